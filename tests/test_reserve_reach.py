"""Issue 26 #2: a guarantee's reserve is held only on GPUs the guaranteed tenant can use.

Unit tests on :func:`vgpuhost.policy.admission.admit` with per-GPU facts (:class:`HostGpu`: the types
each GPU offers), one per case of the issue (other boards, other pools, the other way round, isolation
and avoid rules, hardware isolation), and an end-to-end start through the qemu hook on a simulated host
(two A40s and an L40S), read back from the sysfs tree, the state store and the audit log.
"""

from vgpuhost.policy import admission as adm
from vgpuhost.policy.feasibility import HostGpu
from test_admission import G1, G2, G3, OWNER_A, OWNER_B, held, offers, tenant, vreq

A40 = tuple((f"A40-{n}Q", n * 1024, 0) for n in (1, 2, 4, 8, 16, 24, 48))
L40S = tuple((f"L40S-{n}Q", n * 1024, 0) for n in (1, 2, 4, 8, 16, 24, 48))
H200_MIG = (("H200X-1-18C", 18432, 1), ("H200X-2-35C", 35840, 2), ("H200X-7-141C", 144384, 7))
OWNER_C = "33333333-3333-3333-3333-333333333333"


def gpu(bdf, types=A40, mem=49152, mig=0):
    return HostGpu(bdf, mem, types, mig)


def untenanted(n, g, profile="A40-8Q"):
    return [held(f"n{i}", f"0000000{i}-1111-1111-1111-111111111111", None, g, profile) for i in range(n)]


# ---------------------------------------------------------------------------
# other boards

def test_free_framebuffer_on_another_board_is_not_room_for_an_a40_guarantee():
    # a holds one A40-8Q on G1 (full); G2 is the only A40 with room; G3 an L40S, empty
    ts = {"a": tenant("a", g={"vgpus": 2}), "b": tenant("b", g={"vgpus": 0}, b={"vgpus": 4})}
    h = [held("a1", OWNER_A, "a", G1)] + untenanted(5, G1)
    facts = [gpu(G1), gpu(G2), gpu(G3, L40S)]
    mem = {G1: 49152, G2: 49152, G3: 49152}
    d = adm.admit(vreq(owner=OWNER_B, tenant="b", profile="A40-4Q"), tenants=ts, allocations=h, gpu_memory=mem,
                  offers=offers(0, 12, profile="A40-4Q", gpus=(G1, G2)), gpus=facts)
    assert not d.admitted and d.code == "burst"
    assert "a first 4096 MiB vGPU on 0000:81:00.0 would fix its vGPU size" in d.reason
    assert "(tenant 'a': 1 vGPU(s) of 8192 MiB)" in d.reason
    # the same burst at a's size leaves room for it beside
    d = adm.admit(vreq(owner=OWNER_B, tenant="b", profile="A40-8Q"), tenants=ts, allocations=h, gpu_memory=mem,
                  offers=offers(0, 6, gpus=(G1, G2)), gpus=facts)
    assert d.admitted and d.burst and d.gpu == G2
    # and a burst on the L40S takes nothing a needs
    d = adm.admit(vreq(owner=OWNER_B, tenant="b", profile="L40S-48Q"), tenants=ts, allocations=h, gpu_memory=mem,
                  offers=offers(1, profile="L40S-48Q", gpus=(G3,)), gpus=facts)
    assert d.admitted and d.gpu == G3


def test_the_room_of_a_count_guarantee_is_counted_in_the_size_it_uses():
    # a uses A40-8Q: 6 more fit on the empty A40 only if nothing else sizes it
    ts = {"a": tenant("a", g={"vgpus": 7}), "b": tenant("b", g={"vgpus": 0}, b={"vgpus": 4})}
    h = [held("a1", OWNER_A, "a", G1)] + untenanted(5, G1)
    facts = [gpu(G1), gpu(G2), gpu(G3, L40S)]
    d = adm.admit(vreq(owner=OWNER_B, tenant="b"), tenants=ts, allocations=h, offers=offers(0, 6, gpus=(G1, G2)),
                  gpus=facts)
    assert not d.admitted and "(tenant 'a': 6 vGPU(s) of 8192 MiB)" in d.reason


