"""One decision per start (issue 26, findings 1, 4 and 7).

- Concurrent starts through the real hook handler, in real processes, with the agent down: admission
  decides under the host lock on facts read under it, every ``admitted`` row has its allocation and its
  vGPU, every exit matches its row, and admitted rows == allocations == vGPUs.
- A refusal of the device layer's re-check is said in admission's terms, and its one admission row reads
  ``refused``; a domain whose second vGPU is refused leaves one ``refused`` row, no ``admitted`` one.
- Refusals name the tenant, its quota and use, never the requesting domain as what would free room, and
  hints name only changes that would admit.
- A kill at every write of ``prepare begin`` with a tenant: after one ``reconcile`` every device the
  domain holds has its allocation row with the tenant, and every allocation row its device.
- ``tenant add|set|remove`` write their audit row in the change's transaction.
"""

from __future__ import annotations

import io
import os
import signal
from typing import Dict, List

import pytest

from vgpuhost.hook import runtime as hook
from vgpuhost.io.state import StateStore
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.ops import tenancy
from vgpuhost.policy import admission as adm
from vgpuhost.model.tenancy import Limits as L

from test_admission import G1, OWNER_A, OWNER_B, held, offers, tenant, vreq
from test_crash import check_host, cli_op, hook_op, kill_everywhere, retry_without_reconcile, run
from test_hook import GPU_HI, GPU_LO, bind_as_asked, domain_xml, mdev_gpu, mdev_hostdev, mdevs, mixed, start, stop
from test_tenancy import tdom, uid


def bound(host, xml: str) -> str:
    """``xml``, its domain bound by the operator to the tenant its metadata names (issue 28)."""
    bind_as_asked(host, xml)
    return xml


def store_of(host) -> StateStore:
    return StateStore(host.state_dir)


def admission_rows(s: StateStore):
    return [r for r in s.audit_rows() if r.path == "(admission)"]


def two_vgpu_xml(name: str, dom: str, devs, tenant_name: str, profile: str = "A40-8Q", gpus=(None, None)) -> str:
    meta = Metadata(tenant=tenant_name, vgpus=[VgpuRequest(profile, uuid=d, gpu=g) for d, g in zip(devs, gpus)])
    return domain_xml(name, dom, meta, [mdev_hostdev(d) for d in devs])


# ---------------------------------------------------------------------------
# 1. concurrent starts, agent down

def _fork_starts(host, jobs) -> Dict[str, int]:
    """Run ``prepare begin`` of each ``(name, xml)`` in its own forked process, all released at once;
    ``{name: exit code}``."""
    import threading
    assert threading.active_count() == 1, "a fork copies the locks other threads hold"
    gate_r, gate_w = os.pipe()
    pids = {}
    for name, xml in jobs:
        pid = os.fork()
        if pid == 0:                                # the child: never returns
            code = 4
            try:
                os.close(gate_w)
                os.read(gate_r, 1)                  # every child waits here until the gate opens
                code = hook.main([name, "prepare", "begin", "-"], io.BytesIO(xml.encode()), io.StringIO(),
                                 host=host)
            finally:
                os._exit(code if isinstance(code, int) else 4)
        pids[pid] = name
    os.close(gate_r)
    os.close(gate_w)                                # EOF: every child reads it at once
    out = {}
    for pid, name in pids.items():
        _, status = os.waitpid(pid, 0)
        out[name] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return out


