#!/usr/bin/env python3
"""Benchmark: how many vGPU requests each placement strategy admits, against an upper bound.

Replays one seeded trace of REQUESTS vGPU requests and their releases on a
simulated host of GPUS A40 boards (48 GB, classic mdev, equal-size mode,
half on NUMA node 0, half on node 1) and prints, per strategy (first-fit,
best-fit, worst-fit, ``reserve``: best-fit that keeps the last two empty
GPUs from whole-GPU requests, and ``headroom``: best-fit that refuses a
whole- or half-GPU request opening an empty GPU above 70% / 85% of the
framebuffer in use), the share of requests admitted, next to two
upper bounds on the share *any* placement could admit on the same trace.
With ``--seeds N`` it replays N traces (seeds SEED ... SEED+N-1) and prints
each seed's row and the medians.

Trace: requests arrive as a Poisson process; each holds its vGPU for an
exponentially distributed time, then releases it (a refused request releases
nothing).  Profiles are mixed (A40-4Q ... A40-48Q, and A40-8C, which shares
8Q's framebuffer size); 15% of requests are a further vGPU of the VM that
asked just before (same owner: one vGPU per VM per GPU applies).  The mean
lifetime is set so that the offered load — the framebuffer of the requests
active at a time, on average — is LOAD x the host's framebuffer.

Placement runs the real, pure :func:`vgpuhost.placement.place` on offers
built as :func:`vgpuhost.vgpu.offers` builds them, from an in-memory
capacity model: the simulator's own rules (:func:`vgpuhost.sim.capacity.gpu_available`:
equal-size mode, max instances per type).  With ``--validate N`` the first N
trace events are also replayed through the real ``vgpuhost.vgpu.create`` /
``remove`` on a simulated host (one process per strategy), and every
decision (admitted or refused, and on which GPU) must match the model's.

Upper bound (UB): the optimum of the linear-programming relaxation of

    maximise the number of admitted requests, such that at every instant the
    framebuffer of the admitted requests then active fits in the host's total
    framebuffer (GPUS x 48 GB),

with admission fractions 0 <= x_r <= 1.  Every placement the vGPU manager
allows satisfies that constraint (each A40 type's max instances x its
framebuffer is exactly 48 GB), whatever the strategy, even an offline one
that knows the future and may migrate vGPUs between GPUs; the LP optimum is
at least the integer one.  So no placement can admit more than UB; the
gap between a strategy and UB bounds what a better strategy could gain
(equal-size fragmentation, one vGPU per VM per GPU, online decisions and
the fractional relaxation all sit in that gap).  It is solved exactly: with
y_r = framebuffer_r x x_r the constraint matrix has consecutive ones per
column (an interval matrix, totally unimodular), so the LP is a min-cost
flow on the time line: C = total framebuffer units flow from the first to
the last instant, along "idle" arcs (capacity C, cost 0) or a request's arc
(arrival -> release, capacity = its framebuffer units, cost -1/units).

Class-aware bound (CB): in equal-size mode a GPU holds vGPUs of one
framebuffer size only, at most max-instances of them (48 GB / size on the
A40).  So at every arrival, the admitted requests then active need, per
size class c, ceil(active_c / max_c) GPUs, and the sum over classes is at
most GPUS.  The largest number of admissions subject to that is an integer
program (binary x_r per request, integer GPUs per class and arrival); any
placement, online or offline, with or without migration, satisfies it.  It
is solved with scipy's HiGHS MILP under a time limit (``--bound-time``);
the bench prints HiGHS's dual bound, which is a valid upper bound whether or
not the solver proved optimality (the gap is printed too).  Without scipy
(``pip install scipy``; not a dependency of vgpuhost) the row says so.

Tight class-aware bound: the same integer program, so the same optimum, but a
model the solver bounds far better (:func:`tight_class_bound`): one GPU
variable per size class and set of requests that could then be active (not per
arrival), the 48Q class's GPUs replaced by its count, and residual capacity
cutting planes on each class row, added round by round from the LP's fractional
solution.  Its LP bound is certified by the LP's dual solution through weak
duality (:func:`dual_certificate`), so it does not rest on the solver having
converged; HiGHS's branch and bound then runs on the strengthened model under
the same ``--bound-time`` and lowers it.  The bench also prints the best
schedule found, checked against the constraint (:func:`class_fits`): the
optimum lies between the two.  The "of CB" column and the target line use the
tightest proven bound of the two rows.

With ``--repack`` it also replays an experiment (not a strategy: vgpuhost
does not migrate vGPUs): online admission, by best-fit's rule (admit what
fits) and by ``headroom``'s, on a host that repacks every vGPU at every
arrival, so a request fits when, with it, the sum over size classes of
ceil(active / max per GPU) is at most GPUS (the class-aware bound's
constraint, decided online; one vGPU per VM per GPU is not checked).  Every
placement without migration keeps within that constraint, so the row says
what the same admission rule admits once equal-size fragmentation is
removed, and its gap to the class-aware bound what deciding online, without
knowing the future, still costs.

With ``--restarts K`` it also replays best-fit and headroom with *repack at
restart*: each admitted vGPU restarts K times over its life on average (a
Poisson process, drawn apart from the trace, so the requests and the bounds
do not change), and each restart releases it and places it again by the same
strategy, as any start is placed (vgpuhost never moves a running vGPU; a
restart is where it may repack).  Unlike ``--repack`` this is what vgpuhost
does, given VMs that restart; the row's share of the tight class-aware bound
is the issue's repack-at-restart figure (target >= 96%).  Under each it prints why the
requests refused at their arrival were refused (the strategy's rule, one vGPU per VM per GPU,
fragmented: a repacked host would hold them, or full) and the restarts refused, and it replays
headroom once more with one vGPU per VM per GPU unenforced, as the bounds do not enforce it (an
experiment: what the owner rule costs the strategy).

    .venv/bin/python bench/placement.py [--seed 1] [--seeds 1] [--requests 2000] [--gpus 16] [--load 1.0]
                                        [--validate 300] [--bound-time 60] [--clairvoyant] [--repack]
                                        [--restarts K]
"""

from __future__ import annotations

import argparse
import heapq
import math
import multiprocessing
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vgpuhost.policy.placement import MANUAL, GpuOffer, Request, place  # noqa: E402
from vgpuhost.sim.capacity import gpu_available  # noqa: E402
from vgpuhost.sim.catalog import load_catalog  # noqa: E402
from vgpuhost.model.values import PciAddress  # noqa: E402

BOARD = "A40"
STRATEGIES = ("first-fit", "best-fit", "worst-fit", "reserve", "headroom")
RESERVING = ("reserve", "headroom")
MIX: Sequence[Tuple[str, float]] = (("A40-4Q", 0.25), ("A40-8Q", 0.25), ("A40-8C", 0.10), ("A40-12Q", 0.10),
                                    ("A40-16Q", 0.15), ("A40-24Q", 0.10), ("A40-48Q", 0.05))
