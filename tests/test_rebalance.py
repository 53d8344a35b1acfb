"""Capacity that follows demand (issue 30, item 3): ``vgpuhost rebalance`` on simulated hosts.

A start refused on a full pool is what drives a move: the reconciler moves an empty GPU from an
idle pool, and the same start is then admitted.  Outcomes are read back from the simulated NVML
(scheduler policy), the state store (pools, journal) and the audit log.  The bounds (min/max,
quiet hours, changes per hour), the dry run, busy GPUs and guarantees each leave the host as it was.
"""

from __future__ import annotations

import calendar
import json
import time

import pytest

from vgpuhost.cli.main import main as cli_main
from vgpuhost.io.state import StateStore
from vgpuhost.model.errors import InputError
from vgpuhost.ops import rebalance, tenancy
from vgpuhost.policy import rebalance as pol
from vgpuhost.sim.nvml import SimNvml

from test_hook import GPU_HI, GPU_LO, L40S, mdev_gpu, mixed, start
from test_tenancy import tdom, uid


def run(capsys, host, *argv):
    code = cli_main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def policy_of(host, gpu) -> str:
    return SimNvml(host).scheduler_state(gpu).policy


def pool_map(s: StateStore) -> dict:
    return {g: p for g, p, _, _ in s.pool_rows()}


BASE = {str(GPU_LO): "gold", str(L40S): "batch"}


def gold_one(make_host, capsys, *, l40s_policy: bool = True):
    """Pool gold (fixed share, serves guaranteed) on GPU_LO, pool batch (best effort) on the L40S (its
    scheduler set too with ``l40s_policy``), GPU_HI in no declared pool (the default pool: burstable and
    best effort, equal share running); tenant g (guaranteed) holds gold's one A40-48Q.  ``(host, store)``."""
    host = mixed(make_host)
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_LO), "--policy", "fixed-share")[0] == 0
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "equal-share")[0] == 0
    if l40s_policy:
        assert run(capsys, host, "scheduler", "set", "--gpu", str(L40S), "--policy", "best-effort")[0] == 0
    s = StateStore(host.state_dir)
    tenancy.set_pools(s, [tenancy.adm.Pool("gold", "fixed-share", ("guaranteed",), (str(GPU_LO),)),
                          tenancy.adm.Pool("batch", "best-effort", ("best-effort",), (str(L40S),))])
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    assert start(host, "g0", tdom("g0", uid("10101010", 0), uid("20202020", 0), tenant="g",
                                  profile="A40-48Q")) == (0, "")
    return host, s


def gold_full(make_host, capsys, *, quota=None):
    """:func:`gold_one`, and tenant g's second start is refused for room."""
    host, s = gold_one(make_host, capsys)
    assert mdev_gpu(host, uid("20202020", 0)) == GPU_LO
    second = tdom("g1", uid("10101010", 1), uid("20202020", 1), tenant="g", profile="A40-48Q")
    rc, err = start(host, "g1", second)
    assert rc == 2 and "no room for vGPU A40-48Q of tenant 'g'" in err, err
    return host, s, second


def test_a_refused_start_moves_an_empty_gpu_and_the_same_start_then_succeeds(make_host, capsys):
    host, s, second = gold_full(make_host, capsys)
    assert pool_map(s) == BASE
    code, out, err = run(capsys, host, "--json", "rebalance")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "vgpuhost.rebalance/v1" and doc["changed"] is True and not doc["dry_run"]
    [move] = doc["moves"]
    assert (move["gpu"], move["from_pool"], move["to_pool"], move["policy"], move["done"]) == \
        (str(GPU_HI), "default", "gold", "fixed-share", True)
    assert "1 start(s) of A40-48Q (guaranteed; g) refused" in move["reason"]
    # read back: the GPU runs gold's policy, is recorded in gold, and the audit row names the demand
    assert policy_of(host, GPU_HI) == "fixed-share"
    assert pool_map(s) == dict(BASE, **{str(GPU_HI): "gold"})
    [row] = [r for r in s.audit_rows() if r.path == "(pools)" and r.operation.startswith("rebalance move")]
    assert row.result == "ok" and "pool default -> gold" in row.value and "A40-48Q (guaranteed; g)" in row.value
    nvml_rows = [r for r in s.audit_rows() if r.operation == f"rebalance move {GPU_HI}" and r.path.startswith("nvml:")]
    assert len(nvml_rows) == 1 and nvml_rows[0].result == "ok"
    entries = [e for e in s.journal_entries() if e.kind == "rebalance"]
    assert len(entries) == 1 and entries[0].state == "closed" and entries[0].done == 2
    assert not s.journal_entries(open_only=True)
    # the same start is now admitted, on the moved GPU
    assert start(host, "g1", second) == (0, "")
    assert mdev_gpu(host, uid("20202020", 1)) == GPU_HI
    # demand served: a second run moves nothing and holds nothing (the move answered that refusal)
    code, out, _ = run(capsys, host, "--json", "rebalance")
    doc = json.loads(out)
    assert code == 0 and doc["moves"] == [] and doc["held"] == [], doc
    assert {d["pool"]: d["refused"] for d in doc["demand"]} == {"gold": 0, "batch": 0}


