"""Inventory: an immutable snapshot of a host's GPUs, as sysfs shows them.

Owns: discovery — reading PCI devices, IOMMU groups, SR-IOV PF/VF links,
mdev parents/types/instances, NVIDIA vendor-VFIO VFs and host facts
(cmdline, modules, processes) through :class:`vgpuhost.sysfs.Sysfs` — and
the frozen records that hold them.  Must not: write anything, or decide what is
good or bad (that is :mod:`vgpuhost.checks`).

Sources: docs/reference/hardware.md#pci-and-iommu (PCI/IOMMU files), #mdev (mdev), #vendor-vfio (vendor VFIO:
``nvidia/creatable_vgpu_types``, ``current_vgpu_type``; backend detection as
vgpu-device-manager does it), #vgpu-types (type names).  MIG state comes from NVML in
a later issue: :class:`Gpu` has ``mig`` = None until a probe fills it.
"""

from __future__ import annotations

import errno
import os

from ..io import files
from ..io.sysfs import Sysfs, int_of
from ..io.vgpudev import (mdev_available, mdev_available_all, mdev_type_constants, mdev_type_of, mdev_types_available,
                          supported_types_dir, types_dir_in, vendor_vgpu_vfs, vf_current_type, vf_offers)
from ..io.vgpudev import parse_creatable_vgpu_types  # noqa: F401  (the door parses it; inventory re-exports it)
from ..model.boards import board
from ..model.errors import SysfsError
from ..model.kinds import Backend
from ..model.values import (PciAddress, VgpuProfile, field, is_digits, parse_description, parse_size_mib, record, replace,
                            strip_vendor_prefix)

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple
    MigProbe = Callable[[PciAddress], Optional[Mapping[str, object]]]
    GiProbe = Callable[[Sysfs, PciAddress], Optional[Dict[str, int]]]

NVIDIA_VENDOR = 0x10de
INTEL_VENDOR = 0x8086
CLASS_NAMES = {
    0x0300: "VGA controller", 0x0302: "3D controller", 0x0380: "display controller",
    0x0403: "HD audio", 0x0c03: "USB controller", 0x0c80: "serial bus controller (UCSI)",
    0x0604: "PCI bridge", 0x0106: "SATA controller", 0x0108: "NVMe controller",
    0x0200: "Ethernet controller", 0x0280: "network controller", 0x0104: "RAID controller",
    0x0c05: "SMBus controller", 0x0600: "host bridge", 0x0601: "ISA bridge",
}

BACKEND_MDEV = Backend.MDEV
BACKEND_VENDOR_VFIO = Backend.VENDOR_VFIO


