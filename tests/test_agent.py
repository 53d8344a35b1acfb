"""The vgpuhost agent over real unix sockets: roles, the API document, concurrency, socket activation.

Every agent runs as its own process (``vgpuhost --root R agent``) on a
simulated host; clients are real processes connecting to its sockets
(the permission tests drop to throwaway uids and gids).  Outcomes are read
back from the simulated sysfs tree, the state store and the audit log.
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid as uuidlib
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

from agentutil import (ADMIN_GID, ADMIN_UID, OTHER_GID, OTHER_UID, RO_GID, RO_UID, REPO, AgentRun, as_user,
                       socket_dir)
from test_hook import vgpu_domain
from vgpuhost.agent import api
from vgpuhost.io import agentclient, unixsock
from vgpuhost.io.files import data_path
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.observe.inventory import discover

DOM = "11111111-2222-4333-8444-0000000000a1"
MDEV = "aaaaaaaa-2222-4333-8444-0000000000a1"
MANUAL = "aaaaaaaa-2222-4333-8444-0000000000c3"
SPEC = REPO / "vgpuhost" / "agent" / "openapi.yaml"


def mdevs(host) -> Dict[str, str]:
    """mdev UUID -> type id, from the simulated tree."""
    return {m.uuid: m.type_id for m in discover(Sysfs(host), with_types=False).mdevs}


def records(host) -> Dict[str, Any]:
    return {r.id: r for r in StateStore(host.state_dir, create=False).vgpu_records()}


@pytest.fixture
def a40(make_host):
    return make_host("a40-mdev")


@pytest.fixture
def agent(a40):
    with AgentRun(a40.root) as run:
        yield run


# ---------------------------------------------------------------------------
# roles: SO_PEERCRED and the socket files

def _allocate(path: str, dom: str) -> tuple:
    return (path, "POST", f"/v1/domains/{dom}/allocate", {"profile": "A40-8Q"})


def test_sockets_are_0660_with_their_groups(agent):
    for path, gid in ((agent.admin, ADMIN_GID), (agent.ro, RO_GID)):
        st = os.stat(path)
        assert (st.st_mode & 0o777, st.st_gid, st.st_uid) == (0o660, gid, 0)
    # the tenant socket: anyone connects, the credentials decide (tests/test_agent_tenants.py)
    st = os.stat(os.path.join(agent.dir, "agent-tenant.sock"))
    assert (st.st_mode & 0o777, st.st_gid, st.st_uid) == (0o666, 0, 0)


def test_read_only_group_reads_but_cannot_allocate_and_others_are_refused(agent, a40):
    dom2 = str(uuidlib.uuid4())
    ro_calls = [(agent.ro, "GET", "/v1/inventory", None), (agent.ro, "GET", "/v1/vgpus", None),
                _allocate(agent.ro, DOM), (agent.admin, "GET", "/v1/inventory", None), _allocate(agent.admin, DOM)]
    # the read-only group: reads on its socket; no allocate there; the admin socket's file keeps it out
    assert as_user(RO_UID, RO_GID, [], ro_calls) == [200, 200, 403, "EACCES", "EACCES"]
    # supplementary membership counts the same (read from /proc/<pid>/status)
    assert as_user(RO_UID, OTHER_GID, [RO_GID], ro_calls[:3]) == [200, 200, 403]
    # anyone else: neither socket file lets it connect
    other = [(agent.ro, "GET", "/v1/inventory", None), _allocate(agent.admin, DOM)]
    assert as_user(OTHER_UID, OTHER_GID, [], other) == ["EACCES", "EACCES"]
    # a member of the admin group (supplementary) may allocate on the admin socket
    assert as_user(ADMIN_UID, OTHER_GID, [ADMIN_GID], [_allocate(agent.admin, dom2)]) == [200]
    assert [r.owner for r in records(a40).values()] == [dom2]
    assert list(mdevs(a40)) == list(records(a40))


def test_peer_credentials_refuse_even_when_the_socket_files_do_not(agent, a40):
    """With both sockets loosened to 0666, the agent's own check (SO_PEERCRED) still decides."""
    for path in (agent.admin, agent.ro):
        os.chmod(path, 0o666)
    other = [(agent.ro, "GET", "/v1/inventory", None), (agent.admin, "GET", "/v1/inventory", None),
             _allocate(agent.admin, DOM)]
    assert as_user(OTHER_UID, OTHER_GID, [], other) == [403, 403, 403]
    # the read-only group on the admin socket: still read-only
    assert as_user(RO_UID, RO_GID, [], other) == [200, 200, 403]
    assert records(a40) == {} and mdevs(a40) == {}
    status, doc = agent.call("GET", "/v1/audit")
    assert status == 200 and doc["rows"] == []          # nothing was written, not even a refusal's intent


def test_roles_are_reported(agent):
    assert agent.call("GET", "/v1/agent")[1]["role"] == "admin"
    assert agent.call("GET", "/v1/agent", ro=True)[1]["role"] == "read"


# ---------------------------------------------------------------------------
# the API document against the served endpoints

def _nullable(node):
    """OpenAPI 3.0's ``nullable`` as JSON Schema (``type: [T, "null"]``)."""
    if isinstance(node, dict):
        out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
        if node.get("nullable") and "type" in out:
            out["type"] = [out["type"], "null"]
        return out
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    return node


def _validate(doc: dict, spec: dict, schema: dict, instance) -> None:
    import jsonschema
    jsonschema.validate(instance, {"allOf": [_nullable(schema)], "components": _nullable(spec["components"])})


def _response_schema(spec: dict, op: dict, status: int):
    responses = op["responses"]
    resp = responses.get(str(status)) or responses["default"]
    if "$ref" in resp:
        resp = spec["components"]["responses"][resp["$ref"].rsplit("/", 1)[1]]
    content = resp["content"]
    ctype, media = next(iter(content.items()))
    return ctype, media["schema"]


def test_every_served_path_is_documented_and_every_documented_path_is_served():
    spec = yaml.safe_load(SPEC.read_text())
    documented = {(m.upper(), p, op["x-vgpuhost-role"]) for p, ops in spec["paths"].items() for m, op in ops.items()}
    served = {(r.method, r.template, r.role) for r in api.ROUTES}
    assert documented == served


