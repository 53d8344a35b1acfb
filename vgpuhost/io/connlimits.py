"""Limits on the connections a listening socket serves: shared by the agent's unix sockets and the metrics port.

Owns: :class:`DeadlineReader` (a connection's bytes with a gap limit and a whole-request deadline),
:class:`RefusalLog` (connections refused for want of a slot, logged as one line per interval, however
many: a storm is one line) and :func:`answer_and_close` (send a whole canned answer at accept, shut the
writing side, and close once the peer is done, through one shared :class:`Lingerer` thread).  Used by
:mod:`vgpuhost.agent.server` and :func:`vgpuhost.ops.exporter.listen`.  Must not: parse HTTP or decide who may connect.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import select
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


class Lingerer:
    """Closes connections answered at accept once their peer has had its say: each handed connection
    (its whole answer sent and its writing side shut, so the peer reads the answer and then end of file)
    is kept open until its peer closes, sends more than ``max_bytes``, or ``linger_s`` passed, whichever
    comes first; what the peer sends meanwhile is read and dropped.  Without this a peer that sends its
    request after the answer came (curl, any client that writes before it reads) finds the connection
    closed: EPIPE on a unix socket, a reset over TCP that may discard the answer unread.

    One daemon thread for all of them (started at a hand when none runs, ending when it holds none), one
    epoll set, woken at most every
    ``batch_s`` while connections are held (a flood's closes are done in batches, not one wake-up each);
    at most ``max_held`` held at once (beyond, a connection is closed at once, as before): a flood of
    refused connections gets no thread and no slot, only a file descriptor for at most ``linger_s``."""

    def __init__(self, linger_s: float = 1.0, max_held: int = 256, max_bytes: int = 1 << 20,
                 batch_s: float = 0.01):
        self.linger_s, self.max_held, self.max_bytes, self.batch_s = linger_s, max_held, max_bytes, batch_s
        self._held: "dict[int, list]" = {}          # fd -> [socket, bytes read]; written by hand, read by _run
        self._order: "collections.deque" = collections.deque()     # (deadline, fd, socket), oldest first
        self._epoll: "select.epoll | None" = None
        self._start = threading.Lock()

    def hand(self, sock: socket.socket) -> None:
        """Keep ``sock`` (answered, writing side shut, its descriptor non-blocking: a socket with a timeout
        is) until its peer is done, then close it (see above).  Thread-safe."""
        with self._start:
            if len(self._held) >= self.max_held:
                sock.close()
                return
            if self._epoll is None:         # the thread ends when it holds nothing: start one
                self._epoll = select.epoll()
                threading.Thread(target=self._run, args=(self._epoll,), name="vgpuhost-linger", daemon=True).start()
            fd = sock.fileno()
            self._held[fd] = [sock, 0]
            try:
                self._epoll.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
            except (OSError, ValueError):
                del self._held[fd]
                sock.close()
                return
            self._order.append((time.monotonic() + self.linger_s, fd, sock))

    @property
    def held(self) -> int:
        """How many connections are held now."""
        return len(self._held)

    def _drop(self, fd: int, sock: socket.socket) -> None:
        """Close ``sock`` if it is still the one held as ``fd`` (only :meth:`_run` calls it)."""
        entry = self._held.get(fd)
        if entry is not None and entry[0] is sock:
            del self._held[fd]              # before the close: the descriptor's number is free only after it
            sock.close()                    # which takes it out of the epoll set

    def _run(self, epoll: "select.epoll") -> None:
        held, order, read = self._held, self._order, os.read
        while True:
            if not order:
                # nothing held: the thread ends (a process that forks, a test's, holds no idle thread);
                # the next hand starts another, under the same lock
                with self._start:
                    if not order:
                        self._epoll = None
                        epoll.close()
                        return
                continue
            now = time.monotonic()
            while order and order[0][0] <= now:
                _, fd, sock = order.popleft()
                self._drop(fd, sock)
            if not order:
                continue
            for fd, _ in epoll.poll(order[0][0] - now):
                entry = held.get(fd)
                if entry is None:
                    continue
                try:
                    chunk = read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                entry[1] += len(chunk)
                if not chunk or entry[1] > self.max_bytes:
                    self._drop(fd, entry[0])
            # the entries already closed at the front go now (their deadline would drop them anyway)
            while order and held.get(order[0][1], (None,))[0] is not order[0][2]:
                order.popleft()
            time.sleep(self.batch_s)


_LINGER = Lingerer()


def answer_and_close(request: socket.socket, answer: bytes) -> None:
    """Send ``answer`` (a whole HTTP answer) on a connection not handed to a worker, shut its writing
    side (the peer reads the answer, then end of file) and have :class:`Lingerer` close it once the peer
    closes (what it sends meanwhile, its request, read and dropped), after at most 1 s: the peer's request
    may come after the answer without finding the connection gone."""
    try:
        request.settimeout(1.0)         # which makes its descriptor non-blocking, as the Lingerer reads it
        request.sendall(answer)
        request.shutdown(socket.SHUT_WR)
    except OSError:
        request.close()
        return
    _LINGER.hand(request)
