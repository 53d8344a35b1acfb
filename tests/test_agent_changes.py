"""The agent's changes run side by side (trial 7 finding F8).

A remove the kernel blocks (a holder vgpuhost cannot see keeps the mdev
open; the write is bounded by ``VGPUHOST_REMOVE_TIMEOUT_S``) holds its own
GPU's lock, as the one-shot hook's does, and nothing else: a domain start on
another GPU through the agent completes while that remove still waits.  The
agent's snapshot stays the host (equal to a whole-host discovery) when writes
overlap: a write whose bookkeeping sees another's change still in flight, or
a whole read installed meanwhile, makes the whole host due.  Outcomes are read
back from the simulated tree, the simulator's open-device table, the state
store and the journal; no wall-time tolerance.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest

from test_hook import vgpu_domain
from vgpuhost.agent import api
from vgpuhost.cli.main import main as cli_main
from vgpuhost.io import sysfs
from vgpuhost.io.residentwriter import Writers
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.io.vfioholders import REMOVE_TIMEOUT_ENV
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.inventory import discover
from vgpuhost.sim.build import materialise
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.sim.spec import parse_spec

from test_agent_snapshot import GPUS, _a40s

#: how long a test waits for what happens at once when the code is right (a deadline, not a tolerance)
DEADLINE_S = 20.0


@pytest.fixture
def host(tmp_path):
    return materialise(parse_spec(_a40s(3)), tmp_path / "host")


@pytest.fixture
def writers():
    """A pool of resident writers making this process's bounded writes, as in the agent."""
    pool = Writers()
    sysfs.set_bounded_writer(pool.write)
    try:
        yield pool
    finally:
        sysfs.set_bounded_writer(None)
        pool.close()


def _uuid(i: int, head: str = "11111111") -> str:
    return f"{head}-2222-4333-8444-{i:012x}"


def _mdev(i: int) -> str:
    return _uuid(i, "aaaaaaaa")


def _hook(agent: api.Agent, act: str, i: int, gpu: str) -> dict:
    xml = vgpu_domain(f"vm{i}", _uuid(i), _mdev(i), gpu=PciAddress.parse(gpu))
    return api._hook(agent, api.Request({}, {}, {"xml": xml, "name": f"vm{i}"}, "test", 1), act)


def _fresh(host, like=None):
    """A whole-host discovery; with ``like`` (a snapshot), its running process names taken from ``like``: the
    simulated holder's ``/proc`` entry is no device change (the fingerprint leaves processes out)."""
    inv = discover(Sysfs(host))
    if like is not None:
        inv = dataclasses.replace(inv, host=dataclasses.replace(inv.host, processes=like.host.processes))
    return inv