@record(frozen=True)
class PciDevice:
    """One PCI function.  Ids are ints (``vendor`` 0x10de); ``numa_node`` -1 = unknown."""

    address: PciAddress
    vendor: int
    device: int
    subsystem_vendor: int
    subsystem_device: int
    pci_class: int
    driver: Optional[str]
    driver_override: Optional[str]
    numa_node: int
    boot_vga: Optional[bool]
    reset_methods: Tuple[str, ...]
    iommu_group: Optional[int]
    upstream: Optional[PciAddress]
    physfn: Optional[PciAddress] = None
    virtfns: Tuple[PciAddress, ...] = ()
    sriov_totalvfs: Optional[int] = None
    sriov_numvfs: Optional[int] = None
    #: the PCI device that hosts this device's PCI domain (Intel VMD's endpoint: the device directory
    #: above ``pci10000:00`` in the device's sysfs path); None for a domain of the platform's own host
    #: bridge (docs/reference/hardware.md#intel-vmd)
    domain_host: Optional[PciAddress] = None

    @property
    def base_class(self) -> int:
        return self.pci_class >> 16

    @property
    def subclass(self) -> int:
        return self.pci_class >> 8

    @property
    def is_bridge(self) -> bool:
        """A PCI bridge (class 0x0604), left on pcieport in a passthrough group."""
        return self.subclass == 0x0604

    @property
    def stays_in_group(self) -> bool:
        """A function passthrough leaves where it is: a PCI bridge (on pcieport), or a host
        bridge (class 0x0600) with no driver, such as AMD's "PCIe Dummy Host Bridge" on
        EPYC/Threadripper.  The kernel's VFIO viability check accepts both: a driverless
        device holds no DMA (docs/reference/hardware.md#pci-and-iommu)."""
        return self.is_bridge or (self.subclass == 0x0600 and self.driver is None)

    @property
    def is_display(self) -> bool:
        return self.base_class == 0x03

    @property
    def is_vf(self) -> bool:
        return self.physfn is not None

    @property
    def class_name(self) -> str:
        return CLASS_NAMES.get(self.subclass, f"class {self.pci_class:#08x}")

    @property
    def ids(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"


@record(frozen=True)
class IommuGroup:
    number: int
    members: Tuple[PciAddress, ...]


@record(frozen=True)
class VgpuType:
    """A vGPU type offered on one parent (an mdev parent or a vendor-VFIO VF).

    ``type_id`` is the sysfs id: ``nvidia-566`` (mdev) or ``1145`` (vendor
    VFIO, the NVML type id).  ``framebuffer_mib`` comes from the mdev
    ``description`` or, failing that, the name.  ``available_instances`` is
    the kernel's count for this parent; on vendor VFIO it is 1 when the VF
    lists the type as creatable now, else 0.
    """

    gpu: PciAddress
    parent: PciAddress
    backend: str
    type_id: str
    raw_name: str
    name: str
    profile: Optional[VgpuProfile]
    framebuffer_mib: Optional[int]
    max_instances: Optional[int]
    available_instances: int
    device_api: Optional[str]
    description: Mapping[str, str] = field(default_factory=dict)


@record(frozen=True)
class MdevDevice:
    """A mediated device (vGPU) instance on the classic mdev path."""

    uuid: str
    parent: PciAddress
    type_id: str
    iommu_group: Optional[int]
    driver: Optional[str]


@record(frozen=True)
class VfVgpu:
    """A vendor-VFIO VF (vGPU 17+) and the vGPU type it holds (``type_id`` None = free)."""

    vf: PciAddress
    gpu: PciAddress
    type_id: Optional[str]
    creatable: Tuple[Tuple[str, str], ...]  # (type id, raw name) listed in creatable_vgpu_types


@record(frozen=True)
class Unreadable:
    """A vGPU parent (a VF, or an mdev parent) whose attribute could not be read, so it offers nothing.

    ``device``: the VF or mdev parent; ``attribute``: the file's name (``creatable_vgpu_types``);
    ``errno_name``: ``EINVAL``...; ``reason``: one phrase.  A read of ``creatable_vgpu_types`` fails
    with EINVAL when the driver's query of the GPU fails (docs/reference/hardware.md#vendor-vfio):
    discovery records it here and goes on.
    """

    device: PciAddress
    attribute: str
    errno_name: str
    reason: str

    def describe(self) -> str:
        """``0000:41:00.5: reading creatable_vgpu_types failed with EINVAL (...)`` in one line."""
        return f"{self.device}: reading {self.attribute} failed with {self.errno_name} ({self.reason})"


def _unreadable(device: PciAddress, e: SysfsError) -> Unreadable:
    why = ("the driver's query of the GPU failed; it offers no vGPU type until a read succeeds"
           if e.errno == errno.EINVAL else os.strerror(e.errno).lower())
    return Unreadable(device, os.path.basename(e.path), e.errno_name, why)


@record(frozen=True)
class Gpu:
    """An NVIDIA GPU (physical function) and what it can serve.

    ``backends`` lists what sysfs shows it can serve: ``passthrough`` (it has
    an IOMMU group), ``mdev`` (classic mdev, on the PF or on its SR-IOV VFs),
    ``vendor-vfio`` (vGPU 17+ VFs with ``nvidia/``).  ``mig`` is None until
    an NVML probe (later issue) reports MIG capability and mode.
    ``gpu_instances``: GPU-instance profile name -> count (``{"1g.18gb": 2}``),
    read from NVML only for an SR-IOV GPU whose VFs offer a MIG-backed type
    now (the kernel's count of those is the free VFs, not the free GPU
    instances); None when not read or NVML could not say.
    ``unreadable``: its VFs and mdev parents whose vGPU attributes could not be
    read (:class:`Unreadable`); they offer nothing, the rest of the GPU is read.
    ``vmd``: the Intel VMD endpoint whose PCI domain holds the GPU (its
    ``domain_host`` when that is an Intel device), else None: such a GPU
    shares the VMD's IOMMU group (docs/reference/hardware.md#intel-vmd).
    """

    address: PciAddress
    pci: PciDevice
    board: Optional[str]
    vgpu_backend: Optional[str]
    backends: Tuple[str, ...]
    vfs: Tuple[PciAddress, ...]
    mdev_parents: Tuple[PciAddress, ...]
    companions: Tuple[PciAddress, ...]
    mig: Optional[Mapping[str, object]] = None
    gpu_instances: Optional[Mapping[str, int]] = None
    unreadable: Tuple[Unreadable, ...] = ()
    vmd: Optional[PciAddress] = None

    @property
    def model(self) -> str:
        """Product name from the PCI device id, else ``10de:xxxx``."""
        known = board(self.pci.device)
        return known.product if known else self.pci.ids

    @property
    def model_known(self) -> bool:
        """Whether vgpuhost knows the PCI device id (:mod:`vgpuhost.model.boards`): an unknown one has
        no product name, framebuffer or capacity figures of its own."""
        return board(self.pci.device) is not None

    @property
    def framebuffer_mib(self) -> Optional[int]:
        """The board's framebuffer (MiB) when the device id is known, else None."""
        known = board(self.pci.device)
        return known.framebuffer_mib if known else None


@record(frozen=True)
class SelinuxFacts:
    """SELinux facts for libvirt's hooks (docs/reference/libvirt.md#selinux).

    ``enforcing``: ``sys/fs/selinux/enforce`` reads 1.  ``hooks_unconfined``: the policy boolean
    ``virt_hooks_unconfined`` (its current value; None where the policy has no such boolean).
    ``hooks_label`` / ``etc_label``: the SELinux types of ``etc/libvirt/hooks`` and of ``etc/libvirt``
    (None: unlabelled or absent)."""

    enforcing: bool
    hooks_unconfined: Optional[bool]
    hooks_label: Optional[str]
    etc_label: Optional[str]


@record(frozen=True)
class HostFacts:
    """Host-level facts read from proc/ and lib/modules under the root."""

    cmdline: str
    cpu_vendor: Optional[str]
    cpu_virt_flags: FrozenSet[str]
    kernel_release: Optional[str]
    modules_loaded: FrozenSet[str]
    modules_builtin: FrozenSet[str]
    modules_available: FrozenSet[str]
    interrupt_remapping: Optional[bool]   # None: not visible
    processes: FrozenSet[str]             # proc/<pid>/comm values (truncated to 15 characters)
    boot_framebuffers: Mapping[str, Tuple[str, ...]]  # BDF -> BOOTFB/efifb/... owners in iomem
    iommu_units: Tuple[str, ...]
    #: SELinux as libvirt's hooks meet it (None: SELinux is not on, ``sys/fs/selinux/enforce`` is absent)
    selinux: "Optional[SelinuxFacts]" = None

    @property
    def cmdline_args(self) -> Dict[str, str]:
        out: Dict[str, str] = {}
        for tok in self.cmdline.split():
            k, _, v = tok.partition("=")
            out[k] = v
        return out

    def running(self, name: str) -> bool:
        """A process named ``name`` runs (``comm`` holds at most 15 characters)."""
        return name[:15] in self.processes

    def module_present(self, name: str) -> bool:
        return name in self.modules_loaded or name in self.modules_builtin


@record(frozen=True)
class Inventory:
    """A snapshot of one host (values only; compare and serialise freely)."""

    devices: Mapping[PciAddress, PciDevice]
    groups: Mapping[int, IommuGroup]
    gpus: Tuple[Gpu, ...]
    vgpu_types: Tuple[VgpuType, ...]
    mdevs: Tuple[MdevDevice, ...]
    vf_vgpus: Tuple[VfVgpu, ...]
    host: HostFacts
    #: GPUs out of service (unhealthy or cordoned; :mod:`vgpuhost.ops.health` sets it from the state store):
    #: GPU -> the reason line.  They offer no free instance (:func:`free_instances`); what they hold is listed.
    out_of_service: Mapping[PciAddress, str] = field(default_factory=dict)
    #: vendor-VFIO VFs reserved for an incoming live migration (:func:`vgpuhost.ops.health.in_service` sets
    #: it from the state store): VF -> the type id reserved.  Such a VF lists no type (the caller drops its
    #: rows) and counts as holding a vGPU of that type (:attr:`GpuIndex.present`), so every count of its GPU
    #: (placement, ``types``, ``capacity``, the exporter) treats the reserved instance as taken.
    reserved: Mapping[PciAddress, str] = field(default_factory=dict)

    @property
    def iommu_enabled(self) -> bool:
        return bool(self.groups)

    def gpu(self, address: PciAddress) -> Optional[Gpu]:
        by_address = self.__dict__.get("_by_address")
        if by_address is None:      # a cache, not a field (one pass over the GPUs, not their types)
            by_address = {g.address: g for g in self.gpus}
            object.__setattr__(self, "_by_address", by_address)
        return by_address.get(address)

    def types_of(self, address: PciAddress) -> Tuple[VgpuType, ...]:
        """The :attr:`vgpu_types` rows of the GPU at ``address``, in their order (empty: none); the rows
        are grouped by GPU once, on the first call (:func:`with_gpu` hands the grouping on)."""
        return self._type_runs().get(address, ())

    def _type_runs(self) -> Dict[PciAddress, Tuple[VgpuType, ...]]:
        runs = self.__dict__.get("_runs")
        if runs is None:    # a cache, not a field (as _index)
            runs = _group_rows(self.vgpu_types)
            object.__setattr__(self, "_runs", runs)
        return runs

    def on_gpu(self, address: PciAddress) -> Optional[GpuIndex]:
        """The :class:`GpuIndex` of the GPU at ``address`` (None: no such GPU), built once for all GPUs."""
        index = self.__dict__.get("_index")
        if index is None:
            index = _build_index(self)
            object.__setattr__(self, "_index", index)   # a cache, not a field: equality and replace() ignore it
        return index.get(address)

    def group_of(self, address: PciAddress) -> Optional[IommuGroup]:
        dev = self.devices.get(address)
        if dev is None or dev.iommu_group is None:
            return None
        return self.groups.get(dev.iommu_group)


class GpuIndex:
    """What one GPU holds, gathered once per :class:`Inventory` (:meth:`Inventory.on_gpu`).

    ``types``: its :class:`VgpuType` rows in sysfs order (one per parent and
    type); ``by_type``: type id -> those rows; ``framebuffer_of``: type id ->
    framebuffer MiB (None: unknown) of each listed type; ``time_sliced``: the
    listed type ids that are not MIG-backed; ``present``: the type id of every
    vGPU on it (mdevs on its parents, then vendor-VFIO VFs holding a type);
    ``vgpus``: the mdev UUIDs and VF addresses (str) of those vGPUs; ``reserved``: the VFs (str) whose type
    counts in ``present`` because an incoming live migration reserved them (:attr:`Inventory.reserved`).
    """

    __slots__ = ("gpu", "types", "by_type", "framebuffer_of", "time_sliced", "present", "vgpus", "reserved")

    def __init__(self, gpu: Gpu):
        self.gpu = gpu
        self.types: List[VgpuType] = []
        self.by_type: Dict[str, List[VgpuType]] = {}
        self.framebuffer_of: Dict[str, Optional[int]] = {}
        self.time_sliced: set = set()
        self.present: List[str] = []
        self.vgpus: List[str] = []
        self.reserved: List[str] = []


def _group_rows(rows) -> Dict[PciAddress, Tuple[VgpuType, ...]]:
    """``{GPU: its rows of rows, in order}``; a GPU's rows come together (one lookup per run of them)."""
    out: Dict[PciAddress, List[VgpuType]] = {}
    gpu = run = None
    for t in rows:
        if t.gpu is not gpu:
            gpu = t.gpu
            run = out.get(gpu)
            if run is None:
                run = out[gpu] = []
        run.append(t)
    return {g: tuple(r) for g, r in out.items()}


def _build_index(inv: "Inventory", only: Optional[Gpu] = None) -> Dict[PciAddress, GpuIndex]:
    """One pass over the inventory's types, mdevs and VFs: cost linear in devices.  ``only``: the index of
    that one GPU (its rows looked up, :meth:`Inventory.types_of`)."""
    out = {g.address: GpuIndex(g) for g in (inv.gpus if only is None else (only,))}
    gpu = ix = None
    for t in (inv.vgpu_types if only is None else inv.types_of(only.address)):
        if t.gpu is not gpu:        # a GPU's rows come together: one lookup per run of them
            gpu = t.gpu
            ix = out.get(gpu)
        if ix is not None:
            ix.types.append(t)
            rows = ix.by_type.get(t.type_id)
            if rows is None:
                rows = ix.by_type[t.type_id] = []
                if not (t.profile and t.profile.mig_backed):
                    ix.time_sliced.add(t.type_id)
            rows.append(t)
            ix.framebuffer_of[t.type_id] = t.framebuffer_mib
    parent_gpu = {p: ix for ix in out.values() for p in ix.gpu.mdev_parents}
    for m in inv.mdevs:
        ix = parent_gpu.get(m.parent)
        if ix is not None:
            ix.present.append(m.type_id)
            ix.vgpus.append(m.uuid)
    for v in inv.vf_vgpus:
        ix = out.get(v.gpu)
        if ix is not None and v.type_id:
            ix.present.append(v.type_id)
            ix.vgpus.append(str(v.vf))
        elif ix is not None and v.vf in inv.reserved:
            ix.present.append(inv.reserved[v.vf])      # promised to an incoming migration: taken
            ix.reserved.append(str(v.vf))
    return out


def gpu_available(inv: "Inventory", gpu: PciAddress, type_id: str,
                  framebuffers: Optional[Mapping[str, int]] = None) -> int:
    """Free instances of ``type_id`` on one GPU: the count of :func:`free_instances`."""
    return free_instances(inv, gpu, type_id, framebuffers)[0]


def free_instances(inv: "Inventory", gpu: PciAddress, type_id: str,
                   framebuffers: Optional[Mapping[str, int]] = None, *, name: Optional[str] = None,
                   limit: Optional[int] = None) -> Tuple[int, str]:
    """``(n, why)``: free instances of ``type_id`` on one GPU, and why there are none.

    The one capacity rule: ``vgpuhost types``, placement offers and the
    refusals' "types that still fit" all count with it.  ``why`` is "" when
    ``n`` > 0, else one phrase (``bound to vfio-pci (passed through): release
    it first``, ``holds 8192 MiB vGPUs; equal-size mode admits only that
    size``, ``no A40-8Q instance free``).

    - A GPU out of service (``inv.out_of_service``: unhealthy or cordoned,
      :mod:`vgpuhost.ops.health`) offers nothing.
    - A GPU not on the ``nvidia`` driver offers nothing (the NVIDIA vGPU
      manager serves vGPUs only from it), nor does a vendor-VFIO GPU behind
      Intel VMD (its VFs cannot be assigned: docs/reference/hardware.md#intel-vmd).
    - Otherwise the kernel's per-parent counts are summed.  On SR-IOV GPUs
      every free VF reports 1 for each type that fits now, so that sum counts
      free VFs, and it is capped (docs/reference/hardware.md#vgpu-types):
      time-sliced mdev types by the type's max instances (``max_instance`` in
      the description) less the present vGPUs of the same framebuffer size;
      time-sliced vendor-VFIO types (no max in sysfs) by the board
      framebuffer left over (board size from the device id, else the largest
      type) divided by the type's framebuffer; MIG-backed types by the GPU
      instances of the type's GPU-instance profile (``Gpu.gpu_instances``,
      from NVML) less the MIG-backed vGPUs on them: each GPU instance holds
      one (docs/reference/hardware.md#mig-profiles).  Where NVML gives no
      count (not read, or no GPU instance of that profile listed) the
      kernel's stands.
    - ``framebuffers`` maps type ids not listed now (a full GPU hides them)
      to MiB; ``name`` names such a type in ``why`` (default: the listed
      name, else the type id).
    - ``limit``: the type's max in the GPU's vGPU mode
      (:func:`vgpuhost.policy.config.mode_limits`; mixed-size maxima are
      often lower than equal-size ones, docs/reference/hardware.md#vgpu-types):
      ``n`` is at most that max less the vGPUs of the type present.
    """
    ix = inv.on_gpu(gpu)
    if ix is None:
        return 0, f"no NVIDIA GPU at {gpu}"
    if gpu in inv.out_of_service:
        return 0, f"out of service: {inv.out_of_service[gpu]} ('vgpuhost gpu uncordon {gpu}' after repair)"
    g = ix.gpu
    ts = ix.by_type.get(type_id, ())
    name = ts[0].name if ts else (name or type_id)
    if g.pci.driver != "nvidia":
        return 0, (f"bound to {g.pci.driver} (passed through): release it first" if g.pci.driver
                   else "bound to no driver (the NVIDIA vGPU manager needs nvidia)")
    if g.vmd is not None and g.vgpu_backend == BACKEND_VENDOR_VFIO:
        return 0, (f"behind Intel VMD {g.vmd}: its VFs share the VMD's IOMMU group, so none can be given "
                   "to a VM (docs/reference/hardware.md#intel-vmd)")
    total = sum(t.available_instances for t in ts)
    n = _capped(ix, ts, total, framebuffers) if ts and g.vfs else total
    if n > 0 and limit is not None:
        same = sum(1 for t in ix.present if t == type_id)
        n = min(n, max(0, limit - same))
        if not n:
            return 0, f"{same} of {limit} {name} present, the most this GPU's vGPU mode allows"
    if n > 0:
        return n, ""
    fb = ts[0].framebuffer_mib if ts else (framebuffers or {}).get(type_id)
    return 0, _why_none(ix, ts, name, fb, framebuffers)


def _capped(ix: GpuIndex, ts: "List[VgpuType]", total: int, framebuffers: Optional[Mapping[str, int]]) -> int:
    """The kernel's sum over the VFs of an SR-IOV GPU, capped as :func:`free_instances` says."""
    g = ix.gpu
    profile = ts[0].profile
    if profile is not None and profile.mig_backed:
        free = _free_gpu_instances(ix, profile) if g.gpu_instances is not None else None
        return total if free is None else max(0, min(total, free))
    fb_of: Dict[str, Optional[int]] = dict(framebuffers or {})
    fb_of.update(ix.framebuffer_of)
    sliced = ix.time_sliced
    present = [p for p in ix.present if p in sliced or p not in fb_of or p in (framebuffers or {})]
    fb = ts[0].framebuffer_mib
    if ts[0].max_instances is not None:
        same = sum(1 for p in present if fb_of.get(p) == fb)
        return max(0, min(total, ts[0].max_instances - same))
    board = g.framebuffer_mib or max((fb_of[t] or 0) for t in sliced)
    if not fb or not board:
        return total
    used = sum(fb_of.get(p) or 0 for p in present)
    return max(0, min(total, (board - used) // fb))


def _gi_key(slices: Optional[int], gb: int, suffix: str) -> Tuple[Optional[int], int, str]:
    return (slices, gb, suffix)


def _free_gpu_instances(ix: GpuIndex, profile: VgpuProfile) -> Optional[int]:
    """GPU instances of ``profile``'s GPU-instance profile (same slices, GB and suffix) not holding a vGPU;
    None when NVML lists none of that profile although the kernel offers the type (NVML's view is
    incomplete: the kernel's count stands)."""
    from ..model.values import MigProfile
    from ..model.errors import InputError
    want = _gi_key(profile.gi_slices, profile.framebuffer_gb, profile.gi_suffix)
    have = 0
    for gi_name, count in (ix.gpu.gpu_instances or {}).items():
        try:
            mp = MigProfile.parse(gi_name)
        except InputError:
            continue
        if _gi_key(mp.slices, mp.memory_gb, mp.suffix) == want:
            have += count
    if not have:
        return None
    used = 0
    for tid in ix.present:
        rows = ix.by_type.get(tid)
        p = rows[0].profile if rows else None
        if p is not None and p.mig_backed and _gi_key(p.gi_slices, p.framebuffer_gb, p.gi_suffix) == want:
            used += 1
    return have - used


def _why_none(ix: GpuIndex, ts: "List[VgpuType]", name: str, fb: Optional[int],
              framebuffers: Optional[Mapping[str, int]]) -> str:
    """Why a GPU on nvidia has no free ``name`` (``fb`` MiB): equal-size mode, no free GPU instance, or
    full; with :func:`unread_note` when some of its VFs or mdev parents could not be read (what they
    offer is unknown, so "full" would mislead)."""
    profile = ts[0].profile if ts else VgpuProfile.try_parse(name)
    if profile is not None and profile.mig_backed:
        if ts and ix.gpu.gpu_instances:
            return f"no free GPU instance for {name} (each holds one MIG-backed vGPU)"
        return f"no {name} instance free" + unread_note(ix.gpu)
    sizes = sorted({f for f in present_framebuffers(ix, framebuffers or {}) if f})
    if len(sizes) > 1:          # sizes side by side: the GPU is in mixed-size mode, where sizes mix
        return (f"holds {'/'.join(str(x) for x in sizes)} MiB vGPUs in mixed-size mode: no placement id "
                f"free for {name}" + unread_note(ix.gpu))
    if sizes and fb not in sizes:
        return f"holds {'/'.join(str(x) for x in sizes)} MiB vGPUs; equal-size mode admits only that size"
    held = (f" ({len(ix.reserved)} reserved for incoming migrations: VF {', '.join(ix.reserved)})"
            if ix.reserved else "")
    return f"no {name} instance free" + held + unread_note(ix.gpu)


def unread_note(gpu: "Gpu") -> str:
    """``"; 4 of its 4 VFs could not be read (creatable_vgpu_types: EINVAL), so ..."`` when discovery
    went on without some of ``gpu``'s VFs or mdev parents (docs/reference/hardware.md#vendor-vfio), else ""."""
    if not gpu.unreadable:
        return ""
    return f"; {unread_count(gpu)}, so what they offer is unknown: read again later ('vgpuhost host check' says more)"


def unread_count(gpu: "Gpu") -> str:
    """``4 of its 4 VFs could not be read (creatable_vgpu_types: EINVAL)`` (``gpu.unreadable`` not empty)."""
    u = gpu.unreadable[0]
    whose = f"of its {len(gpu.vfs)} VFs" if gpu.vfs else "of its mdev parents"
    return f"{len(gpu.unreadable)} {whose} could not be read ({u.attribute}: {u.errno_name})"


def present_framebuffers(ix: GpuIndex, fbs: Mapping[str, int]) -> List[Optional[int]]:
    """Framebuffer (MiB) of each time-sliced vGPU present on the GPU of ``ix`` (None: unknown type)."""
    out: List[Optional[int]] = []
    for i in ix.present:
        rows = ix.by_type.get(i)
        if rows and rows[0].profile is not None and rows[0].profile.mig_backed:
            continue
        out.append(rows[0].framebuffer_mib if rows else fbs.get(i))
    return out


# ---------------------------------------------------------------------------
# discovery



#: :func:`discover` scopes: the whole host, or only what vGPU types and capacity need
SCOPE_HOST = "host"
SCOPE_VGPU = "vgpu"


def discover(fs: Sysfs, *, mig_probe: Optional[MigProbe] = None, with_types: bool = True,
             gi_probe: Optional[GiProbe] = None, scope: str = SCOPE_HOST, host_facts: bool = True) -> Inventory:
    """Read the host under ``fs.host`` into an :class:`Inventory`.

    ``mig_probe`` (the NVML seam) returns MIG facts for a GPU or None.
    ``gi_probe`` returns a GPU's GPU instances per profile name or None
    (default :func:`nvml_gpu_instances`); it is asked only about SR-IOV GPUs
    whose VFs offer a MIG-backed type now (:attr:`Gpu.gpu_instances`).
    ``scope`` :data:`SCOPE_VGPU` reads only what vGPU types and capacity
    need (``vgpuhost types``): ``gpus``, ``vgpu_types``, ``mdevs`` and
    ``vf_vgpus`` are what the whole-host scope reads, but ``devices`` holds
    only the GPUs, ``groups`` only theirs, and ``host`` is empty (no /proc,
    no modules); a device is skipped once its vendor is not NVIDIA, a VF is
    known from its PF's ``virtfn`` links.
    ``host_facts``: False leaves ``host`` unread (:data:`UNREAD_HOST_FACTS`):
    no ``/proc`` walk (a read of every process's ``comm``), cmdline,
    cpuinfo or module lists, which only passthrough's checks use (the qemu
    hook's vGPU starts skip them).
    Raises SysfsError when a file that must be readable is not.
    """
    host = fs.host
    lean = scope == SCOPE_VGPU
    if not lean and scope != SCOPE_HOST:
        raise ValueError(f"unknown discovery scope {scope!r}")
    # paths as strings in the loops below: a pathlib join per attribute cost milliseconds per discovery
    pci_devices = host.s.pci_devices
    devices: Dict[PciAddress, PciDevice] = {}
    names = fs.listdir(pci_devices)
    present_names = set(names)
    resolved: Dict[PciAddress, str] = {}      # device -> its directory, symlinks resolved (read once)
    vf_names: set = set()
    for name in names:
        if not PciAddress.is_valid(name):
            continue
        if lean:
            # a VF comes after its PF in address order (its routing id is the PF's plus an offset)
            if name in vf_names or not _nvidia_display(fs, f"{pci_devices}/{name}/"):
                continue
        dev = _read_device(fs, PciAddress.parse(name), resolved)
        devices[dev.address] = dev
        if lean:
            vf_names.update(str(v) for v in dev.virtfns)

    groups: Dict[int, IommuGroup] = {}
    iommu_groups = host.s.iommu_groups
    wanted_groups = {d.iommu_group for d in devices.values()} if lean else None
    for name in fs.listdir(iommu_groups) if not lean else sorted(str(g) for g in wanted_groups if g is not None):
        if not is_digits(name):
            continue
        members = tuple(sorted(PciAddress.parse(m) for m in fs.listdir(f"{iommu_groups}/{name}/devices")
                               if PciAddress.is_valid(m)))
        groups[int(name)] = IommuGroup(int(name), members)

    mdev_parents = {PciAddress.parse(n) for n in fs.listdir(host.s.mdev_bus) if PciAddress.is_valid(n)}
    vgpu_types: List[VgpuType] = []
    vf_vgpus: List[VfVgpu] = []
    gpus: List[Gpu] = []
    for addr in sorted(devices):
        dev = devices[addr]
        if dev.vendor != NVIDIA_VENDOR or not dev.is_display or dev.is_vf:
            continue
        vfs = tuple(v for v in dev.virtfns if (str(v) in present_names if lean else v in devices))
        parents = tuple(p for p in (addr,) + vfs if p in mdev_parents)
        vendor_vfs = vendor_vgpu_vfs(fs, vfs)
        gpus.append(_gpu_value(fs, addr, dev, vfs, parents, vendor_vfs, groups, with_types, vgpu_types,
                               vf_vgpus, mig_probe(addr) if mig_probe else None, gi_probe or nvml_gpu_instances,
                               real=resolved.get(addr)))

    mdevs = tuple(_read_mdevs(fs))
    return Inventory(devices=devices, groups=groups, gpus=tuple(gpus), vgpu_types=tuple(vgpu_types),
                     mdevs=mdevs, vf_vgpus=tuple(vf_vgpus),
                     host=UNREAD_HOST_FACTS if lean or not host_facts else read_host_facts(fs))


def _nvidia_display(fs: Sysfs, d: str) -> bool:
    """Whether the device at ``d`` (its sysfs directory, with a trailing slash) is an NVIDIA display function."""
    if fs.read_int(d + "vendor", default=0) != NVIDIA_VENDOR:
        return False
    return ((fs.read_int(d + "class", default=0) or 0) >> 16) == 0x03


#: host facts of an inventory discovered with ``host_facts=False`` (nothing read: every field empty)
UNREAD_HOST_FACTS = HostFacts(cmdline="", cpu_vendor=None, cpu_virt_flags=frozenset(), kernel_release=None,
                              modules_loaded=frozenset(), modules_builtin=frozenset(),
                              modules_available=frozenset(), interrupt_remapping=None, processes=frozenset(),
                              boot_framebuffers={}, iommu_units=())


def _gpu_value(fs: Sysfs, addr: PciAddress, dev: PciDevice, vfs: Tuple[PciAddress, ...],
               parents: Tuple[PciAddress, ...], vendor_vfs: Tuple[PciAddress, ...],
               groups: Dict[int, IommuGroup], with_types: bool, vgpu_types: List[VgpuType],
               vf_vgpus: List[VfVgpu], mig: Any, gi_probe: Any,
               known: Optional[Dict[str, VgpuType]] = None, real: Optional[str] = None,
               only: Optional[frozenset] = None, prior: Optional[Dict[PciAddress, Dict[str, VgpuType]]] = None
               ) -> Gpu:
    """One GPU of an inventory, shared by :func:`discover` and :func:`discover_gpu`: reads its types
    (appended to ``vgpu_types``; vendor-VFIO VFs to ``vf_vgpus``) and, where a MIG-backed type is
    offered on VFs, its GPU instances through ``gi_probe``.  ``known``: mdev type id -> a row of this
    GPU read before, whose constants (name, description, device_api) are not read again.  ``real``: the GPU's
    directory with symlinks resolved, where the caller has it (:func:`_read_device` resolved it).
    ``only`` and ``prior``: see :func:`_read_mdev_types`."""
    backend = BACKEND_MDEV if parents else (BACKEND_VENDOR_VFIO if vendor_vfs else None)
    types_here: List[VgpuType] = []
    unreadable: List[Unreadable] = []
    if with_types:
        consts: Dict[str, VgpuType] = dict(known or {})   # a type's name, description, device_api: the same on every parent
        reals = _real_dirs(fs, addr, parents, real) if len(parents) > 1 else {}
        for p in parents:
            try:
                types_here.extend(_read_mdev_types(fs, addr, p, consts, reals.get(p), only, prior))
            except SysfsError as e:         # that parent offers nothing; the others are read
                unreadable.append(_unreadable(p, e))
        for vf in vendor_vfs:
            vv, tt, bad = _read_vendor_vf(fs, addr, vf)
            vf_vgpus.append(vv)
            types_here.extend(tt)
            if bad is not None:
                unreadable.append(bad)
    vgpu_types.extend(types_here)
    board = next((t.profile.board for t in types_here if t.profile), None)
    backends: List[str] = []
    if dev.iommu_group is not None:
        backends.append("passthrough")
    if backend:
        backends.append(backend)
    g = groups.get(dev.iommu_group) if dev.iommu_group is not None else None
    companions = tuple(m for m in (g.members if g else ())
                       if m != addr and m.slot_address == addr.slot_address)
    gis = None
    # (the profile's gi_slices, what VgpuProfile.mig_backed says, read without a call per row: a GPU of
    # 16 vendor-VFIO VFs lists some 500 rows, all re-read after each write the agent makes there)
    # (with ``only``, the rows whose counts were read now: the others are a look's, not the host's now)
    if vfs and any(t.available_instances > 0 for t in types_here
                   if t.profile is not None and t.profile.gi_slices is not None
                   and (only is None or t.backend != BACKEND_MDEV or t.type_id in only)):
        gis = gi_probe(fs, addr)
    vmd = dev.domain_host if dev.domain_host is not None and fs.read_int(
        fs.host.s.pci_device(dev.domain_host) + "/vendor", default=0) == INTEL_VENDOR else None
    return Gpu(addr, dev, board, backend, tuple(backends), vfs, parents, companions, mig, gis, tuple(unreadable),
               vmd)


def discover_gpu(fs: Sysfs, gpu: PciAddress, *, with_types: bool = True, host_facts: bool = True,
                 known: Optional[Inventory] = None, only: Optional[frozenset] = None) -> Inventory:
    """Read one GPU under ``fs.host`` into an :class:`Inventory` that holds only it.

    What :func:`discover` reads about ``gpu`` and nothing about any other GPU:
    ``devices`` holds the GPU's physical function, its SR-IOV VFs and the other
    members of their IOMMU groups; ``groups`` those groups and the groups of
    the GPU's mdevs; ``gpus`` the one
    :class:`Gpu` (empty when ``gpu`` is no NVIDIA display physical function);
    ``vgpu_types``, ``mdevs`` and ``vf_vgpus`` the GPU's.  Each record equals
    the one a whole-host :func:`discover` gives for this GPU.  The mdevs are
    found as children of their parent device's directory (the kernel puts an
    mdev's directory under its parent, docs/reference/hardware.md#mdev), or, where
    the host's mdevs are few beside the GPU's parents (an SR-IOV GPU's 16 to 32
    VFs), from the mdev bus's listing as :func:`discover` finds them, each
    link's target naming its parent: one listing instead of one per parent.
    ``host_facts``: False leaves the host
    facts unread (:data:`UNREAD_HOST_FACTS`), for callers that never look at
    them (a vGPU create).  ``known``: an inventory read a moment before (the
    look a re-check under the GPU's lock checks): the constants of this GPU's
    mdev types in it (name, description, device_api: fixed by the driver for
    a type id) are taken from it, and only each type's ``available_instances``
    and the vGPUs present are read again; a type it does not hold is read whole.
    Likewise a PCI function it holds has only what can change while the device
    stays (:func:`_reread_device`: its driver, ``driver_override``, SR-IOV VFs)
    read again; its identity, NUMA node, group and place in the topology are
    the device's for as long as it is present.
    ``only`` (with ``known``): the mdev type ids whose ``available_instances``
    are read again; every other type an mdev parent lists keeps ``known``'s row
    (count included), and each VF the physical function lists now that
    ``known`` holds keeps ``known``'s PCI record and IOMMU group (its driver
    and ``driver_override`` not read again; the physical function, its group,
    the mdev parents, vendor-VFIO VFs and the vGPUs present are).  For a
    re-check under the GPU's lock that decides on those types alone
    (:func:`vgpuhost.ops.vgpu.create_vgpu`: an A100 with 20 VFs lists 12 types
    on each, 240 counts, of which the wanted type is 20; what placement weighs
    is the GPU's driver, its mdev parents, the counts of the wanted type and
    the vGPUs present); the result then is no whole read.
    Cost: proportional to the GPU's VFs and types, not
    to the host.  For an operation on one GPU, under that GPU's lock.
    Raises SysfsError when a file that must be readable is not.
    """
    host = fs.host
    pci_devices = host.s.pci_devices
    devices: Dict[PciAddress, PciDevice] = {}
    groups: Dict[int, IommuGroup] = {}
    iommu_groups = host.s.iommu_groups

    before = known.devices if known is not None else {}

    def read(addr: PciAddress, *, kept: bool = False) -> Optional[PciDevice]:
        if addr not in devices:
            seen = before.get(addr)
            if seen is not None and kept:
                devices[addr] = seen            # (only=) a VF its PF lists now: the look's record
            elif seen is not None:
                dev = _reread_device(fs, seen)      # None: gone (its driver_override with it)
                if dev is None:
                    return None
                devices[addr] = dev
            elif not fs.exists(f"{pci_devices}/{addr}"):
                return None
            else:
                devices[addr] = _read_device(fs, addr)
        return devices[addr]

    def group(number: Optional[int], *, kept: bool = False) -> None:
        if number is None or number in groups:
            return
        if kept and number in known.groups:
            groups[number] = known.groups[number]   # (only=) a VF's group: the look's
            for m in groups[number].members:
                read(m, kept=True)
            return
        names = fs.listdir(f"{iommu_groups}/{number}/devices")
        # (the group's directory looked for only when it lists no device: one listing, not a stat first)
        if not names and not fs.exists(f"{iommu_groups}/{number}"):
            return
        members = tuple(sorted(PciAddress.parse(m) for m in names if PciAddress.is_valid(m)))
        groups[number] = IommuGroup(number, members)
        for m in members:
            read(m)

    dev = read(gpu)
    gpus: List[Gpu] = []
    vgpu_types: List[VgpuType] = []
    vf_vgpus: List[VfVgpu] = []
    mdevs: List[MdevDevice] = []
    if dev is not None and dev.vendor == NVIDIA_VENDOR and dev.is_display and not dev.is_vf:
        narrow = only is not None and known is not None
        vfs = tuple(v for v in dev.virtfns if read(v, kept=narrow) is not None)
        group(dev.iommu_group)
        for v in vfs:
            group(devices[v].iommu_group, kept=narrow)
        mdev_bus = host.s.mdev_bus
        if len(vfs) > 2:
            # the mdev parents from one listing of class/mdev_bus (as discover reads them), not a stat each
            listed = set(fs.listdir(mdev_bus))
            parents = tuple(p for p in (gpu,) + vfs if str(p) in listed)
        else:
            parents = tuple(p for p in (gpu,) + vfs if fs.exists(f"{mdev_bus}/{p}"))
        vendor_vfs = vendor_vgpu_vfs(fs, vfs)
        seed = prior = None
        if known is not None:
            seed, prior = _mdev_rows_of(known.types_of(gpu))
        gpus.append(_gpu_value(fs, gpu, dev, vfs, parents, vendor_vfs, groups, with_types, vgpu_types,
                               vf_vgpus, None, nvml_gpu_instances, seed,
                               only=only if prior is not None else None, prior=prior))
        mdevs = _read_mdevs_of(fs, parents)
        for m in mdevs:
            group(m.iommu_group)        # an mdev's own group (no PCI member), as discover lists it
    return Inventory(devices=devices, groups=groups, gpus=tuple(gpus), vgpu_types=tuple(vgpu_types),
                     mdevs=tuple(mdevs), vf_vgpus=tuple(vf_vgpus),
                     host=read_host_facts(fs) if host_facts else UNREAD_HOST_FACTS)


def discover_named(fs: Sysfs, bdfs: "Tuple[PciAddress, ...]", mdev_uuids: "Tuple[str, ...]") -> Inventory:
    """Read only what a domain's hostdevs name (:func:`vgpuhost.policy.hostdevs.check_hostdevs` weighs it),
    for a start :func:`discover` is not run for (a domain with no vgpuhost devices of its own).

    ``devices``: each PCI function ``bdfs`` names that exists, the members of its IOMMU group and its
    physical function (a VF's PF); ``groups``: those groups; ``mdevs``: each of ``mdev_uuids`` that
    exists on the host, its parent device read as above.  ``gpus``, ``vgpu_types`` and ``vf_vgpus``
    are empty and the host facts unread.  Cost: a few files per named device, none per host device.
    Raises SysfsError when a file that must be readable is not.
    """
    host = fs.host
    pci_devices, iommu_groups = host.s.pci_devices, host.s.iommu_groups
    devices: Dict[PciAddress, PciDevice] = {}
    groups: Dict[int, IommuGroup] = {}

    def read(addr: PciAddress, *, kin: bool = True) -> None:
        if addr in devices or not fs.exists(f"{pci_devices}/{addr}"):
            return
        dev = devices[addr] = _read_device(fs, addr)
        if not kin:
            return
        if dev.physfn is not None:
            read(dev.physfn)
        n = dev.iommu_group
        if n is not None and n not in groups and fs.exists(f"{iommu_groups}/{n}"):
            members = tuple(sorted(PciAddress.parse(m) for m in fs.listdir(f"{iommu_groups}/{n}/devices")
                                   if PciAddress.is_valid(m)))
            groups[n] = IommuGroup(n, members)
            for m in members:
                read(m, kin=False)

    for b in bdfs:
        read(b)
    mdevs: List[MdevDevice] = []
    base = host.s.mdev_devices
    for uuid in mdev_uuids:
        m = _mdev_at(fs, base, uuid) if fs.exists(f"{base}/{uuid}") else None
        if m is not None:
            mdevs.append(m)
            read(m.parent)
    return Inventory(devices=devices, groups=groups, gpus=(), vgpu_types=(), mdevs=tuple(mdevs), vf_vgpus=(),
                     host=UNREAD_HOST_FACTS)


def nvidia_gpus(fs: Sysfs) -> Tuple[PciAddress, ...]:
    """The NVIDIA display physical functions under ``fs.host``, sorted: each PCI function's ``vendor``
    and ``class`` read (a VF is skipped by its ``physfn`` link), nothing else, no IOMMU group, no
    ``/proc``.  What :func:`discover_gpus` is given for a request that may go to any GPU.
    Cost: two or three small reads per PCI function."""
    pci_devices = fs.host.s.pci_devices
    out = []
    for name in fs.listdir(pci_devices):
        if not PciAddress.is_valid(name):
            continue
        d = f"{pci_devices}/{name}/"
        if _nvidia_display(fs, d) and not fs.link_name(d + "physfn"):
            out.append(PciAddress.parse(name))
    return tuple(sorted(out))


def discover_gpus(fs: Sysfs, gpus: "Tuple[PciAddress, ...]", *, named_pci: "Tuple[PciAddress, ...]" = (),
                  named_mdevs: "Tuple[str, ...]" = (), host_facts: bool = True) -> Inventory:
    """Read only ``gpus`` (each as :func:`discover_gpu` reads it) and the devices a domain's hostdevs
    name (``named_pci``, ``named_mdevs``: as :func:`discover_named` reads them) into one
    :class:`Inventory`: what the qemu hook's ``prepare begin`` decides on (the GPUs the domain's
    devices may use), never a whole-host read.  Each GPU's records equal those a whole-host
    :func:`discover` gives; ``gpus`` sorted by address; an address that is no NVIDIA GPU adds its
    device (and its group's) only.  ``host_facts``: as :func:`discover_gpu` (read once).
    Cost: proportional to the GPUs named and their VFs and types, not to the host.
    Raises SysfsError when a file that must be readable is not."""
    parts = [discover_gpu(fs, g, host_facts=False) for g in sorted(set(gpus))]
    # a named device a GPU's read holds already (its VF, its mdev) is not read again
    have = {a for p in parts for a in p.devices}
    have_mdevs = {m.uuid for p in parts for m in p.mdevs}
    named_pci = tuple(a for a in named_pci if a not in have)
    named_mdevs = tuple(u for u in named_mdevs if u not in have_mdevs)
    if named_pci or named_mdevs:
        parts.append(discover_named(fs, named_pci, named_mdevs))
    devices: Dict[PciAddress, PciDevice] = {}
    groups: Dict[int, IommuGroup] = {}
    mdevs: Dict[str, MdevDevice] = {}
    found: List[Gpu] = []
    types: List[VgpuType] = []
    vf_vgpus: List[VfVgpu] = []
    for p in parts:
        for a, d in p.devices.items():
            devices.setdefault(a, d)
        for n, grp in p.groups.items():
            groups.setdefault(n, grp)
        for m in p.mdevs:
            mdevs.setdefault(m.uuid, m)
        found.extend(p.gpus)
        types.extend(p.vgpu_types)
        vf_vgpus.extend(p.vf_vgpus)
    return Inventory(devices={a: devices[a] for a in sorted(devices)}, groups=groups, gpus=tuple(found),
                     vgpu_types=tuple(types), mdevs=tuple(mdevs[u] for u in sorted(mdevs)),
                     vf_vgpus=tuple(vf_vgpus), host=read_host_facts(fs) if host_facts else UNREAD_HOST_FACTS)


def gpu_part(inv: Inventory, gpu: PciAddress) -> Inventory:
    """The part of ``inv`` that one GPU holds, shaped as :func:`discover_gpu`
    returns it (its PF, VFs and their groups' devices; its types, vGPUs; the host facts kept).
    One pass over ``inv``'s devices, mdevs and VFs; the GPU's type rows are looked up
    (:meth:`Inventory.types_of`), not searched for among the host's."""
    g = inv.gpu(gpu)
    if g is None:
        return Inventory(devices={}, groups={}, gpus=(), vgpu_types=(), mdevs=(), vf_vgpus=(), host=inv.host)
    parents = set(g.mdev_parents)
    mdevs = tuple(m for m in inv.mdevs if m.parent in parents)
    numbers = {inv.devices[a].iommu_group for a in (gpu,) + g.vfs if a in inv.devices}
    numbers |= {m.iommu_group for m in mdevs}
    groups = {n: inv.groups[n] for n in numbers if n is not None and n in inv.groups}
    members = {gpu, *g.vfs, *(m for grp in groups.values() for m in grp.members)}
    rows = inv.types_of(gpu)
    part = Inventory(devices={a: d for a, d in inv.devices.items() if a in members}, groups=groups, gpus=(g,),
                     vgpu_types=rows, mdevs=mdevs,
                     vf_vgpus=tuple(v for v in inv.vf_vgpus if v.gpu == gpu), host=inv.host,
                     out_of_service={a: r for a, r in inv.out_of_service.items() if a == gpu})
    # the GPU's run of rows (the same tuple: what is kept per run, policy.offers.types_by_gpu, serves the
    # part too) and, with no VF reserved (the part holds no reservation), its GpuIndex, not built again
    object.__setattr__(part, "_runs", {gpu: rows} if rows else {})
    index = inv.__dict__.get("_index")
    if index is not None and not inv.reserved and gpu in index:
        object.__setattr__(part, "_index", {gpu: index[gpu]})
    return part


def with_gpu(inv: Inventory, gpu: PciAddress, part: Inventory) -> Optional[Inventory]:
    """``inv`` with what it held of GPU ``gpu`` (:func:`gpu_part`) replaced by ``part``, a
    :func:`discover_gpu` read of that GPU made since: the snapshot a whole-host :func:`discover` would
    give when nothing else changed (records in discover's order: devices by address, groups by number
    as text, GPUs by address, each GPU's types and VFs in its place, mdevs by UUID; ``inv``'s host facts
    kept).  None when the merge cannot be exact: a device the GPU held before is still on the host
    but not in ``part`` (it moved to another GPU's group, say), or ``part`` holds a device or group
    that ``inv`` lists under another GPU.  Cost: one pass over ``inv``'s devices, groups, mdevs and VFs, and
    one per GPU over its type rows' runs (:meth:`Inventory.types_of`), no read."""
    old = gpu_part(inv, gpu)
    if len(part.gpus) > 1 or any(g.address != gpu for g in part.gpus):
        return None
    gone_devices = set(old.devices) - set(part.devices)
    gone_groups = set(old.groups) - set(part.groups)
    # a device or group of the old part that the new one lacks must be gone from the host, which the
    # caller cannot tell without a read: refuse (the caller scans the whole host)
    others = {a for g in inv.gpus if g.address != gpu for a in (g.address,) + g.vfs}
    if gone_devices - {gpu, *(v for g in old.gpus for v in g.vfs)} or (set(part.devices) & others):
        return None
    if gone_groups - {m.iommu_group for m in old.mdevs} - {d.iommu_group for d in old.devices.values()}:
        return None
    devices = {a: d for a, d in inv.devices.items() if a not in gone_devices}
    devices.update(part.devices)
    groups = {n: g for n, g in inv.groups.items() if n not in gone_groups}
    groups.update(part.groups)
    parents = {p for g in old.gpus + part.gpus for p in g.mdev_parents}
    mdevs = [m for m in inv.mdevs if m.parent not in parents] + list(part.mdevs)
    gpus = [g for g in inv.gpus if g.address != gpu] + list(part.gpus)
    gpus.sort(key=lambda g: g.address)
    order = {g.address: i for i, g in enumerate(gpus)}
    # the type rows: each GPU's run of them (Inventory.types_of) kept whole, the GPU's replaced by
    # part's, in the GPUs' order; no row compared (a host of 2,000 rows merged after every write)
    runs = {a: r for a, r in inv._type_runs().items() if a != gpu}
    for a, r in _group_rows(part.vgpu_types).items():
        runs[a] = runs.get(a, ()) + r
    if all(a in order for a in runs):
        types = tuple(t for g in gpus for t in runs.get(g.address, ()))
    else:       # rows of a GPU the inventory does not list (not discover's): first, in their order
        rows = [t for t in inv.vgpu_types if t.gpu != gpu] + list(part.vgpu_types)
        rows.sort(key=lambda t: order.get(t.gpu, -1))          # stable: each GPU's rows keep their order
        types, runs = tuple(rows), None
    vfs = [v for v in inv.vf_vgpus if v.gpu != gpu] + list(part.vf_vgpus)
    vfs.sort(key=lambda v: order.get(v.gpu, -1))
    merged = Inventory(devices={a: devices[a] for a in sorted(devices, key=str)},
                       groups={n: groups[n] for n in sorted(groups, key=str)}, gpus=tuple(gpus),
                       vgpu_types=types, mdevs=tuple(sorted(mdevs, key=lambda m: m.uuid)),
                       vf_vgpus=tuple(vfs), host=inv.host)
    if runs is not None:        # handed on: the next merge into this snapshot looks its GPUs' rows up too
        object.__setattr__(merged, "_runs", {g.address: runs[g.address] for g in gpus if runs.get(g.address)})
        index = inv.__dict__.get("_index")
        mine = {p for g in part.gpus for p in g.mdev_parents}
        if index is not None and not inv.reserved and all(m.parent in mine for m in part.mdevs) \
                and all(v.gpu == gpu for v in part.vf_vgpus):
            # what every other GPU holds (its record, rows, mdevs, VFs) is what it held: its GpuIndex too;
            # the merged GPU's is built anew (Inventory.on_gpu)
            index = {a: ix for a, ix in index.items() if a != gpu and a in order}
            for g in part.gpus:
                index.update(_build_index(merged, g))
            object.__setattr__(merged, "_index", index)
    return merged


def _mdev_rows_of(rows) -> Tuple[Dict[str, VgpuType], Dict[PciAddress, Dict[str, VgpuType]]]:
    """``(type id -> a row, parent -> {type id: its row})`` of a GPU's mdev rows (a parent's rows come
    together: one lookup per parent, not per row)."""
    seed: Dict[str, VgpuType] = {}
    prior: Dict[PciAddress, Dict[str, VgpuType]] = {}
    parent = here = None
    for t in rows:
        if t.backend != BACKEND_MDEV:
            continue
        if t.parent is not parent:
            parent = t.parent
            here = prior.setdefault(parent, {})
        here[t.type_id] = t
        seed.setdefault(t.type_id, t)
    return seed, prior


def _read_mdevs_of(fs: Sysfs, parents: Tuple[PciAddress, ...]) -> List[MdevDevice]:
    """The mdevs on ``parents``, read as :func:`_read_mdevs` reads them (sorted by UUID).

    Found from the mdev bus's listing (each entry's link read: its target's last directory but one is
    the parent, as :func:`_mdev_at` resolves it) where the host holds at most
    :data:`_BUS_PER_PARENT` mdevs per parent asked about, else from each parent's own directory
    (the kernel puts an mdev's directory under its parent's): the fewer calls (an A100's 20 VFs
    with one mdev: one listing and one link, not 20 listings)."""
    base = fs.host.s.mdev_devices
    found = []
    names = fs.listdir(base) if len(parents) > 2 else None
    if names is not None and len(names) <= _BUS_PER_PARENT * len(parents):
        wanted = {str(p): p for p in parents}
        readlink = os.readlink
        for name in names:
            try:
                target = readlink(f"{base}/{name}")
            except OSError:             # gone meanwhile, or no link: _mdev_at says (as _read_mdevs reads it)
                target = None
            if target is not None:
                head = target.rstrip("/").rsplit("/", 2)
                p = wanted.get(head[-2]) if len(head) == 3 else None
                if p is None:
                    continue            # another parent's (its target names it)
                found.append((name, p))
            else:
                m = _mdev_at(fs, base, name)
                if m is not None and str(m.parent) in wanted:
                    found.append((name, m.parent))
    else:
        for p in parents:
            for name in fs.listdir(fs.host.s.pci_device(p)):
                if len(name) == 36 and name.count("-") == 4 and fs.exists(f"{base}/{name}"):
                    found.append((name, p))
    out = []
    for name, p in sorted(found):
        m = _mdev_at(fs, base, name)
        if m is not None and m.parent == p:     # not a bus link that points elsewhere
            out.append(m)
    return out


#: :func:`_read_mdevs_of` reads the mdev bus's listing while it holds at most this many mdevs per parent
_BUS_PER_PARENT = 3


def nvml_gpu_instances(fs: Sysfs, gpu: PciAddress) -> Optional[Dict[str, int]]:
    """``{GPU-instance profile name: count}`` of ``gpu`` from NVML (the simulator's on a
    simulated root); None when NVML cannot say (not loaded, MIG off, any NVML error)."""
    from ..io.backends import open_backend
    from ..model.errors import VgpuhostError
    try:
        backend = open_backend(fs.host)
        names = {p.profile_id: p.name for p in backend.gi_profiles(gpu)}
        out: Dict[str, int] = {}
        for gi in backend.gpu_instances(gpu):
            name = names.get(gi.profile_id)
            if name is None:
                return None
            out[name] = out.get(name, 0) + 1
        return out
    except (VgpuhostError, OSError, ImportError):
        return None


#: the attributes :func:`_read_device` reads of a PCI function, in one pass (``Sysfs.read_attrs_in``)
_DEVICE_ATTRS = ["driver_override", "boot_vga", "reset_method", "vendor", "device", "subsystem_vendor",
                 "subsystem_device", "class", "numa_node", "sriov_totalvfs", "sriov_numvfs"]


def _read_device(fs: Sysfs, addr: PciAddress, resolved: Optional[Dict[PciAddress, str]] = None) -> PciDevice:
    """The PCI function at ``addr``; ``resolved``: where its directory, symlinks resolved, is kept."""
    top = fs.host.s.pci_device(addr)
    d = top + "/"
    texts = dict(zip(_DEVICE_ATTRS, fs.read_attrs_in(d, _DEVICE_ATTRS)))

    def num(name: str, default: "Optional[int]" = 0) -> "Optional[int]":
        v = int_of(texts[name], d + name, default)
        return default if v is None else v

    override = texts["driver_override"]
    if override in ("(null)", ""):
        override = None
    boot_vga_v = texts["boot_vga"]
    group = fs.link_name(d + "iommu_group")
    physfn = fs.link_name(d + "physfn")
    virtfns = _virtfns(fs, top)
    real = fs.resolve(top)
    if resolved is not None:
        resolved[addr] = real
    real_parent = os.path.basename(os.path.dirname(real))
    upstream = PciAddress.parse(real_parent) if PciAddress.is_valid(real_parent) else None
    reset = texts["reset_method"] or ""
    return PciDevice(
        address=addr, vendor=num("vendor"), device=num("device"),
        subsystem_vendor=num("subsystem_vendor"), subsystem_device=num("subsystem_device"),
        pci_class=num("class"), driver=fs.link_name(d + "driver"), driver_override=override,
        numa_node=num("numa_node", -1),
        boot_vga=None if boot_vga_v is None else boot_vga_v == "1",
        reset_methods=tuple(reset.split()),
        iommu_group=int(group) if is_digits(group) else None,
        upstream=upstream,
        physfn=PciAddress.parse(physfn) if physfn and PciAddress.is_valid(physfn) else None,
        virtfns=virtfns,
        sriov_totalvfs=num("sriov_totalvfs", None),
        sriov_numvfs=num("sriov_numvfs", None),
        domain_host=_domain_host(real, addr))


def _virtfns(fs: Sysfs, top: str) -> Tuple[PciAddress, ...]:
    """The VFs the ``virtfn<N>`` links in the device directory ``top`` name, by N (a GPU's 16 to 32; the
    links read without a call per link, as :meth:`Sysfs.link_name` reads them: one gone meanwhile is left out)."""
    found = []
    readlink, parse, valid = os.readlink, PciAddress.parse, PciAddress.is_valid
    for entry in fs.listdir(top):
        if entry.startswith("virtfn") and is_digits(entry[6:]):
            try:
                target = readlink(f"{top}/{entry}").rpartition("/")[2]
            except FileNotFoundError:
                continue
            except OSError:                 # not a link, or unreadable: as link_name answers
                target = fs.link_name(f"{top}/{entry}")
            if target and valid(target):
                found.append((int(entry[6:]), parse(target)))
    found.sort()
    return tuple(v for _, v in found)


def _reread_device(fs: Sysfs, dev: PciDevice) -> PciDevice:
    """``dev`` (read a moment before) with what can change while the function stays present read
    again: its ``driver`` link, ``driver_override``, and for a physical function ``sriov_numvfs`` and its
    ``virtfn`` links (VFs enabled or disabled).  Its ids, class, NUMA node, boot VGA, reset methods,
    IOMMU group, physfn and upstream are fixed for the device's life (a hot-replug is a new device:
    callers read under the GPU's lock a look a few milliseconds old).  What a re-check under the GPU's
    lock (:func:`discover_gpu` with ``known``) reads.  None when the function is gone (its
    ``driver_override`` absent, and its directory: no stat before the read)."""
    d = fs.host.s.pci_device(dev.address) + "/"
    override = fs.read_attr(d + "driver_override")       # one read(2): a sysfs attribute
    if override is None and not fs.exists(d[:-1]):
        return None
    if override in ("(null)", ""):
        override = None
    changed = {"driver": fs.link_name(d + "driver"), "driver_override": override}
    if dev.sriov_totalvfs:
        changed["virtfns"] = _virtfns(fs, d[:-1])
        changed["sriov_numvfs"] = fs.read_attr_int(d + "sriov_numvfs")
    # unchanged (as after nearly every write): the record itself, not a copy of it
    fields = dev.__dict__
    if all(fields[k] == v for k, v in changed.items()):
        return dev
    return replace(dev, **changed)


def _domain_host(real: str, addr: PciAddress) -> Optional[PciAddress]:
    """The device directory right above the root bus of ``addr``'s domain (``pci10000:00``) in its
    resolved sysfs path ``real``: the device that hosts the domain (Intel VMD), else None."""
    parts = real.split("/")
    root_bus = f"pci{addr.domain:04x}:"
    for i in range(1, len(parts)):
        if parts[i].startswith(root_bus):
            return PciAddress.parse(parts[i - 1]) if PciAddress.is_valid(parts[i - 1]) else None
    return None


# memos of the two parsers below (a dict each, emptied when full: not functools.lru_cache, whose
# import the qemu hook's start would pay for)
_NAMES: Dict[str, Tuple[str, Optional[VgpuProfile]]] = {}
_DESCS: Dict[str, Tuple[Tuple[str, str], ...]] = {}
_MEMO_MAX = 4096
#: (GPU, VF, its creatable (type id, name) pairs) -> the VgpuType rows :func:`_read_vendor_vf` made of them
_VF_TYPES: Dict[tuple, Tuple[VgpuType, ...]] = {}


def _parse_name(raw_name: str) -> Tuple[str, Optional[VgpuProfile]]:
    got = _NAMES.get(raw_name)
    if got is None:
        name = strip_vendor_prefix(raw_name)
        got = name, VgpuProfile.try_parse(name)
        if len(_NAMES) >= _MEMO_MAX:
            _NAMES.clear()
        _NAMES[raw_name] = got
    return got


def _parse_desc(text: str) -> Tuple[Tuple[str, str], ...]:
    got = _DESCS.get(text)
    if got is None:
        got = tuple(parse_description(text).items())
        if len(_DESCS) >= _MEMO_MAX:
            _DESCS.clear()
        _DESCS[text] = got
    return got


#: (raw name or type id, framebuffer text, max_instance text) -> (name, profile, framebuffer MiB, max
#: instances): what :func:`_make_type` derives, the same for every parent that lists the type
_DERIVED: Dict[tuple, tuple] = {}


def _make_type(gpu: PciAddress, parent: PciAddress, backend: str, type_id: str, raw_name: str,
               available: int, description: Mapping[str, str], device_api: Optional[str]) -> VgpuType:
    """The row of ``type_id`` on ``parent``.  What it derives from the name and description is derived
    once per process (:data:`_DERIVED`), and the row is built with positional fields: the VFs of a GPU
    list the same types (an L40S host's ``prepare begin`` builds 480 rows; 0.74 -> 0.3 ms, measured
    2026-12-07)."""
    fb_text = description.get("framebuffer")
    mx = description.get("max_instance")
    key = (raw_name or None, None if raw_name else type_id, fb_text, mx)
    got = _DERIVED.get(key)
    if got is None:
        name, profile = _parse_name(raw_name) if raw_name else (type_id, None)
        fb = parse_size_mib(fb_text) if fb_text else None
        if fb is None and profile is not None:
            fb = profile.framebuffer_gb * 1024
        got = (name, profile, fb, int(mx) if is_digits(mx) else None)
        if len(_DERIVED) >= _MEMO_MAX:
            _DERIVED.clear()
        _DERIVED[key] = got
    return VgpuType(gpu, parent, backend, type_id, raw_name, got[0], got[1], got[2], got[3], available,
                    device_api, description)


def _read_mdev_types(fs: Sysfs, gpu: PciAddress, parent: PciAddress,
                     consts: Optional[Dict[str, VgpuType]] = None, real: Optional[str] = None,
                     only: Optional[frozenset] = None,
                     prior: Optional[Dict[PciAddress, Dict[str, VgpuType]]] = None) -> List[VgpuType]:
    """The types of one mdev parent.  ``consts`` (type id -> a row read before) is
    shared by the parents of one GPU: ``name``, ``description`` and ``device_api``
    are the type's, the same on every VF of the GPU, so only
    ``available_instances`` is read per parent (docs/reference/hardware.md#mdev).
    ``real``: the parent's device directory with symlinks resolved (:func:`_real_dirs`), read
    instead of ``class/mdev_bus/<parent>``: no symlink to follow on each of its files' opens.
    ``prior``: ``{parent: {type id: row}}`` of a read before (:func:`_mdev_rows_of`): a row whose count
    is the one read now is that row itself, not a new one (after a write most counts stay).  ``only``
    (type ids, with ``prior``): only those types' ``available_instances`` are read; each other type the
    parent lists keeps its row of ``prior`` (every type is read when the parent lists one ``prior``
    lacks)."""
    tdir = types_dir_in(real) if real is not None else supported_types_dir(fs.host, parent)
    out = []
    before = prior.get(parent) if prior is not None else None
    only_here = only if only is not None and before is not None else None
    tids, counts = mdev_types_available(fs, tdir, only_here)
    if not tids and real is not None:       # not where _real_dirs looked for it: through its class/mdev_bus link
        tdir = supported_types_dir(fs.host, parent)
        tids, counts = mdev_types_available(fs, tdir, only_here)
    if only_here is not None and tids and any(tid not in before for tid in tids):
        counts = mdev_available_all(fs, tdir, tids)     # a type the look did not hold: every count read
    new = object.__new__
    for tid, avail in zip(tids, counts):
        was = before.get(tid) if before is not None else None
        if was is not None and (avail is None or was.available_instances == avail):
            out.append(was)             # not asked about (only), or the same count: the row read before
            continue
        known = consts.get(tid) if consts is not None else None
        if known is None:
            description, name, device_api = mdev_type_constants(fs, tdir, tid)
            t = _make_type(gpu, parent, BACKEND_MDEV, tid, name or "", avail, dict(_parse_desc(description or "")),
                           device_api)
            if consts is not None:
                consts[tid] = t
        else:
            # the row of another parent of this GPU with this parent and count: its fields copied, not
            # passed one by one to __init__ (3,072 rows on an 8 x 32 VF host)
            t = new(VgpuType)
            d = t.__dict__
            d.update(known.__dict__)
            d["parent"] = parent
            d["available_instances"] = avail
        out.append(t)
    return out


def _real_dirs(fs: Sysfs, gpu: PciAddress, parents: Tuple[PciAddress, ...],
               top: Optional[str] = None) -> Dict[PciAddress, str]:
    """``{parent: its device directory, symlinks resolved}`` for the mdev parents of ``gpu`` (the GPU and
    its VFs): the GPU's own path resolved once, and each VF looked for beside it, where the kernel places a
    VF (a function of the same upstream bridge, docs/reference/hardware.md#pci-and-iommu); a parent
    not found there is read through its ``class/mdev_bus`` link (:func:`_read_mdev_types`).  One ``realpath`` per GPU
    instead of a symlink walk on every open of hundreds of type files (an 8 x 32 VF host: 3,000); ``top``:
    the GPU's resolved directory where the caller has it."""
    if top is None:
        top = fs.resolve(fs.host.s.pci_device(gpu))
    beside = os.path.dirname(top)
    # not checked here: a parent whose directory lists no types there is read through its link
    # (_read_mdev_types), which saves a stat of every parent
    return {p: top if p == gpu else f"{beside}/{p}" for p in parents}


def _read_vendor_vf(fs: Sysfs, gpu: PciAddress, vf: PciAddress) -> Tuple[VfVgpu, List[VgpuType], Optional[Unreadable]]:
    """A vendor-VFIO VF: its record, the types it lists, and what could not be read of it (None: all
    was).  A VF whose ``creatable_vgpu_types`` read fails lists nothing; the type it holds is still
    read (a vGPU on it stays known)."""
    try:
        creatable, cur = vf_offers(fs, vf)
    except SysfsError as e:
        bad = _unreadable(vf, e)
        try:
            cur = vf_current_type(fs, vf)
        except SysfsError:
            cur = None
        return VfVgpu(vf, gpu, cur, ()), [], bad
    offered = tuple(creatable)
    key = (gpu, vf, offered)
    types = _VF_TYPES.get(key)
    if types is None:
        # the rows depend on nothing but these: a VF that lists what it listed before gives the same
        # (frozen) rows, not built again (a long-running agent re-reads every VF of a GPU it wrote to)
        types = tuple(_make_type(gpu, vf, BACKEND_VENDOR_VFIO, tid, name, 1, {}, "vfio-pci") for tid, name in offered)
        if len(_VF_TYPES) >= _MEMO_MAX:
            _VF_TYPES.clear()
        _VF_TYPES[key] = types
    return VfVgpu(vf, gpu, cur, offered), list(types), None


def _read_mdevs(fs: Sysfs) -> List[MdevDevice]:
    base = fs.host.s.mdev_devices
    return [m for m in (_mdev_at(fs, base, name) for name in fs.listdir(base)) if m is not None]


def _mdev_at(fs: Sysfs, base: str, name: str) -> Optional[MdevDevice]:
    """The mdev ``name`` under ``base`` (``sys/bus/mdev/devices``): its parent (where its link resolves),
    type, IOMMU group and driver; None when it was removed while read (realpath's readlink raced a remove)
    or is half-removed (no parent address or no type): skipped rather than guessed."""
    d = f"{base}/{name}"
    try:
        real = fs.resolve(d)
    except FileNotFoundError:
        return None
    parent = os.path.basename(os.path.dirname(real))
    tid = mdev_type_of(fs, d)
    if not PciAddress.is_valid(parent) or tid is None:
        return None
    group = fs.link_name(d + "/iommu_group")
    return MdevDevice(name, PciAddress.parse(parent), tid, int(group) if is_digits(group) else None,
                      fs.link_name(d + "/driver"))


_BOOTFB_NAMES = ("BOOTFB", "efifb", "simplefb", "simple-framebuffer", "vesafb")


def read_host_facts(fs: Sysfs) -> HostFacts:
    host = fs.host
    cmdline = fs.read_optional(host.s.proc_cmdline) or ""
    cpuinfo = fs.read_optional(host.s.proc_cpuinfo) or ""
    vendor = None
    flags: set = set()
    for line in cpuinfo.splitlines():
        k, _, v = line.partition(":")
        k = k.strip()
        if k == "vendor_id" and vendor is None:
            vendor = v.strip()
        elif k == "flags" and not flags:
            flags = set(v.split())
    release = fs.read_optional(host.s.path("proc", "sys", "kernel", "osrelease"))
    loaded = frozenset(line.split()[0] for line in (fs.read_optional(host.s.proc_modules) or "").splitlines()
                       if line.strip())
    builtin: FrozenSet[str] = frozenset()
    available: FrozenSet[str] = frozenset()
    if release:
        mdir = host.s.lib_modules(release)
        builtin = frozenset(_module_name(p) for p in (fs.read_optional(os.path.join(mdir, "modules.builtin")) or "").split())
        available = frozenset(_module_name(line.split(":")[0])
                              for line in (fs.read_optional(os.path.join(mdir, "modules.dep")) or "").splitlines()
                              if line.strip())
    interrupts = fs.read_optional(host.s.path("proc", "interrupts"))
    ir: Optional[bool] = None
    if interrupts is not None:
        if "IR-" in interrupts:
            ir = True
        elif "MSI" in interrupts or "IO-APIC" in interrupts:
            ir = False
    procs = set()
    proc = host.s.path("proc")
    for entry in fs.listdir(proc):
        if is_digits(entry):
            comm = fs.read_optional(f"{proc}/{entry}/comm")
            if comm:
                procs.add(comm)
    return HostFacts(cmdline=cmdline, cpu_vendor=vendor, cpu_virt_flags=frozenset(flags & {"vmx", "svm"}),
                     kernel_release=release, modules_loaded=loaded, modules_builtin=builtin,
                     modules_available=available, interrupt_remapping=ir, processes=frozenset(procs),
                     boot_framebuffers=_boot_framebuffers(fs.read_optional(host.s.path("proc", "iomem")) or ""),
                     iommu_units=tuple(fs.listdir(host.s.iommu_class)), selinux=_read_selinux(fs))


def _read_selinux(fs: Sysfs) -> Optional[SelinuxFacts]:
    """SELinux's mode, the hooks' boolean and the labels of libvirt's hooks directory, where SELinux is on."""
    host = fs.host
    enforce = fs.read_optional(host.s.path("sys", "fs", "selinux", "enforce"))
    if enforce is None:
        return None
    boolean = fs.read_optional(host.s.path("sys", "fs", "selinux", "booleans", "virt_hooks_unconfined"))
    unconfined = None if boolean is None or not boolean.split() else boolean.split()[0] == "1"

    def type_of(path: str) -> Optional[str]:
        label = files.selinux_label(path)               # user:role:type:level
        parts = label.split(":") if label else []
        return parts[2] if len(parts) >= 3 else None
    return SelinuxFacts(enforcing=enforce.strip() == "1", hooks_unconfined=unconfined,
                        hooks_label=type_of(host.s.libvirt_hooks), etc_label=type_of(host.s.etc("libvirt")))


def _module_name(path: str) -> str:
    """``kernel/drivers/vfio/pci/vfio-pci.ko`` -> ``vfio_pci``."""
    base = os.path.basename(path.strip())
    for ext in (".ko.xz", ".ko.zst", ".ko.gz", ".ko"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    return base.replace("-", "_")


def _boot_framebuffers(iomem: str) -> Dict[str, Tuple[str, ...]]:
    """BDF -> boot framebuffer owners nested under its BAR in ``/proc/iomem``."""
    out: Dict[str, List[str]] = {}
    stack: List[Tuple[int, str]] = []
    for line in iomem.splitlines():
        if ":" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        name = line.split(" : ", 1)[1].strip() if " : " in line else ""
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if any(fb in name for fb in _BOOTFB_NAMES):
            for _, owner in reversed(stack):
                if PciAddress.is_valid(owner):
                    out.setdefault(owner, []).append(name)
                    break
        stack.append((indent, name))
    return {k: tuple(v) for k, v in out.items()}
