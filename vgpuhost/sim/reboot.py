"""A simulated host's reboot: what a restart of the machine does to its kernel, driver and NVML state.

Owns: :func:`reboot`, which puts a simulated root in the state a real host is in once it has booted
again and before vgpuhost's boot units run (docs/guide/simulator.md#reboot, where each behaviour
names its source).  Must not: restore anything vgpuhost restores itself; that is the boot units'
work (``vgpuhost-layout.service``, ``vgpuhost-reconcile.service``: docs/guide/boot-units.md), and
the point of a simulated reboot is to let them do it.

What is lost (runtime state):

- every process: the qemus holding vGPUs (meta ``opened`` and their ``proc/<pid>``), and with them
  the domains libvirt was running; a libvirtd that ``vgpuhost sim libvirtd start --hook`` keeps for
  this root is stopped first (its domains destroyed, their ``release`` hooks run, as libvirt-guests
  does at a clean shutdown);
- every vGPU: each mdev (its directory, links, IOMMU group and ``/dev/vfio`` node), each vendor-VFIO
  VF's ``current_vgpu_type`` (back to 0);
- each device's ``driver_override`` and driver binding;
- NVML's runtime state: GPU and compute instances, mixed-size mode, the scheduler set through NVML
  (back to the driver's default, best effort), a lost GPU and queued Xid events, compute processes;
- the kernel's boot id (``proc/sys/kernel/random/boot_id``): a new one, as each boot makes.

What stays (persistent state, read at boot):

- the files under ``etc/`` and ``var/`` (vgpuhost's state store included);
- MIG mode, a pending change becoming current (the reboot resets the GPU);
- the SR-IOV VFs, which the simulator's spec fixes: a real host enables them again at boot with
  ``/usr/lib/nvidia/sriov-manage -e`` (docs/guide/simulator.md#reboot says what is not simulated);
- injected faults (``faults`` of the spec and ``sim fail --create-errno``): the hardware is the same.

Then the boot, in the kernel's order: each device binds to the driver a driverctl override names
(``etc/driverctl.d/pci-<BDF>``: driverctl's udev rule sets ``driver_override`` before the probe),
else to vfio-pci when an ``options vfio-pci ids=`` line of ``etc/modprobe.d`` names its vendor and
device, else to the driver it booted with; then mdevctl starts every mdev defined with ``"start":
"auto"`` (``etc/mdevctl.d/<parent>/<uuid>``), with its attributes, as its udev rule does when the
parent appears.  A definition that cannot start (its type has no instance left, its parent is not on
``nvidia``) is reported and skipped, as mdevctl logs it and goes on.
"""

from __future__ import annotations

import json
import os
import re
from uuid import uuid4
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..io.configfiles import modprobe_conf_files
from ..io.hostroot import HostRoot
from .libvirtd import keep_stop, kept
from .nvml import DEFAULT_SCHEDULER
from .kernel import VFIO_PCI, SimKernel, _rmtree, write_attr

#: a simulated root's record of the work directories of the libvirtds kept for it
#: (``vgpuhost sim libvirtd start --hook``), one a line: :func:`note_libvirtd`
LIBVIRTD_RECORD = "libvirtd-workdirs"


def note_libvirtd(host: HostRoot, workdir: Path) -> None:
    """Record that a libvirtd kept in ``workdir`` runs this simulated host's hook (once)."""
    record = host.sim_dir / LIBVIRTD_RECORD
    known = record.read_text().splitlines() if record.exists() else []
    if str(workdir) not in known:
        with open(record, "a", encoding="utf-8") as f:
            f.write(f"{workdir}\n")


def noted_libvirtds(host: HostRoot) -> List[Path]:
    """The work directories :func:`note_libvirtd` recorded for this host, in order."""
    record = host.sim_dir / LIBVIRTD_RECORD
    return [Path(line) for line in (record.read_text().splitlines() if record.exists() else []) if line]


