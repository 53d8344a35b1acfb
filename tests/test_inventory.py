"""Inventory and host check over every shipped example host spec.

Each spec's full inventory (GPUs, types with max/available, findings) is
compared with a reviewed golden under tests/data/inventory/, and the facts
the issue names are asserted explicitly as well.
"""

from __future__ import annotations

import json

import pytest

from vgpuhost.policy.checks import check_host, is_ready
from vgpuhost.observe.inventory import discover, parse_creatable_vgpu_types
from vgpuhost.present.inventory import aggregate_types, gpus_doc
from vgpuhost.sim.data import bundled_specs
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress

from conftest import golden

SPECS = sorted(bundled_specs())
A = PciAddress.parse


def summary(host) -> str:
    inv = discover(Sysfs(host))
    types = [{k: e[k] for k in ("gpu", "type_id", "name", "series", "framebuffer_mib", "gi_slices",
                                "media_extensions", "max_instances", "available_instances", "backend")}
             | {"parents": len(e["parents"])}
             for e in aggregate_types(inv.vgpu_types, inv)]
    findings = [[f.severity, f.code, f.subject] for f in check_host(inv)]
    doc = {"gpus": gpus_doc(inv), "types": types, "groups": {str(k): [str(m) for m in v.members]
                                                            for k, v in sorted(inv.groups.items())},
           "findings": findings}
    return json.dumps(doc, indent=1) + "\n"


def test_all_seven_issue_specs_are_shipped():
    assert {"a100-sriov-mdev", "l40s-vendor-vfio", "a40-mdev", "h200-mig", "turing-consumer",
            "iommu-off", "sata-shared-group"} <= set(SPECS)


@pytest.mark.parametrize("name", SPECS)
def test_inventory_matches_golden(make_host, name):
    golden("inventory", f"{name}.json", summary(make_host(name)))


def _inv(make_host, name):
    inv = discover(Sysfs(make_host(name)))
    return inv, check_host(inv)


def _codes(findings, subject=None):
    return {f.code: f for f in findings if subject is None or f.subject == subject}


def test_a_a100_sriov_mdev(make_host):
    inv, findings = _inv(make_host, "a100-sriov-mdev")
    (gpu,) = inv.gpus
    assert gpu.address == A("0000:41:00.0") and gpu.vgpu_backend == "mdev"
    assert len(gpu.vfs) == 20 and gpu.vfs[0] == A("0000:41:00.4") and gpu.vfs[-1] == A("0000:41:02.7")
    assert gpu.mdev_parents == gpu.vfs              # the VFs are the mdev parents, not the PF
    assert gpu.companions == (A("0000:41:00.1"),)   # HD audio
    vf0 = inv.devices[gpu.vfs[0]]
    assert vf0.physfn == gpu.address and vf0.iommu_group != gpu.pci.iommu_group
    t = {e["name"]: e for e in aggregate_types(inv.vgpu_types, inv)}
    assert t["A100-4C"]["type_id"] == "nvidia-468" and t["A100-4C"]["available_instances"] == 10  # 20 free VFs, capped by max 10
    assert t["A100-4C"]["max_instances"] == 10 and t["A100-4C"]["framebuffer_mib"] == 4096
    assert t["A100-1-5CME"]["media_extensions"] and t["A100-1-5CME"]["gi_slices"] == 1
    assert t["A100-1-5C"]["available_instances"] == 0   # MIG-backed: MIG mode is off
    assert is_ready(findings)
    assert "GROUP_COMPANIONS" in _codes(findings, "0000:41:00.0")


def test_b_l40s_vendor_vfio(make_host):
    inv, findings = _inv(make_host, "l40s-vendor-vfio")
    assert [str(g.address) for g in inv.gpus] == ["0000:21:00.0", "0000:a1:00.0"]
    assert [g.pci.numa_node for g in inv.gpus] == [0, 1]
    for g in inv.gpus:
        assert g.vgpu_backend == "vendor-vfio" and len(g.vfs) == 16 and g.mdev_parents == ()
    assert inv.mdevs == () and len(inv.vf_vgpus) == 32
    assert all(v.type_id is None for v in inv.vf_vgpus)
    names = {(t.type_id, t.name) for t in inv.vgpu_types}
    assert ("1145", "L40S-1B") in names and ("1152", "L40S-8Q") in names
    assert is_ready(findings)


