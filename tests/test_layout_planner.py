"""The layout planner on hand-built HostViews: no simulated tree, no store, no NVML.

Each case builds the host it needs as values (an inventory, records, running
domains, NVML facts, config files), plans a layout over it with the pure
:func:`vgpuhost.plan.layout.plan` and asserts the typed steps, the drift
lines, what is reported and what blocks.
"""

from __future__ import annotations

import builtins
import os

import pytest

from vgpuhost.model.nvml import GiProfile, GpuInstance, SchedulerCaps, SchedulerState
from vgpuhost.model.records import PassthroughRecord, VgpuRecord
from vgpuhost.model.errors import HostEnvironmentError, InputError
from vgpuhost.model.values import PciAddress, VgpuProfile
from vgpuhost.observe.hostview import HostView, MigMode, NvmlFacts, SeenType
from vgpuhost.observe.inventory import (BACKEND_MDEV, Gpu, HostFacts, Inventory, IommuGroup, MdevDevice, PciDevice,
                                        VgpuType)
from vgpuhost.plan.layout import (OPERATOR_MARK, REBOOT_MARK, RESET_MARK, LayoutChangeMigMode, LayoutCreateVgpus,
                                  LayoutMakeGpuInstances, LayoutPreparePassthrough, LayoutRecreateVgpu,
                                  LayoutReleasePassthrough, LayoutRemoveVgpu, LayoutSetMixedSize, LayoutSetScheduler,
                                  LayoutStep, Report, drift, plan, scope)
from vgpuhost.policy.config import board_tables, parse

A40 = PciAddress.parse("0000:81:00.0")
A40B = PciAddress.parse("0000:82:00.0")
A100 = PciAddress.parse("0000:41:00.0")
AUDIO = PciAddress.parse("0000:81:00.1")
DOMAIN = "5b1d3c8e-7a2f-4c6d-9e0b-1f2a3b4c5d6e"
UUIDS = [f"00000000-0000-4000-8000-00000000000{i}" for i in range(1, 10)]

# A40 time-sliced Q types: (type id, name, framebuffer MiB, max instances)
A40_TYPES = [("nvidia-564", "A40-4Q", 4096, 12), ("nvidia-565", "A40-6Q", 6144, 8),
             ("nvidia-566", "A40-8Q", 8192, 6), ("nvidia-567", "A40-12Q", 12288, 4),
             ("nvidia-568", "A40-16Q", 16384, 3)]
A100_PROFILES = (
    GiProfile(19, "1g.5gb", 1, 5120, 7, tuple((s, 1) for s in range(7))),
    GiProfile(14, "2g.10gb", 2, 10240, 3, ((0, 2), (2, 2), (4, 2))),
    GiProfile(9, "3g.20gb", 3, 20480, 2, ((0, 4), (4, 4))),
    GiProfile(5, "4g.20gb", 4, 20480, 1, ((0, 4),)),
    GiProfile(0, "7g.40gb", 7, 40960, 1, ((0, 8),)),
)
CAPS = SchedulerCaps(("best-effort", "equal-share", "fixed-share"), arr_supported=True)
BEST_EFFORT = SchedulerState("best-effort")
MODULES = frozenset({"nvidia", "vfio", "vfio_pci", "vfio_iommu_type1", "vfio_pci_core", "nvidia_vgpu_vfio"})


# ---------------------------------------------------------------------------
# building hosts as values

def pci(addr: PciAddress, *, device: int = 0x2235, driver: str = "nvidia", group: int = 31,
        pci_class: int = 0x030200, totalvfs=None, numvfs=None) -> PciDevice:
    return PciDevice(addr, 0x10de, device, 0x10de, 0x1452, pci_class, driver, None, 0, False, ("flr",), group,
                     None, sriov_totalvfs=totalvfs, sriov_numvfs=numvfs)


