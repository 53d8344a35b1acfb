"""VFIO passthrough of a whole IOMMU group, and its safe release.

Owns: the operations ``prepare`` and ``release``: observe the group, refuse
before anything is touched (:mod:`vgpuhost.policy.iommu`), plan
(:mod:`vgpuhost.plan.passthrough`), run the steps through the one
:class:`~vgpuhost.plan.executor.Executor` under a per-group lock with
rollback, keep the records of original drivers in the state store, and
driverctl persistence (:class:`~vgpuhost.plan.steps.WriteConfig` /
:class:`~vgpuhost.plan.steps.RemoveConfig` steps).  Must not: write sysfs
or files except through the Executor, or spell kernel paths.

Facts (the project's docs reference, section 1): release order (companions
such as HD audio back to their host driver before the GPU goes back to
nvidia); a boot framebuffer holding BAR 0.  driverctl's persisted override
format: one file ``/etc/driverctl.d/pci-<BDF>`` holding the driver name.

Ownership: every recorded function carries the group's owner, a domain
UUID (the qemu hook) or ``manual`` (the CLI); prepare refuses a group
another owner holds, and ``release(owner=...)`` releases only a group that
owner holds (a late release never frees the next owner's group).  No
release frees a group of a running domain unless the caller takes it from
the domain itself (``while_running``: the hook's release, detach).

Not detectable from sysfs and so not checked here: NVIDIA persistence mode
(NVML, a later issue) and open users of a companion's driver.
"""

from __future__ import annotations

from contextlib import ExitStack

from ..model.errors import DeviceError, RefusedError, SysfsError, VgpuhostError
from ..io.hostroot import HostRoot
from ..observe.inventory import Inventory, PciDevice, discover
from ..io.locks import file_lock
from ..policy.placement import MANUAL, POOL_OWNERS, validate_owner
from ..io.state import StateStore, utcnow
from ..model.records import PassthroughRecord
from ..plan.executor import Executor, describe
from ..plan.journal import Journal
from ..plan.passthrough import FunctionPlan, plan_prepare, plan_release, rollback_steps
from ..plan.steps import RemoveConfig, WriteConfig
from ..policy.iommu import VFIO_PCI, group_endpoints, prepare_blockers
from ..io.configfiles import config_equals
from ..io.sysfs import Sysfs
from ..io.process import actor as actor_name
from ..model.values import PciAddress, field, record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, List, Optional, Sequence, Tuple

@record
class Outcome:
    """What prepare/release did (or would do, with ``dry_run``)."""

    action: str
    gpu: PciAddress
    group: Optional[int]
    changed: bool
    dry_run: bool
    functions: List[Dict[str, Optional[str]]] = field(default_factory=list)
    steps: List[str] = field(default_factory=list)
    persisted: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    writes: int = 0   # kernel and config writes made (each has an audit row)

    def as_dict(self) -> dict:
        return {"schema": "vgpuhost.passthrough/v1", "action": self.action, "gpu": str(self.gpu),
                "iommu_group": self.group, "changed": self.changed, "dry_run": self.dry_run,
                "functions": self.functions, "steps": self.steps, "persisted": self.persisted,
                "notes": self.notes, "writes": self.writes}


# ---------------------------------------------------------------------------
# execution

def _locks(store: StateStore, group: int, gpu: PciAddress, dry_run: bool) -> ExitStack:
    """The group lock, then the GPU lock (vGPU operations take the GPU lock); none for a dry run."""
    stack = ExitStack()
    if not dry_run:
        stack.enter_context(file_lock(store.state_dir, f"group-{group}"))
        stack.enter_context(file_lock(store.state_dir, f"gpu-{gpu}"))
    return stack


#: what a driverctl override file holds for vfio-pci
DRIVERCTL_VFIO = "vfio-pci\n"


def _driverctl_path(host: HostRoot, bdf: PciAddress):
    return host.driverctl_d / f"pci-{bdf}"


