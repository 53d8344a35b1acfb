"""Tenancy (issue 13) on simulated hosts: the tenant CLI, admission in the qemu hook, 16 concurrent starts.

Outcomes are read back from the simulated sysfs tree, the state store (tenants, allocations, vGPU
records) and the audit log.
"""

from __future__ import annotations

import json
import subprocess
from typing import Dict

import pytest

from vgpuhost.cli.main import main as cli_main
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.observe.inventory import discover
from vgpuhost.ops import tenancy
from vgpuhost.policy import admission as adm

from test_hook import (GPU_HI, GPU_LO, bind_as_asked, domain_xml, install, mdev_gpu, mdev_hostdev, mdevs, mixed, pci_hostdev,
                       start, stop)


def run(capsys, host, *argv):
    code = cli_main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def tdom(name: str, uuid: str, mdev: str, tenant=None, profile="A40-8Q", strategy="first-fit") -> str:
    meta = Metadata(strategy=strategy, tenant=tenant, vgpus=[VgpuRequest(profile, uuid=mdev)])
    return domain_xml(name, uuid, meta, [mdev_hostdev(mdev)])


def uid(prefix: str, i: int) -> str:
    return f"{prefix}-2222-4333-8444-{i:012d}"


def store_of(host) -> StateStore:
    return StateStore(host.state_dir)


# ---------------------------------------------------------------------------
# the CLI

def test_tenant_cli_round_trip_json_and_audit(make_host, capsys):
    host = make_host("a40-mdev")
    code, out, _ = run(capsys, host, "tenant", "add", "prod", "--vgpus", "2:4", "--framebuffer", "16G:32G",
                       "--series", "C,Q", "--label", "env=prod", "--avoid", "env=dev", "--isolation", "exclusive")
    assert code == 0 and "added tenant prod" in out
    code, out, _ = run(capsys, host, "--json", "tenant", "show", "prod")
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "vgpuhost.tenant/v1"
    t = doc["tenant"]
    assert t["quota"]["vgpus"] == {"guaranteed": 2, "burst": 4}
    assert t["quota"]["framebuffer_mib"] == {"guaranteed": 16384, "burst": 32768}
    assert t["series"] == ["C", "Q"] and t["isolation"] == "exclusive" and t["avoid"] == ["env=dev"]
    assert run(capsys, host, "tenant", "set", "prod", "--vgpus", "none", "--qos", "best-effort")[0] == 0
    t = tenancy.get(store_of(host), "PROD")            # names match case-insensitively
    assert t.quota.guaranteed.vgpus is None and t.qos == "best-effort" and t.quota.guaranteed.framebuffer_mib == 16384
    code, _, err = run(capsys, host, "tenant", "add", "prod")
    assert code == 2 and err.startswith("vgpuhost: error: tenant 'prod' exists;") and err.count("\n") == 1
    code, _, err = run(capsys, host, "tenant", "add", "x", "--vgpus", "4:2")
    assert code == 2 and "burst limit 2 is below the guaranteed 4" in err
    assert tenancy.tenants(store_of(host)).keys() == {"prod"}
    code, out, _ = run(capsys, host, "--json", "tenant", "list")
    assert [t["name"] for t in json.loads(out)["tenants"]] == ["prod"]
    assert run(capsys, host, "tenant", "remove", "prod")[0] == 0
    code, _, err = run(capsys, host, "tenant", "show", "prod")
    assert code == 2 and "no tenant 'prod'" in err
    ops = [r.operation for r in store_of(host).audit_rows()]
    assert ops == ["tenant add prod", "tenant set prod", "tenant remove prod"]


def test_capacity_shows_fragmentation(make_host, capsys):
    host = make_host("l40s-vendor-vfio")
    assert run(capsys, host, "vgpu", "create", "--profile", "L40S-8Q")[0] == 0
    assert run(capsys, host, "vgpu", "create", "--profile", "L40S-4Q", "--strategy", "spread")[0] == 0
    code, out, _ = run(capsys, host, "--json", "capacity", "--profile", "L40S-24Q")
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "vgpuhost.capacity/v1"
    [p] = doc["profiles"]
    # 40 + 44 GiB free in all would hold 3 more L40S-24Q, but each GPU holds another size (equal-size mode)
    assert p["fits"] == 0 and p["framebuffer_would_allow"] == 3 and p["blocked"] == 3 and "fragmentation" in p["note"]
    assert set(p["by_pool"]) == {"default"}
    code, out, _ = run(capsys, host, "capacity")
    assert code == 0 and "L40S-24Q: fragmentation" in out