class Host:
    """A host under construction: GPUs, their vGPU types and vGPUs, records, NVML facts."""

    def __init__(self, cmdline: str = "ro quiet intel_iommu=on iommu=pt"):
        self.devices = {}
        self.groups = {}
        self.gpus = []
        self.types = []
        self.mdevs = []
        self.records = []
        self.nvml = {}
        self.running = {}
        self.passthrough = []
        self.driverctl = {}
        self.seen = []
        self.scheduler_conf = None
        self.cmdline = cmdline

    def a40(self, addr: PciAddress = A40, *, driver: str = "nvidia", group: int = 31, audio: bool = False,
            mixed_size=None, scheduler=BEST_EFFORT, active_vgpus: int = 0) -> "Host":
        dev = pci(addr, driver=driver, group=group)
        members = [addr]
        self.devices[addr] = dev
        if audio:
            a = PciAddress(addr.domain, addr.bus, addr.slot, 1)
            self.devices[a] = pci(a, driver="snd_hda_intel", group=group, pci_class=0x040300)
            members.append(a)
        self.groups[group] = IommuGroup(group, tuple(members))
        self.gpus.append(Gpu(addr, dev, "A40", "mdev", ("passthrough", "mdev"), (), (addr,), ()))
        if driver == "nvidia":
            for tid, name, fb, mx in A40_TYPES:
                self.types.append(VgpuType(addr, addr, BACKEND_MDEV, tid, f"NVIDIA {name}", name,
                                           VgpuProfile.parse(name), fb, mx, mx, "vfio-pci"))
            self.nvml[addr] = NvmlFacts(name="NVIDIA A40", uuid=f"GPU-{addr.bus:02x}000000-0000-0000-0000-000000000000",
                                        mixed_size=mixed_size, scheduler=scheduler, scheduler_caps=CAPS,
                                        active_vgpus=active_vgpus)
        return self

    def a100(self, addr: PciAddress = A100, *, mig: MigMode = MigMode(False, False), instances=(),
             processes: int = 0, group: int = 40) -> "Host":
        dev = pci(addr, device=0x20f1, group=group)
        self.devices[addr] = dev
        self.groups[group] = IommuGroup(group, (addr,))
        self.gpus.append(Gpu(addr, dev, "A100", None, ("passthrough",), (), (), ()))
        self.nvml[addr] = NvmlFacts(name="NVIDIA A100-PCIE-40GB", uuid="GPU-a100", mig_mode=mig,
                                    gi_profiles=A100_PROFILES, gpu_instances=tuple(instances),
                                    compute_processes=processes)
        return self

    def vgpu(self, gpu: PciAddress, name: str, *, owner="layout", uid=None, present=True, recorded=True,
             time="2026-01-01T00:00:00Z") -> str:
        """A vGPU of type ``name`` on ``gpu``: in sysfs (``present``) and/or in the records."""
        tid = next(t for t, n, _, _ in A40_TYPES if n == name)
        uid = uid or UUIDS[len(self.mdevs) + len(self.records)]
        if present:
            self.mdevs.append(MdevDevice(uid, gpu, tid, 100 + len(self.mdevs), "nvidia-vgpu-vfio"))
            self.types = [t if not (t.gpu == gpu and t.type_id == tid) else
                          VgpuType(t.gpu, t.parent, t.backend, t.type_id, t.raw_name, t.name, t.profile,
                                   t.framebuffer_mib, t.max_instances, t.available_instances - 1, t.device_api)
                          for t in self.types]
        if recorded and owner is not None:
            self.records.append(VgpuRecord(uid, BACKEND_MDEV, str(gpu), str(gpu), tid, name, owner, None, None,
                                           False, time))
        return uid

    def view(self) -> HostView:
        facts = HostFacts(self.cmdline, "GenuineIntel", frozenset({"vmx"}), "6.1.0", MODULES, frozenset(), MODULES,
                          True, frozenset(), {}, ("dmar0",))
        inv = Inventory(dict(self.devices), dict(self.groups), tuple(self.gpus), tuple(self.types),
                        tuple(self.mdevs), (), facts)
        return HostView.of(inv, self.records, running=self.running, passthrough=self.passthrough,
                           seen=self.seen, nvml=self.nvml, driverctl=self.driverctl,
                           scheduler_conf=self.scheduler_conf)


