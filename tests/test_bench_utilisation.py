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
    assert e.share == pytest.approx(0.3) and e.source == TENANT_PROFILE
    assert est.estimate("ci", "A40-8Q") is None


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
