"""Configuration files other tools read: modprobe.d, driverctl overrides, mdevctl definitions, systemd units.

Owns: reading them (:func:`read_config_text`, :func:`config_equals`,
:func:`list_config_files`) and what an audit row records of one
(:func:`audit_value`); and the few other host files vgpuhost looks at
before it writes one: whether something exists (:func:`exists`), an
executable a unit names (:func:`is_executable_file`, :func:`find_program`).
Writing them (atomic: temp file + rename) and
removing them is :meth:`vgpuhost.io.sysfs.Sysfs.write_config` /
:meth:`~vgpuhost.io.sysfs.Sysfs.remove_config`'s, the one module that opens
files for writing, which add the audit row; product code changes these
files only through
:class:`~vgpuhost.plan.steps.WriteConfig` and
:class:`~vgpuhost.plan.steps.RemoveConfig` steps.  Must not: decide what a
file should hold (policy and planners do) or echo the content of a file
that failed to parse.
"""

from __future__ import annotations

import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import List, Optional, Sequence, Tuple, Union
    PathArg = Union[str, "os.PathLike[str]"]


def read_config_text(path: PathArg) -> Optional[str]:
    """A configuration file's text (UTF-8, undecodable bytes replaced); None when it does not exist.

    Raises HostEnvironmentError (exit 2) when it exists but cannot be read.
    """
    try:
        # O_NONBLOCK: a FIFO planted under a config name must not hang the reader; only a regular file is read
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        from ..model.errors import HostEnvironmentError
        raise HostEnvironmentError(f"cannot read {path}: {e.strerror}",
                                   hint="run as root, or check the file's permissions") from None
    with open(fd, encoding="utf-8", errors="replace") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            from ..model.errors import HostEnvironmentError
            raise HostEnvironmentError(f"cannot read {path}: not a regular file",
                                       hint="remove it or replace it with a regular file")
        try:
            return f.read()
        except OSError as e:
            from ..model.errors import HostEnvironmentError
            raise HostEnvironmentError(f"cannot read {path}: {e.strerror}",
                                       hint="run as root, or check the file's permissions") from None


def config_equals(path: PathArg, text: str) -> bool:
    """The file at ``path`` holds exactly ``text`` (False when missing or unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == text
    except (OSError, UnicodeDecodeError):
        return False


#: symbolic links followed in one path before it counts as a loop (the kernel's MAXSYMLINKS, path_resolution(7))
MAX_SYMLINKS = 40


def resolve_in_root(root: PathArg, path: PathArg) -> Optional[str]:
    """``path`` (under ``root``) with every symbolic link followed as if ``root`` were ``/``: an
    absolute target (``/etc/modprobe.d/real.conf``) resolves under ``root``, a ``..`` never climbs
    above it, so a host tree read with ``--root`` never reads a file of the machine running vgpuhost.
    None for a loop (more than :data:`MAX_SYMLINKS` links) or a link that cannot be read.  ``path``
    itself when ``root`` is ``/``: the kernel then follows the links."""
    root = os.path.abspath(os.fspath(root))
    path = os.path.abspath(os.fspath(path))
    if root == "/":
        return path
    rel = os.path.relpath(path, root)
    if rel == ".." or rel.startswith("../"):
        return None
    todo = [c for c in rel.split("/") if c not in ("", ".")]
    todo.reverse()
    current, hops = root, 0
    while todo:
        part = todo.pop()
        if part == "..":
            current = os.path.dirname(current) if current != root else root
            continue
        nxt = os.path.join(current, part)
        if not os.path.islink(nxt):
            current = nxt
            continue
        hops += 1
        try:
            target = os.readlink(nxt)
        except OSError:
            return None
        if hops > MAX_SYMLINKS:
            return None
        if target.startswith("/"):
            current = root
        todo.extend(reversed([c for c in target.split("/") if c not in ("", ".")]))
    return current


def list_config_files(directory: PathArg, suffix: str = "", root: Optional[PathArg] = None) -> List[Tuple[str, str]]:
    """``[(name, text)]`` of the files in ``directory`` whose names end in ``suffix``, sorted by name.

    Empty when the directory does not exist or cannot be listed; a file that
    cannot be read raises HostEnvironmentError (exit 2, see :func:`read_config_text`).
    ``root``: the host root ``directory`` lies under; links are followed inside it
    (:func:`resolve_in_root`), a loop or dangling link is skipped.
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    out = []
    for name in names:
        if not name.endswith(suffix):
            continue
        full = os.path.join(directory, name)
        if root is not None:
            full = resolve_in_root(root, full)
            if full is None:
                continue
        text = read_config_text(full)
        if text is not None:
            out.append((name, text))
    return out


