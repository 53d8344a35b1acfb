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

    Raises HostEnvironmentError when it cannot be had within ``timeout_s``.
    """
    ldir = Path(state_dir) / "locks"
    try:
        ldir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(ldir / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
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
