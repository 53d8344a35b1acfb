"""Forecasts of allocated and busy GPU use from the hourly rollups: a seasonal mean with a trend.

Owns: turning rollup rows (:class:`~vgpuhost.model.usage.UsageRow`) into
hourly series per tenant and per pool (:func:`series`), the forecast method
(:func:`fit`, :func:`project`), and its error on held-out history beside a
baseline (:func:`held_out`).  Pure: no I/O.  Must not: read the store.

The method (docs/guide/billing.md#forecasts), for an hourly series ``y``:

1. a least-squares line ``a + b*t`` (the trend) and the seasonal profile,
   the mean of ``y - (a + b*t)`` at each hour of the week (168 values: daily
   and weekly seasonality together; with under a week of history at each
   hour of the day, under a day none), fitted in turn
   (:data:`BACKFIT_ROUNDS` rounds: the line on ``y`` less the profile, the
   profile on ``y`` less the line), so a season the history ends on (a
   weekend) does not bend the trend;
3. the forecast at hour ``t``: ``a + b*t + profile[t]``, never below 0.

Its error is measured on held-out weeks: fit on the history before the
last ``weeks`` weeks, forecast them, and compare with what was metered;
the baseline beside it is the week before them repeated ("last week
again").  Error: WAPE, the sum of absolute errors over the sum of the
actual values (0: perfect; None when nothing was used).

Units: allocated is device-hours per hour (the mean number of devices of a
dimension held: vGPUs, MIG compute slices, passthrough GPUs), busy is
SM-busy hours per hour.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..model.concepts import DeviceKind
from ..model.usage import UsageRow
from ..model.values import VgpuProfile

WEEK = 168
DAY = 24
#: rounds of fitting the trend and the seasonal profile in turn (backfitting)
BACKFIT_ROUNDS = 8
#: rollup kind -> (quota dimension, units of a device per allocated hour)
DIMENSION_OF_KIND = {"vgpu": "vgpus", "mig-vgpu": "mig_slices", "passthrough": "passthrough_gpus"}
_FMT = "%Y-%m-%dT%H:00:00Z"


def hour_index(hour: str, origin: datetime) -> int:
    """Whole hours from ``origin`` to the rollup hour key ``hour``."""
    t = datetime.strptime(hour, _FMT).replace(tzinfo=timezone.utc)
    return int((t - origin).total_seconds() // 3600)


def hour_key(origin: datetime, i: int) -> str:
    return (origin + timedelta(hours=i)).strftime(_FMT)


def _units(row: UsageRow) -> float:
    if row.kind == "mig-vgpu":
        p = VgpuProfile.try_parse(row.profile)
        return float(p.gi_slices) if p is not None and p.gi_slices else 1.0
    return 1.0


def series(rows: Iterable[UsageRow], origin: datetime, hours: int, *,
           pools: Mapping[str, str]) -> Dict[Tuple[str, str, str], List[float]]:
    """``{(scope, name, measure): hourly values}`` over ``hours`` hours from ``origin``.

    ``scope``: ``tenant`` (``name`` the tenant, "" for none) or ``pool`` (``pools``: GPU BDF
    -> pool; a GPU in none is pool ""); ``measure``: ``allocated:<dimension>`` (device-hours
    per hour, MIG in compute slices) or ``busy`` (SM-busy hours per hour).  Hours with no
    rows are 0."""
    out: Dict[Tuple[str, str, str], List[float]] = {}
    for r in rows:
        i = hour_index(r.hour, origin)
        if not 0 <= i < hours:
            continue
        dim = DIMENSION_OF_KIND.get(r.kind)
        for scope, name in (("tenant", r.tenant), ("pool", pools.get(r.gpu, ""))):
            if dim:
                out.setdefault((scope, name, "allocated:" + dim), [0.0] * hours)[i] += r.alloc_s / 3600 * _units(r)
            if r.kind != DeviceKind.PASSTHROUGH:
                out.setdefault((scope, name, "busy"), [0.0] * hours)[i] += r.sm_busy_s / 3600
    return out


@dataclass(frozen=True)
class Model:
    """A fitted series: ``a + b*t + profile[t % period]`` (``period`` 168, 24 or 1), from ``n`` hours."""

    a: float
    b: float
    period: int
    profile: Tuple[float, ...]
    n: int

    def at(self, t: int) -> float:
        return max(0.0, self.a + self.b * t + self.profile[t % self.period])


def fit(y: Sequence[float]) -> Model:
    """The model of hourly series ``y`` (hour 0 = its first value); see the module doc."""
    n = len(y)
    if n == 0:
        return Model(0.0, 0.0, 1, (0.0,), 0)
    period = WEEK if n >= WEEK else DAY if n >= DAY else 1
    mt = (n - 1) / 2
    var = sum((t - mt) ** 2 for t in range(n))
    profile = [0.0] * period
    a = b = 0.0
    for _ in range(BACKFIT_ROUNDS):         # trend and season fitted in turn, each on what the other leaves
        z = [v - profile[t % period] for t, v in enumerate(y)]
        mz = sum(z) / n
        b = sum((t - mt) * (v - mz) for t, v in enumerate(z)) / var if var else 0.0
        a = mz - b * mt
        sums, counts = [0.0] * period, [0] * period
        for t, v in enumerate(y):
            sums[t % period] += v - (a + b * t)
            counts[t % period] += 1
        profile = [s / c if c else 0.0 for s, c in zip(sums, counts)]
    return Model(a, b, period, tuple(profile), n)


def project(model: Model, horizon: int) -> List[float]:
    """The ``horizon`` hours after the history the model was fitted on."""
    return [model.at(model.n + h) for h in range(horizon)]


def wape(actual: Sequence[float], predicted: Sequence[float]) -> Optional[float]:
    """Sum of absolute errors over the sum of actual values; None when nothing was used."""
    total = sum(abs(v) for v in actual)
    if total <= 0:
        return None
    return sum(abs(p - v) for p, v in zip(predicted, actual)) / total


@dataclass(frozen=True)
class HeldOut:
    """Error on the last ``weeks`` weeks: the method's and the baseline's (last week repeated)."""

    weeks: int
    error: Optional[float]
    baseline: Optional[float]


def held_out(y: Sequence[float], weeks: int = 1) -> Optional[HeldOut]:
    """Fit on ``y`` less its last ``weeks`` weeks, forecast them; None when ``y`` has fewer than
    ``weeks + 1`` weeks (the baseline needs the week before)."""
    k = weeks * WEEK
    if len(y) < k + WEEK:
        return None
    train, test = list(y[:-k]), list(y[-k:])
    pred = project(fit(train), k)
    last = train[-WEEK:]
    base = [last[i % WEEK] for i in range(k)]
    return HeldOut(weeks, wape(test, pred), wape(test, base))


__all__ = ["series", "fit", "project", "held_out", "wape", "Model", "HeldOut", "hour_index", "hour_key",
           "DIMENSION_OF_KIND", "WEEK", "DAY"]
