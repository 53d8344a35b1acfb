"""Scoped discovery (issue 17 #1): an operation on one GPU reads that GPU alone.

``discover_gpu`` must give, for its GPU, exactly the records a whole-host
``discover`` gives; a vGPU create pinned to GPU A (the layout's, the hook's
with a VF) and the check under the lock of an unpinned create must never read
GPU B's sysfs.  Reads are counted at the sysfs door (every read method of
:class:`vgpuhost.io.sysfs.Sysfs`, which is the only code that reads the tree).
"""

from __future__ import annotations

import pytest

from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress, replace
from vgpuhost.observe.inventory import UNREAD_HOST_FACTS, discover, discover_gpu
from vgpuhost.ops.vgpu import create, remove
from test_vgpu import TWO_A40, TWO_A100, TWO_L40S_MIXED

A = PciAddress.parse
LO, HI = A("0000:41:00.0"), A("0000:81:00.0")
L40S_LO, L40S_HI = A("0000:21:00.0"), A("0000:a1:00.0")

HOSTS = {
    "a40-pf-mdev": (TWO_A40.format(mixed="false", faults=""), LO, HI, "A40-8Q"),
    "a100-vf-mdev": (TWO_A100, LO, HI, "A100-4C"),
    "l40s-vendor-vfio": (TWO_L40S_MIXED, L40S_LO, L40S_HI, "L40S-4Q"),
}

READS = ("read_optional", "link_name", "resolve", "listdir", "exists")


def _spy(monkeypatch, names) -> list:
    """Every path passed to the Sysfs read methods ``names`` from now on (a list of str, filled as they run)."""
    seen = []
    for name in names:
        fn = getattr(Sysfs, name)

        def spy(self, path, *a, _fn=fn, **kw):
            seen.append(str(path))
            return _fn(self, path, *a, **kw)
        monkeypatch.setattr(Sysfs, name, spy)
    return seen


@pytest.fixture
def reads(monkeypatch):
    """Every path passed to a Sysfs read method while the test runs (a list of str)."""
    return _spy(monkeypatch, READS)


def _restricted(inv, gpu):
    g = inv.gpu(gpu)
    parents = set(g.mdev_parents)
    return (g, tuple(t for t in inv.vgpu_types if t.gpu == gpu), tuple(m for m in inv.mdevs if m.parent in parents),
            tuple(v for v in inv.vf_vgpus if v.gpu == gpu))


def _populate(host, store, a, b, profile):
    """Two vGPUs on ``a``, two on ``b``: ``{gpu: [ids]}``."""
    made = {}
    for g in (a, b):
        made[g] = [create(host, store, profile=profile, gpu=g, actor="test").id for _ in range(2)]
    return made


def _names_of(host, inv, gpu, ids):
    """Strings that only a read of ``gpu`` (its PF, VFs, their vGPUs) would put in a path."""
    g = inv.gpu(gpu)
    return {str(gpu), *map(str, g.vfs), *ids}


@pytest.mark.parametrize("case", sorted(HOSTS))
def test_discover_gpu_equals_the_whole_host_read_restricted_to_that_gpu(make_host, case):
    yaml_text, a, b, profile = HOSTS[case]
    host = make_host(yaml_text=yaml_text)
    store = StateStore(host.state_dir)
    _populate(host, store, a, b, profile)
    fs = Sysfs(host)
    full = discover(fs)
    assert full.mdevs or full.vf_vgpus
    for gpu in (a, b):
        one = discover_gpu(fs, gpu)
        assert [g.address for g in one.gpus] == [gpu]
        assert _restricted(one, gpu) == _restricted(full, gpu)
        assert _restricted(one, gpu)[1], "the GPU's types were read"
        # every device and group read is the whole host's record of it; the GPU's VFs and group are there
        assert all(full.devices[d] == dev for d, dev in one.devices.items())
        assert all(full.groups[n] == grp for n, grp in one.groups.items())
        assert set(one.gpu(gpu).vfs) <= set(one.devices)
        assert one.group_of(gpu) == full.group_of(gpu)
        assert one.host == full.host
        other = b if gpu == a else a
        assert other not in one.devices and not any(t.gpu == other for t in one.vgpu_types)
    assert discover_gpu(fs, a, host_facts=False).host == UNREAD_HOST_FACTS
    assert discover_gpu(fs, a, with_types=False).vgpu_types == ()


