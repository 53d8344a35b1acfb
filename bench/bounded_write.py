#!/usr/bin/env python3
"""Benchmark: a bounded write (``Sysfs.write_bounded``, an mdev remove) by a fork per write or by a resident writer.

On a simulated ``a40-mdev`` host, each remove preceded by a create (not timed), two cases:

  one-shot    a fresh process per write, one remove each (the qemu hook's case, agent down): the
              process's CPU and its children's (every writer reaped before the process ends), from
              just before the write to after it, less the simulator's CPU (its time file); the
              resident writer is started for the write and ended after it
  long-lived  one process holding BALLAST MB of Python objects (the agent's heap is about 100 MB),
              RUNS removes in a row (the agent's case): per write, the caller's CPU (its process
              clock), the writer's (a forked child's, reaped at once: this process's children's
              time; the resident writer's: ``/proc/PID/schedstat``, nanoseconds), both less the
              simulator's CPU charged to that process

Medians over RUNS (the one-shot case: RUNS processes per way, interleaved).  Nothing is asserted.

    .venv/bin/python bench/bounded_write.py [--runs 15] [--ballast-mb 100] [--tmpdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

A40 = "0000:81:00.0"
A40_8Q = "nvidia-566"
TIME_ENV = "VGPUHOST_SIM_TIME_FILE"


def _uuid(i: int) -> str:
    return f"aaaaaaaa-2222-4333-8444-{i:012x}"


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _sim_cpu(path: str) -> dict:
    """{pid: simulator CPU seconds} from the time file (then emptied)."""
    out: dict = {}
    with open(path) as f:
        for line in f:
            w, c, pid = line.split()
            out[int(pid)] = out.get(int(pid), 0.0) + float(c)
    open(path, "w").close()
    return out


def _schedstat(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def one(way: str, root: str, uuid: str, simtime: str) -> dict:
    """One process's one write (the one-shot case); its figures."""
    from vgpuhost.io import sysfs
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.io.residentwriter import Writers
    host = HostRoot(root)
    fs = sysfs.Sysfs(host)
    fs.write(host.mdev_bus / A40 / "mdev_supported_types" / A40_8Q / "create", uuid)
    _sim_cpu(simtime)
    c0 = time.process_time() + _children_cpu()
    pool = None
    if way == "resident":
        pool = Writers()
        sysfs.set_bounded_writer(pool.write)
    assert fs.write_bounded(str(host.mdev_devices / uuid / "remove"), "1", 20.0)
    if pool is not None:
        w = pool._idle.pop()
        w.proc.stdin.close()
        w.proc.stdout.close()
        w.proc.wait()
    cpu = time.process_time() + _children_cpu() - c0
    return {"cpu": cpu, "sim": sum(_sim_cpu(simtime).values())}


def long_lived(way: str, root: str, simtime: str, runs: int, ballast_mb: int) -> dict:
    """RUNS writes in this process, holding ``ballast_mb`` MB of objects; per-write medians (ms)."""
    from vgpuhost.io import sysfs
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.io.residentwriter import Writers
    ballast = [list(range(64)) for _ in range(ballast_mb * 1024 * 1024 // 1100)]   # ~1.1 kB a list
    host = HostRoot(root)
    pool = None
    if way == "resident":
        pool = Writers()
        sysfs.set_bounded_writer(pool.write)
        pool.start_spare()
    caller, writer = [], []
    for i in range(runs + 1):
        fs = sysfs.Sysfs(host)
        uuid = _uuid(1000 + i)
        fs.write(host.mdev_bus / A40 / "mdev_supported_types" / A40_8Q / "create", uuid)
        pid = pool.idle_pids()[0] if pool is not None else None
        _sim_cpu(simtime)
        c0, k0 = time.process_time(), _children_cpu()
        w0 = _schedstat(pid) if pid else 0.0
        assert fs.write_bounded(str(host.mdev_devices / uuid / "remove"), "1", 20.0)
        c1, k1 = time.process_time(), _children_cpu()
        w1 = _schedstat(pid) if pid else 0.0
        sims = _sim_cpu(simtime)
        own_sim = sims.pop(os.getpid(), 0.0)
        if i:                       # the first: the writer's first write (its simulator's import)
            caller.append(c1 - c0 - own_sim)
            writer.append((k1 - k0) + (w1 - w0) - sum(sims.values()))
    if pool is not None:
        pool.close()
    del ballast
    return {"caller": statistics.median(caller) * 1000, "writer": statistics.fmean(writer) * 1000}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--ballast-mb", type=int, default=100)
    ap.add_argument("--tmpdir", metavar="DIR")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)        # WAY ROOT UUID SIMTIME (a child)
    ap.add_argument("--long", nargs=2, help=argparse.SUPPRESS)       # WAY ROOT (a child)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(*args.one)))
        return 0
    simtime_env = os.environ.get(TIME_ENV)
    if args.long:
        print(json.dumps(long_lived(args.long[0], args.long[1], simtime_env, args.runs, args.ballast_mb)))
        return 0
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.data import bundled_specs
    from vgpuhost.sim.spec import load_spec
    tmp = tempfile.mkdtemp(prefix="vgpuhost-bench-bw-", dir=args.tmpdir)
    try:
        host = materialise(load_spec(bundled_specs()["a40-mdev"]), os.path.join(tmp, "host"))
        simtime = os.path.join(tmp, "simtime")
        open(simtime, "w").close()
        env = dict(os.environ, **{TIME_ENV: simtime})
        me = [sys.executable, str(Path(__file__).resolve())]
        shots: dict = {"fork": [], "resident": []}
        for i in range(args.runs):
            for way in shots:
                out = subprocess.run(me + ["--one", way, str(host.root), _uuid(i), simtime], env=env,
                                     capture_output=True, text=True, check=True)
                shots[way].append(json.loads(out.stdout))
        longs = {}
        for way in ("fork", "resident"):
            out = subprocess.run(me + ["--runs", str(args.runs), "--ballast-mb", str(args.ballast_mb), "--long", way,
                                       str(host.root)], env=env, capture_output=True, text=True, check=True)
            longs[way] = json.loads(out.stdout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"command: {' '.join([sys.executable] + sys.argv)}")
    print(f"a40-mdev, one remove per write; {args.runs} runs; load average {os.getloadavg()[0]:.2f}")
    print("one-shot (a process per write: its CPU + its writer's, less the simulator's), ms, median:")
    for way, xs in shots.items():
        print(f"  {way:<9} {statistics.median(x['cpu'] - x['sim'] for x in xs) * 1000:8.2f}"
              f"   (with the simulator's: {statistics.median(x['cpu'] for x in xs) * 1000:.2f})")
    print(f"long-lived (one process of about {args.ballast_mb} MB more, a write after another), ms per write:")
    for way, d in longs.items():
        print(f"  {way:<9} caller {d['caller']:7.3f} (median)   writer {d['writer']:7.3f} (mean; less the simulator's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
