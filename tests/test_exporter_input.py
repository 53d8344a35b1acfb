"""Time and interval options refused with one line and exit 2 (trial 9 F3).

Extreme dates (a period or an ``--until`` whose end is past year 9999, an offset that moves a time before
year 1) and numbers that are not finite (``nan``, ``inf``: ``click.FloatRange`` lets NaN through, every
comparison with it being false) ended in "internal error", exit 4, or (``agent --metering-interval nan``)
turned metering off without a word.  One parser per kind of value (:class:`vgpuhost.cli.common.Finite`,
:func:`vgpuhost.policy.when.parse_when`, :func:`vgpuhost.policy.billing.period_bounds`) refuses them.
"""

from __future__ import annotations

import contextlib
import io
from datetime import datetime, timezone

import pytest

from vgpuhost.cli.main import main as cli_main
from vgpuhost.policy.when import parse_when


def _cli(host, *argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["--root", str(host.root), *argv])
    return code, out.getvalue(), err.getvalue()


PRICES = "version: 1\ncurrency: EUR\nallocated:\n  profiles:\n    A40-8Q: 0.80\n"


@pytest.mark.parametrize("argv, says", [
    (("bill", "--prices", "{prices}", "--period", "9999-12"), "invalid period '9999-12'"),
    (("usage", "--until", "9999-12-31T23:30"), "invalid time '9999-12-31T23:30'"),
    (("usage", "--since", "0001-01-01T00:00+01:00"), "invalid time '0001-01-01T00:00+01:00'"),
    (("advise", "--until", "9999-12-31T23:30"), "invalid time '9999-12-31T23:30'"),
    (("audit", "--since", "0001-01-01T00:00+01:00"), "invalid --since '0001-01-01T00:00+01:00'"),
    (("exporter", "--interval", "nan"), "'--interval': 'nan' is not a finite number"),
    (("exporter", "--max-hold", "nan", "--once"), "'--max-hold': 'nan' is not a finite number"),
    (("exporter", "--max-hold", "inf", "--once"), "'--max-hold': inf is not in the range"),
    (("top", "--interval", "nan", "-n", "1"), "'--interval': 'nan' is not a finite number"),
    (("agent", "--metering-interval", "nan"), "'--metering-interval': 'nan' is not a finite number"),
    (("agent", "--read-timeout", "NaN"), "'--read-timeout': 'NaN' is not a finite number"),
    # final 9 N5: the TCP listener's scope with no TCP listener
    (("agent", "--metrics-scope", "all"), "--metrics-scope all applies to the --metrics-port listener"),
    (("advise", "--min-hours", "nan"), "'--min-hours': 'nan' is not a finite number"),
    (("advise", "--min-hours", "inf"), "'--min-hours': 'inf' is not a finite number"),
])
def test_out_of_range_times_and_nan_are_refused_with_one_line_and_exit_2(make_host, tmp_path, argv, says):
    host = make_host("a40-mdev")
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES)
    code, out, err = _cli(host, *[a.format(prices=prices) for a in argv])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("vgpuhost: error: "), (code, err)
    assert says in lines[0] and "internal error" not in err, err
    assert not (host.root / "run" / "vgpuhost").exists()          # nothing started (the agent)


def test_the_last_period_and_time_within_range_still_work(make_host, tmp_path):
    host = make_host("a40-mdev")
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES)
    code, out, err = _cli(host, "bill", "--prices", str(prices), "--period", "9999-11")
    assert code == 0 and "total: 0.00 EUR" in out, err
    code, out, err = _cli(host, "usage", "--since", "1960-01-01", "--until", "9999-11-30T23:30")
    assert code == 0, err
    now = datetime(2026, 12, 7, tzinfo=timezone.utc)
    assert parse_when("9999-12-01T00:00", now) == datetime(9999, 12, 1, tzinfo=timezone.utc)
    assert parse_when("9999-12-01T00:01", now) is None and parse_when("0001-01-01T00:00", now) is None
    assert parse_when("999999999d", now) == datetime(1, 1, 2, tzinfo=timezone.utc)