def test_one_refused_start_moves_one_gpu_not_one_a_pass():
    """Two empty GPUs could serve gold; the one refused start moves one, and the next pass none."""
    from vgpuhost.policy.admission import Pool
    refused = [pol.Refusal("2026-12-07T03:00:00+00:00", "A40-48Q", "g", "guaranteed", "capacity")]
    assert pol.pending(refused, {}) == refused
    assert pol.pending(refused, {("a40-48q", "guaranteed"): "2026-12-07T03:00:01+00:00"}) == []
    assert pol.pending(refused, {("a40-48q", "burstable"): "2026-12-07T03:00:01+00:00"}) == refused
    line = "GPU 0000:81:00.0: pool default -> gold: 1 start(s) of A40-48Q (guaranteed; g) refused for room"
    assert pol.served_by(line) == ("a40-48q", "guaranteed") and pol.served_by("pool gold has no empty GPU") is None
    gpus = [pol.GpuFacts(f"0000:0{i}:00.0", "holds 1 device(s)" if i == 1 else "", ("a40-48q",), 49152)
            for i in (1, 2, 3)]
    pools = [Pool("gold", "fixed-share", ("guaranteed",), ("0000:01:00.0",))]
    args = dict(pools=pools, gpus=gpus, refusals=refused, tenants={}, held=(), host_gpus=(), bounds=pol.Bounds(),
                minute_of_day=0, moves_last_hour=0)
    d = pol.decide(**args)
    assert [m.gpu for m in d.moves] == ["0000:02:00.0"] and d.moves[0].serves == 1
    # gold has an empty GPU now (its VM stopped since the refusal): nothing to move, nothing held
    gpus[0] = pol.GpuFacts("0000:01:00.0", "", ("a40-48q",), 49152)
    d = pol.decide(**args)
    assert not d.moves and not d.held


def test_dry_run_changes_nothing(make_host, capsys):
    host, s, _ = gold_full(make_host, capsys)
    rows, pools = len(s.audit_rows()), pool_map(s)
    code, out, err = run(capsys, host, "rebalance", "--dry-run")
    assert code == 0, err
    assert f"would move GPU {GPU_HI}: pool default -> gold" in out
    assert f"1. set the vGPU scheduler of {GPU_HI} to fixed share" in out and "2. record GPU" in out, out
    assert policy_of(host, GPU_HI) == "equal-share" and pool_map(s) == pools and len(s.audit_rows()) == rows
    assert not [e for e in s.journal_entries() if e.kind == "rebalance"]


def test_a_busy_gpu_is_never_moved(make_host, capsys):
    host, s, _ = gold_full(make_host, capsys)
    # a domain with no tenant takes GPU_HI (the default pool serves best effort)
    assert start(host, "b0", tdom("b0", uid("30303030", 0), uid("40404040", 0), profile="A40-8Q")) == (0, "")
    assert mdev_gpu(host, uid("40404040", 0)) == GPU_HI
    code, out, err = run(capsys, host, "--json", "rebalance")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["moves"] == [] and doc["changed"] is False
    assert any("no other pool has an empty GPU offering a40-48q" in h for h in doc["held"]), doc["held"]
    assert policy_of(host, GPU_HI) == "equal-share" and pool_map(s) == BASE


def test_a_move_that_would_break_a_guarantee_is_not_made(make_host, capsys):
    host, s, _ = gold_full(make_host, capsys)
    # tenant b (burstable) is guaranteed one vGPU: only the default pool's GPU_HI serves burstable
    tenancy.add(s, tenancy.Tenant("b", quota=tenancy.Quota(tenancy.Limits(vgpus=1), tenancy.Limits())))
    code, out, err = run(capsys, host, "--json", "rebalance")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["moves"] == []
    assert any("guarantee of tenant 'b'" in h for h in doc["held"]), doc["held"]
    assert policy_of(host, GPU_HI) == "equal-share" and pool_map(s) == BASE


