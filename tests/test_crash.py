"""kill -9 at every write (issue 12): the simulated kernel SIGKILLs the process
at its Nth write, before or after the write lands (``VGPUHOST_SIM_KILL_AT``,
``VGPUHOST_SIM_KILL_WHEN``); then one ``vgpuhost reconcile`` runs, and the
host must hold

- 0 half-bound groups (every function of a GPU's group on vfio-pci, or every
  one on its original driver with no ``driver_override`` left),
- 0 unrecorded devices (each function on vfio-pci and each vGPU has its record),
- 0 unaudited completed writes (each write that landed, as the simulated
  kernel logs it, has its audit row),
- 0 double allocations (one owner per group; each record names a device that
  exists, each vGPU one record; no owner holds more than it asked for),

with no open journal entry left (``reconcile --check`` exits 0), and the next
prepare/release cycle must restore the original drivers.

Each operation runs in a forked child of the test process (the CLI or the
hook handler, in process, as the real commands run), so a kill costs a fork
rather than an interpreter start.  The next cycle runs after every "after"
kill point (and the first "before" one): "before write N+1" leaves the host
as "after write N" does, differing only in the store, which the invariants
and ``reconcile --check`` read at every point.
"""

from __future__ import annotations

import io
import itertools
import os
import shutil
import sqlite3
import subprocess
from typing import Callable, Dict, List

import pytest

from vgpuhost.cli.main import main
from vgpuhost.hook import runtime as hook
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.observe.inventory import discover
from vgpuhost.sim import kernel as sim_kernel

from test_hook import domain_xml, mdev_hostdev, pci_hostdev

TURING = """
version: 1
name: turing-crash
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, snd_hda_intel, xhci_pci, i2c_nvidia_gpu]
devices:
  - {bdf: "0000:00:01.0", model: intel-root-port}
  - {bdf: "0000:01:00.0", model: RTX2080-TU104, upstream: "0000:00:01.0"}
  - {bdf: "0000:01:00.1", model: tu104-hda, upstream: "0000:00:01.0"}
  - {bdf: "0000:01:00.2", model: tu104-xhci, upstream: "0000:00:01.0"}
  - {bdf: "0000:01:00.3", model: tu104-ucsi, upstream: "0000:00:01.0"}
"""
GPU = "0000:01:00.0"
FUNCS = ["0000:01:00.0", "0000:01:00.1", "0000:01:00.2", "0000:01:00.3"]
ORIGINAL = {"0000:01:00.0": "nvidia", "0000:01:00.1": "snd_hda_intel",
            "0000:01:00.2": "xhci_hcd", "0000:01:00.3": "nvidia-gpu"}
A40_GPU = "0000:81:00.0"
MDEV = "aaaaaaaa-2222-4333-8444-00000000c0de"
DOM = "11111111-2222-4333-8444-00000000c0de"
LAYOUT = """
version: 1
layouts:
  desk:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu:
          types: {A40-8Q: 2}
"""


# ---------------------------------------------------------------------------
# running one operation in a child that may be killed

def _child(fn: Callable[[], int], env: Dict[str, str]) -> int:
    """Run ``fn`` in a forked child with ``env`` added; its exit code, or -signal."""
    import threading
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    assert not others, f"threads {others} run in the test process: a fork copies the locks they hold (a hang)"
    pid = os.fork()
    if pid == 0:                                    # the child: never returns
        code = 4
        try:
            os.environ.update(env)
            sim_kernel._writes_made = 0
            code = fn()
        finally:
            os._exit(code if isinstance(code, int) else 4)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def cli_op(host, *argv) -> Callable[[], int]:
    return lambda: main(["--root", str(host.root), *argv])


def hook_op(host, op: str, sub: str, xml: str) -> Callable[[], int]:
    return lambda: hook.main(["crash-vm", op, sub, "-"], io.BytesIO(xml.encode()), io.StringIO(), host=host)


def run(host, fn, log, *, kill_at: int = 0, when: str = "before") -> int:
    env = {sim_kernel.WRITE_LOG_ENV: str(log)}
    if kill_at:
        env.update({sim_kernel.KILL_AT_ENV: str(kill_at), sim_kernel.KILL_WHEN_ENV: when})
    return _child(fn, env)


# ---------------------------------------------------------------------------
# the invariants

def _db(host):
    conn = sqlite3.connect(host.state_dir / "state.db")
    return conn


