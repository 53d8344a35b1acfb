"""A GPU in mixed-size mode offers, places and counts at most the type's mixed-size max (issue 25 item 4).

Mixed-size maxima are often lower than equal-size ones: A40 and L40S 4C 12 -> 8, 8C 6 -> 4, 16C 3 -> 2
(NVIDIA AI Enterprise 5.0 user guide, appendix A); the time-sliced H200X types keep theirs in both
modes (7C 20, 14C 10, 28C 5).  docs/reference/hardware.md#vgpu-types.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.inventory import discover
from vgpuhost.ops import tenancy
from vgpuhost.ops.vgpu import create
from vgpuhost.model.errors import RefusedError
from vgpuhost.policy.config import mode_limits, type_max
from vgpuhost.policy.offers import offers
from vgpuhost.policy.placement import Request, place
from vgpuhost.sim.build import materialise
from vgpuhost.sim.spec import parse_spec

GPU = PciAddress.parse("0000:21:00.0")


def spec(model: str, backend: str, mixed: bool, numvfs: int = 32) -> str:
    vfs = f", sriov_numvfs: {numvfs}" if backend == "vendor-vfio" else ""
    return ("version: 1\nname: mixed\nhost:\n"
            "  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]\n"
            "devices:\n"
            '  - {bdf: "0000:20:01.1", model: amd-root-port}\n'
            f'  - {{bdf: "0000:21:00.0", model: {model}, upstream: "0000:20:01.1", '
            f"vgpu: {{backend: {backend}, mixed_size: {str(mixed).lower()}{vfs}}}}}\n")


@pytest.fixture
def build(tmp_path):
    n = {"i": 0}

    def make(model: str, backend: str, mixed: bool):
        n["i"] += 1
        return materialise(parse_spec(spec(model, backend, mixed)), tmp_path / f"h{n['i']}")
    return make


@pytest.mark.parametrize("name, equal, mixed", [
    ("A40-4C", 12, 8), ("A40-8C", 6, 4), ("A40-16C", 3, 2), ("L40S-4C", 12, 8), ("L40S-8C", 6, 4),
    ("L40S-16C", 3, 2), ("H200X-7C", 20, 20), ("H200X-14C", 10, 10), ("H200X-28C", 5, 5),
])
def test_catalog_keeps_both_maxima(name, equal, mixed):
    device = {"A40": 0x2235, "L40S": 0x26b9, "H200X": 0x2335}[name.split("-")[0]]
    assert (type_max(device, name, False), type_max(device, name, True)) == (equal, mixed)


def test_simulated_mdev_parent_in_mixed_mode_reports_the_mixed_size_max(build):
    """The driver's available_instances follows the mode: the simulator's does too."""
    for mixed, want in ((False, 12), (True, 8)):
        inv = discover(Sysfs(build("A40", "mdev", mixed)))
        [t] = [t for t in inv.vgpu_types if t.name == "A40-4C"]
        assert t.available_instances == want
        assert [o.available for o in offers(inv, [], "A40-4C")] == [want]


def test_vendor_vfio_gpu_in_mixed_mode_offers_and_places_at_most_the_mixed_max(build):
    host = build("L40S", "vendor-vfio", True)
    inv = discover(Sysfs(host))
    mixed = tenancy.mixed_size_of(host, inv)
    assert mixed == {GPU: True}                                  # read back from the simulated NVML
    limits = mode_limits(inv, "L40S-4C", mixed)
    assert limits == {GPU: 8}
    assert [o.available for o in offers(inv, [], "L40S-4C")] == [12]            # framebuffer alone: 48 / 4
    [o] = offers(inv, [], "L40S-4C", (), limits)
    assert o.available == 8
    assert place([o], Request("L40S-4C")).admitted


def test_vgpu_create_refuses_the_ninth_4c_on_a_mixed_size_l40s(build):
    host = build("L40S", "vendor-vfio", True)
    store = StateStore(host.state_dir)
    for i in range(8):
        create(host, store, profile="L40S-4C", owner=f"6695eb01-f6a4-8304-79aa-97f2502e19{i:02d}")
    inv = discover(Sysfs(host))
    assert sum(1 for v in inv.vf_vgpus if v.type_id) == 8
    with pytest.raises(RefusedError):
        create(host, store, profile="L40S-4C", owner="6695eb01-f6a4-8304-79aa-97f2502e1999")
    assert sum(1 for v in discover(Sysfs(host)).vf_vgpus if v.type_id) == 8       # nothing more made
    doc = tenancy.capacity(store, inv, tenancy.mixed_size_of(host, inv))
    [row] = [p for p in doc["profiles"] if p["profile"] == "L40S-4C"]
    assert row["fits"] == 0


def test_equal_size_gpu_keeps_the_equal_size_max(build):
    host = build("L40S", "vendor-vfio", False)
    inv = discover(Sysfs(host))
    limits = mode_limits(inv, "L40S-4C", tenancy.mixed_size_of(host, inv))
    assert limits == {GPU: 12} and [o.available for o in offers(inv, [], "L40S-4C", (), limits)] == [12]


def test_admission_counts_the_mixed_size_max_the_device_layer_counts(build):
    """The hook's admission weighs the GPU's room with the max of its mode: a mixed-size L40S offers 8
    L40S-4C, not the 12 its framebuffer alone would allow (read back from the admission audit row)."""
    from test_hook import domain_xml, pci_hostdev, start
    from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
    host = build("L40S", "vendor-vfio", True)
    store = StateStore(host.state_dir)
    tenancy.add(store, tenancy.Tenant("team"))
    vf = PciAddress.parse("0000:21:00.4")
    meta = Metadata(tenant="team", vgpus=[VgpuRequest("L40S-4C", vf=vf)])
    assert start(host, "mx0", domain_xml("mx0", "6695eb01-f6a4-8304-79aa-97f2502e1900", meta,
                                         [pci_hostdev(vf)])) == (0, "")
    [row] = [r for r in store.audit_rows() if r.path == "(admission)"]
    assert row.result == "admitted" and "(8 L40S-4C free;" in row.value, row.value


def _fill(host, store, n):
    for i in range(n):
        create(host, store, profile="L40S-4C", owner=f"6695eb01-f6a4-8304-79aa-97f2502e17{i:02d}")


def test_types_avail_counts_the_mixed_size_max(build, capsys):
    """`vgpuhost types` AVAIL is what placement will place: 8 L40S-4C on a mixed-size L40S, then 3 after 5,
    not the 12 and 7 the framebuffer alone allows (tester finding F4)."""
    import json
    from vgpuhost.cli.main import main
    host = build("L40S", "vendor-vfio", True)

    def avail():
        assert main(["--root", str(host.root), "--json", "types", "--gpu", str(GPU)]) == 0
        return {e["name"]: e["available_instances"] for e in json.loads(capsys.readouterr().out)["types"]}
    assert avail()["L40S-4C"] == 8
    _fill(host, StateStore(host.state_dir), 5)
    assert avail()["L40S-4C"] == 3
    equal = build("L40S", "vendor-vfio", False)
    assert main(["--root", str(equal.root), "--json", "types"]) == 0
    assert {e["name"]: e["available_instances"] for e in json.loads(capsys.readouterr().out)["types"]}["L40S-4C"] == 12


def test_refusal_hint_names_no_type_the_mode_keeps_out(build):
    """Full at 8 L40S-4C: the refusal's "types that still fit" does not offer L40S-4C again (F4)."""
    host = build("L40S", "vendor-vfio", True)
    store = StateStore(host.state_dir)
    _fill(host, store, 8)
    with pytest.raises(RefusedError) as e:
        create(host, store, profile="L40S-4C", owner="6695eb01-f6a4-8304-79aa-97f2502e1999")
    assert "L40S-4C" not in (e.value.hint or ""), e.value.hint
    # 16 GiB are left, but in 2 GiB gaps between the 4C placements (ids 0 6 ... 42, size 4): no 8C placement
    # (ids 0 12 24 36, size 8) is free, so fragmentation keeps 8C out; 1 GiB types still fit
    assert "L40S-8C" not in (e.value.hint or ""), e.value.hint
    assert "L40S-1Q" in (e.value.hint or ""), e.value.hint


