"""MIG on demand (issue 30, item 4): a re-layout keeps busy GPU instances and re-slices only free
ones; the simulator records which GPU instance each MIG-backed vGPU sits on, as NVML's
``nvmlVgpuInstanceGetGpuInstanceId`` reports it on a real host.

Everything is read back through a fresh simulated NVML (:class:`SimNvml`), the simulated sysfs tree
(``current_vgpu_type``) and the state store's audit log.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.model.errors import RefusedError
from vgpuhost.model.values import PciAddress
from vgpuhost.ops import mig
from vgpuhost.ops.vgpu import create, remove
from vgpuhost.sim.kernel import SimKernel
from vgpuhost.sim.nvml import SimNvml

H200 = PciAddress.parse("0000:18:00.0")      # the shipped h200-mig-on spec's GPU


def gis(host):
    """``{gi_id: (profile name, start)}`` read through a fresh simulated NVML."""
    nv = SimNvml(host)
    names = {p.profile_id: p.name for p in nv.gi_profiles(H200)}
    return {g.gi_id: (names[g.profile_id], g.start) for g in nv.gpu_instances(H200)}


def busy(host):
    return SimNvml(host).gpu_instance_vgpus(H200)


def vf_type(host, vf):
    return (host.pci_device(vf) / "nvidia" / "current_vgpu_type").read_text().strip()


@pytest.fixture
def h200(make_host):
    return make_host("h200-mig-on")


def test_nvml_says_which_gpu_instance_each_mig_backed_vgpu_sits_on(h200):
    store = StateStore(h200.state_dir)
    mig.apply(h200, store, H200, "3g.71gb=2")
    assert busy(h200) == {}
    one = create(h200, store, profile="H200X-3-71C")
    first = busy(h200)
    assert list(first.values()) == [1] and set(first) <= set(gis(h200))
    two = create(h200, store, profile="H200X-3-71C")
    assert sorted(busy(h200)) == sorted(gis(h200)) and set(busy(h200).values()) == {1}
    # the first vGPU stays on its GPU instance when the second goes
    remove(h200, store, two.id)
    assert busy(h200) == first
    assert vf_type(h200, one.id) != "0"


def test_relayout_keeps_the_busy_instance_and_reslices_the_free_one(h200):
    store = StateStore(h200.state_dir)
    mig.apply(h200, store, H200, "3g.71gb=2")
    vm = create(h200, store, profile="H200X-3-71C")
    (held,) = busy(h200)
    before = gis(h200)[held]
    rows = len(store.audit_rows())
    out = mig.apply(h200, store, H200, "3g.71gb=1,2g.35gb=1,1g.18gb=1")
    after = gis(h200)
    assert after[held] == before                             # same id, profile and start slice
    assert Counter(p for p, _ in after.values()) == Counter({"3g.71gb": 1, "2g.35gb": 1, "1g.18gb": 1})
    assert busy(h200) == {held: 1} and vf_type(h200, vm.id) != "0"
    # one destroy and two creates, each audited
    new_rows = store.audit_rows()[rows:]
    assert [r.path for r in new_rows] == ["nvml:nvmlGpuInstanceDestroy"] + \
        ["nvml:nvmlDeviceCreateGpuInstanceWithPlacement"] * 2
    assert any("kept the busy GPU instance" in n for n in out.notes)
    # placements are the device's (start slices) and do not overlap
    nv = SimNvml(h200)
    profs = {p.profile_id: p for p in nv.gi_profiles(H200)}
    used = 0
    for g in nv.gpu_instances(H200):
        assert (g.start, g.size) in profs[g.profile_id].placements
        assert not used & (((1 << g.size) - 1) << g.start)
        used |= ((1 << g.size) - 1) << g.start


@pytest.mark.parametrize("layout,why", [
    ("none", "and the layout has no 3g.71gb for it"),
    ("7g.141gb=1", "and the layout has no 3g.71gb for it"),
    ("4g.71gb=1,3g.71gb=1", "do not fit beside it"),
])
def test_a_layout_that_needs_the_busy_instance_gone_is_refused_naming_it(h200, capsys, layout, why):
    store = StateStore(h200.state_dir)
    mig.apply(h200, store, H200, "3g.71gb=2")
    # one vGPU on each 3g.71gb, then the one on slice 4 goes: the busy instance is the one at slice 0,
    # where the 4g.71gb (which can start only there) would have to go
    vms = [create(h200, store, profile="H200X-3-71C") for _ in range(2)]
    on = SimKernel(h200).gi_of_vgpus(SimKernel(h200).meta(), str(H200))
    at4 = next(v for v in vms if gis(h200)[on[v.id]][1] == 4)
    remove(h200, store, at4.id)
    (held,) = busy(h200)
    name, start = gis(h200)[held]
    assert (name, start) == ("3g.71gb", 0)
    before, rows = gis(h200), len(store.audit_rows())
    with pytest.raises(RefusedError) as e:
        mig.apply(h200, store, H200, layout)
    assert f"GPU instance {held} ({name} at memory slice {start}) holds 1 vGPU" in e.value.message
    assert why in e.value.message and str(H200) in e.value.message
    assert gis(h200) == before and len(store.audit_rows()) == rows
    assert main(["--root", str(h200.root), "mig", "apply", "--gpu", str(H200), layout]) == 2
    assert f"GPU instance {held}" in capsys.readouterr().err


LAYOUTS = ["3g.71gb=2", "3g.71gb=1,2g.35gb=1,1g.18gb=1", "2g.35gb=3,1g.18gb=1", "1g.18gb=7",
           "4g.71gb=1,3g.71gb=1", "7g.141gb=1", "1g.18gb=3,3g.71gb=1", "none"]
PROFILES = ["H200X-1-18C", "H200X-2-35C", "H200X-3-71C", "H200X-4-71C", "H200X-7-141C"]
OPS = st.lists(st.one_of(st.tuples(st.just("apply"), st.sampled_from(LAYOUTS)),
                         st.tuples(st.just("start"), st.sampled_from(PROFILES)),
                         st.tuples(st.just("vm"), st.sampled_from(PROFILES)),
                         st.tuples(st.just("stop"), st.integers(0, 6))), min_size=1, max_size=6)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_relayouts_and_starts_never_destroy_a_busy_gpu_instance(make_host, ops):
    """Random re-layouts (mig apply), vGPUs made by hand, VM starts with MIG on demand (prepare begin:
    a GPU instance made when none is free) and stops (release end: it is destroyed): no step ever
    destroys a GPU instance a vGPU sits on, and once every VM is stopped nothing made on demand is left."""
    from vgpuhost.libvirt.domxml import parse_domain
    from vgpuhost.ops.devices import prepare, release_domain
    host = make_host("h200-mig-on")
    store = StateStore(host.state_dir)
    migdemand.set_opt_in(host, store, H200, True, actor="test")
    held_vfs = []                                # (vGPU id, domain UUID or None)
    free_vfs = list(vfs(host))
    for n, (op, arg) in enumerate(ops):
        held = {gi: gis(host)[gi] for gi in busy(host)}
        if op == "apply":
            try:
                mig.apply(host, store, H200, arg)
            except RefusedError as e:
                assert "busy GPU instance" in e.message or "does not fit" in e.message
        elif op == "start":
            try:
                held_vfs.append((create(host, store, profile=arg).id, None))
                free_vfs.remove(held_vfs[-1][0])
            except RefusedError:
                pass                                # no free GPU instance of its profile
        elif op == "vm":
            uuid = f"11111111-2222-4333-8444-{n:012d}"
            try:
                prepare(host, parse_domain(vm_xml(f"vm{n}", uuid, arg, free_vfs[0])), actor="test", store=store)
                held_vfs.append((free_vfs.pop(0), uuid))
            except RefusedError:
                pass                                # no free slice range for it: nothing made
        elif held_vfs:
            vid, uuid = held_vfs.pop(arg % len(held_vfs))
            # the stopped vGPU's own instance may go (made on demand for it); every other busy one stays
            own = SimKernel(host).gi_of_vgpus(SimKernel(host).meta(), str(H200)).get(vid)
            held.pop(own, None)
            if uuid is None:
                remove(host, store, vid)
            else:
                release_domain(host, store, uuid, actor="test")
            free_vfs.append(vid)
        now = gis(host)
        # every instance busy before the step is still there, same id, profile and start slice
        assert all(now.get(gi) == where for gi, where in held.items())
        # every running vGPU still holds its VF and sits on a live GPU instance; what was made on
        # demand is a live instance of a running VM
        on = SimKernel(host).gi_of_vgpus(SimKernel(host).meta(), str(H200))
        assert sorted(on) == sorted(v for v, _ in held_vfs) and all(vf_type(host, v) != "0" for v, _ in held_vfs)
        assert all(g in now for g in on.values()) and len(set(on.values())) == len(on)
        vms = {u for _, u in held_vfs if u}
        assert all(m.owner in vms and m.gi_id in now for m in migdemand.made(store))
    for vid, uuid in held_vfs:
        if uuid is not None:
            release_domain(host, store, uuid, actor="test")
    assert migdemand.made(store) == []


# ---------------------------------------------------------------------------
# MIG on demand through the qemu hook (h200-mig-on: MIG mode on, VFs enabled, no GPU instance)

import io as _io                                             # noqa: E402

from vgpuhost.hook import runtime as hook                    # noqa: E402
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest    # noqa: E402
from vgpuhost.ops import migdemand                           # noqa: E402

from test_hook import domain_xml, pci_hostdev                # noqa: E402

DOM1 = "11111111-2222-4333-8444-0000000000a1"
DOM2 = "11111111-2222-4333-8444-0000000000a2"


def vfs(host):
    return SimKernel(host).meta()["gpus"][str(H200)]["vfs"]


def vm_xml(name, uuid, profile, vf):
    return domain_xml(name, uuid, Metadata(vgpus=[VgpuRequest(profile, vf=PciAddress.parse(vf))]),
                      [pci_hostdev(vf)])


def hook_run(host, name, op, sub, xml, err=None):
    """The hook handler in process, as libvirt runs it; its exit code (its one line goes to ``err``)."""
    return hook.main([name, op, sub, "-"], _io.BytesIO(xml.encode()), err or _io.StringIO(), host=host)


def cli(host, *argv):
    return main(["--root", str(host.root), *argv])


def test_a_vm_starts_on_a_mig_backed_profile_with_no_instance_and_release_destroys_it(h200, capsys):
    store = StateStore(h200.state_dir)
    vf1, vf2 = vfs(h200)[:2]
    xml1 = vm_xml("vm1", DOM1, "H200X-1-18C", vf1)
    # not opted in: the start is refused, saying how to opt in, and nothing is made
    err = _io.StringIO()
    assert hook_run(h200, "vm1", "prepare", "begin", xml1, err) == 2
    assert "unknown vGPU profile 'H200X-1-18C'" in err.getvalue() and "mig on-demand --gpu" in err.getvalue()
    assert gis(h200) == {} and vf_type(h200, vf1) == "0"
    capsys.readouterr()
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    assert migdemand.opted_in(store) == {str(H200)}
    # the start makes a 1g.18gb GPU instance and the vGPU sits on it
    assert hook_run(h200, "vm1", "prepare", "begin", xml1) == 0
    (gi1,) = gis(h200)
    assert gis(h200)[gi1][0] == "1g.18gb" and busy(h200) == {gi1: 1} and vf_type(h200, vf1) != "0"
    assert [(m.owner, m.gi_id) for m in migdemand.made(store)] == [(DOM1, gi1)]
    rows = [r.path for r in store.audit_rows()]
    assert "nvml:nvmlDeviceCreateGpuInstanceWithPlacement" in rows
    # a second VM on a profile of its own gets its own instance; vm1's stop destroys the one made for
    # it, and only that one
    xml2 = vm_xml("vm2", DOM2, "H200X-2-35C", vf2)
    assert hook_run(h200, "vm2", "prepare", "begin", xml2) == 0
    assert len(busy(h200)) == 2 and sorted(m.owner for m in migdemand.made(store)) == [DOM1, DOM2]
    gi2 = next(m.gi_id for m in migdemand.made(store) if m.owner == DOM2)
    assert hook_run(h200, "vm1", "release", "end", xml1) == 0
    assert gi1 not in gis(h200) and vf_type(h200, vf1) == "0"
    assert [m.owner for m in migdemand.made(store)] == [DOM2] and list(gis(h200)) == [gi2]
    assert [r.path for r in store.audit_rows()].count("nvml:nvmlGpuInstanceDestroy") == 1
    assert hook_run(h200, "vm1", "prepare", "begin", xml1) == 0
    (gi1,) = [g for g in gis(h200) if g != gi2]
    # an explicit mig apply declares the layout: the instances it keeps are its own from then on
    # (trial 10a finding 9: the apply took vm1's instance as the layout's 1g.18gb, and vm1's stop then
    # destroyed it, leaving the layout just applied in drift)
    assert cli(h200, "mig", "apply", "--gpu", str(H200), "1g.18gb=1,2g.35gb=1,3g.71gb=1") == 0
    assert gis(h200)[gi1][0] == "1g.18gb" and gis(h200)[gi2][0] == "2g.35gb"
    assert busy(h200) == {gi1: 1, gi2: 1} and vf_type(h200, vf1) != "0"
    assert migdemand.made(store) == []
    adopted = [r.value for r in store.audit_rows() if "is the applied layout's now" in r.value]
    assert len(adopted) == 2 and all(r.startswith("mig.made/0000:18:00.0/") for r in adopted)
    assert cli(h200, "mig", "apply", "--gpu", str(H200), "1g.18gb=1,2g.35gb=2") == 0
    now = gis(h200)
    assert gi1 in now and Counter(p for p, _ in now.values()) == Counter({"1g.18gb": 1, "2g.35gb": 2})
    # a re-layout that needs vm1's instance gone is refused, naming it
    capsys.readouterr()
    assert cli(h200, "mig", "apply", "--gpu", str(H200), "2g.35gb=3") == 2
    assert f"GPU instance {gi1} (1g.18gb at memory slice" in capsys.readouterr().err
    # the stops leave the layout as applied
    assert hook_run(h200, "vm1", "release", "end", xml1) == 0
    assert hook_run(h200, "vm2", "release", "end", xml2) == 0
    assert vf_type(h200, vf1) == "0" and busy(h200) == {} and gis(h200) == now
    assert cli(h200, "mig", "assert", "--gpu", str(H200), "1g.18gb=1,2g.35gb=2") == 0
    assert cli(h200, "reconcile", "--check") == 0


# ---------------------------------------------------------------------------
# kill -9 at every write of the on-demand create (prepare begin) and destroy (release end)

from test_crash import check_host, hook_op, kill_everywhere, run    # noqa: E402

VF1 = "0000:18:00.4"                 # the h200-mig-on spec's first VF


def _opted_in(make_host):
    host = make_host("h200-mig-on")
    assert vfs(host)[0] == VF1
    assert main(["--root", str(host.root), "mig", "on-demand", "--gpu", str(H200), "on"]) == 0
    return host


def _started_on_demand(make_host):
    host = _opted_in(make_host)
    assert hook_run(host, "crash-vm", "prepare", "begin", KILL_XML) == 0 and len(gis(host)) == 1
    return host


KILL_XML = vm_xml("crash-vm", DOM1, "H200X-1-18C", VF1)


def _made_or_nothing(host, log):
    """After the kill and a reconcile: no GPU instance and no record, or (the domain still recorded as
    running: libvirt's release end ends it) the one instance made for it, recorded for it."""
    store = StateStore(host.state_dir)
    now, mine = gis(host), migdemand.made(store)
    if not now and not mine:
        return []
    if DOM1 in store.active_domains() and len(now) == 1 and [m.owner for m in mine] == [DOM1] \
            and list(now.values())[0] == ("1g.18gb", mine[0].start):
        return []
    return [f"GPU instances {now} with records {mine}"]


def _no_leak(host, log):
    """libvirt's release end after the killed call, then a full start and stop: nothing left."""
    out = []
    if run(host, hook_op(host, "release", "end", KILL_XML), log) != 0:
        out.append("the release end after the kill failed")
    if run(host, hook_op(host, "prepare", "begin", KILL_XML), log) != 0:
        out.append("the next prepare begin failed")
    elif len(gis(host)) != 1:
        out.append(f"the next start made {gis(host)}")
    if run(host, hook_op(host, "release", "end", KILL_XML), log) != 0:
        out.append("the next release end failed")
    store = StateStore(host.state_dir)
    if gis(host) or migdemand.made(store):
        out.append(f"left: GPU instances {gis(host)}, records {migdemand.made(store)}")
    if vf_type(host, VF1) != "0":
        out.append("the VF still holds a vGPU")
    return out + check_host(host, log, owners_max={})


def test_kill_during_the_on_demand_create_leaves_no_half_made_instance(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _opted_in, lambda h: hook_op(h, "prepare", "begin", KILL_XML),
                    _made_or_nothing, owners_max={DOM1: 1}, cycle=_no_leak)


def test_kill_during_the_on_demand_destroy_leaves_no_instance_behind(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _started_on_demand, lambda h: hook_op(h, "release", "end", KILL_XML),
                    _made_or_nothing, owners_max={DOM1: 1}, cycle=_no_leak, check_ok=_interrupted_stop_named)


def _interrupted_stop_named(host, rc):
    """``reconcile --check`` after a killed ``release end``: 0, or 1 naming the instance of the stop
    still recorded running (libvirt's next ``release end`` ends it: ``_no_leak``).  The start that made
    it has ended, so its record names no live maker (before trial 10a finding 8's fix, the test's own
    pid, alive, hid it)."""
    if rc == 0:
        return True
    store = StateStore(host.state_dir)
    return rc == 1 and [why for _, why in migdemand.left(host, store)] == [
        "an interrupted stop: its release end did not finish"]


def test_reconcile_destroys_what_a_start_killed_before_the_domain_was_recorded_made(make_host, tmp_path):
    """Killed right after the GPU instance landed (the domain not recorded as running yet): reconcile
    alone destroys it; reconcile --check reported it first."""
    host = _opted_in(make_host)
    log = tmp_path / "w.log"
    assert run(host, hook_op(host, "prepare", "begin", KILL_XML), log, kill_at=1, when="after") == -9
    store = StateStore(host.state_dir)
    assert len(gis(host)) == 1 and [m.owner for m in migdemand.made(store)] == [DOM1]
    assert DOM1 not in store.active_domains()
    assert run(host, lambda: main(["--root", str(host.root), "reconcile", "--check"]), log) == 1
    assert run(host, lambda: main(["--root", str(host.root), "reconcile"]), log) == 0
    assert gis(host) == {} and migdemand.made(StateStore(host.state_dir)) == []
    assert run(host, lambda: main(["--root", str(host.root), "reconcile", "--check"]), log) == 0


def test_capacity_types_and_the_exporter_count_the_instances_that_could_be_made(h200, capsys):
    """A fresh MIG host (7 slices free, no GPU instance): nothing counts until the GPU opts in; then
    capacity, types and the exporter's free instances count what a start would make, and the counts
    follow what is made and re-sliced."""
    from vgpuhost.io.state import StateStore as Store
    from vgpuhost.ops.metering import host_series
    store = StateStore(h200.state_dir)

    def capacity(profile):
        capsys.readouterr()
        code = cli(h200, "--json", "capacity", "--profile", profile)
        out = capsys.readouterr().out
        return code, (__import__("json").loads(out)["profiles"][0]["fits"] if code == 0 else None)

    assert capacity("H200X-1-18C") == (2, None)
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    assert capacity("H200X-1-18C") == (0, 7)
    assert capacity("H200X-3-71C") == (0, 2) and capacity("H200X-7-141C") == (0, 1)
    capsys.readouterr()
    assert cli(h200, "--json", "types", "--gpu", str(H200)) == 0
    avail = {t["name"]: t["available_instances"] for t in __import__("json").loads(capsys.readouterr().out)["types"]}
    assert avail["H200X-1-18C"] == 7 and avail["H200X-4-71C"] == 1
    assert host_series(h200, Store(h200.state_dir))["free_instances"][("H200X-1-18C", "")] == 7
    # a 3g.71gb made (one way of two) and a vGPU on it: the counts follow the slices left
    mig.apply(h200, store, H200, "3g.71gb=1")
    create(h200, store, profile="H200X-3-71C")
    assert capacity("H200X-3-71C") == (0, 1) and capacity("H200X-7-141C") == (0, 0)     # listed with 0
    # the 3g.71gb takes memory slices 4-7 and 3 of the 7 compute slices: four 1g.18gb fit in slices 0-3
    assert capacity("H200X-1-18C") == (0, 4)
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "off") == 0
    assert capacity("H200X-1-18C") == (2, None)


