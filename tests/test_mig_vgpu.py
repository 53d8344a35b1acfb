"""MIG-backed vGPUs: SR-IOV -> MIG mode -> GPU instance -> vGPU, on the simulated H200."""

from __future__ import annotations

import pytest

from vgpuhost.cli.main import main
from vgpuhost.model.errors import RefusedError
from vgpuhost.io.backends import backend_for
from vgpuhost.io.state import StateStore
from vgpuhost.model.values import PciAddress
from vgpuhost.ops.vgpu import create

GPU = PciAddress.parse("0000:18:00.0")
H200_MIG_ON = """
version: 1
name: h200-on
host: {modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]}
devices:
  - {bdf: "0000:17:01.0", model: intel-root-port}
  - bdf: "0000:18:00.0"
    model: H200-SXM-141GB
    upstream: "0000:17:01.0"
    vgpu: {backend: vendor-vfio, sriov_numvfs: 16}
    mig: {mode: true}
"""


def layout(host):
    b = backend_for(host)
    names = {p.profile_id: p.name for p in b.gi_profiles(GPU)}
    return sorted(names[g.profile_id] for g in b.gpu_instances(GPU))


def test_without_a_gpu_instance_the_refusal_names_the_missing_step(make_host, capsys):
    host = make_host(yaml_text=H200_MIG_ON)
    code = main(["--root", str(host.root), "vgpu", "create", "--profile", "H200X-1-18C"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "create a 1g.18gb GPU instance" in err and "--create-gi" in err and "order:" in err
    assert layout(host) == [] and not host.state_dir.joinpath("state.db").exists() or \
        StateStore(host.state_dir).vgpu_records() == []


def test_create_gi_then_vgpu_lands_on_it(make_host):
    host = make_host(yaml_text=H200_MIG_ON)
    store = StateStore(host.state_dir)
    out = create(host, store, profile="H200X-1-18C", create_gi=True)
    assert layout(host) == ["1g.18gb"]
    assert (host.pci_device(out.id) / "nvidia" / "current_vgpu_type").read_text().strip() == "1414"
    ops = [r.path for r in store.audit_rows()]
    assert any(p.startswith("nvml:") and "CreateGpuInstance" in p for p in ops)   # the GI, audited
    assert ops.index(next(p for p in ops if "CreateGpuInstance" in p)) < ops.index(
        next(p for p in ops if p.endswith("current_vgpu_type")))                     # before the vGPU
    # the +me type needs its own +me GPU instance, never the plain one
    me = create(host, store, profile="H200X-1-18CME", create_gi=True)
    assert layout(host) == ["1g.18gb", "1g.18gb+me"]
    assert (host.pci_device(me.id) / "nvidia" / "current_vgpu_type").read_text().strip() == "1415"


def test_a_gpu_instance_that_cannot_fit_is_refused_before_any_change(make_host):
    host = make_host(yaml_text=H200_MIG_ON)
    store = StateStore(host.state_dir)
    create(host, store, profile="H200X-4-71C", create_gi=True)
    before = layout(host)
    with pytest.raises(RefusedError, match="does not fit"):
        create(host, store, profile="H200X-7-141C", create_gi=True)
    assert layout(host) == before


def test_mig_mode_off_is_named_in_order(make_host, capsys):
    host = make_host("h200-mig")
    code = main(["--root", str(host.root), "vgpu", "create", "--profile", "H200X-1-18C", "--create-gi"])
    err = capsys.readouterr().err
    assert code == 2 and "MIG mode is off" in err and "order:" in err


def test_persist_is_refused_before_a_gpu_instance_is_created(make_host):
    from vgpuhost.model.errors import InputError
    host = make_host(yaml_text=H200_MIG_ON)
    with pytest.raises(InputError, match="--persist"):
        create(host, StateStore(host.state_dir), profile="H200X-1-18C", create_gi=True, persist=True)
    assert layout(host) == []


def test_an_empty_layout_never_wipes_the_gpu(make_host, capsys):
    host = make_host(yaml_text=H200_MIG_ON)
    create(host, StateStore(host.state_dir), profile="H200X-1-18C", create_gi=True)
    for blank in ("", " "):
        code = main(["--root", str(host.root), "mig", "apply", "--gpu", str(GPU), blank])
        assert code == 2 and "empty MIG layout" in capsys.readouterr().err
    assert layout(host) == ["1g.18gb"]