def cfg(body: str, name: str = "layout.yaml"):
    return parse("version: 1\nlayouts:\n  main:\n    gpus:\n" + body, name)


def vgpu_entry(types: str, select: str = "{board: A40}", extra: str = "") -> str:
    return (f"      - select: {select}\n        mode: vgpu\n        vgpu:\n          types: {types}\n" + extra)


def steps(p):
    return [(type(s).__name__, s.target, s.action) for s in p.steps]


# ---------------------------------------------------------------------------
# vGPU counts

def test_an_empty_a40_gets_its_vgpus_and_the_scheduler_as_typed_steps():
    c = cfg(vgpu_entry("{A40-8Q: 4}", extra="        scheduler: {policy: equal-share, timeslice_ms: 3}\n"))
    p = plan(c, None, Host().a40().view())
    assert [type(s) for s in p.steps] == [LayoutSetScheduler, LayoutCreateVgpus]
    sched, create = p.steps
    assert sched.state == SchedulerState("equal-share", arr=False, timeslice_ms=3) and sched.gpu == A40
    assert (create.profile, create.count, create.uuids, create.kind) == ("A40-8Q", 4, (), "vgpu")
    assert create.why == "layout wants 4, host has 0 (layout.yaml:5)"
    assert p.diff == ["- 0000:81:00.0 scheduler equal share, ARR off, time slice 3 ms (host has best effort)",
                      "- 0000:81:00.0 vgpu A40-8Q x4 (host has 0)"]
    assert not p.blocked and not p.reboot and not p.manual
    assert all(isinstance(s, LayoutStep) for s in p.steps)


def test_a_host_that_matches_plans_nothing_and_has_no_drift():
    h = Host().a40()
    for _ in range(2):
        h.vgpu(A40, "A40-8Q")
    c = cfg(vgpu_entry("{A40-8Q: 2}"))
    p = plan(c, None, h.view())
    assert p.steps == [] and p.diff == [] and not p.changed
    assert p.text() == "layout 'main' (layout.yaml): the host matches; nothing to do"
    assert drift(c, None, h.view()).in_sync


def test_fewer_wanted_removes_the_newest_layout_vgpus_first():
    h = Host().a40()
    old = h.vgpu(A40, "A40-8Q", time="2026-01-01T00:00:00Z")
    new = h.vgpu(A40, "A40-8Q", time="2026-03-01T00:00:00Z")
    mid = h.vgpu(A40, "A40-8Q", time="2026-02-01T00:00:00Z")
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}")), None, h.view())
    assert [type(s) for s in p.steps] == [LayoutRemoveVgpu, LayoutRemoveVgpu]
    assert [s.vgpu_id for s in p.steps] == [new, mid] and old not in {s.vgpu_id for s in p.steps}
    assert p.diff == ["- 0000:81:00.0 vgpu A40-8Q x1 (host has 3)"]


def test_a_type_change_removes_the_old_type_and_creates_the_new():
    h = Host().a40()
    gone = h.vgpu(A40, "A40-8Q")
    p = plan(cfg(vgpu_entry("{A40-4Q: 2}")), None, h.view())
    assert steps(p) == [("LayoutRemoveVgpu", "0000:81:00.0", f"remove A40-8Q {gone}"),
                        ("LayoutCreateVgpus", "0000:81:00.0", "create 2 x A40-4Q")]


def test_a_recorded_vgpu_missing_from_the_host_is_re_created_with_its_id():
    h = Host().a40()
    h.vgpu(A40, "A40-8Q")
    lost = h.vgpu(A40, "A40-8Q", present=False)
    c = cfg(vgpu_entry("{A40-8Q: 2}"))
    p = plan(c, None, h.view())
    assert [type(s) for s in p.steps] == [LayoutRecreateVgpu] and p.steps[0].vgpu_id == lost
    assert f"- 0000:81:00.0 vgpu A40-8Q {lost} (recorded for the layout, missing on the host)" in p.diff
    # not wanted any more: its record is dropped instead
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}")), None, h.view())
    assert [(type(s), s.action) for s in p.steps] == [(LayoutRemoveVgpu, f"drop the record of missing A40-8Q {lost}")]


