"""The real NVML backend: :class:`vgpuhost.nvml.NvmlBackend` over nvidia-ml-py.

Owns: every call into ``pynvml`` (imported lazily, so inventory and the hook
path never load it), the mapping of ``NVMLError_*`` to :class:`NvmlError`
(NVML error name kept, NOT_SUPPORTED visible through ``.not_supported``), the
conversion between NVML structs and vgpuhost's dataclasses, and the
read-only :func:`probe` used by ``bench/nvml_probe.py``.
Must not: pick devices by index (the probe only *enumerates* by index to
learn PCI bus ids, then works by bus id like everything else), or decide
policy (validation against capabilities is the scheduler/MIG code's job).

Facts checked against nvidia-ml-py 13.x (``pynvml.py``) and the NVML API
reference (docs/reference/hardware.md#mig-profiles, #vgpu-scheduling, #nvml):

* ``nvmlDeviceGetHandleByPciBusId`` takes ``str`` or ``bytes`` (the
  ``convertStrBytes`` decorator encodes), parsed by NVML as ``%x:%x:%x.%x``;
  we send NVML's own spelling ``00000000:41:00.0`` (8-digit domain).
* ``nvmlDeviceGetGpuInstanceProfileInfo(handle, index)`` takes a
  ``NVML_GPU_INSTANCE_PROFILE_*`` *index*; the returned ``.id`` is the
  nvidia-smi profile id, and every other MIG call (placements, create, list)
  takes that id.  The v2 struct carries the driver's own ``name``
  (``"MIG 1g.18gb"``); when it is empty (v1 fallback) the name is built as
  ``{sliceCount}g.{GB}gb`` plus a suffix from the profile index (``_REV1`` =
  ``+me``, ``_GFX`` = ``+gfx``, ``_NO_ME`` = ``-me``, ``_ALL_ME`` = ``+me.all``),
  ``GB`` being the board's memory (``nvmlDeviceGetMemoryInfo``) times the
  instance's share in eighths, rounded up (NVIDIA/go-nvlib
  ``getMigMemorySizeGB``): a real H200 (143771 MiB) gives 16384 MiB ->
  1g.18gb, 33024 -> 1g.35gb, 71168 -> 3g.71gb (mig-parted issue 120), where
  rounding the instance's own MiB up to GiB said 16, 33 and 70.
* ``nvmlDeviceCreateGpuInstanceWithPlacement(dev, id, placement)`` passes
  ``placement`` to C unchanged and the C side wants a *pointer*, so we pass
  ``byref(c_nvmlGpuInstancePlacement_t)``.
* ``nvmlVgpuInstanceGetFbUsage``: pynvml hands a 32-bit ``c_uint`` to a
  function that writes an ``unsigned long long``; :meth:`vgpu_fb_usage`
  calls the C function with its own ``c_ulonglong``.
* Heterogeneous (mixed-size) mode: ``NVML_VGPU_PGPU_HETEROGENEOUS_MODE = 0``
  and ``NVML_VGPU_PGPU_HOMOGENEOUS_MODE = 1`` -- mode 0 means mixed-size ON.
* Scheduler: capabilities' ``min/maxTimeslice`` and the get/set
  ``timeslice`` fields are nanoseconds per the NVML reference; we still derive
  the unit from the capabilities' magnitude (>= 1e6 -> ns, >= 1e3 -> us,
  else ms) and log every value sent.  The *get* struct's ARR arm is
  ``{avgFactor, timeslice}`` (no frequency); the *set* struct's ARR arm is
  ``{avgFactor, frequency}``.  We report ``frequency_hz = 1 s / timeslice``.
  Device-level scheduler calls are NOT_SUPPORTED in MIG mode: pass
  ``gi_id=`` to use the per-GPU-instance calls.
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
import threading
from importlib.metadata import version
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from ..model.concepts import SchedulerPolicy
from ..model.errors import HostEnvironmentError, InputError, TransientError
from ..model.nvml import (DeviceFacts, GiProfile, GpuInstance, SchedulerCaps, SchedulerState,  # noqa: F401
                          bdf_from_nvml, nvml_bus_id)
from ..model.values import PciAddress, mig_memory_gb
from .nvml import NvmlError

log = logging.getLogger("vgpuhost.nvml")

NVML_HINT = "commands that need NVML cannot run here; inventory (vgpuhost gpus) still works"

# NVMLError subclass name -> why NVML as a whole is unusable on this host.
_UNAVAILABLE = {
    "NVMLError_LibraryNotFound": "libnvidia-ml.so.1 not found (no NVIDIA driver)",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded",
    "NVMLError_NoPermission": "no permission to open the NVIDIA devices (run as root)",
    "NVMLError_LibRmVersionMismatch": "libnvidia-ml and the loaded kernel driver differ in version "
                                      "(reload the nvidia modules or reboot)",
}

_ERROR_HINTS = {
    "NVMLError_NotSupported": "not supported by this driver/device (a plain data-centre driver instead "
                              "of the vGPU manager, or a device-level call on a GPU in MIG mode)",
    "NVMLError_InUse": "the GPU is in use (processes, vGPUs or GPU instances hold it)",
    "NVMLError_NoPermission": "run as root",
    "NVMLError_FunctionNotFound": "the installed driver is too old for this call",
    "NVMLError_ResetRequired": "the change needs a GPU reset or reboot",
}

#: what NVMLError_NotSupported from a scheduler set means (docs/reference/hardware.md#vgpu-scheduling)
SET_NOT_SUPPORTED_HINT = ("NVML refuses a vGPU scheduler change with NOT_SUPPORTED while a vGPU instance exists on "
                          "the GPU (remove its vGPUs first), and also in MIG mode before Blackwell and without the "
                          "vGPU manager driver")

POLICY_NAMES = {1: SchedulerPolicy.BEST_EFFORT, 2: SchedulerPolicy.EQUAL_SHARE, 3: SchedulerPolicy.FIXED_SHARE}
POLICY_CODES = {v: k for k, v in POLICY_NAMES.items()}

# NVML_GPU_INSTANCE_PROFILE_* index name suffix -> nvidia-smi profile name suffix
_PROFILE_SUFFIX = (
    ("_REV1", "+me"),
    ("_ALL_ME", "+me.all"),
    ("_NO_ME", "-me"),
    ("_GFX", "+gfx"),
)

_PROFILE_INDEX_RE = re.compile(r"^NVML_GPU_INSTANCE_PROFILE_\d+_SLICE(_[A-Z0-9_]+)?$")

_init_lock = threading.Lock()
_init_done = False


def _import_pynvml():
    try:
        import pynvml  # noqa: WPS433 (lazy on purpose)
    except ImportError:
        raise HostEnvironmentError("NVML is not available: nvidia-ml-py (pynvml) is not installed",
                                   hint=f"pip install nvidia-ml-py; {NVML_HINT}") from None
    return pynvml


def profile_indices(nv) -> List[Tuple[str, int]]:
    """``(name, value)`` of every ``NVML_GPU_INSTANCE_PROFILE_<n>_SLICE*`` index pynvml knows, by value."""
    out = [(attr, getattr(nv, attr)) for attr in dir(nv)
           if _PROFILE_INDEX_RE.match(attr) and isinstance(getattr(nv, attr), int)]
    return sorted(out, key=lambda kv: kv[1])


def profile_name(index_name: str, slices: int, memory_mib: int, reported: Union[str, bytes, None] = None,
                 device_memory_mib: Optional[int] = None) -> str:
    """The nvidia-smi MIG profile name: the driver's own when it gave one, else built.

    Built: ``{slices}g.{GB}gb`` + suffix from the profile index name, where ``GB`` is NVIDIA's:
    the board's memory (``device_memory_mib``, ``nvmlDeviceGetMemoryInfo`` total) times the
    instance's share rounded up to an eighth (:func:`vgpuhost.model.values.mig_memory_gb`, after
    NVIDIA/go-nvlib ``getMigMemorySizeGB``).  A GPU instance has less memory than its name says (a
    real H200: 1g.18gb = 16.00 GiB, 1g.35gb = 32.25 GiB, 3g.71gb = 69.50 GiB, NVIDIA/mig-parted
    issue 120), so ``ceil(memory_mib / 1024)`` is used only when the device memory is unknown.
    """
    if isinstance(reported, bytes):
        reported = reported.decode(errors="replace")
    if reported:
        name = reported.strip()
        if name.upper().startswith("MIG "):
            name = name[4:].strip()
        if name:
            return name
    suffix = ""
    for tail, sfx in _PROFILE_SUFFIX:
        if index_name.endswith(tail):
            suffix = sfx
            break
    gb = (mig_memory_gb(memory_mib, device_memory_mib) if device_memory_mib and device_memory_mib > 0
          else math.ceil(memory_mib / 1024))
    return f"{slices}g.{gb}gb{suffix}"


def timeslice_scale(max_timeslice_raw: int) -> int:
    """Raw timeslice units per millisecond, judged from the capabilities' maximum (~30 ms)."""
    if max_timeslice_raw >= 1_000_000:
        return 1_000_000      # ns (what the NVML reference documents)
    if max_timeslice_raw >= 1_000:
        return 1_000          # us
    return 1                  # ms


