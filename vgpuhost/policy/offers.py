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
                    gpu: Optional[PciAddress] = None, seen: Sequence[tuple] = (),
                    on_demand: "frozenset[str] | Sequence[str]" = ()) -> str:
    """The profile name as the devices spell it, matched case-insensitively and exactly.

    Never strips suffixes: ``A100-1-5CME`` does not match ``A100-1-5C``.
    Raises InputError naming near matches when no device offers the name,
    and when one GPU reports the name under two type ids (ambiguous).  ``on_demand``: the GPUs
    (BDF text) where MIG on demand is on: a MIG-backed name unknown there is one whose GPU
    instance is gone, and the hint says so rather than to turn MIG on demand on.
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
    if p is not None and p.mig_backed and (str(gpu) in on_demand if gpu is not None else bool(on_demand)):
        hint += (f"; MIG on demand is on for {gpu or ', '.join(sorted(on_demand))}: the GPU instance a start "
                 "makes for it is gone (another operation re-sliced the GPU meanwhile: 'vgpuhost audit' names "
                 "it); start the domain again")
    elif p is not None and p.mig_backed:
        hint += ("; MIG-backed types appear once MIG mode is on and GPU instances exist ('vgpuhost mig apply'), "
                 "or turn MIG on demand on for the GPU ('vgpuhost mig on-demand --gpu BDF on'): a start then "
                 "makes the GPU instance")
    hint += "".join(f"; {g.address}:" + unread_note(g)[1:] for g in inv.gpus
                    if g.unreadable and (gpu is None or g.address == gpu))      # its types are unknown, not absent
    raise InputError(f"unknown vGPU profile {clipped(name)!r} on {where}", hint=hint)


def missing_records(ix, gpu: PciAddress, records: Sequence[VgpuRecord]) -> List[VgpuRecord]:
    """The records of ``records`` on ``gpu`` (whose :class:`~vgpuhost.observe.inventory.GpuIndex` is ``ix``,
    :meth:`Inventory.on_gpu`; None: nothing there) whose vGPU is not on the host: neither an mdev nor a VF
    holding a type there (lost at a reboot before ``reconcile``, or reset behind vgpuhost).  Each holds
    its share of the GPU for ``reconcile`` to re-create it there (:func:`offers`)."""
    here = set(ix.vgpus) if ix is not None else set()
    at = str(gpu)
    return [r for r in records if r.gpu == at and r.id not in here]


class OfferIndex:
    """What :func:`offers` looks up per GPU, gathered once for many profiles (``capacity`` asks for
    every profile): ``by_gpu`` (:func:`types_by_gpu`), ``seen_of`` (str GPU -> its ``seen`` rows) and
    ``records_of`` (str GPU -> its records).  Build it from the same ``inv``, ``records`` and ``seen``
    the calls pass."""

    __slots__ = ("by_gpu", "seen_of", "records_of", "_missing")

    def __init__(self, inv: Inventory, records: Sequence[VgpuRecord], seen: Sequence[tuple] = ()):
        self.by_gpu = types_by_gpu(inv)
        self.seen_of: Dict[str, List[tuple]] = {}
        for row in seen:
            self.seen_of.setdefault(row[0], []).append(row)
        self.records_of: Dict[str, List[VgpuRecord]] = {}
        for r in records:
            self.records_of.setdefault(r.gpu, []).append(r)
        self._missing: Dict[tuple, List[VgpuRecord]] = {}

    def missing_on(self, gpu: PciAddress, ix, recs: Sequence[VgpuRecord], owner: Optional[str] = None
                   ) -> List[VgpuRecord]:
        """The records of ``recs`` (on ``gpu``, whose :class:`GpuIndex` is ``ix``) whose vGPU is not on the
        host: neither an mdev nor a VF holding a type there (lost at a reboot before ``reconcile``).
        ``owner``'s own records are left out (its start makes them anew).  Computed once per GPU."""
        key = (gpu, owner)
        hit = self._missing.get(key)
        if hit is None:
            hit = self._missing[key] = [r for r in missing_records(ix, gpu, recs) if owner is None or r.owner != owner]
        return hit


