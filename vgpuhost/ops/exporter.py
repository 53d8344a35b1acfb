"""The Prometheus exporter: the sampler's snapshot as metrics over HTTP.

Owns: :class:`SnapshotCollector` (a prometheus-client collector that turns a
:class:`~vgpuhost.ops.metering.Snapshot`, its host-level figures included,
into metric families) and :func:`serve` (the sampler thread plus
prometheus-client's HTTP server, loopback by default).  A scrape only reads the last snapshot: it never waits
on NVML, the state store or libvirt.  Must not: hold metering logic (that is
:mod:`vgpuhost.ops.metering`), or put PIDs in labels.

Conventions (Prometheus's "Writing exporters" and naming guides): one
prefix ``vgpuhost_``, base units (seconds, bytes, ratios 0-1), ``_total``
counters, one ``vgpuhost_device_info`` series per device carrying the
domain, tenant and QoS labels (join on ``device``), ``vgpuhost_up``.
The metric list is in docs/metering.md.
"""

from __future__ import annotations

import io
import logging
import socket
import socketserver
import threading
import time
from socketserver import ThreadingMixIn
from typing import Callable, Dict, Iterator, Optional, Tuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..io.connlimits import DeadlineReader, RefusalLog, answer_and_close
from ..io.nvml_metering import LICENSE_STATES
from ..model.concepts import DeviceKind
from ..model.nvml import nvml_bus_id
from .metering import Sampler, Snapshot, sampler_lock

log = logging.getLogger("vgpuhost.exporter")

PREFIX = "vgpuhost_"
DEFAULT_PORT = 9842
DEFAULT_ADDRESS = "127.0.0.1"

#: what a metrics page holds (``--metrics-scope``): ``host``, the host-level series only (GPUs, pools,
#: the sampler, health, the journal: no series that names a tenant, a domain or a device); ``all``, every
#: series, the per-tenant, per-domain and per-device ones too.  The TCP port serves ``host`` unless the
#: operator asks for ``all`` (any local user can connect to a loopback port: trial 9 F6); the agent's
#: ``GET /v1/metrics`` (admin and read-only roles) is always ``all``.
SCOPES = ("host", "all")
DEFAULT_SCOPE = "host"
#: the labels that make a series tenant-scoped: a family carrying one is left out of a ``host`` page
TENANT_LABELS = frozenset({"tenant", "domain", "domain_uuid", "vm_device"})


def _label_names(family) -> frozenset:
    """The label names a metric family declares (prometheus-client keeps them from ``labels=``), and those
    of its samples (``_total`` and ``_created`` add none)."""
    names = set(getattr(family, "_labelnames", ()) or ())
    for sample in family.samples:
        names.update(sample.labels)
    return frozenset(names)


