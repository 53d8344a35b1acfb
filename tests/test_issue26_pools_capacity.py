"""Issue 26, findings 5 and 6 on simulated hosts: the scheduler policy is what the pool says (``scheduler
set`` refused off a pool's policy, a GPU in drift admits nothing until ``apply``), and capacity answers
what admission would answer for a tenant (``capacity --tenant``, the exporter's per-tenant series,
``advise``, ``fleet capacity|place --tenant``).

Outcomes are read back from the simulated sysfs tree and NVML, the state store and the audit log.
"""

from __future__ import annotations

import json

from vgpuhost.cli.main import main as cli_main
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.observe.inventory import discover
from vgpuhost.ops import tenancy
from vgpuhost.sim.nvml import SimNvml

from test_hook import GPU_HI, GPU_LO, mdev_gpu, mdevs, mixed, start
from test_tenancy import tdom, uid
from test_admission_trial import pool_layout

GOLD = pool_layout("shared", ("0000:41:00.0", "A40-8Q: 1", "equal-share", "std"),
                   ("0000:81:00.0", "A40-8Q: 1", "fixed-share", "{name: gold, serves: [guaranteed]}"))


def run(capsys, host, *argv):
    code = cli_main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def gold_host(make_host, capsys, std=("burstable", "best-effort")):
    """:func:`mixed` with two empty pooled GPUs: std (equal share) on GPU_LO, gold (fixed share, serving
    guaranteed) on GPU_HI, the policies set through NVML first, as a layout's apply leaves them."""
    host = mixed(make_host)
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_LO), "--policy", "equal-share")[0] == 0
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "fixed-share")[0] == 0
    s = StateStore(host.state_dir)
    tenancy.set_pools(s, [tenancy.adm.Pool("std", "equal-share", tuple(std), (str(GPU_LO),)),
                          tenancy.adm.Pool("gold", "fixed-share", ("guaranteed",), (str(GPU_HI),))])
    return host, s


def policy_of(host, gpu) -> str:
    return SimNvml(host).scheduler_state(gpu).policy


# ---------------------------------------------------------------------------
# finding 5: the policy is what the pool says

def test_scheduler_set_refuses_a_policy_the_gpus_pool_does_not_have(make_host, capsys):
    host, s = gold_host(make_host, capsys)
    assert policy_of(host, GPU_HI) == "fixed-share"
    rows = len(s.audit_rows())
    code, _, err = run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "best-effort")
    assert code == 2 and err.count("\n") == 1
    assert f"GPU {GPU_HI} is in pool 'gold', whose scheduler policy is fixed-share, not best-effort" in err
    assert "layout" in err and "vgpuhost apply" in err
    assert policy_of(host, GPU_HI) == "fixed-share" and len(s.audit_rows()) == rows      # nothing changed
    # --all names a pooled GPU too; --persist writes nothing either
    assert run(capsys, host, "scheduler", "set", "--all", "--policy", "equal-share")[0] == 2
    code, _, err = run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "equal-share", "--persist")
    assert code == 2 and "pool 'gold'" in err
    assert not (host.root / "etc/modprobe.d/vgpuhost-scheduler.conf").exists()
    # the pool's own policy, and a GPU's in a pool of that policy, are fine
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_LO), "--policy", "equal-share")[0] == 0
    assert policy_of(host, GPU_LO) == "equal-share"


def test_a_gpu_in_drift_admits_no_class_until_apply_sets_its_pools_policy(make_host, capsys):
    from vgpuhost.ops.layout import apply
    from vgpuhost.policy.config import parse
    host, s = gold_host(make_host, capsys)
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    # someone sets the gold GPU to best effort behind vgpuhost's back (NVML directly)
    SimNvml(host).set_scheduler_state(GPU_HI, SchedulerState(policy="best-effort"))
    assert policy_of(host, GPU_HI) == "best-effort"
    x = tdom("g0", uid("56565656", 0), uid("78787878", 0), tenant="g")
    before = mdevs(host)
    rc, err = start(host, "g0", x)
    assert rc == 2 and err.count("\n") == 1, err
    assert (f"GPU {GPU_HI} runs the best-effort scheduler, not the fixed-share of its pool 'gold': in drift" in err), err
    assert "vgpuhost apply" in err
    assert mdevs(host) == before and not s.allocation_rows()
    # capacity counts nothing free there and says why
    code, out, _ = run(capsys, host, "--json", "capacity", "--profile", "A40-8Q")
    doc = json.loads(out)
    assert a40(doc, "A40-8Q")["by_gpu"][str(GPU_HI)] == 0
    assert "in drift" in {g["gpu"]: g for g in doc["gpus"]}[str(GPU_HI)]["drift"]
    [row] = [r for r in s.audit_rows() if r.path == "(admission)"]
    assert row.result == "refused" and "in drift" in row.value
    # apply sets the pool's policy again; the start is admitted onto the gold GPU
    apply(host, s, parse(GOLD, "gold.yaml"))
    assert policy_of(host, GPU_HI) == "fixed-share"
    assert start(host, "g0", x) == (0, "")
    assert mdev_gpu(host, uid("78787878", 0)) == GPU_HI
    rows = [r for r in s.audit_rows() if r.path == "(admission)"]
    assert [r.result for r in rows] == ["refused", "admitted"] and "pool gold" in rows[-1].value


