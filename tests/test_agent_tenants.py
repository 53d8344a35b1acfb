"""The agent's tenant role, with real unix users and groups made in the test's own mount namespace.

One agent for the module runs inside ``unshare --mount --propagation private`` with ``/etc/passwd``
and ``/etc/group`` bind-mounted from files written here (never this machine's ``/etc``): its admin and
read-only groups and one tenant's group are given by name and found in that group database, and a
second tenant's group is found by the naming convention (``vgpuhost-t-<tenant>``).  Each client is a
real process in a namespace like it, with the uid and groups of one of those users (``setgroups``), so
the agent sees their credentials through ``SO_PEERCRED``/``SO_PEERGROUPS`` as it would on a host.

The host: three simulated A40s; tenants t1 (at most 2 vGPUs) and t2 (exclusive: its GPU holds no one
else's vGPU); domains vm-a of t1, vm-b of t2 and
vm-c of no tenant, each started through the agent's hook endpoint with one A40-8Q.  Outcomes are read
back from the simulated tree, the state store and the audit log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid as uuidlib
from pathlib import Path
from typing import Any, Dict, List

import pytest

from agentutil import REPO, AgentRun, as_user, socket_dir
from test_hook import domain_xml, mdev_hostdev
from vgpuhost.agent import api
from vgpuhost.agent.server import Access, Caller, socket_role
from vgpuhost.io import unixsock
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.observe.inventory import discover
from vgpuhost.sim.build import materialise
from vgpuhost.sim.data import bundled_specs
from vgpuhost.sim.spec import parse_spec

# the users and groups of the namespace's own /etc (ids nobody on this machine has)
ADMIN_GID, RO_GID, T1_GID, T2_GID, NOBODY_GID = 54112, 54111, 54121, 54122, 54130
ADAM, RITA, ALICE, BOB, CAROL, DAVE = 54201, 54202, 54203, 54204, 54205, 54206
GROUPS = {"vgh-admin": (ADMIN_GID, "adam"), "vgh-ro": (RO_GID, "rita"),
          "vgpuhost-t-t1": (T1_GID, "alice,carol"),     # the naming convention
          "ml-team": (T2_GID, "bob,carol"),             # --tenant-group ml-team=t2
          "staff": (NOBODY_GID, "adam,rita,alice,bob,carol,dave")}
USERS = {"adam": ADAM, "rita": RITA, "alice": ALICE, "bob": BOB, "carol": CAROL, "dave": DAVE}

D1, D2, D3 = ("11111111-2222-4333-8444-0000000000e1", "11111111-2222-4333-8444-0000000000e2",
              "11111111-2222-4333-8444-0000000000e3")
M1, M2, M3 = ("aaaaaaaa-2222-4333-8444-0000000000e1", "aaaaaaaa-2222-4333-8444-0000000000e2",
              "aaaaaaaa-2222-4333-8444-0000000000e3")
#: the shipped a40-mdev host with two more A40s (a domain holds one vGPU per GPU; t2 is exclusive)
TWO_A40 = Path(bundled_specs()["a40-mdev"]).read_text() + """
  - {bdf: "0000:40:03.0", model: intel-root-port, numa_node: 0, iommu_group: 20}
  - bdf: "0000:41:00.0"
    model: A40
    upstream: "0000:40:03.0"
    numa_node: 0
    iommu_group: 21
    vgpu: {backend: mdev}
  - {bdf: "0000:c0:03.0", model: intel-root-port, numa_node: 1, iommu_group: 40}
  - bdf: "0000:c1:00.0"
    model: A40
    upstream: "0000:c0:03.0"
    numa_node: 1
    iommu_group: 41
    vgpu: {backend: mdev}
"""
#: the bind mounts, made only inside the new namespace (``$1`` passwd file, ``$2`` group file)
NS_SCRIPT = ('mount --bind "$1" /etc/passwd || exit 125; mount --bind "$2" /etc/group || exit 125; '
             'shift 2; exec "$@"')


def _namespace_unavailable() -> "str | None":
    if os.geteuid() != 0:
        return f"needs root for a private mount namespace (euid {os.geteuid()})"
    if shutil.which("unshare") is None:
        return "util-linux 'unshare' is not installed"
    with tempfile.TemporaryDirectory(prefix="vgh-nsprobe-") as d:
        a = Path(d, "a")
        a.write_text("probe\n")
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               'mount --bind "$1" /etc/group && grep -q probe /etc/group', "sh", str(a)],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            return f"'unshare --mount' + bind mount not permitted here: {(proc.stderr or '').strip()[:200]}"
    return None


class World:
    """The module's agent, its namespace's /etc files, and the clients' command prefix."""

    def __init__(self, root: Path, etc: Path):
        self.host = materialise(parse_spec(TWO_A40), root)
        passwd, group = etc / "passwd", etc / "group"
        passwd.write_text("root:x:0:0:root:/root:/bin/sh\n" + "".join(
            f"{name}:x:{uid}:{NOBODY_GID}::/nonexistent:/usr/sbin/nologin\n" for name, uid in USERS.items()))
        group.write_text("root:x:0:\n" + "".join(f"{name}:x:{gid}:{members}\n"
                                                 for name, (gid, members) in GROUPS.items()))
        self.prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", NS_SCRIPT, "sh",
                       str(passwd), str(group)]
        #: the operator's libvirt URI: libvirt's test driver on a file of this host (a path no member reads)
        self.libvirt_uri = f"test://{etc / 'libvirt-node.xml'}"
        self.run = AgentRun(self.host.root, admin_group="vgh-admin", ro_group="vgh-ro", prefix=self.prefix,
                            extra=("--metering-interval", "0", "--tenant-group", "ml-team=t2",
                                   "--libvirt-uri", self.libvirt_uri))

    def as_user(self, name: str, calls: List[tuple], *, docs: bool = False) -> List[Any]:
        """``calls`` from a process of user ``name`` with its groups from the namespace's group file."""
        uid = USERS[name]
        groups = sorted(gid for gid, members in GROUPS.values() if name in members.split(","))
        return as_user(uid, NOBODY_GID, groups, calls, docs=docs, prefix=self.prefix)

    def store(self) -> StateStore:
        return StateStore(self.host.state_dir, create=False)

    def mdevs(self) -> Dict[str, str]:
        return {m.uuid: m.type_id for m in discover(Sysfs(self.host), with_types=False).mdevs}

    def owners(self) -> Dict[str, str]:
        return {r.id: r.owner for r in self.store().vgpu_records()}


