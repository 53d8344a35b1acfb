"""Mixed-size pools (issue 30 item 2): the pool option, its refusals, and the planner that switches only
empty GPUs (pure planner on hand-built HostViews, as tests/test_layout_planner.py builds them)."""

from __future__ import annotations

import pytest

from tests.test_layout_planner import A40, A40B, DOMAIN, Host, cfg, vgpu_entry
from vgpuhost.model.errors import InputError
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.plan.layout import LayoutSetMixedSize, plan

EQUAL = SchedulerState("equal-share", arr=True)      # what the pool's scheduler block asks: no scheduler step
POOL = ("        scheduler: {policy: equal-share}\n"
        "        pool: {name: desk, mixed_size: true}\n")


def test_a_mixed_size_pool_turns_the_mode_on_on_an_empty_gpu():
    c = cfg(vgpu_entry("{A40-8Q: 0}", extra=POOL))
    [e] = c.layouts["main"].entries
    assert e.pool.mixed_size and e.vgpu.mixed_size is True
    p = plan(c, None, Host().a40(mixed_size=False, scheduler=EQUAL).view())
    [step] = [s for s in p.steps if isinstance(s, LayoutSetMixedSize)]
    assert step.on is True and step.target == str(A40)
    assert p.blocked == []


def test_a_busy_gpu_keeps_its_mode_and_the_plan_says_why():
    h = Host().a40(mixed_size=False, scheduler=EQUAL, active_vgpus=1)
    h.a40(A40B, group=32, mixed_size=False, scheduler=EQUAL)
    h.vgpu(A40, "A40-8Q", owner=DOMAIN)
    h.running = {DOMAIN: "vm1"}
    p = plan(cfg(vgpu_entry("{A40-8Q: 0}", extra=POOL)), None, h.view())
    assert [s.target for s in p.steps if isinstance(s, LayoutSetMixedSize)] == [str(A40B)]   # the empty one only
    assert p.blocked == []
    assert any(n.startswith(f"{A40} keeps mixed-size mode off for pool 'desk': it holds 1 vGPU(s)")
               for n in p.notes), p.notes
    assert "keeps mixed-size mode off" in p.text()


@pytest.mark.parametrize("body, message", [
    ("        scheduler: {policy: fixed-share}\n        pool: {name: gold, mixed_size: true}\n",
     "pool 'gold' is fixed-share, and NVIDIA has no fixed share in mixed-size mode"),
    ("          mixed_size: false\n" + POOL, "vgpu.mixed_size: false in mixed-size pool 'desk'"),
    ("        scheduler: {policy: equal-share}\n        pool: {name: desk, mixed_size: yes please}\n",
     "mixed_size"),
])
def test_config_refusals(body, message):
    with pytest.raises(InputError) as e:
        cfg(vgpu_entry("{A40-8Q: 0}", extra=body))
    assert message in str(e.value)
    assert str(e.value).startswith("layout.yaml:")


def test_two_entries_of_one_pool_agree_on_the_mode():
    body = (vgpu_entry("{A40-8Q: 0}", select="{address: '0000:81:00.0'}", extra=POOL)
            + vgpu_entry("{A40-8Q: 0}", select="{address: '0000:82:00.0'}",
                         extra="        scheduler: {policy: equal-share}\n        pool: {name: desk}\n"))
    with pytest.raises(InputError) as e:
        cfg(body)
    assert "a pool has one vGPU mode" in str(e.value)


# --- through the hook on a simulated host: a mixed-size pool's GPU ---------------------------------

def test_admission_on_a_mixed_size_pool_places_sizes_side_by_side_at_placement_ids(tmp_path):
    """Two sizes on one GPU of an equal-share mixed-size pool through the hook (admission decides, the
    simulated kernel writes the placement id); a third vGPU that no free placement id takes is refused
    by admission with nothing made, though framebuffer is free."""
    from test_hook import start
    from test_mixed_size import _placements, spec
    from test_tenancy import tdom, uid
    from vgpuhost.io.state import StateStore
    from vgpuhost.model.tenancy import Tenant
    from vgpuhost.ops import tenancy
    from vgpuhost.policy import admission as adm
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.nvml import SimNvml
    from vgpuhost.sim.spec import parse_spec
    host = materialise(parse_spec(spec("A40", "mdev", True)), tmp_path / "h")
    gpu = "0000:21:00.0"
    SimNvml(host).set_scheduler_state(gpu, EQUAL)
    s = StateStore(host.state_dir)
    tenancy.set_pools(s, [adm.Pool("desk", "equal-share", ("burstable", "best-effort"), (gpu,))])
    tenancy.add(s, Tenant("web"))
    def dom(i, prof):
        return tdom(f"m{i}", uid("d2d2d2d2", i), uid("e2e2e2e2", i), tenant="web", profile=prof, strategy="best-fit")

    assert start(host, "m1", dom(1, "A40-16Q")) == (0, "")
    assert start(host, "m2", dom(2, "A40-8Q")) == (0, "")          # a second size on the same GPU
    assert _placements(host) == {uid("e2e2e2e2", 1): 0, uid("e2e2e2e2", 2): 24}
    # 24 GiB are free, but a 16Q's ids are 0 and 24, both taken: admission refuses, nothing is made
    rc, err = start(host, "m3", dom(3, "A40-16Q"))
    assert rc == 2 and err.count("\n") == 1 and "A40-16Q" in err, err
    assert set(_placements(host)) == {uid("e2e2e2e2", 1), uid("e2e2e2e2", 2)}
    [row] = [r for r in s.audit_rows() if r.path == "(admission)" and r.result == "refused"]
    assert "m3" in row.operation
    # a 4Q still fits, in the smallest gap (16-24, id 18)
    assert start(host, "m4", dom(4, "A40-4Q")) == (0, "")
    assert _placements(host)[uid("e2e2e2e2", 4)] == 18


