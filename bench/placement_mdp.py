#!/usr/bin/env python3
"""Benchmark: the best long-run admission rate any online placement can reach on a small host, exactly.

``bench/placement.py`` compares placement strategies with upper bounds that
hold even for offline placement with migration; the gap between them mixes
what a better online rule could gain with what no online rule can.  This
script measures the first part exactly, on hosts small enough to enumerate:
it solves the host, under the trace's own stochastic model, as a
continuous-time Markov decision process, for each G in ``--gpus``.

Model (the one ``bench/placement.py``'s traces are drawn from, read from its
``MIX``, ``board()`` and lifetime rule, not restated here): requests arrive
as a Poisson process of rate 1; a request is of size class c (its
framebuffer size; A40-8Q and A40-8C are one class) with the probability
``MIX`` gives its profiles; it holds its vGPU for an exponential lifetime of
mean ``load x G x framebuffer / mean request framebuffer`` (Little's law:
the offered framebuffer is ``load`` x the host's).  In equal-size mode a GPU
is empty or holds 1..max_c vGPUs of one class c, so the state is the
multiset of the G GPUs' (class, count), GPUs being alike (2..6 GPUs: 435 to
1,344,904 states).  At an arrival of class c a policy refuses, joins a GPU
of class c with room (one action per distinct count), or opens an empty
GPU; reward 1 per admission.  Owners are ignored (the trace's rule of one
vGPU per VM per GPU only removes actions), so the optimum is an upper bound
on every online policy without migration — best-fit, ``headroom``, any
admission rule, any tie-break, any use of the past — on this stochastic
model (not on one trace).

Method: uniformisation (rate Lambda = 1 + the largest total departure rate,
so every state keeps a self-loop), then relative value iteration with numpy,
h <- T h - (T h)[0], until the bracket on the long-run reward rate,
Lambda x [min (T h - h), max (T h - h)], is narrower than ``--tol``: the
gain lies in that bracket at every iteration (the bracket is printed).  The
gain is the long-run admitted fraction of requests (arrival rate 1).  The
same iteration with a fixed policy evaluates best-fit (the fullest GPU of
the class with room, else an empty GPU) and ``headroom``
(:data:`vgpuhost.policy.placement.HEADROOM`: best-fit that refuses a request
for a type an empty GPU holds once or twice when opening a GPU would bring
the framebuffer in use above 70% / 85% of the host's) exactly.  The policy
read off the optimal values (argmax of the Q values, refusal on ties) is
evaluated too: it must reproduce the optimum.  The script also prints the
optimal policy's structure: whether it ever places elsewhere than best-fit,
and, under its stationary distribution (power iteration), the share of each
class's arrivals it refuses although they fit, and of those the share that
would have opened an empty GPU.

With ``--traces`` it also replays, for each G, ``bench/placement.py``'s
traces of seeds 1..``--seeds`` (``--requests`` requests, the same G): best-fit
and ``headroom`` through the bench's own model of the real ``place()``, and
the optimal policy with owners honoured (when its best action would put two
vGPUs of one VM on a GPU, it takes the next-best action by its Q values that
is feasible, or refuses when refusing is worth more), and prints each as a
share of the trace's tight class-aware bound (``tight_class_bound``, needs
scipy; ``--bound-time`` seconds of branch and bound), with the medians.  The
optimum of the stochastic model is not a bound on one trace: a trace can
favour another policy, and the replay honours owners the model ignores.

Run time grows about 7x per GPU (2 cores): G=4 ~20 s, G=5 ~3 min, G=6 ~18 min
and 2 GB of memory; ``--traces`` adds about half a minute to 4 minutes per G.

    .venv/bin/python bench/placement_mdp.py [--gpus 2,3,4] [--load 1.0] [--tol 1e-7] [--no-structure]
                                            [--traces [--seeds 6] [--requests 2000] [--bound-time 20]]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vgpuhost.policy.placement import HEADROOM  # noqa: E402

Policy = List[np.ndarray]       # per class: successor state index per state (-1: refuse)


def _bench_placement():
    """bench/placement.py as a module (its MIX, board() and lifetime rule)."""
    name = "bench_placement_for_mdp"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / "placement.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def erlang_b(servers: int, load: float) -> float:
    """Erlang's loss formula B(servers, offered load in Erlangs), by the stable recursion
    B(0) = 1, B(k) = a B(k-1) / (k + a B(k-1))."""
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


class HostMdp:
    """The host as a continuous-time MDP (owners ignored).

    ``sizes``: framebuffer MiB per size class; ``probs``: the probability that an arrival is of each
    class (arrival rate 1; normalised here); ``maxes``: vGPUs of a class one GPU holds (default
    ``fb_mib // size``); ``gpus``: G; ``mean_life``: mean lifetime in mean inter-arrival times;
    ``fb_mib``: one GPU's framebuffer (for ``headroom``'s share in use); ``headroom``: max per GPU
    -> share, as :data:`HEADROOM`.

    A GPU type is 0 (empty) or one (class, count) pair, count 1..max; a state is a non-decreasing
    tuple of G type indices, enumerated in lexicographic order (``states``, N x G).  Raises
    ValueError on inconsistent parameters."""

    def __init__(self, sizes: Sequence[int], probs: Sequence[float], gpus: int, mean_life: float,
                 fb_mib: int, maxes: Optional[Sequence[int]] = None,
                 headroom: Optional[Mapping[int, float]] = None) -> None:
        maxes = [fb_mib // s for s in sizes] if maxes is None else list(maxes)
        if not (len(sizes) == len(probs) == len(maxes)) or gpus < 1 or mean_life <= 0 or min(maxes) < 1:
            raise ValueError("need one probability and one max per size, gpus >= 1, mean_life > 0, max >= 1")
        t0 = time.monotonic()
        total = float(sum(probs))
        self.sizes, self.maxes, self.gpus, self.mean_life, self.fb_mib = list(sizes), maxes, gpus, mean_life, fb_mib
        self.probs = [p / total for p in probs]
        self.headroom = dict(HEADROOM if headroom is None else headroom)
        n_cls = self.n_cls = len(sizes)
        cls, cnt = [-1], [0]
        for c in range(n_cls):
            for k in range(1, maxes[c] + 1):
                cls.append(c)
                cnt.append(k)
        self.t_cls, self.t_cnt = np.array(cls), np.array(cnt)
        n_types = len(cls)
        index = {(cls[t], cnt[t]): t for t in range(1, n_types)}
        up = self.t_up = np.array([-1] + [index.get((cls[t], cnt[t] + 1), -1) for t in range(1, n_types)])
        down = np.array([0] + [index.get((cls[t], cnt[t] - 1), 0) for t in range(1, n_types)])
        self.t_fb = np.array([0] + [sizes[cls[t]] * cnt[t] for t in range(1, n_types)], dtype=np.int64)
        self.open_type = np.array([index[(c, 1)] for c in range(n_cls)])

        self.states = np.array(list(itertools.combinations_with_replacement(range(n_types), gpus)),
                               dtype=np.int64).reshape(-1, gpus)
        n = self.n = len(self.states)
        self._weights = n_types ** np.arange(gpus - 1, -1, -1, dtype=np.int64)
        self._keys = self.states @ self._weights
        st = self.states
        first = np.ones((n, gpus), bool)               # the first GPU of each distinct type in a state
        first[:, 1:] = st[:, 1:] != st[:, :-1]
        self.used_mib = self.t_fb[st].sum(1)
        # arrivals: per class, per GPU position, (states where that position is an action, successors)
        self.arrive: List[List[Tuple[np.ndarray, np.ndarray]]] = []
        for c in range(n_cls):
            per_pos = []
            for i in range(gpus):
                old = st[:, i]
                new = np.where(old == 0, self.open_type[c], np.where(self.t_cls[old] == c, up[old], -1))
                src = np.nonzero(first[:, i] & (new >= 0))[0]
                per_pos.append((src, self._successor(src, i, new[src])))
            self.arrive.append(per_pos)
        # departures: per position, rate (multiplicity x count / mean life) and successor
        self.dep_to = np.tile(np.arange(n)[:, None], (1, gpus))
        self.dep_rate = np.zeros((n, gpus))
        for i in range(gpus):
            old = st[:, i]
            src = np.nonzero(first[:, i] & (old != 0))[0]
            mult = (st[src] == st[src, i][:, None]).sum(1)
            self.dep_rate[src, i] = mult * self.t_cnt[old[src]] / mean_life
            self.dep_to[src, i] = self._successor(src, i, down[old[src]])
        self.total_dep = self.dep_rate.sum(1)
        self.uniform = 1.0 + float(self.total_dep.max()) + 1e-9       # Lambda
        self.build_s = time.monotonic() - t0

    def _successor(self, src: np.ndarray, pos: int, value: np.ndarray) -> np.ndarray:
        s = self.states[src].copy()
        s[:, pos] = value
        s.sort(1)
        return self.index(s)

    def index(self, states: np.ndarray) -> np.ndarray:
        """Indices of sorted states (rows of type indices)."""
        keys = np.asarray(states, dtype=np.int64) @ self._weights
        j = np.searchsorted(self._keys, keys)
        assert np.all(self._keys[np.minimum(j, self.n - 1)] == keys), "not a state"
        return j

    # --- Bellman operators (uniformised, divided by Lambda) ---------------------------------

    def _departures(self, h: np.ndarray) -> np.ndarray:
        return (self.dep_rate * h[self.dep_to]).sum(1) + (self.uniform - 1.0 - self.total_dep) * h

    def q_values(self, h: np.ndarray, c: int) -> Tuple[np.ndarray, np.ndarray]:
        """(best value 1 + h[successor] over admitting actions, or h where refusing is better or
        equal; the chosen successor, -1 = refuse) for an arrival of class c in every state."""
        best = h.copy()
        arg = np.full(self.n, -1, np.int64)
        for src, dst in self.arrive[c]:
            q = 1.0 + h[dst]
            better = q > best[src] + 1e-12
            best[src[better]] = q[better]
            arg[src[better]] = dst[better]
        return best, arg

    def bellman_optimal(self, h: np.ndarray) -> np.ndarray:
        out = self._departures(h)
        for c in range(self.n_cls):
            out += self.probs[c] * self.q_values(h, c)[0]
        return out / self.uniform

    def bellman_policy(self, h: np.ndarray, policy: Policy) -> np.ndarray:
        out = self._departures(h)
        for c in range(self.n_cls):
            a = policy[c]
            out += self.probs[c] * np.where(a >= 0, 1.0 + h[np.maximum(a, 0)], h)
        return out / self.uniform

    def solve(self, policy: Optional[Policy] = None, tol: float = 1e-7,
              max_iter: int = 200_000) -> Tuple[np.ndarray, float, float, int]:
        """Relative value iteration: (relative values h, gain low, gain high, iterations).  The
        long-run admitted fraction (of the optimal policy, or of ``policy``) lies in [low, high]."""
        h = np.zeros(self.n)
        low, high = -math.inf, math.inf
        for it in range(1, max_iter + 1):
            new = self.bellman_optimal(h) if policy is None else self.bellman_policy(h, policy)
            diff = new - h
            low, high = float(diff.min()) * self.uniform, float(diff.max()) * self.uniform
            h = new - new[0]
            if high - low < tol:
                return h, low, high, it
        return h, low, high, max_iter

    # --- policies -----------------------------------------------------------------------------

    def best_fit(self, headroom: bool = False) -> Policy:
        """Best-fit: join the fullest GPU of the class with room, else open an empty GPU (else
        refuse); with ``headroom``, also refuse opening for a class whose max per GPU is a key of
        the headroom map when the framebuffer in use, with the request, would pass that share of
        the host's."""
        policy = []
        for c in range(self.n_cls):
            join = np.full(self.n, -1, np.int64)
            join_type = np.full(self.n, -1, np.int64)
            open_to = np.full(self.n, -1, np.int64)
            for i, (src, dst) in enumerate(self.arrive[c]):
                t = self.states[src, i]
                is_open = t == 0
                open_to[src[is_open]] = dst[is_open]
                fuller = ~is_open & (t > join_type[src])
                join_type[src[fuller]] = t[fuller]
                join[src[fuller]] = dst[fuller]
            if headroom and self.maxes[c] in self.headroom:
                limit = self.headroom[self.maxes[c]] * self.gpus * self.fb_mib
                open_to = np.where(self.used_mib + self.sizes[c] <= limit, open_to, -1)
            policy.append(np.where(join >= 0, join, open_to))
        return policy

    def greedy(self, h: np.ndarray) -> Policy:
        """The policy read off relative values h (argmax of Q, refusal on ties)."""
        return [self.q_values(h, c)[1] for c in range(self.n_cls)]

    def stationary(self, policy: Policy, tol: float = 1e-10, max_iter: int = 100_000) -> np.ndarray:
        """Stationary distribution of the uniformised chain under ``policy`` (power iteration)."""
        pi = np.zeros(self.n)
        pi[0] = 1.0
        stay = (self.uniform - 1.0 - self.total_dep) / self.uniform
        dep_to = self.dep_to.ravel()
        dep_w = self.dep_rate / self.uniform
        for _ in range(max_iter):
            new = pi * stay + np.bincount(dep_to, weights=(pi[:, None] * dep_w).ravel(), minlength=self.n)
            for c in range(self.n_cls):
                a = policy[c]
                admit = a >= 0
                new += np.bincount(a[admit], weights=pi[admit] * self.probs[c] / self.uniform, minlength=self.n)
                new[~admit] += pi[~admit] * self.probs[c] / self.uniform
            done = np.abs(new - pi).sum() < tol
            pi = new
            if done:
                break
        return pi / pi.sum()


