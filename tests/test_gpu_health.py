"""GPU health (issue 27 section 1): a failed GPU is taken out of service, and brought back by hand.

- Must show: a simulated GPU fails mid-run under 8 concurrent VM starts (real processes through the qemu
  hook's handler): every start whose profile fits elsewhere succeeds on the healthy GPU, none lands on the
  failed one, ``capacity``, ``types``, the exporter's series and ``host check`` agree, and ``gpu uncordon``
  brings it back (refused while its health check fails).
- Each signal takes a GPU out: EIO from a device write (the start retries on the next GPU within the same
  start, the audit naming both), NVML GPU_IS_LOST, a critical Xid through NVML's events (a harmless one does
  not), a GPU gone from the PCI tree (the CLI's check at an operation, and the agent's watch).
- Under tenancy the retry is a new placement among admission's candidates: the allocation follows the GPU
  the vGPU is on.
- ``gpu cordon|uncordon|drain`` (CLI, --json, dry run, exit codes) and the agent's endpoints.
"""

from __future__ import annotations

import json
from typing import Dict, List

import pytest

from vgpuhost.agent import api
from vgpuhost.agent.watch import HealthWatch
from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.inventory import discover
from vgpuhost.ops import health, tenancy, vgpu
from vgpuhost.ops.metering import host_series
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.sim.nvml import SimNvml

from test_admission_once import _fork_starts
from test_hook import bind_as_asked, domain_xml, mdev_gpu, mdev_hostdev, mdevs, start
from test_tenancy import uid

A = PciAddress.parse
LO, HI = "0000:41:00.0", "0000:81:00.0"

TWO_A40 = """\
version: 1
name: two-a40-health
host: {cpu_vendor: AuthenticAMD, cmdline: "iommu=pt", modules: [vfio_pci, nvidia_vgpu_vfio, nvidia]}
devices:
  - {bdf: "0000:40:01.1", model: amd-root-port, numa_node: 0}
  - {bdf: "0000:41:00.0", model: A40, upstream: "0000:40:01.1", numa_node: 0, vgpu: {backend: mdev}}
  - {bdf: "0000:80:01.1", model: amd-root-port, numa_node: 1}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:01.1", numa_node: 1, vgpu: {backend: mdev}}
faults: [FAULTS]
"""


def two_a40(make_host, faults: str = ""):
    return make_host(yaml_text=TWO_A40.replace("FAULTS", faults))


