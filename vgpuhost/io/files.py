"""Plain files that are not kernel attributes: operator files, installed files, files shipped in the package.

Owns: reading a small operator file with a size cap (the qemu hook's
allow-list), writing an executable file atomically (the installed qemu hook
dispatcher), removing it, asking what is at a path, reading files shipped
inside the ``vgpuhost`` package (``hook/qemu.sh``), where its data files lie
(:func:`data_path`: ``vgpuhost/data/``), byte-compiling the package, and
finding a system program on a fixed ``PATH``.
Must not: decide anything or word errors for users: it raises ``OSError``
as the system gives it, and callers (ops/, hook/) turn it into one line.
Kernel attributes under ``sys/`` and ``proc/`` are :mod:`vgpuhost.io.sysfs`'s.

Lean: imports only ``os`` at module level (the qemu hook reads the
allow-list through here on every domain start).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from pathlib import Path
    from typing import List, Optional, Union

    PathArg = Union[str, "os.PathLike[str]"]

#: the directory holding the ``vgpuhost`` package's subpackages (``.../vgpuhost``)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the package's data folder: hostdev templates, systemd units, metering rules and dashboard, the board catalog
DATA_DIR = os.path.join(PACKAGE_DIR, "data")


def read_capped(path: PathArg, limit: int) -> Optional[bytes]:
    """Up to ``limit + 1`` bytes of the file (one more than ``limit`` says it is too big); None when absent.

    Raises ``OSError`` when it exists but cannot be read, and ``OSError(EINVAL)``
    when it is not a regular file: a FIFO or a device would block the reader
    (the qemu hook holds up every VM start while it waits), so it is opened
    non-blocking and refused without reading.
    """
    import errno
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def read_text_capped(path: PathArg, limit: int = 1 << 20) -> Optional[str]:
    """The file's first ``limit`` bytes as UTF-8 (undecodable bytes replaced); None when absent.

    Raises ``OSError`` when it exists but cannot be read.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except FileNotFoundError:
        return None


def can_open(path: PathArg) -> bool:
    """The file exists, is a regular file, and this process may open it for reading.

    Opened non-blocking: a FIFO must not hold the caller up.
    """
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: "str | bytes", mode: int = 0o644) -> None:
    """Write ``text`` (str: as UTF-8; bytes: as they are) to ``path`` with ``mode``: a temporary file
    beside it, fsync, rename.

    Creates missing parent directories; never follows a symlink at the
    temporary name.  Raises ``OSError`` (the temporary file is removed).
    """
    tmp = path.with_name(f".{path.name}.vgpuhost-tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        try:
            data = memoryview(text if isinstance(text, bytes) else text.encode("utf-8"))
            while data:
                data = data[os.write(fd, data):]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove(path: PathArg) -> bool:
    """Remove a file; False when it was not there.  Raises ``OSError`` otherwise."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def make_dirs(path: PathArg) -> None:
    """Create ``path`` and its missing parents.  Raises ``OSError`` (also when it exists)."""
    os.makedirs(path)


def remove_tree(path: PathArg) -> None:
    """Remove a directory tree; nothing when it is not there (errors ignored, as ``rm -rf``)."""
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def is_dir(path: PathArg) -> bool:
    return os.path.isdir(path)


def is_file(path: PathArg) -> bool:
    return os.path.isfile(path)


def exists(path: PathArg) -> bool:
    """Something is at ``path``, following symlinks (as ``Path.exists``)."""
    return os.path.exists(path)


def lexists(path: PathArg) -> bool:
    """Something is at ``path`` (a dangling symlink counts)."""
    return os.path.lexists(path)


def is_executable(path: PathArg) -> bool:
    return os.access(path, os.X_OK)


def package_parent() -> str:
    """The directory holding the ``vgpuhost`` package, symlinks resolved (what ``sys.path`` needs)."""
    return os.path.dirname(os.path.realpath(PACKAGE_DIR))


def package_text(*parts: str) -> str:
    """A text file shipped in the package: ``package_text("hook", "qemu.sh")`` is ``vgpuhost/hook/qemu.sh``."""
    with open(os.path.join(PACKAGE_DIR, *parts), encoding="utf-8") as f:
        return f.read()


def data_path(*parts: str) -> str:
    """Where a data file shipped in the package lies: ``data_path("units", NAME)`` is
    ``<package>/data/units/NAME`` (``data_path()``: the data folder).  Nothing is read."""
    return os.path.join(DATA_DIR, *parts)


def data_text(*parts: str) -> str:
    """A data file's text, UTF-8: ``data_text("catalog.yaml")``; OSError when it cannot be read."""
    return package_text("data", *parts)


def compile_package() -> bool:
    """Byte-compile the package so no run compiles it; False when it is not writable."""
    import compileall
    import contextlib
    import io
    try:
        with contextlib.redirect_stdout(io.StringIO()):        # keep --json output clean
            return bool(compileall.compile_dir(PACKAGE_DIR, quiet=2, workers=1))
    except OSError:
        return False


def which(program: str, path: str = "/usr/bin:/bin") -> Optional[str]:
    """The absolute path of ``program`` on ``path`` (not the caller's ``$PATH``), or None."""
    import shutil
    return shutil.which(program, path=path)


def selinux_label(path: PathArg) -> Optional[str]:
    """The SELinux context of ``path`` (its ``security.selinux`` extended attribute, e.g.
    ``system_u:object_r:virt_etc_t:s0``); None when it has none, is absent, or the filesystem keeps no
    extended attributes."""
    try:
        raw = os.getxattr(path, "security.selinux")
    except OSError:
        return None
    return raw.rstrip(b"\0").decode("utf-8", "replace") or None


def real_path(path: PathArg) -> str:
    """``path`` absolute, with every symlink and ``..`` resolved (``os.path.realpath``)."""
    return os.path.realpath(path)


def names_in(path: PathArg) -> List[str]:
    """The names of a directory's entries, sorted by their bytes (C locale order); [] when it is absent."""
    try:
        return sorted(os.listdir(path), key=os.fsencode)
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_executable_file(path: PathArg) -> bool:
    """A regular file with every execute bit set (mode 0755 as ``hook install`` writes it)."""
    import stat
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) and mode & 0o111 == 0o111
