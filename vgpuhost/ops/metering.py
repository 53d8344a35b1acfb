"""Metering: the sampler that turns NVML readings into billed usage.

Owns: :class:`Sampler`, which every ``interval_s`` (default 10) reads the
metering NVML door once (:class:`~vgpuhost.io.nvml_metering.MeteringNvml`),
attributes each device to its domain, tenant, QoS class and profile, and

- integrates per-device counters: allocation seconds and SM, encoder and
  decoder busy seconds (``percent / 100 x seconds``);
- keeps framebuffer used and peak gauges (bytes);
- adds each interval's deltas to the hourly rollups in the state store
  (``usage_hourly``), with its cursors, in one transaction: a crash loses at
  most the interval in flight, and a restarted sampler continues from the
  cursors without counting anything twice;
- marks gaps (``meter_gaps``) where utilisation could not be observed;
- publishes an immutable :class:`Snapshot` that the exporter serves, so a
  scrape never waits on NVML, with the host-level figures of
  :func:`host_series` (free instances per profile and pool, quota use per
  tenant, orphaned devices, open journal entries).

:func:`host_sampler` sets up the sampler of one host, the one set-up that
``vgpuhost exporter`` and the agent both run.

Must not: change a device, or talk to NVML, SQLite or libvirt except through
the io/ doors.

Integration rule: each utilisation sample covers the time since the
previous sample of that device, at most ``max_hold_s`` (default 6
intervals); the rest of a longer span is recorded as a gap.  A device's
first sighting (new, back after an absence, or with another domain) only
sets its cursors: allocation and busy seconds both count from that reading,
so they cover the same span (its first sample averages a window, 1 s back or
since the GPU's last reading, for which no allocation is counted); and a
sample counts no time past the reading's clock, where its allocation ends.
NVML's per-vGPU samples are averages over the driver's sampling period, so
on real GPUs busy seconds are as exact as that period allows; on the
simulator they are exact.

Unread GPUs: a GPU whose read fails, or that is missing from the reading
while a vGPU record still names it, keeps its devices present and unbilled,
their cursors at the last good reading (:meth:`Sampler._hold_unread`); a
device forgotten while unread leaves a gap from that reading to the tick
that found it gone (:data:`UNREAD_GONE`).

Passthrough: a GPU passed through to a VM is invisible to the host's NVML,
so it is metered by allocation time only (from vgpuhost's passthrough
records); its busy seconds stay 0 and its ``kind`` says ``passthrough``.

Allocation after a restart: when a device's cursor names the same domain,
the host has not rebooted since (the kernel's boot id is the one saved with
the cursors) and the device is the one the cursor was written for (its vGPU
record has the creation time the sampler last saw: a clock-free test, so a
record stamped after the cursor by a clock behind NVML's still continues),
the device was allocated throughout, so the whole span since the cursor is
credited.  After a reboot no device continues: the downtime, when no device
existed nor VM ran, is a gap (``host rebooted``) and each device counts from
its first reading in the new boot, as a device first seen.

Clocks: elapsed time comes from a clock that never steps
(``MeteringNvml.monotonic_us``, CLOCK_MONOTONIC on a real host, saved with
the boot id so a restarted sampler can use it too).  The wall clock
(``clock_us``) gives only timestamps and hour buckets: when it moves more
than :data:`STEP_TOLERANCE_US` away from the monotonic clock between two
readings (an NTP or operator step), every cursor is moved by the step, so a
step neither bills nor loses time, nor marks a gap.  Without a comparable
monotonic reading (first run, or a reboot in between) a wall clock that went
back counts as no time at all.  So allocation and busy seconds never
decrease.  After a backward step the wall-clock hours since the step's
target are lived again: the time measured on the monotonic clock goes to
them, but a device-hour never holds more than :data:`HOUR_S` (with what the
store already holds for it); what does not fit is recorded as a gap (``wall
clock stepped back``), not billed (:meth:`Sampler._cap`).

Device counters: a device's exported seconds are the sum over every domain
that held it (the store's rollups, then this process's meters), so they never
decrease, neither when the device passes to another domain nor across a
restart of the sampler.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Callable, Dict, List, Optional, Set, Tuple

from ..io import state as st
from ..io.backends import metering_nvml
from ..io.locks import file_lock
from ..io.nvml_metering import GpuReading, MeteringNvml
from ..io.sysfs import Sysfs
from ..io.virt import open_connection
from ..libvirt.domxml import parse_domain
from ..model.concepts import DeviceKind
from ..model.errors import HostEnvironmentError, VgpuhostError
from ..model.nvml import no_mdev_uuid
from ..model.records import VgpuRecord
from ..model.usage import UsageRow
from ..model.values import parse_uuid
from ..observe.inventory import discover, free_instances
from ..observe.vgpus import match_vgpu_record
from ..policy.anomaly import flags as anomaly_flags
from ..policy.checks import Finding, licence_findings
from ..policy.offers import seen_rows
from . import gputime, tenancy
from .admitting import active as tenancy_active
from .health import in_service, nvml_or_none, status, unrecorded_failures
from .migdemand import makeable
from .vgpu import limits_lookup

log = logging.getLogger("vgpuhost.metering")

DEFAULT_INTERVAL_S = 10.0
HOLD_INTERVALS = 6
#: how far (microseconds) the wall clock may drift from the monotonic clock between two
#: readings before the sampler treats it as a step
STEP_TOLERANCE_US = 1_000_000
#: the gap reason of a device dropped unread (:meth:`Sampler._unread_gaps`): its GPU's read failed or the
#: GPU left the reading, then the device went (removed, or its GPU read again without it)
UNREAD_GONE = "device gone while unread"
#: the gap reason of a device unread up to a reboot (its span from its last reading to the last tick)
UNREAD_REBOOTED = "device unread until the host rebooted"
#: the most seconds one device can be held in one hour: a rollup row never holds more (after a backward
#: wall-clock step, see :meth:`Sampler._cap`)
HOUR_S = 3600.0


def iso_us(us: int) -> str:
    """Microseconds since the epoch as ``2026-12-01T14:05:00.000000+00:00``."""
    return datetime.fromtimestamp(us / 1_000_000, timezone.utc).isoformat(timespec="microseconds")


def hour_of(us: int) -> str:
    """The UTC hour holding ``us``, as ``2026-12-01T14:00:00Z`` (the rollup key)."""
    return datetime.fromtimestamp(us / 1_000_000, timezone.utc).strftime("%Y-%m-%dT%H:00:00Z")


def split_hours(t0_us: int, t1_us: int) -> List[Tuple[str, float]]:
    """``[(hour, fraction)]`` of the span ``(t0, t1]`` falling in each UTC hour (fractions sum to 1)."""
    if t1_us <= t0_us:
        return [(hour_of(t1_us), 1.0)]
    hour_us = 3_600_000_000
    out = []
    a = t0_us
    while a < t1_us:
        b = min(t1_us, (a // hour_us + 1) * hour_us)
        out.append((hour_of(a), (b - a) / (t1_us - t0_us)))
        a = b
    return out


@dataclass(frozen=True)
class MeteredOwner:
    """Who a device is billed to.  Empty strings where unknown."""

    domain_uuid: str = ""
    domain: str = ""
    tenant: str = ""
    qos: str = ""


@dataclass(frozen=True)
class DeviceUsage:
    """One metered device in a :class:`Snapshot`.

    ``device``: mdev UUID, VF BDF or (passthrough) GPU BDF; ``kind``:
    ``vgpu``, ``mig-vgpu`` or ``passthrough``; seconds are lifetime totals
    for (device, domain); bytes are framebuffer; ``licensed``: None when not
    known (passthrough).
    """

    device: str
    kind: str
    gpu: str
    profile: str
    owner: MeteredOwner
    gi_id: Optional[int]
    alloc_s: float
    sm_busy_s: float
    enc_busy_s: float
    dec_busy_s: float
    fb_used_bytes: int
    fb_peak_bytes: int
    fb_total_bytes: int
    license: str
    sm_percent: float = 0.0
    #: (alloc, sm, enc, dec) seconds the device gave other domains (the store's rollups and this
    #: process's meters): the exporter adds them, so a device's counters never decrease, across a
    #: restart too
    earlier: Tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    #: when the vGPU's licence expires (seconds since the epoch), where the driver gives a date
    license_expiry_s: Optional[float] = None


@dataclass(frozen=True)
class Snapshot:
    """What the sampler last saw; what scrapes read.  ``time_us``: the reading's NVML clock."""

    time_us: int = 0
    wall: float = 0.0
    ok: bool = False
    duration_s: float = 0.0
    devices: Tuple[DeviceUsage, ...] = ()
    gpus: Tuple[Tuple[str, str, bool, str, str], ...] = ()     # (bdf, name, mig, gpm status, GPU UUID)
    gi_sm: Tuple[Tuple[str, int, float], ...] = ()             # (gpu, gi_id, percent)
    #: (gpu, gi_id, reason): GPU instances holding vGPUs that GPM does not meter (model/nvml.GPM_REASONS)
    gi_not_metered: Tuple[Tuple[str, int, str], ...] = ()
    errors_total: int = 0
    gap_s_total: float = 0.0
    host: Dict[str, object] = field(default_factory=dict)       # host-level series (see host_series)
    #: (tenant, profile, kind, allocated s, SM busy s): what this process added to the rollups per tenant
    #: and profile (never decreasing while it runs: the exporter's tenant counters, for billing from Prometheus)
    tenant_usage: Tuple[Tuple[str, str, str, float, float], ...] = ()


