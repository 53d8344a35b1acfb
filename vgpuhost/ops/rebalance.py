"""The capacity reconciler: move empty GPUs toward demand (``vgpuhost rebalance``, the agent's loop).

Owns: reading the reconciler's config (:func:`load_bounds`, ``<root>/etc/vgpuhost/rebalance.yaml``
unless named), gathering the facts it decides on under the host lock (:func:`facts`: the recorded
pools, which GPUs are empty, the refused admissions of the window from the audit log, each pool's
metered allocated time over two trend windows, each pool's metered demand per hour for the forecast
(:func:`class_history`), the moves of the last hour, the tenants and allocations for the guarantee check), asking :func:`vgpuhost.policy.rebalance.decide`, and running
each move as a plan (:func:`vgpuhost.plan.rebalance.plan_move`) through the one Executor under a
journal entry of kind ``rebalance`` (:func:`rebalance`; :mod:`vgpuhost.ops.rebalancejournal` ends
one a kill left open).  Must not: decide (policy does),
touch a GPU that holds anything, or stop a VM.

Locks: the ``layout`` lock ``apply`` holds from its plan to its pool records
(:data:`vgpuhost.ops.layout.LOCK`), so a move never lands inside an apply (trial 10 F7); then the host
lock admission decides under (``tenancy``), so no start is admitted while a move is decided and made;
then each moved GPU's lock (its NVML write).  The order of ``apply`` (layout, then what its steps take)
and of the qemu hook (host, then GPU), which takes no layout lock.
"""

from __future__ import annotations

import calendar
import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..io.backends import open_backend
from ..io.files import exists
from ..io.hostroot import HostRoot
from ..io.locks import file_lock
from ..io.process import actor as actor_name
from ..io.state import StateStore, gpu_alloc_by_hour, usage_rows
from ..io.sysfs import Sysfs
from ..io.yamlutil import read_text_file
from ..model.concepts import OwnerKind, QosClass
from ..model.errors import RefusedError, VgpuhostError
from ..model.nvml import SchedulerState
from ..model.records import JournalEntry
from ..model.values import PciAddress
from ..model.yamldoc import load_located
from ..observe.inventory import discover
from ..observe.vgpus import list_vgpus
from ..plan.executor import Executor
from ..plan.journal import Journal
from ..plan.rebalance import AUDIT_PATH, OPERATION, plan_move
from ..plan.steps import SetScheduler
from ..policy import offers as vgpu_offers
from ..policy import rebalance as pol
from ..policy.admission import DEFAULT_POOL, DEFAULT_POOL_SERVES, pool_of
from . import gputime, health, tenancy
from .rebalancejournal import KIND
from .health import out_of_service
from .layout import LOCK as LAYOUT_LOCK

SCHEMA = "vgpuhost.rebalance/v1"
#: where the reconciler's settings live unless named (relative to the host root's etc)
CONFIG = ("vgpuhost", "rebalance.yaml")
#: the audit row of a refused start admission wrote
ADMISSION_PATH = "(admission)"
#: the result of the audit row a right-sized start writes when it falls back to the profile asked
RESIZE_FALLBACK = "resize-fallback"


def config_path(host: HostRoot) -> str:
    return str(host.etc(*CONFIG))


def load_bounds(host: HostRoot, path: Optional[str] = None) -> pol.Bounds:
    """The reconciler's :class:`~vgpuhost.policy.rebalance.Bounds` from ``path`` (default
    :func:`config_path`; that default missing: the defaults, off in the agent).  Raises InputError,
    one line naming the file and the field, for a file that is not valid."""
    where = path or config_path(host)
    if path is None and not exists(where):
        return pol.Bounds()
    text = read_text_file(where, "rebalance config")
    return pol.parse_bounds(load_located(text, where).data, where)


@dataclass
class Facts:
    """What one decision is made on (see :func:`facts`)."""

    pools: list
    gpus: List[pol.GpuFacts]
    refusals: List[pol.Refusal]
    tenants: dict
    held: list
    host_gpus: list
    trends: Dict[str, pol.Trend]
    moves_last_hour: int
    minute_of_day: int
    inventory: Any = None
    moved: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    history: Dict[str, List[float]] = field(default_factory=dict)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))


