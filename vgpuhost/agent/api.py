"""The agent's API version 1: every endpoint as a plain function over one :class:`Agent`.

Owns: what each ``/v1/...`` path does and returns (the JSON documents
the OpenAPI document ``vgpuhost/agent/openapi.yaml`` describes), which
roles may call each path (:attr:`Route.roles`: admin, read-only, tenant)
and what a tenant member sees and may do there (the ``tenant_*``
handlers: its own tenant's data, its own domains), the agent's warm host
snapshot and
the one lock that serialises the agent's writes.  Must not: speak HTTP or
sockets (``server.py``), or hold device logic: every change goes through
the same ops (``ops/vgpu``, ``ops/layout``, the hook's domain devices,
``ops/tenancy``), file locks and audit log as the CLI and the hook.

Errors are raised as :class:`~vgpuhost.model.errors.VgpuhostError`
subclasses and turned into one JSON error document by the server, with
the exit code the CLI would have given.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from .. import __version__
from ..hook.runtime import released_domain
from ..io import locks, residentwriter
from ..io.changes import fingerprint, own_changes
from ..io.hostroot import HostRoot
from ..io.state import StateStore, StoreWatch
from ..io.state import issued_bill as st_issued_bill, meter_gaps as st_meter_gaps, usage_rows as st_usage_rows
from ..io.state import device_hour_tenants as st_device_hour_tenants
from ..io.sysfs import Sysfs
from ..libvirt.domxml import MAX_XML_BYTES, parse_domain, parse_domain_identity
from ..model.concepts import PlacementStrategy
from ..model.errors import InputError, RefusedError, TransientError, VgpuhostError
from ..model.values import PciAddress, clipped, json_flag, json_small_int, json_text, parse_uuid
from ..observe.inventory import discover, discover_gpu, gpu_part, with_gpu
from ..observe.vgpus import list_vgpus
from ..ops import billing, devices, health, mig, migdemand, migrate, tenancy, vgpu
from ..ops.allocate import allocate_admitted
from ..ops.attach import AttachRequest, attach, detach
from ..ops.devices import release_domain
from ..ops.layout import apply, check, plan
from ..ops.passthrough import prepare, release
from ..ops.scheduler import mixed_size, set_runtime
from ..ops.vgpu import reconcile
from ..policy.config import parse
from ..policy.migration import parse_request
from ..policy.mig import parse_layout
from ..policy.placement import OFFERED
from ..policy.when import parse_since
from ..present.inventory import gpus_doc, types_listing
from ..present.scheduler import scheduler_state
from ..present.tenancy import (
    SCHEMA_CAPACITY, SCHEMA_TENANT, SCHEMA_TENANTS, SCHEMA_USAGE, binding_answer, changed_tenant, new_tenant,
    tenant_doc
)
from .spec import document_bytes

API = "v1"
SCHEMA_AGENT = "vgpuhost.agent/v1"
SCHEMA_DOMAINS = "vgpuhost.agent-domains/v1"
SCHEMA_RELEASE = "vgpuhost.agent-release/v1"
SCHEMA_HOOK = "vgpuhost.agent-hook/v1"
SCHEMA_ERROR = "vgpuhost.agent-error/v1"
SCHEMA_GPU_HEALTH = "vgpuhost.gpu-health/v1"
SCHEMA_GPU_DRAIN = "vgpuhost.gpu-drain/v1"
SCHEMA_GPUS_HEALTH = "vgpuhost.agent-gpu-health/v1"

READ, ADMIN, TENANT = "read", "admin", "tenant"
#: every role, in the order the agent tries them for a caller (server.Access.caller)
ROLES = (ADMIN, READ, TENANT)

#: the libvirt URI the agent connects to unless started with another (``vgpuhost agent --libvirt-uri``)
DEFAULT_LIBVIRT_URI = "qemu:///system"
#: local qemu URIs without parameters a caller may also name; any other URI is refused (issue 15 #1:
#: libvirt's ``qemu+ext://...?command=`` runs a program and ``test:///FILE`` reads a file, as root here)
LOCAL_LIBVIRT_URIS = ("qemu:///system", "qemu+unix:///system")


class Unavailable(VgpuhostError):
    """A part of the API whose backing feature is not there (``/v1/metrics`` without the exporter)."""


class Stopping(Unavailable):
    """A change asked of an agent that is stopping (SIGTERM came): 503, nothing changed; the hook's thin
    client gets the JSON error and does the work itself, as with no agent."""

    exit_code = 5


class Misdirected(VgpuhostError):
    """A hook call meant for another host root or state dir than this agent's (421: the caller does it)."""


class NotFound(VgpuhostError):
    """What the request names does not exist (404): the bill of a period not issued yet."""


class Forbidden(RefusedError):
    """A caller's role does not reach this data or this change (403): a tenant member asking for another
    tenant's, or for a domain that is not its tenant's (the same answer whether the domain exists or not)."""


class Request(NamedTuple):
    """One call: ``params`` from the path, ``query`` (first value of each key), ``body`` (parsed JSON
    object or None), ``actor`` (the audit actor naming the peer), ``role`` the caller's role on this
    socket (:data:`ROLES`) and ``tenant`` its tenant when the role is :data:`TENANT` (else None)."""

    params: Dict[str, str]
    query: Dict[str, str]
    body: Optional[Dict[str, Any]]
    actor: str
    peer_pid: int
    role: str = ADMIN
    tenant: Optional[str] = None


class Stream(NamedTuple):
    """An answer written while the work runs (``POST /v1/apply`` with ``"progress": true``): status 200,
    ``application/x-ndjson``, one JSON object a line.  ``run(emit)`` does the work, calling ``emit(doc)``
    for each progress line (``vgpuhost.progress/v1``), and returns the final document; an error it raises
    becomes the last line, an error document whose ``status`` is the HTTP status it would have had."""

    run: Callable[[Callable[[Dict[str, Any]], None]], Dict[str, Any]]


#: the document name of a progress line of a streamed answer (:class:`Stream`)
SCHEMA_PROGRESS = "vgpuhost.progress/v1"


class Text(NamedTuple):
    """A non-JSON answer (``/v1/metrics``)."""

    content_type: str
    body: bytes


#: what a write changed, when it cannot be told: the whole host is read again
EVERYTHING = None


class WriteLock:
    """The agent's write lock: one change at a time (:meth:`Agent.write`), lent by a change while it waits
    long (:class:`vgpuhost.io.locks.lending`).  A change taking it back (:meth:`take_back`) goes before the
    changes that have not started (:meth:`acquire`): it holds file locks those may be waiting for, and a
    change waiting for a file lock lends this lock within ``LEND_AFTER_S``, so the lock comes back to it
    then, never left to whichever new change wins the race (without that, under a storm of starts one
    that held its GPU's lock could wait for this lock while each new start, waiting for that GPU's lock,
    held it ``LEND_AFTER_S``).  ``acquire``/``release``/``locked``, and ``with lock:``, as
    :class:`threading.Lock`."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._new = threading.Condition(self._mutex)       # changes not started
        self._back = threading.Condition(self._mutex)      # changes taking it back
        self._held = False
        self._taking = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock for a change that has not started; False when not had within ``timeout`` seconds
        (-1: no bound) or, with ``blocking`` false, at once."""
        with self._mutex:
            if not (self._held or self._taking):
                self._held = True
                return True
            if not blocking:
                return False
            until = None if timeout is None or timeout < 0 else time.monotonic() + timeout
            while self._held or self._taking:
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    self._wake()            # the wake-up this waiter may have taken goes to another one
                    return False
                self._new.wait(left)
            self._held = True
            return True

    def take_back(self) -> None:
        """Take the lock back for a change that lent it (before the changes not started)."""
        with self._mutex:
            self._taking += 1
            try:
                while self._held:
                    self._back.wait()
            finally:
                self._taking -= 1
            self._held = True

    def release(self) -> None:
        with self._mutex:
            if not self._held:
                raise RuntimeError("release of the agent's write lock, which is not held")
            self._held = False
            self._wake()

    def _wake(self) -> None:
        """(under ``_mutex``) the next holder: a change taking the lock back, else one not started."""
        if self._held:
            return
        if self._taking:
            self._back.notify()
        else:
            self._new.notify()

    def locked(self) -> bool:
        with self._mutex:
            return self._held

    def __enter__(self) -> "WriteLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