def cli(capsys, host, *argv):
    code = main(["--root", str(host.root), "--local", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys, host, *argv):
    code, out, err = cli(capsys, host, "--json", *argv)
    return code, json.loads(out)


def fail_creates_on(host, gpu: str) -> None:
    """The GPU starts failing mid-run: every mdev create on it gives EIO from now on (a fault added to the
    running simulated host, as ``faults: [{op: create, device: GPU, errno: EIO, count: 0}]`` would)."""
    k = SimKernel(host)
    with k.locked():
        meta = k.meta()
        meta.setdefault("faults", []).append({"op": "create", "device": gpu, "errno": 5, "count": 0})
        k.save_meta(meta)


def repair(host) -> None:
    k = SimKernel(host)
    with k.locked():
        meta = k.meta()
        meta["faults"] = []
        k.save_meta(meta)


def vm(name: str, i: int, profile: str = "A40-4Q", gpu=None, tenant=None, strategy="first-fit"):
    dev = uid("cafecafe", i)
    meta = Metadata(strategy=strategy, tenant=tenant, vgpus=[VgpuRequest(profile, uuid=dev, gpu=A(gpu) if gpu else None)])
    return name, dev, domain_xml(name, uid("d0d0d0d0", i), meta, [mdev_hostdev(dev)])


def health_audit(host) -> List:
    return [r for r in StateStore(host.state_dir).audit_rows() if r.path.startswith("(health)")]


# ---------------------------------------------------------------------------
# must show

def test_a_gpu_failing_under_eight_concurrent_starts_is_left_out_everywhere_and_uncordon_brings_it_back(
        make_host, capsys):
    host = two_a40(make_host)
    # before the failure: two VMs run on the first GPU (first-fit)
    for i in range(2):
        name, dev, xml = vm(f"early{i}", 100 + i)
        assert start(host, name, xml)[0] == 0
        assert str(mdev_gpu(host, dev)) == LO
    fail_creates_on(host, LO)       # mid-run: the GPU at 41:00.0 fails
    # 8 concurrent starts: 6 that may go anywhere (A40-4Q fits 12 on an A40), 2 pinned to the failed GPU
    jobs = [vm(f"any{i}", i, strategy=("first-fit", "spread", "best-fit")[i % 3]) for i in range(6)]
    jobs += [vm(f"pinned{i}", 10 + i, gpu=LO) for i in range(2)]
    codes = _fork_starts(host, [(name, xml) for name, _, xml in jobs])
    devs = {name: dev for name, dev, _ in jobs}
    present = mdevs(host)
    # every start whose profile fits elsewhere succeeded, on the healthy GPU
    for i in range(6):
        assert codes[f"any{i}"] == 0, codes
        assert str(mdev_gpu(host, devs[f"any{i}"])) == HI
    # a domain pinned to the failed GPU cannot move: refused (out of service) or failed (EIO), nothing made
    for i in range(2):
        assert codes[f"pinned{i}"] in (2, 3), codes
        assert devs[f"pinned{i}"] not in present
    # none landed on the failed one: only the two from before the failure are there
    on_lo = [u for u in present if str(mdev_gpu(host, u)) == LO]
    assert sorted(on_lo) == sorted(uid("cafecafe", 100 + i) for i in range(2))
    # recorded once, with the reason and the source, and audited once
    s = StateStore(host.state_dir)
    rows = s.gpu_health_rows()
    assert [(r[0], r[2], r[4]) for r in rows] == [(LO, "io", False)]
    assert rows[0][1] == f"creating A40-4Q on {LO} failed: EIO"
    marks = [r for r in health_audit(host) if r.result == "unhealthy"]
    assert len(marks) == 1 and marks[0].path == f"(health) {LO}"
    # every start that met the failure (an EIO create row) and could move names both GPUs in its placement
    # row; which starts meet it depends on the order the processes reach the GPU's lock
    audit = s.audit_rows()
    met = {r.operation for r in audit if r.path.endswith("/create") and r.result == "EIO"}
    assert met and all(LO in r.path for r in audit if r.result == "EIO")
    pinned_ops = {f"vgpu create A40-4Q owner={uid('d0d0d0d0', 10 + i)}" for i in range(2)}
    for op in met - pinned_ops:
        again = [r for r in audit if r.operation == op and r.path == "(placement)" and "marked unhealthy" in r.value]
        assert len(again) == 1 and LO in again[0].value and f"placed again on {HI}" in again[0].value, op
    # capacity, types, the exporter and host check agree: nothing free on the failed GPU
    code, cap = cli_json(capsys, host, "capacity", "--profile", "A40-4Q")
    assert code == 0
    assert cap["profiles"][0]["by_gpu"] == {LO: 0, HI: 12 - 6} and cap["profiles"][0]["fits"] == 6
    code, out, err = cli(capsys, host, "capacity", "--profile", "A40-4Q")
    assert f"{LO}: unhealthy: creating A40-4Q on {LO} failed: EIO: counts nothing" in out
    code, types = cli_json(capsys, host, "types")
    avail = {(e["gpu"], e["name"]): e["available_instances"] for e in types["types"]}
    assert avail[(LO, "A40-4Q")] == 0 and avail[(HI, "A40-4Q")] == 6
    assert all(n == 0 for (g, _), n in avail.items() if g == LO)
    assert f"{LO}: out of service (unhealthy: creating A40-4Q on {LO} failed: EIO): none available" in \
        cli(capsys, host, "types")[1]
    series = host_series(host, s)
    assert series["free_instances"][("A40-4Q", "")] == 6
    assert series["gpu_health"] == {(LO, "io"): (0, 0), (HI, ""): (1, 0)}
    code, check = cli_json(capsys, host, "host", "check")
    assert code == 1
    bad = [f for f in check["findings"] if f["code"] == "GPU_UNHEALTHY"]
    assert [(f["subject"], f["severity"]) for f in bad] == [(LO, "error")]
    # drain: the two domains still on it, what each needs, where it fits now
    code, drained = cli_json(capsys, host, "gpu", "drain", LO)
    assert code == 0 and not drained["in_service"]
    assert sorted(d["name"] for d in drained["domains"]) == ["early0", "early1"]
    assert all(d["running"] and d["fits_on"] == [HI] and d["profile"] == "A40-4Q" for d in drained["domains"])
    # uncordon is refused while the GPU fails its health check (NVML: lost), with an audit row
    SimNvml(host).lose(A(LO))
    code, out, err = cli(capsys, host, "gpu", "uncordon", LO)
    assert code == 2 and "GPU_IS_LOST" in err and err.count("\n") == 1
    assert s.gpu_health_rows(LO) and health_audit(host)[-1].result == "refused"
    # repaired: the check passes and it is back in service everywhere
    SimNvml(host).lose(A(LO), False)
    repair(host)
    code, doc = cli_json(capsys, host, "gpu", "uncordon", LO, "--dry-run")
    assert code == 0 and doc["changed"] and s.gpu_health_rows(LO)          # a dry run changes nothing
    code, doc = cli_json(capsys, host, "gpu", "uncordon", LO)
    assert code == 0 and doc["changed"] and doc["in_service"] and not s.gpu_health_rows()
    assert health_audit(host)[-1].result == "uncordoned"
    code, cap = cli_json(capsys, host, "capacity", "--profile", "A40-4Q")
    assert cap["profiles"][0]["by_gpu"] == {LO: 12 - 2, HI: 6}
    code, types = cli_json(capsys, host, "types", "--gpu", LO)
    assert {e["name"]: e["available_instances"] for e in types["types"]}["A40-4Q"] == 10
    assert host_series(host, s)["gpu_health"] == {(LO, ""): (1, 0), (HI, ""): (1, 0)}
    code, check = cli_json(capsys, host, "host", "check")
    assert not [f for f in check["findings"] if f["code"].startswith("GPU_")]
    name, dev, xml = vm("after", 50)
    assert start(host, name, xml)[0] == 0 and str(mdev_gpu(host, dev)) == LO     # first-fit: back on 41


# ---------------------------------------------------------------------------
# the signals

def test_eio_on_create_retries_on_the_next_gpu_and_a_pinned_request_cannot_move(make_host, capsys):
    host = two_a40(make_host, f'{{op: create, device: "{LO}", errno: EIO, count: 0}}')
    s = StateStore(host.state_dir)
    out = vgpu.create(host, s, profile="A40-8Q", owner="manual")
    assert out.gpu == HI and out.notes == [f"creating A40-8Q on {LO} failed: EIO (marked unhealthy); "
                                          f"created on {HI} instead"]
    assert [r[0] for r in s.gpu_health_rows()] == [LO]
    # pinned: refused as out of service (exit 2), nothing made
    code, out_, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--gpu", LO)
    assert code == 2 and "out of service" in err and LO in err
    assert len(mdevs(host)) == 1


def test_enodev_on_a_pinned_create_fails_exit_3_and_marks_the_gpu(make_host, capsys):
    host = two_a40(make_host, f'{{op: create, device: "{HI}", errno: ENODEV, count: 0}}')
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--gpu", HI)
    assert code == 3 and f"creating A40-8Q on {HI} failed: ENODEV" in err and "marked unhealthy" in err
    assert mdevs(host) == {}
    assert [(r[0], r[2]) for r in StateStore(host.state_dir).gpu_health_rows()] == [(HI, "io")]


def test_einval_or_enospc_say_nothing_about_the_gpu(make_host, capsys):
    host = two_a40(make_host, f'{{op: create, device: "{LO}", errno: ENOSPC, count: 1}}')
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--gpu", LO)
    assert code == 3 and not StateStore(host.state_dir).gpu_health_rows()


def test_nvml_lost_a_critical_xid_and_a_gpu_gone_from_the_tree_each_take_it_out(make_host, capsys):
    host = make_host("a40-mdev")
    s = StateStore(host.state_dir)
    inv = discover(Sysfs(host))
    gpus = [str(g.address) for g in inv.gpus]
    assert len(gpus) >= 1
    nv = SimNvml(host)
    assert health.watch_once(host, s, nv, actor="test", inv=inv) == []
    # a harmless Xid (13: an application's graphics exception) changes nothing
    nv.inject_xid(A(gpus[0]), 13)
    assert health.watch_once(host, s, nv, actor="test", inv=inv) == [] and not s.gpu_health_rows()
    nv.inject_xid(A(gpus[0]), 79)
    got = health.watch_once(host, s, nv, actor="test", inv=inv)
    assert got == [{"gpu": gpus[0], "source": "nvml", "reason": "Xid 79 (GPU has fallen off the bus)"}]
    # recorded once: the same failure again is no new transition
    nv.inject_xid(A(gpus[0]), 48)
    assert health.watch_once(host, s, nv, actor="test", inv=inv) == []
    assert len([r for r in health_audit(host) if r.result == "unhealthy"]) == 1


def test_gpu_is_lost_and_the_pci_tree_through_the_agents_watch_and_the_cli(make_host, capsys):
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    vgpu.create(host, s, profile="A40-8Q", owner="manual")         # the store remembers both GPUs' types
    SimNvml(host).lose(A(HI))
    with HealthWatch(host, interval_s=0.01, event_wait_ms=0) as watch:
        for _ in range(500):
            if watch.transitions:
                break
            watch.stop.wait(0.01)
    assert watch.transitions == [{"gpu": HI, "source": "nvml", "reason": health.hp.LOST_REASON}]
    assert [r.actor for r in health_audit(host)] == ["agent health-watch"]
    # the first GPU disappears from the PCI tree: the next CLI operation's check takes it out
    SimKernel(host).unplug(LO)
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 2 and "fits on none" in err or "out of service" in err
    assert {(r[0], r[2]) for r in s.gpu_health_rows()} == {(HI, "nvml"), (LO, "pci")}
    code, check = cli_json(capsys, host, "host", "check")
    assert code == 1 and {f["subject"] for f in check["findings"] if f["code"] == "GPU_UNHEALTHY"} == {LO, HI}
    code, out, err = cli(capsys, host, "gpu", "uncordon", LO)
    assert code == 2 and "gone from the PCI tree" in err


def test_under_tenancy_the_retry_is_a_new_placement_and_the_allocation_follows_it(make_host):
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("red", quota=tenancy.Quota(tenancy.Limits(vgpus=4), tenancy.Limits(vgpus=4))))
    fail_creates_on(host, LO)
    name, dev, xml = vm("t0", 0, profile="A40-8Q", tenant="red")
    bind_as_asked(host, xml)
    assert start(host, name, xml)[0] == 0
    assert str(mdev_gpu(host, dev)) == HI
    allocs = {r[0]: r for r in s.allocation_rows()}
    assert allocs[dev][3] == HI and allocs[dev][2] == "red"
    rows = [r for r in s.audit_rows() if r.path == "(placement)" and r.result == "re-placed"]
    assert len(rows) == 1 and LO in rows[0].value
    # the next start of the tenant is admitted on the healthy GPU at once
    name, dev2, xml = vm("t1", 1, profile="A40-8Q", tenant="red")
    bind_as_asked(host, xml)
    assert start(host, name, xml)[0] == 0 and str(mdev_gpu(host, dev2)) == HI


