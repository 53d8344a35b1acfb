"""Plans are data: every change vgpuhost makes on a host is one typed step.

Owns: :class:`Step` (the interface the one
:class:`~vgpuhost.plan.executor.Executor` runs) and the step families —
kernel writes under ``/sys`` (driver binding, mdev and VF vGPU create and
remove), configuration files (modprobe.d, driverctl overrides, mdevctl
definitions, systemd units: written atomically, undoable) and NVML calls
(MIG mode, GPU instances, the vGPU scheduler, mixed-size mode) — each a
frozen value that says what it will do (:meth:`Step.describe`, what
``--dry-run`` prints), does it (:meth:`Step.run`), reads it back
(:meth:`Step.verify`) and how it is undone (:meth:`Step.inverse`).
Must not: decide which steps to take (planners in :mod:`vgpuhost.plan`
do, as pure functions), touch files except through the context's
:class:`~vgpuhost.io.sysfs.Sysfs`, or import anything heavy at module level
(the qemu hook imports this module).

Sources: the safe binding sequence is driverctl's (driver_override, unbind,
drivers_probe, then verify: the project's docs reference, section 1);
mdev ``create``/``remove`` and the vendor VFIO ``current_vgpu_type`` write
(section 2-3); the NVML calls and their error names (sections 5-7).
"""

from __future__ import annotations

import errno as _errno
from os.path import join as _join

from ..model.errors import DeviceError
from ..io import vgpudev
from ..io.hostroot import HostRoot
from ..model.values import PciAddress, record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook imports neither typing nor pathlib)
    from pathlib import Path
    from typing import Optional, Tuple
    from ..model.nvml import SchedulerState

ANY_HOST_DRIVER = "<any host driver>"

#: ``Step.audit_by`` values: the audited Sysfs writes a row per write as it happens; the
#: Executor writes the step's one row; a read-only check writes none
AUDIT_FS = "fs"
AUDIT_EXECUTOR = "executor"
AUDIT_NONE = None


class Step:
    """One action on the host, as a value.

    Subclasses are ``@record(frozen=True)`` values and implement
    :meth:`describe` and :meth:`run`; :meth:`verify`, :meth:`inverse`,
    :meth:`audit_row` and :meth:`audit_failure` as they need.
    ``audit_by`` says who writes the step's audit row (see
    :data:`AUDIT_FS`, :data:`AUDIT_EXECUTOR`, :data:`AUDIT_NONE`).
    """

    audit_by: Optional[str] = AUDIT_FS
    #: an NVML write that changes what the GPU offers (its vGPU types' counts) without moving any file
    #: the agent's fingerprint watches: the Executor rewrites the driver-state token after running it
    #: (:func:`vgpuhost.io.changes.note_driver_change`, for executor-audited steps)
    moves_offers = False

    def describe(self, host: HostRoot) -> str:  # pragma: no cover - abstract
        """The line ``--dry-run`` prints for this step (paths as the host names them)."""
        raise NotImplementedError

    def run(self, ctx: StepContext) -> object:  # pragma: no cover - abstract
        """Do it; the result is handed to :meth:`verify` and :meth:`inverse`.

        Raises the door's error (SysfsError, NvmlError) or DeviceError.
        """
        raise NotImplementedError

    def verify(self, ctx: StepContext, result: object) -> None:
        """Read the change back; raise DeviceError when it did not take.  Default: nothing to read."""

    def inverse(self, result: object) -> Optional[Step]:
        """The step that undoes this one after it ran with ``result``; None: nothing to undo here."""
        return None

    def audit_row(self, ctx: StepContext) -> Tuple[str, str]:  # pragma: no cover - executor-audited only
        """``(path, value)`` of the audit row the Executor writes (``audit_by == AUDIT_EXECUTOR``)."""
        raise NotImplementedError

    def audit_failure(self, exc: BaseException) -> Tuple[str, int]:
        """``(suffix to the value, errno)`` of the audit row of a failed run."""
        return "", getattr(exc, "errno", None) or _errno.EIO


