"""A new vGPU never lands on an id a record holds (trial 7 F6).

On vendor VFIO a vGPU is named by its VF, and a reboot (or a remove that failed) leaves records
whose vGPU is missing from the host: ``vgpuhost reconcile`` re-creates each on its own VF.  A
``vgpu create`` (and the layout's create steps, the agent's POST /v1/vgpus and allocate, which share
:func:`vgpuhost.ops.vgpu.create_vgpu`) places on another free VF; a request pinned to such a VF, or an
mdev ``--uuid`` a missing record holds, is refused before any write, naming the record's owner and
the fix; a record that appears between the check and the insert undoes the new device and is a
refusal, never "the state store is unusable".  Each test reads back the simulated tree, the store's
records and the audit log.
"""

from __future__ import annotations

import sqlite3

import pytest

from vgpuhost.cli.main import main
from vgpuhost.io import state
from vgpuhost.io.state import StateStore, put_vgpu, store_error, utcnow
from vgpuhost.model.errors import RefusedError
from vgpuhost.model.records import VgpuRecord
from vgpuhost.model.values import PciAddress
from vgpuhost.ops import vgpu
from vgpuhost.sim.data import bundled_specs
from vgpuhost.sim.reboot import reboot

from test_hook import start, vf_domain

GPU = "0000:21:00.0"
VF4, VF5 = "0000:21:00.4", "0000:21:00.5"
DOM = "6f1b1d4e-0000-4000-8000-00000000f601"
DOM2 = "6f1b1d4e-0000-4000-8000-00000000f602"
MDEV = "aaaaaaaa-2222-4333-8444-00000000f606"


def two_vfs() -> str:
    """l40s-vendor-vfio with 2 VFs per GPU (two L40S-24Q fill 0000:21:00.0)."""
    text = open(bundled_specs()["l40s-vendor-vfio"]).read()
    assert "sriov_numvfs: 16" in text
    return text.replace("sriov_numvfs: 16", "sriov_numvfs: 2")


LAYOUT = ("version: 1\ndefault: a\nlayouts:\n  a:\n    gpus:\n"
          f"      - select: {{address: \"{GPU}\"}}\n        mode: vgpu\n        vgpu: {{types: {{L40S-4Q: 2}}}}\n")


