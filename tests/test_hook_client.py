"""The qemu hook's compiled thin client (vgpuhost/hook/client.c -> vgpuhost-hook-client).

The client is built with gcc for the session when ``make dev`` has not
built it next to the package (no skip under CI=true).  Real processes
throughout: the client run alone against scripted unix-socket servers (its
request byte for byte, its exit codes for every failure), and the
installed dispatcher run as libvirt runs it against a real ``vgpuhost
agent``, with outcomes read back from the simulated tree, the state store
and the agent's counters.  A hook installed with an interpreter that does
not exist and without curl can only succeed through the client.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import List, Optional

import pytest

from agentutil import AgentRun, socket_dir
from nsutil import skip_or_fail
from test_hook import DOM1, MDEV1, dispatch, domain_xml, mdevs, store, vgpu_domain
from vgpuhost.hook import install as hook_install

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "vgpuhost" / "hook" / "client.c"
NO_PYTHON = "/nonexistent/vgpuhost-test/python3"
NS = "https://vgpuhost.dev/xmlns/domain/1"
#: the client's own exit codes (client.c): the dispatcher falls back on 100 and up
EX_USAGE, EX_CONNECT, EX_TIMEOUT, EX_IO, EX_ANSWER, EX_INPUT = 100, 101, 102, 103, 104, 105


@pytest.fixture(scope="session")
def client(tmp_path_factory) -> str:
    """The client's path: the one ``make dev`` built next to the package when it is current, else one
    built here with gcc (no gcc: skip, or fail under CI)."""
    found = hook_install.find_client()
    if found and os.path.getmtime(found) >= os.path.getmtime(SOURCE):
        return found
    gcc = shutil.which("gcc") or shutil.which("cc")
    skip_or_fail(None if gcc else "no gcc or cc to build vgpuhost-hook-client", "the hook client tests")
    out = tmp_path_factory.mktemp("client") / hook_install.CLIENT_NAME
    subprocess.run([gcc, "-O2", "-Wall", "-Wextra", "-Werror", "-std=c99", "-D_FORTIFY_SOURCE=2",
                    "-o", str(out), str(SOURCE)], check=True, timeout=120)
    return str(out)


class Scripted:
    """A unix-socket server answering each connection with ``answer`` (bytes; None: never answers)
    after reading the request's head and Content-Length body; the requests it read in ``requests``."""

    def __init__(self, answer: Optional[bytes], split: int = 0):
        self.dir = socket_dir()
        self.path = os.path.join(self.dir, "agent.sock")
        self.answer = answer
        self.split = split                  # > 0: send that many bytes, wait 50 ms, then the rest
        self.requests: List[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                self.requests.append(head + b"\r\n\r\n" + body)
                if self.answer is None:
                    self.stop.wait(30)
                else:
                    try:
                        if self.split:
                            conn.sendall(self.answer[:self.split])
                            self.stop.wait(0.05)
                            conn.sendall(self.answer[self.split:])
                        else:
                            conn.sendall(self.answer)
                    except OSError:          # the client stopped reading (an answer over its limit)
                        pass

    def close(self) -> None:
        self.stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)    # wakes the accept() (a close alone does not on Linux)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(10)                        # no thread outlives its test (tests that fork follow)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Scripted":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def http(body: bytes, status: str = "200 OK", ctype: str = "text/plain; charset=utf-8") -> bytes:
    return (f"HTTP/1.1 {status}\r\nServer: scripted\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


def run_client(client: str, sock: str, data: bytes, *args: str, timeout_s: str = "10") -> subprocess.CompletedProcess:
    argv = list(args) or ["prepare", "vm1", "/host/root", "/host/state"]
    return subprocess.run([client, sock, *argv, timeout_s], input=data, capture_output=True, timeout=60)


# ---------------------------------------------------------------------------
# the client alone

def test_the_request_is_the_one_curl_sends(client):
    xml = f"<domain><name>vm1</name><metadata><v:vgpuhost xmlns:v='{NS}'/></metadata></domain>\n".encode()
    with Scripted(http(b"vgpuhost-hook/1 0")) as srv:
        proc = run_client(client, srv.path, xml)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b"")
        if shutil.which("curl"):
            subprocess.run(["curl", "-s", "--unix-socket", srv.path, "-H", "Content-Type: application/xml",
                            "-H", "Expect:", "-H", "X-Vgpuhost-Domain: vm1", "-H", "X-Vgpuhost-Root: /host/root",
                            "-H", "X-Vgpuhost-State-Dir: /host/state", "-H", "X-Vgpuhost-Timeout: 10",
                            "--data-binary", "@-",
                            "http://vgpuhost-agent/v1/hook/prepare"], input=xml, capture_output=True, timeout=60)
        requests = list(srv.requests)

    def parts(raw: bytes):
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(b":", 1) for h in lines[1:])}
        return lines[0], headers, body
    line, headers, body = parts(requests[0])
    assert line == b"POST /v1/hook/prepare HTTP/1.1" and body == xml
    assert headers[b"content-type"] == b"application/xml" and headers[b"content-length"] == str(len(xml)).encode()
    assert (headers[b"x-vgpuhost-domain"], headers[b"x-vgpuhost-root"], headers[b"x-vgpuhost-state-dir"]) == \
        (b"vm1", b"/host/root", b"/host/state")
    assert headers[b"host"] == b"vgpuhost-agent" and headers[b"x-vgpuhost-timeout"] == b"10"
    if len(requests) == 2:                          # curl's request: the same line, body and vgpuhost headers
        cline, cheaders, cbody = parts(requests[1])
        assert (cline, cbody) == (line, body)
        ignore = {b"user-agent", b"accept", b"connection"}
        assert {k: v for k, v in cheaders.items() if k not in ignore} == \
            {k: v for k, v in headers.items() if k not in ignore}