def test_concurrent_starts_decide_once_under_the_lock_and_every_row_matches_its_exit(make_host):
    host = mixed(make_host)
    s = store_of(host)
    # three tenants asking mixed sizes: equal-size mode lets each A40 take one size only
    for name in ("red", "blue", "green"):
        tenancy.add(s, tenancy.Tenant(name, quota=tenancy.Quota(L(vgpus=3), L(vgpus=4))))
    sizes = {"red": "A40-4Q", "blue": "A40-2Q", "green": "A40-8Q"}
    jobs, devs = [], {}
    for i in range(12):
        t = ("red", "blue", "green")[i % 3]
        name = f"c{i}"
        devs[name] = uid("c0c0c0c0", i)
        jobs.append((name, tdom(name, uid("d0d0d0d0", i), devs[name], tenant=t, profile=sizes[t],
                                strategy=("first-fit", "spread")[i % 2])))
    for _, xml in jobs:
        bind_as_asked(host, xml)        # the operator binds each domain to its tenant (issue 28)
    codes = _fork_starts(host, jobs)
    assert set(codes.values()) <= {0, 2}, codes
    rows = admission_rows(s)
    allocs = {r[0]: r for r in s.allocation_rows()}
    present = mdevs(host)
    problems: List[str] = []
    for name, rc in codes.items():
        mine = [r for r in rows if r.operation.endswith(devs[name])]
        if len(mine) != 1:
            problems.append(f"{name}: {len(mine)} admission rows")
            continue
        want = "admitted" if rc == 0 else "refused"
        if mine[0].result != want:
            problems.append(f"{name}: exit {rc} but its row reads {mine[0].result}: {mine[0].value}")
        if (rc == 0) != (devs[name] in allocs) or (rc == 0) != (devs[name] in present):
            problems.append(f"{name}: exit {rc}, allocation {devs[name] in allocs}, vGPU {devs[name] in present}")
    assert not problems, "\n".join(problems)
    admitted = [r for r in rows if r.result == "admitted"]
    assert len(admitted) == len(allocs) == len(present) == sum(1 for c in codes.values() if c == 0) > 0
    # where admission placed each one is where it is
    for dev, row in allocs.items():
        assert str(mdev_gpu(host, dev)) == row[3]
    # equal-size mode held: one size per GPU
    by_gpu: Dict[str, set] = {}
    for dev, row in allocs.items():
        by_gpu.setdefault(row[3], set()).add(row[5])
    assert all(len(v) == 1 for v in by_gpu.values()), by_gpu


# ---------------------------------------------------------------------------
# 1. the device layer executes admission's decision; its refusal is admission's

def test_a_recheck_refusal_names_the_tenant_and_leaves_one_refused_row(make_host, monkeypatch):
    """Something outside admission takes the GPU admission chose (here: a vGPU of another size made by hand
    between the decision and the create, as a 'vgpu create' that takes no host lock could): the start
    exits 2 with admission's terms (tenant, quota, use), its one admission row reads refused, and no
    allocation is left."""
    from vgpuhost.ops import devices, vgpu
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, tenancy.Tenant("team", quota=tenancy.Quota(L(vgpus=2))))
    real = devices._make_vgpu

    def intruder(h, store, view, req, profile, allowed, actor, inv=None, narrowed_by="", decided=None):
        # a 2 GiB vGPU made by hand on the decided GPU: equal-size mode then refuses the 8Q there
        vgpu.create(h, store, profile="A40-2Q", gpu=decided, actor="intruder")
        return real(h, store, view, req, profile, allowed, actor, inv, narrowed_by, decided=decided)

    monkeypatch.setattr(devices, "_make_vgpu", intruder)
    dev = uid("e1e1e1e1", 0)
    rc, err = start(host, "vm", tdom("vm", uid("f1f1f1f1", 0), dev, tenant="team"))
    assert rc == 2 and err.count("\n") == 1, err
    assert "admission: vGPU A40-8Q of tenant 'team' (quota vGPUs 2, 0 in use) was admitted onto GPU" in err
    assert "no longer takes it" in err and "holds 2048 MiB vGPUs" in err
    [row] = admission_rows(s)
    assert row.result == "refused" and row.operation.endswith(dev)
    assert row.value.startswith("admitted vGPU A40-8Q for tenant 'team'")
    assert "-> not made, the start refused" in row.value
    assert not s.allocation_rows() and dev not in mdevs(host)


def test_a_domain_whose_second_vgpu_is_refused_leaves_one_refused_row(make_host):
    """Finding 7: quota 1, a domain asking for two vGPUs on two GPUs: one row (refused), not admitted then
    refused; and the remedy never names the domain being started."""
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, tenancy.Tenant("team", quota=tenancy.Quota(L(vgpus=1))))
    d0, d1 = uid("a2a2a2a2", 0), uid("a2a2a2a2", 1)
    xml = two_vgpu_xml("two", uid("b2b2b2b2", 0), (d0, d1), "team", gpus=(GPU_LO, GPU_HI))
    rc, err = start(host, "two", xml)
    assert rc == 2 and err.count("\n") == 1, err
    assert "quota vGPUs of tenant 'team': 1 in use + 1 asked > 1" in err
    assert "detach domain 'two'" not in err and "ask for fewer devices in this domain" in err
    rows = admission_rows(s)
    assert [(r.result, r.operation.endswith(d1)) for r in rows] == [("refused", True)]
    assert not s.allocation_rows() and not mdevs(host)


