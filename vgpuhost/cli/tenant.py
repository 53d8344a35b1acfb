"""`vgpuhost` commands: tenant add|set|list|show|remove|usage|openstack|bind|unbind|policy, and capacity.

Registered on the main group by cli/main.py: every click command in
``COMMANDS`` becomes a top-level command.  Logic lives in
:mod:`vgpuhost.ops.tenancy`; this module parses options and prints.
``--json`` documents: ``vgpuhost.tenant/v1`` (add, set, show, remove),
``vgpuhost.tenants/v1`` (list), ``vgpuhost.tenant-usage/v1``,
``vgpuhost.capacity/v1``, ``vgpuhost.tenant-openstack/v1``, ``vgpuhost.tenant-binding/v1``
(bind, unbind), ``vgpuhost.tenant-policy/v1``.
"""

from __future__ import annotations

from typing import Dict, List, Optional
from urllib.parse import quote

import click

from ..io.virt import default_uri
from ..model.concepts import Isolation, QosClass
from ..model.errors import InputError
from ..model.tenancy import DIMENSIONS, NO_TENANT, usage_text
from ..ops import migdemand, tenancy
from ..ops.vgpu import limits_lookup
from ..present.tenancy import (  # noqa: F401 (the CLI's names)
    LIMIT_OPTIONS, SCHEMA_CAPACITY, SCHEMA_OPENSTACK, SCHEMA_POLICY, SCHEMA_TENANT, SCHEMA_TENANTS, SCHEMA_USAGE,
    binding_answer, changed_tenant, new_tenant, tenant_doc
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


def _bound(store, name: Optional[str] = None) -> Dict[str, List[dict]]:
    """``{tenant (lower case): [binding documents]}`` (:func:`vgpuhost.ops.tenancy.binding_doc`), names
    from the domains the hook saw start."""
    names = store.active_domains()
    out: Dict[str, List[dict]] = {}
    for row in tenancy.bindings(store, name):
        out.setdefault(row[1].lower(), []).append(tenancy.binding_doc(row, names))
    return out


def _bound_text(docs: List[dict]) -> str:
    return ",".join(d["name"] or d["domain"] for d in docs) or "-"


@tenant.command("list")
def tenant_list() -> None:
    """Every tenant with its class, isolation, quota (guaranteed:burst) and the domains bound to it."""
    store = _store(False)
    ts = tenancy.tenants(store)
    bound = _bound(store)
    rows = [[t.name, t.qos, t.isolation, *[t.quota.text(d) for d in DIMENSIONS],
             ",".join(sorted(t.quota.series)) or "all", ",".join(sorted(t.labels)) or "-",
             _bound_text(bound.get(t.name.lower(), []))] for t in ts.values()]
    _emit({"schema": SCHEMA_TENANTS, "tenants": [dict(tenant_doc(t), bound=bound.get(t.name.lower(), []))
                                                  for t in ts.values()]},
          table(["TENANT", "QOS", "ISOLATION", "VGPUS", "FB_MIB", "MIG_SLICES", "PASSTHROUGH", "SERIES", "LABELS",
                 "BOUND"], rows) if rows else "no tenants ('vgpuhost tenant add NAME' adds one)")


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
    store = _store(False)
    t = tenancy.get(store, name)
    docs = _usage(t.name)
    bound = _bound(store, t.name).get(t.name.lower(), [])
    doc = {"schema": SCHEMA_TENANT, "action": "show", "tenant": tenant_doc(t),
           "usage": docs[0]["usage"] if docs else None, "bound": bound}
    text = f"tenant {t.name}: {tenancy.describe(t)}\nbound domains: " + (", ".join(
        f"{b['name'] or b['domain']} (QoS class {b['qos'] or t.qos})" for b in bound) or "none")
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

    With it on, Nova's nova:owner/nova:project is the tenant of a domain
    the operator has not bound ('tenant bind' wins); a domain with GPU
    devices whose project is missing or empty, or whose vgpuhost metadata
    names another tenant, is refused at start.
    """
    store = _store(mode is not None)
    if mode is not None:
        tenancy.set_openstack(store, None if mode == "off" else mode)
    cur = store.setting(tenancy.OPENSTACK) or "off"
    _emit({"schema": SCHEMA_OPENSTACK, "map": cur}, f"OpenStack tenant mapping: {cur}")


def _binding_through_agent(domain: str, body: Dict[str, object]) -> bool:
    """Send a bind/unbind to the agent's admin API when it answers for this libvirt URI (a test:// URI stays
    here: libvirt's test driver lives in each process)."""
    ctx = _ctx()
    uri = default_uri(ctx.connect)
    if uri.startswith("test:"):
        return False
    out = forward(ctx, "POST", f"/v1/domains/{quote(domain, safe='')}/bind", {**body, "uri": uri},
                  accept=lambda info: uri in (info.get("libvirt_uris") or ()))
    if out is None:
        return False
    doc = dict(out.as_dict())
    _emit(doc, doc.pop("text", ""))
    return True


def _emit_binding(doc: dict) -> None:
    doc = dict(doc)
    _emit(doc, doc.pop("text"))


@tenant.command("bind")
@click.argument("domain", required=False)
@click.argument("tenant_name", metavar="[TENANT]", required=False)
@click.option("--qos", type=click.Choice(QosClass.values()),
              help="The domain's QoS class (default: its tenant's, as it is at each start); at most the "
                   "tenant's class.")
@click.option("--from-metadata", "from_metadata", is_flag=True,
              help="Upgrade path: bind DOMAIN (or every domain) with no binding to the tenant its vgpuhost "
                   "metadata names, when that tenant exists.")
@click.option("--dry-run", is_flag=True, help="Say what would be bound; change nothing.")
def tenant_bind(domain: Optional[str], tenant_name: Optional[str], qos: Optional[str], from_metadata: bool,
                dry_run: bool) -> None:
    """Bind DOMAIN (name or UUID) to TENANT: the operator says whose it is (its metadata may only ask).

    Audited; idempotent.  Refused (exit 2, nothing changed) for an unknown
    tenant or a --qos stronger than the tenant's class.  Takes effect at the
    domain's next start.
    """
    if from_metadata:
        if tenant_name is not None or qos is not None:
            raise InputError("--from-metadata takes the tenant from each domain's metadata",
                             hint="give DOMAIN alone (or nothing: every domain), without TENANT or --qos")
        bound, skipped = tenancy.bind_from_metadata(_store(not dry_run), _ctx().connect, domain, dry_run=dry_run)
        _emit_binding(binding_answer(bound, skipped))
        return
    if domain is None or tenant_name is None:
        raise InputError("give DOMAIN and TENANT", hint="'vgpuhost tenant bind DOMAIN TENANT [--qos CLASS]', or "
                                                        "--from-metadata")
    if not dry_run and _binding_through_agent(domain, {"tenant": tenant_name, "qos": qos}):
        return
    doc = tenancy.bind_domain(_store(not dry_run), _ctx().connect, domain, tenant_name, qos=qos, dry_run=dry_run)
    _emit_binding(binding_answer([doc]))


@tenant.command("unbind")
@click.argument("domain")
@click.option("--dry-run", is_flag=True, help="Say what would be unbound; change nothing.")
def tenant_unbind(domain: str, dry_run: bool) -> None:
    """Drop DOMAIN's binding: from its next start it is best effort with no tenant (refused under
    require-binding).  Audited; idempotent."""
    if not dry_run and _binding_through_agent(domain, {"unbind": True}):
        return
    doc = tenancy.bind_domain(_store(not dry_run), _ctx().connect, domain, unbind_it=True, dry_run=dry_run)
    _emit_binding(binding_answer([doc]))


@tenant.command("policy")
@click.option("--require-binding", "require", type=click.Choice(["on", "off"]),
              help="on: a domain bound to no tenant is refused at start; off (default): it is admitted as best "
                   "effort with no tenant.")
def tenant_policy(require: Optional[str]) -> None:
    """Show or set how unbound domains are treated (audited)."""
    store = _store(require is not None)
    if require is not None:
        tenancy.set_require_binding(store, require == "on")
    on = tenancy.require_binding(store)
    mode = store.setting(tenancy.OPENSTACK) or "off"
    loose = tenancy.unbound_running(store) if on else {}
    text = f"require-binding: {'on' if on else 'off'}; OpenStack tenant mapping: {mode}"
    if loose:
        names = ", ".join(sorted(n or u for u, n in loose.items()))
        text += (f"\nnote: {len(loose)} running domain(s) have no binding and will be refused at their next start: "
                 f"{names} ('vgpuhost tenant bind DOMAIN TENANT')")
    _emit({"schema": SCHEMA_POLICY, "require_binding": on, "openstack": mode,
           "unbound_running": sorted(loose)}, text)


@click.command("capacity")
@click.option("--profile", metavar="NAME", help="Only this vGPU profile.")
@click.option("--tenant", metavar="T", help="What this tenant's domains would be admitted to now, and why not more "
                                            "(quota, isolation, QoS class, pools, reserves, placement).")
def capacity(profile: Optional[str], tenant: Optional[str]) -> None:
    """What more fits now, per profile, pool and GPU; where fragmentation blocks a profile.

    A GPU holding an exclusive tenant's vGPUs counts nothing free (no one else
    may join it).  With --tenant T each count is admission's answer for a
    domain of T; an unknown tenant is refused (exit 2).  The last line gives
    the starved demand: expected GPU time (from the metered history) above
    the pools' compute ceilings, a QoS figure.
    """
    ctx = _ctx()
    store = _store(False)
    inv = migdemand.makeable(ctx.host, store, ctx.inventory())   # MIG on demand: instances that could be made
    doc = tenancy.capacity(store, inv, tenancy.mixed_size_of(ctx.host, inv), tenant=tenant,
                           policies=lambda gpus: tenancy.scheduler_policies(ctx.host, gpus),
                           limits_for=limits_lookup(ctx.host, inv, store.vgpu_records()))
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
    notes += [f"{g}: {why}: counts nothing ('vgpuhost gpu uncordon {g}' after repair)"
              for g, why in sorted(inv.out_of_service.items())]       # issue 27: unhealthy or cordoned
    notes += [f"guarantee at risk: {risk['text']}"] if risk and risk["tenants"] else []
    notes += [f"{g['gpu']}: starved demand {g['starved_demand']:.2f} of a GPU (expected GPU time "
              f"{g['gpu_time_expected']:.2f} over the pool's compute ceiling {g['compute_ceiling']:g})"
              for g in doc["gpus"] if g.get("starved_demand")]
    starved = doc["starved_demand"]
    text += (f"\nGPU time: starved demand {starved['total']:.2f} of a GPU in all ({starved['share']:.3f} of the "
             f"{len(doc['gpus'])} GPUs' time; expected demand above the compute ceilings)")
    if notes:
        text += "\n" + "\n".join(notes)
    _emit({"schema": SCHEMA_CAPACITY, **doc}, text)


COMMANDS: List[click.Command] = [tenant, capacity]
