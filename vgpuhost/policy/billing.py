"""Billing: the price sheet, and bills priced from the hourly usage rollups.

Owns: reading and validating a price sheet (``version: 1`` YAML,
docs/guide/billing.md, docs/schemas/prices.v1.schema.json) into a frozen
:class:`PriceSheet`, and :func:`price`, the pure function that turns a
period's rollup rows (:class:`~vgpuhost.model.usage.UsageRow`), its metering
gaps and the tenants' guarantees into a :class:`Bill` of lines, each naming
its quantity, unit, rate, amount and the rollup rows it came from.

Money is exact: every rate, quantity and amount is a :class:`decimal.Decimal`
(never a float); rates, tier bounds and percentages are built from the
sheet's text as written (plain decimal text, at most 12 digits before and 12
after the point; YAML 1.1 forms such as ``010``, ``0x10``, ``1_000``, ``1:30``,
``1e3`` or ``.5`` are refused, never read as the number YAML would make).
Quantities are rounded to :data:`QUANTITY_PLACES` decimal places (half-even)
before they are priced, each line's amount to the currency's minor units
with the sheet's rounding (``half-up`` or ``half-even``, banker's), and a
tenant's total is the sum of its rounded lines, so every line can be
checked from the numbers it shows.

Errors: a bad sheet is one :class:`~vgpuhost.model.errors.InputError`
``FILE:LINE: what is wrong; what to do`` (exit 2); usage a sheet gives no
rate for is one InputError naming the profile (nothing is billed silently).
Must not: read the state store or the host (:mod:`vgpuhost.ops.billing`
does), or hold a float amount.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date as _date, datetime as _datetime, timedelta as _timedelta
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Context, Decimal, localcontext
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..io.yamlutil import read_text_file
from ..model.concepts import DeviceKind
from ..model.errors import InputError
from ..model.tenancy import NO_TENANT
from ..model.usage import UsageRow
from ..model.values import VgpuProfile
from ..model.yamldoc import Located, checked_mapping, kind_of, load_located, require_versioned, shown

VERSION = 1
#: decimal places quantities (hours, GB-hours, slice-hours) are rounded to before they are priced
QUANTITY_PLACES = 6
#: ISO 4217 codes this vgpuhost knows, with their minor units (digits after the decimal point)
CURRENCIES: Dict[str, int] = {
    "AUD": 2, "BHD": 3, "BRL": 2, "CAD": 2, "CHF": 2, "CNY": 2, "CZK": 2, "DKK": 2, "EUR": 2, "GBP": 2,
    "HKD": 2, "HUF": 2, "IDR": 2, "ILS": 2, "INR": 2, "ISK": 0, "JOD": 3, "JPY": 0, "KRW": 0, "KWD": 3,
    "MXN": 2, "NOK": 2, "NZD": 2, "OMR": 3, "PLN": 2, "RON": 2, "SAR": 2, "SEK": 2, "SGD": 2, "THB": 2,
    "TND": 3, "TRY": 2, "TWD": 2, "USD": 2, "ZAR": 2,
}
#: rounding modes a sheet may name -> decimal's
ROUNDINGS = {"half-up": ROUND_HALF_UP, "half-even": ROUND_HALF_EVEN}
#: guarantee dimensions a reserved rate may be given for, the rollup kind each covers, and its unit
RESERVED_DIMS = {"vgpus": ("vgpu", "vGPU-hour"), "mig_slices": ("mig-vgpu", "slice-hour"),
                 "passthrough_gpus": (DeviceKind.PASSTHROUGH.value, "GPU-hour")}
#: a rollup row's kind -> the guarantee dimension its use counts against
DIM_OF_KIND = {kind: dim for dim, (kind, _unit) in RESERVED_DIMS.items()}
_CTX = Context(prec=50)
_HOUR = Decimal(3600)
_Q = Decimal(1).scaleb(-QUANTITY_PLACES)


# --- the price sheet -------------------------------------------------------------------

@dataclass(frozen=True)
class Tier:
    """One step of a graduated rate: ``rate`` per unit for the quantity up to ``up_to`` (None: no end)."""

    up_to: Optional[Decimal]
    rate: Decimal


Rate = Tuple[Tier, ...]


@dataclass(frozen=True)
class PriceSheet:
    """A validated price sheet (see the module doc and docs/guide/billing.md).

    ``profiles``: ``{profile upper-cased: rate}`` per allocated hour; ``families``:
    ``{"A40-Q": rate}`` per framebuffer GB-hour (GB as the profile name spells it);
    ``mig_slice``: per compute-slice-hour of a MIG-backed vGPU; ``passthrough_gpu``:
    per GPU-hour; ``sm_busy``: per SM-busy hour (optional); ``reserved``:
    ``{dimension: per guaranteed unit-hour}``; ``burst_surcharge_percent``: on the
    on-demand amounts of a tenant's use above its guarantee; ``discounts``:
    ``{tenant: percent}``.  ``sha256``: of the sheet's text.
    """

    source: str
    sha256: str
    currency: str
    minor_units: int
    rounding: str
    profiles: Mapping[str, Rate] = field(default_factory=dict)
    families: Mapping[str, Rate] = field(default_factory=dict)
    mig_slice: Optional[Rate] = None
    passthrough_gpu: Optional[Rate] = None
    sm_busy: Optional[Rate] = None
    reserved: Mapping[str, Decimal] = field(default_factory=dict)
    burst_surcharge_percent: Decimal = Decimal(0)
    discounts: Mapping[str, Decimal] = field(default_factory=dict)

    def money(self, value: Decimal) -> Decimal:
        """``value`` rounded to the currency's minor units with the sheet's rounding."""
        return value.quantize(Decimal(1).scaleb(-self.minor_units), rounding=ROUNDINGS[self.rounding],
                              context=_CTX)


def load_prices(path: "str | Any") -> PriceSheet:
    """Read and validate a price sheet file (a regular UTF-8 file of at most 1 MiB).

    Raises InputError ``FILE:LINE: what; hint`` (``FILE`` as given) for every bad sheet.
    """
    text = read_text_file(path, "price sheet")
    return parse_prices(text, source=str(path))


def parse_prices(text: str, source: str = "<prices>") -> PriceSheet:
    """Validate price sheet text (see :func:`load_prices`)."""
    loc = load_located(text, source)
    return _SheetParser(loc).sheet(hashlib.sha256(text.encode("utf-8")).hexdigest())


_TOP = {"version", "currency", "rounding", "allocated", "passthrough_gpu", "sm_busy", "reserved",
        "burst_surcharge_percent", "tenants", "description"}
_ALLOCATED = {"profiles", "families", "mig_slice"}
_TIER = {"up_to", "rate"}
_TENANT = {"discount_percent"}
_FAMILY_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9 ]*(?:-[A-Za-z0-9 ]+)*-[A-Za-z]{1,2}\Z")
_TENANT_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}\Z")
#: money and bounds as a sheet writes them: plain decimal text (a sign only to say "negative" in the refusal)
MONEY_TEXT = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?"
_DECIMAL_TEXT = re.compile(r"\A" + MONEY_TEXT + r"\Z")
#: at most this many digits before / after the decimal point of a sheet's number
MAX_INT_DIGITS = 12
MAX_FRACTION_DIGITS = 12


class _SheetParser:
    def __init__(self, loc: Located):
        self.loc = loc

    def err(self, path: tuple, message: str, hint: Optional[str] = None) -> InputError:
        return self.loc.error(path, message, hint)

    def mapping(self, value: Any, path: tuple, allowed: set, what: str) -> Dict[Any, Any]:
        return checked_mapping(self.err, value, path, allowed, what,
                               hint="see docs/guide/billing.md for the price sheet's format")

    def number(self, value: Any, path: tuple, what: str, *, high: Optional[Decimal] = None,
               positive: bool = False) -> Decimal:
        """A decimal >= 0 (> 0 with ``positive``; <= ``high``) built from the value's text as the
        sheet wrote it (never from the float YAML would read): plain or quoted decimal text,
        :data:`MONEY_TEXT`, at most :data:`MAX_INT_DIGITS` digits before the point and
        :data:`MAX_FRACTION_DIGITS` after it.  YAML 1.1 number forms a plain decimal reader
        would not take (``010``, ``0x10``, ``1_000``, ``1:30``, ``1e3``, ``.5``) are refused."""
        raw = self.loc.scalar(path)
        text, style = raw if raw is not None else (str(value), "")      # None: a default, not written
        if isinstance(value, (bool, dict, list)) or value is None or \
                (isinstance(value, str) and not _DECIMAL_TEXT.match(text)):
            raise self.err(path, f"{what} must be a number, found {kind_of(value)} {shown(value)}",
                           hint="write it as a decimal number, e.g. 0.85")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.err(path, f"{what} is not a finite number", hint="write a decimal number, e.g. 0.85")
        if style in ("|", ">") or not _DECIMAL_TEXT.match(text):
            reads = f", which YAML 1.1 reads as {shown(value)}" if isinstance(value, (int, float)) else ""
            raise self.err(path, f"{what} is written {shown(text)}{reads}: not plain decimal text",
                           hint="write digits with an optional fraction, e.g. 0.85 or 8 (no leading zero, "
                                "exponent, underscore, hex, sexagesimal 1:30 or leading dot)")
        whole, _, frac = text.lstrip("-").partition(".")
        for n, most, where in ((len(whole), MAX_INT_DIGITS, "before"), (len(frac), MAX_FRACTION_DIGITS, "after")):
            if n > most:
                raise self.err(path, f"{what} has {n} digits {where} the decimal point, more than {most}",
                               hint=f"write at most {MAX_INT_DIGITS} digits before the point and "
                                    f"{MAX_FRACTION_DIGITS} after it")
        d = Decimal(text)
        if d < 0 or text.startswith("-"):        # -0 too: a sign is refused (billing.md)
            raise self.err(path, f"{what} is negative ({d})",
                           hint="rates, percentages and tier bounds are >= 0; a credit is a 'bill adjust'")
        if positive and d == 0:
            raise self.err(path, f"{what} must be above 0", hint="give a positive number")
        if high is not None and d > high:
            raise self.err(path, f"{what} = {d} is above {high}", hint=f"give a number from 0 to {high}")
        return d

    def rate(self, value: Any, path: tuple, what: str) -> Rate:
        """A flat rate (a number) or graduated tiers ``[{up_to: Q, rate: R}, ..., {rate: R}]``."""
        if not isinstance(value, list):
            return (Tier(None, self.number(value, path, what)),)
        if not value:
            raise self.err(path, f"{what} has no tiers", hint="give a number, or tiers ending with {rate: R}")
        tiers: List[Tier] = []
        last: Optional[Decimal] = None
        for i, t in enumerate(value):
            p = path + (i,)
            body = self.mapping(t, p, _TIER, f"{what} tier {i + 1}")
            if "rate" not in body:
                raise self.err(p, f"{what} tier {i + 1} needs the key 'rate'", hint="e.g. {up_to: 500, rate: 0.8}")
            final = i == len(value) - 1
            if "up_to" not in body and not final:
                raise self.err(p, f"{what} tier {i + 1} has no 'up_to' but is not the last tier",
                               hint="only the last tier may be open-ended; sort tiers by up_to")
            up = self.number(body["up_to"], p + ("up_to",), f"{what} tier {i + 1} up_to", positive=True) \
                if "up_to" in body else None
            if up is not None and last is not None and up <= last:
                raise self.err(p + ("up_to",), f"{what} tiers overlap or are unsorted: tier {i + 1} ends at "
                               f"{up}, not after tier {i}'s {last}",
                               hint="sort tiers by up_to, each ending above the one before")
            if final and up is not None:
                raise self.err(p, f"{what}'s last tier ends at {up}: use above it would have no rate",
                               hint="leave 'up_to' out of the last tier")
            tiers.append(Tier(up, self.number(body["rate"], p + ("rate",), f"{what} tier {i + 1} rate")))
            last = up
        return tuple(tiers)

    def sheet(self, sha256: str) -> PriceSheet:
        data = require_versioned(self.loc, "price sheet")        # before any message may quote the file
        top = self.mapping(data, (), _TOP, "the price sheet")
        version = top["version"]
        if isinstance(version, str) and version.strip() == str(VERSION):
            raise self.err(("version",), f"version is the string {shown(version)}, not the number {VERSION}",
                           hint=f"write version: {VERSION} without quotes")
        if isinstance(version, bool) or version != VERSION:
            raise self.err(("version",), f"unsupported price sheet version {shown(version)}",
                           hint=f"this vgpuhost reads version {VERSION}")
        if "currency" not in top:
            raise self.err((), "the price sheet needs the key 'currency'", hint="e.g. currency: EUR (ISO 4217)")
        cur = top["currency"]
        if not isinstance(cur, str) or cur.upper() not in CURRENCIES:
            raise self.err(("currency",), f"unknown currency {shown(cur)}",
                           hint="give an ISO 4217 code: " + ", ".join(sorted(CURRENCIES)))
        rounding = top.get("rounding", "half-up")
        if rounding not in ROUNDINGS:
            raise self.err(("rounding",), f"unknown rounding {shown(rounding)}",
                           hint="half-up (0.005 -> 0.01) or half-even (banker's: 0.005 -> 0.00, 0.015 -> 0.02)")
        if "description" in top and not isinstance(top["description"], str):
            raise self.err(("description",), f"description must be a string, found {kind_of(top['description'])}",
                           hint="quote it")
        profiles: Dict[str, Rate] = {}
        families: Dict[str, Rate] = {}
        mig_slice = None
        if "allocated" in top:
            alloc = self.mapping(top["allocated"], ("allocated",), _ALLOCATED, "allocated")
            for name, r in self.mapping(alloc.get("profiles", {}), ("allocated", "profiles"),
                                        _AnyKey(), "allocated.profiles").items():
                p = ("allocated", "profiles", name)
                prof = VgpuProfile.try_parse(name) if isinstance(name, str) else None
                if prof is None:
                    raise self.err(p, f"allocated.profiles: {shown(name)} is not a vGPU profile name",
                                   hint="e.g. A40-8Q or A100-3-20C ('vgpuhost types' lists them)")
                if str(prof).upper() in profiles:
                    raise self.err(p, f"allocated.profiles: {name} is given twice (names compare without case)",
                                   hint="keep one")
                profiles[str(prof).upper()] = self.rate(r, p, f"allocated.profiles.{prof}")
            for name, r in self.mapping(alloc.get("families", {}), ("allocated", "families"),
                                        _AnyKey(), "allocated.families").items():
                p = ("allocated", "families", name)
                if not isinstance(name, str) or not _FAMILY_RE.match(name):
                    raise self.err(p, f"allocated.families: {shown(name)} is not a profile family",
                                   hint="a family is BOARD-SERIES, e.g. A40-Q or A100-C")
                if name.upper() in families:
                    raise self.err(p, f"allocated.families: {name} is given twice (names compare without case)",
                                   hint="keep one")
                families[name.upper()] = self.rate(r, p, f"allocated.families.{name}")
            if "mig_slice" in alloc:
                mig_slice = self.rate(alloc["mig_slice"], ("allocated", "mig_slice"), "allocated.mig_slice")
        passthrough = self.rate(top["passthrough_gpu"], ("passthrough_gpu",), "passthrough_gpu") \
            if "passthrough_gpu" in top else None
        sm_busy = self.rate(top["sm_busy"], ("sm_busy",), "sm_busy") if "sm_busy" in top else None
        reserved: Dict[str, Decimal] = {}
        if "reserved" in top:
            for dim, v in self.mapping(top["reserved"], ("reserved",), set(RESERVED_DIMS), "reserved").items():
                reserved[dim] = self.number(v, ("reserved", dim), f"reserved.{dim}")
        burst = self.number(top["burst_surcharge_percent"], ("burst_surcharge_percent",),
                            "burst_surcharge_percent") if "burst_surcharge_percent" in top else Decimal(0)
        discounts: Dict[str, Decimal] = {}
        if "tenants" in top:
            for name, body in self.mapping(top["tenants"], ("tenants",), _AnyKey(), "tenants").items():
                p = ("tenants", name)
                if not isinstance(name, str) or not _TENANT_RE.match(name):
                    raise self.err(p, f"tenants: {shown(name)} is not a tenant name",
                                   hint="letters, digits and _ . + - (at most 64 characters); quote it")
                if name.lower() in {k.lower() for k in discounts}:
                    raise self.err(p, f"tenants: {name} is given twice (names compare without case)",
                                   hint="keep one")
                terms = self.mapping(body, p, _TENANT, f"tenants.{name}")
                discounts[name] = self.number(terms.get("discount_percent", 0), p + ("discount_percent",),
                                              f"tenants.{name}.discount_percent", high=Decimal(100))
        if not (profiles or families or mig_slice or passthrough or sm_busy or reserved):
            raise self.err((), "the price sheet prices nothing",
                           hint="give allocated.profiles, allocated.families, allocated.mig_slice, "
                                "passthrough_gpu, sm_busy or reserved rates")
        return PriceSheet(self.loc.source, sha256, cur.upper(), CURRENCIES[cur.upper()], rounding, profiles,
                          families, mig_slice, passthrough, sm_busy, reserved, burst, discounts)


class _AnyKey(set):
    """Allowed keys of a mapping whose keys are names (checked by the caller)."""

    def __contains__(self, item: object) -> bool:
        return True


# --- bills -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """The rollup rows a line comes from: ``rows`` of ``usage_hourly`` of the line's tenant, hours
    ``first_hour``..``last_hour``, on ``devices``, summing ``seconds`` (allocation, or SM busy)."""

    rows: int = 0
    first_hour: str = ""
    last_hour: str = ""
    devices: Tuple[str, ...] = ()
    seconds: Decimal = Decimal(0)


@dataclass(frozen=True)
class Line:
    """One bill line: ``quantity`` ``unit`` at ``rate`` (currency per unit) = ``amount``.

    ``item``: what is priced (``on-demand``, ``burst``, ``reserved``, ``covered``,
    ``burst-surcharge``, ``sm-busy``, ``discount``); ``key``: the rate's key (a profile, a
    family, ``mig_slice``, ``passthrough_gpu``, a guarantee dimension); ``tier``: 1-based
    tier of a graduated rate (0: flat); ``kind``: the rollup kind (vgpu, mig-vgpu,
    passthrough; "" for lines that are not usage).
    """

    tenant: str
    item: str
    key: str
    kind: str
    tier: int
    quantity: Decimal
    unit: str
    rate: Decimal
    amount: Decimal
    source: Source = Source()
    note: str = ""


@dataclass(frozen=True)
class Bill:
    """A period's bill: ``lines`` by tenant, ``totals`` ``{tenant: amount}``, ``gaps`` (the
    metering gaps overlapping the period: ``(start, end, device, seconds, reason, tenants)``)."""

    period: str
    start: str
    end: str
    hours: int
    currency: str
    rounding: str
    prices_sha256: str
    lines: Tuple[Line, ...]
    totals: Mapping[str, Decimal]
    gaps: Tuple[tuple, ...] = ()
    #: idle capacity, never priced: ``(key, kind, hours, Source)`` of the rows of devices no domain held
    idle: Tuple[Tuple[str, str, Decimal, Source], ...] = ()


_PERIOD_RE = re.compile(r"\A([0-9]{4})-([0-9]{2})\Z")


def period_bounds(period: str) -> Tuple[str, str, int]:
    """``2026-11`` -> ``("2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z", 720)``: the period's first
    hour, the first hour after it (rollup hour keys) and its length in hours (UTC months).
    InputError for anything but ``YYYY-MM`` from 1970-01 to 9999-11."""
    m = _PERIOD_RE.match(period or "")
    if not m or not 1 <= int(m.group(2)) <= 12 or not (1970, 1) <= (int(m.group(1)), int(m.group(2))) <= (9999, 11):
        # 9999-12 would end in year 10000, past datetime's range (trial 9 F3)
        raise InputError(f"invalid period {shown(period)}",
                         hint="give a UTC month as YYYY-MM from 1970-01 to 9999-11, e.g. 2026-11")
    y, mo = int(m.group(1)), int(m.group(2))
    ny, nm = (y + 1, 1) if mo == 12 else (y, mo + 1)
    days = (_date(ny, nm, 1) - _date(y, mo, 1)).days
    return f"{y:04d}-{mo:02d}-01T00:00:00Z", f"{ny:04d}-{nm:02d}-01T00:00:00Z", days * 24


def hours_of(seconds: float) -> Decimal:
    """Seconds (a rollup's float) as exact decimal hours, before rounding to QUANTITY_PLACES."""
    return _CTX.divide(Decimal(repr(float(seconds))), _HOUR)


def quantity(value: Decimal) -> Decimal:
    """A quantity as it is priced: rounded half-even to :data:`QUANTITY_PLACES` places."""
    return value.quantize(_Q, rounding=ROUND_HALF_EVEN, context=_CTX)


def family_of(profile: VgpuProfile) -> str:
    """``A40-8Q`` -> ``A40-Q``; ``A100-3-20C`` -> ``A100-C`` (board and series, upper-cased)."""
    return f"{profile.board}-{profile.series}".upper()


#: a tenant's guarantee history as :func:`price` takes it: ``[(from_hour, {dimension: units})]``, each
#: step in force from its rollup hour (``2026-11-20T11:00:00Z``) until the next; or one ``{dimension:
#: units}`` mapping, in force for the whole period
Guarantees = Mapping[str, "Sequence[Tuple[str, Mapping[str, int]]] | Mapping[str, int]"]


def period_hours(start: str, end: str) -> List[str]:
    """The rollup hour keys ``start`` <= hour < ``end`` (both rollup hour keys), in order."""
    a = _datetime.strptime(start, "%Y-%m-%dT%H:00:00Z")
    b = _datetime.strptime(end, "%Y-%m-%dT%H:00:00Z")
    out = []
    while a < b:
        out.append(a.strftime("%Y-%m-%dT%H:00:00Z"))
        a += _timedelta(hours=1)
    return out


def price(rows: Iterable[UsageRow], sheet: PriceSheet, *, period: str, start: str, end: str, hours: int,
          guarantees: Guarantees, gaps: Sequence[tuple] = (), tenant: Optional[str] = None,
          reserved_from: Optional[str] = None) -> Bill:
    """The bill of ``rows`` (the period's rollups, hours ``start`` <= hour < ``end``) under ``sheet``.

    ``guarantees``: ``{tenant: [(from_hour, {dimension: guaranteed units})]}`` (the history of
    each tenant's guarantee, :data:`Guarantees`; dimensions of :data:`RESERVED_DIMS`).  An hour's
    guarantee is the step in force at the hour's start; a tenant is charged ``reserved[dim]`` on
    it for each hour of the period from ``reserved_from`` (a rollup hour: the hour metering began;
    None: the period's start), used or not, and never for an hour before its guarantee existed.
    In each hour its use in that dimension up to that hour's guarantee is covered (a ``covered``
    line, amount 0) and the rest, spread over its rows in proportion, is billed at the on-demand
    rates as ``burst``, with ``burst_surcharge_percent`` on top; use in an hour with no guarantee
    (or no reserved rate for the dimension) is ``on-demand``.
    Per allocated hour a row is priced by its profile's rate, else its family's (per
    GB-hour), else (MIG-backed) ``mig_slice`` per slice-hour; passthrough GPUs by
    ``passthrough_gpu``; SM-busy hours by ``sm_busy`` when given.  Graduated tiers apply to
    the tenant's quantity of one line key in the period.  A tenant's discount is a last
    negative line on its subtotal.  Tenant names compare without case (as the tenancy tables
    do): rows and guarantees of ``acme`` and ``Acme`` are one tenant, named as ``guarantees``
    spells it, else as its first row does.  Rows of a device no domain held (an empty
    ``domain_uuid``: a layout's idle pool vGPU, a GPU prepared for passthrough) are never
    priced: they are :attr:`Bill.idle`, the operator's idle capacity.  ``tenant``: bill only
    that tenant (``""``: the use of domains naming no tenant).

    Raises InputError when a row's profile has no rate in the sheet.
    """
    with localcontext(_CTX):
        return _price(list(rows), sheet, period, start, end, hours, guarantees, gaps, tenant, reserved_from)


def _rate_for(row: UsageRow, sheet: PriceSheet) -> Tuple[str, str, Rate, Decimal]:
    """``(key, unit, rate, units per allocated hour)`` of a row's allocation."""
    if row.kind == DeviceKind.PASSTHROUGH:
        if sheet.passthrough_gpu is None:
            raise InputError(f"usage of passed-through GPU {row.gpu} (tenant {row.tenant or NO_TENANT}) has no rate "
                             "in the price sheet", hint="add passthrough_gpu: RATE (per GPU-hour)")
        return "passthrough_gpu", "GPU-hour", sheet.passthrough_gpu, Decimal(1)
    prof = VgpuProfile.try_parse(row.profile)
    name = str(prof).upper() if prof is not None else row.profile.upper()
    if name in sheet.profiles:
        return str(prof) if prof is not None else row.profile, "hour", sheet.profiles[name], Decimal(1)
    if prof is not None and family_of(prof) in sheet.families:
        return family_of(prof), "GB-hour", sheet.families[family_of(prof)], Decimal(prof.framebuffer_gb)
    if prof is not None and prof.mig_backed and sheet.mig_slice is not None:
        return "mig_slice", "slice-hour", sheet.mig_slice, Decimal(prof.gi_slices)
    fam = f", family {family_of(prof)}" if prof is not None else ""
    raise InputError(f"usage of profile {row.profile!r} (tenant {row.tenant or NO_TENANT}) has no rate in the price "
                     "sheet", hint=f"add allocated.profiles.{row.profile}{fam and ' or allocated.families.' + family_of(prof)}"
                     + (" or allocated.mig_slice" if prof is not None and prof.mig_backed else ""))


def _units(row: UsageRow) -> Decimal:
    """A row's use in its guarantee dimension: vGPU-hours, slice-hours or GPU-hours."""
    h = hours_of(row.alloc_s)
    if row.kind == "mig-vgpu":
        prof = VgpuProfile.try_parse(row.profile)
        return h * Decimal(prof.gi_slices if prof is not None and prof.gi_slices else 1)
    return h


class _Acc:
    """Quantity of one line key and the rows behind it."""

    __slots__ = ("qty", "seconds", "rows", "hours", "devices")

    def __init__(self):
        self.qty = Decimal(0)
        self.seconds = Decimal(0)
        self.rows = 0
        self.hours: set = set()
        self.devices: set = set()

    def add(self, row: UsageRow, qty: Decimal, seconds: float) -> None:
        self.qty += qty
        self.seconds += Decimal(repr(float(seconds)))
        self.rows += 1
        self.hours.add(row.hour)
        self.devices.add(row.device)

    def source(self) -> Source:
        hs = sorted(self.hours)
        return Source(self.rows, hs[0] if hs else "", hs[-1] if hs else "", tuple(sorted(self.devices)),
                      self.seconds)


def _tiered(sheet: PriceSheet, rate: Rate, qty: Decimal) -> List[Tuple[int, Decimal, Decimal]]:
    """``[(tier, quantity, rate)]`` of ``qty`` under graduated ``rate`` (tier 0: a flat rate)."""
    if len(rate) == 1 and rate[0].up_to is None:
        return [(0, qty, rate[0].rate)]
    out, below = [], Decimal(0)
    for i, t in enumerate(rate, 1):
        top = t.up_to if t.up_to is not None else None
        part = (min(qty, top) if top is not None else qty) - below
        if part > 0:
            out.append((i, part, t.rate))
        if top is None or qty <= top:
            break
        below = top
    return out or [(1, Decimal(0), rate[0].rate)]


def _steps(value: "Sequence[Tuple[str, Mapping[str, int]]] | Mapping[str, int]", start: str
           ) -> List[Tuple[str, Mapping[str, int]]]:
    if isinstance(value, Mapping):
        return [(start, value)]
    return sorted(value, key=lambda s: s[0])


def _reserved_note(per_hour: List[int], dim: str) -> str:
    """``guarantee 1 vgpus x 100 hours + 2 vgpus x 620 hours`` (stretches of one level, in order)."""
    parts: List[List[int]] = []
    for g in per_hour:
        if g and parts and parts[-1][0] == g:
            parts[-1][1] += 1
        elif g:
            parts.append([g, 1])
    return "guarantee " + " + ".join(f"{g} {dim} x {n} hours" for g, n in parts)


def _price(rows: List[UsageRow], sheet: PriceSheet, period: str, start: str, end: str, hours: int,
           guarantees: Guarantees, gaps: Sequence[tuple], only: Optional[str],
           reserved_from: Optional[str]) -> Bill:
    # tenant names compare without case: one spelling per tenant (the tenancy tables', else the first row's)
    canon: Dict[str, str] = {t.lower(): t for t in guarantees}
    for r in rows:
        canon.setdefault(r.tenant.lower(), r.tenant)
    rows = [r if canon[r.tenant.lower()] == r.tenant else r._replace(tenant=canon[r.tenant.lower()]) for r in rows]
    if only is not None:
        rows = [r for r in rows if r.tenant.lower() == only.lower()]
    rows = [r for r in rows if start <= r.hour < end]
    idle_rows = [r for r in rows if not r.domain_uuid]
    rows = [r for r in rows if r.domain_uuid]
    all_hours = period_hours(start, end)
    first = max(start, reserved_from) if reserved_from else start
    # each tenant's guarantee per hour of the period: the step in force at the hour's start
    g_hour: Dict[str, Dict[str, List[int]]] = {}
    for t, value in guarantees.items():
        if only is not None and t.lower() != only.lower():
            continue
        steps = _steps(value, start)
        per: Dict[str, List[int]] = {d: [] for d in RESERVED_DIMS}
        i, cur = 0, {}
        for h in all_hours:
            while i < len(steps) and steps[i][0] <= h:
                cur = steps[i][1]
                i += 1
            for d in RESERVED_DIMS:
                per[d].append(int(cur.get(d) or 0) if h >= first and d in sheet.reserved else 0)
        if any(any(v) for v in per.values()):
            g_hour[t] = per
    index = {h: i for i, h in enumerate(all_hours)}
    tenants = sorted({r.tenant for r in rows} | set(g_hour))

    def guaranteed(t: str, dim: str, hour: str) -> int:
        per = g_hour.get(t)
        return per[dim][index[hour]] if per is not None and hour in index else 0

    # each hour's use per (tenant, dimension): what the guarantee covers of it
    used: Dict[tuple, Decimal] = defaultdict(Decimal)
    for r in rows:
        if r.kind in DIM_OF_KIND:
            used[(r.tenant, r.hour, DIM_OF_KIND[r.kind])] += _units(r)
    lines: List[Line] = []
    totals: Dict[str, Decimal] = {}
    by_tenant: Dict[str, List[UsageRow]] = defaultdict(list)
    for r in rows:
        by_tenant[r.tenant].append(r)
    for t in tenants:
        t_lines: List[Line] = []
        # reserved: the guarantee, for every hour of the period it was in force (from metering's start), used or not
        for dim, (kind, unit) in RESERVED_DIMS.items():
            per_hour = (g_hour.get(t) or {}).get(dim) or []
            if any(per_hour):
                q = quantity(Decimal(sum(per_hour)))
                t_lines.append(Line(t, "reserved", dim, kind, 0, q, "guaranteed " + unit, sheet.reserved[dim],
                                    sheet.money(q * sheet.reserved[dim]), note=_reserved_note(per_hour, dim)))
        usage: Dict[tuple, _Acc] = defaultdict(_Acc)
        covered: Dict[str, _Acc] = defaultdict(_Acc)
        rate_of: Dict[tuple, Tuple[Rate, str]] = {}
        sm = _Acc()
        for r in by_tenant.get(t, []):
            key, unit, rate, per_hour_units = _rate_for(r, sheet)
            h = hours_of(r.alloc_s)
            dim = DIM_OF_KIND.get(r.kind, "")
            g = guaranteed(t, dim, r.hour) if dim else 0
            share = Decimal(0)
            if g:
                u = used[(t, r.hour, dim)]
                share = min(Decimal(1), Decimal(g) / u) if u > 0 else Decimal(1)
                covered[dim].add(r, _units(r) * share, r.alloc_s * 1.0)
            item = "burst" if g else "on-demand"
            usage[(item, key, r.kind)].add(r, h * per_hour_units * (1 - share), r.alloc_s)
            rate_of[(item, key, r.kind)] = (rate, unit)
            if sheet.sm_busy is not None and r.kind != DeviceKind.PASSTHROUGH:
                sm.add(r, hours_of(r.sm_busy_s), r.sm_busy_s)
        for dim, acc in sorted(covered.items()):
            if not quantity(acc.qty):
                continue
            kind, unit = RESERVED_DIMS[dim]
            t_lines.append(Line(t, "covered", dim, kind, 0, quantity(acc.qty), unit, Decimal(0), Decimal(0),
                                acc.source(), note="use within the guarantee, paid by the reserved line"))
        for (item, key, kind), acc in sorted(usage.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
            rate, unit = rate_of[(item, key, kind)]
            for tier, q, r_ in _tiered(sheet, rate, quantity(acc.qty)):
                if not q:                    # all of it covered by the guarantee (the covered line shows it)
                    continue
                amount = sheet.money(q * r_)
                t_lines.append(Line(t, item, key, kind, tier, q, unit, r_, amount, acc.source()))
                if item == "burst" and sheet.burst_surcharge_percent:
                    pct = sheet.burst_surcharge_percent / 100
                    t_lines.append(Line(t, "burst-surcharge", key, kind, tier, amount, sheet.currency, pct,
                                        sheet.money(amount * pct), acc.source(),
                                        note=f"{sheet.burst_surcharge_percent}% on the burst line above"))
        if sheet.sm_busy is not None and sm.rows:
            for tier, q, r_ in _tiered(sheet, sheet.sm_busy, quantity(sm.qty)):
                t_lines.append(Line(t, "sm-busy", "sm_busy", "", tier, q, "SM-busy-hour", r_, sheet.money(q * r_),
                                    sm.source()))
        subtotal = sum((ln.amount for ln in t_lines), Decimal(0))
        pct = next((v for k, v in sheet.discounts.items() if k.lower() == t.lower()), Decimal(0))
        if pct:
            t_lines.append(Line(t, "discount", "discount_percent", "", 0, subtotal, sheet.currency, -pct / 100,
                                -sheet.money(subtotal * pct / 100), note=f"{pct}% tenant discount on the subtotal"))
        lines.extend(t_lines)
        totals[t] = sum((ln.amount for ln in t_lines), Decimal(0))
    billed = {r.device: set() for r in rows}
    for r in rows:
        billed[r.device].add(r.tenant)
    shown_gaps = []
    for g in gaps:
        who = tuple(sorted(billed.get(g[2], ())))
        if only is not None and g[2] != "*" and not who:
            continue
        shown_gaps.append((g[0], g[1], g[2], g[3], g[4], who))
    idle: Dict[Tuple[str, str], _Acc] = defaultdict(_Acc)
    for r in idle_rows:
        idle[(r.profile if r.kind != DeviceKind.PASSTHROUGH else "passthrough_gpu", r.kind)].add(
            r, hours_of(r.alloc_s), r.alloc_s)
    return Bill(period, start, end, hours, sheet.currency, sheet.rounding, sheet.sha256, tuple(lines), totals,
                tuple(shown_gaps), tuple((k, kind, quantity(acc.qty), acc.source())
                                         for (k, kind), acc in sorted(idle.items())))


__all__ = ["PriceSheet", "Tier", "Line", "Bill", "Source", "load_prices", "parse_prices", "price", "hours_of",
           "quantity", "family_of", "period_bounds", "period_hours", "Guarantees", "CURRENCIES", "ROUNDINGS", "RESERVED_DIMS", "QUANTITY_PLACES", "VERSION"]