def _bind(root: str, dom: str, tenant: str, name: str) -> None:
    """The operator binds the domain to its tenant (the state store's binding, issue 28 item 1; what
    ``vgpuhost tenant bind`` records after asking libvirt the domain's UUID, which this test knows)."""
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.io.state import StateStore
    from vgpuhost.ops import tenancy
    store = StateStore(HostRoot(root).state_dir)
    try:
        assert tenancy.bind(store, dom, tenant, name=name)["tenant"] == tenant
    finally:
        store.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from nsutil import skip_or_fail
    skip_or_fail(_namespace_unavailable(), "the agent's tenant-scope tests")
    base = tmp_path_factory.mktemp("tenants")
    etc = base / "etc"
    etc.mkdir()
    w = World(base / "host", etc)
    try:
        run = w.run
        for body in ({"name": "t1", "vgpus": "2"}, {"name": "t2", "vgpus": "2", "isolation": "exclusive"}):
            status, doc = run.call("POST", "/v1/tenants", body)
            assert status == 200, doc
        for name, dom, mdev, tenant in (("vm-a", D1, M1, "t1"), ("vm-b", D2, M2, "t2"), ("vm-c", D3, M3, None)):
            if tenant:
                _bind(str(w.host.root), dom, tenant, name)
            meta = Metadata(tenant=tenant, vgpus=[VgpuRequest("A40-8Q", uuid=mdev)])
            xml = domain_xml(name, dom, meta, [mdev_hostdev(mdev)])
            status, doc = run.call("POST", "/v1/hook/prepare", {"xml": xml, "name": name})
            assert status == 200, doc
        assert w.owners() == {M1: D1, M2: D2, M3: D3}
        yield w
    finally:
        w.run.close()


def _get(sock: str, target: str) -> tuple:
    return (sock, "GET", target, None)


def _post(sock: str, target: str, body=None) -> tuple:
    return (sock, "POST", target, body)


# ---------------------------------------------------------------------------
# reading

def test_a_tenant_member_reads_only_its_own_tenant(world):
    t = world.run.tenant
    calls = [_get(t, "/v1/agent"), _get(t, "/v1/domains"), _get(t, "/v1/vgpus"), _get(t, "/v1/usage"),
             _get(t, "/v1/tenants"), _get(t, "/v1/capacity"), _get(t, "/v1/audit"), _get(t, "/v1/types")]
    # alice: t1 by the naming convention (group vgpuhost-t-t1)
    (s0, agent), (s1, doms), (s2, vgpus), (s3, usage), (s4, tenants), (s5, cap), (s6, audit), (s7, types) = \
        world.as_user("alice", calls, docs=True)
    assert (s0, s1, s2, s3, s4, s5, s6, s7) == (200,) * 8
    assert (agent["role"], agent["tenant"], agent["recovered"]) == ("tenant", "t1", {})
    assert [d["uuid"] for d in doms["domains"]] == [D1]
    assert [(v["id"], v["owner"]) for v in vgpus["vgpus"]] == [(M1, D1)]
    assert [u["tenant"] for u in usage["tenants"]] == ["t1"] and usage["tenants"][0]["usage"]["vgpus"]["used"] == 1
    assert [x["name"] for x in tenants["tenants"]] == ["t1"]
    assert cap["tenant"] == "t1"
    # t2's exclusive GPU is closed to t1, and says so without naming t2 (an admin reads the name)
    assert {g["gpu"]: g["exclusive"] for g in cap["gpus"]}["0000:81:00.0"] == "another tenant"
    assert "t2" not in json.dumps(cap) and D2 not in json.dumps(cap)
    admin_cap = world.run.call("GET", "/v1/capacity")[1]
    assert {g["gpu"]: g["exclusive"] for g in admin_cap["gpus"]}["0000:81:00.0"] == "t2"
    assert types["types"]                       # what the host offers names no owner
    # the audit: its own domain's rows only, and nothing in them names another tenant or domain
    def concerns_t1(r) -> bool:
        text = r["operation"] + r["path"] + r["value"]
        return D1 in text or M1 in text or "vm-a" in text or r["operation"] in ("tenant add t1", "tenant bind t1")
    assert audit["rows"] and all(concerns_t1(r) for r in audit["rows"]), audit["rows"]
    assert "tenant add t1" in [r["operation"] for r in audit["rows"]]
    assert "tenant add t2" in [r.operation for r in world.store().audit_rows()]
    text = repr(audit["rows"])
    for theirs in (D2, M2, D3, M3, "vm-b", "vm-c", "'t2'"):
        assert theirs not in text, theirs
    assert any(r["operation"].startswith("admission vm-a") and r["result"] == "admitted" for r in audit["rows"])
    # bob: t2 by --tenant-group ml-team=t2 (the group found by name in the namespace's group file)
    (s1, doms), (s2, vgpus), (s3, usage) = world.as_user("bob", calls[1:4], docs=True)
    assert (s1, s2, s3) == (200, 200, 200)
    assert [d["uuid"] for d in doms["domains"]] == [D2]
    assert [v["id"] for v in vgpus["vgpus"]] == [M2] and [u["tenant"] for u in usage["tenants"]] == ["t2"]


def test_a_tenant_member_cannot_read_another_tenants_data_or_the_hosts(world):
    t = world.run.tenant
    got = world.as_user("alice", [_get(t, "/v1/capacity?tenant=t2"), _get(t, "/v1/capacity?tenant=T1"),
                                  _get(t, "/v1/inventory"), _get(t, "/v1/metrics"),
                                  _post(t, "/v1/plan", {"config": "version: 1\n"}),
                                  _get(world.run.ro, "/v1/domains"), _get(world.run.admin, "/v1/domains"),
                                  _get(t, "/v1/capacity?tenant=nope")],
                        docs=True)
    statuses = [g if isinstance(g, str) else g[0] for g in got]
    # another tenant's capacity, the host's inventory and metrics, layout plans: 403; its own in any case: 200;
    # the admin and read-only socket files keep it out
    assert statuses == [403, 200, 403, 403, 403, "EACCES", "EACCES", 403]
    line = got[0][1]["error"]["line"]
    assert line.startswith("capacity for tenant 't2': a member of tenant 't1' reaches only") and "\n" not in line
    # a tenant that does not exist: the same answer (its existence is not told)
    assert got[7][1]["error"]["line"] == line.replace("'t2'", "'nope'")
    assert "tenant 't1'" in got[2][1]["error"]["line"]


