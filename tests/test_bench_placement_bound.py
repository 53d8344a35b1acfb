"""bench/placement.py's class-aware bounds are upper bounds, and the tight one is no looser.

On small random traces the integer program's optimum is found by brute force (every subset of
requests, checked with ``class_fits``) or, for larger ones, by the plain MILP solved to optimality.
The tight bound must be at least that optimum and at most the plain LP bound; the schedule it
reports must keep the constraint; and its LP certificate must bound any LP it is handed duals for.
Needs scipy (a test dependency; the bench itself treats it as optional)."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

np = pytest.importorskip("numpy")
pytest.importorskip("scipy")

REPO = Path(__file__).resolve().parents[1]


def _bench():
    name = "bench_placement_for_tests"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / "placement.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


bp = _bench()
FB, TYPES, _SIM = bp.board()
PROFILES = [p for p, _ in bp.MIX]


def _trace(items):
    """Requests from (profile index, arrival, duration) triples; integer times, so ties happen."""
    return [bp.Req(i, PROFILES[p], f"vm{i}", float(a), float(a + d)) for i, (p, a, d) in enumerate(items)]


def _brute_optimum(reqs, gpus):
    for size in range(len(reqs), -1, -1):
        for chosen in itertools.combinations([r.n for r in reqs], size):
            if bp.class_fits(reqs, chosen, gpus, FB, TYPES):
                return size
    raise AssertionError("the empty schedule always fits")


def _per_arrival_need(reqs, chosen):
    """Direct reading of the definition, for class_fits: at each chosen arrival, the chosen
    requests arrived by then (ties: earlier in the list) and not yet gone (a release at the same
    instant comes first), summed per class as ceil(count / max per GPU)."""
    chosen = set(chosen)
    needs = []
    for k, a in enumerate(reqs):
        if a.n not in chosen:
            continue
        count = {}
        for j, r in enumerate(reqs):
            if r.n in chosen and (r.arrive < a.arrive or (r.arrive == a.arrive and j <= k)) and r.depart > a.arrive:
                size = TYPES[r.profile].fb_mib
                count[size] = count.get(size, 0) + 1
        needs.append(sum(math.ceil(c / (FB // s)) for s, c in count.items()))
    return needs


small_traces = st.lists(st.tuples(st.integers(0, len(PROFILES) - 1), st.integers(0, 12), st.integers(1, 8)),
                        min_size=1, max_size=9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_traces, st.integers(1, 3))
def test_class_fits_reads_the_definition(items, gpus):
    reqs = _trace(items)
    for size in range(len(reqs) + 1):
        for chosen in itertools.islice(itertools.combinations([r.n for r in reqs], size), 20):
            assert bp.class_fits(reqs, chosen, gpus, FB, TYPES) == all(
                n <= gpus for n in _per_arrival_need(reqs, chosen))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_traces, st.integers(1, 3))
def test_tight_bound_brackets_the_brute_force_optimum(items, gpus):
    reqs = _trace(items)
    optimum = _brute_optimum(reqs, gpus)
    tight = bp.tight_class_bound(reqs, gpus, FB, TYPES, time_limit=30)
    assert tight is not None
    assert optimum <= tight.bound <= tight.lp + 1e-6
    assert tight.bound <= math.floor(bp.lp_upper_bound(reqs, gpus, FB, TYPES) + 1e-6)
    assert tight.best <= optimum
    if tight.optimal:
        assert tight.best == tight.bound == optimum
    plain = bp.class_upper_bound(reqs, gpus, FB, TYPES, time_limit=30)
    assert plain is not None and math.floor(plain[0] + 1e-6) >= optimum


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tight_bound_on_short_bench_traces(seed):
    """60 requests of the bench's own trace on 2 GPUs: the plain MILP, run to the end, gives the
    optimum; the tight bound's certified LP bound is at least it and at most the LP bound, and its
    branch and bound finds the same optimum."""
    reqs, _, _ = bp.make_trace(seed, 60, 2, 1.0, FB, TYPES)
    plain = bp.class_upper_bound(reqs, 2, FB, TYPES, time_limit=120)
    assert plain is not None and plain[1] is not None
    optimum = round(plain[1])
    assert math.floor(plain[0] + 1e-6) == optimum, "the plain MILP must finish on 60 requests"
    tight = bp.tight_class_bound(reqs, 2, FB, TYPES, time_limit=120)
    assert optimum <= tight.lp + 1e-6
    assert tight.lp <= bp.lp_upper_bound(reqs, 2, FB, TYPES) + 1e-6
    assert tight.optimal and tight.bound == tight.best == optimum


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_dual_certificate_bounds_the_lp_for_any_multipliers(seed):
    """Weak duality: whatever w >= 0 it is handed, the certificate is at least the LP's optimum."""
    from scipy.optimize import linprog
    from scipy.sparse import csr_matrix
    rng = np.random.default_rng(seed)
    rows, cols = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    a = rng.integers(-2, 4, size=(rows, cols)).astype(float)
    b = rng.integers(0, 6, size=rows).astype(float)
    c = rng.integers(-1, 3, size=cols).astype(float)
    u = rng.integers(1, 4, size=cols).astype(float)
    res = linprog(-c, A_ub=a, b_ub=b, bounds=np.c_[np.zeros(cols), u], method="highs")
    assert res.status == 0                       # x = 0 is feasible, and the box bounds it
    matrix = csr_matrix(a)
    exact = bp.dual_certificate(matrix, b, u, c, -res.ineqlin.marginals)
    assert exact == pytest.approx(-res.fun, abs=1e-6)
    for _ in range(5):
        w = rng.uniform(-1, 3, size=rows)
        assert bp.dual_certificate(matrix, b, u, c, w) >= -res.fun - 1e-9