# ---------------------------------------------------------------------------
# admission in the qemu hook

def test_hook_admits_within_quota_refuses_above_it_and_release_frees(make_host):
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, tenancy.Tenant("team", quota=tenancy.Quota(tenancy.Limits(vgpus=1), tenancy.Limits(vgpus=2))))
    x = [tdom(f"vm{i}", uid("33333333", i), uid("cccccccc", i), tenant="team") for i in range(3)]
    assert start(host, "vm0", x[0]) == (0, "")
    assert start(host, "vm1", x[1]) == (0, "")
    before = mdevs(host)
    rc, err = start(host, "vm2", x[2])
    assert rc == 2 and err.count("\n") == 1
    assert "admission: quota vGPUs of tenant 'team': 2 in use + 1 asked > 2 (burst limit)" in err
    assert "to free room: stop or detach domain 'vm0'" in err
    assert mdevs(host) == before and uid("cccccccc", 2) not in before
    rows = {r[0]: r for r in s.allocation_rows()}
    assert set(rows) == {uid("cccccccc", 0), uid("cccccccc", 1)}
    assert [bool(rows[uid("cccccccc", i)][9]) for i in (0, 1)] == [False, True]      # the second is burst
    adm_rows = [r for r in s.audit_rows() if r.path == "(admission)"]
    assert [r.result for r in adm_rows] == ["admitted", "admitted", "refused"]
    assert "(burst)" in adm_rows[1].value and "2 in use + 1 asked" in adm_rows[2].value
    [u] = [d for d in tenancy.usage_report(s) if d["tenant"] == "team"]
    assert u["usage"]["vgpus"] == {"used": 2, "burst": 1, "guaranteed": 1, "limit": 2}
    assert stop(host, "vm0", x[0]) == (0, "")
    assert {r[0] for r in s.allocation_rows()} == {uid("cccccccc", 1)}
    assert start(host, "vm2", x[2]) == (0, "")          # room again


def test_hook_exclusive_tenant_gets_a_gpu_of_its_own(make_host):
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, tenancy.Tenant("solo", isolation="exclusive"))
    tenancy.add(s, tenancy.Tenant("crowd"))
    assert start(host, "c0", tdom("c0", uid("44444444", 0), uid("dddddddd", 0), tenant="crowd")) == (0, "")
    assert mdev_gpu(host, uid("dddddddd", 0)) == GPU_LO
    # first-fit would pick GPU_LO (room for 5 more A40-8Q); the exclusive tenant goes to GPU_HI
    assert start(host, "s0", tdom("s0", uid("44444444", 1), uid("dddddddd", 1), tenant="solo")) == (0, "")
    assert mdev_gpu(host, uid("dddddddd", 1)) == GPU_HI
    assert start(host, "c1", tdom("c1", uid("44444444", 2), uid("dddddddd", 2), tenant="crowd",
                                  strategy="spread")) == (0, "")
    assert mdev_gpu(host, uid("dddddddd", 2)) == GPU_LO          # never joins solo's GPU
    # a tenant the metadata names is only asked (issue 28): unbound, the domain has no tenant, best effort,
    # and like any domain with no tenant it never joins the exclusive tenant's GPU
    assert start(host, "u", tdom("u", uid("44444444", 3), uid("dddddddd", 3), tenant="nobody")) == (0, "")
    assert mdev_gpu(host, uid("dddddddd", 3)) == GPU_LO
    row = next(r for r in s.allocation_rows() if r[0] == uid("dddddddd", 3))
    assert (row[2], row[8]) == (None, "best-effort")


