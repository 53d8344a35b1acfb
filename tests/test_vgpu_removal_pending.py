"""What a pending removal and an interrupted release read as (trial 7 retest nits).

``vgpu list`` shows a vGPU whose removal is pending (an open ``vgpu-remove`` journal entry: its write
blocked by a holder, or its writer ended without answering) as ``removing``, not ``active``; ``reconcile``
words a domain left recorded by a release killed after it removed the domain's vGPUs as that, not as
"a start killed half-way".  Read back from the CLI's text and JSON and the state store.
"""

from __future__ import annotations

import json
import os

from vgpuhost.io.state import StateStore
from vgpuhost.ops import recover
from vgpuhost.ops.vgpu import _journal_device, create, remove

from test_hook import start, vgpu_domain
from test_remove_blocking import cli

DOM = "11111111-2222-4333-8444-0000000000e1"
DOM2 = "11111111-2222-4333-8444-0000000000e2"
MDEV = "aaaaaaaa-2222-4333-8444-0000000000e1"


def test_vgpu_list_shows_a_vgpu_whose_removal_is_pending_as_removing(make_host, capsys):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")
    other = create(host, store, profile="A40-8Q")
    store.journal_open(kind="vgpu-remove", operation=f"vgpu remove {out.id}", owner=out.owner, actor="test",
                       gpu=out.gpu, group=None, steps=["remove"],
                       devices=[_journal_device(out.id, out.backend, out.gpu, out.parent, out.type_id,
                                                out.type_name, False, "removing")])
    code, text, _ = cli(capsys, host, "vgpu", "list")
    assert code == 0
    states = {line.split()[0]: line.split()[-1] for line in text.splitlines()[1:]}
    assert states == {out.id: "removing", other.id: "active"}, text
    code, text, _ = cli(capsys, host, "--json", "vgpu", "list")
    assert code == 0 and {v["id"]: v["state"] for v in json.loads(text)["vgpus"]} == \
        {out.id: "removing", other.id: "active"}
    # the agent's GET /v1/vgpus says the same (trial 7 retest nit, the agent's side)
    from vgpuhost.agent import api
    doc = api.get_vgpus(api.Agent(host), None)
    assert {v["id"]: v["state"] for v in doc["vgpus"]} == {out.id: "removing", other.id: "active"}, doc
    assert (host.mdev_devices / out.id).is_dir()        # nothing was changed: still there, still recorded
    assert sorted(r.id for r in store.vgpu_records()) == sorted([out.id, other.id])


def test_reconcile_words_an_interrupted_release_by_what_was_interrupted(make_host, capsys):
    """A release killed after it removed the domain's vGPU (and before it forgot the domain) reads as such;
    a start killed before it made anything still reads as a start killed half-way."""
    host = make_host("a40-mdev")
    assert start(host, "vm", vgpu_domain("vm", DOM, MDEV), bind=False) == (0, "")
    store = StateStore(host.state_dir)
    # release end as far as its vGPU removal (ops.devices.release_domain), then killed: the domain stays recorded
    remove(host, store, MDEV, owner=DOM, actor="hook", while_running=True)
    store.domain_started(DOM2, "vm2")                  # a start recorded, nothing made
    assert store.vgpu_records() == [] and set(store.active_domains()) == {DOM, DOM2}
    why = {d["domain"]: d["why"] for d in recover.stale_domains(store, frozenset())}
    assert list(why) == [DOM2] and why[DOM2].endswith("(a start killed half-way, before it made a device)"), why
    # reconcile drops the allocation the killed release left, then forgets both domains, each by its own words
    code, text, err = cli(capsys, host, "--connect", "test:///default", "reconcile")
    assert code == 0 and "in sync" in text, text + err
    lines = {d: [line for line in text.splitlines() if line.startswith("forgotten domain:") and d in line]
             for d in (DOM, DOM2)}
    assert len(lines[DOM]) == 1 and lines[DOM][0].endswith(
        "(a release killed half-way: it removed the domain's 1 vGPU(s) and was killed before it forgot the "
        "domain)"), text
    assert len(lines[DOM2]) == 1 and lines[DOM2][0].endswith("(a start killed half-way, before it made a device)")
    assert store.active_domains() == {} and store.allocation_rows() == []