def cli(capsys, host, *argv):
    code = main(["--root", str(host.root), "--local", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def vf_type(host, vf: str) -> str:
    """The VF's ``nvidia/current_vgpu_type`` as the tree says (``0``: free)."""
    return (host.pci_device(vf) / "nvidia" / "current_vgpu_type").read_text().strip()


def records(host) -> dict:
    store = StateStore(host.state_dir, create=False)
    try:
        return {r.id: (r.owner, r.type_name) for r in store.vgpu_records()}
    finally:
        store.close()


def audit(host) -> list:
    store = StateStore(host.state_dir, create=False)
    try:
        return [(r.path, r.value, r.result) for r in store.audit_rows()]
    finally:
        store.close()


def writes_to(rows, vf: str) -> list:
    return [(v, res) for p, v, res in rows if p.endswith(f"{vf}/nvidia/current_vgpu_type")]


def lost_after_reboot(make_host, capsys, spec="l40s-vendor-vfio", profile="L40S-4Q", n=1, yaml_text=None):
    """A vendor-VFIO host where ``n`` manual vGPUs were made, then lost at a reboot (records 'missing')."""
    host = make_host(spec) if yaml_text is None else make_host(yaml_text=yaml_text)
    for _ in range(n):
        assert cli(capsys, host, "vgpu", "create", "--profile", profile, "--gpu", GPU)[0] == 0
    assert reboot(host)["vgpus_lost"]
    return host


def test_create_after_a_reboot_places_on_a_vf_no_record_holds(make_host, capsys):
    host = lost_after_reboot(make_host, capsys)
    assert records(host) == {VF4: ("manual", "L40S-4Q")} and vf_type(host, VF4) == "0"
    before = len(audit(host))

    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-4Q", "--gpu", GPU, "--owner", DOM)
    assert code == 0, err
    # the old record keeps its owner and its VF, still missing; the new vGPU is on the next free VF
    assert records(host) == {VF4: ("manual", "L40S-4Q"), VF5: (DOM, "L40S-4Q")}
    assert vf_type(host, VF4) == "0" and vf_type(host, VF5) != "0"
    rows = audit(host)[before:]
    assert writes_to(rows, VF4) == [] and writes_to(rows, VF5) == [(vf_type(host, VF5), "ok")]

    # reconcile then makes the missing one again, on its own VF, for its own owner
    assert cli(capsys, host, "reconcile")[0] == 0
    assert vf_type(host, VF4) == vf_type(host, VF5) != "0"
    assert records(host) == {VF4: ("manual", "L40S-4Q"), VF5: (DOM, "L40S-4Q")}


def test_layout_apply_after_a_reboot_leaves_the_missing_records_vf(make_host, capsys, tmp_path):
    host = lost_after_reboot(make_host, capsys)
    config = tmp_path / "layout.yaml"
    config.write_text(LAYOUT)
    code, _, err = cli(capsys, host, "apply", "-c", str(config))
    assert code == 0, err
    recs = records(host)
    assert recs.pop(VF4) == ("manual", "L40S-4Q") and vf_type(host, VF4) == "0"
    assert sorted(recs.values()) == [("layout", "L40S-4Q")] * 2
    assert all(vf_type(host, vf) != "0" for vf in recs)


def test_no_free_vf_but_recorded_ones_refuses_before_any_write(make_host, capsys):
    host = lost_after_reboot(make_host, capsys, profile="L40S-24Q", n=2, yaml_text=two_vfs())
    assert sorted(records(host)) == [VF4, VF5]
    before = audit(host)
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-4Q", "--gpu", GPU)
    assert code == 2 and err.count("\n") == 1, err
    assert "recorded for vGPUs missing from the host" in err and "vgpuhost reconcile" in err
    assert "state store" not in err
    assert audit(host) == before and vf_type(host, VF4) == vf_type(host, VF5) == "0"
    assert records(host) == {VF4: ("manual", "L40S-24Q"), VF5: ("manual", "L40S-24Q")}


def test_a_pinned_vf_of_a_missing_record_is_refused_naming_its_owner_and_the_fix(make_host, capsys):
    host = lost_after_reboot(make_host, capsys)
    before = audit(host)
    store = StateStore(host.state_dir)
    try:
        for owner in (DOM2, "manual"):         # another owner, and the record's own owner
            with pytest.raises(RefusedError) as e:
                vgpu.create(host, store, profile="L40S-4Q", vf=PciAddress.parse(VF4), owner=owner)
            assert "is recorded for L40S-4Q of owner manual, missing from the host" in e.value.message
            assert f"vgpuhost vgpu remove {VF4} --owner manual" in e.value.hint
            assert "vgpuhost reconcile" in e.value.hint
    finally:
        store.close()
    assert audit(host) == before and vf_type(host, VF4) == "0"
    assert records(host) == {VF4: ("manual", "L40S-4Q")}
    # a domain whose XML names that VF: the hook refuses it as held by the record's owner, nothing written
    code, err = start(host, "vmB", vf_domain("vmB", DOM2, VF4))
    assert code != 0 and f"vGPU {VF4} is held by" in err
    assert vf_type(host, VF4) == "0" and records(host) == {VF4: ("manual", "L40S-4Q")}


def test_an_mdev_uuid_a_missing_record_holds_is_refused_with_a_refused_audit_row(make_host, capsys):
    host = make_host("a40-mdev")
    assert cli(capsys, host, "vgpu", "create", "--profile", "A40-4Q", "--uuid", MDEV, "--owner", DOM)[0] == 0
    assert reboot(host)["vgpus_lost"] == [MDEV]
    before = audit(host)
    base = ("vgpu", "create", "--profile", "A40-4Q", "--uuid", MDEV)
    code_dry, _, dry = cli(capsys, host, *base, "--dry-run")
    code, _, err = cli(capsys, host, *base)
    assert code_dry == code == 2 and dry == err and err.count("\n") == 1
    assert f"vGPU {MDEV} is recorded for A40-4Q of owner {DOM}, missing from the host" in err
    assert "vgpuhost reconcile" in err and f"vgpu remove {MDEV} --owner {DOM}" in err
    assert not (host.mdev_devices / MDEV).exists()
    assert records(host) == {MDEV: (DOM, "A40-4Q")}
    new = audit(host)[len(before):]
    assert [(p, res) for p, _, res in new] == [("(placement)", "refused")]      # no write, one refusal row


def test_a_record_made_meanwhile_undoes_the_device_and_is_no_damaged_store(make_host, capsys, monkeypatch):
    """The record appears between the check under the lock and the insert (another process that did not
    take the GPU lock): the new device is removed again, the other record kept, one refusal line."""
    host = make_host("l40s-vendor-vfio")
    real = vgpu._do_create

    def racing(ex, inv, recs, backend, d, vid, *args, **kwargs):
        real(ex, inv, recs, backend, d, vid, *args, **kwargs)
        other = StateStore(host.state_dir)
        try:
            with other.transaction() as conn:
                put_vgpu(conn, VgpuRecord(vid, backend, str(d.gpu), str(d.parent), d.type_id, "L40S-4Q", DOM2,
                                          None, None, False, utcnow()))
        finally:
            other.close()
    monkeypatch.setattr(vgpu, "_do_create", racing)
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-4Q", "--gpu", GPU)
    assert code == 2 and err.count("\n") == 1, err
    assert f"vGPU {VF4} is recorded for L40S-4Q of owner {DOM2}" in err and "removed again" in err
    assert "state store" not in err and "backup" not in err
    assert vf_type(host, VF4) == "0"                             # the device was undone
    assert records(host) == {VF4: (DOM2, "L40S-4Q")}             # the other record untouched
    writes = writes_to(audit(host), VF4)
    assert writes[0][1] == "ok" and writes[0][0] != "0" and writes[-1] == ("0", "ok")
    store = StateStore(host.state_dir, create=False)
    try:
        assert not store.journal_entries(open_only=True)
    finally:
        store.close()


def test_put_vgpu_raises_a_refusal_and_the_store_keeps_its_record(tmp_path):
    store = StateStore(tmp_path)
    rec = VgpuRecord(VF4, "vendor-vfio", GPU, VF4, "1150", "L40S-4Q", "manual", None, None, False, utcnow())
    with store.transaction() as conn:
        put_vgpu(conn, rec)
    with pytest.raises(state.VgpuRecordTaken) as e:
        with store.transaction() as conn:
            put_vgpu(conn, VgpuRecord(VF4, "vendor-vfio", GPU, VF4, "1150", "L40S-4Q", DOM, None, None, False,
                                      utcnow()))
    assert isinstance(e.value, RefusedError) and e.value.vgpu_id == VF4
    assert [(r.id, r.owner) for r in store.vgpu_records()] == [(VF4, "manual")]
    # any other constraint refusal is worded as a refused write, never as a damaged store to restore
    text = store_error("state.db", sqlite3.IntegrityError("UNIQUE constraint failed: tenants.name")).one_line()
    assert "refused a write" in text and "not damaged" in text and "backup" not in text and "unusable" not in text


def test_sriov_mdev_create_after_a_reboot_leaves_the_missing_records_vf_for_reconcile(make_host, capsys):
    """An mdev on an SR-IOV VF (one vGPU a VF): a new vGPU takes another VF, so reconcile can make the
    missing one again on its own parent (before: the new one took that VF and reconcile failed ENOSPC)."""
    host = make_host("a100-sriov-mdev")
    gpu = "0000:41:00.0"
    assert cli(capsys, host, "vgpu", "create", "--profile", "A100-4C", "--gpu", gpu, "--uuid", MDEV)[0] == 0
    store = StateStore(host.state_dir, create=False)
    parent = store.vgpu_records(vgpu_id=MDEV)[0].parent
    store.close()
    assert reboot(host)["vgpus_lost"] == [MDEV]
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A100-4C", "--gpu", gpu, "--owner", DOM)
    assert code == 0, err
    store = StateStore(host.state_dir, create=False)
    try:
        new = [r for r in store.vgpu_records() if r.owner == DOM]
        assert len(new) == 1 and new[0].parent != parent
    finally:
        store.close()
    assert cli(capsys, host, "reconcile")[0] == 0
    assert (host.mdev_devices / MDEV).exists() and (host.mdev_devices / new[0].id).exists()
    assert records(host) == {MDEV: ("manual", "A100-4C"), new[0].id: (DOM, "A100-4C")}
