"""The agent's HTTP edge (breaker findings 7, 8, 9, 11d, 11e): duplicate JSON keys, the
per-connection read timeout and connection cap, Content-Length, malformed request lines and a
non-ASCII X-Vgpuhost-Timeout are each one agent error document, and change nothing."""

from __future__ import annotations

import json
import time

import pytest
from agentutil import ADMIN_GID, AgentRun
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpuhost.io import unixsock
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.observe.inventory import discover


@pytest.fixture
def a40(make_host):
    return make_host("a40-mdev")


@pytest.fixture
def agent(a40):
    with AgentRun(a40.root, extra=("--metering-interval", "0", "--max-connections", "3")) as run:
        yield run


def _raw(path: str, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the agent answers until it closes.  A 429 is sent
    again, as its line says to, up to 200 times (the agent gives a slot back before the answer's last byte,
    so a 429 here would come from a connection still open, e.g. one of the cap test's left to close)."""
    for _ in range(200):
        s = unixsock.connect(path, 30)
        try:
            s.sendall(data)
            raw = _rest(s)
        finally:
            s.close()
        if not raw.startswith(b"HTTP/1.1 429 "):
            return raw
        time.sleep(0.05)
    return raw


def _rest(s) -> bytes:
    """Everything ``s`` receives until the agent closes it."""
    answer = b""
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            return answer
        answer += chunk


def _answer(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b"\r\n", 1)[0].split()[1])
    return status, json.loads(body)


def _nothing_changed(a40) -> None:
    assert discover(Sysfs(a40), with_types=False).mdevs == ()
    store = StateStore(a40.state_dir, create=False)
    assert store.vgpu_records() == [] and store.audit_rows() == []


def test_a_duplicate_json_key_is_refused_naming_it(agent, a40):
    body = b'{"profile":"A40-8Q","dry_run":true,"dry_run":false}'
    status, doc = _answer(_raw(agent.admin, b"POST /v1/vgpus HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)))
    assert status == 400 and doc["schema"] == "vgpuhost.agent-error/v1"
    assert doc["error"]["line"] == "the request body has the key 'dry_run' more than once; send each key once"
    nested = b'{"profile":"A40-8Q","dry_run":true,"x":{"a":1,"a":2}}'
    status, doc = _answer(_raw(agent.admin, b"POST /v1/vgpus HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
                                            % (len(nested), nested)))
    assert status == 400 and "the key 'a' more than once" in doc["error"]["line"]
    _nothing_changed(a40)


def test_a_body_that_is_not_utf8_is_415_and_one_that_is_not_json_400(agent, a40):
    for body, status, line in ((b'{"profile":"A40-8Q\xff"}', 415, "the request body is not UTF-8; send JSON in UTF-8"),
                               (b'{"profile":', 400, "the request body is not JSON; send a JSON object")):
        got, doc = _answer(_raw(agent.admin, b"POST /v1/vgpus HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
                                             % (len(body), body)))
        assert (got, doc["error"]["line"]) == (status, line)
    _nothing_changed(a40)


@pytest.mark.parametrize("headers, status, line", [
    (b"", 411, "a POST needs Content-Length (0 for no body); "),
    (b"Content-Length: 2\r\nContent-Length: 2\r\n", 400, "the request has more than one Content-Length header; "),
    (b"Content-Length: \xd9\xa3\r\n", 400, "Content-Length is not a number; "),
    (b"Content-Length: 1_0\r\n", 400, "Content-Length is not a number; "),
])
def test_content_length_must_be_one_ascii_number(agent, a40, headers, status, line):
    got, doc = _answer(_raw(agent.admin, b"POST /v1/reconcile HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n{}"))
    assert got == status and doc["error"]["line"].startswith(line), doc
    _nothing_changed(a40)


@pytest.mark.parametrize("line", [b"GARBAGE\r\n", b"GET /v1/agent\r\n", b"GET /v1/agent HTTP/9\r\n",
                                  b"POST /v1/reconcile\r\n"])
def test_a_malformed_request_line_gets_the_agent_error_document(agent, a40, line):
    raw = _raw(agent.admin, line + b"\r\n")
    assert raw.startswith(b"HTTP/1.")                      # a status line, even for an HTTP/0.9 request
    status, doc = _answer(raw)
    assert status == 400 and doc["schema"] == "vgpuhost.agent-error/v1"
    assert doc["error"]["line"].startswith("malformed request: ") and doc["error"]["exit_code"] == 2
    _nothing_changed(a40)


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "1\u0663"])
def test_a_hook_timeout_header_that_is_not_ascii_digits_is_bad_input(agent, a40, value):
    xml = b"<domain type='kvm'><name>vm1</name><uuid>11111111-2222-4333-8444-0000000000a1</uuid></domain>"
    raw = _raw(agent.admin, b"POST /v1/hook/prepare HTTP/1.1\r\nContent-Type: application/xml\r\n"
                            b"X-Vgpuhost-Domain: vm1\r\nX-Vgpuhost-Timeout: " + value.encode("utf-8") +
                            b"\r\nContent-Length: %d\r\n\r\n%s" % (len(xml), xml))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n", 1)[0], raw
    code, line = body.decode().split("\n", 1)
    assert code == "vgpuhost-hook/1 2"
    assert "must be whole seconds in ASCII digits" in line and "internal error" not in line
    _nothing_changed(a40)


@pytest.mark.parametrize("headers, status, line", [
    (b"Host x\r\n", 400, "malformed request: a header line that is not NAME: VALUE"),
    (b"Host: x\r\n  folded\r\n", 400, "malformed request: a header line that is not NAME: VALUE"),
    (b"Bad Name: x\r\n", 400, "malformed request: a header line that is not NAME: VALUE"),
    (b"".join(b"X-%d: y\r\n" % i for i in range(101)), 431, "malformed request: Too many headers"),
    (b"X: " + b"y" * 65536 + b"\r\n", 431, "malformed request: Line too long"),
])
def test_a_malformed_header_line_is_400_and_too_many_or_too_long_431(agent, a40, headers, status, line):
    got, doc = _answer(_raw(agent.admin, b"POST /v1/reconcile HTTP/1.1\r\n" + headers +
                            b"Content-Length: 2\r\n\r\n{}"))
    assert got == status and doc["error"]["line"].startswith(line), doc
    _nothing_changed(a40)


_TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(_TOKEN, min_size=1, max_size=12),
                          st.text(st.characters(min_codepoint=0x20, max_codepoint=0xff, blacklist_characters="\x7f"),
                                  max_size=20),
                          st.sampled_from(["\r\n", "\n"])), max_size=12),
       st.sampled_from(["content-length", "content-type", "x-vgpuhost-domain", "expect"]))