def check_host(host, log, *, owners_max: Dict[str, int]) -> List[str]:
    """The four invariants; the problems found (empty: none)."""
    problems: List[str] = []
    fs = Sysfs(host)
    inv = discover(fs)
    store = StateStore(host.state_dir, create=False)
    try:
        pt = {r.bdf: r for r in store.passthrough_records()}
        vgpus = store.vgpu_records()
        audit = {(r.path, r.value) for r in store.audit_rows()}
        open_entries = store.journal_entries(open_only=True)
    finally:
        store.close()
    # half-bound groups, leftover overrides, unrecorded vfio-pci functions
    for g in inv.gpus:
        group = inv.group_of(g.address)
        members = [inv.devices[m] for m in group.members if not inv.devices[m].is_bridge] if group else []
        on_vfio = [d for d in members if d.driver == "vfio-pci"]
        if on_vfio and len(on_vfio) != len(members):
            problems.append(f"half-bound group of {g.address}: "
                            + ", ".join(f"{d.address}={d.driver}" for d in members))
        for d in members:
            if d.driver != "vfio-pci" and d.driver_override is not None:
                problems.append(f"{d.address} keeps driver_override {d.driver_override} on {d.driver}")
            if d.driver == "vfio-pci" and str(d.address) not in pt:
                problems.append(f"{d.address} on vfio-pci with no record")
            if d.driver is None:
                problems.append(f"{d.address} on no driver")
        owners = {pt[str(d.address)].owner for d in members if str(d.address) in pt}
        if len(owners) > 1:
            problems.append(f"group of {g.address} recorded for {sorted(owners)}")
    for bdf, r in pt.items():
        if Sysfs(host).link_name(host.pci_device(bdf) / "driver") != "vfio-pci":
            problems.append(f"record for {bdf} ({r.owner}) but it is not on vfio-pci")
    # vGPUs: present <-> recorded, one each
    present = {m.uuid: m.type_id for m in inv.mdevs}
    present.update({str(v.vf): v.type_id for v in inv.vf_vgpus if v.type_id})
    recorded = {r.id: r for r in vgpus}
    for vid in present:
        if vid not in recorded:
            problems.append(f"vGPU {vid} on the host with no record")
    for vid, r in recorded.items():
        if present.get(vid) != r.type_id:
            problems.append(f"vGPU {vid} recorded for {r.owner} but {'absent' if vid not in present else 'another type'}")
    per_owner: Dict[str, int] = {}
    for r in vgpus:
        per_owner[r.owner] = per_owner.get(r.owner, 0) + 1
    for owner, n in per_owner.items():
        if n > owners_max.get(owner, 0):
            problems.append(f"{owner} holds {n} vGPUs, asked for {owners_max.get(owner, 0)}")
    # every write that landed has its audit row
    if os.path.exists(log):
        for line in open(log, encoding="utf-8").read().splitlines():
            path, _, value = line.partition("\t")
            if (path, value) not in audit:
                problems.append(f"write {value!r} to {path} landed with no audit row")
    if open_entries:
        problems.append("journal entries still open: " + ", ".join(e.operation for e in open_entries))
    return problems


def drivers(host) -> Dict[str, str]:
    fs = Sysfs(host)
    return {b: fs.link_name(host.pci_device(b) / "driver") for b in FUNCS}


def copies(make_host, build, tmp_path) -> Callable[[], HostRoot]:
    """Fresh hosts as ``build(make_host)`` makes them: built once, then copied for each call (``cp -a``:
    the simulated tree's links are relative, nothing in it names its own path, and no process has its
    store open), so a sweep over N kill points costs one build (a layout apply, say) and N copies."""
    template = build(make_host)
    made = itertools.count()

    def fresh() -> HostRoot:
        dest = tmp_path / f"copy{next(made)}"
        subprocess.run(["cp", "-a", str(template.root), str(dest)], check=True, timeout=300)
        return HostRoot(dest)
    return fresh


def count_writes(fresh: Callable[[], HostRoot], op, tmp_path) -> int:
    """How many writes ``op`` makes on a fresh host when nothing kills it."""
    host = fresh()
    log = tmp_path / "count.log"
    rc = run(host, op(host), log)
    assert rc == 0, f"the operation itself fails (exit {rc})"
    n = len(open(log).read().splitlines())
    assert n > 0
    return n