def staying_notes(inv: Inventory, staying: Sequence[PciAddress]) -> List[str]:
    """What a prepare says of the group members that stay on the host (:attr:`PciDevice.stays_in_group`):
    ``bridges stay on pcieport: ...`` per driver they are on, and those with no driver said to have
    none (a driverless function does no DMA, docs/reference/hardware.md#pci-and-iommu), never "on
    pcieport"."""
    by_driver: Dict[str, List[str]] = {}
    driverless: List[str] = []
    for a in staying:
        d = inv.devices.get(a)
        if d is not None and d.driver is None:
            driverless.append(f"{a} ({d.class_name})")
        else:
            by_driver.setdefault(d.driver if d is not None and d.driver else "pcieport", []).append(str(a))
    out = [f"bridges stay on {drv}: " + ", ".join(addrs) for drv, addrs in sorted(by_driver.items())]
    if driverless:
        out.append(", ".join(driverless) + (" has no driver and stays" if len(driverless) == 1 else
                                            " have no driver and stay")
                   + " on the host (a function with no driver does no DMA)")
    return out


def prepare(host: HostRoot, store: StateStore, gpu: PciAddress, *, allow_boot_vga: bool = False,
            persist: bool = False, dry_run: bool = False, actor: Optional[str] = None,
            owner: str = MANUAL, boot_vga_fix: Optional[str] = None) -> Outcome:
    """Bind every endpoint of ``gpu``'s IOMMU group to vfio-pci.

    ``boot_vga_fix``: the remedy a boot-VGA refusal names (see :func:`prepare_blockers`).

    ``owner``: who holds the group from now on, recorded with each function:
    a domain UUID (the qemu hook), ``manual`` (the CLI) or ``layout``.  Idempotent for
    the same owner (a prepared group is a no-op that says so).  Raises
    RefusedError before any write when the group is not viable, a blocker
    holds it, or another owner holds it; DeviceError (exit 3) when a
    function fails to bind, after the functions already moved went back to
    their original drivers.
    """
    owner = validate_owner(owner)
    inv = discover(Sysfs(host))
    group, endpoints, bridges = group_endpoints(inv, gpu)
    with _locks(store, group, gpu, dry_run):
        if not dry_run:
            _recover_first(host, store, gpu, group, actor)
        fs = Sysfs(host)
        inv = discover(fs)                  # fresh, under the lock
        group, endpoints, bridges = group_endpoints(inv, gpu)
        holder = group_holder(store, endpoints)
        if holder is not None and holder != owner:
            raise RefusedError(f"IOMMU group {group} of {gpu} is held by {describe_owner(holder)}",
                               hint=("it is released when that domain stops" if holder not in POOL_OWNERS else
                                     f"give it back first: vgpuhost passthrough release {gpu}")
                               + "; nothing was changed")
        if holder is None:
            # a GPU out of service (unhealthy or cordoned) is handed to no new holder (docs/guide/failures.md);
            # the holder it has keeps it (a retried prepare of the same owner)
            from .health import refuse_out_of_service
            refuse_out_of_service(store, gpu, what=f"pass {gpu} through", actor=actor or actor_name(),
                                  operation=f"passthrough prepare {gpu}", audit=not dry_run)
        blockers = prepare_blockers(inv, gpu, endpoints, allow_boot_vga=allow_boot_vga, boot_vga_fix=boot_vga_fix)
        if blockers:
            raise RefusedError(f"cannot pass {gpu} through: " + "; ".join(blockers),
                               hint="nothing was changed")
        plans = plan_prepare(endpoints)
        out = Outcome("prepare", gpu, group, changed=bool(plans), dry_run=dry_run)
        out.functions = [{"bdf": str(d.address), "from": d.driver, "to": VFIO_PCI} for d in endpoints]
        out.steps = [s for fp in plans for s in describe(host, fp.steps)]
        out.notes += staying_notes(inv, bridges)
        fbs = inv.host.boot_framebuffers.get(str(gpu))
        if fbs:
            out.notes.append(f"a boot framebuffer ({', '.join(fbs)}) holds BAR 0: the VM may fail to start "
                             "with \"BAR 0: can't reserve\"; add initcall_blacklist=sysfb_init")
        if not plans:
            out.notes.append(f"IOMMU group {group} is already bound to vfio-pci: nothing to do")
        persist_paths = [_driverctl_path(host, d.address) for d in endpoints] if persist else []
        persist_steps = [WriteConfig(p, DRIVERCTL_VFIO) for p in persist_paths if not config_equals(p, DRIVERCTL_VFIO)]
        foreign = [p for p in persist_paths if fs.exists(p) and not config_equals(p, DRIVERCTL_VFIO)]
        if foreign:
            raise RefusedError(f"{host.relative(foreign[0])} holds another driverctl override, not written "
                               "by vgpuhost", hint="remove it (driverctl unset-override) or drop --persist; "
                                                    "nothing was changed")
        if persist:
            out.persisted = [host.relative(p) for p in persist_paths]
            out.steps += describe(host, persist_steps)
        if dry_run:
            return out
        # the types the GPU lists now: bound to vfio-pci it lists none (the vGPU manager unregisters it), and
        # a vGPU asked of it later is then refused as passed through, not as an unknown profile
        from ..policy.offers import seen_rows
        store.remember_types([row for row in seen_rows(inv) if row[0] == str(gpu)])
        ex = Executor(host, store, actor=actor or actor_name(), operation=f"passthrough prepare {gpu}")
        old_records = {r.bdf: r for r in store.passthrough_records()}
        journal = Journal.start(store, kind="passthrough-prepare", operation=ex.operation, owner=owner,
                                actor=ex.actor, gpu=str(gpu), group=group, steps=out.steps, devices=[
                                    {"bdf": str(d.address), "driver": d.driver, "override": d.driver_override,
                                     "target": VFIO_PCI, "recorded": str(d.address) in old_records}
                                    for d in endpoints])
        ex.journal = journal
        with journal:
            return _prepare_writes(host, store, ex, gpu, group, endpoints, plans, out, persist, persist_steps,
                                   owner)


