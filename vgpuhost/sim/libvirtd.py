"""A real, isolated libvirtd for end-to-end tests and the demo.

Owns: starting Debian's monolithic ``libvirtd`` (libvirt 9.x) in a private
mount and network namespace (``unshare --mount --net --propagation
private``), with private copies of the five libvirt directories
bind-mounted over ``/etc/libvirt``, ``/run/libvirt``, ``/var/lib/libvirt``,
``/var/log/libvirt`` and ``/var/cache/libvirt`` *inside that namespace
only*, and stopping it without leaving a process behind.
Must not: touch the machine's own libvirt daemon or state.  Everything the
daemon writes lands under ``workdir``; the only trace on the machine is an
empty mount-point directory for each of the five paths that did not exist
(a bind mount needs one; libvirt-daemon-system would create them anyway).

Seen from outside the namespace the private directories are plain
directories under ``workdir``, so the unix socket
``<workdir>/run/libvirt-sock`` reaches the daemon (:attr:`IsolatedLibvirtd.uri`)
and files written by hooks land where tests can read them.  Everything else
(``/tmp``, pytest's temp dirs, the venv) is shared with the machine, so a
hook script in :attr:`IsolatedLibvirtd.hooks_dir` runs vgpuhost against a
simulated host root under ``/tmp`` unchanged.

Process tree (all in the new namespaces)::

    python -m vgpuhost.sim.libvirtd --ns-init SPEC   (pid = IsolatedLibvirtd.pid's parent)
      `- libvirtd -f /etc/libvirt/libvirtd.conf      (IsolatedLibvirtd.pid)
      `- qemu-system-x86_64 ...                      (re-parented: the init is a subreaper)

The init makes the bind mounts, reaps every orphan at once (libvirt waits
for a destroyed qemu to vanish; a slow machine init leaves it a zombie for
seconds), forwards SIGHUP/SIGTERM to libvirtd, and when libvirtd exits (or
its own parent dies: ``PR_SET_PDEATHSIG``) kills every process left in the
network namespace.

libvirt facts used (docs/reference/libvirt.md): ``qemu.conf`` needs ``user``/``group``
root, ``dynamic_ownership = 0``, ``security_driver = "none"``,
``stdio_handler = "file"`` (no virtlogd), ``cgroup_controllers = []``;
the qemu driver looks up the users/groups ``libvirt-qemu`` and ``kvm`` at
start even when qemu.conf says root, so when the machine lacks them the init
bind-mounts private copies of ``/etc/passwd``/``/etc/group`` that add them.
Hooks in ``/etc/libvirt/hooks/qemu.d`` are cached at daemon start and
rescanned on SIGHUP, right before the daemon hook
``/etc/libvirt/hooks/daemon - reload begin SIGHUP`` runs; the private etc
holds such a daemon hook, which :meth:`IsolatedLibvirtd.reload_hooks` uses
as its barrier.

Needs root, util-linux ``unshare`` (and the kernel's permission to use it),
and Debian's ``libvirt-daemon``, ``libvirt-daemon-driver-qemu``,
``libvirt-clients`` and ``qemu-system-x86``: see :func:`available`.
"""

from __future__ import annotations

import ctypes
import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid as uuidlib
import weakref
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import quote
from xml.sax.saxutils import escape

from ..io import files
from ..io.hostroot import HostRoot
from ..model.errors import HostEnvironmentError
from ..model.values import is_digits

#: The machine this daemon runs on (its real root, never a simulated host).
MACHINE = HostRoot(Path("/"))

#: private directory name under ``workdir`` -> the path it replaces in the namespace
NS_DIRS: Dict[str, Path] = {
    "etc": MACHINE.etc("libvirt"),
    "run": MACHINE.path("run", "libvirt"),
    "lib": MACHINE.path("var", "lib", "libvirt"),
    "log": MACHINE.path("var", "log", "libvirt"),
    "cache": MACHINE.path("var", "cache", "libvirt"),
}

#: this module, as ``python -m`` runs it (the namespace's init, the keeper): its name even when it is ``__main__``
MODULE = "vgpuhost.sim.libvirtd"

QEMU_BINARY = "qemu-system-x86_64"
#: the users/groups libvirt's qemu driver resolves at start (Debian's build)
QEMU_USER = "libvirt-qemu"
QEMU_GROUPS = ("libvirt-qemu", "kvm")

