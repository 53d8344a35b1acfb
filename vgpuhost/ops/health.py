"""GPU health: take a failed GPU out of service, cordon and uncordon by hand, say what a drain needs.

Owns: the state store's ``gpu_health`` rows as operations see them
(:func:`out_of_service`, :func:`in_service`: an inventory whose out-of-service
GPUs offer nothing, so placement, ``types``, ``capacity``, the exporter's
free-instance series and with them the fleet view leave them out), recording a
transition (:func:`mark_unhealthy`, audited once), the checks (:func:`check_gpu`:
the PCI tree and NVML; :func:`watch_once`: every known GPU plus NVML's Xid
events, what the agent runs continuously; :func:`quick_check`: the cheap one
each CLI operation runs), and the operator's ``gpu cordon|uncordon|drain``.
The signals and their sources are :mod:`vgpuhost.policy.health`'s.
Must not: stop a VM or remove a device a domain holds (a drain only lists what
each domain needs to move); import anything heavy at module level (the qemu
hook's start calls :func:`in_service` and :func:`mark_unhealthy`).
"""

from __future__ import annotations

import errno

from ..io.hostroot import HEALTH_MARKER, HostRoot
from ..model.errors import InputError, RefusedError
from ..model.kinds import Owner
from ..model.values import PciAddress
from ..policy import health as hp

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, Iterable, List, Optional, Tuple
    from ..io.state import StateStore
    from ..observe.inventory import Inventory

#: the audit operation of every health transition
OPERATION = "gpu health"
#: how long the agent's watch waits for an NVML event per round (ms); its periodic check runs between
WATCH_EVENT_WAIT_MS = 1000
#: the agent's periodic check (seconds): the tree and GPU_IS_LOST of every known GPU
WATCH_INTERVAL_S = 10.0


def out_of_service(store: "StateStore") -> "Dict[PciAddress, str]":
    """``{GPU: reason line}`` of every GPU out of service (one query); a cordon by hand says so."""
    out = {}
    for gpu, reason, source, _time, by_hand in store.gpu_health_rows():
        what = ("cordoned by hand" if source == hp.Source.OPERATOR else
                "unhealthy (cordoned by hand)" if by_hand else "unhealthy")
        out[PciAddress.parse(gpu)] = f"{what}: {reason}"
    return out


def refuse_out_of_service(store: "StateStore", gpu: PciAddress, *, what: str, actor: str,
                          operation: str, audit: bool = True) -> None:
    """Refuse ``what`` (``pass it through``) on ``gpu`` while it is out of service (unhealthy or cordoned):
    RefusedError (exit 2) naming the GPU and why, after one audit row (path ``(health) BDF``, result
    ``refused``) where ``audit``; nothing else changed.  Returns quietly for a GPU in service."""
    rows = store.gpu_health_rows(str(gpu))
    if not rows:
        return
    line = out_of_service(store).get(gpu) or rows[0][1]
    if audit:
        store.audit(actor=actor, operation=operation, path=f"(health) {gpu}", value=f"{what}: out of service",
                    result="refused")
    e = RefusedError(f"cannot {what}: {gpu} is out of service ({line})",
                     hint=f"use another GPU, or repair it and run 'vgpuhost gpu uncordon {gpu}'; nothing was changed")
    e.audited = bool(audit)
    raise e


#: beside state.db while a GPU may be out of service or a VF be reserved for an incoming migration:
#: written before a health row (or a reservation) is, removed once no health row and no reservation is
#: left, so the lean read commands (``types``, which load no SQLite) read the store only when it may matter
MARKER = HEALTH_MARKER


def _marker(state_dir) -> str:
    import os.path
    return os.path.join(str(state_dir), MARKER)


def _set_marker(store: "StateStore") -> None:
    from pathlib import Path
    from ..io.files import exists, write_atomic
    path = _marker(store.dir)
    if exists(path):
        return
    try:
        write_atomic(Path(path), "GPUs out of service are listed in state.db (gpu_health)\n", 0o600)
    except OSError:
        if not exists(path):        # another process writing it at the same time is fine: it is there
            raise


def _clear_marker(store: "StateStore") -> None:
    if not store.gpu_health_rows() and not store.reservation_rows():      # a reservation needs it too
        from ..io.files import remove
        remove(_marker(store.dir))


