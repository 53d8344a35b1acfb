"""The agent under hostile readers (issue 28, finding 6): a request's work is bounded before it is parsed
(413 naming the limit), expensive reads have a per-peer concurrency limit and CPU budget (429 with
Retry-After), a request has a total deadline (408, its slot freed), every malformed request line is
answered at once (400), an excess connection is answered 429 (never EAGAIN), SIGTERM ends an agent
under load, and the metrics listener serves a burst of scrapers.

Real agents on real unix sockets (one per module where the limits allow it); outcomes are status codes,
the one line each refusal carries, and the simulated tree, state store and audit log left unchanged.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
import urllib.request
import uuid as uuidlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from agentutil import ADMIN_GID, REPO, RO_GID, RO_UID, AgentRun, as_user, socket_dir

from test_hook import vgpu_domain
from vgpuhost.agent import server
from vgpuhost.agent.server import ReadBudget
from vgpuhost.io import agentclient, unixsock
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.observe.inventory import discover
from vgpuhost.sim.build import materialise
from vgpuhost.sim.data import bundled_specs
from vgpuhost.sim.spec import load_spec

A40_CONFIG = (server.__file__.rsplit("/vgpuhost/", 1)[0] + "/examples/config/vgpu-a40.yaml")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return materialise(load_spec(bundled_specs()["a40-mdev"]), tmp_path_factory.mktemp("limits") / "host")


@pytest.fixture(scope="module")
def agent(host):
    """Four connections per socket, a request deadline of 2 s, and a long gap allowed between bytes
    (so a 408 here is the total deadline's, and a silence would be long)."""
    with AgentRun(host.root, extra=("--metering-interval", "0", "--max-connections", "4",
                                    "--request-timeout", "2", "--read-timeout", "60")) as run:
        yield run


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(1 << 16)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _raw(path: str, data: bytes) -> bytes:
    s = unixsock.connect(path, 30)
    try:
        s.sendall(data)
        return _read_all(s)
    finally:
        s.close()


def _answer(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def _post(path: str, target: str, body: bytes) -> bytes:
    return _raw(path, b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (target.encode(), len(body), body))


def _unchanged(host) -> None:
    assert discover(Sysfs(host), with_types=False).mdevs == ()
    store = StateStore(host.state_dir, create=False)
    assert store.vgpu_records() == [] and store.audit_rows() == []


def _big_config(entries: int) -> str:
    lines = ["version: 1", "layouts:", "  big:", "    gpus:"]
    for i in range(entries):
        lines += [f"      - select: {{address: '0000:{i % 256:02x}:{i // 256:02x}.0'}}", "        mode: vgpu",
                  "        vgpu: {types: {A40-8Q: 2}}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# bounded before parsing: 413 naming the limit

def test_the_finding_6_body_is_refused_on_its_length_before_it_is_parsed(agent, host):
    body = json.dumps({"config": _big_config(9000), "layout": "big"}).encode()
    assert len(body) > 640_000
    # through the CLI's client: it sends the whole body, and still reads the answer (the agent drains it)
    status, doc = agentclient.call(agent.ro, "POST", "/v1/plan", json.loads(body))
    assert status == 413, doc
    assert doc["error"]["line"] == (f"the request body of {len(body)} bytes is over the 128 KiB POST /v1/plan "
                                    "takes; send a smaller body")
    assert agent.call("GET", "/v1/agent", ro=True)[0] == 200        # and the agent serves on
    _unchanged(host)


@pytest.mark.parametrize("config, line", [
    ("version: 1\n" + "#\n" * 5000, "the layout config has 5001 items (lines, and , { [ in them); at most 4096"),
    ("version: 1\nlayouts: [" + "1," * 3000 + "]\n" + "#\n" * 1200,      # under the body's own JSON item limit
     "the layout config has 4203 items (lines, and , { [ in them); at most 4096"),
    ("version: 1\n" + "# " + "x" * 70_000 + "\n", "the layout config is 70014 bytes; at most 64 KiB"),
])
def test_a_layout_config_over_its_item_or_size_limit_is_refused_before_yaml_reads_it(agent, host, config, line):
    for target in ("/v1/plan", "/v1/assert"):
        status, _h, doc = _answer(_post(agent.ro, target, json.dumps({"config": config}).encode()))
        assert status == 413 and doc["error"]["line"].startswith(line), doc
        assert "at most 256" not in doc["error"]["line"]               # not the config's own validation
    status, _h, doc = _answer(_post(agent.admin, "/v1/apply", json.dumps({"config": config}).encode()))
    assert status == 413 and doc["error"]["line"].startswith(line)
    _unchanged(host)


def test_a_json_body_over_its_item_or_size_limit_is_refused(agent, host):
    many = json.dumps({"name": "t1", "gpus": [1] * 5000}).encode()
    status, _h, doc = _answer(_post(agent.admin, "/v1/tenants", many))
    assert status == 413
    assert doc["error"]["line"] == "the request body has 5002 JSON items (, { [); at most 4096; send fewer entries"
    big = b'{"check": true' + b" " * 70_000 + b"}"
    status, _h, doc = _answer(_post(agent.admin, "/v1/reconcile", big))
    assert status == 413 and doc["error"]["line"].startswith(
        f"the request body of {len(big)} bytes is over the 64 KiB POST /v1/reconcile takes")
    assert agent.call("GET", "/v1/tenants")[1]["tenants"] == []
    _unchanged(host)


def test_a_real_config_is_still_planned(agent, host):
    with open(A40_CONFIG) as f:
        text = f.read()
    status, doc = agent.call("POST", "/v1/plan", {"config": text}, ro=True)
    assert status == 200 and doc["schema"].startswith("vgpuhost.plan/"), doc
    ok = _big_config(256)               # the most entries a layout takes, within every limit
    status, doc = agent.call("POST", "/v1/plan", {"config": ok, "layout": "big"}, ro=True)
    assert status == 200 and doc["schema"].startswith("vgpuhost.plan/")     # planned (no such GPUs here)


# ---------------------------------------------------------------------------
# malformed request lines: 400 at once

@pytest.mark.parametrize("line, text", [
    (b"GET /v1/agent\r\n", "malformed request: a request line without an HTTP version (HTTP/0.9) is not served"),
    (b"\r\n", "malformed request: an empty request line"),
])
def test_an_http_0_9_or_empty_request_line_is_answered_400_without_waiting_for_headers(agent, host, line, text):
    # no blank line follows: the stdlib would wait for headers (60 s here) before answering or closing
    status, _h, doc = _answer(_raw(agent.ro, line))
    assert status == 400 and doc["error"]["line"].startswith(text) and doc["error"]["exit_code"] == 2
    _unchanged(host)


# ---------------------------------------------------------------------------
# the total request deadline: 408, the slot freed, others served meanwhile

#: the start of the 429 a connection gets at accept while every slot of the socket is taken
ALL_SLOTS_TAKEN = b"the agent serves at most "


def _slot_taken(raw: bytes) -> bool:
    """Whether ``raw`` is the 429 of a connection refused at accept because every slot was taken: the
    handler of a request answered just before may not have given its slot back yet (more likely on a loaded
    machine), so a test that needs a slot tries again."""
    return raw.startswith(b"HTTP/1.1 429 ") and ALL_SLOTS_TAKEN in raw


def _trickle(path: str, stop: threading.Event, answers: list, head: bytes = b"GET /v1/agent HTTP/1.1\r\nX-Slow: ") -> None:
    while not stop.is_set():
        raw = None
        s = unixsock.connect(path, 30)
        try:
            s.sendall(head)
            while not stop.is_set():
                if select.select([s], [], [], 0.3)[0]:      # answered: read it all
                    raw = _read_all(s)
                    break
                try:
                    s.sendall(b"x")                         # one byte at a time, never the end of the headers
                except OSError:
                    raw = _read_all(s)
                    break
        finally:
            s.close()
        if raw is None:
            return
        if not _slot_taken(raw):
            answers.append(raw)
            return
        time.sleep(0.05)                                    # no slot yet: connect again


def _call_for_a_slot(agent) -> int:
    """``GET /v1/agent`` on the read-only socket, tried again while it is refused for want of a slot
    (:func:`_slot_taken`, for up to a minute); its status."""
    deadline = time.monotonic() + 60
    while True:
        raw = _raw(agent.ro, b"GET /v1/agent HTTP/1.1\r\n\r\n")
        if not _slot_taken(raw) or time.monotonic() > deadline:
            return _answer(raw)[0]
        time.sleep(0.05)


def test_trickling_connections_get_408_after_the_request_deadline_while_others_are_served(agent, host):
    stop = threading.Event()
    answers: list = []
    threads = [threading.Thread(target=_trickle, args=(agent.ro, stop, answers)) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        assert _call_for_a_slot(agent) == 200                           # the fourth slot serves meanwhile
        for t in threads:
            t.join(60)
    finally:
        stop.set()
    assert len(answers) == 3
    for raw in answers:
        status, _h, doc = _answer(raw)
        assert status == 408
        assert doc["error"]["line"] == ("the request did not arrive within 2 s (request line, headers and body "
                                        "together); send the whole request at once")
    # every slot is free again: four requests at once are all served (a slot comes back just after its
    # answer is sent: tried again for up to a minute, as a loaded machine may take that long)
    deadline = time.monotonic() + 60
    while True:
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda _i: agent.call("GET", "/v1/agent", ro=True)[0], range(4)))
        if got == [200] * 4 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == [200] * 4
    _unchanged(host)


def test_a_request_line_that_never_ends_gets_408_too(agent, host):
    """Trickled inside the request line itself (no version parsed yet), the answer is still an HTTP/1.1 408."""
    stop = threading.Event()
    answers: list = []
    t = threading.Thread(target=_trickle, args=(agent.ro, stop, answers, b"GET /v1/"))
    t.start()
    try:
        t.join(60)
    finally:
        stop.set()
    (raw,) = answers
    status, _h, doc = _answer(raw)
    assert status == 408 and doc["error"]["line"].startswith("the request did not arrive within 2 s")
    _unchanged(host)


# ---------------------------------------------------------------------------
# the accept path: an excess connection is answered 429, never refused by the kernel

#: an agent whose held connections never time out while a test runs: a slot freed by a read timeout
#: (10 s by default) or the module agent's 2 s request deadline on a loaded machine would serve a
#: connection the test expects refused
PATIENT = ("--metering-interval", "0", "--max-connections", "4", "--request-timeout", "3600",
           "--read-timeout", "3600")


def test_two_hundred_connects_at_once_are_each_answered_429_not_eagain(host):
    with AgentRun(host.root, extra=PATIENT) as run:
        held = [unixsock.connect(run.ro, 30) for _ in range(4)]         # every slot taken
        try:
            conns = []
            for _ in range(200):                # all connected before any is read: the backlog holds them
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                s.connect(run.ro)               # EAGAIN (BlockingIOError) were the backlog full
                conns.append(s)
            statuses = []
            for s in conns:
                s.setblocking(True)
                s.settimeout(30)
                statuses.append(_answer(_read_all(s))[0])
                s.close()
        finally:
            for s in held:
                s.close()
        assert statuses == [429] * 200


#: the scripts' one connection: connect to the unix socket, read what it answers up to its close
ANSWER = r"""
import socket


def answer(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(30); s.connect(path)
    raw = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        raw += chunk
    s.close()
    return raw
"""


HOLDER = r"""
import json, os, socket, sys
path = sys.argv[1]
os.setgroups([int(sys.argv[3])]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))
held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); held.settimeout(30); held.connect(path)
held.sendall(b"GET /v1/agent HTTP/1.1\r\n")        # a request begun: its slot is held
out = []
for _ in range(2):                                   # the caller's next connection: over its share
    out.append(answer(path).decode())
print(json.dumps(out))
"""


def _holder_is_capped(sock: str, uid: int, gid: int) -> None:
    """Run :data:`HOLDER` as ``uid``/``gid`` on ``sock``: its connection past the per-caller cap (one of four)
    is answered 429 at accept, with the per-caller line."""
    import subprocess
    proc = subprocess.run([sys.executable, "-c", ANSWER + HOLDER, sock, str(uid), str(gid)],
                          capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    for raw in json.loads(proc.stdout):
        status, _h, doc = _answer(raw.encode())
        assert status == 429 and doc["error"]["exit_code"] == 5
        assert doc["error"]["line"] == (f"uid {uid} already holds 1 of this socket's connections, the most "
                                        "one caller may; close connections you hold open")


def test_one_caller_holds_at_most_a_quarter_of_the_connections(host):
    """--max-connections 4: a caller that is not root holds one; its next is answered 429 at accept, while
    root (here, the test) is still served on the same socket.  (The held connection is held for as long as
    the caller runs: with a request deadline, a caller slowed past it would have its slot freed.)"""
    with AgentRun(host.root, extra=PATIENT) as run:
        _holder_is_capped(run.ro, RO_UID, RO_GID)
        assert run.call("GET", "/v1/agent", ro=True)[0] == 200
    _unchanged(host)


# ---------------------------------------------------------------------------
# the role is decided at accept (trial 8 T2): a peer of no role is answered 403 there and holds no slot

#: throwaway ids for the tenant socket's tests: four uids of no role (in no group of the agent's), and a
#: member of tenant t1 (its group given by gid: ``--tenant-group GID=t1``; the naming convention is off, so
#: nothing depends on this machine's group database)
NO_ROLE_UIDS, NO_ROLE_GID = (54301, 54302, 54303, 54304), 54300
MEMBER_UID, T1_GID = 54311, 54310

NO_ROLE_HOLDER = r"""
import json, os, socket, sys
path, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
big = b"X-A: " + b"a" * 65000 + b"\r\n"
conns = []
# trial 8's slow.py and bighdr.py: a request begun and never ended, one with 4 header lines of 64 KB, and
# a connection that sends nothing
for begun in (b"GET /v1/agent HTTP/1.1\r\n", b"GET /v1/agent HTTP/1.1\r\n" + big * 4, b""):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(30); s.connect(path)
    try:
        s.sendall(begun)
    except OSError:
        pass                    # answered and closed already: the answer is still there to read
    conns.append(s)
print("held", flush=True)
sys.stdin.read()                # held until the test has made its calls
out = []
for s in conns:
    raw = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    except ConnectionResetError:
        pass                    # closed with our bytes unread, after its answer
    except TimeoutError:
        raw += b"(no answer within 30 s)"
    out.append(raw.decode("latin-1"))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tenant_agent(host):
    """Four connections per socket (one per caller), held connections never timed out while a test runs."""
    with AgentRun(host.root, extra=(*PATIENT, "--tenant-group", f"{T1_GID}=t1", "--tenant-group-prefix", "")) as run:
        yield run


def test_peers_of_no_role_are_answered_403_at_accept_and_cannot_keep_a_member_or_root_out(tenant_agent, host):
    """Trial 8 T2: four uids of no role each hold what connections they can on the 0666 tenant socket
    (on main one slot each: the socket's four); each connection is answered 403 at once, before its request
    is read (the one that sent nothing too), and while they hold them root and a tenant member are served."""
    import subprocess
    run = tenant_agent
    holders = [subprocess.Popen([sys.executable, "-c", NO_ROLE_HOLDER, run.tenant, str(uid), str(NO_ROLE_GID)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
               for uid in NO_ROLE_UIDS]
    try:
        for p in holders:
            assert p.stdout.readline() == "held\n"
        # connected after all of theirs (accepted in order): their connections came first
        status, _h, doc = _answer(_raw(run.tenant, b"GET /v1/agent HTTP/1.1\r\n\r\n"))
        assert (status, doc.get("role")) == (200, "admin"), doc
        (got,) = as_user(MEMBER_UID, T1_GID, [T1_GID], [(run.tenant, "GET", "/v1/agent", None)], docs=True)
        assert (got[0], got[1].get("role"), got[1].get("tenant")) == (200, "tenant", "t1"), got
        outs = [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in holders]
    finally:
        for p in holders:
            if p.poll() is None:
                p.kill()
                p.wait()
    for uid, out in zip(NO_ROLE_UIDS, outs):
        assert len(out) == 3
        for raw in out:
            status, _h, doc = _answer(raw.encode("latin-1"))
            assert status == 403 and doc["error"]["exit_code"] == 2
            assert doc["error"]["line"] == (
                f"uid {uid} is not allowed to use the vgpuhost agent: it is in no group of the agent's; ask for "
                f"membership of the group of gid {RO_GID} (read) or the group of gid {ADMIN_GID} (admin), or of "
                "one tenant's group")
    assert run.call("GET", "/v1/agent")[0] == 200               # and the agent serves on
    _unchanged(host)


NO_ROLE_LOOP = r"""
import json, os, socket, sys
path, uid, gid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
out = []
for _ in range(n):                                  # trial 8's flood.py: connect, read the 403, close
    out.append(answer(path).decode("latin-1"))
print(json.dumps(out))
"""


def test_a_no_role_flood_is_answered_from_a_cache_of_403s(inproc):
    """Trial 8 R7: each 403 to a peer of no role was built anew (a JSON document per connection); now two
    uids' 20 connections are answered from two cached answers, each that uid's line."""
    import subprocess
    h, proc, admin, ro = inproc
    tenant = os.path.join(os.path.dirname(admin), server.TENANT_SOCKET)
    srv = next(s for s in proc.servers if s.role == "tenant")
    server._forbidden.cache_clear()
    outs = [json.loads(subprocess.run([sys.executable, "-c", ANSWER + NO_ROLE_LOOP, tenant, str(uid), str(NO_ROLE_GID), "10"],
                                      capture_output=True, text=True, timeout=120, check=True).stdout)
            for uid in NO_ROLE_UIDS[:2]]
    for uid, out in zip(NO_ROLE_UIDS, outs):
        assert len(set(out)) == 1 and len(out) == 10
        status, _h, doc = _answer(out[0].encode("latin-1"))
        assert status == 403 and doc["error"]["line"].startswith(f"uid {uid} is not allowed to use the vgpuhost "
                                                                 "agent: it is in no group of the agent's; ")
    info = server._forbidden.cache_info()
    assert (info.misses, info.hits, srv.forbidden) == (2, 18, 20)


NO_ROLE_SENDS_AFTER = r"""
import json, os, select, socket, sys
path, uid, gid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
out = {}
for _ in range(n):      # as curl does: connect, send the request, read; here the request goes once the answer came
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(30); s.connect(path)
    select.select([s], [], [], 30)
    raw = b""
    try:
        s.sendall(b"GET /v1/vgpus HTTP/1.1\r\nHost: l\r\n\r\n")
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
        key = raw.split(b"\r\n")[0].decode()
    except OSError as e:
        key = type(e).__name__
    out[key] = out.get(key, 0) + 1
    s.close()
print(json.dumps(out))
"""


def test_a_no_role_peer_that_sends_its_request_after_the_403_came_still_reads_it(inproc):
    """Trial 10b B2: the 403 at accept was sent and the connection closed before the request came: curl's
    send then failed (EPIPE) and it said "Couldn't connect to server" (7 runs of 10).  Now the answered
    connection is kept, its writing side shut, until its peer is done: a peer that sends its request only
    once the answer is there reads the 403 20 times of 20, and the agent holds none of them after."""
    import subprocess
    h, proc, admin, ro = inproc
    tenant = os.path.join(os.path.dirname(admin), server.TENANT_SOCKET)
    srv = next(s for s in proc.servers if s.role == "tenant")
    got = json.loads(subprocess.run([sys.executable, "-c", NO_ROLE_SENDS_AFTER, tenant, str(NO_ROLE_UIDS[0]),
                                     str(NO_ROLE_GID), "20"],
                                    capture_output=True, text=True, timeout=120, check=True).stdout)
    assert got == {"HTTP/1.1 403 Forbidden": 20}, got
    assert srv.forbidden == 20
    from vgpuhost.io import connlimits
    _until(lambda: connlimits._LINGER.held == 0, "the answered connections closed once their peers closed")


def test_an_answer_at_accept_is_read_by_a_peer_that_writes_first_and_a_silent_peer_is_closed():
    """The 429 at accept (and the metrics port's) takes the same path: over a socket pair, the peer reads
    the whole answer and then end of file after sending its request late, and more than its limit; a peer
    that sends nothing is closed after the linger time, so a flood holds at most ``max_held``."""
    from vgpuhost.io import connlimits
    lingerer = connlimits.Lingerer(linger_s=0.2, max_held=2, max_bytes=1 << 16)
    answer = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    pairs = [socket.socketpair() for _ in range(3)]
    for srv_side, _ in pairs:
        srv_side.sendall(answer)
        srv_side.shutdown(socket.SHUT_WR)
        lingerer.hand(srv_side)
    assert lingerer.held == 2 and pairs[2][0].fileno() == -1    # the third over max_held: closed at once
    late, silent = pairs[0][1], pairs[1][1]
    late.sendall(b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * 100000 + b"\r\n\r\n")   # more than max_bytes
    assert _read_all(late) == answer
    silent.settimeout(10)
    assert _read_all(silent) == answer              # the answer, then end of file (its writing side shut)
    _until(lambda: lingerer.held == 0, "both closed: the silent one once the linger time passed")
    # holding nothing, its thread ends (a process that forks holds no idle thread: tests/test_crash checks
    # it), and the next hand starts another
    _until(lambda: lingerer._epoll is None, "the linger thread ended once it held nothing")
    again, peer = socket.socketpair()
    again.sendall(answer)
    again.shutdown(socket.SHUT_WR)
    lingerer.hand(again)
    peer.close()
    _until(lambda: lingerer.held == 0 and lingerer._epoll is None, "a new thread closed it and ended")
    for a, b in pairs:
        a.close()
        b.close()


def test_a_tenant_member_still_holds_at_most_a_quarter_of_the_tenant_sockets_connections(tenant_agent, host):
    """A peer with a role keeps the per-peer cap: one of four here; its next connection is 429 at accept,
    while root is served on the same socket."""
    run = tenant_agent
    _holder_is_capped(run.tenant, MEMBER_UID, T1_GID)
    status, _h, doc = _answer(_raw(run.tenant, b"GET /v1/agent HTTP/1.1\r\n\r\n"))
    assert status == 200
    _unchanged(host)


# ---------------------------------------------------------------------------
# a tenant's share of the tenant socket, and root's room (trial 8 R2)

#: members of four tenants (``--tenant-group GID=tN``): t1 has two uids
T1_UIDS, T2_UID, T3_UID, T4_UID = (54321, 54322), 54323, 54324, 54325
T2_GID, T3_GID, T4_GID = 54320, 54330, 54340

HOLD = r"""
import os, socket, sys
path, uid, gid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([gid]); os.setgid(gid); os.setuid(uid)
held = []
for _ in range(n):                                  # each a request begun and never ended: its slot held
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(30); s.connect(path)
    s.sendall(b"GET /v1/agent HTTP/1.1\r\n")
    held.append(s)
print("held", flush=True)
sys.stdin.read()                                    # held until the test closes our stdin
"""


def _hold(sock: str, uid: int, gid: int, n: int):
    """A process of ``uid``/``gid`` holding ``n`` connections to ``sock`` (each a request begun), until its
    stdin is closed; returned once they are connected (the agent accepts connections in order: a later
    connection is decided after them)."""
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", HOLD, sock, str(uid), str(gid), str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    assert p.stdout.readline() == "held\n"
    return p


def test_one_tenants_members_together_hold_at_most_its_share_and_root_keeps_its_room(host):
    """--max-connections 8: a uid holds at most 2, a tenant's members together 2, callers other than root 6.
    Trial 8 R2: with a per-uid cap alone, t1's second uid took two more slots (four uids of one tenant took
    all 64 of the tenant socket's).  Here t1's second uid is answered 429 naming the tenant's share while
    t2's member is served; once t1, t2 and t3 hold their shares (6), t4's member is answered 429 naming
    root's room, and root is still served, twice at once."""
    gids = {T1_GID: "t1", T2_GID: "t2", T3_GID: "t3", T4_GID: "t4"}
    extra = [*PATIENT[:2], "--max-connections", "8", *PATIENT[4:], "--tenant-group-prefix", ""]
    for gid, name in gids.items():
        extra += ["--tenant-group", f"{gid}={name}"]
    with AgentRun(host.root, extra=tuple(extra)) as run:
        call = (run.tenant, "GET", "/v1/agent", None)
        holders = [_hold(run.tenant, T1_UIDS[0], T1_GID, 2)]
        try:
            (got,) = as_user(T1_UIDS[1], T1_GID, [T1_GID], [call], docs=True)
            assert got[0] == 429 and got[1]["error"]["exit_code"] == 5, got
            assert got[1]["error"]["line"] == ("the members of tenant 't1' already hold 2 of this socket's "
                                               "connections, the most one tenant may (its share); close "
                                               "connections your tenant's members hold open")
            (got,) = as_user(T2_UID, T2_GID, [T2_GID], [call], docs=True)
            assert (got[0], got[1].get("tenant")) == (200, "t2"), got
            holders += [_hold(run.tenant, T2_UID, T2_GID, 2), _hold(run.tenant, T3_UID, T3_GID, 2)]
            (got,) = as_user(T4_UID, T4_GID, [T4_GID], [call], docs=True)
            assert got[0] == 429, got
            assert got[1]["error"]["line"] == ("callers other than root hold 6 of this socket's 8 connections, "
                                               "all but the 2 kept for root; retry shortly; close connections "
                                               "you hold open")
            with ThreadPoolExecutor(2) as ex:
                got = list(ex.map(lambda _i: _answer(_raw(run.tenant, b"GET /v1/agent HTTP/1.1\r\n\r\n")),
                                  range(2)))
            assert [(status, doc.get("role")) for status, _h, doc in got] == [(200, "admin")] * 2, got
        finally:
            for p in holders:
                p.communicate(timeout=60)
        # the holders gone, their slots are free: t1's second uid and t4's member are served
        assert [g[0] for g in as_user(T1_UIDS[1], T1_GID, [T1_GID], [call, call], docs=True)] == [200, 200]
        assert [g[0] for g in as_user(T4_UID, T4_GID, [T4_GID], [call], docs=True)] == [200]
    _unchanged(host)


# ---------------------------------------------------------------------------
# a slot is free again before its client has read the whole answer

def test_a_client_that_reconnects_at_once_to_a_nearly_full_socket_is_never_refused(make_host, monkeypatch):
    """Three of four slots held; one client calls 40 times in a row, each call connecting as the previous
    one's answer ended.  The agent gives a slot back a moment late here (50 ms: a busy machine's delay, made
    sure); it gives it back before the answer's last byte, so no call is refused (before, it gave it back
    after closing: the next connection was answered 429, "at most 4 connections ... all open")."""
    late = server._Server._release

    def release_late(self, *args):
        time.sleep(0.05)
        late(self, *args)
    monkeypatch.setattr(server._Server, "_release", release_late)
    h = make_host("a40-mdev")
    d = socket_dir()
    proc = server.open_agent(h, socket_dir=d, admin_group=ADMIN_GID, ro_group=RO_GID, max_connections=4)
    proc.start()
    admin = os.path.join(d, "agent.sock")
    srv = next(s for s in proc.servers if s.role == "admin")
    held = [unixsock.connect(admin, 30) for _ in range(3)]
    try:
        for s in held:
            s.sendall(b"GET /v1/agent HTTP/1.1\r\n")           # a request begun: its slot held
        statuses = [agentclient.call(admin, "GET", "/v1/agent")[0] for _ in range(40)]
        assert statuses == [200] * 40 and srv.refused == 0
        # a request answered with a body to drop after it (413) keeps its slot until that is read: then too
        body = b"x" * (server.MAX_SMALL_BODY + 1)
        raws = [_raw(admin, b"POST /v1/reconcile HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                for _ in range(3)]
    finally:
        for s in held:
            s.close()
        proc.stop()
    assert [_answer(raw)[0] for raw in raws] == [413] * 3 and srv.refused == 0


# ---------------------------------------------------------------------------
# expensive reads: per-peer concurrency and CPU budget

def test_read_budget_limits_concurrency_and_cpu_per_peer():
    now = [100.0]
    b = ReadBudget(per_peer=2, burst_s=2.0, rate=0.25, clock=lambda: now[0])
    assert b.begin(1000) is None and b.begin(1000) is None
    assert b.begin(1000) == ("uid 1000 already runs 2 expensive reads (inventory, types, capacity, audit, metrics, "
                             "plan, assert) at once, the most one caller may", 1)
    assert b.begin(1001) is None                    # another peer has its own
    b.end(1000, 0.5)
    assert b.begin(1000) is None                    # a slot came back
    b.end(1000, 0.5)
    b.end(1000, 2.0)                                # 3 CPU s spent of 2: 1 s short
    assert b.begin(1000) == ("uid 1000 has spent its CPU budget for expensive reads (2 CPU s, renewed at 0.25 "
                             "CPU s per second)", 4)
    now[0] += 4.0                                   # renewed at 0.25 s per second
    assert b.begin(1000) is None
    assert b.refused == 2


@pytest.fixture
def inproc(make_host):
    """An agent in this process (its budget reachable), on a fresh simulated A40."""
    h = make_host("a40-mdev")
    d = socket_dir()
    proc = server.open_agent(h, socket_dir=d, admin_group=ADMIN_GID, ro_group=RO_GID)
    for s in proc.servers:
        s.refusal_delay_s = 0.0         # the pause before an over-limit read's 429 (a rate limit, not tested here)
    proc.start()
    try:
        yield h, proc, os.path.join(d, "agent.sock"), os.path.join(d, "agent-ro.sock")
    finally:
        proc.stop()


def _until(check, what: str, bound_s: float = 10.0) -> None:
    """Wait (polling) until ``check()`` holds; fail naming ``what`` after ``bound_s`` seconds."""
    end = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.01)


def test_workers_are_reused_one_runs_per_busy_connection_and_idle_ones_end():
    served: list = []
    gate = threading.Event()

    def serve(request, uid):
        served.append((request, uid, threading.current_thread().name))
        if request == "hold":
            gate.wait(30)
    w = server._Workers(serve, "test-workers", idle_s=0.3)
    alive = lambda: sorted(t.name for t in threading.enumerate() if t.name.startswith("test-workers-"))  # noqa: E731
    w.submit("a", 1)
    _until(lambda: w._idle == 1, "the first worker idle")
    w.submit("b", 2)                                # handed to the idle worker: no second thread
    _until(lambda: len(served) == 2 and w._idle == 1, "b served")
    assert [x[:2] for x in served] == [("a", 1), ("b", 2)] and served[0][2] == served[1][2] == "test-workers-1"
    w.submit("hold", 3)
    w.submit("hold", 4)                             # the one worker is busy: a second thread serves this one
    _until(lambda: len(served) == 4, "both held connections served at once")
    assert w.started == 2 and alive() == ["test-workers-1", "test-workers-2"]
    gate.set()
    _until(lambda: alive() == [], "idle workers ending after idle_s")
    assert w._idle == 0
    w.submit("c", 5)                                # none left: a new thread
    _until(lambda: w._idle == 1, "c served")
    assert w.started == 3 and served[-1][:3] == ("c", 5, "test-workers-3")
    w.close()                                       # the idle one ends at once
    _until(lambda: alive() == [], "the idle worker ending at close")


def test_one_worker_serves_calls_one_after_another(inproc):
    h, proc, admin, ro = inproc
    srv = next(s for s in proc.servers if s.role == "admin")
    for _ in range(5):
        assert agentclient.call(admin, "GET", "/v1/agent")[0] == 200
        _until(lambda: srv.workers._idle == 1, "the worker back in the pool")
    assert srv.workers.started == 1


def test_expensive_reads_over_the_budget_get_429_with_retry_after_and_the_hook_is_not_held(inproc):
    h, proc, admin, ro = inproc
    budget = proc.servers[0].budget
    assert all(s.budget is budget for s in proc.servers)      # one budget for both sockets
    assert budget.begin(0) is None and budget.begin(0) is None  # root runs two expensive reads
    status, headers, doc = _answer(_raw(ro, b"GET /v1/capacity HTTP/1.1\r\n\r\n"))
    assert status == 429 and headers["retry-after"] == "1" and doc["error"]["exit_code"] == 5
    assert doc["error"]["line"].startswith("uid 0 already runs 2 expensive reads")
    cfg = json.dumps({"config": open(A40_CONFIG).read()}).encode()
    assert _answer(_post(ro, "/v1/plan", cfg))[0] == 429
    # the audit log is read whole per request: an expensive read too (finding 4)
    status, _headers, doc = _answer(_raw(ro, b"GET /v1/audit HTTP/1.1\r\n\r\n"))
    assert status == 429 and doc["error"]["line"].startswith("uid 0 already runs 2 expensive reads")
    assert agentclient.call(ro, "GET", "/v1/agent")[0] == 200              # cheap reads are not limited
    # the hook's prepare and release do not wait behind the readers
    dom, mdev = str(uuidlib.uuid4()), str(uuidlib.uuid4())
    xml = vgpu_domain("vm-limits", dom, mdev)
    assert agentclient.call(admin, "POST", "/v1/hook/prepare", {"xml": xml, "name": "vm-limits"})[0] == 200
    assert [m.uuid for m in discover(Sysfs(h), with_types=False).mdevs] == [mdev]
    assert agentclient.call(admin, "POST", "/v1/hook/release", {"xml": xml, "name": "vm-limits"})[0] == 200
    assert discover(Sysfs(h), with_types=False).mdevs == ()
    budget.end(0, 0.0)
    budget.end(0, 30.0)                             # and spent far more CPU than its burst
    status, headers, doc = _answer(_raw(ro, b"GET /v1/inventory HTTP/1.1\r\n\r\n"))
    assert status == 429 and int(headers["retry-after"]) > 100
    assert doc["error"]["line"].startswith("uid 0 has spent its CPU budget for expensive reads")


def test_the_read_only_and_tenant_sockets_threads_are_niced_and_the_admins_are_not(inproc, monkeypatch):
    """Finding 4: a flood of tenant reads must not slow the hook's prepare on the admin socket."""
    h, proc, admin, ro = inproc
    niced = []
    monkeypatch.setattr(server, "_nice_this_thread", lambda nice: niced.append(nice))
    tenant = os.path.join(os.path.dirname(admin), server.TENANT_SOCKET)
    for path in (admin, ro, tenant):
        before = len(niced)
        assert agentclient.call(path, "GET", "/v1/agent")[0] == 200
        niced.append((path, len(niced) - before))
    assert [x for x in niced if isinstance(x, tuple)] == [(admin, 0), (ro, 1), (tenant, 1)]
    assert server.READ_NICE in niced


# ---------------------------------------------------------------------------
# SIGTERM under load; the metrics listener under a burst

def test_sigterm_ends_the_agent_under_load(host):
    run = AgentRun(host.root, extra=("--metering-interval", "0"))
    stop = threading.Event()
    answers: list = []
    tricklers = [threading.Thread(target=_trickle, args=(run.ro, stop, answers)) for _ in range(16)]
    for t in tricklers:
        t.start()
    body = {"config": open(A40_CONFIG).read()}
    with ThreadPoolExecutor(4) as ex:
        reads = [ex.submit(agentclient.call, run.ro, "POST", "/v1/plan", body) for _ in range(4)]
        try:
            assert run.stop() == 0, run.log.read_text()[-3000:]     # ended by SIGTERM, not killed after 30 s
        finally:
            stop.set()
            for t in tricklers:
                t.join(30)
            run.close()
        for f in reads:
            try:
                f.result()
            except (agentclient.AgentDown, OSError):
                pass


def test_the_metrics_listener_serves_a_burst_of_scrapers():
    from prometheus_client import CollectorRegistry, Gauge
    from vgpuhost.ops.exporter import SCRAPE_BACKLOG, listen
    registry = CollectorRegistry()
    Gauge("vgpuhost_test_up", "a gauge", registry=registry).set(1)
    srv, thread = listen("127.0.0.1", 0, registry)
    try:
        assert srv.request_queue_size == SCRAPE_BACKLOG == socket.SOMAXCONN
        port = srv.server_address[1]

        def scrape(_i):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                return r.status, b"vgpuhost_test_up 1.0" in r.read()
        with ThreadPoolExecutor(64) as ex:
            got = list(ex.map(scrape, range(256)))
        assert got == [(200, True)] * 256
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)


def test_the_api_document_lists_408_413_and_429_where_they_can_occur():
    import yaml
    from test_agent import SPEC, _response_schema, _validate
    spec = yaml.safe_load(SPEC.read_text())
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            want = {"408", "429"} | ({"413"} if method == "post" else set())
            assert want <= set(op["responses"]), (method, path)
    assert "Retry-After" in spec["components"]["responses"]["TooMany"]["headers"]
    # the refusals' documents are the documented AgentError
    op = spec["paths"]["/v1/plan"]["post"]
    budget = ReadBudget()
    why, _retry = (budget.begin(5), budget.begin(5), budget.begin(5))[-1]
    for status, line in ((413, server.config_refusal("#\n" * 5000)), (429, why)):
        _ctype, schema = _response_schema(spec, op, status)
        _validate(spec, spec, schema, server.error_doc(status, line, exit_code=2 if status == 413 else 5))


# ---------------------------------------------------------------------------
# SIGTERM during an apply (trial 4, finding 3)

FOUR_A40 = """
version: 1
name: four-a40
summary: four classic-mdev A40s
host:
  cpu_vendor: GenuineIntel
  cmdline: BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet intel_iommu=on iommu=pt
  kernel_release: 6.1.0-27-amd64
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
""" + "".join(
    f'  - {{bdf: "0000:{b:02x}:03.0", model: intel-root-port, numa_node: 0, iommu_group: {b}}}\n'
    f'  - {{bdf: "0000:{b + 1:02x}:00.0", model: A40, upstream: "0000:{b:02x}:03.0", numa_node: 0, '
    f'iommu_group: {b + 1}, vgpu: {{backend: mdev}}}}\n' for b in (0x20, 0x40, 0x60, 0x80))

MANY = """version: 1
layouts:
  many:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu: {types: {A40-1Q: 8}}
"""


@pytest.mark.parametrize("progress", [True, False])
def test_sigterm_during_an_apply_stops_it_between_steps_and_answers_before_the_sockets_close(
        make_host, monkeypatch, progress):
    """SIGTERM comes while step 1 of 4 runs: that step ends whole, no later step starts, and the caller gets
    the answer (a 503 naming the step not started and the steps that stay done; streamed: the last line)
    before the agent's stop returns; the tree holds what the store records and no journal entry is open."""
    h = make_host(yaml_text=FOUR_A40)
    d = socket_dir()
    proc = server.open_agent(h, socket_dir=d, admin_group=ADMIN_GID, ro_group=RO_GID)
    proc.start()
    asked, stopper = [], []
    original = server.api.Agent.check_stopping

    def sigterm_during_step_1(agent):
        asked.append(1)
        if len(asked) == 2:         # step 1 ran; the agent's stop begins now, as at SIGTERM during step 1
            stopper.append(threading.Thread(target=proc.stop))
            stopper[0].start()
            while not agent.stopping:
                time.sleep(0.001)
        return original(agent)
    monkeypatch.setattr(server.api.Agent, "check_stopping", sigterm_during_step_1)
    lines: list = []
    body = {"config": MANY, "layout": "many", **({"progress": True} if progress else {})}
    try:
        status, doc = agentclient.call(os.path.join(d, "agent.sock"), "POST", "/v1/apply", body,
                                       on_line=lines.append)
    finally:
        if stopper:
            stopper[0].join(30)
        else:
            proc.stop()
    assert stopper and not stopper[0].is_alive() and proc.agent.wait_answers(0)
    # streamed: the progress lines of step 1, then the error document as the last line (its status 503)
    assert [(x["step"], x["state"]) for x in lines] == ([(1, "start"), (1, "done")] if progress else [])
    assert status == 503 and doc["error"]["exit_code"] == 5, doc
    assert doc["error"]["message"].startswith("layout 'many': stopped before step 2 of 4 (vgpu 0000:41:00.0: ")
    assert "1 step(s) before it stay done" in doc["error"]["message"]
    store = StateStore(h.state_dir, create=False)
    recs = {r.id: str(r.parent) for r in store.vgpu_records()}
    tree = {m.uuid: str(m.parent) for m in discover(Sysfs(h), with_types=False).mdevs}
    assert recs == tree and len(tree) == 8 and set(tree.values()) == {"0000:21:00.0"}
    assert store.journal_entries(open_only=True) == []


def test_sigterm_to_the_agent_process_during_a_streamed_apply_answers_and_leaves_host_and_store_agreeing(
        make_host):
    """The same with a real agent process and a real SIGTERM (sent when step 1's end is streamed): the agent
    exits 0, the caller gets a last line (the apply document, or the 503 naming the first step not started),
    and the tree holds exactly what the store records: 8 vGPUs per step done, no journal entry open."""
    import signal
    h = make_host(yaml_text=FOUR_A40)
    run = AgentRun(h.root, extra=("--metering-interval", "0"))
    lines: list = []

    def on_line(doc):
        lines.append(doc)
        if (doc.get("step"), doc.get("state")) == (1, "done"):
            run.proc.send_signal(signal.SIGTERM)
    try:
        status, doc = agentclient.call(run.admin, "POST", "/v1/apply",
                                       {"config": MANY, "layout": "many", "progress": True}, on_line=on_line)
        assert run.proc.wait(30) == 0, run.log.read_text()[-3000:]
    finally:
        run.close()
    done = [x["step"] for x in lines if x["state"] == "done"]
    if status == 200:
        assert doc["schema"] == "vgpuhost.apply/v1" and done == [1, 2, 3, 4]
    else:
        assert status == 503 and doc["error"]["exit_code"] == 5, doc
        assert doc["error"]["message"].startswith(f"layout 'many': stopped before step {len(done) + 1} of 4 (")
    store = StateStore(h.state_dir, create=False)
    recs = {r.id for r in store.vgpu_records()}
    tree = {m.uuid for m in discover(Sysfs(h), with_types=False).mdevs}
    assert recs == tree and len(tree) == 8 * len(done) and done[:1] == [1]
    assert store.journal_entries(open_only=True) == []