def _prepare_writes(host: HostRoot, store: StateStore, ex: Executor, gpu: PciAddress, group: int,
                    endpoints: Sequence[PciDevice], plans: List[FunctionPlan], out: Outcome, persist: bool,
                    persist_steps: list, owner: str) -> Outcome:
    """The writes and records of :func:`prepare` (under its locks and journal entry), with rollback."""
    if True:
        done: List[FunctionPlan] = []
        for fp in plans:
            try:
                ex.run(fp.steps)
            except VgpuhostError as e:
                failed = _rollback(host, ex, done + [fp])
                raise DeviceError(_failure_text(fp.bdf, e, "bind to vfio-pci", done, failed)
                                  + _gpu_failed(store, ex, gpu, fp.bdf, e, "binding"),
                                  hint="see 'vgpuhost audit' for every write") from e
            except BaseException:           # interrupted (Ctrl-C, SIGTERM): leave nothing half-bound
                _rollback(host, ex, done + [fp])
                raise
            done.append(fp)
        records = {r.bdf: r for r in store.passthrough_records()}
        now = utcnow()
        with store.transaction() as conn:
            for pos, d in enumerate(endpoints):
                old = records.get(str(d.address))
                original = old.original_driver if old else d.driver
                store.put_passthrough(conn, PassthroughRecord(
                    str(d.address), group, str(gpu), original,
                    old.original_override if old else d.driver_override, pos,
                    old.time if old else now, persist or bool(old and old.persisted), owner))
        try:
            ex.run(persist_steps)           # a failure removes the files it wrote
            out.changed = out.changed or bool(persist_steps)
        except SysfsError as e:
            failed = _rollback(host, ex, done)
            with store.transaction() as conn:
                store.delete_passthrough(conn, [str(fp.bdf) for fp in done])
            raise DeviceError(f"--persist could not write {host.relative(e.path)}: {e.errno_name}; "
                              + ("the group went back to its drivers" if not failed else
                                 "ROLLBACK FAILED for " + ", ".join(failed)),
                              hint=f"make {host.relative(host.driverctl_d)} writable, or prepare without --persist") from e
        out.writes = ex.writes
        return out