def in_service_at(inv: "Inventory", state_dir, host: "Optional[HostRoot]" = None) -> "Inventory":
    """:func:`in_service` for a command that has no store open: the store under ``state_dir`` is opened
    (never created) only when its marker says a GPU may be out of service; ``inv`` itself otherwise.
    With ``host``, a GPU NVML reports lost now (:func:`lost_now`, not recorded yet) is left out too, as
    the exporter and ``host check`` leave it out (trial 5 finding 8)."""
    from ..io.files import exists
    lost = {g: f"unhealthy: {reason} (not recorded yet)" for g, reason in lost_now(host, inv).items()} \
        if host is not None else {}
    store = None
    if exists(_marker(state_dir)):
        from ..io.state import StateStore
        store = StateStore(state_dir, create=False)
        if store.absent:
            store = None
    if store is None:
        if not lost:
            return inv
        from ..observe.inventory import Inventory
        return Inventory(devices=inv.devices, groups=inv.groups, gpus=inv.gpus, vgpu_types=inv.vgpu_types,
                         mdevs=inv.mdevs, vf_vgpus=inv.vf_vgpus, host=inv.host,
                         out_of_service={**lost, **inv.out_of_service})
    return in_service(inv, store, lost)


def lost_now(host: HostRoot, inv: "Inventory", nvml=None, skip=()) -> "Dict[PciAddress, str]":
    """``{GPU: reason}`` of each GPU of ``inv`` on the nvidia driver, not in ``skip`` nor out of service,
    that NVML reports lost now (GPU_IS_LOST; one cheap query per GPU; ``nvml`` None: opened here, and
    nothing where NVML cannot be had).  The one NVML word on "out of service now" that capacity,
    ``types``, placement (:func:`quick_check` records it), the exporter (:func:`unrecorded_failures`)
    and ``host check`` share."""
    gpus = [g.address for g in inv.gpus if g.pci.driver == "nvidia" and g.address not in inv.out_of_service
            and g.address not in skip]
    if not gpus:
        return {}
    nvml = nvml if nvml is not None else nvml_or_none(host)
    out: "Dict[PciAddress, str]" = {}
    for g in sorted(gpus) if nvml is not None else ():
        try:
            lost = nvml.gpu_lost(g)
        except Exception:       # NVML unreadable for this GPU: the tree decides
            continue
        if lost:
            out[g] = hp.LOST_REASON
    return out


def in_service(inv: "Inventory", store: "Optional[StateStore]",
               also: "Optional[Dict[PciAddress, str]]" = None, *, owner: "Optional[str]" = None) -> "Inventory":
    """``inv`` with :attr:`Inventory.out_of_service` set from the store: those GPUs offer no free instance
    (:func:`vgpuhost.observe.inventory.free_instances`), so no placement, ``types --available``,
    ``capacity`` count or exporter series offers them.  ``also``: ``{GPU: reason line}`` of more GPUs to
    leave out (the exporter's :func:`unrecorded_failures`, which it does not record).  Likewise the
    vendor-VFIO VFs reserved for an incoming live migration (:func:`reserved_vfs`; ``owner``: a domain
    UUID whose own reservations stay free, its incoming start or its repeated ``migrate begin``) list no
    type and count as holding the reserved type (:attr:`Inventory.reserved`).  ``inv`` itself when
    nothing is out of service or reserved, or there is no store (no copy)."""
    if store is None:
        return inv
    oos = {**(also or {}), **out_of_service(store)}
    reserved = reserved_vfs(store, inv, owner)
    if not oos and not inv.out_of_service and not reserved and not inv.reserved:
        return inv
    from ..observe.inventory import Inventory
    types = inv.vgpu_types if not reserved else tuple(t for t in inv.vgpu_types if t.parent not in reserved)
    out = Inventory(devices=inv.devices, groups=inv.groups, gpus=inv.gpus, vgpu_types=types,
                    mdevs=inv.mdevs, vf_vgpus=inv.vf_vgpus, host=inv.host, out_of_service=oos, reserved=reserved)
    if not reserved and not inv.reserved:
        # the same rows, mdevs and VFs: inv's caches of them (its rows by GPU, its GpuIndex per GPU, neither
        # of which looks at out_of_service) serve the copy, not built again for every start's look
        for cache in ("_runs", "_index"):
            kept = inv.__dict__.get(cache)
            if kept is not None:
                object.__setattr__(out, cache, kept)
    return out


