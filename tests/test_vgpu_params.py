"""``nvidia/vgpu_params`` as NVIDIA's driver keeps it, and vgpuhost's writes of it.

The driver's ``vgpu_params_store`` keeps ``count - 1`` bytes (it expects the newline ``echo``
adds, whatever the last byte is), refuses a write over 1024 bytes with E2BIG and any write while
the vGPU is open with EPERM; a vendor-VFIO VF's ``nvidia/`` has no ``vgpu_params``
(docs/reference/hardware.md#mdev, #vendor-vfio).  Read back from the simulated tree.
"""

from __future__ import annotations

import errno

import pytest

from vgpuhost.cli.main import main
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.io.state import StateStore, delete_vgpu, put_vgpu
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.errors import SysfsError
from vgpuhost.model.values import replace
from vgpuhost.ops.vgpu import create, reconcile
from vgpuhost.sim.kernel import SimKernel

A40 = "0000:81:00.0"
A40_8Q = "nvidia-566"
MDEV = "aaaaaaaa-2222-4333-8444-0000000000c1"


def cli(capsys, host: HostRoot, *argv):
    code = main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def params_file(host: HostRoot, uuid: str):
    return host.mdev_devices / uuid / "nvidia" / "vgpu_params"


def mdev(host: HostRoot) -> str:
    Sysfs(host).write(host.mdev_bus / A40 / "mdev_supported_types" / A40_8Q / "create", MDEV)
    return MDEV


def write_errno(fs: Sysfs, path, value: str) -> int:
    with pytest.raises(SysfsError) as e:
        fs.write(path, value)
    return e.value.errno


def test_the_driver_keeps_all_but_the_last_byte(make_host):
    host = make_host("a40-mdev")
    fs = Sysfs(host)
    p = params_file(host, mdev(host))
    fs.write(p, "frame_rate_limiter=0")                  # no newline: the last character is lost
    assert p.read_text() == "frame_rate_limiter=\n"
    fs.write(p, "frame_rate_limiter=0\n")
    assert p.read_text() == "frame_rate_limiter=0\n"
    fs.write(p, "\n")                                    # a lone newline clears it
    assert p.read_text() == "\n"


def test_over_1024_bytes_is_e2big_and_1024_fit(make_host):
    host = make_host("a40-mdev")
    fs = Sysfs(host)
    p = params_file(host, mdev(host))
    fs.write(p, "a=1\n")
    assert write_errno(fs, p, "k=" + "x" * 1022 + "\n") == errno.E2BIG         # 1025 bytes
    assert p.read_text() == "a=1\n"
    fs.write(p, "k=" + "x" * 1021 + "\n")                                      # 1024 bytes: 1023 kept
    assert p.read_text() == "k=" + "x" * 1021 + "\n"


def test_a_write_while_the_vgpu_is_open_is_eperm(make_host):
    host = make_host("a40-mdev")
    fs = Sysfs(host)
    uuid = mdev(host)
    p = params_file(host, uuid)
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(uuid)
    assert write_errno(fs, p, "frame_rate_limiter=0\n") == errno.EPERM
    assert p.read_text() == "\n"
    kernel.close_vgpu(pid)
    fs.write(p, "frame_rate_limiter=0\n")
    assert p.read_text() == "frame_rate_limiter=0\n"


def test_vgpuhost_writes_the_params_with_a_newline_so_they_are_kept_whole(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q", params="frame_rate_limiter=0")
    assert params_file(host, out.id).read_text() == "frame_rate_limiter=0\n"
    assert store.vgpu_records()[0].params == "frame_rate_limiter=0"
    # reconcile re-creates a lost vGPU with its params whole too
    Sysfs(host).write(host.mdev_devices / out.id / "remove", "1")
    assert reconcile(host, store).recreated == [out.id]
    assert params_file(host, out.id).read_text() == "frame_rate_limiter=0\n"


def test_a_vf_has_no_vgpu_params_so_params_are_refused_there_not_failed(make_host, capsys):
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    vf = "0000:21:00.4"
    assert not (host.pci_device(vf) / "nvidia" / "vgpu_params").exists()
    rows = len(store.audit_rows())
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-8Q", "--params", "frame_rate_limiter=0")
    assert code == 2 and err.count("\n") == 1, err
    assert "vgpu_params are not supported here" in err and "without --params" in err
    assert store.vgpu_records() == [] and Sysfs(host).read(host.pci_device(vf) / "nvidia" / "current_vgpu_type") == "0"
    assert not [r for r in store.audit_rows()[rows:] if r.path.startswith("/sys/")]      # nothing written


def test_reconcile_recreates_a_vf_vgpu_without_the_params_it_cannot_set(make_host):
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="L40S-8Q")
    rec = store.vgpu_records()[0]
    with store.transaction() as conn:                    # recorded with params (an older vgpuhost)
        delete_vgpu(conn, rec.id)
        put_vgpu(conn, replace(rec, params="frame_rate_limiter=0"))
    Sysfs(host).write(host.pci_device(out.id) / "nvidia" / "current_vgpu_type", "0")     # lost
    report = reconcile(host, store)
    assert report.recreated == [out.id] and report.failed == []
    assert Sysfs(host).read(host.pci_device(out.id) / "nvidia" / "current_vgpu_type") == out.type_id
