"""`vgpuhost bill` and `vgpuhost forecast`: bills from the metered usage and a price sheet, and
projections of each tenant's and pool's use (issue 32).

Registered on the main group like the other command modules.  Logic lives in
:mod:`vgpuhost.ops.billing` (the document, issuing, adjustments) and
:mod:`vgpuhost.policy.billing` (the price sheet and the pricing); this module
parses options and prints.
"""

from __future__ import annotations

import csv
import io
import re
import sys
from typing import Optional

import click

from ..model.errors import InputError
from ..model.tenancy import NO_TENANT
from ..ops import billing as ops
from ..ops import forecast as forecasting
from ..policy.billing import load_prices
from .common import current as _ctx, store as _store
from .output import dumps, table


def _gap_line(g) -> str:
    who = ", ".join(t or NO_TENANT for t in g["tenants"]) or "no tenant billed"
    return f"gap: {g['start'][:19]} .. {g['end'][:19]} {g['device']}: {g['seconds']:.0f} s, {g['reason']} ({who})"


def _idle_line(i) -> str:
    return (f"idle: {i['key']} ({i['kind']}) {i['quantity']} h on {len(i['source']['devices'])} device(s) no domain "
            "held: not billed")


def _unread_line(doc, u) -> str:
    return (f"unread: GPU {u['gpu']} device {u['device']} last read at {u['read_until'][:19]}Z, before the end of "
            f"{doc['period']}")


def _print(doc, as_json: bool, as_csv: bool) -> None:
    if as_json:
        click.echo(dumps(doc))
        return
    if as_csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(ops.CSV_COLUMNS)
        w.writerows(ops.csv_rows(doc))
        sys.stdout.write(buf.getvalue())
        for g in doc["gaps"]:        # not billing rows: on stderr, so a billing job's log shows them
            click.echo("vgpuhost: " + _gap_line(g), err=True)
        for i in doc.get("idle") or ():
            click.echo("vgpuhost: " + _idle_line(i), err=True)
        for u in doc.get("unread") or ():
            click.echo("vgpuhost: " + _unread_line(doc, u), err=True)
        if not doc["complete"] and not doc.get("unread"):
            click.echo(f"vgpuhost: metering has not passed the end of {doc['period']}: this bill is provisional",
                       err=True)
        elif not doc["complete"]:
            click.echo(f"vgpuhost: devices not read up to the end of {doc['period']}: this bill is provisional",
                       err=True)
        return
    state = doc["status"] + (f" {doc['issued']['time']} by {doc['issued']['actor']}" if doc["issued"] else "")
    click.echo(f"bill {doc['period']} ({doc['start'][:10]} .. {doc['end'][:10]}, {doc['hours']} h), "
               f"{doc['currency']}, {state}; prices sha256 {doc['prices_sha256'][:12]}")
    if doc.get("sheet_differs"):
        click.echo("note: the price sheet given is not the one this bill was issued with; the issued bill stands")
    if not doc["lines"]:
        click.echo("no usage billed in the period")
    else:
        click.echo(table(["TENANT", "ITEM", "KEY", "TIER", "QUANTITY", "UNIT", "RATE", "AMOUNT", "ROWS"],
                         [[ln["tenant"] or NO_TENANT, ln["item"], ln["key"], ln["tier"] or "-", ln["quantity"],
                           ln["unit"], ln["rate"], ln["amount"], ln["source"]["rows"]] for ln in doc["lines"]]))
    for a in doc["adjustments"]:
        click.echo(f"adjustment #{a['id']} {a['tenant'] or NO_TENANT}: {a['amount']} {doc['currency']} "
                   f"({a['reason']}; {a['actor']}, {a['time']})")
    for t in doc["totals_after_adjustments"]:
        click.echo(f"total {t['tenant'] or NO_TENANT}: {t['amount']} {doc['currency']}")
    click.echo(f"total: {doc['total_after_adjustments']} {doc['currency']}")
    for g in doc["gaps"]:
        click.echo(_gap_line(g))
    for i in doc.get("idle") or ():
        click.echo(_idle_line(i))
    for u in doc.get("unread") or ():
        click.echo(_unread_line(doc, u))
    if doc.get("unread") and not doc["issued"]:
        click.echo(f"provisional: {len(doc['unread'])} device(s) not read up to the end of {doc['period']}")
    elif not doc["complete"]:
        click.echo(f"provisional: metering has not passed the end of {doc['period']} (last reading: "
                   f"{doc['metered_until'] or 'none'})")


