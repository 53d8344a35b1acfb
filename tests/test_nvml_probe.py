"""bench/nvml_probe.py, CPU only: its checklist of what is unverified on hardware (printed,
in its JSON and in docs/reference/hardware.md), and its read-only confirmation of the GI
profile ids and the metering calls, against tests/test_nvml_real.py's stand-in H200."""

from __future__ import annotations

import ctypes
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pynvml = pytest.importorskip("pynvml")

from test_nvml_real import FakeNvml, _trap_everything_else, no_nvml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "bench" / "nvml_probe.py"


class MeteringH200(FakeNvml):
    """The stand-in H200 with the C-level metering calls: InstancesUtilizationInfo reports
    doubles, the older call unsigned ints, one sample each; GPM supported."""

    def _util_info(self, h, ref):
        info = ref._obj
        info.sampleValType = pynvml.NVML_VALUE_TYPE_DOUBLE
        if not info.vgpuInstanceCount:
            info.vgpuInstanceCount = 1
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        info.vgpuUtilArray[0].smUtil.dVal = 12.5
        return pynvml.NVML_SUCCESS

    def _util_v0(self, h, stamp, vt_ref, count_ref, samples):
        assert stamp.value == 0
        vt_ref._obj.value = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        if samples is None:
            count_ref._obj.value = 1
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        return pynvml.NVML_SUCCESS

    def _nvmlGetFunctionPointer(self, name):
        if name == "nvmlDeviceGetVgpuInstancesUtilizationInfo":
            return self._util_info
        if name == "nvmlDeviceGetVgpuUtilization":
            return self._util_v0
        return super()._nvmlGetFunctionPointer(name)

    def nvmlGpmQueryDeviceSupport(self, h):
        s = pynvml.c_nvmlGpmSupport_t()
        s.isSupportedDevice = 1
        return s


def _run(monkeypatch, tmp_path, fake):
    fake.install(monkeypatch)
    mutated = _trap_everything_else(fake, monkeypatch)
    mod = runpy.run_path(str(PROBE), run_name="nvml_probe")
    out = tmp_path / "probe.json"
    before = (list(fake.mig), dict(fake.gis), fake.het_mode)
    assert mod["main"](["--out", str(out)]) == 0
    assert mutated == [] and (list(fake.mig), dict(fake.gis), fake.het_mode) == before
    return mod, json.loads(out.read_text())


def test_the_probe_confirms_gi_ids_and_the_metering_calls_read_only(monkeypatch, tmp_path):
    mod, data = _run(monkeypatch, tmp_path, MeteringH200())
    [d] = data["devices"]
    assert d["gi_profile_ids"] == {"1g.18gb": 19, "1g.18gb+me": 20, "1g.35gb": 15, "2g.35gb": 14, "3g.71gb": 9,
                                   "4g.71gb": 5, "7g.141gb": 0}
    m = d["metering"]
    assert m["nvmlDeviceGetVgpuInstancesUtilizationInfo"] == {"sample_value_type": 0,
                                                              "name": "NVML_VALUE_TYPE_DOUBLE", "samples": 1}
    assert m["nvmlDeviceGetVgpuUtilization"] == {"sample_value_type": 1, "name": "NVML_VALUE_TYPE_UNSIGNED_INT",
                                                 "samples": 1}
    assert m["nvmlGpmQueryDeviceSupport"] == {"isSupportedDevice": 1}
    assert data["checklist"] == list(mod["CHECKLIST"]) and len(data["checklist"]) >= 5


def test_a_driver_without_the_metering_calls_is_recorded_in_place(monkeypatch, tmp_path):
    class Old(MeteringH200):
        def _nvmlGetFunctionPointer(self, name):
            if name.startswith("nvmlDeviceGetVgpu"):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return super()._nvmlGetFunctionPointer(name)
    _mod, data = _run(monkeypatch, tmp_path, Old())
    m = data["devices"][0]["metering"]
    assert m["nvmlDeviceGetVgpuUtilization"] == {"error": "NVMLError_FunctionNotFound",
                                                 "call": "nvmlDeviceGetVgpuUtilization"}


def test_the_checklist_is_printed_without_nvml_and_kept_in_the_reference():
    r = subprocess.run([sys.executable, str(PROBE), "--checklist"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    mod = runpy.run_path(str(PROBE), run_name="nvml_probe")
    assert r.stdout.splitlines() == [f"- {item}" for item in mod["CHECKLIST"]]
    hw = (REPO / "docs" / "reference" / "hardware.md").read_text()
    section = hw.split("## Unverified on hardware", 1)[1].split("\n## ", 1)[0]
    for item in mod["CHECKLIST"]:
        assert f"- {item}" in section, item


@no_nvml
def test_without_nvml_the_probe_says_so_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    [line] = r.stderr.strip().splitlines()
    assert "NVML is not available" in line and "no NVML" in line and "Traceback" not in r.stderr
