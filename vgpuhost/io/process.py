"""This process's identity, as the audit log names it, running a program, and ending this process.

Owns: the one spelling of "who did this" (the ``actor`` column of every audit
row), :func:`run_program` (a child process, output captured) and
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
