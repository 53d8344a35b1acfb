"""Admission control (issue 13): the pure decision, quota -> isolation -> QoS class -> pool -> placement."""

import pytest

from vgpuhost.model.errors import InputError
from vgpuhost.model.tenancy import Limits, Quota, Tenant, parse_limit, parse_series, with_limits
from vgpuhost.model.values import PciAddress
from vgpuhost.policy import admission as adm
from vgpuhost.policy.placement import GpuOffer

G1, G2, G3 = "0000:41:00.0", "0000:81:00.0", "0000:c1:00.0"
OWNER_A = "11111111-1111-1111-1111-111111111111"
OWNER_B = "22222222-2222-2222-2222-222222222222"


def offers(*avail, profile="A40-8Q", gpus=(G1, G2, G3)):
    return [GpuOffer(PciAddress.parse(g), 0, "nvidia-566", profile, n,
                     (PciAddress.parse(g),) if n else ()) for g, n in zip(gpus, avail)]


def vreq(owner=OWNER_A, tenant=None, profile="A40-8Q", qos=None, **kw):
    return adm.AdmissionRequest(owner, adm.vgpu_demand(profile), tenant, qos, **kw)


def held(device, owner, tenant, gpu, profile="A40-8Q", burst=False, kind=adm.VGPU):
    d = adm.vgpu_demand(profile) if kind == adm.VGPU else adm.passthrough_demand()
    return adm.Allocation(device, owner, tenant, gpu, kind, d.profile, d.framebuffer_mib, d.mig_slices,
                          "burstable", burst)


def tenant(name, g=None, b=None, **kw):
    return Tenant(name, quota=Quota(Limits(**(g or {})), Limits(**(b or {})), kw.pop("series", frozenset())),
                  **kw)


def test_no_tenants_admits_and_places():
    d = adm.admit(vreq(tenant="demo"), tenants={}, allocations=[], offers=offers(2, 2, 2))
    assert d.admitted and d.gpu == G1 and d.tenant == "demo" and d.qos == "best-effort"
    assert d.candidates == (G1, G2, G3) and d.pool == "default" and not d.burst


def test_unknown_tenant_refused_when_tenants_exist():
    d = adm.admit(vreq(tenant="ghost"), tenants={"a": tenant("a")}, allocations=[], offers=offers(1, 1, 1))
    assert not d.admitted and d.code == "unknown-tenant" and "ghost" in d.reason
    # an unknown tenant is added, not freed: the remedy does not say "to free room" (a breaker's finding)
    assert d.one_line().endswith("; to be admitted: add it ('vgpuhost tenant add ghost') or fix the domain's tenant")


def test_quota_guaranteed_then_burst_then_refused_naming_use():
    t = tenant("a", g={"vgpus": 1}, b={"vgpus": 2})
    ts = {"a": t}
    d1 = adm.admit(vreq(tenant="a"), tenants=ts, allocations=[], offers=offers(3, 3, 3))
    assert d1.admitted and not d1.burst
    h = [held("m1", OWNER_A, "a", G1)]
    d2 = adm.admit(vreq(owner=OWNER_B, tenant="a"), tenants=ts, allocations=h, offers=offers(3, 3, 3))
    assert d2.admitted and d2.burst and "(burst)" in d2.reason
    h.append(held("m2", OWNER_B, "a", G2, burst=True))
    d3 = adm.admit(vreq(owner=OWNER_B, tenant="a"), tenants=ts, allocations=h, offers=offers(3, 3, 3))
    assert not d3.admitted and d3.code == "quota" and d3.quota == "vgpus"
    assert "2 in use + 1 asked > 2 (burst limit)" in d3.reason
    assert any("m1" in f or "m2" in f for f in d3.frees)