def test_discover_gpu_of_an_address_that_is_no_gpu_holds_no_gpu(make_host):
    host = make_host(yaml_text=TWO_A40.format(mixed="false", faults=""))
    fs = Sysfs(host)
    assert discover_gpu(fs, A("0000:40:01.0")).gpus == ()          # the root port
    assert discover_gpu(fs, A("0000:99:00.0")).gpus == ()          # nothing there
    assert discover_gpu(fs, A("0000:99:00.0")).devices == {}


@pytest.mark.parametrize("case", sorted(HOSTS))
def test_a_pinned_create_on_gpu_a_never_reads_gpu_b(make_host, reads, case):
    yaml_text, a, b, profile = HOSTS[case]
    host = make_host(yaml_text=yaml_text)
    store = StateStore(host.state_dir)
    made = _populate(host, store, a, b, profile)
    inv = discover(Sysfs(host))
    forbidden = _names_of(host, inv, b, made[b])
    reads.clear()
    out = create(host, store, profile=profile, gpu=a, actor="test")
    assert out.gpu == str(a)
    assert reads, "the spy saw the reads"
    touched = [p for p in reads if any(f in p for f in forbidden)]
    assert touched == [], f"a create on {a} read {b}: {touched[:5]}"
    # and the vGPU is there, read back from the tree
    assert out.id in {m.uuid for m in discover(Sysfs(host)).mdevs} | {str(v.vf) for v in
                                                                       discover(Sysfs(host)).vf_vgpus if v.type_id}
    reads.clear()
    remove(host, store, out.id, actor="test")
    assert [p for p in reads if any(f in p for f in forbidden)] == []


def test_a_create_on_a_named_vf_reads_that_vfs_gpu_alone(make_host, reads):
    host = make_host(yaml_text=TWO_L40S_MIXED)
    store = StateStore(host.state_dir)
    made = _populate(host, store, L40S_LO, L40S_HI, "L40S-4Q")
    inv = discover(Sysfs(host))
    vf = next(v.vf for v in inv.vf_vgpus if v.gpu == L40S_LO and v.type_id is None)
    forbidden = _names_of(host, inv, L40S_HI, made[L40S_HI])
    reads.clear()
    out = create(host, store, profile="L40S-4Q", vf=vf, owner="6f1a0c2e-1111-4222-8333-944455556666",
                 actor="test")
    assert out.id == str(vf) and out.gpu == str(L40S_LO)
    assert [p for p in reads if any(f in p for f in forbidden)] == []
    held = {str(v.vf): v.type_id for v in discover(Sysfs(host)).vf_vgpus}
    assert held[str(vf)] == out.type_id


def test_an_unpinned_create_given_a_snapshot_rechecks_the_chosen_gpu_alone(make_host, reads):
    """The hook's path: placement on the caller's snapshot, then under the lock only the chosen GPU is read."""
    host = make_host(yaml_text=TWO_A40.format(mixed="false", faults=""))
    store = StateStore(host.state_dir)
    made = _populate(host, store, LO, HI, "A40-8Q")
    inv = discover(Sysfs(host))
    reads.clear()
    out = create(host, store, profile="A40-8Q", strategy="first-fit", inventory=inv, actor="test")
    chosen = A(out.gpu)
    other = HI if chosen == LO else LO
    forbidden = _names_of(host, inv, other, made[other])
    assert [p for p in reads if any(f in p for f in forbidden)] == []
    assert sum(1 for m in discover(Sysfs(host)).mdevs if m.parent == chosen) == 3


