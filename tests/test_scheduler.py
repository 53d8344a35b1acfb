"""vGPU scheduler: the RmPVMRL encoder/decoder (docs/reference/hardware.md#vgpu-scheduling), its modprobe.d file, runtime NVML changes."""

from __future__ import annotations

import json

import pytest

from vgpuhost.ops import scheduler as sch
from vgpuhost.cli.main import main
from vgpuhost.model.errors import DeviceError, HostEnvironmentError, InputError, RefusedError
from vgpuhost.io.nvml import NvmlError
from vgpuhost.model.nvml import SchedulerCaps, SchedulerState
from vgpuhost.io.state import StateStore
from vgpuhost.model.values import PciAddress

S = SchedulerState


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err

GLOBAL_GOLDEN = (
    "# Written by vgpuhost ('vgpuhost scheduler set --persist'); edits may be replaced.\n"
    "# RmPVMRL: vGPU scheduler policy ('vgpuhost scheduler decode VALUE' explains a value).\n"
    "# Takes effect when the nvidia module is reloaded or the host reboots.\n"
    'options nvidia NVreg_RegistryDwords="RmPVMRL=0x11"\n'
)


def _conf(host):
    return (host.modprobe_d / "vgpuhost-scheduler.conf").read_text()


def _audit_paths(host):
    return [r.path for r in StateStore(host.state_dir, create=False).audit_rows()]


def test_persist_all_gpus_golden_and_idempotent(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = sch.persist(host, store, S("fixed-share", arr=True))
    assert out.changed and _conf(host) == GLOBAL_GOLDEN
    assert _audit_paths(host) == ["/etc/modprobe.d/vgpuhost-scheduler.conf"]
    assert any("reload" in n for n in out.notes)
    again = sch.persist(host, store, S("fixed-share", arr=True))
    assert not again.changed
    assert _audit_paths(host) == ["/etc/modprobe.d/vgpuhost-scheduler.conf"]   # no second write


def test_persist_per_device_entries_share_one_line(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    a, b = PciAddress.parse("0000:86:00.0"), PciAddress.parse("0000:81:00.0")
    sch.persist(host, store, S("fixed-share", arr=True), a)
    sch.persist(host, store, S("equal-share", arr=False, timeslice_ms=3), b)
    lines = _conf(host).splitlines()
    assert lines[-1] == ('options nvidia NVreg_RegistryDwordsPerDevice='
                         '"pci=0000:81:00.0;RmPVMRL=0x00030003;pci=0000:86:00.0;RmPVMRL=0x11"')
    assert sum("PerDevice" in line for line in lines) == 1
    # replacing one GPU's value keeps the other; a global value joins on its own line
    sch.persist(host, store, S("equal-share", arr=True, frequency_hz=960, avg_factor=60), a)
    sch.persist(host, store, S("best-effort"), [a, b], dry_run=True)       # dry run writes nothing
    conf = sch.read_conf(host)
    assert conf.value_for("0000:86:00.0") == 0x3C3C0001 and conf.value_for("0000:81:00.0") == 0x00030003
    assert conf.value_for(None) is None
    # all GPUs: the global key, per-GPU RmPVMRL dropped so every GPU gets it
    sch.persist(host, store, S("equal-share", arr=True))
    assert _conf(host).splitlines()[3:] == ['options nvidia NVreg_RegistryDwords="RmPVMRL=0x01"']
    assert len(_audit_paths(host)) == 4


def test_persist_keeps_other_keys_and_warns_about_other_files(make_host):
    host = make_host("a40-mdev")
    host.modprobe_d.mkdir(parents=True, exist_ok=True)
    (host.modprobe_d / "vgpuhost-scheduler.conf").write_text(
        'options nvidia NVreg_RegistryDwords="RmFoo=1;RmPVMRL=0x01"\n')
    (host.modprobe_d / "nvidia.conf").write_text('options nvidia NVreg_RegistryDwords="RMBar=2"\n')
    out = sch.persist(host, StateStore(host.state_dir), S("fixed-share", arr=True))
    assert _conf(host).splitlines()[-1] == 'options nvidia NVreg_RegistryDwords="RmFoo=1;RmPVMRL=0x11"'
    assert any("/etc/modprobe.d/nvidia.conf" in n for n in out.notes)


def test_cli_persist_and_decode(make_host, capsys):
    host = make_host("a40-mdev")
    root = str(host.root)
    code, out, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "fixed-share", "--all", "--persist")
    assert code == 0, err
    assert "wrote /etc/modprobe.d/vgpuhost-scheduler.conf: RmPVMRL=0x00000011 (all GPUs)" in out
    assert _conf(host) == GLOBAL_GOLDEN
    code, out, _ = run(capsys, "--root", root, "scheduler", "set", "--policy", "fixed-share", "--all", "--persist")
    assert code == 0 and out.startswith("no change:")
    code, out, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "equal-share", "--gpu",
                         "0000:81:00.0", "--timeslice-ms", "40", "--persist")
    assert code == 2 and "timeslice 40 ms out of range 1..30" in err
    code, out, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "equal-share", "--gpu",
                         "0000:99:00.0", "--persist")
    assert code == 2 and "no NVIDIA GPU at 0000:99:00.0" in err
    code, _, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "equal-share", "--persist")
    assert code == 2 and "--gpu BDF" in err
    code, _, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "equal-share", "--all",
                       "--frequency-hz", "480", "--persist")
    assert code == 2 and "go together" in err


