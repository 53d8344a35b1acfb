"""Utilisation under tenancy: a seeded multi-tenant trace replayed two ways.

    python bench/utilisation.py [--trace today|diurnal] [--seed N] [--seeds N] [--arrivals N] [--known]
                                [--batch-ceiling S] [--mode-switch] [--pools three|two] [--plot PNG] [--json]

The host: 16 GPUs of two boards (8 A40, 8 L40S, 48 GiB each) in three
pools: ``gold`` (fixed-share, 2+2 GPUs, serves guaranteed and burstable),
``std`` (equal-share, 4+4, burstable and best-effort), ``batch``
(best-effort, 2+2, best-effort); ``--pools two``: ``gold`` and one ``std`` of the
other 12 GPUs (the issue's "fewer, larger pools").  Four tenants with a QoS mix and quotas:
``prod`` (guaranteed, exclusive, avoids env=dev), ``research``
(burstable, shared), ``ci`` (best-effort, shared, env=dev), ``train``
(hardware isolation: passthrough only).

The trace: Poisson arrivals, exponential lifetimes (offered load about 2.5
VMs per GPU), each VM asking for a vGPU of its tenant's usual sizes on one
board (``train``: a whole GPU) and using a share of one GPU's time (0.15 to
0.45 for vGPU work, as hoarded GPUs are typically a third used; 0.5 to 0.9
for training).

Replays:
(a) hoarding baseline: every VM gets a whole free GPU of its board, or is
    turned away;
(b) vgpuhost: every arrival goes through admission and placement
    (:func:`vgpuhost.policy.admission.admit` over
    :class:`vgpuhost.policy.replay.HostModel`, best-fit), departures free
    their devices; after every event :func:`vgpuhost.policy.replay.violations`
    checks quota, isolation, QoS class and scheduler rules.  No vGPU carries
    an expected GPU time, so each counts its profile's fixed share, which
    never passes a GPU's ceiling of 1.0: placement by framebuffer, as before;
(c) compute-aware: as (b), each vGPU carrying an *estimated* GPU time, as
    ``vgpuhost.ops.gputime`` estimates it on a host: the busy-weighted mean metered use
    of its tenant's VMs on the same profile that ran before it (:class:`Estimator`;
    never the VM's own use from the trace), else the profile's fixed share;
    ``--known`` adds (c*), the same with each VM's own use (a reference);
(d) mixed-size + compute-aware: as (c), with the GPUs of the equal-share and
    best-effort pools (``std``, ``batch``) in mixed-size mode (``gold`` is
    fixed-share, which mixed-size mode does not allow): each GPU holds several
    vGPU sizes, each vGPU at a free placement id with the mixed-size maxima
    (:mod:`vgpuhost.model.mixedsize`; fragmentation counted), use estimated.
(e) reconciler: as (c), with the capacity reconciler
    (:func:`vgpuhost.policy.rebalance.decide`, the decision ``vgpuhost
    rebalance`` and the agent make) run every :data:`RECONCILE_EVERY` time
    units on the refusals since its last pass: empty GPUs move between
    pools toward refused starts (at most :data:`RECONCILE_MOVES` a pass,
    each pool keeping one GPU), never a busy one, never breaking a
    guarantee; the moves are counted;
(f) mixed-size + compute-aware + reconciler: (d) with (e)'s reconciler, the
    three together, as the issue's replay asks.  A GPU in mixed-size mode is
    one for the reconciler (it never joins the fixed-share ``gold``, as on a
    host); ``--mode-switch`` lets a moved GPU take its new pool's mode
    instead, a switch the product's reconciler does not make (an experiment).

``--trace diurnal`` (:func:`run_diurnal`): two pools (``desk``, ``compute``) on the same 16 GPUs;
desktops (B and Q, burstable) arrive most at midday, compute (C, best-effort; MIG-backed demand stood
in by C types of MIG-slice sizes, as the model has no MIG) most at midnight; replays hoarding, an even
split, the best static split (searched knowing the trace), the reconciler from the even split, and (o)
one shared equal-share pool serving both classes (:func:`shared_pool`), all compute-aware (estimated
use) in mixed-size mode.  There a day is 24 hours of :data:`DAY` / 24 time
units each, and the reconciler gets what ``vgpuhost.ops.rebalance`` reads on a host: the time of day,
the moves of the last hour, and each pool's metered demand per hour (:func:`_meter_classes`), from
which the product's decision forecasts each pool's need from the same hours of the previous day.
Prints the reconciler's admitted share against the best static split's, the pool bound
(:func:`pools_bound`: what free, instant, clairvoyant moves could serve), and with ``--plot PNG`` the
reconciler's pool sizes and the demand over time (matplotlib, an optional dependency: a skip line
without it).

Printed: the trace's ceiling (the GPU-time demand were every VM admitted);
admitted share; time-averaged shares of the fleet's GPU time served (each
GPU serves at most 1.0), of starved demand (use above 1.0 per GPU: a
noisy-neighbour QoS loss), of demand admitted, of framebuffer asked and of
GPUs held; each over the whole span and over the steady window (after a
warm-up of three mean lifetimes, before the last arrival); violations (must
be 0); the ratio c/a; the refusals of each replay by rule, each split by
tenant (``refusals`` in ``--json``: counts by ``CODE`` and by
``CODE:TENANT``).  ``--seeds N`` prints medians over N seeds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vgpuhost.model.gputime import METERED, TENANT_PROFILE, ExpectedUse  # noqa: E402
from vgpuhost.model.tenancy import Limits, Quota, Tenant  # noqa: E402
from vgpuhost.model.values import replace  # noqa: E402
from vgpuhost.policy import admission as adm  # noqa: E402
from vgpuhost.policy import rebalance as rb  # noqa: E402
from vgpuhost.policy.feasibility import HostGpu  # noqa: E402
from vgpuhost.policy.replay import Board, HostModel, violations  # noqa: E402

GIB = 1024
A40, L40S = Board("A40", 48 * GIB), Board("L40S", 48 * GIB)
GPUS = {**{f"0000:{0x10 + i:02x}:00.0": A40 for i in range(8)},
        **{f"0000:{0x90 + i:02x}:00.0": L40S for i in range(8)}}


def pools(layout: str = "three"):
    """Today's pools: ``three`` (gold 2+2, std 4+4, batch 2+2), or ``two`` (gold 2+2 and one equal-share
    ``std`` of the other 12 GPUs serving burstable and best-effort: the issue's "fewer, larger pools")."""
    a = sorted(g for g, b in GPUS.items() if b is A40)
    ll = sorted(g for g, b in GPUS.items() if b is L40S)
    gold = adm.Pool("gold", "fixed-share", ("guaranteed", "burstable"), (*a[:2], *ll[:2]))
    if layout == "two":
        return [gold, adm.Pool("std", "equal-share", ("burstable", "best-effort"), (*a[2:], *ll[2:]))]
    return [gold,
            adm.Pool("std", "equal-share", ("burstable", "best-effort"), (*a[2:6], *ll[2:6])),
            adm.Pool("batch", "best-effort", ("best-effort",), (*a[6:], *ll[6:]))]


