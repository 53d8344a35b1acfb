"""The capacity reconciler's fixes of trial 10 (tester A): its demand cannot be forged with a domain's
name (F4), a retried start counts once (F5), a GPU reserved for an incoming migration is busy (F1), a
layout's idle vGPUs are no forecast demand (F13), and a pass cannot land inside ``apply`` (F7).

Outcomes are read back from the simulated NVML (scheduler policy), the state store (pools,
reservations, refusal records) and the audit log.
"""

from __future__ import annotations

import json
import time

from vgpuhost.io import state as st
from vgpuhost.io.state import StateStore
from vgpuhost.model.usage import UsageRow
from vgpuhost.ops import rebalance, tenancy
from vgpuhost.sim.nvml import SimNvml

from test_hook import GPU_HI, GPU_LO, MIXED, bind_as_asked, call, mdev_gpu, start
from test_migrate import call as mcall
from test_rebalance import BASE, gold_one, policy_of, pool_map, run
from test_tenancy import tdom, uid


def test_a_domain_name_carrying_a_refusal_tail_is_no_demand(make_host, capsys):
    """F4: tenant b's domain is named like admission's tail (``x; refusal=capacity profile=A40-48Q
    qos=guaranteed tenant=g``) and claims tenant g; its start is refused before admission weighs it.
    The reconciler moves nothing: no refusal is recorded for it, and the audit row's value is never read
    as demand."""
    host, s = gold_one(make_host, capsys)
    tenancy.add(s, tenancy.Tenant("b", qos="burstable"))
    assert "nothing to move" in run(capsys, host, "rebalance", "--dry-run")[1]
    name = "x; refusal=capacity profile=A40-48Q qos=guaranteed tenant=g"
    xml = tdom(name, uid("ee00ee00", 0), uid("ff00ff00", 0), tenant="g", profile="A40-8Q")
    tenancy.bind(s, uid("ee00ee00", 0), "b", name=name, actor="operator")
    rc, err = start(host, "x", xml, bind=False)
    assert rc == 2 and "bound to tenant 'b'" in err, err
    [row] = [r for r in s.audit_rows() if r.path == rebalance.ADMISSION_PATH and r.result == "refused"]
    assert "refusal=capacity profile=A40-48Q qos=guaranteed tenant=g" in row.value
    code, out, err = run(capsys, host, "rebalance")
    assert code == 0 and "nothing to move" in out, out + err
    assert pool_map(s) == BASE and policy_of(host, GPU_HI) == "equal-share"
    assert not [r for r in s.audit_rows() if r.operation.startswith("rebalance")]
    assert s.refusal_records() == []


def test_a_forged_name_on_a_start_admission_weighed_counts_as_its_real_tenant(make_host, capsys):
    """F4: the same name on a start admission did weigh (b's own burstable domain, refused for room in
    the default pool) is demand of b's class and profile, as admission stored them: never the
    guaranteed A40-48Q of tenant g the name spells, so gold gets nothing."""
    host, s = gold_one(make_host, capsys)
    tenancy.add(s, tenancy.Tenant("b", qos="burstable"))
    full = tdom("b0", uid("b0b0b0b0", 0), uid("b1b1b1b1", 0), tenant="b", profile="A40-48Q")
    assert start(host, "b0", full) == (0, "")           # the default pool's one GPU is full
    name = "y; refusal=capacity profile=A40-48Q qos=guaranteed tenant=g"
    rc, err = start(host, "y", tdom(name, uid("b0b0b0b0", 1), uid("b1b1b1b1", 1), tenant="b", profile="A40-8Q"))
    assert rc == 2, err
    code, out, err = run(capsys, host, "--json", "rebalance", "--dry-run")
    doc = json.loads(out)
    assert all(m["to_pool"] != "gold" for m in doc["moves"]), doc["moves"]
    assert "guaranteed" not in " ".join(m["reason"] for m in doc["moves"])
    [rec] = s.refusal_records()
    assert rec[2:] == (uid("b0b0b0b0", 1), uid("b1b1b1b1", 1), "capacity", "A40-8Q", "burstable", "b"), rec