# ---------------------------------------------------------------------------
# changing

def test_a_tenant_member_cannot_change_another_tenants_domain(world):
    t = world.run.tenant
    before = (world.mdevs(), world.owners(), len(world.store().audit_rows()))
    unknown = str(uuidlib.uuid4())
    calls = [_post(t, f"/v1/domains/{D2}/allocate", {"profile": "A40-8Q"}), _post(t, f"/v1/domains/{D2}/release"),
             _post(t, f"/v1/domains/{D3}/allocate", {"profile": "A40-8Q"}),
             _post(t, f"/v1/domains/{unknown}/allocate", {"profile": "A40-8Q"}),
             _post(t, "/v1/vgpus", {"profile": "A40-8Q", "owner": D1}),
             _post(t, f"/v1/vgpus/{M2}/remove", {"owner": D2}),
             _post(t, "/v1/tenants/t1/set", {"vgpus": "6"}),
             _post(t, "/v1/hook/release", {"xml": domain_xml("vm-b", D2, None, [mdev_hostdev(M2)])})]
    got = world.as_user("alice", calls, docs=True)
    assert [s for s, _ in got] == [403] * len(calls), got
    lines = [doc["error"]["line"] for _, doc in got]
    # another tenant's domain, a domain of no tenant and one that does not exist: one answer, existence not told
    assert lines[0].replace(D2, "X") == lines[2].replace(D3, "X") == lines[3].replace(unknown, "X")
    assert lines[0].startswith(f"domain {D2} is not bound to tenant 't1'")
    assert all(doc["error"]["exit_code"] == 2 and doc["error"]["type"] == "RefusedError" for _, doc in got)
    assert (world.mdevs(), world.owners(), len(world.store().audit_rows())) == before


D4, M4 = "11111111-2222-4333-8444-0000000000e4", "aaaaaaaa-2222-4333-8444-0000000000e4"
D6, M6 = "11111111-2222-4333-8444-0000000000e6", "aaaaaaaa-2222-4333-8444-0000000000e6"


def test_a_tenant_member_never_chooses_a_vgpu_uuid_taken_or_free(world):
    """Finding 1 (another tenant's running vGPU's UUID, or its own) and trial 8 T7 (a free UUID another
    domain's XML names, squatted so that domain's next start is refused as held): a tenant member's allocate
    naming any vgpu_uuid is refused, one line, nothing made and nobody's allocation row touched (the other
    tenant keeps its usage and its quota holds)."""
    t = world.run.tenant
    rows_before = sorted(world.store().allocation_rows())
    before = (world.mdevs(), world.owners(), rows_before)
    free = "aaaaaaaa-2222-4333-8444-0000000000f7"           # no record, no allocation, no mdev: another XML's
    got = world.as_user("alice", [_post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q", "vgpu_uuid": M2}),
                                  _post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q", "vgpu_uuid": M1}),
                                  _post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q", "vgpu_uuid": free,
                                                                          "dry_run": True}),
                                  _post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q", "vgpu_uuid": free}),
                                  _get(t, "/v1/usage")], docs=True)
    *refused, (_, usage) = got
    assert [s for s, _ in refused] == [403] * 4, got
    lines = [doc["error"]["line"] for _, doc in refused]
    assert lines[0] == (f"vgpu_uuid '{M2}': a member of tenant 't1' does not choose a vGPU's UUID; omit vgpu_uuid: "
                        "the answer's id is the new vGPU's UUID, to write in the domain's XML")
    assert [ln.replace(M2, "X").replace(M1, "X").replace(free, "X") for ln in lines] == [lines[0].replace(M2, "X")] * 4
    assert (world.mdevs(), world.owners(), sorted(world.store().allocation_rows())) == before
    assert free not in world.mdevs()
    t2_row = [row for row in world.store().allocation_rows() if row[0] == M2]
    assert [r[1:3] for r in t2_row] == [(D2, "t2")]
    admin_usage = {u["tenant"]: u["usage"]["vgpus"]["used"] for u in world.run.call("GET", "/v1/usage")[1]["tenants"]}
    assert admin_usage["t2"] == 1 and admin_usage["t1"] == 1
    assert usage["tenants"][0]["usage"]["vgpus"]["used"] == 1


def test_the_rollback_of_an_admission_drops_only_the_admitted_domains_rows(world):
    """void_admitted never deletes another owner's allocation row of the same device, and record_admitted
    never replaces one."""
    from vgpuhost.ops import tenancy
    s = world.store()
    rows = {row[0]: row for row in s.allocation_rows()}
    assert rows[M2][1] == D2
    row_id = s.audit(actor="test", operation="test rollback", path="(admission)", value="", result="admitted")
    tenancy.void_admitted(s, D1, {M2: row_id}, RuntimeError("boom"))
    assert {row[0]: row for row in s.allocation_rows()} == rows
    assert s.audit_rows()[-1].result == "failed"


