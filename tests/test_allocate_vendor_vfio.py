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

from test_vgpu import TWO_A40  # two classic-mdev A40s, 0000:41:00.0 and 0000:81:00.0

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


# ---------------------------------------------------------------------------
# MIG on demand: a tenant's allocate makes the GPU instance a start would (trial 8 retest: it was 409 while
# `capacity` counted the instances that could be made)

def _h200_on_demand(make_host, vgpus=2):
    from vgpuhost.model.values import PciAddress
    from vgpuhost.ops import migdemand
    host = make_host("h200-mig-on")
    s = StateStore(host.state_dir)
    migdemand.set_opt_in(host, s, PciAddress.parse("0000:18:00.0"), True, actor="test")
    tenancy.add(s, tenancy.Tenant("t1", quota=tenancy.Quota(tenancy.Limits(vgpus=vgpus),
                                                            tenancy.Limits(vgpus=vgpus))))
    tenancy.bind(s, D1, "t1", name="vm1")
    tenancy.bind(s, D2, "t1", name="vm2")
    return host, s


def _instances(host):
    from vgpuhost.model.values import PciAddress
    from vgpuhost.sim.nvml import SimNvml
    nv = SimNvml(host)
    gpu = PciAddress.parse("0000:18:00.0")
    names = {p.profile_id: p.name for p in nv.gi_profiles(gpu)}
    return sorted(names[g.profile_id] for g in nv.gpu_instances(gpu))


def test_a_tenant_allocate_on_a_mig_on_demand_gpu_makes_the_instance_and_the_release_destroys_it(make_host):
    from vgpuhost.ops import migdemand
    from vgpuhost.ops.devices import release_domain
    host, s = _h200_on_demand(make_host)
    assert _instances(host) == []                          # MIG mode on, no GPU instance: nothing offers 1-18C

    def inventory():
        return discover(Sysfs(host))
    # a dry run counts the instance that could be made (as capacity does) and makes nothing
    dry = allocate_admitted(host, s, inventory, owner=D1, tenant="t1", profile="H200X-1-18C", dry_run=True,
                            actor="test")
    assert dry.as_dict()["dry_run"] is True and _instances(host) == [] and s.allocation_rows() == []
    out = allocate_admitted(host, s, inventory, owner=D1, tenant="t1", profile="H200X-1-18C", actor="test")
    vf = out.id
    assert _instances(host) == ["1g.18gb"]
    cur = Sysfs(host).read_optional(host.pci_device(vf) / "nvidia" / "current_vgpu_type")
    assert cur not in (None, "", "0")                      # the VF holds the vGPU, on the instance made for it
    assert [(m.owner, m.gpu) for m in migdemand.made(s)] == [(D1, "0000:18:00.0")]
    assert [(row[0], row[1], row[2]) for row in s.allocation_rows()] == [(vf, D1, "t1")]
    # the domain's release (the tenant's POST release, the hook's release end) destroys it with the vGPU
    assert release_domain(host, s, D1, actor="test") == [vf]
    assert _instances(host) == [] and migdemand.made(s) == [] and s.allocation_rows() == []


def test_an_allocate_refused_after_the_instance_was_made_destroys_it(make_host):
    from vgpuhost.ops import migdemand
    host, s = _h200_on_demand(make_host, vgpus=1)

    def inventory():
        return discover(Sysfs(host))
    allocate_admitted(host, s, inventory, owner=D1, tenant="t1", profile="H200X-1-18C", actor="test")
    assert _instances(host) == ["1g.18gb"]
    # over the quota: admission refuses after the second instance was made; it is destroyed again
    with pytest.raises(RefusedError) as e:
        allocate_admitted(host, s, inventory, owner=D2, tenant="t1", profile="H200X-1-18C", actor="test")
    assert "quota" in e.value.message, e.value.message
    assert _instances(host) == ["1g.18gb"] and [m.owner for m in migdemand.made(s)] == [D1]
    assert [row[1] for row in s.allocation_rows()] == [D1]
    paths = [r.path for r in s.audit_rows()]
    assert paths.count("nvml:nvmlDeviceCreateGpuInstanceWithPlacement") == 2
    assert paths.count("nvml:nvmlGpuInstanceDestroy") == 1
    assert not s.journal_entries(open_only=True)


