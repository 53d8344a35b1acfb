"""The agent's resident writer (issue 31, round 4): bounded writes handed to a process started once.

A long-lived process (the agent: ``vgpuhost.__main__.serve_agent`` calls
``keep_writer``) makes each bounded write (an mdev ``remove``) in a resident
writer, not a fork of itself per write.  These tests hand the writes of a
simulated host to a pool of their own (``Writers``, put in place for the test
only) and read every outcome back from the simulated tree, the audit observers,
the simulator's time file and write log, and ``/proc``: many removes by one
writer; a blocked remove abandons its writer and the next write gets another;
a killed writer is replaced; no writer holds an fd of the caller; and, with a
real agent process, SIGTERM ends the agent while a writer is blocked, the idle
writer ends with it, and the blocked one once its write returns.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

import pytest

from agentutil import AgentRun
from test_hook import vgpu_domain
from vgpuhost.io import agentclient, sysfs
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.io.residentwriter import Writers
from vgpuhost.io.sysfs import Sysfs, WriteOutcomeUnknown
from vgpuhost.io.vfioholders import REMOVE_TIMEOUT_ENV
from vgpuhost.model.errors import SysfsError
from vgpuhost.sim.kernel import TIME_FILE_ENV, WRITE_LOG_ENV, SimKernel

A40 = "0000:81:00.0"                    # a40-mdev
A40_8Q = "nvidia-566"
#: how long a test waits for something that happens at once in the normal case (a deadline, not a tolerance)
DEADLINE_S = 20.0
#: the bound of a write that blocks until the test closes the device (it never returns within it)
BLOCKED_S = 0.3


def until(what, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def _mdev(i: int) -> str:
    return f"aaaaaaaa-2222-4333-8444-{i:012x}"


def _create(host: HostRoot, uuid: str) -> None:
    """An mdev made by this process's simulated kernel (not the writer's)."""
    Sysfs(host).write(host.mdev_bus / A40 / "mdev_supported_types" / A40_8Q / "create", uuid)


def _remove_path(host: HostRoot, uuid: str) -> str:
    return str(host.mdev_devices / uuid / "remove")


def _state(pid: int) -> str:
    """The process's state letter from /proc (``Z`` a zombie), ``-`` once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "-"


def _children(pid: int) -> list:
    """The pids whose parent is ``pid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(name))
    return sorted(out)


@pytest.fixture
def writers():
    """This test's pool of resident writers, making every bounded write of this process meanwhile."""
    pool = Writers()
    sysfs.set_bounded_writer(pool.write)
    try:
        yield pool
    finally:
        sysfs.set_bounded_writer(None)
        pool.close()


def test_one_writer_makes_many_removes_and_the_simulator_reads_its_state_anew_each_time(make_host, writers,
                                                                                       tmp_path, monkeypatch):
    host = make_host("a40-mdev")
    heard = []
    fs = Sysfs(host, intents=[lambda p, v: heard.append(("intent", p, v))],
               observers=[lambda p, v, e: heard.append(("result", p, v, e))])
    _create(host, _mdev(0))
    assert fs.write_bounded(_remove_path(host, _mdev(0)), "1", timeout_s=DEADLINE_S) is True
    assert not os.path.lexists(host.mdev_devices / _mdev(0))
    pid = writers.idle_pids()[0]
    # the simulator's environment set after the writer started: the writer follows this process's
    times, log = tmp_path / "simtime", tmp_path / "writes"
    monkeypatch.setenv(TIME_FILE_ENV, str(times))
    monkeypatch.setenv(WRITE_LOG_ENV, str(log))
    for i in range(1, 9):
        _create(host, _mdev(i))          # made here, after the writer last read the state: never stale there
        assert fs.write_bounded(_remove_path(host, _mdev(i)), "1", timeout_s=DEADLINE_S) is True
        assert not os.path.lexists(host.mdev_devices / _mdev(i))
    assert writers.started == 1 and writers.idle_pids() == [pid] and _state(pid) in "RS"
    assert os.listdir(host.mdev_devices) == []
    assert Sysfs(host).listdir(host.mdev_bus / A40 / "mdev_supported_types" / A40_8Q / "devices") == []
    # intent before, result after, for each remove
    removes = [h for h in heard if h[1].endswith("/remove")]
    assert removes == [x for i in range(9) for x in (("intent", _remove_path(host, _mdev(i)), "1"),
                                                      ("result", _remove_path(host, _mdev(i)), "1", 0))]
    # the writer's simulator time is charged to the writer's pid, and its writes logged where this process logs
    charged = [line.split() for line in times.read_text().splitlines()]
    assert sum(1 for c in charged if int(c[2]) == pid) == 8
    logged = [line.split("\t") for line in log.read_text().splitlines()]
    assert [x for x in logged if x[0].endswith("/remove")] == [
        [host.relative(host.mdev_devices / _mdev(i) / "remove"), "1"] for i in range(1, 9)]
    # a refusal keeps its errno: the device is gone
    with pytest.raises(SysfsError) as e:
        fs.write_bounded(_remove_path(host, _mdev(8)), "1", timeout_s=DEADLINE_S)
    assert e.value.errno == errno.ENOENT and heard[-1] == ("result", _remove_path(host, _mdev(8)), "1", errno.ENOENT)
    assert writers.idle_pids() == [pid]


