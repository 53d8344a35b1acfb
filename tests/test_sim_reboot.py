"""`vgpuhost sim reboot`: what a reboot takes from a simulated host, and the boot units bringing it back.

Each test reads the tree back (``sys/``, ``proc/``, the simulated NVML) and the state store; the boot
is run as systemd runs it: the units' own command lines (rendered by ``install-units``' code), in their
``After=`` order, with the simulated root in ``VGPUHOST_ROOT`` (docs/guide/simulator.md#reboot).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.inventory import discover
from vgpuhost.ops import units
from vgpuhost.ops.layout import check
from vgpuhost.ops.vgpu import list_vgpus
from vgpuhost.policy.config import load as load_config
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.sim.nvml import SimNvml
from vgpuhost.sim.reboot import note_libvirtd

from test_units import exec_start_argv, unit_environment, unit_lines

GPU = "0000:41:00.0"
DOMAIN = "6f1b1d4e-0000-4000-8000-00000000b007"
CONFIG = ("version: 1\nlayouts:\n  compute:\n    gpus:\n"
          f"      - select: {{address: \"{GPU}\"}}\n        mode: vgpu\n"
          "        vgpu: {types: {A100-8C: 2}}\n")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def vgpus(host):
    store = StateStore(host.state_dir, create=False)
    return sorted((v.id, v.owner, v.state) for v in list_vgpus(discover(Sysfs(host)), store.vgpu_records()))


def mdevs(host):
    d = host.mdev_devices
    return sorted(os.listdir(d)) if d.is_dir() else []


def boot(host, config: Path):
    """The layout and reconcile units, as systemd runs them at boot: ExecStartPre=, then ExecStart=."""
    exe = str(Path(sys.executable).parent / "vgpuhost")
    texts = {name: units.render(name, exe=exe, config=str(config), retries=2, retry_delay=0)
             for name in (units.LAYOUT_UNIT, units.RECONCILE_UNIT)}
    for name in (units.LAYOUT_UNIT, units.RECONCILE_UNIT):         # the After= order
        lines = unit_lines(texts[name])
        env = dict(os.environ, VGPUHOST_ROOT=str(host.root))
        env.pop("VGPUHOST_STATE_DIR", None)
        env.update(unit_environment(texts[name]))
        for pre in lines.get("ExecStartPre", []):
            argv = shlex.split(pre)
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, (name, pre, proc.stdout, proc.stderr)
        proc = subprocess.run(exec_start_argv(texts[name]), env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (name, proc.stdout, proc.stderr)


def test_reboot_empties_the_tree_and_the_boot_units_restore_it(make_host, capsys):
    """Layout applied, a manual vGPU and a running domain's vGPU held open by its qemu; the reboot
    leaves no vGPU, no holder and every record missing (the domain still recorded running, as libvirt
    never sent its release); the boot units' commands forget the domain, apply the layout and re-create
    the manual vGPU, and reconcile then finds the host in sync."""
    host = make_host("a100-sriov-mdev")
    root = str(host.root)
    config = host.root / "etc" / "vgpuhost" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(CONFIG)
    assert run(capsys, "--root", root, "apply", "-c", str(config))[0] == 0
    assert run(capsys, "--root", root, "vgpu", "create", "--profile", "A100-8C")[0] == 0
    assert run(capsys, "--root", root, "vgpu", "create", "--profile", "A100-8C", "--owner", DOMAIN)[0] == 0
    StateStore(host.state_dir).domain_started(DOMAIN, "vm1")
    before = vgpus(host)
    held = next(i for i, o, _ in before if o == DOMAIN)
    pid = SimKernel(host).open_vgpu(held)
    assert (host.proc / str(pid) / "comm").is_file() and len(mdevs(host)) == 4

    code, out, err = run(capsys, "--json", "sim", "reboot", root)
    assert code == 0, err
    doc = json.loads(out)
    assert sorted(doc["vgpus_lost"]) == sorted(i for i, _, _ in before)
    assert doc["next"] == [f"vgpuhost --root {root} reconcile --forget-domains",
                           f"vgpuhost --root {root} config check -c {config}",
                           f"vgpuhost --root {root} apply -c {config}", f"vgpuhost --root {root} reconcile"]
    # the tree after the reboot: no mdev, no IOMMU group or /dev/vfio node of one, no holder
    assert mdevs(host) == []
    assert not (host.proc / str(pid)).exists() and SimKernel(host).holders(held) == []
    groups = sorted(os.listdir(host.iommu_groups))
    assert all(not any(len(n) == 36 for n in os.listdir(host.iommu_groups / g / "devices")) for g in groups)
    assert {s for _, _, s in vgpus(host)} == {"missing"}
    store = StateStore(host.state_dir)
    assert list(store.active_domains()) == [DOMAIN]        # no release end was sent
    assert config.read_text() == CONFIG                                 # etc/ is kept
    assert run(capsys, "--root", root, "reconcile", "--check")[0] == 1

    boot(host, config)
    after = vgpus(host)
    assert sorted((o, s) for _, o, s in after) == [("layout", "active")] * 2 + [("manual", "active")]
    assert [i for i, o, _ in after if o == "manual"] == [i for i, o, _ in before if o == "manual"]
    assert held not in mdevs(host) and len(mdevs(host)) == 3           # the domain's vGPU was released
    store = StateStore(host.state_dir)
    assert store.active_domains() == {}
    assert check(host, store, load_config(config)).in_sync
    assert run(capsys, "--root", root, "reconcile", "--check")[0] == 0
    actors = {r.actor.split(" ")[0] for r in store.audit_rows(None)}
    assert {"systemd:vgpuhost-layout.service", "systemd:vgpuhost-reconcile.service"} <= actors


def test_mig_mode_stays_its_instances_and_vendor_vfio_types_go(make_host, capsys):
    """H200, vendor-specific VFIO, MIG on: GPU instances and every VF's vGPU type are lost; MIG mode is
    not; mixed-size mode and the NVML scheduler are back to their defaults."""
    host = make_host("h200-mig-on")
    root = str(host.root)
    pf = PciAddress.parse("0000:18:00.0")
    config = host.root / "etc" / "vgpuhost" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text((Path(__file__).resolve().parents[1] / "examples" / "config" / "mig-h200.yaml").read_text())
    assert run(capsys, "--root", root, "apply", "-c", str(config), "mig")[0] == 0
    nvml = SimNvml(host)
    assert len(nvml.gpu_instances(pf)) == 4
    vfs = sorted(p.name for p in (host.root / "sys" / "bus" / "pci" / "devices").iterdir()
                 if (p / "nvidia" / "current_vgpu_type").is_file())
    types = {vf: (host.pci_device(vf) / "nvidia" / "current_vgpu_type").read_text().strip() for vf in vfs}
    assert sum(t != "0" for t in types.values()) == 3

    code, out, err = run(capsys, "--json", "sim", "reboot", root)
    assert code == 0, err
    assert json.loads(out)["gpu_instances_lost"] == {str(pf): 4}
    assert nvml.gpu_instances(pf) == [] and nvml.mig_mode(pf)[0] is True
    assert {(host.pci_device(vf) / "nvidia" / "current_vgpu_type").read_text().strip() for vf in vfs} == {"0"}
    assert run(capsys, "--root", root, "assert", "-c", str(config), "mig")[0] == 1

    boot(host, config)
    assert len(nvml.gpu_instances(pf)) == 4
    assert sorted((o, s) for _, o, s in vgpus(host)) == [("layout", "active")] * 3
    assert run(capsys, "--root", root, "assert", "-c", str(config), "mig")[0] == 0


def test_drivers_come_back_by_driverctl_and_mdevctl_starts_its_auto_definitions(make_host, capsys):
    """A40: a passthrough persisted with driverctl comes back on vfio-pci (driver_override set, as
    driverctl's udev rule does); a driver_override written by hand does not survive; an mdevctl
    definition with "start": "auto" is started with its attributes, a "manual" one is not."""
    host = make_host("a40-mdev")
    root = str(host.root)
    gpu = "0000:81:00.0"
    override = host.pci_device(gpu) / "driver_override"
    assert run(capsys, "--root", root, "passthrough", "prepare", gpu, "--persist")[0] == 0
    run(capsys, "sim", "reboot", root)
    assert os.path.basename(os.readlink(host.pci_device(gpu) / "driver")) == "vfio-pci"
    assert override.read_text() == "vfio-pci\n"
    assert run(capsys, "--root", root, "passthrough", "release", gpu)[0] == 0      # driverctl file kept
    assert os.path.basename(os.readlink(host.pci_device(gpu) / "driver")) == "nvidia"
    (host.root / "etc" / "driverctl.d" / f"pci-{gpu}").unlink()
    SimKernel(host).write(override, "vfio-pci\n")                     # by hand, not persisted
    run(capsys, "sim", "reboot", root)
    assert override.read_text() == "(null)\n"
    assert os.path.basename(os.readlink(host.pci_device(gpu) / "driver")) == "nvidia"

    assert run(capsys, "--root", root, "vgpu", "create", "--profile", "A40-8Q", "--persist")[0] == 0
    (auto,) = mdevs(host)
    manual = "0c7b0e3a-0000-4000-8000-00000000abcd"
    definitions = host.root / "etc" / "mdevctl.d" / gpu
    (definitions / manual).write_text(json.dumps({"mdev_type": "nvidia-566", "start": "manual", "attrs": []}))
    code, out, err = run(capsys, "--json", "sim", "reboot", root)
    doc = json.loads(out)
    assert code == 0 and doc["vgpus_lost"] == [auto] and doc["mdevctl_started"] == [auto], doc
    assert mdevs(host) == [auto]
    assert run(capsys, "--root", root, "reconcile", "--check")[0] == 0


def test_a_libvirtd_noted_for_the_root_is_forgotten_and_a_real_root_is_refused(make_host, tmp_path, capsys):
    host = make_host("a40-mdev")
    gone = tmp_path / "no-daemon-here"
    note_libvirtd(host, gone)
    note_libvirtd(host, gone)
    assert (host.sim_dir / "libvirtd-workdirs").read_text() == f"{gone}\n"
    code, out, err = run(capsys, "--json", "--root", str(host.root), "sim", "reboot")
    assert code == 0 and json.loads(out)["libvirtd_stopped"] == [], err
    assert not (host.sim_dir / "libvirtd-workdirs").exists()

    plain = tmp_path / "plain"
    (plain / "etc").mkdir(parents=True)
    code, out, err = run(capsys, "sim", "reboot", str(plain))
    assert code == 2 and err.count("\n") == 1 and "is not a simulated host" in err
    assert sorted(p.name for p in plain.rglob("*")) == ["etc"]