class _Meter:
    """Mutable per-device state inside the sampler."""

    __slots__ = ("device", "kind", "gpu", "profile", "owner", "gi_id", "alloc_s", "sm_s", "enc_s", "dec_s",
                 "fb_used", "fb_peak", "fb_total", "license", "alloc_us", "sample_us", "sm_pct", "license_expiry")

    def __init__(self, device: str, kind: str, gpu: str, profile: str, owner: MeteredOwner):
        self.device, self.kind, self.gpu, self.profile, self.owner = device, kind, gpu, profile, owner
        self.gi_id: Optional[int] = None
        self.alloc_s = self.sm_s = self.enc_s = self.dec_s = 0.0
        self.fb_used = self.fb_peak = self.fb_total = 0
        self.license = "unknown"
        self.license_expiry: Optional[float] = None
        self.alloc_us = 0
        self.sample_us = 0
        self.sm_pct = 0.0

    def usage(self, earlier: Tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)) -> DeviceUsage:
        return DeviceUsage(self.device, self.kind, self.gpu, self.profile, self.owner, self.gi_id,
                           self.alloc_s, self.sm_s, self.enc_s, self.dec_s, self.fb_used, self.fb_peak,
                           self.fb_total, self.license, self.sm_pct, earlier, self.license_expiry)


@dataclass
class _Tick:
    """What one tick gathers before it commits: the reading's wall clock ``now_us``, the
    store's vGPU records and domain names, and the rows, cursors, gaps, present meters,
    GPU-instance SM use and first sightings it adds up."""

    now_us: int
    vgpu_recs: Dict[str, object]
    names: Dict[str, str]
    rows: List[UsageRow] = field(default_factory=list)
    cursor_rows: List[tuple] = field(default_factory=list)
    gaps: List[tuple] = field(default_factory=list)
    present: Dict[Tuple[str, str], _Meter] = field(default_factory=dict)
    gi_sm: List[Tuple[str, int, float]] = field(default_factory=list)
    first: Set[Tuple[str, str]] = field(default_factory=set)     # first sighted in this tick: cursors only
    #: cursors (device -> (domain, alloc µs, sample µs)) of devices unread in this tick with no meter
    #: yet (a restarted sampler): kept as they are (:meth:`Sampler._hold_unread`)
    held: Dict[str, tuple] = field(default_factory=dict)


LabelFn = Callable[[str], MeteredOwner]


