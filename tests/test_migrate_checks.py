"""The destination's ``migrate begin`` applies what ``prepare begin`` applies before it admits and reserves:
the hook allow-list, the scheduler policy of pooled GPUs and the GPUs' mixed-size maxima (note43's open
item; ops/devices.admission_inputs is their one source for both).

Each case drives the hook as libvirt does on the destination (tests/test_migrate.py's ``call``) and reads
back that a migration ``prepare begin`` would refuse is refused at ``migrate begin`` with the same reason
and exit code, no reservation in the state store and one ``(migration)`` refusal in the audit log, and
that one ``prepare begin`` would admit still reserves and is then made.
"""

from __future__ import annotations

from typing import Tuple

from vgpuhost.io.state import StateStore
from vgpuhost.libvirt.domxml import parse_domain
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.ops import tenancy
from vgpuhost.ops.devices import allow_path
from vgpuhost.ops.migrate import check_incoming
from vgpuhost.policy.migration import Device, Request
from vgpuhost.sim.nvml import SimNvml

from test_hook import GPU_HI, GPU_LO, L40S, mixed
from test_issue26_pools_capacity import gold_host
from test_migrate import (DOM, MDEV, A, audit_paths, call, mdev_domain, mdevs, reservations, store,
                          vf_domain, vf_type)

ALLOW = "the hook allow-list (etc/vgpuhost/hook.allow) lets the hook place vGPUs only on: "


def refused_at_migrate_begin(host, xml: str, *, name: str = "vm") -> Tuple[str, str]:
    """``migrate begin`` of ``xml`` is refused: exit 2, nothing on stdout, one line; no reservation made, no
    allocation, and one ``(migration)`` row ``refused`` added to the audit log, naming the same line.
    ``(its reason after 'incoming migration refused: ', the audit row's value)``."""
    before, kept = audit_paths(host), reservations(host)
    code, out, err = call(host, name, "migrate", "begin", xml)
    prefix = f"vgpuhost: error: domain '{name}': incoming migration refused: "
    assert code == 2 and out == "" and err.count("\n") == 1, (code, err)
    assert err.startswith(prefix), err
    assert reservations(host) == kept and store(host).allocation_rows() == []
    assert audit_paths(host)[len(before):] == [("(migration)", "refused")]
    row = store(host).audit_rows()[-1]
    assert row.operation == f"migrate begin {name}" and row.result == "refused"
    return err[len(prefix):].rstrip("\n"), row.value


def refused_at_prepare_begin(host, xml: str, *, name: str = "vm") -> str:
    """``prepare begin`` of ``xml`` (a plain start of it, nothing reserved) is refused: exit 2, one line,
    no device made, no allocation; its line after the domain."""
    before, allocations = mdevs(host), store(host).allocation_rows()
    code, _, err = call(host, name, "prepare", "begin", xml)
    prefix = f"vgpuhost: error: domain '{name}': "
    assert code == 2 and err.count("\n") == 1 and err.startswith(prefix), (code, err)
    assert mdevs(host) == before and store(host).allocation_rows() == allocations
    return err[len(prefix):].rstrip("\n")


# ---------------------------------------------------------------------------
# the hook allow-list