def _until(what, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


class _Call(threading.Thread):
    """``fn()`` on its own thread (as the agent serves each connection on one): ``.result`` or ``.error``."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:          # noqa: B036 - handed to the test
            self.error = e


def test_a_blocked_remove_holds_up_only_its_own_gpu_and_the_snapshot_stays_the_host(host, writers, monkeypatch):
    monkeypatch.setenv(REMOVE_TIMEOUT_ENV, "600")       # the remove stays blocked until the test closes the device
    agent = api.Agent(host)
    agent.inventory()
    assert _hook(agent, "prepare", 1, GPUS[0])["changed"] == [_mdev(1)]
    kernel = SimKernel(host)
    holder = kernel.open_vgpu(_mdev(1), via="device")    # a holder vgpuhost cannot see: the remove blocks
    release = _Call(lambda: _hook(agent, "release", 1, GPUS[0]))
    # the remove's write waits in the (simulated) kernel, its journal entry open
    _until(lambda: kernel.meta()["opened"][str(holder)]["requests"] >= 1)
    store = StateStore(host.state_dir)
    assert [e.kind for e in store.journal_entries(open_only=True)] == ["vgpu-remove"]
    # a start on another GPU and a second change after it complete meanwhile (before: both queued behind
    # the remove for its whole bound)
    start = _Call(lambda: _hook(agent, "prepare", 2, GPUS[1]))
    start.join(DEADLINE_S)
    assert not start.is_alive() and start.error is None, start.error
    assert start.result["changed"] == [_mdev(2)]
    assert os.path.realpath(host.mdev_devices / _mdev(2)).split("/")[-2] == GPUS[1]
    assert _hook(agent, "prepare", 3, GPUS[2])["changed"] == [_mdev(3)]
    # ... while the remove is still pending: its device there, its write waiting, its release unanswered
    assert release.is_alive()
    assert (host.mdev_devices / _mdev(1)).is_dir()
    assert kernel.meta()["opened"][str(holder)]["requests"] >= 1
    assert [e.kind for e in store.journal_entries(open_only=True)] == ["vgpu-remove"]
    agent.warm_up()
    inv = agent.inventory()
    assert inv == _fresh(host, like=inv) and agent.scans == 1       # refreshes of the GPUs written alone
    assert {m.uuid for m in inv.mdevs} == {_mdev(1), _mdev(2), _mdev(3)}
    # the device closed: the remove completes, the release answers, the snapshot is the host again
    kernel.close_vgpu(holder)
    release.join(DEADLINE_S)
    assert not release.is_alive() and release.error is None, release.error
    assert release.result["changed"] == [_mdev(1)]
    assert not os.path.lexists(host.mdev_devices / _mdev(1))
    assert store.journal_entries(open_only=True) == [] and {r.id for r in store.vgpu_records()} == {_mdev(2), _mdev(3)}
    agent.warm_up()
    inv = agent.inventory()
    assert inv == _fresh(host, like=inv) and agent.scans == 1
    assert {m.uuid for m in inv.mdevs} == {_mdev(2), _mdev(3)}
    assert agent.write_lock.count == 0


def test_a_write_whose_bookkeeping_sees_another_change_in_flight_makes_a_whole_read(host):
    """Write A made its vGPU on GPUS[0]; before A's bookkeeping, write B makes one on GPUS[2] and ends: B's
    fingerprint holds A's vGPU, which B's device does not explain, and A's then holds B's: the whole host
    is read (not GPUS[2], then GPUS[0] alone, over a snapshot that has neither)."""
    agent = api.Agent(host)
    agent.inventory()
    inner = []

    def create(i, gpu):
        assert cli_main(["--root", str(host.root), "--local", "vgpu", "create", "--profile", "A40-8Q",
                         "--gpu", gpu, "--uuid", _mdev(i)]) == 0
        return [_mdev(i)]

    def fn_a():
        create(1, GPUS[0])
        inner.append(_Call(lambda: agent.write(lambda: create(2, GPUS[2]), changed=lambda names: names)))
        inner[0].join(DEADLINE_S)           # before: B waited for A's lock, and A for B (until this deadline)
        assert not inner[0].is_alive()
        return [_mdev(1)]
    agent.write(fn_a, changed=lambda names: names)
    b, = inner
    assert b.error is None and b.result == [_mdev(2)], b.error
    agent.warm_up()
    assert (agent.scans, agent.refreshes) == (2, 0)         # a whole read: neither write explains the other's
    assert agent.inventory() == _fresh(host)
    assert {str(m.parent) for m in agent.inventory().mdevs} == {GPUS[0], GPUS[2]}


def test_a_whole_read_installed_during_a_writes_bookkeeping_makes_the_whole_host_due(host):
    """Another thread's whole read between the start of a write's bookkeeping and its record: the fingerprint
    the write compared with is no longer what the snapshot matches.  Here the host went A -> B -> A on
    GPUS[2] around that read (a vGPU removed, then made again with the same UUID: the same fingerprint), so
    the write's change looks explained; recorded, the next refresh would read GPUS[0] alone and keep the
    snapshot without that vGPU."""
    agent = api.Agent(host)

    def cli(*args):
        assert cli_main(["--root", str(host.root), "--local", *args]) == 0
    cli("vgpu", "create", "--profile", "A40-8Q", "--gpu", GPUS[2], "--uuid", _mdev(9))
    agent.inventory()
    gpus_of = agent._gpus_of

    def meanwhile(inv, names):
        cli("vgpu", "remove", _mdev(9))
        agent.inventory()                   # another request's read: the whole host, without that vGPU
        cli("vgpu", "create", "--profile", "A40-8Q", "--gpu", GPUS[2], "--uuid", _mdev(9))
        return gpus_of(inv, names)
    agent._gpus_of = meanwhile
    assert _hook(agent, "prepare", 1, GPUS[0])["changed"] == [_mdev(1)]
    agent._gpus_of = gpus_of
    inv = agent.inventory()
    assert inv == _fresh(host)
    assert {m.uuid for m in inv.mdevs} == {_mdev(1), _mdev(9)}


def test_the_gate_lets_changes_run_together_and_stop_waits_for_them(host):
    agent = api.Agent(host)
    gate = agent.write_lock
    inside, go = threading.Event(), threading.Event()

    def held():
        inside.set()
        assert go.wait(DEADLINE_S)
        return None
    first = _Call(lambda: agent.write(held))
    assert inside.wait(DEADLINE_S) and gate.count == 1 and gate.locked()
    assert agent.write(lambda: "second") == "second"        # a second change while the first runs
    assert not gate.acquire(timeout=0)                     # stop's wait: a change still runs
    agent.stop()
    with pytest.raises(api.Stopping):
        agent.write(lambda: "third")
    go.set()
    first.join(DEADLINE_S)
    assert not first.is_alive() and first.error is None
    assert gate.acquire(timeout=DEADLINE_S)                # none runs now: held, none starts
    entered = threading.Event()

    def enter():
        with gate.running():
            entered.set()
    waiting = _Call(enter)
    assert not entered.wait(0.2) and waiting.is_alive()     # it waits while the gate is held ...
    gate.release()
    waiting.join(DEADLINE_S)
    assert entered.is_set() and not gate.locked()           # ... and runs once it is released


def test_sigterm_ends_a_hook_call_waiting_for_its_gpus_lock_undone_and_the_hook_does_it(host, monkeypatch):
    """Changes run side by side, so at SIGTERM several may wait for one GPU's lock (every start placed
    first-fit on the same GPU); each gives up its wait (503: the hook does the work itself), what it made
    undone, instead of keeping the agent's stop waiting for each in turn."""
    from vgpuhost.io import locks
    agent = api.Agent(host)
    agent.inventory()
    waiting = threading.Event()
    real = locks.fcntl

    class Flock:                # fcntl as io.locks uses it, telling the test when a lock is waited for
        LOCK_EX, LOCK_NB = real.LOCK_EX, real.LOCK_NB

        @staticmethod
        def flock(fd, op):
            try:
                return real.flock(fd, op)
            except OSError:
                waiting.set()
                raise
    monkeypatch.setattr(locks, "fcntl", Flock)
    with locks.file_lock(host.state_dir, f"gpu-{GPUS[1]}"):     # another process's operation on GPUS[1]
        start = _Call(lambda: _hook(agent, "prepare", 2, GPUS[1]))
        assert waiting.wait(DEADLINE_S)
        agent.stop()
        start.join(DEADLINE_S)
        assert not start.is_alive()
    assert isinstance(start.error, api.Stopping) and "gave up the prepare" in start.error.message, start.error
    assert not os.path.lexists(host.mdev_devices / _mdev(2))
    store = StateStore(host.state_dir)
    assert store.vgpu_records() == [] and store.active_domains() == {}
    assert store.journal_entries(open_only=True) == []
    assert agent.write_lock.acquire(timeout=0)          # nothing runs: the stop's wait is over at once
    agent.write_lock.release()
