"""Live migration of domains with vGPUs between two simulated hosts (issue 27, section 2).

``vgpuhost migrate check`` in each refusal case, the qemu hook's ``migrate begin`` rewrite on the
destination, the reservation ``prepare begin`` makes from, the release of a cancelled migration, the
sweep of an expired reservation, and a kill -9 sweep over the destination's ``migrate begin`` and
``prepare begin``.

A real live migration between two isolated libvirtds cannot run here: QEMU cannot migrate a VFIO
device without the device (the simulator has no VFIO device behind its tree).  The tests therefore
drive the hook exactly as libvirt calls it during a migration (libvirt's hooks page, docs/reference/
libvirt.md#hooks): on the destination ``NAME migrate begin -`` with the incoming XML on stdin (its
stdout, when not empty, replaces the XML), then ``prepare begin``, ``start begin`` and ``started
begin`` with the XML migrate begin gave; on the source ``release end`` once the migration succeeded;
on the destination ``release end`` when it failed or was cancelled.  Every outcome is read back from
the simulated sysfs trees, the state stores and the audit logs.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from typing import List, Optional, Tuple

import pytest

from vgpuhost.cli.main import main as cli_main
from vgpuhost.hook import runtime as hook
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest, parse_domain
from vgpuhost.model.values import PciAddress

A = PciAddress.parse
DOM = "11111111-2222-4333-8444-0000000000a1"
OTHER = "11111111-2222-4333-8444-0000000000b2"
MDEV = "aaaaaaaa-2222-4333-8444-0000000000a1"
OTHER_MDEV = "aaaaaaaa-2222-4333-8444-0000000000b2"

A40_AT = """
version: 1
name: a40-{bdf}
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
  driver_version: {version}
devices:
  - {{bdf: "0000:{bus}:01.0", model: intel-root-port, numa_node: 0}}
  - {{bdf: "0000:{bdf}", model: A40, upstream: "0000:{bus}:01.0", numa_node: 0, vgpu: {{backend: mdev}}}}