#: seconds: stop() waits this long after SIGTERM before SIGKILL
STOP_GRACE_S = 10.0
VIRSH_TIMEOUT_S = 60.0

LIBVIRTD_CONF = """\
# Written by vgpuhost.sim.libvirtd: unix socket only, no TCP/TLS.
listen_tls = 0
listen_tcp = 0
unix_sock_group = "root"
unix_sock_ro_perms = "0777"
unix_sock_rw_perms = "0700"
unix_sock_admin_perms = "0700"
auth_unix_ro = "none"
auth_unix_rw = "none"
log_outputs = "3:stderr"
"""

QEMU_CONF = """\
# Written by vgpuhost.sim.libvirtd (docs/reference/libvirt.md).
user = "root"
group = "root"
dynamic_ownership = 0
security_driver = "none"
stdio_handler = "file"
cgroup_controllers = [ ]
"""

# The daemon hook: libvirt runs it as `daemon - start|reload|shutdown begin ...`.
# A "reload" line proves the SIGHUP rescan of the hook directories happened.
DAEMON_HOOK = """\
#!/bin/sh
# Written by vgpuhost.sim.libvirtd: reload_hooks() waits for the "reload" line.
echo "$2 $3 $4" >> {log}
exit 0
"""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_MS_BIND = 4096
_SUN_PATH_MAX = 107   # sockaddr_un.sun_path is 108 bytes with the NUL


# --- what the machine offers --------------------------------------------------

