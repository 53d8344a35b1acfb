"""The inventory documents the CLI and the agent both serve: ``vgpuhost.gpus/v1`` and ``vgpuhost.types/v1``.

Owns: turning inventory values into the documented JSON shapes
(docs/reference/json.md).  Must not: read the host, decide anything, or
render text (the CLI's tables stay in :mod:`vgpuhost.cli.output`).
"""

from __future__ import annotations

from ..observe.inventory import Gpu, Inventory, VgpuType, free_instances

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only: `vgpuhost types` does not import typing
    from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

SCHEMA_GPUS = "vgpuhost.gpus/v1"
SCHEMA_TYPES = "vgpuhost.types/v1"


def gpu_doc(inv: Inventory, gpu: Gpu) -> Dict[str, Any]:
    d = gpu.pci
    group = inv.group_of(gpu.address)
    ix = inv.on_gpu(gpu.address)
    present = list(ix.vgpus) if ix is not None else []
    return {
        "address": str(gpu.address),
        "model": gpu.model,
        "model_known": gpu.model_known,
        "board": gpu.board,
        "vendor_id": f"{d.vendor:04x}",
        "device_id": f"{d.device:04x}",
        "subsystem_id": f"{d.subsystem_vendor:04x}:{d.subsystem_device:04x}",
        "class": f"0x{d.pci_class:06x}",
        "driver": d.driver,
        "driver_override": d.driver_override,
        "numa_node": d.numa_node,
        "boot_vga": d.boot_vga,
        "reset_methods": list(d.reset_methods),
        "iommu_group": d.iommu_group,
        "group_members": [str(m) for m in group.members] if group else [],
        "companions": [str(c) for c in gpu.companions],
        "backends": list(gpu.backends),
        "vgpu_backend": gpu.vgpu_backend,
        "sriov": {"totalvfs": d.sriov_totalvfs, "numvfs": d.sriov_numvfs, "vfs": [str(v) for v in gpu.vfs]},
        "mdev_parents": [str(p) for p in gpu.mdev_parents],
        "vgpus": sorted(present),
        "mig": dict(gpu.mig) if gpu.mig is not None else None,
        "vmd": str(gpu.vmd) if gpu.vmd is not None else None,
        "unreadable": [{"device": str(u.device), "attribute": u.attribute, "errno": u.errno_name,
                        "reason": u.reason} for u in gpu.unreadable],
    }


def gpus_doc(inv: Inventory) -> Dict[str, Any]:
    return {"schema": SCHEMA_GPUS, "iommu_enabled": inv.iommu_enabled,
            "gpus": [gpu_doc(inv, g) for g in inv.gpus]}


def aggregate_types(types: Iterable[VgpuType], inv: Optional[Inventory] = None,
                    limits_of: Optional[Callable[[str], Mapping[Any, int]]] = None) -> List[Dict[str, Any]]:
    """One entry per (GPU, type id) with per-parent availability, in sysfs order.

    With ``inv``, ``available_instances`` is what
    :func:`vgpuhost.observe.inventory.free_instances` counts (0 on a GPU not on
    ``nvidia``; on SR-IOV GPUs the per-VF ones sum to more than the GPU holds),
    capped by ``limits_of(name)``'s max for the GPU's vGPU mode where given
    (:func:`vgpuhost.ops.vgpu.limits_lookup`: mixed-size maxima, as placement
    counts them); the per-parent counts stay the kernel's, except on a GPU out of service
    (``inv.out_of_service``: unhealthy or cordoned), where they read 0 as the type's count does.
    """
    # GPU -> type id -> entry.  The rows come a parent at a time, a GPU's parents together (an 8 x 32 VF
    # host: 3,072 rows): the GPU's map and the parent's text are looked up once per run of rows
    by_gpu: Dict[Any, Dict[str, Dict[str, Any]]] = {}
    gpu = parent = entries = parent_text = None
    for t in types:
        if t.gpu is not gpu:
            gpu = t.gpu
            entries = by_gpu.setdefault(gpu, {})
        if t.parent is not parent:
            parent = t.parent
            parent_text = str(parent)
        e = entries.get(t.type_id)
        if e is None:
            e = entries[t.type_id] = _type_fields(t)
        elif not e["name"] and t.name:      # a VF that names a type another VF left nameless
            e.update({k: v for k, v in _type_fields(t).items() if k not in ("available_instances", "parents")})
        n = t.available_instances
        e["available_instances"] += n
        e["parents"].append({"parent": parent_text, "available_instances": n})
    if inv is not None:
        for gpu, entries in by_gpu.items():
            for tid, e in entries.items():
                limit = limits_of(e["name"]).get(gpu) if limits_of is not None and e["name"] else None
                e["available_instances"] = free_instances(inv, gpu, tid, limit=limit)[0]
                if gpu in inv.out_of_service:           # nothing is offered there: the parents agree
                    e["parents"] = [dict(p, available_instances=0) for p in e["parents"]]
    return sorted((e for entries in by_gpu.values() for e in entries.values()),
                  key=lambda e: (e["gpu"], _type_sort(e["type_id"])))


def _type_fields(t: VgpuType) -> Dict[str, Any]:
    """A new ``types`` entry for ``t``: the fields the type gives, its counts at zero."""
    p = t.profile
    return {"gpu": str(t.gpu), "backend": t.backend, "type_id": t.type_id, "name": t.name,
            "raw_name": t.raw_name,
            "series": p.series if p else None, "board": p.board if p else None,
            "framebuffer_mib": t.framebuffer_mib,
            "gi_slices": p.gi_slices if p else None,
            "media_extensions": p.media_extensions if p else False,
            "max_instances": t.max_instances, "available_instances": 0,
            "device_api": t.device_api, "description": dict(t.description), "parents": []}


def _type_sort(type_id: str) -> tuple:
    tail = type_id.rsplit("-", 1)[-1]
    from ..model.values import is_digits
    return (0, int(tail), type_id) if is_digits(tail) else (1, 0, type_id)


def types_doc(entries: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"schema": SCHEMA_TYPES, "types": entries}