def _vfio_ids(host: HostRoot) -> set:
    """``{(vendor, device)}`` the ``options vfio-pci ids=`` lines of ``etc/modprobe.d`` name (hex, lower case)."""
    ids = set()
    for _path, text in modprobe_conf_files(host):
        for line in text.splitlines():
            m = re.match(r"\s*options\s+vfio[-_]pci\s+(.*)$", line)
            if not m:
                continue
            for word in m.group(1).split():
                if word.startswith("ids="):
                    for item in word[4:].split(","):
                        parts = item.split(":")
                        if len(parts) >= 2:
                            ids.add((parts[0].lower(), parts[1].lower()))
    return ids


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _boot_driver(host: HostRoot, kernel: SimKernel, meta: dict, bdf: str, vfio_ids: set) -> Tuple[Optional[str], bool]:
    """``(driver, named by a driverctl override)`` the device binds to at boot."""
    override = _read(host.driverctl_d / f"pci-{bdf}")
    if override:
        return override, True
    ddir = kernel.dev_dir(meta, bdf)
    vendor, device = (_read(ddir / "vendor") or "")[2:], (_read(ddir / "device") or "")[2:]
    if (vendor.lower(), device.lower()) in vfio_ids:
        return VFIO_PCI, False
    return meta["devices"][bdf].get("native_driver"), False


def _stop_libvirtds(host: HostRoot) -> List[str]:
    stopped = []
    for workdir in noted_libvirtds(host):
        if kept(workdir) is not None and keep_stop(workdir):
            stopped.append(str(workdir))
    record = host.sim_dir / LIBVIRTD_RECORD
    if record.exists():
        record.unlink()
    return stopped


def reboot(host: HostRoot) -> dict:
    """Reboot the simulated host at ``host`` (see the module docstring); what happened, as
    ``{"libvirtd_stopped": [workdir], "vgpus_lost": [id], "gpu_instances_lost": {gpu: n},
    "drivers": {bdf: driver or None}, "mdevctl_started": [uuid], "mdevctl_failed": [{"uuid",
    "parent", "error"}]}``.  Raises OSError when the tree cannot be written."""
    stopped = _stop_libvirtds(host)
    kernel = SimKernel(host)
    vfio_ids = _vfio_ids(host)
    lost: List[str] = []
    gis: Dict[str, int] = {}
    drivers: Dict[str, Optional[str]] = {}
    with kernel.locked():
        meta = kernel.meta()
        # every process dies: the qemus holding vGPUs
        for pid in sorted(meta.get("opened") or {}):
            pdir = kernel._rpath(host.proc) / str(int(pid))
            if pdir.is_dir():
                _rmtree(pdir)
        meta["opened"] = {}
        meta["mdev_removing"] = {}          # the removes that waited for them: every mdev goes below
        # a create or remove whose writer was killed half-way: its pieces go (never a vGPU that was lost)
        kernel._settle_mdev_change(meta)
        # every vGPU is gone: mdevs (not persistent), vendor-VFIO types (a VF boots with none)
        for pf, gpu in sorted(meta["gpus"].items()):
            for inst in kernel.instances(meta, pf):
                if gpu["backend"] == "mdev" and not os.path.lexists(host.mdev_devices / inst["id"]):
                    continue        # no bus link: no vGPU, a killed writer's leftover (swept below)
                lost.append(inst["id"])
                if gpu["backend"] == "mdev":
                    kernel._mdev_unregister(meta, kernel._rdir(meta, inst["parent"]) / inst["id"], pf)
                else:
                    write_attr(kernel.dev_dir(meta, inst["parent"]) / "nvidia" / "current_vgpu_type", "0\n")
            if gpu["backend"] == "mdev":
                # and any device directory left by a writer killed before this simulator kept a record
                for parent in gpu["parents"]:
                    kernel.sweep_mdev_leftovers(meta, pf, parent)
            # NVML: GPU and compute instances are not persistent; MIG mode is (a pending change applies)
            if gpu.get("gpu_instances"):
                gis[pf] = len(gpu["gpu_instances"])
            gpu["gpu_instances"] = []
            if gpu.get("mig_capable"):
                gpu["mig_mode"] = bool(gpu.get("mig_pending", gpu.get("mig_mode")))
                gpu["mig_pending"] = gpu["mig_mode"]
            gpu["mig_reset_required"] = False
            gpu["mixed_size"] = False
            gpu["scheduler"] = dict(DEFAULT_SCHEDULER)
            gpu["compute_processes"] = 0
            gpu["lost"] = False
            gpu["xid_events"] = []
        # drivers: every binding and override goes, then each device is probed again
        present = [b for b, d in sorted(meta["devices"].items()) if not d.get("unplugged")]
        for bdf in present:
            drv = kernel._driver_of(meta, bdf)
            if drv:
                kernel._detach(meta, bdf, drv)
            write_attr(kernel.dev_dir(meta, bdf) / "driver_override", "(null)\n")
        # PFs before their VFs (sorted BDFs put a PF first), so a PF's vfio-pci refusal sees its VFs
        for bdf in present:
            drv, by_driverctl = _boot_driver(host, kernel, meta, bdf, vfio_ids)
            if by_driverctl:            # driverctl's udev rule writes driver_override before the probe
                write_attr(kernel.dev_dir(meta, bdf) / "driver_override", drv + "\n")
            if drv and kernel._driver_dir(drv).is_dir() and not (drv == VFIO_PCI and kernel._vfs_enabled(meta, bdf)):
                kernel._attach(meta, bdf, drv)
            drivers[bdf] = kernel._driver_of(meta, bdf)
        kernel.save_meta(meta)
        for pf in meta["gpus"]:
            kernel.refresh_gpu(pf, meta)
            for parent in meta["gpus"][pf]["parents"]:
                kernel.sync_mdev_parent(meta, parent)
    new_boot_id(host)
    started, failed = _mdevctl_autostart(host, kernel)
    return {"libvirtd_stopped": stopped, "vgpus_lost": sorted(lost), "gpu_instances_lost": gis,
            "drivers": drivers, "mdevctl_started": started, "mdevctl_failed": failed}


