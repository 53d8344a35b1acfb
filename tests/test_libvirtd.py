"""A real libvirtd 9.x in private namespaces: domains, qemu hooks, isolation, clean stop.

Uses the session fixture ``libvirtd`` (tests/libvirtd_fixture.py): one
:class:`vgpuhost.sim.libvirtd.IsolatedLibvirtd` for the whole run.  Domains
are tiny and diskless (:func:`diskless_domain_xml`); hooks are sh scripts
that write under pytest's temp dir, which the daemon's namespace shares.

Needs root, ``unshare`` and Debian's libvirt-daemon, libvirt-daemon-driver-qemu,
libvirt-clients and qemu-system-x86: skipped without them, except in CI
(``CI=true``) where a missing prerequisite fails the tests instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List

import libvirt
import pytest

from jsonschema_plugin import validate_document
from vgpuhost.sim.libvirtd import NS_DIRS, IsolatedLibvirtd, diskless_domain_xml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # libvirtd_fixture, whatever the import mode

# The fixtures; a no-op when tests/conftest.py already loads them.
pytest_plugins = ["libvirtd_fixture"]
pytestmark = pytest.mark.root

HOOK_LOG_LINES = ["prepare begin -", "start begin -", "started begin -", "stopped end -", "release end -"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _qemu_pid(daemon: IsolatedLibvirtd, name: str) -> int:
    """The qemu pid libvirt recorded in its private /run/libvirt/qemu/<name>.pid."""
    return int((daemon.run_dir / "qemu" / f"{name}.pid").read_text().strip())


@pytest.fixture
def hook(libvirtd) -> Iterator:
    """``hook(name, body)`` installs an sh hook in the daemon's qemu.d and rescans; removed afterwards."""
    installed: List[Path] = []

    def install(name: str, body: str) -> Path:
        path = libvirtd.hooks_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        installed.append(path)
        libvirtd.reload_hooks()
        return path

    yield install
    for path in installed:
        path.unlink()
    if installed:
        libvirtd.reload_hooks()


# --- domains ---------------------------------------------------------------------

def test_domain_lifecycle_through_libvirt_python(libvirtd):
    conn = libvirt.open(libvirtd.uri)
    try:
        dom = conn.defineXML(diskless_domain_xml("lv-py", memory_mib=64))
        assert dom.name() == "lv-py" and not dom.isActive()
        assert (libvirtd.etc_dir / "qemu" / "lv-py.xml").is_file()      # persistent config, privately
        dom.create()
        assert dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
        assert dom.maxMemory() == 64 * 1024                             # KiB
        qemu = _qemu_pid(libvirtd, "lv-py")
        assert _alive(qemu)
        dom.destroy()
        assert dom.state()[0] == libvirt.VIR_DOMAIN_SHUTOFF
        assert _wait_gone(qemu), f"qemu {qemu} still running after destroy"
        dom.undefine()
        with pytest.raises(libvirt.libvirtError) as err:
            conn.lookupByName("lv-py")
        assert err.value.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN
    finally:
        conn.close()


def test_domain_lifecycle_through_virsh(libvirtd, tmp_path):
    xml = tmp_path / "lv-virsh.xml"
    xml.write_text(diskless_domain_xml("lv-virsh", uuid="6f2d7a0e-1c55-4a8e-9d3b-2a1f0c9e8b7d"))
    libvirtd.virsh("define", str(xml), check=True)
    assert libvirtd.virsh("domuuid", "lv-virsh", check=True).stdout.strip() == \
        "6f2d7a0e-1c55-4a8e-9d3b-2a1f0c9e8b7d"
    libvirtd.virsh("start", "lv-virsh", check=True)
    assert libvirtd.virsh("domstate", "lv-virsh", check=True).stdout.strip() == "running"
    assert "lv-virsh" in libvirtd.virsh("list", "--name", check=True).stdout.split()
    libvirtd.virsh("destroy", "lv-virsh", check=True)
    assert libvirtd.virsh("domstate", "lv-virsh", check=True).stdout.strip() == "shut off"
    libvirtd.virsh("undefine", "lv-virsh", check=True)
    assert "lv-virsh" not in libvirtd.virsh("list", "--all", "--name", check=True).stdout.split()
    bad = libvirtd.virsh("start", "lv-virsh")
    assert bad.returncode != 0 and "lv-virsh" in bad.stderr


