#!/usr/bin/env python3
"""Read-only NVML probe: what the driver reports about every GPU, as JSON.

Reports, per GPU (selected by PCI bus id after enumeration): name, UUID, PCI
ids, MIG mode (current/pending), GPU-instance profiles with their possible
placements and remaining capacity, existing GPU instances (and their vGPU
scheduler state), vGPU host mode, virtualization mode, heterogeneous
(mixed-size) mode, vGPU scheduler capabilities and state, supported and
creatable vGPU types (name, class, framebuffer, max instances, GI profile id)
and running vGPU instances (UUID, type, framebuffer usage).  A call that
fails is recorded in place as ``{"error": "NVMLError_NotSupported", "call": ...}``.

It ONLY reads: every NVML function goes through a reader that refuses any
name with a mutating verb (Set, Create, Destroy, Reset, Clear, Enable, ...),
and tests/test_nvml_real.py checks this file and the probe code for such
names.  Safe to run on a production host; run it unchanged on a real GPU host:

    python bench/nvml_probe.py [--out FILE] [--gpu 0000:41:00.0 ...]

Exits 0 with JSON on stdout (or in FILE), 2 with one line on stderr when NVML
is unavailable (no driver, no nvidia-ml-py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vgpuhost.model.errors import VgpuhostError  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Read-only NVML probe (JSON).")
    ap.add_argument("--out", metavar="FILE", help="write the JSON here instead of stdout")
    ap.add_argument("--gpu", metavar="BDF", action="append",
                    help="only this GPU (dddd:bb:ss.f); repeatable; default every GPU NVML sees")
    args = ap.parse_args(argv)
    try:
        from vgpuhost.io.nvml_pynvml import PynvmlBackend, probe, system_facts
        from vgpuhost.model.values import PciAddress
        gpus = [PciAddress.parse(g) for g in args.gpu] if args.gpu else None
        backend = PynvmlBackend.open()
        report = {"probe": "vgpuhost bench/nvml_probe.py (read-only)", **system_facts(backend),
                  "devices": probe(backend, gpus)}
    except VgpuhostError as e:
        print(f"nvml_probe: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    text = json.dumps(report, indent=2, sort_keys=False, default=str) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"nvml_probe: wrote {args.out} ({len(report['devices'])} GPU(s))", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