def kill_everywhere(make_host, tmp_path, build, op, after_reconcile, *, owners_max, cycle, only=None,
                    check_ok=None):
    """Kill ``op`` at every write, before and after it lands; reconcile; check; run the next cycle.

    ``only(path)``: kill only at the writes whose logged path it accepts (an operation whose other
    writes other tests cover), to keep the suite's time in check.  ``check_ok(host, rc)``: whether
    ``reconcile --check``'s exit ``rc`` after the reconcile is right (default: 0 only)."""
    fresh = copies(make_host, build, tmp_path)
    total = count_writes(fresh, op, tmp_path)
    points = range(1, total + 1)
    if only is not None:
        lines = open(tmp_path / "count.log", encoding="utf-8").read().splitlines()
        points = [n for n in points if only(lines[n - 1].partition("\t")[0])]
        assert points, "no write to kill at"
    failures = []
    for when in ("before", "after"):
        for n in points:
            host = fresh()
            log = tmp_path / f"w-{when}-{n}.log"
            if os.path.exists(log):
                os.unlink(log)
            rc = run(host, op(host), log, kill_at=n, when=when)
            if rc != -9:
                failures.append(f"{when} write {n}: not killed (exit {rc})")
                continue
            rc = run(host, cli_op(host, "reconcile"), log)
            problems = check_host(host, log, owners_max=owners_max)
            if rc not in (0, 1):
                problems.append(f"reconcile exit {rc}")
            rc = run(host, cli_op(host, "reconcile", "--check"), log)
            if not (check_ok(host, rc) if check_ok is not None else rc == 0):
                problems.append(f"reconcile --check exit {rc} after reconcile")
            problems += after_reconcile(host, log)
            if when == "after" or n == points[0]:   # the host between two writes: checked once (see cost)
                problems += cycle(host, log)
            if problems:
                failures.append(f"kill {when} write {n}/{total}: " + "; ".join(problems))
            else:
                shutil.rmtree(host.root, ignore_errors=True)     # hundreds of trees: keep /tmp small
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------
# passthrough prepare / release (CLI)

def _turing(make_host):
    return make_host(yaml_text=TURING)


def _turing_prepared(make_host):
    host = make_host(yaml_text=TURING)
    assert main(["--root", str(host.root), "passthrough", "prepare", GPU]) == 0
    return host


def _pt_cycle(host, log) -> List[str]:
    """The next prepare / release cycle ends on the original drivers."""
    out = []
    if run(host, cli_op(host, "passthrough", "prepare", GPU), log) != 0:
        out.append("the next prepare failed")
    elif set(drivers(host).values()) != {"vfio-pci"}:
        out.append(f"the next prepare left {drivers(host)}")
    if run(host, cli_op(host, "passthrough", "release", GPU), log) != 0:
        out.append("the next release failed")
    if drivers(host) != ORIGINAL:
        out.append(f"after the next cycle: {drivers(host)}")
    return out + check_host(host, log, owners_max={})


def _nothing(host, log) -> List[str]:
    return []


def test_kill_during_passthrough_prepare(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _turing, lambda h: cli_op(h, "passthrough", "prepare", GPU),
                    _nothing, owners_max={}, cycle=_pt_cycle)


def test_kill_during_passthrough_release(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _turing_prepared, lambda h: cli_op(h, "passthrough", "release", GPU),
                    _nothing, owners_max={}, cycle=_pt_cycle)


# ---------------------------------------------------------------------------
# vgpu create / remove (CLI)

def _a40(make_host):
    return make_host("a40-mdev")


def _a40_with_vgpu(make_host):
    host = make_host("a40-mdev")
    assert main(["--root", str(host.root), "vgpu", "create", "--profile", "A40-8Q", "--uuid", MDEV]) == 0
    return host


def _vgpu_cycle(host, log) -> List[str]:
    """The next create / remove cycle works and leaves no vGPU behind."""
    out = []
    store = StateStore(host.state_dir, create=False)
    try:
        held = [r.id for r in store.vgpu_records()]
    finally:
        store.close()
    for vid in held:
        if run(host, cli_op(host, "vgpu", "remove", vid), log) != 0:
            out.append(f"removing the recorded {vid} failed")
    if run(host, cli_op(host, "vgpu", "create", "--profile", "A40-8Q", "--uuid", MDEV), log) != 0:
        out.append("the next create failed")
    if run(host, cli_op(host, "vgpu", "remove", MDEV), log) != 0:
        out.append("the next remove failed")
    if discover(Sysfs(host)).mdevs:
        out.append("mdevs left after the next cycle")
    return out + check_host(host, log, owners_max={})


def test_kill_during_vgpu_create(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _a40,
                    lambda h: cli_op(h, "vgpu", "create", "--profile", "A40-8Q", "--uuid", MDEV),
                    _nothing, owners_max={"manual": 1}, cycle=_vgpu_cycle)


def test_kill_during_vgpu_remove(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _a40_with_vgpu, lambda h: cli_op(h, "vgpu", "remove", MDEV),
                    _nothing, owners_max={"manual": 1}, cycle=_vgpu_cycle)


# ---------------------------------------------------------------------------
# the qemu hook: prepare begin / release end (a passthrough domain and a vGPU domain)

PT_XML = domain_xml("crash-vm", DOM, Metadata(passthrough=[__import__("vgpuhost.model.values", fromlist=["x"])
                                                          .PciAddress.parse(GPU)]),
                    [pci_hostdev(f) for f in FUNCS])