def test_a_layout_opts_its_mig_gpus_in_and_a_bad_value_is_one_line(h200, tmp_path, capsys):
    cfg = tmp_path / "mig.yaml"
    cfg.write_text("version: 1\nlayouts:\n  m:\n    gpus:\n      - select: {board: H200X}\n        mode: mig\n"
                   "        mig:\n          instances: {3g.71gb: 1}\n          on_demand: true\n")
    store = StateStore(h200.state_dir)
    assert cli(h200, "apply", "-c", str(cfg)) == 0
    assert migdemand.opted_in(store) == {str(H200)}
    assert any(r.operation.startswith("mig on-demand on") for r in store.audit_rows())
    cfg.write_text(cfg.read_text().replace("on_demand: true", "on_demand: yes please"))
    capsys.readouterr()
    assert cli(h200, "config", "check", "-c", str(cfg)) == 2
    err = capsys.readouterr().err
    assert "mig.on_demand is a string: write true or false" in err and "yes please" not in err and err.count("\n") == 1


# ---------------------------------------------------------------------------
# the planner alone (pure): whatever is busy, a plan keeps it or the layout is refused naming it

from vgpuhost.model.nvml import GiProfile, GpuInstance         # noqa: E402
from vgpuhost.plan.mig import plan_layout                     # noqa: E402
from vgpuhost.policy.mig import place                         # noqa: E402