# =============================================================================
# kernel writes (sysfs)

@record(frozen=True)
class SetDriverOverride(Step):
    """Write ``driver`` to ``driver_override`` (None clears it: a newline)."""

    bdf: PciAddress
    driver: Optional[str]

    def _path(self, host: HostRoot):
        return _join(host.s.pci_device(self.bdf), "driver_override")

    def describe(self, host: HostRoot) -> str:
        value = repr(self.driver) if self.driver else "'\\n' (clear)"
        return f"write {value} to {host.relative(self._path(host))}"

    def run(self, ctx: StepContext) -> None:
        ctx.fs.write(self._path(ctx.host), self.driver if self.driver else "\n")


@record(frozen=True)
class Unbind(Step):
    """Write the BDF to ``drivers/<driver>/unbind``."""

    bdf: PciAddress
    driver: str

    def describe(self, host: HostRoot) -> str:
        return f"write '{self.bdf}' to {host.relative(_join(host.s.pci_driver(self.driver), 'unbind'))}"

    def run(self, ctx: StepContext) -> None:
        ctx.fs.write(_join(ctx.host.s.pci_driver(self.driver), "unbind"), str(self.bdf))


@record(frozen=True)
class Probe(Step):
    """Write the BDF to ``drivers_probe`` (succeeds even when nothing binds)."""

    bdf: PciAddress

    def describe(self, host: HostRoot) -> str:
        return f"write '{self.bdf}' to {host.relative(host.s.pci_drivers_probe)}"

    def run(self, ctx: StepContext) -> None:
        ctx.fs.write(ctx.host.s.pci_drivers_probe, str(self.bdf))


@record(frozen=True)
class VerifyDriver(Step):
    """Read ``driver`` back; ``expected`` None = unbound, ANY_HOST_DRIVER = bound, not vfio-pci.

    A read-only check (no audit row); raises DeviceError when the driver differs.
    """

    bdf: PciAddress
    expected: Optional[str]
    audit_by = AUDIT_NONE

    def describe(self, host: HostRoot) -> str:
        want = "no driver" if self.expected is None else self.expected
        return f"check {host.relative(_join(host.s.pci_device(self.bdf), 'driver'))} is {want}"

    def run(self, ctx: StepContext) -> None:
        fs = ctx.fs
        got = fs.link_name(_join(fs.host.s.pci_device(self.bdf), "driver"))
        ok = (got is not None and got != "vfio-pci") if self.expected == ANY_HOST_DRIVER else got == self.expected
        if not ok:
            want = "no driver" if self.expected is None else self.expected
            raise DeviceError(
                f"{self.bdf} is bound to {got or 'no driver'} after drivers_probe, expected {want}",
                hint="drivers_probe reported success but bound nothing: is the driver's module loaded "
                     "(modprobe it) and does driver_override name it?")


# --- vGPUs: classic mdev and NVIDIA's vendor-specific VFIO ------------------

@record(frozen=True)
class CreateVgpu(Step):
    """Create one vGPU of ``type_id`` on ``parent``.

    ``backend`` ``mdev``: write the UUID ``vgpu_id`` to
    ``<parent>/mdev_supported_types/<type>/create``; ``vendor-vfio``: write
    the type id to the VF's ``nvidia/current_vgpu_type`` (``vgpu_id`` is the
    VF).  Verified by reading the type back (never report a device that
    does not exist); undone by :class:`RemoveVgpu`.  ``name`` (``A40-8Q``)
    is for messages.
    """

    backend: str
    parent: PciAddress
    type_id: str
    vgpu_id: str
    name: str = ""

    def _write(self, host: HostRoot):
        door = vgpudev.for_backend(self.backend)
        return (door.create_path(host, self.parent, self.type_id, self.vgpu_id),
                door.create_value(self.type_id, self.vgpu_id))

    def describe(self, host: HostRoot) -> str:
        path, value = self._write(host)
        return f"write '{value}' to {host.relative(path)}"

    def run(self, ctx: StepContext) -> None:
        ctx.fs.write(*self._write(ctx.host))

    def verify(self, ctx: StepContext, result: object) -> None:
        got = vgpudev.for_backend(self.backend).current_type(ctx.fs, self.parent, self.vgpu_id)
        if got != self.type_id:
            raw = vgpudev.for_backend(self.backend).raw_current(ctx.fs, self.parent, self.vgpu_id)
            raise DeviceError(f"creating {self.name or self.type_id} on {self.parent} reported success but "
                              f"reads back {raw!r}",
                              hint="check the NVIDIA vGPU manager (nvidia-vgpu-mgr) and dmesg")

    def inverse(self, result: object) -> Optional[Step]:
        return RemoveVgpu(self.backend, self.parent, self.vgpu_id)