"""


def a40(make_host, bdf: str = "41:00.0", version: str = "580.65.05") -> HostRoot:
    bus = f"{int(bdf[:2], 16) - 1:02x}"
    return make_host(yaml_text=A40_AT.format(bdf=bdf, bus=bus, version=version))


def pci_hostdev(bdf) -> str:
    a = A(str(bdf))
    return (f"<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x{a.domain:04x}' "
            f"bus='0x{a.bus:02x}' slot='0x{a.slot:02x}' function='0x{a.function:x}'/></source></hostdev>")


def mdev_hostdev(uuid: str) -> str:
    return (f"<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'><source>"
            f"<address uuid='{uuid}'/></source></hostdev>")


def domain_xml(name: str, uuid: str, meta: Metadata, hostdevs) -> str:
    return (f"<domain type='kvm' id='7'>\n  <name>{name}</name>\n  <uuid>{uuid}</uuid>\n"
            f"  <metadata>\n{meta.to_xml()}  </metadata>\n  <memory unit='KiB'>65536</memory>\n"
            f"  <os><type arch='x86_64' machine='pc'>hvm</type></os>\n  <devices>\n    "
            + "\n    ".join(hostdevs) + "\n  </devices>\n</domain>\n")


def mdev_domain(name: str = "vm", uuid: str = DOM, mdev: str = MDEV, profile: str = "A40-8Q", gpu=None,
                tenant: Optional[str] = None, qos: Optional[str] = None) -> str:
    meta = Metadata(strategy="first-fit", tenant=tenant, vgpus=[VgpuRequest(profile, uuid=mdev, gpu=gpu)], qos=qos)
    return domain_xml(name, uuid, meta, [mdev_hostdev(mdev)])


def vf_domain(vf: str, profile: str, name: str = "vm", uuid: str = DOM) -> str:
    meta = Metadata(strategy="first-fit", vgpus=[VgpuRequest(profile, vf=A(vf))])
    return domain_xml(name, uuid, meta, [pci_hostdev(vf)])


def call(host: HostRoot, name: str, op: str, sub: str, xml: str) -> Tuple[int, str, str]:
    """One hook call as libvirt makes it: ``(exit code, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    code = hook.main([name, op, sub, "-"], io.BytesIO(xml.encode()), err, host=host, stdout=out)
    return code, out.getvalue(), err.getvalue()


def migrate_in(host: HostRoot, name: str, xml: str) -> Tuple[int, str, str]:
    """The destination's side of a successful migration: migrate begin, then prepare, start and
    started begin with the XML migrate begin gave (empty stdout: the XML as it came)."""
    code, out, err = call(host, name, "migrate", "begin", xml)
    if code != 0:
        return code, out, err
    xml = out or xml
    for op in ("prepare", "start", "started"):
        c, _, e = call(host, name, op, "begin", xml)
        if c != 0:
            return c, xml, e
    return 0, xml, ""


def store(host: HostRoot) -> StateStore:
    return StateStore(host.state_dir, create=False)


def reservations(host: HostRoot) -> List[tuple]:
    return store(host).reservation_rows() if (host.state_dir / "state.db").exists() else []


def mdevs(host: HostRoot) -> dict:
    """``{mdev UUID: parent GPU BDF}`` of the mdevs in the tree."""
    fs = Sysfs(host)
    d = host.path("sys", "bus", "mdev", "devices")
    return {u: os.path.basename(os.path.dirname(fs.resolve(d / u))) for u in fs.listdir(d)}


def vf_type(host: HostRoot, vf: str) -> str:
    return Sysfs(host).read(host.pci_device(A(vf)) / "nvidia" / "current_vgpu_type").strip()


def cli(capsys, host: HostRoot, *argv) -> Tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = cli_main(["--root", str(host.root), *argv])
    except SystemExit as e:
        code = e.code
    o = capsys.readouterr()
    return code, o.out, o.err


def check(capsys, src: HostRoot, dest: HostRoot, xml: str, tmp_path) -> Tuple[int, dict, str]:
    f = tmp_path / "dom.xml"
    f.write_text(xml)
    code, out, err = cli(capsys, src, "--json", "migrate", "check", "--xml", str(f), "--to", str(dest.root))
    return code, (json.loads(out) if out.strip() else {}), err


def audit_paths(host: HostRoot) -> List[Tuple[str, str]]:
    if not (host.state_dir / "state.db").exists():
        return []
    return [(r.path, r.result) for r in store(host).audit_rows()]


# ---------------------------------------------------------------------------
# migrate check


def test_check_answers_yes_and_each_refusal_names_what_and_the_fix(make_host, capsys, tmp_path):
    src, dest = make_host("a40-mdev"), a40(make_host, "41:00.0")
    xml = mdev_domain(gpu=A("0000:81:00.0"))
    assert call(src, "vm", "prepare", "begin", xml)[0] == 0
    code, doc, _ = check(capsys, src, dest, xml, tmp_path)
    assert code == 0 and doc["ok"] and doc["refusals"] == []
    assert doc["devices"] == [{"device": MDEV, "kind": "mdev", "profile": "A40-8Q", "gpu": "0000:41:00.0",
                               "parent": "0000:41:00.0"}]
    assert doc["manager_version"] == {"source": "580.65.05", "destination": "580.65.05"}
    assert audit_paths(dest) == [] and reservations(dest) == []          # read-only: nothing on the destination

    # the type missing: an L40S host offers no A40 type
    l40s = make_host("l40s-vendor-vfio")
    code, doc, _ = check(capsys, src, l40s, xml, tmp_path)
    assert code == 2 and not doc["ok"] and [r["code"] for r in doc["refusals"]] == ["type-missing"]
    assert "A40-8Q" in doc["refusals"][0]["line"] and "same on both hosts" in doc["refusals"][0]["fix"]

    # the vGPU manager: another version on the destination
    old = a40(make_host, "41:00.0", version="550.127.06")
    code, doc, _ = check(capsys, src, old, xml, tmp_path)
    assert code == 2 and [r["code"] for r in doc["refusals"]] == ["manager-version"]
    assert "550.127.06" in doc["refusals"][0]["line"] and "580.65.05" in doc["refusals"][0]["fix"]

    # text output: one line per refusal, then the verdict
    f = tmp_path / "dom.xml"
    code, out, _ = cli(capsys, src, "migrate", "check", "--xml", str(f), "--to", str(old.root))
    assert code == 2 and out.splitlines()[0].startswith("refused: vGPU manager 550.127.06 on the destination")
    assert "fix: install vGPU manager 580.65.05" in out.splitlines()[0]


def test_the_simulator_writes_the_vgpu_managers_version_and_refuses_a_bad_one(make_host):
    from vgpuhost.io.vgpudev import manager_version
    from vgpuhost.model.errors import VgpuhostError
    host = a40(make_host, version="550.127.06")
    assert manager_version(Sysfs(host)) == "550.127.06"
    with pytest.raises(VgpuhostError) as e:
        a40(make_host, version="5.x")
    assert e.value.message == "<spec>:6: driver_version must be dotted numbers like 580.65.05, found '5.x'"


def test_check_refuses_passthrough_with_its_reason(make_host, capsys, tmp_path):
    src, dest = make_host("a40-mdev"), a40(make_host)
    meta = Metadata(strategy="first-fit", passthrough=[A("0000:81:00.0")])
    xml = domain_xml("pt", DOM, meta, [pci_hostdev("0000:81:00.0")])
    code, doc, _ = check(capsys, src, dest, xml, tmp_path)
    assert code == 2 and [r["code"] for r in doc["refusals"]] == ["passthrough"]
    assert "no live migration" in doc["refusals"][0]["line"]
    # and the hook's migrate begin refuses it too, reserving nothing
    code, out, err = call(dest, "pt", "migrate", "begin", xml)
    assert code == 2 and out == "" and "passed through" in err and reservations(dest) == []
    assert audit_paths(dest) == [("(migration)", "refused")]


def test_check_runs_admission_for_the_tenant_on_the_destination(make_host, capsys, tmp_path):
    src, dest = make_host("a40-mdev"), a40(make_host)
    for h in (src, dest):
        assert cli(capsys, h, "tenant", "add", "team-a", "--vgpus", "1" if h is src else "0:0")[0] == 0
    from vgpuhost.ops import tenancy
    tenancy.bind(StateStore(src.state_dir), DOM, "team-a", name="vm")      # the operator's binding on the source
    xml = mdev_domain(tenant="team-a")
    assert call(src, "vm", "prepare", "begin", xml)[0] == 0
    before = audit_paths(dest)
    # not bound on the destination (trial 5 finding 4): the check says so and gives the command, as
    # prepare begin there would admit it without a tenant; the source's word is not taken for tenancy
    code, doc, _ = check(capsys, src, dest, xml, tmp_path)
    assert code == 2 and [r["code"] for r in doc["refusals"]] == ["admission"], doc
    assert "bound to tenant team-a on the source but not on this destination" in doc["refusals"][0]["line"]
    assert doc["refusals"][0]["fix"].startswith(f"bind it on the destination first: 'vgpuhost tenant bind {DOM} "
                                                "team-a'")
    assert audit_paths(dest) == before and store(dest).allocation_rows() == []     # admission was read-only
    # bound there: the destination's own binding and quota decide (team-a has none there)
    # the fix's command as given, on a destination whose libvirt does not know the domain yet
    assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", DOM, "team-a")[0] == 0
    assert store(dest).binding(DOM)[1] == "team-a"
    code, doc, _ = check(capsys, src, dest, xml, tmp_path)
    assert code == 2 and [r["code"] for r in doc["refusals"]] == ["admission"], doc
    assert doc["refusals"][0]["line"].startswith("tenant team-a: ") and "bind it" not in doc["refusals"][0]["fix"]
    assert store(dest).allocation_rows() == []
    # the hook's migrate begin decides the same before the migration starts: refused, nothing reserved,
    # one refused audit row (it did no admission: trial 5 leftover)
    before = audit_paths(dest)
    code, out, err = call(dest, "vm", "migrate", "begin", xml)
    assert code == 2 and out == "" and "incoming migration refused: tenant team-a: " in err, err
    assert reservations(dest) == [] and store(dest).allocation_rows() == []
    assert [r for r in audit_paths(dest)[len(before):]] == [("(migration)", "refused")]
    # room for team-a there: the check says yes and the hook's migrate begin and prepare begin agree
    assert cli(capsys, dest, "tenant", "set", "team-a", "--vgpus", "1")[0] == 0
    code, doc, _ = check(capsys, src, dest, xml, tmp_path)
    assert code == 0 and doc["ok"], doc
    assert migrate_in(dest, "vm", xml)[0] == 0 and [r.owner for r in store(dest).vgpu_records()] == [DOM]


def test_the_check_takes_no_tenant_or_class_from_the_request(make_host, capsys):
    """A request that claims a tenant and class the destination never bound (forged JSON, trial 5
    finding 4) gets no admission as that tenant: it is refused with the binding to make there."""
    dest = a40(make_host)
    assert cli(capsys, dest, "tenant", "add", "g", "--qos", "guaranteed")[0] == 0
    req = {"schema": "vgpuhost.migrate-request/v1", "name": "vm", "uuid": DOM, "strategy": "first-fit",
           "anti_affinity": None, "tenant": "g", "qos": "guaranteed", "manager_version": "580.65.05",
           "devices": [{"kind": "mdev", "device": MDEV, "profile": "A40-8Q", "gpu": ""}]}
    from vgpuhost.ops.migrate import check_incoming
    from vgpuhost.policy.migration import parse_request
    doc = check_incoming(dest, parse_request(req))
    assert not doc["ok"] and [r["code"] for r in doc["refusals"]] == ["admission"]
    assert "'vgpuhost tenant bind " + DOM + " g --qos guaranteed'" in doc["refusals"][0]["fix"]
    assert store(dest).binding(DOM) is None and store(dest).allocation_rows() == []


def _refused_in(dest: HostRoot, name: str, xml: str, *, says: str) -> None:
    """``migrate begin`` of ``xml`` on ``dest`` is refused (exit 2, ``says`` in its line) with one
    ``(migration)`` audit row and nothing else written: no reservation, no allocation, no other row."""
    before = audit_paths(dest)
    kept, allocs = reservations(dest), store(dest).allocation_rows()
    code, out, err = call(dest, name, "migrate", "begin", xml)
    assert code == 2 and out == "" and "incoming migration refused: " in err and says in err, err
    assert audit_paths(dest)[len(before):] == [("(migration)", "refused")]
    assert reservations(dest) == kept and store(dest).allocation_rows() == allocs


def test_migrate_begin_refuses_an_xml_that_claims_another_tenant_or_a_stronger_class(make_host, capsys):
    """Trial 7 F5: the incoming XML is what prepare begin will see, so migrate begin weighs its metadata's
    tenant and QoS class as prepare begin does (the XML may ask, never claim): a claim is refused before
    anything is reserved, not at prepare begin."""
    dest = a40(make_host)
    assert cli(capsys, dest, "tenant", "add", "t1", "--vgpus", "0:1")[0] == 0
    assert cli(capsys, dest, "tenant", "add", "t2", "--vgpus", "0:2")[0] == 0
    assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", DOM, "t2")[0] == 0
    # bound to t2, its metadata names t1: refused as prepare begin refuses it, naming the binding
    _refused_in(dest, "vm", mdev_domain(tenant="t1"), says="its metadata names tenant 't1'")
    # a class stronger than t2's (burstable)
    _refused_in(dest, "vm", mdev_domain(qos="guaranteed"), says="guaranteed")
    assert call(dest, "vm", "prepare", "begin", mdev_domain(qos="guaranteed"))[0] == 2      # the two agree
    # migrate check --incoming keeps its word: the request carries the destination-trusted binding only
    from vgpuhost.ops.migrate import check_incoming
    from vgpuhost.policy.migration import Device, Request
    req = Request("vm", DOM, "first-fit", None, None, None, "580.65.05", (Device("mdev", MDEV, "A40-8Q", ""),))
    assert check_incoming(dest, req)["ok"]
    # what the XML may do: ask for its own tenant, or a weaker class; then admitted and reserved
    xml = mdev_domain(tenant="t2", qos="best-effort")
    code, moved, err = migrate_in(dest, "vm", xml)
    assert code == 0, err
    assert [(r.device, r.tenant, r.qos) for r in map(_row, store(dest).allocation_rows())] == \
        [(MDEV, "t2", "best-effort")]


def _row(r):
    from vgpuhost.ops.tenancy import _alloc
    return _alloc(r)


THIRD = "11111111-2222-4333-8444-0000000000c3"
THIRD_MDEV = "aaaaaaaa-2222-4333-8444-0000000000c3"


def test_a_pending_incoming_reservation_counts_against_its_tenants_quota(make_host, capsys):
    """Trial 7 F4: two incoming migrations of one tenant with a quota of 1: the first's reservation is as
    good as in use, so the second's migrate begin (and its check) are refused on quota; so is a start of
    the tenant's third domain meanwhile (docs/guide/migration.md); a cancelled migration frees it."""
    dest = a40(make_host)
    assert cli(capsys, dest, "tenant", "add", "t1", "--vgpus", "0:1")[0] == 0
    for u in (DOM, OTHER, THIRD):
        assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", u, "t1")[0] == 0
    first = mdev_domain(profile="A40-2Q")
    second = mdev_domain("vm2", OTHER, OTHER_MDEV, profile="A40-2Q")
    def fits() -> Tuple[int, str]:
        code, out, _ = cli(capsys, dest, "--json", "capacity", "--tenant", "t1", "--profile", "A40-2Q")
        (doc,) = [p for p in json.loads(out)["profiles"] if p["profile"] == "A40-2Q"]
        return doc["fits"], doc["why_not"]
    assert fits()[0] == 1
    assert call(dest, "vm", "migrate", "begin", first)[0] == 0 and [r[1] for r in reservations(dest)] == [DOM]
    assert fits() == (0, "quota vGPUs of tenant 't1': 1 in use + 1 asked > 1 (burst limit)")   # capacity agrees
    _refused_in(dest, "vm2", second, says="quota vGPUs of tenant 't1': 1 in use + 1 asked > 1")
    from vgpuhost.ops.migrate import check_incoming
    from vgpuhost.policy.migration import Device, Request
    req = Request("vm2", OTHER, "first-fit", None, "t1", None, "580.65.05",
                  (Device("mdev", OTHER_MDEV, "A40-2Q", ""),))
    doc = check_incoming(dest, req)
    assert not doc["ok"] and "quota vGPUs of tenant 't1'" in doc["refusals"][0]["line"], doc
    assert "reserved for the incoming migration of domain 'vm'" in doc["refusals"][0]["fix"], doc
    # a plain start of the tenant's third domain counts it too: refused with the reservation named
    before = audit_paths(dest)
    code, _, err = call(dest, "vm3", "prepare", "begin", mdev_domain("vm3", THIRD, THIRD_MDEV, profile="A40-2Q"))
    assert code == 2 and "quota vGPUs of tenant 't1': 1 in use + 1 asked > 1" in err, err
    assert "reserved for the incoming migration of domain 'vm'" in err
    assert audit_paths(dest)[len(before):] == [("(admission)", "refused")] and mdevs(dest) == {}
    # the incoming domain itself is not counted twice: its prepare begin makes it
    assert migrate_in(dest, "vm", first)[0] == 0 and reservations(dest) == [] and mdevs(dest) == {MDEV: "0000:41:00.0"}
    _refused_in(dest, "vm2", second, says="quota vGPUs of tenant 't1': 1 in use + 1 asked > 1")
    assert call(dest, "vm", "release", "end", first)[0] == 0
    # an expired reservation holds nothing
    assert call(dest, "vm", "migrate", "begin", first)[0] == 0
    st = store(dest)
    with st.transaction() as conn:
        conn.execute("UPDATE reservations SET expires = '2000-01-01T00:00:00.000000+00:00'")
    st.close()
    assert call(dest, "vm2", "migrate", "begin", second)[0] == 0
    assert sorted((r[1], r[6] > "2001") for r in reservations(dest)) == [(DOM, False), (OTHER, True)]


def test_a_pending_incoming_reservation_of_an_exclusive_tenant_keeps_its_gpu(make_host, capsys):
    """Trial 7 F4, isolation: an exclusive tenant's incoming reservation holds its GPU against another
    tenant's incoming migration (one GPU here: refused) and another tenant's start."""
    dest = a40(make_host)
    assert cli(capsys, dest, "tenant", "add", "x", "--isolation", "exclusive")[0] == 0
    assert cli(capsys, dest, "tenant", "add", "s")[0] == 0
    assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", DOM, "x")[0] == 0
    for u in (OTHER, THIRD):
        assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", u, "s")[0] == 0
    assert call(dest, "vm", "migrate", "begin", mdev_domain(profile="A40-2Q"))[0] == 0
    assert [(r[1], r[3]) for r in reservations(dest)] == [(DOM, "0000:41:00.0")]
    _refused_in(dest, "vm2", mdev_domain("vm2", OTHER, OTHER_MDEV, profile="A40-2Q"), says="exclusive")
    code, _, err = call(dest, "vm3", "prepare", "begin", mdev_domain("vm3", THIRD, THIRD_MDEV, profile="A40-2Q"))
    assert code == 2 and "exclusive" in err and mdevs(dest) == {}, err
    assert migrate_in(dest, "vm", mdev_domain(profile="A40-2Q"))[0] == 0
    assert [(a.owner, a.tenant, a.gpu) for a in map(_row, store(dest).allocation_rows())] == \
        [(DOM, "x", "0000:41:00.0")]


def nova_domain(name: str, uuid: str, mdev: str, project: str, profile: str = "A40-2Q") -> str:
    """An unbound domain Nova started: its tenant is its ``<nova:project>`` under the OpenStack mapping."""
    meta = Metadata(strategy="first-fit", vgpus=[VgpuRequest(profile, uuid=mdev)])
    nova = ("<nova:instance xmlns:nova='http://openstack.org/xmlns/libvirt/nova/1.1'><nova:name>i</nova:name>"
            f"<nova:owner><nova:project uuid='6f70656e737461636b2034206576{uuid[-6:]}'>{project}</nova:project>"
            "</nova:owner></nova:instance>\n")
    return (domain_xml(name, uuid, meta, [mdev_hostdev(mdev)])
            .replace("<metadata>\n", "<metadata>\n" + nova, 1))


def test_a_reservation_of_a_nova_mapped_domain_counts_for_its_project_tenant(make_host, capsys):
    """Trial 7 retest N1: with the OpenStack mapping on, an unbound domain's tenant is its XML's Nova project;
    migrate begin stores that tenant with the reservation, so the reservation counts for it: a second
    incoming migration of the project (quota 1) is refused at its migrate begin, as are a plain start of
    the project, ``capacity --tenant`` and ``advise``'s admission count; the refusal names the tenant
    and says the holder is only a reservation (nothing to stop or detach)."""
    dest = a40(make_host)
    assert cli(capsys, dest, "tenant", "add", "t4", "--vgpus", "0:1")[0] == 0
    assert cli(capsys, dest, "tenant", "openstack", "--map", "project-name")[0] == 0
    first = nova_domain("vm", DOM, MDEV, "t4")
    second = nova_domain("vm2", OTHER, OTHER_MDEV, "t4")
    assert call(dest, "vm", "migrate", "begin", first)[0] == 0
    assert [(r[1], r[8]) for r in reservations(dest)] == [(DOM, "t4")] and store(dest).binding_rows() == []
    code, out, err = call(dest, "vm2", "migrate", "begin", second)
    assert code == 2 and out == "", err
    assert ("incoming migration refused: tenant t4 (Nova's project, by the OpenStack mapping): admission: "
            "quota vGPUs of tenant 't4': 1 in use + 1 asked > 1") in err, err
    assert "let the incoming migration of domain 'vm' end, or cancel it (vGPU A40-2Q" in err, err
    assert "stop or detach domain" not in err, err
    assert [r[1] for r in reservations(dest)] == [DOM]
    code, out, _ = cli(capsys, dest, "--json", "capacity", "--tenant", "t4", "--profile", "A40-2Q")
    (doc,) = [p for p in json.loads(out)["profiles"] if p["profile"] == "A40-2Q"]
    assert (doc["fits"], doc["why_not"]) == (0, "quota vGPUs of tenant 't4': 1 in use + 1 asked > 1 (burst limit)")
    from vgpuhost.observe.inventory import discover
    from vgpuhost.ops import tenancy
    st = store(dest)
    assert tenancy.admissible_after(st, discover(Sysfs(dest)), {}, "t4", "A40-2Q", "0000:41:00.0", 2) == \
        (0, "quota vGPUs of tenant 't4': 1 in use + 1 asked > 1 (burst limit)")
    # a plain start of the project's third domain counts it too
    code, _, err = call(dest, "vm3", "prepare", "begin", nova_domain("vm3", THIRD, THIRD_MDEV, "t4"))
    assert code == 2 and "quota vGPUs of tenant 't4': 1 in use + 1 asked > 1" in err and mdevs(dest) == {}, err
    # the reserving domain itself is admitted (its own reservation is not counted against it) and made
    assert migrate_in(dest, "vm", first)[0] == 0 and reservations(dest) == []
    assert [(a.owner, a.tenant) for a in map(_row, store(dest).allocation_rows())] == [(DOM, "t4")]


def test_a_reservation_made_before_schema_15_counts_for_the_domains_binding(make_host, capsys):
    """A store of schema 14 gains the reservation's tenant and class (None for the rows it holds); such a row
    counts for the reserving domain's binding, as before."""
    from storeutil import store_at_version
    from vgpuhost.io.state import MIGRATIONS
    dest = a40(make_host)
    (dest.state_dir).mkdir(parents=True, exist_ok=True)
    conn = store_at_version(dest.state_dir / "state.db", 14)
    conn.execute("INSERT INTO reservations VALUES (?, ?, 'vm', '0000:41:00.0', 'mdev', 'A40-2Q', "
                 "'2999-01-01T00:00:00.000000+00:00', '2026-12-07T00:00:00.000000+00:00')", (MDEV, DOM))
    conn.commit()
    conn.close()
    st = StateStore(dest.state_dir)
    assert st.schema_version == len(MIGRATIONS) == 17
    assert [r[:2] + r[8:] for r in st.reservation_rows()] == [(MDEV, DOM, None, None)]
    st.close()
    assert cli(capsys, dest, "tenant", "add", "t1", "--vgpus", "0:1")[0] == 0
    for u in (DOM, OTHER):
        assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", u, "t1")[0] == 0
    _refused_in(dest, "vm2", mdev_domain("vm2", OTHER, OTHER_MDEV, profile="A40-2Q"),
                says="quota vGPUs of tenant 't1': 1 in use + 1 asked > 1")


def test_check_refuses_a_mig_profile_busy_on_the_destination(make_host, capsys, tmp_path):
    src, dest = make_host("h200-mig-on"), make_host("h200-mig-on")
    for h in (src, dest):
        assert cli(capsys, h, "mig", "apply", "--gpu", "0000:18:00.0", "1g.18gb=1")[0] == 0
    xml = vf_domain("0000:18:00.4", "H200X-1-18C")
    assert call(src, "vm", "prepare", "begin", xml)[0] == 0
    # a destination in MIG mode without any GPU instance has never offered the type: missing, not busy
    bare = make_host("h200-mig-on")
    code, doc, _ = check(capsys, src, bare, xml, tmp_path)
    assert code == 2 and [r["code"] for r in doc["refusals"]] == ["type-missing"], doc
    assert "mig apply" in doc["refusals"][0]["fix"]
    assert check(capsys, src, dest, xml, tmp_path)[0] == 0
    # the destination's only 1g.18gb instance goes to another domain
    assert call(dest, "other", "prepare", "begin", vf_domain("0000:18:00.5", "H200X-1-18C", "other", OTHER))[0] == 0
    code, doc, _ = check(capsys, src, dest, xml, tmp_path)
    assert code == 2 and [r["code"] for r in doc["refusals"]] == ["mig-profile-busy"], doc
    assert "GPU instance" in doc["refusals"][0]["line"] and "mig" in doc["refusals"][0]["fix"]


def test_incoming_reads_the_request_on_stdin_and_a_uri_is_refused_with_the_two_step_form(make_host, capsys,
                                                                                           tmp_path, monkeypatch):
    src, dest = make_host("a40-mdev"), a40(make_host)
    xml = mdev_domain()
    f = tmp_path / "dom.xml"
    f.write_text(xml)
    code, out, err = cli(capsys, src, "migrate", "request", "--xml", str(f))
    assert code == 0 and err == "" and json.loads(out)["schema"] == "vgpuhost.migrate-request/v1"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(out.encode())))
    code, out2, _ = cli(capsys, dest, "--json", "migrate", "check", "--incoming")
    assert code == 0 and json.loads(out2)["ok"] and json.loads(out2)["devices"][0]["gpu"] == "0000:41:00.0"
    code, _, err = cli(capsys, src, "migrate", "check", "--xml", str(f), "--to", "qemu+tcp://dest/system")
    assert code == 2 and "ssh HOST vgpuhost migrate check --incoming" in err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'{"schema": "nope"}')))
    code, _, err = cli(capsys, dest, "migrate", "check", "--incoming")
    assert code == 2 and "not a migration request" in err