def test_following_the_release_advice_for_a_pending_removal_ends_that_entry_and_opens_none(make_host, capsys,
                                                                                            monkeypatch):
    """Trial 8 T9: ``release end`` whose remove did not finish within its bound (a holder vgpuhost cannot
    see keeps the mdev open) leaves one open ``vgpu-remove`` entry and advises ``vgpu remove ID --owner
    UUID``.  Following it while the device is still open keeps waiting on that entry (exit 3, naming it),
    opening no second one; once the device is closed, following it again finishes that same entry."""
    from test_remove_blocking import DOM as RDOM, MDEV as RMDEV, _domain, _hook, until
    from vgpuhost.io.vfioholders import REMOVE_TIMEOUT_ENV
    from vgpuhost.sim.kernel import SimKernel
    host = make_host("a40-mdev")
    xml = _domain("web")
    assert _hook(host, "prepare", "begin", xml) == (0, "")
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(RMDEV, via="device")        # a holder vgpuhost does not see: the write blocks
    monkeypatch.setenv(REMOVE_TIMEOUT_ENV, "0.3")
    rc, err = _hook(host, "release", "end", xml)
    assert rc == 3 and "vgpuhost vgpu remove ID --owner UUID" in err, err
    store = StateStore(host.state_dir)
    first = store.journal_entries(open_only=True)
    assert [(e.kind, e.devices[0]["id"]) for e in first] == [("vgpu-remove", RMDEV)]
    entries = len(store.journal_entries())
    # the advice, while the device is still open: that entry is still pending, named; no second entry
    code, out, err = cli(capsys, host, "vgpu", "remove", RMDEV, "--owner", RDOM)
    assert code == 3 and err.count("\n") == 1, err
    assert f"the removal of {RMDEV} is still pending (journal #{first[0].id}" in err, err
    assert "already in progress" in err and "no second one is opened" in err, err
    assert [e.id for e in store.journal_entries(open_only=True)] == [first[0].id]
    assert len(store.journal_entries()) == entries
    assert [r.id for r in store.vgpu_records()] == [RMDEV] and (host.mdev_devices / RMDEV).is_dir()
    code, text, _ = cli(capsys, host, "reconcile", "--check")
    assert code == 1 and sum(f"vgpu remove {RMDEV}" in line for line in text.splitlines()) == 1, text
    # the holder closes it: the detached write completes; the advice then finishes the same entry
    kernel.close_vgpu(pid)
    until(lambda: not os.path.lexists(host.mdev_devices / RMDEV))
    code, out, err = cli(capsys, host, "vgpu", "remove", RMDEV, "--owner", RDOM)
    assert code == 0 and f"its pending removal (journal #{first[0].id}) finished now" in out + err, (out, err)
    assert store.journal_entries(open_only=True) == [] and len(store.journal_entries()) == entries
    assert [e.state for e in store.journal_entries() if e.id == first[0].id] == ["finished"]
    assert store.vgpu_records() == []


def test_reconcile_check_says_an_entrys_process_is_alive_not_that_it_runs_the_entry(make_host, capsys):
    """Trial 8 T9: an open entry whose process lives on (here: this process, as the resident agent after a
    removal it left pending) reads as "alive, but no operation holds its lock now", not "still running";
    while its GPU's lock is held it reads as possibly under way; a gone process's as interrupted."""
    from vgpuhost.io.locks import file_lock
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")
    eid = store.journal_open(kind="vgpu-remove", operation=f"vgpu remove {out.id}", owner=out.owner, actor="test",
                             gpu=out.gpu, group=None, steps=["remove"],
                             devices=[_journal_device(out.id, out.backend, out.gpu, out.parent, out.type_id,
                                                      out.type_name, False, "removing")])
    code, text, _ = cli(capsys, host, "reconcile", "--check")
    line = next(line for line in text.splitlines() if f"journal #{eid}" in line)
    assert code == 1 and "still running" not in line, line
    assert line.endswith(f" - pid {os.getpid()}, which opened it, is alive, but no operation holds its lock "
                         f"(gpu-{out.gpu}) now: nothing works on it; 'vgpuhost reconcile' ends it (a removal, "
                         "once the device is closed)"), line
    with file_lock(store.dir, f"gpu-{out.gpu}"):
        (entry,) = store.journal_entries(open_only=True)
        line = recover.describe_open(entry, store.dir)
    assert line.endswith(f", which opened it, is alive and gpu-{out.gpu} is locked now: an operation on it may "
                         "be under way; 'vgpuhost reconcile' waits for it, then ends what is left"), line
    with store.transaction() as conn:
        conn.execute("UPDATE journal SET pid = ? WHERE id = ?", (2 ** 22 + 12345, eid))    # no such process
    (entry,) = store.journal_entries(open_only=True)
    assert recover.describe_open(entry, store.dir).endswith(" - interrupted")
    assert (host.mdev_devices / out.id).is_dir() and [r.id for r in store.vgpu_records()] == [out.id]