def test_hook_makes_the_vgpu_where_admission_placed_it(make_host):
    """Admission's placement is the one executed (issue 24): a tenant preferring another's GPU gets
    that GPU, which first-fit over admission's candidates alone would not choose; create only
    re-checks the choice under the GPU lock."""
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, tenancy.Tenant("other"))
    tenancy.add(s, tenancy.Tenant("crowd", labels=frozenset({"env=a"})))
    tenancy.add(s, tenancy.Tenant("fan", prefer=frozenset({"env=a"})))
    assert start(host, "o0", tdom("o0", uid("55555555", 0), uid("eeeeeeee", 0), tenant="other")) == (0, "")
    assert mdev_gpu(host, uid("eeeeeeee", 0)) == GPU_LO
    assert start(host, "c0", tdom("c0", uid("55555555", 1), uid("eeeeeeee", 1), tenant="crowd",
                                  strategy="spread")) == (0, "")
    assert mdev_gpu(host, uid("eeeeeeee", 1)) == GPU_HI
    # first-fit alone would pick GPU_LO; the preference for env=a's GPU decides GPU_HI, and that is where it goes
    assert start(host, "f0", tdom("f0", uid("55555555", 2), uid("eeeeeeee", 2), tenant="fan")) == (0, "")
    assert mdev_gpu(host, uid("eeeeeeee", 2)) == GPU_HI
    [row] = [r for r in s.audit_rows() if r.path == "(admission)" and r.operation.endswith(uid("eeeeeeee", 2))]
    assert "preferred: GPUs holding env=a" in row.value
    rows = {r[0]: r for r in s.allocation_rows()}
    assert rows[uid("eeeeeeee", 2)][3] == str(GPU_HI)


@pytest.mark.parametrize("tenants", [True, False])
def test_hook_resolves_each_profile_once_and_admission_and_create_take_it(make_host, monkeypatch, tenants):
    """The hook's prepare begin resolves a vGPU's profile to the type the host offers once (issue 24):
    admission (tenancy in use or not) and create take that name; create only re-checks its placement."""
    from vgpuhost.policy import offers
    host = mixed(make_host)
    if tenants:
        tenancy.add(store_of(host), tenancy.Tenant("team"))
    asked = []
    resolve = offers.resolve_profile
    monkeypatch.setattr(offers, "resolve_profile", lambda *a, **k: asked.append(a[2]) or resolve(*a, **k))
    assert start(host, "r0", tdom("r0", uid("55555555", 0), uid("eeeeeeee", 0), tenant="team")) == (0, "")
    assert asked == ["A40-8Q"] and mdev_gpu(host, uid("eeeeeeee", 0)) in (GPU_LO, GPU_HI)
    assert [(r[0], r[5]) for r in store_of(host).allocation_rows()] == [(uid("eeeeeeee", 0), "A40-8Q")]


def test_hook_without_tenants_records_no_tenant(make_host):
    host = mixed(make_host)
    assert start(host, "d", tdom("d", uid("55555555", 0), uid("eeeeeeee", 0), tenant="demo")) == (0, "")
    s = store_of(host)
    # the metadata's tenant is an unbound ask (issue 28): never recorded, billed or counted as the tenant's
    assert [(r[0], r[2], r[8]) for r in s.allocation_rows()] == [(uid("eeeeeeee", 0), None, "best-effort")]
    assert not [r for r in s.audit_rows() if r.path == "(admission)"]         # nothing to decide
    assert not (host.state_dir / "locks" / "tenancy.lock").exists()


def test_pools_refuse_a_policy_change_on_a_gpu_with_vgpus(make_host):
    host = mixed(make_host)
    s = store_of(host)
    lo, hi = str(GPU_LO), str(GPU_HI)
    from vgpuhost.model.nvml import SchedulerState
    from vgpuhost.sim.nvml import SimNvml
    for gpu, policy in ((GPU_HI, "fixed-share"), (GPU_LO, "equal-share")):    # the pools' policies (no drift)
        SimNvml(host).set_scheduler_state(gpu, SchedulerState(policy=policy))
    tenancy.set_pools(s, [adm.Pool("gold", "fixed-share", ("guaranteed",), (hi,)),
                          adm.Pool("std", "equal-share", ("burstable", "best-effort"), (lo,))])
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    assert start(host, "g0", tdom("g0", uid("66666666", 0), uid("ffffffff", 0), tenant="g")) == (0, "")
    assert mdev_gpu(host, uid("ffffffff", 0)) == GPU_HI
    with pytest.raises(tenancy.RefusedError, match="holds vGPUs"):
        tenancy.set_pools(s, [adm.Pool("all", "equal-share", ("burstable",), (lo, hi))])
    assert {p.name for p in tenancy.pools(s)} == {"gold", "std"}
    with pytest.raises(tenancy.InputError, match="one GPU has one scheduler policy"):
        tenancy.set_pools(s, [adm.Pool("a", "equal-share", (), (lo,)), adm.Pool("b", "best-effort", (), (lo,))])


