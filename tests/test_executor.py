"""The one Executor: execute, verify, audit and undo-on-failure for sysfs, config-file and NVML steps.

Outcomes are read back from the simulated sysfs tree, the files under the
host root, a recording NVML backend and the state store's audit rows.
"""

from __future__ import annotations

import errno
import os

import pytest

from vgpuhost.io.nvml import NvmlError
from vgpuhost.model.nvml import GpuInstance, SchedulerState
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.errors import DeviceError, SysfsError
from vgpuhost.model.values import PciAddress
from vgpuhost.plan.executor import Executor, describe
from vgpuhost.plan.steps import (CreateGi, DestroyGi, Probe, RemoveConfig, SetDriverOverride, SetMigMode,
                                 SetMixedSize, SetScheduler, Unbind, VerifyDriver, WriteConfig)

A = PciAddress.parse
GPU = A("0000:41:00.0")

TURING = """
version: 1
name: turing-lab
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, snd_hda_intel]
devices:
  - {bdf: "0000:00:01.0", model: intel-root-port}
  - {bdf: "0000:01:00.0", model: RTX2080-TU104, upstream: "0000:00:01.0"}
  - {bdf: "0000:01:00.1", model: tu104-hda, upstream: "0000:00:01.0"}
"""


def rows(host):
    return [(r.operation, r.path, r.value, r.result) for r in StateStore(host.state_dir).audit_rows()]


def executor(host, op="test op", **kw):
    return Executor(host, StateStore(host.state_dir), actor="test", operation=op, **kw)


class FakeNvml:
    """The NVML calls the steps make, recorded; ``fail`` names calls that raise, ``sticky`` ones that do nothing."""

    def __init__(self, *, fail=(), sticky=()):
        self.fail, self.sticky = dict(fail), set(sticky)
        self.calls = []
        self.hetero = False
        self.sched = SchedulerState("best-effort")
        self.gis = {}
        self.mode = (False, False)
        self.full = set()             # GI profile ids with no room left

    def _call(self, name, *args):
        self.calls.append((name, *args))
        if name in self.fail:
            raise NvmlError(name, self.fail[name])

    def set_heterogeneous_mode(self, bdf, on):
        self._call("nvmlDeviceSetVgpuHeterogeneousMode", on)
        if "hetero" not in self.sticky:
            self.hetero = on

    def heterogeneous_mode(self, bdf):
        return self.hetero

    def set_scheduler_state(self, bdf, state):
        self._call("nvmlDeviceSetVgpuSchedulerState", state)
        self.sched = state

    def scheduler_state(self, bdf):
        return self.sched

    def set_mig_mode(self, bdf, enabled):
        self._call("nvmlDeviceSetMigMode", enabled)
        self.mode = (enabled, enabled)
        return self.mode

    def create_gpu_instance(self, bdf, profile_id, start):
        self._call("nvmlDeviceCreateGpuInstanceWithPlacement", profile_id, start)
        if profile_id in self.full:
            raise NvmlError("nvmlDeviceCreateGpuInstanceWithPlacement", "NVMLError_InsufficientResources")
        gi = GpuInstance(len(self.gis) + 1, profile_id, start, 1)
        self.gis[gi.gi_id] = gi
        return gi

    def destroy_gpu_instance(self, bdf, gi_id):
        self._call("nvmlGpuInstanceDestroy", gi_id)
        del self.gis[gi_id]


# ---------------------------------------------------------------------------
# sysfs steps

def test_sysfs_steps_run_and_audit_one_row_per_write(make_host):
    host = make_host(yaml_text=TURING)
    gpu = A("0000:01:00.0")
    steps = [SetDriverOverride(gpu, "vfio-pci"), Unbind(gpu, "nvidia"), Probe(gpu), VerifyDriver(gpu, "vfio-pci")]
    assert describe(host, steps) == [
        "write 'vfio-pci' to /sys/bus/pci/devices/0000:01:00.0/driver_override",
        "write '0000:01:00.0' to /sys/bus/pci/drivers/nvidia/unbind",
        "write '0000:01:00.0' to /sys/bus/pci/drivers_probe",
        "check /sys/bus/pci/devices/0000:01:00.0/driver is vfio-pci"]
    ex = executor(host)
    ex.run(steps)
    assert Sysfs(host).link_name(host.pci_device(gpu) / "driver") == "vfio-pci"
    # the check writes no row; each kernel write one, as it happened
    assert rows(host) == [
        ("test op", "/sys/bus/pci/devices/0000:01:00.0/driver_override", "vfio-pci", "ok"),
        ("test op", "/sys/bus/pci/drivers/nvidia/unbind", "0000:01:00.0", "ok"),
        ("test op", "/sys/bus/pci/drivers_probe", "0000:01:00.0", "ok")]
    assert ex.writes == 3


