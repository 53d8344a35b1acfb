"""vGPU lifecycle on the simulator (issue 4): placement, equal-size and
mixed-size mode, both backends (classic mdev, vendor-specific VFIO), profile
names, ownership, mdevctl persistence, reconcile and error reporting.

Every outcome is read back from the simulated sysfs tree (``mdev_type``
links, ``current_vgpu_type``, ``creatable_vgpu_types``,
``available_instances``), the state store records and the audit log.  No
kernel path is spelt here: every path comes from :class:`HostRoot`.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone

import pytest

from vgpuhost.cli.main import main
from vgpuhost.model.errors import DeviceError, InputError, RefusedError
from vgpuhost.observe.inventory import discover
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress
from vgpuhost.ops.vgpu import create, list_vgpus, reconcile, release_owner, remove, resolve_profile

A = PciAddress.parse

A40 = A("0000:81:00.0")            # a40-mdev: the PF is the mdev parent
A100 = A("0000:41:00.0")           # a100-sriov-mdev: 20 VFs are the mdev parents
L40S_0 = A("0000:21:00.0")         # l40s-vendor-vfio: NUMA node 0
L40S_1 = A("0000:a1:00.0")         # l40s-vendor-vfio: NUMA node 1
GPU_LO, GPU_HI = A("0000:41:00.0"), A("0000:81:00.0")   # the two GPUs of the inline 2-GPU hosts

OWNER_X = "6f1a0c2e-1111-4222-8333-944455556666"
OWNER_Y = "0d9e8f7a-2222-4333-8444-a55566667777"
HEADER_ONLY = "ID    : vGPU Name\n"

TWO_A40 = """
version: 1
name: two-a40
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {{bdf: "0000:40:01.0", model: intel-root-port, numa_node: 0}}
  - {{bdf: "0000:41:00.0", model: A40, upstream: "0000:40:01.0", numa_node: 0,
     vgpu: {{backend: mdev, mixed_size: {mixed}}}}}
  - {{bdf: "0000:80:01.0", model: intel-root-port, numa_node: 1}}
  - {{bdf: "0000:81:00.0", model: A40, upstream: "0000:80:01.0", numa_node: 1,
     vgpu: {{backend: mdev, mixed_size: {mixed}}}}}
faults: [{faults}]
"""

TWO_A100 = """
version: 1
name: two-a100-sriov
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:40:01.0", model: intel-root-port, numa_node: 0}
  - {bdf: "0000:41:00.0", model: A100-PCIE-40GB, upstream: "0000:40:01.0", numa_node: 0,
     vgpu: {backend: mdev, sriov_numvfs: 20}}
  - {bdf: "0000:80:01.0", model: intel-root-port, numa_node: 1}
  - {bdf: "0000:81:00.0", model: A100-PCIE-40GB, upstream: "0000:80:01.0", numa_node: 1,
     vgpu: {backend: mdev, sriov_numvfs: 20}}
"""

ONE_GPU = """
version: 1
name: one-{model}
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {{bdf: "0000:40:01.0", model: intel-root-port, numa_node: 0}}
  - {{bdf: "0000:41:00.0", model: {model}, upstream: "0000:40:01.0", numa_node: 0,
     vgpu: {{backend: {backend}, sriov_numvfs: {numvfs}, mixed_size: {mixed}}}}}
faults: [{faults}]
"""

TWO_L40S_MIXED = """
version: 1
name: two-l40s-mixed
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:20:01.1", model: amd-root-port, numa_node: 0}
  - {bdf: "0000:21:00.0", model: L40S, upstream: "0000:20:01.1", numa_node: 0,
     vgpu: {backend: vendor-vfio, sriov_numvfs: 16, mixed_size: true}}
  - {bdf: "0000:a0:01.1", model: amd-root-port, numa_node: 1}
  - {bdf: "0000:a1:00.0", model: L40S, upstream: "0000:a0:01.1", numa_node: 1,
     vgpu: {backend: vendor-vfio, sriov_numvfs: 16, mixed_size: true}}
"""


# ---------------------------------------------------------------------------
# helpers: read the simulated tree back

def two_a40(make_host, *, mixed="false", faults=""):
    return make_host(yaml_text=TWO_A40.format(mixed=mixed, faults=faults))


def one_gpu(make_host, model="A40", *, backend="mdev", numvfs=0, mixed="false", faults=""):
    return make_host(yaml_text=ONE_GPU.format(model=model, backend=backend, numvfs=numvfs, mixed=mixed,
                                              faults=faults))


def store_of(host):
    return StateStore(host.state_dir)


def mdevs(host):
    """UUIDs under bus/mdev/devices."""
    d = host.mdev_devices
    return sorted(os.listdir(d)) if d.is_dir() else []


def mdev_type(host, uuid):
    return os.path.basename(os.readlink(host.mdev_devices / uuid / "mdev_type"))


def mdev_parent(host, uuid):
    """The parent device's BDF: the directory the mdev lives in, as sysfs lays it out."""
    return os.path.basename(os.path.dirname(os.path.realpath(host.mdev_devices / uuid)))


def gpu_of_mdev(host, uuid):
    """The physical GPU behind an mdev: its parent, or the parent's physfn on SR-IOV."""
    parent = host.pci_device(mdev_parent(host, uuid))
    physfn = parent / "physfn"
    return os.path.basename(os.path.realpath(physfn)) if os.path.lexists(physfn) else parent.name


def types_on(host, gpu):
    """{mdev uuid: type id} of the mdevs on ``gpu`` (PF parent or its VFs)."""
    return {u: mdev_type(host, u) for u in mdevs(host) if gpu_of_mdev(host, u) == str(gpu)}


def available(host, parent, type_id):
    return int((host.mdev_bus / str(parent) / "mdev_supported_types" / type_id / "available_instances")
               .read_text())


def vfs_of(host, pf):
    d = host.pci_device(pf)
    links = sorted((n for n in os.listdir(d) if n.startswith("virtfn")), key=lambda n: int(n[6:]))
    return [os.path.basename(os.path.realpath(d / n)) for n in links]