VGPU_XML = domain_xml("crash-vm", DOM, Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV)]), [mdev_hostdev(MDEV)])


def _hook_cycle(xml, host_check):
    def cycle(host, log) -> List[str]:
        out = []
        # libvirt runs release end after a failed start; then the next start and stop
        run(host, hook_op(host, "release", "end", xml), log)
        if run(host, hook_op(host, "prepare", "begin", xml), log) != 0:
            out.append("the next prepare begin failed")
        if run(host, hook_op(host, "release", "end", xml), log) != 0:
            out.append("the next release end failed")
        out += host_check(host)
        return out + check_host(host, log, owners_max={})
    return cycle


def _started(host, xml):
    """What the hook's prepare begin does, without its process runtime (alarm, signals): a setup step."""
    from vgpuhost.libvirt.domxml import parse_domain
    from vgpuhost.ops.devices import prepare as devices_prepare
    devices_prepare(host, parse_domain(xml), actor="test setup")
    return host


def _turing_started(make_host):
    return _started(make_host(yaml_text=TURING), PT_XML)


def _a40_started(make_host):
    return _started(make_host("a40-mdev"), VGPU_XML)


def _pt_restored(host) -> List[str]:
    return [] if drivers(host) == ORIGINAL else [f"after the next start/stop: {drivers(host)}"]


def _no_mdevs(host) -> List[str]:
    return ["mdevs left after the next start/stop"] if discover(Sysfs(host)).mdevs else []


def test_kill_during_hook_prepare_begin_passthrough(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _turing, lambda h: hook_op(h, "prepare", "begin", PT_XML),
                    _nothing, owners_max={}, cycle=_hook_cycle(PT_XML, _pt_restored))


def test_kill_during_hook_release_end_passthrough(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _turing_started, lambda h: hook_op(h, "release", "end", PT_XML),
                    _nothing, owners_max={}, cycle=_hook_cycle(PT_XML, _pt_restored))


def test_kill_during_hook_prepare_begin_vgpu(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _a40, lambda h: hook_op(h, "prepare", "begin", VGPU_XML),
                    _nothing, owners_max={DOM: 1}, cycle=_hook_cycle(VGPU_XML, _no_mdevs))


def test_kill_during_hook_release_end_vgpu(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _a40_started, lambda h: hook_op(h, "release", "end", VGPU_XML),
                    _nothing, owners_max={DOM: 1}, cycle=_hook_cycle(VGPU_XML, _no_mdevs))


def retry_without_reconcile(make_host, tmp_path, build, xml, host_check, *, retry: bool = True):
    """Kill the hook's prepare begin at every write; the retried start (no reconcile between) must
    succeed, and the stop after it leave the host as it was, with no journal entry open.  ``retry``
    False: the domain is stopped at once, and that stop finishes or rolls back what the killed start
    left (the breaker's finding: the vGPU stayed, foreign, until a reconcile)."""
    fresh = copies(make_host, build, tmp_path)
    total = count_writes(fresh, lambda h: hook_op(h, "prepare", "begin", xml), tmp_path)
    failures = []
    for when in ("before", "after"):
        for n in range(1, total + 1):
            host = fresh()
            log = tmp_path / f"r-{when}-{n}.log"
            if run(host, hook_op(host, "prepare", "begin", xml), log, kill_at=n, when=when) != -9:
                failures.append(f"{when} write {n}: not killed")
                continue
            problems = []
            if retry and run(host, hook_op(host, "prepare", "begin", xml), log) != 0:
                problems.append("the retried prepare begin failed")
            if run(host, hook_op(host, "release", "end", xml), log) != 0:
                problems.append("the release end after it failed")
            problems += host_check(host) + check_host(host, log, owners_max={})
            if problems:
                failures.append(f"kill {when} write {n}/{total}: " + "; ".join(problems))
            else:
                shutil.rmtree(host.root, ignore_errors=True)
    assert not failures, "\n".join(failures)


def test_hook_prepare_begin_killed_then_stopped_vgpu(make_host, tmp_path):
    retry_without_reconcile(make_host, tmp_path, _a40, VGPU_XML, _no_mdevs, retry=False)


def test_hook_prepare_begin_killed_then_stopped_passthrough(make_host, tmp_path):
    retry_without_reconcile(make_host, tmp_path, _turing, PT_XML, _pt_restored, retry=False)


def test_hook_prepare_begin_retried_without_reconcile_vgpu(make_host, tmp_path):
    retry_without_reconcile(make_host, tmp_path, _a40, VGPU_XML, _no_mdevs)