# ---------------------------------------------------------------------------
# 16 hook starts at once, three tenants with quotas

def test_sixteen_concurrent_starts_three_tenants_quotas_hold_and_store_matches_sysfs(make_host, tmp_path):
    host = mixed(make_host)
    s = store_of(host)
    T, L = tenancy.Tenant, tenancy.Limits
    tenancy.add(s, T("alpha", quota=tenancy.Quota(L(vgpus=3))))
    tenancy.add(s, T("beta", quota=tenancy.Quota(L(vgpus=2, framebuffer_mib=16384), L(vgpus=4, framebuffer_mib=24576))))
    tenancy.add(s, T("gamma", isolation="exclusive", quota=tenancy.Quota(L(vgpus=4))))
    limits = {"alpha": 3, "beta": 3, "gamma": 4}        # beta: 24 GiB of A40-8Q is 3 vGPUs
    path = install(host, tmp_path)
    doms = []
    for i in range(16):
        t = ("alpha", "beta", "gamma")[i % 3]
        name, uuid, mdev = f"vm{i}", uid("77777777", i), uid("abababab", i)
        doms.append((name, uuid, mdev, t, tdom(name, uuid, mdev, tenant=t,
                                               strategy=("spread", "best-fit", "first-fit")[i % 3])))
    for d in doms:
        bind_as_asked(host, d[4])           # the operator binds each domain to its tenant (issue 28)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LC_ALL": "C"}
    procs = [subprocess.Popen([str(path), d[0], "prepare", "begin", "-"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for d in doms]
    for p, d in zip(procs, doms):
        p.stdin.write(d[4].encode())
        p.stdin.close()
    results = []
    for p in procs:
        rc = p.wait(timeout=300)
        results.append((rc, p.stderr.read().decode()))
        p.stdout.close()
        p.stderr.close()
    ok = [d for d, (rc, _) in zip(doms, results) if rc == 0]
    for d, (rc, err) in zip(doms, results):
        if rc:
            assert rc == 2 and err.count("\n") == 1 and "admission:" in err, results
    held: Dict[str, int] = {}
    for d in ok:
        held[d[3]] = held.get(d[3], 0) + 1
    # alpha and beta get their quota (6 A40-8Q fit on one A40); gamma, exclusive, gets its 4 when it took a
    # GPU before the others spread over both, else none: which one depends on the order the starts ran in
    assert held.get("alpha") == 3 and held.get("beta") == 3 and held.get("gamma", 0) in (0, 4), results
    assert all(n <= limits[t] for t, n in held.items())
    # the store matches sysfs: allocations == vGPU records == mdevs present, owners and GPUs alike
    inv = discover(Sysfs(host))
    present = {m.uuid for m in inv.mdevs}
    recs = {r.id: r for r in s.vgpu_records()}
    allocs = {r[0]: r for r in s.allocation_rows()}
    assert present == set(recs) == set(allocs) == {d[2] for d in ok}
    for d in ok:
        assert recs[d[2]].owner == allocs[d[2]][1] == d[1] and allocs[d[2]][2] == d[3]
        assert allocs[d[2]][3] == recs[d[2]].gpu == str(mdev_gpu(host, d[2]))
    # gamma is exclusive: a GPU holding gamma's vGPUs holds nobody else's
    by_gpu: Dict[str, set] = {}
    for a in allocs.values():
        by_gpu.setdefault(a[3], set()).add(a[2])
    assert all(ts == {"gamma"} for ts in by_gpu.values() if "gamma" in ts), by_gpu
    for name, tname, in (("alpha", "alpha"), ("beta", "beta"), ("gamma", "gamma")):
        [u] = [x for x in tenancy.usage_report(s) if x["tenant"] == tname]
        lim = u["usage"]["vgpus"]["limit"]
        assert u["usage"]["vgpus"]["used"] <= lim
        assert u["usage"]["vgpus"]["used"] - u["usage"]["vgpus"]["burst"] <= u["usage"]["vgpus"]["guaranteed"]
    for d in doms:
        assert subprocess.run([str(path), d[0], "release", "end", "-"], input=d[4].encode(), env=env,
                              capture_output=True, timeout=120).returncode == 0
    assert discover(Sysfs(host)).mdevs == () and s.allocation_rows() == [] and s.vgpu_records() == []


def test_passthrough_admission_counts_gpus(make_host):
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, tenancy.Tenant("hw", isolation="hardware", quota=tenancy.Quota(tenancy.Limits(passthrough_gpus=1))))
    inv = discover(Sysfs(host))
    lo = inv.gpu(GPU_LO)
    fns = [GPU_LO, *lo.companions]
    meta = Metadata(tenant="hw", passthrough=[GPU_LO])
    x = domain_xml("p0", uid("88888888", 0), meta, [pci_hostdev(f) for f in fns])
    assert start(host, "p0", x) == (0, "")
    assert [(r[0], r[4], r[2]) for r in s.allocation_rows()] == [(str(GPU_LO), "passthrough", "hw")]
    hi = inv.gpu(GPU_HI)
    meta2 = Metadata(tenant="hw", passthrough=[GPU_HI])
    x2 = domain_xml("p1", uid("88888888", 1), meta2, [pci_hostdev(f) for f in [GPU_HI, *hi.companions]])
    rc, err = start(host, "p1", x2)
    assert rc == 2 and "quota passthrough GPUs of tenant 'hw': 1 in use + 1 asked > 1" in err
    rc, err = start(host, "v", tdom("v", uid("88888888", 2), uid("acacacac", 2), tenant="hw"))
    assert rc == 2 and "isolation 'hardware'" in err
    assert stop(host, "p0", x) == (0, "")
    assert s.allocation_rows() == []


# ---------------------------------------------------------------------------
# the domain's QoS class, OpenStack projects, attach's early feedback

NOVA = ("<nova:instance xmlns:nova='http://openstack.org/xmlns/libvirt/nova/1.1'><nova:name>i</nova:name>"
        "<nova:owner><nova:user uuid='u1'>admin</nova:user>"
        "<nova:project uuid='6f70656e737461636b20342065766572'>team</nova:project></nova:owner></nova:instance>\n")


def test_domxml_reads_qos_and_the_nova_project():
    from vgpuhost.libvirt.domxml import parse_domain
    meta = Metadata(qos="guaranteed", vgpus=[VgpuRequest("A40-8Q", uuid=uid("cdcdcdcd", 0))])
    x = domain_xml("n", uid("99999999", 0), raw_meta=NOVA + meta.to_xml(), hostdevs=[mdev_hostdev(uid("cdcdcdcd", 0))])
    v = parse_domain(x)
    assert v.metadata.qos == "guaranteed" and v.nova_project == ("team", "6f70656e737461636b20342065766572")
    assert parse_domain(domain_xml("n", uid("99999999", 0))).nova_project is None
    # only Nova's own elements: a <nova:project> under an <owner> or <instance> of another namespace is not Nova's
    for forged in (NOVA.replace("<nova:owner>", "<o:owner xmlns:o='urn:evil'>").replace("</nova:owner>", "</o:owner>"),
                   NOVA.replace("<nova:instance xmlns:nova='http://openstack.org/xmlns/libvirt/nova/1.1'>",
                                "<e:instance xmlns:e='urn:evil' xmlns:nova='http://openstack.org/xmlns/libvirt/nova/1.1'>")
                       .replace("</nova:instance>", "</e:instance>")):
        assert parse_domain(domain_xml("n", uid("99999999", 1), raw_meta=forged)).nova_project is None, forged
    from vgpuhost.model.errors import InputError
    with pytest.raises(InputError, match="unknown qos"):
        parse_domain(domain_xml("n", uid("99999999", 0), raw_meta=meta.to_xml().replace("guaranteed", "gold")))


def test_domain_qos_override_and_openstack_projects(make_host):
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, tenancy.Tenant("team", quota=tenancy.Quota(tenancy.Limits(vgpus=1))))
    # qos=guaranteed on a time-sliced vGPU, and no fixed-share pool: refused by the QoS rule
    meta = Metadata(tenant="team", qos="guaranteed", vgpus=[VgpuRequest("A40-8Q", uuid=uid("cdcdcdcd", 1))])
    q = domain_xml("q", uid("99999999", 1), meta, [mdev_hostdev(uid("cdcdcdcd", 1))])
    rc, err = start(host, "q", q)
    # team is burstable: its domain's metadata may not ask for more (issue 28), and the line names the binding
    assert rc == 2 and "asks QoS class guaranteed, stronger than it may have: it is bound to tenant 'team'" in err
    tenancy.update(s, "team", qos="guaranteed")
    rc, err = start(host, "q", q)
    assert rc == 2 and "QoS class guaranteed needs a hardware partition" in err
    tenancy.update(s, "team", qos="burstable")
    # a Nova domain names no vgpuhost tenant: with the mapping off it has none (best-effort, no quota)
    meta = Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=uid("cdcdcdcd", 2))])
    nova = domain_xml("o1", uid("99999999", 2), raw_meta=NOVA + meta.to_xml(),
                      hostdevs=[mdev_hostdev(uid("cdcdcdcd", 2))])
    assert start(host, "o1", nova) == (0, "")
    assert s.allocation_rows()[0][2] is None
    assert stop(host, "o1", nova) == (0, "")
    tenancy.set_openstack(s, "project-name")
    assert start(host, "o1", nova) == (0, "")
    assert [r[2] for r in s.allocation_rows()] == ["team"]
    meta = Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=uid("cdcdcdcd", 3))])
    nova2 = domain_xml("o2", uid("99999999", 3), raw_meta=NOVA + meta.to_xml(),
                       hostdevs=[mdev_hostdev(uid("cdcdcdcd", 3))])
    rc, err = start(host, "o2", nova2)
    assert rc == 2 and "quota vGPUs of tenant 'team': 1 in use + 1 asked > 1" in err
    tenancy.set_openstack(s, "project-uuid")          # the UUID names no tenant: refused as unknown
    rc, err = start(host, "o2", nova2)
    assert rc == 2 and "unknown tenant '6f70656e737461636b20342065766572'" in err


