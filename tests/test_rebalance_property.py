"""Property: the reconciler's pure decision (:func:`vgpuhost.policy.rebalance.decide`) never moves a
busy GPU, never leaves a tenant's guarantee unservable that was servable, and keeps the operator's
bounds (changes per hour, quiet hours, each pool's min and max), on hand-built hosts of 3 to 6 A40s
in up to three pools, with guaranteed tenants, allocations, refused starts and each pool's metered
history (so forecast moves too) drawn at random."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from vgpuhost.model.tenancy import Limits, Quota, Tenant
from vgpuhost.policy import rebalance as pol
from vgpuhost.policy.admission import Pool, gpu_time_room, pool_of, serves_of
from vgpuhost.policy.demand import Allocation
from vgpuhost.policy.feasibility import HostGpu, at_risk

FB = 49152
TYPES = (("A40-8Q", 8192, 0), ("A40-24Q", 24576, 0), ("A40-48Q", 49152, 0))
MOST = ((8192, 6), (24576, 2), (49152, 1))
POOLS = (("gold", "fixed-share", ("guaranteed",)), ("std", "equal-share", ("burstable", "best-effort")),
         ("batch", "best-effort", ("best-effort",)))
CLASSES = ("guaranteed", "burstable", "best-effort")


@st.composite
def hosts(draw):
    n = draw(st.integers(3, 6))
    gpus = [f"0000:{0x41 + i:02x}:00.0" for i in range(n)]
    where = ["gold", "std", draw(st.sampled_from(("gold", "std")))] + [
        draw(st.sampled_from(("gold", "std", "batch", "default"))) for _ in gpus[3:]]
    pools = [Pool(name, policy, classes, tuple(g for g, w in zip(gpus, where) if w == name))
             for name, policy, classes in POOLS if name in where]
    tenants = {}
    for i in range(draw(st.integers(0, 3))):
        name = f"t{i}"
        tenants[name] = Tenant(name, qos=draw(st.sampled_from(CLASSES)),
                               quota=Quota(Limits(vgpus=draw(st.integers(0, 3))), Limits()))
    held = []
    busy = set()
    for g in gpus:
        if draw(st.integers(0, 2)) == 0:
            owner = draw(st.sampled_from([None, *sorted(tenants)]))
            qos = tenants[owner].qos if owner else "best-effort"
            if not pool_of(pools, g).serves(qos):
                owner, qos = None, "best-effort"
            held.append(Allocation(f"dev-{g}", f"dom-{g}", owner, g, "vgpu", "A40-8Q", 8192, 0, qos))
            busy.add(g)
    facts = [pol.GpuFacts(g, "holds 1 device(s)" if g in busy else "", ("a40-24q", "a40-48q", "a40-8q"), FB)
             for g in gpus]
    refusals = [pol.Refusal("2026-12-07T00:00:00", draw(st.sampled_from(("A40-8Q", "A40-48Q"))),
                            None, draw(st.sampled_from(CLASSES)), "capacity")
                for _ in range(draw(st.integers(1, 4)))]
    host_gpus = [HostGpu(g, FB, TYPES, 0, MOST) for g in gpus]
    bounds = pol.Bounds(changes_per_hour=draw(st.sampled_from((0, 1, 2, 4, 4, 4))),
                        quiet=draw(st.sampled_from((None, None, None, (0, 720), (1380, 60)))),
                        pools={n: pol.PoolBound(draw(st.integers(0, 2)), draw(st.sampled_from((None, 1, 2, 3))))
                               for n in ("gold", "std", "batch", "default") if draw(st.integers(0, 2)) == 0})
    trends = {n: pol.Trend(draw(st.sampled_from((0.0, 3600.0, 36000.0))), 3600.0) for n in ("gold", "std", "batch")}
    # the forecast: per pool, a metered history whose next hour yesterday was 0x..4x this hour's
    history = {n: [1.0] * 24 + [draw(st.sampled_from((0.0, 1.0, 2.0, 4.0)))] + [1.0] * 23
               for n in ("gold", "std", "batch", "default") if draw(st.booleans())}
    return dict(pools=pools, gpus=facts, refusals=refusals, tenants=tenants, held=held, host_gpus=host_gpus,
                bounds=bounds, minute_of_day=draw(st.integers(0, 1439)), moves_last_hour=draw(st.sampled_from((0, 0, 0, 1))),
                trends=trends, history=history), busy


def _count(pools, gpus, name):
    return sum(1 for g in gpus if pool_of(pools, g.gpu).name == name)


@settings(max_examples=60, deadline=None)
@given(hosts())
def test_decide_never_moves_a_busy_gpu_and_keeps_guarantees_and_bounds(drawn):
    args, busy = drawn
    d = pol.decide(**args)
    pools, gpus, bounds = args["pools"], args["gpus"], args["bounds"]
    moved = [m.gpu for m in d.moves]
    assert not set(moved) & busy                                       # never a busy GPU
    assert len(moved) == len(set(moved))                               # each GPU moved once at most
    assert len(d.moves) <= max(0, bounds.changes_per_hour - args["moves_last_hour"])
    if bounds.in_quiet(args["minute_of_day"]):
        assert not d.moves
    after = list(pools)
    for m in d.moves:
        assert pool_of(after, m.gpu).name == m.from_pool
        after = pol.with_move(after, m.gpu, m.to_pool)
        assert pool_of(after, m.gpu).name == m.to_pool
    for name in {m.from_pool for m in d.moves}:                       # a donor keeps its minimum (and a GPU)
        floor = max(bounds.bound(name).min, 1 if name != "default" else 0)
        assert _count(after, gpus, name) >= floor
    for name in {m.to_pool for m in d.moves}:                         # a recipient stays within its maximum
        mx = bounds.bound(name).max
        assert mx is None or _count(after, gpus, name) <= max(mx, _count(pools, gpus, name))
    # the guarantees: no tenant at risk after the moves that was not at risk before
    ts, held, hg = args["tenants"], args["held"], args["host_gpus"]
    was, _ = at_risk(ts, held, gpu_time_room(hg, held, pools), serves_of(pools))
    now, _ = at_risk(ts, held, gpu_time_room(hg, held, after), serves_of(after))
    assert set(now) <= set(was), (was, now, d.moves)