_DEFAULT_SCALE = 1_000_000


class PynvmlBackend:
    """:class:`vgpuhost.nvml.NvmlBackend` over ``pynvml``; get one with :meth:`open`."""

    def __init__(self, nv: Any):
        self._nv = nv
        self._handles: Dict[str, Any] = {}
        self._scale: Dict[str, int] = {}
        self._profile_info_version = 2
        self._sched_v2: Dict[str, bool] = {}      # scheduler call -> its _v2 entry point answers here

    # ---------------------------------------------------------------- plumbing

    @classmethod
    def open(cls) -> "PynvmlBackend":
        """Load and initialise NVML (``nvmlInit`` once per process).

        Raises HostEnvironmentError (exit 2) when nvidia-ml-py, the library
        or the driver is missing, or NVML may not be used here.
        """
        global _init_done
        nv = _import_pynvml()
        with _init_lock:
            if not _init_done:
                try:
                    nv.nvmlInit()
                except nv.NVMLError as e:
                    name = type(e).__name__
                    if name in _UNAVAILABLE:
                        # a driver that is not loaded yet (boot) can come up: transient, exit 5
                        cls_ = TransientError if name == "NVMLError_DriverNotLoaded" else HostEnvironmentError
                        raise cls_(f"NVML is not available: {_UNAVAILABLE[name]}", hint=NVML_HINT) from None
                    raise NvmlError("nvmlInit", name, hint=_ERROR_HINTS.get(name)) from None
                except OSError as e:   # a broken library file, not a missing one
                    raise HostEnvironmentError(f"NVML is not available: loading libnvidia-ml failed: {e}",
                                               hint=NVML_HINT) from None
                _init_done = True
                log.debug("nvmlInit done")
        return cls(nv)

    def _call(self, name: str, fn: Callable, *args):
        """Call ``fn(*args)``; an ``NVMLError_*`` becomes NvmlError(name, error class name)."""
        try:
            return fn(*args)
        except self._nv.NVMLError as e:
            err = type(e).__name__
            raise NvmlError(name, err, hint=_ERROR_HINTS.get(err)) from None

    def _fn(self, name: str, *args):
        """Call ``pynvml.<name>(*args)`` through :meth:`_call`."""
        return self._call(name, getattr(self._nv, name), *args)

    def _handle(self, bdf: Union[PciAddress, str]):
        key = nvml_bus_id(bdf)
        h = self._handles.get(key)
        if h is None:
            h = self._fn("nvmlDeviceGetHandleByPciBusId", key)
            self._handles[key] = h
        return h

    def _gi_handle(self, bdf, gi_id: int):
        return self._fn("nvmlDeviceGetGpuInstanceById", self._handle(bdf), gi_id)

    # ------------------------------------------------------------------ device

    def device_name(self, bdf: PciAddress) -> str:
        return self._fn("nvmlDeviceGetName", self._handle(bdf))

    def device_uuid(self, bdf: PciAddress) -> str:
        return self._fn("nvmlDeviceGetUUID", self._handle(bdf))

    # ------------------------------------------------------------------ health

    def gpu_lost(self, bdf: PciAddress) -> bool:
        """Does NVML answer NVML_ERROR_GPU_IS_LOST for this GPU (fell off the bus, inaccessible)?  A fresh
        handle and one cheap query (PCI info) each time: a cached handle of a lost GPU stays valid."""
        try:
            h = self._nv.nvmlDeviceGetHandleByPciBusId(nvml_bus_id(bdf))
            self._nv.nvmlDeviceGetPciInfo(h)
        except self._nv.NVMLError as e:
            return type(e).__name__ == "NVMLError_GpuIsLost"
        return False

    def xid_events(self, bdfs: List[PciAddress], timeout_ms: int) -> List[Tuple[PciAddress, int]]:
        """Critical Xid events of ``bdfs`` waiting in NVML's event set (``nvmlEventTypeXidCriticalError``,
        registered on first call; NVML API reference, Event Handling Methods): ``[(GPU, Xid)]``.  Waits up
        to ``timeout_ms`` for the first event, then takes what is queued without waiting.  A GPU that
        cannot register (NOT_SUPPORTED) is skipped; its health rests on GPU_IS_LOST and the tree."""
        nv = self._nv
        if getattr(self, "_event_set", None) is None:
            self._event_set = self._fn("nvmlEventSetCreate")
            self._event_bdfs: Dict[str, PciAddress] = {}
        for b in bdfs:
            key = nvml_bus_id(b)
            if key in self._event_bdfs:
                continue
            try:
                h = self._handle(b)
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._event_set)
                uuid = self._fn("nvmlDeviceGetUUID", h)
                self._event_bdfs[uuid] = PciAddress.parse(str(b))
                self._event_bdfs[key] = PciAddress.parse(str(b))
            except (NvmlError, nv.NVMLError):
                self._event_bdfs[key] = PciAddress.parse(str(b))
        out: List[Tuple[PciAddress, int]] = []
        wait = max(0, int(timeout_ms))
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, wait)
            except nv.NVMLError as e:
                if type(e).__name__ == "NVMLError_Timeout":
                    return out
                raise NvmlError("nvmlEventSetWait_v2", type(e).__name__) from None
            try:
                uuid = nv.nvmlDeviceGetUUID(data.device)
            except nv.NVMLError:
                uuid = None
            gpu = self._event_bdfs.get(uuid) if uuid else None
            if gpu is not None:
                out.append((gpu, int(data.eventData)))
            wait = 0

    # --------------------------------------------------------------------- MIG

    def mig_mode(self, bdf: PciAddress) -> Optional[Tuple[bool, bool]]:
        """``(current, pending)``; None when the GPU cannot do MIG (NOT_SUPPORTED)."""
        try:
            cur, pend = self._fn("nvmlDeviceGetMigMode", self._handle(bdf))
        except NvmlError as e:
            if e.not_supported:
                return None
            raise
        return bool(cur), bool(pend)

    def set_mig_mode(self, bdf: PciAddress, enabled: bool) -> Tuple[bool, bool]:
        nv = self._nv
        mode = nv.NVML_DEVICE_MIG_ENABLE if enabled else nv.NVML_DEVICE_MIG_DISABLE
        log.info("nvmlDeviceSetMigMode %s mode=%d", bdf, mode)
        status = self._fn("nvmlDeviceSetMigMode", self._handle(bdf), mode)
        log.info("nvmlDeviceSetMigMode %s activation status=%s", bdf, status)
        now = self.mig_mode(bdf)
        if now is None:
            raise NvmlError("nvmlDeviceGetMigMode", "NVMLError_NotSupported",
                            hint=_ERROR_HINTS["NVMLError_NotSupported"])
        return now

    def _profile_indices(self) -> List[Tuple[str, int]]:
        return profile_indices(self._nv)

    def _profile_info(self, handle, index: int):
        """The profile info at ``index``; None when this board has no such profile."""
        try:
            if self._profile_info_version == 2:
                return self._fn("nvmlDeviceGetGpuInstanceProfileInfo", handle, index)
            return self._fn("nvmlDeviceGetGpuInstanceProfileInfo", handle, index, 1)
        except NvmlError as e:
            if e.nvml_name == "NVMLError_FunctionNotFound" and self._profile_info_version == 2:
                self._profile_info_version = 1       # driver without the V entry point
                return self._profile_info(handle, index)
            if e.nvml_name in ("NVMLError_NotSupported", "NVMLError_InvalidArgument", "NVMLError_NotFound"):
                return None
            raise

    def _raw_profiles(self, handle) -> List[Tuple[str, int, Any]]:
        """``(index name, index, info)`` for every profile the device reports, deduplicated by id."""
        seen = set()
        out = []
        for name, index in self._profile_indices():
            info = self._profile_info(handle, index)
            if info is None or info.id in seen:
                continue
            seen.add(info.id)
            out.append((name, index, info))
        return out

    def _placements(self, handle, profile_id: int) -> Tuple[Tuple[int, int], ...]:
        return tuple(sorted(possible_placements(self._fn, self._nv, handle, profile_id)))

    def gi_profiles(self, bdf: PciAddress) -> List[GiProfile]:
        h = self._handle(bdf)
        out = []
        raw = self._raw_profiles(h)
        # the board's memory names a profile the driver left unnamed (v1 struct); asked only then
        total = (self._device_memory_mib(h) if any(not getattr(info, "name", None) for _n, _i, info in raw)
                 else None)
        for index_name, _index, info in raw:
            out.append(GiProfile(
                profile_id=int(info.id),
                name=profile_name(index_name, int(info.sliceCount), int(info.memorySizeMB),
                                  getattr(info, "name", None), total),
                slices=int(info.sliceCount),
                memory_mib=int(info.memorySizeMB),
                max_count=int(info.instanceCount),
                placements=self._placements(h, int(info.id)),
            ))
        return sorted(out, key=lambda p: (-p.slices, -p.memory_mib, p.profile_id))

    def _device_memory_mib(self, handle) -> Optional[int]:
        """``nvmlDeviceGetMemoryInfo`` total in MiB, None when NVML does not say."""
        try:
            return int(self._fn("nvmlDeviceGetMemoryInfo", handle).total) // (1024 * 1024)
        except (NvmlError, AttributeError, TypeError, ValueError):     # no such call, or no number
            return None

    def _gi_from_handle(self, gi) -> GpuInstance:
        info = self._fn("nvmlGpuInstanceGetInfo", gi)
        return GpuInstance(gi_id=int(info.id), profile_id=int(info.profileId),
                           start=int(info.placement.start), size=int(info.placement.size))

    def _gi_handles(self, handle) -> List[Any]:
        nv = self._nv
        out = []
        for _name, _index, info in self._raw_profiles(handle):
            n = max(int(info.instanceCount), 1)
            arr = (nv.c_nvmlGpuInstance_t * n)()
            count = ctypes.c_uint(0)
            self._fn("nvmlDeviceGetGpuInstances", handle, int(info.id), arr, ctypes.byref(count))
            out.extend(arr[i] for i in range(count.value))
        return out

    def gpu_instances(self, bdf: PciAddress) -> List[GpuInstance]:
        h = self._handle(bdf)
        gis = [self._gi_from_handle(gi) for gi in self._gi_handles(h)]
        return sorted(gis, key=lambda g: (g.start, g.gi_id))

    def create_gpu_instance(self, bdf: PciAddress, profile_id: int, start: int) -> GpuInstance:
        nv = self._nv
        h = self._handle(bdf)
        placements = self._placements(h, profile_id)
        size = next((sz for st, sz in placements if st == start), None)
        if size is None:
            starts = ", ".join(str(st) for st, _ in placements) or "none"
            raise InputError(f"profile id {profile_id} cannot start at memory slice {start} on {bdf}",
                             hint=f"possible starts: {starts}")
        placement = nv.c_nvmlGpuInstancePlacement_t(start, size)
        log.info("nvmlDeviceCreateGpuInstanceWithPlacement %s profile_id=%d start=%d size=%d",
                 bdf, profile_id, start, size)
        gi = self._fn("nvmlDeviceCreateGpuInstanceWithPlacement", h, profile_id, ctypes.byref(placement))
        return self._gi_from_handle(gi)

    def destroy_gpu_instance(self, bdf: PciAddress, gi_id: int) -> None:
        gi = self._gi_handle(bdf, gi_id)
        log.info("nvmlGpuInstanceDestroy %s gi_id=%d", bdf, gi_id)
        self._fn("nvmlGpuInstanceDestroy", gi)

    def gpu_instance_vgpus(self, bdf: PciAddress) -> Dict[int, int]:
        """``{gi_id: MIG-backed vGPUs on it}``: ``nvmlVgpuInstanceGetGpuInstanceId`` of each of
        ``nvmlDeviceGetActiveVgpus`` (a time-sliced vGPU answers INVALID_GPU_INSTANCE_ID, 0xFFFFFFFF:
        left out; docs/reference/hardware.md#mig-backed-vgpus)."""
        out: Dict[int, int] = {}
        for inst in self._fn("nvmlDeviceGetActiveVgpus", self._handle(bdf)):
            gi = int(self._fn("nvmlVgpuInstanceGetGpuInstanceId", inst))
            if gi in (0xFFFFFFFF, -1):
                continue
            out[gi] = out.get(gi, 0) + 1
        return out

    def compute_processes(self, bdf: PciAddress) -> int:
        return len(self._fn("nvmlDeviceGetComputeRunningProcesses", self._handle(bdf)))

    # -------------------------------------------------------------------- vGPU

    def active_vgpus(self, bdf: PciAddress) -> int:
        return len(self._fn("nvmlDeviceGetActiveVgpus", self._handle(bdf)))

    def heterogeneous_mode(self, bdf: PciAddress) -> bool:
        mode = self._fn("nvmlDeviceGetVgpuHeterogeneousMode", self._handle(bdf))
        return int(mode) == self._nv.NVML_VGPU_PGPU_HETEROGENEOUS_MODE

    def set_heterogeneous_mode(self, bdf: PciAddress, enabled: bool) -> None:
        nv = self._nv
        mode = nv.NVML_VGPU_PGPU_HETEROGENEOUS_MODE if enabled else nv.NVML_VGPU_PGPU_HOMOGENEOUS_MODE
        log.info("nvmlDeviceSetVgpuHeterogeneousMode %s mode=%d (%s)", bdf, mode,
                 "heterogeneous" if enabled else "homogeneous")
        self._fn("nvmlDeviceSetVgpuHeterogeneousMode", self._handle(bdf), mode)

    def vgpu_fb_usage(self, vgpu_instance) -> int:
        """Framebuffer bytes used by a vGPU instance.

        pynvml's ``nvmlVgpuInstanceGetFbUsage`` passes a 32-bit ``c_uint`` to a
        function writing an ``unsigned long long``: call the C function with a
        ``c_ulonglong`` of our own.
        """
        nv = self._nv
        usage = ctypes.c_ulonglong(0)

        def call():
            fn = nv._nvmlGetFunctionPointer("nvmlVgpuInstanceGetFbUsage")
            nv._nvmlCheckReturn(fn(vgpu_instance, ctypes.byref(usage)))

        self._call("nvmlVgpuInstanceGetFbUsage", call)
        return int(usage.value)

    def vgpu_utilization(self, bdf: Union[PciAddress, str], last_seen_us: int) -> Tuple[int, List[Any], str]:
        """The per-vGPU utilisation samples of GPU ``bdf`` newer than ``last_seen_us`` (NVML's CPU
        timestamp, microseconds; 0: the driver's whole buffer), with the ``nvmlValueType_t`` the
        driver filled them in: ``(value_type, samples, call)``.

        pynvml's wrappers drop ``sampleValType``, so the C functions are called here, count first
        (no array: NVML_SUCCESS means no sample, NVMLError_InsufficientSize gives the count), then
        with an array of that size (nvml.h, nvidia-ml-py 13.x):
        ``nvmlDeviceGetVgpuInstancesUtilizationInfo(dev, *nvmlVgpuInstancesUtilizationInfo_v1_t)``
        (R550+; the struct carries ``sampleValType``), else, on NVMLError_FunctionNotFound or
        NotSupported, ``nvmlDeviceGetVgpuUtilization(dev, lastSeen, *sampleValType, *count,
        *samples)``.  ``call`` names the one that answered.  Raises NvmlError.
        """
        nv, h = self._nv, self._handle(bdf)
        try:
            vt, rows = self._call("nvmlDeviceGetVgpuInstancesUtilizationInfo",
                                  lambda: _utilization_info_v1(nv, h, int(last_seen_us)))
            return vt, rows, "nvmlDeviceGetVgpuInstancesUtilizationInfo"
        except NvmlError as e:
            if e.nvml_name not in ("NVMLError_FunctionNotFound", "NVMLError_NotSupported"):
                raise
        vt, rows = self._call("nvmlDeviceGetVgpuUtilization", lambda: _utilization_v0(nv, h, int(last_seen_us)))
        return vt, rows, "nvmlDeviceGetVgpuUtilization"

    # --------------------------------------------------------------- scheduler

    def _raw_scheduler_caps(self, bdf):
        return self._fn("nvmlDeviceGetVgpuSchedulerCapabilities", self._handle(bdf))

    def _timeslice_scale(self, bdf) -> int:
        key = nvml_bus_id(bdf)
        if key not in self._scale:
            try:
                caps = self._raw_scheduler_caps(bdf)
                scale = timeslice_scale(int(caps.maxTimeslice)) if caps.maxTimeslice else _DEFAULT_SCALE
            except NvmlError:
                scale = _DEFAULT_SCALE
            self._scale[key] = scale
            log.debug("scheduler timeslice unit on %s: %d per ms", key, scale)
        return self._scale[key]

    def scheduler_caps(self, bdf: PciAddress) -> SchedulerCaps:
        c = self._raw_scheduler_caps(bdf)
        scale = timeslice_scale(int(c.maxTimeslice)) if c.maxTimeslice else _DEFAULT_SCALE
        self._scale[nvml_bus_id(bdf)] = scale
        policies = tuple(POLICY_NAMES[int(p)] for p in c.supportedSchedulers if int(p) in POLICY_NAMES)
        d = SchedulerCaps(policies=(), arr_supported=False)   # the documented defaults

        def pick(raw: int, default: int) -> int:
            return int(raw) if raw else default

        return SchedulerCaps(
            policies=policies,
            arr_supported=bool(c.isArrModeSupported),
            min_timeslice_ms=pick(math.ceil(c.minTimeslice / scale), d.min_timeslice_ms),
            max_timeslice_ms=pick(c.maxTimeslice // scale, d.max_timeslice_ms),
            min_frequency_hz=pick(c.minFrequencyForARR, d.min_frequency_hz),
            max_frequency_hz=pick(c.maxFrequencyForARR, d.max_frequency_hz),
            min_avg_factor=pick(c.minAvgFactorForARR, d.min_avg_factor),
            max_avg_factor=pick(c.maxAvgFactorForARR, d.max_avg_factor),
        )

    def _raw_scheduler_state(self, bdf, gi_id: Optional[int] = None):
        nv = self._nv
        if gi_id is None:
            return self._fn("nvmlDeviceGetVgpuSchedulerState", self._handle(bdf))
        info = nv.c_nvmlVgpuSchedulerStateInfo_v1_t()
        info.version = nv.nvmlVgpuSchedulerStateInfo_v1
        info.engineId = nv.NVML_VGPU_SCHEDULER_ENGINE_TYPE_GRAPHICS
        return self._fn("nvmlGpuInstanceGetVgpuSchedulerState", self._gi_handle(bdf, gi_id), info)

    def _v2(self, name: str, *args):
        """``pynvml.<name>_v2(*args)``, or None where pynvml or the driver lacks it (the v1 call is the
        fallback: a pynvml older than 13 has no such attribute, a driver older than R580 answers
        NVMLError_FunctionNotFound, remembered per call)."""
        v2 = name + "_v2"
        if self._sched_v2.get(v2) is False or not hasattr(self._nv, v2):
            return None
        try:
            out = self._fn(v2, *args)
        except NvmlError as e:
            if e.nvml_name != "NVMLError_FunctionNotFound":
                raise
            self._sched_v2[v2] = False
            log.debug("%s: not in this driver; using %s", v2, name)
            return None
        self._sched_v2[v2] = True
        return out if out is not None else True

    def _scheduler_state_v2(self, bdf, gi_id: Optional[int]) -> Optional[SchedulerState]:
        """The state through ``nvml{Device,GpuInstance}GetVgpuSchedulerState_v2`` (NVML 13; struct
        ``{engineId, schedulerPolicy, avgFactor, timeslice}``, no ARR mode); None when unavailable.
        ARR counts as on when the averaging factor is non-zero (``timeslice`` is then the ARR period)."""
        nv = self._nv
        if not hasattr(nv, "c_nvmlVgpuSchedulerStateInfo_v2_t"):
            return None
        info = nv.c_nvmlVgpuSchedulerStateInfo_v2_t()
        info.engineId = nv.NVML_VGPU_SCHEDULER_ENGINE_TYPE_GRAPHICS
        if gi_id is None:
            got = self._v2("nvmlDeviceGetVgpuSchedulerState", self._handle(bdf), info)
        else:
            got = self._v2("nvmlGpuInstanceGetVgpuSchedulerState", self._gi_handle(bdf, gi_id), info)
        if got is None:
            return None
        policy = POLICY_NAMES.get(int(info.schedulerPolicy), "unknown")
        if policy in (SchedulerPolicy.BEST_EFFORT, "unknown"):
            return SchedulerState(policy=policy)
        scale, ts, avg = self._timeslice_scale(bdf), int(info.timeslice), int(info.avgFactor)
        if avg:
            return SchedulerState(policy=policy, arr=True, frequency_hz=round(scale * 1000 / ts) if ts else None,
                                  avg_factor=avg)
        return SchedulerState(policy=policy, arr=False, timeslice_ms=round(ts / scale) if ts else None)

    def scheduler_state(self, bdf: PciAddress, gi_id: Optional[int] = None) -> SchedulerState:
        """The scheduler of the GPU, or of GPU instance ``gi_id`` (MIG mode, Blackwell and newer).

        The ``_v2`` call first (the v1 calls are deprecated in NVML 13), v1 where the driver or
        pynvml lacks it (docs/reference/hardware.md#nvml).  ``policy`` is ``"unknown"`` when NVML
        reports policy 0.  v1: ARR counts as on when NVML says ENABLE, or says DEFAULT for equal/fixed
        share with a non-zero averaging factor (ARR is the default there since vGPU 15).
        """
        nv = self._nv
        v2 = self._scheduler_state_v2(bdf, gi_id)
        if v2 is not None:
            return v2
        s = self._raw_scheduler_state(bdf, gi_id)
        policy = POLICY_NAMES.get(int(s.schedulerPolicy), "unknown")
        if policy in (SchedulerPolicy.BEST_EFFORT, "unknown"):
            return SchedulerState(policy=policy)
        scale = self._timeslice_scale(bdf)
        with_arr = s.schedulerParams.vgpuSchedDataWithARR
        arr_mode = int(s.arrMode)
        arr = arr_mode == nv.NVML_VGPU_SCHEDULER_ARR_ENABLE or (
            arr_mode == nv.NVML_VGPU_SCHEDULER_ARR_DEFAULT and int(with_arr.avgFactor) != 0)
        if arr:
            ts = int(with_arr.timeslice)
            freq = round(scale * 1000 / ts) if ts else None
            return SchedulerState(policy=policy, arr=True, frequency_hz=freq,
                                  avg_factor=int(with_arr.avgFactor) or None)
        ts = int(s.schedulerParams.vgpuSchedData.timeslice)
        return SchedulerState(policy=policy, arr=False, timeslice_ms=round(ts / scale) if ts else None)

    def _set_scheduler_v2(self, bdf, state: SchedulerState, gi_id: Optional[int]) -> bool:
        """Send ``state`` through ``nvml{Device,GpuInstance}SetVgpuSchedulerState_v2`` (struct
        ``{engineId, schedulerPolicy, avgFactor, frequency}``: it cannot turn ARR off, so a state
        without ARR goes through v1).  False when the ``_v2`` call is not available here."""
        nv = self._nv
        if (state.policy != SchedulerPolicy.BEST_EFFORT and not state.arr) \
                or not hasattr(nv, "c_nvmlVgpuSchedulerState_v2_t"):
            return False
        st = nv.c_nvmlVgpuSchedulerState_v2_t()
        st.engineId = nv.NVML_VGPU_SCHEDULER_ENGINE_TYPE_GRAPHICS
        st.schedulerPolicy = POLICY_CODES[state.policy]
        st.avgFactor = int(state.avg_factor or 0)
        st.frequency = int(state.frequency_hz or 0)
        where = f"{bdf}" if gi_id is None else f"{bdf} gi {gi_id}"
        log.info("vGPU scheduler set (v2) on %s: policy=%d (%s) avgFactor=%d frequency=%d Hz",
                 where, st.schedulerPolicy, state.policy, st.avgFactor, st.frequency)
        if gi_id is None:
            return self._v2("nvmlDeviceSetVgpuSchedulerState", self._handle(bdf), st) is not None
        return self._v2("nvmlGpuInstanceSetVgpuSchedulerState", self._gi_handle(bdf, gi_id), st) is not None

    def set_scheduler_state(self, bdf: PciAddress, state: SchedulerState, gi_id: Optional[int] = None) -> None:
        """Send ``state`` (device-level, or GPU instance ``gi_id`` in MIG mode on Blackwell and newer).

        The ``_v2`` call where the driver and pynvml have it and the state has ARR or is best effort;
        else v1 (docs/reference/hardware.md#nvml).  Missing parameters are sent as 0, which NVML takes
        as "default".  NVMLError_NotSupported keeps its name, with a hint that it also means a vGPU
        instance exists on the GPU (docs/reference/hardware.md#vgpu-scheduling).
        """
        if state.policy not in POLICY_CODES:
            raise InputError(f"unknown scheduler policy {state.policy!r}",
                             hint="one of " + ", ".join(POLICY_CODES))
        try:
            if not self._set_scheduler_v2(bdf, state, gi_id):
                self._set_scheduler_v1(bdf, state, gi_id)
        except NvmlError as e:
            if not e.not_supported:
                raise
            raise NvmlError(e.call, e.nvml_name, hint=SET_NOT_SUPPORTED_HINT) from None

    def _set_scheduler_v1(self, bdf, state: SchedulerState, gi_id: Optional[int]) -> None:
        nv = self._nv
        if gi_id is None:
            st = nv.c_nvmlVgpuSchedulerSetState_t()
        else:
            st = nv.c_nvmlVgpuSchedulerState_v1_t()
            st.version = nv.nvmlVgpuSchedulerState_v1
            st.engineId = nv.NVML_VGPU_SCHEDULER_ENGINE_TYPE_GRAPHICS
        st.schedulerPolicy = POLICY_CODES[state.policy]
        if state.policy == SchedulerPolicy.BEST_EFFORT:
            st.enableARRMode = nv.NVML_VGPU_SCHEDULER_ARR_DEFAULT
            sent = "no parameters"
        elif state.arr:
            st.enableARRMode = nv.NVML_VGPU_SCHEDULER_ARR_ENABLE
            st.schedulerParams.vgpuSchedDataWithARR.avgFactor = int(state.avg_factor or 0)
            st.schedulerParams.vgpuSchedDataWithARR.frequency = int(state.frequency_hz or 0)
            sent = (f"avgFactor={st.schedulerParams.vgpuSchedDataWithARR.avgFactor} "
                    f"frequency={st.schedulerParams.vgpuSchedDataWithARR.frequency} Hz")
        else:
            st.enableARRMode = nv.NVML_VGPU_SCHEDULER_ARR_DISABLE
            scale = self._timeslice_scale(bdf)
            raw = int(state.timeslice_ms or 0) * scale
            st.schedulerParams.vgpuSchedData.timeslice = raw
            unit = {1_000_000: "ns", 1_000: "us", 1: "ms"}[scale]
            sent = f"timeslice={raw} {unit} ({state.timeslice_ms} ms)"
        where = f"{bdf}" if gi_id is None else f"{bdf} gi {gi_id}"
        log.info("vGPU scheduler set on %s: policy=%d (%s) enableARRMode=%d %s",
                 where, st.schedulerPolicy, state.policy, st.enableARRMode, sent)
        if gi_id is None:
            self._fn("nvmlDeviceSetVgpuSchedulerState", self._handle(bdf), st)
        else:
            self._fn("nvmlGpuInstanceSetVgpuSchedulerState", self._gi_handle(bdf, gi_id), st)

    # ------------------------------------------------------------------- probe

    def device_facts(self, bdf: PciAddress) -> DeviceFacts:
        mig = self.mig_mode(bdf)
        return DeviceFacts(bdf=str(bdf), name=self.device_name(bdf), uuid=self.device_uuid(bdf), mig_mode=mig,
                           gi_profiles=self.gi_profiles(bdf) if mig and mig[0] else [],
                           gpu_instances=self.gpu_instances(bdf) if mig and mig[0] else [])

    def probe(self, bdfs: Optional[Iterable[Union[PciAddress, str]]] = None) -> List[dict]:
        """Read-only facts for every GPU (or ``bdfs``); see :func:`probe`."""
        return probe(self, bdfs)


# ----------------------------------------------------------------------- probe
#
# Everything below only reads.  Every NVML function goes through _Reader.get,
# which refuses names containing a mutating verb, so the probe cannot change
# device state even by mistake (tests also trap every mutating pynvml entry).

FORBIDDEN_VERBS = ("Set", "Create", "Destroy", "Reset", "Clear", "Enable", "Disable", "Register",
                   "Unregister", "Issue", "Apply", "Flush", "Stop", "Start", "Remove", "Discover",
                   "Modify", "Write", "Inject")
_FORBIDDEN_RE = re.compile("|".join(FORBIDDEN_VERBS))


def is_mutating(nvml_name: str) -> bool:
    """True when an NVML entry point's name carries a mutating verb."""
    return bool(_FORBIDDEN_RE.search(nvml_name[4:] if nvml_name.startswith("nvml") else nvml_name))


def _enum_name(nv, prefix: str, value: int) -> Optional[str]:
    for attr in dir(nv):
        if attr.startswith(prefix) and getattr(nv, attr) == value:
            return attr
    return None


class _Reader:
    def __init__(self, nv):
        self.nv = nv

    def get(self, name: str, *args):
        if is_mutating(name):
            raise AssertionError(f"probe must not call {name}")
        try:
            return getattr(self.nv, name)(*args)
        except self.nv.NVMLError as e:
            raise NvmlError(name, type(e).__name__) from None

    def c_call(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, a read that calls NVML's C function ``name`` itself (as
        :func:`_utilization_v0` does); refused like :meth:`get` when ``name`` mutates."""
        if is_mutating(name):
            raise AssertionError(f"probe must not call {name}")
        try:
            return fn()
        except self.nv.NVMLError as e:
            raise NvmlError(name, type(e).__name__) from None

    def attempt(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, or ``{"error": "NVMLError_..."}`` when it fails."""
        try:
            return fn()
        except NvmlError as e:
            return {"error": e.nvml_name, "call": e.call}


def _text(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _struct(obj) -> dict:
    """A ctypes struct/union as a plain dict (nested structs and arrays included)."""
    out = {}
    for fname, _ftype in getattr(obj, "_fields_", ()):
        v = getattr(obj, fname)
        if isinstance(v, (ctypes.Structure, ctypes.Union)):
            out[fname] = _struct(v)
        elif isinstance(v, ctypes.Array):
            out[fname] = [_struct(x) if isinstance(x, (ctypes.Structure, ctypes.Union)) else x for x in v]
        elif isinstance(v, bytes):
            out[fname] = _text(v)
        elif isinstance(v, (int, float, str)) or v is None:
            out[fname] = v
        else:
            out[fname] = repr(v)
    return out


def possible_placements(call: Callable[..., Any], nv, handle, profile_id: int) -> List[Tuple[int, int]]:
    """``[(start, size)]`` of a GPU instance profile's possible placements, in NVML's order (slices).

    ``nvmlDeviceGetGpuInstancePossiblePlacements`` is asked twice: first with no array, for the
    count (NVMLError_InsufficientSize when there are some), then with an array of that size (nvml.h).
    ``call(name, *args)``: the caller's NVML call (its error mapping); ``nv``: the pynvml module."""
    count = ctypes.c_uint(0)
    try:
        call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id, None, ctypes.byref(count))
    except NvmlError as e:
        if e.nvml_name != "NVMLError_InsufficientSize":
            raise
    if count.value == 0:
        return []
    arr = (nv.c_nvmlGpuInstancePlacement_t * count.value)()
    call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id, arr, ctypes.byref(count))
    return [(int(arr[i].start), int(arr[i].size)) for i in range(count.value)]

