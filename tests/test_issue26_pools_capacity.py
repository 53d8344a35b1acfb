"""Issue 26, findings 5 and 6 on simulated hosts: the scheduler policy is what the pool says (``scheduler
set`` refused off a pool's policy, a GPU in drift admits nothing until ``apply``), and capacity answers
what admission would answer for a tenant (``capacity --tenant``, the exporter's per-tenant series,
``advise``, ``fleet capacity|place --tenant``).

Outcomes are read back from the simulated sysfs tree and NVML, the state store and the audit log.
"""

from __future__ import annotations

import json

from vgpuhost.cli.main import main as cli_main
from vgpuhost.io.state import StateStore
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.ops import tenancy
from vgpuhost.sim.nvml import SimNvml

from test_hook import GPU_HI, GPU_LO, mdev_gpu, mdevs, mixed, start
from test_tenancy import tdom, uid

GOLD = """
version: 1
layouts:
  shared:
    gpus:
      - select: {address: "0000:41:00.0"}
        mode: vgpu
        vgpu: {types: {A40-8Q: 1}}
        scheduler: {policy: equal-share}
        pool: std
      - select: {address: "0000:81:00.0"}
        mode: vgpu
        vgpu: {types: {A40-8Q: 1}}
        scheduler: {policy: fixed-share}
        pool: {name: gold, serves: [guaranteed]}
"""


def run(capsys, host, *argv):
    code = cli_main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def gold_host(make_host, capsys, std=("burstable", "best-effort")):
    """:func:`mixed` with two empty pooled GPUs: std (equal share) on GPU_LO, gold (fixed share, serving
    guaranteed) on GPU_HI, the policies set through NVML first, as a layout's apply leaves them."""
    host = mixed(make_host)
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_LO), "--policy", "equal-share")[0] == 0
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "fixed-share")[0] == 0
    s = StateStore(host.state_dir)
    tenancy.set_pools(s, [tenancy.adm.Pool("std", "equal-share", tuple(std), (str(GPU_LO),)),
                          tenancy.adm.Pool("gold", "fixed-share", ("guaranteed",), (str(GPU_HI),))])
    return host, s


def policy_of(host, gpu) -> str:
    return SimNvml(host).scheduler_state(gpu).policy


# ---------------------------------------------------------------------------
# finding 5: the policy is what the pool says

def test_scheduler_set_refuses_a_policy_the_gpus_pool_does_not_have(make_host, capsys):
    host, s = gold_host(make_host, capsys)
    assert policy_of(host, GPU_HI) == "fixed-share"
    rows = len(s.audit_rows())
    code, _, err = run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "best-effort")
    assert code == 2 and err.count("\n") == 1
    assert f"GPU {GPU_HI} is in pool 'gold', whose scheduler policy is fixed-share, not best-effort" in err
    assert "layout" in err and "vgpuhost apply" in err
    assert policy_of(host, GPU_HI) == "fixed-share" and len(s.audit_rows()) == rows      # nothing changed
    # --all names a pooled GPU too; --persist writes nothing either
    assert run(capsys, host, "scheduler", "set", "--all", "--policy", "equal-share")[0] == 2
    code, _, err = run(capsys, host, "scheduler", "set", "--gpu", str(GPU_HI), "--policy", "equal-share", "--persist")
    assert code == 2 and "pool 'gold'" in err
    assert not (host.root / "etc/modprobe.d/vgpuhost-scheduler.conf").exists()
    # the pool's own policy, and a GPU's in a pool of that policy, are fine
    assert run(capsys, host, "scheduler", "set", "--gpu", str(GPU_LO), "--policy", "equal-share")[0] == 0
    assert policy_of(host, GPU_LO) == "equal-share"


def test_a_gpu_in_drift_admits_no_class_until_apply_sets_its_pools_policy(make_host, capsys):
    from vgpuhost.ops.layout import apply
    from vgpuhost.policy.config import parse
    host, s = gold_host(make_host, capsys)
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    # someone sets the gold GPU to best effort behind vgpuhost's back (NVML directly)
    SimNvml(host).set_scheduler_state(GPU_HI, SchedulerState(policy="best-effort"))
    assert policy_of(host, GPU_HI) == "best-effort"
    x = tdom("g0", uid("56565656", 0), uid("78787878", 0), tenant="g")
    before = mdevs(host)
    rc, err = start(host, "g0", x)
    assert rc == 2 and err.count("\n") == 1, err
    assert (f"GPU {GPU_HI} runs the best-effort scheduler, not pool 'gold''s fixed-share: in drift" in err), err
    assert "vgpuhost apply" in err
    assert mdevs(host) == before and not s.allocation_rows()
    [row] = [r for r in s.audit_rows() if r.path == "(admission)"]
    assert row.result == "refused" and "in drift" in row.value
    # apply sets the pool's policy again; the start is admitted onto the gold GPU
    apply(host, s, parse(GOLD, "gold.yaml"))
    assert policy_of(host, GPU_HI) == "fixed-share"
    assert start(host, "g0", x) == (0, "")
    assert mdev_gpu(host, uid("78787878", 0)) == GPU_HI
    rows = [r for r in s.audit_rows() if r.path == "(admission)"]
    assert [r.result for r in rows] == ["refused", "admitted"] and "pool gold" in rows[-1].value


