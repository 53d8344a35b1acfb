"""The agent's warm snapshot and its kept answers (issue 31, item 1).

After a hook write the agent re-reads only the GPUs the write touched
(``observe.inventory.with_gpu``), after the answer, coalesced; the snapshot
it then holds equals a fresh whole-host discovery, read back from the
simulated tree.  A change another process makes (the CLI) is never hidden:
the agent reads the whole host then.  Answers kept per snapshot and per
state store content are never stale after a CLI change.  SIGTERM with hook
writes in flight ends the agent and leaves the host and the store agreeing.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agentutil import ADMIN_GID, RO_GID, AgentRun, socket_dir
from test_hook import vf_domain, vgpu_domain
from vgpuhost.agent import api, server
from vgpuhost.cli.main import main as cli_main
from vgpuhost.io import agentclient
from vgpuhost.io.state import StateStore, StoreWatch
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress
from vgpuhost.observe.inventory import discover, discover_gpu, with_gpu
from vgpuhost.ops import tenancy
from vgpuhost.sim.build import materialise
from vgpuhost.sim.data import bundled_specs
from vgpuhost.sim.spec import load_spec, parse_spec

GPUS = ("0000:41:00.0", "0000:42:00.0", "0000:43:00.0")


def _a40s(n: int) -> str:
    lines = ["version: 1", f"name: a40x{n}", "host:",
             "  cmdline: BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet intel_iommu=on iommu=pt",
             "  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]", "devices:"]
    for i in range(n):
        lines.append(f'  - {{bdf: "0000:00:{i + 1:02x}.0", model: intel-root-port, numa_node: 0}}')
        lines.append(f'  - {{bdf: "{GPUS[i]}", model: A40, upstream: "0000:00:{i + 1:02x}.0", numa_node: 0, '
                     f'vgpu: {{backend: mdev}}}}')
    return "\n".join(lines) + "\n"


@pytest.fixture
def host(tmp_path):
    return materialise(parse_spec(_a40s(3)), tmp_path / "host")


def _uuid(i: int, head: str = "11111111") -> str:
    return f"{head}-2222-4333-8444-{i:012x}"


def _hook(agent: api.Agent, act: str, i: int, gpu: str = None) -> dict:
    xml = vgpu_domain(f"vm{i}", _uuid(i), _uuid(i, "aaaaaaaa"), gpu=PciAddress.parse(gpu) if gpu else None)
    return api._hook(agent, api.Request({}, {}, {"xml": xml, "name": f"vm{i}"}, "test", 1), act)


def _fresh(host):
    return discover(Sysfs(host))


# ---------------------------------------------------------------------------
# with_gpu: one GPU's read merged into a whole-host snapshot

@pytest.mark.parametrize("spec", sorted(bundled_specs()))
def test_each_gpu_read_again_and_merged_gives_the_whole_host_read(spec, tmp_path):
    host = materialise(load_spec(bundled_specs()[spec]), tmp_path / "h")
    fs = Sysfs(host)
    inv = discover(fs)
    for g in inv.gpus:
        assert with_gpu(inv, g.address, discover_gpu(fs, g.address, host_facts=False)) == inv


@pytest.mark.parametrize("spec,args", [
    ("a100-sriov-mdev", ["--profile", "A100-4C"]),
    ("l40s-vendor-vfio", ["--profile", "L40S-4Q"]),
])
def test_a_gpu_read_after_a_create_merged_into_the_old_snapshot_is_the_new_host(spec, args, tmp_path):
    host = materialise(load_spec(bundled_specs()[spec]), tmp_path / "h")
    fs = Sysfs(host)
    before = discover(fs)
    assert cli_main(["--root", str(host.root), "--local", "--json", "vgpu", "create", *args]) == 0
    after = discover(fs)
    assert after != before
    merged = before
    for g in (g.address for g in before.gpus):
        merged = with_gpu(merged, g, discover_gpu(fs, g, host_facts=False))
    assert merged == after


# ---------------------------------------------------------------------------
# the agent's snapshot after its own writes

def test_a_hook_write_re_reads_only_its_gpu_and_the_snapshot_is_the_host(host):
    agent = api.Agent(host)
    agent.inventory()
    assert (agent.scans, agent.refreshes) == (1, 0)
    out = _hook(agent, "prepare", 1, GPUS[1])
    assert out["changed"] == [_uuid(1, "aaaaaaaa")]
    agent.warm_up()                     # what the server does once the answer is out and the slot free
    assert (agent.scans, agent.refreshes) == (1, 1)
    inv = agent.inventory()
    assert inv == _fresh(host)
    assert [(m.uuid, str(m.parent)) for m in inv.mdevs] == [(_uuid(1, "aaaaaaaa"), GPUS[1])]
    _hook(agent, "release", 1)
    agent.warm_up()
    assert (agent.scans, agent.refreshes) == (1, 2)
    assert agent.inventory() == _fresh(host) and not agent.inventory().mdevs


@pytest.mark.parametrize("spec,domain", [
    ("l40s-vendor-vfio", lambda i: vf_domain(f"vm{i}", _uuid(i), "0000:21:00.4")),
    ("a100-sriov-mdev", lambda i: vgpu_domain(f"vm{i}", _uuid(i), _uuid(i, "aaaaaaaa"), "A100-4C")),
])
def test_hook_pairs_on_sriov_hosts_keep_the_snapshot_the_host_and_its_rows_grouped(spec, domain, tmp_path):
    """SR-IOV GPUs (16-20 VFs): each refresh merges the written GPU's rows by replacing its run of them
    (Inventory.types_of, handed on from snapshot to snapshot) and re-reads its devices from the snapshot
    before; after every prepare and release the snapshot is the host as a whole read gives it."""
    host = materialise(load_spec(bundled_specs()[spec]), tmp_path / "h")
    agent = api.Agent(host)
    agent.inventory()
    slots = ("types", "by_type", "framebuffer_of", "time_sliced", "present", "vgpus")
    for i in range(2):
        for act in ("prepare", "release"):
            prev = agent.inventory()
            kept = {g.address: prev.on_gpu(g.address) for g in prev.gpus}     # an index to hand on to the merge
            xml = domain(i)
            assert api._hook(agent, api.Request({}, {}, {"xml": xml, "name": f"vm{i}"}, "test", 1), act)["changed"]
            agent.warm_up()
            inv = agent.inventory()
            assert inv is not prev and sum(inv.on_gpu(a) is ix for a, ix in kept.items()) == len(kept) - 1
            fresh = _fresh(host)
            assert inv == fresh
            assert [t.available_instances for t in inv.vgpu_types] == [t.available_instances for t in fresh.vgpu_types]
            for g in inv.gpus:
                assert inv.types_of(g.address) == tuple(t for t in fresh.vgpu_types if t.gpu == g.address)
                ours, theirs = inv.on_gpu(g.address), fresh.on_gpu(g.address)
                assert ours.gpu == theirs.gpu
                assert [getattr(ours, n) for n in slots] == [getattr(theirs, n) for n in slots]
    assert agent.scans == 1 and agent.refreshes == 4
    assert bool(agent.inventory().vf_vgpus) == (spec == "l40s-vendor-vfio") and not agent.inventory().mdevs


def test_refreshes_of_several_writes_coalesce_into_one_read(host):
    agent = api.Agent(host)
    agent.inventory()
    _hook(agent, "prepare", 1, GPUS[0])
    _hook(agent, "prepare", 2, GPUS[2])
    agent.warm_up()
    assert {str(m.parent) for m in agent.inventory().mdevs} == {GPUS[0], GPUS[2]}
    # two releases (a release reads no snapshot): both GPUs due
    _hook(agent, "release", 1)
    _hook(agent, "release", 2)
    before = agent.refreshes
    # another thread refreshing now: this call returns at once, leaving the work to it
    with agent._build_lock:
        done = threading.Thread(target=agent.warm_up)
        done.start()
        done.join(30)
        assert not done.is_alive() and agent.refreshes == before
    agent.warm_up()
    assert (agent.scans, agent.refreshes) == (1, before + 1)    # both GPUs in one refresh
    assert agent.inventory() == _fresh(host) and not agent.inventory().mdevs


def test_a_cli_change_between_the_agents_writes_makes_a_whole_read(host):
    agent = api.Agent(host)
    agent.inventory()
    _hook(agent, "prepare", 1, GPUS[0])
    assert cli_main(["--root", str(host.root), "--local", "vgpu", "create", "--profile", "A40-8Q",
                     "--gpu", GPUS[1]]) == 0
    _hook(agent, "prepare", 2, GPUS[2])
    agent.warm_up()
    assert agent.scans == 2                                 # not a refresh of GPUS[0] and GPUS[2] alone
    assert agent.inventory() == _fresh(host) and len(agent.inventory().mdevs) == 3


def test_a_cli_change_during_an_agent_write_makes_a_whole_read(host):
    agent = api.Agent(host)
    agent.inventory()
    xml = vgpu_domain("vm1", _uuid(1), _uuid(1, "aaaaaaaa"), gpu=PciAddress.parse(GPUS[0]))
    # another process's create, on another GPU, while the agent's hook write runs: seen in how far the
    # host's fingerprint moved, more than the write's own device explains
    orig = agent.write

    def write(fn, changed=None):
        return orig(lambda: (fn(), cli_main(["--root", str(host.root), "--local", "vgpu", "create", "--profile",
                                             "A40-8Q", "--gpu", GPUS[2]]))[0], changed=changed)
    agent.write = write
    api._hook(agent, api.Request({}, {}, {"xml": xml, "name": "vm1"}, "test", 1), "prepare")
    agent.warm_up()
    assert agent.scans == 2 and agent.refreshes == 0
    assert agent.inventory() == _fresh(host) and {str(m.parent) for m in agent.inventory().mdevs} == \
        {GPUS[0], GPUS[2]}


def test_a_failed_write_makes_a_whole_read(host):
    agent = api.Agent(host)
    agent.inventory()
    with pytest.raises(RuntimeError):
        agent.write(lambda: (_ for _ in ()).throw(RuntimeError("x")), changed=lambda r: [])
    agent.inventory()
    assert agent.scans == 2


# ---------------------------------------------------------------------------
# what a refresh keeps from one read to the next: an mdev parent's list of types, tied to its directory

def _a100_pair(agent: api.Agent, i: int) -> None:
    """One hook prepare and release on the A100 (a vGPU on one of its VFs), each refreshed after."""
    xml = vgpu_domain(f"vm{i}", _uuid(i), _uuid(i, "aaaaaaaa"), "A100-4C")
    for act in ("prepare", "release"):
        assert api._hook(agent, api.Request({}, {}, {"xml": xml, "name": f"vm{i}"}, "test", 1), act)["changed"]
        agent.warm_up()
        assert agent.inventory() == _fresh(agent.host)


def _types_dir(host, vf: str) -> str:
    return os.path.realpath(f"{host.s.pci_device(vf)}/mdev_supported_types")


def test_a_kept_type_listing_serves_only_the_directory_it_was_read_from(tmp_path, monkeypatch):
    """The types an mdev parent lists are read with its directory's identity (device, inode, ctime, link
    count; Sysfs.listed_attr_ints) and kept once that directory's ctime is LISTING_SETTLED_NS old.  A VF
    made again (sriov_numvfs 0 -> N: the kernel removes the VFs' directories and makes new ones) has a
    new directory: here the VF's types directory is made anew, one type fewer, while the old one
    still exists (so the file system cannot give its inode number again), and then a type is added
    in place.  After each, the agent's refreshed snapshot is what a whole read gives: a listing kept by
    its path alone would still name the type gone, then miss the one added."""
    from vgpuhost.io import sysfs as sysfs_mod
    monkeypatch.setattr(sysfs_mod, "_LISTINGS", {})
    monkeypatch.setattr(sysfs_mod, "LISTING_SETTLED_NS", 3600 * 10**9)
    host = materialise(load_spec(bundled_specs()["a100-sriov-mdev"]), tmp_path / "h")
    agent = api.Agent(host)
    inv = agent.inventory()
    assert sysfs_mod._LISTINGS == {}            # every directory changed within the hour: no listing kept
    settle = 0.2
    monkeypatch.setattr(sysfs_mod, "LISTING_SETTLED_NS", int(settle * 1e9))
    time.sleep(settle + 0.05)
    _a100_pair(agent, 1)
    parents = [str(p) for g in inv.gpus for p in g.mdev_parents]
    assert len(parents) == 20
    kept = {d for d in sysfs_mod._LISTINGS if d.endswith("/mdev_supported_types/")}
    assert len(kept) == 20
    vf = parents[-1]
    tdir = _types_dir(host, vf)
    dropped = sorted(os.listdir(tdir))[-1]
    # the VF's types directory made again, listing one type fewer
    os.rename(tdir, tdir + ".old")
    shutil.copytree(tdir + ".old", tdir, symlinks=True)
    shutil.rmtree(f"{tdir}/{dropped}")
    _a100_pair(agent, 2)
    rows = [t.type_id for t in agent.inventory().types_of(inv.gpus[0].address) if str(t.parent) == vf]
    assert dropped not in rows and len(rows) == 11
    # kept again once settled; then a type added in place (the same directory, its ctime moves)
    time.sleep(settle + 0.05)
    _a100_pair(agent, 3)
    assert sysfs_mod._LISTINGS[tdir + "/"][1] == tuple(sorted(rows))
    shutil.copytree(f"{tdir}.old/{dropped}", f"{tdir}/{dropped}", symlinks=True)
    _a100_pair(agent, 4)
    rows = [t.type_id for t in agent.inventory().types_of(inv.gpus[0].address) if str(t.parent) == vf]
    assert dropped in rows and len(rows) == 12
    assert agent.scans == 1


def test_listed_attr_ints_reads_the_counts_asked_for(tmp_path):
    """Sysfs.listed_attr_ints: the sorted entries and each one's attribute, or only those asked for
    (the others None); an absent directory lists nothing."""
    host = materialise(load_spec(bundled_specs()["a100-sriov-mdev"]), tmp_path / "h")
    fs = Sysfs(host)
    tdir = _types_dir(host, "0000:41:00.4") + "/"
    names, counts = fs.listed_attr_ints(tdir, "available_instances", default=0)
    assert names == tuple(sorted(os.listdir(tdir)))
    assert counts == [int(open(f"{tdir}{n}/available_instances").read()) for n in names]
    names2, some = fs.listed_attr_ints(tdir, "available_instances", only={names[0], names[3]}, default=0)
    assert names2 == names and some == [counts[0], None, None, counts[3]] + [None] * (len(names) - 4)
    assert fs.listed_attr_ints(tdir + "absent/", "available_instances") == ((), [])


def test_the_fingerprint_reads_each_vfs_type_relative_to_the_bus(tmp_path):
    """io.changes.fingerprint reads each vendor-VFIO VF's current_vgpu_type through one descriptor of
    bus/pci/devices: the values the files hold ("" for a VF that is not there), moving with a create."""
    from vgpuhost.io.changes import fingerprint
    from vgpuhost.io.vgpudev import vf_type_path
    host = materialise(load_spec(bundled_specs()["l40s-vendor-vfio"]), tmp_path / "h")
    vfs = [str(v.vf) for v in _fresh(host).vf_vgpus]
    assert len(vfs) == 32

    def files():
        return tuple(open(vf_type_path(host, vf)).read().strip() for vf in vfs)
    before = fingerprint(host, vfs + ["0000:ff:1f.7"])
    assert before[3] == files() + ("",) and set(before[3][:-1]) == {"0"}
    assert cli_main(["--root", str(host.root), "--local", "vgpu", "create", "--profile", "L40S-4Q"]) == 0
    after = fingerprint(host, vfs)
    assert after[3] == files() and after[3] != before[3][:-1] and sum(t != "0" for t in after[3]) == 1


def test_the_check_under_the_lock_reads_the_wanted_types_counts_alone_on_an_sriov_gpu(tmp_path, monkeypatch):
    """A100 with 20 VFs, 12 types each: the agent's prepare reads under the GPU's lock the 20 counts of the
    type it makes (not 240), and the vGPU is where a whole read says it is."""
    host = materialise(load_spec(bundled_specs()["a100-sriov-mdev"]), tmp_path / "h")
    agent = api.Agent(host)
    inv = agent.inventory()
    opened = []
    real_in = Sysfs._ints_at

    def spy(self, dfd, directory, names, *a, **kw):
        opened.extend(f"{directory}{n}" for n in names)
        return real_in(self, dfd, directory, names, *a, **kw)
    monkeypatch.setattr(Sysfs, "_ints_at", spy)
    xml = vgpu_domain("vm1", _uuid(1), _uuid(1, "aaaaaaaa"), "A100-4C")
    assert api._hook(agent, api.Request({}, {}, {"xml": xml, "name": "vm1"}, "test", 1), "prepare")["changed"]
    wanted = {t.type_id for t in inv.vgpu_types if t.name == "A100-4C"}
    counts = [p for p in opened if p.endswith("/available_instances")]
    assert len(counts) == 20 and all(p.split("/")[-2] in wanted for p in counts)
    fresh = _fresh(host)
    assert [m.uuid for m in fresh.mdevs] == [_uuid(1, "aaaaaaaa")]
    agent.warm_up()
    assert agent.inventory() == fresh


# ---------------------------------------------------------------------------
# answers kept per snapshot and store content

def _capacity(agent: api.Agent, **query) -> dict:
    answer = api.get_capacity(agent, api.Request({}, query, None, "test", 1, api.READ))
    return json.loads(answer.body)


def _free(doc: dict, profile: str = "A40-8Q") -> int:
    return next(p for p in doc["profiles"] if p["profile"] == profile)["fits"]


def test_kept_capacity_is_never_stale_after_a_cli_change(host):
    agent = api.Agent(host)
    first = _capacity(agent)
    assert _capacity(agent) == first and agent.cache_hits >= 1
    assert cli_main(["--root", str(host.root), "--local", "vgpu", "create", "--profile", "A40-8Q",
                     "--gpu", GPUS[0]]) == 0
    after = _capacity(agent)
    assert _free(after) == _free(first) - 1
    # the same as a document built now, without the agent's kept answers
    fresh = api.Agent(host)
    assert after == _capacity(fresh)
    # a store-only change (the CLI's tenant add): the answers that read the store are built again
    built = []

    def build(inv):
        built.append(1)
        return sorted(tenancy.tenants(agent.store))
    assert agent.cached("t", (), build, store=True) == agent.cached("t", (), build, store=True) == []
    assert len(built) == 1
    assert cli_main(["--root", str(host.root), "--local", "tenant", "add", "ml"]) == 0
    assert agent.cached("t", (), build, store=True) == ["ml"] and len(built) == 2


def test_the_store_watch_moves_with_every_commit_of_another_connection(host):
    store = StateStore(host.state_dir)
    watch = StoreWatch(store)
    t0 = watch.token()
    assert t0 is not None and watch.token() == t0
    assert cli_main(["--root", str(host.root), "--local", "tenant", "add", "a"]) == 0
    t1 = watch.token()
    assert t1 != t0
    store.audit(actor="test", operation="x", path="p", value="v", result="ok")     # this process, another connection
    assert watch.token() != t1
    watch.close()


def test_a_kept_answer_is_served_without_the_expensive_read_limits_and_matches(host):
    agent = api.Agent(host)
    req = api.Request({}, {"profile": "a40-8q"}, None, "test", 1, api.READ)
    route = api.match("GET", "/v1/capacity")[0]
    assert api.cached_read(agent, route, req) is None       # nothing kept yet: the limits apply
    built = api.get_capacity(agent, req)
    kept = api.cached_read(agent, route, req)
    assert kept is not None and kept.body == built.body
    assert [p["profile"] for p in json.loads(kept.body)["profiles"]] == ["A40-8Q"]
    tenant_req = req._replace(role=api.TENANT, tenant="ml")
    assert api.cached_read(agent, route, tenant_req) is None        # a tenant's answer is its own


def test_a_read_of_an_answer_being_built_waits_for_that_build(host):
    agent = api.Agent(host)
    agent.inventory()
    built, release = [], threading.Event()

    def slow(inv):
        built.append(1)
        release.wait(30)
        return "doc"
    first = threading.Thread(target=agent.cached, args=("x", (), slow))
    first.start()
    for _ in range(600):
        if agent._building:
            break
        threading.Event().wait(0.01)
    (key, event), = agent._building.items()
    waiting = threading.Event()

    class Seen:                         # the build's event, telling when the reader waits on it
        def wait(self, timeout):
            waiting.set()
            return event.wait(timeout)
    agent._building[key] = Seen()
    got = []
    second = threading.Thread(target=lambda: got.append(agent.peek("x", ())))
    second.start()
    assert waiting.wait(30)             # the reader waits for the build in progress ...
    release.set()                       # ... which ends now
    first.join(30)
    second.join(30)
    assert got == ["doc"] and built == [1]             # one build served both
    assert agent.peek("y", ()) is None                  # nothing built, nothing being built: no wait


# ---------------------------------------------------------------------------
# the refresh comes after the answer and the connection's slot

def test_the_answer_and_the_slot_do_not_wait_for_the_refresh(make_host):
    h = make_host("a40-mdev")
    d = socket_dir()
    proc = server.open_agent(h, socket_dir=d, admin_group=ADMIN_GID, ro_group=RO_GID, max_connections=1)
    agent = proc.agent
    refreshing, go = threading.Event(), threading.Event()
    warm = agent.warm_up

    def held_warm_up():                 # the refresh, held until the test lets it go
        refreshing.set()
        go.wait(30)
        warm()
    agent.warm_up = held_warm_up
    proc.start()
    admin = os.path.join(d, "agent.sock")
    xml = vgpu_domain("vm1", _uuid(1), _uuid(1, "aaaaaaaa"))
    try:
        status, out = agentclient.call(admin, "POST", "/v1/hook/prepare", {"xml": xml, "name": "vm1"})
        assert status == 200 and out["changed"] == [_uuid(1, "aaaaaaaa")]     # answered, the connection closed
        assert refreshing.wait(30) and not go.is_set()                       # while the refresh waits
        # the one connection slot is free again: another request is served, not refused 429
        status, doc = agentclient.call(admin, "GET", "/v1/agent")
        assert status == 200 and doc["snapshot_refreshes"] == 0
        go.set()
        for _ in range(600):
            if agent.refreshes:
                break
            threading.Event().wait(0.05)
        assert agent.refreshes == 1 and agent.inventory() == _fresh(h)
    finally:
        go.set()
        proc.stop()


# ---------------------------------------------------------------------------
# SIGTERM with hook writes in flight

def test_sigterm_with_hook_writes_in_flight_leaves_host_and_store_agreeing(host):
    run = AgentRun(host.root, extra=("--metering-interval", "0"))
    stop = threading.Event()

    def client(i: int) -> None:
        xml = vgpu_domain(f"vm{i}", _uuid(i), _uuid(i, "aaaaaaaa"))
        while not stop.is_set():
            for act in ("prepare", "release"):
                try:
                    agentclient.call(run.admin, "POST", f"/v1/hook/{act}", {"xml": xml, "name": f"vm{i}"})
                except (agentclient.AgentDown, OSError):
                    return
    with ThreadPoolExecutor(6) as ex:
        futures = [ex.submit(client, i) for i in range(6)]
        try:
            for _ in range(200):                            # some writes done before the signal
                if StateStore(host.state_dir).audit_rows():
                    break
                threading.Event().wait(0.05)
            assert run.stop() == 0, run.log.read_text()[-3000:]     # SIGTERM, not a kill after 30 s
        finally:
            stop.set()
            run.close()
        for f in futures:
            f.result()
    store = StateStore(host.state_dir)
    assert not store.journal_entries(open_only=True)
    # every vGPU on the host is recorded, and every record is on the host
    present = {m.uuid for m in _fresh(host).mdevs}
    assert present == {r.id for r in store.vgpu_records()}


# ---------------------------------------------------------------------------
# MIG and vGPU-mode changes made outside the agent (trial 8 T1)

A100 = "0000:41:00.0"       # a100-sriov-mdev


def _local(host, *argv) -> None:
    assert cli_main(["--root", str(host.root), "--local", *argv]) == 0


def _mig_domain(i: int, profile: str = "A100-1-5C") -> str:
    return vgpu_domain(f"mig{i}", _uuid(i), _uuid(i, "aaaaaaaa"), profile)


def test_a_local_mig_change_is_seen_by_the_agents_snapshot_and_its_next_start(tmp_path):
    """``vgpuhost --local mig apply`` (what vgpuhost-layout.service runs) while the agent is up: the
    agent's snapshot, its types answer and its next start of a MIG-backed vGPU follow the new GPU
    instances at once, as a fresh one-shot read does."""
    host = materialise(load_spec(bundled_specs()["a100-sriov-mdev"]), tmp_path / "h")
    agent = api.Agent(host)
    types = api.get_types(agent, api.Request({}, {}, None, "test", 1))
    assert agent.inventory() == _fresh(host) and agent.scans == 1
    _local(host, "mig", "enable", "--gpu", A100)
    _local(host, "mig", "apply", "--gpu", A100, "3g.20gb=1,1g.5gb=2")
    fresh = _fresh(host)
    assert fresh.gpu(PciAddress.parse(A100)).gpu_instances == {"3g.20gb": 1, "1g.5gb": 2}
    assert agent.inventory() == fresh and agent.scans == 2           # read again, once
    after = api.get_types(agent, api.Request({}, {}, None, "test", 1))
    assert after != types
    capsys_free = api.get_types(agent, api.Request({}, {}, None, "test", 1))
    assert capsys_free == after and agent.scans == 2                  # and kept again
    rows = {t["name"]: t["available_instances"] for t in json.loads(after.body)["types"]}
    assert rows["A100-1-5C"] == 2 and rows.get("A100-10C", 0) == 0
    xml = _mig_domain(1)
    out = api._hook(agent, api.Request({}, {}, {"xml": xml, "name": "mig1"}, "test", 1), "prepare")
    assert out["changed"] == [_uuid(1, "aaaaaaaa")]
    assert [m.uuid for m in _fresh(host).mdevs] == [_uuid(1, "aaaaaaaa")]


def _behind_the_agent(host, *changes) -> None:
    """``changes`` made as NVML alone makes them (``nvidia-smi``): the driver-state token left as it was,
    so no file the agent's fingerprint watches moves."""
    from vgpuhost.io.changes import DRIVER_TOKEN
    token = os.path.join(host.state_dir, DRIVER_TOKEN)
    kept = open(token).read() if os.path.exists(token) else None
    for argv in changes:
        _local(host, *argv)
    if kept is None:
        if os.path.exists(token):
            os.unlink(token)
    else:
        with open(token, "w") as f:
            f.write(kept)


@pytest.mark.parametrize("case", ["gpu-instances-made", "mig-turned-off"])
def test_a_start_is_never_refused_on_a_snapshot_that_missed_a_mig_change(case, tmp_path):
    """A MIG change the agent cannot see (NVML alone): its snapshot stays as it was, but a start it
    would refuse on it (a GPU instance missing; no room for a time-sliced vGPU) is looked at again on
    a fresh read and admitted, as the one-shot hook admits it."""
    host = materialise(load_spec(bundled_specs()["a100-sriov-mdev"]), tmp_path / "h")
    agent = api.Agent(host)
    if case == "gpu-instances-made":
        agent.inventory()
        _behind_the_agent(host, ("mig", "enable", "--gpu", A100), ("mig", "apply", "--gpu", A100, "1g.5gb=2"))
        profile = "A100-1-5C"
    else:
        _local(host, "mig", "enable", "--gpu", A100)
        _local(host, "mig", "apply", "--gpu", A100, "7g.40gb=1")
        agent.inventory()
        _behind_the_agent(host, ("mig", "apply", "--gpu", A100, "7g.40gb=0"), ("mig", "disable", "--gpu", A100))
        profile = "A100-4C"
    stale = agent.inventory()
    assert stale != _fresh(host)                     # what the agent cannot see (io/changes.py says so)
    assert not any(t.available_instances for t in stale.vgpu_types if t.name == profile)
    xml = _mig_domain(1, profile)
    out = api._hook(agent, api.Request({}, {}, {"xml": xml, "name": "mig1"}, "test", 1), "prepare")
    assert out["changed"] == [_uuid(1, "aaaaaaaa")]
    [made] = _fresh(host).mdevs
    assert made.uuid == _uuid(1, "aaaaaaaa") and StateStore(host.state_dir).vgpu_records()[0].type_name == profile
    agent.warm_up()
    assert agent.inventory() == _fresh(host)         # the write made the agent read the host again


def test_a_local_mixed_size_mode_change_makes_the_agent_read_the_host_again(tmp_path):
    """A vendor-VFIO GPU's mixed-size mode decides which types its VFs list once vGPUs sit on it (the
    simulator's listing of an empty GPU is the same in both modes): a ``--local vgpu mode`` moves no
    kernel file the fingerprint watches, only the driver-state token, and the agent reads the host
    again at its next read (and once only)."""
    from vgpuhost.io.changes import DRIVER_TOKEN
    host = materialise(load_spec(bundled_specs()["l40s-vendor-vfio"]), tmp_path / "h")
    agent = api.Agent(host)
    agent.inventory()
    _local(host, "vgpu", "mode", "--gpu", "0000:21:00.0", "--mixed-size", "on")
    assert os.path.exists(os.path.join(host.state_dir, DRIVER_TOKEN))
    assert agent.inventory() == _fresh(host) and agent.scans == 2
    agent.inventory()
    assert agent.scans == 2


def test_the_agents_own_mig_on_demand_start_re_reads_its_gpu_not_the_whole_host(make_host):
    """Trial 8 retest R1: the GPU instance a start makes on demand through the agent moves the driver-state
    token; the agent's own write names its GPU, so that GPU alone is read again (no whole read), and the
    snapshot is still the host.  Another process's token write is never taken as the agent's."""
    from test_mig_ondemand import H200, gis, vfs, vm_xml
    from vgpuhost.cli.main import main
    from vgpuhost.io.changes import DRIVER_TOKEN, note_driver_change
    host = make_host("h200-mig-on")
    assert main(["--root", str(host.root), "--local", "mig", "on-demand", "--gpu", str(H200), "on"]) == 0
    agent = api.Agent(host)
    agent.inventory()
    scans = agent.scans
    vf = sorted(vfs(host))[0]
    xml = vm_xml("od1", _uuid(1), "H200X-1-18C", vf)
    out = api._hook(agent, api.Request({}, {}, {"xml": xml, "name": "od1"}, "test", 1), "prepare")
    assert out["changed"] and len(gis(host)) == 1                # the vGPU and its instance made on demand
    agent.warm_up()
    assert agent.scans == scans and agent.inventory() == _fresh(host)      # its GPU read again, not the host
    # the same token moved by another process (its own write, a --local change): a whole read
    token = (host.state_dir / DRIVER_TOKEN).read_text()
    note_driver_change(host, str(H200))
    from vgpuhost.io import changes
    with changes._OWN_LOCK:                                      # as if another process had written it
        changes._OWN.clear()
    assert (host.state_dir / DRIVER_TOKEN).read_text() != token
    agent.inventory()
    assert agent.scans == scans + 1


def test_the_driver_token_is_never_read_through_a_link_or_from_a_device(make_host):
    """Trial 8 retest R3: a token that is a symbolic link (to /dev/urandom: a new value at every read, a whole
    read of the host per request) reads as none, and so does one that is not a regular file."""
    from vgpuhost.io.changes import DRIVER_TOKEN, fingerprint
    host = make_host("a40-mdev")
    path = host.state_dir / DRIVER_TOKEN
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/urandom")
    assert fingerprint(host)[4] == "" and fingerprint(host) == fingerprint(host)
    path.unlink()
    path.mkdir()
    assert fingerprint(host)[4] == ""
    path.rmdir()
    path.write_text("abc\n")
    assert fingerprint(host)[4] == "abc"
