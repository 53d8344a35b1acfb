"""Admission control: may this tenant's domain have this device now, and where?  A pure function.

Owns: :func:`admit`, the one decision the qemu hook (with authority, at
``prepare begin`` under the host lock) and ``attach`` (early feedback) ask,
in a fixed order: quota -> isolation -> QoS class -> pool -> placement;
the values it decides over (:class:`Pool`, :class:`AdmissionRequest`;
:class:`Demand`, :class:`Allocation` and :class:`Admission` live in
:mod:`vgpuhost.policy.demand`, which the hook's path imports without these
rules, and are re-exported here); quota use (:func:`usage`).  Must not: read the host or the state store, or change
anything; callers (``vgpuhost.ops.tenancy``) build the inputs from the
records and an inventory, and record the outcome.

Rules (docs/guide/tenancy.md):

- **Quota.**  For each dimension (:data:`vgpuhost.model.tenancy.DIMENSIONS`)
  the tenant's use plus the demand may not pass the burst limit (or the
  guaranteed limit where no burst is set).  Use above the guaranteed limit
  marks the allocation *burst*.  The allowed series (``C`` only, ...) is
  checked first.
- **Reserve.**  Use no guarantee covers (a burst; a domain with no tenant,
  or a tenant's device in dimensions without a guaranteed limit, once any
  tenant has a guarantee) is admitted on a GPU only where, with it there,
  every other tenant's unused guarantee can still be served together on the
  GPUs that tenant can use (its types and sizes, its pool's class, its
  isolation and avoid rules, equal-size mode, MIG slices, empty GPUs for
  passthrough): :class:`vgpuhost.policy.feasibility.Reserve`, over
  per-GPU facts (``gpus``, :class:`HostGpu`).  The refusal (code
  ``burst``) names the tenants holding the room.  An isolation refusal of a
  guaranteed request names the bursts and untenanted use on the GPUs its
  isolation closed.
- **Isolation.**  ``hardware``: MIG-backed vGPUs and passthrough only.
  ``exclusive``: a time-sliced GPU holds only this tenant's vGPUs (and no
  other tenant's vGPU joins it).  ``shared``: anything not excluded by an
  exclusive holder or by label anti-affinity (``avoid``, both ways).
  MIG-backed vGPUs and passthrough are hardware partitions: neighbours do
  not matter to them.
- **QoS class.**  ``guaranteed`` needs a hardware partition or a GPU in a
  fixed-share pool; ``burstable`` a GPU in a pool serving it (equal-share
  or fixed-share); ``best-effort`` any pool serving it.  A domain that
  names no tenant is best-effort.
- **Pools.**  Time-sliced vGPUs go only to GPUs whose pool serves the
  class.  GPUs in no declared pool form the implicit pool ``default``,
  which serves ``burstable`` and ``best-effort`` (its scheduler policy is
  whatever the GPU runs).  A GPU of a declared pool running another policy
  than its pool's (``policies``, read under the host lock) is in drift and
  serves no class.  Hardware partitions ignore pools.
- **GPU time.**  A time-sliced vGPU goes only to a GPU where its expected
  GPU-time demand (``Demand.use``, else its profile's fixed share:
  :mod:`vgpuhost.policy.compute`) still fits, with the expected demand of
  the vGPUs there, under the compute ceiling of the GPU's pool
  (``Pool.ceiling``, 1.0 by default).  When the framebuffer fits somewhere
  but GPU time nowhere, the refusal (code ``gpu-time``) names the GPU time
  on each GPU.  The reserve of unused guarantees counts a GPU's room as the
  lesser of its free framebuffer and its GPU time left, a future vGPU
  costing its fixed share (exact in fixed-share pools, where the scheduler
  gives a vGPU its fixed share and no more).
- **Placement.**  :func:`vgpuhost.policy.placement.place` over the GPUs
  left, with the tenant's ``prefer`` labels tried first (affinity).  A
  time-sliced vGPU tries the pools serving the weakest strongest class first
  (:func:`pool_tier`: a best-effort vGPU goes to a best-effort-only pool
  before an equal-share one, a burstable vGPU to an equal-share pool before
  a fixed-share one), the next tier only when none fits there.

A refusal names the rule, the quota with its current use, and what would
free room; for a guaranteed request, that includes other tenants' burst
allocations on the GPUs it could use.  vgpuhost never stops a VM itself.
"""

from __future__ import annotations

from ..model.kinds import Owner, PlacementStrategy, SchedulerPolicy
from ..model.tenancy import (BEST_EFFORT, BURSTABLE, DIMENSION_TEXT, DIMENSIONS, EXCLUSIVE, GUARANTEED,
                             HARDWARE, QOS_CLASSES, UNTENANTED_QOS, Quota, Tenant,
                             tenant_named)  # noqa: F401 (tenant_named re-exported for ops.tenancy)
from ..model.gputime import DEFAULT_CEILING, MAX_CEILING
from ..model.values import record, replace
from . import compute
from .feasibility import HostGpu, Reserve  # noqa: F401 (HostGpu re-exported for ops.tenancy)
from .demand import (PASSTHROUGH, ROOM_CODES, VGPU, Admission, Allocation, Demand,  # noqa: F401 (re-exported)
                     allocation, passthrough_demand, refusal_tag, vgpu_demand)
from .placement import GpuOffer, Request, place

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, List, Mapping, Optional, Sequence, Tuple

DEFAULT_POOL = "default"
#: the settings key prefix (then the GPU's BDF) of a GPU the capacity reconciler moved to another pool:
#: ``FROM -> TO`` (pool names); written with the move, dropped by its undo and when the layout's pools
#: are recorded again (``vgpuhost apply`` puts the layout's pool back and says so)
REBALANCE_MOVED = "rebalance.moved."
#: the classes each scheduler policy may serve (a policy never serves a class stronger than its own)
POLICY_SERVES = {SchedulerPolicy.FIXED_SHARE: (GUARANTEED, BURSTABLE, BEST_EFFORT),
                 SchedulerPolicy.EQUAL_SHARE: (BURSTABLE, BEST_EFFORT), SchedulerPolicy.BEST_EFFORT: (BEST_EFFORT,)}
DEFAULT_POOL_SERVES = (BURSTABLE, BEST_EFFORT)


@record(frozen=True)
class Pool:
    """GPUs under one scheduler policy, serving ``classes`` (QoS classes); ``ceiling``: the expected
    GPU-time demand each GPU may carry (a share of one GPU; None: :data:`DEFAULT_CEILING`, 1.0; above
    1.0 only in a best-effort pool, up to :data:`MAX_CEILING`)."""

    name: str
    policy: str
    classes: Tuple[str, ...]
    gpus: Tuple[str, ...]
    ceiling: Optional[float] = None

    def serves(self, qos: str) -> bool:
        return qos in self.classes


