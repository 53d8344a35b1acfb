"""Metering end to end with Debian's real Prometheus and promtool.

- ``promtool check rules`` and ``promtool test rules`` on the shipped rules,
  with series fixtures for every rule (tests/data/metering/rules_test.yml);
- the exporter (``vgpuhost exporter``, a real process) on a simulated A40
  host with known load, scraped by a real ``prometheus`` on loopback with a
  temp data dir: a PromQL query gives per-tenant SM busy seconds within 2% of
  the integral of the simulated traces, and restarting the exporter mid-run
  neither loses nor counts twice in ``vgpuhost usage``.

Tenants come from the domains' vgpuhost metadata through libvirt's test
driver (a node file written by the test).  Without ``prometheus``/``promtool``
these tests skip, and fail under CI (``make dev`` installs them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from nsutil import skip_or_fail
from vgpuhost.io import state as st
from vgpuhost.io.backends import metering_nvml
from vgpuhost.io.files import data_path
from vgpuhost.io.state import StateStore
from vgpuhost.sim.metering import integral

REPO = Path(__file__).resolve().parents[1]
RULES = Path(data_path("metering", "rules.yml"))
DASHBOARD = Path(data_path("metering", "grafana-dashboard.json"))
RULES_TEST = REPO / "tests" / "data" / "metering" / "rules_test.yml"
DOMAINS = {  # name: (uuid, tenant)
    "alpha-1": ("a1a1a1a1-0000-4000-8000-000000000001", "alpha"),
    "alpha-2": ("a1a1a1a1-0000-4000-8000-000000000002", "alpha"),
    "beta-1": ("b2b2b2b2-0000-4000-8000-000000000001", "beta"),
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    skip_or_fail(None if path else f"{name} is not installed (apt-get install prometheus)", name)
    return path


def test_promtool_checks_and_tests_every_rule():
    promtool = _tool("promtool")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
    out = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True,
                         timeout=300, cwd=RULES_TEST.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    # every alert and recording rule has a fixture
    import yaml
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    tested = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a.get("exp_alerts")}
    recorded = {e["expr"] for t in tests for e in t.get("promql_expr_test", [])}
    for r in rules:
        if "alert" in r:
            assert r["alert"] in tested, f"no firing fixture for {r['alert']}"
        else:
            assert r["record"] in recorded, f"no fixture for {r['record']}"


def test_every_alert_links_its_runbook():
    """Each alert's runbook_url is its section of docs/guide/alerts.md under the docs site's address
    (mkdocs.yml's site_url), and that section exists."""
    import yaml
    site = yaml.safe_load((REPO / "mkdocs.yml").read_text())["site_url"]
    headings = set(re.findall(r"^## (\w+)$", (REPO / "docs" / "guide" / "alerts.md").read_text(), flags=re.M))
    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    for r in alerts:
        assert r["annotations"].get("runbook_url") == f"{site}guide/alerts/#{r['alert'].lower()}", r["alert"]
        assert r["alert"] in headings, f"docs/guide/alerts.md has no section for {r['alert']}"
    assert headings == {r["alert"] for r in alerts}, "sections for alerts that no longer exist"


def test_the_documented_dcgm_exporter_join_evaluates_on_both_exporters_series():
    """docs/metering.md's join with dcgm-exporter is the expression promtool evaluates in
    tests/data/metering/dcgm_join_test.yml (series labelled as each exporter labels them), and it passes."""
    import yaml
    promtool = _tool("promtool")
    fixture = RULES_TEST.parent / "dcgm_join_test.yml"
    doc = (REPO / "docs" / "metering.md").read_text()
    shown = doc.split("### Joining with dcgm-exporter", 1)[1].split("```\n", 2)[1]
    (case,) = yaml.safe_load(fixture.read_text())["tests"][0]["promql_expr_test"]
    assert case["expr"].strip() == shown.strip()
    out = subprocess.run([promtool, "test", "rules", str(fixture)], capture_output=True, text=True, timeout=120,
                         cwd=fixture.parent)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _wait(pred, what: str, budget: float = 60.0, step: float = 0.1):
    deadline = time.monotonic() + budget
    while True:
        try:
            value = pred()
            if value:
                return value
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


def _node_xml(path: Path) -> str:
    doms = []
    for name, (uuid, tenant) in DOMAINS.items():
        doms.append(f"""
  <domain type="test">
    <name>{name}</name>
    <uuid>{uuid}</uuid>
    <memory unit="MiB">64</memory>
    <vcpu>1</vcpu>
    <os><type arch="x86_64">hvm</type></os>
    <metadata>
      <vgpuhost:domain xmlns:vgpuhost="https://vgpuhost.dev/xmlns/domain/1" version="1" tenant="{tenant}"/>
    </metadata>
    <devices/>
  </domain>""")
    path.write_text("<node>" + "".join(doms) + "\n</node>\n")
    return f"test://{path}"


class Exporter:
    """``vgpuhost exporter`` as a process.  ``--max-hold 30``: at the default 10 s interval a
    sample may cover 60 s, so a restart within a minute loses nothing; at this test's 0.25 s
    interval a restart (a new Python process) takes longer than 6 intervals, so the test
    says what the default says at 10 s."""

    def __init__(self, root: Path, uri: str, port: int, log: Path):
        self.args = [sys.executable, "-m", "vgpuhost", "--root", str(root), "--connect", uri, "exporter",
                     "--port", str(port), "--interval", "0.25", "--max-hold", "30", "--metrics-scope", "all"]
        self.port = port
        self.log = log
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"),
                                     cwd=REPO)
        _wait(lambda: b"vgpuhost_up 1.0" in _get(f"http://127.0.0.1:{self.port}/metrics"), "the exporter")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _query(prom: str, expr: str, at: float = None) -> list:
    q = {"query": expr}
    if at is not None:
        q["time"] = f"{at:.3f}"
    doc = json.loads(_get(f"{prom}/api/v1/query?" + urllib.parse.urlencode(q)))
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


