"""Capacity ahead of demand (issue 30, item 3): the reconciler's forecast of each pool's need from the
same hours of the previous days in the metered history (else the trend), the moves it makes ahead of
that need, and where an empty GPU goes when two pools both want it (where it admits more starts).
Pure decisions on hand-built hosts, and the forecast's history read back from a store's rollups."""

from __future__ import annotations

import time

import pytest

from vgpuhost.io import state as st
from vgpuhost.io.state import StateStore
from vgpuhost.model.errors import InputError
from vgpuhost.model.gputime import ExpectedUse, TENANT_PROFILE
from vgpuhost.model.usage import UsageRow
from vgpuhost.ops import rebalance
from vgpuhost.policy import rebalance as pol
from vgpuhost.policy.admission import Pool
from vgpuhost.policy.demand import Allocation

FB = 49152
OFFERS = ("a40-1b", "a40-12c", "a40-48c")
GPUS = [f"0000:{0x41 + i:02x}:00.0" for i in range(6)]
#: 48 h of metered demand: on each of the two days, 1.0 at the hour now began and 2.0 in the hour after
RISE = ([1.0, 2.0] + [1.0] * 22) * 2


def _host(desk, compute, busy=()):
    pools = [Pool("desk", "equal-share", ("burstable",), tuple(desk)),
             Pool("compute", "best-effort", ("best-effort",), tuple(compute))]
    gpus = [pol.GpuFacts(g, "holds 1 device(s)" if g in busy else "", OFFERS, FB) for g in (*desk, *compute)]
    return pools, gpus


def _args(pools, gpus, **kw):
    return dict(dict(pools=pools, gpus=gpus, refusals=(), tenants={}, held=(), host_gpus=(),
                     bounds=pol.Bounds(changes_per_hour=8), minute_of_day=600, moves_last_hour=0), **kw)


def test_growth_reads_the_same_hours_of_the_previous_days():
    # demand doubles from hour 0 to hour 1 of each day: at hour 0 the forecast one hour ahead is 2x
    hist = [2.0 if h % 24 == 1 else 1.0 for h in range(48)]
    assert pol.growth(hist, 1, 7) == (2.0, "the same hours of the last 2 day(s)")
    assert pol.growth(hist, 1, 1) == (2.0, "the same hours of the last 1 day(s)")
    # four times: kept to MAX_RATIO; a fall of 8x: kept to 1 / MAX_RATIO
    assert pol.growth([1.0, 4.0] + [1.0] * 22, 1, 7)[0] == pol.MAX_RATIO
    assert pol.growth([8.0, 1.0] + [1.0] * 22, 1, 7)[0] == 1 / pol.MAX_RATIO


def test_growth_falls_back_to_the_trend_then_to_none():
    assert pol.growth([2.0, 2.0, 3.0, 3.0], 2, 7) == (1.5, "the trend of the last 4 h")
    assert pol.growth([1.0], 1, 7) == (1.0, "no history")
    assert pol.growth([], 1, 7) == (1.0, "no history")
    assert pol.growth([0.0, 0.0, 5.0], 1, 7) == (1.0, "no history")       # nothing metered before
    assert pol.growth([1.0] * 48, 0, 7) == (1.0, "no forecast (horizon 0 h)")


def test_a_pool_forecast_to_need_more_gets_empty_gpus_ahead_of_its_refusals():
    pools, gpus = _host(GPUS[:2], GPUS[2:], busy=GPUS[:2])
    # desk holds 2 GPUs, both busy; yesterday its demand doubled in the next hour; compute: flat, idle
    hist = {"desk": RISE}
    d = pol.decide(**_args(pools, gpus, history={"desk": hist["desk"], "compute": [0.0] * 48}))
    assert [(m.from_pool, m.to_pool) for m in d.moves] == [("compute", "desk"), ("compute", "desk")]
    assert all(m.gpu in GPUS[2:] for m in d.moves)
    assert "pool desk is forecast to need 4.0 GPU(s) in 1 h (the same hours of the last 2 day(s); 2.0 now)" \
        in d.moves[0].reason
    look = dict(d.demand)["desk"]
    assert (look["need_now"], look["need_ahead"]) == (2.0, 4.0)
    # no forecast: nothing moves (no refusal, no rising trend)
    assert not pol.decide(**_args(pools, gpus)).moves
    # the bounds hold a forecast move: the desk maximum, the changes per hour, quiet hours
    capped = pol.decide(**_args(pools, gpus, history={"desk": hist["desk"]},
                                bounds=pol.Bounds(pools={"desk": pol.PoolBound(0, 3)})))
    assert len(capped.moves) == 1 and any("maximum of 3" in h for h in capped.held)
    assert not pol.decide(**_args(pools, gpus, history={"desk": hist["desk"]},
                                  bounds=pol.Bounds(quiet=(0, 1439)))).moves


