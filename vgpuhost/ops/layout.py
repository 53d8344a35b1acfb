"""Declarative layouts: plan, apply and assert a config's layout on a host.

Owns: the operations over the pure planner (:mod:`vgpuhost.plan.layout`) —
:func:`plan` and :func:`check` (observe the host once, scoped to the GPUs the
layout may select, then plan or list the drift) and :func:`apply` (observe ->
plan -> run exactly those steps through the one
:class:`~vgpuhost.plan.executor.Executor` -> observe again and assert) — and
the binding, in the executor's context, of each layout step type to the
operation that runs it (:func:`handlers`): :func:`vgpuhost.ops.vgpu.create` /
:func:`~vgpuhost.ops.vgpu.remove`, :func:`vgpuhost.ops.mig.set_mode` /
:func:`~vgpuhost.ops.mig.apply`, :func:`vgpuhost.ops.scheduler.mixed_size` /
:func:`~vgpuhost.ops.scheduler.set_runtime`,
:func:`vgpuhost.ops.passthrough.prepare` / :func:`~vgpuhost.ops.passthrough.release`
— which take their locks, write the audit rows and read back.  Must not:
decide what to do (the planner does) or write sysfs, NVML or config files
itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..io.hostroot import HostRoot
from ..io.locks import file_lock
from ..io.process import actor as actor_name
from ..io.state import StateStore
from ..model.errors import DeviceError, InputError, RefusedError, VgpuhostError
from ..model.values import PciAddress
from ..observe.hostview import HostView, observe, refresh
from ..observe.inventory import gpu_part
from ..plan import layout as planner
from ..plan.executor import Executor
from ..plan.layout import (
    KINDS, OPERATOR_MARK, PHASES, REBOOT_MARK, RESET_MARK, Drift, LayoutChangeMigMode, LayoutCreateVgpus,
    LayoutMakeGpuInstances, LayoutPreparePassthrough, LayoutRecreateVgpu, LayoutReleasePassthrough, LayoutRemoveVgpu,
    LayoutSetMixedSize, LayoutSetScheduler, LayoutStep, Plan, Report, reboot_step
)
from ..policy import compute
from ..policy.config import Config
from ..policy.admission import REBALANCE_MOVED
from ..policy.placement import LAYOUT
from . import gputime, mig, migdemand, passthrough, scheduler, tenancy, vgpu
from .health import out_of_service

SCHEMA_APPLY = "vgpuhost.apply/v1"


@dataclass
class ApplyResult:
    """What :func:`apply` did: ``done`` (executed steps), ``skipped`` (steps of a
    GPU whose MIG mode change stays pending), ``reboot`` (reported), and
    ``drift_after`` (the check after; only reboot-marked lines may remain)."""

    plan: Plan
    done: List[LayoutStep] = field(default_factory=list)
    skipped: List[LayoutStep] = field(default_factory=list)
    reboot: List[Report] = field(default_factory=list)
    drift_after: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    recorded: bool = False      # apply recorded a change beside the devices' (pools, MIG on demand)

    @property
    def changed(self) -> bool:
        return bool(self.done)

    def as_dict(self) -> Dict[str, Any]:
        return {"schema": SCHEMA_APPLY, "layout": self.plan.layout, "source": self.plan.source,
                "changed": self.changed, "done": [s.as_dict() for s in self.done],
                "skipped": [s.as_dict() for s in self.skipped], "reboot": [s.as_dict() for s in self.reboot],
                "drift_after": list(self.drift_after), "notes": list(self.notes), "recorded": self.recorded}

    def text(self) -> str:
        return apply_text(self.as_dict())


def apply_text(doc: dict) -> str:
    """What ``apply`` prints for its ``vgpuhost.apply/v1`` document, made here or by the agent."""
    head = f"layout {doc['layout']!r} ({doc['source']})"
    done = doc["done"]
    # a record apply made (pools, MIG on demand) is not "nothing to do"
    lines = [f"{head}: applied {len(done)} step{'s' if len(done) != 1 else ''}" if done
             else f"{head}: the host's devices match; recorded what the notes say" if doc.get("recorded")
             else f"{head}: the host matches; nothing to do"]
    for i, s in enumerate(done, 1):
        lines.append(f"  {i:>2}. {s['kind']:<12} {s['target']:<12}  {s['action']}")
    for s in doc["skipped"]:
        lines.append(f"  skipped: {s['kind']} {s['target']}: {s['action']}")
    if doc["reboot"]:
        lines.append("reported, never done by vgpuhost (take effect at boot or GPU reset):")
        lines += [f"   - {s['kind']:<12} {s['target']:<12}  {s['action']}" for s in doc["reboot"]]
    if doc["drift_after"]:
        lines.append("still differs (until then):")
        lines += [f"  {d}" for d in doc["drift_after"]]
    lines += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# observe -> plan

def view_for(host: HostRoot, store: StateStore, cfg: Config, layout: Optional[str] = None) -> HostView:
    """One :class:`HostView` for ``layout``: NVML facts and driverctl overrides for the GPUs
    it may select only; NVML not opened for a passthrough-only layout.  Raises InputError for
    an unknown layout, HostEnvironmentError when ``host`` is no host root."""
    gpus, nvml = planner.scope(cfg, layout)
    return observe(host, store, gpus=gpus, nvml=nvml)


def health_blocks(store: StateStore, p: Plan) -> List[str]:
    """What :func:`plan` and :func:`apply` block for GPU health: one line per GPU out of service (unhealthy
    or cordoned, :func:`vgpuhost.ops.health.out_of_service`) that a step of ``p`` would place on or change
    (every step but a vGPU removal and a passthrough release, which free it), naming the GPU, why it is out
    and the first such step.  Empty when every GPU a step changes is in service (one store query)."""
    oos = out_of_service(store)
    if not oos:
        return []
    out: Dict[str, str] = {}
    for s in p.steps:
        if isinstance(s, (LayoutRemoveVgpu, LayoutReleasePassthrough)) or s.target == "host":
            continue
        gpu = PciAddress.parse(s.target)
        if gpu in oos and s.target not in out:
            out[s.target] = (f"{s.target} is out of service ({oos[gpu]}): step '{s.kind} {s.action}' needs it; "
                             f"'vgpuhost gpu uncordon {s.target}' after repair, or select another GPU")
    return list(out.values())


def plan(host: HostRoot, store: StateStore, cfg: Config, layout: Optional[str] = None) -> Plan:
    """The ordered steps that bring ``host`` to ``layout`` (default: the config's default).

    Observes the host once (sysfs inventory, the state store's records, NVML)
    and plans over that snapshot (:func:`vgpuhost.plan.layout.plan`): nothing is
    written.  Raises InputError (``FILE:LINE:``) when the layout does not suit
    this host (a type the GPU does not offer, a MIG layout that cannot fit it,
    two entries selecting one GPU) and HostEnvironmentError when NVML is needed
    and missing.
    """
    view = view_for(host, store, cfg, layout)
    p = planner.plan(cfg, layout, view)
    p.blocked += [b for b in health_blocks(store, p) if b not in p.blocked]   # what apply refuses, plan shows
    new = planner.pools(cfg, layout, view)
    mixed = {e.pool.name.lower() for e in cfg.layout(layout).entries if e.pool is not None and e.pool.mixed_size}
    for pl in new:
        p.notes.append(f"pool {pl.name} ({pl.policy}, serves {', '.join(pl.classes)}"
                       + (f", compute ceiling {pl.ceiling:g}" if pl.ceiling is not None else "")
                       + (", mixed-size" if pl.name.lower() in mixed else "") + "): "
                       + (", ".join(pl.gpus) or "selects no GPU here") + " (recorded by apply, for admission)")
    p.notes += ceiling_notes(store, view, new)
    p.notes += [f"MIG on demand {'on' if on else 'off'} for {gpu} (recorded by apply)"
                for gpu, on in on_demand_changes(store, cfg, layout, view)]
    try:
        _pools(store, cfg, layout, view)            # what apply refuses before any change, plan shows
    except (RefusedError, InputError) as e:
        if e.message not in p.blocked:
            p.blocked.append(e.message)
    return p


def ceiling_notes(store: StateStore, view: HostView, new) -> List[str]:
    """One note per pool whose compute ceiling ``new`` (the layout's pools) changes from the recorded one:
    ``pool NAME: compute ceiling 0.3 -> 0.1 (apply records it)``, and where the lower ceiling is under
    what the running vGPUs on a GPU of it expect (:func:`vgpuhost.ops.gputime.gpu_figures`), that GPU's
    expected demand and the starved demand it leaves (new starts there are refused with ``gpu-time``)."""
    old = {p.name.lower(): p for p in tenancy.pools(store)} if new else {}
    notes: List[str] = []
    figures = None
    for pl in new:
        was = old.get(pl.name.lower())
        if was is None or compute.ceiling_of(was) == compute.ceiling_of(pl):
            continue
        a, b = compute.ceiling_of(was), compute.ceiling_of(pl)
        line = f"pool {pl.name}: compute ceiling {a:g} -> {b:g} (apply records it)"
        if b < a:
            if figures is None:
                held = gputime.with_use(gputime.history(store), tenancy.allocations(store, view.inventory))
                figures = gputime.gpu_figures(held, new, {str(g.address): g.framebuffer_mib or 0
                                                          for g in view.inventory.gpus if g.vgpu_backend})
            over = [(g, figures[g]) for g in pl.gpus if g in figures and figures[g]["starved_demand"] > 0]
            if over:
                line += ": under the running vGPUs' expected GPU time on " + ", ".join(
                    f"{g} ({f['gpu_time_expected']:.2f} expected, {f['starved_demand']:.2f} starved)"
                    for g, f in over) + "; new starts there are refused (gpu-time) until demand falls under it"
        notes.append(line)
    return notes


def check(host: HostRoot, store: StateStore, cfg: Config, layout: Optional[str] = None) -> Drift:
    """Compare ``host`` with ``layout``: the same walk as :func:`plan`, as drift lines, and the pools
    admission uses (the store's) against the layout's (``- pools: GPU ...: pool gold (...)``, which
    ``apply`` records)."""
    view = view_for(host, store, cfg, layout)
    drift = planner.drift(cfg, layout, view)
    new = planner.pools(cfg, layout, view)
    if new or store.pool_rows():
        drift.diff += [f"- pools: {_moved_note(line, moved, 'apply puts it back')}" if moved else
                       f"- pools: {line} (apply records it)"
                       for line, moved in _with_moves(store, tenancy.pool_changes(store, new))]
    drift.diff += [f"- mig: GPU {gpu}: MIG on demand {'on' if on else 'off'} (host has {'off' if on else 'on'}; "
                   "apply records it)" for gpu, on in on_demand_changes(store, cfg, layout, view)]
    return drift


def on_demand_changes(store: StateStore, cfg: Config, layout: Optional[str], view: HostView) -> List[tuple]:
    """``[(GPU BDF, on)]`` where ``layout``'s ``mig: {on_demand: ...}`` differs from what the store records
    (:func:`vgpuhost.ops.migdemand.opted_in`): what :func:`apply` turns on or off after its steps, shown by
    :func:`plan` as a note and by :func:`check` as drift (trial 5 retest N2: both said "in sync")."""
    wanted = planner.mig_on_demand(cfg, layout, view)
    if not wanted:
        return []
    now = migdemand.opted_in(store) if not store.absent else frozenset()
    return [(gpu, on) for gpu, on in sorted(wanted.items()) if (gpu in now) != on]


def _with_moves(store: StateStore, lines: List[str]) -> List[tuple]:
    """``(line, FROM -> TO or "")`` for each :func:`vgpuhost.ops.tenancy.pool_changes` line
    (``GPU BDF: ...``): the move the capacity reconciler made of that GPU, where it still sits as moved
    (:data:`vgpuhost.policy.admission.REBALANCE_MOVED`)."""
    moved = {k[len(REBALANCE_MOVED):]: v for k, v in store.settings_under(REBALANCE_MOVED).items()}
    out = []
    for line in lines:
        out.append((line, moved.get(_gpu_of(line), "")))
    return out


def _gpu_of(line: str) -> str:
    """The BDF a ``GPU 0000:41:00.0: ...`` line names ('' for another line)."""
    if not line.startswith("GPU "):
        return ""
    return line[len("GPU "):].split(": ", 1)[0]


#: the lock ``apply`` holds from its plan to its pool records; the capacity reconciler takes it before the
#: host lock (:func:`vgpuhost.ops.rebalance.rebalance`), so a move never lands between the two (trial 10 F7)
LOCK = "layout"


def _moved_note(line: str, moved: str, what: str) -> str:
    return f"{line} (the capacity reconciler moved it, pool {moved}; {what}: the layout's pools win)"


def apply(host: HostRoot, store: StateStore, cfg: Config, layout: Optional[str] = None, *,
          actor: Optional[str] = None, progress=None,
          stop: Optional[Callable[[], None]] = None) -> ApplyResult:
    """Run exactly the steps :func:`plan` gives, then read the host back.

    Raises RefusedError (exit 2) before any change when the plan is blocked
    (devices of running domains, vGPUs the layout did not create in the way,
    operator steps first), naming them; DeviceError (exit 3) when a step
    fails (the steps before it stay done; each layer rolls back its own
    half-done operation) or the host does not match afterwards.  Reboot steps
    are reported in the result, never done.  Serialised per state dir by a
    ``layout`` lock (:data:`LOCK`), which the capacity reconciler takes too.  ``progress(i, n, step, state)``, when given, is called
    as each step starts (state ``"start"``), ends (``"done"``, ``"failed"``)
    or is skipped (``"skipped"``).  ``stop()``, when given, is called before
    each step starts: a VgpuhostError it raises (the agent's Stopping after
    SIGTERM) ends the apply between two steps, re-raised as its own type
    naming the first step not started and how many stay done (the steps are
    each whole: the ones before stay done, as after a failed step; none is
    left half-done).
    """
    name = cfg.layout(layout).name
    who = actor or f"{actor_name()} apply {name}"
    with file_lock(store.state_dir, LOCK):
        gpus_in_scope, nvml = planner.scope(cfg, layout)
        view = observe(host, store, gpus=gpus_in_scope, nvml=nvml)
        p = planner.plan(cfg, layout, view)
        p.blocked += [b for b in health_blocks(store, p) if b not in p.blocked]   # GPUs out of service
        if p.blocked:
            raise RefusedError(f"layout {name!r} cannot be applied: " + "; ".join(p.blocked),
                               hint="nothing was changed; 'vgpuhost plan -c FILE' shows the whole plan")
        new_pools = _pools(store, cfg, layout, view)      # refused here, before any change
        result = ApplyResult(p, reboot=list(p.reboot), notes=list(p.notes))
        carried = Carried(host, store, view, nvml=nvml)
        ex = Executor(host, store, actor=who, operation=f"apply {name}",
                      bindings=_recording(handlers(host, store, who, carried), result, p.steps, progress, stop))
        try:
            ex.run(p.steps)
        except VgpuhostError as e:
            i = next(n for n, s in enumerate(p.steps, 1) if s is ex.failed)
            step = p.steps[i - 1]
            done = f"; {len(result.done)} step(s) before it stay done" if result.done else ""
            if getattr(e, "stopped_apply", False):
                raise type(e)(f"layout {name!r}: stopped before step {i} of {len(p.steps)} ({step.kind} "
                              f"{step.target}: {step.action}): {e.message}{done or '; nothing was changed'}",
                              hint="run apply again: it plans from what the host holds now") from e
            raise DeviceError(f"layout {name!r}: step {i} of {len(p.steps)} failed ({step.kind} {step.target}: "
                              f"{step.action}): {e.one_line()}{done}",
                              hint="'vgpuhost assert -c FILE' shows what differs; 'vgpuhost audit' every "
                                   "write") from e
        drift = planner.drift(cfg, layout, view_for(host, store, cfg, layout))     # the pools are recorded below
        result.drift_after = list(drift.diff)
        if drift.runtime:
            raise DeviceError(f"layout {name!r}: after {len(result.done)} step(s) the host still differs: "
                              + "; ".join(d[2:] for d in drift.runtime),
                              hint="'vgpuhost audit' shows every write; 'vgpuhost assert -c FILE' the difference")
        if new_pools is not None:
            marked = dict(_with_moves(store, tenancy.pool_changes(store, new_pools)))
            lines = tenancy.set_pools(store, new_pools, actor=who, check=False)
            result.recorded = result.recorded or bool(lines)
            result.notes += [_moved_note(line, marked[line], "put back") if marked.get(line) else line
                             for line in lines]
        for gpu, on in sorted(planner.mig_on_demand(cfg, layout, view).items()):
            if migdemand.set_opt_in(host, store, PciAddress.parse(gpu), on, actor=who):
                result.recorded = True
                result.notes.append(f"MIG on demand {'on' if on else 'off'} for {gpu}")
        return result


def _pools(store: StateStore, cfg: Config, layout: Optional[str], view: HostView):
    """The tenancy pools ``layout`` declares on this host (None: it declares none and none are recorded).

    Raises RefusedError when recording them would change the scheduler policy
    of a GPU that running domains' vGPUs are on, or leave such a vGPU in a
    pool that does not serve its QoS class (NVML changes a GPU's policy only
    while it holds no vGPUs; the plan's own steps empty the GPUs the layout
    itself filled)."""
    new = planner.pools(cfg, layout, view)
    if not new and not store.pool_rows():
        return None
    policies = {}
    for g in view.inventory.gpus:
        try:
            st = view.nvml(g.address).scheduler
        except VgpuhostError:
            st = None
        if st is not None:
            policies[str(g.address)] = st.policy
    tenancy.check_pools(store, new, policies=policies)
    return new

# ---------------------------------------------------------------------------
# executing: each step type bound to the operation that runs it

class Carried:
    """The one :class:`HostView` an apply carries across its steps (issue 17).

    Taken once before planning; after each step, the step's GPU is marked
    changed and read again (alone, :func:`vgpuhost.observe.hostview.refresh`)
    only when a later step needs the view, so apply never re-observes the
    host per step.  What the view serves: the first, unlocked placement look
    of each vGPU create (:meth:`part`); every operation still re-reads its
    GPU under the GPU's lock before it writes.
    """

    def __init__(self, host: HostRoot, store: StateStore, view: HostView, *, nvml: bool = True):
        self.host, self.store, self.view, self.nvml = host, store, view, nvml
        self.changed: set = set()
        self.refreshes = 0

    def part(self, gpu: PciAddress):
        """The view's inventory of ``gpu`` alone (read again first when a step changed it)."""
        if gpu in self.changed:
            self.view = refresh(self.view, self.host, self.store, [gpu], nvml=self.nvml)
            self.changed.discard(gpu)
            self.refreshes += 1
        return gpu_part(self.view.inventory, gpu)

    def after(self, step: LayoutStep) -> None:
        """Note that ``step`` ran (its GPU has changed)."""
        self.changed.add(step.gpu)


#: what a handler returns when a MIG mode change stays pending until a GPU reset
PENDING = "pending"

Handler = Callable[[LayoutStep], Optional[str]]


def _recording(bound: Mapping[type, Handler], result: ApplyResult, steps=(), progress=None,
               stop: Optional[Callable[[], None]] = None) -> Dict[type, Handler]:
    """``bound``, each handler wrapped to keep ``result`` (done, skipped, reboot) as the
    Executor runs the plan: once a MIG mode change on a GPU stays pending, the GPU's
    later steps are skipped (they need the mode the reset brings) and the reset is
    reported.  ``progress(i, n, step, state)`` hears of each step and ``stop()`` is
    asked before each starts (see :func:`apply`)."""
    pending = set()
    position = {id(s): i for i, s in enumerate(steps, 1)}

    def tell(step, state: str) -> None:
        if progress:
            progress(position.get(id(step), 0), len(steps), step, state)

    def keep(handler: Handler) -> Handler:
        def run(step: LayoutStep) -> Optional[str]:
            if step.target in pending:
                result.skipped.append(step)
                tell(step, "skipped")
                return None
            if stop is not None:
                try:
                    stop()
                except VgpuhostError as e:
                    e.stopped_apply = True      # apply names it a stop between steps, not a failed step
                    raise
            tell(step, "start")
            try:
                note = handler(step)
            except BaseException:
                tell(step, "failed")
                raise
            result.done.append(step)
            tell(step, "done")
            if note == PENDING:
                pending.add(step.target)
                result.reboot.append(reboot_step("mig-mode", step.target, f"reset the GPU (nvidia-smi -r -i "
                                                 f"{step.target}) or reboot, then run apply again: the MIG mode "
                                                 "change is pending", "the driver keeps MIG mode changes pending "
                                                 "until a GPU reset (docs/reference/hardware.md#mig-profiles)"))
            return note
        return run

    return {t: keep(h) for t, h in bound.items()}


def handlers(host: HostRoot, store: StateStore, actor: str,
             carried: Optional[Carried] = None) -> Mapping[type, Handler]:
    """``{step type: run it}`` for every executable layout step type.

    Each handler runs its step through the layer that owns the operation (locks,
    audit rows, read-back, rollback of its own half-done work) and returns
    :data:`PENDING` when a MIG mode change waits for a GPU reset, else None.
    ``carried``: the apply's one view (:class:`Carried`): vGPU creates take
    their first look from it, and every step marks its GPU changed in it.
    Raises what that layer raises (a VgpuhostError).
    """
    bound = _handlers(host, store, actor, carried, mig, passthrough, scheduler, vgpu)
    if carried is None:
        return bound

    def noting(handler: Handler) -> Handler:
        def run(step: LayoutStep) -> Optional[str]:
            try:
                return handler(step)
            finally:
                carried.after(step)      # even a failed step may have changed its GPU
        return run

    return {t: noting(h) for t, h in bound.items()}


def _handlers(host: HostRoot, store: StateStore, actor: str, carried: Optional[Carried], mig, passthrough,
              scheduler, vgpu) -> Dict[type, Handler]:

    def remove(s: LayoutRemoveVgpu) -> None:
        vgpu.remove(host, store, s.vgpu_id, owner=LAYOUT, actor=actor)

    def create(s: LayoutCreateVgpus) -> None:
        # one look for the step: the vGPUs it has made since only make the GPU fuller, and each
        # create places again on a fresh read of this GPU under its lock
        seen = carried.part(s.gpu) if carried is not None else None
        for k in range(s.count):
            vid = s.uuids[k] if k < len(s.uuids) else None
            vf = PciAddress.parse(vid) if vid and ":" in vid else None     # a BDF (vendor VFIO): the same VF
            vgpu.create(host, store, profile=s.profile, gpu=None if vf else s.gpu, owner=LAYOUT,
                        uuid=None if vf else vid, vf=vf, actor=actor, inventory=seen)

    def recreate(s: LayoutRecreateVgpu) -> None:
        _recreate(host, store, s.vgpu_id, actor)

    def mig_mode(s: LayoutChangeMigMode) -> Optional[str]:
        out = mig.set_mode(host, store, s.gpu, s.enabled, actor=actor, owner=LAYOUT)
        if out.mig_mode and out.mig_mode["current"] != s.enabled:
            return PENDING
        return None

    def gpu_instances(s: LayoutMakeGpuInstances) -> None:
        mig.apply(host, store, s.gpu, s.counts, actor=actor, owner=LAYOUT)

    def mixed_size(s: LayoutSetMixedSize) -> None:
        scheduler.mixed_size(host, store, s.gpu, s.on, actor=actor, owner=LAYOUT)

    def set_scheduler(s: LayoutSetScheduler) -> None:
        scheduler.set_runtime(host, store, s.gpu, s.state, actor=actor, owner=LAYOUT)

    def prepare(s: LayoutPreparePassthrough) -> None:
        passthrough.prepare(host, store, s.gpu, allow_boot_vga=s.allow_boot_vga, persist=s.persist, actor=actor)

    def release(s: LayoutReleasePassthrough) -> None:
        passthrough.release(host, store, s.gpu, persist=True, actor=actor)

    return {LayoutRemoveVgpu: remove, LayoutCreateVgpus: create, LayoutRecreateVgpu: recreate,
            LayoutChangeMigMode: mig_mode, LayoutMakeGpuInstances: gpu_instances, LayoutSetMixedSize: mixed_size,
            LayoutSetScheduler: set_scheduler, LayoutPreparePassthrough: prepare, LayoutReleasePassthrough: release}


def _recreate(host: HostRoot, store: StateStore, vid: str, actor: str) -> None:
    """Re-create the recorded layout vGPU ``vid`` with its own id, type and parameters
    (:func:`vgpuhost.ops.vgpu.recreate_recorded`, as :func:`vgpuhost.ops.vgpu.reconcile` does for each
    missing record): the record stays until the device reads back, so a failed try leaves it missing
    (and the next apply tries the same id again) instead of losing the id.
    Raises DeviceError when the kernel refuses or the device does not read back (GpuFailedError, the GPU
    recorded unhealthy, on EIO/ENODEV).
    """
    rec = next((r for r in store.vgpu_records(owner=LAYOUT) if r.id == vid), None)
    if rec is None:
        raise DeviceError(f"vGPU {vid} is no longer recorded for the layout", hint="run apply again")
    vgpu.recreate_recorded(host, store, rec, actor=actor,
                           operation=f"apply re-create {rec.type_name} {rec.id} owner=layout")


__all__ = ["Plan", "Drift", "ApplyResult", "LayoutStep", "plan", "check", "apply", "view_for", "handlers", "KINDS",
           "PHASES", "REBOOT_MARK", "RESET_MARK", "OPERATOR_MARK"]