@pytest.mark.parametrize("answer, code, err", [
    (http(b"vgpuhost-hook/1 0"), 0, b""),
    (http(b"vgpuhost-hook/1 2\nvgpuhost: error: domain 'vm1': no such profile; pick one\n"), 2,
     b"vgpuhost: error: domain 'vm1': no such profile; pick one\n"),
    (http(b"vgpuhost-hook/1 3\nline one\n\n\n", status="500 Internal Server Error"), 3, b"line one\n"),
    (http(b"vgpuhost-hook/1 5\n"), 5, b""),
    # not the hook's answer: the dispatcher falls back, nothing printed
    (http(b'{"schema": "vgpuhost.agent-error/v1"}', status="421 Misdirected Request", ctype="application/json"),
     EX_ANSWER, b""),
    (http(b"vgpuhost-hook/1 130"), EX_ANSWER, b""),            # over 99: not an exit code the agent gives
    (http(b"vgpuhost-hook/1 x"), EX_ANSWER, b""),
    (http(b"vgpuhost-hook/1 "), EX_ANSWER, b""),
    (http(b"vgpuhost-hook/2 0"), EX_ANSWER, b""),
    (http(b"vgpuhost-hook/1 0 trailing"), EX_ANSWER, b""),
    (b"garbage\r\n\r\nvgpuhost-hook/1 0", EX_ANSWER, b""),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\nvgpuhost-hook/1 0", EX_ANSWER, b""),          # cut short
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n11\r\nvgpuhost-hook/1 0\r\n0\r\n\r\n", EX_ANSWER, b""),
    (http(b"vgpuhost-hook/1 0\n" + b"x" * (70 * 1024)), EX_ANSWER, b""),                          # over 64 KiB
    (b"", EX_ANSWER, b""),                                                                        # closed at once
    (b"HTTP/1.1 200 OK\r\n\r\nvgpuhost-hook/1 4\nno length: read to the end", 4, b"no length: read to the end\n"),
])
def test_answers_and_their_exit_codes(client, answer, code, err):
    with Scripted(answer) as srv:
        proc = run_client(client, srv.path, b"<domain/>")
    assert (proc.returncode, proc.stdout, proc.stderr) == (code, b"", err)


