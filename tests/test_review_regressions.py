"""Regressions from the fresh-eyes review of passthrough and vGPU: each test
reads the outcome back from the simulated tree, the store or the CLI."""

from __future__ import annotations

import json
import os

import pytest

from vgpuhost.cli.main import main
from vgpuhost.model.errors import DeviceError, RefusedError
from vgpuhost.ops.passthrough import prepare, release
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress
from vgpuhost.ops.vgpu import create, reconcile

from test_passthrough import GPU, ORIGINAL, drivers, overrides, turing

A = PciAddress.parse
L40S = A("0000:21:00.0")


def cli(capsys, host, *argv):
    code = main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_passthrough_refuses_a_vendor_vfio_gpu_carrying_vgpus(make_host):
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    create(host, store, profile="L40S-8Q", gpu=L40S)
    rows = len(store.audit_rows())
    with pytest.raises(RefusedError, match="carries vGPUs"):
        prepare(host, store, L40S)
    assert len(store.audit_rows()) == rows
    assert Sysfs(host).link_name(host.pci_device(L40S) / "driver") == "nvidia"


def l40s_first_vfs_off(make_host):
    """l40s-vendor-vfio after ``sriov-manage -d 0000:21:00.0``: vfio-pci binds no PF with VFs enabled
    (issue 12 #4c), so that L40S can be passed through; the other keeps its 16 VFs."""
    from pathlib import Path
    from vgpuhost.sim.data import bundled_specs
    text = Path(bundled_specs()["l40s-vendor-vfio"]).read_text()
    first = '    numa_node: 0\n    vgpu: {backend: vendor-vfio, sriov_numvfs: 16}\n'
    assert first in text
    return make_host(yaml_text=text.replace(first, '    numa_node: 0\n'))


def test_vgpu_create_refuses_a_passed_through_gpu(make_host, capsys):
    host = l40s_first_vfs_off(make_host)
    prepare(host, StateStore(host.state_dir), L40S)
    rows = len(StateStore(host.state_dir).audit_rows())
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-8Q", "--gpu", str(L40S))
    assert code == 2 and "passed through" in err and err.count("\n") == 1
    assert len(StateStore(host.state_dir).audit_rows()) == rows
    # without --gpu it lands on the other L40S
    out = create(host, StateStore(host.state_dir), profile="L40S-8Q")
    assert out.gpu == "0000:a1:00.0"


def test_prepare_persist_failure_rolls_the_group_back(make_host):
    host = turing(make_host)
    host.driverctl_d.parent.mkdir(parents=True, exist_ok=True)
    host.driverctl_d.write_text("not a directory")
    store = StateStore(host.state_dir)
    with pytest.raises(DeviceError) as ei:
        prepare(host, store, GPU, persist=True)
    assert "--persist could not write" in ei.value.message and "went back to its drivers" in ei.value.message
    assert drivers(host) == ORIGINAL and set(overrides(host).values()) == {"(null)"}
    assert store.passthrough_records() == []


def test_prepare_refuses_to_overwrite_a_foreign_driverctl_override(make_host):
    host = turing(make_host)
    host.driverctl_d.mkdir(parents=True)
    (host.driverctl_d / "pci-0000:01:00.1").write_text("nouveau\n")
    with pytest.raises(RefusedError, match="another driverctl override"):
        prepare(host, StateStore(host.state_dir), GPU, persist=True)
    assert (host.driverctl_d / "pci-0000:01:00.1").read_text() == "nouveau\n"
    assert drivers(host) == ORIGINAL
    release(host, StateStore(host.state_dir), GPU, persist=True)     # never deletes it either
    assert (host.driverctl_d / "pci-0000:01:00.1").read_text() == "nouveau\n"