def test_a_failed_create_after_admission_voids_its_row(make_host):
    """A device write that fails (EIO on the chosen GPU, and on the one placed again: issue 27 retries a
    start once its GPU fails) after admission: exit 3, the start's admission row reads failed (the same
    row: one decision), no allocation row is left."""
    host = mixed(make_host, faults=f'{{op: create, device: "{GPU_LO}", errno: EIO, count: 0}}, '
                                   f'{{op: create, device: "{GPU_HI}", errno: EIO, count: 0}}')
    s = store_of(host)
    tenancy.add(s, tenancy.Tenant("team"))
    dev = uid("a3a3a3a3", 0)
    rc, err = start(host, "vm", tdom("vm", uid("b3b3b3b3", 0), dev, tenant="team"))
    assert rc == 3, err
    [row] = admission_rows(s)
    assert row.result == "failed" and "-> not made, the start failed" in row.value
    assert not s.allocation_rows() and not mdevs(host)


# ---------------------------------------------------------------------------
# 7. refusals and hints

def test_a_capacity_refusal_names_the_tenant_its_quota_and_use():
    ts = {"a": tenant("a", g={"vgpus": 2}, b={"vgpus": 3})}
    h = [held("x1", OWNER_A, "a", G1)]
    d = adm.admit(vreq(owner=OWNER_B, tenant="a"), tenants=ts, allocations=h, offers=offers(0, gpus=(G1,)))
    assert not d.admitted and d.code == "capacity"
    assert d.reason.startswith("no room for vGPU A40-8Q of tenant 'a' (quota vGPUs 2:3, 1 in use): "), d.reason
    d = adm.admit(vreq(owner=OWNER_B), tenants=ts, allocations=h, offers=offers(0, gpus=(G1,)))
    assert "of a domain without a tenant" in d.reason


def test_a_hint_never_names_a_removal_that_would_not_admit():
    """Finding 7: a guaranteed 8Q refused on a GPU holding a 4Q made by hand and two 4Q of another tenant's
    guarantee: removing the hand-made one leaves 4Q there (equal-size mode), so it is not suggested."""
    ts = {"a": tenant("a", g={"vgpus": 1}), "b": tenant("b", g={"vgpus": 2})}
    h = [held("m1", "manual", None, G1, profile="A40-4Q"), held("b1", OWNER_A, "b", G1, profile="A40-4Q"),
         held("b2", OWNER_A, "b", G1, profile="A40-4Q")]
    d = adm.admit(vreq(owner=OWNER_B, tenant="a"), tenants=ts, allocations=h, gpu_memory={G1: 49152},
                  offers=offers(0, gpus=(G1,)))
    assert not d.admitted and d.code == "capacity"
    assert "m1" not in d.one_line() and "made by hand" not in d.one_line()
    assert d.one_line().endswith("to free room: 'vgpuhost capacity' shows what fits where")
    # with the hand-made 4Q the only one there, removing it admits: then it is named
    d = adm.admit(vreq(owner=OWNER_B, tenant="a"), tenants=ts, allocations=h[:1], gpu_memory={G1: 49152},
                  offers=offers(0, gpus=(G1,)))
    assert "remove the vGPU A40-4Q m1 on 0000:41:00.0 made by hand ('vgpuhost vgpu remove m1')" in d.one_line()


def test_a_hint_names_every_blocker_of_another_size_on_the_gpu():
    """Two 4Q vGPUs with no tenant on the GPU: both must go for an 8Q (equal-size mode), so both are named."""
    ts = {"a": tenant("a", g={"vgpus": 1})}
    h = [held("m1", "manual", None, G1, profile="A40-4Q"), held("m2", "manual", None, G1, profile="A40-4Q")]
    d = adm.admit(vreq(owner=OWNER_B, tenant="a"), tenants=ts, allocations=h, gpu_memory={G1: 49152},
                  offers=offers(0, gpus=(G1,)))
    line = d.one_line()
    assert "'vgpuhost vgpu remove m1'" in line and "'vgpuhost vgpu remove m2'" in line


# ---------------------------------------------------------------------------
# 4. a kill anywhere in prepare begin: allocations match the devices after one reconcile

DOM = uid("c4c4c4c4", 0)
DEVS = (uid("d4d4d4d4", 0), uid("d4d4d4d4", 1))
KILL_XML = two_vgpu_xml("crash-vm", DOM, DEVS, "team", gpus=(GPU_LO, GPU_HI))


