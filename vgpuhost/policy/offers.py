"""vGPU types, named and offered: profile names as the devices spell them, and placement offers (pure).

Owns: resolving a profile name per device (:func:`resolve_profile`:
case-insensitive, exact, never stripping suffixes), one placement offer per
vGPU-capable GPU (:func:`offers`, for :func:`vgpuhost.policy.placement.place`),
what is present on a GPU, the types a GPU still fits (:func:`fitting_elsewhere`)
and the seen-type rows (:func:`seen_rows`: ``(gpu, type_id, name,
framebuffer_mib)``, the state store's ``seen_types`` row shape).  Inputs are
an :class:`~vgpuhost.observe.inventory.Inventory` and records already read.
Must not: read sysfs or the store, or change anything.  Lean: the qemu hook
imports it.

Facts (the project's docs reference, sections 2-4): a GPU in equal-size
(time-sliced) mode admits only vGPUs of the size already present; a GPU
bound to another driver than nvidia offers nothing.
"""

from __future__ import annotations

from ..model.errors import InputError
from ..model.kinds import Backend
from ..model.values import PciAddress, VgpuProfile, clipped, replace, strip_vendor_prefix
from ..observe.inventory import Inventory, VgpuType, free_instances, unread_note
from ..observe.inventory import present_framebuffers as _present_framebuffers
from .placement import GpuOffer

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Callable, Collection, Dict, FrozenSet, List, Mapping, Optional, Sequence
    from ..model.records import VgpuRecord


def types_by_gpu(inv: Inventory) -> Dict[PciAddress, Dict[str, List[VgpuType]]]:
    """``{gpu: {lower-case name: [VgpuType per parent]}}`` as the devices report them.  The value is shared
    (the last inventory's is kept: a start, its re-check and the agent's capacity answers ask of one
    snapshot again and again): callers must not change it.  Each GPU's map is kept with its run of rows
    (:meth:`Inventory.types_of`, the same tuple in every inventory that holds them: a snapshot's GPUs the
    agent did not re-read, a start's look at one GPU of it): built once per run, not per inventory."""
    global _BY_GPU
    last = _BY_GPU
    if last is not None and last[0] is inv:
        return last[1]
    out: Dict[PciAddress, Dict[str, List[VgpuType]]] = {}
    lower: Dict[str, str] = {}
    for gpu, run in inv._type_runs().items():
        hit = _BY_RUN.get(id(run))
        if hit is not None and hit[0] is run:
            out[gpu] = hit[1]
            continue
        names: Dict[str, List[VgpuType]] = {}
        for t in run:
            low = lower.get(t.name)
            if low is None:
                low = lower[t.name] = t.name.lower()
            rows = names.get(low)
            if rows is None:
                names[low] = [t]
            else:
                rows.append(t)
        out[gpu] = names
        if len(_BY_RUN) >= 64:
            _BY_RUN.clear()
        _BY_RUN[id(run)] = (run, names)      # the run itself kept: its id is not given to another meanwhile
    _BY_GPU = (inv, out)
    return out


#: id of a GPU's run of rows -> (that run, its map by lower-case name): :func:`types_by_gpu`'s, bounded
_BY_RUN: Dict[int, tuple] = {}


#: (the inventory :func:`types_by_gpu` was asked about last, its answer): one pair, replaced whole
_BY_GPU = None


