"""Discovery that tells the truth (issue 25 items 10, 12, 13), on simulated trees.

- 10: a vGPU attribute whose read fails (the driver's query failed: EINVAL)
  marks that VF or mdev parent unreadable, with the reason; discovery goes on.
- 12: PCI domains of more than four hex digits (Intel VMD's 10000:) parse,
  such GPUs are listed, and what vgpuhost does not support behind VMD is
  refused with the reason.
- 13: messages name the real cause (the missing type, not the board; a
  nameless type; an unknown device id; a driverless function).
"""

from __future__ import annotations

import json

import pytest

from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.errors import InputError
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.inventory import discover
from vgpuhost.ops.passthrough import prepare

A = PciAddress.parse


def cli(capsys, host, *argv):
    code = main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------
# 12. PCI domains beyond four hex digits

@pytest.mark.parametrize("text, want", [
    ("10000:01:00.0", (0x10000, 0x01, 0x00, 0)),
    ("10001:80:05.0", (0x10001, 0x80, 0x05, 0)),          # jaypipes/ghw#372's lspci
    ("5d0505:00:00.0", (0x5d0505, 0, 0, 0)),
    ("ffffffff:ff:1f.7", (0xffffffff, 0xff, 0x1f, 7)),
    ("0000:41:00.0", (0, 0x41, 0, 0)),
])
def test_pci_address_takes_any_domain_the_kernel_prints(text, want):
    a = A(text)
    assert (a.domain, a.bus, a.slot, a.function) == want
    assert str(a) == text and PciAddress.is_valid(text)


@pytest.mark.parametrize("text", ["000:41:00.0", "100000000:01:00.0", "10000:1:00.0", "10000:01:00.8",
                                  "1000g:01:00.0", "10000:01:00"])
def test_pci_address_still_refuses_what_the_kernel_never_prints(text):
    assert not PciAddress.is_valid(text)
    with pytest.raises(InputError):
        A(text)


# ---------------------------------------------------------------------------
# 13. a driverless function in the group is not "on pcieport"

HOST_BRIDGE = """
version: 1
name: epyc-dummy-host-bridge
host:
  cpu_vendor: AuthenticAMD
  cmdline: "iommu=pt"
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, snd_hda_intel]
devices:
  - {bdf: "0000:40:01.0", model: amd-dummy-host-bridge, iommu_group: 31}
  - {bdf: "0000:40:01.1", model: amd-root-port, iommu_group: 31}
  - {bdf: "0000:41:00.0", model: A40, upstream: "0000:40:01.1", iommu_group: 31}
  - {bdf: "0000:41:00.1", model: nvidia-hda, upstream: "0000:40:01.1", iommu_group: 31}
"""


def test_driverless_group_member_is_said_to_have_no_driver(make_host):
    host = make_host(yaml_text=HOST_BRIDGE)
    out = prepare(host, StateStore(host.state_dir), A("0000:41:00.0"), dry_run=True)
    assert "bridges stay on pcieport: 0000:40:01.1" in out.notes
    assert ("0000:40:01.0 (host bridge) has no driver and stays on the host (a function with no driver "
            "does no DMA)") in out.notes
    assert not any("pcieport" in n and "0000:40:01.0" in n for n in out.notes), out.notes


# ---------------------------------------------------------------------------
# 13. the type is missing, not the board

A100_MIG = """
version: 1
name: a100-mig
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:40:01.1", model: intel-root-port}
  - bdf: "0000:41:00.0"
    model: A100-PCIE-40GB
    upstream: "0000:40:01.1"
    vgpu: {backend: mdev, sriov_numvfs: 4}
    mig: {mode: true}
"""


def _drop_type(host, type_id):
    """The tree of a driver release without ``type_id``: no parent lists it under mdev_supported_types."""
    import shutil
    gone = [p for p in host.root.joinpath("sys", "devices").rglob(type_id) if p.parent.name == "mdev_supported_types"]
    assert gone
    for p in gone:
        shutil.rmtree(p)


@pytest.mark.parametrize("extra", [[], ["--create-gi"]])
def test_missing_me_type_on_an_a100_names_the_type_not_the_board(make_host, capsys, extra):
    host = make_host(yaml_text=A100_MIG)
    _drop_type(host, "nvidia-479")                  # A100-1-5CME
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A100-1-5CME", *extra)
    assert code == 2, err
    assert ("GPU 0000:41:00.0 has board A100 but its driver offers no A100-1-5CME type" in err), err
    assert "no GPU of that board" not in err and "create a 1g.5gb+me GPU instance" not in err
    assert not list(host.root.joinpath("sys", "bus", "mdev", "devices").iterdir())     # nothing created