def reserved_vfs(store: "StateStore", inv: "Inventory", owner: "Optional[str]" = None) -> "Dict[PciAddress, str]":
    """``{VF: type id}`` of the free vendor-VFIO VFs of ``inv`` that an incoming migration (not ``owner``'s)
    reserved and that have not expired (one query; ``{}`` on a store without reservations).  The type id
    is the reserved profile's as the VF's GPU lists it (or listed it: the store's seen types)."""
    if store.absent:
        return {}
    rows = [r for r in store.reservation_rows() if r[4] == "vf" and r[1] != owner]
    if not rows:
        return {}
    from ..io.state import utcnow
    now = utcnow()
    free = {v.vf: v for v in inv.vf_vgpus if not v.type_id}
    out: "Dict[PciAddress, str]" = {}
    seen = None
    for device, _owner, _name, gpu, _kind, profile, expires, *_rest in rows:
        if expires < now:
            continue                # an expired reservation holds nothing ('vgpuhost reconcile' drops it)
        try:
            vf = PciAddress.parse(device)
        except InputError:
            continue
        if vf not in free:
            continue                # made already (prepare begin), or not on this host's tree
        tid = next((t.type_id for t in inv.vgpu_types if str(t.gpu) == gpu and t.name.lower() == profile.lower()),
                   None)
        if tid is None:
            seen = store.seen_types() if seen is None else seen
            tid = next((str(r[1]) for r in seen if r[0] == gpu and str(r[2]).lower() == profile.lower()), None)
        if tid is None:
            tid = _catalog_type_id(inv, free[vf].gpu, profile)     # a MIG-backed type on demand: not listed yet
        out[vf] = tid or ""
    return out


def _catalog_type_id(inv: "Inventory", gpu: PciAddress, profile: str) -> "Optional[str]":
    """The vendor-VFIO type id of ``profile`` on ``gpu``'s board from the catalog (what MIG on demand
    lists, :func:`vgpuhost.ops.migdemand.makeable`); None when the board or the type is not known."""
    g = inv.gpu(gpu)
    if g is None:
        return None
    from ..io.catalog import load_catalog
    for m in load_catalog().gpus.values():
        if m.ids.device == g.pci.device:
            return next((str(t.type_id) for t in m.vgpu_types if t.name.lower() == profile.lower()), None)
    return None


def mark_unhealthy(store: "StateStore", gpu: PciAddress, reason: str, source: str, *, actor: str,
                   operation: str = OPERATION) -> bool:
    """Record ``gpu`` unhealthy (``source``: a :class:`vgpuhost.policy.health.Source`) with one audit row
    (path ``(health) BDF``, value the reason, result ``unhealthy``); True when this was a transition,
    False when the GPU had failed already (its row and reason kept: the first failure is what the
    operator needs).  A GPU cordoned by hand that fails now records the failure and stays cordoned."""
    def failed_already(rows) -> bool:
        return bool(rows) and rows[0][2] != hp.Source.OPERATOR
    if failed_already(store.gpu_health_rows(str(gpu))):
        return False
    _set_marker(store)
    with store.transaction() as conn:
        rows = store.gpu_health_rows(str(gpu))
        if failed_already(rows):
            return False
        store.put_gpu_health(conn, str(gpu), reason, source, bool(rows))
        store.audit(actor=actor, operation=operation, path=f"(health) {gpu}", value=f"{source}: {reason}",
                    result="unhealthy", conn=conn)
    return True


def failed_write(store: "StateStore", gpu: PciAddress, e: BaseException, what: str, *, actor: str,
                 operation: str) -> "Optional[str]":
    """After a device write on ``gpu`` failed with ``e`` (a SysfsError from a driver-binding write, an
    NvmlError from a MIG or scheduler call): when it means the GPU itself failed
    (:func:`vgpuhost.policy.health.write_failure`: EIO/ENODEV, NVML GPU_IS_LOST), record the GPU
    unhealthy (:func:`mark_unhealthy`, one audit row) and return the reason (``binding 0000:41:00.0 to
    vfio-pci on 0000:41:00.0 failed: EIO``); None, recording nothing, when the write was refused for the
    request.  The one place the passthrough, MIG and scheduler operations classify their failed writes
    (a vGPU create's is :func:`vgpuhost.ops.vgpu.gpu_failed`, on the same policy)."""
    nvml_name = getattr(e, "nvml_name", None)
    err = getattr(e, "errno", None)
    source = hp.write_failure(err if isinstance(err, int) else None, nvml_name)
    if source is None:
        return None
    if nvml_name is not None:
        reason = f"{what} on {gpu} failed: GPU_IS_LOST"
    else:
        reason = hp.errno_reason(err, gpu, what)
    mark_unhealthy(store, gpu, reason, source, actor=actor, operation=operation)
    return reason