@pytest.mark.parametrize("config, held", [
    ("pools: {default: {min: 1}}", "pool default is at its minimum of 1 GPU(s)"),
    ("pools: {gold: {max: 1}}", "pool gold is at its maximum of 1 GPU(s)"),
    ("changes_per_hour: 0", "changes per hour: 0 made in the last hour, at most 0"),
    ("quiet_hours: NOW", "(UTC): no change now"),
])
def test_bounds_hold_the_move(make_host, capsys, tmp_path, config, held):
    host, s, _ = gold_full(make_host, capsys)
    cfg = tmp_path / "rebalance.yaml"
    now = time.gmtime(time.time() - 60)
    later = time.gmtime(time.time() + 600)           # quiet hours around now (wrapping midnight too)
    config = config.replace("NOW", f"'{now.tm_hour:02d}:{now.tm_min:02d}-{later.tm_hour:02d}:{later.tm_min:02d}'")
    cfg.write_text("version: 1\n" + config + "\n")
    code, out, err = run(capsys, host, "--json", "rebalance", "-c", str(cfg))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["moves"] == [] and any(held in h for h in doc["held"]), doc["held"]
    assert policy_of(host, GPU_HI) == "equal-share" and pool_map(s) == BASE


def test_the_rate_bound_counts_the_moves_of_the_last_hour(make_host, capsys, tmp_path):
    host, s, _ = gold_full(make_host, capsys)
    cfg = tmp_path / "rebalance.yaml"
    cfg.write_text("version: 1\nchanges_per_hour: 1\n")
    assert run(capsys, host, "rebalance", "-c", str(cfg))[0] == 0
    assert pool_map(s)[str(GPU_HI)] == "gold"
    # more demand for a burstable pool: the one move of this hour is spent
    b = tdom("b1", uid("50505050", 0), uid("60606060", 0), tenant=None, profile="A40-48Q")
    rc, _ = start(host, "b1", b)
    assert rc == 2
    doc = json.loads(run(capsys, host, "--json", "rebalance", "-c", str(cfg))[1])
    assert doc["moves"] == [] and any("at most 1" in h for h in doc["held"]), doc["held"]


def test_quiet_hours_are_read_as_utc_minutes():
    b = pol.parse_bounds({"quiet_hours": "22:00-06:00"})
    assert b.quiet == (22 * 60, 6 * 60)
    assert b.in_quiet(23 * 60) and b.in_quiet(0) and b.in_quiet(5 * 60 + 59)
    assert not b.in_quiet(6 * 60) and not b.in_quiet(12 * 60) and not b.in_quiet(21 * 60 + 59)


@pytest.mark.parametrize("doc, words", [
    ({"pools": {"gold": {"min": 3, "max": 2}}}, "pools.gold.min 3 is above its max 2"),
    ({"quiet_hours": "25:00-06:00"}, "quiet_hours must be HH:MM-HH:MM (UTC), not '25:00-06:00'"),
    ({"quiet_hours": "06:00-06:00"}, "is empty"),
    ({"changes_per_hour": -1}, "changes_per_hour must be a whole number from 0 to 60, not -1"),
    ({"agent": {"enabled": "yes"}}, "agent.enabled must be true or false"),
    ({"agent": {"interval_s": 1}}, "agent.interval_s must be a whole number from 10 to 86400"),
    ({"pool": {}}, "unknown key 'pool'"),
    ({"pools": {"gold": {"minimum": 1}}}, "pools.gold must be a mapping of min and max"),
])
def test_bounds_are_validated_with_one_line(doc, words):
    with pytest.raises(InputError) as e:
        pol.parse_bounds(doc, "r.yaml")
    assert words in e.value.message and "\n" not in e.value.message and e.value.message.startswith("r.yaml: ")


def test_a_bad_config_is_refused_by_the_cli_with_nothing_changed(make_host, capsys, tmp_path):
    host, s, _ = gold_full(make_host, capsys)
    cfg = tmp_path / "rebalance.yaml"
    cfg.write_text("version: 1\npools: {gold: {min: 2, max: 1}}\n")
    rows = len(s.audit_rows())
    code, _, err = run(capsys, host, "rebalance", "-c", str(cfg))
    assert code == 2 and err.count("\n") == 1 and "pools.gold.min 2 is above its max 1" in err
    assert len(s.audit_rows()) == rows and pool_map(s) == BASE


