"""Unix stream sockets for the agent's local API: bind, systemd's LISTEN_FDS, peer credentials, connect.

Owns: creating a listening socket file with its mode and group
(:func:`bind`), adopting sockets systemd passed by socket activation
(:func:`listen_fds`, the ``sd_listen_fds(3)`` protocol: ``LISTEN_PID``,
``LISTEN_FDS``, ``LISTEN_FDNAMES``, descriptors from 3), reading who is on
the other end (:func:`peer`: ``SO_PEERCRED``'s pid, uid and gid, plus the
supplementary groups from ``SO_PEERGROUPS``), naming groups
(:func:`group_id`, :func:`group_name`: the group database), connecting as a
client (:func:`connect`) and telling
systemd the service is ready (:func:`sd_notify`, the ``sd_notify(3)``
protocol: one datagram to ``$NOTIFY_SOCKET``).
Must not: parse HTTP or decide roles; it reports facts about sockets.

The peer's credentials are the kernel's (``socket(7)``, ``SO_PEERCRED`` and
``SO_PEERGROUPS``: the credentials the peer held at ``connect()`` time, kept
with the socket).  They are not read from ``/proc/<pid>/status`` while the
kernel can give them: the pid names whatever process holds it *now*, so a
peer that passed its connection on and exited could have its pid reused by a
process with more groups.  Only where ``SO_PEERGROUPS`` is missing (Linux
before 4.13) or the peer holds more groups than one call reads (256) are the
groups read from the real ``/proc`` (never a simulated host root), and then
only when that process's effective uid and gid are still the ones
``SO_PEERCRED`` reported; otherwise the primary group alone counts.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook imports this module)
    from typing import Dict, FrozenSet, Mapping, Optional, Union

from ..model.errors import HostEnvironmentError, InputError
from ..model.values import is_digits

#: the first descriptor systemd passes (``SD_LISTEN_FDS_START``)
LISTEN_FDS_START = 3


class Peer:
    """Who connected: ``pid``, ``uid``, ``gid`` (SO_PEERCRED) and ``groups`` (every gid the
    process holds: primary and supplementary; the primary alone when /proc cannot say)."""

    __slots__ = ("pid", "uid", "gid", "groups")

    def __init__(self, pid: int, uid: int, gid: int, groups: "FrozenSet[int]"):
        self.pid, self.uid, self.gid, self.groups = pid, uid, gid, groups

    def __repr__(self) -> str:
        return f"Peer(pid={self.pid}, uid={self.uid}, gid={self.gid}, groups={sorted(self.groups)})"


def group_name(gid: int) -> "Optional[str]":
    """The name of group ``gid`` in the group database (``getgrgid(3)``: /etc/group or NSS), None when it
    has none."""
    import grp
    try:
        return grp.getgrgid(gid).gr_name
    except (KeyError, OverflowError):
        return None


#: the group database's file (``group(5)``); :func:`group_db_stamp` says when it changed
GROUP_DB = "/etc/group"


def group_db_stamp() -> "Optional[tuple]":
    """What changes whenever :data:`GROUP_DB` is written (in place or replaced, as ``groupadd`` and
    ``usermod`` do): its device, inode, size, and modification and change times in nanoseconds; None when
    it cannot be read (``stat(2)``: one system call, no read of the file)."""
    try:
        st = os.stat(GROUP_DB)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def group_id(group: "Union[str, int]") -> int:
    """The gid of ``group`` (a name, or a number given as int or digits; a number need not be
    in the group database).  Raises InputError for an unknown name."""
    if isinstance(group, int):
        return group
    text = str(group).strip()
    if is_digits(text):
        return int(text)
    import grp
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise InputError(f"no group {text!r} on this host",
                         hint=f"create it (groupadd --system {text}) or name another group or a gid") from None


def bind(path: "Union[str, os.PathLike]", *, mode: int, gid: int, backlog: int = socket.SOMAXCONN) -> socket.socket:
    """A listening AF_UNIX stream socket at ``path``, mode ``mode`` (e.g. 0o660), group ``gid``, with
    ``backlog`` connections queued before ``connect()`` fails with EAGAIN (the kernel caps it at
    ``net.core.somaxconn``).

    The parent directory is created (0755) when missing.  A stale socket
    file at ``path`` (nobody answers) is replaced; a live one, or anything
    that is not a socket, is refused with HostEnvironmentError.
    """
    path = os.fspath(path)
    parent = os.path.dirname(path) or "."
    try:
        os.makedirs(parent, mode=0o755, exist_ok=True)
    except OSError as e:
        raise HostEnvironmentError(f"cannot create the socket directory {parent!r}: {e.strerror}",
                                   hint="pass --socket-dir DIR to a writable directory") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise HostEnvironmentError(f"{path!r} exists and is not a socket", hint="move it aside")
        if answers(path):
            raise HostEnvironmentError(f"another agent is listening on {path!r}",
                                       hint="stop it first (systemctl stop vgpuhost-agent.socket "
                                            "vgpuhost-agent.service)")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)          # no window in which the socket is reachable by others
        try:
            _at(path, sock.bind)
        finally:
            os.umask(old)
        os.chown(path, -1, gid)
        os.chmod(path, mode)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise HostEnvironmentError(f"cannot listen on {path!r}: {e.strerror or e}",
                                   hint="check the directory's permissions (the agent runs as root)") from None
    return sock


def remove_socket(path: "Union[str, os.PathLike]") -> None:
    """Remove the socket file at ``path`` if it is one (at shutdown of sockets the agent bound)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def listen_fds(env: "Optional[Mapping[str, str]]" = None, *, unset: bool = True) -> "Dict[str, socket.socket]":
    """Sockets systemd passed to this process, by name (``LISTEN_FDNAMES``; ``fd<N>`` when unnamed).

    Empty when ``LISTEN_PID`` is not this process or ``LISTEN_FDS`` is
    missing.  ``unset``: remove the variables from ``os.environ`` (children
    must not adopt the descriptors, ``sd_listen_fds(3)``).  Only AF_UNIX
    stream sockets are accepted; another kind raises HostEnvironmentError.
    """
    env = os.environ if env is None else env
    try:
        pid = int(env.get("LISTEN_PID", ""))
        count = int(env.get("LISTEN_FDS", ""))
    except ValueError:
        return {}
    if pid != os.getpid() or count <= 0:
        return {}
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    if unset and env is os.environ:
        for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(k, None)
    out: Dict[str, socket.socket] = {}
    for i in range(count):
        fd = LISTEN_FDS_START + i
        sock = socket.socket(fileno=fd)
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise HostEnvironmentError(f"systemd passed descriptor {fd} that is not a unix stream socket",
                                       hint="the .socket unit must use ListenStream= with a path")
        os.set_inheritable(fd, False)
        name = names[i] if i < len(names) and names[i] else f"fd{fd}"
        out[name] = sock
    return out