def test_the_agent_answers_the_incoming_check(make_host):
    """``POST /v1/migrate/check`` (read role) answers the destination's side, as ``--incoming`` does."""
    from vgpuhost.agent import api
    from vgpuhost.ops.migrate import request_for
    src, dest = make_host("a40-mdev"), make_host("l40s-vendor-vfio")
    body = request_for(src, StateStore(src.state_dir, create=False), parse_domain(mdev_domain())).as_dict()
    route, params, _ = api.match("POST", "/v1/migrate/check")
    assert route is not None and api.READ in route.roles
    api.check_keys(route, body)
    req = api.Request(params, {}, body, "test", 0, api.READ)
    doc = route.handler_for(req)(api.Agent(dest), req)
    assert doc["schema"] == "vgpuhost.migrate-check/v1" and not doc["ok"]
    assert [r["code"] for r in doc["refusals"]] == ["type-missing"] and audit_paths(dest) == []
    with pytest.raises(Exception) as e:
        bad = api.Request(params, {}, {**body, "devices": [{"kind": "disk"}]}, "test", 0, api.READ)
        route.handler_for(bad)(api.Agent(dest), bad)
    assert getattr(e.value, "exit_code", None) == 2


FAKE_SSH = """#!/bin/sh
# ssh as vgpuhost calls it: -o BatchMode=yes [-p PORT] -- TARGET vgpuhost --json migrate check --incoming;
# the far side is the host root $FAKE_SSH_ROOT, and the target is noted in $FAKE_SSH_LOG
[ "$1" = -o ] && [ "$2" = BatchMode=yes ] || exit 255
shift 2
if [ "$1" = -p ]; then shift 2; fi
[ "$1" = -- ] || exit 255
printf '%s\\n' "$2" >> "$FAKE_SSH_LOG"
if [ "$2" = unreachable ]; then echo "ssh: connect to host unreachable port 22: No route to host" >&2; exit 255; fi
shift 3
exec PYTHON -m vgpuhost --root "$FAKE_SSH_ROOT" "$@"
"""


