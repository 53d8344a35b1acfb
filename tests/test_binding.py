"""Tenant bindings the operator controls (issue 28, item 1; findings 1, 2 and 5).

A domain's tenant and QoS class come from the operator's binding in the
state store (or Nova's project with the OpenStack mapping on); its XML may
ask, never claim.  Each start runs the qemu hook's ``prepare begin`` in
process on a simulated host; outcomes are read back from the simulated
tree, the state store's allocations and bindings, and the audit log.
"""

from __future__ import annotations

import json
import sqlite3

import pytest

from vgpuhost.cli.main import main as cli_main
from vgpuhost.io.state import MIGRATIONS, StateStore
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest, parse_domain
from vgpuhost.ops import metering, tenancy
from vgpuhost.policy import admission as adm
from vgpuhost.policy.binding import trusted

from test_hook import GPU_HI, GPU_LO, domain_xml, mdev_hostdev, mdevs, mixed, start, stop
from test_tenancy import NOVA, uid

T, Q, L = tenancy.Tenant, tenancy.Quota, tenancy.Limits


def vm(name: str, i: int, *, tenant=None, qos=None, raw_prefix: str = "") -> str:
    meta = Metadata(tenant=tenant, qos=qos, vgpus=[VgpuRequest("A40-8Q", uuid=uid("b1b1b1b1", i))])
    return domain_xml(name, uid("a1a1a1a1", i), raw_meta=raw_prefix + meta.to_xml(),
                      hostdevs=[mdev_hostdev(uid("b1b1b1b1", i))])


def nothing_made(host, s: StateStore) -> bool:
    return mdevs(host) == {} and s.allocation_rows() == [] and s.vgpu_records() == []


def admission(s: StateStore):
    return [r for r in s.audit_rows() if r.path == "(admission)"]


