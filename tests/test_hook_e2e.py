"""The qemu hook under a real libvirtd 9.x (Debian 12), started by the test suite in private namespaces.

Uses the session fixture ``libvirtd`` (tests/libvirtd_fixture.py): never the
machine's own daemon or state.  vgpuhost's hook is installed with ``vgpuhost
hook install`` (a real process, as an operator runs it) into the daemon's
private ``/etc/libvirt/hooks/qemu.d``, pointing at a simulated GPU host under
pytest's temp dir, which the daemon's namespace shares.  A second hook,
``zz-spy``, runs after vgpuhost's (libvirt runs qemu.d alphabetically) and
records what the simulated tree looked like right after ``prepare begin``.

The simulated devices exist only in the simulated tree, so after the hook
made them libvirt fails to open them in the real sysfs; the tests assert that
exact error, that ``release end`` (which libvirt runs after a failed start)
undid everything, and what the audit log says the hook wrote.  Their PCI
addresses sit in PCI segment ``00ee``, which no machine here has: libvirt can
never reach a real device through them (checked before each start).

Needs root, ``unshare`` and Debian's libvirt-daemon, libvirt-daemon-driver-qemu,
libvirt-clients and qemu-system-x86: skipped without them, except in CI
(``CI=true``) where that fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))      # libvirtd_fixture, nsutil

from vgpuhost.libvirt.domxml import Metadata, VgpuRequest                # noqa: E402
from vgpuhost.io.hostroot import HostRoot                           # noqa: E402
from vgpuhost.sim.build import materialise                       # noqa: E402
from vgpuhost.sim.libvirtd import IsolatedLibvirtd, diskless_domain_xml   # noqa: E402
from vgpuhost.sim.spec import parse_spec                         # noqa: E402
from vgpuhost.io.state import StateStore                   # noqa: E402
from vgpuhost.io.sysfs import Sysfs                                 # noqa: E402
from vgpuhost.model.values import PciAddress                           # noqa: E402

pytest_plugins = ["libvirtd_fixture"]
pytestmark = pytest.mark.root

A = PciAddress.parse
PT_GPU, PT_AUDIO, VGPU_GPU = A("00ee:41:00.0"), A("00ee:41:00.1"), A("00ee:81:00.0")
SPEC = """
version: 1
name: hook-e2e
summary: an A40 to pass through (with its HD-audio function) and an A40 for classic-mdev vGPUs
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio, snd_hda_intel]
devices:
  - {bdf: "00ee:40:01.0", model: intel-root-port, numa_node: 0}
  - {bdf: "00ee:41:00.0", model: A40, upstream: "00ee:40:01.0", numa_node: 0}
  - {bdf: "00ee:41:00.1", model: nvidia-hda, upstream: "00ee:40:01.0", numa_node: 0}
  - {bdf: "00ee:80:01.0", model: intel-root-port, numa_node: 1}
  - {bdf: "00ee:81:00.0", model: A40, upstream: "00ee:80:01.0", numa_node: 1, vgpu: {backend: mdev}}
