"""Placement: which physical GPU gets a new vGPU.  A pure function.

Owns: choosing a GPU (and a parent on it) for a vGPU request from what
each GPU offers right now, by strategy, and saying why.  Must not: read
the host or the state store; callers build :class:`GpuOffer` values from an
inventory and the records (see :func:`vgpuhost.vgpu.offers`).

Capacity is counted in instances of the requested type, as the kernel
reports them (``available_instances`` on mdev, creatable VFs on vendor
VFIO), so the vGPU manager's own rules — equal-size mode (a GPU holding 8Q
vGPUs offers only 8 GB types), mixed-size mode where enabled, max instances
(docs/reference/hardware.md#vgpu-types) — are honoured by construction.  On top of those:

- one vGPU per VM per physical GPU (docs/reference/hardware.md#field-lessons): a GPU where the
  request's owner already holds a vGPU is skipped (owner ``manual`` exempt);
- anti-affinity: no two vGPUs with the same key on one GPU;
- NUMA preference: GPUs on the requested node first, others only if none fits.

Strategies: ``first-fit`` (lowest PCI address), ``best-fit`` (the GPU left
with the fewest free instances that still fits: packs densely, keeps whole
GPUs free for large types), ``worst-fit`` alias ``spread`` (the most free
instances, then the fewest vGPUs present: balances load).

``reserve`` (in :data:`RESERVING`, not in :data:`STRATEGIES`: it may refuse
a request some GPU could hold, so callers opt in) is best-fit plus trunk
reservation for whole-GPU types: a request whose type fits only once on an
empty GPU (``available == 1`` on a GPU holding no vGPU, e.g. A40-48Q) is
refused when it would take one of the last :data:`RESERVE_EMPTY` empty
GPUs (a request pinned to a GPU is not refused for it).  When the object is the number of admitted requests, one whole-GPU
vGPU displaces up to max-instances small ones for its lifetime; keeping two
GPUs empty for them admits more on the mixed traces of
``bench/placement.py`` (figures in docs/performance.md, "Placement").

``headroom`` (also in :data:`RESERVING`) is best-fit plus admission control
by the framebuffer in use: a request that would open an empty GPU (no GPU
already holding its size has room) for a type an empty GPU holds only once
or twice (A40-48Q, A40-24Q) is refused when, with it, the vGPU framebuffer
in use on the pool would pass :data:`HEADROOM` of the pool's framebuffer
(70% for a whole-GPU type, 85% for a half-GPU type); such a vGPU costs its
whole or half GPU in equal-size mode, which, with the host near full, small
requests would share many ways.  Requests that join a GPU already holding
their size, pinned requests, and GPUs without known framebuffer figures
(``GpuOffer.framebuffer_mib``/``used_mib`` None: it then decides as
best-fit) are never refused by it.  On the traces of ``bench/placement.py
--seeds 6`` it admits more than best-fit on every seed.
"""

from __future__ import annotations

from ..model.kinds import Owner, PlacementStrategy
from ..model.values import PciAddress, field, record, validate_owner  # noqa: F401 (validate_owner: re-exported)

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import FrozenSet, List, Optional, Sequence, Tuple

STRATEGIES = PlacementStrategy.FITTING
RESERVING = PlacementStrategy.RESERVING     # may refuse a request that fits: opt-in, see the module docstring
RESERVE_EMPTY = 2               # empty GPUs a whole-GPU request may not take (``reserve``)
#: ``headroom``: instances of the type an empty GPU holds -> the share of the pool's framebuffer in
#: use above which such a request may not take an empty GPU (types that share a GPU three or more
#: ways are never refused).  Chosen on bench/placement.py seeds 7..30, checked on seeds 1..6.
HEADROOM = {1: 0.70, 2: 0.85}
#: what the CLI's --strategy and the domain metadata offer: the strategies, and ``headroom``, whose
#: refusal of a request that fits says so (``reserve`` stays API-only: see docs/performance.md)
OFFERED = PlacementStrategy.OFFERED
MANUAL = Owner.MANUAL
LAYOUT = Owner.LAYOUT      # vGPUs a declarative layout pre-creates (vgpuhost apply)
POOL_OWNERS = Owner.POOL