def test_migrate_begin_places_only_on_gpus_the_hook_allow_list_allows(make_host):
    host = mixed(make_host)                 # two A40 (GPU_LO, GPU_HI, classic mdev) and an L40S (vendor VFIO)
    allow = allow_path(host)
    allow.parent.mkdir(parents=True)
    free = mdev_domain()

    # a file listing nothing allows nothing: refused as prepare begin refuses it, with its fix
    allow.write_text("")
    start = refused_at_prepare_begin(host, free)
    assert start.endswith("; " + ALLOW + "none"), start
    why, value = refused_at_migrate_begin(host, free)
    assert why.endswith("; " + ALLOW + "none") and "0000:41:00.0: not in the hook allow-list" in why, why
    assert why.split("; ")[-1] == start.split("; ")[-1]                     # the same fix, word for word
    assert value.endswith("fix: " + ALLOW + "none")
    check = check_incoming(host, Request("vm", DOM, "first-fit", None, None, None, "580.65.05",
                                         (Device("mdev", MDEV, "A40-8Q", ""),)))
    assert not check["ok"] and check["refusals"][0]["fix"] == ALLOW + "none"     # migrate check --incoming too

    # only the low A40: the L40S's VF is not offered (prepare begin refuses it there too)
    allow.write_text(f"{GPU_LO}\n")
    vf = vf_domain("0000:a1:00.4", "L40S-4Q")
    assert "GPU 0000:a1:00.0 is not in the hook allow-list (etc/vgpuhost/hook.allow)" in \
        refused_at_prepare_begin(host, vf)
    why, _ = refused_at_migrate_begin(host, vf)
    assert "0000:a1:00.0: not in the hook allow-list" in why and why.endswith("; " + ALLOW + str(GPU_LO)), why
    assert vf_type(host, "0000:a1:00.4") == "0"

    # a pin to a GPU the list leaves out moves to one it allows (as a pin to a GPU absent here does); the XML
    # prepare begin sees passes its own allow-list check and makes the vGPU where it was reserved
    pinned = mdev_domain(gpu=GPU_HI)
    assert "GPU 0000:81:00.0 is not in the hook allow-list" in refused_at_prepare_begin(host, pinned)
    code, moved, err = call(host, "vm", "migrate", "begin", pinned)
    assert code == 0 and err == "", err
    assert [(r[0], r[1], r[3]) for r in reservations(host)] == [(MDEV, DOM, str(GPU_LO))]
    assert audit_paths(host)[-1] == ("(reservation)", "reserved")
    assert parse_domain(moved).metadata.vgpus[0].gpu == GPU_LO
    for op in ("prepare", "start", "started"):
        assert call(host, "vm", op, "begin", moved)[0] == 0
    assert mdevs(host) == {MDEV: str(GPU_LO)} and reservations(host) == []

    # a bad allow-list refuses (fails closed) as at prepare begin: same line, nothing reserved
    assert call(host, "vm", "release", "end", moved)[0] == 0 and mdevs(host) == {}
    allow.write_text("41:00.0\n")
    code, _, err = call(host, "vm", "migrate", "begin", free)
    assert code == 2 and "hook.allow:1: '41:00.0' is not a GPU's PCI address" in err and reservations(host) == []
    assert (2, err) == call(host, "vm", "prepare", "begin", free)[::2]


# ---------------------------------------------------------------------------
# the scheduler policy of pooled GPUs

def test_migrate_begin_refuses_a_class_whose_only_gpu_is_in_drift_as_prepare_begin_does(make_host, capsys):
    host, s = gold_host(make_host, capsys)      # std (equal share) on GPU_LO, gold (fixed share, guaranteed) on GPU_HI
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    tenancy.bind(s, DOM, "g", name="vm")
    xml = mdev_domain()
    # the gold GPU set to best effort behind vgpuhost's back: it serves no class until 'apply'
    SimNvml(host).set_scheduler_state(GPU_HI, SchedulerState(policy="best-effort"))
    start = refused_at_prepare_begin(host, xml)
    assert "runs the best-effort scheduler, not the fixed-share of its pool 'gold': in drift" in start, start
    why, value = refused_at_migrate_begin(host, xml)
    assert why == "tenant g: " + start, why                             # prepare begin's line, word for word
    assert "in drift" in value
    req = Request("vm", DOM, "first-fit", None, "g", None, "580.65.05", (Device("mdev", MDEV, "A40-8Q", ""),))
    doc = check_incoming(host, req)
    r = doc["refusals"][0]
    assert not doc["ok"] and f"{r['line']}; {r['fix']}" == why         # migrate check --incoming says the same
    # the pool's policy again: the migration is admitted, reserved on the gold GPU and made there
    SimNvml(host).set_scheduler_state(GPU_HI, SchedulerState(policy="fixed-share"))
    assert check_incoming(host, req)["ok"]
    code, moved, err = call(host, "vm", "migrate", "begin", xml)
    assert code == 0 and moved == "", err
    assert [(r[0], r[3]) for r in reservations(host)] == [(MDEV, str(GPU_HI))]
    assert call(host, "vm", "prepare", "begin", xml)[0] == 0
    assert mdevs(host) == {MDEV: str(GPU_HI)} and reservations(host) == []
    assert [(r[0], r[2], r[3]) for r in store(host).allocation_rows()] == [(MDEV, "g", str(GPU_HI))]


# ---------------------------------------------------------------------------
# mixed-size maxima (free placement ids on a vendor-VFIO GPU in mixed-size mode)

MIXED_L40S = ("version: 1\nname: mixed\nhost:\n"
              "  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]\n"
              "  driver_version: 580.65.05\n"
              "devices:\n"
              '  - {bdf: "0000:20:01.1", model: amd-root-port}\n'
              '  - {bdf: "0000:21:00.0", model: L40S, upstream: "0000:20:01.1", '
              "vgpu: {backend: vendor-vfio, mixed_size: true, sriov_numvfs: 32}}\n")