def test_headers_are_read_as_the_stdlibs_email_parser_reads_them(lines, asked):
    """The agent's own header reader (no email parser) gives what http.client.parse_headers gave for
    every well-formed header block: first value, every value, any case."""
    import http.client
    import io
    from vgpuhost.agent.server import read_headers
    names = [n for n, _v, _e in lines] + [asked, asked.upper()]
    raw = "".join(f"{n}: {v}{e}" for n, v, e in lines).encode("latin-1") + b"\r\nbody"
    mine, theirs = read_headers(io.BytesIO(raw)), http.client.parse_headers(io.BytesIO(raw))
    for name in names:
        assert mine.get(name) == theirs.get(name)
        assert mine.get_all(name) == theirs.get_all(name)


def test_more_connections_than_the_cap_are_refused(agent, a40):
    idle = [unixsock.connect(agent.admin, 30) for _ in range(3)]       # the cap: 3 connections at once
    try:
        extra = unixsock.connect(agent.admin, 30)        # one more: answered at once, unasked, and closed
        try:
            raw = _rest(extra)
        finally:
            extra.close()
        status, doc = _answer(raw)
        assert status == 429 and doc["error"]["exit_code"] == 5
        assert doc["error"]["line"].startswith("the agent serves at most 3 connections at once on this socket")
    finally:
        for s in idle:
            s.close()
    for _ in range(600):                       # the slots come back as the agent sees the closes
        status, _doc = agent.call("GET", "/v1/agent")
        if status != 429:
            break
        time.sleep(0.1)
    assert status == 200
    _nothing_changed(a40)


