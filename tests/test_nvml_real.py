"""The real NVML adapter (vgpuhost.nvml_real) against a stand-in installed at
the pynvml *function* level, plus the real library-less behaviour of this
GPU-less machine.

The stand-in (:class:`FakeNvml`) replaces ``pynvml.nvmlDeviceGetMigMode`` &c.
with functions that check argument order and types the way the C library
would see them (bus-id spelling, profile *id* vs profile *index*, pointers
vs structs) and answer with the real pynvml struct classes, so field names
and the FB-usage 64-bit quirk are exercised.  Numbers are H200-like
(docs/reference/hardware.md#mig-profiles); memory sizes as a real H200 reports them (NVIDIA/mig-parted issue 120).
"""

from __future__ import annotations

import ctypes
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

pynvml = pytest.importorskip("pynvml")

from vgpuhost.io import nvml_pynvml as nvml_real  # noqa: E402
from vgpuhost.model.errors import HostEnvironmentError, InputError  # noqa: E402
from vgpuhost.io.nvml import NvmlError  # noqa: E402
from vgpuhost.model.nvml import GpuInstance, SchedulerState  # noqa: E402
from vgpuhost.io.nvml_pynvml import PynvmlBackend, is_mutating, profile_name  # noqa: E402
from vgpuhost.model.values import PciAddress  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
S = SchedulerState
BDF = PciAddress.parse("0000:41:00.0")
BUS_ID = "00000000:41:00.0"

# index -> (id, sliceCount, instanceCount, memorySizeMB, driver name, placements)
H200 = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, 1, 7, 16384, "MIG 1g.18gb", [(s, 1) for s in range(7)]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (20, 1, 1, 16384, "MIG 1g.18gb+me", [(s, 1) for s in range(7)]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (15, 1, 4, 33024, "MIG 1g.35gb", [(s, 2) for s in (0, 2, 4, 6)]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, 2, 3, 33024, "MIG 2g.35gb", [(s, 2) for s in (0, 2, 4)]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, 3, 2, 71168, "MIG 3g.71gb", [(0, 4), (4, 4)]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, 4, 1, 71168, "MIG 4g.71gb", [(0, 4)]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, 7, 1, 143104, "MIG 7g.141gb", [(0, 8)]),
}
#: a real H200's memory.total (MiB), the device memory NVIDIA names its MIG profiles from
H200_MEMORY_MIB = 143771
MUTATING_FAKES = ("nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceDestroy",
                  "nvmlDeviceSetVgpuHeterogeneousMode", "nvmlDeviceSetVgpuSchedulerState",
                  "nvmlGpuInstanceSetVgpuSchedulerState", "nvmlDeviceSetVgpuSchedulerState_v2",
                  "nvmlGpuInstanceSetVgpuSchedulerState_v2")


def nvml_error(code):
    return pynvml.NVMLError(code)


def _target(ref, ctype):
    """The object behind a ``byref(...)`` argument, checking its C type."""
    assert type(ref).__name__ == "CArgObject", f"expected byref(...), got {type(ref).__name__}"
    assert isinstance(ref._obj, ctype), f"expected a pointer to {ctype.__name__}, got {type(ref._obj).__name__}"
    return ref._obj


