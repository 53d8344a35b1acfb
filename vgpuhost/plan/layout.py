"""The layout planner: what it takes to bring a host to a declarative layout.

Owns: :func:`plan`, a pure function of a config's layout (:mod:`vgpuhost.policy.config`)
and one :class:`~vgpuhost.observe.hostview.HostView` that returns the ordered,
typed steps that bring the host there, the drift lines (:func:`drift`: the same
walk), what is reported and never done (reboot and operator steps) and the
reasons apply must not start; the step types (:class:`LayoutStep` and its
subclasses, each named ``Layout...`` so none is mistaken for the single-write
steps of :mod:`vgpuhost.plan.steps` it is made of); and :func:`nvml_scope`,
the GPUs whose NVML facts a plan may read.
Must not: read or write anything (no sysfs, NVML, store or file access: every
fact comes from the view) or execute a step (:mod:`vgpuhost.ops.layout` binds
each step type to the operation that runs it).

Order (docs/reference/hardware.md#vendor-vfio, #field-lessons): first what must go — layout vGPUs no longer
wanted or in the way, passed-through groups going back to the host — then
SR-IOV (an operator step: vgpuhost never runs ``sriov-manage``) -> MIG mode
-> GPU instances -> mixed-size mode -> scheduler -> vGPUs -> passthrough
bindings; except that a scheduler change comes before the mixed-size step
that turns mixed-size mode on (fixed share, which it may be leaving, is not
allowed in mixed-size mode, docs/reference/hardware.md#vgpu-scheduling).

Preconditions are the plan's: what a step's layer would refuse (fixed share
under mixed-size mode, a scheduler the device's capabilities do not allow,
a MIG mode change while vendor-VFIO VFs are enabled, vGPUs of other owners
or running domains in the way) blocks the plan or is a ``FILE:LINE:`` error
before any step runs, so apply never removes vGPUs and then stops on a
step that could not have worked.  With the VFs disabled, a MIG mode change
is planned alone and enabling them is named as the operator's next step
(``sriov-manage -e`` destroys GPU instances, docs/reference/hardware.md#vendor-vfio).  Kernel
parameters and module options take effect at boot: they are reported as
reboot steps and never done.  A MIG mode change left *pending* until a GPU
reset (docs/reference/hardware.md#mig-profiles) is reported the same way.

Ownership: vGPUs a layout creates have owner ``layout``
(:data:`vgpuhost.policy.placement.LAYOUT`) and a layout only ever removes those.
vGPUs of other owners (``manual``, a domain UUID, or not created by
vgpuhost) count against capacity and are never removed: when one stands in
the way (a mode change needs the GPU empty) the plan is blocked and says
which.  Devices held by running domains (the view's ``running``) block any
step that would remove or rebind them, or change MIG mode, GPU instances,
SR-IOV, mixed-size mode or the scheduler of their GPU.

Cost: one walk over the layout's entries and the view; nothing is read per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ..model.nvml import SchedulerState
from ..model.concepts import Backend, OwnerKind, PlanKind, SchedulerPolicy
from ..model.errors import VgpuhostError
from ..model.values import PciAddress, VgpuProfile
from .executor import StepContext
from .steps import AUDIT_NONE, Step
from ..observe.hostview import HostView, MigMode, SeenType
from ..observe.inventory import BACKEND_MDEV, Gpu, Inventory, VgpuType, gpu_available
from ..observe.vgpus import VgpuEntry
from ..policy.config import (Config, Entry, Layout, MigSpec, VgpuSpec, _near, board_names, board_tables, check_mig,
                             check_vgpu_types, gi_name_for, type_max)
from ..policy.admission import Pool
from ..policy.placement import LAYOUT, GpuOffer, Request, place
from ..policy.iommu import group_endpoints, prepare_blockers
from ..policy.mig import ORDER, layout_text
from ..policy.offers import offers
from ..policy.scheduler import (CONF_NAME, SchedulerConf, check_caps, describe, encode, matches, override_line,
                                parse_conf, registry_options, render_conf, set_value, with_own_file)
from .mig import plan_layout

SCHEMA_PLAN = "vgpuhost.plan/v1"
SCHEMA_ASSERT = "vgpuhost.assert/v1"

KINDS = PlanKind.values()
#: the order steps run in; removals first, then the forward order of docs/reference/hardware.md#vendor-vfio.  A scheduler
#: change a mixed-size step depends on (leaving fixed share, which mixed-size mode does not allow)
#: runs before it ("scheduler-first"); any other scheduler change runs after it.
PHASES = ("vgpu-remove", "passthrough-release", "mig-mode", "gpu-instance", "scheduler-first", "mixed-size",
          "scheduler", "vgpu-create", "passthrough-prepare")
REBOOT_MARK = "(needs a reboot)"
RESET_MARK = "(needs a GPU reset)"
OPERATOR_MARK = "(needs an operator step)"
#: a mixed-size pool's GPU that keeps its mode while vGPUs the layout did not create are on it
EMPTY_MARK = "(needs the GPU free of other vGPUs)"
VFIO_PCI = "vfio-pci"
#: what a driverctl override file holds for a function kept on vfio-pci
DRIVERCTL_VFIO = "vfio-pci\n"


# ---------------------------------------------------------------------------
# steps

class PlanLine:
    """What every line of a plan says: ``kind`` (one of :data:`KINDS`), ``target``
    (a GPU's BDF or ``host``), ``action`` (what it does, in words: ``create 2 x
    A100-2Q``), ``why`` (the reason, ending with the config line that asks for it)
    and ``reboot`` (takes effect only at boot or GPU reset: reported, never executed)."""

    kind: str
    target: str
    action: str
    why: str
    reboot: bool

    def describe(self, host: Any = None) -> str:
        """One line: ``vgpu 0000:81:00.0: create 4 x A40-8Q``."""
        return f"{self.kind} {self.target}: {self.action}"

    def as_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "action": self.action, "why": self.why,
                "reboot": self.reboot}


@dataclass(frozen=True)
class LayoutStep(PlanLine, Step):
    """A step apply executes through the Executor; ``kind`` per class.  The fields after
    ``why`` say what it does.  Composite: each runs an operation of ops/ (creating N
    vGPUs, preparing passthrough, applying a MIG layout), which takes its locks, writes
    its own audit rows and reads back; :func:`vgpuhost.ops.layout.handlers` binds each
    class to that operation in the executor's context (:meth:`StepContext.bound`)."""

    kind: ClassVar[str] = ""
    reboot: ClassVar[bool] = False
    audit_by: ClassVar[Optional[str]] = AUDIT_NONE      # the bound operation audits each write

    def run(self, ctx: StepContext) -> object:
        """Run the operation bound to this step's type; its result (``"pending"`` for a MIG
        mode change that waits for a GPU reset).  Raises what the operation raises."""
        return ctx.bound(self)(self)

    target: str
    action: str
    why: str

    @property
    def gpu(self) -> PciAddress:
        """The target GPU's address."""
        return PciAddress.parse(self.target)


@dataclass(frozen=True)
class Report(PlanLine):
    """A step vgpuhost reports and never takes: a kernel parameter, a module, a
    persistent scheduler setting or a GPU reset (``reboot``), or an operator step
    (SR-IOV, ``reboot`` False)."""

    target: str
    action: str
    why: str
    kind: str
    reboot: bool = False


@dataclass(frozen=True)
class LayoutRemoveVgpu(LayoutStep):
    """Remove the layout's vGPU ``vgpu_id`` (or drop the record of a missing one)."""

    kind: ClassVar[str] = PlanKind.VGPU
    vgpu_id: str


@dataclass(frozen=True)
class LayoutCreateVgpus(LayoutStep):
    """Create ``count`` vGPUs of type ``profile`` on the target GPU, owner layout;
    ``uuids``: ids to reuse, in order (the rest are new): mdev UUIDs, or on vendor VFIO the
    VFs (BDFs) to set the type on."""

    kind: ClassVar[str] = PlanKind.VGPU
    profile: str
    count: int
    uuids: Tuple[str, ...] = ()


@dataclass(frozen=True)
class LayoutRecreateVgpu(LayoutStep):
    """Re-create the recorded, missing layout vGPU ``vgpu_id`` with its own id and type."""

    kind: ClassVar[str] = PlanKind.VGPU
    vgpu_id: str


@dataclass(frozen=True)
class LayoutChangeMigMode(LayoutStep):
    """Turn the target GPU's MIG mode on or off (may stay pending until a GPU reset)."""

    kind: ClassVar[str] = PlanKind.MIG_MODE
    enabled: bool


@dataclass(frozen=True)
class LayoutMakeGpuInstances(LayoutStep):
    """Make the target GPU's GPU instances ``{profile name: count}``."""

    kind: ClassVar[str] = PlanKind.GPU_INSTANCE
    layout: Tuple[Tuple[str, int], ...]

    @property
    def counts(self) -> Dict[str, int]:
        return dict(self.layout)


@dataclass(frozen=True)
class LayoutSetMixedSize(LayoutStep):
    """Turn the target GPU's mixed-size (heterogeneous) vGPU mode on or off."""

    kind: ClassVar[str] = PlanKind.MIXED_SIZE
    on: bool


@dataclass(frozen=True)
class LayoutSetScheduler(LayoutStep):
    """Set the target GPU's runtime vGPU scheduler."""

    kind: ClassVar[str] = PlanKind.SCHEDULER
    state: SchedulerState


