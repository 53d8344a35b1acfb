"""bench/forecast.py runs (a smoke test on 3 weeks): the real sampler writes the simulated history and
the table prints each series' held-out error beside the baseline's.  Nothing is asserted on the errors'
size (the bench reports them; tests/test_forecast.py checks the method on known seasonality)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_forecast_prints_held_out_errors_and_the_baseline(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "bench" / "forecast.py"), "--weeks", "3", "--tmpdir",
                        str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = re.findall(r"^tenant (office|batch) (allocated:vgpus|busy) +1 +([0-9.]+)% +([0-9.]+)%$", r.stdout, re.M)
    assert {(t, m) for t, m, _e, _b in rows} == {("office", "allocated:vgpus"), ("office", "busy"),
                                                ("batch", "allocated:vgpus"), ("batch", "busy")}, r.stdout
    assert "504 ticks" in r.stdout
    assert list(tmp_path.iterdir()) == [], "the bench removes its host"
