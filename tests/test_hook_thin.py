"""The qemu hook's thin client: with the agent up, the sh dispatcher hands the call to it with curl.

Real processes throughout: the installed dispatcher run as libvirt runs it
(minimal environment, XML on stdin), a real ``vgpuhost agent`` on real unix
sockets, and outcomes read back from the simulated tree, the state store
and the agent's own counters.  A hook installed with an interpreter that
does not exist proves that no Python starts: it can only succeed through
the agent.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from contextlib import nullcontext
from pathlib import Path

import pytest

from agentutil import AgentRun
from test_hook import DOM1, MDEV1, audit, dispatch, mdevs, store, vgpu_domain
from vgpuhost.hook.install import install as hook_install

pytestmark = pytest.mark.skipif(shutil.which("curl") is None and os.environ.get("CI") != "true",
                                reason="needs curl (CI=true fails instead)")

NO_PYTHON = "/nonexistent/vgpuhost-test/python3"


def _install(host, tmp_path, **kw) -> Path:
    return Path(hook_install(host, hooks_dir=tmp_path / "qemu.d", **kw).path)


def _sock_dir(host) -> str:
    return str(host.path("run", "vgpuhost"))


def test_agent_up_no_python_starts(make_host, tmp_path):
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, python=NO_PYTHON)
    assert "for d in /usr/bin /bin /usr/local/bin; do" in hook.read_text()
    xml = vgpu_domain("thin1", DOM1, MDEV1).encode()
    with AgentRun(host.root, _sock_dir(host)) as agent:
        proc = dispatch(hook, ["thin1", "prepare", "begin", "-"], xml)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b""), proc.stderr
        assert mdevs(host) == {MDEV1: "nvidia-566"}
        assert [r.owner for r in store(host).vgpu_records()] == [DOM1]
        assert DOM1 in store(host).active_domains()
        proc = dispatch(hook, ["thin1", "release", "end", "-"], xml)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {}
        info = agent.call("GET", "/v1/agent")[1]
    assert info["served_thin_client"] == {"POST /v1/hook/prepare": 1, "POST /v1/hook/release": 1}
    assert store(host).vgpu_records() == [] and store(host).active_domains() == {}
    # the same audit trail as the hook's own path: actor 'hook NAME', the writes and the placement
    rows = [r for r in audit(host) if r.actor.startswith("hook thin1")]
    assert {r.path.rsplit("/", 1)[-1] for r in rows} >= {"create", "remove", "(placement)"}
    # agent down: the dispatcher falls back to the interpreter, which this install does not have
    proc = dispatch(hook, ["thin1", "prepare", "begin", "-"], xml)
    assert proc.returncode == 127 and mdevs(host) == {}


def test_agent_refusal_is_the_hooks_own_line_and_exit_code(make_host, tmp_path):
    host = make_host("a40-mdev")
    xml = vgpu_domain("thin-bad", DOM1, MDEV1, "A40-7Q").encode()
    local = dispatch(_install(host, tmp_path / "local"), ["thin-bad", "prepare", "begin", "-"], xml)
    assert local.returncode == 2 and b"unknown vGPU profile 'A40-7Q'" in local.stderr
    # trial 10b B3: two <name> elements, the second another domain's: the handler names libvirt's (argv)
    two = vgpu_domain("thin-two", DOM1, MDEV1).replace("<name>thin-two</name>",
                                                       "<name>thin-two</name><name>forged</name>").encode()
    local_two = dispatch(_install(host, tmp_path / "local"), ["thin-two", "prepare", "begin", "-"], two)
    assert local_two.returncode == 2 and local_two.stderr == (
        b"vgpuhost: error: domain 'thin-two': domain XML has more than one <name>; libvirt writes one; pass the "
        b"document 'virsh dumpxml NAME' prints\n"), local_two.stderr
    hook = _install(host, tmp_path, python=NO_PYTHON)
    with AgentRun(host.root, _sock_dir(host)) as agent:
        proc = dispatch(hook, ["thin-bad", "prepare", "begin", "-"], xml)
        # not well-formed XML: the name comes from argv, as when the hook parses it itself
        broken = dispatch(hook, ["argv-name", "prepare", "begin", "-"],
                          b"<domain><metadata xmlns:v='https://vgpuhost.dev/xmlns/domain/1'>")
        agent_two = dispatch(hook, ["thin-two", "prepare", "begin", "-"], two)
        served = agent.call("GET", "/v1/agent")[1]["served_thin_client"]
    assert (proc.returncode, proc.stdout, proc.stderr) == (local.returncode, b"", local.stderr)
    assert broken.returncode == 2 and broken.stderr.startswith(b"vgpuhost: error: domain 'argv-name': domain XML ")
    assert broken.stderr.count(b"\n") == 1
    assert (agent_two.returncode, agent_two.stderr) == (2, local_two.stderr)
    assert served == {"POST /v1/hook/prepare": 3}
    assert mdevs(host) == {} and store(host).active_domains() == {}


def test_no_agent_a_dead_socket_or_another_roots_agent_fall_back_to_the_handler(make_host, tmp_path):
    host, other = make_host("a40-mdev"), make_host("a40-mdev")
    hook = _install(host, tmp_path)
    xml = vgpu_domain("fb", DOM1, MDEV1).encode()

    def start_stop() -> None:
        proc = dispatch(hook, ["fb", "prepare", "begin", "-"], xml)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {MDEV1: "nvidia-566"}
        proc = dispatch(hook, ["fb", "release", "end", "-"], xml)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {}
    start_stop()                                    # no socket at all
    # a socket file nobody listens on (an agent killed with -9)
    sdir = host.path("run", "vgpuhost")
    sdir.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(sdir / "agent.sock"))
    dead.close()
    start_stop()
    os.unlink(sdir / "agent.sock")
    # an agent serving another host root answers 421: the handler does the work on this root
    with AgentRun(other.root, str(sdir)) as agent:
        start_stop()
        info = agent.call("GET", "/v1/agent")[1]
    assert info["served_thin_client"] == {"POST /v1/hook/prepare": 1, "POST /v1/hook/release": 1}
    assert mdevs(other) == {} and store(other).vgpu_records() == [] and store(other).active_domains() == {}
    assert store(host).vgpu_records() == [] and store(host).active_domains() == {}


@pytest.mark.parametrize("reason", ["failed", "shutdown", "crashed"])
def test_release_end_takes_the_shutoff_reason_as_its_extra_argument(make_host, tmp_path, reason):
    """Since libvirt 10.5 'release end' gets the shutoff reason, not '-', as its extra argument
    (docs/reference/libvirt.md#hooks): the release is the same, through the handler and the agent."""
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path)
    xml = vgpu_domain("why", DOM1, MDEV1).encode()
    for agent_up in (False, True):
        with AgentRun(host.root, _sock_dir(host)) if agent_up else nullcontext():
            proc = dispatch(hook, ["why", "prepare", "begin", "-"], xml)
            assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {MDEV1: "nvidia-566"}
            proc = dispatch(hook, ["why", "release", "end", reason], xml)
            assert (proc.returncode, proc.stderr) == (0, b""), proc.stderr
            assert mdevs(host) == {} and store(host).vgpu_records() == [] and store(host).active_domains() == {}