def test_too_many_vgpus_for_the_free_capacity_block_the_plan():
    h = Host().a40()
    for _ in range(5):
        h.vgpu(A40, "A40-8Q", owner="manual")
    p = plan(cfg(vgpu_entry("{A40-8Q: 2}")), None, h.view())
    assert p.blocked == ["0000:81:00.0: 2 more A40-8Q wanted, 1 fit now (other vGPUs there: owner manual)"]


def test_a_type_the_gpu_does_not_offer_is_a_config_error_naming_near_ones():
    with pytest.raises(InputError) as e:
        plan(cfg(vgpu_entry("{A40-9Q: 1}", select="{address: '0000:81:00.0'}")), None, Host().a40().view())
    assert e.value.message == "layout.yaml:8: vGPU type A40-9Q does not exist on 0000:81:00.0 (A40)"
    assert "A40-8Q" in e.value.hint


def test_type_names_are_spelled_as_the_gpu_spells_them():
    p = plan(cfg(vgpu_entry("{a40-8q: 1}")), None, Host().a40().view())
    assert steps(p) == [("LayoutCreateVgpus", "0000:81:00.0", "create 1 x A40-8Q")]


def test_a_type_seen_before_but_not_listed_now_still_resolves():
    h = Host().a40()
    h.types = [t for t in h.types if t.name != "A40-16Q"]          # full: the driver hides it
    h.seen = [("0000:81:00.0", "nvidia-568", "A40-16Q", 16384)]
    p = plan(cfg(vgpu_entry("{a40-16q: 0, A40-8Q: 1}")), None, h.view())
    assert steps(p) == [("LayoutCreateVgpus", "0000:81:00.0", "create 1 x A40-8Q")]
    assert all(isinstance(s, SeenType) for s in h.view().seen)


# ---------------------------------------------------------------------------
# ownership: other owners, running domains, orphans, equal size

def test_vgpus_of_other_owners_are_never_removed_and_block_a_change_that_needs_the_gpu_empty():
    h = Host().a40(mixed_size=False, active_vgpus=2)
    manual = h.vgpu(A40, "A40-8Q", owner="manual")
    foreign = h.vgpu(A40, "A40-8Q", owner=None)
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}", extra="          mixed_size: true\n")), None, h.view())
    assert not any(isinstance(s, LayoutRemoveVgpu) for s in p.steps)
    assert p.blocked == [
        f"vGPU {manual} (A40-8Q) on 0000:81:00.0 (owner manual) would have to be removed (mixed-size mode can "
        "change only while the GPU has no vGPUs): a layout removes only the vGPUs it created; remove it first "
        f"(vgpuhost vgpu remove {manual})",
        f"vGPU {foreign} (A40-8Q) on 0000:81:00.0 (not created by vgpuhost) would have to be removed (mixed-size "
        "mode can change only while the GPU has no vGPUs): a layout removes only the vGPUs it created"]
    # with no vGPU running, mixed-size mode can change with them present
    h.nvml[A40] = NvmlFacts(mixed_size=False, scheduler=BEST_EFFORT, scheduler_caps=CAPS, active_vgpus=0)
    assert plan(cfg(vgpu_entry("{A40-8Q: 1}", extra="          mixed_size: true\n")), None, h.view()).blocked == []


def test_a_running_domains_vgpu_blocks_a_scheduler_change_while_vgpus_run():
    h = Host().a40(active_vgpus=1)
    held = h.vgpu(A40, "A40-8Q", owner=DOMAIN)
    h.running = {DOMAIN: "vm1"}
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}", extra="        scheduler: {policy: equal-share}\n")), None, h.view())
    assert any(b.startswith(f"vGPU {held} (A40-8Q) on 0000:81:00.0 is held by running domain vm1 ({DOMAIN})")
               for b in p.blocked)
    assert "BLOCKED" in p.text()


