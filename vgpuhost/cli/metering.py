"""`vgpuhost` commands: exporter, usage, advise (metering, issue 14).

Registered on the main group like the other command modules: every click
command in ``COMMANDS`` becomes a top-level command.  Logic lives in
:mod:`vgpuhost.ops.metering`, :mod:`vgpuhost.ops.exporter` and
:mod:`vgpuhost.policy.usage`; this module parses options and prints.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Optional

import click
from prometheus_client import CollectorRegistry, generate_latest

from ..io import state as st
from ..io.virt import DEFAULT_URI, ENV_URI
from ..model.errors import InputError
from ..model.tenancy import NO_TENANT
from ..ops import tenancy
from ..ops.billing import csv_safe
from ..ops.exporter import SnapshotCollector, serve
from ..ops.metering import anomalies_of, host_sampler, hour_end, licence_states, live_view, sampler_lock
from ..policy.usage import IDLE_KEY, NONE_KEY, Offer, advise as plan_advice, aggregate
from ..policy.when import HINT as WHEN_HINT, parse_when
from .common import Finite, current as _ctx, store as _store
from .output import dumps, table


def _labels_uri(ctx) -> Optional[str]:
    """libvirt for domain names/tenants: --connect, $LIBVIRT_DEFAULT_URI, else qemu:///system on a real host."""
    if ctx.connect or os.environ.get(ENV_URI):
        return ctx.connect or os.environ.get(ENV_URI)
    return None if ctx.host.is_simulated else DEFAULT_URI


def _sampler(ctx, interval: float, max_hold: Optional[float]):
    ctx.host.require_host()
    return host_sampler(ctx.host, _store(ctx, write=True), interval_s=interval, max_hold_s=max_hold,
                        libvirt_uri=_labels_uri(ctx))


@click.command("exporter", short_help="Meter vGPUs and serve Prometheus metrics.")
@click.option("--listen", default="127.0.0.1", show_default=True, metavar="ADDR",
              help="Address to serve /metrics on (loopback unless you mean otherwise).")
@click.option("--port", type=click.IntRange(0, 65535), default=9842, show_default=True,
              help="TCP port (0: any free port, printed).")
@click.option("--interval", type=Finite(0.05, 3600), default=10.0, show_default=True, metavar="S",
              help="Seconds between NVML readings.")
@click.option("--max-hold", type=Finite(0.05, 86400), default=None, metavar="S",
              help="Longest span one utilisation sample covers (default 6 intervals); longer is a gap.")
@click.option("--metrics-scope", type=click.Choice(["host", "all"]), default="host", show_default=True,
              help="What the page served holds: host (GPUs, pools, health, the sampler; no series naming a "
                   "tenant, domain or device: any local user can connect) or all (every tenant's too: restrict "
                   "who may connect, docs/guide/alerts.md).  --once prints all.")
@click.option("--once", is_flag=True, help="Take one reading, print the metrics page and exit (no server).")
def exporter(listen: str, port: int, interval: float, max_hold: Optional[float], metrics_scope: str,
             once: bool) -> None:
    """Run the metering sampler and serve its metrics to Prometheus.

    Every INTERVAL it reads per-vGPU utilisation, framebuffer and licence
    from NVML, adds allocation and busy seconds to the hourly rollups in the
    state store (what 'vgpuhost usage' reports), and publishes a snapshot;
    scrapes read that snapshot only.  Passed-through GPUs are metered by
    allocation time only.  Stops cleanly on SIGTERM or Ctrl-C.
    """
    ctx = _ctx()
    sampler = _sampler(ctx, interval, max_hold)
    if once:
        with sampler_lock(sampler.store.state_dir):
            sampler.tick()
        reg = CollectorRegistry(auto_describe=False)
        reg.register(SnapshotCollector(lambda: sampler.snapshot, interval))
        click.echo(generate_latest(reg).decode(), nl=False)
        return
    stop = threading.Event()

    def ready(bound: int) -> None:
        host = f"[{listen}]" if ":" in listen else listen
        click.echo(f"vgpuhost exporter: http://{host}:{bound}/metrics (every {interval:g} s, {metrics_scope} "
                   "series)", err=True)

    try:
        serve(sampler, address=listen, port=port, stop=stop, ready=ready, scope=metrics_scope)
    except OSError as e:
        raise InputError(f"cannot listen on {listen}:{port}: {e.strerror or e}",
                         hint="pick another --port, or stop what holds it") from None
    except KeyboardInterrupt:
        stop.set()
        click.echo("vgpuhost exporter: stopped", err=True)


def _when(text: Optional[str], default: datetime) -> datetime:
    if not text:
        return default
    when = parse_when(text, datetime.now(timezone.utc))
    if when is None:
        raise InputError(f"invalid time {text[:40]!r}", hint=WHEN_HINT)
    return when