def pool_problems(pools: Sequence[Pool]) -> List[str]:
    """What is wrong with a set of pools (empty: fine): a GPU in two pools (two scheduler policies on
    one GPU), an unknown policy, a class the policy cannot serve, a duplicate or reserved name."""
    out: List[str] = []
    seen: Dict[str, str] = {}
    names = set()
    for p in pools:
        if p.name.lower() in names or p.name == DEFAULT_POOL:
            out.append(f"pool {p.name!r}: " + ("the name is taken" if p.name.lower() in names else
                                               f"{DEFAULT_POOL!r} names the GPUs in no pool"))
        names.add(p.name.lower())
        if p.policy not in POLICY_SERVES:
            out.append(f"pool {p.name!r}: unknown scheduler policy {p.policy!r} (one of "
                       f"{', '.join(POLICY_SERVES)})")
            continue
        for c in p.classes:
            if c not in QOS_CLASSES:
                out.append(f"pool {p.name!r}: unknown QoS class {c!r}")
            elif c not in POLICY_SERVES[p.policy]:
                out.append(f"pool {p.name!r}: a {p.policy} pool cannot serve {c} (it serves "
                           f"{', '.join(POLICY_SERVES[p.policy])})")
        for g in p.gpus:
            if g in seen:
                out.append(f"GPU {g} is in pools {seen[g]!r} and {p.name!r}: one GPU has one scheduler policy")
            seen[g] = p.name
        why = ceiling_problem(p.policy, p.ceiling)
        if why:
            out.append(f"pool {p.name!r}: {why}")
    return out


def ceiling_problem(policy: str, ceiling: Optional[float]) -> Optional[str]:
    """What is wrong with compute ceiling ``ceiling`` (a share of one GPU per GPU) for a pool running
    ``policy`` (None: nothing), as a phrase starting ``ceiling VALUE`` (the layout's key is
    ``pool.ceiling``): not a number above 0; above 1.0 outside a best-effort pool (equal-share and
    fixed-share time slices cannot give more than the whole GPU); above :data:`MAX_CEILING`.  The
    value is shown as given (``1.0000000001``, not a rounded ``1``): the limits are exact."""
    if ceiling is None:
        return None
    if isinstance(ceiling, bool) or not isinstance(ceiling, (int, float)) or not ceiling > 0:
        return f"ceiling {ceiling!r} is not a share of a GPU above 0 (e.g. 1.0)"
    if ceiling > DEFAULT_CEILING and policy != SchedulerPolicy.BEST_EFFORT:
        kind = f"{'an' if (policy or 'undeclared')[0] in 'aeiou' else 'a'} {policy or 'undeclared'}"
        return (f"ceiling {ceiling!r} overcommits {kind} pool: only a best-effort pool may carry more than "
                f"{DEFAULT_CEILING:g} GPU of expected demand per GPU")
    if ceiling > MAX_CEILING:
        return f"ceiling {ceiling!r} is above the most allowed, {MAX_CEILING:g}"
    return None


