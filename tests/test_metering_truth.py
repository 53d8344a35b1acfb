"""Metering against what the driver really reports (issue 25): the utilisation sample's value
type, GPM only on MIG-backed vGPUs that own their GPU instance, no GPM sample leaked, and
vendor-VFIO vGPUs (no mdev UUID, the domain UUID as VM UUID) matched to vgpuhost's records,
checked against a real ``nvidia-smi vgpu -q`` capture (tests/data/real/nvidia-smi/).

The real door runs against stand-ins at pynvml's function level and, for the calls vgpuhost
makes through ``_nvmlGetFunctionPointer``, at the C level, as tests/test_nvml_real.py does.
"""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path
from typing import Dict, List

import pytest

from vgpuhost.cli.main import main
from vgpuhost.io import nvml_pynvml
from vgpuhost.io.backends import metering_nvml
from vgpuhost.io.nvml_metering import PynvmlMetering
from vgpuhost.io.nvml_pynvml import PynvmlBackend, bdf_from_nvml
from vgpuhost.io.state import StateStore, put_vgpu
from vgpuhost.model.nvml import GPM_NOT_WHOLE_INSTANCE, GPM_UNKNOWN_SHARE, gpm_not_metered, no_mdev_uuid
from vgpuhost.model.records import VgpuRecord
from vgpuhost.observe.vgpus import match_vgpu_record
from vgpuhost.ops.exporter import SnapshotCollector
from vgpuhost.ops.metering import Sampler

pynvml = pytest.importorskip("pynvml")

REAL = Path(__file__).parent / "data" / "real" / "nvidia-smi"
DOM = "1e8927c3-0000-4000-8000-00000000000a"


def smi_blocks(text: str) -> Dict[str, List[Dict[str, str]]]:
    """``nvidia-smi vgpu -q`` text as ``{GPU bus id: [{field: value} per vGPU]}`` (top-level
    ``key : value`` lines of each ``vGPU ID`` block; ``#`` lines are the fixture's header)."""
    out: Dict[str, List[Dict[str, str]]] = {}
    gpu = None
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^GPU (\S+)$", line)
        if m:
            gpu = m.group(1)
            out[gpu] = []
            continue
        m = re.match(r"^( +)([^:]+?)\s+: ?(.*)$", line)
        if not m or gpu is None:
            continue
        indent, key, value = len(m.group(1)), m.group(2), m.group(3).strip()
        if key == "vGPU ID":
            out[gpu].append({"vGPU ID": value})
        elif indent == 8 and out[gpu]:
            out[gpu][-1][key] = value
    return out


CAPTURE = smi_blocks((REAL / "rtxpro6000-vgpu-q-580.105.06.txt").read_text())


# ---------------------------------------------------------------- the real capture itself

def test_the_capture_shows_vm_uuid_and_no_mdev_uuid():
    [(bus_id, vgpus)] = CAPTURE.items()
    assert bdf_from_nvml(bus_id) == "0001:c8:00.0"
    assert len(vgpus) == 2
    for v in vgpus:
        assert "MDEV UUID" not in v
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", v["VM UUID"])
        assert v["GPU Instance ID"] == "N/A" and v["vGPU Type"] == "1519"
    header = (REAL / "rtxpro6000-vgpu-q-580.105.06.txt").read_text().splitlines()[:3]
    assert any("a15631d5c20d56a1663ac4b2685aa79d58d1d055" in h for h in header)
    assert "580.105.06" in (REAL / "README.md").read_text()


@pytest.mark.parametrize("text, none", [("", True), ("00000000-0000-0000-0000-000000000000", True),
                                        ("\x00", True), ("00000000-0000-0000-0000-000000000101", False),
                                        ("8f01eb9a-0000-4000-8000-000000000007", False)])
def test_an_empty_or_all_zero_mdev_uuid_is_none(text, none):
    assert no_mdev_uuid(text) is none