def test_a_failed_kernel_write_is_audited_with_its_errno_and_re_raised(make_host):
    host = make_host(yaml_text=TURING)
    gpu = A("0000:01:00.0")
    ex = executor(host)
    with pytest.raises(SysfsError) as ei:
        ex.run([Unbind(gpu, "snd_hda_intel")])         # not bound there: the kernel says ENODEV
    assert ei.value.errno == errno.ENODEV and ex.failed == Unbind(gpu, "snd_hda_intel")
    assert rows(host)[-1][1:] == ("/sys/bus/pci/drivers/snd_hda_intel/unbind", "0000:01:00.0", "ENODEV")


def test_a_failed_check_raises_device_error(make_host):
    host = make_host(yaml_text=TURING)
    gpu = A("0000:01:00.0")
    with pytest.raises(DeviceError, match="bound to nvidia after drivers_probe, expected vfio-pci"):
        executor(host).run([VerifyDriver(gpu, "vfio-pci")])
    assert rows(host) == []


# ---------------------------------------------------------------------------
# configuration-file steps

def test_config_write_is_atomic_audited_verified_and_undone(make_host):
    host = make_host(yaml_text=TURING)
    new = host.etc("modprobe.d", "vgpuhost-test.conf")
    old = host.driverctl_d / "pci-0000:01:00.1"
    old.parent.mkdir(parents=True, exist_ok=True)
    old.write_text("snd_hda_intel\n")
    steps = [WriteConfig(new, "options vfio-pci ids=10de:1e87\n"), WriteConfig(old, "vfio-pci\n"),
             Unbind(A("0000:01:00.0"), "snd_hda_intel")]                    # fails: ENODEV
    assert describe(host, steps[:2]) == ["write 'options vfio-pci ids=10de:1e87' to /etc/modprobe.d/vgpuhost-test.conf",
                                         "write 'vfio-pci' to /etc/driverctl.d/pci-0000:01:00.1"]
    ex = executor(host)
    with pytest.raises(SysfsError):
        ex.run(steps)
    # undone in reverse: the old override back, the new file gone
    assert not new.exists() and old.read_text() == "snd_hda_intel\n" and ex.undo_ok
    assert [r[1:] for r in rows(host)] == [
        ("/etc/modprobe.d/vgpuhost-test.conf", "options vfio-pci ids=10de:1e87", "ok"),
        ("/etc/driverctl.d/pci-0000:01:00.1", "vfio-pci", "ok"),
        ("/sys/bus/pci/drivers/snd_hda_intel/unbind", "0000:01:00.0", "ENODEV"),
        ("/etc/driverctl.d/pci-0000:01:00.1", "snd_hda_intel", "ok"),
        ("/etc/modprobe.d/vgpuhost-test.conf", "<remove>", "ok")]
    assert not list(new.parent.glob(".*vgpuhost-tmp"))


def test_config_remove_is_undone_by_writing_the_text_back(make_host):
    host = make_host(yaml_text=TURING)
    unit = host.etc("systemd", "system", "vgpuhost-test.service")
    text = "[Unit]\nDescription=test\n\n[Service]\nExecStart=/bin/true\n"
    ex = executor(host)
    ex.run([WriteConfig(unit, text)])
    assert unit.read_text() == text
    assert rows(host)[-1][2] == "<5 lines, 55 bytes: [Unit]>"          # a long file is summarised
    assert describe(host, [WriteConfig(unit, text)]) == ["write /etc/systemd/system/vgpuhost-test.service (5 lines)"]
    with pytest.raises(SysfsError):
        ex.run([RemoveConfig(unit), Unbind(A("0000:01:00.0"), "snd_hda_intel")])
    assert unit.read_text() == text
    # removing a file that is not there changes nothing and writes no row
    n = len(rows(host))
    ex.run([RemoveConfig(host.etc("modprobe.d", "absent.conf"))])
    assert len(rows(host)) == n


