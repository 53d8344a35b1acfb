"""Live migration of a domain with vGPUs: the source's request, the destination's check, the hook's rewrite.

Owns: :func:`request_for` (what the source sends: the domain's devices as it holds them, its
binding, the vGPU manager version), :func:`check_incoming` (the destination's answer: can it take
the domain, and why not; read-only on both hosts), :func:`check` (both sides, the destination a
host root directory), and :func:`incoming` (the qemu hook's ``migrate begin`` on the destination:
a free device chosen by the domain's placement rules, host-specific pins rewritten, the device
reserved in the state store for ``prepare begin`` to make).  :func:`sweep` frees reservations that
expired (``vgpuhost reconcile``).  Decisions are :mod:`vgpuhost.policy.migration`'s.  Must not: call
libvirt from :func:`incoming` (it runs inside libvirtd's incoming migration, docs/reference/libvirt.md);
import anything heavy at module level (the hook imports it for ``migrate begin``).

The split: the destination's side takes a request document (:data:`~vgpuhost.policy.migration.REQUEST_SCHEMA`,
``vgpuhost migrate request DOMAIN``) and answers a check document, so the two can run on two hosts
(``vgpuhost migrate request vm | ssh dest vgpuhost migrate check --incoming``); ``migrate check
--to DIR`` runs both here for a destination that is a host root (the simulator).

libvirt facts (docs/reference/libvirt.md#hooks): on the destination, libvirt runs ``qemu NAME
migrate begin -`` with the incoming domain XML on stdin; the hook may print a rewritten XML on
stdout (empty: unchanged), and a failure or an invalid XML cancels the incoming migration.  Then
``prepare begin``, ``start begin`` and ``started begin`` run as for a start; a migration that fails
or is cancelled after that runs ``release end`` on the destination; a successful one runs
``release end`` on the source.
"""

from __future__ import annotations

from ..io.hostroot import HostRoot
from ..model.concepts import DeviceKind
from ..model.errors import InputError, RefusedError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Tuple
    from ..io.state import StateStore
    from ..libvirt.domxml import DomainView
    from ..observe.inventory import Inventory
    from ..policy.migration import Refusal, Request

#: how long a reservation made by ``migrate begin`` holds its device when no ``prepare begin`` or
#: ``release end`` follows (libvirt runs ``prepare begin`` right after ``migrate begin``, before QEMU
#: starts and before any memory is copied); ``vgpuhost reconcile`` frees an expired one
RESERVATION_TTL_S = 300


def manager_version(host: HostRoot) -> "Optional[str]":
    """The vGPU manager's version on ``host``: ``sys/module/nvidia/version`` (the nvidia module's
    ``MODULE_VERSION``, e.g. ``580.65.05``), None when unreadable."""
    from ..io.sysfs import Sysfs
    from ..io.vgpudev import manager_version as read_version
    return read_version(Sysfs(host))


def request_for(host: HostRoot, store: "StateStore", view: "DomainView") -> "Request":
    """The request for ``view``'s domain as this host sees it: each device its metadata declares (a
    vGPU's type as this host's records name it when the domain holds it), the domain's binding here
    (tenant, QoS class) and this host's vGPU manager version.  On the source it is what a destination
    is sent; on the destination :func:`incoming` builds it from the incoming XML.  Raises InputError
    for a domain without vgpuhost devices."""
    from ..policy.migration import Device, Request
    meta = view.metadata
    if meta is None or meta.empty:
        raise InputError(f"domain {view.name or view.uuid} declares no vgpuhost device: nothing to check",
                         hint="'vgpuhost attach' declares its vGPUs; a domain without them migrates as any other")
    held = {r.id: r for r in store.vgpu_records(owner=view.uuid)}
    devices = []
    for v in meta.vgpus:
        rec = held.get(v.device)
        devices.append(Device("mdev" if v.uuid else "vf", v.device, rec.type_name if rec else str(v.profile),
                              rec.gpu if rec else (str(v.gpu) if v.gpu else "")))
    for g in meta.passthrough:
        devices.append(Device("passthrough", str(g), "", str(g)))
    row = store.binding(view.uuid) if not store.absent else None
    return Request(view.name or view.uuid, view.uuid, meta.strategy, meta.anti_affinity,
                   row[1] if row else None, row[2] if row else None, manager_version(host), tuple(devices))


def _facts(host: HostRoot, store: "StateStore", owner: str) -> "Tuple[Inventory, list, list]":
    """The destination's inventory (GPUs out of service offer nothing, VFs other incoming migrations than
    ``owner``'s reserved are taken), records and seen types."""
    from ..io.sysfs import Sysfs
    from ..observe.inventory import discover
    from ..policy.offers import seen_rows
    from .health import in_service
    inv = in_service(discover(Sysfs(host)), None if store.absent else store, owner=owner)
    if not store.absent:
        # MIG on demand: the GPU instances a start would make count, as capacity and types count them
        from .migdemand import makeable
        inv = makeable(host, store, inv)
    return inv, store.vgpu_records(), store.seen_types() + seen_rows(inv)


