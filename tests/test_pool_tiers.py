"""Placement fills the pools of the weakest tier first (issue 30: compute-aware placement).

A time-sliced vGPU goes to a pool whose strongest class served is weaker before a pool serving a
stronger one (a best-effort vGPU to a best-effort-only pool before an equal-share one, a burstable vGPU
to an equal-share pool before a fixed-share one): checked against an independent reading of the
offers and the GPU time left before each arrival, on random traces of the pure host model.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as hs

from vgpuhost.model.gputime import METERED, ExpectedUse
from vgpuhost.model.tenancy import Tenant
from vgpuhost.model.values import replace
from vgpuhost.policy import admission as adm
from vgpuhost.policy import compute
from vgpuhost.policy.replay import Board, HostModel, violations

BOARD = Board("A40", 48 * 1024)
GPUS = {f"0000:{0x10 + i:02x}:00.0": BOARD for i in range(5)}
G = sorted(GPUS)
POOLS = [adm.Pool("batch", "best-effort", ("best-effort",), (G[0], G[1])),
         adm.Pool("std", "equal-share", ("burstable", "best-effort"), (G[2], G[3])),
         adm.Pool("gold", "fixed-share", ("guaranteed", "burstable", "best-effort"), (G[4],))]
TENANTS = {n: Tenant(n, q) for n, q in (("w", "best-effort"), ("b", "burstable"), ("g", "guaranteed"))}


def test_a_pool_tier_is_the_strongest_class_it_serves():
    assert [adm.pool_tier(p) for p in POOLS] == [0, 1, 2]
    assert adm.pool_tier(adm.pool_of(POOLS, "0000:99:00.0")) == 1      # the implicit pool serves burstable


def test_a_best_effort_vgpu_takes_the_best_effort_pool_before_a_fuller_equal_share_gpu():
    model = HostModel(GPUS, POOLS)
    use = ExpectedUse(0.3, METERED)
    assert model.arrive("b1", replace(adm.vgpu_demand("A40-8Q"), use=use), TENANTS, tenant="b").gpu == G[2]
    # best-fit alone would join the std GPU already holding an 8 GB vGPU; the best-effort-only pool comes first
    d = model.arrive("w1", replace(adm.vgpu_demand("A40-8Q"), use=use), TENANTS, tenant="w")
    assert d.admitted and d.gpu in (G[0], G[1]), d.reason
    assert violations(model, TENANTS) == []


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from(["A40-4Q", "A40-8Q", "A40-16Q"]), hs.floats(0.05, 0.9),
                          hs.sampled_from(["w", "b", "g"]), hs.booleans()),
                min_size=1, max_size=30))
def test_no_gpu_of_a_weaker_tier_could_have_taken_the_vgpu(arrivals):
    model = HostModel(GPUS, POOLS)
    policy_of = {g: p.policy for p in POOLS for g in p.gpus}
    for i, (profile, share, tenant, leave) in enumerate(arrivals):
        dem = replace(adm.vgpu_demand(profile), use=ExpectedUse(share, METERED))
        offers = {str(o.gpu): o for o in model.offers(profile)}
        load = compute.gpu_load(model.allocations, model.memory(), policy_of.get)
        before = list(model.allocations)
        d = model.arrive(f"vm{i}", dem, TENANTS, tenant=tenant)
        if not d.admitted:
            assert model.allocations == before
        else:
            qos = TENANTS[tenant].qos
            tier = adm.pool_tier(adm.pool_of(POOLS, d.gpu))
            for p in POOLS:
                if adm.pool_tier(p) >= tier or not p.serves(qos):
                    continue
                for g in p.gpus:
                    share_here = compute.expected(dem, GPUS[g].memory_mib, p.policy).share
                    fits = offers[g].available > 0 and compute.fits(share_here, load.get(g, 0.0),
                                                                    compute.ceiling_of(p))
                    assert not fits, (f"{profile} of {tenant} went to {d.gpu} (tier {tier}) though {g} of pool "
                                      f"{p.name} had room: {d.reason}")
        if leave and i % 2:
            model.depart(f"vm{i // 2}")
        top = {g: compute.ceiling_of(p) for p in POOLS for g in p.gpus}
        assert all(v <= top[g] + 1e-9 for g, v in
                   compute.gpu_load(model.allocations, model.memory(), policy_of.get).items())
        assert violations(model, TENANTS) == []