# --- hooks -------------------------------------------------------------------------

def test_qemu_d_hook_runs_in_order_with_the_domain_xml(libvirtd, hook, tmp_path):
    log = tmp_path / "hook.log"
    hook("50-record", f'echo "$1 $2 $3 $4" >> {log}\ncat > {tmp_path}/"$2-$3.xml"\n')
    libvirtd.virsh("define", "/dev/stdin", input=diskless_domain_xml("lv-hook"), check=True)
    try:
        libvirtd.virsh("start", "lv-hook", check=True)
        assert log.read_text().splitlines() == [f"lv-hook {op}" for op in HOOK_LOG_LINES[:3]]
        libvirtd.virsh("destroy", "lv-hook", check=True)
    finally:
        libvirtd.virsh("undefine", "lv-hook")
    assert log.read_text().splitlines() == [f"lv-hook {op}" for op in HOOK_LOG_LINES]
    prepared = (tmp_path / "prepare-begin.xml").read_text()
    assert "<name>lv-hook</name>" in prepared and "id=" in prepared   # the live XML on stdin


def test_failing_prepare_hook_aborts_the_start_and_reaches_virsh(libvirtd, hook, tmp_path):
    log = tmp_path / "hook.log"
    hook("50-refuse", f'cat > /dev/null\necho "$1 $2 $3" >> {log}\n'
                      'if [ "$2" = prepare ]; then echo "vgpuhost-test: no GPU for $1" >&2; exit 1; fi\n')
    libvirtd.virsh("define", "/dev/stdin", input=diskless_domain_xml("lv-refused"), check=True)
    try:
        proc = libvirtd.virsh("start", "lv-refused")
        assert proc.returncode != 0
        assert "vgpuhost-test: no GPU for lv-refused" in proc.stderr
        assert libvirtd.virsh("domstate", "lv-refused", check=True).stdout.strip() == "shut off"
    finally:
        libvirtd.virsh("undefine", "lv-refused")
    # docs/reference/libvirt.md: a start that fails in prepare still runs stopped and release.
    assert log.read_text().splitlines() == ["lv-refused prepare begin", "lv-refused stopped end",
                                            "lv-refused release end"]


# --- isolation -----------------------------------------------------------------------