def test_check_over_ssh_runs_the_destinations_side_there(make_host, capsys, tmp_path, monkeypatch):
    """``--to qemu+ssh://HOST/system``: the request goes to ``vgpuhost migrate check --incoming`` over ssh
    (a stand-in ``ssh`` on PATH that checks the command line and runs the far side on another root)."""
    import sys
    src, dest = make_host("a40-mdev"), a40(make_host, version="550.127.06")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text(FAKE_SSH.replace("PYTHON", sys.executable))
    (bindir / "ssh").chmod(0o755)
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_ROOT", str(dest.root))
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    f = tmp_path / "dom.xml"
    f.write_text(mdev_domain())
    code, out, err = cli(capsys, src, "--json", "migrate", "check", "--xml", str(f), "--to",
                         "qemu+ssh://root@dest.example:2222/system")
    assert code == 2 and [r["code"] for r in json.loads(out)["refusals"]] == ["manager-version"], err
    assert json.loads(out)["destination"] == str(dest.root)
    assert log.read_text().splitlines() == ["root@dest.example"]
    code, _, err = cli(capsys, src, "migrate", "check", "--xml", str(f), "--to", "ssh://unreachable")
    assert code == 2 and "gave no answer (exit 255: ssh: connect to host unreachable" in err
    code, _, err = cli(capsys, src, "migrate", "check", "--xml", str(f), "--to", "ssh://-oProxyCommand=x")
    assert code == 2 and "invalid ssh destination" in err
    assert log.read_text().splitlines() == ["root@dest.example", "unreachable"]     # the bad one never ran ssh