def test_cli_decode_documented_value(capsys):
    code, out, _ = run(capsys, "scheduler", "decode", "0x3c3c0001")
    assert code == 0
    assert out.splitlines()[0] == "RmPVMRL=0x3c3c0001: equal share, ARR on, frequency 960 Hz, averaging factor 60"
    assert "bits 21:12 = 0x3c0  frequency 960 Hz" in out and "bits 31:24 = 0x3c   averaging factor 60" in out
    code, out, _ = run(capsys, "scheduler", "decode", "--json", "1010565121")
    doc = json.loads(out)
    assert code == 0 and doc["valid"] and doc["value"] == "0x3c3c0001"
    assert doc["state"] == {"policy": "equal-share", "arr": True, "timeslice_ms": None,
                            "frequency_hz": 960, "avg_factor": 60}
    assert doc["fields"]["timeslice_ms"] is None
    code, out, _ = run(capsys, "scheduler", "decode", "0x001f0003")
    assert code == 1 and "timeslice 31 ms out of range 1..30" in out
    code, _, err = run(capsys, "scheduler", "decode", "banana")
    assert code == 2 and err.count("\n") == 1


def test_cli_decode_weighted_scheduler_bit_is_valid(capsys):
    """0x09: equal share with the weighted scheduler off (bit 3, R590/R595's nvrm_registry.h): exit 0, not a
    reserved-bit problem (main refused it with "reserved bits 3:2 are set", exit 1)."""
    code, out, _ = run(capsys, "scheduler", "decode", "0x09")
    assert code == 0, out
    assert "weighted scheduler off (bit 3, R590 and R595)" in out.splitlines()[0] and "problem" not in out
    code, out, _ = run(capsys, "scheduler", "decode", "--json", "9")
    doc = json.loads(out)
    assert code == 0 and doc["valid"] and doc["fields"]["weighted_disable"] == 1 and doc["problems"] == []


# =============================================================================
# runtime form, against a fake NVML backend

class FakeNvml:
    """The NvmlBackend methods the scheduler uses, with call recording."""

    def __init__(self, gpus, *, caps=None, mig=False, vgpus=0, hetero=False, state=None, sticky=False):
        self.caps = caps or SchedulerCaps(policies=("best-effort", "equal-share", "fixed-share"), arr_supported=True)
        self.mig = {g: mig for g in gpus}
        self.vgpus = {g: vgpus for g in gpus}
        self.hetero = {g: hetero for g in gpus}
        self.state = {g: state or S("best-effort") for g in gpus}
        self.sticky = sticky          # set_* calls have no effect (read-back mismatch)
        self.calls = []

    def mig_mode(self, bdf):
        return (self.mig[bdf], self.mig[bdf])

    def scheduler_caps(self, bdf):
        return self.caps

    def scheduler_state(self, bdf):
        if self.mig[bdf]:
            raise NvmlError("nvmlDeviceGetVgpuSchedulerState", "NVMLError_NotSupported")
        return self.state[bdf]

    def set_scheduler_state(self, bdf, state):
        self.calls.append(("set_scheduler_state", bdf, state))
        if not self.sticky:
            self.state[bdf] = state

    def active_vgpus(self, bdf):
        return self.vgpus[bdf]

    def heterogeneous_mode(self, bdf):
        return self.hetero[bdf]

    def set_heterogeneous_mode(self, bdf, on):
        self.calls.append(("set_heterogeneous_mode", bdf, on))
        if not self.sticky:
            self.hetero[bdf] = on