def _advised_refusals(rows: Sequence[Any]) -> set:
    """The ids of the refused admission rows that were a right-sized start's first try (the advised,
    smaller profile: ops.devices' ``resize-fallback`` row follows, and the start asks again with the
    profile asked): not demand, so one start counts once (its second try's row, if refused, counts)."""
    out: set = set()
    last: Dict[str, int] = {}       # domain name -> id of its newest refused admission row so far
    for r in rows:
        if r.path == ADMISSION_PATH and r.result == "refused" and r.operation.startswith("admission "):
            last[r.operation[len("admission "):].rsplit(" ", 1)[0]] = r.id
        elif r.result == RESIZE_FALLBACK and r.operation.startswith("prepare "):
            got = last.pop(r.operation[len("prepare "):], None)
            if got is not None:
                out.add(got)
    return out


def facts(host: HostRoot, store: StateStore, bounds: pol.Bounds, *, now_s: Optional[float] = None) -> Facts:
    """Read the host and the store once for a decision (under the caller's host lock).

    A GPU is busy (never moved) when it holds any vGPU (on the host or recorded, any owner), an
    allocation, a device reserved for an incoming migration that has not expired (:func:`reserved_gpus`), is off the ``nvidia`` driver (passed through), is in MIG mode or out of service.
    Refusals: the starts admission refused in the last ``bounds.window_min`` minutes, as it stored
    them in their own columns (``StateStore.refusal_records``; never parsed from an audit row's value)
    that :func:`vgpuhost.policy.rebalance.refusal_of` reads as demand for room (by the refusal code),
    one per domain and profile (:func:`vgpuhost.policy.rebalance.distinct_starts`), less a right-sized start's first try (:func:`_advised_refusals`) and those a move of
    the window already answered (:func:`vgpuhost.policy.rebalance.pending`).  Trends: each pool's
    metered vGPU allocated seconds over the last ``trend_hours`` and the span before.  ``moved``: the
    GPUs the moves of the window put where they are (the hold-down); each empty GPU's mixed-size mode
    from NVML (False where it cannot say); ``history``: each pool's metered demand per hour
    (:func:`class_history` shared among the pools by the classes they serve)."""
    now = time.time() if now_s is None else now_s
    inv = discover(Sysfs(host))
    records = store.vgpu_records()
    held_raw = tenancy.allocations(store, inv)
    held = gputime.with_use(gputime.history(store, now_s=now), held_raw)
    oos = {str(g) for g in out_of_service(store)}
    holding: Dict[str, int] = {}
    for e in list_vgpus(inv, records):
        if e.gpu is not None:
            holding[str(e.gpu)] = holding.get(str(e.gpu), 0) + 1
    for a in held_raw:
        if a.gpu and not holding.get(a.gpu):
            holding[a.gpu] = 1          # an allocation with no vGPU seen (passthrough, one being made)
    reserved = reserved_gpus(store, now)
    offered: Dict[str, set] = {}
    for t in inv.vgpu_types:
        offered.setdefault(str(t.gpu), set()).add(t.name.lower())
    gpus = []
    nvml = functools.lru_cache(maxsize=1)(lambda: open_backend(host))     # opened once, if asked
    for g in inv.gpus:
        addr = str(g.address)
        mig = bool(g.mig and g.mig.get("current"))
        busy = ("out of service" if addr in oos else f"holds {holding[addr]} device(s)" if holding.get(addr)
                else f"reserved for the incoming migration of {reserved[addr]}" if addr in reserved
                else "passed through or off the nvidia driver" if g.pci.driver != "nvidia"
                else "in MIG mode" if mig else "")
        gpus.append(pol.GpuFacts(addr, busy, tuple(sorted(offered.get(addr, ()))), g.framebuffer_mib or 0,
                                 not busy and _mixed_size(nvml, g.address)))
    ts = tenancy.tenants(store)
    qos_of = {n.lower(): t.qos for n, t in ts.items()}
    refusals, served = [], {}
    since = _iso(now - bounds.window_min * 60)
    rows = store.audit_rows(since=since)
    advised = _advised_refusals(rows)
    # demand: what admission stored for each start it refused (its own columns), never an audit row's
    # value, which echoes the domain's name (trial 10 F4); one per domain and profile (F5)
    for audit_id, at, domain, _device, code, profile, qos, tenant in store.refusal_records(since=since):
        got = pol.refusal_of(at, code, profile, qos, tenant, qos_of, domain) if audit_id not in advised else None
        if got is not None:
            refusals.append(got)
    for r in rows:
        if r.path == AUDIT_PATH and r.operation.startswith(OPERATION) and r.result == "ok":
            group = pol.served_by(r.value)
            if group is not None and ": undo: " not in r.value:
                served[group] = max(served.get(group, ""), r.time)
    refusals = pol.pending(pol.distinct_starts(refusals), served)
    seen = store.seen_types() + vgpu_offers.seen_rows(inv)
    host_gpus = tenancy.host_gpus(inv, seen, tenancy._type_fb(inv, store), tenancy._gpu_slices(inv, seen))
    pools = tenancy.pools(store)
    span = bounds.trend_hours * 3600
    since = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now - 2 * span))
    cut = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now - span))
    sums: Dict[str, List[float]] = {}
    for hour, gpu, alloc_s in gpu_alloc_by_hour(store, since):
        name = pool_of(pools, gpu).name.lower()
        pair = sums.setdefault(name, [0.0, 0.0])
        pair[0 if hour >= cut else 1] += alloc_s or 0.0
    trends = {n: pol.Trend(a, b) for n, (a, b) in sums.items()}
    moved = sum(1 for r in store.audit_rows(since=_iso(now - 3600))
                if r.path == AUDIT_PATH and r.operation.startswith(OPERATION) and r.result == "ok"
                and ": undo: " not in r.value)
    recent: Dict[str, Tuple[str, str]] = {}      # the hold-down: GPUs a move of the window put where they are
    for r in store.audit_rows(since=_iso(now - bounds.window_min * 60)):
        if r.path == AUDIT_PATH and r.operation.startswith(OPERATION) and r.result == "ok":
            got = pol.moved_to(r.value)
            if got is not None and ": undo: " not in r.value and r.time >= recent.get(got[0], ("",))[0]:
                recent[got[0]] = (r.time, got[1])
    tm = time.gmtime(now)
    names = [p.name for p in pools] + ([DEFAULT_POOL] if any(pool_of(pools, g.gpu).name == DEFAULT_POOL
                                                               for g in gpus) else [])
    history = pol.pool_history(class_history(store, now, bounds), pools, names)
    return Facts(pools, gpus, refusals, ts, held, host_gpus, trends, moved, tm.tm_hour * 60 + tm.tm_min, inv,
                 recent, history)