EVIL_SSH = """#!/bin/sh
cat >/dev/null
exec PYTHON -c "import sys; sys.stdout.write(open(sys.argv[1]).read())" "$FAKE_SSH_ANSWER"
"""


def test_check_over_ssh_reads_a_capped_answer_and_escapes_its_strings(make_host, capsys, tmp_path, monkeypatch):
    """A destination that answers a forged check document (trial 5 finding 14): terminal control sequences
    and line breaks in its strings are escaped in the text output; an answer over 1 MiB, or one that is
    not a check document (too many refusals, an unknown code), is refused, exit 2, nothing of it printed."""
    import sys
    src, dest = make_host("a40-mdev"), a40(make_host, version="550.127.06")
    f = tmp_path / "dom.xml"
    f.write_text(mdev_domain())
    code, real, _ = cli(capsys, src, "--json", "migrate", "check", "--xml", str(f), "--to", str(dest.root))
    assert code == 2
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text(EVIL_SSH.replace("PYTHON", sys.executable))
    (bindir / "ssh").chmod(0o755)
    answer = tmp_path / "answer.json"
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_ANSWER", str(answer))
    doc = json.loads(real)
    doc["refusals"][0]["line"] = "\x1b]0;pwned\x07\x1b[31mEVIL\x1b[0m\nOK: dst can take vm"
    doc["destination"] = "d\x1b[2Jst"
    answer.write_text(json.dumps(doc))
    code, out, err = cli(capsys, src, "migrate", "check", "--xml", str(f), "--to", "ssh://b")
    assert code == 2 and "\x1b" not in out and "\x07" not in out
    assert out.count("\n") == 2 and "\\x1b]0;pwned\\x07" in out and "\\nOK: dst" in out, out
    big = dict(doc, refusals=[dict(doc["refusals"][0], fix="x" * 1000)] * 2000)
    answer.write_text(json.dumps(big))
    code, out, err = cli(capsys, src, "migrate", "check", "--xml", str(f), "--to", "ssh://b")
    assert code == 2 and out == "" and "answered more than 1048576 bytes" in err and "xxx" not in err
    answer.write_text(json.dumps(dict(doc, refusals=[doc["refusals"][0]] * 100)))
    code, out, err = cli(capsys, src, "migrate", "check", "--xml", str(f), "--to", "ssh://b")
    assert code == 2 and out == "" and "'refusals' is not a list of at most 52" in err and "pwned" not in err
    answer.write_text(json.dumps(dict(doc, refusals=[dict(doc["refusals"][0], code="\x1bx")])))
    code, out, err = cli(capsys, src, "migrate", "check", "--xml", str(f), "--to", "ssh://b")
    assert code == 2 and out == "" and "refusals[0] is not a refusal of a known code" in err


# ---------------------------------------------------------------------------
# the hook's migrate begin on the destination


def test_a_pinned_classic_mdev_is_repinned_reserved_made_and_the_source_freed(make_host):
    src, dest = make_host("a40-mdev"), a40(make_host, "41:00.0")
    xml = mdev_domain(gpu=A("0000:81:00.0"))
    assert call(src, "vm", "prepare", "begin", xml)[0] == 0 and mdevs(src) == {MDEV: "0000:81:00.0"}
    code, out, err = call(dest, "vm", "migrate", "begin", xml)
    assert code == 0, err
    new = parse_domain(out)
    assert new.metadata.vgpus[0].gpu == A("0000:41:00.0") and new.mdev_uuids == [MDEV]   # same UUID
    rows = reservations(dest)
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [(MDEV, DOM, "0000:41:00.0", "mdev")]
    assert mdevs(dest) == {}                                            # prepare begin makes it, not migrate begin
    for op in ("prepare", "start", "started"):
        assert call(dest, "vm", op, "begin", out)[0] == 0
    assert mdevs(dest) == {MDEV: "0000:41:00.0"} and reservations(dest) == []
    assert ("(reservation)", "made") in audit_paths(dest)
    assert call(src, "vm", "release", "end", xml)[0] == 0                # success: the source lets go
    assert mdevs(src) == {} and store(src).vgpu_records() == []


def test_an_unpinned_mdev_keeps_its_xml_and_is_made_where_it_was_reserved(make_host):
    src, dest = make_host("a40-mdev"), make_host(yaml_text=A40_AT.format(bdf="41:00.0", bus="40", version="580.65.05")
                                                  .replace('  - {bdf: "0000:40:01.0"', '  - {bdf: "0000:80:01.0", '
                                                           'model: intel-root-port, numa_node: 1}\n'
                                                           '  - {bdf: "0000:81:00.0", model: A40, upstream: '
                                                           '"0000:80:01.0", numa_node: 1, vgpu: {backend: mdev}}\n'
                                                           '  - {bdf: "0000:40:01.0"'))
    xml = mdev_domain()
    code, out, _ = call(dest, "vm", "migrate", "begin", xml)
    assert code == 0 and out == ""                                       # nothing host-specific: unchanged
    (row,) = reservations(dest)
    assert row[0] == MDEV and row[3] == "0000:41:00.0"
    assert call(dest, "vm", "prepare", "begin", xml)[0] == 0
    assert mdevs(dest) == {MDEV: "0000:41:00.0"} and reservations(dest) == []