def test_a_tenant_member_reads_no_other_tenants_audit_rows_or_names(world):
    """Finding 2: rows chosen by exact identifiers, every shown field redacted."""
    from vgpuhost.ops import tenancy
    run, t = world.run, world.run.tenant
    root = str(world.host.root)
    # t2's domain named like t1's in another case, started and stopped: the audit names it, nothing running does
    _bind(root, D4, "t2", "VM-A")
    meta = Metadata(tenant="t2", vgpus=[VgpuRequest("A40-8Q", uuid=M4)])
    xml4 = domain_xml("VM-A", D4, meta, [mdev_hostdev(M4)])
    assert run.call("POST", "/v1/hook/prepare", {"xml": xml4, "name": "VM-A"})[0] == 200
    assert run.call("POST", "/v1/hook/release", {"xml": xml4, "name": "VM-A"})[0] == 200
    # t2's domain 'web' whose metadata names t1 (refused), then moved to t1: its bind rows say tenant=t2
    _bind(root, D6, "t2", "web")
    xml6 = domain_xml("web", D6, Metadata(tenant="t1", vgpus=[VgpuRequest("A40-8Q", uuid=M6)]), [mdev_hostdev(M6)])
    assert run.call("POST", "/v1/hook/prepare", {"xml": xml6, "name": "web"})[0] == 409
    _bind(root, D6, "t1", "web")
    # a t1 domain named like a profile (bound, never started)
    d7 = "11111111-2222-4333-8444-0000000000e7"
    _bind(root, d7, "t1", "A40-8Q")
    try:
        (status, audit), = world.as_user("alice", [_get(t, "/v1/audit")], docs=True)
    finally:
        s = world.store()
        for d in (D6, d7):
            tenancy.unbind(s, d)
    assert status == 200
    text = json.dumps(audit["rows"])
    for theirs in (D2, M2, D3, M3, D4, M4, M6, "VM-A", "vm-b", "vm-c", "t2", "ml-team"):
        assert theirs not in text, theirs
    mine = (D1, M1, D6, d7)
    for r in audit["rows"]:
        fields = r["operation"] + " " + r["path"] + " " + r["value"]
        assert any(x in fields for x in mine) or r["operation"] == "tenant add t1", r
        assert not (r["operation"].startswith("vgpu create A40-8Q") and D1 not in r["operation"]), r
    values = [r["value"] for r in audit["rows"] if D6 in r["value"]]
    assert any("(was: tenant=(another tenant)" in v for v in values), values
    assert any("tenant=(another tenant)" in v and "was" not in v for v in values), json.dumps(audit["rows"], indent=1)
    # the refused start of t2's 'web' names t1 in its metadata, but is not t1's row
    assert not [r for r in audit["rows"] if r["operation"].startswith("admission") and M6 in text]
    # an admin reads them all, names included
    admin = run.call("GET", "/v1/audit")[1]["rows"]
    assert any(r["operation"] == f"admission VM-A {M4}" for r in admin)
    assert any("tenant=t2" in r["value"] and D6 in r["value"] for r in admin)


def test_another_tenants_refused_admission_naming_a_members_vgpu_is_not_its_row(world):
    """Trial 10b B4: a refused admission of t2's domain whose "to free room" hint names t1's vGPU (as
    admission words a capacity refusal) is t2's row: t1's member does not read it (neither the agent's
    form, domain by UUID, nor the hook's, domain by name with the device's id), while t1's own rows, an
    admitted one and a refused one whose hint names t2's vGPU, are shown, t2's names hidden in them."""
    t = world.run.tenant
    s = world.store()
    hint = (f"to free room: tenant 't1' holds vGPU A40-8Q {M1} on 0000:41:00.0 as burst (domain {D1}); "
            "'vgpuhost capacity' shows what fits where")
    theirs_agent = str(uuidlib.uuid4())
    theirs_hook = str(uuidlib.uuid4())
    # as admission writes a refusal: its audit row and, apart, what it decided (admission_refusals)
    refused = dict(code="capacity", profile="A40-8Q", qos="burstable")
    s.audit_refusal(actor="agent uid=54204 pid=4960", operation=f"admission {D2} {theirs_agent}",
                    value="no room for vGPU A40-8Q of tenant 't2' (quota vGPUs 0:7, 5 in use): A40-8Q fits on none "
                          f"of the 3 vGPU-capable GPUs; {hint}; bound to tenant 't2' by cli uid=0 pid=3681 at "
                          "2026-12-07T16:39:31; refusal=capacity profile=A40-8Q qos=burstable tenant=t2",
                    domain_uuid=D2, device=theirs_agent, tenant="t2", **refused)
    s.audit_refusal(actor="hook vm-b pid=4961", operation=f"admission vm-b {theirs_hook}",
                    value=f"no room for vGPU A40-8Q of tenant 't2' (quota vGPUs 0:7, 6 in use): {hint}; "
                          "refusal=capacity profile=A40-8Q qos=burstable tenant=t2",
                    domain_uuid=D2, device=theirs_hook, tenant="t2", **refused)
    mine_refused = str(uuidlib.uuid4())
    s.audit_refusal(actor=f"agent uid={ALICE} pid=4962", operation=f"admission {D1} {mine_refused}",
                    value=f"no room for vGPU A40-8Q of tenant 't1' (quota vGPUs 0:2, 1 in use): to free room: "
                          f"tenant 't2' holds vGPU A40-8Q {M2} on 0000:81:00.0 (domain {D2}); refusal=capacity "
                          "profile=A40-8Q qos=burstable tenant=t1",
                    domain_uuid=D1, device=mine_refused, tenant="t1", **refused)
    # a refusal admission did not record apart whose text claims t1 (a tenant-written name can carry any
    # tail): never t1's by its text
    s.audit(actor="hook vm-b pid=4963", operation=f"admission vm-b {uuidlib.uuid4()}", path="(admission)",
            value="domain 'x; refusal=capacity profile=A40-8Q qos=burstable tenant=t1' refused; "
                  "refusal=capacity profile=A40-8Q qos=burstable tenant=t1", result="refused")
    (status, audit), = world.as_user("alice", [_get(t, "/v1/audit")], docs=True)
    assert status == 200
    rows = audit["rows"]
    text = json.dumps(rows)
    assert "pid=4963" not in text
    # t2's refusals: absent (their quota and use, their member's uid and pid, their profile)
    assert theirs_agent not in text and theirs_hook not in text and "0:7" not in text and "54204" not in text
    assert not [r for r in rows if r["actor"] in ("agent uid=54204 pid=4960", "hook vm-b pid=4961")]
    # t1's own: its admitted start (the fixture's) and its refusal, t2's vGPU and domain hidden in it
    assert any(r["operation"].startswith("admission vm-a") and r["result"] == "admitted" for r in rows)
    own = [r for r in rows if r["operation"] == f"admission {D1} {mine_refused}"]
    assert len(own) == 1 and own[0]["result"] == "refused", rows
    assert "quota vGPUs 0:2, 1 in use" in own[0]["value"] and M2 not in text and D2 not in text
    assert "tenant=t1" in own[0]["value"] and "'t2'" not in own[0]["value"]
    # bob (t2) reads its own two refusals, with t1's vGPU hidden
    (status, theirs), = world.as_user("bob", [_get(t, "/v1/audit")], docs=True)
    got = {r["actor"] for r in theirs["rows"] if r["result"] == "refused"}
    assert {"agent uid=54204 pid=4960", "hook vm-b pid=4961"} <= got and f"agent uid={ALICE} pid=4962" not in got
    assert theirs_agent in json.dumps(theirs["rows"]) and mine_refused not in json.dumps(theirs["rows"])
    assert M1 not in json.dumps(theirs["rows"])
    # the admin reads all three
    admin = {r["operation"].split()[-1] for r in world.run.call("GET", "/v1/audit")[1]["rows"]}
    assert {theirs_agent, theirs_hook, mine_refused} <= admin


