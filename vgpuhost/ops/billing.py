"""Bills: a period's usage rollups priced, issued once, adjusted in the open.

Owns: the bill document (``vgpuhost.bill/v1``, docs/schemas/bill.v1.schema.json)
of a period, built by :func:`bill` from the state store's hourly rollups
(``usage_hourly``: the tenant metering attributed each row to, never
re-derived), its metering gaps, the history of the tenants' guarantees
(:func:`guarantees`: each hour is charged the guarantee in force at its start,
from the sampler's first reading) and the devices not read up to the period's
end (:func:`unread`), priced by :func:`vgpuhost.policy.billing.price`;
:func:`issue`, which stores a period's bill for good (``bills``, with the
price sheet's SHA-256) once metering has read every device past the
period's end; and :func:`adjust`, a late correction of an issued bill,
appended with an audit row.  Rows of devices no domain held are idle
capacity, listed apart and never priced.  An issued period's bill is always the
issued document (plus its adjustments): more history arriving, or another
price sheet, never changes it.  :data:`CSV_COLUMNS` is the CSV export's
column list.

Money in the document is decimal text (``"123.45"``), never a JSON number,
so a billing system reads it exactly.  Errors: InputError (exit 2) for a bad
period, an unpriced profile, issuing twice or too early, adjusting a period
not issued; nothing is written then.  Must not: price anything itself
(policy/billing.py), or write anything but ``bills``, ``bill_adjustments``
and their audit rows.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..io import state as st
from ..io.process import actor as process_actor
from ..io.state import StateStore
from ..model.errors import InputError
from ..model.tenancy import NO_TENANT, check_name
from ..model.yamldoc import shown
from ..policy.billing import CURRENCIES, RESERVED_DIMS, Bill, PriceSheet, period_bounds, price
from . import tenancy
from .metering import hour_of, iso_us

SCHEMA = "vgpuhost.bill/v1"
#: the CSV export's columns, in order (docs/guide/billing.md#csv; tests/test_billing.py checks both)
CSV_COLUMNS = ("period", "status", "tenant", "item", "key", "kind", "tier", "quantity", "unit", "rate", "amount",
               "currency", "source_rows", "source_first_hour", "source_last_hour", "source_devices",
               "source_seconds", "note", "prices_sha256")


def _actor() -> str:
    return process_actor()


def _ceil_hour(iso: str) -> str:
    """The rollup hour key of the first hour starting at or after ISO time ``iso``."""
    t = datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone(timezone.utc)
    h = t.replace(minute=0, second=0, microsecond=0)
    if h < t:
        h += timedelta(hours=1)
    return h.strftime("%Y-%m-%dT%H:00:00Z")


def guarantees(store: StateStore) -> Dict[str, List[Tuple[str, Dict[str, int]]]]:
    """Each tenant's guarantee history (:data:`vgpuhost.policy.billing.Guarantees`): ``{tenant:
    [(from_hour, {dimension: guaranteed units})]}`` from the store's ``tenant_guarantees`` (every
    ``tenant add|set|remove``), each step in force from the first whole UTC hour after its change.
    Names compare without case; a tenant is spelt as its newest row spells it."""
    out: Dict[str, List[Tuple[str, Dict[str, int]]]] = {}
    names: Dict[str, str] = {}
    for tenant, since, vgpus, mig, pt in st.tenant_guarantees(store):
        k = tenant.lower()
        names[k] = tenant
        out.setdefault(k, []).append((_ceil_hour(since), {"vgpus": int(vgpus), "mig_slices": int(mig),
                                                          "passthrough_gpus": int(pt)}))
    return {names[k]: v for k, v in out.items() if any(any(g.values()) for _h, g in v)}


def metered_since(store: StateStore) -> Optional[str]:
    """The wall-clock time of the sampler's first reading (ISO), None before the first."""
    v = st.meter_state(store, "first_tick_us")
    return iso_us(int(v)) if v else None