def current_type(host, vf):
    return (host.pci_device(vf) / "nvidia" / "current_vgpu_type").read_text().strip()


def creatable(host, vf):
    return (host.pci_device(vf) / "nvidia" / "creatable_vgpu_types").read_text()


def creatable_ids(host, vf):
    return {line.split(":")[0].strip() for line in creatable(host, vf).splitlines()[1:]}


def vendor_state(host, pf):
    """{VF: current_vgpu_type} for every VF of ``pf``."""
    return {vf: current_type(host, vf) for vf in vfs_of(host, pf)}


def cli(host, *args):
    return main(["--root", str(host.root), *args])


def records_by_id(store):
    return {r.id: r for r in store.vgpu_records()}


# ---------------------------------------------------------------------------
# equal-size mode: fill a GPU with 4C, then ask for 8C

def test_a40_holding_4c_refuses_8c_naming_equal_size_and_what_still_fits(make_host, capsys):
    host = make_host("a40-mdev")
    store = store_of(host)
    first = create(host, store, profile="A40-4C")
    assert mdev_type(host, first.id) == "nvidia-572" and mdev_parent(host, first.id) == str(A40)
    assert available(host, A40, "nvidia-574") == 0          # the kernel offers no 8C any more
    with pytest.raises(RefusedError) as ei:
        create(host, store, profile="A40-8C", gpu=A40)
    line = ei.value.one_line()
    assert "4096 MiB" in line and "equal-size" in line
    assert "types that still fit" in line and "A40-4C (11)" in line and "A40-4Q (11)" in line
    assert "A40-8C (" not in line
    assert mdevs(host) == [first.id]                        # nothing created
    # the CLI says the same in one line, exit 2 (refused before touching anything)
    rows = len(store.audit_rows())
    code = cli(host, "vgpu", "create", "--profile", "A40-8C")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "equal-size" in err and "A40-4C (11)" in err
    assert len(store.audit_rows()) == rows and mdevs(host) == [first.id]


def test_a40_full_of_4c_refuses_more_and_lists_nothing_fits(make_host):
    host = make_host("a40-mdev")
    store = store_of(host)
    made = [create(host, store, profile="A40-4C").id for _ in range(12)]   # max instances 12
    assert set(types_on(host, A40).values()) == {"nvidia-572"} and sorted(made) == mdevs(host)
    assert available(host, A40, "nvidia-572") == 0
    for profile in ("A40-4C", "A40-8C"):
        with pytest.raises(RefusedError) as ei:
            create(host, store, profile=profile)
        assert "types that still fit: 0000:81:00.0: none" in ei.value.one_line()
    assert len(mdevs(host)) == 12 and len(store.vgpu_records()) == 12


def test_a100_sriov_holding_4c_refuses_8c(make_host):
    host = make_host("a100-sriov-mdev")
    store = store_of(host)
    out = create(host, store, profile="A100-4C")
    # the parent is a VF, not the PF; the VF holds its one vGPU
    assert out.parent != str(A100) and out.parent in vfs_of(host, A100)
    assert mdev_parent(host, out.id) == out.parent and mdev_type(host, out.id) == "nvidia-468"
    assert available(host, out.parent, "nvidia-468") == 0
    with pytest.raises(RefusedError) as ei:
        create(host, store, profile="A100-8C")
    assert "4096 MiB" in ei.value.one_line() and "equal-size" in ei.value.one_line()
    assert "A100-4C (" in ei.value.hint
    assert mdevs(host) == [out.id]


@pytest.mark.parametrize("spec", [TWO_A40.format(mixed="false", faults=""), TWO_A100], ids=["a40", "a100-sriov"])
def test_best_fit_puts_8c_on_the_other_gpu(make_host, spec):
    host = make_host(yaml_text=spec)
    store = store_of(host)
    board = "A40" if "model: A40," in spec else "A100"
    four = create(host, store, profile=f"{board}-4C", gpu=GPU_LO)
    assert gpu_of_mdev(host, four.id) == str(GPU_LO)
    eight = f"{board}-8C"
    with pytest.raises(RefusedError, match="equal-size"):
        create(host, store, profile=eight, gpu=GPU_LO, strategy="best-fit")
    out = create(host, store, profile=eight, strategy="best-fit")
    assert out.gpu == str(GPU_HI) and "best-fit" in out.reason
    assert gpu_of_mdev(host, out.id) == str(GPU_HI)
    assert mdev_type(host, out.id) == ("nvidia-574" if board == "A40" else "nvidia-470")
    assert {r.gpu for r in store.vgpu_records()} == {str(GPU_LO), str(GPU_HI)}


# ---------------------------------------------------------------------------
# strategies

@pytest.mark.parametrize("loaded,expect", [
    (GPU_HI, {"best-fit": GPU_HI, "worst-fit": GPU_LO, "spread": GPU_LO, "first-fit": GPU_LO}),
    (GPU_LO, {"best-fit": GPU_LO, "worst-fit": GPU_HI, "spread": GPU_HI, "first-fit": GPU_LO}),
])
def test_strategies_choose_differently_when_one_gpu_holds_vgpus(make_host, loaded, expect):
    host = two_a40(make_host)
    store = store_of(host)
    for _ in range(2):
        create(host, store, profile="A40-8Q", gpu=loaded)
    assert len(types_on(host, loaded)) == 2
    before = (mdevs(host), len(store.audit_rows()))
    for strategy, gpu in expect.items():
        plan = create(host, store, profile="A40-8Q", strategy=strategy, dry_run=True)
        assert plan.gpu == str(gpu), (strategy, plan.reason)
        assert plan.reason.startswith(f"{strategy}: {gpu}")
    assert (mdevs(host), len(store.audit_rows())) == before      # dry runs wrote nothing
    # and for real: best-fit packs onto the loaded GPU, spread balances onto the other
    packed = create(host, store, profile="A40-8Q", strategy="best-fit")
    spread = create(host, store, profile="A40-8Q", strategy="spread")
    assert gpu_of_mdev(host, packed.id) == str(loaded)
    assert gpu_of_mdev(host, spread.id) == str(expect["spread"])