# ---------------------------------------------------------------------------
# finding 6: capacity answers what admission would answer

def exclusive_host(make_host):
    """:func:`mixed` with tenant ``solo`` (exclusive) holding an A40-4Q on GPU_LO and ``web`` (shared,
    2 vGPUs at most)."""
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("solo", isolation="exclusive"))
    tenancy.add(s, tenancy.Tenant("web", quota=tenancy.Quota(tenancy.Limits(vgpus=2), tenancy.Limits())))
    assert start(host, "s0", tdom("s0", uid("90909090", 0), uid("a0a0a0a0", 0), tenant="solo",
                                  profile="A40-4Q")) == (0, "")
    assert mdev_gpu(host, uid("a0a0a0a0", 0)) == GPU_LO
    return host, s


def a40(doc, profile="A40-4Q"):
    [p] = [p for p in doc["profiles"] if p["profile"] == profile]
    return p


def test_capacity_counts_nothing_free_on_a_gpu_an_exclusive_tenant_holds(make_host, capsys):
    host, _ = exclusive_host(make_host)
    code, out, _ = run(capsys, host, "--json", "capacity", "--profile", "A40-4Q")
    doc = json.loads(out)
    assert code == 0 and doc["tenant"] is None
    p = a40(doc)
    assert p["by_gpu"][str(GPU_LO)] == 0 and p["by_gpu"][str(GPU_HI)] == 12 and p["fits"] == 12
    ex = {g["gpu"]: g["exclusive"] for g in doc["gpus"]}
    assert ex[str(GPU_LO)] == "solo" and ex[str(GPU_HI)] is None
    code, out, _ = run(capsys, host, "capacity", "--profile", "A40-4Q")
    assert code == 0 and f"{GPU_LO}: held by exclusive tenant solo" in out


def test_capacity_for_a_tenant_is_what_admission_admits(make_host, capsys):
    host, s = exclusive_host(make_host)
    code, out, _ = run(capsys, host, "--json", "capacity", "--tenant", "WEB", "--profile", "A40-4Q")
    doc = json.loads(out)
    assert code == 0 and doc["tenant"] == "web"
    p = a40(doc)
    # never on solo's GPU; at most 2 by its quota, however many GPU_HI could hold
    assert p["by_gpu"] == {str(GPU_LO): 0, str(GPU_HI): 2} and p["fits"] == 2 and p["blocked"] == 0
    assert "quota vGPUs of tenant 'web': 2 in use + 1 asked > 2" in p["why_not"]
    # the exclusive tenant itself may join its own GPU and take an empty one
    p = a40(json.loads(run(capsys, host, "--json", "capacity", "--tenant", "solo", "--profile", "A40-4Q")[1]))
    assert p["by_gpu"] == {str(GPU_LO): 11, str(GPU_HI): 12} and p["fits"] == 23 and p["why_not"]
    # admission agrees: web starts two, the third is refused for its quota, and capacity then says 0
    for i in range(3):
        rc, err = start(host, f"w{i}", tdom(f"w{i}", uid("90909090", i + 1), uid("a0a0a0a0", i + 1), tenant="web",
                                            profile="A40-4Q"))
        assert (rc, i < 2 or "quota vGPUs of tenant 'web'" in err) == ((0 if i < 2 else 2), True), err
    assert {mdev_gpu(host, uid("a0a0a0a0", i)) for i in (1, 2)} == {GPU_HI}
    code, out, _ = run(capsys, host, "capacity", "--tenant", "web", "--profile", "A40-4Q")
    assert code == 0 and "no more for tenant web: quota vGPUs of tenant 'web': 2 in use + 1 asked > 2" in out


