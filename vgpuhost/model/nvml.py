"""The values NVML reports and takes: GPU-instance profiles and instances, vGPU scheduler state.

Owns: the value types of the NVML door (:mod:`vgpuhost.io.nvml`), which
policy, planning and the simulator share without importing the door, and
:func:`scheduler_text`, a scheduler state in words (audit rows, plans and
the simulator's write log spell it so).  Must not: call NVML or touch files.

Names and semantics: docs/reference/hardware.md#mig-profiles, #vgpu-scheduling, #nvml.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .kinds import SchedulerPolicy


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