def test_layout_vgpus_on_a_gpu_no_entry_selects_are_orphans_and_go():
    h = Host().a40().a40(A40B, group=32)
    orphan = h.vgpu(A40B, "A40-8Q")
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}", select="{address: '0000:81:00.0'}")), None, h.view())
    assert (LayoutRemoveVgpu, "0000:82:00.0", orphan) in [(type(s), s.target, getattr(s, "vgpu_id", None))
                                                   for s in p.steps]
    assert f"- 0000:82:00.0 vgpu A40-8Q {orphan} (owner layout, not in layout 'main')" in p.diff


def test_another_size_held_by_someone_else_is_an_equal_size_conflict():
    h = Host().a40()
    other = h.vgpu(A40, "A40-4Q", owner="manual")
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}")), None, h.view())
    assert any(b.startswith(f"vGPU {other} (A40-4Q, owner manual) holds 0000:81:00.0 at 4096 MiB vGPUs: in "
                            "equal-size mode the layout's A40-8Q cannot join it") for b in p.blocked)


def test_equal_size_does_not_apply_in_mixed_size_mode():
    h = Host().a40(mixed_size=True)
    h.vgpu(A40, "A40-4Q", owner="manual")
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}", extra="          mixed_size: true\n")), None, h.view())
    assert not any("equal-size" in b for b in p.blocked)


# ---------------------------------------------------------------------------
# mixed size and scheduler

def test_leaving_fixed_share_for_mixed_size_orders_the_scheduler_first():
    h = Host().a40(mixed_size=False, scheduler=SchedulerState("fixed-share", timeslice_ms=2))
    c = cfg(vgpu_entry("{A40-8Q: 1}", extra="          mixed_size: true\n"
                                           "        scheduler: {policy: equal-share}\n"))
    p = plan(c, None, h.view())
    assert [type(s) for s in p.steps] == [LayoutSetScheduler, LayoutSetMixedSize, LayoutCreateVgpus]
    assert p.steps[1].on is True and p.steps[0].why.endswith("before mixed-size mode, which fixed share does "
                                                              "not allow")


def test_mixed_size_on_a_fixed_share_gpu_without_a_scheduler_key_is_blocked():
    h = Host().a40(mixed_size=False, scheduler=SchedulerState("fixed-share", timeslice_ms=2))
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}", extra="          mixed_size: true\n")), None, h.view())
    assert any("uses the fixed-share scheduler, which mixed-size mode does not allow" in b for b in p.blocked)


def test_mixed_size_on_a_gpu_without_the_mode_is_a_config_error():
    with pytest.raises(InputError, match="has no mixed-size vGPU mode"):
        plan(cfg(vgpu_entry("{A40-8Q: 1}", extra="          mixed_size: true\n")), None, Host().a40().view())


def test_a_scheduler_the_device_cannot_take_is_a_config_error_at_plan():
    h = Host().a40()
    h.nvml[A40] = NvmlFacts(scheduler=BEST_EFFORT, scheduler_caps=SchedulerCaps(("best-effort",), False))
    with pytest.raises(InputError, match="scheduler:"):
        plan(cfg(vgpu_entry("{A40-8Q: 1}", extra="        scheduler: {policy: fixed-share}\n")), None, h.view())


def test_a_gpu_without_a_device_level_scheduler_refuses_a_scheduler_key():
    h = Host().a40()
    h.nvml[A40] = NvmlFacts()
    with pytest.raises(InputError, match="has no device-level vGPU scheduler"):
        plan(cfg(vgpu_entry("{A40-8Q: 1}", extra="        scheduler: {policy: equal-share}\n")), None, h.view())


