#!/usr/bin/env python3
"""Benchmark: how types, plan, apply and the qemu hook's prepare grow with the host.

Builds simulated hosts of 1, 2, 4, 8 and 16 (``--gpus``) A40 boards on the
classic mdev path and a layout of ``--per-gpu`` (default 12) A40-4Q vGPUs on
every GPU, then times, in this process, ``--runs`` rounds interleaved (each
round runs every operation on every size, so a busy machine weighs on all
sizes alike; medians):

  types   ``vgpuhost --json types`` through the CLI's ``main`` (stdout captured)
  plan    :func:`vgpuhost.ops.layout.plan` of the layout on the empty host
  apply   :func:`vgpuhost.ops.layout.apply` of it, on a fresh copy of the empty host
          (the copy is made outside the timed region)
  hook    the qemu hook's ``prepare begin`` (:func:`vgpuhost.hook.runtime.main`) of a
          domain with one A40-4Q vGPU, on the empty host; its ``release end`` runs
          after, untimed, and both must exit 0

The simulated kernel's own time (``vgpuhost.sim``: SimKernel writes, SimNvml
calls, whatever they call) is measured separately by wrapping the simulator's
entry points, and subtracted in the ``own`` columns: a real kernel and NVML
have costs of their own, which these figures do not model.  Then prints, for
each operation, the growth exponent ``k`` of ``time ~ GPUs^k`` (least squares
on log-log, over all sizes; targets of issue 17: <= 1.1) and apply's cost per
vGPU at the largest size against the smallest (target <= 1.5).  Nothing is
asserted on time.  No root needed.

    .venv/bin/python bench/scale.py [--runs 3] [--gpus 1,2,4,8,16] [--per-gpu 12] [--ops types,plan,apply,hook]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from benchutil import a40_spec_yaml, exponent

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROFILE = "A40-4Q"
DOMAIN_UUID = "5f0c8a3e-1b2d-4c6e-8f70-9a1b2c3d4e5f"
MDEV_UUID = "0b9e2f5c-7d1a-4e3b-9c8d-6f5a4b3c2d1e"
OPS = ("types", "plan", "apply", "hook")


def spec_yaml(gpus: int) -> str:
    """A host of ``gpus`` A40s on classic mdev, each behind its own root port."""
    return a40_spec_yaml(gpus, "bench-scale")


def layout_yaml(per_gpu: int) -> str:
    return ("version: 1\nlayouts:\n  bench:\n    gpus:\n      - select: {board: A40}\n        mode: vgpu\n"
            f"        vgpu:\n          types: {{{PROFILE}: {per_gpu}}}\n")


def domain_xml() -> bytes:
    """A live domain document with one vGPU, as libvirt passes it to the hook."""
    from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
    meta = Metadata(vgpus=[VgpuRequest(PROFILE, uuid=MDEV_UUID)])
    dev = (f"<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'><source>"
           f"<address uuid='{MDEV_UUID}'/></source></hostdev>")
    return (f"<domain type='kvm' id='7'>\n  <name>bench-vm</name>\n  <uuid>{DOMAIN_UUID}</uuid>\n"
            f"  <metadata>\n{meta.to_xml()}  </metadata>\n  <memory unit='KiB'>65536</memory>\n"
            f"  <os><type arch='x86_64' machine='pc'>hvm</type></os>\n  <devices>\n    {dev}\n"
            f"  </devices>\n</domain>\n").encode()


# ---------------------------------------------------------------------------
# the simulated kernel's own time

class SimClock:
    """Wraps the simulator's entry points; ``seconds`` is the time spent inside them (outermost calls only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._undo: List[Tuple[type, str, object]] = []

    def _wrap(self, cls: type, name: str) -> None:
        fn = cls.__dict__[name]
        clock = self

        def timed_call(*args, **kwargs):
            if clock._depth:
                return fn(*args, **kwargs)
            clock._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0
                clock._depth -= 1

        setattr(cls, name, timed_call)
        self._undo.append((cls, name, fn))

    def install(self) -> "SimClock":
        from vgpuhost.sim.kernel import SimKernel
        from vgpuhost.sim.nvml import SimNvml
        self._wrap(SimKernel, "__init__")
        self._wrap(SimKernel, "write")
        self._wrap(SimKernel, "meta")
        self._wrap(SimKernel, "refresh_gpu")
        self._wrap(SimNvml, "__init__")
        for name, fn in list(SimNvml.__dict__.items()):
            if callable(fn) and not name.startswith("_"):
                self._wrap(SimNvml, name)
        try:
            from vgpuhost.sim.metering import SimMetering
            self._wrap(SimMetering, "__init__")
            for name, fn in list(SimMetering.__dict__.items()):
                if callable(fn) and not name.startswith("_"):
                    self._wrap(SimMetering, name)
        except ImportError:
            pass
        return self

    def uninstall(self) -> None:
        for cls, name, fn in reversed(self._undo):
            setattr(cls, name, fn)
        self._undo.clear()


