"""Materialise a host spec into a host root on disk.

Owns: laying out ``sys/`` (real relative symlinks, as the kernel does; see
docs/reference/hardware.md#mdev), ``proc/``, ``lib/modules`` and
``dev/vfio`` for a :class:`HostSpec`, and the simulator's own metadata in
``<root>/.vgpuhost-sim/`` (``host.json``, ``state.json``, ``gpus/<BDF>.json``:
:meth:`vgpuhost.sim.kernel.SimKernel.meta`).  Must not: implement write semantics
(that is :mod:`vgpuhost.sim.kernel`).

IOMMU grouping when a device names no ``iommu_group`` (docs/reference/hardware.md#pci-and-iommu):
functions of one slot share a group (no multifunction ACS); a bridge with
``acs: false`` pulls every device below it into its own group; SR-IOV VFs get
a group each.  A device whose ``upstream`` is in another PCI domain sits in a
domain that upstream device hosts (Intel VMD: ``.../0000:5d:05.5/pci10000:00/
10000:00:02.0``) and is in that device's group, as since Linux 5.6
(docs/reference/hardware.md#intel-vmd).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..io.hostroot import SIM_MARKER, HostRoot
from ..model.errors import SimulatorError
from ..model.values import PciAddress
from .catalog import Catalog, GpuModel, load_catalog
from .kernel import READ_FAULTS_FILE, SimKernel, write_meta
from .metering import write_load
from .nvml import nvml_seed
from .spec import DeviceSpec, HostSpec

# driver name -> kernel module name (sys/bus/pci/drivers/<d>/module)
DRIVER_MODULES = {
    "vfio-pci": "vfio_pci", "nvidia": "nvidia", "snd_hda_intel": "snd_hda_intel",
    "xhci_hcd": "xhci_pci", "nvidia-gpu": "i2c_nvidia_gpu", "pcieport": "pcieport",
    "ahci": "ahci", "igb": "igb", "i915": "i915", "ast": "ast", "vmd": "vmd",
}
FIRST_GROUP = 10
WRITE_ONLY = ("config", "remove", "reset", "rescan")


class _Dev:
    """A device being laid out (spec device or expanded VF)."""

    def __init__(self, bdf: PciAddress, *, vendor: int, device: int, sub_vendor: int, sub_device: int,
                 pci_class: int, driver: Optional[str], reset_method: str, numa_node: int,
                 upstream: Optional[PciAddress], model: str, is_gpu: bool,
                 boot_vga: bool = False, boot_framebuffer: bool = False,
                 iommu_group: Optional[int] = None, pf: Optional[PciAddress] = None, acs: bool = True):
        self.bdf = bdf
        self.vendor, self.device, self.sub_vendor, self.sub_device = vendor, device, sub_vendor, sub_device
        self.pci_class = pci_class
        self.driver = driver
        self.reset_method = reset_method
        self.numa_node = numa_node
        self.upstream = upstream
        self.model = model
        self.is_gpu = is_gpu
        self.boot_vga = boot_vga
        self.boot_framebuffer = boot_framebuffer
        self.iommu_group = iommu_group
        self.pf = pf
        self.acs = acs
        self.vfs: List[PciAddress] = []
        self.relpath = ""  # sys/devices/... relative to the root

    @property
    def is_bridge(self) -> bool:
        return (self.pci_class >> 8) == 0x0604


def _w(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _link(link: Path, target: Path) -> None:
    """A relative symlink at ``link`` pointing at ``target`` (both absolute)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(os.path.relpath(target, link.parent), link)


def materialise(spec: HostSpec, dest: "str | Path", *, catalog: Optional[Catalog] = None,
                force: bool = False) -> HostRoot:
    """Build the host root for ``spec`` at ``dest`` and return its HostRoot.

    ``dest`` must be absent or empty unless ``force`` (then an existing
    simulated root there is replaced).  Raises SimulatorError otherwise.
    """
    cat = catalog or load_catalog()
    root = Path(dest).absolute()
    try:
        return _materialise(spec, root, cat, force)
    except OSError as e:
        raise SimulatorError(f"cannot build a simulated host at {str(root)!r}: {e.strerror}"
                             + (f" ({e.filename})" if e.filename and str(e.filename) != str(root) else ""),
                             hint="pick a writable, empty directory") from None