def test_an_mdev_uuid_another_owner_holds_on_the_destination_is_renamed(make_host, capsys):
    """The only reason an mdev's UUID changes: the destination has that UUID already, for another owner."""
    dest = make_host(yaml_text=A40_AT.format(bdf="41:00.0", bus="40", version="580.65.05"))
    assert cli(capsys, dest, "vgpu", "create", "--profile", "A40-8Q", "--uuid", MDEV)[0] == 0
    xml = mdev_domain()
    code, moved, err = migrate_in(dest, "vm", xml)
    assert code == 0, err
    new = parse_domain(moved)
    (uuid,) = new.mdev_uuids
    assert uuid != MDEV and new.metadata.vgpus[0].uuid == uuid
    assert {r.id: r.owner for r in store(dest).vgpu_records()} == {MDEV: "manual", uuid: DOM}
    assert set(mdevs(dest)) == {MDEV, uuid} and reservations(dest) == []


def test_two_incoming_migrations_do_not_reserve_the_same_last_slot(make_host):
    """An A40 holds one A40-48Q: the first incoming migration reserves it, the second is refused (exit 2)
    with the reason, and gets it once the first was cancelled."""
    dest = a40(make_host)
    first = mdev_domain(profile="A40-48Q")
    second = mdev_domain("vm2", OTHER, OTHER_MDEV, profile="A40-48Q")
    assert call(dest, "vm", "migrate", "begin", first)[0] == 0
    code, out, err = call(dest, "vm2", "migrate", "begin", second)
    assert code == 2 and out == "" and "reserved for other incoming migrations" in err
    assert [r[1] for r in reservations(dest)] == [DOM]
    assert call(dest, "vm", "release", "end", first)[0] == 0
    assert call(dest, "vm2", "migrate", "begin", second)[0] == 0 and [r[1] for r in reservations(dest)] == [OTHER]


def test_a_vendor_vfio_vf_taken_on_the_destination_moves_to_a_free_one(make_host):
    src, dest = make_host("l40s-vendor-vfio"), make_host("l40s-vendor-vfio")
    xml = vf_domain("0000:21:00.4", "L40S-4Q")
    assert call(src, "vm", "prepare", "begin", xml)[0] == 0 and vf_type(src, "0000:21:00.4") != "0"
    assert call(dest, "other", "prepare", "begin", vf_domain("0000:21:00.4", "L40S-4Q", "other", OTHER))[0] == 0
    code, moved, err = migrate_in(dest, "vm", xml)
    assert code == 0, err
    new = parse_domain(moved)
    assert new.metadata.vgpus[0].vf == A("0000:21:00.5") and new.pci_sources == [A("0000:21:00.5")]
    assert vf_type(dest, "0000:21:00.5") == vf_type(src, "0000:21:00.4") and reservations(dest) == []
    owners = {r.id: r.owner for r in store(dest).vgpu_records()}
    assert owners == {"0000:21:00.4": OTHER, "0000:21:00.5": DOM}
    # a start of another domain naming the reserved VF is refused while the reservation holds
    assert call(dest, "vm2", "migrate", "begin", vf_domain("0000:21:00.6", "L40S-4Q", "vm2",
                                                          "11111111-2222-4333-8444-0000000000c3"))[0] == 0
    x = vf_domain("0000:21:00.6", "L40S-4Q", "x", "11111111-2222-4333-8444-0000000000d4")
    code, _, err = call(dest, "x", "prepare", "begin", x)
    assert code == 2 and "reserved for the incoming migration of domain 'vm2'" in err, err
    # once expired (vm2's migration never came), the reservation holds nothing: the start takes the VF
    st = store(dest)
    with st.transaction() as conn:
        conn.execute("UPDATE reservations SET expires = '2000-01-01T00:00:00.000000+00:00'")
    st.close()
    assert call(dest, "x", "prepare", "begin", x)[0] == 0 and vf_type(dest, "0000:21:00.6") != "0"


L3 = "11111111-2222-4333-8444-0000000000e5"


def test_a_reserved_vf_takes_its_types_last_slot_from_every_other_start_and_count(make_host, capsys):
    """L40S-48Q fits once per L40S (trial 5 findings 3 and 5): GPU 21 full, the reservation of a VF of
    GPU a1 for an incoming migration takes a1's one slot.  A second migration needing it is refused at
    migrate begin naming the reservation; ``vgpu create`` finds no room (nothing made); capacity and
    types count the instance as taken; the migration's own prepare begin makes it there."""
    dest = make_host("l40s-vendor-vfio")
    assert call(dest, "l0", "prepare", "begin", vf_domain("0000:21:00.4", "L40S-48Q", "l0", OTHER))[0] == 0
    code, out, _ = cli(capsys, dest, "--json", "types", "--available")
    assert [t["gpu"] for t in json.loads(out)["types"] if t["name"] == "L40S-48Q"] == ["0000:a1:00.0"]
    vm = vf_domain("0000:21:00.5", "L40S-48Q")
    code, moved, err = call(dest, "vm", "migrate", "begin", vm)
    assert code == 0, err
    assert [(r[0], r[3], r[5]) for r in reservations(dest)] == [("0000:a1:00.4", "0000:a1:00.0", "L40S-48Q")]
    code, out, err = call(dest, "l2", "migrate", "begin", vf_domain("0000:21:00.6", "L40S-48Q", "l2", L3))
    assert code == 2 and out == "" and "0000:a1:00.0: 1 L40S-48Q reserved for other incoming migrations" in err
    assert [r[1] for r in reservations(dest)] == [DOM]
    # a start naming another VF of that GPU is refused naming the reservation, with its audit row (retest N1:
    # it was placed again and again, "the host kept changing under placement (5 attempts)")
    before = audit_paths(dest)
    code, _, err = call(dest, "l2", "prepare", "begin", vf_domain("0000:a1:00.6", "L40S-48Q", "l2", L3))
    assert code == 2 and "0000:a1:00.0's L40S-48Q slots are reserved for other incoming migrations " \
                         "(VF 0000:a1:00.4)" in err, err
    assert audit_paths(dest)[len(before):] == [("0000:a1:00.6", "refused")]
    assert vf_type(dest, "0000:a1:00.6") == "0"
    # naming the reserved VF itself, or a VF another domain holds: refused, and each has its row (trial 6
    # finding 4: no row)
    before = audit_paths(dest)
    code, _, err = call(dest, "l2", "prepare", "begin", vf_domain("0000:a1:00.4", "L40S-48Q", "l2", L3))
    assert code == 2 and "0000:a1:00.4 is reserved for the incoming migration of domain 'vm'" in err, err
    code, _, err = call(dest, "l2", "prepare", "begin", vf_domain("0000:21:00.4", "L40S-48Q", "l2", L3))
    assert code == 2, err
    assert audit_paths(dest)[len(before):] == [("(start)", "refused"), ("(start)", "refused")]
    # with tenancy in use, admission's refusal names the reservation too (trial 6 finding 4)
    assert cli(capsys, dest, "tenant", "add", "t1", "--qos", "best-effort")[0] == 0
    assert cli(capsys, dest, "--connect", "test:///default", "tenant", "bind", L3, "t1")[0] == 0
    before = audit_paths(dest)
    code, _, err = call(dest, "l2", "prepare", "begin", vf_domain("0000:a1:00.6", "L40S-48Q", "l2", L3))
    assert code == 2 and "1 reserved for incoming migrations: VF 0000:a1:00.4" in err, err
    assert [r for r in audit_paths(dest)[len(before):] if r[1] == "refused"] == [("(admission)", "refused")]
    assert cli(capsys, dest, "tenant", "remove", "t1")[0] == 0
    code, out, _ = cli(capsys, dest, "--json", "capacity", "--profile", "L40S-48Q")
    assert code == 0 and json.loads(out)["profiles"][0]["fits"] == 0, out
    code, out, _ = cli(capsys, dest, "--json", "types", "--available")
    assert code == 0 and not any(t["name"] == "L40S-48Q" for t in json.loads(out)["types"]), out
    code, out, _ = cli(capsys, dest, "exporter", "--once")
    assert code == 0 and 'vgpuhost_free_instances{pool="",profile="L40S-48Q"} 0.0' in out
    code, _, err = cli(capsys, dest, "vgpu", "create", "--profile", "L40S-48Q")
    assert code == 2 and "cannot place L40S-48Q" in err
    assert {r.owner for r in store(dest).vgpu_records()} == {OTHER}          # nothing made for 'manual'
    assert vf_type(dest, "0000:a1:00.4") == "0"
    # the migration's own start makes it on the reserved VF and spends the reservation
    for op in ("prepare", "start", "started"):
        assert call(dest, "vm", op, "begin", moved)[0] == 0
    assert vf_type(dest, "0000:a1:00.4") != "0" and reservations(dest) == []
    assert {r.id: r.owner for r in store(dest).vgpu_records()} == {"0000:21:00.4": OTHER, "0000:a1:00.4": DOM}