def test_no_gpu_of_the_board_names_the_boards_there(make_host, capsys):
    host = make_host("a40-mdev")
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A100-1-5CME", "--dry-run")
    assert code == 2 and "no GPU of board A100 (0000:81:00.0 is A40" in err, err


# ---------------------------------------------------------------------------
# 13. a vendor-VFIO type listed without a name

L40S_SMALL = """
version: 1
name: l40s-small
host: {modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia]}
devices:
  - {bdf: "0000:20:01.1", model: intel-root-port}
  - {bdf: "0000:21:00.0", model: L40S, upstream: "0000:20:01.1", vgpu: {backend: vendor-vfio, sriov_numvfs: 4}}
"""


def _creatable_files(host):
    return sorted(p for p in host.root.joinpath("sys", "devices").rglob("creatable_vgpu_types"))


def test_nameless_vendor_vfio_type_shows_its_id_and_no_name(make_host, capsys):
    host = make_host(yaml_text=L40S_SMALL)
    for f in _creatable_files(host):            # the driver lists 1145 with a blank name ("%-5d : %s")
        f.write_text(f.read_text().replace("NVIDIA L40S-1B", ""))
    code, out, err = cli(capsys, host, "types")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.startswith("0000:21:00.0  1145 ")]
    assert rows and rows[0][2:5] == ["(no", "name)", "-"], out
    assert ("(no name): the driver lists type 1145 without a name, so its board, series and framebuffer "
            "are unknown") in out
    code, out, err = cli(capsys, host, "--json", "types")
    e = next(e for e in json.loads(out)["types"] if e["gpu"] == "0000:21:00.0" and e["type_id"] == "1145")
    assert e["name"] == "" and e["series"] is None


def test_a_type_one_vf_names_takes_that_name(make_host, capsys):
    host = make_host(yaml_text=L40S_SMALL)
    first = _creatable_files(host)[0]           # one VF of 0000:21:00.0 lists 1145 without its name
    first.write_text(first.read_text().replace("NVIDIA L40S-1B", ""))
    code, out, err = cli(capsys, host, "--json", "types")
    e = next(e for e in json.loads(out)["types"] if e["gpu"] == "0000:21:00.0" and e["type_id"] == "1145")
    assert (e["name"], e["series"], e["framebuffer_mib"]) == ("L40S-1B", "B", 1024)
    assert len(e["parents"]) == 4


# ---------------------------------------------------------------------------
# 13. a GPU of an unknown device id is marked unknown

def test_gpu_of_unknown_device_id_is_marked_unknown(make_host, capsys):
    host = make_host("a40-mdev")
    (host.pci_device("0000:81:00.0") / "device").write_text("0x2bb5\n")     # an id not in model/boards.py
    code, out, err = cli(capsys, host, "gpus")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("0000:81:00.0"))
    assert "10de:2bb5 (unknown device id)" in row, out
    code, out, err = cli(capsys, host, "--json", "gpus")
    doc = json.loads(out)
    assert [(g["address"], g["model"], g["model_known"]) for g in doc["gpus"]] == [
        ("0000:81:00.0", "10de:2bb5", False)]
    host2 = make_host("a40-mdev")
    code, out, err = cli(capsys, host2, "--json", "gpus")
    assert [(g["model"], g["model_known"]) for g in json.loads(out)["gpus"]] == [("A40", True)]


# ---------------------------------------------------------------------------
# 10. discovery survives a failing attribute

L40S_FAULT = """
version: 1
name: l40s-read-fault
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia]
devices:
  - {{bdf: "0000:20:01.1", model: intel-root-port}}
  - bdf: "0000:21:00.0"
    model: L40S
    upstream: "0000:20:01.1"
    vgpu: {{backend: vendor-vfio, sriov_numvfs: 4}}
faults:
  - {{op: read, attr: creatable_vgpu_types, device: "{device}", errno: EINVAL, count: {count}}}
"""