#: what a refusal whose write marked the GPU unhealthy adds to its line
MARKED = " (the GPU is marked unhealthy and left out of placement)"


def check_gpu(host: HostRoot, gpu: PciAddress, nvml=None) -> "List[Tuple[str, str]]":
    """What is wrong with ``gpu`` now: ``[(source, reason)]``, empty when healthy.  Reads the PCI tree
    (the device's directory and its ``vendor`` attribute: EIO/ENODEV there is the failure itself), the
    device back (a fresh read of the GPU's vGPU and driver attributes, :func:`device_read_failure`:
    EIO/ENODEV from any of them) and, with ``nvml`` (an :class:`vgpuhost.io.nvml.NvmlBackend`),
    GPU_IS_LOST."""
    from ..io.sysfs import Sysfs
    from ..model.errors import SysfsError
    fs = Sysfs(host)
    path = host.s.pci_device(gpu)
    if not fs.exists(path):
        return [(hp.Source.PCI, hp.GONE_REASON)]
    out = []
    try:
        fs.read_attr(path + "/vendor")
    except SysfsError as e:
        if hp.is_unhealthy_errno(e.errno):
            out.append((hp.Source.IO, hp.errno_reason(e.errno, gpu, "reading vendor")))
    if not out:
        failed = device_read_failure(host, gpu)
        if failed:
            out.append((hp.Source.IO, failed))
    if nvml is not None:
        try:
            if nvml.gpu_lost(gpu):
                out.append((hp.Source.NVML, hp.LOST_REASON))
        except Exception:       # NVML unreadable for this GPU (not on nvidia): the tree decides
            pass
    return out


def device_read_failure(host: HostRoot, gpu: PciAddress) -> "Optional[str]":
    """Read ``gpu`` back (:func:`vgpuhost.observe.inventory.discover_gpu`: its vGPU types, instances and
    driver attributes, and those of its VFs): the reason line of the first read that failed with EIO or
    ENODEV, None when every read answered (other errnos are refusals, not the GPU failing)."""
    from ..io.sysfs import Sysfs
    from ..model.errors import SysfsError
    from ..observe.inventory import discover_gpu
    try:
        one = discover_gpu(Sysfs(host), gpu, host_facts=False)
    except SysfsError as e:
        if hp.is_unhealthy_errno(e.errno):
            return hp.errno_reason(e.errno, gpu, f"reading {host.relative(e.path) if e.path else 'the device'}")
        return None
    failures = read_failures(one)
    return failures[0][1] if failures else None


def known_gpus(store: "StateStore", inv: "Optional[Inventory]" = None) -> "List[PciAddress]":
    """Every GPU vgpuhost knows of: the inventory's, and those the store remembers (types seen, vGPUs
    and passthrough recorded, health rows), sorted."""
    seen = {row[0] for row in store.seen_types()} | {r.gpu for r in store.vgpu_records()}
    seen |= {r.gpu for r in store.passthrough_records()} | {row[0] for row in store.gpu_health_rows()}
    out = {PciAddress.parse(g) for g in seen}
    if inv is not None:
        out |= {g.address for g in inv.gpus}
    return sorted(out)


def read_failures(inv: "Inventory") -> "List[Tuple[PciAddress, str]]":
    """``[(GPU, reason)]`` for each GPU whose device read failed with EIO or ENODEV in this discovery (a
    vGPU attribute of the GPU or one of its VFs, :attr:`Gpu.unreadable`): the read failing is the GPU's."""
    out = []
    for g in inv.gpus:
        for u in g.unreadable:
            err = getattr(errno, u.errno_name, None)
            if hp.is_unhealthy_errno(err):
                out.append((g.address, f"reading {u.attribute} of {u.device} failed: {u.errno_name}"))
                break
    return out