def tenants():
    return {t.name: t.validate() for t in (
        Tenant("prod", "guaranteed", "exclusive",
               Quota(Limits(vgpus=12, framebuffer_mib=192 * GIB), Limits(vgpus=16, framebuffer_mib=256 * GIB),
                     frozenset("Q")), frozenset({"env=prod"}), frozenset({"env=dev"})),
        Tenant("research", "burstable", "shared",
               Quota(Limits(vgpus=30, framebuffer_mib=240 * GIB), Limits(vgpus=48, framebuffer_mib=360 * GIB),
                     frozenset("QC"))),
        Tenant("ci", "best-effort", "shared", Quota(Limits(vgpus=24), Limits(vgpus=40), frozenset("C")),
               frozenset({"env=dev"})),
        Tenant("train", "guaranteed", "hardware", Quota(Limits(passthrough_gpus=3), Limits(passthrough_gpus=4))),
    )}


MIX = {  # tenant: (weight, series, {size GB: weight})
    "prod": (0.2, "Q", {8: 5, 16: 3, 24: 2}),
    "research": (0.35, "Q", {4: 3, 8: 4, 12: 2, 16: 1}),
    "ci": (0.35, "C", {4: 6, 8: 4}),
    "train": (0.1, "", {}),
}


def trace(seed: int, arrivals: int):
    """``[(time, 'arrive'|'depart', vm)]`` sorted, and the VMs: ``{vm: (tenant, profile or None, board, use)}``."""
    rnd = random.Random(seed)
    rate, mean_life = 1.0, MEAN_LIFE          # offered load: 40 VMs at once on 16 GPUs
    names = list(MIX)
    weights = [MIX[n][0] for n in names]
    vms, events = {}, []
    t = 0.0
    for i in range(arrivals):
        t += rnd.expovariate(rate)
        tn = rnd.choices(names, weights)[0]
        board = rnd.choice(("A40", "L40S"))
        _, series, sizes = MIX[tn]
        if tn == "train":
            profile, use = None, rnd.uniform(0.5, 0.9)
        else:
            gb = rnd.choices(list(sizes), list(sizes.values()))[0]
            profile, use = f"{board}-{gb}{series}", rnd.uniform(0.15, 0.45)
        vm = f"vm{i}"
        vms[vm] = (tn, profile, board, use)
        events.append((t, 0, "arrive", vm))
        events.append((t + rnd.expovariate(1 / mean_life), 1, "depart", vm))
    events.sort()
    return [(e[0], e[2], e[3]) for e in events], vms


#: the steady window: after the warm-up (three mean lifetimes) and before the last arrival (the drain)
WARMUP_LIVES = 3.0
MEAN_LIFE = 40.0


class Meter:
    """Time-weighted averages of the fleet's state between events, over the whole span and over the
    steady window ``[steady_from, steady_to)``."""

    FIELDS = ("fb", "time", "held", "starved", "demand")

    def __init__(self, steady=(0.0, float("inf"))):
        self.last = None
        self.steady = steady
        self.span = self.steady_span = 0.0
        self.sums = dict.fromkeys(self.FIELDS, 0.0)
        self.steady_sums = dict.fromkeys(self.FIELDS, 0.0)

    def tick(self, now: float, values) -> None:
        if self.last is not None:
            dt = now - self.last
            self.span += dt
            lo, hi = max(self.last, self.steady[0]), min(now, self.steady[1])
            sdt = max(0.0, hi - lo)
            self.steady_span += sdt
            for k, v in zip(self.FIELDS, values):
                self.sums[k] += v * dt
                self.steady_sums[k] += v * sdt
        self.last = now

    def result(self, steady: bool = False):
        """``{field: time-weighted mean}`` over the whole span (or the steady window)."""
        sums, span = (self.steady_sums, self.steady_span) if steady else (self.sums, self.span)
        return {k: v / (span or 1.0) for k, v in sums.items()}