def test_the_default_config_file_is_read(make_host, capsys):
    host, s, _ = gold_full(make_host, capsys)
    path = host.etc("vgpuhost", "rebalance.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("version: 1\nagent: {enabled: true, interval_s: 60}\npools: {gold: {max: 1}}\n")
    b = rebalance.load_bounds(host)
    assert b.enabled and b.interval_s == 60 and b.bound("GOLD").max == 1
    doc = json.loads(run(capsys, host, "--json", "rebalance", "--dry-run")[1])
    assert doc["moves"] == [] and doc["bounds"]["pools"]["gold"]["max"] == 1


def test_trend_marks_a_full_pool_whose_use_rises():
    assert pol.Trend(7200, 3600).rising and not pol.Trend(3600, 3600).rising and not pol.Trend(0, 0).rising
    assert calendar.timegm(time.gmtime(0)) == 0


# ---------------------------------------------------------------------------
# kill -9 at each step of a move, then reconcile: the host is before or after, never half-moved

def _state(host) -> tuple:
    s = StateStore(host.state_dir, create=False)
    try:
        return pool_map(s).get(str(GPU_HI), "default"), policy_of(host, GPU_HI), s.journal_entries(open_only=True)
    finally:
        s.close()


def test_kill_at_each_step_of_a_move_leaves_it_before_or_after(make_host, capsys, tmp_path):
    kill_sweep(make_host, capsys, tmp_path, lambda mh: gold_full(mh, capsys)[0])


def test_kill_at_each_step_of_a_forecast_move_leaves_it_before_or_after(make_host, capsys, tmp_path):
    """The same sweep on a move the forecast alone drove (no start refused: tests/test_rebalance_forecast.py's
    host)."""
    from test_rebalance_forecast import forecast_host
    kill_sweep(make_host, capsys, tmp_path, lambda mh: forecast_host(mh, capsys))


def kill_sweep(make_host, capsys, tmp_path, build):
    """Kill a move of GPU_HI from the default pool (equal share) to gold (fixed share) on the host
    ``build(make_host)`` makes at every NVML write and step boundary; each kill leaves the host before
    or after the move once ``reconcile`` has run, and the next pass ends it moved."""
    import os
    import signal

    from test_crash import copies, cli_op, run as crash_run

    fresh = copies(make_host, build, tmp_path)
    capsys.readouterr()

    def move(host, kill_after=None):
        def op() -> int:
            def progress(i, n, step, state):
                if (i, state) == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
            s = StateStore(host.state_dir)
            r = rebalance.rebalance(host, s, pol.Bounds(), progress=progress)
            return 0 if r.done else 9
        return op

    before, after = ("default", "equal-share"), ("gold", "fixed-share")
    # the kill points: each NVML write (the simulated kernel's counter), before and after it lands, and
    # each step boundary the journal sees (entry open, nothing run; each step done, the entry not closed)
    host = fresh()
    log = tmp_path / "count.log"
    assert crash_run(host, move(host), log) == 0 and _state(host)[:2] == after
    writes = len(open(log).read().splitlines())
    assert writes == 1                                   # the scheduler set; the pool record is the store's
    points = [("write", n, when) for n in range(1, writes + 1) for when in ("before", "after")]
    points += [("step", (0, "start"), None), ("step", (1, "done"), None), ("step", (2, "done"), None)]
    seen = set()
    for kind, where, when in points:
        host = fresh()
        log = tmp_path / f"k-{len(seen)}.log"
        if kind == "write":
            rc = crash_run(host, move(host), log, kill_at=where, when=when)
        else:
            rc = crash_run(host, move(host, kill_after=where), log)
        assert rc == -9, (kind, where, when, rc)
        pool, policy, open_entries = _state(host)
        assert any(e.kind == "rebalance" for e in open_entries), (kind, where, when)     # interrupted: left open
        assert crash_run(host, cli_op(host, "reconcile"), log) in (0, 1)
        assert crash_run(host, cli_op(host, "reconcile", "--check"), log) == 0, (kind, where, when)
        pool, policy, open_entries = _state(host)
        assert (pool, policy) in (before, after), (kind, where, when, pool, policy)
        assert not open_entries
        seen.add((pool, policy))
        # the reconciler's next run finishes the move from wherever the host was left
        assert crash_run(host, move(host), log) in (0, 9)
        assert _state(host)[:2] == after, (kind, where, when)
        s = StateStore(host.state_dir, create=False)
        rolled = [e for e in s.journal_entries() if e.kind == "rebalance" and e.state in ("finished", "rolled-back")]
        s.close()
        assert len(rolled) == 1, (kind, where, when)
    assert seen == {before, after}, seen            # both ends are reached by some kill point


# ---------------------------------------------------------------------------
# the agent runs the same reconciler when its config turns it on

def test_the_agent_runs_the_reconciler_when_its_config_turns_it_on(make_host, capsys):
    from agentutil import ADMIN_GID, RO_GID, socket_dir
    from vgpuhost.agent import server

    host, s, second = gold_full(make_host, capsys)
    proc = server.open_agent(host, socket_dir=socket_dir(), admin_group=ADMIN_GID, ro_group=RO_GID)
    try:
        assert proc.agent.rebalancer is None                 # no config: off
    finally:
        proc.stop()
    # stopped without being started: no thread is left waiting on an accept loop that never ran
    # (socketserver's shutdown() would wait forever, and a later fork in this process would copy it)
    import threading
    assert [t.name for t in threading.enumerate() if "shutdown" in t.name] == []
    path = host.etc("vgpuhost", "rebalance.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("version: 1\nagent: {enabled: true, interval_s: 900}\n")
    proc = server.open_agent(host, socket_dir=socket_dir(), admin_group=ADMIN_GID, ro_group=RO_GID)
    proc.start()
    try:
        r = proc.agent.rebalancer
        assert r is not None and r.thread.is_alive() and r.interval_s == 900
        doc = r.run_once()                                   # what the loop runs each interval
        assert doc["changed"] is True and [m["gpu"] for m in doc["moves"]] == [str(GPU_HI)]
        assert pool_map(s)[str(GPU_HI)] == "gold" and policy_of(host, GPU_HI) == "fixed-share"
        [row] = [r for r in s.audit_rows() if r.operation.startswith("rebalance move") and r.path == "(pools)"]
        assert row.actor == "agent rebalance"
    finally:
        proc.stop()
    assert not r.thread.is_alive() and r.run_once() is None    # stopped: no run starts
    assert start(host, "g1", second) == (0, "")
    # a config that is not valid keeps the agent from starting, with one line naming the field
    path.write_text("version: 1\nagent: {enabled: true, interval_s: 5}\n")
    with pytest.raises(InputError) as e:
        server.open_agent(host, socket_dir=socket_dir(), admin_group=ADMIN_GID, ro_group=RO_GID)
    assert "agent.interval_s must be a whole number from 10 to 86400, not 5" in e.value.message


# ---------------------------------------------------------------------------
# the trend over the metered history

def test_facts_read_each_pools_allocated_time_over_two_trend_windows(make_host, capsys):
    from vgpuhost.io import state as st
    from vgpuhost.model.usage import UsageRow
    host, s, _ = gold_full(make_host, capsys)
    now = time.time()

    def hour(back_h: float) -> str:
        return time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now - back_h * 3600))

    def row(h, dev, gpu, alloc):
        return UsageRow(hour(h), dev, "dom-" + dev, "vgpu", gpu, "A40-48Q", "", "g", "guaranteed", alloc,
                        alloc / 3, 0, 0, 0, 0, 1)
    with s.transaction() as conn:
        st.add_usage(conn, [row(1, "a", str(GPU_LO), 3600.0), row(2, "b", str(GPU_LO), 3600.0),
                            row(8, "c", str(GPU_LO), 1800.0), row(3, "d", str(GPU_HI), 600.0),
                            row(9, "e", str(GPU_HI), 1200.0), row(20, "f", str(GPU_HI), 9999.0)])
    f = rebalance.facts(host, s, pol.Bounds(trend_hours=6), now_s=now)
    assert f.trends["gold"] == pol.Trend(7200.0, 1800.0) and f.trends["gold"].rising
    assert f.trends["default"] == pol.Trend(600.0, 1200.0) and not f.trends["default"].rising   # 20 h ago: out
    busy = {g.gpu: g.busy for g in f.gpus}
    assert busy[str(GPU_LO)] == "holds 1 device(s)" and busy[str(GPU_HI)] == "" and busy[str(L40S)] == ""
    assert [(r.profile, r.tenant, r.qos, r.code) for r in f.refusals] == [("A40-48Q", "g", "guaranteed", "capacity")]