def unrecorded_failures(host: HostRoot, store: "StateStore", inv: "Inventory",
                        nvml=None) -> "Dict[PciAddress, Tuple[str, str]]":
    """``{GPU: (source, reason)}`` of each GPU failing now that no failure row records yet (a cordon by hand
    alone records none), read without writing anything: what the exporter serves without the agent
    (docs/metering.md#gpu-health-in-the-exporter).  Looks at: a GPU the store remembers that is gone from the PCI tree
    (``pci``), a device read of ``inv`` that failed with EIO/ENODEV (``io``, :func:`read_failures`), and,
    with ``nvml``, GPU_IS_LOST of each GPU of ``inv`` (``nvml``; one cheap NVML query per GPU)."""
    from ..io.sysfs import Sysfs
    failed = {row[0] for row in store.gpu_health_rows() if row[2] != hp.Source.OPERATOR}
    present = {g.address for g in inv.gpus}
    fs = Sysfs(host)
    out: "Dict[PciAddress, Tuple[str, str]]" = {}
    for g in known_gpus(store):
        if str(g) not in failed and g not in present and not fs.exists(host.s.pci_device(g)):
            out[g] = (hp.Source.PCI, hp.GONE_REASON)
    for g, reason in read_failures(inv):
        if str(g) not in failed:
            out.setdefault(g, (hp.Source.IO, reason))
    if nvml is not None:
        skip = {g for g in present if str(g) in failed or g in out}
        for g, reason in lost_now(host, inv, nvml, skip).items():
            out[g] = (hp.Source.NVML, reason)
    return out


def quick_check(host: HostRoot, store: "Optional[StateStore]", inv: "Inventory", *, actor: str,
                whole: bool = True) -> "List[dict]":
    """The check each CLI operation runs (cheap: one query per table): a GPU the store remembers that is
    gone from the PCI tree, a GPU whose device read failed with EIO/ENODEV in ``inv``
    (:func:`read_failures`), and, ``whole`` only, a GPU NVML reports lost (:func:`lost_now`: one NVML
    query per GPU), are marked unhealthy.  ``whole`` False: ``inv`` holds only the GPUs the
    operation may use (the qemu hook reads no other GPU's path), so only its read failures are looked at;
    the agent's watch and the next whole-host read find a GPU gone.  Returns the transitions
    (:func:`watch_once`'s shape)."""
    if store is None:
        return []
    out = []
    failures = read_failures(inv)
    if not failures and not whole:
        return out                       # the hook's usual start: no read failed, no query
    marked = {row[0] for row in store.gpu_health_rows() if row[2] != hp.Source.OPERATOR}   # failed already
    for addr, reason in failures:
        if str(addr) not in marked and mark_unhealthy(store, addr, reason, hp.Source.IO, actor=actor):
            out.append({"gpu": str(addr), "source": hp.Source.IO, "reason": reason})
            marked.add(str(addr))
    if not whole:
        return out
    # NVML's GPU_IS_LOST (lost_now): the operation that sees it records it, so capacity, types and the
    # exporter agree with what it does (trial 5 finding 8)
    for addr, reason in lost_now(host, inv, skip={PciAddress.parse(g) for g in marked}).items():
        if mark_unhealthy(store, addr, reason, hp.Source.NVML, actor=actor):
            out.append({"gpu": str(addr), "source": hp.Source.NVML, "reason": reason})
            marked.add(str(addr))
    present = set(inv.devices) | {g.address for g in inv.gpus}
    seen = {row[0] for row in store.seen_types()} | {r.gpu for r in store.vgpu_records()}
    from ..io.sysfs import Sysfs
    fs = Sysfs(host)
    for g in sorted(seen - marked):
        addr = PciAddress.parse(g)
        if addr in present or fs.exists(host.s.pci_device(addr)):
            continue
        if mark_unhealthy(store, addr, hp.GONE_REASON, hp.Source.PCI, actor=actor):
            out.append({"gpu": g, "source": hp.Source.PCI, "reason": hp.GONE_REASON})
    return out