@dataclass(frozen=True)
class LayoutPreparePassthrough(LayoutStep):
    """Bind the target GPU's IOMMU group to vfio-pci (and write driverctl overrides)."""

    kind: ClassVar[str] = PlanKind.PASSTHROUGH
    allow_boot_vga: bool = False
    persist: bool = False


@dataclass(frozen=True)
class LayoutReleasePassthrough(LayoutStep):
    """Give the target GPU's IOMMU group back to its host drivers (overrides removed)."""

    kind: ClassVar[str] = PlanKind.PASSTHROUGH


def reboot_step(kind: str, target: str, action: str, why: str) -> Report:
    """A step that takes effect only at boot or GPU reset."""
    return Report(target, action, why, kind=kind, reboot=True)


def operator_step(kind: str, target: str, action: str, why: str) -> Report:
    """A step the operator takes (vgpuhost does not run it)."""
    return Report(target, action, why, kind=kind)


# ---------------------------------------------------------------------------
# results

@dataclass
class Plan:
    """What apply would do for ``layout``.

    ``steps``: ordered, executable; ``reboot``: reported, never executed
    (kernel parameters, module options, pending MIG mode); ``manual``:
    operator steps vgpuhost does not run (SR-IOV); ``blocked``: why apply
    must not start (in-use devices, blockers, operator steps first);
    ``diff``: how the host differs from the layout (the :func:`drift`
    lines); ``reboot_diff``: those of them only a reboot, a GPU reset or an
    operator step fixes; ``notes``: facts worth knowing (an entry that
    selects no GPU here).
    """

    layout: str
    source: str = ""
    steps: List[LayoutStep] = field(default_factory=list)
    reboot: List[Report] = field(default_factory=list)
    manual: List[Report] = field(default_factory=list)
    blocked: List[str] = field(default_factory=list)
    diff: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    reboot_diff: List[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.steps)

    def as_dict(self) -> Dict[str, Any]:
        return {"schema": SCHEMA_PLAN, "layout": self.layout, "source": self.source, "changed": self.changed,
                "steps": [s.as_dict() for s in self.steps], "reboot": [s.as_dict() for s in self.reboot],
                "manual": [s.as_dict() for s in self.manual], "blocked": list(self.blocked),
                "diff": list(self.diff), "notes": list(self.notes)}

    def text(self) -> str:
        """The printed plan."""
        head = f"layout {self.layout!r} ({self.source})"
        lines: List[str] = []
        if self.steps:
            lines.append(f"{head}: {len(self.steps)} step{'s' if len(self.steps) != 1 else ''}")
            for i, s in enumerate(self.steps, 1):
                lines.append(f"  {i:>2}. {s.kind:<12} {s.target:<12}  {s.action}")
                lines.append(f"      why: {s.why}")
        elif not (self.reboot or self.manual or self.blocked or self.reboot_diff):
            # a note apply acts on (pools, MIG on demand: "(recorded by apply)") is not "nothing to do"
            records = any("recorded by apply" in n or "apply records it" in n for n in self.notes)
            lines.append(f"{head}: the host's devices match; apply records what the notes say" if records
                         else f"{head}: the host matches; nothing to do")
        else:
            lines.append(f"{head}: no step vgpuhost can take now")
        if self.reboot:
            lines.append("reported, never done by vgpuhost (take effect at boot or GPU reset):")
            for s in self.reboot:
                lines.append(f"   - {s.kind:<12} {s.target:<12}  {s.action}")
                lines.append(f"     why: {s.why}")
        if self.manual:
            lines.append("operator steps (vgpuhost does not run them):")
            for s in self.manual:
                lines.append(f"   - {s.kind:<12} {s.target:<12}  {s.action}")
                lines.append(f"     why: {s.why}")
        if self.blocked:
            lines.append("BLOCKED: apply refuses before any change until these are resolved:")
            lines += [f"   - {b}" for b in self.blocked]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class Drift:
    """How the host differs from a layout: ``diff`` lines (``- 0000:41:00.0 vgpu
    A100-2Q x2 (host has 1)``); ``reboot``: those of them only a reboot, a GPU
    reset or an operator step fixes (they end with a ``(needs ...)`` mark)."""

    layout: str
    source: str
    diff: List[str] = field(default_factory=list)
    reboot: List[str] = field(default_factory=list)

    @property
    def in_sync(self) -> bool:
        return not self.diff

    @property
    def runtime(self) -> List[str]:
        """The lines apply can fix now."""
        return [d for d in self.diff if d not in self.reboot]

    def as_dict(self) -> Dict[str, Any]:
        return {"schema": SCHEMA_ASSERT, "layout": self.layout, "source": self.source, "in_sync": self.in_sync,
                "diff": list(self.diff), "reboot": list(self.reboot)}

    def text(self) -> str:
        if self.in_sync:
            return f"in sync with layout {self.layout!r} ({self.source})"
        return "\n".join([f"drift from layout {self.layout!r} ({self.source}):"] + self.diff)


# ---------------------------------------------------------------------------
# the walker

def _escaped(text: str) -> str:
    """``text`` with control and other non-printable characters as Python escapes (``\\n``)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclass
class _GpuVgpus:
    """The vGPUs on one GPU, by who holds them."""

    layout_active: List[VgpuEntry]       # owner layout, present
    layout_missing: List[VgpuEntry]      # recorded for the layout, absent from the host
    layout_mismatched: List[VgpuEntry]
    others: List[VgpuEntry]              # present: manual, a domain's, or foreign
    #: the layout's vGPUs a domain claimed (pool model): counted as the layout's, never removed by it
    claimed: List[VgpuEntry] = field(default_factory=list)


@dataclass(frozen=True)
class _Totals:
    """A vgpu entry with total counts, across its GPUs: ``gpus`` and their ``label`` (the
    BDFs joined by commas); per lower-cased type name, the layout's vGPUs present
    (``have``) and recorded but missing (``missing``), as ``(GPU, entry)``; ``want``:
    ``{lower-cased name: (name as the GPU spells it, count)}``; ``removed``: per GPU, the
    layout's vGPUs removed to empty it (None: not emptied)."""

    gpus: Sequence[Gpu]
    label: str
    have: Dict[str, List[Tuple[Gpu, Any]]]
    missing: Dict[str, List[Tuple[Gpu, Any]]]
    want: Dict[str, Tuple[str, int]]
    removed: Dict[PciAddress, Optional[List[Any]]]


