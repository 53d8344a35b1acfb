"""The qemu hook on simulated hosts: the handler in process, and the installed dispatcher as real processes.

Every outcome is read back from the simulated sysfs tree (mdev devices,
``driver`` links, ``current_vgpu_type``), the state store (records, owners,
running domains) and the audit log (one row per write: "nothing written"
means no row).  Domain documents are built here as libvirt writes them: the
hostdevs plus vgpuhost's metadata element from :class:`vgpuhost.domxml.Metadata`.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from vgpuhost.hook import runtime as hook
from vgpuhost.hook.install import install as hook_install
from vgpuhost.ops.devices import allow_path
from vgpuhost.cli.main import main as cli_main
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.observe.inventory import discover
from vgpuhost.io.locks import file_lock
from vgpuhost.io.state import DB_NAME, StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress

A = PciAddress.parse

DOM1 = "11111111-2222-4333-8444-000000000001"
DOM2 = "11111111-2222-4333-8444-000000000002"
MDEV1 = "aaaaaaaa-2222-4333-8444-000000000001"
MDEV2 = "aaaaaaaa-2222-4333-8444-000000000002"

A40 = A("0000:81:00.0")                 # a40-mdev
A100, A100_AUDIO = A("0000:41:00.0"), A("0000:41:00.1")   # a100-sriov-mdev
NIC = A("0000:00:1f.6")                 # a100-sriov-mdev: an Intel NIC
L40S_0 = A("0000:21:00.0")              # l40s-vendor-vfio
VF_0, VF_1 = A("0000:21:00.4"), A("0000:21:00.5")
SATA_GPU, SATA_AUDIO, SATA_DISK = A("0000:03:00.0"), A("0000:03:00.1"), A("0000:04:00.0")

# two A40 (classic mdev, one with an HD-audio companion), an Intel iGPU, an L40S (vendor VFIO)
MIXED = """
version: 1
name: hook-mixed
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio, snd_hda_intel]
devices:
  - {{bdf: "0000:00:02.0", model: intel-uhd-630}}
  - {{bdf: "0000:40:01.0", model: intel-root-port, numa_node: 0}}
  - {{bdf: "0000:41:00.0", model: A40, upstream: "0000:40:01.0", numa_node: 0, vgpu: {{backend: mdev}}}}
  - {{bdf: "0000:41:00.1", model: nvidia-hda, upstream: "0000:40:01.0", numa_node: 0}}
  - {{bdf: "0000:80:01.0", model: intel-root-port, numa_node: 1}}
  - {{bdf: "0000:81:00.0", model: A40, upstream: "0000:80:01.0", numa_node: 1, vgpu: {{backend: mdev}}}}
  - {{bdf: "0000:a0:01.1", model: amd-root-port, numa_node: 1}}
  - {{bdf: "0000:a1:00.0", model: L40S, upstream: "0000:a0:01.1", numa_node: 1,
      vgpu: {{backend: vendor-vfio, sriov_numvfs: 8}}}}
faults: [{faults}]
"""
GPU_LO, GPU_HI, IGPU, L40S = A("0000:41:00.0"), A("0000:81:00.0"), A("0000:00:02.0"), A("0000:a1:00.0")


def mixed(make_host, faults: str = ""):
    return make_host(yaml_text=MIXED.format(faults=faults))


def mixed_l40s_vfs_off(make_host, faults: str = ""):
    """:data:`MIXED` after ``sriov-manage -d`` on the L40S (no VFs, so no vGPU there): the L40S can be
    passed through (vfio-pci binds no PF with VFs enabled, issue 12 #4c)."""
    text = MIXED.replace("vgpu: {{backend: vendor-vfio, sriov_numvfs: 8}}", "vgpu: {{backend: none}}")
    assert text != MIXED
    return make_host(yaml_text=text.format(faults=faults))


def a100_vfs_off(make_host):
    """a100-sriov-mdev after ``sriov-manage -d``: vfio-pci binds no PF with VFs enabled (issue 12 #4c),
    so passthrough of the A100 needs its VFs off."""
    from vgpuhost.sim.data import bundled_specs
    text = open(bundled_specs()["a100-sriov-mdev"]).read()
    return make_host(yaml_text=text.replace("sriov_numvfs: 20", "sriov_numvfs: 0"))


# ---------------------------------------------------------------------------
# domain documents

def pci_hostdev(bdf, managed: bool = False) -> str:
    a = A(str(bdf))
    return (f"<hostdev mode='subsystem' type='pci' managed='{'yes' if managed else 'no'}'><source>"
            f"<address domain='0x{a.domain:04x}' bus='0x{a.bus:02x}' slot='0x{a.slot:02x}' "
            f"function='0x{a.function:x}'/></source></hostdev>")


def mdev_hostdev(uuid: str) -> str:
    return (f"<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'><source>"
            f"<address uuid='{uuid}'/></source></hostdev>")


def domain_xml(name: str, uuid: str, meta: Optional[Metadata] = None, hostdevs: Sequence[str] = (),
               raw_meta: Optional[str] = None) -> str:
    """A domain document as libvirt passes it to ``prepare begin`` (live XML, with id=)."""
    md = raw_meta if raw_meta is not None else (meta.to_xml() if meta is not None else "")
    return (f"<domain type='kvm' id='7'>\n  <name>{name}</name>\n  <uuid>{uuid}</uuid>\n"
            f"  <metadata>\n{md}  </metadata>\n  <memory unit='KiB'>65536</memory>\n"
            f"  <os><type arch='x86_64' machine='pc'>hvm</type></os>\n  <devices>\n    "
            + "\n    ".join(hostdevs) + "\n  </devices>\n</domain>\n")


def vgpu_domain(name: str, uuid: str, mdev: str, profile: str = "A40-8Q", *, strategy: str = "first-fit",
                gpu=None) -> str:
    meta = Metadata(strategy=strategy, vgpus=[VgpuRequest(profile, uuid=mdev, gpu=gpu)])
    return domain_xml(name, uuid, meta, [mdev_hostdev(mdev)])


def vf_domain(name: str, uuid: str, vf, profile: str = "L40S-4Q") -> str:
    meta = Metadata(vgpus=[VgpuRequest(profile, vf=A(str(vf)))])
    return domain_xml(name, uuid, meta, [pci_hostdev(vf)])


def pt_domain(name: str, uuid: str, gpu, functions: Sequence, *, managed: bool = False) -> str:
    meta = Metadata(passthrough=[A(str(gpu))])
    return domain_xml(name, uuid, meta, [pci_hostdev(f, managed) for f in functions])


# ---------------------------------------------------------------------------
# running the hook

def call(host, name: str, op: str, sub: str, xml: str) -> Tuple[int, str]:
    """The handler in process: (exit code, stderr)."""
    err = io.StringIO()
    rc = hook.main([name, op, sub, "-"], io.BytesIO(xml.encode()), err, host=host)
    return rc, err.getvalue()


def start(host, name: str, xml: str, *, bind: bool = True) -> Tuple[int, str]:
    """``prepare begin`` in process.  ``bind``: first bind the domain, as its operator would with
    ``vgpuhost tenant bind --from-metadata``, to the tenant its metadata names when that tenant exists
    and the domain has no binding yet (issue 28: the metadata only asks); False for tests of a domain
    the operator did not bind (forgery, unbound domains)."""
    if bind:
        bind_as_asked(host, xml)
    return call(host, name, "prepare", "begin", xml)


def bind_as_asked(host, xml: str) -> None:
    """Bind the domain of ``xml`` to the tenant its metadata names (see :func:`start`)."""
    from vgpuhost.io.state import StateStore
    from vgpuhost.libvirt.domxml import parse_domain
    from vgpuhost.ops import tenancy
    from vgpuhost.model.errors import VgpuhostError
    try:
        view = parse_domain(xml)
    except VgpuhostError:
        return                      # metadata the hook refuses: nothing to bind, the start says why
    asked = getattr(view.metadata, "tenant", None)
    if not asked or not (host.state_dir / "state.db").exists():
        return
    store = StateStore(host.state_dir)
    try:
        if store.binding(view.uuid) is None and store.tenant_rows(asked):
            tenancy.bind(store, view.uuid, asked, name=view.name, actor="test operator")
    finally:
        store.close()


def stop(host, name: str, xml: str) -> Tuple[int, str]:
    return call(host, name, "release", "end", xml)


def install(host, tmp_path, **kw) -> Path:
    out = hook_install(host, hooks_dir=tmp_path / "qemu.d", **kw)
    return Path(out.path)


def dispatch(path: Path, argv: Sequence[str], data: bytes, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the installed dispatcher as libvirt (>= 10.5) does: minimal environment, XML on stdin."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C",
           "USER": "root", "LOGNAME": "root"}
    return subprocess.run([str(path), *argv], input=data, capture_output=True, env=env, timeout=timeout)


# ---------------------------------------------------------------------------
# reading the host back

def mdevs(host) -> Dict[str, str]:
    """``{uuid: type id}`` of every mdev in the tree."""
    fs = Sysfs(host)
    return {u: fs.link_name(host.mdev_devices / u / "mdev_type") for u in fs.listdir(host.mdev_devices)}


def mdev_gpu(host, uuid: str) -> PciAddress:
    inv = discover(Sysfs(host))
    parent = next(m.parent for m in inv.mdevs if m.uuid == uuid)
    return next(g.address for g in inv.gpus if parent in g.mdev_parents)


def driver(host, bdf) -> Optional[str]:
    return Sysfs(host).link_name(host.pci_device(str(bdf)) / "driver")


def vf_type(host, vf) -> Optional[str]:
    return Sysfs(host).read_optional(host.pci_device(str(vf)) / "nvidia" / "current_vgpu_type")


def tree(host) -> dict:
    """Everything a hook could change: mdevs, every device's driver, driver_override and vGPU type."""
    fs = Sysfs(host)
    out: dict = {"mdevs": mdevs(host)}
    for b in fs.listdir(host.pci_devices):
        d = host.pci_device(b)
        out[b] = (fs.link_name(d / "driver"), fs.read_optional(d / "driver_override"),
                  fs.read_optional(d / "nvidia" / "current_vgpu_type"))
    return out


def store(host) -> StateStore:
    return StateStore(host.state_dir)


def audit(host) -> list:
    """Audit rows; an absent store has none (and is not created by looking)."""
    if not (host.state_dir / DB_NAME).exists():
        return []
    return store(host).audit_rows()


def writes(host) -> list:
    """Audit rows of sysfs writes (not the placement decisions)."""
    return [r for r in audit(host) if r.path.startswith("/sys/")]


# ---------------------------------------------------------------------------
# classic mdev, vendor-VFIO VF, passthrough: start and stop

def test_mdev_vgpu_on_a40_is_made_at_start_and_removed_at_stop(make_host):
    host = make_host("a40-mdev")
    xml = vgpu_domain("web1", DOM1, MDEV1, "A40-8Q", strategy="best-fit")
    assert start(host, "web1", xml) == (0, "")
    assert mdevs(host) == {MDEV1: "nvidia-566"}                     # the UUID the hostdev names, A40-8Q
    rec = store(host).vgpu_records()
    assert [(r.id, r.owner, r.type_name, r.gpu) for r in rec] == [(MDEV1, DOM1, "A40-8Q", str(A40))]
    assert store(host).active_domains() == {DOM1: "web1"}
    placement = [r for r in audit(host) if r.path == "(placement)"]
    assert placement and placement[0].value.startswith("best-fit:") and placement[0].actor.startswith("hook web1")
    assert stop(host, "web1", xml) == (0, "")
    assert mdevs(host) == {} and store(host).vgpu_records() == [] and store(host).active_domains() == {}


def test_mdev_vgpu_on_a100_sriov_lands_on_a_vf_parent(make_host):
    host = make_host("a100-sriov-mdev")
    xml = vgpu_domain("ml", DOM1, MDEV1, "a100-4c")                # names match case-insensitively
    assert start(host, "ml", xml) == (0, "")
    inv = discover(Sysfs(host))
    (m,) = inv.mdevs
    assert m.uuid == MDEV1 and inv.devices[m.parent].physfn == A100
    assert store(host).vgpu_records()[0].type_name == "A100-4C"
    assert stop(host, "ml", xml) == (0, "") and mdevs(host) == {}


def test_vf_type_is_set_at_start_and_cleared_at_stop(make_host):
    host = make_host("l40s-vendor-vfio")
    xml = vf_domain("vdi", DOM1, VF_1, "L40S-4Q")
    assert start(host, "vdi", xml) == (0, "")
    assert vf_type(host, VF_1) == "1150" and vf_type(host, VF_0) == "0"        # exactly that VF
    (rec,) = store(host).vgpu_records()
    assert (rec.id, rec.owner, rec.backend) == (str(VF_1), DOM1, "vendor-vfio")
    n = len(writes(host))
    assert start(host, "vdi", xml) == (0, "")                                   # a retried start
    assert len(writes(host)) == n and len(store(host).vgpu_records()) == 1
    assert stop(host, "vdi", xml) == (0, "")
    assert vf_type(host, VF_1) == "0" and store(host).vgpu_records() == []


def test_passthrough_group_with_its_audio_companion(make_host):
    host = a100_vfs_off(make_host)
    xml = pt_domain("gpu-vm", DOM1, A100, [A100, A100_AUDIO])
    assert start(host, "gpu-vm", xml) == (0, "")
    assert (driver(host, A100), driver(host, A100_AUDIO)) == ("vfio-pci", "vfio-pci")
    recs = store(host).passthrough_records()
    assert {(r.bdf, r.owner) for r in recs} == {(str(A100), DOM1), (str(A100_AUDIO), DOM1)}
    assert start(host, "gpu-vm", xml) == (0, "")                               # idempotent
    assert stop(host, "gpu-vm", xml) == (0, "")
    assert (driver(host, A100), driver(host, A100_AUDIO)) == ("nvidia", "snd_hda_intel")
    assert store(host).passthrough_records() == []
    assert stop(host, "gpu-vm", xml) == (0, "")                                # a second release: no-op


def test_passthrough_and_vgpus_in_one_domain(make_host):
    host = mixed(make_host)
    meta = Metadata(strategy="spread", vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1), VgpuRequest("L40S-2Q", vf=A("0000:a1:00.6"))],
                    passthrough=[GPU_LO])
    xml = domain_xml("big", DOM1, meta, [pci_hostdev(GPU_LO), pci_hostdev("0000:41:00.1"), mdev_hostdev(MDEV1),
                                          pci_hostdev("0000:a1:00.6")])
    assert start(host, "big", xml) == (0, "")
    assert driver(host, GPU_LO) == "vfio-pci"
    assert mdev_gpu(host, MDEV1) == GPU_HI                  # the passed-through A40 offers no vGPU any more
    assert vf_type(host, "0000:a1:00.6") == "1148"
    assert stop(host, "big", xml) == (0, "")
    assert driver(host, GPU_LO) == "nvidia" and mdevs(host) == {} and vf_type(host, "0000:a1:00.6") == "0"
    owners = {r.owner for r in store(host).vgpu_records()} | {r.owner for r in store(host).passthrough_records()}
    assert owners == set()