H200_PROFILES = [   # id, name, compute slices, MiB, max, placements (start, size): the catalog's H200 table
    GiProfile(19, "1g.18gb", 1, 16384, 7, tuple((s, 1) for s in range(7))),
    GiProfile(15, "1g.35gb", 1, 32768, 4, tuple((s, 2) for s in (0, 2, 4, 6))),
    GiProfile(14, "2g.35gb", 2, 32768, 3, tuple((s, 2) for s in (0, 2, 4))),
    GiProfile(9, "3g.71gb", 3, 69632, 2, ((0, 4), (4, 4))),
    GiProfile(5, "4g.71gb", 4, 69632, 1, ((0, 4),)),
    GiProfile(0, "7g.141gb", 7, 139264, 1, ((0, 8),)),
]
COUNTS = st.dictionaries(st.sampled_from([19, 15, 14, 9, 5, 0]), st.integers(1, 3), max_size=3)


@settings(max_examples=30, deadline=None)
@given(have=COUNTS, wanted=COUNTS, busy_bits=st.integers(0, 127))
def test_a_plan_never_destroys_a_busy_gpu_instance(have, wanted, busy_bits):
    found = place(H200_PROFILES, have)
    current = [GpuInstance(i + 1, p.profile_id, start, dict(p.placements)[start])
               for i, (p, start) in enumerate(found or [])]
    busy = {g.gi_id: 1 for k, g in enumerate(current) if busy_bits >> k & 1}
    try:
        lp = plan_layout(H200_PROFILES, current, wanted, busy=busy)
    except RefusedError as e:
        assert "does not fit" in e.message or (busy and "busy GPU instance" in e.message
                                               and any(f"GPU instance {g} (" in e.message for g in busy))
        return
    destroyed = {d.gi_id for d in lp.destroy}
    assert not destroyed & set(busy)
    kept = {g.gi_id for g in lp.keep}
    assert set(busy) <= kept
    # the result is the wanted layout, each new instance on a placement the device allows, none overlapping
    after = [g for g in current if g.gi_id not in destroyed] + [
        GpuInstance(100 + i, c.profile_id, c.start, c.size) for i, c in enumerate(lp.create)]
    assert Counter(g.profile_id for g in after) == Counter({k: v for k, v in wanted.items() if v})
    used = 0
    for g in after:
        assert (g.start, g.size) in dict((p.profile_id, p.placements) for p in H200_PROFILES)[g.profile_id]
        assert not used & (((1 << g.size) - 1) << g.start)
        used |= ((1 << g.size) - 1) << g.start


