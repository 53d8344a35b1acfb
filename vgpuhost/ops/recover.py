"""Finishing or rolling back device operations an interruption cut short.

Owns: reading the intent journal's open entries (:mod:`vgpuhost.plan.journal`)
and, for each, leaving the host consistent with the records: a half-done
``passthrough prepare`` goes back to the drivers the functions had before
(unless it had in fact completed: every function on vfio-pci and recorded,
then it is closed as finished); a half-done ``passthrough release`` is
finished (every function back to the original driver the journal kept, the
records dropped); a ``vgpu create`` cut off before its record is rolled
back (the vGPU it made is removed again, its mdevctl definition too); a
``vgpu remove`` is finished (device removed, record dropped); an NVML
operation (MIG mode, MIG layout, vGPU scheduler, mixed-size mode) is
finished when the GPU reads as wanted, else rolled back to the state its
entry recorded (:mod:`vgpuhost.ops.nvmljournal`).  A vGPU that a process
still holds open is not removed (a remove write of an open mdev blocks until
it is closed, docs/reference/hardware.md#mdev): the entry stays open ("remove
pending") for the next reconcile, as it does when a remove write does not
return within its bound (it finishes by itself once the device is closed).  Runs under the same group/GPU locks as the operations, so an
entry an operation is still working on is never touched: another process's
is guarded by the locks it holds, this process's own (the resident agent's
other requests, an outer operation) by :func:`vgpuhost.plan.journal.in_progress`;
an entry this process left open and works on no more (a pending removal) is
ended like any other.  Must not: decide
placement, or touch devices the entry does not name.

Also drops the allocation rows admission wrote for devices a killed start
never made (:func:`settle_allocations`, under the host lock).

Entry points: :func:`recover_all` (``vgpuhost reconcile``, which the boot
units run) and :func:`recover_locked` (the start of every passthrough or
vGPU operation, for its own group and GPU).
"""

from __future__ import annotations

import os

from ..io import vgpudev
from ..io.hostroot import HostRoot
from ..io.locks import file_lock, lock_held
from ..io.state import StateStore, delete_vgpu, pid_alive
from ..model.records import JournalEntry
from ..io.sysfs import Sysfs
from ..io.vfioholders import RemoveTimedOut, VgpuInUse
from ..model.errors import VgpuhostError
from ..model.kinds import Backend
from ..model.values import PciAddress, field, record
from ..plan.executor import Executor
from ..plan.journal import in_progress
from ..plan.steps import ANY_HOST_DRIVER, Probe, SetDriverOverride, Unbind, VerifyDriver, WriteConfig

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import FrozenSet, List, Optional, Set

VFIO_PCI = "vfio-pci"
BACKEND_MDEV = Backend.MDEV
#: the kinds :mod:`vgpuhost.ops.nvmljournal` ends (kept here too: the hook path must not import it)
NVML_KINDS = ("mig-mode", "mig-apply", "scheduler-set", "mixed-size")