def watch_once(host: HostRoot, store: "StateStore", nvml, *, actor: str, inv: "Optional[Inventory]" = None,
               event_wait_ms: int = 0, check: bool = True, also: "Iterable[PciAddress]" = ()) -> "List[dict]":
    """One round of the agent's watch: NVML's critical Xid events (waiting up to ``event_wait_ms`` for the
    first), then :func:`check_gpu` of every known GPU in service; each new failure recorded
    (:func:`mark_unhealthy`).  Returns the transitions: ``[{gpu, source, reason}]``.  ``nvml`` None:
    the tree alone (no NVML on this host).  ``check`` False: the events only (between periodic checks).
    ``also``: GPUs to watch beside :func:`known_gpus` (those the agent's earlier checks found in the tree)."""
    gpus = sorted(set(known_gpus(store, inv)) | set(also))
    marked = {PciAddress.parse(row[0]) for row in store.gpu_health_rows() if row[2] != hp.Source.OPERATOR}
    found: "List[Tuple[PciAddress, str, str]]" = []
    if nvml is not None:
        try:
            events = nvml.xid_events([g for g in gpus if g not in marked], event_wait_ms)
        except Exception:       # the event set could not be read: the periodic check still runs
            events = []
        found += [(g, hp.Source.NVML, hp.xid_reason(x)) for g, x in events if hp.is_critical_xid(x)]
    for g in gpus if check else ():
        if g not in marked:
            found += [(g, source, reason) for source, reason in check_gpu(host, g, nvml)]
    if check and inv is not None:
        found += [(g, hp.Source.IO, reason) for g, reason in read_failures(inv) if g not in marked]
    out = []
    for g, source, reason in found:
        if mark_unhealthy(store, g, reason, source, actor=actor):
            out.append({"gpu": str(g), "source": source, "reason": reason})
    return out


def status(store: "StateStore", inv: "Optional[Inventory]" = None) -> "List[dict]":
    """``[{gpu, healthy, in_service, reason, source, since, cordoned}]`` for every known GPU, sorted by BDF;
    ``healthy`` is False once a failure was recorded (a cordon by hand alone leaves it True)."""
    rows = {row[0]: row for row in store.gpu_health_rows()}
    out = []
    for g in known_gpus(store, inv):
        row = rows.get(str(g))
        out.append({"gpu": str(g), "healthy": row is None or row[2] == hp.Source.OPERATOR, "in_service": row is None,
                    "reason": row[1] if row else None, "source": row[2] if row else None,
                    "since": row[3] if row else None, "cordoned": bool(row[4]) if row else False})
    return out


def _gone(host: HostRoot, inv: "Inventory", gpu: PciAddress) -> bool:
    """Is ``gpu`` (known: :func:`_require_gpu`) gone from the PCI tree (not in ``inv``, no device directory)?"""
    if inv.gpu(gpu) is not None:
        return False
    from ..io.sysfs import Sysfs
    fs = Sysfs(host)
    return not fs.exists(host.s.pci_device(gpu))


def _require_gpu(store: "StateStore", inv: "Inventory", gpu: PciAddress) -> None:
    """InputError unless ``gpu`` is a GPU of ``inv`` or one the store remembers (:func:`known_gpus`: a GPU
    gone from the PCI tree still holds records to drain, and can be cordoned)."""
    if inv.gpu(gpu) is None and gpu not in known_gpus(store):
        known = ", ".join(str(g.address) for g in inv.gpus) or "none"
        from ..model.errors import InputError
        raise InputError(f"no NVIDIA GPU at {gpu}", hint=f"GPUs on this host: {known} ('vgpuhost gpus')")


def cordon(host: HostRoot, store: "StateStore", inv: "Inventory", gpu: PciAddress, *, reason: str, actor: str,
           dry_run: bool = False) -> dict:
    """Take ``gpu`` out of placement by hand (maintenance): ``{gpu, changed, cordoned, reason, holders}``.
    What it holds keeps running.  A GPU already unhealthy keeps its failure's row (reason, source, time)
    and is marked cordoned by hand beside it (uncordon is then the way back for both); ``reason`` then
    goes to the audit row only, and the answer's ``reason`` is the failure's.  A GPU gone from the PCI
    tree that the store remembers is recorded unhealthy first (source ``pci``, :func:`mark_unhealthy`,
    unless it failed already), then cordoned on top.  Audited (result ``cordoned``, value the reason given).
    InputError for an unknown GPU, and for a ``reason`` that is
    not one line of printable text of at most 512 characters (:func:`vgpuhost.policy.health.reason_problem`:
    the same check locally and through the agent)."""
    from ..model.errors import InputError
    reason = (reason or "").strip()
    problem = hp.reason_problem(reason)
    if problem:
        raise InputError(problem, hint="give one line of printable text, at most "
                                       f"{hp.REASON_MAX} characters; nothing was changed")
    _require_gpu(store, inv, gpu)
    why = reason or "maintenance"
    gone = _gone(host, inv, gpu)
    # gone from the PCI tree: a failure first (source pci, as the agent or the next operation records it),
    # then the cordon on top of it, so host check errs (GPU_UNHEALTHY) and the metric reads 0
    failed = gone and not dry_run and mark_unhealthy(store, gpu, hp.GONE_REASON, hp.Source.PCI, actor=actor,
                                                     operation="gpu cordon")
    rows = store.gpu_health_rows(str(gpu))
    changed = failed or not rows or not rows[0][4]
    if changed and not dry_run:
        _set_marker(store)
        with store.transaction() as conn:
            if store.gpu_health_rows(str(gpu)):
                store.cordon_gpu_health(conn, str(gpu))     # the failure's reason, source and time stay
            else:
                store.put_gpu_health(conn, str(gpu), why, hp.Source.OPERATOR, True)
            store.audit(actor=actor, operation="gpu cordon", path=f"(health) {gpu}", value=why,
                        result="cordoned", conn=conn)
    return {"gpu": str(gpu), "changed": changed, "dry_run": dry_run, "in_service": False,
            "reason": rows[0][1] if rows else hp.GONE_REASON if gone else why,
            "holders": sorted({h["domain"] for h in _holders(store, gpu)})}


