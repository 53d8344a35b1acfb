"""Forecasts: each tenant's and pool's allocated and busy use projected from the hourly rollups,
and the first day the host could not serve the guarantees beside the projected demand.

Owns: the ``vgpuhost.forecast/v1`` document (docs/schemas/forecast.v1.schema.json) built by
:func:`forecast` from the state store's rollups (the tenant metering attributed each row to),
with the method of :mod:`vgpuhost.policy.forecast` and its error on the last held-out week beside
the "last week again" baseline, and the capacity check: for each day of the horizon, each
tenant's guarantee raised to its projected peak that day (per dimension: vGPUs, MIG compute
slices, passthrough GPUs) and the host's feasibility check of guarantees
(:mod:`vgpuhost.policy.feasibility`, as ``tenant add|set`` and admission use it) asked whether
all of them can be served together on top of what is held now.  Must not: write anything.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, List, Optional

from ..io import state as st
from ..io.state import StateStore
from ..model.errors import InputError
from ..policy import forecast as fc
from . import tenancy
from .billing import known_tenant
from .metering import gpu_pools

SCHEMA = "vgpuhost.forecast/v1"
METHOD = ("least-squares trend plus the mean residual at each hour of the week (of the day with under a "
          "week of history); error: WAPE on the last held-out week, baseline: the week before repeated")
UNITS = {"busy": "SM-busy hours per hour", "allocated:vgpus": "vGPUs (device-hours per hour)",
         "allocated:mig_slices": "MIG compute slices (slice-hours per hour)",
         "allocated:passthrough_gpus": "passthrough GPUs (GPU-hours per hour)"}


def _now(store: StateStore) -> datetime:
    """The hour after the sampler's last reading (history ends there), else now."""
    v = st.meter_state(store, "last_tick_us")
    t = datetime.fromtimestamp(int(v) / 1e6, timezone.utc) if v else datetime.now(timezone.utc)
    return t.replace(minute=0, second=0, microsecond=0)


def forecast(store: StateStore, *, horizon_h: int, history_h: int = 28 * 24, tenant: Optional[str] = None,
             inv=None) -> Dict[str, Any]:
    """The forecast document: per tenant and pool series (``tenant``: only that tenant's, and no
    pools), projected over ``horizon_h`` hours from the last ``history_h`` hours; with ``inv``
    (the host's inventory) and tenants, ``capacity``: the first day guarantees plus projected
    peaks cannot be served.  InputError for a horizon or history out of range."""
    if not 1 <= horizon_h <= 366 * 24:
        raise InputError(f"horizon of {horizon_h} h is out of range", hint="give 1h to 366d, e.g. --horizon 30d")
    if history_h < 1:
        raise InputError(f"history of {history_h} h is out of range", hint="give at least 1h, e.g. --history 4w")
    end = _now(store)
    origin = end - timedelta(hours=history_h)
    rows = st.usage_rows(store, fc.hour_key(origin, 0), fc.hour_key(end, 0))
    data = fc.series(rows, origin, history_h, pools=gpu_pools(store))
    if tenant is not None:
        tenant = known_tenant(store, tenant, {k[1] for k in data if k[0] == "tenant"},
                              f"in the {history_h} hours of history")
        data = {k: v for k, v in data.items() if k[0] == "tenant" and k[1].lower() == tenant.lower()}
    out_series = []
    projected: Dict[tuple, List[float]] = {}
    for (scope, name, measure), y in sorted(data.items()):
        first = next((i for i, v in enumerate(y) if v), None)
        y_seen = y[first:] if first is not None else []
        model = fc.fit(y_seen)
        proj = fc.project(model, horizon_h)
        projected[(scope, name, measure)] = proj
        peak = max(range(horizon_h), key=lambda h: proj[h]) if proj else 0
        ho = fc.held_out(y_seen)
        days = []
        for d in range(0, horizon_h, 24):
            part = proj[d:d + 24]
            days.append({"day": (end + timedelta(hours=d)).strftime("%Y-%m-%d"),
                         "mean": round(sum(part) / len(part), 6), "peak": round(max(part), 6)})
        out_series.append({
            "scope": scope, "name": name, "measure": measure, "unit": UNITS.get(measure, ""),
            "history_hours": len(y_seen), "history_mean": round(sum(y_seen) / len(y_seen), 6) if y_seen else 0.0,
            "trend_per_day": round(model.b * 24, 6), "seasonality": {168: "weekly", 24: "daily"}.get(model.period, "none"),
            "projected_mean": round(sum(proj) / len(proj), 6), "projected_peak": round(proj[peak], 6),
            "peak_at": fc.hour_key(end, peak),
            "held_out": None if ho is None else {"weeks": ho.weeks, "error": _r(ho.error), "baseline": _r(ho.baseline)},
            "daily": days})
    return {"schema": SCHEMA, "now": fc.hour_key(end, 0), "history_hours": history_h, "horizon_hours": horizon_h,
            "tenant": tenant, "method": METHOD, "series": out_series,
            "capacity": _capacity(store, inv, projected, end, horizon_h) if inv is not None else None}


def _r(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 6)


def _capacity(store: StateStore, inv, projected: Dict[tuple, List[float]], end: datetime,
              horizon_h: int) -> Optional[Dict[str, Any]]:
    """The first day of the horizon on which the tenants' guarantees, each raised to its projected
    peak of that day, cannot all be served on this host (None without tenants)."""
    ts = tenancy.tenants(store)
    if not ts:
        return None
    by_lower = {n.lower(): n for n in ts}
    undecided = False
    for d in range(0, horizon_h, 24):
        raised = dict(ts)
        grown = []
        for (scope, name, measure), proj in projected.items():
            if scope != "tenant" or not measure.startswith("allocated:") or name.lower() not in by_lower:
                continue
            tname = by_lower[name.lower()]
            dim = measure.split(":", 1)[1]
            peak = math.ceil(max(proj[d:d + 24]) - 1e-9)
            q = raised[tname].quota
            g = q.guaranteed.get(dim)
            if peak > (g or 0):
                b = q.burst.get(dim)
                q = replace(q, guaranteed=replace(q.guaranteed, **{dim: peak}),
                            burst=replace(q.burst, **{dim: max(b, peak)}) if b is not None else q.burst)
                raised[tname] = replace(raised[tname], quota=q)
                grown.append(f"{tname} {dim} {peak}")
        if not grown:
            continue
        r = tenancy._risk(store, inv, raised)        # the feasibility check tenant add|set and admission use
        undecided = undecided or not r.decided
        if r.tenants:
            return {"first_short_day": (end + timedelta(hours=d)).strftime("%Y-%m-%d"), "tenants": list(r.tenants),
                    "projected_peaks": grown, "text": r.text, "decided": True}
    return {"first_short_day": None, "tenants": [], "projected_peaks": [], "text": None, "decided": not undecided}


__all__ = ["forecast", "SCHEMA", "METHOD"]
