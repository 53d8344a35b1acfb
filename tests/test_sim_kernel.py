"""The simulated kernel (vgpuhost.sim.kernel) behind Sysfs.write.

Every write goes through :class:`vgpuhost.sysfs.Sysfs` on a host root built
with :func:`vgpuhost.sim.build.materialise`; results are checked by reading
the tree back (links, file contents), as a caller on a real host would.
"""

import errno
import json
import multiprocessing
import os
import re
import signal
import threading
import uuid as uuidlib
from pathlib import Path

import pytest

from vgpuhost.model.errors import SysfsError
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.sim.build import materialise
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.sim.spec import parse_spec
from vgpuhost.io.sysfs import Sysfs

A40_SPEC = """
version: 1
name: a40
host: {modules: [vfio_pci, nvidia], processes: [PROCS]}
devices:
  - {bdf: "0000:40:01.0", model: intel-root-port}
  - {bdf: "0000:41:00.0", model: A40, upstream: "0000:40:01.0", vgpu: {backend: mdev}}
  - {bdf: "0000:41:00.1", model: nvidia-hda, upstream: "0000:40:01.0"}
"""

A100_SPEC = """
version: 1
name: a100
host: {modules: [vfio_pci, nvidia]}
devices:
  - {bdf: "0000:41:00.0", model: A100-PCIE-40GB, vgpu: {backend: mdev, sriov_numvfs: 4}}
"""

L40S_SPEC = """
version: 1
name: l40s
host: {modules: [vfio_pci, nvidia]}
devices:
  - {bdf: "0000:81:00.0", model: L40S, vgpu: {backend: vendor-vfio, sriov_numvfs: 4}}
"""

PASSTHROUGH_SPEC = """
version: 1
name: turing
host: {modules: [vfio_pci, nvidia]}
devices:
  - {bdf: "0000:0a:00.0", model: RTX2080-TU104}
  - {bdf: "0000:0a:00.1", model: tu104-hda}
  - {bdf: "0000:0a:00.2", model: tu104-xhci}
  - {bdf: "0000:0a:00.3", model: tu104-ucsi}
  - {bdf: "0000:00:17.0", model: intel-sata-ahci}
faults:
  - {op: bind, device: "0000:0a:00.1", errno: EIO, count: 1}
  - {op: probe, device: "0000:00:17.0", effect: ignore, count: 0}
"""

A40 = "0000:41:00.0"
A40_HDA = "0000:41:00.1"
A40_8Q, A40_1B, A40_8C = "nvidia-566", "nvidia-557", "nvidia-574"
A100 = "0000:41:00.0"
A100_VFS = ["0000:41:00.4", "0000:41:00.5", "0000:41:00.6", "0000:41:00.7"]
A100_4C = "nvidia-468"
L40S_VFS = ["0000:81:00.4", "0000:81:00.5", "0000:81:00.6", "0000:81:00.7"]
TU_GPU, TU_HDA, TU_XHCI, TU_UCSI = "0000:0a:00.0", "0000:0a:00.1", "0000:0a:00.2", "0000:0a:00.3"
SATA = "0000:00:17.0"


def build(tmp_path, text, name="root"):
    host = materialise(parse_spec(text), tmp_path / name)
    return host, Sysfs(host)


def new_uuid():
    return str(uuidlib.uuid4())


def meta(host):
    from vgpuhost.sim.kernel import SimKernel
    return SimKernel(host).meta()


def write_err(sysfs, path, value):
    with pytest.raises(SysfsError) as ei:
        sysfs.write(path, value)
    assert ei.value.path == str(path)
    assert ei.value.value == value
    return ei.value.errno


@pytest.fixture
def a40(tmp_path):
    return build(tmp_path, A40_SPEC.replace("PROCS", ""))


def mtype(host, parent, tid):
    return host.pci_device(parent) / "mdev_supported_types" / tid


def avail(sysfs, host, parent, tid):
    return sysfs.read_int(mtype(host, parent, tid) / "available_instances")


def vf_nvidia(host, vf):
    return host.pci_device(vf) / "nvidia"


def creatable(sysfs, host, vf):
    return sysfs.read(vf_nvidia(host, vf) / "creatable_vgpu_types").splitlines()


def driver(sysfs, host, bdf):
    return sysfs.link_name(host.pci_device(bdf) / "driver")


def group_of(host, bdf):
    return os.path.basename(os.readlink(host.pci_device(bdf) / "iommu_group"))


# --- mdev create / remove -------------------------------------------------------
def test_create_lays_out_mdev_like_the_kernel(a40):
    host, sysfs = a40
    u = new_uuid()
    next_group = meta(host)["next_iommu_group"]
    sysfs.write(mtype(host, A40, A40_8Q) / "create", u.upper() + "\n")  # echo adds a newline
    pdir = Path(os.path.realpath(host.pci_device(A40)))
    mdir = pdir / u  # named in lower case, as the kernel prints it
    assert mdir.is_dir()
    assert os.readlink(mdir / "mdev_type") == f"../mdev_supported_types/{A40_8Q}"
    assert (mdir / "remove").read_text() == ""
    assert sysfs.read(mdir / "nvidia" / "vgpu_params") == ""
    assert os.readlink(mtype(host, A40, A40_8Q) / "devices" / u) == f"../../../{u}"
    bus_link = host.mdev_devices / u
    assert os.readlink(bus_link) == os.path.relpath(mdir, bus_link.parent)
    assert os.path.realpath(bus_link) == str(mdir)
    # a new IOMMU group of its own
    gdir = Path(os.path.realpath(mdir / "iommu_group"))
    assert gdir == Path(os.path.realpath(host.iommu_groups / str(next_group)))
    assert not os.readlink(mdir / "iommu_group").startswith("/")
    assert os.path.realpath(gdir / "devices" / u) == str(mdir)
    assert sysfs.read(gdir / "type") == "DMA"
    assert meta(host)["next_iommu_group"] == next_group + 1
    assert (host.dev_vfio / str(next_group)).exists()
    # bound to the vGPU manager's VFIO driver
    assert sysfs.link_name(mdir / "driver") == "nvidia-vgpu-vfio"
    assert os.path.isdir(mdir / "driver")
    assert avail(sysfs, host, A40, A40_8Q) == 5


