"""The resident writer: one small process, started once, that makes a long-lived process's bounded writes.

Owns: :class:`Writers`, the pool of writer processes of this process, which
:meth:`vgpuhost.io.sysfs.Sysfs.write_bounded` hands each write to once :func:`keep_writer` was called (the agent
calls it once it listens: :func:`vgpuhost.__main__.serve_agent`), and :func:`serve`, the writer's own loop.  A process
that has not called it (the one-shot qemu hook, the CLI: one bounded write per process at most, or a few) makes
each bounded write in a forked child (:func:`vgpuhost.io.sysfs._write_detached`), which costs it less than a
writer's start.
Must not: decide anything; interpret errnos (the caller does).

Why: a bounded write (an mdev ``remove``, which the kernel may block without end: docs/reference/hardware.md#mdev)
runs outside the calling process, so that a write blocked in the kernel, uninterruptible, never holds one of
its threads or keeps it from exiting.  A fork per write costs the size of the caller's page tables: 1.74 ms of
the ~100 MB agent's CPU per release (2026-12-07), more than the rest of its remove.  A writer started once and
handed each write over a pipe costs a round trip (two small pipe writes and reads) per write instead.

The writer is a fresh interpreter (``python -I -S``, the package's directory first on ``sys.path``), not a fork
of the caller: it holds no fd of the caller (subprocess's ``close_fds``: no lock, socket or libvirt pipe), its
own session (``setsid``), stdin/stdout its request and answer pipes, stderr on /dev/null; and a fork of the
agent after its threads run would copy their locks in whatever state they were (an exec'd writer has no such
hazard, so it could start at any time).  The first one starts when the agent starts listening
(:func:`keep_writer`; an agent refused before that starts none), and a writer's successor as soon as it is
abandoned or found dead: a write's ``timeout_s`` counts from the write's start, as before (the agent waits at most that long), and a fresh
interpreter's start (about 30 ms of CPU, more wall time under load) would otherwise be in the first write's
bound and wall time.  An agent that never removes anything keeps one idle writer, a small process.

Protocol, one request at a time per writer: a request is one line of JSON ``[ROOT, PATH, VALUE, ENV]``
(``ROOT`` the simulated host root whose simulated kernel makes the write, ``""`` for a real one, where the
write is one ``write(2)``; ``ENV`` the simulator's environment variables as the caller has them now,
``{name: value or null}``, so a writer that lives long follows the caller's: its time file, its write log);
the answer one line, the errno (0: written).  A writer's first line, once it has imported what it needs, is
``ready``: one that ends before it (its start failed) took nothing, and :meth:`Writers.write` raises OSError,
so :meth:`vgpuhost.io.sysfs.Sysfs.write_bounded` makes that write in a forked child, as without a resident
writer (a broken start costs a write its fork, never the write).  The simulator re-reads the host's state at every write
(:meth:`vgpuhost.sim.kernel.SimKernel.write`), so a writer that lives long never acts on a stale one.

Lifecycle: an idle writer waits for the next request; several callers at once take one idle writer each (a
new one when none is idle; at most :data:`IDLE_KEPT` are kept idle).  A writer whose answer does not come in
``timeout_s`` (a remove blocked in the kernel) is abandoned: its pipes are closed here, so once its write
returns it finds its answer pipe closed or its request pipe at end of file and exits.  Each writer has a daemon
thread waiting for it from its start, so whenever it ends it is reaped (no zombie while this process runs, and
no thread of this process is held by a blocked writer in a way that matters: the thread is a daemon).
The next write gets another writer (started at once, idle meanwhile).  A writer found dead before a request is
replaced; one that dies during a write answers nothing: that write's errno is EIO, as a detached child's that
closed its pipe unanswered.  When
this process ends, every idle writer reads end of file and exits; a blocked one exits once its write returns.
"""

from __future__ import annotations

import errno
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from .hostroot import HostRoot
from .sysfs import Sysfs, _write_once, set_bounded_writer