def _dist_version(dist: str) -> Optional[str]:
    try:
        return version(dist)
    except Exception:   # not installed as a distribution (vendored pynvml.py)
        return None


def system_facts(backend: PynvmlBackend) -> dict:
    """Driver/NVML versions (read-only)."""
    r = _Reader(backend._nv)
    return {
        "nvidia_ml_py_version": _dist_version("nvidia-ml-py"),
        "driver_version": r.attempt(lambda: _text(r.get("nvmlSystemGetDriverVersion"))),
        "nvml_version": r.attempt(lambda: _text(r.get("nvmlSystemGetNVMLVersion"))),
        "device_count": r.attempt(lambda: r.get("nvmlDeviceGetCount")),
    }


def probe(backend: PynvmlBackend, bdfs: Optional[Iterable[Union[PciAddress, str]]] = None) -> List[dict]:
    """Read-only facts about every GPU (or the ones in ``bdfs``), one dict each.

    Each failing call is recorded in place as ``{"error": "NVMLError_...", "call": ...}``.
    """
    nv = backend._nv
    r = _Reader(nv)
    if bdfs is None:
        # Enumerate by index only to learn bus ids; everything after works by bus id.
        ids = []
        count = r.attempt(lambda: r.get("nvmlDeviceGetCount"))
        if isinstance(count, dict):
            return [{"error": count["error"], "call": count["call"]}]
        for i in range(count):
            pci = r.attempt(lambda i=i: r.get("nvmlDeviceGetPciInfo", r.get("nvmlDeviceGetHandleByIndex", i)))
            if isinstance(pci, dict) and "error" in pci:
                ids.append({"index": i, **pci})
            else:
                ids.append(bdf_from_nvml(pci.busId))
    else:
        ids = [str(b) for b in bdfs]
    out = []
    for bdf in ids:
        if isinstance(bdf, dict):
            out.append(bdf)
            continue
        out.append(_probe_device(r, bdf))
    return out


