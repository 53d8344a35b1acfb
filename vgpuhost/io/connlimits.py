"""Limits on the connections a listening socket serves: shared by the agent's unix sockets and the metrics port.

Owns: :class:`DeadlineReader` (a connection's bytes with a gap limit and a whole-request deadline),
:class:`RefusalLog` (connections refused for want of a slot, logged as one line per interval, however
many: a storm is one line) and :func:`answer_and_close` (send a whole canned answer at accept, drop what
the peer already sent, close).  Used by :mod:`vgpuhost.agent.server` and
:func:`vgpuhost.ops.exporter.listen`.  Must not: parse HTTP or decide who may connect.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time


class DeadlineReader(io.RawIOBase):
    """The connection's bytes for :class:`io.BufferedReader`: each ``recv`` waits at most ``idle_s``,
    and none starts after ``total_s`` from the connection's start (TimeoutError; ``expired`` says which
    limit it was)."""

    def __init__(self, sock: socket.socket, idle_s: float, total_s: float):
        super().__init__()
        self.sock, self.idle_s = sock, idle_s
        self.until = time.monotonic() + total_s
        self.expired = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        left = self.until - time.monotonic()
        if left <= 0:
            self.expired = True
            raise TimeoutError("the request's deadline passed")
        self.sock.settimeout(min(self.idle_s, left))
        try:
            return self.sock.recv_into(buf)
        except TimeoutError:
            self.expired = left <= self.idle_s
            raise


class RefusalLog:
    """Counts connections refused on ``where`` (a socket path, ``address:port``) and logs them to ``log``
    as one warning line per ``interval_s`` at most, naming how many were refused since the last line.
    ``refused``: the count so far.  Thread-safe."""

    def __init__(self, log: logging.Logger, where: object, interval_s: float, clock=time.monotonic):
        self.log, self.where, self.interval_s, self.clock = log, where, interval_s, clock
        self.refused = 0
        self._lock = threading.Lock()
        self._warned_at = -interval_s - 1.0
        self._warned_count = 0

    def note(self, message: str) -> None:
        """One more connection refused, for ``message`` (the refusal's one line)."""
        with self._lock:
            self.refused += 1
            now = self.clock()
            if now - self._warned_at < self.interval_s:
                return
            n, self._warned_at, self._warned_count = self.refused - self._warned_count, now, self.refused
        self.log.warning("refused %d connection(s) on %s since the last such line: %s", n, self.where, message)


def answer_and_close(request: socket.socket, answer: bytes) -> None:
    """Send ``answer`` (a whole HTTP answer) on a connection not handed to a worker, drop what its
    peer has already sent (at most 1 MiB, never waiting for more), and close it."""
    try:
        request.settimeout(1.0)
        request.sendall(answer)
        request.setblocking(False)
        for _ in range(16):         # what the client already sent: a close with unread data
            if not request.recv(1 << 16):   # would reset the connection before it reads the answer
                break
    except OSError:
        pass
    try:
        request.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    request.close()