def release(host: HostRoot, store: StateStore, gpu: PciAddress, *, persist: bool = False,
            dry_run: bool = False, actor: Optional[str] = None, owner: Optional[str] = None,
            while_running: bool = False) -> Outcome:
    """Give every function of ``gpu``'s group back, companions first, the GPU last.

    Idempotent.  A function that fails to go back is named in a DeviceError
    after the others were released; its record stays for a retry.  A group
    a running domain holds (one the qemu hook started and has not released:
    ``store.active_domains()``) raises RefusedError, with or without
    ``owner``, unless ``while_running`` (the hook's release and undo, and
    detach, which take the GPU from the domain first: as
    :func:`vgpuhost.ops.vgpu.remove`); a group recorded for a domain that
    is not running (a host crash skipped its ``release end``) is released.
    With ``owner`` (a domain UUID) only a group that owner holds is
    released: a group with no records is a no-op (already released, or
    never prepared), one another owner holds raises RefusedError and is
    left alone.
    """
    if owner is not None:
        owner = validate_owner(owner)
    inv = discover(Sysfs(host))
    group, endpoints, _ = group_endpoints(inv, gpu)
    with _locks(store, group, gpu, dry_run):
        if not dry_run:
            _recover_first(host, store, gpu, group, actor)
        inv = discover(Sysfs(host))
        group, endpoints, _ = group_endpoints(inv, gpu)
        records = {r.bdf: r for r in store.passthrough_records()}
        holder = group_holder(store, endpoints, records)
        if owner is not None and holder is None:
            out = Outcome("release", gpu, group, changed=False, dry_run=dry_run)
            out.notes.append(f"IOMMU group {group} is not held by {owner}: nothing to do")
            return out
        _check_release_holder(store, gpu, group, holder, owner, while_running)
        plans = plan_release(endpoints, records)
        out, persisted = _release_outcome(host, gpu, group, endpoints, records, plans, persist, dry_run)
        if dry_run:
            return out
        ex = Executor(host, store, actor=actor or actor_name(), operation=f"passthrough release {gpu}")
        targets = {str(fp.bdf): fp.target_driver for fp in plans}
        journal = Journal.start(store, kind="passthrough-release", operation=ex.operation,
                                owner=group_holder(store, endpoints, records) or MANUAL, actor=ex.actor,
                                gpu=str(gpu), group=group, steps=out.steps, devices=[
                                    {"bdf": str(d.address), "driver": d.driver, "override": d.driver_override,
                                     "target": (targets[str(d.address)] if str(d.address) in targets
                                                else d.driver),
                                     "recorded": str(d.address) in records}
                                    for d in endpoints])
        ex.journal = journal
        with journal:
            return _release_writes(host, store, ex, gpu, endpoints, plans, out, persist, persisted)


def _check_release_holder(store: StateStore, gpu: PciAddress, group: int, holder: Optional[str],
                          owner: Optional[str], while_running: bool) -> None:
    """Refuse (RefusedError) a release for ``owner`` of a group another owner holds, and, unless
    ``while_running``, of a group a running domain holds."""
    if owner is not None and holder != owner:
        raise RefusedError(f"IOMMU group {group} of {gpu} is held by {describe_owner(holder)}, "
                           f"not {owner}: left alone",
                           hint="a late release for an earlier owner never frees the next owner's group")
    if not while_running:
        running = store.active_domains()
        if holder in running:
            raise RefusedError(f"IOMMU group {group} of {gpu} is in use by running domain "
                               f"{running[holder]} ({holder}): left alone",
                               hint="stop the domain first; its qemu hook releases the group when it stops")