def test_hook_prepare_begin_retried_without_reconcile_passthrough(make_host, tmp_path):
    retry_without_reconcile(make_host, tmp_path, _turing, PT_XML, _pt_restored)


# ---------------------------------------------------------------------------
# apply (a layout of two vGPUs)

def test_kill_during_apply(make_host, tmp_path):
    cfg = tmp_path / "layout.yaml"
    cfg.write_text(LAYOUT)

    def cycle(host, log) -> List[str]:
        out = []
        if run(host, cli_op(host, "apply", "-c", str(cfg)), log) != 0:
            out.append("the next apply failed")
        if run(host, cli_op(host, "assert", "-c", str(cfg)), log) != 0:
            out.append("the layout does not hold after the next apply")
        return out + check_host(host, log, owners_max={"layout": 2})

    kill_everywhere(make_host, tmp_path, _a40, lambda h: cli_op(h, "apply", "-c", str(cfg)),
                    _nothing, owners_max={"layout": 2}, cycle=cycle)


# ---------------------------------------------------------------------------
# vgpu create --persist: the mdevctl definition goes with the vGPU, or neither stays

def _definitions(host) -> Dict[str, str]:
    """``{uuid: parent}`` of every mdevctl definition under the root."""
    d = host.mdevctl_d
    if not d.is_dir():
        return {}
    return {u.name: p.name for p in d.iterdir() for u in p.iterdir()}


def _persist_consistent(host, log) -> List[str]:
    """Each persisted record has its definition, and each definition a persisted record (or none at all)."""
    store = StateStore(host.state_dir, create=False)
    try:
        recs = {r.id: r for r in store.vgpu_records()}
    finally:
        store.close()
    defs = _definitions(host)
    out = [f"definition of {u} with no record" for u in defs if u not in recs]
    out += [f"persisted {u} with no definition" for u, r in recs.items() if r.persisted and u not in defs]
    out += [f"definition of {u} under {p}, vGPU on {recs[u].parent}" for u, p in defs.items()
            if u in recs and recs[u].parent != p]
    return out


def _persist_cycle(host, log) -> List[str]:
    out = _vgpu_cycle(host, log)
    if run(host, cli_op(host, "vgpu", "create", "--profile", "A40-8Q", "--uuid", MDEV, "--persist"), log) != 0:
        out.append("the next create --persist failed")
    elif _definitions(host) != {MDEV: A40_GPU}:
        out.append(f"the next create --persist left definitions {_definitions(host)}")
    if run(host, cli_op(host, "vgpu", "remove", MDEV), log) != 0:
        out.append("the next remove failed")
    if _definitions(host):
        out.append(f"definitions left after the next remove: {_definitions(host)}")
    return out + check_host(host, log, owners_max={})


def test_kill_during_vgpu_create_persist(make_host, tmp_path):
    kill_everywhere(make_host, tmp_path, _a40,
                    lambda h: cli_op(h, "vgpu", "create", "--profile", "A40-8Q", "--uuid", MDEV, "--persist"),
                    _persist_consistent, owners_max={"manual": 1}, cycle=_persist_cycle)


# ---------------------------------------------------------------------------
# NVML writes (issue 12, the MIG/scheduler part): mig enable/disable, mig apply, scheduler set,
# mixed-size mode, and a layout apply that carries MIG and scheduler changes.  The simulated NVML
# counts its changes in the same kill-at-Nth-write counter as the simulated kernel and logs them
# to the same write log, so kill_everywhere covers every NVML call as it covers sysfs writes.

A100 = "0000:41:00.0"
A100_MIG = """
version: 1
name: a100-mig-crash
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:40:01.0", model: intel-root-port, numa_node: 0}
  - {bdf: "0000:41:00.0", model: A100-PCIE-40GB, upstream: "0000:40:01.0", numa_node: 0,
     vgpu: {backend: mdev, sriov_numvfs: 0}, mig: {mode: MODE}}
"""
SEVERAL = "3g.20gb=1,2g.10gb=1,1g.5gb=2"
ALL_1G = "1g.5gb=7"
TWO_3G = "3g.20gb=2"


def _nvml(host):
    from vgpuhost.io.backends import backend_for
    return backend_for(host)


def mig_layout(host, gpu=A100) -> Dict[str, int]:
    """The GPU's GPU instances as ``{profile name: count}`` (empty with MIG mode off)."""
    from vgpuhost.policy.mig import counts
    b = _nvml(host)
    mode = b.mig_mode(gpu)
    return counts(b.gi_profiles(gpu), b.gpu_instances(gpu)) if mode and mode[0] else {}


def _layout(text: str) -> Dict[str, int]:
    from vgpuhost.policy.mig import parse_layout
    return parse_layout(text)


