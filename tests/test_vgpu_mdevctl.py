"""Debian's ``mdevctl`` sees the vGPUs ``vgpuhost vgpu create`` makes on host (a).

Host (a) is ``a100-sriov-mdev``: an A100-40GB whose 20 SR-IOV VFs are mdev
parents.  vgpuhost runs as the CLI (``python -m vgpuhost --root R``);
mdevctl 1.2 runs in a private mount namespace with ``R/sys`` over the sysfs
mount point and ``R/etc/mdevctl.d`` over mdevctl's config directory (see
tests/nsutil.py: ``prepare_root`` adds the ``scripts.d/callouts`` and
``notifiers`` directories mdevctl insists on; the host's own sysfs and
config are never touched).

- ``mdevctl list --dumpjson`` lists a created vGPU under its parent VF with
  its type id, exactly what vgpuhost reported;
- a vGPU created with ``--persist`` is also in ``mdevctl list --defined
  --dumpjson`` with ``start: auto``, and one created without it is not;
- ``vgpuhost vgpu remove`` takes a persisted vGPU out of both lists.

Needs root, ``unshare -m`` and mdevctl: skipped without them, except in CI
(``CI=true``) where a missing prerequisite fails the test instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nsutil, whatever pytest's import mode
import nsutil  # noqa: E402

from vgpuhost.io.hostroot import HostRoot  # noqa: E402
from vgpuhost.sim.data import bundled_specs  # noqa: E402
from vgpuhost.sim.build import materialise  # noqa: E402
from vgpuhost.sim.spec import load_spec  # noqa: E402

pytestmark = pytest.mark.root

SPEC_A = "a100-sriov-mdev"
A100 = "0000:41:00.0"


@pytest.fixture(scope="module")
def mdevctl_ns() -> None:
    """Skip (fail in CI) when mdevctl cannot be run in a private mount namespace."""
    reason = nsutil.unavailable_reason()
    if reason is None and not os.path.isdir(nsutil.NS_MDEVCTL_CONF_TARGET):
        # nsutil shadows the config directory only when its mount point exists
        reason = (f"no {nsutil.NS_MDEVCTL_CONF_TARGET} to bind the simulated root's etc/mdevctl.d over "
                  "(is the mdevctl package installed?)")
    nsutil.skip_or_fail(reason, "the vGPU mdevctl test")


def _vgpuhost(root: Path, *args: str) -> dict:
    argv = [sys.executable, "-m", "vgpuhost", "--root", str(root), "--json", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{argv!r} failed ({proc.returncode}): {proc.stderr}{proc.stdout}"
    return json.loads(proc.stdout)


def _listed(root: Path, *flags: str) -> Dict[str, Tuple[str, str, str]]:
    """``mdevctl list [flags] --dumpjson`` -> ``{uuid: (parent, mdev_type, start)}``."""
    before = nsutil.sysfs_mount_lines()
    doc = json.loads(nsutil.run_mdevctl(root, "list", *flags, "--dumpjson"))
    assert nsutil.sysfs_mount_lines() == before, "the sysfs mount of the test's namespace changed"
    return {u: (p, v.get("mdev_type"), v.get("start")) for p, u, v in nsutil._pairs(doc, "list")}


def test_mdevctl_lists_created_and_persisted_vgpus(mdevctl_ns, tmp_path):
    host: HostRoot = materialise(load_spec(bundled_specs()[SPEC_A]), tmp_path / SPEC_A)
    root = host.root
    assert _listed(root) == {} and _listed(root, "--defined") == {}

    plain = _vgpuhost(root, "vgpu", "create", "--profile", "A100-4C")
    assert plain["schema"] == "vgpuhost.vgpu/v1" and plain["backend"] == "mdev" and plain["gpu"] == A100
    assert plain["type_name"] == "A100-4C" and plain["parent"] != A100   # a VF, not the PF
    active = _listed(root)
    assert set(active) == {plain["id"]}, "mdevctl list does not show the created vGPU"
    parent, mdev_type, _ = active[plain["id"]]
    assert (parent, mdev_type) == (plain["parent"], plain["type_id"])
    # the type id mdevctl reports is the one whose name is A100-4C on that parent
    types = nsutil.parse_types(nsutil.run_mdevctl(root, "types", "--dumpjson"))
    assert types[parent][mdev_type]["name"].endswith("A100-4C")
    assert _listed(root, "--defined") == {}, "a vGPU created without --persist is defined in mdevctl"

    kept = _vgpuhost(root, "vgpu", "create", "--profile", "a100-4c", "--persist")
    assert kept["id"] != plain["id"] and kept["parent"] != plain["parent"]
    assert (host.mdevctl_d / kept["parent"] / kept["id"]).is_file()
    active = _listed(root)
    assert {u: v[:2] for u, v in active.items()} == {
        plain["id"]: (plain["parent"], plain["type_id"]),
        kept["id"]: (kept["parent"], kept["type_id"]),
    }
    assert _listed(root, "--defined") == {kept["id"]: (kept["parent"], kept["type_id"], "auto")}

    # vgpuhost's own list agrees
    ours = {e["id"]: (e["parent"], e["type_id"]) for e in _vgpuhost(root, "vgpu", "list")["vgpus"]}
    assert ours == {u: v[:2] for u, v in active.items()}

    _vgpuhost(root, "vgpu", "remove", kept["id"])
    assert _listed(root, "--defined") == {}
    assert set(_listed(root)) == {plain["id"]}