def offers(inv: Inventory, records: Sequence[VgpuRecord], profile: str,
           seen: Sequence[tuple] = (), limits: Optional[Mapping[PciAddress, int]] = None,
           index: Optional[OfferIndex] = None, owner: Optional[str] = None,
           modes: Optional[Callable[[], Mapping[PciAddress, bool]]] = None) -> List[GpuOffer]:
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
    parent, and the offer counts at most the VFs left.  Such a record also
    holds its share of its GPU (:func:`_held_by_missing`): its time-sliced
    framebuffer counts as used, and on a GPU in equal-size mode its size is
    the only one offered, so ``reconcile`` finds room to re-create it; the
    offer's note names the records when nothing is left.  ``owner``: the
    requester, whose own missing records hold nothing for it (a domain's
    start removes its stale record and makes the vGPU anew).
    ``modes``: a callable giving ``{gpu: mixed-size mode on}`` as NVML reports it
    (:func:`vgpuhost.ops.vgpu.limits_lookup`'s ``modes``), called only for a GPU
    holding a missing record: the GPU's mode, not guessed from the sizes present
    (trial 8 retest R6); in mixed-size mode the record's placement id is held
    through ``limits`` (R4) and a count of 0 names the record.
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
        if recs and ix is not None and type_id is not None and g.pci.driver == "nvidia":
            # a record whose vGPU is missing holds its share of the GPU for 'vgpuhost reconcile' to re-create
            # it there (trial 7 retest N2: a new vGPU that took its room made the boot reconcile fail ENOSPC)
            gone = ix_all.missing_on(g.address, ix, recs, owner)
            if gone:
                mixed = _mode_of(modes, g.address)
                before = available
                available, why = _held_by_missing(g, ix, ts, gone, fb, sizes, fbs, available, mixed)
                if why and (before > 0 or mixed and g.address not in inv.out_of_service):
                    note = why
        used = None if None in sizes else sum(sizes)        # type: ignore[arg-type]
        out.append(GpuOffer(g.address, g.pci.numa_node, type_id, type_name, available, parents, owners,
                            keys, len(ix.vgpus) if ix is not None else 0, note,
                            framebuffer_mib=g.framebuffer_mib, used_mib=used))
    return out


def _mode_of(modes: Optional[Callable[[], Mapping[PciAddress, bool]]], gpu: PciAddress) -> Optional[bool]:
    """GPU ``gpu``'s mixed-size mode as ``modes()`` reports it; None where unknown."""
    if modes is None:
        return None
    on = modes().get(gpu)
    return None if on is None else bool(on)


def _record_fb(r: VgpuRecord, ix, fbs: Mapping[str, int]) -> Optional[int]:
    """Framebuffer MiB of record ``r``'s type: as the GPU lists it, as seen before (``fbs``: type id ->
    MiB), else from its profile name (``L40S-48Q``: 48 GiB); None when unknown or MIG-backed (its GPU
    instance holds it, not the time-sliced framebuffer)."""
    p = VgpuProfile.try_parse(r.type_name)
    if p is not None and p.mig_backed:
        return None
    fb = ix.framebuffer_of.get(r.type_id) or fbs.get(r.type_id)
    return fb or (p.framebuffer_gb * 1024 if p is not None and p.framebuffer_gb else None)


def _held_by_missing(g, ix, ts: Sequence[VgpuType], gone: Sequence[VgpuRecord], fb: Optional[int],
                     sizes: Sequence[Optional[int]], fbs: Mapping[str, int], available: int,
                     mixed: Optional[bool] = None) -> tuple:
    """``(available, why)`` on GPU ``g`` once the time-sliced framebuffer of the records ``gone`` (whose
    vGPUs are missing from the host) counts as held.  ``mixed``: the GPU's mixed-size mode as NVML
    reports it (None: unknown, then guessed: two sizes present, or another size offered beside the one
    present, read as mixed-size mode).  A GPU in equal-size mode holding a missing record of another
    size admits only that size (0), and records of two sizes admit none; in mixed-size mode the
    records' placement ids are held by the caller's limit (:func:`vgpuhost.ops.vgpu.limits_lookup`,
    trial 8 retest R4) and any size may fit beside them.  The board's framebuffer less the present
    vGPUs' and the missing records' caps the count by the type's ``fb`` MiB; a type with a max
    (``max_instances``) counts the missing records of its size as present.  ``why``: '' unless the
    count is 0, then the line naming the records, the mode's reason and ``vgpuhost reconcile``."""
    wanted = ts[0].profile if ts else None
    if not fb or (wanted is not None and wanted.mig_backed):
        return available, ""            # a MIG-backed type: GPU instances count it, not the framebuffer
    held = [(r, f) for r in gone for f in (_record_fb(r, ix, fbs),) if f]
    if not held:
        return available, ""
    names = ", ".join(f"{r.id} ({r.type_name}, owner {r.owner})" for r, _ in held[:3]) + (
        f" and {len(held) - 3} more" if len(held) > 3 else "")
    one = len(held) == 1
    why = (f"vGPU{'' if one else 's'} {names} {'is' if one else 'are'} recorded here but missing from the host: "
           f"{'its' if one else 'their'} framebuffer is kept for 'vgpuhost reconcile' to re-create "
           f"{'it' if one else 'them'} there")
    present = [x for x in sizes if x]
    sized = set(present)
    if mixed is None:
        # unknown: mixed-size mode shows as two sizes present, or a size not present still offered beside them
        mixed = len(sized) > 1 or bool(sized) and any(t.available_instances > 0 and t.framebuffer_mib
                                                      and t.framebuffer_mib not in sized
                                                      for t in ix.types if t.type_id in ix.time_sliced)
    kept = sorted({f for _, f in held})
    if not mixed and (len(kept) > 1 or any(f != fb for f in kept)):
        if len(kept) > 1:
            return 0, why + (f"; they need mixed-size mode ({'/'.join(map(str, kept))} MiB vGPUs) and the GPU "
                             f"is in equal-size mode: run 'vgpuhost reconcile' (it turns mixed-size mode on "
                             "first while the GPU holds no vGPU)")
        return 0, why + f"; equal-size mode admits only {kept[0]} MiB vGPUs"
    board = g.framebuffer_mib or max([f or 0 for t, f in ix.framebuffer_of.items() if t in ix.time_sliced] or [0])
    n = available
    if board:
        n = min(n, max(0, (board - sum(present) - sum(f for _, f in held)) // fb))
    most = ts[0].max_instances if ts else None
    if most is not None:
        same = sum(1 for x in present if x == fb) + sum(1 for _, f in held if f == fb)
        n = min(n, max(0, most - same))
    if n <= 0 and mixed:
        return 0, why + (f"; in mixed-size mode {'it keeps its' if one else 'each keeps its'} placement id, and "
                         f"no placement id of this size is free beside {'it' if one else 'them'}")
    return n, (why if n <= 0 else "")


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


def held_on(inv: Inventory, gpu: PciAddress, type_id: str, n: int, records: Sequence[VgpuRecord],
            fbs: Optional[Mapping[str, int]] = None,
            modes: Optional[Callable[[], Mapping[PciAddress, bool]]] = None,
            recorded: Optional[Collection[str]] = None) -> int:
    """``n`` free instances of ``type_id`` on ``gpu`` (as :func:`vgpuhost.observe.inventory.free_instances`
    counts them) less what ``records`` hold there, as :func:`offers` counts it: free VFs a record holds
    (``recorded``: :func:`recorded_vfs` of ``records``, computed when None) take nothing new, and records
    whose vGPU is missing hold their share of the GPU (:func:`_held_by_missing`, in the mode ``modes``
    reports).  What the refusals' "types that still fit" count, so they agree with placement (trial 8
    retest R6; ``vgpuhost types`` shows the driver's counts and reads no store).  ``fbs``: type id -> MiB
    seen before."""
    ix = inv.on_gpu(gpu)
    if ix is None or n <= 0 or not records:
        return n
    ts = ix.by_type.get(type_id, ())
    if not ts:
        return n
    fbs = fbs or {}
    recorded = recorded_vfs(records) if recorded is None else recorded
    if recorded:        # free VFs a record holds (vendor VFIO) take nothing new
        vfs = [str(t.parent) for t in ts if t.available_instances > 0]
        left = sum(1 for p in vfs if p not in recorded)
        n = min(n, left) if left < len(vfs) else n
    gone = missing_records(ix, gpu, records)
    if gone and n > 0:
        sizes = _present_framebuffers(ix, fbs)
        n = _held_by_missing(ix.gpu, ix, ts, gone, ts[0].framebuffer_mib or fbs.get(type_id), sizes, fbs, n,
                             _mode_of(modes, gpu))[0]
    return n


def fitting_elsewhere(inv: Inventory, gpu: PciAddress, seen: Sequence[tuple] = (),
                      limits_of: Optional[Callable[[str], Mapping[PciAddress, int]]] = None,
                      recorded: Collection[str] = (), records: Sequence[VgpuRecord] = (),
                      modes: Optional[Callable[[], Mapping[PciAddress, bool]]] = None) -> str:
    """``A40-8Q (5), A40-8C (5)``: the types that still fit on ``gpu`` (refusal and ENOSPC advice),
    counted by :func:`vgpuhost.observe.inventory.free_instances` as the offers are; ``seen`` as for
    :func:`offers`; ``limits_of``: a type name -> its ``limits`` for :func:`offers` (the max in each
    GPU's vGPU mode: :func:`vgpuhost.ops.vgpu.limits_lookup`); ``recorded``: the VFs records hold
    (:func:`recorded_vfs`), whose free ones count as taken, as in :func:`offers`; ``records``: the vGPU
    records, whose vGPUs missing from ``gpu`` hold their share of it, as in :func:`offers`; ``modes``
    as for :func:`offers`."""
    ix = inv.on_gpu(gpu)
    if ix is None:
        return "none"
    fbs = {row[1]: row[3] for row in seen if row[0] == str(gpu) and row[3]}
    agg: Dict[str, int] = {}
    for tid, ts in ix.by_type.items():
        if ts[0].name not in agg:
            limit = limits_of(ts[0].name).get(gpu) if limits_of is not None and ts[0].name else None
            n = held_on(inv, gpu, tid, free_instances(inv, gpu, tid, fbs, limit=limit)[0], records, fbs,
                        modes, recorded)
            if n > 0:
                agg[ts[0].name] = n
    return ", ".join(f"{n} ({c})" for n, c in sorted(agg.items())) or "none"


__all__ = ["types_by_gpu", "resolve_profile", "OfferIndex", "offers", "recorded_vfs", "present_by_gpu",
           "present_framebuffers", "seen_rows", "fitting_elsewhere", "held_on", "missing_records"]