def test_framebuffer_quota_counts_mib():
    ts = {"a": tenant("a", g={"framebuffer_mib": 16384})}
    h = [held("m1", OWNER_A, "a", G1, profile="A40-8Q")]
    ok = adm.admit(vreq(owner=OWNER_B, tenant="a", profile="A40-8Q"), tenants=ts, allocations=h,
                   offers=offers(3, 3, 3))
    assert ok.admitted
    no = adm.admit(vreq(owner=OWNER_B, tenant="a", profile="A40-16Q"), tenants=ts, allocations=h,
                   offers=offers(3, 3, 3, profile="A40-16Q"))
    assert not no.admitted and no.quota == "framebuffer_mib" and "8192 in use + 16384 asked > 16384" in no.reason


def test_series_restriction():
    ts = {"a": tenant("a", series=frozenset("C"))}
    d = adm.admit(vreq(tenant="a"), tenants=ts, allocations=[], offers=offers(1, 1, 1))
    assert not d.admitted and d.code == "series"
    d = adm.admit(vreq(tenant="a", profile="A40-8C"), tenants=ts, allocations=[],
                  offers=offers(1, 1, 1, profile="A40-8C"))
    assert d.admitted


def test_hardware_isolation_refuses_time_sliced_admits_mig_and_passthrough():
    ts = {"h": tenant("h", isolation="hardware")}
    d = adm.admit(vreq(tenant="h"), tenants=ts, allocations=[], offers=offers(1, 1, 1))
    assert not d.admitted and d.code == "isolation"
    d = adm.admit(vreq(tenant="h", profile="H200X-1-18C"), tenants=ts, allocations=[],
                  offers=offers(1, 0, 0, profile="H200X-1-18C"))
    assert d.admitted and d.pool is None
    d = adm.admit(adm.AdmissionRequest(OWNER_A, adm.passthrough_demand(), "h", gpu=G2), tenants=ts,
                  allocations=[])
    assert d.admitted and d.gpu == G2


def test_exclusive_keeps_gpus_to_itself_both_ways():
    ts = {"x": tenant("x", isolation="exclusive"), "s": tenant("s")}
    h = [held("m1", OWNER_B, "s", G1)]
    d = adm.admit(vreq(tenant="x"), tenants=ts, allocations=h, offers=offers(3, 3, 3))
    assert d.admitted and d.gpu == G2 and G1 not in d.candidates
    h.append(held("m2", OWNER_A, "x", G2))
    d = adm.admit(vreq(owner="33333333-3333-3333-3333-333333333333", tenant="s"), tenants=ts, allocations=h,
                  offers=offers(0, 3, 3))
    assert d.admitted and d.gpu == G3 and G2 not in d.candidates
    # an untenanted domain does not join the exclusive tenant's GPU either
    d = adm.admit(vreq(owner="33333333-3333-3333-3333-333333333333"), tenants=ts, allocations=h,
                  offers=offers(0, 3, 0))
    assert not d.admitted and d.code == "capacity" and "exclusive" in d.reason and G2 not in d.candidates


def test_label_anti_affinity_and_affinity():
    ts = {"prod": tenant("prod", labels=frozenset({"env=prod"}), avoid=frozenset({"env=dev"})),
          "dev": tenant("dev", labels=frozenset({"env=dev"})),
          "batch": tenant("batch", prefer=frozenset({"env=dev"}))}
    h = [held("m1", OWNER_A, "prod", G1)]
    d = adm.admit(vreq(owner=OWNER_B, tenant="dev"), tenants=ts, allocations=h, offers=offers(3, 3, 3))
    assert d.admitted and d.gpu == G2 and "avoids env=dev" not in d.reason
    h.append(held("m2", OWNER_B, "dev", G3))
    d = adm.admit(vreq(owner="33333333-3333-3333-3333-333333333333", tenant="batch"), tenants=ts,
                  allocations=h, offers=offers(3, 3, 3))
    assert d.admitted and d.gpu == G3 and "preferred" in d.reason