def test_the_check_under_the_lock_reads_no_type_constant_the_snapshot_holds(make_host, monkeypatch):
    """Given the caller's snapshot, the re-read under the GPU lock reads the wanted type's free instances and
    the vGPUs present again, never another type's count, nor a type's name, description or device_api (fixed
    for a type id): and when the snapshot lacks a type the parent lists, that type is read whole and every
    count again."""
    host = make_host(yaml_text=TWO_A40.format(mixed="false", faults=""))
    store = StateStore(host.state_dir)
    opened = []
    real = Sysfs.read_attr

    def spy(self, path, *a, **kw):
        opened.append(str(path))
        return real(self, path, *a, **kw)
    monkeypatch.setattr(Sysfs, "read_attr", spy)
    real_in = Sysfs._ints_at

    def spy_in(self, dfd, directory, names, *a, **kw):      # the files it opens relative to the directory
        opened.extend(f"{directory}{n}" for n in names)
        return real_in(self, dfd, directory, names, *a, **kw)
    monkeypatch.setattr(Sysfs, "_ints_at", spy_in)
    inv = discover(Sysfs(host))
    n_types = sum(1 for t in inv.vgpu_types if t.gpu == LO)
    constants = ("/name", "/description", "/device_api")
    opened.clear()
    out = create(host, store, profile="A40-8Q", gpu=LO, inventory=inv, actor="test")
    assert A(out.gpu) == LO
    assert [p for p in opened if p.endswith(constants)] == []
    wanted = next(t.type_id for t in inv.vgpu_types if t.gpu == LO and t.name == "A40-8Q")
    counts = [p for p in opened if p.endswith("/available_instances")]
    assert len(counts) == 1 and counts[0].endswith(f"/{wanted}/available_instances")
    # a snapshot that lacks a type: that type's constants are read, and every type's count
    partial = replace(inv, vgpu_types=tuple(t for t in inv.vgpu_types if t.name != "A40-2Q"))
    opened.clear()
    out = create(host, store, profile="A40-8Q", gpu=LO, inventory=partial, actor="test")
    assert len([p for p in opened if p.endswith(constants)]) == 3
    assert sum(1 for p in opened if p.endswith("/available_instances")) >= n_types
    # what was made is what a fresh read shows
    assert sum(1 for m in discover(Sysfs(host)).mdevs if m.parent == LO) == 2


# ---------------------------------------------------------------------------
# one view carried across apply's steps

LAYOUT_TWO = """
version: 1
layouts:
  main:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu:
          types: {A40-8Q: %d}
"""


def _observe_all(host, store):
    from vgpuhost.observe.hostview import observe
    return observe(host, store)


@pytest.mark.parametrize("case", sorted(HOSTS))
def test_a_view_refreshed_for_the_gpu_that_changed_equals_a_fresh_observe(make_host, case):
    from vgpuhost.observe.hostview import refresh
    from vgpuhost.observe.inventory import gpu_part
    yaml_text, a, b, profile = HOSTS[case]
    host = make_host(yaml_text=yaml_text)
    store = StateStore(host.state_dir)
    made = _populate(host, store, a, b, profile)
    view = _observe_all(host, store)
    create(host, store, profile=profile, gpu=a, actor="test")
    remove(host, store, made[a][0], actor="test")
    stale = view
    view = refresh(view, host, store, [a])
    fresh = _observe_all(host, store)
    assert view != stale
    assert view == fresh
    assert view.inventory == fresh.inventory and view.vgpus == fresh.vgpus
    # the part of one GPU is what discover_gpu reads of it
    for g in (a, b):
        one = discover_gpu(Sysfs(host), g)
        part = gpu_part(fresh.inventory, g)
        assert (part.gpus, part.vgpu_types, part.mdevs, part.vf_vgpus) == (one.gpus, one.vgpu_types, one.mdevs,
                                                                           one.vf_vgpus)
        assert part.devices == one.devices and part.groups == one.groups


def _whole_host_scans(reads, host):
    """How many whole-host discoveries the recorded reads hold (each lists every PCI device once)."""
    return sum(1 for p in reads if p == str(host.pci_devices))


def test_apply_reads_the_whole_host_twice_whatever_the_number_of_steps(make_host, reads):
    """Once to plan, once to assert after; every step reads only its own GPU."""
    from vgpuhost.ops import layout as ops_layout
    from vgpuhost.policy.config import parse
    host = make_host(yaml_text=TWO_A40.format(mixed="false", faults=""))
    store = StateStore(host.state_dir)
    reads.clear()
    result = ops_layout.apply(host, store, parse(LAYOUT_TWO % 3, "l.yaml"), actor="test")
    assert len(result.done) == 2 and result.drift_after == []
    assert _whole_host_scans(reads, host) == 2
    assert len(store.vgpu_records()) == 6
    # and again with removals and creates on both GPUs: three A40-8Q to one
    reads.clear()
    result = ops_layout.apply(host, store, parse(LAYOUT_TWO % 1, "l.yaml"), actor="test")
    assert len(result.done) >= 2 and result.drift_after == []
    assert _whole_host_scans(reads, host) == 2
    inv = discover(Sysfs(host))
    assert sorted(str(m.parent) for m in inv.mdevs) == [str(LO), str(HI)]