class FakeNvml:
    """One H200 at 0000:41:00.0 behind pynvml's function names."""

    def __init__(self, *, name_field=True, sched_caps_ns=True, sched_v2=False):
        self.handle = pynvml.c_nvmlDevice_t()
        self.mig = [1, 1]
        self.name_field = name_field
        self.gis = {}            # gi_id -> (profile_id, start, size, struct keeping the pointer alive)
        self.next_gi = 1
        self.het_mode = pynvml.NVML_VGPU_PGPU_HOMOGENEOUS_MODE
        self.sched = pynvml.c_nvmlVgpuSchedulerGetState_t()
        self.sched.schedulerPolicy = pynvml.NVML_VGPU_SCHEDULER_POLICY_BEST_EFFORT
        self.gi_sched = {}
        self.sched_caps_ns = sched_caps_ns
        self.sched_v2 = sched_v2     # the driver has the NVML 13 _v2 scheduler calls (else FUNCTION_NOT_FOUND)
        self.calls = []
        self.vgpus = [ctypes.c_uint(7)]
        self.vgpu_gi = {}            # vGPU instance -> GPU instance id (MIG-backed); others: INVALID
        self.fb_usage = 5 * 1024 ** 3 + 123          # > 4 GiB: needs 64 bits
        self.fb_target_types = []

    # -------------------------------------------------------------- install
    def install(self, monkeypatch):
        monkeypatch.setattr(nvml_real, "_init_done", False)
        for attr in dir(self):
            if attr.startswith("nvml") or attr == "_nvmlGetFunctionPointer":
                monkeypatch.setattr(pynvml, attr, getattr(self, attr))
        return self

    def _dev(self, h):
        assert h is self.handle, "call was not given the handle from nvmlDeviceGetHandleByPciBusId"

    def _gi(self, gi):
        assert isinstance(gi, pynvml.c_nvmlGpuInstance_t), f"not a GPU instance handle: {gi!r}"
        addr = ctypes.addressof(gi.contents)
        for gid, (_pid, _st, _sz, obj) in self.gis.items():
            if ctypes.addressof(obj) == addr:
                return gid
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _profile_by_id(self, pid):
        for info in H200.values():
            if info[0] == pid:
                return info
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    # -------------------------------------------------------------- system
    def nvmlInit(self):
        self.calls.append("nvmlInit")

    def nvmlSystemGetDriverVersion(self):
        return "570.124.03"

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        assert index == 0
        return self.handle

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        assert isinstance(bus_id, (str, bytes))
        if isinstance(bus_id, bytes):
            bus_id = bus_id.decode()
        if bus_id.upper() != BUS_ID:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return self.handle

    def nvmlDeviceGetPciInfo(self, h):
        self._dev(h)
        p = pynvml.nvmlPciInfo_t()
        p.busId = BUS_ID.encode()
        p.pciDeviceId = 0x233510DE
        p.pciSubSystemId = 0x18BE10DE
        return p

    def nvmlDeviceGetName(self, h):
        self._dev(h)
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        self._dev(h)
        return "GPU-11111111-2222-3333-4444-555555555555"

    def nvmlDeviceGetHostVgpuMode(self, h):
        self._dev(h)
        return pynvml.NVML_HOST_VGPU_MODE_SRIOV

    def nvmlDeviceGetVirtualizationMode(self, h):
        self._dev(h)
        return pynvml.NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU

    # -------------------------------------------------------------- MIG
    def nvmlDeviceGetMigMode(self, h):
        self._dev(h)
        return list(self.mig)

    def nvmlDeviceSetMigMode(self, h, mode):
        self._dev(h)
        assert mode in (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE)
        self.calls.append(("nvmlDeviceSetMigMode", mode))
        self.mig[1] = mode            # pending until a reset
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetMemoryInfo(self, h):
        self._dev(h)
        info = pynvml.c_nvmlMemory_t()
        info.total = H200_MEMORY_MIB * 1024 * 1024
        return info

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h, index, version=2):
        self._dev(h)
        if index not in H200:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        pid, slices, count, mem, name, _pl = H200[index]
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        info.id = pid
        info.sliceCount = slices
        info.instanceCount = count
        info.memorySizeMB = mem
        if version == 2 and self.name_field:
            info.name = name.encode()
        return info

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, h, profile_id, placements_ref, count_ref):
        self._dev(h)
        placements = self._profile_by_id(profile_id)[5]
        count = _target(count_ref, ctypes.c_uint)
        if placements_ref is None:
            count.value = len(placements)
            return pynvml.NVML_SUCCESS
        assert isinstance(placements_ref, ctypes.Array)
        assert placements_ref._type_ is pynvml.c_nvmlGpuInstancePlacement_t
        if len(placements_ref) < len(placements):
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, (st, sz) in enumerate(placements):
            placements_ref[i].start, placements_ref[i].size = st, sz
        count.value = len(placements)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, h, profile_id):
        self._dev(h)
        return self._profile_by_id(profile_id)[2] - sum(1 for g in self.gis.values() if g[0] == profile_id)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h, profile_id, placement):
        self._dev(h)
        pl = _target(placement, pynvml.c_nvmlGpuInstancePlacement_t)
        if not self.mig[0]:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if (pl.start, pl.size) not in self._profile_by_id(profile_id)[5]:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        used = {s for (_p, st, sz, _o) in self.gis.values() for s in range(st, st + sz)}
        if used & set(range(pl.start, pl.start + pl.size)):
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gid = self.next_gi
        self.next_gi += 1
        obj = pynvml.struct_c_nvmlGpuInstance_t()
        self.gis[gid] = (profile_id, pl.start, pl.size, obj)
        self.calls.append(("create", profile_id, pl.start, pl.size))
        return ctypes.pointer(obj)

    def nvmlDeviceGetGpuInstances(self, h, profile_id, arr, count_ref):
        self._dev(h)
        count = _target(count_ref, ctypes.c_uint)
        assert isinstance(arr, ctypes.Array) and arr._type_ is pynvml.c_nvmlGpuInstance_t
        mine = [(gid, g) for gid, g in sorted(self.gis.items()) if g[0] == profile_id]
        if len(arr) < len(mine):
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, (_gid, g) in enumerate(mine):
            arr[i] = ctypes.pointer(g[3])
        count.value = len(mine)
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetInfo(self, gi):
        gid = self._gi(gi)
        pid, st, sz, _o = self.gis[gid]
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = gid, pid
        info.placement.start, info.placement.size = st, sz
        return info

    def nvmlDeviceGetGpuInstanceById(self, h, gi_id):
        self._dev(h)
        if gi_id not in self.gis:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return ctypes.pointer(self.gis[gi_id][3])

    def nvmlGpuInstanceDestroy(self, gi):
        gid = self._gi(gi)
        self.calls.append(("destroy", gid))
        del self.gis[gid]
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._dev(h)
        return []

    # -------------------------------------------------------------- vGPU
    def nvmlDeviceGetActiveVgpus(self, h):
        self._dev(h)
        return list(self.vgpus)

    def nvmlDeviceGetSupportedVgpus(self, h):
        self._dev(h)
        return [ctypes.c_uint(1100), ctypes.c_uint(1101)]

    def nvmlDeviceGetCreatableVgpus(self, h):
        self._dev(h)
        return [ctypes.c_uint(1101)]

    def nvmlVgpuTypeGetName(self, t):
        return {1100: "NVIDIA H200X-1-18C", 1101: "NVIDIA H200X-141C"}[t]

    def nvmlVgpuTypeGetClass(self, t):
        return "Compute"

    def nvmlVgpuTypeGetFramebufferSize(self, t):
        return {1100: 18 * 1024 ** 3, 1101: 141 * 1024 ** 3}[t]

    def nvmlVgpuTypeGetMaxInstances(self, h, t):
        self._dev(h)
        return {1100: 7, 1101: 1}[t]

    def nvmlVgpuTypeGetGpuInstanceProfileId(self, t):
        return {1100: 19, 1101: 0xFFFFFFFF}[t]

    def nvmlVgpuInstanceGetUUID(self, i):
        return "11111111-0000-0000-0000-000000000007"

    def nvmlVgpuInstanceGetType(self, i):
        return 1100

    def nvmlVgpuInstanceGetGpuInstanceId(self, i):
        return self.vgpu_gi.get(int(getattr(i, "value", i)), 0xFFFFFFFF)

    def nvmlDeviceGetVgpuHeterogeneousMode(self, h):
        self._dev(h)
        return self.het_mode

    def nvmlDeviceSetVgpuHeterogeneousMode(self, h, mode):
        self._dev(h)
        assert mode in (pynvml.NVML_VGPU_PGPU_HETEROGENEOUS_MODE, pynvml.NVML_VGPU_PGPU_HOMOGENEOUS_MODE)
        self.het_mode = mode
        return pynvml.NVML_SUCCESS

    def _nvmlGetFunctionPointer(self, name):
        """The C entry points called directly (FB usage): writes a 64-bit value
        through the pointer it gets, as the driver does (a c_uint target keeps
        only the low 32 bits here instead of overflowing).  Any other symbol is one this
        driver lacks: pynvml raises NVMLError_FunctionNotFound for it."""
        if name != "nvmlVgpuInstanceGetFbUsage":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

        def c_fn(instance, usage_ref):
            assert int(getattr(instance, "value", instance)) == 7
            target = usage_ref._obj
            self.fb_target_types.append(type(target))
            target.value = self.fb_usage
            return pynvml.NVML_SUCCESS
        return c_fn

    # -------------------------------------------------------------- scheduler
    def nvmlDeviceGetVgpuSchedulerCapabilities(self, h):
        self._dev(h)
        c = pynvml.c_nvmlVgpuSchedulerCapabilities_t()
        c.supportedSchedulers[0] = pynvml.NVML_VGPU_SCHEDULER_POLICY_BEST_EFFORT
        c.supportedSchedulers[1] = pynvml.NVML_VGPU_SCHEDULER_POLICY_EQUAL_SHARE
        c.supportedSchedulers[2] = pynvml.NVML_VGPU_SCHEDULER_POLICY_FIXED_SHARE
        unit = 1_000_000 if self.sched_caps_ns else 1
        c.minTimeslice, c.maxTimeslice = 1 * unit, 30 * unit
        c.isArrModeSupported = 1
        c.minFrequencyForARR, c.maxFrequencyForARR = 63, 960
        c.minAvgFactorForARR, c.maxAvgFactorForARR = 1, 60
        return c

    def nvmlDeviceGetVgpuSchedulerState(self, h):
        self._dev(h)
        if self.mig[0]:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.sched

    def _apply(self, target, st):
        target.schedulerPolicy = st.schedulerPolicy
        target.arrMode = st.enableARRMode
        if st.enableARRMode == pynvml.NVML_VGPU_SCHEDULER_ARR_ENABLE:
            p = st.schedulerParams.vgpuSchedDataWithARR
            target.schedulerParams.vgpuSchedDataWithARR.avgFactor = p.avgFactor
            # the driver reports the ARR period back as a timeslice in ns
            target.schedulerParams.vgpuSchedDataWithARR.timeslice = round(1e9 / p.frequency)
        else:
            target.schedulerParams.vgpuSchedData.timeslice = st.schedulerParams.vgpuSchedData.timeslice

    def nvmlDeviceSetVgpuSchedulerState(self, h, st):
        self._dev(h)
        assert isinstance(st, pynvml.c_nvmlVgpuSchedulerSetState_t), type(st)
        if self.mig[0]:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if self.vgpus:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        self.calls.append(("sched", st.schedulerPolicy, st.enableARRMode,
                           st.schedulerParams.vgpuSchedDataWithARR.avgFactor,
                           st.schedulerParams.vgpuSchedDataWithARR.frequency,
                           st.schedulerParams.vgpuSchedData.timeslice))
        self.sched = pynvml.c_nvmlVgpuSchedulerGetState_t()
        self._apply(self.sched, st)
        return pynvml.NVML_SUCCESS

    def _need_v2(self):
        if not self.sched_v2:                       # a driver before R580: no such entry point
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _fill_v2(self, info, src):
        assert isinstance(info, pynvml.c_nvmlVgpuSchedulerStateInfo_v2_t), type(info)
        assert info.engineId == pynvml.NVML_VGPU_SCHEDULER_ENGINE_TYPE_GRAPHICS
        info.schedulerPolicy = src.schedulerPolicy if src is not None else pynvml.NVML_VGPU_SCHEDULER_POLICY_BEST_EFFORT
        if src is None:
            return info
        if src.arrMode == pynvml.NVML_VGPU_SCHEDULER_ARR_ENABLE:
            info.avgFactor = src.schedulerParams.vgpuSchedDataWithARR.avgFactor
            info.timeslice = src.schedulerParams.vgpuSchedDataWithARR.timeslice
        else:
            info.avgFactor, info.timeslice = 0, src.schedulerParams.vgpuSchedData.timeslice
        return info

    def _apply_v2(self, target, st):
        assert isinstance(st, pynvml.c_nvmlVgpuSchedulerState_v2_t), type(st)
        assert st.engineId == pynvml.NVML_VGPU_SCHEDULER_ENGINE_TYPE_GRAPHICS
        target.schedulerPolicy = st.schedulerPolicy
        target.arrMode = pynvml.NVML_VGPU_SCHEDULER_ARR_ENABLE          # v2 cannot turn ARR off
        target.schedulerParams.vgpuSchedDataWithARR.avgFactor = st.avgFactor
        target.schedulerParams.vgpuSchedDataWithARR.timeslice = round(1e9 / st.frequency) if st.frequency else 0

    def nvmlDeviceGetVgpuSchedulerState_v2(self, h, info):
        self._need_v2()
        self._dev(h)
        if self.mig[0]:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.calls.append("get-v2")
        return self._fill_v2(info, self.sched)

    def nvmlDeviceSetVgpuSchedulerState_v2(self, h, st):
        self._need_v2()
        self._dev(h)
        if self.mig[0] or self.vgpus:               # NOT_SUPPORTED also while a vGPU instance exists
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.calls.append(("sched-v2", st.schedulerPolicy, st.avgFactor, st.frequency))
        self.sched = pynvml.c_nvmlVgpuSchedulerGetState_t()
        self._apply_v2(self.sched, st)
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetVgpuSchedulerState_v2(self, gi, info):
        self._need_v2()
        return self._fill_v2(info, self.gi_sched.get(self._gi(gi)))

    def nvmlGpuInstanceSetVgpuSchedulerState_v2(self, gi, st):
        self._need_v2()
        gid = self._gi(gi)
        self.calls.append(("gi-sched-v2", gid, st.schedulerPolicy, st.avgFactor, st.frequency))
        target = pynvml.c_nvmlVgpuSchedulerStateInfo_v1_t()
        self._apply_v2(target, st)
        self.gi_sched[gid] = target
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetVgpuSchedulerState(self, gi, info):
        gid = self._gi(gi)
        assert isinstance(info, pynvml.c_nvmlVgpuSchedulerStateInfo_v1_t)
        assert info.version == pynvml.nvmlVgpuSchedulerStateInfo_v1
        assert info.engineId == pynvml.NVML_VGPU_SCHEDULER_ENGINE_TYPE_GRAPHICS
        src = self.gi_sched.get(gid)
        if src is None:
            info.schedulerPolicy = pynvml.NVML_VGPU_SCHEDULER_POLICY_BEST_EFFORT
        else:
            ctypes.memmove(ctypes.addressof(info.schedulerParams), ctypes.addressof(src.schedulerParams),
                           ctypes.sizeof(info.schedulerParams))
            info.schedulerPolicy, info.arrMode = src.schedulerPolicy, src.arrMode
        return info

    def nvmlGpuInstanceSetVgpuSchedulerState(self, gi, st):
        gid = self._gi(gi)
        assert isinstance(st, pynvml.c_nvmlVgpuSchedulerState_v1_t), type(st)
        assert st.version == pynvml.nvmlVgpuSchedulerState_v1
        assert st.engineId == pynvml.NVML_VGPU_SCHEDULER_ENGINE_TYPE_GRAPHICS
        self.calls.append(("gi-sched", gid, st.schedulerPolicy, st.enableARRMode))
        target = pynvml.c_nvmlVgpuSchedulerStateInfo_v1_t()
        self._apply(target, st)
        self.gi_sched[gid] = target
        return pynvml.NVML_SUCCESS


