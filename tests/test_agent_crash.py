"""kill -9 of the agent in the middle of an allocate, and the recovery at its next start.

The agent is stopped at the worst point: its kernel write made the mdev,
its record is not written yet.  The test holds the simulated kernel's lock
(the agent's create write waits on it, seen in /proc/locks), then the state
store's write lock, then lets the write through; once the mdev exists the
agent is killed with SIGKILL.  At the next start the agent recovers (the
intent journal of issue 12, through reconcile): afterwards the host and the
records agree again and nothing is left that nobody owns.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time

import pytest

from agentutil import AgentRun, socket_dir
from test_agent import DOM, a40, mdevs, records  # noqa: F401 (a40: the fixture)
from vgpuhost.io import agentclient
from vgpuhost.io.state import StateStore
from vgpuhost.io.state import DB_NAME
from vgpuhost.sim.kernel import SimKernel

journal = pytest.importorskip("vgpuhost.plan.journal", reason="the intent journal (issue 12) is not in this tree")


def _blocked_on_flock(pid: int) -> bool:
    with open("/proc/locks") as f:
        return any("->" in line and f" {pid} " in line for line in f)


def _wait(cond, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_kill_9_between_the_kernel_write_and_the_record_is_recovered_at_the_next_start(a40):
    d = socket_dir()
    run = AgentRun(a40.root, d)
    answers = []
    db = None
    try:
        with SimKernel(a40).locked():
            t = threading.Thread(target=lambda: answers.append(_call(run.admin)), daemon=True)
            t.start()
            _wait(lambda: _blocked_on_flock(run.proc.pid), "the agent's create write to wait on the kernel lock")
            # the create's journal entry is open: its kernel write is what waits (the agent's health watch
            # may be what waited on the kernel lock first; the create opens its entry just before its write)
            _wait(lambda: StateStore(a40.state_dir).journal_entries(open_only=True), "the create's journal entry")
            db = sqlite3.connect(str(a40.state_dir / DB_NAME), timeout=60, isolation_level=None)
            db.execute("BEGIN IMMEDIATE")            # the agent's next store write (audit row, record) waits
        _wait(lambda: os.listdir(a40.mdev_devices), "the mdev to appear")
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(30)
        db.execute("ROLLBACK")
        db.close()
        db = None
        t.join(60)
        assert answers and answers[0] == "down"      # the client saw the agent go away
        made = list(mdevs(a40))
        assert len(made) == 1 and records(a40) == {}  # the half-done state the kill left
        run = AgentRun(a40.root, d)                  # the next start recovers
        status, rep = run.call("POST", "/v1/reconcile", {"check": True})
        assert status == 200 and rep["in_sync"] and rep["orphans"] == [], rep
        assert set(mdevs(a40)) == set(records(a40))
        vg = run.call("GET", "/v1/vgpus")[1]["vgpus"]
        assert all(v["state"] == "active" for v in vg)
        # and it serves on: the domain can allocate
        status, out = run.call("POST", f"/v1/domains/{DOM}/allocate", {"profile": "A40-8Q"})
        assert status == 200 and set(mdevs(a40)) == set(records(a40))
    finally:
        if db is not None:
            db.close()
        run.close()


def _call(path: str):
    try:
        status, _ = agentclient.call(path, "POST", f"/v1/domains/{DOM}/allocate", {"profile": "A40-8Q"})
        return status
    except agentclient.AgentDown:
        return "down"