# ---------------------------------------------------------------------------
# other pools, and the other way round

GOLD = adm.Pool("gold", "fixed-share", ("guaranteed",), (G1,))
SILVER = adm.Pool("silver", "equal-share", ("burstable", "best-effort"), (G2,))


def test_a_silver_gpu_is_not_room_for_a_tenant_only_gold_serves():
    ts = {"g": tenant("g", qos="guaranteed", g={"vgpus": 1}),
          "c": tenant("c", qos="guaranteed", g={"vgpus": 0}, b={"vgpus": 2})}
    facts = [gpu(G1), gpu(G2)]
    d = adm.admit(vreq(owner=OWNER_B, tenant="c", profile="A40-4Q"), tenants=ts, allocations=[],
                  pools=[GOLD, SILVER], offers=offers(12, 12, profile="A40-4Q", gpus=(G1, G2)), gpus=facts)
    assert not d.admitted and d.code == "burst" and d.candidates == ()
    assert "would fix its vGPU size" in d.reason and "tenant 'g'" in d.reason
    # a burstable burst on silver takes nothing g can use
    ts["b"] = tenant("b", g={"vgpus": 0}, b={"vgpus": 2})
    d = adm.admit(vreq(owner=OWNER_C, tenant="b", profile="A40-4Q"), tenants=ts, allocations=[],
                  pools=[GOLD, SILVER], offers=offers(12, 12, profile="A40-4Q", gpus=(G1, G2)), gpus=facts)
    assert d.admitted and d.gpu == G2 and d.pool == "silver"


def test_no_room_is_held_on_a_pool_that_cannot_serve_the_guaranteed_tenant():
    # t (burstable) is guaranteed 6 vGPUs; gold serves guaranteed only, so t's room is on G2 and G3
    ts = {"t": tenant("t", g={"vgpus": 6}), "c": tenant("c", qos="guaranteed", g={"vgpus": 0}, b={"vgpus": 2})}
    facts = [gpu(G1), gpu(G2), gpu(G3)]
    pools = [adm.Pool("gold", "fixed-share", ("guaranteed",), (G1,))]
    d = adm.admit(vreq(owner=OWNER_B, tenant="c"), tenants=ts, allocations=[], pools=pools,
                  offers=offers(6, 6, 6), gpus=facts, gpu_memory={G1: 49152, G2: 49152, G3: 49152})
    assert d.admitted and d.burst and d.gpu == G1 and d.pool == "gold"


# ---------------------------------------------------------------------------
# isolation and avoid rules

def test_a_burst_may_not_take_the_last_gpu_an_exclusive_guarantee_needs():
    # s holds a vGPU on G1 with room; x (exclusive) cannot share it: G2 is the only GPU x can use
    ts = {"x": tenant("x", isolation="exclusive", g={"vgpus": 1}), "s": tenant("s", g={"vgpus": 2}),
          "b": tenant("b", g={"vgpus": 0}, b={"vgpus": 4})}
    h = [held("s1", OWNER_A, "s", G1)]
    facts = [gpu(G1), gpu(G2)]
    d = adm.admit(vreq(owner=OWNER_B, tenant="b", anti_affinity=None, gpu=G2), tenants=ts, allocations=h,
                  offers=offers(5, 6, gpus=(G1, G2)), gpus=facts)
    assert not d.admitted and d.code == "burst" and "tenant 'x'" in d.reason
    # a domain with no tenant alike
    d = adm.admit(vreq(owner=OWNER_B, gpu=G2), tenants=ts, allocations=h, offers=offers(5, 6, gpus=(G1, G2)),
                  gpus=facts)
    assert not d.admitted and d.code == "burst" and d.reason.startswith("vGPU A40-8Q for a domain without a tenant")
    # beside s, where x could never go anyway, the burst is admitted
    d = adm.admit(vreq(owner=OWNER_B, tenant="b"), tenants=ts, allocations=h, offers=offers(5, 6, gpus=(G1, G2)),
                  gpus=facts)
    assert d.admitted and d.gpu == G1