FOUR_A40 = MIXED.replace('''  - {{bdf: "0000:a0:01.1"''', '''  - {{bdf: "0000:c0:01.0", model: intel-root-port, numa_node: 1}}
  - {{bdf: "0000:c1:00.0", model: A40, upstream: "0000:c0:01.0", numa_node: 1, vgpu: {{backend: mdev}}}}
  - {{bdf: "0000:e0:01.0", model: intel-root-port, numa_node: 1}}
  - {{bdf: "0000:e1:00.0", model: A40, upstream: "0000:e0:01.0", numa_node: 1, vgpu: {{backend: mdev}}}}
  - {{bdf: "0000:a0:01.1"''')


def test_a_retried_start_counts_once(make_host, capsys):
    """F5: one domain's A40-24Q start, refused three times (a retry loop), is one start: one GPU moves
    to gold, not two (three A40-24Q need two GPUs); the other two A40s stay in the default pool."""
    assert FOUR_A40 != MIXED
    host = make_host(yaml_text=FOUR_A40.format(faults=""))
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_LO), "--policy", "fixed-share")[0] == 0
    s = StateStore(host.state_dir)
    tenancy.set_pools(s, [tenancy.adm.Pool("gold", "fixed-share", ("guaranteed",), (str(GPU_LO),))])
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    assert start(host, "g0", tdom("g0", uid("10101010", 0), uid("20202020", 0), tenant="g",
                                  profile="A40-48Q")) == (0, "")
    again = tdom("g1", uid("10101010", 1), uid("20202020", 1), tenant="g", profile="A40-24Q")
    assert [start(host, "g1", again)[0] for _ in range(3)] == [2, 2, 2]
    code, out, err = run(capsys, host, "--json", "rebalance")
    assert code == 0, err
    doc = json.loads(out)
    assert [m["done"] for m in doc["moves"]] == [True], doc["moves"]
    assert "1 start(s) of A40-24Q (guaranteed; g)" in doc["moves"][0]["reason"]
    pools = pool_map(s)
    assert sorted(g for g, p in pools.items() if p == "gold") == sorted([str(GPU_LO), doc["moves"][0]["gpu"]])
    assert len(pools) == 2, pools       # two A40s left in the default pool
    assert start(host, "g1", again) == (0, "")
    assert len(s.refusal_records()) == 3


def test_a_gpu_reserved_for_an_incoming_migration_is_not_moved(make_host, capsys):
    """F1: ``migrate begin`` reserves an A40-24Q on GPU_HI (the default pool, the only one serving
    burstable) for tenant b's incoming domain; gold is full and refused a start.  The reconciler leaves
    GPU_HI where it is (busy: reserved), and the migration's ``prepare begin`` then makes its vGPU."""
    host, s = gold_one(make_host, capsys)
    tenancy.add(s, tenancy.Tenant("b", qos="burstable"))
    assert start(host, "g1", tdom("g1", uid("10101010", 1), uid("20202020", 1), tenant="g",
                                  profile="A40-48Q"))[0] == 2
    inx = tdom("mig", uid("30303030", 0), uid("40404040", 0), tenant="b", profile="A40-24Q")
    bind_as_asked(host, inx)
    rc, out, err = mcall(host, "mig", "migrate", "begin", inx)
    assert rc == 0, err
    assert [(r[0], r[3]) for r in s.reservation_rows()] == [(uid("40404040", 0), str(GPU_HI))]
    f = rebalance.facts(host, s, rebalance.load_bounds(host))
    assert {g.gpu: g.busy for g in f.gpus}[str(GPU_HI)] == "reserved for the incoming migration of mig"
    code, out, err = run(capsys, host, "--json", "rebalance")
    assert code == 0, err
    assert json.loads(out)["moves"] == []
    assert pool_map(s) == BASE and policy_of(host, GPU_HI) == "equal-share"
    assert call(host, "mig", "prepare", "begin", inx) == (0, "")
    assert mdev_gpu(host, uid("40404040", 0)) == GPU_HI