def _probe_device(r: _Reader, bdf: str) -> dict:
    """One GPU's read-only facts (:func:`probe`): its identity and modes, MIG GPU-instance
    profiles, vGPU scheduler, vGPU types and running vGPUs, in that order, each failing call
    recorded in place, then ``gi_profile_ids`` (``{profile name: id}``, from
    nvmlDeviceGetGpuInstanceProfileInfo(V) per profile index) and ``metering``
    (:func:`_probe_metering`).  Only ``bdf``, ``nvml_bus_id`` and ``handle`` when no handle is had."""
    dev: Dict[str, Any] = {"bdf": bdf, "nvml_bus_id": nvml_bus_id(bdf)}
    h = r.attempt(lambda: r.get("nvmlDeviceGetHandleByPciBusId", nvml_bus_id(bdf)))
    if isinstance(h, dict) and "error" in h:
        dev["handle"] = h
        return dev
    dev.update(_probe_modes(r, h))
    dev["gi_profiles"] = [e for e in (_probe_gi_profile(r, h, name, index) for name, index in profile_indices(r.nv))
                          if e is not None]
    dev["gi_profile_ids"] = {p["profile_name"]: p["id"] for p in dev["gi_profiles"] if "profile_name" in p}
    dev.update(_probe_vgpus(r, h))
    dev["metering"] = _probe_metering(r, h)
    return dev