def _hour(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:00:00Z")


def _window(since: Optional[str], until: Optional[str]):
    """``(first hour, end hour or None)``: --since rounds down; an --until inside an hour includes it."""
    start = _when(since, datetime(1970, 1, 1, tzinfo=timezone.utc))
    if not until:
        return _hour(start), None
    end = _when(until, datetime.now(timezone.utc))
    if end <= start:
        raise InputError("--until is not after --since", hint="give a window such as --since 7d")
    floor = end.replace(minute=0, second=0, microsecond=0)
    return _hour(start), _hour(floor + _one_hour() if floor < end else floor)


def _one_hour():
    return timedelta(hours=1)


@click.command("usage", short_help="Chargeback: allocated and busy GPU time per tenant, domain or profile.")
@click.option("--since", metavar="WHEN", help="ISO 8601 time or an age (30m, 2h, 7d); default: all history.")
@click.option("--until", metavar="WHEN", help="ISO 8601 time or an age; default: no end.")
@click.option("--by", "by", type=click.Choice(["tenant", "domain", "profile", "hour"]), default="tenant",
              show_default=True, help="One row per tenant, domain, profile, or UTC hour (in time order).")
@click.option("--csv", "as_csv", is_flag=True, help="CSV on stdout (for billing systems).")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (as the global --json).")
def usage(since: Optional[str], until: Optional[str], by: str, as_csv: bool, as_json: bool) -> None:
    """Allocated GPU hours and SM/encoder/decoder busy seconds from the hourly rollups.

    Whole UTC hours: --since rounds down to its hour, an --until inside an
    hour includes that hour.  Gaps (spans the sampler could not observe
    utilisation) in the window are listed.
    """
    ctx = _ctx()
    lo, hi = _window(since, until)
    store = _store(ctx, write=False)
    conn = store
    rows = st.usage_rows(conn, lo, hi)
    gaps = st.meter_gaps(conn, lo, hi)
    if as_csv and (as_json or ctx.json):
        raise InputError("--csv and --json are exclusive", hint="pick one output format")
    totals = aggregate(rows, by)
    fields = [by, "gpu_hours", "alloc_seconds", "sm_busy_seconds", "encoder_busy_seconds",
              "decoder_busy_seconds", "framebuffer_peak_bytes", "devices", "hours"]
    recs = [[t.key, round(t.gpu_hours, 6), round(t.alloc_s, 3), round(t.sm_busy_s, 3), round(t.enc_busy_s, 3),
             round(t.dec_busy_s, 3), t.fb_peak_bytes, t.devices, t.hours] for t in totals]
    if by == "domain":          # one row per domain UUID and tenant: the name alone may be two domains
        fields += ["domain_uuid", "tenant"]
        for r, t in zip(recs, totals):
            r += [t.domain_uuid, t.tenant]
    if ctx.json or as_json:
        click.echo(dumps({"schema": "vgpuhost.usage/v1", "since": lo, "until": hi, "by": by,
                          "rows": [dict(zip(fields, r)) for r in recs],
                          "gaps": [{"start": g[0], "end": g[1], "device": g[2], "seconds": g[3], "reason": g[4]}
                                   for g in gaps]}))
        return
    if as_csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(fields)
        w.writerows([[csv_safe(c) for c in r] for r in recs])     # as bill --csv: no cell runs as a formula
        sys.stdout.write(buf.getvalue())
        for g in gaps:              # not billing rows: on stderr, so a billing job's log shows them
            click.echo(f"vgpuhost: gap: {g[0][:19]} .. {g[1][:19]} {g[2]}: {g[3]:.0f} s, {g[4]}", err=True)
        return
    if not recs:
        click.echo(f"no usage recorded from {lo}{' to ' + hi if hi else ''} (is 'vgpuhost exporter' running?)")
    else:
        extra = ["DOMAIN-UUID", "TENANT"] if by == "domain" else []
        click.echo(table([by.upper(), "GPU-HOURS", "SM-BUSY-S", "ENC-BUSY-S", "DEC-BUSY-S", "FB-PEAK-MIB",
                          "DEVICES"] + extra,
                         [[NO_TENANT if by == "tenant" and r[0] == NONE_KEY else
                           IDLE_SHOWN if by in ("tenant", "domain") and r[0] == IDLE_KEY and not (extra and r[9])
                           else r[0], f"{r[1]:.3f}", f"{r[3]:.1f}",
                           f"{r[4]:.1f}", f"{r[5]:.1f}", f"{r[6] / 1048576:.0f}", r[7]]
                          + ([r[9] or "-", (r[10] or NO_TENANT) if r[9] else "-"] if extra else []) for r in recs]))
    for g in gaps:
        click.echo(f"gap: {g[0][:19]} .. {g[1][:19]} {g[2]}: {g[3]:.0f} s, {g[4]}")


#: how a usage table names devices no domain held (``--by tenant`` and ``--by domain``)
IDLE_SHOWN = "(idle: no domain)"


@click.command("advise", short_help="Right-sizing advice from metered history.")
@click.option("--since", metavar="WHEN", default="7d", show_default=True,
              help="Start of the window (ISO 8601 or an age).")
@click.option("--until", metavar="WHEN", help="End of the window; default: no end.")
@click.option("--min-hours", type=Finite(0, None), default=1.0, show_default=True,
              help="Only devices allocated at least this long in the window.")
@click.option("--tenant", metavar="T", help="Count the more VMs this tenant's domains would be admitted to.")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (as the global --json).")
def advise(since: str, until: Optional[str], min_hours: float, tenant: Optional[str], as_json: bool) -> None:
    """VMs whose framebuffer peak and SM use fit a smaller profile, idle guaranteed vGPUs,
    and how many more VMs those changes would admit.

    Where tenants exist, the more VMs are what admission would admit once the
    changes are made (quota, isolation, QoS class, pools, reserves): for
    the tenant whose devices freed the room, or with --tenant T for T (an
    unknown tenant is refused, exit 2).
    """
    ctx = _ctx()
    lo, hi = _window(since, until)
    store = _store(ctx, write=False)
    rows = st.usage_rows(store, lo, hi)
    offers = {}
    inv = None
    try:
        inv = ctx.inventory()
        for t in inv.vgpu_types:
            if t.framebuffer_mib:
                offers.setdefault(t.name.upper(), Offer(t.name, int(t.framebuffer_mib), t.max_instances))
    except Exception:           # advice still works from the names in the rows
        pass
    for _gpu, _tid, name, fb in store.seen_types():
        if fb:
            offers.setdefault(str(name).upper(), Offer(str(name), int(fb), None))
    if tenant is not None:
        tenant = tenancy.get(store, tenant).name          # InputError naming the known tenants
    changes: dict = {}
    admits = None
    if inv is not None and tenancy.active(store):
        def admits(gpu, profile, n, whose):
            return tenancy.admissible_after(store, inv, changes, tenant if tenant is not None else whose, profile,
                                            gpu, n, policies=lambda g: tenancy.scheduler_policies(ctx.host, g))[0]
        items, _ = plan_advice(rows, list(offers.values()), min_alloc_s=min_hours * 3600)
        changes.update({a.device: (a.to if a.action == "downsize" else None) for a in items if a.action != "keep"})
    items, more = plan_advice(rows, list(offers.values()), min_alloc_s=min_hours * 3600, admits=admits)
    found = _flags(ctx, store, hi, rows)
    if ctx.json or as_json:
        click.echo(dumps({"schema": "vgpuhost.advise/v1", "since": lo, "until": hi, "tenant": tenant,
                          "advice": [a.__dict__ for a in items], "more_vms": more,
                          "flags": [f.__dict__ for f in found]}))
        return
    for f in found:
        click.echo(f"flag: {f.kind}{' tenant ' + f.tenant if f.tenant else ''}{' ' + f.device if f.device else ''}: "
                   f"{f.why}; {f.todo}")
    act = [a for a in items if a.action != "keep"]
    if not act:
        click.echo(f"nothing to change: {len(items)} devices checked from {lo}{' to ' + hi if hi else ''}")
    else:
        click.echo(table(["DOMAIN", "TENANT", "DEVICE", "PROFILE", "ACTION", "TO", "REASON"],
                         [[a.domain, a.tenant or NO_TENANT, a.device, a.profile, a.action, a.to or "-", a.reason]
                          for a in act]))
    for name, n in sorted(more.items()):
        click.echo(f"these changes would admit {n} more {name} VM(s)" + (f" of tenant {tenant}" if tenant else ""))
    if tenant and act and not more:
        click.echo(f"these changes would admit no more VMs of tenant {tenant} ('vgpuhost capacity --tenant {tenant}' "
                   "says what it may start now)")


def _flags(ctx, store, hi: Optional[str], rows) -> list:
    """The anomaly flags at the window's end (its last hour, else the sampler's last reading):
    rollups, gaps, and the vGPUs' licence states where the metering NVML answers."""
    last = st.meter_state(store, "last_tick_us")
    if hi:
        end = datetime.strptime(hi, "%Y-%m-%dT%H:00:00Z").replace(tzinfo=timezone.utc)
    elif last:
        end = hour_end(int(last))
    else:
        return []
    tenants_of = {r.device: r.tenant for r in rows}
    licences = None
    try:
        if not hi:
            licences = {d: (state, tenants_of.get(d, "")) for d, state in licence_states(ctx.host, store).items()}
    except Exception:            # no NVML here: the flags of the rollups only
        licences = None
    return anomalies_of(store, end, licences)


SCHEMA_TOP = "vgpuhost.top/v1"


@click.command("top", short_help="What each VM and tenant uses now: a live view of the vGPUs (reads only).")
@click.option("--interval", type=Finite(0.1, 3600), default=2.0, show_default=True, metavar="SECONDS",
              help="Seconds between frames: each frame is the use over the last interval.")
@click.option("-n", "--count", type=click.IntRange(min=1), metavar="N",
              help="Stop after N frames (default: until Ctrl-C).")
@click.option("--by", "by", type=click.Choice(["vgpu", "domain", "tenant"]), default="vgpu", show_default=True,
              help="One line per vGPU, or summed per domain or tenant.")
def top(interval: float, count: Optional[int], by: str) -> None:
    """Live SM, memory, encoder and decoder use and framebuffer of every vGPU, from NVML.

    Reads NVML and the state store only: it meters nothing and does not
    disturb the exporter's or agent's sampler.  The first frame comes after
    one interval.  On a terminal each frame replaces the last; otherwise
    frames follow each other (with --json: one document per line).
    """
    ctx = _ctx()
    view = live_view(ctx.host, _store(ctx, write=False))
    view.read()                                   # the window starts now
    tty = sys.stdout.isatty() and not ctx.json
    n = 0
    try:
        while count is None or n < count:
            time.sleep(interval)
            doc = top_doc(view.read(), by, interval)
            n += 1
            if ctx.json:
                click.echo(json.dumps(doc, separators=(",", ":")))
            else:
                click.echo(("\033[H\033[2J" if tty else ("\n" if n > 1 else "")) + top_text(doc))
    except KeyboardInterrupt:
        if count is not None:
            raise


def top_doc(uses, by: str, interval: float) -> dict:
    """The ``vgpuhost.top/v1`` document of one frame: rows per vGPU, domain or tenant, busiest first
    (SM percent; summed over a domain's or tenant's vGPUs, so 2 vGPUs at 60% are 120)."""
    rows = {}
    for u in uses:
        o = u.owner
        key = {"vgpu": u.device, "domain": o.domain_uuid or u.device, "tenant": o.tenant or NONE_KEY}[by]
        r = rows.setdefault(key, {"key": key, "gpu": u.gpu if by == "vgpu" else None,
                                  "profile": u.profile if by == "vgpu" else None,
                                  "domain": (o.domain or o.domain_uuid or None) if by != "tenant" else None,
                                  "tenant": o.tenant or None, "vgpus": 0, "sm_pct": None, "mem_pct": None,
                                  "enc_pct": None, "dec_pct": None, "fb_used_bytes": 0, "fb_total_bytes": 0})
        r["vgpus"] += 1
        for k, v in (("sm_pct", u.sm), ("mem_pct", u.mem), ("enc_pct", u.enc), ("dec_pct", u.dec)):
            if v is not None:
                r[k] = round((r[k] or 0.0) + v, 2)
        r["fb_used_bytes"] += u.fb_used_bytes
        r["fb_total_bytes"] += u.fb_total_bytes
    out = sorted(rows.values(), key=lambda r: (-(r["sm_pct"] or 0.0), r["key"]))
    return {"schema": SCHEMA_TOP, "by": by, "interval_s": interval, "rows": out}


def top_text(doc: dict) -> str:
    def pct(v):
        return "-" if v is None else f"{v:.1f}"

    def gib(b):
        return f"{b / 2**30:.1f}"
    by = doc["by"]
    head = {"vgpu": ["VGPU", "GPU", "PROFILE", "DOMAIN", "TENANT"], "domain": ["DOMAIN", "TENANT", "VGPUS"],
            "tenant": ["TENANT", "VGPUS"]}[by]
    rows = []
    for r in doc["rows"]:
        lead = {"vgpu": [r["key"], r["gpu"], r["profile"], r["domain"], r["tenant"]],
                "domain": [r["domain"] or r["key"], r["tenant"], r["vgpus"]], "tenant": [r["key"], r["vgpus"]]}[by]
        rows.append(lead + [pct(r["sm_pct"]), pct(r["mem_pct"]), pct(r["enc_pct"]), pct(r["dec_pct"]),
                            f"{gib(r['fb_used_bytes'])}/{gib(r['fb_total_bytes'])}"])
    if not rows:
        return f"no active vGPUs (NVML, every {doc['interval_s']:g} s)"
    return table(head + ["SM%", "MEM%", "ENC%", "DEC%", "FB GiB"], rows)


COMMANDS = (exporter, usage, advise, top)
