"""Issue 26 #3: promises that can be kept.

The pure search (:mod:`vgpuhost.policy.feasibility`): can every tenant's guarantee be served together
(pools, QoS classes, isolation, boards, equal-size mode, vGPU counts, MIG slices, passthrough GPUs)?
Then ``tenant add|set`` through the CLI on a simulated host: a feasible set is accepted, an infeasible
one refused with the reason (exit 2, nothing changed), and ``--allow-oversubscribe`` records it,
audited, warned and shown as "guarantee at risk" by ``tenant usage``, ``capacity``, ``host check`` and
the exporter.  Outcomes are read back from the state store, the audit log and the documents printed.
"""

import json

from vgpuhost.model.tenancy import Limits, Quota, Tenant
from vgpuhost.ops import tenancy
from vgpuhost.policy import admission as adm
from vgpuhost.policy import feasibility as feas
from vgpuhost.policy.feasibility import HostGpu
from test_admission import G1, G2, G3, OWNER_A, held, tenant
from test_reserve_reach import A40, H200_MIG, L40S, gpu
from test_tenancy_gaps import run, store_of


def verdict(ts, allocations=(), gpus=(), pools=(), **kw):
    return feas.search(feas.needs(ts, allocations), tenants=ts, allocations=list(allocations), gpus=list(gpus),
                       serves=adm.serves_of(pools), **kw)


# ---------------------------------------------------------------------------
# the search

def test_an_exclusive_tenant_and_a_passthrough_guarantee_need_a_gpu_each():
    ts = {"x": tenant("x", isolation="exclusive", g={"vgpus": 1}), "p": tenant("p", g={"passthrough_gpus": 1})}
    assert verdict(ts, gpus=[gpu(G1), gpu(G2)]).ok is True
    v = verdict(ts, gpus=[gpu(G1)])
    assert v.ok is False and "tenant 'p': 1 passthrough GPU(s)" in v.reason
    r = feas.risk(ts, [], [gpu(G1)], adm.serves_of(()), order=["x"])
    assert r.tenants == ("p",) and r.decided
    assert r.text == "tenant 'p': 1 passthrough GPU(s) cannot be served beside the unused guarantees of tenant 'x' " \
                     "(exclusive)"
    # a shared tenant leaves the GPU to nobody either (the passthrough takes it whole)
    ts["x"] = tenant("x", g={"vgpus": 1})
    assert verdict(ts, gpus=[gpu(G1)]).ok is False


def test_exclusive_tenants_do_not_share_a_gpu_and_shared_ones_do():
    two = {"x": tenant("x", isolation="exclusive", g={"vgpus": 2}), "y": tenant("y", isolation="exclusive",
                                                                                 g={"vgpus": 2})}
    assert verdict(two, gpus=[gpu(G1)]).ok is False
    assert verdict(two, gpus=[gpu(G1), gpu(G2)]).ok is True
    shared = {"x": tenant("x", g={"vgpus": 2}), "y": tenant("y", g={"vgpus": 2})}
    assert verdict(shared, gpus=[gpu(G1)]).ok is True
    avoid = {"x": tenant("x", g={"vgpus": 2}, avoid=frozenset({"env=dev"})),
             "y": tenant("y", g={"vgpus": 2}, labels=frozenset({"env=dev"}))}
    assert verdict(avoid, gpus=[gpu(G1)]).ok is False


def test_pools_serve_only_their_classes():
    ts = {"g": tenant("g", qos="guaranteed", g={"vgpus": 1})}
    assert verdict(ts, gpus=[gpu(G1)]).ok is False                       # no fixed-share pool: no GPU serves it
    gold = [adm.Pool("gold", "fixed-share", ("guaranteed",), (G1,))]
    assert verdict(ts, gpus=[gpu(G1)], pools=gold).ok is True
    # a burstable tenant may not be served on gold: with only G1, it cannot be kept
    ts["b"] = tenant("b", g={"vgpus": 1})
    v = verdict(ts, gpus=[gpu(G1)], pools=gold)
    assert v.ok is False and "tenant 'b'" in v.reason
    assert verdict(ts, gpus=[gpu(G1), gpu(G2)], pools=gold).ok is True
    # hardware partitions ignore pools: a MIG GPU in gold serves a burstable tenant's slices
    ts = {"m": tenant("m", g={"mig_slices": 3})}
    assert verdict(ts, gpus=[gpu(G1, H200_MIG, 144384, 7)], pools=gold).ok is True


