"""What a pending removal and an interrupted release read as (trial 7 retest nits).

``vgpu list`` shows a vGPU whose removal is pending (an open ``vgpu-remove`` journal entry: its write
blocked by a holder, or its writer ended without answering) as ``removing``, not ``active``; ``reconcile``
words a domain left recorded by a release killed after it removed the domain's vGPUs as that, not as
"a start killed half-way".  Read back from the CLI's text and JSON and the state store.
"""

from __future__ import annotations

import json

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