def _materialise(spec: HostSpec, root: Path, cat: Catalog, force: bool) -> HostRoot:
    if os.path.lexists(root) and not root.is_dir():
        raise SimulatorError(f"{root} exists and is not a directory", hint="pick an empty directory")
    replace_old = False
    if root.is_dir() and any(root.iterdir()):
        if not force:
            raise SimulatorError(f"{root} is not empty", hint="pick an empty directory, or pass --force "
                                                              "to replace a simulated host there")
        if not (root / SIM_MARKER).is_dir():
            raise SimulatorError(f"{root} is not a simulated host root; refusing to replace it")
        replace_old = True
    root.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename it into place: a failure leaves nothing half-built.  The
    # private staging folder (0700, mkdtemp's) holds the new root, made as mkdir makes any folder
    # (0755 under the usual umask 022), so the root reads as a real / does: mdevctl, driverctl and
    # non-root readers can walk it.
    stage = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=root.parent))
    tmp = stage / "root"
    try:
        tmp.mkdir()
        _build(spec, HostRoot(tmp), cat)
        if replace_old:
            os.rename(root, stage / "old")
            try:
                os.rename(tmp, root)
            except BaseException:
                os.rename(stage / "old", root)         # the old host stays as it was
                raise
        else:
            if root.is_dir():
                root.rmdir()
            os.rename(tmp, root)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return HostRoot(root)


def _build(spec: HostSpec, host: HostRoot, cat: Catalog) -> None:
    root = host.root
    devs = _expand(spec, cat)
    _assign_paths(devs)
    groups = _assign_groups(devs) if spec.iommu else {}
    drivers = sorted({d.driver for d in devs.values() if d.driver}
                     | ({"vfio-pci"} if ({"vfio_pci"} & set(spec.modules + spec.builtin_modules)) else set()))

    for name in drivers:
        ddir = host.pci_driver(name)
        for f in ("bind", "unbind", "new_id", "remove_id"):
            _w(ddir / f)
        mod = DRIVER_MODULES.get(name, name.replace("-", "_"))
        (host.sys_module / mod).mkdir(parents=True, exist_ok=True)
        _link(ddir / "module", host.sys_module / mod)
    _w(host.pci_drivers_probe)
    _w(host.path("sys", "bus", "pci", "rescan"))
    _w(host.path("sys", "bus", "pci", "drivers_autoprobe"), "1\n")
    host.iommu_groups.mkdir(parents=True, exist_ok=True)
    host.iommu_class.mkdir(parents=True, exist_ok=True)
    if spec.iommu:
        unit = "dmar0" if spec.cpu_vendor == "GenuineIntel" else "ivhd0"
        (host.path("sys", "devices", "virtual", "iommu", unit)).mkdir(parents=True, exist_ok=True)
        _link(host.iommu_class / unit, host.path("sys", "devices", "virtual", "iommu", unit))

    for d in devs.values():
        _lay_device(host, d, groups.get(d.bdf), devs)

    gpus: Dict[str, dict] = {}
    for ds in spec.devices:
        if ds.is_gpu:
            gpus[str(ds.bdf)] = _gpu_entry(host, ds, cat.gpus[ds.model], devs, cat)

    _lay_proc(host, spec, devs)
    meta = {
        "version": 1,
        "name": spec.name,
        "summary": spec.summary,
        "source": spec.source,
        "devices": {str(b): {"path": d.relpath, "native_driver": d.driver, "model": d.model,
                             "class": d.pci_class, "is_gpu": d.is_gpu,
                             "pf": str(d.pf) if d.pf else None,
                             "iommu_group": groups.get(b)} for b, d in sorted(devs.items())},
        "drivers": drivers,
        "gpus": gpus,
        "processes": list(spec.processes),
        "next_iommu_group": (max(groups.values()) + 1) if groups else FIRST_GROUP,
        "faults": [dict(op=f.op, device=f.device, errno=f.errno, count=f.count, effect=f.effect,
                        **({"attr": f.attr} if f.attr else {}))
                   for f in spec.faults],
    }
    sim = root / SIM_MARKER
    sim.mkdir(exist_ok=True)
    write_meta(sim, meta)           # host.json, state.json and one file per GPU (sim/kernel.py)
    read_faults = sorted({f.attr for f in spec.faults if f.op == "read" and f.attr})
    if read_faults:         # what Sysfs checks on a simulated root before it asks the kernel (kernel.read)
        (sim / READ_FAULTS_FILE).write_text("".join(a + "\n" for a in read_faults))
    if spec.load:
        write_load(host, {k: json.loads(v) for k, v in spec.load})
    kernel = SimKernel(host)
    meta = kernel.meta()
    for pf, gpu in gpus.items():
        kernel.refresh_gpu(pf, meta)
        for parent in gpu["parents"]:       # a parent booted off nvidia offers no mdev type
            kernel.sync_mdev_parent(meta, parent)