def test_the_agents_capacity_counts_them_and_follows_the_opt_in(h200):
    import json as _json
    from vgpuhost.agent import api

    def fits(agent, profile):
        doc = _json.loads(api.get_capacity(agent, api.Request({}, {}, None, "test", 1, api.READ)).body)
        return next((p["fits"] for p in doc["profiles"] if p["profile"] == profile), None)

    agent = api.Agent(h200)
    assert fits(agent, "H200X-1-18C") is None
    assert cli(h200, "--local", "mig", "on-demand", "--gpu", str(H200), "on") == 0
    assert fits(agent, "H200X-1-18C") == 7 and fits(agent, "H200X-7-141C") == 1
    assert cli(h200, "--local", "mig", "on-demand", "--gpu", str(H200), "off") == 0
    assert fits(agent, "H200X-1-18C") is None


def test_an_instance_another_vgpu_took_meanwhile_is_left_to_it_at_release(h200, capsys):
    """Without tenancy's host lock a vGPU made by hand can land on a GPU instance made on demand once the
    domain's own vGPU is gone: the domain's stop then leaves that instance (an audit row says so) and
    keeps its record (trial 5 finding 2), so once it is empty reconcile --check lists it and the next
    release end destroys it."""
    from vgpuhost.libvirt.domxml import parse_domain
    from vgpuhost.ops.devices import prepare, release_domain
    store = StateStore(h200.state_dir)
    migdemand.set_opt_in(h200, store, H200, True, actor="test")
    vf1 = vfs(h200)[0]
    prepare(h200, parse_domain(vm_xml("vm1", DOM1, "H200X-1-18C", vf1)), actor="test", store=store)
    (gi,) = gis(h200)
    remove(h200, store, vf1, owner=DOM1, while_running=True)     # its vGPU gone by hand
    other = create(h200, store, profile="H200X-1-18C")       # and another takes the instance
    assert busy(h200) == {gi: 1}
    assert release_domain(h200, store, DOM1, actor="test") == []
    assert gis(h200) == {gi: ("1g.18gb", gis(h200)[gi][1])} and vf_type(h200, other.id) != "0"
    assert [(m.owner, m.gi_id) for m in migdemand.made(store)] == [(DOM1, gi)]      # still made on demand
    assert any(r.result == "kept" and "kept:" in r.value for r in store.audit_rows())
    capsys.readouterr()
    assert cli(h200, "reconcile", "--check") == 0            # in use by the other vGPU: not left
    remove(h200, store, other.id)
    assert gis(h200) == {gi: ("1g.18gb", gis(h200)[gi][1])} and busy(h200) == {}
    capsys.readouterr()
    assert cli(h200, "reconcile", "--check") == 1
    out = capsys.readouterr().out
    assert f"left: GPU instance {gi} at memory slice" in out and "left empty after its owner's stop" in out
    # another domain's release end finds it empty and destroys it, with its own instance
    xml2 = vm_xml("vm2", DOM2, "H200X-2-35C", vfs(h200)[1])
    assert hook_run(h200, "vm2", "prepare", "begin", xml2) == 0 and len(gis(h200)) == 2
    assert hook_run(h200, "vm2", "release", "end", xml2) == 0
    assert gis(h200) == {} and migdemand.made(store) == []
    assert cli(h200, "reconcile", "--check") == 0