class Sampler:
    """Reads NVML every interval; integrates, rolls up, publishes a snapshot.

    ``nvml``: a MeteringNvml; ``store``: a StateStore; ``labels(domain_uuid)``
    gives the domain's name, tenant and QoS class (see :func:`owner_labels`);
    ``host_series()``: optional host-level figures for the snapshot (free
    instances, quota use, orphans, journal), read at most every
    ``host_every_s``.
    """

    def __init__(self, nvml: MeteringNvml, store, *, interval_s: float = DEFAULT_INTERVAL_S,
                 max_hold_s: Optional[float] = None, labels: Optional[LabelFn] = None,
                 host_series: Optional[Callable[[], Dict[str, object]]] = None, host_every_s: float = 60.0):
        self.nvml = nvml
        self.store = store
        self.interval_s = float(interval_s)
        self.max_hold_us = int((max_hold_s if max_hold_s is not None else HOLD_INTERVALS * interval_s) * 1e6)
        self.labels = labels or (lambda uuid: MeteredOwner(domain_uuid=uuid))
        self.host_series = host_series
        self.host_every_s = host_every_s
        self._host_at = 0.0
        self._host: Dict[str, object] = {}
        self._meters: Dict[Tuple[str, str], _Meter] = {}
        #: devices metered while a vGPU record named them: once the record is gone, an unread GPU no longer
        #: holds them (:meth:`_hold_unread`); a vGPU never recorded (made outside vgpuhost) stays held
        self._recorded: set = set()
        self._retired: Dict[Tuple[str, str], _Meter] = {}   # meters of this process no longer present
        self._mono_live = False          # _last_mono_us was read by this process
        self._errors = 0
        self._gap_s = 0.0
        self._tenant_s: Dict[Tuple[str, str, str], List[float]] = {}   # (tenant, profile, kind) -> [alloc, sm]
        self._lock = threading.Lock()
        self.snapshot = Snapshot()
        conn = store
        #: device -> {domain: (alloc, sm, enc, dec) lifetime seconds}: the store's totals, then each retired
        #: meter's; a device's counters are the sum over its domains, so they never fall across a restart
        self._seconds: Dict[str, Dict[str, Tuple[float, float, float, float]]] = {}
        self._fb_peak: Dict[Tuple[str, str], int] = {}
        for (device, domain), tot in st.usage_totals(conn).items():
            self._seconds.setdefault(device, {})[domain] = (float(tot[0]), float(tot[1]), float(tot[2]),
                                                            float(tot[3]))
            self._fb_peak[(device, domain)] = int(tot[4] or 0)
        self._cursors = st.meter_cursors(conn)
        last = st.meter_state(conn, "last_tick_us")
        self._last_tick_us = int(last) if last else 0
        mono = st.meter_state(conn, "last_tick_mono_us")
        self._last_mono_us: Optional[int] = int(mono) if mono else None
        self._boot = st.meter_state(conn, "boot_id") or ""
        high = st.meter_state(conn, "high_tick_us")
        #: the latest wall-clock time metered so far (µs): after a backward step, hours before it are re-lived
        self._high_us = max(int(high) if high else 0, self._last_tick_us)
        try:
            seen_recs = json.loads(st.meter_state(conn, "vgpu_record_times") or "{}")
            self._rec_times = {str(k): str(v) for k, v in seen_recs.items()}
        except (ValueError, AttributeError):
            self._rec_times = {}
        self._rec_times_saved = dict(self._rec_times)
        try:
            seen = json.loads(st.meter_state(conn, "gpu_seen_us") or "{}")
            self._gpu_seen = {str(k): int(v) for k, v in seen.items()}
        except (ValueError, AttributeError):
            self._gpu_seen = {}

    # --- attribution ------------------------------------------------------------
    def _records(self) -> Tuple[Dict[str, object], List[object], Dict[str, str]]:
        """``(vGPU records by id, passthrough records, active domains)`` as of this reading.

        A vGPU being made (its device written, its record not committed yet) is named with its
        owner by its create's open journal entry, opened before the first write and closed after the
        record (ops/vgpu._execute_create).  The journal is read first: an entry closed since then has
        its record committed before the records are read, so NVML's newest vGPUs always have an owner
        here (issue 26, item 8: a device published with no domain right after an allocate)."""
        creating = [e for e in self.store.journal_entries(open_only=True) if e.kind == "vgpu-create"]
        vgpus = {r.id: r for r in self.store.vgpu_records()}
        for e in creating:
            for d in e.devices:
                vid = str(d.get("id") or "")
                if vid and vid not in vgpus and d.get("gpu") and d.get("type_name"):
                    vgpus[vid] = VgpuRecord(vid, str(d.get("backend") or ""), str(d["gpu"]),
                                            str(d.get("parent") or d["gpu"]), str(d.get("type_id") or ""),
                                            str(d["type_name"]), e.owner, None, None,
                                            bool(d.get("persisted")), e.opened or "")
        return vgpus, self.store.passthrough_records(), self.store.active_domains()

    def _owner(self, domain_uuid: str, names: Dict[str, str]) -> MeteredOwner:
        if not domain_uuid:
            return MeteredOwner()
        o = self.labels(domain_uuid)
        name = o.domain or names.get(domain_uuid, "") or domain_uuid
        return MeteredOwner(domain_uuid, name, o.tenant, o.qos)

    # --- one tick ------------------------------------------------------------------
    def tick(self) -> Snapshot:
        """Read once, integrate, write the rollups, publish and return the snapshot."""
        t_start = time.perf_counter()
        with self._lock:
            try:
                snap = self._tick()
            except Exception as e:        # NVML or the store failed: keep serving the last snapshot
                self._errors += 1
                log.warning("metering sample failed: %s", e)
                snap = replace(self.snapshot, ok=False, errors_total=self._errors)
            snap = replace(snap, duration_s=time.perf_counter() - t_start)
            self.snapshot = snap
            return snap

    def _clocks(self) -> Tuple[int, int, str]:
        """(wall µs, monotonic µs, boot id) now."""
        now_us = self.nvml.clock_us()
        mono = getattr(self.nvml, "monotonic_us", None)
        boot = getattr(self.nvml, "boot_id", None)
        if mono is None:                        # a stand-in with one clock: only a step back is seen
            return now_us, now_us, ""
        return now_us, int(mono()), str(boot() if boot is not None else "")

    def _after_read(self, now_us: int, mono_us: int) -> Tuple[int, int]:
        """The tick's clocks read again after NVML's read (µs), so that every sample of that read is
        no newer than the tick (NVML stamps a sample when it is taken, at or before the read's return).
        A sample's average then covers exactly the span it is credited for: from the GPU's last seen
        sample to its own time stamp.  Read before the NVML call, the tick's clock was older than
        the samples by the read's duration, and busy seconds were off by that span's share of a
        changing load.  Where the wall clock stepped during the read, the first reading stands."""
        again, mono_again, _ = self._clocks()
        if again >= now_us and abs((again - now_us) - (mono_again - mono_us)) <= STEP_TOLERANCE_US:
            return again, mono_again
        return now_us, mono_us

    def _unstep(self, now_us: int, mono_us: int, boot: str) -> None:
        """Move every wall-clock cursor by the wall clock's step since the last reading (see
        the module doc), so spans measured on the wall clock equal the monotonic time."""
        if not self._last_tick_us:
            return
        wall_dt = now_us - self._last_tick_us
        comparable = self._mono_live or (boot and boot == self._boot)
        if self._last_mono_us is not None and comparable and mono_us >= self._last_mono_us:
            step = wall_dt - (mono_us - self._last_mono_us)
        elif wall_dt < 0:
            step = wall_dt                      # no comparable monotonic reading: back counts as no time
        else:
            return
        if abs(step) <= STEP_TOLERANCE_US:
            return
        log.warning("the wall clock stepped %+.3f s; metering measures elapsed time on the monotonic clock",
                    step / 1e6)

        def mv(us: int) -> int:
            return us + step if us else us
        self._last_tick_us = mv(self._last_tick_us)
        for m in list(self._meters.values()) + list(self._retired.values()):
            m.alloc_us, m.sample_us = mv(m.alloc_us), mv(m.sample_us)
        self._cursors = {d: (c[0], mv(int(c[1])), mv(int(c[2]))) for d, c in self._cursors.items()}
        self._gpu_seen = {g: mv(v) for g, v in self._gpu_seen.items()}

    def _tick(self) -> Snapshot:
        now_us, mono_us, boot = self._clocks()
        rebooted = bool(boot and self._boot and boot != self._boot and self._last_tick_us)
        self._unstep(now_us, mono_us, boot)
        if rebooted:
            # the host rebooted since the last reading: no device existed, nor VM ran, while it was down,
            # so nothing continues from its cursor; each device counts from its first reading in this boot
            log.warning("the host rebooted since the last metering reading: metering starts again from now")
            unread_gaps = self._unread_gaps(self._dropped(None), self._last_tick_us, UNREAD_REBOOTED)
            self._cursors = {}
            self._gpu_seen = {}
        begin = getattr(self.labels, "begin_tick", None)
        if begin is not None:
            begin()
        readings: List[GpuReading] = self.nvml.read(dict(self._gpu_seen))
        now_us, mono_us = self._after_read(now_us, mono_us)
        newest_sample = max((v.sample.timestamp_us for g in readings for v in g.vgpus if v.sample is not None),
                            default=0)
        vgpu_recs, pt_recs, names = self._records()
        t = _Tick(now_us, vgpu_recs, names)
        if rebooted:
            t.gaps.extend(unread_gaps)
        if rebooted and now_us > self._last_tick_us:
            t.gaps.append((iso_us(self._last_tick_us), iso_us(now_us), "*",
                           (now_us - self._last_tick_us) / 1e6, "host rebooted"))
        elif self._last_tick_us and now_us - self._last_tick_us > self.max_hold_us and not self._meters:
            t.gaps.append((iso_us(self._last_tick_us), iso_us(now_us), "*",
                           (now_us - self._last_tick_us) / 1e6, "sampler not running"))
        for g in readings:
            self._meter_gpu(t, g)
        self._hold_unread(t, readings)
        self._meter_passthrough(t, pt_recs)
        self._commit(t, mono_us, boot)
        wall = time.time()
        self._read_host_series(wall)
        return Snapshot(time_us=max(now_us, newest_sample), wall=wall, ok=True,
                        devices=tuple(m.usage(self._earlier(m)) for _, m in sorted(t.present.items())),
                        gpus=tuple((g.bdf, g.name, g.mig, g.gpm, g.uuid) for g in readings if not g.error),
                        gi_sm=tuple(t.gi_sm),
                        gi_not_metered=tuple((g.bdf, gi, why) for g in readings if not g.error
                                             for gi, why in sorted(g.gi_not_metered.items())),
                        errors_total=self._errors, gap_s_total=self._gap_s,
                        host=dict(self._host),
                        tenant_usage=tuple((k[0], k[1], k[2], v[0], v[1]) for k, v in sorted(self._tenant_s.items())))

    def _meter_for(self, t: _Tick, device: str, kind: str, gpu: str, profile: str,
                   owner: MeteredOwner) -> _Meter:
        """The meter of ``device`` for ``owner`` in this tick: the running one, a retired one
        back after an absence (counted again from now), or a new one that continues from the
        store's totals and cursor when the same domain held the device since (see the module
        doc), else counts from this first sighting (``t.first``)."""
        now_us = t.now_us
        key = (device, owner.domain_uuid)
        m = self._meters.get(key)
        if m is None and key in self._retired:
            m = self._retired.pop(key)         # back after an absence: counted again from now,
            m.alloc_us = now_us                # allocation and busy alike
            m.sample_us = 0
            t.first.add(key)
        rec = t.vgpu_recs.get(device)
        if m is None:
            m = _Meter(device, kind, gpu, profile, owner)
            tot = self._seconds.get(device, {}).get(owner.domain_uuid)
            if tot:                            # its lifetime totals (the store's, or a retired meter's)
                m.alloc_s, m.sm_s, m.enc_s, m.dec_s = tot
                m.fb_peak = self._fb_peak.get(key, 0)
            cur = self._cursors.get(device)
            if cur and cur[0] == owner.domain_uuid and self._same_device(device, rec, int(cur[1])):
                m.alloc_us, m.sample_us = int(cur[1]), int(cur[2]) or int(cur[1])
            else:
                m.alloc_us = now_us            # allocation and busy counted from first sight
                t.first.add(key)
        if rec is not None and getattr(rec, "time", ""):
            self._rec_times[device] = str(rec.time)
        m.kind, m.gpu, m.profile, m.owner = kind, gpu, profile, owner
        t.present[key] = m
        return m

    def _same_device(self, device: str, rec, cursor_us: int) -> bool:
        """Whether ``device`` is the one its cursor was written for (not made again since): its
        vGPU record (``rec``, None: no vGPU record, a passthrough GPU) is the one the sampler last
        saw, by its creation time as the store keeps it (a clock-free comparison); where the
        sampler kept no such time (a store written before it did), the record is older than the
        cursor (both wall-clock)."""
        if rec is None:
            return True
        seen = self._rec_times.get(device)
        if seen is not None:
            return seen == str(rec.time)
        return _us(rec.time) <= cursor_us

    def _account(self, t: _Tick, m: _Meter, alloc_dt_us: int, busy: Tuple[float, float, float], t0_us: int,
                 samples: int) -> None:
        """Add ``m``'s rollup rows for ``alloc_dt_us`` µs allocated since ``t0_us`` and ``busy``
        (SM, encoder, decoder seconds) to the tick, split over the hours they fall in; a
        device with nothing to add still gets its row for this hour.  A span that reaches back
        before the latest time metered (the wall clock stepped back) goes to hours that may hold
        time already: see :meth:`_cap`."""
        if alloc_dt_us <= 0 and not any(busy) and not samples:
            t.rows.extend(_rows(m, [(hour_of(t.now_us), 1.0)], 0.0, (0.0, 0.0, 0.0), 0))
            return
        rows = _rows(m, split_hours(t0_us, t.now_us), alloc_dt_us / 1e6, busy, samples)
        if t0_us < self._high_us:
            rows = self._cap(t, m, rows, t0_us)
        t.rows.extend(rows)

    def _cap(self, t: _Tick, m: _Meter, rows: List[UsageRow], t0_us: int) -> List[UsageRow]:
        """``rows`` with each device-hour held to the hour's length (:data:`HOUR_S`), counting what
        the store holds for the device in that hour (any domain): after a backward wall-clock step
        the hours after the step's target are lived again, and a device cannot be held for more than
        one device-hour per hour.  What does not fit is recorded as a gap (``wall clock stepped
        back``) and taken off ``m``'s totals, so the exporter's counters equal the rollups; busy
        seconds are cut in the same proportion."""
        have = st.device_alloc_by_hour(self.store, m.device, sorted({r.hour for r in rows}))
        out: List[UsageRow] = []
        cut = [0.0, 0.0, 0.0, 0.0]
        for r in rows:
            room = max(0.0, HOUR_S - have.get(r.hour, 0.0))
            if r.alloc_s <= room + 1e-6:        # (a float sum's last digits are no overlap)
                out.append(r)
                continue
            f = room / r.alloc_s
            kept = r._replace(alloc_s=room, sm_busy_s=r.sm_busy_s * f, enc_busy_s=r.enc_busy_s * f,
                              dec_busy_s=r.dec_busy_s * f)
            for i, (a, b) in enumerate(((r.alloc_s, kept.alloc_s), (r.sm_busy_s, kept.sm_busy_s),
                                        (r.enc_busy_s, kept.enc_busy_s), (r.dec_busy_s, kept.dec_busy_s))):
                cut[i] += a - b
            out.append(kept)
        if cut[0] > 0:
            t.gaps.append((iso_us(t0_us), iso_us(t.now_us), m.device, cut[0], "wall clock stepped back"))
            m.alloc_s -= cut[0]
            m.sm_s -= cut[1]
            m.enc_s -= cut[2]
            m.dec_s -= cut[3]
        return out

    def _meter_gpu(self, t: _Tick, g: GpuReading) -> None:
        """Meter one GPU's reading: its GPU instances' SM use and each of its vGPUs.  A failed
        read keeps the GPU's devices present, unbilled, with their cursors unchanged."""
        if g.error:
            self._errors += 1               # its devices stay, unbilled: :meth:`_hold_unread`
            return
        for gi, pct in sorted(g.gi_sm.items()):
            t.gi_sm.append((g.bdf, gi, pct))
        seen = self._gpu_seen.get(g.bdf, 0)
        newest = seen
        for v in g.vgpus:
            newest = max(newest, self._meter_vgpu(t, g, v, seen))
        self._gpu_seen[g.bdf] = max(newest, t.now_us if not g.vgpus else newest)

    def _hold_unread(self, t: _Tick, readings: List[GpuReading]) -> None:
        """Keep the devices of the GPUs this reading could not read present, unbilled, with their
        cursors unchanged (:func:`vgpuhost.ops.billing.unread` then holds the issue of a month they
        are behind): a GPU whose read failed, and a GPU absent from the reading (it left the PCI tree,
        or its driver) while the device's vGPU record still names it.  Such a device is forgotten,
        and its unread span recorded as a gap (:meth:`_commit`), only when its GPU is read again
        without it or its record is removed; a restarted sampler holds the cursors it loaded alike."""
        read_ok = {g.bdf for g in readings if not g.error}
        failed = {g.bdf for g in readings if g.error}

        def unread_gpu(device: str, gpu: str) -> bool:
            rec = t.vgpu_recs.get(device)
            if gpu in failed:
                # the operator removed the record of a device on a GPU that stays unreadable (lost for good
                # but still on the bus): forgotten, as on a GPU that left the tree (final 9b NEW-2)
                return rec is not None or device not in self._recorded
            return gpu not in read_ok and rec is not None and str(getattr(rec, "gpu", "")) == gpu

        for key, m in self._meters.items():
            if key not in t.present and m.kind != DeviceKind.PASSTHROUGH and unread_gpu(m.device, m.gpu):
                t.present[key] = m
                t.cursor_rows.append((m.device, key[1], m.alloc_us, m.sample_us))
        present = {k[0] for k in t.present}
        for device, cur in self._cursors.items():      # a restarted sampler's cursors with no meter yet
            rec = t.vgpu_recs.get(device)
            if device not in present and rec is not None and unread_gpu(device, str(getattr(rec, "gpu", ""))):
                t.held[device] = cur
                t.cursor_rows.append((device, cur[0], int(cur[1]), int(cur[2])))

    def _meter_vgpu(self, t: _Tick, g: GpuReading, v, seen: int) -> int:
        """Meter vGPU reading ``v`` of GPU reading ``g`` (``seen``: the GPU's last reading, µs):
        attribute it (by mdev UUID, or without one by GPU, VM UUID and type:
        :func:`~vgpuhost.observe.vgpus.match_vgpu_record`), integrate its utilisation sample (the integration rule of the module doc)
        and its allocation.  Returns the newest sample time it used, µs (0: none)."""
        now_us = t.now_us
        mdev = "" if no_mdev_uuid(v.device) else v.device
        rec = match_vgpu_record(list(t.vgpu_recs.values()), gpu=g.bdf, device=mdev, vm_id=v.vm_id,
                                type_name=v.type_name)
        device = mdev or (rec.id if rec is not None else f"{g.bdf}/vgpu{v.instance}")
        if rec is not None:
            self._recorded.add(device)
        domain = v.vm_id or (rec.owner if rec is not None and _is_uuid(rec.owner) else "")
        kind = "mig-vgpu" if v.gi_id is not None else "vgpu"
        m = self._meter_for(t, device, kind, g.bdf, v.type_name, self._owner(domain, t.names))
        m.gi_id = v.gi_id
        m.fb_used, m.fb_total, m.license = v.fb_used_bytes, v.fb_total_bytes, v.license
        m.license_expiry = v.license_expiry_s
        m.fb_peak = max(m.fb_peak, v.fb_used_bytes)
        alloc_dt = max(0, now_us - m.alloc_us) if m.alloc_us else 0
        busy = (0.0, 0.0, 0.0)
        samples = 0
        newest = 0
        t0 = m.alloc_us or now_us
        s = v.sample
        if (m.device, m.owner.domain_uuid) in t.first:   # its sample averages a span with no allocation
            m.sample_us = now_us
            if s is not None:                # the next sample averages from this one's time stamp
                newest = m.sample_us = min(s.timestamp_us, now_us)
            s = None
        if s is not None and s.timestamp_us > m.sample_us:
            prev = m.sample_us or seen
            end = min(s.timestamp_us, now_us)        # never past the reading that ends the allocation
            if prev and end > prev:
                dt = end - prev
                held = min(dt, self.max_hold_us)
                if dt > held:
                    t.gaps.append((iso_us(prev), iso_us(end - held), device, (dt - held) / 1e6,
                                   "no utilisation samples"))
                busy = (s.sm / 100 * held / 1e6, s.enc / 100 * held / 1e6, s.dec / 100 * held / 1e6)
                m.sm_s += busy[0]
                m.enc_s += busy[1]
                m.dec_s += busy[2]
                m.sm_pct = s.sm
                samples = 1
            m.sample_us = max(m.sample_us, end)
            newest = s.timestamp_us
        m.alloc_s += alloc_dt / 1e6
        self._account(t, m, alloc_dt, busy, t0, samples)
        m.alloc_us = now_us
        t.cursor_rows.append((device, domain, m.alloc_us, m.sample_us))
        return newest

    def _meter_passthrough(self, t: _Tick, pt_recs: List[object]) -> None:
        """Meter the passed-through GPUs by allocation time only (the host's NVML cannot see them)."""
        now_us = t.now_us
        for gpu in sorted({r.gpu for r in pt_recs if r.bdf == r.gpu}):
            owner_uuid = next((r.owner for r in pt_recs if r.bdf == gpu), "")
            domain = owner_uuid if _is_uuid(owner_uuid) else ""
            m = self._meter_for(t, gpu, "passthrough", gpu, "passthrough", self._owner(domain, t.names))
            m.license = "n/a"
            alloc_dt = max(0, now_us - m.alloc_us) if m.alloc_us else 0
            t0 = m.alloc_us or now_us
            m.alloc_s += alloc_dt / 1e6
            self._account(t, m, alloc_dt, (0.0, 0.0, 0.0), t0, 0)
            m.alloc_us = now_us
            t.cursor_rows.append((gpu, domain, m.alloc_us, 0))

    def _commit(self, t: _Tick, mono_us: int, boot: str) -> None:
        """Write the tick's rollups, cursors, gaps and clocks in one transaction, then retire
        the meters of devices no longer present (their seconds kept for DeviceUsage.earlier)."""
        now_us = t.now_us
        kept = {k[0] for k in t.present} | set(t.held)
        gone = sorted(({d for d, _u in self._meters} | set(self._cursors)) - kept)
        t.gaps.extend(self._unread_gaps(self._dropped(t), now_us, UNREAD_GONE))
        with self.store.transaction() as conn:
            st.add_usage(conn, t.rows)
            st.put_meter_cursors(conn, t.cursor_rows, gone)
            for gap in t.gaps:
                st.add_meter_gap(conn, *gap)
            st.put_meter_state(conn, "last_tick_us", str(now_us))
            st.put_meter_state(conn, "last_tick_mono_us", str(mono_us))
            st.put_meter_state(conn, "boot_id", boot)
            st.put_meter_state(conn, "gpu_seen_us", json.dumps(self._gpu_seen, sort_keys=True))
            high = max(self._high_us, now_us)
            if high != self._high_us or not self._last_tick_us:
                st.put_meter_state(conn, "high_tick_us", str(high))
            for d in gone:
                self._rec_times.pop(d, None)
            if self._rec_times != self._rec_times_saved:
                st.put_meter_state(conn, "vgpu_record_times", json.dumps(self._rec_times, sort_keys=True))
        for gap in t.gaps:
            self._gap_s += gap[3]
        for r in t.rows:
            acc = self._tenant_s.setdefault((r.tenant, r.profile, r.kind), [0.0, 0.0])
            acc[0] += r.alloc_s
            acc[1] += r.sm_busy_s
        for key, m in self._meters.items():
            if key not in t.present:
                self._retired[key] = m
        for (device, domain), m in list(self._meters.items()) + list(t.present.items()):
            self._seconds.setdefault(device, {})[domain] = (m.alloc_s, m.sm_s, m.enc_s, m.dec_s)
            self._fb_peak[(device, domain)] = m.fb_peak
        self._meters = t.present
        self._last_tick_us, self._last_mono_us, self._boot = now_us, mono_us, boot
        self._high_us = max(self._high_us, now_us)
        self._rec_times_saved = dict(self._rec_times)
        self._mono_live = True
        self._cursors = dict(t.held)

    def _dropped(self, t: Optional[_Tick]) -> List[Tuple[str, int]]:
        """``[(device, last reading µs)]`` of the meters and loaded cursors this tick does not carry
        on (``t`` None: all of them, a reboot): a meter not present, a cursor neither held nor
        continued by a meter of its device and domain (one counted from first sight does not)."""
        out: Dict[str, int] = {}
        for key, m in self._meters.items():
            if t is None or key not in t.present:
                out[key[0]] = max(out.get(key[0], 0), m.alloc_us)
        for device, cur in self._cursors.items():
            key = (device, str(cur[0]))
            if t is None or (device not in t.held and key not in self._meters
                             and (key not in t.present or key in t.first)):
                out[device] = max(out.get(device, 0), int(cur[1]))
        return sorted(out.items())

    def _unread_gaps(self, dropped: List[Tuple[str, int]], end_us: int, reason: str) -> List[tuple]:
        """The gaps of the ``dropped`` devices (:meth:`_dropped`) that were dropped unread: each one
        whose last reading is before the previous tick, as ``(start, end, device, seconds, reason)``
        from that reading to ``end_us``.  A device read at the previous tick leaves none: it went
        within one interval, as any device that goes."""
        return [(iso_us(at), iso_us(end_us), d, (end_us - at) / 1e6, reason) for d, at in dropped
                if 0 < at < self._last_tick_us and end_us > at]

    def _read_host_series(self, wall: float) -> None:
        """Read the host-level figures when they are ``host_every_s`` old (or never read); a
        failure keeps the last ones and counts an error."""
        if self.host_series is not None and (not self._host or wall - self._host_at >= self.host_every_s):
            try:
                self._host = self.host_series()
                self._host_at = wall
            except Exception as e:
                log.warning("host series failed: %s", e)
                self._errors += 1

    def _earlier(self, m: _Meter) -> Tuple[float, float, float, float]:
        """Seconds ``m``'s device gave other domains, in this process and before it as the
        store's rollups keep them (DeviceUsage.earlier)."""
        out = [0.0, 0.0, 0.0, 0.0]
        for domain, secs in self._seconds.get(m.device, {}).items():
            if domain != m.owner.domain_uuid:
                for i, v in enumerate(secs):
                    out[i] += v
        return (out[0], out[1], out[2], out[3])

    # --- running ---------------------------------------------------------------------
    def run(self, stop: threading.Event, *, locked: bool = False) -> None:
        """Tick every ``interval_s`` until ``stop`` is set (the first tick at once), holding
        :func:`sampler_lock` throughout (``locked``: the caller holds it).

        When another sampler holds it, nothing is sampled: ``refused`` says
        why (logged), the snapshot stays not ok (``vgpuhost_up`` 0), and run returns.
        """
        if locked:
            self._loop(stop)
            return
        try:
            with sampler_lock(self.store.state_dir):
                self._loop(stop)
        except HostEnvironmentError as e:
            self.refused = e
            log.error("metering not started: %s", e.one_line())

    def _loop(self, stop: threading.Event) -> None:
        nxt = time.monotonic()
        while not stop.is_set():
            self.tick()
            nxt += self.interval_s
            delay = nxt - time.monotonic()
            if delay < 0:                     # fell behind: skip, never burst
                nxt = time.monotonic()
                delay = 0
            stop.wait(delay)

    refused = None


