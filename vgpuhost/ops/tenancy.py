"""Tenancy: tenants and their quotas in the state store, admission for a domain's devices, reports.

Owns: ``tenant add|set|list|show|remove`` (:func:`add`, :func:`update`,
:func:`remove`, :func:`tenants`), the allocations admission counts
(:func:`allocations`: the store's ``allocations`` rows, plus every vGPU or
passthrough group vgpuhost holds that has none, counted as having no
tenant), the admission of a domain's devices (:func:`admit_domain`,
audited, one row per decision with its reason; :func:`admitting`, the hook's
block, with :func:`record_admitted` writing the allocations and ``admitted``
rows before the first device write and :func:`void_admitted` giving them
their outcome when the start fails) and its record (:func:`forget`; :func:`record_allocations` and the
grants where tenancy is not in use live in :mod:`vgpuhost.ops.admitting`,
re-exported here), the host lock admission runs under
(:func:`host_lock`), pools (:func:`set_pools`, :func:`pools`), the
``tenant usage`` and ``capacity`` reports (:func:`usage_report`,
:func:`capacity`), the OpenStack tenant mapping setting, and the
operator's bindings of domains to tenants (issue 28: :func:`bind`,
:func:`unbind`, :func:`bind_domain`, :func:`bind_from_metadata`,
:func:`set_require_binding`; :func:`trust` gathers what
:func:`vgpuhost.policy.binding.trusted` decides a start's tenant and class from).
Must not: decide (that is :func:`vgpuhost.policy.admission.admit`), touch
sysfs, or stop a VM.
"""

from __future__ import annotations

from ..io.locks import file_lock
from ..io.state import StateStore
from ..model.errors import InputError, RefusedError  # noqa: F401 (re-exported for callers and tests)
from ..model.kinds import Backend, Owner
from ..model.tenancy import (DIMENSIONS, EXCLUSIVE, Limits, Quota, Tenant, check_name, labels_text,
                             parse_labels, UNTENANTED_QOS)
from ..model.values import replace
from ..policy import admission as adm
from . import gputime
from .admitting import (HOST_LOCK, OPENSTACK, REQUIRE_BINDING, Admitting, Granted, active,  # noqa: F401
                        record_allocations, type_framebuffers as _type_fb, unenforced as _unenforced)

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple
    from ..libvirt.domxml import DomainView
    from ..observe.inventory import Inventory

LOCK = HOST_LOCK
OPENSTACK_MODES = ("project-name", "project-uuid")


def _actor() -> str:
    from ..io.process import actor
    return actor()


def host_lock(store: StateStore):
    """``with host_lock(store):`` holds the host lock admission decides and records under
    (``<state dir>/locks/tenancy.lock``)."""
    return file_lock(store.dir, LOCK)


# ---------------------------------------------------------------------------
# tenants in the store

_COLS = (("vgpus", 3), ("framebuffer_mib", 5), ("mig_slices", 7), ("passthrough_gpus", 9))


def _tenant(row: Sequence) -> Tenant:
    g = Limits(**{d: row[i] for d, i in _COLS})
    b = Limits(**{d: row[i + 1] for d, i in _COLS})
    return Tenant(row[0], row[1], row[2], Quota(g, b, frozenset(row[11])), parse_labels(row[12]),
                  parse_labels(row[13]), parse_labels(row[14]))


def _row(t: Tenant) -> tuple:
    q = t.quota
    lims = []
    for d, _ in _COLS:
        lims += [q.guaranteed.get(d), q.burst.get(d)]
    return (t.name, t.qos, t.isolation, *lims, "".join(sorted(q.series)), labels_text(t.labels),
            labels_text(t.avoid), labels_text(t.prefer))


def tenants(store: StateStore) -> Dict[str, Tenant]:
    """Every tenant by name."""
    return {r[0]: _tenant(r) for r in store.tenant_rows()}


def get(store: StateStore, name: str) -> Tenant:
    """One tenant (names match case-insensitively); raises InputError naming the known ones."""
    rows = store.tenant_rows(check_name(name))
    if not rows:
        known = ", ".join(r[0] for r in store.tenant_rows()) or "none"
        raise InputError(f"no tenant {name!r}", hint=f"tenants: {known} ('vgpuhost tenant add NAME' adds one)")
    return _tenant(rows[0])


def _audit(store: StateStore, actor: Optional[str], operation: str, value: str, conn) -> None:
    """The change's audit row, in the change's transaction ``conn``: both commit, or neither."""
    store.audit(actor=actor or _actor(), operation=operation, path="(tenants)", value=value, conn=conn)


def describe(t: Tenant) -> str:
    """``qos=burstable isolation=shared vgpus=4:6 framebuffer_mib=32768 series=C labels=env=prod``."""
    parts = [f"qos={t.qos}", f"isolation={t.isolation}"]
    parts += [f"{d}={t.quota.text(d)}" for d in DIMENSIONS if t.quota.guaranteed.get(d) is not None]
    if t.quota.series:
        parts.append("series=" + ",".join(sorted(t.quota.series)))
    for what, labs in (("labels", t.labels), ("avoid", t.avoid), ("prefer", t.prefer)):
        if labs:
            parts.append(f"{what}={labels_text(labs)}")
    return " ".join(parts)


def add(store: StateStore, tenant: Tenant, *, actor: Optional[str] = None,
        promise: Optional[Promise] = None) -> Tenant:
    """Add ``tenant``; raises InputError when it is invalid or the name is taken.  Under
    :func:`host_lock`, as admission decides (TransientError when it cannot be had).  ``promise``:
    check that every guarantee can still be kept (:func:`keep_promise`; RefusedError, nothing changed)."""
    tenant.validate()
    with host_lock(store), store.transaction() as conn:
        taken = store.tenant_rows(tenant.name)          # names match case-insensitively
        if taken:
            raise InputError(f"tenant {taken[0][0]!r} exists" + (f" (names match in any case: {tenant.name!r})"
                                                                if taken[0][0] != tenant.name else ""),
                             hint=f"change it with 'vgpuhost tenant set {taken[0][0]} ...'")
        keep_promise(store, conn, tenant, promise, actor)
        store.put_tenant(conn, _row(tenant))
        _audit(store, actor, f"tenant add {tenant.name}", describe(tenant), conn)
    return tenant


def update(store: StateStore, name: str, *, actor: Optional[str] = None, promise: Optional[Promise] = None,
           **changes) -> Tenant:
    """Change fields of tenant ``name`` (:class:`Tenant` field names); returns the new value.

    A lower quota is allowed while use exceeds it: running domains keep
    their devices (vgpuhost never stops a VM), new admissions are refused.
    """
    return update_with(store, name, lambda old: changes, actor=actor, promise=promise)


def update_with(store: StateStore, name: str, change: Callable[[Tenant], Mapping[str, object]], *,
                actor: Optional[str] = None, promise: Optional[Promise] = None) -> Tenant:
    """:func:`update` with the changes computed from the tenant as stored (``change(old)``: field ->
    value), read and written under :func:`host_lock`, so that no admission decides in between.
    ``promise``: as :func:`add`'s."""
    with host_lock(store), store.transaction() as conn:
        old = get(store, name)
        new = replace(old, **change(old)).validate()
        keep_promise(store, conn, new, promise, actor)
        store.put_tenant(conn, _row(new))
        _audit(store, actor, f"tenant set {old.name}", describe(new), conn)
    return new


def remove(store: StateStore, name: str, *, actor: Optional[str] = None) -> Tenant:
    """Remove tenant ``name``; RefusedError (naming the domains and devices) while its domains hold
    devices.  Under :func:`host_lock`: a start admitted for the tenant records its allocation first."""
    with host_lock(store), store.transaction() as conn:
        t = get(store, name)
        held = [_alloc(r) for r in store.allocation_rows(conn) if (r[2] or "").lower() == t.name.lower()]
        if held:
            names = store.active_domains()
            owners = sorted({a.owner for a in held}, key=lambda o: (names.get(o) or o))
            shown = "; ".join(f"{adm.who(a, names)} ({adm.held_text(a)})"
                              for o in owners[:4] for a in held if a.owner == o)
            more = f"; and {len(owners) - 4} more domain(s)" if len(owners) > 4 else ""
            raise RefusedError(f"tenant {t.name!r} holds {len(held)} device(s): {shown}{more}",
                               hint="stop those domains first (vgpuhost never stops a VM itself), then remove "
                                    "the tenant; nothing was changed")
        bound = [r[0] for r in store.binding_rows(t.name)]
        store.delete_binding(conn, tenant=t.name)
        store.delete_tenant(conn, t.name)
        _audit(store, actor, f"tenant remove {t.name}", describe(t) + (
            f"; its bindings dropped: {', '.join(bound)}" if bound else ""), conn)
    return t


# ---------------------------------------------------------------------------
# bindings: the operator says whose a domain is (issue 28)

#: how an audit row names a binding with no class of its own (the tenant's, as it is at each start)
_OWN_CLASS = "the tenant's"


def binding_doc(row: Sequence, names: Optional[Mapping[str, str]] = None) -> Dict[str, object]:
    """``{"domain": UUID, "name": name or None, "tenant", "qos": class or None (the tenant's),
    "bound_by", "time"}`` of a binding row."""
    return {"domain": row[0], "name": (names or {}).get(row[0]), "tenant": row[1], "qos": row[2],
            "bound_by": row[3], "time": row[4]}


def bind(store: StateStore, domain: str, tenant: str, *, qos: Optional[str] = None, name: Optional[str] = None,
         actor: Optional[str] = None, dry_run: bool = False) -> Dict[str, object]:
    """Bind domain ``domain`` (UUID) to ``tenant`` and optionally QoS class ``qos`` (None: the tenant's own,
    as it is at each start); ``name``: the domain's name, for lines and the audit row.

    Idempotent: binding as bound changes nothing and writes no row.  Otherwise upserted with one audit row
    (path ``(tenants)``, operation ``tenant bind NAME``) in one transaction, under :func:`host_lock` (no
    start is admitted meanwhile).
    Raises InputError (an unknown tenant or class, a malformed UUID), RefusedError (``qos`` stronger than
    the tenant's class); nothing is changed then.  Returns ``{"action": "bind", "domain", "name",
    "tenant", "qos", "changed", "was": the previous binding's document or None, "dry_run"}``."""
    from ..model.tenancy import QOS_CLASSES
    from ..model.values import parse_uuid
    from ..policy.binding import stronger
    uuid = parse_uuid(domain)
    if qos is not None and qos not in QOS_CLASSES:
        raise InputError(f"unknown QoS class {qos!r}", hint="one of " + ", ".join(QOS_CLASSES))

    def run(c) -> Dict[str, object]:
        t = get(store, tenant)
        if qos is not None and stronger(qos, t.qos):
            raise RefusedError(f"domain {name or uuid}: QoS class {qos} is stronger than tenant {t.name!r}'s class "
                               f"{t.qos}", hint=f"bind a class no stronger than {t.qos}, or raise the tenant's class "
                                             f"first ('vgpuhost tenant set {t.name} --qos {qos}'); nothing was "
                                             "changed")
        old = store.binding(uuid)
        out = {"action": "bind", "domain": uuid, "name": name, "tenant": t.name, "qos": qos,
               "was": binding_doc(old, {uuid: name} if name else None) if old else None, "dry_run": dry_run}
        out["changed"] = old is None or old[1] != t.name or old[2] != qos
        if out["changed"] and not dry_run:
            who = actor or _actor()
            store.put_binding(c, uuid, t.name, qos, who)
            was = f" (was: tenant={old[1]} qos={old[2] or _OWN_CLASS})" if old else ""
            _audit(store, who, f"tenant bind {name or uuid}",
                   f"domain {uuid}: tenant={t.name} qos={qos or _OWN_CLASS}{was}", c)
        return out
    return _binding_write(store, run, dry_run)