def test_first_fit_takes_the_lowest_address(make_host):
    host = two_a40(make_host)
    store = store_of(host)
    out = create(host, store, profile="A40-16Q")                 # default strategy: first-fit
    assert out.gpu == str(GPU_LO) and gpu_of_mdev(host, out.id) == str(GPU_LO)
    assert "first GPU (by PCI address)" in out.reason
    for _ in range(2):                                           # A40-16Q: 3 per GPU
        assert gpu_of_mdev(host, create(host, store, profile="A40-16Q").id) == str(GPU_LO)
    out = create(host, store, profile="A40-16Q")                 # 0000:41 is full now
    assert gpu_of_mdev(host, out.id) == str(GPU_HI)
    assert "0000:41:00.0: no A40-16Q instance free" not in out.reason   # admitted: no refusal text
    assert len(types_on(host, GPU_LO)) == 3 and len(types_on(host, GPU_HI)) == 1


def test_numa_preference_and_fallback_on_l40s(make_host):
    host = make_host("l40s-vendor-vfio")
    store = store_of(host)
    on1 = create(host, store, profile="L40S-48Q", numa_node=1)
    assert on1.gpu == str(L40S_1) and on1.id in vfs_of(host, L40S_1)
    assert current_type(host, on1.id) == "1156"
    assert "NUMA node 1 preferred" in on1.reason
    # node 1 is full (48Q: one per GPU): fall back to node 0 and say so
    fell = create(host, store, profile="L40S-48Q", numa_node=1)
    assert fell.gpu == str(L40S_0) and fell.id in vfs_of(host, L40S_0)
    assert current_type(host, fell.id) == "1156"
    assert "no GPU on NUMA node 1 fits, took node 0" in fell.reason
    # the node preference comes before the strategy: worst-fit alone would take the emptier node-1 GPU
    host2 = make_host("l40s-vendor-vfio")
    store2 = store_of(host2)
    create(host2, store2, profile="L40S-8Q", gpu=L40S_0)
    assert create(host2, store2, profile="L40S-8Q", strategy="worst-fit", dry_run=True).gpu == str(L40S_1)
    on0 = create(host2, store2, profile="L40S-8Q", numa_node=0, strategy="worst-fit")
    assert on0.gpu == str(L40S_0) and current_type(host2, on0.id) == "1152"


def test_anti_affinity_key_spreads_then_refuses(make_host):
    host = two_a40(make_host)
    store = store_of(host)
    a = create(host, store, profile="A40-8Q", anti_affinity="db")
    b = create(host, store, profile="A40-8Q", anti_affinity="db")
    other = create(host, store, profile="A40-8Q", anti_affinity="web")
    assert {gpu_of_mdev(host, a.id), gpu_of_mdev(host, b.id)} == {str(GPU_LO), str(GPU_HI)}
    assert gpu_of_mdev(host, other.id) == str(GPU_LO)          # a different key may share
    with pytest.raises(RefusedError) as ei:
        create(host, store, profile="A40-8Q", anti_affinity="db")
    assert "anti-affinity key 'db'" in ei.value.message
    assert len(mdevs(host)) == 3
    recs = records_by_id(store)
    assert recs[a.id].anti_affinity == "db" and recs[other.id].anti_affinity == "web"


def test_one_vgpu_per_vm_per_gpu(make_host):
    host = two_a40(make_host)
    store = store_of(host)
    first = create(host, store, profile="A40-8Q", owner=OWNER_X)
    second = create(host, store, profile="A40-8Q", owner=OWNER_X)
    assert {gpu_of_mdev(host, first.id), gpu_of_mdev(host, second.id)} == {str(GPU_LO), str(GPU_HI)}
    with pytest.raises(RefusedError) as ei:
        create(host, store, profile="A40-8Q", owner=OWNER_X)
    assert "one vGPU per VM per GPU" in ei.value.message
    assert len(mdevs(host)) == 2
    # another VM, and 'manual', are not held back
    create(host, store, profile="A40-8Q", owner=OWNER_Y, gpu=GPU_LO)
    create(host, store, profile="A40-8Q", gpu=GPU_LO)
    create(host, store, profile="A40-8Q", gpu=GPU_LO)
    assert len(types_on(host, GPU_LO)) == 4


def test_one_vgpu_per_vm_on_a_one_gpu_host_is_refused(make_host, capsys):
    host = make_host("a40-mdev")
    store = store_of(host)
    create(host, store, profile="A40-8Q", owner=OWNER_X)
    code = cli(host, "vgpu", "create", "--profile", "A40-8Q", "--owner", OWNER_X)
    err = capsys.readouterr().err
    assert code == 2 and "one vGPU per VM per GPU" in err and err.count("\n") == 1
    assert len(mdevs(host)) == 1


# ---------------------------------------------------------------------------
# mixed-size mode

def test_mixed_size_off_keeps_one_size_on_keeps_both(make_host):
    off = one_gpu(make_host, "A40")
    store = store_of(off)
    create(off, store, profile="A40-4C")
    with pytest.raises(RefusedError, match="equal-size"):
        create(off, store, profile="A40-8C")
    assert set(types_on(off, GPU_LO).values()) == {"nvidia-572"}

    on = one_gpu(make_host, "A40", mixed="true")
    store = store_of(on)
    small = create(on, store, profile="A40-4C")
    big = create(on, store, profile="A40-8C")
    # both sizes live on the same parent now
    assert mdev_parent(on, small.id) == mdev_parent(on, big.id) == str(GPU_LO)
    assert sorted(types_on(on, GPU_LO).values()) == ["nvidia-572", "nvidia-574"]
    # capacity: A40-8C's mixed-size max is 4 (6 in equal-size mode; NVIDIA AI Enterprise 5.0,
    # appendix A), at placement ids 0, 12, 24, 36 (vgpuhost/model/mixedsize.py, unconfirmed beyond
    # NVIDIA's L4 example); the 4C sits at id 0, so two more 8C fit and a third does not, though
    # 20 GB are left: the fragmentation capacity reports
    for _ in range(2):
        create(on, store, profile="A40-8C")
    with pytest.raises(RefusedError) as ei:
        create(on, store, profile="A40-8C")
    assert "A40-4C" in ei.value.hint
    assert available(on, GPU_LO, "nvidia-574") == 0
    assert sorted(types_on(on, GPU_LO).values()).count("nvidia-574") == 3


