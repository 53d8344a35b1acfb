"""Compute-aware placement (issue 30, item 1) on simulated hosts and in the pure model.

Each vGPU carries an expected GPU-time demand (its domain's metered history, else its tenant's mean on
the profile, else the profile's fixed share); a pool declares a compute ceiling per GPU; admission places
a vGPU only where its expected demand still fits under the ceiling and refuses (code ``gpu-time``) when
none does; starved demand is measured in ``capacity``, the exporter and an alert rule (the promtool
fixture is in tests/data/metering/rules_test.yml, run by tests/test_metering_prometheus.py).

Outcomes are read back from the simulated sysfs tree, the state store and the audit log.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from vgpuhost.cli.main import main as cli_main
from vgpuhost.io import state as st
from vgpuhost.io.state import StateStore
from vgpuhost.model.errors import InputError
from vgpuhost.model.gputime import METERED, PROFILE_SHARE, TENANT_PROFILE, ExpectedUse
from vgpuhost.model.tenancy import Limits, Quota, Tenant
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.model.usage import UsageRow
from vgpuhost.model.values import replace
from vgpuhost.ops import gputime, tenancy
from vgpuhost.policy import admission as adm
from vgpuhost.policy import compute
from vgpuhost.policy.demand import Allocation
from vgpuhost.policy.feasibility import HostGpu, Need, search
from vgpuhost.policy.replay import Board, HostModel, violations
from vgpuhost.sim.nvml import SimNvml

from test_hook import GPU_HI, GPU_LO, L40S, mdev_gpu, mdevs, mixed, start
from test_tenancy import tdom, uid

GIB = 1024


def run(capsys, host, *argv):
    code = cli_main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def metered(s: StateStore, domain: str, tenant: str, profile: str, share: float, hours: int = 2) -> None:
    """``hours`` of metering rollups for ``domain``'s vGPU of ``profile``: busy ``share`` of one GPU."""
    now = int(time.time()) // 3600 * 3600
    rows = [UsageRow(time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now - 3600 * h)), f"dev-{domain}-{h}", domain,
                     "vgpu", str(GPU_LO), profile, "", tenant, "burstable", 3600.0, 3600.0 * share, 0.0, 0.0, 0, 0, 60)
            for h in range(hours)]
    with s.transaction() as conn:
        st.add_usage(conn, rows)


def std_host(make_host, ceiling=None):
    """:func:`mixed` with both A40s in one equal-share pool ``std`` and tenant ``web`` (shared, burstable)."""
    host = mixed(make_host)
    for g in (GPU_LO, GPU_HI):      # the pool's policy, as a layout's apply leaves it
        SimNvml(host).set_scheduler_state(g, SchedulerState(policy="equal-share"))
    s = StateStore(host.state_dir)
    tenancy.set_pools(s, [adm.Pool("std", "equal-share", ("burstable", "best-effort"), (str(GPU_LO), str(GPU_HI)),
                                   ceiling)])
    tenancy.add(s, Tenant("web"))
    return host, s


def web(i: int) -> str:
    return tdom(f"w{i}", uid("d0d0d0d0", i), uid("e0e0e0e0", i), tenant="web", strategy="best-fit")


# ---------------------------------------------------------------------------
# the estimate