def test_every_operation_declares_the_roles_the_routing_table_serves():
    """The security model per operation: the peer-credential scheme, the roles that may call it (as the
    server decides them: api.Route.roles) and, where tenant members may, what they get there."""
    spec = yaml.safe_load(SPEC.read_text())
    scheme = spec["components"]["securitySchemes"]["unixPeerCredentials"]
    assert all(role in scheme["description"] for role in api.ROLES)
    assert spec["security"] == [{"unixPeerCredentials": []}]
    for route in api.ROUTES:
        op = spec["paths"][route.template][route.method.lower()]
        assert op["x-vgpuhost-roles"] == list(route.roles), route.template
        assert op["security"] == [{"unixPeerCredentials": []}], route.template
        assert ("x-vgpuhost-tenant-scope" in op) == (api.TENANT in route.roles), route.template
        assert route.role in route.roles and (route.tenant is not None) == (api.TENANT in route.roles)
    # the tenant role reaches no write but allocate and release, and no read of the whole host
    tenant_ops = {(r.method, r.template) for r in api.ROUTES if api.TENANT in r.roles}
    assert {t for m, t in tenant_ops if m == "POST"} == {"/v1/domains/{uuid}/allocate", "/v1/domains/{uuid}/release"}
    assert not tenant_ops & {("GET", "/v1/inventory"), ("GET", "/v1/metrics"), ("POST", "/v1/plan")}


#: a stopped domain in libvirt's test driver, read afresh by every connection (the agent's own)
TEST_NODE = """<node><domain type='test' xmlns:test='http://libvirt.org/schemas/domain/test/1.0'>
<name>doc-vm2</name><uuid>11111111-2222-4333-8444-0000000000d4</uuid><memory>65536</memory>
<os><type>hvm</type></os><devices/><test:runstate>5</test:runstate></domain></node>"""


def _requests(a40_config: str, uri: str) -> List[tuple]:
    """One request per documented (method, path), in an order that leaves something to release."""
    xml = vgpu_domain("doc-vm", DOM, MDEV)
    other = "11111111-2222-4333-8444-0000000000b2"
    layout = {"config": a40_config, "source": "vgpu-a40.yaml", "layout": "mixed"}
    return [
        ("GET", "/v1/agent", "/v1/agent", None),
        ("GET", "/v1/openapi", "/v1/openapi", None),
        ("GET", "/v1/inventory", "/v1/inventory", None),
        ("GET", "/v1/types", "/v1/types?available=true", None),
        ("GET", "/v1/capacity", "/v1/capacity", None),
        ("POST", "/v1/passthrough/{bdf}/prepare", "/v1/passthrough/0000:81:00.0/prepare", {"persist": False}),
        ("POST", "/v1/passthrough/{bdf}/release", "/v1/passthrough/0000:81:00.0/release", {}),
        ("POST", "/v1/tenants", "/v1/tenants", {"name": "t1", "vgpus": "4:6", "labels": ["env=dev"]}),
        ("POST", "/v1/tenants/{name}/set", "/v1/tenants/t1/set", {"qos": "guaranteed", "framebuffer": "32G",
                                                                   "allow_oversubscribe": True}),   # warned
        ("POST", "/v1/domains/{domain}/bind", "/v1/domains/doc-vm2/bind", {"tenant": "t1", "uri": uri}),
        ("POST", "/v1/tenants/{name}/remove", "/v1/tenants/t1/remove", None),
        ("POST", "/v1/domains/{domain}/attach", "/v1/domains/doc-vm2/attach", {"profile": "A40-8Q", "uri": uri}),
        ("POST", "/v1/domains/{domain}/detach", "/v1/domains/doc-vm2/detach", {"all": True, "uri": uri}),
        ("POST", "/v1/gpus/{bdf}/mixed-size", "/v1/gpus/0000:81:00.0/mixed-size", {"mixed_size": True}),
        ("POST", "/v1/gpus/{bdf}/cordon", "/v1/gpus/0000:81:00.0/cordon", {"reason": "maintenance"}),
        ("GET", "/v1/gpus/{bdf}/drain", "/v1/gpus/0000:81:00.0/drain", None),
        ("GET", "/v1/gpus/health", "/v1/gpus/health", None),
        ("POST", "/v1/gpus/{bdf}/uncordon", "/v1/gpus/0000:81:00.0/uncordon", {}),
        ("POST", "/v1/scheduler", "/v1/scheduler", {"policy": "best-effort", "gpus": ["0000:81:00.0"]}),
        ("POST", "/v1/mig/{bdf}/apply", "/v1/mig/0000:18:00.0/apply", {"layout": "1g.18gb=1"}),
        ("POST", "/v1/mig/{bdf}/enable", "/v1/mig/0000:18:00.0/enable", None),
        ("POST", "/v1/mig/{bdf}/disable", "/v1/mig/0000:18:00.0/disable", None),
        ("POST", "/v1/domains/{uuid}/allocate", f"/v1/domains/{other}/allocate", {"profile": "A40-8Q"}),
        ("POST", "/v1/hook/prepare", "/v1/hook/prepare", {"xml": xml, "name": "doc-vm"}),
        ("POST", "/v1/vgpus", "/v1/vgpus", {"profile": "A40-8Q", "vgpu_uuid": MANUAL}),
        ("GET", "/v1/vgpus", "/v1/vgpus", None),
        ("POST", "/v1/vgpus/{id}/remove", f"/v1/vgpus/{MANUAL}/remove", {"owner": "manual"}),
        ("GET", "/v1/domains", "/v1/domains", None),
        ("GET", "/v1/tenants", "/v1/tenants", None),
        ("GET", "/v1/usage", "/v1/usage", None),
        ("GET", "/v1/usage/hourly", "/v1/usage/hourly?period=2026-10", None),
        ("GET", "/v1/bill", "/v1/bill?period=2026-10", None),       # issued by the test before the agent starts
        ("GET", "/v1/audit", "/v1/audit?since=1h", None),
        ("GET", "/v1/metrics", "/v1/metrics", None),
        ("POST", "/v1/hook/release", "/v1/hook/release", {"xml": xml}),
        ("POST", "/v1/domains/{uuid}/release", f"/v1/domains/{other}/release", None),
        ("POST", "/v1/plan", "/v1/plan", layout),
        ("POST", "/v1/apply", "/v1/apply", layout),
        ("POST", "/v1/assert", "/v1/assert", layout),
        ("POST", "/v1/reconcile", "/v1/reconcile", {"check": True}),
        ("POST", "/v1/migrate/check", "/v1/migrate/check",
         {"schema": "vgpuhost.migrate-request/v1", "name": "doc-vm3", "uuid": other, "strategy": "first-fit",
          "anti_affinity": None, "tenant": None, "qos": None, "manager_version": "580.65.05",
          "devices": [{"kind": "mdev", "device": MDEV, "profile": "A40-8Q", "gpu": ""}]}),
    ]


#: the MIG endpoints go to agents on H200 hosts (MIG mode on: a layout applies, enable is a no-op;
#: off: disable is a no-op)
MIG_HOSTS = {"/v1/mig/{bdf}/apply": "h200-mig-on", "/v1/mig/{bdf}/enable": "h200-mig-on",
             "/v1/mig/{bdf}/disable": "h200-mig"}