def reserved_gpus(store: StateStore, now: float) -> Dict[str, str]:
    """``{GPU BDF: domain name}`` of the GPUs holding a device reserved for an incoming live migration
    (``migrate begin``, :mod:`vgpuhost.ops.migrate`) that has not expired at ``now`` (seconds since the
    epoch): busy for the reconciler, as a held device is (trial 10 F1)."""
    at = _iso(now)
    out: Dict[str, str] = {}
    for _device, _owner, name, gpu, _kind, _profile, expires, *_ in store.reservation_rows():
        if gpu and expires[:19] >= at:
            out.setdefault(str(gpu), name)
    return out


def class_history(store: StateStore, now: float, bounds: pol.Bounds) -> Dict[str, List[float]]:
    """Each QoS class's metered demand per hour over the last ``bounds.history_days`` days and a day
    (the forecast reads the same hours of each day, and the hours after them): ``{class: [mean
    time-sliced vGPUs held in the hour]}``, oldest first, the last value the last whole hour before
    ``now``; from the hourly rollups (``usage_hourly``: allocated seconds / 3600, by the class each
    row records; none recorded: best-effort).  Rows of devices no domain held (a layout's idle vGPUs:
    no domain UUID) are room, not demand, and are left out (trial 10 F13).  Empty when ``history_days`` or ``horizon_h`` is 0."""
    if not bounds.history_days or not bounds.horizon_h:
        return {}
    hours = (bounds.history_days + 1) * 24
    end = int(now // 3600) * 3600                 # the hour now began: history ends before it
    origin = end - hours * 3600
    out: Dict[str, List[float]] = {}
    for r in usage_rows(store, time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(origin)),
                        time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(end))):
        if r.kind != "vgpu" or not r.domain_uuid:
            continue
        i = (calendar.timegm(time.strptime(r.hour, "%Y-%m-%dT%H:00:00Z")) - origin) // 3600
        if 0 <= i < hours:
            out.setdefault(r.qos or str(QosClass.BEST_EFFORT), [0.0] * hours)[int(i)] += (r.alloc_s or 0.0) / 3600
    return out