def test_failures_without_an_answer_have_their_own_exit_codes(client, tmp_path):
    xml = b"<domain/>"
    missing = run_client(client, str(tmp_path / "none.sock"), xml)
    dead_path = str(tmp_path / "dead.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(dead_path)                             # a socket file nobody listens on (an agent killed with -9)
    dead.close()
    refused = run_client(client, dead_path, xml)
    with Scripted(None) as srv:                      # reads the request, never answers
        slow = run_client(client, srv.path, xml, timeout_s="1")
        assert len(srv.requests) == 1
    with Scripted(http(b"vgpuhost-hook/1 0")) as srv:
        nul = run_client(client, srv.path, b"<domain>\0</domain>")
        big = run_client(client, srv.path, b"<domain>" + b" " * (4 * 1024 * 1024) + b"</domain>")
        usage = [
            subprocess.run([client], capture_output=True, timeout=60),
            run_client(client, srv.path, xml, "start", "vm1", "/r", "/s"),            # not prepare|release
            run_client(client, srv.path, xml, "prepare", "vm\n1", "/r", "/s"),        # a header injection
            run_client(client, srv.path, xml, "prepare", "vm1", "/r\r\nX-Evil: 1", "/s"),
            run_client(client, srv.path, xml, timeout_s="0"),
            run_client(client, srv.path, xml, timeout_s="ten"),
            run_client(client, "/" + "s" * 200, xml),                                  # longer than sun_path
        ]
        served = len(srv.requests)
    assert (missing.returncode, refused.returncode, slow.returncode) == (EX_CONNECT, EX_CONNECT, EX_TIMEOUT)
    assert (nul.returncode, big.returncode) == (EX_INPUT, EX_INPUT)
    assert [p.returncode for p in usage] == [EX_USAGE] * len(usage)
    assert served == 0                               # none of them reached the server
    for p in [missing, refused, slow, nul, big, *usage]:
        assert (p.stdout, p.stderr) == (b"", b"")


@pytest.mark.parametrize("split", [5, 10, 40])
def test_an_answer_in_pieces_is_read_whole(client, split):
    """An answer whose HTTP head arrives in more than one read is still the agent's answer (found by a
    breaker's scripted agent: the client took a head cut short for garbage and the work ran twice)."""
    with Scripted(http(b"vgpuhost-hook/1 2\nvgpuhost: error: no\n"), split=split) as srv:
        proc = run_client(client, srv.path, b"<domain/>")
    assert (proc.returncode, proc.stderr) == (2, b"vgpuhost: error: no\n")


def test_version_and_the_longest_timeout_hook_install_takes(client, make_host, tmp_path):
    assert subprocess.run([client, "--version"], capture_output=True, timeout=60).stdout == \
        hook_install.CLIENT_VERSION
    with Scripted(http(b"vgpuhost-hook/1 0")) as srv:
        # hook install --timeout 3600: the dispatcher passes 3605 (its + 5 s)
        assert run_client(client, srv.path, b"<domain/>", timeout_s="3605").returncode == 0
        assert run_client(client, srv.path, b"<domain/>", timeout_s="3606").returncode == EX_USAGE
    # a program that is not the client is refused at install (it would answer every start 'done')
    from vgpuhost.model.errors import InputError
    with pytest.raises(InputError, match="does not answer '--version'"):
        hook_install.render(make_host("a40-mdev"), client="/bin/true")


def test_hook_mode_failures_of_the_client_itself_say_so(client):
    """In --hook mode the client's own failure is one line and an exit code of vgpuhost's table (4: the
    dispatcher and client disagree; reinstall), never a silent 100..106 that fails the start."""
    proc = subprocess.run([client, "--hook", "prepare", "/nonexistent.sock", "ten", "/bin/sh", "1", "vm1",
                           "/bin/true"], input=b"<domain/>", capture_output=True, timeout=60)
    assert proc.returncode == 4
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vgpuhost: error: the hook's client") and "hook install" in lines[0]


# ---------------------------------------------------------------------------
# the installed dispatcher with the client, against a real agent

def _install(host, where: Path, client: str, **kw) -> Path:
    return Path(hook_install.install(host, hooks_dir=where / "qemu.d", client=client, **kw).path)


def test_client_end_to_end_no_python_no_curl(make_host, tmp_path, client):
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, client, python=NO_PYTHON, curl=False)
    text = hook.read_text()
    assert f"for c in '{client}'; do\n" in text and "\tfor d in ; do\n" in text
    xml = vgpu_domain("thin1", DOM1, MDEV1).encode()
    with AgentRun(host.root, str(host.path("run", "vgpuhost"))) as agent:
        proc = dispatch(hook, ["thin1", "prepare", "begin", "-"], xml)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b""), proc.stderr
        assert mdevs(host) == {MDEV1: "nvidia-566"}
        assert [r.owner for r in store(host).vgpu_records()] == [DOM1]
        proc = dispatch(hook, ["thin1", "release", "end", "-"], xml)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {}
        # refused by the agent: the hook's own line and exit code, through the client
        bad = vgpu_domain("thin-bad", DOM1, MDEV1, "A40-7Q").encode()
        refused = dispatch(hook, ["thin-bad", "prepare", "begin", "-"], bad)
        info = agent.call("GET", "/v1/agent")[1]
    assert info["served_thin_client"] == {"POST /v1/hook/prepare": 2, "POST /v1/hook/release": 1}
    assert store(host).vgpu_records() == [] and store(host).active_domains() == {}
    local = dispatch(_install(host, tmp_path / "local", "none"), ["thin-bad", "prepare", "begin", "-"], bad)
    assert local.returncode == 2 and b"unknown vGPU profile 'A40-7Q'" in local.stderr
    assert (refused.returncode, refused.stdout, refused.stderr) == (local.returncode, b"", local.stderr)
    # agent down: the client cannot connect, the dispatcher starts the interpreter this install lacks
    proc = dispatch(hook, ["thin1", "prepare", "begin", "-"], xml)
    assert proc.returncode == 127 and mdevs(host) == {}


