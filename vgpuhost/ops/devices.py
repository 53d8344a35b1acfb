"""A domain's devices: make them at start, give them back at stop.

Owns: ``prepare`` (every device a domain's vgpuhost metadata names: its
passthrough groups bound, its vGPUs created, all or nothing) and
``release`` / :func:`release_domain` (what a domain holds removed, owner
guarded, and the domain forgotten).  The qemu hook runs them at ``prepare
begin`` / ``release end``; ``vgpuhost reconcile --forget-domains`` runs
:func:`release_domain` for domains a host crash left recorded as running.
Reads the operator allow-list (:func:`load_allow`) through io/ and decides
with :mod:`vgpuhost.policy.hookrequest`; every GPU device a domain's hostdevs
name, declared or not, is decided by :mod:`vgpuhost.policy.hostdevs` before
admission and before any write (an undeclared one refused, with an audit row).
Must not: call libvirt (the hook runs inside a libvirtd call, docs/reference/libvirt.md);
import anything heavy at module level (the qemu hook imports this module on
every GPU domain start: ops modules are imported where used).
"""

from __future__ import annotations

import os
import _signal as signal     # the C module: ``signal`` itself imports enum (the hook's start)

from ..io.hostroot import HostRoot
from ..model.errors import DeviceError, GpuFailedError, InputError, RefusedError, VgpuhostError
from ..model.kinds import Backend
from ..model.values import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:   # only for annotations: never imported on the hook path
    from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple
    from ..io.state import StateStore
    from ..model.records import VgpuRecord
    from ..libvirt.domxml import DomainView
    from ..observe.inventory import Inventory
    from ..policy.hookrequest import Checked


#: the hook allow-list, as refusals name it
ALLOW_LIST = "the hook allow-list (etc/vgpuhost/hook.allow)"


def allow_path(host: HostRoot):
    """``<root>/etc/vgpuhost/hook.allow``: the GPUs the qemu hook may act on."""
    from ..policy.hookrequest import ALLOW_FILE
    return host.etc(*ALLOW_FILE)


def load_allow(host: HostRoot) -> "Optional[FrozenSet[PciAddress]]":
    """The GPUs the hook may act on, read from :func:`allow_path`: None = every NVIDIA GPU.

    See :func:`vgpuhost.policy.hookrequest.parse_allow` for the format.
    Raises InputError for a bad line (``file:line: ...``) and
    HostEnvironmentError when the file cannot be read; the hook then
    refuses (fails closed).
    """
    from ..io.files import read_capped
    from ..policy.hookrequest import ALLOW_FILE, MAX_ALLOW_BYTES, parse_allow
    path = host.s.etc(*ALLOW_FILE)          # allow_path() as a string (no pathlib on the hook's path)
    try:
        data = read_capped(path, MAX_ALLOW_BYTES)
    except OSError as e:
        from ..model.errors import HostEnvironmentError
        raise HostEnvironmentError(f"cannot read the hook allow-list {host.relative(path)}: {e.strerror}",
                                   hint="make it readable by root, or remove it to allow every NVIDIA GPU") from None
    return parse_allow(data, host.relative(path))


def admission_inputs(host: HostRoot, inv: "Inventory", allow: "Optional[FrozenSet[PciAddress]]",
                     records: "Optional[Sequence[VgpuRecord]]" = None, owner: "Optional[str]" = None) -> dict:
    """What the hook weighs beside a domain's own devices when it admits and places them, as the keywords
    :func:`vgpuhost.ops.tenancy.admitting` and :func:`~vgpuhost.ops.tenancy.admit_domain` take: ``allowed``
    (the hook allow-list ``allow``, :func:`load_allow`: None = every NVIDIA GPU), ``limits_for`` (a type
    name -> ``{GPU: its max in the GPU's vGPU mode}``, :func:`vgpuhost.ops.vgpu.limits_lookup`: mixed-size
    maxima and free placement ids, the records whose vGPU is missing from a GPU counted at their ids as
    ``vgpu create`` and ``capacity`` count them, classic mdev included) and ``policies`` (GPU BDFs ->
    ``{BDF: the scheduler policy it runs}``, :func:`vgpuhost.ops.tenancy.scheduler_policies`: a pooled GPU
    in drift admits nothing).  ``records``: the vGPU records (the state store's, read by the caller; None:
    a vendor-VFIO GPU's are read from the store when it is in mixed-size mode, an mdev GPU's missing ones
    not looked for); ``owner``: the domain being admitted, whose own records hold nothing for it (its
    start makes them anew, as :func:`vgpuhost.policy.offers.offers` leaves them out).  One source for
    ``prepare begin`` and the destination's ``migrate begin`` (:func:`vgpuhost.ops.migrate.incoming`, which
    narrows its placement by ``allowed`` and ``limits_for`` too), so an incoming migration is refused where
    its ``prepare begin`` would be.  Reads nothing until a callable is called (NVML then: the modes only for
    vendor-VFIO GPUs listing the type and GPUs holding a missing record, the policies only of pooled GPUs
    asked for).  ``limits_for.modes()``: ``{GPU: mixed-size mode on}`` (NVML, read once), for the offers'
    ``modes``: asked only for a GPU holding a record whose vGPU is missing (trial 8 retest R6)."""
    if records is not None and owner is not None:
        records = [r for r in records if r.owner != owner]
    lookup: list = []

    def limits_for(name: str) -> dict:
        if not lookup:
            from .vgpu import limits_lookup
            lookup.append(limits_lookup(host, inv, records))
        return lookup[0](name)

    def modes() -> dict:
        # the GPUs' mixed-size modes (NVML), asked only for a GPU holding a record whose vGPU is missing
        limits_for("")
        return lookup[0].modes()
    limits_for.modes = modes        # type: ignore[attr-defined]

    def policies(gpus) -> "Dict[str, str]":
        from .tenancy import scheduler_policies
        return scheduler_policies(host, gpus)
    return {"allowed": allow, "limits_for": limits_for, "policies": policies}