def test_the_writer_holds_no_fd_of_the_caller_and_has_its_own_session(make_host, writers):
    host = make_host("a40-mdev")
    lock = open(host.root / "held-lock", "w")          # an fd of this process the writer must not hold
    try:
        _create(host, _mdev(1))
        assert Sysfs(host).write_bounded(_remove_path(host, _mdev(1)), "1", timeout_s=DEADLINE_S) is True
        pid = writers.idle_pids()[0]
        fds = {int(n): os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")}
    finally:
        lock.close()
    assert sorted(fds) == [0, 1, 2], fds
    assert fds[0].startswith("pipe:") and fds[1].startswith("pipe:") and fds[2] == os.devnull
    assert os.getsid(pid) == pid != os.getsid(0)


def test_a_blocked_remove_abandons_its_writer_and_the_next_write_gets_a_new_one(make_host, writers):
    host = make_host("a40-mdev")
    heard = []
    fs = Sysfs(host, observers=[lambda p, v, e: heard.append((p, e))])
    _create(host, _mdev(1))
    _create(host, _mdev(2))
    assert fs.write_bounded(_remove_path(host, _mdev(2)), "1", timeout_s=DEADLINE_S) is True
    first = writers.idle_pids()[0]
    kernel = SimKernel(host)
    holder = kernel.open_vgpu(_mdev(1), via="device")
    assert fs.write_bounded(_remove_path(host, _mdev(1)), "1", timeout_s=BLOCKED_S) is False
    assert heard[-1] == (_remove_path(host, _mdev(1)), errno.ETIMEDOUT)
    until(lambda: kernel.meta()["opened"][str(holder)]["requests"] >= 1)     # the writer waits in the kernel
    spare = writers.idle_pids()             # abandoned, still writing; its successor started at once
    assert len(spare) == 1 and first not in spare and _state(first) in "RS"
    assert (host.mdev_devices / _mdev(1)).is_dir()
    # the next write gets the new writer, and succeeds
    _create(host, _mdev(3))
    assert fs.write_bounded(_remove_path(host, _mdev(3)), "1", timeout_s=DEADLINE_S) is True
    assert not os.path.lexists(host.mdev_devices / _mdev(3))
    second = writers.idle_pids()[0]
    assert second == spare[0] != first and writers.started == 2
    # the device closed: the abandoned write completes, and its writer ends and is reaped (no zombie)
    kernel.close_vgpu(holder)
    until(lambda: not os.path.lexists(host.mdev_devices / _mdev(1)))
    until(lambda: _state(first) == "-")
    assert writers.idle_pids() == [second] and _state(second) in "RS"


def test_a_killed_writer_is_replaced(make_host, writers):
    host = make_host("a40-mdev")
    fs = Sysfs(host)
    _create(host, _mdev(1))
    assert fs.write_bounded(_remove_path(host, _mdev(1)), "1", timeout_s=DEADLINE_S) is True
    first = writers.idle_pids()[0]
    os.kill(first, signal.SIGKILL)                      # killed while idle
    until(lambda: _state(first) == "-")                 # reaped at once, before any other write
    _create(host, _mdev(2))
    assert fs.write_bounded(_remove_path(host, _mdev(2)), "1", timeout_s=DEADLINE_S) is True
    assert not os.path.lexists(host.mdev_devices / _mdev(2))
    second = writers.idle_pids()[0]
    assert second != first and writers.started == 2
    # killed during its write (a remove waiting in the kernel): that write's outcome is unknown (never a definite
    # EIO: its write(2) may have been made), the observers hear EINTR; the next write gets a new writer
    heard = []
    fs = Sysfs(host, observers=[lambda p, v, e: heard.append((p, e))])
    kernel = SimKernel(host)
    _create(host, _mdev(3))
    holder = kernel.open_vgpu(_mdev(3), via="device")
    got = []

    def blocked() -> None:
        try:
            got.append(fs.write_bounded(_remove_path(host, _mdev(3)), "1", timeout_s=DEADLINE_S * 3))
        except (SysfsError, WriteOutcomeUnknown) as e:
            got.append(e)
    t = threading.Thread(target=blocked, daemon=True)
    t.start()
    until(lambda: kernel.meta()["opened"][str(holder)]["requests"] >= 1)
    os.kill(second, signal.SIGKILL)
    t.join(DEADLINE_S)
    assert len(got) == 1 and type(got[0]) is WriteOutcomeUnknown, got
    assert "ended without answering" in got[0].message and got[0].exit_code == 3
    assert heard == [(_remove_path(host, _mdev(3)), errno.EINTR)]
    kernel.close_vgpu(holder)                           # the killed writer's remove still ends at the close
    assert not os.path.lexists(host.mdev_devices / _mdev(3))
    _create(host, _mdev(4))
    assert fs.write_bounded(_remove_path(host, _mdev(4)), "1", timeout_s=DEADLINE_S) is True
    assert writers.started == 3 and not os.path.lexists(host.mdev_devices / _mdev(4))
    until(lambda: _state(second) == "-")


def _cli(capsys, host: HostRoot, *argv):
    from vgpuhost.cli.main import main
    code = main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _remove_in_thread(host: HostRoot, store, vid: str) -> list:
    """``ops.vgpu.remove`` of ``vid`` in a thread; the list gets its outcome or its exception."""
    from vgpuhost.ops import vgpu as vgpu_ops
    got: list = []

    def run() -> None:
        try:
            got.append(vgpu_ops.remove(host, store, vid, while_running=True))
        except BaseException as e:      # noqa: BLE001 - the test reads it
            got.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    got.append(t)
    return got


def test_a_writer_killed_while_its_remove_waits_leaves_the_removal_pending_never_re_created(make_host, writers,
                                                                                           capsys):
    """Trial 7 F1: the writer killed (kill -9, OOM) during a remove the kernel blocks (a holder vgpuhost cannot
    see): its write may have been taken, so the outcome is unknown.  The remove is reported as one that did
    not finish (exit 3), the journal entry stays open, the record is kept; ``reconcile`` never re-creates the
    vGPU, and finishes the removal once the device is closed.  Before: a definite EIO, the entry closed as
    failed, and ``reconcile`` re-created a vGPU nobody would use."""
    from vgpuhost.io.state import StateStore
    from vgpuhost.io.vfioholders import RemoveUnanswered
    from vgpuhost.ops.vgpu import create
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")
    writers.start_spare()
    pid = writers.idle_pids()[0]
    kernel = SimKernel(host)
    holder = kernel.open_vgpu(out.id, via="device")         # no group fd: invisible to the holder check
    got = _remove_in_thread(host, store, out.id)
    until(lambda: kernel.meta()["opened"][str(holder)]["requests"] >= 1)     # the writer waits in the kernel
    os.kill(pid, signal.SIGKILL)
    got[0].join(DEADLINE_S)
    err = got[1]
    assert isinstance(err, RemoveUnanswered) and err.exit_code == 3, err
    assert "ended without answering" in err.message and "stays pending" in err.hint, err.one_line()
    assert "held by" not in err.message                     # no holder is blamed
    assert [(e.kind, e.devices[0]["id"]) for e in store.journal_entries(open_only=True)] == [("vgpu-remove", out.id)]
    assert [r.id for r in store.vgpu_records()] == [out.id] and (host.mdev_devices / out.id).is_dir()
    assert [r.result for r in store.audit_rows() if r.path.endswith("/remove")] == ["EINTR"]
    code, text, _ = _cli(capsys, host, "reconcile", "--check")
    assert code == 1 and f"vgpu remove {out.id}" in text, text
    kernel.close_vgpu(holder)           # the holder closes: the kernel finishes the killed writer's remove
    assert not os.path.lexists(host.mdev_devices / out.id)
    code, text, _ = _cli(capsys, host, "reconcile", "--check")
    assert code == 1 and "its removal is pending (an open journal entry); not re-created" in text, text
    code, text, _ = _cli(capsys, host, "reconcile")
    assert code == 0 and "finished" in text and "re-created" not in text, text
    assert not os.path.lexists(host.mdev_devices / out.id)
    assert store.vgpu_records() == [] and store.journal_entries(open_only=True) == []
    assert _cli(capsys, host, "reconcile", "--check")[0] == 0


def test_a_writer_killed_after_its_write_landed_reports_the_remove_done(make_host, writers, capsys, tmp_path,
                                                                         monkeypatch):
    """Trial 7 F1 addendum: a vendor-VFIO clear made, then the writer killed before it answered.  The vGPU is
    read back gone, so the remove is done: record dropped, journal closed, ``reconcile --check`` in sync.
    Before: EIO, the record left 'missing', and ``reconcile`` re-created the vGPU.  (The writer is held after
    its write by the simulator's write log, a FIFO nobody reads.)"""
    from vgpuhost.io.state import StateStore
    from vgpuhost.ops.vgpu import create
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="L40S-8Q")
    type_file = host.pci_device(out.id) / "nvidia" / "current_vgpu_type"
    writers.start_spare()
    pid = writers.idle_pids()[0]
    fifo = tmp_path / "write-log"
    os.mkfifo(fifo)
    monkeypatch.setenv(WRITE_LOG_ENV, str(fifo))        # the writer blocks opening it, once its write landed
    got = _remove_in_thread(host, store, out.id)
    until(lambda: Sysfs(host).read(type_file) == "0")
    assert _state(pid) in "RS" and got[0].is_alive()    # the write landed; no answer yet
    os.kill(pid, signal.SIGKILL)
    got[0].join(DEADLINE_S)
    monkeypatch.delenv(WRITE_LOG_ENV)
    assert got[1].changed and got[1].id == out.id, got[1]
    assert store.vgpu_records() == [] and store.journal_entries(open_only=True) == []
    assert [r.result for r in store.audit_rows() if r.path.endswith("/current_vgpu_type")][-1:] == ["EINTR"], store.audit_rows()
    assert _cli(capsys, host, "reconcile", "--check")[0] == 0
    assert Sysfs(host).read(type_file) == "0"