@pytest.fixture
def l40s(make_host):
    host = make_host("l40s-vendor-vfio")
    gpus = sch.host_gpus(host)
    assert len(gpus) == 2
    return host, gpus


def test_runtime_set_reads_back_and_audits(l40s):
    host, gpus = l40s
    nv = FakeNvml(gpus)
    store = StateStore(host.state_dir)
    want = S("equal-share", arr=True, frequency_hz=480, avg_factor=30)
    out = sch.set_runtime(host, store, gpus[0], want, backend=nv)
    assert out.changed and nv.state[gpus[0]] == want and nv.state[gpus[1]] == S("best-effort")
    assert [r.path for r in store.audit_rows()] == [f"nvml:{gpus[0]}/vgpu-scheduler"]
    again = sch.set_runtime(host, store, gpus[0], want, backend=nv)     # idempotent
    assert not again.changed and len(nv.calls) == 1
    sch.set_runtime(host, store, "all", S("fixed-share", arr=False, timeslice_ms=2), backend=nv)
    assert all(nv.state[g] == S("fixed-share", arr=False, timeslice_ms=2) for g in gpus)


def test_runtime_refusals_change_nothing(l40s):
    host, gpus = l40s
    store = StateStore(host.state_dir)
    nv = FakeNvml(gpus)
    nv.vgpus[gpus[1]] = 2
    with pytest.raises(RefusedError) as ei:
        sch.set_runtime(host, store, "all", S("equal-share", arr=True), backend=nv)
    assert str(gpus[1]) in ei.value.message and "2 vGPU(s) running" in ei.value.message
    assert nv.calls == []                       # checked every GPU before touching any

    nv = FakeNvml(gpus, hetero=True)
    with pytest.raises(RefusedError, match="mixed-size mode: fixed share is not available"):
        sch.set_runtime(host, store, gpus[0], S("fixed-share", arr=True), backend=nv)
    sch.set_runtime(host, store, gpus[0], S("equal-share", arr=True), backend=nv)    # equal share is fine

    nv = FakeNvml(gpus, mig=True)
    with pytest.raises(RefusedError, match="MIG mode.*Software Scheduler is not supported in MIG mode"):
        sch.set_runtime(host, store, gpus[0], S("equal-share", arr=True), backend=nv)

    caps = SchedulerCaps(policies=("best-effort", "equal-share"), arr_supported=False, max_timeslice_ms=20)
    nv = FakeNvml(gpus, caps=caps)
    with pytest.raises(RefusedError, match="does not support the fixed-share scheduler"):
        sch.set_runtime(host, store, gpus[0], S("fixed-share", arr=False, timeslice_ms=2), backend=nv)
    with pytest.raises(InputError, match="timeslice 25 ms out of range 1..20"):
        sch.set_runtime(host, store, gpus[0], S("equal-share", arr=False, timeslice_ms=25), backend=nv)
    with pytest.raises(RefusedError, match="adaptive round robin"):
        sch.set_runtime(host, store, gpus[0], S("equal-share", arr=True, frequency_hz=480, avg_factor=2),
                        backend=nv)
    assert nv.calls == []
    out = sch.set_runtime(host, store, gpus[0], S("equal-share", arr=True), backend=nv)   # ARR off: default slice
    assert nv.state[gpus[0]] == S("equal-share", arr=False) and any("default time slice" in n for n in out.notes)

    with pytest.raises(InputError, match="no NVIDIA GPU at 0000:99:00.0"):
        sch.set_runtime(host, store, PciAddress.parse("0000:99:00.0"), S("best-effort"), backend=nv)