# ---------------------------------------------------------------------------
# the operator's commands

def test_cordon_dry_run_cordon_drain_and_uncordon(make_host, capsys):
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    name, dev, xml = vm("held", 0)
    assert start(host, name, xml)[0] == 0
    code, doc = cli_json(capsys, host, "gpu", "cordon", LO, "--reason", "fan swap", "--dry-run")
    assert code == 0 and doc["changed"] and doc["dry_run"] and not s.gpu_health_rows()
    code, doc = cli_json(capsys, host, "gpu", "cordon", LO, "--reason", "fan swap")
    assert code == 0 and doc == {"schema": "vgpuhost.gpu-health/v1", "action": "cordon", "gpu": LO, "changed": True,
                                 "dry_run": False, "in_service": False, "reason": "fan swap",
                                 "holders": [uid("d0d0d0d0", 0)]}
    assert [(r[0], r[1], r[2], r[4]) for r in s.gpu_health_rows()] == [(LO, "fan swap", "operator", True)]
    code, out, err = cli(capsys, host, "gpu", "cordon", LO)
    assert code == 0 and out.startswith("no change")
    # cordoned: not placed there, still counted as healthy in the metric
    out_ = vgpu.create(host, s, profile="A40-4Q", owner="manual")
    assert out_.gpu == HI
    assert host_series(host, s)["gpu_health"][(LO, "operator")] == (1, 1)
    code, check = cli_json(capsys, host, "host", "check")
    assert [(f["code"], f["severity"]) for f in check["findings"]
            if f["subject"] == LO and f["code"].startswith("GPU_")] == [("GPU_CORDONED", "warning")]
    code, out, err = cli(capsys, host, "gpu", "drain", LO)
    assert code == 0 and "held (running) vgpu" in out and f"fits here on: {HI}" in out
    code, out, err = cli(capsys, host, "gpu", "uncordon", LO)
    assert code == 0 and "back in service" in out and not s.gpu_health_rows()
    assert [r.result for r in health_audit(host)] == ["cordoned", "uncordoned"]
    # an unknown GPU and a short BDF are input errors (exit 2)
    assert cli(capsys, host, "gpu", "cordon", "0000:99:00.0")[0] == 2
    assert cli(capsys, host, "gpu", "drain", "41:00.0")[0] == 2


def test_the_agent_endpoints(make_host):
    host = two_a40(make_host)
    agent = api.Agent(host)

    def call(method, path, body=None, role=api.ADMIN):
        route, params, _ = api.match(method, path)
        assert route is not None and role in route.roles
        api.check_keys(route, body)
        req = api.Request(params, {}, body, "test", 0, role)
        doc = route.handler_for(req)(agent, req)
        return json.loads(doc.body) if isinstance(doc, api.Text) else doc       # reads kept encoded

    doc = call("POST", f"/v1/gpus/{LO}/cordon", {"reason": "maintenance"})
    assert doc["schema"] == "vgpuhost.gpu-health/v1" and doc["changed"] and not doc["in_service"]
    types = call("GET", "/v1/types", role=api.READ)
    assert all(e["available_instances"] == 0 for e in types["types"] if e["gpu"] == LO)
    assert any(e["available_instances"] > 0 for e in types["types"] if e["gpu"] == HI)
    cap = call("GET", "/v1/capacity", role=api.READ)
    assert all(p["by_gpu"].get(LO, 0) == 0 for p in cap["profiles"])
    assert call("GET", f"/v1/gpus/{LO}/drain", role=api.READ)["domains"] == []
    states = {g["gpu"]: g for g in call("GET", "/v1/gpus/health", role=api.READ)["gpus"]}
    assert states[LO]["cordoned"] and not states[LO]["in_service"] and states[HI]["in_service"]
    route, _, _ = api.match("POST", f"/v1/gpus/{LO}/uncordon")
    assert api.READ not in route.roles
    doc = call("POST", f"/v1/gpus/{LO}/uncordon", {})
    assert doc["changed"] and doc["in_service"]
    with pytest.raises(Exception):
        call("POST", f"/v1/gpus/{LO}/cordon", {"reasn": "typo"})


def test_sim_fail_injects_each_signal(make_host, capsys):
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    code, doc = cli_json(capsys, host, "sim", "fail", LO, "--create-errno", "EIO")
    assert code == 0 and doc == {"schema": "vgpuhost.sim-fail/v1", "gpu": LO,
                                 "fault": "every vGPU create fails with EIO"}
    assert vgpu.create(host, s, profile="A40-8Q", owner="manual").gpu == HI
    code, doc = cli_json(capsys, host, "sim", "fail", HI, "--xid", "95")
    assert code == 0 and SimNvml(host).xid_events([A(HI)], 0) == [(A(HI), 95)]
    assert cli(capsys, host, "sim", "fail", HI, "--lost")[0] == 0 and SimNvml(host).gpu_lost(A(HI))
    assert cli(capsys, host, "sim", "fail", HI, "--found")[0] == 0 and not SimNvml(host).gpu_lost(A(HI))
    assert cli(capsys, host, "sim", "fail", HI, "--unplug")[0] == 0
    assert A(HI) not in {g.address for g in discover(Sysfs(host)).gpus}
    assert cli(capsys, host, "sim", "fail", HI, "--lost", "--xid", "79")[0] == 2
    assert cli(capsys, host, "sim", "fail", HI, "--create-errno", "NOPE")[0] == 2


def test_when_no_other_gpu_takes_it_the_start_fails_exit_3_naming_both(make_host, capsys):
    host = two_a40(make_host, f'{{op: create, device: "{LO}", errno: EIO, count: 0}}, '
                              f'{{op: create, device: "{HI}", errno: EIO, count: 0}}')
    name, dev, xml = vm("doomed", 0)
    rc, err = start(host, name, xml)
    assert rc == 3 and f"creating A40-4Q on {LO} failed: EIO" in err and f"creating A40-4Q on {HI} failed: EIO" in err
    assert "no other GPU takes it" in err and mdevs(host) == {}
    assert {r[0] for r in StateStore(host.state_dir).gpu_health_rows()} == {LO, HI}


def test_cordoning_an_unhealthy_gpu_keeps_its_failure(make_host, capsys):
    host = two_a40(make_host, f'{{op: create, device: "{LO}", errno: EIO, count: 0}}')
    s = StateStore(host.state_dir)
    assert vgpu.create(host, s, profile="A40-8Q", owner="manual").gpu == HI
    code, doc = cli_json(capsys, host, "gpu", "cordon", LO)
    assert code == 0 and doc["changed"] and doc["reason"] == f"creating A40-8Q on {LO} failed: EIO"
    assert [(r[2], r[4]) for r in s.gpu_health_rows()] == [("io", True)]
    assert host_series(host, s)["gpu_health"][(LO, "io")] == (0, 1)
    code, check = cli_json(capsys, host, "host", "check")
    assert [f["code"] for f in check["findings"] if f["subject"] == LO and f["code"].startswith("GPU_")] == \
        ["GPU_UNHEALTHY"]


def test_eio_from_a_device_read_takes_the_gpu_out_at_the_next_operation(make_host, capsys):
    host = two_a40(make_host, f'{{op: read, attr: creatable_vgpu_types, device: "{LO}", errno: EIO, count: 0}}, '
                              f'{{op: read, attr: available_instances, device: "{LO}", errno: EIO, count: 0}}')
    inv = discover(Sysfs(host))
    assert [g for g, _ in health.read_failures(inv)] == [A(LO)]
    s = StateStore(host.state_dir)
    assert vgpu.create(host, s, profile="A40-8Q", owner="manual").gpu == HI
    [row] = s.gpu_health_rows()
    assert row[0] == LO and row[2] == "io" and "failed: EIO" in row[1]