def test_a_pressed_pool_gets_an_empty_gpu_from_a_pool_that_keeps_one():
    from vgpuhost.policy.admission import Pool
    gpus = [pol.GpuFacts("0000:01:00.0", "holds 1 device(s)", ("a40-8q",), 49152),
            pol.GpuFacts("0000:02:00.0", "", ("a40-8q",), 49152),
            pol.GpuFacts("0000:03:00.0", "", ("a40-8q",), 49152)]
    pools = [Pool("gold", "fixed-share", ("guaranteed",), ("0000:01:00.0",)),
             Pool("std", "equal-share", ("burstable",), ("0000:02:00.0", "0000:03:00.0"))]
    args = dict(pools=pools, gpus=gpus, refusals=(), tenants={}, held=(), host_gpus=(), bounds=pol.Bounds(),
                minute_of_day=600, moves_last_hour=0)
    d = pol.decide(**args, trends={"gold": pol.Trend(7200, 3600)})
    [m] = d.moves
    assert (m.gpu, m.from_pool, m.to_pool, m.policy) == ("0000:02:00.0", "std", "gold", "fixed-share")
    assert "pool gold has no empty GPU and its allocated time rose from 1.0 h to 2.0 h" in m.reason
    # not rising: nothing; std rising too with only its spare to give: held
    assert not pol.decide(**args, trends={"gold": pol.Trend(3600, 3600)}).moves
    one = dict(args, pools=[pools[0], Pool("std", "equal-share", ("burstable",), ("0000:02:00.0",)),
                            Pool("be", "best-effort", ("best-effort",), ("0000:03:00.0",))])
    d = pol.decide(**one, trends={"gold": pol.Trend(7200, 3600)})
    assert not d.moves and d.held