def _expand(spec: HostSpec, cat: Catalog) -> Dict[PciAddress, _Dev]:
    devs: Dict[PciAddress, _Dev] = {}
    for ds in spec.devices:
        if ds.is_gpu:
            g = cat.gpus[ds.model]
            d = _Dev(ds.bdf, vendor=g.ids.vendor, device=g.ids.device, sub_vendor=g.ids.subsystem_vendor,
                     sub_device=g.ids.subsystem_device, pci_class=g.pci_class, driver=ds.driver,
                     reset_method=g.reset_method, numa_node=ds.numa_node, upstream=ds.upstream,
                     model=ds.model, is_gpu=True, boot_vga=ds.boot_vga,
                     boot_framebuffer=ds.boot_framebuffer, iommu_group=ds.iommu_group)
            devs[ds.bdf] = d
            for i in range(ds.vgpu.sriov_numvfs):
                vf = ds.bdf.with_devfn(ds.bdf.devfn + g.sriov_offset + i * g.sriov_stride)
                if vf in devs:
                    raise SimulatorError(f"VF {vf} of {ds.bdf} collides with another device")
                d.vfs.append(vf)
                devs[vf] = _Dev(vf, vendor=g.ids.vendor, device=g.vf_device or g.ids.device,
                                sub_vendor=g.ids.subsystem_vendor, sub_device=g.ids.subsystem_device,
                                pci_class=g.pci_class, driver=ds.driver, reset_method="flr",
                                numa_node=ds.numa_node, upstream=ds.upstream, model=ds.model,
                                is_gpu=False, pf=ds.bdf)
        else:
            m = cat.devices[ds.model]
            devs[ds.bdf] = _Dev(ds.bdf, vendor=m.ids.vendor, device=m.ids.device,
                                sub_vendor=m.ids.subsystem_vendor, sub_device=m.ids.subsystem_device,
                                pci_class=m.pci_class, driver=ds.driver, reset_method=m.reset_method,
                                numa_node=ds.numa_node, upstream=ds.upstream, model=ds.model,
                                is_gpu=False, boot_vga=ds.boot_vga, boot_framebuffer=ds.boot_framebuffer,
                                iommu_group=ds.iommu_group, acs=m.acs)
    return devs


def _assign_paths(devs: Dict[PciAddress, _Dev]) -> None:
    def path(d: _Dev) -> str:
        if d.relpath:
            return d.relpath
        if d.upstream is None:
            d.relpath = f"sys/devices/pci{d.bdf.domain:04x}:{d.bdf.bus:02x}/{d.bdf}"
        elif d.upstream.domain != d.bdf.domain:     # the upstream device hosts this domain (Intel VMD)
            d.relpath = f"{path(devs[d.upstream])}/pci{d.bdf.domain:04x}:{d.bdf.bus:02x}/{d.bdf}"
        else:
            d.relpath = f"{path(devs[d.upstream])}/{d.bdf}"
        return d.relpath

    for d in devs.values():
        path(d)


def _assign_groups(devs: Dict[PciAddress, _Dev]) -> Dict[PciAddress, int]:
    """IOMMU group number per device (see the module docstring)."""
    def group_key(d: _Dev) -> Tuple:
        # a device in a PCI domain that another device hosts (behind Intel VMD) DMAs with that
        # device's requester id: it is in that device's group (docs/reference/hardware.md#intel-vmd)
        below, up = d, d.upstream
        while up is not None:
            if up.domain != below.bdf.domain:
                return group_key(devs[up])
            below, up = devs[up], devs[up].upstream
        # the highest non-ACS bridge above d (or d itself if it is one) owns the group
        owner: Optional[_Dev] = None
        up = d.upstream
        while up is not None:
            u = devs[up]
            if u.is_bridge and not u.acs:
                owner = u
            up = u.upstream
        if d.is_bridge and not d.acs and owner is None:
            owner = d
        if owner is not None:
            return ("bridge", owner.bdf)
        if d.pf is not None:
            return ("vf", d.bdf)
        return ("slot", d.bdf.domain, d.bdf.bus, d.bdf.slot)

    explicit = {d.bdf: d.iommu_group for d in devs.values() if d.iommu_group is not None}
    keys: Dict[Tuple, int] = {}
    out: Dict[PciAddress, int] = {}
    used = set(explicit.values())
    nxt = FIRST_GROUP
    for bdf in sorted(devs):
        d = devs[bdf]
        if bdf in explicit:
            out[bdf] = explicit[bdf]
            continue
        k = group_key(d)
        if k not in keys:
            while nxt in used:
                nxt += 1
            keys[k] = nxt
            used.add(nxt)
        out[bdf] = keys[k]
    return out