def _placements(host: HostRoot, store: "StateStore", req: "Request", inv: "Inventory", records: list, seen: list,
                keep: "Dict[str, object]", inputs: dict, admitted: "object" = None
                ) -> "Tuple[List[dict], List[Refusal]]":
    """Where the destination makes each of ``req``'s vGPUs (``{device, kind, profile, gpu, parent}`` each),
    and the refusals.  ``keep``: device -> the VF or GPU the incoming XML names, kept when still free.
    ``inputs``: :func:`vgpuhost.ops.devices.admission_inputs`: the GPUs the hook allow-list leaves out
    offer nothing (a pin to one is moved, as a pin to an absent GPU is) and each GPU offers at most its
    mode's max (mixed-size), as ``prepare begin`` places; a refusal the allow-list narrowed names it as
    ``prepare begin``'s does.  ``admitted``: :func:`_vf_admission`'s answer (None: not narrowed): a VF is
    chosen only on a GPU admission accepts for it (:meth:`vgpuhost.ops.admitting.Admitting.allowed_gpus`,
    as ``prepare begin`` narrows an unpinned vGPU's placement), the XML's VF kept only there."""
    from dataclasses import replace
    from ..model.values import PciAddress
    from ..policy import migration as mig
    from ..policy.offers import allowed_only, offers, resolve_profile
    from .devices import ALLOW_LIST, placed_only_on
    allowed, limits_for = inputs["allowed"], inputs["limits_for"]
    from ..policy.placement import Request as Placing
    where = f"destination {host.s.root}"
    from ..io.state import utcnow
    now = utcnow()          # an expired reservation holds nothing (reconcile deletes it)
    others = [r for r in store.reservation_rows() if r[1] != req.uuid and r[6] >= now] if not store.absent else []
    reserved = frozenset(r[0] for r in others)
    # mdevs other incoming migrations reserved and prepare begin has not made yet: (GPU, type) -> how many
    pending: "Dict[Tuple[str, str], int]" = {}
    for r in others:
        if r[4] == DeviceKind.MDEV:
            pending[(r[3], r[5].lower())] = pending.get((r[3], r[5].lower()), 0) + 1
    reserved_here: "Dict[Tuple[PciAddress, str], int]" = {}       # (GPU, type id) -> VFs reserved by others
    vf_gpu = {v.vf: v.gpu for v in inv.vf_vgpus}
    for vf, tid in inv.reserved.items():
        if vf in vf_gpu:
            reserved_here[(vf_gpu[vf], tid)] = reserved_here.get((vf_gpu[vf], tid), 0) + 1
    taken: "Dict[PciAddress, PciAddress]" = {}      # GPU -> what this domain takes there (one vGPU per VM per GPU)
    used_parents: set = set()
    out: "List[dict]" = []
    refusals: "List[Refusal]" = []
    for d in req.devices:
        if d.kind == DeviceKind.PASSTHROUGH:
            refusals.append(mig.passthrough_refusal(d))
            continue
        try:
            name = resolve_profile(inv, records, d.profile, None, seen)
        except InputError as e:
            refusals.append(mig.type_refusal(d, where, e.message.replace("unknown vGPU profile", "no GPU offers")
                                             .split(" on ")[0], known=False))
            continue
        offered = []
        for o in allowed_only(offers(inv, records, name, seen, limits_for(name)), allowed):
            if o.gpu in inv.out_of_service:
                o = replace(o, available=0, parents=(), note=f"out of service: {inv.out_of_service[o.gpu]}")
            if o.gpu in taken:
                o = replace(o, owners=o.owners | {req.uuid})
            held = pending.get((str(o.gpu), name.lower()), 0)
            if held and o.available > 0:
                o = replace(o, available=max(0, o.available - held),
                            note=f"{held} {name} reserved for other incoming migrations")
            vfs_held = reserved_here.get((o.gpu, o.type_id), 0) if o.type_id else 0
            if vfs_held and o.available == 0:
                # a VF other incoming migrations reserved counts as taken (ops/health.in_service): say so
                o = replace(o, note=f"{vfs_held} {name} reserved for other incoming migrations")
            parents = tuple(p for p in o.parents if p not in used_parents)
            if o.parents and d.kind == "vf":
                o = replace(o, parents=parents, available=min(o.available, len(parents)))
            offered.append(o)
        only = admitted.allowed_gpus(d.device, allowed) if admitted is not None and d.kind == "vf" else allowed
        if only is not allowed:
            offered = [o if o.gpu in only else replace(o, available=0, parents=(), note=NOT_ADMITTED)
                       for o in offered]
        placing = Placing(name, req.uuid, req.strategy, None, req.anti_affinity, None)
        k = keep.get(d.device)
        gpu, parent = mig.choose_device(offered, placing, keep=k if isinstance(k, PciAddress) else None,
                                        reserved=reserved)
        if gpu is None:
            r = mig.type_refusal(d, where, str(parent))
            refusals.append(r if only is None else
                            replace(r, fix=placed_only_on(only, admitted.narrowed_by(d.device, allowed)
                                                          if only is not allowed else ALLOW_LIST)))
            continue
        taken[gpu] = parent
        if d.kind == "vf":
            used_parents.add(parent)
        out.append({"device": d.device, "kind": d.kind, "profile": name, "gpu": str(gpu),
                    "parent": str(parent) if parent is not None else None})
    return out, refusals