def test_a_move_whose_nvml_write_finds_the_gpu_lost_marks_it_unhealthy(make_host, capsys):
    """The move's scheduler write answers GPU_IS_LOST (``sim fail --write-errno EIO``): the move fails and is
    undone, and the GPU is recorded unhealthy (source nvml) by the same classification as every device write."""
    host, s, second = gold_full(make_host, capsys)
    assert run(capsys, host, "sim", "fail", str(GPU_HI), "--write-errno", "EIO")[0] == 0
    code, out, err = run(capsys, host, "--json", "rebalance")
    doc = json.loads(out)
    assert [m["done"] for m in doc["moves"]] == [False], doc
    assert "GPU_IS_LOST" in " ".join(doc["failed"]) or "GpuIsLost" in " ".join(doc["failed"]), doc["failed"]
    assert "the GPU is marked unhealthy" in " ".join(doc["failed"])
    assert [(r[0], r[2]) for r in s.gpu_health_rows()] == [(str(GPU_HI), "nvml")]
    assert pool_map(s) == BASE and policy_of(host, GPU_HI) == "equal-share"


def test_the_reconciler_reads_the_refusal_admission_stored_not_the_rows_wording(make_host, capsys):
    """Admission stores each start it refused in its own columns beside the audit row (domain, device,
    code, profile, class, tenant); the reconciler reads those, not the row's value (whose tail is for the
    reader only).  A field admission could not have written (an unknown tenant, a class that is none, a
    code that is no demand for room) is no demand."""
    host, s, second = gold_full(make_host, capsys)
    [row] = [r for r in s.audit_rows() if r.path == rebalance.ADMISSION_PATH and r.result == "refused"]
    assert row.value.endswith("; refusal=capacity profile=A40-48Q qos=guaranteed tenant=g"), row.value
    [rec] = s.refusal_records()
    assert rec == (row.id, row.time, uid("10101010", 1), uid("20202020", 1), "capacity", "A40-48Q",
                   "guaranteed", "g"), rec
    at = "2026-12-07T03:00:00+00:00"
    known = {"g": "guaranteed"}
    assert pol.refusal_of(at, "capacity", "A40-48Q", "guaranteed", "g", known, "d") == \
        pol.Refusal(at, "A40-48Q", "g", "guaranteed", "capacity", "d")
    assert pol.refusal_of(at, "gpu-time", "L40S-4Q", "best-effort", None, {}) == \
        pol.Refusal(at, "L40S-4Q", None, "best-effort", "gpu-time")
    assert pol.refusal_of(at, "capacity", "A40-48Q", "", "g", known) == \
        pol.Refusal(at, "A40-48Q", "g", "guaranteed", "capacity")         # no class stored: the tenant's
    assert pol.refusal_of(at, "quota", "A40-48Q", "guaranteed", "g", known) is None
    assert pol.refusal_of(at, "capacity", "A40-48Q", "guaranteed", "nobody", known) is None
    assert pol.refusal_of(at, "capacity", "A40-48Q", "gold-plated", "g", known) is None
    assert pol.refusal_of(at, "capacity", "A40-48Q x=1", "guaranteed", "g", known) is None