def _a100(mig_on: bool, layout: str = ""):
    def build(make_host):
        host = make_host(yaml_text=A100_MIG.replace("MODE", "true" if mig_on else "false"))
        if layout:
            assert main(["--root", str(host.root), "mig", "apply", "--gpu", A100, layout]) == 0
        return host
    return build


def _layout_is(*allowed: Dict[str, int], mode=None):
    """After reconcile: the GPU holds one of ``allowed`` layouts whole (no half layout, no GPU
    instance that neither the old nor the new layout has: none owned by no one)."""
    def check(host, log) -> List[str]:
        got = mig_layout(host)
        out = [] if got in allowed else [f"half a MIG layout: {got} (allowed: {list(allowed)})"]
        if mode is not None:
            m = _nvml(host).mig_mode(A100)
            if m[1] not in mode:
                out.append(f"MIG mode {m}, wanted pending in {mode}")
        return out
    return check


def _mig_cycle(argv, want: Dict[str, int], mode=True):
    """The next run of the same command reaches the wanted state."""
    def cycle(host, log) -> List[str]:
        out = []
        if run(host, cli_op(host, *argv), log) != 0:
            out.append(f"the next {' '.join(argv[:2])} failed")
        if mig_layout(host) != want:
            out.append(f"after the next run: {mig_layout(host)}, wanted {want}")
        if _nvml(host).mig_mode(A100) != (mode, mode):
            out.append(f"after the next run: MIG mode {_nvml(host).mig_mode(A100)}")
        return out + check_host(host, log, owners_max={})
    return cycle


def test_kill_during_mig_enable(make_host, tmp_path):
    argv = ("mig", "enable", "--gpu", A100)
    kill_everywhere(make_host, tmp_path, _a100(False), lambda h: cli_op(h, *argv),
                    _layout_is({}, mode=(False, True)), owners_max={}, cycle=_mig_cycle(argv, {}))


def test_kill_during_mig_disable(make_host, tmp_path):
    argv = ("mig", "disable", "--gpu", A100)

    def old_or_off(host, log) -> List[str]:
        m, got = _nvml(host).mig_mode(A100), mig_layout(host)
        if m == (False, False) and got == {}:
            return []
        if m == (True, True) and got == _layout(SEVERAL):
            return []
        return [f"MIG mode {m} with {got}: neither the old layout nor MIG off"]

    kill_everywhere(make_host, tmp_path, _a100(True, SEVERAL), lambda h: cli_op(h, *argv), old_or_off,
                    owners_max={}, cycle=_mig_cycle(argv, {}, mode=False))


def test_kill_during_mig_apply_of_several_instances(make_host, tmp_path):
    argv = ("mig", "apply", "--gpu", A100, SEVERAL)
    kill_everywhere(make_host, tmp_path, _a100(True), lambda h: cli_op(h, *argv),
                    _layout_is({}, _layout(SEVERAL)), owners_max={}, cycle=_mig_cycle(argv, _layout(SEVERAL)))


def test_kill_during_mig_apply_from_one_layout_to_another(make_host, tmp_path):
    argv = ("mig", "apply", "--gpu", A100, TWO_3G)
    kill_everywhere(make_host, tmp_path, _a100(True, ALL_1G), lambda h: cli_op(h, *argv),
                    _layout_is(_layout(ALL_1G), _layout(TWO_3G)), owners_max={},
                    cycle=_mig_cycle(argv, _layout(TWO_3G)))


def test_kill_during_scheduler_set(make_host, tmp_path):
    from vgpuhost.model.nvml import SchedulerState
    argv = ("scheduler", "set", "--gpu", A40_GPU, "--policy", "equal-share", "--timeslice-ms", "3")
    want = SchedulerState("equal-share", arr=False, timeslice_ms=3)

    def old_or_new(host, log) -> List[str]:
        got = _nvml(host).scheduler_state(A40_GPU)
        return [] if got.policy == "best-effort" or got == want else [f"scheduler {got}"]

    def cycle(host, log) -> List[str]:
        out = [] if run(host, cli_op(host, *argv), log) == 0 else ["the next scheduler set failed"]
        if _nvml(host).scheduler_state(A40_GPU) != want:
            out.append(f"after the next run: {_nvml(host).scheduler_state(A40_GPU)}")
        return out + check_host(host, log, owners_max={})

    kill_everywhere(make_host, tmp_path, _a40, lambda h: cli_op(h, *argv), old_or_new, owners_max={},
                    cycle=cycle)


