"""``host check``: the findings and one verdict per mode (passthrough, vGPU, MIG) for each GPU.

Owns: gathering what the pure checks (:mod:`vgpuhost.policy.checks`) need
beyond the inventory: the board catalog's word on vGPU and MIG support, and
NVML's MIG mode, GPU instances and active vGPUs.  NVML that cannot be had
(no driver, no nvidia-ml-py) is reported per GPU, never raised: ``host
check`` runs on hosts that are not ready.  Must not: change the host.
"""

from __future__ import annotations

from typing import AbstractSet, Dict, List, Tuple

from ..io.backends import open_backend
from ..io.catalog import load_catalog
from ..io.hostroot import HostRoot
from ..io.nvml import NvmlError
from ..model.errors import VgpuhostError
from ..model.values import PciAddress
from ..observe.inventory import Inventory
from ..policy.checks import Finding, GpuFacts, ModeVerdict, check_host, mode_verdicts


def gpu_facts(host: HostRoot, inv: Inventory, on_demand: AbstractSet[str] = frozenset()
              ) -> Dict[PciAddress, GpuFacts]:
    """:class:`GpuFacts` for every GPU of ``inv``: the catalog, then NVML (GPUs on nvidia only);
    ``on_demand``: the GPUs (BDF text) opted in to MIG on demand
    (:func:`vgpuhost.ops.migdemand.opted_in`)."""
    models = {m.ids.device: m for m in load_catalog().gpus.values()}
    try:
        backend, nvml_error = open_backend(host), ""
    except VgpuhostError as e:
        backend, nvml_error = None, e.message
    out: Dict[PciAddress, GpuFacts] = {}
    for g in inv.gpus:
        m = models.get(g.pci.device)
        base = dict(vgpu_board=bool(m.vgpu_types) if m is not None else None,
                    mig_capable=m.mig_capable if m is not None else None,
                    mig_on_demand=str(g.address) in on_demand)
        if backend is None or g.pci.driver != "nvidia":
            reason = nvml_error or f"NVML sees only GPUs on the nvidia driver; {g.address} is on " \
                                   f"{g.pci.driver or 'no driver'}"
            out[g.address] = GpuFacts(**base, nvml_error=reason)
            continue
        try:
            mode = backend.mig_mode(g.address)
            gis = len(backend.gpu_instances(g.address)) if mode is not None and mode[0] else 0
            try:
                active = int(backend.active_vgpus(g.address))
            except NvmlError as e:
                if not e.not_supported:
                    raise
                active = 0
        except NvmlError as e:
            out[g.address] = GpuFacts(**base, nvml_error=e.one_line())
            continue
        base["mig_capable"] = mode is not None
        out[g.address] = GpuFacts(**base, mig_on=mode[0] if mode else None, mig_pending=mode[1] if mode else None,
                                  gpu_instances=gis, active_vgpus=active)
    return out


def check(host: HostRoot, inv: Inventory, on_demand: AbstractSet[str] = frozenset()
          ) -> Tuple[List[Finding], List[ModeVerdict]]:
    """``host check``: the findings and the per-GPU mode verdicts (``on_demand``: as for :func:`gpu_facts`).
    On a GPU opted in to MIG on demand with MIG mode on, "no VF offers a vGPU type" (VGPU_NO_TYPES,
    whose fix is to make GPU instances) is no warning: a start makes its GPU instance (info)."""
    facts = gpu_facts(host, inv, on_demand)
    findings = check_host(inv)
    for i, f in enumerate(findings):
        g = next((a for a in facts if str(a) == f.subject), None)
        if f.code == "VGPU_NO_TYPES" and g is not None and facts[g].mig_on_demand and facts[g].mig_on:
            findings[i] = Finding("info", "VGPU_MIG_ON_DEMAND", f.subject,
                                  f"{f.message}: MIG on demand is on, so a start makes the GPU instance of its "
                                  "MIG-backed type ('vgpuhost capacity' counts what fits)")
    return findings, mode_verdicts(inv, facts)
