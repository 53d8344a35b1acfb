"""A missing record on a GPU in mixed-size mode (trial 8 retest R4, R5, R6).

N2 keeps a missing record's share of its GPU for ``vgpuhost reconcile``.  In mixed-size mode that share is a
placement id of the record's size, as if the vGPU were present (R4: a new vGPU took its slot and the
boot ``reconcile`` failed ENOSPC); the GPU's mode is the one NVML reports, not guessed from the sizes
present (R6: two missing records and nothing present read as equal-size mode, and ``capacity`` disagreed with placement);
after a reboot (mixed-size mode is lost) ``reconcile`` turns the mode on before re-creating records of two
sizes on a GPU holding no vGPU (R5: it re-created one in equal-size mode and then the mode was locked).
Each test reads back the simulated tree, the store and the CLI's exit code and line.
"""

from __future__ import annotations

import json
import re

from vgpuhost.io.state import StateStore
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.sim.reboot import reboot

from test_create_recorded_vf import audit, cli, records, vf_type

A1 = "0000:a1:00.0"
A40 = "0000:81:00.0"


def _mode(host, gpu):
    from vgpuhost.io.backends import open_backend
    return bool(open_backend(host).heterogeneous_mode(gpu))


def _l40s_mixed(make_host, capsys):
    """l40s-vendor-vfio, a1 in mixed-size mode, L40S-8Q then L40S-4Q on it (manual): their VFs."""
    host = make_host("l40s-vendor-vfio")
    assert cli(capsys, host, "vgpu", "mode", "--gpu", A1, "--mixed-size", "on")[0] == 0
    made = []
    for p in ("L40S-8Q", "L40S-4Q"):
        code, out, err = cli(capsys, host, "vgpu", "create", "--profile", p, "--gpu", A1)
        assert code == 0, err
        made.append(next(i for i in records(host) if i not in made))
    return host, made


def _reset_vf(host, vf):
    """The VF's vGPU goes behind vgpuhost (a reset): its record stays, its device is missing."""
    SimKernel(host).write(host.pci_device(vf) / "nvidia" / "current_vgpu_type", "0\n")
    assert vf_type(host, vf) == "0"


def _types_avail(capsys, host, gpu) -> dict:
    """``{type name: AVAIL}`` of ``vgpuhost --json types --gpu``."""
    code, out, err = cli(capsys, host, "--json", "types", "--gpu", gpu)
    assert code == 0, err
    return {e["name"]: e["available_instances"] for e in json.loads(out)["types"]}


def _capacity(capsys, host, profile, gpu) -> int:
    """What ``vgpuhost --json capacity --profile`` says is free on ``gpu``."""
    code, out, err = cli(capsys, host, "--json", "capacity", "--profile", profile)
    assert code == 0, err
    doc = json.loads(out)
    rows = [p["by_gpu"] for p in doc["profiles"] if p["profile"] == profile]
    assert len(rows) == 1, out
    return rows[0].get(gpu, 0)


HELD = "is recorded here but missing from the host"


def test_r4_vendor_vfio_a_new_vgpu_cannot_take_the_missing_records_placement_id(make_host, capsys):
    """The retest's repro (/tmp/r8/mixm): a1 mixed-size, 8Q + 4Q, the 8Q's VF reset behind vgpuhost; a 24Q
    fits beside the record, then a 12Q does not (before: placed, and reconcile failed ENOSPC); reconcile
    re-creates the record, in sync."""
    host, (v8, v4) = _l40s_mixed(make_host, capsys)
    _reset_vf(host, v8)
    assert _capacity(capsys, host, "L40S-24Q", A1) == 1
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-24Q", "--gpu", A1)
    assert code == 0, err
    before, recs = audit(host), records(host)
    assert _capacity(capsys, host, "L40S-12Q", A1) == 0
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-12Q", "--gpu", A1)
    assert code == 2 and err.count("\n") == 1, err
    assert f"vGPU {v8} (L40S-8Q, owner manual) {HELD}" in err and "vgpuhost reconcile" in err, err
    assert "in mixed-size mode it keeps its placement id" in err and "equal-size" not in err, err
    assert audit(host) == before and records(host) == recs
    code, out, err = cli(capsys, host, "reconcile")
    assert code == 0 and f"re-created: {v8}" in out and "in sync" in out, out + err
    assert vf_type(host, v8) != "0" and vf_type(host, v4) != "0"


def test_r4_wording_names_the_record_and_the_mixed_size_mode(make_host, capsys):
    """Before the 24Q: a 48Q on a1 is refused naming the record, not 'equal-size mode admits only that size'."""
    host, (v8, _v4) = _l40s_mixed(make_host, capsys)
    _reset_vf(host, v8)
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-48Q", "--gpu", A1)
    assert code == 2 and f"vGPU {v8} (L40S-8Q, owner manual) {HELD}" in err, err
    assert "equal-size" not in err and "mixed-size mode" in err, err


def test_r4_classic_mdev_a_new_vgpu_cannot_take_the_missing_records_placement_id(make_host, capsys):
    """/tmp/r8/a40mix: a40-mdev, 81:00.0 mixed-size, A40-8Q + A40-4Q, the 8Q's mdev removed behind vgpuhost:
    a 24Q fits, a 12Q then is refused naming the record; reconcile re-creates it, in sync."""
    host = make_host("a40-mdev")
    assert cli(capsys, host, "vgpu", "mode", "--gpu", A40, "--mixed-size", "on")[0] == 0
    made = []
    for p in ("A40-8Q", "A40-4Q"):
        assert cli(capsys, host, "vgpu", "create", "--profile", p, "--gpu", A40)[0] == 0
        made.append(next(i for i in records(host) if i not in made))
    v8 = made[0]
    SimKernel(host).write(host.mdev_devices / v8 / "remove", "1")
    assert not (host.mdev_devices / v8).exists()
    assert cli(capsys, host, "vgpu", "create", "--profile", "A40-24Q", "--gpu", A40)[0] == 0
    recs = records(host)
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-12Q", "--gpu", A40)
    assert code == 2 and f"vGPU {v8} (A40-8Q, owner manual) {HELD}" in err, err
    assert records(host) == recs
    code, out, err = cli(capsys, host, "reconcile")
    assert code == 0 and f"re-created: {v8}" in out and "in sync" in out, out + err
    assert (host.mdev_devices / v8).exists()