def test_fallback_to_the_handler_when_the_agent_is_down_or_answers_garbage(make_host, tmp_path, client):
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, client, curl=False)
    xml = vgpu_domain("fb", DOM1, MDEV1).encode()
    sdir = host.path("run", "vgpuhost")

    def start_stop() -> None:
        proc = dispatch(hook, ["fb", "prepare", "begin", "-"], xml)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {MDEV1: "nvidia-566"}
        proc = dispatch(hook, ["fb", "release", "end", "-"], xml)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {}
    start_stop()                                     # no socket
    sdir.mkdir(parents=True)
    for answer in (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"not http at all\r\n\r\n"):
        srv = Scripted(answer)
        try:
            os.symlink(srv.path, sdir / "agent.sock")
            start_stop()
            assert len(srv.requests) == 2            # the client asked; the handler then did the work
        finally:
            os.unlink(sdir / "agent.sock")
            srv.close()
    assert store(host).vgpu_records() == [] and store(host).active_domains() == {}


def test_an_oversized_xml_is_refused_as_the_handler_refuses_it(make_host, tmp_path, client):
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, client, curl=False)
    pad = b"<!-- " + b"x" * (4 * 1024 * 1024) + b" -->\n"
    xml = vgpu_domain("big", DOM1, MDEV1).encode().replace(b"<devices>", pad + b"<devices>")
    local = dispatch(_install(host, tmp_path / "sh", "none"), ["big", "prepare", "begin", "-"], xml)   # the handler
    with AgentRun(host.root, str(host.path("run", "vgpuhost"))) as agent:
        proc = dispatch(hook, ["big", "prepare", "begin", "-"], xml)
        info = agent.call("GET", "/v1/agent")[1]
    assert local.returncode == 2 and b"vgpuhost reads at most" in local.stderr
    assert (proc.returncode, proc.stderr) == (local.returncode, local.stderr)
    assert info["served_thin_client"] == {} and mdevs(host) == {}


#: forks the dispatcher from a small process (a child of this one would start with its peak RSS) and
#: writes the dispatcher's peak RSS (KiB) to the file argv[1]
_LAUNCH = ("import os, sys\npid = os.fork()\nif pid == 0:\n    os.execv(sys.argv[2], sys.argv[2:])\n"
           "_, status, usage = os.wait4(pid, 0)\nopen(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
           "sys.exit(os.waitstatus_to_exitcode(status))\n")


