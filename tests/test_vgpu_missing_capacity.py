"""A record whose vGPU is missing holds its share of its GPU (trial 7 retest N2).

After a reboot (before the boot units' ``reconcile``) a record keeps its id for ``vgpuhost reconcile``
to re-create it there (trial 7 F6: its VF); placement and admission also count its framebuffer as held
on its GPU (and, on a GPU in equal-size mode, its size as the only one offered), so a new vGPU goes to
another GPU or is refused with a line naming the record and ``vgpuhost reconcile``, and the boot
``reconcile`` never fails ENOSPC re-creating it.  Each test reads back the simulated tree, the store's
records and the command's exit code and line.
"""

from __future__ import annotations

import pytest

from vgpuhost.io.state import StateStore
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.sim.reboot import reboot

from test_create_recorded_vf import audit, cli, records, vf_type
from test_hook import domain_xml, mdev_hostdev, start

GPU, OTHER_GPU = "0000:21:00.0", "0000:a1:00.0"
VF4 = "0000:21:00.4"
DOM = "6f1b1d4e-0000-4000-8000-00000000f701"
DOM2 = "6f1b1d4e-0000-4000-8000-00000000f702"
MDEV = "aaaaaaaa-2222-4333-8444-00000000f701"
MDEV2 = "aaaaaaaa-2222-4333-8444-00000000f702"

TWO_A40 = """
version: 1
name: two-a40
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
  driver_version: 580.65.05
devices:
  - {bdf: "0000:40:01.0", model: intel-root-port, numa_node: 0}
  - {bdf: "0000:41:00.0", model: A40, upstream: "0000:40:01.0", numa_node: 0, vgpu: {backend: mdev}}
  - {bdf: "0000:80:01.0", model: intel-root-port, numa_node: 0}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:01.0", numa_node: 0, vgpu: {backend: mdev}}
"""


def vgpus(host) -> dict:
    """``{id: (gpu, type name)}`` of the records."""
    store = StateStore(host.state_dir, create=False)
    try:
        return {r.id: (r.gpu, r.type_name) for r in store.vgpu_records()}
    finally:
        store.close()


def test_a_new_vgpu_goes_to_another_gpu_and_reconcile_re_creates_the_missing_one(make_host, capsys):
    """The retest's repro: L40S-48Q (one per GPU), reboot, L40S-48Q again: placed on the other GPU (before:
    on the GPU of the missing record, and the boot reconcile failed ENOSPC)."""
    host = make_host("l40s-vendor-vfio")
    assert cli(capsys, host, "vgpu", "create", "--profile", "L40S-48Q")[0] == 0
    assert reboot(host)["vgpus_lost"] == [VF4]
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-48Q")
    assert code == 0, err
    new = [i for i in vgpus(host) if i != VF4]
    assert len(new) == 1 and vgpus(host)[new[0]] == (OTHER_GPU, "L40S-48Q") and vf_type(host, VF4) == "0"
    code, out, err = cli(capsys, host, "reconcile")
    assert code == 0 and "re-created: 0000:21:00.4" in out and "in sync" in out, out + err
    assert vf_type(host, VF4) != "0" and vf_type(host, new[0]) != "0"


def test_a_gpu_holding_a_missing_record_refuses_a_pinned_vgpu_naming_the_record(make_host, capsys):
    """Pinned to the GPU of the missing record: refused, exit 2, nothing written, the line names the
    record and 'vgpuhost reconcile' (another size too: equal-size mode admits only the record's size)."""
    host = make_host("l40s-vendor-vfio")
    assert cli(capsys, host, "vgpu", "create", "--profile", "L40S-48Q")[0] == 0
    reboot(host)
    before = audit(host)
    for profile in ("L40S-48Q", "L40S-4Q"):
        code, _, err = cli(capsys, host, "vgpu", "create", "--profile", profile, "--gpu", GPU)
        assert code == 2 and err.count("\n") == 1, err
        assert ("vGPU 0000:21:00.4 (L40S-48Q, owner manual) is recorded here but missing from the host: its "
                "framebuffer is kept for 'vgpuhost reconcile' to re-create it there") in err, err
        assert "types that still fit: 0000:21:00.0: none" in err, err
    assert audit(host) == before and records(host) == {VF4: ("manual", "L40S-48Q")}
    assert all(vf_type(host, f"0000:21:00.{f}") == "0" for f in range(4, 8))
    assert cli(capsys, host, "reconcile")[0] == 0 and vf_type(host, VF4) != "0"