class SnapshotCollector:
    """prometheus-client collector over ``get_snapshot()``; ``interval_s`` decides staleness
    (``vgpuhost_up`` is 0 when the last good sample is older than 3 intervals); ``scope`` (:data:`SCOPES`)
    which families it yields: ``all``, or ``host`` (none carrying a :data:`TENANT_LABELS` label)."""

    def __init__(self, get_snapshot: Callable[[], Snapshot], interval_s: float, scope: str = "all"):
        if scope not in SCOPES:
            raise ValueError(f"scope {scope!r} is not one of {SCOPES}")
        self.get_snapshot = get_snapshot
        self.interval_s = interval_s
        self.scope = scope
        self._cache: "tuple[Optional[Snapshot], list]" = (None, [])

    def describe(self):
        return []          # unchecked collector: families vary with the host

    def fresh(self, snap: Snapshot) -> bool:
        """Whether ``snap`` is a good reading taken within 3 intervals (and a second) of now: ``vgpuhost_up``."""
        return bool(snap.ok and (time.time() - snap.wall) <= 3 * self.interval_s + 1)

    def collect(self) -> Iterator[object]:
        """``vgpuhost_up`` (judged now), then the snapshot's families, built once per snapshot."""
        snap = self.get_snapshot()
        fresh = self.fresh(snap)
        up = GaugeMetricFamily(PREFIX + "up", "1 when the sampler's last reading succeeded recently, else 0")
        up.add_metric([], 1.0 if fresh else 0.0)
        yield up
        cached, families = self._cache
        if cached is not snap:
            families = list(self._families(snap))
            if self.scope == "host":
                families = [f for f in families if not _label_names(f) & TENANT_LABELS]
            self._cache = (snap, families)
        yield from families

    def _families(self, snap: Snapshot) -> Iterator[object]:
        g = GaugeMetricFamily(PREFIX + "sampler_last_sample_timestamp_seconds",
                              "NVML clock time of the last reading (seconds since the epoch)")
        g.add_metric([], snap.time_us / 1e6)
        yield g
        g = GaugeMetricFamily(PREFIX + "sampler_duration_seconds", "How long the last reading took")
        g.add_metric([], snap.duration_s)
        yield g
        c = CounterMetricFamily(PREFIX + "sampler_errors", "Readings or GPUs that failed")
        c.add_metric([], float(snap.errors_total))
        yield c
        c = CounterMetricFamily(PREFIX + "metering_gap_seconds",
                                "Seconds marked as gaps (no utilisation samples) since the exporter started")
        c.add_metric([], snap.gap_s_total)
        yield c

        info = GaugeMetricFamily(PREFIX + "device_info", "One per metered device: who holds it",
                                 labels=["vm_device", "kind", "gpu", "profile", "gpu_instance", "domain",
                                         "domain_uuid", "tenant", "qos"])
        fams = {
            "alloc": CounterMetricFamily(PREFIX + "device_allocated_seconds",
                                         "Seconds the device was allocated to its domain", labels=["vm_device"]),
            "sm": CounterMetricFamily(PREFIX + "device_sm_busy_seconds",
                                      "SM busy seconds (utilisation x time; 0 for passthrough)", labels=["vm_device"]),
            "enc": CounterMetricFamily(PREFIX + "device_encoder_busy_seconds", "Encoder busy seconds",
                                       labels=["vm_device"]),
            "dec": CounterMetricFamily(PREFIX + "device_decoder_busy_seconds", "Decoder busy seconds",
                                       labels=["vm_device"]),
            "fb": GaugeMetricFamily(PREFIX + "device_framebuffer_used_bytes", "Framebuffer in use",
                                    labels=["vm_device"]),
            "peak": GaugeMetricFamily(PREFIX + "device_framebuffer_peak_bytes",
                                      "Highest framebuffer use seen for this device and domain", labels=["vm_device"]),
            "size": GaugeMetricFamily(PREFIX + "device_framebuffer_size_bytes", "Framebuffer of the profile",
                                      labels=["vm_device"]),
            "lic": GaugeMetricFamily(PREFIX + "device_licensed",
                                     "1 when the vGPU holds a licence, else 0 (vGPUs only)", labels=["vm_device"]),
            "util": GaugeMetricFamily(PREFIX + "device_sm_utilization_ratio",
                                      "SM utilisation of the last sample (0-1)", labels=["vm_device"]),
            "state": GaugeMetricFamily(PREFIX + "device_license_state",
                                       "1 for the vGPU's licence state as NVML reports it, 0 for the other five "
                                       "(vGPUs only)", labels=["vm_device", "state"]),
            "expiry": GaugeMetricFamily(PREFIX + "device_license_expiry_timestamp_seconds",
                                        "When the vGPU's licence expires (seconds since the epoch), where the "
                                        "driver gives a date", labels=["vm_device"]),
        }
        for d in snap.devices:
            o = d.owner
            info.add_metric([d.device, d.kind, d.gpu, d.profile, "" if d.gi_id is None else str(d.gi_id),
                             o.domain, o.domain_uuid, o.tenant, o.qos], 1.0)
            lab = [d.device]
            e = d.earlier                 # other domains' seconds on this device in this process
            fams["alloc"].add_metric(lab, d.alloc_s + e[0])
            if d.kind != DeviceKind.PASSTHROUGH:
                fams["sm"].add_metric(lab, d.sm_busy_s + e[1])
                fams["enc"].add_metric(lab, d.enc_busy_s + e[2])
                fams["dec"].add_metric(lab, d.dec_busy_s + e[3])
                fams["fb"].add_metric(lab, float(d.fb_used_bytes))
                fams["peak"].add_metric(lab, float(d.fb_peak_bytes))
                fams["size"].add_metric(lab, float(d.fb_total_bytes))
                fams["lic"].add_metric(lab, 1.0 if d.license == "licensed" else 0.0)
                for state in LICENSE_STATES:
                    fams["state"].add_metric(lab + [state], 1.0 if d.license == state else 0.0)
                if d.license_expiry_s is not None:
                    fams["expiry"].add_metric(lab, d.license_expiry_s)
                fams["util"].add_metric(lab, d.sm_percent / 100)
        yield info
        yield from fams.values()
        # per tenant and profile, for systems that bill from Prometheus (docs/guide/billing.md#prometheus)
        ta = CounterMetricFamily(PREFIX + "tenant_allocated_seconds",
                                 "Seconds a tenant's devices of a profile were allocated (the rollups' alloc_s "
                                 "added up since the exporter started; tenant \"\": none)",
                                 labels=["tenant", "profile", "kind"])
        ts = CounterMetricFamily(PREFIX + "tenant_sm_busy_seconds",
                                 "SM busy seconds of a tenant's vGPUs of a profile since the exporter started",
                                 labels=["tenant", "profile", "kind"])
        for tenant, profile, kind, alloc_s, sm_s in snap.tenant_usage:
            ta.add_metric([tenant, profile, kind], alloc_s)
            if kind != DeviceKind.PASSTHROUGH:
                ts.add_metric([tenant, profile, kind], sm_s)
        yield ta
        yield ts

        # pci_bus_id, UUID and modelName as dcgm-exporter spells them, so its series join on them
        # (docs/metering.md, "Joining with dcgm-exporter")
        gi = GaugeMetricFamily(PREFIX + "gpu_info", "One per GPU NVML sees",
                               labels=["gpu", "name", "mig", "gpm", "pci_bus_id", "UUID", "modelName"])
        for bdf, name, mig, gpm, uuid in snap.gpus:
            gi.add_metric([bdf, name, "1" if mig else "0", gpm, nvml_bus_id(bdf), uuid, name], 1.0)
        yield gi
        u = GaugeMetricFamily(PREFIX + "gpu_instance_sm_utilization_ratio",
                              "SM utilisation of a MIG GPU instance from GPM (0-1)", labels=["gpu", "gpu_instance"])
        for bdf, gid, pct in snap.gi_sm:
            u.add_metric([bdf, str(gid)], pct / 100)
        yield u
        n = GaugeMetricFamily(PREFIX + "gpu_instance_not_metered",
                              "1 per MIG GPU instance holding vGPUs whose SM use GPM does not meter, with why",
                              labels=["gpu", "gpu_instance", "reason"])
        for bdf, gid, why in snap.gi_not_metered:
            n.add_metric([bdf, str(gid), why], 1.0)
        yield n
        yield from _host_families(snap.host)