def test_boards_sizes_and_equal_size_mode():
    # a uses A40-8Q: 7 more do not fit one A40 (6 a GPU), the L40S offers no A40 type
    ts = {"a": tenant("a", g={"vgpus": 8})}
    h = [held("a1", OWNER_A, "a", G1)]
    assert verdict(ts, h, [gpu(G1), gpu(G3, L40S)]).ok is False
    assert verdict(ts, h, [gpu(G1), gpu(G2)]).ok is True
    # equal-size: G1 holds 4Q vGPUs of no tenant; a (8Q) cannot join them
    h = [held("a1", OWNER_A, "a", G2), held("n1", "manual", None, G1, "A40-4Q")]
    ts = {"a": tenant("a", g={"vgpus": 7})}
    assert verdict(ts, h, [gpu(G1), gpu(G2)]).ok is False
    # framebuffer guarantees count MiB in whatever sizes fit
    ts = {"f": tenant("f", g={"framebuffer_mib": 98304})}
    assert verdict(ts, (), [gpu(G1), gpu(G2)]).ok is True
    assert verdict(ts, (), [gpu(G1)]).ok is False
    # hardware isolation: MIG-backed only
    ts = {"h": tenant("h", isolation="hardware", g={"vgpus": 2})}
    assert verdict(ts, (), [gpu(G1)]).ok is False
    assert verdict(ts, (), [gpu(G1, H200_MIG, 144384, 7)]).ok is True


def test_the_search_is_bounded_and_says_unknown():
    gpus = [gpu(f"0000:{i + 16:02x}:00.0") for i in range(16)]
    # 17 exclusive tenants on 16 GPUs: the bounds see it at once
    ts = {f"t{i}": tenant(f"t{i}", isolation="exclusive", g={"vgpus": 1}) for i in range(17)}
    assert verdict(ts, gpus=gpus).ok is False
    del ts["t16"]
    assert verdict(ts, gpus=gpus).ok is True
    # 17 tenants that each avoid all the others: no way either, but proving it means trying many
    ts = {f"t{i}": tenant(f"t{i}", g={"vgpus": 1}, labels=frozenset({f"id=t{i}"}),
                          avoid=frozenset({f"id=t{j}" for j in range(17) if j != i})) for i in range(17)}
    v = verdict(ts, gpus=gpus, limit=50)
    assert v.ok is None and "50 search steps" in v.reason
    assert verdict(ts, gpus=gpus).ok is None                # the default bound: a tenth of a second or so


# ---------------------------------------------------------------------------
# tenant add | set on a simulated host (one A40)