def test_the_signals_are_classified_as_documented():
    import errno
    from vgpuhost.policy import health as hp
    assert hp.is_unhealthy_errno(errno.EIO) and hp.is_unhealthy_errno(errno.ENODEV)
    assert not any(hp.is_unhealthy_errno(e) for e in (errno.EINVAL, errno.ENOSPC, errno.EBUSY, errno.EPERM,
                                                       errno.EEXIST, None))
    assert {79, 48, 94, 95, 119} <= set(hp.CRITICAL_XIDS) and not hp.is_critical_xid(13)
    assert hp.xid_reason(79) == "Xid 79 (GPU has fallen off the bus)"
    # every critical Xid is in the guide's table, and the guide names no other
    from pathlib import Path
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "failures.md").read_text()
    table = guide.split("| Xid | catalog name |", 1)[1].split("\n\n", 1)[0]
    listed = {int(line.split("|")[1]) for line in table.splitlines()[2:] if line.startswith("| ")}
    assert listed == set(hp.CRITICAL_XIDS)


def test_a_cordoned_gpu_that_fails_records_the_failure_and_stays_cordoned(make_host, capsys):
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    assert cli(capsys, host, "gpu", "cordon", LO, "--reason", "firmware")[0] == 0
    SimNvml(host).inject_xid(A(LO), 119)
    got = health.watch_once(host, s, SimNvml(host), actor="test", inv=discover(Sysfs(host)))
    assert got == [{"gpu": LO, "source": "nvml", "reason": "Xid 119 (GSP RPC timeout)"}]
    assert [(r[1], r[2], r[4]) for r in s.gpu_health_rows()] == [("Xid 119 (GSP RPC timeout)", "nvml", True)]
    assert host_series(host, s)["gpu_health"][(LO, "nvml")] == (0, 1)
    assert health.out_of_service(s) == {A(LO): "unhealthy (cordoned by hand): Xid 119 (GSP RPC timeout)"}


def test_the_pynvml_door_reads_gpu_is_lost_and_critical_xid_events():
    """io/nvml_pynvml.py's health calls over a stand-in of the pynvml module (its NVMLError classes are
    named as pynvml names them): GPU_IS_LOST from a fresh handle, Xids from one event set, a timeout ends
    the wait."""
    from types import SimpleNamespace
    from vgpuhost.io.nvml_pynvml import PynvmlBackend

    class NVMLError(Exception):
        pass
    lost_error = type("NVMLError_GpuIsLost", (NVMLError,), {})
    timeout_error = type("NVMLError_Timeout", (NVMLError,), {})
    queue = [SimpleNamespace(device="h41", eventData=79), SimpleNamespace(device="h81", eventData=13)]
    registered = []

    def handle(bus):
        return {"00000000:41:00.0": "h41", "00000000:81:00.0": "h81"}[bus]

    def pci_info(h):
        if h == "h41":
            raise lost_error()
        return object()

    def wait(event_set, ms):
        if not queue:
            raise timeout_error()
        return queue.pop(0)

    nv = SimpleNamespace(NVMLError=NVMLError, nvmlDeviceGetHandleByPciBusId=handle, nvmlDeviceGetPciInfo=pci_info,
                         nvmlEventSetCreate=lambda: "set", nvmlEventTypeXidCriticalError=8,
                         nvmlDeviceRegisterEvents=lambda h, t, s: registered.append((h, t, s)),
                         nvmlDeviceGetUUID=lambda h: "GPU-" + h, nvmlEventSetWait_v2=wait)
    b = PynvmlBackend(nv)
    assert b.gpu_lost(A(LO)) and not b.gpu_lost(A(HI))
    assert b.xid_events([A(LO), A(HI)], 100) == [(A(LO), 79), (A(HI), 13)]
    assert registered == [("h41", 8, "set"), ("h81", 8, "set")]
    assert b.xid_events([A(LO), A(HI)], 100) == [] and len(registered) == 2       # registered once


# ---------------------------------------------------------------------------
# trial 4 findings

def _pt_xml(name: str, i: int, gpu: str = LO) -> str:
    from test_hook import pt_domain
    return pt_domain(name, uid("d1d1d1d1", i), gpu, [gpu])


def _driver(host, bdf: str):
    return Sysfs(host).link_name(host.pci_device(bdf) / "driver")


@pytest.mark.parametrize("how", ["cordon", "unhealthy"])
def test_a_gpu_out_of_service_is_handed_to_no_new_vm_by_passthrough(make_host, capsys, how):
    """Finding 1: the hook's start of a passthrough domain and 'passthrough prepare' refuse (exit 2, one line
    naming the GPU and why), nothing changed (still on nvidia, no domain recorded), an audit row."""
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    if how == "cordon":
        assert cli(capsys, host, "gpu", "cordon", LO, "--reason", "fan swap")[0] == 0
    else:
        assert health.mark_unhealthy(s, A(LO), "Xid 79 (GPU has fallen off the bus)", "nvml", actor="test")
    before = len(s.audit_rows())
    rc, err = start(host, "ptvm", _pt_xml("ptvm", 0))
    assert rc == 2 and f"{LO} is out of service" in err and "\n" not in err.strip(), err
    assert _driver(host, LO) == "nvidia" and s.active_domains() == {} and s.passthrough_records() == []
    rows = s.audit_rows()[before:]
    assert [(r.path, r.result) for r in rows] == [(f"(health) {LO}", "refused")]
    code, out, err = cli(capsys, host, "passthrough", "prepare", LO)
    assert code == 2 and f"{LO} is out of service" in err and _driver(host, LO) == "nvidia"
    assert s.passthrough_records() == [] and s.audit_rows()[-1].result == "refused"
    # the GPU in service goes through as before
    rc, err = start(host, "ptvm2", _pt_xml("ptvm2", 1, HI))
    assert rc == 0, err
    assert _driver(host, HI) == "vfio-pci"


def test_cordoning_an_unhealthy_gpu_keeps_the_failures_reason_source_and_time(make_host, capsys):
    """Finding 6: the cordon is recorded beside the failure; its reason goes to the audit row."""
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    assert health.mark_unhealthy(s, A(LO), "creating A40-8Q on 0000:41:00.0 failed: EIO", "io", actor="test")
    [(gpu, reason, source, since, by_hand)] = s.gpu_health_rows()
    code, doc = cli_json(capsys, host, "gpu", "cordon", LO, "--reason", "fan")
    assert code == 0 and doc["changed"] and doc["reason"] == reason
    assert s.gpu_health_rows() == [(gpu, reason, "io", since, True)]
    assert s.audit_rows()[-1].value == "fan" and s.audit_rows()[-1].result == "cordoned"
    code, check = cli_json(capsys, host, "host", "check")
    [f] = [f for f in check["findings"] if f["subject"] == LO and f["code"] == "GPU_UNHEALTHY"]
    assert f"since {since} (io): {reason}" in f["message"]


def test_attach_refuses_passthrough_of_and_notes_a_pin_to_a_gpu_out_of_service(make_host, capsys):
    """Findings 1 and 7: 'attach --passthrough' of a GPU out of service is refused (definition unchanged);
    an mdev vGPU pinned to one gets the note that the hook refuses its starts."""
    import libvirt
    from vgpuhost.model.errors import RefusedError
    from vgpuhost.ops.attach import attach
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    assert cli(capsys, host, "gpu", "cordon", LO, "--reason", "maint")[0] == 0
    conn = libvirt.open("test:///default")
    try:
        dom = conn.defineXML("<domain type='test'><name>vgh-health</name><memory>65536</memory>"
                             "<os><type>hvm</type></os><devices/></domain>")
        before = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        with pytest.raises(RefusedError) as err:
            attach(host, s, "test:///default", "vgh-health", passthrough=LO)
        assert f"{LO} is out of service (cordoned by hand: maint)" in err.value.one_line()
        assert dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE) == before
        out = attach(host, s, "test:///default", "vgh-health", profile="A40-8Q", gpu=LO, dry_run=True)
        assert any(f"the qemu hook refuses every start of vgh-health while {LO} is out of service" in n
                   for n in out.notes), out.notes
        out = attach(host, s, "test:///default", "vgh-health", profile="A40-8Q", gpu=HI, dry_run=True)
        assert not any("out of service" in n for n in out.notes)
    finally:
        dom.undefine()
        conn.close()