@pytest.mark.slow
def test_prometheus_scrapes_per_tenant_busy_seconds_across_an_exporter_restart(make_host, tmp_path, capsys):
    prometheus = _tool("prometheus")
    from vgpuhost.cli.main import main
    host = make_host("a40-mdev")
    devices = {}
    for name, (uuid, _tenant) in DOMAINS.items():
        assert main(["--root", str(host.root), "--json", "vgpu", "create", "--profile", "A40-8Q",
                     "--owner", uuid]) == 0
        devices[name] = json.loads(capsys.readouterr().out)
    store = StateStore(host.state_dir)
    # the operator binds each domain to its tenant: metering attributes by the binding, never by the XML
    from vgpuhost.ops import tenancy
    for t in sorted({t for _, t in DOMAINS.values()}):
        tenancy.add(store, tenancy.Tenant(t))
    for name, (uuid, t) in DOMAINS.items():
        tenancy.bind(store, uuid, t, name=name)
    by_owner = {r.owner: r.id for r in store.vgpu_records()}
    nv = metering_nvml(host)
    traces = {
        by_owner[DOMAINS["alpha-1"][0]]: {"sm": 50, "start": 0},
        by_owner[DOMAINS["alpha-2"][0]]: {"sm": {"square": {"high": 90, "low": 10, "period_s": 1.3}},
                                          "start": 0},
        by_owner[DOMAINS["beta-1"][0]]: {"sm": {"steps": [[0, 20], [2.5, 70], [5.0, 35]]}, "start": 0},
    }
    tenant_of = {by_owner[u]: t for (u, t) in DOMAINS.values()}

    uri = _node_xml(tmp_path / "node.xml")
    eport, pport = _free_port(), _free_port()
    exporter = Exporter(host.root, uri, eport, tmp_path / "exporter.log")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: vgpuhost
    scrape_interval: 500ms
    scrape_timeout: 400ms
    static_configs:
      - targets: ["127.0.0.1:{eport}"]