def test_capacity_refuses_an_unknown_tenant(make_host, capsys):
    host, _ = exclusive_host(make_host)
    code, out, err = run(capsys, host, "capacity", "--tenant", "nosuch")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "no tenant 'nosuch'" in err and "tenants: solo, web" in err


def test_exporter_free_instances_leave_out_exclusive_gpus_and_say_what_each_tenant_may_start(make_host):
    from prometheus_client import CollectorRegistry, generate_latest

    from vgpuhost.ops.exporter import _host_families
    from vgpuhost.ops.metering import host_series
    host, s = exclusive_host(make_host)
    series = host_series(host, s)
    # 12 A40-4Q fit on the empty GPU_HI; none on solo's GPU for anyone else
    assert series["free_instances"][("A40-4Q", "")] == 12
    tf = series["tenant_free_instances"]
    assert tf[("web", "A40-4Q")] == 2 and tf[("solo", "A40-4Q")] == 23
    # the same answers as 'capacity --tenant'
    web = tenancy.capacity(s, discover(Sysfs(host)), tenant="web")
    assert all(tf[("web", p["profile"])] == p["fits"] for p in web["profiles"])
    assert {p["profile"] for p in web["profiles"]} == {pr for t, pr in tf if t == "web"}

    class Families:
        def collect(self):
            return list(_host_families(series))
    reg = CollectorRegistry()
    reg.register(Families())
    text = generate_latest(reg).decode()
    assert 'vgpuhost_tenant_free_instances{profile="A40-4Q",tenant="web"} 2.0' in text
    assert 'vgpuhost_free_instances{pool="",profile="A40-4Q"} 12.0' in text


def _facts(instance, series):
    """A host's :class:`HostFacts` as Prometheus would give them from its exporter's ``series``."""
    from vgpuhost.policy.fleet import HostFacts
    free = {}
    for (profile, _pool), n in series["free_instances"].items():
        free[profile] = free.get(profile, 0) + n
    return HostFacts(instance, True, "", free, dict(series.get("quota_used", {})),
                     {(t, r): v for (t, r, k), v in series.get("quota_limit", {}).items() if k == "burst"},
                     series.get("tenant_free_instances"))


def test_fleet_place_never_chooses_a_host_whose_admission_refuses_the_tenant(make_host, capsys):
    from vgpuhost.model.errors import InputError
    from vgpuhost.ops.metering import host_series
    from vgpuhost.policy.fleet import capacity as fleet_capacity, rank
    # h1: both A40s in a fixed-share pool that serves guaranteed only; web is burstable
    h1, s1 = gold_host(make_host, capsys)
    tenancy.set_pools(s1, [tenancy.adm.Pool("gold", "fixed-share", ("guaranteed",), (str(GPU_HI), str(GPU_LO)))],
                      check=False)
    SimNvml(h1).set_scheduler_state(GPU_LO, SchedulerState(policy="fixed-share"))     # the pool's policy
    tenancy.add(s1, tenancy.Tenant("web"))
    tenancy.add(s1, tenancy.Tenant("g", qos="guaranteed"))
    # h2: one A40-8Q already held, no tenants at all
    h2 = mixed(make_host)
    assert run(capsys, h2, "vgpu", "create", "--profile", "A40-8Q")[0] == 0
    facts = [_facts("h1", host_series(h1, s1)), _facts("h2", host_series(h2, StateStore(h2.state_dir)))]
    assert facts[0].free["A40-8Q"] > facts[1].free["A40-8Q"] > 0
    r = rank(facts, "A40-8Q", tenant="web")
    assert r.hosts and r.hosts[0][0] == "h2" and [h for h, _ in r.hosts] == ["h2"]
    assert r.skipped == [("h1", "its admission admits no A40-8Q for tenant web now ('vgpuhost capacity --tenant web "
                                "--profile A40-8Q' there says why)")]
    # admission on h1 agrees: the pool serves guaranteed only
    doc = tenancy.capacity(s1, discover(Sysfs(h1)), tenant="web")
    assert a40(doc, "A40-8Q")["fits"] == 0 and "does not serve burstable" in a40(doc, "A40-8Q")["why_not"]
    # the guaranteed tenant may start there: h1 (first by name) is its choice
    assert rank(facts, "A40-8Q", tenant="G").hosts[0] == ("h1", 12)
    # a domain naming no tenant is best-effort, which h1's pool does not serve either
    assert facts[0].tenant_free[("", "A40-8Q")] == 0
    r = rank(facts, "A40-8Q")
    assert [h for h, _ in r.hosts] == ["h2"] and r.skipped[0][0] == "h1" and "naming no tenant" in r.skipped[0][1]
    cap = fleet_capacity(facts, "A40-8Q", "web")
    assert cap["tenant"] == "web" and cap["profiles"][0]["by_host"] == {"h1": 0, "h2": 11}
    # a tenant no host knows is refused, naming the known ones
    for call in (lambda: rank(facts, "A40-8Q", tenant="nosuch"), lambda: fleet_capacity(facts, None, "nosuch")):
        try:
            call()
        except InputError as e:
            assert "no tenant 'nosuch'" in e.message and e.hint == "tenants: g, web"
        else:
            raise AssertionError("an unknown tenant was accepted")


