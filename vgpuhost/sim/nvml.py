"""The simulator's NVML: :class:`SimNvml`, the NVML backend of a simulated host.

Owns: the device state only the NVIDIA driver knows — MIG mode (current and
pending), GPU instances, mixed-size (heterogeneous) mode, the vGPU scheduler —
kept per GPU in the simulated host's ``.vgpuhost-sim/gpus/<BDF>.json`` next to the
simulated sysfs tree, so separate processes see one host.  Every change takes
:meth:`SimKernel.locked`, re-reads the metadata inside the lock, saves the GPU's file and
rewrites the GPU's sysfs availability (:meth:`SimKernel.refresh_gpu`): MIG-backed
vGPU types become creatable once GPU instances of their profile exist.
Must not: be imported on a real host (:func:`vgpuhost.io.backends.backend_for` only
loads it, by name, for a simulated root).

Seeded per GPU by :func:`nvml_seed` (called by :mod:`vgpuhost.sim.build`;
older host.json files without the keys get the same defaults on read):

- ``name``, ``uuid``: what ``nvmlDeviceGetName`` / ``GetUUID`` report;
- ``gi_profiles``: the board's MIG profile table from the catalog
  (docs/reference/hardware.md#mig-profiles) with memory in MiB as a real GPU reports it where the
  catalog has the figure (a real H200's ``1g.18gb``: 16384, below the name), else the name's GB x 1024;
- ``mig_mode`` (current), ``mig_pending``, ``mig_reset_required`` (a MIG mode
  change stays *pending* until :meth:`SimNvml.reset` when true, or while
  ``nvidia-persistenced`` runs: it blocks the reset, docs/reference/hardware.md#mig-profiles);
- ``gpu_instances``: ``[{gi_id, profile_id, profile, start, size}]``;
- ``compute_processes``: CUDA processes on the GPU (blocks MIG mode changes);
- ``scheduler`` / ``scheduler_caps`` (docs/reference/hardware.md#vgpu-scheduling).

Crash injection: every change (MIG mode, GPU instance create/destroy,
mixed-size mode, scheduler; and :meth:`SimNvml.reset`) is one crash point of
the simulated kernel's kill-at-Nth-write counter (``VGPUHOST_SIM_KILL_AT``,
``_WHEN``, :mod:`.kernel`), and a change that landed is appended to
``VGPUHOST_SIM_WRITE_LOG`` as its audit row spells it (the NVML door's
``row_*`` functions), so the fault-injection tests cover NVML writes too.

Errors are :class:`~vgpuhost.nvml.NvmlError` with the NVML error name
(docs/reference/hardware.md#nvml): ``NVMLError_NotFound`` (no such GPU, or not on the
``nvidia`` driver: NVML sees only those), ``NVMLError_NotSupported`` (not
MIG-capable, MIG mode off for GI calls, no vGPU manager for vGPU calls,
device-level scheduler calls in MIG mode, fixed share in mixed-size mode),
``NVMLError_InUse`` (vGPUs or processes present -- but a scheduler set answers
NOT_SUPPORTED then, as the driver does -- GPU instances present when
disabling MIG, a GPU instance backing a vGPU), ``NVMLError_InvalidArgument``
(unknown profile id or placement start, scheduler values out of range),
``NVMLError_InsufficientResources`` (max count reached, placement overlaps,
compute slices exhausted).
"""

from __future__ import annotations

import errno
import os
import uuid as _uuid
from typing import Callable, Dict, List, Optional, Tuple

from ..io.hostroot import HostRoot
from ..io.nvml import NvmlError, row_create_gi, row_destroy_gi, row_set_mig_mode, row_set_mixed_size, row_set_scheduler
from ..model.boards import MIG_NO_SCHEDULER, board
from ..model.nvml import GiProfile, GpuInstance, SchedulerCaps, SchedulerState
from ..model.values import MigProfile, PciAddress
from .catalog import load_catalog
from .kernel import PERSISTENCED, WRITE_LOG_ENV, SimKernel, crash_point