def test_create_fills_a40_then_enospc(a40):
    host, sysfs = a40
    create = mtype(host, A40, A40_8Q) / "create"
    for _ in range(6):
        sysfs.write(create, new_uuid())
    assert avail(sysfs, host, A40, A40_8Q) == 0
    u = new_uuid()
    assert write_err(sysfs, create, u) == errno.ENOSPC
    assert not os.path.lexists(host.mdev_devices / u)
    assert len(sysfs.listdir(host.mdev_devices)) == 6
    assert len(sysfs.listdir(mtype(host, A40, A40_8Q) / "devices")) == 6


def test_create_recomputes_capacity_not_trusting_the_file(a40):
    host, sysfs = a40
    for _ in range(6):
        sysfs.write(mtype(host, A40, A40_8Q) / "create", new_uuid())
    # someone scribbles on the file behind the kernel's back
    (mtype(host, A40, A40_8Q) / "available_instances").write_text("3\n")
    assert write_err(sysfs, mtype(host, A40, A40_8Q) / "create", new_uuid()) == errno.ENOSPC


def test_equal_size_rule(a40):
    host, sysfs = a40
    assert avail(sysfs, host, A40, A40_1B) == 32
    sysfs.write(mtype(host, A40, A40_8Q) / "create", new_uuid())
    assert avail(sysfs, host, A40, A40_1B) == 0
    assert avail(sysfs, host, A40, A40_8C) == 5
    assert write_err(sysfs, mtype(host, A40, A40_1B) / "create", new_uuid()) == errno.ENOSPC
    sysfs.write(mtype(host, A40, A40_8C) / "create", new_uuid())
    assert avail(sysfs, host, A40, A40_8Q) == 4


@pytest.mark.parametrize("bad", ["", "nope", "2b9a4c1e5d3f4e7a8c6b0f1e2d3c4b5a",
                                 "2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5", "{2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a}",
                                 "2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5g"])
def test_create_bad_uuid_einval(a40, bad):
    host, sysfs = a40
    assert write_err(sysfs, mtype(host, A40, A40_8Q) / "create", bad) == errno.EINVAL
    assert sysfs.listdir(host.mdev_devices) == []
    assert avail(sysfs, host, A40, A40_8Q) == 6


def test_create_duplicate_uuid_eexist(a40):
    host, sysfs = a40
    u = new_uuid()
    sysfs.write(mtype(host, A40, A40_8Q) / "create", u)
    assert write_err(sysfs, mtype(host, A40, A40_8C) / "create", u) == errno.EEXIST
    assert write_err(sysfs, mtype(host, A40, A40_8Q) / "create", u.upper()) == errno.EEXIST
    assert sysfs.listdir(host.mdev_devices) == [u]


def test_remove_restores_capacity_and_cleans_up(a40):
    host, sysfs = a40
    u = new_uuid()
    sysfs.write(mtype(host, A40, A40_8Q) / "create", u)
    mdir = Path(os.path.realpath(host.mdev_devices / u))
    gdir = Path(os.path.realpath(mdir / "iommu_group"))
    assert avail(sysfs, host, A40, A40_1B) == 0
    assert write_err(sysfs, host.mdev_devices / u / "remove", "0") == errno.EINVAL
    assert mdir.is_dir()
    sysfs.write(host.mdev_devices / u / "remove", "1\n")
    assert not mdir.exists()
    assert not os.path.lexists(host.mdev_devices / u)
    assert sysfs.listdir(mtype(host, A40, A40_8Q) / "devices") == []
    assert not gdir.exists()
    assert not (host.dev_vfio / gdir.name).exists()
    assert avail(sysfs, host, A40, A40_8Q) == 6
    assert avail(sysfs, host, A40, A40_1B) == 32


# --- a writer killed inside a create or remove (one write(2) in the kernel) -------------
#: the simulator's own steps that change the tree while it makes or takes away an mdev
_TREE_STEPS = ("_symlink", "_create_file", "_unlink", "_rmtree")


def _tree(host):
    """What a reader sees of ``sys/`` and ``dev/``: ``{path: link target, file content or 'dir'}``."""
    out = {}
    for top in ("sys", "dev"):
        for dirpath, dirnames, filenames in os.walk(host.root / top):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                rel = os.path.relpath(p, host.root)
                if os.path.islink(p):
                    out[rel] = "-> " + os.readlink(p)
                elif os.path.isdir(p):
                    out[rel] = "dir"
                else:
                    with open(p, "rb") as f:
                        out[rel] = f.read()
    return out