#: the note on a GPU admission does not accept for an incoming VF (isolation, pool), as placement lists it
NOT_ADMITTED = "not admitted for the domain's tenant there (isolation or pool)"


def _vf_admission(store: "StateStore", view: "DomainView", inv: "Inventory", inputs: dict,
                  trusted: "object") -> "object":
    """Where admission accepts each vGPU on a VF of ``view``'s incoming domain, asked as if unplaced:
    :func:`vgpuhost.ops.tenancy.admit_domain` (read-only, ``trusted``: :func:`_claim_refusals`'s answer,
    ``inputs`` as :func:`vgpuhost.ops.devices.admission_inputs` gives them) of the same domain with each VF
    vGPU unpinned (the VF the XML names is a pin to its GPU; here the destination may move it), as an
    :class:`vgpuhost.ops.admitting.Admitting` whose :meth:`~vgpuhost.ops.admitting.Admitting.allowed_gpus`
    narrows the VF's placement to admission's candidates, as ``prepare begin`` narrows an unpinned vGPU's.
    None when the domain has no VF vGPU, tenancy is not in use (``trusted`` None) or admission refuses it
    anywhere (the admission of the XML as placed, :func:`_admission`, then says why)."""
    meta = view.metadata
    if trusted is None or not any(v.vf is not None for v in meta.vgpus):
        return None
    from ..libvirt.domxml import DomainView, Metadata, VgpuRequest
    from ..model.errors import VgpuhostError
    from . import tenancy
    asked = DomainView()
    asked.name, asked.uuid, asked.nova_project = view.name, view.uuid, view.nova_project
    asked.metadata = Metadata(meta.strategy, meta.tenant, meta.anti_affinity,
                              [VgpuRequest(v.profile, uuid=v.device) if v.vf is not None else v for v in meta.vgpus],
                              [], meta.qos)
    try:
        return tenancy.Admitting(tenancy.admit_domain(store, asked, inv, audit=False, trusted=trusted, **inputs))
    except VgpuhostError:
        return None


def _request_view(req: "Request") -> "DomainView":
    """``req``'s domain as a domain XML would declare it (no XML: ``migrate check --incoming``): its vGPUs
    as the request names them (an mdev by UUID, a VF by BDF), no tenant or class asked; a device whose
    profile is no vGPU type name is left out (placement refuses it)."""
    from ..libvirt.domxml import DomainView, Metadata, VgpuRequest
    from ..model.values import PciAddress
    view = DomainView()
    view.name, view.uuid = req.name, req.uuid
    vgpus = []
    for d in req.devices:
        if d.kind == DeviceKind.PASSTHROUGH:
            continue
        try:
            vgpus.append(VgpuRequest(d.profile, vf=PciAddress.parse(d.device)) if d.kind == "vf" else
                         VgpuRequest(d.profile, uuid=d.device))
        except InputError:
            continue
    view.metadata = Metadata(req.strategy, None, req.anti_affinity, vgpus, [], None)
    return view


def _trusted(store: "StateStore", req: "Request") -> "object":
    """:func:`vgpuhost.ops.tenancy.trust`'s answer for ``req``'s domain with the destination's own binding
    (``migrate check --incoming``: no XML, nothing asked), None when tenancy is not in use here."""
    from .admitting import active
    if store.absent or not active(store):
        return None
    from . import tenancy
    return tenancy.trust(store, _request_view(req))