def test_attach_reserves_no_vf_on_a_gpu_out_of_service(make_host):
    """Finding 7: vendor VFIO: the VF is reserved on the GPU in service."""
    import libvirt
    from vgpuhost.ops.attach import attach
    host = make_host("l40s-vendor-vfio")
    s = StateStore(host.state_dir)
    gpus = sorted(str(g.address) for g in discover(Sysfs(host)).gpus)
    health.cordon(host, s, discover(Sysfs(host)), A(gpus[0]), reason="maint", actor="test")
    conn = libvirt.open("test:///default")
    try:
        dom = conn.defineXML("<domain type='test'><name>vgh-health-vf</name><memory>65536</memory>"
                             "<os><type>hvm</type></os><devices/></domain>")
        out = attach(host, s, "test:///default", "vgh-health-vf", profile="L40S-8Q", dry_run=True)
        assert [d.gpu for d in out.devices] == [gpus[1]]
    finally:
        dom.undefine()
        conn.close()


def test_uncordon_reads_the_device_back_and_host_check_reports_reads_failing_now(make_host, capsys):
    """Finding 4: a vGPU attribute read failing with EIO fails uncordon's check (exit 2, nothing changed) and
    is GPU_UNHEALTHY in host check before any operation recorded it."""
    host = two_a40(make_host, f'{{op: read, attr: available_instances, device: "{LO}", errno: EIO, count: 0}}')
    s = StateStore(host.state_dir)
    code, check = cli_json(capsys, host, "host", "check")
    assert code != 0 and [f["severity"] for f in check["findings"]
                          if f["subject"] == LO and f["code"] == "GPU_UNHEALTHY"] == ["error"]
    assert s.gpu_health_rows() == []                     # host check changes nothing
    assert cli(capsys, host, "gpu", "cordon", LO, "--reason", "maint")[0] == 0
    code, out, err = cli(capsys, host, "gpu", "uncordon", LO)
    assert code == 2 and "fails its health check" in err and "available_instances" in err and "EIO" in err
    assert [r[0] for r in s.gpu_health_rows()] == [LO]
    repair(host)
    code, doc = cli_json(capsys, host, "gpu", "uncordon", LO, "--dry-run")
    assert code == 0 and "device" in doc["checked"]
    assert cli(capsys, host, "gpu", "uncordon", LO)[0] == 0 and s.gpu_health_rows() == []


def test_plan_blocks_a_step_on_a_gpu_out_of_service_and_apply_changes_nothing(make_host, capsys):
    """Finding 8: plan shows it BLOCKED; apply refuses before any change (exit 2)."""
    from pathlib import Path
    cfg = str(Path(__file__).resolve().parent.parent / "examples" / "config" / "vgpu-a40.yaml")
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    assert cli(capsys, host, "gpu", "cordon", HI, "--reason", "maint")[0] == 0
    code, doc = cli_json(capsys, host, "plan", "-c", cfg, "vdi")
    assert any(b.startswith(f"{HI} is out of service (cordoned by hand: maint)") for b in doc["blocked"]), doc
    assert not any(b.startswith(LO) for b in doc["blocked"])
    code, out, err = cli(capsys, host, "plan", "-c", cfg, "vdi")
    assert "BLOCKED" in out and f"{HI} is out of service" in out
    code, out, err = cli(capsys, host, "apply", "-c", cfg, "vdi")
    assert code == 2 and f"{HI} is out of service" in err and "nothing was changed" in err
    assert mdevs(host) == {} and s.vgpu_records() == []


def test_host_check_capacity_and_types_agree_on_a_gpu_out_of_service(make_host, capsys):
    """Findings 14, 15, 27: host check's vGPU and passthrough verdicts are not 'ready'; capacity gives the
    reason (JSON and text), counts no free framebuffer there and blames no fragmentation; types' parents
    read 0 as the type does."""
    host = make_host("a40-mdev")
    gpu = str(discover(Sysfs(host)).gpus[0].address)
    s = StateStore(host.state_dir)
    assert health.mark_unhealthy(s, A(gpu), f"creating A40-8Q on {gpu} failed: EIO", "io", actor="test")
    code, check = cli_json(capsys, host, "host", "check")
    verdicts = {m["mode"]: v for m in check["modes"] for v in m["gpus"] if v["gpu"] == gpu}
    assert verdicts["vgpu"]["verdict"] == "blocked" and "out of service" in verdicts["vgpu"]["reason"]
    assert verdicts["passthrough"]["verdict"] == "blocked"
    code, cap = cli_json(capsys, host, "capacity")
    [g] = cap["gpus"]
    assert g["out_of_service"].startswith("unhealthy: creating A40-8Q") and g["free_mib"] == 0
    assert all(p["fits"] == 0 and p["blocked"] == 0 and "fragmentation" not in p["note"] for p in cap["profiles"])
    code, out, err = cli(capsys, host, "capacity", "--profile", "A40-8Q")
    assert "fragmentation" not in out and f"{gpu}: unhealthy: creating A40-8Q" in out
    code, types = cli_json(capsys, host, "types")
    assert types["types"] and all(e["available_instances"] == 0 and
                                  all(p["available_instances"] == 0 for p in e["parents"]) for e in types["types"])


@pytest.mark.parametrize("opt", [["--create-errno", "EIO"], ["--lost"], ["--found"], ["--xid", "79"], ["--unplug"]])
def test_sim_fail_refuses_a_bdf_that_is_no_gpu_of_the_host(make_host, capsys, opt):
    """Findings 13a/b: exit 2 and one line for every option; no fault stored."""
    host = two_a40(make_host)
    state = host.root / ".vgpuhost-sim" / "state.json"
    before = state.read_bytes()
    code, out, err = cli(capsys, host, "sim", "fail", "0000:99:00.0", *opt)
    assert code == 2 and "no NVIDIA GPU at 0000:99:00.0" in err and out == ""
    assert state.read_bytes() == before
    assert cli(capsys, host, "sim", "fail", "0000:40:01.1", *opt)[0] == 2       # a root port, no GPU


def test_cordon_reason_is_checked_the_same_locally_and_through_the_agent(make_host, capsys):
    """Finding 16: one line of printable text, at most 512 characters; the error names --reason."""
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    agent = api.Agent(host)

    def through_agent(reason):
        route, params, _ = api.match("POST", f"/v1/gpus/{LO}/cordon")
        body = {"reason": reason}
        api.check_keys(route, body)
        return route.handler_for(api.Request(params, {}, body, "test", 0, api.ADMIN))(agent, api.Request(
            params, {}, body, "test", 0, api.ADMIN))

    from vgpuhost.model.errors import InputError
    for bad in ("x" * 513, "two\nlines", "bell\x01"):
        code, out, err = cli(capsys, host, "gpu", "cordon", LO, "--reason", bad)
        assert code == 2 and "--reason" in err and len(err.strip().splitlines()) <= 2, err
        with pytest.raises(InputError) as e:
            through_agent(bad)
        assert e.value.message in err
    assert s.gpu_health_rows() == [] and health_audit(host) == []
    assert cli(capsys, host, "gpu", "cordon", LO, "--reason", "x" * 512)[0] == 0
    assert s.gpu_health_rows()[0][1] == "x" * 512