# --- placement ids (issue 30 item 2) --------------------------------------------------------------

def _placements(host):
    """``{vGPU id: placement id}`` read back from the simulated tree (``nvidia/placement_id``)."""
    from vgpuhost.io.vgpudev import read_placement
    fs = Sysfs(host)
    inv = discover(fs)
    out = {}
    for g in inv.gpus:
        ix = inv.on_gpu(g.address)
        for vid in (ix.vgpus if ix is not None else []):
            parent = PciAddress.parse(vid) if g.vgpu_backend == "vendor-vfio" else g.address
            out[vid] = read_placement(fs, g.vgpu_backend, parent, vid)
    return out


def test_model_grid_ids_and_best_fit():
    from vgpuhost.model import mixedsize
    assert mixedsize.placement_ids(24, 6, 4) == [0, 6, 12, 18]          # NVIDIA's example: L4-6Q
    assert mixedsize.placement_ids(48, 8, 4) == [0, 12, 24, 36]
    assert mixedsize.free_ids(48, 8, 4, [(0, 16)]) == [24, 36]
    # best fit: the 4 GiB vGPU goes in the smallest gap (8 units left after a 16 at 0 and an 8 at 24 and 36:
    # ids 18 is not an id of 4C; 4C ids are 0 6 12 ... 42: 18 overlaps nothing but sits in the gap [16, 24))
    assert mixedsize.best_id(48, 4, 8, [(0, 16), (24, 8), (36, 8)]) == 18
    assert mixedsize.fits_count(48, 4, 8, [(0, 4)] * 1, 1) == 7


