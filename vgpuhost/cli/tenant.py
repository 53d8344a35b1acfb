"""`vgpuhost` commands: tenant add|set|list|show|remove|usage|openstack, and capacity.

Registered on the main group by cli/main.py: every click command in
``COMMANDS`` becomes a top-level command.  Logic lives in
:mod:`vgpuhost.ops.tenancy`; this module parses options and prints.
``--json`` documents: ``vgpuhost.tenant/v1`` (add, set, show, remove),
``vgpuhost.tenants/v1`` (list), ``vgpuhost.tenant-usage/v1``,
``vgpuhost.capacity/v1``, ``vgpuhost.tenant-openstack/v1``.
"""

from __future__ import annotations

from typing import Dict, List, Optional
from urllib.parse import quote

import click

from ..model.concepts import Isolation, QosClass
from ..model.errors import InputError
from ..model.tenancy import DIMENSIONS, NO_TENANT, usage_text
from ..ops import tenancy
from ..present.tenancy import (  # noqa: F401 (the CLI's names)
    LIMIT_OPTIONS, SCHEMA_CAPACITY, SCHEMA_OPENSTACK, SCHEMA_TENANT, SCHEMA_TENANTS, SCHEMA_USAGE, changed_tenant,
    new_tenant, tenant_doc
)
from .agentcall import forward
from .common import current, emit, store
from .output import table


def _ctx():
    """The global options' Context (:func:`vgpuhost.cli.common.current`)."""
    return current()


def _store(write: bool):
    return store(current(), write=write)


def _emit(doc: dict, text: str) -> None:
    emit(current(), doc, text)


