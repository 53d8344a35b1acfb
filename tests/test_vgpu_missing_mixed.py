"""A missing record on a GPU in mixed-size mode (trial 8 retest R4, R5, R6).

N2 keeps a missing record's share of its GPU for ``vgpuhost reconcile``.  In mixed-size mode that share is a
placement id of the record's size, as if the vGPU were present (R4: a new vGPU took its slot and the
boot ``reconcile`` failed ENOSPC); the GPU's mode is the one NVML reports, not guessed from the sizes
present (R6: two missing records and nothing present read as equal-size mode, and ``types`` disagreed);
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
    assert _types_avail(capsys, host, A1)["L40S-24Q"] == 1
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-24Q", "--gpu", A1)
    assert code == 0, err
    before, recs = audit(host), records(host)
    assert _types_avail(capsys, host, A1).get("L40S-12Q", 0) == 0
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


def test_r6_two_missing_records_on_a_mixed_size_gpu_types_capacity_and_placement_agree(make_host, capsys):
    """/tmp/r8/mix2m: both VFs reset, the mode still on: the GPU is read as mixed-size (NVML), not equal-size
    from the sizes present (none): types, capacity and placement agree on a 24Q (1) and a 48Q (0, the line
    naming both records and the mode); the 24Q is made and reconcile re-creates both, in sync."""
    host, (v8, v4) = _l40s_mixed(make_host, capsys)
    for vf in (v8, v4):
        _reset_vf(host, vf)
    avail = _types_avail(capsys, host, A1)
    assert (avail["L40S-24Q"], avail["L40S-48Q"]) == (1, 0), avail
    assert _capacity(capsys, host, "L40S-24Q", A1) == 1 and _capacity(capsys, host, "L40S-48Q", A1) == 0
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-48Q", "--gpu", A1)
    assert code == 2 and f"vGPUs {v8} (L40S-8Q, owner manual), {v4} (L40S-4Q, owner manual) are recorded here but missing from the host" in err, err
    assert "equal-size" not in err and "in mixed-size mode each keeps its placement id" in err, err
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "L40S-24Q", "--gpu", A1)
    assert code == 0, err
    assert _types_avail(capsys, host, A1).get("L40S-24Q", 0) == 0
    code, out, err = cli(capsys, host, "reconcile")
    assert code == 0 and f"re-created: {v8}" in out and f"re-created: {v4}" in out and "in sync" in out, out + err
    assert vf_type(host, v8) != "0" and vf_type(host, v4) != "0"
