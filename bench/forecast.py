#!/usr/bin/env python3
"""Benchmark: forecast error on held-out weeks of a simulated history, beside a baseline.

A simulated A40 host runs WEEKS weeks (default 6) of hourly sampler ticks
(the real :class:`~vgpuhost.ops.metering.Sampler` over the simulator's clock
and NVML), seeded:

- tenant ``office``: two vGPUs always allocated, busy in working hours on
  weekdays (SM 70-90 %), idle at night (5 %) and at weekends (2 %);
- tenant ``batch``: one vGPU always, and one more made every Monday 00:00
  and removed every Friday 00:00, SM load growing week by week.

For each series ``vgpuhost forecast`` projects (per tenant and pool,
allocated and busy), the method of :mod:`vgpuhost.policy.forecast` is fitted
on the history before the last HELD weeks (default 1, then 2) and scored
on them (WAPE: sum of absolute errors / sum of actual use), beside the
baseline "the week before repeated".

    .venv/bin/python bench/forecast.py [--weeks 6] [--seed 32] [--tmpdir DIR]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vgpuhost.cli.main import main  # noqa: E402
from vgpuhost.io import state as st  # noqa: E402
from vgpuhost.io.backends import metering_nvml  # noqa: E402
from vgpuhost.io.state import StateStore  # noqa: E402
from vgpuhost.ops.metering import MeteredOwner, Sampler, gpu_pools  # noqa: E402
from vgpuhost.policy import forecast as fc  # noqa: E402
from vgpuhost.sim.build import materialise  # noqa: E402
from vgpuhost.sim.data import bundled_specs  # noqa: E402
from vgpuhost.sim.spec import load_spec  # noqa: E402

START = datetime(2026, 10, 5, tzinfo=timezone.utc).timestamp()        # a Monday


def _quiet(*argv) -> None:
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main(list(argv))
    if rc != 0:
        raise SystemExit(f"vgpuhost {' '.join(argv)}: exit {rc}")


def office_steps(weeks: int, rnd: random.Random):
    steps = []
    for d in range(weeks * 7):
        if d % 7 < 5:
            steps += [[d * 86400, 5], [d * 86400 + 9 * 3600, rnd.randrange(70, 91)], [d * 86400 + 18 * 3600, 5]]
        else:
            steps.append([d * 86400, 2])
    return steps


def batch_steps(weeks: int, rnd: random.Random):
    return [[d * 86400, min(100, 30 + 4 * (d // 7) + rnd.randrange(0, 10))] for d in range(weeks * 7)]


def build(root: Path, weeks: int, seed: int) -> StateStore:
    host = materialise(load_spec(bundled_specs()["a40-mdev"]), root)
    r = ["--root", str(host.root)]
    rnd = random.Random(seed)
    doms = {"office": ["0ff1ce00-0000-4000-8000-00000000000%d" % i for i in (1, 2)],
            "batch": ["ba7c0000-0000-4000-8000-00000000000%d" % i for i in (1, 2)]}
    tenant_of = {d: t for t, ds in doms.items() for d in ds}
    store = StateStore(host.state_dir)
    nv = metering_nvml(host)
    nv.freeze(START)
    traces = {doms["office"][0]: office_steps(weeks, rnd), doms["office"][1]: office_steps(weeks, rnd),
              doms["batch"][0]: batch_steps(weeks, rnd), doms["batch"][1]: batch_steps(weeks, rnd)}

    def create(dom):
        _quiet(*r, "vgpu", "create", "--profile", "A40-8Q", "--owner", dom)
        rec = next(x for x in store.vgpu_records() if x.owner == dom)
        nv.set_trace(rec.id, {"sm": {"steps": traces[dom]}, "start": START, "vm": dom, "fb_mib": 4000})
        return rec.id

    for dom in (doms["office"][0], doms["office"][1], doms["batch"][0]):
        create(dom)
    extra = None
    s = Sampler(nv, store, interval_s=3600, labels=lambda u: MeteredOwner(u, "", tenant_of.get(u, ""), ""))
    for h in range(weeks * 168 + 1):
        how = h % 168
        if how == 0 and extra is None:
            extra = create(doms["batch"][1])
        s.tick()
        if how == 4 * 24 and extra is not None:
            _quiet(*r, "vgpu", "remove", extra)
            extra = None
        if h < weeks * 168:
            nv.advance(3600)
    return store


def main_(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weeks", type=int, default=6, help="weeks of simulated history (at least 3)")
    ap.add_argument("--seed", type=int, default=32)
    ap.add_argument("--tmpdir", help="where to build the simulated host (removed afterwards)")
    a = ap.parse_args(argv)
    if a.weeks < 3:
        ap.error("--weeks must be at least 3")
    root = Path(tempfile.mkdtemp(prefix="vgpuhost-forecast-", dir=a.tmpdir))
    try:
        t0 = time.perf_counter()
        store = build(root / "host", a.weeks, a.seed)
        took = time.perf_counter() - t0
        hours = a.weeks * 168
        origin = datetime.fromtimestamp(START, timezone.utc)
        data = fc.series(st.usage_rows(store), origin, hours, pools=gpu_pools(store))
        print(f"forecast error on held-out weeks: {a.weeks} weeks of hourly rollups written by the sampler "
              f"({hours} ticks, {took:.1f} s), seed {a.seed}")
        print(f"{'SERIES':40} {'HELD':>4} {'METHOD-WAPE':>12} {'BASELINE-WAPE':>14}")
        for held in (1, 2):
            for (scope, name, measure), y in sorted(data.items()):
                ho = fc.held_out(y, held)
                if ho is None:
                    continue
                f = lambda v: "-" if v is None else f"{v * 100:.1f}%"
                print(f"{scope + ' ' + (name or '(none)') + ' ' + measure:40} {held:>4} {f(ho.error):>12} "
                      f"{f(ho.baseline):>14}")
        print("WAPE: sum of absolute hourly errors / sum of metered use; baseline: the week before repeated")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main_())