def test_advise_counts_the_more_vms_admission_would_admit(make_host, capsys):
    from vgpuhost.io import state as st
    from vgpuhost.model.usage import UsageRow
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    # solo (exclusive, at most 2 vGPUs) holds an A40-4Q on GPU_LO; web is another tenant
    tenancy.add(s, tenancy.Tenant("solo", isolation="exclusive",
                                  quota=tenancy.Quota(tenancy.Limits(vgpus=2), tenancy.Limits())))
    tenancy.add(s, tenancy.Tenant("web"))
    dom, dev = uid("90909090", 0), uid("a0a0a0a0", 0)
    assert start(host, "s0", tdom("s0", dom, dev, tenant="solo", profile="A40-4Q")) == (0, "")
    assert mdev_gpu(host, dev) == GPU_LO
    # two hours at a 500 MiB peak and 1 % SM: it fits an A40-1Q, freeing 3 GiB on solo's GPU
    mib = 1024 * 1024
    with s.transaction() as conn:
        st.add_usage(conn, [UsageRow(f"2026-12-01T{h:02d}:00:00Z", dev, dom, "vgpu", str(GPU_LO), "A40-4Q", "s0",
                                     "solo", "burstable", 3600.0, 36.0, 0.0, 0.0, 500 * mib, 4096 * mib, 60)
                            for h in (10, 11)])
    code, out, _ = run(capsys, host, "--json", "advise", "--since", "2026-11-30")
    doc = json.loads(out)
    assert code == 0 and doc["advice"][0]["action"] == "downsize" and doc["advice"][0]["to"] == "A40-1Q"
    # the freed 3 GiB would hold 3 A40-1Q, but only solo may use that GPU, and its quota leaves room for 1
    assert doc["more_vms"] == {"A40-1Q": 1} and doc["tenant"] is None
    # web may not join solo's GPU at all
    code, out, _ = run(capsys, host, "advise", "--since", "2026-11-30", "--tenant", "web")
    assert code == 0 and "would admit no more VMs of tenant web" in out and "more A40-1Q" not in out
    code, _, err = run(capsys, host, "advise", "--since", "2026-11-30", "--tenant", "nosuch")
    assert code == 2 and "no tenant 'nosuch'" in err and "tenants: solo, web" in err


def test_admit_closes_a_pooled_gpu_whose_running_policy_is_not_its_pools():
    """The pure rule: ``policies`` (the policy each GPU runs) closes a declared pool's GPU running another
    policy; the implicit pool, a GPU not read, and hardware partitions are not checked."""
    from vgpuhost.model.values import PciAddress
    from vgpuhost.policy import admission as adm
    from vgpuhost.policy.placement import GpuOffer
    g1, g2 = "0000:41:00.0", "0000:81:00.0"
    offers = [GpuOffer(PciAddress.parse(g), 0, "nvidia-566", "A40-8Q", 2, (PciAddress.parse(g),)) for g in (g1, g2)]
    pools = [adm.Pool("gold", "fixed-share", ("guaranteed", "burstable"), (g1,))]
    ts = {"t": tenancy.Tenant("t", qos="guaranteed")}

    def decide(policies, qos=None, profile="A40-8Q"):
        return adm.admit(adm.AdmissionRequest("o", adm.vgpu_demand(profile), "t", qos), tenants=ts, allocations=[],
                         pools=pools, offers=offers, policies=policies)
    assert decide(None).gpu == g1 and decide({}).gpu == g1 and decide({g1: "fixed-share"}).gpu == g1
    d = decide({g1: "best-effort", g2: "best-effort"})
    assert not d.admitted and d.code == "pool" and "in drift" in d.reason and "vgpuhost apply" in d.remedy()
    # a burstable request goes to the default pool's GPU instead (its policy is whatever it runs)
    d = decide({g1: "equal-share", g2: "best-effort"}, qos="burstable")
    assert d.admitted and d.gpu == g2 and d.candidates == (g2,)
