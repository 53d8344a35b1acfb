"""A GPU in mixed-size mode offers, places and counts at most the type's mixed-size max (issue 25 item 4).

Mixed-size maxima are often lower than equal-size ones: A40 and L40S 4C 12 -> 8, 8C 6 -> 4, 16C 3 -> 2
(NVIDIA AI Enterprise 5.0 user guide, appendix A); the time-sliced H200X types keep theirs in both
modes (7C 20, 14C 10, 28C 5).  docs/reference/hardware.md#vgpu-types.
"""

from __future__ import annotations

import pytest

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
    assert "L40S-8C (2)" in (e.value.hint or ""), e.value.hint          # 16 GiB left: 2 of 4 mixed-size 8C