def test_domains_without_metadata_and_other_operations_pass_untouched(make_host):
    host = make_host("a40-mdev")

    class NoRead(io.BytesIO):
        def read(self, *a):
            raise AssertionError("stdin read for an operation the hook does not act on")

    for op, sub in [("start", "begin"), ("started", "begin"), ("stopped", "end"),
                    ("reconnect", "begin"), ("attach", "begin")]:
        assert hook.main(["vm", op, sub, "-"], NoRead(), io.StringIO(), host=host) == 0
    plain = domain_xml("plain", DOM1, hostdevs=[mdev_hostdev(MDEV1)])
    assert start(host, "plain", plain) == (0, "") and stop(host, "plain", plain) == (0, "")
    assert mdevs(host) == {} and not host.state_dir.exists()            # not even a state store


def test_release_copes_with_a_start_that_never_happened(make_host):
    host = make_host("a40-mdev")
    xml = vgpu_domain("never", DOM1, MDEV1)
    assert stop(host, "never", xml) == (0, "") and not host.state_dir.exists()
    store(host)                                            # a store exists, the domain holds nothing in it
    assert stop(host, "never", xml) == (0, "") and audit(host) == []


# ---------------------------------------------------------------------------
# idempotence, ownership, rollback

def test_retried_start_keeps_the_mdev_and_a_stale_record_is_made_anew(make_host):
    host = make_host("a40-mdev")
    xml = vgpu_domain("web1", DOM1, MDEV1)
    assert start(host, "web1", xml) == (0, "")
    n = len(writes(host))
    assert start(host, "web1", xml) == (0, "")                # libvirt retried, or a restart after a crash
    assert mdevs(host) == {MDEV1: "nvidia-566"} and len(writes(host)) == n
    assert len(store(host).vgpu_records()) == 1
    # the host rebooted: the mdev is gone, the record is still there
    Sysfs(host).write(host.mdev_devices / MDEV1 / "remove", "1")
    assert start(host, "web1", xml) == (0, "")
    assert mdevs(host) == {MDEV1: "nvidia-566"} and len(store(host).vgpu_records()) == 1


def test_a_device_another_domain_holds_is_refused_by_name(make_host):
    host = mixed(make_host)
    a = domain_xml("alpha", DOM1, Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1),
                                                   VgpuRequest("L40S-4Q", vf=A("0000:a1:00.4"))],
                                            passthrough=[GPU_LO]),
                   [mdev_hostdev(MDEV1), pci_hostdev("0000:a1:00.4"), pci_hostdev(GPU_LO), pci_hostdev("0000:41:00.1")])
    assert start(host, "alpha", a) == (0, "")
    before = (tree(host), len(audit(host)))
    for xml, what in [(vgpu_domain("beta", DOM2, MDEV1), f"vGPU {MDEV1} is held by domain 'alpha' ({DOM1})"),
                      (vf_domain("beta", DOM2, "0000:a1:00.4"), f"vGPU 0000:a1:00.4 is held by domain 'alpha' ({DOM1})"),
                      (pt_domain("beta", DOM2, GPU_LO, [GPU_LO, "0000:41:00.1"]),
                       f"IOMMU group of {GPU_LO} is held by domain 'alpha' ({DOM1})")]:
        rc, err = start(host, "beta", xml)
        assert rc == 2 and what in err and err.count("\n") == 1, err
        # nothing changed but the refusal's own audit row (trial 6 finding 4: none)
        assert tree(host) == before[0] and len(audit(host)) == before[1] + 1
        assert (audit(host)[-1].path, audit(host)[-1].result) == ("(start)", "refused")
        before = (tree(host), len(audit(host)))
    assert store(host).active_domains() == {DOM1: "alpha"}


def test_a_late_release_never_frees_the_next_owners_device(make_host):
    host = make_host("l40s-vendor-vfio")
    a, b = vf_domain("alpha", DOM1, VF_0), vf_domain("beta", DOM2, VF_0)
    assert start(host, "alpha", a) == (0, "") and stop(host, "alpha", a) == (0, "")
    assert start(host, "beta", b) == (0, "")
    assert stop(host, "alpha", a) == (0, "")              # alpha's release arrives again, late
    assert vf_type(host, VF_0) == "1150" and store(host).vgpu_records()[0].owner == DOM2


def test_a_failing_second_device_undoes_the_first(make_host):
    host = mixed_l40s_vfs_off(make_host, faults=f'{{op: create, device: "{GPU_HI}", errno: EIO, count: 0}}')
    before = tree(host)
    meta = Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1, gpu=GPU_LO), VgpuRequest("A40-8Q", uuid=MDEV2, gpu=GPU_HI)],
                    passthrough=[L40S])
    hostdevs = [mdev_hostdev(MDEV1), mdev_hostdev(MDEV2), pci_hostdev(L40S)]
    xml = domain_xml("two", DOM1, meta, hostdevs)
    rc, err = start(host, "two", xml)
    assert rc == 3 and err.count("\n") == 1 and "EIO" in err, err
    assert tree(host) == before                                # the group is back, the first mdev gone
    created = [r for r in writes(host) if r.path.endswith("/create") and r.result == "ok"]
    assert [r.value for r in created] == [MDEV1]               # it had been made, then undone
    assert store(host).vgpu_records() == [] and store(host).passthrough_records() == []
    assert store(host).active_domains() == {}


