"""Property tests (hypothesis) for admission: random sequences of tenant changes, attach/start, stop,
failed starts and pool changes never exceed a guaranteed quota, break an isolation level, serve a QoS
class from the wrong mechanism, or put two scheduler policies on one GPU.

The host is :class:`vgpuhost.policy.replay.HostModel` (the vGPU manager's capacity rules, no files);
the checks are :func:`vgpuhost.policy.replay.violations`, written apart from admission's own code.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vgpuhost.model.tenancy import Limits, Quota, Tenant
from vgpuhost.model.values import replace
from vgpuhost.policy import admission as adm
from vgpuhost.policy.replay import Board, HostModel, violations

A40, L40S = Board("A40", 49152), Board("L40S", 49152)
GPUS = {"0000:01:00.0": A40, "0000:02:00.0": A40, "0000:03:00.0": L40S, "0000:04:00.0": L40S,
        "0000:05:00.0": A40}
NAMES = ("t0", "t1", "t2", "t3")
LABELS = ("env=prod", "env=dev", "tier=batch")
POLICIES = ("fixed-share", "equal-share", "best-effort")


@st.composite
def limits(draw):
    def one():
        g = draw(st.one_of(st.none(), st.integers(0, 6)))
        b = None if g is None else draw(st.one_of(st.none(), st.integers(g, g + 4)))
        return g, b
    v, fb, pt = one(), one(), one()
    fb = tuple(None if x is None else x * 8192 for x in fb)
    return Quota(Limits(vgpus=v[0], framebuffer_mib=fb[0], passthrough_gpus=pt[0]),
                 Limits(vgpus=v[1], framebuffer_mib=fb[1], passthrough_gpus=pt[1]),
                 draw(st.sampled_from([frozenset(), frozenset("Q"), frozenset("C"), frozenset("QC")])))


@st.composite
def tenant(draw, name):
    return Tenant(name, draw(st.sampled_from(("guaranteed", "burstable", "best-effort"))),
                  draw(st.sampled_from(("shared", "shared", "exclusive", "hardware"))), draw(limits()),
                  frozenset(draw(st.lists(st.sampled_from(LABELS), max_size=1))),
                  frozenset(draw(st.lists(st.sampled_from(LABELS), max_size=1))),
                  frozenset(draw(st.lists(st.sampled_from(LABELS), max_size=1))))


@st.composite
def pools(draw):
    out, left = [], sorted(GPUS)
    for i in range(draw(st.integers(0, 3))):
        if not left:
            break
        gpus = draw(st.lists(st.sampled_from(left), min_size=1, max_size=2, unique=True))
        left = [g for g in left if g not in gpus]
        policy = draw(st.sampled_from(POLICIES))
        classes = tuple(draw(st.lists(st.sampled_from(adm.POLICY_SERVES[policy]), min_size=1, unique=True)))
        out.append(adm.Pool(f"p{i}", policy, classes, tuple(gpus)))
    return out


PROFILES = st.sampled_from(["A40-8Q", "A40-16Q", "A40-4C", "L40S-8Q", "L40S-24C", "L40S-12Q", "A40-48Q"])

op = st.one_of(
    st.tuples(st.just("start"), st.integers(0, 40), st.sampled_from(NAMES + (None,)), PROFILES,
              st.sampled_from([None, None, "guaranteed", "burstable", "best-effort"]),
              st.sampled_from(["first-fit", "best-fit", "spread"]), st.booleans()),
    st.tuples(st.just("passthrough"), st.integers(0, 40), st.sampled_from(NAMES), st.booleans()),
    st.tuples(st.just("stop"), st.integers(0, 40)),
    st.tuples(st.just("set"), st.sampled_from(NAMES), limits(), st.sampled_from(("guaranteed", "burstable",
                                                                                 "best-effort"))),
    st.tuples(st.just("pools"), pools()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=st.tuples(*[tenant(n) for n in NAMES]), initial=pools(), ops=st.lists(op, max_size=60))
def test_random_operations_keep_quota_isolation_qos_and_one_policy_per_gpu(ts, initial, ops):
    tenants = {t.name: t for t in ts}
    model = HostModel(GPUS, initial)
    raised = True       # no quota lowered yet: use must stay within every limit
    for o in ops:
        kind = o[0]
        if kind == "start":
            _, n, tname, profile, qos, strategy, fail = o
            owner = f"vm{n}"
            before = adm.usage(tname, model.allocations) if tname else None
            d = model.arrive(owner, adm.vgpu_demand(profile), tenants, tenant=tname, qos=qos, strategy=strategy,
                             fail=fail)
            if d.admitted and tname and not fail:
                _admitted_within_quota(tenants[tname], before, adm.vgpu_demand(profile), d)
            if not d.admitted:
                assert d.reason and d.code != "ok"
        elif kind == "passthrough":
            _, n, tname, fail = o
            before = adm.usage(tname, model.allocations)
            d = model.arrive(f"vm{n}", adm.passthrough_demand(), tenants, tenant=tname, fail=fail)
            if d.admitted and not fail:
                _admitted_within_quota(tenants[tname], before, adm.passthrough_demand(), d)
        elif kind == "stop":
            model.depart(f"vm{o[1]}")
        elif kind == "set":
            _, name, quota, qos = o
            old = tenants[name]
            for dim in ("vgpus", "framebuffer_mib", "passthrough_gpus"):
                was, now = old.quota.ceiling(dim), quota.ceiling(dim)
                if (was is None and now is not None) or (was is not None and now is not None and now < was):
                    raised = False
                if (old.quota.guaranteed.get(dim) or 0) > (quota.guaranteed.get(dim) or 0) or (
                        old.quota.guaranteed.get(dim) is None and quota.guaranteed.get(dim) is not None):
                    raised = False
            tenants[name] = replace(old, quota=quota, qos=qos)
        else:
            before = list(model.pools)
            why = model.set_pools(o[1])
            if why is not None:
                assert model.pools == before
        assert violations(model, tenants, check_quota=raised) == [], (o, model.allocations, model.pools)


def _admitted_within_quota(t: Tenant, before, demand: adm.Demand, d: adm.Admission) -> None:
    for dim, (total, _) in before.items():
        n = demand.amount(dim)
        if not n:
            continue
        ceiling, g = t.quota.ceiling(dim), t.quota.guaranteed.get(dim)
        assert ceiling is None or total + n <= ceiling, (t, dim, total, n)
        if g is not None and not d.burst:
            assert total + n <= g, (t, dim, total, n, d)


@settings(max_examples=60, deadline=None)
@given(ts=st.tuples(*[tenant(n) for n in NAMES]), arrivals=st.lists(
    st.tuples(st.sampled_from(NAMES), PROFILES), min_size=1, max_size=30))
def test_a_refusal_always_names_its_rule_and_what_would_free_room(ts, arrivals):
    tenants = {t.name: t for t in ts}
    model = HostModel(GPUS)
    for i, (tname, profile) in enumerate(arrivals):
        d = model.arrive(f"vm{i}", adm.vgpu_demand(profile), tenants, tenant=tname)
        if d.admitted:
            assert d.gpu in GPUS and d.gpu in d.candidates
        else:
            assert d.code in ("series", "quota", "isolation", "qos", "pool", "capacity", "burst")
            assert d.frees, d
            if d.code == "quota":
                assert "in use" in d.reason and d.quota