def test_a_bdf_with_white_space_is_refused_and_drain_advises_a_vgpu_with_no_domain(make_host, capsys):
    """Findings 28 and 23."""
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    for argv in (("cordon", LO + " "), ("uncordon", " " + LO), ("drain", LO + " ")):
        code, out, err = cli(capsys, host, "gpu", *argv)
        assert code == 2 and "invalid PCI address" in err
    assert s.gpu_health_rows() == []
    made = vgpu.create(host, s, profile="A40-8Q", owner="manual", gpu=A(LO))
    code, doc = cli_json(capsys, host, "gpu", "drain", LO)
    [d] = doc["domains"]
    assert d["domain"] == "manual" and f"'vgpuhost vgpu remove {made.id}'" in d["needs"]
    assert "stop the domain" not in d["needs"]


def test_a_gpu_gone_from_the_tree_that_the_store_remembers_can_be_drained_cordoned_and_is_reported(
        make_host, capsys):
    """Finding 5: drain lists what it held, cordon records it, host check reports it."""
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    made = vgpu.create(host, s, profile="A40-8Q", owner="manual", gpu=A(LO))
    assert cli(capsys, host, "sim", "fail", LO, "--unplug")[0] == 0
    code, check = cli_json(capsys, host, "host", "check")
    assert [f["code"] for f in check["findings"] if f["subject"] == LO] == ["GPU_UNHEALTHY"]
    assert s.gpu_health_rows() == []                     # host check changes nothing
    code, doc = cli_json(capsys, host, "gpu", "drain", LO)
    assert code == 0 and [d["device"] for d in doc["domains"]] == [made.id]
    code, doc = cli_json(capsys, host, "gpu", "cordon", LO, "--reason", "replace")
    assert code == 0 and [(r[0], r[4]) for r in s.gpu_health_rows()] == [(LO, True)]
    assert cli(capsys, host, "gpu", "cordon", "0000:99:00.0")[0] == 2            # never known: still refused


def test_the_exporter_serves_unhealthy_for_a_gpu_gone_from_the_tree_without_the_agent(make_host, capsys):
    """Finding 2 (the PCI tree part): nothing recorded the failure, the series still says 0."""
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    vgpu.create(host, s, profile="A40-8Q", owner="manual", gpu=A(LO))
    assert host_series(host, s)["gpu_health"][(LO, "")] == (1, 0)
    assert cli(capsys, host, "sim", "fail", LO, "--unplug")[0] == 0
    series = host_series(host, s)["gpu_health"]
    assert series[(LO, "pci")] == (0, 0) and (LO, "") not in series and series[(HI, "")] == (1, 0)
    assert s.gpu_health_rows() == []


def test_a_second_create_errno_replaces_the_first(make_host, capsys):
    """Finding 13c: what sim fail prints is what creates then fail with."""
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    assert cli(capsys, host, "sim", "fail", LO, "--create-errno", "EINVAL")[0] == 0
    code, out, err = cli(capsys, host, "sim", "fail", LO, "--create-errno", "ENODEV")
    assert code == 0 and "ENODEV" in out
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--gpu", LO)
    assert code == 3 and "ENODEV" in err and "EINVAL" not in err
    assert [r[1] for r in s.gpu_health_rows()] == [f"creating A40-8Q on {LO} failed: ENODEV"]


def test_cordon_of_a_gpu_gone_from_the_tree_records_the_failure_under_the_cordon(make_host, capsys):
    """Retest of finding 5: the cordon of a vanished GPU is not an operator cordon alone (host check errs, the
    metric reads 0); drain calls it out of service before and after; a cordon from before the unplug is kept."""
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    vgpu.create(host, s, profile="A40-8Q", owner="manual", gpu=A(LO))
    vgpu.create(host, s, profile="A40-8Q", owner="manual", gpu=A(HI))
    assert cli(capsys, host, "gpu", "cordon", HI, "--reason", "fan swap")[0] == 0     # by hand, before it goes
    for g in (LO, HI):
        assert cli(capsys, host, "sim", "fail", g, "--unplug")[0] == 0
    code, doc = cli_json(capsys, host, "gpu", "drain", LO)
    assert code == 0 and doc["in_service"] is False and "gone from the PCI tree" in doc["reason"]
    code, out, err = cli(capsys, host, "gpu", "drain", LO)
    assert "out of service (gone from the PCI tree" in out and "in service;" not in out
    assert s.gpu_health_rows(LO) == []                           # drain changes nothing
    for g in (LO, HI):
        code, doc = cli_json(capsys, host, "gpu", "cordon", g, "--reason", "replace")
        assert code == 0 and doc["changed"] is True and doc["reason"] == "gone from the PCI tree"
    assert {(r[0], r[1], r[2], r[4]) for r in s.gpu_health_rows()} == {
        (LO, "gone from the PCI tree", "pci", True), (HI, "gone from the PCI tree", "pci", True)}
    assert [(r.path, r.result) for r in health_audit(host) if r.operation == "gpu cordon"] == [
        (f"(health) {HI}", "cordoned"), (f"(health) {LO}", "unhealthy"), (f"(health) {LO}", "cordoned"),
        (f"(health) {HI}", "unhealthy"), (f"(health) {HI}", "cordoned")]
    code, check = cli_json(capsys, host, "host", "check")
    assert sorted((f["subject"], f["code"], f["severity"]) for f in check["findings"] if f["subject"] in (LO, HI)) == [
        (LO, "GPU_UNHEALTHY", "error"), (HI, "GPU_UNHEALTHY", "error")]
    series = host_series(host, s)["gpu_health"]
    assert series[(LO, "pci")] == (0, 1) and series[(HI, "pci")] == (0, 1)
    code, doc = cli_json(capsys, host, "gpu", "drain", LO)
    assert doc["in_service"] is False and doc["reason"].startswith("unhealthy (cordoned by hand): gone from")
    # a second cordon changes nothing and keeps the failure
    code, doc = cli_json(capsys, host, "gpu", "cordon", LO)
    assert code == 0 and doc["changed"] is False and s.gpu_health_rows(LO)[0][2] == "pci"


def test_the_agents_watch_records_a_gpu_that_held_nothing_leaving_the_tree(make_host, capsys):
    """Retest of finding 5 (agent variant): a GPU that never held a vGPU is recorded when it leaves the tree,
    so host check, capacity, the agent's health list and the exporter agree."""
    host = make_host("l40s-vendor-vfio")
    s = StateStore(host.state_dir)
    gpus = [str(g.address) for g in discover(Sysfs(host)).gpus]
    assert len(gpus) == 2 and not s.seen_types() and not s.vgpu_records()
    gone = gpus[0]
    with HealthWatch(host, interval_s=0.01, event_wait_ms=0) as watch:
        for _ in range(500):
            if watch.rounds >= 1:
                break
            watch.stop.wait(0.01)
        SimKernel(host).unplug(gone)
        for _ in range(500):
            if watch.transitions:
                break
            watch.stop.wait(0.01)
    assert watch.transitions == [{"gpu": gone, "source": "pci", "reason": "gone from the PCI tree"}]
    assert [(r[0], r[2], r[4]) for r in s.gpu_health_rows()] == [(gone, "pci", False)]
    assert [(r.path, r.result, r.actor) for r in health_audit(host)] == [
        (f"(health) {gone}", "unhealthy", "agent health-watch")]
    assert {row[0] for row in s.seen_types()} == set(gpus)         # the next agent knows both too
    code, check = cli_json(capsys, host, "host", "check")
    assert [(f["code"], f["severity"]) for f in check["findings"] if f["subject"] == gone] == [
        ("GPU_UNHEALTHY", "error")]
    assert [g["gpu"] for g in health.status(s, discover(Sysfs(host))) if not g["healthy"]] == [gone]
    assert host_series(host, s)["gpu_health"][(gone, "pci")] == (0, 0)
    code, cap = cli_json(capsys, host, "capacity")       # offers nothing there (it is not on the host)
    assert [g["gpu"] for g in cap["gpus"]] == [gpus[1]]
    assert {g for p in cap["profiles"] for g in p["by_gpu"]} == {gpus[1]}