def prepare(host: HostRoot, view: "DomainView", *, actor: str, inventory=None,
            store: "Optional[StateStore]" = None) -> List[str]:
    """Make every device the domain's metadata names exist; returns what this call changed.

    First, every GPU device the domain's hostdevs name must be declared by its metadata
    (:mod:`vgpuhost.policy.hostdevs`): RefusedError (exit 2) with an audit row ``(hostdevs)``
    otherwise, nothing made.  A domain with no vgpuhost devices gets only that check, on the devices
    its hostdevs name (no state store is made when it passes).

    All or nothing: on any failure what this call made is removed again
    (owner-guarded) before the error propagates.  Idempotent: devices the
    domain already holds (a retried start) are kept as they are.
    ``inventory``: a current discovery of the host instead of reading it
    again, or a callable returning one (the agent's warm snapshot, checked
    against the host when called); every placement is still re-checked under
    the GPU lock on a fresh read.  Where tenancy is in use only the callable
    serves, called under the host lock (a snapshot taken before it may miss
    another start's devices); a plain one is read again there.  ``store``: the state
    store already open on ``host.state_dir`` (the agent's), instead of
    opening it for this call.
    """
    meta = view.metadata
    if meta is None or meta.empty:
        if view.hostdevs:
            _check_undeclared(host, view, actor, store)
        return []
    from ..io.files import is_file
    from ..io.state import DB_NAME, StateStore
    if store is None and is_file(os.path.join(host.s.state_dir, DB_NAME)):
        store = StateStore(host.s.state_dir, owned=lambda: _owned(host))
    recovered = end_interrupted(host, store, view, actor=actor) if store is not None else []
    if recovered:
        inventory = None                    # the host changed
    try:
        return _prepare(host, view, actor, inventory, store)
    except VgpuhostError as e:
        if recovered:
            # what the start undid of another operation first belongs in its refusal (a breaker's finding:
            # a start that rolled back an interrupted 'mig apply' and then refused said nothing of it)
            note = "before this start, vgpuhost ended " + "; ".join(r.line() for r in recovered)
            e.hint = f"{e.hint}; {note}" if e.hint else note
        raise


def end_interrupted(host: HostRoot, store: "StateStore", view: "DomainView", *, actor: str) -> list:
    """Finish or roll back the interrupted operations (open journal entries) naming a device ``view``'s
    metadata declares (its vGPUs' mdev UUIDs and VFs, its passthrough GPUs): a start of it killed mid-way
    (or another operation on those devices), each under its own locks
    (:func:`vgpuhost.ops.recover.recover_devices`), as every CLI operation does under its GPU lock, so
    the domain's next start is decided on the host as the records say it is, not refused for what the
    killed one left.  ``prepare begin`` and the destination's ``migrate begin``
    (:func:`vgpuhost.ops.migrate.incoming`) run it first.  Returns the :class:`~vgpuhost.ops.recover.Recovered`
    reports (empty, after one query, when no entry is open)."""
    if not store.journal_entries(open_only=True):
        return []
    from .recover import recover_devices
    meta = view.metadata
    names = {r.device for r in meta.vgpus} | {str(g) for g in meta.passthrough}
    return recover_devices(host, store, names, actor=actor)


def _prepare(host: HostRoot, view: "DomainView", actor: str, inventory, store: "Optional[StateStore]") -> List[str]:
    """:func:`prepare` once interrupted operations on the domain's devices are ended.

    Where tenancy is in use the host lock (:func:`vgpuhost.ops.tenancy.host_lock`) is taken first and
    held until the devices are made and their allocations recorded: the host is read, the request
    checked, its profiles resolved and its devices admitted on facts read under it (issue 26), so two
    starts never decide on the same view.  A start of a domain with vGPUs on a host where a GPU is
    opted in to MIG on demand takes it too (nothing enforced): its GPU instance is made and its vGPU
    put on it with no other start between, so the driver (which puts a vGPU on the lowest free GPU
    instance of its profile) cannot put it on another start's fresh one, nor another start take this
    one (trial 5 finding 2).  Otherwise no lock is taken (nothing to enforce)."""
    from .admitting import HOST_LOCK, active as tenancy_in_use
    on_demand = (store is not None and view.metadata is not None and bool(view.metadata.vgpus)
                 and "on" in store.settings_under("mig.on-demand/").values())
    enforced = store is not None and tenancy_in_use(store)
    if enforced or on_demand:
        from ..io.locks import file_lock
        with file_lock(store.dir, HOST_LOCK):
            # the caller's inventory serves only when it can say it is current now (the agent's snapshot,
            # checked against the host when called); a plain snapshot may predate another start's devices
            inv = inventory() if callable(inventory) else None
            return _prepare_locked(host, view, actor, inv, store, enforced)
    return _prepare_locked(host, view, actor, inventory() if callable(inventory) else inventory, store, False)


def _prepare_locked(host: HostRoot, view: "DomainView", actor: str, inventory: "Optional[Inventory]",
                    store: "Optional[StateStore]", enforced: bool) -> List[str]:
    """:func:`_prepare` with the host lock held where ``enforced`` (tenancy in use)."""
    from ..io.state import StateStore
    from ..policy.hookrequest import check_request
    from ..policy.iommu import group_endpoints
    allow = load_allow(host)
    # only the GPUs the domain's devices may use, and the devices its hostdevs name: never the whole host
    inv = inventory if inventory is not None else domain_inventory(host, view, allow)
    checked = check_request(inv, view, allow, group_endpoints)
    if store is None:
        store = StateStore(host.s.state_dir, owned=lambda: _owned(host))
    from .health import in_service
    inv = in_service(inv, store, owner=view.uuid)        # GPUs out of service offer nothing to admission or placement (issue 27)
    try:
        return _prepare_checked(host, view, actor, inv, store, enforced, checked, allow)
    except RefusedError as e:
        # every refusal of a start has its audit row (the host was asked to change): the row of the decision
        # that refused it where it wrote one (admission, hostdevs, placement), else this one
        if not e.audited:
            store.audit(actor=actor, operation=f"prepare {view.name or view.uuid}", path="(start)",
                        value=e.message, result="refused")
            e.audited = True
        raise