def test_mixed_size_uses_mixed_max_instances(make_host):
    # A100 8C: 5 per GPU in equal-size mode, 4 in mixed-size mode (docs/reference/hardware.md#vgpu-types)
    counts = {}
    for mixed in ("false", "true"):
        host = one_gpu(make_host, "A100-PCIE-40GB", numvfs=20, mixed=mixed)
        store = store_of(host)
        n = 0
        while True:
            try:
                create(host, store, profile="A100-8C")
            except RefusedError:
                break
            n += 1
        counts[mixed] = n
        assert len(mdevs(host)) == n and set(types_on(host, GPU_LO).values()) == {"nvidia-470"}
        assert len({mdev_parent(host, u) for u in mdevs(host)}) == n      # one vGPU per VF
    assert counts == {"false": 5, "true": 4}


# ---------------------------------------------------------------------------
# vendor-specific VFIO

def test_vendor_vfio_writes_type_id_reads_back_and_remove_writes_zero(make_host):
    host = make_host("l40s-vendor-vfio")
    store = store_of(host)
    before = vendor_state(host, L40S_0)
    assert set(before.values()) == {"0"} and len(before) == 16
    out = create(host, store, profile="L40S-8Q", gpu=L40S_0)
    vf = out.id
    assert out.backend == "vendor-vfio" and vf == out.parent and vf in vfs_of(host, L40S_0)
    assert PciAddress.is_valid(vf)                               # the id is the VF's BDF
    assert current_type(host, vf) == "1152" == out.type_id
    assert [v for v, t in vendor_state(host, L40S_0).items() if t != "0"] == [vf]
    assert creatable(host, vf) == HEADER_ONLY                    # the VF holds its one vGPU
    # equal-size: the other VFs of that GPU offer only 8 GB types now; the other GPU everything
    other_vf = vfs_of(host, L40S_0)[1]
    assert creatable_ids(host, other_vf) == {"1152", "1162", "1169"}       # 8Q, 8A, 8C
    assert "1156" in creatable_ids(host, vfs_of(host, L40S_1)[0])
    rec = records_by_id(store)[vf]
    assert (rec.backend, rec.gpu, rec.parent, rec.type_id, rec.type_name) == \
        ("vendor-vfio", str(L40S_0), vf, "1152", "L40S-8Q")
    row = store.audit_rows()[-1]
    assert row.path == host.relative(host.pci_device(vf) / "nvidia" / "current_vgpu_type")
    assert (row.value, row.result) == ("1152", "ok")

    gone = remove(host, store, vf)
    assert gone.changed and current_type(host, vf) == "0"
    row = store.audit_rows()[-1]
    assert row.path == host.relative(host.pci_device(vf) / "nvidia" / "current_vgpu_type")
    assert (row.value, row.result) == ("0", "ok")
    assert store.vgpu_records() == []
    assert "1156" in creatable_ids(host, other_vf)               # the GPU is empty again


def test_vendor_vfio_full_gpu_leaves_header_only_creatable_types(make_host):
    host = make_host("l40s-vendor-vfio")
    store = store_of(host)
    out = create(host, store, profile="L40S-48Q", gpu=L40S_0)    # max 1 per GPU: it is full
    assert current_type(host, out.id) == "1156"
    for vf in vfs_of(host, L40S_0):
        assert creatable(host, vf) == HEADER_ONLY, vf
    for vf in vfs_of(host, L40S_1):                              # the other GPU is untouched
        assert "1156  : NVIDIA L40S-48Q" in creatable(host, vf).splitlines()
    inv = discover(Sysfs(host))
    assert not [t for t in inv.vgpu_types if t.gpu == L40S_0]
    with pytest.raises(RefusedError):
        create(host, store, profile="L40S-48Q", gpu=L40S_0)
    assert [v for v, t in vendor_state(host, L40S_0).items() if t != "0"] == [out.id]
    # without --gpu the request goes to the GPU with room
    nxt = create(host, store, profile="L40S-48Q")
    assert nxt.gpu == str(L40S_1) and current_type(host, nxt.id) == "1156"


def test_vendor_vfio_refuses_uuid_and_writes_nothing(make_host, capsys):
    host = make_host("l40s-vendor-vfio")
    store = store_of(host)
    with pytest.raises(InputError, match="--uuid applies to mdev"):
        create(host, store, profile="L40S-8Q", uuid="2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a")
    code = cli(host, "vgpu", "create", "--profile", "L40S-8Q", "--uuid", "2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a")
    assert code == 2 and "--uuid" in capsys.readouterr().err
    for pf in (L40S_0, L40S_1):
        assert set(vendor_state(host, pf).values()) == {"0"}
    assert store.audit_rows() == [] and store.vgpu_records() == []


def test_vendor_vfio_refuses_persist_pointing_at_reconcile(make_host, capsys):
    host = make_host("l40s-vendor-vfio")
    store = store_of(host)
    with pytest.raises(InputError) as ei:
        create(host, store, profile="L40S-8Q", persist=True)
    assert "vendor-VFIO" in ei.value.message and "reconcile" in ei.value.hint
    code = cli(host, "vgpu", "create", "--profile", "L40S-8Q", "--persist")
    err = capsys.readouterr().err
    assert code == 2 and "reconcile" in err and err.count("\n") == 1
    for pf in (L40S_0, L40S_1):
        assert set(vendor_state(host, pf).values()) == {"0"}
    assert store.audit_rows() == [] and store.vgpu_records() == []
    assert not host.mdevctl_d.exists() or not any(host.mdevctl_d.rglob("*"))


def test_vendor_vfio_eperm_says_the_vf_is_taken(make_host):
    host = one_gpu(make_host, "L40S", backend="vendor-vfio", numvfs=4,
                   faults='{op: set_type, device: "0000:41:00.4", errno: EPERM}')
    store = store_of(host)
    with pytest.raises(DeviceError) as ei:
        create(host, store, profile="L40S-8Q")
    assert "0000:41:00.4 is taken" in ei.value.message and "EPERM" in ei.value.message
    assert set(vendor_state(host, GPU_LO).values()) == {"0"} and store.vgpu_records() == []
    row = store.audit_rows()[-1]
    assert (row.value, row.result, row.errno) == ("1152", "EPERM", 1)