class _Walker:
    """One walk of a layout over a view: fills a :class:`Plan` (steps by phase)."""

    def __init__(self, cfg: Config, lay: Layout, view: HostView):
        self.cfg, self.lay, self.view = cfg, lay, view
        self.inv: Inventory = view.inventory
        self.mixed_after: Dict[PciAddress, bool] = {}      # GPU -> the mixed-size mode a planned step sets
        # domain names are the hook's input: escaped, so a newline in one cannot forge plan lines
        self.active: Mapping[str, str] = {u: _escaped(n) for u, n in view.running.items()}
        self.seen = view.seen
        self.entries: Sequence[VgpuEntry] = view.vgpus
        # by GPU, once (the walk stays linear in GPUs): seen types, listed types, vGPUs
        self._seen_of: Dict[str, List[SeenType]] = {}
        for row in view.seen:
            self._seen_of.setdefault(row.gpu, []).append(row)
        self._types_of: Dict[PciAddress, List[VgpuType]] = {}
        for t in self.inv.vgpu_types:
            self._types_of.setdefault(t.gpu, []).append(t)
        self._vgpus_of: Dict[str, List[VgpuEntry]] = {}
        for e in view.vgpus:
            self._vgpus_of.setdefault(e.gpu, []).append(e)
        self._offered: Dict[PciAddress, Dict[str, Tuple[str, Optional[str]]]] = {}
        self.phases: Dict[str, List[LayoutStep]] = {p: [] for p in PHASES}
        self.plan = Plan(lay.name, cfg.source)
        self.changing: Set[str] = set()        # GPUs (str) some step changes

    def mig_mode(self, g: Gpu) -> Optional[MigMode]:
        return self.view.nvml(g.address).mig_mode

    # --- output helpers ---------------------------------------------------------
    def step(self, phase: str, step: LayoutStep) -> None:
        self.phases[phase].append(step)
        if step.target != "host":
            self.changing.add(step.target)

    def diff(self, line: str, mark: Optional[str] = None) -> None:
        text = f"- {line}" + (f" {mark}" if mark else "")
        self.plan.diff.append(text)
        if mark:
            self.plan.reboot_diff.append(text)

    def block(self, text: str) -> None:
        if text not in self.plan.blocked:
            self.plan.blocked.append(text)

    def result(self) -> Plan:
        self.plan.steps = [s for p in PHASES for s in self.phases[p]]
        return self.plan

    # --- host settings ----------------------------------------------------------
    def host_settings(self) -> None:
        h = self.inv.host
        args = h.cmdline_args
        for param, where in self.cfg.host.kernel_params:
            key, eq, value = param.partition("=")
            if key in args and (not eq or args[key] == value):
                continue
            now = f"has {key}={args[key]}" if key in args and args[key] else (
                f"has {key}" if key in args else "lacks it")
            action = (f"change {key}={args[key]} to {param} on the kernel command line" if key in args
                      else f"add {param} to the kernel command line")
            self.plan.reboot.append(reboot_step(PlanKind.KERNEL_PARAM, "host", action + " (GRUB_CMDLINE_LINUX, "
                                                "update-grub), then reboot", f"wanted by {where}; /proc/cmdline {now}"))
            self.diff(f"host kernel-param {param} (cmdline {now})", REBOOT_MARK)
        for mod, where in self.cfg.host.vfio_modules:
            if h.module_present(mod):
                continue
            avail = mod in h.modules_available
            why = f"wanted by {where}; {mod} is not loaded nor built in" + (
                "" if avail or not h.modules_available else
                f", and kernel {h.kernel_release} has no such module: install it")
            self.plan.reboot.append(reboot_step(PlanKind.MODULE, "host", f"load {mod} at boot (a line in "
                                                "/etc/modules-load.d/vfio.conf; vgpuhost never loads modules)", why))
            self.diff(f"host module {mod} (not loaded)", REBOOT_MARK)

    # --- selection ------------------------------------------------------------------
    def _matches(self, entry: Entry, g: Gpu) -> bool:
        offline = _matches_offline(entry, g)
        if offline is not None:
            return offline
        if g.pci.driver != "nvidia":
            return False
        uuid = self.view.nvml(g.address).uuid
        return bool(uuid) and uuid.lower() in entry.select.values

    def select(self) -> Dict[PciAddress, Entry]:
        owner: Dict[PciAddress, Entry] = {}
        for e in self.lay.entries:
            if e.select.kind == "address":
                for a in e.select.values:
                    if self.inv.gpu(a) is None and a in self.inv.devices:
                        d = self.inv.devices[a]
                        raise e.select.where.error(
                            f"{a} is a {d.class_name}{' (an SR-IOV VF)' if d.is_vf else ''}, not an NVIDIA GPU",
                            hint="select the GPU's physical function ('vgpuhost gpus' lists them)")
            matched = [g for g in self.inv.gpus if self._matches(e, g)]
            if not matched:
                self.plan.notes.append(f"{e.label()} selects no GPU on this host")
            for g in matched:
                if g.address in owner:
                    first = owner[g.address]
                    raise e.select.where.error(
                        f"selects {g.address} ({g.model}), which the entry at line {first.select.where.line} "
                        "selects too: one GPU may be claimed by one entry only",
                        hint="make the selectors disjoint (by address, board or device_id)")
                owner[g.address] = e
        return owner

    # --- per GPU ----------------------------------------------------------------------
    def vgpus_of(self, g: Gpu) -> _GpuVgpus:
        bdf = str(g.address)
        mine = self._vgpus_of.get(bdf, [])
        claimed = {r.id for r in self.view.records if getattr(r, "pool", None) == LAYOUT}
        return _GpuVgpus(
            [e for e in mine if e.owner == LAYOUT and e.state == "active"],
            [e for e in mine if e.owner == LAYOUT and e.state == "missing"],
            [e for e in mine if e.owner == LAYOUT and e.state == "mismatched"],
            [e for e in mine if e.owner != LAYOUT and e.state != "missing"],
            [e for e in mine if e.id in claimed and e.state == "active"])

    def _holder(self, e) -> str:
        if e.owner is None:
            return "not created by vgpuhost"
        if e.owner in self.active:
            return f"held by running domain {self.active[e.owner]} ({e.owner})"
        if e.owner == OwnerKind.MANUAL:
            return "owner manual"
        return f"owner domain {e.owner} (not running)"

    def guard_in_use(self, g: Gpu, vg: _GpuVgpus, what: str) -> None:
        """Block when ``what`` (a change to ``g``) would touch a device a running domain holds."""
        for e in vg.others:
            if e.owner in self.active:
                self.block(f"vGPU {e.id} ({e.type_name or e.type_id}) on {g.address} is held by running domain "
                           f"{self.active[e.owner]} ({e.owner}): {what} would touch it")

    def empty(self, g: Gpu, vg: _GpuVgpus, reasons: Sequence[str], why: str,
              keep: Optional[Dict[str, int]] = None) -> List[Any]:
        """Plan the removal of the layout's vGPUs on ``g`` (the GPU must be empty for
        ``reasons``); block on any other vGPU there.  Returns the removed entries.

        ``keep``: lower-case type name -> how many of that type the layout creates on
        ``g`` afterwards (the removed ones first, in id order, as :meth:`count_vgpus`
        reuses them); None when nothing comes back (passthrough).  Only the reasons
        say "re-created" for the ones that are."""
        text = "; ".join(reasons)
        left = dict(keep or {})
        for e in vg.others:
            what = f"vGPU {e.id} ({e.type_name or e.type_id}) on {g.address}"
            if e.owner in self.active:
                self.block(f"{what} is held by running domain {self.active[e.owner]} ({e.owner}): it would have to "
                           f"be removed ({text})")
            else:
                self.block(f"{what} ({self._holder(e)}) would have to be removed ({text}): a layout removes only "
                           "the vGPUs it created" + ("" if e.owner is None else
                                                     f"; remove it first (vgpuhost vgpu remove {e.id})"))
        for e in vg.layout_mismatched:
            self.block(f"vGPU {e.id} on {g.address} holds type {e.type_id}, not the one recorded for the layout: "
                       "left alone ('vgpuhost reconcile --check' reports it)")
        removed = []
        for e in sorted(vg.layout_active + vg.layout_missing, key=lambda e: e.id):
            gone = e.state == "missing"
            key = (e.type_name or e.type_id or "").lower()
            if gone:
                after = ""
            elif keep is None:
                after = "; not re-created: the GPU is passed through"
            elif left.get(key, 0) > 0:
                left[key] -= 1
                after = ("; the layout re-creates it after, with the same UUID" if e.backend == BACKEND_MDEV
                         else "; the layout re-creates it after, on the same VF")
            else:
                after = "; the layout does not want it back"
            self.step("vgpu-remove", LayoutRemoveVgpu(
                str(g.address), f"{'drop the record of missing' if gone else 'remove'} {e.type_name} {e.id}",
                f"{text}{after} ({why})", vgpu_id=e.id))
            if not gone:
                removed.append(e)
        return removed

    def release_if_passed_through(self, g: Gpu, entry: Entry) -> bool:
        """A GPU a vgpu/mig entry wants back on nvidia; True when a release is planned."""
        if g.pci.driver == "nvidia":
            return False
        bdf = str(g.address)
        rec = self.view.passthrough.get(bdf)
        if rec is not None and rec.owner in self.active:
            self.block(f"{bdf} is passed through to running domain {self.active[rec.owner]} ({rec.owner}): "
                       f"{entry.mode} mode would take it back")
        self.diff(f"{bdf} driver nvidia (host has {g.pci.driver or 'no driver'})")
        self.step("passthrough-release", LayoutReleasePassthrough(
            bdf, "give the IOMMU group back to its host drivers (release; driverctl overrides removed)",
            f"{entry.mode} mode needs the GPU on nvidia ({entry.where})"))
        return True

    def offered(self, g: Gpu) -> Dict[str, Tuple[str, Optional[str]]]:
        """Lower-case name -> (name, type id) of the vGPU types ``g`` lists now or listed before."""
        out = self._offered.get(g.address)
        if out is None:
            out = {}
            for row in self._seen_of.get(str(g.address), ()):
                out.setdefault(row.name.lower(), (row.name, None))
            for t in self._types_of.get(g.address, ()):
                out[t.name.lower()] = (t.name, t.type_id)
            self._offered[g.address] = out
        return out

    def spelled(self, g: Gpu, name: str) -> str:
        """A vGPU type name as ``g``'s driver spells it (names match without case), else as
        vgpuhost's board table spells it, else as written."""
        hit = self.offered(g).get(name.lower())
        if hit is not None:
            return hit[0]
        table = board_tables().get(g.pci.device)
        row = table.types.get(name.lower()) if table is not None else None
        return row[0] if row is not None else name

    def check_types(self, g: Gpu, names: Sequence[Any], *, mig_profiles=None) -> None:
        """Each wanted vGPU type exists on ``g``: InputError ``FILE:LINE:`` naming near matches."""
        offered = self.offered(g)
        table = board_tables().get(g.pci.device)
        label = f"{g.address} ({g.model})"
        for c in names:
            if c.name.lower() in offered:
                continue
            p = VgpuProfile.parse(c.name)
            if p.mig_backed:
                boards = board_names(g.pci.device, g.board)
                if p.board.lower() not in boards and (g.board or table is not None):
                    raise c.where.error(f"MIG-backed vGPU type {c.name} does not exist on {label}",
                                        hint=f"its board is {p.board}; this GPU is "
                                             f"{g.board or (table.board if table else g.model)}")
                if mig_profiles is not None and not any(x.name.lower() == gi_name_for(p) for x in mig_profiles):
                    raise c.where.error(f"MIG-backed vGPU type {c.name} needs GPU-instance profile "
                                        f"{gi_name_for(p)}, which {label} does not offer")
                continue
            known = [n for n, _ in offered.values() if not (VgpuProfile.try_parse(n) or p).mig_backed]
            if not known and table is not None:
                # the GPU lists no time-sliced type now (MIG mode on): vgpuhost's table decides
                if c.name.lower() in table.types:
                    continue
                known = [r[0] for r in table.types.values() if not VgpuProfile.parse(r[0]).mig_backed]
            if known:
                raise c.where.error(f"vGPU type {c.name} does not exist on {label}",
                                    hint=_near(c.name, known, "types"))

    def count_vgpus(self, g: Gpu, vg: _GpuVgpus, wanted: Sequence[Any], removed: Optional[List[Any]],
                    where, *, capacity_check: bool) -> None:
        """Plan the layout's vGPUs on one GPU (per-gpu counts, or MIG-backed)."""
        bdf = str(g.address)
        want = {c.name.lower(): (self.spelled(g, c.name), c.count) for c in wanted}
        have: Dict[str, List[Any]] = {}
        for e in vg.layout_active:
            have.setdefault((e.type_name or e.type_id).lower(), []).append(e)
        lent: Dict[str, int] = {}          # claimed by domains (pool model): the layout's, in use
        for e in vg.claimed:
            key = (e.type_name or e.type_id).lower()
            lent[key] = lent.get(key, 0) + 1
        missing: Dict[str, List[Any]] = {}
        for e in vg.layout_missing:
            missing.setdefault((e.type_name or e.type_id).lower(), []).append(e)
        for key in sorted(set(want) | set(have)):
            name, n = want[key] if key in want else (self.spelled(g, have[key][0].type_name or key), 0)
            h = len(have.get(key, [])) + lent.get(key, 0)
            if h != n:
                self.diff(f"{bdf} vgpu {name} x{n} (host has {h})")
        for key, es in sorted(missing.items()):
            for e in es:
                self.diff(f"{bdf} vgpu {e.type_name} {e.id} (recorded for the layout, missing on the host)")
        creates: List[Tuple[str, int, Tuple[str, ...]]] = []
        recreates: List[Any] = []
        removes: List[Tuple[Any, str]] = []
        if removed is not None:                       # the GPU is emptied first: create everything
            reuse: Dict[str, List[str]] = {}
            for e in removed:       # the same ids: an mdev's UUID, or the VF on vendor VFIO
                reuse.setdefault((e.type_name or "").lower(), []).append(e.id)
            for key, (name, n) in sorted(want.items()):
                if n:
                    creates.append((name, n, tuple(reuse.get(key, [])[:n])))
        else:
            for key in sorted(set(want) | set(have) | set(missing)):
                name, n = want[key] if key in want else (
                    self.spelled(g, _type_name(have.get(key, []) + missing.get(key, []), key)), 0)
                present = sorted(have.get(key, []), key=lambda e: self._time(e.id))
                gone = missing.get(key, [])
                free = max(0, n - lent.get(key, 0))      # claimed ones stay with their domains
                for e in present[free:][::-1]:
                    removes.append((e, f"layout wants {n} {name}, host has {len(present) + lent.get(key, 0)}"))
                room = max(0, free - len(present))
                for e in gone:
                    if room:
                        recreates.append(e)
                        room -= 1
                    else:
                        removes.append((e, "recorded for the layout but missing, and not wanted any more"))
                if room:
                    creates.append((want[key][0], room, ()))
        for e, why in removes:
            verb = "drop the record of missing" if e.state == "missing" else "remove"
            self.step("vgpu-remove", LayoutRemoveVgpu(bdf, f"{verb} {e.type_name} {e.id}", f"{why} ({where})",
                                                      vgpu_id=e.id))
        for e in recreates:
            self.step("vgpu-create", LayoutRecreateVgpu(bdf, f"re-create {e.type_name} {e.id}",
                                                        f"recorded for the layout, missing on the host ({where})",
                                                        vgpu_id=e.id))
        for name, n, uuids in creates:
            self.step("vgpu-create", LayoutCreateVgpus(bdf, f"create {n} x {name}",
                                                       f"layout wants {want[name.lower()][1]}, host has "
                                                       f"{len(have.get(name.lower(), [])) if removed is None else 0} "
                                                       f"({where})", profile=name, count=n, uuids=uuids))
        if capacity_check and removed is None and not removes and g.pci.driver == "nvidia":
            needs: Dict[str, Tuple[str, int]] = {}
            for name, n, _ in creates:
                needs[name.lower()] = (name, needs.get(name.lower(), (name, 0))[1] + n)
            for e in recreates:
                key = (e.type_name or e.type_id).lower()
                needs[key] = (e.type_name, needs.get(key, (e.type_name, 0))[1] + 1)
            self._capacity(g, sorted(needs.values()))

    def equal_size(self, g: Gpu, vg: _GpuVgpus, wanted: Sequence[Any]) -> None:
        """Block when vGPUs the layout does not own hold ``g`` at another framebuffer size
        (equal-size mode: one size per GPU, docs/reference/hardware.md#vgpu-types)."""
        fb = {t.type_id: t.framebuffer_mib for t in self._types_of.get(g.address, ())}
        fb.update({row.type_id: row.framebuffer_mib for row in self._seen_of.get(str(g.address), ())
                   if row.framebuffer_mib})
        sizes = {VgpuProfile.parse(c.name).framebuffer_gb * 1024 for c in wanted if c.count}
        for e in vg.others:
            p = VgpuProfile.try_parse(e.type_name or "")
            if p is not None and p.mig_backed:
                continue
            size = fb.get(e.type_id)
            if size and sizes and size not in sizes:
                self.block(f"vGPU {e.id} ({e.type_name or e.type_id}, {self._holder(e)}) holds {g.address} at "
                           f"{size} MiB vGPUs: in equal-size mode the layout's "
                           + ", ".join(c.name for c in wanted if c.count) + " cannot join it (docs/reference/hardware.md#vgpu-types)")

    def _time(self, vid: str) -> str:
        return self.view.record_time(vid)

    def _capacity(self, g: Gpu, needs: Sequence[Tuple[str, int]]) -> None:
        """Block when a GPU cannot take the vGPUs the plan creates on it (no removals on it).

        Judged in the vGPU mode the plan leaves: where a planned step changes an empty GPU's
        mixed-size mode, the kernel's count now (the old mode's max) is replaced by the catalog's
        max of the type in the new mode (docs/reference/hardware.md#vgpu-types)."""
        fbs = {row.type_id: row.framebuffer_mib for row in self._seen_of.get(str(g.address), ())
               if row.framebuffer_mib}
        vg = self.vgpus_of(g)
        empty = not (vg.others or vg.layout_active or vg.claimed)
        for name, n in needs:
            ts = [t for t in self._types_of.get(g.address, ()) if t.name.lower() == name.lower()]
            avail = gpu_available(self.inv, g.address, ts[0].type_id, fbs) if ts else 0
            if ts and empty and g.address in self.mixed_after and g.address not in self.inv.out_of_service:
                after = type_max(g.pci.device, name, self.mixed_after[g.address])
                if after is not None:
                    avail = after
            if n > avail:
                holders = sorted({self._holder(e) for e in self.vgpus_of(g).others})
                self.block(f"{g.address}: {n} more {name} wanted, {avail} fit now"
                           + (f" (other vGPUs there: {', '.join(holders)})" if holders else ""))

    # --- modes --------------------------------------------------------------------------
    def passthrough(self, g: Gpu, entry: Entry) -> None:
        bdf = str(g.address)
        spec = entry.passthrough
        try:
            group, endpoints, _ = group_endpoints(self.inv, g.address)
        except VgpuhostError as err:
            self.block(f"{bdf}: {err.message}")
            self.diff(f"{bdf} passthrough vfio-pci (host has {g.pci.driver or 'no driver'}; not possible here)")
            return
        bound = all(d.driver == VFIO_PCI for d in endpoints)
        persisted = all(self.view.driverctl_override(d.address) == DRIVERCTL_VFIO for d in endpoints)
        if bound and (persisted or not spec.persist):
            return
        if not bound:
            moving = [d for d in endpoints if d.driver != VFIO_PCI]
            self.diff(f"{bdf} passthrough vfio-pci (host has " + ", ".join(
                f"{d.address} on {d.driver or 'no driver'}" for d in moving) + ")")
        else:
            self.diff(f"{bdf} passthrough driverctl overrides (host has none for some functions)")
        vg = self.vgpus_of(g)
        if vg.others or vg.layout_active or vg.layout_missing:
            self.empty(g, vg, ["passthrough needs a GPU without vGPUs"], str(entry.where))
        for b in prepare_blockers(replace(self.inv, mdevs=(), vf_vgpus=()), g.address, endpoints,
                                  allow_boot_vga=spec.allow_boot_vga):
            self.block(f"{bdf}: {b}")
        n = len(endpoints)
        action = f"bind IOMMU group {group} ({n} function{'s' if n != 1 else ''}) to vfio-pci"
        if spec.persist:
            action += " and write driverctl overrides"
        self.step("passthrough-prepare", LayoutPreparePassthrough(bdf, action, f"mode passthrough ({entry.where})",
                                                                  allow_boot_vga=spec.allow_boot_vga,
                                                                  persist=spec.persist))

    def no_backend(self, g: Gpu, entry: Entry) -> bool:
        """A GPU with no vGPU backend: SR-IOV off (operator step) or no vGPU manager; True when so."""
        if g.vgpu_backend is not None:
            return False
        bdf = str(g.address)
        dev = g.pci
        if dev.sriov_totalvfs and not dev.sriov_numvfs:
            self.plan.manual.append(operator_step(PlanKind.SRIOV, bdf, "enable SR-IOV VFs: /usr/lib/nvidia/sriov-manage "
                                                  f"-e {bdf}", f"{entry.mode} mode needs the VFs that carry vGPUs "
                                                  f"({entry.where})"))
            self.block(f"{bdf}: SR-IOV VFs are not enabled: run /usr/lib/nvidia/sriov-manage -e {bdf} first "
                       "(vgpuhost does not run it)")
            self.diff(f"{bdf} sriov enabled (host has 0 VFs)", OPERATOR_MARK)
        else:
            self.block(f"{bdf} ({g.model}) offers no vGPU types: is the NVIDIA vGPU manager installed? "
                       "('vgpuhost host check')")
            self.diff(f"{bdf} {entry.mode} (host offers no vGPU types)")
        return True

    @staticmethod
    def _vfs_off(g: Gpu) -> bool:
        """SR-IOV capable, VFs not enabled (the operator disabled them, or never enabled them)."""
        return bool(g.vgpu_backend is None and g.pci.sriov_totalvfs and not g.pci.sriov_numvfs)

    def _vfs_block_mig(self, g: Gpu, entry: Entry, change: str) -> bool:
        """On vendor-specific VFIO, MIG mode changes only while the VFs are disabled
        (docs/reference/hardware.md#vendor-vfio): an operator step, so the plan is blocked before anything is
        removed.  True when so."""
        if not (g.vgpu_backend == Backend.VENDOR_VFIO and g.vfs):
            return False
        bdf = str(g.address)
        self.plan.manual.append(operator_step(
            PlanKind.SRIOV, bdf, f"disable SR-IOV VFs (/usr/lib/nvidia/sriov-manage -d {bdf}), run vgpuhost apply, "
            f"then enable them (sriov-manage -e {bdf}) and run apply again",
            f"MIG mode can change only while VFs are disabled on vendor-specific VFIO (order: {ORDER}; "
            f"{entry.where})"))
        self.block(f"{bdf}: {change}: MIG mode can change only while its {len(g.vfs)} SR-IOV VFs are disabled: "
                   f"run /usr/lib/nvidia/sriov-manage -d {bdf} first (vgpuhost does not run it)")
        return True

    def _vfs_after(self, g: Gpu, entry: Entry) -> None:
        """The VFs are off and this apply changes MIG mode (the moment for it): enabling them
        is the operator's next step, then apply again for GPU instances and vGPUs
        (``sriov-manage -e`` destroys GPU instances, docs/reference/hardware.md#vendor-vfio)."""
        bdf = str(g.address)
        self.plan.manual.append(operator_step(
            PlanKind.SRIOV, bdf, f"after this apply: enable SR-IOV VFs (/usr/lib/nvidia/sriov-manage -e {bdf}), then run "
            "apply again", f"{entry.mode} mode needs the VFs that carry vGPUs; "
            + ("GPU instances and vGPUs come after them, since enabling them destroys GPU instances"
               if entry.mode == "mig" else "the vGPUs come after them") + f" ({entry.where})"))
        self.diff(f"{bdf} sriov enabled (host has 0 VFs)", OPERATOR_MARK)

    def vgpu(self, g: Gpu, entry: Entry, total: bool = False) -> Optional[List[Any]]:
        """A vgpu entry on one GPU: everything but the counts when ``total`` (returns the
        removed layout vGPUs when the GPU is emptied, else None)."""
        spec: VgpuSpec = entry.vgpu
        bdf = str(g.address)
        where = str(entry.where)
        released = self.release_if_passed_through(g, entry)
        if not released and self._vfs_off(g):
            mode = self.mig_mode(g)
            if mode is not None and mode.pending:       # VFs off: the moment to turn MIG mode off
                self.diff(f"{bdf} mig-mode off (host has {'on' if mode.current else 'off, on pending'})")
                self.step("mig-mode", LayoutChangeMigMode(
                    bdf, "disable MIG mode (its GPU instances go first)",
                    f"time-sliced vGPUs need MIG mode off ({where})", enabled=False))
                self._vfs_after(g, entry)
                return None
        if not released and self.no_backend(g, entry):
            return None
        self.check_types(g, [t for t in spec.types])
        vg = self.vgpus_of(g)
        empty_for: List[str] = []
        touches: List[str] = []
        mode = None if released else self._vgpu_mig_off(g, entry, empty_for, touches)
        # NVML answers for this GPU's device-level vGPU settings now (not while it is passed
        # through or in MIG mode; then the state is unknown until the steps before run)
        reads = not released and not (mode is not None and mode.current)
        mixed_now = self.view.nvml(g.address).mixed_size if reads else None
        sched_now = self.view.nvml(g.address).scheduler if reads else None
        table = board_tables().get(g.pci.device)
        if table is not None:             # the same counts check as the lint, for any selector
            check_vgpu_types(spec, table, f"{bdf} ({g.model})",
                             mixed=bool(spec.mixed_size if spec.mixed_size is not None else mixed_now))
        mixed_on_step = self._vgpu_mixed_size(g, entry, reads, mixed_now, empty_for, touches)
        self._vgpu_scheduler(g, entry, reads, mixed_now, sched_now, mixed_on_step, empty_for, touches)
        keep = {c.name.lower(): c.count for c in spec.types if c.count}
        removed = self.empty(g, vg, empty_for, where, keep) if empty_for else None
        if not empty_for:
            for what in touches:
                self.guard_in_use(g, vg, what)
        if not total:
            self.count_vgpus(g, vg, spec.types, removed, where, capacity_check=not released and not empty_for)
            mixed = self.mixed_after.get(g.address, spec.mixed_size if spec.mixed_size is not None
                                         else bool(mixed_now))
            if not mixed and not released:
                self.equal_size(g, vg, spec.types)
                sizes = sorted({VgpuProfile.parse(c.name).framebuffer_gb for c in spec.types if c.count})
                if len(sizes) > 1:      # a mixed-size pool's GPU kept in equal-size mode (busy)
                    self.block(f"{bdf} stays in equal-size mode while it holds vGPUs the layout did not create, "
                               f"and the layout's {', '.join(c.name for c in spec.types if c.count)} are "
                               f"{len(sizes)} sizes: remove those vGPUs (or stop their domains) first, so the "
                               "plan can turn mixed-size mode on")
        return removed

    def _vgpu_mig_off(self, g: Gpu, entry: Entry, empty_for: List[str], touches: List[str]) -> Optional[MigMode]:
        """Time-sliced vGPUs on a GPU in MIG mode (or with it pending): the step that turns it
        off, which needs the GPU empty (added to ``empty_for`` and ``touches``).  Returns the
        GPU's MIG mode (None where the view has none)."""
        mode = self.mig_mode(g)
        if mode is not None and mode.on_or_pending:
            bdf = str(g.address)
            vfs = mode.pending and self._vfs_block_mig(g, entry, "turning MIG mode off")
            self.diff(f"{bdf} mig-mode off (host has {mode.text()})", OPERATOR_MARK if vfs else None)
            empty_for.append("MIG mode can change only while the GPU has no vGPUs")
            touches.append("turning MIG mode off")
            self.step("mig-mode", LayoutChangeMigMode(
                bdf, "disable MIG mode (its GPU instances go first)",
                f"time-sliced vGPUs need MIG mode off ({entry.where})", enabled=False))
        return mode

    def _vgpu_mixed_size(self, g: Gpu, entry: Entry, reads: bool, mixed_now: Optional[bool],
                         empty_for: List[str], touches: List[str]) -> bool:
        """The entry's ``mixed_size`` on one GPU (``mixed_now``: NVML's answer, None where it has
        no such mode or cannot be read now, ``reads`` False): the step that changes it, which
        needs the GPU without vGPUs while one runs.  InputError ``FILE:LINE:`` for
        ``mixed_size: true`` on a GPU that has no such mode.  Returns whether a step turns it on."""
        spec: VgpuSpec = entry.vgpu
        if spec.mixed_size is None:
            return False
        bdf = str(g.address)
        cur = mixed_now
        if cur is None and reads:
            if spec.mixed_size:
                raise (spec.where or entry.where).error(
                    f"mixed_size: true, but {bdf} ({g.model}) has no mixed-size vGPU mode (NVML: not "
                    "supported)", hint="mixed-size mode needs vGPU 17+ on a board that offers it; use one "
                                       "framebuffer size and mixed_size: false")
            return False                  # off where the GPU has no such mode: nothing to do
        if cur is not None and bool(cur) == spec.mixed_size:
            return False
        want = "on" if spec.mixed_size else "off"
        if cur is not None and entry.pool is not None and entry.pool.mixed_size:
            vg = self.vgpus_of(g)
            # the layout's own idle vGPUs do not hold the mode: the plan removes them, switches and
            # re-creates them with the same ids (below); others' vGPUs, lent or mismatched ones do
            busy = len({e.id for e in vg.others + vg.layout_mismatched + vg.claimed})
            unseen = (self.view.nvml(g.address).active_vgpus or 0) - len(vg.layout_active) - busy
            if busy or unseen > 0:
                # a mixed-size pool switches only GPUs it can empty: a busy one keeps its mode (issue 30
                # item 2), and assert calls that drift until the GPU holds only the layout's vGPUs
                n = busy + max(0, unseen)
                self.plan.notes.append(
                    f"{bdf} keeps mixed-size mode {'on' if cur else 'off'} for pool {entry.pool.name!r}: it holds "
                    f"{n} vGPU(s) the layout did not create, and a mixed-size pool changes the mode only once "
                    "the GPU holds none; it switches at an apply after that")
                self.diff(f"{bdf} mixed-size {want} (host has {'on' if cur else 'off'}; pool "
                          f"{entry.pool.name!r})", EMPTY_MARK)
                self.mixed_after[g.address] = bool(cur)
                return False
        if cur is not None:
            self.diff(f"{bdf} mixed-size {want} (host has {'on' if cur else 'off'})")
            touches.append("changing mixed-size mode")
            if self._running(g):
                empty_for.append("mixed-size mode can change only while the GPU has no vGPUs")
        self.mixed_after[g.address] = bool(spec.mixed_size)
        self.step("mixed-size", LayoutSetMixedSize(
            bdf, f"turn mixed-size mode {want}",
            (f"host has {'on' if cur else 'off'}" if cur is not None else
             "its state is unknown until the steps before run") + f" ({entry.where})", on=spec.mixed_size))
        return spec.mixed_size

    def _vgpu_scheduler(self, g: Gpu, entry: Entry, reads: bool, mixed_now: Optional[bool],
                        sched_now: Optional[SchedulerState], mixed_on_step: bool, empty_for: List[str],
                        touches: List[str]) -> None:
        """The entry's scheduler on one GPU (``sched_now``: NVML's, None when it cannot be read
        now): blocks fixed share under mixed-size mode, and plans the change (before the
        mixed-size step when that leaves fixed share), which needs the GPU without running
        vGPUs; and the persistent setting."""
        spec: VgpuSpec = entry.vgpu
        bdf = str(g.address)
        where = str(entry.where)
        if mixed_on_step and entry.scheduler is None and sched_now is not None \
                and sched_now.policy == SchedulerPolicy.FIXED_SHARE:
            self.block(f"{bdf} uses the fixed-share scheduler, which mixed-size mode does not allow "
                       f"(docs/reference/hardware.md#vgpu-scheduling): add scheduler: {{policy: equal-share}} "
                       f"(or best-effort) to the entry at {where}")
        if entry.scheduler is None:
            return
        want_state = entry.scheduler.state
        if want_state.policy == SchedulerPolicy.FIXED_SHARE and spec.mixed_size is None and mixed_now:
            self.block(f"{bdf} is in mixed-size mode, where fixed share is not available "
                       f"(docs/reference/hardware.md#vgpu-scheduling): "
                       f"add mixed_size: false to the entry at {where}, or use equal-share")
        if reads:
            want_state = self._schedulable(g, entry, want_state)
        cur = sched_now
        if cur is None or not matches(want_state, cur):
            if cur is not None:
                self.diff(f"{bdf} scheduler {describe(want_state)} (host has {describe(cur)})")
                touches.append("changing the scheduler")
                if self._running(g):
                    empty_for.append("the scheduler can change only while no vGPU runs on the GPU")
            # leaving fixed share for mixed-size mode: the scheduler first (docs/reference/hardware.md#vgpu-scheduling)
            phase = "scheduler-first" if mixed_on_step else "scheduler"
            first = mixed_on_step and cur is not None and cur.policy == SchedulerPolicy.FIXED_SHARE
            self.step(phase, LayoutSetScheduler(
                bdf, f"set the vGPU scheduler: {describe(want_state)}",
                (f"host has {describe(cur)}" if cur is not None else "its state is unknown until the steps before run")
                + f" ({entry.scheduler.where})"
                + ("; before mixed-size mode, which fixed share does not allow" if first else ""), state=want_state))
        if entry.scheduler.persist:
            self.persist_scheduler(g, entry.scheduler.state, entry)

    def _schedulable(self, g: Gpu, entry: Entry, state: SchedulerState) -> SchedulerState:
        """The state :func:`vgpuhost.scheduler.set_runtime` would set on ``g`` for ``state`` (the
        driver's default time slice where the device has no ARR and no ARR parameter is given);
        InputError ``FILE:LINE:`` when the device cannot take it, so apply never removes vGPUs for
        a scheduler step that would then fail."""
        where = entry.scheduler.where
        facts = self.view.nvml(g.address)
        caps = facts.scheduler_caps
        if caps is None or facts.scheduler is None:
            raise where.error(f"{g.address} ({g.model}) has no device-level vGPU scheduler (NVML: not supported)",
                              hint="remove the scheduler key from this entry (and from the layout's default)")
        if (state.arr and not caps.arr_supported and state.frequency_hz is None and state.avg_factor is None
                and state.policy != SchedulerPolicy.BEST_EFFORT):
            state = replace(state, arr=False)
        try:
            check_caps(g.address, state, caps)
        except VgpuhostError as e:
            raise where.error(f"scheduler: {e.message}", hint=e.hint) from None
        return state

    def _running(self, g: Gpu) -> bool:
        n = self.view.nvml(g.address).active_vgpus
        return bool(n)

    def persist_scheduler(self, g: Gpu, state: SchedulerState, entry: Entry) -> None:
        bdf = str(g.address)
        conf = parse_conf(self.view.scheduler_conf or "")
        value = encode(state)
        have = conf.value_for(bdf)
        if have is None:
            have = conf.value_for(None)
        self.scheduler_override(g, conf, value)
        if have == value:
            return
        shown = "none" if have is None else f"0x{have:08x}"
        self.plan.reboot.append(reboot_step(
            "scheduler", bdf, f"persist RmPVMRL=0x{value:08x} ({describe(state)}): 'vgpuhost scheduler set --gpu "
            f"{bdf} --policy {state.policy}{_sched_flags(state)} --persist', then reload the nvidia module or reboot",
            f"scheduler.persist ({entry.scheduler.where}); vgpuhost's modprobe.d file has {shown}"))
        self.diff(f"{bdf} scheduler-persist RmPVMRL=0x{value:08x} (modprobe.d has {shown})", REBOOT_MARK)

    def scheduler_override(self, g: Gpu, conf: SchedulerConf, value: int) -> None:
        """Another modprobe.d file, or the kernel command line, that gives GPU ``g`` another ``RmPVMRL``
        than vgpuhost's file will (the last option wins, docs/reference/hardware.md#vgpu-scheduling): an
        operator step, since vgpuhost changes only its own file.  Nothing when the view read no files."""
        if not self.view.modprobe_files and self.view.cmdline is None:
            return
        mine = next((p for p, _ in self.view.modprobe_files if p.rsplit("/", 1)[-1] == CONF_NAME),
                    f"/etc/modprobe.d/{CONF_NAME}")
        files = with_own_file(self.view.modprobe_files, mine, render_conf(set_value(conf, value, [g.address])))
        line = override_line(value, registry_options(files, self.view.cmdline), str(g.address), mine)
        if line:
            self.plan.manual.append(operator_step(PlanKind.SCHEDULER, str(g.address), "merge or remove the "
                                                  "overriding NVreg_RegistryDwords* option", line))
            self.diff(f"{g.address} scheduler-persist overridden ({line})", OPERATOR_MARK)

    def vgpu_total(self, entry: Entry, gpus: Sequence[Gpu]) -> None:
        """A vgpu entry with counts: total: place the missing vGPUs across ``gpus`` by the strategy."""
        spec: VgpuSpec = entry.vgpu
        if not gpus:
            return
        removed_by_gpu: Dict[PciAddress, Optional[List[Any]]] = {}
        for g in gpus:
            removed_by_gpu[g.address] = self.vgpu(g, entry, total=True)
        have: Dict[str, List[Tuple[Gpu, Any]]] = {}
        missing: Dict[str, List[Tuple[Gpu, Any]]] = {}
        for g in gpus:
            vg = self.vgpus_of(g)
            for e in vg.layout_active:
                have.setdefault(e.type_name.lower(), []).append((g, e))
            for e in vg.layout_missing:
                missing.setdefault(e.type_name.lower(), []).append((g, e))
        want = {c.name.lower(): (self.spelled(gpus[0], c.name), c.count) for c in spec.types}
        tot = _Totals(gpus, ",".join(str(g.address) for g in gpus), have, missing, want, removed_by_gpu)
        for key in sorted(set(want) | set(have)):
            name, n = want[key] if key in want else (self.spelled(gpus[0], have[key][0][1].type_name or key), 0)
            if len(have.get(key, [])) != n:
                self.diff(f"{tot.label} vgpu {name} x{n} total (host has {len(have.get(key, []))})")
        for key, pairs in sorted(missing.items()):
            for g, e in pairs:
                self.diff(f"{g.address} vgpu {e.type_name} {e.id} (recorded for the layout, missing on the host)")
        for key in sorted(set(want) | set(have) | set(missing)):
            self._vgpu_total_type(entry, tot, key)

    def _vgpu_total_type(self, entry: Entry, tot: _Totals, key: str) -> None:
        """One type (lower-cased name ``key``) of a total-count entry: its vGPUs on emptied GPUs
        come back where they were, the oldest of the rest stay and the newest beyond the
        count go, recorded missing ones are re-created while there is room (their records
        dropped otherwise), and what is still missing is placed by the strategy."""
        where = str(entry.where)
        have, missing = tot.have.get(key, []), tot.missing.get(key, [])
        name, n = tot.want[key] if key in tot.want else (self.spelled(tot.gpus[0], _type_name(
            [e for _, e in have + missing], key)), 0)
        # vGPUs on emptied GPUs come back where they were
        kept: List[Tuple[Gpu, Any]] = []
        for g, e in have:
            if tot.removed.get(g.address) is not None:
                kept.append((g, e))
        kept = kept[:n]
        for g in tot.gpus:
            mine = [e for gg, e in kept if gg.address == g.address]
            if mine:
                uuids = tuple(e.id for e in mine)      # the same ids: mdev UUIDs, or the VFs (vendor VFIO)
                self.step("vgpu-create", LayoutCreateVgpus(
                    str(g.address), f"create {len(mine)} x {name}",
                    f"back where it was before the GPU was emptied ({where})",
                    profile=name, count=len(mine), uuids=uuids))
        stay = [(g, e) for g, e in have if tot.removed.get(g.address) is None]
        stay.sort(key=lambda ge: self._time(ge[1].id))
        room = max(0, n - len(kept))
        for g, e in stay[room:][::-1]:
            self.step("vgpu-remove", LayoutRemoveVgpu(
                str(g.address), f"remove {e.type_name} {e.id}",
                f"layout wants {n} {name} in total, host has {len(have)} ({where})", vgpu_id=e.id))
        room = max(0, room - len(stay))
        for g, e in missing:
            if room:
                room -= 1
                self.step("vgpu-create", LayoutRecreateVgpu(
                    str(g.address), f"re-create {e.type_name} {e.id}",
                    f"recorded for the layout, missing on the host ({where})", vgpu_id=e.id))
            else:
                self.step("vgpu-remove", LayoutRemoveVgpu(
                    str(g.address), f"drop the record of missing {e.type_name} {e.id}",
                    f"not wanted any more ({where})", vgpu_id=e.id))
        if room:
            self._place_total(entry, tot, name, n, room)

    def _place_total(self, entry: Entry, tot: _Totals, name: str, n: int, room: int) -> None:
        """Place ``room`` more vGPUs of type ``name`` (``n`` wanted in total) on the entry's GPUs
        bound to nvidia, by the entry's strategy; a GPU whose settings a step changes takes
        what cannot be placed now; otherwise the plan is blocked."""
        spec: VgpuSpec = entry.vgpu
        pool = [g for g in tot.gpus if g.pci.driver == "nvidia"]
        offs = [o for o in offers(self.inv, self.view.records, name, self.seen)
                if o.gpu in {g.address for g in pool}]
        placed: Dict[PciAddress, int] = {}
        for _ in range(room):
            d = place(offs, Request(name, LAYOUT, spec.strategy))
            if not d.admitted:
                changing = [g for g in tot.gpus if str(g.address) in self.changing]
                if changing:
                    placed[changing[0].address] = placed.get(changing[0].address, 0) + 1
                    continue
                self.block(f"cannot place {room} x {name} on {tot.label} ({entry.where}): {d.reason}")
                break
            placed[d.gpu] = placed.get(d.gpu, 0) + 1
            offs = [_taken(o) if o.gpu == d.gpu else o for o in offs]
        for gpu, k in sorted(placed.items()):
            self.step("vgpu-create", LayoutCreateVgpus(
                str(gpu), f"create {k} x {name}",
                f"layout wants {n} {name} in total, {spec.strategy} places {k} here ({entry.where})",
                profile=name, count=k))

    def mig(self, g: Gpu, entry: Entry) -> None:
        """A mig entry on one GPU: MIG mode on, its GPU instances, then its vGPUs (counted)."""
        spec: MigSpec = entry.mig
        bdf = str(g.address)
        where = str(entry.where)
        if self.release_if_passed_through(g, entry):
            self._mig_after_release(g, entry)
            return
        mode = self.mig_mode(g)
        if mode is None:
            raise entry.where.error(f"{bdf} ({g.model}) is not MIG-capable (NVML reports no MIG mode)",
                                    hint="use mode: vgpu or passthrough for it")
        profiles = list(self.view.nvml(g.address).gi_profiles)
        label = f"{bdf} ({self.view.nvml(g.address).name or g.model})"
        wanted_ids = check_mig(spec, profiles, label)
        if any(c.count for c in spec.vgpus) and self._vfs_off(g) and not mode.current:
            self._mig_on_with_vfs_off(g, entry, mode)
            return
        if any(c.count for c in spec.vgpus) and self.no_backend(g, entry):
            return
        self.check_types(g, spec.vgpus, mig_profiles=profiles)
        vg = self.vgpus_of(g)
        empty_for: List[str] = []
        touches: List[str] = []
        gis = self._mig_mode_on(g, entry, mode, empty_for, touches)
        if gis is None:
            return
        self._mig_instances(g, entry, profiles, gis, wanted_ids, empty_for, touches)
        keep = {c.name.lower(): c.count for c in spec.vgpus if c.count}
        removed = self.empty(g, vg, empty_for, where, keep) if empty_for else None
        if not empty_for:
            for what in touches:
                self.guard_in_use(g, vg, what)
        gi_step = any(s.target == bdf for s in self.phases["gpu-instance"])
        self.count_vgpus(g, vg, spec.vgpus, removed, where, capacity_check=not empty_for and not gi_step)

    def _mig_after_release(self, g: Gpu, entry: Entry) -> None:
        """A mig entry on a GPU that comes back from passthrough: its MIG state is unknown until
        then, so MIG mode on and the whole GPU-instance layout are planned, and the vGPUs counted."""
        spec: MigSpec = entry.mig
        bdf = str(g.address)
        where = str(entry.where)
        layout = {c.name: c.count for c in spec.instances if c.count}
        self.step("mig-mode", LayoutChangeMigMode(
            bdf, "enable MIG mode", f"mode mig; the state is unknown while the GPU is passed through ({where})",
            enabled=True))
        self.step("gpu-instance", LayoutMakeGpuInstances(
            bdf, f"make GPU instances {layout_text(layout)}", f"mode mig ({where})", layout=tuple(layout.items())))
        self.count_vgpus(g, self.vgpus_of(g), spec.vgpus, [], where, capacity_check=False)

    def _mig_on_with_vfs_off(self, g: Gpu, entry: Entry, mode: MigMode) -> None:
        """VFs off: the moment to turn MIG mode on (or to reset the GPU where it is pending); GPU
        instances and vGPUs come after the VFs are enabled (docs/reference/hardware.md#vendor-vfio)."""
        bdf = str(g.address)
        where = str(entry.where)
        if mode.pending:
            self.plan.reboot.append(reboot_step("mig-mode", bdf, f"reset the GPU (nvidia-smi -r -i {bdf}) or "
                                                "reboot: MIG mode on is pending", f"mode mig ({where})"))
            self.diff(f"{bdf} mig-mode on (host has off, on pending)", RESET_MARK)
        else:
            self.diff(f"{bdf} mig-mode on (host has off)")
            procs = self.view.nvml(g.address).compute_processes
            if procs:
                self.block(f"{bdf}: {procs} process(es) use the GPU: MIG mode cannot change (stop them)")
            self.step("mig-mode", LayoutChangeMigMode(
                bdf, "enable MIG mode", f"mode mig, host has MIG off ({where})", enabled=True))
        self._vfs_after(g, entry)

    def _mig_mode_on(self, g: Gpu, entry: Entry, mode: MigMode, empty_for: List[str],
                     touches: List[str]) -> Optional[List[Any]]:
        """MIG mode on for a mig entry: the step that turns it on (the GPU empty first) or
        cancels a pending disable.  Returns the GPU's GPU instances now ([] while MIG mode is
        off), or None when MIG mode on waits for a GPU reset (reported; nothing more to plan)."""
        bdf = str(g.address)
        where = str(entry.where)
        if mode.current:
            if not mode.pending:                   # on now, but off after the next GPU reset
                vfs = self._vfs_block_mig(g, entry, "cancelling the pending MIG disable")
                self.diff(f"{bdf} mig-mode on (host has on, off pending)", OPERATOR_MARK if vfs else None)
                touches.append("enabling MIG mode")
                self.step("mig-mode", LayoutChangeMigMode(
                    bdf, "enable MIG mode (cancels the pending disable)",
                    f"mode mig, host has MIG off pending ({where})", enabled=True))
            return list(self.view.nvml(g.address).gpu_instances)
        if mode.pending:
            self.plan.reboot.append(reboot_step("mig-mode", bdf, f"reset the GPU (nvidia-smi -r -i {bdf}) or "
                                                "reboot: MIG mode on is pending", f"mode mig ({where}); GPU "
                                                "instances come after the reset"))
            self.diff(f"{bdf} mig-mode on (host has off, on pending)", RESET_MARK)
            return None
        vfs = self._vfs_block_mig(g, entry, "enabling MIG mode")
        self.diff(f"{bdf} mig-mode on (host has off)", OPERATOR_MARK if vfs else None)
        procs = self.view.nvml(g.address).compute_processes
        if procs:
            self.block(f"{bdf}: {procs} process(es) use the GPU: MIG mode cannot change (stop them)")
        empty_for.append("MIG mode can change only while the GPU has no vGPUs")
        touches.append("enabling MIG mode")
        self.step("mig-mode", LayoutChangeMigMode(
            bdf, "enable MIG mode", f"mode mig, host has MIG off ({where})", enabled=True))
        return []

    def _mig_instances(self, g: Gpu, entry: Entry, profiles: Sequence[Any], gis: List[Any],
                       wanted_ids: Dict[int, int], empty_for: List[str], touches: List[str]) -> None:
        """The entry's GPU instances against the GPU's (``profiles``: its GiProfile values;
        ``gis``: its GpuInstance values; ``wanted_ids``: ``{profile id: count}``): the step
        that makes them, which needs the GPU empty when one is destroyed."""
        if not entry.mig.instances_given:
            return          # `mig: {on_demand: ...}` alone: the GPU keeps the instances it has
        bdf = str(g.address)
        layout = {c.name: c.count for c in entry.mig.instances if c.count}
        by_id = {p.profile_id: p for p in profiles}
        have_counts: Dict[str, int] = {}
        for x in gis:
            n = by_id[x.profile_id].name if x.profile_id in by_id else f"profile {x.profile_id}"
            have_counts[n] = have_counts.get(n, 0) + 1
        want_counts = {by_id[i].name: n for i, n in wanted_ids.items()}
        if entry.mig.on_demand is True:
            # MIG on demand: the declared instances are a floor; every other one stays (those made for
            # running domains come and go with them: neither drift nor a step; trial 5 finding 9)
            short = {n: c - have_counts.get(n, 0) for n, c in want_counts.items() if c > have_counts.get(n, 0)}
            if not short:
                return
            have_ids: Dict[int, int] = {}
            for x in gis:
                have_ids[x.profile_id] = have_ids.get(x.profile_id, 0) + 1
            wanted_ids = {i: max(wanted_ids.get(i, 0), have_ids.get(i, 0)) for i in set(wanted_ids) | set(have_ids)
                          if i in by_id}
            layout = {by_id[i].name: c for i, c in wanted_ids.items() if c}
            want_counts = dict(layout)
        if have_counts == want_counts:
            return
        self.diff(f"{bdf} gpu-instances {layout_text(want_counts)} (host has {layout_text(have_counts)})")
        lp = plan_layout(profiles, gis, wanted_ids)
        parts = []
        if lp.destroy:
            parts.append("destroy " + ", ".join(f"{d.profile} (GI {d.gi_id})" for d in lp.destroy))
            empty_for.append("GPU instances can be destroyed only while the GPU has no vGPUs")
        if lp.create:
            parts.append("create " + ", ".join(c.profile for c in lp.create))
        if lp.destroy or entry.mig.on_demand is not True:
            touches.append("changing GPU instances")    # an on-demand floor's creates touch no vGPU
        self.step("gpu-instance", LayoutMakeGpuInstances(
            bdf, f"make GPU instances {layout_text(want_counts)}" + (f": {'; '.join(parts)}" if parts else ""),
            f"host has {layout_text(have_counts)} ({entry.where})", layout=tuple(layout.items())))

    def orphans(self, selection: Dict[PciAddress, Entry]) -> None:
        """Layout vGPUs on GPUs this layout does not select: removed."""
        chosen = {str(a) for a in selection}
        for e in self.entries:
            if e.owner != LAYOUT or (e.gpu in chosen):
                continue
            gone = e.state == "missing"
            self.diff(f"{e.gpu} vgpu {e.type_name} {e.id} (owner layout, not in layout {self.lay.name!r})")
            verb = "drop the record of missing" if gone else "remove"
            self.step("vgpu-remove", LayoutRemoveVgpu(e.gpu or e.parent, f"{verb} {e.type_name} {e.id}",
                                                      f"owner layout, but no entry of layout {self.lay.name!r} selects "
                                                      "its GPU", vgpu_id=e.id))

    def walk(self) -> Plan:
        self.host_settings()
        selection = self.select()
        for entry in self.lay.entries:
            gpus = [self.inv.gpu(a) for a, e in sorted(selection.items()) if e is entry]
            if entry.mode == "passthrough":
                for g in gpus:
                    self.passthrough(g, entry)
            elif entry.mode == "mig":
                for g in gpus:
                    self.mig(g, entry)
            elif entry.vgpu.counts == "total":
                self.vgpu_total(entry, gpus)
            else:
                for g in gpus:
                    self.vgpu(g, entry)
        self.orphans(selection)
        return self.result()