def bench_model(gpus: int, load: float = 1.0) -> Tuple[HostMdp, List[str]]:
    """The MDP of ``bench/placement.py``'s traces on G A40s: (model, class labels)."""
    bp = _bench_placement()
    fb_mib, types, _ = bp.board()
    by_size: Dict[int, float] = {}
    for profile, weight in bp.MIX:
        by_size[types[profile].fb_mib] = by_size.get(types[profile].fb_mib, 0.0) + weight
    sizes = sorted(by_size)
    maxes = [min(t.max for t in types.values() if t.fb_mib == s) for s in sizes]
    total = sum(by_size.values())
    mean_fb = sum(s * w for s, w in by_size.items()) / total
    mean_life = load * gpus * fb_mib / mean_fb             # the rule of make_trace (arrival rate 1)
    labels = [f"{s // 1024} GB" for s in sizes]
    return HostMdp(sizes, [by_size[s] for s in sizes], gpus, mean_life, fb_mib, maxes=maxes), labels


def replay_trace(m: HostMdp, h: np.ndarray, reqs, events, class_of: Mapping[str, int]) -> int:
    """Admissions of the policy read off ``h`` on one trace of ``bench/placement.py`` (its
    ``make_trace`` requests and events), owners honoured: the admitting actions are ranked by
    1 + h[successor]; the first that beats refusing (h[state]) and has a GPU not holding a vGPU
    of the request's owner is taken; else the request is refused."""
    gtype = [0] * m.gpus                        # GPU type index per GPU
    owners: List[Dict[str, int]] = [dict() for _ in range(m.gpus)]
    where: Dict[int, int] = {}
    admitted = 0
    for _, kind, n in events:
        r = reqs[n]
        if kind == 0:
            g = where.pop(n, None)
            if g is not None:
                owners[g][r.owner] -= 1
                if not owners[g][r.owner]:
                    del owners[g][r.owner]
                gtype[g] = 0 if m.t_cnt[gtype[g]] == 1 else gtype[g] - 1
            continue
        c = class_of[r.profile]
        options: Dict[int, List[int]] = {}     # successor GPU type -> GPUs that reach it
        for g, t in enumerate(gtype):
            nt = int(m.open_type[c]) if t == 0 else (int(m.t_up[t]) if m.t_cls[t] == c else -1)
            if nt >= 0:
                options.setdefault(nt, []).append(g)
        here = float(h[m.index(np.array([sorted(gtype)]))[0]])
        ranked = []
        for nt, gs in options.items():
            after = list(gtype)
            after[gs[0]] = nt
            ranked.append((1.0 + float(h[m.index(np.array([sorted(after)]))[0]]), nt, gs))
        chosen = None
        for q, nt, gs in sorted(ranked, key=lambda x: -x[0]):
            if q <= here + 1e-12:
                break
            ok = [g for g in gs if r.owner not in owners[g]]
            if ok:
                chosen = (ok[0], nt)
                break
        if chosen is None:
            continue
        g, nt = chosen
        gtype[g] = nt
        owners[g][r.owner] = owners[g].get(r.owner, 0) + 1
        where[n] = g
        admitted += 1
    return admitted


