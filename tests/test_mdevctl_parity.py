"""``vgpuhost types --json`` agrees with Debian's ``mdevctl types --dumpjson``.

Both read the same simulated host: mdevctl through a bind mount of
``<root>/sys`` over the sysfs mount point inside a private mount namespace
(see tests/nsutil.py; the host's own sysfs is never touched), vgpuhost
through ``--root``.  For every mdev parent and type: same parents, same type
ids, and per (parent, type) the same available_instances, name, description
and device_api.  Checked on pristine hosts and again after vGPUs were created
through vgpuhost's sysfs layer (the simulator's kernel), where
``mdevctl list --dumpjson`` must also show exactly the created devices.

Needs root, ``unshare -m`` and mdevctl: skipped without them, except in CI
(``CI=true``) where a missing prerequisite fails the test instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid as uuidlib
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nsutil, whatever pytest's import mode
import nsutil  # noqa: E402

from vgpuhost.io.hostroot import HostRoot  # noqa: E402
from vgpuhost.observe.inventory import discover  # noqa: E402
from vgpuhost.sim.data import bundled_specs  # noqa: E402
from vgpuhost.sim.build import materialise  # noqa: E402
from vgpuhost.sim.spec import load_spec  # noqa: E402
from vgpuhost.io.sysfs import Sysfs  # noqa: E402

pytestmark = pytest.mark.root

SPEC_A = "a100-sriov-mdev"   # SR-IOV: 20 VFs, each an mdev parent with 0/1 instance
SPEC_C = "a40-mdev"          # PF is the mdev parent, equal-size mode


@pytest.fixture(scope="module")
def mdevctl_ns() -> None:
    """Skip (fail in CI) when mdevctl cannot be run in a private mount namespace."""
    nsutil.skip_or_fail(nsutil.unavailable_reason(), "the mdevctl parity test")


def _build(tmp_path: Path, name: str) -> HostRoot:
    return materialise(load_spec(bundled_specs()[name]), tmp_path / name)


def _vgpuhost_types(root: Path) -> dict:
    argv = [sys.executable, "-m", "vgpuhost", "--root", str(root), "--json", "types"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{argv!r} failed ({proc.returncode}): {proc.stderr}"
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "vgpuhost.types/v1"
    return doc


def _by_parent(doc: dict) -> Dict[str, Dict[str, dict]]:
    """vgpuhost's types document in nsutil.parse_types' shape: {parent: {type_id: {...}}}."""
    out: Dict[str, Dict[str, dict]] = {}
    for e in doc["types"]:
        assert e["backend"] == "mdev", e
        # "name" is the sysfs name without the vendor prefix; raw_name is the sysfs name
        assert e["raw_name"].endswith(e["name"]), e
        # the GPU-level figure is the per-parent sum, capped on SR-IOV GPUs by the type's max
        # instances (every free VF reports 1): never above either
        per_parent = sum(p["available_instances"] for p in e["parents"])
        assert e["available_instances"] <= per_parent, e
        if e["max_instances"] is not None:
            assert e["available_instances"] <= e["max_instances"], e
        for p in e["parents"]:
            types = out.setdefault(p["parent"], {})
            assert e["type_id"] not in types, f"vgpuhost lists {p['parent']} {e['type_id']} twice"
            types[e["type_id"]] = {"available_instances": p["available_instances"], "name": e["raw_name"],
                                   "description": e["description"], "device_api": e["device_api"]}
    return out


def _assert_parity(root: Path) -> Dict[str, Dict[str, dict]]:
    """Compare both views of ``root``; mdevctl's view, parsed."""
    before = nsutil.sysfs_mount_lines()
    theirs = nsutil.parse_types(nsutil.run_mdevctl(root, "types", "--dumpjson"))
    assert nsutil.sysfs_mount_lines() == before, "the sysfs mount of the test's namespace changed"
    ours = _by_parent(_vgpuhost_types(root))

    assert theirs, "mdevctl saw no mdev parent: the namespace bind mount did not take effect"
    assert sorted(ours) == sorted(theirs), "different mdev parents"
    problems: List[str] = []
    for parent in sorted(theirs):
        if sorted(ours[parent]) != sorted(theirs[parent]):
            problems.append(f"{parent}: type ids differ: only vgpuhost "
                            f"{sorted(set(ours[parent]) - set(theirs[parent]))}, only mdevctl "
                            f"{sorted(set(theirs[parent]) - set(ours[parent]))}")
            continue
        for tid in sorted(theirs[parent]):
            for field in ("available_instances", "name", "description", "device_api"):
                a, b = ours[parent][tid][field], theirs[parent][tid][field]
                if a != b:
                    problems.append(f"{parent} {tid} {field}: vgpuhost {a!r} != mdevctl {b!r}")
    assert not problems, "vgpuhost and mdevctl disagree:\n" + "\n".join(problems[:40])
    return theirs


