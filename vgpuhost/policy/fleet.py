"""Fleet placement: which host gets a new vGPU, from what every host's agent publishes.  A pure function.

Owns: ranking hosts for a request (profile, optional tenant) from per-host
figures read from Prometheus (:class:`HostFacts`), by the placement
strategies of :mod:`vgpuhost.policy.placement` taken at host granularity,
and saying why each host was skipped.  Must not: query anything (the
Prometheus door is :mod:`vgpuhost.io.promquery`).

Per host: ``free`` instances of the profile now (``vgpuhost_free_instances``,
summed over pools), whether its scrape is healthy (``up`` and
``vgpuhost_up`` both 1, the sample fresh), and the tenant's quota use and
burst limit for vGPUs (``vgpuhost_tenant_quota_used`` / ``_limit``).

Strategies: ``first-fit`` (the first host by name with room), ``best-fit``
(the fewest free instances that still fit: packs hosts), ``worst-fit`` alias
``spread`` (the most free: balances load).  Ties go by host name.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..model.concepts import PlacementStrategy
from ..model.errors import InputError
from ..model.values import record
from .placement import STRATEGIES


@record(frozen=True)
class HostFacts:
    """One host as Prometheus sees it: ``instance`` (its scrape target), ``healthy`` (up, fresh),
    ``free``: ``{profile: instances}``, ``quota_used``/``quota_limit``: ``{(tenant, resource): n}``."""

    instance: str
    healthy: bool
    why_unhealthy: str
    free: Dict[str, float]
    quota_used: Dict[Tuple[str, str], float]
    quota_limit: Dict[Tuple[str, str], float]


@record(frozen=True)
class Ranked:
    """The outcome: ``hosts`` in order of preference as ``(instance, free)``; ``skipped``: ``(instance, why)``."""

    profile: str
    strategy: str
    tenant: Optional[str]
    hosts: List[Tuple[str, int]]
    skipped: List[Tuple[str, str]]

    def as_dict(self) -> dict:
        return {"schema": "vgpuhost.fleet-place/v1", "profile": self.profile, "strategy": self.strategy,
                "tenant": self.tenant, "chosen": self.hosts[0][0] if self.hosts else None,
                "hosts": [{"instance": i, "free": n} for i, n in self.hosts],
                "skipped": [{"instance": i, "why": w} for i, w in self.skipped]}


def rank(facts: Sequence[HostFacts], profile: str, *, strategy: str = PlacementStrategy.FIRST_FIT,
         tenant: Optional[str] = None) -> Ranked:
    """Hosts that can take one ``profile`` vGPU now, best first.  Raises InputError for an unknown strategy."""
    if strategy not in STRATEGIES:
        raise InputError(f"unknown placement strategy {strategy!r}", hint="one of " + ", ".join(STRATEGIES))
    want = profile.lower()
    fits: List[Tuple[str, int]] = []
    skipped: List[Tuple[str, str]] = []
    for h in sorted(facts, key=lambda f: f.instance):
        if not h.healthy:
            skipped.append((h.instance, h.why_unhealthy))
            continue
        free = int(sum(n for p, n in h.free.items() if p.lower() == want))
        if free <= 0:
            skipped.append((h.instance, f"no {profile} free"))
            continue
        if tenant is not None:
            limit = h.quota_limit.get((tenant, "vgpus"))
            used = h.quota_used.get((tenant, "vgpus"), 0.0)
            if limit is not None and used + 1 > limit:
                skipped.append((h.instance, f"tenant {tenant} holds {used:g} of {limit:g} vGPUs allowed there"))
                continue
        fits.append((h.instance, free))
    if strategy == PlacementStrategy.BEST_FIT:
        fits.sort(key=lambda x: (x[1], x[0]))
    elif strategy in (PlacementStrategy.WORST_FIT, PlacementStrategy.SPREAD):
        fits.sort(key=lambda x: (-x[1], x[0]))
    return Ranked(profile, strategy, tenant, fits, skipped)


def capacity(facts: Sequence[HostFacts], profile: Optional[str] = None) -> dict:
    """Free instances per profile and host, healthy hosts only; unhealthy ones listed with why."""
    out: Dict[str, Dict[str, int]] = {}
    down = []
    for h in sorted(facts, key=lambda f: f.instance):
        if not h.healthy:
            down.append({"instance": h.instance, "why": h.why_unhealthy})
            continue
        for p, n in h.free.items():
            if profile is None or p.lower() == profile.lower():
                out.setdefault(p, {})
                out[p][h.instance] = out[p].get(h.instance, 0) + int(n)
    return {"schema": "vgpuhost.fleet-capacity/v1",
            "profiles": [{"profile": p, "total": sum(by.values()), "by_host": by} for p, by in sorted(out.items())],
            "skipped": down}