@pytest.fixture
def fake(monkeypatch):
    return FakeNvml().install(monkeypatch)


@pytest.fixture
def be(fake):
    return PynvmlBackend.open()


# ------------------------------------------------------------------ plumbing

def test_open_inits_once(fake):
    PynvmlBackend.open()
    PynvmlBackend.open()
    assert fake.calls.count("nvmlInit") == 1


@pytest.mark.parametrize("code,text", [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 not found"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no permission"),
])
def test_open_maps_unavailable_to_host_environment_error(monkeypatch, code, text):
    monkeypatch.setattr(nvml_real, "_init_done", False)

    def init():
        raise pynvml.NVMLError(code)
    monkeypatch.setattr(pynvml, "nvmlInit", init)
    with pytest.raises(HostEnvironmentError) as ei:
        PynvmlBackend.open()
    line = ei.value.one_line()
    assert "NVML is not available" in line and text in line and "vgpuhost gpus" in line
    # issue 12 #4k: a driver that is not loaded yet (boot) is transient (exit 5, the boot units retry);
    # a missing library or no permission is not (exit 2)
    want = 5 if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED else 2
    assert "\n" not in line and ei.value.exit_code == want
    assert nvml_real._init_done is False


def test_open_without_pynvml_is_host_environment_error(monkeypatch):
    monkeypatch.setattr(nvml_real, "_init_done", False)
    monkeypatch.setitem(sys.modules, "pynvml", None)     # import pynvml -> ImportError
    with pytest.raises(HostEnvironmentError, match="nvidia-ml-py"):
        PynvmlBackend.open()