POLICIES = ("best-effort", "equal-share", "fixed-share")

NOT_FOUND = "NVMLError_NotFound"
NOT_SUPPORTED = "NVMLError_NotSupported"
IN_USE = "NVMLError_InUse"
INVALID = "NVMLError_InvalidArgument"
INSUFFICIENT = "NVMLError_InsufficientResources"
GPU_IS_LOST = "NVMLError_GpuIsLost"
UNKNOWN = "NVMLError_Unknown"


def _memory_mib(p) -> int:
    """A catalog MigProfileDef's memory in MiB: the driver's figure where known, else the name's."""
    if p.memory_mib is not None:
        return int(p.memory_mib)
    try:
        return MigProfile.parse(p.name).memory_gb * 1024
    except Exception:  # a catalog name that does not parse: no memory figure
        return 0


def _slices(name: str) -> int:
    try:
        return MigProfile.parse(name).slices
    except Exception:
        return 0


#: the scheduler after the driver loads: best effort, every field the driver's default
#: (docs/reference/hardware.md#vgpu-scheduling); a reboot brings it back (:mod:`.reboot`)
DEFAULT_SCHEDULER = {"policy": "best-effort", "arr": False, "timeslice_ms": None, "frequency_hz": None,
                     "avg_factor": None}


def nvml_seed(model, mig_mode: bool, bdf: str) -> dict:
    """The NVML side of one GPU's host.json entry (``model``: a catalog GpuModel)."""
    profiles = [{"profile_id": p.profile_id, "name": p.name, "slices": _slices(p.name),
                 "memory_mib": _memory_mib(p), "max_count": p.max_count,
                 "placements": [[s, p.size] for s in p.placement_starts]}
                for p in model.mig_profiles]
    return {
        "name": model.marketing_name,
        "uuid": "GPU-" + str(_uuid.uuid5(_uuid.NAMESPACE_URL, f"vgpuhost-sim:{model.key}:{bdf}")),
        "gi_profiles": profiles,
        "mig_mode": bool(mig_mode) if model.mig_capable else False,
        "mig_pending": bool(mig_mode) if model.mig_capable else False,
        "mig_reset_required": False,
        "gpu_instances": [],
        "compute_processes": 0,
        "scheduler": dict(DEFAULT_SCHEDULER),
        "scheduler_caps": {"policies": list(POLICIES), "arr_supported": True,
                           "min_timeslice_ms": 1, "max_timeslice_ms": 30,
                           "min_frequency_hz": 63, "max_frequency_hz": 960,
                           "min_avg_factor": 1, "max_avg_factor": 60},
    }


def _fill_defaults(gpu: dict, pf: str) -> None:
    """Give a host.json GPU entry written before NVML was simulated the seeded keys."""
    if "gi_profiles" in gpu and "scheduler" in gpu:
        return
    model = load_catalog().gpus.get(gpu.get("board", ""))
    if model is None:
        return
    for k, v in nvml_seed(model, bool(gpu.get("mig_mode")), pf).items():
        gpu.setdefault(k, v)