def test_kill_during_mixed_size_mode(make_host, tmp_path):
    argv = ("vgpu", "mode", "--gpu", A40_GPU, "--mixed-size", "on")

    def cycle(host, log) -> List[str]:
        out = [] if run(host, cli_op(host, *argv), log) == 0 else ["the next vgpu mode failed"]
        if not _nvml(host).heterogeneous_mode(A40_GPU):
            out.append("mixed-size mode off after the next run")
        return out + check_host(host, log, owners_max={})

    kill_everywhere(make_host, tmp_path, _a40, lambda h: cli_op(h, *argv), _nothing, owners_max={}, cycle=cycle)


def test_kill_during_apply_with_mig_and_scheduler_changes(make_host, tmp_path):
    """The example A100 config, from its 'mig' layout (MIG on, four GPU instances, a MIG-backed
    vGPU on each) to its 'compute' layout: the vGPUs go, the GPU instances go, MIG mode goes off,
    the scheduler changes, four time-sliced vGPUs come."""
    from pathlib import Path
    from vgpuhost.model.nvml import SchedulerState
    cfg = str(Path(__file__).resolve().parents[1] / "examples" / "config" / "vgpu-a100.yaml")
    gpu = A100                          # the a100-sriov-mdev spec's GPU
    old = {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}
    sched = SchedulerState("equal-share", arr=True, frequency_hz=480, avg_factor=33)

    def build(make_host):
        host = make_host("a100-sriov-mdev")
        assert main(["--root", str(host.root), "apply", "-c", cfg, "mig"]) == 0
        return host

    def consistent(host, log) -> List[str]:
        b = _nvml(host)
        m, got = b.mig_mode(gpu), mig_layout(host, gpu)
        out = []
        if not ((m == (True, True) and got == old) or (m == (False, False) and got == {})):
            out.append(f"MIG mode {m} with {got}: neither the old layout nor MIG off")
        if m[0] is False and b.scheduler_state(gpu).policy not in ("best-effort", sched.policy):
            out.append(f"scheduler {b.scheduler_state(gpu)}")
        return out

    def cycle(host, log) -> List[str]:
        out = []
        if run(host, cli_op(host, "apply", "-c", cfg, "compute"), log) != 0:
            out.append("the next apply failed")
        if run(host, cli_op(host, "assert", "-c", cfg, "compute"), log) != 0:
            out.append("the layout does not hold after the next apply")
        if _nvml(host).scheduler_state(gpu) != sched:
            out.append(f"scheduler after the next apply: {_nvml(host).scheduler_state(gpu)}")
        return out + check_host(host, log, owners_max={"layout": 4})

    # every NVML write of the apply (GPU instances, MIG mode, scheduler), before and after it lands;
    # the vGPU writes around them are covered by test_kill_during_apply and the vgpu tests
    kill_everywhere(make_host, tmp_path, build, lambda h: cli_op(h, "apply", "-c", cfg, "compute"), consistent,
                    owners_max={"layout": 4}, cycle=cycle, only=lambda path: path.startswith("nvml:"))


def test_a_stop_that_cannot_end_its_killed_start_says_so_and_keeps_the_domain(make_host, tmp_path):
    """The second breaker's finding: the killed start's vGPU cannot be removed (an injected remove fault): the stop exits 3
    with one line naming the interrupted operation, and the domain stays recorded (its marker too), so
    the next stop tries again; once the fault is gone it releases the vGPU."""
    from vgpuhost.sim.kernel import SimKernel
    host = _a40(make_host)
    log = tmp_path / "w.log"
    total = count_writes(lambda: _a40(make_host), lambda h: hook_op(h, "prepare", "begin", VGPU_XML), tmp_path)
    kill_at = next(n for n in range(1, total + 1)
                   if run(h := _a40(make_host), hook_op(h, "prepare", "begin", VGPU_XML), log, kill_at=n,
                          when="after") == -9 and discover(Sysfs(h)).mdevs)
    assert run(host, hook_op(host, "prepare", "begin", VGPU_XML), log, kill_at=kill_at, when="after") == -9
    assert discover(Sysfs(host)).mdevs
    k = SimKernel(host)
    meta = k.meta()
    meta["faults"] = [{"op": "remove", "errno": 16}]
    k.save_meta(meta)
    err = io.StringIO()
    assert hook.main(["crash-vm", "release", "end", "-"], io.BytesIO(VGPU_XML.encode()), err, host=host) == 3
    line = err.getvalue()
    assert line.count("\n") == 1 and "interrupted operation" in line and "reconcile" in line, line
    assert DOM in StateStore(host.state_dir).active_domains()
    assert (host.state_dir / "domains" / DOM).exists()
    meta["faults"] = []
    k.save_meta(meta)
    assert hook.main(["crash-vm", "release", "end", "-"], io.BytesIO(VGPU_XML.encode()), io.StringIO(), host=host) == 0
    assert not discover(Sysfs(host)).mdevs and DOM not in StateStore(host.state_dir).active_domains()


