"""The NVML door: every call into the NVIDIA driver's management library.

Owns: the :class:`NvmlBackend` interface that MIG, scheduler and vGPU-mode
code use, its real implementation over nvidia-ml-py (``import pynvml``,
lazily; :func:`vgpuhost.io.backends.backend_for` chooses between it and
the simulator's, :class:`vgpuhost.sim.nvml.SimNvml`, whose state is in the
simulated host's ``.vgpuhost-sim/host.json``).  Devices are selected by PCI bus id, never by
index (docs/reference/hardware.md#field-lessons).  ``NVMLError_*`` become :class:`NvmlError` keeping
the NVML error name; a missing library or driver becomes
:class:`HostEnvironmentError` (exit 2) while sysfs inventory still works.
Must not: be imported by the hook path or by inventory.

Names and semantics: docs/reference/hardware.md#mig-profiles, #vgpu-scheduling, #nvml.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Protocol, Tuple

from ..model.errors import VgpuhostError
from ..model.kinds import SchedulerPolicy
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


@dataclass(frozen=True)
class GiProfile:
    """A GPU-instance profile as the device reports it (docs/reference/hardware.md#mig-profiles).

    ``profile_id`` is the nvidia-smi profile id (``nvmlDeviceGetGpuInstanceProfileInfo(...).id``);
    ``placements`` are ``(start, size)`` in memory slices out of 8.
    """

    profile_id: int
    name: str            # "1g.18gb", "1g.18gb+me"
    slices: int          # compute slices (the "1g")
    memory_mib: int
    max_count: int
    placements: Tuple[Tuple[int, int], ...]


@dataclass(frozen=True)
class GpuInstance:
    gi_id: int
    profile_id: int
    start: int
    size: int


@dataclass(frozen=True)
class SchedulerState:
    """The vGPU scheduler of one GPU (or GPU instance): policy
    ``best-effort|equal-share|fixed-share``, ARR on/off, and either
    ``timeslice_ms`` (no ARR) or ``frequency_hz`` + ``avg_factor`` (ARR)."""

    policy: str
    arr: bool = False
    timeslice_ms: Optional[int] = None
    frequency_hz: Optional[int] = None
    avg_factor: Optional[int] = None


@dataclass(frozen=True)
class SchedulerCaps:
    policies: Tuple[str, ...]
    arr_supported: bool
    min_timeslice_ms: int = 1
    max_timeslice_ms: int = 30
    min_frequency_hz: int = 63
    max_frequency_hz: int = 960
    min_avg_factor: int = 1
    max_avg_factor: int = 60


@dataclass
class DeviceFacts:
    """What a read-only probe reports about one GPU."""

    bdf: str
    name: str
    uuid: str
    mig_mode: Optional[Tuple[bool, bool]] = None           # (current, pending); None: not MIG-capable
    gi_profiles: List[GiProfile] = field(default_factory=list)
    gpu_instances: List[GpuInstance] = field(default_factory=list)


# ---------------------------------------------------------------------------
# the one spelling of an NVML write: the audit row the Executor writes for it
# (:mod:`vgpuhost.plan.steps`) and the line the simulator's write log keeps for it
# (:mod:`vgpuhost.sim.nvml`), so a fault-injection test can match the two

#: scheduler policies in words
POLICY_TEXT = {SchedulerPolicy.BEST_EFFORT: "best effort", SchedulerPolicy.EQUAL_SHARE: "equal share",
               SchedulerPolicy.FIXED_SHARE: "fixed share"}


def scheduler_text(state: SchedulerState) -> str:
    """One line: ``equal share, ARR on, frequency 960 Hz, averaging factor 60``."""
    if state.policy == SchedulerPolicy.BEST_EFFORT:
        return "best effort"
    parts = [POLICY_TEXT.get(state.policy, state.policy)]
    if state.arr:
        parts.append("ARR on")
        parts.append(f"frequency {state.frequency_hz} Hz" if state.frequency_hz else "default frequency")
        parts.append(f"averaging factor {state.avg_factor}" if state.avg_factor else "default averaging factor")
    else:
        parts.append("ARR off")
        parts.append(f"time slice {state.timeslice_ms} ms" if state.timeslice_ms else "default time slice")
    return ", ".join(parts)


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
    def compute_processes(self, bdf: PciAddress) -> int: ...
    # vGPU (docs/reference/hardware.md#vgpu-types, #vgpu-scheduling, #nvml)
    def active_vgpus(self, bdf: PciAddress) -> int: ...
    def heterogeneous_mode(self, bdf: PciAddress) -> bool: ...
    def set_heterogeneous_mode(self, bdf: PciAddress, enabled: bool) -> None: ...
    def scheduler_caps(self, bdf: PciAddress) -> SchedulerCaps: ...
    def scheduler_state(self, bdf: PciAddress) -> SchedulerState: ...
    def set_scheduler_state(self, bdf: PciAddress, state: SchedulerState) -> None: ...