def _probe_metering(r: _Reader, h) -> Dict[str, Any]:
    """The metering calls on handle ``h``, read only: the ``nvmlValueType_t`` each utilisation
    call reports (with the count of samples since lastSeen 0) and whether GPM is supported."""
    nv, a = r.nv, r.attempt

    def util(name: str, fn: Callable[..., Tuple[int, List[Any]]]):
        vt, rows = r.c_call(name, lambda: fn(nv, h, 0))
        return {"sample_value_type": vt, "name": _enum_name(nv, "NVML_VALUE_TYPE_", vt), "samples": len(rows)}
    return {
        "nvmlDeviceGetVgpuInstancesUtilizationInfo": a(lambda: util("nvmlDeviceGetVgpuInstancesUtilizationInfo",
                                                                    _utilization_info_v1)),
        "nvmlDeviceGetVgpuUtilization": a(lambda: util("nvmlDeviceGetVgpuUtilization", _utilization_v0)),
        "nvmlGpmQueryDeviceSupport": a(lambda: {"isSupportedDevice": int(
            r.get("nvmlGpmQueryDeviceSupport", h).isSupportedDevice)}),
    }


def _probe_modes(r: _Reader, h) -> Dict[str, Any]:
    """``name``, ``uuid``, ``pci`` and the MIG, host vGPU, virtualization and heterogeneous modes of handle ``h``."""
    nv, a = r.nv, r.attempt
    dev: Dict[str, Any] = {}
    dev["name"] = a(lambda: _text(r.get("nvmlDeviceGetName", h)))
    dev["uuid"] = a(lambda: _text(r.get("nvmlDeviceGetUUID", h)))

    def pci():
        p = r.get("nvmlDeviceGetPciInfo", h)
        return {"busId": _text(p.busId), "pciDeviceId": f"0x{p.pciDeviceId:08x}",
                "pciSubSystemId": f"0x{p.pciSubSystemId:08x}"}
    dev["pci"] = a(pci)

    def mig():
        cur, pend = r.get("nvmlDeviceGetMigMode", h)
        return {"current": int(cur), "pending": int(pend)}
    dev["mig_mode"] = a(mig)

    def host_mode():
        v = int(r.get("nvmlDeviceGetHostVgpuMode", h))
        return {"value": v, "name": _enum_name(nv, "NVML_HOST_VGPU_MODE_", v)}
    dev["host_vgpu_mode"] = a(host_mode)

    def virt_mode():
        v = int(r.get("nvmlDeviceGetVirtualizationMode", h))
        return {"value": v, "name": _enum_name(nv, "NVML_GPU_VIRTUALIZATION_MODE_", v)}
    dev["virtualization_mode"] = a(virt_mode)

    def het():
        v = int(r.get("nvmlDeviceGetVgpuHeterogeneousMode", h))
        return {"value": v, "heterogeneous": v == nv.NVML_VGPU_PGPU_HETEROGENEOUS_MODE}
    dev["heterogeneous_mode"] = a(het)
    return dev


