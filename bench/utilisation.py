"""Utilisation under tenancy: a seeded multi-tenant trace replayed two ways.

    python bench/utilisation.py [--seed N] [--arrivals N] [--json]

The host: 16 GPUs of two boards (8 A40, 8 L40S, 48 GiB each) in three
pools: ``gold`` (fixed-share, 2+2 GPUs, serves guaranteed and burstable),
``std`` (equal-share, 4+4, burstable and best-effort), ``batch``
(best-effort, 2+2, best-effort).  Four tenants with a QoS mix and quotas:
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
    checks quota, isolation, QoS class and scheduler rules.

Printed: admitted share; time-averaged share of the fleet's framebuffer
serving VMs (what they asked for) and of its GPU time used; GPUs held;
violations (must be 0); the ratio b/a.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vgpuhost.model.tenancy import Limits, Quota, Tenant  # noqa: E402
from vgpuhost.policy import admission as adm  # noqa: E402
from vgpuhost.policy.replay import Board, HostModel, violations  # noqa: E402

GIB = 1024
A40, L40S = Board("A40", 48 * GIB), Board("L40S", 48 * GIB)
GPUS = {**{f"0000:{0x10 + i:02x}:00.0": A40 for i in range(8)},
        **{f"0000:{0x90 + i:02x}:00.0": L40S for i in range(8)}}


def pools():
    a = sorted(g for g, b in GPUS.items() if b is A40)
    ll = sorted(g for g, b in GPUS.items() if b is L40S)
    return [adm.Pool("gold", "fixed-share", ("guaranteed", "burstable"), (*a[:2], *ll[:2])),
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
    rate, mean_life = 1.0, 40.0          # offered load: 40 VMs at once on 16 GPUs
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


class Meter:
    """Time-weighted averages of the fleet's state between events."""

    def __init__(self):
        self.last, self.span = None, 0.0
        self.fb = self.time = self.held = 0.0

    def tick(self, now: float, fb_share: float, time_share: float, held_share: float) -> None:
        if self.last is not None:
            dt = now - self.last
            self.span += dt
            self.fb += fb_share * dt
            self.time += time_share * dt
            self.held += held_share * dt
        self.last = now

    def result(self):
        s = self.span or 1.0
        return self.fb / s, self.time / s, self.held / s


def _shares(placed, vms):
    """``placed``: {vm: [(gpu, framebuffer MiB)]} -> (framebuffer share, time share, GPUs held share)."""
    total_fb = sum(b.memory_mib for b in GPUS.values())
    fb, use_by_gpu = 0, {}
    for vm, where in placed.items():
        use = vms[vm][3]
        for gpu, mib in where:
            fb += mib
            use_by_gpu[gpu] = use_by_gpu.get(gpu, 0.0) + use
    time = sum(min(1.0, u) for u in use_by_gpu.values())
    return fb / total_fb, time / len(GPUS), len(use_by_gpu) / len(GPUS)


def replay_hoarding(events, vms):
    free = {g for g in GPUS}
    placed, admitted, meter = {}, 0, Meter()
    per = {}
    for now, kind, vm in events:
        meter.tick(now, *_shares(placed, vms))
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
    return admitted, meter.result(), 0, per


def replay_vgpuhost(events, vms):
    ts = tenants()
    model = HostModel(GPUS, pools())
    placed, admitted, meter, broken = {}, 0, Meter(), 0
    codes, per = {}, {}
    for now, kind, vm in events:
        meter.tick(now, *_shares(placed, vms))
        tn, profile, board, _ = vms[vm]
        if kind == "arrive":
            demand = adm.passthrough_demand() if profile is None else adm.vgpu_demand(profile)
            d = model.arrive(vm, demand, ts, tenant=tn, strategy="best-fit")
            if d.admitted:
                admitted += 1
                per[tn] = per.get(tn, 0) + 1
                mib = GPUS[d.gpu].memory_mib if profile is None else demand.framebuffer_mib
                placed[vm] = [(d.gpu, mib)]
            else:
                codes[d.code] = codes.get(d.code, 0) + 1
        elif vm in placed:
            model.depart(vm)
            placed.pop(vm)
        broken += len(violations(model, ts))
    return admitted, meter.result(), broken, codes, per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--arrivals", type=int, default=2400)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    events, vms = trace(args.seed, args.arrivals)
    a_adm, (a_fb, a_time, a_held), a_broken, a_per = replay_hoarding(events, vms)
    b_adm, (b_fb, b_time, b_held), b_broken, codes, b_per = replay_vgpuhost(events, vms)
    n = len(vms)
    asked = {}
    for tn, *_ in vms.values():
        asked[tn] = asked.get(tn, 0) + 1
    doc = {
        "seed": args.seed, "arrivals": n, "events": len(events), "gpus": len(GPUS),
        "hoarding": {"admitted_share": a_adm / n, "framebuffer_share": a_fb, "time_share": a_time,
                     "gpus_held_share": a_held, "violations": a_broken,
                     "admitted_by_tenant": {t: a_per.get(t, 0) / asked[t] for t in sorted(asked)}},
        "vgpuhost": {"admitted_share": b_adm / n, "framebuffer_share": b_fb, "time_share": b_time,
                     "gpus_held_share": b_held, "violations": b_broken, "refusals": codes,
                     "admitted_by_tenant": {t: b_per.get(t, 0) / asked[t] for t in sorted(asked)}},
        "ratio_b_over_a": {"admitted_share": (b_adm / a_adm) if a_adm else None,
                           "framebuffer_share": (b_fb / a_fb) if a_fb else None,
                           "time_share": (b_time / a_time) if a_time else None},
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"trace: seed {args.seed}, {n} arrivals, {len(events)} events, {len(GPUS)} GPUs (8 A40 + 8 L40S), "
              "4 tenants")
        print(f"{'':28}{'(a) hoarding':>14}{'(b) vgpuhost':>14}{'b/a':>8}")
        rows = [("admitted share", a_adm / n, b_adm / n), ("framebuffer share (used)", a_fb, b_fb),
                ("GPU time share (used)", a_time, b_time), ("GPUs held", a_held, b_held)]
        for label, a, b in rows:
            print(f"{label:28}{a:>14.3f}{b:>14.3f}{(b / a if a else float('nan')):>8.2f}")
        for t in sorted(asked):
            a, b = a_per.get(t, 0) / asked[t], b_per.get(t, 0) / asked[t]
            print(f"{'  admitted, ' + t:28}{a:>14.3f}{b:>14.3f}{(b / a if a else float('nan')):>8.2f}")
        print(f"{'QoS/isolation violations':28}{a_broken:>14}{b_broken:>14}")
        print("vgpuhost refusals by rule: " + (", ".join(f"{k} {v}" for k, v in sorted(codes.items())) or "none"))
    return 1 if b_broken else 0


if __name__ == "__main__":
    sys.exit(main())