def test_c_a40_classic_mdev(make_host):
    inv, findings = _inv(make_host, "a40-mdev")
    (gpu,) = inv.gpus
    assert gpu.mdev_parents == (gpu.address,) and gpu.vfs == ()
    assert gpu.pci.iommu_group == 31 and gpu.pci.upstream == A("0000:80:03.0")
    series = {t.profile.series for t in inv.vgpu_types}
    assert series == {"Q", "B", "A", "C"}
    q8 = next(t for t in inv.vgpu_types if t.type_id == "nvidia-566")
    assert q8.name == "A40-8Q" and q8.raw_name == "NVIDIA A40-8Q" and q8.max_instances == 6
    assert q8.description["frl_config"] == "60" and q8.framebuffer_mib == 8192
    assert is_ready(findings)


def test_d_h200_mig_capable(make_host):
    inv, findings = _inv(make_host, "h200-mig")
    (gpu,) = inv.gpus
    assert gpu.vgpu_backend == "vendor-vfio" and gpu.model == "H200-SXM-141GB" and gpu.board == "H200X"
    names = {t.name for t in inv.vgpu_types}
    assert "H200X-141C" in names
    assert "H200X-1-18C" not in names      # MIG-backed types are not creatable until MIG mode + GIs
    assert gpu.mig is None                  # the NVML seam: filled by the MIG issue
    assert is_ready(findings)


def test_e_turing_companions_must_move(make_host):
    inv, findings = _inv(make_host, "turing-consumer")
    (gpu,) = inv.gpus
    assert gpu.companions == (A("0000:01:00.1"), A("0000:01:00.2"), A("0000:01:00.3"))
    f = _codes(findings, "0000:01:00.0")
    msg = f["GROUP_COMPANIONS"].message
    for needle in ("0000:01:00.2 (USB controller, xhci_hcd)", "0000:01:00.3 (serial bus controller (UCSI)",
                   "must move with the GPU"):
        assert needle in msg
    assert f["GROUP_VIABLE"].severity == "ok"
    assert f["BOOT_VGA"].severity == "warning" and "--allow-boot-vga" in f["BOOT_VGA"].fix
    assert "initcall_blacklist=sysfb_init" in f["BOOT_FRAMEBUFFER"].fix
    host_codes = _codes(findings, "host")
    assert "PERSISTENCED" in host_codes and "NVIDIA_DRM" in host_codes
    assert is_ready(findings)   # warnings only: usable after the operator's steps


def test_f_iommu_off_says_how_to_enable(make_host):
    inv, findings = _inv(make_host, "iommu-off")
    assert not inv.iommu_enabled
    f = _codes(findings, "host")["IOMMU_OFF"]
    assert f.severity == "error"
    assert "intel_iommu=on" in f.fix and "update-grub" in f.fix
    assert not is_ready(findings)


def test_g_sata_in_group_not_viable(make_host):
    inv, findings = _inv(make_host, "sata-shared-group")
    f = _codes(findings, "0000:03:00.0")
    assert "GROUP_VIABLE" not in f
    bad = f["GROUP_NOT_VIABLE"]
    assert bad.severity == "error"
    assert "0000:04:00.0 (SATA controller, ahci)" in bad.message
    assert "0000:02:00.0" not in bad.message    # the bridge is allowed
    assert "0000:03:00.1" not in bad.message    # the GPU's own audio function is a companion
    assert not is_ready(findings)


def test_amd_iommu_fix_names_amd_parameter(make_host):
    host = make_host(yaml_text="""
version: 1
name: amd-off
host: {cpu_vendor: AuthenticAMD, iommu: false, cmdline: "ro quiet"}
devices:
  - {bdf: "0000:c1:00.0", model: L40S}
""")
    f = _codes(check_host(discover(Sysfs(host))), "host")["IOMMU_OFF"]
    # amd_iommu= has no "on": the kernel turns AMD-Vi on by itself where the firmware enables it
    assert "AMD-Vi" in f.fix and "firmware" in f.fix and "amd_iommu=on" not in f.fix
    assert "intel_iommu" not in f.fix