@pytest.mark.parametrize("how", ["lost", "unplug", "read"])
def test_the_standalone_exporter_serves_a_gpu_failing_now_that_nothing_recorded(make_host, capsys, how):
    """Finding 2: ``exporter --once`` (no agent) samples GPU_IS_LOST, the PCI tree and device reads itself:
    vgpuhost_gpu_healthy 0 and the failure's source, no free instance offered there; nothing is recorded."""
    host = two_a40(make_host, '{op: read, device: "0000:41:00.0", attr: available_instances, errno: EIO, count: 0}'
                   if how == "read" else "")
    s = StateStore(host.state_dir)
    vgpu.create(host, s, profile="A40-8Q", owner="manual", gpu=A(HI))
    if how != "read":
        assert host_series(host, s, SimNvml(host))["free_instances"][("A40-8Q", "")] == 6 + 5
        assert cli(capsys, host, "sim", "fail", LO, f"--{how}")[0] == 0
    code, out, err = cli(capsys, host, "exporter", "--once")
    assert code == 0
    source = {"lost": "nvml", "unplug": "pci", "read": "io"}[how]
    assert f'vgpuhost_gpu_healthy{{gpu="{LO}"}} 0.0' in out and f'vgpuhost_gpu_healthy{{gpu="{HI}"}} 1.0' in out
    assert f'vgpuhost_gpu_failure_info{{gpu="{LO}",source="{source}"}} 1.0' in out
    assert "vgpuhost_gpu_failure_info{" + f'gpu="{HI}"' not in out
    free = host_series(host, s, SimNvml(host))["free_instances"]
    assert free[("A40-8Q", "")] == 5                 # the five left on HI, none on LO (failing now)
    assert s.gpu_health_rows() == [] and health_audit(host) == []        # read only: nothing recorded


def _vanish_and_fail_creates(host, vid: str, gpu: str) -> None:
    """The vGPU goes away behind vgpuhost's back, and every create on its GPU fails with EIO from now on."""
    Sysfs(host).write(host.mdev_devices / vid / "remove", "1")
    fail_creates_on(host, gpu)


def test_reconcile_and_a_layouts_re_create_mark_a_gpu_whose_create_fails_with_eio(make_host, capsys, tmp_path):
    """Left out last session: writes that do not go through vgpu create mark the GPU too (one write path for
    a recorded vGPU made again, vgpu.recreate_recorded, and one classification, vgpu.gpu_failed)."""
    from test_layout import A40_DESK, cfg
    from vgpuhost.model.errors import DeviceError, RefusedError
    from vgpuhost.ops import layout
    host = make_host("a40-mdev")
    s = StateStore(host.state_dir)
    gpu = str(discover(Sysfs(host)).gpus[0].address)
    made = vgpu.create(host, s, profile="A40-8Q", owner="manual")
    _vanish_and_fail_creates(host, made.id, gpu)
    rep = vgpu.reconcile(host, s)
    assert rep.recreated == [] and len(rep.failed) == 1 and "failed: EIO" in rep.failed[0]
    assert [(r[0], r[2]) for r in s.gpu_health_rows()] == [(gpu, "io")]
    assert s.gpu_health_rows()[0][1] == f"re-creating A40-8Q {made.id} on {gpu} failed: EIO"
    assert [(r.operation, r.result) for r in health_audit(host)] == [(f"reconcile {made.id}", "unhealthy")]
    code, check = cli_json(capsys, host, "host", "check")
    assert [f["severity"] for f in check["findings"]
            if f["subject"] == gpu and f["code"] == "GPU_UNHEALTHY"] == ["error"]
    # a layout's re-create step: the same path (a fresh host, the layout's vGPU gone, creates failing)
    host = make_host("a40-mdev")
    s = StateStore(host.state_dir)
    c = cfg(A40_DESK)
    layout.apply(host, s, c)
    gone = sorted(r.id for r in s.vgpu_records())[0]
    _vanish_and_fail_creates(host, gone, gpu)
    with pytest.raises(DeviceError, match=f"re-creating A40-8Q {gone} on {gpu} failed: EIO .*marked unhealthy"):
        layout.apply(host, s, c)
    assert [(r[0], r[2]) for r in s.gpu_health_rows()] == [(gpu, "io")]
    assert [(r.operation, r.result) for r in health_audit(host)] == [
        (f"apply re-create A40-8Q {gone} owner=layout", "unhealthy")]
    assert gone in {r.id for r in s.vgpu_records()}             # the record stays for the next try
    with pytest.raises(RefusedError, match="out of service"):      # the next apply: refused, nothing tried
        layout.apply(host, s, c)
    assert len([r for r in s.audit_rows() if r.path.endswith("/create")]) == 4 + 1


def test_host_checks_mig_verdict_and_a_cordoned_gpu_failing_now(make_host, capsys):
    """Left out last session: the MIG verdict of a GPU out of service is blocked, as the other modes' are; a GPU
    cordoned by hand is still checked, so a failure now is GPU_UNHEALTHY (error) beside GPU_CORDONED."""
    host = make_host("h200-mig-on")
    gpu = str(discover(Sysfs(host)).gpus[0].address)

    def mig_verdict():
        code, doc = cli_json(capsys, host, "host", "check")
        [m] = [m for m in doc["modes"] if m["mode"] == "mig"]
        return code, [(g["gpu"], g["verdict"], g["reason"]) for g in m["gpus"]], doc
    assert mig_verdict()[1] == [(gpu, "ready", "MIG mode on, 0 GPU instances")]
    assert cli(capsys, host, "gpu", "cordon", gpu, "--reason", "firmware")[0] == 0
    code, verdicts, doc = mig_verdict()
    assert verdicts == [(gpu, "blocked", "out of service: cordoned by hand: firmware")]
    assert [(f["code"], f["severity"]) for f in doc["findings"] if f["code"].startswith("GPU_")] == [
        ("GPU_CORDONED", "warning")]
    assert cli(capsys, host, "sim", "fail", gpu, "--lost")[0] == 0
    code, verdicts, doc = mig_verdict()
    assert code == 1 and sorted((f["code"], f["severity"]) for f in doc["findings"]
                                if f["code"].startswith("GPU_")) == [
        ("GPU_CORDONED", "warning"), ("GPU_UNHEALTHY", "error")]
    assert verdicts[0][1] == "blocked"


