"""The inventory documents the CLI and the agent both serve: ``vgpuhost.gpus/v1`` and ``vgpuhost.types/v1``.

Owns: turning inventory values into the documented JSON shapes
(docs/reference/json.md), and :func:`types_listing`, the one builder of the
types document that ``vgpuhost types`` (:mod:`vgpuhost.cli.lean`) and the
agent's ``GET /v1/types`` both call, so AVAIL cannot differ between them.
Must not: read the host itself (what AVAIL needs beyond the inventory, the
vGPU-mode cap and MIG on demand, it asks of ``ops/``, imported where used:
a lean ``types`` start pays for them only on a host that needs them),
decide anything, or render tables (they stay in :mod:`vgpuhost.cli.output`).
"""

from __future__ import annotations

from ..observe.inventory import Gpu, Inventory, VgpuType, free_instances

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only: `vgpuhost types` does not import typing
    from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

SCHEMA_GPUS = "vgpuhost.gpus/v1"
SCHEMA_TYPES = "vgpuhost.types/v1"
#: :data:`vgpuhost.ops.migdemand.HINT_FILE` and :data:`~vgpuhost.ops.migdemand.ON`, spelt here too: a lean
#: ``types`` does not import that module on a host where no GPU may be opted in (tests hold them equal)
ON_DEMAND_HINT = "mig-on-demand"
ON_DEMAND_PREFIX = "mig.on-demand/"


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


def types_listing(host, inv: Inventory, gpu=None, *, available: bool = False,
                  store=None) -> Tuple[Dict[str, Any], List[str]]:
    """``(document, notes)`` of ``vgpuhost types`` and ``GET /v1/types``: the ``vgpuhost.types/v1`` document
    of ``inv``'s vGPU types (``gpu``, a PciAddress: that GPU's alone; ``available``: only types with a free
    instance), and the notes the CLI prints under its table, one line each (a parent that could not be
    read, a GPU out of service, the MIG-backed types whose AVAIL counts GPU instances a start would make).

    ``inv`` leaves the GPUs out of service out of what is free (:func:`vgpuhost.ops.health.in_service`).
    AVAIL is what placement counts:

    - on a GPU opted in to MIG on demand (the state store's ``mig.on-demand/<BDF>``), the GPU instances a
      start would make (:func:`vgpuhost.ops.migdemand.makeable`).  The store is read only while its hint
      file (:data:`vgpuhost.ops.migdemand.HINT_FILE`) says a GPU may be opted in and a GPU has a VF or an
      mdev parent: ``store`` when the caller holds it open (the agent), else opened here;
    - on a vendor-VFIO GPU, capped by the max in the GPU's vGPU mode (mixed-size: what still fits at free
      placement ids), as :func:`vgpuhost.ops.vgpu.limits_lookup` counts it.

    Besides ``inv`` both read NVML (the GPUs' vGPU mode; MIG mode and GPU instances of an opted-in GPU),
    the catalog, the placement ids of the VFs holding vGPUs and the store's opt-ins: vgpuhost's own
    changes of those are audited in the store or change a VF's type, so a cache of the answer keys on
    the inventory's devices and the store's change counter (the agent's, :meth:`vgpuhost.agent.api.Agent.cached`).
    Raises HostEnvironmentError (:class:`~vgpuhost.io.state.StateStore`) when the store, read only while a GPU
    may be opted in, cannot be opened.
    """
    made_note: List[str] = []
    from ..io.files import exists
    # (the state directory as text: HostRoot.state_dir is a Path, and pathlib imports re, enum, urllib)
    if any(g.vfs or g.mdev_parents for g in inv.gpus) \
            and exists(f"{host.s.state_dir}/{ON_DEMAND_HINT}"):
        if store is None:
            from ..io.state import StateStore
            store = StateStore(host.state_dir, create=False)
        if store.settings_under(ON_DEMAND_PREFIX):
            from ..ops.migdemand import makeable
            before = {(t.parent, t.name.lower()) for t in inv.vgpu_types if t.available_instances}
            inv = makeable(host, store, inv)
            made: Dict[str, List[str]] = {}
            for t in inv.vgpu_types:
                if t.available_instances and (t.parent, t.name.lower()) not in before \
                        and t.name not in made.setdefault(str(t.gpu), []):
                    made[str(t.gpu)].append(t.name)
            made_note = [f"{g}: MIG on demand: AVAIL of {', '.join(n)} counts the GPU instances a start "
                         "would make" for g, n in sorted(made.items()) if n and (gpu is None or g == str(gpu))]
    limits_of = None
    from ..observe.inventory import BACKEND_VENDOR_VFIO
    if any(g.vfs and g.vgpu_backend == BACKEND_VENDOR_VFIO for g in inv.gpus):
        # vendor VFIO lists a type on every free VF: the max in the GPU's mode (mixed-size: often lower)
        # caps AVAIL, as placement counts it; NVML and the catalog only on such a host
        from ..ops.vgpu import limits_lookup
        limits_of = limits_lookup(host, inv)
    entries = aggregate_types(inv.vgpu_types if gpu is None else (t for t in inv.vgpu_types if t.gpu == gpu), inv,
                              limits_of)
    if available:
        entries = [e for e in entries if e["available_instances"] > 0]
    notes = [f"{g.address}: unreadable {u.describe()}" for g in inv.gpus if gpu is None or g.address == gpu
             for u in g.unreadable]        # its types are unknown, not absent
    notes += [f"{g}: out of service ({why}): none available" for g, why in sorted(inv.out_of_service.items())
              if gpu is None or g == gpu]       # unhealthy or cordoned (docs/guide/failures.md)
    return types_doc(entries), notes + made_note