def test_runtime_read_back_mismatch_is_a_device_error(l40s):
    host, gpus = l40s
    nv = FakeNvml(gpus, sticky=True)
    with pytest.raises(DeviceError, match="reads back 'best effort'"):
        sch.set_runtime(host, StateStore(host.state_dir), gpus[0], S("equal-share", arr=True), backend=nv)


def test_runtime_dry_run_touches_nothing(l40s):
    host, gpus = l40s
    nv = FakeNvml(gpus)
    out = sch.set_runtime(host, None, "all", S("equal-share", arr=True), backend=nv, dry_run=True)
    assert out.changed and out.dry_run and nv.calls == []


def test_mixed_size_rules(l40s):
    host, gpus = l40s
    store = StateStore(host.state_dir)
    nv = FakeNvml(gpus, state=S("fixed-share", arr=True))
    with pytest.raises(RefusedError, match="fixed-share scheduler"):
        sch.mixed_size(host, store, gpus[0], True, backend=nv)
    nv = FakeNvml(gpus, vgpus=1)
    with pytest.raises(RefusedError, match="1 vGPU"):
        sch.mixed_size(host, store, gpus[0], True, backend=nv)
    assert not sch.mixed_size(host, store, gpus[0], False, backend=nv).changed   # already off: no refusal
    nv = FakeNvml(gpus)
    out = sch.mixed_size(host, store, gpus[0], True, backend=nv)
    assert out.changed and nv.hetero[gpus[0]] and not nv.hetero[gpus[1]]
    assert [r.path for r in store.audit_rows()] == [f"nvml:{gpus[0]}/vgpu-heterogeneous-mode"]
    nv = FakeNvml(gpus, sticky=True)
    with pytest.raises(DeviceError):
        sch.mixed_size(host, store, gpus[0], True, backend=nv)


def test_show_reports_state_and_persistent_value(l40s):
    host, gpus = l40s
    sch.persist(host, StateStore(host.state_dir), S("fixed-share", arr=True), gpus[1])
    nv = FakeNvml(gpus, state=S("equal-share", arr=False, timeslice_ms=2))
    nv.mig[gpus[1]] = True
    doc = sch.show(host, backend=nv)
    a, b = doc["gpus"]
    assert a["state"]["text"] == "equal share, ARR off, time slice 2 ms" and a["persistent"] is None
    assert b["state"] is None and b["errors"]["state"] == "NVMLError_NotSupported"
    assert b["persistent"] == {"value": "0x00000011", "scope": "this GPU", "text": sch.describe(sch.decode(0x11))}
    text = sch.show_text(doc)
    assert "MIG mode on" in text and "time slice 2 ms" in text


def test_cli_runtime_uses_the_backend(l40s, monkeypatch, capsys):
    host, gpus = l40s
    nv = FakeNvml(gpus)
    monkeypatch.setattr(sch, "open_backend", lambda h: nv)
    root = str(host.root)
    code, out, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "equal-share", "--gpu",
                         str(gpus[0]), "--frequency-hz", "960", "--avg-factor", "60")
    assert code == 0, err
    assert f"{gpus[0]}: best effort -> equal share, ARR on, frequency 960 Hz, averaging factor 60" in out
    nv.vgpus[gpus[1]] = 1
    code, _, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "fixed-share", "--gpu", str(gpus[1]))
    assert code == 2 and f"GPU {gpus[1]} has 1 vGPU(s) running" in err and err.count("\n") == 1
    code, out, _ = run(capsys, "--root", root, "--json", "scheduler", "show", "--gpu", str(gpus[0]))
    assert code == 0 and json.loads(out)["gpus"][0]["state"]["frequency_hz"] == 960

    # through the whole command line: invoking the subcommand alone would give it a context without
    # the group's '-h', and click keeps that help option on the command (docs/reference/cli.md would differ)
    code, out, _ = run(capsys, "--root", root, "vgpu", "mode", "--gpu", str(gpus[0]), "--mixed-size", "on")
    assert code == 0 and "mixed-size mode off -> on" in out


