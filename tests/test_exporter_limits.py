"""The metrics port on a shared host: who may read what (trial 9 F6) and what one local user may hold (F14).

Any local user can connect to a loopback TCP port (no peer credentials), so the page served there holds
the host-level series only unless the operator asks for every series (``--metrics-scope all``); the agent's
``GET /v1/metrics`` on its unix sockets (admin and read-only roles) serves them all (tests/test_agent.py).
The port serves at most ``max_connections`` at once (429 beyond, logged as one line per interval), closes a
request that has not all arrived within :data:`SCRAPE_TIMEOUT_S`, however it paces its bytes, and writes
no traceback for a connection that ends early.
"""

from __future__ import annotations

import logging
import re
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from test_metering import DOM_A, DOM_B, loaded  # noqa: F401  (the fixture: two tenant domains' vGPUs metered)
from vgpuhost.ops import exporter
from vgpuhost.ops.exporter import SnapshotCollector, TENANT_LABELS, listen
from vgpuhost.ops.metering import Sampler


def _page(sampler, scope):
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(lambda: sampler.snapshot, 10, scope))
    return generate_latest(reg).decode()


def test_the_host_scope_page_names_no_tenant_domain_or_device(loaded):   # noqa: F811
    host, store, nv, recs, _traces = loaded
    s = Sampler(nv, store, interval_s=10)
    s.tick()
    nv.advance(10)
    s.tick()
    full, hosted = _page(s, "all"), _page(s, "host")
    assert DOM_A in full and recs[DOM_A] in full and "vgpuhost_device_allocated_seconds_total{" in full
    for secret in (DOM_A, DOM_B, recs[DOM_A], recs[DOM_B], "vgpuhost_device_", "vgpuhost_tenant_"):
        assert secret not in hosted, secret
    labels = set(re.findall(r'[{,]([a-zA-Z_]+)="', hosted))
    assert labels and not labels & TENANT_LABELS, labels
    # the host's own figures are there, as in the full page
    for line in ("vgpuhost_up 1.0", 'vgpuhost_gpu_info{', "vgpuhost_sampler_errors_total"):
        assert line in hosted and line in full, line
    with pytest.raises(ValueError):
        SnapshotCollector(lambda: s.snapshot, 10, "tenants")


def test_the_exporter_serves_the_host_scope_on_tcp_unless_asked(loaded):   # noqa: F811
    """``serve`` (what ``vgpuhost exporter`` runs; the CLI's and the agent's --metrics-scope default to
    host, as the packaged units run them) serves no tenant's series on TCP unless asked for all."""
    import threading
    from vgpuhost.cli.agent import agent_cmd
    from vgpuhost.cli.metering import exporter as exporter_cmd
    for cmd in (exporter_cmd, agent_cmd):
        assert next(p for p in cmd.params if p.name == "metrics_scope").default == "host"
    host, store, nv, recs, _traces = loaded
    for kw, shown in (({}, False), ({"scope": "all"}, True)):
        s = Sampler(nv, store, interval_s=10)
        stop, bound = threading.Event(), []
        t = threading.Thread(target=exporter.serve, args=(s,), daemon=True,
                             kwargs=dict(port=0, stop=stop, ready=bound.append, **kw))
        t.start()
        try:
            deadline = time.monotonic() + 60
            while not bound or s.snapshot.time_us == 0:
                assert time.monotonic() < deadline and t.is_alive()
                time.sleep(0.02)
            with urllib.request.urlopen(f"http://127.0.0.1:{bound[0]}/metrics", timeout=30) as r:
                page = r.read().decode()
        finally:
            stop.set()
            t.join(30)
        assert "vgpuhost_gpu_info{" in page
        assert (recs[DOM_A] in page) == shown and (DOM_A in page) == shown, (kw, page[:400])


def _registry():
    reg = CollectorRegistry()
    Gauge("vgpuhost_test_up", "a gauge", registry=reg).set(1)
    return reg


def test_the_metrics_port_serves_a_bounded_number_of_connections_and_logs_a_storm_as_one_line(caplog, capfd):
    srv, thread = listen("127.0.0.1", 0, _registry(), max_connections=4)
    port = srv.server_address[1]
    held = []
    try:
        for _ in range(4):              # four slow clients take every slot (accepted first: one accept loop)
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            c.sendall(b"G")
            held.append(c)
        with caplog.at_level(logging.WARNING, logger="vgpuhost.exporter"):
            answers = []
            for _ in range(40):
                c = socket.create_connection(("127.0.0.1", port), timeout=10)
                c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                answers.append(c.makefile("rb").read())
                c.close()
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
            assert e.value.code == 429
        assert all(a.startswith(b"HTTP/1.1 429 ") and b"too many connections" in a for a in answers)
        assert srv.refusals.refused == 41
        storm = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(storm) == 1 and "at most 4 connections" in storm[0].getMessage(), storm
        for c in held:                                     # the slots come back once they are closed
            c.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                    assert b"vgpuhost_test_up 1.0" in r.read()
                break
            except urllib.error.HTTPError as e:
                assert e.code == 429 and time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)
    assert "Traceback" not in capfd.readouterr().err


def test_a_request_paced_slowly_is_closed_at_its_deadline_without_a_traceback(monkeypatch, capfd):
    """A byte every 0.1 s never trips a per-recv timeout; the whole request's deadline closes it."""
    monkeypatch.setattr(exporter, "SCRAPE_TIMEOUT_S", 0.5)
    srv, thread = listen("127.0.0.1", 0, _registry(), max_connections=2)
    try:
        c = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=10)
        closed = False
        for b in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"x" * 200:      # 20 s of trickle at most
            try:
                c.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            c.setblocking(False)
            try:
                if c.recv(1) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            finally:
                c.setblocking(True)
        c.close()
        assert closed, "the slow request was never closed"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)
    assert "Traceback" not in capfd.readouterr().err