def test_guaranteed_time_sliced_needs_fixed_share_pool():
    ts = {"g": tenant("g", qos="guaranteed")}
    d = adm.admit(vreq(tenant="g"), tenants=ts, allocations=[], offers=offers(1, 1, 1))
    assert not d.admitted and d.code == "qos" and "fixed-share" in d.reason
    pools = [adm.Pool("gold", "fixed-share", ("guaranteed",), (G3,)),
             adm.Pool("std", "equal-share", ("burstable", "best-effort"), (G1, G2))]
    d = adm.admit(vreq(tenant="g"), tenants=ts, allocations=[], pools=pools, offers=offers(1, 1, 1))
    assert d.admitted and d.gpu == G3 and d.pool == "gold" and d.candidates == (G3,)
    # a domain's override: best-effort is served by neither declared pool, nor by 'default' (no GPU left)
    d = adm.admit(vreq(tenant="g", qos="best-effort"), tenants=ts, allocations=[],
                  pools=[adm.Pool("gold", "fixed-share", ("guaranteed",), (G1, G2, G3))], offers=offers(1, 1, 1))
    assert not d.admitted and d.code == "pool"


def test_capacity_refusal_names_other_tenants_burst():
    ts = {"a": tenant("a", g={"vgpus": 1}, b={"vgpus": 3}), "b": tenant("b", g={"vgpus": 2})}
    h = [held("m1", OWNER_A, "a", G1), held("m2", OWNER_A, "a", G1, burst=True)]
    d = adm.admit(vreq(owner=OWNER_B, tenant="b"), tenants=ts, allocations=h, offers=offers(0, 0, 0),
                  names={OWNER_A: "web-1"})
    assert not d.admitted and d.code == "capacity"
    assert any("tenant 'a' holds vGPU A40-8Q m2" in f and "web-1" in f for f in d.frees)
    assert "to free room" in d.one_line()


def test_burst_only_from_free_capacity():
    # 2 GPUs of 48 GiB; tenant b has 64 GiB guaranteed and uses none: a burst of a may not eat into it
    ts = {"a": tenant("a", g={"framebuffer_mib": 0}, b={"framebuffer_mib": 65536}),
          "b": tenant("b", g={"framebuffer_mib": 65536})}
    mem = {G1: 49152, G2: 49152}
    d = adm.admit(vreq(tenant="a", profile="A40-48Q"), tenants=ts, allocations=[], gpu_memory=mem,
                  offers=offers(1, 1, profile="A40-48Q", gpus=(G1, G2)))
    assert not d.admitted and d.code == "burst" and "(tenant 'b': 65536 MiB framebuffer)" in d.reason
    ts["b"] = tenant("b", g={"framebuffer_mib": 32768})
    d = adm.admit(vreq(tenant="a", profile="A40-16Q"), tenants=ts, allocations=[], gpu_memory=mem,
                  offers=offers(3, 3, profile="A40-16Q", gpus=(G1, G2)))
    assert d.admitted and d.burst


def test_passthrough_of_a_gpu_holding_vgpus_is_refused():
    d = adm.admit(adm.AdmissionRequest(OWNER_B, adm.passthrough_demand(), gpu=G1), tenants={},
                  allocations=[held("m1", OWNER_A, None, G1)], names={OWNER_A: "vm-a"})
    assert not d.admitted and d.code == "capacity" and "vm-a" in d.frees[0]


def test_pool_problems():
    bad = [adm.Pool("a", "equal-share", ("guaranteed",), (G1,)), adm.Pool("b", "fixed-share", (), (G1,)),
           adm.Pool("default", "best-effort", ("best-effort",), ())]
    text = " | ".join(adm.pool_problems(bad))
    assert "cannot serve guaranteed" in text and "one GPU has one scheduler policy" in text and "'default'" in text


def test_model_parsing():
    assert parse_limit("4:6", "x") == (4, 6) and parse_limit("none", "x") == (None, None)
    assert parse_limit("24G:32G", "fb", mib=True) == (24576, 32768)
    assert parse_series("c,q") == frozenset("CQ")
    with pytest.raises(InputError):
        parse_limit("four", "x")
    with pytest.raises(InputError, match="below the guaranteed"):
        Quota(Limits(vgpus=4), Limits(vgpus=2)).validate()
    q = with_limits(Quota(), {"vgpus": (2, 4)})
    assert q.ceiling("vgpus") == 4 and q.text("vgpus") == "2:4"
    with pytest.raises(InputError):
        Tenant("bad name").validate()