@record
class Recovered:
    """What reconcile did with one open entry."""

    entry: int
    operation: str
    owner: str
    result: str            # finished | rolled-back | pending (left open) | failed (left open)
    detail: str = ""
    devices: List[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def line(self) -> str:
        head = f"journal #{self.entry} {self.operation}" if self.entry else self.operation
        return f"{head} (owner {self.owner}): {self.result}" + (f": {self.detail}" if self.detail else "")


def open_entries(store: StateStore) -> List[JournalEntry]:
    """Open entries, oldest first."""
    return store.journal_entries(open_only=True)


def describe_open(entry: JournalEntry, state_dir: "Optional[str]" = None) -> str:
    """One line for ``reconcile --check``.  How it stands is said by what is known: the process that
    opened it gone (interrupted); or alive, and then (with ``state_dir``) whether the entry's group/GPU
    locks, which every operation on it holds while it works, are held now.  An alive process is not said
    to be working on it: the resident agent lives on after it left a removal pending (trial 8 T9)."""
    devs = ", ".join(d.get("bdf") or d.get("id") or d.get("gpu") or "?" for d in entry.devices)
    head = (f"journal #{entry.id} open since {entry.opened}: {entry.operation} (owner {entry.owner}, "
            f"{entry.done}/{len(entry.steps)} steps done; devices {devs})")
    if not pid_alive(entry.pid):
        return head + " - interrupted"
    alive = f" - pid {entry.pid}, which opened it, is alive"
    names = _lock_names(entry)
    held = None if state_dir is None else [lock_held(state_dir, n) for n in names]
    if held is not None and not any(held) and None not in held:
        return (head + alive + f", but no operation holds its lock{'s' if len(names) > 1 else ''} "
                f"({', '.join(names)}) now: nothing works on it; 'vgpuhost reconcile' ends it"
                + (" (a removal, once the device is closed)" if entry.kind == "vgpu-remove" else ""))
    if held is not None and any(held):
        return (head + alive + f" and {', '.join(n for n, h in zip(names, held) if h)} is locked now: an "
                "operation on it may be under way; 'vgpuhost reconcile' waits for it, then ends what is left")
    return (head + alive + "; whether it still works on it is not known here (its locks are not readable); "
            "'vgpuhost reconcile' waits for its locks, then ends what is left")


def _lock_names(entry: JournalEntry) -> List[str]:
    """The locks an operation on ``entry`` holds while it works (its group's, if any, then its GPU's)."""
    return ([f"group-{entry.iommu_group}"] if entry.iommu_group is not None else []) + [f"gpu-{entry.gpu}"]


def recover_all(host: HostRoot, store: StateStore, *, actor: str) -> List[Recovered]:
    """Finish or roll back every open entry, each under its group and GPU locks; then drop the
    allocations of devices an interrupted start never made (:func:`settle_allocations`)."""
    out: List[Recovered] = []
    for entry in open_entries(store):
        with _locks(store, entry):
            again = next((e for e in store.journal_entries(open_only=True) if e.id == entry.id), None)
            if again is None:
                continue            # its own process ended it while we waited for the lock
            out.append(_recover(host, store, again, actor))
    return out + settle_allocations(store, actor=actor)


def _unmade(store: StateStore, owner: Optional[str] = None) -> List[tuple]:
    """Allocation rows (``owner``'s, else every one) whose device vgpuhost does not hold (no vGPU record
    of that id; no passthrough record of that GPU): written by admission before the device's first write,
    by a start killed before the device was made (or whose make reconcile rolled back)."""
    rows = store.allocation_rows(owner=owner)
    if not rows:
        return []
    ids = {r.id for r in store.vgpu_records()}
    gpus = {r.gpu for r in store.passthrough_records()}
    return [r for r in rows if not ((r[4] == "vgpu" and r[0] in ids) or (r[4] == "passthrough" and r[3] in gpus))]


def unmade_allocations(store: StateStore) -> List[str]:
    """One line per allocation row of a device never made (:func:`_unmade`), for ``reconcile --check``."""
    return [f"allocation of {r[0]} ({r[4]}, domain {r[1]}, tenant {r[2] or 'none'}) for a device never made "
            "(an interrupted start, or a stop killed before it dropped the row; 'vgpuhost reconcile' drops it)" for r in _unmade(store)]


def settle_allocations(store: StateStore, *, actor: str, owner: Optional[str] = None,
                       locked: bool = False) -> List[Recovered]:
    """Drop the allocation rows of devices never made (:func:`_unmade`; ``owner``'s only, when given),
    one report per domain, under the host lock (a start still running holds it until its devices are
    made: its rows are never taken for a killed one's; ``locked``: the caller holds it, as a retried
    start does before it is admitted again).  Each dropped device's admission audit row gets its
    outcome, result ``interrupted``, in the same transaction; the devices the start did make keep their
    rows (they count against the tenant's quota until the domain's ``release end``)."""
    if not _unmade(store, owner):
        return []
    if locked:
        return _settle(store, actor, owner)
    from .admitting import HOST_LOCK
    with file_lock(store.dir, HOST_LOCK):
        return _settle(store, actor, owner)


def _settle(store: StateStore, actor: str, owner: Optional[str]) -> List[Recovered]:
    out: List[Recovered] = []
    rows = _unmade(store, owner)
    if rows:
        with store.transaction() as conn:
            store.delete_allocations(conn, devices=[r[0] for r in rows])
            for r in rows:
                aid = store.admission_row(r[0], conn)
                if aid is not None:
                    store.audit_outcome(aid, detail=" -> interrupted before the device was made; its allocation "
                                                    f"dropped ({actor})", result="interrupted", conn=conn)
            owners = sorted({r[1] for r in rows})
            for o in owners:
                devs = [r[0] for r in rows if r[1] == o]
                detail = "allocation of " + ", ".join(devs) + " dropped: not held (an interrupted start, or a stop killed before it dropped the row)"
                store.audit(actor=actor, operation=f"allocations of {o}", path="(allocations)",
                            value=detail, conn=conn)
                out.append(Recovered(0, "admitted start", o, "rolled-back", detail, devs))
    return out


def recover_locked(host: HostRoot, store: StateStore, *, gpu: str, group: Optional[int] = None,
                   actor: str) -> List[Recovered]:
    """Recover the open entries on ``gpu`` (or IOMMU ``group``); the caller holds their locks.

    An entry a thread of this process still works on (an outer operation of
    the same process, another request of the resident agent:
    :func:`vgpuhost.plan.journal.in_progress`) is skipped; one this process
    left open and no longer works on (a removal left pending when its write
    did not return in time, trial 8 T10) is ended as any other process's.
    """
    out = []
    for entry in open_entries(store):
        if in_progress(entry.id, entry.pid):
            continue
        if entry.gpu == gpu or (group is not None and entry.iommu_group == group):
            out.append(_recover(host, store, entry, actor))
    return out


def recover_devices(host: HostRoot, store: StateStore, names: "Set[str]", *, actor: str) -> List[Recovered]:
    """Recover the open entries naming any of ``names`` (mdev UUIDs, VF or GPU BDFs), each under its locks.

    For a caller that has not chosen a GPU yet (the qemu hook's ``prepare
    begin`` retried after an interrupted start): what the interrupted
    operation left is finished or rolled back before the request is checked
    against the host.  An entry whose process still runs is ended by that
    process while this call waits for its lock.
    """
    out: List[Recovered] = []
    for entry in open_entries(store):
        named = {entry.gpu} | {str(d.get("id") or d.get("bdf")) for d in entry.devices}
        if not named & names:
            continue
        with _locks(store, entry):
            again = next((e for e in store.journal_entries(open_only=True) if e.id == entry.id), None)
            if again is not None:
                out.append(_recover(host, store, again, actor))
    return out


class _locks:
    """``with _locks(store, entry):`` holds the entry's group lock (if any), then its GPU lock;
    a class, not ``contextlib.ExitStack``: the qemu hook recovers through here and imports no
    contextlib."""

    def __init__(self, store: StateStore, entry: JournalEntry):
        self.locks = [file_lock(store.dir, n) for n in _lock_names(entry)]
        self.held: list = []

    def __enter__(self) -> None:
        try:
            for lock in self.locks:
                lock.__enter__()
                self.held.append(lock)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        while self.held:
            self.held.pop().__exit__(None, None, None)
        return False


def _recover(host: HostRoot, store: StateStore, entry: JournalEntry, actor: str) -> Recovered:
    ex = Executor(host, store, actor=actor, operation=f"reconcile journal #{entry.id} ({entry.operation})")
    rep = Recovered(entry.id, entry.operation, entry.owner, "failed")
    try:
        if entry.kind == "passthrough-prepare":
            _prepare(host, store, ex, entry, rep)
        elif entry.kind == "passthrough-release":
            _release(host, store, ex, entry, rep)
        elif entry.kind == "vgpu-create":
            _vgpu_create(host, store, ex, entry, rep)
        elif entry.kind == "vgpu-remove":
            _vgpu_remove(host, store, ex, entry, rep)
        elif entry.kind in NVML_KINDS:
            from .nvmljournal import recover as recover_nvml     # NVML only when an NVML entry is open
            recover_nvml(ex, entry, rep)
        elif entry.kind == "rebalance":
            from .rebalancejournal import recover as recover_move      # the capacity reconciler's move (a pool)
            recover_move(host, store, ex, entry, rep)
        else:
            rep.detail = f"unknown kind {entry.kind!r} (a newer vgpuhost wrote it): left open"
            return rep
    except VgpuhostError as e:
        rep.result = "failed"
        rep.detail = e.message + "; the entry stays open for the next reconcile"
        return rep
    if rep.result in ("finished", "rolled-back"):
        store.journal_close(entry.id, state=rep.result, outcome=rep.detail or rep.result)
    return rep


# --- passthrough -------------------------------------------------------------------

def _read(host: HostRoot, bdf: str):
    from ..observe.inventory import _read_device
    return _read_device(Sysfs(host), PciAddress.parse(bdf))


def _give_back(host: HostRoot, ex: Executor, bdf: str, target: Optional[str]) -> None:
    """Return one function to ``target`` (a driver, ANY_HOST_DRIVER, or None: no driver), override cleared.

    The safe sequence of docs/reference/hardware.md#pci-and-iommu: clear ``driver_override``, unbind
    from the driver it is on now, ``drivers_probe``, read ``driver`` back.
    """
    cur = _read(host, bdf)
    addr = PciAddress.parse(bdf)
    steps: list = []
    if cur.driver_override is not None:
        steps.append(SetDriverOverride(addr, None))
    on_target = (cur.driver is not None and cur.driver != VFIO_PCI if target == ANY_HOST_DRIVER
                 else cur.driver == target)
    if not on_target:
        if cur.driver is not None:
            steps.append(Unbind(addr, cur.driver))
        if target is not None:
            steps.append(Probe(addr))
        steps.append(VerifyDriver(addr, target))
    ex.run(steps)


def _prepare(host: HostRoot, store: StateStore, ex: Executor, entry: JournalEntry, rep: Recovered) -> None:
    records = {r.bdf: r for r in store.passthrough_records()}
    now = {d["bdf"]: _read(host, d["bdf"]) for d in entry.devices}
    rep.devices = [d["bdf"] for d in entry.devices]
    if all(now[b].driver == VFIO_PCI for b in now) and all(
            b in records and records[b].owner == entry.owner for b in now):
        rep.result, rep.detail = "finished", "the group was bound and recorded before the interruption"
        return
    # roll back, companions first and the GPU last (the reverse of the bind order)
    for d in reversed(entry.devices):
        cur = now[d["bdf"]]
        if cur.driver == d["driver"] and cur.driver_override == d["override"]:
            continue                    # as it was before (never touched, or already on vfio-pci)
        _give_back(host, ex, d["bdf"], d["driver"])
    with store.transaction() as conn:
        store.delete_passthrough(conn, [d["bdf"] for d in entry.devices if not d.get("recorded")])
    rep.result = "rolled-back"
    rep.detail = "functions returned to " + ", ".join(f"{d['bdf']} {d['driver'] or 'no driver'}"
                                                    for d in entry.devices)


def _release(host: HostRoot, store: StateStore, ex: Executor, entry: JournalEntry, rep: Recovered) -> None:
    rep.devices = [d["bdf"] for d in entry.devices]
    for d in reversed(entry.devices):           # companions first, the GPU last
        target = d.get("target")
        if target == VFIO_PCI:
            continue                            # not part of the release (left as it was)
        _give_back(host, ex, d["bdf"], target)
    with store.transaction() as conn:
        store.delete_passthrough(conn, [d["bdf"] for d in entry.devices])
    rep.result = "finished"
    rep.detail = "functions given back: " + ", ".join(
        f"{d['bdf']} {d['target'] if d['target'] != ANY_HOST_DRIVER else 'host driver'}" for d in entry.devices)


# --- vGPUs ------------------------------------------------------------------------------

def _current_type(host: HostRoot, dev: dict) -> Optional[str]:
    """The type the journalled vGPU ``dev`` holds now (None: gone), read through the vGPU door."""
    return vgpudev.for_backend(dev["backend"]).current_type(Sysfs(host), dev["parent"], dev["id"])


def destroy(fs: Sysfs, backend: str, parent: PciAddress, vid: str) -> None:
    """Remove vGPU ``vid`` (mdev ``remove`` <- 1; vendor VFIO ``current_vgpu_type`` <- 0) through the
    vGPU door: refused while a process holds it open, the write bounded in time.  Raises
    VgpuInUse, RemoveTimedOut (:mod:`vgpuhost.io.vfioholders`) or SysfsError."""
    vgpudev.for_backend(backend).remove(fs, parent, vid)


def _destroy(host: HostRoot, ex: Executor, dev: dict) -> Optional[str]:
    """Remove the vGPU ``dev`` names; None when done, else why it is pending (held open, or the
    write did not return in time)."""
    try:
        destroy(ex.fs, dev["backend"], PciAddress.parse(dev["parent"]), dev["id"])
        return None
    except (VgpuInUse, RemoveTimedOut) as e:
        return e.message + "; remove pending, the entry stays open"


def _drop_definition(host: HostRoot, ex: Executor, dev: dict) -> None:
    if dev.get("persisted") and dev["backend"] == BACKEND_MDEV:
        ex.fs.remove_config(os.path.join(host.s.mdevctl_d, dev["parent"], dev["id"]))     # False when absent


def _vgpu_create(host: HostRoot, store: StateStore, ex: Executor, entry: JournalEntry, rep: Recovered) -> None:
    dev = entry.devices[0]
    rep.devices = [dev["id"]]
    rec = next((r for r in store.vgpu_records() if r.id == dev["id"]), None)
    present = _current_type(host, dev)
    if rec is not None and rec.owner == entry.owner:
        rep.result, rep.detail = "finished", f"vGPU {dev['id']} was created and recorded before the interruption"
        definition = host.mdevctl_d / rec.parent / rec.id
        if rec.persisted and rec.backend == BACKEND_MDEV and not ex.fs.exists(definition):
            # killed between the record and --persist's mdevctl definition: write it now
            from ..io.configfiles import mdevctl_json
            ex.run([WriteConfig(definition, mdevctl_json(rec.type_id, vgpudev.mdevctl_attrs(rec.params)))])
            rep.detail += "; its mdevctl definition written now"
        return
    if present is not None and present == dev["type_id"]:
        pending = _destroy(host, ex, dev)
        if pending is not None:
            rep.result, rep.detail = "pending", pending
            return
    _drop_definition(host, ex, dev)
    rep.result = "rolled-back"
    rep.detail = (f"vGPU {dev['id']} created but never recorded: removed again" if present == dev["type_id"]
                  else f"vGPU {dev['id']} was never created")


def _vgpu_remove(host: HostRoot, store: StateStore, ex: Executor, entry: JournalEntry, rep: Recovered) -> None:
    dev = entry.devices[0]
    rep.devices = [dev["id"]]
    present = _current_type(host, dev)
    if present is not None and present == dev["type_id"]:
        pending = _destroy(host, ex, dev)
        if pending is not None:
            rep.result, rep.detail = "pending", pending
            return
    with store.transaction() as conn:
        delete_vgpu(conn, dev["id"], owner=entry.owner)
    _drop_definition(host, ex, dev)
    rep.result, rep.detail = "finished", f"vGPU {dev['id']} removed and its record dropped"


#: the longest a domain's start can run (seconds): the qemu hook's longest timeout (3600 s,
#: :data:`vgpuhost.hook.runtime.MAX_TIMEOUT_S`) and its backstop (30 s); a start recorded longer ago
#: whose process is not known is over
START_BOUND_S = 3600 + 30


def stale_domains(store: StateStore, libvirt_active: "Optional[FrozenSet[str]]" = None,
                  now_s: "Optional[float]" = None) -> "List[dict]":
    """Domains recorded running (the hook's ``prepare begin`` records it before it makes anything) that hold
    nothing, and whose start is over: ``[{domain, name, since, why}]``, sorted by UUID.  Left behind by a
    start killed after it recorded the domain and before it made a device (trial 4 finding 29): libvirt
    runs no ``release end`` for a start that never began, so the row and its marker stay.

    Holds nothing: no vGPU or passthrough record, no allocation and no open journal entry owned by it.
    Its start is over when, with ``libvirt_active`` (the UUIDs libvirt lists active now; None where libvirt
    cannot be asked), libvirt does not list it active; without it, when the process that recorded it
    (:meth:`vgpuhost.io.state.StateStore.domain_starter`) is gone, or, where the marker names none,
    when it was recorded over :data:`START_BOUND_S` ago."""
    import time as _time
    from ..io.state import pid_alive
    starts = store.domain_starts()
    if not starts:
        return []
    names = store.active_domains()
    held = {r.owner for r in store.vgpu_records()} | {r.owner for r in store.passthrough_records()}
    held |= {row[1] for row in store.allocation_rows()} | {e.owner for e in store.journal_entries(open_only=True)}
    now = _time.time() if now_s is None else now_s
    out = []
    for uuid, since in sorted(starts.items()):
        if uuid in held:
            continue
        if libvirt_active is not None:
            if uuid in libvirt_active:
                continue
            why = "libvirt does not list it running"
        else:
            pid = store.domain_starter(uuid)
            if pid is not None:
                if pid_alive(pid):
                    continue                # its start may still be under way
                why = f"the process that started it (pid {pid}) is gone"
            else:
                from datetime import datetime
                try:
                    age = now - datetime.fromisoformat(since).timestamp()
                except ValueError:
                    age = 0.0
                if age <= START_BOUND_S:
                    continue
                why = f"recorded over {START_BOUND_S} s ago"
        out.append({"domain": uuid, "name": names.get(uuid, uuid), "since": since,
                    "why": f"recorded running since {since} and holds nothing: {why}"})
    if out:
        # by what was interrupted: a release that removed the domain's vGPUs and was killed before it
        # dropped the domain's row, or a start killed before it made anything (the audit log since then)
        removed = _removed_since(store, min(d["since"] for d in out))
        for d in out:
            n = sum(1 for owner, time in removed if owner == d["domain"] and time >= d["since"])
            d["why"] += (f" (a release killed half-way: it removed the domain's {n} vGPU(s) and was killed before "
                         "it forgot the domain)" if n else " (a start killed half-way, before it made a device)")
    return out


def _removed_since(store: StateStore, since: str) -> "List[tuple]":
    """``(owner, time)`` of each vGPU removal (or give-back to the layout's pool) made since ``since`` (ISO
    8601 UTC) for an owner, by the audit log: the rows of ``vgpu remove ID owner=UUID`` and ``vgpu give
    back ID owner=UUID`` whose write was made (result ``ok``)."""
    out = []
    for r in store.audit_rows(since=since):
        if r.result == "ok" and r.operation.startswith(("vgpu remove ", "vgpu give back ")) and " owner=" in r.operation:
            out.append((r.operation.rsplit(" owner=", 1)[1], r.time))
    return out


def forget_stale(store: StateStore, stale: "List[dict]", *, actor: str) -> "List[str]":
    """Forget each domain of :func:`stale_domains` (its row and its marker, as ``release end`` does), with
    one audit row each (operation ``reconcile``, path ``(domain) UUID``, result ``forgotten``); the UUIDs
    forgotten.  A domain started again since, or that holds something by now, is left alone."""
    done = []
    for d in stale:
        uuid = d["domain"]
        if store.domain_starts().get(uuid) != d["since"] or (store.vgpu_records(owner=uuid) or any(r.owner == uuid for r in store.passthrough_records())
                or store.allocation_rows(owner=uuid)):
            continue
        store.domain_stopped(uuid)
        store.audit(actor=actor, operation="reconcile", path=f"(domain) {uuid}", value=d["why"], result="forgotten")
        done.append(uuid)
    return done


__all__ = ["stale_domains", "forget_stale", "START_BOUND_S", "Recovered", "recover_all", "settle_allocations", "unmade_allocations", "recover_devices", "recover_locked",
           "open_entries", "describe_open", "destroy"]