def test_creatable_read_einval_marks_the_vf_unreadable_and_discovery_goes_on(make_host, capsys):
    host = make_host(yaml_text=L40S_FAULT.format(device="0000:21:00.5", count=0))
    inv = discover(Sysfs(host))                 # raised SysfsError(EINVAL) before
    (g,) = inv.gpus
    assert [(str(u.device), u.attribute, u.errno_name) for u in g.unreadable] == [
        ("0000:21:00.5", "creatable_vgpu_types", "EINVAL")]
    parents = {str(t.parent) for t in inv.vgpu_types}
    assert parents == {"0000:21:00.4", "0000:21:00.6", "0000:21:00.7"}      # the other VFs are read
    code, out, err = cli(capsys, host, "gpus")
    assert code == 0, err
    assert ("0000:21:00.0: unreadable 0000:21:00.5: reading creatable_vgpu_types failed with EINVAL "
            "(the driver's query of the GPU failed") in out
    code, out, err = cli(capsys, host, "--json", "gpus")
    assert json.loads(out)["gpus"][0]["unreadable"] == [{
        "device": "0000:21:00.5", "attribute": "creatable_vgpu_types", "errno": "EINVAL",
        "reason": "the driver's query of the GPU failed; it offers no vGPU type until a read succeeds"}]
    code, out, err = cli(capsys, host, "--json", "host", "check")
    f = [f for f in json.loads(out)["findings"] if f["code"] == "VGPU_UNREADABLE"]
    assert [(x["severity"], x["subject"]) for x in f] == [("warning", "0000:21:00.0")]
    code, out, err = cli(capsys, host, "types")
    assert code == 0 and "L40S-1B" in out, err


def test_a_vgpu_on_an_unreadable_vf_stays_known(make_host, capsys):
    host = make_host(yaml_text=L40S_FAULT.format(device="0000:21:00.4", count=0))
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-4Q", "--gpu", "0000:21:00.0")
    assert code == 0, err
    inv = discover(Sysfs(host))
    held = [(str(v.vf), v.type_id) for v in inv.vf_vgpus if v.type_id]
    assert len(held) == 1 and held[0][0] != "0000:21:00.4"          # placed on a VF that reads
    (host.pci_device("0000:21:00.4") / "nvidia" / "current_vgpu_type").write_text("1150\n")
    inv = discover(Sysfs(host))                 # a vGPU there (made before the fault): still listed
    assert ("0000:21:00.4", "1150") in [(str(v.vf), v.type_id) for v in inv.vf_vgpus]


def test_a_counted_read_fault_clears(make_host):
    host = make_host(yaml_text=L40S_FAULT.format(device="0000:21:00.0", count=1))     # the PF: any of its VFs
    first = discover(Sysfs(host)).gpus[0].unreadable
    assert [str(u.device) for u in first] == ["0000:21:00.4"]
    assert discover(Sysfs(host)).gpus[0].unreadable == ()


def test_a_gpu_whose_vfs_all_fail_to_read_is_not_called_full(make_host, capsys):
    """Every VF's creatable_vgpu_types fails (EINVAL): no command calls the GPU full or typeless; each
    says its types could not be read (tester finding F5)."""
    host = make_host(yaml_text=L40S_FAULT.format(device="0000:21:00.0", count=0))
    assert len(discover(Sysfs(host)).gpus[0].unreadable) == 4
    code, out, err = cli(capsys, host, "--json", "host", "check")
    [f] = [f for f in json.loads(out)["findings"] if f["code"] == "VGPU_NO_TYPES"]
    assert ("but 4 of its 4 VFs could not be read (creatable_vgpu_types: EINVAL), so its vGPU types are unknown"
            in f["message"]), f
    [m] = [m for m in json.loads(out)["modes"] if m["mode"] == "vgpu"]
    assert m["gpus"][0]["verdict"] == "blocked" and "so its vGPU types are unknown" in m["gpus"][0]["reason"], m
    code, out, err = cli(capsys, host, "types")
    assert code == 0 and out.startswith("no vGPU types\n0000:21:00.0: unreadable 0000:21:00.4: reading "
                                        "creatable_vgpu_types failed with EINVAL"), out
    code, out, err = cli(capsys, host, "capacity")
    assert "0000:21:00.0: 4 vGPU parents could not be read" in out, out
    code, out, err = cli(capsys, host, "--json", "capacity")
    assert json.loads(out)["gpus"][0]["unreadable"] == ["0000:21:00.4", "0000:21:00.5", "0000:21:00.6",
                                                        "0000:21:00.7"]
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-4Q", "--gpu", "0000:21:00.0")
    assert code != 0 and "could not be read" in err and "instance free" not in err.split(";")[-1], err


