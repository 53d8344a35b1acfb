#!/usr/bin/env python3
"""Benchmark: the metering sampler's cost per vGPU per interval, and scrape latency.

A host of GPUS x VGPUS active vGPUs (default 8 x 48 = 384) is read through an
in-memory MeteringNvml that answers at once (so the figures are vgpuhost's own
cost: attribution, integration, the hourly-rollup transaction in a real
SQLite state store, the snapshot), with a load that changes every reading.
Then ``vgpuhost exporter``'s HTTP server (prometheus-client) serves that
snapshot on loopback and ``/metrics`` is fetched RUNS times.

Printed: median and p95 of one sampler tick, the cost per vGPU per interval,
the tick as a share of the default 10 s interval, scrape latency (median,
p95), page size and series count.  NVML's own time on a real GPU host comes
on top of the tick (bench/nvml_probe.py measures a real driver's reads).

    .venv/bin/python bench/metering.py [--gpus 8] [--vgpus 48] [--ticks 30] [--runs 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vgpuhost.io.nvml_metering import GpuReading, UtilSample, VgpuReading  # noqa: E402
from vgpuhost.io.state import StateStore  # noqa: E402
from vgpuhost.ops.exporter import serve  # noqa: E402
from vgpuhost.ops.metering import Sampler  # noqa: E402

MIB = 1024 * 1024


class SyntheticNvml:
    """GPUS x VGPUS active vGPUs; the clock moves 10 s per read."""

    def __init__(self, gpus: int, vgpus: int):
        self.gpus, self.vgpus = gpus, vgpus
        self.t_us = 1_796_000_000_000_000
        self.n = 0

    def clock_us(self) -> int:
        return self.t_us

    def read(self, last_seen_us):
        self.n += 1
        self.t_us += 10_000_000
        out = []
        for g in range(self.gpus):
            bdf = f"0000:{0x41 + g:02x}:00.0"
            vs = []
            for i in range(self.vgpus):
                k = g * self.vgpus + i
                sm = float((k * 7 + self.n * 13) % 101)
                vs.append(VgpuReading(i + 1, f"00000000-0000-4000-8000-{k:012x}", f"10000000-0000-4000-8000-{k:012x}",
                                      "L40S-1Q", None, ((k + self.n) % 900) * MIB, 1024 * MIB,
                                      "licensed" if k % 17 else "unlicensed",
                                      UtilSample(self.t_us, sm, sm / 2, sm / 10, sm / 20)))
            out.append(GpuReading(bdf, "NVIDIA L40S", False, tuple(vs)))
        return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--vgpus", type=int, default=48)
    ap.add_argument("--ticks", type=int, default=30)
    ap.add_argument("--runs", type=int, default=50)
    a = ap.parse_args()
    n = a.gpus * a.vgpus
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(Path(tmp) / "state")
        nv = SyntheticNvml(a.gpus, a.vgpus)
        sampler = Sampler(nv, store, interval_s=10)
        sampler.tick()
        sampler.tick()                     # first device sight, then the first integration
        ticks = []
        for _ in range(a.ticks):
            t0 = time.perf_counter()
            snap = sampler.tick()
            ticks.append(time.perf_counter() - t0)
        assert snap.ok and len(snap.devices) == n, "the sampler failed"
        med = statistics.median(ticks)
        print(f"metering sampler, {a.gpus} GPUs x {a.vgpus} vGPUs = {n} vGPUs, {a.ticks} ticks")
        print(f"  tick: median {med * 1e3:.1f} ms, p95 {pct(ticks, 95) * 1e3:.1f} ms")
        print(f"  per vGPU per interval: {med / n * 1e6:.0f} us")
        print(f"  tick / 10 s interval: {med / 10:.4%}")

        stop = threading.Event()
        ready = threading.Event()
        port = {}

        def on_ready(p):
            port["p"] = p
            ready.set()

        sampler.interval_s = 3600          # the server's own loop ticks once; the scrapes read the snapshot
        t = threading.Thread(target=serve, args=(sampler,), kwargs=dict(port=0, stop=stop, ready=on_ready),
                             daemon=True)
        t.start()
        ready.wait(30)
        url = f"http://127.0.0.1:{port['p']}/metrics"
        body = urllib.request.urlopen(url, timeout=30).read()
        lat = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            body = urllib.request.urlopen(url, timeout=30).read()
            lat.append(time.perf_counter() - t0)
        stop.set()
        t.join(10)
        series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
        print(f"scrape /metrics ({a.runs} runs): median {statistics.median(lat) * 1e3:.1f} ms, "
              f"p95 {pct(lat, 95) * 1e3:.1f} ms, {len(body) / 1024:.0f} KiB, {series} series")
        print(f"  scrape / tick: {statistics.median(lat) / med:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