# ---------------------------------------------------------------------------
# NVML steps

def test_nvml_steps_audit_one_row_each_and_undo_in_reverse(make_host):
    host = make_host(yaml_text=TURING)
    nv = FakeNvml(fail={"nvmlDeviceSetVgpuSchedulerState": "NVMLError_InUse"})
    eq = SchedulerState("equal-share", arr=False, timeslice_ms=2)
    ex = executor(host, backend=nv)
    steps = [SetMixedSize(GPU, True), SetScheduler(GPU, eq, SchedulerState("best-effort"))]
    assert describe(host, steps) == [f"turn mixed-size vGPU mode on on {GPU}",
                                     f"set the vGPU scheduler of {GPU} to equal share, ARR off, time slice 2 ms"]
    with pytest.raises(NvmlError):
        ex.run(steps)
    assert nv.hetero is False and ex.undo_ok and ex.failed == steps[1]
    assert [r[1:] for r in rows(host)] == [
        (f"nvml:{GPU}/vgpu-heterogeneous-mode", "on", "ok"),
        (f"nvml:{GPU}/vgpu-scheduler", "equal share, ARR off, time slice 2 ms", "EIO"),
        (f"nvml:{GPU}/vgpu-heterogeneous-mode", "off", "ok")]


def test_mig_steps_keep_their_audit_rows_and_undo_created_instances(make_host):
    host = make_host(yaml_text=TURING)
    nv = FakeNvml()
    ex = executor(host, backend=nv)
    ok = CreateGi(GPU, 9, "3g.71gb", 4, 4)
    ex.run([SetMigMode(GPU, True), ok])
    assert nv.mode == (True, True) and list(nv.gis) == [1]
    nv.full.add(19)
    with pytest.raises(NvmlError):
        ex.run([DestroyGi(GPU, 1, "3g.71gb", 4, 4, 9), CreateGi(GPU, 19, "1g.18gb", 0, 1)])
    # the destroyed instance was created again where it was
    assert [g.profile_id for g in nv.gis.values()] == [9]
    assert [r[1:] for r in rows(host)] == [
        ("nvml:nvmlDeviceSetMigMode", f"gpu={GPU} mode=1", "ok"),
        ("nvml:nvmlDeviceCreateGpuInstanceWithPlacement", f"gpu={GPU} profile=9 (3g.71gb) start=4 size=4", "ok"),
        ("nvml:nvmlGpuInstanceDestroy", f"gpu={GPU} gi=1 (3g.71gb) start=4", "ok"),
        ("nvml:nvmlDeviceCreateGpuInstanceWithPlacement",
         f"gpu={GPU} profile=19 (1g.18gb) start=0 size=1 -> NVMLError_InsufficientResources", "ENOSPC"),
        ("nvml:nvmlDeviceCreateGpuInstanceWithPlacement", f"gpu={GPU} profile=9 (3g.71gb) start=4 size=4", "ok")]


def test_a_step_that_ran_but_does_not_read_back_is_undone_too(make_host):
    host = make_host(yaml_text=TURING)
    nv = FakeNvml(sticky={"hetero"})
    ex = executor(host, backend=nv)
    with pytest.raises(DeviceError, match="mixed-size mode reads back off after turning it on"):
        ex.run([SetMixedSize(GPU, True)])
    assert [c[0:2] for c in nv.calls] == [("nvmlDeviceSetVgpuHeterogeneousMode", True),
                                          ("nvmlDeviceSetVgpuHeterogeneousMode", False)]