def test_the_agents_tenant_allocate_makes_the_instance_and_its_snapshot_stays_the_host(make_host):
    """Through the agent (its warm snapshot): the member's allocate is answered 200 on the VF the made
    instance serves, the agent's capacity then matches a one-shot read, and the member's release destroys it."""
    from vgpuhost.agent import api
    from vgpuhost.ops import migdemand
    host, s = _h200_on_demand(make_host)
    agent = api.Agent(host)
    agent.inventory()

    def req(body=None):
        return api.Request({"uuid": D1}, {}, body, "test-member", 1, role=api.TENANT, tenant="t1")
    out = api.tenant_allocate(agent, req({"profile": "H200X-1-18C"}))
    assert out["backend"] == "vendor-vfio" and _instances(host) == ["1g.18gb"], out
    assert [(row[0], row[1]) for row in s.allocation_rows()] == [(out["id"], D1)]
    agent.warm_up()
    assert agent.inventory() == discover(Sysfs(host))           # the snapshot is the host after the allocate
    api.tenant_release(agent, req())
    assert _instances(host) == [] and migdemand.made(s) == [] and s.allocation_rows() == []
    agent.warm_up()
    assert agent.inventory() == discover(Sysfs(host))


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


# ---------------------------------------------------------------------------
# trial 10 B8: a GPU out of service (cordoned, unhealthy) is no candidate of the tenant's allocate

@pytest.mark.parametrize("out", ["cordoned", "unhealthy"])
@pytest.mark.parametrize("strategy", ["first-fit", "spread", "worst-fit"])
@pytest.mark.parametrize("backend", ["vendor-vfio", "mdev"])
def test_a_tenant_allocate_skips_a_gpu_out_of_service_that_its_strategy_ranks_first(make_host, backend, strategy,
                                                                                     out):
    """Two empty GPUs: every strategy ranks the first one first.  With it cordoned (or unhealthy) the
    tenant's allocate was admitted onto it, then refused 409 ("the GPU changed outside admission") though
    the other GPU had room.  Now admission weighs the host as placement does: the vGPU is made on the other
    GPU, its allocation row and its admission row name that GPU, and nothing touches the one out of service."""
    from vgpuhost.model.values import PciAddress
    from vgpuhost.ops import health
    from vgpuhost.policy.health import Source
    if backend == "vendor-vfio":
        host, profile, bad, good = make_host("l40s-vendor-vfio"), "L40S-4Q", "0000:21:00.0", "0000:a1:00.0"
    else:
        host, profile, bad, good = (make_host(yaml_text=TWO_A40.format(mixed="false", faults="")), "A40-4Q",
                                    "0000:41:00.0", "0000:81:00.0")
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("t1", quota=tenancy.Quota(tenancy.Limits(vgpus=2), tenancy.Limits(vgpus=2))))
    tenancy.bind(s, D1, "t1", name="vm1")

    def inventory():
        return discover(Sysfs(host))
    if out == "cordoned":
        health.cordon(host, s, inventory(), PciAddress.parse(bad), reason="maintenance", actor="test")
    else:
        health.mark_unhealthy(s, PciAddress.parse(bad), "EIO from a create", Source.IO, actor="test")
    dry = allocate_admitted(host, s, inventory, owner=D1, tenant="t1", profile=profile, strategy=strategy,
                            dry_run=True, actor="test")
    assert dry.gpu == good, dry.as_dict()
    made = allocate_admitted(host, s, inventory, owner=D1, tenant="t1", profile=profile, strategy=strategy,
                             actor="test")
    assert made.gpu == good, made.as_dict()
    recs = [(r.id, r.owner, r.gpu) for r in s.vgpu_records()]
    assert recs == [(made.id, D1, good)]
    assert [(row[0], row[1], row[3]) for row in s.allocation_rows()] == [(made.id, D1, good)]
    inv = discover(Sysfs(host))
    assert [str(m.parent) for m in inv.mdevs] + [str(v.gpu) for v in inv.vf_vgpus if v.type_id] == [good]   # the host
    admitted = [r for r in s.audit_rows() if r.path == "(admission)"]
    assert [r.result for r in admitted] == ["admitted"] and good in admitted[0].value, admitted


def test_the_agents_tenant_allocate_skips_a_cordoned_gpu(make_host):
    """The same through the agent's tenant route and its warm snapshot (the tester's repro: 409 there)."""
    from vgpuhost.agent import api
    from vgpuhost.model.values import PciAddress
    from vgpuhost.ops import health
    host = make_host("l40s-vendor-vfio")
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("t1", quota=tenancy.Quota(tenancy.Limits(vgpus=2), tenancy.Limits(vgpus=2))))
    tenancy.bind(s, D1, "t1", name="vm1")
    agent = api.Agent(host)
    health.cordon(host, s, agent.inventory(), PciAddress.parse("0000:21:00.0"), reason="maintenance", actor="test")
    req = api.Request({"uuid": D1}, {}, {"profile": "L40S-4Q", "strategy": "spread"}, "test-member", 1,
                      role=api.TENANT, tenant="t1")
    out = api.tenant_allocate(agent, req)
    assert out["gpu"] == "0000:a1:00.0", out
    assert [(r.id, r.gpu) for r in s.vgpu_records()] == [(out["id"], "0000:a1:00.0")]
    assert [(row[0], row[3]) for row in s.allocation_rows()] == [(out["id"], "0000:a1:00.0")]
