"""The destination's ``migrate begin`` admits an incoming domain as its ``prepare begin`` will: the XML's
tenant claim before placement, a killed start's leftovers ended first, a VF chosen among those admission
accepts, and a missing mdev record counted as create, ``types`` and ``capacity`` count it.

Each case drives the hook as libvirt does on the destination (tests/test_migrate.py's ``call``) and reads
back the exit code, the one stderr line, the reservations and allocations in the state store, and the
simulated tree.
"""

from __future__ import annotations

import signal
import subprocess

from vgpuhost.io.hostroot import HostRoot
from vgpuhost.io.state import StateStore

from test_migrate import (DOM, MDEV, A, _child, a40, call, cli, mdev_domain, mdevs, reservations, store)
from test_migrate_checks import refused_at_migrate_begin, refused_at_prepare_begin

HELD = "aaaaaaaa-2222-4333-8444-0000000000f1"


# ---------------------------------------------------------------------------
# the XML's tenant claim is weighed before placement (final8 F2)

def test_a_forged_tenant_claim_is_named_at_migrate_begin_though_the_domain_holds_a_vgpu_here(make_host, capsys):
    """The domain is bound to t1 and holds a vGPU on the destination's only GPU; its incoming XML claims
    t2.  Placement alone would refuse it for "one vGPU per VM per GPU"; prepare begin names the forged
    claim, and so does migrate begin now (the claim is weighed first)."""
    dest = a40(make_host)
    assert cli(capsys, dest, "tenant", "add", "t1", "--vgpus", "0:2")[0] == 0
    assert cli(capsys, dest, "tenant", "add", "t2", "--vgpus", "0:2")[0] == 0
    assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", DOM, "t1")[0] == 0
    assert cli(capsys, dest, "vgpu", "create", "--profile", "A40-8Q", "--uuid", HELD, "--owner", DOM)[0] == 0
    held = mdevs(dest)
    xml = mdev_domain(tenant="t2")
    start = refused_at_prepare_begin(dest, xml)
    assert "its metadata names tenant 't2', but it is bound to tenant 't1'" in start, start
    why, value = refused_at_migrate_begin(dest, xml)
    assert "its metadata names tenant 't2', but it is bound to tenant 't1'" in why, why
    assert "one vGPU per VM per GPU" not in why and "one vGPU per VM per GPU" not in value, why
    assert why == "tenant t1: " + start, (why, start)           # prepare begin's line and fix, word for word
    assert mdevs(dest) == held and reservations(dest) == []
    # its own tenant asked: the claim passes, and placement's refusal is the one left (it holds the GPU here)
    why, _ = refused_at_migrate_begin(dest, mdev_domain(tenant="t1"))
    assert "one vGPU per VM per GPU" in why, why


# ---------------------------------------------------------------------------
# a killed start's leftovers are ended first, as prepare begin ends them

def test_migrate_begin_ends_a_killed_starts_leftovers_first_as_prepare_begin_does(make_host, capsys, tmp_path):
    """The domain's start here was killed right after its A40-48Q (the whole GPU) was written: the mdev is
    in the tree with no record (its journal entry open) and its allocation row is left.  Its retried
    prepare begin rolls the create back, drops the row and starts; migrate begin did neither, so the
    orphan took the GPU and the migration was refused.  Now it ends them as prepare begin does, reserves
    the vGPU under its own UUID (the XML unchanged) and its prepare begin makes it."""
    from vgpuhost.sim import kernel as sim_kernel
    dest = a40(make_host)
    assert cli(capsys, dest, "tenant", "add", "t1", "--vgpus", "0:2")[0] == 0
    assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", DOM, "t1")[0] == 0
    xml = mdev_domain(profile="A40-48Q")
    env = {sim_kernel.KILL_AT_ENV: "1", sim_kernel.KILL_WHEN_ENV: "after"}
    assert _child(lambda: call(dest, "vm", "prepare", "begin", xml)[0], env) == -signal.SIGKILL
    s = store(dest)
    assert mdevs(dest) == {MDEV: "0000:41:00.0"} and s.vgpu_records() == []
    assert [r[0] for r in s.allocation_rows()] == [MDEV] and len(s.journal_entries(open_only=True)) == 1
    # the same host state: its prepare begin ends the leftovers and starts
    copy = HostRoot(tmp_path / "copy")
    subprocess.run(["cp", "-a", str(dest.root), str(copy.root)], check=True, timeout=60)
    assert call(copy, "vm", "prepare", "begin", xml)[0] == 0 and mdevs(copy) == {MDEV: "0000:41:00.0"}
    # a migrate begin refused after it ended them (here for a forged tenant) says so, as prepare begin does
    forged = HostRoot(tmp_path / "forged")
    subprocess.run(["cp", "-a", str(dest.root), str(forged.root)], check=True, timeout=60)
    code, out, err = call(forged, "vm", "migrate", "begin", mdev_domain(profile="A40-48Q", tenant="t9"))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "its metadata names tenant 't9'" in err and "before this migration, vgpuhost ended journal #1" in err, err
    assert mdevs(forged) == {} and store(forged).allocation_rows() == [] and reservations(forged) == []
    # migrate begin: ended first, then placed, admitted and reserved as the XML names it
    code, moved, err = call(dest, "vm", "migrate", "begin", xml)
    assert (code, moved, err) == (0, "", "")
    s = store(dest)
    assert mdevs(dest) == {} and s.journal_entries(open_only=True) == [] and s.allocation_rows() == []
    assert [(r[0], r[1], r[3], r[8]) for r in reservations(dest)] == [(MDEV, DOM, "0000:41:00.0", "t1")]
    results = [(r.path, r.result) for r in s.audit_rows()]
    assert ("(admission)", "interrupted") in results and results[-1] == ("(reservation)", "reserved")
    assert call(dest, "vm", "prepare", "begin", xml)[0] == 0
    assert mdevs(dest) == {MDEV: "0000:41:00.0"} and reservations(dest) == []
    assert [(r[0], r[2]) for r in store(dest).allocation_rows()] == [(MDEV, "t1")]