""")
    prom = subprocess.Popen([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{pport}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    base = f"http://127.0.0.1:{pport}"
    try:
        exporter.start()
        _wait(lambda: _get(f"{base}/-/ready") is not None, "prometheus", budget=120)
        _wait(lambda: _query(base, 'vgpuhost_up{job="vgpuhost"} == 1'), "a first scrape", budget=60)
        # the load starts once the sampler has seen every device (its first reading has no "before")
        start = nv.clock_us() / 1e6 + 0.5
        for dev, tr in traces.items():
            tr["start"] = start
            nv.set_trace(dev, tr)
        time.sleep(3.0)
        exporter.stop()                 # mid-run: the load goes on while it is down
        time.sleep(1.0)
        exporter.start()
        time.sleep(3.0)

        expr = ('sum by (tenant) (vgpuhost_device_sm_busy_seconds_total{job="vgpuhost"} '
                '* on (instance, vm_device) group_left (tenant) vgpuhost_device_info{job="vgpuhost"})')
        # the newest scrape: the counters and the sampler's clock come from it together
        last = _query(base, 'timestamp(vgpuhost_sampler_last_sample_timestamp_seconds{job="vgpuhost"})')
        at = float(last[0]["value"][1])
        (sample_t,) = [float(r["value"][1]) for r in
                       _query(base, 'vgpuhost_sampler_last_sample_timestamp_seconds{job="vgpuhost"}', at)]
        got = {r["metric"]["tenant"]: float(r["value"][1]) for r in _query(base, expr, at)}
        want = {}
        for dev, tr in traces.items():
            want[tenant_of[dev]] = want.get(tenant_of[dev], 0.0) + integral(tr, "sm", 0, sample_t) / 100
        assert set(got) == {"alpha", "beta"}
        for tenant in want:
            assert want[tenant] > 1.0
            assert got[tenant] == pytest.approx(want[tenant], rel=0.02), (tenant, got, want)
        # the restart shows in Prometheus as a counter that did not reset
        resets = _query(base, 'sum(resets(vgpuhost_device_sm_busy_seconds_total{job="vgpuhost"}[1m]))', at)
        assert float(resets[0]["value"][1]) == 0
        # every query of the shipped Grafana dashboard is valid PromQL, and the device ones find data
        dash = json.loads(DASHBOARD.read_text())
        for panel in dash["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$instance", ".*").replace("$tenant", ".*")
                result = _query(base, expr, at)
                if "device_" in expr and "encoder" not in expr and "gpu_instance" not in expr:
                    assert result, (panel["title"], expr)
    finally:
        exporter.stop()
        prom.terminate()
        try:
            prom.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()

    # vgpuhost usage: exactly the integral up to the last sample, no loss, no double count
    conn = StateStore(host.state_dir)
    cursors = st.meter_cursors(conn)
    assert main(["--root", str(host.root), "--json", "usage", "--by", "tenant"]) == 0
    doc = json.loads(capsys.readouterr().out)
    usage = {r["tenant"]: r for r in doc["rows"]}
    want = {}
    for dev, tr in traces.items():
        t_end = cursors[dev][2] / 1e6
        want[tenant_of[dev]] = want.get(tenant_of[dev], 0.0) + integral(tr, "sm", 0, t_end) / 100
    for tenant, w in want.items():
        assert usage[tenant]["sm_busy_seconds"] == pytest.approx(w, abs=2e-3), (tenant, usage, want)
    assert usage["alpha"]["devices"] == 2 and usage["beta"]["devices"] == 1
    assert doc["gaps"] == []
    # allocation ran on through the restart: every device was credited the same span
    allocs = [sum(r[9] for r in st.usage_rows(conn) if r[1] == dev) for dev in traces]
    assert max(allocs) - min(allocs) < 0.5 and min(allocs) > 6.0
