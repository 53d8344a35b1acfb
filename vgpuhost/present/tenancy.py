"""The tenant documents the CLI and the agent both serve, and the tenant request parsing they share.

Schema ids: ``vgpuhost.tenant/v1`` (add, set, show, remove), ``vgpuhost.tenants/v1``
(list), ``vgpuhost.tenant-usage/v1``, ``vgpuhost.capacity/v1``,
``vgpuhost.tenant-openstack/v1``, ``vgpuhost.tenant-binding/v1`` (bind, unbind),
``vgpuhost.tenant-policy/v1``.  :func:`new_tenant` and :func:`changed_tenant`
take the options of ``tenant add|set`` as strings, as typed on the command line or
sent in an agent request body; they raise InputError naming a bad option.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..model.tenancy import DIMENSIONS, Tenant, check_label, check_name, parse_limit, parse_series, with_limits
from ..model.values import replace
from ..ops import tenancy

SCHEMA_TENANT = "vgpuhost.tenant/v1"
SCHEMA_TENANTS = "vgpuhost.tenants/v1"
SCHEMA_USAGE = "vgpuhost.tenant-usage/v1"
SCHEMA_CAPACITY = "vgpuhost.capacity/v1"
SCHEMA_OPENSTACK = "vgpuhost.tenant-openstack/v1"
SCHEMA_BINDING = "vgpuhost.tenant-binding/v1"
SCHEMA_POLICY = "vgpuhost.tenant-policy/v1"

#: option name -> (quota dimension, counts MiB?)
LIMIT_OPTIONS = {"vgpus": ("vgpus", False), "framebuffer": ("framebuffer_mib", True),
                 "mig_slices": ("mig_slices", False), "passthrough": ("passthrough_gpus", False)}


def tenant_doc(t) -> dict:
    q = t.quota
    return {"name": t.name, "qos": t.qos, "isolation": t.isolation,
            "quota": {d: {"guaranteed": q.guaranteed.get(d), "burst": q.burst.get(d)} for d in DIMENSIONS},
            "series": sorted(q.series), "labels": sorted(t.labels), "avoid": sorted(t.avoid),
            "prefer": sorted(t.prefer)}


def binding_line(doc: dict) -> str:
    """One line for a :func:`vgpuhost.ops.tenancy.bind` / ``unbind`` document."""
    who = f"domain {doc.get('name') or doc['domain']}"
    dry = " (dry run: nothing changed)" if doc.get("dry_run") and doc.get("changed") else ""
    if doc["action"] == "unbind":
        if not doc["changed"]:
            return f"{who} is not bound (nothing changed)"
        return f"unbound {who} (was tenant {doc['was']['tenant']}): from its next start, best effort with no " \
               f"tenant{dry}"
    qos = doc["qos"] or "the tenant's"
    if not doc["changed"]:
        return f"{who} is bound to tenant {doc['tenant']} (QoS class {qos}) already (nothing changed)"
    was = f" (was tenant {doc['was']['tenant']})" if doc.get("was") else ""
    return f"bound {who} to tenant {doc['tenant']} (QoS class {qos}){was}{dry}"


def binding_answer(bound, skipped=()) -> dict:
    """The ``vgpuhost.tenant-binding/v1`` document: ``bindings`` (each :func:`vgpuhost.ops.tenancy.bind`'s
    or ``unbind``'s document), ``skipped`` (``{"domain", "name", "reason"}``) and ``text``."""
    lines = [binding_line(d) for d in bound]
    lines += [f"domain {s['name'] or s['domain']}: not bound: {s['reason']}" for s in skipped]
    return {"schema": SCHEMA_BINDING, "bindings": list(bound), "skipped": list(skipped),
            "text": "\n".join(lines) or "no domain to bind"}


def _changes(old, *, qos, isolation, vgpus, framebuffer, mig_slices, passthrough, series, labels, avoid,
             prefer, replace_labels: bool) -> Dict[str, object]:
    out: Dict[str, object] = {}
    if qos:
        out["qos"] = qos
    if isolation:
        out["isolation"] = isolation
    limits: Dict[str, Tuple[Optional[int], Optional[int]]] = {}
    for opt, value in (("vgpus", vgpus), ("framebuffer", framebuffer), ("mig_slices", mig_slices),
                       ("passthrough", passthrough)):
        if value is not None:
            dim, mib = LIMIT_OPTIONS[opt]
            limits[dim] = parse_limit(value, "--" + opt.replace("_", "-"), mib=mib)
    quota = old.quota
    if limits:
        quota = with_limits(quota, limits)
    if series is not None:
        quota = replace(quota, series=parse_series(series))
    if quota != old.quota:
        out["quota"] = quota
    for name, given in (("labels", labels), ("avoid", avoid), ("prefer", prefer)):
        if given:
            vals = frozenset(check_label(x) for x in given if x != "none")
            out[name] = vals if replace_labels or "none" in given else getattr(old, name) | vals
    return out


def new_tenant(name: str, opts: Dict[str, object]):
    """The Tenant ``tenant add NAME`` makes from the command's options (strings, as typed).
    Raises InputError naming a bad option."""
    base = Tenant(check_name(name))
    return replace(base, **_changes(base, replace_labels=True, **opts))


def changed_tenant(store, name: str, opts: Dict[str, object], *, actor: Optional[str] = None, promise=None):
    """``tenant set NAME``: tenant NAME with the options given changed, stored; returns it.  ``promise``:
    :class:`vgpuhost.ops.tenancy.Promise` (every guarantee kept, or recorded at risk)."""
    # computed from the tenant as stored under the host lock (labels add to the stored ones)
    return tenancy.update_with(store, name, lambda old: _changes(old, replace_labels=False, **opts), actor=actor,
                               promise=promise)
