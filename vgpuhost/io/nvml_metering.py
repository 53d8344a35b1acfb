"""The NVML door for metering: per-vGPU identity, utilisation, framebuffer, licence, GPM.

Owns: the read-only :class:`MeteringNvml` interface the sampler
(:mod:`vgpuhost.ops.metering`) uses, its real implementation
:class:`PynvmlMetering` over nvidia-ml-py (through
:class:`~vgpuhost.io.nvml_pynvml.PynvmlBackend`'s call wrapper, so
``NVMLError_*`` become :class:`~vgpuhost.io.nvml.NvmlError` the same way),
while the simulator's is :class:`vgpuhost.sim.metering.SimMetering`
(:func:`vgpuhost.io.backends.metering_nvml` picks one).  Kept apart from
:mod:`vgpuhost.io.nvml` so the device-changing door stays small.
Must not: change anything on a GPU (every call here only reads), decide
policy, or be imported by the hook path.

Units: timestamps are NVML's CPU timestamps in microseconds since the epoch;
utilisation is percent (0-100) of the sample period; framebuffer is bytes.

NVML facts used (nvidia-ml-py 13.x ``pynvml.py`` and the NVML API reference,
"vGPU Management" and "GPM" chapters):

* ``nvmlDeviceGetActiveVgpus(dev)`` lists the vGPU instances a *running* VM
  holds; an mdev that no VM has opened is not active and has no samples.
* ``nvmlVgpuInstanceGetMdevUUID`` gives the mdev UUID (classic mdev);
  ``nvmlVgpuInstanceGetVmID`` gives ``(id, type)``; on KVM the type is
  ``NVML_VGPU_VM_ID_UUID`` and the id is the libvirt domain UUID.
* ``nvmlDeviceGetVgpuInstancesUtilizationInfo`` (v1 struct, driver R550+)
  and the older ``nvmlDeviceGetVgpuUtilization`` return one sample per
  active vGPU newer than ``lastSeenTimeStamp``: SM, memory, encoder and
  decoder utilisation in percent; we try the first and fall back to the
  second on ``NVMLError_FunctionNotFound``/``NotSupported``.
* ``nvmlVgpuInstanceGetFbUsage`` writes an ``unsigned long long``; pynvml
  binds it as ``c_uint`` and keeps only the low 32 bits, so we use
  :meth:`PynvmlBackend.vgpu_fb_usage`, which passes a ``c_ulonglong``.
* ``nvmlVgpuInstanceGetLicenseInfo_v2`` (``isLicensed``, ``currentState``
  ``NVML_GRID_LICENSE_STATE_*``).
* GPM (Hopper and newer): ``nvmlGpmQueryDeviceSupport``, two
  ``nvmlGpmMigSampleGet`` samples of a GPU instance, and
  ``nvmlGpmMetricsGet`` with ``NVML_GPM_METRIC_SM_UTIL`` give the SM
  utilisation of one GPU instance between the two samples.
* A passed-through GPU is not visible to the host's NVML at all: it is
  metered by allocation time only (the sampler reads vgpuhost's records).
"""

from __future__ import annotations

import calendar
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Tuple

from ..model.nvml import GPM_UNKNOWN_SHARE, VALUE_TYPE_FIELDS, gpm_not_metered, no_mdev_uuid
from .nvml import NvmlError
from .nvml_pynvml import bdf_from_nvml, profile_name

#: licence states as vgpuhost names them (NVML_GRID_LICENSE_STATE_* 0..5)
log = logging.getLogger("vgpuhost.metering")

LICENSE_STATES = ("unknown", "uninitialized", "unlicensed-unrestricted", "unlicensed-restricted",
                  "unlicensed", "licensed")


#: ``nvmlVgpuLicenseExpiry_t.status`` of a date that holds (NVML_GRID_LICENSE_EXPIRY_VALID)
LICENSE_EXPIRY_VALID = 2


def license_expiry(expiry) -> Optional[float]:
    """An ``nvmlVgpuLicenseExpiry_t`` (year, month, day, hour, min, sec, status) as seconds since the epoch
    (UTC), or None unless its status is :data:`LICENSE_EXPIRY_VALID` and the date is a real one."""
    if expiry is None or int(getattr(expiry, "status", 0)) != LICENSE_EXPIRY_VALID:
        return None
    try:
        fields = tuple(int(getattr(expiry, k)) for k in ("year", "month", "day", "hour", "min", "sec"))
        if not (1 <= fields[1] <= 12 and 1 <= fields[2] <= 31 and fields[3] < 24 and fields[4] < 60
                and fields[5] < 61):
            return None
        return float(calendar.timegm(fields + (0, 0, 0)))
    except (TypeError, ValueError, OverflowError):
        return None