def test_a_members_allocate_pinned_to_no_gpu_gets_the_operators_line(world):
    """Trial 10b B5: ``gpu`` set to an address with no device, or with a device that is not a GPU (a root
    port here; a VF on vendor-VFIO hosts), gave a member "no GPU here offers vGPU types ('vgpuhost host
    check' says why)"; now the operator's line, nothing made, no allocation row."""
    t = world.run.tenant
    before = (world.mdevs(), world.owners(), sorted(world.store().allocation_rows()))
    got = world.as_user("alice", [_post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q", "gpu": addr})
                                  for addr in ("0000:99:00.0", "0000:40:03.0")], docs=True)
    admin = [world.run.call("POST", f"/v1/domains/{D1}/allocate",
                            {"profile": "A40-8Q", "gpu": addr, "dry_run": True})
             for addr in ("0000:99:00.0", "0000:40:03.0")]
    for (status, doc), (a_status, a_doc), addr in zip(got, admin, ("0000:99:00.0", "0000:40:03.0")):
        assert (status, a_status) == (400, 400), (doc, a_doc)
        assert doc["error"]["line"] == a_doc["error"]["line"] == (f"no NVIDIA GPU at {addr}; 'vgpuhost gpus' "
                                                                  "lists them")
    assert (world.mdevs(), world.owners(), sorted(world.store().allocation_rows())) == before


def test_an_error_line_echoes_the_callers_input_whether_or_not_it_names_something(world):
    """Finding 3: an unknown name and another tenant's (domain, tenant) name give the same answer."""
    t = world.run.tenant
    got = world.as_user("alice", [_post(t, "/v1/domains/vm-b/release"), _post(t, "/v1/domains/zzz/release"),
                                  _post(t, "/v1/domains/t2/allocate", {"profile": "A40-8Q"}),
                                  _post(t, "/v1/domains/nope/allocate", {"profile": "A40-8Q"}),
                                  _get(t, "/v1/types?gpu=vm-b"), _get(t, "/v1/types?gpu=zzz")], docs=True)
    lines = [(s, doc["error"]["line"]) for s, doc in got]
    assert lines[0] == (400, "invalid UUID 'vm-b'") or lines[0][1].startswith("invalid UUID 'vm-b'"), lines
    for (sa, a), (sb, b), (na, nb) in ((lines[0], lines[1], ("vm-b", "zzz")), (lines[2], lines[3], ("t2", "nope")),
                                       (lines[4], lines[5], ("vm-b", "zzz"))):
        assert sa == sb and na in a and a.replace(na, "X") == b.replace(nb, "X"), (a, b)
    assert "another" not in repr(lines)


def test_a_tenant_allocate_keeps_to_the_hook_allow_list(world):
    """Finding 5: placement only on allowed GPUs; a pinned GPU outside the list is refused."""
    from vgpuhost.ops import devices
    t = world.run.tenant
    allow = Path(devices.allow_path(world.host))
    allow.parent.mkdir(parents=True, exist_ok=True)
    allow.write_text("0000:41:00.0\n")          # vm-a's vGPU is there already: no room for a second of vm-a's
    before = (world.mdevs(), world.owners(), sorted(world.store().allocation_rows()))
    try:
        got = world.as_user("alice", [_post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q"}),
                                      _post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q",
                                                                              "gpu": "0000:c1:00.0"})], docs=True)
    finally:
        allow.unlink()
    (s1, free), (s2, pinned) = got
    assert (s1, s2) == (409, 409), got
    assert pinned["error"]["line"].startswith("GPU 0000:c1:00.0 is not in the hook allow-list"), pinned
    assert (world.mdevs(), world.owners(), sorted(world.store().allocation_rows())) == before
    # without the list the same request goes to 0000:c1:00.0 (a dry run: nothing made)
    (s3, dry), = world.as_user("alice", [_post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q",
                                                                                  "dry_run": True})], docs=True)
    assert (s3, dry["gpu"]) == (200, "0000:c1:00.0"), dry


def test_a_tenant_member_sees_no_host_paths_or_host_wide_counters(world):
    """Finding 8i."""
    (s, doc), = world.as_user("alice", [_get(world.run.tenant, "/v1/agent")], docs=True)
    assert s == 200 and (doc["role"], doc["tenant"]) == ("tenant", "t1")
    for key in ("root", "state_dir", "served", "served_thin_client", "snapshot_scans", "snapshot_waits"):
        assert key not in doc, key
    assert str(world.host.root) not in json.dumps(doc)
    # trial 10b B7: the operator's --libvirt-uri names a file of the host: the local qemu URIs only
    assert doc["libvirt_uris"] == ["qemu:///system", "qemu+unix:///system"]
    assert "libvirt-node.xml" not in json.dumps(doc)
    admin = world.run.call("GET", "/v1/agent")[1]
    assert admin["root"] == str(world.host.root) and admin["served"]
    assert admin["libvirt_uris"][0] == world.libvirt_uri