@pytest.mark.parametrize("board, backend", [("A40", "mdev"), ("L40S", "vendor-vfio")])
def test_mixed_sizes_take_valid_placement_ids_read_back_from_the_tree(build, board, backend):
    host = build(board, backend, True)
    store = StateStore(host.state_dir)
    made = [create(host, store, profile=f"{board}-{p}", owner=f"6695eb01-f6a4-8304-79aa-97f2502e18{i:02d}")
            for i, p in enumerate(["16Q", "8Q", "4Q"])]
    got = _placements(host)
    assert len(got) == 3 and None not in got.values(), got
    # 16Q at 0 (units 0-16); 8Q at 24 (ids 0 12 24 36: 24 and 36 free, equal gaps, the lower); the 4Q in
    # the smallest gap, 16-24, at id 18 (best fit), which keeps 32-48 whole for another 8Q at 36
    assert sorted(got.values()) == [0, 18, 24], got
    if backend == "vendor-vfio":
        # the first goes where the driver puts it (0); then vgpuhost chose each id (best fit) and wrote it
        # to the VF before the type: audited writes
        writes = [r.value for r in store.audit_rows() if r.path.endswith("/nvidia/placement_id")]
        assert writes == ["24", "18"], writes
    inv = discover(Sysfs(host))
    # the 16Q at 0 and 8Q at 24 leave no 16Q id (0, 24) free: fragmentation, though 20 GiB are free
    assert len(made) == 3
    assert [o.available for o in offers(inv, [], f"{board}-8Q")][0] >= 1
    assert all(t.available_instances == 0 for t in inv.vgpu_types if t.name == f"{board}-16Q")
    assert [o.available for o in offers(inv, [], f"{board}-16Q")] == [0]


def test_a_written_placement_id_is_honoured_and_a_taken_one_refused(build):
    from vgpuhost.io.vgpudev import placement_path
    from vgpuhost.model.errors import SysfsError
    host = build("L40S", "vendor-vfio", True)
    fs = Sysfs(host)
    inv = discover(fs)
    vfs = sorted({t.parent for t in inv.vgpu_types})
    tid = next(t.type_id for t in inv.vgpu_types if t.name == "L40S-8Q")
    fs.write(placement_path(host, "vendor-vfio", vfs[0], str(vfs[0])), "36")
    fs.write(host.s.pci_device(vfs[0]) + "/nvidia/current_vgpu_type", tid)
    assert _placements(host) == {str(vfs[0]): 36}
    fs.write(placement_path(host, "vendor-vfio", vfs[1], str(vfs[1])), "36")
    with pytest.raises(SysfsError):
        fs.write(host.s.pci_device(vfs[1]) + "/nvidia/current_vgpu_type", tid)


