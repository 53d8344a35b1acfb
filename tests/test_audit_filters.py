"""`vgpuhost audit --domain --gpu --actor --limit`: the rows that match, read back from the state store."""

from __future__ import annotations

import json

from vgpuhost.cli.main import main

DOM_A = "6f1b1d4e-0000-4000-8000-00000000000a"
DOM_B = "6f1b1d4e-0000-4000-8000-00000000000b"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_audit_filters(make_host, capsys, monkeypatch):
    host = make_host("l40s-vendor-vfio")
    root = ["--root", str(host.root)]
    gpus = [g["address"] for g in json.loads(run(capsys, *root, "--json", "gpus")[1])["gpus"]]
    assert len(gpus) >= 2
    monkeypatch.setenv("VGPUHOST_ACTOR", "operator alice")
    assert run(capsys, *root, "vgpu", "create", "--profile", "L40S-4Q", "--gpu", gpus[0], "--owner", DOM_A)[0] == 0
    monkeypatch.setenv("VGPUHOST_ACTOR", "ansible bob")
    assert run(capsys, *root, "vgpu", "create", "--profile", "L40S-4Q", "--gpu", gpus[1], "--owner", DOM_B)[0] == 0

    def rows(*filters):
        code, out, err = run(capsys, *root, "--json", "audit", *filters)
        assert code == 0, err
        doc = json.loads(out)
        return doc, doc["rows"]

    doc, everything = rows()
    assert len(everything) >= 2 and doc["filters"] == {"domain": None, "gpu": None, "op": None, "actor": None,
                                                 "limit": None}
    doc, a = rows("--domain", DOM_A.upper())
    assert a and all(f"owner={DOM_A}" in r["operation"] for r in a)
    assert doc["filters"]["domain"] == DOM_A.upper()
    _, b = rows("--actor", "ansible")
    assert b and all(r["actor"] == "ansible bob" for r in b) and {r["id"] for r in a}.isdisjoint(r["id"] for r in b)
    _, g = rows("--gpu", gpus[1])
    # the GPU, or its VF that the vendor-VFIO vGPU was written through (same bus and device, another function)
    assert g and all(gpus[1] in r["path"] + r["operation"] + (r["value"] or "") or
                     f"/devices/{gpus[1][:-1]}" in r["path"] for r in g)
    assert any(r["path"].endswith("/nvidia/current_vgpu_type") for r in g)
    assert {r["id"] for r in g} <= {r["id"] for r in b} | {r["id"] for r in everything if "(placement)" in r["path"]}
    _, last = rows("--limit", "1")
    assert last == everything[-1:]
    _, none = rows("--domain", "no-such-vm", "--actor", "ansible")
    assert none == []
    code, out, err = run(capsys, *root, "audit", "--domain", "no-such-vm")
    assert code == 0 and out.strip() == "no audit rows match"
    code, out, err = run(capsys, *root, "audit", "--gpu", "41:00.0")
    assert code == 2 and "0000:41:00.0" in err
    code, out, err = run(capsys, *root, "audit", "--limit", "0")
    assert code == 2


def test_a_long_actor_is_capped_in_the_table_and_whole_in_json(make_host, capsys, monkeypatch):
    """A 5000-character actor (a domain's long name) does not widen every row of the text table; --json keeps
    the actor as recorded."""
    from vgpuhost.cli.audit import ACTOR_WIDTH
    host = make_host("l40s-vendor-vfio")
    root = ["--root", str(host.root)]
    actor = "hook " + "n" * 5000
    monkeypatch.setenv("VGPUHOST_ACTOR", actor)
    assert run(capsys, *root, "vgpu", "create", "--profile", "L40S-4Q", "--owner", DOM_A)[0] == 0
    code, out, _ = run(capsys, *root, "audit")
    assert code == 0 and max(len(line) for line in out.splitlines()) < 400
    assert ("hook " + "n" * (ACTOR_WIDTH - 8) + "...") in out
    code, out, _ = run(capsys, *root, "--json", "audit")
    recorded = {r["actor"] for r in json.loads(out)["rows"]}
    assert len(recorded) == 1 and len(recorded.pop()) > ACTOR_WIDTH       # as the store keeps it, not capped