@record(frozen=True)
class RemoveVgpu(Step):
    """Remove one vGPU: write ``1`` to the mdev's ``remove`` (mdev) or ``0`` to the VF's
    ``nvidia/current_vgpu_type`` (vendor VFIO), never while a process holds it open, and
    bounded in time (:meth:`vgpuhost.io.vgpudev.VgpuDevices.remove`: raises ``VgpuInUse``
    before any write, ``RemoveTimedOut`` when the write blocks).  Verified: the vGPU is gone."""

    backend: str
    parent: PciAddress
    vgpu_id: str

    def _write(self, host: HostRoot):
        return vgpudev.for_backend(self.backend).remove_write(host, self.parent, self.vgpu_id)

    def describe(self, host: HostRoot) -> str:
        path, value = self._write(host)
        return f"write '{value}' to {host.relative(path)}"

    def run(self, ctx: StepContext) -> None:
        vgpudev.for_backend(self.backend).remove(ctx.fs, self.parent, self.vgpu_id)

    def verify(self, ctx: StepContext, result: object) -> None:
        if vgpudev.for_backend(self.backend).current_type(ctx.fs, self.parent, self.vgpu_id) is not None:
            raise DeviceError(f"removing {self.vgpu_id} reported success but it is still there",
                              hint="check dmesg and the NVIDIA vGPU manager")


@record(frozen=True)
class SetVgpuParams(Step):
    """Write ``params`` (``frame_rate_limiter=0``) and a newline to a vGPU's ``nvidia/vgpu_params``
    (the driver keeps all but the last byte written: docs/reference/hardware.md#mdev); undone
    with the vGPU."""

    backend: str
    parent: PciAddress
    type_id: str
    vgpu_id: str
    params: str

    def _path(self, host: HostRoot):
        return vgpudev.for_backend(self.backend).params_path(host, self.parent, self.vgpu_id)

    def describe(self, host: HostRoot) -> str:
        return f"write '{self.params}' to {host.relative(self._path(host))}"

    def run(self, ctx: StepContext) -> None:
        ctx.fs.write(self._path(ctx.host), vgpudev.params_value(self.params))


@record(frozen=True)
class SetPlacement(Step):
    """Write ``placement`` (a placement id) to a free VF's ``nvidia/placement_id`` before its type is
    set, so the vGPU goes there on a GPU in mixed-size mode (docs/reference/hardware.md#vgpu-types);
    verified by reading it back; nothing to undo (a VF without a vGPU has no placement)."""

    backend: str
    parent: PciAddress
    vgpu_id: str
    placement: int

    def _path(self, host: HostRoot):
        return vgpudev.placement_path(host, self.backend, self.parent, self.vgpu_id)

    def describe(self, host: HostRoot) -> str:
        return f"write '{self.placement}' to {host.relative(self._path(host))}"

    def run(self, ctx: StepContext) -> None:
        ctx.fs.write(self._path(ctx.host), str(self.placement))

    def verify(self, ctx: StepContext, result: object) -> None:
        got = vgpudev.read_placement(ctx.fs, self.backend, self.parent, self.vgpu_id)
        if got != self.placement:
            raise DeviceError(f"placement id {self.placement} written to {self.parent} reads back {got!r}",
                              hint="check the NVIDIA vGPU manager (nvidia-vgpu-mgr) and dmesg")


