"""Issue 12 (j): `types`, placement offers and refusals count free vGPUs with one function.

Each test reads what the CLI prints (`types --json`, a refusal's hint) on a
simulated host changed through vgpuhost itself, and each failed before the
capacity rule was shared: `types` counted the kernel's per-parent numbers on
a GPU bound to vfio-pci, MIG-backed types on SR-IOV GPUs counted free VFs,
and refusals named such counts as "types that still fit".
"""

from __future__ import annotations

import json
import re

from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.inventory import discover, gpu_available
from vgpuhost.policy.offers import fitting_elsewhere, offers

A = PciAddress.parse
A40 = "0000:81:00.0"
H200 = "0000:18:00.0"
A100 = "0000:41:00.0"
DOM = "11111111-2222-4333-8444-0000000000c1"

A100_MIG_ON = """
version: 1
name: a100-mig-sriov
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:40:01.1", model: intel-root-port, numa_node: 0}
  - bdf: "0000:41:00.0"
    model: A100-PCIE-40GB
    upstream: "0000:40:01.1"
    numa_node: 0
    vgpu: {backend: mdev, sriov_numvfs: 20}
    mig: {mode: true}
"""


def cli(capsys, host, *argv):
    code = main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def types_json(capsys, host, *extra):
    code, out, err = cli(capsys, host, "--json", "types", *extra)
    assert code == 0, err
    return {e["name"]: e for e in json.loads(out)["types"]}


def _fit_counts(hint: str) -> dict:
    """``types that still fit: 0000:..: A-1 (2), B (1)`` -> ``{"A-1": 2, "B": 1}``."""
    return {m[1]: int(m[2]) for m in re.finditer(r"([A-Za-z0-9-]+) \((\d+)\)", hint)}


# ---------------------------------------------------------------------------
# a GPU bound to vfio-pci offers nothing

def test_types_shows_no_availability_on_a_gpu_passed_through(make_host, capsys):
    host = make_host("a40-mdev")
    code, _, err = cli(capsys, host, "passthrough", "prepare", A40)
    assert code == 0, err
    # off nvidia the vGPU manager has unregistered the GPU: sysfs lists no type, so neither does vgpuhost
    assert types_json(capsys, host) == {}                                          # 32 x A40-1B before
    assert types_json(capsys, host, "--available") == {}
    code, out, _ = cli(capsys, host, "types", "--available")
    assert code == 0 and out.strip() == "no vGPU types"
    code, _, err = cli(capsys, host, "passthrough", "release", A40)
    assert code == 0, err
    assert types_json(capsys, host)["A40-8Q"]["available_instances"] == 6          # back on nvidia


def test_a_refusal_on_a_passed_through_gpu_names_no_type_that_still_fits(make_host, capsys):
    host = make_host("a40-mdev")
    assert cli(capsys, host, "passthrough", "prepare", A40)[0] == 0
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--owner", DOM)
    assert code == 2 and "bound to vfio-pci" in err
    assert f"types that still fit: {A40}: none" in err                          # listed A40-1B (32), ... before


# ---------------------------------------------------------------------------
# MIG-backed types on SR-IOV GPUs count free GPU instances, not free VFs

def test_mig_backed_types_on_vendor_vfio_count_free_gpu_instances(make_host, capsys):
    host = make_host("h200-mig-on")
    code, _, err = cli(capsys, host, "mig", "apply", "--gpu", H200, "1g.18gb=2,2g.35gb=1")
    assert code == 0, err
    t = types_json(capsys, host)
    assert t["H200X-1-18C"]["available_instances"] == 2          # 16 before: one per free VF
    assert t["H200X-2-35C"]["available_instances"] == 1
    assert sum(p["available_instances"] for p in t["H200X-1-18C"]["parents"]) == 16   # the kernel's own view stays
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "H200X-1-18C", "--owner", DOM)
    assert code == 0, err
    t = types_json(capsys, host)
    assert t["H200X-1-18C"]["available_instances"] == 1 and t["H200X-2-35C"]["available_instances"] == 1


def test_mig_backed_types_on_sriov_mdev_count_free_gpu_instances(make_host, capsys):
    host = make_host(yaml_text=A100_MIG_ON)
    code, _, err = cli(capsys, host, "mig", "apply", "--gpu", A100, "1g.5gb=3,3g.20gb=1")
    assert code == 0, err
    t = types_json(capsys, host)
    assert t["A100-1-5C"]["available_instances"] == 3            # 20 before: the free VFs
    assert t["A100-3-20C"]["available_instances"] == 1
    for i in range(3):                                           # one vGPU per VM per GPU: three owners
        assert cli(capsys, host, "vgpu", "create", "--profile", "A100-1-5C", "--owner", DOM[:-1] + str(i))[0] == 0
    t = types_json(capsys, host)
    assert "A100-1-5C" not in t or t["A100-1-5C"]["available_instances"] == 0
    assert t["A100-3-20C"]["available_instances"] == 1


def test_a_refusal_names_only_mig_types_that_fit(make_host, capsys):
    host = make_host("h200-mig-on")
    assert cli(capsys, host, "mig", "apply", "--gpu", H200, "1g.18gb=2,2g.35gb=1")[0] == 0
    assert cli(capsys, host, "vgpu", "create", "--profile", "H200X-1-18C", "--owner", DOM,
               "--anti-affinity", "db")[0] == 0
    # placement refuses (anti-affinity: the only GPU holds key db): the hint lists what still fits there
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "H200X-1-18C", "--owner", DOM[:-1] + "2",
                       "--anti-affinity", "db")
    assert code == 2 and "types that still fit" in err, err
    assert _fit_counts(err.split("types that still fit:", 1)[1]) == {"H200X-1-18C": 1, "H200X-2-35C": 1}


# ---------------------------------------------------------------------------
# one function: types, offers and refusal hints agree on every GPU and type

def _agree(host, capsys):
    t = types_json(capsys, host)
    inv = discover(Sysfs(host))
    for g in inv.gpus:
        fits = _fit_counts(fitting_elsewhere(inv, g.address))
        for e in t.values():
            if e["gpu"] != str(g.address):
                continue
            n = e["available_instances"]
            assert gpu_available(inv, g.address, e["type_id"]) == n
            (o,) = [o for o in offers(inv, [], e["name"]) if o.gpu == g.address]
            assert o.available == n, (e["name"], o)
            assert fits.get(e["name"], 0) == n
            assert (o.note == "") == (n > 0)


def test_types_offers_and_hints_agree(make_host, capsys):
    host = make_host("a100-sriov-mdev")
    store = StateStore(host.state_dir)
    from vgpuhost.ops.vgpu import create
    _agree(host, capsys)
    create(host, store, profile="A100-4C", owner=DOM)
    _agree(host, capsys)
    host = make_host("h200-mig-on")
    assert cli(capsys, host, "mig", "apply", "--gpu", H200, "1g.18gb=2,2g.35gb=1")[0] == 0
    _agree(host, capsys)
    host = make_host("l40s-vendor-vfio")
    create(host, StateStore(host.state_dir), profile="L40S-8Q", owner=DOM)
    _agree(host, capsys)
    host = make_host("a40-mdev")
    assert cli(capsys, host, "passthrough", "prepare", A40)[0] == 0
    _agree(host, capsys)