def test_attach_refuses_early_what_admission_would_refuse(make_host, tmp_path, capsys):
    import libvirt
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.model.errors import RefusedError
    from vgpuhost.ops.attach import attach
    h = make_host("a40-mdev")
    host = HostRoot(h.root, tmp_path / "state")
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("hw", isolation="hardware"))
    conn = libvirt.open("test:///default")
    name = "tenancy-attach"
    try:
        conn.defineXML(f"<domain type='test'><name>{name}</name><memory>65536</memory><os><type>hvm</type></os>"
                       "<devices/></domain>")
        before = conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        with pytest.raises(RefusedError, match="isolation 'hardware'"):
            attach(host, s, "test:///default", name, profile="A40-8Q", tenant="hw")
        assert conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE) == before
        from vgpuhost.model.errors import InputError
        with pytest.raises(InputError, match="no tenant 'other'"):      # the binding attach would record
            attach(host, s, "test:///default", name, profile="A40-8Q", tenant="other")
        assert conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE) == before and not s.binding_rows()
        tenancy.add(s, tenancy.Tenant("other"))
        out = attach(host, s, "test:///default", name, profile="A40-8Q", tenant="other", qos="best-effort")
        assert out.changed
        from vgpuhost.libvirt.domxml import parse_domain
        m = parse_domain(conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)).metadata
        assert (m.tenant, m.qos) == ("other", "best-effort")
        # attach --tenant/--qos record the operator's binding too, audited (issue 28)
        uuid = conn.lookupByName(name).UUIDString()
        assert [r[:3] for r in s.binding_rows()] == [(uuid, "other", "best-effort")]
        assert [r.operation for r in s.audit_rows() if r.path == "(tenants)"][-1] == f"tenant bind {name}"
        assert not [r for r in s.audit_rows() if r.path == "(admission)"]     # feedback only: not audited
    finally:
        try:
            conn.lookupByName(name).undefine()
        except libvirt.libvirtError:
            pass
        conn.close()