@pytest.mark.parametrize("cmdline, named", [("ro iommu=off", "iommu=off"), ("amd_iommu=off iommu=pt", "amd_iommu=off")])
def test_a_cmdline_that_turns_the_iommu_off_is_named(make_host, cmdline, named):
    host = make_host(yaml_text=f"""
version: 1
name: amd-cmdline-off
host: {{cpu_vendor: AuthenticAMD, iommu: false, cmdline: "{cmdline}"}}
devices:
  - {{bdf: "0000:c1:00.0", model: L40S}}
""")
    f = _codes(check_host(discover(Sysfs(host))), "host")["IOMMU_OFF"]
    assert named in f.message and f"remove '{named}'" in f.fix


def test_firmware_iommu_off_when_cmdline_asks(make_host):
    host = make_host(yaml_text="""
version: 1
name: fw-off
host: {iommu: false, cmdline: "ro intel_iommu=on iommu=pt"}
devices:
  - {bdf: "0000:81:00.0", model: A40}
""")
    f = _codes(check_host(discover(Sysfs(host))), "host")["IOMMU_OFF"]
    assert "firmware" in f.message and "VT-d" in f.fix


def test_interrupt_remapping_off_and_builtin_vfio(make_host):
    host = make_host(yaml_text="""
version: 1
name: ir-off
host: {interrupt_remapping: false, modules: [nvidia, vfio, vfio_iommu_type1], builtin_modules: [vfio_pci]}
devices:
  - {bdf: "0000:81:00.0", model: A40}
""")
    f = _codes(check_host(discover(Sysfs(host))), "host")
    assert f["IR_OFF"].severity == "warning" and "allow_unsafe_interrupts" in f["IR_OFF"].message
    assert f["VFIO_BUILTIN"].severity == "info"
    assert f["VFIO_LOADED"].severity == "ok"      # built-in counts as present


def test_sriov_capable_without_vfs_says_sriov_manage(make_host):
    host = make_host(yaml_text="""
version: 1
name: no-vfs
host: {modules: [nvidia, vfio, vfio_pci, vfio_iommu_type1]}
devices:
  - {bdf: "0000:41:00.0", model: A100-PCIE-40GB}
""")
    f = _codes(check_host(discover(Sysfs(host))), "0000:41:00.0")["SRIOV_DISABLED"]
    assert "sriov-manage -e 0000:41:00.0" in f.fix


def test_creatable_vgpu_types_parser():
    text = "ID    : vGPU Name\n1145  : NVIDIA L40S-1B\n1414  : NVIDIA H200X-1-18C\n"
    assert parse_creatable_vgpu_types(text) == [("1145", "NVIDIA L40S-1B"), ("1414", "NVIDIA H200X-1-18C")]
    assert parse_creatable_vgpu_types("ID    : vGPU Name\n") == []   # a full GPU: header only


def test_an_mdev_removed_while_discovery_reads_it_is_skipped(make_host, monkeypatch):
    """A remove racing discovery (realpath's readlink meets a vanished link) drops that mdev, no crash."""
    from vgpuhost.io.state import StateStore
    from vgpuhost.ops.vgpu import create
    host = make_host("a40-mdev")
    made = create(host, StateStore(host.state_dir), profile="A40-8Q")
    assert [m.uuid for m in discover(Sysfs(host)).mdevs] == [made.id]
    real_resolve = Sysfs.resolve

    def racing(self, path):
        if made.id in str(path):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_resolve(self, path)

    monkeypatch.setattr(Sysfs, "resolve", racing)
    assert discover(Sysfs(host)).mdevs == ()


def _label(path, selinux_type):
    """Give ``path`` an SELinux context of ``selinux_type`` (its security.selinux attribute, as restorecon sets it)."""
    import os
    os.setxattr(path, "security.selinux", f"system_u:object_r:{selinux_type}:s0".encode() + b"\0")