def test_machine_libvirt_untouched(libvirtd, host_libvirt_before):
    # Work the daemon a little first, so there is something that could have leaked.
    libvirtd.virsh("define", "/dev/stdin", input=diskless_domain_xml("lv-iso"), check=True)
    libvirtd.virsh("start", "lv-iso", check=True)
    try:
        from libvirtd_fixture import host_libvirt_snapshot   # registered as a plugin by now
        assert host_libvirt_snapshot() == host_libvirt_before
        assert not NS_DIRS["run"].joinpath("libvirt-sock").exists()
        assert libvirtd.virsh("net-list", "--all", "--name", check=True).stdout.split() == []
        # The daemon's private files are where the workdir says, seen from outside.
        assert libvirtd.socket_path.is_socket()
        assert (libvirtd.workdir / "log" / "qemu" / "lv-iso.log").is_file()
        # The bind mounts exist only in the daemon's namespace.
        targets = {str(t) for t in NS_DIRS.values()}
        mine = {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}
        theirs = {line.split()[4] for line in
                  Path(f"/proc/{libvirtd.pid}/mountinfo").read_text().splitlines()}
        assert targets & mine == set()
        assert targets <= theirs
        assert os.readlink(f"/proc/{libvirtd.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    finally:
        libvirtd.virsh("destroy", "lv-iso")
        libvirtd.virsh("undefine", "lv-iso")


# --- stop ------------------------------------------------------------------------------

def _start_domain(daemon: IsolatedLibvirtd, name: str):
    """Define and start ``name``; ``(libvirtd pid, qemu pid)``."""
    daemon.virsh("define", "/dev/stdin", input=diskless_domain_xml(name), check=True)
    daemon.virsh("start", name, check=True)
    return daemon.pid, _qemu_pid(daemon, name)


def test_stop_leaves_no_process(libvirtd, tmp_path):
    with IsolatedLibvirtd(tmp_path / "d") as daemon:
        daemon_pid, qemu = _start_domain(daemon, "lv-stop")
        assert daemon_pid != libvirtd.pid and _alive(qemu)
    assert not _alive(daemon_pid) and not _alive(qemu)
    assert not daemon.running and daemon.pid is None
    daemon.stop()                                             # idempotent
    assert libvirtd.running and libvirtd.virsh("uri").returncode == 0   # the session daemon is untouched


def test_qemu_dies_with_a_killed_daemon(libvirtd, tmp_path):
    daemon = IsolatedLibvirtd(tmp_path / "d")
    try:
        daemon.start()
        daemon_pid, qemu = _start_domain(daemon, "lv-orphan")
        os.kill(daemon_pid, signal.SIGKILL)         # libvirtd crashes: its init kills what is left
        assert _wait_gone(qemu), f"qemu {qemu} outlived its libvirtd"
        deadline = time.monotonic() + 10
        while daemon.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not daemon.running
    finally:
        daemon.stop()


OWNER = """
import os, signal, sys
from pathlib import Path
from vgpuhost.sim.libvirtd import IsolatedLibvirtd, diskless_domain_xml
d = IsolatedLibvirtd(Path(sys.argv[1]))
d.start()
d.virsh("define", "/dev/stdin", input=diskless_domain_xml("lv-owner"), check=True)
d.virsh("start", "lv-owner", check=True)
print(d.pid, (d.run_dir / "qemu" / "lv-owner.pid").read_text().strip(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)        # no stop(), no atexit: the owner just vanishes
"""


def test_daemon_and_qemu_die_with_a_killed_owner(libvirtd, tmp_path):
    proc = subprocess.run([sys.executable, "-c", OWNER, str(tmp_path / "d")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    daemon_pid, qemu = (int(x) for x in proc.stdout.split())
    assert _wait_gone(qemu), f"qemu {qemu} outlived the process that owned its daemon"
    assert _wait_gone(daemon_pid), f"libvirtd {daemon_pid} outlived the process that owned it"


def _vgpuhost(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vgpuhost", *argv], capture_output=True, text=True, timeout=120)


def test_sim_libvirtd_is_kept_running_after_the_command_and_stopped_by_it(libvirtd, tmp_path, make_host):
    """`vgpuhost sim libvirtd start|status|stop`: a daemon for trying VMs by hand, with the hook for a
    simulated host, that outlives the command, dies with its keeper, and is stopped without a trace."""
    root = str(make_host("a40-mdev").root)
    work = str(tmp_path / "lv")
    started = _vgpuhost("--root", root, "--json", "sim", "libvirtd", "start", "--hook", work)
    assert started.returncode == 0, started.stderr
    doc = json.loads(started.stdout)
    validate_document(doc)
    assert doc["running"] and doc["uri"].endswith(f"socket={work}/run/libvirt-sock"), doc
    # the daemon outlived the command, answers, and runs vgpuhost's hook for the simulated root
    conn = libvirt.open(doc["uri"])
    try:
        assert conn.getURI().startswith("qemu:///system")
    finally:
        conn.close()
    hook = Path(doc["hooks_dir"]) / "vgpuhost"
    assert hook.is_file() and root in hook.read_text()
    again = _vgpuhost("--json", "sim", "libvirtd", "start", work)               # idempotent: the same daemon
    assert again.returncode == 0 and json.loads(again.stdout)["pid"] == doc["pid"], again.stderr
    status = _vgpuhost("--json", "sim", "libvirtd", "status", work)
    assert status.returncode == 0 and json.loads(status.stdout)["pid"] == doc["pid"]
    stopped = _vgpuhost("--json", "sim", "libvirtd", "stop", work)
    assert stopped.returncode == 0 and json.loads(stopped.stdout)["stopped"] is True, stopped.stderr
    validate_document(json.loads(stopped.stdout))
    assert _wait_gone(doc["pid"]) and not (tmp_path / "lv" / "keeper.json").exists()
    status = _vgpuhost("sim", "libvirtd", "status", work)
    assert status.returncode == 1 and "no libvirtd runs" in status.stdout
    assert _vgpuhost("sim", "libvirtd", "stop", work).returncode == 0          # nothing to stop: said, exit 0
    # the keeper killed with -9: its daemon goes with it, and the record left behind counts for nothing
    started = _vgpuhost("--json", "sim", "libvirtd", "start", work)
    assert started.returncode == 0, started.stderr
    kept = json.loads((tmp_path / "lv" / "keeper.json").read_text())
    os.kill(kept["keeper"], signal.SIGKILL)
    assert _wait_gone(kept["libvirtd"]), "libvirtd outlived its keeper"
    assert _vgpuhost("sim", "libvirtd", "status", work).returncode == 1
    # 'sim reboot' of the root stops the daemon kept with its hook, as the machine's shutdown would
    started = _vgpuhost("--root", root, "--json", "sim", "libvirtd", "start", "--hook", work)
    assert started.returncode == 0, started.stderr
    rebooted = _vgpuhost("--json", "sim", "reboot", root)
    assert rebooted.returncode == 0, rebooted.stderr
    assert json.loads(rebooted.stdout)["libvirtd_stopped"] == [str(Path(work).resolve())], rebooted.stdout
    assert _wait_gone(json.loads(started.stdout)["pid"]) and not (tmp_path / "lv" / "keeper.json").exists()


def test_sim_libvirtd_hook_needs_a_simulated_root(tmp_path):
    """--hook for a root that is not a simulated host is refused before anything starts."""
    done = _vgpuhost("--root", "/", "sim", "libvirtd", "start", "--hook", str(tmp_path / "lv"))
    assert done.returncode == 2 and "--hook needs --root to name a simulated host" in done.stderr, done.stderr
    assert not (tmp_path / "lv").exists()


def test_sim_libvirtd_restarts_with_its_hook_adds_one_to_a_running_daemon_and_trusts_no_stale_record(
        libvirtd, tmp_path, make_host):
    """Start --hook again after a stop (idempotent, the hook already there); --hook on a daemon started
    without it installs the hook and makes the daemon rescan its hooks; a record whose process ID another
    process now has is not trusted (status says none runs, stop signals nothing); bad work directories."""
    root = str(make_host("a40-mdev").root)
    work = tmp_path / "lv"
    assert _vgpuhost("sim", "libvirtd", "start", str(work)).returncode == 0            # no hook
    hook = work / "etc" / "hooks" / "qemu.d" / "vgpuhost"
    reloads = work / "daemon-hook.log"
    before = reloads.read_text().count("reload ")
    added = _vgpuhost("--root", root, "sim", "libvirtd", "start", "--hook", str(work))
    assert added.returncode == 0 and hook.is_file() and root in hook.read_text(), added.stderr
    assert reloads.read_text().count("reload ") == before + 1                      # libvirtd rescanned its hooks
    # the same directory by another spelling (a symlink, a '..'): the same daemon, not a second start
    (tmp_path / "alias").symlink_to(work)
    for other in (tmp_path / "alias", tmp_path / "alias" / ".." / "lv"):
        same = _vgpuhost("--json", "sim", "libvirtd", "start", str(other))
        assert same.returncode == 0 and json.loads(same.stdout)["running"], same.stderr
    assert _vgpuhost("sim", "libvirtd", "status", str(work)).returncode == 0       # its record is intact
    assert _vgpuhost("sim", "libvirtd", "stop", str(work)).returncode == 0
    again = _vgpuhost("--root", root, "sim", "libvirtd", "start", "--hook", str(work))
    assert again.returncode == 0 and hook.is_file(), again.stderr
    assert _vgpuhost("sim", "libvirtd", "stop", str(work)).returncode == 0
    # a stale record naming a process that is not its keeper: not trusted, and nothing is signalled
    other = subprocess.Popen(["sleep", "300"])
    try:
        (work / "keeper.json").write_text(json.dumps({"keeper": other.pid, "libvirtd": 999999, "uri": "x",
                                                      "hooks_dir": "x", "log": "x"}))
        status = _vgpuhost("sim", "libvirtd", "status", str(work))
        assert status.returncode == 1 and "no libvirtd runs" in status.stdout
        assert _vgpuhost("sim", "libvirtd", "stop", str(work)).returncode == 0
        assert other.poll() is None, "stop signalled a process that is not its keeper"
    finally:
        other.kill()
        other.wait()
    # an empty work directory, and one inside the simulated host, are refused before anything starts
    empty = _vgpuhost("sim", "libvirtd", "start", "")
    assert empty.returncode == 2 and "the work directory is empty" in empty.stderr
    inside = _vgpuhost("--root", root, "sim", "libvirtd", "start", "--hook", root + "/lv")
    assert inside.returncode == 2 and "is inside the simulated host" in inside.stderr
    assert not Path(root, "lv").exists()