def _prepare_checked(host: HostRoot, view: "DomainView", actor: str, inv: "Inventory", store: "StateStore",
                     enforced: bool, checked: "Checked", allow) -> List[str]:
    """:func:`_prepare_locked` once the request is checked and the store open: what was made."""
    from ..policy.hookrequest import check_holders
    from .health import in_service
    active = store.active_domains()
    records = store.vgpu_records()
    # a PCI hostdev may name a group another owner holds: the records are read for it too
    pt_records = store.passthrough_records() if checked.passthrough or view.pci_sources else ()
    check_holders(inv, view, checked, vgpu_records=records, passthrough_records=pt_records, active_domains=active)
    # every GPU device the domain names, declared or not (issue 28): an undeclared one is refused here,
    # before admission and before any write
    _refuse_hostdevs(store, view, actor, inv, allow=checked.allowed, vgpu_records=records,
                     passthrough_records=pt_records, active_domains=active)
    if not (checked.vgpus and any(getattr(r.profile, "mig_backed", False) for r in checked.vgpus)):
        return _prepare_made(host, view, actor, store, enforced, inv, checked, records, pt_records, active)
    # MIG on demand (opted-in GPUs): a GPU instance for a MIG-backed vGPU none takes now, made before
    # its profile is resolved and admitted, and destroyed again when the start fails below; the start
    # counts as in progress in this process meanwhile (the agent's other hooks leave its instances alone)
    from . import migdemand
    with migdemand.starting(view.uuid):
        resized, requests = None, checked.vgpus
        if view.metadata.resize == "auto" and migdemand.opted_in(store) and not _reservations(store, view, checked):
            # right-sized first (trial 10a finding 15): the instance made is the one the advised profile
            # needs, offered as MIG on demand would make it
            resized = _right_size(store, view, migdemand.makeable(host, store, inv),
                                  {r.device: str(r.profile) for r in checked.vgpus}, {r.id for r in records})
            requests = [type(r)(resized[r.device][1], r.uuid, r.vf, r.gpu) if r.device in resized else r
                        for r in checked.vgpus]
        ondemand = migdemand.make_for(host, store, view.uuid, requests, inv, actor=actor)
        if ondemand:
            inv = in_service(domain_inventory(host, view, allow), store, owner=view.uuid)
        try:
            out = _prepare_made(host, view, actor, store, enforced, inv, checked, records, pt_records, active,
                                resized)
        except BaseException as e:
            if ondemand:
                failed = migdemand.release_made(host, store, ondemand, actor=actor)
                if failed and isinstance(e, VgpuhostError):
                    e.message += "; UNDO FAILED for " + ", ".join(failed)
            raise
        if ondemand:
            migdemand.started(store, ondemand)        # no start in progress holds them any more
        return out