def test_responses_validate_against_the_documented_schemas(a40, tmp_path, make_host):
    spec = yaml.safe_load(SPEC.read_text())
    config = (REPO / "examples" / "config" / "vgpu-a40.yaml").read_text()
    node = tmp_path / "node.xml"
    node.write_text(TEST_NODE)
    reqs = _requests(config, f"test://{node}")
    assert {(m, t) for m, t, _, _ in reqs} == {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    # an issued month for GET /v1/bill (metering read past its end; no usage: a bill of zero)
    from vgpuhost.io import state as st
    from vgpuhost.ops import billing
    from vgpuhost.policy.billing import parse_prices
    store = StateStore(a40.state_dir)
    with store.transaction() as conn:
        st.put_meter_state(conn, "last_tick_us", str(1_790_812_800_000_000))        # metering began 2026-10-01
        st.put_meter_state(conn, "last_tick_us", str(1_793_577_600_000_000))        # and read past it: 2026-11-02
    billing.issue(store, "2026-10", parse_prices("version: 1\ncurrency: EUR\nallocated: {profiles: {A40-8Q: 1}}\n"),
                  actor="test")
    statuses = {}
    # attach/detach name the agent's own libvirt URI (a caller may name no other: issue 15 #1)
    agent = AgentRun(a40.root, extra=("--metering-interval", "0", "--libvirt-uri", f"test://{node}"))
    others = {name: AgentRun(make_host(name).root) for name in sorted(set(MIG_HOSTS.values()))}
    try:
        answers = [(method, template, target, body,
                    (others[MIG_HOSTS[template]] if template in MIG_HOSTS else agent).call(method, target, body))
                   for method, template, target, body in reqs]
    finally:
        for run in [agent, *others.values()]:
            run.close()
    for method, template, target, body, (status, doc) in answers:
        statuses[template] = status
        ctype, schema = _response_schema(spec, spec["paths"][template][method.lower()], status)
        if ctype == "application/json":
            _validate(doc, spec, schema, doc)
        else:
            assert isinstance(doc, str) and doc
    assert statuses.pop("/v1/metrics") in (200, 503)
    assert set(statuses.values()) == {200}, statuses
    # the writes happened, through the same ops: the layout's six vGPUs (2 A40-8Q + 4 A40-4Q) are on the host
    assert sorted(r.type_name for r in records(a40).values()) == ["A40-4Q"] * 4 + ["A40-8Q"] * 2
    assert set(mdevs(a40)) == set(records(a40))
    ops = {row.operation.split(" owner=")[0] for row in StateStore(a40.state_dir).audit_rows()}
    assert {"vgpu create A40-8Q", "vgpu create A40-4Q", "vgpu remove " + MDEV, "vgpu remove " + MANUAL} <= ops, ops


@pytest.mark.parametrize("method,target,body,status,exit_code", [
    ("GET", "/v1/nothing", None, 404, 2),
    ("DELETE", "/v1/inventory", None, 405, 2),
    ("POST", f"/v1/domains/{DOM}/allocate", {"profile": "A40-99Q"}, 400, 2),
    ("POST", f"/v1/domains/not-a-uuid/allocate", {"profile": "A40-8Q"}, 400, 2),
    ("POST", f"/v1/domains/{DOM}/allocate", {}, 400, 2),
    ("POST", f"/v1/domains/{DOM}/allocate", {"profile": "A40-8Q", "gpu": "0000:99:00.0"}, 400, 2),
    ("POST", "/v1/plan", {"config": "version: 1\nlayouts: {x: {gpus: [{select: {}, mode: nope}]}}"}, 400, 2),
    ("POST", "/v1/hook/prepare", {"xml": "<domain><name>x</name"}, 400, 2),
    ("GET", "/v1/audit?since=yesterday", None, 400, 2),
])
def test_bad_requests_are_one_error_document_and_change_nothing(agent, a40, method, target, body, status, exit_code):
    spec = yaml.safe_load(SPEC.read_text())
    got, doc = agent.call(method, target, body)
    assert (got, doc["error"]["exit_code"]) == (status, exit_code), doc
    _validate(doc, spec, spec["components"]["schemas"]["AgentError"], doc)
    assert "\n" not in doc["error"]["line"]
    assert records(a40) == {} and mdevs(a40) == {}


def test_a_bad_since_names_the_query_parameter_and_shows_a_clipped_value(agent, a40):
    """Trial 8 T8: the API's refusal names its own parameter (not the CLI's --since) and never echoes a long
    value whole."""
    from vgpuhost.model.values import SHOWN_MAX
    for value in ("yesterday", "9" * 5000):
        got, doc = agent.call("GET", f"/v1/audit?since={value}")
        line = doc["error"]["line"]
        assert (got, doc["error"]["exit_code"]) == (400, 2), doc
        assert line.startswith(f"invalid since '{value[:SHOWN_MAX]}"), line
        assert "--since" not in line and len(line) < SHOWN_MAX + 300, line


@pytest.mark.parametrize("action,extra", [("attach", {"profile": "A40-8Q"}), ("detach", {"all": True})])
def test_attach_and_detach_refuse_a_libvirt_uri_the_agent_was_not_started_with(agent, a40, tmp_path, action, extra):
    """Issue 15 #1: the root agent never opens a caller's URI: no program run (qemu+ext, ?command=),
    no file read (test:///FILE), and nothing of either in the answer."""
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.sh"
    evil.write_text(f"#!/bin/sh\ntouch {marker}\n")
    evil.chmod(0o755)
    secret = tmp_path / "secret"
    secret.write_text("SECRET-FIRST-LINE\n")
    secret.chmod(0o600)
    spec = yaml.safe_load(SPEC.read_text())
    for uri in (f"qemu+ext:///system?command={evil}", f"qemu:///system?command={evil}", f"test://{secret}",
                "qemu:///session", "qemu+ssh://elsewhere/system", ""):
        status, doc = agent.call("POST", f"/v1/domains/vm1/{action}", {**extra, "uri": uri})
        assert (status, doc["error"]["exit_code"]) == (400, 2), (uri, doc)
        _validate(doc, spec, spec["components"]["schemas"]["AgentError"], doc)
        line = doc["error"]["line"]
        assert "\n" not in line and "SECRET" not in json.dumps(doc) and "only at qemu:///system" in line, line
    assert not marker.exists()
    assert records(a40) == {} and mdevs(a40) == {}
    assert agent.call("GET", "/v1/agent")[1]["libvirt_uris"] == ["qemu:///system", "qemu+unix:///system"]


def test_the_cli_keeps_a_uri_the_agent_does_not_take_in_its_own_process(a40):
    """attach --connect with a URI the agent refuses: the CLI does it itself (here: no such daemon),
    the agent is not asked; an allowed URI goes to the agent.  The CLI runs as its own process (libvirt
    is never loaded into pytest's, which later tests fork)."""
    import subprocess
    import sys

    def cli(*args):
        env = {k: v for k, v in os.environ.items() if k not in (agentclient.ENV_SOCKET, "VGPUHOST_AGENT")}
        return subprocess.run([sys.executable, "-m", "vgpuhost", "--root", str(a40.root), *args], env=env,
                              capture_output=True, text=True, timeout=120, cwd=str(REPO))
    with AgentRun(a40.root, str(a40.path("run", "vgpuhost"))) as run:
        done = cli("--connect", "qemu:///system?socket=/nonexistent/sock", "attach", "vm1", "--profile", "A40-8Q")
        assert done.returncode != 0 and done.stderr.startswith("vgpuhost: error: "), done.stderr
        assert "only at" not in done.stderr
        served = run.call("GET", "/v1/agent")[1]["served"]
        assert "POST /v1/domains/{domain}/attach" not in served
        cli("--connect", "qemu:///system", "detach", "vm1", "--all")
        assert run.call("GET", "/v1/agent")[1]["served"]["POST /v1/domains/{domain}/detach"] == 1


def _request_schema(spec, op) -> Dict[str, Any]:
    schema = ((op.get("requestBody") or {}).get("content") or {}).get("application/json", {}).get("schema", {})
    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_every_body_schema_is_closed_and_names_the_keys_the_agent_takes():
    spec = yaml.safe_load(SPEC.read_text())
    for route in api.ROUTES:
        schema = _request_schema(spec, spec["paths"][route.template][route.method.lower()])
        if route.method == "POST" and schema:
            assert schema.get("additionalProperties") is False, route.template
            assert set(schema["properties"]) == set(route.keys), route.template
        else:
            assert route.keys == (), route.template


def test_an_unknown_body_key_is_refused_and_changes_nothing(agent, a40):
    """Issue 15 #2: a misspelt dry_run (``dryrun``) made a real vGPU; now every endpoint names the key."""
    spec = yaml.safe_load(SPEC.read_text())
    status, doc = agent.call("POST", "/v1/vgpus", {"profile": "A40-8Q", "dryrun": True, "gpus": "0000:81:00.0"})
    assert (status, doc["error"]["exit_code"]) == (400, 2), doc
    assert doc["error"]["line"].startswith("unknown key 'dryrun' (and 1 more) in the body of POST /v1/vgpus; "), doc
    assert "dry_run" in doc["error"]["hint"]
    for route in api.ROUTES:
        if route.method != "POST":
            continue
        target = route.template.format(uuid=DOM, id=MDEV, bdf="0000:81:00.0", domain="vm1", name="t1")
        status, doc = agent.call("POST", target, {"no_such_key\x00": 1})
        assert status == 400 and "unknown key 'no_such_key?'" in doc["error"]["line"], (target, doc)
        _validate(doc, spec, spec["components"]["schemas"]["AgentError"], doc)
    assert records(a40) == {} and mdevs(a40) == {}
    assert StateStore(a40.state_dir).audit_rows() == []


def test_refusals_name_the_groups_the_agent_was_started_with(agent):
    """Issue 15 #3: the 403 hints name --admin-group/--ro-group as given, not the default names."""
    for path in (agent.admin, agent.ro):
        os.chmod(path, 0o666)
    got = as_user(OTHER_UID, OTHER_GID, [], [(agent.ro, "GET", "/v1/inventory", None)], hints=True)
    # groups given as gids are named as gids (trial 8 T6: not "a member of the 0 group")
    assert got == [[403, f"ask for membership of the group of gid {RO_GID} (read) or the group of gid {ADMIN_GID} "
                         "(admin), or of one tenant's group"]]
    got = as_user(RO_UID, RO_GID, [], [_allocate(agent.ro, DOM)], hints=True)
    assert got == [[403, f"use the admin socket as root or a member of the group of gid {ADMIN_GID}"]]


def test_a_negative_content_length_is_bad_input(agent, a40):
    s = unixsock.connect(agent.admin, 10)
    s.sendall(b"POST /v1/reconcile HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
    answer = b""
    while True:                      # the agent closes the connection after each answer
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        answer += chunk
    s.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n", 1)[0]
    assert json.loads(body)["error"]["line"].startswith("Content-Length is negative; ")
    assert records(a40) == {} and mdevs(a40) == {}


def test_a_body_that_is_not_json_or_too_large_is_refused(agent):
    s = unixsock.connect(agent.admin, 10)
    s.sendall(b"POST /v1/reconcile HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{nope")
    assert b" 400 " in s.recv(1 << 16).split(b"\r\n", 1)[0]
    s.close()
    s = unixsock.connect(agent.admin, 10)
    s.sendall(b"POST /v1/reconcile HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
    assert b" 413 " in s.recv(1 << 16).split(b"\r\n", 1)[0]
    s.close()


def test_a_refusal_carries_the_cli_exit_code(agent, a40):
    for i in range(6):
        assert agent.call("POST", f"/v1/domains/{uuidlib.uuid4()}/allocate", {"profile": "A40-8Q"})[0] == 200
    status, doc = agent.call("POST", f"/v1/domains/{DOM}/allocate", {"profile": "A40-8Q"})
    assert (status, doc["error"]["type"], doc["error"]["exit_code"]) == (409, "RefusedError", 2)
    assert "cannot place A40-8Q" in doc["error"]["message"]


# ---------------------------------------------------------------------------
# 16 concurrent clients

#: one client of the concurrency test: a fresh interpreter (a fork of this multi-threaded test process could
#: inherit a lock another thread held, and hang), ready once imported, sending when the go file appears
_CLIENT = r"""
import json, os, sys, time
from vgpuhost.io import agentclient
path, dom, go = sys.argv[1:4]
print("ready", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.001)
status, doc = agentclient.call(path, "POST", f"/v1/domains/{dom}/allocate", {"profile": "A40-8Q",
                                                                             "strategy": "first-fit"})
print(json.dumps([dom, status, doc]), flush=True)
"""


def test_sixteen_concurrent_clients_never_double_allocate(agent, a40, tmp_path):
    """16 processes ask at once for an A40-8Q each; the A40 holds 6 (equal-size mode): exactly 6 get one,
    10 are refused (409, exit code 2), no vGPU is given twice, and the store matches the tree."""
    import subprocess
    import sys
    go = tmp_path / "go"
    doms = [f"11111111-2222-4333-8444-{i:012x}" for i in range(16)]
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, agent.admin, d, str(go)], stdout=subprocess.PIPE,
                              text=True, cwd=str(REPO)) for d in doms]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        go.touch()                                   # all 16 send now
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            results.append(tuple(json.loads(out.strip().splitlines()[-1])))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ok = {dom: doc["id"] for dom, status, doc in results if status == 200}
    refused = [doc for _, status, doc in results if status != 200]
    assert len(ok) == 6 and len(set(ok.values())) == 6
    assert len(refused) == 10 and {(d["status"], d["error"]["exit_code"]) for d in refused} == {(409, 2)}
    recs = records(a40)
    assert {r.id: r.owner for r in recs.values()} == {v: k for k, v in ok.items()}
    assert mdevs(a40) == {r.id: r.type_id for r in recs.values()}
    status, rep = agent.call("POST", "/v1/reconcile", {"check": True})
    assert status == 200 and rep["in_sync"] and not rep["orphans"]
    # each write has its ok audit row
    creates = [r for r in StateStore(a40.state_dir).audit_rows() if r.path.endswith("/create")]
    assert sorted(r.value for r in creates if r.result == "ok") == sorted(ok.values())


