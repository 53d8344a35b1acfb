"""MIG on the simulator (issue 5): the simulated NVML, the layout planner,
``mig show|enable|disable|apply|assert`` and MIG-backed vGPU availability.

State is read back through the NVML backend (:class:`SimNvml`, a fresh
instance each time, so only host.json carries it) and the simulated sysfs
tree (``available_instances`` / ``creatable_vgpu_types``).  No kernel path
is spelt here: every path comes from :class:`HostRoot`.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from vgpuhost.ops import mig
from vgpuhost.cli.main import main
from vgpuhost.model.errors import DeviceError, InputError, RefusedError
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.io.backends import backend_for
from vgpuhost.io.nvml import NvmlError
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.sim.nvml import SimNvml
from vgpuhost.io.state import StateStore
from vgpuhost.model.values import PciAddress
from vgpuhost.ops.vgpu import create

A = PciAddress.parse
GPU = A("0000:41:00.0")          # the inline specs' GPU
H200 = A("0000:18:00.0")         # the shipped h200-mig spec's GPU

ONE_GPU = """
version: 1
name: one-{model}
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
  processes: [{processes}]
devices:
  - {{bdf: "0000:40:01.0", model: intel-root-port, numa_node: 0}}
  - {{bdf: "0000:41:00.0", model: {model}, upstream: "0000:40:01.0", numa_node: 0,
     vgpu: {{backend: {backend}, sriov_numvfs: {numvfs}}}, mig: {{mode: {mig}}}}}
