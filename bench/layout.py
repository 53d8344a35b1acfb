#!/usr/bin/env python3
"""Benchmark: planning a layout from one HostView, as the host grows.

Builds simulated hosts of 1, 4 and 16 (``--gpus``) A40 boards on the classic
mdev path, each holding two layout vGPUs under best effort, and a layout that
wants an equal-share scheduler on every GPU (per GPU: remove the two vGPUs,
set the scheduler, create them again with their UUIDs: four steps).  Then times, interleaved and
RUNS times each, in this process:

  observe     :func:`vgpuhost.observe.hostview.observe` scoped to the layout
              (one sysfs scan, the store's records, NVML facts per GPU)
  plan        :func:`vgpuhost.plan.layout.plan` over that view (pure)
  scan        one :func:`vgpuhost.observe.inventory.discover` (the sysfs scan alone)

and prints medians, the plan's share of a plan-from-scratch, and
``observe / (scan x GPUs)``: what one snapshot costs against the one-scan-per-GPU
a planner that reads while it walks would pay (below 1 means the snapshot is
cheaper; it falls as GPUs are added).  No root needed.

    .venv/bin/python bench/layout.py [--runs 7] [--gpus 1,4,16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from benchutil import a40_spec_yaml, timed

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUT = """
version: 1
layouts:
  bench:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu:
          types: {A40-8Q: 2}
        scheduler: {policy: equal-share, timeslice_ms: 3}
"""


def spec_yaml(gpus: int) -> str:
    return a40_spec_yaml(gpus, "bench-layout")


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="timed runs of each (default 7, at least 5)")
    ap.add_argument("--gpus", default="1,4,16", help="host sizes, comma-separated (default 1,4,16; at most 31)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.gpus.split(",")]
    if args.runs < 5 or not all(1 <= n <= 31 for n in sizes):
        ap.error("--runs at least 5, GPUs 1..31")

    from vgpuhost.io.state import StateStore
    from vgpuhost.io.sysfs import Sysfs
    from vgpuhost.observe.hostview import observe
    from vgpuhost.observe.inventory import discover
    from vgpuhost.ops import layout as ops_layout
    from vgpuhost.plan import layout as planner
    from vgpuhost.policy.config import parse
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.spec import parse_spec

    cfg = parse(LAYOUT, "bench.yaml")
    gpus_of, nvml = planner.scope(cfg, None)
    print(f"{'GPUs':>5}  {'observe ms':>10}  {'plan ms':>8}  {'scan ms':>8}  {'plan/total':>10}  "
          f"{'observe/(scan x GPUs)':>21}")
    with tempfile.TemporaryDirectory(prefix="vgpuhost-bench-") as tmp:
        for n in sizes:
            host = materialise(parse_spec(spec_yaml(n)), Path(tmp) / f"h{n}")
            store = StateStore(host.state_dir)
            ops_layout.apply(host, store, parse(LAYOUT.replace("equal-share, timeslice_ms: 3", "best-effort"),
                                                "bench.yaml"), actor="bench")
            times: Dict[str, List[float]] = {"observe": [], "plan": [], "scan": []}
            view = observe(host, store, gpus=gpus_of, nvml=nvml)
            expected = planner.plan(cfg, None, view)
            assert len(expected.steps) == 4 * n, expected.text()
            for _ in range(args.runs):
                times["observe"].append(timed(lambda: observe(host, store, gpus=gpus_of, nvml=nvml)))
                times["plan"].append(timed(lambda: planner.plan(cfg, None, view)))
                times["scan"].append(timed(lambda: discover(Sysfs(host))))
            med = {k: statistics.median(v) * 1000 for k, v in times.items()}
            print(f"{n:>5}  {med['observe']:>10.1f}  {med['plan']:>8.2f}  {med['scan']:>8.1f}  "
                  f"{med['plan'] / (med['plan'] + med['observe']):>10.3f}  "
                  f"{med['observe'] / (med['scan'] * n):>21.2f}")
            store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
