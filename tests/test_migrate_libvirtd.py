"""Migration of a domain with a vGPU between two simulated hosts, each with its own real isolated libvirtd.

Issue 27, section 2's Must show.  Two :class:`vgpuhost.sim.libvirtd.IsolatedLibvirtd` (one module
fixture, started once), each with vgpuhost's qemu hook installed by ``vgpuhost hook install`` for its
own simulated host: the source's A40 at ``00ee:81:00.0``, the destination's at ``00ee:41:00.0`` (PCI
segment ``00ee``, which no machine here has, so libvirt never reaches a real device).

What is real and what is driven:

- **real (libvirt runs vgpuhost's installed hook)**: the domain (vgpuhost metadata pinned to the
  source's GPU, an mdev ``<hostdev>``) is defined on the source's libvirtd and started by it: its
  ``prepare begin`` makes the vGPU on ``81:00.0`` (seen by a spy hook run right after vgpuhost's);
  the XML handed to the destination is the one libvirt produces for a migration (``virsh dumpxml
  --migratable``, ``VIR_DOMAIN_XML_MIGRATABLE``); the rewritten XML is defined on the destination's
  libvirtd and started by it: its ``prepare begin`` makes the reserved device on ``41:00.0`` and
  drops the reservation; ``release end`` on each side frees the device.
- **driven**: ``migrate begin`` on the destination.  libvirt runs that hook only inside an incoming
  migration, and ``virsh migrate`` between the two daemons cannot run here.  The test runs the
  installed hook script as libvirt does (``NAME migrate begin -``, the migratable XML on stdin, a
  minimal environment, the new XML read from stdout).
- **not real**: a running domain.  libvirt cannot open a simulated mdev (no VFIO on this machine, and
  no such mdev in the real sysfs), so each start fails after ``prepare begin`` and libvirt runs
  ``release end`` at once (the error asserted as in tests/test_hook_e2e.py); the source's migratable
  XML is therefore the defined domain's, and its ``release end`` is the one after that failed start,
  not the one after a completed migration.  A domain without the ``<hostdev>`` would run, but the
  hook refuses a vGPU whose hostdev is missing.

Needs root, ``unshare`` and Debian's libvirt-daemon, libvirt-daemon-driver-qemu, libvirt-clients and
qemu-system-x86: skipped without them, except in CI (``CI=true``) where that fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))      # nsutil

import nsutil                                                   # noqa: E402
from vgpuhost.io.hostroot import HostRoot                       # noqa: E402
from vgpuhost.io.state import StateStore                        # noqa: E402
from vgpuhost.io.sysfs import Sysfs                             # noqa: E402
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest, parse_domain   # noqa: E402
from vgpuhost.model.values import PciAddress                    # noqa: E402
from vgpuhost.sim.build import materialise                      # noqa: E402
from vgpuhost.sim.libvirtd import IsolatedLibvirtd, available, diskless_domain_xml   # noqa: E402
from vgpuhost.sim.spec import parse_spec                        # noqa: E402

pytestmark = pytest.mark.root

A = PciAddress.parse
SRC_GPU, DEST_GPU = A("00ee:81:00.0"), A("00ee:41:00.0")
VGPUHOST = [sys.executable, "-m", "vgpuhost"]
SPEC = """
version: 1
name: {name}
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
  driver_version: 580.65.05
devices:
  - {{bdf: "00ee:{bus}:01.0", model: intel-root-port, numa_node: 0}}
  - {{bdf: "00ee:{gpu}", model: A40, upstream: "00ee:{bus}:01.0", numa_node: 0, vgpu: {{backend: mdev}}}}
"""
#: a minimal environment, as libvirtd gives its hooks
HOOK_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C"}


class Side:
    """One simulated host with its own isolated libvirtd and vgpuhost's hook installed."""

    def __init__(self, host: HostRoot, daemon: IsolatedLibvirtd, hook: Path):
        self.host, self.daemon, self.hook = host, daemon, hook

    def virsh(self, *args: str, input: str = None) -> subprocess.CompletedProcess:
        return self.daemon.virsh(*args, input=input)

    def mdevs(self) -> Dict[str, str]:
        """``{mdev UUID: parent GPU BDF}`` in the simulated tree."""
        fs, d = Sysfs(self.host), self.host.mdev_devices
        return {u: Path(fs.resolve(d / u)).parent.name for u in fs.listdir(d)}

    def spied(self, name: str) -> Dict[str, str]:
        """What the spy hook (``zz-spy``, run after vgpuhost's) saw right after NAME's ``prepare begin``:
        ``{mdev UUID: parent GPU BDF}``."""
        lines = (self.daemon.workdir / f"{name}.mdevs").read_text().split("\n")
        return dict(line.split(" ", 1) for line in lines if line)

    def store(self) -> StateStore:
        return StateStore(self.host.state_dir, create=False)


