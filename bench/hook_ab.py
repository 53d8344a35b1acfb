#!/usr/bin/env python3
"""Benchmark: ``bench/hook.py``'s ratios for two trees of vgpuhost, side by side in one run.

Each tree (``--before DIR``: a checkout of an earlier commit, e.g. ``git archive COMMIT | tar -x -C DIR``
with the compiled ``vgpuhost/hook/vgpuhost-hook-client`` copied in; ``--after``: this checkout) builds
its simulated hosts and installs its own hook with its own ``bench/hook.py`` (``Bench``: ``hook install``
and the agent run from that tree's package), agent down and agent up.  Then every pair (``prepare
begin`` + ``release end``) of every host and the clean ``python -I -S -c pass`` start run interleaved,
RUNS times each, in one process, and the ratios ``bench/hook.py`` prints are printed per tree:

  down wall   agent down, own (wall - simulator) / the clean start's wall
  down CPU    agent down, hook CPU - simulator CPU / the clean start's CPU (steadier under load)
  up CPU      agent up, hook CPU + agent CPU + writer CPU - simulator CPU / the clean start's CPU

Every call of both trees is measured by this checkout's ``bench/hook.py`` (its ``Bench._dispatch`` and
``medians``), so both are read with one yardstick: since issue 31 round 4 the agent's writer processes' CPU
(a fork of the agent per remove before, a resident writer after) counts, less the simulator's CPU charged
to them.

Nothing is asserted on time; a failed hook run aborts (as in ``bench/hook.py``).

    .venv/bin/python bench/hook_ab.py --before DIR [--after .] [--runs 20]
                                      [--hosts a40-mdev,l40s-vendor-vfio,a100-sriov-mdev,h200-mig]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench_module(tree: Path, tag: str):
    spec = importlib.util.spec_from_file_location(f"hook_{tag}", tree / "bench" / "hook.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, metavar="DIR", help="the earlier tree (with bench/hook.py)")
    ap.add_argument("--after", default=str(REPO), metavar="DIR", help="the later tree (default: this checkout)")
    ap.add_argument("--runs", type=int, default=20, help="interleaved runs of each pair (default 20)")
    ap.add_argument("--hosts", default="a40-mdev,l40s-vendor-vfio,a100-sriov-mdev,h200-mig",
                    help="shipped hosts with a device to make, comma-separated")
    ap.add_argument("--tmpdir", metavar="DIR", help="where the hosts go (default: the system temp dir)")
    args = ap.parse_args(argv)
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    specs = [s.strip() for s in args.hosts.split(",") if s.strip()]
    sys.path.insert(0, str(REPO / "bench"))
    mods = {tag: _bench_module(tree, tag) for tag, tree in trees.items()}
    for tag in trees:       # one yardstick: every call measured as this checkout's bench measures it
        mods[tag].Bench._dispatch = mods["after"].Bench._dispatch
    tmp = Path(tempfile.mkdtemp(prefix="vgpuhost-bench-hook-ab-", dir=args.tmpdir))
    benches = []
    samples: dict = {}
    cwd = os.getcwd()
    try:
        for tag, tree in trees.items():
            os.chdir(tree)              # 'python -m vgpuhost hook install' finds this tree's package first
            (tmp / tag).mkdir()
            for s in specs:
                for agent in (False, True):
                    benches.append((tag, mods[tag].Bench(s, tmp / tag, agent)))
        os.chdir(cwd)
        m = mods["after"]
        clean = [m._clean_interpreter(tmp / "clean-venv"), "-I", "-S", "-c", "pass"]
        jobs = [("clean", None)] + [(f"{tag} {b.label}", b) for tag, b in benches]
        for _, b in jobs:               # warm-up, and a first start/stop that proves each host works
            if b is not None:
                m._pair(b, {})
        for i in range(args.runs):
            for label, b in jobs[i % len(jobs):] + jobs[:i % len(jobs)]:     # rotate: no position bias
                if b is None:
                    samples.setdefault("clean", []).append(m._baseline(clean))
                    continue
                got: dict = {}
                m._pair(b, got)
                for k, v in got.items():
                    samples.setdefault(f"{label} {k.split()[-1]}", []).extend(v)
    finally:
        os.chdir(cwd)
        for _, b in benches:
            b.close()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {n: mods["after"].medians(t) for n, t in samples.items()}
    bw, bc = med["clean"]["wall"], med["clean"]["cpu"]
    print(f"command: {' '.join([sys.executable] + sys.argv)}")
    print(f"before: {trees['before']}; after: {trees['after']}; {args.runs} interleaved runs each; medians")
    print(f"clean python -I -S -c pass: wall {bw * 1000:.1f} ms, CPU {bc * 1000:.1f} ms")
    print(f"{'HOST':<32}{'down wall':>10}{'down CPU':>10}{'up CPU':>10}{'up writer ms':>14}")
    for s in specs:
        for tag in trees:
            d, u = f"{tag} {s}", f"{tag} {s} agent-up"
            own = med[f"{d} prepare"]["own"] + med[f"{d} release"]["own"]
            cpu_d = sum(med[f"{d} {op}"]["cpu"] - med[f"{d} {op}"]["sim_cpu"] for op in ("prepare", "release"))
            cpu_u = sum(med[f"{u} {op}"]["cpu"] + med[f"{u} {op}"]["agent"] + med[f"{u} {op}"]["writer"]
                        - med[f"{u} {op}"]["sim_cpu"] for op in ("prepare", "release"))
            writer = sum(med[f"{u} {op}"]["writer"] for op in ("prepare", "release"))
            print(f"{tag + ' ' + s:<32}{own / bw:>10.2f}{cpu_d / bc:>10.2f}{cpu_u / bc:>10.2f}{writer * 1000:>14.2f}")
    print("targets (issue 31): down <= 5, up <= 2.5")
    print()
    print("agent up, ms of CPU per call (medians; WRITER a mean): client, agent, writer less its simulator CPU, "
          "the agent's simulator CPU")
    print(f"{'HOST':<32}{'prepare: client':>16}{'agent':>7}{'writer':>7}{'sim':>6}"
          f"{'release: client':>17}{'agent':>7}{'writer':>7}{'sim':>6}")
    for s in specs:
        for tag in trees:
            u = f"{tag} {s} agent-up"
            cols = "".join(f"{med[f'{u} {op}'][k] * 1000:>{w}.2f}" for op in ("prepare", "release")
                           for k, w in (("cpu", 16 if op == "prepare" else 17), ("agent", 7), ("writer", 7),
                                        ("sim_cpu", 6)))
            print(f"{tag + ' ' + s:<32}{cols}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