#: the lock one sampler per state dir holds while it runs: two samplers (``vgpuhost exporter``,
#: the agent's, ``exporter --once``) would add every interval to the rollups twice
SAMPLER_LOCK = "metering"


def sampler_lock(state_dir):
    """Hold :data:`SAMPLER_LOCK` in ``state_dir`` (a context manager); HostEnvironmentError
    within half a second when another sampler holds it."""


    @contextmanager
    def held():
        try:
            with file_lock(state_dir, SAMPLER_LOCK, timeout_s=0.5):
                yield
        except HostEnvironmentError as e:
            if "held lock" not in e.message:
                raise
            raise HostEnvironmentError(
                "another metering sampler (vgpuhost exporter, or the agent's) writes this state dir's usage",
                hint="run one of them (the agent: --metering-interval 0 turns its sampler off); two would "
                     "count every interval twice") from None

    return held()


def _rows(m: _Meter, hours: List[Tuple[str, float]], alloc_s: float, busy: Tuple[float, float, float],
          samples: int) -> List[UsageRow]:
    """The usage rows of one device's span, split over the UTC ``hours`` it touches (``(hour, fraction)``);
    the framebuffer peak and the sample count go to the last hour only."""
    o = m.owner
    out = []
    for i, (hour, frac) in enumerate(hours):
        last = i == len(hours) - 1
        out.append(UsageRow(hour=hour, device=m.device, domain_uuid=o.domain_uuid, kind=m.kind, gpu=m.gpu,
                            profile=m.profile, domain=o.domain, tenant=o.tenant, qos=o.qos, alloc_s=alloc_s * frac,
                            sm_busy_s=busy[0] * frac, enc_busy_s=busy[1] * frac, dec_busy_s=busy[2] * frac,
                            fb_peak_bytes=m.fb_peak if last else 0, fb_total_bytes=m.fb_total,
                            samples=samples if last else 0))
    return out


