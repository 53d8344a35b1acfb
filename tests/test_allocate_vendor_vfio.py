"""A tenant member's allocate on a vendor-VFIO GPU (trial 8 retest R0).

Admission takes the vGPU under a UUID (the allocate names no device), but on vendor VFIO a vGPU has no UUID:
its VF names it.  Before, every such allocate failed after admission ("--uuid applies to mdev vGPUs"),
though the member gave no UUID.  Now the vGPU is made on the VF placement takes, and its allocation row
names that VF, as the vGPU record does: the tenant's quota counts it once.  Read back from the simulated
tree and the state store.
"""

from __future__ import annotations

import pytest

from vgpuhost.io.sysfs import Sysfs
from vgpuhost.io.state import StateStore
from vgpuhost.model.errors import RefusedError
from vgpuhost.observe.inventory import discover
from vgpuhost.ops import tenancy
from vgpuhost.ops.allocate import allocate_admitted

D1 = "11111111-2222-4333-8444-0000000000a1"
D2 = "11111111-2222-4333-8444-0000000000a2"


def test_a_tenant_allocate_on_vendor_vfio_makes_the_vgpu_on_a_vf_and_counts_it_once(make_host):
    host = make_host("l40s-vendor-vfio")
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("t1", quota=tenancy.Quota(tenancy.Limits(vgpus=1), tenancy.Limits(vgpus=1))))
    tenancy.bind(s, D1, "t1", name="vm1")
    tenancy.bind(s, D2, "t1", name="vm2")

    def inventory():
        return discover(Sysfs(host))
    out = allocate_admitted(host, s, inventory, owner=D1, tenant="t1", profile="L40S-4Q", actor="test")
    vf = out.id
    assert out.backend == "vendor-vfio" and vf == out.parent, out.as_dict()
    cur = Sysfs(host).read_optional(host.pci_device(vf) / "nvidia" / "current_vgpu_type")
    assert cur not in (None, "", "0")                             # the VF holds the vGPU now
    assert [(r.id, r.owner) for r in s.vgpu_records()] == [(vf, D1)]
    assert [(row[0], row[1], row[2]) for row in s.allocation_rows()] == [(vf, D1, "t1")]
    # the quota (1) counts it once: a second allocate for the tenant is refused, nothing more made
    with pytest.raises(RefusedError) as e:
        allocate_admitted(host, s, inventory, owner=D2, tenant="t1", profile="L40S-4Q", actor="test")
    assert "quota" in e.value.message, e.value.message
    assert [r.id for r in s.vgpu_records()] == [vf]
    assert [row[0] for row in s.allocation_rows()] == [vf]


def test_a_vgpu_uuid_on_a_vendor_vfio_gpu_is_refused_before_anything_is_made(make_host):
    host = make_host("l40s-vendor-vfio")
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("t1", quota=tenancy.Quota(tenancy.Limits(vgpus=2), tenancy.Limits(vgpus=2))))
    tenancy.bind(s, D1, "t1", name="vm1")
    with pytest.raises(RefusedError) as e:
        allocate_admitted(host, s, lambda: discover(Sysfs(host)), owner=D1, tenant="t1", profile="L40S-4Q",
                          uuid="aaaaaaaa-2222-4333-8444-0000000000a1", actor="test")
    assert "vendor VFIO" in e.value.message, e.value.message
    assert s.vgpu_records() == [] and s.allocation_rows() == []