class SimNvml:
    """:class:`vgpuhost.nvml.NvmlBackend` over a simulated host's host.json."""

    def __init__(self, host: HostRoot):
        self.host = host
        self.kernel = SimKernel(host)

    # --- plumbing ----------------------------------------------------------
    def _driver(self, meta: dict, pf: str) -> Optional[str]:
        try:
            return os.path.basename(os.readlink(self.kernel.dev_dir(meta, pf) / "driver"))
        except OSError:
            return None

    def _gpu(self, meta: dict, bdf: PciAddress, call: str) -> Tuple[str, dict]:
        pf = str(bdf)
        gpu = (meta.get("gpus") or {}).get(pf)
        if gpu is None:
            raise NvmlError(call, NOT_FOUND, hint=f"no NVIDIA GPU at {pf}")
        drv = self._driver(meta, pf)
        if drv != "nvidia":
            raise NvmlError(call, NOT_FOUND,
                            hint=f"{pf} is bound to {drv or 'no driver'}; NVML sees only GPUs on nvidia")
        _fill_defaults(gpu, pf)
        return pf, gpu

    def _read(self, bdf: PciAddress, call: str) -> Tuple[dict, str, dict]:
        self.kernel.settle()                  # a write cut short by a killed writer is whole or gone first
        meta = self.kernel.meta_view()        # shared: the queries below only read it
        pf, gpu = self._gpu(meta, bdf, call)
        return meta, pf, gpu

    def _change(self, bdf: PciAddress, call: str, fn: Callable[[dict, str, dict], object],
                logged: Optional[Callable[[str, object], Tuple[str, str]]] = None):
        """Run ``fn(meta, pf, gpu)`` under the simulator lock; save and refresh sysfs when it returns.

        One crash point (the kill-at-Nth-write counter the simulated kernel's writes share); a
        change that landed is logged to the write log as ``logged(pf, fn's result)`` spells it
        (the audit row's ``(path, value)``, :mod:`vgpuhost.io.nvml`)."""
        with crash_point():
            self.kernel.settle()            # (before the lock: it takes the lock itself)
            with self.kernel.locked():
                meta = self.kernel.meta()
                pf, gpu = self._gpu(meta, bdf, call)
                self._write_fault(meta, pf, call)
                out = fn(meta, pf, gpu)
                self.kernel.save_meta(meta, pf)         # this GPU's file alone
                self.kernel.refresh_gpu(pf, meta)
            log = os.environ.get(WRITE_LOG_ENV)
            if log and logged is not None:
                path, value = logged(pf, out)
                with open(log, "a", encoding="utf-8") as f:
                    f.write(f"{path}\t{value}\n")
            return out

    def _write_fault(self, meta: dict, pf: str, call: str) -> None:
        """Fire an injected ``nvml`` fault on ``pf`` (the spec's ``faults``, ``sim fail --write-errno``): the
        write fails with NvmlError ``NVMLError_GpuIsLost`` for EIO/ENODEV (what NVML answers for a GPU
        that fell off the bus), ``NVMLError_Unknown`` for any other errno; nothing changes."""
        try:
            self.kernel._fault(meta, "nvml", [pf], pf)       # (the kernel's one fault matcher and counter)
        except OSError as e:
            name = GPU_IS_LOST if e.errno in (errno.EIO, errno.ENODEV) else UNKNOWN
            raise NvmlError(call, name, hint=f"injected nvml fault on {pf}") from None

    def _vgpus(self, meta: dict, pf: str) -> List[dict]:
        return self.kernel.instances(meta, pf)

    def _mig_vgpus(self, meta: dict, pf: str, gpu: dict) -> Dict[str, int]:
        """MIG-backed vGPUs present, per GPU-instance profile name."""
        out: Dict[str, int] = {}
        for inst in self._vgpus(meta, pf):
            t = gpu["types"].get(inst["type_id"]) or {}
            if t.get("gi_profile"):
                out[t["gi_profile"]] = out.get(t["gi_profile"], 0) + 1
        return out

    @staticmethod
    def _profiles(gpu: dict) -> List[GiProfile]:
        return [GiProfile(p["profile_id"], p["name"], p["slices"], p["memory_mib"], p["max_count"],
                          tuple((int(s), int(z)) for s, z in p["placements"]))
                for p in gpu.get("gi_profiles") or []]

    @staticmethod
    def _instances(gpu: dict) -> List[GpuInstance]:
        return [GpuInstance(g["gi_id"], g["profile_id"], g["start"], g["size"])
                for g in sorted(gpu.get("gpu_instances") or [], key=lambda g: g["gi_id"])]

    @staticmethod
    def _mig_scheduler(gpu: dict, pf: str, call: str) -> NvmlError:
        """NOT_SUPPORTED for a device-level scheduler call in MIG mode, with the driver's reason: before
        Blackwell there is no vGPU scheduler in MIG mode at all ("Software Scheduler is not supported in
        MIG mode"); from Blackwell on it is per GPU instance (docs/reference/hardware.md#vgpu-scheduling)."""
        model = load_catalog().gpus.get(gpu.get("board", ""))
        b = board(model.ids.device) if model is not None else None
        if b is not None and b.mig_scheduler:
            return NvmlError(call, NOT_SUPPORTED, hint=f"{pf} is in MIG mode: the scheduler is per GPU instance")
        return NvmlError(call, NOT_SUPPORTED, hint=f"{pf} is in MIG mode: {MIG_NO_SCHEDULER}")

    @staticmethod
    def _need_vgpu_manager(gpu: dict, call: str) -> None:
        if gpu.get("backend", "none") == "none":
            raise NvmlError(call, NOT_SUPPORTED, hint="no NVIDIA vGPU manager drives this GPU")

    # --- devices -------------------------------------------------------------
    def device_name(self, bdf: PciAddress) -> str:
        return self._read(bdf, "nvmlDeviceGetName")[2].get("name") or "NVIDIA GPU"

    def device_uuid(self, bdf: PciAddress) -> str:
        return self._read(bdf, "nvmlDeviceGetUUID")[2].get("uuid") or ""

    # --- MIG -------------------------------------------------------------------
    def mig_mode(self, bdf: PciAddress) -> Optional[Tuple[bool, bool]]:
        _, _, gpu = self._read(bdf, "nvmlDeviceGetMigMode")
        if not gpu.get("mig_capable"):
            return None
        cur = bool(gpu.get("mig_mode"))
        return cur, bool(gpu.get("mig_pending", cur))

    def set_mig_mode(self, bdf: PciAddress, enabled: bool) -> Tuple[bool, bool]:
        call = "nvmlDeviceSetMigMode"

        def fn(meta: dict, pf: str, gpu: dict) -> Tuple[bool, bool]:
            if not gpu.get("mig_capable"):
                raise NvmlError(call, NOT_SUPPORTED, hint=f"{pf} is not MIG-capable")
            cur = bool(gpu.get("mig_mode"))
            pending = bool(gpu.get("mig_pending", cur))
            want = bool(enabled)
            if cur == want and pending == want:
                return cur, pending
            if self._vgpus(meta, pf):
                raise NvmlError(call, IN_USE, hint=f"vGPUs exist on {pf}")
            if int(gpu.get("compute_processes") or 0) > 0:
                raise NvmlError(call, IN_USE, hint=f"{gpu['compute_processes']} processes use {pf}")
            if not want and gpu.get("gpu_instances"):
                raise NvmlError(call, IN_USE, hint=f"GPU instances exist on {pf}")
            blocked = bool(gpu.get("mig_reset_required")) or PERSISTENCED in (meta.get("processes") or [])
            gpu["mig_pending"] = want
            if not blocked:
                gpu["mig_mode"] = want
            return bool(gpu["mig_mode"]), want

        return self._change(bdf, call, fn, lambda pf, out: row_set_mig_mode(pf, enabled))

    def reset(self, bdf: PciAddress) -> Tuple[bool, bool]:
        """Simulate a GPU reset (``nvidia-smi -r``): a pending MIG mode takes effect,
        mixed-size mode is lost (docs/reference/hardware.md#vgpu-types).  Not part of NvmlBackend."""
        call = "nvmlDeviceResetGpu"

        def fn(meta: dict, pf: str, gpu: dict) -> Tuple[bool, bool]:
            if self._vgpus(meta, pf) or int(gpu.get("compute_processes") or 0) > 0:
                raise NvmlError(call, IN_USE)
            if gpu.get("mig_capable"):
                gpu["mig_mode"] = bool(gpu.get("mig_pending", gpu.get("mig_mode")))
                if not gpu["mig_mode"]:
                    gpu["gpu_instances"] = []
            gpu["mixed_size"] = False
            return bool(gpu.get("mig_mode")), bool(gpu.get("mig_pending", gpu.get("mig_mode")))

        return self._change(bdf, call, fn)

    # --- health (docs/guide/failures.md#signals) ----------------------------------
    def gpu_lost(self, bdf: PciAddress) -> bool:
        """True once :meth:`lose` marked the GPU lost (NVML_ERROR_GPU_IS_LOST on every call to it)."""
        gpu = (self.kernel.meta_view().get("gpus") or {}).get(str(bdf))
        return bool(gpu and gpu.get("lost"))

    def xid_events(self, bdfs: List[PciAddress], timeout_ms: int) -> List[Tuple[PciAddress, int]]:
        """The Xids :meth:`inject_xid` queued for ``bdfs``, taken off the queue (never waits: the
        simulator's events are all there already), as NVML's event set hands them out once each."""
        wanted = {str(b) for b in bdfs}
        out: List[Tuple[PciAddress, int]] = []
        # the agent's watch asks every round: the lock (which every simulated kernel write takes) only when an
        # event is queued, and only for the read and the save
        if not any(gpu.get("xid_events") for pf, gpu in (self.kernel.meta_view().get("gpus") or {}).items()
                   if pf in wanted):
            return out
        with self.kernel.locked():
            meta = self.kernel.meta()
            changed = False
            for pf, gpu in sorted((meta.get("gpus") or {}).items()):
                if pf in wanted and gpu.get("xid_events"):
                    out += [(PciAddress.parse(pf), int(x)) for x in gpu["xid_events"]]
                    gpu["xid_events"] = []
                    changed = True
            if changed:
                self.kernel.save_meta(meta)
        return out

    def lose(self, bdf: PciAddress, lost: bool = True) -> None:
        """Simulator only: the GPU falls off the bus as NVML sees it (GPU_IS_LOST), or comes back."""
        self._set_health(bdf, "lost", bool(lost))

    def inject_xid(self, bdf: PciAddress, xid: int) -> None:
        """Simulator only: queue an Xid event for the GPU (NVML's ``nvmlEventTypeXidCriticalError``)."""
        self._set_health(bdf, "xid_events", int(xid))

    def _set_health(self, bdf: PciAddress, key: str, value) -> None:
        with self.kernel.locked():
            meta = self.kernel.meta()
            gpu = (meta.get("gpus") or {}).get(str(bdf))
            if gpu is None:
                raise NvmlError("sim", NOT_FOUND, hint=f"no NVIDIA GPU at {bdf}")
            if key == "xid_events":
                gpu.setdefault("xid_events", []).append(value)
            else:
                gpu[key] = value
            self.kernel.save_meta(meta)

    def gi_profiles(self, bdf: PciAddress) -> List[GiProfile]:
        _, pf, gpu = self._read(bdf, "nvmlDeviceGetGpuInstanceProfileInfo")
        if not gpu.get("mig_capable"):
            raise NvmlError("nvmlDeviceGetGpuInstanceProfileInfo", NOT_SUPPORTED,
                            hint=f"{pf} is not MIG-capable")
        return self._profiles(gpu)

    def gpu_instances(self, bdf: PciAddress) -> List[GpuInstance]:
        _, pf, gpu = self._read(bdf, "nvmlDeviceGetGpuInstances")
        if not gpu.get("mig_capable"):
            raise NvmlError("nvmlDeviceGetGpuInstances", NOT_SUPPORTED, hint=f"{pf} is not MIG-capable")
        if not gpu.get("mig_mode"):
            return []
        return self._instances(gpu)

    def gpu_instance_vgpus(self, bdf: PciAddress) -> Dict[int, int]:
        """``{gi_id: MIG-backed vGPUs on it}`` (GPU instances holding none are left out): what
        ``nvmlVgpuInstanceGetGpuInstanceId`` of each active vGPU gives on a real host."""
        meta, pf, gpu = self._read(bdf, "nvmlVgpuInstanceGetGpuInstanceId")
        if not gpu.get("mig_capable") or not gpu.get("mig_mode"):
            return {}
        out: Dict[int, int] = {}
        for gi in self.kernel.gi_of_vgpus(meta, pf).values():
            out[gi] = out.get(gi, 0) + 1
        return out

    def create_gpu_instance(self, bdf: PciAddress, profile_id: int, start: int) -> GpuInstance:
        call = "nvmlDeviceCreateGpuInstanceWithPlacement"

        def fn(meta: dict, pf: str, gpu: dict) -> GpuInstance:
            if not gpu.get("mig_capable") or not gpu.get("mig_mode"):
                raise NvmlError(call, NOT_SUPPORTED, hint=f"MIG mode is off on {pf}")
            profiles = {p.profile_id: p for p in self._profiles(gpu)}
            prof = profiles.get(int(profile_id))
            if prof is None:
                raise NvmlError(call, INVALID, hint=f"no GPU-instance profile id {profile_id} on {pf}")
            size = next((z for s, z in prof.placements if s == int(start)), None)
            if size is None:
                raise NvmlError(call, INVALID, hint=f"{prof.name} cannot start at memory slice {start}")
            gis = gpu.setdefault("gpu_instances", [])
            if sum(1 for g in gis if g["profile_id"] == prof.profile_id) >= prof.max_count:
                raise NvmlError(call, INSUFFICIENT, hint=f"{prof.max_count} {prof.name} instances exist")
            for g in gis:
                if int(start) < g["start"] + g["size"] and g["start"] < int(start) + size:
                    raise NvmlError(call, INSUFFICIENT,
                                    hint=f"memory slices {start}..{int(start) + size - 1} overlap GPU "
                                         f"instance {g['gi_id']}")
            compute = max((p.slices for p in profiles.values()), default=0)
            used = sum(profiles[g["profile_id"]].slices for g in gis if g["profile_id"] in profiles)
            if used + prof.slices > compute:
                raise NvmlError(call, INSUFFICIENT, hint=f"{used} of {compute} compute slices in use")
            taken = {g["gi_id"] for g in gis}
            gi_id = next(i for i in range(1, 64) if i not in taken)
            gis.append({"gi_id": gi_id, "profile_id": prof.profile_id, "profile": prof.name,
                        "start": int(start), "size": size})
            return GpuInstance(gi_id, prof.profile_id, int(start), size), prof.name

        gi, _ = self._change(bdf, call, fn,
                             lambda pf, out: row_create_gi(pf, out[0].profile_id, out[1], out[0].start, out[0].size))
        return gi

    def destroy_gpu_instance(self, bdf: PciAddress, gi_id: int) -> None:
        call = "nvmlGpuInstanceDestroy"

        def fn(meta: dict, pf: str, gpu: dict) -> None:
            if not gpu.get("mig_capable") or not gpu.get("mig_mode"):
                raise NvmlError(call, NOT_SUPPORTED, hint=f"MIG mode is off on {pf}")
            gis = gpu.get("gpu_instances") or []
            gi = next((g for g in gis if g["gi_id"] == int(gi_id)), None)
            if gi is None:
                raise NvmlError(call, NOT_FOUND, hint=f"no GPU instance {gi_id} on {pf}")
            if int(gi_id) in self.kernel.gi_of_vgpus(meta, pf).values():
                raise NvmlError(call, IN_USE, hint=f"a vGPU runs on GPU instance {gi_id}")
            gpu["gpu_instances"] = [g for g in gis if g["gi_id"] != int(gi_id)]
            return gi

        self._change(bdf, call, fn, lambda pf, gi: row_destroy_gi(pf, gi["gi_id"], gi["profile"], gi["start"]))

    def compute_processes(self, bdf: PciAddress) -> int:
        return int(self._read(bdf, "nvmlDeviceGetComputeRunningProcesses")[2].get("compute_processes") or 0)

    # --- vGPU ----------------------------------------------------------------
    def active_vgpus(self, bdf: PciAddress) -> int:
        meta, pf, gpu = self._read(bdf, "nvmlDeviceGetActiveVgpus")
        self._need_vgpu_manager(gpu, "nvmlDeviceGetActiveVgpus")
        return len(self._vgpus(meta, pf))

    def heterogeneous_mode(self, bdf: PciAddress) -> bool:
        _, _, gpu = self._read(bdf, "nvmlDeviceGetVgpuHeterogeneousMode")
        self._need_vgpu_manager(gpu, "nvmlDeviceGetVgpuHeterogeneousMode")
        return bool(gpu.get("mixed_size"))

    def set_heterogeneous_mode(self, bdf: PciAddress, enabled: bool) -> None:
        call = "nvmlDeviceSetVgpuHeterogeneousMode"

        def fn(meta: dict, pf: str, gpu: dict) -> None:
            self._need_vgpu_manager(gpu, call)
            if bool(gpu.get("mixed_size")) == bool(enabled):
                return
            if self._vgpus(meta, pf):
                raise NvmlError(call, IN_USE, hint=f"vGPUs exist on {pf}")
            gpu["mixed_size"] = bool(enabled)

        self._change(bdf, call, fn, lambda pf, out: row_set_mixed_size(pf, enabled))

    def scheduler_caps(self, bdf: PciAddress) -> SchedulerCaps:
        call = "nvmlDeviceGetVgpuSchedulerCapabilities"
        _, pf, gpu = self._read(bdf, call)
        self._need_vgpu_manager(gpu, call)
        if gpu.get("mig_mode"):         # device-level scheduler calls: NOT_SUPPORTED in MIG mode on every board
            raise self._mig_scheduler(gpu, pf, call)
        c = dict(gpu["scheduler_caps"])
        return SchedulerCaps(policies=tuple(c.pop("policies")), **c)

    def scheduler_state(self, bdf: PciAddress) -> SchedulerState:
        call = "nvmlDeviceGetVgpuSchedulerState"
        _, pf, gpu = self._read(bdf, call)
        self._need_vgpu_manager(gpu, call)
        if gpu.get("mig_mode"):
            raise self._mig_scheduler(gpu, pf, call)
        return SchedulerState(**gpu["scheduler"])

    def set_scheduler_state(self, bdf: PciAddress, state: SchedulerState) -> None:
        call = "nvmlDeviceSetVgpuSchedulerState"

        def fn(meta: dict, pf: str, gpu: dict) -> None:
            self._need_vgpu_manager(gpu, call)
            if gpu.get("mig_mode"):
                raise self._mig_scheduler(gpu, pf, call)
            caps = gpu["scheduler_caps"]
            if state.policy not in caps["policies"]:
                raise NvmlError(call, INVALID, hint=f"policy {state.policy!r} not in {caps['policies']}")
            if state.policy == "fixed-share" and gpu.get("mixed_size"):
                raise NvmlError(call, NOT_SUPPORTED, hint="fixed share is not available in mixed-size mode")
            if state.arr and not caps["arr_supported"]:
                raise NvmlError(call, NOT_SUPPORTED, hint="ARR is not supported")
            if state.policy != "best-effort":
                checks = ([("frequency_hz", state.frequency_hz), ("avg_factor", state.avg_factor)]
                          if state.arr else [("timeslice_ms", state.timeslice_ms)])
                for key, value in checks:
                    lo, hi = caps[f"min_{key}"], caps[f"max_{key}"]
                    if value is not None and not (lo <= value <= hi):
                        raise NvmlError(call, INVALID, hint=f"{key} {value} outside {lo}..{hi}")
            if self._vgpus(meta, pf):        # the driver answers NOT_SUPPORTED here, not IN_USE
                raise NvmlError(call, NOT_SUPPORTED, hint=f"a vGPU instance exists on {pf}: the scheduler changes "
                                                          "only while the GPU has none")
            gpu["scheduler"] = {"policy": state.policy, "arr": bool(state.arr),
                                "timeslice_ms": state.timeslice_ms, "frequency_hz": state.frequency_hz,
                                "avg_factor": state.avg_factor}

        self._change(bdf, call, fn, lambda pf, out: row_set_scheduler(pf, state))


__all__ = ["SimNvml", "nvml_seed", "POLICIES"]