def _release_outcome(host: HostRoot, gpu: PciAddress, group: int, endpoints: Sequence[PciDevice], records: dict,
                     plans: List[FunctionPlan], persist: bool, dry_run: bool) -> Tuple[Outcome, list]:
    """What :func:`release` will do, before it writes: ``(outcome with functions, steps and notes,
    the driverctl override files that bind the group at boot)``."""
    out = Outcome("release", gpu, group, changed=bool(plans), dry_run=dry_run)
    out.functions = [{"bdf": str(fp.bdf), "from": fp.before_driver, "to": fp.target_driver}
                     for fp in plans]
    out.steps = [s for fp in plans for s in describe(host, fp.steps)]
    unrecorded = [str(d.address) for d in endpoints if d.driver == VFIO_PCI
                  and str(d.address) not in records]
    if unrecorded:
        out.notes.append("not bound by vgpuhost (no record), released to the host driver that "
                         "probes: " + ", ".join(unrecorded))
    if not plans:
        out.notes.append(f"IOMMU group {group} is already on its host drivers: nothing to do")
    persisted = [_driverctl_path(host, d.address) for d in endpoints
                 if config_equals(_driverctl_path(host, d.address), DRIVERCTL_VFIO)]
    if persist:
        out.persisted = [host.relative(p) for p in persisted]
        out.steps += describe(host, [RemoveConfig(p) for p in persisted])
    elif persisted:
        out.notes.append("driverctl overrides remain and rebind the group at boot: "
                         + ", ".join(host.relative(p) for p in persisted)
                         + " (release with --persist removes them)")
    return out, persisted


def _gpu_failed(store: StateStore, ex: Executor, gpu: PciAddress, bdf: PciAddress, e: BaseException,
                what: str) -> str:
    """What a failed binding write ``e`` on ``bdf`` (a function of ``gpu``'s group) adds to the refusal:
    when it means the GPU failed (EIO/ENODEV), ``gpu`` is recorded unhealthy
    (:func:`vgpuhost.ops.health.failed_write`) and the line says so; else nothing."""
    from . import health
    marked = health.failed_write(store, gpu, e, f"{what} {bdf}", actor=ex.actor, operation=ex.operation)
    return health.MARKED if marked else ""


def _release_writes(host: HostRoot, store: StateStore, ex: Executor, gpu: PciAddress, endpoints: Sequence[PciDevice],
                    plans: List[FunctionPlan], out: Outcome, persist: bool, persisted: list) -> Outcome:
    """The writes of :func:`release` (under its locks and journal entry)."""
    if True:
        released, errors, marked = [], [], ""
        for fp in plans:
            try:
                ex.run(fp.steps)
                released.append(str(fp.bdf))
            except VgpuhostError as e:
                errors.append((fp.bdf, e))
                marked = marked or _gpu_failed(store, ex, gpu, fp.bdf, e, "giving back")
        with store.transaction() as conn:
            gone = [str(d.address) for d in endpoints if str(d.address) not in {str(b) for b, _ in errors}]
            store.delete_passthrough(conn, gone)
        if persist:
            for p in persisted:
                try:
                    ex.run([RemoveConfig(p)])
                    out.changed = True
                except SysfsError as e:
                    errors.append((PciAddress.parse(p.name[4:]), e))
        if errors:
            bdf, e = errors[0]
            raise DeviceError(_failure_text(bdf, e, "give back", [], []) + marked +
                              (f"; released: {', '.join(released)}" if released else ""),
                              hint="fix the cause and run release again; 'vgpuhost audit' has every write")
        out.writes = ex.writes
        return out


def _recover_first(host: HostRoot, store: StateStore, gpu: PciAddress, group: int, actor: Optional[str]) -> None:
    """Finish or roll back what an interrupted operation left on this group or GPU (locks held)."""
    from .recover import recover_locked
    recover_locked(host, store, gpu=str(gpu), group=group, actor=actor or actor_name())


def group_holder(store: StateStore, endpoints: Sequence[PciDevice],
                 records: Optional[Dict[str, PassthroughRecord]] = None) -> Optional[str]:
    """The owner recorded for the group's functions (a domain UUID or ``manual``), None when unrecorded."""
    if records is None:
        records = {r.bdf: r for r in store.passthrough_records()}
    for d in endpoints:
        rec = records.get(str(d.address))
        if rec is not None:
            return rec.owner
    return None


def describe_owner(owner: str) -> str:
    """``domain 4b20...``, ``a manual 'vgpuhost passthrough prepare'`` or ``vgpuhost's declarative layout``."""
    if owner == MANUAL:
        return "a manual 'vgpuhost passthrough prepare'"
    if owner in POOL_OWNERS:
        return f"vgpuhost's declarative {owner}"
    return f"domain {owner}"


