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
reaped writers'.  ``--resident 0`` shows the GPU's first vGPU coming and going (every type's count moves).  ``--host NAME``: a
shipped simulated host instead (``vgpuhost/sim/hosts/NAME.yaml``), its first GPU with vGPUs, its 4 GB
time-sliced type (else its smallest); on SR-IOV GPUs the resident vGPUs take the first VFs and the timed one
the next; on ``vendor-vfio`` a create sets the VF's ``current_vgpu_type`` and a remove resets it (through
``write_bounded``, as vgpuhost does).

    .venv/bin/python bench/sim_write.py [--gpus 8 | --host NAME] [--resident 4] [--pairs 200] [--tmpdir /dev/shm]

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


def _target(meta: dict, gpu: str) -> tuple:
    """``(backend, type id, parents)`` of simulated GPU ``gpu``: its time-sliced type of 4 GB (else its
    smallest), and the parents a vGPU goes on (the GPU itself, or its VFs)."""
    g = meta["gpus"][gpu]
    sliced = sorted((t for t, d in g["types"].items() if not d.get("gi_profile")),
                    key=lambda t: (g["types"][t]["fb_mib"] != 4096, g["types"][t]["fb_mib"], t))
    return g["backend"], (TYPE_ID if TYPE_ID in g["types"] else sliced[0]), list(g["parents"])


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default=None,
                    help="a shipped simulated host (vgpuhost/sim/hosts/NAME.yaml) instead of --gpus A40s")
    ap.add_argument("--gpus", type=int, default=8, help="A40s on the simulated host (default 8)")
    ap.add_argument("--resident", type=int, default=4, help="vGPUs left on the GPU first (default 4, 0..11)")
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
    from vgpuhost.sim.kernel import SimKernel
    from vgpuhost.sim.spec import parse_spec

    if args.host:
        spec_file = REPO / "vgpuhost" / "sim" / "hosts" / f"{args.host}.yaml"
        if not spec_file.is_file():
            ap.error(f"--host: no {spec_file}")
        spec = spec_file.read_text()
    else:
        spec = a40_spec_yaml(args.gpus, "simwrite")
    base = Path(tempfile.mkdtemp(prefix="vgpuhost-simwrite-", dir=args.tmpdir))
    try:
        materialise(parse_spec(spec), base / "host")
        host = HostRoot(base / "host")
        meta = SimKernel(host).meta()
        gpu = next((g for g in sorted(meta["gpus"]) if meta["gpus"][g]["backend"] in ("mdev", "vendor-vfio")), None)
        if gpu is None:
            raise SystemExit("bench: the host has no GPU with vGPUs")
        backend, tid, parents = _target(meta, gpu)
        sliced_vfs = len(parents) > 1 or parents != [gpu]
        if sliced_vfs and args.resident >= len(parents):
            raise SystemExit(f"bench: --resident {args.resident}: the GPU has {len(parents)} VFs")
        # where the timed vGPU goes: the GPU itself (classic mdev), or the VF after the resident ones
        timed_parent = parents[args.resident] if sliced_vfs else gpu
        sysfs = Sysfs(host)

        def make(parent: str) -> str:
            if backend == "vendor-vfio":
                sysfs.write(host.pci_device(parent) / "nvidia" / "current_vgpu_type", tid.split("-")[-1])
                return parent
            u = str(uuidlib.uuid4())
            sysfs.write(host.pci_device(parent) / "mdev_supported_types" / tid / "create", u)
            return u

        def unmake(vid: str) -> None:
            path = (host.pci_device(vid) / "nvidia" / "current_vgpu_type" if backend == "vendor-vfio"
                    else host.mdev_devices / vid / "remove")
            if not sysfs.write_bounded(path, "0" if backend == "vendor-vfio" else "1", 30.0):
                raise SystemExit("bench: a remove did not return within 30 s")

        for i in range(args.resident):
            make(parents[i] if sliced_vfs else gpu)
        timefile = base / "simtime"
        os.environ[SIM_TIME_ENV] = str(timefile)

        def pair() -> str:
            vid = make(timed_parent)
            unmake(vid)
            return vid

        for _ in range(5):          # warm: the page cache, the simulator's parses
            pair()
        creates: List[tuple] = []
        removes: List[tuple] = []
        cpu0, ch0, t0 = time.process_time(), os.times(), time.perf_counter()
        for _ in range(args.pairs):
            timefile.write_text("")
            vid = pair()
            got = _charges(timefile)
            # the charges of the create's write (this process) and the remove's (the writer), in that order
            if len(got) != 2:
                raise SystemExit(f"bench: expected the simulator's charges of two writes, got {got}")
            creates.append(got[0])
            removes.append(got[1])
            if backend == "mdev" and os.path.lexists(host.mdev_devices / vid):
                raise SystemExit("bench: the vGPU was not removed")
        wall = time.perf_counter() - t0
        ch1 = os.times()
        cpu = time.process_time() - cpu0 + (ch1.children_user + ch1.children_system
                                            - ch0.children_user - ch0.children_system)
        med = lambda xs, i: statistics.median(x[i] for x in xs) * 1000     # noqa: E731
        name = args.host or f"{args.gpus} x A40"
        print(f"simulated {name}: {backend} GPU {gpu}, type {tid}, {args.resident} resident, the timed vGPU on "
              f"{timed_parent}; {args.pairs} pairs (vgpuhost at {REPO})")
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