def trace_rows(m: HostMdp, h: np.ndarray, seeds: Sequence[int], requests: int, load: float,
               bound_time: float) -> List[Tuple[int, int, int, int, Optional[int]]]:
    """Per seed: (seed, best-fit, headroom, optimal replayed, tight class-aware bound or None)."""
    bp = _bench_placement()
    fb_mib, types, sim = bp.board()
    class_of = {p: m.sizes.index(types[p].fb_mib) for p, _ in bp.MIX}
    out = []
    for seed in seeds:
        reqs, events, _ = bp.make_trace(seed, requests, m.gpus, load, fb_mib, types)
        got = [sum(d.admitted for d in bp.replay_model(s, reqs, events, m.gpus, fb_mib, types, sim).values())
               for s in ("best-fit", "headroom")]
        opt = replay_trace(m, h, reqs, events, class_of)
        tb = bp.tight_class_bound(reqs, m.gpus, fb_mib, types, bound_time)
        out.append((seed, got[0], got[1], opt, None if tb is None else tb.bound))
    return out


def structure(m: HostMdp, h: np.ndarray, policy: Policy, labels: Sequence[str]) -> List[str]:
    """Lines on the optimal policy: where it places, and what it refuses (stationary shares)."""
    bf = m.best_fit()
    elsewhere = sum(int(np.sum((policy[c] >= 0) & (policy[c] != bf[c]))) for c in range(m.n_cls))
    pi = m.stationary(policy)
    lines = [f"    places elsewhere than best-fit in {elsewhere} of {m.n_cls * m.n} (state, class) pairs"]
    parts = []
    for c in range(m.n_cls):
        fits = bf[c] >= 0
        refused = fits & (policy[c] < 0)
        joins = np.zeros(m.n, bool)         # a GPU of the class has room: best-fit would not open one
        for i, (src, dst) in enumerate(m.arrive[c]):
            joins[src[m.states[src, i] != 0]] = True
        opening = refused & ~joins
        share = float(pi[refused].sum()) / max(float(pi[fits].sum()), 1e-300)
        open_share = float(pi[opening].sum()) / max(float(pi[refused].sum()), 1e-300)
        parts.append(f"{labels[c]} {share:.1%}" + (f" ({open_share:.0%} opening)" if share >= 5e-4 else ""))
    lines.append("    refuses, of each class's arrivals that fit (stationary): " + ", ".join(parts))
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="2,3,4", help="comma-separated GPU counts (default 2,3,4; 5: ~3 min, "
                                                    "6: ~18 min and 2 GB)")
    ap.add_argument("--load", type=float, default=1.0,
                    help="offered load: mean framebuffer of active requests / the host's (default 1.0)")
    ap.add_argument("--tol", type=float, default=1e-7,
                    help="stop when the bracket on the admitted fraction is narrower (default 1e-7)")
    ap.add_argument("--traces", action="store_true",
                    help="also replay bench/placement.py's traces (seeds 1..--seeds) on G GPUs: best-fit, headroom "
                         "and the optimal policy (owners honoured), as shares of each trace's tight class-aware bound")
    ap.add_argument("--seeds", type=int, default=6, help="--traces: seeds 1..N (default 6)")
    ap.add_argument("--requests", type=int, default=2000, help="--traces: requests per trace (default 2000)")
    ap.add_argument("--bound-time", type=float, default=20.0, metavar="S",
                    help="--traces: branch-and-bound seconds per tight class-aware bound (default 20)")
    ap.add_argument("--no-structure", action="store_true",
                    help="skip the optimal policy's stationary refusal shares (a power iteration)")
    args = ap.parse_args(argv)
    try:
        gpu_counts = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        ap.error("--gpus takes comma-separated integers, e.g. 2,3,4")
    if (any(not 1 <= g <= 8 for g in gpu_counts) or args.load <= 0 or args.tol <= 0 or args.seeds < 1
            or args.requests < 1 or args.bound_time < 0):
        ap.error("need 1 <= each of --gpus <= 8, --load > 0, --tol > 0, --seeds >= 1, --requests >= 1, "
                 "--bound-time >= 0")
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]) if sys.argv[0] else "bench/placement_mdp.py",
                                            *(sys.argv[1:] if argv is None else argv)])
    print(f"$ {cmd}")
    bp = _bench_placement()
    print(f"mix: " + ", ".join(f"{p} {w:.0%}" for p, w in bp.MIX) + f"; offered load {args.load:.2f}; "
          f"owners ignored; headroom shares {dict(HEADROOM)}")
    print()
    t_all = time.monotonic()
    rows = []
    traced: Dict[int, List[float]] = {}
    for g in gpu_counts:
        t0 = time.monotonic()
        m, labels = bench_model(g, args.load)
        print(f"G={g}: {m.n:,} states, mean lifetime {m.mean_life:.3f}, Lambda {m.uniform:.3f} "
              f"(built in {m.build_s:.1f} s)", flush=True)
        h, lo, hi, it = m.solve(tol=args.tol)
        got = {"optimal": (lo, hi, it)}
        for name, pol in (("best-fit", m.best_fit()), ("headroom", m.best_fit(headroom=True)),
                          ("optimal, read off", m.greedy(h))):
            _, plo, phi, pit = m.solve(pol, tol=args.tol)
            got[name] = (plo, phi, pit)
        for name, (plo, phi, pit) in got.items():
            print(f"  {name:<18} {(plo + phi) / 2:.5%}   in [{plo:.7f}, {phi:.7f}] after {pit} iterations")
        opt = (lo + hi) / 2
        hr = sum(got["headroom"][:2]) / 2
        bf = sum(got["best-fit"][:2]) / 2
        print(f"  optimum over headroom: {opt / hr - 1:+.2%} relative; over best-fit {opt / bf - 1:+.2%}")
        if not args.no_structure:
            print("\n".join(structure(m, h, m.greedy(h), labels)))
        print(f"  ({time.monotonic() - t0:.1f} s)", flush=True)
        if args.traces:
            t1 = time.monotonic()
            per_seed = trace_rows(m, h, range(1, args.seeds + 1), args.requests, args.load, args.bound_time)
            print(f"  traces of bench/placement.py (seed: best-fit, headroom, optimal replayed / tight bound):")
            print("    " + "; ".join(f"{s}: {b} {r} {o} / {'n/a' if tb is None else tb}"
                                     for s, b, r, o, tb in per_seed))
            if all(row[4] for row in per_seed):
                med = [statistics.median(row[k] / row[4] for row in per_seed) for k in (1, 2, 3)]
                print(f"    median share of the bound: best-fit {med[0]:.2%}, headroom {med[1]:.2%}, "
                      f"optimal replayed {med[2]:.2%}")
                traced[g] = med
            else:
                print("    no tight bound (needs scipy)")
            print(f"  (traces {time.monotonic() - t1:.1f} s)", flush=True)
        rows.append((g, m.n, opt, bf, hr))
    print()
    print(f"{'G':>3} {'states':>10} {'optimal':>9} {'best-fit':>9} {'headroom':>9} {'edge over headroom':>19}")
    for g, n, opt, bf, hr in rows:
        print(f"{g:>3} {n:>10,} {opt:>9.3%} {bf:>9.3%} {hr:>9.3%} {opt / hr - 1:>19.2%}"
              + ("" if g not in traced else "   traces: " + " ".join(f"{v:.2%}" for v in traced[g])))
    print()
    print("optimal: the long-run admitted fraction no online policy without migration exceeds on this model")
    print("(owners ignored); best-fit and headroom evaluated exactly; brackets from relative value iteration.")
    if traced:
        print("traces: medians over the seeds of best-fit, headroom and the optimal policy replayed (owners honoured),")
        print("as shares of each trace's tight class-aware bound (a replay, not a bound).")
    print(f"time: {time.monotonic() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