def test_a_refusal_after_passthrough_undoes_the_group(make_host):
    host = a100_vfs_off(make_host)
    before = tree(host)
    # the vGPU can only go on the A100, which this same start passes through
    meta = Metadata(vgpus=[VgpuRequest("A100-4C", uuid=MDEV1)], passthrough=[A100])
    xml = domain_xml("greedy", DOM1, meta, [pci_hostdev(A100), pci_hostdev(A100_AUDIO), mdev_hostdev(MDEV1)])
    rc, err = start(host, "greedy", xml)
    assert rc == 2 and "cannot place A100-4C" in err and err.count("\n") == 1, err
    assert tree(host) == before and store(host).passthrough_records() == []
    assert any(r.path.endswith("driver_override") for r in writes(host))   # it had bound the group first


def test_a_start_waiting_on_a_gpu_lock_ends_as_transient_before_its_timeout(make_host, tmp_path):
    """Another vgpuhost operation holds the GPU's lock past the start's time: the start waits until 1 s
    before the hook's timeout, then exits 5 (a lock held past the timeout), nothing changed."""
    host = make_host("a40-mdev")
    path = install(host, tmp_path, timeout_s=2)
    xml = vgpu_domain("slow", DOM1, MDEV1).encode()
    store(host)
    with file_lock(host.state_dir, f"gpu-{A40}"):            # another vgpuhost operation holds the GPU
        proc = dispatch(path, ["slow", "prepare", "begin", "-"], xml)
    err = proc.stderr.decode()
    assert proc.returncode == 5 and f"lock 'gpu-{A40}'" in err and err.count("\n") == 1, err
    assert mdevs(host) == {} and store(host).active_domains() == {} and writes(host) == []


def test_hook_timeout_after_a_device_was_made_undoes_it_and_fails(make_host, monkeypatch):
    """The hook's alarm (HookTimeout) arriving once the start has made its vGPU: the vGPU is removed again
    and the start exits 3 saying so."""
    from vgpuhost.ops import vgpu
    host = make_host("a40-mdev")
    real = vgpu.create

    def create_then_time_out(*args, **kw):
        real(*args, **kw)
        raise hook.HookTimeout("the vgpuhost hook timed out after 1 s")
    monkeypatch.setattr(vgpu, "create", create_then_time_out)
    rc, err = start(host, "slow", vgpu_domain("slow", DOM1, MDEV1))
    assert rc == 3 and "timed out after 1 s" in err and "what this start had made was undone" in err, err
    assert err.count("\n") == 1 and mdevs(host) == {} and store(host).active_domains() == {}


def test_the_watchdog_ends_a_handler_stuck_where_no_signal_handler_runs():
    """No ``timeout`` process runs in front of the handler: its own watchdog (a C thread) ends a process
    that never returns to the interpreter (here: SIGALRM and SIGTERM blocked, then a long sleep) with
    exit 1 once the timeout and both backstops have passed, with nothing on stderr."""
    code = ("import signal, sys, time\n"
            f"sys.path.insert(0, {str(Path(hook.__file__).parents[2])!r})\n"
            "from vgpuhost.hook import runtime as hook\n"
            "hook.BACKSTOP_EXTRA_S, hook.BACKSTOP_KILL_S = 0, 1\n"
            "def stuck(argv, stdin):\n"
            "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})\n"
            "    time.sleep(120)\n"
            "    return 0\n"
            "hook.main = stuck\n"
            "hook.run()\n")
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "VGPUHOST_HOOK_TIMEOUT": "1"}
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, "vm", "prepare", "begin", "-"],
                          capture_output=True, env=env, timeout=100)
    assert proc.returncode == 1 and proc.stderr == b"", proc.stderr


# ---------------------------------------------------------------------------
# trust: the XML is hostile

def test_a_group_holding_a_sata_controller_is_refused(make_host):
    host = make_host("sata-shared-group")
    before = tree(host)
    cases = [
        (pt_domain("x", DOM1, SATA_GPU, [SATA_GPU, SATA_AUDIO, SATA_DISK]), "not viable: it also holds 0000:04:00.0 (SATA controller"),
        (pt_domain("x", DOM1, SATA_DISK, [SATA_DISK]), "0000:04:00.0 is a SATA controller (8086:a352), not an NVIDIA GPU"),
        (vf_domain("x", DOM1, SATA_DISK), "0000:04:00.0 is a SATA controller (8086:a352), not a VF of an NVIDIA GPU"),
    ]
    for xml, want in cases:
        rc, err = start(host, "x", xml)
        assert rc == 2 and want in err and err.count("\n") == 1, err
    assert tree(host) == before and writes(host) == []


def test_non_nvidia_devices_are_never_acted_on(make_host):
    host = mixed(make_host)
    before = tree(host)
    for xml, want in [(pt_domain("x", DOM1, IGPU, [IGPU]), "0000:00:02.0 is a VGA controller (8086:3e92), not an NVIDIA GPU"),
                      (vgpu_domain("x", DOM1, MDEV1, gpu=IGPU), "not an NVIDIA GPU"),
                      (vf_domain("x", DOM1, "0000:41:00.1"), "is a HD audio (10de:1aef), not a VF of an NVIDIA GPU")]:
        rc, err = start(host, "x", xml)
        assert rc == 2 and want in err, err
    assert tree(host) == before and writes(host) == []


def test_metadata_must_match_the_domains_hostdevs(make_host):
    host = mixed(make_host)
    before = tree(host)
    no_mdev = domain_xml("x", DOM1, Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1)]), [mdev_hostdev(MDEV2)])
    no_companion = pt_domain("x", DOM1, GPU_LO, [GPU_LO])
    managed = pt_domain("x", DOM1, GPU_LO, [GPU_LO, "0000:41:00.1"], managed=True)
    vf_managed = domain_xml("x", DOM1, Metadata(vgpus=[VgpuRequest("L40S-4Q", vf=A("0000:a1:00.4"))]),
                            [pci_hostdev("0000:a1:00.4", managed=True)])
    vf_missing = domain_xml("x", DOM1, Metadata(vgpus=[VgpuRequest("L40S-4Q", vf=A("0000:a1:00.4"))]))
    for xml, want in [(no_mdev, "the domain has no <hostdev type='mdev'> with that UUID"),
                      (no_companion, "the domain has no <hostdev type='pci' managed='no'> for 0000:41:00.1"),
                      (managed, "is managed='yes', but vgpuhost binds the whole IOMMU group itself (never both)"),
                      (vf_managed, "0000:a1:00.4 is managed='yes'"),
                      (vf_missing, "no <hostdev type='pci' managed='no'> for 0000:a1:00.4")]:
        rc, err = start(host, "x", xml)
        assert rc == 2 and want in err and err.count("\n") == 1, err
    assert tree(host) == before and writes(host) == []


def test_allow_list_narrows_what_the_hook_acts_on(make_host):
    host = mixed(make_host)
    allow = allow_path(host)
    allow.parent.mkdir(parents=True)
    xml = vgpu_domain("w", DOM1, MDEV1, gpu=GPU_HI)
    allow.write_text(f"# GPUs guests may use\n{GPU_LO}   # the low one\n\n")
    rc, err = start(host, "w", xml)
    assert rc == 2 and f"GPU {GPU_HI} is not in the hook allow-list" in err and mdevs(host) == {}
    # unpinned: placement only considers allowed GPUs (GPU_LO), whatever the strategy
    free = vgpu_domain("w", DOM1, MDEV1, strategy="worst-fit")
    assert start(host, "w", free) == (0, "") and mdev_gpu(host, MDEV1) == GPU_LO
    assert stop(host, "w", free) == (0, "")
    vf = vf_domain("v", DOM2, "0000:a1:00.4")
    rc, err = start(host, "v", vf)
    assert rc == 2 and f"GPU {L40S} is not in the hook allow-list" in err
    allow.write_text("")                                       # a file listing nothing allows nothing
    assert start(host, "w", free)[0] == 2
    allow.write_text("*\n")
    assert start(host, "v", vf) == (0, "") and stop(host, "v", vf) == (0, "")
    allow.write_text("0000:41:00.0\n41:00.0\n")
    rc, err = start(host, "w", free)
    assert rc == 2 and "hook.allow:2: '41:00.0' is not a GPU's PCI address" in err, err
    assert mdevs(host) == {}


# ---------------------------------------------------------------------------
# bad input through the installed dispatcher, as real processes

BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>
<domain><name>&lol3;</name><uuid>11111111-2222-4333-8444-000000000001</uuid>
<metadata><vgpuhost:domain xmlns:vgpuhost="https://vgpuhost.dev/xmlns/domain/1"/></metadata></domain>
"""
XXE = """<?xml version="1.0"?>
<!DOCTYPE domain [<!ENTITY xxe SYSTEM "file:///etc/shadow">]>
<domain><name>&xxe;</name><uuid>11111111-2222-4333-8444-000000000001</uuid>
<metadata><vgpuhost:domain xmlns:vgpuhost="https://vgpuhost.dev/xmlns/domain/1"/></metadata></domain>
"""


def _meta_raw(inner: str) -> str:
    return f'<vgpuhost:domain xmlns:vgpuhost="https://vgpuhost.dev/xmlns/domain/1" version="1">{inner}</vgpuhost:domain>\n'


def bad_inputs() -> List[Tuple[str, bytes, str]]:
    good = vgpu_domain("bad", DOM1, MDEV1)
    big_tail = good.replace("</devices>", "<!-- " + "x" * (50 * 1024 * 1024) + " --></devices>")
    return [
        ("truncated", good[: len(good) // 2].encode(), "domain XML is not well-formed"),
        ("xxe", XXE.encode(), "domain XML has a DOCTYPE"),
        ("billion-laughs", BILLION_LAUGHS.encode(), "domain XML has a DOCTYPE"),
        ("50MB", big_tail.encode(), "vgpuhost reads at most 4194304"),
        ("dotdot-uuid", domain_xml("bad", DOM1, raw_meta=_meta_raw('<vgpuhost:vgpu profile="A40-8Q" uuid="../../../etc/passwd"/>')).encode(),
         "invalid mdev UUID '../../../etc/passwd'"),
        ("dotdot-vf", domain_xml("bad", DOM1, raw_meta=_meta_raw('<vgpuhost:vgpu profile="A40-8Q" vf="../../sys/bus/pci"/>')).encode(),
         "invalid PCI address '../../sys/bus/pci'"),
        ("dotdot-profile", domain_xml("bad", DOM1, raw_meta=_meta_raw(f'<vgpuhost:vgpu profile="../A40-8Q" uuid="{MDEV1}"/>')).encode(),
         "vgpuhost metadata of domain 'bad': a <vgpu> profile= is not a vGPU type name"),
        ("missing-bdf", pt_domain("bad", DOM1, "0000:99:00.0", ["0000:99:00.0"]).encode(), "no PCI device at 0000:99:00.0"),
        ("missing-vf", vf_domain("bad", DOM1, "0000:99:00.4").encode(), "no PCI device at 0000:99:00.4"),
        ("unknown-profile", vgpu_domain("bad", DOM1, MDEV1, "A40-7Q").encode(), "unknown vGPU profile 'A40-7Q'"),
        ("unknown-element", domain_xml("bad", DOM1, raw_meta=_meta_raw("<vgpuhost:steal/>")).encode(),
         "unknown element <steal>"),
    ]


def test_bad_input_fails_with_one_line_and_writes_nothing(make_host, tmp_path):
    host = make_host("a40-mdev")
    path = install(host, tmp_path)
    before = tree(host)
    for case, data, want in bad_inputs():
        proc = dispatch(path, ["bad", "prepare", "begin", "-"], data)
        err = proc.stderr.decode()
        assert proc.returncode == 2, (case, proc.returncode, err)
        assert err.count("\n") == 1 and err.startswith("vgpuhost: error: domain 'bad': ") and want in err, (case, err)
        assert proc.stdout == b"", case
        assert tree(host) == before and writes(host) == [], case
    assert store(host).active_domains() == {} and store(host).vgpu_records() == []


def test_dispatcher_passes_domains_without_vgpuhost_untouched(make_host, tmp_path):
    host = make_host("a40-mdev")
    path = install(host, tmp_path)
    plain = domain_xml("plain", DOM1, hostdevs=[mdev_hostdev(MDEV1)]).encode()
    for op, sub in [("prepare", "begin"), ("start", "begin"), ("started", "begin"), ("stopped", "end"),
                    ("release", "end")]:
        proc = dispatch(path, ["plain", op, sub, "-"], plain)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b"")
    # other operations exit before reading stdin, even for GPU domains
    proc = dispatch(path, ["x", "started", "begin", "-"], vgpu_domain("x", DOM1, MDEV1).encode())
    assert (proc.returncode, proc.stderr) == (0, b"")
    assert not host.state_dir.exists() and mdevs(host) == {}


def test_dispatcher_runs_prepare_and_release_as_libvirt_does(make_host, tmp_path):
    host = make_host("a40-mdev")
    path = install(host, tmp_path)
    assert os.stat(path).st_mode & 0o777 == 0o755
    xml = vgpu_domain("web1", DOM1, MDEV1).encode()
    proc = dispatch(path, ["web1", "prepare", "begin", "-"], xml)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b""), proc.stderr
    assert mdevs(host) == {MDEV1: "nvidia-566"}
    proc = dispatch(path, ["web1", "release", "end", "-"], xml)
    assert (proc.returncode, proc.stderr) == (0, b"") and mdevs(host) == {}


def test_module_entry_point(make_host):
    host = make_host("a40-mdev")
    env = dict(os.environ, VGPUHOST_ROOT=str(host.root))
    xml = vgpu_domain("m", DOM1, MDEV1, "A40-99Q").encode()
    proc = subprocess.run([sys.executable, "-m", "vgpuhost.hook", "m", "prepare", "begin", "-"], input=xml,
                          capture_output=True, env=env, timeout=60)
    assert proc.returncode == 2 and b"unknown vGPU profile 'A40-99Q'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "vgpuhost.hook"], capture_output=True, env=env, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(b"usage: ")


def test_hook_path_imports_stay_lean(make_host, tmp_path):
    """Neither click, lxml, yaml, jinja2 nor libvirt is imported on prepare or release (DESIGN: the hook path is lean),
    nor what only some paths need (dataclasses and inspect: records are vgpuhost.values.record; difflib: only for
    an unknown profile; uuid: the domain names its mdev; importlib.resources, shutil: the simulator's data and trees)."""
    host = mixed(make_host)
    meta = Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1), VgpuRequest("L40S-4Q", vf=A("0000:a1:00.4"))],
                    passthrough=[GPU_LO])
    xml = domain_xml("lean", DOM1, meta, [mdev_hostdev(MDEV1), pci_hostdev("0000:a1:00.4"), pci_hostdev(GPU_LO),
                                           pci_hostdev("0000:41:00.1")])
    code = ("import io,sys\nfrom vgpuhost.hook import runtime as hook\n"
            "x=sys.stdin.buffer.read()\n"
            "for op, sub in (('prepare','begin'),('release','end')):\n"
            "    assert hook.main(['lean',op,sub,'-'], io.BytesIO(x)) == 0\n"
            "heavy = {'click','lxml','yaml','jinja2','libvirt','libvirtmod','xml.sax.saxutils','urllib.request',\n"
            "         'dataclasses','inspect','difflib','uuid','importlib.resources','shutil','tempfile'}\n"
            "print(sorted(m for m in sys.modules if m in heavy or m.split('.')[0] in heavy))\n")
    proc = subprocess.run([sys.executable, "-S", "-c", code], input=xml.encode(), capture_output=True,
                          env=dict(os.environ, VGPUHOST_ROOT=str(host.root), PYTHONPATH=str(Path(hook.__file__).parent.parent)),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().strip() == "[]"


#: modules a real host's hook path must not import (issue 17): each costs milliseconds per domain start
LEAN_FORBIDDEN = {"pathlib", "enum", "re", "threading", "json", "typing", "dataclasses", "socket", "selectors",
                  "random", "http", "email", "urllib", "functools", "collections", "operator", "xml"}
#: ...of which the hook path still imports these (none since the io doors it uses take string paths
#: and PCI address, UUID and name parsing is hand-written).  The test fails when one goes away too,
#: so the list only shrinks: delete its name here.
LEAN_KNOWN: set = set()


def test_hook_path_imports_on_a_real_host(make_host):
    """The handler as the dispatcher runs it on a real host (no simulator marker: no simulator imported),
    in a fresh ``python -I -S``, with the agent tried already (``VGPUHOST_AGENT=off``): prepare (which
    gets as far as the create write and its rollback: nothing makes the mdev appear in a plain tree)
    and release, then the modules it imported."""
    host = make_host("a40-mdev")
    (host.sim_dir / "host.json").unlink()               # a plain tree: writes land in files, as on a real host
    assert not host.is_simulated
    code = ("import io,sys\n"
            f"sys.path.insert(0, {str(Path(hook.__file__).parents[2])!r})\n"
            "from vgpuhost.hook import runtime as hook\n"
            "x=sys.stdin.buffer.read()\n"
            "codes=[hook.main(['lean',op,sub,'-'], io.BytesIO(x), stderr=io.StringIO())\n"
            "       for op, sub in (('prepare','begin'),('release','end'))]\n"
            "print(codes)\n"
            "print(sorted(m for m in sys.modules if m.startswith('vgpuhost.sim')))\n"
            f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(LEAN_FORBIDDEN)!r})))\n")
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "VGPUHOST_ROOT": str(host.root), "VGPUHOST_AGENT": "off"}
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], input=vgpu_domain("lean", DOM1, MDEV1).encode(),
                          capture_output=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    codes, sim, imported = proc.stdout.decode().splitlines()
    assert codes == "[3, 0]"        # the create write landed in a plain file, was found wanting and undone
    assert sim == "[]"
    top = {m.split(".")[0] for m in imported.split()}
    assert top == LEAN_KNOWN, f"imported now: {sorted(top)}; listed as known: {sorted(LEAN_KNOWN)}"


# ---------------------------------------------------------------------------
# 16 domains start at once