def test_a_persistent_scheduler_is_compared_with_the_modprobe_file_and_reported():
    h = Host().a40()
    c = cfg(vgpu_entry("{A40-8Q: 0}", extra="        scheduler: {policy: best-effort, persist: true}\n"))
    p = plan(c, None, h.view())
    assert p.steps == [] and [(type(s), s.kind, s.reboot) for s in p.reboot] == [(Report, "scheduler", True)]
    assert p.diff == ["- 0000:81:00.0 scheduler-persist RmPVMRL=0x00000000 (modprobe.d has none) "
                      + REBOOT_MARK]
    h.scheduler_conf = 'options nvidia NVreg_RegistryDwords="RmPVMRL=0x00000000"\n'
    p = plan(c, None, h.view())
    assert p.reboot == [] and p.diff == []


# ---------------------------------------------------------------------------
# passthrough

PT = "      - select: {address: '0000:81:00.0'}\n        mode: passthrough\n"


def test_passthrough_binds_the_whole_group():
    p = plan(cfg(PT), None, Host().a40(audio=True).view())
    assert [type(s) for s in p.steps] == [LayoutPreparePassthrough]
    s = p.steps[0]
    assert s.action == "bind IOMMU group 31 (2 functions) to vfio-pci" and not s.persist
    assert p.diff == ["- 0000:81:00.0 passthrough vfio-pci (host has 0000:81:00.0 on nvidia, 0000:81:00.1 on "
                      "snd_hda_intel)"]


def test_passthrough_done_and_persisted_is_in_sync_and_persist_compares_driverctl_files():
    h = Host().a40(driver="vfio-pci")
    c = cfg(PT + "        passthrough: {persist: true}\n")
    p = plan(c, None, h.view())
    assert p.diff == ["- 0000:81:00.0 passthrough driverctl overrides (host has none for some functions)"]
    assert [(type(s), s.persist) for s in p.steps] == [(LayoutPreparePassthrough, True)]
    h.driverctl = {"0000:81:00.0": "vfio-pci\n"}
    assert plan(c, None, h.view()).diff == []
    h.driverctl = {"0000:81:00.0": "nouveau\n"}
    assert plan(c, None, h.view()).diff != []


def test_passthrough_empties_the_gpu_of_layout_vgpus_and_blocks_on_others():
    h = Host().a40()
    mine = h.vgpu(A40, "A40-8Q")
    p = plan(cfg(PT), None, h.view())
    assert [type(s) for s in p.steps] == [LayoutRemoveVgpu, LayoutPreparePassthrough]
    assert p.steps[0].vgpu_id == mine and "not re-created: the GPU is passed through" in p.steps[0].why
    h.vgpu(A40, "A40-8Q", owner="manual")
    assert any("a layout removes only the vGPUs it created" in b for b in plan(cfg(PT), None, h.view()).blocked)


def test_a_gpu_passed_through_to_a_running_domain_is_not_taken_back():
    h = Host().a40(driver="vfio-pci")
    h.passthrough = [PassthroughRecord("0000:81:00.0", 31, "0000:81:00.0", "nvidia", None, 0, "t", True, DOMAIN)]
    h.running = {DOMAIN: "vm1"}
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}")), None, h.view())
    assert [type(s) for s in p.steps] == [LayoutReleasePassthrough, LayoutCreateVgpus]
    assert p.blocked == [f"0000:81:00.0 is passed through to running domain vm1 ({DOMAIN}): vgpu mode would take "
                         "it back"]


def test_a_passthrough_only_layout_needs_no_nvml_even_when_nvml_is_missing():
    h = Host().a40()
    h.nvml = {A40: NvmlFacts(error=HostEnvironmentError("NVML is not available on this host"))}
    p = plan(cfg(PT), None, h.view())
    assert [type(s) for s in p.steps] == [LayoutPreparePassthrough]
    with pytest.raises(HostEnvironmentError, match="NVML is not available"):
        plan(cfg(vgpu_entry("{A40-8Q: 1}")), None, h.view())
    gpus, nvml = scope(cfg(PT), None)
    assert nvml is False and gpus(h.view().inventory) == [A40]


# ---------------------------------------------------------------------------
# MIG

MIG = ("      - select: {board: A100}\n        mode: mig\n        mig:\n          instances: {'3g.20gb': 2}\n")