def _prepare_made(host: HostRoot, view: "DomainView", actor: str, store: "StateStore", enforced: bool,
                  inv: "Inventory", checked: "Checked", records, pt_records, active,
                  resized_first: "Optional[Dict[str, Tuple[str, str, str]]]" = None) -> List[str]:
    """:func:`_prepare_locked` once the request is checked (and GPU instances made on demand): resolve,
    admit and make the devices; what was made, all or nothing.  ``resized_first``: the right-sizing
    decided before GPU instances were made on demand (None: decided here)."""
    if resized_first:
        # the instances made on demand are the advised profiles': the ones asked resolve as MIG on demand offers them
        from .migdemand import makeable
        types = _resolve_profiles(makeable(host, store, inv), store, checked, host)
    else:
        types = _resolve_profiles(inv, store, checked, host) if checked.vgpus else {}
    me = view.uuid
    # devices reserved for an incoming live migration (the hook's migrate begin, ops/migrate.py): this
    # domain's are made where they were reserved; another domain's are not taken
    mine_reserved = _reservations(store, view, checked) if checked.vgpus else {}
    requested = types
    # an incoming live migration (reserved by migrate begin) makes the type the XML names, as reserved:
    # the type is part of the migrated device's state, so it is never right-sized here (docs/guide/migration.md)
    resized = resized_first if resized_first is not None else (
        _right_size(store, view, inv, types, {r.id for r in records})
        if checked.vgpus and view.metadata.resize == "auto" and not mine_reserved else {})
    if resized:
        types = dict(types)
        types.update({dev: new for dev, (_, new, _) in resized.items()})
    if checked.passthrough and inv.out_of_service:
        # a GPU out of service (unhealthy or cordoned) goes to no new domain by passthrough, pooled or not
        # (docs/guide/failures.md); the domain that holds it already (a retried start) keeps it
        from .health import refuse_out_of_service
        held = {r.gpu for r in pt_records if r.owner == me}
        for gpu, _ in checked.passthrough:
            if gpu in inv.out_of_service and str(gpu) not in held:
                refuse_out_of_service(store, gpu, what=f"pass {gpu} through to {view.name or me}", actor=actor,
                                      operation=f"prepare {view.name or me}")
    # what the records gave the domain before this start (read above: no second read on the hook's path)
    held_before = (frozenset(r.id for r in records if r.owner == me),
                   frozenset(r.gpu for r in pt_records if r.owner == me) if checked.passthrough else None)
    was_active = me in active
    # a start of a domain recorded running (a retry, a forged document) that is refused or fails leaves its
    # record as it was: name, time and marker (trial 10 B1: the refusal said nothing was changed)
    record_before = store.domain_record(me) if was_active else None
    store.domain_started(me, view.name or me)
    made: List[Tuple[str, object]] = []
    if enforced:
        # admission (issues 13, 26): quota, isolation, QoS class, pool, decided once under the host lock
        from . import tenancy
        inputs = admission_inputs(host, inv, checked.allowed, records, me)     # migrate begin admits with the same

        def block(kinds):
            return tenancy.admitting(store, view, inv, actor=actor, types=kinds, **inputs)
        admitting = block(types) if not resized else _ResizedOrAsked(block, types, requested, resized, store,
                                                                      view, actor)
    else:
        from .admitting import unenforced_admitting
        admitting = unenforced_admitting(store, view, inv, types)   # nothing to enforce: no admission code imported
    try:
        with admitting as grant:
            if isinstance(admitting, _ResizedOrAsked):
                types = admitting.types             # the advised profiles, or those asked where they were refused
            try:
                if checked.passthrough:
                    from . import passthrough
                    for gpu, _ in checked.passthrough:
                        grant.made(str(gpu), str(gpu))
                        if gpu in checked.pooled:
                            continue                    # bound by the operator for guests: used as it is
                        out = passthrough.prepare(host, store, gpu, owner=me, actor=actor,
                                                  boot_vga_fix=f"run 'vgpuhost passthrough prepare --allow-boot-vga "
                                                               f"{gpu}' if the host has another console, then start "
                                                               "the domain (the hook uses a group bound that way)")
                        if out.changed:
                            made.append(("passthrough", gpu))
                # pinned first: an unpinned vGPU placed first could take the GPU a pinned one needs (one vGPU
                # per VM per GPU); admission decides in the same order
                for req in sorted(checked.vgpus, key=lambda r: r.gpu is None and r.vf is None):
                    # the inventory read above still describes the host while this call has changed nothing
                    decided = grant.placed_gpu(req.device) or mine_reserved.get(req.device)

                    def make(profile):
                        return _make_vgpu(host, store, view, req, profile,
                                          grant.allowed_gpus(req.device, checked.allowed), actor,
                                          inv if not made else domain_inventory(host, view, checked.allowed),
                                          grant.narrowed_by(req.device, checked.allowed), decided=decided)
                    try:
                        vid = make(types[req.device])
                        if not enforced and req.device in resized and types[req.device] != requested[req.device]:
                            _audit_resized(store, view, actor, {req.device: resized[req.device]}, None)
                    except RefusedError as e:
                        if enforced or types[req.device] == requested[req.device]:
                            # admission placed it: the device layer only re-checks, and its refusal is admission's
                            raise _audit_refused(store, view, actor, req.device, grant.refused(req.device, e)) \
                                from None
                        # no admission here (no tenancy): the advised profile found no room, the one asked may
                        _audit_resized(store, view, actor, {req.device: resized[req.device]}, e.message)
                        try:
                            vid = make(requested[req.device])
                        except RefusedError as again:
                            raise _audit_refused(store, view, actor, req.device, grant.refused(req.device, again)) \
                                from None
                    if vid is not None:
                        made.append(("claim", vid[6:]) if vid.startswith("claim:") else ("vgpu", vid))
            except BaseException as e:
                # undone inside the block: admission's record of the start (its allocation rows) goes only
                # once what was made is gone, so a kill during the undo leaves no device outside its quota.
                # What the records give the domain since the start counts too: an interrupt (the hook's
                # alarm) can land after a device's record was written and before it was noted in ``made``
                made += _made_unnoted(store, me, held_before, made)
                failed = _undo(host, store, me, made, actor)
                if failed and isinstance(e, VgpuhostError):
                    e.message += "; UNDO FAILED for " + ", ".join(failed)
                raise
    except BaseException:
        if not was_active:
            try:
                store.domain_stopped(me)
            except Exception:
                pass
        elif record_before is not None:
            try:
                store.domain_restore(me, record_before)
            except Exception:
                pass
        raise
    if mine_reserved:
        # made: the reservations migrate begin took for them are spent
        store.drop_reservations(owner=me, actor=actor, operation=f"prepare {view.name or me}", result="made")
    return [str(d) for _, d in made]


def _reservations(store: "StateStore", view: "DomainView", checked: "Checked") -> "Dict[str, PciAddress]":
    """``{device: GPU}`` of the devices reserved for ``view``'s incoming migration (migrate begin); raises
    RefusedError (exit 2) when a vGPU the domain asks for is reserved for another domain's migration."""
    rows = store.reservation_rows()
    if not rows:
        return {}
    from ..io.state import utcnow
    me = view.uuid
    now = utcnow()
    by_device = {r[0]: r for r in rows}
    for req in checked.vgpus:
        r = by_device.get(req.device)
        if r is not None and r[1] != me and r[6] >= now:          # an expired one holds nothing
            raise RefusedError(f"{req.device} is reserved for the incoming migration of domain {r[2]!r} "
                               f"until {r[6]}",
                               hint="start the domain once that migration ended, or give it another VF; "
                                    "'vgpuhost reconcile' frees an expired reservation")
    return {r[0]: PciAddress.parse(r[3]) for r in rows if r[1] == me}


def domain_gpus(host: HostRoot, view: "DomainView", allow: "Optional[FrozenSet[PciAddress]]") -> "Tuple[PciAddress, ...]":
    """The GPUs the devices ``view``'s metadata declares may use, sorted: each passthrough GPU, a pinned
    vGPU's GPU, a VF's physical function (its ``physfn`` link), and for a vGPU placed anywhere the
    hook allow-list ``allow`` or, without one, every NVIDIA GPU
    (:func:`vgpuhost.observe.inventory.nvidia_gpus`: two small reads per PCI function).  Reads no GPU."""
    from ..io.sysfs import Sysfs
    fs = Sysfs(host)
    meta = view.metadata
    out = set(meta.passthrough)
    anywhere = False
    for req in meta.vgpus:
        if req.vf is not None:
            name = fs.link_name(os.path.join(host.s.pci_device(req.vf), "physfn"))
            if name and PciAddress.is_valid(name):
                out.add(PciAddress.parse(name))
        elif req.gpu is not None:
            out.add(req.gpu)
        elif allow is not None:
            out |= allow
        else:
            anywhere = True
    if anywhere:
        from ..observe.inventory import nvidia_gpus
        out |= set(nvidia_gpus(fs))
    return tuple(sorted(out))