def test_the_estimate_is_the_domains_history_then_its_tenants_then_the_fixed_share(make_host):
    _, s = std_host(make_host)
    metered(s, uid("d0d0d0d0", 1), "web", "A40-8Q", 0.7)
    metered(s, uid("d0d0d0d0", 2), "web", "A40-8Q", 0.3)
    hist = gputime.history(s)
    own = gputime.estimate(hist, uid("d0d0d0d0", 1), "web", "A40-8Q")
    assert own == ExpectedUse(0.7, METERED, 7200.0)
    # a new domain of web: the mean of web's domains on the profile, each weighted by its busy seconds
    # (0.7 x 0.7 + 0.3 x 0.3) / (0.7 + 0.3), not the plain 0.5 (trial 10a finding 11)
    new = gputime.estimate(hist, uid("d0d0d0d0", 9), "WEB", "a40-8q")
    assert new.source == TENANT_PROFILE and new.share == pytest.approx(0.58)
    # another profile, or no tenant: None, which policy reads as the fixed share (8 GiB of 48 GiB)
    assert gputime.estimate(hist, uid("d0d0d0d0", 9), "web", "A40-4Q") is None
    d = adm.vgpu_demand("A40-8Q")
    assert compute.expected(d, 48 * GIB) == ExpectedUse(pytest.approx(1 / 6), PROFILE_SHARE)
    # in a fixed-share pool never more than the fixed share (the scheduler gives no more)
    assert compute.expected(replace(d, use=own), 48 * GIB, "fixed-share").share == pytest.approx(1 / 6)
    assert compute.expected(replace(d, use=own), 48 * GIB, "equal-share").share == 0.7


def test_a_start_expects_at_least_its_tenants_estimate_whatever_its_own_idle_history(make_host):
    """Trial 10 retest N1: a domain that ran idle before (its own mean 0.0) expects, when it starts again,
    its tenant's estimate if that is higher (a start is a new run, and an idle earlier run costs nothing);
    a domain whose own mean is higher keeps its own; a vGPU already running is estimated the same way, and an
    own mean under the profile's fixed share counts the fixed share."""
    _, s = std_host(make_host)
    idle, busy, heavy = uid("d0d0d0d0", 1), uid("d0d0d0d0", 2), uid("d0d0d0d0", 3)
    metered(s, idle, "web", "A40-8Q", 0.0)
    metered(s, busy, "web", "A40-8Q", 0.5)
    metered(s, heavy, "web", "A40-8Q", 0.9, hours=1)
    hist = gputime.history(s)
    tenant = gputime.estimate(hist, "", "web", "A40-8Q")
    assert tenant.source == TENANT_PROFILE and tenant.share == pytest.approx((0.5 * 0.5 * 2 + 0.9 * 0.9) / 1.9,
                                                                             abs=1e-4)
    d = adm.vgpu_demand("A40-8Q")
    assert gputime.demand_with_use(hist, d, idle, "web").use == tenant                  # not its own 0.0
    assert gputime.demand_with_use(hist, d, heavy, "web").use == ExpectedUse(0.9, METERED, 3600.0)
    assert gputime.demand_with_use(hist, d, idle, None).use == ExpectedUse(0.0, METERED, 7200.0)  # no tenant
    # running, the same (trial 10 final NEW-1: counted at its idle mean, a busy domain let the next start be
    # packed beside it)
    held = [Allocation("x", idle, "web", str(GPU_LO), "vgpu", "A40-8Q", 8 * GIB, 0, "burstable")]
    assert gputime.with_use(hist, held)[0].use == tenant
    # no tenant's estimate to compare: an own mean below the profile's fixed share counts the fixed share
    alone = gputime.with_use(hist, [replace(held[0], tenant=None)])[0]
    assert alone.use == ExpectedUse(0.0, METERED, 7200.0)
    assert compute.expected(alone, 48 * GIB, "equal-share") == ExpectedUse(pytest.approx(1 / 6), METERED, 7200.0)
    assert compute.gpu_load([alone], {str(GPU_LO): 48 * GIB}, lambda g: "equal-share")[str(GPU_LO)] == \
        pytest.approx(1 / 6)