def test_other_init_errors_keep_nvml_name(monkeypatch):
    monkeypatch.setattr(nvml_real, "_init_done", False)

    def init():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    monkeypatch.setattr(pynvml, "nvmlInit", init)
    with pytest.raises(NvmlError) as ei:
        PynvmlBackend.open()
    assert (ei.value.call, ei.value.nvml_name) == ("nvmlInit", "NVMLError_Unknown")


def test_handles_by_pci_bus_id_in_nvml_spelling(fake, be, monkeypatch):
    seen = []
    real = fake.nvmlDeviceGetHandleByPciBusId

    def spy(bus_id):
        seen.append(bus_id)
        return real(bus_id)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByPciBusId", spy)
    assert be.device_name(BDF) == "NVIDIA H200"
    assert be.device_uuid("0000:41:00.0").startswith("GPU-")
    assert seen == ["00000000:41:00.0"]               # cached per bus id
    assert nvml_real.nvml_bus_id(PciAddress.parse("0001:af:1f.7")) == "00000001:AF:1F.7"
    assert nvml_real.bdf_from_nvml(b"00000000:41:00.0") == "0000:41:00.0"
    with pytest.raises(NvmlError) as ei:
        be.device_name(PciAddress.parse("0000:42:00.0"))
    assert ei.value.nvml_name == "NVMLError_NotFound" and ei.value.call == "nvmlDeviceGetHandleByPciBusId"