TIERS = """version: 1
layouts:
  tiers:
    gpus:
      - select: {address: "0000:41:00.0"}
        mode: vgpu
        vgpu: {types: {A40-48Q: 1}}
        scheduler: {policy: fixed-share}
        pool: {name: gold, serves: [guaranteed]}
      - select: {address: "0000:a1:00.0"}
        mode: vgpu
        vgpu: {types: {L40S-4Q: 1}}
        scheduler: {policy: best-effort}
        pool: {name: batch, serves: [best-effort]}
"""


def test_apply_puts_a_moved_gpu_back_and_assert_and_apply_say_the_reconciler_moved_it(make_host, capsys, tmp_path):
    """The layout's pools win: after a move, assert names the moved GPU as moved by the reconciler and
    apply records the layout's pools again, saying it puts that GPU back; the move's mark is gone then."""
    host = mixed(make_host)
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "equal-share")[0] == 0
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text(TIERS)
    code, out, err = run(capsys, host, "apply", "-c", str(cfg))
    assert code == 0, out + err
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    assert start(host, "g0", tdom("g0", uid("10101010", 0), uid("20202020", 0), tenant="g",
                                  profile="A40-48Q")) == (0, "")
    rc, err = start(host, "g1", tdom("g1", uid("10101010", 1), uid("20202020", 1), tenant="g", profile="A40-48Q"))
    assert rc == 2, err
    code, out, err = run(capsys, host, "assert", "-c", str(cfg))
    assert code == 0, out + err
    assert run(capsys, host, "rebalance")[0] == 0
    assert pool_map(s)[str(GPU_HI)] == "gold"
    assert s.settings_under("rebalance.moved.") == {f"rebalance.moved.{GPU_HI}": "default -> gold"}
    code, out, err = run(capsys, host, "assert", "-c", str(cfg))
    assert code != 0
    assert (f"GPU {GPU_HI}: out of pool gold (the capacity reconciler moved it, pool default -> gold; "
            "apply puts it back: the layout's pools win)") in out + err, out + err
    code, out, err = run(capsys, host, "apply", "-c", str(cfg))
    assert code == 0, out + err
    assert f"GPU {GPU_HI}: out of pool gold (the capacity reconciler moved it, pool default -> gold; put back" \
        in out + err, out + err
    assert pool_map(s) == BASE and s.settings_under("rebalance.moved.") == {}
    assert run(capsys, host, "assert", "-c", str(cfg))[0] == 0


def test_an_undone_move_leaves_no_mark(make_host, capsys):
    from vgpuhost.plan.rebalance import RecordPool
    from vgpuhost.plan.executor import StepContext
    host, s, _ = gold_full(make_host, capsys)
    step = RecordPool(str(GPU_HI), "gold", "fixed-share", ("guaranteed",), "default", "", (), "1 start(s)")
    ctx = StepContext(host, s, actor="t", operation="rebalance")
    step.run(ctx)
    assert s.settings_under("rebalance.moved.") == {f"rebalance.moved.{GPU_HI}": "default -> gold"}
    step.inverse(None).run(ctx)
    assert s.settings_under("rebalance.moved.") == {} and pool_map(s) == BASE