def domain_inventory(host: HostRoot, view: "DomainView", allow: "Optional[FrozenSet[PciAddress]]") -> "Inventory":
    """What ``prepare begin`` decides on: the GPUs :func:`domain_gpus` names, each read alone
    (:func:`vgpuhost.observe.inventory.discover_gpus`), and the PCI functions and mdevs the domain's
    hostdevs name (a VF the metadata names among them); host facts (every process's comm, modules,
    cpuinfo) only for passthrough's checks.  Cost: the GPUs the domain may use, not the host."""
    from ..io.sysfs import Sysfs
    from ..observe.inventory import discover_gpus
    meta = view.metadata
    named = tuple(view.pci_sources) + tuple(r.vf for r in meta.vgpus if r.vf is not None)
    return discover_gpus(Sysfs(host), domain_gpus(host, view, allow), named_pci=named,
                         named_mdevs=tuple(view.mdev_uuids), host_facts=bool(meta.passthrough))


def _check_undeclared(host: HostRoot, view: "DomainView", actor: str, store: "Optional[StateStore]") -> None:
    """``prepare begin`` of a domain whose metadata declares no device: refuse a GPU device it names
    (:mod:`vgpuhost.policy.hostdevs`), reading only the devices its hostdevs name and the records
    (no state store is made for a domain that passes)."""
    from ..io.sysfs import Sysfs
    from ..observe.inventory import discover_named
    from ..policy.hostdevs import REFUSED, classify
    inv = discover_named(Sysfs(host), tuple(view.pci_sources), tuple(view.mdev_uuids))
    if not view.mdev_uuids and all(v.outcome != REFUSED for v in classify(
            inv, view, declared_pci=frozenset(), allow=None, vgpu_records=(), passthrough_records=(),
            active_domains={})):
        return      # PCI functions only, none a GPU device (a NIC): no state store opened (sqlite's import)
    if store is None:
        store = open_store(host)
    records = store.vgpu_records() if store is not None else ()
    pt_records = store.passthrough_records() if store is not None and view.pci_sources else ()
    active = store.active_domains() if store is not None else {}
    if store is None:
        from ..io.state import StateStore
        store = _LazyStore(lambda: StateStore(host.s.state_dir, owned=lambda: _owned(host)))
    _refuse_hostdevs(store, view, actor, inv, allow=None, vgpu_records=records, passthrough_records=pt_records,
                     active_domains=active)


class _LazyStore:
    """A state store opened only when an audit row must be written (a refusal)."""

    def __init__(self, opener):
        self._opener = opener

    def audit(self, **kw) -> int:
        return self._opener().audit(**kw)


def _refuse_hostdevs(store, view: "DomainView", actor: str, inv: "Inventory", **facts) -> None:
    """:func:`vgpuhost.policy.hostdevs.check_hostdevs` on ``view``; a refusal gets its audit row
    (path ``(hostdevs)``, result ``refused``) and propagates (RefusedError, exit 2): nothing was made."""
    from ..policy.hostdevs import check_hostdevs, declared_functions
    try:
        check_hostdevs(inv, view, declared_pci=declared_functions(view, inv), **facts)
    except RefusedError as e:
        store.audit(actor=actor, operation=f"prepare {view.name or view.uuid}", path="(hostdevs)",
                    value=e.message, result="refused")
        e.audited = True
        raise


def _made_unnoted(store: "StateStore", me: str, before: "Tuple[FrozenSet[str], Optional[FrozenSet[str]]]",
                  made: "List[Tuple[str, object]]") -> "List[Tuple[str, object]]":
    """What the records give ``me`` that they did not ``before`` the start (``(vGPU ids, passthrough GPUs)``;
    GPUs None: the start asks for no passthrough) and ``made`` does not name, as :func:`_undo` takes it;
    empty when the store cannot be read (the journal then has it)."""
    noted = {str(d) for _, d in made}
    try:
        out: List[Tuple[str, object]] = []
        if before[1] is not None:
            gpus = {r.gpu for r in store.passthrough_records() if r.owner == me}
            out += [("passthrough", PciAddress.parse(g)) for g in sorted(gpus - before[1]) if g not in noted]
        out += [("claim" if r.pool is not None else "vgpu", r.id)
                for r in sorted(store.vgpu_records(owner=me), key=lambda r: r.id)
                if r.id not in before[0] and r.id not in noted]
    except Exception:
        return []
    return out


#: the metered window right-sizing reads (as ``advise``'s default) and the allocation it needs in it
RESIZE_WINDOW_S = 7 * 24 * 3600
RESIZE_MIN_ALLOC_S = 3600.0


def _right_size(store: "StateStore", view: "DomainView", inv: "Inventory", types: Dict[str, str],
                existing: "FrozenSet[str] | set" = frozenset()) -> "Dict[str, Tuple[str, str, str]]":
    """Right-sizing at restart (issue 30 item 5), for a domain whose metadata asks ``resize="auto"``:
    ``{device: (profile asked, profile advised, evidence)}`` for each of its vGPUs that ``advise``
    (:func:`vgpuhost.policy.usage.advise` over the domain's own metered rollups of the last 7 days)
    would move to a smaller profile of the same board and series that this host offers.  The advice is
    made for the profile asked now, over the history on any profile of its board, series and GI size
    (a run on the advised profile is evidence like one on the asked): the same use gives the same
    advice at every start (trial 10a finding 6), and it is never the profile asked or a larger one
    (finding 2).  Only at a start: a running VM is never changed.  Admission (quota, isolation, class,
    pool, placement) still decides on the advised profile; :class:`_ResizedOrAsked` falls back to the
    one asked.  A vGPU that exists already (``existing``: recorded ids, e.g. one a layout pre-created and
    lends) keeps its type."""
    import time as _time
    from ..io.state import usage_rows
    from ..model.values import VgpuProfile
    from ..policy.usage import Offer, advise
    since = _time.strftime("%Y-%m-%dT%H:00:00Z", _time.gmtime(_time.time() - RESIZE_WINDOW_S))
    rows = [r for r in usage_rows(store, since) if r.domain_uuid == view.uuid and r.device in types
            and r.device not in existing]
    if not rows:
        return {}
    offers: Dict[str, object] = {}
    for t in inv.vgpu_types:
        if t.framebuffer_mib:
            offers.setdefault(t.name.upper(), Offer(t.name, int(t.framebuffer_mib), t.max_instances))
    for _gpu, _tid, name, fb in store.seen_types():
        if fb:
            offers.setdefault(str(name).upper(), Offer(str(name), int(fb), None))

    def series(name: str):
        p = VgpuProfile.try_parse(name)
        return None if p is None else (p.board, p.series, p.gi_slices)

    # each device's rows on its asked profile's series, read as if metered on the asked profile: advise
    # then weighs the use against the asked framebuffer, and offers only profiles smaller than it
    asked_rows = []
    for r in rows:
        asked = types[r.device]
        if asked.upper() in offers and series(asked) is not None and series(r.profile) == series(asked):
            asked_rows.append(r._replace(profile=asked))
    if not asked_rows:
        return {}
    items, _ = advise(asked_rows, list(offers.values()), min_alloc_s=RESIZE_MIN_ALLOC_S)
    out: Dict[str, Tuple[str, str, str]] = {}
    for a in items:
        if a.action != "downsize" or not a.to or a.device not in types:
            continue
        old, new = types[a.device], a.to
        if series(new) != series(old) or offers[new.upper()].framebuffer_mib >= offers[old.upper()].framebuffer_mib:
            continue                # the same series only (same board, same letter class), and smaller
        out[a.device] = (old, new, a.reason)
    return out