def _shares(placed, vms):
    """``placed``: {vm: [(gpu, framebuffer MiB)]} -> (framebuffer share, GPU time served share, GPUs held
    share, starved demand share (use above one GPU's time, per GPU), demand share (all it asks))."""
    total_fb = sum(b.memory_mib for b in GPUS.values())
    fb, use_by_gpu = 0, {}
    for vm, where in placed.items():
        use = vms[vm][3]
        for gpu, mib in where:
            fb += mib
            use_by_gpu[gpu] = use_by_gpu.get(gpu, 0.0) + use
    time = sum(min(1.0, u) for u in use_by_gpu.values())
    starved = sum(max(0.0, u - 1.0) for u in use_by_gpu.values())
    n = len(GPUS)
    return fb / total_fb, time / n, len(use_by_gpu) / n, starved / n, sum(use_by_gpu.values()) / n


def demand_ceiling(events, vms, steady):
    """The trace's own ceiling: the GPU-time demand if every VM were admitted, as a share of the fleet
    (uncapped, and capped at the fleet's GPUs), whole span and steady window."""
    live, m_raw, m_cap = set(), Meter(steady), Meter(steady)
    n = len(GPUS)
    for now, kind, vm in events:
        d = sum(vms[v][3] for v in live) / n
        m_raw.tick(now, (0, d, 0, 0, d))
        m_cap.tick(now, (0, min(1.0, d), 0, 0, d))
        (live.add if kind == "arrive" else live.discard)(vm)
    return {"demand": m_raw.result()["time"], "capped": m_cap.result()["time"],
            "demand_steady": m_raw.result(True)["time"], "capped_steady": m_cap.result(True)["time"]}


def replay_hoarding(events, vms, steady):
    free = {g for g in GPUS}
    placed, admitted, meter = {}, 0, Meter(steady)
    per = {}
    for now, kind, vm in events:
        meter.tick(now, _shares(placed, vms))
        tn, profile, board, _ = vms[vm]
        if kind == "arrive":
            cands = sorted(g for g in free if profile is None or GPUS[g].name == board)
            if cands:
                g = cands[0]
                free.discard(g)
                mib = GPUS[g].memory_mib if profile is None else int(profile.split("-")[1][:-1]) * GIB
                placed[vm] = [(g, mib)]
                admitted += 1
                per[tn] = per.get(tn, 0) + 1
        elif vm in placed:
            free.add(placed.pop(vm)[0][0])
    return admitted, meter, 0, {}, per


class Estimator:
    """What ``vgpuhost.ops.gputime`` does on a host, over the trace: a new VM's expected GPU time is the
    mean metered use of its tenant's VMs on the same profile that ran before it, each VM's use weighted by
    its busy time (``sum(u * u) / sum(u)``, each VM standing for the same allocated time: idle VMs weigh
    nothing, so idle decoys cannot lower it; trial 10a finding 11), else the profile's fixed share (use
    is learnt when a VM has run, never read from the trace for the VM itself)."""

    def __init__(self):
        self.sums = {}

    def learn(self, tenant, profile, use) -> None:
        n, b, w = self.sums.get((tenant, profile), (0, 0.0, 0.0))
        use = min(1.0, use)
        self.sums[(tenant, profile)] = (n + 1, b + use, w + use * use)

    def estimate(self, tenant, profile):
        n, b, w = self.sums.get((tenant, profile), (0, 0.0, 0.0))
        return ExpectedUse(w / b, TENANT_PROFILE, float(n)) if n and b > 0 else None


#: time units between two passes of the reconciler in replay (e) (a sixteenth of a mean lifetime)
RECONCILE_EVERY = 2.5
#: moves a pass may make (the reconciler's changes_per_hour, a pass standing for its hour)
RECONCILE_MOVES = 4
#: the diurnal trace's reconciler (an hour is a 24th of :data:`DAY`): moves in any hour, and the hours
#: ahead it forecasts each pool's need (from the same hours of the previous day, else the trend)
RECONCILE_MOVES_PER_HOUR = 8
HORIZON_H = 1