def test_the_move_rechecks_a_reservation_under_the_gpu_lock(make_host, capsys):
    """F1: a reservation made after the decision (between the facts and the move) stops the move under
    the GPU's lock: nothing is changed and the move is listed as failed."""
    host, s = gold_one(make_host, capsys)
    assert start(host, "g1", tdom("g1", uid("10101010", 1), uid("20202020", 1), tenant="g",
                                  profile="A40-48Q"))[0] == 2
    real = rebalance.facts

    def facts_then_reserved(*a, **k):
        got = real(*a, **k)
        s.reserve([(uid("40404040", 0), "mig", str(GPU_HI), "mdev", "A40-24Q",
                    time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 300)) + ".000000+00:00")],
                  owner=uid("30303030", 0), actor="test", operation="migrate begin")
        return got

    rebalance.facts = facts_then_reserved
    try:
        result = rebalance.rebalance(host, s, rebalance.load_bounds(host))
    finally:
        rebalance.facts = real
    assert [m.gpu for m, _ in result.plans] == [str(GPU_HI)] and result.done == []
    assert "reserved for the incoming migration of 'mig'" in result.failed[0], result.failed
    assert pool_map(s) == BASE and policy_of(host, GPU_HI) == "equal-share"


def _idle_rows(hour_s: float, n: int, qos: str = ""):
    """``n`` metered hours of a layout's vGPUs on GPU_HI in the hour at ``hour_s``: no domain held
    them (``qos``: ''), or, as the control, a domain did."""
    return [UsageRow(time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(hour_s)), uid("1d1e1d1e", i),
                     uid("dddddddd", i) if qos else "", "vgpu", str(GPU_HI), "A40-8Q", "", "", qos, 3600.0, 0.0,
                     0.0, 0.0, 0, 8192 << 20, 360) for i in range(n)]


def test_idle_layout_vgpus_are_no_forecast_demand(make_host, capsys):
    """F13: yesterday one idle layout vGPU was metered at this hour and six at the next (no domain held
    them: tenant and class empty).  That is room, not best-effort demand: no class history, no trend
    use, and the best-effort pool is not forecast to need a second GPU.  The control (the same hours
    held by domains) is demand."""
    host = make_host(yaml_text=MIXED.format(faults=""))
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_LO), "--policy", "best-effort")[0] == 0
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "equal-share")[0] == 0
    s = StateStore(host.state_dir)
    tenancy.set_pools(s, [tenancy.adm.Pool("batch", "best-effort", ("best-effort",), (str(GPU_LO),)),
                          tenancy.adm.Pool("std", "equal-share", ("burstable",), (str(GPU_HI),))])
    tenancy.add(s, tenancy.Tenant("be", qos="best-effort"))
    assert start(host, "be0", tdom("be0", uid("bebebebe", 0), uid("bfbfbfbf", 0), tenant="be",
                                   profile="A40-8Q")) == (0, "")
    now = int(time.time()) // 3600 * 3600
    with s.transaction() as conn:
        st.add_usage(conn, _idle_rows(now - 86400, 1) + _idle_rows(now - 86400 + 3600, 6)
                     + _idle_rows(now - 2 * 86400, 1))
    bounds = rebalance.load_bounds(host)
    assert rebalance.class_history(s, time.time(), bounds) == {}
    assert st.gpu_alloc_by_hour(s, "2000-01-01T00:00:00Z") == []
    code, out, err = run(capsys, host, "--json", "rebalance", "--dry-run")
    doc = json.loads(out)
    assert doc["moves"] == [], doc["moves"]
    assert {d["pool"]: d["need_ahead"] for d in doc["demand"]}["batch"] == 1.0
    with s.transaction() as conn:           # the control: the same hours held by best-effort domains
        st.add_usage(conn, _idle_rows(now - 86400, 1, "best-effort") + _idle_rows(now - 86400 + 3600, 6,
                                                                                  "best-effort"))
    assert sum(rebalance.class_history(s, time.time(), bounds)["best-effort"]) == 7.0
    doc = json.loads(run(capsys, host, "--json", "rebalance", "--dry-run")[1])
    assert [m["to_pool"] for m in doc["moves"]] == ["batch"], doc["moves"]


THREE_A40 = MIXED.replace('''  - {{bdf: "0000:a0:01.1"''', '''  - {{bdf: "0000:c0:01.0", model: intel-root-port, numa_node: 1}}
  - {{bdf: "0000:c1:00.0", model: A40, upstream: "0000:c0:01.0", numa_node: 1, vgpu: {{backend: mdev}}}}
  - {{bdf: "0000:a0:01.1"''')