def test_a_connection_that_stops_sending_is_closed(a40):
    with AgentRun(a40.root, extra=("--metering-interval", "0", "--read-timeout", "1")) as run:
        idle = unixsock.connect(run.admin, 60)
        try:
            idle.sendall(b"GET /v1/agent HTTP/1.1\r\n")                 # a partial request, then silence
            answer = _rest(idle)
        finally:
            idle.close()
        status, doc = _answer(answer)                                 # answered 408, then closed
        assert status == 408 and doc["error"]["line"].startswith("the request stopped arriving (nothing for 1 s)")
        partial = unixsock.connect(run.admin, 60)
        try:
            partial.sendall(b"POST /v1/reconcile HTTP/1.1\r\nContent-Length: 50\r\n\r\n{")
            answer = _rest(partial)
        finally:
            partial.close()
        status, doc = _answer(answer)
        assert status == 408 and doc["error"]["line"].startswith("the request body did not arrive")
        assert "Traceback" not in run.log.read_text()
    _nothing_changed(a40)


def test_an_agent_internal_error_says_report_it_once():
    from vgpuhost.hook.runtime import agent_error_line
    line = agent_error_line("vm1", 4, "internal error: KeyError: 'x'; report it (the agent's journal has the traceback)")
    assert line.count("report it") == 1 and line.startswith("vgpuhost: internal error in the vgpuhost agent")
    assert agent_error_line("vm1", 4, "the agent answered 500").endswith(" (report it)")


