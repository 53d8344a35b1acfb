"""The simulated kernel's cheaper writes (issue 31, item 5) keep what it shows.

- the attribute refresh replaces only the files whose value moved, and still sets right a file changed
  behind the kernel's back;
- a parent's vGPUs, found by one listing of its directory, are those its types' ``devices/`` list;
- a GPU's state parsed once and kept across writes is never served for a file that changed, even one
  changed back to bytes seen before.

Every outcome is read back from the simulated tree and the simulator's own files.
"""

import errno
import json
import os
import uuid as uuidlib

import pytest

from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.errors import SysfsError
from vgpuhost.sim.build import materialise
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.sim.spec import parse_spec

A40_SPEC = """
version: 1
name: a40
host: {modules: [vfio_pci, nvidia]}
devices:
  - {bdf: "0000:40:01.0", model: intel-root-port}
  - {bdf: "0000:41:00.0", model: A40, upstream: "0000:40:01.0", vgpu: {backend: mdev}}
"""
from test_sim_kernel import A100_SPEC  # noqa: E402  (the same one-GPU A100 host)
A40 = "0000:41:00.0"
A40_8Q, A40_8C, A40_1B, A40_4Q = "nvidia-566", "nvidia-574", "nvidia-557", "nvidia-564"
#: the A40's 8 GB types (Q, C, A): in equal-size mode their counts move together
A40_8GB = {A40_8Q, A40_8C, "nvidia-587"}
A100_VFS = ["0000:41:00.4", "0000:41:00.5", "0000:41:00.6", "0000:41:00.7"]
A100_4C = "nvidia-468"


@pytest.fixture
def a40(tmp_path):
    host = materialise(parse_spec(A40_SPEC), tmp_path / "root")
    return host, Sysfs(host)


def types_dir(host, parent):
    return host.pci_device(parent) / "mdev_supported_types"


def inodes(host, parent):
    """``{type id: (inode, text)}`` of each type's ``available_instances``."""
    out = {}
    for tid in sorted(os.listdir(types_dir(host, parent))):
        p = types_dir(host, parent) / tid / "available_instances"
        out[tid] = (os.stat(p).st_ino, p.read_text())
    return out


def create(sysfs, host, parent, tid):
    u = str(uuidlib.uuid4())
    sysfs.write(types_dir(host, parent) / tid / "create", u)
    return u


def test_a_create_replaces_only_the_counts_that_moved(a40):
    host, sysfs = a40
    create(sysfs, host, A40, A40_8Q)            # the first vGPU: every type's count moves
    before = inodes(host, A40)
    create(sysfs, host, A40, A40_8Q)
    after = inodes(host, A40)
    replaced = {t for t in before if before[t][0] != after[t][0]}
    assert replaced == A40_8GB == {t for t in before if before[t][1] != after[t][1]}
    assert after[A40_8Q][1] == "4\n" and after[A40_8C][1] == "4\n" and after[A40_1B][1] == "0\n"
    assert [n for n in os.listdir(types_dir(host, A40) / A40_8Q) if n.endswith(".sim-tmp")] == []


def test_the_first_vgpu_and_the_last_move_every_count(a40):
    host, sysfs = a40
    before = inodes(host, A40)
    u = create(sysfs, host, A40, A40_8C)
    made = inodes(host, A40)
    assert {t for t in before if before[t][0] != made[t][0]} == set(before)       # every type: 0 or its size's
    sysfs.write(host.mdev_devices / u / "remove", "1")
    assert {t: v[1] for t, v in inodes(host, A40).items()} == {t: v[1] for t, v in before.items()}


def test_the_sizes_counts_move_together_and_the_others_stay(a40):
    host, sysfs = a40
    create(sysfs, host, A40, A40_8Q)
    before = inodes(host, A40)
    create(sysfs, host, A40, A40_8C)            # same size, other series: the 8 GB counts move
    after = inodes(host, A40)
    assert {t for t in before if before[t][0] != after[t][0]} == A40_8GB
    assert all(after[t][1] == "4\n" for t in A40_8GB) and after[A40_1B] == before[A40_1B]


def test_a_file_changed_behind_the_kernels_back_is_set_right_at_the_next_refresh(a40):
    host, sysfs = a40
    create(sysfs, host, A40, A40_8Q)
    scribbled = types_dir(host, A40) / A40_1B / "available_instances"
    scribbled.write_text("7\n")                  # a type whose count the next create does not move
    create(sysfs, host, A40, A40_8Q)
    assert scribbled.read_text() == "0\n"
    assert (types_dir(host, A40) / A40_8Q / "available_instances").read_text() == "4\n"


