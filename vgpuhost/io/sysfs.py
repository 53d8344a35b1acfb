"""Every read and write of a kernel file under the host root.

Owns: file I/O on ``sys/``, ``proc/`` and ``dev/`` of a :class:`HostRoot`,
turning ``OSError`` into :class:`SysfsError` that keeps the errno, the path
and the value written.  On a simulated root (made by :mod:`vgpuhost.sim`)
writes go through the simulator's kernel (from :func:`vgpuhost.io.backends.sysfs_kernel`), which applies the same semantics
the kernel would (ENOSPC on a full mdev type, EPERM on a taken VF...).
Must not: decide anything; callers interpret what is read.

Kernel file conventions (docs/reference/hardware.md#pci-and-iommu, #mdev, #vendor-vfio): values end in a newline;
ids read as ``0x10de``; ``driver_override`` reads ``(null)`` when unset;
write-only files (``create``, ``remove``, ``unbind``) read empty.
"""

from __future__ import annotations

import errno
import os
from time import time_ns as _time_ns

from ..model.errors import DeviceError, SysfsError
from .hostroot import HostRoot

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from pathlib import Path
    from typing import Callable, Dict, List, Optional, Tuple, Union

    PathArg = Union[str, Path]
    #: called after every write attempt: (path, value, errno or 0)
    WriteObserver = Callable[[str, str, int], None]
    #: called before every write attempt: (path, value)
    IntentObserver = Callable[[str, str], None]

MAX_READ_BYTES = 1 << 20
#: in a simulated root's metadata directory: the attribute names the simulator fails reads of (one a
#: line, :meth:`vgpuhost.sim.kernel.SimKernel.read`); absent when none
SIM_READ_FAULTS = "read-faults"
#: in a simulated root's metadata directory while a write of the simulator's kernel may be cut short (its
#: writer killed inside it, docs/guide/simulator.md#killed-writer): made before the write changes the tree,
#: removed once it is whole; a :class:`Sysfs` that finds it at its first read has the kernel settle the write
#: first (:meth:`vgpuhost.sim.kernel.SimKernel.settle`), so no reader sees half of one
SIM_UNSETTLED = "unsettled"
#: the first read of :meth:`Sysfs.read_attr_ints_in` (a number); a file that fills it is read again in full
_SMALL_READ_BYTES = 4096
ATTR_READ_BYTES = 65536     # more than a page: a sysfs attribute that fills it is read again in full
#: :meth:`Sysfs.listed_attr_ints` remembers a listing once its directory's ctime is this far behind the clock
LISTING_SETTLED_NS = 1_000_000_000
#: directory -> (its identity, its sorted entries): :meth:`Sysfs.listed_attr_ints`'s listings
_LISTINGS: "Dict[str, tuple]" = {}
_LISTINGS_MAX = 4096
#: (names, attribute) -> the names of the attribute's files (``<name>/<attr>``), made once per listing
_ATTR_NAMES: "Dict[tuple, List[str]]" = {}


def attr_names(names: "Tuple[str, ...]", attr: str) -> "List[str]":
    """``[f"{name}/{attr}" for name in names]``, made once per ``(names, attr)`` and kept (the VFs of a GPU
    list the same type ids: their attribute files' names are made once, not once per VF)."""
    key = (names, attr)
    got = _ATTR_NAMES.get(key)
    if got is None:
        got = [f"{n}/{attr}" for n in names]
        if len(_ATTR_NAMES) >= 256:
            _ATTR_NAMES.clear()
        _ATTR_NAMES[key] = got
    return got


def _read_closing(fd: int, limit: int) -> Optional[bytes]:
    """One ``read(2)`` of at most ``limit`` bytes from ``fd``, which is then closed: the bytes (``b""``
    where the file would block), None on an error (the caller reads the file again its slower way)."""
    try:
        return os.read(fd, limit)
    except BlockingIOError:
        return b""
    except OSError:
        return None
    finally:
        os.close(fd)