# =============================================================================
# configuration files (etc/: modprobe.d, driverctl, mdevctl, systemd units)

def _config_line(text: str) -> Optional[str]:
    """The text when it is one short line (what a dry run quotes), else None."""
    body = text[:-1] if text.endswith("\n") else text
    return body if "\n" not in body and len(body) <= 80 else None


#: a config step's result when the old text could not be read (nothing to restore it from)
_UNREADABLE = object()


def _old_text(path: Path) -> object:
    """The file's text before a change (None: absent; :data:`_UNREADABLE`: cannot be read, so the
    change itself will report why)."""
    from ..io.configfiles import read_config_text
    from ..model.errors import HostEnvironmentError
    try:
        return read_config_text(path)
    except HostEnvironmentError:
        return _UNREADABLE


@record(frozen=True)
class WriteConfig(Step):
    """Write a configuration file atomically (temp file + rename), creating its directory.

    ``path``: absolute (under the host root, or a directory the operator
    named); ``text``: the whole file.  One audit row (the text, or a
    summary for a long file).  Verified by reading it back; undone by
    restoring the old text (or removing a file that was not there).
    """

    path: Path
    text: str

    def describe(self, host: HostRoot) -> str:
        line = _config_line(self.text)
        if line is not None:
            return f"write {line!r} to {host.relative(self.path)}"
        return f"write {host.relative(self.path)} ({len(self.text.splitlines())} lines)"

    def run(self, ctx: StepContext) -> object:
        old = _old_text(self.path)
        ctx.fs.write_config(self.path, self.text)
        return old

    def verify(self, ctx: StepContext, result: object) -> None:
        from ..io.configfiles import config_equals
        if not config_equals(self.path, self.text):
            raise DeviceError(f"{ctx.host.relative(self.path)} does not read back what was written",
                              hint="is another tool writing it at the same time?")

    def inverse(self, result: object) -> Optional[Step]:
        if result is _UNREADABLE:
            return None
        if result is None:
            return RemoveConfig(self.path)
        return WriteConfig(self.path, str(result))


@record(frozen=True)
class RemoveConfig(Step):
    """Remove a configuration file (nothing, and no audit row, when it is not there).

    Undone by writing its old text back.
    """

    path: Path

    def describe(self, host: HostRoot) -> str:
        return f"remove {host.relative(self.path)}"

    def run(self, ctx: StepContext) -> object:
        old = _old_text(self.path)
        ctx.fs.remove_config(self.path)
        return old

    def verify(self, ctx: StepContext, result: object) -> None:
        if ctx.fs.exists(self.path):
            raise DeviceError(f"{ctx.host.relative(self.path)} is still there after removing it",
                              hint="is another tool writing it at the same time?")

    def inverse(self, result: object) -> Optional[Step]:
        return None if result is None or result is _UNREADABLE else WriteConfig(self.path, str(result))


# =============================================================================
# NVML calls (one audit row each, written by the Executor: path ``nvml:...``)

#: NVML error name -> the errno the audit row's result column shows
NVML_AUDIT_ERRNO = {
    "NVMLError_InUse": _errno.EBUSY, "NVMLError_InsufficientResources": _errno.ENOSPC,
    "NVMLError_InvalidArgument": _errno.EINVAL, "NVMLError_NotSupported": _errno.EOPNOTSUPP,
    "NVMLError_NotFound": _errno.ENODEV, "NVMLError_NoPermission": _errno.EPERM,
}