def _mixed_size(nvml: Callable[[], Any], bdf: PciAddress) -> bool:
    """Whether NVML (``nvml()``: the backend, opened once) says the empty GPU ``bdf`` runs mixed-size
    mode (False where it cannot say: no NVML, not supported)."""
    try:
        return bool(nvml().heterogeneous_mode(bdf))
    except VgpuhostError:
        return False


@dataclass
class Result:
    """What :func:`rebalance` decided and did: ``decision``, ``done`` (moves made), ``failed`` (one
    line per move that failed and was undone), ``plans`` (the steps of each move, in words)."""

    decision: pol.Decision
    dry_run: bool
    bounds: pol.Bounds
    plans: List[Tuple[pol.Move, List[str]]] = field(default_factory=list)
    done: List[pol.Move] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return {"schema": SCHEMA, "dry_run": self.dry_run, "changed": bool(self.done),
                "moves": [dict(m.as_dict(), steps=steps, done=m in self.done) for m, steps in self.plans],
                "held": list(self.decision.held), "failed": list(self.failed),
                "demand": [dict(d, pool=n) for n, d in self.decision.demand],
                "bounds": self.bounds.as_dict()}

    def text(self) -> str:
        lines = []
        verb = "would move" if self.dry_run else "moved"
        for m, steps in self.plans:
            if self.dry_run or m in self.done:
                lines.append(f"{verb} GPU {m.gpu}: pool {m.from_pool} -> {m.to_pool}: {m.reason}")
                lines += [f"  {i}. {s}" for i, s in enumerate(steps, 1)]
        lines += [f"failed: {f}" for f in self.failed]
        lines += [f"held: {h}" for h in self.decision.held]
        if not lines:
            lines.append("nothing to move: no refused start, forecast need or rising pool calls for empty capacity")
        return "\n".join(lines)


def rebalance(host: HostRoot, store: StateStore, bounds: pol.Bounds, *, dry_run: bool = False,
              actor: Optional[str] = None, now_s: Optional[float] = None,
              progress: Optional[Callable[[int, int, object, str], None]] = None) -> Result:
    """Decide and (unless ``dry_run``) make the moves, each a plan run by the Executor.

    Under the ``layout`` lock (no ``apply`` runs meanwhile) and the host lock: read the facts (:func:`facts`), decide
    (:func:`vgpuhost.policy.rebalance.decide`); then per move, under the GPU's lock: check it is
    still empty (NVML: no vGPU active), open a journal entry (kind ``rebalance``, the GPU's pools and
    scheduler state before and after), run the steps (scheduler, then the pool record with its
    audit row naming the demand), close the entry.  A step that fails undoes the steps before it
    (the Executor) and the move is listed in ``failed``; the next moves still run.  ``progress(i, n,
    step, state)`` hears of each step (``start`` / ``done``).  Raises HostEnvironmentError when NVML
    is needed and missing, TransientError when a lock cannot be had (an ``apply`` holding the
    ``layout`` lock longer than the lock's timeout).
    """
    who = actor or f"{actor_name()} rebalance"
    with file_lock(store.state_dir, LAYOUT_LOCK), tenancy.host_lock(store):
        f = facts(host, store, bounds, now_s=now_s)
        decision = pol.decide(pools=f.pools, gpus=f.gpus, refusals=f.refusals, tenants=f.tenants, held=f.held,
                              host_gpus=f.host_gpus, bounds=bounds, minute_of_day=f.minute_of_day,
                              moves_last_hour=f.moves_last_hour, trends=f.trends, moved=f.moved,
                              history=f.history)
        result = Result(decision, dry_run, bounds)
        if not decision.moves:
            return result
        backend = open_backend(host)
        pools = {p.name.lower(): p for p in f.pools}

        def classes_of(name: str) -> Tuple[str, ...]:
            p = pools.get(name.lower())
            return tuple(p.classes) if p is not None else tuple(DEFAULT_POOL_SERVES)

        def policy_of(name: str) -> str:
            p = pools.get(name.lower())
            return p.policy if p is not None else ""

        for m in decision.moves:
            bdf = PciAddress.parse(m.gpu)
            try:
                now_state = backend.scheduler_state(bdf)
            except VgpuhostError:
                now_state = None
            steps = plan_move(m, now_state, classes=classes_of(m.to_pool), was_policy=policy_of(m.from_pool),
                              was_classes=classes_of(m.from_pool))
            result.plans.append((m, [s.describe(host) for s in steps]))
            if dry_run:
                continue
            try:
                _run_move(host, store, backend, m, steps, now_state, who, progress)
                result.done.append(m)
            except VgpuhostError as e:
                result.failed.append(f"GPU {m.gpu} to pool {m.to_pool}: {e.one_line()} (undone)")
        return result