def unread(store: StateStore, end: str) -> List[Dict[str, str]]:
    """The devices metering has not read up to ``end`` (a rollup hour key): ``[{device, gpu,
    read_until}]``, each a device whose cursor (its last allocation reading) is before ``end``,
    as a GPU whose NVML read fails leaves them (their allocation since is credited when it
    answers again, split into the hours it fell in)."""
    end_us = int(datetime.strptime(end, "%Y-%m-%dT%H:00:00Z").replace(tzinfo=timezone.utc).timestamp()) * 1_000_000
    behind = sorted((int(c[1]), dev) for dev, c in st.meter_cursors(store).items() if 0 < int(c[1]) < end_us)
    gpus = st.device_gpus(store, [d for _u, d in behind])
    return [{"device": d, "gpu": gpus.get(d, d), "read_until": iso_us(u)} for u, d in behind]


def _iso_hour(hour: str) -> str:
    """A rollup hour key as the gaps' timestamps spell it (``...T00:00:00.000000+00:00``)."""
    return datetime.strptime(hour, "%Y-%m-%dT%H:00:00Z").replace(tzinfo=timezone.utc).isoformat(
        timespec="microseconds")


def metered_until(store: StateStore) -> Optional[str]:
    """The wall-clock time of the sampler's last reading (ISO), None before the first."""
    v = st.meter_state(store, "last_tick_us")
    return iso_us(int(v)) if v else None


def _money(d: Decimal) -> str:
    return format(d, "f")


def _total(amounts, currency: str) -> str:
    """The sum of ``amounts`` (Decimals) in the currency's minor units (an empty sum is ``0.00``)."""
    return _money(sum(amounts, Decimal(0)).quantize(Decimal(1).scaleb(-CURRENCIES.get(currency, 2))))


def document(b: Bill, *, status: str, complete: bool, metered: Optional[str], prices: Optional[str],
             behind: Optional[List[Dict[str, str]]] = None) -> Dict[str, Any]:
    """The ``vgpuhost.bill/v1`` document of ``b`` (no adjustments yet: :func:`with_adjustments`);
    ``behind``: the devices metering has not read to the period's end (:func:`unread`)."""
    lines = []
    for ln in b.lines:
        s = ln.source
        lines.append({"tenant": ln.tenant, "item": ln.item, "key": ln.key, "kind": ln.kind, "tier": ln.tier,
                      "quantity": _money(ln.quantity), "unit": ln.unit, "rate": _money(ln.rate),
                      "amount": _money(ln.amount),
                      "source": {"table": "usage_hourly", "rows": s.rows, "first_hour": s.first_hour or None,
                                 "last_hour": s.last_hour or None, "devices": list(s.devices),
                                 "seconds": _money(s.seconds)},
                      "note": ln.note})
    return {"schema": SCHEMA, "period": b.period, "start": b.start, "end": b.end, "hours": b.hours,
            "currency": b.currency, "rounding": b.rounding, "prices_sha256": b.prices_sha256, "prices": prices,
            "status": status, "issued": None, "complete": complete, "metered_until": metered, "tenant": None,
            "lines": lines,
            "totals": [{"tenant": t, "amount": _money(a)} for t, a in sorted(b.totals.items())],
            "total": _total(b.totals.values(), b.currency),
            "adjustments": [], "totals_after_adjustments": [], "total_after_adjustments": None,
            "gaps": [{"start": g[0], "end": g[1], "device": g[2], "seconds": float(g[3]), "reason": g[4],
                      "tenants": list(g[5])} for g in b.gaps],
            "unread": list(behind or []),
            "idle": [{"key": k, "kind": kind, "quantity": _money(q), "unit": "hour",
                      "source": {"table": "usage_hourly", "rows": src.rows, "first_hour": src.first_hour or None,
                                 "last_hour": src.last_hour or None, "devices": list(src.devices),
                                 "seconds": _money(src.seconds)}} for k, kind, q, src in b.idle]}


