"""This process's identity, as the audit log names it.

Owns: the one spelling of "who did this" (the ``actor`` column of every audit
row).  Must not: import anything heavy; the qemu hook calls it on every run.
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