def test_not_supported_is_kept_visible(fake, be, monkeypatch):
    def ns(h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetVgpuHeterogeneousMode", ns)
    with pytest.raises(NvmlError) as ei:
        be.heterogeneous_mode(BDF)
    e = ei.value
    assert e.nvml_name == "NVMLError_NotSupported" and e.not_supported
    assert e.call == "nvmlDeviceGetVgpuHeterogeneousMode" and e.exit_code == 3
    assert "vGPU manager" in e.one_line()
    # NOT_SUPPORTED on the MIG query means "not MIG-capable", not an error
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", ns)
    assert be.mig_mode(BDF) is None


def test_every_nvml_error_subclass_maps_by_name(be):
    for code, cls in pynvml.NVMLError._valClassMapping.items():
        def boom(code=code):
            raise pynvml.NVMLError(code)
        with pytest.raises(NvmlError) as ei:
            be._call("nvmlSomething", boom)
        assert ei.value.nvml_name == cls.__name__ and cls.__name__.startswith("NVMLError_")


# ----------------------------------------------------------------------- MIG

def test_mig_mode_and_pending_change(fake, be):
    fake.mig = [0, 0]
    assert be.mig_mode(BDF) == (False, False)
    assert be.set_mig_mode(BDF, True) == (False, True)        # pending until reset
    assert ("nvmlDeviceSetMigMode", pynvml.NVML_DEVICE_MIG_ENABLE) in fake.calls


def test_gi_profiles_use_ids_names_and_placements(fake, be):
    profs = {p.name: p for p in be.gi_profiles(BDF)}
    assert set(profs) == {"1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"}
    assert profs["1g.18gb"].profile_id == 19 and profs["1g.18gb"].max_count == 7
    assert profs["1g.18gb+me"].profile_id == 20
    assert profs["1g.35gb"].placements == ((0, 2), (2, 2), (4, 2), (6, 2))
    assert profs["3g.71gb"].placements == ((0, 4), (4, 4)) and profs["3g.71gb"].memory_mib == 71168
    assert profs["7g.141gb"].profile_id == 0 and profs["7g.141gb"].slices == 7


def test_profile_names_built_when_driver_gives_none(monkeypatch):
    FakeNvml(name_field=False).install(monkeypatch)
    names = sorted(p.name for p in PynvmlBackend.open().gi_profiles(BDF))
    assert names == sorted(["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"])
    # A100-40GB memory sizes as nvidia-smi prints them (4.75 / 9.62 / 19.62 / 39.25 GiB): rounding up
    assert profile_name("NVML_GPU_INSTANCE_PROFILE_1_SLICE", 1, 4864) == "1g.5gb"
    assert profile_name("NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1", 1, 4864) == "1g.5gb+me"
    assert profile_name("NVML_GPU_INSTANCE_PROFILE_2_SLICE", 2, 9856) == "2g.10gb"
    assert profile_name("NVML_GPU_INSTANCE_PROFILE_3_SLICE", 3, 20096) == "3g.20gb"
    assert profile_name("NVML_GPU_INSTANCE_PROFILE_7_SLICE", 7, 40192) == "7g.40gb"
    assert profile_name("NVML_GPU_INSTANCE_PROFILE_1_SLICE", 1, 1, b"MIG 1g.24gb") == "1g.24gb"


def test_profile_info_v1_fallback_when_v_entry_point_missing(fake, monkeypatch):
    real = fake.nvmlDeviceGetGpuInstanceProfileInfo

    def old_driver(h, index, version=2):
        if version == 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return real(h, index, version)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstanceProfileInfo", old_driver)
    names = {p.name for p in PynvmlBackend.open().gi_profiles(BDF)}
    assert "1g.18gb+me" in names and "3g.71gb" in names


def test_create_list_destroy_gpu_instances(fake, be):
    gi = be.create_gpu_instance(BDF, 9, 4)                    # profile *id* 9 = 3g
    assert gi == GpuInstance(gi_id=1, profile_id=9, start=4, size=4)
    be.create_gpu_instance(BDF, 14, 0)
    assert fake.calls[-2:] == [("create", 9, 4, 4), ("create", 14, 0, 2)]
    assert be.gpu_instances(BDF) == [GpuInstance(2, 14, 0, 2), GpuInstance(1, 9, 4, 4)]
    with pytest.raises(NvmlError) as ei:
        be.create_gpu_instance(BDF, 9, 0)                     # overlaps the 2g at 0
    assert ei.value.nvml_name == "NVMLError_InsufficientResources"
    with pytest.raises(InputError) as ie:
        be.create_gpu_instance(BDF, 9, 2)
    assert "possible starts: 0, 4" in ie.value.one_line()
    be.destroy_gpu_instance(BDF, 1)
    assert be.gpu_instances(BDF) == [GpuInstance(2, 14, 0, 2)]
    with pytest.raises(NvmlError, match="NVMLError_NotFound"):
        be.destroy_gpu_instance(BDF, 1)


def test_processes_vgpus_and_mixed_size(fake, be):
    assert be.compute_processes(BDF) == 0
    assert be.active_vgpus(BDF) == 1
    assert be.heterogeneous_mode(BDF) is False                # HOMOGENEOUS_MODE == 1
    be.set_heterogeneous_mode(BDF, True)
    assert fake.het_mode == pynvml.NVML_VGPU_PGPU_HETEROGENEOUS_MODE == 0
    assert be.heterogeneous_mode(BDF) is True


def test_which_gpu_instance_each_vgpu_sits_on(fake, be):
    """``nvmlVgpuInstanceGetGpuInstanceId`` of each active vGPU: a time-sliced one (INVALID_GPU_INSTANCE_ID)
    is left out; MIG-backed ones count per GPU instance (docs/reference/hardware.md#mig-backed-vgpus)."""
    assert be.gpu_instance_vgpus(BDF) == {}
    fake.vgpus = [ctypes.c_uint(7), ctypes.c_uint(8), ctypes.c_uint(9)]
    fake.vgpu_gi = {7: 2, 9: 5}
    assert be.gpu_instance_vgpus(BDF) == {2: 1, 5: 1}


def test_fb_usage_64bit_quirk(fake, be):
    # pynvml's own wrapper hands a 32-bit c_uint to a 64-bit out-parameter
    assert pynvml.nvmlVgpuInstanceGetFbUsage(fake.vgpus[0]) == fake.fb_usage & 0xFFFFFFFF
    assert fake.fb_target_types[-1] is ctypes.c_uint
    assert be.vgpu_fb_usage(fake.vgpus[0]) == fake.fb_usage > 2 ** 32
    assert fake.fb_target_types[-1] is ctypes.c_ulonglong


# ----------------------------------------------------------------- scheduler

def test_scheduler_caps_in_ms_from_ns(fake, be):
    caps = be.scheduler_caps(BDF)
    assert caps.policies == ("best-effort", "equal-share", "fixed-share")
    assert caps.arr_supported
    assert (caps.min_timeslice_ms, caps.max_timeslice_ms) == (1, 30)
    assert (caps.min_frequency_hz, caps.max_frequency_hz, caps.min_avg_factor, caps.max_avg_factor) == (63, 960, 1, 60)


def test_scheduler_set_and_read_back_without_arr(fake, be, caplog):
    fake.mig = [0, 0]
    fake.vgpus = []
    caplog.set_level(logging.INFO, logger="vgpuhost.nvml")
    be.set_scheduler_state(BDF, SchedulerState("equal-share", arr=False, timeslice_ms=3))
    assert fake.calls[-1] == ("sched", pynvml.NVML_VGPU_SCHEDULER_POLICY_EQUAL_SHARE,
                              pynvml.NVML_VGPU_SCHEDULER_ARR_DISABLE, 3_000_000, 0, 3_000_000)
    assert "timeslice=3000000 ns (3 ms)" in caplog.text
    assert be.scheduler_state(BDF) == SchedulerState("equal-share", arr=False, timeslice_ms=3)


def test_scheduler_set_and_read_back_with_arr(fake, be):
    fake.mig = [0, 0]
    fake.vgpus = []
    want = SchedulerState("fixed-share", arr=True, frequency_hz=960, avg_factor=60)
    be.set_scheduler_state(BDF, want)
    assert fake.calls[-1][:5] == ("sched", 3, pynvml.NVML_VGPU_SCHEDULER_ARR_ENABLE, 60, 960)
    assert be.scheduler_state(BDF) == want
    be.set_scheduler_state(BDF, SchedulerState("best-effort"))
    assert fake.calls[-1][1:3] == (1, pynvml.NVML_VGPU_SCHEDULER_ARR_DEFAULT)
    assert be.scheduler_state(BDF) == SchedulerState("best-effort")


def test_scheduler_timeslice_unit_follows_capabilities(monkeypatch):
    fake = FakeNvml(sched_caps_ns=False).install(monkeypatch)   # a driver reporting ms
    fake.mig, fake.vgpus = [0, 0], []
    be = PynvmlBackend.open()
    assert be.scheduler_caps(BDF).max_timeslice_ms == 30
    be.set_scheduler_state(BDF, SchedulerState("equal-share", timeslice_ms=5))
    assert fake.calls[-1][-1] == 5


def test_scheduler_refusals_keep_nvml_names(fake, be):
    fake.mig = [0, 0]
    with pytest.raises(NvmlError) as ei:                        # a vGPU runs
        be.set_scheduler_state(BDF, SchedulerState("equal-share", timeslice_ms=2))
    assert ei.value.nvml_name == "NVMLError_InUse"
    fake.mig = [1, 1]
    with pytest.raises(NvmlError) as ei:                        # device-level call in MIG mode
        be.scheduler_state(BDF)
    assert ei.value.not_supported
    with pytest.raises(InputError):
        be.set_scheduler_state(BDF, SchedulerState("round-robin"))


def test_scheduler_per_gpu_instance_in_mig_mode(fake, be):
    gi = be.create_gpu_instance(BDF, 19, 0)
    assert be.scheduler_state(BDF, gi_id=gi.gi_id) == SchedulerState("best-effort")
    be.set_scheduler_state(BDF, SchedulerState("equal-share", arr=True, frequency_hz=480, avg_factor=33),
                           gi_id=gi.gi_id)
    assert fake.calls[-1] == ("gi-sched", gi.gi_id, 2, pynvml.NVML_VGPU_SCHEDULER_ARR_ENABLE)
    assert be.scheduler_state(BDF, gi_id=gi.gi_id) == SchedulerState("equal-share", arr=True, frequency_hz=480,
                                                                      avg_factor=33)


def test_scheduler_v2_calls_first_where_the_driver_has_them(monkeypatch):
    """NVML 13 deprecates the v1 scheduler calls: the _v2 ones go first (main used v1 only)."""
    fake = FakeNvml(sched_v2=True).install(monkeypatch)
    fake.mig, fake.vgpus = [0, 0], []
    be = PynvmlBackend.open()
    want = S("fixed-share", arr=True, frequency_hz=960, avg_factor=60)
    be.set_scheduler_state(BDF, want)
    assert fake.calls[-1] == ("sched-v2", pynvml.NVML_VGPU_SCHEDULER_POLICY_FIXED_SHARE, 60, 960)
    assert be.scheduler_state(BDF) == want and fake.calls[-1] == "get-v2"
    assert not any(isinstance(c, tuple) and c[0] == "sched" for c in fake.calls)      # no v1 set
    # v2 cannot turn ARR off ("support for disabling ARR mode removed"): that state goes through v1
    be.set_scheduler_state(BDF, S("equal-share", arr=False, timeslice_ms=3))
    assert fake.calls[-1][:3] == ("sched", pynvml.NVML_VGPU_SCHEDULER_POLICY_EQUAL_SHARE,
                                  pynvml.NVML_VGPU_SCHEDULER_ARR_DISABLE)
    assert be.scheduler_state(BDF) == S("equal-share", arr=False, timeslice_ms=3)
    be.set_scheduler_state(BDF, S("best-effort"))
    assert fake.calls[-1] == ("sched-v2", pynvml.NVML_VGPU_SCHEDULER_POLICY_BEST_EFFORT, 0, 0)
    assert be.scheduler_state(BDF) == S("best-effort")


def test_scheduler_v1_fallback_on_function_not_found_is_remembered(fake, be, monkeypatch):
    fake.mig, fake.vgpus = [0, 0], []
    tried = []
    real = fake.nvmlDeviceGetVgpuSchedulerState_v2
    monkeypatch.setattr(pynvml, "nvmlDeviceGetVgpuSchedulerState_v2", lambda *a: tried.append(1) or real(*a))
    want = S("equal-share", arr=True, frequency_hz=480, avg_factor=33)
    be.set_scheduler_state(BDF, want)                          # a pre-R580 driver: v1
    assert fake.calls[-1][:5] == ("sched", 2, pynvml.NVML_VGPU_SCHEDULER_ARR_ENABLE, 33, 480)
    assert be.scheduler_state(BDF) == want and be.scheduler_state(BDF) == want
    assert tried == [1]                                        # FUNCTION_NOT_FOUND asked once, then v1 only


def test_scheduler_v1_when_pynvml_has_no_v2(fake, be, monkeypatch):
    """An older nvidia-ml-py (before 13) has neither the _v2 functions nor their structs."""
    fake.mig, fake.vgpus = [0, 0], []
    fake.sched_v2 = True
    for name in ("nvmlDeviceGetVgpuSchedulerState_v2", "nvmlDeviceSetVgpuSchedulerState_v2",
                 "c_nvmlVgpuSchedulerStateInfo_v2_t", "c_nvmlVgpuSchedulerState_v2_t"):
        monkeypatch.delattr(pynvml, name)
    be.set_scheduler_state(BDF, S("fixed-share", arr=True, frequency_hz=960, avg_factor=60))
    assert fake.calls[-1][0] == "sched"
    assert be.scheduler_state(BDF) == S("fixed-share", arr=True, frequency_hz=960, avg_factor=60)
    assert "get-v2" not in fake.calls


def test_scheduler_set_not_supported_hint_names_an_existing_vgpu(monkeypatch):
    """NOT_SUPPORTED on a scheduler set also means a vGPU instance exists on the GPU: the hint says so."""
    fake = FakeNvml(sched_v2=True).install(monkeypatch)
    fake.mig = [0, 0]                                          # one vGPU instance (fake.vgpus)
    with pytest.raises(NvmlError) as ei:
        PynvmlBackend.open().set_scheduler_state(BDF, S("equal-share", arr=True))
    assert ei.value.not_supported and ei.value.call == "nvmlDeviceSetVgpuSchedulerState_v2"
    assert "while a vGPU instance exists on the GPU" in ei.value.hint


def test_scheduler_v2_per_gpu_instance(monkeypatch):
    fake = FakeNvml(sched_v2=True).install(monkeypatch)
    be = PynvmlBackend.open()
    gi = be.create_gpu_instance(BDF, 19, 0)
    assert be.scheduler_state(BDF, gi_id=gi.gi_id) == S("best-effort")
    want = S("equal-share", arr=True, frequency_hz=480, avg_factor=33)
    be.set_scheduler_state(BDF, want, gi_id=gi.gi_id)
    assert fake.calls[-1] == ("gi-sched-v2", gi.gi_id, 2, 33, 480)
    assert be.scheduler_state(BDF, gi_id=gi.gi_id) == want


# --------------------------------------------------------------------- probe

def _trap_everything_else(fake, monkeypatch):
    """Every pynvml function the fake does not provide: mutating ones fail the
    test when called, the rest answer NOT_SUPPORTED (recorded by the probe)."""
    mutated = []
    for attr in dir(pynvml):
        fn = getattr(pynvml, attr)
        if not attr.startswith("nvml") or not callable(fn) or isinstance(fn, type):
            continue
        if attr in MUTATING_FAKES or (is_mutating(attr) and not hasattr(fake, attr)):
            monkeypatch.setattr(pynvml, attr, lambda *a, _n=attr: mutated.append(_n))
        elif not hasattr(fake, attr):
            def ns(*a, **k):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            monkeypatch.setattr(pynvml, attr, ns)
    return mutated


def test_probe_reads_everything_and_changes_nothing(fake, monkeypatch):
    be = PynvmlBackend.open()
    gi = be.create_gpu_instance(BDF, 9, 0)
    fake.gi_sched[gi.gi_id] = None
    fake.gi_sched.clear()
    mutated = _trap_everything_else(fake, monkeypatch)
    before = (list(fake.mig), dict(fake.gis), fake.het_mode)
    facts = nvml_real.system_facts(be)
    devs = be.probe()
    json.dumps([facts, devs])                                   # plain JSON
    assert mutated == []
    assert (list(fake.mig), dict(fake.gis), fake.het_mode) == before
    assert facts["driver_version"] == "570.124.03"
    assert facts["nvml_version"]["error"] == "NVMLError_NotSupported"
    [d] = devs
    assert d["bdf"] == "0000:41:00.0" and d["name"] == "NVIDIA H200"
    assert d["pci"]["pciDeviceId"] == "0x233510de"
    assert d["mig_mode"] == {"current": 1, "pending": 1}
    assert d["host_vgpu_mode"] == {"value": 1, "name": "NVML_HOST_VGPU_MODE_SRIOV"}
    assert d["virtualization_mode"]["name"] == "NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU"
    assert d["heterogeneous_mode"] == {"value": 1, "heterogeneous": False}
    profs = {p["profile_name"]: p for p in d["gi_profiles"]}
    assert profs["3g.71gb"]["id"] == 9 and profs["3g.71gb"]["placements"] == [[0, 4], [4, 4]]
    assert profs["3g.71gb"]["remaining_capacity"] == 1
    assert profs["3g.71gb"]["gpu_instances"][0]["placement"] == [0, 4]
    assert profs["3g.71gb"]["gpu_instances"][0]["scheduler_state"]["schedulerPolicy"] == 1
    assert d["scheduler_capabilities"]["maxTimeslice"] == 30_000_000
    assert d["scheduler_state"] == {"error": "NVMLError_NotSupported", "call": "nvmlDeviceGetVgpuSchedulerState"}
    assert [t["name"] for t in d["supported_vgpu_types"]] == ["NVIDIA H200X-1-18C", "NVIDIA H200X-141C"]
    assert d["supported_vgpu_types"][0]["framebuffer_bytes"] == 18 * 1024 ** 3
    assert d["creatable_vgpu_types"][0]["max_instances"] == 1
    assert d["active_vgpus"][0]["fb_usage_bytes"] == fake.fb_usage


def test_probe_records_a_missing_device(fake, be):
    [d] = be.probe(["0000:99:00.0"])
    assert d["handle"]["error"] == "NVMLError_NotFound"


FORBIDDEN = re.compile(r"nvml\w*(Set|Create|Destroy|Reset|Clear|Enable|Disable|Register|Remove|Discover|Modify)")


def test_probe_script_and_probe_code_name_no_mutating_nvml_call():
    import inspect
    script = (REPO / "bench" / "nvml_probe.py").read_text()
    assert not FORBIDDEN.search(script), FORBIDDEN.search(script).group(0)
    for fn in (nvml_real.probe, nvml_real._probe_device, nvml_real._gi_sched_state, nvml_real._fb_usage,
               nvml_real.system_facts, nvml_real._Reader, nvml_real._probe_metering, nvml_real._utilization_v0,
               nvml_real._utilization_info_v1):
        src = inspect.getsource(fn)
        hit = FORBIDDEN.search(src)
        assert not hit, f"{fn.__name__}: {hit.group(0)}"
    # and the runtime guard refuses them
    for name in ("nvmlDeviceSetMigMode", "nvmlGpuInstanceDestroy", "nvmlDeviceResetGpuLockedClocks",
                 "nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlDeviceClearEccErrorCounts"):
        with pytest.raises(AssertionError):
            nvml_real._Reader(pynvml).get(name)
    assert not is_mutating("nvmlDeviceGetVgpuSchedulerState")


# --------------------------------------------- the real thing: no GPU here

def _nvml_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


no_nvml = pytest.mark.skipif(_nvml_loadable(), reason="libnvidia-ml.so.1 is present on this machine")


@no_nvml
def test_real_open_without_driver_is_host_environment_error(monkeypatch):
    monkeypatch.setattr(nvml_real, "_init_done", False)
    with pytest.raises(HostEnvironmentError) as ei:
        PynvmlBackend.open()
    assert "libnvidia-ml.so.1 not found" in ei.value.one_line()


def _bare_real_root(tmp_path) -> Path:
    root = tmp_path / "realhost"
    (root / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    (root / "proc").mkdir()
    return root


@no_nvml
def test_backend_for_real_root_without_driver(tmp_path, monkeypatch):
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.io.backends import backend_for
    monkeypatch.setattr(nvml_real, "_init_done", False)
    host = HostRoot.from_env(str(_bare_real_root(tmp_path)))
    assert not host.is_simulated
    with pytest.raises(HostEnvironmentError, match="NVML is not available"):
        backend_for(host)


def _vgpuhost(*args):
    return subprocess.run([sys.executable, "-m", "vgpuhost", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def _has_mig_show() -> bool:
    try:
        from vgpuhost.cli.mig import mig
    except ImportError:
        return False
    return "show" in getattr(mig, "commands", {})


@no_nvml
@pytest.mark.skipif(not _has_mig_show(), reason="'vgpuhost mig show' not written yet")
def test_cli_mig_show_without_nvml_exits_2_one_line_and_gpus_still_works(tmp_path):
    root = _bare_real_root(tmp_path)
    r = _vgpuhost("--root", str(root), "mig", "show")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "NVML" in lines[0] and "Traceback" not in r.stderr, r.stderr
    g = _vgpuhost("--root", str(root), "gpus")
    assert g.returncode == 0, (g.stdout, g.stderr)


@no_nvml
def test_probe_script_without_nvml_exits_2_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "bench" / "nvml_probe.py"), "--out", str(tmp_path / "p.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and "NVML is not available" in r.stderr
    assert not (tmp_path / "p.json").exists()


def test_probe_script_with_fake_nvml_writes_json(fake, tmp_path, monkeypatch, capsys):
    import runpy
    _trap_everything_else(fake, monkeypatch)
    out = tmp_path / "probe.json"
    mod = runpy.run_path(str(REPO / "bench" / "nvml_probe.py"), run_name="nvml_probe")
    assert mod["main"](["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["devices"][0]["uuid"].startswith("GPU-") and data["driver_version"] == "570.124.03"