def _us(iso: str) -> int:
    try:
        return int(datetime.fromisoformat(iso).timestamp() * 1_000_000)
    except (TypeError, ValueError):
        return 0


def _is_uuid(text: str) -> bool:
    try:
        parse_uuid(text)
        return True
    except Exception:
        return False


# --- who owns a domain: name, tenant, QoS ----------------------------------------------

class OwnerLabels:
    """``labels(domain_uuid) -> MeteredOwner``: the domain's name, tenant and QoS class.

    Sources, first that knows wins: the tenancy allocations (the tenant and
    QoS class admission recorded for the domain's devices) and tenants (a
    tenant's default QoS class), where this vgpuhost has tenancy; then the
    operator's binding of the domain (issue 28), its name read through
    libvirt (``uri``): a tenant the domain's metadata names is never used.  Both are
    refreshed every ``refresh_s``, and at once (at most every ``refresh_s /
    6``) for a domain not seen before.  The allocations are read again on
    every sampler tick (:meth:`begin_tick`), and a domain that started
    again since the last tick (a new ``since`` in the state store) has its
    metadata read again at once, so a domain released and started for
    another tenant is never billed to the earlier one.  With neither, tenant
    and QoS stay empty.  Failures are logged and the last answers kept.
    """

    def __init__(self, store, uri: Optional[str] = None, refresh_s: float = 60.0):
        self.store = store
        self.uri = uri
        self.refresh_s = refresh_s
        self._cache: Dict[str, MeteredOwner] = {}
        self._admitted: Dict[str, Tuple[str, str]] = {}
        self._at = -1e18
        self._tenant_qos: Dict[str, str] = {}
        self._starts: Optional[Dict[str, str]] = None

    def begin_tick(self) -> None:
        """Called by the sampler before each reading: the allocations again, and everything at
        once when a domain started (or started again) since the last tick."""
        try:
            starts = self.store.domain_starts()
        except Exception as e:
            log.warning("reading the running domains failed: %s", e)
            starts = self._starts
        restarted = self._starts is not None and starts is not None and any(
            since != self._starts.get(uuid) for uuid, since in starts.items())
        self._starts = starts
        if restarted:
            self._at = -1e18                   # the next call refreshes all
        elif time.monotonic() - self._at < self.refresh_s:
            self._admitted = admitted_owners(self.store)

    def _refresh(self) -> None:
        self._at = time.monotonic()
        self._tenant_qos = tenant_default_qos(self.store)
        self._admitted = admitted_owners(self.store)
        if not self.uri:
            return
        cache: Dict[str, MeteredOwner] = {}
        bound = bound_owners(self.store)
        try:
            with open_connection(self.uri) as conn:
                for d in conn.domains():
                    try:
                        view = parse_domain(d.inactive_xml())
                    except Exception:
                        continue
                    # the tenant and class are the operator's binding (issue 28), never the XML's claim
                    tenant, qos = bound.get(view.uuid, ("", ""))
                    cache[d.uuid.lower()] = MeteredOwner(d.uuid.lower(), d.name, tenant, qos)
        except Exception as e:
            log.warning("reading domain metadata from %s failed: %s", self.uri, e)
            return
        self._cache = cache

    def __call__(self, domain_uuid: str) -> MeteredOwner:
        key = domain_uuid.lower()
        age = time.monotonic() - self._at
        if age >= self.refresh_s or (key not in self._cache and key not in self._admitted
                                     and age >= self.refresh_s / 6):
            self._refresh()
        o = self._cache.get(key) or MeteredOwner(domain_uuid=key)
        tenant, qos = self._admitted.get(key, ("", ""))
        if tenant or qos:
            o = replace(o, tenant=tenant or o.tenant, qos=qos or o.qos)
        if not o.qos and o.tenant in self._tenant_qos:
            o = replace(o, qos=self._tenant_qos[o.tenant])
        return o


