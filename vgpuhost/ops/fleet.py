"""The fleet view: every host's agent series from Prometheus, as :class:`~vgpuhost.policy.fleet.HostFacts`.

Owns: the PromQL that reads capacity (per tenant too:
``vgpuhost_tenant_free_instances``), quota use and health per scrape
target, and joining the answers per ``instance``.  Must not: rank (that is
:mod:`vgpuhost.policy.fleet`) or change anything.

A host is healthy when its scrape is up (``up == 1``), its sampler says
so (``vgpuhost_up == 1``), and its last sample is at most ``stale_s``
seconds old (``vgpuhost_sampler_last_sample_timestamp_seconds``).  A stopped
agent fails its scrapes: ``up`` is 0 and Prometheus marks its series stale,
so it is skipped.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..io.promquery import query
from ..policy.fleet import HostFacts

DEFAULT_STALE_S = 120.0


def host_facts(url: str, *, job: Optional[str] = None, stale_s: float = DEFAULT_STALE_S) -> List[HostFacts]:
    """One :class:`HostFacts` per scrape target Prometheus knows (``job``: only that job)."""
    sel = f'{{job="{job}"}}' if job else ""
    up = {m.get("instance", ""): v for m, v in query(url, f"up{sel}")}
    vup = {m.get("instance", ""): v for m, v in query(url, f"vgpuhost_up{sel}")}
    age = {m.get("instance", ""): v for m, v in
           query(url, f"time() - vgpuhost_sampler_last_sample_timestamp_seconds{sel}")}
    free: Dict[str, Dict[str, float]] = {}
    for m, v in query(url, f"vgpuhost_free_instances{sel}"):
        d = free.setdefault(m.get("instance", ""), {})
        d[m.get("profile", "")] = d.get(m.get("profile", ""), 0.0) + v
    used: Dict[str, Dict[Tuple[str, str], float]] = {}
    for m, v in query(url, f"vgpuhost_tenant_quota_used{sel}"):
        used.setdefault(m.get("instance", ""), {})[(m.get("tenant", ""), m.get("resource", ""))] = v
    limit: Dict[str, Dict[Tuple[str, str], float]] = {}
    for m, v in query(url, f'vgpuhost_tenant_quota_limit{{limit="burst"{"," + sel[1:-1] if sel else ""}}}'):
        limit.setdefault(m.get("instance", ""), {})[(m.get("tenant", ""), m.get("resource", ""))] = v
    tfree: Dict[str, Dict[Tuple[str, str], float]] = {}
    for m, v in query(url, f"vgpuhost_tenant_free_instances{sel}"):
        d2 = tfree.setdefault(m.get("instance", ""), {})
        key = (m.get("tenant", ""), m.get("profile", ""))
        d2[key] = d2.get(key, 0.0) + v
    out = []
    for inst in sorted(up):
        why = ""
        if up[inst] != 1:
            why = "its scrape is down (up == 0)"
        elif vup.get(inst) != 1:
            why = "its sampler is not up (vgpuhost_up != 1)" if inst in vup else "it publishes no vgpuhost series"
        elif inst not in age or age[inst] > stale_s:
            why = f"its last sample is stale (over {stale_s:g} s old)"
        out.append(HostFacts(inst, not why, why, free.get(inst, {}), used.get(inst, {}), limit.get(inst, {}),
                             tfree.get(inst)))
    return out
