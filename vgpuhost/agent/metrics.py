"""The agent's metering: the sampler of the metering exporter, run inside the agent, and its registry.

Owns: starting :class:`vgpuhost.ops.metering.Sampler` in a thread of the
agent (the same sampler, rollups and host series as ``vgpuhost exporter``:
both set it up with :func:`vgpuhost.ops.metering.host_sampler`),
rendering its registry for ``GET /v1/metrics`` (every series: the admin
and read-only roles only), and an optional loopback TCP listener for
Prometheus (which scrapes HTTP over TCP, not unix sockets) that any local
user can reach: it serves the host-level series only unless the operator
asks for all (``--metrics-scope all``; :data:`vgpuhost.ops.exporter.SCOPES`).  Must not: hold metering logic (``ops/metering.py``,
``ops/exporter.py``).  Run either the agent's metering or ``vgpuhost
exporter`` on a host, not both: each integrates usage into the store.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Tuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..io.state import StateStore
from ..ops.exporter import DEFAULT_SCOPE, SnapshotCollector, listen
from ..ops.metering import host_sampler

log = logging.getLogger("vgpuhost.agent")


class AgentMetering:
    """The sampler thread and its prometheus-client registry (``interval_s`` seconds between readings)."""

    def __init__(self, host, interval_s: float):
        self.sampler = host_sampler(host, StateStore(host.state_dir, create=True), interval_s=interval_s)
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector(lambda: self.sampler.snapshot, interval_s)
        self.registry.register(self.collector)
        self._rendered: Tuple[object, bool, bytes] = (None, False, b"")
        self.stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self._tcp = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.sampler.run, args=(self.stop,), name="agent-metering",
                                       daemon=True)
        self.thread.start()

    def render(self) -> Tuple[str, bytes]:
        """``(content type, body)`` of the Prometheus text exposition, encoded once per sampler reading
        and ``vgpuhost_up`` value (what the registry holds changes with nothing else)."""
        snap = self.sampler.snapshot
        fresh = self.collector.fresh(snap)
        kept_snap, kept_fresh, body = self._rendered
        if kept_snap is not snap or kept_fresh != fresh or not body:
            body = generate_latest(self.registry)
            # (a reading taken while encoding: kept under the one read before, so encoded again next time)
            self._rendered = (snap, fresh, body)
        return CONTENT_TYPE_LATEST, body

    def listen_tcp(self, address: str, port: int, scope: str = DEFAULT_SCOPE) -> int:
        """Serve ``/metrics`` on ``address:port`` too (for Prometheus); the port bound.  ``scope``: which
        series that page holds (``host``: none naming a tenant, a domain or a device; ``all``: what
        ``GET /v1/metrics`` serves).  Raises OSError when it cannot bind."""
        registry = self.registry
        if scope != "all":
            registry = CollectorRegistry(auto_describe=False)
            registry.register(SnapshotCollector(lambda: self.sampler.snapshot, self.collector.interval_s, scope))
        server, _thread = listen(address, port, registry)
        self._tcp = server
        return server.server_address[1]

    def close(self) -> None:
        self.stop.set()
        if self._tcp is not None:
            self._tcp.shutdown()
            self._tcp.server_close()
        if self.thread is not None:
            self.thread.join(timeout=10)