def _type_name(entries: Sequence[Any], default: str) -> str:
    """The type name the first of ``entries`` (vGPU list entries) records, else ``default``."""
    return next((e.type_name for e in entries if e.type_name), default)


def _taken(o: GpuOffer) -> GpuOffer:
    """``o`` after one more vGPU of its type landed there (placement simulation)."""
    return replace(o, available=max(0, o.available - 1), present=o.present + 1,
                   parents=o.parents[1:] if len(o.parents) > 1 else o.parents)


def _sched_flags(state: SchedulerState) -> str:
    if state.policy == SchedulerPolicy.BEST_EFFORT:
        return ""
    if not state.arr:
        return f" --timeslice-ms {state.timeslice_ms}" if state.timeslice_ms else ""
    if state.frequency_hz is not None:
        return f" --frequency-hz {state.frequency_hz} --avg-factor {state.avg_factor}"
    return ""





# ---------------------------------------------------------------------------
# public

def plan(config: Config, layout: Optional[str], view: HostView) -> Plan:
    """The ordered steps that bring the host ``view`` shows to ``layout`` of ``config``
    (None: the config's default layout).  Pure: reads nothing but its arguments.

    Raises InputError (``FILE:LINE:``) when the layout does not suit this host (a
    type the GPU does not offer, a MIG layout that cannot fit it, two entries
    selecting one GPU, a scheduler the device cannot take) and whatever kept a
    needed GPU's NVML facts from being read (:meth:`HostView.nvml`:
    HostEnvironmentError when NVML is missing).
    """
    return _Walker(config, config.layout(layout), view).walk()


