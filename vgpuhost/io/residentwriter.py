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
abandoned or found dead, so that a fresh interpreter's start (about 30 ms of CPU, more wall time under load)
comes before the next write, not in it.  A write is handed only to a writer that has said it is ready: a
writer's start is not counted in the write's ``timeout_s`` (it has its own bound, :data:`START_TIMEOUT_S`,
never past the caller's deadline), so a write is never left in the pipe of a writer that then cannot take it.
An agent that never removes anything keeps one idle writer, a small process.

Protocol, one request at a time per writer: the caller starts the writer with its :func:`identity` (its
vgpuhost version and :data:`PROTOCOL`); a writer whose code on disk is another (a package upgraded under a
running agent, before its restart) exits at once with :data:`EXIT_OTHER_VERSION`.  A writer's first line,
once it has imported what it needs, is ``ready``.  A request is one line of JSON ``[ROOT, PATH, VALUE, ENV]``
(``ROOT`` the simulated host root whose simulated kernel makes the write, ``""`` for a real one, where the
write is one ``write(2)``; ``ENV`` the simulator's environment variables as the caller has them now,
``{name: value or null}``, so a writer that lives long follows the caller's: its time file, its write log);
the answer one line, the errno (0: written), or ``unable`` when the writer failed before the write (the
simulator's module broken on disk, a request it cannot read; nothing written).  The simulator re-reads the
host's state at every write (:meth:`vgpuhost.sim.kernel.SimKernel.write`), so a writer that lives long
never acts on a stale one.

Failed starts: a writer that ends before it is ready, cannot be run, is not ready within
:data:`START_TIMEOUT_S` or answers ``unable`` took nothing: :meth:`Writers.write` raises OSError, and
:meth:`vgpuhost.io.sysfs.Sysfs.write_bounded` makes that write in a forked child, as without a resident
writer (a failed start costs a write its fork, never the write).  Each failure is logged; the next write gets
a new writer; only :data:`START_FAILURES_OFF` failures in a row (a broken installation, not one writer killed)
turn the pool off, for :data:`OFF_S` seconds, after which one start is tried again.  ``GET /v1/agent`` shows
the pool (:func:`status`: ``resident_writer``).

Lifecycle: an idle writer waits for the next request; several callers at once take one idle writer each (a
new one when none is idle; at most :data:`IDLE_KEPT` are kept idle).  A writer whose answer does not come in
``timeout_s`` (a remove blocked in the kernel) is abandoned: its pipes are closed here, so once its write
returns it finds its answer pipe closed or its request pipe at end of file and exits.  Each writer has a daemon
thread waiting for it from its start, so whenever it ends it is reaped (no zombie while this process runs, and
no thread of this process is held by a blocked writer in a way that matters: the thread is a daemon).
The next write gets another writer (started at once, idle meanwhile).  A writer found dead before a request is
replaced.  One that dies during a write (killed, out of memory) answers nothing: that write's outcome is
unknown (its write(2) may have been made), :data:`vgpuhost.io.sysfs.UNANSWERED`, as a detached child's that
closed its pipe unanswered; the caller reads the device back (:meth:`vgpuhost.io.vgpudev.VgpuDevices.remove`).
When this process ends, every idle writer reads end of file and exits; a blocked one exits once its write
returns.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from .. import __version__
from .hostroot import HostRoot
from .locks import time_left, wait_long
from .sysfs import UNANSWERED, Sysfs, _write_once, set_bounded_writer
from .vfioholders import DEADLINE_MARGIN_S

#: idle writers kept for the next write (more are started when writes come at once, and ended when they return)
IDLE_KEPT = 2
#: the simulated kernels a writer keeps (one per simulated host root it has written under; the agent has one)
_KERNELS_KEPT = 8
#: the most bytes an answer takes (an errno and a newline)
_ANSWER_BYTES = 64
#: the protocol's number: the caller and the writer must have the same, and the same vgpuhost version
#: (:func:`identity`); 2: the ``unable`` answer
PROTOCOL = 2
#: seconds a writer may take to say :data:`READY` (its interpreter's start and imports, about 30 ms of CPU):
#: not counted in a write's bound (a request is handed only to a ready writer), but never past the
#: caller's deadline (:func:`vgpuhost.io.locks.time_left`)
START_TIMEOUT_S = 10.0
#: failed starts in a row after which no writer is started for :data:`OFF_S` seconds (each bounded write
#: forks a child meanwhile): a broken installation, not one writer killed
START_FAILURES_OFF = 3
#: seconds the pool stays off after :data:`START_FAILURES_OFF` failed starts in a row; then one start is
#: tried again (and, failing, turns it off again)
OFF_S = 600.0
#: a writer's exit status when the caller's :func:`identity` is not its own (the package changed on disk
#: under a running agent: an upgrade before the agent's restart)
EXIT_OTHER_VERSION = 3
#: :meth:`Writer.ask`: the writer had ended before the request was sent (nothing written)
UNSENT = -2
#: :meth:`Writer.ask`: the writer answered that it cannot make writes (it failed before the write: a module
#: the write needs broken on disk, a request it cannot read; nothing written)
CANNOT = -4
#: a writer's first line, once it has imported what it needs
READY = b"ready"
#: a writer's answer when it failed before the write (:data:`CANNOT`)
UNABLE = b"unable"
#: the writer process's code (``python -I -S -c CODE PACKAGE_PARENT IDENTITY``)
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); from vgpuhost.io.residentwriter import serve; "
         "sys.exit(serve(boot=sys.argv[2]))")
#: :meth:`Writer._line`: the writer's answer pipe reached end of file (it ended)
_EOF = object()


def identity() -> str:
    """What a writer must share with its caller: ``VERSION/PROTOCOL`` (``0.2.0/2``)."""
    return f"{__version__}/{PROTOCOL}"


def _package_parent() -> str:
    """The directory holding the ``vgpuhost`` package this module belongs to."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


log = logging.getLogger("vgpuhost.agent")


class Writer:
    """One writer process (:func:`serve`) and its two pipes, seen from the caller."""

    def __init__(self) -> None:
        """Start the writer.  Raises OSError when it cannot be started (no processes left, no interpreter)."""
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, _package_parent(), identity()],
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

    def _line(self, deadline: float):
        """The writer's next line (bytes, without its newline), None when none came by ``deadline``
        (``time.monotonic()``), :data:`_EOF` when its answer pipe closed (it ended) or cannot be read."""
        out = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            try:
                ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    return None
                data = os.read(out, _ANSWER_BYTES)
            except OSError:
                return _EOF
            if not data:
                return _EOF
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def wait_ready(self, timeout_s: float) -> Optional[str]:
        """Wait at most ``timeout_s`` seconds for the writer's :data:`READY`: None once it is ready, else why
        not, a clause (``ended before it was ready (exit status 1)``; ``was not ready within 10 s``).  It
        has been handed nothing before."""
        if self.ready:
            return None
        line = self._line(time.monotonic() + max(0.0, timeout_s))
        if line == READY:
            self.ready = True
            return None
        if line is None:
            return f"was not ready within {timeout_s:g} s"
        if line is not _EOF:
            return "said something else than ready (not this protocol)"
        try:
            status = self.proc.wait(timeout=1.0)    # its answer pipe closed: it is ending
        except subprocess.TimeoutExpired:
            return "ended before it was ready"
        if status == EXIT_OTHER_VERSION:
            return (f"refused to start: the package on disk is not this agent's version {identity()} (it changed "
                    "under the running agent, an upgrade: restart the agent)")
        return f"ended before it was ready (exit status {status})"

    def ask(self, request: bytes, timeout_s: float) -> Optional[int]:
        """Send one request line to this writer, which is ready (:meth:`wait_ready`); the errno answered (0:
        written), None when no answer came within ``timeout_s`` seconds (the write is blocked in the kernel),
        :data:`vgpuhost.io.sysfs.UNANSWERED` when the writer ended without answering (killed during the
        write: whether the write was made is unknown), :data:`UNSENT` when it had ended before the request
        could be sent, :data:`CANNOT` when it answered that it cannot make writes (in neither case was
        anything written)."""
        try:
            os.write(self.proc.stdin.fileno(), request)     # a line of a few hundred bytes: one write(2)
        except (BrokenPipeError, ConnectionResetError):
            return UNSENT
        # a write the kernel blocks (an mdev remove while its device is open) may wait up to its bound: past
        # LEND_AFTER_S this thread lends what it holds (the agent's write lock: its other changes go on)
        line = wait_long(lambda t: self._line(time.monotonic() + max(0.0, t)), max(0.0, timeout_s))
        if line is None:
            return None
        if line == UNABLE:
            return CANNOT
        if line is _EOF or not line.isdigit():
            return UNANSWERED               # ended, or not this protocol (never trusted again): unknown
        return int(line)

    def close(self) -> None:
        """Close both pipes: an idle writer then reads end of file and exits, a busy one once its write has
        returned (its reaper reaps it)."""
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Writers:
    """This process's writers: :meth:`write` hands a bounded write to an idle one.  ``clock``: the
    monotonic clock the pool's off period (:data:`OFF_S`) is measured on."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._idle: List[Writer] = []
        self._clock = clock
        #: writers started, in all (a count, for tests and the agent's status)
        self.started = 0
        #: starts that failed in a row (a writer that ended before it was ready, could not be run, or cannot
        #: make writes); 0 again once one has answered a write
        self.start_failures = 0
        #: the last failed start, a line (None: none yet)
        self.last_failure: Optional[str] = None
        #: ``clock()`` until which no writer is started (:data:`START_FAILURES_OFF` failed starts in a row)
        self._off_until: Optional[float] = None

    @property
    def broken(self) -> bool:
        """Whether the pool is off now (:data:`START_FAILURES_OFF` failed starts in a row, less than
        :data:`OFF_S` seconds ago): every write raises OSError, and the caller forks a child per write."""
        return self._off_until is not None and self._clock() < self._off_until

    def write(self, root: str, path: str, value: str, env: Dict[str, Optional[str]],
              timeout_s: float) -> Optional[int]:
        """Make one write in a writer: its errno (0: written), None when it did not return within
        ``timeout_s`` seconds (the writer is abandoned; it finishes the write by itself),
        :data:`vgpuhost.io.sysfs.UNANSWERED` when the writer ended without answering (killed during the
        write: whether it was made is unknown).  ``root``: the simulated host root whose kernel makes the
        write, ``""`` on a real root.  ``env``: the simulator's environment variables the writer takes for
        this write.  The write is handed only to a ready writer: a writer's start (at most
        :data:`START_TIMEOUT_S`) is not counted in ``timeout_s``.  Raises OSError when no writer could take
        it (the pool is off, :attr:`broken`; a writer's start failed; or it cannot make writes): nothing was
        written, and the caller makes it otherwise."""
        if self.broken:
            raise OSError(errno.ECHILD, "the resident writer is off after failed starts")
        request = (json.dumps([root, path, value, env]) + "\n").encode("utf-8")
        for _ in range(2):
            writer = self._ready_writer(timeout_s)
            got = writer.ask(request, timeout_s)
            if got != UNSENT:
                break
            writer.close()                  # it died idle after it was ready (killed): another one, once
        else:
            raise OSError(errno.ECHILD, "the resident writers ended before they could take the write")
        if got == CANNOT:
            writer.close()
            self._start_failed(writer.pid, "cannot make writes (it failed before the write: a module broken "
                                           "on disk?)")
            raise OSError(errno.ECHILD, f"the resident writer (pid {writer.pid}) cannot make writes")
        if got is None or got < 0:
            writer.close()                  # blocked (abandoned) or dead: never handed out again
            self._spare()                   # its successor starts now, not in the next write's bound
            return got
        if self.start_failures:
            self._worked(writer.pid)
        self._give_back(writer)
        return got

    def _ready_writer(self, timeout_s: float) -> Writer:
        """An idle writer, or a new one, once it is ready.  Raises OSError when none is (its start failed:
        counted, :meth:`_start_failed`; or it was not ready before the caller's deadline: kept for a later
        write)."""
        writer = self._take()
        if writer.ready:
            return writer
        bound = START_TIMEOUT_S
        left = time_left()
        if left is not None:                # never past the caller's deadline, with the write's own bound
            bound = max(0.0, min(bound, left - DEADLINE_MARGIN_S - timeout_s))
        why = writer.wait_ready(bound)
        if why is None:
            return writer
        if bound < START_TIMEOUT_S and writer.alive() and why.startswith("was not ready"):
            self._give_back(writer)         # a slow start cut short by the deadline: ready for a later write
            raise OSError(errno.ETIMEDOUT, f"the resident writer (pid {writer.pid}) {why}")
        writer.close()
        if writer.alive():
            writer.proc.kill()              # hung in its start (it holds no request): by its pid, our child
        self._start_failed(writer.pid, why)
        self._spare()
        raise OSError(errno.ECHILD, f"the resident writer (pid {writer.pid}) {why}")

    def _worked(self, pid: int) -> None:
        """A writer answered a write: the failed starts in a row end."""
        with self._lock:
            failures, self.start_failures, self._off_until = self.start_failures, 0, None
        if failures:
            log.warning("resident writer (pid %d) made a write after %d failed start(s): bounded writes go "
                           "to resident writers again", pid, failures)

    def _start_failed(self, pid: Optional[int], why: str) -> None:
        """Count one failed start (``pid`` None: it could not be run), log it, and turn the pool off at
        :data:`START_FAILURES_OFF` in a row."""
        who = "resident writer" if pid is None else f"resident writer (pid {pid})"
        with self._lock:
            self.start_failures += 1
            self.last_failure = f"{who} {why}"
            off = self.start_failures >= START_FAILURES_OFF
            if off:
                self._off_until = self._clock() + OFF_S
            failures = self.start_failures
        if off:
            log.warning("%s %s: %d failed starts in a row, no writer is started for %g s (each bounded "
                           "write forks a child meanwhile; GET /v1/agent resident_writer)", who, why, failures,
                           OFF_S)
        else:
            log.warning("%s %s (%d failed start(s) in a row): that write forks a child; the next write "
                           "gets a new writer", who, why, failures)

    def _spare(self) -> None:
        """:meth:`start_spare`, unless the pool is off; a failure is counted, not raised."""
        if self.broken:
            return
        try:
            self.start_spare()
        except OSError:
            pass                            # counted; the next write tries again

    def start_spare(self) -> None:
        """Start a writer now, to wait idle for the next write, unless one is idle already: a fresh
        interpreter's start (about 30 ms of CPU) then comes before the next write, not in it.  Raises OSError
        when it cannot be started (counted as a failed start)."""
        with self._lock:
            if self._idle:
                return
        self._give_back(self._new())

    def _new(self) -> Writer:
        """A new writer (not ready yet); raises OSError, counted, when it cannot be run."""
        with self._lock:
            self.started += 1
        try:
            return Writer()
        except OSError as e:
            self._start_failed(None, f"could not be run: {e.strerror or e}")
            raise

    def _take(self) -> Writer:
        """An idle writer that is alive, or a new one."""
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.alive():
                    return w
                w.close()                   # died while idle (killed): replaced
        return self._new()

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

    def status(self) -> Dict[str, Any]:
        """The pool as ``GET /v1/agent`` shows it: ``mode`` (``resident``, or ``fork`` while it is off:
        each bounded write forks a child), ``started`` (writers started in all), ``idle`` (writers waiting: one
        killed while idle is dropped here, not counted until the next write replaces it),
        ``start_failures`` (failed starts in a row, 0 once a writer answered a write),
        ``last_start_failure`` (a line, or None), ``off_for_s`` (seconds until a start is tried again while
        off, else None)."""
        now = self._clock()
        with self._lock:
            dead = [w for w in self._idle if not w.alive()]
            self._idle = [w for w in self._idle if w not in dead]
            off = self._off_until is not None and now < self._off_until
            doc = {"mode": "fork" if off else "resident", "started": self.started, "idle": len(self._idle),
                   "start_failures": self.start_failures, "last_start_failure": self.last_failure,
                   "off_for_s": round(self._off_until - now, 1) if off else None}
        for w in dead:
            w.close()
        return doc

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
            pass                            # counted; the first write tries again
    return _writers


def status() -> Optional[Dict[str, Any]]:
    """This process's pool as :meth:`Writers.status` says it, None when :func:`keep_writer` was not called
    (each bounded write forks a child)."""
    pool = _writers
    return None if pool is None else pool.status()


def let_writers_go() -> None:
    """Undo :func:`keep_writer`: bounded writes fork a child per write again, and the idle writers end (each
    reads end of file); a blocked one ends once its write returns.  For a process whose long life ends (the
    agent stopping in a process that goes on: the tests)."""
    global _writers
    if _writers is not None:
        set_bounded_writer(None)
        _writers.close()
        _writers = None


def serve(requests=None, answers=None, boot: Optional[str] = None) -> Optional[int]:
    """The writer's loop: read a request line from ``requests`` (stdin's binary stream), make the write, write
    the errno line to ``answers`` (stdout's fd), or :data:`UNABLE` when it fails before the write (a bad
    request, the simulator's module broken on disk: nothing written); return None at end of file, or when the
    answer cannot be written (the caller has gone or abandoned this writer).  ``boot``: the caller's
    :func:`identity`; when it is not this code's, nothing is read or said and :data:`EXIT_OTHER_VERSION` is
    returned (the writer's exit status)."""
    if boot is not None and boot != identity():
        return EXIT_OTHER_VERSION
    requests = requests if requests is not None else sys.stdin.buffer
    answers = answers if answers is not None else sys.stdout.fileno()
    kernels: Dict[str, object] = {}
    try:
        os.write(answers, READY + b"\n")
    except OSError:
        return None
    while True:
        line = requests.readline()
        if not line:
            return None
        try:        # everything before the write itself: a failure here (a bad request, the simulator's
            # module broken on disk) is this writer's, not the write's; nothing was written
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
        except BaseException:
            answer = UNABLE
        else:
            try:
                _write_once(kernel, path, value)
                answer = b"0"
            except OSError as e:
                answer = b"%d" % (e.errno or errno.EIO)
            except BaseException:               # a simulator's failure: not written
                answer = b"%d" % errno.EIO
        try:
            os.write(answers, answer + b"\n")
        except OSError:
            return None