def _audit_refused(store: "StateStore", view: "DomainView", actor: str, device: str, error: Exception) -> Exception:
    """``error`` after its audit row (path ``device``, result ``refused``): the device layer refused to place
    a vGPU of this start (nothing made, the start fails with exit 2), as admission's refusals get one."""
    if not getattr(error, "audited", False):
        store.audit(actor=actor, operation=f"prepare {view.name or view.uuid}", path=device,
                    value=getattr(error, "message", str(error)), result="refused")
        error.audited = True
    return error


def _audit_resized(store: "StateStore", view: "DomainView", actor: str,
                   resized: "Dict[str, Tuple[str, str, str]]", refused: "Optional[str]") -> None:
    """One audit row per vGPU right-sized at this start (result ``resized``), or, where admission
    refused the advised profiles (``refused``: why), one per vGPU that keeps the one asked
    (result ``resize-fallback``)."""
    for dev, (old, new, why) in sorted(resized.items()):
        if refused is None:
            store.audit(actor=actor, operation=f"prepare {view.name or view.uuid}", path=dev,
                        value=f"resize auto: {old} -> {new} ({why}; metered over the last 7 days)",
                        result="resized")
        else:
            store.audit(actor=actor, operation=f"prepare {view.name or view.uuid}", path=dev,
                        value=f"resize auto: {new} advised for {old} could not be placed ({refused}); "
                              f"started with {old} as asked", result="resize-fallback")


class _ResizedOrAsked:
    """Admission of the advised profiles, and where it refuses them, of the profiles asked (one
    ``resize-fallback`` audit row each); ``types`` is what was admitted once entered."""

    def __init__(self, block, advised, asked, resized, store, view, actor):
        self._block, self.types, self._asked = block, advised, asked
        self._resized, self._store, self._view, self._actor = resized, store, view, actor
        self._inner = None

    def __enter__(self):
        self._inner = self._block(self.types)
        try:
            grant = self._inner.__enter__()
        except RefusedError as e:
            _audit_resized(self._store, self._view, self._actor, self._resized, e.message)
            self.types = self._asked
            self._inner = self._block(self._asked)
            return self._inner.__enter__()
        _audit_resized(self._store, self._view, self._actor, self._resized, None)
        return grant

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


def _resolve_profiles(inv: "Inventory", store: "StateStore", checked: "Checked",
                      host: "Optional[HostRoot]" = None) -> Dict[str, str]:
    """``{device: vGPU type name as this host's devices spell it}`` for each vGPU ``checked`` asks for:
    its profile resolved once, before any write, on its pinned GPU / its VF's GPU (else the host).
    Admission and create take these names and do not resolve again.  ``host``: where an unpinned
    profile ``inv`` (the domain's GPUs alone) does not know is looked up on every GPU of the host before
    it is refused.  Raises InputError for a profile this host does not know there."""
    from ..policy.offers import resolve_profile, seen_rows
    records = store.vgpu_records()
    rows = seen_rows(inv)
    # remembered before this start changes the host: a GPU it passes through lists no types afterwards,
    # and a vGPU asked of that GPU is then refused as not placeable, not as an unknown profile
    store.remember_types(rows)
    seen = store.seen_types() + rows
    out: Dict[str, str] = {}
    wider = None
    # GPUs opted in to MIG on demand: an unknown MIG-backed profile there lost the instance its start made
    on_demand = (frozenset(k.split("/", 1)[1] for k, v in store.settings_under("mig.on-demand/").items() if v == "on")
                 if any(getattr(r.profile, "mig_backed", False) for r in checked.vgpus) else frozenset())
    for req in checked.vgpus:
        gpu = req.gpu
        if req.vf is not None:
            dev = inv.devices.get(req.vf)
            gpu = dev.physfn if dev is not None else None
        try:
            out[req.device] = resolve_profile(inv, records, str(req.profile), gpu, seen, on_demand=on_demand)
        except InputError:
            if gpu is not None or host is None:
                raise
            # ``inv`` holds only the GPUs the domain may use (the allow-list's): a profile the host's
            # other GPUs offer is known, and its placement refusal names what narrowed it.  Read on
            # this refusal path only
            if wider is None:
                from ..io.sysfs import Sysfs
                from ..observe.inventory import discover_gpus, nvidia_gpus
                fs = Sysfs(host)
                wider = discover_gpus(fs, nvidia_gpus(fs), host_facts=False)
            out[req.device] = resolve_profile(wider, records, str(req.profile), None, seen + seen_rows(wider))
    return out