def tenant_default_qos(store) -> Dict[str, str]:
    """``{tenant: default QoS class}`` from the tenancy tables (issue 13) when present, else ``{}``."""
    try:
        return {str(n): str(t.qos) for n, t in tenancy.tenants(store).items() if getattr(t, "qos", None)}
    except Exception as e:
        log.warning("reading tenants failed: %s", e)
        return {}


def bound_owners(store) -> Dict[str, Tuple[str, str]]:
    """``{domain UUID: (tenant, QoS class or '')}`` from the operator's bindings (issue 28), else ``{}``."""
    try:
        return {str(r[0]).lower(): (str(r[1]), str(r[2] or "")) for r in store.binding_rows()}
    except Exception as e:
        log.warning("reading bindings failed: %s", e)
        return {}


def admitted_owners(store) -> Dict[str, Tuple[str, str]]:
    """``{domain UUID: (tenant, QoS class)}`` from the allocations admission recorded, else ``{}``."""
    try:
        out: Dict[str, Tuple[str, str]] = {}
        for a in tenancy.allocations(store):
            if a.tenant:
                out[str(a.owner).lower()] = (str(a.tenant), str(a.qos or ""))
        return out
    except Exception as e:
        log.warning("reading allocations failed: %s", e)
        return {}


# --- the host-level figures and the sampler of one host ------------------------------

def host_series(host_root, store, nvml=None) -> Dict[str, object]:
    """Host-level figures for the snapshot (sysfs and the state store; with ``nvml``, a
    :class:`vgpuhost.io.nvml.NvmlBackend`, NVML's GPU_IS_LOST of each GPU as well).

    ``free_instances``: ``{(profile, pool): n}`` (pool ``""`` until GPU pools
    exist; a GPU an exclusive tenant's vGPUs hold counts none: no one else
    may join it; where admission applies, each GPU's count is capped by GPU
    time under its pool's ceiling, :func:`vgpuhost.ops.tenancy.time_fits`); ``orphaned_devices``: ``{reason: n}``; ``journal_open`` and
    ``gpu_health``: ``{(gpu, source): (healthy 1/0, cordoned 1/0)}`` of every GPU
    known (:func:`vgpuhost.ops.health.status`; a GPU failing now that nothing recorded yet reads
    unhealthy with its source, :func:`vgpuhost.ops.health.unrecorded_failures`: gone from the PCI tree
    ``pci``, a device read failing with EIO/ENODEV ``io``, GPU_IS_LOST ``nvml``; read only, nothing is
    recorded; a GPU out of service, recorded or failing now, counts no free instance); ``quota_used``/``quota_limit`` only where the store has a journal or
    tenant quotas; ``tenant_free_instances``: ``{(tenant, profile): n}``,
    what admission would admit of each profile for each tenant now
    (:func:`vgpuhost.ops.tenancy.capacity` with the tenant; tenant ``""``:
    for a domain naming no tenant), only where tenants exist; ``gpu_time``:
    ``{(gpu, pool): (expected GPU time, compute ceiling, starved demand)}`` and ``pool_starved``:
    ``{pool: starved demand}`` (shares of one GPU), only where tenancy is in use.
    """
    inv = discover(Sysfs(host_root), with_types=True)
    health_rows = getattr(store, "gpu_health_rows", None)     # GPU health (issue 27), where the store has it
    failing: Dict[object, Tuple[str, str]] = {}
    if callable(health_rows):
        try:    # the GPUs seen, remembered (written only when new): one that leaves the tree later is known
            store.remember_types(seen_rows(inv))
        except st.StoreError as e:
            log.warning("remembering the vGPU types seen failed: %s", e)
        failing = unrecorded_failures(host_root, store, inv, nvml)
        # a GPU out of service, or failing now, counts no free instance
        inv = in_service(inv, store, {g: f"unhealthy: {reason}" for g, (_s, reason) in failing.items()})
    if callable(getattr(store, "settings_under", None)):
        inv = makeable(host_root, store, inv)   # MIG on demand: the GPU instances a start would make count
    pools = gpu_pools(store)
    closed = _exclusive_gpus(store, inv)
    by_time = _time_fits(store, inv)
    free: Dict[tuple, int] = {}
    for g in inv.gpus:
        if str(g.address) in closed:
            continue
        ix = inv.on_gpu(g.address)
        for tid, ts in ix.by_type.items():
            key = (ts[0].name, pools.get(str(g.address), ""))
            n = free_instances(inv, g.address, tid)[0]
            t = by_time(str(g.address), ts[0].name, ts[0].framebuffer_mib) if by_time is not None else None
            free[key] = free.get(key, 0) + (n if t is None else min(n, t))
    present = {m.uuid for m in inv.mdevs} | {str(v.vf) for v in inv.vf_vgpus if v.type_id}
    records = store.vgpu_records()
    running = set(store.active_domains())
    recorded = {r.id for r in records}
    orphans = {"owner-not-running": sum(1 for r in records if r.id in present and _uuid_like(r.owner)
                                        and r.owner not in running),
               "unrecorded": len(present - recorded)}
    out: Dict[str, object] = {"free_instances": free, "orphaned_devices": orphans}
    if callable(health_rows):
        now = {str(g): source for g, (source, _r) in failing.items()}
        out["gpu_health"] = {}
        for h in status(store, inv):
            if h["gpu"] in now:
                # failing now and not recorded yet (no agent ran): unhealthy, with the source the agent records
                out["gpu_health"][(h["gpu"], now[h["gpu"]])] = (0, 1 if h["cordoned"] else 0)
                continue
            out["gpu_health"][(h["gpu"], h["source"] or "")] = (1 if h["healthy"] else 0, 1 if h["cordoned"] else 0)
    journal = getattr(store, "journal_entries", None)        # the intent journal (issue 12), where present
    if callable(journal):
        try:
            out["journal_open"] = len(journal(open_only=True))
        except Exception as e:
            log.warning("reading the journal failed: %s", e)
    out.update(_quota(store, inv))
    out.update(_tenant_free(host_root, store, inv))
    out.update(_anomalies(store))
    out.update(_gpu_time(store, inv))
    return out