def test_selinux_confined_hooks_and_a_hand_made_hooks_directory_are_warned(make_host):
    """SELinux enforcing with virt_hooks_unconfined off runs libvirt's hooks confined (rhbz#2276917), and a
    hooks directory with /etc/libvirt's type was made by hand: host check warns of each with its fix; with
    the boolean on and the directory relabelled, or SELinux permissive or off, it says nothing."""
    host = make_host("a40-mdev")
    selinux = host.root / "sys" / "fs" / "selinux"
    hooks = host.root / "etc" / "libvirt" / "hooks"
    hooks.mkdir(parents=True)
    assert "SELINUX_HOOKS_CONFINED" not in _codes(check_host(discover(Sysfs(host))), "host")   # no SELinux
    (selinux / "booleans").mkdir(parents=True)
    (selinux / "enforce").write_text("1")
    (selinux / "booleans" / "virt_hooks_unconfined").write_text("0 0")
    _label(hooks.parent, "virt_etc_t")
    _label(hooks, "virt_etc_t")
    inv = discover(Sysfs(host))
    assert inv.host.selinux.enforcing and inv.host.selinux.hooks_unconfined is False
    f = _codes(check_host(inv), "host")
    assert f["SELINUX_HOOKS_CONFINED"].severity == "warning"
    assert f["SELINUX_HOOKS_CONFINED"].fix == "setsebool -P virt_hooks_unconfined on"
    assert f["SELINUX_HOOKS_LABEL"].fix == "restorecon -Rv /etc/libvirt/hooks"
    assert "(virt_etc_t)" in f["SELINUX_HOOKS_LABEL"].message
    (selinux / "booleans" / "virt_hooks_unconfined").write_text("1 1")
    _label(hooks, "virt_hook_exec_t")
    f = _codes(check_host(discover(Sysfs(host))), "host")
    assert "SELINUX_HOOKS_CONFINED" not in f and "SELINUX_HOOKS_LABEL" not in f
    (selinux / "booleans" / "virt_hooks_unconfined").write_text("0 0")
    (selinux / "enforce").write_text("0")                                     # permissive: nothing is denied
    f = _codes(check_host(discover(Sysfs(host))), "host")
    assert "SELINUX_HOOKS_CONFINED" not in f and "SELINUX_HOOKS_LABEL" not in f


# ---------------------------------------------------------------------------
# the hook's scoped reads (issue 31): the GPUs a domain may use, each read alone, equal to the whole-host read

@pytest.mark.parametrize("name", ["a40-mdev", "l40s-vendor-vfio", "a100-sriov-mdev", "h200-mig"])
def test_discover_gpus_holds_each_gpus_records_as_the_whole_host_read_has_them(make_host, name):
    from vgpuhost.observe.inventory import discover_gpu, discover_gpus, gpu_part, nvidia_gpus
    host = make_host(name)
    fs = Sysfs(host)
    whole = discover(fs, host_facts=False)
    gpus = nvidia_gpus(fs)
    assert gpus == tuple(g.address for g in whole.gpus) and gpus
    scoped = discover_gpus(fs, gpus, host_facts=False)
    assert scoped.gpus == whole.gpus
    assert sorted(scoped.vgpu_types, key=repr) == sorted(whole.vgpu_types, key=repr)
    for g in gpus:
        part = gpu_part(whole, g)
        assert {a: scoped.devices[a] for a in part.devices} == dict(part.devices)
        # the re-check under the GPU's lock: what can change read again, the rest taken from the look
        again = discover_gpu(fs, g, host_facts=False, known=whole)
        assert again == discover_gpu(fs, g, host_facts=False)