def test_backend_unavailable_is_one_line_exit_2(l40s, monkeypatch, capsys):
    host, gpus = l40s
    import vgpuhost.io.backends as nvml

    def no_module(h):
        raise ModuleNotFoundError("No module named 'vgpuhost.nvml_real'")

    monkeypatch.setattr(nvml, "backend_for", no_module)
    with pytest.raises(HostEnvironmentError, match="NVML is not available"):
        sch.open_backend(host)
    code, out, err = run(capsys, "--root", str(host.root), "scheduler", "show")
    assert code == 2 and out == "" and err.count("\n") == 1 and "NVML is not available" in err

    def no_driver(h):
        raise HostEnvironmentError("NVML library not found (NVMLError_LibraryNotFound)")

    monkeypatch.setattr(nvml, "backend_for", no_driver)
    code, _, err = run(capsys, "--root", str(host.root), "scheduler", "set", "--policy", "best-effort", "--all")
    assert code == 2 and err.count("\n") == 1 and "LibraryNotFound" in err


# =============================================================================
# through the simulated NVML (vgpuhost/sim/nvml.py) and the CLI

def _sim_ready():
    try:
        import vgpuhost.sim.nvml  # noqa: F401
    except ImportError:
        return False
    return True


sim_only = pytest.mark.skipif(not _sim_ready(), reason="simulated NVML not present")


@sim_only
def test_sim_runtime_set_show_and_refusals(make_host, capsys):
    host = make_host("l40s-vendor-vfio")
    root = str(host.root)
    code, out, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "fixed-share", "--all",
                         "--timeslice-ms", "3")
    assert code == 0, err
    assert "0000:21:00.0: best effort -> fixed share, ARR off, time slice 3 ms" in out
    code, out, _ = run(capsys, "--root", root, "scheduler", "set", "--policy", "fixed-share", "--all",
                       "--timeslice-ms", "3")
    assert code == 0 and out.count("no change") == 2
    code, out, _ = run(capsys, "--root", root, "--json", "scheduler", "show")
    doc = json.loads(out)
    assert [g["state"]["timeslice_ms"] for g in doc["gpus"]] == [3, 3]
    # mixed-size refused while fixed share is on; allowed after equal share
    with pytest.raises(RefusedError, match="fixed-share"):
        sch.mixed_size(host, StateStore(host.state_dir), PciAddress.parse("0000:21:00.0"), True)
    code, _, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "equal-share", "--gpu", "0000:21:00.0")
    assert code == 0, err
    out = sch.mixed_size(host, StateStore(host.state_dir), PciAddress.parse("0000:21:00.0"), True)
    assert out.changed
    code, _, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "fixed-share", "--gpu", "0000:21:00.0")
    assert code == 2 and "mixed-size mode" in err
    # a running vGPU blocks a change
    sch.mixed_size(host, StateStore(host.state_dir), PciAddress.parse("0000:21:00.0"), False)
    code, _, err = run(capsys, "--root", root, "vgpu", "create", "--profile", "L40S-4Q", "--gpu", "0000:21:00.0")
    assert code == 0, err
    code, _, err = run(capsys, "--root", root, "scheduler", "set", "--policy", "best-effort", "--gpu", "0000:21:00.0")
    assert code == 2 and "GPU 0000:21:00.0 has 1 vGPU(s) running" in err


@sim_only
def test_sim_mig_and_plain_driver_refused_in_one_line(make_host, capsys):
    from vgpuhost.io.backends import backend_for
    host = make_host("h200-mig")
    gpu = sch.host_gpus(host)[0]
    backend_for(host).set_mig_mode(gpu, True)
    code, _, err = run(capsys, "--root", str(host.root), "scheduler", "set", "--policy", "equal-share", "--all")
    assert code == 2 and err.count("\n") == 1 and "Software Scheduler is not supported in MIG mode" in err
    host = make_host("turing-consumer")
    code, _, err = run(capsys, "--root", str(host.root), "scheduler", "set", "--policy", "equal-share", "--all")
    assert code == 2 and err.count("\n") == 1 and "NVMLError_NotSupported" in err
