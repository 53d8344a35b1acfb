"""A lean client of the vgpuhost agent's local API (HTTP/1.1 over its unix socket).

Owns: finding the agent's socket (:func:`socket_path`: ``$VGPUHOST_AGENT_SOCKET``,
else ``<root>/run/vgpuhost/agent.sock``), one request with a JSON body and
a JSON (or text) answer (:func:`call`).  Must not: import anything heavy
(the qemu hook imports it on every domain start: no :mod:`http.client`,
a few hundred bytes of HTTP by hand; json and the socket only in :func:`call`).

:func:`call` raises :class:`AgentDown` when nobody answers on the socket
(missing, refused, or the agent went away before it answered); callers
then do the work themselves.  Any answer, error documents included, is
returned as ``(status, document)``.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple
    from .hostroot import HostRoot

ENV_SOCKET = "VGPUHOST_AGENT_SOCKET"
#: ``off``: never use the agent (the hook and CLI do the work themselves)
ENV_USE = "VGPUHOST_AGENT"
MAX_ANSWER = 64 * 1024 * 1024
#: the agent's error documents (vgpuhost.agent.api.SCHEMA_ERROR): the last line of a streamed answer that failed
SCHEMA_ERROR = "vgpuhost.agent-error/v1"


class AgentDown(Exception):
    """Nobody answered on the agent's socket (the caller does the work itself)."""


def disabled() -> bool:
    """``$VGPUHOST_AGENT`` is ``off`` (or ``0``, ``no``): never use the agent."""
    return os.environ.get(ENV_USE, "").lower() in ("off", "0", "no")


def default_socket(root: str) -> str:
    """``<root>/run/vgpuhost/agent.sock``: where the agent listens by default."""
    return os.path.join(root, "run", "vgpuhost", "agent.sock")


def socket_path(host: "Optional[HostRoot]" = None, root: "Optional[str]" = None) -> "Optional[str]":
    """The admin socket to try: ``$VGPUHOST_AGENT_SOCKET``, else ``<root>/run/vgpuhost/agent.sock``;
    None when ``$VGPUHOST_AGENT`` is ``off``."""
    if disabled():
        return None
    given = os.environ.get(ENV_SOCKET)
    if given:
        return given
    return default_socket(host.s.root if host is not None else (root or "/"))


def call(path: str, method: str, target: str, body: "Optional[Dict[str, Any]]" = None, *,
         timeout_s: float = 120.0, on_line: "Optional[Callable[[Dict[str, Any]], None]]" = None) -> "Tuple[int, Any]":
    """``method target`` with ``body`` as JSON; ``(status, parsed JSON or text)``.

    A streamed answer (``application/x-ndjson``: one JSON object a line) gives each line but the last to
    ``on_line`` as it arrives, and returns the last: its ``status`` when it is an error document, else 200.
    ``timeout_s`` bounds each wait on the socket, so a long answer that keeps sending lines does not time
    out.  Raises AgentDown when the socket is missing or refuses, or the
    connection closes before a full answer; OSError for other socket
    errors (EACCES: the caller may not use this socket).
    """
    import stat
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise AgentDown(f"no agent on {path} (not a socket)")
    except (FileNotFoundError, NotADirectoryError):
        raise AgentDown(f"no agent on {path} (no such file)") from None
    import json     # only now: the qemu hook with no agent running imports no json (and re) for nothing
    from .unixsock import connect
    data = b"" if body is None else json.dumps(body).encode("utf-8")
    head = (f"{method} {target} HTTP/1.1\r\nHost: vgpuhost-agent\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode("ascii")
    try:
        sock = connect(path, timeout_s)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise AgentDown(f"no agent on {path} ({e.strerror})") from None
    chunks = []
    try:
        try:
            sock.sendall(head + data)
        except BrokenPipeError:
            pass            # answered and closed before the request was all sent (429, 413): read the answer
        size = 0
        lines = _Lines(on_line, json) if on_line is not None else None
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_ANSWER:
                raise OSError("the agent's answer is too large")
            if lines is not None:
                lines.feed(chunk)
    except (ConnectionResetError, BrokenPipeError) as e:
        if not chunks:      # a reset after the answer (the agent closed with our bytes unread) is the end
            raise AgentDown(f"the agent on {path} went away ({e.strerror})") from None
    finally:
        sock.close()
    from ..model.values import is_digits
    raw = b"".join(chunks)
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0:
        raise AgentDown(f"the agent on {path} closed the connection before answering")
    lines = raw[:head_end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not is_digits(parts[1]):
        raise AgentDown(f"the agent on {path} gave no HTTP status line")
    status = int(parts[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    payload = raw[head_end + 4:]
    if headers.get("content-type", "").startswith("application/x-ndjson"):
        last = [x for x in payload.split(b"\n") if x.strip()][-1:]
        if not last:
            raise AgentDown(f"the agent on {path} went away in the middle of its answer")
        doc = json.loads(last[0])
        if isinstance(doc, dict) and doc.get("schema") == "vgpuhost.progress/v1":
            raise AgentDown(f"the agent on {path} went away in the middle of its answer")
        error = isinstance(doc, dict) and doc.get("schema") == SCHEMA_ERROR
        return (int(doc.get("status", 500)) if error else status), doc
    n = headers.get("content-length")
    if is_digits(n) and len(payload) < int(n):
        raise AgentDown(f"the agent on {path} went away in the middle of its answer")
    if headers.get("content-type", "").startswith("application/json"):
        return status, json.loads(payload)
    return status, payload.decode("utf-8", "replace")


class _Lines:
    """Hands the progress lines of a streamed answer to a callback as they arrive (past the HTTP head;
    the last line, the answer's document, is left to :func:`call`)."""

    def __init__(self, on_line, json):
        self.on_line, self.json = on_line, json
        self.buf = b""
        self.in_body = False

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        if not self.in_body:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if b"application/x-ndjson" not in self.buf[:end].lower():
                self.on_line = None            # not a streamed answer: nothing to hand on
            self.buf, self.in_body = self.buf[end + 4:], True
        while self.on_line is not None and b"\n" in self.buf:
            line, _, self.buf = self.buf.partition(b"\n")
            doc = self.json.loads(line) if line.strip() else None
            if isinstance(doc, dict) and doc.get("schema") == "vgpuhost.progress/v1":
                self.on_line(doc)