#: the host series' quota resources measured in bytes (ops/metering) -> their ``resource`` label on the
#: ``..._bytes`` series
BYTES_RESOURCES = {"framebuffer_bytes": "framebuffer"}


def _host_families(host: Dict[str, object]) -> Iterator[object]:
    if "free_instances" in host:
        f = GaugeMetricFamily(PREFIX + "free_instances", "vGPUs of a profile that can still be created now",
                              labels=["profile", "pool"])
        for (profile, pool), n in sorted(host["free_instances"].items()):
            f.add_metric([profile, pool], float(n))
        yield f
    if "tenant_free_instances" in host:
        f = GaugeMetricFamily(PREFIX + "tenant_free_instances",
                              "vGPUs of a profile admission would admit for the tenant's domains now (quota, "
                              "isolation, QoS class, pools, reserves, placement; tenant \"\": a domain naming none)",
                              labels=["tenant", "profile"])
        for (tenant, profile), n in sorted(host["tenant_free_instances"].items()):
            f.add_metric([tenant, profile], float(n))
        yield f
    if "gpu_health" in host:
        # one fixed label set per GPU (a transition changes the value, never the series); how it failed is
        # the separate info series, present only while it is out of service by a failure
        h = GaugeMetricFamily(PREFIX + "gpu_healthy",
                              "1 while the GPU is healthy, 0 once a failure took it out of service (EIO/ENODEV, "
                              "GPU_IS_LOST, a critical Xid, gone from the PCI tree; vgpuhost_gpu_failure_info says "
                              "which) until 'vgpuhost gpu uncordon' after repair", labels=["gpu"])
        why = GaugeMetricFamily(PREFIX + "gpu_failure_info",
                                "1 for a GPU a failure took out of service, labelled with how it failed (source: "
                                "io, nvml or pci); absent while the GPU is healthy", labels=["gpu", "source"])
        c = GaugeMetricFamily(PREFIX + "gpu_cordoned", "1 while an operator has cordoned the GPU (no placement)",
                              labels=["gpu"])
        for (gpu, source), (healthy, cordoned) in sorted(host["gpu_health"].items()):
            h.add_metric([gpu], float(healthy))
            if not healthy:
                why.add_metric([gpu, source or "unknown"], 1.0)
            c.add_metric([gpu], float(cordoned))
        yield h
        yield why
        yield c
    if "orphaned_devices" in host:
        f = GaugeMetricFamily(PREFIX + "orphaned_devices",
                              "vGPUs with no running owner (owner-not-running) or no record (unrecorded)",
                              labels=["reason"])
        for reason, n in sorted(host["orphaned_devices"].items()):
            f.add_metric([reason], float(n))
        yield f
    if "journal_open" in host:
        f = GaugeMetricFamily(PREFIX + "journal_open_entries", "Operations journaled and not finished")
        f.add_metric([], float(host["journal_open"]))
        yield f
    if "quota_used" in host:
        # one unit per name: counts (vGPUs, MIG slices, passthrough GPUs) and bytes (framebuffer) apart
        used = GaugeMetricFamily(PREFIX + "tenant_quota_used", "A tenant's use of a counted quota resource "
                                 "(vgpus, mig_slices, passthrough_gpus)", labels=["tenant", "resource"])
        used_b = GaugeMetricFamily(PREFIX + "tenant_quota_used_bytes", "A tenant's use of a quota resource "
                                   "measured in bytes (framebuffer)", labels=["tenant", "resource"])
        lim = GaugeMetricFamily(PREFIX + "tenant_quota_limit", "A tenant's quota of a counted resource",
                                labels=["tenant", "resource", "limit"])
        lim_b = GaugeMetricFamily(PREFIX + "tenant_quota_limit_bytes", "A tenant's quota of a resource measured "
                                  "in bytes", labels=["tenant", "resource", "limit"])
        for (tenant, resource), v in sorted(host["quota_used"].items()):
            if resource in BYTES_RESOURCES:
                used_b.add_metric([tenant, BYTES_RESOURCES[resource]], float(v))
            else:
                used.add_metric([tenant, resource], float(v))
        for (tenant, resource, kind), v in sorted(host.get("quota_limit", {}).items()):
            if resource in BYTES_RESOURCES:
                lim_b.add_metric([tenant, BYTES_RESOURCES[resource], kind], float(v))
            else:
                lim.add_metric([tenant, resource, kind], float(v))
        yield from (used, used_b, lim, lim_b)
    if "guarantee_at_risk" in host:
        f = GaugeMetricFamily(PREFIX + "tenant_guarantee_at_risk",
                              "1 when the tenant's guarantee cannot be served beside the other tenants' now",
                              labels=["tenant"])
        for tenant, v in sorted(host["guarantee_at_risk"].items()):
            f.add_metric([tenant], v)
        yield f
    if "gpu_time" in host:
        exp = GaugeMetricFamily(PREFIX + "gpu_time_expected",
                                "Expected GPU-time demand of the GPU's time-sliced vGPUs (shares of one GPU, from "
                                "the metered history; else the profile's fixed share)", labels=["gpu", "pool"])
        ceil = GaugeMetricFamily(PREFIX + "gpu_compute_ceiling",
                                 "The expected GPU-time demand the GPU's pool lets it carry (shares of one GPU)",
                                 labels=["gpu", "pool"])
        st = GaugeMetricFamily(PREFIX + "gpu_starved_demand",
                               "Expected GPU-time demand above the GPU's compute ceiling (shares of one GPU): a "
                               "noisy-neighbour QoS figure; 0 where placement kept it under", labels=["gpu", "pool"])
        for (gpu, pool), (e, c, v) in sorted(host["gpu_time"].items()):
            exp.add_metric([gpu, pool], float(e))
            ceil.add_metric([gpu, pool], float(c))
            st.add_metric([gpu, pool], float(v))
        yield exp
        yield ceil
        yield st
    if "pool_starved" in host:
        f = GaugeMetricFamily(PREFIX + "pool_starved_demand",
                              "Expected GPU-time demand above the compute ceilings of the pool's GPUs, summed "
                              "(shares of one GPU)", labels=["pool"])
        for pool, v in sorted(host["pool_starved"].items()):
            f.add_metric([pool], float(v))
        yield f
    if "anomalies" in host:
        f = GaugeMetricFamily(PREFIX + "anomaly", "1 per anomaly flag: kind (usage-spike, saturated, "
                              "idle-guaranteed, gaps-growing), tenant and device where it names one; "
                              "'vgpuhost advise' says why and what to do", labels=["kind", "tenant", "vm_device"])
        for (kind, tenant, device), v in sorted(host["anomalies"].items()):
            f.add_metric([kind, tenant, device], v)
        yield f