# ---------------------------------------------------------------------------
# the warm snapshot

def test_reads_use_a_warm_snapshot_renewed_by_writes_and_by_changes(agent, a40):
    def scans():
        return agent.call("GET", "/v1/agent")[1]["snapshot_scans"]
    agent.call("GET", "/v1/inventory")
    first = scans()
    for _ in range(3):
        agent.call("GET", "/v1/vgpus")
        agent.call("GET", "/v1/types")
    assert scans() == first                              # nothing changed: no rescan
    status, out = agent.call("POST", f"/v1/domains/{DOM}/allocate", {"profile": "A40-8Q"})
    assert status == 200
    listed = agent.call("GET", "/v1/vgpus")[1]["vgpus"]
    assert [v["id"] for v in listed] == [out["id"]] and scans() == first + 1
    # a change the agent did not make (the CLI, another tool) is seen too
    from vgpuhost.cli.main import main as cli_main
    assert cli_main(["--root", str(a40.root), "vgpu", "create", "--profile", "A40-8Q"]) == 0
    assert len(agent.call("GET", "/v1/vgpus")[1]["vgpus"]) == 2


# ---------------------------------------------------------------------------
# CLI write commands through the agent

def test_cli_writes_go_through_the_agent_when_it_answers(a40, capsys):
    from vgpuhost.cli.main import main as cli_main
    sock = a40.path("run", "vgpuhost")
    base = ["--root", str(a40.root)]
    with AgentRun(a40.root, str(sock)) as run:
        assert cli_main(base + ["--json", "vgpu", "create", "--profile", "A40-8Q", "--owner", DOM]) == 0
        made = json.loads(capsys.readouterr().out)
        assert made["owner"] == DOM and list(mdevs(a40)) == [made["id"]]
        served = run.call("GET", "/v1/agent")[1]["served"]
        assert served.get("POST /v1/vgpus") == 1
        rows = StateStore(a40.state_dir).audit_rows()
        assert any(r.path.endswith("/create") and r.actor.startswith("agent uid=0 pid=") for r in rows)
        # a refusal through the agent: the CLI's one line and exit code
        assert cli_main(base + ["vgpu", "remove", made["id"], "--owner", "manual"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vgpuhost: error: ") and err.count("\n") == 1
        assert cli_main(base + ["vgpu", "remove", made["id"], "--owner", DOM]) == 0
        assert "removed A40-8Q" in capsys.readouterr().out
        assert cli_main(base + ["reconcile"]) == 0
        assert run.call("GET", "/v1/agent")[1]["served"].get("POST /v1/reconcile") == 1
        assert mdevs(a40) == {} and records(a40) == {}
    # the agent down: the CLI does it itself
    assert cli_main(base + ["vgpu", "create", "--profile", "A40-8Q"]) == 0
    rows = StateStore(a40.state_dir).audit_rows()
    assert rows[-1].actor.startswith("cli uid=0 pid=")


#: write commands in an order that exercises each, refusals included (rc 2: nothing changed)
WRITES = [
    ["passthrough", "prepare", "0000:81:00.0"],
    ["passthrough", "prepare", "0000:81:00.0"],                 # idempotent: no change
    ["passthrough", "release", "0000:81:00.0"],
    ["tenant", "add", "t1", "--vgpus", "4:6", "--label", "env=dev"],
    ["tenant", "add", "t1"],                                    # refused: exists
    ["tenant", "set", "t1", "--qos", "guaranteed", "--framebuffer", "32G"],       # refused: no fixed-share pool
    ["tenant", "set", "t1", "--qos", "guaranteed", "--framebuffer", "32G", "--allow-oversubscribe"],   # warned
    ["tenant", "set", "nobody", "--qos", "guaranteed"],         # refused: unknown
    ["tenant", "remove", "t1"],
    ["vgpu", "mode", "--gpu", "0000:81:00.0", "--mixed-size", "on"],
    ["scheduler", "set", "--policy", "equal-share", "--timeslice-ms", "4", "--gpu", "0000:81:00.0"],
    ["scheduler", "set", "--policy", "fixed-share", "--timeslice-ms", "99", "--gpu", "0000:81:00.0"],   # refused
    ["apply", "-c", str(REPO / "examples" / "config" / "vgpu-a40.yaml"), "mixed"],
    ["apply", "-c", str(REPO / "examples" / "config" / "vgpu-a40.yaml"), "mixed"],   # nothing to do
    ["passthrough", "prepare", "0000:81:00.0"],                 # refused: vGPUs on it
]


def _run(cli_main, capsys, base, argv):
    """(exit code, stdout, stderr) with the host root and fresh mdev UUIDs written alike."""
    import re
    rc = cli_main(base + argv)
    out = capsys.readouterr()
    same = [re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "UUID",
                   text.replace(base[1], "ROOT")) for text in (out.out, out.err)]
    return (rc, *same)


def test_apply_through_the_agent_streams_the_same_progress_lines_as_a_local_apply(make_host, capsys):
    """`apply -v` through the agent: the agent streams a progress line per step as it runs (application/
    x-ndjson), and the CLI shows them as a local apply does -- the same stderr, stdout and exit code, and
    for an apply refused after the stream began, the same one-line error and exit code."""
    from vgpuhost.cli.main import main as cli_main
    from vgpuhost.io import agentclient
    a, b = make_host("a40-mdev"), make_host("a40-mdev")
    config = str(REPO / "examples" / "config" / "vgpu-a40.yaml")
    with AgentRun(a.root, str(a.path("run", "vgpuhost"))) as run_a:
        ra = _run(cli_main, capsys, ["--root", str(a.root), "-v"], ["apply", "-c", config, "mixed"])
        rb = _run(cli_main, capsys, ["--root", str(b.root), "--local", "-v"], ["apply", "-c", config, "mixed"])
        assert ra == rb and ra[0] == 0
        steps = [line for line in ra[2].splitlines() if line.startswith("vgpuhost: [")]
        assert len(steps) == 8 and steps[0].startswith("vgpuhost: [1/4] scheduler") and len(mdevs(a)) == 6
        assert run_a.call("GET", "/v1/agent")[1]["served"]["POST /v1/apply"] == 1
        # the stream itself: a progress line as each step starts and ends, then the apply document
        seen = []
        text = (REPO / "examples" / "config" / "vgpu-a40.yaml").read_text()
        status, doc = agentclient.call(run_a.admin, "POST", "/v1/apply", {"config": text, "layout": "mixed",
                                                                        "progress": True}, on_line=seen.append)
        assert status == 200 and doc["schema"] == "vgpuhost.apply/v1" and seen == []       # nothing to do
        # refused once the stream began (a vGPU the layout did not make is in its way): the error document
        # carries the status, and the CLI gives its one line and exit code as a local apply does
        c, d = make_host("a40-mdev"), make_host("a40-mdev")
        with AgentRun(c.root, str(c.path("run", "vgpuhost"))) as run_c:
            for host, local in ((c, []), (d, ["--local"])):
                assert cli_main(["--root", str(host.root), *local, "vgpu", "create", "--profile", "A40-48Q",
                                 "--owner", "6f1b1d4e-0000-4000-8000-000000000001"]) == 0
            capsys.readouterr()
            rc_ = _run(cli_main, capsys, ["--root", str(c.root), "-v"], ["apply", "-c", config, "mixed"])
            rd = _run(cli_main, capsys, ["--root", str(d.root), "--local", "-v"], ["apply", "-c", config, "mixed"])
            assert rc_ == rd and rc_[0] == 2 and rc_[2].startswith("vgpuhost: error: layout 'mixed' cannot be applied")
            assert rc_[2].count("\n") == 1
            assert run_c.call("GET", "/v1/agent")[1]["served"]["POST /v1/apply"] == 1


def test_every_write_command_gives_the_same_result_through_the_agent_as_locally(make_host, capsys):
    """Two identical hosts, an agent on each: host A's CLI goes through its agent, host B's CLI
    is told --local.  Each command's exit code, text, stderr line and --json document agree;
    A's agent served every write and B's none; the audit names the agent on A and the CLI on B."""
    from vgpuhost.cli.main import main as cli_main
    a, b = make_host("a40-mdev"), make_host("a40-mdev")
    with AgentRun(a.root, str(a.path("run", "vgpuhost"))) as run_a, \
            AgentRun(b.root, str(b.path("run", "vgpuhost"))) as run_b:
        for argv in WRITES:
            ra = _run(cli_main, capsys, ["--root", str(a.root)], argv)
            rb = _run(cli_main, capsys, ["--root", str(b.root), "--local"], argv)
            assert ra == rb, argv
            warned = "--allow-oversubscribe" in argv
            assert (ra[2].startswith("vgpuhost: warning: guarantee at risk") if warned else ra[2] == "") \
                if ra[0] == 0 else ra[2].startswith("vgpuhost: error: ") and ra[2].count("\n") == 1
        # --json: the same documents (the agent's "text" is not in the tenant's)
        for argv in (["tenant", "add", "t2", "--series", "Q"], ["tenant", "remove", "t2"]):
            ja = json.loads(_run(cli_main, capsys, ["--root", str(a.root), "--json"], argv)[1])
            jb = json.loads(_run(cli_main, capsys, ["--root", str(b.root), "--local", "--json"], argv)[1])
            assert ja == jb and "text" not in ja
        served_a = run_a.call("GET", "/v1/agent")[1]["served"]
        served_b = run_b.call("GET", "/v1/agent")[1]["served"]
    assert served_a["POST /v1/passthrough/{bdf}/prepare"] == 3 and served_a["POST /v1/passthrough/{bdf}/release"] == 1
    assert served_a["POST /v1/tenants"] == 3 and served_a["POST /v1/tenants/{name}/set"] == 3
    assert served_a["POST /v1/tenants/{name}/remove"] == 2 and served_a["POST /v1/apply"] == 2
    assert served_a["POST /v1/gpus/{bdf}/mixed-size"] == 1 and served_a["POST /v1/scheduler"] == 2
    assert not {k: v for k, v in served_b.items() if k.startswith("POST")}
    # the same host state both ways: vGPUs of the layout, no tenants
    assert sorted(mdevs(a).values()) == sorted(mdevs(b).values()) and len(mdevs(a)) == 6
    for host, who in ((a, "agent uid=0 pid="), (b, "cli uid=0 pid=")):
        rows = StateStore(host.state_dir).audit_rows()
        ops = {r.operation for r in rows if r.actor.startswith(who)}
        assert {"tenant add t1", "tenant set t1", "tenant remove t1"} <= ops, ops
        assert any(r.path.endswith("driver_override") or "bind" in r.path for r in rows if r.actor.startswith(who))


@pytest.mark.root
def test_attach_and_detach_go_through_the_agent_to_a_real_libvirtd(libvirtd, a40, capsys):
    """attach/detach with the agent up: the agent defines the domain on the libvirt URI the CLI
    names (here a real, isolated libvirtd), and audits it as itself."""
    import libvirt
    from vgpuhost.cli.main import main as cli_main
    from vgpuhost.libvirt import domxml
    from vgpuhost.sim.libvirtd import diskless_domain_xml
    base = ["--root", str(a40.root), "--connect", libvirtd.uri]
    conn = libvirt.open(libvirtd.uri)
    try:
        conn.defineXML(diskless_domain_xml("vgh-agent"))
        with AgentRun(a40.root, str(a40.path("run", "vgpuhost")),
                      extra=("--metering-interval", "0", "--libvirt-uri", libvirtd.uri)) as run:
            assert cli_main(base + ["--json", "attach", "vgh-agent", "--profile", "A40-8Q", "--tenant", "t1"]) == 0
            doc = json.loads(capsys.readouterr().out)
            assert doc["schema"] == "vgpuhost.attach/v1" and doc["uri"] == libvirtd.uri
            view = domxml.parse_domain(libvirtd.virsh("dumpxml", "--inactive", "vgh-agent", check=True).stdout)
            assert view.mdev_uuids == [doc["devices"][0]["id"]] and view.metadata.tenant == "t1"
            # a refusal through the agent: one line, exit 2, the definition unchanged
            before = libvirtd.virsh("dumpxml", "--inactive", "vgh-agent", check=True).stdout
            assert cli_main(base + ["attach", "vgh-agent", "--profile", "A40-99Q"]) == 2
            err = capsys.readouterr().err
            assert err.startswith("vgpuhost: error: ") and err.count("\n") == 1
            assert libvirtd.virsh("dumpxml", "--inactive", "vgh-agent", check=True).stdout == before
            assert cli_main(base + ["detach", "vgh-agent", "--all"]) == 0
            assert "detached A40-8Q vGPU" in capsys.readouterr().out
            served = run.call("GET", "/v1/agent")[1]["served"]
        assert served["POST /v1/domains/{domain}/attach"] == 2 and served["POST /v1/domains/{domain}/detach"] == 1
        dumped = libvirtd.virsh("dumpxml", "--inactive", "vgh-agent", check=True).stdout
        assert "<hostdev" not in dumped and domxml.NS not in dumped
        rows = StateStore(a40.state_dir).audit_rows()
        assert any(r.operation == "attach vgh-agent" and r.actor.startswith("agent uid=0 pid=") for r in rows)
    finally:
        try:
            conn.lookupByName("vgh-agent").undefine()
        except libvirt.libvirtError:
            pass
        conn.close()


MIG_WRITES = [
    ["mig", "apply", "--gpu", "0000:18:00.0", "1g.18gb=1,2g.35gb=1"],
    ["mig", "apply", "--gpu", "0000:18:00.0", "1g.18gb=1,2g.35gb=1"],     # no change
    ["mig", "apply", "--gpu", "0000:18:00.0", "7g.500gb=1"],              # refused: no such profile
    ["mig", "enable", "--gpu", "0000:18:00.0"],                           # no change
    ["mig", "disable", "--gpu", "0000:18:00.0"],                          # refused: VFs enabled
]


def test_mig_writes_give_the_same_result_through_the_agent_as_locally(make_host, capsys):
    from vgpuhost.cli.main import main as cli_main
    a, b = make_host("h200-mig-on"), make_host("h200-mig-on")
    with AgentRun(a.root, str(a.path("run", "vgpuhost"))) as run_a:
        for argv in MIG_WRITES:
            ra = _run(cli_main, capsys, ["--root", str(a.root)], argv)
            rb = _run(cli_main, capsys, ["--root", str(b.root)], argv)          # no agent for b
            assert ra == rb, argv
        served = run_a.call("GET", "/v1/agent")[1]["served"]
    assert served["POST /v1/mig/{bdf}/apply"] == 3 and served["POST /v1/mig/{bdf}/enable"] == 1
    assert served["POST /v1/mig/{bdf}/disable"] == 1
    rows = StateStore(a.state_dir).audit_rows()
    assert rows and any(r.actor.startswith("agent uid=0 pid=") for r in rows)


def test_write_commands_fall_back_to_local_when_the_agent_does_not_answer(a40, capsys):
    """A stale socket file (the agent was killed) and VGPUHOST_AGENT=off: the CLI does the work."""
    from vgpuhost.cli.main import main as cli_main
    sock = a40.path("run", "vgpuhost")
    run = AgentRun(a40.root, str(sock))
    run.kill()                                  # SIGKILL: the socket file stays, nobody answers
    assert (sock / "agent.sock").exists()
    base = ["--root", str(a40.root)]
    assert cli_main(base + ["tenant", "add", "t1"]) == 0
    assert cli_main(base + ["passthrough", "prepare", "0000:81:00.0"]) == 0
    assert cli_main(base + ["passthrough", "release", "0000:81:00.0"]) == 0
    capsys.readouterr()
    rows = StateStore(a40.state_dir).audit_rows()
    assert rows and all(r.actor.startswith("cli uid=0 pid=") for r in rows)
    run.close()


# ---------------------------------------------------------------------------
# metrics: the metering sampler in the agent

@pytest.mark.parametrize("scope", [None, "all"])
def test_metrics_on_the_socket_and_on_loopback_tcp(a40, scope):
    """The read-only socket serves every series; the loopback TCP port, which any local user can reach
    (trial 9 F6: every tenant's domains and usage, which the tenant socket refuses with 403), serves only
    the host-level series unless the operator asks for all (--metrics-scope all)."""
    import urllib.request
    with AgentRun(a40.root, extra=["--metering-interval", "0.2", "--metrics-port", "0",
                                   *(["--metrics-scope", scope] if scope else [])]) as run:
        st, out = run.call("POST", f"/v1/domains/{DOM}/allocate", {"profile": "A40-8Q"})
        assert st == 200
        line = next(l for l in run.log.read_text().splitlines() if "metrics on http://" in l)
        url = line.split("metrics on ")[1].strip()
        assert url.startswith("http://127.0.0.1:")
        # every sample names the device's owner, also one taken while the allocation was being recorded
        # (ops/metering Sampler._records reads the create's open journal entry); wait (up to a minute, for
        # a busy machine) only for a sample taken after the device was made
        import time
        deadline = time.monotonic() + 60
        while True:
            st, text = run.call("GET", "/v1/metrics", ro=True)
            info = [l for l in text.splitlines() if l.startswith("vgpuhost_device_info{")] if st == 200 else []
            if info or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert st == 200 and "vgpuhost_up 1.0" in text
        assert len(info) == 1 and f'domain_uuid="{DOM}"' in info[0] and 'profile="A40-8Q"' in info[0]
        with urllib.request.urlopen(url, timeout=30) as resp:
            scraped = resp.read().decode()
        assert "vgpuhost_up 1.0" in scraped and 'vgpuhost_gpu_info{' in scraped
        assert 'vgpuhost_free_instances{' in scraped
        if scope == "all":
            assert f'vm_device="{out["id"]}"' in scraped and f'domain_uuid="{DOM}"' in scraped
        else:
            assert out["id"] not in scraped and DOM not in scraped and "vgpuhost_device_" not in scraped
            assert "vgpuhost_tenant_" not in scraped and "vgpuhost_anomaly" not in scraped
            assert not re.search(r'\b(tenant|domain|domain_uuid|vm_device)="', scraped), scraped


def test_a_raw_sqlite_error_is_answered_as_what_it_is():
    """The agent's last-resort answer to a raw SQLite error (trial 7 retest nit): a busy or locked store is
    a transient 503 (exit 5, try again), never "restore state.db from a backup"; a damaged one is."""
    import sqlite3
    from vgpuhost.agent.server import store_error_doc
    doc = store_error_doc("/s/state.db", sqlite3.OperationalError("database is locked"))
    assert doc["status"] == 503 and doc["error"]["type"] == "TransientError" and doc["error"]["exit_code"] == 5
    assert "is busy" in doc["error"]["message"] and "restore" not in doc["error"]["line"], doc
    doc = store_error_doc("/s/state.db", sqlite3.OperationalError("attempt to write a readonly database"))
    assert doc["error"]["type"] == "StateError" and "read-only" in doc["error"]["message"]
    assert "restore" not in doc["error"]["line"], doc
    doc = store_error_doc("/s/state.db", sqlite3.DatabaseError("database disk image is malformed"))
    assert doc["error"]["type"] == "StateError" and "restore state.db from a backup" in doc["error"]["line"]


def test_metrics_off_is_503_saying_why(agent):
    st, doc = agent.call("GET", "/v1/metrics", ro=True)
    assert st == 503 and "metering is off" in doc["error"]["message"] and doc["error"]["exit_code"] == 2


# ---------------------------------------------------------------------------
# socket activation

def test_socket_activation_uses_the_passed_sockets(a40):
    d = socket_dir()
    socks = [unixsock.bind(os.path.join(d, "a.sock"), mode=0o660, gid=ADMIN_GID),
             unixsock.bind(os.path.join(d, "r.sock"), mode=0o660, gid=RO_GID)]
    try:
        with AgentRun(a40.root, d, passed=socks) as run:
            for s in socks:
                s.close()                                   # only the agent holds them now
            run.wait_ready(os.path.join(d, "a.sock"))
            assert agentclient.call(os.path.join(d, "a.sock"), "GET", "/v1/agent")[1]["role"] == "admin"
            assert agentclient.call(os.path.join(d, "r.sock"), "GET", "/v1/agent")[1]["role"] == "read"
            assert sorted(os.listdir(d)) == ["a.sock", "agent.log", "r.sock"]    # it bound nothing of its own
            st, _ = agentclient.call(os.path.join(d, "r.sock"), "POST", f"/v1/domains/{DOM}/allocate",
                                     {"profile": "A40-8Q"})
            assert st == 403
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)