def _fed(hook: Path, argv: List[str], parts: List[bytes]):
    """Run the installed dispatcher as :func:`dispatch` does, writing ``parts`` to its stdin one after
    another until it stops reading: ``(exit code, stderr, bytes it took, its peak RSS in KiB)``, the RSS
    of the process the dispatcher is (it execs the client, which may exec it again)."""
    import sys
    import tempfile
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C"}
    rss_file = tempfile.NamedTemporaryFile(prefix="vgpuhost-rss-", delete=False)
    rss_file.close()
    proc = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCH, rss_file.name, str(hook), *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    took = [0]

    def feed() -> None:
        try:
            for part in parts:
                view = memoryview(part)
                for at in range(0, len(view), 1 << 20):
                    proc.stdin.write(view[at:at + (1 << 20)])
                    took[0] += len(view[at:at + (1 << 20)])
            proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    err = proc.stderr.read()
    proc.wait(120)
    writer.join(60)
    rss = int(Path(rss_file.name).read_text())
    os.unlink(rss_file.name)
    return proc.returncode, err, took[0], rss


def test_an_oversized_xml_at_prepare_is_decided_without_holding_it(make_host, tmp_path, client):
    """final8 F1: with the client installed (the agent up or not), a domain XML over 4 MiB at 'prepare
    begin' is not handed back whole to the sh dispatcher (150 MB in, 295 MB of memory): the client refuses
    it with the handler's line and exit 2 as soon as what it read names vgpuhost or a host device (the rest
    never read), scans the rest a piece at a time where it does not, and lets a document naming neither
    through (exit 0), as the sh does.  Nothing reaches the agent; nothing changes."""
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, client, curl=False)
    sh = _install(host, tmp_path / "sh", "none", curl=False)    # the sh dispatcher and the handler alone
    sdir = host.path("run", "vgpuhost")
    sdir.mkdir(parents=True)
    xml = vgpu_domain("vm3", DOM1, MDEV1).encode()
    head, tail = xml.split(b"<devices>")
    plain_head, plain_tail = domain_xml("vm4", DOM1).encode().split(b"<devices>")
    pad = b" " * (40 << 20)
    with Scripted(http(b"vgpuhost-hook/1 0")) as srv:
        os.symlink(srv.path, sdir / "agent.sock")
        # vgpuhost's namespace in the first 4 MiB: refused at once, the rest of the 40 MiB never read
        code, err, took, rss = _fed(hook, ["vm3", "prepare", "begin", "-"], [head, pad, b"<devices>" + tail])
        want = dispatch(sh, ["vm3", "prepare", "begin", "-"], head + b" " * (5 << 20) + b"<devices>" + tail)
        assert want.returncode == 2 and b"domain XML is over 4194304 bytes" in want.stderr, want.stderr
        assert (code, err) == (want.returncode, want.stderr)
        assert took < (12 << 20) and rss < (16 << 10), (took, rss)
        # the host device only after the padding (the F1 document): the rest is scanned, never held
        late = [plain_head, pad, b"<devices><hostdev mode='subsystem' type='pci'/>" + plain_tail]
        code, err, took, rss = _fed(hook, ["vm4", "prepare", "begin", "-"], late)
        want = dispatch(sh, ["vm4", "prepare", "begin", "-"], b"".join([plain_head, b" " * (5 << 20), late[2]]))
        assert want.returncode == 2 and (code, err) == (want.returncode, want.stderr), (code, err, want.stderr)
        assert rss < (16 << 10), rss
        # naming neither: nothing to do, as the sh decides; a NUL byte read: the dispatcher's own line
        code, err, took, rss = _fed(hook, ["vm4", "prepare", "begin", "-"], [plain_head, pad, b"<devices>" + plain_tail])
        assert (code, err) == (0, b"") and took == len(plain_head) + len(pad) + len(plain_tail) + 9 and rss < (16 << 10)
        nul = [head, b"\0" + b" " * (5 << 20), b"<devices>" + tail]
        want = dispatch(sh, ["vm3", "prepare", "begin", "-"], b"".join(nul))
        assert want.returncode == 2 and b"NUL byte" in want.stderr
        assert _fed(hook, ["vm3", "prepare", "begin", "-"], nul)[:2] == (want.returncode, want.stderr)
        assert srv.requests == []
    assert mdevs(host) == {}
    assert not (host.state_dir / "state.db").exists() or store(host).vgpu_records() == []