def test_idle_domains_cannot_lower_the_estimate_of_a_tenants_new_domains(make_host, capsys):
    """Trial 10a finding 11: a tenant's idle decoy domains on a profile weigh nothing in the estimate of
    its domains without history (each domain's mean weighted by its busy seconds), so its new domains are
    placed as its real use says, not packed beside another tenant's VM; lowering it costs real GPU time."""
    host, s = std_host(make_host)
    tenancy.add(s, Tenant("quiet"))
    metered(s, uid("a0a0a0a0", 0), "quiet", "A40-8Q", 0.5, hours=3)
    assert start(host, "q0", tdom("q0", uid("a0a0a0a0", 0), uid("a1a1a1a1", 0), tenant="quiet")) == (0, "")
    assert mdev_gpu(host, uid("a1a1a1a1", 0)) == GPU_LO
    for i in range(2):                                          # web's real VMs, stopped now
        metered(s, uid("b0b0b0b0", i), "web", "A40-8Q", 0.5, hours=3)
    honest = gputime.estimate(gputime.history(s), uid("d0d0d0d0", 9), "web", "A40-8Q")
    for i in range(10):                                         # ten idle decoys, 3 h each
        metered(s, uid("c0c0c0c0", i), "web", "A40-8Q", 0.0, hours=3)
    gamed = gputime.estimate(gputime.history(s), uid("d0d0d0d0", 9), "web", "A40-8Q")
    assert honest == ExpectedUse(0.5, TENANT_PROFILE, 6 * 3600.0)
    assert gamed.share == 0.5 and gamed.source == TENANT_PROFILE            # the plain mean: 0.083
    # four new domains of web (no history of their own): placed at 0.5 each, the fourth refused
    placed = [start(host, f"w{i}", web(i))[0] for i in range(4)]
    assert placed == [0, 0, 0, 2]
    on = [mdev_gpu(host, uid("e0e0e0e0", i)) for i in range(3)]
    assert sorted(map(str, on)) == sorted([str(GPU_LO), str(GPU_HI), str(GPU_HI)])
    assert uid("e0e0e0e0", 3) not in {r[0] for r in s.allocation_rows()}
    # once they run as web's VMs do, no GPU carries more than its ceiling: quiet's VM is not starved
    for i in range(3):
        metered(s, uid("d0d0d0d0", i), "web", "A40-8Q", 0.5)
    doc = json.loads(run(capsys, host, "--json", "capacity")[1])
    assert doc["starved_demand"]["total"] == 0
    assert {g["gpu"]: g["gpu_time_expected"] for g in doc["gpus"] if g["gpu_time_expected"]} == {
        str(GPU_LO): pytest.approx(1.0), str(GPU_HI): pytest.approx(1.0)}
    # what lowering it costs: decoys must be busy, and halving it takes as much busy time as the real use
    # (web's real VMs, 5 domains now: 3 h x 0.5 x 2 + 2 h x 0.5 x 3 = 6 busy hours; 60 decoys x 3 h x 0.1 = 18)
    for i in range(60):
        metered(s, uid("c1c1c1c1", i), "web", "A40-8Q", 0.1, hours=3)
    costly = gputime.estimate(gputime.history(s), uid("d0d0d0d0", 9), "web", "A40-8Q")
    assert costly.share == pytest.approx((6 * 0.5 + 18 * 0.1) / (6 + 18))     # 0.2, after 18 GPU-hours spent


def test_a_tenant_whose_domains_were_idle_gets_the_fixed_share_not_zero(make_host):
    """Trial 10a finding 11: a tenant with no busy history on a profile (idle domains only, or less than ten
    busy GPU-minutes) gets no tenant-profile estimate: its new domains count the profile's fixed share."""
    _, s = std_host(make_host)
    for i in range(5):
        metered(s, uid("c0c0c0c0", i), "web", "A40-8Q", 0.0, hours=3)
    hist = gputime.history(s)
    assert gputime.estimate(hist, uid("d0d0d0d0", 9), "web", "A40-8Q") is None
    # a domain's own idle history is its own: it expects what it used
    assert gputime.estimate(hist, uid("c0c0c0c0", 0), "web", "A40-8Q") == ExpectedUse(0.0, METERED, 3 * 3600.0)
    metered(s, uid("c1c1c1c1", 0), "web", "A40-8Q", 0.05, hours=3)         # 540 busy seconds: not yet
    assert gputime.estimate(gputime.history(s), uid("d0d0d0d0", 9), "web", "A40-8Q") is None
    metered(s, uid("c1c1c1c1", 1), "web", "A40-8Q", 0.05, hours=3)         # 1080: trusted
    assert gputime.estimate(gputime.history(s), uid("d0d0d0d0", 9), "web", "A40-8Q").share == pytest.approx(0.05)