def _gpu_time(store, inv) -> Dict[str, object]:
    """``{"gpu_time": {(gpu, pool): (expected, ceiling, starved)}, "pool_starved": {pool: starved}}``
    (shares of one GPU: :func:`vgpuhost.ops.gputime.gpu_figures`) where tenancy is in use (placement
    weighs GPU time only under admission), else ``{}``."""
    try:
        if not tenancy_active(store):
            return {}
        pl = tenancy.pools(store)
        held = gputime.with_use(gputime.history(store), tenancy.allocations(store, inv))
        figs = gputime.gpu_figures(held, pl, {str(g.address): g.framebuffer_mib or 0 for g in inv.gpus
                                              if g.vgpu_backend})
        pool_of = {g: p.name for p in pl for g in p.gpus}
        per = {(g, pool_of.get(g, "default")): (f["gpu_time_expected"], f["compute_ceiling"], f["starved_demand"])
               for g, f in figs.items()}
        return {"gpu_time": per, "pool_starved": gputime.starved_summary(figs, pl)["by_pool"]}
    except Exception as e:
        log.warning("reading GPU time per GPU failed: %s", e)
        return {}


#: how often (seconds) the exporter's anomaly flags are worked out again from the rollups (they read weeks)
ANOMALY_EVERY_S = 900.0
_anomaly_cache: Dict[str, Tuple[float, Dict[str, object]]] = {}


def _anomalies(store) -> Dict[str, object]:
    """``{"anomalies": {(kind, tenant, device): 1.0}}``: the flags of
    :func:`anomalies_of` at the end of the sampler's last hour, worked out at most every
    :data:`ANOMALY_EVERY_S` (licences: the exporter serves them per device; measured 2026-12-06: 1.2 s
    for 384 vGPUs' five weeks of rollups on a loaded 2-core machine)."""
    key = str(store.state_dir)
    now = time.monotonic()
    hit = _anomaly_cache.get(key)
    if hit is not None and now - hit[0] < ANOMALY_EVERY_S:
        return hit[1]
    try:
        last = st.meter_state(store, "last_tick_us")
        end = hour_end(int(last) if last else int(time.time() * 1e6))
        out: Dict[str, object] = {"anomalies": {(f.kind, f.tenant, f.device): 1.0 for f in anomalies_of(store, end)}}
    except Exception as e:
        log.warning("working out anomaly flags failed: %s", e)
        out = {}
    _anomaly_cache[key] = (now, out)
    return out


def hour_end(us: int) -> datetime:
    """The end of the rollup hours a reading at ``us`` completed: ``us`` itself on a whole hour,
    else the next whole hour (aware UTC)."""
    t = datetime.fromtimestamp(us / 1e6, timezone.utc)
    floor = t.replace(minute=0, second=0, microsecond=0)
    return floor if floor == t else floor + timedelta(hours=1)


def anomalies_of(store, end: datetime, licences=None) -> list:
    """The anomaly flags (:func:`vgpuhost.policy.anomaly.flags`) at ``end`` (an aware datetime on
    an hour) from the rollups of the last three days per device, five weeks per tenant
    (:func:`vgpuhost.io.state.usage_by_tenant`) and eight days of gaps; ``licences``:
    ``{device: (state, tenant)}``."""
    def key(t: datetime) -> str:
        return hour_of(int(t.timestamp() * 1e6))
    rows = st.usage_rows(store, key(end - timedelta(days=3)), key(end))                 # per device: 3 days
    history = st.usage_by_tenant(store, key(end - timedelta(weeks=5)), key(end))        # per tenant: 5 weeks
    gaps = st.meter_gaps(store, iso_us(int((end - timedelta(days=8)).timestamp() * 1e6)))
    if licences:        # a licence whose tenant the caller did not know: the tenant its newest rollups name
        tenant_of = {r.device: r.tenant for r in rows}
        licences = {d: (state, tenant or tenant_of.get(d, "")) for d, (state, tenant) in licences.items()}
    return anomaly_flags(rows, gaps, now=end, licences=licences, history=history)


def licence_states(host_root, store) -> Dict[str, str]:
    """``{device: licence state}`` of the vGPUs the host's metering NVML reads now (one read; no
    rollup written); devices named as the sampler names them (mdev UUID, else the record's id)."""
    return {device: state for device, (state, _) in licences(host_root, store).items()}


def licence_report(host_root, store, inv) -> List[Finding]:
    """``host check``'s licence findings (:func:`vgpuhost.policy.checks.licence_findings`): one per vGPU
    NVML reads, judged against this machine's clock.  None where the host has no vGPU; one ``info``
    finding ``LICENCES_UNREAD`` where NVML cannot be read (nvidia-ml-py or the driver missing)."""
    if not (inv.mdevs or inv.vf_vgpus):
        return []
    try:
        found = licences(host_root, store)
    except VgpuhostError as e:
        return [Finding("info", "LICENCES_UNREAD", "host", f"vGPU licences not read: {e.one_line()}")]
    return licence_findings(found, time.time())


def licences(host_root, store) -> Dict[str, Tuple[str, Optional[float]]]:
    """``{device: (licence state, expiry)}`` of the vGPUs the host's metering NVML reads now: a state of
    :data:`~vgpuhost.io.nvml_metering.LICENSE_STATES`, and when the licence expires (seconds since the
    epoch; None where the driver gives no date).  Devices named as the sampler names them.  Raises what
    :func:`metering_nvml` raises where NVML cannot be had (HostEnvironmentError)."""
    recs = list(store.vgpu_records()) if store is not None else []
    out: Dict[str, Tuple[str, Optional[float]]] = {}
    for g in metering_nvml(host_root).read({}):
        if g.error:
            continue
        for v in g.vgpus:
            mdev = "" if no_mdev_uuid(v.device) else v.device
            rec = match_vgpu_record(recs, gpu=g.bdf, device=mdev, vm_id=v.vm_id, type_name=v.type_name)
            out[mdev or (rec.id if rec is not None else f"{g.bdf}/vgpu{v.instance}")] = (v.license,
                                                                                       v.license_expiry_s)
    return out


