"""The values NVML reports and takes: GPU-instance profiles and instances, vGPU scheduler state.

Owns: the value types of the NVML door (:mod:`vgpuhost.io.nvml`), which
policy, planning and the simulator share without importing the door, and
:func:`scheduler_text`, a scheduler state in words (audit rows, plans and
the simulator's write log spell it so).  Must not: call NVML or touch files.

Names and semantics: docs/reference/hardware.md#mig-profiles, #vgpu-scheduling, #nvml.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

from .errors import InputError
from .kinds import SchedulerPolicy
from .values import MigProfile, PciAddress, VgpuProfile


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


# ---------------------------------------------------------------------------
# metering values (docs/reference/hardware.md#metering)

#: ``nvmlValueType_t`` -> the ``nvmlValue_t`` union member it names (nvml.h; nvidia-ml-py 13.x
#: ``NVML_VALUE_TYPE_DOUBLE = 0`` ... ``NVML_VALUE_TYPE_UNSIGNED_SHORT = 6``)
VALUE_TYPE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

#: why a MIG GPU instance's SM use is not metered through GPM (a ``gpm`` reason in the metering
#: output): the NVML API reference's "NVML GPM" chapter says that in NVIDIA vGPU software GPM is
#: supported only on MIG-backed vGPU profiles that are allocated all of the instance's framebuffer
GPM_NOT_WHOLE_INSTANCE = "vgpu-not-whole-instance"
#: the GPU instance's vGPU type could not be told to own the whole instance (a name vgpuhost
#: cannot parse): not metered rather than guessed
GPM_UNKNOWN_SHARE = "vgpu-share-unknown"
GPM_REASONS = (GPM_NOT_WHOLE_INSTANCE, GPM_UNKNOWN_SHARE)


def no_mdev_uuid(text: Optional[str]) -> bool:
    """True when an mdev UUID NVML reports is none: empty, or all zeros
    (``00000000-0000-0000-0000-000000000000``).  A vendor-specific VFIO vGPU has no mdev: a
    real ``nvidia-smi vgpu -q`` on such a host (driver 580) prints no ``MDEV UUID`` line
    (tests/data/real/nvidia-smi/README.md)."""
    t = (text or "").strip().strip("\x00")
    return not t.replace("-", "").strip("0")


def gpm_not_metered(type_names: List[str], gi_profile_name: Optional[str]) -> Optional[str]:
    """Why GPM does not meter a GPU instance holding vGPUs of ``type_names`` (one name per vGPU
    in it, ``H200X-1-18C``) on a GI of profile ``gi_profile_name`` (``1g.18gb``), or None when
    it does.

    Source: NVML API reference, "NVML GPM" (docs.nvidia.com/deploy/nvml-api/group__GPM.html):
    for NVIDIA vGPU software, GPM is supported only on MIG-backed vGPU profiles allocated all of
    the instance's framebuffer.  So: one vGPU in the instance, MIG-backed, whose framebuffer
    (GB, as the type name spells it) is the instance's (GB, as the profile name spells it);
    :data:`GPM_NOT_WHOLE_INSTANCE` when it is smaller or shared, :data:`GPM_UNKNOWN_SHARE` when a
    name does not parse.
    """
    if len(type_names) != 1:
        return GPM_NOT_WHOLE_INSTANCE if type_names else GPM_UNKNOWN_SHARE
    prof = VgpuProfile.try_parse(type_names[0])
    try:
        gi: Optional[MigProfile] = MigProfile.parse(gi_profile_name or "")
    except InputError:
        gi = None
    if prof is None or gi is None:
        return GPM_UNKNOWN_SHARE
    if not prof.mig_backed or prof.framebuffer_gb < gi.memory_gb:
        return GPM_NOT_WHOLE_INSTANCE
    return None


def nvml_bus_id(bdf: Union[PciAddress, str]) -> str:
    """Our ``0000:41:00.0`` in NVML's own spelling ``00000000:41:00.0``."""
    a = bdf if isinstance(bdf, PciAddress) else PciAddress.parse(bdf)
    return f"{a.domain:08X}:{a.bus:02X}:{a.slot:02X}.{a.function:X}"


def bdf_from_nvml(bus_id: Union[str, bytes]) -> str:
    """``00000000:41:00.0`` -> ``0000:41:00.0``."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    m = re.match(r"^\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])\s*$", bus_id)
    if not m:
        return bus_id
    d, b, s, f = (int(x, 16) for x in m.groups())
    return f"{d:04x}:{b:02x}:{s:02x}.{f}"