def test_a_gpu_moved_for_a_refused_start_is_no_donor_until_that_start_retries(make_host, capsys):
    """Trial 5 finding 10, over several passes: the GPU moved into gold for g1's refused start is not
    given away to answer a best-effort refusal on the next passes (held, naming the hold-down), g1's
    retry then lands on it; an unanswered move's GPU is a donor again once the window has passed."""
    host, s, second = gold_full(make_host, capsys)
    bounds = pol.Bounds()
    r = rebalance.rebalance(host, s, bounds)
    assert [(m.gpu, m.to_pool) for m in r.done] == [(str(GPU_HI), "gold")]
    # a best-effort start with no tenant is refused now (the default pool gave its GPU away)
    rc, err = start(host, "b0", tdom("b0", uid("30303030", 0), uid("40404040", 0), profile="A40-48Q"))
    assert rc == 2 and "no room for vGPU A40-48Q of a domain without a tenant" in err, err
    for _ in range(3):                              # pass after pass: no ping-pong
        r = rebalance.rebalance(host, s, bounds)
        assert r.decision.moves == () and r.done == []
        assert any(f"GPU {GPU_HI} was moved to pool gold at" in h and "retry first" in h for h in r.decision.held), \
            r.decision.held
    assert pool_map(s)[str(GPU_HI)] == "gold" and policy_of(host, GPU_HI) == "fixed-share"
    assert len([x for x in s.audit_rows() if x.path == "(pools)" and x.operation.startswith("rebalance move")]) == 1
    # past the window, with g1 never retried: the GPU may serve the best-effort demand (refused later)
    later = time.time() + bounds.window_min * 60 + 60
    f = rebalance.facts(host, s, bounds, now_s=later)
    assert f.moved == {}
    assert start(host, "g1", second) == (0, "")      # g1's retry: on the GPU moved for it
    assert mdev_gpu(host, uid("20202020", 1)) == GPU_HI


def test_an_empty_gpu_in_mixed_size_mode_is_not_moved_into_a_fixed_share_pool(make_host, capsys):
    """Trial 5 finding 13: the decision holds the move (the dry run promises nothing), the real run
    changes nothing and exits 0; the GPU out of mixed-size mode moves."""
    host, s, _ = gold_full(make_host, capsys)
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "best-effort")[0] == 0
    assert run(capsys, host, "vgpu", "mode", "--gpu", str(GPU_HI), "--mixed-size", "on")[0] == 0
    rows = len(s.audit_rows())
    for argv in (("rebalance", "--dry-run"), ("rebalance",)):
        code, out, err = run(capsys, host, *argv)
        assert code == 0, err
        assert "move GPU" not in out
        assert (f"held: 1 start(s) of A40-48Q (guaranteed; g) refused for room in the last 60 min (capacity); pool "
                f"gold serves them: GPU {GPU_HI} is in mixed-size mode, and pool gold is fixed-share") in out, out
    assert len(s.audit_rows()) == rows and pool_map(s) == BASE and policy_of(host, GPU_HI) == "best-effort"
    assert not [e for e in s.journal_entries() if e.kind == "rebalance"]
    assert run(capsys, host, "vgpu", "mode", "--gpu", str(GPU_HI), "--mixed-size", "off")[0] == 0
    code, out, _ = run(capsys, host, "rebalance")
    assert code == 0 and f"moved GPU {GPU_HI}: pool default -> gold" in out, out
    assert policy_of(host, GPU_HI) == "fixed-share"


def test_the_hold_down_covers_a_gpu_only_while_it_stays_in_the_pool_it_was_moved_to():
    from vgpuhost.policy.admission import Pool
    refused = [pol.Refusal("2026-12-07T03:00:00+00:00", "A40-48Q", None, "best-effort", "capacity")]
    gpus = [pol.GpuFacts("0000:01:00.0", "", ("a40-48q",), 49152)]
    args = dict(pools=[Pool("gold", "fixed-share", ("guaranteed",), ("0000:01:00.0", "0000:02:00.0")),
                       Pool("batch", "best-effort", ("best-effort",), ("0000:03:00.0",))],
                gpus=gpus + [pol.GpuFacts(f"0000:0{i}:00.0", "holds 1 device(s)", ("a40-48q",), 49152) for i in (2, 3)],
                refusals=refused, tenants={}, held=(), host_gpus=(), bounds=pol.Bounds(), minute_of_day=0,
                moves_last_hour=0)
    assert [(m.gpu, m.to_pool) for m in pol.decide(**args).moves] == [("0000:01:00.0", "batch")]
    held = pol.decide(**args, moved={"0000:01:00.0": ("2026-12-07T02:59:00+00:00", "gold")})
    assert not held.moves and "was moved to pool gold at 2026-12-07T02:59:00" in held.held[0]
    elsewhere = pol.decide(**args, moved={"0000:01:00.0": ("2026-12-07T02:59:00+00:00", "default")})
    assert [m.gpu for m in elsewhere.moves] == ["0000:01:00.0"]      # put back by a layout since: no hold
    assert pol.moved_to("GPU 0000:81:00.0: pool default -> gold: 1 start(s) of A40-48Q") == ("0000:81:00.0", "gold")
