"""observe(): one HostView per operation, read from a simulated host through the io doors.

What the view holds is compared with what the simulated host and the state
store hold; scope and NVML failures are checked; and plan/assert/apply are
shown to read the host once per snapshot, not once per GPU.
"""

from __future__ import annotations

import dataclasses

import pytest

import vgpuhost.io.backends as nvml_door
import vgpuhost.observe.hostview as hostview
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.errors import HostEnvironmentError
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.hostview import SCHEDULER_CONF, HostView, MigMode, SeenType, observe
from vgpuhost.ops import layout, vgpu
from vgpuhost.policy.config import parse
from vgpuhost.sim.nvml import SimNvml

A40 = PciAddress.parse("0000:81:00.0")
H200 = PciAddress.parse("0000:18:00.0")
DOMAIN = "5b1d3c8e-7a2f-4c6d-9e0b-1f2a3b4c5d6e"

FOUR_A40 = """
version: 1
name: four-a40
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:40:01.0", model: intel-root-port, numa_node: 0}
  - {bdf: "0000:41:00.0", model: A40, upstream: "0000:40:01.0", numa_node: 0, vgpu: {backend: mdev}}
  - {bdf: "0000:50:01.0", model: intel-root-port, numa_node: 0}
  - {bdf: "0000:51:00.0", model: A40, upstream: "0000:50:01.0", numa_node: 0, vgpu: {backend: mdev}}
  - {bdf: "0000:80:01.0", model: intel-root-port, numa_node: 1}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:01.0", numa_node: 1, vgpu: {backend: mdev}}
  - {bdf: "0000:90:01.0", model: intel-root-port, numa_node: 1}
  - {bdf: "0000:91:00.0", model: A40, upstream: "0000:90:01.0", numa_node: 1, vgpu: {backend: mdev}}
"""

DESK = """
version: 1
layouts:
  desk:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu:
          types: {A40-8Q: 2}
        scheduler: {policy: equal-share, timeslice_ms: 3}
"""