def serve(sampler: Sampler, *, address: str = DEFAULT_ADDRESS, port: int = DEFAULT_PORT,
          stop: Optional[threading.Event] = None, ready: Optional[Callable[[int], None]] = None,
          scope: str = DEFAULT_SCOPE, max_connections: Optional[int] = None) -> None:
    """Run the sampler and serve ``/metrics`` on ``address:port`` until ``stop`` is set.

    ``port`` 0 picks a free port; ``ready(port)`` is called once it listens.  ``scope``: which series the
    page holds (:data:`SCOPES`; the host-level ones unless asked); ``max_connections``: :func:`listen`'s.
    Raises OSError when the address cannot be bound, HostEnvironmentError when
    another sampler already meters this state dir (:func:`~vgpuhost.ops.metering.sampler_lock`).
    """

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: sampler.snapshot, sampler.interval_s, scope))
    stop = stop or threading.Event()
    with sampler_lock(sampler.store.state_dir):     # refused before it listens or says it does
        server, thread = listen(address, port, registry, max_connections=max_connections)
        try:
            if ready is not None:
                ready(server.server_address[1])
            sampler.run(stop, locked=True)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)


#: the metrics listener's backlog (the kernel caps it at ``net.core.somaxconn``)
SCRAPE_BACKLOG = socket.SOMAXCONN
#: seconds a scrape's connection may send nothing, and the most its whole request (line and headers) may
#: take however it paces it, before it is closed
SCRAPE_TIMEOUT_S = 10.0
#: connections the metrics port serves at once (a thread each); one more is answered 429 and closed
SCRAPE_MAX_CONNECTIONS = 16
#: seconds between two log lines about scrapes refused for want of a slot (a storm is one line)
SCRAPE_REFUSAL_LOG_S = 10.0
_TOO_MANY = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain; charset=utf-8\r\n"
             b"Retry-After: 1\r\nContent-Length: 49\r\nConnection: close\r\n\r\n"
             b"too many connections to the metrics port at once\n")