def _binding_write(store: StateStore, run, dry_run: bool) -> Dict[str, object]:
    """``run(conn)`` of a binding change: under :func:`host_lock` in one transaction, or ``run(None)`` for a
    dry run (reads only)."""
    if dry_run:
        return run(None)
    with host_lock(store), store.transaction() as c:
        return run(c)


def unbind(store: StateStore, domain: str, *, name: Optional[str] = None, actor: Optional[str] = None,
           dry_run: bool = False) -> Dict[str, object]:
    """Drop the binding of domain ``domain`` (UUID): from its next start it is unbound (best effort, no
    tenant; refused under ``require-binding``).  Idempotent (unbound: nothing changed, no row); else one
    audit row in the same transaction, under :func:`host_lock`.  Returns ``{"action": "unbind", "domain",
    "name", "tenant": None, "qos": None, "changed", "was", "dry_run"}``; a running domain keeps what it
    was admitted with."""
    from ..model.values import parse_uuid
    uuid = parse_uuid(domain)

    def run(c) -> Dict[str, object]:
        old = store.binding(uuid)
        out = {"action": "unbind", "domain": uuid, "name": name, "tenant": None, "qos": None,
               "was": binding_doc(old, {uuid: name} if name else None) if old else None,
               "changed": old is not None, "dry_run": dry_run}
        if old is not None and not dry_run:
            store.delete_binding(c, domain=uuid)
            _audit(store, actor, f"tenant unbind {name or uuid}", f"domain {uuid}: was tenant={old[1]} "
                                                                  f"qos={old[2] or _OWN_CLASS}", c)
        return out
    return _binding_write(store, run, dry_run)


def _domain_ref(conn, store: StateStore, domain: str) -> Tuple[str, Optional[str]]:
    """``(UUID, name)`` of libvirt domain ``domain`` (name or UUID); a UUID libvirt does not know but the
    store holds a binding of gives ``(UUID, None)`` (so an undefined domain can be unbound).  Raises
    InputError naming the URI otherwise."""
    from ..model.errors import InputError as _Input
    from ..model.values import parse_uuid
    try:
        dom = conn.lookup(domain)
        return dom.uuid.lower(), dom.name
    except _Input:
        try:
            uuid = parse_uuid(domain)
        except _Input:
            uuid = None
        if uuid is not None and store.binding(uuid) is not None:
            return uuid, None
        raise


def bind_domain(store: StateStore, uri: Optional[str], domain: str, tenant: Optional[str] = None, *,
                qos: Optional[str] = None, unbind_it: bool = False, actor: Optional[str] = None,
                dry_run: bool = False) -> Dict[str, object]:
    """``vgpuhost tenant bind DOMAIN TENANT [--qos C]`` / ``tenant unbind DOMAIN``: ``domain`` (name or
    UUID) resolved through libvirt at ``uri`` (None: the default), then :func:`bind` / :func:`unbind`; a
    UUID libvirt does not know is bound as given (a domain about to migrate in).
    Raises as they do, and InputError for a domain libvirt does not know, HostEnvironmentError when
    libvirt cannot be reached."""
    from ..io import virt
    from ..model.errors import VgpuhostError
    from ..model.values import parse_uuid
    if unbind_it:
        # a bound UUID is unbound whatever libvirt says of it (undefined, or libvirt unreachable): the
        # binding is the store's; libvirt only gives the audit row its name
        try:
            bound = parse_uuid(domain)
        except VgpuhostError:
            bound = None
        if bound is not None and store.binding(bound) is not None:
            try:
                with virt.open_connection(virt.default_uri(uri)) as conn:
                    _, name = _domain_ref(conn, store, domain)
            except VgpuhostError:
                name = None
            return unbind(store, bound, name=name, actor=actor, dry_run=dry_run)
    with virt.open_connection(virt.default_uri(uri)) as conn:
        try:
            uuid, name = _domain_ref(conn, store, domain)
        except InputError:
            # a UUID libvirt does not know (yet): bound as given, so the destination of a live migration
            # can be bound before the domain arrives (docs/guide/migration.md); a name must be known
            try:
                uuid, name = parse_uuid(domain), None
            except VgpuhostError:
                raise InputError(f"libvirt does not know domain {domain!r}",
                                 hint="give its name or UUID ('virsh list --all'); a UUID is bound even before "
                                      "the domain is defined here") from None
            if unbind_it:
                raise
    if unbind_it:
        return unbind(store, uuid, name=name, actor=actor, dry_run=dry_run)
    if tenant is None:
        raise InputError("give the TENANT to bind the domain to", hint=f"'vgpuhost tenant bind {domain} TENANT'")
    return bind(store, uuid, tenant, qos=qos, name=name, actor=actor, dry_run=dry_run)


def bind_from_metadata(store: StateStore, uri: Optional[str], domain: Optional[str] = None, *,
                       actor: Optional[str] = None, dry_run: bool = False) -> Tuple[List[dict], List[dict]]:
    """The upgrade path (docs/guide/tenancy.md, "Trust model"): bind each libvirt domain (or ``domain``
    only) that has no binding yet to the tenant its vgpuhost metadata names, when that tenant exists;
    with no QoS class (the tenant's: a ``qos=`` in the metadata stays an ask, capped at the tenant's).
    Each binding is audited as :func:`bind` audits it.  Returns ``(bound, skipped)``: :func:`bind`'s
    documents, and ``{"domain", "name", "reason"}`` for every domain naming a tenant that was not
    bound (bound already, or an unknown tenant)."""
    from ..io import virt
    from ..libvirt.domxml import parse_domain
    from ..model.errors import VgpuhostError
    bound: List[dict] = []
    skipped: List[dict] = []
    with virt.open_connection(virt.default_uri(uri)) as conn:
        doms = [conn.lookup(domain)] if domain is not None else conn.domains()
        views = []
        for d in doms:
            try:
                views.append((d, parse_domain(d.inactive_xml())))
            except (VgpuhostError, ValueError) as e:
                skipped.append({"domain": d.uuid.lower(), "name": d.name,
                                "reason": f"its definition could not be read: {getattr(e, 'message', e)}"})
    ts = tenants(store)
    for d, view in views:
        asked = getattr(view.metadata, "tenant", None)
        if not asked:
            if domain is not None:
                skipped.append({"domain": view.uuid, "name": d.name, "reason": "its metadata names no tenant"})
            continue
        old = store.binding(view.uuid)
        if old is not None:
            skipped.append({"domain": view.uuid, "name": d.name, "reason": binding_text_of(old)})
            continue
        if adm.tenant_named(ts, asked) is None:
            skipped.append({"domain": view.uuid, "name": d.name,
                            "reason": f"its metadata names tenant {asked!r}, which does not exist "
                                      f"('vgpuhost tenant add {asked}' first)"})
            continue
        bound.append(bind(store, view.uuid, asked, name=d.name, actor=actor, dry_run=dry_run))
    return bound, skipped


def binding_text_of(row: Sequence) -> str:
    """A binding row in words (:func:`vgpuhost.policy.binding.binding_text`)."""
    from ..policy.binding import binding_text
    return binding_text(row)


def bindings(store: StateStore, tenant: Optional[str] = None) -> List[tuple]:
    """The binding rows ``(domain, tenant, qos, bound_by, time)``, one tenant's when given."""
    return store.binding_rows(tenant)


def set_require_binding(store: StateStore, on: bool, *, actor: Optional[str] = None) -> bool:
    """Turn ``require-binding`` on (an unbound domain's start is refused) or off (it is admitted as best
    effort with no tenant); audited (path ``(settings)``) in the same transaction.  Returns ``on``."""
    with host_lock(store), store.transaction() as conn:
        if require_binding(store) == on:            # as it is: idempotent, no row
            return on
        store.put_setting(conn, REQUIRE_BINDING, "on" if on else None)
        store.audit(actor=actor or _actor(), operation="tenant policy require-binding", path="(settings)",
                    value="on" if on else "off", conn=conn)
    return on


def unbound_running(store: StateStore) -> Dict[str, str]:
    """``{domain UUID: name}`` of the domains recorded as running (started through the hook, not released)
    that have no binding: under ``require-binding`` their next start is refused."""
    return {u: n for u, n in store.active_domains().items() if store.binding(u.lower()) is None}


def require_binding(store: StateStore) -> bool:
    """Is ``require-binding`` on?"""
    return store.setting(REQUIRE_BINDING) == "on"


def trust(store: StateStore, view: DomainView, *, binding: "object" = None,
          ts: Optional[Mapping[str, Tenant]] = None):
    """:func:`vgpuhost.policy.binding.trusted` for ``view``'s start on this host: its binding (one lookup by
    UUID; ``binding``: a row to weigh instead, as ``attach --tenant`` is about to record), the bound
    tenant's class (``ts``: the tenants, read when not given), the OpenStack mapping and ``require-binding``."""
    from ..policy.binding import trusted
    row = store.binding(view.uuid) if binding is None else binding
    ts = tenants(store) if ts is None else ts
    meta = view.metadata
    mode = store.setting(OPENSTACK)
    tenant = row[1] if row is not None else None
    if row is None and mode and view.nova_project is not None:
        tenant = (view.nova_project[1] if mode == "project-uuid" else view.nova_project[0]) or None
    t = adm.tenant_named(ts, tenant) if tenant else None
    return trusted(view.name or view.uuid, binding=row, asked_tenant=getattr(meta, "tenant", None),
                   asked_qos=getattr(meta, "qos", None), tenant_class=t.qos if t is not None else None,
                   openstack=mode, nova_project=view.nova_project, require_binding=require_binding(store))