def test_a_metered_share_above_one_gpu_is_read_as_one_and_starts_on_an_empty_gpu(make_host, capsys):
    """Trial 10a finding 14: rollups reading more busy than allocated seconds (1.01 of a GPU) are read as
    1.0: the domain starts on an empty GPU of an equal-share pool, which then expects 1.0."""
    host, s = std_host(make_host)
    metered(s, uid("d0d0d0d0", 1), "web", "A40-8Q", 1.01)
    metered(s, uid("d0d0d0d0", 2), "web", "A40-8Q", 1.5)
    hist = gputime.history(s)
    assert gputime.estimate(hist, uid("d0d0d0d0", 1), "web", "A40-8Q") == ExpectedUse(1.0, METERED, 7200.0)
    assert gputime.estimate(hist, uid("d0d0d0d0", 9), "web", "A40-8Q").share == 1.0
    d = replace(adm.vgpu_demand("A40-8Q"), use=ExpectedUse(1.2, METERED))
    assert compute.expected(d, 48 * GIB, "equal-share").share == 1.0
    assert start(host, "w1", web(1)) == (0, "")
    first = mdev_gpu(host, uid("e0e0e0e0", 1))
    assert first in (GPU_LO, GPU_HI)
    doc = json.loads(run(capsys, host, "--json", "capacity")[1])
    assert {g["gpu"]: g["gpu_time_expected"] for g in doc["gpus"]}[str(first)] == 1.0
    assert doc["starved_demand"]["total"] == 0
    # the second domain metered 1.5: also 1.0, on the other GPU
    assert start(host, "w2", web(2)) == (0, "") and mdev_gpu(host, uid("e0e0e0e0", 2)) not in (first, None)


LENDING_LAYOUT = """version: 1
layouts:
  l:
    gpus:
      - select: {address: "0000:81:00.0"}
        mode: vgpu
        vgpu: {types: {A40-8Q: 6}}
        scheduler: {policy: equal-share}
        pool: {name: std, serves: [burstable]}
"""


def test_a_layouts_idle_vgpus_expect_no_gpu_time_and_are_lent_to_a_busier_domain(make_host, capsys):
    """Trial 10a finding 10: a layout's pre-created vGPUs that no domain holds are room, not demand: a
    domain expecting more than the profile's fixed share (0.3 > 1/6) is lent one of them on an otherwise
    idle GPU, and the lent slot then expects what the domain does, not its fixed share besides."""
    from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
    from test_hook import domain_xml, mdev_hostdev
    host = mixed(make_host)
    path = host.root / "l.yaml"
    path.write_text(LENDING_LAYOUT)
    assert run(capsys, host, "apply", "-c", str(path), "--yes")[0] == 0
    s = StateStore(host.state_dir)
    tenancy.add(s, Tenant("web"))
    idle = sorted(r.id for r in s.vgpu_records() if r.owner == "layout")
    assert len(idle) == 6
    doc = json.loads(run(capsys, host, "--json", "capacity")[1])
    assert {g["gpu"]: g["gpu_time_expected"] for g in doc["gpus"]}[str(GPU_HI)] == 0     # six idle: no demand
    metered(s, uid("d9d9d9d9", 0), "web", "A40-8Q", 0.3, hours=3)
    # pinned to the layout's GPU (its only choice): lent a layout slot, not refused for GPU time
    x = domain_xml("w1", uid("d1d1d1d1", 1), Metadata(tenant="web", vgpus=[VgpuRequest(
        "A40-8Q", uuid=uid("e1e1e1e1", 1), gpu=GPU_HI)]), [mdev_hostdev(uid("e1e1e1e1", 1))])
    assert start(host, "w1", x) == (0, "")
    assert mdev_gpu(host, uid("e1e1e1e1", 1)) == GPU_HI
    recs = {r.id: r for r in s.vgpu_records()}
    assert recs[uid("e1e1e1e1", 1)].owner == uid("d1d1d1d1", 1) and recs[uid("e1e1e1e1", 1)].pool == "layout"
    assert len([r for r in recs.values() if r.owner == "layout"]) == 5 and len(mdevs(host)) == 6
    assert [r[3] for r in s.allocation_rows() if r[0] == uid("e1e1e1e1", 1)] == [str(GPU_HI)]
    # the GPU now expects the domain's 0.3 alone: the five idle slots and the lent one's fixed share add nothing
    doc = json.loads(run(capsys, host, "--json", "capacity")[1])
    assert {g["gpu"]: g["gpu_time_expected"] for g in doc["gpus"]}[str(GPU_HI)] == pytest.approx(0.3)
    assert doc["starved_demand"]["total"] == 0
    # three more fit there (0.3 x 3 = 0.9 + 0.3 > 1: the fourth of them does not)
    for i in (2, 3):
        x = domain_xml(f"w{i}", uid("d1d1d1d1", i), Metadata(tenant="web", vgpus=[VgpuRequest(
            "A40-8Q", uuid=uid("e1e1e1e1", i), gpu=GPU_HI)]), [mdev_hostdev(uid("e1e1e1e1", i))])
        assert start(host, f"w{i}", x) == (0, "")
    x = domain_xml("w4", uid("d1d1d1d1", 4), Metadata(tenant="web", vgpus=[VgpuRequest(
        "A40-8Q", uuid=uid("e1e1e1e1", 4), gpu=GPU_HI)]), [mdev_hostdev(uid("e1e1e1e1", 4))])
    rc, err = start(host, "w4", x)
    assert rc == 2 and "0.90 expected + 0.30 asked > ceiling 1" in err, err
    assert len([r for r in s.vgpu_records() if r.owner == "layout"]) == 3