#: idle writers kept for the next write (more are started when writes come at once, and ended when they return)
IDLE_KEPT = 2
#: the simulated kernels a writer keeps (one per simulated host root it has written under; the agent has one)
_KERNELS_KEPT = 8
#: the most bytes an answer takes (an errno and a newline)
_ANSWER_BYTES = 64
#: :meth:`Writer.ask`: the writer ended during the write, without an answer (the write's errno: EIO)
UNANSWERED = -1
#: :meth:`Writer.ask`: the writer had ended before the request was sent (nothing written)
UNSENT = -2
#: :meth:`Writer.ask`: the writer ended before it was ready (its start failed; nothing written)
NOT_STARTED = -3
#: a writer's first line, once it has imported what it needs
READY = b"ready"
#: the writer process's code (``python -I -S -c CODE PACKAGE_PARENT``)
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from vgpuhost.io.residentwriter import serve; serve()"


def _package_parent() -> str:
    """The directory holding the ``vgpuhost`` package this module belongs to."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Writer:
    """One writer process (:func:`serve`) and its two pipes, seen from the caller."""

    def __init__(self) -> None:
        """Start the writer.  Raises OSError when it cannot be started (no processes left, no interpreter)."""
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, _package_parent()],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     close_fds=True, start_new_session=True, bufsize=0)
        self.pid = self.proc.pid
        #: whether it has said it is ready (:data:`READY`, its first line)
        self.ready = False
        self._buffer = b""
        # its reaper: a daemon thread waiting for it from its start, so a writer that ends for any reason
        # (abandoned and done, killed while idle) is reaped at once, never a zombie while this process runs
        threading.Thread(target=self.proc.wait, name=f"vgpuhost-writer-reaper-{self.pid}", daemon=True).start()

    def alive(self) -> bool:
        """Whether the writer still runs, as far as its reaper has seen (one that ended an instant ago may
        still count as alive: a request to it then finds its pipe closed, :data:`UNSENT`)."""
        return self.proc.returncode is None

    def ask(self, request: bytes, timeout_s: float) -> Optional[int]:
        """Send one request line; the errno answered (0: written), None when no answer came within
        ``timeout_s`` seconds (a writer still starting then makes the write once started: the request waits in
        its pipe), :data:`UNANSWERED` when the writer ended without answering (it died during the write),
        :data:`UNSENT` when it had ended before the request could be sent, :data:`NOT_STARTED` when it ended
        before it was ready (its start failed; in neither case was anything written)."""
        try:
            os.write(self.proc.stdin.fileno(), request)     # a line of a few hundred bytes: one write(2)
        except (BrokenPipeError, ConnectionResetError):
            return UNSENT if self.ready else NOT_STARTED
        out = self.proc.stdout.fileno()
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            try:
                ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    return None
                data = os.read(out, _ANSWER_BYTES)
            except OSError:
                return UNANSWERED      # no answer can be read: as if it had died (it may have written)
            if not data:
                return UNANSWERED if self.ready else NOT_STARTED
            self._buffer += data
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                if line == READY and not self.ready:
                    self.ready = True
                elif self.ready and line.isdigit():
                    return int(line)
                else:
                    return UNANSWERED           # not this protocol: never trusted again

    def close(self) -> None:
        """Close both pipes: an idle writer then reads end of file and exits, a busy one once its write has
        returned (its reaper reaps it)."""
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Writers:
    """This process's writers: :meth:`write` hands a bounded write to an idle one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: List[Writer] = []
        #: writers started, in all (a count, for tests and the agent's status)
        self.started = 0
        #: a writer ended before it was ready (its start fails: a broken installation): no more are started, and
        #: every write raises OSError (the caller forks a child per write, as without resident writers)
        self.broken = False

    def write(self, root: str, path: str, value: str, env: Dict[str, Optional[str]],
              timeout_s: float) -> Optional[int]:
        """Make one write in a writer: its errno (0: written), None when it did not return within
        ``timeout_s`` seconds (the writer is abandoned; it finishes the write by itself).  ``root``: the
        simulated host root whose kernel makes the write, ``""`` on a real root.  ``env``: the simulator's
        environment variables the writer takes for this write.  Raises OSError when no writer can be started
        (none could be run, or the one run ended before it was ready, and then :attr:`broken`): nothing was
        written."""
        if self.broken:
            raise OSError(errno.ECHILD, "the resident writer cannot start")
        request = (json.dumps([root, path, value, env]) + "\n").encode("utf-8")
        writer = self._take()
        got = writer.ask(request, timeout_s)
        if got == UNSENT:                   # it died idle, after _take saw it alive: another one, once
            writer.close()
            writer = self._take()
            got = writer.ask(request, timeout_s)
        if got == NOT_STARTED:
            writer.close()
            self.broken = True
            raise OSError(errno.ECHILD, f"the resident writer (pid {writer.pid}) ended before it was ready")
        if got is None or got < 0:
            writer.close()                  # blocked (abandoned) or dead: never handed out again
            try:
                self.start_spare()          # its successor starts now, not in the next write's bound
            except OSError:
                pass                        # the next write tries again
            return None if got is None else errno.EIO
        self._give_back(writer)
        return got

    def start_spare(self) -> None:
        """Start a writer now, to wait idle for the next write, unless one is idle already: a write's
        ``timeout_s`` counts from its start, and a fresh interpreter's start takes some of it (about 30 ms of
        CPU).  Raises OSError when it cannot be started."""
        with self._lock:
            if self._idle:
                return
            self.started += 1
        w = Writer()
        self._give_back(w)

    def _take(self) -> Writer:
        """An idle writer that is alive, or a new one."""
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.alive():
                    return w
                w.close()                   # died while idle (killed): replaced
            self.started += 1
        return Writer()

    def _give_back(self, writer: Writer) -> None:
        with self._lock:
            if len(self._idle) < IDLE_KEPT:
                self._idle.append(writer)
                return
        writer.close()

    def idle_pids(self) -> List[int]:
        """The pids of the idle writers (for tests and benchmarks)."""
        with self._lock:
            return [w.pid for w in self._idle]

    def close(self) -> None:
        """End every idle writer (each reads end of file); a later write starts a new one."""
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.close()