# ---------------------------------------------------------------------------
# promises: every guarantee can be kept together (issue 26 #3)

#: the setting naming the tenants whose guarantees were recorded at risk (``--allow-oversubscribe``), comma-separated
OVERSUBSCRIBED = "tenants.oversubscribed"


class Promise:
    """How ``tenant add|set`` check their guarantees (:func:`keep_promise`).

    ``inventory``: the host's :class:`Inventory`, or a callable giving it
    (None, or a callable raising VgpuhostError/OSError: the host cannot be
    read, so nothing is checked and :attr:`warning` says so); ``allow``:
    ``--allow-oversubscribe``, record guarantees that cannot all be kept
    instead of refusing them.  After the change, :attr:`warning` holds the
    line to show ('' when every guarantee can be kept).
    """

    def __init__(self, inventory, allow: bool = False):
        self.inventory, self.allow = inventory, allow
        self.warning = ""

    def read(self) -> Optional[Inventory]:
        from ..model.errors import VgpuhostError
        try:
            return self.inventory() if callable(self.inventory) else self.inventory
        except (VgpuhostError, OSError):
            return None


def oversubscribed(store: StateStore) -> List[str]:
    """The tenants whose guarantees were recorded at risk with ``--allow-oversubscribe``, in order."""
    return [n for n in (store.setting(OVERSUBSCRIBED) or "").split(",") if n]


def _guarantee_facts(store: StateStore, inv: Inventory) -> Tuple[List[adm.Allocation], List[adm.HostGpu], object]:
    from ..policy import offers as vgpu_offers
    seen = store.seen_types() + vgpu_offers.seen_rows(inv)
    facts = host_gpus(inv, seen, _type_fb(inv, store), _gpu_slices(inv, seen))
    held = gputime.with_use(gputime.history(store), allocations(store, inv))
    pl = pools(store)
    return held, adm.gpu_time_room(facts, held, pl), adm.serves_of(pl)


def _risk(store: StateStore, inv: Inventory, ts: Mapping[str, Tenant], last: Optional[str] = None):
    """:func:`vgpuhost.policy.feasibility.risk` of tenants ``ts`` on this host, kept in this order: the
    tenants whose guarantees were checked when promised, then ``last`` (the one being changed), then
    those recorded at risk (``--allow-oversubscribe``), in the order they were."""
    from ..policy.feasibility import risk
    held, facts, serves = _guarantee_facts(store, inv)
    late = [n.lower() for n in oversubscribed(store) if not last or n.lower() != last.lower()]

    def rank(n: str):
        low = n.lower()
        if last and low == last.lower():
            return (1, 0, n)
        return (2, late.index(low), n) if low in late else (0, 0, n)
    return risk(ts, held, facts, serves, sorted(ts, key=rank))


def keep_promise(store: StateStore, conn, new: Tenant, promise: Optional[Promise], actor: Optional[str]) -> None:
    """Refuse (RefusedError, nothing changed) a tenant change after which the guarantees of all
    tenants cannot be served together on this host (:mod:`vgpuhost.policy.feasibility`: pools, QoS
    classes, isolation, boards and types, equal-size mode, vGPU counts, framebuffer, MIG slices,
    passthrough GPUs), unless ``promise.allow``: then the tenant is recorded at risk (setting
    :data:`OVERSUBSCRIBED`, in ``conn``'s transaction, with an audit row) and ``promise.warning`` says
    so.  Guarantees already at risk before the change do not refuse it.  ``promise`` None: no check."""
    if promise is None:
        return
    inv = promise.read()
    if inv is None:
        promise.warning = "guarantees not checked: the host's GPUs could not be read"
        return
    before = tenants(store)
    after = {n: t for n, t in before.items() if n.lower() != new.name.lower()}
    after[new.name] = new
    now = _risk(store, inv, after, new.name)
    was = {n.lower() for n in _risk(store, inv, before, new.name).tenants} if now.tenants else set()
    fresh = [n for n in now.tenants if n.lower() not in was]
    if not fresh:
        if not now.decided:
            promise.warning = "guarantees not fully checked: the search was left undecided (too many choices)"
        elif now.tenants:
            promise.warning = f"guarantee at risk (as before): {now.text}"
        return
    if not promise.allow:
        raise RefusedError(f"tenant {new.name!r}: the guarantees cannot all be kept on this host: {now.text}",
                           hint="lower a guarantee, change the isolation, pools or series, or give "
                                "--allow-oversubscribe to record them as at risk; nothing was changed")
    names = oversubscribed(store)
    names += [n for n in fresh if n.lower() not in {x.lower() for x in names}]
    store.put_setting(conn, OVERSUBSCRIBED, ",".join(names))
    store.audit(actor=actor or _actor(), operation=f"tenant oversubscribe {new.name}", path="(tenants)",
                value=f"guarantee at risk: {now.text}")
    promise.warning = f"guarantee at risk (--allow-oversubscribe): {now.text}"


def guarantees_at_risk(store: StateStore, inv: Optional[Inventory]) -> Optional[dict]:
    """``{"tenants": [names], "reasons": {tenant: its unused guarantee}, "text": line, "decided": bool}``:
    whose guarantees cannot be served beside the others' now; None without an inventory or tenants."""
    ts = tenants(store)
    if inv is None or not ts:
        return None
    r = _risk(store, inv, ts)
    return {"tenants": list(r.tenants), "reasons": dict(r.reasons), "text": r.text, "decided": r.decided}


def guarantee_findings(store: StateStore, inv: Inventory) -> list:
    """``host check`` findings (:class:`vgpuhost.policy.checks.Finding`, code ``GUARANTEE_AT_RISK``,
    a warning) for each tenant whose guarantee cannot be served beside the others' now."""
    from ..policy.checks import Finding
    risk = guarantees_at_risk(store, inv)
    if not risk:
        return []
    out = [Finding("warning", "GUARANTEE_AT_RISK", f"tenant {n}",
                   f"the guarantee of tenant {n!r} cannot be served beside the other tenants' on this host: "
                   f"{risk['text']}",
                   f"lower a guarantee ('vgpuhost tenant set {n} ...'), change isolation or pools, or add GPUs; "
                   "'vgpuhost tenant usage' shows it") for n in risk["tenants"]]
    if not risk["decided"]:
        out.append(Finding("info", "GUARANTEES_UNCHECKED", "tenants",
                           "whether every guarantee can be served together was left undecided (too many choices)"))
    return out


# ---------------------------------------------------------------------------
# allocations

def _alloc(row: Sequence) -> adm.Allocation:
    return adm.Allocation(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8], bool(row[9]))


def allocations(store: StateStore, inv: Optional[Inventory] = None) -> List[adm.Allocation]:
    """What admission counts as held now.

    The ``allocations`` rows whose device vgpuhost still holds (a vGPU record,
    or a passthrough record of the GPU), then every vGPU record and
    passthrough GPU with no row, with no tenant (manual, layout, or made
    before tenancy).
    """
    vrecs = store.vgpu_records()
    # a tenant named in another case (recorded while tenancy was off) is the tenant as stored
    canon = {r[0].lower(): r[0] for r in store.tenant_rows()}
    pt_gpus: Dict[str, str] = {}
    for r in store.passthrough_records():
        pt_gpus.setdefault(r.gpu, r.owner)
    ids = {r.id for r in vrecs}
    out: List[adm.Allocation] = []
    seen = set()
    for row in store.allocation_rows():
        a = _alloc(row)
        if a.tenant and canon.get(a.tenant.lower(), a.tenant) != a.tenant:
            a = replace(a, tenant=canon[a.tenant.lower()])
        if (a.kind == adm.VGPU and a.device in ids) or (a.kind == adm.PASSTHROUGH and a.gpu in pt_gpus):
            out.append(a)
            seen.add(a.device)
    fbs = None
    for r in vrecs:
        if r.id in seen:
            continue
        if fbs is None:
            fbs = _type_fb(inv, store)
        dem = adm.vgpu_demand(r.type_name, fbs.get(r.type_name.lower()))
        out.append(adm.Allocation(r.id, r.owner, None, r.gpu, adm.VGPU, r.type_name, dem.framebuffer_mib,
                                  dem.mig_slices))
    for gpu, owner in sorted(pt_gpus.items()):
        if gpu not in seen:
            out.append(adm.Allocation(gpu, owner, None, gpu, adm.PASSTHROUGH))
    return out


# ---------------------------------------------------------------------------
# pools

#: the settings key holding the pools' compute ceilings, ``name=share;name=share`` (pools declaring one)
POOL_CEILINGS = "pool-ceilings"


