"""plan / apply / assert of declarative layouts on simulated hosts.

Every outcome is read back from the simulated host (the sysfs tree, the
simulated NVML state), the state store and the audit log.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vgpuhost.ops import vgpu
from vgpuhost.cli.main import main
from vgpuhost.policy.config import load, parse
from vgpuhost.model.errors import DeviceError, InputError, RefusedError
from vgpuhost.ops.layout import REBOOT_MARK, RESET_MARK, apply, check, plan
from vgpuhost.io.backends import backend_for
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.sim.nvml import SimNvml
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "config"
A40 = PciAddress.parse("0000:81:00.0")
A100 = PciAddress.parse("0000:41:00.0")
H200 = PciAddress.parse("0000:18:00.0")
DOMAIN = "5b1d3c8e-7a2f-4c6d-9e0b-1f2a3b4c5d6e"

A40_DESK = """
version: 1
layouts:
  desk:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu:
          types: {A40-8Q: 4}
        scheduler: {policy: equal-share, timeslice_ms: 3}
"""


def cfg(text: str, name: str = "layout.yaml"):
    return parse(text, name)


def mdevs(host):
    """``{uuid: type id}`` of the mdevs in the simulated sysfs tree."""
    d = host.mdev_devices
    return {u: os.path.basename(os.readlink(d / u / "mdev_type")) for u in sorted(os.listdir(d))} \
        if d.exists() else {}


def vf_types(host, gpu):
    """``{VF: type id}`` of the vendor-VFIO VFs of ``gpu`` that hold a vGPU."""
    out = {}
    for link in sorted(host.pci_device(gpu).glob("virtfn*")):
        vf = os.path.basename(os.readlink(link))
        t = (host.pci_device(vf) / "nvidia" / "current_vgpu_type").read_text().strip()
        if t != "0":
            out[vf] = t
    return out


def set_sim_scheduler(host, gpu, policy="best-effort"):
    """Change the simulated GPU's scheduler behind vgpuhost's back (an operator's nvidia-smi)."""
    k = SimNvml(host).kernel
    with k.locked():
        meta = k.meta()
        meta["gpus"][str(gpu)]["scheduler"] = {"policy": policy, "arr": False, "timeslice_ms": None,
                                               "frequency_hz": None, "avg_factor": None}
        k.save_meta(meta)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_cfg(tmp_path, text, name="layout.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------------------
# the main loop: clean host -> layout; no-op; drift -> assert -> apply

def test_apply_from_a_clean_host_reaches_the_layout_and_a_second_apply_changes_nothing(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    c = cfg(A40_DESK)
    p = plan(host, store, c)
    assert [(s.kind, s.action) for s in p.steps] == [
        ("scheduler", "set the vGPU scheduler: equal share, ARR off, time slice 3 ms"),
        ("vgpu", "create 4 x A40-8Q")]
    assert p.steps[1].why.endswith("(layout.yaml:6)") and p.steps[0].why.endswith("(layout.yaml:10)")
    assert not check(host, store, c).in_sync
    result = apply(host, store, c)
    assert result.changed and [s.kind for s in result.done] == ["scheduler", "vgpu"] and not result.drift_after
    # the CLI prints an apply the agent made from its document, in the same words
    from vgpuhost.cli.layout import apply_text
    assert apply_text(result.as_dict()) == result.text()
    # read back: the tree, NVML, the records, the audit log
    assert sorted(mdevs(host).values()) == ["nvidia-566"] * 4
    assert backend_for(host).scheduler_state(A40) == SchedulerState("equal-share", arr=False, timeslice_ms=3)
    assert {r.owner for r in store.vgpu_records()} == {"layout"} and len(store.vgpu_records()) == 4
    rows = store.audit_rows()
    assert any(r.path.endswith("nvidia-566/create") for r in rows)
    assert any(r.path == f"nvml:{A40}/vgpu-scheduler" for r in rows)
    assert all("apply desk" in r.actor for r in rows if r.path != "(placement)")
    # a second apply changes nothing and writes nothing
    again = apply(host, store, c)
    assert not again.changed and again.done == []
    assert apply_text(again.as_dict()) == again.text()
    assert len(store.audit_rows()) == len(rows)
    assert check(host, store, c).in_sync


def test_a_removed_vgpu_is_drift_that_assert_reports_and_apply_repairs(make_host, tmp_path, capsys):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    path = write_cfg(tmp_path, A40_DESK)
    assert run(capsys, "--root", host.root, "apply", "-c", path)[0] == 0
    gone = sorted(mdevs(host))[0]
    vgpu.remove(host, store, gone)                      # by hand, with vgpuhost
    code, out, _ = run(capsys, "--root", host.root, "assert", "-c", path)
    assert code == 1 and out.splitlines() == [f"drift from layout 'desk' ({path}):",
                                              "- 0000:81:00.0 vgpu A40-8Q x4 (host has 3)"]
    code, out, _ = run(capsys, "--root", host.root, "apply", "-c", path)
    assert code == 0 and "create 1 x A40-8Q" in out
    assert len(mdevs(host)) == 4 and gone not in mdevs(host)
    assert run(capsys, "--root", host.root, "assert", "-c", path)[0] == 0


def test_a_vgpu_removed_behind_vgpuhosts_back_comes_back_with_its_uuid(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    c = cfg(A40_DESK)
    apply(host, store, c)
    gone = sorted(mdevs(host))[1]
    Sysfs(host).write(host.mdev_devices / gone / "remove", "1")        # echo 1 > remove
    d = check(host, store, c)
    assert f"- 0000:81:00.0 vgpu {'A40-8Q'} {gone} (recorded for the layout, missing on the host)" in d.diff
    p = plan(host, store, c)
    assert [s.action for s in p.steps] == [f"re-create A40-8Q {gone}"]
    apply(host, store, c)
    assert gone in mdevs(host) and len(mdevs(host)) == 4
    assert check(host, store, c).in_sync


def test_a_failed_re_create_keeps_the_id_for_the_next_apply(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    c = cfg(A40_DESK)
    apply(host, store, c)
    gone = sorted(mdevs(host))[0]
    Sysfs(host).write(host.mdev_devices / gone / "remove", "1")
    k = SimNvml(host).kernel                           # the vGPU manager fails the next create once
    with k.locked():
        meta = k.meta()
        # EINVAL: a refusal, not the GPU failing (EIO would take it out of service: test_gpu_health)
        meta["faults"] = [{"op": "create", "device": str(A40), "errno": 22, "count": 1, "effect": "error"}]
        k.save_meta(meta)
    with pytest.raises(DeviceError, match=f"re-creating A40-8Q {gone} on 0000:81:00.0 failed: EINVAL"):
        apply(host, store, c)
    assert gone in {r.id for r in store.vgpu_records()}          # still recorded, still missing
    apply(host, store, c)
    assert gone in mdevs(host) and len(mdevs(host)) == 4 and check(host, store, c).in_sync


def test_a_changed_scheduler_is_drift_and_apply_repairs_it_keeping_the_vgpus(make_host, capsys, tmp_path):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    c = cfg(A40_DESK)
    apply(host, store, c)
    before = mdevs(host)
    set_sim_scheduler(host, A40, "best-effort")
    d = check(host, store, c)
    assert d.diff == ["- 0000:81:00.0 scheduler equal share, ARR off, time slice 3 ms (host has best effort)"]
    # the simulated driver changes the scheduler only while no vGPU runs: the layout's go and come back
    p = plan(host, store, c)
    assert [s.kind for s in p.steps] == ["vgpu"] * 4 + ["scheduler", "vgpu"]
    assert "the scheduler can change only while no vGPU runs" in p.steps[0].why
    result = apply(host, store, c)
    assert mdevs(host) == before                       # same UUIDs, same types
    assert backend_for(host).scheduler_state(A40).policy == "equal-share"
    assert not result.drift_after and check(host, store, c).in_sync


# ---------------------------------------------------------------------------
# ownership and running VMs

def test_a_layout_that_would_remove_a_running_vms_vgpu_stops_before_any_change(make_host, tmp_path, capsys):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    c = cfg(A40_DESK)
    apply(host, store, c)
    store.domain_started(DOMAIN, "vm1")
    vm = vgpu.create(host, store, profile="A40-8Q", owner=DOMAIN)
    set_sim_scheduler(host, A40, "best-effort")       # drift that needs the GPU empty
    tree, rows = mdevs(host), len(store.audit_rows())
    p = plan(host, store, c)
    assert p.blocked == [f"vGPU {vm.id} (A40-8Q) on 0000:81:00.0 is held by running domain vm1 ({DOMAIN}): it "
                         "would have to be removed (the scheduler can change only while no vGPU runs on the GPU)"]
    with pytest.raises(RefusedError, match=f"held by running domain vm1 \\({DOMAIN}\\)") as ei:
        apply(host, store, c)
    assert "nothing was changed" in ei.value.one_line()
    assert mdevs(host) == tree and len(store.audit_rows()) == rows
    assert backend_for(host).scheduler_state(A40).policy == "best-effort"
    # a layout that takes the GPU for passthrough names the domain too (CLI: exit 2, one line)
    path = write_cfg(tmp_path, "version: 1\nlayouts:\n  pt:\n    gpus:\n      - {select: {board: A40}, "
                                "mode: passthrough}\n")
    code, out, err = run(capsys, "--root", host.root, "apply", "-c", path)
    assert code == 2 and out == "" and err.count("\n") == 1 and "held by running domain vm1" in err
    assert mdevs(host) == tree and len(store.audit_rows()) == rows
    # once the VM is gone (the hook releases it) the layout goes through
    vgpu.release_owner(host, store, DOMAIN)
    store.domain_stopped(DOMAIN)
    apply(host, store, c)
    assert check(host, store, c).in_sync and len(mdevs(host)) == 4


def test_a_layout_never_removes_vgpus_it_did_not_create(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    manual = vgpu.create(host, store, profile="A40-8Q")
    plain = A40_DESK.replace("        scheduler: {policy: equal-share, timeslice_ms: 3}\n", "")
    apply(host, store, cfg(plain.replace("A40-8Q: 4", "A40-8Q: 2")))
    assert len(mdevs(host)) == 3 and manual.id in mdevs(host)
    apply(host, store, cfg(plain.replace("A40-8Q: 4", "A40-8Q: 1")))
    assert len(mdevs(host)) == 2 and manual.id in mdevs(host)
    # a size the manual vGPU keeps out (equal-size mode) is refused before the layout's go
    smaller = cfg(plain.replace("A40-8Q: 4", "A40-4Q: 2"))
    p = plan(host, store, smaller)
    assert any(f"vGPU {manual.id} (A40-8Q, owner manual) holds 0000:81:00.0 at 8192 MiB vGPUs" in b
               for b in p.blocked)
    before = mdevs(host)
    with pytest.raises(RefusedError):
        apply(host, store, smaller)
    assert mdevs(host) == before
    # a mode change that needs the GPU empty names the manual vGPU and how to remove it
    set_sim_scheduler(host, A40, "fixed-share")
    p = plan(host, store, cfg(A40_DESK.replace("A40-8Q: 4", "A40-8Q: 1")))
    assert any(f"vGPU {manual.id} (A40-8Q) on 0000:81:00.0 (owner manual) would have to be removed" in b
               and f"vgpuhost vgpu remove {manual.id}" in b for b in p.blocked)


def test_layout_vgpus_on_a_gpu_the_layout_no_longer_selects_are_removed(make_host):
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    both = cfg("version: 1\nlayouts:\n  l:\n    gpus:\n      - select: {board: L40S}\n        mode: vgpu\n"
               "        vgpu: {types: {L40S-8Q: 2}}\n")
    apply(host, store, both)
    second = PciAddress.parse("0000:a1:00.0")
    assert len(vf_types(host, PciAddress.parse("0000:21:00.0"))) == 2 and len(vf_types(host, second)) == 2
    one = cfg("version: 1\nlayouts:\n  l:\n    gpus:\n      - select: {address: \"0000:21:00.0\"}\n"
              "        mode: vgpu\n        vgpu: {types: {L40S-8Q: 2}}\n")
    d = check(host, store, one)
    assert sum("(owner layout, not in layout 'l')" in x for x in d.diff) == 2
    apply(host, store, one)
    assert vf_types(host, second) == {} and check(host, store, one).in_sync


def test_total_counts_are_placed_by_the_strategy(make_host):
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    text = ("version: 1\nlayouts:\n  l:\n    gpus:\n      - select: {board: L40S}\n        mode: vgpu\n"
            "        vgpu: {types: {L40S-4Q: N}, counts: total, strategy: spread}\n")
    g1, g2 = PciAddress.parse("0000:21:00.0"), PciAddress.parse("0000:a1:00.0")
    apply(host, store, cfg(text.replace("N", "4")))
    assert (len(vf_types(host, g1)), len(vf_types(host, g2))) == (2, 2)
    assert not apply(host, store, cfg(text.replace("N", "4"))).changed
    apply(host, store, cfg(text.replace("N", "7")))
    assert len(vf_types(host, g1)) + len(vf_types(host, g2)) == 7
    d = check(host, store, cfg(text.replace("N", "3")))
    assert d.diff == ["- 0000:21:00.0,0000:a1:00.0 vgpu L40S-4Q x3 total (host has 7)"]
    apply(host, store, cfg(text.replace("N", "3")))
    assert len(vf_types(host, g1)) + len(vf_types(host, g2)) == 3
    assert check(host, store, cfg(text.replace("N", "3"))).in_sync


# ---------------------------------------------------------------------------
# MIG

def test_mig_layout_then_a_switch_to_time_sliced_and_back(make_host):
    host = make_host("a100-sriov-mdev")
    store = StateStore(host.state_dir)
    c = load(EXAMPLES / "vgpu-a100.yaml")
    b = backend_for(host)
    result = apply(host, store, c, "mig")
    assert [s.kind for s in result.done] == ["mig-mode", "gpu-instance", "vgpu", "vgpu", "vgpu"]
    assert b.mig_mode(A100) == (True, True)
    names = {p.profile_id: p.name for p in b.gi_profiles(A100)}
    assert sorted(names[g.profile_id] for g in b.gpu_instances(A100)) == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
    assert sorted(mdevs(host).values()) == ["nvidia-474", "nvidia-474", "nvidia-475", "nvidia-476"]
    assert not apply(host, store, c, "mig").changed
    # switch: the MIG-backed vGPUs go, MIG mode goes off, the time-sliced vGPUs come
    p = plan(host, store, c, "compute")
    assert [s.kind for s in p.steps] == ["vgpu"] * 4 + ["mig-mode", "scheduler", "vgpu"]
    apply(host, store, c, "compute")
    assert b.mig_mode(A100) == (False, False)
    assert sorted(mdevs(host).values()) == ["nvidia-471"] * 4
    assert b.scheduler_state(A100) == SchedulerState("equal-share", arr=True, frequency_hz=480, avg_factor=33)
    assert check(host, store, c, "compute").in_sync and not check(host, store, c, "mig").in_sync


A100_PERSISTENCED = """
version: 1
name: a100-p
host:
  cmdline: ro intel_iommu=on iommu=pt
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
  processes: [nvidia-persistenced]
devices:
  - {bdf: "0000:40:01.1", model: intel-root-port}
  - bdf: "0000:41:00.0"
    model: A100-PCIE-40GB
    upstream: "0000:40:01.1"
    vgpu: {backend: mdev, sriov_numvfs: 8}
"""


def test_a_mig_mode_change_left_pending_is_reported_not_failed(make_host):
    host = make_host(yaml_text=A100_PERSISTENCED)     # persistenced blocks the GPU reset
    store = StateStore(host.state_dir)
    c = load(EXAMPLES / "vgpu-a100.yaml")
    result = apply(host, store, c, "mig")
    assert [s.kind for s in result.done] == ["mig-mode"]
    assert [s.kind for s in result.skipped] == ["gpu-instance", "vgpu", "vgpu", "vgpu"]
    assert any("reset the GPU (nvidia-smi -r -i 0000:41:00.0)" in s.action for s in result.reboot)
    assert result.drift_after == [f"- 0000:41:00.0 mig-mode on (host has off, on pending) {RESET_MARK}"]
    d = check(host, store, c, "mig")
    assert d.reboot == d.diff and not d.runtime
    # a second apply does not try again; it reports the reset
    again = plan(host, store, c, "mig")
    assert again.steps == [] and [s.kind for s in again.reboot] == ["mig-mode"] and again.reboot[0].reboot
    SimNvml(host).reset(A100)
    apply(host, store, c, "mig")
    assert check(host, store, c, "mig").in_sync


def test_mig_on_vendor_vfio_with_vfs_enabled_is_an_operator_step(make_host, capsys):
    host = make_host("h200-mig")
    store = StateStore(host.state_dir)
    c = load(EXAMPLES / "mig-h200.yaml")
    p = plan(host, store, c, "mig")
    assert [s.kind for s in p.manual] == ["sriov"] and "sriov-manage -d 0000:18:00.0" in p.manual[0].action
    with pytest.raises(RefusedError, match="SR-IOV VFs are disabled"):
        apply(host, store, c, "mig")
    assert store.audit_rows() == [] and backend_for(host).mig_mode(H200) == (False, False)
    code, out, err = run(capsys, "--root", host.root, "plan", "-c", EXAMPLES / "mig-h200.yaml", "mig")
    assert code == 2 and "operator steps (vgpuhost does not run them):" in out and "is blocked" in err


from test_mig_vgpu import H200_MIG_ON   # noqa: E402  (the same MIG-on H200 host)


def test_mig_backed_vgpus_on_vendor_vfio(make_host):
    host = make_host(yaml_text=H200_MIG_ON)
    store = StateStore(host.state_dir)
    c = load(EXAMPLES / "mig-h200.yaml")
    apply(host, store, c, "mig")
    b = backend_for(host)
    names = {p.profile_id: p.name for p in b.gi_profiles(H200)}
    assert sorted(names[g.profile_id] for g in b.gpu_instances(H200)) == ["1g.18gb", "1g.18gb", "2g.35gb", "3g.71gb"]
    assert sorted(vf_types(host, H200).values()) == ["1414", "1414", "1418"]
    assert check(host, store, c, "mig").in_sync and not apply(host, store, c, "mig").changed


# ---------------------------------------------------------------------------
# passthrough

A40_PT = """
version: 1
name: a40-pt
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio, snd_hda_intel]
devices:
  - {bdf: "0000:80:03.0", model: intel-root-port}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:03.0", vgpu: {backend: mdev}}
  - {bdf: "0000:81:00.1", model: nvidia-hda, upstream: "0000:80:03.0"}
"""

PT = """
version: 1
default: pt
layouts:
  pt:
    gpus:
      - select: {device_id: 0x2235}
        mode: passthrough
        passthrough: {persist: true}
  vdi:
    gpus:
      - select: {device_id: 0x2235}
        mode: vgpu
        vgpu: {types: {A40-4Q: 2}}
"""


def driver(host, bdf):
    link = host.pci_device(bdf) / "driver"
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else None


def test_passthrough_layout_binds_the_group_and_a_vgpu_layout_gives_it_back(make_host):
    host = make_host(yaml_text=A40_PT)
    store = StateStore(host.state_dir)
    c = cfg(PT)
    result = apply(host, store, c)
    group = os.path.basename(os.readlink(host.pci_device("0000:81:00.0") / "iommu_group"))
    assert [(s.kind, s.action) for s in result.done] == [
        ("passthrough", f"bind IOMMU group {group} (2 functions) to vfio-pci and write driverctl overrides")]
    assert driver(host, "0000:81:00.0") == "vfio-pci" and driver(host, "0000:81:00.1") == "vfio-pci"
    assert (host.driverctl_d / "pci-0000:81:00.0").read_text() == "vfio-pci\n"
    assert not apply(host, store, c).changed and check(host, store, c).in_sync
    # the vdi layout takes it back: release (overrides removed), then vGPUs
    d = check(host, store, c, "vdi")
    assert d.diff[0] == "- 0000:81:00.0 driver nvidia (host has vfio-pci)"
    apply(host, store, c, "vdi")
    assert driver(host, "0000:81:00.0") == "nvidia" and driver(host, "0000:81:00.1") == "snd_hda_intel"
    assert not (host.driverctl_d / "pci-0000:81:00.0").exists()
    assert sorted(mdevs(host).values()) == ["nvidia-564"] * 2
    assert check(host, store, c, "vdi").in_sync


def test_a_gpu_passed_through_to_a_running_domain_is_not_taken_back(make_host):
    host = make_host(yaml_text=A40_PT)
    store = StateStore(host.state_dir)
    c = cfg(PT)
    apply(host, store, c)
    # the hook records its domain as the group's owner
    with store.transaction() as conn:
        conn.execute("UPDATE passthrough SET owner = ?", (DOMAIN,))
    store.domain_started(DOMAIN, "vm1")
    p = plan(host, store, c, "vdi")
    assert p.blocked == [f"0000:81:00.0 is passed through to running domain vm1 ({DOMAIN}): vgpu mode would take "
                         "it back"]
    with pytest.raises(RefusedError):
        apply(host, store, c, "vdi")
    assert driver(host, "0000:81:00.0") == "vfio-pci"


# ---------------------------------------------------------------------------
# reboot steps, failures, selection, CLI

def test_kernel_parameters_and_modules_are_reported_never_done(make_host, tmp_path, capsys):
    host = make_host("a40-mdev")
    text = A40_DESK.replace("layouts:", "host:\n  kernel_params: [intel_iommu=on, iommu=pt, nosmt]\n"
                            "  vfio_modules: [vfio_pci, vfio_virqfd]\nlayouts:")
    text = text.replace("timeslice_ms: 3}", "timeslice_ms: 3, persist: true}")
    path = write_cfg(tmp_path, text)
    etc_before = sorted(str(p) for p in host.path("etc").rglob("*"))
    code, out, _ = run(capsys, "--root", host.root, "plan", "-c", path)
    assert code == 0 and "reported, never done by vgpuhost" in out
    p = plan(host, StateStore(host.state_dir, create=False), load(path))
    assert [(s.kind, s.reboot) for s in p.reboot] == [("kernel-param", True), ("module", True), ("scheduler", True)]
    assert "add nosmt to the kernel command line" in p.reboot[0].action
    assert "vfio_virqfd" in p.reboot[1].action and "never loads modules" in p.reboot[1].action
    assert "--policy equal-share --timeslice-ms 3 --persist" in p.reboot[2].action
    code, out, _ = run(capsys, "--root", host.root, "apply", "-c", path)
    assert code == 0 and "reported, never done" in out
    assert sorted(str(p) for p in host.path("etc").rglob("*")) == etc_before        # nothing written to etc/
    code, out, _ = run(capsys, "--root", host.root, "assert", "-c", path)
    assert code == 1
    assert out.splitlines()[1:] == [
        f"- host kernel-param nosmt (cmdline lacks it) {REBOOT_MARK}",
        f"- host module vfio_virqfd (not loaded) {REBOOT_MARK}",
        f"- 0000:81:00.0 scheduler-persist RmPVMRL=0x00030003 (modprobe.d has none) {REBOOT_MARK}"]


def test_a_failing_step_exits_3_naming_the_step_and_retries_help(make_host, tmp_path, capsys):
    spec = """
version: 1
name: a40-fault
host: {modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]}
devices:
  - {bdf: "0000:80:03.0", model: intel-root-port}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:03.0", vgpu: {backend: mdev}}
faults:
  - {op: create, device: "0000:81:00.0", errno: EAGAIN, count: 1}
"""
    # EAGAIN: a transient failure a retry gets past (EIO or ENODEV would take the GPU out of service
    # until 'gpu uncordon', issue 27: then no retry helps)
    host = make_host(yaml_text=spec)
    path = write_cfg(tmp_path, A40_DESK)
    code, _, err = run(capsys, "--root", host.root, "apply", "-c", path)
    assert code == 3 and err.count("\n") == 1
    assert "step 2 of 2 failed (vgpu 0000:81:00.0: create 4 x A40-8Q)" in err
    assert "1 step(s) before it stay done" in err
    # the fault is spent: with --retries the next try converges
    host2 = make_host(yaml_text=spec)
    code, out, err = run(capsys, "--root", host2.root, "apply", "-c", path, "--retries", "2", "--retry-delay", "0")
    assert code == 0 and "try 1 of 3" in err and "applied" in out
    assert len(mdevs(host2)) == 4


def test_two_entries_that_select_one_gpu_on_the_host_are_refused(make_host):
    host = make_host("a40-mdev")
    c = cfg("version: 1\nlayouts:\n  l:\n    gpus:\n      - select: {board: A40}\n        mode: vgpu\n"
            "        vgpu: {types: {A40-8Q: 1}}\n      - select: {address: \"0000:81:00.0\"}\n"
            "        mode: passthrough\n", "two.yaml")
    with pytest.raises(InputError) as ei:
        plan(host, StateStore(host.state_dir, create=False), c)
    assert ei.value.message.startswith("two.yaml:8: selects 0000:81:00.0 (A40), which the entry at line 5 "
                                       "selects too")


def test_json_documents_and_dry_run(make_host, tmp_path, capsys):
    host = make_host("a40-mdev")
    path = write_cfg(tmp_path, A40_DESK)
    code, out, _ = run(capsys, "--root", host.root, "--json", "plan", "-c", path)
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "vgpuhost.plan/v1" and doc["changed"] is True
    assert doc["steps"][1] == {"kind": "vgpu", "target": "0000:81:00.0", "action": "create 4 x A40-8Q",
                               "why": f"layout wants 4, host has 0 ({path}:6)", "reboot": False}
    code, dry, _ = run(capsys, "--root", host.root, "--json", "apply", "-c", path, "--dry-run")
    assert code == 0 and json.loads(dry) == doc
    assert not host.state_dir.joinpath("state.db").exists()          # plan and --dry-run write nothing
    code, out, _ = run(capsys, "--root", host.root, "--json", "assert", "-c", path)
    d = json.loads(out)
    assert code == 1 and d["schema"] == "vgpuhost.assert/v1" and d["in_sync"] is False and len(d["diff"]) == 2
    code, out, _ = run(capsys, "--root", host.root, "--json", "apply", "-c", path)
    a = json.loads(out)
    assert code == 0 and a["schema"] == "vgpuhost.apply/v1" and a["changed"] and a["drift_after"] == []
    code, out, _ = run(capsys, "--root", host.root, "--json", "assert", "-c", path)
    assert code == 0 and json.loads(out)["in_sync"] is True


def test_plan_text_golden(make_host):
    from conftest import golden
    host = make_host("a100-sriov-mdev")
    c = load(EXAMPLES / "vgpu-a100.yaml")
    store = StateStore(host.state_dir, create=False)
    text = plan(host, store, c, "mig").text().replace(str(EXAMPLES), "examples/config")
    golden("config", "plan-a100-mig.txt", text + "\n")


def test_unknown_layout_and_bad_config_exit_2(make_host, tmp_path, capsys):
    host = make_host("a40-mdev")
    path = write_cfg(tmp_path, A40_DESK)
    code, _, err = run(capsys, "--root", host.root, "apply", "-c", path, "nope")
    assert code == 2 and "no layout 'nope'" in err
    code, _, err = run(capsys, "--root", host.root, "plan", "-c", tmp_path / "missing.yaml")
    assert code == 2 and "cannot read config file" in err
    assert not host.state_dir.joinpath("state.db").exists()


# ---------------------------------------------------------------------------
# review 1 regressions: preconditions are checked in plan, before any change

def test_leaving_fixed_share_for_mixed_size_sets_the_scheduler_first(make_host, tmp_path, capsys):
    # review 1, item 1: vdi (fixed share, 6 x A40-8Q) -> mixed (equal share, mixed-size mode) failed
    # at the mixed-size step after removing all six vGPUs, and every later apply failed the same way
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    path = EXAMPLES / "vgpu-a40.yaml"
    assert run(capsys, "--root", host.root, "apply", "-c", path)[0] == 0
    vdi = mdevs(host)
    assert sorted(vdi.values()) == ["nvidia-566"] * 6
    p = plan(host, store, load(path), "mixed")
    kinds = [s.kind for s in p.steps]
    assert kinds == ["vgpu"] * 6 + ["scheduler", "mixed-size", "vgpu", "vgpu"]
    assert "before mixed-size mode, which fixed share does not allow" in p.steps[6].why
    # only the removed vGPUs that come back say so; the two kept keep their UUIDs
    back = [s for s in p.steps[:6] if "re-creates it after, with the same UUID" in s.why]
    assert len(back) == 2 and all("does not want it back" in s.why for s in p.steps[:6] if s not in back)
    code, out, err = run(capsys, "--root", host.root, "apply", "-c", path, "mixed")
    assert code == 0, err
    # read back: NVML state, the mdev tree
    b = backend_for(host)
    assert b.heterogeneous_mode(A40) is True
    assert b.scheduler_state(A40) == SchedulerState("equal-share", arr=False, timeslice_ms=2)
    now = mdevs(host)
    assert sorted(now.values()) == ["nvidia-564"] * 4 + ["nvidia-566"] * 2
    assert {u for u, t in now.items() if t == "nvidia-566"} <= set(vdi)
    assert run(capsys, "--root", host.root, "assert", "-c", path, "mixed")[0] == 0
    # and back: mixed-size off first, then fixed share
    p = plan(host, store, load(path), "vdi")
    assert [s.kind for s in p.steps if s.kind != "vgpu"] == ["mixed-size", "scheduler"]
    assert run(capsys, "--root", host.root, "apply", "-c", path, "vdi")[0] == 0
    assert b.heterogeneous_mode(A40) is False and b.scheduler_state(A40).policy == "fixed-share"
    assert sorted(mdevs(host).values()) == ["nvidia-566"] * 6


def test_capacity_is_judged_in_the_mode_the_plan_leaves(make_host, capsys):
    """Trial 4 finding 17: an empty A40 in mixed-size mode (4 x A40-8Q at most) and the vdi layout
    (6 x A40-8Q, mixed_size: false): the plan's own step turns mixed-size off first, so the six fit."""
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    assert run(capsys, "--root", host.root, "vgpu", "mode", "--gpu", str(A40), "--mixed-size", "on")[0] == 0
    p = plan(host, store, load(EXAMPLES / "vgpu-a40.yaml"), "vdi")
    assert p.blocked == [] and [s.kind for s in p.steps][:2] == ["mixed-size", "scheduler"]
    assert run(capsys, "--root", host.root, "apply", "-c", EXAMPLES / "vgpu-a40.yaml", "vdi")[0] == 0
    assert backend_for(host).heterogeneous_mode(A40) is False
    assert sorted(mdevs(host).values()) == ["nvidia-566"] * 6


MIXED_NO_SCHEDULER = """
version: 1
layouts:
  two-sizes:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu: {types: {A40-8Q: 2, A40-4Q: 2}, mixed_size: true}
"""


def test_mixed_size_on_a_fixed_share_gpu_without_a_scheduler_is_blocked_before_any_change(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    apply(host, store, load(EXAMPLES / "vgpu-a40.yaml"), "vdi")          # fixed share, 6 vGPUs
    tree, rows = mdevs(host), len(store.audit_rows())
    c = cfg(MIXED_NO_SCHEDULER)
    p = plan(host, store, c)
    assert any("uses the fixed-share scheduler, which mixed-size mode does not allow" in b and "layout.yaml:6" in b
               for b in p.blocked)
    with pytest.raises(RefusedError, match="fixed-share scheduler"):
        apply(host, store, c)
    assert mdevs(host) == tree and len(store.audit_rows()) == rows
    assert backend_for(host).heterogeneous_mode(A40) is False


def set_sim_caps(host, gpu, **caps):
    k = SimNvml(host).kernel
    with k.locked():
        meta = k.meta()
        meta["gpus"][str(gpu)]["scheduler_caps"].update(caps)
        k.save_meta(meta)


def test_a_scheduler_the_device_cannot_take_is_a_config_error_at_plan_not_a_failed_step(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    apply(host, store, cfg(A40_DESK))                                      # 4 vGPUs, equal share 3 ms
    tree, rows = mdevs(host), len(store.audit_rows())
    set_sim_caps(host, A40, max_timeslice_ms=2)
    with pytest.raises(InputError) as ei:
        apply(host, store, cfg(A40_DESK))
    assert ei.value.message.startswith("layout.yaml:10: scheduler: ") and "timeslice 3 ms" in ei.value.message
    assert mdevs(host) == tree and len(store.audit_rows()) == rows
    # no ARR on the device: 'fixed-share' alone means the driver's default time slice, as
    # 'vgpuhost scheduler set' does it, and a second apply finds the host in sync
    set_sim_caps(host, A40, max_timeslice_ms=30, arr_supported=False)
    c = cfg(A40_DESK.replace("{policy: equal-share, timeslice_ms: 3}", "{policy: fixed-share}"))
    apply(host, store, c)
    assert backend_for(host).scheduler_state(A40).policy == "fixed-share"
    assert check(host, store, c).in_sync and not apply(host, store, c).changed


def test_type_names_differing_in_case_are_a_duplicate_and_the_plan_spells_types_as_the_device(
        make_host, tmp_path, capsys):
    # review 1, item 4
    dup = write_cfg(tmp_path, A40_DESK.replace("types: {A40-8Q: 4}", 'types: {"A40-8Q": 4, "a40-8q": 1}'))
    code, out, err = run(capsys, "config", "check", "-c", dup)
    assert code == 2 and out == ""
    assert err.startswith(f"vgpuhost: error: {dup}:9: duplicate type: vgpu.types names a40-8q twice (as A40-8Q)")
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    lower = cfg(A40_DESK.replace("types: {A40-8Q: 4}", "types: {a40-8q: 2}"))
    p = plan(host, store, lower)
    assert [s.action for s in p.steps if s.kind == "vgpu"] == ["create 2 x A40-8Q"]
    apply(host, store, lower)
    assert sorted(mdevs(host).values()) == ["nvidia-566"] * 2
    assert {r.type_name for r in store.vgpu_records()} == {"A40-8Q"}
    assert check(host, store, lower).in_sync
    # review 1, item 13: a type the layout no longer wants is named as the device spells it
    other = cfg(A40_DESK.replace("types: {A40-8Q: 4}", "types: {a40-4q: 1}"))
    p = plan(host, store, other)
    removes = [s for s in p.steps if s.action.startswith("remove")]
    assert len(removes) == 2 and all("layout wants 0 A40-8Q, host has 2" in s.why for s in removes)
    assert "- 0000:81:00.0 vgpu A40-8Q x0 (host has 2)" in p.diff
    assert [s.action for s in p.steps if s.action.startswith("create")] == ["create 1 x A40-4Q"]


def test_vgpus_removed_for_passthrough_are_not_said_to_come_back(make_host):
    # review 1, item 13
    host = make_host(yaml_text=A40_PT)
    store = StateStore(host.state_dir)
    c = cfg(PT)
    apply(host, store, c, "vdi")
    assert len(mdevs(host)) == 2
    p = plan(host, store, c, "pt")
    removes = [s for s in p.steps if s.action.startswith("remove")]
    assert len(removes) == 2
    assert all("re-creates" not in s.why and "not re-created: the GPU is passed through" in s.why for s in removes)
    apply(host, store, c, "pt")
    assert mdevs(host) == {} and driver(host, "0000:81:00.0") == "vfio-pci"


def test_a_mig_change_behind_enabled_vfs_is_an_operator_line_in_assert(make_host, capsys):
    # review 1, item 8: apply cannot fix it until the VFs are disabled by hand
    host = make_host("h200-mig")
    store = StateStore(host.state_dir)
    c = load(EXAMPLES / "mig-h200.yaml")
    d = check(host, store, c, "mig")
    line = "- 0000:18:00.0 mig-mode on (host has off) (needs an operator step)"
    assert line in d.diff and line in d.reboot
    code, out, _ = run(capsys, "--root", host.root, "--json", "assert", "-c", EXAMPLES / "mig-h200.yaml", "mig")
    assert code == 1 and line in json.loads(out)["reboot"]


def test_turning_mig_off_behind_enabled_vfs_is_blocked_before_the_vgpus_go(make_host):
    # the plan used to remove the MIG-backed vGPUs, then fail at the MIG mode step
    host = make_host(yaml_text=H200_MIG_ON)
    store = StateStore(host.state_dir)
    c = load(EXAMPLES / "mig-h200.yaml")
    apply(host, store, c, "mig")
    held, rows = vf_types(host, H200), len(store.audit_rows())
    p = plan(host, store, c, "timesliced")
    assert p.blocked and "turning MIG mode off" in p.blocked[0] and "sriov-manage -d 0000:18:00.0" in p.blocked[0]
    assert "- 0000:18:00.0 mig-mode off (host has on) (needs an operator step)" in p.diff
    with pytest.raises(RefusedError, match="SR-IOV VFs are disabled"):
        apply(host, store, c, "timesliced")
    assert vf_types(host, H200) == held and len(store.audit_rows()) == rows
    assert backend_for(host).mig_mode(H200) == (True, True)


H200_VFS_OFF = """
version: 1
name: h200-vfs-off
host: {modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]}
devices:
  - {bdf: "0000:17:01.0", model: intel-root-port}
  - {bdf: "0000:18:00.0", model: H200-SXM-141GB, upstream: "0000:17:01.0"}
"""


def test_with_the_vfs_disabled_apply_changes_mig_mode_and_names_the_next_operator_step(make_host):
    # the operator step the plan names ("disable the VFs, run apply, enable them, run apply
    # again") used to be blocked at its second step ("enable the VFs first")
    host = make_host(yaml_text=H200_VFS_OFF)
    store = StateStore(host.state_dir)
    c = load(EXAMPLES / "mig-h200.yaml")
    p = plan(host, store, c, "mig")
    assert not p.blocked and [s.action for s in p.steps] == ["enable MIG mode"]
    assert [s.kind for s in p.manual] == ["sriov"] and "sriov-manage -e 0000:18:00.0" in p.manual[0].action
    result = apply(host, store, c, "mig")
    assert backend_for(host).mig_mode(H200) == (True, True)
    assert result.drift_after == ["- 0000:18:00.0 sriov enabled (host has 0 VFs) (needs an operator step)"]
    # and back to time-sliced, the same way
    p = plan(host, store, c, "timesliced")
    assert not p.blocked and [s.action for s in p.steps] == ["disable MIG mode (its GPU instances go first)"]
    apply(host, store, c, "timesliced")
    assert backend_for(host).mig_mode(H200) == (False, False)


def test_an_empty_layout_holds_nothing_and_removes_the_layout_vgpus(make_host, tmp_path, capsys):
    # review 1, item 20
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    path = write_cfg(tmp_path, A40_DESK + "  none:\n    description: nothing\n    gpus: []\n")
    assert run(capsys, "--root", host.root, "apply", "-c", path, "desk")[0] == 0
    manual = vgpu.create(host, store, profile="A40-8Q", owner="manual")
    assert len(mdevs(host)) == 5
    code, out, _ = run(capsys, "config", "check", "-c", path)
    assert code == 0 and "none: 0 entries" in out
    code, out, err = run(capsys, "--root", host.root, "apply", "-c", path, "none")
    assert code == 0, err
    assert list(mdevs(host)) == [manual.id]                   # the manual vGPU stays
    assert [r.owner for r in store.vgpu_records()] == ["manual"]
    assert run(capsys, "--root", host.root, "assert", "-c", path, "none")[0] == 0


def test_the_a40_walkthrough_assert_after_apply_and_after_persisting(make_host, capsys):
    # review 1, item 7: the walkthrough (README, examples/config/vgpu-a40.yaml) as written
    host = make_host("a40-mdev")
    path = EXAMPLES / "vgpu-a40.yaml"
    assert run(capsys, "--root", host.root, "apply", "-c", path)[0] == 0
    code, out, _ = run(capsys, "--root", host.root, "assert", "-c", path)
    assert code == 1 and out.splitlines()[1:] == [
        "- 0000:81:00.0 scheduler-persist RmPVMRL=0x00000011 (modprobe.d has none) (needs a reboot)"]
    assert run(capsys, "--root", host.root, "scheduler", "set", "--gpu", A40, "--policy", "fixed-share",
               "--persist")[0] == 0
    assert run(capsys, "--root", host.root, "assert", "-c", path)[0] == 0