def _tenanted(make_host):
    host = mixed(make_host)
    tenancy.add(store_of(host), tenancy.Tenant("team", quota=tenancy.Quota(L(vgpus=2))))
    bind_as_asked(host, KILL_XML)
    return host


def _allocations_match(host, log) -> List[str]:
    s = StateStore(host.state_dir, create=False)
    try:
        recs = {r.id: r for r in s.vgpu_records() if r.owner == DOM}
        allocs = {r[0]: r for r in s.allocation_rows()}
        rows = [r for r in s.audit_rows() if r.path == "(admission)"]
    finally:
        s.close()
    out = [f"vGPU {v} held by the domain with no allocation row" for v in recs if v not in allocs]
    # the admission rows: one per device, admitted where the allocation stands, else its outcome says why
    for d in DEVS:
        mine = [r for r in rows if r.operation.endswith(d)]
        if len(mine) > 1 or (mine and (mine[0].result == "admitted") != (d in allocs)):
            out.append(f"admission rows of {d}: {[(r.result, r.value[-60:]) for r in mine]}, allocation {d in allocs}")
    out += [f"allocation of {d} for a device not held" for d in allocs if d not in recs]
    out += [f"allocation of {d} names tenant {r[2]!r}" for d, r in allocs.items() if r[2] != "team"]
    out += [f"allocation of {d} on {r[3]}, the vGPU on {recs[d].gpu}" for d, r in allocs.items()
            if d in recs and recs[d].gpu != r[3]]
    return out


def _cycle(host, log) -> List[str]:
    """The domain's release end, then a full start and stop: allocations follow."""
    out = []
    if hook_op(host, "release", "end", KILL_XML)() != 0:
        out.append("release end failed")
    s = store_of(host)
    if s.allocation_rows() or mdevs(host):
        out.append(f"after release: {len(s.allocation_rows())} allocations, {len(mdevs(host))} mdevs")
    if hook_op(host, "prepare", "begin", KILL_XML)() != 0:
        out.append("the next start failed")
    elif {r[0] for r in s.allocation_rows()} != set(DEVS):
        out.append(f"after the next start: allocations {[r[0] for r in s.allocation_rows()]}")
    if hook_op(host, "release", "end", KILL_XML)() != 0:
        out.append("the next release failed")
    return out + check_host(host, log, owners_max={})


def test_kill_during_hook_prepare_begin_with_a_tenant_leaves_allocations_matching_devices(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _tenanted, lambda h: hook_op(h, "prepare", "begin", KILL_XML),
                    _allocations_match, owners_max={DOM: 2}, cycle=_cycle)


def test_reconcile_check_names_the_allocations_of_a_start_killed_before_its_first_write(make_host, tmp_path,
                                                                                        capfd):
    host = _tenanted(make_host)
    log = tmp_path / "w.log"
    assert run(host, hook_op(host, "prepare", "begin", KILL_XML), log, kill_at=1, when="before") == -9
    s = store_of(host)
    assert {r[0] for r in s.allocation_rows()} == set(DEVS) and not mdevs(host)
    capfd.readouterr()
    assert run(host, cli_op(host, "reconcile", "--check"), log) == 1
    out = capfd.readouterr().out
    assert f"allocation of {DEVS[0]} (vgpu, domain {DOM}, tenant team) for a device never made" in out
    assert run(host, cli_op(host, "reconcile"), log) == 0
    assert not s.allocation_rows()
    assert [r.result for r in admission_rows(s)] == ["interrupted", "interrupted"]
    assert run(host, cli_op(host, "reconcile", "--check"), log) == 0


def _one_admitted_row_per_device(host) -> List[str]:
    """After the killed start, its retry and the stop: each device admitted once (the killed start's
    row of a device it never made reads interrupted), and no allocation left."""
    s = store_of(host)
    rows = admission_rows(s)
    out = [f"{d}: {[r.result for r in rows if r.operation.endswith(d)]}" for d in DEVS
           if [r.result for r in rows if r.operation.endswith(d)].count("admitted") != 1]
    return out + ([f"allocations left: {s.allocation_rows()}"] if s.allocation_rows() else [])


def test_a_killed_start_with_a_tenant_retried_without_reconcile_is_admitted_once(make_host, tmp_path):
    retry_without_reconcile(make_host, tmp_path, _tenanted, KILL_XML, _one_admitted_row_per_device)


# ---------------------------------------------------------------------------
# 4. tenant add|set|remove: the change and its audit row in one transaction