# ------------------------------------------------------------- a stand-in from the capture

class CaptureLib:
    """The captured GPU behind pynvml's names: its two active vGPUs, their VM UUIDs and type,
    with ``mdev`` as what nvmlVgpuInstanceGetMdevUUID answers (None: NOT_SUPPORTED)."""

    def __init__(self, mdev=b"", value_type=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, util_v1=True):
        [(self.bus_id, self.vgpus)] = CAPTURE.items()
        self.handle = pynvml.c_nvmlDevice_t()
        self.mdev = mdev
        self.value_type = value_type
        self.util_v1 = util_v1
        self.ids = [int(v["vGPU ID"]) for v in self.vgpus]

    def install(self, monkeypatch):
        monkeypatch.setattr(nvml_pynvml, "_init_done", False)
        for attr in dir(self):
            if attr.startswith("nvml") or attr == "_nvmlGetFunctionPointer":
                monkeypatch.setattr(pynvml, attr, getattr(self, attr))
        return self

    def _v(self, i):
        return self.vgpus[self.ids.index(int(getattr(i, "value", i)))]

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.handle

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        assert bus_id == self.bus_id, bus_id
        return self.handle

    def nvmlDeviceGetPciInfo(self, h):
        p = pynvml.nvmlPciInfo_t()
        p.busId = self.bus_id.encode()
        return p

    def nvmlDeviceGetName(self, h):
        return "NVIDIA RTX PRO 6000 Blackwell Server Edition"

    def nvmlDeviceGetUUID(self, h):
        return "GPU-00000000-0000-4000-8000-00000000b600"

    def nvmlDeviceGetMigMode(self, h):
        return [0, 0]

    def nvmlDeviceGetActiveVgpus(self, h):
        return [ctypes.c_uint(i) for i in self.ids]

    def nvmlVgpuInstanceGetMdevUUID(self, i):
        if self.mdev is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.mdev

    def nvmlVgpuInstanceGetVmID(self, i):
        return (self._v(i)["VM UUID"].upper().encode(), pynvml.NVML_VGPU_VM_ID_UUID)

    def nvmlVgpuInstanceGetType(self, i):
        return int(self._v(i)["vGPU Type"])

    def nvmlVgpuTypeGetName(self, t):
        assert t == 1519
        return self.vgpus[0]["vGPU Name"]

    def nvmlVgpuTypeGetFramebufferSize(self, t):
        return 3072 * 1024 * 1024

    def nvmlVgpuInstanceGetGpuInstanceId(self, i):
        return 0xFFFFFFFF                                 # "GPU Instance ID : N/A"

    def nvmlVgpuInstanceGetLicenseInfo_v2(self, i):
        info = pynvml.c_nvmlVgpuLicenseInfo_t()
        info.currentState = pynvml.NVML_GRID_LICENSE_STATE_UNLICENSED_UNRESTRICTED
        return info

    # the C-level calls: FB usage, and utilisation with its sample type
    def _fill(self, value, pct):
        field = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
        if self.value_type in field:
            setattr(value, field[self.value_type], float(pct) if self.value_type == 0 else int(pct))

    def _sample(self, s, i, v):
        s.vgpuInstance = self.ids[i]
        s.timeStamp = 2_000_000
        util = int(v["Utilization"]) if "Utilization" in v else 0
        self._fill(s.smUtil, 12.5 if self.value_type == 0 and i == 1 else util)
        self._fill(s.memUtil, 7)

    def _util_info(self, h, ref):
        info = ref._obj
        assert info.version == pynvml.VgpuInstancesUtilizationInfo_v1
        info.sampleValType = self.value_type
        if info.vgpuInstanceCount < len(self.ids):
            info.vgpuInstanceCount = len(self.ids)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        info.vgpuInstanceCount = len(self.ids)
        for i in range(len(self.ids)):
            self._sample(info.vgpuUtilArray[i], i, {"Utilization": 12 if i else 0})
        return pynvml.NVML_SUCCESS

    def _util_v0(self, h, stamp, vt_ref, count_ref, samples):
        vt_ref._obj.value = self.value_type
        if samples is None:
            count_ref._obj.value = len(self.ids)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i in range(len(self.ids)):
            self._sample(samples[i], i, {"Utilization": 12 if i else 0})
        return pynvml.NVML_SUCCESS

    def _nvmlGetFunctionPointer(self, name):
        if name == "nvmlDeviceGetVgpuInstancesUtilizationInfo":
            if not self.util_v1:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return self._util_info
        if name == "nvmlDeviceGetVgpuUtilization":
            return self._util_v0
        assert name == "nvmlVgpuInstanceGetFbUsage", name

        def fb(instance, ref):
            ref._obj.value = 128 * 1024 * 1024
            return pynvml.NVML_SUCCESS
        return fb