def resolve_profile(inv: Inventory, records: Sequence[VgpuRecord], name: str,
                    gpu: Optional[PciAddress] = None, seen: Sequence[tuple] = ()) -> str:
    """The profile name as the devices spell it, matched case-insensitively and exactly.

    Never strips suffixes: ``A100-1-5CME`` does not match ``A100-1-5C``.
    Raises InputError naming near matches when no device offers the name,
    and when one GPU reports the name under two type ids (ambiguous).
    """
    wanted = strip_vendor_prefix(name).lower()       # "NVIDIA A40-8Q", in any case, is A40-8Q
    by_gpu = types_by_gpu(inv)
    scope = {gpu: by_gpu.get(gpu, {})} if gpu is not None else by_gpu
    known = {t.name for names in scope.values() for ts in names.values() for t in ts}
    known |= {r.type_name for r in records if gpu is None or r.gpu == str(gpu)}
    known |= {row[2] for row in seen if gpu is None or row[0] == str(gpu)}
    for g, names in scope.items():
        ids = {t.type_id for t in names.get(wanted, [])}
        if len(ids) > 1:
            raise InputError(f"profile {clipped(name)!r} is ambiguous on {g}: type ids {', '.join(sorted(ids))}",
                             hint="report this GPU's 'vgpuhost types --gpu' output")
    for n in sorted(known):
        if n.lower() == wanted:
            return n
    import difflib      # only on this error path: the qemu hook keeps its imports lean
    near = difflib.get_close_matches(name.upper(), sorted(known), n=5, cutoff=0.6)
    where = f"GPU {gpu}" if gpu else "this host"
    hint = ("near matches: " + ", ".join(near)) if near else "'vgpuhost types' lists the profiles"
    if not known:
        hint = ("no vGPU type could be read here" if any(g.unreadable for g in inv.gpus) else
                "no GPU here offers vGPU types ('vgpuhost host check' says why)")
    p = VgpuProfile.try_parse(name)
    if p is not None and p.mig_backed:
        hint += ("; MIG-backed types appear once MIG mode is on and GPU instances exist ('vgpuhost mig apply'), "
                 "or turn MIG on demand on for the GPU ('vgpuhost mig on-demand --gpu BDF on'): a start then "
                 "makes the GPU instance")
    hint += "".join(f"; {g.address}:" + unread_note(g)[1:] for g in inv.gpus
                    if g.unreadable and (gpu is None or g.address == gpu))      # its types are unknown, not absent
    raise InputError(f"unknown vGPU profile {clipped(name)!r} on {where}", hint=hint)


class OfferIndex:
    """What :func:`offers` looks up per GPU, gathered once for many profiles (``capacity`` asks for
    every profile): ``by_gpu`` (:func:`types_by_gpu`), ``seen_of`` (str GPU -> its ``seen`` rows) and
    ``records_of`` (str GPU -> its records).  Build it from the same ``inv``, ``records`` and ``seen``
    the calls pass."""

    __slots__ = ("by_gpu", "seen_of", "records_of")

    def __init__(self, inv: Inventory, records: Sequence[VgpuRecord], seen: Sequence[tuple] = ()):
        self.by_gpu = types_by_gpu(inv)
        self.seen_of: Dict[str, List[tuple]] = {}
        for row in seen:
            self.seen_of.setdefault(row[0], []).append(row)
        self.records_of: Dict[str, List[VgpuRecord]] = {}
        for r in records:
            self.records_of.setdefault(r.gpu, []).append(r)