@click.group("bill", invoke_without_command=True,
             short_help="Bills: a period's metered usage priced by a price sheet; issue, adjust, export.")
@click.option("--prices", "prices", metavar="FILE", help="The price sheet (YAML, version 1; docs/guide/billing.md). "
              "Needed unless the period is issued.")
@click.option("--period", metavar="YYYY-MM", help="The UTC month to bill, e.g. 2026-11.")
@click.option("--tenant", metavar="T", help="Only this tenant's lines and totals ('(no tenant)' or '': the use of "
              "domains naming no tenant).")
@click.option("--issue", "do_issue", is_flag=True,
              help="Store the period's bill for good (once metering has passed its end); it never changes after.")
@click.option("--csv", "as_csv", is_flag=True, help="CSV on stdout, one row per line (docs/guide/billing.md#csv).")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (as the global --json).")
@click.pass_context
def bill(cctx: click.Context, prices: Optional[str], period: Optional[str], tenant: Optional[str], do_issue: bool,
         as_csv: bool, as_json: bool) -> None:
    """A period's bill: the hourly usage rollups priced by a price sheet.

    Each line names its quantity, unit, rate, amount and the rollup rows it
    came from; totals per tenant; metering gaps in the period are listed
    (never billed silently).  With --issue the bill is stored in the state
    store with the price sheet's SHA-256 and never changes: running 'bill'
    for an issued period prints the issued bill (with its adjustments),
    whatever history arrived since.  A bad price sheet is one line
    FILE:LINE, exit 2.
    """
    if cctx.invoked_subcommand is not None:
        if prices or period or tenant or do_issue or as_csv or as_json:
            raise InputError("bill's own options go without a subcommand",
                             hint=f"give them after '{cctx.invoked_subcommand}'")
        return
    ctx = _ctx()
    if as_csv and (as_json or ctx.json):
        raise InputError("--csv and --json are exclusive", hint="pick one output format")
    if not period:
        raise InputError("bill needs --period YYYY-MM", hint="e.g. vgpuhost bill --prices prices.yaml --period 2026-11")
    sheet = load_prices(prices) if prices else None
    if do_issue:
        if sheet is None:
            raise InputError("--issue needs --prices FILE", hint="the bill is priced with the sheet it is issued with")
        if tenant is not None:
            raise InputError("--issue issues the whole period's bill, not one tenant's", hint="leave --tenant out")
        doc = ops.issue(_store(ctx, write=True), period, sheet, prices=prices)
    else:
        doc = ops.bill(_store(ctx, write=False), period, sheet, tenant=tenant, prices=prices)
    if sheet is not None and doc["status"] == "open":
        for t in ops.unknown_discounts(_store(ctx, write=False), sheet, doc):
            click.echo(f"vgpuhost: warning: the price sheet gives tenant {t!r} a discount, but no tenant of that "
                       "name is known or billed: check its spelling", err=True)
    _print(doc, ctx.json or as_json, as_csv)


@bill.command("adjust", short_help="Correct an issued bill: an audited adjustment, the bill itself unchanged.")
@click.option("--period", required=True, metavar="YYYY-MM", help="The issued period.")
@click.option("--tenant", required=True, metavar="T",
              help="The tenant the adjustment is for ('(no tenant)' or '' for the use of domains naming no tenant).")
@click.option("--amount", required=True, metavar="AMOUNT",
              help="Plain decimal amount in the bill's currency (ASCII digits, optional sign, at most 12 digits "
                   "before the point and the currency's minor units after it); negative is a credit (e.g. -12.50).")
@click.option("--reason", required=True, metavar="TEXT",
              help="Why: one line of printable text, at most 500 characters (it goes to the audit log).")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (as the global --json).")