MDEV_FAULT = """
version: 1
name: a100-read-fault
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:40:01.1", model: intel-root-port}
  - bdf: "0000:41:00.0"
    model: A100-PCIE-40GB
    upstream: "0000:40:01.1"
    vgpu: {backend: mdev, sriov_numvfs: 4}
faults:
  - {op: read, attr: available_instances, device: "0000:41:00.6", errno: EIO, count: 0}
"""


def test_an_mdev_parent_whose_type_reads_fail_is_unreadable(make_host):
    host = make_host(yaml_text=MDEV_FAULT)
    (g,) = discover(Sysfs(host)).gpus
    assert [(str(u.device), u.attribute, u.errno_name) for u in g.unreadable] == [
        ("0000:41:00.6", "available_instances", "EIO")]
    assert "0000:41:00.6" not in {str(t.parent) for t in discover(Sysfs(host)).vgpu_types}


@pytest.mark.parametrize("fault, why", [
    ("{op: read, device: \"0000:21:00.5\"}", "a read fault needs attr"),
    ("{op: read, attr: vendor}", "a read fault needs attr, one of creatable_vgpu_types"),
    ("{op: create, attr: creatable_vgpu_types}", "attr is for read faults"),
    ("{op: read, attr: creatable_vgpu_types, effect: ignore}", "effect 'ignore' is for writes"),
])
def test_read_fault_spec_errors(fault, why):
    from vgpuhost.sim.spec import parse_spec
    text = L40S_FAULT.format(device="0000:21:00.5", count=0).split("faults:")[0] + f"faults:\n  - {fault}\n"
    with pytest.raises(InputError, match=why):
        parse_spec(text)


# ---------------------------------------------------------------------------
# 12. a GPU behind Intel VMD: listed, and what VMD prevents refused with the reason

VMD = """
version: 1
name: vmd-a40
summary: an A40 in Intel VMD's PCI domain 10000 beside one outside it
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, snd_hda_intel]
devices:
  - {bdf: "0000:5d:05.5", model: intel-vmd}
  - {bdf: "10000:00:02.0", model: intel-vmd-root-port, upstream: "0000:5d:05.5"}
  - {bdf: "10000:01:00.0", model: A40, upstream: "10000:00:02.0", vgpu: {backend: mdev}}
  - {bdf: "10000:01:00.1", model: nvidia-hda, upstream: "10000:00:02.0"}
  - {bdf: "0000:00:1c.0", model: intel-root-port}
  - {bdf: "0000:03:00.0", model: A40, upstream: "0000:00:1c.0"}
  - {bdf: "0000:03:00.1", model: nvidia-hda, upstream: "0000:00:1c.0"}
"""
VMD_GPU = "10000:01:00.0"

VMD_L40S = """
version: 1
name: vmd-l40s
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia]
devices:
  - {bdf: "0000:5d:05.5", model: intel-vmd}
  - {bdf: "10000:00:02.0", model: intel-vmd-root-port, upstream: "0000:5d:05.5"}
  - {bdf: "10000:01:00.0", model: L40S, upstream: "10000:00:02.0", vgpu: {backend: vendor-vfio, sriov_numvfs: 4}}
"""


def test_simulator_lays_out_a_vmd_domain_as_the_kernel_does(make_host):
    import os
    host = make_host(yaml_text=VMD)
    real = os.path.realpath(host.pci_device(VMD_GPU))
    assert real.endswith("/sys/devices/pci0000:5d/0000:5d:05.5/pci10000:00/10000:00:02.0/10000:01:00.0")
    fs = Sysfs(host)
    assert fs.read(host.pci_device("0000:5d:05.5") / "device") == "0x28c0"
    assert fs.link_name(host.pci_device("0000:5d:05.5") / "driver") == "vmd"
    inv = discover(fs)
    group = inv.group_of(A(VMD_GPU))                # the VMD endpoint's group holds its whole domain
    assert [str(m) for m in group.members] == ["0000:5d:05.5", "10000:00:02.0", "10000:01:00.0", "10000:01:00.1"]
    assert inv.devices[A(VMD_GPU)].domain_host == A("0000:5d:05.5")
    assert inv.devices[A("0000:03:00.0")].domain_host is None