def _admission(host: HostRoot, store: "StateStore", req: "Request", inv: "Inventory",
               placed: "List[dict]", inputs: dict, incoming: "Optional[DomainView]" = None,
               out: "Optional[list]" = None, trusted: "object" = None) -> "Tuple[List[Refusal], Dict[str, str]]":
    """Admission on the destination, read-only (``admit_domain`` with ``audit`` off: no row, no
    allocation), as the destination's ``prepare begin`` will decide it: with the destination's own
    binding of the domain, never the request's tenant or QoS class (the source's word, not trusted for
    tenancy: docs/guide/migration.md), and ``inputs`` (:func:`vgpuhost.ops.devices.admission_inputs`: the
    hook allow-list, mixed-size maxima, the scheduler policy each pooled GPU runs), as prepare begin passes
    them.  A domain the source says is bound (``req.tenant``) and the destination has not bound is refused
    with the command that binds it there (prepare begin would admit it as a domain without a tenant).
    Nothing when tenancy is not in use there.

    ``incoming``: the domain XML ``prepare begin`` will see (the hook's ``migrate begin``: the incoming XML
    with its devices as placed here), admitted as it is: its pins, its metadata's asks (``tenant=``,
    ``qos=``) and Nova's project weighed as prepare begin weighs them (:func:`vgpuhost.ops.tenancy.trust`:
    the XML may ask, never claim; a claim of another tenant or a stronger class is refused here; the
    tenant a refusal names is the trusted one, Nova's mapped project included).  None (``migrate check
    --incoming``): the request has no XML, its devices are admitted as placed (``placed``), and its tenant
    and class are the source's word, never weighed.  Devices other incoming migrations reserved here count
    as their tenants' (``admit_domain``: the tenant stored with each).  ``out``: where the trusted tenant and
    class (:func:`vgpuhost.ops.tenancy.trust`'s answer) are appended when admission was asked (tenancy in
    use), for the reservation to store.  ``trusted``: :func:`vgpuhost.ops.tenancy.trust`'s answer for
    ``incoming``, already asked (:func:`_claim_refusals`, before placement), instead of asking it again.

    Returns the refusals and ``{device: the GPU admission placed it on}`` (the view's device ids; empty
    when tenancy is not in use or it refused): ``prepare begin`` makes a vGPU where its admission places
    it, so the reservation and the check's answer name that GPU, not placement's first choice."""
    from ..policy import migration as mig
    from .admitting import active
    if store.absent or not active(store):
        return [], {}
    from . import tenancy
    row = store.binding(req.uuid)
    if row is None and req.tenant:
        qos = f" --qos {req.qos}" if req.qos else ""
        return [mig.Refusal(mig.ADMISSION, "", f"domain {req.name} is bound to tenant {req.tenant} on the source "
                                               "but not on this destination: its start here would be admitted "
                                               "as a domain without a tenant",
                            f"bind it on the destination first: 'vgpuhost tenant bind {req.uuid} {req.tenant}{qos}' "
                            "(the destination decides tenancy with its own binding)")], {}
    if incoming is not None:
        view = incoming
        # placed is in the metadata's vGPU order (request_for), the XML's devices as rewritten
        types = {v.device: p["profile"] for p, v in zip(placed, view.metadata.vgpus)}
    else:
        from ..libvirt.domxml import DomainView, Metadata, VgpuRequest
        from ..model.values import PciAddress
        view = DomainView()
        view.name, view.uuid = req.name, req.uuid
        vgpus = []
        for p in placed:
            if p["kind"] == "mdev":
                vgpus.append(VgpuRequest(p["profile"], uuid=p["device"]))
            else:
                vgpus.append(VgpuRequest(p["profile"], vf=PciAddress.parse(p["parent"])))
        view.metadata = Metadata(req.strategy, None, req.anti_affinity, vgpus, [], None)
        types = {p["device"]: p["profile"] for p in placed}
    tr = trusted if trusted is not None and incoming is not None else tenancy.trust(store, view, binding=row)
    if out is not None:
        out.append(tr)
    try:
        granted = tenancy.admit_domain(store, view, inv, audit=False, types=types, binding=row, trusted=tr,
                                       **inputs)
    except RefusedError as e:
        return [_admission_refusal(tr, e)], {}
    return [], {g.device: g.decision.gpu for g in granted if g.decision.gpu}


def _admission_refusal(tr, e: RefusedError) -> "Refusal":
    """Admission's refusal ``e`` of a domain trusted as ``tr`` as the destination says it: its line after
    the tenant it was decided for (:func:`_whose`), its hint as the fix."""
    from ..policy import migration as mig
    return mig.Refusal(mig.ADMISSION, "", f"{_whose(tr)}: {e.message}",
                       e.hint or "free room for the tenant there ('vgpuhost capacity --tenant')")


def _claim_refusals(store: "StateStore", view: "DomainView", out: list) -> "List[Refusal]":
    """The incoming XML's tenant and class claims weighed as ``prepare begin`` weighs them first
    (:func:`vgpuhost.ops.tenancy.trust`: the XML may ask, never claim; ``require-binding``; a Nova domain
    with no project), before placement: a forged ``tenant=`` is refused for the claim, as at prepare
    begin, whatever placement would say of the devices (final8 F2: a domain that holds a vGPU here was
    refused for "one vGPU per VM per GPU").  The answer is appended to ``out`` for :func:`_admission`.
    Nothing when tenancy is not in use here (no claim is weighed then: the XML's tenant is never recorded)."""
    from .admitting import active
    if store.absent or not active(store):
        return []
    from . import tenancy
    tr = tenancy.trust(store, view)
    out.append(tr)
    if not tr.refusal:
        return []
    return [_admission_refusal(tr, RefusedError(f"admission: {tr.refusal}", hint=tr.hint))]


def _request_refusals(store: "StateStore", inv: "Inventory", view: "DomainView",
                      allow: "Optional[frozenset]") -> "List[Refusal]":
    """``prepare begin``'s own checks of the XML it will see, the same calls with the same hook allow-list
    ``allow``: :func:`vgpuhost.policy.hookrequest.check_request` (a vGPU without its ``<hostdev>``, a VF's
    hostdev ``managed='yes'``, a GPU the allow-list leaves out) and
    :func:`vgpuhost.policy.hostdevs.check_hostdevs` (a GPU device a ``<hostdev>`` names that the metadata
    does not declare, or another owner holds).  One refusal (``no-device``) with its line and fix."""
    from ..model.errors import VgpuhostError
    from ..policy import migration as mig
    from ..policy.hookrequest import check_request
    from ..policy.hostdevs import check_hostdevs, declared_functions
    from ..policy.iommu import group_endpoints
    try:
        checked = check_request(inv, view, allow, group_endpoints)
        check_hostdevs(inv, view, declared_pci=declared_functions(view, inv), allow=checked.allowed,
                       vgpu_records=store.vgpu_records(), passthrough_records=store.passthrough_records(),
                       active_domains=store.active_domains())
    except VgpuhostError as e:
        return [mig.Refusal(mig.NO_DEVICE, "", e.message, e.hint or "fix the domain's XML ('vgpuhost attach' "
                                                                    "writes hostdev and metadata together)")]
    return []