class _MigCall(Step):
    """A MIG NVML call on one GPU: audit row ``nvml:<call>`` / ``gpu=<bdf> <value>``."""

    audit_by = AUDIT_EXECUTOR
    moves_offers = True         # MIG mode and GPU instances: what MIG-backed and time-sliced types offer
    call = ""

    def row(self) -> Tuple[str, str]:  # pragma: no cover - abstract
        """``(path, value)``: the NVML door's spelling of this write (:mod:`vgpuhost.io.nvml`), which
        the simulator's write log uses too."""
        raise NotImplementedError

    def audit_row(self, ctx: StepContext) -> Tuple[str, str]:
        return self.row()

    def audit_failure(self, exc: BaseException) -> Tuple[str, int]:
        name = getattr(exc, "nvml_name", None)
        if name is None:
            return "", _errno.EIO
        return f" -> {name}", NVML_AUDIT_ERRNO.get(name, _errno.EIO)


@record(frozen=True)
class SetMigMode(_MigCall):
    """``nvmlDeviceSetMigMode``: MIG mode on or off (may stay pending until a GPU reset).

    Result: ``(current, pending)``.  Undone by the opposite call.
    """

    gpu: PciAddress
    enabled: bool
    call = "nvmlDeviceSetMigMode"

    def describe(self, host: Optional[HostRoot] = None) -> str:
        return f"{self.call} {'enable' if self.enabled else 'disable'}"

    def row(self) -> Tuple[str, str]:
        from ..io.nvml import row_set_mig_mode
        return row_set_mig_mode(self.gpu, self.enabled)

    def run(self, ctx: StepContext) -> object:
        return ctx.backend.set_mig_mode(self.gpu, self.enabled)

    def inverse(self, result: object) -> Optional[Step]:
        return SetMigMode(self.gpu, not self.enabled)


@record(frozen=True)
class CreateGi(_MigCall):
    """``nvmlDeviceCreateGpuInstanceWithPlacement``: one GPU instance at a memory-slice placement.

    ``profile_id``: the device's GI profile id; ``profile``: its name
    (``1g.18gb``); ``start``/``size``: memory slices.  Result: the
    :class:`~vgpuhost.model.nvml.GpuInstance`; undone by destroying it.  Not
    verified one by one: the planner's caller reads the whole layout back
    after the last step (a layout is what NVML reports all together).
    """

    gpu: PciAddress
    profile_id: int
    profile: str
    start: int
    size: int
    call = "nvmlDeviceCreateGpuInstanceWithPlacement"

    def describe(self, host: Optional[HostRoot] = None) -> str:
        return (f"{self.call} {self.profile} (profile id {self.profile_id}) at memory slice "
                f"{self.start} (size {self.size})")

    def row(self) -> Tuple[str, str]:
        from ..io.nvml import row_create_gi
        return row_create_gi(self.gpu, self.profile_id, self.profile, self.start, self.size)

    def run(self, ctx: StepContext) -> object:
        return ctx.backend.create_gpu_instance(self.gpu, self.profile_id, self.start)

    def inverse(self, result: object) -> Optional[Step]:
        gi = getattr(result, "gi_id", None)
        if gi is None:
            return None
        return DestroyGi(self.gpu, gi, self.profile, self.start, self.size, self.profile_id)


@record(frozen=True)
class DestroyGi(_MigCall):
    """``nvmlGpuInstanceDestroy``: one GPU instance, by id.

    ``profile_id`` (when known) lets the undo create it again at the same
    placement.  Verified with the whole layout, as :class:`CreateGi`.
    """

    gpu: PciAddress
    gi_id: int
    profile: str
    start: int
    size: int
    profile_id: Optional[int] = None
    call = "nvmlGpuInstanceDestroy"

    def describe(self, host: Optional[HostRoot] = None) -> str:
        return f"{self.call} GPU instance {self.gi_id} ({self.profile} at memory slice {self.start})"

    def row(self) -> Tuple[str, str]:
        from ..io.nvml import row_destroy_gi
        return row_destroy_gi(self.gpu, self.gi_id, self.profile, self.start)

    def run(self, ctx: StepContext) -> object:
        return ctx.backend.destroy_gpu_instance(self.gpu, self.gi_id)

    def inverse(self, result: object) -> Optional[Step]:
        if self.profile_id is None:
            return None
        return CreateGi(self.gpu, self.profile_id, self.profile, self.start, self.size)