def test_gpu_behind_vmd_is_listed_and_marked(make_host, capsys):
    host = make_host(yaml_text=VMD)
    code, out, err = cli(capsys, host, "gpus")
    assert code == 0, err
    assert any(line.startswith(VMD_GPU + "  A40") for line in out.splitlines()), out      # missing before
    assert (f"{VMD_GPU}: behind Intel VMD 0000:5d:05.5: passthrough and vendor-VFIO vGPUs are refused") in out
    code, out, err = cli(capsys, host, "--json", "gpus")
    got = {g["address"]: g["vmd"] for g in json.loads(out)["gpus"]}
    assert got == {"0000:03:00.0": None, VMD_GPU: "0000:5d:05.5"}


def test_passthrough_behind_vmd_is_refused_with_the_reason(make_host, capsys):
    host = make_host(yaml_text=VMD)
    code, out, err = cli(capsys, host, "passthrough", "prepare", VMD_GPU, "--dry-run")
    assert code == 2, err
    assert "expected the full form" not in err                 # what main said
    assert (f"{VMD_GPU} cannot be passed through: it is behind Intel VMD 0000:5d:05.5 (PCI domain 10000), "
            "whose devices all share the VMD's IOMMU group") in err
    code, out, err = cli(capsys, host, "passthrough", "prepare", VMD_GPU)
    assert code == 2
    assert Sysfs(host).link_name(host.pci_device(VMD_GPU) / "driver") == "nvidia"            # nothing moved
    assert Sysfs(host).link_name(host.pci_device("0000:5d:05.5") / "driver") == "vmd"
    code, out, err = cli(capsys, host, "--json", "host", "check")
    doc = json.loads(out)
    assert {f["code"] for f in doc["findings"] if f["subject"] == VMD_GPU} >= {"BEHIND_VMD"}
    assert "GROUP_NOT_VIABLE" not in {f["code"] for f in doc["findings"]}          # no ACS advice for VMD
    verdicts = {(g["gpu"], m["mode"]): g["verdict"] for m in doc["modes"] for g in m["gpus"]}
    assert verdicts[(VMD_GPU, "passthrough")] == "blocked" and verdicts[("0000:03:00.0", "passthrough")] == "ready"
    assert verdicts[(VMD_GPU, "vgpu")] == "ready"               # classic mdev is not refused behind VMD


def test_classic_mdev_vgpu_behind_vmd_is_created(make_host, capsys):
    host = make_host(yaml_text=VMD)
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--gpu", VMD_GPU)
    assert code == 0, err
    (m,) = discover(Sysfs(host)).mdevs
    assert str(m.parent) == VMD_GPU and m.type_id == "nvidia-566"


def test_vendor_vfio_behind_vmd_is_refused_with_the_reason(make_host, capsys):
    host = make_host(yaml_text=VMD_L40S)
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-4Q")
    assert code == 2
    assert "behind Intel VMD 0000:5d:05.5: its VFs share the VMD's IOMMU group, so none can be given to a VM" in err
    assert discover(Sysfs(host)).vf_vgpus and not any(v.type_id for v in discover(Sysfs(host)).vf_vgpus)
    code, out, err = cli(capsys, host, "--json", "types")
    assert {e["available_instances"] for e in json.loads(out)["types"]} == {0}
    code, out, err = cli(capsys, host, "--json", "host", "check")
    doc = json.loads(out)
    verdicts = {(g["gpu"], m["mode"]): g["verdict"] for m in doc["modes"] for g in m["gpus"]}
    assert verdicts[(VMD_GPU, "vgpu")] == "blocked"
    assert "VF_GROUP_SHARED" not in {f["code"] for f in doc["findings"]}


def test_a_refusal_on_a_gpu_with_an_unreadable_vf_says_so(make_host, capsys):
    """Three VFs hold vGPUs, the fourth cannot be read: the refusal does not say "full" alone (F5)."""
    host = make_host(yaml_text=L40S_FAULT.format(device="0000:21:00.5", count=0))
    for _ in range(3):
        code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-1Q", "--gpu", "0000:21:00.0")
        assert code == 0, err
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-1Q", "--gpu", "0000:21:00.0")
    assert code != 0 and "1 of its 4 VFs could not be read (creatable_vgpu_types: EINVAL)" in err, err
    assert len([v for v in discover(Sysfs(host)).vf_vgpus if v.type_id]) == 3
