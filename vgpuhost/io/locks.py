"""Cross-process locks in the state dir (``<state dir>/locks/<name>.lock``).

Owns: serialising operations on one IOMMU group or one GPU across the CLI,
the hook and boot units (fcntl ``flock``; released when the process dies, so
a crash never leaves a stale lock); a thread's deadline for its waits
(:class:`deadline`), and what a thread lends while it waits long
(:class:`lending`: the agent's write lock, while one of its changes waits
for a lock held elsewhere or a write the kernel blocks).  Must not: know
what is being locked.
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
#: seconds a wait may take before the thread lends what it holds for others (:class:`lending`): longer than
#: a lock held by an ordinary operation's step or a write the kernel makes at once, short beside the waits it
#: is for (a lock an operation holds while the kernel blocks its remove, up to that remove's bound)
LEND_AFTER_S = 0.25

#: this thread's deadline (``time.monotonic()``) for every lock it waits for, set by :func:`deadline`
#: (``_thread._local``: the hook's path imports no threading)
_local = _thread._local()


class deadline:
    """``with deadline(t) as scope:`` no lock this thread waits for in the block waits past ``t``
    (``time.monotonic()`` seconds): the agent's hook calls end when the hook's client stops waiting.
    ``cancelled``: a callable asked while a lock is waited for; once it returns true the wait ends as
    at ``t`` (TransientError) and ``scope.gave_up`` is True (the agent stopping: a hook call waiting for
    a GPU's lock gives up, and the hook does the work itself); one wait only: the later ones in the block
    (the rollback of what the call made) wait as before."""

    __slots__ = ("t", "before", "cancelled", "gave_up", "outer")

    def __init__(self, t: float, cancelled=None):
        self.t = t
        self.before = None
        self.cancelled = cancelled
        self.gave_up = False
        self.outer = None

    def __enter__(self) -> "deadline":
        self.before = getattr(_local, "deadline", None)
        self.outer = getattr(_local, "scope", None)
        _local.deadline = self.t
        _local.scope = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _local.deadline = self.before
        _local.scope = self.outer
        return False


class lending:
    """``with lending(lend, take):`` while this thread waits long in the block, what it holds for others is
    lent: ``lend()`` is called once a wait has lasted :data:`LEND_AFTER_S` (a lock another operation holds,
    :func:`file_lock`; a bounded write the kernel has not returned, :func:`wait_long`) and ``take()`` when
    that wait is over, before the thread goes on (``take`` may wait; it is called whatever ended the wait).
    The agent lends its write lock so: its other changes run meanwhile, each under its own file locks, as
    the one-shot hook's processes do, while the lending change keeps the file locks it holds.  A wait
    inside a lent one lends nothing more.  ``lent``: the waits that lent, in all."""

    __slots__ = ("lend", "take", "before", "out", "lent")

    def __init__(self, lend, take):
        self.lend = lend
        self.take = take
        self.before = None
        self.out = False            # lent now
        self.lent = 0

    def __enter__(self) -> "lending":
        self.before = getattr(_local, "lender", None)
        _local.lender = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _local.lender = self.before
        return False


def _lend() -> "lending | None":
    """Lend what this thread's :class:`lending` holds (None when there is none, or it is lent already: the
    caller then takes nothing back)."""
    lender = getattr(_local, "lender", None)
    if lender is None or lender.out:
        return None
    lender.lend()
    lender.out = True
    lender.lent += 1
    return lender


def _take_back(lender: "lending | None") -> None:
    if lender is not None:
        lender.out = False
        lender.take()


def wait_long(wait, timeout_s: float):
    """``wait(t)`` (waits at most ``t`` seconds; None when nothing came) for at most ``timeout_s`` seconds in
    all; past :data:`LEND_AFTER_S`, with what this thread's :class:`lending` holds lent for the rest.  What
    ``wait`` returned last."""
    lender = getattr(_local, "lender", None)
    if lender is None or lender.out or timeout_s <= LEND_AFTER_S:
        return wait(timeout_s)
    until = time.monotonic() + timeout_s
    got = wait(LEND_AFTER_S)
    if got is not None:
        return got
    lent = _lend()
    try:
        return wait(max(0.0, until - time.monotonic()))
    finally:
        _take_back(lent)


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
        _wait_for(fd, name, path, timeout_s)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _wait_for(fd: int, name: str, path: str, timeout_s: float) -> None:
    """``flock`` ``fd`` (the lock file ``path``, the lock ``name``), polling until :func:`_take_lock`'s bound;
    past :data:`LEND_AFTER_S`, with what this thread's :class:`lending` holds lent until the wait is over."""
    start = time.monotonic()
    until = start + timeout_s
    bound = getattr(_local, "deadline", None)
    if bound is not None and bound < until:
        until = bound
    delay = 0.001
    lent = None
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            scope = getattr(_local, "scope", None)
            if scope is not None and scope.cancelled is not None and scope.cancelled():
                scope.gave_up, scope.cancelled = True, None     # the rollback's own waits are not given up
                raise TransientError(f"stopped waiting for lock {name!r}: the caller gave up",
                                     hint="nothing was done under it; try again") from None
            now = time.monotonic()
            if now >= until:
                raise TransientError(
                    f"another vgpuhost operation has held lock {name!r} for over {now - start:.0f} s",
                    hint=f"wait for it to finish, or find it with: fuser -v {path}") from None
            if lent is None and now - start >= LEND_AFTER_S:
                lent = _lend()
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    finally:
        _take_back(lent)


file_lock.__wrapped__ = _take_lock


def lock_held(state_dir: "str | os.PathLike[str]", name: str) -> "bool | None":
    """Whether a process holds the lock ``name`` now (a moment's reading: it may be taken or let go just
    after): True when held, False when not (or its file was never made), None when it cannot be told (the
    lock dir or file is not readable by this user, or is a symlink).  Takes nothing that lasts and makes no
    file: tries the ``flock`` without waiting and lets it go at once."""
    path = os.path.join(plain_path(state_dir), "locks", f"{name}.lock")
    try:
        if os.path.islink(os.path.dirname(path)):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return True if e.errno in (errno.EAGAIN, errno.EACCES) else None
    finally:
        os.close(fd)                # closing the descriptor lets the lock go, if it was had
    return False