# ---------------------------------------------------------------------------
# profile names

def test_names_resolve_exactly_and_case_insensitively(make_host):
    a100 = make_host("a100-sriov-mdev")
    inv = discover(Sysfs(a100))
    assert resolve_profile(inv, [], "A100-1-5CME") == "A100-1-5CME"
    assert resolve_profile(inv, [], "A100-1-5C") == "A100-1-5C"
    assert resolve_profile(inv, [], "a100-1-5cme") == "A100-1-5CME"
    a40 = make_host("a40-mdev")
    inv = discover(Sysfs(a40))
    assert resolve_profile(inv, [], "a40-8q") == "A40-8Q"
    out = create(a40, store_of(a40), profile="a40-8q")
    assert out.type_name == "A40-8Q" and mdev_type(a40, out.id) == "nvidia-566"
    assert records_by_id(store_of(a40))[out.id].type_name == "A40-8Q"


def _mig_on(host, pf, free):
    """Seed the simulator: MIG mode on with ``free`` GPU instances (NVML's side, a later issue)."""
    k = SimKernel(host)
    meta = k.meta()
    meta["gpus"][str(pf)]["mig_mode"] = True
    meta["gpus"][str(pf)]["free_gpu_instances"] = free
    k.save_meta(meta)
    k.refresh_gpu(str(pf))


def test_me_type_is_never_replaced_by_the_non_me_type(make_host):
    host = make_host("a100-sriov-mdev")
    store = store_of(host)
    _mig_on(host, A100, {"1g.5gb": 7})                 # 1g.5gb free, no 1g.5gb+me instance
    vf0 = vfs_of(host, A100)[0]
    assert available(host, vf0, "nvidia-474") == 1 and available(host, vf0, "nvidia-479") == 0
    with pytest.raises(RefusedError) as ei:
        create(host, store, profile="A100-1-5CME")
    # the refusal names the missing +me GPU instance; the plain 1g.5gb one is never used instead
    assert "A100-1-5CME" in ei.value.message and "1g.5gb+me GPU instance" in ei.value.message
    assert mdevs(host) == [] and store.vgpu_records() == [] and store.audit_rows() == []
    plain = create(host, store, profile="A100-1-5C")
    assert plain.type_name == "A100-1-5C" and mdev_type(host, plain.id) == "nvidia-474"
    # MIG-backed vGPUs cannot be persisted through mdevctl
    with pytest.raises(InputError, match="MIG-backed") as ei:
        create(host, store, profile="A100-1-5C", persist=True)
    assert "reconcile" in ei.value.hint and mdevs(host) == [plain.id]


def test_me_type_is_created_as_itself(make_host):
    host = make_host("a100-sriov-mdev")
    store = store_of(host)
    _mig_on(host, A100, {"1g.5gb": 6, "1g.5gb+me": 1})
    me = create(host, store, profile="a100-1-5cme")
    assert me.type_name == "A100-1-5CME" and mdev_type(host, me.id) == "nvidia-479"
    assert records_by_id(store)[me.id].type_name == "A100-1-5CME"


def test_me_type_fits_beside_a_non_me_mig_vgpu(make_host):
    host = make_host("a100-sriov-mdev")
    store = store_of(host)
    _mig_on(host, A100, {"1g.5gb": 6, "1g.5gb+me": 1})
    plain = create(host, store, profile="A100-1-5C")
    assert available(host, vfs_of(host, A100)[1], "nvidia-479") == 1    # the kernel offers it
    me = create(host, store, profile="A100-1-5CME")
    assert mdev_type(host, me.id) == "nvidia-479" and mdev_type(host, plain.id) == "nvidia-474"


def test_unknown_profile_lists_near_matches_in_one_line(make_host, capsys):
    host = make_host("a40-mdev")
    code = cli(host, "vgpu", "create", "--profile", "A40-7Q")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "unknown vGPU profile 'A40-7Q'" in err and "near matches:" in err and "A40-" in err
    with pytest.raises(InputError) as ei:
        create(host, store_of(host), profile="A40-8X")
    assert "A40-8Q" in ei.value.hint
    assert mdevs(host) == [] and store_of(host).audit_rows() == []


# ---------------------------------------------------------------------------
# ownership

def test_remove_refuses_an_mdev_vgpuhost_did_not_create(make_host, capsys):
    host = make_host("a40-mdev")
    store = store_of(host)
    foreign = "11111111-2222-4333-8444-555555555555"
    Sysfs(host).write(host.mdev_bus / str(A40) / "mdev_supported_types" / "nvidia-566" / "create", foreign)
    assert mdevs(host) == [foreign]
    with pytest.raises(RefusedError, match="not created by vgpuhost"):
        remove(host, store, foreign)
    code = cli(host, "vgpu", "remove", foreign)
    assert code == 2 and "not created by vgpuhost" in capsys.readouterr().err
    assert mdevs(host) == [foreign] and mdev_type(host, foreign) == "nvidia-566"
    assert store.audit_rows() == []
    # vgpu list shows it as foreign, with no owner
    [entry] = list_vgpus(discover(Sysfs(host)), store.vgpu_records())
    assert (entry.id, entry.state, entry.owner) == (foreign, "foreign", None)


def test_late_release_never_removes_the_next_owners_vgpu(make_host):
    host = make_host("l40s-vendor-vfio")
    store = store_of(host)
    x = create(host, store, profile="L40S-48Q", gpu=L40S_0, owner=OWNER_X)
    remove(host, store, x.id, owner=OWNER_X)
    y = create(host, store, profile="L40S-48Q", gpu=L40S_0, owner=OWNER_Y)
    assert y.id == x.id                                          # the same VF, reused
    with pytest.raises(RefusedError, match=f"now belongs to {OWNER_Y}"):
        remove(host, store, y.id, owner=OWNER_X)
    assert release_owner(host, store, OWNER_X) == []
    assert current_type(host, y.id) == "1156"
    assert records_by_id(store)[y.id].owner == OWNER_Y