def test_tenant_add_refuses_guarantees_that_cannot_all_be_kept_unless_allowed(make_host, capsys):
    host = make_host("a40-mdev")
    s = store_of(host)
    assert run(capsys, host, "tenant", "add", "x", "--isolation", "exclusive", "--vgpus", "1")[0] == 0
    rows = len(s.audit_rows())
    code, out, err = run(capsys, host, "tenant", "add", "p", "--passthrough", "1")
    assert code == 2 and err.count("\n") == 1 and out == ""
    assert err.startswith("vgpuhost: error: tenant 'p': the guarantees cannot all be kept on this host: tenant 'p': "
                          "1 passthrough GPU(s) cannot be served beside the unused guarantees of tenant 'x' "
                          "(exclusive)")
    assert "--allow-oversubscribe" in err and "nothing was changed" in err
    assert set(tenancy.tenants(s)) == {"x"} and len(s.audit_rows()) == rows
    assert tenancy.oversubscribed(s) == []
    # tenant set alike: x's guarantee may grow on its own GPU, but not past it
    assert run(capsys, host, "tenant", "set", "x", "--vgpus", "2")[0] == 0
    code, _, err = run(capsys, host, "tenant", "set", "x", "--passthrough", "1")
    assert code == 2 and "cannot be served" in err and tenancy.get(s, "x").quota.guaranteed.passthrough_gpus is None
    # allowed: recorded, audited, warned
    code, out, err = run(capsys, host, "--json", "tenant", "add", "p", "--passthrough", "1", "--allow-oversubscribe")
    assert code == 0 and err.startswith("vgpuhost: warning: guarantee at risk (--allow-oversubscribe): tenant 'p'")
    doc = json.loads(out)
    assert doc["tenant"]["name"] == "p" and doc["warning"].startswith("guarantee at risk")
    assert set(tenancy.tenants(s)) == {"x", "p"} and tenancy.oversubscribed(s) == ["p"]
    [row] = [r for r in s.audit_rows() if r.operation == "tenant oversubscribe p"]
    assert "cannot be served beside the unused guarantees of tenant 'x'" in row.value
    # shown as at risk: tenant usage (text and JSON), capacity, host check, the exporter
    code, out, _ = run(capsys, host, "tenant", "usage")
    assert code == 0 and "tenant 'p': guarantee at risk: its unused 1 passthrough GPU(s) cannot be served beside the other " \
        "tenants' guarantees" in out
    assert "tenant 'x': guarantee at risk" not in out
    code, out, _ = run(capsys, host, "--json", "tenant", "usage")
    by = {t["tenant"]: t for t in json.loads(out)["tenants"]}
    assert by["p"]["at_risk"] is True and by["x"]["at_risk"] is False
    code, out, _ = run(capsys, host, "--json", "capacity")
    assert code == 0 and json.loads(out)["guarantees_at_risk"] == [
        {"tenant": "p", "guarantee": "1 passthrough GPU(s)"}]
    code, out, _ = run(capsys, host, "capacity")
    assert "guarantee at risk: tenant 'p': 1 passthrough GPU(s) cannot be served" in out
    code, out, _ = run(capsys, host, "--json", "host", "check")
    [f] = [f for f in json.loads(out)["findings"] if f["code"] == "GUARANTEE_AT_RISK"]
    assert f["severity"] == "warning" and f["subject"] == "tenant p"
    from vgpuhost.ops.exporter import _host_families
    from vgpuhost.ops.metering import host_series
    fams = {f.name: f for f in _host_families(host_series(host, s))}
    assert {x.labels["tenant"]: x.value for x in fams["vgpuhost_tenant_guarantee_at_risk"].samples} == \
        {"p": 1.0, "x": 0.0}
    # a change that leaves the same tenant at risk is accepted, warned as before
    code, _, err = run(capsys, host, "tenant", "set", "x", "--vgpus", "1")
    assert code == 0 and "guarantee at risk (as before)" in err
    # lowering p's guarantee ends the risk
    assert run(capsys, host, "tenant", "set", "p", "--passthrough", "0")[0] == 0
    code, out, _ = run(capsys, host, "--json", "tenant", "usage")
    assert not any(t["at_risk"] for t in json.loads(out)["tenants"])
    # raising it again is a new promise: refused without --allow-oversubscribe
    code, _, err = run(capsys, host, "tenant", "set", "p", "--passthrough", "1")
    assert code == 2 and "tenant 'p': 1 passthrough GPU(s) cannot be served" in err
    assert tenancy.get(s, "p").quota.guaranteed.passthrough_gpus == 0


def test_pools_refuse_a_guarantee_no_gpu_can_serve(make_host, capsys):
    host = make_host("a40-mdev")
    s = store_of(host)
    tenancy.set_pools(s, [adm.Pool("gold", "fixed-share", ("guaranteed",), ("0000:81:00.0",))])
    assert run(capsys, host, "tenant", "add", "g", "--qos", "guaranteed", "--vgpus", "2")[0] == 0
    code, _, err = run(capsys, host, "tenant", "add", "b", "--vgpus", "1")
    assert code == 2 and "tenant 'b': 1 vGPU(s) cannot be served beside the unused guarantees of tenant 'g'" in err
    assert set(tenancy.tenants(s)) == {"g"}
    # a tenant with no guarantee promises nothing
    assert run(capsys, host, "tenant", "add", "b")[0] == 0
    t = Tenant("c", quota=Quota(Limits(vgpus=1)))
    promise = tenancy.Promise(None)
    assert tenancy.add(s, t, promise=promise) == t and promise.warning.startswith("guarantees not checked")