def _vf_records(store, owners):
    """vgpuhost's records of two vendor-VFIO vGPUs (VFs 0001:c8:00.4/.5) of the captured type."""
    with store.transaction() as conn:
        for n, owner in enumerate(owners):
            vf = f"0001:c8:00.{4 + n}"
            put_vgpu(conn, VgpuRecord(vf, "vendor-vfio", "0001:c8:00.0", vf, "1519",
                                      "RTX Pro 6000 Blackwell DC-3Q", owner, None, None, True,
                                      "2026-07-22T15:00:00+00:00"))


@pytest.mark.parametrize("mdev", [b"", b"00000000-0000-0000-0000-000000000000", None],
                         ids=["empty", "all-zero", "not-supported"])
def test_vendor_vfio_vgpus_of_the_capture_match_their_records(monkeypatch, tmp_path, mdev):
    lib = CaptureLib(mdev=mdev).install(monkeypatch)
    door = PynvmlMetering(PynvmlBackend.open())
    [g] = door.read({})
    assert g.bdf == "0001:c8:00.0"
    vms = [v["VM UUID"] for v in lib.vgpus]
    assert [(v.device, v.vm_id, v.type_name, v.gi_id) for v in g.vgpus] == [
        ("", vms[0], "RTX Pro 6000 Blackwell DC-3Q", None), ("", vms[1], "RTX Pro 6000 Blackwell DC-3Q", None)]
    store = StateStore(tmp_path / "state")
    _vf_records(store, vms)
    snap = Sampler(door, store, interval_s=10).tick()
    assert {(d.device, d.owner.domain_uuid, d.kind) for d in snap.devices} == {
        ("0001:c8:00.4", vms[0], "vgpu"), ("0001:c8:00.5", vms[1], "vgpu")}


def test_a_vgpu_of_another_vm_or_type_matches_no_record():
    recs = [VgpuRecord("0001:c8:00.4", "vendor-vfio", "0001:c8:00.0", "0001:c8:00.4", "1519",
                       "RTX Pro 6000 Blackwell DC-3Q", DOM, None, None, True, "")]
    fit = dict(gpu="0001:c8:00.0", device="", vm_id=DOM.upper(), type_name="NVIDIA RTX Pro 6000 Blackwell DC-3Q")
    assert match_vgpu_record(recs, **fit) is recs[0]
    assert match_vgpu_record(recs, **{**fit, "vm_id": "f0adb76f-7612-4c68-84b4-375a4e6c5476"}) is None
    assert match_vgpu_record(recs, **{**fit, "type_name": "RTX Pro 6000 Blackwell DC-6Q"}) is None
    assert match_vgpu_record(recs, **{**fit, "gpu": "0000:c8:00.0"}) is None
    assert match_vgpu_record(recs, **{**fit, "vm_id": ""}) is None


# ------------------------------------------------------------- the sample's value type