def _served(agent) -> dict:
    return agent.call("GET", "/v1/agent")[1]["served"]


def test_hook_mode_makes_the_dispatchers_checks_on_the_xml(make_host, tmp_path, client):
    """With the agent up the dispatcher execs the client before reading the XML: the client decides
    what the sh would (vgpuhost's namespace, the store's domain marker, a NUL byte) and only the
    calls the sh would hand over reach the agent."""
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, client, python=NO_PYTHON, curl=False)
    sh = _install(host, tmp_path / "sh", "none")            # the same checks made by the sh itself
    plain = domain_xml("plain", DOM1).encode()
    two = domain_xml("two", DOM1).replace("</uuid>", "</uuid><uuid>" + DOM1 + "</uuid>", 1).encode()
    xml = vgpu_domain("hm", DOM1, MDEV1).encode()
    with AgentRun(host.root, str(host.path("run", "vgpuhost"))) as agent:
        for op, sub in (("prepare", "begin"), ("start", "begin"), ("stopped", "end")):
            proc = dispatch(hook, ["plain", op, sub, "-"], plain)
            assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b"")
        assert _served(agent).get("POST /v1/hook/prepare") is None
        # started through the hook: its release reaches the agent even with the metadata gone
        assert dispatch(hook, ["hm", "prepare", "begin", "-"], xml).returncode == 0
        assert mdevs(host) == {MDEV1: "nvidia-566"} and os.path.exists(host.state_dir / "domains" / DOM1)
        proc = dispatch(hook, ["hm", "release", "end", "-"], plain)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {}
        assert store(host).active_domains() == {}
        # released: no marker for its UUID, the release ends in the client; two <uuid>s go on to the agent
        assert dispatch(hook, ["plain", "release", "end", "-"], plain).returncode == 0
        assert _served(agent).get("POST /v1/hook/release") == 1
        assert dispatch(hook, ["two", "release", "end", "-"], two).returncode == 0
        # a NUL byte: the dispatcher's own line and exit code, nothing handed over
        nul = xml.replace(b"<devices>", b"<devices>\0")
        got = dispatch(hook, ["hm", "prepare", "begin", "-"], nul)
        served = _served(agent)
    want = dispatch(sh, ["hm", "prepare", "begin", "-"], nul)
    assert want.returncode == 2 and b"NUL byte" in want.stderr
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert (served.get("POST /v1/hook/prepare"), served.get("POST /v1/hook/release")) == (1, 2)
    assert mdevs(host) == {}


def test_hook_mode_falls_back_on_a_timeout_a_large_xml_and_an_odd_name(make_host, tmp_path, client):
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, client, curl=False, timeout_s=1)
    sdir = host.path("run", "vgpuhost")
    sdir.mkdir(parents=True)
    # over the pipe's 64 KiB: the handler gets the XML from a writer child
    pad = b"<!-- " + b"x" * (200 * 1024) + b" -->\n"
    big = vgpu_domain("to", DOM1, MDEV1).encode().replace(b"<devices>", pad + b"<devices>")
    with Scripted(None) as srv:                      # takes the call, never answers: 1 + 5 s, then the handler
        os.symlink(srv.path, sdir / "agent.sock")
        try:
            proc = dispatch(hook, ["to", "prepare", "begin", "-"], big)
            assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {MDEV1: "nvidia-566"}
            assert len(srv.requests) == 1 and srv.requests[0].endswith(big)
        finally:
            os.unlink(sdir / "agent.sock")
    xml = vgpu_domain("odd", DOM1, MDEV1).encode()
    # the agent part under the default hook timeout: with 1 s, the release's remove write would have
    # the 0.05 s floor (io/vfioholders.remove_timeout_s keeps 2 s before the hook's deadline), too short
    # for a detached writer on a busy machine (one CI failure: "did not finish within 0.05 s")
    hook = _install(host, tmp_path / "default", client, curl=False)
    with AgentRun(host.root, str(sdir)) as agent:
        # a name that cannot travel in a header: the handler does the work itself
        proc = dispatch(hook, ["odd\x7fname", "release", "end", "-"], xml)
        assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {}
        # over 4 MiB at prepare, naming neither vgpuhost nor a host device: nothing to do, as the sh decides
        # (the client scans the rest a piece at a time: test_an_oversized_xml_at_prepare_is_decided_...)
        huge_plain = domain_xml("huge", DOM1).encode().replace(b"<devices>", b"<!-- " + b"y" * (5 << 20) + b" -->")
        assert dispatch(hook, ["huge", "prepare", "begin", "-"], huge_plain).returncode == 0
        served = _served(agent)
    assert "POST /v1/hook/prepare" not in served and "POST /v1/hook/release" not in served
    assert store(host).active_domains() == {} and store(host).vgpu_records() == []