class Sysfs:
    """Reads and writes kernel files under one host root.

    All paths are absolute paths under ``host.root`` (derive them with
    :class:`HostRoot`), as strings or path-likes; what the observers hear
    is a string.  No :mod:`pathlib` here: the qemu hook's path uses this
    class (see :mod:`vgpuhost.io.hostroot`).  Reads raise ``SysfsError(op='read')``; writes raise
    ``SysfsError`` with ``value`` set.
    """

    def __init__(self, host: HostRoot, *, observers: Optional[List[WriteObserver]] = None,
                 intents: Optional[List[IntentObserver]] = None):
        """``observers`` hear of every write attempt after it (path, value, errno or 0);
        ``intents`` before it (path, value), so an audit row exists even for a write
        whose process is killed while it runs."""
        self.host = host
        self.observers: List[WriteObserver] = list(observers or [])
        self.intents: List[IntentObserver] = list(intents or [])
        self._simulated = host.is_simulated
        self._sim_kernel = None
        self._sim_read_faults: Optional[frozenset] = None     # read at the first read on a simulated root
        self._real_dirs: Dict[str, str] = {}    # :meth:`resolve`'s directories, each resolved once

    @property
    def simulated(self) -> bool:
        return self._simulated

    @property
    def _kernel(self):
        """The simulator's kernel on a simulated root (None on a real one), made at the first write:
        a command that only reads never loads the simulator."""
        if self._sim_kernel is None and self._simulated:
            from .backends import sysfs_kernel
            self._sim_kernel = sysfs_kernel(self.host)    # the simulator stands in for the kernel
        return self._sim_kernel

    # --- reads ---------------------------------------------------------
    def read(self, path: PathArg) -> str:
        """The file's content with surrounding whitespace stripped."""
        text = self.read_optional(path)
        if text is None:
            raise SysfsError("read", str(path), errno.ENOENT, hint=_read_hint(errno.ENOENT))
        return text

    def read_optional(self, path: PathArg) -> Optional[str]:
        """Like :meth:`read` but None when the file does not exist.

        Reads with one ``read(2)`` of up to 64 KiB, as sysfs attributes are
        at most a page; bytes that are not UTF-8 are replaced.
        """
        try:
            if self._simulated and self._sim_faulted(path):
                from pathlib import Path        # the simulator's kernel takes a Path
                self._kernel.read(Path(path))   # an injected read fault raises OSError
            # O_NONBLOCK: a FIFO planted in the tree must not hang a read
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SysfsError("read", str(path), e.errno or errno.EIO,
                             hint=_read_hint(e.errno)) from e
        try:
            chunks = []
            total = 0
            while total <= MAX_READ_BYTES:
                data = os.read(fd, 65536)
                if not data:
                    break
                chunks.append(data)
                total += len(data)
            else:
                raise SysfsError("read", str(path), errno.EFBIG,
                                 hint=f"a kernel attribute is at most a page; this file is over {MAX_READ_BYTES} bytes")
        except BlockingIOError:
            chunks = []
        except OSError as e:
            raise SysfsError("read", str(path), e.errno or errno.EIO,
                             hint=_read_hint(e.errno)) from e
        finally:
            os.close(fd)
        return b"".join(chunks).decode("utf-8", "replace").strip()

    def read_attr(self, path: str) -> Optional[str]:
        """A sysfs attribute, as :meth:`read_optional` reads it, with one ``read(2)``
        where that suffices.

        A sysfs text attribute is at most a page and the kernel returns all of
        it to the first read (Linux Documentation/filesystems/sysfs.rst), so
        the read that would only see its end is saved; a read that fills the
        buffer falls back to :meth:`read_optional`.  Not for /proc files (they
        come a page per read).
        """
        if self._simulated and self._sim_faulted(path):
            return self.read_optional(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError:
            return self.read_optional(path)     # the same error, raised the same way
        data = _read_closing(fd, ATTR_READ_BYTES)
        if data is None or len(data) >= ATTR_READ_BYTES:
            return self.read_optional(path)
        return data.decode("utf-8", "replace").strip()

    def _sim_faulted(self, path: PathArg) -> bool:
        """On a simulated root: whether reads of a file of this name may fail by an injected read
        fault (:data:`SIM_READ_FAULTS`, read once per instance), so the simulator's kernel decides."""
        names = self._sim_read_faults
        if names is None:
            names = self._sim_first_read()
        return bool(names) and os.path.basename(os.fspath(path)) in names

    def _sim_first_read(self) -> frozenset:
        """This instance's first read of a simulated root: a write the simulator's kernel has not
        settled (:data:`SIM_UNSETTLED`: its writer was killed inside it) is settled first, as the
        kernel's mdev create or remove is one write(2), whole or not at all, so no read sees half a
        device (trial 10 B6: a killed create's device was counted, never listed, until some later
        write); then the names of the attributes whose reads may fail by an injected fault
        (:data:`SIM_READ_FAULTS`), kept.  One ``lstat`` when nothing is unsettled."""
        sim = self.host.s.sim_dir
        if os.path.lexists(os.path.join(sim, SIM_UNSETTLED)):
            try:
                self._kernel.settle()
            except OSError:
                pass        # the tree could not be settled (gone meanwhile): read it as it is
        try:
            with open(os.path.join(sim, SIM_READ_FAULTS), encoding="utf-8") as f:
                names = frozenset(f.read().split())
        except OSError:
            names = frozenset()
        self._sim_read_faults = names
        return names

    def read_int(self, path: PathArg, *, default: Optional[int] = None) -> Optional[int]:
        """An integer file (``0x10de`` or ``-1`` style); ``default`` when absent.

        Raises SysfsError(EINVAL) when the content is not a number.
        """
        return _to_int(self.read_optional(path), path, default)

    def read_attr_int(self, path: str, *, default: Optional[int] = None) -> Optional[int]:
        """:meth:`read_int` for a sysfs attribute, read as :meth:`read_attr` reads it."""
        return _to_int(self.read_attr(path), path, default)

    def read_attr_ints_in(self, directory: str, names: List[str], *,
                          default: Optional[int] = None) -> List[Optional[int]]:
        """``[read_attr_int(directory + name) for name in names]`` (``directory`` ends with ``/``;
        a name may hold a ``/``), the same values and errors, with the directory opened once and each
        file opened relative to it (``openat(2)``: the kernel walks the directory's path once, not once
        per file; a GPU's hundreds of ``available_instances`` files).  A file that cannot be read so
        (an error, a fault the simulator injects, an attribute of a page or more) is read by
        :meth:`read_attr_int` itself."""
        if not names:
            return []
        if self._simulated and (self._sim_faulted(names[0]) or (self._sim_read_faults and any(
                self._sim_faulted(n) for n in names))):      # no faults listed (the first call read them): no loop
            return [self.read_attr_int(directory + n, default=default) for n in names]
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return [self.read_attr_int(directory + n, default=default) for n in names]
        try:
            return self._ints_at(dfd, directory, names, default)
        finally:
            os.close(dfd)

    def listed_attr_ints(self, directory: str, attr: str, *, only=None,
                         default: Optional[int] = None) -> Tuple[Tuple[str, ...], List[Optional[int]]]:
        """``(names, values)``: the sorted entries of ``directory`` (ends with ``/``; :meth:`listdir`'s,
        empty when it is absent) and :meth:`read_attr_int` of each one's ``attr`` (``<name>/<attr>``),
        the directory opened once for both.  ``only``: the names whose ``attr`` is read (a
        container); the others' values are None.

        The listing is remembered across calls (and :class:`Sysfs` instances) with the directory's
        identity, ``fstat(2)`` of the descriptor opened anyway: device and inode number, ctime and
        link count; it is used again only while the directory has that identity.  A directory made
        again (an mdev parent's ``mdev_supported_types`` when its device is removed and added, its
        VFs disabled and enabled: ``sriov_numvfs`` 0 -> N, or the vGPU manager registering the parent
        again) is a new inode: sysfs (kernfs) numbers inodes from a cyclic counter with a
        generation, never reusing one while the system runs.  A directory whose entries change in
        place gets a new ctime (a file system that stores it: the simulator's tree), and so does one
        a file system gives a freed inode number again, as long as the clock moved on: a listing is
        remembered only once the directory's ctime is :data:`LISTING_SETTLED_NS` behind the clock
        (a change later than the listing then gives a later ctime).  Why: an agent re-reads each VF of
        a GPU after every write, and the types a parent lists are the driver's for its life (an A100
        with 20 VFs: 20 listings a read).  Raises SysfsError as :meth:`listdir` and
        :meth:`read_attr_int` do."""
        if self._simulated and self._sim_faulted(attr):
            names = tuple(self.listdir(directory))
            want = [n for n in names if only is None or n in only]
            got = dict(zip(want, self.read_attr_ints_in(directory, [f"{n}/{attr}" for n in want], default=default)))
            return names, [got.get(n) for n in names]
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return (), []
        except OSError as e:
            raise SysfsError("read", str(directory), e.errno or errno.EIO) from e
        try:
            st = os.fstat(dfd)
            ident = (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_nlink)
            kept = _LISTINGS.get(directory)
            if kept is not None and kept[0] == ident:
                names = kept[1]
            else:
                names = tuple(sorted(os.listdir(directory)))
                if _time_ns() - st.st_ctime_ns >= LISTING_SETTLED_NS:
                    if len(_LISTINGS) >= _LISTINGS_MAX:
                        _LISTINGS.clear()
                    _LISTINGS[directory] = (ident, names)
            if only is None:
                files = attr_names(names, attr)
                return names, self._ints_at(dfd, directory, files, default) if files else []
            want = tuple(n for n in names if n in only)
            got = dict(zip(want, self._ints_at(dfd, directory, list(attr_names(want, attr)), default)))
            return names, [got.get(n) for n in names]
        except (FileNotFoundError, NotADirectoryError):
            return (), []
        except OSError as e:
            raise SysfsError("read", str(directory), e.errno or errno.EIO) from e
        finally:
            os.close(dfd)

    def _ints_at(self, dfd: int, directory: str, names: List[str], default: Optional[int]) -> List[Optional[int]]:
        """:meth:`read_attr_ints_in`'s reads, relative to ``dfd`` (``directory`` opened)."""
        out: List[Optional[int]] = []
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
        # the loop runs thousands of times a `types` (one file per parent and type): the calls bound
        # to locals, the read inlined (as _read_closing), the bytes parsed by int() itself where they
        # are a plain number (what _to_int gives for their text; anything else goes through _to_int)
        open_, read, close, append, small = os.open, os.read, os.close, out.append, _SMALL_READ_BYTES
        for n in names:
            try:
                fd = open_(n, flags, dir_fd=dfd)
            except FileNotFoundError:
                append(default)
                continue
            except OSError:
                append(self.read_attr_int(directory + n, default=default))
                continue
            try:
                data = read(fd, small)
            except BlockingIOError:
                data = b""
            except OSError:
                data = None
            finally:
                close(fd)
            if data is None or len(data) >= small:
                append(self.read_attr_int(directory + n, default=default))
                continue
            try:
                append(int(data, 0))
            except ValueError:
                append(_to_int(data.decode("utf-8", "replace").strip(), directory + n, default))
        return out

    def read_attrs_in(self, directory: str, names: List[str]) -> List[Optional[str]]:
        """``[read_optional(directory + name) for name in names]`` (``directory`` ends with ``/``), the same
        texts and errors, with the directory opened once and each file opened relative to it and read
        with one ``read(2)``, as :meth:`read_attr_ints_in` reads numbers.  A file that cannot be read so
        (an error, a fault the simulator injects, a text of a page or more) is read by
        :meth:`read_optional` itself.  Why: a discovery reads 11 attributes of each PCI function, and the
        full path of each walked a symlink (``bus/pci/devices/<BDF>``) again; an A100 with 20 VFs has 21
        functions (2026-12-07)."""
        if not names:
            return []
        if self._simulated and any(self._sim_faulted(n) for n in names):
            return [self.read_optional(directory + n) for n in names]
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return [self.read_optional(directory + n) for n in names]
        out: List[Optional[str]] = []
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            for n in names:
                try:
                    fd = os.open(n, flags, dir_fd=dfd)
                except FileNotFoundError:
                    out.append(None)
                    continue
                except OSError:
                    out.append(self.read_optional(directory + n))
                    continue
                data = _read_closing(fd, _SMALL_READ_BYTES)
                if data is None or len(data) >= _SMALL_READ_BYTES:
                    out.append(self.read_optional(directory + n))
                else:
                    out.append(data.decode("utf-8", "replace").strip())
        finally:
            os.close(dfd)
        return out

    def link_name(self, path: PathArg) -> Optional[str]:
        """The last component of a symlink's target (``driver`` -> ``nvidia``).

        None when the link does not exist.
        """
        try:
            return os.path.basename(os.readlink(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.EINVAL:  # not a symlink
                return None
            raise SysfsError("read", str(path), e.errno or errno.EIO) from e

    def resolve(self, path: PathArg) -> str:
        """The real path of ``path`` (symlinks resolved), a string: what ``os.path.realpath`` gives.

        Each directory it passes through is resolved once per instance (``realpath``: an ``lstat`` per
        component, some 15 under a host root) and remembered; the last component's symlink, when it is
        one, is read (``readlink``) and its target, whose leading ``..`` climb out of that resolved
        directory, resolved the same way.  Why: the sysfs link of each PCI function of a GPU
        (``bus/pci/devices/<BDF>`` -> ``../../../devices/pci0000:40/.../<BDF>``) was resolved with a full
        ``realpath`` per function, about 400 ``lstat`` calls a ``prepare begin`` on a GPU with 20 VFs
        (2026-12-07); the VFs share their directory.  A target with ``..`` after another component, a
        chain of more than 40 links, a directory on the way that meets a loop of links (ELOOP), or an
        error other than "absent" or "not a link" is left to ``realpath`` whole.  One difference: a link removed between ``realpath``'s ``lstat`` and its
        ``readlink`` made it raise FileNotFoundError; here the link is read once, and a removed one is
        absent (its path as given, as ``realpath`` gives an absent path)."""
        p = os.fspath(path)
        for _ in range(40):
            head, tail = os.path.split(p)
            if not head or tail in ("", ".", "..") or not head.startswith("/"):
                break
            real_head = self._real_dirs.get(head)
            if real_head is None:
                try:
                    real_head = os.path.realpath(head, strict=True)
                except FileNotFoundError:
                    real_head = os.path.realpath(head)      # absent: realpath keeps what cannot be resolved
                except OSError:
                    break       # a loop (ELOOP): realpath stops there and keeps the rest of the path as it
                    #             is, so its answer for head + tail is not head's + tail's: left to it whole
                if len(self._real_dirs) >= 256:
                    self._real_dirs.clear()
                self._real_dirs[head] = real_head
            joined = f"{real_head}/{tail}" if real_head != "/" else f"/{tail}"
            try:
                target = os.readlink(joined)
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.ENOENT):
                    return joined           # not a link, or absent (realpath keeps the name as it is)
                break
            if target.startswith("/"):
                p = target
                continue
            base = real_head
            parts = target.split("/")
            i = 0
            while i < len(parts) and parts[i] in ("..", ".", ""):
                if parts[i] == "..":
                    base = os.path.dirname(base)
                i += 1
            rest = [c for c in parts[i:] if c not in ("", ".")]
            if not rest or ".." in rest:
                break
            p = base.rstrip("/") + "/" + "/".join(rest)
        return os.path.realpath(path)

    def listdir(self, path: PathArg) -> List[str]:
        """Sorted entry names; an empty list when the directory is absent."""
        if self._simulated and self._sim_read_faults is None:
            self._sim_first_read()
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise SysfsError("read", str(path), e.errno or errno.EIO) from e

    def exists(self, path: PathArg) -> bool:
        return os.path.lexists(path)

    # --- writes --------------------------------------------------------
    def write(self, path: PathArg, value: str) -> None:
        """Write ``value`` to a kernel file, as ``echo -n value > path`` would.

        Raises SysfsError(errno, path, value) when the kernel refuses.
        """
        p = os.fspath(path)
        err = 0
        self._intend(p, value)
        try:
            if self._kernel is not None:
                from pathlib import Path        # the simulator's kernel takes a Path
                self._kernel.write(Path(p), value)
            else:
                # one write(2), as `echo -n` does; O_NONBLOCK so a FIFO cannot hang us
                fd = os.open(p, os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                try:
                    os.write(fd, value.encode("utf-8"))
                finally:
                    os.close(fd)
        except OSError as e:
            err = e.errno or errno.EIO
            raise SysfsError("write", str(p), err, value=value) from e
        finally:
            self._notify(p, value, err)

    def write_bounded(self, path: PathArg, value: str, timeout_s: float) -> bool:
        """Write ``value`` to ``path`` as :meth:`write` does, but give up waiting after ``timeout_s``
        seconds: True when the write returned in time, False when it is still blocked.

        For a write the kernel may block without end (an mdev ``remove`` while the device is
        open: docs/reference/hardware.md#mdev).  A writer blocked there cannot be interrupted, not
        even by SIGKILL once a signal has come, and a thread of ours blocked so would keep this
        process from exiting; so the write(2) runs in another process: a detached child forked
        for this write (its own session, stdin/stdout/stderr on /dev/null, no other fd: the qemu
        hook's pipes to libvirt close when this process ends), or, in a process that called
        :func:`vgpuhost.io.residentwriter.keep_writer` (the agent), a resident writer started once
        and handed each write over a pipe.  On a timeout that process is left to finish the write
        when the device is closed (reaped by this process meanwhile, or by init once this process
        has ended); this process goes on.  The audit observers hear the write here, with
        ETIMEDOUT on a timeout; a simulated crash point is this process's.  Raises SysfsError when
        the kernel refuses in time, and :class:`WriteOutcomeUnknown` when the process making the write
        ended without answering (killed, out of memory: its write(2) may have been made or not; the
        observers hear EINTR): the caller reads the device back, and treats a write it cannot see made as
        one not done in time, never as a refusal.
        """
        p = os.fspath(path)
        self._intend(p, value)
        kernel = self._kernel       # made here: the child only writes
        crash = kernel.crash_point() if kernel is not None else None
        if crash is not None:
            crash.__enter__()       # a simulated crash point is this process's, as for any write
        try:
            if _bounded_writer is None:
                err = _write_detached(kernel, p, value, timeout_s)
            else:                   # a resident writer (the agent: vgpuhost.io.residentwriter)
                try:
                    err = _bounded_writer(str(self.host.root) if kernel is not None else "", p, value,
                                          kernel.writer_env() if kernel is not None else {}, timeout_s)
                except OSError:     # no writer could be started (nothing written): this write forks its own
                    err = _write_detached(kernel, p, value, timeout_s)
        finally:
            if crash is not None:
                crash.__exit__(None, None, None)
        if err == UNANSWERED:
            self._notify(p, value, errno.EINTR)
            raise WriteOutcomeUnknown(p, value)
        self._notify(p, value, err if err is not None else errno.ETIMEDOUT)
        if err is None:
            return False
        if err:
            raise SysfsError("write", str(p), err, value=value)
        return True

    def _intend(self, path: str, value: str) -> None:
        """Tell every intent observer (the audit log, written before the write) about one write."""
        for obs in self.intents:
            obs(path, value)

    def _notify(self, path: str, value: str, err: int) -> None:
        """Tell every observer (the audit log) about one write attempt."""
        for obs in self.observers:
            obs(path, value, err)

    # --- host configuration files (etc/) --------------------------------------
    def write_config(self, path: PathArg, text: str) -> None:
        """Write a configuration file atomically (temp file + rename), creating its directory.

        For files under ``<root>/etc`` that other tools read (driverctl,
        mdevctl, modprobe.d, systemd units).  Raises SysfsError keeping the
        errno and path.  The audit value is the text itself when it is one
        short line, else a summary (lines, bytes, first line): a unit file
        does not belong in one audit row.
        """
        from .configfiles import audit_value       # not on the qemu hook's path: it writes no config file
        p = os.fspath(path)
        err = 0
        self._intend(p, audit_value(text))

        def apply() -> None:
            head, name = os.path.split(p)
            os.makedirs(head, exist_ok=True)
            tmp = os.path.join(head, f".{name}.vgpuhost-tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, p)
        try:
            if self._kernel is not None:
                from pathlib import Path        # the simulator's kernel takes a Path
                self._kernel.file_op(Path(p), audit_value(text), apply)   # a crash point on a simulated root
            else:
                apply()
        except OSError as e:
            err = e.errno or errno.EIO
            raise SysfsError("write", str(p), err, value=text) from e
        finally:
            self._notify(p, audit_value(text), err)

    def remove_config(self, path: PathArg) -> bool:
        """Remove a configuration file; False when it was not there."""
        p = os.fspath(path)
        if not os.path.lexists(p):
            return False
        self._intend(p, "<remove>")
        try:
            if self._kernel is not None:
                from pathlib import Path        # the simulator's kernel takes a Path
                self._kernel.file_op(Path(p), "<remove>", lambda: os.unlink(p))     # a crash point on a simulated root
            else:
                os.unlink(p)
        except FileNotFoundError:
            self._notify(p, "<remove>", 0)
            return False
        except OSError as e:
            self._notify(p, "<remove>", e.errno or errno.EIO)
            raise SysfsError("remove", str(p), e.errno or errno.EIO) from e
        self._notify(p, "<remove>", 0)
        return True


#: what a bounded write's process answers when it ended without answering (killed, out of memory, after its
#: write(2) or before it: the write's outcome is unknown; :class:`WriteOutcomeUnknown`)
UNANSWERED = -1


class WriteOutcomeUnknown(DeviceError):
    """A bounded write (:meth:`Sysfs.write_bounded`) whose outcome this process does not know: the process
    making it ended without answering (killed, out of memory): its write(2) may have been made or not, and
    only the device tells which.  ``path`` and ``value`` are the write's.  The
    caller reads the device back and treats a write it cannot see made as one not done in time, never as a
    refusal.  Exit 3."""

    def __init__(self, path: str, value: str):
        self.path = str(path)
        self.value = value
        super().__init__(f"writing {value!r} to {self.path}: {self.why}")

    @property
    def why(self) -> str:
        """Why the outcome is unknown, as a clause."""
        return ("the process making the write ended without answering (killed?), so whether it was made is not "
                "known")


#: how this process makes a bounded write when not by a forked child (:func:`set_bounded_writer`): None, or
#: ``(root, path, value, env, timeout_s) -> errno (0: written), None (not done in time) or UNANSWERED``;
#: raises OSError when it could not take the write (nothing written: the write then forks, as without it)
_bounded_writer = None


def set_bounded_writer(writer) -> None:
    """Make every later :meth:`Sysfs.write_bounded` of this process through ``writer`` (``(root, path, value,
    env, timeout_s) -> errno or None``: ``root`` the simulated host root whose kernel makes the write, ``""`` on
    a real one; ``env`` the simulator's environment, :meth:`vgpuhost.sim.kernel.SimKernel.writer_env`; None when
    the write did not return within ``timeout_s`` seconds, :data:`UNANSWERED` when its process ended without
    answering; raising OSError when it could not take the write, which then forks its own child), or through
    a forked child per write again (None).
    :func:`vgpuhost.io.residentwriter.keep_writer` calls it."""
    global _bounded_writer
    _bounded_writer = writer


def _write_once(kernel, path: str, value: str) -> None:
    """One write of ``value`` (through the simulator's ``kernel`` when there is one, uncounted)."""
    if kernel is not None:
        from pathlib import Path        # the simulator's kernel takes a Path
        kernel.write(Path(path), value, counted=False)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        os.write(fd, value.encode("utf-8"))
    finally:
        os.close(fd)


def _max_fd() -> int:
    try:
        return max(1024, os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        return 65536


#: writers left blocked by :func:`_write_detached` (their pids): reaped, without waiting, at the next call
_abandoned: "List[int]" = []


def _reap_abandoned() -> None:
    """Collect the exit status of each abandoned writer that has finished since (never blocks)."""
    for pid in list(_abandoned):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid                              # reaped elsewhere: nothing left to wait for
        if done and pid in _abandoned:              # another thread may have reaped it meanwhile
            _abandoned.remove(pid)


def _write_detached(kernel, path: str, value: str, timeout_s: float) -> Optional[int]:
    """Run :func:`_write_once` in a detached child; its errno (0: written), None: not done
    within ``timeout_s`` seconds, :data:`UNANSWERED`: the child ended without answering (killed
    after its write(2), or before it: unknown; see :meth:`Sysfs.write_bounded`).

    One fork, not two: a fork costs about the size of this process's page tables (22-28 ms each
    for a 100 MB agent, measured 2026-12-07 on the 2-core development machine under load), and
    the agent makes one per remove.  The child starts its own session and holds no fd of ours
    but its end of the result pipe; it writes the errno and exits.  A child that answers in
    time is reaped at once; one left blocked is listed in :data:`_abandoned` and reaped at a
    later call (or by init, once this process has ended: the one-shot hook's case)."""
    _reap_abandoned()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the writer
        try:
            os.close(r)
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            # no other fd: a lock (flock is per open file) or a pipe to libvirt held here would
            # outlive this process's parent
            os.closerange(3, w)
            os.closerange(w + 1, _max_fd())
            err = 0
            try:
                _write_once(kernel, path, value)
            except OSError as e:
                err = e.errno or errno.EIO
            except BaseException:
                err = errno.EIO
            os.write(w, str(err).encode("ascii"))
        finally:
            os._exit(0)
    os.close(w)
    import select           # here: a C module (dlopen) only a bounded write needs (0.2 ms a prepare; `types` never)
    from .locks import wait_long

    def answered(t: float) -> Optional[bool]:
        return True if select.select([r], [], [], max(0.0, t))[0] else None
    try:
        # past LEND_AFTER_S this thread lends what it holds (the agent's write lock) for the rest of the wait
        if not wait_long(answered, max(0.0, timeout_s)):
            _abandoned.append(pid)
            return None
        data = os.read(r, 32)
    finally:
        os.close(r)
    if data:
        os.waitpid(pid, 0)                          # it has written its answer: it exits now
    else:
        _abandoned.append(pid)                      # the pipe closed unanswered: it is ending anyway
        _reap_abandoned()
    text = data.decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else UNANSWERED     # no answer (or a torn one): the outcome is unknown


def int_of(text: Optional[str], path: PathArg, default: Optional[int] = None) -> Optional[int]:
    """The number in ``text``, the content of the file at ``path`` as :meth:`Sysfs.read_attrs_in` gave
    it, read as :meth:`Sysfs.read_int` reads it (``0x10de`` or ``-1`` style; ``default`` for None or
    empty).  Raises SysfsError(EINVAL) naming ``path`` when it is not a number."""
    return _to_int(text, path, default)


def _to_int(text: Optional[str], path: PathArg, default: Optional[int]) -> Optional[int]:
    if text is None or text == "":
        return default
    try:
        return int(text, 0)
    except ValueError:
        try:
            return int(text, 10)
        except ValueError:
            raise SysfsError("read", str(path), errno.EINVAL,
                             hint=f"expected a number, found {text[:40]!r}") from None


def _read_hint(err: Optional[int]) -> Optional[str]:
    if err == errno.EACCES:
        return "run as root, or check the file's permissions"
    if err == errno.ENOENT:
        return "is --root pointing at a host root (a directory holding sys/ and proc/)?"
    return None