def _lay_device(host: HostRoot, d: _Dev, group: Optional[int], devs: Dict[PciAddress, _Dev]) -> None:
    ddir = host.root / d.relpath
    ddir.mkdir(parents=True, exist_ok=True)
    _w(ddir / "vendor", f"0x{d.vendor:04x}\n")
    _w(ddir / "device", f"0x{d.device:04x}\n")
    _w(ddir / "subsystem_vendor", f"0x{d.sub_vendor:04x}\n")
    _w(ddir / "subsystem_device", f"0x{d.sub_device:04x}\n")
    _w(ddir / "class", f"0x{d.pci_class:06x}\n")
    _w(ddir / "numa_node", f"{d.numa_node}\n")
    _w(ddir / "driver_override", "(null)\n")
    _w(ddir / "enable", "1\n")
    if d.reset_method:
        _w(ddir / "reset_method", d.reset_method + "\n")
    if (d.pci_class >> 16) == 0x03 and d.pf is None:
        _w(ddir / "boot_vga", "1\n" if d.boot_vga else "0\n")
    for f in WRITE_ONLY:
        _w(ddir / f)
    _link(host.pci_device(d.bdf), ddir)
    if group is not None:
        gdir = host.iommu_groups / str(group)
        _w(gdir / "type", "DMA\n")
        _w(gdir / "reserved_regions")
        _link(gdir / "devices" / str(d.bdf), ddir)
        _link(ddir / "iommu_group", gdir)
    if d.driver:
        _link(ddir / "driver", host.pci_driver(d.driver))
        _link(host.pci_driver(d.driver) / str(d.bdf), ddir)
    if d.vfs:
        _w(ddir / "sriov_numvfs", f"{len(d.vfs)}\n")
        _w(ddir / "sriov_offset", f"{(d.vfs[0].devfn - d.bdf.devfn)}\n")
        _w(ddir / "sriov_stride", "1\n")
        _w(ddir / "sriov_vf_device", f"{devs[d.vfs[0]].device:04x}\n")
        for i, vf in enumerate(d.vfs):
            _link(ddir / f"virtfn{i}", host.root / devs[vf].relpath)
    if d.pf is not None:
        _link(ddir / "physfn", host.root / devs[d.pf].relpath)


def _gpu_entry(host: HostRoot, ds: DeviceSpec, g: GpuModel, devs: Dict[PciAddress, _Dev],
               cat: Catalog) -> dict:
    ddir = host.root / devs[ds.bdf].relpath
    if g.sriov_totalvfs:
        _w(ddir / "sriov_totalvfs", f"{g.sriov_totalvfs}\n")
        if not ds.vgpu.sriov_numvfs:
            _w(ddir / "sriov_numvfs", "0\n")
    backend = ds.vgpu.backend
    vfs = [str(v) for v in devs[ds.bdf].vfs]
    mdev = backend == "mdev"
    types: Dict[str, dict] = {}
    for t in g.vgpu_types:
        tid = f"nvidia-{t.type_id}" if mdev else str(t.type_id)
        types[tid] = {"name": t.name, "raw_name": f"{g.type_name_prefix} {t.name}",
                      "fb_mib": t.framebuffer_mib, "max": t.max_instances,
                      "max_mixed": t.max_instances_mixed, "gi_profile": t.gi_profile,
                      "series": t.profile.series}
    parents: List[str] = []
    if backend == "mdev":
        parents = vfs if vfs else [str(ds.bdf)]
        for p in parents:
            pdir = host.root / devs[PciAddress.parse(p)].relpath
            for tid, t in types.items():
                tdir = pdir / "mdev_supported_types" / tid
                _w(tdir / "name", t["raw_name"] + "\n")
                desc = dict(cat.series_description.get(t["series"], {}))
                parts = [f"num_heads={desc.get('num_heads', 1)}", f"frl_config={desc.get('frl_config', 60)}",
                         f"framebuffer={t['fb_mib']}M",
                         f"max_resolution={desc.get('max_resolution', '4096x2160')}",
                         f"max_instance={t['max']}"]
                _w(tdir / "description", ", ".join(parts) + "\n")
                _w(tdir / "device_api", "vfio-pci\n")
                _w(tdir / "available_instances", "0\n")
                _w(tdir / "create")
                (tdir / "devices").mkdir(parents=True, exist_ok=True)
            _link(host.mdev_bus / p, pdir)
        host.mdev_devices.mkdir(parents=True, exist_ok=True)
    elif backend == "vendor-vfio":
        parents = vfs
        for p in parents:
            ndir = host.root / devs[PciAddress.parse(p)].relpath / "nvidia"
            _w(ndir / "creatable_vgpu_types", "ID    : vGPU Name\n")
            _w(ndir / "current_vgpu_type", "0\n")
            # placement_id (mixed-size mode: written before the type to choose a placement; "Not
            # Applicable" while the VF holds none); no vgpu_params: the driver's VF group has none
            # (docs/reference/hardware.md#vendor-vfio, #vgpu-types)
            _w(ndir / "placement_id", "Not Applicable\n")
    entry = {
        "board": g.key, "backend": backend, "vfs": vfs, "parents": parents,
        "framebuffer_mib": g.framebuffer_mib, "types": types,
        "mixed_size": ds.vgpu.mixed_size, "mig_capable": g.mig_capable, "mig_mode": ds.mig_mode,
        "free_gpu_instances": {}, "gpu_instances": [],
    }
    # the simulated NVML's state (MIG profiles, pending mode, scheduler): vgpuhost.sim.nvml
    entry.update({k: v for k, v in nvml_seed(g, ds.mig_mode, str(ds.bdf)).items() if k not in entry})
    return entry