@record(frozen=True)
class GpuOffer:
    """What one GPU offers for the requested type now.

    ``type_id`` None: the GPU does not offer the type at all.  ``parents``:
    the mdev parents / VFs with a free instance, in the order to use them.
    """

    gpu: PciAddress
    numa_node: int
    type_id: Optional[str]
    type_name: Optional[str]
    available: int
    parents: Tuple[PciAddress, ...]
    owners: FrozenSet[str] = frozenset()
    keys: FrozenSet[str] = frozenset()
    present: int = 0
    note: str = ""          # why it does not fit, when the caller knows better (e.g. equal-size)
    framebuffer_mib: Optional[int] = None   # the GPU's framebuffer (``headroom``; None: unknown)
    used_mib: Optional[int] = None          # framebuffer of the time-sliced vGPUs present (None: unknown)


@record(frozen=True)
class Request:
    profile: str
    owner: str = MANUAL
    strategy: str = PlacementStrategy.DEFAULT
    numa_node: Optional[int] = None
    anti_affinity: Optional[str] = None
    gpu: Optional[PciAddress] = None


@record(frozen=True)
class Decision:
    """The chosen GPU and parent, or None with the reason per GPU."""

    gpu: Optional[PciAddress]
    parent: Optional[PciAddress]
    type_id: Optional[str]
    reason: str
    rejected: Tuple[Tuple[str, str], ...] = field(default=())

    @property
    def admitted(self) -> bool:
        return self.gpu is not None


def _why_not(o: GpuOffer, req: Request) -> Optional[str]:
    if o.type_id is None:
        return f"does not offer {req.profile}"
    if o.available <= 0:
        return o.note or f"no {o.type_name} instance free"
    if req.owner not in POOL_OWNERS and req.owner in o.owners:
        return f"already holds a vGPU of {req.owner} (one vGPU per VM per GPU)"
    if req.anti_affinity and req.anti_affinity in o.keys:
        return f"already holds a vGPU with anti-affinity key {req.anti_affinity!r}"
    return None


def _tightest(req, chosen, n_fit: int, n_pool: int, off_node: int, rejected) -> "Decision":
    """The Decision of a packing strategy (``headroom``, ``reserve``) that took ``chosen``, the GPU
    with the fewest free instances that still fits; ``off_node`` is 1 when it is not on the
    requested NUMA node."""
    reason = (f"{req.strategy}: {chosen.gpu} is the GPU with the fewest free instances that still fits "
              f"({chosen.available} {chosen.type_name} free; {n_fit} of {n_pool} GPUs fit)")
    if req.numa_node is not None:
        reason += (f"; NUMA node {req.numa_node} preferred" if off_node == 0 else
                   f"; no GPU on NUMA node {req.numa_node} fits, took node {chosen.numa_node}")
    return Decision(chosen.gpu, chosen.parents[0], chosen.type_id, reason, tuple(rejected))