def test_apply_turns_a_mixed_size_pools_empty_gpus_to_mixed_size_and_plan_says_so(make_host, tmp_path, capsys):
    """`plan` and `apply` on a simulated host: the pool's note says mixed-size, apply turns the mode on
    (read back from the simulated NVML); a GPU holding a vGPU keeps equal-size mode at a later apply."""
    from vgpuhost.cli.main import main
    from vgpuhost.io.state import StateStore
    from vgpuhost.ops.vgpu import create
    from vgpuhost.sim.nvml import SimNvml
    from test_hook import GPU_HI, GPU_LO, mixed
    host = mixed(make_host)                     # two A40s (classic mdev) and an L40S
    gpus = [GPU_LO, GPU_HI]
    for g in gpus:                              # the pool's policy already: no scheduler step
        SimNvml(host).set_scheduler_state(g, EQUAL)
    # one GPU gets a vGPU first (in equal-size mode): it must keep its mode
    create(host, StateStore(host.state_dir), profile="A40-8Q", gpu=gpus[0], owner="6695eb01-f6a4-8304-79aa-97f2502e1777")
    cfg = tmp_path / "layout.yaml"
    cfg.write_text("version: 1\nlayouts:\n  desk:\n    gpus:\n"
                   "      - select: {board: A40}\n        mode: vgpu\n        vgpu: {types: {A40-8Q: 0}}\n"
                   "        scheduler: {policy: equal-share}\n        pool: {name: desk, mixed_size: true}\n")
    assert main(["--root", str(host.root), "plan", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "pool desk (equal-share, serves burstable, best-effort, mixed-size)" in out, out
    assert f"{gpus[0]} keeps mixed-size mode off for pool 'desk'" in out, out
    assert main(["--root", str(host.root), "apply", "-c", str(cfg)]) == 0
    capsys.readouterr()
    nv = SimNvml(host)
    assert [nv.heterogeneous_mode(g) for g in gpus] == [False, True]
    [row] = [r for r in StateStore(host.state_dir).audit_rows() if "heterogeneous" in r.path or "mixed" in r.path]
    assert str(GPU_HI) in row.path


L40S_POOL = ("version: 1\nlayouts:\n  desk:\n    gpus:\n"
             "      - select: {board: L40S}\n        mode: vgpu\n        vgpu:\n          types: TYPES\n"
             "        scheduler: {policy: best-effort}\n        pool: {name: desk, mixed_size: true}\n")


def test_a_pool_gpu_holding_only_the_layouts_vgpus_switches_and_keeps_their_ids(make_host, tmp_path):
    """Trial 5 finding 6: a pool GPU kept in equal-size mode by a manual vGPU is drift for `assert` (marked:
    apply cannot fix it now, so apply itself does not fail); once only the layout's own vGPU is left, the
    plan removes it, turns the mode on and re-creates it on the same VF (read back from the simulated
    NVML, the state store and the audit log)."""
    from vgpuhost.io.state import StateStore
    from vgpuhost.model.values import PciAddress
    from vgpuhost.ops import layout as ops_layout
    from vgpuhost.ops.vgpu import create, remove
    from vgpuhost.plan.layout import EMPTY_MARK
    from vgpuhost.policy.config import load
    from vgpuhost.sim.nvml import SimNvml
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    gpu = PciAddress.parse("0000:21:00.0")
    (tmp_path / "ms.yaml").write_text(L40S_POOL.replace("TYPES", "{L40S-8Q: 1}"))
    c = load(tmp_path / "ms.yaml")
    manual = create(host, store, profile="L40S-8Q", gpu=gpu).id
    ops_layout.apply(host, store, c, "desk")          # exit 0: the busy GPU keeps its mode, not a failed apply
    nv = SimNvml(host)
    assert nv.heterogeneous_mode(gpu) is False
    drift = ops_layout.check(host, store, c, "desk")
    line = f"- {gpu} mixed-size on (host has off; pool 'desk') {EMPTY_MARK}"
    assert drift.diff == [line] and drift.reboot == [line] and not drift.in_sync
    [mine] = [r.id for r in store.vgpu_records(owner="layout") if r.gpu == str(gpu)]
    remove(host, store, manual)                       # now only the layout's own vGPU holds the GPU
    p = ops_layout.plan(host, store, c, "desk")
    assert [(s.kind, s.action) for s in p.steps] == [
        ("vgpu", f"remove L40S-8Q {mine}"), ("mixed-size", "turn mixed-size mode on"), ("vgpu", "create 1 x L40S-8Q")]
    assert "on the same VF" in p.steps[0].why
    n_audit = len(store.audit_rows())
    ops_layout.apply(host, store, c, "desk")
    assert nv.heterogeneous_mode(gpu) is True
    assert [r.id for r in store.vgpu_records(owner="layout") if r.gpu == str(gpu)] == [mine]
    assert (host.root / f"sys/bus/pci/devices/{mine}/nvidia/current_vgpu_type").read_text().strip() != "0"
    ops = [r.operation for r in store.audit_rows()[n_audit:]]
    assert [o.split(" owner")[0] for o in ops if "placement" not in o][:3] == [
        f"vgpu remove {mine}", f"vgpu mode {gpu} --mixed-size on", "vgpu create L40S-8Q"], ops
    assert ops_layout.check(host, store, c, "desk").in_sync


def test_a_mixed_size_pool_layout_declares_two_sizes_and_apply_makes_both(make_host, tmp_path):
    """Trial 5 finding 12: a mixed-size pool's layout may hold two framebuffer sizes without
    vgpu.mixed_size (the pool sets it); apply turns the mode on and makes both at distinct placement
    ids (read back from the simulated NVML, the VFs' placement_id and the state store).  A set no
    placement ids can hold is refused at read time, and a GPU the pool keeps in equal-size mode (a
    manual vGPU on it) blocks the plan, saying why."""
    from vgpuhost.io.state import StateStore
    from vgpuhost.model.values import PciAddress
    from vgpuhost.ops import layout as ops_layout
    from vgpuhost.ops.vgpu import create
    from vgpuhost.policy.config import load
    from vgpuhost.sim.nvml import SimNvml
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    gpu = PciAddress.parse("0000:21:00.0")
    f = tmp_path / "ms.yaml"
    f.write_text(L40S_POOL.replace("TYPES", "{L40S-8Q: 3, L40S-4Q: 2}"))
    c = load(f)
    assert c.layouts["desk"].entries[0].vgpu.mixed_size is True
    ops_layout.apply(host, store, c, "desk")
    assert SimNvml(host).heterogeneous_mode(gpu) is True
    mine = [r for r in store.vgpu_records(owner="layout") if r.gpu == str(gpu)]
    assert sorted(r.type_name for r in mine) == ["L40S-4Q"] * 2 + ["L40S-8Q"] * 3
    ids = [(host.root / f"sys/bus/pci/devices/{r.id}/nvidia/placement_id").read_text().strip() for r in mine]
    assert len(set(ids)) == 5, ids
    assert ops_layout.check(host, store, c, "desk").in_sync
    f.write_text(L40S_POOL.replace("TYPES", "{L40S-8Q: 4, L40S-4Q: 1}"))      # 48 GB, but no id left for a 4Q
    with pytest.raises(InputError) as e:
        load(f)
    assert "do not all find a free placement id" in str(e.value) and str(e.value).startswith(f"{f}:8:")
    f.write_text(L40S_POOL.replace("TYPES", "{L40S-8Q: 1, L40S-4Q: 1}").replace(", mixed_size: true", ""))
    with pytest.raises(InputError) as e:
        load(f)
    assert "mixed_size: true}" in str(e.value.hint)                   # the fix it names: a mixed-size pool
    other = make_host("l40s-vendor-vfio")
    create(other, StateStore(other.state_dir), profile="L40S-8Q", gpu=gpu)
    f.write_text(L40S_POOL.replace("TYPES", "{L40S-8Q: 1, L40S-4Q: 1}"))
    p = ops_layout.plan(other, StateStore(other.state_dir), load(f), "desk")
    assert any(b.startswith(f"{gpu} stays in equal-size mode") for b in p.blocked), p.blocked
