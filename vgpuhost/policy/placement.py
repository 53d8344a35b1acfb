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
``bench/placement.py`` (figures in the README's Performance section).
"""

from __future__ import annotations

from ..model.errors import InputError
from ..model.kinds import Owner
from ..model.values import PciAddress, field, parse_uuid, record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import FrozenSet, List, Optional, Sequence, Tuple

STRATEGIES = ("first-fit", "best-fit", "worst-fit", "spread")
RESERVING = ("reserve",)        # may refuse a request that fits: opt-in, see the module docstring
RESERVE_EMPTY = 2               # empty GPUs a whole-GPU request may not take (``reserve``)
MANUAL = Owner.MANUAL
LAYOUT = Owner.LAYOUT      # vGPUs a declarative layout pre-creates (vgpuhost apply)
POOL_OWNERS = Owner.POOL


def validate_owner(owner: str) -> str:
    """An owner as vgpuhost records it: a domain UUID (lower case), ``manual`` or ``layout``.

    Raises InputError naming the bad value.
    """
    if owner in POOL_OWNERS:
        return owner
    try:
        return parse_uuid(owner)
    except InputError:
        raise InputError(f"invalid owner {owner!r}",
                         hint="give the domain UUID (virsh domuuid NAME), 'manual' or 'layout'") from None


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


@record(frozen=True)
class Request:
    profile: str
    owner: str = MANUAL
    strategy: str = "first-fit"
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

    if req.strategy == "reserve":
        chosen = min(fits, key=lambda o: (numa(o), o.available, o.gpu))
        if req.gpu is None and chosen.present == 0 and chosen.available == 1:
            empty = sum(1 for o in pool if o.present == 0)
            if empty <= RESERVE_EMPTY:
                why = (f"reserve: {req.profile} takes a whole GPU and only {empty} of {len(pool)} GPUs are "
                       f"empty (the last {RESERVE_EMPTY} are kept for requests that share a GPU)")
                return Decision(None, None, None, why, tuple(rejected))
        reason = (f"reserve: {chosen.gpu} is the GPU with the fewest free instances that still fits "
                  f"({chosen.available} {chosen.type_name} free; {len(fits)} of {len(pool)} GPUs fit)")
        if req.numa_node is not None:
            reason += (f"; NUMA node {req.numa_node} preferred" if numa(chosen) == 0 else
                       f"; no GPU on NUMA node {req.numa_node} fits, took node {chosen.numa_node}")
        return Decision(chosen.gpu, chosen.parents[0], chosen.type_id, reason, tuple(rejected))
    if req.strategy == "first-fit":
        key = lambda o: (numa(o), o.gpu)                                  # noqa: E731
        why = "the first GPU (by PCI address) that fits"
    elif req.strategy == "best-fit":
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
