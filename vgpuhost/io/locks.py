"""Cross-process locks in the state dir (``<state dir>/locks/<name>.lock``).

Owns: serialising operations on one IOMMU group or one GPU across the CLI,
the hook and boot units (fcntl ``flock``; released when the process dies, so
a crash never leaves a stale lock).  Must not: know what is being locked.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path

from ..model.errors import HostEnvironmentError, TransientError

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Iterator

DEFAULT_TIMEOUT_S = 120.0


@contextmanager
def file_lock(state_dir: "str | os.PathLike[str]", name: str, *,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[None]:
    """Hold the exclusive lock ``name`` (e.g. ``group-12``) for the block.

    Raises HostEnvironmentError when it cannot be had within ``timeout_s``, or
    when the lock file or the lock dir is a symlink (never followed).
    """
    ldir = Path(state_dir) / "locks"
    path = ldir / f"{name}.lock"
    try:
        if os.path.islink(ldir):
            raise HostEnvironmentError(f"the lock dir {str(ldir)!r} is a symlink; vgpuhost refuses to follow it",
                                       hint=f"remove the link (rm {ldir}); vgpuhost creates the directory anew")
        ldir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # O_NOFOLLOW: a symlink planted as a lock file never makes vgpuhost create or open its target
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise HostEnvironmentError(f"the lock file {str(path)!r} is a symlink; vgpuhost refuses to follow it",
                                       hint=f"remove the link (rm {path}); nothing was changed") from None
        raise HostEnvironmentError(f"cannot create lock {name!r} in {str(ldir)!r}: {e.strerror}",
                                   hint="pass --state-dir DIR to a writable directory") from None
    try:
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise TransientError(
                        f"another vgpuhost operation has held lock {name!r} for over {timeout_s:.0f} s",
                        hint="wait for it to finish, or find it with: fuser -v "
                             f"{ldir / (name + '.lock')}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)