def place(offers: Sequence[GpuOffer], req: Request) -> Decision:
    """Choose a GPU for ``req`` among ``offers``; never raises for a full host.

    Raises ValueError for an unknown strategy (callers validate first).
    """
    if req.strategy not in STRATEGIES and req.strategy not in RESERVING:
        raise ValueError(f"unknown strategy {req.strategy!r}")
    pool = [o for o in offers if req.gpu is None or o.gpu == req.gpu]
    fits: List[GpuOffer] = []
    rejected: List[Tuple[str, str]] = []
    for o in pool:
        why = _why_not(o, req)
        if why:
            rejected.append((str(o.gpu), why))
        else:
            fits.append(o)
    if not fits:
        where = f"GPU {req.gpu}" if req.gpu else f"the {len(pool)} vGPU-capable GPUs"
        detail = "; ".join(f"{g}: {w}" for g, w in rejected) or "no vGPU-capable GPU"
        return Decision(None, None, None, f"{req.profile} fits on none of {where}: {detail}"
                        if req.gpu is None else f"{req.profile} does not fit on {where}: {detail}",
                        tuple(rejected))

    def numa(o: GpuOffer) -> int:
        return 0 if req.numa_node is None or o.numa_node == req.numa_node else 1

    if req.strategy == PlacementStrategy.HEADROOM:
        chosen = min(fits, key=lambda o: (numa(o), o.available, o.gpu))
        why = _headroom_refusal(pool, chosen, req)
        if why:
            return Decision(None, None, None, why, tuple(rejected))
        return _tightest(req, chosen, len(fits), len(pool), numa(chosen), rejected)
    if req.strategy == PlacementStrategy.RESERVE:
        chosen = min(fits, key=lambda o: (numa(o), o.available, o.gpu))
        if req.gpu is None and chosen.present == 0 and chosen.available == 1:
            empty = sum(1 for o in pool if o.present == 0)
            if empty <= RESERVE_EMPTY:
                why = (f"reserve: {req.profile} takes a whole GPU and only {empty} of {len(pool)} GPUs are "
                       f"empty (the last {RESERVE_EMPTY} are kept for requests that share a GPU)")
                return Decision(None, None, None, why, tuple(rejected))
        return _tightest(req, chosen, len(fits), len(pool), numa(chosen), rejected)
    if req.strategy == PlacementStrategy.FIRST_FIT:
        key = lambda o: (numa(o), o.gpu)                                  # noqa: E731
        why = "the first GPU (by PCI address) that fits"
    elif req.strategy == PlacementStrategy.BEST_FIT:
        key = lambda o: (numa(o), o.available, o.gpu)                     # noqa: E731
        why = "the GPU with the fewest free instances that still fits"
    else:
        key = lambda o: (numa(o), -o.available, o.present, o.gpu)         # noqa: E731
        why = "the GPU with the most free instances"
    chosen = min(fits, key=key)
    reason = (f"{req.strategy}: {chosen.gpu} is {why} ({chosen.available} {chosen.type_name} free; "
              f"{len(fits)} of {len(pool)} GPUs fit)")
    if req.numa_node is not None:
        reason += (f"; NUMA node {req.numa_node} preferred" if numa(chosen) == 0 else
                   f"; no GPU on NUMA node {req.numa_node} fits, took node {chosen.numa_node}")
    return Decision(chosen.gpu, chosen.parents[0], chosen.type_id, reason, tuple(rejected))


def _headroom_refusal(pool: Sequence[GpuOffer], chosen: GpuOffer, req: Request) -> Optional[str]:
    """Why ``headroom`` refuses ``req`` on ``chosen`` (best-fit's choice), or None to admit it."""
    share = HEADROOM.get(chosen.available) if chosen.present == 0 else None
    if share is None or req.gpu is not None:
        return None
    if any(o.framebuffer_mib is None or o.used_mib is None for o in pool) or not chosen.framebuffer_mib:
        return None
    total = sum(o.framebuffer_mib for o in pool)
    used = sum(o.used_mib for o in pool) + chosen.framebuffer_mib // chosen.available
    if used <= share * total:
        return None
    what = "a whole GPU" if chosen.available == 1 else f"1/{chosen.available} of a GPU"
    return (f"headroom: {req.profile} fits on the empty GPU {chosen.gpu}, but refused: it takes {what}, and with "
            f"it {used * 100 // total}% of the {len(pool)} GPUs' framebuffer would be in use, over the "
            f"{share:.0%} allowed for such types (room kept for vGPUs that share a GPU); place it with "
            "another strategy, or pin it to a GPU")
