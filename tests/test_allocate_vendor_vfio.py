"""A tenant member's allocate on a vendor-VFIO GPU (trial 8 retest R0).

Admission takes the vGPU under a UUID (the allocate names no device), but on vendor VFIO a vGPU has no UUID:
its VF names it.  Before, every such allocate failed after admission ("--uuid applies to mdev vGPUs"),
though the member gave no UUID.  Now the vGPU is made on the VF placement takes, and its allocation row
names that VF, as the vGPU record does: the tenant's quota counts it once.  Read back from the simulated
tree and the state store.
"""

from __future__ import annotations

import os

import pytest

from vgpuhost.io.sysfs import Sysfs
from vgpuhost.io.state import StateStore
from vgpuhost.model.errors import RefusedError
from vgpuhost.observe.inventory import discover
from vgpuhost.ops import tenancy
from vgpuhost.ops.allocate import allocate_admitted
from vgpuhost.ops.recover import unmade_allocations

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


def _allocate_killed(host, point: str) -> int:
    """A tenant allocate of L40S-4Q for D1 in a child process SIGKILLed at ``point``: ``block-end`` (the vGPU
    made and recorded, the admission block not yet ended) or ``record`` (inside the transaction that
    writes the VF's record, before it commits).  The child's wait status."""
    import os
    import signal
    pid = os.fork()
    if pid == 0:                                                    # pragma: no cover (the child)
        try:
            from vgpuhost.ops import vgpu
            if point == "block-end":
                tenancy._AdmittingBlock.__exit__ = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
            else:
                def put(conn, rec, _put=vgpu.put_vgpu):
                    _put(conn, rec)
                    os.kill(os.getpid(), signal.SIGKILL)
                vgpu.put_vgpu = put
            s = StateStore(host.state_dir)
            allocate_admitted(host, s, lambda: discover(Sysfs(host)), owner=D1, tenant="t1", profile="L40S-4Q",
                              actor="test")
        finally:
            os._exit(3)                                             # not killed: the parent fails
    return os.waitpid(pid, 0)[1]


@pytest.mark.parametrize("point", ["block-end", "record"])
def test_a_tenant_allocate_killed_after_or_in_the_vfs_record_leaves_the_final_row_or_nothing(make_host, point,
                                                                                            capsys):
    """note 44: an allocate killed between the VF's record and the end of the admission block left the
    allocation row under the admitted UUID beside the VF's record until reconcile.  The row takes the VF's
    id in the transaction that writes the record: killed after it, the store holds the VF's record and its
    row (the quota counts it); killed inside it, neither (reconcile rolls the VF back and drops the
    admitted row), and no row is ever left under the admitted UUID beside a record."""
    import signal
    from vgpuhost.cli.main import main
    host = make_host("l40s-vendor-vfio")
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("t1", quota=tenancy.Quota(tenancy.Limits(vgpus=2), tenancy.Limits(vgpus=2))))
    tenancy.bind(s, D1, "t1", name="vm1")
    s.close()
    status = _allocate_killed(host, point)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    s = StateStore(host.state_dir)
    recs = [(r.id, r.owner) for r in s.vgpu_records()]
    rows = [(row[0], row[1], row[2]) for row in s.allocation_rows()]
    if point == "block-end":
        assert len(recs) == 1 and rows == [(recs[0][0], D1, "t1")], (recs, rows)
        vf = recs[0][0]
        assert Sysfs(host).read_optional(host.pci_device(vf) / "nvidia" / "current_vgpu_type") not in ("0", None)
        assert unmade_allocations(s) == []                          # nothing for reconcile to drop
    else:
        assert recs == [] and len(rows) == 1 and ":" not in rows[0][0], rows     # the admitted UUID's row only
        assert main(["--root", str(host.root), "reconcile"]) == 0, capsys.readouterr()
        assert s.vgpu_records() == [] and s.allocation_rows() == []
        cur = {Sysfs(host).read_optional(p / "nvidia" / "current_vgpu_type")
               for p in host.pci_devices.iterdir() if (p / "nvidia" / "current_vgpu_type").exists()}
        assert cur <= {"0"}, cur                                     # the VF made was rolled back