def test_a_donor_keeps_what_it_is_forecast_to_need():
    pools, gpus = _host(GPUS[:2], GPUS[2:], busy=(*GPUS[:2], GPUS[2]))
    desk = RISE
    # compute holds 1 busy GPU and 3 empty ones; its own demand is forecast to double: it keeps 2
    d = pol.decide(**_args(pools, gpus, history={"desk": desk, "compute": desk}))
    assert len(d.moves) == 2 and all(m.to_pool == "desk" for m in d.moves)
    left = [g for g in GPUS[2:] if g not in {m.gpu for m in d.moves}]
    assert len(left) == 2
    # forecast to rise 2x on 3 busy GPUs (need 6): it gives none
    pools, gpus = _host(GPUS[:2], GPUS[2:], busy=(*GPUS[:2], *GPUS[2:5]))
    d = pol.decide(**_args(pools, gpus, history={"desk": desk, "compute": desk}))
    assert not d.moves and any("pool compute needs its 4 GPU(s)" in h for h in d.held), d.held


def _refused(profile, qos, tenant, n):
    return [pol.Refusal(f"2026-12-07T10:0{i}:00", profile, tenant, qos, "capacity") for i in range(n)]


def _held(gpu, profile, tenant, qos, use, i):
    return Allocation(f"dev{i}", f"dom{i}", tenant, gpu, "vgpu", profile, 12288, 0, qos,
                      use=ExpectedUse(use, TENANT_PROFILE, 3600.0))


def test_an_empty_gpu_both_pools_want_goes_where_it_admits_more_starts():
    # desk: 1 GPU full of desktops (0.15 each); compute: 1 busy (a 0.7 job), 1 empty; both refused starts
    pools, gpus = _host(GPUS[:1], GPUS[1:3], busy=GPUS[:2])
    held = [_held(GPUS[0], "A40-1B", "office", "burstable", 0.15, i) for i in range(6)] + \
        [_held(GPUS[1], "A40-12C", "hpc", "best-effort", 0.7, 9)]
    refusals = _refused("A40-1B", "burstable", "office", 3) + _refused("A40-12C", "best-effort", "hpc", 1)
    d = pol.decide(**_args(pools, gpus, refusals=refusals, held=held))
    [m] = d.moves
    assert (m.gpu, m.from_pool, m.to_pool) == (GPUS[2], "compute", "desk")    # 6 desktops a GPU against 1 job
    # the other way round: the desktops' GPU is not given to one compute job
    pools, gpus = _host(GPUS[:2], GPUS[2:3], busy=(GPUS[0], GPUS[2]))
    held = [_held(GPUS[0], "A40-1B", "office", "burstable", 0.15, i) for i in range(6)] + \
        [_held(GPUS[2], "A40-12C", "hpc", "best-effort", 0.7, 9)]
    d = pol.decide(**_args(pools, gpus, refusals=refusals, held=held))
    assert not d.moves
    # compute's own demand forecast to rise: it keeps its empty GPU even for more starts elsewhere
    pools, gpus = _host(GPUS[:1], GPUS[1:3], busy=GPUS[:2])
    held = [_held(GPUS[0], "A40-1B", "office", "burstable", 0.15, i) for i in range(6)] + \
        [_held(GPUS[1], "A40-12C", "hpc", "best-effort", 0.7, 9)]
    rising = RISE
    d = pol.decide(**_args(pools, gpus, refusals=refusals, held=held, history={"compute": rising}))
    assert not d.moves