def drift(config: Config, layout: Optional[str], view: HostView) -> Drift:
    """How the host ``view`` shows differs from ``layout``: the walk of :func:`plan`, as drift lines."""
    p = plan(config, layout, view)
    return Drift(p.layout, p.source, list(p.diff), list(p.reboot_diff))


def _matches_offline(entry: Entry, g: Gpu) -> Optional[bool]:
    """Whether ``entry`` selects ``g`` without NVML; None for a UUID selector (it needs NVML)."""
    sel = entry.select
    if sel.kind == "all":
        return True
    if sel.kind == "address":
        return g.address in sel.values
    if sel.kind == "device_id":
        return g.pci.device in sel.values
    if sel.kind == "board":
        names = board_names(g.pci.device, g.board)
        return any(v.lower() in names for v in sel.values)
    return None


def pools(config: Config, layout: Optional[str], view: HostView) -> List[Pool]:
    """The tenancy pools ``layout`` declares, each with the GPUs of ``view`` its entries select (BDF
    strings), in file order.  Pure."""
    lay = config.layout(layout)
    walker = _Walker(config, lay, view)
    by: Dict[str, Pool] = {}
    for e in lay.entries:
        if e.pool is None:
            continue
        gpus = tuple(str(g.address) for g in walker.inv.gpus if walker._matches(e, g))
        key = e.pool.name.lower()
        old = by.get(key)
        by[key] = Pool(e.pool.name, e.scheduler.state.policy, e.pool.serves,
                       (old.gpus if old else ()) + tuple(g for g in gpus if not old or g not in old.gpus),
                       e.pool.ceiling)
    return list(by.values())


