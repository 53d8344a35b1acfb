"""bench/placement_mdp.py solves the host's Markov decision process correctly.

Checks against results that do not come from the script: Erlang's loss formula for one size class
(one GPU of m vGPUs, and G GPUs of a whole-GPU class), the classical fact that admission control
cannot help a one-class loss system, the state count of a multiset, and bench/placement.py's own
lifetime rule.  On the bench's mix at G = 2 and 3, the optimum must be at least best-fit and
``headroom`` (evaluated exactly), and the policy read off the optimal values must reproduce it.
The trace replay (``--traces``) must admit as the loss system does for one whole-GPU size, and
honour one vGPU per VM per GPU."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-10


def _load(name: str, file: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


mdp = _load("bench_placement_mdp_for_tests", "placement_mdp.py")


def erlang_b(servers: int, load: float) -> float:
    """Erlang B from its closed form, a^m/m! / sum_k a^k/k! (independent of the script's recursion)."""
    terms = [load ** k / math.factorial(k) for k in range(servers + 1)]
    return terms[-1] / sum(terms)


def gain(model, policy=None):
    _, lo, hi, _ = model.solve(policy, tol=TOL)
    assert hi - lo < TOL
    return (lo + hi) / 2


@pytest.mark.parametrize("per_gpu,life", [(1, 0.7), (6, 4.0), (12, 9.5)])
def test_one_gpu_one_class_best_fit_is_erlang_b(per_gpu, life):
    m = mdp.HostMdp([48 * 1024 // per_gpu], [1.0], gpus=1, mean_life=life, fb_mib=48 * 1024,
                    maxes=[per_gpu], headroom={})
    assert m.n == per_gpu + 1
    assert gain(m, m.best_fit()) == pytest.approx(1 - erlang_b(per_gpu, life), abs=1e-8)


@pytest.mark.parametrize("gpus,life", [(2, 1.5), (4, 3.0), (5, 6.0)])
def test_whole_gpu_class_on_g_gpus_is_erlang_b_with_g_servers(gpus, life):
    m = mdp.HostMdp([48 * 1024], [1.0], gpus=gpus, mean_life=life, fb_mib=48 * 1024, headroom={})
    assert m.n == gpus + 1
    assert gain(m, m.best_fit()) == pytest.approx(1 - erlang_b(gpus, life), abs=1e-8)


@pytest.mark.parametrize("gpus,per_gpu,life", [(2, 4, 5.0), (3, 3, 7.0), (2, 6, 14.0)])
def test_one_class_admission_control_cannot_help(gpus, per_gpu, life):
    """One class: a request fits while fewer than G x m are active, wherever they sit, and refusing
    never pays; so the optimum is best-fit's, the Erlang loss of G x m servers."""
    m = mdp.HostMdp([48 * 1024 // per_gpu], [1.0], gpus=gpus, mean_life=life, fb_mib=48 * 1024,
                    maxes=[per_gpu], headroom={})
    assert m.n == math.comb(per_gpu + gpus, gpus)          # multisets of G out of m + 1 GPU states
    erlang = 1 - erlang_b(gpus * per_gpu, life)
    assert gain(m) == pytest.approx(erlang, abs=1e-8)
    assert gain(m, m.best_fit()) == pytest.approx(erlang, abs=1e-8)


def test_two_classes_admission_control_helps_and_headroom_takes_effect():
    """Two classes, the large one worth the same per admission: the optimum beats best-fit, and a
    headroom rule on the whole-GPU class changes the admitted fraction."""
    m = mdp.HostMdp([12 * 1024, 48 * 1024], [0.8, 0.2], gpus=2, mean_life=6.0, fb_mib=48 * 1024,
                    headroom={1: 0.5})
    opt, bf, hr = gain(m), gain(m, m.best_fit()), gain(m, m.best_fit(headroom=True))
    assert opt > bf + 1e-4
    assert opt >= hr - 1e-9
    assert abs(hr - bf) > 1e-4


def test_bench_model_reads_the_bench_mix_and_lifetime():
    bp = mdp._bench_placement()
    fb, types, _ = bp.board()
    m, labels = mdp.bench_model(3, 1.0)
    assert labels == ["4 GB", "8 GB", "12 GB", "16 GB", "24 GB", "48 GB"]
    assert m.probs == pytest.approx([0.25, 0.35, 0.10, 0.15, 0.10, 0.05])
    assert m.maxes == [12, 6, 4, 3, 2, 1]
    assert m.n == math.comb(29 + 3 - 1, 3)                  # 28 (class, count) pairs + empty, G = 3
    assert m.mean_life == pytest.approx(bp.make_trace(1, 5, 3, 1.0, fb, types)[2])


@pytest.mark.parametrize("gpus", [2, 3])
def test_bench_mix_optimum_dominates_and_is_reproduced(gpus):
    m, _ = mdp.bench_model(gpus, 1.0)
    h, lo, hi, _ = m.solve(tol=1e-9)
    _, bf_lo, bf_hi, _ = m.solve(m.best_fit(), tol=1e-9)
    _, hr_lo, hr_hi, _ = m.solve(m.best_fit(headroom=True), tol=1e-9)
    assert lo >= bf_hi and lo >= hr_hi                       # brackets: the optimum is at least both
    assert lo > bf_hi + 0.01                                 # and strictly better on this mix
    greedy = m.greedy(h)
    _, g_lo, g_hi, _ = m.solve(greedy, tol=1e-9)
    assert g_lo <= hi + 1e-9 and g_hi >= lo - 1e-9           # the read-off policy reaches the optimum
    # it never places elsewhere than best-fit; it only refuses
    bf = m.best_fit()
    assert all(np.all((greedy[c] < 0) | (greedy[c] == bf[c])) for c in range(m.n_cls))


def test_trace_replay_of_one_whole_gpu_class_is_the_loss_system():
    """One whole-GPU size, every request its own VM: the optimal policy admits whatever fits, so the
    replay admits a request exactly when fewer than G are active (counted here on the events)."""
    bp = mdp._bench_placement()
    m = mdp.HostMdp([48 * 1024], [1.0], gpus=2, mean_life=2.0, fb_mib=48 * 1024, maxes=[1], headroom={})
    h, _, _, _ = m.solve(tol=TOL)
    rng = np.random.default_rng(7)
    arrive = np.cumsum(rng.exponential(1.0, 300))
    reqs = [bp.Req(i, "A40-48Q", f"vm{i}", float(a), float(a + rng.exponential(2.0))) for i, a in enumerate(arrive)]
    events = sorted([(r.arrive, 1, r.n) for r in reqs] + [(r.depart, 0, r.n) for r in reqs])
    active, want = set(), 0
    for _, kind, n in events:
        if kind == 0:
            active.discard(n)
        elif len(active) < 2:
            active.add(n)
            want += 1
    assert 0 < want < len(reqs)
    assert mdp.replay_trace(m, h, reqs, events, {"A40-48Q": 0}) == want


def test_trace_replay_honours_owners():
    """Two vGPUs of one VM never share a GPU: with one GPU, a VM's second concurrent request is refused."""
    bp = mdp._bench_placement()
    m = mdp.HostMdp([4 * 1024], [1.0], gpus=1, mean_life=5.0, fb_mib=48 * 1024, maxes=[12], headroom={})
    h, _, _, _ = m.solve(tol=TOL)
    reqs = [bp.Req(0, "A40-4Q", "a", 1.0, 10.0), bp.Req(1, "A40-4Q", "a", 2.0, 11.0),
            bp.Req(2, "A40-4Q", "b", 3.0, 12.0), bp.Req(3, "A40-4Q", "a", 10.5, 13.0)]
    events = sorted([(r.arrive, 1, r.n) for r in reqs] + [(r.depart, 0, r.n) for r in reqs])
    assert mdp.replay_trace(m, h, reqs, events, {"A40-4Q": 0}) == 3