# ---------------------------------------------------------------------------
# placement and admission through the hook

def test_placement_keeps_each_gpu_under_its_ceiling_and_refuses_naming_gpu_time(make_host, capsys):
    host, s = std_host(make_host)
    metered(s, uid("d0d0d0d0", 90), "web", "A40-8Q", 0.6)          # web's A40-8Q VMs use 0.6 of a GPU
    rc, err = start(host, "w1", web(1))
    assert (rc, err) == (0, ""), err
    first = mdev_gpu(host, uid("e0e0e0e0", 1))
    # best-fit by framebuffer alone would put the second beside the first (5 more A40-8Q fit there);
    # 0.6 + 0.6 passes the ceiling of 1.0, so it goes to the other GPU
    assert start(host, "w2", web(2)) == (0, "")
    second = mdev_gpu(host, uid("e0e0e0e0", 2))
    assert {first, second} == {GPU_LO, GPU_HI}
    rows = {r[0]: r[3] for r in s.allocation_rows()}
    assert rows[uid("e0e0e0e0", 1)] == str(first) and rows[uid("e0e0e0e0", 2)] == str(second)
    # a third finds framebuffer on both GPUs but GPU time on neither: refused, one line, nothing made
    before = mdevs(host)
    rc, err = start(host, "w3", web(3))
    assert rc == 2 and err.count("\n") == 1, err
    assert "no GPU time for vGPU A40-8Q" in err and "0.60 of a GPU (tenant-profile)" in err
    assert "0.60 expected + 0.60 asked > ceiling 1" in err
    assert mdevs(host) == before and uid("e0e0e0e0", 3) not in {r[0] for r in s.allocation_rows()}
    [row] = [r for r in s.audit_rows() if r.path == "(admission)" and r.result == "refused"]
    assert "no GPU time" in row.value and "w3" in row.operation
    # capacity: the expected GPU time per GPU, no starved demand
    code, out, _ = run(capsys, host, "--json", "capacity", "--profile", "A40-8Q")
    doc = json.loads(out)
    assert code == 0
    per = {g["gpu"]: g for g in doc["gpus"]}
    for g in (GPU_LO, GPU_HI):
        assert per[str(g)]["gpu_time_expected"] == pytest.approx(0.6)
        assert per[str(g)]["compute_ceiling"] == 1.0 and per[str(g)]["starved_demand"] == 0
    assert doc["starved_demand"] == {"total": 0, "share": 0, "by_pool": {"std": 0, "default": 0}}   # the L40S: no pool