def offers(inv: Inventory, records: Sequence[VgpuRecord], profile: str,
           seen: Sequence[tuple] = (), limits: Optional[Mapping[PciAddress, int]] = None,
           index: Optional[OfferIndex] = None) -> List[GpuOffer]:
    """One :class:`GpuOffer` per vGPU-capable GPU for ``profile`` (as resolved).

    ``seen``: ``(gpu, type_id, name, framebuffer_mib)`` rows remembered from
    earlier reads; a GPU that offered the type before but lists it no more
    (full, or another size present) gets an offer of 0 with the reason.
    ``limits``: ``{gpu: max instances of the profile in the GPU's current mode}``
    (:func:`vgpuhost.policy.config.mode_limits`; mixed-size maxima are often
    lower than equal-size ones, docs/reference/hardware.md#vgpu-types): an
    offer is capped at that max less the vGPUs of the profile on the GPU.
    A vendor-VFIO GPU lists a type on every free VF, so without a limit its
    offer is what the framebuffer or the equal-size max allows.
    A free VF one of ``records`` holds (:func:`recorded_vfs`: a vGPU missing
    from the host, kept for ``vgpuhost reconcile`` to re-create there) is no
    parent, and the offer counts at most the VFs left.
    ``index``: an :class:`OfferIndex` of the same ``inv``, ``records`` and
    ``seen``, built once for many calls (else built here).
    """
    ix_all = index if index is not None else OfferIndex(inv, records, seen)
    by_gpu, seen_of, records_of = ix_all.by_gpu, ix_all.seen_of, ix_all.records_of
    out = []
    for g in inv.gpus:
        if not g.vgpu_backend:
            continue
        ix = inv.on_gpu(g.address)
        ts = by_gpu.get(g.address, {}).get(profile.lower(), [])
        mine = seen_of.get(str(g.address), [])
        fbs = {row[1]: row[3] for row in mine if row[3]}
        recs = records_of.get(str(g.address), [])
        owners = frozenset(r.owner for r in recs)
        keys = frozenset(r.anti_affinity for r in recs if r.anti_affinity)
        parents = tuple(t.parent for t in ts if t.available_instances > 0)
        type_id, type_name, fb = ((ts[0].type_id, ts[0].name, ts[0].framebuffer_mib) if ts else
                                  next(((row[1], row[2], row[3]) for row in mine
                                        if row[2].lower() == profile.lower()), (None, None, None)))
        # a type the GPU listed before and hides now (full, or another size present) counts 0, with the reason
        limit = limits.get(g.address) if limits else None
        available, note = (free_instances(inv, g.address, type_id, fbs, name=type_name, limit=limit)
                           if type_id is not None
                           else free_instances(inv, g.address, "", fbs) if g.pci.driver != "nvidia" else (0, ""))
        if g.pci.driver != "nvidia":
            parents = ()
        if recs and parents:
            # a free VF a record names (vendor VFIO: its id; an mdev on SR-IOV: its parent, one vGPU a VF)
            # belongs to that record: a vGPU missing from the host (lost at a reboot, a remove that failed)
            # that 'vgpuhost reconcile' re-creates there, so it is never placed on (trial 7 F6: the record
            # would adopt the new device; an mdev's re-create would find its VF taken, ENOSPC)
            held = recorded_vfs(recs)
            free = tuple(p for p in parents if str(p) not in held)
            if len(free) < len(parents):
                kept = [str(p) for p in parents if str(p) in held]
                parents = free
                if available > len(free):
                    available = len(free)
                    if not available:
                        note = (f"its free VFs are recorded for vGPUs missing from the host ({', '.join(kept)}): "
                                "'vgpuhost reconcile' re-creates them there")
        sizes = _present_framebuffers(ix, fbs) if ix is not None else []
        used = None if None in sizes else sum(sizes)        # type: ignore[arg-type]
        out.append(GpuOffer(g.address, g.pci.numa_node, type_id, type_name, available, parents, owners,
                            keys, len(ix.vgpus) if ix is not None else 0, note,
                            framebuffer_mib=g.framebuffer_mib, used_mib=used))
    return out


#: the note of an offer on a GPU the hook allow-list (etc/vgpuhost/hook.allow) leaves out
NOT_ALLOWED = "not in the hook allow-list"


def allowed_only(offers: Sequence[GpuOffer], allowed: Optional[FrozenSet[PciAddress]]) -> List[GpuOffer]:
    """``offers`` narrowed to the hook allow-list ``allowed`` (GPU addresses; None: every GPU): an offer on
    a GPU it leaves out offers nothing (no instance, no parent), noted :data:`NOT_ALLOWED`.  What the hook's
    admission (``prepare begin``) and the destination's ``migrate begin`` placement both weigh."""
    if allowed is None:
        return list(offers)
    return [o if o.gpu in allowed else replace(o, available=0, parents=(), note=NOT_ALLOWED) for o in offers]