def test_sriov_mdev_a_missing_smaller_vgpu_keeps_its_size_on_the_gpu(make_host, capsys):
    """a100-sriov-mdev: A100-10C missing, then A100-40C: refused (equal-size: the record's size only; before:
    made on another VF, and reconcile failed ENOSPC); A100-10C still fits (3 more: 4 a GPU), and
    reconcile re-creates the missing one."""
    host = make_host("a100-sriov-mdev")
    gpu = "0000:41:00.0"
    assert cli(capsys, host, "vgpu", "create", "--profile", "A100-10C", "--uuid", MDEV)[0] == 0
    assert reboot(host)["vgpus_lost"] == [MDEV]
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A100-40C")
    assert code == 2 and f"vGPU {MDEV} (A100-10C, owner manual) is recorded here but missing" in err, err
    assert "equal-size mode admits only 10240 MiB vGPUs" in err and "A100-10C (3)" in err, err
    assert list(vgpus(host)) == [MDEV] and not (host.mdev_devices / MDEV).exists()
    for _ in range(3):
        code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A100-10C")
        assert code == 0, err
    made = [i for i in vgpus(host) if i != MDEV]
    assert len(made) == 3
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A100-10C", "--gpu", gpu)
    assert code == 2 and "is recorded here but missing from the host" in err, err      # the 4th is the record's
    code, out, err = cli(capsys, host, "reconcile")
    assert code == 0 and "in sync" in out, out + err
    assert all((host.mdev_devices / i).exists() for i in [MDEV, *made])


def a40_domain(name: str, uuid: str, mdev: str) -> str:
    meta = Metadata(strategy="first-fit", vgpus=[VgpuRequest("A40-48Q", uuid=mdev)])
    return domain_xml(name, uuid, meta, [mdev_hostdev(mdev)])


@pytest.mark.parametrize("tenancy", [False, True])
def test_a_start_is_placed_off_the_gpu_of_a_missing_record_and_not_against_its_owner(make_host, capsys, tenancy):
    """Through the qemu hook, placed by the device layer (no tenancy) or by admission (a tenant declared): a
    domain's A40-48Q lost at a reboot holds its GPU, so another domain's A40-48Q starts on the other GPU
    (before, without tenancy: on the same GPU); the domain itself, started again, is not kept out by its
    own missing record (its start makes the vGPU anew, on its GPU)."""
    host = make_host(yaml_text=TWO_A40)
    if tenancy:
        assert cli(capsys, host, "tenant", "add", "t")[0] == 0
    assert start(host, "vm", a40_domain("vm", DOM, MDEV), bind=False) == (0, "")
    assert vgpus(host) == {MDEV: ("0000:41:00.0", "A40-48Q")}
    assert reboot(host)["vgpus_lost"] == [MDEV]
    assert start(host, "vm2", a40_domain("vm2", DOM2, MDEV2), bind=False) == (0, "")
    assert vgpus(host) == {MDEV: ("0000:41:00.0", "A40-48Q"), MDEV2: ("0000:81:00.0", "A40-48Q")}
    assert (host.mdev_devices / MDEV2).exists() and not (host.mdev_devices / MDEV).exists()
    rc, err = start(host, "vm", a40_domain("vm", DOM, MDEV), bind=False)
    assert rc == 0, err
    assert vgpus(host) == {MDEV: ("0000:41:00.0", "A40-48Q"), MDEV2: ("0000:81:00.0", "A40-48Q")}
    assert (host.mdev_devices / MDEV).exists()