def test_a_lower_ceiling_leaves_starved_demand_in_capacity_and_the_exporter(make_host, capsys):
    from prometheus_client import CollectorRegistry, generate_latest

    from vgpuhost.ops.exporter import _host_families
    from vgpuhost.ops.metering import host_series
    host, s = std_host(make_host)
    metered(s, uid("d0d0d0d0", 90), "web", "A40-8Q", 0.6)
    assert start(host, "w1", web(1)) == (0, "") and start(host, "w2", web(2)) == (0, "")
    # the operator lowers the pool's ceiling to 0.5 while both run: each GPU now carries 0.1 too much
    tenancy.set_pools(s, [adm.Pool("std", "equal-share", ("burstable", "best-effort"), (str(GPU_LO), str(GPU_HI)),
                                   0.5)])
    assert [p.ceiling for p in tenancy.pools(s)] == [0.5]
    [row] = [r for r in s.audit_rows() if r.operation == "pools set" and "compute ceiling 0.5" in r.value]
    code, out, _ = run(capsys, host, "--json", "capacity")
    doc = json.loads(out)
    assert {g["gpu"]: g["starved_demand"] for g in doc["gpus"]} == {str(GPU_LO): pytest.approx(0.1),
                                                                    str(GPU_HI): pytest.approx(0.1), str(L40S): 0}
    assert doc["starved_demand"]["total"] == pytest.approx(0.2)
    assert doc["starved_demand"]["by_pool"] == {"std": pytest.approx(0.2), "default": 0}
    code, out, _ = run(capsys, host, "capacity")
    assert code == 0 and "starved demand 0.20 of a GPU in all" in out
    assert f"{GPU_LO}: starved demand 0.10 of a GPU (expected GPU time 0.60 over the pool's compute ceiling 0.5)" in out
    series = host_series(host, s)
    assert series["pool_starved"] == {"std": pytest.approx(0.2), "default": 0}

    class Families:
        def collect(self):
            return list(_host_families(series))
    reg = CollectorRegistry()
    reg.register(Families())
    text = generate_latest(reg).decode()
    assert f'vgpuhost_gpu_starved_demand{{gpu="{GPU_LO}",pool="std"}} 0.1' in text
    assert f'vgpuhost_gpu_time_expected{{gpu="{GPU_HI}",pool="std"}} 0.6' in text
    assert f'vgpuhost_gpu_compute_ceiling{{gpu="{GPU_HI}",pool="std"}} 0.5' in text
    assert 'vgpuhost_pool_starved_demand{pool="std"} 0.2' in text
    # and a third start finds no GPU time at all
    rc, err = start(host, "w3", web(3))
    assert rc == 2 and "ceiling 0.5 of pool 'std'" in err


def test_capacity_without_a_tenant_and_free_instances_count_gpu_time_as_admission_does(make_host, capsys):
    """Trial 4 finding 9: `capacity` without --tenant and vgpuhost_free_instances count what GPU time lets a
    domain naming no tenant start (its fixed share under each GPU's ceiling), not the framebuffer's room,
    and agree with admission's own count (vgpuhost_tenant_free_instances{tenant=""})."""
    from vgpuhost.ops.metering import host_series
    host, s = std_host(make_host)
    metered(s, uid("d0d0d0d0", 90), "web", "A40-8Q", 0.6)
    assert start(host, "w1", web(1)) == (0, "") and start(host, "w2", web(2)) == (0, "")
    # each A40 expects 0.6 under a ceiling of 1.0: 0.4 left, two A40-8Q at 1/6 each (framebuffer: 5 each)
    code, out, _ = run(capsys, host, "--json", "capacity", "--profile", "A40-8Q")
    [p] = json.loads(out)["profiles"]
    assert code == 0 and p["fits"] == 4 and p["by_gpu"] == {str(GPU_LO): 2, str(GPU_HI): 2}
    assert p["blocked"] == 0 and p["framebuffer_would_allow"] == 4         # GPU time is not fragmentation
    series = host_series(host, s)
    assert series["free_instances"][("A40-8Q", "std")] == 4 == series["tenant_free_instances"][("", "A40-8Q")]
    # a ceiling under what runs: admission refuses every start, and nothing is advertised free
    tenancy.set_pools(s, [adm.Pool("std", "equal-share", ("burstable", "best-effort"), (str(GPU_LO), str(GPU_HI)),
                                   0.5)])
    code, out, _ = run(capsys, host, "capacity", "--profile", "A40-8Q")
    assert code == 0 and out.splitlines()[1].split()[:2] == ["A40-8Q", "0"], out
    series = host_series(host, s)
    assert series["free_instances"][("A40-8Q", "std")] == 0 == series["tenant_free_instances"][("", "A40-8Q")]
    before = mdevs(host)
    rc, err = start(host, "d9", tdom("d9", uid("d0d0d0d0", 9), uid("e0e0e0e0", 9)))
    assert rc == 2 and "no GPU time" in err and mdevs(host) == before