@pytest.mark.parametrize("util_v1", [True, False], ids=["InstancesUtilizationInfo", "VgpuUtilization"])
@pytest.mark.parametrize("value_type", range(7))
def test_utilisation_is_read_by_the_sample_type_the_driver_gives(monkeypatch, value_type, util_v1):
    CaptureLib(value_type=value_type, util_v1=util_v1).install(monkeypatch)
    door = PynvmlMetering(PynvmlBackend.open())
    [g] = door.read({})
    sm = [v.sample.sm for v in g.vgpus]
    assert sm == ([0.0, 12.5] if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE else [0.0, 12.0])
    assert [v.sample.mem for v in g.vgpus] == [7.0, 7.0]


def test_an_undefined_sample_type_gives_no_samples_not_a_guess(monkeypatch):
    CaptureLib(value_type=pynvml.NVML_VALUE_TYPE_COUNT).install(monkeypatch)
    [g] = PynvmlMetering(PynvmlBackend.open()).read({})
    assert len(g.vgpus) == 2 and all(v.sample is None for v in g.vgpus)


# ------------------------------------------------------------------------------ GPM

class GpmLib(CaptureLib):
    """A MIG GPU (1g.18gb GIs 3 and 5) holding ``types`` as {instance: (type name, GI)}, with
    GPM, counting the samples allocated and freed; ``fail_get`` GIs fail nvmlGpmMigSampleGet."""

    def __init__(self, types, fail_get=()):
        super().__init__()
        self.types = types
        self.ids = sorted(types)
        self.fail_get = set(fail_get)
        self.allocated, self.freed, self.got = [], [], []

    def nvmlDeviceGetMigMode(self, h):
        return [1, 1]

    def nvmlVgpuInstanceGetVmID(self, i):
        return (DOM.encode(), pynvml.NVML_VGPU_VM_ID_UUID)

    def nvmlVgpuInstanceGetType(self, i):
        return int(getattr(i, "value", i))

    def nvmlVgpuTypeGetName(self, t):
        return "NVIDIA " + self.types[t][0]

    def nvmlVgpuInstanceGetGpuInstanceId(self, i):
        return self.types[int(getattr(i, "value", i))][1]

    def _sample(self, s, i, v):
        s.vgpuInstance = self.ids[i]
        s.timeStamp = 2_000_000
        s.smUtil.uiVal = 50

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h, index, version=2):
        if index != pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.memorySizeMB, info.name = 19, 1, 16384, b"MIG 1g.18gb"
        return info

    def nvmlDeviceGetGpuInstanceById(self, h, gi):
        return gi

    def nvmlGpuInstanceGetInfo(self, gi):
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = gi, 19
        return info

    def nvmlGpmQueryDeviceSupport(self, h):
        s = pynvml.c_nvmlGpmSupport_t()
        s.isSupportedDevice = 1
        return s

    def nvmlGpmSampleAlloc(self):
        s = pynvml.c_nvmlGpmSample_t()
        self.allocated.append(id(s))
        self._alive = getattr(self, "_alive", []) + [s]          # ids stay unique while alive
        return s

    def nvmlGpmSampleFree(self, s):
        assert id(s) in self.allocated and id(s) not in self.freed, "freed twice or never allocated"
        self.freed.append(id(s))

    def nvmlGpmMigSampleGet(self, h, gi, sample):
        self.got.append(gi)
        if gi in self.fail_get:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return sample

    def nvmlGpmMetricsGet(self, mg):
        mg.metrics[0].value = 37.5
        mg.metrics[0].nvmlReturn = 0
        return mg

    def held(self):
        return sorted(set(self.allocated) - set(self.freed))


