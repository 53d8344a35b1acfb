"""The fleet view: a real Prometheus scrapes three agents on three simulated hosts, on loopback ports.

Each agent runs its metering sampler and serves ``/metrics`` on a loopback
TCP port (``--metrics-port``); Debian's ``prometheus`` scrapes the three
every 500 ms, naming them ``h1``, ``h2``, ``h3`` (the ``instance`` label).
``vgpuhost fleet place`` then reads Prometheus's HTTP API: it picks the host
with room under each strategy, respects a tenant's quota, and skips a host
whose agent was stopped.  Without prometheus the test is skipped, except in
CI (``CI=true``) where it fails.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from agentutil import AgentRun
from test_metering_prometheus import _free_port, _get, _tool, _wait
from vgpuhost.cli.main import main as cli_main
from vgpuhost.io.promquery import query


def _place(capsys, url: str, *args: str) -> dict:
    rc = cli_main(["--json", "fleet", "place", "--prometheus", url, "--profile", "A40-8Q", *args])
    doc = json.loads(capsys.readouterr().out)
    assert rc == (0 if doc["hosts"] else 1)
    return doc


def test_fleet_place_picks_by_strategy_respects_quotas_and_skips_a_stopped_agent(make_host, tmp_path, capsys):
    prometheus = _tool("prometheus")
    hosts = [make_host("a40-mdev") for _ in range(3)]
    # h2 already holds three A40-8Q: 3 free there, 6 on h1 and h3
    for _ in range(3):
        assert cli_main(["--root", str(hosts[1].root), "vgpu", "create", "--profile", "A40-8Q"]) == 0
    # on h1, tenant t1 may hold no vGPU at all
    assert cli_main(["--root", str(hosts[0].root), "tenant", "add", "t1", "--vgpus", "0"]) == 0
    capsys.readouterr()
    ports = [_free_port() for _ in hosts]
    agents = []
    prom = None
    try:
        for h, port in zip(hosts, ports):
            agents.append(AgentRun(h.root, extra=["--metering-interval", "0.5", "--metrics-port", str(port), "--metrics-scope", "all"]))
        pport = _free_port()
        cfg = tmp_path / "prometheus.yml"
        targets = "\n".join(f'      - targets: ["127.0.0.1:{p}"]\n        labels: {{instance: h{i}}}'
                            for i, p in enumerate(ports, 1))
        cfg.write_text(f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: vgpuhost
    scrape_interval: 500ms
    scrape_timeout: 400ms
    static_configs:
{targets}
""")
        prom = subprocess.Popen([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{pport}", "--log.level=warn"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
        url = f"http://127.0.0.1:{pport}"
        _wait(lambda: _get(f"{url}/-/ready") is not None, "prometheus", budget=120)
        _wait(lambda: len(query(url, 'vgpuhost_free_instances{profile="A40-8Q"}')) == 3, "three hosts' series",
              budget=120)
        _wait(lambda: len(query(url, "vgpuhost_tenant_quota_limit")) >= 1, "h1's tenant quota", budget=60)

        assert _place(capsys, url)["chosen"] == "h1"
        best = _place(capsys, url, "--strategy", "best-fit")
        assert best["chosen"] == "h2" and [h["free"] for h in best["hosts"]] == [3, 6, 6]
        assert _place(capsys, url, "--strategy", "spread")["chosen"] == "h1"
        # the tenant's quota on h1 leaves it out for t1
        t1 = _place(capsys, url, "--tenant", "t1")
        assert t1["chosen"] == "h2" and t1["skipped"][0]["instance"] == "h1"
        assert "tenant t1" in t1["skipped"][0]["why"]

        assert cli_main(["--json", "fleet", "capacity", "--prometheus", url, "--profile", "A40-8Q"]) == 0
        cap = json.loads(capsys.readouterr().out)
        assert cap["profiles"][0]["by_host"] == {"h1": 6, "h2": 3, "h3": 6}

        # stop h1's agent: its scrape goes down and it is skipped
        agents[0].stop()
        _wait(lambda: query(url, 'up{instance="h1"} == 0'), "h1's scrape to fail", budget=60)
        after = _place(capsys, url)
        assert after["chosen"] == "h2"
        assert {"instance": "h1", "why": "its scrape is down (up == 0)"} in after["skipped"]
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        for a in agents:
            a.close()


def test_fleet_place_with_no_prometheus_is_one_line_exit_2(capsys):
    port = _free_port()
    rc = cli_main(["fleet", "place", "--prometheus", f"http://127.0.0.1:{port}", "--profile", "A40-8Q"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("vgpuhost: error: cannot query Prometheus") and err.count("\n") == 1