# ---------------------------------------------------------------------------
# pools in the declarative layout

POOLS = """
version: 1
layouts:
  shared:
    gpus:
      - select: {{address: "0000:41:00.0"}}
        mode: vgpu
        vgpu: {{types: {{A40-8Q: 1}}}}
        scheduler: {{policy: {lo}}}
        pool: std
      - select: {{address: "0000:81:00.0"}}
        mode: vgpu
        vgpu: {{types: {{A40-8Q: 1}}}}
        scheduler: {{policy: {hi}}}
        pool: {{name: gold, serves: [{serves}]}}
"""


def test_layout_pools_are_recorded_by_apply_and_guard_busy_gpus(make_host):
    from vgpuhost.ops.layout import apply, plan
    from vgpuhost.policy.config import parse
    host = mixed(make_host)
    s = store_of(host)
    c = parse(POOLS.format(lo="equal-share", hi="fixed-share", serves="guaranteed"), "pools.yaml")
    p = plan(host, s, c)
    assert any(n.startswith("pool gold (fixed-share, serves guaranteed): 0000:81:00.0") for n in p.notes), p.notes
    apply(host, s, c)
    assert {(x.name, x.policy, x.classes, x.gpus) for x in tenancy.pools(s)} == {
        ("std", "equal-share", ("burstable", "best-effort"), (str(GPU_LO),)),
        ("gold", "fixed-share", ("guaranteed",), (str(GPU_HI),))}
    assert any(r.operation == "pools set" for r in s.audit_rows())
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    tenancy.add(s, tenancy.Tenant("b"))
    assert start(host, "g0", tdom("g0", uid("12121212", 0), uid("34343434", 0), tenant="g")) == (0, "")
    assert start(host, "b0", tdom("b0", uid("12121212", 1), uid("34343434", 1), tenant="b",
                                  strategy="spread")) == (0, "")
    assert mdev_gpu(host, uid("34343434", 0)) == GPU_HI and mdev_gpu(host, uid("34343434", 1)) == GPU_LO
    # swapping the policies would change the scheduler under running vGPUs: refused before any change
    before = mdevs(host)
    with pytest.raises(tenancy.RefusedError):
        apply(host, s, parse(POOLS.format(lo="fixed-share", hi="equal-share", serves="burstable"), "pools.yaml"))
    assert mdevs(host) == before and {x.name for x in tenancy.pools(s)} == {"std", "gold"}
    # gold no longer serving guaranteed would strand g0's vGPU outside its class: refused too
    with pytest.raises(tenancy.RefusedError, match="holds a guaranteed vGPU"):
        apply(host, s, parse(POOLS.format(lo="equal-share", hi="fixed-share", serves="burstable"), "pools.yaml"))
    assert mdevs(host) == before and tenancy.pools(s)[0].classes in (("guaranteed",), ("burstable", "best-effort"))
    assert stop(host, "g0", tdom("g0", uid("12121212", 0), uid("34343434", 0), tenant="g")) == (0, "")
    apply(host, s, parse(POOLS.format(lo="equal-share", hi="fixed-share", serves="burstable"), "pools.yaml"))
    assert [x.classes for x in tenancy.pools(s) if x.name == "gold"] == [("burstable",)]