def test_remove_with_the_wrong_owner_is_refused_on_mdev(make_host):
    host = make_host("a40-mdev")
    store = store_of(host)
    out = create(host, store, profile="A40-8Q", owner=OWNER_Y)
    n = len(store.audit_rows())
    with pytest.raises(RefusedError, match=f"now belongs to {OWNER_Y}, not {OWNER_X}") as ei:
        remove(host, store, out.id, owner=OWNER_X)
    assert "late release" in ei.value.hint
    assert mdevs(host) == [out.id] and len(store.audit_rows()) == n
    remove(host, store, out.id, owner=OWNER_Y)
    assert mdevs(host) == [] and store.vgpu_records() == []


def test_release_owner_removes_only_that_owners_vgpus(make_host):
    host = two_a40(make_host)
    store = store_of(host)
    x1 = create(host, store, profile="A40-8Q", owner=OWNER_X)
    x2 = create(host, store, profile="A40-8Q", owner=OWNER_X)
    y = create(host, store, profile="A40-8Q", owner=OWNER_Y)
    m = create(host, store, profile="A40-8Q")
    assert len(mdevs(host)) == 4
    outs = release_owner(host, store, OWNER_X)
    assert sorted(o.id for o in outs) == sorted([x1.id, x2.id])
    assert mdevs(host) == sorted([y.id, m.id])
    assert {r.id: r.owner for r in store.vgpu_records()} == {y.id: OWNER_Y, m.id: "manual"}
    assert release_owner(host, store, OWNER_X) == []              # idempotent


def test_records_hold_owner_type_parent_and_time(make_host):
    host = make_host("a100-sriov-mdev")
    store = store_of(host)
    t0 = datetime.now(timezone.utc)
    out = create(host, store, profile="A100-10C", owner=OWNER_X, anti_affinity="k", params="frame_rate_limiter=0")
    [rec] = store.vgpu_records()
    assert rec.id == out.id and rec.backend == "mdev"
    assert rec.owner == OWNER_X and rec.type_id == "nvidia-471" and rec.type_name == "A100-10C"
    assert rec.gpu == str(A100) and rec.parent == mdev_parent(host, out.id) and rec.parent in vfs_of(host, A100)
    assert rec.anti_affinity == "k" and rec.params == "frame_rate_limiter=0" and not rec.persisted
    when = datetime.fromisoformat(rec.time)
    assert when.tzinfo is not None and t0 - timedelta(seconds=1) <= when <= datetime.now(timezone.utc)
    assert store.vgpu_records(owner=OWNER_X) == [rec] and store.vgpu_records(owner=OWNER_Y) == []


def test_owner_uuid_case_does_not_matter_for_release(make_host):
    host = make_host("a40-mdev")
    store = store_of(host)
    out = create(host, store, profile="A40-8Q", owner=OWNER_X.upper())
    assert records_by_id(store)[out.id].owner == OWNER_X          # stored lower-case
    released = release_owner(host, store, OWNER_X.upper())
    assert [o.id for o in released] == [out.id] and mdevs(host) == []


def test_remove_refuses_a_vf_another_tool_reused_and_reconcile_reports_it(make_host):
    host = make_host("l40s-vendor-vfio")
    store = store_of(host)
    out = create(host, store, profile="L40S-8Q", gpu=L40S_0, owner=OWNER_X)
    fs = Sysfs(host)
    cur = host.pci_device(out.id) / "nvidia" / "current_vgpu_type"
    fs.write(cur, "0")                     # someone else destroys it and puts a 4Q there
    fs.write(cur, "1150")
    with pytest.raises(RefusedError, match="now holds type 1150, not the recorded 1152"):
        remove(host, store, out.id, owner=OWNER_X)
    assert current_type(host, out.id) == "1150"
    rep = reconcile(host, store, check=True)
    assert not rep.in_sync and rep.mismatched == [f"{out.id}: holds 1150, recorded 1152"]
    assert [e.state for e in list_vgpus(discover(Sysfs(host)), store.vgpu_records()) if e.id == out.id] == ["mismatched"]


def test_remove_of_a_vgpu_already_gone_drops_the_record(make_host):
    host = make_host("a40-mdev")
    store = store_of(host)
    out = create(host, store, profile="A40-8Q")
    Sysfs(host).write(host.mdev_devices / out.id / "remove", "1")
    rows = len(store.audit_rows())
    gone = remove(host, store, out.id)
    assert any("already gone" in n for n in gone.notes)
    assert store.vgpu_records() == [] and len(store.audit_rows()) == rows      # nothing written


def test_remove_of_an_open_mdev_is_refused_and_keeps_the_record(make_host, capsys):
    """A remove of an mdev a qemu holds would block (docs/reference/hardware.md#mdev): refused before
    any write, exit 2, naming the holder (tests/test_remove_blocking.py has the rest)."""
    host = make_host("a40-mdev")
    store = store_of(host)
    out = create(host, store, profile="A40-8Q", owner=OWNER_X)
    rows = len(store.audit_rows())
    k = SimKernel(host)
    pid = k.open_vgpu(out.id)          # a running VM holds it
    code = cli(host, "vgpu", "remove", out.id)
    err = capsys.readouterr().err
    assert code == 2 and f"vGPU {out.id} is open, held by qemu-system-x86 (pid {pid}" in err, err
    assert mdevs(host) == [out.id] and records_by_id(store)[out.id].owner == OWNER_X
    assert len(store.audit_rows()) == rows and store.journal_entries(open_only=True) == []
    k.close_vgpu(pid)