STD_LAYOUT = """version: 1
layouts:
  std:
    gpus:
      - select: {{address: "0000:41:00.0"}}
        mode: vgpu
        vgpu: {{types: {{A40-8Q: 0}}}}
        scheduler: {{policy: equal-share, arr: false}}
        pool: {{name: std, serves: [burstable, best-effort], ceiling: {ceiling}}}
      - select: {{address: "0000:81:00.0"}}
        mode: vgpu
        vgpu: {{types: {{A40-8Q: 0}}}}
        scheduler: {{policy: equal-share, arr: false}}
        pool: {{name: std, serves: [burstable, best-effort], ceiling: {ceiling}}}
"""


def test_plan_shows_a_ceiling_change_and_what_it_starves(make_host):
    """Trial 4 finding 25: a layout lowering a pool's ceiling under running vGPUs: plan names the change
    and the GPUs whose expected demand it leaves above it; apply records it."""
    from vgpuhost.ops.layout import apply, plan
    from vgpuhost.policy.config import parse
    host, s = std_host(make_host, ceiling=1.0)
    metered(s, uid("d0d0d0d0", 90), "web", "A40-8Q", 0.6)
    assert start(host, "w1", web(1)) == (0, "") and start(host, "w2", web(2)) == (0, "")
    same = plan(host, s, parse(STD_LAYOUT.format(ceiling=1.0), "l.yaml"), "std")
    assert same.steps == [], [(x.action, x.why) for x in same.steps]
    assert not [n for n in same.notes if "->" in n] and "compute ceiling 1" in "\n".join(same.notes)
    lower = parse(STD_LAYOUT.format(ceiling=0.5), "l.yaml")
    p = plan(host, s, lower, "std")
    assert p.blocked == [] and p.steps == [], [s.action for s in p.steps]
    [note] = [n for n in p.notes if n.startswith("pool std: compute ceiling")]
    assert note == (f"pool std: compute ceiling 1 -> 0.5 (apply records it): under the running vGPUs' expected "
                    f"GPU time on {GPU_LO} (0.60 expected, 0.10 starved), {GPU_HI} (0.60 expected, 0.10 starved); "
                    "new starts there are refused (gpu-time) until demand falls under it")
    assert [p.ceiling for p in tenancy.pools(s)] == [1.0]          # plan records nothing
    apply(host, s, lower, "std")
    assert [p.ceiling for p in tenancy.pools(s)] == [0.5]
    assert not [n for n in plan(host, s, lower, "std").notes if "->" in n]


# ---------------------------------------------------------------------------
# the layout's ceiling

LAYOUT = """version: 1
layouts:
  l:
    gpus:
      - select: {{address: "0000:81:00.0"}}
        mode: vgpu
        vgpu: {{types: {{A40-4Q: 1}}}}
        scheduler: {{policy: {policy}}}
        pool: {{name: p, ceiling: {ceiling}}}
"""