def _killed_at_audit(host, fn) -> int:
    """Run ``fn`` in a forked child that SIGKILLs itself when the tenant change's audit row is written
    (before it is committed); its exit status."""
    pid = os.fork()
    if pid == 0:
        code = 4
        try:
            real = StateStore.audit

            def audit(self, **kw):
                if kw.get("path") == "(tenants)":
                    real(self, **kw)
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(self, **kw)
            StateStore.audit = audit
            fn(StateStore(host.state_dir))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def test_tenant_changes_and_their_audit_rows_commit_together(make_host):
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, tenancy.Tenant("team", quota=tenancy.Quota(L(vgpus=1))))
    rows = len([r for r in s.audit_rows() if r.path == "(tenants)"])
    assert _killed_at_audit(host, lambda st: tenancy.update(st, "team", quota=tenancy.Quota(L(vgpus=3)))) == -9
    assert tenancy.get(s, "team").quota.guaranteed.get("vgpus") == 1          # no change without its row
    assert _killed_at_audit(host, lambda st: tenancy.add(st, tenancy.Tenant("new"))) == -9
    assert "new" not in tenancy.tenants(s)
    assert _killed_at_audit(host, lambda st: tenancy.remove(st, "team")) == -9
    assert "team" in tenancy.tenants(s)
    assert len([r for r in s.audit_rows() if r.path == "(tenants)"]) == rows
    # not killed: change and row both
    tenancy.update(s, "team", quota=tenancy.Quota(L(vgpus=3)))
    assert tenancy.get(s, "team").quota.guaranteed.get("vgpus") == 3
    assert [r.operation for r in s.audit_rows() if r.path == "(tenants)"][-1] == "tenant set team"


# ---------------------------------------------------------------------------
# 1. with the agent up: its warm snapshot is read under the host lock

def _host_lock_held(host) -> bool:
    import fcntl
    path = host.state_dir / "locks" / "tenancy.lock"
    if not path.exists():
        return False                                # never taken: not held (and not created here)
    fd = os.open(str(path), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_the_agents_snapshot_is_taken_under_the_host_lock_where_tenancy_is_in_use(make_host):
    """The agent hands prepare its snapshot as a callable (``Agent.inventory``): under tenancy it is called
    with the host lock held, so what admission decides on is checked against the host under the lock;
    a plain snapshot handed in is read again there; without tenancy no lock is taken."""
    from vgpuhost.libvirt.domxml import parse_domain
    from vgpuhost.observe.inventory import discover
    from vgpuhost.io.sysfs import Sysfs
    from vgpuhost.ops import devices
    host = mixed(make_host)
    s = store_of(host)
    seen = []

    def snapshot():
        seen.append(_host_lock_held(host))
        return discover(Sysfs(host))

    devices.prepare(host, parse_domain(tdom("a", uid("a5a5a5a5", 0), uid("b5b5b5b5", 0))), actor="t",
                    inventory=snapshot, store=s)
    assert seen == [False]                          # no tenancy: no lock
    tenancy.add(s, tenancy.Tenant("team"))
    devices.prepare(host, parse_domain(bound(host, tdom("b", uid("a5a5a5a5", 1), uid("b5b5b5b5", 1),
                                                         tenant="team"))), actor="t", inventory=snapshot, store=s)
    assert seen == [False, True]
    # a plain snapshot from before another start's vGPU is not trusted under tenancy: the host is read again
    stale = discover(Sysfs(host))                   # GPU_HI empty here
    devices.prepare(host, parse_domain(bound(host, tdom("c", uid("a5a5a5a5", 2), uid("b5b5b5b5", 2),
                                                         tenant="team", profile="A40-4Q"))), actor="t", store=s)
    assert mdev_gpu(host, uid("b5b5b5b5", 2)) == GPU_HI
    with pytest.raises(tenancy.RefusedError) as e:  # the stale view would admit a 2Q onto GPU_HI
        devices.prepare(host, parse_domain(bound(host, tdom("d", uid("a5a5a5a5", 3), uid("b5b5b5b5", 3),
                                                             tenant="team", profile="A40-2Q"))),
                        actor="t", inventory=stale, store=s)
    assert e.value.message.startswith("admission: no room for vGPU A40-2Q of tenant 'team'"), e.value.message
    assert [r.result for r in admission_rows(s)] == ["admitted", "admitted", "refused"]
    assert len(s.allocation_rows()) == 3 and len(mdevs(host)) == 3