SAME_VM = 0.15
MAX_GPUS = 64


# --- host and trace -------------------------------------------------------------------

@dataclass(frozen=True)
class TypeInfo:
    type_id: str
    fb_mib: int
    max: int


def board() -> Tuple[int, Dict[str, TypeInfo], dict]:
    """(framebuffer MiB, {name: TypeInfo}, the GPU as the simulator's capacity rules take it)."""
    g = load_catalog().gpus[BOARD]
    types = {t.name: TypeInfo(f"nvidia-{t.type_id}", t.framebuffer_mib, t.max_instances)
             for t in g.vgpu_types if not t.gi_profile}
    sim = {"types": {t.type_id: {"fb_mib": t.fb_mib, "max": t.max, "max_mixed": t.max, "gi_profile": None}
                     for t in types.values()},
           "mixed_size": False, "mig_mode": False, "framebuffer_mib": g.framebuffer_mib}
    return g.framebuffer_mib, types, sim


def gpu_addresses(n: int) -> List[Tuple[PciAddress, str, int]]:
    """(GPU, its root port, NUMA node) for n GPUs, one per bus."""
    return [(PciAddress.parse(f"0000:{0x41 + i:02x}:00.0"), f"0000:00:{(i % 31) + 1:02x}.{i // 31}",
             0 if i < n / 2 else 1) for i in range(n)]