def test_a_burst_may_not_take_the_last_gpu_an_avoid_rule_leaves_the_guarantee():
    ts = {"p": tenant("p", g={"vgpus": 1}, avoid=frozenset({"env=dev"})),
          "d": tenant("d", g={"vgpus": 2}, labels=frozenset({"env=dev"})),
          "b": tenant("b", g={"vgpus": 0}, b={"vgpus": 4})}
    h = [held("d1", OWNER_A, "d", G1)]
    d = adm.admit(vreq(owner=OWNER_B, tenant="b", gpu=G2), tenants=ts, allocations=h,
                  offers=offers(5, 6, gpus=(G1, G2)), gpus=[gpu(G1), gpu(G2)])
    assert not d.admitted and d.code == "burst" and "tenant 'p'" in d.reason


def test_the_exclusive_tenants_refusal_names_the_burst_on_the_gpu_it_needs():
    ts = {"x": tenant("x", isolation="exclusive", g={"vgpus": 1}), "s": tenant("s", g={"vgpus": 2}),
          "b": tenant("b", g={"vgpus": 0}, b={"vgpus": 4})}
    h = [held("s1", OWNER_A, "s", G1), held("b1", OWNER_C, "b", G2, burst=True)]
    d = adm.admit(vreq(owner=OWNER_B, tenant="x"), tenants=ts, allocations=h, offers=offers(5, 5, gpus=(G1, G2)),
                  gpus=[gpu(G1), gpu(G2)], names={OWNER_C: "burster"})
    assert not d.admitted and d.code == "isolation"
    assert "tenant 'b' holds vGPU A40-8Q b1 on 0000:81:00.0 as burst (domain 'burster')" in d.one_line()


def test_a_slice_burst_may_not_take_the_mig_room_a_hardware_tenants_vgpu_count_needs():
    # h (hardware isolation) is guaranteed 1 vGPU: only a MIG-backed one can serve it
    ts = {"h": tenant("h", isolation="hardware", g={"vgpus": 1}),
          "b": tenant("b", g={"mig_slices": 0}, b={"mig_slices": 7})}
    facts = [gpu(G1, H200_MIG, 144384, 7)]
    kw = dict(tenants=ts, allocations=[], gpu_memory={G1: 144384}, gpu_slices={G1: 7}, gpus=facts)
    d = adm.admit(vreq(tenant="b", profile="H200X-7-141C"), offers=offers(1, profile="H200X-7-141C", gpus=(G1,)),
                  **kw)
    assert not d.admitted and d.code == "burst" and "(tenant 'h': 1 vGPU(s))" in d.reason
    d = adm.admit(vreq(tenant="b", profile="H200X-2-35C"), offers=offers(1, profile="H200X-2-35C", gpus=(G1,)),
                  **kw)
    assert d.admitted and d.burst


# ---------------------------------------------------------------------------
# end to end: the qemu hook on a simulated host with two A40s and an L40S