def _write_killed_at_step(host, path, value, step, steps=_TREE_STEPS):
    """Write ``value`` to ``path`` through the simulated kernel in a forked child that SIGKILLs
    itself before its ``step``-th change of the tree (0: never; ``steps``: the simulator's functions
    that count as one); ``(how it ended, steps made)``."""
    from vgpuhost.sim import kernel as sim_kernel
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: never returns
        code = 3
        try:
            os.close(rfd)
            made = [0]

            def counted(fn):
                def step_then(*a, **kw):
                    made[0] += 1
                    if made[0] == step:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*a, **kw)
                return step_then
            for name in steps:
                setattr(sim_kernel, name, counted(getattr(sim_kernel, name)))
            SimKernel(host).write(path, value)
            os.write(wfd, str(made[0]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        made = r.read()
    _, status = os.waitpid(pid, 0)
    return (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)), int(made or 0)


def test_a_create_killed_half_way_leaves_no_half_mdev(tmp_path):
    """kill -9 of a writer while the simulator lays out an mdev (between its directory and its bus
    link, at every step): the next write takes the pieces away, so the next create of that UUID
    succeeds (no EEXIST) and, once removed, the tree is the fresh host's again."""
    text = A40_SPEC.replace("PROCS", "")
    host, sysfs = build(tmp_path, text, "ref")
    u = new_uuid()
    rc, total = _write_killed_at_step(host, mtype(host, A40, A40_8Q) / "create", u, 0)
    assert rc == 0 and total >= 10
    sysfs.write(host.mdev_devices / u / "remove", "1")
    fresh = _tree(host)         # (the first create makes the mdev driver's directory; it stays)
    for step in range(1, total + 1):
        host, sysfs = build(tmp_path, text, f"k{step}")
        rc, _ = _write_killed_at_step(host, mtype(host, A40, A40_8Q) / "create", u, step)
        assert rc == -signal.SIGKILL, step
        assert not os.path.lexists(host.mdev_devices / u), step       # never shown before it is whole
        sysfs.write(mtype(host, A40, A40_8Q) / "create", u)
        mdir = Path(os.path.realpath(host.mdev_devices / u))
        assert mdir.parent == Path(os.path.realpath(host.pci_device(A40))), step
        assert sysfs.listdir(mtype(host, A40, A40_8Q) / "devices") == [u], step
        assert (host.dev_vfio / Path(os.path.realpath(mdir / "iommu_group")).name).exists(), step
        assert avail(sysfs, host, A40, A40_8Q) == 5, step
        sysfs.write(host.mdev_devices / u / "remove", "1")
        assert _tree(host) == fresh, step


def test_reads_after_a_create_killed_half_way_see_no_half_mdev(tmp_path):
    """trial 10 B6: a writer killed while the simulator lays out an mdev left a device that the driver's
    counts (``available_instances``, the type's ``devices/``) and NVML's vGPU count showed but the bus did
    not, until some later write.  The kernel's create is one write(2): now the first read after the kill
    (a Sysfs's, or an NVML query's) finds the device gone whole, with no write in between, at every step."""
    from vgpuhost.model.values import PciAddress
    from vgpuhost.sim.nvml import SimNvml
    text = A40_SPEC.replace("PROCS", "")
    host, _ = build(tmp_path, text, "ref")
    u = new_uuid()
    rc, total = _write_killed_at_step(host, mtype(host, A40, A40_8Q) / "create", u, 0)
    assert rc == 0 and total >= 10
    for step in range(1, total + 1):
        host, _ = build(tmp_path, text, f"k{step}")
        before = _tree(host)
        rc, _ = _write_killed_at_step(host, mtype(host, A40, A40_8Q) / "create", u, step)
        assert rc == -signal.SIGKILL, step
        nvml_first = step % 2 == 0
        if nvml_first:
            assert SimNvml(host).active_vgpus(PciAddress.parse(A40)) == 0, step
        sysfs = Sysfs(host)
        assert avail(sysfs, host, A40, A40_8Q) == 6, step
        assert sysfs.listdir(mtype(host, A40, A40_8Q) / "devices") == [], step
        assert sysfs.listdir(host.mdev_devices) == [], step
        assert not os.path.lexists(Path(os.path.realpath(host.pci_device(A40))) / u), step
        assert SimNvml(host).active_vgpus(PciAddress.parse(A40)) == 0, step
        # the tree a reader sees is the one before the write (less the mdev driver's directory, which
        # the first create makes and which stays, empty)
        after = {k: v for k, v in _tree(host).items() if not k.startswith("sys/bus/mdev/drivers")}
        assert after == {k: v for k, v in before.items() if not k.startswith("sys/bus/mdev/drivers")}, step
        assert not (host.sim_dir / "unsettled").exists(), step


def test_apply_after_a_create_killed_half_way_needs_no_other_write(tmp_path, capsys):
    """trial 10 B6, the tester's symptom: after a kill inside a create, 'reconcile --check' said in sync while
    every 'apply' failed ("6 more A40-8Q wanted, 5 fit now"; "GPU has 1 vGPU(s) running"), until some other
    write.  Now apply, the next command, makes the layout whole; the audit log shows no other write first."""
    from vgpuhost.cli.main import main
    from vgpuhost.io.state import StateStore
    from vgpuhost.sim.data import bundled_specs
    from vgpuhost.sim.spec import load_spec
    host = materialise(load_spec(bundled_specs()["a40-mdev"]), tmp_path / "a40")
    gpu = "0000:81:00.0"
    rc, total = _write_killed_at_step(host, mtype(host, gpu, A40_8Q) / "create", new_uuid(), 6)
    assert rc == -signal.SIGKILL
    root = str(host.root)
    assert main(["--root", root, "reconcile", "--check"]) == 0
    config = str(Path(__file__).resolve().parent.parent / "examples" / "config" / "vgpu-a40.yaml")
    assert main(["--root", root, "apply", "-y", "-c", config, "vdi"]) == 0, capsys.readouterr()
    sysfs = Sysfs(host)
    assert len(sysfs.listdir(mtype(host, gpu, A40_8Q) / "devices")) == 6
    assert len(sysfs.listdir(host.mdev_devices)) == 6
    assert avail(sysfs, host, gpu, A40_8Q) == 0
    creates = [r for r in StateStore(host.state_dir).audit_rows() if r.path.endswith(f"{A40_8Q}/create")]
    assert len(creates) == 6 and all(r.result == "ok" for r in creates), creates


def test_a_remove_killed_half_way_leaves_no_half_mdev(tmp_path):
    """kill -9 of a writer while the simulator takes an mdev away, at every step: the device is whole
    or no longer found by its bus link, and the next write takes the rest away (the fresh host's
    tree), as the kernel's remove, once begun, ends with the device gone."""
    text = A40_SPEC.replace("PROCS", "")
    host, sysfs = build(tmp_path, text, "ref")
    u = new_uuid()
    sysfs.write(mtype(host, A40, A40_8Q) / "create", u)
    rc, total = _write_killed_at_step(host, host.mdev_devices / u / "remove", "1", 0)
    assert rc == 0 and total >= 4
    fresh = _tree(host)
    wholes = 0
    for step in range(1, total + 1):
        host, sysfs = build(tmp_path, text, f"k{step}")
        sysfs.write(mtype(host, A40, A40_8Q) / "create", u)
        rc, _ = _write_killed_at_step(host, host.mdev_devices / u / "remove", "1", step)
        assert rc == -signal.SIGKILL, step
        # found whole by its bus link (killed before its first step), or not found at all
        whole = os.path.lexists(host.mdev_devices / u)
        assert not whole or os.path.islink(host.mdev_devices / u / "mdev_type"), step
        wholes += whole
        if whole:
            # killed before it took anything away: the device stays, whole and removable, as after a
            # writer killed before its write(2) (trial 6 retest: the next write took it away, under a
            # retried release, which then failed ENOENT)
            sysfs.write(host.mdev_devices / u / "remove", "1")      # the retried remove: it works
            assert not os.path.lexists(host.mdev_devices / u), step
        sysfs.write(mtype(host, A40, A40_1B) / "create", new_uuid())   # any next write on the host
        assert sysfs.listdir(mtype(host, A40, A40_8Q) / "devices") == [], step
        assert avail(sysfs, host, A40, A40_1B) == 31, step
        (v,) = sysfs.listdir(host.mdev_devices)
        sysfs.write(host.mdev_devices / v / "remove", "1")
        assert _tree(host) == fresh, step
    assert 1 <= wholes < total          # some kills came before the first step, others after


def test_a_leftover_mdev_directory_does_not_block_its_uuid(a40):
    """A device directory with no bus link (what a writer killed mid-create left before the simulator
    kept a record of its changes): a create of its UUID takes it away and succeeds."""
    host, sysfs = a40
    u = new_uuid()
    sysfs.write(mtype(host, A40, A40_8Q) / "create", u)
    sysfs.write(host.mdev_devices / u / "remove", "1")
    fresh = _tree(host)
    mdir = Path(os.path.realpath(host.pci_device(A40))) / u
    (mdir / "nvidia").mkdir(parents=True)
    os.symlink(f"../mdev_supported_types/{A40_8Q}", mdir / "mdev_type")
    (mdir / "remove").write_text("")
    sysfs.write(mtype(host, A40, A40_8C) / "create", u)
    assert os.readlink(host.mdev_devices / u / "mdev_type").endswith(A40_8C)
    assert avail(sysfs, host, A40, A40_8C) == 5 and avail(sysfs, host, A40, A40_8Q) == 5
    sysfs.write(host.mdev_devices / u / "remove", "1")
    assert _tree(host) == fresh


def test_sim_reboot_sweeps_a_leftover_mdev_directory_and_does_not_count_it_lost(a40):
    """``sim reboot`` takes away a device directory with no bus link (no record of it kept) and does
    not report it among the vGPUs lost: it never was one."""
    from vgpuhost.sim.reboot import reboot
    host, sysfs = a40
    kept = new_uuid()
    sysfs.write(mtype(host, A40, A40_8Q) / "create", kept)
    u = new_uuid()
    mdir = Path(os.path.realpath(host.pci_device(A40))) / u
    (mdir / "nvidia").mkdir(parents=True)
    os.symlink(f"../mdev_supported_types/{A40_8Q}", mdir / "mdev_type")
    assert reboot(host)["vgpus_lost"] == [kept]
    assert not os.path.lexists(mdir) and sysfs.listdir(host.mdev_devices) == []
    assert avail(sysfs, host, A40, A40_8Q) == 6


def test_create_on_unbound_gpu_enoent(a40):
    # off nvidia the vGPU manager has unregistered the mdev parent: no mdev_supported_types, no create file
    host, sysfs = a40
    sysfs.write(host.pci_driver("nvidia") / "unbind", A40)
    assert write_err(sysfs, mtype(host, A40, A40_8Q) / "create", new_uuid()) == errno.ENOENT
    assert not (host.pci_device(A40) / "mdev_supported_types").exists()


def test_unbind_gpu_with_vgpus_ebusy(a40):
    host, sysfs = a40
    sysfs.write(mtype(host, A40, A40_8Q) / "create", new_uuid())
    assert write_err(sysfs, host.pci_driver("nvidia") / "unbind", A40) == errno.EBUSY
    assert driver(sysfs, host, A40) == "nvidia"


def test_unbind_with_persistenced_ebusy(tmp_path):
    host, sysfs = build(tmp_path, A40_SPEC.replace("PROCS", "nvidia-persistenced"))
    assert write_err(sysfs, host.pci_driver("nvidia") / "unbind", A40) == errno.EBUSY
    assert driver(sysfs, host, A40) == "nvidia"
    sysfs.write(host.pci_driver("snd_hda_intel") / "unbind", A40_HDA)  # companions are not held
    assert driver(sysfs, host, A40_HDA) is None


# --- SR-IOV mdev (A100) --------------------------------------------------------
def test_sriov_vfs_hold_one_vgpu_each(tmp_path):
    host, sysfs = build(tmp_path, A100_SPEC)
    assert sysfs.listdir(host.mdev_bus) == A100_VFS
    types = meta(host)["gpus"][A100]["types"]
    for vf in A100_VFS:
        for tid, t in types.items():
            expected = 0 if t["gi_profile"] else 1  # MIG mode off
            assert avail(sysfs, host, vf, tid) == expected, (vf, tid)
    u = new_uuid()
    sysfs.write(mtype(host, A100_VFS[0], A100_4C) / "create", u)
    for tid in types:
        assert avail(sysfs, host, A100_VFS[0], tid) == 0
    for vf in A100_VFS[1:]:
        for tid, t in types.items():
            expected = 1 if (t["fb_mib"] == 4096 and not t["gi_profile"]) else 0
            assert avail(sysfs, host, vf, tid) == expected, (vf, tid)
    assert write_err(sysfs, mtype(host, A100_VFS[0], A100_4C) / "create", new_uuid()) == errno.ENOSPC
    # the VF holding it cannot leave nvidia; the PF neither
    assert write_err(sysfs, host.pci_driver("nvidia") / "unbind", A100_VFS[0]) == errno.EBUSY
    assert write_err(sysfs, host.pci_driver("nvidia") / "unbind", A100) == errno.EBUSY
    sysfs.write(host.pci_driver("nvidia") / "unbind", A100_VFS[1])
    assert driver(sysfs, host, A100_VFS[1]) is None
    sysfs.write(host.mdev_devices / u / "remove", "1")
    assert avail(sysfs, host, A100_VFS[2], "nvidia-470") == 1


# --- vendor-specific VFIO (L40S) ---------------------------------------------
def test_vendor_vfio_set_and_clear_type(tmp_path):
    host, sysfs = build(tmp_path, L40S_SPEC)
    vf0, vf1 = L40S_VFS[0], L40S_VFS[1]
    cur = vf_nvidia(host, vf0) / "current_vgpu_type"
    all_types = creatable(sysfs, host, vf1)
    assert all_types[0] == "ID    : vGPU Name"
    assert "1145  : NVIDIA L40S-1B" in all_types
    assert "1152  : NVIDIA L40S-8Q" in all_types

    sysfs.write(cur, "1152\n")
    assert (cur).read_text() == "1152\n"
    assert creatable(sysfs, host, vf0) == ["ID    : vGPU Name"]
    others = creatable(sysfs, host, vf1)
    assert "1152  : NVIDIA L40S-8Q" in others
    assert "1169  : NVIDIA L40S-8C" in others
    assert "1145  : NVIDIA L40S-1B" not in others
    assert all(line.split(":")[0].strip() in ("ID", "1152", "1162", "1169") for line in others)

    assert write_err(sysfs, cur, "1152") == errno.EPERM
    assert write_err(sysfs, cur, "1169") == errno.EPERM
    assert write_err(sysfs, vf_nvidia(host, vf1) / "current_vgpu_type", "1145") == errno.ENOSPC
    assert write_err(sysfs, vf_nvidia(host, vf1) / "current_vgpu_type", "0") == errno.EPERM
    assert write_err(sysfs, host.pci_driver("nvidia") / "unbind", vf0) == errno.EBUSY

    sysfs.write(cur, "0")
    assert cur.read_text() == "0\n"
    assert creatable(sysfs, host, vf0) == all_types
    assert creatable(sysfs, host, vf1) == all_types
    assert write_err(sysfs, cur, "0\n") == errno.EPERM


def test_vendor_vfio_bad_values(tmp_path):
    host, sysfs = build(tmp_path, L40S_SPEC)
    cur = vf_nvidia(host, L40S_VFS[0]) / "current_vgpu_type"
    for bad in ("abc", "0x47a", "-1", "", "11 45"):
        assert write_err(sysfs, cur, bad) == errno.EINVAL, bad
    assert write_err(sysfs, cur, "9999") == errno.EINVAL
    assert write_err(sysfs, cur, "570") == errno.EINVAL  # an A40 id, not this board's
    assert cur.read_text() == "0\n"


def test_vendor_vfio_full_gpu_header_only(tmp_path):
    host, sysfs = build(tmp_path, L40S_SPEC)
    sysfs.write(vf_nvidia(host, L40S_VFS[0]) / "current_vgpu_type", "1155")  # 24Q, 2 per GPU
    assert "1155  : NVIDIA L40S-24Q" in creatable(sysfs, host, L40S_VFS[1])
    sysfs.write(vf_nvidia(host, L40S_VFS[1]) / "current_vgpu_type", "1155")
    for vf in L40S_VFS:
        assert creatable(sysfs, host, vf) == ["ID    : vGPU Name"], vf
    assert write_err(sysfs, vf_nvidia(host, L40S_VFS[2]) / "current_vgpu_type", "1155") == errno.ENOSPC


def test_vgpu_params(tmp_path, a40):
    """The driver keeps count - 1 bytes and shows them with a newline; a VF has no vgpu_params
    (tests/test_vgpu_params.py has the rest)."""
    host, sysfs = build(tmp_path, L40S_SPEC, name="l40s")
    assert not (vf_nvidia(host, L40S_VFS[0]) / "vgpu_params").exists()
    ahost, asys = a40
    u = new_uuid()
    asys.write(mtype(ahost, A40, A40_8Q) / "create", u)
    mparams = ahost.mdev_devices / u / "nvidia" / "vgpu_params"
    asys.write(mparams, "vgpu-placement-id=6\n")
    assert asys.read(mparams) == "vgpu-placement-id=6"
    asys.write(mparams, " ")
    assert asys.read(mparams) == ""


# --- PCI binding -----------------------------------------------------------------
@pytest.fixture
def turing(tmp_path):
    return build(tmp_path, PASSTHROUGH_SPEC, name="turing")


def test_driver_override_set_and_clear(turing):
    host, sysfs = turing
    ov = host.pci_device(TU_GPU) / "driver_override"
    assert sysfs.read(ov) == "(null)"
    sysfs.write(ov, "vfio-pci")
    assert ov.read_text() == "vfio-pci\n"
    assert driver(sysfs, host, TU_GPU) == "nvidia"  # no side effect
    sysfs.write(ov, "\n")
    assert ov.read_text() == "(null)\n"
    sysfs.write(ov, "vfio-pci\n")
    assert sysfs.read(ov) == "vfio-pci"
    sysfs.write(ov, "")
    assert sysfs.read(ov) == "(null)"


def test_unbind_and_bind_native(turing):
    host, sysfs = turing
    hda_drv = host.pci_driver("snd_hda_intel")
    assert write_err(sysfs, host.pci_driver("nvidia") / "unbind", TU_HDA) == errno.ENODEV
    assert write_err(sysfs, hda_drv / "unbind", "0000:0b:00.0") == errno.ENODEV
    sysfs.write(hda_drv / "unbind", TU_HDA + "\n")
    assert driver(sysfs, host, TU_HDA) is None
    assert not os.path.lexists(hda_drv / TU_HDA)
    assert write_err(sysfs, hda_drv / "unbind", TU_HDA) == errno.ENODEV
    # vfio-pci matches only through driver_override
    assert write_err(sysfs, host.pci_driver("vfio-pci") / "bind", TU_HDA) == errno.ENODEV
    assert write_err(sysfs, host.pci_driver("nvidia") / "bind", TU_HDA) == errno.ENODEV
    assert write_err(sysfs, hda_drv / "bind", "0000:0b:00.0") == errno.ENODEV
    # first bind of the hda hits the injected EIO, and changes nothing
    err = write_err(sysfs, hda_drv / "bind", TU_HDA)
    assert err == errno.EIO
    assert driver(sysfs, host, TU_HDA) is None
    assert meta(host)["faults"] == [f for f in meta(host)["faults"] if f["op"] != "bind"]
    sysfs.write(hda_drv / "bind", TU_HDA)
    assert driver(sysfs, host, TU_HDA) == "snd_hda_intel"
    assert os.path.realpath(hda_drv / TU_HDA) == os.path.realpath(host.pci_device(TU_HDA))
    assert os.path.realpath(host.pci_device(TU_HDA) / "driver") == os.path.realpath(hda_drv)
    assert not os.readlink(hda_drv / TU_HDA).startswith("/")
    assert not os.readlink(host.pci_device(TU_HDA) / "driver").startswith("/")
    assert write_err(sysfs, hda_drv / "bind", TU_HDA) == errno.EBUSY


def test_driverctl_flow_and_dev_vfio_node(turing):
    host, sysfs = turing
    group = group_of(host, TU_GPU)
    assert {group_of(host, b) for b in (TU_HDA, TU_XHCI, TU_UCSI)} == {group}
    node = host.dev_vfio / group
    funcs = [TU_GPU, TU_HDA, TU_XHCI, TU_UCSI]
    natives = {b: driver(sysfs, host, b) for b in funcs}
    for bdf in funcs:
        sysfs.write(host.pci_device(bdf) / "driver_override", "vfio-pci")
        sysfs.write(host.pci_driver(natives[bdf]) / "unbind", bdf)
        sysfs.write(host.pci_drivers_probe, bdf)
        assert driver(sysfs, host, bdf) == "vfio-pci"
        assert node.exists()
    assert sorted(sysfs.listdir(host.pci_driver("vfio-pci"))) == sorted(
        ["bind", "module", "new_id", "remove_id", "unbind"] + funcs)
    # release: companions first; the node stays while any member is on vfio-pci
    for i, bdf in enumerate(reversed(funcs)):
        sysfs.write(host.pci_device(bdf) / "driver_override", "\n")
        sysfs.write(host.pci_driver("vfio-pci") / "unbind", bdf)
        assert node.exists() == (i < len(funcs) - 1)
        sysfs.write(host.pci_drivers_probe, bdf)
        assert driver(sysfs, host, bdf) == natives[bdf]
    assert not node.exists()


def test_bind_through_override(turing):
    host, sysfs = turing
    sysfs.write(host.pci_driver("xhci_hcd") / "unbind", TU_XHCI)
    sysfs.write(host.pci_device(TU_XHCI) / "driver_override", "vfio-pci")
    # a stale override blocks the native driver
    assert write_err(sysfs, host.pci_driver("xhci_hcd") / "bind", TU_XHCI) == errno.ENODEV
    sysfs.write(host.pci_driver("vfio-pci") / "bind", TU_XHCI)
    assert driver(sysfs, host, TU_XHCI) == "vfio-pci"
    assert (host.dev_vfio / group_of(host, TU_XHCI)).exists()


def test_drivers_probe_edge_cases(turing):
    host, sysfs = turing
    probe = host.pci_drivers_probe
    assert write_err(sysfs, probe, "0000:0b:00.0") == errno.ENODEV
    sysfs.write(probe, TU_GPU)  # already bound: success, nothing changes
    assert driver(sysfs, host, TU_GPU) == "nvidia"
    # override naming a driver that is not loaded: success, stays unbound
    sysfs.write(host.pci_device(TU_UCSI) / "driver_override", "not-loaded")
    sysfs.write(host.pci_driver("nvidia-gpu") / "unbind", TU_UCSI)
    sysfs.write(probe, TU_UCSI)
    assert driver(sysfs, host, TU_UCSI) is None
    # injected 'ignore' (count 0: every time): probe succeeds and binds nothing
    sysfs.write(host.pci_driver("ahci") / "unbind", SATA)
    for _ in range(2):
        sysfs.write(probe, SATA)
        assert driver(sysfs, host, SATA) is None
    assert [f["op"] for f in meta(host)["faults"]] == ["bind", "probe"]
    sysfs.write(host.pci_driver("ahci") / "bind", SATA)
    assert driver(sysfs, host, SATA) == "ahci"


# --- other files ----------------------------------------------------------------------
def test_read_only_missing_and_plain_files(a40, turing):
    host, sysfs = a40
    f = mtype(host, A40, A40_8Q) / "available_instances"
    assert write_err(sysfs, f, "9") == errno.EACCES
    assert sysfs.read(f) == "6"
    for name in ("vendor", "device", "class", "numa_node", "subsystem_vendor"):
        assert write_err(sysfs, host.pci_device(A40) / name, "0") == errno.EACCES
    for name in ("name", "description", "device_api"):
        assert write_err(sysfs, mtype(host, A40, A40_8Q) / name, "x") == errno.EACCES
    missing = host.pci_device(A40) / "no_such_attr"
    assert write_err(sysfs, missing, "1") == errno.ENOENT
    assert not os.path.lexists(missing)
    assert write_err(sysfs, host.pci_device("0000:99:00.0") / "driver_override", "x") == errno.ENOENT
    assert write_err(sysfs, host.pci_device(A40), "x") == errno.EISDIR
    # write-only files accept writes and stay empty; plain files take the value
    sysfs.write(host.pci_device(A40) / "reset", "1")
    assert (host.pci_device(A40) / "reset").read_text() == ""
    sysfs.write(host.pci_device(A40) / "reset_method", "bus")
    assert sysfs.read(host.pci_device(A40) / "reset_method") == "bus"
    thost, tsys = turing
    vendor = thost.pci_device(TU_GPU) / "vendor"
    assert write_err(tsys, vendor, "0x1") == errno.EACCES
    assert tsys.read(vendor) == "0x10de"


# --- concurrency ---------------------------------------------------------------------
def _create_worker(root, barrier, results):
    sysfs = Sysfs(HostRoot(Path(root)))
    create = HostRoot(Path(root)).pci_device(A40) / "mdev_supported_types" / A40_8Q / "create"
    barrier.wait()
    out = []
    for _ in range(3):
        try:
            sysfs.write(create, str(uuidlib.uuid4()))
            out.append(0)
        except SysfsError as e:
            out.append(e.errno)
    results.put(out)


def test_concurrent_creates_respect_capacity(a40):
    host, sysfs = a40
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(4)
    results = ctx.Queue()
    procs = [ctx.Process(target=_create_worker, args=(str(host.root), barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = [e for _ in procs for e in results.get(timeout=30)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sorted(outcomes) == [0] * 6 + [errno.ENOSPC] * 6
    assert len(sysfs.listdir(host.mdev_devices)) == 6
    assert len(sysfs.listdir(mtype(host, A40, A40_8Q) / "devices")) == 6
    pdir = Path(os.path.realpath(host.pci_device(A40)))
    assert len([n for n in os.listdir(pdir) if (pdir / n / "mdev_type").is_symlink()]) == 6
    assert avail(sysfs, host, A40, A40_8Q) == 0
    groups = {os.path.realpath(host.mdev_devices / u / "iommu_group") for u in sysfs.listdir(host.mdev_devices)}
    assert len(groups) == 6


def test_vgpu_faults(tmp_path):
    faults = """
faults:
  - {op: create, device: "0000:41:00.0", errno: EIO, count: 2}
  - {op: remove, errno: EBUSY, count: 1}
  - {op: set_type, device: "0000:81:00.5", errno: EAGAIN, count: 1}
  - {op: unbind, device: "0000:81:00.6", effect: ignore, count: 1}
"""
    spec = A40_SPEC.replace("PROCS", "") + """
  - {bdf: "0000:81:00.0", model: L40S, vgpu: {backend: vendor-vfio, sriov_numvfs: 4}}
""" + faults
    host, sysfs = build(tmp_path, spec)
    create = mtype(host, A40, A40_8Q) / "create"
    assert write_err(sysfs, create, "bad") == errno.EINVAL  # refused anyway: fault not used up
    for _ in range(2):
        assert write_err(sysfs, create, new_uuid()) == errno.EIO
    assert sysfs.listdir(host.mdev_devices) == []
    assert avail(sysfs, host, A40, A40_8Q) == 6
    u = new_uuid()
    sysfs.write(create, u)
    assert write_err(sysfs, host.mdev_devices / u / "remove", "1") == errno.EBUSY
    assert os.path.isdir(host.mdev_devices / u)
    sysfs.write(host.mdev_devices / u / "remove", "1")
    assert not os.path.lexists(host.mdev_devices / u)
    # set_type fault on one VF only
    sysfs.write(vf_nvidia(host, L40S_VFS[0]) / "current_vgpu_type", "1145")
    cur1 = vf_nvidia(host, L40S_VFS[1]) / "current_vgpu_type"
    assert write_err(sysfs, cur1, "1145") == errno.EAGAIN
    assert cur1.read_text() == "0\n"
    sysfs.write(cur1, "1145")
    assert cur1.read_text() == "1145\n"
    # an ignored unbind succeeds and leaves the VF bound
    sysfs.write(host.pci_driver("nvidia") / "unbind", L40S_VFS[2])
    assert driver(sysfs, host, L40S_VFS[2]) == "nvidia"
    sysfs.write(host.pci_driver("nvidia") / "unbind", L40S_VFS[2])
    assert driver(sysfs, host, L40S_VFS[2]) is None
    assert meta(host)["faults"] == []


def test_attribute_rewrites_are_atomic_for_concurrent_readers(tmp_path):
    """A reader never sees an attribute the simulator rewrites (available_instances,
    creatable_vgpu_types, current_vgpu_type) empty or cut short: temp file + rename, as a
    kernel attribute reads old or new; and no temp file is left behind."""
    spec = A40_SPEC.replace("PROCS", "") + """
  - {bdf: "0000:81:00.0", model: L40S, vgpu: {backend: vendor-vfio, sriov_numvfs: 4}}
"""
    host, sysfs = build(tmp_path, spec)
    watched = [mtype(host, A40, A40_8Q) / "available_instances", mtype(host, A40, A40_1B) / "available_instances",
               vf_nvidia(host, L40S_VFS[1]) / "creatable_vgpu_types", vf_nvidia(host, L40S_VFS[0]) / "current_vgpu_type"]
    seen = {p: set() for p in watched}
    bad: list = []
    stop = threading.Event()

    def complete(p: Path, text: str) -> bool:
        if p.name == "creatable_vgpu_types":
            return text.startswith("ID    : vGPU Name\n") and text.endswith("\n")
        return re.fullmatch(r"\d+\n", text) is not None

    def reader() -> None:
        while not stop.is_set():
            for p in watched:
                fd = os.open(p, os.O_RDONLY)        # one read(2), as Sysfs and the kernel's readers do
                try:
                    text = os.read(fd, 65536).decode()
                finally:
                    os.close(fd)
                seen[p].add(text)
                if not complete(p, text):
                    bad.append((p.name, text))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(10):
            u = new_uuid()
            sysfs.write(mtype(host, A40, A40_8Q) / "create", u)         # every A40 type's count changes
            sysfs.write(vf_nvidia(host, L40S_VFS[0]) / "current_vgpu_type", "1145")   # the other VFs' lists shrink
            sysfs.write(host.mdev_devices / u / "remove", "1")
            sysfs.write(vf_nvidia(host, L40S_VFS[0]) / "current_vgpu_type", "0")
    finally:
        stop.set()
        t.join(timeout=30)
    assert bad == []
    assert all(len(values) >= 2 for values in seen.values()), seen      # the reader saw the values change
    dirs = {p.parent for p in watched}
    assert [n for d in dirs for n in os.listdir(d) if n.endswith(".sim-tmp")] == []
    assert avail(sysfs, host, A40, A40_8Q) == 6 and driver(sysfs, host, L40S_VFS[0]) == "nvidia"


def test_a_vendor_vfio_clear_killed_between_type_and_placement_leaves_no_stale_placement(tmp_path):
    """kill -9 of a writer clearing a VF's vGPU (``current_vgpu_type`` 0) in mixed-size mode, at every
    file it writes: the VF is found either still holding its vGPU at its placement, or free with its
    placement "Not Applicable" once the next write has run (the driver's clear is one write(2)); a
    new vGPU on it then takes the free placement (trial 6 notes)."""
    text = L40S_SPEC.replace("sriov_numvfs: 4}", "sriov_numvfs: 4, mixed_size: true}")
    vf0, vf1 = L40S_VFS[0], L40S_VFS[1]
    steps = _TREE_STEPS + ("write_attr",)

    def two_24q(name):
        host, sysfs = build(tmp_path, text, name)
        for vf in (vf0, vf1):
            sysfs.write(vf_nvidia(host, vf) / "current_vgpu_type", "1155")    # L40S-24Q: ids 0, then 24
        return host, sysfs
    host, _ = two_24q("ref")
    rc, total = _write_killed_at_step(host, vf_nvidia(host, vf0) / "current_vgpu_type", "0", 0, steps)
    assert rc == 0 and total >= 2
    cleared = 0
    for step in range(1, total + 1):
        host, sysfs = two_24q(f"c{step}")
        assert (vf_nvidia(host, vf0) / "placement_id").read_text().strip() == "0"
        rc, _ = _write_killed_at_step(host, vf_nvidia(host, vf0) / "current_vgpu_type", "0", step, steps)
        assert rc == -signal.SIGKILL, step
        with pytest.raises(SysfsError):          # any next write, even a refused one (a free VF holds none)
            sysfs.write(vf_nvidia(host, L40S_VFS[2]) / "current_vgpu_type", "0")
        cur = (vf_nvidia(host, vf0) / "current_vgpu_type").read_text().strip()
        placement = (vf_nvidia(host, vf0) / "placement_id").read_text().strip()
        if cur == "1155":
            assert placement == "0", step               # killed before the clear: the vGPU stays whole
            continue
        cleared += 1
        assert (cur, placement) == ("0", "Not Applicable"), step
        vf2 = L40S_VFS[2]
        sysfs.write(vf_nvidia(host, vf1) / "current_vgpu_type", "0")            # 24 free too now
        sysfs.write(vf_nvidia(host, vf2) / "placement_id", "0")                 # another VF takes 0 first
        sysfs.write(vf_nvidia(host, vf2) / "current_vgpu_type", "1155")
        sysfs.write(vf_nvidia(host, vf0) / "current_vgpu_type", "1155")         # takes what is free: 24
        assert (vf_nvidia(host, vf0) / "placement_id").read_text().strip() == "24", step
    assert cleared >= 1