def test_a_mig_backed_vgpu_moves_to_a_free_gpu_instance(make_host, capsys):
    src, dest = make_host("h200-mig-on"), make_host("h200-mig-on")
    for h, layout in ((src, "1g.18gb=1"), (dest, "1g.18gb=2")):
        assert cli(capsys, h, "mig", "apply", "--gpu", "0000:18:00.0", layout)[0] == 0
    xml = vf_domain("0000:18:00.4", "H200X-1-18C")
    assert call(src, "vm", "prepare", "begin", xml)[0] == 0
    assert call(dest, "other", "prepare", "begin", vf_domain("0000:18:00.4", "H200X-1-18C", "other", OTHER))[0] == 0
    code, moved, err = migrate_in(dest, "vm", xml)
    assert code == 0, err
    vf = parse_domain(moved).metadata.vgpus[0].vf
    assert vf != A("0000:18:00.4") and vf_type(dest, str(vf)) == vf_type(src, "0000:18:00.4")


def test_a_cancelled_migration_releases_the_reservation_and_an_expired_one_is_swept(make_host, capsys):
    src, dest = make_host("a40-mdev"), a40(make_host)
    xml = mdev_domain()
    assert call(dest, "vm", "migrate", "begin", xml)[0] == 0 and len(reservations(dest)) == 1
    assert call(dest, "vm", "release", "end", xml)[0] == 0                # libvirt cancels: release end
    assert reservations(dest) == [] and mdevs(dest) == {}
    assert ("(reservation)", "released") in audit_paths(dest)
    # a destination whose libvirtd died after migrate begin: nothing calls release end; the reservation expires
    assert call(dest, "vm", "migrate", "begin", xml)[0] == 0
    row = reservations(dest)[0]
    st = store(dest)
    with st.transaction() as conn:                # its expiry passed
        conn.execute("UPDATE reservations SET expires = '2000-01-01T00:00:00.000000+00:00'")
    st.close()
    code, out, _ = cli(capsys, dest, "reconcile", "--check")
    assert code == 1 and f"expired reservation: mdev {row[0]}" in out
    code, out, _ = cli(capsys, dest, "reconcile")
    assert code == 0 and reservations(dest) == [] and ("(reservation)", "expired") in audit_paths(dest)


