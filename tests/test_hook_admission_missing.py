"""The qemu hook's admission counts a missing mdev record as ``vgpu create`` and ``capacity`` count it.

A record whose vGPU is missing from its GPU (:func:`vgpuhost.policy.offers.missing_records`: an mdev
removed behind vgpuhost, lost at a reboot) holds its share of the GPU for ``vgpuhost reconcile``; in
mixed-size mode that share is a placement id of its size (trial 8 retest R4).  ``vgpu create`` and
``capacity`` counted the id on classic-mdev GPUs; the hook's admission (``prepare begin``, and the
destination's ``migrate begin``) counted the framebuffer only, so it admitted a vGPU onto a GPU whose
re-check then refused it, though another GPU had room.  Each case reads back the exit code, the tree,
the allocations and the audit rows.
"""

from __future__ import annotations

from vgpuhost.sim.kernel import SimKernel

from test_hook import GPU_HI, GPU_LO, mixed
from test_migrate import DOM, MDEV, call, cli, mdev_domain, mdevs, reservations, store


def _lo_with_a_missing_8q(make_host, capsys):
    """:func:`test_hook.mixed`'s low A40 in mixed-size mode holding an A40-8Q (missing: its mdev removed
    behind vgpuhost), an A40-4Q and an A40-24Q: a 12Q fits its framebuffer, not its free placement ids;
    the high A40 is empty.  Tenancy in use, the domain bound.  ``(host, the missing record's id)``."""
    host = mixed(make_host)
    assert cli(capsys, host, "vgpu", "mode", "--gpu", str(GPU_LO), "--mixed-size", "on")[0] == 0
    made = []
    for p in ("A40-8Q", "A40-4Q"):
        assert cli(capsys, host, "vgpu", "create", "--profile", p, "--gpu", str(GPU_LO))[0] == 0
        made.append(next(r.id for r in store(host).vgpu_records() if r.id not in made))
    SimKernel(host).write(host.mdev_devices / made[0] / "remove", "1")
    assert cli(capsys, host, "vgpu", "create", "--profile", "A40-24Q", "--gpu", str(GPU_LO))[0] == 0
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-12Q", "--gpu", str(GPU_LO), "--dry-run")
    assert code == 2 and "recorded here but missing from the host" in err, err      # create counts its id
    assert cli(capsys, host, "tenant", "add", "t1")[0] == 0
    assert cli(capsys, host, "--connect", "test:///default", "tenant", "bind", DOM, "t1")[0] == 0
    return host, made[0]


def test_prepare_begin_admits_beside_a_missing_mdev_records_placement_id_as_create_counts_it(make_host, capsys):
    """An unpinned A40-12Q, first-fit: admission placed it on the low A40 (the framebuffer fits), its
    re-check there refused it and the start failed; now admission counts the record's placement id and
    places it on the high A40, where it is made."""
    host, _ = _lo_with_a_missing_8q(make_host, capsys)
    before = mdevs(host)
    code, out, err = call(host, "vm", "prepare", "begin", mdev_domain(profile="A40-12Q"))
    assert code == 0 and err == "", err
    assert mdevs(host) == {**before, MDEV: str(GPU_HI)}
    assert [(r[0], r[2], r[3]) for r in store(host).allocation_rows() if r[1] == DOM] == [(MDEV, "t1", str(GPU_HI))]
    rows = [(r.path, r.result) for r in store(host).audit_rows() if r.operation.startswith("admission vm")]
    assert rows == [("(admission)", "admitted")], rows


def test_prepare_begin_pinned_to_the_gpu_is_refused_by_admission_naming_the_record(make_host, capsys):
    """Pinned to the low A40: refused by admission itself (one line naming the record, one refused row),
    not admitted and then refused by the device layer's re-check ("no longer takes it")."""
    host, missing = _lo_with_a_missing_8q(make_host, capsys)
    before, allocations = mdevs(host), store(host).allocation_rows()
    code, out, err = call(host, "vm", "prepare", "begin", mdev_domain(profile="A40-12Q", gpu=GPU_LO))
    assert code == 2 and err.count("\n") == 1, err
    assert "admission: " in err and f"vGPU {missing} (A40-8Q, owner manual) is recorded here but missing" in err, err
    assert "no longer takes it" not in err, err
    assert mdevs(host) == before and store(host).allocation_rows() == allocations
    rows = [(r.path, r.result) for r in store(host).audit_rows() if r.operation.startswith("admission vm")]
    assert rows == [("(admission)", "refused")], rows


def test_migrate_begin_reserves_beside_a_missing_mdev_records_placement_id(make_host, capsys):
    """The destination's migrate begin counts the id too: the incoming A40-12Q is reserved on the high
    A40 and its prepare begin makes it there."""
    host, _ = _lo_with_a_missing_8q(make_host, capsys)
    xml = mdev_domain(profile="A40-12Q")
    code, moved, err = call(host, "vm", "migrate", "begin", xml)
    assert code == 0 and moved == "" and err == "", err
    assert [(r[0], r[3]) for r in reservations(host)] == [(MDEV, str(GPU_HI))]
    assert call(host, "vm", "prepare", "begin", xml)[0] == 0
    assert mdevs(host)[MDEV] == str(GPU_HI) and reservations(host) == []


def test_a_tenant_allocate_counts_a_missing_mdev_records_placement_id_too(make_host, capsys):
    """The agent's tenant allocate admits with the same inputs (ops/devices.admission_inputs): its A40-12Q
    goes to the high A40, not admitted onto the low one and then refused by create's re-check."""
    from vgpuhost.io.sysfs import Sysfs
    from vgpuhost.observe.inventory import discover
    from vgpuhost.ops.allocate import allocate_admitted
    host, _ = _lo_with_a_missing_8q(make_host, capsys)
    s = store(host)
    out = allocate_admitted(host, s, lambda: discover(Sysfs(host)), owner=DOM, tenant="t1", profile="A40-12Q",
                            actor="test")
    assert out.gpu == str(GPU_HI) and mdevs(host)[out.id] == str(GPU_HI)
    assert [(r[0], r[2], r[3]) for r in s.allocation_rows() if r[1] == DOM] == [(out.id, "t1", str(GPU_HI))]