def measure(clock: SimClock, fn: Callable[[], object]) -> Tuple[float, float]:
    """(wall seconds, of which inside the simulator) for one call of ``fn``."""
    s0 = clock.seconds
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    return wall, clock.seconds - s0


# ---------------------------------------------------------------------------

def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each operation per size (default 3)")
    ap.add_argument("--gpus", default="1,2,4,8,16", help="host sizes, comma-separated (default 1,2,4,8,16; <= 31)")
    ap.add_argument("--per-gpu", type=int, default=12, help="layout vGPUs per GPU (default 12, 1..12)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"operations to time (default {','.join(OPS)})")
    ap.add_argument("--tmpdir", default=None, help="where to build the hosts (default: the system's)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.gpus.split(",")]
    except ValueError:
        ap.error("--gpus takes numbers, e.g. 1,2,4")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if args.runs < 1 or not all(1 <= n <= 31 for n in sizes) or not 1 <= args.per_gpu <= 12:
        ap.error("--runs at least 1, GPUs 1..31, --per-gpu 1..12")
    if any(o not in OPS for o in ops):
        ap.error(f"--ops: choose from {', '.join(OPS)}")

    from vgpuhost.cli.main import main as cli_main
    from vgpuhost.hook.runtime import main as hook_main
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.io.state import StateStore
    from vgpuhost.ops import layout as ops_layout
    from vgpuhost.policy.config import parse
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.spec import parse_spec

    cfg = parse(layout_yaml(args.per_gpu), "bench.yaml")
    xml = domain_xml()
    clock = SimClock().install()
    print(f"host: N x A40 (classic mdev); layout: {args.per_gpu} x {PROFILE} per GPU; {args.runs} run(s) each; "
          "times in ms (median); sim = inside vgpuhost.sim; own = total - sim")
    base = Path(tempfile.mkdtemp(prefix="vgpuhost-scale-", dir=args.tmpdir))
    pristine = {n: base / f"h{n}" for n in sizes}
    # {op: {size: [(wall s, sim s)]}}, and the note of each (op, size)
    samples: Dict[str, Dict[int, List[Tuple[float, float]]]] = {o: {n: [] for n in sizes} for o in ops}
    notes: Dict[Tuple[str, int], str] = {}

    def fresh(n: int, tag: str) -> HostRoot:
        dst = base / f"h{n}-{tag}"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(pristine[n], dst, symlinks=True)
        return HostRoot(dst)

    def once(op: str, n: int) -> Tuple[Tuple[float, float], str]:
        """One timed run of ``op`` on the host of ``n`` GPUs: ((wall s, sim s), note)."""
        if op == "types":
            host = HostRoot(pristine[n])
            buf = io.StringIO()

            def call() -> None:
                with contextlib.redirect_stdout(buf):
                    code = cli_main(["--root", str(host.root), "--json", "types"])
                if code != 0:
                    raise SystemExit(f"bench: types exited {code}")
            return measure(clock, call), ""
        if op == "plan":
            host = HostRoot(pristine[n])
            store = StateStore(host.state_dir)
            box = {}
            got = measure(clock, lambda: box.setdefault("p", ops_layout.plan(host, store, cfg)))
            store.close()
            return got, f"{len(box['p'].steps)} steps"
        if op == "apply":
            host = fresh(n, "apply")
            store = StateStore(host.state_dir)
            box = {}
            got = measure(clock, lambda: box.setdefault("r", ops_layout.apply(host, store, cfg, actor="bench")))
            made = len(store.vgpu_records())
            store.close()
            if made != n * args.per_gpu or box["r"].drift_after:
                raise SystemExit(f"bench: apply made {made} vGPUs, expected {n * args.per_gpu}")
            return got, f"{made} vGPUs"
        host = fresh(n, "hook")
        err = io.StringIO()
        got = measure(clock, lambda: _hook(hook_main, host, xml, "prepare", "begin", err))
        made = (host.mdev_devices / MDEV_UUID).exists()
        _hook(hook_main, host, xml, "release", "end", err)
        if not made or (host.mdev_devices / MDEV_UUID).exists():
            raise SystemExit(f"bench: the hook did not make and remove the vGPU: {err.getvalue()}")
        return got, "prepare begin, one vGPU"

    try:
        for n in sizes:
            materialise(parse_spec(spec_yaml(n)), pristine[n])
        for op in ops:
            once(op, sizes[0])          # warm-up, untimed: imports, caches, the page cache
        for r in range(args.runs):      # interleaved: every size and operation in each round
            for n in sizes:
                for op in ops:
                    got, notes[(op, n)] = once(op, n)
                    samples[op][n].append(got)
            print(f"  round {r + 1} of {args.runs} done", file=sys.stderr, flush=True)
    finally:
        clock.uninstall()
        shutil.rmtree(base, ignore_errors=True)

    # {op: {size: (median wall s, median sim s, median own s)}}
    print(f"{'GPUs':>4}  {'op':<6} {'total':>9} {'sim':>9} {'own':>9}  note")
    results: Dict[str, Dict[int, Tuple[float, float, float]]] = {o: {} for o in ops}
    for n in sizes:
        for op in ops:
            got = samples[op][n]
            wall = statistics.median(w for w, _ in got)
            sim = statistics.median(x for _, x in got)
            own = statistics.median(w - x for w, x in got)
            results[op][n] = (wall, sim, own)
            print(f"{n:>4}  {op:<6} {wall * 1e3:>9.1f} {sim * 1e3:>9.1f} {own * 1e3:>9.1f}  {notes[(op, n)]}")

    print()
    print(f"{'op':<6} {'k total':>8} {'k own':>8}   growth exponent: time ~ GPUs^k over {','.join(map(str, sizes))} "
          "(target <= 1.1)")
    for op in ops:
        got = [n for n in sizes if n in results[op]]
        if len(got) < 2:
            continue
        tot = exponent(got, [results[op][n][0] for n in got])
        own = exponent(got, [results[op][n][2] for n in got])
        print(f"{op:<6} {tot:>8.2f} {own:>8.2f}")
    if "apply" in ops and len(sizes) >= 2:
        lo, hi = min(sizes), max(sizes)
        per = {n: (results["apply"][n][0] / (n * args.per_gpu), results["apply"][n][2] / (n * args.per_gpu))
               for n in (lo, hi)}
        print()
        print(f"apply per vGPU: {lo} GPU(s) {per[lo][0] * 1e3:.1f} ms (own {per[lo][1] * 1e3:.1f}), "
              f"{hi} GPUs {per[hi][0] * 1e3:.1f} ms (own {per[hi][1] * 1e3:.1f})")
        print(f"apply per vGPU, {hi} GPUs / {lo}: total {per[hi][0] / per[lo][0]:.2f}, "
              f"own {per[hi][1] / per[lo][1]:.2f}   (target <= 1.5)")
    return 0


def _hook(hook_main, host, xml: bytes, op: str, sub: str, err: io.StringIO) -> None:
    code = hook_main(["bench-vm", op, sub, "-"], io.BytesIO(xml), stderr=err, host=host)
    if code != 0:
        raise SystemExit(f"bench: hook {op} {sub} exited {code}: {err.getvalue().strip()[:300]}")


if __name__ == "__main__":
    sys.exit(main())