def test_sim_fail_refuses_conflicts_and_a_found_with_nothing_lost_and_repair_undoes_each_fault(make_host, capsys):
    """Findings 13d-f: --found needs a lost GPU, options that conflict are refused (exit 2, nothing changed),
    and --repair undoes --unplug, --create-errno, --lost and queued Xids, so repair-then-uncordon can be tried."""
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    sim = host.root / ".vgpuhost-sim"
    before = {p.name: p.read_bytes() for p in sim.rglob("*.json")}
    code, out, err = cli(capsys, host, "sim", "fail", LO, "--found")
    assert code == 2 and "does not report 0000:41:00.0 lost" in err
    code, out, err = cli(capsys, host, "sim", "fail", LO, "--lost", "--found")
    assert code == 2 and "--lost and --found do not go together" in err
    assert {p.name: p.read_bytes() for p in sim.rglob("*.json")} == before            # nothing changed
    assert not SimNvml(host).gpu_lost(A(LO))
    # every fault at once on LO, after a vGPU made there: taken out, then repaired and uncordoned
    made = vgpu.create(host, s, profile="A40-8Q", owner="manual", gpu=A(LO))
    for opt in (["--create-errno", "EIO"], ["--lost"], ["--xid", "79"], ["--unplug"]):
        assert cli(capsys, host, "sim", "fail", LO, *opt)[0] == 0
    assert cli(capsys, host, "sim", "fail", LO, "--found")[0] == 2        # unplugged: no GPU for --found
    assert cli(capsys, host, "gpu", "cordon", LO)[0] == 0                 # recorded: gone (pci), cordoned
    code, out, err = cli(capsys, host, "gpu", "uncordon", LO)
    assert code == 2 and "gone from the PCI tree" in err
    code, doc = cli_json(capsys, host, "sim", "fail", LO, "--repair")
    assert code == 0 and doc["fault"] == ("repaired: back in the PCI tree, vGPU creates work, 1 queued Xid event(s) "
                                          "dropped, NVML sees it")
    inv = discover(Sysfs(host))
    assert A(LO) in {g.address for g in inv.gpus} and made.id in {m.uuid for m in inv.mdevs}
    assert health.check_gpu(host, A(LO), SimNvml(host)) == []
    assert cli(capsys, host, "gpu", "uncordon", LO)[0] == 0 and s.gpu_health_rows() == []
    assert vgpu.create(host, s, profile="A40-8Q", owner="manual", gpu=A(LO)).gpu == LO
    code, doc = cli_json(capsys, host, "sim", "fail", LO, "--repair")
    assert code == 0 and doc["fault"] == "repaired: nothing to undo"


# ---------------------------------------------------------------------------
# the other device writes: passthrough binding, MIG and scheduler (NVML) writes


def test_passthrough_binding_writes_failing_with_eio_mark_the_gpu_and_einval_does_not(make_host, capsys):
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    code, out, _ = cli(capsys, host, "sim", "fail", LO, "--write-errno", "EIO")
    assert code == 0 and "every driver-binding and NVML write fails with EIO" in out
    code, out, err = cli(capsys, host, "passthrough", "prepare", LO)
    assert code == 3 and "EIO" in err and "the GPU is marked unhealthy" in err, err
    assert _driver(host, LO) == "nvidia" and s.passthrough_records() == []           # rolled back
    [(gpu, reason, source)] = [(r[0], r[1], r[2]) for r in s.gpu_health_rows()]
    assert (gpu, source) == (LO, "io") and reason.startswith("binding ") and reason.endswith(f"on {LO} failed: EIO")
    assert [(r.path, r.result) for r in health_audit(host)] == [(f"(health) {LO}", "unhealthy")]
    assert [r.operation for r in health_audit(host)] == [f"passthrough prepare {LO}"]
    # a refusal of the request (EINVAL) says nothing about the GPU
    assert cli(capsys, host, "sim", "fail", HI, "--write-errno", "EINVAL")[0] == 0
    code, out, err = cli(capsys, host, "passthrough", "prepare", HI)
    assert code == 3 and "EINVAL" in err and "unhealthy" not in err
    assert [r[0] for r in s.gpu_health_rows()] == [LO] and _driver(host, HI) == "nvidia"
    # repaired: the binding works again on HI
    code, out, _ = cli(capsys, host, "sim", "fail", HI, "--repair")
    assert code == 0 and "device writes work" in out
    assert cli(capsys, host, "passthrough", "prepare", HI)[0] == 0 and _driver(host, HI) == "vfio-pci"


def test_a_passthrough_release_failing_with_enodev_marks_the_gpu(make_host, capsys):
    host = two_a40(make_host)
    s = StateStore(host.state_dir)
    assert cli(capsys, host, "passthrough", "prepare", HI)[0] == 0
    assert cli(capsys, host, "sim", "fail", HI, "--write-errno", "ENODEV")[0] == 0
    code, out, err = cli(capsys, host, "passthrough", "release", HI)
    assert code == 3 and "ENODEV" in err and "the GPU is marked unhealthy" in err, err
    assert [(r[0], r[2]) for r in s.gpu_health_rows()] == [(HI, "io")]
    assert [r.operation for r in health_audit(host)] == [f"passthrough release {HI}"]


def test_mig_and_scheduler_writes_failing_with_gpu_is_lost_mark_the_gpu(make_host, capsys):
    from test_mig import H200_NOVF, GPU
    host = make_host(yaml_text=H200_NOVF)
    s = StateStore(host.state_dir)
    code, out, _ = cli(capsys, host, "sim", "fail", str(GPU), "--write-errno", "EIO")
    assert code == 0
    code, out, err = cli(capsys, host, "mig", "enable", "--gpu", str(GPU))
    assert code == 3 and "NVMLError_GpuIsLost" in err and "the GPU is marked unhealthy" in err, err
    assert SimNvml(host).mig_mode(GPU) == (False, False)                              # nothing changed
    [(gpu, reason, source)] = [(r[0], r[1], r[2]) for r in s.gpu_health_rows()]
    assert (gpu, source) == (str(GPU), "nvml") and reason.endswith(f"on {GPU} failed: GPU_IS_LOST")
    # the scheduler's NVML write on an A40: the same classification, the same record
    a40 = make_host("a40-mdev")
    s2 = StateStore(a40.state_dir)
    assert cli(capsys, a40, "sim", "fail", "0000:81:00.0", "--write-errno", "ENODEV")[0] == 0
    before = SimNvml(a40).scheduler_state(A("0000:81:00.0"))
    code, out, err = cli(capsys, a40, "scheduler", "set", "--policy", "equal-share", "--gpu", "0000:81:00.0")
    assert code == 3 and "NVMLError_GpuIsLost" in err and "the GPU is marked unhealthy" in err, err
    assert SimNvml(a40).scheduler_state(A("0000:81:00.0")) == before
    assert [(r[0], r[2]) for r in s2.gpu_health_rows()] == [("0000:81:00.0", "nvml")]
    assert len(health_audit(a40)) == 1


def test_a_gpu_nvml_reports_lost_and_nothing_recorded_is_out_of_service_in_every_view(make_host, capsys):
    """Trial 5 finding 8: NVML says GPU_IS_LOST, no agent recorded it: capacity leaves it out as the
    exporter and host check do, and vgpu create places elsewhere, recording the failure (one audit row,
    source nvml) so every later view, the lean types too, says so from the store."""
    host = two_a40(make_host)
    assert cli(capsys, host, "sim", "fail", LO, "--lost")[0] == 0
    store = StateStore(host.state_dir)
    assert store.gpu_health_rows(LO) == []                       # nothing recorded yet
    code, doc = cli_json(capsys, host, "capacity", "--profile", "A40-4Q")
    assert code == 0 and doc["profiles"][0]["fits"] == 12        # the healthy A40 alone
    assert host_series(host, StateStore(host.state_dir), SimNvml(host))["free_instances"][("A40-4Q", "")] == 12
    code, out, _ = cli(capsys, host, "vgpu", "create", "--profile", "A40-4Q")
    assert code == 0
    assert [r.gpu for r in vgpu_records(host)] == [HI]
    rows = [r for r in store.audit_rows() if r.path == f"(health) {LO}"]
    assert len(rows) == 1 and rows[0].result == "unhealthy" and "GPU_IS_LOST" in rows[0].value
    assert store.gpu_health_rows(LO)
    code, doc = cli_json(capsys, host, "types", "--gpu", LO)
    assert code == 0 and all(t["available_instances"] == 0 for t in doc["types"])


def vgpu_records(host):
    return StateStore(host.state_dir).vgpu_records()
