"""Simulated NVML load: :class:`SimMetering`, the metering NVML of a simulated host.

Owns: deterministic per-vGPU utilisation, framebuffer, licence and VM-id
traces and the simulated clock, kept in ``.vgpuhost-sim/load.json`` beside
the simulated host's ``host.json`` (so separate processes, the sampler and a
test, see one load), and the answers the sampler's reads get
(:class:`vgpuhost.io.nvml_metering.MeteringNvml`).  Must not: change the
simulated kernel or host.json, or be imported on a real host
(:func:`vgpuhost.io.backends.metering_nvml` loads it, by name, only for a
simulated root).

A host spec sets the initial traces with a top-level ``load:`` mapping (the
``traces`` below); at run time :meth:`SimMetering.set_trace` changes them.

``load.json`` (all keys optional)::

    {"clock_offset_s": 0.0,                 # simulated clock = wall clock + offset
     "clock_frozen_s": null,                # set: the clock stands here (+ offset) instead
     "clock_step_s": 0.0,                   # a step of the simulated wall clock alone (NTP's):
                                            # the simulated monotonic clock does not see it
     "traces": {                            # by device id, then "type:<name>", then "default"
        "<mdev UUID | VF BDF | type:A40-8Q | default>": {
            "sm": X, "mem": X, "enc": X, "dec": X,   # percent, X below
            "fb_mib": X,                              # framebuffer used, MiB
            "start": 1767225600.0, "stop": null,      # trace is 0 outside [start, stop) (seconds)
            "vm": "<domain UUID>",                    # what nvmlVgpuInstanceGetVmID reports
            "license": "licensed",                   # a LICENSE_STATES name
            "license_expiry": 1767225600}}}          # when it expires (epoch s; absent: no date)

A value ``X`` is a number (constant), ``{"square": {"high": H, "low": L,
"period_s": P, "duty": 0.5}}`` (H for the first ``duty`` of each period
from ``start``), or ``{"steps": [[t_s, v], ...]}`` (v from ``start + t_s``
on).  A vendor-VFIO vGPU is reported as the driver reports it: no mdev UUID
(``device`` is ''), and the trace's ``vm`` (the libvirt domain UUID QEMU gives the
driver) as its VM id, so the sampler matches it by GPU, VM UUID and type (a real
``nvidia-smi vgpu -q`` of driver 580, tests/data/real/nvidia-smi/); its trace is still
keyed by the VF's BDF.  GPM meters a GPU instance only when its one vGPU is MIG-backed
and owns the instance's whole framebuffer (:func:`_gpm_reasons`).  Every reading is exact: a utilisation sample is the *mean* of the trace
over ``(last_seen, now]`` (1 s back when ``last_seen`` is 0), so the busy
seconds a sampler integrates equal :func:`integral` of the trace.  Traces run on
the simulated true time (the monotonic clock); sample timestamps are on the
simulated wall clock, which :meth:`SimMetering.step_wall` steps.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, List, Optional

from ..io.hostroot import HostRoot
from ..model.errors import InputError
from ..io.nvml_metering import LICENSE_STATES, GpuReading, UtilSample, VgpuReading, read_boot_id
from ..model.nvml import gpm_not_metered
from .kernel import SimKernel

LOAD_FILE = "load.json"
MIB = 1024 * 1024
_GPM_BOARDS = ("H", "B", "GB")          # Hopper and Blackwell boards report GPM


def _value_integral(x: Any, t0: float, t1: float, origin: float) -> float:
    """Integral of value spec ``x`` over ``[t0, t1]`` (seconds; ``origin``: the trace's t = 0)."""
    if t1 <= t0 or x is None:
        return 0.0
    if isinstance(x, (int, float)):
        return float(x) * (t1 - t0)
    if "square" in x:
        sq = x["square"]
        hi, lo, period = float(sq["high"]), float(sq.get("low", 0.0)), float(sq["period_s"])
        on = period * float(sq.get("duty", 0.5))

        def cumulative(t: float) -> float:          # integral from origin to t
            k, r = divmod(t - origin, period)
            return k * (hi * on + lo * (period - on)) + (hi * min(r, on) + lo * max(0.0, r - on))

        return cumulative(t1) - cumulative(t0)
    if "steps" in x:
        steps = sorted((origin + float(t), float(v)) for t, v in x["steps"])
        total = 0.0
        for i, (start, v) in enumerate(steps):
            end = steps[i + 1][0] if i + 1 < len(steps) else math.inf
            a, b = max(t0, start), min(t1, end)
            if b > a:
                total += v * (b - a)
        return total
    raise ValueError("a load value is a number, {square: ...} or {steps: ...}")


def _value_at(x: Any, t: float, origin: float) -> float:
    """Value spec ``x`` at time ``t`` (seconds)."""
    if x is None:
        return 0.0
    if isinstance(x, (int, float)):
        return float(x)
    if "square" in x:
        sq = x["square"]
        period = float(sq["period_s"])
        high = (t - origin) % period < period * float(sq.get("duty", 0.5))
        return float(sq["high"]) if high else float(sq.get("low", 0.0))
    if "steps" in x:
        v = 0.0
        for at, val in sorted((float(a), float(b)) for a, b in x["steps"]):
            if origin + at <= t:
                v = val
        return v
    raise ValueError("a load value is a number, {square: ...} or {steps: ...}")


TRACE_KEYS = ("sm", "mem", "enc", "dec", "fb_mib", "start", "stop", "vm", "license", "license_expiry")
_VALUE_KEYS = ("sm", "mem", "enc", "dec", "fb_mib")


def check_trace(trace: Any) -> Optional[str]:
    """Why ``trace`` is not a valid load trace (see the module doc), or None when it is."""
    if not isinstance(trace, dict):
        return "a trace is a mapping (" + ", ".join(TRACE_KEYS) + ")"
    for key, x in trace.items():
        if key not in TRACE_KEYS:
            return f"unknown trace key {key!r} (allowed: {', '.join(TRACE_KEYS)})"
        if key in _VALUE_KEYS:
            why = _check_value(x, percent=key != "fb_mib")
            if why:
                return f"{key}: {why}"
        elif key in ("start", "stop"):
            if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
                return f"{key} is a time in seconds since the epoch"
        elif key == "vm":
            if not isinstance(x, str) or len(x) > 64:
                return "vm is a domain UUID"
        elif key == "license" and x not in LICENSE_STATES:
            return f"license is one of {', '.join(LICENSE_STATES)}"
        elif key == "license_expiry" and (isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0):
            return "license_expiry is when the licence expires, seconds since the epoch (a number >= 0)"
    return None


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_value(x: Any, *, percent: bool) -> Optional[str]:
    top = 100.0 if percent else 1e9
    ok = (lambda v: _num(v) and 0 <= v <= top)
    if _num(x):
        return None if ok(x) else f"{x} is outside 0..{top:g}"
    if isinstance(x, dict) and set(x) == {"square"} and isinstance(x["square"], dict):
        sq = x["square"]
        if not set(sq) <= {"high", "low", "period_s", "duty"} or "high" not in sq or "period_s" not in sq:
            return "square takes high, period_s and optionally low, duty"
        if not (ok(sq["high"]) and ok(sq.get("low", 0)) and _num(sq["period_s"]) and sq["period_s"] > 0
                and _num(sq.get("duty", 0.5)) and 0 <= sq.get("duty", 0.5) <= 1):
            return f"square: high/low within 0..{top:g}, period_s > 0, duty within 0..1"
        return None
    if isinstance(x, dict) and set(x) == {"steps"} and isinstance(x["steps"], list) and x["steps"]:
        for st in x["steps"]:
            if not (isinstance(st, list) and len(st) == 2 and _num(st[0]) and st[0] >= 0 and ok(st[1])):
                return f"steps are [seconds from start, value within 0..{top:g}] pairs"
        return None
    return "a value is a number, {square: {...}} or {steps: [[t, v], ...]}"


def integral(trace: dict, key: str, t0: float, t1: float) -> float:
    """Integral of ``trace[key]`` (percent) over ``[t0, t1]`` clipped to the trace's start/stop,
    in percent-seconds: ``/ 100`` gives busy seconds."""
    start = float(trace.get("start") or 0.0)
    stop = trace.get("stop")
    a = max(t0, start)
    b = min(t1, float(stop)) if stop is not None else t1
    return _value_integral(trace.get(key), a, b, start)


def write_load(host: HostRoot, traces: Dict[str, dict]) -> None:
    """Write the initial ``load.json`` of a host being built (:mod:`vgpuhost.sim.build`)."""
    (host.sim_dir / LOAD_FILE).write_text(json.dumps({"traces": traces}, indent=1, sort_keys=True))


def _gpm_reasons(vgpus: List[VgpuReading], gpu_instances: List[dict]) -> Dict[int, Optional[str]]:
    """``{gi_id: why GPM does not meter it, or None}`` for each simulated GPU instance holding
    vGPUs: as the driver does, only a MIG-backed vGPU allocated the whole instance's framebuffer
    is metered (:func:`vgpuhost.model.nvml.gpm_not_metered`, NVML API reference "NVML GPM")."""
    profile = {int(g["gi_id"]): g.get("profile") for g in gpu_instances}
    by_gi: Dict[int, List[str]] = {}
    for v in vgpus:
        if v.gi_id is not None:
            by_gi.setdefault(v.gi_id, []).append(v.type_name)
    return {gi: gpm_not_metered(names, profile.get(gi)) for gi, names in sorted(by_gi.items())}


class SimMetering:
    """:class:`~vgpuhost.io.nvml_metering.MeteringNvml` over a simulated host."""

    def __init__(self, host: HostRoot):
        self.host = host
        self.kernel = SimKernel(host)
        self.path = host.sim_dir / LOAD_FILE

    # --- the load file -------------------------------------------------------
    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def _save(self, doc: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def set_trace(self, key: str, trace: Optional[dict]) -> None:
        """Set (None: clear) the trace of ``key`` (device id, ``type:<name>`` or ``default``).

        Raises InputError for a trace :func:`check_trace` refuses."""
        if trace is not None:
            why = check_trace(trace)
            if why:
                raise InputError(f"invalid load trace for {key!r}: {why}", hint="see vgpuhost/sim/metering.py")
        with self.kernel.locked():
            doc = self.load()
            traces = doc.setdefault("traces", {})
            if trace is None:
                traces.pop(key, None)
            else:
                traces[key] = trace
            self._save(doc)

    def advance(self, seconds: float) -> float:
        """Move the simulated clock forward; returns the new offset (seconds)."""
        with self.kernel.locked():
            doc = self.load()
            doc["clock_offset_s"] = float(doc.get("clock_offset_s") or 0.0) + float(seconds)
            self._save(doc)
            return doc["clock_offset_s"]

    def step_wall(self, seconds: float) -> float:
        """Step the simulated wall clock by ``seconds`` (either sign), as NTP or an operator
        would, leaving the simulated monotonic clock alone; returns the total step (seconds)."""
        with self.kernel.locked():
            doc = self.load()
            doc["clock_step_s"] = float(doc.get("clock_step_s") or 0.0) + float(seconds)
            self._save(doc)
            return doc["clock_step_s"]

    # --- MeteringNvml ----------------------------------------------------------
    def clock_us(self) -> int:
        return self._now_us(self.load())

    def monotonic_us(self) -> int:
        """The simulated monotonic clock: the wall clock without :meth:`step_wall`'s steps."""
        doc = self.load()
        return self._now_us(doc) - int(round(float(doc.get("clock_step_s") or 0.0) * 1_000_000))

    def boot_id(self) -> str:
        """The simulated kernel's boot id, read as on a real host from ``proc/sys/kernel/random/boot_id``
        (a new one at each ``sim reboot``: :func:`vgpuhost.sim.reboot.reboot`); ``sim`` on a tree with
        none yet (made before its first simulated reboot)."""
        return read_boot_id(str(self.host.path("proc", "sys", "kernel", "random", "boot_id"))) or "sim"

    def freeze(self, at: Optional[float] = None) -> None:
        """Stop the simulated clock at ``at`` (seconds; default now): from then on only
        :meth:`advance` moves it, so tests need no timing."""
        with self.kernel.locked():
            doc = self.load()
            doc["clock_frozen_s"] = float(at if at is not None else time.time())
            self._save(doc)

    @staticmethod
    def _now_us(doc: dict) -> int:
        base = doc.get("clock_frozen_s")
        base = float(base) if base is not None else time.time()
        return int(round((base + float(doc.get("clock_offset_s") or 0.0) + float(doc.get("clock_step_s") or 0.0))
                         * 1_000_000))

    @staticmethod
    def _trace(traces: dict, device: str, type_name: str) -> dict:
        return traces.get(device) or traces.get(f"type:{type_name}") or traces.get("default") or {}

    def read(self, last_seen_us: Dict[str, int]) -> List[GpuReading]:
        self.kernel.settle()            # a write cut short by a killed writer: whole or gone first
        meta = self.kernel.meta()
        doc = self.load()
        now_us = self._now_us(doc)
        step = float(doc.get("clock_step_s") or 0.0)
        now = now_us / 1_000_000 - step       # the load runs on true time: a wall-clock step does not move it
        traces = doc.get("traces") or {}
        out: List[GpuReading] = []
        for pf in sorted(meta.get("gpus") or {}):
            gpu = meta["gpus"][pf]
            if gpu.get("backend", "none") == "none":
                continue
            try:
                drv = os.path.basename(os.readlink(self.kernel.dev_dir(meta, pf) / "driver"))
            except OSError:
                drv = None
            if drv != "nvidia":
                continue                      # NVML sees only GPUs on nvidia (passed through: invisible)
            if gpu.get("lost"):
                # `sim fail --lost`: every NVML call on it answers GPU_IS_LOST, as SimNvml's do (final 9b NEW-3)
                out.append(GpuReading(pf, "", False, (), error="GPU_IS_LOST"))
                continue
            seen = int(last_seen_us.get(pf, 0))
            t0 = seen / 1_000_000 - step if seen else now - 1.0
            mig = bool(gpu.get("mig_mode"))
            vendor_vfio = gpu.get("backend") == "vendor-vfio"
            live_vgpus = self.kernel.instances(meta, pf)
            # the GPU instance each MIG-backed vGPU sits on, as the simulated driver recorded it
            on_gi = self.kernel.gi_of_vgpus(meta, pf, instances=live_vgpus) if mig else {}
            vgpus = []
            gi_sm: Dict[int, float] = {}
            for n, inst in enumerate(live_vgpus):
                t = gpu["types"].get(inst["type_id"]) or {}
                name = t.get("name", inst["type_id"])
                trace = self._trace(traces, inst["id"], name)
                gi_id = on_gi.get(inst["id"]) if t.get("gi_profile") else None
                sample = None
                if now_us > seen:
                    span = now - t0
                    vals = {k: integral(trace, k, t0, now) / span for k in ("sm", "mem", "enc", "dec")}
                    sample = UtilSample(now_us, vals["sm"], vals["mem"], vals["enc"], vals["dec"])
                    if gi_id is not None:
                        gi_sm[gi_id] = min(100.0, gi_sm.get(gi_id, 0.0) + vals["sm"])
                start = float(trace.get("start") or 0.0)
                stop = trace.get("stop")
                live = now >= start and (stop is None or now < float(stop))
                fb_mib = _value_at(trace.get("fb_mib"), now, start) if live else 0.0
                lic = trace.get("license", "licensed")
                vgpus.append(VgpuReading(
                    instance=n + 1,
                    device="" if vendor_vfio else inst["id"],     # a VF has no mdev UUID (module doc)
                    vm_id=str(trace.get("vm") or "").lower(),
                    type_name=name, gi_id=gi_id,
                    fb_used_bytes=int(round(fb_mib * MIB)),
                    fb_total_bytes=int(t.get("fb_mib") or 0) * MIB,
                    license=lic if lic in LICENSE_STATES else "unknown",
                    sample=sample, license_expiry_s=_expiry(trace.get("license_expiry"))))
            board = str(gpu.get("board") or "")
            gpm = "ok" if mig and board.upper().startswith(_GPM_BOARDS) else "unavailable"
            why = _gpm_reasons(vgpus, gpu.get("gpu_instances") or []) if mig else {}
            gi_sm = {gi: pct for gi, pct in gi_sm.items() if gpm == "ok" and why.get(gi) is None}
            out.append(GpuReading(pf, gpu.get("name") or "NVIDIA GPU", mig, tuple(vgpus), gi_sm, gpm,
                                  gi_not_metered={gi: r for gi, r in why.items() if r is not None},
                                  uuid=str(gpu.get("uuid") or "")))
        return out


def _expiry(value) -> "float | None":
    """A trace's ``license_expiry`` as NVML would report it: a valid date, whole seconds (None: no date)."""
    return None if value is None else float(int(value))


__all__ = ["SimMetering", "integral", "check_trace", "write_load", "LOAD_FILE"]
