#!/usr/bin/env python3
"""Benchmark: what the simulated kernel costs per vGPU create and remove (issue 31, item 5).

Not a test: nothing is asserted on time.  One simulated host of ``--gpus`` (8) A40s on classic mdev (the
host of ``bench/agent_load.py --mode scale``), ``--resident`` (4) A40-4Q vGPUs left on the first GPU (about
what 8 concurrent hook clients keep there), then ``--pairs`` (200) creates and removes of one more A40-4Q
through the product's sysfs door, as the hook and the agent make them: ``Sysfs.write`` of the type's
``create``, ``Sysfs.write_bounded`` of the mdev's ``remove`` (its detached writer, a fork of this process,
runs the simulator's remove).  The simulator charges every write's wall and CPU time to
``$VGPUHOST_SIM_TIME_FILE`` (:mod:`vgpuhost.sim.kernel`, the writer's charge included); printed: the
simulator's CPU and wall per create and per remove (medians), and this process's CPU per pair with its
reaped writers'.  ``--resident 0`` shows the GPU's first vGPU coming and going (every type's count moves).

    .venv/bin/python bench/sim_write.py [--gpus 8] [--resident 4] [--pairs 200] [--tmpdir /dev/shm]

Run it from the tree to measure (``cd TREE && python bench/sim_write.py``): it imports that tree's vgpuhost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

TYPE_ID = "nvidia-564"      # A40-4Q
SIM_TIME_ENV = "VGPUHOST_SIM_TIME_FILE"


def _charges(path: Path) -> List[tuple]:
    with open(path) as f:
        return [tuple(float(x) for x in line.split()) for line in f if line.strip()]


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=8, help="A40s on the simulated host (default 8)")
    ap.add_argument("--resident", type=int, default=4, help="A40-4Q vGPUs left on the first GPU (default 4, 0..11)")
    ap.add_argument("--pairs", type=int, default=200, help="creates + removes timed (default 200)")
    ap.add_argument("--tmpdir", default=None, help="where to build the host (default: the system's)")
    args = ap.parse_args(argv)
    if not 0 <= args.resident <= 11 or args.pairs < 1 or not 1 <= args.gpus <= 31:
        ap.error("--resident 0..11, --pairs at least 1, --gpus 1..31")

    import uuid as uuidlib
    from benchutil import a40_spec_yaml
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.io.sysfs import Sysfs
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.spec import parse_spec

    base = Path(tempfile.mkdtemp(prefix="vgpuhost-simwrite-", dir=args.tmpdir))
    try:
        materialise(parse_spec(a40_spec_yaml(args.gpus, "simwrite")), base / "host")
        host = HostRoot(base / "host")
        gpu = "0000:41:00.0"
        create = host.pci_device(gpu) / "mdev_supported_types" / TYPE_ID / "create"
        sysfs = Sysfs(host)
        for _ in range(args.resident):
            sysfs.write(create, str(uuidlib.uuid4()))
        timefile = base / "simtime"
        os.environ[SIM_TIME_ENV] = str(timefile)

        def pair() -> tuple:
            u = str(uuidlib.uuid4())
            sysfs.write(create, u)
            if not sysfs.write_bounded(host.mdev_devices / u / "remove", "1", 30.0):
                raise SystemExit("bench: a remove did not return within 30 s")
            return u

        for _ in range(5):          # warm: the page cache, the simulator's parses
            pair()
        creates: List[tuple] = []
        removes: List[tuple] = []
        cpu0, ch0, t0 = time.process_time(), os.times(), time.perf_counter()
        for _ in range(args.pairs):
            timefile.write_text("")
            u = pair()
            got = _charges(timefile)
            # the charges of the create's write (this process) and the remove's (the writer), in that order
            if len(got) != 2:
                raise SystemExit(f"bench: expected the simulator's charges of two writes, got {got}")
            creates.append(got[0])
            removes.append(got[1])
            if os.path.lexists(host.mdev_devices / u):
                raise SystemExit("bench: the vGPU was not removed")
        wall = time.perf_counter() - t0
        ch1 = os.times()
        cpu = time.process_time() - cpu0 + (ch1.children_user + ch1.children_system
                                            - ch0.children_user - ch0.children_system)
        med = lambda xs, i: statistics.median(x[i] for x in xs) * 1000     # noqa: E731
        print(f"simulated {args.gpus} x A40, {args.resident} A40-4Q resident on {gpu}, {args.pairs} pairs "
              f"(vgpuhost at {REPO})")
        print(f"  simulator, create: CPU {med(creates, 1):.2f} ms, wall {med(creates, 0):.2f} ms (median)")
        print(f"  simulator, remove (in the detached writer): CPU {med(removes, 1):.2f} ms, "
              f"wall {med(removes, 0):.2f} ms (median)")
        print(f"  whole pair: {wall / args.pairs * 1000:.2f} ms wall, {cpu / args.pairs * 1000:.2f} ms CPU "
              f"(this process and its reaped writers)")
    finally:
        os.environ.pop(SIM_TIME_ENV, None)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