def test_facts_read_each_pools_hourly_demand_from_the_rollups_by_class(tmp_path):
    s = StateStore(str(tmp_path))
    now = time.time()
    end = int(now // 3600) * 3600

    def row(back_h, dev, qos, alloc):
        hour = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(end - back_h * 3600))
        return UsageRow(hour, dev, "dom-" + dev, "vgpu", "0000:41:00.0", "A40-1B", "", "t", qos, alloc,
                        0, 0, 0, 0, 0, 1)
    with s.transaction() as conn:
        st.add_usage(conn, [row(1, "a", "burstable", 3600.0), row(1, "b", "burstable", 1800.0),
                            row(24, "c", "best-effort", 3600.0), row(2, "d", "", 900.0),
                            row(24 * 9, "e", "burstable", 3600.0)])        # older than the history read
    got = rebalance.class_history(s, now, pol.Bounds(history_days=1))
    assert len(got["burstable"]) == 48 and got["burstable"][-1] == 1.5 and sum(got["burstable"]) == 1.5
    assert got["best-effort"][-24] == 1.0 and got["best-effort"][-2] == 0.25
    assert rebalance.class_history(s, now, pol.Bounds(horizon_h=0)) == {}
    pools = [Pool("desk", "equal-share", ("burstable",), ("0000:41:00.0",)),
             Pool("mixed", "equal-share", ("burstable", "best-effort"), ("0000:42:00.0",))]
    hist = pol.pool_history(got, pools, ["desk", "mixed"])
    assert hist["desk"][-1] == 0.75 and hist["mixed"][-1] == 0.75 and hist["mixed"][-24] == 1.0


def forecast_host(make_host, capsys):
    """Pool gold (fixed share, serves guaranteed) on GPU_LO, full with tenant g's A40-48Q, no start
    refused; pool batch on the L40S; GPU_HI empty in the default pool (equal share running); the
    rollups say the guaranteed class held 1 vGPU in this hour yesterday, 2 in the next, 4 in the next."""
    from test_hook import GPU_LO
    from test_rebalance import gold_one

    host, s = gold_one(make_host, capsys, l40s_policy=False)
    end = int(time.time() // 3600) * 3600

    def row(back_h, dev):
        hour = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(end - back_h * 3600))
        return UsageRow(hour, dev, "dom-" + dev, "vgpu", str(GPU_LO), "A40-48Q", "", "g", "guaranteed", 3600.0,
                        0, 0, 0, 0, 0, 1)
    with s.transaction() as conn:       # yesterday: 1 vGPU in this hour, 2 in the next, 4 in the one after
        st.add_usage(conn, [row(24, "a"), row(23, "a"), row(23, "b")] + [row(22, d) for d in "abcd"])
    return host                         # (so the forecast is 2x should the hour turn before the test runs)


def test_rebalance_moves_a_gpu_ahead_of_a_forecast_rise_through_the_executor(make_host, capsys):
    """On a simulated host: pool gold (fixed share) full, no start refused; yesterday the guaranteed
    class's demand doubled in the hour after this one.  ``vgpuhost rebalance`` moves the empty GPU of
    the default pool to gold before any start is refused: the scheduler set (NVML), the pool recorded,
    an audit row naming the forecast, the journal entry closed."""
    import json

    from test_hook import GPU_HI
    from test_rebalance import policy_of, pool_map, run

    host = forecast_host(make_host, capsys)
    s = StateStore(host.state_dir)
    code, out, err = run(capsys, host, "rebalance", "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    [m] = doc["moves"]
    assert (m["gpu"], m["from_pool"], m["to_pool"]) == (str(GPU_HI), "default", "gold")
    assert pool_map(s).get(str(GPU_HI)) is None                           # the dry run changed nothing
    code, out, err = run(capsys, host, "rebalance")
    assert code == 0, err
    assert pool_map(s)[str(GPU_HI)] == "gold" and policy_of(host, GPU_HI) == "fixed-share"
    [audit] = [r for r in s.audit_rows() if r.path == "(pools)" and r.operation.startswith("rebalance move")]
    assert "pool gold is forecast to need 2.0 GPU(s) in 1 h (the same hours of the last 1 day(s); 1.0 now)" \
        in audit.value, audit.value
    assert [e.state for e in s.journal_entries() if e.kind == "rebalance"] == ["closed"]


def test_the_forecast_settings_are_read_and_checked():
    b = pol.parse_bounds({"version": 1, "horizon_h": 2, "history_days": 3})
    assert (b.horizon_h, b.history_days) == (2, 3) and b.as_dict()["horizon_h"] == 2
    assert (pol.Bounds().horizon_h, pol.Bounds().history_days) == (1, 7)
    for doc, words in (({"horizon_h": 13}, "horizon_h must be a whole number from 0 to 12, not 13"),
                       ({"history_days": -1}, "history_days must be a whole number from 0 to 28, not -1")):
        with pytest.raises(InputError) as e:
            pol.parse_bounds(doc, "rebalance.yaml")
        assert f"rebalance.yaml: {words}" in str(e.value)