def _quota_options(fn):
    opts = [
        click.option("--qos", type=click.Choice(QosClass.values()),
                     help="Default QoS class of the tenant's domains (a domain's metadata may override it)."),
        click.option("--isolation", type=click.Choice(Isolation.values()),
                     help="shared: time-sliced GPUs with other tenants; exclusive: time-sliced GPUs of its own; "
                          "hardware: MIG-backed vGPUs and passthrough only."),
        click.option("--vgpus", metavar="G[:B]", help="vGPUs: guaranteed[:burst] ('none': no limit)."),
        click.option("--framebuffer", metavar="G[:B]", help="vGPU framebuffer, MiB or with G/M suffix (32G:48G)."),
        click.option("--mig-slices", metavar="G[:B]", help="Compute slices of MIG-backed vGPUs' GPU instances."),
        click.option("--passthrough", metavar="G[:B]", help="Whole GPUs passed through."),
        click.option("--series", metavar="LIST", help="Allowed vGPU series, e.g. C or C,Q ('all': any)."),
        click.option("--label", "labels", metavar="K=V", multiple=True, help="A label of the tenant (env=prod)."),
        click.option("--avoid", metavar="K=V", multiple=True,
                     help="Never share a time-sliced GPU with tenants carrying this label."),
        click.option("--prefer", metavar="K=V", multiple=True,
                     help="Prefer GPUs holding vGPUs of tenants carrying this label."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


@click.group("tenant")
def tenant() -> None:
    """Tenants: quotas, QoS classes, isolation (admission runs at attach and at domain start)."""


def _through_agent(target: str, body: Dict[str, object]) -> bool:
    """Send a tenant write to the agent when it answers; print its answer as the command would."""
    out = forward(_ctx(), "POST", target, body)
    if out is None:
        return False
    doc = dict(out.as_dict())
    text = doc.pop("text", "")
    if doc.get("warning"):                  # tenant add|set: guarantees at risk, as the command warns locally
        click.echo(f"vgpuhost: warning: {doc['warning']}", err=True)
    _emit(doc, text)
    return True


def _body(opts: Dict[str, object]) -> Dict[str, object]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.items()}


_OVERSUBSCRIBE = click.option(
    "--allow-oversubscribe", "allow_oversubscribe", is_flag=True,
    help="Record guarantees that cannot all be kept on this host together (refused otherwise) as at risk: "
         "audited, warned, shown by 'tenant usage', 'capacity', 'host check' and the exporter.")


def _promise(allow: bool) -> "tenancy.Promise":
    """The check of every guarantee against this host's GPUs (the inventory read when needed)."""
    return tenancy.Promise(_ctx().inventory, allow)


def _warned(doc: dict, text: str, promise: "tenancy.Promise") -> None:
    """Emit ``doc``/``text`` with the promise's warning: a ``warning`` field and a line on stderr."""
    if promise.warning:
        doc["warning"] = promise.warning
        click.echo(f"vgpuhost: warning: {promise.warning}", err=True)
    _emit(doc, text)


@tenant.command("add")
@click.argument("name")
@_quota_options
@_OVERSUBSCRIBE
def tenant_add(name: str, allow_oversubscribe: bool = False, **opts) -> None:
    """Add tenant NAME (defaults: qos burstable, isolation shared, no limits).  Refused (exit 2) when its
    guarantees and the others' cannot all be kept on this host, unless --allow-oversubscribe."""
    t = new_tenant(name, opts)          # bad options fail here, before the agent is asked
    body = {"name": name, **_body(opts), **({"allow_oversubscribe": True} if allow_oversubscribe else {})}
    if _through_agent("/v1/tenants", body):
        return
    promise = _promise(allow_oversubscribe)
    t = tenancy.add(_store(True), t, promise=promise)
    _warned({"schema": SCHEMA_TENANT, "action": "add", "tenant": tenant_doc(t)},
            f"added tenant {t.name}: {tenancy.describe(t)}", promise)


@tenant.command("set")
@click.argument("name")
@_quota_options
@_OVERSUBSCRIBE
def tenant_set(name: str, allow_oversubscribe: bool = False, **opts) -> None:
    """Change tenant NAME; only the options given change (labels add; '--label none' clears).  Refused
    as 'tenant add' is when the guarantees could no longer all be kept."""
    body = {**_body(opts), **({"allow_oversubscribe": True} if allow_oversubscribe else {})}
    if _through_agent(f"/v1/tenants/{quote(name, safe='')}/set", body):
        return
    promise = _promise(allow_oversubscribe)
    t = changed_tenant(_store(True), name, opts, promise=promise)
    _warned({"schema": SCHEMA_TENANT, "action": "set", "tenant": tenant_doc(t)},
            f"tenant {t.name}: {tenancy.describe(t)}", promise)


@tenant.command("list")
def tenant_list() -> None:
    """Every tenant with its class, isolation and quota (guaranteed:burst)."""
    ts = tenancy.tenants(_store(False))
    rows = [[t.name, t.qos, t.isolation, *[t.quota.text(d) for d in DIMENSIONS],
             ",".join(sorted(t.quota.series)) or "all", ",".join(sorted(t.labels)) or "-"] for t in ts.values()]
    _emit({"schema": SCHEMA_TENANTS, "tenants": [tenant_doc(t) for t in ts.values()]},
          table(["TENANT", "QOS", "ISOLATION", "VGPUS", "FB_MIB", "MIG_SLICES", "PASSTHROUGH", "SERIES", "LABELS"],
                rows) if rows else "no tenants ('vgpuhost tenant add NAME' adds one)")


def _usage(name: Optional[str]) -> List[dict]:
    store = _store(False)
    inv = None
    try:
        inv = _ctx().inventory()
    except Exception:       # usage is the store's view; an unreadable host only loses type sizes
        inv = None
    docs = tenancy.usage_report(store, inv)
    if name is not None:
        t = tenancy.get(store, name)
        docs = [d for d in docs if d["tenant"] == t.name]
    return docs


def risk_lines(docs: List[dict]) -> List[str]:
    """``tenant 'p': guarantee at risk: its unused 1 passthrough GPU(s) cannot be served beside the other
    tenants' guarantees`` per tenant at risk."""
    return [f"tenant {d['tenant']!r}: guarantee at risk: its unused {d.get('risk') or 'guarantee'} cannot be "
            "served beside the other tenants' guarantees" for d in docs if d.get("at_risk")]


def _usage_rows(docs: List[dict]) -> List[list]:
    """Table rows of ``tenant usage`` documents (:func:`vgpuhost.model.tenancy.usage_text` per dimension)."""
    rows = []
    for d in docs:
        cells = [usage_text(u["used"], u["burst"], u["guaranteed"], u["limit"])
                 for u in (d["usage"][dim] for dim in DIMENSIONS)]
        rows.append([d["tenant"] or NO_TENANT, d["domains"], *cells])
    return rows


USAGE_HEADERS = ["TENANT", "DOMAINS", "VGPUS", "FB_MIB", "MIG_SLICES", "PASSTHROUGH"]


@tenant.command("show")
@click.argument("name")
def tenant_show(name: str) -> None:
    """One tenant: its terms and its use now."""
    t = tenancy.get(_store(False), name)
    docs = _usage(t.name)
    doc = {"schema": SCHEMA_TENANT, "action": "show", "tenant": tenant_doc(t),
           "usage": docs[0]["usage"] if docs else None}
    text = f"tenant {t.name}: {tenancy.describe(t)}"
    if docs:
        text += "\n" + "\n".join([table(USAGE_HEADERS, _usage_rows(docs)), *risk_lines(docs)])
    _emit(doc, text)


@tenant.command("remove")
@click.argument("name")
def tenant_remove(name: str) -> None:
    """Remove tenant NAME (refused while its domains hold devices)."""
    if _through_agent(f"/v1/tenants/{quote(name, safe='')}/remove", {}):
        return
    t = tenancy.remove(_store(True), name)
    _emit({"schema": SCHEMA_TENANT, "action": "remove", "tenant": tenant_doc(t)}, f"removed tenant {t.name}")


@tenant.command("usage")
@click.argument("name", required=False)
def tenant_usage(name: Optional[str]) -> None:
    """Allocations against quota, per tenant: USED/QUOTA (guaranteed:burst), the burst part
    and any use over the quota in brackets; '(no tenant)' is what no tenant holds."""
    docs = _usage(name)
    text = table(USAGE_HEADERS, _usage_rows(docs)) if docs else "no tenants and nothing held"
    _emit({"schema": SCHEMA_USAGE, "tenants": docs}, "\n".join([text, *risk_lines(docs)]))


@tenant.command("openstack")
@click.option("--map", "mode", type=click.Choice(["project-name", "project-uuid", "off"]),
              help="Map a domain's nova:owner/nova:project to a tenant (by project name or UUID), or not.")
def tenant_openstack(mode: Optional[str]) -> None:
    """Show or set the OpenStack tenant mapping (off by default).

    With it on, a domain whose vgpuhost metadata names no tenant but whose
    Nova metadata carries nova:owner/nova:project counts as that project's
    tenant.
    """
    store = _store(mode is not None)
    if mode is not None:
        tenancy.set_openstack(store, None if mode == "off" else mode)
    cur = store.setting(tenancy.OPENSTACK) or "off"
    _emit({"schema": SCHEMA_OPENSTACK, "map": cur}, f"OpenStack tenant mapping: {cur}")


@click.command("capacity")
@click.option("--profile", metavar="NAME", help="Only this vGPU profile.")
@click.option("--tenant", metavar="T", help="What this tenant's domains would be admitted to now, and why not more "
                                            "(quota, isolation, QoS class, pools, reserves, placement).")
def capacity(profile: Optional[str], tenant: Optional[str]) -> None:
    """What more fits now, per profile, pool and GPU; where fragmentation blocks a profile.

    A GPU holding an exclusive tenant's vGPUs counts nothing free (no one else
    may join it).  With --tenant T each count is admission's answer for a
    domain of T; an unknown tenant is refused (exit 2).
    """
    ctx = _ctx()
    inv = ctx.inventory()
    store = _store(False)
    doc = tenancy.capacity(store, inv, tenancy.mixed_size_of(ctx.host, inv), tenant=tenant,
                           policies=lambda gpus: tenancy.scheduler_policies(ctx.host, gpus))
    risk = tenancy.guarantees_at_risk(store, inv)
    doc["guarantees_at_risk"] = [{"tenant": n, "guarantee": (risk or {})["reasons"].get(n)}
                                 for n in (risk or {}).get("tenants", ())]
    if profile:
        doc["profiles"] = [p for p in doc["profiles"] if p["profile"].lower() == profile.lower()]
        if not doc["profiles"]:
            raise InputError(f"no GPU here offers {profile!r}", hint="'vgpuhost types' lists the profiles")
    rows = []
    for p in doc["profiles"]:
        per_gpu = " ".join(f"{g}={n}" for g, n in p["by_gpu"].items())
        per_pool = " ".join(f"{k}={n}" for k, n in p["by_pool"].items())
        rows.append([p["profile"], p["fits"], per_pool, per_gpu, p["blocked"] or "-"])
    text = table(["PROFILE", "FITS", "BY_POOL", "BY_GPU", "BLOCKED"], rows)
    notes = [f"{p['profile']}: {p['note']}" for p in doc["profiles"] if p["note"]]
    if doc["tenant"] is not None:
        text = f"tenant {doc['tenant']} (what admission would admit now)\n" + text
        why: Dict[str, List[str]] = {}
        for p in doc["profiles"]:
            if p["why_not"] and (profile or p["fits"] == 0) and p["by_gpu"]:
                why.setdefault(p["why_not"], []).append(p["profile"])
        notes += [f"{', '.join(names)}: no more for tenant {doc['tenant']}: {reason}" for reason, names in why.items()]
    notes += [f"{g['gpu']}: held by exclusive tenant {g['exclusive']}: no one else's vGPU may join it"
              for g in doc["gpus"] if g.get("exclusive")]
    notes += [f"{g['gpu']}: {g['drift']}" for g in doc["gpus"] if g.get("drift")]
    notes += [f"{g['gpu']}: {len(g['unreadable'])} vGPU parents could not be read ({', '.join(g['unreadable'])}): "
              "what they offer is not counted ('vgpuhost host check' says why)" for g in doc["gpus"] if g["unreadable"]]
    notes += [f"guarantee at risk: {risk['text']}"] if risk and risk["tenants"] else []
    if notes:
        text += "\n" + "\n".join(notes)
    _emit({"schema": SCHEMA_CAPACITY, **doc}, text)


COMMANDS: List[click.Command] = [tenant, capacity]