def test_a_failed_gpm_mig_sample_get_frees_its_sample(monkeypatch):
    lib = GpmLib({1: ("H200X-1-18C", 3), 2: ("H200X-1-18C", 5)}, fail_get={5}).install(monkeypatch)
    door = PynvmlMetering(PynvmlBackend.open())
    [g] = door.read({})
    assert g.gpm == "unavailable" and lib.got == [3, 5]
    assert lib.held() == [] and len(lib.allocated) == 2            # on main the sample of GI 5 leaked
    lib.fail_get.clear()
    door.read({})
    [g] = door.read({})
    assert (g.gpm, g.gi_sm) == ("ok", {3: 37.5, 5: 37.5})
    assert len(lib.held()) == 2                                   # the last sample of each GI, kept
    lib.types.pop(2)
    lib.ids = [1]
    door.read({})
    assert len(lib.held()) == 1                                   # GI 5's kept sample freed
    door.close()
    assert lib.held() == []


def test_gpm_meters_only_vgpus_that_own_the_whole_gpu_instance(monkeypatch, tmp_path):
    lib = GpmLib({1: ("H200X-1-18C", 3), 2: ("H200X-1-9C", 5)}).install(monkeypatch)
    door = PynvmlMetering(PynvmlBackend.open())
    door.read({})
    [g] = door.read({})
    assert g.gi_sm == {3: 37.5} and g.gi_not_metered == {5: GPM_NOT_WHOLE_INSTANCE}
    assert set(lib.got) == {3}                                    # no GPM sample of GI 5 at all
    snap = Sampler(door, StateStore(tmp_path / "state"), interval_s=10).tick()
    assert snap.gi_not_metered == (("0001:c8:00.0", 5, GPM_NOT_WHOLE_INSTANCE),)
    fams = {f.name: f for f in SnapshotCollector(lambda: snap, 10).collect()}
    [s] = fams["vgpuhost_gpu_instance_not_metered"].samples
    assert s.labels == {"gpu": "0001:c8:00.0", "gpu_instance": "5", "reason": GPM_NOT_WHOLE_INSTANCE}


@pytest.mark.parametrize("types, gi, why", [
    (["H200X-1-18C"], "1g.18gb", None),
    (["A100-1-5CME"], "1g.5gb+me", None),
    (["A100-1-5C", "A100-1-5C"], "1g.5gb", GPM_NOT_WHOLE_INSTANCE),     # two vGPUs share it
    (["H200X-1-9C"], "1g.18gb", GPM_NOT_WHOLE_INSTANCE),                # half its framebuffer
    (["L40S-24Q"], "1g.18gb", GPM_NOT_WHOLE_INSTANCE),                  # not MIG-backed
    (["H200X-1-18C"], None, GPM_UNKNOWN_SHARE),
    (["no such name"], "1g.18gb", GPM_UNKNOWN_SHARE),
])
def test_the_gpm_whole_instance_rule(types, gi, why):
    assert gpm_not_metered(types, gi) == why


# ---------------------------------------------------------------- the simulator agrees

def test_the_simulator_reports_a_vendor_vfio_vgpu_as_the_capture_shows(make_host, capsys):
    host = make_host("l40s-vendor-vfio")
    assert main(["--root", str(host.root), "--json", "vgpu", "create", "--profile", "L40S-24Q",
                 "--owner", DOM]) == 0
    vf = json.loads(capsys.readouterr().out)
    store = StateStore(host.state_dir)
    [rec] = store.vgpu_records()
    nv = metering_nvml(host)
    nv.freeze()
    nv.set_trace(rec.id, {"sm": 40, "vm": DOM.upper()})
    gpus = {g.bdf: g for g in nv.read({})}
    [v] = gpus[rec.gpu].vgpus
    # as the captured driver: no mdev UUID, the domain UUID as VM UUID, no GPU instance
    assert (v.device, v.vm_id, v.type_name, v.gi_id) == ("", DOM, "L40S-24Q", None), vf
    s = Sampler(nv, store, interval_s=10)
    s.tick()
    nv.advance(10)
    [d] = s.tick().devices
    assert (d.device, d.owner.domain_uuid) == (rec.id, DOM)
    assert d.sm_busy_s == pytest.approx(4.0, rel=1e-6)