def test_a_burst_is_refused_the_last_a40_a_guarantee_needs_though_the_l40s_is_empty(make_host):
    from test_hook import GPU_HI, GPU_LO, mdevs, mixed, start
    from test_tenancy import tdom, uid
    from test_tenancy_gaps import admission_rows, quota, store_of, T, L
    from vgpuhost.ops import tenancy
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, T("a", quota=quota(vgpus=2)))
    tenancy.add(s, T("b", quota=tenancy.Quota(L(vgpus=0), L(vgpus=4))))
    assert start(host, "a0", tdom("a0", uid("40404040", 0), uid("c0c0c0c0", 0), tenant="a")) == (0, "")
    for i in range(5):          # domains with no tenant fill the first A40 at a's size
        assert start(host, f"n{i}", tdom(f"n{i}", uid("41414141", i), uid("c1c1c1c1", i))) == (0, "")
    assert {str(GPU_LO)} == {r[3] for r in s.allocation_rows()}
    rc, err = start(host, "b0", tdom("b0", uid("42424242", 0), uid("c2c2c2c2", 0), tenant="b", profile="A40-4Q"))
    assert rc == 2 and err.count("\n") == 1
    assert f"a first 4096 MiB vGPU on {GPU_HI} would fix its vGPU size" in err and "(tenant 'a': 1 vGPU(s) of 8192 MiB)" in err
    assert uid("c2c2c2c2", 0) not in mdevs(host) and len(s.allocation_rows()) == 6
    assert admission_rows(s)[-1].result == "refused"
    # a's guarantee is there when it asks
    assert start(host, "a1", tdom("a1", uid("40404040", 1), uid("c0c0c0c0", 1), tenant="a")) == (0, "")
    assert [r[3] for r in s.allocation_rows() if r[0] == uid("c0c0c0c0", 1)] == [str(GPU_HI)]


def test_a_guaranteed_vgpu_goes_where_the_other_guarantees_stay_servable():
    # x (exclusive) needs an empty GPU; s's guaranteed vGPU goes beside a domain with no tenant on G1, not on
    # the empty G2 that placement (first-fit) would pick first
    ts = {"x": tenant("x", isolation="exclusive", g={"vgpus": 1}), "s": tenant("s", g={"vgpus": 2})}
    h = untenanted(1, G1)
    d = adm.admit(vreq(owner=OWNER_B, tenant="s"), tenants=ts, allocations=h,
                  offers=offers(5, 6, gpus=(G2, G1)), gpus=[gpu(G1), gpu(G2)])
    assert d.admitted and not d.burst and d.gpu == G1
    # where only the empty GPU fits, the guarantee is still admitted there
    d = adm.admit(vreq(owner=OWNER_B, tenant="s"), tenants=ts, allocations=h,
                  offers=offers(0, 6, gpus=(G1, G2)), gpus=[gpu(G1), gpu(G2)])
    assert d.admitted and d.gpu == G2


def test_through_the_hook_a_burst_may_not_take_the_last_gpu_an_exclusive_tenant_can_use(make_host, capsys):
    from test_hook import GPU_HI, GPU_LO, L40S, mdevs, mixed, start
    from test_tenancy import tdom, uid
    from test_tenancy_gaps import admission_rows, quota, run, store_of, T, L
    from vgpuhost.ops import tenancy
    host = mixed(make_host)
    s = store_of(host)
    # the L40S holds a vGPU made by hand (no tenant's): exclusive x cannot go there
    assert run(capsys, host, "vgpu", "create", "--profile", "L40S-8Q", "--gpu", str(L40S))[0] == 0
    tenancy.add(s, T("s", quota=quota(vgpus=2), labels=frozenset({"team=s"})))
    tenancy.add(s, T("x", quota=quota(vgpus=1), isolation="exclusive"))
    tenancy.add(s, T("b", quota=tenancy.Quota(L(vgpus=0), L(vgpus=4)), avoid=frozenset({"team=s"})))
    assert start(host, "s0", tdom("s0", uid("43434343", 0), uid("c3c3c3c3", 0), tenant="s")) == (0, "")
    assert [r[3] for r in s.allocation_rows()] == [str(GPU_LO)]
    # b avoids s, so only the empty A40 could take its burst: the last GPU x can use
    rc, err = start(host, "b0", tdom("b0", uid("44444444", 0), uid("c4c4c4c4", 0), tenant="b"))
    assert rc == 2 and err.count("\n") == 1 and "tenant 'x'" in err and "burst for tenant 'b' refused" in err
    assert uid("c4c4c4c4", 0) not in mdevs(host) and admission_rows(s)[-1].result == "refused"
    # x's guarantee is there when it asks
    assert start(host, "x0", tdom("x0", uid("45454545", 0), uid("c5c5c5c5", 0), tenant="x")) == (0, "")
    assert [r[3] for r in s.allocation_rows() if r[2] == "x"] == [str(GPU_HI)]