def test_migrate_begin_counts_a_mixed_size_gpus_free_placement_ids_as_prepare_begin_does(make_host):
    """An L40S in mixed-size mode holding 16Q, 8Q, 4Q, 8Q and 2Q has one free placement id for a 2Q, though
    its VFs list the type and its framebuffer takes 23 more: the first incoming 2Q is reserved, the second
    is refused at its migrate begin (counted in the GPU's mode: the reservation takes that id), as its
    prepare begin is once the first is made."""
    from vgpuhost.io.sysfs import Sysfs
    from vgpuhost.observe.inventory import discover
    from vgpuhost.ops.vgpu import create, mode_limits
    from vgpuhost.policy.offers import offers
    from test_migrate import OTHER
    host = make_host(yaml_text=MIXED_L40S)
    s = StateStore(host.state_dir)
    gpu = A("0000:21:00.0")
    for i, p in enumerate(["L40S-16Q", "L40S-8Q", "L40S-4Q", "L40S-8Q", "L40S-2Q"]):
        create(host, s, profile=p, owner=f"6695eb01-f6a4-8304-79aa-97f2502e19{i:02d}")
    inv = discover(Sysfs(host))
    assert [o.available for o in offers(inv, s.vgpu_records(), "L40S-2Q")] == [23]      # the framebuffer alone
    assert mode_limits(host, inv, "L40S-2Q") == {gpu: 2}                               # one 2Q made, one more fits
    first, second = vf_domain("0000:21:02.0", "L40S-2Q"), vf_domain("0000:21:02.1", "L40S-2Q", "vm2", OTHER)
    code, moved, err = call(host, "vm", "migrate", "begin", first)
    assert code == 0 and moved == "", err
    assert [(r[0], r[1], r[3], r[5]) for r in reservations(host)] == [("0000:21:02.0", DOM, str(gpu), "L40S-2Q")]
    why, _ = refused_at_migrate_begin(host, second, name="vm2")
    assert why.startswith("L40S-2Q (0000:21:02.1): destination ") and \
        "0000:21:00.0: 1 L40S-2Q reserved for other incoming migrations" in why, why
    # the first is made where it was reserved; the second's prepare begin would be refused as well
    assert call(host, "vm", "prepare", "begin", first)[0] == 0 and reservations(host) == []
    assert {r.id: r.owner for r in s.vgpu_records()}["0000:21:02.0"] == DOM and vf_type(host, "0000:21:02.0") != "0"
    assert "does not offer L40S-2Q now" in refused_at_prepare_begin(host, second, name="vm2")
    assert vf_type(host, "0000:21:02.1") == "0"


# ---------------------------------------------------------------------------
# the tenant a refusal names: the trusted one (Nova's mapped project included)

NOVA = ("<nova:instance xmlns:nova='http://openstack.org/xmlns/libvirt/nova/1.1'><nova:name>i</nova:name>"
        "<nova:owner><nova:user uuid='u1'>admin</nova:user>"
        "<nova:project uuid='6f70656e737461636b20342065766572'>team</nova:project></nova:owner></nova:instance>\n")


def test_a_refusal_of_a_nova_mapped_domain_names_its_mapped_tenant(make_host):
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("team", quota=tenancy.Quota(tenancy.Limits(vgpus=0), tenancy.Limits(vgpus=0))))
    tenancy.set_openstack(s, "project-name")
    xml = mdev_domain().replace("<metadata>\n", "<metadata>\n" + NOVA)
    start = refused_at_prepare_begin(host, xml)
    assert "tenant 'team'" in start, start
    why, _ = refused_at_migrate_begin(host, xml)
    assert why == "tenant team (Nova's project, by the OpenStack mapping): " + start, why   # not "tenant (none)"


# ---------------------------------------------------------------------------
# prepare begin's own checks of the XML: an undeclared GPU device

def test_an_xml_naming_a_gpu_device_its_metadata_does_not_declare_is_refused_at_migrate_begin(make_host):
    from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
    from test_migrate import domain_xml, mdev_hostdev, pci_hostdev
    host = mixed(make_host)
    meta = Metadata(strategy="first-fit", vgpus=[VgpuRequest("A40-8Q", uuid=MDEV)])
    xml = domain_xml("vm", DOM, meta, [mdev_hostdev(MDEV), pci_hostdev(GPU_HI)])    # GPU_HI itself, undeclared
    start = refused_at_prepare_begin(host, xml)
    assert str(GPU_HI) in start, start
    why, _ = refused_at_migrate_begin(host, xml)
    assert why == start, why                                            # prepare begin's line and fix
    # declared as the metadata says (the vGPU alone): reserved
    assert call(host, "vm", "migrate", "begin", mdev_domain())[0] == 0 and [r[1] for r in reservations(host)] == [DOM]