def _make_vgpu(host: HostRoot, store: "StateStore", view: "DomainView", req, profile: str, allowed, actor: str,
               inv: "Optional[Inventory]" = None,
               narrowed_by: str = ALLOW_LIST,
               decided: "Optional[PciAddress]" = None) -> Optional[str]:
    """Create one requested vGPU; its id when this call made it (``claim:ID`` when it was lent
    from the layout's pool), None when the domain already held it.

    The pool model first: a vGPU the layout pre-created that the domain names (its mdev
    UUID, ``attach --uuid``, or its VF) is claimed as it is, with no write; otherwise, when
    the layout holds a free one of the wanted profile on a GPU the domain may use, its slot
    is handed over (the pool's mdev is removed, the domain's UUID created there, and the
    domain's vGPU counts as the layout's, given back at release).  Only then is a vGPU
    created from free capacity.

    ``profile``: the request's type name as the host's devices spell it (:func:`_resolve_profiles`):
    created as it is, not resolved again.
    ``inv``: a current inventory of the host, for the first placement look (None: read it anew).
    ``decided``: the GPU admission placed the vGPU on: a vGPU made from free capacity is made there,
    the placement only re-checked under the GPU lock (None: placed here, once); a pool's vGPU is lent
    there too (admission places a vGPU first where the layout has one to lend).  Without a decision
    (tenancy not in use) a pool's vGPU is lent from any GPU ``allowed``: lending takes no new capacity.
    """
    from . import vgpu
    meta = view.metadata
    me = view.uuid
    wanted_id = str(req.vf) if req.vf is not None else req.uuid
    if wanted_id is not None and vgpu.claim(host, store, wanted_id, owner=me, profile=profile,
                                            actor=actor) is not None:
        return "claim:" + wanted_id
    if (req.vf is None and req.uuid is not None and not any(r.id == req.uuid for r in store.vgpu_records())
            and not _defined_in_mdevctl(host, req.uuid)):
        # lent where admission placed it (its decision and audit row name that GPU), else from any allowed GPU
        swapped = _swap_from_pool(host, store, view, req, profile,
                                  frozenset({decided}) if decided is not None else allowed, actor)
        if swapped is not None:
            return swapped
    if req.vf is not None:
        out = vgpu.create(host, store, profile=profile, vf=req.vf, owner=me, strategy=meta.strategy,
                          anti_affinity=meta.anti_affinity, actor=actor, inventory=inv, resolved=True)
        return out.id if out.changed else None
    rec = next((r for r in store.vgpu_records(owner=me) if r.id == req.uuid), None)
    if rec is not None:
        from ..io.sysfs import Sysfs
        from ..io.vgpudev import mdev_current_type
        current = mdev_current_type(Sysfs(host), req.uuid)
        if current == rec.type_id and rec.type_name.lower() == profile.lower():
            return None                         # a retried start: the domain already holds it
        # stale (gone since, e.g. a host reboot) or the profile changed while stopped: make it anew
        vgpu.remove(host, store, req.uuid, owner=me, actor=actor, while_running=True)
        inv = None                              # the host changed
    try:
        try:
            out = vgpu.create(host, store, profile=profile, uuid=req.uuid, gpu=req.gpu or decided, owner=me,
                              strategy=meta.strategy, anti_affinity=meta.anti_affinity, allowed_gpus=allowed,
                              actor=actor, inventory=inv, resolved=True)
        except GpuFailedError as e:
            if req.gpu is not None or decided is None:
                raise           # pinned by the domain (it cannot move), or placed by create itself (it retried)
            # admission placed it on a GPU that failed (now marked unhealthy): a new placement among admission's
            # candidates, under the same host lock, with its own audit row; the allocation follows the record
            store.audit(actor=actor, operation=f"prepare {view.name or me}", path="(placement)",
                        value=f"{e.message} (marked unhealthy); placed again among admission's candidates",
                        result="re-placed")
            try:
                out = vgpu.create(host, store, profile=profile, uuid=req.uuid, gpu=None, owner=me,
                                  strategy=meta.strategy, anti_affinity=meta.anti_affinity,
                                  allowed_gpus=allowed, actor=actor, inventory=None, resolved=True)
            except RefusedError as r:
                # a device write failed (exit 3): said as such, with why no other candidate takes it
                e.message += f" (marked unhealthy); no other GPU takes it: {r.message}"
                raise e from None
            out.notes.append(f"{e.message} (marked unhealthy); created on {out.gpu} instead")
    except RefusedError as e:
        if allowed is None:
            raise
        raise RefusedError(e.message, hint=placed_only_on(allowed, narrowed_by)) from None
    return out.id


def placed_only_on(allowed: "FrozenSet[PciAddress]", narrowed_by: str = ALLOW_LIST) -> str:
    """The hint of a vGPU placement refused where ``allowed`` (the hook allow-list, or admission's
    candidates within it: ``narrowed_by`` says which) narrowed the GPUs: ``prepare begin``'s, and
    ``migrate begin``'s for the same refusal."""
    listed = ", ".join(sorted(map(str, allowed))) or "none"
    return f"{narrowed_by} lets the hook place vGPUs only on: {listed}"


def _defined_in_mdevctl(host: HostRoot, uuid: str) -> bool:
    """An mdevctl definition names ``uuid``: the vGPU is created as it says (or refused), never
    swapped in from the layout's pool."""
    from ..io.sysfs import Sysfs
    fs = Sysfs(host)
    return any(fs.exists(os.path.join(host.s.mdevctl_d, p, uuid)) for p in fs.listdir(host.s.mdevctl_d))


