"""A pure model of a host's GPUs under admission: offers, arrivals, departures, pool changes.

Owns: :class:`HostModel`, a stand-in for a host that ``bench/utilisation.py``
replays multi-tenant traces through and the property tests drive with
random operations; and :func:`violations`, an independent check of the
rules admission must keep (quota, isolation, QoS class, one scheduler
policy per GPU).  Must not: touch files, the store or sysfs.

The model's GPUs follow the vGPU manager's capacity rules as vgpuhost's
simulator does: equal-size mode (one framebuffer size per GPU at a time),
max instances = board framebuffer / type framebuffer, one vGPU per VM per
GPU; a GPU passed through holds nothing else.  MIG is not modelled.  A GPU
in ``mixed`` (mixed-size mode, issue 30) holds several sizes, each vGPU at a
free placement id of :mod:`vgpuhost.model.mixedsize` (best fit), with
mixed-size maxima the equal-size max rounded down to a power of two (the
A40 and L40S tables, docs/reference/hardware.md#vgpu-types).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..model import mixedsize
from ..model.concepts import PlacementStrategy, QosClass, SchedulerPolicy
from ..model.tenancy import EXCLUSIVE, GUARANTEED, HARDWARE, Tenant
from ..model.values import PciAddress, VgpuProfile, record
from .admission import (
    PASSTHROUGH, VGPU, Admission, AdmissionRequest, Allocation, Demand, Pool, admit, allocation, pool_change_refusal,
    pool_of, pool_problems, usage
)
from .placement import GpuOffer


@record(frozen=True)
class Board:
    """A GPU board: name as vGPU type names spell it (``A40``), framebuffer MiB, time-sliced sizes (GB)."""

    name: str
    memory_mib: int
    sizes_gb: Tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 48)


class HostModel:
    """GPUs (BDF -> :class:`Board`), pools, and the allocations admission made.

    ``placed_policy``: device -> the scheduler policy of its GPU's pool when
    it was placed (a pool change may never alter it while the device lives).
    """

    def __init__(self, gpus: Mapping[str, Board], pools: Sequence[Pool] = (), mixed: Sequence[str] = ()):
        self.gpus: Dict[str, Board] = dict(gpus)
        self.mixed = frozenset(mixed)                       # GPUs in mixed-size mode
        self.placement: Dict[str, Tuple[int, int]] = {}     # device -> (placement id, size) on a mixed GPU
        self.pools: List[Pool] = list(pools)
        self.allocations: List[Allocation] = []
        self.placed_policy: Dict[str, str] = {}
        self._n = 0

    # --- what the host offers ----------------------------------------------------
    def offers(self, profile: str) -> List[GpuOffer]:
        """One offer per GPU for a time-sliced ``profile`` (``A40-8Q``), as ``ops.vgpu.offers`` builds them."""
        p = VgpuProfile.try_parse(profile)
        out = []
        for g, board in sorted(self.gpus.items()):
            addr = PciAddress.parse(g)
            if p is None or p.board != board.name.upper() or p.framebuffer_gb not in board.sizes_gb or p.mig_backed:
                out.append(GpuOffer(addr, 0, None, None, 0, ()))
                continue
            fb = p.framebuffer_gb * 1024
            here = [a for a in self.allocations if a.gpu == g]
            note = ""
            if any(a.kind == PASSTHROUGH for a in here):
                avail, note = 0, "passed through"
            elif g in self.mixed:
                units, size, mx = self._grid(board, p.framebuffer_gb)
                taken = [self.placement[a.device] for a in here if a.device in self.placement]
                same = sum(1 for a in here if a.framebuffer_mib == fb)
                avail = mixedsize.fits_count(units, size, mx, taken, same)
                note = "" if avail else "no free placement id (mixed-size mode)"
            elif {a.framebuffer_mib for a in here} - {fb}:
                avail, note = 0, "holds another vGPU size; equal-size mode admits only that size"
            else:
                avail = board.memory_mib // fb - len(here)
            out.append(GpuOffer(addr, 0, f"{board.name}-{p.framebuffer_gb}", profile, max(avail, 0),
                                (addr,) if avail > 0 else (), frozenset(a.owner for a in here), frozenset(),
                                len(here), note))
        return out

    @staticmethod
    def _grid(board: Board, size_gb: int) -> Tuple[int, int, int]:
        """``(units, placement size, mixed-size max)`` of a ``size_gb`` type on ``board``."""
        units = board.memory_mib // 1024
        equal = units // size_gb
        mx = 1 << (equal.bit_length() - 1) if equal else 0
        return units, size_gb, mx

    def memory(self) -> Dict[str, int]:
        return {g: b.memory_mib for g, b in self.gpus.items()}

    def free_gpu(self, board: Optional[str] = None) -> Optional[str]:
        """The first GPU (of ``board``) holding nothing, for a passthrough request."""
        busy = {a.gpu for a in self.allocations}
        for g, b in sorted(self.gpus.items()):
            if g not in busy and (board is None or b.name == board):
                return g
        return None

    # --- events ---------------------------------------------------------------------
    def arrive(self, owner: str, demand: Demand, tenants: Mapping[str, Tenant], *, tenant: Optional[str] = None,
               qos: Optional[str] = None, strategy: str = PlacementStrategy.BEST_FIT, gpu: Optional[str] = None,
               fail: bool = False) -> Admission:
        """Admit one device for domain ``owner`` and, unless ``fail`` (the device could not be made after
        admission: nothing is recorded), hold it.  Returns the decision."""
        offers = self.offers(demand.profile) if demand.kind == VGPU else []
        if demand.kind == PASSTHROUGH and gpu is None:
            gpu = self.free_gpu()
            if gpu is None:
                return Admission(False, "no GPU is free for passthrough", tenant, qos or QosClass.BEST_EFFORT,
                                 code="capacity")
        d = admit(AdmissionRequest(owner, demand, tenant, qos, gpu, strategy), tenants=tenants,
                  allocations=self.allocations, pools=self.pools, offers=offers, gpu_memory=self.memory())
        if d.admitted and not fail:
            self._n += 1
            device = f"dev{self._n}"
            self.allocations.append(allocation(device, owner, d.gpu or "", demand, d))
            if demand.kind == VGPU and d.gpu in self.mixed:
                units, size, mx = self._grid(self.gpus[d.gpu], demand.framebuffer_mib // 1024)
                taken = [self.placement[a.device] for a in self.allocations if a.gpu == d.gpu
                         and a.device in self.placement]
                pid = mixedsize.best_id(units, size, mx, taken)
                self.placement[device] = (pid if pid is not None else 0, size)
            self.placed_policy[device] = pool_of(self.pools, d.gpu or "").policy
        return d

    def depart(self, owner: str) -> int:
        """Release every device of ``owner``; how many."""
        gone = [a for a in self.allocations if a.owner == owner]
        self.allocations = [a for a in self.allocations if a.owner != owner]
        for a in gone:
            self.placed_policy.pop(a.device, None)
            self.placement.pop(a.device, None)
        return len(gone)

    def set_pools(self, new: Sequence[Pool]) -> Optional[str]:
        """Replace the pools as ``ops.tenancy.set_pools`` does; the refusal, or None when done."""
        problems = pool_problems(new)
        if problems:
            return "; ".join(problems)
        why = pool_change_refusal(self.pools, new, self.allocations)
        if why:
            return why
        self.pools = list(new)
        return None


def violations(model: HostModel, tenants: Mapping[str, Tenant], *, check_quota: bool = True) -> List[str]:
    """Every broken rule in ``model`` now (empty: none), checked without :func:`admit`'s code paths.

    - quota: a tenant holds more than its ceiling, or its guaranteed-marked use passes its guaranteed limit;
    - isolation: a hardware tenant holds a time-sliced vGPU; a time-sliced GPU holds an exclusive tenant's
      vGPU and another's; two tenants on one time-sliced GPU where one avoids a label of the other;
    - QoS class: a guaranteed time-sliced vGPU outside a fixed-share pool; any time-sliced vGPU in a pool
      that does not serve its class;
    - scheduler: a GPU in two pools, or a live vGPU whose GPU's policy changed since it was placed;
    - capacity: a GPU over its framebuffer, two vGPU sizes on one GPU, anything beside a passthrough.
    """
    out: List[str] = []
    if check_quota:
        for t in tenants.values():
            u = usage(t.name, model.allocations)
            for d, (total, burst) in u.items():
                ceiling, g = t.quota.ceiling(d), t.quota.guaranteed.get(d)
                if ceiling is not None and total > ceiling:
                    out.append(f"quota: {t.name} holds {total} {d} > {ceiling}")
                if g is not None and total - burst > g:
                    out.append(f"quota: {t.name} guaranteed use {total - burst} {d} > {g}")
    seen: Dict[str, str] = {}
    for p in model.pools:
        for g in p.gpus:
            if g in seen:
                out.append(f"scheduler: GPU {g} in pools {seen[g]} and {p.name}")
            seen[g] = p.name
    by_gpu: Dict[str, List[Allocation]] = {}
    for a in model.allocations:
        by_gpu.setdefault(a.gpu, []).append(a)
        t = tenants.get(a.tenant) if a.tenant else None
        hw = a.kind == PASSTHROUGH or a.mig_slices > 0
        if t is not None and t.isolation == HARDWARE and not hw:
            out.append(f"isolation: hardware tenant {t.name} holds time-sliced {a.device}")
        if not hw:
            pool = pool_of(model.pools, a.gpu)
            if a.qos == GUARANTEED and pool.policy != SchedulerPolicy.FIXED_SHARE:
                out.append(f"qos: guaranteed {a.device} on {a.gpu} in {pool.name} ({pool.policy or 'no policy'})")
            if not pool.serves(a.qos):
                out.append(f"qos: {a.qos} {a.device} in pool {pool.name}, which does not serve it")
            if model.placed_policy.get(a.device, pool.policy) != pool.policy:
                out.append(f"scheduler: {a.gpu} changed policy under {a.device}")
    for g, held in by_gpu.items():
        board = model.gpus.get(g)
        if any(a.kind == PASSTHROUGH for a in held) and len(held) > 1:
            out.append(f"capacity: {g} passed through and holding {len(held) - 1} more")
        sliced = [a for a in held if a.kind == VGPU and not a.mig_slices]
        if len({a.framebuffer_mib for a in sliced}) > 1 and g not in model.mixed:
            out.append(f"capacity: {g} holds two vGPU sizes")
        if board is not None and sum(a.framebuffer_mib for a in sliced) > board.memory_mib:
            out.append(f"capacity: {g} over its framebuffer")
        if g in model.mixed:
            spans = sorted(model.placement[a.device] for a in sliced if a.device in model.placement)
            if any(s0 + z0 > s1 for (s0, z0), (s1, _) in zip(spans, spans[1:])):
                out.append(f"capacity: {g} holds two vGPUs at overlapping placements")
        names = {a.tenant for a in sliced}
        for a in sliced:
            t = tenants.get(a.tenant) if a.tenant else None
            if t is not None and t.isolation == EXCLUSIVE and len(names) > 1:
                out.append(f"isolation: exclusive {t.name} shares {g} with {sorted(map(str, names - {t.name}))}")
            for b in sliced:
                u = tenants.get(b.tenant) if b.tenant else None
                if t is not None and u is not None and t.name != u.name and (t.avoid & u.labels):
                    out.append(f"isolation: {t.name} avoids {sorted(t.avoid & u.labels)} but shares {g} with {u.name}")
    return sorted(set(out))