def uncordon(host: HostRoot, store: "StateStore", inv: "Inventory", gpu: PciAddress, *, actor: str,
             nvml=None, dry_run: bool = False) -> dict:
    """Bring ``gpu`` back into placement after a health check (:func:`check_gpu`): ``{gpu, changed,
    in_service, checked}``.  Refused (RefusedError, exit 2, an audit row ``refused``, nothing changed)
    while the check finds a problem, naming it.  A GPU in service already: nothing to do."""
    _require_gpu(store, inv, gpu)
    problems = check_gpu(host, gpu, nvml)
    if problems:
        line = "; ".join(f"{source}: {reason}" for source, reason in problems)
        if not dry_run:
            store.audit(actor=actor, operation="gpu uncordon", path=f"(health) {gpu}", value=line, result="refused")
        raise RefusedError(f"{gpu} fails its health check: {line}",
                           hint="repair or replace it (reset, reseat, reboot) and run 'vgpuhost gpu uncordon' again")
    rows = store.gpu_health_rows(str(gpu))
    if rows and not dry_run:
        with store.transaction() as conn:
            store.delete_gpu_health(conn, str(gpu))
            store.audit(actor=actor, operation="gpu uncordon", path=f"(health) {gpu}",
                        value=f"health check passed (was {'cordoned' if rows[0][4] else 'unhealthy'}: {rows[0][1]})",
                        result="uncordoned", conn=conn)
        _clear_marker(store)
    return {"gpu": str(gpu), "changed": bool(rows), "dry_run": dry_run, "in_service": True,
            "checked": ["pci", "device"] + (["nvml"] if nvml is not None else [])}


def _holders(store: "StateStore", gpu: PciAddress) -> "List[dict]":
    names = store.active_domains()
    out = []
    for r in store.vgpu_records(gpu=str(gpu)):
        out.append({"domain": r.owner, "name": names.get(r.owner), "device": r.id, "kind": "vgpu",
                    "profile": r.type_name, "running": r.owner in names, "pool": r.pool})
    for gpu_of, owner in sorted({(r.gpu, r.owner) for r in store.passthrough_records(gpu=str(gpu))}):
        out.append({"domain": owner, "name": names.get(owner), "device": gpu_of, "kind": "passthrough",
                    "profile": None, "running": owner in names, "pool": None})
    return out


