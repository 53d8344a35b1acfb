"""Anomaly flags (issue 32, item 3): each rule on rollups built to trip it beside a neighbour that
must stay quiet, then `advise` and the exporter on a history the real sampler wrote."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from vgpuhost.cli.main import main
from vgpuhost.io.backends import metering_nvml
from vgpuhost.io.state import StateStore
from vgpuhost.model.usage import UsageRow
from vgpuhost.ops import metering
from vgpuhost.ops.metering import MeteredOwner, Sampler, host_series
from vgpuhost.policy.anomaly import flags

END = datetime(2026, 11, 30, tzinfo=timezone.utc)


def _rows(tenant, device, hours, *, alloc=3600.0, busy=0.0, qos="burstable", devices=1):
    out = []
    for h in range(hours, 0, -1):
        hour = (END - timedelta(hours=h)).strftime("%Y-%m-%dT%H:00:00Z")
        for d in range(devices):
            b = busy(h) if callable(busy) else busy
            out.append(UsageRow(hour, f"{device}{d or ''}", "dom-" + device, "vgpu", "0000:81:00.0", "A40-8Q", "",
                                tenant, qos, alloc, b, 0, 0, 0, 0, 1))
    return out


def kinds(fs):
    return [(f.kind, f.tenant, f.device) for f in fs]          # flags() sorts by kind, tenant, device


def test_a_tenant_far_above_its_recent_pattern_is_flagged():
    steady = _rows("steady", "s", 4 * 168, devices=2)
    spiky = _rows("spiky", "p", 4 * 168, devices=2)
    spiky += [r._replace(device="p-extra" + str(i)) for i in range(4) for r in spiky[-48:][::2]]    # 4 more for 24 h
    fs = flags(steady + spiky, now=END)
    spikes = [f for f in fs if f.kind == "usage-spike"]
    assert [(f.tenant, f.kind) for f in spikes] == [("spiky", "usage-spike")]
    assert "144.0 vgpus-hours in the last 24 h, 3.0x the 48.0" in spikes[0].why and spikes[0].todo


def test_the_store_reading_flags_the_same_spike(tmp_path):
    """anomalies_of reads the tenants' patterns summed per hour in SQL: the same flag as the rows."""
    from vgpuhost.io import state as st
    from vgpuhost.ops.metering import anomalies_of
    rows = _rows("steady", "s", 4 * 168, devices=2)
    spiky = _rows("spiky", "p", 4 * 168, devices=2)
    spiky += [r._replace(device="p-extra" + str(i)) for i in range(4) for r in spiky[-48:][::2]]
    store = StateStore(tmp_path)
    with store.transaction() as conn:
        st.add_usage(conn, rows + spiky)
    got = anomalies_of(store, END)
    assert [(f.kind, f.tenant) for f in got] == [("usage-spike", "spiky")]
    assert got == [f for f in flags(rows + spiky, now=END) if f.kind == "usage-spike"]


def test_saturated_idle_unlicensed_and_growing_gaps():
    rows = (_rows("a", "hot", 6, busy=3600.0) + _rows("a", "warm", 6, busy=lambda h: 3600.0 if h > 1 else 1800.0)
            + _rows("g", "idle", 3 * 24, qos="guaranteed") + _rows("g", "used", 3 * 24, qos="guaranteed", busy=900.0)
            + _rows("b", "idle-burstable", 3 * 24))
    day = lambda d: (END - timedelta(days=d)).isoformat(timespec="microseconds")
    gaps = [(day(d), day(d), "dev", 100.0, "no utilisation samples") for d in range(2, 8)] + \
           [(day(0.5), day(0.5), "dev", 3000.0, "no utilisation samples")]
    fs = flags(rows, gaps, now=END, licences={"hot": ("licensed", "a"), "lic": ("unlicensed", "c")})
    assert kinds(fs) == [("saturated", "a", "hot"), ("idle-guaranteed", "g", "idle"), ("unlicensed", "c", "lic"),
                         ("gaps-growing", "", "")]
    assert all(f.why and f.todo for f in fs)
    assert kinds(flags(rows, gaps[:-1], now=END)) == [("saturated", "a", "hot"), ("idle-guaranteed", "g", "idle")]


def test_advise_and_the_exporter_flag_what_the_sampler_metered(make_host, capsys, monkeypatch):
    host = make_host("a40-mdev")
    dom = "1e8927c3-0000-4000-8000-0000000000f1"
    assert main(["--root", str(host.root), "vgpu", "create", "--profile", "A40-8Q", "--owner", dom]) == 0
    store = StateStore(host.state_dir)
    (rec,) = store.vgpu_records()
    nv = metering_nvml(host)
    nv.freeze(END.timestamp() - 8 * 3600)
    nv.set_trace(rec.id, {"sm": 100, "license": "unlicensed", "vm": dom})
    s = Sampler(nv, store, interval_s=3600, labels=lambda u: MeteredOwner(u, "vm", "acme", ""))
    s.tick()
    for _ in range(8):
        nv.advance(3600)
        s.tick()
    capsys.readouterr()
    # the rollups lie at END, a fixed date: a window from the real clock's "7 days ago" (advise's default)
    # stopped holding them on 2026-12-07, and the unlicensed flag then lost its tenant
    since = ["--since", (END - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")]
    rc = main(["--root", str(host.root), "--json", "advise", *since])
    out = capsys.readouterr()
    assert rc == 0, out.err
    got = {(f["kind"], f["tenant"], f["device"]) for f in json.loads(out.out)["flags"]}
    assert got == {("saturated", "acme", rec.id), ("unlicensed", "acme", rec.id)}
    rc = main(["--root", str(host.root), "advise", *since])
    text = capsys.readouterr().out
    assert rc == 0 and f"flag: saturated tenant acme {rec.id}: its SM was busy" in text
    # the exporter's gauge, worked out from the same rollups
    monkeypatch.setattr(metering, "_anomaly_cache", {})
    series = host_series(host, store)
    assert series["anomalies"] == {("saturated", "acme", rec.id): 1.0}
