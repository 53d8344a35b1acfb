"""A start killed after it recorded its domain and before it made a device (trial 4 finding 29).

The qemu hook's ``prepare begin`` records the domain as running (its ``domains`` row and its marker, with
the process ID that started it) before it makes anything; kill -9 there leaves both while the domain holds
nothing, and libvirt runs no ``release end`` for a start that never began.  ``reconcile --check`` reports
such a domain (exit 1) and ``reconcile`` forgets it, audited; a domain whose start may still run (its
process alive), one that holds a device, and one libvirt lists running are left alone.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from vgpuhost.cli.main import main
from vgpuhost.hook import runtime as hook
from vgpuhost.io.state import MARKER_DIR, StateStore
from vgpuhost.ops import recover

from test_gpu_health import vm


def _killed_after_recording(host, name: str, xml: str) -> int:
    """Run ``prepare begin`` in a fresh process that kills itself (SIGKILL) right after the domain is recorded
    running, before anything is admitted or made; the child's pid.  A new interpreter, not a fork: a fork of
    this worker would copy the locks its other threads hold (an earlier test's agent or libvirt loop)."""
    code = textwrap.dedent(f"""\
        import io, os, signal, sys
        sys.path.insert(0, {str(Path(hook.__file__).parents[2])!r})
        from vgpuhost.hook import runtime as hook
        from vgpuhost.io.hostroot import HostRoot
        from vgpuhost.ops import admitting

        def killed(*a, **kw):
            os.kill(os.getpid(), signal.SIGKILL)
        admitting.unenforced_admitting = killed
        hook.main([{name!r}, "prepare", "begin", "-"], io.BytesIO(sys.stdin.buffer.read()), io.StringIO(),
                  host=HostRoot({str(host.root)!r}, {str(host.state_dir)!r}))
        os._exit(4)
        """)
    env = dict(os.environ, VGPUHOST_AGENT="off")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=env)
    proc.communicate(xml.encode(), timeout=120)
    assert proc.returncode == -signal.SIGKILL
    return proc.pid