def test_the_layout_declares_a_ceiling_and_refuses_overcommit_outside_best_effort():
    from vgpuhost.policy.config import parse
    cfg = parse(LAYOUT.format(policy="best-effort", ceiling=1.5), "l.yaml")
    [e] = cfg.layout("l").entries
    assert e.pool.ceiling == 1.5
    for policy, ceiling, says in (("equal-share", 1.5, ": pool.ceiling 1.5 overcommits an equal-share pool"),
                                  ("fixed-share", 1.2, ": pool.ceiling 1.2 overcommits a fixed-share pool"),
                                  # the value as given: a limit just over 1.0 is not shown as "1"
                                  ("equal-share", 1.0000000001, "pool.ceiling 1.0000000001 overcommits an"),
                                  ("best-effort", 9, "above the most allowed, 8"),
                                  ("best-effort", 0, "is not a share of a GPU above 0"),
                                  ("best-effort", "lots", "is not a share of a GPU above 0")):
        with pytest.raises(InputError) as ei:
            parse(LAYOUT.format(policy=policy, ceiling=ceiling), "l.yaml")
        assert says in str(ei.value) and "\n" not in str(ei.value) and "compute" not in str(ei.value), str(ei.value)
    assert adm.pool_problems([adm.Pool("p", "equal-share", ("burstable",), ("g",), 1.5)]) == [
        "pool 'p': ceiling 1.5 overcommits an equal-share pool: only a best-effort pool may carry more "
        "than 1 GPU of expected demand per GPU"]


# ---------------------------------------------------------------------------
# the reserve of unused guarantees counts GPU time left

def test_the_reserve_counts_gpu_time_left_as_room():
    ts = {"g": Tenant("g", "burstable", quota=Quota(Limits(vgpus=2), Limits()))}
    need = [Need("g", vgpus=2)]
    gpu = HostGpu("0000:81:00.0", 48 * GIB, (("A40-8Q", 8 * GIB, 0),))
    assert search(need, tenants=ts, allocations=[], gpus=[gpu], serves=lambda g, q: True).ok is True
    # one sixth of the GPU's time left: room for one A40-8Q at its fixed share, not two
    tight = replace(gpu, compute_room=1 / 6)
    assert search(need, tenants=ts, allocations=[], gpus=[tight], serves=lambda g, q: True).ok is False
    assert search([Need("g", vgpus=1)], tenants=ts, allocations=[], gpus=[tight],
                  serves=lambda g, q: True).ok is True


# ---------------------------------------------------------------------------
# property: admitted vGPUs never take a GPU over its ceiling

BOARD = Board("A40", 48 * GIB)
GPUS = {f"0000:{0x10 + i:02x}:00.0": BOARD for i in range(3)}


@settings(max_examples=40, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from(["A40-4Q", "A40-8Q", "A40-12Q", "A40-16Q"]),
                          hs.floats(0.05, 0.95), hs.booleans(), hs.sampled_from(["a", "b", None])),
                min_size=1, max_size=25),
       hs.sampled_from([None, 0.6, 1.0, 2.0]))
def test_admission_never_takes_a_gpu_over_its_ceiling(arrivals, ceiling):
    pools = [adm.Pool("be", "best-effort", ("best-effort",), tuple(GPUS), ceiling)]
    ts = {n: Tenant(n, "best-effort") for n in ("a", "b")}
    model = HostModel(GPUS, pools)
    top = compute.ceiling_of(pools[0])
    for i, (profile, share, leave, tenant) in enumerate(arrivals):
        d = model.arrive(f"vm{i}", replace(adm.vgpu_demand(profile), use=ExpectedUse(share, METERED)), ts,
                         tenant=tenant, strategy="best-fit")
        load = compute.gpu_load(model.allocations, model.memory())
        assert all(v <= top + 1e-9 for v in load.values()), (load, top)
        if not d.admitted:
            assert d.code in ("gpu-time", "capacity"), d.reason
            if d.code == "gpu-time":
                # it was refused for GPU time only: some GPU had the framebuffer for it
                assert any(o.available > 0 for o in model.offers(profile))
        if leave and i % 3 == 0:
            model.depart(f"vm{i // 2}")
        assert violations(model, ts) == []