def spec_yaml(n: int) -> str:
    lines = ["version: 1", f"name: bench-placement-{n}", f"summary: {n} x {BOARD} on classic mdev (benchmark)",
             "host:", "  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]",
             "devices:"]
    for gpu, port, numa in gpu_addresses(n):
        lines.append(f'  - {{bdf: "{port}", model: intel-root-port, numa_node: {numa}}}')
        lines.append(f'  - {{bdf: "{gpu}", model: {BOARD}, upstream: "{port}", numa_node: {numa}, '
                     "vgpu: {backend: mdev}}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Req:
    n: int
    profile: str
    owner: str
    arrive: float
    depart: float


def make_trace(seed: int, requests: int, gpus: int, load: float, fb_mib: int,
               types: Dict[str, TypeInfo]) -> Tuple[List[Req], List[Tuple[float, int, int]], float]:
    """(requests, events [(time, 0 = release | 1 = arrival, request)], mean lifetime)."""
    rng = random.Random(seed)
    names = [n for n, _ in MIX]
    weights = [w for _, w in MIX]
    mean_fb = sum(types[n].fb_mib * w for n, w in MIX) / sum(weights)
    mean_life = load * gpus * fb_mib / mean_fb          # arrival rate 1: Little's law
    out: List[Req] = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(1.0)
        if out and rng.random() < SAME_VM:
            owner = out[-1].owner
        else:
            owner = str(uuidlib.UUID(int=rng.getrandbits(128), version=4))
        profile = rng.choices(names, weights)[0]
        out.append(Req(i, profile, owner, t, t + rng.expovariate(1.0 / mean_life)))
    # at equal times a release comes before an arrival
    events = sorted([(r.arrive, 1, r.n) for r in out] + [(r.depart, 0, r.n) for r in out])
    return out, events, mean_life


# --- the model --------------------------------------------------------------------------

@dataclass
class Decided:
    admitted: bool
    gpu: Optional[str]
    fragmented: bool = False      # refused although the host's free framebuffer would hold it


def _depart(where: Dict[int, PciAddress], present: Dict[PciAddress, Dict[int, Req]], n: int) -> None:
    """Request ``n`` leaves (a refused one was never placed)."""
    g = where.pop(n, None)
    if g is not None:
        del present[g][n]


def _available(sim: dict, types: Dict[str, TypeInfo], held, type_id) -> int:
    """How many more of ``type_id`` fit on a GPU holding the requests ``held`` (the simulator's rules)."""
    return gpu_available(sim, [types[h.profile].type_id for h in held]).get(type_id, 0)


def replay_model(strategy: str, reqs: List[Req], events, gpus: int, fb_mib: int,
                 types: Dict[str, TypeInfo], sim: dict, limit: Optional[int] = None) -> Dict[int, Decided]:
    addrs = gpu_addresses(gpus)
    present: Dict[PciAddress, Dict[int, Req]] = {g: {} for g, _, _ in addrs}
    where: Dict[int, PciAddress] = {}
    out: Dict[int, Decided] = {}
    for k, (_, kind, n) in enumerate(events):
        if limit is not None and k >= limit:
            break
        if kind == 0:
            _depart(where, present, n)
            continue
        r = reqs[n]
        t = types[r.profile]
        d = place(_offers(sim, types, present, addrs, t, r, fb_mib), Request(r.profile, r.owner, strategy))
        if d.admitted:
            present[d.gpu][n] = r
            where[n] = d.gpu
            out[n] = Decided(True, str(d.gpu))
        else:
            free = sum(gpus * [fb_mib]) - sum(types[h.profile].fb_mib for p in present.values() for h in p.values())
            out[n] = Decided(False, None, fragmented=free >= t.fb_mib)
    return out


def _offers(sim: dict, types: Dict[str, TypeInfo], present, addrs, t: TypeInfo, r: Req, fb_mib: int) -> list:
    """One GpuOffer per GPU for request ``r`` of type ``t``, from what each GPU holds now (``present``)."""
    offers = []
    for g, _, numa in addrs:
        held = present[g].values()
        avail = _available(sim, types, held, t.type_id)
        offers.append(GpuOffer(g, numa, t.type_id, r.profile, avail, (g,) if avail > 0 else (),
                               frozenset(h.owner for h in held), frozenset(), len(present[g]),
                               framebuffer_mib=fb_mib, used_mib=sum(types[h.profile].fb_mib for h in held)))
    return offers


#: why a request the restart replay refused at its arrival was refused (``replay_restarting(causes=)``)
RESTART_CAUSES = ("rule", "owner", "fragmented", "full")


def _refusal_cause(offers, owner: str, t: TypeInfo, present, gpus: int, fb_mib: int,
                   types: Dict[str, TypeInfo]) -> str:
    """Why a request of type ``t`` was refused now: ``rule`` (a GPU would hold it: the strategy's own
    refusal, as headroom's), ``owner`` (only GPUs holding the VM's own vGPU have room: one vGPU per VM
    per GPU), ``fragmented`` (no GPU has room, but a host that repacked every vGPU now would hold it:
    with it, the sum over size classes of ceil(active / max per GPU) is at most ``gpus``, the
    class-aware bound's constraint) or ``full`` (not even that)."""
    if any(o.available > 0 and owner not in o.owners for o in offers):
        return "rule"
    if any(o.available > 0 for o in offers):
        return "owner"
    active: Dict[int, int] = {t.fb_mib: 1}
    for held in present.values():
        for h in held.values():
            size = types[h.profile].fb_mib
            active[size] = active.get(size, 0) + 1
    need = sum(-(-k // (fb_mib // size)) for size, k in active.items())
    return "fragmented" if need <= gpus else "full"


def replay_restarting(strategy: str, reqs: List[Req], events, gpus: int, fb_mib: int,
                      types: Dict[str, TypeInfo], sim: dict, restarts: float, seed: int,
                      owners: bool = True, causes: Optional[Dict[str, int]] = None) -> int:
    """Admissions of ``strategy`` (vgpuhost's own placement) when VMs restart (``--restarts``): each
    admitted vGPU restarts ``restarts`` times over its life on average (a Poisson process over its
    lifetime, drawn from ``seed`` apart from the trace's, so the requests and the bounds are the same),
    and at each restart is released and placed again by ``strategy`` as at any start (repack at
    restart: vgpuhost never moves a running vGPU; a restarting one may land elsewhere; under best-fit it
    always fits, at worst where it was; a restart the rule refuses, as headroom may when the vGPU was
    alone on its GPU, ends the VM: not counted as admitted).  Its share of the class-aware bound is what placing again at restart
    recovers of the fragmentation.

    ``owners`` False: an experiment, not vgpuhost: one vGPU per VM per GPU is not enforced (every
    request placed as a pool owner's), as the bounds do not enforce it.  ``causes``: a dict that gets,
    per :data:`RESTART_CAUSES` key, the requests refused at their arrival for that cause
    (:func:`_refusal_cause`), and under ``ended`` the restarts refused (VMs ended)."""
    rng = random.Random(seed * 7919 + 17)
    timeline = list(events)
    for r in reqs:
        if restarts <= 0:
            break
        t = r.arrive
        rate = restarts / max(r.depart - r.arrive, 1e-9)
        while True:
            t += rng.expovariate(rate)
            if t >= r.depart:
                break
            timeline.append((t, 2, r.n))
    timeline.sort()
    addrs = gpu_addresses(gpus)
    present: Dict[PciAddress, Dict[int, Req]] = {g: {} for g, _, _ in addrs}
    where: Dict[int, PciAddress] = {}
    admitted = 0
    for _, kind, n in timeline:
        if kind == 0 or (kind == 2 and n not in where):
            _depart(where, present, n)
            continue
        if kind == 2:
            _depart(where, present, n)           # stopped; placed again below as at any start
        r = reqs[n]
        t = types[r.profile]
        owner = r.owner if owners else MANUAL
        offers = _offers(sim, types, present, addrs, t, r, fb_mib)
        d = place(offers, Request(r.profile, owner, strategy))
        if d.admitted:
            present[d.gpu][n] = r
            where[n] = d.gpu
            admitted += 1 if kind == 1 else 0
        elif kind == 2:
            admitted -= 1       # refused at its restart (headroom may refuse to open an empty GPU): it no longer runs
            if causes is not None:
                causes["ended"] = causes.get("ended", 0) + 1
        elif causes is not None:
            why = _refusal_cause(offers, owner, t, present, gpus, fb_mib, types)
            causes[why] = causes.get(why, 0) + 1
    return admitted


def replay_clairvoyant(reqs: List[Req], events, gpus: int, fb_mib: int, types: Dict[str, TypeInfo],
                       sim: dict) -> int:
    """Admissions of an experiment, not a strategy and not a bound: ``headroom``'s admission rule,
    but placement that knows every request's departure time (no migration): among the GPUs that
    fit, the one whose vGPUs' last departure comes soonest at or after the request's own (else the
    latest), so GPUs empty together.  What knowing lifetimes would add to an online rule."""
    from vgpuhost.policy.placement import HEADROOM
    addrs = [g for g, _, _ in gpu_addresses(gpus)]
    present: Dict[PciAddress, Dict[int, Req]] = {g: {} for g in addrs}
    where: Dict[int, PciAddress] = {}
    admitted = 0
    for _, kind, n in events:
        if kind == 0:
            _depart(where, present, n)
            continue
        r = reqs[n]
        t = types[r.profile]
        avail = {g: _available(sim, types, present[g].values(), t.type_id) for g in addrs}
        fits = [g for g in addrs if avail[g] > 0 and all(h.owner != r.owner for h in present[g].values())]
        shared = [g for g in fits if present[g]]
        if shared:
            later = [g for g in shared if max(h.depart for h in present[g].values()) >= r.depart]
            last = lambda g: max(h.depart for h in present[g].values())      # noqa: E731
            chosen = min(later, key=last) if later else max(shared, key=last)
        elif fits:
            chosen = fits[0]
            share = HEADROOM.get(avail[chosen])
            used = sum(types[h.profile].fb_mib for p in present.values() for h in p.values()) + fb_mib // avail[chosen]
            if share is not None and used > share * gpus * fb_mib:
                continue
        else:
            continue
        present[chosen][n] = r
        where[n] = chosen
        admitted += 1
    return admitted


REPACK_RULES = ("best-fit", "headroom")
#: the strategies replayed with repack at restart (``--restarts``)
RESTART_RULES = ("best-fit", "headroom")


def replay_repacking(rule: str, reqs: List[Req], events, gpus: int, fb_mib: int,
                     types: Dict[str, TypeInfo]) -> int:
    """Admissions of an experiment, not a strategy and not a bound (``--repack``): ``rule``'s online
    admission (``best-fit``: whatever fits; ``headroom``: also its refusal of a type an empty GPU
    holds once or twice that would open a GPU above :data:`HEADROOM` of the framebuffer in use) on a
    host that repacks every vGPU at every arrival: a request fits when, with it, the sum over size
    classes of ceil(active / max per GPU) is at most ``gpus`` (one vGPU per VM per GPU unchecked)."""
    from vgpuhost.policy.placement import HEADROOM
    active: Dict[int, int] = {}          # framebuffer MiB of a size class -> admitted vGPUs active
    alive = set()
    in_use = opened = admitted = 0       # framebuffer MiB in use; GPUs the repacked host needs
    for _, kind, n in events:
        t = types[reqs[n].profile]
        per_gpu = fb_mib // t.fb_mib
        if kind == 0:
            if n in alive:
                alive.discard(n)
                active[t.fb_mib] -= 1
                in_use -= t.fb_mib
                opened -= 1 if active[t.fb_mib] % per_gpu == 0 else 0
            continue
        opens = active.get(t.fb_mib, 0) % per_gpu == 0
        if opens:
            if opened + 1 > gpus:
                continue
            share = HEADROOM.get(per_gpu) if rule == "headroom" else None
            if share is not None and in_use + t.fb_mib > share * gpus * fb_mib:
                continue
            opened += 1
        active[t.fb_mib] = active.get(t.fb_mib, 0) + 1
        in_use += t.fb_mib
        alive.add(n)
        admitted += 1
    return admitted


# --- the upper bound: LP relaxation as a min-cost flow -------------------------------------

def lp_upper_bound(reqs: List[Req], gpus: int, fb_mib: int, types: Dict[str, TypeInfo]) -> float:
    """max sum x_r s.t. for all t: sum_{r active at t} fb_r x_r <= gpus * fb, 0 <= x_r <= 1 (exact)."""
    unit = 0
    for r in reqs:                                  # framebuffer unit: gcd of the sizes and the board
        unit = _gcd(unit, types[r.profile].fb_mib)
    unit = _gcd(unit, fb_mib)
    units = {r.n: types[r.profile].fb_mib // unit for r in reqs}
    scale = 1
    for u in set(units.values()):
        scale = scale * u // _gcd(scale, u)          # lcm: integer costs -scale/u
    cap = gpus * fb_mib // unit
    times = sorted({r.arrive for r in reqs} | {r.depart for r in reqs})
    index = {t: i for i, t in enumerate(times)}
    nodes = len(times)
    # residual graph: arc = [to, capacity, cost, index of the reverse arc]
    graph: List[List[list]] = [[] for _ in range(nodes)]

    def arc(a: int, b: int, c: int, w: int) -> None:
        graph[a].append([b, c, w, len(graph[b])])
        graph[b].append([a, 0, -w, len(graph[a]) - 1])

    for i in range(nodes - 1):
        arc(i, i + 1, cap, 0)
    for r in reqs:
        arc(index[r.arrive], index[r.depart], units[r.n], -scale // units[r.n])
    # potentials: shortest distances in the initial DAG (every arc goes forward in time)
    pot = [0] * nodes
    for i in range(nodes):
        for b, c, w, _ in graph[i]:
            if c > 0 and b > i and pot[i] + w < pot[b]:
                pot[b] = pot[i] + w
    src, dst, flow, cost = 0, nodes - 1, 0, 0
    inf = float("inf")
    while flow < cap:                                # successive shortest paths (Dijkstra, reduced costs)
        dist = [inf] * nodes
        prev: List[Optional[Tuple[int, int]]] = [None] * nodes
        dist[src] = 0
        heap = [(0, src)]
        while heap:
            d, a = heapq.heappop(heap)
            if d > dist[a]:
                continue
            for j, (b, c, w, _) in enumerate(graph[a]):
                if c > 0:
                    nd = d + w + pot[a] - pot[b]
                    if nd < dist[b]:
                        dist[b] = nd
                        prev[b] = (a, j)
                        heapq.heappush(heap, (nd, b))
        for i in range(nodes):
            if dist[i] < inf:
                pot[i] += dist[i]
        push, b = cap - flow, dst
        while b != src:
            a, j = prev[b]
            push = min(push, graph[a][j][1])
            b = a
        b = dst
        while b != src:
            a, j = prev[b]
            e = graph[a][j]
            e[1] -= push
            graph[b][e[3]][1] += push
            cost += push * e[2]
            b = a
        flow += push
    return -cost / scale


def _size_classes(reqs: List[Req], fb_mib: int, types: Dict[str, TypeInfo]) -> Tuple[List[int], Dict[int, int], List[int]]:
    """The trace's size classes: (framebuffer sizes ascending, size -> class index, max per GPU of each)."""
    sizes = sorted({types[r.profile].fb_mib for r in reqs})
    return sizes, {sz: i for i, sz in enumerate(sizes)}, [fb_mib // sz for sz in sizes]


def class_upper_bound(reqs: List[Req], gpus: int, fb_mib: int, types: Dict[str, TypeInfo],
                      time_limit: float) -> Optional[Tuple[float, Optional[float]]]:
    """(dual bound, best admissions found) of the class-aware integer program, or None without scipy.

    max sum x_r  s.t. at every arrival t, for each size class c:
    sum_{r in c active at t} x_r <= max_c * y_{c,t};  sum_c y_{c,t} <= gpus;  x binary, y integer >= 0.
    """
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:
        return None
    sizes, cls, per_gpu = _size_classes(reqs, fb_mib, types)
    n_cls, n_req = len(sizes), len(reqs)
    order = sorted(reqs, key=lambda r: r.arrive)
    n_arr = len(order)
    rows: List[int] = []
    cols: List[int] = []
    vals: List[int] = []
    active: Dict[int, Req] = {}
    departures: List[Tuple[float, int]] = []
    row = 0
    for k, a in enumerate(order):
        while departures and departures[0][0] <= a.arrive:     # a release before an arrival at equal times
            active.pop(heapq.heappop(departures)[1], None)
        active[a.n] = a
        heapq.heappush(departures, (a.depart, a.n))
        for r in active.values():
            rows.append(row + cls[types[r.profile].fb_mib])
            cols.append(r.n)
            vals.append(1)
        for c in range(n_cls):
            y = n_req + c * n_arr + k
            rows += [row + c, row + n_cls]
            cols += [y, y]
            vals += [-per_gpu[c], 1]
        row += n_cls + 1
    matrix = coo_matrix((vals, (rows, cols)), shape=(row, n_req + n_cls * n_arr)).tocsr()
    upper = np.zeros(row)
    upper[n_cls::n_cls + 1] = gpus
    cost = np.zeros(n_req + n_cls * n_arr)
    cost[:n_req] = -1
    res = milp(cost, constraints=LinearConstraint(matrix, -np.inf, upper),
               integrality=np.ones(len(cost)),
               bounds=Bounds(0, np.r_[np.ones(n_req), np.full(n_cls * n_arr, gpus)]),
               options={"time_limit": time_limit, "disp": False})
    dual = getattr(res, "mip_dual_bound", None)
    if dual is None or not np.isfinite(dual):
        return None
    return -dual, (-res.fun if res.fun is not None else None)


# --- the tight class-aware bound: a stronger formulation, cutting planes, a certificate -------------

@dataclass(frozen=True)
class TightBound:
    """A proven upper bound on the class-aware integer program's optimum, and a schedule that
    reaches ``best`` (so the optimum lies in ``best`` .. ``bound``).

    ``bound``: min(``lp``, ``bnb``) rounded down (admissions are whole).  ``lp``: the LP relaxation
    of the strengthened model after the cutting-plane rounds, as certified by its dual (see
    :func:`dual_certificate`; exact arithmetic up to float rounding, margin 1e-6).  ``bnb``: the
    branch-and-bound dual bound of HiGHS on the same model after the time limit (None: skipped or
    none); valid up to the solver's tolerances, like the plain row's.  ``optimal``: HiGHS closed the
    gap.  ``best``: admissions of the best schedule HiGHS found (0: none), checked with
    :func:`class_fits`.  ``cuts``: cutting planes added; ``rounds``: LP solves."""
    bound: int
    lp: float
    bnb: Optional[float]
    optimal: bool
    best: int
    cuts: int
    rounds: int


def class_fits(reqs: Sequence[Req], admitted, gpus: int, fb_mib: int, types: Dict[str, TypeInfo]) -> bool:
    """Whether the requests numbered in ``admitted`` keep the class-aware constraint: at every arrival
    (releases first at equal times), the sum over size classes of ceil(active / max per GPU) is at
    most ``gpus``.  Independent of the bound's model: it checks the schedules the bound reports."""
    admitted = set(admitted)
    size_of = {r.n: types[r.profile].fb_mib for r in reqs}
    active: Dict[int, int] = {}
    events = sorted([(r.arrive, 1, r.n) for r in reqs if r.n in admitted]
                    + [(r.depart, 0, r.n) for r in reqs if r.n in admitted])
    for _, kind, n in events:
        size = size_of[n]
        active[size] = active.get(size, 0) + (1 if kind else -1)
        if kind and sum(-(-k // (fb_mib // s)) for s, k in active.items()) > gpus:
            return False
    return True


def dual_certificate(matrix, upper, var_upper, objective, duals) -> float:
    """Weak duality: for max c.x s.t. A x <= b, 0 <= x <= u, every w >= 0 gives
    c.x = w.(A x) + (c - A^T w).x <= w.b + sum_j max(0, (c - A^T w)_j) u_j.  Returns that bound
    for ``duals`` (negative entries are taken as 0), so the bound does not rest on the LP solver
    having converged: any w, however found, is a certificate that can be checked by this sum."""
    import numpy as np
    w = np.maximum(np.asarray(duals, dtype=float), 0.0)
    reduced = np.asarray(objective, dtype=float) - matrix.T @ w
    return float(np.dot(w, upper) + np.dot(np.maximum(reduced, 0.0), var_upper))


def tight_class_bound(reqs: List[Req], gpus: int, fb_mib: int, types: Dict[str, TypeInfo],
                      time_limit: float, max_rounds: int = 60) -> Optional[TightBound]:
    """A tighter proven bound on the class-aware integer program of :func:`class_upper_bound`
    (same optimum), or None without scipy.  ``time_limit``: seconds for branch and bound (0: the
    cutting-plane LP only); the cutting-plane rounds take a few seconds on the bench's trace.

    The model, each step keeping the optimum:

    - y per size class and *set of requests that could be active* (a class's requests that have
      arrived and not left), not per arrival: arrivals with the same set need the same GPUs, so one
      variable serves them all; y <= ceil(|set| / max_c).  A class without requests needs no y.
    - a class with one vGPU per GPU (A40-48Q) needs exactly as many GPUs as it has active vGPUs:
      its y is replaced by the sum of its x in the coupling rows.
    - duplicate coupling rows (the same classes' sets) are dropped.

    Cutting planes (residual capacity inequalities of the single-row set
    {x in {0,1}^T, y integer: sum_T x <= m y}): for a class row with m = max_c, a subset T of its
    set with |T| = q and k = ceil(q / m) - 1, r = q - k m (so 0 < r <= m):

        sum_T x <= k m + r (y - k)

    Valid for every integer y: at y >= k + 1 the right side is >= q >= sum_T x; at y = k it is
    k m >= m y; at y = k - j (j >= 1) it is k m - r j >= m (k - j) as r <= m, and m y >= sum x.
    A round solves the LP (HiGHS) and adds, per class row whose y is fractional (k = floor(y)),
    the most violated such cut: T = the largest x values, at least k m + 1 and at most (k + 1) m of
    them, extended while x > y - k.  Rounds stop when none is violated.  The last LP's duals give
    the certified bound (:func:`dual_certificate`).  Then HiGHS's branch and bound runs on the model
    with its cuts, under ``time_limit``; its dual bound and its best schedule are reported.
    """
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, linprog, milp
        from scipy.sparse import csr_matrix
    except ImportError:
        return None
    sizes, cls, per_gpu = _size_classes(reqs, fb_mib, types)
    n_req = len(reqs)
    of = {r.n: cls[types[r.profile].fb_mib] for r in reqs}
    index = {r.n: i for i, r in enumerate(reqs)}       # column of x_r
    # sets of possibly active requests per class, one per change; coupling rows as tuples of sets
    sets: List[Tuple[int, Tuple[int, ...]]] = []        # (class, columns)
    current: List[Optional[int]] = [None] * len(sizes)  # set id per class now (None: empty)
    active: List[set] = [set() for _ in sizes]
    departures: List[Tuple[float, int]] = []
    couplings = set()
    for a in sorted(reqs, key=lambda r: r.arrive):
        changed = {of[a.n]}
        while departures and departures[0][0] <= a.arrive:     # a release before an arrival at equal times
            gone = heapq.heappop(departures)[1]
            active[of[gone]].discard(index[gone])
            changed.add(of[gone])
        active[of[a.n]].add(index[a.n])
        heapq.heappush(departures, (a.depart, a.n))
        for c in changed:
            current[c] = None
            if active[c]:
                current[c] = len(sets)
                sets.append((c, tuple(sorted(active[c]))))
        couplings.add(tuple(s for s in current if s is not None))
    y_col: Dict[int, int] = {}
    n_var = n_req
    for s, (c, members) in enumerate(sets):
        if per_gpu[c] > 1:
            y_col[s] = n_var
            n_var += 1
    var_upper = np.ones(n_var)
    rows: List[Tuple[List[int], List[float], float]] = []
    class_rows: List[Tuple[int, int]] = []              # (set, y column)
    for s, col in y_col.items():
        c, members = sets[s]
        var_upper[col] = -(-len(members) // per_gpu[c])
        rows.append((list(members) + [col], [1.0] * len(members) + [-float(per_gpu[c])], 0.0))
        class_rows.append((s, col))
    for tup in sorted(couplings):
        coef: Dict[int, float] = {}
        for s in tup:
            if s in y_col:
                coef[y_col[s]] = 1.0
            else:
                for j in sets[s][1]:
                    coef[j] = coef.get(j, 0.0) + 1.0
        rows.append((list(coef), list(coef.values()), float(gpus)))
    objective = np.zeros(n_var)
    objective[:n_req] = 1.0

    def assemble():
        r_idx = [k for k, (cols, _, _) in enumerate(rows) for _ in cols]
        c_idx = [j for cols, _, _ in rows for j in cols]
        vals = [v for _, vs, _ in rows for v in vs]
        return (csr_matrix((vals, (r_idx, c_idx)), shape=(len(rows), n_var)),
                np.array([b for _, _, b in rows]))

    cuts = rounds = 0
    certified = math.inf
    while rounds < max_rounds:
        matrix, upper = assemble()
        res = linprog(-objective, A_ub=matrix, b_ub=upper, bounds=np.c_[np.zeros(n_var), var_upper],
                      method="highs")
        rounds += 1
        if res.status != 0:
            return None
        certified = min(certified, dual_certificate(matrix, upper, var_upper, objective, -res.ineqlin.marginals))
        x = res.x
        added = 0
        for s, col in class_rows:
            c, members = sets[s]
            m = per_gpu[c]
            k = math.floor(x[col] + 1e-9)
            f = x[col] - k
            if f < 1e-6:
                continue
            chosen: List[int] = []
            violation = -k * m * (1 - f)
            for j in sorted(members, key=lambda j: -x[j]):
                if len(chosen) >= (k + 1) * m or (len(chosen) > k * m and x[j] <= f):
                    break
                chosen.append(j)
                violation += x[j] - f
            if len(chosen) <= k * m or violation <= 1e-6:
                continue
            r = len(chosen) - k * m
            rows.append((chosen + [col], [1.0] * len(chosen) + [-float(r)], float(k * (m - r))))
            added += 1
        cuts += added
        if not added:
            break
    bnb: Optional[float] = None
    optimal = False
    best = 0
    if time_limit > 0:
        matrix, upper = assemble()
        res = milp(-objective, constraints=LinearConstraint(matrix, -np.inf, upper),
                   integrality=np.ones(n_var), bounds=Bounds(0, var_upper),
                   options={"time_limit": time_limit, "disp": False})
        dual = getattr(res, "mip_dual_bound", None)
        if dual is not None and np.isfinite(dual):
            bnb = -dual
        if res.x is not None:
            chosen_reqs = [reqs[i].n for i in range(n_req) if res.x[i] > 0.5]
            if class_fits(reqs, chosen_reqs, gpus, fb_mib, types):
                best = len(chosen_reqs)
                optimal = res.status == 0
    bound = math.floor(min(certified, math.inf if bnb is None else bnb) + 1e-6)
    return TightBound(bound, certified, bnb, optimal and bound == best, best, cuts, rounds)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


# --- validation through the real create/remove -------------------------------------------------

def replay_real(args) -> Tuple[str, Dict[int, Decided], float]:
    """Replay the first ``limit`` events through vgpuhost.vgpu on a fresh simulated host."""
    strategy, reqs, events, gpus, limit = args
    from vgpuhost.model.errors import RefusedError
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.spec import parse_spec
    from vgpuhost.io.state import StateStore
    from vgpuhost.ops.vgpu import create, remove
    start = time.monotonic()
    out: Dict[int, Decided] = {}
    ids: Dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="vgpuhost-bench-") as tmp:
        host = materialise(parse_spec(spec_yaml(gpus)), Path(tmp) / "host")
        store = StateStore(host.state_dir)
        for _, kind, n in events[:limit]:
            r = reqs[n]
            if kind == 0:
                if n in ids:
                    remove(host, store, ids.pop(n), owner=r.owner, actor="bench")
                continue
            try:
                o = create(host, store, profile=r.profile, owner=r.owner, strategy=strategy, actor="bench")
            except RefusedError:
                out[n] = Decided(False, None)
                continue
            ids[n] = o.id
            out[n] = Decided(True, o.gpu)
        store.close()
    return strategy, out, time.monotonic() - start


# --- main --------------------------------------------------------------------------------------------

def _causes_text(causes: Dict[str, float]) -> str:
    """One line of :func:`replay_restarting`'s ``causes``: the refusals at arrival by cause, then the ended VMs."""
    words = {"rule": "by the strategy's rule although a GPU had room", "owner": "by one vGPU per VM per GPU",
             "fragmented": "fragmented (a repacked host would hold it)", "full": "full (a repacked host too)"}
    return (", ".join(f"{causes.get(k, 0):g} {words[k]}" for k in RESTART_CAUSES)
            + f"; {causes.get('ended', 0):g} restarts refused (the VM ended)")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    ap.add_argument("--seeds", type=int, default=1, metavar="N",
                    help="replay N traces, seeds SEED ... SEED+N-1, and print medians (default 1)")
    ap.add_argument("--requests", type=int, default=2000, help="vGPU requests in the trace (default 2000)")
    ap.add_argument("--gpus", type=int, default=16, help=f"A40 GPUs on the host (default 16, at most {MAX_GPUS})")
    ap.add_argument("--load", type=float, default=1.0,
                    help="offered load: mean framebuffer of active requests / the host's (default 1.0)")
    ap.add_argument("--validate", type=int, default=300, metavar="N",
                    help="replay the first N events through the real create/remove too (default 300; 0: off; "
                         "first seed only)")
    ap.add_argument("--clairvoyant", action="store_true",
                    help="also replay an experiment that knows every request's departure (not a strategy, "
                         "not a bound): what lifetimes known in advance would add to headroom")
    ap.add_argument("--repack", action="store_true",
                    help="also replay an experiment on a host that repacks every vGPU at every arrival (not a "
                         "strategy: vgpuhost does not migrate), admitting by best-fit's and headroom's rules: "
                         "what equal-size fragmentation costs them")
    ap.add_argument("--restarts", type=float, default=0.0, metavar="K",
                    help="also replay best-fit and headroom with repack at restart: each admitted vGPU restarts K "
                         "times over its life on average and is placed again then (default 0: off)")
    ap.add_argument("--bound-time", type=float, default=60.0, metavar="S",
                    help="time limit per trace for each class-aware bound's MILP (plain, tight), seconds (default 60; "
                         "0: skip both)")
    args = ap.parse_args(argv)
    if (not (1 <= args.gpus <= MAX_GPUS) or args.requests < 1 or args.load <= 0 or args.validate < 0
            or args.seeds < 1 or args.bound_time < 0 or args.restarts < 0):
        ap.error(f"need 1 <= --gpus <= {MAX_GPUS}, --requests >= 1, --load > 0, --validate >= 0, --seeds >= 1, "
                 "--bound-time >= 0, --restarts >= 0")
    t0 = time.monotonic()
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]) if sys.argv[0] else "bench/placement.py",
                                            *(sys.argv[1:] if argv is None else argv)])
    fb_mib, types, sim = board()
    seeds = list(range(args.seed, args.seed + args.seeds))
    reqs, events, mean_life = make_trace(seeds[0], args.requests, args.gpus, args.load, fb_mib, types)

    pool = None
    if args.validate:
        ctx = multiprocessing.get_context("fork")
        pool = ctx.Pool(len(STRATEGIES))
        pending = pool.map_async(replay_real, [(s, reqs, events, args.gpus, args.validate) for s in STRATEGIES])

    n = len(reqs)
    rows = []           # per seed: (seed, {strategy: results}, lp bound, class bound or None, TightBound or None)
    clair: Dict[int, int] = {}      # --clairvoyant: admissions per seed
    repack: Dict[str, Dict[int, int]] = {rule: {} for rule in REPACK_RULES}     # --repack: rule -> seed -> admissions
    restart: Dict[str, Dict[int, int]] = {rule: {} for rule in RESTART_RULES}   # --restarts: the same
    why: Dict[str, Dict[int, Dict[str, int]]] = {rule: {} for rule in RESTART_RULES}    # rule -> seed -> causes
    ownerless: Dict[int, int] = {}      # --restarts: headroom's replay with one vGPU per VM per GPU unenforced
    t_model = t_bound = t_class = t_tight = 0.0
    for seed in seeds:
        if seed != seeds[0]:
            reqs, events, _ = make_trace(seed, args.requests, args.gpus, args.load, fb_mib, types)
        t1 = time.monotonic()
        results = {s: replay_model(s, reqs, events, args.gpus, fb_mib, types, sim) for s in STRATEGIES}
        if args.clairvoyant:
            clair[seed] = replay_clairvoyant(reqs, events, args.gpus, fb_mib, types, sim)
        if args.repack:
            for rule in REPACK_RULES:
                repack[rule][seed] = replay_repacking(rule, reqs, events, args.gpus, fb_mib, types)
        if args.restarts:
            for rule in RESTART_RULES:
                why[rule][seed] = {}
                restart[rule][seed] = replay_restarting(rule, reqs, events, args.gpus, fb_mib, types, sim,
                                                        args.restarts, seed, causes=why[rule][seed])
            ownerless[seed] = replay_restarting("headroom", reqs, events, args.gpus, fb_mib, types, sim,
                                                args.restarts, seed, owners=False)
        t2 = time.monotonic()
        ub = lp_upper_bound(reqs, args.gpus, fb_mib, types)
        t3 = time.monotonic()
        cb = class_upper_bound(reqs, args.gpus, fb_mib, types, args.bound_time) if args.bound_time else None
        t4 = time.monotonic()
        tb = tight_class_bound(reqs, args.gpus, fb_mib, types, args.bound_time) if args.bound_time else None
        t_model, t_bound, t_class = t_model + t2 - t1, t_bound + t3 - t2, t_class + t4 - t3
        t_tight += time.monotonic() - t4
        rows.append((seed, results, ub, cb, tb))

    mix = ", ".join(f"{p} {w:.0%}" for p, w in MIX)
    print(f"$ {cmd}")
    print(f"seed {args.seed}" + (f"..{seeds[-1]}" if len(seeds) > 1 else "")
          + f"; host: {args.gpus} x {BOARD} ({fb_mib // 1024} GB, classic mdev, equal-size mode); "
          f"trace: {n} requests + their releases, Poisson arrivals, mean lifetime {mean_life:.1f} "
          f"inter-arrival times, offered load {args.load:.2f} x the host's framebuffer; "
          f"{SAME_VM:.0%} a further vGPU of the previous VM")
    print(f"mix: {mix}")
    print()

    def admitted(r: Dict[int, Decided]) -> int:
        return sum(1 for d in r.values() if d.admitted)

    def cb_text(cb) -> str:
        return "n/a" if cb is None else f"{math.floor(cb[0] + 1e-6)}"

    def proven(cb, tb) -> Optional[int]:
        """The tightest proven class-aware bound of a seed: the smaller of the two rows."""
        got = ([] if cb is None else [math.floor(cb[0] + 1e-6)]) + ([] if tb is None else [tb.bound])
        return min(got) if got else None

    def tight_note(tb) -> str:
        how = (f"cut LP {tb.lp:.1f} (certified)" + ("" if tb.bnb is None else f", B&B {tb.bnb:.1f}")
               + f"; {tb.cuts} cuts")
        if tb.optimal:
            return f"   (the optimum: {how}; a schedule of {tb.best} found, checked)"
        return f"   ({how}; best schedule found {tb.best}, checked: the optimum lies in {tb.best}..{tb.bound})"

    if len(seeds) == 1:
        _, results, ub, cb, tb = rows[0]
        bound = proven(cb, tb)
        print(f"{'strategy':<18} {'admitted':>9} {'share':>7} {'refused':>8} {'of which fragmented':>20} "
              f"{'of CB':>6}")
        for s in STRATEGIES:
            r = results[s]
            adm = admitted(r)
            frag = sum(1 for d in r.values() if not d.admitted and d.fragmented)
            of_cb = "" if bound is None else f"{adm / bound:.1%}"
            print(f"{s:<18} {adm:>9} {adm / n:>7.1%} {n - adm:>8} {frag:>20} {of_cb:>6}")
        if cb is None:
            print(f"{'class-aware bound':<18} {'n/a':>9}  (needs scipy, or --bound-time 0)")
        else:
            print(f"{'class-aware bound':<18} {cb_text(cb):>9} {math.floor(cb[0] + 1e-6) / n:>7.1%}"
                  + ("" if cb[1] is None else f"   (plain MILP: best found {cb[1]:.0f}, "
                                                 f"gap {cb[0] - cb[1]:.0f})"))
        if tb is None:
            print(f"{'tight class bound':<18} {'n/a':>9}  (needs scipy, or --bound-time 0)")
        else:
            print(f"{'tight class bound':<18} {tb.bound:>9} {tb.bound / n:>7.1%}" + tight_note(tb))
        print(f"{'LP bound':<18} {ub:>9.1f} {ub / n:>7.1%}")
        if clair:
            print(f"{'clairvoyant (exp.)':<18} {clair[rows[0][0]]:>9} {clair[rows[0][0]] / n:>7.1%}"
                  "   (knows departures: not a strategy, not a bound)")
        if args.repack:
            for rule in REPACK_RULES:
                got = repack[rule][rows[0][0]]
                of_cb = "" if bound is None else f"{got / bound:.1%}"
                print(f"{rule + ' repacked':<18} {got:>9} {got / n:>7.1%} {n - got:>8} {'':>20} {of_cb:>6}"
                      "   (exp.: repacks at every arrival; not a strategy)")
        if args.restarts:
            for rule in RESTART_RULES:
                got = restart[rule][rows[0][0]]
                of_cb = "" if bound is None else f"{got / bound:.1%}"
                print(f"{rule + ' restarts':<18} {got:>9} {got / n:>7.1%} {n - got:>8} {'':>20} {of_cb:>6}"
                      f"   (repack at restart: {args.restarts:g} restarts a VM's life, placed again then)")
                print(f"{'':<18} refused: {_causes_text(why[rule][rows[0][0]])}")
            got = ownerless[rows[0][0]]
            of_cb = "" if bound is None else f"{got / bound:.1%}"
            print(f"{'  owners ignored':<18} {got:>9} {got / n:>7.1%} {n - got:>8} {'':>20} {of_cb:>6}"
                  "   (exp.: headroom restarts, one vGPU per VM per GPU unenforced, as in the bounds)")
    else:
        print(f"{'seed':>5} " + " ".join(f"{s:>10}" for s in STRATEGIES)
              + f" {'class bnd':>10} {'tight bnd':>10} {'schedule':>9} {'LP bnd':>8}")
        for seed, results, ub, cb, tb in rows:
            print(f"{seed:>5} " + " ".join(f"{admitted(results[s]):>10}" for s in STRATEGIES)
                  + f" {cb_text(cb):>10} {'n/a' if tb is None else tb.bound:>10} "
                  f"{'n/a' if tb is None else tb.best:>9} {ub:>8.1f}")
        med = {s: statistics.median(admitted(r[1][s]) for r in rows) for s in STRATEGIES}

        def median_of(values) -> Optional[float]:
            return statistics.median(values) if values and None not in values else None

        med_plain = median_of([None if r[3] is None else math.floor(r[3][0] + 1e-6) for r in rows])
        med_tight = median_of([None if r[4] is None else r[4].bound for r in rows])
        med_sched = median_of([None if r[4] is None else r[4].best for r in rows])
        med_cb = median_of([proven(r[3], r[4]) for r in rows])
        which = ("the tight bound's" if med_tight is not None and med_cb == med_tight else "the class-aware bound's")

        def cell(v, w: int, share: bool = False) -> str:
            return f"{'n/a':>{w}}" if v is None else (f"{v / n:>{w}.1%}" if share else f"{v:>{w}.1f}")

        print(f"{'median':>5} " + " ".join(f"{med[s]:>10.1f}" for s in STRATEGIES)
              + f" {cell(med_plain, 10)} {cell(med_tight, 10)} {cell(med_sched, 9)} "
              f"{statistics.median(r[2] for r in rows):>8.1f}")
        print(f"{'share':>5} " + " ".join(f"{med[s] / n:>10.1%}" for s in STRATEGIES)
              + f" {cell(med_plain, 10, True)} {cell(med_tight, 10, True)} {cell(med_sched, 9, True)} "
              f"{statistics.median(r[2] for r in rows) / n:>8.1%}")
        print()
        if any(r[4] is not None for r in rows):
            print("tight bound per seed: " + "; ".join(
                f"{r[0]}: " + ("n/a" if r[4] is None else
                               (f"optimum {r[4].best}" if r[4].optimal else f"{r[4].best}..{r[4].bound}")
                               + f" (cut LP {r[4].lp:.1f}" + ("" if r[4].bnb is None else f", B&B {r[4].bnb:.1f}")
                               + ")") for r in rows))
        for s in RESERVING:
            better = sum(1 for r in rows if admitted(r[1][s]) > admitted(r[1]["best-fit"]))
            print(f"{s} admits more than best-fit on {better} of {len(rows)} seeds")
        if med_cb is not None:
            best = max(STRATEGIES, key=lambda s: med[s])
            print(f"best strategy by median: {best}, {med[best] / med_cb:.1%} of {which} median ({med_cb:.1f}, "
                  "the tightest proven class-aware bound)")
            for s in RESERVING:
                if s != best:
                    print(f"{s}: {med[s] / med_cb:.1%} of {which} median")
            if med_sched is not None and med_sched:
                print(f"against the best schedules found (the integer program's optimum is at least these): "
                      f"{best} {med[best] / med_sched:.1%} of their median ({med_sched:.1f})")
        def experiment(label: str, got: dict, target: str = "") -> None:
            """One line per experiment: each seed's admissions, their median and its share of the bound."""
            m = statistics.median(got.values())
            print(f"{label}: " + " ".join(str(got[seed]) for seed, *_ in rows) + f", median {m:.1f}"
                  + ("" if med_cb is None else f", {m / med_cb:.1%} of {which} median{target}"))

        if args.repack:
            for rule in REPACK_RULES:
                experiment(f"{rule} on a host that repacks at every arrival (experiment; not a strategy)", repack[rule])
        if args.restarts:
            for rule in RESTART_RULES:
                experiment(f"{rule} with repack at restart ({args.restarts:g} restarts a VM's life, placed again "
                           "then)", restart[rule], " (target >= 96%)")
                print(f"  refused, median per trace: " + _causes_text(
                    {k: statistics.median(c.get(k, 0) for c in why[rule].values())
                     for k in RESTART_CAUSES + ("ended",)}))
            experiment("headroom with repack at restart, one vGPU per VM per GPU unenforced as in the bounds "
                       "(experiment; vgpuhost enforces it)", ownerless)
        if clair:
            experiment("clairvoyant experiment (knows departures; not a strategy)", clair)
    print()
    print("fragmented: refused although the host's free framebuffer, summed over GPUs, would have held it.")
    print("class-aware bound: at every arrival, sum over size classes of ceil(active / max per GPU) <= GPUs;")
    print("the plain MILP's dual bound (valid even when the time limit stops the solver).  tight class bound:")
    print("the same integer program, a stronger model with cutting planes; its LP bound is certified by a dual")
    print("solution, then branch and bound lowers it; 'schedule': the most admissions of a schedule found that")
    print("keeps the constraint (checked), so the optimum lies between it and the tight bound.  'of CB': of the")
    print("tightest proven bound.  LP bound: the active framebuffer fits the host's (exact, as a min-cost")
    print("flow).  No placement — online or offline, with or without migration — admits more than any of the")
    print("bounds on the trace (see the module docstring).")

    status = 0
    if pool is not None:
        real = pending.get(timeout=600)
        pool.close()
        pool.join()
        reqs, events, _ = make_trace(seeds[0], args.requests, args.gpus, args.load, fb_mib, types)
        limited = {s: replay_model(s, reqs, events, args.gpus, fb_mib, types, sim, limit=args.validate)
                   for s in STRATEGIES}
        arrivals = sum(1 for _, kind, _ in events[:args.validate] if kind == 1)
        lines = []
        for s, got, secs in real:
            want = limited[s]
            diff = [k for k in want if (want[k].admitted, want[k].gpu) != (got[k].admitted, got[k].gpu)]
            refused = sum(1 for d in got.values() if not d.admitted)
            lines.append(f"  {s:<10} {arrivals} requests, {refused} refused: "
                         + ("model == real" if not diff else
                            f"{len(diff)} DIFFER, first request {diff[0]}: model {want[diff[0]]}, "
                            f"real {got[diff[0]]}") + f" ({secs:.1f} s)")
            status = status or (1 if diff else 0)
        print()
        print(f"validation: the first {args.validate} events of seed {seeds[0]} through "
              f"vgpuhost.vgpu.create/remove on a simulated {args.gpus}-GPU host, decision by decision "
              "(admitted?, which GPU):")
        print("\n".join(lines))
    print()
    print(f"time: model {t_model:.2f} s, LP bound {t_bound:.2f} s, class-aware bound {t_class:.1f} s, "
          f"tight class bound {t_tight:.1f} s, "
          f"total {time.monotonic() - t0:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