def test_a_writer_that_cannot_start_leaves_the_write_to_a_forked_child(make_host, writers, monkeypatch):
    """A writer whose start fails (here: it exits before it is ready, as one whose imports fail would) takes
    nothing; the write is made by a child forked for it, as without a resident writer, and heard once."""
    from vgpuhost.io import residentwriter
    monkeypatch.setattr(residentwriter, "_BOOT", "import sys; sys.exit(1)")
    host = make_host("a40-mdev")
    heard = []
    fs = Sysfs(host, intents=[lambda p, v: heard.append(("intent", p, v))],
               observers=[lambda p, v, e: heard.append(("result", p, v, e))])
    _create(host, _mdev(1))
    heard.clear()
    assert fs.write_bounded(_remove_path(host, _mdev(1)), "1", timeout_s=DEADLINE_S) is True
    assert not os.path.lexists(host.mdev_devices / _mdev(1))
    assert heard == [("intent", _remove_path(host, _mdev(1)), "1"), ("result", _remove_path(host, _mdev(1)), "1", 0)]
    assert writers.start_failures == 1 and not writers.broken   # one failed start: not off


def test_a_real_root_write_goes_through_the_writer_once(tmp_path, writers):
    (tmp_path / "sys").mkdir()
    (tmp_path / "proc").mkdir()
    attr = tmp_path / "sys" / "attr"
    attr.write_text("")
    fs = Sysfs(HostRoot(tmp_path))
    assert not fs.simulated
    for value in ("1", "22", "333"):
        assert fs.write_bounded(attr, value, timeout_s=DEADLINE_S) is True
        assert attr.read_text() == value
    with pytest.raises(SysfsError) as e:
        fs.write_bounded(tmp_path / "sys", "1", timeout_s=DEADLINE_S)      # a directory: EISDIR
    assert e.value.errno == errno.EISDIR and writers.started == 1