@dataclass(frozen=True)
class VgpuReading:
    """One active vGPU as NVML reports it at one read.

    ``instance``: NVML's vGPU instance id (valid while it runs); ``device``:
    the mdev UUID, or ``""`` where NVML gives none (vendor VFIO);
    ``vm_id``: the VM id (libvirt domain UUID on KVM) or ``""``;
    ``type_name``: the vGPU type name (``A40-8Q``); ``gi_id``: the GPU
    instance of a MIG-backed vGPU, else None; ``fb_used_bytes`` /
    ``fb_total_bytes``: framebuffer in bytes; ``license``: one of
    :data:`LICENSE_STATES`; ``sample``: the utilisation sample newer than
    the read's ``last_seen_us``, or None; ``license_expiry_s``: when the
    licence expires (seconds since the epoch, UTC), or None where the driver
    gives no valid date (``NVML_GRID_LICENSE_EXPIRY_VALID`` is 2; a
    permanent licence, 4, never expires).
    """

    instance: int
    device: str
    vm_id: str
    type_name: str
    gi_id: Optional[int]
    fb_used_bytes: int
    fb_total_bytes: int
    license: str
    sample: Optional["UtilSample"] = None
    license_expiry_s: Optional[float] = None


@dataclass(frozen=True)
class UtilSample:
    """Utilisation of one vGPU: percent of the period ending at ``timestamp_us``."""

    timestamp_us: int
    sm: float
    mem: float
    enc: float
    dec: float


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one read: ``bdf`` (``0000:41:00.0``), its name, MIG mode,
    its active vGPUs, and the SM utilisation (percent) of each GPU instance
    where GPM gives it (``gi_sm``: ``{gi_id: percent}``; empty when GPM is
    not available, ``gpm`` says why; ``gi_not_metered``: the GPU instances whose vGPUs GPM
    does not meter, with the reason)."""

    bdf: str
    name: str
    mig: bool
    vgpus: Tuple[VgpuReading, ...]
    gi_sm: Dict[int, float] = field(default_factory=dict)
    gpm: str = "unavailable"
    error: Optional[str] = None
    #: ``{gi_id: reason}`` for the GPU instances GPM does not meter although they hold
    #: MIG-backed vGPUs (:data:`~vgpuhost.model.nvml.GPM_REASONS`)
    gi_not_metered: Dict[int, str] = field(default_factory=dict)
    #: the GPU's UUID as NVML gives it (``nvmlDeviceGetUUID``: ``GPU-xxxxxxxx-...``); "" when unknown
    uuid: str = ""


class MeteringNvml(Protocol):
    """What the sampler reads.  Nothing here changes a GPU."""

    def clock_us(self) -> int:
        """Now on NVML's clock (CPU time, microseconds since the epoch): the wall clock, which
        NTP or an operator may step; only timestamps and hour buckets come from it."""

    def monotonic_us(self) -> int:
        """Now on a clock that never steps (microseconds, CLOCK_MONOTONIC: since boot, the same
        for every process): elapsed time comes from it.  Optional: without it the sampler uses
        its own process's ``time.monotonic``."""

    def boot_id(self) -> str:
        """What tells one boot from the next, so a restarted sampler knows whether a
        :meth:`monotonic_us` it saved is still comparable ('' when unknown).  Optional."""

    def read(self, last_seen_us: Dict[str, int]) -> List[GpuReading]:
        """Every GPU NVML sees with a vGPU manager, with samples newer than
        ``last_seen_us[bdf]`` (0: the latest).  A GPU whose reads fail is
        returned with ``error`` set (the NVML error name) and no vGPUs."""