def mig_on_demand(config: Config, layout: Optional[str], view: HostView) -> Dict[str, bool]:
    """``{GPU BDF: on}`` for the GPUs of ``view`` that ``layout``'s mig entries with ``on_demand`` set
    select (MIG on demand, :mod:`vgpuhost.ops.migdemand`).  Pure."""
    lay = config.layout(layout)
    walker = _Walker(config, lay, view)
    out: Dict[str, bool] = {}
    for e in lay.entries:
        if e.mig is None or e.mig.on_demand is None:
            continue
        for g in walker.inv.gpus:
            if walker._matches(e, g):
                out[str(g.address)] = e.mig.on_demand
    return out


def scope(config: Config, layout: Optional[str]):
    """``(gpus, nvml)`` for :func:`vgpuhost.observe.hostview.observe`: a function of the
    inventory giving the GPUs ``layout`` may select, and whether any of them may need
    NVML (a mig or vgpu entry, or a UUID selector).  Pure."""
    lay = config.layout(layout)
    needs_nvml = any(e.mode != "passthrough" or e.select.kind == "uuid" for e in lay.entries)

    def gpus(inv: Inventory) -> List[PciAddress]:
        out = []
        for g in inv.gpus:
            if any(_matches_offline(e, g) is not False for e in lay.entries):
                out.append(g.address)
        return out

    return gpus, needs_nvml


__all__ = ["plan", "drift", "scope", "pools", "Plan", "Drift", "PlanLine", "LayoutStep", "Report", "LayoutRemoveVgpu",
           "LayoutCreateVgpus", "LayoutRecreateVgpu", "mig_on_demand", "LayoutChangeMigMode", "LayoutMakeGpuInstances",
           "LayoutSetMixedSize", "LayoutSetScheduler", "LayoutPreparePassthrough", "LayoutReleasePassthrough", "KINDS",
           "PHASES", "REBOOT_MARK", "RESET_MARK", "OPERATOR_MARK"]
