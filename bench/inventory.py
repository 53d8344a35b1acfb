#!/usr/bin/env python3
"""Benchmark: ``vgpuhost types --json`` against ``mdevctl types --dumpjson``.

Builds a simulated host of GPUS x VFS mdev parents (L40S boards with SR-IOV
on the classic mdev path, one GPU per bus behind its own root port), then
times, interleaved and RUNS times each:

  vgpuhost    ``python -m vgpuhost --root DIR --json types`` (a new interpreter each run)
  mdevctl     ``mdevctl types --dumpjson`` inside ``unshare -m`` with DIR/sys bind-mounted
              over the sysfs mount point (namespace-private; see tests/nsutil.py)
  ns-wrapper  the same ``unshare ... sh -c`` wrapper, bind mounts included, running ``true``
  in-process  ``discover()`` + ``aggregate_types()`` + JSON rendering in this process
              (no interpreter start-up)

and prints medians, the namespace overhead and the ratios.  Needs root (the
private mount namespace) and mdevctl; exits 2 otherwise.

    sudo .venv/bin/python bench/inventory.py [--runs 7] [--gpus 8] [--vfs 32]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List

from benchutil import run, timed

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))   # nsutil: the namespace wrapper the parity test uses

MODEL = "L40S"        # catalog: sriov totalvfs 32, 21 vGPU types
MAX_VFS = 32
MAX_GPUS = 31         # one root port per slot of bus 00 (slots 01..1f)


def spec_yaml(gpus: int, vfs: int) -> str:
    lines = [
        "version: 1",
        f"name: bench-{gpus}x{vfs}",
        f"summary: {gpus} {MODEL} GPUs x {vfs} SR-IOV VFs on the mdev path (benchmark)",
        "host:",
        "  cmdline: BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet intel_iommu=on iommu=pt",
        "  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]",
        "devices:",
    ]
    for i in range(gpus):
        port = f"0000:00:{i + 1:02x}.0"
        gpu = f"0000:{0x41 + i:02x}:00.0"
        numa = i * 2 // gpus
        lines.append(f'  - {{bdf: "{port}", model: intel-root-port, numa_node: {numa}}}')
        lines.append(f'  - {{bdf: "{gpu}", model: {MODEL}, upstream: "{port}", numa_node: {numa}, '
                     f"vgpu: {{backend: mdev, sriov_numvfs: {vfs}}}}}")
    return "\n".join(lines) + "\n"


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="timed runs of each command (default 7, at least 5)")
    ap.add_argument("--gpus", type=int, default=8, help=f"GPUs (default 8, at most {MAX_GPUS})")
    ap.add_argument("--vfs", type=int, default=32,
                    help=f"VFs per GPU, each an mdev parent (default 32, at most {MAX_VFS})")
    args = ap.parse_args(argv)
    if args.runs < 5:
        ap.error("--runs must be at least 5")
    if not 1 <= args.gpus <= MAX_GPUS:
        ap.error(f"--gpus must be 1..{MAX_GPUS}")
    if not 1 <= args.vfs <= MAX_VFS:
        ap.error(f"--vfs must be 1..{MAX_VFS} ({MODEL} sriov_totalvfs)")

    import nsutil
    if os.geteuid() != 0:
        print("bench/inventory.py must run as root: mdevctl is pointed at the simulated host through a "
              "bind mount in a private mount namespace (unshare -m).  Try: "
              f"sudo {shlex.join([sys.executable] + sys.argv)}", file=sys.stderr)
        return 2
    reason = nsutil.unavailable_reason()
    if reason is not None:
        print(f"bench/inventory.py cannot run mdevctl here: {reason}", file=sys.stderr)
        return 2

    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.observe.inventory import discover
    from vgpuhost.cli.output import aggregate_types, dumps, types_doc
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.spec import parse_spec
    from vgpuhost.io.sysfs import Sysfs

    tmp = tempfile.mkdtemp(prefix="vgpuhost-bench-")
    try:
        root = Path(tmp) / "host"
        t_build = timed(lambda: materialise(parse_spec(spec_yaml(args.gpus, args.vfs), source="<bench>"), root))
        nsutil.prepare_root(root)
        mdevctl = nsutil.mdevctl_path()
        true = shutil.which("true") or "/bin/true"
        cmds: Dict[str, List[str]] = {
            "vgpuhost": [sys.executable, "-m", "vgpuhost", "--root", str(root), "--json", "types"],
            "mdevctl": nsutil.ns_argv(root, [mdevctl, "types", "--dumpjson"]),
            "ns-wrapper": nsutil.ns_argv(root, [true]),
        }
        host = HostRoot(root)

        def in_process() -> str:
            inv = discover(Sysfs(host))
            return dumps(types_doc(aggregate_types(inv.vgpu_types)))

        jobs: Dict[str, Callable[[], object]] = {name: (lambda a=a: run(a)) for name, a in cmds.items()}
        jobs["in-process"] = in_process

        # warm-up (page cache, .pyc) and a sanity check that both read the simulated tree
        import json
        ours = json.loads(run(cmds["vgpuhost"]))
        theirs = nsutil.parse_types(run(cmds["mdevctl"]))
        our_pairs = sum(len(e["parents"]) for e in ours["types"])
        their_pairs = sum(len(t) for t in theirs.values())
        parents = args.gpus * args.vfs
        if len(theirs) != parents or our_pairs != their_pairs:
            raise SystemExit(f"bench: views differ: mdevctl {len(theirs)} parents / {their_pairs} "
                             f"(parent, type) pairs, vgpuhost {our_pairs} pairs, expected {parents} parents")
        in_process()
        run(cmds["ns-wrapper"])

        times: Dict[str, List[float]] = {name: [] for name in jobs}
        names = list(jobs)
        for i in range(args.runs):
            order = names[i % len(names):] + names[:i % len(names)]   # rotate: no fixed position bias
            for name in order:
                times[name].append(timed(jobs[name]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {n: statistics.median(t) for n, t in times.items()}
    mdev_net = med["mdevctl"] - med["ns-wrapper"]
    ms = lambda s: f"{s * 1000:8.1f}"   # noqa: E731

    print(f"command: {shlex.join([sys.executable] + sys.argv)}")
    print(f"host: {args.gpus} x {MODEL}, {args.vfs} VFs each = {parents} mdev parents, "
          f"{their_pairs} (parent, type) pairs; built in {t_build:.2f} s; {args.runs} interleaved runs each")
    print("measured:")
    for n in ("vgpuhost", "mdevctl", "ns-wrapper"):
        print(f"  {n:<11} {shlex.join(cmds[n])}")
    print("  in-process  discover(Sysfs(HostRoot(DIR))) + aggregate_types() + dumps(types_doc())")
    print()
    print(f"{'WHAT':<34}{'MEDIAN ms':>10}{'MIN ms':>10}{'MAX ms':>10}")
    rows = [
        ("vgpuhost CLI (python -m vgpuhost)", "vgpuhost"),
        ("mdevctl in ns wrapper", "mdevctl"),
        ("ns wrapper alone (true)", "ns-wrapper"),
        ("vgpuhost in-process", "in-process"),
    ]
    for label, n in rows:
        print(f"{label:<34}{ms(med[n]):>10}{ms(min(times[n])):>10}{ms(max(times[n])):>10}")
    print(f"{'mdevctl net (wrapper subtracted)':<34}{ms(mdev_net):>10}")
    print()
    print(f"ratio vgpuhost CLI / mdevctl (both as run)       {med['vgpuhost'] / med['mdevctl']:6.2f}")
    if mdev_net > 0:
        print(f"ratio vgpuhost CLI / mdevctl net                 {med['vgpuhost'] / mdev_net:6.2f}")
        print(f"ratio vgpuhost in-process / mdevctl net          {med['in-process'] / mdev_net:6.2f}")
    else:
        print("mdevctl net <= 0: the namespace overhead dominates; ratios against it are meaningless")
    print(f"ratio vgpuhost in-process / mdevctl (as run)     {med['in-process'] / med['mdevctl']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