def _rollback(host: HostRoot, ex: Executor, plans: List[FunctionPlan]) -> List[str]:
    """Return each function in ``plans`` (last first) to its driver before; failures by BDF."""
    failed = []
    for fp in reversed(plans):
        now = discover_device(host, fp.bdf)
        try:
            ex.run(rollback_steps(fp, now))
        except VgpuhostError as e:
            failed.append(f"{fp.bdf} ({_errtext(e)})")
    return failed


def discover_device(host: HostRoot, bdf: PciAddress) -> PciDevice:
    from ..observe.inventory import _read_device
    return _read_device(Sysfs(host), bdf)


def _errtext(e: VgpuhostError) -> str:
    if isinstance(e, SysfsError):
        if e.value is None:
            return f"{e.errno_name} on {e.path}"
        return f"{e.errno_name} writing {e.value.strip()[:60]!r} to {e.path}"
    return e.message


def _failure_text(bdf: PciAddress, e: VgpuhostError, what: str, done: List[FunctionPlan],
                  rollback_failed: List[str]) -> str:
    text = f"{bdf} failed to {what}: {_errtext(e)}"
    if done:
        text += "; rolled back " + ", ".join(str(fp.bdf) for fp in done) + (
            " to their original drivers" if len(done) > 1 else " to its original driver")
    if rollback_failed:
        text += "; ROLLBACK FAILED for " + ", ".join(rollback_failed)
    return text


# ---------------------------------------------------------------------------
# early binding (modprobe.d)

def modprobe_config(inv: Inventory, gpu: PciAddress, fs: Sysfs,
                    records: Optional[Dict[str, PassthroughRecord]] = None) -> str:
    """``vfio-pci ids=`` and ``softdep`` lines that bind the group at boot.

    Module names are read from ``drivers/<driver>/module``.  The ids match
    every device with the same vendor:device; such other devices are named
    in a comment.
    """
    _, endpoints, _ = group_endpoints(inv, gpu)
    ids, mods = [], []
    for d in endpoints:
        if d.ids not in ids:
            ids.append(d.ids)
        rec = (records or {}).get(str(d.address))
        drv = rec.original_driver if rec else d.driver
        if drv and drv != VFIO_PCI:
            mod = fs.link_name(fs.host.pci_driver(drv) / "module") or drv.replace("-", "_")
            if mod not in mods:
                mods.append(mod)
    others = [str(d.address) for d in inv.devices.values()
              if d.ids in ids and d.address not in {e.address for e in endpoints}]
    if "vfio_pci" in inv.host.modules_builtin:
        # a built-in vfio-pci never reads /etc/modprobe.d: its options come from the kernel command line
        lines = [f"# vgpuhost: bind IOMMU group of {gpu} to vfio-pci at boot",
                 "# vfio-pci is built into this kernel, so /etc/modprobe.d options are ignored: add these to the",
                 "# kernel command line (GRUB_CMDLINE_LINUX in /etc/default/grub, then update-grub) and reboot"]
        if others:
            lines.append("# WARNING: these ids also match " + ", ".join(sorted(others)) +
                         ", which would be bound to vfio-pci too")
        lines.append(f"vfio-pci.ids={','.join(ids)}")
        return "\n".join(lines) + "\n"
    lines = [f"# vgpuhost: bind IOMMU group of {gpu} to vfio-pci at boot",
             "# put in /etc/modprobe.d/vfio.conf, then update-initramfs -u (or dracut -f) and reboot"]
    if others:
        lines.append("# WARNING: these ids also match " + ", ".join(sorted(others)) +
                     ", which would be bound to vfio-pci too")
    lines.append(f"options vfio-pci ids={','.join(ids)}")
    lines += [f"softdep {m} pre: vfio-pci" for m in mods]
    return "\n".join(lines) + "\n"


__all__ = ["prepare", "release", "modprobe_config", "group_holder", "describe_owner", "Outcome"]