def test_concurrent_starts_leave_no_gpu_instance_after_their_stops(make_host, capsys):
    """Trial 5 finding 2: six starts at once (separate processes, no agent, no tenancy): each makes a
    GPU instance, and the driver puts each vGPU on the lowest free instance of its profile, often
    another start's.  After the six release ends no GPU instance and no record is left, and reconcile
    --check is in sync; done three times over (the race led to a leak in most tries before)."""
    import os
    for _ in range(3):
        host = _opted_in(make_host)
        store = StateStore(host.state_dir)
        xmls = [vm_xml(f"m{i}", f"22222222-2222-4333-8444-00000000000{i}", "H200X-1-18C", vf)
                for i, vf in enumerate(vfs(host)[:6])]
        pids = []
        for i, xml in enumerate(xmls):
            pid = os.fork()
            if pid == 0:                                    # a child: one hook process, as libvirt runs it
                code = 1
                try:
                    err = _io.StringIO()
                    code = hook_run(host, f"m{i}", "prepare", "begin", xml, err)
                    os.write(2, err.getvalue().encode())
                finally:
                    os._exit(code)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
        assert codes == [0] * 6
        assert len(gis(host)) == 6 and sorted(busy(host).values()) == [1] * 6
        assert len(migdemand.made(store)) == 6
        for i, xml in enumerate(xmls):
            assert hook_run(host, f"m{i}", "release", "end", xml) == 0
        assert gis(host) == {} and migdemand.made(store) == []
        capsys.readouterr()
        assert cli(host, "reconcile", "--check") == 0


def test_a_start_that_fails_after_the_instance_was_made_destroys_it(h200):
    """The VF's create write fails (an injected EINVAL): the start exits with the device error, and the GPU
    instance made for it is destroyed again, both changes audited."""
    import errno
    from vgpuhost.libvirt.domxml import parse_domain
    from vgpuhost.model.errors import DeviceError
    from vgpuhost.ops.devices import prepare
    from vgpuhost.sim.kernel import STATE
    store = StateStore(h200.state_dir)
    migdemand.set_opt_in(h200, store, H200, True, actor="test")
    vf1 = vfs(h200)[0]
    kernel = SimKernel(h200)
    meta = kernel.meta()
    meta["faults"] = [{"op": "set_type", "device": vf1, "errno": errno.EINVAL, "count": 1}]
    kernel.save_meta(meta, STATE)
    with pytest.raises(DeviceError):
        prepare(h200, parse_domain(vm_xml("vm1", DOM1, "H200X-1-18C", vf1)), actor="test", store=store)
    assert gis(h200) == {} and migdemand.made(store) == [] and vf_type(h200, vf1) == "0"
    paths = [r.path for r in store.audit_rows()]
    assert paths.count("nvml:nvmlDeviceCreateGpuInstanceWithPlacement") == 1
    assert paths.count("nvml:nvmlGpuInstanceDestroy") == 1
    assert not store.journal_entries(open_only=True)


def _in_child(fn):
    """``fn()`` (an exit code) in a forked process, as the hook runs; its exit code."""
    import os
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_stop_killed_between_the_vgpu_and_the_instance_is_named_by_the_check(h200, capsys):
    """Trial 5 finding 17: ``release end`` killed after the vGPU went and before the GPU instance made
    on demand did (the domain still recorded running): reconcile --check lists the instance as left by
    an interrupted stop, and reconcile destroys it."""
    store = StateStore(h200.state_dir)
    migdemand.set_opt_in(h200, store, H200, True, actor="test")
    vf1 = vfs(h200)[0]
    xml1 = vm_xml("vm1", DOM1, "H200X-1-18C", vf1)
    assert _in_child(lambda: hook_run(h200, "vm1", "prepare", "begin", xml1)) == 0   # its process gone since
    (gi,) = gis(h200)
    remove(h200, store, vf1, owner=DOM1, while_running=True)     # the release's first step, then the kill
    assert DOM1 in store.active_domains() and busy(h200) == {} and vf_type(h200, vf1) == "0"
    capsys.readouterr()
    assert cli(h200, "reconcile", "--check") == 1
    out = capsys.readouterr().out
    assert f"left: GPU instance {gi} at memory slice" in out
    assert "an interrupted stop: its release end did not finish" in out
    assert "a stop killed before it dropped the row" in out
    assert cli(h200, "reconcile") == 0
    assert gis(h200) == {} and migdemand.made(store) == []
    assert cli(h200, "reconcile", "--check") == 0


