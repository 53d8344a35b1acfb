"""This process's identity, as the audit log names it, running a program, and ending this process.

Owns: the one spelling of "who did this" (the ``actor`` column of every audit
row), :func:`run_program` (a child process, output captured), :func:`run_capped` (the same, its
output read up to a cap) and
:func:`exit_after` (a watchdog that ends this process).  Must not:
import anything heavy at module level; the qemu hook calls :func:`actor` on
every run (and starts no child).
"""

from __future__ import annotations

import os


def actor(who: str = "cli", *, with_uid: bool = True) -> str:
    """The audit actor of this process: ``$VGPUHOST_ACTOR`` when set (the systemd units set it,
    e.g. ``systemd:vgpuhost-layout.service``), else ``"<who> uid=<uid> pid=<pid>"``
    (``with_uid=False``: ``"<who> pid=<pid>"``, as the qemu hook writes it)."""
    given = os.environ.get("VGPUHOST_ACTOR")
    if given:
        return given
    return f"{who} uid={os.getuid()} pid={os.getpid()}" if with_uid else f"{who} pid={os.getpid()}"


def run_program(argv, *, input: bytes = b"", timeout: float = 60):
    """Run ``argv`` with ``input`` on stdin, stdout and stderr captured: a ``subprocess.CompletedProcess``.

    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds and ``OSError`` when it cannot start.
    """
    import subprocess
    return subprocess.run(list(argv), input=input, capture_output=True, timeout=timeout)


def run_capped(argv, *, input: bytes = b"", timeout: float = 60, limit: int = 1 << 20):
    """Run ``argv`` as :func:`run_program` does, reading at most ``limit`` + 1 bytes of its stdout and
    ``limit`` bytes of its stderr: ``(returncode, stdout, stderr)``.  A child that writes more than
    ``limit`` bytes on stdout is killed (its returncode then negative) and ``stdout`` is ``limit`` + 1
    bytes long, so the caller can tell it was cut.  Raises ``subprocess.TimeoutExpired`` after
    ``timeout`` seconds (the child killed) and ``OSError`` when it cannot start."""
    import selectors
    import subprocess
    import time
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = bytearray(), bytearray()
    pending = memoryview(input)
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    try:
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(list(argv), timeout)
            for key, _ in sel.select(left):
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(proc.stdin.fileno(), pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = key.data
                room = (limit + 1 if buf is out else limit) - len(buf)
                buf += chunk[:max(0, room)]
                if buf is out and len(out) > limit:
                    # cut: the answer is too long whatever else comes; read nothing more (a grandchild
                    # that keeps stderr open, e.g. an ssh master, must not hold this call to its timeout)
                    proc.kill()
                    for key in list(sel.get_map().values()):
                        sel.unregister(key.fileobj)
                    break
        proc.wait(max(0.1, deadline - time.monotonic()))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
    return proc.returncode, bytes(out), bytes(err)


def exit_after(seconds: int) -> None:
    """End this process with ``_exit(1)`` ``seconds`` from now, whatever it is doing then, even
    stuck in C code where no Python signal handler runs.

    A C thread of :mod:`faulthandler` (built into the interpreter: no import
    cost, no :mod:`threading`) sleeps until then; the tracebacks it writes
    before exiting go to ``/dev/null``.  One per process: a later call
    replaces the earlier deadline.
    """
    import faulthandler
    try:
        sink = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        sink = 2
    faulthandler.dump_traceback_later(seconds, exit=True, file=sink)