def _create(host: HostRoot, parent: str, type_id: str) -> str:
    uuid = str(uuidlib.uuid4())
    Sysfs(host).write(host.mdev_bus / parent / "mdev_supported_types" / type_id / "create", uuid)
    return uuid


def _assert_list_parity(host: HostRoot, created: Dict[str, Tuple[str, str]]) -> None:
    theirs = nsutil.parse_list(nsutil.run_mdevctl(host.root, "list", "--dumpjson"))
    ours = {m.uuid: (str(m.parent), m.type_id) for m in discover(Sysfs(host)).mdevs}
    assert theirs == created, "mdevctl list does not show exactly the created mdevs"
    assert ours == theirs, "vgpuhost's inventory and mdevctl list disagree"


@pytest.mark.parametrize("spec", [SPEC_A, SPEC_C])
def test_types_match_mdevctl_on_fresh_host(mdevctl_ns, tmp_path, spec):
    host = _build(tmp_path, spec)
    theirs = _assert_parity(host.root)
    if spec == SPEC_A:
        assert len(theirs) == 20, "a100-sriov-mdev: one parent per VF"
        # time-sliced types: one free instance per VF; MIG-backed ones: none (MIG mode off)
        assert all(ts["nvidia-471"]["available_instances"] == 1 for ts in theirs.values())
        assert all(ts["nvidia-474"]["available_instances"] == 0 for ts in theirs.values())
    else:
        assert list(theirs) == ["0000:81:00.0"]
        assert theirs["0000:81:00.0"]["nvidia-566"]["available_instances"] == 6
    assert nsutil.parse_list(nsutil.run_mdevctl(host.root, "list", "--dumpjson")) == {}


def test_types_and_list_match_mdevctl_after_creating_mdevs(mdevctl_ns, tmp_path):
    a40 = _build(tmp_path, SPEC_C)
    a100 = _build(tmp_path, SPEC_A)
    created_c = {}
    for _ in range(2):
        created_c[_create(a40, "0000:81:00.0", "nvidia-566")] = ("0000:81:00.0", "nvidia-566")
    created_a = {}
    for vf in ("0000:41:00.4", "0000:41:01.2"):
        created_a[_create(a100, vf, "nvidia-471")] = (vf, "nvidia-471")

    c = _assert_parity(a40.root)
    # equal-size mode: with two 8Q (8 GB) vGPUs only 8 GB types have room
    assert c["0000:81:00.0"]["nvidia-566"]["available_instances"] == 4
    assert c["0000:81:00.0"]["nvidia-557"]["available_instances"] == 0
    a = _assert_parity(a100.root)
    assert all(t["available_instances"] == 0 for t in a["0000:41:00.4"].values())
    assert a["0000:41:00.5"]["nvidia-471"]["available_instances"] == 1

    _assert_list_parity(a40, created_c)
    _assert_list_parity(a100, created_a)