def test_the_view_holds_the_host_and_the_store_as_typed_values(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    made = vgpu.create(host, store, profile="A40-8Q", gpu=A40, owner="manual")
    store.domain_started(DOMAIN, "vm1")
    view = observe(host, store)
    assert [g.address for g in view.inventory.gpus] == [A40]
    assert [(r.id, r.owner) for r in view.records] == [(made.id, "manual")]
    assert [(e.id, e.state, e.owner, e.type_name) for e in view.vgpus] == [(made.id, "active", "manual", "A40-8Q")]
    assert dict(view.running) == {DOMAIN: "vm1"}
    assert all(isinstance(t, SeenType) for t in view.seen)
    assert SeenType("0000:81:00.0", "nvidia-566", "A40-8Q", 8192) in view.seen
    facts = view.nvml(A40)
    assert facts.mig_mode is None and facts.uuid.startswith("GPU-")
    assert facts.scheduler == SchedulerState("best-effort") and facts.scheduler_caps is not None
    assert facts.active_vgpus == SimNvml(host).active_vgpus(A40)
    assert view.scheduler_conf is None and dict(view.driverctl) == {}


def test_the_view_is_a_value(make_host):
    host = make_host("a40-mdev")
    view = observe(host, StateStore(host.state_dir))
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.records = ()
    with pytest.raises(TypeError):
        view.running["x"] = "y"
    with pytest.raises(TypeError):
        view.nvml_facts[A40] = None
    assert observe(host, StateStore(host.state_dir)) == view           # same host, same snapshot


def test_mig_mode_is_a_typed_value_and_instances_are_read_while_mig_is_on(make_host):
    host = make_host("h200-mig-on")
    store = StateStore(host.state_dir)
    facts = observe(host, store).nvml(H200)
    assert facts.mig_mode == MigMode(current=True, pending=True) and facts.mig_mode.text() == "on"
    assert [p.name for p in facts.gi_profiles][:1] and facts.gpu_instances == ()
    assert facts.scheduler is None and facts.mixed_size is None      # device-level: not read in MIG mode
    assert MigMode(False, True).text() == "off, on pending" and MigMode(True, False).waiting


def test_config_files_plans_compare_against_are_in_the_view(make_host):
    host = make_host("a40-mdev")
    fs = Sysfs(host)
    fs.write_config(host.driverctl_d / f"pci-{A40}", "vfio-pci\n")
    fs.write_config(host.modprobe_d / SCHEDULER_CONF, 'options nvidia NVreg_RegistryDwords="RmPVMRL=0x1"\n')
    view = observe(host, StateStore(host.state_dir))
    assert view.driverctl_override(A40) == "vfio-pci\n" and view.driverctl_override("0000:01:00.0") is None
    assert view.scheduler_conf == 'options nvidia NVreg_RegistryDwords="RmPVMRL=0x1"\n'
    from vgpuhost.ops.scheduler import conf_path
    assert conf_path(host) == host.modprobe_d / SCHEDULER_CONF


def test_scope_limits_nvml_and_driverctl_reads(make_host, monkeypatch):
    host = make_host(yaml_text=FOUR_A40)
    store = StateStore(host.state_dir)
    calls = []
    real = nvml_door.backend_for

    def counting(h):
        b = real(h)
        orig = b.mig_mode

        def mig_mode(bdf):
            calls.append(str(bdf))
            return orig(bdf)
        b.mig_mode = mig_mode
        return b
    monkeypatch.setattr(nvml_door, "backend_for", counting)
    view = observe(host, store, gpus=[A40])
    assert calls == [str(A40)] and set(view.nvml_facts) == {A40}
    assert len(view.inventory.gpus) == 4                 # the rest of the view is host-wide
    calls.clear()
    view = observe(host, store, gpus=lambda inv: [g.address for g in inv.gpus if g.pci.numa_node == 1])
    assert calls == ["0000:81:00.0", "0000:91:00.0"]
    calls.clear()
    observe(host, store, nvml=False)
    assert calls == []


def test_nvml_missing_is_kept_in_the_view_and_raised_only_when_needed(make_host, monkeypatch):
    host = make_host("a40-mdev")

    def missing(h):
        raise ImportError("pynvml", name="pynvml")
    monkeypatch.setattr(nvml_door, "backend_for", missing)
    view = observe(host, StateStore(host.state_dir))            # does not raise
    with pytest.raises(HostEnvironmentError, match=r"NVML is not available on this host \(pynvml cannot be "
                                                   r"loaded\)"):
        view.nvml(A40)
    passthrough = parse("version: 1\nlayouts:\n  pt:\n    gpus:\n      - select: {address: '0000:81:00.0'}\n"
                        "        mode: passthrough\n", "pt.yaml")
    assert [s.kind for s in layout.plan(host, StateStore(host.state_dir), passthrough).steps] == ["passthrough"]
    with pytest.raises(HostEnvironmentError):
        layout.plan(host, StateStore(host.state_dir), parse(DESK, "desk.yaml"))


def test_a_root_that_is_no_host_is_refused(tmp_path):
    with pytest.raises(HostEnvironmentError):
        observe(hostview.HostRoot.from_env(tmp_path), StateStore(tmp_path / "state"))


def test_plan_assert_and_apply_read_the_host_once_per_snapshot_not_per_gpu(make_host, monkeypatch):
    host = make_host(yaml_text=FOUR_A40)
    store = StateStore(host.state_dir)
    scans, opens = [], []
    real_discover, real_backend = hostview.discover, nvml_door.backend_for
    monkeypatch.setattr(hostview, "discover", lambda fs: scans.append(1) or real_discover(fs))
    monkeypatch.setattr(nvml_door, "backend_for", lambda h: opens.append(1) or real_backend(h))
    c = parse(DESK, "desk.yaml")
    p = layout.plan(host, store, c)
    assert len(p.steps) == 8 and len(scans) == 1 and len(opens) == 1      # 4 GPUs: one scan, one NVML open
    scans.clear(), opens.clear()
    assert not layout.check(host, store, c).in_sync and len(scans) == 1
    scans.clear()
    result = layout.apply(host, store, c)
    assert len(result.done) == 8 and not result.drift_after
    # apply: one snapshot to plan, one to assert after (each step's own layer reads what it changes)
    assert len(scans) == 2
    scans.clear()
    assert layout.check(host, store, c).in_sync and len(scans) == 1


def test_views_built_by_hand_derive_the_vgpu_list_and_the_seen_types(make_host):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    made = vgpu.create(host, store, profile="A40-8Q", gpu=A40)
    observed = observe(host, store)
    by_hand = HostView.of(observed.inventory, store.vgpu_records(), seen=store.seen_types())
    assert by_hand.vgpus == observed.vgpus and [e.id for e in by_hand.vgpus] == [made.id]
    assert by_hand.seen == observed.seen
