#!/usr/bin/env python3
"""Read-only NVML probe: what the driver reports about every GPU, as JSON.

Reports, per GPU (selected by PCI bus id after enumeration): name, UUID, PCI
ids, MIG mode (current/pending), GPU-instance profiles with their possible
placements and remaining capacity, existing GPU instances (and their vGPU
scheduler state), vGPU host mode, virtualization mode, heterogeneous
(mixed-size) mode, vGPU scheduler capabilities and state, supported and
creatable vGPU types (name, class, framebuffer, max instances, GI profile id)
and running vGPU instances (UUID, type, framebuffer usage), the GI profile ids
(``gi_profile_ids``: nvmlDeviceGetGpuInstanceProfileInfo(V) for each profile
index), and the metering calls (``metering``: the ``nvmlValueType_t`` each
utilisation call reports, and nvmlGpmQueryDeviceSupport).  A call that
fails is recorded in place as ``{"error": "NVMLError_NotSupported", "call": ...}``.

It also prints :data:`CHECKLIST`, what is still unverified on real hardware
(kept in docs/reference/hardware.md#unverified-on-hardware): the JSON carries
it as ``checklist``, and ``--checklist`` prints it alone, without NVML.

It ONLY reads: every NVML function goes through a reader that refuses any
name with a mutating verb (Set, Create, Destroy, Reset, Clear, Enable, ...),
and tests/test_nvml_real.py checks this file and the probe code for such
names.  Safe to run on a production host; run it unchanged on a real GPU host:

    python bench/nvml_probe.py [--out FILE] [--gpu 0000:41:00.0 ...] [--checklist]

Exits 0 with JSON on stdout (or in FILE), 2 with one line on stderr when NVML
is unavailable (no driver, no nvidia-ml-py): "NVML is not available: ...".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vgpuhost.model.errors import VgpuhostError  # noqa: E402

#: what vgpuhost still takes on trust, not from a real GPU host: each line names the fact and
#: what in this probe's JSON (or on the host) settles it
CHECKLIST = (
    "GI profile ids of each board (H200: 19/20/15/14/9/5/0): devices[].gi_profile_ids",
    "GI memory below the profile name (H200 1g.18gb = 16.00 GiB): devices[].gi_profiles[].memorySizeMB",
    "utilisation sample type of nvmlDeviceGetVgpuInstancesUtilizationInfo and nvmlDeviceGetVgpuUtilization: "
    "devices[].metering (sample_value_type)",
    "GPM support (Hopper and newer): devices[].metering.nvmlGpmQueryDeviceSupport",
    "GPM on a MIG-backed vGPU that owns its whole GPU instance, and none on a smaller one: "
    "vgpuhost_gpu_instance_sm_utilization_ratio with a running VM",
    "whether the per-vGPU utilisation calls return rows for MIG-backed vGPUs: devices[].metering samples "
    "with a MIG-backed VM running",
    "mdev UUID NVML reports for a vendor-VFIO vGPU (empty, all zeros or NOT_SUPPORTED), and the VM id "
    "(the domain UUID): nvmlVgpuInstanceGetMdevUUID / nvmlVgpuInstanceGetVmID with a VM running",
    "framebuffer usage above 4 GiB read through the 64-bit C call: devices[].active_vgpus[].fb_usage_bytes",
    "scheduler timeslice unit (ns) from the capabilities: devices[].scheduler_capabilities",
    "no vGPU scheduler in MIG mode before Blackwell: devices[].gpu_instances[].scheduler_state on A100/H100/H200",
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Read-only NVML probe (JSON).")
    ap.add_argument("--out", metavar="FILE", help="write the JSON here instead of stdout")
    ap.add_argument("--gpu", metavar="BDF", action="append",
                    help="only this GPU (dddd:bb:ss.f); repeatable; default every GPU NVML sees")
    ap.add_argument("--checklist", action="store_true",
                    help="print what is still unverified on real hardware, and exit (needs no NVML)")
    args = ap.parse_args(argv)
    if args.checklist:
        sys.stdout.write("".join(f"- {item}\n" for item in CHECKLIST))
        return 0
    try:
        from vgpuhost.io.nvml_pynvml import PynvmlBackend, probe, system_facts
        from vgpuhost.model.values import PciAddress
        gpus = [PciAddress.parse(g) for g in args.gpu] if args.gpu else None
        backend = PynvmlBackend.open()
        report = {"probe": "vgpuhost bench/nvml_probe.py (read-only)", **system_facts(backend),
                  "devices": probe(backend, gpus), "checklist": list(CHECKLIST)}
    except VgpuhostError as e:
        print(f"nvml_probe: {e.one_line()} (no NVML: nothing probed; --checklist lists what is unverified)",
              file=sys.stderr)
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