def test_interrupted_prepare_rolls_back(make_host, monkeypatch):
    from vgpuhost.plan import steps
    host = turing(make_host)
    real = steps.Probe.run
    calls = {"n": 0}

    def probe(self, fs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real(self, fs)
    monkeypatch.setattr(steps.Probe, "run", probe)
    with pytest.raises(KeyboardInterrupt):
        prepare(host, StateStore(host.state_dir), GPU)
    monkeypatch.setattr(steps.Probe, "run", real)
    assert drivers(host) == ORIGINAL and set(overrides(host).values()) == {"(null)"}


def test_persist_keeps_params_and_a_failed_persist_removes_the_vgpu(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q", params="frame_rate_limiter=0", persist=True)
    doc = json.loads((host.mdevctl_d / out.parent / out.id).read_text())
    assert doc == {"mdev_type": "nvidia-566", "start": "auto", "attrs": [{"nvidia/vgpu_params": "frame_rate_limiter=0"}]}
    (host.mdevctl_d / out.parent).chmod(0o500)
    blocker = host.mdevctl_d / "0000:81:00.0"
    blocker.chmod(0o755)
    # make the parent dir a file so the write fails even for root
    import shutil
    shutil.rmtree(blocker)
    blocker.write_text("x")
    with pytest.raises(DeviceError, match="--persist could not write") as ei:
        create(host, store, profile="A40-8Q", persist=True)
    assert "was removed again" in ei.value.message
    assert len(store.vgpu_records()) == 1 and len(os.listdir(host.mdev_devices)) == 1


def test_a_reused_mdev_uuid_with_another_type_is_reported(make_host, capsys):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")
    fs = Sysfs(host)
    fs.write(host.mdev_devices / out.id / "remove", "1")
    fs.write(host.mdev_bus / "0000:81:00.0" / "mdev_supported_types" / "nvidia-564" / "create", out.id)
    rep = reconcile(host, store, check=True)
    assert not rep.in_sync and rep.mismatched == [f"{out.id}: holds nvidia-564, recorded nvidia-566"]
    code, _, _ = cli(capsys, host, "reconcile", "--check")
    assert code == 1


def test_read_only_commands_create_no_state(make_host, capsys):
    host = make_host("a40-mdev")
    for argv in (["vgpu", "list"], ["audit"], ["reconcile", "--check"],
                 ["vgpu", "create", "--profile", "A40-8Q", "--dry-run"],
                 ["passthrough", "prepare", "--dry-run", "0000:81:00.0"]):
        code, _, err = cli(capsys, host, *argv)
        assert code == 0, (argv, err)
    assert not host.state_dir.exists()


def test_damaged_state_store_is_one_line(make_host, capsys):
    host = make_host("a40-mdev")
    host.state_dir.mkdir(parents=True)
    (host.state_dir / "state.db").write_bytes(b"garbage" * 1000)
    code, _, err = cli(capsys, host, "vgpu", "list")
    assert code == 2 and "not a database" in err and err.count("\n") == 1
    assert "aside" not in err and "restore state.db from a backup" in err     # issue 12 #3


def test_audit_since_a_huge_age(make_host, capsys):
    host = make_host("a40-mdev")
    code, out, _ = cli(capsys, host, "--json", "audit", "--since", "999999999d")
    assert code == 0 and json.loads(out)["rows"] == []
    code, _, err = cli(capsys, host, "audit", "--since", "100000000000000000000m")
    assert code == 2 and "invalid --since" in err


@pytest.mark.parametrize("params", ["foo", "=1", "a=1,a=2", "../../x=1", "a=" + "x" * 2000,
                                    "a=1\n", "a=1,\nb=2", "a=1\nb=2", "a=1,\tb=2"])
def test_bad_params_refused(make_host, capsys, params):
    host = make_host("a40-mdev")
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--params", params)
    assert code == 2 and err.count("\n") == 1 and os.listdir(host.mdev_devices) == []


def test_negative_numa_node_refused(make_host, capsys):
    code, _, err = cli(capsys, make_host("a40-mdev"), "vgpu", "create", "--profile", "A40-8Q",
                       "--numa-node", "-7")
    assert code == 2 and ".;" not in err and err.count("\n") == 1


def test_bare_spec_name_is_the_shipped_one_even_with_a_same_named_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a40-mdev").mkdir()
    code = main(["sim", "create", "a40-mdev", str(tmp_path / "root")])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("given", ["nvidia a40-8q", "NVIDIA A40-8Q", "Grid A40-8Q", " a40-8q "])
def test_a_vendor_prefix_in_any_case_names_the_type(make_host, capsys, given):
    """`--profile 'nvidia a40-8q'` is A40-8Q (tester finding F9), read back from the simulated tree."""
    host = make_host("a40-mdev")
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", given)
    assert code == 0, err
    [m] = os.listdir(host.mdev_devices)
    assert os.path.basename(os.readlink(host.mdev_devices / m / "mdev_type")) == "nvidia-566"     # A40-8Q


def test_an_unknown_long_profile_name_is_shown_cut(make_host, capsys):
    host = make_host("a40-mdev")
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-" + "9" * 2000 + "Q")
    assert code == 2 and err.count("\n") == 1 and len(err) < 300 and "9" * 65 not in err, err


def test_an_open_vgpu_made_by_hand_is_not_called_a_domain(make_host, capsys):
    """The refusal's hint for a manual vGPU held open names no 'domain (owner manual)' (F9)."""
    from vgpuhost.sim.kernel import SimKernel
    host = make_host("a40-mdev")
    out = create(host, StateStore(host.state_dir), profile="A40-8Q")
    SimKernel(host).open_vgpu(out.id)
    code, _, err = cli(capsys, host, "vgpu", "remove", out.id)
    assert code == 2 and "owned by manual, not by a domain" in err and "domain that uses it" not in err, err
    assert os.path.isdir(host.mdev_devices / out.id)