# ---------------------------------------------------------------------------
# finding 6: capacity answers what admission would answer

def exclusive_host(make_host):
    """:func:`mixed` with tenant ``solo`` (exclusive) holding an A40-4Q on GPU_LO and ``web`` (shared,
    2 vGPUs at most)."""
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("solo", isolation="exclusive"))
    tenancy.add(s, tenancy.Tenant("web", quota=tenancy.Quota(tenancy.Limits(vgpus=2), tenancy.Limits())))
    assert start(host, "s0", tdom("s0", uid("90909090", 0), uid("a0a0a0a0", 0), tenant="solo",
                                  profile="A40-4Q")) == (0, "")
    assert mdev_gpu(host, uid("a0a0a0a0", 0)) == GPU_LO
    return host, s


def a40(doc, profile="A40-4Q"):
    [p] = [p for p in doc["profiles"] if p["profile"] == profile]
    return p


def test_capacity_counts_nothing_free_on_a_gpu_an_exclusive_tenant_holds(make_host, capsys):
    host, _ = exclusive_host(make_host)
    code, out, _ = run(capsys, host, "--json", "capacity", "--profile", "A40-4Q")
    doc = json.loads(out)
    assert code == 0 and doc["tenant"] is None
    p = a40(doc)
    assert p["by_gpu"][str(GPU_LO)] == 0 and p["by_gpu"][str(GPU_HI)] == 12 and p["fits"] == 12
    ex = {g["gpu"]: g["exclusive"] for g in doc["gpus"]}
    assert ex[str(GPU_LO)] == "solo" and ex[str(GPU_HI)] is None
    code, out, _ = run(capsys, host, "capacity", "--profile", "A40-4Q")
    assert code == 0 and f"{GPU_LO}: held by exclusive tenant solo" in out


def test_capacity_for_a_tenant_is_what_admission_admits(make_host, capsys):
    host, s = exclusive_host(make_host)
    code, out, _ = run(capsys, host, "--json", "capacity", "--tenant", "WEB", "--profile", "A40-4Q")
    doc = json.loads(out)
    assert code == 0 and doc["tenant"] == "web"
    p = a40(doc)
    # never on solo's GPU; at most 2 by its quota, however many GPU_HI could hold
    assert p["by_gpu"] == {str(GPU_LO): 0, str(GPU_HI): 2} and p["fits"] == 2 and p["blocked"] == 0
    assert "quota vGPUs of tenant 'web': 2 in use + 1 asked > 2" in p["why_not"]
    # the exclusive tenant itself may join its own GPU and take an empty one
    p = a40(json.loads(run(capsys, host, "--json", "capacity", "--tenant", "solo", "--profile", "A40-4Q")[1]))
    assert p["by_gpu"] == {str(GPU_LO): 11, str(GPU_HI): 12} and p["fits"] == 23 and p["why_not"]
    # admission agrees: web starts two, the third is refused for its quota, and capacity then says 0
    for i in range(3):
        rc, err = start(host, f"w{i}", tdom(f"w{i}", uid("90909090", i + 1), uid("a0a0a0a0", i + 1), tenant="web",
                                            profile="A40-4Q"))
        assert (rc, i < 2 or "quota vGPUs of tenant 'web'" in err) == ((0 if i < 2 else 2), True), err
    assert {mdev_gpu(host, uid("a0a0a0a0", i)) for i in (1, 2)} == {GPU_HI}
    code, out, _ = run(capsys, host, "capacity", "--tenant", "web", "--profile", "A40-4Q")
    assert code == 0 and "no more for tenant web: quota vGPUs of tenant 'web': 2 in use + 1 asked > 2" in out


def test_capacity_refuses_an_unknown_tenant(make_host, capsys):
    host, _ = exclusive_host(make_host)
    code, out, err = run(capsys, host, "capacity", "--tenant", "nosuch")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "no tenant 'nosuch'" in err and "tenants: solo, web" in err