def adjust(period: str, tenant: str, amount: str, reason: str, as_json: bool) -> None:
    """Append a late correction to an issued bill.

    The issued lines never change; the adjustment is stored beside them
    with an audit row, and 'vgpuhost bill --period P' shows it and the
    totals after it.  Refused (exit 2, nothing written) for a period not
    issued, a tenant with no lines in it, an amount that is not plain
    decimal text within bounds, or a reason that is not one printable line.
    """
    ctx = _ctx()
    a = ops.adjust(_store(ctx, write=True), period, tenant, amount, reason)
    if ctx.json or as_json:
        click.echo(dumps(dict(a, schema="vgpuhost.bill-adjust/v1")))
        return
    click.echo(f"adjustment #{a['id']} of {a['period']} for {a['tenant'] or NO_TENANT}: {a['amount']} "
               f"{a['currency']} (audit row {a['audit_id']})")


def _hours(text: str, what: str) -> int:
    m = re.fullmatch(r"\s*([0-9]{1,5})\s*([hdw])\s*", text or "")
    if not m:
        raise InputError(f"invalid {what} {text[:20]!r}", hint="give hours, days or weeks: 12h, 30d, 4w")
    return int(m[1]) * {"h": 1, "d": 24, "w": 168}[m[2]]


@click.command("forecast", short_help="Project each tenant's and pool's GPU use; say when guarantees would not fit.")
@click.option("--tenant", metavar="T", help="Only this tenant's series (no pools).")
@click.option("--horizon", default="30d", show_default=True, metavar="N[h|d|w]", help="How far to project.")
@click.option("--history", default="4w", show_default=True, metavar="N[h|d|w]",
              help="How much of the hourly rollups to learn from (ending at the sampler's last reading).")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (as the global --json).")
def forecast(tenant: Optional[str], horizon: str, history: str, as_json: bool) -> None:
    """Each tenant's and pool's allocated and SM-busy use, projected from the
    hourly rollups with daily and weekly seasonality and a trend, with the
    method's error on the last held-out week beside a baseline (that week
    predicted as the one before it).

    Where tenants exist it says the first day on which the guarantees, each
    raised to its tenant's projected peak, could not all be served on this
    host (the feasibility check 'tenant add|set' uses).
    """
    ctx = _ctx()
    store = _store(ctx, write=False)
    inv = None
    try:
        inv = ctx.inventory()
    except Exception:            # the projection still works from the rollups alone
        inv = None
    doc = forecasting.forecast(store, horizon_h=_hours(horizon, "--horizon"), history_h=_hours(history, "--history"),
                               tenant=tenant, inv=inv)
    if ctx.json or as_json:
        click.echo(dumps(doc))
        return
    if not doc["series"]:
        click.echo(f"no usage in the {doc['history_hours']} hours before {doc['now']} (is 'vgpuhost exporter' running?)")
    else:
        def err(h):
            if h is None:
                return "-"
            f = lambda v: "-" if v is None else f"{v * 100:.1f}%"
            return f"{f(h['error'])} vs {f(h['baseline'])}"
        click.echo(table(["SCOPE", "NAME", "MEASURE", "HISTORY-MEAN", "PROJECTED-MEAN", "PEAK", "PEAK-AT", "TREND/DAY",
                          "HELD-OUT-ERR (BASELINE)"],
                         [[s["scope"], s["name"] or NO_TENANT, s["measure"], f"{s['history_mean']:.3f}",
                           f"{s['projected_mean']:.3f}", f"{s['projected_peak']:.3f}", s["peak_at"][:13],
                           f"{s['trend_per_day']:+.4f}", err(s["held_out"])] for s in doc["series"]]))
    cap = doc["capacity"]
    if cap and cap["first_short_day"]:
        click.echo(f"from {cap['first_short_day']} the guarantees plus the projected demand ({', '.join(cap['projected_peaks'])}) "
                   f"cannot all be served on this host: {cap['text']}")
    elif cap:
        click.echo(f"the guarantees plus the projected demand fit on this host for the next {horizon}"
                   + ("" if cap["decided"] else " (some days were left undecided: too many choices)"))


COMMANDS = (bill, forecast)