def test_vgpu_list_joins_records_and_host(make_host, capsys):
    host = make_host("a40-mdev")
    store = store_of(host)
    mine = create(host, store, profile="A40-8Q", owner=OWNER_X)
    lost = create(host, store, profile="A40-8Q")
    foreign = "11111111-2222-4333-8444-555555555555"
    fs = Sysfs(host)
    fs.write(host.mdev_bus / str(A40) / "mdev_supported_types" / "nvidia-566" / "create", foreign)
    fs.write(host.mdev_devices / lost.id / "remove", "1")
    assert cli(host, "--json", "vgpu", "list") == 0
    doc = json.loads(capsys.readouterr().out)
    got = {e["id"]: (e["state"], e["owner"], e["type_id"], e["type_name"]) for e in doc["vgpus"]}
    assert got == {mine.id: ("active", OWNER_X, "nvidia-566", "A40-8Q"),
                   lost.id: ("missing", "manual", "nvidia-566", "A40-8Q"),
                   foreign: ("foreign", None, "nvidia-566", "A40-8Q")}


# ---------------------------------------------------------------------------
# persistence

@pytest.mark.parametrize("spec,profile,gpu", [("a100-sriov-mdev", "A100-20C", A100), ("a40-mdev", "A40-8Q", A40)])
def test_persist_writes_mdevctl_definition_and_remove_deletes_it(make_host, spec, profile, gpu, capsys):
    host = make_host(spec)
    store = store_of(host)
    code = cli(host, "--json", "vgpu", "create", "--profile", profile, "--persist")
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    uuid, parent = doc["id"], doc["parent"]
    assert mdevs(host) == [uuid] and mdev_parent(host, uuid) == parent
    assert gpu_of_mdev(host, uuid) == str(gpu)
    path = host.mdevctl_d / parent / uuid
    assert json.loads(path.read_text()) == {"mdev_type": mdev_type(host, uuid), "start": "auto", "attrs": []}
    assert records_by_id(store)[uuid].persisted
    assert any(r.path == host.relative(path) and r.result == "ok" for r in store.audit_rows())
    assert cli(host, "vgpu", "remove", uuid) == 0
    assert not path.exists() and mdevs(host) == [] and store.vgpu_records() == []


def test_without_persist_no_mdevctl_definition(make_host):
    host = make_host("a40-mdev")
    out = create(host, store_of(host), profile="A40-8Q")
    assert not (host.mdevctl_d / str(A40) / out.id).exists()


# ---------------------------------------------------------------------------
# reconcile

def test_reconcile_recreates_missing_and_leaves_foreign_alone(make_host, capsys):
    host = make_host("a40-mdev")
    store = store_of(host)
    kept = create(host, store, profile="A40-8Q", owner=OWNER_X)
    lost = create(host, store, profile="A40-8Q", owner=OWNER_Y, params="frame_rate_limiter=0")
    foreign = "11111111-2222-4333-8444-555555555555"
    fs = Sysfs(host)
    fs.write(host.mdev_bus / str(A40) / "mdev_supported_types" / "nvidia-566" / "create", foreign)
    # behind vgpuhost's back: the vGPU goes away (a reboot, an operator)
    fs.write(host.mdev_devices / lost.id / "remove", "1")
    assert lost.id not in mdevs(host)
    rows = len(store.audit_rows())

    rep = reconcile(host, store, check=True)
    assert not rep.in_sync and [m.split()[0] for m in rep.missing] == [lost.id]
    assert OWNER_Y in rep.missing[0] and rep.recreated == []
    assert [o.split()[0] for o in rep.orphans] == [foreign]
    assert lost.id not in mdevs(host) and len(store.audit_rows()) == rows     # check changed nothing
    assert cli(host, "reconcile", "--check") == 1
    assert "missing: " + lost.id in capsys.readouterr().out

    rep = reconcile(host, store)
    assert rep.recreated == [lost.id] and rep.in_sync and rep.failed == []
    assert [o.split()[0] for o in rep.orphans] == [foreign]
    assert mdev_type(host, lost.id) == "nvidia-566" and mdev_parent(host, lost.id) == str(A40)
    assert (host.mdev_devices / lost.id / "nvidia" / "vgpu_params").read_text().strip() == "frame_rate_limiter=0"
    assert sorted(mdevs(host)) == sorted([kept.id, lost.id, foreign])           # foreign left alone
    assert mdev_type(host, foreign) == "nvidia-566"
    assert records_by_id(store)[lost.id].owner == OWNER_Y
    new_rows = store.audit_rows()[rows:]
    assert new_rows and all(r.operation.startswith("reconcile") for r in new_rows)
    assert new_rows[0].value == lost.id and new_rows[0].result == "ok"
    assert cli(host, "reconcile", "--check") == 0
    out = capsys.readouterr().out
    assert "in sync" in out and "foreign (left alone): " + foreign in out


def test_reconcile_recreates_a_vendor_vfio_vgpu_on_its_vf(make_host):
    host = make_host("l40s-vendor-vfio")
    store = store_of(host)
    out = create(host, store, profile="L40S-24Q", gpu=L40S_1)
    Sysfs(host).write(host.pci_device(out.id) / "nvidia" / "current_vgpu_type", "0")
    assert current_type(host, out.id) == "0"
    assert cli(host, "reconcile", "--check") == 1
    rep = reconcile(host, store)
    assert rep.recreated == [out.id] and rep.in_sync
    assert current_type(host, out.id) == "1155"
    assert cli(host, "reconcile", "--check") == 0


# ---------------------------------------------------------------------------
# errors, params, dry-run, audit

def test_params_are_written_and_read_back(make_host):
    host = make_host("a40-mdev")
    store = store_of(host)
    out = create(host, store, profile="A40-8Q", params="frame_rate_limiter=0,disable_vnc=1")
    ppath = host.mdev_devices / out.id / "nvidia" / "vgpu_params"
    assert ppath.read_text().strip() == "frame_rate_limiter=0,disable_vnc=1"
    assert records_by_id(store)[out.id].params == "frame_rate_limiter=0,disable_vnc=1"
    placement, *rows = store.audit_rows()
    assert placement.path == "(placement)" and placement.value.startswith("first-fit: 0000:81:00.0")
    assert [r.value for r in rows] == [out.id, "frame_rate_limiter=0,disable_vnc=1"]
    assert rows[1].path == host.relative(ppath) and rows[1].result == "ok"

    # a vendor-VFIO VF has no vgpu_params: tests/test_vgpu_params.py