def _lay_proc(host: HostRoot, spec: HostSpec, devs: Dict[PciAddress, _Dev]) -> None:
    _w(host.proc_cmdline, spec.cmdline + "\n")
    lines = []
    for m in spec.modules:
        lines.append(f"{m} 16384 0 - Live 0x0000000000000000")
    _w(host.proc_modules, "\n".join(lines) + ("\n" if lines else ""))
    for m in spec.modules + spec.builtin_modules:
        (host.sys_module / m).mkdir(parents=True, exist_ok=True)
    if "nvidia" in spec.modules:
        _w(host.sys_module / "nvidia" / "version", spec.driver_version + "\n")   # MODULE_VERSION's attribute
    _w(host.proc_cpuinfo, f"processor\t: 0\nvendor_id\t: {spec.cpu_vendor}\n"
                          f"flags\t\t: {'vmx' if spec.cpu_vendor == 'GenuineIntel' else 'svm'}\n")
    _w(host.path("proc", "sys", "kernel", "osrelease"), spec.kernel_release + "\n")
    chip = "IR-PCI-MSI" if spec.iommu and spec.interrupt_remapping else "PCI-MSI"
    irq = ["           CPU0\n  0:         42   IO-APIC    2-edge      timer"]
    for n, d in enumerate(sorted(devs)):
        if devs[d].driver:
            irq.append(f" {120 + n}:          0  {chip} {n}-edge      {devs[d].driver}")
    _w(host.path("proc", "interrupts"), "\n".join(irq) + "\n")
    iomem = ["00000000-00000fff : Reserved"]
    base = 0x80000000
    for n, bdf in enumerate(sorted(devs)):
        d = devs[bdf]
        if (d.pci_class >> 16) != 0x03 or d.pf is not None:
            continue
        start = base + n * 0x1000000
        iomem.append(f"  {start:08x}-{start + 0xffffff:08x} : {bdf}")
        if d.boot_framebuffer:
            iomem.append(f"    {start:08x}-{start + 0x2fffff:08x} : BOOTFB")
        elif d.driver:
            iomem.append(f"    {start:08x}-{start + 0xffffff:08x} : {d.driver}")
    _w(host.path("proc", "iomem"), "\n".join(iomem) + "\n")
    for pid, name in enumerate(spec.processes, start=1000):
        _w(host.path("proc", str(pid), "comm"), name[:15] + "\n")   # the kernel's TASK_COMM_LEN
    mdir = host.lib_modules(spec.kernel_release)
    builtin = [f"kernel/{_module_path(m)}" for m in spec.builtin_modules]
    _w(mdir / "modules.builtin", "\n".join(builtin) + ("\n" if builtin else ""))
    available = sorted(set(spec.modules) | {"vfio", "vfio_pci", "vfio_pci_core", "vfio_iommu_type1"}
                       - set(spec.builtin_modules))
    _w(mdir / "modules.dep", "".join(f"kernel/{_module_path(m)}:\n" for m in available))
    host.dev_vfio.mkdir(parents=True, exist_ok=True)
    _w(host.dev_vfio / "vfio")
    host.modprobe_d.mkdir(parents=True, exist_ok=True)


def _module_path(module: str) -> str:
    if module.startswith("vfio"):
        sub = "pci/" if module.startswith("vfio_pci") else ""
        return f"drivers/vfio/{sub}{module.replace('_', '-')}.ko"
    if module.startswith("nvidia"):
        return f"updates/dkms/{module.replace('_', '-')}.ko"
    return f"drivers/misc/{module}.ko"