def test_vendor_vfio_counts_what_still_fits_at_free_placement_ids(build, capsys):
    """On a vendor-VFIO GPU every free VF lists a type while one placement is free: placement, `types` and
    admission count the free placement ids (fragmentation), read back from the VFs' nvidia/placement_id."""
    import json
    from vgpuhost.cli.main import main
    from vgpuhost.ops.vgpu import mode_limits
    host = build("L40S", "vendor-vfio", True)
    store = StateStore(host.state_dir)
    for i, p in enumerate(["L40S-16Q", "L40S-8Q", "L40S-4Q"]):       # at 0, 24 and 18 (see above)
        create(host, store, profile=p, owner=f"6695eb01-f6a4-8304-79aa-97f2502e19{i:02d}")
    inv = discover(Sysfs(host))
    # 8Q: ids 0 12 24 36, only 36 free -> one more; 4Q: 36 and 42 free -> two more, not the 8 - 1 the max allows
    assert mode_limits(host, inv, "L40S-8Q") == {GPU: 2} and mode_limits(host, inv, "L40S-4Q") == {GPU: 3}
    assert main(["--root", str(host.root), "--json", "types"]) == 0
    avail = {e["name"]: e["available_instances"] for e in json.loads(capsys.readouterr().out)["types"]}
    assert (avail["L40S-8Q"], avail["L40S-4Q"]) == (1, 2)
    create(host, store, profile="L40S-8Q", owner="6695eb01-f6a4-8304-79aa-97f2502e1990")
    assert 36 in _placements(host).values()
    with pytest.raises(RefusedError):
        create(host, store, profile="L40S-8Q", owner="6695eb01-f6a4-8304-79aa-97f2502e1991")


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 48]), max_size=40))
def test_best_fit_placements_never_overlap_nor_pass_a_types_mixed_max(sizes):
    """Property: vGPUs placed one after another at best_id on an A40-like grid (48 units, maxima the
    equal-size max rounded down to a power of two) never overlap, sit at one of their type's ids, and
    fits_count agrees with what best_id then manages to place."""
    from vgpuhost.model import mixedsize

    def mx(size):
        equal = 48 // size
        return 1 << (equal.bit_length() - 1)

    taken, count = [], {}
    for size in sizes:
        free_before = mixedsize.fits_count(48, size, mx(size), taken, count.get(size, 0))
        pid = mixedsize.best_id(48, size, mx(size), taken) if count.get(size, 0) < mx(size) else None
        assert (pid is not None) == (free_before > 0)
        if pid is None:
            continue
        assert pid in mixedsize.placement_ids(48, size, mx(size))
        assert all(pid + size <= s or s + z <= pid for s, z in taken)
        taken.append((pid, size))
        count[size] = count.get(size, 0) + 1
        assert count[size] <= mx(size)
    assert sum(z for _, z in taken) <= 48


def test_capacity_on_a_fragmented_vendor_vfio_gpu_counts_free_placement_ids(build, capsys):
    import json
    from vgpuhost.cli.main import main
    host = build("L40S", "vendor-vfio", True)
    store = StateStore(host.state_dir)
    for i, p in enumerate(["L40S-16Q", "L40S-8Q", "L40S-4Q"]):
        create(host, store, profile=p, owner=f"6695eb01-f6a4-8304-79aa-97f2502e1a{i:02d}")
    assert main(["--root", str(host.root), "--json", "capacity"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fits = {p["profile"]: p["fits"] for p in doc["profiles"]}
    assert (fits["L40S-8Q"], fits["L40S-4Q"]) == (1, 2)
    assert fits.get("L40S-16Q", 0) == 0


def test_a_refusal_on_a_mixed_size_gpu_names_the_placement_ids_not_equal_size_mode(build):
    """A GPU holding vGPUs of two sizes is in mixed-size mode: a size that no free placement id takes is
    refused for that, not with equal-size mode's "admits only that size" (trial 6 notes)."""
    host = build("L40S", "vendor-vfio", True)
    store = StateStore(host.state_dir)
    for i, p in enumerate(["L40S-16Q", "L40S-8Q", "L40S-4Q"]):       # ids 0, 24 and 18: 16 GB left, split
        create(host, store, profile=p, owner=f"6695eb01-f6a4-8304-79aa-97f2502e1b{i:02d}")
    with pytest.raises(RefusedError) as e:
        create(host, store, profile="L40S-16Q", owner="6695eb01-f6a4-8304-79aa-97f2502e1b10")
    assert "mixed-size mode: no placement id free for L40S-16Q" in str(e.value), str(e.value)
    assert "equal-size mode admits only" not in str(e.value)
    assert sorted(_placements(host).values()) == [0, 18, 24]        # nothing made
