"""Cross-process locks in the state dir (``<state dir>/locks/<name>.lock``).

Owns: serialising operations on one IOMMU group or one GPU across the CLI,
the hook and boot units (fcntl ``flock``; released when the process dies, so
a crash never leaves a stale lock).  Must not: know what is being locked.
"""

from __future__ import annotations

import _thread
import errno
import fcntl
import os
import time

from ..model.errors import HostEnvironmentError, TransientError
from .hostroot import plain_path

DEFAULT_TIMEOUT_S = 120.0

#: this thread's deadline (``time.monotonic()``) for every lock it waits for, set by :func:`deadline`
#: (``_thread._local``: the hook's path imports no threading)
_local = _thread._local()


class deadline:
    """``with deadline(t):`` no lock this thread waits for in the block waits past ``t``
    (``time.monotonic()`` seconds): the agent's hook calls end when the hook's client stops waiting."""

    __slots__ = ("t", "before")

    def __init__(self, t: float):
        self.t = t
        self.before = None

    def __enter__(self) -> None:
        self.before = getattr(_local, "deadline", None)
        _local.deadline = self.t

    def __exit__(self, exc_type, exc, tb) -> bool:
        _local.deadline = self.before
        return False


def time_left() -> "float | None":
    """Seconds until this thread's :class:`deadline` (may be negative), None when no deadline is set:
    other bounded waits (a vGPU remove write, :func:`vgpuhost.io.vfioholders.remove_timeout_s`) end
    before it too."""
    bound = getattr(_local, "deadline", None)
    return None if bound is None else bound - time.monotonic()


def file_lock(state_dir: "str | os.PathLike[str]", name: str, *,
              timeout_s: "float | None" = None) -> "_HeldLock":
    """``with file_lock(state_dir, name):`` holds the exclusive lock ``name`` (e.g. ``group-12``)
    for the block; ``timeout_s`` defaults to :data:`DEFAULT_TIMEOUT_S` (the default of
    ``file_lock.__wrapped__``, the function that takes the lock).

    Raises HostEnvironmentError when the lock file or the lock dir is a symlink
    (never followed) or cannot be made, TransientError when the lock cannot be
    had within ``timeout_s``.  A class, not ``contextlib.contextmanager``: the
    qemu hook takes locks and does not import contextlib.
    """
    return _HeldLock(state_dir, name, timeout_s)


class _HeldLock:
    __slots__ = ("args", "fd")

    def __init__(self, state_dir, name: str, timeout_s):
        self.args = (state_dir, name, timeout_s)
        self.fd = None

    def __enter__(self) -> None:
        state_dir, name, timeout_s = self.args
        if timeout_s is None:
            self.fd = file_lock.__wrapped__(state_dir, name)
        else:
            self.fd = file_lock.__wrapped__(state_dir, name, timeout_s=timeout_s)

    def __exit__(self, exc_type, exc, tb) -> bool:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        return False


def _take_lock(state_dir: "str | os.PathLike[str]", name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Open and ``flock`` the lock file; its descriptor (closing it releases the lock)."""
    ldir = os.path.join(plain_path(state_dir), "locks")
    path = os.path.join(ldir, f"{name}.lock")
    try:
        if os.path.islink(ldir):
            raise HostEnvironmentError(f"the lock dir {str(ldir)!r} is a symlink; vgpuhost refuses to follow it",
                                       hint=f"remove the link (rm {ldir}); vgpuhost creates the directory anew")
        os.makedirs(ldir, mode=0o700, exist_ok=True)
        # O_NOFOLLOW: a symlink planted as a lock file never makes vgpuhost create or open its target
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise HostEnvironmentError(f"the lock file {str(path)!r} is a symlink; vgpuhost refuses to follow it",
                                       hint=f"remove the link (rm {path}); nothing was changed") from None
        raise HostEnvironmentError(f"cannot create lock {name!r} in {str(ldir)!r}: {e.strerror}",
                                   hint="pass --state-dir DIR to a writable directory") from None
    try:
        start = time.monotonic()
        until = start + timeout_s
        bound = getattr(_local, "deadline", None)
        if bound is not None and bound < until:
            until = bound
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= until:
                    raise TransientError(
                        f"another vgpuhost operation has held lock {name!r} for over "
                        f"{time.monotonic() - start:.0f} s",
                        hint="wait for it to finish, or find it with: fuser -v "
                             f"{path}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
    except BaseException:
        os.close(fd)
        raise
    return fd


file_lock.__wrapped__ = _take_lock