def test_a_tenant_member_allocates_for_its_domain_within_quota_and_releases_it(world):
    t = world.run.tenant
    got = world.as_user("alice", [_post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q", "dry_run": True}),
                                  _post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q"}),
                                  _post(t, f"/v1/domains/{D1}/allocate", {"profile": "A40-8Q"}),
                                  _get(t, "/v1/usage")], docs=True)
    (s0, dry), (s1, made), (s2, refused), (s3, usage) = got
    # a dry run: admitted where the real one goes (not t2's exclusive GPU, not vm-a's own), nothing made
    assert (s0, dry["dry_run"], dry["gpu"]) == (200, True, "0000:c1:00.0"), dry
    assert s1 == 200, made
    new = made["id"]
    assert (made["owner"], made["gpu"]) == (D1, "0000:c1:00.0") and world.owners()[new] == D1 and new in world.mdevs()
    # recorded as t1's allocation when made: it counts against the quota now, not only at the domain's start
    rows = {row[0]: row for row in world.store().allocation_rows()}
    assert rows[new][1:3] == (D1, "t1")
    assert (s2, refused["error"]["exit_code"]) == (409, 2), refused
    assert "quota" in refused["error"]["line"] and "t1" in refused["error"]["line"]
    assert usage["tenants"][0]["usage"]["vgpus"]["used"] == 2
    assert sorted(world.owners().values()) == sorted([D1, D1, D2, D3])
    audit = world.store().audit_rows()
    # (the allow-list test's refusal came before: the last two are this test's)
    assert [r.result for r in audit if r.operation.startswith(f"admission {D1}")][-2:] == ["admitted", "refused"]
    # its own running domain's release is refused (finding 6): the hook releases a running domain's devices
    (s, out), = world.as_user("alice", [_post(t, f"/v1/domains/{D1}/release")], docs=True)
    assert s == 409 and out["error"]["line"].startswith(f"domain {D1} is running"), out
    assert world.owners()[new] == D1 and world.owners()[M1] == D1 and D1 in world.store().active_domains()
    # once it is no longer recorded running: both of vm-a's vGPUs go; the others' stay
    world.store().domain_stopped(D1)
    (s, out), = world.as_user("alice", [_post(t, f"/v1/domains/{D1}/release")], docs=True)
    assert s == 200 and sorted(out["released"]) == sorted([M1, new])
    assert world.owners() == {M2: D2, M3: D3} and set(world.mdevs()) == {M2, M3}
    assert not [row for row in world.store().allocation_rows() if row[1] == D1]


def test_a_read_only_member_reads_all_and_cannot_write(world):
    run = world.run
    before = (world.mdevs(), world.owners())
    got = world.as_user("rita", [_get(run.ro, "/v1/domains"), _get(run.ro, "/v1/usage"),
                                 _post(run.ro, f"/v1/domains/{D2}/allocate", {"profile": "A40-8Q"}),
                                 _post(run.tenant, f"/v1/domains/{D2}/allocate", {"profile": "A40-8Q"}),
                                 _post(run.tenant, f"/v1/domains/{D2}/release"),
                                 _post(run.ro, "/v1/tenants", {"name": "t9"}),
                                 _get(run.admin, "/v1/domains")], docs=True)
    statuses = [g if isinstance(g, str) else g[0] for g in got]
    assert statuses == [200, 200, 403, 403, 403, 403, "EACCES"]
    assert {d["uuid"] for d in got[0][1]["domains"]} >= {D2, D3}
    assert {u["tenant"] for u in got[1][1]["tenants"]} >= {"t1", "t2"}
    assert (world.mdevs(), world.owners()) == before
    assert [x[0] for x in world.store().tenant_rows()] == ["t1", "t2"]


def test_groups_of_two_tenants_or_of_none_are_refused(world):
    t = world.run.tenant
    (s1, carol), = world.as_user("carol", [_get(t, "/v1/domains")], docs=True)
    (s2, dave), = world.as_user("dave", [_get(t, "/v1/domains")], docs=True)
    assert (s1, s2) == (403, 403)
    assert "more than one tenant (t1, t2)" in carol["error"]["line"]
    assert "in no group of the agent's" in dave["error"]["line"]


def test_an_admin_can_do_everything(world):
    run = world.run
    got = world.as_user("adam", [_get(run.admin, "/v1/inventory"), _get(run.tenant, "/v1/agent"),
                                 _post(run.admin, f"/v1/domains/{D2}/allocate", {"profile": "A40-8Q"}),
                                 _post(run.admin, "/v1/tenants", {"name": "t3"}),
                                 _post(run.admin, f"/v1/domains/{D2}/release"),
                                 _get(run.admin, "/v1/audit")], docs=True)
    assert [s for s, _ in got] == [200] * 6, got
    assert got[1][1]["role"] == "admin"
    assert world.owners() == {M3: D3}
    assert [x[0] for x in world.store().tenant_rows()] == ["t1", "t2", "t3"]
    assert any(D2 in r["operation"] for r in got[5][1]["rows"])     # an admin reads every row


# ---------------------------------------------------------------------------
# the role decision itself (no agent)

def _peer(uid: int, gid: int, *groups: int) -> unixsock.Peer:
    return unixsock.Peer(4242, uid, gid, frozenset({gid, *groups}))


def test_roles_are_tried_admin_then_read_then_tenant(monkeypatch):
    names = {700: "vgpuhost-t-ml", 701: "vgpuhost-t-", 702: "other", 703: "vgpuhost-t-bad name"}
    monkeypatch.setattr(unixsock, "group_name", names.get)
    access = Access(10, 11, {800: "Web"})
    assert access.caller(_peer(0, 0)) == (Caller(api.ADMIN), "")
    assert access.caller(_peer(5, 5, 10, 700)) == (Caller(api.ADMIN), "")
    assert access.caller(_peer(5, 5, 11, 700)) == (Caller(api.READ), "")
    assert access.caller(_peer(5, 700)) == (Caller(api.TENANT, "ml"), "")
    assert access.caller(_peer(5, 5, 800)) == (Caller(api.TENANT, "Web"), "")
    assert access.caller(_peer(5, 5, 701, 702, 703)) == (None, "it is in no group of the agent's")
    who, why = access.caller(_peer(5, 5, 700, 800))
    assert who is None and "more than one tenant (ml, Web)" in why
    assert Access(10, 11, prefix="").caller(_peer(5, 700))[0] is None      # the convention turned off
    # the read-only socket serves no change: an admin reads there, a tenant member keeps its scope
    assert socket_role(Caller(api.ADMIN), api.READ) == Caller(api.READ)
    assert socket_role(Caller(api.TENANT, "ml"), api.READ) == Caller(api.TENANT, "ml")
    assert socket_role(Caller(api.ADMIN), api.TENANT) == Caller(api.ADMIN)


