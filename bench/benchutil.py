"""Helpers the benchmark scripts share: run a command, time a call.

The scripts run as ``python bench/NAME.py``, so this directory is on
``sys.path`` and they import this module by name.
"""

from __future__ import annotations

import math
import shlex
import statistics
import subprocess
import time
from typing import Callable, List


def run(argv: List[str]) -> str:
    """Run ``argv``; its stdout, or SystemExit naming the command and its stderr when it fails."""
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
    return proc.stdout


def precompile(package_dir) -> None:
    """Byte-compile the package at ``package_dir`` as an installed package has it, before anything is timed.

    The shell this runs from may set ``PYTHONDONTWRITEBYTECODE=1`` (which would leave a process that
    finds no bytecode compiling every module each run): the compile runs without it, in its own process.
    Raises SystemExit when compileall fails."""
    import os
    import sys
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run([sys.executable, "-m", "compileall", "-q", str(package_dir)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench: compiling {package_dir} failed: {proc.stderr.strip()[:500]}")


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took (wall clock, perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def a40_spec_yaml(gpus: int, name: str) -> str:
    """A simulated host spec (YAML text) of ``gpus`` A40s on classic mdev, each behind its own root port."""
    lines = ["version: 1", f"name: {name}-{gpus}", "host:",
             "  cmdline: BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet intel_iommu=on iommu=pt",
             "  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]",
             "devices:"]
    for i in range(gpus):
        port, gpu = f"0000:00:{i + 1:02x}.0", f"0000:{0x41 + i:02x}:00.0"
        lines.append(f'  - {{bdf: "{port}", model: intel-root-port, numa_node: 0}}')
        lines.append(f'  - {{bdf: "{gpu}", model: A40, upstream: "{port}", numa_node: 0, vgpu: {{backend: mdev}}}}')
    return "\n".join(lines) + "\n"


def wait_agent(proc: subprocess.Popen, path: str, log: Callable[[], str]) -> subprocess.Popen:
    """``proc`` (a ``vgpuhost agent``) once its socket ``path`` answers ``GET /v1/agent`` (30 s at most);
    SystemExit, with the end of ``log()``, when it exits first or never answers (then it is killed)."""
    from vgpuhost.io import agentclient
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"bench: the agent exited {proc.returncode}: {log()[-500:]}")
        try:
            if agentclient.call(path, "GET", "/v1/agent", timeout_s=5)[0] == 200:
                return proc
        except (agentclient.AgentDown, OSError):
            pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("bench: the agent did not answer")


def exponent(sizes: List[int], values: List[float]) -> float:
    """The least-squares slope of log(value) over log(size): how a cost grows with the host (1: linearly)."""
    xs = [math.log(s) for s in sizes]
    ys = [math.log(max(v, 1e-9)) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")