def _compute(store: StateStore, sheet: PriceSheet, period: str, *, prices: Optional[str],
             tenant: Optional[str] = None) -> Dict[str, Any]:
    start, end, hours = period_bounds(period)
    rows = st.usage_rows(store, start, end)
    gaps = st.meter_gaps(store, _iso_hour(start), _iso_hour(end))
    since = st.meter_state(store, "first_tick_us")
    b = price(rows, sheet, period=period, start=start, end=end, hours=hours, guarantees=guarantees(store),
              gaps=gaps, tenant=tenant, reserved_from=hour_of(int(since)) if since else end)
    metered = metered_until(store)
    behind = unread(store, end) if metered is not None and metered >= _iso_hour(end) else []
    complete = metered is not None and metered >= _iso_hour(end) and not behind
    return document(b, status="open", complete=complete, metered=metered, prices=prices, behind=behind)


def with_adjustments(doc: Dict[str, Any], adjustments: List[tuple]) -> Dict[str, Any]:
    """``doc`` with the period's adjustments and the totals after them."""
    doc = dict(doc)
    doc["adjustments"] = [{"id": a[0], "tenant": a[1], "amount": a[2], "reason": a[3], "actor": a[4],
                           "time": a[5], "audit_id": a[6]} for a in adjustments]
    after: Dict[str, Decimal] = {t["tenant"]: Decimal(t["amount"]) for t in doc["totals"]}
    for a in adjustments:
        after[a[1]] = after.get(a[1], Decimal(0)) + Decimal(a[2])
    doc["totals_after_adjustments"] = [{"tenant": t, "amount": _money(v)} for t, v in sorted(after.items())]
    doc["total_after_adjustments"] = _total(after.values(), doc["currency"])
    return doc


def for_tenant(doc: Dict[str, Any], tenant: Optional[str]) -> Dict[str, Any]:
    """``doc`` cut to one tenant's lines, totals, adjustments and gaps (None: all)."""
    if tenant is None:
        return doc
    t = tenant.lower()
    doc = dict(doc, tenant=tenant)
    for k in ("lines", "totals", "adjustments", "totals_after_adjustments"):
        doc[k] = [x for x in doc[k] if x["tenant"].lower() == t]
    doc["gaps"] = [g for g in doc["gaps"] if g["device"] == "*" or t in {x.lower() for x in g["tenants"]}]
    doc["idle"] = []                 # idle capacity is no tenant's
    doc["total"] = _total((Decimal(x["amount"]) for x in doc["totals"]), doc["currency"])
    if doc["total_after_adjustments"] is not None:
        doc["total_after_adjustments"] = _total((Decimal(x["amount"]) for x in doc["totals_after_adjustments"]),
                                                doc["currency"])
    return doc


def bill(store: StateStore, period: str, sheet: Optional[PriceSheet], *, tenant: Optional[str] = None,
         prices: Optional[str] = None) -> Dict[str, Any]:
    """The bill document of ``period`` (``YYYY-MM``, UTC): the issued one with its adjustments
    when the period is issued (``sheet`` may then be None; ``sheet_differs`` says when the sheet
    given is not the one it was issued with), else priced now from the rollups with ``sheet``
    (status ``open``; ``complete`` false while metering has not passed the period's end).
    ``tenant``: one tenant's part (``''`` or ``(no tenant)``: the use of domains naming no tenant).
    InputError: a bad period, no sheet for an open period, usage the sheet has no rate for, a
    ``tenant`` that is not a valid name or not known (:func:`known_tenant`)."""
    period_bounds(period)
    tenant = tenant_arg(tenant) if tenant is not None else None
    row = st.issued_bill(store, period)
    if row is not None:
        doc = json.loads(row[4])
        doc["sheet_differs"] = sheet is not None and sheet.sha256 != row[3]
        if tenant is not None:
            known_tenant(store, tenant, [t["tenant"] for t in doc["totals"]], f"in the issued bill of {period}")
        return for_tenant(with_adjustments(doc, st.bill_adjustments(store, period)), tenant)
    if sheet is None:
        raise InputError(f"the bill of {period} is not issued: it is priced from the rollups now, with a price sheet",
                         hint="give --prices FILE")
    doc = _compute(store, sheet, period, prices=prices, tenant=tenant)     # only that tenant's rows priced
    if tenant is not None:
        known_tenant(store, tenant, [t["tenant"] for t in doc["totals"]], f"in {period}")
    doc["sheet_differs"] = False
    return for_tenant(with_adjustments(doc, []), tenant)