def test_warm_snapshot_a_domain_start_waits_for_no_host_scan(make_host, tmp_path):
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, python=NO_PYTHON)
    xml = vgpu_domain("warm", DOM1, MDEV1).encode()
    with AgentRun(host.root, _sock_dir(host)) as agent:
        assert agent.call("GET", "/v1/inventory")[0] == 200          # the snapshot is read once
        waits = agent.call("GET", "/v1/agent")[1]["snapshot_waits"]
        for _ in range(3):
            assert dispatch(hook, ["warm", "prepare", "begin", "-"], xml).returncode == 0
            assert dispatch(hook, ["warm", "release", "end", "-"], xml).returncode == 0
            # the agent re-read the host after answering each change (before the next call can arrive)
            _until_warm(agent)
        info = agent.call("GET", "/v1/agent")[1]
    assert info["snapshot_waits"] == waits, info
    # each change's GPU read again after answering (a refresh), or the whole host (a scan)
    assert info["snapshot_scans"] + info["snapshot_refreshes"] >= 1 + 6 - 1
    assert mdevs(host) == {}


def _until_warm(agent) -> None:
    import time
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        def reads():
            doc = agent.call("GET", "/v1/agent")[1]
            return doc["snapshot_scans"] + doc["snapshot_refreshes"]
        before = reads()
        time.sleep(0.05)
        if reads() == before:
            return
    raise AssertionError("the agent kept scanning")


def test_curl_missing_at_install_the_handler_talks_to_the_agent(make_host, tmp_path):
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, curl=False)
    assert "for d in ; do" in hook.read_text()
    xml = vgpu_domain("nocurl", DOM1, MDEV1).encode()
    with AgentRun(host.root, _sock_dir(host)) as agent:
        proc = dispatch(hook, ["nocurl", "prepare", "begin", "-"], xml)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {MDEV1: "nvidia-566"}
        proc = dispatch(hook, ["nocurl", "release", "end", "-"], xml)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {}
        info = agent.call("GET", "/v1/agent")[1]
    assert info["served"]["POST /v1/hook/prepare"] == 1 and info["served_thin_client"] == {}


def test_agent_answers_the_xml_form_and_refuses_another_root_as_json(make_host, tmp_path):
    """The endpoint itself, with curl as the dispatcher runs it."""
    host = make_host("a40-mdev")
    xml = vgpu_domain("form", DOM1, MDEV1)
    with AgentRun(host.root, _sock_dir(host)) as agent:
        def curl(*headers: str) -> subprocess.CompletedProcess:
            hs = [a for h in headers for a in ("-H", h)]
            return subprocess.run(["curl", "-s", "-w", "\n%{http_code} %{content_type}", "--unix-socket",
                                   agent.admin, "-H", "Content-Type: application/xml", *hs, "--data-binary", "@-",
                                   "http://vgpuhost-agent/v1/hook/prepare"], input=xml.encode(),
                                  capture_output=True, timeout=120)
        wrong = curl(f"X-Vgpuhost-Root: {tmp_path}", "X-Vgpuhost-Domain: form")
        assert wrong.stdout.endswith(b"\n421 application/json") and mdevs(host) == {}
        right = curl(f"X-Vgpuhost-Root: {host.root}", f"X-Vgpuhost-State-Dir: {host.state_dir}")
        assert right.stdout == b"vgpuhost-hook/1 0\n200 text/plain; charset=utf-8", right.stdout
        assert mdevs(host) == {MDEV1: "nvidia-566"}