def _probe_gi_profile(r: _Reader, h, index_name: str, index: int) -> Optional[Dict[str, Any]]:
    """One MIG GPU-instance profile of handle ``h``: its info, name, possible placements, remaining
    capacity and GPU instances (each with its vGPU scheduler state); None when the device does not
    have it (NotSupported, InvalidArgument, NotFound), the error in place for any other failure."""
    nv, a = r.nv, r.attempt
    entry: Dict[str, Any] = {"index": index, "index_name": index_name}
    info = a(lambda: r.get("nvmlDeviceGetGpuInstanceProfileInfo", h, index))
    if isinstance(info, dict):
        if info.get("error") in ("NVMLError_NotSupported", "NVMLError_InvalidArgument", "NVMLError_NotFound"):
            return None
        entry.update(info)
        return entry
    entry.update(_struct(info))
    entry["profile_name"] = profile_name(index_name, int(info.sliceCount), int(info.memorySizeMB),
                                         getattr(info, "name", None))
    pid = int(info.id)

    entry["placements"] = a(lambda: [list(p) for p in possible_placements(r.get, nv, h, pid)])
    entry["remaining_capacity"] = a(lambda: r.get("nvmlDeviceGetGpuInstanceRemainingCapacity", h, pid))

    def instances(n=max(int(info.instanceCount), 1)):
        arr = (nv.c_nvmlGpuInstance_t * n)()
        count = ctypes.c_uint(0)
        r.get("nvmlDeviceGetGpuInstances", h, pid, arr, ctypes.byref(count))
        gis = []
        for i in range(count.value):
            gi = arr[i]
            gii = r.get("nvmlGpuInstanceGetInfo", gi)
            g = {"id": int(gii.id), "profileId": int(gii.profileId),
                 "placement": [int(gii.placement.start), int(gii.placement.size)]}
            g["scheduler_state"] = a(lambda gi=gi: _gi_sched_state(r, gi))
            gis.append(g)
        return gis
    entry["gpu_instances"] = a(instances)
    return entry