def recorded_vfs(records: Sequence[VgpuRecord]) -> FrozenSet[str]:
    """The VFs (BDF text) ``records`` hold, present or not: a vendor-VFIO vGPU's id, an SR-IOV mdev's
    parent (a VF holds one vGPU); never a classic mdev's parent, the GPU itself, which holds many."""
    return frozenset([r.id for r in records if r.backend != Backend.MDEV]
                     + [r.parent for r in records if r.backend == Backend.MDEV and r.parent != r.gpu])


def present_by_gpu(inv: Inventory) -> Dict[PciAddress, int]:
    """``{gpu: vGPUs present}`` for the GPUs that hold any."""
    out: Dict[PciAddress, int] = {}
    for g in inv.gpus:
        ix = inv.on_gpu(g.address)
        if ix is not None and ix.vgpus:
            out[g.address] = len(ix.vgpus)
    return out


def present_framebuffers(inv: Inventory, gpu: PciAddress, fbs: Dict[str, int]) -> List[Optional[int]]:
    """Framebuffer (MiB) of each time-sliced vGPU present on ``gpu`` (None: unknown type)."""
    ix = inv.on_gpu(gpu)
    return _present_framebuffers(ix, fbs) if ix is not None else []


def seen_rows(inv: Inventory) -> List[tuple]:
    """``(gpu, type_id, name, framebuffer_mib)`` for every type the inventory lists (a new list each call;
    the rows of the last inventory asked about are kept: a start asks several times of one snapshot)."""
    global _SEEN
    last = _SEEN
    if last is not None and last[0] is inv:
        return list(last[1])
    seen = set()
    gpu = text = None
    for t in inv.vgpu_types:
        if t.gpu is not gpu:        # a GPU's rows come together: its address spelled once per run of them
            gpu = t.gpu
            text = str(gpu)
        seen.add((text, t.type_id, t.name, t.framebuffer_mib))
    rows = tuple(sorted(seen))
    _SEEN = (inv, rows)
    return list(rows)


#: (the inventory :func:`seen_rows` read last, its rows): one pair, replaced whole (threads share it)
_SEEN = None


def fitting_elsewhere(inv: Inventory, gpu: PciAddress, seen: Sequence[tuple] = (),
                      limits_of: Optional[Callable[[str], Mapping[PciAddress, int]]] = None,
                      recorded: Collection[str] = ()) -> str:
    """``A40-8Q (5), A40-8C (5)``: the types that still fit on ``gpu`` (refusal and ENOSPC advice),
    counted by :func:`vgpuhost.observe.inventory.free_instances` as the offers are; ``seen`` as for
    :func:`offers`; ``limits_of``: a type name -> its ``limits`` for :func:`offers` (the max in each
    GPU's vGPU mode: :func:`vgpuhost.ops.vgpu.limits_lookup`); ``recorded``: the VFs records hold
    (:func:`recorded_vfs`), whose free ones count as taken, as in :func:`offers`."""
    ix = inv.on_gpu(gpu)
    if ix is None:
        return "none"
    fbs = {row[1]: row[3] for row in seen if row[0] == str(gpu) and row[3]}
    agg: Dict[str, int] = {}
    for tid, ts in ix.by_type.items():
        if ts[0].name not in agg:
            limit = limits_of(ts[0].name).get(gpu) if limits_of is not None and ts[0].name else None
            n = free_instances(inv, gpu, tid, fbs, limit=limit)[0]
            if recorded and n > 0:      # free VFs a record holds (vendor VFIO) take nothing new
                vfs = [str(t.parent) for t in ts if t.available_instances > 0]
                left = sum(1 for p in vfs if p not in recorded)
                n = min(n, left) if left < len(vfs) else n
            if n > 0:
                agg[ts[0].name] = n
    return ", ".join(f"{n} ({c})" for n, c in sorted(agg.items())) or "none"


__all__ = ["types_by_gpu", "resolve_profile", "OfferIndex", "offers", "recorded_vfs", "present_by_gpu",
           "present_framebuffers", "seen_rows", "fitting_elsewhere"]