def new_boot_id(host: HostRoot) -> str:
    """Give the simulated kernel a new boot id (``proc/sys/kernel/random/boot_id``, a random UUID), as
    a real kernel makes one once per boot (drivers/char/random.c); returns it."""
    boot_id = str(uuid4())
    path = host.path("proc", "sys", "kernel", "random", "boot_id")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(boot_id + "\n")
    os.replace(tmp, path)
    return boot_id


def _mdevctl_autostart(host: HostRoot, kernel: SimKernel) -> Tuple[List[str], List[dict]]:
    """mdevctl's start of the ``"start": "auto"`` definitions under ``etc/mdevctl.d``, through the kernel."""
    started: List[str] = []
    failed: List[dict] = []
    top = host.mdevctl_d
    if not top.is_dir():
        return started, failed
    for parent in sorted(os.listdir(top)):
        if not (top / parent).is_dir():
            continue
        for uuid in sorted(os.listdir(top / parent)):
            try:
                doc = json.loads((top / parent / uuid).read_text())
            except (OSError, ValueError):
                failed.append({"uuid": uuid, "parent": parent, "error": "unreadable definition"})
                continue
            if not isinstance(doc, dict) or doc.get("start") != "auto":
                continue
            type_id = str(doc.get("mdev_type") or "")
            create = host.pci_device(parent) / "mdev_supported_types" / type_id / "create"
            try:
                kernel.write(create, uuid)
                for attr in doc.get("attrs") or []:
                    for name, value in (attr.items() if isinstance(attr, dict) else ()):
                        kernel.write(host.mdev_devices / uuid / name, f"{value}\n")
            except OSError as e:
                failed.append({"uuid": uuid, "parent": parent, "error": os.strerror(e.errno or 5)})
                continue
            started.append(uuid)
    return started, failed


__all__ = ["reboot", "note_libvirtd", "noted_libvirtds", "LIBVIRTD_RECORD"]