def _whose(tr) -> str:
    """The tenant a refusal's line starts with: ``tenant t1`` (bound), ``tenant t1 (Nova's project, by the
    OpenStack mapping)`` or ``no tenant``."""
    from ..policy.binding import OPENSTACK
    if tr.tenant is None:
        return "no tenant"
    return f"tenant {tr.tenant}" + (" (Nova's project, by the OpenStack mapping)" if tr.source == OPENSTACK else "")


def check_incoming(host: HostRoot, req: "Request") -> dict:
    """The destination's answer to ``req`` (this host is the destination): the check document
    (:data:`~vgpuhost.policy.migration.CHECK_SCHEMA`): ``ok``, ``refusals`` (code, device, line, fix),
    ``devices`` (where each vGPU would be made) and both vGPU manager versions.  Changes nothing on
    this host: the state store is opened read-only (never created)."""
    from ..io.state import StateStore
    from ..policy import migration as mig
    store = StateStore(host.s.state_dir, create=False)
    try:
        refusals: "List[Refusal]" = []
        dest_manager = manager_version(host)
        m = mig.manager_refusal(req.manager, dest_manager)
        if m is not None:
            refusals.append(m)
        inv, records, seen = _facts(host, store, req.uuid)
        from .devices import admission_inputs, load_allow
        inputs = admission_inputs(host, inv, load_allow(host), records, req.uuid)   # what the hook there weighs
        placed, more = _placements(host, store, req, inv, records, seen, {}, inputs,
                                   _vf_admission(store, _request_view(req), inv, inputs, _trusted(store, req)))
        refusals += more
        if not more and placed:
            more, decided = _admission(host, store, req, inv, placed, inputs)
            refusals += more
            for p in placed:
                if p["kind"] == "mdev" and p["device"] in decided:
                    p["gpu"] = p["parent"] = decided[p["device"]]   # where prepare begin's admission makes it
    finally:
        store.close()
    return {"schema": mig.CHECK_SCHEMA, "domain": req.name, "uuid": req.uuid, "destination": host.s.root,
            "ok": not refusals, "manager_version": {"source": req.manager, "destination": dest_manager},
            "tenant": req.tenant, "devices": placed, "refusals": [r.as_dict() for r in refusals]}


def check(host: HostRoot, store: "StateStore", view: "DomainView", dest: str) -> dict:
    """``vgpuhost migrate check DOMAIN --to DEST`` on the source ``host``: the request made here, answered by
    the destination.  ``dest``: a host root directory (``VGPUHOST_ROOT`` form), or an ssh URI
    (``ssh://[USER@]HOST[:PORT]``, ``qemu+ssh://[USER@]HOST[:PORT]/system``: the destination's side runs
    there as ``vgpuhost --json migrate check --incoming`` over ssh, :func:`over_ssh`).  Any other URI is
    refused (InputError, exit 2) with the two-step form."""
    from ..io.files import is_dir
    req = request_for(host, store, view)
    if dest.startswith(("ssh://", "qemu+ssh://")):
        doc = over_ssh(dest, req)
    elif "://" in dest or not is_dir(dest):
        raise InputError(f"destination {dest!r} is neither a host root directory nor an ssh:// or qemu+ssh:// URI",
                         hint=f"or run the check there: 'vgpuhost migrate request {view.name or view.uuid} | "
                              "ssh HOST vgpuhost migrate check --incoming'")
    else:
        doc = check_incoming(HostRoot.from_env(dest, None), req)
    more = running_type_refusals(view, req)
    if more:
        doc["refusals"] = [r.as_dict() for r in more] + doc["refusals"]
        doc["ok"] = False
    return doc


def running_type_refusals(view: "DomainView", req: "Request") -> "List[Refusal]":
    """The source's own rule (trial 5 finding 1): a vGPU whose running type (``req``, from this host's
    records) differs from the profile the domain XML names (right-sized at its start, ``resize="auto"``)
    cannot migrate with that XML: the destination's ``migrate begin`` and ``prepare begin`` make what the
    XML names, never right-sizing an incoming migration.  One refusal each, with the ``virsh migrate
    --xml`` fix."""
    from ..model.values import VgpuProfile
    from ..policy.migration import running_type_refusal
    out = []
    asked = {v.device: str(v.profile) for v in view.metadata.vgpus}
    for d in req.devices:
        if d.kind == DeviceKind.PASSTHROUGH or d.device not in asked:
            continue
        a, r = VgpuProfile.try_parse(asked[d.device]), VgpuProfile.try_parse(d.profile)
        if a is not None and r is not None and str(a).upper() != str(r).upper():
            out.append(running_type_refusal(req.name, d.device, d.profile, asked[d.device]))
    return out


#: characters an ssh destination may hold (user, host name or address, port); never a leading '-'
_SSH_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_@:[]%")
SSH_TIMEOUT_S = 120