def test_sixteen_domains_start_at_once_with_distinct_devices(make_host, tmp_path):
    """16 hook processes in parallel on one host: 12 want an A40-12Q mdev (4 fit per A40: 8 in all),
    4 want L40S VFs, two of them the same VF.  Each success holds distinct devices; nothing is over capacity."""
    host = mixed(make_host)
    path = install(host, tmp_path)
    doms = []
    for i in range(16):
        uuid = f"22222222-2222-4333-8444-{i:012d}"
        if i < 12:
            mdev = f"bbbbbbbb-2222-4333-8444-{i:012d}"
            xml = vgpu_domain(f"vm{i}", uuid, mdev, "A40-12Q", strategy=("spread", "best-fit", "first-fit")[i % 3])
            doms.append((f"vm{i}", uuid, mdev, xml))
        else:
            vf = ["0000:a1:00.4", "0000:a1:00.5", "0000:a1:00.6", "0000:a1:00.6"][i - 12]
            doms.append((f"vm{i}", uuid, vf, vf_domain(f"vm{i}", uuid, vf, "L40S-8Q")))
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LC_ALL": "C"}
    procs = [subprocess.Popen([str(path), name, "prepare", "begin", "-"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for name, *_ in doms]
    for p, (_, _, _, xml) in zip(procs, doms):
        p.stdin.write(xml.encode())
        p.stdin.close()
    results = []
    for p in procs:
        rc = p.wait(timeout=300)
        results.append((rc, p.stderr.read().decode()))
        p.stdout.close()
        p.stderr.close()
    ok = [d for d, (rc, _) in zip(doms, results) if rc == 0]
    failed = [(d, r) for d, r in zip(doms, results) if r[0] != 0]
    for (_, _, _, _), (rc, err) in failed:
        assert rc == 2 and err.count("\n") == 1, results
        assert "cannot place A40-12Q: A40-12Q fits on none" in err or "0000:a1:00.6" in err, results
    mdev_ok = [d for d in ok if d[2].startswith("bbbbbbbb")]
    vf_ok = [d for d in ok if not d[2].startswith("bbbbbbbb")]
    assert len(mdev_ok) == 8 and len(vf_ok) == 3, results
    inv = discover(Sysfs(host))
    per_gpu: Dict[PciAddress, int] = {}
    for m in inv.mdevs:
        g = next(g.address for g in inv.gpus if m.parent in g.mdev_parents)
        per_gpu[g] = per_gpu.get(g, 0) + 1
        assert m.type_id == "nvidia-567"
    assert per_gpu == {GPU_LO: 4, GPU_HI: 4}                    # A40-12Q: at most 4 per GPU
    assert {m.uuid for m in inv.mdevs} == {d[2] for d in mdev_ok}
    assert {str(v.vf) for v in inv.vf_vgpus if v.type_id} == {"0000:a1:00.4", "0000:a1:00.5", "0000:a1:00.6"}
    recs = store(host).vgpu_records()
    assert {(r.id, r.owner) for r in recs} == {(d[2], d[1]) for d in ok}      # distinct devices, one owner each
    assert store(host).active_domains() == {d[1]: d[0] for d in ok}
    for name, uuid, dev, xml in doms:                          # every domain stops (libvirt runs release end)
        assert dispatch(path, [name, "release", "end", "-"], xml.encode()).returncode == 0
    assert discover(Sysfs(host)).mdevs == () and store(host).vgpu_records() == []
    assert all(r.result == "ok" for r in writes(host)), [r for r in writes(host) if r.result != "ok"]


# ---------------------------------------------------------------------------
# vgpuhost hook install | uninstall | status

def cli(*args) -> Tuple[int, str, str]:
    import contextlib
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(list(args))
    return rc, out.getvalue(), err.getvalue()


def test_cli_install_is_idempotent_and_says_to_reload_libvirtd(make_host, capsys):
    host = make_host("a40-mdev")
    root = str(host.root)
    rc = cli_main(["--root", root, "--json", "hook", "install", "--dry-run"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["schema"] == "vgpuhost.hook/v1" and doc["dry_run"] and doc["new"]
    path = host.libvirt_hooks / "qemu.d" / "vgpuhost"
    assert not path.exists()
    rc = cli_main(["--root", root, "hook", "install"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith(f"installed {path}") and "SIGHUP" in out and "systemctl reload libvirtd" in out
    text = path.read_text()
    assert f"VGPUHOST_ROOT='{root}'" in text and not re.search(r"@[A-Z_]+@", text)   # every placeholder filled
    mtime = path.stat().st_mtime_ns
    rc = cli_main(["--root", root, "--json", "hook", "install"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and not doc["changed"] and not doc["reload_needed"] and path.stat().st_mtime_ns == mtime
    rc = cli_main(["--root", root, "--json", "hook", "status"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["schema"] == "vgpuhost.hook-status/v1" and doc["installed"] and doc["current"]
    assert doc["allow"]["summary"] == "every NVIDIA GPU (no allow-list file)"
    assert [r.operation for r in audit(host)] == ["hook install"]
    # a changed timeout rewrites the file; no reload is needed for that
    rc = cli_main(["--root", root, "--json", "hook", "install", "--timeout", "30"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["changed"] and not doc["new"] and not doc["reload_needed"]
    assert "VGPUHOST_HOOK_TIMEOUT=30" in path.read_text()
    assert cli_main(["--root", root, "hook", "status"]) == 0
    capsys.readouterr()
    # stale: the file differs from what install writes now
    path.write_text(path.read_text().replace("VGPUHOST_HOOK_TIMEOUT=30", "VGPUHOST_HOOK_TIMEOUT=30\n: edited"))
    assert cli_main(["--root", root, "hook", "status"]) == 1
    assert "current:     no" in capsys.readouterr().out
    assert cli_main(["--root", root, "hook", "uninstall"]) == 0
    assert not path.exists() and cli_main(["--root", root, "hook", "uninstall"]) == 0
    out = capsys.readouterr().out
    assert "no change" in out
    assert cli_main(["--root", root, "hook", "status"]) == 1
    assert "not installed" in capsys.readouterr().out


def test_cli_never_overwrites_or_removes_a_foreign_hook(make_host, capsys):
    host = make_host("a40-mdev")
    d = host.libvirt_hooks / "qemu.d"
    d.mkdir(parents=True)
    (d / "vgpuhost").write_text("#!/bin/sh\nexit 0\n")
    for cmd in ("install", "uninstall"):
        rc = cli_main(["--root", str(host.root), "hook", cmd])
        err = capsys.readouterr().err
        assert rc == 2 and "was not written by vgpuhost: left alone" in err and err.count("\n") == 1
    assert (d / "vgpuhost").read_text() == "#!/bin/sh\nexit 0\n"


def test_cli_status_reports_the_allow_list(make_host, capsys, tmp_path):
    host = make_host("a40-mdev")
    allow = allow_path(host)
    allow.parent.mkdir(parents=True)
    allow.write_text(f"{A40}\n")
    hooks_dir = tmp_path / "elsewhere"
    assert cli_main(["--root", str(host.root), "hook", "install", "--hooks-dir", str(hooks_dir)]) == 0
    capsys.readouterr()
    assert cli_main(["--root", str(host.root), "--json", "hook", "status", "--hooks-dir", str(hooks_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["allow"]["gpus"] == [str(A40)] and doc["path"] == str(hooks_dir / "vgpuhost")
    allow.write_text("nonsense\n")
    assert cli_main(["--root", str(host.root), "--json", "hook", "status", "--hooks-dir", str(hooks_dir)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert "hook.allow:1" in doc["allow"]["error"]


@pytest.mark.parametrize("cmd", ["install", "uninstall", "status"])
def test_cli_relative_hooks_dir_is_refused(make_host, capsys, tmp_path, monkeypatch, cmd):
    """Review 1 item 6: libvirt runs hooks from an absolute directory; a relative --hooks-dir used to be
    written under the working directory."""
    host = make_host("a40-mdev")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = sorted(p.relative_to(host.root) for p in host.root.rglob("*"))
    rc, out, err = cli("--root", str(host.root), "hook", cmd, "--hooks-dir", "relative/dir")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("vgpuhost: error: --hooks-dir 'relative/dir' is not an absolute path; libvirt runs hooks "
                          "from an absolute directory")
    assert list(cwd.iterdir()) == [] and sorted(p.relative_to(host.root) for p in host.root.rglob("*")) == before


def test_cli_hooks_dir_with_a_newline_is_named_for_it(make_host, capsys):
    """An absolute --hooks-dir holding a newline is refused for the newline, not called relative."""
    host = make_host("a40-mdev")
    rc = cli_main(["--root", str(host.root), "hook", "install", "--hooks-dir", "/tmp/x/a\nb"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "holds a control character" in err and "absolute" not in err


def test_cli_status_names_the_allow_list_it_read_and_tells_malformed_from_unreadable(make_host, capsys):
    """Review 1 item 10: the allow-list path is the file read (under --root); a bad line is
    "malformed", not "unreadable"."""
    host = make_host("a40-mdev")
    root = str(host.root)
    allow = allow_path(host)
    allow.parent.mkdir(parents=True)
    assert cli_main(["--root", root, "hook", "install"]) == 0
    capsys.readouterr()
    assert cli_main(["--root", root, "--json", "hook", "status"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["allow"]["path"] == str(allow) and str(allow).startswith(root)
    assert doc["allow"]["summary"] == "every NVIDIA GPU (no allow-list file)"
    allow.write_text(f"{A40}\n41:00.0\n")
    assert cli_main(["--root", root, "--json", "hook", "status"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["allow"]["summary"] == "malformed: the hook refuses every GPU domain" and not doc["ok"]
    assert "hook.allow:2: '41:00.0' is not a GPU's PCI address" in doc["allow"]["error"]
    assert cli_main(["--root", root, "hook", "status"]) == 1
    out = capsys.readouterr().out
    assert f"allow-list:  {allow}: malformed: the hook refuses every GPU domain" in out.splitlines()
    if os.geteuid() != 0:                          # root reads a mode-000 file anyway
        allow.chmod(0)
        try:
            assert cli_main(["--root", root, "--json", "hook", "status"]) == 1
            doc = json.loads(capsys.readouterr().out)
            assert doc["allow"]["summary"] == "unreadable: the hook refuses every GPU domain"
        finally:
            allow.chmod(0o644)
    allow.unlink()
    allow.mkdir()                                  # a directory cannot be read as the list
    assert cli_main(["--root", root, "--json", "hook", "status"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["allow"]["summary"] == "unreadable: the hook refuses every GPU domain"


def test_cli_status_a_foreign_hook_file_is_not_installed(make_host, capsys):
    """Review 1 item 11: a file vgpuhost did not write is not vgpuhost's hook installed."""
    host = make_host("a40-mdev")
    d = host.libvirt_hooks / "qemu.d"
    d.mkdir(parents=True)
    (d / "vgpuhost").write_text("#!/bin/sh\nexit 0\n")
    (d / "vgpuhost").chmod(0o755)
    assert cli_main(["--root", str(host.root), "--json", "hook", "status"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["installed"], doc["written_by_vgpuhost"], doc["current"], doc["ok"]) == (False, False, False, False)
    assert cli_main(["--root", str(host.root), "hook", "status"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "installed:   no (a file not written by vgpuhost is there)" in out
    assert out[-1].startswith(f"not installed: {d / 'vgpuhost'} is someone else's: move it aside")
    assert (d / "vgpuhost").read_text() == "#!/bin/sh\nexit 0\n"


def test_cli_status_lists_the_other_qemu_hooks_in_libvirts_order_and_warns_of_gpu_ones(make_host, capsys):
    """libvirt runs hooks/qemu, then qemu.d/* by name (docs/reference/libvirt.md#hooks): hook status lists
    the others in that order, and warns (exit 1) about one whose text names a GPU of this host or a tool of
    the GPU device layer -- naming only those terms, never echoing the script."""
    host = make_host("a40-mdev")
    root = str(host.root)
    d = host.libvirt_hooks / "qemu.d"
    assert cli_main(["--root", root, "hook", "install"]) == 0
    capsys.readouterr()

    def script(path, text, mode=0o755):
        path.write_text("#!/bin/sh\n" + text)
        path.chmod(mode)

    script(host.libvirt_hooks / "qemu", "logger started $1\n")                     # the main script: first
    script(d / "10-net", "ip link set tap0 up\n")                                 # before vgpuhost, harmless
    script(d / "zz-detach", "virsh nodedev-detach pci_0000_81_00_0  # SECRET-TOKEN\n")   # after, the A40
    script(d / "yy-notes", "echo sriov_numvfs\n", mode=0o644)                    # not executable: not run
    assert cli_main(["--root", root, "--json", "hook", "status"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"]
    got = [(Path(o["path"]).name, o["order"], o["before_vgpuhost"], o["gpus"], o["acts_on"])
           for o in doc["other_hooks"]]
    assert got == [("qemu", 1, True, [], []), ("10-net", 2, True, [], []),
                   ("zz-detach", 4, False, [str(A40)], ["nodedev-detach"])], got
    assert cli_main(["--root", root, "hook", "status"]) == 1
    out = capsys.readouterr().out
    assert f"other hook:  {d / 'zz-detach'} (runs after vgpuhost's, #4): WARNING: it names {A40}, nodedev-detach" \
        in out and "SECRET-TOKEN" not in out
    (d / "zz-detach").unlink()
    assert cli_main(["--root", root, "hook", "status"]) == 0            # the harmless ones are listed only
    assert "other hook:  " in capsys.readouterr().out


def test_a_group_the_operator_bound_is_used_as_it_is(make_host):
    from vgpuhost.ops.passthrough import prepare as pt_prepare
    host = a100_vfs_off(make_host)
    pt_prepare(host, store(host), A100)                          # 'vgpuhost passthrough prepare' (owner manual)
    n = len(writes(host))
    xml = pt_domain("gpu-vm", DOM1, A100, [A100, A100_AUDIO])
    assert start(host, "gpu-vm", xml) == (0, "") and len(writes(host)) == n
    assert stop(host, "gpu-vm", xml) == (0, "") and len(writes(host)) == n
    assert driver(host, A100) == "vfio-pci"
    assert {r.owner for r in store(host).passthrough_records()} == {"manual"}


# ---------------------------------------------------------------------------
# the library changes the hook relies on: passthrough owners, vgpu.create(vf=)

def test_passthrough_owner_guards_prepare_and_release(make_host):
    from vgpuhost.model.errors import RefusedError
    from vgpuhost.ops.passthrough import prepare as pt_prepare, release as pt_release
    host = a100_vfs_off(make_host)
    s = store(host)
    out = pt_release(host, s, A100, owner=DOM1)                  # nothing held: a no-op
    assert not out.changed and writes(host) == []
    assert pt_prepare(host, s, A100, owner=DOM1).changed
    assert not pt_prepare(host, s, A100, owner=DOM1).changed     # same owner: idempotent
    with pytest.raises(RefusedError, match=f"held by domain {DOM1}"):
        pt_prepare(host, s, A100, owner=DOM2)
    with pytest.raises(RefusedError, match=f"held by domain {DOM1}"):
        pt_prepare(host, s, A100)                                # a manual prepare too
    with pytest.raises(RefusedError, match=f"held by domain {DOM1}, not {DOM2}: left alone"):
        pt_release(host, s, A100, owner=DOM2)
    assert driver(host, A100) == "vfio-pci"
    assert pt_release(host, s, A100, owner=DOM1).changed and driver(host, A100) == "nvidia"
    assert not pt_release(host, s, A100, owner=DOM1).changed     # released already: no-op
    pt_prepare(host, s, A100)
    with pytest.raises(RefusedError, match="held by a manual 'vgpuhost passthrough prepare'"):
        pt_prepare(host, s, A100, owner=DOM1)


def test_vgpu_create_on_a_named_vf(make_host):
    from vgpuhost.model.errors import InputError, RefusedError
    from vgpuhost.ops.vgpu import create
    host = make_host("l40s-vendor-vfio")
    s = store(host)
    out = create(host, s, profile="L40S-4Q", vf=VF_1, owner=DOM1)
    assert (out.id, out.parent, out.changed) == (str(VF_1), str(VF_1), True) and vf_type(host, VF_1) == "1150"
    n = len(writes(host))
    again = create(host, s, profile="l40s-4q", vf=VF_1, owner=DOM1)
    assert not again.changed and len(writes(host)) == n          # the record says DOM1 holds it: no-op
    with pytest.raises(RefusedError, match=f"VF {VF_1} holds L40S-4Q of {DOM1}"):
        create(host, s, profile="L40S-4Q", vf=VF_1, owner=DOM2)
    with pytest.raises(RefusedError, match="already holds L40S-4Q"):
        create(host, s, profile="L40S-2Q", vf=VF_1, owner=DOM1)
    with pytest.raises(RefusedError, match="one vGPU per VM per GPU"):
        create(host, s, profile="L40S-4Q", vf=VF_0, owner=DOM1)  # a second vGPU of DOM1 on the same GPU
    with pytest.raises(RefusedError, match="does not offer L40S-8Q now"):
        create(host, s, profile="L40S-8Q", vf=VF_0, owner=DOM2)  # equal-size mode: 4 GB vGPUs there now
    with pytest.raises(RefusedError, match="not an SR-IOV VF of an NVIDIA GPU"):
        create(host, s, profile="L40S-4Q", vf=A("0000:20:01.1"), owner=DOM2)
    with pytest.raises(InputError, match="no PCI device at 0000:21:1f.7"):
        create(host, s, profile="L40S-4Q", vf=A("0000:21:1f.7"), owner=DOM2)
    with pytest.raises(InputError, match="not both"):
        create(host, s, profile="L40S-4Q", vf=VF_0, uuid=MDEV1, owner=DOM2)
    assert len(writes(host)) == n
    a100 = make_host("a100-sriov-mdev")
    vf = next(d for d in discover(Sysfs(a100)).devices.values() if d.physfn == A100).address
    with pytest.raises(RefusedError, match="is on the mdev path, not vendor-specific VFIO"):
        create(a100, store(a100), profile="A100-4C", vf=vf, owner=DOM1)


# ---------------------------------------------------------------------------
# review regressions

def test_boot_vga_refusal_names_a_fix_the_hook_can_take(make_host):
    """A hook takes no options: the remedy is to bind the group first, which the hook then uses
    (test_a_group_the_operator_bound_is_used_as_it_is)."""
    host = make_host("turing-consumer")
    gpu = A("0000:01:00.0")
    fns = [gpu, A("0000:01:00.1"), A("0000:01:00.2"), A("0000:01:00.3")]
    xml = pt_domain("desk", DOM1, gpu, fns)
    rc, err = start(host, "desk", xml)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"run 'vgpuhost passthrough prepare --allow-boot-vga {gpu}'" in err and "pass --allow" not in err
    assert writes(host) == [] and driver(host, gpu) == "nvidia"


def test_a_manual_release_never_frees_a_running_domains_group(make_host):
    from vgpuhost.model.errors import RefusedError
    from vgpuhost.ops.passthrough import release as pt_release
    host = a100_vfs_off(make_host)
    xml = pt_domain("gpu-vm", DOM1, A100, [A100, A100_AUDIO])
    assert start(host, "gpu-vm", xml) == (0, "")
    with pytest.raises(RefusedError, match="in use by running domain gpu-vm"):
        pt_release(host, store(host), A100)
    assert driver(host, A100) == "vfio-pci"
    # the host crashed: no 'release end' came, the domain is not running any more
    store(host).domain_stopped(DOM1)
    assert pt_release(host, store(host), A100).changed
    assert driver(host, A100) == "nvidia" and store(host).passthrough_records() == []


def test_a_manual_vgpu_remove_never_removes_a_running_domains_vgpu(make_host, capsys):
    """Issue 12 (e): refused with --owner naming the running domain as without it; the mdev stays."""
    host = make_host("a40-mdev")
    xml = vgpu_domain("gpu-vm", DOM1, MDEV1)
    assert start(host, "gpu-vm", xml) == (0, "")
    for extra in ([], ["--owner", DOM1]):
        capsys.readouterr()
        assert cli_main(["--root", str(host.root), "vgpu", "remove", MDEV1, *extra]) == 2
        err = capsys.readouterr().err
        assert "in use by running domain gpu-vm" in err and err.count("\n") == 1, err
        assert MDEV1 in mdevs(host) and [r.id for r in store(host).vgpu_records()] == [MDEV1]
    assert stop(host, "gpu-vm", xml) == (0, "")          # the hook's own release still removes it
    assert mdevs(host) == {} and store(host).vgpu_records() == []


def test_allow_list_bytes_that_are_not_ascii_are_not_shown(make_host):
    host = mixed(make_host)
    allow = allow_path(host)
    allow.parent.mkdir(parents=True)
    allow.write_bytes(b"\xff\xfe41:00.0\n")
    rc, err = start(host, "w", vgpu_domain("w", DOM1, MDEV1))
    assert rc == 2 and "hook.allow:1: a line (not shown: 15 characters) is not a GPU's PCI address" in err, err
    assert "\ufffd" not in err and "xfe" not in err


def test_an_allow_list_symlinked_to_another_file_never_shows_its_lines(make_host, tmp_path, capsys):
    """issue 12 #4m: hook.allow symlinked to a file of secrets; the error names the line, not its content."""
    host = mixed(make_host)
    secret = tmp_path / "creds.yaml"
    secret.write_text("db_password: hunter2\n")
    allow = allow_path(host)
    allow.parent.mkdir(parents=True)
    allow.symlink_to(secret)
    rc, err = start(host, "w", vgpu_domain("w", DOM1, MDEV1))
    assert rc == 2 and "hook.allow:1: a line (not shown: 20 characters)" in err, err
    assert cli_main(["--root", str(host.root), "hook", "status"]) != 0
    out = capsys.readouterr()
    assert "hunter2" not in err + out.out + out.err and "db_password" not in err + out.out + out.err


def test_a_placement_refusal_names_the_allow_list_when_there_is_one(make_host):
    host = make_host("a40-mdev")
    allow = allow_path(host)
    allow.parent.mkdir(parents=True)
    allow.write_text("0000:41:00.0\n")                      # names no GPU of this host
    rc, err = start(host, "w", vgpu_domain("w", DOM1, MDEV1))
    assert rc == 2 and err.count("\n") == 1, err
    assert "the hook allow-list (etc/vgpuhost/hook.allow) lets the hook place vGPUs only on: 0000:41:00.0" in err
    assert mdevs(host) == {} and writes(host) == []


# ---------------------------------------------------------------------------
# after a host crash: the 'release end' that never came (reconcile --forget-domains, the boot units)

def test_forget_domains_does_the_release_a_crash_skipped(make_host, capsys):
    host = a100_vfs_off(make_host)
    xml = pt_domain("gpu-vm", DOM1, A100, [A100, A100_AUDIO])
    assert start(host, "gpu-vm", xml) == (0, "")
    assert store(host).active_domains() == {DOM1: "gpu-vm"}
    # the host went down without 'release end'; at boot, before libvirtd:
    code = cli_main(["--root", str(host.root), "--json", "reconcile", "--forget-domains"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["forgotten"] == [{"uuid": DOM1, "name": "gpu-vm", "released": [str(A100)]}]
    assert store(host).active_domains() == {} and store(host).passthrough_records() == []
    assert driver(host, A100) == "nvidia"
    assert any(r.actor.startswith("reconcile --forget-domains gpu-vm") for r in audit(host))
    assert cli_main(["--root", str(host.root), "reconcile", "--forget-domains"]) == 0      # idempotent
    assert "no domain recorded as running" in capsys.readouterr().out


def test_forget_domains_is_refused_while_qemu_runs(make_host, capsys):
    host = make_host(yaml_text=A40_WITH_QEMU)
    assert start(host, "w", vgpu_domain("w", DOM1, MDEV1)) == (0, "")
    n = len(writes(host))
    code = cli_main(["--root", str(host.root), "reconcile", "--forget-domains"])
    err = capsys.readouterr().err
    assert code == 2 and "qemu is running (qemu-system-x86)" in err and err.count("\n") == 1, err
    assert store(host).active_domains() == {DOM1: "w"} and MDEV1 in mdevs(host) and len(writes(host)) == n


A40_WITH_QEMU = """
version: 1
name: a40-busy
host: {modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio],
       processes: [qemu-system-x86]}
devices:
  - {bdf: "0000:80:01.0", model: amd-root-port}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:01.0", vgpu: {backend: mdev}}
"""


def test_install_restores_a_hook_that_lost_its_execute_bit(make_host, capsys):
    """Issue 12 #4g: libvirt skips a hook it cannot execute, so an identical text with mode 0644 is not 'up to date'."""
    host = make_host("a40-mdev")
    root = str(host.root)
    assert cli_main(["--root", root, "hook", "install"]) == 0
    path = host.libvirt_hooks / "qemu.d" / "vgpuhost"
    path.chmod(0o644)
    capsys.readouterr()
    assert cli_main(["--root", root, "--json", "hook", "install"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["changed"] and any("not executable" in n for n in doc["notes"])
    assert path.stat().st_mode & 0o777 == 0o755
    assert cli_main(["--root", root, "--json", "hook", "install"]) == 0
    assert not json.loads(capsys.readouterr().out)["changed"]


def test_an_allow_list_that_is_a_fifo_is_refused_without_blocking(make_host, capsys):
    """Issue 12 #4g: a FIFO as the allow-list hung 'hook status' and every VM start; only regular files are read."""
    host = make_host("a40-mdev")
    root = str(host.root)
    assert cli_main(["--root", root, "hook", "install"]) == 0
    allow = allow_path(host)
    allow.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(allow)
    capsys.readouterr()
    proc = subprocess.run([sys.executable, "-m", "vgpuhost", "--root", root, "--json", "hook", "status"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["allow"]["summary"] == "unreadable: the hook refuses every GPU domain"
    assert "not a regular file" in doc["allow"]["error"]


def test_status_exits_1_naming_an_allow_listed_gpu_the_host_lacks(make_host, capsys):
    """Issue 12 #4g: 'hook status' exited 0 while the allow-list named a BDF the host does not have
    (a GPU moved to another slot, a list copied from another host): the hook then refuses every domain
    that wants it, and nothing said so."""
    host = make_host("a40-mdev")
    root = str(host.root)
    assert cli_main(["--root", root, "hook", "install"]) == 0
    allow = allow_path(host)
    allow.parent.mkdir(parents=True, exist_ok=True)
    allow.write_text(f"{A40}\n0000:41:00.0\n0000:00:1f.6\n")  # the A40; nothing at 41:00.0; 1f.6 is not here
    capsys.readouterr()
    assert cli_main(["--root", root, "--json", "hook", "status"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["allow"]["missing"] == ["0000:00:1f.6", "0000:41:00.0"] and not doc["ok"]
    assert doc["allow"]["gpus"] == sorted([str(A40), "0000:41:00.0", "0000:00:1f.6"])
    assert cli_main(["--root", root, "hook", "status"]) == 1
    out = capsys.readouterr().out
    assert ("allow-list names GPUs this host does not have: 0000:00:1f.6, 0000:41:00.0 "
            "(fix or remove those lines)") in out, out
    allow.write_text(f"{A40}\n")                              # fixed: ok again
    assert cli_main(["--root", root, "--json", "hook", "status"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["allow"]["missing"] == [] and doc["ok"]
    # a PCI device that is there but is no NVIDIA GPU counts as missing too
    host2 = make_host("a100-sriov-mdev")
    assert cli_main(["--root", str(host2.root), "hook", "install"]) == 0
    allow2 = allow_path(host2)
    allow2.parent.mkdir(parents=True, exist_ok=True)
    allow2.write_text(f"{A100}\n{NIC}\n")
    capsys.readouterr()
    assert cli_main(["--root", str(host2.root), "--json", "hook", "status"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["allow"]["missing"] == [str(NIC)]


# ---------------------------------------------------------------------------
# issue 12 #2: release does not depend on the domain XML at release time

def _without_metadata(xml: str) -> str:
    """The same domain document with vgpuhost's metadata element gone (virsh metadata --remove --live)."""
    out = re.sub(r"<vgpuhost:domain .*?</vgpuhost:domain>\n?", "", xml, flags=re.S)
    assert "vgpuhost" not in out
    return out


def test_release_without_metadata_releases_what_the_store_says_through_the_dispatcher(make_host, tmp_path):
    """The XML at 'release end' lost vgpuhost's metadata: the sh dispatcher used to exit 0 before any
    Python ran, and the vGPU and the passed-through group stayed held for good."""
    host = mixed_l40s_vfs_off(make_host)
    path = install(host, tmp_path)
    meta = Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1, gpu=GPU_LO)], passthrough=[L40S])
    xml = domain_xml("both", DOM1, meta, [mdev_hostdev(MDEV1), pci_hostdev(L40S)])
    proc = dispatch(path, ["both", "prepare", "begin", "-"], xml.encode())
    assert proc.returncode == 0, proc.stderr
    assert MDEV1 in mdevs(host) and driver(host, L40S) == "vfio-pci"
    proc = dispatch(path, ["both", "release", "end", "-"], _without_metadata(xml).encode())
    assert (proc.returncode, proc.stderr) == (0, b"")
    assert mdevs(host) == {} and driver(host, L40S) == "nvidia"
    s = store(host)
    assert s.vgpu_records() == [] and s.passthrough_records() == [] and s.active_domains() == {}


def test_release_with_changed_or_invalid_metadata_releases_what_the_domain_holds(make_host, tmp_path):
    """'virsh metadata --live' changed the element: it now names another vGPU, another GPU, or carries
    something this vgpuhost refuses to parse.  Release still frees exactly what the store says the domain
    holds, and nothing it names instead."""
    host = mixed_l40s_vfs_off(make_host)
    path = install(host, tmp_path)
    xml = vgpu_domain("web", DOM1, MDEV1, gpu=GPU_LO)
    other = vgpu_domain("other", DOM2, MDEV2, gpu=GPU_HI)
    for x, name in ((xml, "web"), (other, "other")):
        assert dispatch(path, [name, "prepare", "begin", "-"], x.encode()).returncode == 0
    assert set(mdevs(host)) == {MDEV1, MDEV2}
    # web's metadata now names other's vGPU and passes the L40S through: release must free only MDEV1
    changed = domain_xml("web", DOM1, Metadata(vgpus=[VgpuRequest("A40-4Q", uuid=MDEV2)], passthrough=[L40S]),
                         [mdev_hostdev(MDEV2)])
    proc = dispatch(path, ["web", "release", "end", "-"], changed.encode())
    assert (proc.returncode, proc.stderr) == (0, b"")
    assert set(mdevs(host)) == {MDEV2} and [r.owner for r in store(host).vgpu_records()] == [DOM2]
    # other's metadata is now something vgpuhost cannot parse (an unknown attribute, a bad profile)
    for raw in ('<vgpuhost:vgpu profile="A40-8Q" uuid="%s" colour="red"/>' % MDEV2,
                '<vgpuhost:vgpu profile="no such thing!"/>'):
        bad = domain_xml("other", DOM2, raw_meta=_meta_raw(raw), hostdevs=[mdev_hostdev(MDEV2)])
        rc, err = stop(host, "other", bad)        # the handler in process: the same answer
        assert (rc, err) == (0, ""), err
    assert mdevs(host) == {} and store(host).vgpu_records() == [] and store(host).active_domains() == {}
    # a prepare with such metadata is still refused, as before
    bad = domain_xml("other", DOM2, raw_meta=_meta_raw('<vgpuhost:vgpu profile="A40-8Q" colour="red"/>'))
    rc, err = start(host, "other", bad)
    assert rc == 2 and "unknown attribute 'colour'" in err


def test_release_of_a_domain_that_holds_nothing_stays_cheap_and_silent(make_host, tmp_path):
    """A plain domain's 'release end' on a host where vgpuhost has a store: the handler runs (the
    store is the record), finds nothing and writes nothing."""
    host = make_host("a40-mdev")
    path = install(host, tmp_path)
    xml = vgpu_domain("web", DOM1, MDEV1)
    assert dispatch(path, ["web", "prepare", "begin", "-"], xml.encode()).returncode == 0
    n = len(audit(host))
    plain = domain_xml("plain", DOM2, hostdevs=[])
    proc = dispatch(path, ["plain", "release", "end", "-"], plain.encode())
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b"")
    assert len(audit(host)) == n and set(mdevs(host)) == {MDEV1}


NO_PYTHON = "/nonexistent/vgpuhost-test/python3"


def test_release_of_a_domain_the_store_never_started_starts_no_python(make_host, tmp_path):
    """The store keeps a marker per domain it records as started; a plain domain's 'release end'
    finds none and the dispatcher exits 0 without starting Python (an installed interpreter that
    does not exist proves it), while a started domain whose metadata is gone still reaches it."""
    host = make_host("a40-mdev")
    assert dispatch(install(host, tmp_path), ["web", "prepare", "begin", "-"],
                    vgpu_domain("web", DOM1, MDEV1).encode()).returncode == 0
    markers = Path(str(host.state_dir)) / "domains"
    assert sorted(p.name for p in markers.iterdir()) == [DOM1]
    path = install(host, tmp_path, python=NO_PYTHON)
    plain = domain_xml("plain", DOM2, hostdevs=[])
    proc = dispatch(path, ["plain", "release", "end", "-"], plain.encode())
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b"")
    # web holds a vGPU and lost its metadata: the dispatcher must run the handler (here: fails to start it)
    proc = dispatch(path, ["web", "release", "end", "-"], _without_metadata(vgpu_domain("web", DOM1, MDEV1)).encode())
    assert proc.returncode != 0 and MDEV1 in mdevs(host)
    # with a real interpreter it releases and the marker goes with the row
    proc = dispatch(install(host, tmp_path), ["web", "release", "end", "-"],
                    _without_metadata(vgpu_domain("web", DOM1, MDEV1)).encode())
    assert (proc.returncode, proc.stderr) == (0, b"")
    assert mdevs(host) == {} and store(host).active_domains() == {} and list(markers.iterdir()) == []


def test_a_store_from_before_the_markers_runs_the_handler_and_gets_its_markers(make_host, tmp_path):
    """An upgraded host: domains started by a vgpuhost without markers are in the store but have no
    marker; the dispatcher runs the handler for every release until the folder exists, and the next
    change makes it with a marker for each recorded domain."""
    host = make_host("a40-mdev")
    path = install(host, tmp_path)
    for name, dom, mdev in (("web", DOM1, MDEV1), ("db", DOM2, MDEV2)):
        assert dispatch(path, [name, "prepare", "begin", "-"], vgpu_domain(name, dom, mdev).encode()).returncode == 0
    markers = Path(str(host.state_dir)) / "domains"
    shutil.rmtree(markers)
    proc = dispatch(install(host, tmp_path, python=NO_PYTHON), ["web", "release", "end", "-"],
                    _without_metadata(vgpu_domain("web", DOM1, MDEV1)).encode())
    assert proc.returncode != 0                     # it tried the handler
    path = install(host, tmp_path)                  # the real interpreter again
    proc = dispatch(path, ["web", "release", "end", "-"], _without_metadata(vgpu_domain("web", DOM1, MDEV1)).encode())
    assert (proc.returncode, proc.stderr) == (0, b"")
    assert sorted(p.name for p in markers.iterdir()) == [DOM2] and set(mdevs(host)) == {MDEV2}


def test_a_domain_xml_with_two_uuid_elements_goes_to_the_handler(make_host, tmp_path):
    """The dispatcher reads the UUID with sh patterns only when there is one <uuid> element."""
    host = make_host("a40-mdev")
    assert dispatch(install(host, tmp_path), ["web", "prepare", "begin", "-"],
                    vgpu_domain("web", DOM1, MDEV1).encode()).returncode == 0
    plain = domain_xml("plain", DOM2, hostdevs=[])
    odd = plain.replace("</domain>", "<metadata><x:a xmlns:x='urn:x'><uuid>%s</uuid></x:a></metadata></domain>" % DOM1)
    proc = dispatch(install(host, tmp_path, python=NO_PYTHON), ["plain", "release", "end", "-"], odd.encode())
    assert proc.returncode != 0                     # not decided by the first <uuid> it saw


# ---------------------------------------------------------------------------
# issue 12 #4l: an mdevctl definition (defined, not started) for the UUID a domain names

def _define_in_mdevctl(host, parent: str, uuid: str, text: str) -> Path:
    d = host.mdevctl_d / parent
    d.mkdir(parents=True, exist_ok=True)
    (d / uuid).write_text(text)
    return d / uuid


def test_an_mdevctl_definition_for_the_domains_uuid_is_respected_or_refused(make_host):
    """The hook used to create the mdev with the domain's type on the first parent that fit, whatever
    'mdevctl define' said for that UUID.  Now: the definition's parent and type, or a refusal naming it."""
    host = make_host("a100-sriov-mdev")
    vf = "0000:41:01.2"                                        # not the parent first-fit would pick
    _define_in_mdevctl(host, vf, MDEV1, '{"mdev_type": "nvidia-468", "start": "manual", "attrs": []}\n')
    xml = vgpu_domain("ml", DOM1, MDEV1, "A100-4C")            # nvidia-468 is A100-4C: they agree
    assert start(host, "ml", xml) == (0, "")
    (m,) = discover(Sysfs(host)).mdevs
    assert (m.uuid, str(m.parent), m.type_id) == (MDEV1, vf, "nvidia-468")
    rec = store(host).vgpu_records()[0]
    assert rec.parent == vf and not rec.persisted
    assert stop(host, "ml", xml) == (0, "") and mdevs(host) == {}
    assert (host.mdevctl_d / vf / MDEV1).exists()             # the operator's definition is left alone
    # the definition says A100-8C (nvidia-470), the domain asks for A100-4C: refused, naming both
    (host.mdevctl_d / vf / MDEV1).write_text('{"mdev_type": "nvidia-470", "start": "manual", "attrs": []}\n')
    n = len(writes(host))
    rc, err = start(host, "ml", xml)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"mdevctl definition /etc/mdevctl.d/{vf}/{MDEV1} defines {MDEV1} as A100-8C (nvidia-470)" in err
    assert "but A100-4C is asked for" in err and f"mdevctl undefine --uuid {MDEV1}" in err
    assert mdevs(host) == {} and len(writes(host)) == n and store(host).vgpu_records() == []


def test_an_mdevctl_definition_that_is_not_json_is_refused_by_position_only(make_host):
    host = make_host("a40-mdev")
    _define_in_mdevctl(host, str(A40), MDEV1, "root:$6$SECRETHASH$xyz:19000:0:99999:7:::\n")
    rc, err = start(host, "web", vgpu_domain("web", DOM1, MDEV1))
    assert rc == 2 and err.count("\n") == 1, err
    assert f"/etc/mdevctl.d/{A40}/{MDEV1} is not valid JSON (line 1, column 1)" in err
    assert "SECRET" not in err and mdevs(host) == {} and writes(host) == []


def test_the_dispatcher_refuses_xml_with_a_nul_byte_instead_of_dropping_it(make_host, tmp_path):
    """Issue 12 #4m: '$(cat)' dropped NUL bytes, so the handler acted on a document libvirt never sent."""
    host = make_host("a40-mdev")
    path = install(host, tmp_path)
    xml = vgpu_domain("web", DOM1, MDEV1).replace("<memory", "<!-- \0 --><memory").encode()
    assert b"\0" in xml
    proc = dispatch(path, ["web", "prepare", "begin", "-"], xml)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1 and "NUL byte" in err, err
    assert mdevs(host) == {} and writes(host) == []
    # the handler itself refuses one too (python -m vgpuhost.hook, or a dispatcher of an older version)
    rc, err = start(host, "web", xml.decode())
    assert rc == 2 and "domain XML holds a NUL byte (at offset" in err, err
    # the same document without the NUL goes ahead
    proc = dispatch(path, ["web", "prepare", "begin", "-"], xml.replace(b"\0", b""))
    assert proc.returncode == 0, proc.stderr


def test_agent_call_without_a_socket_is_agent_down_before_json(tmp_path):
    """The handler's own try of the agent (a hook installed without curl, no agent running): a missing
    path or one that is no socket is AgentDown at once, and json (with re) is not imported for it."""
    (tmp_path / "plain").write_text("")
    code = ("import sys\n"
            f"sys.path.insert(0, {str(Path(hook.__file__).parents[2])!r})\n"
            "from vgpuhost.io import agentclient\n"
            "for p in sys.argv[1:]:\n"
            "    try:\n"
            "        agentclient.call(p, 'POST', '/v1/hook/prepare', {'xml': ''}, timeout_s=5)\n"
            "    except agentclient.AgentDown as e:\n"
            "        print('down', 'no agent on' in str(e))\n"
            "print(sorted(m for m in ('json', 're', 'socket') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path / "missing" / "agent.sock"),
                           str(tmp_path / "plain")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["down True", "down True", "[]"]


@pytest.mark.parametrize("shell", ["/bin/dash", "/bin/bash"])
def test_the_installed_dispatcher_passes_the_shells_syntax_check(make_host, tmp_path, shell):
    """The shipped hook/qemu.sh is a template (debian/vgpuhost.lintian-overrides says so); what
    'hook install' writes from it is a script every POSIX shell parses, with no placeholder left."""
    host = make_host("a40-mdev")
    path = install(host, tmp_path)
    assert not re.search(r"@[A-Z_]+@", path.read_text())
    proc = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (0, "")
