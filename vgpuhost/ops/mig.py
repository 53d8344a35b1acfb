"""MIG on a host: show, enable/disable, apply and assert GPU-instance layouts.

Owns: the operations ``show``, ``enable``/``disable``, ``apply`` and
``assert`` over an :class:`~vgpuhost.io.nvml.NvmlBackend`: observe the
device, refuse what must not start, plan (:mod:`vgpuhost.plan.mig`) and run
the steps through the one Executor (an audit row ``nvml:<call>`` each, undone
on failure), then read the result back.  Layout parsing, names and placement
are :mod:`vgpuhost.policy.mig`'s.  Must not: call pynvml, spell kernel paths
or read files (the inventory reads ``/proc``).

Facts (the project's docs reference, sections 3 and 5): enabling MIG mode
needs no processes and no vGPUs on the GPU and can stay *pending* until a GPU
reset.  On the vendor-specific VFIO path the order is MIG mode -> SR-IOV ->
GPU instances -> mixed-size mode -> vGPUs (``sriov-manage -e`` destroys GPU
instances), so a MIG mode change is refused while VFs are enabled there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..io.backends import open_backend
from ..io.hostroot import HostRoot
from ..io.locks import file_lock
from ..io.nvml import NvmlBackend, NvmlError
from ..io.process import actor as actor_name
from ..io.sysfs import Sysfs
from ..model.concepts import Backend, OwnerKind
from ..model.errors import DeviceError, InputError, RefusedError
from ..model.nvml import GiProfile, GpuInstance
from ..model.values import PciAddress
from ..observe.inventory import discover, discover_gpu
from ..plan.executor import Executor
from ..plan.mig import LayoutPlan, busy_refusal, plan_layout, plan_mode_change
from ..plan.steps import CreateGi, DestroyGi, Step
from ..policy.mig import (
    ORDER, counts, layout_text, name_key, names, parse_layout, place, profile_name, resolve_layout, why_not
)
from . import health, migmade
from .nvmljournal import start
from .recover import recover_locked

SCHEMA_SHOW = "vgpuhost.mig-show/v1"
SCHEMA_OUTCOME = "vgpuhost.mig/v1"
SCHEMA_ASSERT = "vgpuhost.mig-assert/v1"



# ---------------------------------------------------------------------------
# layouts (pure)

# ---------------------------------------------------------------------------
# outcomes

@dataclass
class MigOutcome:
    action: str
    gpu: str
    changed: bool
    dry_run: bool
    name: str = ""
    mig_mode: Optional[Dict[str, bool]] = None
    layout_before: Dict[str, int] = field(default_factory=dict)
    layout_after: Dict[str, int] = field(default_factory=dict)
    steps: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    writes: int = 0

    def as_dict(self) -> dict:
        return {"schema": SCHEMA_OUTCOME, **self.__dict__}


@dataclass
class MigAssert:
    gpu: str
    in_sync: bool
    wanted: Dict[str, int]
    actual: Dict[str, int]
    mig_mode: Optional[Dict[str, bool]]
    diff: List[Dict[str, object]]

    def as_dict(self) -> dict:
        return {"schema": SCHEMA_ASSERT, **self.__dict__}


# ---------------------------------------------------------------------------
# device access

class _Device:
    """One GPU as NVML and sysfs see it (read at construction)."""

    def __init__(self, host: HostRoot, backend: NvmlBackend, bdf: PciAddress, inv=None):
        self.host, self.backend, self.bdf = host, backend, bdf
        # this GPU alone (issue 17): a MIG step of a layout on N GPUs must not read all N each time
        inv = inv if inv is not None else discover_gpu(Sysfs(host), bdf, with_types=False)
        self.inv = inv
        g = inv.gpu(bdf)
        if g is None:
            known = ", ".join(str(x.address) for x in discover(Sysfs(host), with_types=False).gpus) or "none"
            raise InputError(f"no NVIDIA GPU at {bdf}", hint=f"GPUs on this host: {known} ('vgpuhost gpus')")
        self.gpu = g
        try:
            self.name = backend.device_name(bdf)
            self.mode = backend.mig_mode(bdf)
        except NvmlError as e:
            if e.nvml_name == "NVMLError_NotFound":
                drv = g.pci.driver
                raise RefusedError(f"NVML does not see {bdf}: it is bound to {drv or 'no driver'}",
                                   hint="NVML sees only GPUs on the nvidia driver; "
                                        f"'vgpuhost passthrough release {bdf}' gives it back") from None
            raise

    def require_mig(self) -> None:
        if self.mode is None:
            raise RefusedError(f"{self.bdf} ({self.name}) is not MIG-capable")

    def profiles(self) -> List[GiProfile]:
        return list(self.backend.gi_profiles(self.bdf))

    def instances(self) -> List[GpuInstance]:
        return list(self.backend.gpu_instances(self.bdf))

    def busy(self, gis: Sequence[GpuInstance]) -> Dict[int, int]:
        """``{gi_id: vGPUs on it}`` for the GPU instances that hold vGPUs (NVML's
        ``nvmlVgpuInstanceGetGpuInstanceId`` of each active vGPU).  Where NVML cannot say which
        instance a vGPU sits on but vGPUs exist, every instance counts as busy (nothing is
        destroyed under a vGPU on a guess)."""
        try:
            return dict(self.backend.gpu_instance_vgpus(self.bdf))
        except NvmlError as e:
            if not e.not_supported:
                raise
        n = self.vgpus()
        return {g.gi_id: n for g in gis} if n else {}

    def vgpus(self) -> int:
        try:
            return int(self.backend.active_vgpus(self.bdf))
        except NvmlError as e:
            if e.not_supported:
                return 0
            raise


def _mode_dict(mode: Optional[Tuple[bool, bool]]) -> Optional[Dict[str, bool]]:
    return None if mode is None else {"current": bool(mode[0]), "pending": bool(mode[1])}


def _run(dev: _Device, store, steps: Sequence[Step], *, actor: str, operation: str, kind: str, owner: str,
         want: dict, check=None) -> int:
    """Run NVML steps through the Executor (audit row each, verify, undo on failure); the writes made.

    A journal entry of ``kind`` (:mod:`vgpuhost.ops.nvmljournal`: the GPU's
    state before, ``want``, the steps) is opened before the first call and
    closed when the steps and ``check()`` (the read-back) end, so an
    interrupted run is finished or rolled back by ``reconcile``.  An NVML
    failure becomes a DeviceError naming the step and whether the earlier
    steps were undone.
    """
    ex = Executor(dev.host, store, actor=actor, operation=operation, backend=dev.backend)
    ex.journal = start(store, dev.backend, dev.bdf, kind=kind, operation=operation, owner=owner, actor=actor,
                       steps=[s.describe(dev.host) for s in steps], want=want)
    with ex.journal:
        try:
            ex.run(steps)
        except NvmlError as e:
            what = ex.failed.describe(dev.host) if ex.failed is not None else e.call
            marked = health.failed_write(store, dev.bdf, e, what, actor=actor, operation=operation)
            raise DeviceError(f"{what} on {dev.bdf} failed: {e.nvml_name}"
                              + (f" ({e.hint})" if e.hint else "") + (health.MARKED if marked else "")
                              + ("; the earlier steps were undone" if ex.undo_ok else
                                 "; undoing the earlier steps failed too: check 'vgpuhost mig show'"),
                              hint="see 'vgpuhost audit'") from e
        if check is not None:
            check()
    return ex.writes


def _recover_first(host: HostRoot, store, bdf: PciAddress, actor: Optional[str]) -> None:
    """Finish or roll back what an interrupted operation left on ``bdf`` (its lock held)."""
    recover_locked(host, store, gpu=str(bdf), actor=actor or actor_name())


# ---------------------------------------------------------------------------
# operations

def show(host: HostRoot, gpu: Optional[PciAddress] = None, *, backend: Optional[NvmlBackend] = None) -> dict:
    """MIG state of every NVIDIA GPU (or ``gpu``): the ``vgpuhost.mig-show/v1`` document.

    Per GPU: ``gpu``, ``name``, ``mig_capable``, ``mig_mode`` ({current,
    pending} or None), ``pending_change``, ``profiles`` (id, name, slices,
    memory_mib, max_count, placements [{start, size}]), ``gpu_instances``
    ({gi_id, profile_id, profile, start, size, vgpus: the vGPUs on it, None when NVML cannot
    say}), ``layout`` ({name: count}),
    ``error`` (NVML could not answer for this GPU) or None.
    """
    backend = backend or open_backend(host)
    host.require_host()
    inv = discover(Sysfs(host), with_types=False)
    if gpu is not None and inv.gpu(gpu) is None:
        known = ", ".join(str(x.address) for x in inv.gpus) or "none"
        raise InputError(f"no NVIDIA GPU at {gpu}", hint=f"GPUs on this host: {known} ('vgpuhost gpus')")
    entries = []
    for g in inv.gpus:
        if gpu is not None and g.address != gpu:
            continue
        e: Dict[str, object] = {"gpu": str(g.address), "name": None, "mig_capable": False, "mig_mode": None,
                                "pending_change": False, "profiles": [], "gpu_instances": [], "layout": {},
                                "error": None}
        try:
            e["name"] = backend.device_name(g.address)
            mode = backend.mig_mode(g.address)
            e["mig_mode"] = _mode_dict(mode)
            if mode is not None:
                e["mig_capable"] = True
                e["pending_change"] = mode[0] != mode[1]
                profiles = backend.gi_profiles(g.address)
                gis = backend.gpu_instances(g.address)
                by_id = {p.profile_id: p for p in profiles}
                e["profiles"] = [{"profile_id": p.profile_id, "name": p.name, "slices": p.slices,
                                  "memory_mib": p.memory_mib, "max_count": p.max_count,
                                  "placements": [{"start": s, "size": z} for s, z in p.placements]}
                                 for p in profiles]
                try:
                    held = backend.gpu_instance_vgpus(g.address) if gis else {}
                except NvmlError:
                    held = None                 # NVML cannot say which instance a vGPU sits on
                e["gpu_instances"] = [{"gi_id": x.gi_id, "profile_id": x.profile_id,
                                       "profile": profile_name(by_id, x.profile_id),
                                       "start": x.start, "size": x.size,
                                       "vgpus": None if held is None else held.get(x.gi_id, 0)} for x in gis]
                e["layout"] = counts(profiles, gis)
        except NvmlError as err:
            e["error"] = err.one_line()
        entries.append(e)
    return {"schema": SCHEMA_SHOW, "gpus": entries}


def show_text(doc: dict) -> str:
    lines: List[str] = []
    for e in doc["gpus"]:
        head = f"{e['gpu']} {e['name'] or ''}".rstrip()
        if e["error"]:
            lines.append(f"{head}: NVML: {e['error']}")
            continue
        if not e["mig_capable"]:
            lines.append(f"{head}: not MIG-capable")
            continue
        m = e["mig_mode"]
        state = "on" if m["current"] else "off"
        if e["pending_change"]:
            state += f" (pending: {'on' if m['pending'] else 'off'} after a GPU reset)"
        lines.append(f"{head}: MIG {state}")
        lines.append(f"  layout: {layout_text(e['layout'])}")
        for x in e["gpu_instances"]:
            lines.append(f"  GPU instance {x['gi_id']}: {x['profile']} (profile id {x['profile_id']}) "
                         f"at memory slice {x['start']}, size {x['size']}"
                         + (f", holds {x['vgpus']} vGPU{'s' if x['vgpus'] != 1 else ''}" if x.get("vgpus") else ""))
        lines.append("  profiles: " + ", ".join(
            f"{p['name']} (id {p['profile_id']}, max {p['max_count']})" for p in e["profiles"]))
    return "\n".join(lines) if lines else "no NVIDIA GPU found"


def _check_mode_change(dev: _Device, want: bool) -> None:
    """Refuse (RefusedError) while vGPUs, processes or VFs block a MIG mode change."""
    bdf = dev.bdf
    n = dev.vgpus()
    if n:
        raise RefusedError(f"cannot {'enable' if want else 'disable'} MIG mode on {bdf}: {n} vGPU(s) exist",
                           hint=f"remove them first ('vgpuhost vgpu list'); order: {ORDER}")
    procs = int(dev.backend.compute_processes(bdf))
    if procs:
        raise RefusedError(f"cannot change MIG mode on {bdf}: {procs} process(es) use the GPU",
                           hint="stop them (nvidia-smi lists them) and retry")
    if dev.gpu.vgpu_backend == Backend.VENDOR_VFIO and dev.gpu.vfs:
        raise RefusedError(
            f"cannot change MIG mode on {bdf}: {len(dev.gpu.vfs)} SR-IOV VFs are enabled; the order is {ORDER}",
            hint=f"disable them (/usr/lib/nvidia/sriov-manage -d {bdf}), change MIG mode, then enable them "
                 f"again (sriov-manage -e {bdf})")


def set_mode(host: HostRoot, store, bdf: PciAddress, enabled: bool, *, dry_run: bool = False,
             backend: Optional[NvmlBackend] = None, actor: Optional[str] = None,
             owner: str = OwnerKind.MANUAL) -> MigOutcome:
    """Enable or disable MIG mode on ``bdf`` (idempotent).

    Journaled (kind ``mig-mode``, ``owner``: ``manual`` or ``layout``) before
    the first NVML call; an interrupted one left on the GPU is finished or
    rolled back first.  Disabling destroys the GPU instances first (listed in the plan).  Refuses
    (RefusedError) while vGPUs, processes or, on the vendor-VFIO path, VFs
    block it; a change left pending until a GPU reset is reported in
    ``mig_mode`` and the notes.  DeviceError when NVML fails (undone).
    """
    backend = backend or open_backend(host)
    action = "enable" if enabled else "disable"

    def plan(dev: _Device) -> Tuple[MigOutcome, List[Step]]:
        dev.require_mig()
        cur, pending = dev.mode
        out = MigOutcome(action, str(bdf), changed=False, dry_run=dry_run, name=dev.name,
                         mig_mode=_mode_dict(dev.mode))
        profiles = dev.profiles()
        gis = dev.instances() if cur else []
        out.layout_before = counts(profiles, gis)
        if pending == enabled:
            out.layout_after = dict(out.layout_before)
            if cur != enabled:
                out.notes.append(f"MIG mode {'on' if enabled else 'off'} is pending: reset the GPU "
                                 f"(nvidia-smi -r -i {bdf}) or reboot for it to take effect")
            return out, []
        _check_mode_change(dev, enabled)
        steps = plan_mode_change(bdf, profiles, gis, enabled)
        out.steps = [s.describe() for s in steps]
        out.changed = True
        if dev.inv.host.running("nvidia-persistenced"):
            out.notes.append("nvidia-persistenced runs: it can block the GPU reset, leaving the change pending")
        return out, steps

    dev = _Device(host, backend, bdf)
    if dry_run:
        return plan(dev)[0]
    with file_lock(store.state_dir, f"gpu-{bdf}"):
        _recover_first(host, store, bdf, actor)
        dev = _Device(host, backend, bdf)
        out, steps = plan(dev)
        if not steps:
            return out

        def check() -> None:
            mode = backend.mig_mode(bdf)
            out.mig_mode = _mode_dict(mode)
            if mode is None or mode[1] != enabled:
                raise DeviceError(f"MIG mode on {bdf} reads back {out.mig_mode} after {action}",
                                  hint="check nvidia-smi -q and dmesg")

        out.writes = _run(dev, store, steps, actor=actor or actor_name(), operation=f"mig {action} {bdf}",
                          kind="mig-mode", owner=owner, want={"mig_mode": bool(enabled)}, check=check)
        mode = backend.mig_mode(bdf)
        out.layout_after = counts(dev.profiles(), backend.gpu_instances(bdf) if mode[0] else [])
        if mode[0] != enabled:
            out.notes.append(f"MIG mode {'on' if enabled else 'off'} is pending: reset the GPU "
                             f"(nvidia-smi -r -i {bdf}) or reboot for it to take effect")
        return out


def enable(host: HostRoot, store, bdf: PciAddress, **kw) -> MigOutcome:
    return set_mode(host, store, bdf, True, **kw)


def disable(host: HostRoot, store, bdf: PciAddress, **kw) -> MigOutcome:
    return set_mode(host, store, bdf, False, **kw)


def apply(host: HostRoot, store, bdf: PciAddress, layout: "str | Mapping[str, int]", *,
          dry_run: bool = False, backend: Optional[NvmlBackend] = None,
          actor: Optional[str] = None, owner: str = OwnerKind.MANUAL, adopt: bool = False) -> MigOutcome:
    """Make ``bdf``'s GPU instances match ``layout`` (a no-op when they already do).

    Journaled (kind ``mig-apply``, ``owner``) before the first NVML call: an
    interruption leaves the old layout or the new one after ``reconcile``
    (:mod:`vgpuhost.ops.nvmljournal`); one left on the GPU is ended first.

    Names resolve against the device's profiles (InputError with near
    matches otherwise).  A layout that cannot fit is refused (RefusedError)
    before anything is touched, naming why; so is MIG mode off or pending,
    and destroying GPU instances while vGPUs exist.  Each NVML change is
    audited; the result is read back and verified (DeviceError otherwise,
    after undoing what was done).

    MIG on demand (:mod:`vgpuhost.ops.migdemand`): a GPU instance made for a start still in progress
    counts as busy (its vGPU may not sit on it yet): a layout that would destroy it is refused naming
    it.  ``adopt`` (an explicit ``mig apply``, which declares the whole layout): the instances made on
    demand that the applied layout keeps are its own from then on (their records dropped, audited),
    so their owner's stop leaves them; without it (a ``vgpu create --create-gi``, a layout step)
    they stay the domain's.
    """
    backend = backend or open_backend(host)
    wanted_names = parse_layout(layout) if isinstance(layout, str) else dict(layout)

    def plan(dev: _Device) -> Tuple[MigOutcome, LayoutPlan, Dict[int, int], List[GiProfile]]:
        dev.require_mig()
        profiles = dev.profiles()
        wanted = resolve_layout(profiles, wanted_names, where=f"{bdf} ({dev.name})")
        reason = why_not(profiles, wanted)
        if reason:
            raise RefusedError(f"MIG layout does not fit {bdf} ({dev.name}): {reason}",
                               hint="nothing was changed")
        cur, pending = dev.mode
        if not cur:
            what = ("is pending until a GPU reset (nvidia-smi -r -i {0}) or reboot".format(bdf) if pending
                    else f"is off: run 'vgpuhost mig enable --gpu {bdf}' first")
            raise RefusedError(f"MIG mode on {bdf} {what}", hint=f"order: {ORDER}")
        gis = dev.instances()
        busy = dev.busy(gis)
        # an instance made on demand for a start in progress: its vGPU may not be made yet (trial 10a finding 3)
        mine = [] if getattr(store, "absent", False) else migmade.in_progress(store, str(bdf))
        starting = {g.gi_id: m for m in mine for g in gis
                    if (g.profile_id, g.start) == (m.profile_id, m.start) and not busy.get(g.gi_id)}
        try:
            lp = plan_layout(profiles, gis, wanted, bdf, busy={**busy, **{k: 1 for k in starting}})
        except RefusedError as e:
            if starting and not busy_refusal(profiles, gis, wanted, busy):
                raise RefusedError(f"the layout on {bdf} would destroy " + ", ".join(
                    f"GPU instance {k} ({profile_name({p.profile_id: p for p in profiles}, m.profile_id)} at "
                    f"memory slice {m.start}), made on demand for a start of {m.owner} in progress"
                    for k, m in sorted(starting.items())),
                    hint="apply again once that start has ended (its vGPU then sits on it, or it is gone); "
                         "nothing was changed") from None
            e.message = e.message.replace("MIG layout would", f"the layout on {bdf} would", 1)
            raise
        out = MigOutcome("apply", str(bdf), changed=bool(lp.steps), dry_run=dry_run, name=dev.name,
                         mig_mode=_mode_dict(dev.mode), layout_before=counts(profiles, gis),
                         layout_after=names(profiles, wanted), steps=[s.describe() for s in lp.steps])
        if pending != cur:
            out.notes.append("MIG mode off is pending until a GPU reset: these GPU instances go with it")
        if lp.destroy and (busy or starting):
            out.notes.append("kept the busy GPU instance(s) " + ", ".join(
                f"{g.gi_id}" for g in lp.keep if busy.get(g.gi_id) or g.gi_id in starting)
                + "; re-sliced only free ones")
        if not lp.steps:
            out.notes.append(f"{bdf} already has {layout_text(out.layout_before)}")
        return out, lp, wanted, profiles

    dev = _Device(host, backend, bdf)
    if dry_run:
        return plan(dev)[0]
    with file_lock(store.state_dir, f"gpu-{bdf}"):
        _recover_first(host, store, bdf, actor)
        dev = _Device(host, backend, bdf)
        out, lp, wanted, profiles = plan(dev)
        operation = f"mig apply {bdf} {layout_text(names(profiles, wanted))}"
        if not lp.steps:
            if adopt:
                _adopt(store, bdf, lp.keep, out, actor=actor or actor_name(), operation=operation)
            return out
        got: List[GpuInstance] = []

        def check() -> None:
            got[:] = backend.gpu_instances(bdf)
            have: Dict[int, int] = {}
            for g in got:
                have[g.profile_id] = have.get(g.profile_id, 0) + 1
            if have != {k: v for k, v in wanted.items() if v}:
                raise DeviceError(f"MIG layout on {bdf} reads back {layout_text(counts(profiles, got))} after "
                                  f"apply, wanted {layout_text(names(profiles, wanted))}",
                                  hint="see 'vgpuhost audit' and 'vgpuhost mig show'")

        out.writes = _run(dev, store, lp.steps, actor=actor or actor_name(),
                          operation=operation, kind="mig-apply",
                          owner=owner, want={"layout": {str(k): v for k, v in wanted.items() if v}}, check=check)
        out.layout_after = counts(profiles, got)
        if adopt:
            _adopt(store, bdf, got, out, actor=actor or actor_name(), operation=operation)
        return out


def _adopt(store, bdf: PciAddress, gis: Sequence[GpuInstance], out: MigOutcome, *, actor: str,
           operation: str) -> None:
    """The GPU instances made on demand among ``gis`` (the applied layout's) are the layout's now
    (:func:`vgpuhost.ops.migmade.adopt`); a note on ``out`` names them."""
    taken = migmade.adopt(store, str(bdf), {g.gi_id for g in gis}, actor=actor, operation=operation)
    if taken:
        out.notes.append("the layout keeps GPU instance(s) " + ", ".join(
            f"{m.gi_id} (made on demand for {m.owner})" for m in taken) + ": their domains' stop leaves them")


def make_instance(host: HostRoot, store, bdf: PciAddress, gi_profile: str, *, owner: str, actor: str,
                  record=None, backend: Optional[NvmlBackend] = None) -> GpuInstance:
    """Create ONE GPU instance of ``gi_profile`` (``1g.18gb``) on ``bdf`` beside the instances there,
    at a placement the device allows (:func:`vgpuhost.policy.mig.place`: its start slices); nothing
    else is touched.  Under the GPU's lock, after ending what an interrupted operation left there;
    journaled (kind ``mig-apply``, ``owner``) and audited like ``mig apply``.  ``record(start)``:
    called before the NVML call, with the memory slice chosen (MIG on demand writes its intent
    there, :mod:`vgpuhost.ops.migdemand`).  Returns the instance made.

    Raises RefusedError when MIG mode is off or no free slice range takes another ``gi_profile``
    (naming the instances in the way); DeviceError when NVML fails (undone).
    """
    backend = backend or open_backend(host)
    with file_lock(store.state_dir, f"gpu-{bdf}"):
        _recover_first(host, store, bdf, actor)
        dev = _Device(host, backend, bdf)
        dev.require_mig()
        if not dev.mode[0]:
            raise RefusedError(f"MIG mode on {bdf} is off: no GPU instance can be made",
                               hint=f"'vgpuhost mig enable --gpu {bdf}'; order: {ORDER}")
        profiles = dev.profiles()
        by_name = {p.name.lower(): p for p in profiles}
        prof = by_name.get(gi_profile.lower())
        if prof is None:
            raise RefusedError(f"{bdf} ({dev.name}) has no GPU-instance profile {gi_profile}")
        gis = dev.instances()
        found = place(profiles, {prof.profile_id: 1}, gis)
        if not found:
            there = layout_text(counts(profiles, gis))
            raise RefusedError(f"no free slice range on {bdf} takes another {prof.name}: it holds {there}",
                               hint=f"{prof.name} starts at memory slice "
                                    f"{'/'.join(str(s) for s, _ in prof.placements)}; 'vgpuhost mig show' "
                                    "lists the instances")
        start = found[0][1]
        step = CreateGi(bdf, prof.profile_id, prof.name, start, dict(prof.placements)[start])
        if record is not None:
            record(start)
        wanted: Dict[int, int] = {}
        for g in gis:
            wanted[g.profile_id] = wanted.get(g.profile_id, 0) + 1
        wanted[prof.profile_id] = wanted.get(prof.profile_id, 0) + 1
        made: List[GpuInstance] = []

        def check() -> None:
            made[:] = [g for g in backend.gpu_instances(bdf) if g.profile_id == prof.profile_id and g.start == start]
            if not made:
                raise DeviceError(f"no {prof.name} at memory slice {start} on {bdf} after creating it",
                                  hint="see 'vgpuhost audit' and 'vgpuhost mig show'")

        _run(dev, store, [step], actor=actor, operation=f"mig on-demand create {prof.name} on {bdf}",
             kind="mig-apply", owner=owner, want={"layout": {str(k): v for k, v in wanted.items()}}, check=check)
        return made[0]


def destroy_instance(host: HostRoot, store, bdf: PciAddress, *, profile_id: int, start: int, owner: str,
                     actor: str, gi_id: Optional[int] = None, backend: Optional[NvmlBackend] = None
                     ) -> Optional[GpuInstance]:
    """Destroy the GPU instance of ``profile_id`` at memory slice ``start`` on ``bdf`` (and, given,
    id ``gi_id``) when it holds no vGPU; the instance destroyed, or None when there is none there.
    Under the GPU's lock, journaled (kind ``mig-apply``) and audited.  Raises RefusedError when a
    vGPU sits on it (naming it); DeviceError when NVML fails (undone)."""
    backend = backend or open_backend(host)
    with file_lock(store.state_dir, f"gpu-{bdf}"):
        _recover_first(host, store, bdf, actor)
        dev = _Device(host, backend, bdf)
        if dev.mode is None or not dev.mode[0]:
            return None
        gis = dev.instances()
        gi = next((g for g in gis if g.profile_id == profile_id and g.start == start
                   and (gi_id is None or g.gi_id == gi_id)), None)
        if gi is None:
            return None
        profiles = dev.profiles()
        by_id = {p.profile_id: p for p in profiles}
        n = dev.busy(gis).get(gi.gi_id, 0)
        if n:
            raise RefusedError(f"GPU instance {gi.gi_id} ({profile_name(by_id, gi.profile_id)} at memory slice "
                               f"{gi.start}) on {bdf} holds {n} vGPU{'s' if n != 1 else ''}: it stays",
                               hint="it goes when its vGPU does")
        wanted: Dict[int, int] = {}
        for g in gis:
            if g.gi_id != gi.gi_id:
                wanted[g.profile_id] = wanted.get(g.profile_id, 0) + 1
        step = DestroyGi(bdf, gi.gi_id, profile_name(by_id, gi.profile_id), gi.start, gi.size, gi.profile_id)

        def check() -> None:
            if any(g.gi_id == gi.gi_id and g.start == gi.start for g in backend.gpu_instances(bdf)):
                raise DeviceError(f"GPU instance {gi.gi_id} is still on {bdf} after destroying it",
                                  hint="see 'vgpuhost audit' and 'vgpuhost mig show'")

        _run(dev, store, [step], actor=actor, operation=f"mig on-demand destroy GPU instance {gi.gi_id} on {bdf}",
             kind="mig-apply", owner=owner, want={"layout": {str(k): v for k, v in wanted.items()}}, check=check)
        return gi


def assert_layout(host: HostRoot, bdf: PciAddress, layout: "str | Mapping[str, int]", *,
                  backend: Optional[NvmlBackend] = None) -> MigAssert:
    """Compare ``bdf``'s GPU instances with ``layout``; ``in_sync`` False on drift, with a diff
    ``[{profile, wanted, actual}]``.  MIG mode off (or a change pending) is drift
    unless the layout is empty."""
    backend = backend or open_backend(host)
    wanted_names = parse_layout(layout) if isinstance(layout, str) else dict(layout)
    dev = _Device(host, backend, bdf)
    dev.require_mig()
    profiles = dev.profiles()
    wanted = names(profiles, resolve_layout(profiles, wanted_names, where=f"{bdf} ({dev.name})"))
    cur, pending = dev.mode
    actual = counts(profiles, dev.instances() if cur else [])
    diff: List[Dict[str, object]] = []
    for name in sorted(set(wanted) | set(actual), key=name_key):
        if wanted.get(name, 0) != actual.get(name, 0):
            diff.append({"profile": name, "wanted": wanted.get(name, 0), "actual": actual.get(name, 0)})
    if wanted and (not cur or pending != cur):
        now = ("on" if cur else "off") + (f" ({'on' if pending else 'off'} pending)" if pending != cur else "")
        diff.insert(0, {"profile": "(mig mode)", "wanted": "on", "actual": now})
    return MigAssert(str(bdf), not diff, wanted, actual, _mode_dict(dev.mode), diff)


__all__ = ["MigOutcome", "MigAssert",
           "show", "show_text", "enable", "disable", "set_mode", "apply", "assert_layout", "make_instance",
           "destroy_instance"]