def test_a_start_on_a_cordoned_gpu_makes_no_gpu_instance_there(h200, capsys):
    """Trial 5 finding 11: an on-demand start on a GPU out of service (cordoned by hand) is refused
    at once, naming the cordon, with no NVML write (no GPU instance made and destroyed again)."""
    store = StateStore(h200.state_dir)
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    assert cli(h200, "gpu", "cordon", str(H200), "--reason", "test") == 0
    rows = len(store.audit_rows())
    err = _io.StringIO()
    xml1 = vm_xml("vm1", DOM1, "H200X-1-18C", vfs(h200)[0])
    assert hook_run(h200, "vm1", "prepare", "begin", xml1, err) == 2
    line = err.getvalue()
    assert "out of service" in line and "test" in line and "try again" not in line
    assert gis(h200) == {} and migdemand.made(store) == []
    new_rows = store.audit_rows()[rows:]
    assert not [r for r in new_rows if r.path.startswith("nvml:")]
    # the refusal has its audit row (trial 5 retest N5)
    assert [(r.path, r.result) for r in new_rows if r.result == "refused"] == [(f"(mig on-demand) {H200}", "refused")]


def test_host_check_calls_vgpu_ready_on_an_opted_in_gpu_with_no_instance(h200, capsys):
    """Trial 5 finding 16: MIG mode on, no GPU instance: vGPU is blocked (make instances) until the GPU
    opts in to MIG on demand; then host check calls it ready, as capacity counts 7 that fit."""
    import json as _json

    def verdict():
        capsys.readouterr()
        cli(h200, "--json", "host", "check")
        doc = _json.loads(capsys.readouterr().out)
        mode = next(m for m in doc["modes"] if m["mode"] == "vgpu")
        (v,) = [x for x in mode["gpus"] if str(H200) in x.values()]
        return v

    assert verdict()["verdict"] == "blocked"
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    v = verdict()
    assert v["verdict"] == "ready" and "MIG on demand" in v["reason"] and "mig apply" not in (v.get("fix") or "")
    capsys.readouterr()
    cli(h200, "--json", "host", "check")
    mine = [f for f in _json.loads(capsys.readouterr().out)["findings"] if f["subject"] == str(H200)]
    assert not [f for f in mine if "mig apply" in f["fix"] or f["code"] == "VGPU_NO_TYPES"]
    assert [f["severity"] for f in mine if f["code"] == "VGPU_MIG_ON_DEMAND"] == ["info"]
    assert gis(h200) == {}


def test_a_full_on_demand_gpu_lists_every_mig_backed_profile_with_0(h200, capsys):
    """Trial 5 finding 15: a 4g.71gb and a 3g.71gb made on demand fill the GPU: capacity, types and the
    exporter's free instances still list the board's other MIG-backed profiles, each with 0."""
    import json as _json
    from vgpuhost.ops.metering import host_series
    store = StateStore(h200.state_dir)
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    vf1, vf2 = vfs(h200)[:2]
    assert hook_run(h200, "p40", "prepare", "begin", vm_xml("p40", DOM1, "H200X-4-71C", vf1)) == 0
    assert hook_run(h200, "p33", "prepare", "begin", vm_xml("p33", DOM2, "H200X-3-71C", vf2)) == 0
    assert sorted(p for p, _ in gis(h200).values()) == ["3g.71gb", "4g.71gb"]
    capsys.readouterr()
    assert cli(h200, "--json", "capacity", "--profile", "H200X-1-18C") == 0
    assert _json.loads(capsys.readouterr().out)["profiles"][0]["fits"] == 0
    assert cli(h200, "--json", "capacity") == 0
    fits = {p["profile"]: p["fits"] for p in _json.loads(capsys.readouterr().out)["profiles"]}
    assert {k: fits[k] for k in ("H200X-1-18C", "H200X-2-35C", "H200X-7-141C", "H200X-4-71C")} == \
        {"H200X-1-18C": 0, "H200X-2-35C": 0, "H200X-7-141C": 0, "H200X-4-71C": 0}
    assert cli(h200, "--json", "types", "--gpu", str(H200)) == 0
    avail = {t["name"]: t["available_instances"] for t in _json.loads(capsys.readouterr().out)["types"]}
    assert avail.get("H200X-1-18C") == 0 and avail.get("H200X-7-141C") == 0
    free = host_series(h200, StateStore(h200.state_dir))["free_instances"]
    assert free[("H200X-1-18C", "")] == 0 and free[("H200X-7-141C", "")] == 0
    # a third start finds no slice range: refused, nothing made, and its audit row (trial 6 finding 9)
    rows = len(store.audit_rows())
    third = vm_xml("p18", "11111111-2222-4333-8444-0000000000a3", "H200X-1-18C", vfs(h200)[2])
    assert hook_run(h200, "p18", "prepare", "begin", third) == 2
    assert sorted(p for p, _ in gis(h200).values()) == ["3g.71gb", "4g.71gb"]
    new = [(r.path, r.result) for r in store.audit_rows()[rows:]]
    assert new == [("(start)", "refused")], new


def test_a_cordoned_on_demand_gpu_lists_its_mig_backed_profiles_with_0(h200, capsys):
    """Trial 5 retest N3: a GPU opted in to MIG on demand and cordoned offers nothing, and says so as a full
    one does: capacity --profile answers 0 (not "no GPU here offers"), types and the exporter list 0."""
    import json as _json
    from vgpuhost.ops.metering import host_series
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    assert cli(h200, "gpu", "cordon", str(H200), "--reason", "maintenance") == 0
    capsys.readouterr()
    assert cli(h200, "--json", "capacity", "--profile", "H200X-1-18C") == 0
    assert _json.loads(capsys.readouterr().out)["profiles"][0]["fits"] == 0
    assert cli(h200, "--json", "types", "--gpu", str(H200)) == 0
    avail = {t["name"]: t["available_instances"] for t in _json.loads(capsys.readouterr().out)["types"]}
    assert avail.get("H200X-1-18C") == 0 and avail.get("H200X-7-141C") == 0
    free = host_series(h200, StateStore(h200.state_dir))["free_instances"]
    assert free[("H200X-1-18C", "")] == 0
    assert gis(h200) == {}


