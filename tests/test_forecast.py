"""Forecasts (issue 32, item 2): the seasonal-trend method on rollups with known weekly and daily
seasonality, its held-out error beside the last-week baseline, and the capacity check that
raises each guarantee to its tenant's projected peak and asks the feasibility check."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

import pytest

from vgpuhost.cli.main import main
from vgpuhost.io import state as st
from vgpuhost.io.state import StateStore
from vgpuhost.model.usage import UsageRow
from vgpuhost.policy import forecast as fc

ORIGIN = datetime(2026, 11, 2, tzinfo=timezone.utc)          # a Monday


def truth(t: int, *, base=4.0, slope=0.01, day=2.0, weekend=-1.5) -> float:
    """vGPUs held at hour t: a trend, a daily wave, quieter weekends."""
    dow = (t // 24) % 7
    return max(0.0, base + slope * t + day * math.sin(2 * math.pi * (t % 24) / 24) + (weekend if dow >= 5 else 0))


def _write(store, tenant, values, *, device_count=1, kind="vgpu", profile="A40-1Q", sm=0.5):
    rows = []
    for t, v in enumerate(values):
        hour = (ORIGIN + timedelta(hours=t)).strftime("%Y-%m-%dT%H:00:00Z")
        for d in range(device_count):
            rows.append(UsageRow(hour, f"{tenant}-dev{d}", f"dom-{tenant}-{d}", kind, "0000:81:00.0", profile, "",
                                 tenant, "", v * 3600 / device_count, v * sm * 3600 / device_count, 0, 0, 0, 0, 1))
    with store.transaction() as conn:
        st.add_usage(conn, rows)
        st.put_meter_state(conn, "last_tick_us", str(int((ORIGIN + timedelta(hours=len(values))).timestamp() * 1e6)))


def test_the_method_learns_weekly_and_daily_seasonality_and_the_trend():
    hist = [truth(t) for t in range(4 * 168)]
    model = fc.fit(hist)
    assert model.period == fc.WEEK and model.b * 24 == pytest.approx(0.24, rel=0.05)
    future = [truth(t) for t in range(4 * 168, 5 * 168)]
    assert fc.wape(future, fc.project(model, 168)) < 0.02
    ho = fc.held_out(hist)
    assert ho.error < 0.02 and ho.baseline > ho.error      # the baseline misses the trend
    # too little history: daily seasonality only, then none
    assert fc.fit(hist[:30]).period == fc.DAY and fc.fit(hist[:5]).period == 1
    assert fc.held_out(hist[:200]) is None


def test_forecast_reports_series_and_the_held_out_error(make_host, capsys):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    _write(store, "acme", [truth(t) for t in range(4 * 168)], device_count=2)
    rc = main(["--root", str(host.root), "--json", "forecast", "--horizon", "14d"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    doc = json.loads(out.out)
    by = {(s["scope"], s["name"], s["measure"]): s for s in doc["series"]}
    s = by[("tenant", "acme", "allocated:vgpus")]
    assert s["seasonality"] == "weekly" and s["history_hours"] == 4 * 168
    assert s["held_out"]["error"] < 0.02 < s["held_out"]["baseline"]
    assert s["trend_per_day"] == pytest.approx(0.24, rel=0.05)
    want = [truth(t) for t in range(4 * 168, 4 * 168 + 14 * 24)]
    assert s["projected_mean"] == pytest.approx(sum(want) / len(want), rel=0.02)
    assert len(s["daily"]) == 14 and doc["now"] == "2026-11-30T00:00:00Z"
    assert ("pool", "", "allocated:vgpus") in by and ("tenant", "acme", "busy") in by
    rc = main(["--root", str(host.root), "forecast", "--tenant", "acme"])
    text = capsys.readouterr().out
    assert rc == 0 and "acme" in text and "pool" not in text.split("\n")[1]


def test_forecast_says_when_guarantees_plus_projected_demand_do_not_fit(make_host, capsys):
    host = make_host("a40-mdev")
    assert main(["--root", str(host.root), "tenant", "add", "acme", "--vgpus", "2:40"]) == 0
    assert main(["--root", str(host.root), "tenant", "add", "calm", "--vgpus", "1:2"]) == 0
    capsys.readouterr()
    store = StateStore(host.state_dir)
    # acme grows from 4 to about 24 vGPUs over four weeks; on an A40 (32 x A40-1Q at most) it will not fit
    _write(store, "acme", [4 + 20 * t / 672 for t in range(672)], device_count=4)
    _write(store, "calm", [1.0] * 672)
    rc = main(["--root", str(host.root), "--json", "forecast", "--horizon", "60d"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    cap = json.loads(out.out)["capacity"]
    # the guarantees are kept in promise order: acme's raised one first, so calm's is the one left out
    assert cap["first_short_day"] is not None and cap["tenants"] == ["calm"] and cap["text"]
    day = (datetime.fromisoformat(cap["first_short_day"]) - datetime(2026, 11, 30)).days
    assert 0 < day < 60 and any(p.startswith("acme vgpus ") for p in cap["projected_peaks"])
    # the same over a short horizon: it fits
    rc = main(["--root", str(host.root), "forecast", "--horizon", "3d"])
    assert rc == 0 and "fit on this host for the next 3d" in capsys.readouterr().out


def test_bad_horizons_are_refused(make_host, capsys):
    host = make_host("a40-mdev")
    for bad in ("30", "0d", "30y"):
        rc = main(["--root", str(host.root), "forecast", "--horizon", bad])
        assert rc == 2, bad
        assert "horizon" in capsys.readouterr().err