def ssh_argv(uri: str) -> "List[str]":
    """The ssh command line that runs the destination's side for ``uri`` (``ssh://`` or ``qemu+ssh://``,
    ``[USER@]HOST[:PORT]``, any path ignored): ``ssh -o BatchMode=yes [-p PORT] -- [USER@]HOST vgpuhost
    --json migrate check --incoming``.  Raises InputError for a destination that is not plain."""
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError:
        parts, port = None, None
    host = parts.hostname if parts is not None else None
    if not host or host[0] == "-" or not set(host) <= _SSH_CHARS or (parts.username and (
            parts.username[0] == "-" or not set(parts.username) <= _SSH_CHARS)) or parts.password:
        raise InputError(f"invalid ssh destination {uri!r}",
                         hint="ssh://[USER@]HOST[:PORT] or qemu+ssh://[USER@]HOST[:PORT]/system")
    target = f"{parts.username}@{host}" if parts.username else host
    return (["ssh", "-o", "BatchMode=yes"] + (["-p", str(port)] if port else [])
            + ["--", target, "vgpuhost", "--json", "migrate", "check", "--incoming"])


#: the most bytes of the destination's answer read over ssh (a check document is a few KiB)
MAX_ANSWER_BYTES = 1 << 20


def over_ssh(uri: str, req: "Request") -> dict:
    """The destination's check document for ``req``, from ``vgpuhost migrate check --incoming`` run on the
    host ``uri`` names over ssh (its exit 0 or 2 both answer a document).  The answer is untrusted: at
    most :data:`MAX_ANSWER_BYTES` are read, and it must parse as a check document
    (:func:`vgpuhost.policy.migration.parse_check`: sizes, counts, codes); its strings are escaped where
    printed.  Raises HostEnvironmentError (exit 2) when ssh cannot run or the far side answers no check
    document (too large, not JSON, not the schema); never echoes its output."""
    import json
    from ..io.process import run_capped
    from ..model.errors import HostEnvironmentError
    from ..policy.migration import parse_check
    argv = ssh_argv(uri)
    target = argv[argv.index("--") + 1]
    try:
        rc, stdout, stderr = run_capped(argv, input=json.dumps(req.as_dict()).encode(), timeout=SSH_TIMEOUT_S,
                                        limit=MAX_ANSWER_BYTES)
    except OSError as e:
        raise HostEnvironmentError(f"cannot run ssh: {e.strerror}", hint="install openssh-client") from None
    except Exception as e:
        if type(e).__name__ != "TimeoutExpired":
            raise
        raise HostEnvironmentError(f"{target} did not answer within {SSH_TIMEOUT_S} s",
                                   hint="check that 'ssh HOST true' works without a prompt") from None
    fix = "vgpuhost must be installed there and 'ssh HOST vgpuhost --version' work without a prompt"
    if len(stdout) > MAX_ANSWER_BYTES:
        raise HostEnvironmentError(f"the check over ssh on {target} answered more than {MAX_ANSWER_BYTES} bytes: "
                                   "not a check document", hint=fix)
    try:
        doc = json.loads(stdout.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        doc = None
    if rc not in (0, 2) or doc is None:
        err = stderr.decode("utf-8", "replace").strip().splitlines()
        last = "".join(c if c.isprintable() else "?" for c in (err[-1] if err else ""))[:300]
        raise HostEnvironmentError(f"the check over ssh on {target} gave no answer (exit {rc}"
                                   + (f": {last}" if last else "") + ")", hint=fix)
    try:
        return parse_check(doc)
    except InputError as e:
        raise HostEnvironmentError(f"the check over ssh on {target} gave no check document ({e.message})",
                                   hint=fix) from None


# ---------------------------------------------------------------------------
# the qemu hook's migrate begin (destination)

def _expiry(seconds: int) -> str:
    import time
    secs = time.time() + seconds
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + ".000000+00:00"


def incoming(host: HostRoot, data: bytes, *, actor: str) -> "Optional[str]":
    """``migrate begin`` on the destination: the rewritten domain XML (None: print nothing, unchanged).

    For each vGPU the incoming domain's metadata declares, a device is chosen here by the domain's
    placement rules (strategy, anti-affinity, one vGPU per VM per GPU), keeping the one the XML names
    where it is free here: a VF (vendor VFIO, MIG-backed types included) is rewritten in the metadata
    (``vf=``) and in the ``<hostdev>`` source address; a classic mdev keeps its UUID (it is unique, and
    the guest sees the same device) unless another owner holds that UUID here (then a new one, in the
    metadata and the ``<hostdev>``), and its ``gpu=`` pin is rewritten only when this host cannot place
    it on that GPU.  Where tenancy is in use a VF is chosen only on a GPU admission accepts for it
    (:func:`_vf_admission`).  Each chosen device is reserved for the domain (state store, owner its UUID,
    expiring after :data:`RESERVATION_TTL_S`), so no start takes it before ``prepare begin`` makes it
    (:func:`vgpuhost.ops.devices.prepare` places a reserved mdev on its reserved GPU).

    First, as ``prepare begin`` does, what a killed start of the domain left here is ended: the open
    journal entries naming its devices (:func:`vgpuhost.ops.devices.end_interrupted`) and, where tenancy
    is in use, its allocation rows of devices never made (:func:`vgpuhost.ops.recover.settle_allocations`,
    under the host lock); a refusal's hint then names what was ended.

    The devices are placed, and the XML ``prepare begin`` will see (the rewritten one) is checked and
    admitted, with what ``prepare begin`` places and admits with
    (:func:`vgpuhost.ops.devices.admission_inputs`): the hook allow-list (a GPU it leaves out offers
    nothing; a pin to one moves, as a pin to an absent GPU does), the GPUs' mixed-size maxima (a record
    whose vGPU is missing holding its placement id) and, for admission, the scheduler policy each pooled
    GPU runs (one in drift admits nothing); then ``prepare begin``'s own check of the XML
    (:func:`vgpuhost.policy.hookrequest.check_request`).

    Raises RefusedError (exit 2, nothing reserved, one audit row ``(migration)``) when the destination
    cannot take the domain: the XML's ``tenant=``/``qos=`` claims (weighed first, before placement, as
    ``prepare begin`` weighs them: :func:`_claim_refusals`), a passed-through GPU, a type or MIG profile not free here on a GPU the
    allow-list allows (counted in the GPU's mode), the XML's devices refused by that check (``no-device``),
    or its admission here (the destination's own binding, quota, isolation, pools and their scheduler
    policies, as ``migrate check --incoming`` decides it, and the incoming XML's ``tenant=``/``qos=`` asks
    as ``prepare begin`` weighs them: a claim is refused; other incoming migrations' reservations count as
    their tenants' devices); InputError (exit 2) for a bad XML or a bad allow-list, HostEnvironmentError
    for an unreadable one (nothing reserved)."""
    from ..libvirt.domxml import parse_domain
    view = parse_domain(data)
    meta = view.metadata
    if meta is None or meta.empty:
        return None
    from ..io.locks import file_lock
    from ..io.state import StateStore, utcnow
    from .admitting import HOST_LOCK
    from .devices import _owned, admission_inputs, end_interrupted, load_allow
    store = StateStore(host.s.state_dir, owned=lambda: _owned(host))
    name = view.name or view.uuid
    operation = f"migrate begin {name}"
    # what a killed start of this domain left here (its devices' open journal entries) is finished or rolled
    # back first, as its prepare begin does before anything else: the devices are placed and admitted on the
    # host as the records say it is
    ended = end_interrupted(host, store, view, actor=actor)
    with file_lock(store.dir, HOST_LOCK):      # the lock admission decides starts under: no start races it
        from .admitting import active
        if not store.absent and active(store):
            # and its allocation rows of devices never made go, as prepare begin's admission drops them
            # (ops/tenancy.admitting) before it admits the domain anew
            from .recover import settle_allocations
            ended += settle_allocations(store, actor=actor, owner=view.uuid, locked=True)
        req = request_for(host, store, view)
        inv, records, seen = _facts(host, store, req.uuid)
        # what prepare begin places and admits with (the hook allow-list, mixed-size maxima, the pools'
        # scheduler policies), from the one source it takes them from: a migration its prepare begin would
        # refuse for them is refused here, before anything is reserved or its memory copied
        allow = load_allow(host)            # a bad or unreadable allow-list refuses, as at prepare begin
        inputs = admission_inputs(host, inv, allow, records, view.uuid)
        keep: "Dict[str, object]" = {}
        for v in meta.vgpus:
            keep[v.device] = v.vf if v.vf is not None else v.gpu
        # the XML's tenant and class claims first, as prepare begin weighs them before it places anything
        claimed: list = []
        refusals = _claim_refusals(store, view, claimed)
        placed = []
        if not refusals:
            # under tenancy a VF is chosen on a GPU admission accepts for it (isolation, pools), not kept on
            # one it refuses when another would take it
            admitted = _vf_admission(store, view, inv, inputs, claimed[0] if claimed else None)
            placed, refusals = _placements(host, store, req, inv, records, seen, keep, inputs, admitted)
        rows = []
        changed_vfs: "Dict[str, str]" = {}
        changed_pins: "Dict[str, str]" = {}
        changed_uuids: "Dict[str, str]" = {}
        new_xml = None
        trusted: list = []          # the tenant and class admission trusted, for the reservation
        if not refusals and placed:
            expires = _expiry(RESERVATION_TTL_S)
            expires_now = utcnow()
            # an mdev UUID another owner holds here (a record, or an mdev in the tree nobody recorded for this
            # domain) must change: the rest of the domain keeps its identity, the guest sees the same device type
            mine = {r.id for r in records if r.owner == view.uuid}
            in_use = ({r.id for r in records} | {m.uuid for m in inv.mdevs}) - mine
            for p, v in zip(placed, meta.vgpus):
                if p["kind"] == "vf":
                    rows.append((p["parent"], name, p["gpu"], "vf", p["profile"], expires))
                    if p["parent"] != str(v.vf):
                        changed_vfs[str(v.vf)] = p["parent"]
                else:
                    device = p["device"]
                    if device in in_use or any(r[0] == device and r[1] != view.uuid and r[6] >= expires_now
                                               for r in store.reservation_rows()):
                        device = changed_uuids[p["device"]] = _new_uuid(in_use)
                    rows.append((device, name, p["gpu"], "mdev", p["profile"], expires))
                    if v.gpu is not None and str(v.gpu) != p["gpu"]:
                        changed_pins[p["device"]] = p["gpu"]
            if changed_vfs or changed_pins or changed_uuids:
                new_xml = rewrite(data, view, changed_vfs, changed_pins, changed_uuids)
            # the XML prepare begin will see, checked and admitted as it will check and admit it: its own
            # check of the XML with the allow-list, then the destination's admission, read-only (its binding,
            # the XML's tenant and class asks: trial 7 F5; the inputs above): a domain its tenant's quota,
            # isolation or pools keep out, or whose XML claims another tenant or a stronger class, is refused
            # before anything is reserved, not at its prepare begin
            seen_view = parse_domain(new_xml.encode()) if new_xml is not None else view
            refusals = _request_refusals(store, inv, seen_view, allow)
            if not refusals:
                refusals, decided = _admission(host, store, req, inv, placed, inputs, seen_view, trusted,
                                               trusted=claimed[0] if claimed else None)
                # an mdev is reserved on the GPU prepare begin's admission will make it on (an unpinned one's
                # may differ from placement's first choice: pools, isolation); a pin and a VF fix their GPU
                rows = [(r[0], r[1], decided.get(r[0], r[2]), r[3], r[4], r[5]) if r[3] == "mdev" else r
                        for r in rows]
        if refusals:
            line = "; ".join(r.text() for r in refusals)
            store.audit(actor=actor, operation=operation, path="(migration)", value=line, result="refused")
            first = refusals[0]
            fix = first.fix
            if ended:
                # what it ended of a killed start first belongs in its refusal, as prepare begin says it
                note = "before this migration, vgpuhost ended " + "; ".join(r.line() for r in ended)
                fix = f"{fix}; {note}" if fix else note
            raise RefusedError(f"incoming migration refused: {first.line}" +
                               (f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else ""), hint=fix)
        from .health import _set_marker
        _set_marker(store)      # commands that open no store read it then: a reserved VF counts as taken
        # the tenant admission trusted (a binding, or the OpenStack mapping of the XML's project: trial 7
        # retest N1) is stored with the reservation: every admission counts it for that tenant
        store.reserve(rows, owner=view.uuid, actor=actor, operation=operation,
                      tenant=trusted[0].tenant if trusted else None, qos=trusted[0].qos if trusted else None)
    return new_xml


def _new_uuid(taken: set) -> str:
    import uuid
    while True:
        u = str(uuid.uuid4())
        if u not in taken:
            return u


def rewrite(data: bytes, view: "DomainView", vfs: "Dict[str, str]", pins: "Dict[str, str]",
            uuids: "Optional[Dict[str, str]]" = None) -> str:
    """The domain XML ``data`` with each VF of ``vfs`` (old BDF -> new BDF) moved, in the metadata and in
    the ``<hostdev>`` source address that names it, each mdev of ``pins`` (UUID -> GPU BDF) pinned
    to its new GPU, and each mdev of ``uuids`` (old UUID -> new UUID) renamed in the metadata and its
    ``<hostdev>``; everything else as it was."""
    uuids = uuids or {}
    from ..libvirt.domain import DomainDoc, hostdev_source
    from ..libvirt.domxml import VgpuRequest
    from ..model.values import PciAddress
    doc = DomainDoc.parse(data)
    for h in doc.hostdevs():
        kind, source = hostdev_source(h)
        if kind == "mdev" and source in uuids:
            h.find("source/address").set("uuid", uuids[source])
            continue
        if kind != "pci" or source not in vfs:
            continue
        new = PciAddress.parse(vfs[source])
        a = h.find("source/address")
        a.set("domain", f"0x{new.domain:04x}")
        a.set("bus", f"0x{new.bus:02x}")
        a.set("slot", f"0x{new.slot:02x}")
        a.set("function", f"0x{new.function:x}")
    meta = view.metadata
    meta.vgpus = [VgpuRequest(v.profile, vf=PciAddress.parse(vfs[str(v.vf)]), gpu=v.gpu)
                  if v.vf is not None and str(v.vf) in vfs else
                  VgpuRequest(v.profile, uuid=uuids.get(v.uuid, v.uuid),
                              gpu=PciAddress.parse(pins[v.uuid]) if v.uuid in pins else v.gpu)
                  if v.uuid is not None and (v.uuid in pins or v.uuid in uuids) else v
                  for v in meta.vgpus]
    doc.set_metadata(meta)
    return doc.to_xml()


def sweep(store: "StateStore", *, actor: str, check: bool = False) -> "List[str]":
    """Reservations whose expiry passed (a destination whose migration ended without ``prepare begin``
    or ``release end``, e.g. its libvirtd killed): freed (one audit row each, result ``expired``), or with
    ``check`` only listed.  One line each: ``KIND DEVICE on GPU for NAME (expired TIME)``."""
    from ..io.state import utcnow
    if store.absent:
        return []
    now = utcnow()
    if check:
        rows = [r for r in store.reservation_rows() if r[6] < now]
    else:
        rows = store.drop_reservations(expired_before=now, actor=actor, operation="reconcile", result="expired")
    return [f"{r[4]} {r[0]} on {r[3]} for {r[2]} (expired {r[6]})" for r in rows]
