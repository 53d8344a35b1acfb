"""The vGPUs of a host: sysfs joined with vgpuhost's records.

Owns: :class:`VgpuEntry` and :func:`list_vgpus`, the join of an inventory's
mdevs and vendor-VFIO vGPUs with the state store's records (who created
each, and which recorded ones are missing).  Must not: read anything itself
(it is given an inventory and records) or decide what to do about a vGPU.
Lean on purpose (no dataclasses or typing at import): the qemu hook path
reaches it through :mod:`vgpuhost.ops.vgpu`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from ..model.kinds import VgpuState
from ..model.records import VgpuRecord
from ..model.values import record
from .inventory import BACKEND_MDEV, BACKEND_VENDOR_VFIO, Inventory

#: a vGPU's state in :class:`VgpuEntry`: on the host and recorded with its type; recorded,
#: not on the host; on the host, not created by vgpuhost; on the host with another type; recorded,
#: its removal pending (given by the caller: the open journal entries)
VGPU_STATES = (VgpuState.ACTIVE, VgpuState.MISSING, VgpuState.FOREIGN, VgpuState.MISMATCHED, VgpuState.REMOVING)


@record(frozen=True)
class VgpuEntry:
    """One vGPU: on the host, recorded by vgpuhost, or both.

    ``id``: mdev UUID or vendor-VFIO VF BDF; ``gpu``: its GPU's BDF (None: the
    parent is no known GPU); ``parent``: the PF or VF it sits on; ``type_name``:
    as recorded (state active) or as the GPU lists the type; ``owner``: None when
    vgpuhost did not create it; ``state``: one of :data:`VGPU_STATES`.
    """

    id: str
    gpu: Optional[str]
    parent: str
    type_id: str
    type_name: Optional[str]
    backend: str
    owner: Optional[str]       # None: not created by vgpuhost
    state: str                 # active | missing (recorded, not on the host) | foreign | mismatched | removing

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def list_vgpus(inv: Inventory, records: Sequence[VgpuRecord], removing: "frozenset" = frozenset()
               ) -> List[VgpuEntry]:
    """Every vGPU on the host joined with the records, plus recorded ones that are missing;
    sorted by (gpu, parent, id).  ``removing``: the recorded ids whose removal is pending (open
    ``vgpu-remove`` journal entries, :func:`vgpuhost.ops.vgpu.removal_pending`): state ``removing``
    instead of ``active`` or ``missing``."""
    by_id = {r.id: r for r in records}
    names = {(t.gpu, t.type_id): t.name for t in inv.vgpu_types}
    parent_gpu = {p: g.address for g in inv.gpus for p in g.mdev_parents}
    out: List[VgpuEntry] = []
    seen = set()
    for m in inv.mdevs:
        g = parent_gpu.get(m.parent)
        r = by_id.get(m.uuid)
        seen.add(m.uuid)
        state = (VgpuState.FOREIGN if r is None else
                 VgpuState.ACTIVE if r.type_id == m.type_id else VgpuState.MISMATCHED)
        out.append(VgpuEntry(m.uuid, str(g) if g else None, str(m.parent), m.type_id,
                             r.type_name if state == VgpuState.ACTIVE else names.get((g, m.type_id)), BACKEND_MDEV,
                             r.owner if r else None, state))
    for v in inv.vf_vgpus:
        if not v.type_id:
            continue
        r = by_id.get(str(v.vf))
        seen.add(str(v.vf))
        state = (VgpuState.FOREIGN if r is None else
                 VgpuState.ACTIVE if r.type_id == v.type_id else VgpuState.MISMATCHED)
        out.append(VgpuEntry(str(v.vf), str(v.gpu), str(v.vf), v.type_id,
                             r.type_name if state == VgpuState.ACTIVE else names.get((v.gpu, v.type_id)),
                             BACKEND_VENDOR_VFIO, r.owner if r else None, state))
    for r in records:
        if r.id not in seen:
            out.append(VgpuEntry(r.id, r.gpu, r.parent, r.type_id, r.type_name, r.backend, r.owner, VgpuState.MISSING))
    if removing:
        out = [VgpuEntry(e.id, e.gpu, e.parent, e.type_id, e.type_name, e.backend, e.owner, VgpuState.REMOVING)
               if e.id in removing and e.owner is not None and e.state in (VgpuState.ACTIVE, VgpuState.MISSING)
               else e for e in out]
    return sorted(out, key=lambda e: (e.gpu or "", e.parent, e.id))


def _type_key(name: Optional[str]) -> str:
    """A vGPU type name as compared: without the ``NVIDIA ``/``GRID `` prefix, case-folded."""
    t = (name or "").strip()
    for prefix in ("NVIDIA ", "GRID "):
        if t.upper().startswith(prefix):
            t = t[len(prefix):]
    return t.casefold()


def match_vgpu_record(records: Sequence[VgpuRecord], *, gpu: str, device: str, vm_id: str,
                      type_name: str) -> Optional[VgpuRecord]:
    """The record of a vGPU NVML reports as active, or None.

    ``device``: the mdev UUID NVML gives ('' for none: a caller passes '' for an empty or all-zero
    one, :func:`vgpuhost.model.nvml.no_mdev_uuid`); ``gpu``: its GPU's BDF (``0000:41:00.0``);
    ``vm_id``: NVML's VM id; ``type_name``: its type (``L40S-24Q``, with or without ``NVIDIA``).
    With an mdev UUID the record is the one of that id.  Without one (a vendor-specific VFIO
    vGPU: a real ``nvidia-smi vgpu -q`` of driver 580 shows the libvirt domain UUID as VM UUID and
    no MDEV UUID, tests/data/real/nvidia-smi/README.md) it is the one record on that GPU, of that
    type, owned by that domain (NVIDIA allows one vGPU per VM per GPU); none when no record or more
    than one fits.
    """
    if device:
        return next((r for r in records if r.id == device), None)
    vm = (vm_id or "").strip().lower()
    if not vm:
        return None
    want = _type_key(type_name)
    fits = [r for r in records if str(r.gpu) == gpu and (r.owner or "").lower() == vm and _type_key(r.type_name) == want]
    return fits[0] if len(fits) == 1 else None


__all__ = ["VgpuEntry", "list_vgpus", "VGPU_STATES", "match_vgpu_record"]