def _side(tmp: Path, name: str, gpu: PciAddress) -> Side:
    host = materialise(parse_spec(SPEC.format(name=name, bus=f"{gpu.bus - 1:02x}", gpu=f"{gpu.bus:02x}:00.0")),
                       tmp / f"{name}-host")
    daemon = IsolatedLibvirtd(tmp / f"{name}-libvirtd")
    daemon.start()
    try:
        proc = subprocess.run([*VGPUHOST, "--root", str(host.root), "hook", "install", "--hooks-dir",
                               str(daemon.hooks_dir)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        spy = daemon.hooks_dir / "zz-spy"          # libvirt runs qemu.d in name order: after vgpuhost's
        spy.write_text("#!/bin/sh\ncat > /dev/null\n"
                       'if [ "$2 $3" = "prepare begin" ]; then\n'
                       f'  cd {host.mdev_devices} && for u in *; do [ -e "$u" ] && '
                       'echo "$u $(basename "$(dirname "$(readlink -f "$u")")")"; done '
                       f'> {daemon.workdir}/"$1.mdevs"\n'
                       "fi\nexit 0\n")
        spy.chmod(0o755)
        daemon.reload_hooks()
    except BaseException:
        daemon.stop()
        raise
    return Side(host, daemon, daemon.hooks_dir / "vgpuhost")


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> Iterator[Tuple[Side, Side]]:
    """(source, destination): each a simulated A40 host with its own started libvirtd and vgpuhost's hook."""
    ok, reason = available()
    nsutil.skip_or_fail(None if ok else reason, "the two-libvirtd migration tests")
    tmp = tmp_path_factory.mktemp("migrate-libvirtd")
    src = _side(tmp, "src", SRC_GPU)
    try:
        dest = _side(tmp, "dest", DEST_GPU)
    except BaseException:
        src.daemon.stop()
        raise
    try:
        yield src, dest
    finally:
        dest.daemon.stop()
        src.daemon.stop()


def domain_xml(name: str, uuid: str, meta: Metadata, hostdevs: str = "") -> str:
    xml = diskless_domain_xml(name, uuid=uuid)
    xml = xml.replace("</uuid>", "</uuid>\n  <metadata>\n" + meta.to_xml() + "  </metadata>", 1)
    return xml.replace("</devices>", hostdevs + "  </devices>")


def migrate_begin(dest: Side, name: str, xml: str) -> subprocess.CompletedProcess:
    """The destination's ``migrate begin`` as libvirt runs it: the installed script, the XML on stdin."""
    return subprocess.run([str(dest.hook), name, "migrate", "begin", "-"], input=xml.encode(), capture_output=True,
                          env=HOOK_ENV, timeout=120)


def mdev_hostdev(uuid: str) -> str:
    return (f"    <hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'><source>"
            f"<address uuid='{uuid}'/></source></hostdev>\n")


def failed_start(side: Side, name: str, mdev: str) -> None:
    """``virsh start NAME`` fails as it must here: after the hook's prepare begin made the mdev, libvirt
    cannot open it (no VFIO on the machine, or no such mdev in the real sysfs)."""
    p = side.virsh("start", name)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 1 and lines[0] == f"error: Failed to start domain '{name}'", p.stderr
    assert lines[1:] in ([["error: unsupported configuration: Mediated host device assignment requires VFIO support"],
                          [f"error: device not found: mediated device '{mdev}' not found"]]), lines


def test_a_pinned_mdev_domain_moves_between_two_libvirtds_through_their_hooks(two_hosts):
    src, dest = two_hosts
    name, uuid, mdev = "mig-pinned", "11111111-2222-4333-8444-00000000c0a1", "aaaaaaaa-2222-4333-8444-00000000c0a1"
    meta = Metadata(strategy="first-fit", vgpus=[VgpuRequest("A40-8Q", uuid=mdev, gpu=SRC_GPU)])
    assert src.virsh("define", "/dev/stdin", input=domain_xml(name, uuid, meta, mdev_hostdev(mdev))).returncode == 0
    try:
        # what libvirt hands a migration: the domain's migratable XML (VIR_DOMAIN_XML_MIGRATABLE)
        mig = src.virsh("dumpxml", "--migratable", name)
        assert mig.returncode == 0
        doc = parse_domain(mig.stdout)
        assert doc.metadata.vgpus[0].gpu == SRC_GPU and doc.mdev_uuids == [mdev]
        # the source: libvirt's start runs prepare begin (the real hook), which makes the vGPU on 81:00.0;
        # libvirt then fails on the simulated mdev and runs release end, which frees it
        failed_start(src, name, mdev)
        assert src.spied(name) == {mdev: str(SRC_GPU)}                      # right after prepare begin
        assert src.mdevs() == {} and src.store().vgpu_records() == []
        made = [r.operation.split(" ")[:2] for r in src.store().audit_rows() if r.actor.startswith(f"hook {name}")]
        assert ["vgpu", "create"] in made and ["vgpu", "remove"] in made, made
        # the destination's migrate begin (driven, see the module docstring): the pin is rewritten, the UUID
        # and the hostdev kept, the device reserved, nothing made yet
        p = migrate_begin(dest, name, mig.stdout)
        assert p.returncode == 0 and p.stderr == b"", p.stderr
        new = parse_domain(p.stdout)
        assert new.metadata.vgpus[0].gpu == DEST_GPU and new.metadata.vgpus[0].uuid == mdev
        assert new.uuid == uuid and new.mdev_uuids == [mdev]
        rows = dest.store().reservation_rows()
        assert [(r[0], r[1], r[3], r[4]) for r in rows] == [(mdev, uuid, str(DEST_GPU), "mdev")]
        assert dest.mdevs() == {}
        # the destination's libvirtd takes the rewritten XML; its start runs prepare begin (the real hook),
        # which makes the reserved device on 41:00.0 and drops the reservation; libvirt's failure on the
        # simulated mdev then runs release end there, which frees it: nothing leaks on either side
        assert dest.virsh("define", "/dev/stdin", input=p.stdout.decode()).returncode == 0
        assert parse_domain(dest.virsh("dumpxml", name).stdout).metadata.vgpus[0].gpu == DEST_GPU
        failed_start(dest, name, mdev)
        assert dest.spied(name) == {mdev: str(DEST_GPU)}
        assert ("(reservation)", "made") in [(r.path, r.result) for r in dest.store().audit_rows()]
        assert dest.store().reservation_rows() == [] and dest.mdevs() == {} and dest.store().vgpu_records() == []
    finally:
        for side in (src, dest):
            side.virsh("undefine", name)