#: this process's writers, once :func:`keep_writer` was called
_writers: Optional[Writers] = None


def keep_writer() -> Writers:
    """Make this process's bounded writes (:meth:`vgpuhost.io.sysfs.Sysfs.write_bounded`) through resident
    writers from now on, and start the first now; this process's :class:`Writers`.  For a long-lived process
    (the agent, at its start); calling it again changes nothing."""
    global _writers
    if _writers is None:
        _writers = Writers()
        set_bounded_writer(_writers.write)
        try:
            _writers.start_spare()
        except OSError:
            pass                            # the first write tries again (and raises then)
    return _writers


def let_writers_go() -> None:
    """Undo :func:`keep_writer`: bounded writes fork a child per write again, and the idle writers end (each
    reads end of file); a blocked one ends once its write returns.  For a process whose long life ends (the
    agent stopping in a process that goes on: the tests)."""
    global _writers
    if _writers is not None:
        set_bounded_writer(None)
        _writers.close()
        _writers = None


def serve(requests=None, answers=None) -> None:
    """The writer's loop: read a request line from ``requests`` (stdin's binary stream), make the write, write
    the errno line to ``answers`` (stdout's fd); return at end of file, or when the answer cannot be written
    (the caller has gone or abandoned this writer)."""
    requests = requests if requests is not None else sys.stdin.buffer
    answers = answers if answers is not None else sys.stdout.fileno()
    kernels: Dict[str, object] = {}
    try:
        os.write(answers, READY + b"\n")
    except OSError:
        return
    while True:
        line = requests.readline()
        if not line:
            return
        try:
            root, path, value, env = json.loads(line)
            for name, v in env.items():
                if v is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = v
            kernel = None
            if root:
                kernel = kernels.get(root)
                if kernel is None:
                    if len(kernels) >= _KERNELS_KEPT:
                        kernels.clear()
                    kernel = kernels[root] = Sysfs(HostRoot(root))._kernel
            _write_once(kernel, path, value)
            err = 0
        except OSError as e:
            err = e.errno or errno.EIO
        except BaseException:                   # a bad request, a simulator's failure: not written
            err = errno.EIO
        try:
            os.write(answers, f"{err}\n".encode("ascii"))
        except OSError:
            return