def drain(store: "StateStore", inv: "Inventory", gpu: PciAddress, host: "Optional[HostRoot]" = None) -> dict:
    """What holds ``gpu`` and what each needs to move elsewhere; changes nothing and stops no VM:
    ``{gpu, in_service, reason, domains: [{domain, name, running, device, kind, profile, needs, fits_on}]}``.
    ``in_service`` False and ``reason`` the line why for a GPU out of service, and, with ``host``, for one
    gone from the PCI tree that nothing recorded yet (``reason`` None while in service).
    ``fits_on``: the other GPUs in service here where that profile fits now (free instances, the one
    capacity rule); ``needs``: one line (a vGPU of a profile; a passed-through GPU moves only by a stop
    and a start elsewhere: no live migration of a passed-through GPU)."""
    from ..observe.inventory import free_instances
    _require_gpu(store, inv, gpu)
    inv = in_service(inv, store)
    why = inv.out_of_service.get(gpu)
    if why is None and host is not None and _gone(host, inv, gpu):
        why = f"{hp.GONE_REASON} (not recorded yet: the agent or the next vgpuhost operation records it)"
    out = []
    for h in _holders(store, gpu):
        fits: "List[str]" = []
        if h["kind"] == "vgpu":
            for g in inv.gpus:
                if g.address == gpu:
                    continue
                ix = inv.on_gpu(g.address)
                tid = next((t.type_id for t in (ix.types if ix else ()) if t.name.lower() == str(h["profile"]).lower()),
                           None)
                if tid is not None and free_instances(inv, g.address, tid)[0] > 0:
                    fits.append(str(g.address))
            if Owner.is_pool(h["domain"]):     # made for guests, no domain of its own
                made = "'vgpuhost vgpu create'" if h["domain"] == Owner.MANUAL else "a layout ('vgpuhost apply')"
                needs = (f"a {h['profile']} vGPU made by {made}, owned by no domain: once no domain uses it, "
                         f"remove it ('vgpuhost vgpu remove {h['device']}') and create it on another GPU")
            else:
                needs = (f"a {h['profile']} vGPU: stop the domain and start it again (placement leaves {gpu} "
                         "out), or migrate it live to a host that offers the type")
        else:
            needs = ("a whole GPU by passthrough: no live migration of a passed-through GPU; stop it and start it "
                     "on another GPU or host")
        out.append({**h, "needs": needs, "fits_on": fits})
    return {"gpu": str(gpu), "in_service": why is None, "reason": why, "domains": out}


def findings(host: HostRoot, store: "Optional[StateStore]", inv: "Inventory", nvml=None) -> list:
    """``host check``'s health findings (:class:`vgpuhost.policy.checks.Finding`): ``GPU_UNHEALTHY``
    (error) for each GPU recorded unhealthy and for each GPU in service whose check (:func:`check_gpu`)
    fails now (not recorded here: ``host check`` changes nothing; the agent and the next operation
    record it; a GPU cordoned by hand too), ``GPU_CORDONED`` (warning) for each GPU cordoned by hand."""
    from ..policy.checks import Finding
    rows = {row[0]: row for row in store.gpu_health_rows()} if store is not None else {}
    out = []
    for gpu, row in sorted(rows.items()):
        if row[4] and row[2] == hp.Source.OPERATOR:
            out.append(Finding("warning", "GPU_CORDONED", gpu, f"cordoned by hand since {row[3]}: {row[1]}",
                               f"'vgpuhost gpu uncordon {gpu}' brings it back after a health check"))
        else:
            out.append(Finding("error", "GPU_UNHEALTHY", gpu,
                               f"out of service since {row[3]} ({row[2]}): {row[1]}",
                               f"'vgpuhost gpu drain {gpu}' lists what must move; repair it, then "
                               f"'vgpuhost gpu uncordon {gpu}'"))
    # a GPU cordoned by hand is still checked: a failure now is an error beside the cordon's warning
    failed = {gpu for gpu, row in rows.items() if row[2] != hp.Source.OPERATOR}
    present = {g.address for g in inv.gpus}
    for g in known_gpus(store) if store is not None else ():
        if str(g) not in failed and g not in present and check_gpu(host, g):   # remembered, gone from the tree
            out.append(Finding("error", "GPU_UNHEALTHY", str(g), f"fails its health check now: pci: {hp.GONE_REASON} "
                               "(the state store still remembers it)",
                               f"'vgpuhost gpu drain {g}' lists what it held; the agent (or the next vgpuhost "
                               "operation) takes it out of service"))
    for g in inv.gpus:
        if str(g.address) in failed:
            continue
        problems = check_gpu(host, g.address, nvml)
        if problems:
            out.append(Finding("error", "GPU_UNHEALTHY", str(g.address),
                               "fails its health check now: " + "; ".join(f"{s}: {r}" for s, r in problems),
                               "the agent (or the next vgpuhost operation) takes it out of service"))
    return out


def nvml_or_none(host: HostRoot):
    """The NVML backend for the health checks (:func:`vgpuhost.io.backends.open_backend`), None where NVML
    cannot be had (no driver, no library): the PCI tree still decides."""
    from ..io.backends import open_backend
    from ..model.errors import VgpuhostError
    try:
        return open_backend(host)
    except VgpuhostError:
        return None