def test_r6_two_missing_records_on_a_mixed_size_gpu_capacity_and_placement_agree(make_host, capsys):
    """/tmp/r8/mix2m: both VFs reset, the mode still on: the GPU is read as mixed-size (NVML), not equal-size
    from the sizes present (none): capacity and placement agree on a 24Q (1) and a 48Q (0, the line naming
    both records and the mode); the 24Q is made and reconcile re-creates both, in sync.  ``types`` shows the
    driver's counts (the records' room is free there until reconcile re-creates them: docs/guide/vgpus.md)
    and reads no store (tests/test_cli_lean.py)."""
    host, (v8, v4) = _l40s_mixed(make_host, capsys)
    for vf in (v8, v4):
        _reset_vf(host, vf)
    assert _capacity(capsys, host, "L40S-24Q", A1) == 1 and _capacity(capsys, host, "L40S-48Q", A1) == 0
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-48Q", "--gpu", A1)
    assert code == 2 and f"vGPUs {v8} (L40S-8Q, owner manual), {v4} (L40S-4Q, owner manual) are recorded here but missing from the host" in err, err
    assert "equal-size" not in err and "in mixed-size mode each keeps its placement id" in err, err
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-24Q", "--gpu", A1)
    assert code == 0, err
    assert _capacity(capsys, host, "L40S-24Q", A1) == 0
    code, out, err = cli(capsys, host, "reconcile")
    assert code == 0 and f"re-created: {v8}" in out and f"re-created: {v4}" in out and "in sync" in out, out + err
    assert vf_type(host, v8) != "0" and vf_type(host, v4) != "0"


def _audit_paths(host) -> list:
    return [(p, v) for p, v, _res in audit(host)]


def test_r5_reboot_reconcile_turns_mixed_size_mode_on_first_and_ends_in_sync(make_host, capsys):
    """/tmp/r8/mixn: 8Q + 4Q on a mixed-size a1, reboot (the mode is lost): reconcile --check says it would
    turn the mode on, changes nothing; reconcile turns it on (audited, as 'vgpu mode' does) and re-creates
    both (before: the first re-created in equal-size mode, the second ENOSPC, the mode locked)."""
    host, (v8, v4) = _l40s_mixed(make_host, capsys)
    assert sorted(reboot(host)["vgpus_lost"]) == sorted([v8, v4]) and not _mode(host, A1)
    before = _audit_paths(host)
    code, out, err = cli(capsys, host, "reconcile", "--check")
    assert code == 1 and f"mixed-size mode: {A1} (would turn mixed-size mode on first" in out, out + err
    assert _audit_paths(host) == before and not _mode(host, A1)
    code, out, err = cli(capsys, host, "reconcile")
    assert code == 0 and f"turned mixed-size mode on: {A1}" in out, out + err
    assert f"re-created: {v8}" in out and f"re-created: {v4}" in out and "in sync" in out, out
    assert _mode(host, A1) and vf_type(host, v8) != "0" and vf_type(host, v4) != "0"
    assert (f"nvml:{A1}/vgpu-heterogeneous-mode", "on") in _audit_paths(host)[len(before):]
    code, out, err = cli(capsys, host, "--json", "reconcile")
    assert code == 0 and json.loads(out)["in_sync"] and json.loads(out)["mixed_size_on"] == []


def test_r5_reconcile_re_creates_none_where_the_mode_cannot_change_and_never_locks_it(make_host, capsys):
    """After the reboot a vGPU made behind vgpuhost sits on a1 (the mode cannot change): reconcile re-creates
    neither record there (one re-created in equal-size mode would lock the mode) and says in one line per
    record what to run; once that vGPU is gone the mode turns on and reconcile ends in sync."""
    host, (v8, v4) = _l40s_mixed(make_host, capsys)
    reboot(host)
    other = "0000:a1:00.6"
    kernel = SimKernel(host)
    kernel.write(host.pci_device(other) / "nvidia" / "current_vgpu_type", "1150\n")      # L40S-4Q, foreign
    code, out, err = cli(capsys, host, "reconcile")
    assert code == 1 and "NOT in sync" in out, out + err
    failed = [line for line in out.splitlines() if line.startswith("FAILED: ")]
    assert len(failed) == 2 and all("need mixed-size mode" in f and
                                    f"run 'vgpuhost vgpu mode --gpu {A1} --mixed-size on', then 'vgpuhost reconcile'"
                                    in f for f in failed), out
    assert vf_type(host, v8) == "0" and vf_type(host, v4) == "0" and not _mode(host, A1)
    kernel.write(host.pci_device(other) / "nvidia" / "current_vgpu_type", "0\n")
    assert cli(capsys, host, "vgpu", "mode", "--gpu", A1, "--mixed-size", "on")[0] == 0 and _mode(host, A1)
    code, out, err = cli(capsys, host, "reconcile")
    assert code == 0 and "in sync" in out and "turned mixed-size mode on" not in out, out + err
    assert vf_type(host, v8) != "0" and vf_type(host, v4) != "0"