def test_a_missing_count_file_is_made_again(a40):
    host, sysfs = a40
    gone = types_dir(host, A40) / A40_1B / "available_instances"
    os.unlink(gone)
    create(sysfs, host, A40, A40_8Q)
    assert gone.read_text() == "0\n" and oct(os.stat(gone).st_mode & 0o777) == "0o644"


def test_the_vgpus_found_are_those_the_types_list(tmp_path):
    host = materialise(parse_spec(A40_SPEC), tmp_path / "a40")
    sysfs = Sysfs(host)
    made = sorted([create(sysfs, host, A40, A40_8Q), create(sysfs, host, A40, A40_8C),
                   create(sysfs, host, A40, A40_8Q)])
    # a directory of an mdev's shape that is no mdev (no mdev_type link) is not one
    os.mkdir(host.pci_device(A40) / "00000000-0000-4000-8000-000000000000")
    kernel = SimKernel(host)
    got = kernel.instances(kernel.meta(), A40)
    listed = sorted((A40, tid, u) for tid in os.listdir(types_dir(host, A40))
                    for u in os.listdir(types_dir(host, A40) / tid / "devices"))
    assert [(i["parent"], i["type_id"], i["id"]) for i in got] == listed
    assert sorted(i["id"] for i in got) == made

    a100 = materialise(parse_spec(A100_SPEC), tmp_path / "a100")
    s100 = Sysfs(a100)
    on = {vf: create(s100, a100, vf, A100_4C) for vf in A100_VFS[1:3]}
    k100 = SimKernel(a100)
    got = k100.instances(k100.meta(), "0000:41:00.0")
    assert [(i["parent"], i["type_id"], i["id"]) for i in got] == [(vf, A100_4C, on[vf]) for vf in A100_VFS[1:3]]
    # a VF holding one reports 0 of every type; the others still 1 of it
    assert (types_dir(a100, A100_VFS[1]) / A100_4C / "available_instances").read_text() == "0\n"
    assert (types_dir(a100, A100_VFS[0]) / A100_4C / "available_instances").read_text() == "1\n"


def test_a_gpu_file_changed_and_changed_back_is_read_again(a40):
    """The kernel keeps each GPU's parsed state across its writes while the file's bytes stay the same:
    another writer's change (here: the type's max lowered, then the very bytes put back) is seen by the
    next write."""
    host, sysfs = a40
    gfile = host.sim_dir / "gpus" / f"{A40}.json"
    original = gfile.read_bytes()
    create(sysfs, host, A40, A40_4Q)              # this process has parsed and kept the GPU's state
    doc = json.loads(original)
    doc["types"][A40_4Q]["max"] = 1
    gfile.write_text(json.dumps(doc, sort_keys=True))
    with pytest.raises(SysfsError) as ei:
        create(sysfs, host, A40, A40_4Q)
    assert ei.value.errno == errno.ENOSPC
    gfile.write_bytes(original)                   # the bytes the kernel parsed first
    create(sysfs, host, A40, A40_4Q)
    assert len(os.listdir(types_dir(host, A40) / A40_4Q / "devices")) == 2
    assert (types_dir(host, A40) / A40_4Q / "available_instances").read_text() == "10\n"


def test_a_host_tree_at_the_filesystem_root_re_expresses_its_paths():
    """The Debian package's test runs a simulated host whose tree is ``/`` (in a chroot): a path under it
    is its own real path there, and one outside any root is refused (the fresh clone's test_deb failed
    with "'/sys/kernel/iommu_groups' is not under '/'")."""
    from types import SimpleNamespace

    import pytest

    from vgpuhost.sim.kernel import SimKernel
    at_root = SimpleNamespace(_root_str="/", _real_str="/")
    assert SimKernel._rstr(at_root, "/sys/kernel/iommu_groups") == "/sys/kernel/iommu_groups"
    assert SimKernel._rstr(at_root, "/") == "/"
    moved = SimpleNamespace(_root_str="/srv/h", _real_str="/real/h")
    assert SimKernel._rstr(moved, "/srv/h/sys/bus") == "/real/h/sys/bus"
    assert SimKernel._rstr(moved, "/srv/h") == "/real/h"
    with pytest.raises(ValueError):
        SimKernel._rstr(moved, "/srv/hx/sys")
