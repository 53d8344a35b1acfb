"""Running real vgpuhost agents for the tests: a process per agent, real unix sockets.

The socket directory is a short, world-traversable directory under /tmp
(``sockaddr_un`` holds 108 bytes, and the permission tests connect as
throwaway uids that cannot pass pytest's 0700 temporary directories).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from vgpuhost.io import agentclient

REPO = Path(__file__).resolve().parents[1]
#: throwaway ids: nobody has them (they need no entry in /etc/passwd or /etc/group)
RO_GID, ADMIN_GID, OTHER_GID = 54011, 54012, 54013
RO_UID, ADMIN_UID, OTHER_UID = 54001, 54002, 54003


def socket_dir() -> str:
    d = tempfile.mkdtemp(prefix="vgh-", dir="/tmp")
    os.chmod(d, 0o755)
    return d


class AgentRun:
    """``vgpuhost --root ROOT agent`` in its own process, until :meth:`stop` (SIGTERM) or :meth:`kill`."""

    def __init__(self, root, sockdir: Optional[str] = None, *, env: Optional[Dict[str, str]] = None,
                 admin_group: "int | str" = ADMIN_GID, ro_group: "int | str" = RO_GID, passed: Sequence = (),
                 extra: Sequence[str] = ("--metering-interval", "0"), prefix: Sequence[str] = ()):
        self.root = str(root)
        self.own_dir = sockdir is None
        self.dir = sockdir or socket_dir()
        os.makedirs(self.dir, exist_ok=True)
        self.admin = os.path.join(self.dir, "agent.sock")
        self.ro = os.path.join(self.dir, "agent-ro.sock")
        self.tenant = os.path.join(self.dir, "agent-tenant.sock")
        self.log = Path(self.dir) / "agent.log"
        # ``prefix``: a command line the agent runs under (tests/test_agent_tenants.py: a private mount
        # namespace with its own /etc/passwd and /etc/group)
        cmd = [*prefix, sys.executable, "-m", "vgpuhost", "--root", self.root, "agent", "--socket-dir", self.dir,
               "--admin-group", str(admin_group), "--ro-group", str(ro_group), *extra]
        full_env = {**os.environ, **(env or {})}
        full_env.pop(agentclient.ENV_SOCKET, None)
        kw: Dict[str, Any] = {}
        if passed:                       # socket activation: the sockets become fds 3.. (sd_listen_fds)
            fds = [s.fileno() for s in passed]

            def pre():
                dups = [os.dup(fd) for fd in fds]
                for i, fd in enumerate(dups):
                    os.dup2(fd, 3 + i)
            kw = {"preexec_fn": pre, "pass_fds": sorted(set(fds) | set(range(3, 3 + len(fds))))}
            full_env.update(LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=":".join(n for n in ("admin", "ro")[:len(fds)]))
            cmd = ["/bin/sh", "-c", 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"', "sh"] + cmd
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(cmd, env=full_env, stdout=logf, stderr=subprocess.STDOUT, cwd=str(REPO),
                                         **kw)
        if passed:
            from vgpuhost.io import unixsock
            self.admin = unixsock.socket_path(passed[0])
            self.ro = unixsock.socket_path(passed[1]) if len(passed) > 1 else self.ro
        self.wait_ready(self.admin)

    def wait_ready(self, path: Optional[str] = None, timeout_s: float = 60) -> None:
        path = path or self.admin
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the agent exited {self.proc.returncode}: {self.log.read_text()}")
            try:
                status, _ = agentclient.call(path, "GET", "/v1/agent", timeout_s=5)
                if status == 200:
                    return
            except (agentclient.AgentDown, OSError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"the agent did not answer on {path}: {self.log.read_text()}")

    def call(self, method: str, target: str, body=None, *, ro: bool = False) -> Tuple[int, Any]:
        return agentclient.call(self.ro if ro else self.admin, method, target, body)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "AgentRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


CLIENT = r"""
import json, os, sys
from vgpuhost.io import agentclient, unixsock  # imported as root: the ids drop below
uid, gid, groups, calls, hints, docs = json.loads(sys.argv[1])
os.setgroups(groups)
os.setgid(gid)
os.setuid(uid)
out = []
for path, method, target, body in calls:
    try:
        status, doc = agentclient.call(path, method, target, body, timeout_s=60)
        error = doc.get("error") if isinstance(doc, dict) else None
        if docs:
            out.append([status, doc])
            continue
        out.append([status, error.get("hint")] if hints and isinstance(error, dict) else status)
    except PermissionError:
        out.append("EACCES")
    except agentclient.AgentDown as e:
        out.append("down")
print(json.dumps(out))
"""


def as_user(uid: int, gid: int, groups: List[int], calls: List[tuple], *, hints: bool = False,
            docs: bool = False, prefix: Sequence[str] = ()) -> List[Any]:
    """Run ``calls`` (``(socket, method, target, body)``) from a process with these ids; each
    answer's HTTP status (with ``hints``: ``[status, error hint]`` for an error; with ``docs``:
    ``[status, document]``), or ``EACCES`` when the socket file refused the connection.  The client
    imports vgpuhost as root and drops its ids before the first connection; ``prefix``: a command
    line it runs under (a private mount namespace)."""
    import json
    proc = subprocess.run([*prefix, sys.executable, "-c", CLIENT, json.dumps([uid, gid, groups, calls, hints, docs])],
                          capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