def _ceilings(text: Optional[str]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for part in (text or "").split(";"):
        name, _, value = part.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            continue                # a damaged entry: the default ceiling
    return out


def pools(store: StateStore) -> List[adm.Pool]:
    """The declared pools (from the layout), each with its GPUs and its compute ceiling (None: 1.0)."""
    by: Dict[str, Tuple[str, str, List[str]]] = {}
    for gpu, pool, policy, classes in store.pool_rows():
        by.setdefault(pool, (policy, classes, []))[2].append(gpu)
    ceil = _ceilings(store.setting(POOL_CEILINGS)) if by else {}
    return [adm.Pool(n, p, tuple(c.split(",")) if c else (), tuple(gs), ceil.get(n))
            for n, (p, c, gs) in sorted(by.items())]


def check_pools(store: StateStore, new: Sequence[adm.Pool], *, policies: Optional[Mapping[str, str]] = None) -> None:
    """Raise unless ``new`` may replace the recorded pools now.

    InputError for :func:`vgpuhost.policy.admission.pool_problems` (a GPU in
    two pools: two scheduler policies on one GPU); RefusedError for
    :func:`vgpuhost.policy.admission.pool_change_refusal` over the devices
    domains hold (NVML changes a GPU's scheduler policy only while it holds
    no vGPUs; ``policies``: the policy each GPU runs now, by BDF).
    """
    problems = adm.pool_problems(new)
    if problems:
        raise InputError("pools: " + "; ".join(problems), hint="one GPU belongs to one pool")
    held = [a for a in allocations(store) if not Owner.is_pool(a.owner)]
    why = adm.pool_change_refusal(pools(store), new, held, policies)
    if why:
        raise RefusedError(why, hint="stop the domains on it first, or leave it in its pool")


def pool_changes(store: StateStore, new: Sequence[adm.Pool]) -> List[str]:
    """What recording ``new`` as the host's pools would change, one line a GPU (empty: nothing):
    ``GPU 0000:41:00.0: pool gold (fixed-share, serves guaranteed)`` or ``GPU ...: out of pool gold``."""
    old = {g: p for p in pools(store) for g in p.gpus}
    changes: List[str] = []
    for p in new:
        for g in p.gpus:
            if g not in old or old[g].name != p.name or old[g].policy != p.policy or old[g].classes != p.classes \
                    or old[g].ceiling != p.ceiling:
                changes.append(f"GPU {g}: pool {p.name} ({p.policy}, serves {', '.join(p.classes)}"
                               + (f", compute ceiling {p.ceiling:g}" if p.ceiling is not None else "") + ")")
    for g, p in old.items():
        if not any(g in n.gpus for n in new):
            changes.append(f"GPU {g}: out of pool {p.name}")
    return changes


def set_pools(store: StateStore, new: Sequence[adm.Pool], *, policies: Optional[Mapping[str, str]] = None,
              actor: Optional[str] = None, check: bool = True) -> List[str]:
    """Record ``new`` as the host's pools (replacing the old, and forgetting which GPUs the capacity
    reconciler had moved: :data:`vgpuhost.policy.admission.REBALANCE_MOVED`); returns what changed, one line each (also
    one audit row).  ``check``: :func:`check_pools` first (``vgpuhost apply`` checks before its steps and
    records after them).  Raises as :func:`check_pools`; nothing changes then.
    """
    if check:
        check_pools(store, new, policies=policies)
    changes = pool_changes(store, new)
    with store.transaction() as conn:
        store.replace_pools(conn, [(g, p.name, p.policy, ",".join(p.classes)) for p in new for g in p.gpus])
        store.put_setting(conn, POOL_CEILINGS, ";".join(f"{p.name}={p.ceiling:g}" for p in new
                                                        if p.ceiling is not None) or None)
        for key in store.settings_under(adm.REBALANCE_MOVED):    # the recorded pools are the layout's again
            store.put_setting(conn, key, None)
    if changes:
        store.audit(actor=actor or _actor(), operation="pools set", path="(pools)", value="; ".join(changes))
    return changes


# ---------------------------------------------------------------------------
# admission for a domain

def set_openstack(store: StateStore, mode: Optional[str], *, actor: Optional[str] = None) -> Optional[str]:
    """Turn the OpenStack tenant mapping on (``project-name`` / ``project-uuid``) or off (None); audited."""
    if mode is not None and mode not in OPENSTACK_MODES:
        raise InputError(f"unknown OpenStack mapping {mode!r}", hint="one of " + ", ".join(OPENSTACK_MODES) + ", off")
    store.set_setting(OPENSTACK, mode)
    store.audit(actor=actor or _actor(), operation="tenant openstack", path="(settings)", value=mode or "off")
    return mode


def admit_domain(store: StateStore, view: DomainView, inv: Inventory, *, actor: Optional[str] = None,
                 allowed: Optional[frozenset] = None, audit: bool = True,
                 types: Optional[Mapping[str, str]] = None,
                 limits_for: "Optional[Callable[[str], Mapping]]" = None,
                 policies: "Optional[Callable[[Sequence[str]], Mapping[str, str]]]" = None,
                 binding: "object" = None, trusted: "object" = None) -> List[Granted]:
    """Admit every device ``view``'s metadata names that the domain does not hold yet, all or none.

    The tenant and QoS class are the trusted ones (:func:`trust`: the operator's binding, or Nova's
    project with the OpenStack mapping on; ``binding``: a binding row to weigh instead of the store's,
    as ``attach --tenant`` is about to record; ``trusted``: :func:`trust`'s answer, already asked): a
    domain whose metadata claims another tenant or a stronger class, an unbound one under
    ``require-binding``, or a Nova domain with no project is refused (one ``refused`` row with
    ``audit``, naming the binding).

    What is held: :func:`allocations`, and the live reservations of other incoming live migrations
    (:func:`reserved_allocations`: as their bound tenant's vGPUs, for quota and isolation; a refusal's
    hint then names them and what frees them).

    Call under :func:`host_lock` (the qemu hook, with authority); ``attach``
    calls it without, for early feedback (``audit`` False: nothing written).
    ``inv``: the host as :func:`vgpuhost.ops.health.in_service` gives it (GPUs out of service and VFs
    reserved for other incoming migrations offer nothing), as the hook's start, ``migrate begin`` and the
    tenant's allocate read it: the offers are counted on it, so a GPU out of service left in would be
    admitted, then refused by the device layer (only ``attach``'s early look at an mdev vGPU pinned to a
    GPU out of service passes the host unfiltered: it notes that GPU instead).
    ``audit``: a refusal is written as the start's one admission row; the
    admitted decisions are not written here but by :func:`record_admitted`,
    with their allocations, before the devices are made.
    ``allowed``: the hook allow-list (None = every GPU).  ``types``: ``{device: type name as the
    host's devices spell it}``, resolved once by the caller (the hook's prepare); a vGPU not named
    there has its profile resolved here (``attach``'s early look).  ``limits_for``: as
    :func:`admitting`'s (None: equal-size maxima, as the driver's listing shows).  ``policies``:
    GPU BDFs -> ``{BDF: scheduler policy it runs now}`` (:func:`scheduler_policies`), asked once, only
    for the GPUs of declared pools that offer a time-sliced vGPU asked for (None: not checked); a GPU
    running another policy than its pool's is in drift and admits nothing.
    Raises RefusedError with the first refusal's reason and what would free
    room; InputError when the domain's metadata names a QoS class not known.
    """
    from ..policy import offers as vgpu_offers
    meta = view.metadata
    if meta is None or meta.empty:
        return []
    me = view.uuid
    ts = tenants(store)
    tr = trusted if trusted is not None else trust(store, view, binding=binding, ts=ts)
    if tr.refusal:
        if audit:
            first = next((str(g) for g in meta.passthrough), None) or next((v.device for v in meta.vgpus), "-")
            store.audit(actor=actor or _actor(), operation=f"admission {view.name or me} {first}",
                        path="(admission)", value=tr.refusal, result="refused")
        e = RefusedError(f"admission: {tr.refusal}", hint=tr.hint)
        e.audited = bool(audit)
        raise e
    tname = tr.tenant
    held = allocations(store, inv)
    admitted = {r[0] for r in store.allocation_rows(owner=me)}
    mine = {a.device for a in held if a.owner == me and a.device in admitted}
    # devices the domain holds with no admitted allocation (made for it in advance: ``vgpu create
    # --owner``, the agent's allocate endpoint) are admitted now like any other, where they are; until
    # then they count as no one's, so they leave the use admission weighs (else counted twice)
    premade = {a.device: a for a in held if a.owner == me and a.device not in admitted}
    held = [a for a in held if a.device not in premade]
    hist = gputime.history(store)             # expected GPU time: the metered history, one query
    held = gputime.with_use(hist, held)
    records = store.vgpu_records()
    seen = store.seen_types() + vgpu_offers.seen_rows(inv)
    fbs = _type_fb(inv, store)
    facts = admit_facts(store, inv, seen, fbs)
    # what other incoming live migrations reserved here is as good as in use (trial 7 F4): their prepare
    # begin follows at once and makes it, so it counts as its bound tenant's, for quota and isolation alike
    pending = reserved_allocations(store, me, held, ts, fbs)
    if pending:
        held = held + pending
        facts = dict(facts, names={**facts["names"], **{a.owner: n for a, n, _ in pending_names(store, pending)}})
    pl = facts["pools"]
    qos = tr.qos
    out: List[Granted] = []
    reqs: List[Tuple[str, adm.AdmissionRequest, list, frozenset]] = []
    for g in meta.passthrough:
        if str(g) not in mine:
            reqs.append((str(g), adm.AdmissionRequest(me, adm.passthrough_demand(), tname, qos, str(g)), [],
                         frozenset()))
    for v in meta.vgpus:
        if v.device in mine:
            continue
        pin = v.gpu
        if v.vf is not None:
            dev = inv.devices.get(v.vf)
            pin = dev.physfn if dev is not None else pin
        name = types[v.device] if types and v.device in types else \
            vgpu_offers.resolve_profile(inv, records, str(v.profile), pin, seen)
        offers = _lent(vgpu_offers.offers(inv, records, name, seen, limits_for(name) if limits_for else None,
                                          owner=me, modes=getattr(limits_for, "modes", None)), records, name)
        offers = vgpu_offers.allowed_only(offers, allowed)        # as migrate begin's placement narrows them
        pre = premade.get(v.device)
        rec = next((r for r in records if r.id == v.device), None) if pre is not None else None
        if rec is not None and rec.type_name.lower() == name.lower():
            pin = rec.gpu                       # it exists there: admitted in place, no new instance placed
            offers = _held_offers(offers, rec, me, inv)
        lent = next((r for r in records if r.id == v.device and r.owner == Owner.LAYOUT
                     and r.type_name.lower() == name.lower()), None) if pre is None else None
        if lent is not None:
            # the layout's free vGPU the domain names is claimed where it is (ops.devices._make_vgpu): that
            # GPU is the one admission weighs, its pool, class and isolation included, without the claimed
            # vGPU itself as a neighbour
            pin = lent.gpu
        dem = gputime.demand_with_use(hist, adm.vgpu_demand(name, fbs.get(name.lower())), me, tname)
        reqs.append((v.device, adm.AdmissionRequest(me, dem, tname, qos, str(pin) if pin else None,
                                                    meta.strategy, meta.anti_affinity), offers,
                     frozenset({lent.id}) if lent is not None else frozenset()))
    # pinned devices first: an unpinned vGPU placed first could take the GPU a pinned one needs (one vGPU
    # per VM per GPU), as ops.devices makes them
    reqs.sort(key=lambda r: r[1].demand.kind == adm.VGPU and r[1].gpu is None)
    running: Optional[Mapping[str, str]] = None
    if policies is not None and pl:
        pooled = {g for p in pl if p.policy for g in p.gpus}
        asked = sorted({str(o.gpu) for _, r, offers, _ in reqs if not r.demand.hardware for o in offers
                        if o.type_id is not None and str(o.gpu) in pooled})
        running = policies(asked) if asked else None
    taken: set = set()          # GPUs this start's earlier vGPUs went to: one vGPU per VM per GPU
    for device, req, offers, replaced in reqs:
        if taken and req.demand.kind == adm.VGPU:
            offers = [replace(o, owners=o.owners | {me}) if str(o.gpu) in taken else o for o in offers]
        facts_of = dict(facts, tenants=ts, policies=running)
        d = None
        lending = _lendable(records, req.demand.profile) if req.demand.kind == adm.VGPU and not req.gpu else {}
        if any(str(o.gpu) in lending for o in offers):
            # the pool model lends a layout's free vGPU before it makes one (ops.devices._swap_from_pool):
            # placed first where one is lent, so the device goes where this decision (and its row) says;
            # the vGPU whose slot is handed over (the first by id, as the swap takes it) is no neighbour
            handed = {min(r.id for r in records if r.owner == Owner.LAYOUT and r.gpu == g
                          and r.type_name.lower() == req.demand.profile.lower()) for g in lending}
            d = adm.admit(req, offers=[o if str(o.gpu) in lending else
                                       replace(o, available=0, parents=(), note="no layout vGPU to lend")
                                       for o in offers],
                          allocations=[a for a in held if a.device not in handed], **facts_of)
            if not d.admitted:
                d = None
        if d is None:
            d = adm.admit(req, offers=offers, allocations=[a for a in held if a.device not in replaced], **facts_of)
        if audit and not d.admitted:
            # the start's one row: the devices admitted before this one are not made, so not audited
            # the row, and beside it (its own columns) what admission decided: the reconciler's demand
            # is read from those, never from the value (it echoes the domain's name: trial 10 F4)
            store.audit_refusal(actor=actor or _actor(), operation=f"admission {view.name or me} {device}",
                                value=f"{d.one_line()}; {tr.text}; "
                                      f"{adm.refusal_tag(d.code, req.demand.profile, d.qos, d.tenant)}",
                                domain_uuid=me, device=device, code=d.code, profile=req.demand.profile,
                                qos=str(d.qos), tenant=d.tenant)
        if not d.admitted:
            hint = d.remedy()
            if pending:
                hint = f"{hint}; {reserved_note(store, pending)}" if hint else reserved_note(store, pending)
            e = RefusedError(f"admission: {d.reason}", hint=hint)
            e.audited = bool(audit)
            raise e
        out.append(Granted(device, req.demand, d))
        held = [*held, adm.allocation(device, me, d.gpu or "", req.demand, d)]   # the next device counts it
        if d.gpu and req.demand.kind == adm.VGPU:
            taken.add(d.gpu)
    return out


def reserved_allocations(store: StateStore, owner: str, held: Sequence[adm.Allocation],
                         ts: Mapping[str, Tenant], fbs: Mapping[str, int]) -> List[adm.Allocation]:
    """The vGPUs other incoming live migrations than ``owner``'s reserved on this host (the qemu hook's
    ``migrate begin``, :mod:`vgpuhost.ops.migrate`), live (not expired) and not made yet (no device of
    ``held`` has their id), as admission counts them: one allocation each on its reserved GPU, of the
    tenant the destination's admission trusted at ``migrate begin`` (stored with the reservation: the
    domain's binding, or the OpenStack mapping of its XML's ``<nova:project>``, trial 7 retest N1) and
    its class (stored; else the tenant's); a row that stores no tenant (tenancy was not in use then, or
    made before schema 15) counts for the domain's binding here (none: a domain without a tenant).  Burst
    where the tenant's use with it passes a guaranteed limit; each is marked ``reserved``.
    ``held``: the allocations counted already; ``ts``: the tenants; ``fbs``: framebuffer MiB by type
    name (lower case).  One query (``[]`` without reservations), one binding lookup per reserving domain
    that stores no tenant."""
    rows = store.reservation_rows() if not store.absent else []
    if not rows:
        return []
    from ..io.state import utcnow
    now = utcnow()
    have = {a.device for a in held}
    out: List[adm.Allocation] = []
    counted = list(held)
    bound: Dict[str, object] = {}
    for device, who, _name, gpu, _kind, profile, expires, _time, stored, stored_qos in \
            sorted(rows, key=lambda r: (r[7], r[0])):
        if who == owner or expires < now or device in have:
            continue            # its own, expired (holds nothing), or made already (counted as held)
        if stored:
            row = (who, stored, stored_qos)         # what migrate begin's admission trusted (binding or mapping)
        else:
            if who not in bound:
                bound[who] = store.binding(who)
            row = bound[who]
        t = adm.tenant_named(ts, row[1]) if row is not None else None
        tname = t.name if t is not None else (row[1] if row is not None else None)
        qos = (row[2] if row is not None and row[2] else None) or (t.qos if t is not None else UNTENANTED_QOS)
        dem = adm.vgpu_demand(profile, fbs.get(profile.lower()))
        burst = False
        if t is not None:
            used = adm.usage(t.name, counted)
            g = t.quota.guaranteed
            burst = any(dem.amount(d) and g.get(d) is not None and used[d][0] + dem.amount(d) > g.get(d)
                        for d in DIMENSIONS)
        a = adm.Allocation(device, who, tname, gpu, adm.VGPU, profile, dem.framebuffer_mib, dem.mig_slices, qos, burst,
                           reserved=True)
        out.append(a)
        counted.append(a)
    return out


def pending_names(store: StateStore, pending: Sequence[adm.Allocation]) -> List[Tuple[adm.Allocation, str, str]]:
    """``(allocation, domain name, expiry)`` of each of :func:`reserved_allocations`' allocations."""
    rows = {r[0]: r for r in store.reservation_rows()}
    return [(a, rows[a.device][2] if a.device in rows else a.owner, rows[a.device][6][:19] if a.device in rows
             else "") for a in pending]


def reserved_note(store: StateStore, pending: Sequence[adm.Allocation]) -> str:
    """The words a refusal's hint adds when :func:`reserved_allocations` counted: what is reserved, for
    whom, until when, and what frees it."""
    named = pending_names(store, pending)
    parts = [f"vGPU {a.profile} on {a.gpu} reserved for the incoming migration of domain {n!r}"
             + (f" (tenant {a.tenant!r})" if a.tenant else " (no tenant)") + (f" until {e} UTC" if e else "")
             for a, n, e in named[:3]]
    more = f" and {len(named) - 3} more" if len(named) > 3 else ""
    return ("counted as in use: " + "; ".join(parts) + more + " (freed when its prepare begin makes it, the "
            "migration is cancelled, or the reservation expires: 'vgpuhost reconcile')")


def admit_facts(store: StateStore, inv: Inventory, seen: Sequence[tuple], fbs: Mapping[str, int]) -> Dict[str, object]:
    """The host facts :func:`vgpuhost.policy.admission.admit` weighs beside a request, as its keywords:
    ``pools``, ``names`` (domain names by UUID), ``gpu_memory`` (MiB by BDF), ``gpu_slices`` and ``gpus``
    (:func:`host_gpus`); ``seen``: the vGPU types seen (``(gpu, type_id, name, framebuffer_mib)`` rows),
    ``fbs``: framebuffer MiB by type name (lower case).  One reading for the start's admission,
    ``capacity`` and ``advise`` alike."""
    slices = _gpu_slices(inv, seen)
    return dict(pools=pools(store), names=store.active_domains(),
                gpu_memory={str(g.address): g.framebuffer_mib for g in inv.gpus if g.framebuffer_mib},
                gpu_slices=slices, gpus=host_gpus(inv, seen, fbs, slices))


def _lendable(records: Sequence, name: str) -> Dict[str, int]:
    """``{GPU BDF: the layout's free vGPUs of type name}`` (case-insensitive), which a start may be lent."""
    lendable: Dict[str, int] = {}
    for r in records:
        if r.owner == Owner.LAYOUT and r.type_name.lower() == name.lower():
            lendable[r.gpu] = lendable.get(r.gpu, 0) + 1
    return lendable


def _lent(offers: Sequence, records: Sequence, name: str) -> list:
    """``offers`` of vGPU type ``name`` as admission counts them: the pool model lends a layout's free
    vGPU of the type at the start (:mod:`vgpuhost.ops.devices`), so each is one more instance there."""
    lendable = _lendable(records, name)
    return [replace(o, available=o.available + lendable[str(o.gpu)], note="",
                    parents=o.parents or (o.gpu,)) if lendable.get(str(o.gpu)) else o for o in offers]


def host_gpus(inv: Inventory, seen: Sequence[tuple], fbs: Mapping[str, int],
              slices: Mapping[str, int]) -> List[adm.HostGpu]:
    """Every GPU of ``inv`` with a known framebuffer as the guarantees see it (:class:`HostGpu`): the vGPU
    types it offers (listed now or seen before, ``seen``: ``(gpu, type_id, name, framebuffer_mib)`` rows;
    ``fbs``: framebuffer MiB by type name, lower case) and its compute slices in MIG mode (``slices``,
    :func:`_gpu_slices`), and the most vGPUs of each time-sliced size mdev on the GPU itself lists
    (on VFs each VF lists its own).  A GPU listing no type (driver not loaded, passed through) offers
    any size."""
    from ..model.values import VgpuProfile
    types: Dict[str, set] = {}
    most: Dict[str, Dict[int, int]] = {}
    for t in inv.vgpu_types:
        types.setdefault(str(t.gpu), set()).add(t.name)
        if t.max_instances and t.framebuffer_mib and not (t.profile and t.profile.gi_slices) \
                and t.backend == Backend.MDEV and t.parent == t.gpu:      # per GPU, not per VF
            m = most.setdefault(str(t.gpu), {})
            m[t.framebuffer_mib] = max(m.get(t.framebuffer_mib, 0), t.max_instances)
    for row in seen:
        types.setdefault(row[0], set()).add(row[2])
    out = []
    for g in inv.gpus:
        addr = str(g.address)
        if not g.framebuffer_mib:
            continue
        named = []
        for name in sorted(types.get(addr, ())):
            p = VgpuProfile.try_parse(name)
            fb = fbs.get(name.lower()) or (p.framebuffer_gb * 1024 if p else 0)
            if fb:
                named.append((name, fb, (p.gi_slices or 0) if p else 0))
        out.append(adm.HostGpu(addr, g.framebuffer_mib, tuple(named) or None, slices.get(addr, 0),
                               tuple(sorted(most.get(addr, {}).items()))))
    return out


def _gpu_slices(inv: Inventory, seen: Sequence[tuple]) -> Dict[str, int]:
    """Compute slices per GPU where its MIG-backed vGPU types are known (listed now, or seen before):
    the most slices a type of it takes (``H200X-7-141C``: 7) is the whole GPU."""
    from ..model.values import VgpuProfile
    out: Dict[str, int] = {}
    named = [(str(t.gpu), t.profile) for t in inv.vgpu_types]
    named += [(row[0], VgpuProfile.try_parse(row[2])) for row in seen]
    for gpu, p in named:
        if p is not None and p.gi_slices:
            out[gpu] = max(out.get(gpu, 0), p.gi_slices)
    return out


def _held_offers(offers: Sequence, rec, me: str, inv: Inventory) -> list:
    """``offers`` for admitting vGPU record ``rec``, made for domain ``me`` in advance, where it is: its
    GPU offers the instance it holds (placement's one-vGPU-per-VM rule does not count it against
    itself); the request is pinned there, so the other GPUs do not matter."""
    from ..model.values import PciAddress
    from ..policy.placement import GpuOffer
    gpu = PciAddress.parse(rec.gpu)
    parent = PciAddress.parse(rec.parent) if PciAddress.is_valid(rec.parent) else gpu
    out, found = [], False
    for o in offers:
        if o.gpu == gpu:
            found = True
            o = replace(o, type_id=o.type_id or rec.type_id, type_name=o.type_name or rec.type_name,
                        available=max(0, o.available) + 1, parents=o.parents or (parent,),
                        owners=o.owners - {me}, note="")
        out.append(o)
    if not found:
        g = inv.gpu(gpu)
        out.append(GpuOffer(gpu, g.pci.numa_node if g is not None else 0, rec.type_id, rec.type_name, 1,
                            (parent,)))
    return out


def admitting(store: StateStore, view: DomainView, inv: Inventory, *, actor: Optional[str] = None,
              allowed: Optional[frozenset] = None, types: Optional[Mapping[str, str]] = None,
              limits_for: "Optional[Callable[[str], Mapping]]" = None,
              policies: "Optional[Callable[[Sequence[str]], Mapping[str, str]]]" = None,
              binding: "object" = None) -> "_AdmittingBlock":
    """The qemu hook's ``prepare begin``: admit the domain's devices with authority.

    ``binding``: a binding row to weigh instead of the store's (:func:`trust`): the agent's tenant
    allocate passes the tenant the caller's credentials established for a domain it holds.

    Call it under :func:`host_lock`, taken before ``inv`` and the store were
    read and held until the block ends (:func:`vgpuhost.ops.devices.prepare`
    does): one decision per start, on facts read under the lock.
    ``with admitting(...) as box:`` gives an :class:`Admitting`; entering it
    decides (RefusedError, one ``refused`` audit row, nothing written else,
    when admission refuses) and, before any device write, records the
    decision in one transaction: an allocation row per device (the GPU
    admission placed it on) and one ``admitted`` audit row each, so a start
    killed half-way leaves no device outside its tenant's quota.  The caller
    creates the devices inside the block where :meth:`Admitting.placed_gpu`
    says (a re-check only; :meth:`Admitting.refused` rewords its refusal in
    admission's terms) and reports each with :meth:`Admitting.made`.  When
    the block ends without an error the allocation rows take the GPUs the
    devices went to; when it ends by an error (the caller has undone what it
    made) the rows of devices no longer held go, and each admission row gets
    its outcome (result ``refused`` or ``failed``, `` -> not made: ...``) in
    the same transaction, so the audit shows one decision per device whose
    result matches the start's exit.  With tenancy not in use (:func:`active`)
    every device is admitted with nothing audited (its tenant name, if any,
    is still recorded at the end).
    ``types``: the vGPUs' type names as resolved once (:func:`admit_domain`); ``limits_for``:
    a type name -> ``{gpu: its max in the GPU's vGPU mode}`` (:func:`vgpuhost.ops.vgpu.mode_limits`),
    so admission counts what the device layer will (mixed-size maxima are often lower); ``policies``:
    as :func:`admit_domain`'s, called under the lock (the scheduler policy each pooled GPU runs).
    """
    return _AdmittingBlock(store, view, inv, actor, allowed, types, limits_for, policies, binding)


def record_admitted(store: StateStore, view: DomainView, granted: Sequence[Granted], *,
                    actor: Optional[str] = None, bound: str = "") -> Dict[str, int]:
    """Record admitted ``granted`` before their devices are made, in one transaction: each device's
    allocation row (on the GPU admission decided; a passthrough GPU's own) and its ``admitted`` audit
    row (``bound``: the binding in words, appended to its value).  Returns ``{device: audit row id}``
    for :func:`void_admitted`."""
    me = view.uuid
    rows: Dict[str, int] = {}
    who = actor or _actor()
    with store.transaction() as conn:
        theirs = {row[0]: row[1] for row in store.allocation_rows(conn) if row[1] != me}
        # another owner's allocation of a device it still holds is never replaced (its tenant's quota would
        # lose it); a row left by a device no longer held (a start killed before reconcile) is, as before
        taken = [gr.device for gr in granted
                 if gr.device in theirs and gr.device in _held_by(store, theirs[gr.device])]
        if taken:
            raise RefusedError(f"vGPU UUID {taken[0]} is taken; omit its UUID for a new one",
                               hint="a new device needs a UUID no device uses; nothing was changed")
        for gr in granted:
            a = adm.allocation(gr.device, me, gr.decision.gpu or "", gr.demand, gr.decision)
            store.put_allocation(conn, (a.device, a.owner, a.tenant, a.gpu, a.kind, a.profile, a.framebuffer_mib,
                                        a.mig_slices, a.qos, int(a.burst)))
            rows[gr.device] = store.audit(actor=who, operation=f"admission {view.name or me} {gr.device}",
                                          path="(admission)", value=gr.decision.one_line() + (
                                              f"; {bound}" if bound else ""), result="admitted", conn=conn)
    return rows


def _held_by(store: StateStore, owner: str) -> set:
    """The devices (vGPU ids, passthrough GPUs) ``owner`` holds by the records now."""
    return {r.id for r in store.vgpu_records(owner=owner)} | \
        {r.gpu for r in store.passthrough_records() if r.owner == owner}


def void_admitted(store: StateStore, owner: str, rows: Mapping[str, int], error: BaseException,
                  before: "frozenset" = frozenset()) -> None:
    """A start admitted as ``rows`` (:func:`record_admitted`) failed and its devices were undone: in one
    transaction, drop the allocation rows of the devices ``owner`` no longer holds, or held before the
    start (``before``: made for it in advance, left as they were, unadmitted), and give each admission
    row its outcome (``refused`` for a refusal, else ``failed``; the line says why).  Only rows ``owner``
    holds are dropped: another owner's allocation of the same device is never touched."""
    from ..model.errors import VgpuhostError
    held = _held_by(store, owner)
    gone = [d for d in rows if d not in held or d in before]
    result = "refused" if isinstance(error, RefusedError) else "failed"
    why = error.message if isinstance(error, VgpuhostError) else (type(error).__name__ + (f": {error}" if str(error)
                                                                                          else ""))
    with store.transaction() as conn:
        store.delete_allocations(conn, devices=gone, of_owner=owner)
        for device, row in rows.items():
            left = "" if device in gone else " (the device is still held: the undo failed)"
            store.audit_outcome(row, detail=f" -> not made, the start {result}: {why[:300]}{left}", result=result,
                                conn=conn)


class _Enforced(Admitting):
    """:class:`Admitting` under tenancy: a refusal of the device layer's re-check is said in admission's terms."""

    def __init__(self, granted: List[Granted], store: StateStore, inv: Inventory):
        super().__init__(granted)
        self.store, self.inv = store, inv

    def refused(self, device: str, error):
        g = self.granted.get(device)
        if g is None or not g.decision.gpu or not isinstance(error, RefusedError):
            return error
        d = g.decision
        t = tenant_named_in(self.store, d.tenant)
        who = adm.standing(t, d.tenant, allocations(self.store))
        return RefusedError(f"admission: {g.demand.text()} of {who} was admitted onto GPU {d.gpu}, but the "
                            f"GPU no longer takes it: {error.message}",
                            hint="the GPU changed outside admission (a vGPU made by hand, 'vgpu create', or a "
                                 "layout: 'vgpuhost vgpu list'); start the domain again to be admitted anew, "
                                 "or remove what took the room; nothing was changed")


def tenant_named_in(store: StateStore, name: Optional[str]) -> Optional[Tenant]:
    """Tenant ``name`` as stored (names match in any case), None for none or an unknown one."""
    return adm.tenant_named(tenants(store), name) if name else None


class _AdmittingBlock:
    """:func:`admitting`'s context manager (a class: the hook's path imports no contextlib)."""

    def __init__(self, store: StateStore, view: DomainView, inv: Inventory, actor: Optional[str],
                 allowed: Optional[frozenset], types: Optional[Mapping[str, str]],
                 limits_for: "Optional[Callable[[str], Mapping]]" = None, policies=None, binding=None):
        self.store, self.view, self.inv, self.actor, self.allowed = store, view, inv, actor, allowed
        self.types, self.limits_for, self.policies, self.binding = types, limits_for, policies, binding
        self.granted: Optional[List[Granted]] = None
        self.box: Optional[Admitting] = None
        self.rows: Dict[str, int] = {}
        self.before: frozenset = frozenset()

    def __enter__(self) -> Admitting:
        store, view = self.store, self.view
        meta = view.metadata
        if meta is None or meta.empty:
            return Admitting([])
        if not active(store):
            self.granted = _unenforced(store, view, self.inv, self.types)
            self.box = Admitting(self.granted)
            return self.box
        # a start of this domain killed before it made every device it was admitted for (retried with no
        # reconcile between): those allocations go first, so the devices are admitted anew, once each
        from .recover import settle_allocations
        settle_allocations(store, actor=self.actor or _actor(), owner=view.uuid, locked=True)
        tr = trust(store, view, binding=self.binding)
        self.granted = admit_domain(store, view, self.inv, actor=self.actor, allowed=self.allowed,
                                    types=self.types, limits_for=self.limits_for, policies=self.policies,
                                    trusted=tr)
        self.before = frozenset(_held_by(store, view.uuid))
        self.rows = record_admitted(store, view, self.granted, actor=self.actor, bound=tr.text)
        self.box = _Enforced(self.granted, store, self.inv)
        return self.box

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.granted is None:
            return False
        if exc_type is None:
            record_allocations(self.store, self.view.uuid, self.granted, self.box.gpus, self.box.renamed)
        elif self.rows:
            try:
                void_admitted(self.store, self.view.uuid, self.rows, exc, self.before)
            except Exception:
                pass    # the start's own error is the one to report; 'vgpuhost reconcile' drops the rows left
        return False


def forget(store: StateStore, owner: Optional[str] = None, devices: Sequence[str] = ()) -> int:
    """Drop allocation rows of ``owner`` (its ``release end``) or of ``devices``; rows dropped."""
    return store.forget_allocations(owner=owner, devices=devices)


# ---------------------------------------------------------------------------
# reports

def usage_report(store: StateStore, inv: Optional[Inventory] = None) -> List[dict]:
    """Per tenant, then one entry with ``"tenant": None`` for devices with no tenant (manual and layout
    vGPUs, domains naming none) when there are any: each dimension's use, burst part and limits, and
    ``domains``, how many libvirt domains hold them (owners ``manual`` and ``layout`` are not domains);
    ``at_risk``: its guarantee cannot be served beside the others' now (:func:`guarantees_at_risk`, with
    ``inv`` only) and ``risk``, its unused guarantee as text then (else None)."""
    held = allocations(store, inv)
    ts = tenants(store)
    risk = guarantees_at_risk(store, inv) if inv is not None and ts else None
    risky = {n.lower() for n in (risk or {}).get("tenants", ())}
    out = []
    names = sorted(ts) + sorted({a.tenant for a in held if a.tenant and a.tenant not in ts})
    for n in names + [None]:
        t = ts.get(n) if n else None
        u = adm.usage(n, held, t.quota if t else None)
        if n is None and not any(a.tenant is None for a in held):
            continue
        dims = {}
        for d in DIMENSIONS:
            total, burst = u[d]
            dims[d] = {"used": total, "burst": burst,
                       "guaranteed": t.quota.guaranteed.get(d) if t else None,
                       "limit": t.quota.ceiling(d) if t else None}
        out.append({"tenant": n, "known": t is not None, "qos": t.qos if t else None,
                    "isolation": t.isolation if t else None,
                    "domains": len({a.owner for a in held if a.tenant == n and Owner.is_domain(a.owner)}),
                    "usage": dims, "at_risk": bool(n and n.lower() in risky),
                    "risk": (risk or {}).get("reasons", {}).get(n) if n else None})
    return out


def scheduler_policies(host, gpus: Sequence[str]) -> Dict[str, str]:
    """``{BDF: the vGPU scheduler policy the GPU runs now}`` (``best-effort`` / ``equal-share`` /
    ``fixed-share``), one NVML read per GPU of ``gpus`` (BDF strings); a GPU NVML cannot answer for
    (MIG mode, no vGPU manager, an unknown policy) is left out, and the whole mapping is empty when NVML
    cannot be had: admission then does not check the policy there."""
    from ..io.backends import open_backend
    from ..model.errors import VgpuhostError
    from ..model.kinds import SchedulerPolicy
    from ..model.values import PciAddress
    try:
        backend = open_backend(host)
    except (VgpuhostError, OSError, ImportError):
        return {}
    out: Dict[str, str] = {}
    for g in gpus:
        try:
            policy = str(backend.scheduler_state(PciAddress.parse(g)).policy)
        except (VgpuhostError, OSError, ValueError):
            continue
        if policy in SchedulerPolicy.ALL:
            out[g] = policy
    return out


def mixed_size_of(host, inv: Inventory) -> Dict[object, bool]:
    """``{gpu: mixed-size (heterogeneous) mode on}`` for the vGPU-capable GPUs NVML answers for
    (``heterogeneous_mode``; docs/reference/hardware.md#vgpu-types); empty when NVML cannot be had:
    callers then count equal-size maxima, as before."""
    from ..io.backends import open_backend
    from ..model.errors import VgpuhostError
    try:
        backend = open_backend(host)
    except (VgpuhostError, OSError, ImportError):
        return {}
    out: Dict[object, bool] = {}
    for g in inv.gpus:
        if g.vgpu_backend and g.pci.driver == "nvidia":
            try:
                out[g.address] = bool(backend.heterogeneous_mode(g.address))
            except (VgpuhostError, OSError):
                continue
    return out


def exclusive_holders(tenants_: Mapping[str, Tenant], held: Sequence[adm.Allocation]) -> Dict[str, str]:
    """``{GPU BDF: tenant}`` for the GPUs holding time-sliced vGPUs of an exclusive tenant: no other
    tenant's vGPU (nor a domain with no tenant) may join them (docs/guide/tenancy.md, "QoS classes and isolation")."""
    out: Dict[str, str] = {}
    for a in held:
        if a.kind != adm.VGPU or a.mig_slices or not a.tenant:
            continue
        t = adm.tenant_named(tenants_, a.tenant)
        if t is not None and t.isolation == EXCLUSIVE:
            out.setdefault(a.gpu, t.name)
    return out


def admissible(req: adm.AdmissionRequest, *, tenants_: Mapping[str, Tenant], held: Sequence[adm.Allocation],
               offers: Sequence, limit: Optional[int] = None, **facts) -> Tuple[int, Dict[str, int], adm.Admission]:
    """How many devices like ``req`` admission would admit now, one after another, asking
    :func:`vgpuhost.policy.admission.admit` itself (dry: nothing recorded, no audit row): each admitted
    one is added to the allocations and takes one instance off its GPU's offer, until admission refuses
    (or ``limit`` are admitted).  ``facts``: admit's other keywords (pools, gpu_memory, gpu_slices,
    names, policies).  Returns ``(n, {GPU BDF: n placed there}, the last decision: the refusal saying
    why not one more, or the last admission when ``limit`` stopped it)``."""
    held = list(held)
    offers = list(offers)
    by: Dict[str, int] = {}
    n = 0
    while True:
        owner = f"(capacity {n})"
        d = adm.admit(replace(req, owner=owner), tenants=tenants_, allocations=held, offers=offers, **facts)
        if not d.admitted:
            return n, by, d
        n += 1
        g = d.gpu or ""
        by[g] = by.get(g, 0) + 1
        held.append(adm.allocation(owner, owner, g, req.demand, d))
        offers = [replace(o, available=o.available - 1, present=o.present + 1) if str(o.gpu) == g else o
                  for o in offers]
        if limit is not None and n >= limit:
            return n, by, d


def admissible_after(store: StateStore, inv: Inventory, changes: Mapping[str, Optional[str]], tenant: Optional[str],
                     profile: str, gpu: str, n: int, *,
                     policies: "Optional[Callable[[Sequence[str]], Mapping[str, str]]]" = None) -> Tuple[int, str]:
    """How many ``profile`` vGPUs admission would admit on ``gpu`` (BDF) for a domain of ``tenant`` (None:
    a domain naming no tenant) once ``changes`` are made, at most ``n`` (what the freed framebuffer
    holds): ``(count, admission's reason for one more, '' when all n)``.  ``changes``: ``{device: the
    vGPU type it is resized to, or None: given back}``, as ``advise`` proposes.  Asks
    :func:`vgpuhost.policy.admission.admit` itself (:func:`admissible`): quota, isolation, QoS class,
    pools, reserves, with the GPU offering ``n`` instances (a tenant not known: refused, 0).  Other incoming
    live migrations' reservations count as their tenants' vGPUs (:func:`reserved_allocations`)."""
    from ..model.values import PciAddress
    from ..policy import offers as vgpu_offers
    from ..policy.placement import GpuOffer
    ts = tenants(store)
    fbs = _type_fb(inv, store)
    held = []
    for a in allocations(store, inv):
        if a.device in changes:
            to = changes[a.device]
            if to is None:
                continue
            d = adm.vgpu_demand(to, fbs.get(to.lower()))
            a = replace(a, profile=to, framebuffer_mib=d.framebuffer_mib, mig_slices=d.mig_slices)
        held.append(a)
    # incoming migrations' live reservations are as good as in use, as for every admission (admit_domain)
    held += reserved_allocations(store, "(advise)", held, ts, fbs)
    records = store.vgpu_records()
    seen = store.seen_types() + vgpu_offers.seen_rows(inv)
    offer = next((o for o in vgpu_offers.offers(inv, records, profile, seen) if str(o.gpu) == gpu), None)
    addr = PciAddress.parse(gpu)
    if offer is None:
        g = inv.gpu(addr)
        offer = GpuOffer(addr, g.pci.numa_node if g is not None else 0, profile, profile, n, (addr,))
    offer = replace(offer, type_id=offer.type_id or profile, type_name=offer.type_name or profile, available=n,
                    parents=offer.parents or (addr,), note="")
    facts = admit_facts(store, inv, seen, fbs)
    pooled = sorted({g for p in facts["pools"] if p.policy for g in p.gpus} & {gpu})
    got, _, last = admissible(adm.AdmissionRequest("(advise)", adm.vgpu_demand(profile, fbs.get(profile.lower())),
                                                   tenant, gpu=gpu),
                              tenants_=ts, held=held, offers=[offer], limit=n,
                              policies=policies(pooled) if policies is not None and pooled else None, **facts)
    return got, ("" if last.admitted else last.reason)


def capacity(store: StateStore, inv: Inventory, mixed_size: "Optional[Mapping[object, bool]]" = None, *,
             tenant: Optional[str] = None,
             policies: "Optional[Callable[[Sequence[str]], Mapping[str, str]]]" = None, per_gpu: bool = True,
             untenanted: bool = False, limits_for: "Optional[Callable[[str], Mapping]]" = None) -> dict:
    """What more fits now, per profile, pool and GPU, and where fragmentation blocks a profile.

    ``limits_for``: a type name -> ``{gpu: its max in the GPU's vGPU mode}``
    (:func:`vgpuhost.ops.vgpu.limits_lookup`: on a vendor-VFIO GPU in mixed-size mode, what still fits at
    free placement ids), used instead of ``mixed_size``'s maxima where given.

    Per vGPU type name: instances free per GPU (as placement counts them),
    the GPU's pool, the total; and, for time-sliced types, how many the
    free framebuffer summed over GPUs would allow, so ``blocked`` says how
    many fragmentation (free framebuffer spread over GPUs, or a GPU held in
    equal-size mode by another size) keeps out.  ``mixed_size``
    (:func:`mixed_size_of`): GPU -> mixed-size mode; a GPU in it counts the
    type's mixed-size max, often lower (docs/reference/hardware.md#vgpu-types).

    A GPU holding time-sliced vGPUs of an exclusive tenant is marked
    (``"exclusive": tenant``) and counts no free instance (no one else may
    join it); so does a pooled GPU in drift (``"drift"``: why, when
    ``policies`` is given: its running scheduler policy is not its pool's).  With ``tenant`` (a tenant's name; InputError naming the known
    tenants for an unknown one) each count is admission's answer for a
    domain of that tenant (:func:`admissible`): ``by_gpu`` what it could
    start on each GPU, ``fits`` how many it could start in all (quota,
    isolation, QoS class, pools, reserves and placement together), and
    ``why_not`` admission's reason for one more.  ``policies``: as
    :func:`admit_domain`'s (the scheduler policy each pooled GPU runs; a GPU
    in drift admits nothing); ``per_gpu`` False (the exporter, which needs
    ``fits`` only): ``by_gpu`` is where the ``fits`` would go one after
    another, not what each GPU alone could take (half the admission calls);
    ``untenanted`` (no ``tenant``): admission's answer for a domain naming
    no tenant (best-effort, no quota), as with a tenant.  Without either,
    where admission applies (a pool or a tenant recorded), each GPU's count
    is also capped by GPU time as admission caps it (:func:`time_fits`: the
    profile's expected share under the GPU's pool ceiling), so a host whose
    ceilings refuse every start (``gpu-time``) shows 0, not the framebuffer's
    room; ``framebuffer_would_allow`` is capped alike (GPU time is not
    fragmentation).

    GPU time: each GPU also carries ``gpu_time_expected`` (the expected
    GPU-time demand of its time-sliced vGPUs, from the metered history:
    :mod:`vgpuhost.ops.gputime`), ``compute_ceiling`` (its pool's) and
    ``starved_demand`` (expected demand above the ceiling), all shares of one
    GPU; ``starved_demand`` at the top sums them (``total``, ``share`` of the
    GPUs listed, ``by_pool``).
    """
    from ..policy import offers as vgpu_offers
    from ..policy.capacity import summarise
    from ..policy.config import mode_limits
    records = store.vgpu_records()
    seen = store.seen_types() + vgpu_offers.seen_rows(inv)
    hist = gputime.history(store)
    held = gputime.with_use(hist, allocations(store, inv))
    pl = pools(store)
    ts = tenants(store)
    me = get(store, tenant) if tenant is not None else None
    excl = exclusive_holders(ts, held)
    pooled = sorted({g for p in pl if p.policy for g in p.gpus})
    running = policies(pooled) if policies is not None and pooled else None
    drift = {g: adm.drift_note(adm.pool_of(pl, g), g, running) for g in pooled}
    used: Dict[str, int] = {}
    for a in held:
        if a.kind == adm.VGPU and not a.mig_slices:
            used[a.gpu] = used.get(a.gpu, 0) + a.framebuffer_mib
    pt = {a.gpu for a in held if a.kind == adm.PASSTHROUGH}
    gpus = []
    for g in inv.gpus:
        if not g.vgpu_backend:
            continue
        addr = str(g.address)
        mem = g.framebuffer_mib
        gpus.append({"gpu": addr, "pool": adm.pool_of(pl, addr).name,
                     "framebuffer_mib": mem, "unreadable": [str(u.device) for u in g.unreadable],
                     "free_mib": 0 if addr in pt or g.pci.driver != "nvidia" or g.address in inv.out_of_service else
                     (max(0, mem - used.get(addr, 0)) if mem else None),
                     "exclusive": excl.get(addr), "drift": drift.get(addr) or None,
                     # issue 27: unhealthy or cordoned: nothing free there (no fragmentation counted)
                     "out_of_service": inv.out_of_service.get(g.address)})
    timing = gputime.gpu_figures(held, pl, {g["gpu"]: g["framebuffer_mib"] or 0 for g in gpus})
    for g in gpus:
        g.update(timing[g["gpu"]])
    mem_of = {g["gpu"]: g["framebuffer_mib"] or 0 for g in gpus}
    timed = not (me is not None or untenanted) and bool(pl or ts)      # admission applies: GPU time caps
    closed = {g for g, t in excl.items() if me is None or t.lower() != me.name.lower()}
    closed |= {g for g, why in drift.items() if why}
    ask = me is not None or untenanted
    facts: Dict[str, object] = {}
    fbs = _type_fb(inv, store)
    asked_held = held
    if ask:
        facts = dict(admit_facts(store, inv, seen, fbs), policies=running)
        # admission counts other incoming migrations' live reservations as their tenants' (admit_domain)
        asked_held = held + reserved_allocations(store, "(capacity)", held, ts, fbs)
    present: Dict[str, int] = {}
    for r in records:
        present[r.gpu] = present.get(r.gpu, 0) + 1
    max_of: Dict[str, int] = {}
    for t in inv.vgpu_types:
        if t.max_instances:
            max_of.setdefault(t.name.lower(), t.max_instances)
    per_type = []
    admitted: Dict[str, Tuple[int, str, str]] = {}
    index = vgpu_offers.OfferIndex(inv, records, seen)        # once for every profile, not once each
    modes = getattr(limits_for, "modes", None) or (lambda: mixed_size or {})     # the GPUs' modes, as NVML says
    for name in sorted({t.name for t in inv.vgpu_types} | {row[2] for row in seen}):
        limits = (dict(limits_for(name)) if limits_for is not None else
                  mode_limits(inv, name, mixed_size) if mixed_size else {})
        offers = vgpu_offers.offers(inv, records, name, seen, limits, index=index, modes=modes)
        if all(o.type_id is None for o in offers):
            continue
        dem = gputime.demand_with_use(hist, adm.vgpu_demand(name, fbs.get(name.lower())), "(capacity)",
                                      me.name if me is not None else None)
        rows = []
        for o in offers:
            if o.type_id is None:
                continue
            g = inv.gpu(o.gpu)
            if g is not None and g.vfs and g.vgpu_backend != Backend.MDEV:     # vendor VFIO: one vGPU per free VF
                cap: Optional[int] = len(g.vfs) - sum(1 for v in inv.vf_vgpus if v.gpu == o.gpu and v.type_id)
            else:
                m = max_of.get(name.lower())
                cap = None if m is None else max(0, m - present.get(str(o.gpu), 0))
            if o.gpu in limits:         # the type's max in the GPU's mode (mixed-size: often lower)
                # a missing record counts against its mode's max; in mixed-size mode the limit holds its
                # placement id already (ops.vgpu.limits_lookup): only the vGPUs present count then
                ix = inv.on_gpu(o.gpu) if (mixed_size or {}).get(o.gpu) else None
                here = frozenset(ix.vgpus) if ix is not None else None
                same = sum(1 for r in records if r.gpu == str(o.gpu) and r.type_name.lower() == name.lower()
                           and (here is None or r.id in here))
                left = max(0, limits[o.gpu] - same)
                cap = left if cap is None else min(cap, left)
            free = 0 if str(o.gpu) in closed and not dem.mig_backed else o.available
            if timed:
                by_time = _time_count(dem, timing.get(str(o.gpu)), mem_of.get(str(o.gpu)),
                                      adm.pool_of(pl, str(o.gpu)).policy)
                if by_time is not None:
                    free = min(free, by_time)
                    cap = by_time if cap is None else min(cap, by_time)
            rows.append((str(o.gpu), free, cap))
        if ask:
            lent = _lent(offers, records, name)
            req = adm.AdmissionRequest("(capacity)", dem, me.name if me is not None else None)
            n, placed, last = admissible(req, tenants_=ts, held=asked_held, offers=lent, **facts)
            alone = dict(placed)
            for o in lent if per_gpu else ():
                if o.type_id is not None:
                    alone[str(o.gpu)] = admissible(replace(req, gpu=str(o.gpu)), tenants_=ts, held=asked_held,
                                                   offers=lent, limit=max(0, o.available), **facts)[0] \
                        if o.available > 0 else 0
            rows = [(g, alone.get(g, 0), cap) for g, _, cap in rows]
            admitted[name] = (n, "" if last.admitted else last.reason, "ok" if last.admitted else last.code)
        per_type.append((name, dem.framebuffer_mib, dem.mig_backed, rows))
    doc = summarise(gpus, per_type, admitted if ask else None)
    doc["tenant"] = me.name if me is not None else None
    doc["starved_demand"] = gputime.starved_summary(timing, pl)
    return doc


def _time_count(dem, figures: Optional[dict], gpu_memory_mib: Optional[int], policy: str) -> Optional[int]:
    """How many more vGPUs of demand ``dem`` fit by GPU time on a GPU with ``figures``
    (:func:`vgpuhost.ops.gputime.gpu_figures`: expected demand, ceiling), each expecting its share as
    admission counts it (:func:`vgpuhost.policy.compute.expected`: its metered use, else the profile's
    fixed share); None: GPU time does not bound it (a hardware partition, a share not known)."""
    from ..policy import compute
    if figures is None or not compute.sliced(dem):
        return None
    share = compute.expected(dem, gpu_memory_mib, policy or "").share
    if share <= 0:
        return None
    left = figures["compute_ceiling"] - figures["gpu_time_expected"]
    return max(0, int((left + compute.EPSILON) / share))


def time_fits(store: StateStore, inv: "Inventory"):
    """Where admission applies (a pool or a tenant recorded): ``fits(gpu, profile, framebuffer_mib) -> n``,
    how many more vGPUs of ``profile`` GPU time lets a domain naming no tenant start on ``gpu`` (BDF text)
    under its pool's compute ceiling (None: not bounded by GPU time); None where admission does not apply
    (the device layer places by framebuffer alone).  What the exporter's ``vgpuhost_free_instances`` and
    ``capacity`` without ``--tenant`` count."""
    pl = pools(store)
    if not pl and not store.tenant_rows():
        return None
    hist = gputime.history(store)
    held = gputime.with_use(hist, allocations(store, inv))
    mem = {str(g.address): g.framebuffer_mib or 0 for g in inv.gpus if g.vgpu_backend}
    timing = gputime.gpu_figures(held, pl, mem)

    def fits(gpu: str, profile: str, framebuffer_mib: Optional[int]) -> Optional[int]:
        dem = gputime.demand_with_use(hist, adm.vgpu_demand(profile, framebuffer_mib), "(capacity)", None)
        return _time_count(dem, timing.get(gpu), mem.get(gpu), adm.pool_of(pl, gpu).policy)
    return fits


# ---------------------------------------------------------------------------
# a domain's tenant, for callers scoped to one (the agent's tenant role)

def domain_tenant(store: StateStore, uuid: str) -> Optional[str]:
    """The tenant domain ``uuid`` belongs to: the operator's binding (the state store's ``bindings``), else
    the tenant its admitted allocations were recorded for; None for a domain of no tenant (or one vgpuhost
    does not know).  The domain's XML is never asked: a caller scoped to a tenant must not be able to claim
    a domain by what its XML says."""
    row = store.binding(uuid.lower())
    if row is not None:
        return row[1]
    for row in store.allocation_rows(owner=uuid):
        if row[2]:
            return row[2]
    return None


def tenant_domains(store: StateStore, tenant: str) -> "Dict[str, str]":
    """``{domain UUID: its tenant as recorded}`` for the domains vgpuhost knows (running, holding a device,
    or with allocations) whose :func:`domain_tenant` is ``tenant`` (names match in any case)."""
    known = set(store.active_domains())
    known |= {r.owner for r in store.vgpu_records()}
    known |= {r.owner for r in store.passthrough_records() if r.owner}
    known |= {row[1] for row in store.allocation_rows()}
    known |= {row[0] for row in store.binding_rows()}          # bound, idle or not yet started
    out: Dict[str, str] = {}
    for uuid in sorted(o for o in known if Owner.is_domain(o)):
        t = domain_tenant(store, uuid)
        if t and t.lower() == tenant.lower():
            out[uuid] = t
    return out
