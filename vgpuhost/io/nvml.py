"""The NVML door: every call into the NVIDIA driver's management library.

Owns: the :class:`NvmlBackend` interface that MIG, scheduler and vGPU-mode
code use, its real implementation over nvidia-ml-py (``import pynvml``,
lazily; :func:`vgpuhost.io.backends.backend_for` chooses between it and
the simulator's, :class:`vgpuhost.sim.nvml.SimNvml`, whose state is in the
simulated host's ``.vgpuhost-sim/host.json``).  Devices are selected by PCI bus id, never by
index (docs/reference/hardware.md#field-lessons).  ``NVMLError_*`` become :class:`NvmlError` keeping
the NVML error name; a missing library or driver becomes
:class:`HostEnvironmentError` (exit 2) while sysfs inventory still works.
Its value types (:class:`~vgpuhost.model.nvml.GiProfile`, ``GpuInstance``,
``SchedulerState``, ...) live in :mod:`vgpuhost.model.nvml`, so code that only
reasons about them need not import the door.
Must not: be imported by the hook path or by inventory.

Names and semantics: docs/reference/hardware.md#mig-profiles, #vgpu-scheduling, #nvml.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Tuple

from ..model.errors import VgpuhostError
from ..model.nvml import GiProfile, GpuInstance, SchedulerCaps, SchedulerState, scheduler_text
from ..model.values import PciAddress


class NvmlError(VgpuhostError):
    """An NVML call failed; ``nvml_name`` is the NVMLError subclass name (``NVMLError_InUse``)."""

    exit_code = 3

    def __init__(self, call: str, nvml_name: str, *, hint: Optional[str] = None):
        self.call = call
        self.nvml_name = nvml_name
        super().__init__(f"{call} failed: {nvml_name}", hint=hint)

    @property
    def not_supported(self) -> bool:
        return self.nvml_name == "NVMLError_NotSupported"


# ---------------------------------------------------------------------------
# the one spelling of an NVML write: the audit row the Executor writes for it
# (:mod:`vgpuhost.plan.steps`) and the line the simulator's write log keeps for it
# (:mod:`vgpuhost.sim.nvml`), so a fault-injection test can match the two

def row_set_mig_mode(gpu: object, enabled: bool) -> Tuple[str, str]:
    """``(path, value)`` of an ``nvmlDeviceSetMigMode`` write."""
    return "nvml:nvmlDeviceSetMigMode", f"gpu={gpu} mode={int(bool(enabled))}"


def row_create_gi(gpu: object, profile_id: int, profile: str, start: int, size: int) -> Tuple[str, str]:
    """``(path, value)`` of an ``nvmlDeviceCreateGpuInstanceWithPlacement`` write (slices)."""
    return ("nvml:nvmlDeviceCreateGpuInstanceWithPlacement",
            f"gpu={gpu} profile={profile_id} ({profile}) start={start} size={size}")


def row_destroy_gi(gpu: object, gi_id: int, profile: str, start: int) -> Tuple[str, str]:
    """``(path, value)`` of an ``nvmlGpuInstanceDestroy`` write."""
    return "nvml:nvmlGpuInstanceDestroy", f"gpu={gpu} gi={gi_id} ({profile}) start={start}"


def row_set_scheduler(gpu: object, state: SchedulerState) -> Tuple[str, str]:
    """``(path, value)`` of an ``nvmlDeviceSetVgpuSchedulerState`` write (the state in words)."""
    return f"nvml:{gpu}/vgpu-scheduler", scheduler_text(state)


def row_set_mixed_size(gpu: object, on: bool) -> Tuple[str, str]:
    """``(path, value)`` of an ``nvmlDeviceSetVgpuHeterogeneousMode`` write."""
    return f"nvml:{gpu}/vgpu-heterogeneous-mode", "on" if on else "off"


class NvmlBackend(Protocol):
    """The device operations vgpuhost needs.  Every method takes a PCI address.

    Raise :class:`NvmlError` (NVML error name kept) on failure.
    """

    def device_name(self, bdf: PciAddress) -> str: ...
    def device_uuid(self, bdf: PciAddress) -> str: ...
    # MIG (docs/reference/hardware.md#mig-profiles)
    def mig_mode(self, bdf: PciAddress) -> Optional[Tuple[bool, bool]]: ...
    def set_mig_mode(self, bdf: PciAddress, enabled: bool) -> Tuple[bool, bool]: ...
    def gi_profiles(self, bdf: PciAddress) -> List[GiProfile]: ...
    def gpu_instances(self, bdf: PciAddress) -> List[GpuInstance]: ...
    def create_gpu_instance(self, bdf: PciAddress, profile_id: int, start: int) -> GpuInstance: ...
    def destroy_gpu_instance(self, bdf: PciAddress, gi_id: int) -> None: ...
    def gpu_instance_vgpus(self, bdf: PciAddress) -> Dict[int, int]: ...
    def compute_processes(self, bdf: PciAddress) -> int: ...
    # vGPU (docs/reference/hardware.md#vgpu-types, #vgpu-scheduling, #nvml)
    def active_vgpus(self, bdf: PciAddress) -> int: ...
    def heterogeneous_mode(self, bdf: PciAddress) -> bool: ...
    def set_heterogeneous_mode(self, bdf: PciAddress, enabled: bool) -> None: ...
    def scheduler_caps(self, bdf: PciAddress) -> SchedulerCaps: ...
    def scheduler_state(self, bdf: PciAddress) -> SchedulerState: ...
    def set_scheduler_state(self, bdf: PciAddress, state: SchedulerState) -> None: ...
    # health (docs/guide/failures.md#signals)
    def gpu_lost(self, bdf: PciAddress) -> bool: ...
    def xid_events(self, bdfs: List[PciAddress], timeout_ms: int) -> List[Tuple[PciAddress, int]]: ...