def test_an_on_demand_layout_needs_no_instances_and_its_domains_instances_are_no_drift(h200, tmp_path, capsys):
    """Trial 5 finding 9: ``mig: {on_demand: true}`` alone is a layout; the GPU instances its domains'
    starts make are neither drift (assert in sync) nor planned away; a declared instance is a floor:
    made when missing, the on-demand ones beside it kept."""
    cfg = tmp_path / "od.yaml"
    cfg.write_text("version: 1\nlayouts:\n  od:\n    gpus:\n      - select: {board: H200}\n        mode: mig\n"
                   "        mig:\n          on_demand: true\n")
    store = StateStore(h200.state_dir)
    # before apply, plan shows the opt-in and assert calls its absence drift (retest N2: "in sync", exit 0)
    capsys.readouterr()
    assert cli(h200, "plan", "-c", str(cfg), "od") == 0
    out = capsys.readouterr().out
    assert f"MIG on demand on for {H200} (recorded by apply)" in out and "nothing to do" not in out, out
    assert "the host's devices match; apply records what the notes say" in out
    assert cli(h200, "assert", "-c", str(cfg), "od") == 1
    assert f"GPU {H200}: MIG on demand on (host has off" in capsys.readouterr().out
    assert migdemand.opted_in(store) == frozenset()
    assert cli(h200, "apply", "-c", str(cfg), "od") == 0
    assert migdemand.opted_in(store) == {str(H200)} and gis(h200) == {}
    # turned off by hand: drift again, until apply turns it back on
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "off") == 0
    capsys.readouterr()
    assert cli(h200, "assert", "-c", str(cfg), "od") == 1
    assert "MIG on demand on (host has off" in capsys.readouterr().out
    assert cli(h200, "apply", "-c", str(cfg), "od") == 0
    assert migdemand.opted_in(store) == {str(H200)}
    xml1 = vm_xml("m0", DOM1, "H200X-1-18C", vfs(h200)[0])
    assert hook_run(h200, "m0", "prepare", "begin", xml1) == 0
    (gi,) = gis(h200)
    capsys.readouterr()
    assert cli(h200, "assert", "-c", str(cfg), "od") == 0
    assert cli(h200, "plan", "-c", str(cfg), "od") == 0
    assert "nothing to do" in capsys.readouterr().out
    # a declared 3g.71gb is made beside the running domain's instance, which stays
    cfg.write_text(cfg.read_text().replace("on_demand: true", "on_demand: true\n          instances: {3g.71gb: 1}"))
    assert cli(h200, "apply", "-c", str(cfg), "od") == 0
    now = gis(h200)
    assert gi in now and sorted(p for p, _ in now.values()) == ["1g.18gb", "3g.71gb"] and busy(h200) == {gi: 1}
    assert cli(h200, "assert", "-c", str(cfg), "od") == 0
    # the domain's stop destroys its own instance; the declared one stays, still in sync
    assert hook_run(h200, "m0", "release", "end", xml1) == 0
    assert [p for p, _ in gis(h200).values()] == ["3g.71gb"]
    assert cli(h200, "assert", "-c", str(cfg), "od") == 0
    # `on_demand: false` alone is a whole entry too (trial 6 #5): apply turns it off and keeps the GPU's
    # instances as they are (no GPU-instance step); without on_demand, instances are still required
    cfg.write_text("version: 1\nlayouts:\n  od:\n    gpus:\n      - select: {board: H200}\n        mode: mig\n"
                   "        mig:\n          on_demand: false\n")
    capsys.readouterr()
    assert cli(h200, "config", "check", "-c", str(cfg)) == 0
    assert cli(h200, "plan", "-c", str(cfg), "od") == 0
    out = capsys.readouterr().out
    assert f"MIG on demand off for {H200} (recorded by apply)" in out and "GPU instances" not in out, out
    assert cli(h200, "apply", "-c", str(cfg), "od") == 0
    out = capsys.readouterr().out       # the run that records it says so, not "nothing to do" (trial 7 F3d)
    assert "recorded what the notes say" in out and "nothing to do" not in out, out
    assert migdemand.opted_in(store) == frozenset()
    assert cli(h200, "apply", "-c", str(cfg), "od") == 0
    assert "the host matches; nothing to do" in capsys.readouterr().out
    assert [p for p, _ in gis(h200).values()] == ["3g.71gb"]
    assert cli(h200, "assert", "-c", str(cfg), "od") == 0
    cfg.write_text(cfg.read_text().replace("on_demand: false", "vgpus: {}"))
    assert cli(h200, "config", "check", "-c", str(cfg)) == 2
    assert "mig needs the key 'instances'" in capsys.readouterr().err
    # trial 7 F3: a mistyped on_demand is named as such, not as a missing instances key; vGPUs with the
    # instances left out say so; a null instances is "found nothing", without "None"
    for mig, said in (("on_demand: 0", "mig.on_demand is a number: write true or false"),
                      ("on_demand: false\n          vgpus: {H200X-1-18C: 1}",
                       "1 x H200X-1-18C needs 1 1g.18gb GPU instance, and mig.instances is left out"),
                      ("on_demand: false\n          instances: null", "must be a mapping, found nothing")):
        cfg.write_text("version: 1\nlayouts:\n  od:\n    gpus:\n      - select: {board: H200}\n        mode: mig\n"
                       f"        mig:\n          {mig}\n")
        assert cli(h200, "config", "check", "-c", str(cfg)) == 2
        err = capsys.readouterr().err
        assert said in err and "None" not in err and "needs the key" not in err and err.count("\n") <= 2, err


# ---------------------------------------------------------------------------
# trial 10a findings 3, 8, 12, 15: a start in progress, two vGPUs on one GPU, right-sizing first

def _between_instance_and_vgpu(monkeypatch, fn):
    """Run ``fn()`` inside the next start, once its GPU instance is made and before its vGPU is."""
    real = migdemand.make_for
    seen = []

    def racing(*a, **kw):
        out = real(*a, **kw)
        seen.append((out, fn()))
        return out
    monkeypatch.setattr(migdemand, "make_for", racing)
    return seen


def test_another_domains_release_in_the_agents_process_leaves_a_start_in_progress_its_instance(h200, monkeypatch):
    # trial 10a finding 8: the agent runs every hook in one process; a record this process made counted as
    # an orphan's, so vm2's release end (or a reconcile) destroyed the instance vm1's start had just made
    store = StateStore(h200.state_dir)
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    vf1, vf2 = vfs(h200)[:2]
    xml1, xml2 = vm_xml("vm1", DOM1, "H200X-1-18C", vf1), vm_xml("vm2", DOM2, "H200X-1-18C", vf2)

    def meanwhile():
        left = migdemand.left(h200, store)
        return hook_run(h200, "vm2", "release", "end", xml2), dict(gis(h200)), left, migdemand.sweep(
            h200, store, actor="test")
    seen = _between_instance_and_vgpu(monkeypatch, meanwhile)
    assert hook_run(h200, "vm1", "prepare", "begin", xml1) == 0
    ((made, (rc, during, left, swept)),) = seen
    (m,) = made
    assert rc == 0 and during == {m.gi_id: ("1g.18gb", m.start)} and left == [] and swept == ([], [])
    assert busy(h200) == {m.gi_id: 1} and vf_type(h200, vf1) != "0"
    assert "nvml:nvmlGpuInstanceDestroy" not in [r.path for r in store.audit_rows()]
    # the start ended: its record names no maker any more, and vm1's stop destroys the instance
    (rec,) = migdemand.made(store)
    assert (rec.owner, rec.gi_id, rec.pid) == (DOM1, m.gi_id, 0)
    assert hook_run(h200, "vm1", "release", "end", xml1) == 0
    assert gis(h200) == {} and migdemand.made(store) == []