def test_apply_with_scheduler_steps_reads_the_whole_host_twice(make_host, reads):
    """A scheduler change per GPU, then the vGPUs: each step reads its GPU alone."""
    from vgpuhost.io.backends import open_backend
    from vgpuhost.ops import layout as ops_layout
    from vgpuhost.policy.config import parse
    host = make_host(yaml_text=TWO_A40.format(mixed="false", faults=""))
    store = StateStore(host.state_dir)
    text = (LAYOUT_TWO % 2) + "        scheduler: {policy: equal-share, timeslice_ms: 3}\n"
    reads.clear()
    result = ops_layout.apply(host, store, parse(text, "l.yaml"), actor="test")
    assert sorted(s.kind for s in result.done) == ["scheduler", "scheduler", "vgpu", "vgpu"]
    assert result.drift_after == []
    assert _whole_host_scans(reads, host) == 2
    nvml = open_backend(host)
    assert [nvml.scheduler_state(g).policy for g in (LO, HI)] == ["equal-share", "equal-share"]
    assert len(store.vgpu_records()) == 4


# ---------------------------------------------------------------------------
# the qemu hook's prepare reads only the GPUs the domain's devices may use (issue 31)

HOOK_READS = READS + ("read_attr", "read_int", "read_attr_int", "read_attr_ints_in")


@pytest.fixture
def hook_reads(monkeypatch):
    """Every path the hook's reads pass to Sysfs, its typed reads too."""
    return _spy(monkeypatch, HOOK_READS)


@pytest.mark.parametrize("how", ["vf", "pinned", "allow-list"])
def test_the_hooks_prepare_and_release_read_no_path_of_a_gpu_the_domain_may_not_use(make_host, hook_reads,
                                                                                     monkeypatch, how):
    """A VF the domain names, a GPU its metadata pins, or an allow-list of one GPU: prepare begin and release
    end read nothing of the other GPU (its PF, its VFs, its vGPUs), never list the host's PCI devices, and
    the vGPU is made on the GPU the domain may use (read back from the tree)."""
    from test_hook import DOM1, MDEV1, start, stop, vf_domain, vgpu_domain
    from vgpuhost.ops.devices import allow_path
    monkeypatch.setenv("VGPUHOST_AGENT", "off")
    if how == "vf":
        yaml_text, mine, other = TWO_L40S_MIXED, L40S_LO, L40S_HI
    else:
        yaml_text, mine, other = TWO_A40.format(mixed="false", faults=""), LO, HI
    host = make_host(yaml_text=yaml_text)
    store = StateStore(host.state_dir)
    made = _populate(host, store, mine, other, "L40S-4Q" if how == "vf" else "A40-8Q")
    g_other = discover(Sysfs(host)).gpu(other)
    if how == "vf":
        vf = next(v for v in discover(Sysfs(host)).gpu(mine).vfs
                  if not any(x.vf == v and x.type_id for x in discover(Sysfs(host)).vf_vgpus))
        xml = vf_domain("w", DOM1, vf)
    elif how == "pinned":
        xml = vgpu_domain("w", DOM1, MDEV1, gpu=mine, strategy="spread")
    else:
        allow = allow_path(host)
        allow.parent.mkdir(parents=True, exist_ok=True)
        allow.write_text(f"{mine}\n")
        xml = vgpu_domain("w", DOM1, MDEV1, strategy="spread")   # spread would pick the emptier GPU: not allowed
    forbidden = {str(other), *map(str, g_other.vfs), *made[other]}
    hook_reads.clear()
    rc, err = start(host, "w", xml)
    assert rc == 0, err
    during = list(hook_reads)
    after = discover(Sysfs(host))
    if how == "vf":
        assert next(x for x in after.vf_vgpus if x.vf == vf).type_id
    else:
        assert next(m for m in after.mdevs if m.uuid == MDEV1).parent in (mine, *after.gpu(mine).vfs)
    hook_reads.clear()
    rc, err = stop(host, "w", xml)
    assert rc == 0, err
    during += hook_reads
    assert [p for p in during if any(f in p for f in forbidden)] == []
    assert str(host.pci_devices) not in during              # the host's PCI functions never listed
    assert any(str(mine) in p for p in during)              # (the spy saw the reads of the GPU it may use)
