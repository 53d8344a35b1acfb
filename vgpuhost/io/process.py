"""This process's identity, as the audit log names it, and running a program.

Owns: the one spelling of "who did this" (the ``actor`` column of every audit
row) and :func:`run_program` (a child process, output captured).  Must not:
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