def unknown_discounts(store: StateStore, sheet: PriceSheet, doc: Dict[str, Any]) -> List[str]:
    """The tenants the sheet gives a discount that are neither in the tenancy tables, nor in the
    guarantee history, nor billed in ``doc``: a misspelt name, whose discount applies to no one."""
    known = {t.lower() for t in tenancy.tenants(store)} | {r[0].lower() for r in st.tenant_guarantees(store)} \
        | {t["tenant"].lower() for t in doc["totals"]}
    return sorted(t for t in sheet.discounts if t.lower() not in known)


def issue(store: StateStore, period: str, sheet: PriceSheet, *, prices: Optional[str] = None,
          actor: Optional[str] = None, now: Optional[str] = None) -> Dict[str, Any]:
    """Price ``period`` with ``sheet`` and store it as issued (with an audit row), once.

    Refused (InputError, nothing written) when the period is issued already (a correction is
    :func:`adjust`), metering has not passed the period's end (the bill would miss usage), a
    device's last reading is before the period's end (its GPU's NVML read failing: :func:`unread`;
    its usage would land in the period after issue), or metering began after the period ended
    (nothing was metered in it).  Returns the issued document."""
    period_bounds(period)
    who = actor or _actor()
    when = now or datetime.now(timezone.utc).isoformat(timespec="seconds")
    with store.transaction() as conn:
        row = st.issued_bill(conn, period)
        if row is not None:
            raise InputError(f"the bill of {period} was issued at {row[1]} and never changes",
                             hint=f"a late correction is 'vgpuhost bill adjust --period {period} --tenant T "
                                  "--amount A --reason TEXT'")
        doc = _compute(store, sheet, period, prices=prices)
        since = metered_since(store)
        if doc["metered_until"] is not None and doc["metered_until"] >= _iso_hour(doc["end"]) \
                and since is not None and since >= _iso_hour(doc["end"]):
            raise InputError(f"metering began at {since[:19]}Z, after {period} ended: this host metered nothing "
                             "in it, so there is no bill to issue",
                             hint="issue the months since metering began")
        if doc["unread"]:
            u = doc["unread"][0]
            more = f" (and {len(doc['unread']) - 1} more device(s))" if len(doc["unread"]) > 1 else ""
            raise InputError(f"GPU {u['gpu']}: device {u['device']} was last read at {u['read_until'][:19]}Z, "
                             f"before the end of {period}{more}: its usage up to then is not metered yet",
                             hint=f"issue {period} once the sampler reads that GPU again (see 'vgpuhost health'); "
                                  "if it is gone for good, remove its devices so metering forgets them")
        if not doc["complete"]:
            raise InputError(f"metering has not passed the end of {period} (last reading: "
                             f"{doc['metered_until'] or 'none'}): its bill would miss usage",
                             hint="issue it once the sampler (vgpuhost exporter or the agent) has read past "
                                  f"{doc['end']}")
        doc = dict(doc, status="issued", issued={"time": when, "actor": who})
        text = json.dumps(doc, sort_keys=True)
        store.audit(actor=who, operation=f"bill issue {period}", path="(bills)",
                    value=f"total {doc['total']} {doc['currency']}, prices sha256 {sheet.sha256}", conn=conn)
        st.put_bill(conn, period, when, who, sheet.sha256, text)
    doc["sheet_differs"] = False
    return with_adjustments(doc, [])


#: an adjustment amount as ``--amount`` takes it: ASCII digits, an optional sign and fraction
_AMOUNT_RE = re.compile(r"\A([+-]?)([0-9]+)(?:\.([0-9]+))?\Z")
#: at most this many digits before the decimal point of an adjustment (below a trillion)
AMOUNT_INT_DIGITS = 12
#: at most this many characters of an adjustment's reason (one line of printable text)
REASON_MAX = 500