def _swap_from_pool(host: HostRoot, store: "StateStore", view: "DomainView", req, profile: str, allowed,
                    actor: str) -> Optional[str]:
    """Hand a free pool vGPU of type ``profile`` (as resolved) a slot for the domain's mdev UUID;
    ``claim:UUID``, or None (no free one)."""
    from . import vgpu
    me = view.uuid
    for rec in vgpu.pool_candidates(store, profile=profile, gpu=req.gpu, allowed=allowed, owner=me):
        try:
            vgpu.remove(host, store, rec.id, owner=rec.owner, actor=actor)
        except VgpuhostError:
            continue                    # taken or busy meanwhile: the next one
        try:
            vgpu.create(host, store, profile=rec.type_name, uuid=req.uuid, gpu=PciAddress.parse(rec.gpu),
                        owner=rec.owner, actor=actor)
        except VgpuhostError:
            # give the pool its vGPU back where it was, then try the next one
            vgpu.create(host, store, profile=rec.type_name, uuid=rec.id if rec.backend == Backend.MDEV else None,
                        gpu=PciAddress.parse(rec.gpu), owner=rec.owner, actor=actor)
            continue
        if vgpu.claim(host, store, req.uuid, owner=me, profile=profile, pool=rec.owner, actor=actor):
            return "claim:" + req.uuid
    return None


def _undo(host: HostRoot, store: "StateStore", me: str, made: List[Tuple[str, object]], actor: str) -> List[str]:
    """Remove what this prepare made, last first; the ids that could not be undone."""
    old = None
    try:
        old = signal.signal(signal.SIGTERM, signal.SIG_IGN)     # let the undo finish
    except ValueError:
        pass
    failed = []
    try:
        for kind, dev in reversed(made):
            try:
                if kind == "claim":
                    from . import vgpu
                    vgpu.give_back(host, store, str(dev), owner=me, actor=actor)
                elif kind == "vgpu":
                    from . import vgpu
                    vgpu.remove(host, store, str(dev), owner=me, actor=actor, while_running=True)
                else:
                    from . import passthrough
                    passthrough.release(host, store, dev, owner=me, actor=actor, while_running=True)
            except Exception as e:
                failed.append(f"{dev} ({e})")
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return failed


def release(host: HostRoot, view: "DomainView", *, actor: str, store: "Optional[StateStore]" = None) -> List[str]:
    """Remove the vGPUs and release the groups the domain holds; forget the domain.

    A domain that holds nothing (a start that never happened, a second
    release) is a no-op; no state store is created for it.  Every device is
    tried; the first failure raises DeviceError naming how many failed.
    ``store``: the state store already open on ``host.state_dir`` (the
    agent's), instead of opening it for this call.
    """
    if store is None:
        store = open_store(host)
        if store is None:
            return []
    return release_domain(host, store, view.uuid, actor=actor)


def open_store(host: HostRoot) -> "Optional[StateStore]":
    """The state store on ``host.state_dir`` when there is one (``state.db`` exists), else None: a domain
    with nothing recorded needs no store created for it."""
    from ..io.files import is_file
    from ..io.state import DB_NAME, StateStore
    if not is_file(os.path.join(host.s.state_dir, DB_NAME)):
        return None
    return StateStore(host.s.state_dir, owned=lambda: _owned(host))


def release_domain(host: HostRoot, store: "StateStore", me: str, *, actor: str) -> List[str]:
    """``release end`` for the domain with UUID ``me``: see :func:`release`; the ids released.

    An operation of this domain's that was interrupted (its ``prepare begin`` killed half-way) is
    finished or rolled back first, under its locks, so what it made is released too, not left behind
    unowned until a ``reconcile``."""
    done: List[str] = []
    errors: List[str] = []
    mine = [e for e in store.journal_entries(open_only=True) if e.owner == me]
    if mine:
        from .recover import recover_devices
        ended = recover_devices(host, store, {str(d.get("id") or d.get("bdf")) for e in mine for d in e.devices}
                                or {e.gpu for e in mine}, actor=actor)
        left = [r for r in ended if r.owner == me and r.result not in ("finished", "rolled-back")]
        if left:
            # what the interrupted start made is still on the host and this domain's: keep the domain
            # recorded (its marker too), so the next stop or 'reconcile' tries again
            raise DeviceError("release could not end this domain's interrupted operation: "
                              + "; ".join(r.line() for r in left),
                              hint="its devices stay held and the domain recorded; fix the cause (the audit log "
                                   "names the failed write), then run 'vgpuhost reconcile'")
    recs = store.vgpu_records(owner=me)
    if recs:
        from . import vgpu
        for r in reversed(recs):
            try:
                if r.pool is not None and vgpu.give_back(host, store, r.id, owner=me, actor=actor):
                    done.append(r.id)           # lent from the layout's pool: it goes back, not away
                    continue
                vgpu.remove(host, store, r.id, owner=me, actor=actor, while_running=True)
                done.append(r.id)
            except VgpuhostError as e:
                errors.append(f"{r.id}: {e.message}")
    gpus = sorted({r.gpu for r in store.passthrough_records() if r.owner == me})
    if gpus:
        from . import passthrough
        for g in gpus:
            try:
                passthrough.release(host, store, PciAddress.parse(g), owner=me, actor=actor, while_running=True)
                done.append(g)
            except VgpuhostError as e:
                errors.append(f"{g}: {e.message}")
    # what an incoming migration reserved for it and never made (a migration cancelled or failed on this
    # destination: libvirt's release end): freed
    store.drop_reservations(owner=me, actor=actor, operation=f"release {me}")
    # GPU instances made on demand for it (MIG on demand): destroyed once its vGPUs are gone; and those
    # another domain's vGPU kept busy at their owner's stop (empty once it went: migdemand.release_for)
    if store.settings_under("mig.made/"):
        from . import migdemand
        errors += migdemand.release_for(host, store, me, actor=actor)
    # and its allocations (ops.tenancy.forget, without importing admission, its module's, on the hook's
    # release path), in the same transaction
    store.domain_stopped(me, allocations=True)
    if errors:
        raise DeviceError(f"release left {len(errors)} device(s) held: " + "; ".join(errors),
                          hint="they stay recorded for this domain; fix the cause and run "
                               "'vgpuhost vgpu remove ID --owner UUID' / 'vgpuhost passthrough release BDF'")
    return done


def _owned(host):
    """Devices vgpuhost may own (read only when state.db is an empty file)."""
    from ..observe.ownable import devices_vgpuhost_may_own
    return devices_vgpuhost_may_own(host)