#: The directories modprobe reads ``*.conf`` files from, highest precedence first, under the host root
#: (kmod's ``default_config_paths`` in ``libkmod/libkmod.c`` with SYSCONFDIR ``/etc`` and DISTCONFDIR
#: ``/usr/lib``; modprobe.d(5), docs/reference/hardware.md#vgpu-scheduling).
MODPROBE_DIRS = (("etc", "modprobe.d"), ("run", "modprobe.d"), ("usr", "local", "lib", "modprobe.d"),
                 ("usr", "lib", "modprobe.d"), ("lib", "modprobe.d"))


def modprobe_conf_files(host) -> List[Tuple[str, str]]:
    """``[(path, text)]`` of the modprobe.d files modprobe reads, in the order it reads them.

    As kmod does (``conf_files_list`` / ``conf_files_insert_sorted`` in ``libkmod/libkmod-config.c``):
    every ``*.conf`` regular file of :data:`MODPROBE_DIRS` (a link followed inside the host root,
    :func:`resolve_in_root`), sorted by file name whatever its directory;
    a name already found in a directory of higher precedence hides the same name further down.
    ``path`` is the host's own spelling (``/etc/modprobe.d/zz-local.conf``, :meth:`HostRoot.relative`);
    ``host`` a :class:`~vgpuhost.io.hostroot.HostRoot`.  A directory that is missing or cannot be
    listed is skipped; a file that cannot be read raises HostEnvironmentError (exit 2).
    """
    chosen = {}
    for parts in MODPROBE_DIRS:
        directory = host.path(*parts)
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if len(name) < 6 or not name.endswith(".conf") or name in chosen:
                continue
            # a link is followed inside the host root: an absolute target names the host's file, not ours
            full = resolve_in_root(host.root, os.path.join(directory, name))
            if full is None or not os.path.isfile(full):
                continue            # a directory, FIFO, device, loop or dangling link named *.conf is no config file
            chosen[name] = (os.path.join(directory, name), full)
    out = []
    for name in sorted(chosen):
        listed, full = chosen[name]
        text = read_config_text(full)
        if text is not None:
            out.append((host.relative(listed), text))
    return out


def exists(path: PathArg) -> bool:
    """Something is at ``path`` (a dangling symlink counts: ``systemctl enable`` links)."""
    return os.path.lexists(path)


def is_file(path: PathArg) -> bool:
    """``path`` is a regular file (following symlinks)."""
    return os.path.isfile(path)


def is_executable_file(path: PathArg) -> bool:
    """``path`` is a regular file this process may execute (False on any error)."""
    try:
        return os.path.isfile(path) and os.access(path, os.X_OK)
    except OSError:
        return False


def find_program(name: str) -> Optional[str]:
    """``name`` on ``PATH`` (``shutil.which``), None when absent."""
    import shutil
    return shutil.which(name)


def audit_value(text: str, limit: int = 160) -> str:
    """What the audit log records for a configuration file's text: the text when it is one
    short line, else ``<N lines, B bytes: first non-comment line>``."""
    body = text[:-1] if text.endswith("\n") else text
    if "\n" not in body and len(body) <= limit:
        return text
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")), lines[0] if lines else "")
    return f"<{len(lines)} lines, {len(text.encode('utf-8'))} bytes: {first[:80]}>"


def mdevctl_json(type_id: str, attrs: Sequence[Tuple[str, str]] = ()) -> str:
    """mdevctl's definition of an mdev of ``type_id``, started automatically (docs/reference/hardware.md#mdev).

    ``attrs``: ``(attribute, value)`` pairs mdevctl writes to the mdev's sysfs after creating it,
    in order (:func:`vgpuhost.io.vgpudev.mdevctl_attrs` gives the vGPU parameters', so they come back too).
    """
    import json
    return json.dumps({"mdev_type": type_id, "start": "auto", "attrs": [{k: v} for k, v in attrs]},
                      indent=2) + "\n"


__all__ = ["MODPROBE_DIRS", "modprobe_conf_files", "mdevctl_json", "read_config_text", "config_equals", "list_config_files", "exists", "is_file", "is_executable_file", "find_program",
           "audit_value"]