def read_boot_id(path: Optional[str]) -> str:
    """The kernel's boot id (``<proc>/sys/kernel/random/boot_id``: a new UUID every boot) read from
    ``path``, '' when there is none or it is unreadable."""
    if not path:
        return ""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _text(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode(errors="replace").rstrip("\x00").strip()
    return str(v or "").strip()


def _value(v: Any, value_type: int) -> float:
    """A ``c_nvmlValue_t`` union read by the ``nvmlValueType_t`` the driver gave
    (:data:`~vgpuhost.model.nvml.VALUE_TYPE_FIELDS`).  Raises ValueError for a type NVML does
    not define: such a sample is not guessed at."""
    name = VALUE_TYPE_FIELDS.get(int(value_type))
    if name is None:
        raise ValueError(f"unknown nvmlValueType_t {value_type}")
    return float(getattr(v, name))


class PynvmlMetering:
    """:class:`MeteringNvml` over nvidia-ml-py, using a PynvmlBackend's call wrapper and handles."""

    def __init__(self, backend: Any, boot_id_path: Optional[str] = None):
        """``boot_id_path``: the host's ``<proc>/sys/kernel/random/boot_id`` (see :meth:`boot_id`)."""
        self._be = backend
        self._boot_id_path = boot_id_path
        self._nv = backend._nv
        self._gpm_prev: Dict[Tuple[str, int], Any] = {}       # (bdf, gi) -> the last GPM sample
        self._gi_names: Dict[str, Dict[int, str]] = {}         # bdf -> {GI profile id: name}

    def clock_us(self) -> int:
        return int(time.time() * 1_000_000)

    def monotonic_us(self) -> int:
        return time.monotonic_ns() // 1000

    def boot_id(self) -> str:
        return read_boot_id(self._boot_id_path)

    # --- listing and identity ---------------------------------------------------
    def bus_ids(self) -> List[str]:
        """PCI bus ids (``0000:41:00.0``) of every GPU NVML sees (enumerated by index only to learn them)."""
        out = []
        for i in range(int(self._be._fn("nvmlDeviceGetCount"))):
            h = self._be._fn("nvmlDeviceGetHandleByIndex", i)
            out.append(bdf_from_nvml(self._be._fn("nvmlDeviceGetPciInfo", h).busId))
        return out

    def active_instances(self, bdf: str) -> List[int]:
        """vGPU instance ids active on GPU ``bdf`` (all GPU instances together)."""
        return [int(getattr(i, "value", i)) for i in self._be._fn("nvmlDeviceGetActiveVgpus", self._be._handle(bdf))]

    def instance_identity(self, instance: int) -> Tuple[str, str, str, Optional[int]]:
        """``(mdev UUID or "", VM id or "", type name, GI id or None)`` of one vGPU instance.

        An empty or all-zero mdev UUID is none (a vendor-specific VFIO vGPU has no mdev: a real
        ``nvidia-smi vgpu -q`` of driver 580 prints no MDEV UUID line, and the libvirt domain
        UUID as VM UUID; tests/data/real/nvidia-smi/README.md); a VM UUID is lower-cased."""
        fn = self._be._fn
        try:
            mdev = _text(fn("nvmlVgpuInstanceGetMdevUUID", instance))
        except NvmlError as e:
            if e.nvml_name not in ("NVMLError_NotSupported", "NVMLError_FunctionNotFound"):
                raise
            mdev = ""
        if no_mdev_uuid(mdev):          # vendor VFIO: no mdev (empty, or all zeros)
            mdev = ""
        try:
            vm = fn("nvmlVgpuInstanceGetVmID", instance)
            vm_id = _text(vm[0] if isinstance(vm, (tuple, list)) else vm)
        except NvmlError:
            vm_id = ""
        if len(vm_id) == 36 and vm_id.count("-") == 4:
            vm_id = vm_id.lower()       # a domain UUID, spelled as libvirt spells it
        type_id = int(fn("nvmlVgpuInstanceGetType", instance))
        name = _text(fn("nvmlVgpuTypeGetName", type_id))
        if name.upper().startswith("NVIDIA "):
            name = name[7:]
        try:
            gi = int(fn("nvmlVgpuInstanceGetGpuInstanceId", instance))
            gi_id = None if gi in (0xFFFFFFFF, -1) else gi
        except NvmlError:
            gi_id = None
        return mdev, vm_id, name, gi_id

    def fb_total(self, instance: int) -> int:
        """Framebuffer bytes of the instance's vGPU type."""
        t = int(self._be._fn("nvmlVgpuInstanceGetType", instance))
        return int(self._be._fn("nvmlVgpuTypeGetFramebufferSize", t))

    def fb_used(self, instance: int) -> int:
        """Framebuffer bytes in use (64-bit: see :meth:`PynvmlBackend.vgpu_fb_usage`)."""
        return self._be.vgpu_fb_usage(instance)

    def license(self, instance: int) -> str:
        """One of :data:`LICENSE_STATES`."""
        return self.license_info(instance)[0]

    def license_info(self, instance: int) -> "Tuple[str, Optional[float]]":
        """``(state, expiry)``: one of :data:`LICENSE_STATES`, and when the licence expires (seconds since
        the epoch, UTC; None unless ``licenseExpiry.status`` is ``NVML_GRID_LICENSE_EXPIRY_VALID``, 2)."""
        try:
            info = self._be._fn("nvmlVgpuInstanceGetLicenseInfo_v2", instance)
        except NvmlError as e:
            if e.nvml_name not in ("NVMLError_FunctionNotFound", "NVMLError_NotSupported"):
                raise
            status = int(self._be._fn("nvmlVgpuInstanceGetLicenseStatus", instance))
            return ("licensed" if status else "unlicensed"), None
        state = int(getattr(info, "currentState", 0))
        if 0 <= state < len(LICENSE_STATES) and state:
            name = LICENSE_STATES[state]
        else:
            name = "licensed" if int(getattr(info, "isLicensed", 0)) else "unlicensed"
        return name, license_expiry(getattr(info, "licenseExpiry", None))

    # --- utilisation ---------------------------------------------------------------
    def utilization(self, bdf: str, last_seen_us: int) -> Dict[int, UtilSample]:
        """``{instance: sample}`` newer than ``last_seen_us`` (the newest per instance).

        Each value is read by the ``sampleValType`` the driver reported with the samples
        (:meth:`PynvmlBackend.vgpu_utilization` calls the C functions, since pynvml drops it);
        a type NVML does not define gives no samples (logged), never a guess."""
        value_type, rows, call = self._be.vgpu_utilization(bdf, int(last_seen_us))
        out: Dict[int, UtilSample] = {}
        for r in rows or []:
            inst = int(getattr(r.vgpuInstance, "value", r.vgpuInstance))
            try:
                s = UtilSample(int(r.timeStamp), _value(r.smUtil, value_type), _value(r.memUtil, value_type),
                               _value(r.encUtil, value_type), _value(r.decUtil, value_type))
            except ValueError as e:
                log.warning("%s on %s: %s; its samples are skipped", call, bdf, e)
                return {}
            if inst not in out or s.timestamp_us > out[inst].timestamp_us:
                out[inst] = s
        return out

    # --- GPM -----------------------------------------------------------------------
    def _free_sample(self, sample: Any) -> None:
        """``nvmlGpmSampleFree`` of a sample ``nvmlGpmSampleAlloc`` gave (a failure is logged)."""
        try:
            self._be._fn("nvmlGpmSampleFree", sample)
        except NvmlError as e:
            log.warning("nvmlGpmSampleFree failed: %s", e.nvml_name)

    def _drop_samples(self, bdf: str, keep: Tuple[int, ...] = ()) -> None:
        """Free the kept GPM samples of GPU ``bdf`` but those of the GPU instances in ``keep``."""
        for key in [k for k in self._gpm_prev if k[0] == bdf and k[1] not in keep]:
            self._free_sample(self._gpm_prev.pop(key))

    def close(self) -> None:
        """Free every GPM sample this door still holds."""
        for key in list(self._gpm_prev):
            self._free_sample(self._gpm_prev.pop(key))

    def gi_sm_utilization(self, bdf: str, gi_ids: List[int]) -> Tuple[Dict[int, float], str]:
        """SM utilisation (percent) per GPU instance between this read and the previous one.

        Returns ``({gi_id: percent}, status)``; status ``ok``, ``warming-up``
        (first read: GPM needs two samples) or ``unavailable`` (not Hopper+,
        or the driver lacks GPM).  Every sample ``nvmlGpmSampleAlloc`` gives is freed with
        ``nvmlGpmSampleFree`` on every path (NVML API reference, GPM functions): a failed
        ``nvmlGpmMigSampleGet`` frees the new one, and a GPU instance no longer asked for
        frees its kept one.
        """
        nv, fn = self._nv, self._be._fn
        h = self._be._handle(bdf)
        self._drop_samples(bdf, keep=tuple(gi_ids))
        try:
            if not int(getattr(fn("nvmlGpmQueryDeviceSupport", h), "isSupportedDevice", 0)):
                self._drop_samples(bdf)
                return {}, "unavailable"
        except NvmlError:
            self._drop_samples(bdf)
            return {}, "unavailable"
        out: Dict[int, float] = {}
        status = "ok"
        for gi in gi_ids:
            try:
                cur = fn("nvmlGpmSampleAlloc")
            except NvmlError:
                self._drop_samples(bdf)
                return {}, "unavailable"
            try:
                fn("nvmlGpmMigSampleGet", h, gi, cur)
            except NvmlError:
                self._free_sample(cur)
                self._drop_samples(bdf)
                return {}, "unavailable"
            prev = self._gpm_prev.get((bdf, gi))
            self._gpm_prev[(bdf, gi)] = cur
            if prev is None:
                status = "warming-up"
                continue
            mg = nv.c_nvmlGpmMetricsGet_t()
            mg.version = nv.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = 1
            mg.sample1, mg.sample2 = prev, cur
            mg.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
            try:
                res = fn("nvmlGpmMetricsGet", mg)
            except NvmlError:
                continue
            finally:
                self._free_sample(prev)
            if int(res.metrics[0].nvmlReturn) == 0:
                out[gi] = float(res.metrics[0].value)
        return out, status

    def _gi_profile_name(self, bdf: str, gi_id: int) -> Optional[str]:
        """The profile name (``1g.18gb``) of GPU instance ``gi_id`` of GPU ``bdf``, or None
        when NVML does not say (the device's profile names are read once per GPU)."""
        try:
            names = self._gi_names.get(bdf)
            if names is None:
                names = {int(info.id): profile_name(index_name, int(info.sliceCount), int(info.memorySizeMB),
                                                    getattr(info, "name", None))
                         for index_name, _i, info in self._be._raw_profiles(self._be._handle(bdf))}
                self._gi_names[bdf] = names
            gi = self._be._gi_handle(bdf, gi_id)
            return names.get(int(self._be._fn("nvmlGpuInstanceGetInfo", gi).profileId))
        except NvmlError:
            return None

    def gpm_reasons(self, bdf: str, vgpus: List[VgpuReading]) -> Dict[int, Optional[str]]:
        """``{gi_id: why GPM does not meter it, or None}`` for each GPU instance holding MIG-backed
        vGPUs of ``vgpus`` (:func:`~vgpuhost.model.nvml.gpm_not_metered`: only vGPUs allocated
        the whole instance's framebuffer are metered)."""
        by_gi: Dict[int, List[str]] = {}
        for v in vgpus:
            if v.gi_id is not None:
                by_gi.setdefault(v.gi_id, []).append(v.type_name)
        out: Dict[int, Optional[str]] = {}
        for gi, names in sorted(by_gi.items()):
            prof = self._gi_profile_name(bdf, gi)
            out[gi] = gpm_not_metered(names, prof) if prof else GPM_UNKNOWN_SHARE
        return out

    # --- one read --------------------------------------------------------------------
    def read(self, last_seen_us: Dict[str, int]) -> List[GpuReading]:
        out: List[GpuReading] = []
        for bdf in self.bus_ids():
            try:
                out.extend(self._read_gpu(bdf, last_seen_us.get(bdf, 0)))
            except NvmlError as e:
                out.append(GpuReading(bdf, "", False, (), error=e.nvml_name))
        return out

    def _read_gpu(self, bdf: str, last_seen_us: int) -> List[GpuReading]:
        """GPU ``bdf``'s reading (none when it has no vGPU manager); raises NvmlError."""
        name = _text(self._be.device_name(bdf))
        try:
            uuid = _text(self._be.device_uuid(bdf))
        except NvmlError:
            uuid = ""
        mig = bool((self._be.mig_mode(bdf) or (False, False))[0])
        try:
            instances = self.active_instances(bdf)
        except NvmlError as e:
            if e.not_supported:          # no vGPU manager on this GPU
                return []
            raise
        samples = self.utilization(bdf, last_seen_us) if instances else {}
        vgpus = []
        for inst in instances:
            mdev, vm_id, tname, gi = self.instance_identity(inst)
            state, expiry = self.license_info(inst)
            vgpus.append(VgpuReading(inst, mdev, vm_id, tname, gi, self.fb_used(inst),
                                     self.fb_total(inst), state, samples.get(inst), expiry))
        gi_sm: Dict[int, float] = {}
        gpm = "unavailable"
        reasons: Dict[int, Optional[str]] = {}
        if mig:
            reasons = self.gpm_reasons(bdf, vgpus)
            gi_sm, gpm = self.gi_sm_utilization(bdf, [g for g, why in reasons.items() if why is None])
        else:
            self._drop_samples(bdf)
        not_metered = {g: why for g, why in reasons.items() if why is not None}
        return [GpuReading(bdf, name, mig, tuple(vgpus), gi_sm, gpm, gi_not_metered=not_metered, uuid=uuid)]


__all__ = ["MeteringNvml", "GpuReading", "VgpuReading", "UtilSample", "LICENSE_STATES", "license_expiry",
           "PynvmlMetering"]