def _probe_vgpus(r: _Reader, h) -> Dict[str, Any]:
    """The vGPU side of handle ``h``: scheduler capabilities and state, supported and creatable vGPU
    types (name, class, framebuffer in bytes, max instances, GI profile id) and the running vGPUs
    (UUID, type, framebuffer used in bytes)."""
    a = r.attempt
    dev: Dict[str, Any] = {}
    dev["scheduler_capabilities"] = a(lambda: _struct(r.get("nvmlDeviceGetVgpuSchedulerCapabilities", h)))
    dev["scheduler_state"] = a(lambda: _struct(r.get("nvmlDeviceGetVgpuSchedulerState", h)))

    def vgpu_types(call):
        types = []
        for tid in r.get(call, h):
            t = int(getattr(tid, "value", tid))
            types.append({
                "type_id": t,
                "name": a(lambda t=t: _text(r.get("nvmlVgpuTypeGetName", t))),
                "class": a(lambda t=t: _text(r.get("nvmlVgpuTypeGetClass", t))),
                "framebuffer_bytes": a(lambda t=t: int(r.get("nvmlVgpuTypeGetFramebufferSize", t))),
                "max_instances": a(lambda t=t: int(r.get("nvmlVgpuTypeGetMaxInstances", h, t))),
                "gpu_instance_profile_id": a(lambda t=t: int(r.get("nvmlVgpuTypeGetGpuInstanceProfileId", t))),
            })
        return types
    dev["supported_vgpu_types"] = a(lambda: vgpu_types("nvmlDeviceGetSupportedVgpus"))
    dev["creatable_vgpu_types"] = a(lambda: vgpu_types("nvmlDeviceGetCreatableVgpus"))

    def active():
        out = []
        for inst in r.get("nvmlDeviceGetActiveVgpus", h):
            i = int(getattr(inst, "value", inst))
            out.append({
                "instance": i,
                "uuid": a(lambda i=i: _text(r.get("nvmlVgpuInstanceGetUUID", i))),
                "type_id": a(lambda i=i: int(r.get("nvmlVgpuInstanceGetType", i))),
                "fb_usage_bytes": a(lambda i=i: _fb_usage(r, i)),
            })
        return out
    dev["active_vgpus"] = a(active)
    return dev