def test_mig_apply_refuses_to_reslice_the_instance_a_start_in_progress_made(h200, monkeypatch, capsys):
    # trial 10a finding 3: mig apply (the GPU lock only) took the fresh instance for a free one and
    # re-sliced it; the start then failed telling the operator to turn on MIG on demand, which was on
    store = StateStore(h200.state_dir)
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    vf1 = vfs(h200)[0]
    xml1 = vm_xml("vm1", DOM1, "H200X-1-18C", vf1)
    seen = _between_instance_and_vgpu(monkeypatch, lambda: (cli(h200, "mig", "apply", "--gpu", str(H200),
                                                                "3g.71gb=2"), capsys.readouterr().err))
    assert hook_run(h200, "vm1", "prepare", "begin", xml1) == 0
    ((made, (rc, err)),) = seen
    (m,) = made
    assert rc == 2 and (f"would destroy GPU instance {m.gi_id} (1g.18gb at memory slice {m.start}), made on "
                        f"demand for a start of {DOM1} in progress") in err, err
    assert gis(h200) == {m.gi_id: ("1g.18gb", m.start)} and busy(h200) == {m.gi_id: 1}
    assert [r.path for r in store.audit_rows()].count("nvml:nvmlGpuInstanceDestroy") == 0
    # once the start ended, the same apply only has the busy instance in its way, named as such
    assert cli(h200, "mig", "apply", "--gpu", str(H200), "3g.71gb=2") == 2
    err = capsys.readouterr().err
    assert f"GPU instance {m.gi_id} (1g.18gb at memory slice {m.start}) holds 1 vGPU" in err, err
    assert hook_run(h200, "vm1", "release", "end", xml1) == 0
    assert gis(h200) == {}


def test_a_start_whose_on_demand_instance_is_gone_is_not_told_to_turn_on_demand_on(h200, monkeypatch):
    # trial 10a finding 3: the refusal of a start whose instance another operation took said "turn MIG on
    # demand on for the GPU", which was on
    store = StateStore(h200.state_dir)
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    vf1 = vfs(h200)[0]
    monkeypatch.setattr(migdemand, "make_for", lambda *a, **kw: [])        # its instance gone meanwhile
    err = _io.StringIO()
    assert hook_run(h200, "vm1", "prepare", "begin", vm_xml("vm1", DOM1, "H200X-1-18C", vf1), err) == 2
    line = err.getvalue()
    assert f"MIG on demand is on for {H200}: the GPU instance a start makes for it is gone" in line, line
    assert "mig on-demand --gpu" not in line and gis(h200) == {} and vf_type(h200, vf1) == "0"
    assert store.vgpu_records() == [] and DOM1 not in store.active_domains()


@pytest.mark.parametrize("before", ["none", "1g.18gb=1"])
def test_two_mig_backed_vgpus_on_one_gpu_are_refused_naming_the_one_vgpu_per_vm_rule(h200, capsys, before):
    # trial 10a finding 12: with a free instance the refusal said "create a 1g.18gb GPU instance"
    store = StateStore(h200.state_dir)
    if before != "none":
        assert cli(h200, "mig", "apply", "--gpu", str(H200), before) == 0
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    was = gis(h200)
    vf1, vf2 = vfs(h200)[:2]
    xml = domain_xml("two", DOM1, Metadata(vgpus=[VgpuRequest("H200X-1-18C", vf=PciAddress.parse(vf1)),
                                                  VgpuRequest("H200X-1-18C", vf=PciAddress.parse(vf2))]),
                     [pci_hostdev(vf1), pci_hostdev(vf2)])
    err = _io.StringIO()
    assert hook_run(h200, "two", "prepare", "begin", xml, err) == 2
    line = err.getvalue()
    assert f"asks for H200X-1-18C ({vf2}) on GPU {H200}, where its vGPU {vf1} goes too: one vGPU per VM per " \
           "GPU" in line and "create a" not in line, line
    assert gis(h200) == was and busy(h200) == {} and migdemand.made(store) == []
    assert vf_type(h200, vf1) == vf_type(h200, vf2) == "0"
    assert [r.result for r in store.audit_rows() if r.operation == "prepare two"] == ["refused"]


@pytest.mark.parametrize("before", ["none", "1g.18gb=1"])
def test_right_sizing_comes_before_the_on_demand_instance(h200, before):
    # trial 10a finding 15: the instance was made for the profile asked (H200X-1-35C) before right-sizing;
    # the advised vGPU went to another instance and the one made stayed empty, or (no instance of the
    # advised profile) the advice was silently dropped
    import time
    from vgpuhost.io import state as st
    from vgpuhost.model.usage import UsageRow
    store = StateStore(h200.state_dir)
    if before != "none":
        assert cli(h200, "mig", "apply", "--gpu", str(H200), before) == 0
    assert cli(h200, "mig", "on-demand", "--gpu", str(H200), "on") == 0
    was = gis(h200)
    vf = vfs(h200)[0]
    now = int(time.time()) // 3600 * 3600          # 3 h metered at 4000 MiB peak, 10 % SM: H200X-1-18C fits
    rows = [UsageRow(time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now - 3600 * (k + 1))), vf, DOM1, "mig-vgpu",
                     str(H200), "H200X-1-35C", "", "", "", 3600.0, 360.0, 0.0, 0.0, 4000 << 20, 35840 << 20, 60)
            for k in range(3)]
    with store.transaction() as conn:
        st.add_usage(conn, rows)
    xml = domain_xml("vm1", DOM1, Metadata(vgpus=[VgpuRequest("H200X-1-35C", vf=PciAddress.parse(vf))],
                                           resize="auto"), [pci_hostdev(vf)])
    assert hook_run(h200, "vm1", "prepare", "begin", xml) == 0
    assert [r.value.split(" (")[0] for r in store.audit_rows() if r.result == "resized"] == \
        ["resize auto: H200X-1-35C -> H200X-1-18C"]
    (gi,) = gis(h200)
    assert gis(h200)[gi][0] == "1g.18gb" and busy(h200) == {gi: 1}
    assert [m.gi_id for m in migdemand.made(store)] == ([] if was else [gi])
    assert vf_type(h200, vf) == "1414"             # the catalog's H200X-1-18C
    assert hook_run(h200, "vm1", "release", "end", xml) == 0
    assert gis(h200) == was and migdemand.made(store) == []