def test_a_group_renamed_in_etc_group_counts_from_the_next_call(monkeypatch, tmp_path):
    """Group names are cached until /etc/group changes (not for a fixed time): a group renamed into or out of
    a tenant moves its members at once; while the file is unchanged, no name is looked up again."""
    db = tmp_path / "group"
    db.write_text("vgpuhost-t-ml:x:700:\n")
    names = {700: "vgpuhost-t-ml"}
    looked: list = []
    monkeypatch.setattr(unixsock, "GROUP_DB", str(db))
    monkeypatch.setattr(unixsock, "group_name", lambda gid: looked.append(gid) or names.get(gid))
    access = Access(10, 11)
    assert access.caller(_peer(5, 700)) == (Caller(api.TENANT, "ml"), "")
    assert access.caller(_peer(6, 700)) == (Caller(api.TENANT, "ml"), "")
    assert looked == [700]                          # the file unchanged: the cached name served the second call
    names[700] = "vgpuhost-t-web"                   # groupmod -n: the file is written anew
    db.write_text("vgpuhost-t-web:x:700:\n")
    assert access.caller(_peer(5, 700)) == (Caller(api.TENANT, "web"), "")
    names[700] = "staff"                            # renamed out of the convention, replaced as groupmod does
    db.with_name("group+").write_text("staff:x:700:\n")
    db.with_name("group+").replace(db)
    assert access.caller(_peer(5, 700)) == (None, "it is in no group of the agent's")
    assert looked == [700, 700, 700]
    db.unlink()                                     # no group file at all (names from NSS only): still read
    names[700] = "vgpuhost-t-ml"
    assert access.caller(_peer(5, 700)) == (Caller(api.TENANT, "ml"), "")


def test_peer_groups_are_the_kernels_at_connect_time():
    """The peer's uid, gid and supplementary groups as the kernel keeps them with the connection
    (SO_PEERCRED, SO_PEERGROUPS): no /proc read, so no reused pid can lend another process's groups."""
    d = socket_dir()                # world-traversable: the client runs as a throwaway uid
    path = os.path.join(d, "s.sock")
    srv = unixsock.bind(path, mode=0o666, gid=0)
    srv.settimeout(30)
    try:
        code = ("import os, socket, sys; os.setgroups([54301, 54302]); os.setgid(54303); os.setuid(54304); "
                "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.recv(1)")
        child = subprocess.Popen([sys.executable, "-c", code, path])
        conn, _ = srv.accept()
        try:
            peer = unixsock.peer(conn)
            assert (peer.pid, peer.uid, peer.gid, peer.groups) == (child.pid, 54304, 54303,
                                                                   frozenset({54301, 54302, 54303}))
            conn.send(b"x")
        finally:
            conn.close()
            child.wait(30)
    finally:
        srv.close()
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------
# bills a tenant can check (trial 9: a tenant could see neither its metered usage nor its bill)

def test_a_tenant_member_reads_its_issued_bill_and_the_hourly_rows_behind_it_and_no_others(world):
    from vgpuhost.io import state as st
    from vgpuhost.model.usage import UsageRow
    from vgpuhost.ops import billing
    from vgpuhost.policy.billing import parse_prices
    store = world.store()
    rows = [UsageRow("2026-10-05T10:00:00Z", M1, D1, "vgpu", "0000:41:00.0", "A40-8Q", "vm-a", "t1", "", 3600.0,
                     1800.0, 0, 0, 0, 0, 60),
            UsageRow("2026-10-05T11:00:00Z", M1, D1, "vgpu", "0000:41:00.0", "A40-8Q", "vm-a", "t1", "", 1800.0,
                     900.0, 0, 0, 0, 0, 30),
            UsageRow("2026-10-05T10:00:00Z", M2, D2, "vgpu", "0000:81:00.0", "A40-8Q", "vm-b", "t2", "", 3600.0,
                     3600.0, 0, 0, 0, 0, 60)]
    with store.transaction() as conn:
        st.add_usage(conn, rows)
        st.put_meter_state(conn, "last_tick_us", str(1_790_812_800_000_000))      # metering began 2026-10-01
        st.put_meter_state(conn, "last_tick_us", str(1_793_577_600_000_000))      # 2026-11-02: October metered
    sheet = parse_prices("version: 1\ncurrency: EUR\nallocated: {profiles: {A40-8Q: 1.00}}\n")
    issued = billing.issue(store, "2026-10", sheet, actor="test")
    assert {t["tenant"]: t["amount"] for t in issued["totals"]} == {"t1": "1.50", "t2": "1.00"}
    t = world.run.tenant
    (s1, bill), (s2, hourly), (s3, open_month), (s4, bad), (s5, missing) = world.as_user(
        "alice", [_get(t, "/v1/bill?period=2026-10"), _get(t, "/v1/usage/hourly?period=2026-10"),
                  _get(t, "/v1/bill?period=2026-11"), _get(t, "/v1/bill?period=2026-13"), _get(t, "/v1/bill")],
        docs=True)
    assert (s1, s2, s3, s4, s5) == (200, 200, 404, 400, 400), (open_month, bad, missing)
    # its own lines and total, nothing of t2's; the hours its lines name are the rows it reads
    assert bill["status"] == "issued" and bill["total"] == "1.50"
    assert {x["tenant"] for x in bill["lines"]} == {"t1"} and [x["tenant"] for x in bill["totals"]] == ["t1"]
    assert [(r["hour"], r["device"], r["alloc_s"]) for r in hourly["rows"]] == [
        ("2026-10-05T10:00:00Z", M1, 3600.0), ("2026-10-05T11:00:00Z", M1, 1800.0)]
    assert sum(r["alloc_s"] for r in hourly["rows"]) / 3600 == float(bill["lines"][0]["quantity"])
    for theirs in (D2, M2, "vm-b", "'t2'", '"t2"'):
        assert theirs not in json.dumps(bill) + json.dumps(hourly), theirs
    assert "not issued" in open_month["error"]["message"], open_month
    assert "2026-13" in bad["error"]["message"] and "period=YYYY-MM" in missing["error"]["message"], (bad, missing)
    # the operator reads both tenants' part
    status, whole = world.run.call("GET", "/v1/bill?period=2026-10")
    assert status == 200 and whole["total"] == "2.50"
    status, all_rows = world.run.call("GET", "/v1/usage/hourly?period=2026-10")
    assert status == 200 and len(all_rows["rows"]) == 3 and all_rows["tenant"] is None