"""
MACHINE = HostRoot(Path("/"))
VGPUHOST = [sys.executable, "-m", "vgpuhost"]


def machine_has_vfio() -> bool:
    """What libvirt checks before any hostdev (qemuHostdevHostSupportsPassthroughVFIO): IOMMU groups and /dev/vfio/vfio."""
    try:
        groups = os.listdir(MACHINE.iommu_groups)
    except OSError:
        groups = []
    return bool(groups) and (MACHINE.dev_vfio / "vfio").exists()


def pci_error(bdf: PciAddress) -> str:
    if not machine_has_vfio():
        return "error: unsupported configuration: host doesn't support passthrough of host PCI devices"
    config = MACHINE.pci_device(bdf) / "config"
    return f"error: Device {bdf} not found: could not access {config}: No such file or directory"


def mdev_errors(uuid: str) -> List[str]:
    if not machine_has_vfio():
        return ["error: unsupported configuration: Mediated host device assignment requires VFIO support"]
    return [f"error: device not found: mediated device '{uuid}' not found"]


@pytest.fixture
def gpu_host(tmp_path) -> HostRoot:
    host = materialise(parse_spec(SPEC), tmp_path / "gpu-host")
    for bdf in (PT_GPU, PT_AUDIO, VGPU_GPU):                       # libvirt must never reach a real device
        assert not os.path.lexists(MACHINE.pci_device(bdf)), f"this machine has a real {bdf}"
    return host


@pytest.fixture
def hooked(libvirtd: IsolatedLibvirtd, gpu_host: HostRoot, tmp_path) -> Iterator[IsolatedLibvirtd]:
    """vgpuhost's hook (and the spy after it) installed in the daemon, for ``gpu_host``; removed afterwards."""
    spy = libvirtd.hooks_dir / "zz-spy"
    spy.write_text("#!/bin/sh\ncat > /dev/null\n"
                   f'if [ "$2 $3" = "prepare begin" ]; then\n'
                   f'  ls {gpu_host.mdev_devices} > {tmp_path}/"$1.mdevs"\n'
                   f'  for f in {PT_GPU} {PT_AUDIO}; do basename "$(readlink {gpu_host.pci_devices}/$f/driver)"; done > {tmp_path}/"$1.drivers"\n'
                   "fi\n")
    spy.chmod(0o755)
    proc = subprocess.run([*VGPUHOST, "--root", str(gpu_host.root), "hook", "install", "--hooks-dir",
                           str(libvirtd.hooks_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("installed ") and "SIGHUP" in proc.stdout      # a new hook: reload libvirtd
    libvirtd.reload_hooks()
    try:
        yield libvirtd
    finally:
        subprocess.run([*VGPUHOST, "--root", str(gpu_host.root), "hook", "uninstall", "--hooks-dir",
                        str(libvirtd.hooks_dir)], capture_output=True, timeout=120)
        spy.unlink()
        libvirtd.reload_hooks()


def define(daemon: IsolatedLibvirtd, name: str, meta: Metadata = None, hostdevs: str = "") -> str:
    """Define ``name`` (diskless) with vgpuhost metadata and hostdevs; its UUID."""
    xml = diskless_domain_xml(name)
    if meta is not None:
        xml = xml.replace("</uuid>", "</uuid>\n  <metadata>\n" + meta.to_xml() + "  </metadata>", 1)
    xml = xml.replace("</devices>", hostdevs + "  </devices>")
    daemon.virsh("define", "/dev/stdin", input=xml, check=True)
    return daemon.virsh("domuuid", name, check=True).stdout.strip()


def pci_hostdev(bdf: PciAddress) -> str:
    return (f"    <hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x{bdf.domain:04x}' "
            f"bus='0x{bdf.bus:02x}' slot='0x{bdf.slot:02x}' function='0x{bdf.function:x}'/></source></hostdev>\n")


def mdev_hostdev(uuid: str) -> str:
    return (f"    <hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'><source>"
            f"<address uuid='{uuid}'/></source></hostdev>\n")


def error_lines(stderr: str) -> List[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def drivers(host: HostRoot) -> List[str]:
    fs = Sysfs(host)
    return [fs.link_name(host.pci_device(b) / "driver") for b in (PT_GPU, PT_AUDIO)]


def test_hook_makes_the_devices_at_start_and_release_undoes_them(hooked, gpu_host, tmp_path):
    mdev = "aaaaaaaa-2222-4333-8444-00000000e2e1"
    meta = Metadata(strategy="best-fit", vgpus=[VgpuRequest("A40-8Q", uuid=mdev)], passthrough=[PT_GPU])
    uuid = define(hooked, "hk-gpu", meta, pci_hostdev(PT_GPU) + pci_hostdev(PT_AUDIO) + mdev_hostdev(mdev))
    try:
        proc = hooked.virsh("start", "hk-gpu")
        # the hook made both; then libvirt could not open the (simulated) PCI device in the real sysfs
        assert proc.returncode == 1
        assert error_lines(proc.stderr) == ["error: Failed to start domain 'hk-gpu'", pci_error(PT_GPU)]
        assert (tmp_path / "hk-gpu.mdevs").read_text().split() == [mdev]            # right after prepare begin
        assert (tmp_path / "hk-gpu.drivers").read_text().split() == ["vfio-pci"] * 2
        # release end ran after the failed start: everything is back
        assert os.listdir(gpu_host.mdev_devices) == []
        assert drivers(gpu_host) == ["nvidia", "snd_hda_intel"]
        store = StateStore(gpu_host.state_dir)
        assert store.vgpu_records() == [] and store.passthrough_records() == [] and store.active_domains() == {}
        rows = [r for r in store.audit_rows() if r.actor.startswith("hook hk-gpu")]
        ops = [(r.operation.split(" ")[0:2], r.path.rsplit("/", 1)[-1]) for r in rows if r.path != "(placement)"]
        assert (["vgpu", "create"], "create") in ops and (["vgpu", "remove"], "remove") in ops
        assert (["passthrough", "prepare"], "drivers_probe") in ops and (["passthrough", "release"], "drivers_probe") in ops
        assert all(r.result == "ok" for r in rows) and all(uuid in r.operation for r in rows if r.operation.startswith("vgpu"))
        assert hooked.virsh("domstate", "hk-gpu", check=True).stdout.strip() == "shut off"
    finally:
        hooked.virsh("undefine", "hk-gpu")


def test_vgpu_only_domain_fails_on_the_simulated_mdev(hooked, gpu_host, tmp_path):
    mdev = "aaaaaaaa-2222-4333-8444-00000000e2e2"
    define(hooked, "hk-vgpu", Metadata(vgpus=[VgpuRequest("A40-4Q", uuid=mdev)]), mdev_hostdev(mdev))
    try:
        proc = hooked.virsh("start", "hk-vgpu")
        lines = error_lines(proc.stderr)
        assert proc.returncode == 1 and lines[0] == "error: Failed to start domain 'hk-vgpu'"
        assert lines[1:] in [[e] for e in mdev_errors(mdev)], lines
        assert (tmp_path / "hk-vgpu.mdevs").read_text().split() == [mdev]
        assert os.listdir(gpu_host.mdev_devices) == [] and StateStore(gpu_host.state_dir).vgpu_records() == []
    finally:
        hooked.virsh("undefine", "hk-vgpu")


def test_domain_without_metadata_runs_normally_with_the_hook(hooked, gpu_host):
    define(hooked, "hk-plain")
    try:
        hooked.virsh("start", "hk-plain", check=True)        # every hook call exits without starting Python
        assert hooked.virsh("domstate", "hk-plain", check=True).stdout.strip() == "running"
        hooked.virsh("destroy", "hk-plain", check=True)
        assert hooked.virsh("domstate", "hk-plain", check=True).stdout.strip() == "shut off"
    finally:
        hooked.virsh("undefine", "hk-plain")
    store = StateStore(gpu_host.state_dir)                  # (hook install made it, for its audit row)
    assert [r.operation for r in store.audit_rows()] == ["hook install"] and store.active_domains() == {}


def test_hook_failure_reaches_virsh_start(hooked, gpu_host):
    mdev = "aaaaaaaa-2222-4333-8444-00000000e2e3"
    define(hooked, "hk-bad", Metadata(vgpus=[VgpuRequest("A40-7Q", uuid=mdev)]), mdev_hostdev(mdev))
    try:
        proc = hooked.virsh("start", "hk-bad")
        assert proc.returncode == 1
        want = ("vgpuhost: error: domain 'hk-bad': unknown vGPU profile 'A40-7Q' on this host; near matches: "
                "A40-8Q, A40-6Q, A40-4Q, A40-3Q, A40-2Q")
        lines = error_lines(proc.stderr)
        assert lines[0] == "error: Failed to start domain 'hk-bad'"
        assert lines[1].startswith("error: Hook script execution failed: ") and lines[1].endswith(
            "/etc/libvirt/hooks/qemu.d/vgpuhost hk-bad prepare begin -) unexpected exit status 2: " + want), lines
        assert len(lines) == 2
        assert hooked.virsh("domstate", "hk-bad", check=True).stdout.strip() == "shut off"
        assert os.listdir(gpu_host.mdev_devices) == []
        assert [r for r in StateStore(gpu_host.state_dir).audit_rows() if r.actor.startswith("hook")] == []
    finally:
        hooked.virsh("undefine", "hk-bad")