def parse_amount(text: str, currency_places: int) -> Decimal:
    """An adjustment amount (``-12.50``, ``30``, ``+5``) as a Decimal: ASCII digits with an
    optional sign and fraction, at most :data:`AMOUNT_INT_DIGITS` digits before the point and
    ``currency_places`` after it, not zero, returned in the currency's minor units (``5`` -> ``5.00``);
    InputError otherwise (``1e3``, ``1_000``, ``.5``,
    non-ASCII digits, spaces)."""
    m = _AMOUNT_RE.match(text or "")
    if not m:
        raise InputError(f"invalid amount {shown(text)}: not a plain decimal amount",
                         hint="give ASCII digits with an optional sign and fraction, e.g. -12.50 or 30 "
                              "(no exponent, underscore, spaces or other digits)")
    if len(m.group(2)) > AMOUNT_INT_DIGITS:
        raise InputError(f"amount has {len(m.group(2))} digits before the decimal point, more than "
                         f"{AMOUNT_INT_DIGITS}", hint="give an amount below 10^12 in the bill's currency")
    if len(m.group(3) or "") > currency_places:
        raise InputError(f"amount {shown(text)} has more decimal places than the currency's {currency_places}",
                         hint="round it to the currency's minor units")
    d = Decimal(text)
    if d == 0:
        raise InputError(f"invalid amount {shown(text)}", hint="give a non-zero decimal amount, e.g. -12.50")
    return d.quantize(Decimal(1).scaleb(-currency_places))        # in the currency's minor units: 5 -> 5.00


def check_reason(reason: str) -> str:
    """An adjustment's reason, stripped: one line of printable text, 1..:data:`REASON_MAX`
    characters; InputError for an empty one, a longer one, or one with a control character
    (a newline, a tab, an escape, a bidi override: anything ``str.isprintable`` refuses)."""
    reason = (reason or "").strip()
    if not reason:
        raise InputError("an adjustment needs a reason", hint="give --reason TEXT (it goes to the audit log)")
    if len(reason) > REASON_MAX:
        raise InputError(f"the reason is over {REASON_MAX} characters", hint="say it shorter")
    bad = next((i for i, ch in enumerate(reason) if not ch.isprintable()), None)
    if bad is not None:
        raise InputError(f"the reason has a control character (U+{ord(reason[bad]):04X} at character {bad + 1})",
                         hint="give one line of printable text: no newline, tab or other control character")
    return reason


def known_tenant(store: StateStore, tenant: str, seen: "Iterable[str]", where: str) -> str:
    """A ``--tenant`` value checked (:func:`tenant_arg` first): ``''`` (no tenant) as it is; else a
    valid tenant name (:func:`vgpuhost.model.tenancy.check_name`) that the tenancy tables hold, that
    had a guarantee once (``tenant_guarantees``: a removed tenant), or that is in ``seen`` (the
    tenants of the rows or lines at hand).  InputError otherwise (``where``: the report's scope,
    for the message), so a misspelt name is not a report of nothing."""
    tenant = tenant_arg(tenant)
    if not tenant:
        return tenant
    check_name(tenant)
    known = {t.lower() for t in tenancy.tenants(store)} | {r[0].lower() for r in st.tenant_guarantees(store)} \
        | {t.lower() for t in seen}
    if tenant.lower() not in known:
        raise InputError(f"no tenant {shown(tenant)}: not in the tenancy tables and no usage of it {where}",
                         hint="'vgpuhost tenant list' names the tenants; tenant names compare without case")
    return tenant


def tenant_arg(tenant: str) -> str:
    """A ``--tenant`` value as the bill stores it: ``(no tenant)`` (as the bill prints the use of
    domains naming no tenant) and ``''`` both mean that untenanted use (``''``)."""
    return "" if tenant.strip().lower() == NO_TENANT else tenant