def test_exclusive_tenants_share_a_mig_gpu():
    # MIG-backed vGPUs are hardware partitions: two exclusive tenants may both have one on one MIG GPU
    ts = {"x": tenant("x", isolation="exclusive", g={"vgpus": 1}), "y": tenant("y", isolation="exclusive",
                                                                                g={"vgpus": 1})}
    assert verdict(ts, gpus=[gpu(G1, H200_MIG, 144384, 7)]).ok is True
    assert verdict(ts, gpus=[gpu(G1)]).ok is False


# ---------------------------------------------------------------------------
# the search against a brute force over every way small hosts can be given out

def _brute(ts, allocations, gpus):
    """Every GPU: nothing, passthrough (if empty), or one size with any vGPU counts per tenant (shared
    tenants together, exclusive alone, beside what it holds): can every unused guarantee be met?"""
    import itertools
    needs = feas.needs(ts, allocations)
    names = [n.tenant for n in needs]
    held = {k: {a.profile for a in allocations if a.tenant == k} for k in names}
    per_gpu = []
    for g in gpus:
        here = [a for a in allocations if a.gpu == g.gpu]
        size = here[0].framebuffer_mib if here else None
        free = g.framebuffer_mib - sum(a.framebuffer_mib for a in here)
        present = {a.tenant for a in here}
        opts = [{}]
        if not here:
            opts.append({"pt": 1})
        for name, fb, _ in g.types:
            if size is not None and fb != size:
                continue
            ok = [k for k in names if (not held[k] or name in held[k]) and not any(
                p != k and (ts[k].conflicts(ts.get(p) if p else None) or (p and ts[p].conflicts(ts[k])))
                for p in present)]
            for counts in itertools.product(range(free // fb + 1), repeat=len(ok)):
                if sum(counts) > free // fb:
                    continue
                used = [k for k, c in zip(ok, counts) if c]
                if any(ts[a].conflicts(ts[b]) for a in used for b in used if a != b):
                    continue
                opts.append({k: (c, c * fb) for k, c in zip(ok, counts) if c})
        per_gpu.append(opts)
    for combo in itertools.product(*per_gpu):
        pt = sum(o.get("pt", 0) for o in combo)
        got = {k: [0, 0] for k in names}
        for o in combo:
            for k, v in o.items():
                if k != "pt":
                    got[k][0] += v[0]
                    got[k][1] += v[1]
        if pt >= sum(n.passthrough_gpus for n in needs) and all(
                got[n.tenant][0] >= n.vgpus and got[n.tenant][1] >= n.framebuffer_mib for n in needs):
            return True
    return False


def test_the_search_agrees_with_a_brute_force_on_small_hosts():
    import random
    rnd = random.Random(26)
    types = (("A40-8Q", 8192, 0), ("A40-16Q", 16384, 0), ("A40-24Q", 24576, 0))
    other = (("L40S-8Q", 8192, 0), ("L40S-16Q", 16384, 0))
    checked = {True: 0, False: 0}
    for case in range(160):
        small = [HostGpu(G1, 49152, types), HostGpu(G2, 49152, types if case % 2 else other)]   # A40, A40|L40S
        ts = {}
        for name in ("a", "b", "c")[:rnd.randint(1, 3)]:
            g = {}
            if rnd.random() < 0.7:
                g["vgpus"] = rnd.randint(1, 6)
            if rnd.random() < 0.4:
                g["framebuffer_mib"] = rnd.choice((8192, 16384, 40960, 65536))
            if rnd.random() < 0.2:
                g["passthrough_gpus"] = 1
            ts[name] = tenant(name, g=g, isolation=rnd.choice(("shared", "shared", "exclusive")),
                              labels=frozenset({f"id={name}"}),
                              avoid=frozenset({"id=a"}) if name == "c" and rnd.random() < 0.5 else frozenset())
        allocations = []
        for i, g in enumerate((G1, G2)):
            if rnd.random() < 0.4:
                who = rnd.choice([None, *ts])
                profile = rnd.choice(small[i].types)[0]
                allocations += [held(f"d{i}{j}", OWNER_A, who, g, profile) for j in range(rnd.randint(1, 2))]
        expect = _brute(ts, allocations, small)
        got = verdict(ts, allocations, small)
        assert got.ok is expect, (case, ts, allocations)
        checked[expect] += 1
    assert checked[True] > 20 and checked[False] > 20