def _exclusive_gpus(store, inv) -> Dict[str, str]:
    """``{GPU BDF: exclusive tenant}`` for the GPUs an exclusive tenant's vGPUs hold (issue 26), else ``{}``."""
    try:
        ts = tenancy.tenants(store)
        return tenancy.exclusive_holders(ts, tenancy.allocations(store, inv)) if ts else {}
    except Exception as e:
        log.warning("reading exclusive tenants failed: %s", e)
        return {}


def _time_fits(store, inv):
    """:func:`vgpuhost.ops.tenancy.time_fits` (None where admission does not apply or it cannot be read)."""
    try:
        return tenancy.time_fits(store, inv)
    except Exception as e:
        log.warning("reading GPU time for free instances failed: %s", e)
        return None


def _tenant_free(host_root, store, inv) -> Dict[str, object]:
    """``{"tenant_free_instances": {(tenant, profile): n}}``: for each tenant (and ``""``, a domain naming
    no tenant) and profile, how many admission would admit now (:func:`vgpuhost.ops.tenancy.capacity`,
    dry); ``{}`` without tenants."""
    try:
        ts = tenancy.tenants(store)
        if not ts:
            return {}
        out: Dict[tuple, int] = {}
        limits = limits_lookup(host_root, inv)  # mixed-size maxima and free placement ids, as placement counts
        for name in [""] + sorted(ts):          # "": a domain naming no tenant
            doc = tenancy.capacity(store, inv, tenant=name or None, untenanted=not name, per_gpu=False,
                                   policies=lambda gpus: tenancy.scheduler_policies(host_root, gpus),
                                   limits_for=limits)
            for p in doc["profiles"]:
                out[(name, p["profile"])] = int(p["fits"])
        return {"tenant_free_instances": out}
    except Exception as e:
        log.warning("reading tenants' capacity failed: %s", e)
        return {}


def gpu_pools(store) -> Dict[str, str]:
    """``{gpu BDF: pool}`` where the store knows GPU pools (issue 13), else ``{}``."""
    try:
        return {str(g): str(p.name) for p in tenancy.pools(store) for g in p.gpus}
    except Exception as e:
        log.warning("reading GPU pools failed: %s", e)
        return {}


#: tenancy's quota dimensions -> (resource label, factor to base units)
_QUOTA_UNITS = {"vgpus": ("vgpus", 1), "framebuffer_mib": ("framebuffer_bytes", 1024 * 1024),
                "mig_slices": ("mig_slices", 1), "passthrough_gpus": ("passthrough_gpus", 1)}


def _quota(store, inv) -> Dict[str, object]:
    """Quota use and limits per tenant where tenancy exists (issue 13); ``{}`` otherwise.

    ``quota_used``: ``{(tenant, resource): value}``; ``quota_limit``:
    ``{(tenant, resource, "guaranteed"|"burst"): value}``; framebuffer in bytes; ``guarantee_at_risk``:
    ``{tenant: 1.0 when its guarantee cannot be served beside the others' now, else 0.0}``.
    """
    try:
        used, limit, risk = {}, {}, {}
        for row in tenancy.usage_report(store, inv):
            if not row.get("tenant"):
                continue
            t = str(row["tenant"])
            if row.get("known"):
                risk[t] = 1.0 if row.get("at_risk") else 0.0
            for dim, u in (row.get("usage") or {}).items():
                res, k = _QUOTA_UNITS.get(dim, (dim, 1))
                used[(t, res)] = float(u.get("used") or 0) * k
                if u.get("guaranteed") is not None:
                    limit[(t, res, "guaranteed")] = float(u["guaranteed"]) * k
                if u.get("limit") is not None:
                    limit[(t, res, "burst")] = float(u["limit"]) * k
        return {"quota_used": used, "quota_limit": limit, "guarantee_at_risk": risk}
    except Exception as e:
        log.warning("reading quota use failed: %s", e)
        return {}


def _uuid_like(text: str) -> bool:
    return len(text) == 36 and text.count("-") == 4


@dataclass(frozen=True)
class LiveUse:
    """One active vGPU's use over the last interval, for ``vgpuhost top``: ``device`` (mdev UUID or VF
    BDF), ``gpu`` (BDF), ``profile``, ``owner`` (domain, name, tenant, QoS class), utilisation in percent
    of the interval (``sm``, ``mem``, ``enc``, ``dec``; None where NVML gave no sample) and framebuffer
    used/total in bytes."""

    device: str
    gpu: str
    profile: str
    owner: MeteredOwner
    sm: Optional[float]
    mem: Optional[float]
    enc: Optional[float]
    dec: Optional[float]
    fb_used_bytes: int
    fb_total_bytes: int


class LiveView:
    """What the vGPUs use now, read from NVML without metering anything (``vgpuhost top``).

    Each :meth:`read` asks NVML for the samples since the previous read (the first read averages
    NVML's own window), attributes each vGPU as the sampler does (its record, the allocations'
    tenant) and returns one :class:`LiveUse` per active vGPU.  It writes nothing: the running
    sampler (exporter or agent) is not disturbed, and rollups stay that sampler's."""

    def __init__(self, nvml: MeteringNvml, store):
        self.nvml = nvml
        self.store = store
        self.labels = OwnerLabels(store)
        self._seen: Dict[str, int] = {}

    def read(self) -> List[LiveUse]:
        readings = self.nvml.read(dict(self._seen))
        recs = list(self.store.vgpu_records())
        names = self.store.active_domains()
        out: List[LiveUse] = []
        for g in readings:
            if g.error:
                continue
            for v in g.vgpus:
                mdev = "" if no_mdev_uuid(v.device) else v.device
                rec = match_vgpu_record(recs, gpu=g.bdf, device=mdev, vm_id=v.vm_id, type_name=v.type_name)
                device = mdev or (rec.id if rec is not None else f"{g.bdf}/vgpu{v.instance}")
                domain = v.vm_id or (rec.owner if rec is not None and _is_uuid(rec.owner) else "")
                s = v.sample
                owner = self.labels(domain) if domain else MeteredOwner()
                if domain and not owner.domain:
                    owner = replace(owner, domain=names.get(domain.lower(), ""))
                out.append(LiveUse(device, g.bdf, v.type_name, owner,
                                   s.sm if s else None, s.mem if s else None, s.enc if s else None,
                                   s.dec if s else None, v.fb_used_bytes, v.fb_total_bytes))
                if s is not None:
                    self._seen[g.bdf] = max(self._seen.get(g.bdf, 0), s.timestamp_us)
        return out


def live_view(host_root, store) -> LiveView:
    """The :class:`LiveView` of a host, through its metering NVML door (real or simulated)."""
    return LiveView(metering_nvml(host_root), store)


def host_sampler(host_root, store, *, interval_s: float, max_hold_s: Optional[float] = None,
                 libvirt_uri: Optional[str] = None) -> Sampler:
    """The sampler of one host, set up as ``vgpuhost exporter`` and the agent run it.

    Readings come from the host's metering NVML door (real or simulated,
    :func:`vgpuhost.io.backends.metering_nvml`); ``store``: a writable
    StateStore; owners are labelled from the store's records and, with
    ``libvirt_uri``, libvirt's domains (:class:`OwnerLabels`); the host-level
    figures (:func:`host_series`, with the health checks' NVML door,
    :func:`vgpuhost.ops.health.nvml_or_none`, for GPU_IS_LOST) are read every ``max(interval_s, 30)``
    seconds.  ``interval_s`` and ``max_hold_s``: as :class:`Sampler` takes them.
    """
    health_nvml: List[object] = []          # the health checks' NVML door, opened at the first host reading

    def series() -> Dict[str, object]:
        if not health_nvml:
            health_nvml.append(nvml_or_none(host_root))
        return host_series(host_root, store, health_nvml[0])

    return Sampler(metering_nvml(host_root), store, interval_s=interval_s, max_hold_s=max_hold_s,
                   labels=OwnerLabels(store, libvirt_uri), host_series=series, host_every_s=max(interval_s, 30.0))


__all__ = ["Sampler", "Snapshot", "DeviceUsage", "MeteredOwner", "OwnerLabels", "host_sampler", "host_series",
           "LiveUse", "LiveView", "live_view", "licence_states", "licences", "licence_report", "anomalies_of", "hour_end",
           "gpu_pools", "split_hours", "hour_of", "DEFAULT_INTERVAL_S"]
