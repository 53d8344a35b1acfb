"""The vGPU scheduler on a host: its modprobe.d file, runtime NVML changes, mixed-size mode.

Owns: the persistent form (``<root>/etc/modprobe.d/vgpuhost-scheduler.conf``,
written as a :class:`~vgpuhost.plan.steps.WriteConfig` step so it is audited
and verified), the runtime form through the NVML backend
(:func:`set_runtime`, :func:`show`: :class:`~vgpuhost.plan.steps.SetScheduler`
steps) and mixed-size mode (:func:`mixed_size`:
:class:`~vgpuhost.plan.steps.SetMixedSize`), all run by the one Executor.
Must not: encode or decode ``RmPVMRL`` or decide what a state may hold
(:mod:`vgpuhost.policy.scheduler`), talk to pynvml directly
(:mod:`vgpuhost.io.nvml`), read files itself (:mod:`vgpuhost.io.configfiles`),
or print.

Facts (the project's docs reference, sections 4, 6, 7): NVML changes the
scheduler only while no vGPU runs on the GPU; device-level calls return
NOT_SUPPORTED in MIG mode; fixed share is not available in mixed-size mode;
mixed-size mode changes only with no vGPU on the GPU.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..io.backends import open_backend
from ..io.catalog import load_catalog
from ..io.configfiles import list_config_files, modprobe_conf_files, read_config_text
from ..io.hostroot import HostRoot
from ..io.locks import file_lock
from ..io.nvml import NvmlError
from ..io.process import actor as actor_name
from ..io.sysfs import Sysfs
from ..model.boards import MIG_NO_SCHEDULER, board
from ..model.concepts import OwnerKind, SchedulerPolicy
from ..model.errors import InputError, RefusedError, VgpuhostError
from ..model.nvml import SchedulerState
from ..model.values import PciAddress
from ..observe.inventory import discover, discover_gpu
from ..plan.executor import Executor
from ..plan.steps import SetMixedSize, SetScheduler, WriteConfig
from ..policy.scheduler import (
    CONF_NAME, SchedulerConf, check_caps, decode, describe, describe_value, encode, matches, parse_conf, problems,
    render_conf, set_value, sets_registry_dwords, state_doc, validate, ModuleOption, effective_options,
    effective_value, mig_scheduler_refusal, override_line, overriding_sources, registry_options, with_own_file
)
from . import health
from .nvmljournal import start
from .recover import recover_locked
from .tenancy import pools as declared_pools

# =============================================================================
# persistent form: <root>/etc/modprobe.d/vgpuhost-scheduler.conf

def conf_path(host: HostRoot) -> Path:
    return host.modprobe_d / CONF_NAME


def read_conf(host: HostRoot) -> SchedulerConf:
    return parse_conf(read_config_text(conf_path(host)) or "")


def _other_registry_files(host: HostRoot) -> List[str]:
    """Other modprobe.d files setting the same module options (the last one read wins)."""
    return [host.relative(host.modprobe_d / name)
            for name, text in list_config_files(host.modprobe_d, ".conf", root=host.root)
            if name != CONF_NAME and sets_registry_dwords(text)]


def module_options(host: HostRoot) -> List[ModuleOption]:
    """Every ``NVreg_RegistryDwords[PerDevice]`` the nvidia module gets at its next load, in order: the
    modprobe.d files as modprobe reads them (:func:`vgpuhost.io.configfiles.modprobe_conf_files`), then
    the kernel command line (:func:`vgpuhost.policy.scheduler.registry_options`)."""
    return registry_options(modprobe_conf_files(host), read_config_text(host.proc_cmdline),
                            host.relative(host.proc_cmdline))


def persistent_drift(host: HostRoot, conf: SchedulerConf, options: Sequence[ModuleOption],
                     bdf: PciAddress) -> Tuple[Optional[Dict[str, object]], Optional[str]]:
    """``(effective, drift)`` for one GPU: the ``RmPVMRL`` it gets at the next module load (the last
    option wins, docs/reference/hardware.md#vgpu-scheduling; None when none names it) and, when vgpuhost's
    file sets a value for it that is not the one it gets, one line naming the file that overrides it
    (only the parsed values are shown, never a file's text)."""
    eff = effective_value(effective_options(options), str(bdf))
    effective = None if eff.value is None else {
        "value": f"0x{eff.value:08x}", "scope": eff.scope, "source": eff.source,
        "text": describe_value(eff.value) if not problems(eff.value) else "invalid"}
    per, glob = conf.value_for(str(bdf)), conf.value_for(None)
    own = per if per is not None else glob
    return effective, override_line(own, options, str(bdf), host.relative(conf_path(host)))


@dataclass
class PersistOutcome:
    path: str
    value: int
    gpus: List[str]            # empty: all GPUs
    changed: bool
    dry_run: bool
    text: str
    notes: List[str] = field(default_factory=list)

    def as_dict(self) -> Dict[str, object]:
        return {"schema": "vgpuhost.scheduler-persist/v1", "path": self.path, "value": f"0x{self.value:08x}",
                "meaning": describe(decode(self.value)), "gpus": self.gpus or "all", "changed": self.changed,
                "dry_run": self.dry_run, "text": self.text, "notes": self.notes}


def persist(host: HostRoot, store, state: SchedulerState, gpu: Union[None, PciAddress, Sequence[PciAddress]] = None,
            *, dry_run: bool = False, actor: Optional[str] = None, backend=None) -> PersistOutcome:
    """Write ``RmPVMRL`` for all GPUs (``gpu=None``) or per GPU to vgpuhost's modprobe.d file.

    All GPUs: sets ``NVreg_RegistryDwords`` and drops per-GPU ``RmPVMRL``
    entries so every GPU gets the value.  Per GPU: adds/replaces that GPU's
    entry in ``NVreg_RegistryDwordsPerDevice``.  Other keys in the file are
    kept.  No write when the text would not change (idempotent).

    A policy other than best effort for a GPU named that is in MIG mode, now or after the next reset
    (NVML ``mig_mode``), is refused with the driver's reason (RefusedError, nothing written:
    docs/reference/hardware.md#vgpu-scheduling); for all GPUs, the notes name those in MIG mode.
    Otherwise a MIG-capable board in scope gets the general MIG note.
    A policy other than a pooled GPU's pool's is refused as :func:`set_runtime` refuses it.
    """

    value = encode(state)
    gpus: List[PciAddress] = [] if gpu is None else ([gpu] if isinstance(gpu, PciAddress) else list(gpu))
    refuse_off_pool(store, gpus, state.policy, every=not gpus)
    in_mig = _in_mig_mode(host, gpus, backend) if state.policy != SchedulerPolicy.BEST_EFFORT else []
    if in_mig and gpus:
        raise _refuse_mig(host, in_mig[0])
    path = conf_path(host)
    with ExitStack() as stack:
        if not dry_run:
            stack.enter_context(file_lock(store.state_dir, "scheduler-conf"))
        old = read_config_text(path)
        text = render_conf(set_value(parse_conf(old or ""), value, gpus))
        changed = text != old
        if changed and not dry_run:
            ex = Executor(host, store, actor=actor or actor_name(),
                          operation="scheduler set --persist " + (",".join(map(str, gpus)) or "--all"))
            ex.run([WriteConfig(path, text)])
    notes = []
    if changed:
        notes.append("takes effect after the nvidia module is reloaded (no VM may use the GPU) or the host reboots")
    else:
        notes.append(f"{host.relative(path)} already holds this value")
    if in_mig:
        notes.append(f"the driver ignores it on {', '.join(map(str, in_mig))}: in MIG mode ({MIG_NO_SCHEDULER} "
                     "before Blackwell)")
    elif state.policy != SchedulerPolicy.BEST_EFFORT and _any_mig_capable(host, gpus):
        notes.append("the driver ignores it on a GPU in MIG mode (no software scheduler there)")
    if state.policy == SchedulerPolicy.FIXED_SHARE:
        notes.append("fixed share is not available while a GPU is in mixed-size mode")
    mine = host.relative(path)
    files = with_own_file(modprobe_conf_files(host), mine, text)
    winners = overriding_sources(registry_options(files, read_config_text(host.proc_cmdline),
                                                  host.relative(host.proc_cmdline)), mine)
    if winners:
        notes.append(", ".join(winners) + " sets NVreg_RegistryDwords* after vgpuhost's file, so it overrides this "
                     "value (modprobe passes every options line; the last one counts): merge it there or remove it")
    others = _other_registry_files(host)
    if others:
        notes.append("other modprobe.d files also set NVreg_RegistryDwords*: " + ", ".join(others)
                     + " (a module option given twice keeps the last one read): merge them")
    return PersistOutcome(path=host.relative(path), value=value, gpus=[str(g) for g in gpus], changed=changed,
                          dry_run=dry_run, text=text, notes=notes)


# =============================================================================
# runtime form: NVML

def host_gpus(host: HostRoot) -> List[PciAddress]:
    """The NVIDIA GPUs sysfs shows (physical functions)."""
    host.require_host()
    return [g.address for g in discover(Sysfs(host), with_types=False).gpus]


def _boards(host: HostRoot, gpus: Sequence[PciAddress]) -> List[Tuple[PciAddress, Optional[object]]]:
    """Each GPU with its catalog board (:class:`vgpuhost.model.catalog.GpuModel`, by PCI device id),
    None for a board the catalog does not list or a GPU sysfs does not show."""
    fs = Sysfs(host)
    models = {m.ids.device: m for m in load_catalog().gpus.values()}
    out = []
    for g in gpus:
        dev = fs.read_int(host.pci_device(g) / "device", default=None)
        out.append((g, models.get(dev) if dev is not None else None))
    return out


def _in_mig_mode(host: HostRoot, gpus: Sequence[PciAddress], backend=None) -> Optional[List[PciAddress]]:
    """The GPUs in scope (``gpus``, or every NVIDIA GPU when empty) in MIG mode now or after their next
    reset, by NVML; None when NVML cannot be asked (no driver, no pynvml: the MIG note stays general)."""
    try:
        backend = backend if backend is not None else open_backend(host)
        out = []
        for g in list(gpus) or host_gpus(host):
            try:
                mode = backend.mig_mode(g)
            except NvmlError as e:
                if e.not_supported:
                    continue            # not MIG-capable
                raise
            if mode and (mode[0] or mode[1]):
                out.append(g)
        return out
    except (VgpuhostError, OSError, ImportError):
        return None


def _any_mig_capable(host: HostRoot, gpus: Sequence[PciAddress]) -> bool:
    """Whether the MIG note of ``scheduler set --persist`` applies: some GPU in scope (``gpus``, or every
    NVIDIA GPU when empty) is MIG-capable by the catalog (docs/reference/hardware.md), or of a board the
    catalog does not list, or the host's GPUs cannot be read (then the note is kept)."""
    try:
        scope = list(gpus) or host_gpus(host)
    except Exception:               # a note only: unreadable GPUs keep it
        return True
    boards = _boards(host, scope)
    return not boards or any(m is None or m.mig_capable for _g, m in boards)


def refuse_boards_without_vgpu(host: HostRoot, gpus: Sequence[PciAddress]) -> None:
    """RefusedError (exit 2) for a GPU whose board has no vGPU support (a GeForce, say): the
    vGPU scheduler setting would be written for a GPU that never runs the vGPU manager.

    The board's vGPU types come from the catalog (``vgpuhost/data/catalog.yaml``, docs/reference/hardware.md#vgpu-types);
    a board the catalog does not list is given the benefit of the doubt."""
    for g, m in _boards(host, gpus):
        if m is not None and not m.vgpu_types:
            raise RefusedError(f"{g} is a {m.marketing_name}, which has no vGPU support: the vGPU scheduler does "
                               "not apply to it", hint="name a GPU that runs vGPUs (vgpuhost types lists them)")


def resolve_gpus(host: HostRoot, gpus: Sequence[PciAddress], all_gpus: bool) -> List[PciAddress]:
    """Every NVIDIA GPU (``all_gpus``), or ``gpus`` checked to be NVIDIA GPUs, sorted; InputError
    naming the host's GPUs for one that is not.  Named GPUs are read alone, not the whole host."""
    if all_gpus:
        known = host_gpus(host)
        if not known:
            raise InputError("no NVIDIA GPU found on this host", hint="'vgpuhost gpus' lists them")
        return known
    host.require_host()
    fs = Sysfs(host)
    for g in gpus:
        if not discover_gpu(fs, g, with_types=False, host_facts=False).gpus:
            known = host_gpus(host)
            raise InputError(f"no NVIDIA GPU at {g}",
                             hint=f"GPUs on this host: {', '.join(map(str, known)) or 'none'} ('vgpuhost gpus')")
    return sorted(set(gpus), key=str)


def refuse_off_pool(store, gpus: Sequence[PciAddress], policy: str, *, every: bool = False) -> None:
    """RefusedError (exit 2, nothing changed) when ``policy`` is not the scheduler policy of the declared
    pool (docs/guide/tenancy.md, "Pools") of a GPU of ``gpus`` (``every``: of any pooled GPU, for ``--all``).

    A pool is one policy by definition, and admission closes a GPU whose policy differs from its pool's
    (in drift); a pool's policy is changed in the layout (``vgpuhost apply``), on empty GPUs.  GPUs in no
    declared pool (the implicit pool ``default``) take any policy."""
    if store is None:
        return
    pl = declared_pools(store)
    if not pl:
        return
    wanted = {str(g) for g in gpus}
    for p in pl:
        for g in p.gpus:
            if (every or g in wanted) and p.policy and p.policy != policy:
                raise RefusedError(f"GPU {g} is in pool {p.name!r}, whose scheduler policy is {p.policy}, not "
                                   f"{policy}: a pool's GPUs run its policy (admission serves no class on a GPU "
                                   "in drift)",
                                   hint="change the pool's policy in the layout and run 'vgpuhost apply', or take "
                                        "the GPU out of the pool there; nothing was changed")


def _mig_on(backend, bdf: PciAddress) -> bool:
    try:
        mode = backend.mig_mode(bdf)
    except NvmlError as e:
        if e.not_supported:
            return False
        raise
    return bool(mode and mode[0])


def _refuse_mig(host: HostRoot, bdf: PciAddress) -> RefusedError:
    """The refusal of the scheduler on ``bdf`` in MIG mode, by its board's architecture
    (:func:`vgpuhost.policy.scheduler.mig_scheduler_refusal`)."""
    dev = Sysfs(host).read_int(host.pci_device(bdf) / "device", default=None)
    b = board(dev) if dev is not None else None
    return mig_scheduler_refusal(bdf, b.product if b else None, b.architecture if b else None)


def _supported(bdf: PciAddress, what: str, fn):
    """``fn()``; NOT_SUPPORTED becomes a one-line refusal naming the GPU (plain data-centre driver...)."""
    try:
        return fn()
    except NvmlError as e:
        if e.not_supported:
            raise RefusedError(f"GPU {bdf}: {what} is not available ({e.call}: {e.nvml_name})",
                               hint="this needs the NVIDIA vGPU manager driver (not the plain data-centre "
                                    "driver) on a GPU that supports vGPU") from None
        raise


@dataclass
class RuntimeOutcome:
    action: str
    dry_run: bool
    gpus: List[Dict[str, object]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(g["changed"] for g in self.gpus)

    def as_dict(self) -> Dict[str, object]:
        return {"schema": f"vgpuhost.{self.action}/v1", "dry_run": self.dry_run, "changed": self.changed,
                "gpus": self.gpus, "notes": self.notes}


def _gpu_locks(host: HostRoot, store, gpus: Sequence[PciAddress], dry_run: bool, actor: str) -> ExitStack:
    """The GPUs' locks (none for a dry run), each GPU's interrupted operations ended first
    (:mod:`vgpuhost.ops.recover`)."""
    with ExitStack() as stack:
        if not dry_run:
            for g in sorted(gpus, key=str):     # one order everywhere: no deadlock between two --all runs
                stack.enter_context(file_lock(store.state_dir, f"gpu-{g}"))
            if store.journal_entries(open_only=True):
                for g in gpus:
                    recover_locked(host, store, gpu=str(g), actor=actor)
        return stack.pop_all()


def _run(host: HostRoot, store, backend, bdf: PciAddress, step, *, kind: str, operation: str, owner: str,
         actor: str, want: dict) -> None:
    """Run one NVML ``step`` through the Executor under a journal entry of ``kind``
    (:mod:`vgpuhost.ops.nvmljournal`), opened before the call and closed after its read-back."""
    ex = Executor(host, store, actor=actor, operation=operation, backend=backend)
    ex.journal = start(store, backend, bdf, kind=kind, operation=operation, owner=owner, actor=actor,
                       steps=[step.describe(host)], want=want)
    with ex.journal:
        try:
            ex.run([step])
        except NvmlError as e:
            # the GPU failed (NVML GPU_IS_LOST): out of service from now on (issue 27); the error goes on
            if health.failed_write(store, bdf, e, step.describe(host), actor=actor, operation=operation):
                e.message += health.MARKED
            raise


def set_runtime(host: HostRoot, store, target: Union[str, PciAddress, Sequence[PciAddress]], state: SchedulerState,
                *, backend=None, dry_run: bool = False, actor: Optional[str] = None,
                owner: str = OwnerKind.MANUAL) -> RuntimeOutcome:
    """Set the vGPU scheduler through NVML on one GPU, several, or ``"all"``.

    Each GPU's change is journaled (kind ``scheduler-set``, ``owner``) before
    its NVML call; interrupted operations on the GPUs are ended first.

    Every GPU is checked before any is changed: not in MIG mode, no vGPU
    running, the policy and parameters within its capabilities, no fixed
    share in mixed-size mode.  Then set, read back and compare (DeviceError
    on mismatch).  A GPU already in the requested state is left alone.
    When ARR is asked for without parameters and the device cannot do ARR,
    the driver's default time slice is used instead.

    Unless the layout sets it (``owner`` ``layout``, as its pools say), a
    policy other than a pooled GPU's pool's is refused
    (:func:`refuse_off_pool`, RefusedError, nothing changed).
    """
    validate(state)
    if target == "all":
        gpus = resolve_gpus(host, [], True)
    elif isinstance(target, PciAddress):
        gpus = resolve_gpus(host, [target], False)
    else:
        gpus = resolve_gpus(host, list(target), False)
    if owner != OwnerKind.LAYOUT:
        refuse_off_pool(store, gpus, state.policy, every=target == "all")
    backend = backend if backend is not None else open_backend(host)
    actor = actor or actor_name()
    out = RuntimeOutcome("scheduler-set", dry_run)
    with _gpu_locks(host, store, gpus, dry_run, actor):
        plan: List[Tuple[PciAddress, SchedulerState, SchedulerState]] = []
        for bdf in gpus:
            if _mig_on(backend, bdf):
                raise _refuse_mig(host, bdf)
            want = state
            caps = _supported(bdf, "the vGPU scheduler", lambda: backend.scheduler_caps(bdf))
            if (want.arr and not caps.arr_supported and want.frequency_hz is None and want.avg_factor is None
                    and want.policy != SchedulerPolicy.BEST_EFFORT):
                want = replace(want, arr=False)
                out.notes.append(f"{bdf}: no adaptive round robin on this device; using the default time slice")
            check_caps(bdf, want, caps)
            if want.policy == SchedulerPolicy.FIXED_SHARE and backend.heterogeneous_mode(bdf):
                raise RefusedError(f"GPU {bdf} is in mixed-size mode: fixed share is not available there",
                                   hint=f"turn it off first ('vgpuhost vgpu mode --gpu {bdf} --mixed-size off', "
                                        "with no vGPU on the GPU) or use equal-share")
            before = backend.scheduler_state(bdf)
            if not matches(want, before):
                running = backend.active_vgpus(bdf)
                if running:
                    raise RefusedError(f"GPU {bdf} has {running} vGPU(s) running: the scheduler can only change "
                                       "while none runs",
                                       hint="stop the VMs using it, or use --persist (applies at the next "
                                            "module reload/reboot)")
            plan.append((bdf, want, before))
        for bdf, want, before in plan:
            entry: Dict[str, object] = {"gpu": str(bdf), "before": state_doc(before), "requested": state_doc(want),
                                        "changed": False, "after": state_doc(before)}
            if not matches(want, before) and not dry_run:
                _run(host, store, backend, bdf, SetScheduler(bdf, want, before), kind="scheduler-set",
                     operation=f"scheduler set {bdf}", owner=owner, actor=actor,
                     want={"scheduler": asdict(want)})
                entry.update(changed=True, after=state_doc(backend.scheduler_state(bdf)))
            elif not matches(want, before):
                entry["changed"] = True       # would change
            out.gpus.append(entry)
    if out.changed:
        out.notes.append("runtime setting: lost when the nvidia module reloads; use --persist to keep it")
    return out


def mixed_size(host: HostRoot, store, bdf: PciAddress, on: bool, *, backend=None, dry_run: bool = False,
               actor: Optional[str] = None, owner: str = OwnerKind.MANUAL) -> RuntimeOutcome:
    """Turn a GPU's mixed-size (heterogeneous) vGPU mode on or off.

    Journaled (kind ``mixed-size``, ``owner``) before the NVML call;
    interrupted operations on the GPU are ended first.

    Refused while vGPUs exist on the GPU, and turning it on while the GPU's
    scheduler is fixed share.  Reads back and compares.
    """
    gpus = resolve_gpus(host, [bdf], False)
    backend = backend if backend is not None else open_backend(host)
    actor = actor or actor_name()
    out = RuntimeOutcome("vgpu-mode", dry_run)
    with _gpu_locks(host, store, gpus, dry_run, actor):
        before = bool(_supported(bdf, "mixed-size vGPU mode", lambda: backend.heterogeneous_mode(bdf)))
        entry: Dict[str, object] = {"gpu": str(bdf), "mixed_size_before": before, "mixed_size": before,
                                    "changed": False}
        if before != on:
            running = backend.active_vgpus(bdf)
            if running:
                raise RefusedError(f"GPU {bdf} has {running} vGPU(s): mixed-size mode can only change while "
                                   "the GPU has none", hint="remove its vGPUs first ('vgpuhost vgpu list')")
            if on:
                try:
                    sched = backend.scheduler_state(bdf)
                except NvmlError as e:
                    if not e.not_supported:
                        raise
                    sched = None
                if sched is not None and sched.policy == SchedulerPolicy.FIXED_SHARE:
                    raise RefusedError(f"GPU {bdf} uses the fixed-share scheduler, which mixed-size mode does "
                                       "not allow",
                                       hint=f"switch to equal-share or best-effort first ('vgpuhost scheduler set "
                                            f"--gpu {bdf} --policy equal-share')")
            entry["changed"] = True
            if not dry_run:
                _run(host, store, backend, bdf, SetMixedSize(bdf, on), kind="mixed-size",
                     operation=f"vgpu mode {bdf} --mixed-size {'on' if on else 'off'}", owner=owner, actor=actor,
                     want={"mixed_size": bool(on)})
                entry["mixed_size"] = on
            else:
                entry["mixed_size"] = on
        out.gpus.append(entry)
    if on and out.changed:
        out.notes.append("mixed-size mode is lost on reboot, module reload, GPU reset and 'sriov-manage -e'")
    return out


def show(host: HostRoot, gpu: Optional[PciAddress] = None, *, backend=None) -> Dict[str, object]:
    """Each GPU's scheduler (runtime state, capabilities, running vGPUs, modes) and the persistent value."""
    gpus = resolve_gpus(host, [gpu], False) if gpu is not None else host_gpus(host)
    backend = backend if backend is not None else open_backend(host)
    conf = read_conf(host)
    options = module_options(host)
    entries = []
    drift: List[str] = []
    for bdf in gpus:
        e: Dict[str, object] = {"gpu": str(bdf)}

        def call(name, fn):
            try:
                return fn()
            except NvmlError as err:
                e.setdefault("errors", {})[name] = err.nvml_name    # type: ignore[index]
                return None

        mig = call("mig_mode", lambda: backend.mig_mode(bdf))
        e["mig"] = None if mig is None else {"current": bool(mig[0]), "pending": bool(mig[1])}
        state = call("state", lambda: backend.scheduler_state(bdf))
        e["state"] = state_doc(state)
        caps = call("caps", lambda: backend.scheduler_caps(bdf))
        e["caps"] = asdict(caps) if caps is not None else None
        e["active_vgpus"] = call("active_vgpus", lambda: backend.active_vgpus(bdf))
        hm = call("mixed_size", lambda: backend.heterogeneous_mode(bdf))
        e["mixed_size"] = None if hm is None else bool(hm)
        per, glob = conf.value_for(str(bdf)), conf.value_for(None)
        pv = per if per is not None else glob
        e["persistent"] = None if pv is None else {
            "value": f"0x{pv:08x}", "scope": "this GPU" if per is not None else "all GPUs",
            "text": describe_value(pv) if not problems(pv) else "invalid"}
        e["effective"], line = persistent_drift(host, conf, options, bdf)
        e["drift"] = line
        if line:
            drift.append(line)
        entries.append(e)
    return {"schema": "vgpuhost.scheduler-show/v1", "conf": host.relative(conf_path(host)), "gpus": entries,
            "drift": drift}


def show_text(doc: Dict[str, object]) -> str:
    lines: List[str] = []
    for e in doc["gpus"]:    # type: ignore[union-attr]
        lines.append(f"GPU {e['gpu']}")
        st = e.get("state")
        errs = e.get("errors") or {}
        if st:
            lines.append(f"  scheduler:  {st['text']}")
        else:
            lines.append(f"  scheduler:  unavailable ({errs.get('state', 'unknown')})")
        if e.get("mig") and e["mig"]["current"]:
            lines.append("  MIG mode on: no device-level vGPU scheduler (before Blackwell none at all: "
                         "Software Scheduler is not supported in MIG mode)")
        caps = e.get("caps")
        if caps:
            lines.append(f"  supports:   {', '.join(caps['policies']) or 'none'}; ARR "
                         f"{'yes' if caps['arr_supported'] else 'no'}; time slice {caps['min_timeslice_ms']}.."
                         f"{caps['max_timeslice_ms']} ms; frequency {caps['min_frequency_hz']}.."
                         f"{caps['max_frequency_hz']} Hz; averaging factor {caps['min_avg_factor']}.."
                         f"{caps['max_avg_factor']}")
        av, ms = e.get("active_vgpus"), e.get("mixed_size")
        lines.append(f"  vGPUs running: {'?' if av is None else av}; mixed-size mode: "
                     f"{'?' if ms is None else ('on' if ms else 'off')}")
        p = e.get("persistent")
        lines.append(f"  persistent: {p['text']} (RmPVMRL={p['value']}, {p['scope']}) in {doc['conf']}" if p
                     else "  persistent: none set by vgpuhost (driver default: best effort)")
        eff = e.get("effective")
        if e.get("drift") or (eff and not p):
            lines.append(f"  effective:  {eff['text']} (RmPVMRL={eff['value']}, {eff['scope']}) from {eff['source']}"
                         if eff else "  effective:  none (best effort: no option that counts names RmPVMRL)")
        if e.get("drift"):
            lines.append(f"  drift:      {e['drift']}")
    return "\n".join(lines) if lines else "no NVIDIA GPU found"


__all__ = ["persist", "set_runtime", "refuse_off_pool", "mixed_size", "show", "show_text", "conf_path", "read_conf", "host_gpus",
           "resolve_gpus"]