def test_dry_run_shows_placement_and_steps_and_writes_nothing(make_host, capsys):
    host = make_host("a40-mdev")
    uuid = "2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a"
    code = cli(host, "vgpu", "create", "--profile", "A40-8Q", "--uuid", uuid, "--params", "frame_rate_limiter=0",
               "--persist", "--dry-run")
    out = capsys.readouterr().out
    assert code == 0
    create_path = host.mdev_bus / str(A40) / "mdev_supported_types" / "nvidia-566" / "create"
    assert f"would create A40-8Q {uuid} on {A40}" in out
    assert "placement: first-fit: 0000:81:00.0" in out
    assert f"write '{uuid}' to {host.relative(create_path)}" in out
    assert f"write 'frame_rate_limiter=0' to {host.relative(host.mdev_devices / uuid / 'nvidia' / 'vgpu_params')}" in out
    assert host.relative(host.mdevctl_d / str(A40) / uuid) in out
    assert mdevs(host) == [] and available(host, A40, "nvidia-566") == 6
    assert store_of(host).audit_rows() == [] and store_of(host).vgpu_records() == []
    assert not (host.mdevctl_d / str(A40) / uuid).exists()


def test_audit_log_holds_the_create_write(make_host):
    host = make_host("a40-mdev")
    store = store_of(host)
    out = create(host, store, profile="A40-8Q", owner=OWNER_X)
    decision, row = store.audit_rows()
    assert decision.path == "(placement)" and "first-fit" in decision.value and decision.operation == row.operation
    assert row.path == host.relative(host.mdev_bus / str(A40) / "mdev_supported_types" / "nvidia-566" / "create")
    assert (row.value, row.result, row.errno) == (out.id, "ok", 0)
    assert "vgpu create A40-8Q" in row.operation and OWNER_X in row.operation
    remove(host, store, out.id)
    last = store.audit_rows()[-1]
    assert last.path == host.relative(host.mdev_devices / out.id / "remove") and last.value == "1"


def test_injected_enospc_is_explained_with_what_still_fits(make_host, capsys):
    host = one_gpu(make_host, "A40", faults='{op: create, device: "0000:41:00.0", errno: ENOSPC}')
    store = store_of(host)
    with pytest.raises(DeviceError) as ei:
        create(host, store, profile="A40-8Q")
    msg = ei.value.message
    assert "ENOSPC" in msg and "no A40-8Q instance left on 0000:41:00.0" in msg
    assert "types that still fit there:" in msg and "A40-4C (" in msg
    assert mdevs(host) == [] and store.vgpu_records() == []
    _decision, row = store.audit_rows()
    assert (row.result, row.errno) == ("ENOSPC", 28)
    assert row.path == host.relative(host.mdev_bus / str(GPU_LO) / "mdev_supported_types" / "nvidia-566" / "create")
    # through the CLI: exit 3, one line
    host2 = one_gpu(make_host, "A40", faults='{op: create, errno: ENOSPC}')
    code = cli(host2, "vgpu", "create", "--profile", "A40-8Q")
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and "ENOSPC" in err and "still fit" in err
    assert mdevs(host2) == []
    # the fault was spent: the next try works
    assert cli(host2, "vgpu", "create", "--profile", "A40-8Q") == 0
    assert len(mdevs(host2)) == 1


def test_injected_enospc_on_vendor_vfio(make_host):
    host = one_gpu(make_host, "L40S", backend="vendor-vfio", numvfs=4,
                   faults='{op: set_type, errno: ENOSPC}')
    store = store_of(host)
    with pytest.raises(DeviceError) as ei:
        create(host, store, profile="L40S-8Q")
    assert "ENOSPC" in ei.value.message and "types that still fit there" in ei.value.message
    assert set(vendor_state(host, GPU_LO).values()) == {"0"} and store.vgpu_records() == []


def test_einval_says_the_type_is_not_supported_there(make_host):
    host = one_gpu(make_host, "A40", faults='{op: create, errno: EINVAL}')
    store = store_of(host)
    with pytest.raises(DeviceError) as ei:
        create(host, store, profile="A40-8Q")
    assert "A40-8Q (type nvidia-566) is not supported on 0000:41:00.0" in ei.value.message
    assert "EINVAL" in ei.value.message and mdevs(host) == []
    assert store.audit_rows()[-1].result == "EINVAL"


def test_a_create_that_does_nothing_is_not_reported_as_success(make_host):
    host = one_gpu(make_host, "A40", faults='{op: create, effect: ignore}')
    store = store_of(host)
    with pytest.raises(DeviceError, match="reported success but reads back"):
        create(host, store, profile="A40-8Q")
    assert mdevs(host) == [] and store.vgpu_records() == []


# ---------------------------------------------------------------------------
# regressions: bugs found in review, fixed

def test_vendor_vfio_equal_size_refusal_names_the_reason(make_host):
    host = make_host("l40s-vendor-vfio")
    store = store_of(host)
    create(host, store, profile="L40S-4C", gpu=L40S_0)
    with pytest.raises(RefusedError) as ei:
        create(host, store, profile="L40S-8C", gpu=L40S_0)
    assert "equal-size" in ei.value.one_line() and "L40S-4C (" in ei.value.one_line()


def test_best_fit_ranks_vendor_vfio_gpus_by_real_capacity(make_host):
    host = make_host(yaml_text=TWO_L40S_MIXED)
    store = store_of(host)
    create(host, store, profile="L40S-24Q", gpu=L40S_0)          # 24 GB left: three 8Q fit
    for _ in range(6):
        create(host, store, profile="L40S-1Q", gpu=L40S_1)       # 42 GB left: five 8Q fit
    best = create(host, store, profile="L40S-8Q", strategy="best-fit", dry_run=True)
    worst = create(host, store, profile="L40S-8Q", strategy="worst-fit", dry_run=True)
    assert (best.gpu, worst.gpu) == (str(L40S_0), str(L40S_1))


def test_placement_reason_counts_instances_not_vfs(make_host):
    host = make_host("l40s-vendor-vfio")
    plan = create(host, store_of(host), profile="L40S-48Q", dry_run=True)
    assert "(1 L40S-48Q free;" in plan.reason