def _gi_sched_state(r: _Reader, gi) -> dict:
    nv = r.nv
    info = nv.c_nvmlVgpuSchedulerStateInfo_v1_t()
    info.version = nv.nvmlVgpuSchedulerStateInfo_v1
    info.engineId = nv.NVML_VGPU_SCHEDULER_ENGINE_TYPE_GRAPHICS
    return _struct(r.get("nvmlGpuInstanceGetVgpuSchedulerState", gi, info))


def _fb_usage(r: _Reader, instance: int) -> int:
    """The FB-usage 64-bit quirk, read-only path (see PynvmlBackend.vgpu_fb_usage)."""
    nv = r.nv
    usage = ctypes.c_ulonglong(0)
    try:
        fn = nv._nvmlGetFunctionPointer("nvmlVgpuInstanceGetFbUsage")
        nv._nvmlCheckReturn(fn(instance, ctypes.byref(usage)))
    except nv.NVMLError as e:
        raise NvmlError("nvmlVgpuInstanceGetFbUsage", type(e).__name__) from None
    return int(usage.value)


# ------------------------------------------------------- utilisation, by the C calls
#
# pynvml's nvmlDeviceGetVgpuUtilization and nvmlDeviceGetVgpuInstancesUtilizationInfo fill the
# driver's nvmlValueType_t and drop it; these two keep it (PynvmlBackend.vgpu_utilization).

def _utilization_info_v1(nv, handle, last_seen_us: int) -> Tuple[int, List[Any]]:
    """``(sampleValType, samples)`` of ``nvmlDeviceGetVgpuInstancesUtilizationInfo`` (v1 struct)."""
    fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetVgpuInstancesUtilizationInfo")
    info = nv.c_nvmlVgpuInstancesUtilizationInfo_v1_t()
    info.version = nv.VgpuInstancesUtilizationInfo_v1
    info.lastSeenTimeStamp = last_seen_us
    info.vgpuInstanceCount = 0
    ret = fn(handle, ctypes.byref(info))
    if ret == nv.NVML_SUCCESS:
        return int(info.sampleValType), []
    if ret != nv.NVML_ERROR_INSUFFICIENT_SIZE:
        raise nv.NVMLError(ret)
    arr = (nv.c_nvmlVgpuInstanceUtilizationInfo_v1_t * int(info.vgpuInstanceCount))()
    info.vgpuUtilArray = arr
    nv._nvmlCheckReturn(fn(handle, ctypes.byref(info)))
    return int(info.sampleValType), list(arr[:int(info.vgpuInstanceCount)])


def _utilization_v0(nv, handle, last_seen_us: int) -> Tuple[int, List[Any]]:
    """``(sampleValType, samples)`` of ``nvmlDeviceGetVgpuUtilization``."""
    fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetVgpuUtilization")
    value_type = ctypes.c_uint(0)
    count = ctypes.c_uint(0)
    stamp = ctypes.c_ulonglong(last_seen_us)
    ret = fn(handle, stamp, ctypes.byref(value_type), ctypes.byref(count), None)
    if ret == nv.NVML_SUCCESS:
        return int(value_type.value), []
    if ret != nv.NVML_ERROR_INSUFFICIENT_SIZE:
        raise nv.NVMLError(ret)
    arr = (nv.c_nvmlVgpuInstanceUtilizationSample_t * count.value)()
    nv._nvmlCheckReturn(fn(handle, stamp, ctypes.byref(value_type), ctypes.byref(count), arr))
    return int(value_type.value), list(arr[:count.value])
