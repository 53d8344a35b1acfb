"""Expected GPU-time demand of vGPUs, from the metered history: the estimate admission places by.

Owns: reading the metering rollups once (:func:`history`, over the last
:data:`HISTORY_HOURS`), estimating one vGPU's expected GPU time
(:func:`estimate`: the domain's own metered mean on the profile, else the
busy-weighted mean of its tenant's domains on the profile, else None, which
:mod:`vgpuhost.policy.compute` reads as the profile's fixed share; a start
takes the higher of the two, :func:`estimate_start`), and
handing it to policy as values (:func:`with_use` for the allocations held:
a vGPU no domain holds, a layout's or a manual one, expects none;
:func:`demand_with_use` for a request).  Must not: decide placement.
Imported on the qemu hook's path under tenancy (``ops.tenancy.admit_domain``):
no ``typing``, one query.

Units: shares of one GPU's time, ``sm_busy_s / alloc_s`` of the hourly
rollups (docs/metering.md), never above 1.0 (a vGPU cannot use more than
one GPU's time: a rollup reading more is measurement, read as 1.0);
history with less than :data:`MIN_HISTORY_S` allocated seconds is not
trusted, nor a tenant's with less than :data:`MIN_TENANT_BUSY_S` busy seconds.

The tenant's estimate weights each domain's mean by that domain's busy
seconds (``sum(busy_d * busy_d / alloc_d) / sum(busy_d)``), so allocated but
idle domains weigh nothing: a tenant lowers the estimate of its domains
without history only by spending real GPU time at a low share (to halve it,
as much busy time as its real domains spent), trial 10a finding 11.
"""

from __future__ import annotations

import time

from ..io import state as st
from ..model.gputime import IDLE, METERED, TENANT_PROFILE, ExpectedUse
from ..model.kinds import Owner
from ..model.values import replace

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, List, Optional, Sequence, Tuple

#: how far back the metered history counts (hours): two days follow a VM's use as it is now, and keep the
#: query on the qemu hook's path short (measured 2026-12-07 on a loaded 2-core machine, 384 metered vGPUs:
#: 14 days of rollups took 0.70 s, 2 days 0.1 s)
HISTORY_HOURS = 48
#: allocated seconds of history below which a mean is not trusted (ten minutes)
MIN_HISTORY_S = 600.0
#: busy seconds a tenant's domains on a profile must have metered before their mean is trusted for a
#: domain without history of its own (ten minutes of one GPU's full time): a tenant whose domains were
#: idle, or nearly, gets the profile's fixed share, not an estimate its idle domains set
MIN_TENANT_BUSY_S = 600.0


class History:
    """Summed metered use: ``domains[(domain UUID, profile)]`` -> ``(alloc_s, sm_busy_s)`` and
    ``tenants[(tenant, profile)]`` -> ``(alloc_s, sm_busy_s, busy-weighted share sum)`` (names lower case;
    ``sm_busy_s`` never above ``alloc_s``; the last: ``sum(busy_d * busy_d / alloc_d)`` over the tenant's
    domains, :func:`estimate` divides it by ``sm_busy_s``)."""

    def __init__(self, rows: "Sequence[tuple]" = ()):
        self.domains: "Dict[Tuple[str, str], Tuple[float, float]]" = {}
        self.tenants: "Dict[Tuple[str, str], Tuple[float, float, float]]" = {}
        for domain, tenant, profile, alloc_s, busy_s in rows:
            alloc_s = alloc_s or 0.0
            busy_s = min(busy_s or 0.0, alloc_s)        # more than the whole GPU is measurement: 1.0
            key = (domain.lower(), profile.lower())
            a, b = self.domains.get(key, (0.0, 0.0))
            self.domains[key] = (a + alloc_s, b + busy_s)
            if tenant:
                key = (tenant.lower(), profile.lower())
                a, b, w = self.tenants.get(key, (0.0, 0.0, 0.0))
                self.tenants[key] = (a + alloc_s, b + busy_s, w + (busy_s * busy_s / alloc_s if alloc_s else 0.0))


def history(store, *, now_s: "Optional[float]" = None) -> History:
    """The metered history of the last :data:`HISTORY_HOURS` hours (``now_s``: Unix seconds, for tests)."""
    t = (time.time() if now_s is None else now_s) - HISTORY_HOURS * 3600
    since = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(t))
    return History(st.gpu_time_history(store, since))