def adjust(store: StateStore, period: str, tenant: str, amount: str, reason: str, *,
           actor: Optional[str] = None, now: Optional[str] = None) -> Dict[str, Any]:
    """Append an adjustment of ``amount`` (decimal text, currency of the issued bill; negative: a
    credit) for ``tenant`` (``''`` or ``(no tenant)``: the untenanted lines) to the issued bill of
    ``period``, with an audit row; the adjustment.

    Refused (InputError, nothing written): the period not issued, a tenant with no lines in it, a
    bad reason (:func:`check_reason`), a bad amount (:func:`parse_amount`)."""
    period_bounds(period)
    reason = check_reason(reason)
    tenant = tenant_arg(tenant)
    who = actor or _actor()
    when = now or datetime.now(timezone.utc).isoformat(timespec="seconds")
    with store.transaction() as conn:
        row = st.issued_bill(conn, period)
        if row is None:
            raise InputError(f"the bill of {period} is not issued: an open period's bill follows the rollups",
                             hint=f"issue it first ('vgpuhost bill --prices FILE --period {period} --issue')")
        doc = json.loads(row[4])
        d = parse_amount(amount, CURRENCIES.get(doc["currency"], 2))
        billed = {t["tenant"].lower(): t["tenant"] for t in doc["totals"]}
        if tenant.lower() not in billed:
            who_t = (NO_TENANT if not tenant else shown(tenant))
            raise InputError(f"tenant {who_t} has no lines in the issued bill of {period}",
                             hint="give --tenant as one of the tenants billed: "
                                  + (", ".join(repr(t) if t else f"'{NO_TENANT}'" for t in sorted(billed.values()))
                                     or "none"))
        tenant = billed[tenant.lower()]
        aid = store.audit(actor=who, operation=f"bill adjust {period}", path="(bills)",
                          value=f"tenant {tenant or NO_TENANT}: {format(d, 'f')} {doc['currency']}: {reason}",
                          conn=conn)
        adj_id = st.add_bill_adjustment(conn, period, tenant, format(d, "f"), reason, who, when, aid)
    return {"id": adj_id, "period": period, "tenant": tenant, "amount": format(d, "f"), "currency": doc["currency"],
            "reason": reason, "actor": who, "time": when, "audit_id": aid}


#: CSV columns that hold text (the others are decimal text or counts): :func:`csv_safe` applies
_CSV_TEXT = {"period", "status", "tenant", "item", "key", "kind", "unit", "currency", "source_first_hour",
             "source_last_hour", "source_devices", "note", "prices_sha256"}
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(cell: Any) -> Any:
    """A text cell as the CSV export writes it: one a spreadsheet would run as a formula (it starts
    with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return) gets a leading ``'`` (OWASP's
    advice against CSV injection); anything else unchanged."""
    return "'" + cell if isinstance(cell, str) and cell.startswith(_FORMULA_START) else cell


def csv_rows(doc: Dict[str, Any]) -> List[List[Any]]:
    """The CSV export's rows (:data:`CSV_COLUMNS`) of a bill document: its lines, then its
    adjustments (item ``adjustment``, key the adjustment's id); text cells through :func:`csv_safe`
    (a cell a spreadsheet would take for a formula gets a leading ``'``), decimal cells as they are."""
    out = []
    for ln in doc["lines"]:
        s = ln["source"]
        out.append([doc["period"], doc["status"], ln["tenant"], ln["item"], ln["key"], ln["kind"], ln["tier"],
                    ln["quantity"], ln["unit"], ln["rate"], ln["amount"], doc["currency"], s["rows"],
                    s["first_hour"] or "", s["last_hour"] or "", " ".join(s["devices"]), s["seconds"], ln["note"],
                    doc["prices_sha256"]])
    for a in doc["adjustments"]:
        out.append([doc["period"], doc["status"], a["tenant"], "adjustment", str(a["id"]), "", 0, "1",
                    doc["currency"], a["amount"], a["amount"], doc["currency"], 0, "", "", "", "0", a["reason"],
                    doc["prices_sha256"]])
    text = [i for i, c in enumerate(CSV_COLUMNS) if c in _CSV_TEXT]
    for r in out:
        for i in text:
            r[i] = csv_safe(r[i])
    return out


__all__ = ["bill", "issue", "adjust", "known_tenant", "unknown_discounts", "unread", "metered_since", "document", "csv_rows", "csv_safe", "guarantees", "metered_until", "CSV_COLUMNS",
           "SCHEMA", "parse_amount", "check_reason", "tenant_arg", "AMOUNT_INT_DIGITS", "REASON_MAX"]
