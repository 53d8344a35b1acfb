"""Anomalies in metered use that operators want to hear about before a tenant complains.

Owns: :func:`flags`, which reads hourly rollup rows and metering gaps (and, where the caller
has them, vGPU licence states) and returns :class:`Flag` values, each saying what was seen,
why it matters and what to do.  Pure: no I/O.  Must not: read the store or NVML.

The rules (docs/guide/billing.md#anomalies), at the end of the rows (``now``: the hour after
the newest row, or the caller's):

- ``usage-spike``: a tenant's allocated device-hours or SM-busy hours over the last
  :data:`SPIKE_HOURS` hours are more than :data:`SPIKE_FACTOR` times what the method of
  :mod:`vgpuhost.policy.forecast`, fitted on the weeks before, expected for those hours, and
  at least :data:`SPIKE_MIN` above it (so a tenant going from 0.1 to 0.3 is not news);
- ``saturated``: a vGPU whose SM was busy at least :data:`SATURATED_SHARE` of its allocated
  time in each of the last :data:`SATURATED_HOURS` hours;
- ``idle-guaranteed``: a vGPU of QoS class ``guaranteed`` allocated all of the last
  :data:`IDLE_DAYS` days whose SM share stayed under :data:`IDLE_SHARE` (it holds a
  guarantee no one uses);
- ``unlicensed``: a vGPU whose licence state (the caller's NVML reading) is not
  ``licensed``;
- ``gaps-growing``: the metering gap seconds of the last day exceed :data:`GAP_MIN_S` and
  twice the mean of the days before in the window.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..model.concepts import DeviceKind, QosClass
from ..model.usage import UsageRow
from . import forecast as fc

SPIKE_HOURS = 24
SPIKE_FACTOR = 2.0
SPIKE_MIN = 12.0            # device-hours or SM-busy hours over the SPIKE_HOURS
SATURATED_SHARE = 0.99
SATURATED_HOURS = 6
IDLE_DAYS = 3
IDLE_SHARE = 0.01
GAP_MIN_S = 600.0
KINDS = ("usage-spike", "saturated", "idle-guaranteed", "unlicensed", "gaps-growing")
_FMT = "%Y-%m-%dT%H:00:00Z"


@dataclass(frozen=True)
class Flag:
    """One anomaly: ``kind`` (:data:`KINDS`), who (``tenant``, ``device``: "" where not one),
    ``why`` (what was seen, with the figures) and ``todo`` (what to do)."""

    kind: str
    tenant: str
    device: str
    why: str
    todo: str


def _hour(h: str) -> datetime:
    return datetime.strptime(h, _FMT).replace(tzinfo=timezone.utc)


def flags(rows: Sequence[UsageRow], gaps: Sequence[tuple] = (), *, now: Optional[datetime] = None,
          licences: Mapping[str, Tuple[str, str]] = None, history: Optional[Sequence[UsageRow]] = None) -> List[Flag]:
    """The anomalies in ``rows`` (hourly rollups, any order) and ``gaps`` (``(start, end, device,
    seconds, reason)``) up to ``now`` (default: the hour after the newest row); ``licences``:
    ``{device: (licence state, tenant)}`` of the vGPUs NVML reads now; ``history``: rows for the
    tenants' patterns (``usage-spike``; per tenant is enough: :func:`vgpuhost.io.state.usage_by_tenant`),
    default ``rows``.  Sorted by kind, tenant, device."""
    out: List[Flag] = []
    pattern = rows if history is None else history
    if rows or pattern:
        newest = max(_hour(r.hour) for r in list(rows) + list(pattern))
        end = now or newest + timedelta(hours=1)
        out += _spikes(pattern, end)
        out += _saturated(rows, end)
        out += _idle(rows, end)
    for device, (state, tenant) in sorted((licences or {}).items()):
        if state != "licensed":
            out.append(Flag("unlicensed", tenant, device, f"the vGPU's licence state is {state}",
                            "check the licence server and the VM's licence client (nvidia-gridd); an "
                            "unlicensed vGPU runs degraded"))
    out += _gaps(gaps, now)
    return sorted(out, key=lambda f: (KINDS.index(f.kind), f.tenant, f.device))


def _spikes(rows: Sequence[UsageRow], end: datetime) -> List[Flag]:
    hours = 5 * fc.WEEK
    origin = end - timedelta(hours=hours)
    data = fc.series(rows, origin, hours, pools={})
    out = []
    for (scope, tenant, measure), y in sorted(data.items()):
        if scope != "tenant":
            continue
        hist, recent = y[:-SPIKE_HOURS], y[-SPIKE_HOURS:]
        first = next((i for i, v in enumerate(hist) if v), None)
        if first is None or len(hist) - first < fc.DAY:
            continue                        # no pattern to compare with yet
        expected = sum(fc.project(fc.fit(hist[first:]), SPIKE_HOURS))
        seen = sum(recent)
        if seen > SPIKE_FACTOR * expected and seen - expected >= SPIKE_MIN:
            what = "SM-busy hours" if measure == "busy" else measure.split(":", 1)[1].replace("_", " ") + "-hours"
            out.append(Flag("usage-spike", tenant, "",
                            f"{seen:.1f} {what} in the last {SPIKE_HOURS} h, {seen / expected if expected else 0:.1f}x "
                            f"the {expected:.1f} its recent pattern predicts",
                            "check with the tenant that the load is expected (a new job, a runaway VM); "
                            f"'vgpuhost forecast --tenant {tenant or '...'}' shows its pattern; its bill will show it"))
    return out


def _saturated(rows: Sequence[UsageRow], end: datetime) -> List[Flag]:
    last = [(end - timedelta(hours=k)).strftime(_FMT) for k in range(1, SATURATED_HOURS + 1)]
    per: Dict[str, Dict[str, Tuple[float, float, str]]] = defaultdict(dict)
    for r in rows:
        if r.kind != DeviceKind.PASSTHROUGH and r.hour in last:
            a, b, _t = per[r.device].get(r.hour, (0.0, 0.0, ""))
            per[r.device][r.hour] = (a + r.alloc_s, b + r.sm_busy_s, r.tenant)
    out = []
    for device, hours in sorted(per.items()):
        if len(hours) == SATURATED_HOURS and all(a > 0 and b >= SATURATED_SHARE * a for a, b, _ in hours.values()):
            tenant = hours[last[0]][2]
            out.append(Flag("saturated", tenant, device,
                            f"its SM was busy at least {SATURATED_SHARE:.0%} of the time in each of the last "
                            f"{SATURATED_HOURS} hours", "the VM wants more GPU than its profile's share: offer a "
                            "larger profile or a fixed-share/guaranteed class, or check for a runaway job"))
    return out


def _idle(rows: Sequence[UsageRow], end: datetime) -> List[Flag]:
    start = (end - timedelta(days=IDLE_DAYS)).strftime(_FMT)
    per: Dict[str, List] = {}
    for r in rows:
        if r.kind == DeviceKind.PASSTHROUGH or r.hour < start:
            continue
        acc = per.setdefault(r.device, [0.0, 0.0, set(), r])
        acc[0] += r.alloc_s
        acc[1] += r.sm_busy_s
        acc[2].add(r.hour)
        if r.hour >= acc[3].hour:
            acc[3] = r
    out = []
    for device, (alloc, busy, hours, newest) in sorted(per.items()):
        if newest.qos != QosClass.GUARANTEED or len(hours) < IDLE_DAYS * 24 or alloc <= 0:
            continue
        share = busy / alloc
        if share < IDLE_SHARE:
            out.append(Flag("idle-guaranteed", newest.tenant, device,
                            f"a guaranteed vGPU held for the last {IDLE_DAYS} days used {share:.2%} of its SM time",
                            "ask the tenant to release it or move it to a burstable class; its guarantee keeps room "
                            "others could use ('vgpuhost advise' right-sizes it)"))
    return out


def _gaps(gaps: Sequence[tuple], now: Optional[datetime]) -> List[Flag]:
    if not gaps:
        return []
    def day(iso: str) -> str:
        return iso[:10]
    per: Dict[str, float] = defaultdict(float)
    for g in gaps:
        per[day(str(g[1]))] += float(g[3])
    days = sorted(per)
    last = (now - timedelta(hours=1)).strftime("%Y-%m-%d") if now else days[-1]
    first = datetime.strptime(days[0], "%Y-%m-%d")
    span = (datetime.strptime(last, "%Y-%m-%d") - first).days
    before = [per.get((first + timedelta(days=i)).strftime("%Y-%m-%d"), 0.0) for i in range(span)]
    mean = sum(before) / len(before) if before else 0.0
    seen = per.get(last, 0.0)
    if seen >= GAP_MIN_S and seen > 2 * mean:
        return [Flag("gaps-growing", "", "", f"{seen:.0f} s of metering gaps on {last}, against {mean:.0f} s a day "
                     "before", "check that the sampler (vgpuhost exporter or the agent) keeps running and that "
                     "NVML answers ('vgpuhost usage' lists the gaps); usage in a gap is not billed")]
    return []


__all__ = ["Flag", "flags", "KINDS"]