def sd_notify(state: str, env: "Optional[Mapping[str, str]]" = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd's ``$NOTIFY_SOCKET`` (``sd_notify(3)``).

    For ``Type=notify`` units: a path, or an abstract address written with a
    leading ``@``.  Returns False, sending nothing, when the variable is unset
    (not started by systemd, or not ``Type=notify``); raises nothing: a
    failed send is False too (systemd then times the start out and says so).
    """
    env = os.environ if env is None else env
    address = env.get("NOTIFY_SOCKET", "")
    if not address or not (address.startswith("/") or address.startswith("@")):
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True


def socket_path(sock: socket.socket) -> str:
    """The file a listening unix socket is bound to ('' when abstract or unbound)."""
    name = sock.getsockname()
    return name if isinstance(name, str) else ""


def socket_group(sock: socket.socket) -> "Optional[int]":
    """The group owning the socket file of ``sock`` (None when it has none)."""
    path = socket_path(sock)
    try:
        return os.stat(path).st_gid if path else None
    except OSError:
        return None


#: the longest path ``sockaddr_un`` holds (108 bytes with its NUL, ``unix(7)``)
MAX_PATH = 107


def _at(path: str, call) -> None:
    """``call(path)``; a path too long for ``sockaddr_un`` is reached from its directory
    (chdir there and back: only for single-threaded callers, the hook, the CLI, the agent's start)."""
    if len(os.fsencode(path)) <= MAX_PATH:
        call(path)
        return
    here = os.open(".", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.chdir(os.path.dirname(path) or ".")
        call(os.path.basename(path))
    finally:
        os.fchdir(here)
        os.close(here)


_UCRED = struct.Struct("3i")
#: ``SO_PEERGROUPS`` (Linux 4.13, asm-generic value; Python names it from 3.x on some builds only)
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
#: the most groups one ``SO_PEERGROUPS`` read returns (Python's getsockopt reads at most 1024 bytes)
PEERGROUPS_MAX = 256


def peer(conn: socket.socket) -> Peer:
    """The credentials of the process at the other end of ``conn``: ``SO_PEERCRED``'s pid, uid and
    gid and ``SO_PEERGROUPS``'s supplementary groups, as the kernel kept them at ``connect()``
    (see the module docstring for the fallback to ``/proc``)."""
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    groups = _peer_groups(conn)
    if groups is None:
        groups = _proc_groups(pid, uid, gid)
    return Peer(pid, uid, gid, frozenset({gid}) | groups)


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of ``conn`` (``SO_PEERCRED``; no ``/proc`` read)."""
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]


def _peer_groups(conn: socket.socket) -> "Optional[FrozenSet[int]]":
    """``SO_PEERGROUPS``: the peer's supplementary groups at connect time; None when the kernel has no
    such option or the peer holds more than :data:`PEERGROUPS_MAX` groups (ERANGE)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * PEERGROUPS_MAX)
    except OSError:
        return None
    n = len(raw) // 4
    return frozenset(struct.unpack(f"{n}I", raw[:4 * n]))


def _proc_groups(pid: int, uid: int, gid: int) -> "FrozenSet[int]":
    """The supplementary groups of ``pid`` from the real ``/proc/<pid>/status``, only while its effective
    uid and gid are still ``uid`` and ``gid`` (else empty: a reused pid is not the peer); empty when
    unreadable."""
    from .hostroot import running_kernel_proc_status
    found = {}
    try:
        with open(running_kernel_proc_status(pid), "rb") as f:
            for line in f:
                key = line.split(b":", 1)[0]
                if key in (b"Uid", b"Gid", b"Groups"):
                    found[key] = [int(v) for v in line.split()[1:]]
    except (OSError, ValueError):
        return frozenset()
    uids, gids = found.get(b"Uid", []), found.get(b"Gid", [])
    if len(uids) < 2 or len(gids) < 2 or uids[1] != uid or gids[1] != gid:
        return frozenset()
    return frozenset(found.get(b"Groups", []))


def connect(path: "Union[str, os.PathLike]", timeout_s: float) -> socket.socket:
    """A connected client socket to ``path``; raises OSError (ENOENT, ECONNREFUSED, EACCES, ...)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        _at(os.fspath(path), sock.connect)
    except BaseException:
        sock.close()
        raise
    return sock


def answers(path: "Union[str, os.PathLike]", timeout_s: float = 0.5) -> bool:
    """Does a process accept connections on the socket at ``path``?"""
    try:
        connect(path, timeout_s).close()
        return True
    except OSError:
        return False