def _hook_xml_request(xml: str, headers: bytes) -> bytes:
    body = xml.encode()
    return (b"POST /v1/hook/prepare HTTP/1.1\r\nContent-Type: application/xml\r\n" + headers +
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def test_a_hook_header_given_twice_is_refused_not_taken_first_wins(agent, a40):
    """Trial 8 T4: two X-Vgpuhost-Root headers (the agent's own first, then another) were read first-wins and
    the domain prepared; each of the thin client's headers given twice is now 400, before the body is read."""
    from test_hook import vgpu_domain
    xml = vgpu_domain("vm1", "11111111-2222-4333-8444-0000000000a1", "aaaaaaaa-2222-4333-8444-0000000000a1")
    own = b"X-Vgpuhost-Domain: vm1\r\nX-Vgpuhost-Root: %s\r\nX-Vgpuhost-State-Dir: %s\r\n" % (
        str(a40.root).encode(), str(a40.state_dir).encode())
    for name, twice in (("X-Vgpuhost-Root", b"X-Vgpuhost-Root: /tmp/other\r\n"),
                        ("X-Vgpuhost-State-Dir", b"X-Vgpuhost-State-Dir: /tmp/other\r\n"),
                        ("X-Vgpuhost-Domain", b"X-Vgpuhost-Domain: vm2\r\n"),
                        ("X-Vgpuhost-Timeout", b"X-Vgpuhost-Timeout: 10\r\nX-Vgpuhost-Timeout: 20\r\n")):
        raw = _raw(agent.admin, _hook_xml_request(xml, own + twice))
        assert raw.startswith(b"HTTP/1.1 400 "), raw[:200]
        status, doc = _answer(raw)
        assert (status, doc["error"]["line"]) == (400, f"the request has more than one {name} header; send one"), doc
    _nothing_changed(a40)


def _until_head(s) -> bytes:
    """What the agent sends up to the end of its first status line and headers (or until it closes)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        raw += chunk
    return raw


def test_expect_100_continue_is_answered_only_once_the_request_passed_its_checks(agent, a40):
    """Trial 8 T5: ``100 Continue`` came before the role and body-limit checks (then 413 or 403).  Now a
    request refused before its body is read gets its final answer alone; one that passes gets ``100
    Continue``, then its answer once the body is sent."""
    expect = b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
    refused = [
        (agent.admin, b"POST /v1/reconcile HTTP/1.1\r\n" + expect + b"Content-Length: 100000000\r\n\r\n", 413,
         "the request body of 100000000 bytes is over the 64 KiB POST /v1/reconcile takes; send a smaller body"),
        (agent.ro, b"POST /v1/reconcile HTTP/1.1\r\n" + expect + b"Content-Length: 15\r\n\r\n", 403,
         "POST /v1/reconcile changes the host: not allowed for the read-only socket; use the admin socket as "
         f"root or a member of the group of gid {ADMIN_GID}"),
        (agent.admin, b"POST /v1/hook/prepare HTTP/1.1\r\nContent-Type: application/xml\r\nExpect: 100-continue\r\n"
                      b"X-Vgpuhost-Domain: vm1\r\nX-Vgpuhost-Domain: vm2\r\nContent-Length: 300\r\n\r\n", 400,
         "the request has more than one X-Vgpuhost-Domain header; send one"),
    ]
    for path, head, status, line in refused:
        s = unixsock.connect(path, 30)
        try:
            s.sendall(head)                     # the body is not sent: the client waits for 100 Continue
            raw = _until_head(s)
            assert not raw.startswith(b"HTTP/1.1 100"), raw
            head_end = raw.index(b"\r\n\r\n")
            length = int(dict(h.split(b": ", 1) for h in raw[:head_end].split(b"\r\n")[1:])[b"Content-Length"])
            while len(raw) < head_end + 4 + length:
                chunk = s.recv(1 << 16)
                assert chunk, raw
                raw += chunk
        finally:
            s.close()
        assert _answer(raw)[0] == status and _answer(raw)[1]["error"]["line"] == line, raw
    # a request that passes its checks: 100 Continue, and nothing more until the body comes
    body = b'{"check": true}'
    s = unixsock.connect(agent.admin, 30)
    try:
        s.sendall(b"POST /v1/reconcile HTTP/1.1\r\n" + expect + b"Content-Length: %d\r\n\r\n" % len(body))
        assert _until_head(s) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        raw = _rest(s)
    finally:
        s.close()
    status, doc = _answer(raw)
    assert status == 200 and doc["in_sync"] is True, doc
    _nothing_changed(a40)


def test_a_query_parameter_given_twice_is_refused_not_taken_last_wins(agent, a40):
    """``?profile=A&profile=B`` read as B (the last) silently; now 400 naming the key, as a hook header or a
    JSON key given twice is, on the cached path too (capacity for one profile read first)."""
    assert agent.call("GET", "/v1/capacity?profile=A40-4Q")[0] == 200
    for target, key in (("/v1/capacity?profile=A40-4Q&profile=A40-8Q", "profile"),
                        ("/v1/capacity?profile=A40-4Q&profile=A40-4Q", "profile"),
                        ("/v1/audit?since=1&since=2", "since"),
                        ("/v1/types?available=1&gpu=0000:21:00.0&available=0", "available"),
                        ("/v1/types?gpu=x&gpu=%01", "gpu")):
        status, doc = agent.call("GET", target)
        assert (status, doc["error"]["exit_code"], doc["error"]["line"]) == (
            400, 2, f"the query gives '{key}' more than once; give each query parameter once"), (target, doc)
    assert agent.call("GET", "/v1/audit?since=1h")[0] == 200
    _nothing_changed(a40)
