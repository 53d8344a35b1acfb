"""Helpers the benchmark scripts share: run a command, time a call.

The scripts run as ``python bench/NAME.py``, so this directory is on
``sys.path`` and they import this module by name.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from typing import Callable, List


def run(argv: List[str]) -> str:
    """Run ``argv``; its stdout, or SystemExit naming the command and its stderr when it fails."""
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
    return proc.stdout


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took (wall clock, perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