"""


def spec(model="A100-PCIE-40GB", backend="mdev", numvfs=0, mig_on=False, processes=""):
    return ONE_GPU.format(model=model, backend=backend, numvfs=numvfs, mig=str(mig_on).lower(),
                          processes=processes)


A100_MDEV = spec()                                                            # MIG off, PF is the parent
A100_SRIOV = spec(numvfs=20)
H200_ON = spec("H200-SXM-141GB", "vendor-vfio", 16, mig_on=True)             # MIG on before SR-IOV
H200_NOVF = spec("H200-SXM-141GB", "none", 0)                                # no SR-IOV yet

# mig-parted style configs (all-1g, all-2g, all-3g, all-7g, all-balanced) per board
LAYOUTS = {
    "a100": {
        "all-1g": {"1g.5gb": 7}, "all-2g": {"2g.10gb": 3}, "all-3g": {"3g.20gb": 2},
        "all-7g": {"7g.40gb": 1}, "all-balanced": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1},
        "4g+3g": {"4g.20gb": 1, "3g.20gb": 1}, "all-1g.10gb": {"1g.10gb": 4},
        "2g+1g": {"2g.10gb": 3, "1g.5gb": 1}, "me": {"1g.5gb+me": 1, "1g.5gb": 6},
    },
    "h200": {
        "all-1g": {"1g.18gb": 7}, "all-2g": {"2g.35gb": 3}, "all-3g": {"3g.71gb": 2},
        "all-7g": {"7g.141gb": 1}, "all-balanced": {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1},
        "4g+3g": {"4g.71gb": 1, "3g.71gb": 1}, "all-1g.35gb": {"1g.35gb": 4},
        "2g+1g": {"2g.35gb": 3, "1g.18gb": 1}, "me": {"1g.18gb+me": 1, "1g.18gb": 6},
    },
}


def store_of(host):
    return StateStore(host.state_dir)


def cli(host, *args):
    return main(["--root", str(host.root), *args])


def text(layout):
    return ",".join(f"{k}={v}" for k, v in layout.items())


def gi_counts(host, bdf):
    """GPU instances per profile name, read through a fresh simulated NVML."""
    nv = SimNvml(host)
    names = {p.profile_id: p.name for p in nv.gi_profiles(bdf)}
    return dict(Counter(names[g.profile_id] for g in nv.gpu_instances(bdf)))


def mdev_available(host, parent, name):
    for tdir in (host.mdev_bus / str(parent) / "mdev_supported_types").iterdir():
        if (tdir / "name").read_text().split()[-1] == name:
            return int((tdir / "available_instances").read_text())
    raise AssertionError(name)


def creatable(host, vf):
    lines = (host.pci_device(vf) / "nvidia" / "creatable_vgpu_types").read_text().splitlines()[1:]
    return {line.split(":", 1)[1].strip().split()[-1] for line in lines}


def first_vf(host, pf):
    return SimKernel(host).meta()["gpus"][str(pf)]["vfs"][0]


@pytest.fixture
def a100(make_host):
    host = make_host(yaml_text=A100_MDEV)
    mig.enable(host, store_of(host), GPU)
    return host


@pytest.fixture
def h200(make_host):
    return make_host(yaml_text=H200_ON)


# ---------------------------------------------------------------------------
# every mig-parted style layout fits, apply is idempotent, and moves between layouts

@pytest.mark.parametrize("board,name", [(b, n) for b in LAYOUTS for n in LAYOUTS[b]])
def test_layout_fits_applies_and_second_apply_is_a_noop(make_host, board, name):
    host = make_host(yaml_text=H200_ON if board == "h200" else A100_MDEV)
    bdf = GPU
    store = store_of(host)
    if board == "a100":
        mig.enable(host, store, bdf)
    layout = LAYOUTS[board][name]
    dry = mig.apply(host, store, bdf, text(layout), dry_run=True)
    assert dry.changed and dry.dry_run and gi_counts(host, bdf) == {}
    out = mig.apply(host, store, bdf, text(layout))
    assert out.changed and gi_counts(host, bdf) == layout == out.layout_after
    rows = len(store.audit_rows())
    assert rows == sum(layout.values()) + (1 if board == "a100" else 0)
    again = mig.apply(host, store, bdf, text(layout))
    assert not again.changed and again.steps == [] and len(store.audit_rows()) == rows
    assert cli(host, "mig", "assert", "--gpu", str(bdf), text(layout)) == 0
    # placements are real: starts allowed by the profile, no overlap, compute within 7 slices
    nv = SimNvml(host)
    profs = {p.profile_id: p for p in nv.gi_profiles(bdf)}
    used = 0
    for g in nv.gpu_instances(bdf):
        assert (g.start, g.size) in profs[g.profile_id].placements
        mask = ((1 << g.size) - 1) << g.start
        assert not used & mask
        used |= mask
    assert sum(profs[g.profile_id].slices for g in nv.gpu_instances(bdf)) <= 7


@pytest.mark.parametrize("board", ["a100", "h200"])
def test_moves_between_every_pair_of_layouts(make_host, board):
    host = make_host(yaml_text=H200_ON if board == "h200" else A100_MDEV)
    store = store_of(host)
    if board == "a100":
        mig.enable(host, store, GPU)
    names = list(LAYOUTS[board])
    for a, b in itertools.permutations(names[:5], 2):
        mig.apply(host, store, GPU, text(LAYOUTS[board][a]))
        assert gi_counts(host, GPU) == LAYOUTS[board][a]
        mig.apply(host, store, GPU, text(LAYOUTS[board][b]))
        assert gi_counts(host, GPU) == LAYOUTS[board][b]
    mig.apply(host, store, GPU, "none")
    assert gi_counts(host, GPU) == {}


def test_wanted_instances_are_kept_when_the_rest_fits(a100):
    store = store_of(a100)
    mig.apply(a100, store, GPU, "3g.20gb=1")
    before = SimNvml(a100).gpu_instances(GPU)
    out = mig.apply(a100, store, GPU, "3g.20gb=1,2g.10gb=1,1g.5gb=2")
    assert len(out.steps) == 3 and all("CreateGpuInstance" in s for s in out.steps)
    assert set(before) <= set(SimNvml(a100).gpu_instances(GPU))
    out = mig.apply(a100, store, GPU, "3g.20gb=1")
    assert len(out.steps) == 3 and all("Destroy" in s for s in out.steps)
    assert SimNvml(a100).gpu_instances(GPU) == before


# ---------------------------------------------------------------------------
# refusals before any change

@pytest.mark.parametrize("board,layout,why", [
    ("h200", "1g.18gb=7,7g.141gb=1", "7x1g.18gb + 1x7g.141gb needs 15 of 8 memory slices"),
    ("a100", "1g.5gb=7,7g.40gb=1", "7x1g.5gb + 1x7g.40gb needs 15 of 8 memory slices"),
    ("a100", "1g.5gb=8", "exceeds the device's maximum of 7 1g.5gb"),
    ("h200", "3g.71gb=3", "exceeds the device's maximum of 2 3g.71gb"),
    ("h200", "4g.71gb=1,2g.35gb=2", "needs 8 of 7 compute slices"),
    ("a100", "1g.10gb=3,3g.20gb=1", "needs 10 of 8 memory slices"),
])
def test_layout_that_cannot_fit_is_refused_before_any_change(make_host, capsys, board, layout, why):
    host = make_host(yaml_text=H200_ON if board == "h200" else A100_MDEV)
    if board == "a100":
        SimNvml(host).set_mig_mode(GPU, True)
    store = store_of(host)
    mig.apply(host, store, GPU, "1g.5gb=1" if board == "a100" else "1g.18gb=1")
    before = SimNvml(host).gpu_instances(GPU)
    rows = len(store.audit_rows())
    with pytest.raises(RefusedError) as ei:
        mig.apply(host, store, GPU, layout)
    assert why in ei.value.message and "nothing was changed" in ei.value.hint
    assert SimNvml(host).gpu_instances(GPU) == before and len(store.audit_rows()) == rows
    capsys.readouterr()
    assert cli(host, "mig", "apply", "--gpu", str(GPU), layout) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err


def test_7x1g_plus_7g_leaves_an_untouched_gpu_and_an_empty_audit(h200):
    store = store_of(h200)
    with pytest.raises(RefusedError, match="needs 15 of 8 memory slices"):
        mig.apply(h200, store, GPU, "1g.18gb=7,7g.141gb=1")
    assert gi_counts(h200, GPU) == {} and store.audit_rows() == []
    assert SimKernel(h200).meta()["gpus"][str(GPU)]["gpu_instances"] == []


def test_apply_needs_mig_mode_on(make_host):
    host = make_host(yaml_text=A100_MDEV)
    with pytest.raises(RefusedError) as ei:
        mig.apply(host, store_of(host), GPU, "1g.5gb=1")
    assert "mig enable --gpu 0000:41:00.0" in ei.value.message and "MIG mode -> SR-IOV" in ei.value.hint


def test_malformed_layouts_are_input_errors():
    for bad in ("3g", "3g.71gb=x", "3g.71gb=1,3g.71gb=2", "1g.18gb=1;2g.35gb=1", "1g.18gb=999"):
        with pytest.raises(InputError):
            mig.parse_layout(bad)
    assert mig.parse_layout(" 3G.71GB = 1 , 1g.18gb ,2g.35gb=0") == {"3g.71gb": 1, "1g.18gb": 1}
    assert mig.parse_layout("none") == {}
    for blank in ("", "   "):          # an unset shell variable must not wipe every GPU instance
        with pytest.raises(InputError, match="empty MIG layout"):
            mig.parse_layout(blank)


# ---------------------------------------------------------------------------
# names resolve per device

def test_names_resolve_per_device_from_what_the_device_reports(a100, h200):
    a_ids = {p.name: p.profile_id for p in SimNvml(a100).gi_profiles(GPU)}
    h_ids = {p.name: p.profile_id for p in SimNvml(h200).gi_profiles(GPU)}
    assert a_ids["1g.5gb"] == 19 == h_ids["1g.18gb"]       # one id, two names
    mig.apply(a100, store_of(a100), GPU, "1G.5GB=1")
    assert gi_counts(a100, GPU) == {"1g.5gb": 1}
    with pytest.raises(InputError) as ei:
        mig.apply(h200, store_of(h200), GPU, "1g.5gb=1")
    assert "unknown GPU-instance profile '1g.5gb'" in ei.value.message
    assert "near matches:" in ei.value.hint and "1g.18gb" in ei.value.hint
    assert gi_counts(h200, GPU) == {} and store_of(h200).audit_rows() == []
    assert SimNvml(h200).gi_profiles(GPU)[0].memory_mib == 16384      # as a real H200 reports 1g.18gb (mig-parted #120)


# ---------------------------------------------------------------------------
# MIG mode: blockers, pending, disable

def test_enable_refused_while_vgpus_exist(make_host, capsys):
    host = make_host(yaml_text=A100_MDEV)
    store = store_of(host)
    create(host, store, profile="A100-4C")
    with pytest.raises(RefusedError, match="1 vGPU"):
        mig.enable(host, store, GPU)
    assert SimNvml(host).mig_mode(GPU) == (False, False)
    with pytest.raises(NvmlError) as ei:
        SimNvml(host).set_mig_mode(GPU, True)
    assert ei.value.nvml_name == "NVMLError_InUse" and ei.value.call == "nvmlDeviceSetMigMode"
    capsys.readouterr()
    assert cli(host, "mig", "enable", "--gpu", str(GPU)) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_enable_refused_while_processes_use_the_gpu(make_host):
    host = make_host(yaml_text=A100_MDEV)
    k = SimKernel(host)
    meta = k.meta()
    meta["gpus"][str(GPU)]["compute_processes"] = 2
    k.save_meta(meta)
    with pytest.raises(RefusedError, match="2 process"):
        mig.enable(host, store_of(host), GPU)
    assert SimNvml(host).mig_mode(GPU) == (False, False)


def test_enable_refused_while_vendor_vfio_vfs_exist_naming_the_order(make_host, capsys):
    host = make_host("h200-mig")
    with pytest.raises(RefusedError) as ei:
        mig.enable(host, store_of(host), H200)
    assert "16 SR-IOV VFs" in ei.value.message and "MIG mode -> SR-IOV -> GPU instances" in ei.value.message
    assert "sriov-manage -d" in ei.value.hint
    assert SimNvml(host).mig_mode(H200) == (False, False) and store_of(host).audit_rows() == []
    capsys.readouterr()
    assert cli(host, "mig", "enable", "--gpu", str(H200)) == 2
    # without VFs the same board enables at once
    novf = make_host(yaml_text=H200_NOVF)
    out = mig.enable(novf, store_of(novf), GPU)
    assert out.changed and out.mig_mode == {"current": True, "pending": True}


def test_pending_mode_change_is_reported_until_a_reset(make_host, capsys):
    host = make_host(yaml_text=A100_MDEV)
    k = SimKernel(host)
    meta = k.meta()
    meta["gpus"][str(GPU)]["mig_reset_required"] = True
    k.save_meta(meta)
    store = store_of(host)
    out = mig.enable(host, store, GPU)
    assert out.changed and out.mig_mode == {"current": False, "pending": True}
    assert any("pending" in n for n in out.notes)
    assert SimNvml(host).mig_mode(GPU) == (False, True)
    # show reports it, in text and JSON
    capsys.readouterr()
    assert cli(host, "mig", "show") == 0
    assert "MIG off (pending: on after a GPU reset)" in capsys.readouterr().out
    assert cli(host, "--json", "mig", "show", "--gpu", str(GPU)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "vgpuhost.mig-show/v1"
    assert doc["gpus"][0]["mig_mode"] == {"current": False, "pending": True} and doc["gpus"][0]["pending_change"]
    # enabling again is a no-op that still says pending; apply is refused until the reset
    again = mig.enable(host, store, GPU)
    assert not again.changed and any("pending" in n for n in again.notes)
    with pytest.raises(RefusedError, match="pending"):
        mig.apply(host, store, GPU, "1g.5gb=1")
    assert cli(host, "mig", "assert", "--gpu", str(GPU), "1g.5gb=1") == 1
    assert "(mig mode): wanted on, found off (on pending)" in capsys.readouterr().out
    SimNvml(host).reset(GPU)
    assert SimNvml(host).mig_mode(GPU) == (True, True)
    mig.apply(host, store, GPU, "1g.5gb=1")
    assert gi_counts(host, GPU) == {"1g.5gb": 1}


def test_persistenced_leaves_the_change_pending(make_host):
    host = make_host(yaml_text=spec(processes="nvidia-persistenced"))
    out = mig.enable(host, store_of(host), GPU)
    assert out.mig_mode == {"current": False, "pending": True}
    assert any("nvidia-persistenced" in n for n in out.notes)


def test_disable_destroys_gpu_instances_first_and_restores_time_sliced_types(a100):
    store = store_of(a100)
    assert mdev_available(a100, GPU, "A100-4C") == 0               # MIG on: time-sliced types off
    mig.apply(a100, store, GPU, "3g.20gb=2")
    dry = mig.disable(a100, store, GPU, dry_run=True)
    assert len(dry.steps) == 3 and gi_counts(a100, GPU) == {"3g.20gb": 2}
    out = mig.disable(a100, store, GPU)
    assert out.mig_mode == {"current": False, "pending": False} and out.layout_after == {}
    assert SimKernel(a100).meta()["gpus"][str(GPU)]["gpu_instances"] == []
    assert mdev_available(a100, GPU, "A100-4C") == 10
    assert [r.path for r in store.audit_rows()][-3:] == ["nvml:nvmlGpuInstanceDestroy"] * 2 + \
        ["nvml:nvmlDeviceSetMigMode"]
    assert not mig.disable(a100, store, GPU).changed


def test_not_mig_capable_and_unknown_gpu(make_host, capsys):
    host = make_host("a40-mdev")
    with pytest.raises(RefusedError, match="not MIG-capable"):
        mig.apply(host, store_of(host), A("0000:81:00.0"), "1g.5gb=1")
    with pytest.raises(InputError, match="no NVIDIA GPU at 0000:99:00.0"):
        mig.enable(host, store_of(host), A("0000:99:00.0"))
    assert cli(host, "mig", "show") == 0
    assert "not MIG-capable" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# MIG-backed vGPUs

def test_mig_backed_types_become_available_once_gpu_instances_exist(make_host, capsys):
    host = make_host(yaml_text=A100_SRIOV)
    store = store_of(host)
    vf = first_vf(host, GPU)

    def avail(name):
        capsys.readouterr()
        assert cli(host, "--json", "types", "--gpu", str(GPU)) == 0
        doc = json.loads(capsys.readouterr().out)
        return next(t["available_instances"] for t in doc["types"] if t["name"] == name)

    assert avail("A100-1-5C") == 0 and avail("A100-4C") > 0
    mig.enable(host, store, GPU)
    assert avail("A100-1-5C") == 0 and avail("A100-4C") == 0        # MIG on, no GPU instance yet
    mig.apply(host, store, GPU, "1g.5gb=1,3g.20gb=1")
    assert avail("A100-1-5C") > 0 and avail("A100-3-20C") > 0 and avail("A100-2-10C") == 0
    assert mdev_available(host, vf, "A100-1-5C") == 1
    out = create(host, store, profile="A100-1-5C")
    # the one 1g.5gb GPU instance now holds a vGPU: no second one
    assert mdev_available(host, first_vf(host, GPU), "A100-1-5C") == 0
    assert all(mdev_available(host, p, "A100-1-5C") == 0
               for p in SimKernel(host).meta()["gpus"][str(GPU)]["vfs"])
    with pytest.raises(RefusedError):
        create(host, store, profile="A100-1-5C")
    # its GPU instance cannot go while the vGPU runs, and MIG mode cannot change
    with pytest.raises(RefusedError, match="vGPU"):
        mig.apply(host, store, GPU, "3g.20gb=1")
    with pytest.raises(RefusedError, match="vGPU"):
        mig.disable(host, store, GPU)
    gi = next(g for g in SimNvml(host).gpu_instances(GPU) if g.profile_id == 19)
    with pytest.raises(NvmlError) as ei:
        SimNvml(host).destroy_gpu_instance(GPU, gi.gi_id)
    assert ei.value.nvml_name == "NVMLError_InUse"
    # adding GPU instances beside a running vGPU is fine
    mig.apply(host, store, GPU, "1g.5gb=2,3g.20gb=1")
    assert mdev_available(host, vfs_free(host, out.parent), "A100-1-5C") == 1


def vfs_free(host, taken):
    return next(v for v in SimKernel(host).meta()["gpus"][str(GPU)]["vfs"] if v != taken)


def test_h200_mig_backed_type_creatable_on_vfs_once_a_gpu_instance_exists(h200):
    vf = first_vf(h200, GPU)
    assert "H200X-1-18C" not in creatable(h200, vf)
    mig.apply(h200, store_of(h200), GPU, "1g.18gb=1")
    assert "H200X-1-18C" in creatable(h200, vf) and "H200X-1-18CME" not in creatable(h200, vf)
    assert "H200X-4C" not in creatable(h200, vf)


# ---------------------------------------------------------------------------
# verification and rollback

class FailingNvml(SimNvml):
    """Fails the n-th GPU-instance creation with NVMLError_InsufficientResources."""

    def __init__(self, host, fail_at):
        super().__init__(host)
        self.calls = 0
        self.fail_at = fail_at

    def create_gpu_instance(self, bdf, profile_id, start):
        self.calls += 1
        if self.calls == self.fail_at:
            raise NvmlError("nvmlDeviceCreateGpuInstanceWithPlacement", "NVMLError_InsufficientResources")
        return super().create_gpu_instance(bdf, profile_id, start)


def test_failed_create_is_undone_and_audited(a100):
    store = store_of(a100)
    mig.apply(a100, store, GPU, "7g.40gb=1")
    before = gi_counts(a100, GPU)
    with pytest.raises(DeviceError) as ei:
        mig.apply(a100, store, GPU, "3g.20gb=1,2g.10gb=1,1g.5gb=2", backend=FailingNvml(a100, 3))
    assert "NVMLError_InsufficientResources" in ei.value.message and "undone" in ei.value.message
    assert gi_counts(a100, GPU) == before
    rows = store.audit_rows()
    failed = [r for r in rows if r.result != "ok"]
    assert len(failed) == 1 and failed[0].result == "ENOSPC" and "NVMLError_InsufficientResources" in failed[0].value


class LyingNvml(SimNvml):
    """Reports success for a creation that never happened."""

    def create_gpu_instance(self, bdf, profile_id, start):
        from vgpuhost.model.nvml import GpuInstance
        return GpuInstance(99, profile_id, start, 1)


def test_apply_never_reports_success_that_did_not_happen(a100):
    with pytest.raises(DeviceError, match="reads back none"):
        mig.apply(a100, store_of(a100), GPU, "1g.5gb=1", backend=LyingNvml(a100))


def test_assert_reports_drift_with_a_diff(a100, capsys):
    mig.apply(a100, store_of(a100), GPU, "3g.20gb=1,1g.5gb=2")
    capsys.readouterr()
    assert cli(a100, "mig", "assert", "--gpu", str(GPU), "3g.20gb=1,1g.5gb=2") == 0
    assert "in sync" in capsys.readouterr().out
    assert cli(a100, "--json", "mig", "assert", "--gpu", str(GPU), "3g.20gb=2") == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "vgpuhost.mig-assert/v1" and not doc["in_sync"]
    assert {"profile": "3g.20gb", "wanted": 2, "actual": 1} in doc["diff"]
    assert {"profile": "1g.5gb", "wanted": 0, "actual": 2} in doc["diff"]


def test_cli_apply_json_and_dry_run_touch_nothing(make_host, capsys):
    host = make_host(yaml_text=H200_ON)
    capsys.readouterr()
    assert cli(host, "--json", "mig", "apply", "--gpu", str(GPU), "3g.71gb=1,2g.35gb=1,1g.18gb=1",
               "--dry-run") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "vgpuhost.mig/v1" and doc["dry_run"] and len(doc["steps"]) == 3
    assert doc["steps"][0].startswith("nvmlDeviceCreateGpuInstanceWithPlacement 3g.71gb")
    assert gi_counts(host, GPU) == {} and not (host.state_dir / "state.db").exists()
    assert cli(host, "mig", "apply", "--gpu", str(GPU), "3g.71gb=1,2g.35gb=1,1g.18gb=1") == 0
    assert "applied 1x1g.18gb + 1x2g.35gb + 1x3g.71gb" in capsys.readouterr().out
    assert cli(host, "mig", "apply", "--gpu", str(GPU), "3g.71gb=1,2g.35gb=1,1g.18gb=1") == 0
    assert capsys.readouterr().out.startswith("no change:")
    assert cli(host, "mig", "apply", "--gpu", str(GPU), "bogus") == 2


# ---------------------------------------------------------------------------
# the rest of the simulated NVML: mixed-size mode and the scheduler

def test_heterogeneous_mode_and_scheduler_state_live_in_host_json(make_host):
    host = make_host(yaml_text=spec("H200-SXM-141GB", "vendor-vfio", 16))
    nv = SimNvml(host)
    assert nv.device_name(GPU) == "NVIDIA H200" and nv.device_uuid(GPU).startswith("GPU-")
    assert nv.heterogeneous_mode(GPU) is False
    nv.set_heterogeneous_mode(GPU, True)
    assert SimNvml(host).heterogeneous_mode(GPU) is True
    caps = nv.scheduler_caps(GPU)
    assert caps.policies == ("best-effort", "equal-share", "fixed-share") and caps.arr_supported
    assert nv.scheduler_state(GPU) == SchedulerState("best-effort")
    with pytest.raises(NvmlError) as ei:
        nv.set_scheduler_state(GPU, SchedulerState("fixed-share"))
    assert ei.value.nvml_name == "NVMLError_NotSupported"                 # fixed share, mixed-size
    with pytest.raises(NvmlError) as ei:
        nv.set_scheduler_state(GPU, SchedulerState("equal-share", timeslice_ms=31))
    assert ei.value.nvml_name == "NVMLError_InvalidArgument"
    want = SchedulerState("equal-share", arr=True, frequency_hz=960, avg_factor=60)
    nv.set_scheduler_state(GPU, want)
    assert SimNvml(host).scheduler_state(GPU) == want
    # a running vGPU blocks both (a scheduler set answers NOT_SUPPORTED then, as the driver does)
    create(host, store_of(host), profile="H200X-8C")
    assert SimNvml(host).active_vgpus(GPU) == 1
    for call, args, name in (("set_heterogeneous_mode", (False,), "NVMLError_InUse"),
                             ("set_scheduler_state", (SchedulerState("best-effort"),), "NVMLError_NotSupported")):
        with pytest.raises(NvmlError) as ei:
            getattr(SimNvml(host), call)(GPU, *args)
        assert ei.value.nvml_name == name


def test_device_level_scheduler_is_not_supported_in_mig_mode(h200):
    nv = SimNvml(h200)
    for call, args in (("scheduler_state", ()), ("set_scheduler_state", (SchedulerState("equal-share"),))):
        with pytest.raises(NvmlError) as ei:
            getattr(nv, call)(GPU, *args)
        assert ei.value.not_supported


def test_nvml_sees_only_gpus_on_the_nvidia_driver(make_host):
    from vgpuhost.ops.passthrough import prepare
    host = make_host(yaml_text=A100_MDEV)
    prepare(host, store_of(host), GPU)
    with pytest.raises(NvmlError) as ei:
        SimNvml(host).mig_mode(GPU)
    assert ei.value.nvml_name == "NVMLError_NotFound"
    with pytest.raises(RefusedError, match="bound to vfio-pci"):
        mig.enable(host, store_of(host), GPU)


def test_create_gpu_instance_validates_like_nvml(a100):
    nv = SimNvml(a100)
    cases = [(99, 0, "NVMLError_InvalidArgument"), (9, 2, "NVMLError_InvalidArgument")]
    for pid, start, name in cases:
        with pytest.raises(NvmlError) as ei:
            nv.create_gpu_instance(GPU, pid, start)
        assert ei.value.nvml_name == name
    nv.create_gpu_instance(GPU, 9, 0)
    for pid, start in ((14, 2), (0, 0), (5, 0)):
        with pytest.raises(NvmlError) as ei:
            nv.create_gpu_instance(GPU, pid, start)
        assert ei.value.nvml_name == "NVMLError_InsufficientResources"
    with pytest.raises(NvmlError) as ei:
        nv.destroy_gpu_instance(GPU, 42)
    assert ei.value.nvml_name == "NVMLError_NotFound"
    nv.set_mig_mode(GPU, True)                      # already on: no-op
    with pytest.raises(NvmlError) as ei:
        nv.set_mig_mode(GPU, False)                 # GPU instances exist
    assert ei.value.nvml_name == "NVMLError_InUse"


# ---------------------------------------------------------------------------
# a real host without NVML

def test_mig_show_on_a_real_host_without_nvml_is_one_line_exit_2(tmp_path, capsys):
    root = tmp_path / "real"
    (root / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    (root / "proc").mkdir()
    host = HostRoot(root)
    assert not host.is_simulated
    code = main(["--root", str(root), "mig", "show"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "NVML" in err
    assert main(["--root", str(root), "gpus"]) == 0                   # inventory still works
    with pytest.raises(Exception):
        backend_for(host)
