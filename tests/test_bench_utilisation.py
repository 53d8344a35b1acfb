"""bench/utilisation.py tells the truth about itself (issue 30, item 6): the trace's own ceiling, the
starved demand of each replay, the steady window beside the whole span, and a compute-aware replay whose
use is estimated from VMs that ran before, never read from the trace for the VM placed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import utilisation as bench  # noqa: E402

from vgpuhost.model.gputime import TENANT_PROFILE  # noqa: E402


@pytest.fixture(scope="module")
def doc():
    return bench.run(13, 300)


def test_the_trace_ceiling_bounds_every_replay(doc):
    tc = doc["trace_ceiling"]
    assert 0 < tc["capped"] <= tc["demand"] and 0 < tc["capped_steady"] <= tc["demand_steady"]
    for key in ("hoarding", "vgpuhost", "compute_aware"):
        r = doc[key]
        assert r["violations"] == 0
        # what is served and what is starved add up to the demand admitted, which the ceiling bounds
        assert r["time_share"] + r["starved_share"] == pytest.approx(r["demand_share"])
        assert r["demand_share"] <= tc["demand"] + 1e-9
    assert doc["hoarding"]["starved_share"] == 0


def test_compute_aware_placement_starves_less_than_framebuffer_placement(doc):
    assert doc["compute_aware"]["starved_share"] < doc["vgpuhost"]["starved_share"]
    assert doc["compute_aware"]["refusals"].get("gpu-time", 0) > 0
    assert "gpu-time" not in doc["vgpuhost"]["refusals"]
    lo, hi = doc["steady_window"]
    assert bench.WARMUP_LIVES * bench.MEAN_LIFE == lo < hi


def test_the_estimate_is_learnt_from_vms_that_ran_never_the_vms_own():
    est = bench.Estimator()
    assert est.estimate("research", "A40-8Q") is None            # nothing ran yet: the fixed share
    est.learn("research", "A40-8Q", 0.2)
    est.learn("research", "A40-8Q", 0.4)
    e = est.estimate("research", "A40-8Q")
    # weighted by each VM's busy time, as on a host: (0.2 x 0.2 + 0.4 x 0.4) / (0.2 + 0.4)
    assert e.share == pytest.approx(1 / 3) and e.source == TENANT_PROFILE
    assert est.estimate("ci", "A40-8Q") is None
    for _ in range(10):                     # idle VMs weigh nothing (trial 10a finding 11)
        est.learn("research", "A40-8Q", 0.0)
    assert est.estimate("research", "A40-8Q").share == pytest.approx(1 / 3)


def test_the_reconciler_replay_moves_empty_gpus_and_breaks_nothing(doc):
    r = doc["reconciler"]
    assert r["violations"] == 0                                   # quota, isolation, QoS class, scheduler rules
    assert r["refusals"]["moves"] > 0                             # pools did resize to demand
    assert r["time_share"] + r["starved_share"] == pytest.approx(r["demand_share"])


def test_a_reconciler_pass_never_moves_a_gpu_that_holds_a_device():
    from vgpuhost.policy.demand import Allocation
    from vgpuhost.policy.rebalance import Refusal
    from vgpuhost.policy.replay import HostModel
    model = HostModel(bench.GPUS, bench.pools())
    batch = next(p for p in model.pools if p.name == "batch")
    held = batch.gpus[0]
    model.allocations.append(Allocation("d0", "vm0", "ci", held, "vgpu", "A40-4C", 4096, 0, "best-effort"))
    gold = next(p for p in model.pools if p.name == "gold")
    for i, g in enumerate(gold.gpus):          # gold full: no room for the refused starts but a move
        model.allocations.append(Allocation(f"p{i}", f"vmp{i}", "prod", g, "vgpu", "A40-48Q", 49152, 0,
                                            "guaranteed"))
    refused = [Refusal("0", "A40-8Q", "prod", "guaranteed", "capacity")] * 3
    moves = bench.reconcile(model, bench.tenants(), refused, bench._host_gpus(model))
    assert moves and held not in {m.gpu for m in moves}
    assert all(m.to_pool == "gold" for m in moves)
    gold = next(p for p in model.pools if p.name == "gold")
    assert {m.gpu for m in moves} <= set(gold.gpus)              # the model's pools were replaced


def test_replay_f_keeps_the_rules_and_a_mixed_size_gpu_joins_gold_only_with_the_mode_switch(doc):
    """(f), mixed-size + compute-aware + reconciler: 0 violations; a GPU in mixed-size mode never moves to
    the fixed-share gold (the product's rule: mixed-size mode has no fixed share), unless the experiment's
    mode switch, which makes each moved GPU take its new pool's mode."""
    from vgpuhost.policy.demand import Allocation
    from vgpuhost.policy.rebalance import Refusal
    from vgpuhost.policy.replay import HostModel
    r = doc["all"]
    assert r["violations"] == 0 and "moves" in r["refusals"]
    assert r["time_share"] + r["starved_share"] == pytest.approx(r["demand_share"])
    for switch in (False, True):
        ps = bench.pools()
        mixed = [g for p in ps if p.policy != "fixed-share" for g in p.gpus]
        model = HostModel(bench.GPUS, ps, mixed)
        gold = next(p for p in model.pools if p.name == "gold")
        for i, g in enumerate(gold.gpus):      # gold full: its refused starts need a move
            model.allocations.append(Allocation(f"p{i}", f"vmp{i}", "prod", g, "vgpu", "A40-48Q", 49152, 0,
                                                "guaranteed"))
        refused = [Refusal("0", "A40-8Q", "prod", "guaranteed", "capacity")] * 3
        moves = bench.reconcile(model, bench.tenants(), refused, bench._host_gpus(model), switch=switch)
        to_gold = {m.gpu for m in moves if m.to_pool == "gold"}
        if not switch:
            assert to_gold == set() and model.mixed == frozenset(mixed)
        else:
            assert to_gold and not (to_gold & model.mixed) and model.mixed == frozenset(mixed) - to_gold


@pytest.fixture(scope="module")
def diurnal():
    saved = bench.STATIC_SPLITS
    bench.STATIC_SPLITS = (4, 8, 12)          # a tiny search: the test checks the bench's rules, not its figures
    try:
        return bench.run_diurnal(13, 240, timeline=[])
    finally:
        bench.STATIC_SPLITS = saved


def test_the_diurnal_trace_shifts_desktops_by_day_and_compute_by_night():
    events, vms = bench.diurnal_trace(5, 600)
    day = [vms[vm][0] for t, k, vm in events if k == "arrive" and abs((t % bench.DAY) - bench.DAY / 2) < 30]
    night = [vms[vm][0] for t, k, vm in events if k == "arrive" and min(t % bench.DAY, bench.DAY - t % bench.DAY) < 30]
    assert day.count(bench.DESK) > 3 * day.count(bench.COMPUTE)
    assert night.count(bench.COMPUTE) > night.count(bench.DESK)
    desk = {vms[vm][1].split("-")[1][-1] for vm in vms if vms[vm][0] == bench.DESK}
    comp = {vms[vm][1].split("-")[1][-1] for vm in vms if vms[vm][0] == bench.COMPUTE}
    assert desk == {"B", "Q"} and comp == {"C"}


def test_the_diurnal_replays_keep_the_rules_and_the_best_static_split_is_the_best_tried(diurnal):
    d = diurnal
    assert [k for k, _ in d["replays"]] == ["hoarding", "even_pools", "best_static", "reconciler", "shared_pool"]
    for k, _ in d["replays"]:
        assert d[k]["violations"] == 0
        assert d[k]["time_share"] + d[k]["starved_share"] == pytest.approx(d[k]["demand_share"])
    assert d["best_static"]["admitted_share"] >= d["even_pools"]["admitted_share"]
    assert d["best_static"]["desk_gpus"] in (3, 4, 5, 7, 8, 9, 11, 12, 13)
    assert d["reconciler"]["refusals"]["moves"] > 0
    assert d["reconciler_over_best_static"] == pytest.approx(
        d["reconciler"]["admitted_share"] / d["best_static"]["admitted_share"] - 1)
    assert d["shared_over_best_static"] == pytest.approx(
        d["shared_pool"]["admitted_share"] / d["best_static"]["admitted_share"] - 1)
    assert "moves" not in d["shared_pool"]["refusals"]


def test_in_one_shared_pool_desktops_fill_the_gpu_time_a_compute_vm_leaves():
    """(o): a compute VM and desktops share one GPU while their expected GPU time fits under the ceiling
    of 1.0, and the next desktop past it is refused for GPU time; split pools keep the desktop off the
    compute GPU whatever its GPU time."""
    from vgpuhost.model.gputime import ExpectedUse
    from vgpuhost.model.values import replace
    from vgpuhost.policy import admission as adm
    from vgpuhost.policy.replay import HostModel
    gpu = sorted(bench.GPUS)[0]
    one = {gpu: bench.GPUS[gpu]}
    ts = bench.diurnal_tenants()

    def ask(model, vm, tenant, profile, share):
        dem = replace(adm.vgpu_demand(profile), use=ExpectedUse(share, TENANT_PROFILE))
        return model.arrive(vm, dem, ts, tenant=tenant)

    shared = HostModel(one, [adm.Pool("shared", "equal-share", ("burstable", "best-effort"), (gpu,))], [gpu])
    assert ask(shared, "c", bench.COMPUTE, "A40-24C", 0.65).admitted
    assert [ask(shared, f"d{i}", bench.DESK, "A40-2B", 0.15).admitted for i in range(3)] == [True, True, False]
    assert {a.gpu for a in shared.allocations} == {gpu} and len(shared.allocations) == 3
    assert bench.violations(shared, ts) == []
    split = HostModel(one, [adm.Pool("compute", "best-effort", ("best-effort",), (gpu,))], [gpu])
    assert ask(split, "c", bench.COMPUTE, "A40-24C", 0.65).admitted
    assert not ask(split, "d0", bench.DESK, "A40-2B", 0.15).admitted


def test_two_pools_keep_gold_and_merge_std_and_batch():
    three, two = bench.pools(), bench.pools("two")
    assert [p.name for p in two] == ["gold", "std"] and two[0] == three[0]
    assert sorted(two[1].gpus) == sorted(three[1].gpus + three[2].gpus)
    assert set(two[1].classes) == {"burstable", "best-effort"} and two[1].policy == "equal-share"


def test_the_plot_is_written_or_skipped_with_a_line(tmp_path):
    out = tmp_path / "d.png"
    line = bench.plot_diurnal(13, 160, str(out))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert line.startswith("plot skipped: matplotlib is not installed") and not out.exists()
    else:
        assert line == f"plot: {out}" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_pool_bound_takes_the_best_split_at_every_moment():
    """The diurnal pool bound: desktops packed whole, each compute VM alone on a GPU, the best split."""
    n = len(bench.GPUS)
    vms = {"d1": (bench.DESK, "A40-1B", "A40", 0.5), "c1": (bench.COMPUTE, "A40-12C", "A40", 0.8),
           "c2": (bench.COMPUTE, "A40-12C", "A40", 0.6)}
    events = [(0.0, "arrive", v) for v in vms] + [(10.0, "depart", v) for v in vms]
    got = bench.pools_bound(events, vms, (0.0, 10.0))
    assert got["time_share"] == pytest.approx(1.9 / n) and got["time_share_steady"] == pytest.approx(1.9 / n)
    # more compute VMs than GPUs and desktops asking 10 GPUs: the best split serves all 16 GPUs
    vms = {f"c{i}": (bench.COMPUTE, "A40-12C", "A40", 0.9) for i in range(20)}
    vms["d"] = (bench.DESK, "A40-1B", "A40", 10.0)
    events = [(0.0, "arrive", v) for v in vms] + [(4.0, "depart", v) for v in vms]
    got = bench.pools_bound(events, vms, (0.0, 4.0))
    assert got["time_share"] == pytest.approx((10.0 + 6 * 0.9) / n)


def test_the_shared_bound_keeps_large_vms_apart_and_48c_alone():
    """The shared-pool bound: a VM over half a GPU takes a GPU alone (its leftover filled by small VMs),
    a 48C takes a whole GPU, and nothing is served past the fleet."""
    n = len(bench.GPUS)
    vms = {"w": (bench.COMPUTE, "A40-48C", "A40", 0.7), "l1": (bench.COMPUTE, "A40-24C", "A40", 0.8),
           "l2": (bench.COMPUTE, "A40-12C", "A40", 0.6), "s": (bench.DESK, "A40-1B", "A40", 0.1)}
    events = [(0.0, "arrive", v) for v in vms] + [(10.0, "depart", v) for v in vms]
    got = bench.shared_bound(events, vms, (0.0, 10.0))
    assert got["time_share"] == pytest.approx(2.2 / n) and got["time_share_steady"] == pytest.approx(2.2 / n)
    # 20 large VMs on 16 GPUs: 16 served alone, the 4 others not at all; 24 small ones fill the leftovers
    vms = {f"l{i}": (bench.COMPUTE, "A40-24C", "A40", 0.6) for i in range(20)}
    vms.update({f"s{i}": (bench.DESK, "A40-1B", "A40", 0.25) for i in range(24)})
    events = [(0.0, "arrive", v) for v in vms] + [(4.0, "depart", v) for v in vms]
    got = bench.shared_bound(events, vms, (0.0, 4.0))
    assert got["time_share"] == pytest.approx(min(16 * 0.6 + 24 * 0.25, n) / n)
