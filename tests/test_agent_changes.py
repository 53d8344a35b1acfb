"""A change of the agent that waits long lends its write lock (trial 7 finding F8).

A remove the kernel blocks (a holder vgpuhost cannot see keeps the mdev
open; the write is bounded by ``VGPUHOST_REMOVE_TIMEOUT_S``) used to hold the
agent's one write lock for its whole bound, so every start the agent served
waited, on any GPU; with the agent down the one-shot hook waits only for the
blocked GPU's file lock.  Now a change of the agent that waits past
``locks.LEND_AFTER_S`` (for that remove, or for a file lock another
operation holds) lends the write lock for the rest of the wait and keeps its
file locks: the others run meanwhile, and only those that need a lock it
holds wait for it, as separate processes do.  The snapshot stays the host (a
whole-host discovery) when a lent change moved the host under another's
bookkeeping, and two starts waiting side by side never take more than a
GPU's room or a tenant's quota.  Outcomes are read back from the simulated
tree, the simulator's open-device table, the state store and the journal;
the blocked remove's bound is far longer than anything here waits, so
"while it is still blocked" is a state, not a time.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest

from test_hook import vgpu_domain
from test_resident_writer import resident_writers
from vgpuhost.agent import api
from vgpuhost.cli.main import main as cli_main
from vgpuhost.io import locks
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.io.vfioholders import REMOVE_TIMEOUT_ENV
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.model.tenancy import Limits
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.inventory import discover
from vgpuhost.ops import tenancy
from vgpuhost.ops.admitting import HOST_LOCK
from vgpuhost.sim.build import materialise
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.sim.spec import parse_spec

from test_agent_snapshot import GPUS, _a40s
from test_hook import bind_as_asked, domain_xml, mdev_hostdev

#: how long a test waits for what happens at once when the code is right (a deadline, not a tolerance)
DEADLINE_S = 60.0
#: the blocked remove's bound here: the test ends it by closing the device long before (on the tree before
#: this change, the start on another GPU returned only once this bound had passed and the remove was over)
BLOCKED_S = "60"


@pytest.fixture
def host(tmp_path):
    return materialise(parse_spec(_a40s(3)), tmp_path / "host")


@pytest.fixture(params=["resident", "forked"])
def writer(request):
    """How the agent's bounded writes are made: a resident writer (the agent's own, once it listens) or a child
    forked per write (before it listens, or with the resident writer off)."""
    if request.param == "forked":
        yield None
        return
    with resident_writers() as pool:
        yield pool


def _uuid(i: int, head: str = "11111111") -> str:
    return f"{head}-2222-4333-8444-{i:012x}"


def _mdev(i: int) -> str:
    return _uuid(i, "aaaaaaaa")


def _xml(i: int, gpu=None, profile: str = "A40-8Q", tenant=None, strategy: str = "first-fit") -> str:
    if tenant is None:
        return vgpu_domain(f"vm{i}", _uuid(i), _mdev(i), profile, strategy=strategy,
                           gpu=PciAddress.parse(gpu) if gpu else None)
    meta = Metadata(tenant=tenant, vgpus=[VgpuRequest(profile, uuid=_mdev(i))])
    return domain_xml(f"vm{i}", _uuid(i), meta, [mdev_hostdev(_mdev(i))])


def _hook(agent: api.Agent, act: str, i: int, gpu=None, **kw) -> dict:
    req = api.Request({}, {}, {"xml": _xml(i, gpu, **kw), "name": f"vm{i}"}, "test", 1)
    return api._hook(agent, req, act)


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


def _gpu_of(host, mdev: str) -> str:
    return os.path.realpath(host.mdev_devices / mdev).split("/")[-2]


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


@pytest.fixture
def waiters(monkeypatch):
    """``{lock name: {thread ids}}``: the threads found a lock held (io.locks' flock answered EAGAIN), as
    io.locks waits for it."""
    seen: dict = {}
    real = locks.fcntl
    lock = threading.Lock()

    class Flock:                # fcntl as io.locks uses it, telling the test who waits for which lock
        LOCK_EX, LOCK_NB = real.LOCK_EX, real.LOCK_NB

        @staticmethod
        def flock(fd, op):
            try:
                return real.flock(fd, op)
            except OSError:
                name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))[:-len(".lock")]
                with lock:
                    seen.setdefault(name, set()).add(threading.get_ident())
                raise
    monkeypatch.setattr(locks, "fcntl", Flock)
    return seen


# ---------------------------------------------------------------------------
# F8: a blocked remove holds up only the changes that need its GPU

def test_a_blocked_remove_holds_up_only_its_own_gpu_and_the_snapshot_stays_the_host(host, writer, waiters,
                                                                                     monkeypatch):
    monkeypatch.setenv(REMOVE_TIMEOUT_ENV, BLOCKED_S)
    agent = api.Agent(host)
    agent.inventory()
    assert _hook(agent, "prepare", 1, GPUS[0])["changed"] == [_mdev(1)]
    kernel = SimKernel(host)
    holder = kernel.open_vgpu(_mdev(1), via="device")    # a holder vgpuhost cannot see: the remove blocks
    release = _Call(lambda: _hook(agent, "release", 1))
    # the remove's write waits in the (simulated) kernel, its journal entry open
    _until(lambda: kernel.meta()["opened"][str(holder)]["requests"] >= 1)
    store = StateStore(host.state_dir)
    assert [e.kind for e in store.journal_entries(open_only=True)] == ["vgpu-remove"]
    # starts that need the blocked GPU wait for its lock, as the one-shot hook's would: one pinned there, one
    # placed there first-fit ...
    same = [_Call(lambda: _hook(agent, "prepare", 4, GPUS[0])), _Call(lambda: _hook(agent, "prepare", 5))]
    # ... and starts on other GPUs complete meanwhile (before: each queued behind the remove for its bound),
    # pinned or placed (spread: the emptiest GPU)
    assert _hook(agent, "prepare", 2, GPUS[1])["changed"] == [_mdev(2)]
    assert _hook(agent, "prepare", 3, strategy="spread")["changed"] == [_mdev(3)]
    assert _gpu_of(host, _mdev(2)) == GPUS[1] and _gpu_of(host, _mdev(3)) == GPUS[2]
    # ... while the remove is still blocked: its device there, its write waiting, its release unanswered
    assert release.is_alive() and all(c.is_alive() for c in same)
    _until(lambda: len(waiters.get(f"gpu-{GPUS[0]}", ())) >= 2)     # both inside their changes, waiting for it
    assert (host.mdev_devices / _mdev(1)).is_dir()
    assert not os.path.lexists(host.mdev_devices / _mdev(4)) and not os.path.lexists(host.mdev_devices / _mdev(5))
    assert kernel.meta()["opened"][str(holder)]["requests"] >= 1
    assert [e.kind for e in store.journal_entries(open_only=True)] == ["vgpu-remove"]
    assert {r.id for r in store.vgpu_records()} == {_mdev(1), _mdev(2), _mdev(3)}
    agent.warm_up()
    inv = agent.inventory()
    assert inv == _fresh(host, like=inv) and agent.scans == 1       # refreshes of the GPUs written alone
    # the device closed: the remove completes, the release answers, the starts on its GPU go on
    kernel.close_vgpu(holder)
    for c in [release] + same:
        c.join(DEADLINE_S)
        assert not c.is_alive() and c.error is None, c.error
    assert release.result["changed"] == [_mdev(1)]
    assert [c.result["changed"] for c in same] == [[_mdev(4)], [_mdev(5)]]
    assert not os.path.lexists(host.mdev_devices / _mdev(1))
    assert _gpu_of(host, _mdev(4)) == GPUS[0] and _gpu_of(host, _mdev(5)) == GPUS[0]
    assert store.journal_entries(open_only=True) == []
    assert {r.id for r in store.vgpu_records()} == {_mdev(i) for i in (2, 3, 4, 5)}
    agent.warm_up()
    inv = agent.inventory()
    assert inv == _fresh(host, like=inv)
    assert {m.uuid for m in inv.mdevs} == {_mdev(i) for i in (2, 3, 4, 5)}
    assert agent.lent >= 2      # the release's remove, and the first start's wait for its GPU that let in the second
    assert agent.write_lock.acquire(timeout=0)      # nothing holds it now
    agent.write_lock.release()


def test_a_wait_answered_within_its_first_part_lends_nothing_and_a_longer_one_lends_once():
    """io.locks.wait_long: the ordinary write (answered within LEND_AFTER_S) hands nothing over; one that is
    not lends once for the rest of its wait, and the lock is taken back whatever ended it."""
    calls = []
    lender = locks.lending(lambda: calls.append("lend"), lambda: calls.append("take"))
    asked = []

    def at_once(t):
        asked.append(t)
        return "answer"
    with lender:
        assert locks.wait_long(at_once, 20.0) == "answer"
    assert calls == [] and lender.lent == 0 and asked == [locks.LEND_AFTER_S]
    answers = iter([None, "late"])

    def later(t):
        asked.append(t)
        assert calls == (["lend"] if len(asked) > 2 else [])
        return next(answers)
    with lender:
        assert locks.wait_long(later, 20.0) == "late"
    assert calls == ["lend", "take"] and lender.lent == 1 and asked[1] == locks.LEND_AFTER_S and 0 < asked[2] <= 20.0

    def fails(t):
        if t == locks.LEND_AFTER_S:
            return None
        raise OSError("the wait failed")
    with lender, pytest.raises(OSError):
        locks.wait_long(fails, 20.0)
    assert calls == ["lend", "take", "lend", "take"] and lender.lent == 2
    assert locks.wait_long(at_once, 20.0) == "answer" and calls[-1] == "take"      # no lender: nothing lent


# ---------------------------------------------------------------------------
# the snapshot while a lent change has moved the host

def test_a_write_whose_bookkeeping_sees_a_lent_change_makes_a_whole_read(host, waiters):
    """Change A made its vGPU on GPUS[0], then waits for a lock another operation holds (lent); change B makes
    one on GPUS[2] and ends: B's fingerprint holds A's vGPU, which B's device does not explain, and A's then
    holds B's: the whole host is read (not GPUS[2], then GPUS[0] alone, over a snapshot that has neither)."""
    agent = api.Agent(host)
    agent.inventory()

    def create(i, gpu):
        assert cli_main(["--root", str(host.root), "--local", "vgpu", "create", "--profile", "A40-8Q",
                         "--gpu", gpu, "--uuid", _mdev(i)]) == 0
        return [_mdev(i)]

    def fn_a():
        create(1, GPUS[0])
        with locks.file_lock(host.state_dir, "elsewhere"):
            pass
        return [_mdev(1)]
    with locks.file_lock(host.state_dir, "elsewhere"):          # another process's operation holds it
        a = _Call(lambda: agent.write(fn_a, changed=lambda names: names))
        _until(lambda: waiters.get("elsewhere"))
        b = _Call(lambda: agent.write(lambda: create(2, GPUS[2]), changed=lambda names: names))
        b.join(DEADLINE_S)      # before: B waited for A's write lock, and A for this lock (until the deadline)
        assert not b.is_alive() and b.error is None and b.result == [_mdev(2)], b.error
        assert a.is_alive()
    a.join(DEADLINE_S)
    assert not a.is_alive() and a.error is None and a.result == [_mdev(1)], a.error
    assert agent.lent == 1
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


# ---------------------------------------------------------------------------
# no double booking: starts waiting side by side decide under the same file locks as the one-shot hook

def _two_starts_waiting_for(agent, waiters, lock: str, starts):
    """Run ``starts`` (two callables) while ``lock`` is held elsewhere, until both wait for it inside their
    changes (side by side: the first lent the write lock), then let the lock go; the two calls."""
    with locks.file_lock(agent.host.state_dir, lock):
        calls = [_Call(fn) for fn in starts]
        _until(lambda: len(waiters.get(lock, ())) >= 2)
    for c in calls:
        c.join(DEADLINE_S)
        assert not c.is_alive()
    return calls


def test_two_starts_waiting_side_by_side_never_overfill_a_gpu(host, waiters):
    agent = api.Agent(host)
    agent.inventory()
    calls = _two_starts_waiting_for(agent, waiters, f"gpu-{GPUS[0]}", [
        lambda: _hook(agent, "prepare", 1, GPUS[0], profile="A40-48Q"),
        lambda: _hook(agent, "prepare", 2, GPUS[0], profile="A40-48Q")])
    made = [c for c in calls if c.error is None]
    refused = [c for c in calls if c.error is not None]
    assert len(made) == 1 and len(refused) == 1, [c.error for c in calls]
    assert "A40-48Q" in refused[0].error.message
    mdevs = [m.name for m in host.mdev_devices.iterdir()]
    assert len(mdevs) == 1 and _gpu_of(host, mdevs[0]) == GPUS[0]
    assert [r.id for r in StateStore(host.state_dir).vgpu_records()] == mdevs
    assert agent.inventory() == _fresh(host)


def test_two_starts_waiting_side_by_side_never_pass_a_tenant_quota(host, waiters):
    store = StateStore(host.state_dir, create=True)
    tenancy.add(store, tenancy.Tenant("team", quota=tenancy.Quota(Limits(vgpus=1))))
    for i in (1, 2):
        bind_as_asked(host, _xml(i, tenant="team"))
    agent = api.Agent(host)
    agent.inventory()
    calls = _two_starts_waiting_for(agent, waiters, HOST_LOCK, [
        lambda: _hook(agent, "prepare", 1, tenant="team"), lambda: _hook(agent, "prepare", 2, tenant="team")])
    made = [c for c in calls if c.error is None]
    refused = [c for c in calls if c.error is not None]
    assert len(made) == 1 and len(refused) == 1, [c.error for c in calls]
    assert "quota vGPUs of tenant 'team': 1 in use + 1 asked > 1" in refused[0].error.message
    assert len(list(host.mdev_devices.iterdir())) == 1
    assert [r.owner for r in store.vgpu_records()] == [made[0].result["domain"]]


# ---------------------------------------------------------------------------
# SIGTERM

def test_sigterm_ends_a_hook_call_waiting_for_its_gpus_lock_undone_and_the_hook_does_it(host, waiters):
    """A change that waits for a lock lends the write lock, so at SIGTERM several may wait for one GPU's lock
    (every start placed first-fit on the same GPU); each gives up its wait (503: the hook does the work
    itself), what it made undone, instead of keeping the agent's stop waiting for each in turn."""
    agent = api.Agent(host)
    agent.inventory()
    with locks.file_lock(host.state_dir, f"gpu-{GPUS[1]}"):     # another process's operation on GPUS[1]
        start = _Call(lambda: _hook(agent, "prepare", 2, GPUS[1]))
        _until(lambda: waiters.get(f"gpu-{GPUS[1]}"))
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


def test_a_change_taking_the_write_lock_back_goes_before_changes_not_started():
    """Under a storm of starts on one GPU, the change that lent the lock holds that GPU's file lock: it must
    get the write lock when the holder lets it go, not after whichever new start wins the race."""
    lock = api.WriteLock()
    assert lock.acquire() and lock.locked()
    got = []

    def new(i):
        with lock:
            got.append(f"new{i}")

    def back():
        lock.take_back()
        got.append("back")
        lock.release()
    waiting = [_Call(lambda: new(1)), _Call(lambda: new(2))]
    _until(lambda: len(lock._new._waiters) == 2)
    waiting.append(_Call(back))
    _until(lambda: len(lock._back._waiters) == 1)
    assert not lock.acquire(timeout=0) and not lock.acquire(blocking=False)
    lock.release()
    for c in waiting:
        c.join(DEADLINE_S)
        assert not c.is_alive() and c.error is None, c.error
    assert got[0] == "back" and sorted(got[1:]) == ["new1", "new2"]
    assert not lock.locked() and lock.acquire(timeout=0)