def test_hook_mode_without_the_handlers_interpreter(make_host, tmp_path, client):
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, client, python=NO_PYTHON, curl=False)
    sdir = host.path("run", "vgpuhost")
    sdir.mkdir(parents=True)
    with Scripted(http(b"not the hook's answer")) as srv:
        os.symlink(srv.path, sdir / "agent.sock")
        proc = dispatch(hook, ["gone", "prepare", "begin", "-"], vgpu_domain("gone", DOM1, MDEV1).encode())
    assert proc.returncode == 127 and NO_PYTHON.encode() in proc.stderr and mdevs(host) == {}
    assert len(srv.requests) == 1


def test_install_looks_for_the_client_where_make_dev_and_the_package_put_it(make_host, tmp_path, client):
    host = make_host("a40-mdev")
    here = Path(hook_install.__file__).resolve().parent / hook_install.CLIENT_NAME
    text = hook_install.render(host)
    assert f"for c in '{here}' '/usr/lib/vgpuhost/vgpuhost-hook-client'; do\n" in text
    assert "for c in ; do\n" in hook_install.render(host, client="none")
    assert "for c in ; do\n" in hook_install.render(host, curl=False)
    assert f"for c in '{client}'; do\n" in hook_install.render(host, client=client)
    from vgpuhost.model.errors import InputError
    with pytest.raises(InputError):
        hook_install.render(host, client="relative/vgpuhost-hook-client")
    with pytest.raises(InputError):
        hook_install.render(host, client=str(tmp_path / "missing"))
    # installed with --client PATH or none: still current (status reads the choice back)
    for choice in (client, "none"):
        hook = _install(host, tmp_path / choice.strip("/").replace("/", "-"), choice)
        st = hook_install.status(host, hooks_dir=hook.parent)
        assert st["current"], (choice, st)
    # the default: the text does not change when the client is built later or removed
    hook = _install(host, tmp_path / "default", None)
    assert hook_install.status(host, hooks_dir=hook.parent)["current"]


def test_the_agent_starts_no_work_after_the_client_stopped_waiting(make_host, tmp_path, client):
    """The client tells the agent how long it waits (``X-Vgpuhost-Timeout``); the agent waits for locks
    only until then and starts nothing after it.  Found by a breaker: with the GPU's lock held past the
    hook's timeout, the agent made the mdev after the start had already failed."""
    from vgpuhost.io.locks import file_lock
    host = make_host("a40-mdev")
    hook = _install(host, tmp_path, client, python=NO_PYTHON, curl=False, timeout_s=1)   # client waits 1 + 5 s
    xml = vgpu_domain("late", DOM1, MDEV1).encode()
    with AgentRun(host.root, str(host.path("run", "vgpuhost"))):
        with file_lock(host.state_dir, "gpu-0000:81:00.0"):         # another operation holds the A40
            proc = dispatch(hook, ["late", "prepare", "begin", "-"], xml)
        err = proc.stderr.decode()
        # the agent's answer (transient, one line), not the client's timeout and fallback (127: no Python)
        assert proc.returncode == 5 and err.count("\n") == 1 and "held lock" in err, err
        time.sleep(1.0)                                              # the lock is free now: still nothing
        assert mdevs(host) == {} and store(host).active_domains() == {}