def estimate(hist: History, domain: str, tenant: "Optional[str]", profile: str) -> "Optional[ExpectedUse]":
    """The expected GPU time of a vGPU of ``profile`` for ``domain`` (UUID) of ``tenant``: its metered mean
    (:data:`MIN_HISTORY_S` allocated seconds at least), else the busy-weighted mean of its tenant's domains
    on the profile (:class:`History`; :data:`MIN_TENANT_BUSY_S` busy seconds at least), else None (the
    profile's fixed share, :mod:`vgpuhost.policy.compute`).  Never above 1.0."""
    alloc_s, busy_s = hist.domains.get((domain.lower(), profile.lower()), (0.0, 0.0))
    if alloc_s >= MIN_HISTORY_S:
        return ExpectedUse(min(1.0, round(busy_s / alloc_s, 4)), METERED, alloc_s)
    if not tenant:
        return None
    alloc_s, busy_s, weighted = hist.tenants.get((tenant.lower(), profile.lower()), (0.0, 0.0, 0.0))
    if alloc_s >= MIN_HISTORY_S and busy_s >= MIN_TENANT_BUSY_S:
        return ExpectedUse(min(1.0, round(weighted / busy_s, 4)), TENANT_PROFILE, alloc_s)
    return None


def with_use(hist: History, allocations: "Sequence") -> "List":
    """``allocations`` (:class:`vgpuhost.policy.demand.Allocation`) with each time-sliced vGPU's
    expected GPU time filled in (:func:`estimate_start`; the others unchanged).  A vGPU no domain holds (owner
    ``layout`` or ``manual``: made for guests, free until one is lent or claimed) expects 0.0
    (:data:`vgpuhost.model.gputime.IDLE`): it is room, not demand; lent, it is the domain's and
    expects what the domain does (trial 10a finding 10)."""
    out = []
    for a in allocations:
        if a.kind == "vgpu" and not a.mig_slices and a.use is None:
            use = (ExpectedUse(0.0, IDLE) if Owner.is_pool(a.owner)
                   else estimate_start(hist, a.owner, a.tenant, a.profile))
            if use is not None:
                a = replace(a, use=use)
        out.append(a)
    return out


def estimate_start(hist: History, domain: str, tenant: "Optional[str]", profile: str) -> "Optional[ExpectedUse]":
    """The expected GPU time of a vGPU ``domain`` starts now: the higher of its own metered mean and its
    tenant's estimate (:func:`estimate` each), else whichever there is, else None.  A start is a new run:
    a domain that ran idle before and runs busy now would otherwise be packed as idle beside another
    tenant's VMs, at no cost to its tenant (trial 10 retest N1: four such domains starved a neighbour by
    1.39).  A vGPU already running is estimated the same way (:func:`with_use`): counted at an idle mean
    of its own, a busy one would let the next start be packed beside it (trial 10 final NEW-1).  An own
    mean below the profile's fixed share counts that share (:func:`vgpuhost.policy.compute.expected`)."""
    own = estimate(hist, domain, None, profile)
    theirs = estimate(hist, "", tenant, profile) if tenant else None
    if own is None or (theirs is not None and theirs.share > own.share):
        return theirs
    return own


def demand_with_use(hist: History, demand, domain: str, tenant: "Optional[str]"):
    """``demand`` (:class:`vgpuhost.policy.demand.Demand`) with its expected GPU time, for a time-sliced vGPU
    about to start (:func:`estimate_start`)."""
    if demand.kind != "vgpu" or demand.mig_slices or demand.use is not None:
        return demand
    use = estimate_start(hist, domain, tenant, demand.profile)
    return demand if use is None else replace(demand, use=use)


def gpu_figures(allocations: "Sequence", pools: "Sequence", gpu_memory: "Dict[str, int]") -> "Dict[str, dict]":
    """Per GPU of ``gpu_memory`` (framebuffer MiB by BDF): ``{"gpu_time_expected", "compute_ceiling",
    "starved_demand"}`` (shares of one GPU), for ``allocations`` with their use (:func:`with_use`) under
    ``pools`` (:class:`vgpuhost.policy.admission.Pool`): what ``capacity`` and the exporter show."""
    from ..policy import compute
    from ..policy.admission import pool_of
    load = compute.gpu_load(allocations, gpu_memory, lambda g: pool_of(pools, g).policy)
    out = {}
    for g in sorted(gpu_memory):
        top = compute.ceiling_of(pool_of(pools, g))
        here = load.get(g, 0.0)
        out[g] = {"gpu_time_expected": round(here, 4), "compute_ceiling": top,
                  "starved_demand": round(max(0.0, here - top), 4)}
    return out


def starved_summary(figures: "Dict[str, dict]", pools: "Sequence") -> dict:
    """``{"total", "share", "by_pool"}``: the starved demand of :func:`gpu_figures` summed (shares of one
    GPU), as a share of the GPUs counted, and per pool (every pool with a GPU counted, 0.0 included)."""
    from ..policy.admission import pool_of
    by_pool: "Dict[str, float]" = {}
    for g, f in figures.items():
        p = pool_of(pools, g).name
        by_pool[p] = round(by_pool.get(p, 0.0) + f["starved_demand"], 4)
    total = round(sum(f["starved_demand"] for f in figures.values()), 4)
    return {"total": total, "share": round(total / len(figures), 4) if figures else 0.0, "by_pool": by_pool}
