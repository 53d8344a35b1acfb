"""Fleet placement: which host gets a new vGPU, from what every host's agent publishes.  A pure function.

Owns: ranking hosts for a request (profile, optional tenant) from per-host
figures read from Prometheus (:class:`HostFacts`), by the placement
strategies of :mod:`vgpuhost.policy.placement` taken at host granularity,
and saying why each host was skipped.  Must not: query anything (the
Prometheus door is :mod:`vgpuhost.io.promquery`).

Per host: ``free`` instances of the profile now (``vgpuhost_free_instances``,
summed over pools), whether its scrape is healthy (``up`` and
``vgpuhost_up`` both 1, the sample fresh), the tenants it knows and their
quota use and burst limit for vGPUs (``vgpuhost_tenant_quota_used`` /
``_limit``), and what admission would admit of each profile for each
tenant now (``vgpuhost_tenant_free_instances``).

A request with no tenant counts, on a host that knows tenants, what its
admission would admit for a domain naming no tenant (series tenant ``""``).
A tenant's request counts, on a host that knows tenants, only what that
host's admission would admit for the tenant (its quota, isolation, QoS
class, pools, reserves and placement, as ``vgpuhost capacity --tenant``
answers there): a host where the tenant is unknown, or where admission
admits none, is skipped with why.  A tenant no host knows is refused
(InputError) while any host knows tenants; on hosts with no tenant at all
the name is only recorded, as their admission does.

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
    tenant_free: Optional[Dict[Tuple[str, str], float]] = None

    def tenants(self) -> Dict[str, str]:
        """The tenants this host knows, ``{lower-case name: name}`` (from its quota and per-tenant series)."""
        out = {t.lower(): t for t, _ in self.quota_used if t}
        out.update({t.lower(): t for t, _ in (self.tenant_free or {}) if t})
        return out

    def admits(self, tenant: str, profile: str) -> Optional[int]:
        """How many ``profile`` vGPUs this host's admission would admit for ``tenant`` (``""``: a domain
        naming no tenant) now; None when the host publishes no such series (no tenants there, or an
        older agent: only the quota is known)."""
        if self.tenant_free is None or not any(a.lower() == tenant.lower() for a, _ in self.tenant_free):
            return None
        t, p = tenant.lower(), profile.lower()
        return int(sum(n for (a, b), n in self.tenant_free.items() if a.lower() == t and b.lower() == p))


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
    if tenant is not None:
        tenant = known_tenant(facts, tenant)
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
        if tenant is not None and h.tenants():
            why = _tenant_refusal(h, tenant, profile)
            if why:
                skipped.append((h.instance, why))
                continue
            n = h.admits(tenant, profile)
            free = free if n is None else n
        elif tenant is None and h.admits("", profile) is not None:
            free = h.admits("", profile) or 0
            if free <= 0:
                skipped.append((h.instance, f"its admission admits no {profile} for a domain naming no tenant now "
                                            "(name the tenant: --tenant T)"))
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


def known_tenant(facts: Sequence[HostFacts], tenant: str) -> str:
    """``tenant`` as the hosts spell it; InputError naming the known tenants when hosts know tenants
    and none knows this one (hosts that know no tenant record any name: it is returned as given)."""
    known: Dict[str, str] = {}
    for h in facts:
        known.update(h.tenants())
    if not known:
        return tenant
    if tenant.lower() not in known:
        shown = ", ".join(sorted(known.values())[:12])
        raise InputError(f"no tenant {tenant!r} on any host of the fleet", hint=f"tenants: {shown}")
    return known[tenant.lower()]


def _tenant_refusal(h: HostFacts, tenant: str, profile: str) -> str:
    """Why ``h`` (a host that knows tenants) takes no ``profile`` vGPU of ``tenant`` now ('' when it would)."""
    if tenant.lower() not in h.tenants():
        return f"tenant {tenant} is not known there (its admission refuses the tenant's domains)"
    n = h.admits(tenant, profile)
    if n is not None and n <= 0:
        return (f"its admission admits no {profile} for tenant {tenant} now ('vgpuhost capacity --tenant {tenant} "
                f"--profile {profile}' there says why)")
    return ""


def capacity(facts: Sequence[HostFacts], profile: Optional[str] = None, tenant: Optional[str] = None) -> dict:
    """Free instances per profile and host, healthy hosts only; unhealthy ones listed with why.  With
    ``tenant``: what each host's admission would admit for the tenant (a host that knows no tenants:
    its free instances), hosts that know tenants but not this one listed as skipped; InputError for a
    tenant no host knows (:func:`known_tenant`)."""
    if tenant is not None:
        tenant = known_tenant(facts, tenant)
    out: Dict[str, Dict[str, int]] = {}
    down = []
    for h in sorted(facts, key=lambda f: f.instance):
        if not h.healthy:
            down.append({"instance": h.instance, "why": h.why_unhealthy})
            continue
        free = h.free
        if tenant is not None and h.tenants():
            if tenant.lower() not in h.tenants():
                down.append({"instance": h.instance, "why": _tenant_refusal(h, tenant, profile or "")})
                continue
            if h.tenant_free is not None:
                free = {p: n for (t, p), n in h.tenant_free.items() if t.lower() == tenant.lower()}
        for p, n in free.items():
            if profile is None or p.lower() == profile.lower():
                out.setdefault(p, {})
                out[p][h.instance] = out[p].get(h.instance, 0) + int(n)
    return {"schema": "vgpuhost.fleet-capacity/v1", "tenant": tenant,
            "profiles": [{"profile": p, "total": sum(by.values()), "by_host": by} for p, by in sorted(out.items())],
            "skipped": down}