def test_a_recheck_with_a_known_look_sees_a_vgpu_and_a_driver_change_made_since(make_host):
    from vgpuhost.io.sysfs import Sysfs as _Sysfs
    from vgpuhost.observe.inventory import discover_gpu
    from vgpuhost.ops.vgpu import create
    from vgpuhost.io.state import StateStore
    host = make_host("l40s-vendor-vfio")
    fs = _Sysfs(host)
    gpu = PciAddress.parse("0000:21:00.0")
    look = discover_gpu(fs, gpu, host_facts=False)
    store = StateStore(host.state_dir)
    out = create(host, store, profile="L40S-4Q", vf=PciAddress.parse("0000:21:00.4"), owner="manual")
    again = discover_gpu(fs, gpu, host_facts=False, known=look)
    assert again == discover_gpu(fs, gpu, host_facts=False)
    assert any(v.vf == PciAddress.parse(out.id) and v.type_id for v in again.vf_vgpus)
    # a driver_override written since the look is read again
    fs.write(host.pci_device("0000:21:00.5") / "driver_override", "vfio-pci\n")
    again = discover_gpu(fs, gpu, host_facts=False, known=look)
    assert again.devices[PciAddress.parse("0000:21:00.5")].driver_override == "vfio-pci"


@pytest.mark.parametrize("name", ["a100-sriov-mdev", "l40s-vendor-vfio"])
def test_sysfs_resolve_is_realpath(make_host, name, tmp_path):
    """``Sysfs.resolve`` (directories resolved once per instance, the last link read alone) gives what
    ``os.path.realpath`` gives: for every entry of the host's PCI, mdev and IOMMU folders (and a name and
    a link below each), and for absolute, looping, climbing and absent links."""
    import os
    host = make_host(name)
    fs = Sysfs(host)
    paths = []
    for top in ("sys/bus/pci/devices", "sys/class/mdev_bus", "sys/bus/mdev/devices", "sys/kernel/iommu_groups"):
        folder = str(host.root / top)
        for e in os.listdir(folder) if os.path.isdir(folder) else ():
            paths += [os.path.join(folder, e), os.path.join(folder, e, "x"), os.path.join(folder, e, "driver")]
    d = tmp_path / "links"
    d.mkdir()
    for link, target in (("loop1", "loop2"), ("loop2", "loop1"), ("abs", str(host.root)), ("mid", "a/../b"),
                         ("up", "../"), ("dot", "."), ("chain", "abs/sys/bus/pci/devices")):
        os.symlink(target, d / link)
    paths += [str(d / n) for n in ("loop1", "abs", "abs/sys", "mid", "up", "dot", "absent", "dot/abs", "chain")]
    paths += ["/", "/proc/self"]
    # a path through a link that refers to itself (trial 6 #2): realpath stops at the loop and keeps the
    # rest as it is, so head and tail resolved apart differ from the whole
    t = tmp_path / "t6" / "sys"
    (t / "b").mkdir(parents=True)
    for link, target in (("b/b", "b/../../a/"), ("a", "b"), ("b/0000:41:00.0", "../x"), ("x", ".")):
        os.symlink(target, t / link)
    paths += [str(t / "b/b/0000:41:00.0/a"), str(t / "b/b/x"), str(t / "a/0000:41:00.0/b/absent/../a")]
    assert len(paths) > 60
    assert [fs.resolve(p) for p in paths] == [os.path.realpath(p) for p in paths]


def test_sysfs_read_attrs_in_reads_as_read_optional(make_host):
    """``Sysfs.read_attrs_in`` gives ``read_optional``'s text for each attribute of every PCI function (None
    for an absent one), and raises its error for one that cannot be read (a directory: EISDIR)."""
    import os
    from vgpuhost.model.errors import SysfsError
    from vgpuhost.observe.inventory import _DEVICE_ATTRS
    host = make_host("a100-sriov-mdev")
    fs = Sysfs(host)
    names = _DEVICE_ATTRS + ["no_such_attribute"]
    folders = [f"{host.s.pci_devices}/{d}/" for d in sorted(os.listdir(host.s.pci_devices))]
    assert len(folders) > 20
    for d in folders:
        assert fs.read_attrs_in(d, names) == [fs.read_optional(d + n) for n in names]
    broken = folders[0] + "vendor"
    os.unlink(broken)
    os.mkdir(broken)
    with pytest.raises(SysfsError) as got:
        fs.read_attrs_in(folders[0], ["device", "vendor"])
    with pytest.raises(SysfsError) as want:
        fs.read_optional(broken)
    assert str(got.value) == str(want.value)