def _run_move(host: HostRoot, store: StateStore, backend, m: pol.Move, steps: Sequence, before: Optional[SchedulerState],
              actor: str, progress) -> None:
    with file_lock(store.state_dir, f"gpu-{m.gpu}"):
        running = backend.active_vgpus(PciAddress.parse(m.gpu))
        if running:
            raise RefusedError(f"GPU {m.gpu} has {running} vGPU(s) running now: it is not moved",
                               hint="the reconciler never touches a busy GPU")
        reserved = reserved_gpus(store, time.time()).get(m.gpu)
        if reserved is not None:
            raise RefusedError(f"GPU {m.gpu} holds a device reserved for the incoming migration of "
                               f"{reserved!r}: it is not moved", hint="the reconciler never touches a busy GPU")
        device = {"gpu": m.gpu, "from_pool": m.from_pool, "to_pool": m.to_pool,
                  "scheduler_before": asdict(before) if before is not None else None,
                  "policy_after": m.policy or None, "reason": m.reason}
        journal = Journal.start(store, kind=KIND, operation=f"{OPERATION} {m.gpu} {m.from_pool} -> {m.to_pool}",
                                owner=str(OwnerKind.LAYOUT), actor=actor, gpu=m.gpu, group=None,
                                devices=[device], steps=[s.describe(host) for s in steps])
        ex = Executor(host, store, actor=actor, operation=f"{OPERATION} {m.gpu}", backend=backend, journal=journal)
        if progress is not None:
            ex.journal = _Told(journal, progress, len(steps))
        with journal:
            try:
                ex.run(steps)
            except VgpuhostError as e:
                # the GPU failed (NVML GPU_IS_LOST): out of service from now on (issue 27); the error goes on
                if health.failed_write(store, PciAddress.parse(m.gpu), e, ex.failed.describe(host)
                                       if ex.failed is not None else "moving it", actor=actor,
                                       operation=ex.operation):
                    e.message += health.MARKED
                raise


class _Told:
    """The journal seam, also telling ``progress`` of each step done (the kill sweep's hook)."""

    def __init__(self, journal: Journal, progress, n: int):
        self.journal, self.progress, self.n = journal, progress, n

    def begin(self, executor, steps) -> None:
        self.journal.begin(executor, steps)
        self.progress(0, self.n, None, "start")

    def step_done(self, executor, index: int, step) -> None:
        self.journal.step_done(executor, index, step)
        self.progress(index + 1, self.n, step, "done")

    def end(self, executor, error) -> None:
        self.journal.end(executor, error)


__all__ = ["SCHEMA", "KIND", "CONFIG", "config_path", "load_bounds", "facts", "Facts", "reserved_gpus", "Result", "rebalance",
           "KIND"]