def _host_gpus(model):
    """The GPUs as the guarantee check sees them (every time-sliced size of the board, Q and C)."""
    out = []
    for g, b in sorted(model.gpus.items()):
        types = tuple((f"{b.name}-{gb}{s}", gb * GIB, 0) for gb in b.sizes_gb for s in "QC")
        out.append(HostGpu(g, b.memory_mib, types, 0, tuple((gb * GIB, b.memory_mib // (gb * GIB))
                                                             for gb in b.sizes_gb)))
    return out


def reconcile(model, ts, refused, host_gpus, *, now=0.0, metered=None, day=None, moved_at=(), switch=False):
    """One pass of the capacity reconciler over ``model`` (its pools replaced by the moves); the moves.

    The decision is the product's (:func:`vgpuhost.policy.rebalance.decide`), on the facts
    ``vgpuhost.ops.rebalance.facts`` reads on a host: the GPUs (busy when they hold anything), the
    refusals since the last pass, the held vGPUs with their expected use, and, with ``metered``
    (``{QoS class: [mean vGPUs held per hour]}``, as the hourly rollups of ``ops.metering`` give) and
    ``day`` (time units a day is: a bench hour is ``day / 24``), each pool's metered history for the
    forecast, the time of day and the moves of the last hour (``moved_at``: their times).

    A GPU in mixed-size mode (``model.mixed``) is one for the decision too (it never joins a
    fixed-share pool), unless ``switch``: then each moved GPU takes its new pool's mode (mixed-size
    outside fixed-share pools; an experiment: the product's reconciler makes no mode switch)."""
    busy = {a.gpu for a in model.allocations}
    gpus = [rb.GpuFacts(g, "holds devices" if g in busy else "",
                        tuple(f"{b.name}-{gb}{s}".lower() for gb in b.sizes_gb for s in "QCB"), b.memory_mib,
                        g in model.mixed and not switch)
            for g, b in sorted(model.gpus.items())]
    if day is None:
        bounds = rb.Bounds(changes_per_hour=RECONCILE_MOVES, window_min=int(RECONCILE_EVERY), horizon_h=0)
        d = rb.decide(pools=model.pools, gpus=gpus, refusals=refused, tenants=ts, held=model.allocations,
                      host_gpus=host_gpus, bounds=bounds, minute_of_day=720, moves_last_hour=0)
    else:
        hour = day / 24
        bounds = rb.Bounds(changes_per_hour=RECONCILE_MOVES_PER_HOUR, window_min=int(RECONCILE_EVERY / hour * 60),
                           horizon_h=HORIZON_H)
        names = [p.name for p in model.pools]
        history = rb.pool_history(metered or {}, model.pools, names)
        d = rb.decide(pools=model.pools, gpus=gpus, refusals=refused, tenants=ts, held=model.allocations,
                      host_gpus=host_gpus, bounds=bounds, minute_of_day=int((now % day) / day * 1440),
                      moves_last_hour=sum(1 for t in moved_at if t > now - hour), history=history)
    for m in d.moves:
        model.pools = rb.with_move(model.pools, m.gpu, m.to_pool)
    if switch and d.moves:
        model.mixed = frozenset(g for p in model.pools if p.policy != "fixed-share" for g in p.gpus)
    return d.moves


def replay_vgpuhost(events, vms, steady, *, use="none", pool_set=None, mixed=False, reconciler=False,
                    ts=None, timeline=None, day=None, switch=False):
    """Replay through admission.  ``use``: ``none`` (today: no GPU-time estimate, every vGPU counts its
    fixed share), ``estimated`` (:class:`Estimator`), ``known`` (the trace's own use: a reference).
    ``reconciler``: run :func:`reconcile` every :data:`RECONCILE_EVERY` (replay (e)); the moves are
    returned in ``codes['moves']``.  ``ts``: the tenants (None: :func:`tenants`); ``timeline``: a list
    each reconciler pass appends ``(time, {pool: GPUs})`` to; ``day``: time units a day is (the diurnal
    trace: the reconciler gets each pool's metered history per hour, a 24th of it, and forecasts)."""
    ts = ts if ts is not None else tenants()
    ps = pool_set if pool_set is not None else pools()
    model = HostModel(GPUS, ps, [g for p in ps if p.policy != "fixed-share" for g in p.gpus] if mixed else ())
    est = Estimator()
    placed, admitted, meter, broken = {}, 0, Meter(steady), 0
    codes, per = {}, {}
    refused, next_pass, moves, hg = [], RECONCILE_EVERY, 0, _host_gpus(model)
    metered, moved_at, last = {}, [], 0.0
    for now, kind, vm in events:
        meter.tick(now, _shares(placed, vms))
        if reconciler and day is not None:
            _meter_classes(metered, model, last, now, day / 24)
            last = now
        if reconciler and now >= next_pass:
            hours = int(now // (day / 24)) if day else 0
            done = reconcile(model, ts, refused, hg, now=now, day=day, moved_at=moved_at, switch=switch,
                             metered={q: (ys + [0.0] * hours)[:hours] for q, ys in metered.items()})
            moves += len(done)
            moved_at += [now] * len(done)
            if timeline is not None:
                timeline.append((now, {p.name: len(p.gpus) for p in model.pools}))
            refused, next_pass = [], now + RECONCILE_EVERY
        tn, profile, board, u = vms[vm]
        if kind == "arrive":
            demand = adm.passthrough_demand() if profile is None else adm.vgpu_demand(profile)
            if profile is not None and use == "estimated":
                demand = replace(demand, use=est.estimate(tn, profile))
            elif profile is not None and use == "known":
                demand = replace(demand, use=ExpectedUse(u, METERED))
            d = model.arrive(vm, demand, ts, tenant=tn, strategy="best-fit")
            if d.admitted:
                admitted += 1
                per[tn] = per.get(tn, 0) + 1
                mib = GPUS[d.gpu].memory_mib if profile is None else demand.framebuffer_mib
                placed[vm] = [(d.gpu, mib)]
            else:
                codes[d.code] = codes.get(d.code, 0) + 1
                codes[f"{d.code}:{tn}"] = codes.get(f"{d.code}:{tn}", 0) + 1    # the same, by tenant
                if profile is not None and d.code in rb.DEMAND_CODES:
                    refused.append(rb.Refusal(f"{now:.1f}", profile, tn, d.qos, d.code))
        elif vm in placed:
            model.depart(vm)
            placed.pop(vm)
            if profile is not None:
                est.learn(tn, profile, u)       # metered while it ran
        broken += len(violations(model, ts))
    if reconciler:
        codes["moves"] = moves
    return admitted, meter, broken, codes, per


def _meter_classes(metered, model, t0, t1, hour):
    """Add the vGPUs ``model`` holds, per QoS class, over ``[t0, t1)`` to ``metered`` (``{class: [mean
    vGPUs held per hour]}``): what the hourly rollups of ``ops.metering`` record on a host."""
    count = {}
    for a in model.allocations:
        count[a.qos] = count.get(a.qos, 0) + 1
    i = int(t0 // hour)
    while i * hour < t1:
        lo, hi = max(t0, i * hour), min(t1, (i + 1) * hour)
        for q, c in count.items():
            ys = metered.setdefault(q, [])
            ys.extend([0.0] * (i + 1 - len(ys)))
            ys[i] += c * max(0.0, hi - lo) / hour
        i += 1


REPLAYS = (("hoarding", "(a) hoarding", None), ("vgpuhost", "(b) vgpuhost", "none"),
           ("compute_aware", "(c) compute-aware", "estimated"),
           ("mixed_compute_aware", "(d) mixed-size + compute-aware", "estimated-mixed"),
           ("reconciler", "(e) reconciler", "reconciler"),
           ("all", "(f) mixed-size + compute-aware + reconciler", "reconciler-mixed"))


def run(seed: int, arrivals: int, *, known: bool = False, batch_ceiling=None, switch: bool = False,
        layout: str = "three"):
    """One seed: the document :func:`main` prints.  ``batch_ceiling``: the compute ceiling of pool
    ``batch`` (best-effort) in the compute-aware replays (None: 1.0).  ``switch``: in (f), a moved GPU
    takes its new pool's mode (:func:`reconcile`; an experiment).  ``layout``: the pools (:func:`pools`)."""
    events, vms = trace(seed, arrivals)
    last_arrival = max(t for t, k, _ in events if k == "arrive")
    steady = (WARMUP_LIVES * MEAN_LIFE, last_arrival)
    n = len(vms)
    asked = {}
    for tn, *_ in vms.values():
        asked[tn] = asked.get(tn, 0) + 1
    doc = {"trace": "today", "seed": seed, "arrivals": n, "events": len(events), "gpus": len(GPUS),
           "batch_ceiling": batch_ceiling, "pools": layout,
           "steady_window": list(steady), "trace_ceiling": demand_ceiling(events, vms, steady)}
    replays = list(REPLAYS) + ([("compute_aware_known", "(c*) known use", "known")] if known else [])
    doc["replays"] = [[k, lab] for k, lab, _ in replays]
    for key, _, use in replays:
        if use is None:
            adm_n, meter, broken, codes, per = replay_hoarding(events, vms, steady)
        else:
            ps = [replace(p, ceiling=batch_ceiling) if p.name == "batch" and use != "none" else p
                  for p in pools(layout)]
            adm_n, meter, broken, codes, per = replay_vgpuhost(
                events, vms, steady, use="estimated" if use.startswith("reconciler") else use.replace("-mixed", ""),
                pool_set=ps, mixed=use.endswith("-mixed"), reconciler=use.startswith("reconciler"),
                switch=switch and use == "reconciler-mixed")
        doc[key] = _figures(adm_n, n, meter, broken, codes, per, asked)
    a = doc["hoarding"]
    doc["ratio_c_over_a"] = {k: (doc["compute_aware"][k] / a[k]) if a[k] else None
                             for k in ("admitted_share", "framebuffer_share", "time_share")}
    return doc


# ---------------------------------------------------------------------------
# the diurnal trace (--trace diurnal): desktops by day, compute by night

#: one day in time units; lifetimes are short beside it, so the mix turns over within a half day
DAY = 200.0
#: mean lifetime of a diurnal VM (the steady window starts WARMUP_LIVES of them in)
DIURNAL_LIFE = 15.0
#: peak arrival rates (per time unit): desktops at midday, compute at midnight
DESK_RATE, COMPUTE_RATE = 6.0, 1.6
#: the floor of each rate, as a share of its peak (some desktops at night, some compute by day)
RATE_FLOOR = 0.1
DESK, COMPUTE = "office", "hpc"
DIURNAL_MIX = {  # tenant: (series, {profile suffix: weight}, use range)
    DESK: ("QB", {"1B": 2, "2B": 3, "4Q": 3, "8Q": 2}, (0.08, 0.2)),
    # C on whole MIG-slice sizes (24C, 48C: what a 3g/7g GPU instance holds): the model has no MIG,
    # so MIG-backed compute is stood in by the time-sliced C type of the same framebuffer
    COMPUTE: ("C", {"12C": 2, "24C": 3, "48C": 1}, (0.4, 0.9)),
}


def diurnal_tenants():
    return {t.name: t.validate() for t in (
        Tenant(DESK, "burstable", "shared", Quota(Limits(vgpus=400), Limits(vgpus=400), frozenset("QB"))),
        Tenant(COMPUTE, "best-effort", "shared", Quota(Limits(vgpus=200), Limits(vgpus=200), frozenset("C"))),
    )}


def diurnal_pools(desk: int):
    """Two pools: ``desk`` (equal-share, serves burstable: the desktops) on ``desk`` GPUs, ``compute``
    (best-effort, serves best-effort) on the others; each board split as evenly as it goes."""
    a = sorted(g for g, b in GPUS.items() if b is A40)
    ll = sorted(g for g, b in GPUS.items() if b is L40S)
    na, nl = (desk + 1) // 2, desk // 2
    return [adm.Pool("desk", "equal-share", ("burstable",), (*a[:na], *ll[:nl])),
            adm.Pool("compute", "best-effort", ("best-effort",), (*a[na:], *ll[nl:]))]


def shared_pool():
    """One pool on all 16 GPUs: equal-share, serving burstable (the desktops) and best-effort (compute), so
    a compute VM and desktops share a GPU where their expected GPU time fits under the ceiling of 1.0."""
    return [adm.Pool("shared", "equal-share", ("burstable", "best-effort"), tuple(sorted(GPUS)))]


def day_phase(t: float) -> float:
    """0 at midnight, 1 at midday (a cosine over :data:`DAY`)."""
    return 0.5 - 0.5 * math.cos(2 * math.pi * t / DAY)


def diurnal_trace(seed: int, arrivals: int):
    """As :func:`trace`: desktops (B and Q) arrive at a rate that peaks at midday, compute (C) at one
    that peaks at midnight (:data:`DESK_RATE`, :data:`COMPUTE_RATE`, each at least :data:`RATE_FLOOR`
    of its peak), by thinning a Poisson process of the two peaks' sum."""
    rnd = random.Random(seed)
    peak = DESK_RATE + COMPUTE_RATE
    vms, events = {}, []
    t, i = 0.0, 0
    while i < arrivals:
        t += rnd.expovariate(peak)
        ph = day_phase(t)
        desk = DESK_RATE * (RATE_FLOOR + (1 - RATE_FLOOR) * ph)
        comp = COMPUTE_RATE * (RATE_FLOOR + (1 - RATE_FLOOR) * (1 - ph))
        x = rnd.random() * peak
        if x >= desk + comp:
            continue
        tn = DESK if x < desk else COMPUTE
        series, sizes, (lo, hi) = DIURNAL_MIX[tn]
        board = rnd.choice(("A40", "L40S"))
        profile = f"{board}-{rnd.choices(list(sizes), list(sizes.values()))[0]}"
        vm = f"vm{i}"
        vms[vm] = (tn, profile, board, rnd.uniform(lo, hi))
        events.append((t, 0, "arrive", vm))
        events.append((t + rnd.expovariate(1 / DIURNAL_LIFE), 1, "depart", vm))
        i += 1
    events.sort()
    return [(e[0], e[2], e[3]) for e in events], vms


def _bound(events, vms, steady, served):
    """Time-weighted ``served(live)`` (GPU time, in GPUs) over the trace, live being the VMs arrived and
    not departed (admitted or not), as a share of the fleet: ``{time_share, time_share_steady}``."""
    live, meter = {}, Meter(steady)
    for now, kind, vm in events:
        meter.tick(now, (0, served(live.values()) / len(GPUS), 0, 0, 0))
        if kind == "arrive":
            live[vm] = vms[vm]
        else:
            live.pop(vm, None)
    return {"time_share": meter.result()["time"], "time_share_steady": meter.result(True)["time"]}


def pools_bound(events, vms, steady):
    """The most GPU time any pool reconciler could serve on the diurnal trace, as a share of the fleet
    (whole span, steady window): at every moment the split of the GPUs between desktops and compute
    that serves most, with moves free, instant and clairvoyant, desktops packed to a whole GPU each,
    and each compute VM alone on a GPU (its expected GPU time, about 0.65, leaves no room for a second
    under a ceiling of 1.0): max over k of min(desktop demand, GPUs - k) + the k largest compute uses."""
    n = len(GPUS)

    def served(live):
        desk = sum(v[3] for v in live if v[0] == DESK)
        comp = sorted((v[3] for v in live if v[0] != DESK), reverse=True)
        best, top = min(desk, n), 0.0
        for k in range(1, min(n, len(comp)) + 1):
            top += comp[k - 1]
            best = max(best, min(desk, n - k) + top)
        return best
    return _bound(events, vms, steady, served)


def shared_bound(events, vms, steady):
    """The most GPU time one shared pool could serve on the diurnal trace without starving any VM, as a
    share of the fleet (whole span, steady window): at every moment, clairvoyant, with running VMs moved
    free and at once, and framebuffer ignored but for a 48 GB type (a whole GPU: nothing beside it).  A
    VM using more than half a GPU needs a GPU of its own (two would pass 1.0); smaller ones fill what is
    left, split as finely as needed: max over the whole-GPU VMs ``a`` and large VMs ``b`` placed (the
    largest first) of ``A_a + min(B_b + small, N - a)``.  An upper bound: a placement that starves no VM
    never serves more."""
    n = len(GPUS)

    def served(live):
        whole = sorted((v[3] for v in live if v[1].endswith("-48C")), reverse=True)
        large = sorted((v[3] for v in live if not v[1].endswith("-48C") and v[3] > 0.5), reverse=True)
        small = sum(v[3] for v in live if not v[1].endswith("-48C") and v[3] <= 0.5)
        best, top_a = 0.0, 0.0
        for a in range(min(n, len(whole)) + 1):
            top_a += whole[a - 1] if a else 0.0
            top_b = 0.0
            for b in range(min(n - a, len(large)) + 1):
                top_b += large[b - 1] if b else 0.0
                best = max(best, top_a + min(top_b + small, n - a))
        return best
    return _bound(events, vms, steady, served)


#: the desk pool sizes the best static split is searched over first (then the two beside the best)
STATIC_SPLITS = tuple(range(2, 15, 2))


def run_diurnal(seed: int, arrivals: int, *, timeline=None):
    """One seed of the diurnal trace: hoarding, compute-aware on an even split (8 desk + 8 compute),
    compute-aware on the best static split (the one of :data:`STATIC_SPLITS` that admits most, chosen
    knowing the trace), the reconciler from the even split, and one shared pool (:func:`shared_pool`);
    use estimated.  ``timeline``: as
    :func:`replay_vgpuhost`'s, for the reconciler replay."""
    events, vms = diurnal_trace(seed, arrivals)
    last_arrival = max(t for t, k, _ in events if k == "arrive")
    steady = (WARMUP_LIVES * DIURNAL_LIFE, last_arrival)
    n = len(vms)
    ts = diurnal_tenants()
    asked = {}
    for tn, *_ in vms.values():
        asked[tn] = asked.get(tn, 0) + 1
    doc = {"trace": "diurnal", "seed": seed, "arrivals": n, "events": len(events), "gpus": len(GPUS),
           "steady_window": list(steady), "trace_ceiling": demand_ceiling(events, vms, steady),
           "pools_bound": pools_bound(events, vms, steady), "shared_bound": shared_bound(events, vms, steady),
           "replays": [list(r) for r in DIURNAL_REPLAYS]}

    def one(ps, reconciler=False, tl=None):
        adm_n, meter, broken, codes, per = replay_vgpuhost(events, vms, steady, use="estimated", pool_set=ps,
                                                           mixed=True, reconciler=reconciler, ts=ts, timeline=tl,
                                                           day=DAY if reconciler else None)
        return _figures(adm_n, n, meter, broken, codes, per, asked)

    adm_n, meter, broken, codes, per = replay_hoarding(events, vms, steady)
    doc["hoarding"] = _figures(adm_n, n, meter, broken, codes, per, asked)
    doc["even_pools"] = one(diurnal_pools(8))
    tried = {8: doc["even_pools"]}
    for k in STATIC_SPLITS:                     # every other split, then the two beside the best of them
        tried[k] = tried.get(k) or one(diurnal_pools(k))
    top = max(tried, key=lambda k: tried[k]["admitted_share"])
    for k in (top - 1, top + 1):
        if 1 <= k <= len(GPUS) - 1 and k not in tried:
            tried[k] = one(diurnal_pools(k))
    best = max(tried.items(), key=lambda kv: kv[1]["admitted_share"])
    doc["best_static"] = dict(best[1], desk_gpus=best[0])
    doc["reconciler"] = one(diurnal_pools(8), reconciler=True, tl=timeline)
    doc["shared_pool"] = one(shared_pool())
    b = doc["best_static"]["admitted_share"]
    doc["reconciler_over_best_static"] = doc["reconciler"]["admitted_share"] / b - 1 if b else None
    doc["shared_over_best_static"] = doc["shared_pool"]["admitted_share"] / b - 1 if b else None
    a = doc["hoarding"]
    doc["ratio_c_over_a"] = {k: (doc["best_static"][k] / a[k]) if a[k] else None
                             for k in ("admitted_share", "framebuffer_share", "time_share")}
    return doc


DIURNAL_REPLAYS = (("hoarding", "(a) hoarding"), ("even_pools", "(c) 8+8 pools"),
                   ("best_static", "(s) best static pools"), ("reconciler", "(e) reconciler"),
                   ("shared_pool", "(o) one shared pool"))


def demand_timeline(events, vms, at):
    """``[(time, desktop GPU-time demand, compute GPU-time demand)]`` of the VMs live (arrived, not yet
    departed, admitted or not) at each time of ``at`` (sorted)."""
    live, out, i = {}, [], 0
    for now in at:
        while i < len(events) and events[i][0] <= now:
            _, kind, vm = events[i]
            if kind == "arrive":
                live[vm] = vms[vm]
            else:
                live.pop(vm, None)
            i += 1
        d = sum(v[3] for v in live.values() if v[0] == DESK)
        out.append((now, d, sum(v[3] for v in live.values() if v[0] != DESK)))
    return out


def plot_diurnal(seed: int, arrivals: int, path: str) -> str:
    """Write the reconciler's pool sizes and the demand over time on the diurnal trace (seed ``seed``) as a
    PNG at ``path`` with matplotlib; the line to print (a skip line when matplotlib is not installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("plot skipped: matplotlib is not installed (an optional bench dependency: "
                "pip install 'vgpuhost[bench]' or apt install python3-matplotlib)")
    timeline = []
    events, vms = diurnal_trace(seed, arrivals)
    last_arrival = max(t for t, k, _ in events if k == "arrive")
    replay_vgpuhost(events, vms, (0.0, last_arrival), use="estimated", pool_set=diurnal_pools(8), mixed=True,
                    reconciler=True, ts=diurnal_tenants(), timeline=timeline, day=DAY)
    times = [t for t, _ in timeline]
    dem = demand_timeline(events, vms, times)
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=80)
    ax.step(times, [p.get("desk", 0) for _, p in timeline], where="post", color="tab:blue", label="desk pool (GPUs)")
    ax.step(times, [p.get("compute", 0) for _, p in timeline], where="post", color="tab:red",
            label="compute pool (GPUs)")
    ax.plot(times, [d for _, d, _ in dem], color="tab:blue", alpha=0.45, linestyle="--",
            label="desktop demand (GPU time)")
    ax.plot(times, [c for _, _, c in dem], color="tab:red", alpha=0.45, linestyle="--",
            label="compute demand (GPU time)")
    ax.set_xlabel(f"time (a day is {DAY:g} units)")
    ax.set_ylabel("GPUs")
    ax.set_ylim(0, len(GPUS) + 1)
    ax.set_title(f"capacity reconciler on the diurnal trace (seed {seed}, 16 GPUs)")
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"plot: {path}"


def _figures(adm_n, n, meter, broken, codes, per, asked):
    whole, st = meter.result(), meter.result(True)
    return {"admitted_share": adm_n / n, "framebuffer_share": whole["fb"], "time_share": whole["time"],
            "time_share_steady": st["time"], "starved_share": whole["starved"],
            "starved_share_steady": st["starved"], "demand_share": whole["demand"],
            "gpus_held_share": whole["held"], "violations": broken, "refusals": codes,
            "admitted_by_tenant": {t: per.get(t, 0) / asked[t] for t in sorted(asked)}}


ROWS = (("admitted share", "admitted_share"), ("GPU time share, whole span", "time_share"),
        ("GPU time share, steady", "time_share_steady"), ("starved demand, whole span", "starved_share"),
        ("starved demand, steady", "starved_share_steady"), ("demand admitted (asked)", "demand_share"),
        ("framebuffer share (used)", "framebuffer_share"), ("GPUs held", "gpus_held_share"))


def median(xs):
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", choices=("today", "diurnal"), default="today",
                    help="today's mixed trace, or desktops by day and compute by night")
    ap.add_argument("--seed", type=int, default=13, help="the first seed")
    ap.add_argument("--seeds", type=int, default=1, help="seeds from --seed on; figures are their median")
    ap.add_argument("--arrivals", type=int, default=2400)
    ap.add_argument("--known", action="store_true", help="also replay (c) with the trace's own use (a reference)")
    ap.add_argument("--batch-ceiling", type=float, default=None, metavar="SHARE",
                    help="compute ceiling of the best-effort pool batch in (c) (overcommit; default 1.0)")
    ap.add_argument("--mode-switch", action="store_true",
                    help="today's trace, replay (f): a GPU the reconciler moves takes its new pool's mode "
                         "(mixed-size outside fixed-share pools), which the product's reconciler does not do "
                         "(an experiment)")
    ap.add_argument("--pools", choices=("three", "two"), default="three",
                    help="today's trace: gold, std and batch, or gold and one equal-share std of 12 GPUs "
                         "serving burstable and best-effort")
    ap.add_argument("--plot", metavar="PNG", default=None,
                    help="diurnal trace: write the reconciler's pool sizes and the demand over time (first seed) "
                         "as a PNG (needs matplotlib)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.trace == "diurnal":
        docs = [run_diurnal(args.seed + i, args.arrivals) for i in range(args.seeds)]
    else:
        docs = [run(args.seed + i, args.arrivals, known=args.known, batch_ceiling=args.batch_ceiling,
                    switch=args.mode_switch, layout=args.pools) for i in range(args.seeds)]
    keys = [k for k, _ in docs[0]["replays"]]
    labels = dict(docs[0]["replays"])
    broken = sum(d[k]["violations"] for d in docs for k in keys)
    if args.json:
        print(json.dumps(docs[0] if len(docs) == 1 else {"seeds": [d["seed"] for d in docs], "runs": docs}, indent=2))
        return 1 if broken else 0
    d0 = docs[0]
    seeds = f"seed {args.seed}" if len(docs) == 1 else f"seeds {args.seed}..{args.seed + len(docs) - 1} (median)"
    who = ("2 tenants: office (burstable desktops, B and Q) by day, hpc (best-effort compute, C) by night; "
           f"a day is {DAY:g} time units" if args.trace == "diurnal" else "4 tenants")
    print(f"trace {args.trace}: {seeds}, {d0['arrivals']} arrivals, {d0['gpus']} GPUs (8 A40 + 8 L40S), {who}; "
          f"steady window t={d0['steady_window'][0]:.0f}..{d0['steady_window'][1]:.0f} "
          "(after warm-up, before the drain)")
    tc = {k: median([d["trace_ceiling"][k] for d in docs]) for k in d0["trace_ceiling"]}
    print(f"trace ceiling (GPU-time demand if every VM were admitted): {tc['demand']:.3f} whole span "
          f"({tc['capped']:.3f} capped at {d0['gpus']} GPUs), {tc['demand_steady']:.3f} steady "
          f"({tc['capped_steady']:.3f} capped)")
    ws = [max(12, len(labels[k]) + 2) for k in keys]        # one column per replay, as wide as its label
    print(f"{'':30}" + "".join(f"{labels[k]:>{w}}" for k, w in zip(keys, ws)) + f"{'c/a':>7}")
    for label, f in ROWS:
        vals = [median([d[k][f] for d in docs]) for k in keys]
        ratio = vals[2] / vals[0] if vals[0] else float("nan")
        print(f"{label:30}" + "".join(f"{v:>{w}.3f}" for v, w in zip(vals, ws)) + f"{ratio:>7.2f}")
    for t in sorted(d0["hoarding"]["admitted_by_tenant"]):
        vals = [median([d[k]["admitted_by_tenant"][t] for d in docs]) for k in keys]
        print(f"{'  admitted, ' + t:30}" + "".join(f"{v:>{w}.3f}" for v, w in zip(vals, ws)))
    print(f"{'QoS/quota/isolation violations':30}" + "".join(f"{sum(d[k]['violations'] for d in docs):>{w}}"
                                                            for k, w in zip(keys, ws)))
    for k in keys[1:]:
        codes = {}
        for d in docs:
            for c, v in d[k]["refusals"].items():
                codes[c] = codes.get(c, 0) + v
        moved = codes.pop("moves", None)
        split = sorted(((ct.partition(":"), v) for ct, v in codes.items() if ":" in ct), key=lambda x: -x[1])
        by_tenant = {c: ", ".join(f"{t} {v}" for (c2, _, t), v in split if c2 == c) for c in codes if ":" not in c}
        print(f"{labels[k]} refusals by rule (all seeds): "
              + (", ".join(f"{c} {v} ({by_tenant[c]})" for c, v in sorted(codes.items()) if ":" not in c)
                 or "none")
              + (f"; pool moves of empty GPUs: {moved}" if moved is not None else ""))
    if args.trace == "diurnal":
        print("best static pools, desk GPUs of 16, by seed: " + ", ".join(str(d["best_static"]["desk_gpus"])
                                                                         for d in docs))
        pb = [median([d["pools_bound"][k] for d in docs]) for k in ("time_share", "time_share_steady")]
        print(f"pool bound (GPU time with free, instant, clairvoyant moves; each compute VM alone on a GPU, "
              f"desktops packed whole): {pb[0]:.3f} whole span, {pb[1]:.3f} steady")
        gain = median([d["reconciler_over_best_static"] for d in docs])
        print(f"reconciler against the best static pools: admitted {gain:+.1%} (median; target >= +10%)")
        gain = median([d["shared_over_best_static"] for d in docs])
        print(f"one shared pool against the best static pools: admitted {gain:+.1%} (median; no pool to move: "
              "the pool bound above does not bound it, its desktops fill the GPU time compute VMs leave)")
        sb = [median([d["shared_bound"][k] for d in docs]) for k in ("time_share", "time_share_steady")]
        print(f"shared-pool bound (GPU time starving no VM, clairvoyant, running VMs moved free; a VM over half a "
              f"GPU alone, 48C alone, the rest split finely): {sb[0]:.3f} whole span, {sb[1]:.3f} steady")
        if args.plot:
            print(plot_diurnal(args.seed, args.arrivals, args.plot))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