@pytest.mark.parametrize("body, message", [
    ("""      - select: all
        mode: vgpu
        vgpu: {types: {A40-8Q: 1}}
        pool: gold
""", "a pool needs a scheduler policy"),
    ("""      - select: all
        mode: vgpu
        vgpu: {types: {A40-8Q: 1}}
        scheduler: {policy: equal-share}
        pool: {name: gold, serves: [guaranteed]}
""", "a pool with the equal-share scheduler cannot serve 'guaranteed'"),
    ("""      - select: all
        mode: vgpu
        vgpu: {types: {A40-8Q: 1}}
        scheduler: {policy: fixed-share}
        pool: {name: gold, serves: [gold]}
""", "'gold' is not a QoS class"),
    ("""      - select: {address: "0000:41:00.0"}
        mode: vgpu
        vgpu: {types: {A40-8Q: 1}}
        scheduler: {policy: equal-share}
        pool: gold
      - select: {address: "0000:81:00.0"}
        mode: vgpu
        vgpu: {types: {A40-8Q: 1}}
        scheduler: {policy: best-effort}
        pool: gold
""", "a pool has one scheduler policy"),
    ("""      - select: all
        mode: passthrough
        pool: gold
""", "pool in an entry with mode: passthrough"),
    ("""      - select: all
        mode: vgpu
        vgpu: {types: {A40-8Q: 1}}
        scheduler: {policy: best-effort}
        pool: default
""", "'default' names the GPUs in no pool"),
])
def test_layout_pool_errors(body, message):
    from vgpuhost.model.errors import InputError
    from vgpuhost.policy.config import parse
    with pytest.raises(InputError) as e:
        parse("version: 1\nlayouts:\n  x:\n    gpus:\n" + body, "p.yaml")
    assert message in e.value.message and e.value.message.startswith("p.yaml:")