def test_every_strategy_keeps_the_constraint_and_stays_under_the_bounds():
    """The constraint holds for real placements: each strategy's admissions on a bench trace (4 GPUs,
    300 requests) keep it, and none admits more than the tight bound or the plain one; nor does the
    tight bound's own schedule beat the plain bound."""
    reqs, events, _ = bp.make_trace(7, 300, 4, 1.0, FB, TYPES)
    tight = bp.tight_class_bound(reqs, 4, FB, TYPES, time_limit=20)
    plain = bp.class_upper_bound(reqs, 4, FB, TYPES, time_limit=20)
    assert tight is not None and plain is not None
    assert 0 < tight.best <= math.floor(plain[0] + 1e-6)      # a schedule never beats a valid bound
    for strategy in bp.STRATEGIES:
        decided = bp.replay_model(strategy, reqs, events, 4, FB, TYPES, _SIM)
        admitted = [n for n, d in decided.items() if d.admitted]
        assert bp.class_fits(reqs, admitted, 4, FB, TYPES), strategy
        assert len(admitted) <= min(tight.bound, math.floor(plain[0] + 1e-6)), strategy


def test_repack_at_restart_is_the_strategy_without_restarts_and_stays_under_the_bound():
    """``--restarts``: with no restart the replay admits what the strategy admits; with restarts it
    places each restarting vGPU again (best-fit never loses one: its own slot was freed) and admits no
    more than the tight class-aware bound."""
    reqs, events, _ = bp.make_trace(7, 300, 4, 1.0, FB, TYPES)
    tight = bp.tight_class_bound(reqs, 4, FB, TYPES, time_limit=20)
    for strategy in bp.RESTART_RULES:
        plain = sum(1 for d in bp.replay_model(strategy, reqs, events, 4, FB, TYPES, _SIM).values() if d.admitted)
        assert bp.replay_restarting(strategy, reqs, events, 4, FB, TYPES, _SIM, 0.0, 7) == plain
        got = bp.replay_restarting(strategy, reqs, events, 4, FB, TYPES, _SIM, 3.0, 7)
        assert 0 < got <= tight.bound, strategy