def test_an_undo_that_fails_is_reported_and_the_rest_still_undone(make_host):
    host = make_host(yaml_text=TURING)
    nv = FakeNvml()
    ex = executor(host, backend=nv)
    steps = [SetMigMode(GPU, True), SetMixedSize(GPU, True), SetScheduler(GPU, SchedulerState("equal-share"))]
    nv.fail["nvmlDeviceSetVgpuSchedulerState"] = "NVMLError_InUse"

    real = nv.set_heterogeneous_mode

    def refuse_off(bdf, on):
        if not on:
            raise NvmlError("nvmlDeviceSetVgpuHeterogeneousMode", "NVMLError_InUse")
        real(bdf, on)
    nv.set_heterogeneous_mode = refuse_off
    with pytest.raises(NvmlError):
        ex.run(steps)
    assert not ex.undo_ok and len(ex.undo_errors) == 1
    assert nv.mode == (False, False)                  # undone although the step after it failed to undo


def test_interrupt_undoes_and_re_raises(make_host):
    host = make_host(yaml_text=TURING)
    nv = FakeNvml()

    class Boom(SetMixedSize):
        def run(self, ctx):
            raise KeyboardInterrupt
    ex = executor(host, backend=nv)
    with pytest.raises(KeyboardInterrupt):
        ex.run([SetMigMode(GPU, True), Boom(GPU, True)])
    assert nv.mode == (False, False)


def test_the_journal_seam_sees_begin_each_step_and_end(make_host):
    host = make_host(yaml_text=TURING)
    seen = []

    class Journal:
        def begin(self, ex, steps):
            seen.append(("begin", ex.operation, len(steps)))

        def step_done(self, ex, i, step):
            seen.append(("done", i))

        def end(self, ex, error):
            seen.append(("end", type(error).__name__ if error else None))

    nv = FakeNvml(fail={"nvmlDeviceSetVgpuSchedulerState": "NVMLError_InUse"})
    ex = executor(host, backend=nv, journal=Journal())
    ex.run([SetMixedSize(GPU, True)])
    with pytest.raises(NvmlError):
        ex.run([SetMixedSize(GPU, False), SetScheduler(GPU, SchedulerState("equal-share"))])
    assert seen == [("begin", "test op", 1), ("done", 0), ("end", None),
                    ("begin", "test op", 2), ("done", 0), ("end", "NvmlError")]


def test_no_store_no_rows_but_writes_counted(make_host):
    host = make_host(yaml_text=TURING)
    ex = Executor(host, None, actor="test", operation="op", backend=FakeNvml())
    ex.run([SetMixedSize(GPU, True), WriteConfig(host.etc("x.conf"), "x\n")])
    assert ex.writes == 2 and not host.state_dir.exists()


def test_each_nvml_write_that_moves_offers_rewrites_the_driver_token_made_or_failed(make_host):
    """The agent's fingerprint (io.changes) reads the driver-state token: every MIG or mixed-size call,
    made or failed, leaves a token no fingerprint read before it holds; a scheduler call and a kernel
    write leave it alone."""
    from vgpuhost.io.changes import fingerprint
    host = make_host(yaml_text=TURING)
    nv = FakeNvml(fail={"nvmlDeviceSetMigMode": "NVMLError_InUse"})
    ex = executor(host, backend=nv)
    seen = [fingerprint(host)[4]]
    assert seen == [""]                                     # no MIG change yet: no token
    ex.run([SetMixedSize(GPU, True)])
    seen.append(fingerprint(host)[4])
    ex.run([CreateGi(GPU, 9, "3g.71gb", 4, 4)])
    seen.append(fingerprint(host)[4])
    with pytest.raises(NvmlError):
        ex.run([SetMigMode(GPU, True)])
    seen.append(fingerprint(host)[4])
    assert len(set(seen)) == 4 and all(len(t) == 24 for t in seen[1:])
    ex.run([SetScheduler(GPU, SchedulerState("equal-share", arr=False, timeslice_ms=2))])
    ex.run([SetDriverOverride(A("0000:01:00.1"), "vfio-pci")])
    assert fingerprint(host)[4] == seen[-1]
    # no temporary file left; the token's lock file (own_changes: read and replaced under it) beside it
    assert sorted(n for n in os.listdir(host.state_dir) if n.startswith("driver-state")) == \
        ["driver-state.token", "driver-state.token.lock"]