def pool_change_refusal(old: Sequence[Pool], new: Sequence[Pool], held: Sequence[Allocation],
                        policies: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why replacing pools ``old`` by ``new`` must be refused (None: it may go ahead).

    ``held``: the allocations now.  NVML changes a GPU's scheduler policy
    only while it holds no vGPUs (NVIDIA vGPU user guide, "vGPU
    scheduler"): a GPU holding vGPUs whose policy would change (from its old
    pool's, or from ``policies``, the policy each GPU runs now by BDF) is
    refused.  So is a change that would leave a running time-sliced vGPU in
    a pool that does not serve its QoS class.
    """
    was_of = {g: p.policy for p in old for g in p.gpus}
    sliced: Dict[str, List[Allocation]] = {}
    for a in held:
        if a.kind == VGPU:
            sliced.setdefault(a.gpu, []).append(a)
    for g, here in sorted(sliced.items()):
        p = pool_of(new, g)
        was = was_of.get(g) or (policies or {}).get(g)
        if p.policy and was != p.policy:       # an unknown policy (no pool, none given) counts as another
            return (f"pool {p.name!r}: GPU {g} runs the {was or 'undeclared'} scheduler and holds vGPUs; NVML "
                    f"changes the policy (to {p.policy}) only on a GPU with no vGPUs")
        if not p.policy and g in was_of:
            return f"GPU {g} holds vGPUs: it stays in pool with the {was_of[g]} scheduler until it is empty"
        for a in here:
            if not a.mig_slices and not p.serves(a.qos):
                return f"GPU {g} holds a {a.qos} vGPU ({a.device}) and pool {p.name!r} would not serve {a.qos}"
    return None


def pool_of(pools: Sequence[Pool], gpu: str) -> Pool:
    """The pool holding ``gpu``: a declared one, else the implicit :data:`DEFAULT_POOL`."""
    for p in pools:
        if gpu in p.gpus:
            return p
    return Pool(DEFAULT_POOL, "", DEFAULT_POOL_SERVES, ())


@record(frozen=True)
class AdmissionRequest:
    """One device a domain asks for.  ``qos``: the domain's override of its tenant's class; ``gpu``: the
    GPU (passthrough) or a pin (vGPU); ``strategy`` / ``anti_affinity`` / ``numa_node`` as in placement."""

    owner: str
    demand: Demand
    tenant: Optional[str] = None
    qos: Optional[str] = None
    gpu: Optional[str] = None
    strategy: str = PlacementStrategy.DEFAULT
    anti_affinity: Optional[str] = None
    numa_node: Optional[int] = None


# ---------------------------------------------------------------------------
# use

def usage(tenant: str, allocations: Sequence[Allocation],
          quota: Optional[Quota] = None) -> Dict[str, Tuple[int, int]]:
    """``{dimension: (total use, burst use)}`` of ``tenant``'s allocations.

    With ``quota`` (the tenant's quota now), the burst part is the use above
    the guaranteed limit, up to the ceiling (0 in a dimension with no
    guarantee): use against the quota as it is now, whatever each device was
    labelled when it was admitted (a guarantee raised since, or a guaranteed
    domain stopped, leaves fewer bursts).  Without it, the part labelled burst
    at admission."""
    out = {d: (0, 0) for d in DIMENSIONS}
    for a in allocations:
        if a.tenant != tenant:
            continue
        dem = a.demand
        for d in DIMENSIONS:
            n = dem.amount(d)
            t, b = out[d]
            out[d] = (t + n, b + (n if a.burst else 0))
    if quota is not None:
        for d, (t, _) in out.items():
            g, top = quota.guaranteed.get(d), quota.ceiling(d)
            out[d] = (t, 0 if g is None else max(0, min(t, top if top is not None else t) - g))
    return out


def bursting(tenants: Mapping[str, Tenant], allocations: Sequence[Allocation]) -> List[Allocation]:
    """The allocations held as burst now: those admitted as burst whose tenant's use still passes a
    guaranteed limit it has now (a guarantee raised since, or a guaranteed domain stopped, ends a burst)."""
    over: Dict[str, bool] = {}
    out = []
    for a in allocations:
        if not (a.burst and a.tenant):
            continue
        if a.tenant not in over:
            t = tenant_named(tenants, a.tenant)
            over[a.tenant] = t is None or any(b for _, b in usage(a.tenant, allocations, t.quota).values())
        if over[a.tenant]:
            out.append(a)
    return out


def who(a: Allocation, names: Mapping[str, str]) -> str:
    """Who holds ``a``, for messages: ``domain 'vm1'`` (``names``: domain names by UUID), ``domain UUID``,
    or the owner ``manual`` / ``layout``."""
    n = names.get(a.owner)
    return f"domain {n!r}" if n else (f"domain {a.owner}" if a.owner not in Owner.POOL else a.owner)


def held_text(a: Allocation) -> str:
    """What ``a`` is, for messages: ``vGPU A40-8Q UUID on BDF`` or ``passthrough GPU BDF``."""
    return (f"vGPU {a.profile} {a.device} on {a.gpu}" if a.kind == VGPU else f"passthrough GPU {a.gpu}")


def free_line(a: Allocation, names: Mapping[str, str], extra: str = "") -> str:
    """What frees the room ``a`` holds, for a refusal's remedies: ``stop or detach domain 'vm1' (vGPU ...)``,
    or for an incoming migration's reservation (``a.reserved``: nothing runs here to stop) ``let the
    incoming migration of domain 'vm1' end, or cancel it (vGPU ...: only reserved for it, nothing runs
    here to stop)``.  ``extra``: words added inside the parentheses (``, no tenant``)."""
    if a.reserved:
        return (f"let the incoming migration of {who(a, names)} end, or cancel it ({held_text(a)}{extra}: only "
                "reserved for it, nothing runs here to stop)")
    return f"stop or detach {who(a, names)} ({held_text(a)}{extra})"


def standing(tenant: Optional[Tenant], tname: Optional[str], allocations: Sequence[Allocation]) -> str:
    """Who asks, with its quota and its use now, for refusals: ``tenant 'team' (quota vGPUs 1:2, 1 in
    use; framebuffer MiB 16384, 8192 in use)``, ``tenant 'team' (no quota limit; 1 vGPU in use)``,
    or ``a domain without a tenant``."""
    if tname is None:
        return "a domain without a tenant"
    used = usage(tname, allocations)
    if tenant is None:
        return f"tenant {tname!r}"
    parts = [f"{DIMENSION_TEXT[d]} {tenant.quota.text(d)}, {used[d][0]} in use" for d in DIMENSIONS
             if tenant.quota.guaranteed.get(d) is not None]
    if parts:
        return f"tenant {tenant.name!r} (quota " + "; ".join(parts) + ")"
    return f"tenant {tenant.name!r} (no quota limit; {used['vgpus'][0]} vGPU(s), " \
           f"{used['passthrough_gpus'][0]} passthrough GPU(s) in use)"


# ---------------------------------------------------------------------------
# the decision

def admit(req: AdmissionRequest, *, tenants: Mapping[str, Tenant], allocations: Sequence[Allocation],
          pools: Sequence[Pool] = (), offers: Sequence[GpuOffer] = (),
          gpu_memory: Optional[Mapping[str, int]] = None, names: Optional[Mapping[str, str]] = None,
          gpu_slices: Optional[Mapping[str, int]] = None, gpus: Optional[Sequence[HostGpu]] = None,
          policies: Optional[Mapping[str, str]] = None) -> Admission:
    """Decide ``req``: quota -> isolation -> QoS class -> pool -> placement (module docstring).

    ``tenants``: every tenant by name (empty: tenancy is not in use, and a
    tenant name is only recorded); ``allocations``: every device held now,
    the requesting domain's others included; ``pools``: the declared pools
    (:func:`pool_problems` must find nothing); ``offers``: for a vGPU, one
    :class:`GpuOffer` per vGPU-capable GPU for the profile (as
    :func:`vgpuhost.ops.vgpu.offers` builds them); ``gpu_memory``: total
    framebuffer per GPU (MiB, by BDF) for the reserve of unused guarantees
    (unknown GPUs are left out of it); ``gpu_slices``: compute slices per
    GPU in MIG mode (the same reserve, for MIG slices); ``gpus``: every
    GPU of the host as the reserve sees it (:class:`HostGpu`: the types it
    offers; None: built from ``gpu_memory``, ``gpu_slices`` and ``offers``,
    each GPU offering the type asked and the types it holds); ``names``:
    domain names by UUID, for messages; ``policies``: the scheduler policy each GPU
    runs now (by BDF, as NVML reads it under the host lock; None, or a GPU
    left out: not known, not checked): a GPU of a declared pool running
    another policy than its pool's is *in drift* and takes no time-sliced
    vGPU of any class until ``vgpuhost apply`` sets its pool's policy again.
    Never raises for a refusal: it is the returned decision.
    """
    names = names or {}
    dem = req.demand
    tenant: Optional[Tenant] = None
    if req.tenant is not None:
        tenant = tenant_named(tenants, req.tenant)
        if tenant is None and tenants:
            known = ", ".join(sorted(tenants)[:8])
            return Admission(False, f"unknown tenant {req.tenant!r} (tenants: {known})", req.tenant,
                             req.qos or UNTENANTED_QOS, code="unknown-tenant", frees=(_add_hint(req.tenant),))
    tname = tenant.name if tenant is not None else req.tenant
    qos = req.qos or (tenant.qos if tenant is not None else UNTENANTED_QOS)

    def refuse(code: str, reason: str, *, quota: str = "", frees=(), burst: bool = False,
               candidates=()) -> Admission:
        return Admission(False, reason, tname, qos, burst, code, quota, candidates=tuple(candidates),
                         frees=tuple(frees))

    # 1. quota, 2. isolation, 3. QoS class
    burst, quota_note, refusal = False, "", None
    if tenant is not None:
        burst, quota_note, refusal = _quota(dem, tenant, allocations, names, refuse, req.owner)
    if refusal is None:
        refusal = _class_refusal(dem, tenant, qos, pools, refuse)
    if refusal is not None:
        return refusal
    # 4. pool + isolation per GPU
    if dem.kind == PASSTHROUGH:
        return _passthrough(req, tenant, tname, qos, burst, quota_note, tenants, allocations, gpu_memory, names,
                            gpu_slices, pools, gpus)
    narrowed, candidates, refusal = _narrow(dem, tenant, tname, qos, pools, offers, tenants, allocations, names,
                                            refuse, policies)
    if refusal is not None:
        return _naming_takers(refusal, tenant, tname, burst, narrowed, tenants, allocations, names)
    # use no guarantee covers leaves room for the other tenants' unused guarantees (module docstring)
    reserved = _reserved(tname, tenants, allocations)
    unguaranteed = bool(reserved) and (tenant is None or burst or not _covered(tenant, dem))
    kept: List[str] = []
    size_note = ""
    memory = _memory(gpu_memory, gpus)
    load = compute.gpu_load(allocations, memory, lambda g: pool_of(pools, g).policy)
    if unguaranteed:
        narrowed, candidates, kept, size_note = _keep_reserve(
            dem, req, tname, narrowed, candidates, tenants, allocations, pools,
            _with_room(host_gpus(gpus, gpu_memory, gpu_slices, offers, dem, allocations), load, pools))
    # GPU time: close the GPUs where the expected demand would pass the pool's compute ceiling
    narrowed, timed = _fit_gpu_time(dem, narrowed, load, memory, pools)
    # 5. placement (a guaranteed request first where the other guarantees stay servable)
    keep = _with_room(host_gpus(gpus, gpu_memory, gpu_slices, offers, dem, allocations), load, pools) \
        if reserved and not unguaranteed else []
    decision = _place_keeping(dem, req, tname, tenant, tenants, allocations, narrowed, pools, keep)
    if not decision.admitted and kept:
        return refuse("burst", f"{_asker(dem, tenant, tname, burst)} refused: {size_note}", burst=burst,
                      candidates=candidates, frees=_reserve_frees(tenant, dem, burst, reserved))
    if not decision.admitted and timed:
        use = compute.expected(dem, memory.get(timed[0]), pool_of(pools, timed[0]).policy)
        return refuse("gpu-time", f"no GPU time for {dem.text()} of {standing(tenant, tname, allocations)}: it "
                                  f"expects {use.text()}, and no GPU where its framebuffer fits has that much left "
                                  f"under its pool's compute ceiling: {decision.reason}",
                      candidates=candidates, burst=burst,
                      frees=("wait for GPU time to free (a vGPU to stop)",
                             "raise the pool's compute ceiling (best-effort pools: pool.ceiling in the layout)",
                             "'vgpuhost capacity' shows the GPU time expected per GPU"))
    if not decision.admitted:
        frees = _claimable(dem, tenant, tname, unguaranteed, candidates, tenants, allocations, names, gpu_memory)
        return refuse("capacity", f"no room for {dem.text()} of {standing(tenant, tname, allocations)}: "
                                  f"{decision.reason}", frees=frees, candidates=candidates, burst=burst)
    gpu = str(decision.gpu)
    return _admitted(dem, tname, qos, burst, quota_note, None if dem.hardware else pool_of(pools, gpu).name,
                     decision, candidates)


def _memory(gpu_memory: Optional[Mapping[str, int]], gpus: Optional[Sequence[HostGpu]]) -> Dict[str, int]:
    """Framebuffer MiB by BDF: ``gpu_memory``, else the host's GPUs as the reserve sees them."""
    if gpu_memory:
        return dict(gpu_memory)
    return {g.gpu: g.framebuffer_mib for g in gpus or ()}


def gpu_time_room(gpus: Sequence[HostGpu], allocations: Sequence[Allocation], pools: Sequence[Pool]) -> List[HostGpu]:
    """``gpus`` (:class:`HostGpu`) with the GPU time each has left under its pool's ceiling, given the
    expected demand of ``allocations`` there (``HostGpu.compute_room``): the facts the guarantees are
    checked on (``tenant add|set``), as admission's reserve counts them."""
    memory = {g.gpu: g.framebuffer_mib for g in gpus}
    return _with_room(gpus, compute.gpu_load(allocations, memory, lambda g: pool_of(pools, g).policy), pools)


def _with_room(gpus: Sequence[HostGpu], load: Mapping[str, float], pools: Sequence[Pool]) -> List[HostGpu]:
    """``gpus`` with the GPU time left under each one's pool ceiling (``HostGpu.compute_room``)."""
    return [replace(g, compute_room=compute.room(load.get(g.gpu, 0.0), compute.ceiling_of(pool_of(pools, g.gpu))))
            for g in gpus]


def _fit_gpu_time(dem: Demand, narrowed: List[GpuOffer], load: Mapping[str, float], memory: Mapping[str, int],
                  pools: Sequence[Pool]) -> Tuple[List[GpuOffer], List[str]]:
    """Close the offers where time-sliced ``dem``'s expected GPU-time demand would pass the GPU's pool
    ceiling: ``(offers, the BDFs closed for GPU time)``; a hardware partition closes none."""
    if not compute.sliced(dem):
        return narrowed, []
    out: List[GpuOffer] = []
    closed: List[str] = []
    for o in narrowed:
        g = str(o.gpu)
        if o.available > 0:
            pool = pool_of(pools, g)
            share = compute.expected(dem, memory.get(g), pool.policy).share
            here, top = load.get(g, 0.0), compute.ceiling_of(pool)
            if not compute.fits(share, here, top):
                closed.append(g)
                o = replace(o, available=0, parents=(), note=f"GPU time: {here:.2f} expected + {share:.2f} asked "
                                                             f"> ceiling {top:g} of pool {pool.name!r}")
        out.append(o)
    return out, closed


def _claimable(dem: Demand, tenant: Optional[Tenant], tname: Optional[str], unguaranteed: bool,
               candidates: Sequence[str], tenants: Mapping[str, Tenant], allocations: Sequence[Allocation],
               names: Mapping[str, str], gpu_memory: Optional[Mapping[str, int]] = None) -> List[str]:
    """What would make room on ``candidates`` for a demand placement refused: for a guarantee, the
    room it may claim back (other tenants' bursts, then domains with no tenant) on the one candidate
    GPU where freeing them would admit it (:func:`_freeing`); then the capacity hint."""
    frees = []
    if not unguaranteed and tenant is not None:
        frees = _holders(_freeing(dem, tname, candidates, tenants, allocations, gpu_memory), tname, names,
                         tenants, allocations)
    frees.append("'vgpuhost capacity' shows what fits where")
    return frees


def _freeing(dem: Demand, tname: Optional[str], candidates: Sequence[str], tenants: Mapping[str, Tenant],
             allocations: Sequence[Allocation], gpu_memory: Optional[Mapping[str, int]]) -> List[Allocation]:
    """The fewest allocations a guarantee may claim back (other tenants' bursts, devices with no tenant
    but the layout's) whose end would let ``dem`` onto one of ``candidates``; empty when no such set
    exists on any of them.  A time-sliced vGPU needs every vGPU of another size gone from the GPU
    (equal-size mode) and its framebuffer free (``gpu_memory``: MiB per GPU; a GPU not named there
    counts the claimable ones on it as the set); a MIG-backed vGPU or a passthrough GPU the whole
    set on the GPU (its slices or the GPU are not counted here)."""
    now = set(id(a) for a in bursting(tenants, allocations))
    best: List[Allocation] = []
    for gpu in candidates:
        on = [a for a in allocations if a.gpu == gpu]
        claim = [a for a in on if a.tenant != tname and (id(a) in now or (a.tenant is None and
                                                                             a.owner != Owner.LAYOUT))]
        if not claim:
            continue
        keep = [a for a in on if all(a is not c for c in claim)]
        if dem.kind != VGPU or dem.mig_slices or not dem.framebuffer_mib:
            if keep:
                continue        # a GPU or its slices others keep: not freed by these alone
            chosen = claim
        else:
            if any(a.framebuffer_mib != dem.framebuffer_mib or a.kind != VGPU for a in keep):
                continue        # another size (or a passthrough) stays: equal-size mode refuses it still
            chosen = [a for a in claim if a.framebuffer_mib != dem.framebuffer_mib or a.kind != VGPU]
            mem = (gpu_memory or {}).get(gpu)
            if mem is None:
                chosen = claim
            else:
                free = mem - sum(a.framebuffer_mib for a in on if all(a is not c for c in chosen))
                for a in sorted((c for c in claim if all(c is not x for x in chosen)), key=lambda a: a.device):
                    if free >= dem.framebuffer_mib:
                        break
                    chosen.append(a)
                    free += a.framebuffer_mib
                if free < dem.framebuffer_mib:
                    continue
            rest = [c for c in claim if all(c is not x for x in chosen)]
            if not chosen and rest:
                chosen = rest[:1]   # the framebuffer fits, yet placement found no instance free: free one
        if chosen and (not best or len(chosen) < len(best)):
            best = chosen
    return best


def _admitted(dem: Demand, tname: Optional[str], qos: str, burst: bool, quota_note: str, pool: Optional[str],
              decision, candidates: Sequence[str]) -> Admission:
    """The admission of a placed vGPU, its reason naming tenant, class, quota, pool and placement."""
    parts = [f"admitted {dem.text()} for " + (f"tenant {tname!r}" if tname else "a domain without a tenant"),
             f"class {qos}" + (" (burst)" if burst else "")]
    if quota_note:
        parts.append(quota_note)
    if pool:
        parts.append(f"pool {pool}")
    parts.append(decision.reason)
    return Admission(True, "; ".join(parts), tname, qos, burst, "ok", gpu=str(decision.gpu),
                     parent=str(decision.parent), type_id=decision.type_id, candidates=tuple(candidates), pool=pool)


def _quota(dem: Demand, tenant: Tenant, allocations: Sequence[Allocation], names: Mapping[str, str],
           refuse, owner: str = "") -> Tuple[bool, str, Optional[Admission]]:
    """Step 1, the tenant's quota: ``(burst, note for the reason, refusal or None)``; ``burst`` when the
    demand passes a guaranteed limit (within the ceiling).  ``refuse`` builds the refusal, whose remedies
    name the tenant's other domains, never ``owner`` (the domain asking: stopping it frees nothing for
    its own start; its devices admitted first count, and asking for fewer is the remedy)."""
    q = tenant.quota
    if q.series and dem.kind == VGPU and dem.series not in q.series:
        return False, "", refuse("series", f"tenant {tenant.name!r} may use vGPU series "
                                           f"{', '.join(sorted(q.series))} only; {dem.profile} is series "
                                           f"{dem.series or '?'}", quota="series",
                                 frees=(f"use a {'/'.join(sorted(q.series))} profile, or widen the quota "
                                        f"('vgpuhost tenant set {tenant.name} --series ...')",))
    used = usage(tenant.name, allocations)
    burst = False
    notes = []
    for d in DIMENSIONS:
        n = dem.amount(d)
        if not n:
            continue
        total, _ = used[d]
        ceiling = q.ceiling(d)
        g = q.guaranteed.get(d)
        if ceiling is not None and total + n > ceiling:
            mine = sorted((a for a in allocations if a.tenant == tenant.name and a.demand.amount(d)
                           and a.owner != owner), key=lambda a: (-a.demand.amount(d), a.device))
            frees = [free_line(a, names) for a in mine[:3]]
            own = sum(a.demand.amount(d) for a in allocations if a.tenant == tenant.name and a.owner == owner)
            if own:
                frees.append(f"ask for fewer devices in this domain (its other devices take {own} of it)")
            frees.append(("or raise" if frees else "raise") + f" the quota ('vgpuhost tenant set {tenant.name} "
                         f"--{d.replace('_mib', '').replace('_gpus', '').replace('_', '-')} ...')")
            kind = "burst" if q.burst.get(d) is not None else "guaranteed"
            return False, "", refuse("quota", f"quota {DIMENSION_TEXT[d]} of tenant {tenant.name!r}: {total} in "
                                              f"use + {n} asked > {ceiling} ({kind} limit)", quota=d, frees=frees)
        if g is not None and total + n > g:
            burst = True
        if g is not None:
            notes.append(f"{DIMENSION_TEXT[d]} {total + n}/{q.text(d)}")
    return burst, "quota " + (", ".join(notes) if notes else "unlimited"), None


def _class_refusal(dem: Demand, tenant: Optional[Tenant], qos: str, pools: Sequence[Pool],
                   refuse) -> Optional[Admission]:
    """Steps 2 and 3: the tenant's isolation level and the QoS class, refused or None."""
    if tenant is not None and tenant.isolation == HARDWARE and not dem.hardware:
        return refuse("isolation", f"tenant {tenant.name!r} has isolation 'hardware': MIG-backed vGPUs and "
                                   f"passthrough only, not the time-sliced {dem.profile}",
                      frees=("ask for a MIG-backed profile (e.g. <board>-1-<GB>C) or a passthrough GPU",))
    if qos not in QOS_CLASSES:
        return refuse("qos", f"unknown QoS class {qos!r}", frees=("one of " + ", ".join(QOS_CLASSES),))
    if qos == GUARANTEED and not dem.hardware and not any(p.policy == SchedulerPolicy.FIXED_SHARE and p.serves(GUARANTEED)
                                                            for p in pools):
        return refuse("qos", f"QoS class guaranteed needs a hardware partition (a MIG-backed vGPU or "
                             f"passthrough) or a GPU in a fixed-share pool; {dem.profile} is time-sliced and no "
                             "fixed-share pool serves guaranteed",
                      frees=("declare a fixed-share pool in the layout, ask for a MIG-backed profile, or set the "
                             "domain's qos to burstable",))
    return None


def _narrow(dem: Demand, tenant: Optional[Tenant], tname: Optional[str], qos: str, pools: Sequence[Pool],
            offers: Sequence[GpuOffer], tenants: Mapping[str, Tenant], allocations: Sequence[Allocation],
            names: Mapping[str, str], refuse, policies: Optional[Mapping[str, str]] = None
            ) -> Tuple[List[GpuOffer], List[str], Optional[Admission]]:
    """Step 4 for a vGPU, the pools and isolation per GPU: ``(offers, each closed with its reason when
    the GPU may not take the demand; the BDFs that may; refusal or None)``.  A GPU whose running
    scheduler policy (``policies``) is not its declared pool's is closed as in drift."""
    by_gpu = _by_gpu(allocations)
    narrowed: List[GpuOffer] = []
    candidates: List[str] = []
    served_any = False
    drifted: List[str] = []
    for o in offers:
        g = str(o.gpu)
        why = None
        if not dem.hardware:
            pool = pool_of(pools, g)
            if not pool.serves(qos):
                why = f"pool {pool.name!r} does not serve {qos}"
            elif drift_note(pool, g, policies):
                served_any = True
                drifted.append(g)
                why = drift_note(pool, g, policies)
            else:
                served_any = True
                why = _isolation_conflict(tenant, tname, by_gpu.get(g, ()), tenants)
        if why is None:
            candidates.append(g)
            narrowed.append(o)
        else:
            narrowed.append(replace(o, available=0, parents=(), note=why))
    if not dem.hardware and not offers and any(a.kind == PASSTHROUGH for a in allocations):
        # every vGPU-capable GPU is passed through (a GPU bound to vfio-pci offers no vGPU types)
        frees = _holders([a for a in allocations if a.kind == PASSTHROUGH], tname, names, tenants, allocations)
        return narrowed, candidates, refuse(
            "capacity", f"no room for {dem.text()}: no GPU offers vGPUs now (the GPUs are passed through)",
            frees=frees + ["'vgpuhost capacity' shows what fits where"])
    if not dem.hardware and not served_any:
        serving = [p.name for p in pools if p.serves(qos)]
        return narrowed, candidates, refuse(
            "pool", f"no pool serves QoS class {qos} on this host"
                    + (f" (pools serving it: {', '.join(serving)}, none with a GPU offering {dem.profile})"
                       if serving else ""),
            frees=("declare a pool serving it in the layout, or change the domain's qos",))
    if not candidates and drifted:
        rej = "; ".join(f"{o.gpu}: {o.note}" for o in narrowed if o.note)
        return narrowed, candidates, refuse(
            "pool", f"no GPU may take {dem.text()} of "
                    f"{('tenant ' + repr(tname)) if tname else 'a domain without a tenant'}: {rej}",
            frees=("run 'vgpuhost apply' with the host's layout to set each pool's scheduler policy again (on a "
                   "GPU with no vGPUs)",))
    if not candidates:
        rej = "; ".join(f"{o.gpu}: {o.note}" for o in narrowed if o.note) or "no vGPU-capable GPU"
        return narrowed, candidates, refuse(
            "isolation", f"no GPU may take {dem.text()} of "
                         f"{('tenant ' + repr(tname)) if tname else 'a domain without a tenant'} "
                         f"under its isolation: {rej}",
            frees=("wait for a GPU to empty, or change the tenant's isolation or labels",))
    return narrowed, candidates, None


def drift_note(pool: Pool, gpu: str, policies: Optional[Mapping[str, str]]) -> str:
    """Why ``gpu`` of ``pool`` serves no class now: it runs another scheduler policy than its pool's
    (``policies``: the policy each GPU runs, by BDF); '' when it does not, or that is not known (no
    policy read, or the implicit pool, whose policy is whatever the GPU runs)."""
    now = (policies or {}).get(gpu)
    if not now or not pool.policy or now == pool.policy:
        return ""
    return (f"GPU {gpu} runs the {now} scheduler, not the {pool.policy} of its pool {pool.name!r}: in drift, it "
            f"serves no class until 'vgpuhost apply' sets the pool's policy again")


def _by_gpu(allocations: Sequence[Allocation]) -> Dict[str, List[Allocation]]:
    by_gpu: Dict[str, List[Allocation]] = {}
    for a in allocations:
        by_gpu.setdefault(a.gpu, []).append(a)
    return by_gpu


def _place_keeping(dem: Demand, req: AdmissionRequest, tname: Optional[str], tenant: Optional[Tenant],
                   tenants: Mapping[str, Tenant], allocations: Sequence[Allocation], narrowed: List[GpuOffer],
                   pools: Sequence[Pool], gpus: Sequence[HostGpu]):
    """Step 5 for a request a guarantee covers: placement first over the GPUs where the other tenants'
    unused guarantees stay servable (``gpus``: the facts; empty: no such preference), then over all."""
    if gpus:
        _, _, kept, _ = _keep_reserve(dem, req, tname, narrowed, [str(o.gpu) for o in narrowed], tenants,
                                      allocations, pools, gpus)
        if kept:
            first = _place_weakest_first(dem, req, tenant, tenants, allocations,
                                         [o for o in narrowed if str(o.gpu) not in kept], pools)
            if first.admitted:
                return first
    return _place_weakest_first(dem, req, tenant, tenants, allocations, narrowed, pools)


def _place_weakest_first(dem: Demand, req: AdmissionRequest, tenant: Optional[Tenant], tenants: Mapping[str, Tenant],
                         allocations: Sequence[Allocation], narrowed: Sequence[GpuOffer], pools: Sequence[Pool]):
    """Placement of a time-sliced vGPU over the GPUs of the pools whose strongest class served is weakest first
    (:func:`pool_tier`: best-effort-only pools, then pools serving up to burstable, then those serving
    guaranteed), a tier taken only when none below it fits: a pool's room is what the stronger classes it
    serves can use, and they can use no other pool.  A pinned request, a hardware partition, or a host
    without declared pools: over all at once.  The final try is over all of ``narrowed``, so a refusal
    names every GPU."""
    if compute.sliced(dem) and req.gpu is None and pools:
        tiers: Dict[int, List[GpuOffer]] = {}
        for o in narrowed:
            if o.available > 0:
                tiers.setdefault(pool_tier(pool_of(pools, str(o.gpu))), []).append(o)
        for rank in sorted(tiers)[:-1]:
            first = _place_preferred(dem, req, tenant, tenants, allocations, tiers[rank])
            if first.admitted:
                return first
    return _place_preferred(dem, req, tenant, tenants, allocations, narrowed)


#: the strength of each QoS class, weakest 0 (:func:`pool_tier`)
CLASS_RANK = {BEST_EFFORT: 0, BURSTABLE: 1, GUARANTEED: 2}


def pool_tier(pool: Pool) -> int:
    """The rank in :data:`CLASS_RANK` of the strongest class ``pool`` serves (0 for a pool serving none):
    placement fills the pools of the lowest tier first."""
    return max((CLASS_RANK.get(c, 0) for c in pool.classes), default=0)


def _place_preferred(dem: Demand, req: AdmissionRequest, tenant: Optional[Tenant], tenants: Mapping[str, Tenant],
                     allocations: Sequence[Allocation], narrowed: Sequence[GpuOffer]):
    """Step 5: placement over ``narrowed``, first on the GPUs holding a tenant the requester prefers."""
    preq = Request(dem.profile, req.owner, req.strategy, req.numa_node, req.anti_affinity,
                   _addr(req.gpu) if req.gpu else None)
    if tenant is not None and tenant.prefer:
        liked = set()
        for g, held in _by_gpu(allocations).items():
            for a in held:
                other = tenant_named(tenants, a.tenant) if a.tenant else None
                if other is not None and other.labels & tenant.prefer:
                    liked.add(g)
        if liked:
            first = place([o for o in narrowed if str(o.gpu) in liked], preq)
            if first.admitted:
                return replace(first, reason=first.reason + f"; preferred: GPUs holding "
                                                            f"{', '.join(sorted(tenant.prefer))}")
    return place(narrowed, preq)


def _add_hint(name: str) -> str:
    """How to admit a domain naming the unknown tenant ``name``: a command that works (quoted for a shell),
    or, for a name no tenant can have (an OpenStack project name with spaces), what to do instead."""
    from ..model.errors import InputError
    from ..model.tenancy import check_name
    try:
        check_name(name)
    except InputError:
        return (f"no tenant can be called {name[:64]!r} (letters, digits and _.:+- only): map OpenStack projects "
                "by UUID ('vgpuhost tenant openstack --map project-uuid') or name a tenant in the domain "
                "('vgpuhost attach --tenant T')")
    import shlex
    return f"add it ('vgpuhost tenant add {shlex.quote(name)}') or fix the domain's tenant"


def _addr(text: str):
    from ..model.values import PciAddress
    return PciAddress.parse(text)


def _isolation_conflict(me: Optional[Tenant], my_name: Optional[str], held: Sequence[Allocation],
                        tenants: Mapping[str, Tenant]) -> Optional[str]:
    """Why a time-sliced vGPU of ``me`` may not join the time-sliced vGPUs ``held`` on one GPU."""
    for a in held:
        if a.demand.hardware:
            continue                            # a MIG partition or passthrough: no shared time slices
        if a.tenant is not None and my_name is not None and a.tenant.lower() == my_name.lower():
            continue
        other = tenant_named(tenants, a.tenant) if a.tenant else None
        if a.tenant and other is None:
            other = Tenant(a.tenant)            # a tenant since removed, or named while tenancy was off
        if me is not None:
            why = me.conflicts(other)
        elif other is not None and other.isolation == EXCLUSIVE:
            why = f"tenant {other.name!r} is exclusive: its time-sliced GPUs hold no other tenant's vGPUs"
        else:
            why = None
        if why:
            return why
    return None


def _passthrough(req: AdmissionRequest, tenant: Optional[Tenant], tname: Optional[str], qos: str, burst: bool,
                 quota_note: str, tenants: Mapping[str, Tenant], allocations: Sequence[Allocation],
                 gpu_memory: Optional[Mapping[str, int]], names: Mapping[str, str],
                 gpu_slices: Optional[Mapping[str, int]] = None, pools: Sequence[Pool] = (),
                 gpus: Optional[Sequence[HostGpu]] = None) -> Admission:
    gpu = req.gpu or ""
    held = [a for a in allocations if a.gpu == gpu and a.owner != req.owner
            and not (a.kind == PASSTHROUGH and a.owner in Owner.POOL)]   # bound by the operator for guests
    if held:
        a = held[0]
        frees = [free_line(a, names)]
        if a.tenant != tname and not burst and a in bursting(tenants, allocations):
            frees.insert(0, f"tenant {a.tenant!r} holds it as burst")
        return Admission(False, f"no room for passthrough GPU {gpu}: it holds {held_text(a)} of {who(a, names)}",
                         tname, qos, burst, "capacity", frees=tuple(frees))
    dem = req.demand
    reserved = _reserved(tname, tenants, allocations)
    if reserved and (tenant is None or burst or not _covered(tenant, dem)):
        short = _reserve_short(dem, req, tname, gpu, tenants, allocations, pools,
                               host_gpus(gpus, gpu_memory, gpu_slices, (), dem, allocations))
        if short:
            return Admission(False, f"{_asker(dem, tenant, tname, burst)} refused: {short}", tname, qos, burst,
                             "burst", frees=tuple(_reserve_frees(tenant, dem, burst,
                                                                                          reserved)))
    parts = ["admitted passthrough GPU " + gpu + " for " + (f"tenant {tname!r}" if tname else
                                                             "a domain without a tenant"),
             f"class {qos}" + (" (burst)" if burst else "")]
    if quota_note:
        parts.append(quota_note)
    return Admission(True, "; ".join(parts), tname, qos, burst, "ok", gpu=gpu, candidates=(gpu,) if gpu else ())


# ---------------------------------------------------------------------------
# the reserve of unused guarantees

def _covered(tenant: Tenant, dem: Demand) -> bool:
    """Does a guarantee of ``tenant`` cover ``dem`` (a dimension it uses has a guaranteed limit)?  Called
    when it is not a burst: a covered request is within every guarantee it touches."""
    return any(tenant.quota.guaranteed.get(d) is not None and dem.amount(d) for d in DIMENSIONS)


def _reserved(me: Optional[str], tenants: Mapping[str, Tenant],
              allocations: Sequence[Allocation]) -> List[Tuple[str, Dict[str, int]]]:
    """The other tenants' unused guarantees: ``[(tenant, {dimension: unused})]``, by name, none empty.
    Unused = guaranteed limit - the tenant's use now (what it holds fills its guarantee first, whatever
    each device was labelled at admission: a burst left running after a guaranteed domain stopped, or
    under a guarantee raised since, is guaranteed use now)."""
    out = []
    for name in sorted(tenants):
        if name == me:
            continue
        t = tenants[name]
        u = None
        left: Dict[str, int] = {}
        for d in DIMENSIONS:
            g = t.quota.guaranteed.get(d)
            if not g:
                continue
            if u is None:
                u = usage(name, allocations)
            total, _ = u[d]
            if g - total > 0:
                left[d] = g - total
        if left:
            out.append((name, left))
    return out


def host_gpus(gpus: Optional[Sequence[HostGpu]], gpu_memory: Optional[Mapping[str, int]],
              gpu_slices: Optional[Mapping[str, int]], offers: Sequence[GpuOffer], dem: Demand,
              allocations: Sequence[Allocation]) -> List[HostGpu]:
    """The GPUs as the reserve sees them: ``gpus`` when given, else one :class:`HostGpu` per GPU of
    ``gpu_memory`` offering the type asked (where ``offers`` lists it) and the types it holds (none
    known: any size)."""
    if gpus is not None:
        return list(gpus)
    types_of: Dict[str, set] = {}
    for o in offers:
        if o.type_id is not None:
            types_of.setdefault(str(o.gpu), set()).add((o.type_name or dem.profile, dem.framebuffer_mib,
                                                         dem.mig_slices))
    for a in allocations:
        if a.kind == VGPU:
            types_of.setdefault(a.gpu, set()).add((a.profile, a.framebuffer_mib, a.mig_slices))
    out = []
    for g, mem in sorted((gpu_memory or {}).items()):
        t = types_of.get(g)
        sl = (gpu_slices or {}).get(g, 0)
        out.append(HostGpu(g, mem, tuple(sorted(t)) if t and not sl else None, sl))   # MIG: any slice count
    return out


def serves_of(pools: Sequence[Pool]):
    """``serves(gpu, qos)``: whether the pool of ``gpu`` serves QoS class ``qos``."""
    return lambda gpu, qos: pool_of(pools, gpu).serves(qos)


def _asked(req: AdmissionRequest, tname: Optional[str], gpu: str, dem: Demand) -> Allocation:
    return Allocation("(asked)", req.owner, tname, gpu, dem.kind, dem.profile, dem.framebuffer_mib, dem.mig_slices)


def _keep_reserve(dem: Demand, req: AdmissionRequest, tname: Optional[str], narrowed: List[GpuOffer],
                  candidates: List[str], tenants: Mapping[str, Tenant], allocations: Sequence[Allocation],
                  pools: Sequence[Pool], gpus: Sequence[HostGpu]) -> Tuple[List[GpuOffer], List[str], List[str], str]:
    """Close the GPUs where ``dem`` (use no guarantee covers) would leave another tenant's unused guarantee
    unservable (:class:`vgpuhost.policy.feasibility.Reserve`): ``(offers, candidates left, GPUs closed,
    why)``.  Only GPUs the guaranteed tenants can use count as their room (the types they use or their
    series, their pool's class, isolation and avoid rules)."""
    if not gpus:
        return narrowed, candidates, [], ""
    res = Reserve(tname, tenants=tenants, allocations=allocations, gpus=gpus, serves=serves_of(pools))
    if not res.wanted:
        return narrowed, candidates, [], ""
    known = {g.gpu for g in gpus}
    out: List[GpuOffer] = []
    kept: List[str] = []
    why: Dict[Tuple[bool, str], List[str]] = {}
    for o in narrowed:
        g = str(o.gpu)
        if g in candidates and o.available > 0 and g in known:
            bad, sized = res.breaks(_asked(req, tname, g, dem))
            if bad:
                kept.append(g)
                sized = not any(a.gpu == g for a in allocations) and (
                    sized or all(res.other_size(n, dem.framebuffer_mib) for n in bad))
                why.setdefault((sized, res.text(bad)), []).append(g)
                o = replace(o, available=0, parents=(), note=_held_note(dem, [g], sized, res.text(bad)))
        out.append(o)
    note = "; ".join(_held_note(dem, gs, sized, text) for (sized, text), gs in why.items())
    return out, [g for g in candidates if g not in kept], kept, note


def _held_note(dem: Demand, gpus: Sequence[str], sized: bool, text: str) -> str:
    if sized and dem.kind == VGPU and not dem.mig_slices:
        return (f"a first {dem.framebuffer_mib} MiB vGPU on {', '.join(gpus)} would fix its vGPU size (equal-size "
                f"mode), leaving no GPU of the size asked for other tenants' unused guarantees ({text})")
    return (f"the room on {', '.join(gpus)} is held for other tenants' unused guarantees ({text}): they could not "
            f"all be served with it taken")


def _reserve_short(dem: Demand, req: AdmissionRequest, tname: Optional[str], gpu: str,
                   tenants: Mapping[str, Tenant], allocations: Sequence[Allocation], pools: Sequence[Pool],
                   gpus: Sequence[HostGpu]) -> Optional[str]:
    """Why ``dem`` on ``gpu`` (use no guarantee covers) would take room other tenants' unused guarantees
    hold (None: it would not)."""
    if not gpus or gpu not in {g.gpu for g in gpus}:
        return None
    res = Reserve(tname, tenants=tenants, allocations=allocations, gpus=gpus, serves=serves_of(pools))
    bad, sized = res.breaks(_asked(req, tname, gpu, dem))
    return _held_note(dem, [gpu], sized, res.text(bad)) if bad else None


def _naming_takers(refusal: Admission, tenant: Optional[Tenant], tname: Optional[str], burst: bool,
                   narrowed: Sequence[GpuOffer], tenants: Mapping[str, Tenant], allocations: Sequence[Allocation],
                   names: Mapping[str, str]) -> Admission:
    """An isolation refusal of a tenant's guaranteed request names what holds the GPUs its isolation
    closed that no guarantee covers (other tenants' bursts, use with no tenant) before the other remedies."""
    if refusal.code != "isolation" or tenant is None or burst:
        return refusal
    closed = {str(o.gpu) for o in narrowed if o.note}
    held = [a for a in allocations if a.gpu in closed and a.tenant != tname]
    takers = _holders(held, tname, names, tenants, allocations)
    if not takers:
        return refusal
    return replace(refusal, frees=tuple(takers) + tuple(refusal.frees))


def _asker(dem: Demand, tenant: Optional[Tenant], tname: Optional[str], burst: bool) -> str:
    what = "burst passthrough" if dem.kind == PASSTHROUGH and burst else ("burst" if burst else dem.text())
    if tenant is None:
        return f"{what} for a domain without a tenant"
    return f"{what} for tenant {tname!r}" + ("" if burst else " (no guarantee covers it)")


def _reserve_frees(tenant: Optional[Tenant], dem: Demand, burst: bool, reserved) -> List[str]:
    """What would let a request refused for the reserve in."""
    out = ["wait for free capacity"]
    if tenant is None:
        out.append("give the domain a tenant whose guarantee covers it ('vgpuhost attach --tenant T')")
    else:
        dims = [d for d in DIMENSIONS if dem.amount(d)]
        opt = dims[0].replace("_mib", "").replace("_gpus", "").replace("_", "-") if dims else "vgpus"
        out.append(f"raise the guaranteed limit of tenant {tenant.name!r} ('vgpuhost tenant set "
                   f"{tenant.name} --{opt} G[:B]')")
    out.append("or lower the guarantees held (" + ", ".join(f"'vgpuhost tenant set {n} ...'" for n, _ in reserved[:3])
               + ")")
    return out


def _holders(allocations: Sequence[Allocation], me: Optional[str], names: Mapping[str, str],
             tenants: Mapping[str, Tenant], every: Sequence[Allocation]) -> List[str]:
    """Remedies naming what holds room a guarantee may claim back: other tenants' bursts first (as
    :func:`bursting` finds them over ``every`` allocation), then domains and vGPUs with no tenant (at
    most 4, then how many more)."""
    out = []
    now = bursting(tenants, every)
    bursts = sorted((a for a in allocations if a in now and a.tenant != me), key=lambda a: (a.gpu, a.device))
    loose = sorted((a for a in allocations if a.tenant is None and a.owner != Owner.LAYOUT),
                   key=lambda a: (a.gpu, a.device))
    for a in bursts:
        out.append(f"tenant {a.tenant!r} holds {held_text(a)} as burst ({who(a, names)})")
    for a in loose:
        out.append(free_line(a, names, ", no tenant") if a.owner != Owner.MANUAL else
                   f"remove the {held_text(a)} made by hand ('vgpuhost vgpu remove {a.device}')"
                   if a.kind == VGPU else f"release {held_text(a)} ('vgpuhost passthrough release {a.gpu}')")
    if len(out) > 4:
        out = out[:4] + [f"and {len(out) - 4} more ('vgpuhost tenant usage')"]
    return out