def test_sigterm_ends_the_agent_with_a_writer_blocked_and_no_writer_outlives_its_write(make_host):
    """A real agent: a release whose remove blocks (a holder vgpuhost cannot see) leaves its writer blocked
    in the kernel; a later release gets a new writer.  SIGTERM ends the agent; the idle writer ends with it
    (end of file on its request pipe), the blocked one once its write returns (the device closed)."""
    host = make_host("a40-mdev")
    run = AgentRun(host.root, env={REMOVE_TIMEOUT_ENV: "2"})
    try:
        # the writer the agent starts once it listens (it may answer a moment before the writer is spawned)
        until(lambda: len(_children(run.proc.pid)) == 1)
        blocked = _children(run.proc.pid)
        assert len(blocked) == 1
        xml = [vgpu_domain(f"vm{i}", f"11111111-2222-4333-8444-{i:012x}", _mdev(i)) for i in (1, 2)]
        for i in (0, 1):
            status, _ = agentclient.call(run.admin, "POST", "/v1/hook/prepare", {"xml": xml[i], "name": f"vm{i + 1}"})
            assert status == 200
        kernel = SimKernel(host)
        holder = kernel.open_vgpu(_mdev(1), via="device")
        status, doc = agentclient.call(run.admin, "POST", "/v1/hook/release", {"xml": xml[0], "name": "vm1"})
        assert status != 200 and f"remove of {_mdev(1)} did not finish" in str(doc), doc
        assert kernel.meta()["opened"][str(holder)]["requests"] >= 1 and _state(blocked[0]) in "RSD"
        status, _ = agentclient.call(run.admin, "POST", "/v1/hook/release", {"xml": xml[1], "name": "vm2"})
        assert status == 200 and not os.path.lexists(host.mdev_devices / _mdev(2))
        idle = [p for p in _children(run.proc.pid) if p not in blocked]
        assert len(idle) == 1                                   # its successor made vm2's remove
        assert run.stop() == 0, run.log.read_text()[-3000:]     # SIGTERM ended it, not a kill after 30 s
    finally:
        run.close()
    until(lambda: _state(idle[0]) in "Z-")                      # the idle writer read end of file
    assert _state(blocked[0]) in "RSD"                          # the blocked one still waits in the kernel
    assert (host.mdev_devices / _mdev(1)).is_dir()
    kernel.close_vgpu(holder)
    until(lambda: not os.path.lexists(host.mdev_devices / _mdev(1)))
    until(lambda: _state(blocked[0]) in "Z-")                   # and it ended once its write returned


def test_bench_bounded_write_smoke_run_reports_both_ways_in_both_cases(tmp_path):
    """bench/bounded_write.py runs (2 runs, 10 MB of ballast): nothing is asserted on time."""
    import subprocess
    import sys
    from pathlib import Path
    bench = Path(__file__).resolve().parents[1] / "bench" / "bounded_write.py"
    proc = subprocess.run([sys.executable, str(bench), "--runs", "2", "--ballast-mb", "10", "--tmpdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines if line.startswith("  ")] == ["fork", "resident", "fork", "resident"]
    assert sum("caller" in line and "writer" in line for line in lines) == 2
    assert list(tmp_path.iterdir()) == []           # the scratch host is removed