def _cli(capsys, host, *argv):
    code = main(["--root", str(host.root), "--local", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_start_killed_after_recording_its_domain_is_reported_and_forgotten(make_host, capsys):
    host = make_host("a40-mdev")
    s = StateStore(host.state_dir)
    name, dev, xml = vm("killed", 1)
    pid = _killed_after_recording(host, name, xml)
    [(uuid, recorded)] = s.active_domains().items()
    marker = os.path.join(str(host.state_dir), MARKER_DIR, uuid)
    assert recorded == name and os.path.exists(marker) and s.domain_starter(uuid) == pid
    assert s.vgpu_records() == [] and s.allocation_rows() == []               # it holds nothing
    code, doc = _cli(capsys, host, "--json", "reconcile", "--check")[:2]
    doc = json.loads(doc)
    assert code == 1 and doc["in_sync"] is False and len(doc["stale_domains"]) == 1
    assert f"killed ({uuid})" in doc["stale_domains"][0] and f"(pid {pid}) is gone" in doc["stale_domains"][0]
    code, out, err = _cli(capsys, host, "reconcile", "--check")
    assert code == 1 and "stale domain: killed" in out and "NOT in sync" in out
    assert s.active_domains() == {uuid: name} and os.path.exists(marker)    # --check changed nothing
    code, out, err = _cli(capsys, host, "reconcile")
    assert code == 0 and f"forgotten domain: killed ({uuid})" in out
    assert s.active_domains() == {} and not os.path.exists(marker)
    assert [(r.operation, r.path, r.result) for r in s.audit_rows() if r.path.startswith("(domain)")] == [
        ("reconcile", f"(domain) {uuid}", "forgotten")]
    code, out, err = _cli(capsys, host, "reconcile", "--check")
    assert code == 0 and "in sync" in out


def test_a_start_that_may_still_run_one_that_holds_a_device_and_one_libvirt_runs_are_left_alone(make_host):
    host = make_host("a40-mdev")
    s = StateStore(host.state_dir)
    from test_hook import start
    name, dev, xml = vm("running", 2)
    assert start(host, name, xml)[0] == 0               # a real start: it holds its vGPU
    uuid = next(iter(s.active_domains()))
    assert s.vgpu_records(owner=uuid)
    s.domain_started("0d0d0d0d-0000-4000-8000-000000000001", "starting")     # this process: still starting
    assert recover.stale_domains(s) == []
    # an old marker without a process ID: over only once a start cannot run any more
    legacy = "0d0d0d0d-0000-4000-8000-000000000002"
    s.domain_started(legacy, "legacy")
    with open(os.path.join(str(host.state_dir), MARKER_DIR, legacy), "w"):
        pass
    assert recover.stale_domains(s) == []
    since = s.domain_starts()[legacy]
    from datetime import datetime
    later = datetime.fromisoformat(since).timestamp() + recover.START_BOUND_S + 1
    assert [d["domain"] for d in recover.stale_domains(s, now_s=later)] == [legacy]
    # libvirt's view, where it answers, decides: listed active -> left alone; not listed -> stale
    assert [d["domain"] for d in recover.stale_domains(s, frozenset({legacy, uuid}))] == [
        "0d0d0d0d-0000-4000-8000-000000000001"]


def test_the_agents_reconcile_asks_libvirt_at_its_own_uri(make_host):
    """``POST /v1/reconcile`` asks libvirt at the agent's ``--libvirt-uri`` which domains run (libvirt's test
    driver, ``test:///default``, lists one, ``test``, running): a killed start whose domain libvirt lists
    running is kept, another one is forgotten."""
    from vgpuhost.agent import api
    host = make_host("a40-mdev")
    s = StateStore(host.state_dir)
    listed = "6695eb01-f6a4-8304-79aa-97f2502e193f"          # test:///default's domain 'test'
    name, _, xml = vm("listed", 1)
    xml = xml.replace(f"<uuid>{name_uuid(xml)}</uuid>", f"<uuid>{listed}</uuid>")
    _killed_after_recording(host, name, xml)
    gone_name, _, gone_xml = vm("gone", 2)
    _killed_after_recording(host, gone_name, gone_xml)
    gone = name_uuid(gone_xml)
    assert s.active_domains() == {listed: "listed", gone: "gone"}
    agent = api.Agent(host, "test:///default")
    req = api.Request({}, {}, {"check": True}, "test", os.getpid())
    doc = api.post_reconcile(agent, req)
    assert [line.split(" ")[0] for line in doc["stale_domains"]] == ["gone"]
    doc = api.post_reconcile(agent, req._replace(body={"check": False}))
    assert s.active_domains() == {listed: "listed"}
    assert [r.path for r in s.audit_rows() if r.path.startswith("(domain)")] == [f"(domain) {gone}"]
    # the same store seen without libvirt (a URI nothing answers at): the store's view, so it is stale now
    doc = api.post_reconcile(api.Agent(host, "test:///nonexistent.xml"), req)
    assert [line.split(" ")[0] for line in doc["stale_domains"]] == ["listed"]


def test_the_agents_reconcile_at_start_asks_libvirt_at_its_own_uri(make_host):
    """The reconcile an agent runs before it serves (``server.recover_at_start``) asks libvirt at the
    agent's ``--libvirt-uri`` too: a killed start whose domain libvirt lists running is kept (it asked
    nobody before, and forgot both); one nothing answers at keeps both, reported stale (trial 7 F7)."""
    from vgpuhost.agent import api, server
    host = make_host("a40-mdev")
    s = StateStore(host.state_dir)
    listed = "6695eb01-f6a4-8304-79aa-97f2502e193f"          # test:///default's domain 'test'
    name, _, xml = vm("listed", 1)
    _killed_after_recording(host, name, xml.replace(f"<uuid>{name_uuid(xml)}</uuid>", f"<uuid>{listed}</uuid>"))
    gone_name, _, gone_xml = vm("gone", 2)
    _killed_after_recording(host, gone_name, gone_xml)
    gone = name_uuid(gone_xml)
    # libvirt not answering (a URI nothing answers at: libvirtd restarting as the agent starts): both kept,
    # reported stale, the URI named (trial 7 F7: they were forgotten by the store's view, silently)
    out = server.recover_at_start(api.Agent(host, "test:///nonexistent.xml"))
    assert s.active_domains() == {listed: "listed", gone: "gone"}, out
    rec = out["reconcile"]
    assert rec["libvirt_unasked"] == "test:///nonexistent.xml" and rec["forgotten_domains"] == []
    assert sorted(line.split(" ")[0] for line in rec["stale_domains"]) == ["gone", "listed"]
    out = server.recover_at_start(api.Agent(host, "test:///default"))
    assert "error" not in out and s.active_domains() == {listed: "listed"}, out
    assert [line.split(" ")[0] for line in out["reconcile"]["forgotten_domains"]] == ["gone"]
    assert out["reconcile"]["libvirt_unasked"] is None


def name_uuid(xml: str) -> str:
    return xml.split("<uuid>", 1)[1].split("</uuid>", 1)[0]