class Agent:
    """The agent's state: the host, its state store, the warm snapshot and the write lock.

    ``inventory()`` returns a discovery of the host, re-read only when the
    host changed (:func:`vgpuhost.io.changes.fingerprint`: the kernel's device
    files and the token vgpuhost's MIG and vGPU-mode changes rewrite) or the
    agent wrote since; ``scans`` counts the whole-host discoveries
    made, ``refreshes`` the snapshots brought up to date by re-reading only
    the GPUs the agent's writes touched (:meth:`write`, :meth:`warm_up`).
    Each snapshot has a version (:meth:`snapshot`); documents built from a
    snapshot (and the state store) are kept per version (:meth:`cached`).
    """

    def __init__(self, host: HostRoot, libvirt_uri: str = DEFAULT_LIBVIRT_URI):
        self.host = host
        self.libvirt_uri = libvirt_uri
        self.store = StateStore(host.state_dir, create=True)
        self.watch = StoreWatch(self.store)
        self.write_lock = WriteLock()          # one change at a time, lent by one that waits long (write())
        self._snap_lock = threading.Lock()     # the fields below
        self._build_lock = threading.Lock()    # one read of the host for the snapshot at a time
        self._inv = None
        self._key: Optional[tuple] = None
        self._version = 0
        self._pending: set = set()             # GPUs the agent's writes touched since the snapshot was read
        self._pending_all = False              # a write whose devices are not known: read the whole host
        self._accounted: Optional[tuple] = None    # the host's fingerprint as the agent last knew it
        self._base = 0                         # moves when a whole read installs _accounted anew (_after_write)
        self._placed: Dict[str, PciAddress] = {}   # vGPU id -> its GPU, for those made since the snapshot
        self._docs: Dict[tuple, Any] = {}
        self._building: Dict[tuple, threading.Event] = {}    # documents being built now, by their key
        self._docs_lock = threading.Lock()
        self.stopping = False                  # set by stop() at SIGTERM: no write starts after it
        self._answers = threading.Condition()  # guards stopping's setting and _owed
        self._owed = 0                         # answers owed: calls whose change started, not yet answered
        self._answer = threading.local()       # .owed: this thread answers a call (answering()); its change began
        self.scans = 0
        self.refreshes = 0
        self.cache_hits = 0
        self.lent = 0                           # waits of changes that lent the write lock (write())
        self.recovered: Dict[str, Any] = {}     # what recovery at start did (server.recover_at_start)
        self.metering = None                    # agent/metrics.AgentMetering when metering runs
        self.metering_off = "metering is off (--metering-interval 0)"
        self.served: Dict[str, int] = {}       # "METHOD /v1/template" -> answered calls (any status)
        self.served_thin: Dict[str, int] = {}  # the same, for the hook's thin client (XML body, no Python)
        self.snapshot_waits = 0                 # discoveries a request had to wait for (the snapshot was cold)
        self._served_lock = threading.Lock()

    def count(self, route: "Route", thin: bool = False) -> None:
        with self._served_lock:
            key = f"{route.method} {route.template}"
            self.served[key] = self.served.get(key, 0) + 1
            if thin:
                self.served_thin[key] = self.served_thin.get(key, 0) + 1

    # --- the warm snapshot ---------------------------------------------
    def _fingerprint(self, inv) -> tuple:
        """The host's devices as :func:`fingerprint` sees them: the kernel's files and the driver-state
        token every vgpuhost process rewrites after a MIG or vGPU-mode change (trial 8 T1: a ``--local``
        ``mig apply`` moves no kernel file the rest watches).  The state store is not in it: the
        inventory does not read the store; documents that do key on :class:`StoreWatch`."""
        return fingerprint(self.host, [str(v.vf) for v in inv.vf_vgpus] if inv is not None else ())

    def _current(self):
        """``(inventory, version)`` when the snapshot is current (nothing pending, the host unchanged), else
        None; reads nothing but the fingerprint."""
        with self._snap_lock:
            inv, key, version = self._inv, self._key, self._version
            if inv is None or self._pending or self._pending_all:
                return None
        if self._fingerprint(inv) != key:
            return None
        return inv, version

    def snapshot(self, _waiting: bool = True):
        """``(inventory, version)``: the warm snapshot, brought up to date first when the host changed (the
        GPUs the agent's writes touched re-read, or the whole host).  The version changes with every new
        snapshot.  Raises what :func:`discover` raises."""
        with self._build_lock:
            now = self._current()
            if now is not None:
                return now
            return self._build(_waiting)

    def inventory(self, _waiting: bool = True):
        """The host's inventory, from the warm snapshot when nothing changed since it was read."""
        return self.snapshot(_waiting)[0]

    def _build(self, waiting: bool):
        with self._snap_lock:
            inv, gpus, everything = self._inv, sorted(self._pending), self._pending_all
            accounted = self._accounted
            self._pending, self._pending_all = set(), False
        try:
            if inv is not None and not everything and gpus:
                pre = self._fingerprint(inv)
                if pre == accounted:
                    new = inv
                    fs = Sysfs(self.host)
                    for g in gpus:
                        # the GPU's type constants (name, description) from the snapshot: only what moves is read
                        new = with_gpu(new, g, discover_gpu(fs, g, host_facts=False, known=new))
                        if new is None:
                            break
                    if new is not None:
                        # the fingerprint read before the GPUs: a change made while they were read shows next time
                        key = pre if [v.vf for v in new.vf_vgpus] == [v.vf for v in inv.vf_vgpus] else None
                        with self._snap_lock:
                            self.refreshes += 1
                            # (the agent's knowledge of the host stays: a write may have moved it since)
                            return self._install(new, key, self._accounted)
            self.host.require_host()
            # the fingerprint read before the host: a change made while it is read shows next time (the VFs'
            # types are those of the snapshot before; when the new one has other VFs, read after)
            pre = self._fingerprint(inv)
            new = discover(Sysfs(self.host))
            key = pre if inv is not None and [v.vf for v in new.vf_vgpus] == [v.vf for v in inv.vf_vgpus] \
                else self._fingerprint(new)
        except BaseException:
            with self._snap_lock:
                self._pending_all = True        # nothing was installed: the next call reads again
            raise
        with self._snap_lock:
            self.scans += 1
            self.snapshot_waits += waiting
            return self._install(new, key, key)

    def _install(self, inv, key, accounted):
        """(under ``_snap_lock``) the new snapshot and its version."""
        if accounted is not self._accounted:
            self._base += 1
        self._inv, self._key, self._accounted = inv, key, accounted
        self._version += 1
        with self._docs_lock:
            self._docs.clear()
        return inv, self._version

    def invalidate(self) -> None:
        """Forget the snapshot: the next read reads the whole host."""
        with self._snap_lock:
            self._pending_all = True

    def write(self, fn: Callable[[], Any], changed: Optional[Callable[[Any], List[str]]] = None) -> Any:
        """Run one change under the agent's write lock; the snapshot is then due for a refresh.

        The agent's changes run one at a time, but a change that waits long (:func:`vgpuhost.io.locks.lending`:
        past ``LEND_AFTER_S``, for a lock another operation holds, or for a remove the kernel blocks while
        its device is open, up to ``VGPUHOST_REMOVE_TIMEOUT_S``) lends the write lock for the rest of that
        wait, keeping the file locks it holds, and takes it back before it goes on: the other changes run
        meanwhile under their own file locks, as the one-shot hook's processes do, and only those that need
        a lock it holds wait for it (trial 7 F8).  ``lent`` counts such waits.
        ``changed``: the devices (vGPU ids, GPU or VF addresses) the change's result names as changed;
        only their GPUs are read again, when the host's fingerprint moved by no more than they explain
        (another tool's change meanwhile: the whole host).  None, an error or an unknown device: the
        whole host.  The refresh runs at the next read or :meth:`warm_up`, not here."""
        if self.stopping:
            raise Stopping("the agent is stopping: it starts no change now",
                           hint="the hook does the work itself; retry once the agent is back")
        with self.write_lock:
            with self._answers:
                if self.stopping:
                    raise Stopping("the agent is stopping: it starts no change now",
                                   hint="the hook does the work itself; retry once the agent is back")
                if getattr(self._answer, "owed", None) is False:
                    self._answer.owed = True
                    self._owed += 1
            names = None
            try:
                # a wait of fn's that outlasts locks.LEND_AFTER_S (a GPU's lock another operation holds, a
                # remove the kernel blocks until its device is closed) lends the write lock until it is over
                with locks.lending(self.write_lock.release, self.write_lock.take_back) as lender:
                    try:
                        result = fn()
                    finally:
                        if lender.lent:
                            with self._snap_lock:
                                self.lent += lender.lent
                names = changed(result) if changed is not None else None
                return result
            finally:
                self._after_write(names)

    def stop(self) -> None:
        """SIGTERM came: no change starts from now (:meth:`write` raises Stopping, and so does
        :meth:`check_stopping`, which an apply asks between its steps)."""
        with self._answers:
            self.stopping = True

    def check_stopping(self) -> None:
        """Raises Stopping once :meth:`stop` was called (an apply asks before each of its steps)."""
        if self.stopping:
            raise Stopping("the agent is stopping (SIGTERM): it starts no further step",
                           hint="run apply again once the agent is back")

    @contextlib.contextmanager
    def answering(self):
        """The server answers one call inside this: when the call's change starts (:meth:`write`), its
        answer is owed until the block ends (the answer sent), and :meth:`wait_answers` waits for it."""
        self._answer.owed = False
        try:
            yield
        finally:
            if self._answer.owed:
                with self._answers:
                    self._owed -= 1
                    self._answers.notify_all()
            self._answer.owed = None

    def wait_answers(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until every call whose change started has been answered;
        True when none is owed."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._answers:
            while self._owed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._answers.wait(left)
            return True

    def _after_write(self, names: Optional[List[str]]) -> None:
        """Mark the GPUs holding ``names`` due for a refresh when the host's fingerprint moved, since the
        agent last knew it, by no more than their devices explain; else (or ``names`` None) the whole host.

        Under the write lock, one write at a time; a change that lent the lock (:meth:`write`) and has not
        ended may have moved the host meanwhile: unexplained here, that makes the whole host due.
        ``_accounted`` moves only from the value this write compared with: a whole read installed meanwhile
        by a reader (``_base`` moved) makes the whole host due too, never a fingerprint the snapshot does
        not match taken as known."""
        gpus = None
        after = None
        with self._snap_lock:
            inv, accounted, base = self._inv, self._accounted, self._base
        if names is not None and inv is not None and accounted is not None:
            try:
                gpus = self._gpus_of(inv, names)
                after = self._fingerprint(inv)
                if gpus is not None and not self._explained(inv, accounted, after, gpus, names):
                    gpus = None
            except Exception:       # an unreadable host: the whole read says why, at the next request
                gpus = None
        with self._snap_lock:
            if gpus is None or base != self._base:
                self._pending_all = True
            else:
                self._pending |= gpus
                self._accounted = after

    def _gpus_of(self, inv, names: List[str]) -> Optional[set]:
        """The GPUs holding ``names`` (vGPU ids: mdev UUIDs or VF addresses; GPU addresses), from the
        snapshot, the vGPUs placed since, or sysfs (an mdev made now); None when one cannot be told."""
        by_dev = {}
        for g in inv.gpus:
            for a in (g.address,) + g.vfs + g.mdev_parents:
                by_dev[str(a)] = g.address
        by_mdev = {m.uuid: by_dev.get(str(m.parent)) for m in inv.mdevs}
        fs = None
        out = set()
        for name in names:
            name = name[6:] if name.startswith("claim:") else name
            gpu = by_dev.get(name) or by_mdev.get(name) or self._placed.get(name)
            if gpu is None and len(name) == 36:
                fs = fs or Sysfs(self.host)
                try:
                    real = fs.resolve(f"{self.host.s.mdev_devices}/{name}")
                except OSError:
                    return None
                gpu = by_dev.get(real.rstrip("/").rsplit("/", 2)[-2])
                if gpu is not None:
                    with self._snap_lock:
                        if len(self._placed) >= 4096:
                            self._placed.clear()
                        self._placed[name] = gpu
            if gpu is None:
                return None
            out.add(gpu)
        return out

    @staticmethod
    def _explained(inv, before: tuple, after: tuple, gpus: set, names: List[str]) -> bool:
        """Whether what moved in the fingerprint between ``before`` and ``after`` is all on ``gpus``:
        mdevs, driver bindings and VF types of their devices, or the devices ``names``.  A moved
        driver-state token is only when this process's own token writes moved it, each naming one of
        ``gpus`` (its MIG on demand, :func:`vgpuhost.io.changes.own_changes`); another process's (a MIG or
        vGPU-mode change) never is."""
        if before[4:] != after[4:]:
            moved = own_changes(before[4], after[4])
            if moved is None or not moved <= {str(g) for g in gpus}:
                return False
        mine = {n[6:] if n.startswith("claim:") else n for n in names}
        for g in gpus:
            part = gpu_part(inv, g)
            mine |= {str(a) for a in part.devices} | {m.uuid for m in part.mdevs} | {str(g)}
        for b, a in zip(before[:3], after[:3]):
            if (set(b) ^ set(a)) - mine:
                return False
        vfs = inv.vf_vgpus
        if len(before[3]) != len(after[3]) or len(after[3]) != len(vfs):
            return False
        return all(b == a or vfs[i].gpu in gpus for i, (b, a) in enumerate(zip(before[3], after[3])))

    def warm_up(self) -> None:
        """Bring the snapshot up to date when a write left it due (the GPUs it touched, coalesced with
        every other write's since): the server calls this once the answer is sent and the connection's
        slot released, so the next domain start finds a warm snapshot.  Concurrent calls coalesce: one
        reads, the others return at once.  Errors are left for the next request that needs the host."""
        with self._snap_lock:
            if not (self._pending or self._pending_all):
                return
        if not self._build_lock.acquire(blocking=False):
            return                  # another thread refreshes now; it reads what is pending when it starts
        try:
            if self._current() is None:
                self._build(False)
        except Exception:           # an unreadable host: the next request says why
            pass
        finally:
            self._build_lock.release()

    def cached(self, name: str, extra: tuple, build: Callable[[Any], Any], *, store: bool = False):
        """The document ``name`` with parameters ``extra`` for the current snapshot and the state store's
        content now (:class:`StoreWatch`: the store says which GPUs are out of service, issue 27), built
        by ``build(inventory)`` once per snapshot version and store change; the inventory it is given
        leaves the GPUs out of service out of what is free (:func:`vgpuhost.ops.health.in_service`), as
        placement, the CLI and the exporter do.  The value is shared: callers must not change it.
        (``store``: kept for callers; every document is keyed on the store now.)"""
        inv, version = self.snapshot()
        token = self.watch.token()
        if token is None:
            return build(health.in_service(inv, self.store))
        key = (name, version, token, extra)
        with self._docs_lock:
            hit = self._docs.get(key, _MISSING)
            building = None
            if hit is _MISSING and key not in self._building:
                building = self._building[key] = threading.Event()
        if hit is not _MISSING:
            self.cache_hits += 1
            return hit
        try:
            value = build(health.in_service(inv, self.store))
            with self._docs_lock, self._snap_lock:
                if self._version == version:        # a newer snapshot cleared the documents: not this one
                    if len(self._docs) >= MAX_CACHED_DOCS:
                        self._docs.clear()
                    self._docs[key] = value
        finally:
            if building is not None:
                with self._docs_lock:
                    self._building.pop(key, None)
                building.set()
        return value

    def peek(self, name: str, extra: tuple, *, store: bool = False):
        """The cached document (:meth:`cached`) when one is current now, else None; reads nothing but the
        fingerprint and the store's change counter (the server answers it without the expensive-read limits).
        While another request builds that very document, waits for it (at most :data:`PEEK_WAIT_S`): a
        burst of the same read after a change costs one build, not one 429 each beyond the reader's limit."""
        now = self._current()
        if now is None:
            return None
        token = self.watch.token()
        if token is None:
            return None
        key = (name, now[1], token, extra)
        with self._docs_lock:
            hit = self._docs.get(key)
            building = self._building.get(key) if hit is None else None
        if building is not None and building.wait(PEEK_WAIT_S):
            # the same answer is being built by another request now: it is kept once built
            with self._docs_lock:
                hit = self._docs.get(key)
        if hit is not None:
            self.cache_hits += 1
        return hit


_MISSING = object()
#: seconds a read waits for the same answer another request is building (:meth:`Agent.peek`) before it
#: is served as any expensive read
PEEK_WAIT_S = 10.0
#: documents kept per snapshot (each query's variant counts one); more clear the lot
MAX_CACHED_DOCS = 256


# ---------------------------------------------------------------------------
# helpers

def _text(body: Optional[Dict[str, Any]], key: str, *, required: bool = False, limit: int = 4096) -> Optional[str]:
    return json_text(body, key, limit, required)


def _flag(body: Optional[Dict[str, Any]], key: str) -> bool:
    """A JSON body's boolean (absent: false); :func:`json_flag` refuses anything else."""
    return json_flag(key, (body or {}).get(key, False))


def _query_flag(query: Optional[Dict[str, str]], key: str) -> bool:
    """A query parameter's flag: ``1``/``true``/``yes`` or ``0``/``false``/``no``/empty (a query has only text)."""
    value = (query or {}).get(key, "").lower()
    if value in ("1", "true", "yes", "0", "false", "no", ""):
        return value in ("1", "true", "yes")
    raise InputError(f"query parameter {key!r} must be 1 or 0 (true or false)")


def _strategy(body: Optional[Dict[str, Any]]) -> str:
    """The body's placement strategy (absent: first-fit), one of those the agent offers
    (agent/openapi.yaml's enum); ``reserve`` stays Python-API-only (docs/performance.md)."""
    strategy = _text(body, "strategy", limit=32) or PlacementStrategy.FIRST_FIT
    if strategy not in OFFERED:
        raise InputError(f"unknown placement strategy {strategy!r}", hint="one of " + ", ".join(OFFERED))
    return strategy


def _gpu(agent: Agent, text: Optional[str], inv=None):
    if text is None:
        return None
    addr = PciAddress.parse(text)
    if inv is not None and inv.gpu(addr) is None:
        known = ", ".join(str(g.address) for g in inv.gpus) or "none"
        raise InputError(f"no NVIDIA GPU at {addr}", hint=f"GPUs on this host: {known}")
    return addr


def _uuid(text: str) -> str:
    return parse_uuid(text)


# ---------------------------------------------------------------------------
# read endpoints

def get_agent(agent: Agent, req: Request) -> Dict[str, Any]:
    return {"schema": SCHEMA_AGENT, "version": __version__, "api": API, "role": req.role, "tenant": req.tenant,
            "root": str(agent.host.root), "snapshot_scans": agent.scans, "snapshot_waits": agent.snapshot_waits,
            "snapshot_refreshes": agent.refreshes, "cached_answers": agent.cache_hits,
            "served": dict(agent.served), "served_thin_client": dict(agent.served_thin),
            "state_dir": str(agent.host.state_dir), "recovered": agent.recovered,
            "libvirt_uris": allowed_uris(agent), "resident_writer": residentwriter.status()}


def json_answer(doc: Any) -> Text:
    """``doc`` as the server writes a JSON answer (indented, a final newline), encoded once."""
    return Text("application/json", (json.dumps(doc, indent=2) + "\n").encode())


def _inventory_doc(inv) -> Text:
    return json_answer(gpus_doc(inv))


def get_inventory(agent: Agent, req: Request) -> Text:
    """``GET /v1/inventory``: built once per snapshot (:meth:`Agent.cached`)."""
    return agent.cached("inventory", (), _inventory_doc)


def _types_key(req: Request) -> tuple:
    return (req.query.get("gpu"), _query_flag(req.query, "available"))


def _types_doc(agent: Agent, req: Request):
    def build(inv) -> Text:
        addr = _gpu(None, req.query.get("gpu"), inv)
        # the one builder `vgpuhost types` calls too: the vGPU-mode cap and MIG on demand included
        doc, _notes = types_listing(agent.host, inv, addr, available=_query_flag(req.query, "available"),
                                    store=agent.store)
        return json_answer(doc)
    return build


def get_types(agent: Agent, req: Request) -> Text:
    """``GET /v1/types``: :func:`vgpuhost.present.inventory.types_listing`'s document, as ``vgpuhost --json
    types`` prints it; built once per snapshot, state store content and query (an unknown GPU's refusal is
    not kept).  Besides the snapshot it reads NVML (vGPU modes, an opted-in GPU's MIG state), the VFs'
    placement ids and the store's opt-ins: vgpuhost's changes of those are audited in the store (its change
    counter keys the answer) or change a VF's type (the snapshot's fingerprint)."""
    return agent.cached("types", _types_key(req), _types_doc(agent, req), store=True)


def _capacity_doc(agent: Agent, tenant: Optional[str]):
    """The whole capacity document (every profile) for ``tenant``, as :func:`get_capacity` answers it."""
    def build(inv) -> Dict[str, Any]:
        inv = migdemand.makeable(agent.host, agent.store, inv)     # MIG on demand: what a start would make
        doc = tenancy.capacity(agent.store, inv, tenancy.mixed_size_of(agent.host, inv), tenant=tenant,
                               policies=lambda gpus: tenancy.scheduler_policies(agent.host, gpus),
                               limits_for=vgpu.limits_lookup(agent.host, inv, agent.store.vgpu_records()))
        risk = tenancy.guarantees_at_risk(agent.store, inv)
        doc["guarantees_at_risk"] = [{"tenant": n, "guarantee": (risk or {})["reasons"].get(n)}
                                     for n in (risk or {}).get("tenants", ())]
        return {"schema": SCHEMA_CAPACITY, **doc}
    return build


def _capacity_key(req: Request) -> tuple:
    return (req.query.get("tenant"), (req.query.get("profile") or "").lower())


def _capacity_answer(agent: Agent, req: Request):
    """The answer's builder: the whole document (kept too, for the other profiles' answers), then
    the asked profile's rows, encoded."""
    def build(inv) -> Text:
        doc = agent.cached("capacity-doc", (req.query.get("tenant"),), _capacity_doc(agent, req.query.get("tenant")),
                           store=True)
        profile = req.query.get("profile")
        if profile:
            doc = dict(doc, profiles=_profile_rows(doc, profile))
        return json_answer(doc)
    return build


def _profile_rows(doc: Dict[str, Any], profile: str) -> List[Dict[str, Any]]:
    """The capacity document's rows of ``profile`` (any case); InputError, as ``vgpuhost capacity --profile``
    refuses it, when no GPU here offers it (trial 8 T8: not 200 with no rows)."""
    rows = [p for p in doc["profiles"] if p["profile"].lower() == profile.lower()]
    if not rows:
        raise InputError(f"no GPU here offers {profile[:80]!r}", hint="GET /v1/types lists the profiles")
    return rows


def capacity_doc(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/capacity``'s document as a value the caller may change (a copy of the cached one)."""
    doc = agent.cached("capacity-doc", (req.query.get("tenant"),), _capacity_doc(agent, req.query.get("tenant")),
                       store=True)
    doc = copy.deepcopy(doc)
    profile = req.query.get("profile")
    if profile:
        doc["profiles"] = _profile_rows(doc, profile)
    return doc


def get_capacity(agent: Agent, req: Request) -> Text:
    """``GET /v1/capacity``: built once per snapshot, state store content and query: the state store's
    change counter (:class:`~vgpuhost.io.state.StoreWatch`) sees every commit, the CLI's too."""
    return agent.cached("capacity", _capacity_key(req), _capacity_answer(agent, req), store=True)


def cached_read(agent: Agent, route: "Route", req: Request) -> Optional[Text]:
    """The answer to ``req`` when it is a read kept for the current snapshot (and store), else None:
    what the server answers without the expensive reads' limits (it costs no host read and no build)."""
    if req.role == TENANT:
        return None
    if route.handler is get_capacity:
        return agent.peek("capacity", _capacity_key(req), store=True)
    if route.handler is get_types:
        try:
            return agent.peek("types", _types_key(req), store=True)
        except InputError:
            return None
    if route.handler is get_inventory:
        return agent.peek("inventory", ())
    return None


def get_vgpus(agent: Agent, req: Request) -> Dict[str, Any]:
    # a vGPU whose removal is pending (an open journal entry) shows as removing, as `vgpuhost vgpu list` shows it
    entries = list_vgpus(agent.inventory(), agent.store.vgpu_records(), vgpu.removal_pending(agent.store))
    return {"schema": "vgpuhost.vgpu-list/v1", "vgpus": [e.as_dict() for e in entries]}


def domains_doc(store: StateStore) -> Dict[str, Any]:
    """Every domain vgpuhost knows: recorded as running by the hook, or holding a vGPU or a GPU."""
    running = store.active_domains()
    held: Dict[str, Dict[str, List[str]]] = {}
    for r in store.vgpu_records():
        held.setdefault(r.owner, {"vgpus": [], "passthrough": []})["vgpus"].append(r.id)
    for p in store.passthrough_records():
        if p.owner and p.bdf == p.gpu:
            held.setdefault(p.owner, {"vgpus": [], "passthrough": []})["passthrough"].append(p.gpu)
    out = []
    for uuid in sorted(set(running) | {o for o in held if _is_uuid(o)}):
        h = held.get(uuid, {"vgpus": [], "passthrough": []})
        out.append({"uuid": uuid, "name": running.get(uuid), "running": uuid in running,
                    "vgpus": sorted(h["vgpus"]), "passthrough": sorted(set(h["passthrough"]))})
    return {"schema": SCHEMA_DOMAINS, "domains": out}


#: the end of a whole token in free text (an audit row, an error line): a following ``:`` or ``.`` ends it
#: when no word character follows
#: (``domain UUID: tenant=...``), as a space does
_AFTER = r"(?![\w+-]|[.:][\w])"
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _is_uuid(text: str) -> bool:
    return bool(_UUID_RE.fullmatch(text or ""))


def get_domains(agent: Agent, req: Request) -> Dict[str, Any]:
    return domains_doc(agent.store)


def get_tenants(agent: Agent, req: Request) -> Dict[str, Any]:
    return {"schema": SCHEMA_TENANTS, "tenants": [tenant_doc(t) for t in tenancy.tenants(agent.store).values()]}


def get_usage(agent: Agent, req: Request) -> Dict[str, Any]:
    try:
        inv = agent.inventory()
    except VgpuhostError:           # usage is the store's view; an unreadable host only loses type sizes
        inv = None
    return {"schema": SCHEMA_USAGE, "tenants": tenancy.usage_report(agent.store, inv)}


def get_audit(agent: Agent, req: Request) -> Dict[str, Any]:
    since = req.query.get("since")
    start = parse_since(since, name="since") if since else None
    rows = agent.store.audit_rows(start)
    return {"schema": "vgpuhost.audit/v1", "since": start, "rows": [r.__dict__ for r in rows]}


def _period(req: Request) -> str:
    """The request's ``period`` (``YYYY-MM``, a UTC month), checked; InputError when missing or not one."""
    period = req.query.get("period")
    if not period:
        raise InputError("this read needs the query parameter period=YYYY-MM (a UTC month)",
                         hint="e.g. ?period=2026-11")
    billing.period_bounds(period)           # InputError naming what is wrong
    return period


def _issued_bill(agent: Agent, req: Request, tenant: Optional[str]) -> Dict[str, Any]:
    """The issued bill of the request's period (``vgpuhost.bill/v1`` with its adjustments), cut to
    ``tenant`` (None: whole: :func:`_for_member`); NotFound while the period is not issued (an open month
    is priced only with the operator's price sheet, which the agent does not hold)."""
    period = _period(req)
    if st_issued_bill(agent.store, period) is None:
        raise NotFound(f"the bill of {period} is not issued", hint="the operator issues a month once metering "
                       f"has passed its end ('vgpuhost bill --prices FILE --period {period} --issue'); usage "
                       f"so far: GET /v1/usage/hourly?period={period}")
    doc = billing.bill(agent.store, period, None, tenant=tenant)
    if tenant is not None:
        start, end, _hours = billing.period_bounds(period)
        doc["gaps"] = _member_gaps(agent, doc["gaps"], tenant, start, end)
        doc["prices"] = None        # the operator's file path; ``prices_sha256`` names the sheet it was priced with
    return doc


def _gap_hours(start: str, end: str):
    """The rollup hour keys (``2026-11-30T10:00:00Z``) a metering gap from ``start`` to ``end`` (ISO times)
    overlaps."""
    t0 = datetime.fromisoformat(start.replace("Z", "+00:00")).astimezone(timezone.utc)
    t1 = datetime.fromisoformat(end.replace("Z", "+00:00")).astimezone(timezone.utc)
    hour = t0.replace(minute=0, second=0, microsecond=0)
    yield hour.strftime("%Y-%m-%dT%H:00:00Z")          # the gap's own hour, however short the gap
    hour += timedelta(hours=1)
    while hour < t1:
        yield hour.strftime("%Y-%m-%dT%H:00:00Z")
        hour += timedelta(hours=1)


def _member_gaps(agent: Agent, gaps: List[Dict[str, Any]], tenant: str, since: str,
                 until: str) -> List[Dict[str, Any]]:
    """The gaps a tenant member reads (final 9 N2): the whole host's (device ``*``), and a device's where it
    is the member's tenant's: in the hours the gap overlaps, metering gave the device to that tenant; or,
    where no tenant had the device in those hours (a span nothing was read in: a GPU unread, a device gone
    while unread: final 9b NEW-1), in the last hour before the gap that anyone had it.  A gap's ``tenants``
    list is cut to the member's tenant (another tenant's name is not the member's to read)."""
    me = tenant.lower()
    # from a day before the period: the hour before a gap at its very start may lie in the month before
    day_before = (datetime.strptime(since, "%Y-%m-%dT%H:%M:%SZ") - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    holders = st_device_hour_tenants(agent.store, sorted({g["device"] for g in gaps if g["device"] != "*"}),
                                     day_before, until)
    shown = []
    for g in gaps:
        if g["device"] != "*":
            hours = holders.get(g["device"], {})
            covered = list(_gap_hours(g["start"], g["end"]))
            during = set().union(*(hours[h] for h in covered if h in hours))
            if not during:
                before = [h for h in hours if h < covered[0]]
                during = hours[max(before)] if before else set()
            if me not in during:
                continue
        if "tenants" in g:
            g = dict(g, tenants=[t for t in g["tenants"] if t.lower() == me])
        shown.append(g)
    return shown


def get_bill(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/bill?period=YYYY-MM``: the period's issued bill, whole, with its adjustments (as ``vgpuhost
    --json bill --period P`` prints an issued one)."""
    return _issued_bill(agent, req, None)


def tenant_bill(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/bill``: the issued bill cut to the caller's tenant (its lines, totals, adjustments, the
    gaps of its device-hours and the host's, no other tenant's name, no operator file path), so a tenant
    can check what it is charged against its hourly usage."""
    return _issued_bill(agent, req, req.tenant)


SCHEMA_USAGE_HOURLY = "vgpuhost.usage-hourly/v1"
#: the most hourly rows one ``GET /v1/usage/hourly`` answers (about 400 bytes each in JSON): a caller with
#: more in the month asks for one device at a time (``&device=``), so no answer holds the agent's memory
MAX_HOURLY_ROWS = 20_000


def _usage_hourly(agent: Agent, req: Request, tenant: Optional[str]) -> Dict[str, Any]:
    period = _period(req)
    device = req.query.get("device")
    if device is not None and not (0 < len(device) <= 64 and device.isprintable()):
        raise InputError("device must be a vGPU's id or a GPU's address (at most 64 printable characters)",
                         hint="as the rows' 'device' field names it")
    start, end, _hours = billing.period_bounds(period)
    # the caller's rows alone are read (the store's index on tenant and hour), never the whole month's
    rows = st_usage_rows(agent.store, start, end, tenant=tenant, device=device, limit=MAX_HOURLY_ROWS + 1)
    if len(rows) > MAX_HOURLY_ROWS:
        raise InputError(f"{period} has more than {MAX_HOURLY_ROWS} hourly rows "
                         f"{'of your tenant' if tenant is not None else 'on this host'}"
                         f"{' for that device' if device else ''}: more than one answer carries",
                         hint=f"ask for one device at a time: ?period={period}&device=ID")
    gaps = [{"start": g[0], "end": g[1], "device": g[2], "seconds": g[3], "reason": g[4]}
            for g in st_meter_gaps(agent.store, start, end) if device is None or g[2] in ("*", device)]
    if tenant is not None:
        gaps = _member_gaps(agent, gaps, tenant, start, end)
    return {"schema": SCHEMA_USAGE_HOURLY, "period": period, "since": start, "until": end,
            "tenant": tenant, "rows": [r._asdict() for r in rows], "gaps": gaps}


def get_usage_hourly(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/usage/hourly?period=YYYY-MM[&device=ID]``: the period's hourly rollup rows (what bills are
    priced from: docs/guide/billing.md), every device's, and the metering gaps; InputError (400) beyond
    :data:`MAX_HOURLY_ROWS` rows (ask per device)."""
    return _usage_hourly(agent, req, None)


def tenant_usage_hourly(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/usage/hourly``: the rows metering attributed to the caller's tenant, and the gaps of its
    device-hours and of the whole host: the rows its bill's lines name."""
    return _usage_hourly(agent, req, req.tenant)


def get_metrics(agent: Agent, req: Request) -> Text:
    """The metering exporter's series in the Prometheus text format (the agent's sampler)."""
    if agent.metering is None:
        raise Unavailable(f"metrics are not available: {agent.metering_off}",
                          hint="start the agent with --metering-interval S (S > 0) where NVML is available")
    content_type, body = agent.metering.render()
    return Text(content_type, body)


# ---------------------------------------------------------------------------
# write endpoints (admin)

def _allocate_body(agent: Agent, req: Request) -> Tuple[str, str, Any, Optional[str], Optional[str], bool]:
    """An allocate request's body: ``(profile, strategy, gpu or None, vGPU UUID or None, anti-affinity key or
    None, dry run)``; raises InputError for a value out of bounds."""
    body = req.body or {}
    return (_text(body, "profile", required=True, limit=128), _strategy(body),
            _gpu(agent, _text(body, "gpu", limit=32)), _text(body, "vgpu_uuid", limit=64),
            _text(body, "anti_affinity", limit=256), _flag(body, "dry_run"))


def post_allocate(agent: Agent, req: Request) -> Dict[str, Any]:
    """A vGPU of ``profile`` for domain ``uuid`` (the owner), placed by ``strategy`` (or on ``gpu``)."""
    owner = _uuid(req.params["uuid"])
    profile, strategy, gpu, vid, anti, dry = _allocate_body(agent, req)

    def run():
        return vgpu.create(agent.host, agent.store, profile=profile, gpu=gpu, uuid=vid, strategy=strategy,
                           owner=owner, anti_affinity=anti, dry_run=dry, actor=req.actor)
    out = run() if dry else agent.write(run)
    return out.as_dict()


def _int(body: Optional[Dict[str, Any]], key: str) -> Optional[int]:
    return json_small_int(body, key)


def _whole(body: Optional[Dict[str, Any]], key: str) -> Optional[int]:
    """A whole number as the CLI's ``type=int`` options take it (ranges are the operation's to check)."""
    value = (body or {}).get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) >= 1 << 31:
        raise InputError(f"{key!r} must be a whole number")
    return value


def post_vgpu_create(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost vgpu create`` through the agent: every option of the command, ``owner`` default manual."""
    body = req.body or {}
    _strategy(body)
    request = vgpu.VgpuCreateRequest.from_json(body)
    dry = _flag(body, "dry_run")

    def run():
        return vgpu.create_vgpu(agent.host, agent.store, request, dry_run=dry, actor=req.actor)
    return (run() if dry else agent.write(run)).as_dict()


def post_vgpu_remove(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost vgpu remove ID [--owner UUID]`` through the agent."""
    owner = _text(req.body, "owner", limit=64)
    dry = _flag(req.body, "dry_run")

    def run():
        return vgpu.remove(agent.host, agent.store, req.params["id"], owner=owner, dry_run=dry, actor=req.actor)
    return (run() if dry else agent.write(run)).as_dict()


def _names(devices) -> List[str]:
    """The devices a hook write or a release names as changed (vGPU ids, GPU addresses), as text."""
    return [str(d) for d in devices]


def post_release(agent: Agent, req: Request) -> Dict[str, Any]:
    """Every vGPU and GPU domain ``uuid`` holds, released (the hook's ``release end``); the domain forgotten."""
    owner = _uuid(req.params["uuid"])
    released = agent.write(lambda: release_domain(agent.host, agent.store, owner, actor=req.actor), changed=_names)
    return {"schema": SCHEMA_RELEASE, "domain": owner, "released": released}


def _hook(agent: Agent, req: Request, act: str) -> Dict[str, Any]:
    # the store's connections kept between requests (each request is answered on a thread of its own)
    with agent.store.pooled():
        return _hook_pooled(agent, req, act)


def _hook_pooled(agent: Agent, req: Request, act: str) -> Dict[str, Any]:
    for key, mine in (("root", agent.host.root), ("state_dir", agent.host.state_dir)):
        theirs = _text(req.body, key)
        if theirs is not None and theirs != str(mine):
            raise Misdirected(f"this agent serves {key} {mine}, not {theirs}",
                              hint="the hook does the work itself")
    xml = _text(req.body, "xml", required=True, limit=MAX_XML_BYTES)
    # the hook's client waits timeout_s seconds, then the start fails or its handler takes over: the
    # agent starts no work after that, and waits for locks only until then (a stale prepare must not
    # make devices for a start that has already failed)
    waits = _text(req.body, "timeout_s", limit=8)
    if waits is not None and not (waits.isascii() and waits.isdigit()):
        raise InputError(f"timeout_s (X-Vgpuhost-Timeout) must be whole seconds in ASCII digits, not {waits!r}",
                         hint="the hook sends VGPUHOST_HOOK_TIMEOUT + 5")
    deadline = (time.monotonic() + max(1, int(waits)) - 1) if waits else None
    # release: what the store says the UUID holds, whatever the metadata says by now (issue 12 #2); decided
    # as the hook's handler decides it (hook.runtime.released_domain), so a document is released or refused
    # the same with the agent up or down
    data = xml.encode("utf-8")
    libvirt_name = _text(req.body, "name", limit=256)
    view = None
    if act == "release" and libvirt_name:
        view = released_domain(data, libvirt_name, agent.store)
    if view is None:
        view = (parse_domain if act == "prepare" else parse_domain_identity)(data)
    name = view.name or libvirt_name or "?"
    shown = "".join(c if c.isprintable() else "?" for c in name[:80])
    actor = f"hook {shown} pid={req.peer_pid}"
    if act == "prepare":
        def run():
            # the warm snapshot, checked against the host when prepare asks for it (under the host lock
            # where tenancy is in use, so admission decides on facts read under it): no rescan per start
            return devices.prepare(agent.host, view, actor=actor, inventory=agent.inventory, store=agent.store)
    else:
        def run():
            return devices.release(agent.host, view, actor=actor, store=agent.store)
    def in_time():
        if deadline is not None and time.monotonic() >= deadline:
            raise TransientError(f"the hook's client stopped waiting ({waits} s) before the agent could start "
                                 f"the {act} of this domain: nothing was changed",
                                 hint="see what held the agent (GET /v1/agent, the audit log); start it again")
        # SIGTERM while this call waits for a lock (another operation holds its GPU; the agent's write lock
        # lent meanwhile, Agent.write): the wait ends, what the call made is undone as at its deadline, and
        # the hook does the work itself (503), as for a call that came after SIGTERM; one that waits for no
        # lock ends whole within the stop's wait
        scope = locks.deadline(deadline if deadline is not None else float("inf"), cancelled=lambda: agent.stopping)
        try:
            with scope:
                return run()
        except VgpuhostError as e:
            if not scope.gave_up:
                raise
            raise Stopping(f"the agent is stopping: it gave up the {act} of this domain while it waited for a "
                           f"lock ({e.message})", hint="the hook does the work itself") from None
    changed = agent.write(in_time, changed=_names)
    return {"schema": SCHEMA_HOOK, "operation": act, "domain": view.uuid, "name": view.name or libvirt_name,
            "changed": [str(c) for c in changed]}


def post_hook_prepare(agent: Agent, req: Request) -> Dict[str, Any]:
    return _hook(agent, req, "prepare")


def post_hook_release(agent: Agent, req: Request) -> Dict[str, Any]:
    return _hook(agent, req, "release")


#: the endpoints the hook's thin client calls with the domain XML as the body (server.py)
HOOK_HANDLERS = (post_hook_prepare, post_hook_release)


def _config(req: Request):
    text = _text(req.body, "config", required=True, limit=1 << 20)
    source = _text(req.body, "source", limit=256) or "<agent request>"
    return parse(text, source), _text(req.body, "layout", limit=256)


def post_plan(agent: Agent, req: Request) -> Dict[str, Any]:
    cfg, layout = _config(req)
    return plan(agent.host, agent.store, cfg, layout).as_dict()


def post_assert(agent: Agent, req: Request) -> Dict[str, Any]:
    cfg, layout = _config(req)
    return check(agent.host, agent.store, cfg, layout).as_dict()


def post_apply(agent: Agent, req: Request):
    cfg, layout = _config(req)
    cfg.layout(layout)                  # an unknown layout fails before the host is read
    if not _flag(req.body, "progress"):
        return agent.write(lambda: apply(agent.host, agent.store, cfg, layout, actor=req.actor,
                                         stop=agent.check_stopping)).as_dict()

    def run(emit: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
        def progress(i: int, n: int, step, state: str) -> None:
            emit({"schema": SCHEMA_PROGRESS, "step": i, "steps": n, "kind": step.kind, "target": str(step.target),
                  "action": step.action, "state": state})
        return agent.write(lambda: apply(agent.host, agent.store, cfg, layout, actor=req.actor,
                                         progress=progress, stop=agent.check_stopping)).as_dict()
    return Stream(run)


def post_reconcile(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost reconcile`` in the agent; the stale-domain check asks libvirt at the agent's own URI
    (``--libvirt-uri``, as the CLI asks at ``--connect``): a domain libvirt lists active is never
    forgotten; where libvirt does not answer, the state store's view decides."""
    check = _flag(req.body, "check")
    agent.host.require_host()
    uri = agent.libvirt_uri
    if check:
        return reconcile(agent.host, agent.store, check=True, libvirt_uri=uri).as_dict()
    return agent.write(lambda: reconcile(agent.host, agent.store, check=False, actor=req.actor,
                                         libvirt_uri=uri)).as_dict()


# --- the CLI's other write commands (each as the command does it; the CLI forwards here) -----------

def _bdf(req: Request, key: str = "bdf"):
    return PciAddress.parse(req.params[key])


def post_passthrough_prepare(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost passthrough prepare BDF [--allow-boot-vga] [--persist]`` through the agent."""
    addr = _bdf(req)
    boot_vga, persist = _flag(req.body, "allow_boot_vga"), _flag(req.body, "persist")
    return agent.write(lambda: prepare(agent.host, agent.store, addr, allow_boot_vga=boot_vga, persist=persist,
                                       actor=req.actor)).as_dict()


def post_passthrough_release(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost passthrough release BDF [--persist]`` through the agent."""
    addr = _bdf(req)
    persist = _flag(req.body, "persist")
    return agent.write(lambda: release(agent.host, agent.store, addr, persist=persist,
                                       actor=req.actor)).as_dict()


def post_gpu_cordon(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost gpu cordon BDF [--reason TEXT] [--dry-run]`` through the agent."""
    # the reason is checked by health.cordon, as locally (one line, at most 512 characters)
    addr, reason, dry = _bdf(req), _text(req.body, "reason", limit=65536) or "", _flag(req.body, "dry_run")
    doc = agent.write(lambda: health.cordon(agent.host, agent.store, agent.inventory(), addr, reason=reason,
                                            actor=req.actor, dry_run=dry))
    return {"schema": SCHEMA_GPU_HEALTH, "action": "cordon", **doc}


def post_gpu_uncordon(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost gpu uncordon BDF [--dry-run]`` through the agent: the health check, then back in service."""
    addr, dry = _bdf(req), _flag(req.body, "dry_run")
    doc = agent.write(lambda: health.uncordon(agent.host, agent.store, agent.inventory(), addr, actor=req.actor,
                                              nvml=health.nvml_or_none(agent.host), dry_run=dry))
    return {"schema": SCHEMA_GPU_HEALTH, "action": "uncordon", **doc}


def post_migrate_check(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost migrate check --incoming`` on this agent's host: the body is the source's
    ``vgpuhost.migrate-request/v1`` document; the answer the ``vgpuhost.migrate-check/v1`` document
    (can this host take the domain, and why not).  Changes nothing."""
    return migrate.check_incoming(agent.host, parse_request(req.body))


def get_gpu_drain(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost gpu drain BDF``: what holds the GPU and what each domain needs to move (changes nothing)."""
    return {"schema": SCHEMA_GPU_DRAIN, **health.drain(agent.store, agent.inventory(), _bdf(req), agent.host)}


def get_gpu_health(agent: Agent, req: Request) -> Dict[str, Any]:
    """Every known GPU's health: ``{schema, gpus: [{gpu, healthy, in_service, reason, source, since, cordoned}]}``."""
    return {"schema": SCHEMA_GPUS_HEALTH, "gpus": health.status(agent.store, agent.inventory())}


def allowed_uris(agent: Agent) -> List[str]:
    """The libvirt URIs attach/detach may name: the agent's own (``--libvirt-uri``), then the local
    qemu URIs without parameters (:data:`LOCAL_LIBVIRT_URIS`)."""
    return list(dict.fromkeys((agent.libvirt_uri,) + LOCAL_LIBVIRT_URIS))


def _libvirt_uri(agent: Agent, body: Optional[Dict[str, Any]]) -> str:
    """The body's ``uri`` when the agent allows it, else InputError (400); no ``uri``: the agent's own.

    The given URI is never opened, echoed or parsed: libvirt reaches programs
    (``qemu+ext``, ``?command=``) and files (``test:///FILE``) through a URI,
    and the agent runs as root."""
    uri = _text(body, "uri", limit=1024)
    if uri is None:
        return agent.libvirt_uri
    allowed = allowed_uris(agent)
    if uri not in allowed:
        raise InputError("the agent connects to libvirt only at " + ", ".join(allowed) + ", not at the URI given",
                         hint="name one of those, or run the command in your own process "
                              "('vgpuhost --local ... --connect URI')")
    return uri


def post_attach(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost attach DOMAIN ...`` through the agent; ``uri`` the libvirt URI the CLI would use."""
    request = AttachRequest.from_json(req.body)
    uri = _libvirt_uri(agent, req.body)
    return agent.write(lambda: attach(agent.host, agent.store, uri, req.params["domain"], request,
                                      actor=req.actor)).as_dict()


def post_detach(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost detach DOMAIN [DEVICE | --all]`` through the agent."""
    body = req.body or {}
    domain = req.params["domain"]
    device, every = _text(body, "device", limit=64), _flag(body, "all")
    if device is not None and every:
        raise InputError("give a DEVICE or --all, not both")
    uri = _libvirt_uri(agent, body)
    return agent.write(lambda: detach(agent.host, agent.store, uri, domain, device=device, all=every,
                                      actor=req.actor)).as_dict()


def post_bind(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost tenant bind DOMAIN TENANT [--qos C]`` / ``tenant unbind DOMAIN`` (``"unbind": true``)
    through the agent: the operator's binding of a domain (issue 28), audited with the caller as actor."""
    body = req.body or {}
    uri = _libvirt_uri(agent, body)
    gone, dry = _flag(body, "unbind"), _flag(body, "dry_run")
    tenant, qos = _text(body, "tenant", limit=256), _text(body, "qos", limit=32)
    if gone and (tenant is not None or qos is not None):
        raise InputError("'unbind' with 'tenant' or 'qos' contradicts itself",
                         hint='send {"unbind": true} alone to unbind, or a tenant (and qos) to bind')
    doc = agent.write(lambda: tenancy.bind_domain(agent.store, uri, req.params["domain"], tenant, qos=qos,
                                                  unbind_it=gone, actor=req.actor, dry_run=dry))
    return binding_answer([doc])


#: tenant options as the CLI takes them (strings; the lists repeatable) -> the body's keys
_TENANT_TEXT = ("qos", "isolation", "vgpus", "framebuffer", "mig_slices", "passthrough", "series")
_TENANT_LISTS = ("labels", "avoid", "prefer")


def _tenant_options(body: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    opts: Dict[str, Any] = {k: _text(body, k, limit=256) for k in _TENANT_TEXT}
    for k in _TENANT_LISTS:
        value = (body or {}).get(k) or []
        if not isinstance(value, list) or len(value) > 64 or not all(isinstance(v, str) and len(v) <= 256
                                                                       for v in value):
            raise InputError(f"{k!r} must be a list of at most 64 strings")
        opts[k] = tuple(value)
    return opts


def _warned(answer: Dict[str, Any], promise) -> Dict[str, Any]:
    """The answer with the guarantee check's warning (``warning``; the CLI prints it on stderr)."""
    if promise.warning:
        answer["warning"] = promise.warning
    return answer


def _tenant_answer(action: str, t, text: str) -> Dict[str, Any]:
    return {"schema": SCHEMA_TENANT, "action": action, "tenant": tenant_doc(t), "text": text}


def post_tenant_add(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost tenant add NAME [options]`` through the agent (options as the CLI's strings)."""
    name = _text(req.body, "name", required=True, limit=128)
    opts = _tenant_options(req.body)
    promise = tenancy.Promise(agent.inventory, _flag(req.body, "allow_oversubscribe"))

    def run():
        t = tenancy.add(agent.store, new_tenant(name, opts), actor=req.actor, promise=promise)
        return _warned(_tenant_answer("add", t, f"added tenant {t.name}: {tenancy.describe(t)}"), promise)
    return agent.write(run)


def post_tenant_set(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost tenant set NAME [options]`` through the agent."""
    opts = _tenant_options(req.body)
    promise = tenancy.Promise(agent.inventory, _flag(req.body, "allow_oversubscribe"))

    def run():
        t = changed_tenant(agent.store, req.params["name"], opts, actor=req.actor, promise=promise)
        return _warned(_tenant_answer("set", t, f"tenant {t.name}: {tenancy.describe(t)}"), promise)
    return agent.write(run)


def post_tenant_remove(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost tenant remove NAME`` through the agent."""

    def run():
        t = tenancy.remove(agent.store, req.params["name"], actor=req.actor)
        return _tenant_answer("remove", t, f"removed tenant {t.name}")
    return agent.write(run)


def _mig(agent: Agent, req: Request, action: str) -> Dict[str, Any]:
    addr = _bdf(req)
    if action == "apply":
        layout = _text(req.body, "layout", required=True, limit=1024)
        parse_layout(layout)                    # a malformed layout fails before the host is read
        return agent.write(lambda: mig.apply(agent.host, agent.store, addr, layout, actor=req.actor,
                                             adopt=True)).as_dict()
    fn = mig.enable if action == "enable" else mig.disable
    return agent.write(lambda: fn(agent.host, agent.store, addr, actor=req.actor)).as_dict()


def post_mig_enable(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost mig enable --gpu BDF`` through the agent."""
    return _mig(agent, req, "enable")


def post_mig_disable(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost mig disable --gpu BDF`` through the agent."""
    return _mig(agent, req, "disable")


def post_mig_apply(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost mig apply --gpu BDF LAYOUT`` through the agent (``{"layout": "3g.71gb=1,..."}``)."""
    return _mig(agent, req, "apply")


def post_scheduler(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost scheduler set`` (now, through NVML) through the agent: ``policy``, ``timeslice_ms`` or
    ``frequency_hz`` + ``avg_factor``, and ``gpus`` (BDFs) or ``all``."""
    body = req.body or {}
    gpus = body.get("gpus") or []
    if not isinstance(gpus, list) or len(gpus) > 64 or not all(isinstance(g, str) for g in gpus):
        raise InputError("'gpus' must be a list of GPU addresses")
    every = _flag(body, "all")
    if bool(gpus) == every:
        raise InputError("give 'gpus' (GPU addresses) or 'all', not both or neither")
    state = scheduler_state(_text(body, "policy", required=True, limit=32), _whole(body, "timeslice_ms"),
                            _whole(body, "frequency_hz"), _whole(body, "avg_factor"))
    target = "all" if every else [PciAddress.parse(g) for g in gpus]
    return agent.write(lambda: set_runtime(agent.host, agent.store, target, state, actor=req.actor)).as_dict()


def post_vgpu_mode(agent: Agent, req: Request) -> Dict[str, Any]:
    """``vgpuhost vgpu mode --gpu BDF --mixed-size on|off`` through the agent (``{"mixed_size": bool}``)."""
    addr = _bdf(req)
    if not isinstance((req.body or {}).get("mixed_size"), bool):
        raise InputError("the request needs 'mixed_size': true or false")
    on = req.body["mixed_size"]
    return agent.write(lambda: mixed_size(agent.host, agent.store, addr, on, actor=req.actor)).as_dict()


def get_openapi(agent: Agent, req: Request) -> Text:
    return Text("application/yaml", document_bytes())


# ---------------------------------------------------------------------------
# the tenant role: a member of a tenant's group sees its own tenant and domains, and allocates and releases
# for its tenant's domains only (docs/agent.md, "Who may do what")

def _forbidden(req: Request, what: str) -> Forbidden:
    return Forbidden(f"{what}: a member of tenant {req.tenant!r} reaches only that tenant's data and domains",
                     hint="ask the operator (a member of the admin group) for anything else")


def _mine(agent: Agent, req: Request) -> Dict[str, str]:
    """``{domain UUID: tenant}`` of the caller's tenant (:func:`vgpuhost.ops.tenancy.tenant_domains`)."""
    return tenancy.tenant_domains(agent.store, req.tenant)


def _own_domain(agent: Agent, req: Request) -> str:
    """The path's domain UUID when its tenant is the caller's, else Forbidden: one answer for another
    tenant's domain, a domain of no tenant and a domain vgpuhost does not know (existence is not told)."""
    owner = _uuid(req.params["uuid"])
    theirs = tenancy.domain_tenant(agent.store, owner)
    if not theirs or theirs.lower() != req.tenant.lower():
        raise Forbidden(f"domain {owner} is not bound to tenant {req.tenant!r}",
                        hint="a tenant member allocates and releases only for its tenant's domains; the operator "
                             "binds a domain to a tenant")
    return owner


class Redactor:
    """Other tenants' names, other domains' names and UUIDs and their vGPUs' ids in free text (an admission
    reason, an audit row, an error line) written as ``another tenant`` / ``(another domain)`` /
    ``(another vGPU)``, for a tenant member's answer.  The patterns are compiled once per answer: one
    alternation per kind, whatever the number of tenants and domains."""

    def __init__(self, agent: Agent, req: Request, mine: Dict[str, str]):
        me = req.tenant.lower()
        others = sorted({t for t in tenancy.tenants(agent.store) if t.lower() != me}, key=len, reverse=True)
        names = agent.store.active_domains()
        records = agent.store.vgpu_records()
        known = set(names) | {r.owner for r in records} | {row[1] for row in agent.store.allocation_rows()}
        mine_names = {names.get(m) for m in mine}
        domains = {d for d in known if _is_uuid(d) and d not in mine} | \
            {n for d, n in names.items() if d not in mine and n and n not in mine_names}
        vgpus = {r.id for r in records if r.owner not in mine}
        self.subs: List[Tuple["re.Pattern[str]", str]] = []
        if others:
            alt = "(?:" + "|".join(re.escape(t) for t in others) + ")"
            self.subs += [(re.compile(r"(?<![\w.:+-])tenant '" + alt + "'", re.IGNORECASE), "another tenant"),
                          (re.compile(r"(?<![\w.:+-])'" + alt + "'", re.IGNORECASE), "'(another tenant)'"),
                          (re.compile(r"(tenants: (?:[\w.:+()-]+, )*)" + alt + r"(?![\w.:+-])", re.IGNORECASE),
                           r"\1(another tenant)")]
        for found, text in ((domains, "(another domain)"), (vgpus, "(another vGPU)")):
            if found:
                alt = "|".join(re.escape(x) for x in sorted(found, key=len, reverse=True))
                self.subs.append((re.compile(r"(?<![\w.:+-])(?:" + alt + r")" + _AFTER), text))

    def text(self, value: Any) -> Any:
        if not isinstance(value, str) or not value:
            return value
        out = value
        for rx, text in self.subs:
            for _ in range(64):     # a list of tenants names several: each pass takes one of each list
                done = rx.sub(text, out)
                if done == out:
                    break
                out = done
        return out


def _caller_input(req: Request) -> List[str]:
    """The texts the caller sent (path parameters, query values, the body's strings), longest first."""
    texts = list(req.params.values()) + list(req.query.values())
    texts += [v for v in (req.body or {}).values() if isinstance(v, str)]
    return sorted({t for t in texts if t}, key=len, reverse=True)


def redact_error(agent: Agent, req: Request, e: VgpuhostError) -> VgpuhostError:
    """``e`` with its message and hint redacted for a tenant member (:class:`Redactor`), except where
    they echo what the caller sent: an unknown name and another tenant's name give the same line (a
    redacted echo would tell which exist)."""
    r = Redactor(agent, req, _mine(agent, req))
    given = _caller_input(req)

    def text(value: Optional[str]) -> Optional[str]:
        if not value or not given:
            return r.text(value)
        # the caller's own texts are set aside (as markers no pattern matches), the rest redacted, then put back
        rx = re.compile("|".join(re.escape(g) for g in given))
        kept: List[str] = []

        def aside(m: "re.Match[str]") -> str:
            kept.append(m.group(0))
            return f"\x00{len(kept) - 1}\x00"
        out = r.text(rx.sub(aside, value))
        return re.sub("\x00(\\d+)\x00", lambda m: kept[int(m.group(1))], out)
    e.message, e.hint = text(e.message), text(e.hint)
    return e


#: the fields of ``GET /v1/agent`` a tenant member does not get: the host's paths and its host-wide counters
#: (other tenants' calls and starts)
_HOST_ONLY = ("root", "state_dir", "served", "served_thin_client", "snapshot_scans", "snapshot_waits",
              "snapshot_refreshes", "cached_answers", "resident_writer")


def tenant_agent(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/agent`` for a tenant member: no host paths and no host-wide counters (:data:`_HOST_ONLY`),
    ``libvirt_uris`` only the local qemu ones (:data:`LOCAL_LIBVIRT_URIS`: the operator's ``--libvirt-uri``
    may name a host file, ``test:///PATH``; attach and detach are the operator's anyway), and what recovery
    did at start is the operator's (it names devices of every tenant), so ``recovered`` is empty."""
    doc = get_agent(agent, req)
    for key in _HOST_ONLY:
        doc.pop(key)
    doc["libvirt_uris"] = [u for u in doc["libvirt_uris"] if u in LOCAL_LIBVIRT_URIS]
    return {**doc, "recovered": {}}


def tenant_capacity(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/capacity`` as admission would answer a domain of the caller's tenant (``?tenant=`` is that
    tenant; another is Forbidden); guarantees at risk only its own; another tenant's exclusive GPU says
    ``another tenant``."""
    asked = req.query.get("tenant")
    if asked is not None and asked.lower() != req.tenant.lower():
        raise _forbidden(req, f"capacity for tenant {asked[:64]!r}")
    if tenancy.tenant_named_in(agent.store, req.tenant) is None:
        raise Forbidden(f"tenant {req.tenant!r} is not known on this host: it has no capacity here",
                        hint="ask the operator to add the tenant ('vgpuhost tenant add')")
    doc = capacity_doc(agent, req._replace(query={**req.query, "tenant": req.tenant}))
    me = req.tenant.lower()
    r = Redactor(agent, req, _mine(agent, req))
    doc["guarantees_at_risk"] = [g for g in doc["guarantees_at_risk"] if str(g["tenant"]).lower() == me]
    for g in doc["gpus"]:
        if g.get("exclusive") and g["exclusive"].lower() != me:
            g["exclusive"] = "another tenant"
    for p in doc["profiles"]:
        if "why_not" in p:
            p["why_not"] = r.text(p["why_not"])
    return doc


def tenant_vgpus(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/vgpus``: the vGPUs the caller's tenant's domains own."""
    mine = _mine(agent, req)
    doc = get_vgpus(agent, req)
    doc["vgpus"] = [v for v in doc["vgpus"] if v.get("owner") in mine]
    return doc


def tenant_domains(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/domains``: the caller's tenant's domains."""
    mine = _mine(agent, req)
    doc = domains_doc(agent.store)
    doc["domains"] = [d for d in doc["domains"] if d["uuid"] in mine]
    return doc


def tenant_tenants(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/tenants``: the caller's tenant alone (empty when the host does not know it)."""
    me = req.tenant.lower()
    doc = get_tenants(agent, req)
    doc["tenants"] = [t for t in doc["tenants"] if t["name"].lower() == me]
    return doc


def tenant_usage(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/usage``: the caller's tenant's entry alone."""
    me = req.tenant.lower()
    doc = get_usage(agent, req)
    doc["tenants"] = [t for t in doc["tenants"] if t["tenant"] and t["tenant"].lower() == me]
    return doc


_ANY_UUID = re.compile(r"(?<![\w.:+-])[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
                       + _AFTER)
#: where an audit row names a domain by its libvirt name: (field, pattern with the name as group ``n``)
_NAMED_AT = (("actor", re.compile(r"^hook (?P<n>.+?) pid=\d+$")),
             ("operation", re.compile(r"^(?:prepare|attach|detach|tenant bind|tenant unbind) (?P<n>.+?)(?: --live)?$")),
             ("operation", re.compile(r"^admission (?P<n>.+) (?P<id>\S+)$")),
             ("value", re.compile(r"domain '(?P<n>[^']*)'")))
_AUDIT_FIELDS = ("actor", "operation", "path", "value")
#: an audit operation naming a vGPU made or removed for a domain (no ``id``: the row's value is the vGPU's id)
_DEVICE_OF = re.compile(r"^(?:vgpu remove (?P<id>\S+)|vgpu create \S+) owner=(?P<owner>\S+)$")
_UUID_TEXT = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
#: the agent's admission row of a device for a domain named by UUID
_ADMISSION_OF = re.compile(r"^admission (?P<owner>" + _UUID_TEXT + r") (?P<id>\S+)$")
#: where a row says which domain it is about (its subject), by UUID: the operation's ``owner=UUID`` or its
#: verb's first argument, the path ``(domain) UUID``, a binding's or attach's value head
_SUBJECT_DOMAIN = (
    ("operation", re.compile(r"(?:owner=|^(?:admission|allocations of|allocate|release|prepare|attach|detach|"
                             r"tenant bind|tenant unbind|mig on-demand release) )(?P<d>" + _UUID_TEXT + r")"
                             r"(?![\w-])")),
    ("path", re.compile(r"^\(domain\) (?P<d>" + _UUID_TEXT + r")$")),
    ("value", re.compile(r"^(?:domain (?P<d>" + _UUID_TEXT + r"):|(?P<a>" + _UUID_TEXT + r") [+-])")))
#: where a row names its domain by its libvirt name (``prepare NAME``, ``admission NAME DEVICE``)
_SUBJECT_NAME = re.compile(r"^(?:prepare (?P<p>.+?)|admission (?P<a>.+) \S+)$")
#: the tenant an admitted row was admitted for (a refused one's tenant is in ``admission_refusals``:
#: :meth:`vgpuhost.io.state.StateStore.refusal_records`, never read from its text)
_ADMITTED_FOR = re.compile(r"^admitted [^;]*? for tenant '(?P<t>[^']*)'")


def known_domains(store: StateStore) -> set:
    """Every domain UUID the store knows: running, bound, owning a vGPU or a GPU, or holding allocations."""
    return set(store.active_domains()) | {r.owner for r in store.vgpu_records()} | \
        {r.owner for r in store.passthrough_records() if r.owner} | {row[1] for row in store.allocation_rows()} | \
        {row[0] for row in store.binding_rows()}


class AuditScope:
    """What a tenant member sees of the audit log (``GET /v1/audit``): which rows concern its tenant, and
    each shown field with everything else hidden.

    A row is shown when its subject is the tenant's (:meth:`_concerns`): the domain it is about by UUID
    is one of the tenant's (bound, holding allocations or devices:
    :func:`vgpuhost.ops.tenancy.tenant_domains`), an admission was the tenant's, its operation or path
    names a device recorded for one (vGPU ids, passthrough GPUs, allocations), it is the tenant's own
    ``tenant add|set|remove NAME``, or, a row about no domain, its value names one of those or says
    ``tenant=NAME``; a mention in another domain's row never selects it.  Domain names never select a
    row (another tenant's domain may be named like one of the tenant's, or like a profile).  In every
    shown field (actor, operation, path, value): every UUID not of the tenant's reads ``(another domain)``
    or ``(another vGPU)``; every domain name in the places a row names one (``hook NAME pid=``,
    ``admission NAME ID``, ``tenant bind NAME``, ``domain 'NAME'``) that is not the name of one of the
    tenant's domains reads ``(another domain)``, and those names, other running domains' names and other
    tenants' names (``tenant=X``, ``tenant 'X'``, any whole word) are hidden wherever else they occur."""

    def __init__(self, agent: Agent, req: Request, rows: List[Dict[str, Any]]):
        store = agent.store
        mine = _mine(agent, req)
        self.me = req.tenant
        ids = {d.lower() for d in mine}
        ids |= {r.id.lower() for r in store.vgpu_records() if r.owner in mine}
        ids |= {p.gpu for p in store.passthrough_records() if p.owner in mine}
        ids |= {row[0].lower() for row in store.allocation_rows() if row[1] in mine}
        # the devices the log records for them since (made, then removed or released): ``vgpu create|remove
        # ... owner=UUID`` and ``admission UUID ID`` (the agent's allocate) name them
        domains = {d.lower() for d in mine}
        for row in rows:
            op = str(row.get("operation") or "")
            m = _DEVICE_OF.match(op)
            if m and m.group("owner").lower() in domains:
                made = m.group("id") or str(row.get("value") or "")
                if _is_uuid(made.lower()):
                    ids.add(made.lower())
            m = _ADMISSION_OF.match(op)
            if m and m.group("owner").lower() in domains:
                ids.add(m.group("id").lower())      # a device admitted (or refused) for one of its domains
        self.ids = ids
        self.domains = {d.lower() for d in known_domains(store)}
        self.devices = {r.id.lower() for r in store.vgpu_records()} | \
            {row[0].lower() for row in store.allocation_rows()}
        names = store.active_domains()
        my_names = {names[d] for d in mine if names.get(d)}
        token = r"(?<![\w.:+-])(?:" + "|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True)) + \
            r")" + _AFTER if ids else r"(?!x)x"
        self.select = re.compile(token, re.IGNORECASE)
        me = re.escape(self.me)
        self.own_op = re.compile(r"^tenant (?:add|set|remove) " + me + "$", re.IGNORECASE)
        self.own_value = re.compile(r"(?<![\w.:+-])tenant=" + me + _AFTER, re.IGNORECASE)
        # the domains each libvirt name was given (running now; bound by name in the log): a row naming its
        # domain by a name that only other domains have is not T's (a name never selects a row)
        named: Dict[str, set] = {}
        for d, n in names.items():
            named.setdefault(n, set()).add(d.lower())
        for row in rows:
            op = str(row.get("operation") or "")
            if op.startswith(("tenant bind ", "tenant unbind ")):
                m = _SUBJECT_DOMAIN[2][1].match(str(row.get("value") or ""))
                if m and m.group("d"):
                    named.setdefault(op.split(" ", 2)[2], set()).add(m.group("d").lower())
        self.named = named
        self.my_domains = domains
        # the tenant each refusal admission weighed was for, from its own columns (schema 17), keyed by the
        # audit row's id: a refused row's text holds tenant-written names, so its tail is never read
        first = min((str(r.get("time") or "") for r in rows), default=None)
        self.refused_for = {r[0]: r[7] for r in store.refusal_records(since=first)} if rows else {}
        self.shown = [row for row in rows if self._concerns(row)]
        # names the shown rows give the tenant's own domains (a row of its domain names it) and all others
        seen = set()
        for row in rows:
            for field, rx in _NAMED_AT:
                for m in rx.finditer(str(row.get(field) or "")):
                    if _is_uuid(m.group("n").lower()):
                        continue        # a domain named by its UUID: the UUIDs' rule decides
                    seen.add(m.group("n"))
                    if "id" in rx.groupindex and m.group("id").lower() in ids:
                        my_names.add(m.group("n"))
            if self.select.search(str(row.get("value") or "")) and \
                    str(row.get("operation") or "").startswith(("tenant bind ", "tenant unbind ", "prepare ")):
                m = _NAMED_AT[1][1].match(str(row.get("operation") or ""))
                if m:
                    my_names.add(m.group("n"))
        self.my_names = my_names
        others = {n for n in seen | set(names.values()) if n and n not in my_names}
        self.other_names = re.compile(r"(?<![\w.:+-])(?:" + "|".join(
            re.escape(n) for n in sorted(others, key=len, reverse=True)) + r")" + _AFTER) if others else None
        tenants_ = {t for t in tenancy.tenants(store) if t.lower() != self.me.lower()}
        self.other_tenants = re.compile(r"(?<![\w.:+-])(?:" + "|".join(
            re.escape(t) for t in sorted(tenants_, key=len, reverse=True)) + r")" + _AFTER,
            re.IGNORECASE) if tenants_ else None

    def _concerns(self, row: Dict[str, Any]) -> bool:
        """Whether ``row`` is T's, decided by what the row is about, never by a mention of T's device in
        another's text (a refusal's "to free room" names the vGPUs that could make room, of any tenant): the
        domain it is about by UUID (:data:`_SUBJECT_DOMAIN`: T's or not); a domain named by a name only other
        domains have: not T's; an admission's tenant (a refusal's as admission recorded it apart in
        ``admission_refusals``, never its text; the admitted row's ``for tenant 'X'``); T's device in its operation or path; else, a row about no domain or tenant, T's
        tenant row or a whole-token mention of T's domain or device in its value."""
        op, path, value = (str(row.get(k) or "") for k in ("operation", "path", "value"))
        if self.own_op.match(op):
            return True
        for key, rx in _SUBJECT_DOMAIN:
            if key == "value" and not op.startswith(("tenant bind ", "tenant unbind ", "attach ", "detach ")):
                continue
            m = rx.search({"operation": op, "path": path, "value": value}[key])
            subject = next((g for g in m.groups() if g), None) if m else None
            if subject:
                return subject.lower() in self.my_domains
        m = _SUBJECT_NAME.match(op)
        if m:
            given = self.named.get(m.group("p") or m.group("a"))
            if given and not given & self.my_domains:
                return False
        if row.get("id") in self.refused_for:
            tenant = self.refused_for[row.get("id")]
            return bool(tenant) and tenant.lower() == self.me.lower()
        if op.startswith("admission ") or path == "(admission)":
            admitted = _ADMITTED_FOR.match(value)
            if admitted:
                return admitted.group("t").lower() == self.me.lower()
            if "; refusal=" in value and str(row.get("result") or "") == "refused":
                return False    # a refusal weighed before its tenant was recorded apart (schema 16): not by text
        if self.select.search(op) or self.select.search(path):
            return True
        return bool(self.own_value.search(value) or self.select.search(value))

    def _uuid(self, m: "re.Match[str]") -> str:
        u = m.group(0).lower()
        if u in self.ids:
            return m.group(0)
        if u in self.devices:
            return "(another vGPU)"
        before = m.string[max(0, m.start() - 8):m.start()]
        domain = u in self.domains or before.endswith(("owner=", "domain ", "bind ", "admission "))
        return "(another domain)" if domain else "(another vGPU)"

    def _tenant_value(self, m: "re.Match[str]") -> str:
        return m.group(0) if m.group(2).lower() == self.me.lower() else m.group(1) + "(another tenant)"

    def field(self, key: str, value: Any) -> Any:
        if not isinstance(value, str) or not value:
            return value
        out = value
        for field, rx in _NAMED_AT:
            if field == key:
                out = rx.sub(lambda m: m.group(0) if m.group("n") in self.my_names or _is_uuid(m.group("n").lower())
                             else
                             m.group(0)[:m.start("n") - m.start(0)] + "(another domain)" +
                             m.group(0)[m.end("n") - m.start(0):], out)
        out = _ANY_UUID.sub(self._uuid, out)
        out = re.sub(r"(tenant=)([^\s;,)]+)", self._tenant_value, out, flags=re.IGNORECASE)
        out = re.sub(r"(tenant ')([^']*)'", lambda m: m.group(0) if m.group(2).lower() == self.me.lower()
                     else "another tenant", out, flags=re.IGNORECASE)
        if self.other_names is not None:
            out = self.other_names.sub("(another domain)", out)
        if self.other_tenants is not None:
            out = self.other_tenants.sub("(another tenant)", out)
        return out

    def rows(self) -> List[Dict[str, Any]]:
        return [{k: self.field(k, v) if k in _AUDIT_FIELDS else v for k, v in row.items()} for row in self.shown]


def tenant_audit(agent: Agent, req: Request) -> Dict[str, Any]:
    """``GET /v1/audit``: the rows that concern the caller's tenant or its domains, everything else in
    them hidden (:class:`AuditScope`)."""
    doc = get_audit(agent, req)
    doc["rows"] = AuditScope(agent, req, doc["rows"]).rows()
    return doc


def tenant_allocate(agent: Agent, req: Request) -> Dict[str, Any]:
    """``POST /v1/domains/{uuid}/allocate`` for a domain of the caller's tenant only, admitted under the
    tenant's quota now (:func:`vgpuhost.ops.allocate.allocate_admitted`), not only at the domain's start."""
    owner = _own_domain(agent, req)
    profile, strategy, gpu, vid, anti, dry = _allocate_body(agent, req)
    if vid:
        # a free UUID may be one another domain's XML names (attached, not started): a tenant choosing it would
        # have that domain's next start refused as held (trial 8 T7); the tenant's vGPU gets a new UUID
        raise Forbidden(f"vgpu_uuid {clipped(vid)!r}: a member of tenant {req.tenant!r} does not choose a vGPU's "
                        "UUID", hint="omit vgpu_uuid: the answer's id is the new vGPU's UUID, to write in the "
                                     "domain's XML")

    if gpu is not None and agent.inventory().gpu(gpu) is None:
        # the operator's allocate and 'vgpu create' say so (ops/vgpu's pin check), not admission's "no GPU here
        # offers vGPU types", which sends the tenant to a host check it cannot run (trial 10b B5)
        raise InputError(f"no NVIDIA GPU at {gpu}", hint="'vgpuhost gpus' lists them")

    def run():
        # the operator's hook allow-list binds a tenant's vGPUs as it binds the hook's
        return allocate_admitted(agent.host, agent.store, agent.inventory, owner=owner, tenant=req.tenant,
                                 profile=profile, gpu=gpu, uuid=_uuid(vid) if vid else None,
                                 strategy=strategy, anti_affinity=anti, dry_run=dry, actor=req.actor,
                                 allowed=devices.load_allow(agent.host))
    return (run() if dry else agent.write(run)).as_dict()


def tenant_release(agent: Agent, req: Request) -> Dict[str, Any]:
    """``POST /v1/domains/{uuid}/release`` for a domain of the caller's tenant only, and only while it is
    not recorded running (the hook's ``release end`` frees a running domain's devices; a RefusedError,
    409, nothing changed)."""
    owner = _own_domain(agent, req)
    if owner in agent.store.active_domains():
        raise RefusedError(f"domain {owner} is running: its devices are released when it stops",
                           hint="stop the domain (its vGPUs and GPUs are released then), or ask the operator")
    return post_release(agent, req)


# ---------------------------------------------------------------------------
# the route table

class Route(NamedTuple):
    method: str
    template: str           # /v1/domains/{uuid}/allocate
    handler: Callable
    role: str               # the least of admin and read that may call it
    keys: Tuple[str, ...] = ()      # the JSON body's keys it takes (openapi.yaml's requestBody properties)
    query: Tuple[str, ...] = ()     # the query parameters it takes (openapi.yaml's ``in: query`` parameters)
    tenant: Optional[Callable] = None   # what a tenant member gets here (its scoped handler); None: 403

    @property
    def roles(self) -> Tuple[str, ...]:
        """The roles that may call it (openapi.yaml's ``x-vgpuhost-roles``): admin; read unless it changes
        the host; tenant where it has a tenant handler."""
        return (ADMIN,) + ((READ,) if self.role == READ else ()) + ((TENANT,) if self.tenant else ())

    def handler_for(self, req: "Request") -> Callable:
        """The handler serving ``req``'s role: the tenant handler for a tenant member."""
        return self.tenant if req.role == TENANT and self.tenant else self.handler


def check_keys(route: Route, body: Optional[Dict[str, Any]]) -> None:
    """InputError (400) naming the first key of ``body`` that ``route`` does not take (issue 15 #2: a
    misspelt ``dryrun`` must not make a real change)."""
    _refuse_unknown(body, route.keys, "key", f"in the body of {route.method} {route.template}",
                    "no keys (send no body, or {})")


def check_query(route: Route, query: Optional[Dict[str, str]]) -> None:
    """InputError (400) naming the first query parameter ``route`` does not take: a misspelt
    ``?availble=1`` must not quietly answer with every type, as an unknown body key is refused."""
    _refuse_unknown(query, route.query, "query parameter", f"in {route.method} {route.template}",
                    "no query parameters")


def _refuse_unknown(given, allowed, what: str, where: str, none_text: str) -> None:
    unknown = sorted(set(given or ()) - set(allowed))
    if unknown:
        shown = "".join(c if c.isprintable() else "?" for c in unknown[0][:64])
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise InputError(f"unknown {what} {shown!r}{more} {where}",
                         hint=f"it takes {', '.join(allowed) if allowed else none_text}")


_VGPU_KEYS = vgpu.VgpuCreateRequest.JSON_KEYS + ("dry_run",)
_ALLOCATE_KEYS = ("profile", "gpu", "strategy", "vgpu_uuid", "anti_affinity", "dry_run")
_HOOK_KEYS = ("xml", "name", "root", "state_dir", "timeout_s")
_LAYOUT_KEYS = ("config", "source", "layout")
_TENANT_KEYS = _TENANT_TEXT + _TENANT_LISTS + ("allow_oversubscribe",)
_SCHEDULER_KEYS = ("policy", "timeslice_ms", "frequency_hz", "avg_factor", "gpus", "all")

ROUTES: Tuple[Route, ...] = (
    Route("GET", "/v1/agent", get_agent, READ, tenant=tenant_agent),
    Route("GET", "/v1/openapi", get_openapi, READ, tenant=get_openapi),
    Route("GET", "/v1/inventory", get_inventory, READ),
    Route("GET", "/v1/types", get_types, READ, query=("gpu", "available"), tenant=get_types),
    Route("GET", "/v1/capacity", get_capacity, READ, query=("profile", "tenant"),
          tenant=tenant_capacity),
    Route("GET", "/v1/vgpus", get_vgpus, READ, tenant=tenant_vgpus),
    Route("GET", "/v1/domains", get_domains, READ, tenant=tenant_domains),
    Route("GET", "/v1/tenants", get_tenants, READ, tenant=tenant_tenants),
    Route("GET", "/v1/usage", get_usage, READ, tenant=tenant_usage),
    Route("GET", "/v1/usage/hourly", get_usage_hourly, READ, query=("period", "device"), tenant=tenant_usage_hourly),
    Route("GET", "/v1/bill", get_bill, READ, query=("period",), tenant=tenant_bill),
    Route("GET", "/v1/audit", get_audit, READ, query=("since",), tenant=tenant_audit),
    Route("GET", "/v1/metrics", get_metrics, READ),
    Route("POST", "/v1/vgpus", post_vgpu_create, ADMIN, _VGPU_KEYS),
    Route("POST", "/v1/vgpus/{id}/remove", post_vgpu_remove, ADMIN, ("owner", "dry_run")),
    Route("POST", "/v1/domains/{uuid}/allocate", post_allocate, ADMIN, _ALLOCATE_KEYS, tenant=tenant_allocate),
    Route("POST", "/v1/domains/{uuid}/release", post_release, ADMIN, tenant=tenant_release),
    Route("POST", "/v1/hook/prepare", post_hook_prepare, ADMIN, _HOOK_KEYS),
    Route("POST", "/v1/hook/release", post_hook_release, ADMIN, _HOOK_KEYS),
    Route("POST", "/v1/plan", post_plan, READ, _LAYOUT_KEYS),
    Route("POST", "/v1/assert", post_assert, READ, _LAYOUT_KEYS),
    Route("POST", "/v1/apply", post_apply, ADMIN, _LAYOUT_KEYS + ("progress",)),
    Route("POST", "/v1/reconcile", post_reconcile, ADMIN, ("check",)),
    Route("POST", "/v1/passthrough/{bdf}/prepare", post_passthrough_prepare, ADMIN, ("allow_boot_vga", "persist")),
    Route("POST", "/v1/passthrough/{bdf}/release", post_passthrough_release, ADMIN, ("persist",)),
    Route("POST", "/v1/domains/{domain}/attach", post_attach, ADMIN, AttachRequest.JSON_KEYS + ("uri",)),
    Route("POST", "/v1/domains/{domain}/detach", post_detach, ADMIN, ("device", "all", "uri")),
    Route("POST", "/v1/domains/{domain}/bind", post_bind, ADMIN, ("tenant", "qos", "unbind", "dry_run", "uri")),
    Route("POST", "/v1/tenants", post_tenant_add, ADMIN, ("name",) + _TENANT_KEYS),
    Route("POST", "/v1/tenants/{name}/set", post_tenant_set, ADMIN, _TENANT_KEYS),
    Route("POST", "/v1/tenants/{name}/remove", post_tenant_remove, ADMIN),
    Route("POST", "/v1/mig/{bdf}/enable", post_mig_enable, ADMIN),
    Route("POST", "/v1/mig/{bdf}/disable", post_mig_disable, ADMIN),
    Route("POST", "/v1/mig/{bdf}/apply", post_mig_apply, ADMIN, ("layout",)),
    Route("POST", "/v1/scheduler", post_scheduler, ADMIN, _SCHEDULER_KEYS),
    Route("POST", "/v1/gpus/{bdf}/mixed-size", post_vgpu_mode, ADMIN, ("mixed_size",)),
    Route("GET", "/v1/gpus/health", get_gpu_health, READ),
    Route("GET", "/v1/gpus/{bdf}/drain", get_gpu_drain, READ),
    Route("POST", "/v1/migrate/check", post_migrate_check, READ,
          ("schema", "name", "uuid", "strategy", "anti_affinity", "tenant", "qos", "manager_version", "devices")),
    Route("POST", "/v1/gpus/{bdf}/cordon", post_gpu_cordon, ADMIN, ("reason", "dry_run")),
    Route("POST", "/v1/gpus/{bdf}/uncordon", post_gpu_uncordon, ADMIN, ("dry_run",)),
)


def _compile(template: str) -> "re.Pattern[str]":
    return re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(template)) + "$")


_COMPILED = [(r, _compile(r.template)) for r in ROUTES]


def match(method: str, path: str) -> Tuple[Optional[Route], Dict[str, str], List[str]]:
    """``(route, path params, methods allowed on path)``; route None when nothing matches
    (405 when the list of methods is not empty, else 404)."""
    allowed = []
    for route, rx in _COMPILED:
        m = rx.match(path)
        if m:
            if route.method == method:
                return route, m.groupdict(), [route.method]
            allowed.append(route.method)
    return None, {}, allowed