def test_a_members_bill_names_no_other_tenant_nor_its_gaps_nor_the_operators_file(world, tmp_path):
    """Final 9 N2: a device that served t2's domain, then t1's, with a metering gap while t2 held it: t1 reads
    neither that gap nor t2's name in any gap, and not the path of the operator's price sheet."""
    from vgpuhost.io import state as st
    from vgpuhost.model.usage import UsageRow
    from vgpuhost.ops import billing
    from vgpuhost.policy.billing import parse_prices
    store = world.store()
    dev = "cccccccc-2222-4333-8444-0000000000c9"
    gone = "cccccccc-2222-4333-8444-0000000000ca"
    rows = [UsageRow("2026-11-10T08:00:00Z", dev, D2, "vgpu", "0000:81:00.0", "A40-8Q", "vm-b", "t2", "", 3600.0,
                     0, 0, 0, 0, 0, 60),
            UsageRow("2026-11-10T20:00:00Z", dev, D1, "vgpu", "0000:81:00.0", "A40-8Q", "vm-a", "t1", "", 3600.0,
                     0, 0, 0, 0, 0, 60)]
    with store.transaction() as conn:
        st.add_usage(conn, rows)
        conn.execute("INSERT INTO meter_gaps (start, end, device, seconds, reason) VALUES (?, ?, ?, ?, ?)",
                     ("2026-11-10T08:10:00.000000+00:00", "2026-11-10T08:20:00.000000+00:00", dev, 600.0,
                      "no utilisation samples"))
        conn.execute("INSERT INTO meter_gaps (start, end, device, seconds, reason) VALUES (?, ?, ?, ?, ?)",
                     ("2026-11-10T20:30:00.000000+00:00", "2026-11-10T20:40:00.000000+00:00", dev, 600.0,
                      "no utilisation samples"))
        # a device of t1's whose GPU went unread after 19:00 and was then removed: nothing read after its gap's
        # start, so the gap is the tenant that had it last (final 9b NEW-1)
        st.add_usage(conn, [UsageRow("2026-11-12T19:00:00Z", gone, D1, "vgpu", "0000:41:00.0", "A40-8Q", "vm-a",
                                     "t1", "", 3600.0, 0, 0, 0, 0, 0, 60)])
        conn.execute("INSERT INTO meter_gaps (start, end, device, seconds, reason) VALUES (?, ?, ?, ?, ?)",
                     ("2026-11-12T20:00:00.000000+00:00", "2026-11-13T01:30:00.000000+00:00", gone, 19800.0,
                      "device gone while unread"))
        st.put_meter_state(conn, "last_tick_us", str(1_793_491_200_000_000))      # metering began by 2026-11-01
        st.put_meter_state(conn, "last_tick_us", str(1_796_169_600_000_000))      # 2026-12-02: November read
    sheet_path = tmp_path / "acme-secret-discount.yaml"
    sheet_path.write_text("version: 1\ncurrency: EUR\nallocated: {profiles: {A40-8Q: 1.00}}\n")
    issued = billing.issue(store, "2026-11", parse_prices(sheet_path.read_text()), prices=str(sheet_path),
                           actor="test")
    assert [g["tenants"] for g in issued["gaps"]] == [["t1", "t2"], ["t1", "t2"], ["t1"]]    # the operator's view
    t = world.run.tenant
    (s1, bill), (s2, hourly) = world.as_user(
        "alice", [_get(t, "/v1/bill?period=2026-11"), _get(t, "/v1/usage/hourly?period=2026-11")], docs=True)
    assert (s1, s2) == (200, 200)
    assert [(g["start"][:16], g["tenants"]) for g in bill["gaps"]] == [("2026-11-10T20:30", ["t1"]),
                                                                        ("2026-11-12T20:00", ["t1"])]
    assert [g["start"][:16] for g in hourly["gaps"]] == ["2026-11-10T20:30", "2026-11-12T20:00"]
    (s5, theirs), = world.as_user("bob", [_get(t, "/v1/bill?period=2026-11")], docs=True)
    assert s5 == 200 and [(g["start"][:16], g["tenants"]) for g in theirs["gaps"]] == [("2026-11-10T08:10", ["t2"])]
    assert bill["prices"] is None and bill["prices_sha256"] == issued["prices_sha256"]
    assert "secret" not in json.dumps(bill) and "t2" not in json.dumps(bill) + json.dumps(hourly)
    # one device at a time, and a device name that is no device's: no rows, nothing else told
    (s3, one), (s4, bad) = world.as_user(
        "alice", [_get(t, f"/v1/usage/hourly?period=2026-11&device={dev}"),
                  _get(t, "/v1/usage/hourly?period=2026-11&device=" + "x" * 65)], docs=True)
    assert s3 == 200 and [r["hour"] for r in one["rows"]] == ["2026-11-10T20:00:00Z"]
    assert s4 == 400 and "device" in bad["error"]["message"]


def test_a_month_with_more_rows_than_one_answer_carries_is_asked_per_device(world, monkeypatch):
    """Final 9 N4: the answer is bounded; the caller's rows alone are read (by the store's index), and a
    month with more than MAX_HOURLY_ROWS of them is refused with how to ask per device."""
    from vgpuhost.agent import api
    from vgpuhost.io import state as st
    from vgpuhost.model.errors import InputError
    from vgpuhost.model.usage import UsageRow
    store = world.store()
    with store.transaction() as conn:               # two August rows of t1's, one of t2's
        st.add_usage(conn, [UsageRow(f"2026-08-03T0{h}:00:00Z", dev, dom, "vgpu", "0000:41:00.0", "A40-8Q", name,
                                     tenant, "", 3600.0, 0, 0, 0, 0, 0, 60)
                            for h, dev, dom, name, tenant in ((1, M1, D1, "vm-a", "t1"), (2, M1, D1, "vm-a", "t1"),
                                                              (3, M2, D2, "vm-b", "t2"))])
    monkeypatch.setattr(api, "MAX_HOURLY_ROWS", 1)
    agent = api.Agent(world.host)
    req = api.Request({}, {"period": "2026-08"}, None, "test-member", 1, role=api.TENANT, tenant="t1")
    with pytest.raises(InputError) as e:
        api.tenant_usage_hourly(agent, req)
    assert "more than 1 hourly rows of your tenant" in e.value.message and "&device=" in e.value.hint
    one = api.tenant_usage_hourly(agent, req._replace(query={"period": "2026-08", "device": M2}))
    assert one["rows"] == []                        # another tenant's device: none of its rows
    monkeypatch.setattr(api, "MAX_HOURLY_ROWS", 2)
    assert [r["hour"][11:13] for r in api.tenant_usage_hourly(agent, req)["rows"]] == ["01", "02"]