def test_the_installed_dispatcher_runs_migrate_begin_in_the_handler_and_prints_the_xml(make_host, tmp_path):
    """The hook as libvirt runs it (a process, minimal environment, the XML on stdin, the new XML read
    from stdout): a pinned mdev's pin is rewritten; a domain without vgpuhost's metadata prints nothing."""
    from vgpuhost.hook.install import install as hook_install
    dest = a40(make_host, "41:00.0")
    path = hook_install(dest, hooks_dir=tmp_path / "qemu.d").path
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C"}
    xml = mdev_domain(gpu=A("0000:81:00.0"))
    p = subprocess.run([str(path), "vm", "migrate", "begin", "-"], input=xml.encode(), capture_output=True, env=env,
                       timeout=120)
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    assert parse_domain(p.stdout).metadata.vgpus[0].gpu == A("0000:41:00.0")
    assert [r[0] for r in reservations(dest)] == [MDEV]
    plain = "<domain type='kvm'><name>p</name><uuid>" + OTHER + "</uuid><devices/></domain>"
    p = subprocess.run([str(path), "p", "migrate", "begin", "-"], input=plain.encode(), capture_output=True, env=env,
                       timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (0, b"", b"")


# ---------------------------------------------------------------------------
# kill -9 sweep over the destination's migrate begin and prepare begin


def _child(fn, env=None) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            from vgpuhost.sim import kernel as sim_kernel
            sim_kernel._writes_made = 0         # counted per process from 1 (this one forked from pytest's)
            os.environ.update(env or {})
            os._exit(fn())
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _kill_in(cls, name: str, when: str):
    """Patch ``cls.name`` in this (child) process to SIGKILL it ``before`` or ``after`` the call."""
    orig = getattr(cls, name)

    def wrapped(*a, **kw):
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = orig(*a, **kw)
        os.kill(os.getpid(), signal.SIGKILL)
        return out
    setattr(cls, name, wrapped)


def test_kill_sweep_leaves_no_reservation_or_device_behind(make_host, tmp_path):
    from vgpuhost.sim import kernel as sim_kernel
    template = a40(make_host, "41:00.0")
    xml = mdev_domain(gpu=A("0000:81:00.0"))
    n = [0]

    def fresh() -> HostRoot:
        n[0] += 1
        d = tmp_path / f"copy{n[0]}"
        subprocess.run(["cp", "-a", str(template.root), str(d)], check=True, timeout=60)
        return HostRoot(d)

    def fresh_from(host: HostRoot) -> HostRoot:
        n[0] += 1
        d = tmp_path / f"copy{n[0]}"
        subprocess.run(["cp", "-a", str(host.root), str(d)], check=True, timeout=60)
        return HostRoot(d)

    def settled(host: HostRoot, *, release: bool = True) -> None:
        """libvirt's release end on the destination (a failed migration; ``release`` False: a libvirtd that
        died too, so only the expiry frees the reservation), then reconcile: nothing of the domain is left,
        and reconcile --check finds the host in sync."""
        if release:
            assert call(host, "vm", "release", "end", xml)[0] == 0
        else:
            st = store(host)
            with st.transaction() as conn:
                conn.execute("UPDATE reservations SET expires = '2000-01-01T00:00:00.000000+00:00'")
            st.close()
        assert cli_main(["--root", str(host.root), "reconcile"]) == 0
        assert cli_main(["--root", str(host.root), "reconcile", "--check"]) == 0
        st = store(host)
        assert st.reservation_rows() == [] and st.vgpu_records() == [] and st.active_domains() == {}
        assert st.journal_entries(open_only=True) == [] and mdevs(host) == {}

    # migrate begin: its one write is the reservation's transaction; killed before and after it
    from vgpuhost.io.state import StateStore as Store
    for when in ("before", "after"):
        host = fresh()

        def op():
            _kill_in(Store, "reserve", when)
            return call(host, "vm", "migrate", "begin", xml)[0]
        assert _child(op) == -signal.SIGKILL
        assert len(reservations(host)) == (0 if when == "before" else 1)
        if when == "after":
            copy = fresh_from(host)
            settled(copy, release=False)            # nobody called release end: the expiry frees it
        settled(host)

    # prepare begin after a whole migrate begin: killed before and after each of its writes
    host = fresh()
    code, moved, _ = call(host, "vm", "migrate", "begin", xml)
    assert code == 0
    writes = tmp_path / "writes.log"
    assert _child(lambda: call(host, "vm", "prepare", "begin", moved)[0],
                  {sim_kernel.WRITE_LOG_ENV: str(writes)}) == 0
    total = len(writes.read_text().splitlines())
    assert total >= 1
    left = []
    for k in range(1, total + 1):
        for when in ("before", "after"):
            host = fresh()
            assert call(host, "vm", "migrate", "begin", xml)[0] == 0
            env = {sim_kernel.KILL_AT_ENV: str(k), sim_kernel.KILL_WHEN_ENV: when}
            assert _child(lambda: call(host, "vm", "prepare", "begin", moved)[0], env) == -signal.SIGKILL
            assert len(reservations(host)) == 1            # the kill came before prepare could spend it
            left.append(bool(mdevs(host)))
            settled(host)
    assert any(left)                                       # a kill after the create left an mdev to clean up


# ---------------------------------------------------------------------------
# a right-sized domain (resize="auto")


def test_a_right_sized_vgpu_migrates_with_the_type_its_xml_pins_and_is_never_right_sized_incoming(make_host,
                                                                                                   capsys, tmp_path):
    """Trial 5 finding 1: r1 asks A40-8Q with resize="auto" and runs A40-2Q on the source (right-sized
    from its metered history).  The check refuses its XML as it is (the destination makes what the XML
    names), naming the running type and the ``virsh migrate --xml`` fix; an incoming migration is never
    right-sized on the destination (even with history there saying it would be): the XML's type is
    reserved and made.  With the running type pinned in the XML, check and hook agree on A40-2Q."""
    from test_hook import mixed
    from test_resize import dom, history, type_name
    from test_tenancy import store_of, uid
    from vgpuhost.model.tenancy import Quota, Tenant
    from vgpuhost.ops import tenancy
    src, dest = mixed(make_host), mixed(make_host)
    dom_uuid, mdev = uid("d1d1d1d1", 1), uid("e1e1e1e1", 1)
    for h in (src, dest):
        tenancy.add(store_of(h), Tenant("web", quota=Quota()))
        tenancy.bind(store_of(h), dom_uuid, "web", name="r1")
        history(store_of(h), dom_uuid, mdev, "A40-8Q", peak_mib=1500, share=0.03)
    xml = dom(1, True)
    assert call(src, "r1", "prepare", "begin", xml)[0] == 0 and type_name(src, mdev) == "A40-2Q"
    code, doc, _ = check(capsys, src, dest, xml, tmp_path)
    assert code == 2 and [(r["code"], r["device"]) for r in doc["refusals"]] == [("running-type", mdev)], doc
    assert "runs A40-2Q" in doc["refusals"][0]["line"] and 'profile="A40-2Q"' in doc["refusals"][0]["fix"]
    # the XML as it is: the destination makes the type it names, as reserved, without right-sizing
    code, _, err = migrate_in(dest, "r1", xml)
    assert code == 0, err
    assert type_name(dest, mdev) == "A40-8Q"
    assert not [r for r in store(dest).audit_rows() if r.result in ("resized", "resize-fallback")]
    assert call(dest, "r1", "release", "end", xml)[0] == 0 and mdevs(dest) == {}
    # pinned: the check says yes with A40-2Q and the destination makes A40-2Q
    pinned = xml.replace('profile="A40-8Q"', 'profile="A40-2Q"')
    code, doc, _ = check(capsys, src, dest, pinned, tmp_path)
    assert code == 0 and [d["profile"] for d in doc["devices"]] == ["A40-2Q"], doc
    code, _, err = migrate_in(dest, "r1", pinned)
    assert code == 0, err
    assert type_name(dest, mdev) == "A40-2Q" and reservations(dest) == []


# ---------------------------------------------------------------------------
# MIG on demand on the destination


def test_a_mig_backed_vgpu_migrates_to_a_gpu_with_mig_on_demand_and_the_reservation_counts(make_host, capsys,
                                                                                           tmp_path):
    """Trial 5 finding 7: the destination has no GPU instance but MIG on demand on: the check says yes
    (as capacity counts 7), migrate begin reserves a VF and prepare begin makes the GPU instance.  A
    reserved 4g.71gb (one fits) takes that slot from a second migration (refused at migrate begin,
    naming the reservation) and from capacity."""
    src, dest = make_host("h200-mig-on"), make_host("h200-mig-on")
    for h in (src, dest):
        assert cli(capsys, h, "mig", "on-demand", "--gpu", "0000:18:00.0", "on")[0] == 0
    xml = vf_domain("0000:18:00.4", "H200X-1-18C")
    assert call(src, "vm", "prepare", "begin", xml)[0] == 0
    code, doc, _ = check(capsys, src, dest, xml, tmp_path)
    assert code == 0 and [d["profile"] for d in doc["devices"]] == ["H200X-1-18C"], doc
    code, moved, err = migrate_in(dest, "vm", xml)
    assert code == 0, err
    vf = str(parse_domain(moved).metadata.vgpus[0].vf)
    assert vf_type(dest, vf) == vf_type(src, "0000:18:00.4") and reservations(dest) == []
    assert [m.owner for m in __import__("vgpuhost.ops.migdemand", fromlist=["made"]).made(store(dest))] == [DOM]
    big = vf_domain("0000:18:00.6", "H200X-4-71C", "big", OTHER)
    assert call(dest, "big", "migrate", "begin", big)[0] == 0
    assert [(r[1], r[5]) for r in reservations(dest)] == [(OTHER, "H200X-4-71C")]
    code, out, _ = cli(capsys, dest, "--json", "capacity", "--profile", "H200X-4-71C")
    assert code == 0 and json.loads(out)["profiles"][0]["fits"] == 0, out
    code, out, err = call(dest, "big2", "migrate", "begin", vf_domain("0000:18:00.7", "H200X-4-71C", "big2", L3))
    assert code == 2 and out == "" and "1 H200X-4-71C reserved for other incoming migrations" in err, err
    assert [r[1] for r in reservations(dest)] == [OTHER]


def test_a_cut_answer_ends_the_read_even_when_a_grandchild_keeps_stderr_open(tmp_path):
    """The ssh answer over the cap: the child is killed and nothing more is read, though a process it
    left (an ssh master, here a background sleep) holds its stderr open: the call returns the cut answer,
    it does not wait out its timeout (which it raises: TimeoutExpired) (trial 5 retest, N4)."""
    from vgpuhost.io.process import run_capped
    pids = tmp_path / "pids"
    script = f"sleep 60 & echo $! > {pids}; head -c 5000 /dev/zero; sleep 60"
    try:
        code, out, _ = run_capped(["sh", "-c", script], timeout=30, limit=1000)
    finally:
        for pid in pids.read_text().split():
            os.kill(int(pid), signal.SIGKILL)
    assert code < 0 and len(out) == 1001
