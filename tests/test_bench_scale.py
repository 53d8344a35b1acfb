"""bench/scale.py runs (a smoke test on small hosts): it must apply, plan and run the hook for real,
and print its table and ratios.  Nothing is asserted on time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_scale_runs_on_small_hosts(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--gpus", "1,2", "--runs", "1",
                        "--per-gpu", "2", "--tmpdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for op in ("types", "plan", "apply", "hook"):
        assert f"   2  {op}" in out, out
    assert "4 vGPUs" in out and "2 steps" in out
    assert "apply per vGPU, 2 GPUs / 1" in out
    assert list(tmp_path.iterdir()) == [], "the bench removes its hosts"