def find_binary(name: str) -> Optional[str]:
    """``name`` on ``$PATH`` or in the sbin/bin directories (libvirtd lives in /usr/sbin)."""
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def available() -> Tuple[bool, str]:
    """Whether an :class:`IsolatedLibvirtd` can run here: ``(True, "")`` or ``(False, reason)``.

    Checks root, ``unshare`` and a trial ``unshare --mount --net``, and the
    ``libvirtd``, ``virsh`` and ``qemu-system-x86_64`` binaries.  Takes a few
    milliseconds.
    """
    if os.geteuid() != 0:
        return False, f"needs root for private mount/network namespaces (euid {os.geteuid()})"
    missing = [f"{name} (Debian package {pkg})" for name, pkg in (
        ("unshare", "util-linux"), ("libvirtd", "libvirt-daemon"), ("virsh", "libvirt-clients"),
        (QEMU_BINARY, "qemu-system-x86")) if find_binary(name) is None]
    if missing:
        return False, "not installed: " + ", ".join(missing)
    if not any(MACHINE.path("usr", "lib").glob("*/libvirt/connection-driver/libvirt_driver_qemu.so")):
        return False, "libvirt's qemu driver is not installed (Debian package libvirt-daemon-driver-qemu)"
    try:
        proc = subprocess.run([find_binary("unshare"), "--mount", "--net", "--propagation", "private", "true"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"'unshare --mount --net' could not be run: {e}"
    if proc.returncode != 0:
        return False, (f"'unshare --mount --net' is not permitted here (rc {proc.returncode}): "
                       f"{(proc.stderr or proc.stdout).strip()[:200]}")
    return True, ""


def kvm_usable() -> bool:
    """Whether ``/dev/kvm`` opens read-write (then domains use ``type='kvm'``)."""
    try:
        fd = os.open(MACHINE.path("dev", "kvm"), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def diskless_domain_xml(name: str, uuid: Optional[str] = None, memory_mib: int = 64) -> str:
    """A tiny domain that really starts under :class:`IsolatedLibvirtd`.

    ``type='kvm'`` when ``/dev/kvm`` works, else ``'qemu'`` (TCG).  No disk,
    network, graphics or balloon; the guest sits in the firmware's boot
    loop.  ``uuid`` defaults to one derived from ``name`` (uuid5), so the
    same name gives the same UUID.  ``memory_mib`` in MiB.
    """
    if uuid is None:
        uuid = str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, "vgpuhost-sim-domain:" + name))
    virt = "kvm" if kvm_usable() else "qemu"
    return f"""<domain type='{virt}'>
  <name>{escape(name)}</name>
  <uuid>{escape(uuid)}</uuid>
  <memory unit='MiB'>{int(memory_mib)}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
  </os>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{escape(str(MACHINE.path("usr", "bin", QEMU_BINARY)))}</emulator>
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
  </devices>
</domain>
"""


# --- the daemon ---------------------------------------------------------------

class _Proc:
    """What the finalizer needs to stop a daemon (no reference to the owner)."""

    def __init__(self) -> None:
        self.popen: Optional[subprocess.Popen] = None
        self.netns: Optional[str] = None     # "net:[inode]" of the daemon's network namespace
        self.netns_fd: Optional[int] = None  # held open so the inode cannot be reused while we scan
        self.uri: str = ""
        self.log = None


class IsolatedLibvirtd:
    """``libvirtd`` in private mount + network namespaces, all its state under ``workdir``.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.  After
    start: :attr:`uri` reaches the daemon from outside the namespace,
    :attr:`etc_dir` is its ``/etc/libvirt``, :attr:`hooks_dir` its
    ``/etc/libvirt/hooks/qemu.d`` (call :meth:`reload_hooks` after changing
    it), :attr:`log_path` its stderr (libvirt warnings and errors), and
    :attr:`pid` the libvirtd process id (as seen from outside).

    ``workdir`` layout: ``etc/ run/ lib/ log/ cache/`` (the five private
    directories), ``libvirtd.log``, ``libvirtd.pid``, ``daemon-hook.log``
    and, when the machine lacks the qemu users, ``passwd``/``group``.

    Raises :class:`HostEnvironmentError` from :meth:`start` when the machine
    cannot run it (see :func:`available`) or the daemon does not come up.
    """

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir).absolute()
        self.etc_dir = self.workdir / "etc"
        self.hooks_dir = self.etc_dir / "hooks" / "qemu.d"
        self.run_dir = self.workdir / "run"
        self.socket_path = self.run_dir / "libvirt-sock"
        self.log_path = self.workdir / "libvirtd.log"
        self.pid_file = self.workdir / "libvirtd.pid"
        self.daemon_hook_log = self.workdir / "daemon-hook.log"
        self.uri = "qemu:///system?socket=" + quote(str(self.socket_path), safe="/")
        self.pid: Optional[int] = None
        self._proc = _Proc()
        self._proc.uri = self.uri
        self._finalizer = weakref.finalize(self, _stop, self._proc, STOP_GRACE_S)

    # --- context manager ---------------------------------------------------
    def __enter__(self) -> "IsolatedLibvirtd":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        p = self._proc.popen
        return p is not None and p.poll() is None

    # --- start -------------------------------------------------------------
    def start(self, timeout_s: float = 30) -> None:
        """Prepare ``workdir``, start the daemon and wait until it answers (``timeout_s`` seconds).

        Raises HostEnvironmentError (with the end of :attr:`log_path`) when
        it is not available here, exits early, or does not answer in time;
        nothing is left running then.  Call it from a thread that lives as
        long as the daemon should (the main thread): the daemon's init gets
        SIGTERM when the thread that started it ends (``PR_SET_PDEATHSIG``).
        """
        if self.running:
            return
        ok, reason = available()
        if not ok:
            raise HostEnvironmentError(f"cannot run an isolated libvirtd: {reason}",
                                       hint="run as root on Debian 12 with 'make dev' done")
        if len(os.fsencode(self.socket_path)) > _SUN_PATH_MAX:
            raise HostEnvironmentError(
                f"workdir {self.workdir} is too long for a unix socket path ({self.socket_path})",
                hint=f"use a workdir whose path is shorter than {_SUN_PATH_MAX - 20} bytes")
        mounts = self._prepare()
        libvirtd = find_binary("libvirtd")
        spec = {
            "parent": os.getpid(),
            "mounts": mounts,
            "argv": [libvirtd, "-f", str(NS_DIRS["etc"] / "libvirtd.conf"), "-p", str(self.pid_file)],
        }
        env = dict(os.environ)
        path = env.get("PATH", "").split(os.pathsep)
        env["PATH"] = os.pathsep.join(
            [p for p in path if p] +
            [d for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
             if d not in path])
        self._proc.log = open(self.log_path, "ab")
        self._proc.popen = subprocess.Popen(
            [find_binary("unshare"), "--mount", "--net", "--propagation", "private",
             sys.executable, "-m", MODULE, "--ns-init", json.dumps(spec)],
            stdin=subprocess.DEVNULL, stdout=self._proc.log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _prepare(self) -> List[List[str]]:
        """Make the private directories and config; the ``[source, target]`` bind mounts."""
        for name in NS_DIRS:
            (self.workdir / name).mkdir(parents=True, exist_ok=True)
        for sub in ("etc/qemu/autostart", "etc/hooks/qemu.d", "lib/qemu", "log/qemu", "cache/qemu"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.pid_file.unlink(missing_ok=True)   # a stale one would name the wrong process
        (self.etc_dir / "libvirtd.conf").write_text(LIBVIRTD_CONF)
        (self.etc_dir / "qemu.conf").write_text(QEMU_CONF)
        hook = self.etc_dir / "hooks" / "daemon"
        hook.write_text(DAEMON_HOOK.format(log=_sh_quote(str(self.daemon_hook_log))))
        hook.chmod(0o755)
        mounts = []
        for name, target in NS_DIRS.items():
            # A bind mount needs an existing mount point; an empty directory is the only
            # trace left on the machine (the namespace's mounts vanish with it).
            target.mkdir(parents=True, exist_ok=True)
            mounts.append([str(self.workdir / name), str(target)])
        mounts += self._account_mounts()
        return mounts

    def _account_mounts(self) -> List[List[str]]:
        """Private /etc/passwd and /etc/group adding the qemu user/groups when the machine lacks them."""
        need_groups = []
        for g in QEMU_GROUPS:
            try:
                grp.getgrnam(g)
            except KeyError:
                need_groups.append(g)
        try:
            pwd.getpwnam(QEMU_USER)
            need_user = False
        except KeyError:
            need_user = True
        if not need_groups and not need_user:
            return []
        out = []
        gids = {}
        group_text = MACHINE.etc("group").read_text()
        used = {int(line.split(":")[2]) for line in group_text.splitlines() if line.count(":") >= 3
                and is_digits(line.split(":")[2])}
        lines = []
        for g in need_groups:
            gid = next(n for n in range(64055, 65000) if n not in used)
            used.add(gid)
            gids[g] = gid
            lines.append(f"{g}:x:{gid}:")
        if lines:
            (self.workdir / "group").write_text(group_text.rstrip("\n") + "\n" + "\n".join(lines) + "\n")
            out.append([str(self.workdir / "group"), str(MACHINE.etc("group"))])
        if need_user:
            passwd_text = MACHINE.etc("passwd").read_text()
            uids = {int(line.split(":")[2]) for line in passwd_text.splitlines() if line.count(":") >= 6
                    and is_digits(line.split(":")[2])}
            uid = next(n for n in range(64055, 65000) if n not in uids)
            gid = gids.get(QEMU_USER) or grp.getgrnam(QEMU_USER).gr_gid
            (self.workdir / "passwd").write_text(
                passwd_text.rstrip("\n") + f"\n{QEMU_USER}:x:{uid}:{gid}:Libvirt Qemu:"
                f"{NS_DIRS['lib']}:/usr/sbin/nologin\n")
            out.append([str(self.workdir / "passwd"), str(MACHINE.etc("passwd"))])
        return out

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.running:
                raise HostEnvironmentError(
                    f"libvirtd exited at start (rc {self._proc.popen.returncode}): {self._log_tail()}",
                    hint=f"see {self.log_path}")
            if self.pid is None and self.pid_file.exists():
                text = self.pid_file.read_text().strip()
                self.pid = int(text) if is_digits(text) else None
            if self.pid is not None and self.socket_path.exists():
                proc = self.virsh("uri", timeout=max(1.0, deadline - time.monotonic()))
                if proc.returncode == 0:
                    break
            if time.monotonic() > deadline:
                raise HostEnvironmentError(f"libvirtd did not answer within {timeout_s:g} s: {self._log_tail()}",
                                           hint=f"see {self.log_path}")
            time.sleep(0.02)
        # libvirtd's own namespace (the init's may not be unshared yet when start() fails early).
        netns = _netns_of(self.pid)
        if netns is None or netns == _netns_of(os.getpid()):
            raise HostEnvironmentError(f"libvirtd (pid {self.pid}) is not in a private network namespace",
                                       hint=f"see {self.log_path}")
        self._proc.netns_fd = os.open(MACHINE.path("proc", str(self.pid), "ns", "net"),
                                      os.O_RDONLY | os.O_CLOEXEC)
        self._proc.netns = netns

    def _log_tail(self, lines: int = 5) -> str:
        try:
            text = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    # --- while running -----------------------------------------------------
    def virsh(self, *args: str, input: Optional[str] = None, check: bool = False,
              timeout: float = VIRSH_TIMEOUT_S) -> subprocess.CompletedProcess:
        """``virsh -c <uri> ARGS`` (text, stdout/stderr captured, ``LC_ALL=C``).

        ``check=True`` raises ``subprocess.CalledProcessError`` on a non-zero
        exit; ``subprocess.TimeoutExpired`` after ``timeout`` seconds.
        """
        env = dict(os.environ, LC_ALL="C")
        return subprocess.run([find_binary("virsh") or "virsh", "-c", self.uri, *args], input=input,
                              capture_output=True, text=True, check=check, timeout=timeout, env=env)

    def reload_hooks(self, timeout_s: float = 30) -> None:
        """Make the daemon rescan its hook directories (SIGHUP) and wait until it answers again.

        Returns once the daemon hook logged the reload (the rescan comes
        first) and ``virsh uri`` succeeds.  Raises HostEnvironmentError when
        the daemon is not running or does not reload within ``timeout_s``.
        """
        if not self.running or self.pid is None:
            raise HostEnvironmentError("the isolated libvirtd is not running", hint="call start() first")
        deadline = self._sighup(self.pid, timeout_s, alive=lambda: self.running)
        while self.virsh("uri", timeout=max(1.0, deadline - time.monotonic())).returncode != 0:
            if time.monotonic() > deadline:
                raise HostEnvironmentError("libvirtd does not answer after SIGHUP", hint=f"see {self.log_path}")
            time.sleep(0.05)

    def _sighup(self, pid: int, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> float:
        """SIGHUP to libvirtd ``pid``, then wait until its daemon hook logged the reload (the rescan of the
        hooks comes first); the deadline it waited against.  Raises HostEnvironmentError when that does not
        happen within ``timeout_s`` or ``alive()`` turns false."""
        before = self._reloads()
        _signal(pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while self._reloads() <= before:
            if time.monotonic() > deadline or not alive():
                raise HostEnvironmentError(f"libvirtd did not reload its hooks within {timeout_s:g} s: "
                                           f"{self._log_tail()}", hint=f"see {self.log_path}")
            time.sleep(0.01)
        return deadline

    def _reloads(self) -> int:
        try:
            return sum(1 for line in self.daemon_hook_log.read_text().splitlines() if line.startswith("reload "))
        except FileNotFoundError:
            return 0

    # --- stop --------------------------------------------------------------
    def stop(self) -> None:
        """Destroy running domains, SIGTERM the daemon, SIGKILL whatever is left in its namespace.

        Idempotent; never raises for a daemon that is already gone.  Also runs
        at interpreter exit or when the object is collected.
        """
        _stop(self._proc, STOP_GRACE_S)
        self.pid = None


def _stop(proc: _Proc, grace_s: float) -> None:
    popen = proc.popen
    if popen is None:
        return
    try:
        if popen.poll() is None:
            _destroy_domains(proc.uri)
            try:
                popen.send_signal(signal.SIGTERM)   # the init forwards it to libvirtd
                popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if popen.poll() is None:
            popen.kill()
            popen.wait(timeout=grace_s)
        if proc.netns is not None:
            _kill_netns(proc.netns)   # normally empty already: the init kills what libvirtd left
    finally:
        if proc.netns_fd is not None:
            os.close(proc.netns_fd)
            proc.netns_fd = None
        if proc.log is not None:
            proc.log.close()
            proc.log = None
        proc.popen = None


def _destroy_domains(uri: str) -> None:
    """Destroy every running domain (so qemu exits through libvirt, running the hooks)."""
    virsh = find_binary("virsh")
    if virsh is None:
        return
    env = dict(os.environ, LC_ALL="C")
    try:
        listing = subprocess.run([virsh, "-c", uri, "list", "--name"], capture_output=True, text=True,
                                 timeout=20, env=env)
        for name in listing.stdout.split():
            subprocess.run([virsh, "-c", uri, "destroy", name], capture_output=True, text=True,
                           timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _netns_of(pid: int) -> Optional[str]:
    """``net:[4026532...]`` of ``pid``, or None when it is gone."""
    try:
        return os.readlink(MACHINE.path("proc", str(pid), "ns", "net"))
    except OSError:
        return None


def _pids_in_netns(netns: str, exclude: Sequence[int]) -> List[int]:
    out = []
    for entry in os.scandir(MACHINE.path("proc")):
        if is_digits(entry.name):
            pid = int(entry.name)
            if pid not in exclude and _netns_of(pid) == netns:
                out.append(pid)
    return out


def _kill_netns(netns: str, timeout_s: float = 5.0) -> None:
    """SIGKILL every process in network namespace ``netns`` and wait until none is left.

    Does nothing for the caller's own namespace (that would be the whole machine).
    """
    if netns == _netns_of(os.getpid()):
        return
    deadline = time.monotonic() + timeout_s
    while True:
        pids = _pids_in_netns(netns, exclude=())
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


# --- inside the namespace -----------------------------------------------------

def _ns_init(spec: dict) -> int:
    """The namespace's first process: mounts, runs libvirtd, reaps orphans, cleans up.

    ``spec``: ``{"parent": pid, "mounts": [[source, target], ...], "argv": [...]}``.
    Returns libvirtd's exit status (125 when a mount failed).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != spec["parent"]:
        return 125     # the caller died before the death signal was armed
    for source, target in spec["mounts"]:
        if libc.mount(source.encode(), target.encode(), None, _MS_BIND, None) != 0:
            err = ctypes.get_errno()
            print(f"vgpuhost libvirtd init: bind mount {source} -> {target}: {os.strerror(err)}",
                  file=sys.stderr, flush=True)
            return 125
    me = os.getpid()
    netns = _netns_of(me)
    if netns is None or netns == _netns_of(spec["parent"]):
        print("vgpuhost libvirtd init: not in a private network namespace", file=sys.stderr, flush=True)
        return 125
    state = {"pid": None, "stopping": False}

    def forward(signum, _frame):
        if signum == signal.SIGHUP:
            if state["pid"]:
                _signal(state["pid"], signal.SIGHUP)
            return
        if not state["stopping"]:
            state["stopping"] = True
            if state["pid"]:
                _signal(state["pid"], signal.SIGTERM)
            signal.alarm(int(STOP_GRACE_S))

    def overdue(_signum, _frame):
        if state["pid"]:
            _signal(state["pid"], signal.SIGKILL)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    signal.signal(signal.SIGALRM, overdue)
    if state["stopping"]:
        return 0      # told to stop before libvirtd was started
    daemon = subprocess.Popen(spec["argv"], stdin=subprocess.DEVNULL)
    state["pid"] = daemon.pid
    if state["stopping"]:
        _signal(daemon.pid, signal.SIGTERM)

    status = None
    while True:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            break
        if pid == daemon.pid:
            daemon.returncode = status = os.waitstatus_to_exitcode(raw)
            # libvirtd is gone: nothing may outlive it in this namespace.
            for other in _pids_in_netns(netns, exclude=(me,)):
                _signal(other, signal.SIGKILL)
    signal.alarm(0)
    if status is None:
        return 0
    return status if status >= 0 else 128 - status


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# --- kept running for trying VMs by hand (`vgpuhost sim libvirtd start|stop|status`) -------------------

#: the keeper's record in its workdir: ``{"keeper": pid, "libvirtd": pid, "uri": ..., "hooks_dir": ...}``
KEEPER_FILE = "keeper.json"
#: the keeper's own output (what went wrong when it could not start the daemon)
KEEPER_LOG = "keeper.log"


def kept(workdir: Path) -> Optional[Dict[str, object]]:
    """The record of the libvirtd kept running in ``workdir``, or None when none runs there.

    A record whose keeper is gone (killed with -9) is stale and counts as none."""
    try:
        doc = json.loads((Path(workdir) / KEEPER_FILE).read_text())
        pid = int(doc["keeper"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return doc if _keeper_runs(pid, Path(workdir).resolve()) else None


def _keeper_runs(pid: int, workdir: Path) -> bool:
    """Whether process ``pid`` is the keeper of ``workdir`` and runs: not a zombie (a killed keeper whose
    parent, the machine's init, has not reaped it yet still answers ``kill(pid, 0)``), and its command line
    is ``python -m vgpuhost.sim.libvirtd --keep WORKDIR`` (a record left by a keeper killed with -9 may name
    a process ID the machine has given to another process since)."""
    proc = MACHINE.path("proc", str(pid))
    try:
        stat = Path(proc, "stat").read_text()
        argv = Path(proc, "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return False
    if stat.rpartition(")")[2].split()[:1] in (["Z"], ["X"]):
        return False
    return argv[-3:] == [MODULE.encode(), b"--keep", os.fsencode(str(workdir))]


def keep_reload(workdir: Path, timeout_s: float = 30) -> None:
    """Make the libvirtd kept in ``workdir`` rescan its hooks (SIGHUP to it), and return once it has
    (its daemon hook logged the reload).  Raises HostEnvironmentError when none runs there or it does not
    reload within ``timeout_s``."""
    workdir = Path(workdir).resolve()
    doc = kept(workdir)
    if doc is None:
        raise HostEnvironmentError(f"no libvirtd runs in {workdir}", hint=f"vgpuhost sim libvirtd start {workdir}")
    IsolatedLibvirtd(workdir)._sighup(int(doc["libvirtd"]), timeout_s)


def keep_start(workdir: Path, timeout_s: float = 60) -> Dict[str, object]:
    """Start a libvirtd in ``workdir`` that outlives this process, kept by a detached keeper
    (``python -m vgpuhost.sim.libvirtd --keep WORKDIR``); its record once it answers (:func:`kept`).

    Idempotent: a daemon already kept there is returned as it is.  Raises HostEnvironmentError
    (with the end of the keeper's log) when it cannot run here or does not answer in ``timeout_s``."""
    workdir = Path(workdir).resolve()
    doc = kept(workdir)
    if doc is not None:
        return doc
    ok, reason = available()
    if not ok:
        raise HostEnvironmentError(f"cannot run an isolated libvirtd: {reason}",
                                   hint="run as root on Debian 12 with 'make dev' done")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / KEEPER_FILE).unlink(missing_ok=True)
    with open(workdir / KEEPER_LOG, "ab") as log:
        keeper = subprocess.Popen([sys.executable, "-m", MODULE, "--keep", str(workdir)], stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        doc = kept(workdir)
        if doc is not None:
            return doc
        if keeper.poll() is not None or time.monotonic() > deadline:
            if keeper.poll() is None:
                keeper.terminate()
            tail = [line for line in (workdir / KEEPER_LOG).read_text(errors="replace").splitlines() if line.strip()]
            raise HostEnvironmentError(f"the isolated libvirtd in {workdir} did not start: "
                                       + (tail[-1][:300] if tail else "no output"),
                                       hint=f"see {workdir / KEEPER_LOG}")
        time.sleep(0.05)


def keep_stop(workdir: Path, timeout_s: float = 60) -> bool:
    """Stop the libvirtd kept in ``workdir`` (its running domains destroyed first, so their hooks
    run); False when none ran there.  Raises HostEnvironmentError when the keeper outlives ``timeout_s``."""
    workdir = Path(workdir).resolve()
    doc = kept(workdir)
    if doc is None:
        (workdir / KEEPER_FILE).unlink(missing_ok=True)
        return False
    pid = int(doc["keeper"])
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while kept(workdir) is not None:
        if time.monotonic() > deadline:
            raise HostEnvironmentError(f"the keeper of the isolated libvirtd (pid {pid}) did not stop in "
                                       f"{timeout_s:g} s", hint=f"see {workdir / KEEPER_LOG}; kill {pid}")
        time.sleep(0.05)
    return True


def _keep(workdir: Path) -> int:
    """The keeper: starts the daemon, records it, and stops it on SIGTERM/SIGINT/SIGHUP."""
    stopping = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *_: stopping.set())
    daemon = IsolatedLibvirtd(workdir)
    try:
        daemon.start()
    except HostEnvironmentError as e:
        print(f"vgpuhost sim libvirtd: {e.one_line()}", flush=True)
        return 1
    record = workdir / KEEPER_FILE
    files.write_atomic(record, json.dumps({"keeper": os.getpid(), "libvirtd": daemon.pid, "uri": daemon.uri,
                                          "hooks_dir": str(daemon.hooks_dir), "log": str(daemon.log_path)}))
    try:
        while not stopping.wait(0.5) and daemon.running:
            pass
    finally:
        daemon.stop()
        record.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--ns-init":
        sys.exit(_ns_init(json.loads(sys.argv[2])))
    if len(sys.argv) == 3 and sys.argv[1] == "--keep":
        sys.exit(_keep(Path(sys.argv[2])))
    print("usage: python -m vgpuhost.sim.libvirtd --ns-init SPEC | --keep WORKDIR (internal: run by "
          "IsolatedLibvirtd and 'vgpuhost sim libvirtd start')", file=sys.stderr)
    sys.exit(2)