def _hand_trace(*rows):
    """Requests (profile, owner, arrive, depart) and their events, as make_trace builds them."""
    reqs = [bp.Req(i, p, o, a, d) for i, (p, o, a, d) in enumerate(rows)]
    return reqs, sorted([(r.arrive, 1, r.n) for r in reqs] + [(r.depart, 0, r.n) for r in reqs])


def test_restart_replay_names_each_refusal_cause():
    """``replay_restarting(causes=)`` files each refusal under its cause, on hand-built traces."""
    a, b, c = "vm-a", "vm-b", "vm-c"
    cases = [   # (strategy, GPUs, requests, owners enforced, the causes counted, admitted)
        # the VM's second A40-4Q may not join its first: owner rule
        ("best-fit", 1, [("A40-4Q", a, 0, 10), ("A40-4Q", a, 1, 10)], True, {"owner": 1}, 1),
        ("best-fit", 1, [("A40-4Q", a, 0, 10), ("A40-4Q", a, 1, 10)], False, {}, 2),
        # the owner rule spread two A40-4Q over both GPUs; repacked, one GPU would hold them: fragmented
        ("best-fit", 2, [("A40-4Q", a, 0, 10), ("A40-4Q", a, 1, 10), ("A40-8Q", c, 2, 10)], True,
         {"fragmented": 1}, 2),
        # three sizes on two GPUs: full, repacked too
        ("best-fit", 2, [("A40-24Q", a, 0, 10), ("A40-16Q", b, 1, 10), ("A40-8Q", c, 2, 10)], True,
         {"full": 1}, 2),
        # headroom keeps the empty GPU: 24 + 48 GB would be 75% of 96 GB, over the 70% for a whole-GPU type
        ("headroom", 2, [("A40-24Q", a, 0, 10), ("A40-48Q", b, 1, 10)], True, {"rule": 1}, 1),
        ("best-fit", 2, [("A40-24Q", a, 0, 10), ("A40-48Q", b, 1, 10)], True, {}, 2),
    ]
    for strategy, gpus, rows, owners, want, admitted in cases:
        reqs, events = _hand_trace(*rows)
        causes = {}
        got = bp.replay_restarting(strategy, reqs, events, gpus, FB, TYPES, _SIM, 0.0, 1, owners=owners,
                                   causes=causes)
        assert (got, causes) == (admitted, want), (strategy, gpus, rows, owners)


def test_restart_replay_causes_account_for_every_request():
    """On a bench trace with restarts, every request is admitted, refused at its arrival for one
    cause, or ended by a refused restart; without the owner rule none is refused for it; without
    restarts the refusals are replay_model's and none ends."""
    reqs, events, _ = bp.make_trace(3, 400, 4, 1.0, FB, TYPES)
    for strategy in bp.RESTART_RULES:
        for restarts, owners in ((0.0, True), (4.0, True), (4.0, False)):
            causes = {}
            got = bp.replay_restarting(strategy, reqs, events, 4, FB, TYPES, _SIM, restarts, 3, owners=owners,
                                       causes=causes)
            refused = sum(causes.get(k, 0) for k in bp.RESTART_CAUSES)
            assert got == len(reqs) - refused - causes.get("ended", 0), (strategy, restarts, owners)
            assert set(causes) <= set(bp.RESTART_CAUSES) | {"ended"}
            if not owners:
                assert causes.get("owner", 0) == 0
            if strategy == "best-fit":
                assert causes.get("rule", 0) == 0 and causes.get("ended", 0) == 0
            if restarts == 0 and owners:
                plain = bp.replay_model(strategy, reqs, events, 4, FB, TYPES, _SIM)
                assert refused == sum(1 for d in plain.values() if not d.admitted)
                assert causes.get("ended", 0) == 0