class _Discard:
    """wsgiref's error stream: a scrape whose client went away is not a traceback on stderr."""

    def write(self, _text) -> None:
        pass

    def flush(self) -> None:
        pass


def listen(address: str, port: int, registry: CollectorRegistry,
           max_connections: Optional[int] = None) -> Tuple[object, threading.Thread]:
    """Serve ``registry`` as ``/metrics`` on ``address:port`` (an IPv4 or IPv6 address; ``port`` 0 picks a
    free one) from a daemon thread: ``(server, thread)``; ``server.server_address[1]`` is the port bound,
    and ``server.shutdown()`` then ``server.server_close()`` stop it.  Raises OSError when it cannot bind.

    prometheus-client's own WSGI app on the standard library's threading WSGI server: what its
    ``start_http_server`` does from 0.17 on, but bookworm ships 0.16 (python3-prometheus-client
    0.16.0-0.1), whose ``start_http_server`` returns nothing to stop or to ask for the port.

    A scrape storm is served, not dropped: the listen backlog is :data:`SCRAPE_BACKLOG` (the stdlib's
    and prometheus-client's is 5: a burst of scrapers beyond it had its connections dropped and timed
    out), each connection has its own thread (a scrape only reads the last snapshot).  Any local user can
    connect, so what one may hold is bounded (trial 9 F14: a thousand slow connections took every file
    descriptor of the process, its sampler's included): at most ``max_connections``
    (:data:`SCRAPE_MAX_CONNECTIONS`) are served at once, one more is answered 429 from the accepting thread
    and closed (``server.refusals.refused`` counts them; logged as one line per
    :data:`SCRAPE_REFUSAL_LOG_S`, as the agent's sockets do, :class:`vgpuhost.io.connlimits.RefusalLog`); a
    request must arrive within :data:`SCRAPE_TIMEOUT_S` of its connection, however it paces its bytes; a
    connection dropped or timed out is closed without a traceback.
    """
    limit = SCRAPE_MAX_CONNECTIONS if max_connections is None else max_connections
    slots = threading.BoundedSemaphore(limit)

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        block_on_close = False
        request_queue_size = SCRAPE_BACKLOG
        address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        max_connections = limit

        def process_request(self, request, client_address):
            if not slots.acquire(blocking=False):
                self.refusals.note(f"the metrics port serves at most {limit} connections at once, all open")
                answer_and_close(request, _TOO_MANY)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                slots.release()
                self.shutdown_request(request)
                raise

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

        def handle_error(self, request, client_address):     # a client gone or too slow: no traceback
            log.debug("metrics connection from %s ended early", client_address, exc_info=True)

    class Quiet(WSGIRequestHandler):
        def setup(self):
            """StreamRequestHandler's, with the request read through a :class:`DeadlineReader` (a gap of
            at most :data:`SCRAPE_TIMEOUT_S`, and the whole request within it)."""
            self.connection = self.request
            self.connection.settimeout(SCRAPE_TIMEOUT_S)
            self.rfile = io.BufferedReader(DeadlineReader(self.connection, SCRAPE_TIMEOUT_S, SCRAPE_TIMEOUT_S))
            self.wfile = socketserver._SocketWriter(self.connection)

        def get_stderr(self):
            return _Discard()

        def log_message(self, format, *args):     # noqa: A002 (the stdlib's name): no line per scrape
            pass

    server = make_server(address, port, make_wsgi_app(registry), Server, handler_class=Quiet)
    server.refusals = RefusalLog(log, f"{address}:{server.server_address[1]}", SCRAPE_REFUSAL_LOG_S)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