def run(capsys, host, *argv):
    code = cli_main(["--root", str(host.root), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def host(make_host):
    return mixed(make_host)


@pytest.fixture
def s(host):
    return StateStore(host.state_dir)


# ---------------------------------------------------------------------------
# Must show, "Forgery": another tenant, or a stronger class, is refused at start; the audit names the binding

def test_metadata_naming_another_tenant_is_refused_naming_the_binding_and_nothing_is_made(host, s):
    tenancy.add(s, T("alpha", quota=Q(L(vgpus=1))))
    tenancy.add(s, T("beta", qos="guaranteed", quota=Q(L(vgpus=4))))
    tenancy.bind(s, uid("a1a1a1a1", 0), "alpha", name="vm", actor="root")
    rc, err = start(host, "vm", vm("vm", 0, tenant="beta"), bind=False)
    assert rc == 2 and err.count("\n") == 1, err
    assert "its metadata names tenant 'beta', but it is bound to tenant 'alpha' by root" in err
    assert "'vgpuhost tenant bind vm beta'" in err
    [row] = admission(s)
    assert row.result == "refused" and row.operation == f"admission vm {uid('b1b1b1b1', 0)}"
    assert "bound to tenant 'alpha' by root" in row.value
    assert nothing_made(host, s)
    # the binding decides: the same domain asking for its own tenant is admitted, as alpha's
    assert start(host, "vm", vm("vm", 0, tenant="alpha"), bind=False) == (0, "")
    assert [(r[2], r[8]) for r in s.allocation_rows()] == [("alpha", "burstable")]
    assert admission(s)[-1].result == "admitted" and "bound to tenant 'alpha'" in admission(s)[-1].value


def test_a_refused_start_of_a_domain_recorded_running_leaves_its_record_as_it_was(host, s):
    """trial 10 B1: a second ``prepare begin`` of a running domain's UUID (a retry, a forged document) that
    admission refuses had rewritten the domain's row (name and time) and its marker, though the refusal
    said nothing was changed; every later line named the domain by the forged name.  Now its row, its
    marker, its vGPU and its allocation are as they were, and the refusal has its audit row."""
    import os
    from vgpuhost.io.state import MARKER_DIR
    tenancy.add(s, T("alpha", quota=Q(L(vgpus=1))))
    tenancy.add(s, T("beta", quota=Q(L(vgpus=4))))
    me = uid("a1a1a1a1", 0)
    tenancy.bind(s, me, "alpha", name="vm", actor="root")
    assert start(host, "vm", vm("vm", 0, tenant="alpha"), bind=False) == (0, "")
    marker = os.path.join(str(host.state_dir), MARKER_DIR, me)
    with open(marker, "w") as f:
        f.write("424242\n")                    # the starter another process recorded
    before = (s.active_domains(), s.domain_starts(), s.vgpu_records(), s.allocation_rows(), mdevs(host))
    rc, err = start(host, "evil", vm("evil", 0, tenant="beta"), bind=False)
    assert rc == 2 and "bound to tenant 'alpha'" in err and "nothing was changed" in err, err
    assert s.active_domains() == {me: "vm"}
    assert (s.active_domains(), s.domain_starts(), s.vgpu_records(), s.allocation_rows(), mdevs(host)) == before
    assert s.domain_starter(me) == 424242
    assert admission(s)[-1].result == "refused" and admission(s)[-1].operation.startswith("admission evil ")


def test_a_class_stronger_than_the_tenants_is_refused_before_the_gold_pool(host, s):
    """Finding 2: a best-effort tenant's domain asking qos="guaranteed" was admitted into a pool serving
    guaranteed only."""
    tenancy.set_pools(s, [adm.Pool("gold", "fixed-share", ("guaranteed",), (str(GPU_LO), str(GPU_HI)))],
                      check=False)
    tenancy.add(s, T("cheap", qos="best-effort"))
    tenancy.bind(s, uid("a1a1a1a1", 1), "cheap", name="g")
    rc, err = start(host, "g", vm("g", 1, tenant="cheap", qos="guaranteed"), bind=False)
    assert rc == 2 and "asks QoS class guaranteed, stronger than it may have: it is bound to tenant 'cheap'" in err
    assert "which allows best-effort" in err
    [row] = admission(s)
    assert row.result == "refused" and "bound to tenant 'cheap'" in row.value
    assert nothing_made(host, s)
    # nor can the operator bind it stronger than its tenant's class
    with pytest.raises(tenancy.RefusedError, match="stronger than tenant 'cheap''s class best-effort"):
        tenancy.bind(s, uid("a1a1a1a1", 1), "cheap", qos="guaranteed", name="g")
    assert [r[2] for r in s.binding_rows()] == [None]


def test_a_binding_class_caps_what_the_metadata_may_ask(host, s):
    tenancy.add(s, T("gold", qos="guaranteed"))
    tenancy.bind(s, uid("a1a1a1a1", 2), "gold", qos="best-effort", name="b")
    rc, err = start(host, "b", vm("b", 2, qos="burstable"), bind=False)
    assert rc == 2 and "it is bound to tenant 'gold' with QoS class best-effort" in err
    assert nothing_made(host, s)
    # asking less than allowed is granted
    assert start(host, "b", vm("b", 2, qos="best-effort"), bind=False) == (0, "")
    assert [(r[2], r[8]) for r in s.allocation_rows()] == [("gold", "best-effort")]


# ---------------------------------------------------------------------------
# unbound domains, require-binding

def test_an_unbound_domain_is_best_effort_with_no_tenant_and_not_counted_or_billed_to_the_named_one(host, s):
    tenancy.add(s, T("team", quota=Q(L(vgpus=1))))
    x = vm("free", 3, tenant="team")
    assert start(host, "free", x, bind=False) == (0, "")
    [row] = s.allocation_rows()
    assert (row[1], row[2], row[8]) == (uid("a1a1a1a1", 3), None, "best-effort")
    [team] = [u for u in tenancy.usage_report(s) if u["tenant"] == "team"]
    assert team["usage"]["vgpus"]["used"] == 0 and team["domains"] == 0
    # metering attributes the domain to no tenant (its XML's name is never used)
    owner = metering.OwnerLabels(s)(uid("a1a1a1a1", 3))
    assert owner.tenant == "" and metering.bound_owners(s) == {}
    assert stop(host, "free", x) == (0, "")
    # bound now: the same start is team's, against its quota
    tenancy.bind(s, uid("a1a1a1a1", 3), "team", name="free")
    assert start(host, "free", x, bind=False) == (0, "")
    assert [r[2] for r in s.allocation_rows()] == ["team"]
    assert metering.OwnerLabels(s)(uid("a1a1a1a1", 3)).tenant == "team"


def test_require_binding_refuses_an_unbound_domain_audited(host, s, capsys):
    code, out, err = run(capsys, host, "--json", "tenant", "policy", "--require-binding", "on")
    assert code == 0 and json.loads(out) == {"schema": "vgpuhost.tenant-policy/v1", "require_binding": True,
                                             "openstack": "off", "unbound_running": []}
    assert run(capsys, host, "tenant", "policy", "--require-binding", "on")[0] == 0     # as it is: no second row
    assert [(r.operation, r.value) for r in s.audit_rows() if r.path == "(settings)"] == \
        [("tenant policy require-binding", "on")]
    rc, err = start(host, "u", vm("u", 4), bind=False)        # no tenant exists: require-binding alone enforces
    assert rc == 2 and "is bound to no tenant, and the operator requires a binding" in err
    assert "'vgpuhost tenant bind u TENANT'" in err
    assert [r.result for r in admission(s)] == ["refused"] and nothing_made(host, s)
    assert run(capsys, host, "tenant", "policy", "--require-binding", "off")[0] == 0
    assert start(host, "u", vm("u", 4), bind=False) == (0, "")
    assert [r[2] for r in s.allocation_rows()] == [None]
    # turned on again while the unbound domain runs: its next start would be refused, and the answer says so
    code, out, err = run(capsys, host, "tenant", "policy", "--require-binding", "on")
    assert code == 0 and "note: 1 running domain(s) have no binding and will be refused at their next start: u" in out
    code, out, err = run(capsys, host, "--json", "tenant", "policy")
    assert json.loads(out)["unbound_running"] == [uid("a1a1a1a1", 4)]


# ---------------------------------------------------------------------------
# the OpenStack mapping: only what Nova writes

EMPTY_NOVA = NOVA.replace(">team</nova:project>", "></nova:project>")


def test_openstack_mapping_refuses_an_empty_or_missing_project_and_a_disagreeing_tenant(host, s):
    tenancy.add(s, T("team"))
    tenancy.add(s, T("other"))
    tenancy.set_openstack(s, "project-name")
    rc, err = start(host, "e", vm("e", 5, raw_prefix=EMPTY_NOVA), bind=False)     # finding 5
    assert rc == 2 and "its Nova metadata's <nova:project> is empty" in err
    rc, err = start(host, "m", vm("m", 6), bind=False)
    assert rc == 2 and "<nova:project> is missing" in err
    rc, err = start(host, "d", vm("d", 7, tenant="other", raw_prefix=NOVA), bind=False)
    assert rc == 2 and "names tenant 'other', but it is bound by the OpenStack mapping (project-name) to Nova's " \
                       "project 'team'" in err
    assert [r.result for r in admission(s)] == ["refused"] * 3 and nothing_made(host, s)
    assert start(host, "n", vm("n", 8, raw_prefix=NOVA), bind=False) == (0, "")
    assert [r[2] for r in s.allocation_rows()] == ["team"]
    # the operator's binding wins over Nova's project (a domain Nova does not manage, or a correction)
    tenancy.bind(s, uid("a1a1a1a1", 6), "other", name="m")
    assert start(host, "m", vm("m", 6), bind=False) == (0, "")
    assert sorted(r[2] for r in s.allocation_rows()) == ["other", "team"]


def test_trusted_is_one_pure_decision():
    row = ("u", "a", None, "root", "2026-12-06T21:00:00.000000+00:00")
    assert trusted("vm", binding=row, asked_tenant="A", asked_qos=None, tenant_class="burstable") == \
        trusted("vm", binding=row, asked_tenant=None, asked_qos=None, tenant_class="burstable")
    t = trusted("vm", binding=row, asked_tenant=None, asked_qos="best-effort", tenant_class="guaranteed")
    assert (t.tenant, t.qos, t.refusal) == ("a", "best-effort", "")
    t = trusted("vm", binding=None, asked_tenant="a", asked_qos=None, tenant_class=None)
    assert (t.tenant, t.qos, t.source, t.refusal) == (None, "best-effort", "unbound", "")
    t = trusted("vm", binding=None, asked_tenant=None, asked_qos="burstable", tenant_class=None)
    assert "an unbound domain's class" in t.refusal
    t = trusted("vm", binding=None, asked_tenant=None, asked_qos=None, tenant_class=None, openstack="project-uuid",
                nova_project=("team", None))
    assert "<nova:project> is without uuid=" in t.refusal


# ---------------------------------------------------------------------------
# ways to bind: the CLI (by name or UUID through libvirt), attach (test_tenancy), the agent's admin API

@pytest.fixture
def libvirt_dom():
    """Domain ``bindme`` on libvirt's test driver (this process), its metadata naming tenant ``team``."""
    import libvirt
    conn = libvirt.open("test:///default")
    meta = Metadata(tenant="team").to_xml()
    dom = conn.defineXML("<domain type='test'><name>bindme</name><memory>65536</memory><os><type>hvm</type></os>"
                         f"<metadata>{meta}</metadata><devices/></domain>")
    try:
        yield dom.UUIDString()
    finally:
        dom.undefine()
        conn.close()


def test_tenant_bind_and_unbind_resolve_the_domain_audit_and_are_idempotent(host, s, capsys, libvirt_dom):
    uuid = libvirt_dom
    base = ("--connect", "test:///default", "--json", "tenant")
    tenancy.add(s, T("team", qos="burstable"))
    code, out, err = run(capsys, host, *base, "bind", "bindme", "nobody")
    assert code == 2 and "no tenant 'nobody'" in err
    code, out, err = run(capsys, host, *base, "bind", "bindme", "team", "--qos", "guaranteed")
    assert code == 2 and "stronger than tenant 'team''s class burstable" in err
    code, out, err = run(capsys, host, *base, "bind", "bindme", "team", "--dry-run")
    assert code == 0 and json.loads(out)["bindings"][0]["changed"] and s.binding_rows() == []
    assert not [r for r in s.audit_rows() if r.path == "(tenants)" and "bind" in r.operation]
    code, out, err = run(capsys, host, *base, "bind", uuid, "TEAM", "--qos", "best-effort")    # by UUID
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "vgpuhost.tenant-binding/v1"
    assert (doc["bindings"][0]["name"], doc["bindings"][0]["tenant"], doc["bindings"][0]["qos"]) == \
        ("bindme", "team", "best-effort")
    [b] = s.binding_rows()
    assert b[:3] == (uuid, "team", "best-effort") and b[3].startswith("cli uid=")
    code, out, err = run(capsys, host, *base, "bind", "bindme", "team", "--qos", "best-effort")
    assert code == 0 and not json.loads(out)["bindings"][0]["changed"]
    rows = [(r.operation, r.value) for r in s.audit_rows() if r.path == "(tenants)" and "bind" in r.operation]
    assert rows == [("tenant bind bindme", f"domain {uuid}: tenant=team qos=best-effort")]
    # list and show name the bound domains
    code, out, err = run(capsys, host, *base, "list")
    assert json.loads(out)["tenants"][0]["bound"][0]["domain"] == uuid
    code, out, err = run(capsys, host, "tenant", "show", "team")
    assert f"bound domains: {uuid} (QoS class best-effort)" in out
    code, out, err = run(capsys, host, *base, "unbind", "bindme")
    assert code == 0 and json.loads(out)["bindings"][0]["was"]["tenant"] == "team" and s.binding_rows() == []
    code, out, err = run(capsys, host, *base, "unbind", "bindme")
    assert code == 0 and not json.loads(out)["bindings"][0]["changed"]
    rows = [r.operation for r in s.audit_rows() if r.path == "(tenants)" and "bind" in r.operation]
    assert rows == ["tenant bind bindme", "tenant unbind bindme"]


def test_bind_from_metadata_is_the_upgrade_path_and_tenant_remove_drops_bindings(host, s, capsys, libvirt_dom):
    uuid = libvirt_dom
    base = ("--connect", "test:///default", "--json", "tenant", "bind", "--from-metadata")
    code, out, err = run(capsys, host, *base, "bindme")
    assert code == 0 and "tenant 'team', which does not exist" in json.loads(out)["skipped"][0]["reason"]
    tenancy.add(s, T("team"))
    code, out, err = run(capsys, host, *base)
    assert code == 0 and [b["domain"] for b in json.loads(out)["bindings"]] == [uuid]
    assert [r[:3] for r in s.binding_rows()] == [(uuid, "team", None)]
    code, out, err = run(capsys, host, *base)
    assert code == 0 and json.loads(out)["bindings"] == [] and "bound to tenant 'team'" in \
        json.loads(out)["skipped"][0]["reason"]
    tenancy.remove(s, "team")
    assert s.binding_rows() == []
    assert f"its bindings dropped: {uuid}" in [r for r in s.audit_rows() if r.path == "(tenants)"][-1].value


def test_the_agent_binds_through_its_admin_api_and_the_read_only_socket_may_not(make_host):
    from agentutil import AgentRun
    host = make_host("a40-mdev")
    s = StateStore(host.state_dir)
    tenancy.add(s, T("team"))
    with AgentRun(host.root, extra=("--metering-interval", "0", "--libvirt-uri", "test:///default")) as agent:
        status, doc = agent.call("POST", "/v1/domains/test/bind", {"tenant": "team"}, ro=True)
        assert status == 403 and s.binding_rows() == []
        status, doc = agent.call("POST", "/v1/domains/test/bind", {"tenant": "team", "qos": "best-effort"})
        assert status == 200 and doc["schema"] == "vgpuhost.tenant-binding/v1", doc
        [b] = s.binding_rows()
        assert (b[1], b[2]) == ("team", "best-effort") and doc["bindings"][0]["domain"] == b[0]
        status, doc = agent.call("POST", "/v1/domains/test/bind", {"tenant": "nobody"})
        assert status == 400 and doc["error"]["message"] == "no tenant 'nobody'"
        # unbind with a tenant contradicts itself: refused, the binding kept (finding 8f)
        status, doc = agent.call("POST", "/v1/domains/test/bind", {"unbind": True, "tenant": "team"})
        assert status == 400 and "contradicts itself" in doc["error"]["line"] and len(s.binding_rows()) == 1
        status, doc = agent.call("POST", "/v1/domains/test/bind", {"unbind": True})
        assert status == 200 and s.binding_rows() == []
        # a binding of a domain libvirt no longer knows is unbound by its UUID, as 'tenant unbind UUID' does
        gone = "0badc0de-0000-4000-8000-000000000001"
        tenancy.bind(s, gone, "team")
        status, doc = agent.call("POST", f"/v1/domains/{gone}/bind", {"unbind": True})
        assert status == 200 and s.binding_rows() == [], doc
    ops = [r.operation for r in s.audit_rows() if r.path == "(tenants)" and "bind" in r.operation]
    assert ops == ["tenant bind test", "tenant unbind test", f"tenant bind {gone}", f"tenant unbind {gone}"]


# ---------------------------------------------------------------------------
# the store: an upgrade binds what already holds allocations; a host without tenancy reads no binding

def test_schema_11_binds_domains_holding_a_known_tenants_allocations_once(make_host):
    host = make_host("a40-mdev")
    s = StateStore(host.state_dir)
    tenancy.add(s, T("team"))
    held, loose = uid("a1a1a1a1", 9), uid("a1a1a1a1", 10)
    with s.transaction() as c:
        s.put_allocation(c, ("dev-1", held, "TEAM", str(GPU_LO), "vgpu", "A40-8Q", 8192, 0, "burstable", 0))
        s.put_allocation(c, ("dev-2", held, "TEAM", str(GPU_LO), "vgpu", "A40-8Q", 8192, 0, "burstable", 0))
        s.put_allocation(c, ("dev-3", loose, "ghost", str(GPU_LO), "vgpu", "A40-8Q", 8192, 0, "burstable", 0))
        s.put_allocation(c, ("dev-4", "manual", "team", str(GPU_LO), "vgpu", "A40-8Q", 8192, 0, "burstable", 0))
    s.close()
    db = sqlite3.connect(str(host.state_dir / "state.db"))        # a store as version 10 left it
    for table in ("bindings", "bill_adjustments", "bills", "gpu_health", "reservations",   # versions 11 to 14 add
                  "tenant_guarantees", "admission_refusals"):                            # 16, 17
        db.execute(f"DROP TABLE {table}")
    for trigger in ("tenants_guarantee_insert", "tenants_guarantee_update", "tenants_guarantee_delete",
                    "meter_state_first_tick"):                                           # version 16's
        db.execute(f"DROP TRIGGER {trigger}")
    db.execute("PRAGMA user_version = 10")
    db.commit()
    db.close()
    s = StateStore(host.state_dir)
    assert s.schema_version == len(MIGRATIONS) == 17
    assert [r[:4] for r in s.binding_rows()] == [(held, "team", None, "upgrade (schema 11)")]
    [row] = [r for r in s.audit_rows() if r.operation.startswith("tenant bind")]
    assert (row.operation, row.path) == (f"tenant bind {held}", "(tenants)") and "tenant=team" in row.value


def test_a_host_without_tenancy_reads_no_binding_at_start(host, s, monkeypatch):
    def no(*a, **k):
        raise AssertionError("a binding was read on a host without tenancy")
    monkeypatch.setattr(StateStore, "binding", no)
    assert start(host, "plain", vm("plain", 11, tenant="whoever"), bind=False) == (0, "")
    assert [r[2] for r in s.allocation_rows()] == [None]
    assert not (host.state_dir / "locks" / "tenancy.lock").exists()
    assert parse_domain(vm("plain", 11)).metadata.tenant is None


def test_forgery_is_refused_through_the_agent_too(host, s):
    """``prepare begin`` handed to the agent (its socket under the host root) decides as the one-shot
    hook does: refused naming the binding, one refused row, nothing made."""
    from agentutil import AgentRun
    tenancy.add(s, T("alpha"))
    tenancy.add(s, T("beta"))
    tenancy.bind(s, uid("a1a1a1a1", 12), "alpha", name="via", actor="root")
    with AgentRun(host.root, str(host.path("run", "vgpuhost"))) as agent:
        rc, err = start(host, "via", vm("via", 12, tenant="beta"), bind=False)
        assert rc == 2 and "its metadata names tenant 'beta', but it is bound to tenant 'alpha' by root" in err
        assert agent.call("GET", "/v1/agent")[1]["served"].get("POST /v1/hook/prepare") == 1
    [row] = admission(s)
    assert row.result == "refused" and "bound to tenant 'alpha'" in row.value
    assert nothing_made(host, s)


def test_the_xml_never_gets_a_tenant_or_a_class_the_operator_did_not_allow():
    """Property: whatever the metadata asks, an admitted start's tenant is the binding's (or Nova's with the
    mapping on, or none), and its class is never stronger than the binding's and the tenant's."""
    from hypothesis import given, settings, strategies as st
    from vgpuhost.model.tenancy import QOS_CLASSES
    from vgpuhost.policy.binding import stronger
    name = st.sampled_from(["a", "A", "b", None])
    qos = st.sampled_from([*QOS_CLASSES, None])

    @settings(max_examples=300, deadline=None)
    @given(bound=name, bound_qos=qos, asked=name, asked_qos=qos, cls=st.sampled_from([*QOS_CLASSES, None]),
           mode=st.sampled_from([None, "project-name", "project-uuid"]),
           nova=st.sampled_from([None, ("a", None), ("", "u1"), ("b", "u2")]), require=st.booleans())
    def check(bound, bound_qos, asked, asked_qos, cls, mode, nova, require):
        row = None if bound is None else ("u", bound, bound_qos, "root", "2026-12-06T21:00:00")
        t = trusted("vm", binding=row, asked_tenant=asked, asked_qos=asked_qos, tenant_class=cls, openstack=mode,
                    nova_project=nova, require_binding=require)
        if t.refusal:
            assert t.hint.endswith("nothing was changed")
            return
        if row is not None:
            assert t.tenant == bound
        elif mode:
            assert t.tenant == (nova[1] if mode == "project-uuid" else nova[0]) and t.tenant
        else:
            assert t.tenant is None and not require
        if asked and t.tenant is not None:
            assert asked.lower() == t.tenant.lower()
        caps = [c for c in (bound_qos if row is not None else None,
                            cls if t.tenant is not None and cls else "best-effort") if c]
        assert not any(stronger(t.qos, c) for c in caps)
        assert asked_qos is None or t.qos == asked_qos
    check()