def test_a_second_agent_on_the_same_sockets_is_refused(agent, a40, monkeypatch):
    """Refused on its sockets before it recovers anything or starts its metering thread: a refused agent
    left a sampler thread running in the process (a fork from it could then deadlock on SQLite)."""
    import threading

    from vgpuhost.agent import server
    from vgpuhost.__main__ import main as cli_main
    recovered = []
    monkeypatch.setattr(server, "recover_at_start", lambda agent: recovered.append(agent) or {})
    before = set(threading.enumerate())
    rc = cli_main(["--root", str(a40.root), "agent", "--socket-dir", agent.dir, "--admin-group", str(ADMIN_GID),
                   "--ro-group", str(RO_GID), "--metering-interval", "1"])
    assert rc == 2
    assert recovered == []
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
    assert agent.call("GET", "/v1/agent")[0] == 200      # the first one still serves


def test_an_unknown_group_is_one_line_exit_2(a40, capsys):
    from vgpuhost.__main__ import main as cli_main
    rc = cli_main(["--root", str(a40.root), "agent", "--socket-dir", "/tmp/vgh-never", "--admin-group",
                   "no-such-group-vgh"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no group 'no-such-group-vgh'" in err
    assert not os.path.exists("/tmp/vgh-never")


def test_units_ship_and_name_their_sockets():
    units = Path(data_path("units"))
    admin = (units / "vgpuhost-agent.socket").read_text()
    ro = (units / "vgpuhost-agent-ro.socket").read_text()
    service = (units / "vgpuhost-agent.service").read_text()
    assert "FileDescriptorName=admin" in admin and "SocketGroup=vgpuhost\n" in admin
    assert "FileDescriptorName=ro" in ro and "SocketGroup=vgpuhost-ro" in ro
    assert "SocketMode=0660" in admin and "SocketMode=0660" in ro
    assert "ExecStart=/usr/bin/vgpuhost agent" in service


@pytest.mark.skipif(not os.path.exists("/usr/bin/systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_agent_units(tmp_path):
    import subprocess
    units = Path(data_path("units"))
    names = ["vgpuhost-agent.socket", "vgpuhost-agent-ro.socket", "vgpuhost-agent.service"]
    for n in names:
        (tmp_path / n).write_text((units / n).read_text())
    # --man=no: Documentation=man:vgpuhost(8) names the page the package installs, not this machine's
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(tmp_path / n) for n in names)],
                          capture_output=True, text=True, env={**os.environ, "SYSTEMD_LOG_LEVEL": "err"})
    bad = [line for line in proc.stderr.splitlines()
           if "vgpuhost-agent" in line and "Command /usr/bin/vgpuhost" not in line
           and "group" not in line.lower()]
    assert not bad, proc.stderr


@pytest.mark.parametrize("body", [{"dry_run": "false"}, {"dry_run": "no"}, {"dry_run": 0}, {"persist": "true"},
                                  {"strategy": "reserve"}])
def test_a_body_value_of_the_wrong_kind_is_refused_and_changes_nothing(agent, a40, body):
    """A JSON boolean is true or false: "false" read as true once made a real vGPU from a dry run; and
    the agent offers the strategies its OpenAPI enum lists (``reserve`` is Python-API-only)."""
    status, doc = agent.call("POST", "/v1/vgpus", {"profile": "A40-8Q", **body})
    assert (status, doc["error"]["exit_code"]) == (400, 2), doc
    key = next(iter(body))
    assert f"'{key}'" in doc["error"]["line"] or repr(body[key]) in doc["error"]["line"], doc
    assert records(a40) == {} and mdevs(a40) == {}


def test_a_query_flag_takes_its_text_forms(agent):
    assert agent.call("GET", "/v1/types?available=1", ro=True)[0] == 200
    status, doc = agent.call("GET", "/v1/types?available=maybe", ro=True)
    assert status == 400 and "'available'" in doc["error"]["line"]


def test_the_api_document_is_valid_openapi_with_one_operation_id_per_route():
    """openapi-spec-validator (the linter) accepts the document, and every route of the routing table has
    an operationId named after its handler, unique (issue 29 item 4)."""
    from openapi_spec_validator import validate
    doc = yaml.safe_load(SPEC.read_text())
    validate(doc)
    seen = {}
    for route in api.ROUTES:
        op = doc["paths"][route.template][route.method.lower()]
        head, *rest = route.handler.__name__.split("_")
        assert op["operationId"] == head + "".join(w[:1].upper() + w[1:] for w in rest), route
        seen.setdefault(op["operationId"], []).append(route.template)
    assert all(len(v) == 1 for v in seen.values()), seen