def test_mig_off_plans_mode_then_instances():
    p = plan(cfg(MIG), None, Host().a100().view())
    assert [type(s) for s in p.steps] == [LayoutChangeMigMode, LayoutMakeGpuInstances]
    mode, gis = p.steps
    assert mode.enabled is True and gis.counts == {"3g.20gb": 2}
    assert "- 0000:41:00.0 mig-mode on (host has off)" in p.diff


def test_mig_on_with_the_wanted_instances_matches():
    inst = (GpuInstance(1, 9, 0, 4), GpuInstance(2, 9, 4, 4))
    p = plan(cfg(MIG), None, Host().a100(mig=MigMode(True, True), instances=inst).view())
    assert p.steps == [] and p.diff == []


def test_mig_on_with_other_instances_destroys_and_creates():
    inst = (GpuInstance(1, 0, 0, 8),)
    p = plan(cfg(MIG), None, Host().a100(mig=MigMode(True, True), instances=inst).view())
    assert [(type(s), s.action) for s in p.steps] == [
        (LayoutMakeGpuInstances, "make GPU instances 2x3g.20gb: destroy 7g.40gb (GI 1); create 3g.20gb, 3g.20gb")]
    assert p.diff == ["- 0000:41:00.0 gpu-instances 2x3g.20gb (host has 1x7g.40gb)"]


def test_mig_on_pending_is_a_reset_step_reported_not_done():
    p = plan(cfg(MIG), None, Host().a100(mig=MigMode(False, True)).view())
    assert p.steps == [] and [(type(s), s.kind, s.reboot) for s in p.reboot] == [(Report, "mig-mode", True)]
    d = drift(cfg(MIG), None, Host().a100(mig=MigMode(False, True)).view())
    assert d.diff == ["- 0000:41:00.0 mig-mode on (host has off, on pending) " + RESET_MARK] and d.runtime == []


def test_processes_on_the_gpu_block_a_mig_mode_change():
    p = plan(cfg(MIG), None, Host().a100(processes=2).view())
    assert p.blocked == ["0000:41:00.0: 2 process(es) use the GPU: MIG mode cannot change (stop them)"]


def test_a_mig_layout_that_does_not_fit_is_a_config_error():
    c = cfg("      - select: {board: A100}\n        mode: mig\n        mig:\n          instances: {'4g.20gb': 2}\n")
    with pytest.raises(InputError):
        plan(c, None, Host().a100().view())


def test_a_gpu_nvml_reports_no_mig_mode_for_is_not_mig_capable():
    h = Host().a100()
    h.nvml[A100] = NvmlFacts(name="x")
    with pytest.raises(InputError, match="is not MIG-capable"):
        plan(cfg(MIG), None, h.view())


def test_time_sliced_mode_on_a_mig_gpu_turns_mig_off_first():
    h = Host().a40()
    h.nvml[A40] = NvmlFacts(mig_mode=MigMode(True, True), gi_profiles=A100_PROFILES)
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}")), None, h.view())
    assert [(type(s), getattr(s, "enabled", None)) for s in p.steps][0] == (LayoutChangeMigMode, False)
    assert "- 0000:81:00.0 mig-mode off (host has on)" in p.diff


# ---------------------------------------------------------------------------
# host settings, selection, total counts

def test_missing_kernel_parameters_are_reboot_steps_never_done():
    h = Host(cmdline="ro quiet")
    h.a40()
    c = parse("version: 1\nhost:\n  kernel_params: [intel_iommu=on]\nlayouts:\n  main:\n    gpus: []\n",
              "layout.yaml")
    p = plan(c, None, h.view())
    assert p.steps == [] and [(s.kind, s.target, s.reboot) for s in p.reboot] == [("kernel-param", "host", True)]
    assert p.diff == ["- host kernel-param intel_iommu=on (cmdline lacks it) " + REBOOT_MARK]


def test_two_entries_selecting_one_gpu_are_refused():
    c = cfg(vgpu_entry("{A40-8Q: 1}") + vgpu_entry("{A40-4Q: 1}", select="{address: '0000:81:00.0'}"))
    with pytest.raises(InputError, match="one GPU may be claimed by one entry only"):
        plan(c, None, Host().a40().view())