# ---------------------------------------------------------------------------
# vendor VFIO under tenancy: the VF is chosen among the GPUs admission accepts

def test_an_incoming_vf_moves_to_a_gpu_its_tenants_isolation_accepts(make_host, capsys):
    """Tenant x is exclusive; tenant s holds a vGPU on the first L40S.  The incoming XML names a free VF of
    that L40S: kept there, admission refused the migration (isolation), though a VF of the second L40S
    would be admitted.  Now the VF is chosen among the GPUs admission accepts for it (prepare begin's
    narrowing, ops/admitting.Admitting.allowed_gpus): moved to the second L40S, reserved and made there."""
    from vgpuhost.libvirt.domxml import parse_domain
    from test_migrate import OTHER, vf_domain, vf_type
    dest = make_host("l40s-vendor-vfio")
    assert cli(capsys, dest, "tenant", "add", "x", "--isolation", "exclusive")[0] == 0
    assert cli(capsys, dest, "tenant", "add", "s")[0] == 0
    assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", DOM, "x")[0] == 0
    assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", OTHER, "s")[0] == 0
    assert call(dest, "vm2", "prepare", "begin", vf_domain("0000:21:00.4", "L40S-4Q", "vm2", OTHER))[0] == 0
    xml = vf_domain("0000:21:00.5", "L40S-4Q")
    # as the XML names it, prepare begin refuses it on the first L40S (tenant s is there)
    assert "under its isolation" in refused_at_prepare_begin(dest, xml)
    code, moved, err = call(dest, "vm", "migrate", "begin", xml)
    assert code == 0 and err == "", err
    (vf,) = [v.vf for v in parse_domain(moved).metadata.vgpus]
    assert str(vf).startswith("0000:a1:"), moved                        # a VF of the second L40S
    assert [(r[0], r[1], r[3], r[8]) for r in reservations(dest)] == [(str(vf), DOM, "0000:a1:00.0", "x")]
    assert vf_type(dest, "0000:21:00.5") == "0"
    # migrate check --incoming answers the same (its request names the same VF)
    from vgpuhost.ops.migrate import check_incoming
    from vgpuhost.policy.migration import Device, Request
    doc = check_incoming(dest, Request("vm", DOM, "first-fit", None, "x", None, "580.65.05",
                                       (Device("vf", "0000:21:00.5", "L40S-4Q", "0000:21:00.0"),)))
    assert doc["ok"] and [d["gpu"] for d in doc["devices"]] == ["0000:a1:00.0"], doc
    for op in ("prepare", "start", "started"):
        assert call(dest, "vm", op, "begin", moved)[0] == 0
    assert vf_type(dest, str(vf)) != "0" and reservations(dest) == []
    assert sorted((r[0], r[2], r[3]) for r in store(dest).allocation_rows()) == \
        [("0000:21:00.4", "s", "0000:21:00.0"), (str(vf), "x", "0000:a1:00.0")]
