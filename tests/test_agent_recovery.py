"""The resident agent ends what it left open itself (trial 8 T10), never what another of its requests works on.

A removal whose write did not return within its bound (``VGPUHOST_REMOVE_TIMEOUT_S``, the device held
open) leaves its journal entry open, opened by the agent's own process.  Once the device is closed and
the detached write has completed, the agent's next operation on that GPU finishes the entry, as a
one-shot command or ``reconcile`` does; an entry a thread of the process is still working on
(:func:`vgpuhost.plan.journal.in_progress`) is never touched.  Outcomes are read back from the
simulated tree, the state store and a one-shot ``reconcile --check``.
"""

from __future__ import annotations

import os
import threading

import pytest

from test_remove_blocking import A40, DEADLINE_S, MDEV, _domain, until
from vgpuhost.agent import api
from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.io.vfioholders import REMOVE_TIMEOUT_ENV
from vgpuhost.model.errors import VgpuhostError
from vgpuhost.ops.recover import recover_locked
from vgpuhost.ops.vgpu import _journal_device, create
from vgpuhost.plan.journal import Journal, in_progress
from vgpuhost.sim.kernel import SimKernel


def _request(body=None, **params) -> api.Request:
    return api.Request(params, {}, body, "test", 1)


def _in_sync(host, capsys) -> tuple:
    capsys.readouterr()
    code = main(["--root", str(host.root), "--local", "reconcile", "--check"])
    return code, capsys.readouterr().out


def test_the_agents_next_operation_on_the_gpu_finishes_its_own_pending_removal(make_host, monkeypatch, capsys):
    host = make_host("a40-mdev")
    agent = api.Agent(host)
    store = StateStore(host.state_dir)
    xml = _domain("web")
    body = {"xml": xml, "name": "web"}
    assert api._hook(agent, _request(body), "prepare")["changed"] == [MDEV]
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(MDEV, via="device")          # a holder vgpuhost cannot see: the write blocks
    monkeypatch.setenv(REMOVE_TIMEOUT_ENV, "0.3")
    with pytest.raises(VgpuhostError) as e:
        api._hook(agent, _request(body), "release")
    assert e.value.exit_code == 3 and "did not finish within 0.3 s" in e.value.message
    monkeypatch.delenv(REMOVE_TIMEOUT_ENV)
    [entry] = store.journal_entries(open_only=True)
    assert entry.kind == "vgpu-remove" and entry.pid == os.getpid()    # opened by the agent's process
    assert not in_progress(entry.id, entry.pid)                        # ... and no thread of it works on it
    kernel.close_vgpu(pid)
    until(lambda: not os.path.lexists(host.mdev_devices / MDEV))       # the detached write completed
    assert [r.id for r in store.vgpu_records()] == [MDEV]              # the record is still there
    # the agent's next operation on that GPU: a vGPU created there through it
    made = api.post_vgpu_create(agent, _request({"profile": "A40-8Q", "gpu": A40}))
    assert made["gpu"] == A40 and made["id"] != MDEV
    assert store.journal_entries(open_only=True) == []
    [closed] = [j for j in store.journal_entries() if j.id == entry.id]
    assert closed.state == "finished" and MDEV in closed.outcome
    assert [r.id for r in store.vgpu_records()] == [made["id"]]
    assert os.listdir(host.mdev_devices) == [made["id"]]
    assert _in_sync(host, capsys)[0] == 0


def _open_removal(host, store, out) -> int:
    return store.journal_open(kind="vgpu-remove", operation=f"vgpu remove {out.id}", owner=out.owner, actor="test",
                              gpu=out.gpu, group=None, steps=["remove"],
                              devices=[_journal_device(out.id, out.backend, out.gpu, out.parent, out.type_id,
                                                       out.type_name, False, "removing")])


def test_an_entry_another_thread_still_works_on_is_never_touched(make_host):
    """A thread of this process holds a removal's journal block open (its vGPU already gone from the
    tree): another thread's recovery on that GPU leaves it alone, record and entry; once the block ends
    with the entry kept open (pending), the next recovery finishes it."""
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")
    Sysfs(host).write(host.mdev_devices / out.id / "remove", "1")
    inside, leave = threading.Event(), threading.Event()
    ids = []

    def work():
        j = Journal(store, _open_removal(host, store, out), 1)
        ids.append(j.id)
        with j:
            j.keep_open()
            inside.set()
            leave.wait(DEADLINE_S)
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    assert inside.wait(DEADLINE_S)
    assert in_progress(ids[0], os.getpid())
    assert recover_locked(host, store, gpu=out.gpu, actor="test") == []
    assert [e.id for e in store.journal_entries(open_only=True)] == ids and len(store.vgpu_records()) == 1
    leave.set()
    worker.join(DEADLINE_S)
    assert not worker.is_alive() and not in_progress(ids[0], os.getpid())
    [rep] = recover_locked(host, store, gpu=out.gpu, actor="test")
    assert rep.result == "finished" and store.journal_entries(open_only=True) == [] and store.vgpu_records() == []