def test_a_vgpu_half_made_by_a_kill_is_reported_as_interrupted_not_foreign(make_host, tmp_path, capsys):
    """Killed right after the mdev's create landed: ``reconcile --check`` names the device under the open
    entry that will remove it, not as a foreign vGPU left alone (which ``reconcile`` then removes)."""
    host = make_host("a40-mdev")
    assert run(host, cli_op(host, "vgpu", "create", "--profile", "A40-8Q"), tmp_path / "w.log",
               kill_at=1, when="after") == -9
    made = [m.uuid for m in discover(Sysfs(host)).mdevs]
    assert len(made) == 1
    capsys.readouterr()
    assert main(["--root", str(host.root), "--local", "reconcile", "--check"]) == 1
    out = capsys.readouterr().out
    assert f"interrupted (its open journal entry finishes or removes it): {made[0]}" in out
    assert "foreign" not in out


# ---------------------------------------------------------------------------
# killed inside the simulated kernel's mdev create (trial 6 #7): the kernel's create is one write(2)

#: the simulator's own steps that change the tree while it lays an mdev out (or takes one away)
_TREE_STEPS = ("_symlink", "_create_file", "_unlink", "_rmtree")


def _killed_at_tree_step(fn: Callable[[], int], step: int, made: list) -> Callable[[], int]:
    """``fn`` in a child that SIGKILLs itself before the simulator's ``step``-th tree change (0: never;
    the count of changes made is appended to ``made``'s file, ``made[0]``)."""
    def child() -> int:
        count = [0]

        def counted(f):
            def step_then(*a, **kw):
                count[0] += 1
                if count[0] == step:
                    os.kill(os.getpid(), 9)
                return f(*a, **kw)
            return step_then
        for name in _TREE_STEPS:
            setattr(sim_kernel, name, counted(getattr(sim_kernel, name)))
        rc = fn()
        with open(made[0], "w") as f:
            f.write(str(count[0]))
        return rc
    return child


def _vgpus_listed(host, capsys) -> Dict[str, str]:
    """``vgpu list --json``: ``{id: state}``."""
    import json
    capsys.readouterr()
    assert main(["--root", str(host.root), "--local", "--json", "vgpu", "list"]) == 0
    return {v["id"]: v["state"] for v in json.loads(capsys.readouterr().out)["vgpus"]}


def _mdev_dirs(host) -> List[str]:
    """UUID-named directories under the A40's device directory (the tree, as a reader lists it)."""
    pdir = os.path.realpath(host.pci_device(A40_GPU))
    return sorted(n for n in os.listdir(pdir) if len(n) == 36 and os.path.isdir(os.path.join(pdir, n)))


@pytest.mark.parametrize("after", ["next start", "sim reboot"])
def test_a_hook_killed_inside_the_simulated_mdev_create_leaves_no_half_mdev(make_host, tmp_path, capsys, after):
    """kill -9 of a hook start while the simulator lays its mdev out (right after the directory, half
    way, before the bus link): reconcile --check is in sync and ``vgpu list`` shows what the tree
    holds; the next start of the domain makes the mdev (no EEXIST), or ``sim reboot`` leaves no
    device directory behind."""
    fresh = copies(make_host, _a40, tmp_path)
    made = [str(tmp_path / "steps")]
    host = fresh()
    assert run(host, _killed_at_tree_step(hook_op(host, "prepare", "begin", VGPU_XML), 0, made), tmp_path / "n.log") == 0
    total = int(open(made[0]).read())
    assert total >= 10
    for step in (1, total // 2, total):
        host = fresh()
        log = tmp_path / f"s{step}.log"
        assert run(host, _killed_at_tree_step(hook_op(host, "prepare", "begin", VGPU_XML), step, made), log) == -9
        assert run(host, cli_op(host, "reconcile"), log) in (0, 1)
        assert run(host, cli_op(host, "reconcile", "--check"), log) == 0, step
        listed = _vgpus_listed(host, capsys)
        assert listed == {m.uuid: "active" for m in discover(Sysfs(host)).mdevs} == {}, step
        if after == "sim reboot":
            assert main(["--root", str(host.root), "sim", "reboot"]) == 0
            assert _mdev_dirs(host) == [], step
        problems = _hook_cycle(VGPU_XML, _no_mdevs)(host, log)
        assert not problems, f"step {step}/{total}: {problems}"
        assert _mdev_dirs(host) == [], step
        assert run(host, hook_op(host, "prepare", "begin", VGPU_XML), log) == 0
        assert _vgpus_listed(host, capsys) == {MDEV: "active"}
        assert _mdev_dirs(host) == [MDEV] and run(host, cli_op(host, "reconcile", "--check"), log) == 0
