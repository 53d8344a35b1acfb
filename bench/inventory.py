#!/usr/bin/env python3
"""Benchmark: ``vgpuhost types --json`` against ``mdevctl types --dumpjson``.

Builds three simulated hosts of GPUS x VFS boards (one GPU per bus behind
its own root port): L40S with the VFs on the classic mdev path (each VF an
mdev parent, what mdevctl reads), the same on NVIDIA's vendor-specific VFIO
interface (vGPU 17+, no mdev bus: mdevctl has nothing to read there), and
A100-PCIE-40GB on classic mdev (the catalog's ``sriov_totalvfs`` of 20,
marked unconfirmed there, raised to VFS for this tree: :func:`a100_catalog`).
Then times, interleaved and RUNS times each:

  vgpuhost       ``vgpuhost --root DIR --json types``, the console script (a new
                 interpreter each run), on the L40S mdev host
  vgpuhost-a100  the same on the A100 host
  vgpuhost-vfio  the same on the vendor-VFIO host
  gpus           ``vgpuhost --root DIR --json gpus`` on the L40S mdev host
  mdevctl        ``mdevctl types --dumpjson`` inside ``unshare -m`` with DIR/sys
                 bind-mounted over the sysfs mount point (namespace-private; see
                 tests/nsutil.py), on the L40S mdev host
  mdevctl-a100   the same on the A100 host
  ns-wrapper     the same ``unshare ... sh -c`` wrapper, bind mounts included,
                 running ``true``
  python -I      ``python3 -I -c pass``: a clean interpreter start, outside the venv
  python -I -S   the same without ``site``
  in-process     the whole command in this process: ``vgpuhost.cli.main.main``
                 with the same arguments (parsing, discovery, capacity, rendering;
                 stdout captured), on the mdev host

and prints medians, the namespace overhead and the ratios.  The simulator's
own time is measured apart: inside the in-process row by wrapping the
simulator's entry points (bench/scale.py's SimClock), and for the CLI by
listing the ``vgpuhost.sim`` modules a run imports (a read of sysfs files goes
to the files; only writes and NVML calls go through the simulator).  The
package's bytecode is compiled first, as an installed package's is.  Needs
root (the private mount namespace) and mdevctl; exits 2 otherwise.  Nothing
is asserted on time.

    sudo .venv/bin/python bench/inventory.py [--runs 11] [--gpus 8] [--vfs 32]

Target (issue 31): ``types --json`` / ``mdevctl types --dumpjson`` <= 0.5 on both trees.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List

from benchutil import precompile, run, timed

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))   # nsutil: the namespace wrapper the parity test uses

MODEL = "L40S"        # catalog: sriov totalvfs 32, 21 vGPU types
A100 = "A100-PCIE-40GB"     # catalog: 12 vGPU types on classic mdev (sriov totalvfs 20, "unconfirmed")
MAX_VFS = 32
MAX_GPUS = 31         # one root port per slot of bus 00 (slots 01..1f)


def a100_catalog(vfs: int):
    """The shipped catalog with the A100's ``sriov_totalvfs`` raised to ``vfs`` (when above its 20): the
    bench's A100 tree of 8 x 32 VFs on classic mdev, each VF an mdev parent offering the A100's types."""
    import dataclasses
    from vgpuhost.sim.catalog import load_catalog
    cat = dataclasses.replace(load_catalog(), gpus=dict(load_catalog().gpus))     # the loader's is shared
    m = cat.gpus[A100]
    if vfs > m.sriov_totalvfs:
        cat.gpus[A100] = dataclasses.replace(m, sriov_totalvfs=vfs)
    return cat


def spec_yaml(gpus: int, vfs: int, backend: str = "mdev", model: str = MODEL) -> str:
    lines = [
        "version: 1",
        f"name: bench-{model.lower()}-{gpus}x{vfs}-{backend}",
        f"summary: {gpus} {model} GPUs x {vfs} SR-IOV VFs on the {backend} path (benchmark)",
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
        lines.append(f'  - {{bdf: "{gpu}", model: {model}, upstream: "{port}", numa_node: {numa}, '
                     f"vgpu: {{backend: {backend}, sriov_numvfs: {vfs}}}}}")
    return "\n".join(lines) + "\n"


def clean_python() -> str:
    """The interpreter behind this venv (``sys.base_prefix``), for a start outside it."""
    for name in (f"python{sys.version_info[0]}.{sys.version_info[1]}", "python3"):
        path = Path(sys.base_prefix) / "bin" / name
        if path.exists():
            return str(path)
    return sys.executable


def sim_modules_imported(argv: List[str]) -> List[str]:
    """The ``vgpuhost.sim`` modules a run of ``argv`` imports (``-X importtime``)."""
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    return sorted({line.split("|")[-1].strip() for line in proc.stderr.splitlines()
                   if line.startswith("import time:") and "vgpuhost.sim" in line})


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=11, help="timed runs of each command (default 11, at least 5)")
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

    from scale import SimClock       # bench/scale.py: the simulator's own time
    from vgpuhost.cli.main import main as vgpuhost_main
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.spec import parse_spec

    # bytecode as an installed package has it (PYTHONDONTWRITEBYTECODE would leave every run compiling)
    precompile(REPO / "vgpuhost")

    script = Path(sys.executable).parent / "vgpuhost"
    console = [str(script)] if script.exists() else [sys.executable, "-m", "vgpuhost"]
    tmp = tempfile.mkdtemp(prefix="vgpuhost-bench-")
    try:
        root = Path(tmp) / "host"
        vfio = Path(tmp) / "host-vfio"
        a100 = Path(tmp) / "host-a100"
        t_build = timed(lambda: materialise(parse_spec(spec_yaml(args.gpus, args.vfs), source="<bench>"), root))
        materialise(parse_spec(spec_yaml(args.gpus, args.vfs, "vendor-vfio"), source="<bench>"), vfio)
        cat = a100_catalog(args.vfs)
        materialise(parse_spec(spec_yaml(args.gpus, args.vfs, "mdev", A100), source="<bench>", catalog=cat), a100,
                    catalog=cat)
        nsutil.prepare_root(root)
        nsutil.prepare_root(a100)
        mdevctl = nsutil.mdevctl_path()
        true = shutil.which("true") or "/bin/true"
        cmds: Dict[str, List[str]] = {
            "vgpuhost": console + ["--root", str(root), "--json", "types"],
            "vgpuhost-a100": console + ["--root", str(a100), "--json", "types"],
            "vgpuhost-vfio": console + ["--root", str(vfio), "--json", "types"],
            "gpus": console + ["--root", str(root), "--json", "gpus"],
            "mdevctl": nsutil.ns_argv(root, [mdevctl, "types", "--dumpjson"]),
            "mdevctl-a100": nsutil.ns_argv(a100, [mdevctl, "types", "--dumpjson"]),
            "ns-wrapper": nsutil.ns_argv(root, [true]),
            "python -I": [clean_python(), "-I", "-c", "pass"],
            "python -I -S": [clean_python(), "-I", "-S", "-c", "pass"],
        }
        clock = SimClock().install()
        sim_in_process: List[float] = []

        def in_process() -> str:
            buf = io.StringIO()
            s0 = clock.seconds
            with contextlib.redirect_stdout(buf):
                code = vgpuhost_main(["--root", str(root), "--json", "types"])
            sim_in_process.append(clock.seconds - s0)
            if code != 0:
                raise SystemExit(f"bench: in-process vgpuhost types exited {code}")
            return buf.getvalue()

        jobs: Dict[str, Callable[[], object]] = {name: (lambda a=a: run(a)) for name, a in cmds.items()}
        jobs["in-process"] = in_process

        # warm-up (page cache) and a sanity check that both read each simulated tree
        import json
        parents = args.gpus * args.vfs
        pairs: Dict[str, int] = {}
        for ours_cmd, theirs_cmd in (("vgpuhost", "mdevctl"), ("vgpuhost-a100", "mdevctl-a100")):
            ours = json.loads(run(cmds[ours_cmd]))
            theirs = nsutil.parse_types(run(cmds[theirs_cmd]))
            our_pairs = sum(len(e["parents"]) for e in ours["types"])
            their_pairs = sum(len(t) for t in theirs.values())
            if len(theirs) != parents or our_pairs != their_pairs:
                raise SystemExit(f"bench: views differ ({ours_cmd}): mdevctl {len(theirs)} parents / {their_pairs} "
                                 f"(parent, type) pairs, vgpuhost {our_pairs} pairs, expected {parents} parents")
            pairs[ours_cmd] = their_pairs
        vfio_doc = json.loads(run(cmds["vgpuhost-vfio"]))
        vfio_pairs = sum(len(e["parents"]) for e in vfio_doc["types"])
        if in_process() != run(cmds["vgpuhost"]):
            raise SystemExit("bench: the in-process output differs from the CLI's")
        run(cmds["ns-wrapper"])
        run(cmds["gpus"])
        sim_cli = sim_modules_imported(cmds["vgpuhost"])
        sim_in_process.clear()

        times: Dict[str, List[float]] = {name: [] for name in jobs}
        cpus: Dict[str, List[float]] = {name: [] for name in jobs}
        names = list(jobs)
        for i in range(args.runs):
            order = names[i % len(names):] + names[:i % len(names)]   # rotate: no fixed position bias
            for name in order:
                c0 = _cpu(name == "in-process")
                times[name].append(timed(jobs[name]))
                cpus[name].append(_cpu(name == "in-process") - c0)
        clock.uninstall()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {n: statistics.median(t) for n, t in times.items()}
    cmed = {n: statistics.median(t) for n, t in cpus.items()}
    ms = lambda s: f"{s * 1000:8.1f}"   # noqa: E731

    print(f"command: {shlex.join([sys.executable] + sys.argv)}")
    print(f"L40S host: {args.gpus} x {MODEL}, {args.vfs} VFs each = {parents} mdev parents, "
          f"{pairs['vgpuhost']} (parent, type) pairs; built in {t_build:.2f} s; {args.runs} interleaved runs each")
    print(f"A100 host: {args.gpus} x {A100} on classic mdev, {args.vfs} VFs each = {parents} mdev parents, "
          f"{pairs['vgpuhost-a100']} (parent, type) pairs (the catalog's sriov_totalvfs raised to {args.vfs})")
    print(f"vendor-VFIO host: the L40S GPUs and VFs, {vfio_pairs} (VF, type) pairs; no mdev bus, so mdevctl "
          "reads nothing there: its yardstick is mdevctl on the L40S mdev host")
    print("measured:")
    for n in cmds:
        print(f"  {n:<14} {shlex.join(cmds[n])}")
    print("  in-process     vgpuhost.cli.main.main(['--root', DIR, '--json', 'types']) (stdout captured, L40S)")
    print()
    print("CPU ms: the run's user + system time (a child's, waited for, its own children included; the "
          "in-process row's own), which the machine's other load moves less than the wall clock")
    print(f"{'WHAT':<44}{'MEDIAN ms':>10}{'MIN ms':>10}{'MAX ms':>10}{'CPU ms':>10}")
    rows = [
        ("vgpuhost types, L40S (console script)", "vgpuhost"),
        ("vgpuhost types, A100", "vgpuhost-a100"),
        ("vgpuhost types, L40S vendor-VFIO host", "vgpuhost-vfio"),
        ("vgpuhost gpus, L40S", "gpus"),
        ("mdevctl types in ns wrapper, L40S", "mdevctl"),
        ("mdevctl types in ns wrapper, A100", "mdevctl-a100"),
        ("ns wrapper alone (true)", "ns-wrapper"),
        ("clean interpreter (python3 -I -c pass)", "python -I"),
        ("clean interpreter (python3 -I -S -c pass)", "python -I -S"),
        ("vgpuhost in-process (main()), L40S", "in-process"),
    ]
    for label, n in rows:
        print(f"{label:<44}{ms(med[n]):>10}{ms(min(times[n])):>10}{ms(max(times[n])):>10}{ms(cmed[n]):>10}")
    print(f"{'  of in-process: inside vgpuhost.sim':<44}{ms(statistics.median(sim_in_process)):>10}")
    print(f"simulator modules the CLI run imports: {', '.join(sim_cli) or 'none'} (sysfs reads go to the files)")
    print()
    print(f"ratio types / mdevctl types, L40S (both as run; target <= 0.5)   {med['vgpuhost'] / med['mdevctl']:6.2f}")
    print(f"ratio types / mdevctl types, A100 (both as run; target <= 0.5)   "
          f"{med['vgpuhost-a100'] / med['mdevctl-a100']:6.2f}")
    print(f"ratio types vendor-VFIO / mdevctl types L40S (as run)           {med['vgpuhost-vfio'] / med['mdevctl']:6.2f}")
    for tree, ours, theirs in (("L40S", "vgpuhost", "mdevctl"), ("A100", "vgpuhost-a100", "mdevctl-a100")):
        net = med[theirs] - med["ns-wrapper"]
        if net > 0:
            print(f"ratio types / mdevctl net of the ns wrapper, {tree}              {med[ours] / net:6.2f}")
    for tree, ours, theirs in (("L40S", "vgpuhost", "mdevctl"), ("A100", "vgpuhost-a100", "mdevctl-a100")):
        net = cmed[theirs] - cmed["ns-wrapper"]
        if net > 0:
            print(f"ratio types / mdevctl in CPU time, net of the ns wrapper's, {tree} {cmed[ours] / net:6.2f}")
    print(f"ratio types L40S / clean interpreter start (-I -S)               {med['vgpuhost'] / med['python -I -S']:6.2f}")
    return 0


def _cpu(own: bool) -> float:
    """Seconds of user + system time: this process's (``own``) or its waited-for children's."""
    import resource
    ru = resource.getrusage(resource.RUSAGE_SELF if own else resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


if __name__ == "__main__":
    sys.exit(main())
