"""bench/hook.py runs: its yardstick is a clean ``-I -S`` start, it reports every host it is given (one
with no device to make says why), the simulator's and the agent's columns, and the growth exponent
(issue 31).  A smoke run (5 runs, two hosts, agent down, two sizes): nothing is asserted on time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_hook_smoke_run_reports_each_host_the_yardstick_and_the_growth_exponent(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "hook.py"), "--runs", "5", "--agent", "down",
                           "--hosts", "a40-mdev,iommu-off", "--growth", "1,2", "--tmpdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "yardstick: " in out and "-I -S -c pass (clean start, the hook's own flags)" in out
    header = next(line for line in out.splitlines() if line.startswith("WHAT"))
    assert header.split() == ["WHAT", "WALL", "ms", "MIN", "ms", "MAX", "ms", "SIM", "ms", "SIMCPU", "CPU", "ms",
                              "AGENT", "ms", "WRITER", "OWN", "ms"]
    rows = {line.split("  ")[0] for line in out.splitlines()}
    assert {"clean python -I -S -c pass", "a40-mdev prepare", "a40-mdev release", "iommu-off no-meta",
            "a40x1 prepare", "a40x2 release"} <= rows
    assert "own (wall - sim) / clean wall" in out and "CPU - sim CPU / clean CPU" in out
    assert re.search(r"^iommu-off +no device to make: the IOMMU is off", out, re.M)
    assert "growth exponent k (own ~ GPUs^k, least squares over 1,2): " in out
    assert list(tmp_path.iterdir()) == []           # the scratch hosts are removed