@record(frozen=True)
class SetScheduler(Step):
    """Set a GPU's vGPU scheduler (``nvmlDeviceSetVgpuSchedulerState``).

    ``state``: wanted; ``before``: what it was (the undo restores it; None:
    not undone).  Audit row ``nvml:<bdf>/vgpu-scheduler`` with the state in
    words; verified by reading the state back (DeviceError when it differs).
    """

    gpu: PciAddress
    state: SchedulerState
    before: Optional[SchedulerState] = None
    audit_by = AUDIT_EXECUTOR

    def describe(self, host: Optional[HostRoot] = None) -> str:
        from ..policy.scheduler import describe
        return f"set the vGPU scheduler of {self.gpu} to {describe(self.state)}"

    def audit_row(self, ctx: StepContext) -> Tuple[str, str]:
        from ..io.nvml import row_set_scheduler
        return row_set_scheduler(self.gpu, self.state)

    def audit_failure(self, exc: BaseException) -> Tuple[str, int]:
        return "", _errno.EIO

    def run(self, ctx: StepContext) -> object:
        return ctx.backend.set_scheduler_state(self.gpu, self.state)

    def verify(self, ctx: StepContext, result: object) -> None:
        from ..policy.scheduler import describe, matches
        after = ctx.backend.scheduler_state(self.gpu)
        if not matches(self.state, after):
            raise DeviceError(f"GPU {self.gpu}: the scheduler reads back '{describe(after)}' after setting "
                              f"'{describe(self.state)}'",
                              hint="the driver did not take the change; check the vGPU manager version "
                                   "(runtime scheduler changes need driver >= 535)")

    def inverse(self, result: object) -> Optional[Step]:
        return None if self.before is None else SetScheduler(self.gpu, self.before, self.state)


@record(frozen=True)
class SetMixedSize(Step):
    """Turn a GPU's mixed-size (heterogeneous) vGPU mode on or off (``nvmlDeviceSetVgpuHeterogeneousMode``).

    Audit row ``nvml:<bdf>/vgpu-heterogeneous-mode`` ``on|off``; verified by
    reading the mode back; undone by the opposite call.
    """

    gpu: PciAddress
    on: bool
    audit_by = AUDIT_EXECUTOR
    moves_offers = True         # the mode decides which types a vendor-VFIO GPU's VFs list

    def describe(self, host: Optional[HostRoot] = None) -> str:
        return f"turn mixed-size vGPU mode {'on' if self.on else 'off'} on {self.gpu}"

    def audit_row(self, ctx: StepContext) -> Tuple[str, str]:
        from ..io.nvml import row_set_mixed_size
        return row_set_mixed_size(self.gpu, self.on)

    def audit_failure(self, exc: BaseException) -> Tuple[str, int]:
        return "", _errno.EIO

    def run(self, ctx: StepContext) -> object:
        return ctx.backend.set_heterogeneous_mode(self.gpu, self.on)

    def verify(self, ctx: StepContext, result: object) -> None:
        after = bool(ctx.backend.heterogeneous_mode(self.gpu))
        if after != self.on:
            raise DeviceError(f"GPU {self.gpu}: mixed-size mode reads back {'on' if after else 'off'} after "
                              f"turning it {'on' if self.on else 'off'}")

    def inverse(self, result: object) -> Optional[Step]:
        return SetMixedSize(self.gpu, not self.on)


__all__ = ["Step", "AUDIT_FS", "AUDIT_EXECUTOR", "AUDIT_NONE", "ANY_HOST_DRIVER",
           "SetDriverOverride", "Unbind", "Probe", "VerifyDriver", "CreateVgpu", "RemoveVgpu", "SetVgpuParams", "SetPlacement",
           "WriteConfig", "RemoveConfig",
           "SetMigMode", "CreateGi", "DestroyGi", "SetScheduler", "SetMixedSize", "NVML_AUDIT_ERRNO"]
