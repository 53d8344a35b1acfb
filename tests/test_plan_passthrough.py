"""IOMMU viability and the passthrough planner, pure: tested on hand-built inventory values (no simulated tree)."""

from __future__ import annotations

import pytest

from vgpuhost.model.records import PassthroughRecord
from vgpuhost.model.errors import InputError, RefusedError
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.inventory import HostFacts, Inventory, IommuGroup, PciDevice
from vgpuhost.plan.passthrough import FunctionPlan, plan_prepare, plan_release, rollback_steps
from vgpuhost.plan.steps import ANY_HOST_DRIVER, Probe, SetDriverOverride, Unbind, VerifyDriver
from vgpuhost.policy.iommu import group_endpoints, prepare_blockers

A = PciAddress.parse
PORT, GPU, HDA, NIC = A("0000:00:01.0"), A("0000:01:00.0"), A("0000:01:00.1"), A("0000:02:00.0")


def dev(bdf, cls, driver, *, override=None, boot_vga=None, group=1):
    return PciDevice(bdf, 0x10DE, 0x2236, 0x10DE, 0x1482, cls, driver, override, 0, boot_vga, (), group, PORT)


def host(*, processes=(), loaded=("vfio_pci",)):
    return HostFacts("", None, frozenset(), None, frozenset(loaded), frozenset(), frozenset(), None,
                     frozenset(processes), {}, ())


def inventory(devices, members=(PORT, GPU, HDA), **kw):
    return Inventory({d.address: d for d in devices}, {1: IommuGroup(1, tuple(members))} if members else {},
                     (), (), (), (), host(**kw))


BRIDGE = dev(PORT, 0x060400, "pcieport")


def test_the_group_moves_gpu_first_and_bridges_stay():
    inv = inventory([BRIDGE, dev(HDA, 0x040300, "snd_hda_intel"), dev(GPU, 0x030200, "nvidia")])
    group, endpoints, bridges = group_endpoints(inv, GPU)
    assert group == 1 and [d.address for d in endpoints] == [GPU, HDA] and bridges == [PORT]


def test_a_foreign_endpoint_makes_the_group_not_viable():
    inv = inventory([BRIDGE, dev(GPU, 0x030200, "nvidia"), dev(NIC, 0x020000, "ixgbe")], members=(PORT, GPU, NIC))
    with pytest.raises(RefusedError, match=r"IOMMU group 1 of 0000:01:00.0 is not viable: it also holds "
                                           r"0000:02:00.0 \(.*ixgbe\)"):
        group_endpoints(inv, GPU)


def test_no_iommu_and_not_a_gpu_are_refused():
    with pytest.raises(RefusedError, match="the IOMMU is off"):
        group_endpoints(inventory([dev(GPU, 0x030200, "nvidia")], members=()), GPU)
    with pytest.raises(InputError, match="not a GPU"):
        group_endpoints(inventory([BRIDGE, dev(HDA, 0x040300, "snd_hda_intel")]), HDA)


def test_blockers_name_their_fix_and_nothing_blocks_a_bound_group():
    endpoints = [dev(GPU, 0x030200, "nvidia", boot_vga=True), dev(HDA, 0x040300, "snd_hda_intel")]
    inv = inventory([BRIDGE, *endpoints], processes=("nvidia-persiste",), loaded=("nvidia_drm",))
    found = prepare_blockers(inv, GPU, endpoints, allow_boot_vga=False)
    assert [b.split(" ")[0] for b in found] == ["0000:01:00.0", "nvidia-persistenced", "nvidia_drm", "the"]
    assert found[-1] == "the vfio-pci driver is not loaded: modprobe vfio-pci"
    bound = [dev(GPU, 0x030200, "vfio-pci", boot_vga=True)]
    assert prepare_blockers(inventory([BRIDGE, *bound]), GPU, bound, allow_boot_vga=False) == []


def test_prepare_plans_the_safe_sequence_and_skips_what_is_bound():
    endpoints = [dev(GPU, 0x030200, "nvidia"), dev(HDA, 0x040300, "vfio-pci", override="vfio-pci")]
    plans = plan_prepare(endpoints)
    assert plans == [FunctionPlan(GPU, "nvidia", "vfio-pci", (SetDriverOverride(GPU, "vfio-pci"),
                                                             Unbind(GPU, "nvidia"), Probe(GPU),
                                                             VerifyDriver(GPU, "vfio-pci")))]
    # an unbound function needs no unbind
    assert plan_prepare([dev(GPU, 0x030200, None)])[0].steps == (
        SetDriverOverride(GPU, "vfio-pci"), Probe(GPU), VerifyDriver(GPU, "vfio-pci"))


def test_release_gives_companions_back_first_to_their_recorded_drivers():
    endpoints = [dev(GPU, 0x030200, "vfio-pci", override="vfio-pci"),
                 dev(HDA, 0x040300, "vfio-pci", override="vfio-pci")]
    records = {str(GPU): PassthroughRecord(str(GPU), 1, str(GPU), "nvidia", None, 0, "t", False),
               str(HDA): PassthroughRecord(str(HDA), 1, str(GPU), "snd_hda_intel", None, 1, "t", False)}
    plans = plan_release(endpoints, records)
    assert [p.bdf for p in plans] == [HDA, GPU]
    assert plans[1].steps == (SetDriverOverride(GPU, None), Unbind(GPU, "vfio-pci"), Probe(GPU),
                              VerifyDriver(GPU, "nvidia"))
    # unrecorded (another tool bound it): any host driver will do
    assert plan_release(endpoints[:1], {})[0].target_driver == ANY_HOST_DRIVER


def test_rollback_returns_a_function_from_where_the_failure_left_it():
    fp = FunctionPlan(GPU, "nvidia", "vfio-pci", ())
    half = dev(GPU, 0x030200, None, override="vfio-pci")          # unbound, override set, probe failed
    assert rollback_steps(fp, half) == [SetDriverOverride(GPU, None), Probe(GPU), VerifyDriver(GPU, "nvidia")]
    assert rollback_steps(fp, dev(GPU, 0x030200, "nvidia")) == []