def test_a_uuid_selector_reads_the_uuid_from_the_view():
    h = Host().a40().a40(A40B, group=32)
    uuid = h.nvml[A40B].uuid
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}", select="{uuid: " + uuid + "}")), None, h.view())
    assert steps(p) == [("LayoutCreateVgpus", "0000:82:00.0", "create 1 x A40-8Q")]
    gpus, nvml = scope(cfg(vgpu_entry("{A40-8Q: 1}", select="{uuid: " + uuid + "}")), None)
    assert nvml and gpus(h.view().inventory) == [A40, A40B]


def test_an_entry_that_selects_nothing_is_a_note():
    p = plan(cfg(vgpu_entry("{A40-8Q: 1}", select="{address: '0000:99:00.0'}")), None, Host().a40().view())
    assert p.steps == [] and p.notes == ["entry 1 at layout.yaml:5 (vgpu, address 0000:99:00.0) selects no GPU on "
                                         "this host"]


def test_total_counts_are_spread_by_the_strategy():
    h = Host().a40().a40(A40B, group=32)
    c = cfg("      - select: {board: A40}\n        mode: vgpu\n        vgpu:\n          counts: total\n"
            "          strategy: spread\n          types: {A40-8Q: 4}\n")
    p = plan(c, None, h.view())
    assert sorted((s.target, s.count) for s in p.steps) == [("0000:81:00.0", 2), ("0000:82:00.0", 2)]
    assert all(isinstance(s, LayoutCreateVgpus) for s in p.steps)


def test_the_scope_of_a_layout_is_the_gpus_its_entries_may_select():
    h = Host().a40().a40(A40B, group=32).a100()
    gpus, nvml = scope(cfg(MIG), None)
    assert nvml and gpus(h.view().inventory) == [A100]


# ---------------------------------------------------------------------------
# purity

def test_planning_reads_nothing(monkeypatch):
    """The planner does no I/O: with open/listdir/readlink/stat failing it plans the same."""
    h = Host().a40(audio=True).a100()
    h.vgpu(A40, "A40-8Q", present=False)
    c = cfg(vgpu_entry("{A40-8Q: 2}", extra="        scheduler: {policy: equal-share, persist: true}\n") + MIG)
    board_tables()                                    # the board catalog is package data, loaded once
    before = plan(c, None, h.view())

    def refuse(*a, **k):
        raise AssertionError(f"I/O during planning: {a!r}")
    for mod, name in ((builtins, "open"), (os, "listdir"), (os, "readlink"), (os, "stat"), (os, "scandir")):
        monkeypatch.setattr(mod, name, refuse)
    after = plan(c, None, h.view())
    monkeypatch.undo()
    assert after.as_dict() == before.as_dict() and after.steps == before.steps and after.steps


# ---------------------------------------------------------------------------
# executing: typed steps through the one Executor, bound by type

def test_layout_steps_run_through_the_executor_by_the_binding_of_their_type(tmp_path):
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.model.errors import VgpuhostError
    from vgpuhost.plan.executor import Executor
    p = plan(cfg(vgpu_entry("{A40-8Q: 2}", extra="        scheduler: {policy: equal-share}\n")), None,
             Host().a40().view())
    ran = []
    ex = Executor(HostRoot.from_env(tmp_path), None, actor="test", operation="apply main",
                  bindings={LayoutCreateVgpus: lambda s: ran.append(("create", s.profile, s.count)) or "made",
                            LayoutSetScheduler: lambda s: ran.append(("scheduler", s.state.policy))})
    assert ex.run(p.steps) == [None, "made"]
    assert ran == [("scheduler", "equal-share"), ("create", "A40-8Q", 2)] and ex.writes == 0
    unbound = Executor(HostRoot.from_env(tmp_path), None, actor="test", operation="apply main")
    with pytest.raises(VgpuhostError, match="step LayoutSetScheduler has no binding"):
        unbound.run(p.steps)
    assert unbound.failed is p.steps[0]