RACE = """version: 1
layouts:
  l:
    gpus:
      - select: {address: "0000:41:00.0"}
        mode: vgpu
        vgpu: {types: {A40-48Q: 0}}
        scheduler: {policy: fixed-share}
        pool: {name: gold, serves: [guaranteed]}
      - select: {address: ["0000:81:00.0", "0000:c1:00.0"]}
        mode: vgpu
        vgpu: {types: {A40-48Q: 0}}
        scheduler: {policy: equal-share}
        pool: {name: std, serves: [burstable]}
"""


def test_a_pass_cannot_land_inside_apply(make_host, capsys, tmp_path, monkeypatch):
    """F7: a rebalance pass tried while ``apply`` is between its drift check and its pool records (the
    point it calls ``tenancy.pool_changes``) waits for apply's ``layout`` lock (here: gives up at a short
    deadline, moving nothing), so apply records its pools on a host whose schedulers match them and
    ``assert`` finds no drift.  The pass run after apply moves the GPU whole (pool and scheduler)."""
    from vgpuhost.io.locks import deadline
    from vgpuhost.model.errors import TransientError
    host = make_host(yaml_text=THREE_A40.format(faults=""))
    cfg = tmp_path / "l.yaml"
    cfg.write_text(RACE)
    assert run(capsys, host, "apply", "-c", str(cfg), "--yes")[0] == 0
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    assert start(host, "g0", tdom("g0", uid("10101010", 0), uid("20202020", 0), tenant="g",
                                  profile="A40-48Q")) == (0, "")
    assert start(host, "g1", tdom("g1", uid("10101010", 1), uid("20202020", 1), tenant="g",
                                  profile="A40-48Q"))[0] == 2
    layout_pools = pool_map(s)
    real, inside = tenancy.pool_changes, []

    def racing(*a, **k):
        got = real(*a, **k)
        if inside:                  # apply's first call only (set_pools asks again)
            return got
        try:
            with deadline(time.monotonic() + 0.5):
                inside.append(rebalance.rebalance(host, StateStore(host.state_dir), rebalance.load_bounds(host)))
        except TransientError as e:
            inside.append(e)
        return got

    monkeypatch.setattr(tenancy, "pool_changes", racing)
    code, out, err = run(capsys, host, "apply", "-c", str(cfg), "--yes")
    monkeypatch.setattr(tenancy, "pool_changes", real)
    assert code == 0, out + err
    [got] = inside
    assert isinstance(got, TransientError), got
    assert pool_map(s) == layout_pools and policy_of(host, GPU_HI) == "equal-share"
    assert run(capsys, host, "assert", "-c", str(cfg))[0] == 0
    assert run(capsys, host, "rebalance")[0] == 0           # after apply: the move is made whole
    moved = [g for g, p in pool_map(s).items() if p == "gold" and g != str(GPU_LO)]
    assert len(moved) == 1 and SimNvml(host).scheduler_state(moved[0]).policy == "fixed-share"


def test_a_pass_reads_the_refusals_of_its_window_by_the_audit_time_index(tmp_path):
    """Trial 10 retest N3: the refusals were read by scanning every one ever stored (joined to the audit
    row for its time) before the window's filter: 300,000 old ones cost 0.65 s a pass under the host lock.
    The window's audit rows are found by their time index, each refusal by its key (the plan SQLite makes
    for the statement the store runs)."""
    s = StateStore(tmp_path / "state")
    old = s.audit_refusal(actor="t", operation="admission d1 v1", value="v", domain_uuid="d1", device="v1",
                          code="capacity", profile="A40-8Q", qos="burstable", tenant="t")
    since = s.audit_rows()[-1].time
    new = s.audit_refusal(actor="t", operation="admission d2 v2", value="v", domain_uuid="d2", device="v2",
                          code="capacity", profile="A40-8Q", qos="burstable", tenant="t")
    assert [r[0] for r in s.refusal_records()] == [old, new]
    conn = s._conn()
    ran: list = []
    conn.set_trace_callback(ran.append)
    try:
        assert [r[0] for r in s.refusal_records(since=since)][-1] == new
    finally:
        conn.set_trace_callback(None)
    sql = next(q for q in ran if "admission_refusals" in q)
    plan = " ".join(str(row[-1]) for row in conn.execute("EXPLAIN QUERY PLAN " + sql))
    assert "audit_time" in plan and "SCAN r" not in plan and "SCAN admission_refusals" not in plan, plan
