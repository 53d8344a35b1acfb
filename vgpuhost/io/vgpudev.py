"""The one door to the vGPU kernel interfaces: classic mdev and NVIDIA's vendor-specific VFIO.

Owns: one :class:`VgpuDevices` interface and its two implementations
(:class:`MdevDevices`, :class:`VendorVfioDevices`), chosen by :func:`for_backend`
from a :class:`~vgpuhost.model.concepts.Backend`: the sysfs paths of a vGPU
(create, ``vgpu_params``, remove), the value written to create and remove it,
reading back the type it holds, whether it exists, the offers (per-type
listings) a parent makes, and the ``nvidia/vgpu_params`` attribute that
mdevctl definitions carry.  Nothing else builds paths with these names
(``tests/test_architecture.py``'s kernel_attrs rule).  In the pattern of a
mode manager with one implementation per kernel interface: callers hold a
backend object, not a string to branch on.

Must not: import anything heavy at module level (the qemu hook imports this
module through :mod:`vgpuhost.plan.steps`: no typing, no pathlib, no re).

Sources: docs/reference/hardware.md#mdev (``mdev_supported_types``,
``create``, ``remove``, ``mdev_type``) and #vendor-vfio (``nvidia/
creatable_vgpu_types``, ``nvidia/current_vgpu_type``, ``nvidia/vgpu_params``).
"""

from __future__ import annotations

from os.path import join as _join

from ..model.kinds import Backend    # the plain constants: the enum module costs the hook ~1 ms to import
from .sysfs import attr_names
# .vfioholders (with .locks, fcntl, select) is imported by the methods that remove or look for holders:
# a read command (`types`) never does

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only
    from typing import List, Optional, Sequence, Tuple
    from .hostroot import HostRoot
    from .sysfs import Sysfs

MDEV_TYPE_ATTR = "mdev_type"
CURRENT_TYPE_ATTR = "current_vgpu_type"
CREATABLE_ATTR = "creatable_vgpu_types"
SUPPORTED_TYPES_DIR = "mdev_supported_types"
AVAILABLE_ATTR = "available_instances"
PARAMS_ATTR = "vgpu_params"
#: ``nvidia/placement_id`` of a vGPU in mixed-size mode (an mdev's, or a VF's; on a VF written before the
#: type to choose the placement; "Not Applicable" where none; docs/reference/hardware.md#vgpu-types)
PLACEMENT_ATTR = "placement_id"
CREATE_FILE = "create"
REMOVE_FILE = "remove"
#: the NVIDIA driver's directory of vGPU attributes, under a VF (vendor VFIO) or an mdev
NVIDIA_DIR = "nvidia"
#: ``nvidia/vgpu_params`` relative to the mdev: the attribute as mdevctl's ``attrs`` name it
#: (mdevctl writes each value to that path under the mdev, docs/reference/hardware.md#mdev)
MDEVCTL_PARAMS_ATTR = NVIDIA_DIR + "/" + PARAMS_ATTR


class VgpuDevices:
    """The interface: what vgpuhost does to the vGPUs of one backend.

    ``parent`` is the PCI address (a :class:`~vgpuhost.model.values.PciAddress`
    or its string) of the mdev parent or the VF; ``vgpu_id`` the mdev UUID or,
    on vendor VFIO, the VF's address.  Paths are strings.
    """

    backend = None      # the Backend member

    def create_path(self, host: HostRoot, parent, type_id: str, vgpu_id: str) -> str:
        raise NotImplementedError

    def create_value(self, type_id: str, vgpu_id: str) -> str:
        raise NotImplementedError

    def params_path(self, host: HostRoot, parent, vgpu_id: str) -> str:
        raise NotImplementedError

    def remove_write(self, host: HostRoot, parent, vgpu_id: str) -> Tuple[str, str]:
        """``(path, value)`` whose write removes the vGPU."""
        raise NotImplementedError

    def current_type(self, fs: Sysfs, parent, vgpu_id: str) -> Optional[str]:
        """The type id the vGPU holds now, read back; None: it does not exist / the VF holds none."""
        raise NotImplementedError

    def raw_current(self, fs: Sysfs, parent, vgpu_id: str) -> Optional[str]:
        """What the kernel shows as the vGPU's type, unfiltered (for messages)."""
        return self.current_type(fs, parent, vgpu_id)

    def paths(self, host: HostRoot, parent, type_id: str, vgpu_id: str) -> Tuple[str, str]:
        """``(create path, vgpu_params path)``."""
        return self.create_path(host, parent, type_id, vgpu_id), self.params_path(host, parent, vgpu_id)

    def create(self, fs: Sysfs, parent, type_id: str, vgpu_id: str) -> None:
        """Write the create file; raises :class:`~vgpuhost.model.errors.SysfsError` as the kernel refuses."""
        fs.write(self.create_path(fs.host, parent, type_id, vgpu_id), self.create_value(type_id, vgpu_id))

    def device_dir(self, host: HostRoot, parent, vgpu_id: str) -> str:
        """The vGPU's device directory (where its ``iommu_group`` link is)."""
        raise NotImplementedError

    def holders(self, fs: Sysfs, parent, vgpu_id: str) -> list:
        """The processes holding the vGPU open (:func:`vgpuhost.io.vfioholders.holders`)."""
        from .vfioholders import holders
        return holders(fs, self.device_dir(fs.host, parent, vgpu_id))

    def remove(self, fs: Sysfs, parent, vgpu_id: str, *, timeout_s: Optional[float] = None) -> None:
        """Remove the vGPU: refuse while a process holds it open, then write the remove file,
        waiting at most ``timeout_s`` seconds (default :func:`~vgpuhost.io.vfioholders.remove_timeout_s`).

        Never writes ``remove`` for an open device: an mdev remove would block until it is
        closed and ask qemu to unplug it from the guest; a vendor-VFIO destroy of an open VF
        fails with EPERM (docs/reference/hardware.md#mdev, #vendor-vfio).  Raises
        :class:`~vgpuhost.io.vfioholders.VgpuInUse` (nothing written) when a holder is seen,
        :class:`~vgpuhost.io.vfioholders.RemoveTimedOut` when the write did not return in time
        (it completes by itself once the device is closed) or an earlier one still waits
        (:class:`~vgpuhost.io.vfioholders.RemoveInProgress`), SysfsError when the kernel refuses.
        A write whose outcome is unknown (its process ended without answering, or a resident writer
        still starting: :class:`~vgpuhost.io.sysfs.WriteOutcomeUnknown`) is judged by the vGPU read
        back: gone, the remove is done; still there,
        :class:`~vgpuhost.io.vfioholders.RemoveUnanswered` (a :class:`RemoveTimedOut`: the callers
        leave the removal pending, as on a timeout, never recorded as failed).
        """
        from .sysfs import WriteOutcomeUnknown
        from .vfioholders import RemoveInProgress, RemoveTimedOut, RemoveUnanswered, VgpuInUse, remove_timeout_s
        seen = self.holders(fs, parent, vgpu_id)
        if seen:
            raise VgpuInUse(str(vgpu_id), seen)
        if self.remove_in_progress(fs, parent, vgpu_id):
            raise RemoveInProgress(str(vgpu_id), seen)
        limit = remove_timeout_s() if timeout_s is None else timeout_s
        try:
            done = fs.write_bounded(*self.remove_write(fs.host, parent, vgpu_id), timeout_s=limit)
        except WriteOutcomeUnknown as e:
            if self.current_type(fs, parent, vgpu_id) is None:
                return                  # the write was made (its answer lost): the vGPU is gone
            raise RemoveUnanswered(str(vgpu_id), limit, e.why) from e
        if not done:
            raise RemoveTimedOut(str(vgpu_id), limit, self.holders(fs, parent, vgpu_id))

    def remove_in_progress(self, fs: Sysfs, parent, vgpu_id: str) -> bool:
        """Whether an earlier remove write of this vGPU is still waiting for it to be closed."""
        return False

    def params_supported(self, fs: Sysfs, parent, vgpu_id: str) -> bool:
        """Whether the vGPU's ``nvidia/vgpu_params`` exists (a vendor-VFIO VF may have none:
        docs/reference/hardware.md#vendor-vfio).  For an mdev that does not exist yet: True."""
        return True


def params_value(params: str) -> str:
    """What to write to ``nvidia/vgpu_params`` for ``params`` (``frame_rate_limiter=0``): the value and a
    newline, since the driver keeps ``count - 1`` bytes (it expects ``echo``'s newline;
    docs/reference/hardware.md#mdev)."""
    return params + "\n"


class MdevDevices(VgpuDevices):
    """Classic mdev (docs/reference/hardware.md#mdev): create by writing the UUID to
    ``<mdev_bus>/<parent>/mdev_supported_types/<type>/create``; the device is
    ``<mdev_devices>/<uuid>`` with ``mdev_type`` (a link named by the type id),
    ``nvidia/vgpu_params`` and ``remove`` (write ``1``)."""

    backend = Backend.MDEV

    def create_path(self, host, parent, type_id, vgpu_id):
        return _join(host.s.mdev_bus, str(parent), SUPPORTED_TYPES_DIR, type_id, CREATE_FILE)

    def create_value(self, type_id, vgpu_id):
        return vgpu_id

    def params_path(self, host, parent, vgpu_id):
        return _join(host.s.mdev_devices, vgpu_id, NVIDIA_DIR, PARAMS_ATTR)

    def remove_write(self, host, parent, vgpu_id):
        return _join(host.s.mdev_devices, vgpu_id, REMOVE_FILE), "1"

    def device_dir(self, host, parent, vgpu_id):
        return _join(host.s.mdev_devices, vgpu_id)

    def remove_in_progress(self, fs, parent, vgpu_id):
        # the mdev is there and its remove file is not: remove_store() removed itself, the
        # unregister waits for the release (docs/reference/hardware.md#mdev)
        ddir = self.device_dir(fs.host, parent, vgpu_id)
        return fs.exists(ddir) and not fs.exists(_join(ddir, REMOVE_FILE))

    def current_type(self, fs, parent, vgpu_id):
        return mdev_type_of(fs, _join(fs.host.s.mdev_devices, vgpu_id))


def _nvidia_dir(host: HostRoot, vf) -> str:
    """``<pci_devices>/<VF>/nvidia``: the vendor-VFIO attributes of a VF."""
    return _join(host.s.pci_device(vf), NVIDIA_DIR)


class VendorVfioDevices(VgpuDevices):
    """NVIDIA vendor-specific VFIO (docs/reference/hardware.md#vendor-vfio): a VF per
    vGPU; write the type id to ``<pci_devices>/<VF>/nvidia/current_vgpu_type`` to
    create, ``0`` to remove (reads ``0`` while empty; EPERM while the VF is taken, and on a
    ``0`` while the VF is open); ``nvidia/vgpu_params`` beside it where the driver has one."""

    backend = Backend.VENDOR_VFIO

    def create_path(self, host, parent, type_id, vgpu_id):
        return vf_type_path(host, parent)

    def create_value(self, type_id, vgpu_id):
        return type_id

    def params_path(self, host, parent, vgpu_id):
        return _join(_nvidia_dir(host, parent), PARAMS_ATTR)

    def remove_write(self, host, parent, vgpu_id):
        return vf_type_path(host, parent), "0"

    def device_dir(self, host, parent, vgpu_id):
        return host.s.pci_device(parent)

    def params_supported(self, fs, parent, vgpu_id):
        return fs.exists(self.params_path(fs.host, parent, vgpu_id))

    def raw_current(self, fs, parent, vgpu_id):
        return fs.read_optional(vf_type_path(fs.host, parent))

    def current_type(self, fs, parent, vgpu_id):
        cur = self.raw_current(fs, parent, vgpu_id)
        return cur if cur and cur != "0" else None


_MDEV = MdevDevices()
_VENDOR = VendorVfioDevices()


def for_backend(backend) -> VgpuDevices:
    """The door of ``backend`` (a Backend member or its spelling); ValueError on an unknown one."""
    if backend == Backend.MDEV:
        return _MDEV
    if backend == Backend.VENDOR_VFIO:
        return _VENDOR
    raise ValueError(f"unknown vGPU backend {str(backend)[:40]!r}")


def mdevctl_attrs(params: Optional[str]) -> List[Tuple[str, str]]:
    """The mdevctl ``attrs`` that give an mdev its vGPU parameters: ``[("nvidia/vgpu_params", params)]``,
    [] without ``params`` (docs/reference/hardware.md#mdev)."""
    return [(MDEVCTL_PARAMS_ATTR, params)] if params else []


def vf_current_type(fs: Sysfs, vf) -> Optional[str]:
    """The type a vendor-VFIO VF holds (``nvidia/current_vgpu_type``, None for ``0`` or absent)."""
    return _VENDOR.current_type(fs, vf, str(vf))


def placement_path(host: HostRoot, backend, parent, vgpu_id: str) -> str:
    """``<vGPU>/nvidia/placement_id``: under the mdev (classic mdev) or the VF (vendor VFIO)."""
    return _join(for_backend(backend).device_dir(host, parent, vgpu_id), NVIDIA_DIR, PLACEMENT_ATTR)


def read_placement(fs: Sysfs, backend, parent, vgpu_id: str) -> Optional[int]:
    """The vGPU's placement id (mixed-size mode), None where it has none ("Not Applicable", absent)."""
    text = fs.read_optional(placement_path(fs.host, backend, parent, vgpu_id))
    return int(text) if text and text.strip().isdigit() else None


def vf_type_path(host: HostRoot, vf) -> str:
    """``<pci_devices>/<VF>/nvidia/current_vgpu_type`` (docs/reference/hardware.md#vendor-vfio):
    the file that shows the type a vendor-VFIO VF holds (``0``: none)."""
    return _join(_nvidia_dir(host, vf), CURRENT_TYPE_ATTR)


def vf_has_vendor_vgpu(fs: Sysfs, vf) -> bool:
    """Whether ``<VF>/nvidia/current_vgpu_type`` exists: the VF serves vendor-VFIO vGPUs."""
    return fs.exists(vf_type_path(fs.host, vf))


def vendor_vgpu_vfs(fs: Sysfs, vfs) -> tuple:
    """The VFs of ``vfs`` (in order) that serve vendor-VFIO vGPUs (:func:`vf_has_vendor_vgpu` of each),
    their paths spelled from one base (a GPU's 32 VFs: one join, not 32)."""
    base = fs.host.s.pci_devices
    tail = f"/{NVIDIA_DIR}/{CURRENT_TYPE_ATTR}"
    exists = fs.exists
    return tuple(v for v in vfs if exists(f"{base}/{v}{tail}"))


def mdev_current_type(fs: Sysfs, uuid: str) -> Optional[str]:
    """The type id mdev ``uuid`` holds (its ``mdev_type`` link's name); None when it does not exist."""
    return _MDEV.current_type(fs, None, uuid)


def vgpu_exists(fs: Sysfs, vid: str) -> bool:
    """Whether vGPU ``vid`` exists: a VF address holding a type, or ``<mdev_devices>/<uuid>``."""
    from ..model.values import PciAddress
    if PciAddress.is_valid(vid):
        return vf_current_type(fs, vid) is not None
    return fs.exists(_join(fs.host.s.mdev_devices, vid))


def mdev_type_of(fs: Sysfs, mdev_dir: str) -> Optional[str]:
    """The type id of the mdev at ``mdev_dir`` (its ``mdev_type`` link's name)."""
    return fs.link_name(mdev_dir + "/" + MDEV_TYPE_ATTR)


def types_dir_in(device_dir: str) -> str:
    """An mdev parent's directory of types, under the parent's device directory as given (a resolved
    path too): ``<device_dir>/mdev_supported_types/``."""
    return f"{device_dir}/{SUPPORTED_TYPES_DIR}/"


def supported_types_dir(host: HostRoot, parent) -> str:
    """``<mdev_bus>/<parent>/mdev_supported_types/`` (with the trailing slash)."""
    return f"{host.s.mdev_bus}/{parent}/{SUPPORTED_TYPES_DIR}/"


def mdev_type_constants(fs: Sysfs, tdir: str, tid: str) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """``(description, name, device_api)`` of type ``tid`` under ``tdir`` (a :func:`supported_types_dir`),
    each the attribute's text or None when unreadable (docs/reference/hardware.md#mdev).  They are
    the driver's, fixed for a type id: a caller may read them once per GPU."""
    base = f"{tdir}{tid}/"
    return fs.read_attr(base + "description"), fs.read_attr(base + "name"), fs.read_attr(base + "device_api")


def mdev_available(fs: Sysfs, tdir: str, tid: str) -> int:
    """``available_instances`` of type ``tid`` under ``tdir`` (a :func:`supported_types_dir`): how many
    more the parent can create now (int >= 0, 0 when unreadable; docs/reference/hardware.md#mdev)."""
    return max(0, fs.read_attr_int(f"{tdir}{tid}/{AVAILABLE_ATTR}", default=0) or 0)


def mdev_available_all(fs: Sysfs, tdir: str, tids: Sequence[str]) -> List[int]:
    """:func:`mdev_available` of each of ``tids`` under ``tdir``, in order (one open of ``tdir``:
    :meth:`~vgpuhost.io.sysfs.Sysfs.read_attr_ints_in`)."""
    names = attr_names(tids if type(tids) is tuple else tuple(tids), AVAILABLE_ATTR)
    return [n if n is not None and n > 0 else 0 for n in fs.read_attr_ints_in(tdir, names, default=0)]



def mdev_types_available(fs: Sysfs, tdir: str, only=None) -> Tuple[Tuple[str, ...], List[Optional[int]]]:
    """``(type ids, counts)``: the types ``tdir`` (a :func:`supported_types_dir` or :func:`types_dir_in`)
    lists, sorted, and :func:`mdev_available` of each, the directory opened once
    (:meth:`~vgpuhost.io.sysfs.Sysfs.listed_attr_ints`: its listing kept while the directory is the
    same one).  ``only``: the type ids whose count is read; the others' counts are None.  Empty
    when the directory is absent."""
    tids, counts = fs.listed_attr_ints(tdir, AVAILABLE_ATTR, only=only, default=0)
    return tids, [None if n is None and only is not None and t not in only else (n if n is not None and n > 0 else 0)
                  for t, n in zip(tids, counts)]


def vf_offers(fs: Sysfs, vf) -> Tuple[List[Tuple[str, str]], Optional[str]]:
    """``(creatable [(type id, name)], current type or None)`` of a vendor-VFIO VF
    (``nvidia/creatable_vgpu_types``, then ``nvidia/current_vgpu_type``; docs/reference/hardware.md#vendor-vfio)."""
    # sysfs attributes (a page at most): one read(2) each (Sysfs.read_attr); the agent reads every VF of a GPU
    # it wrote to again
    d = f"{fs.host.s.pci_devices}/{vf}/{NVIDIA_DIR}/"
    creatable = parse_creatable_vgpu_types(fs.read_attr(d + CREATABLE_ATTR) or "")
    cur = fs.read_attr(d + CURRENT_TYPE_ATTR)
    return creatable, (cur if cur and cur != "0" else None)


#: text of ``creatable_vgpu_types`` -> its (type id, name) pairs (:func:`parse_creatable_vgpu_types`)
_CREATABLE: dict = {}


def parse_creatable_vgpu_types(text: str) -> List[Tuple[str, str]]:
    r"""``nvidia/creatable_vgpu_types`` -> ``[(type id, name)]`` (docs/reference/hardware.md#vendor-vfio).

    The header line ``ID    : vGPU Name`` is skipped; a full GPU leaves only it.  Each line is
    ``^\s*(\d+)\s*:\s*(.+?)\s*$``, parsed by hand (the qemu hook reads it on vendor VFIO and
    imports no ``re``, see :mod:`vgpuhost.model.values`).  A text parsed before is not parsed again (the
    VFs of a GPU list the same types: a new list of the same pairs).
    """
    got = _CREATABLE.get(text)
    if got is not None:
        return list(got)
    out = []
    for line in text.splitlines():
        left, colon, right = line.partition(":")
        tid = left.strip()
        if not colon or not tid.isdecimal() or not right or "\n" in right:
            continue
        name = right.strip()
        out.append((tid, name or right[-1]))    # all blank: the pattern's .+? takes the last blank
    if len(_CREATABLE) >= 1024:
        _CREATABLE.clear()
    _CREATABLE[text] = tuple(out)
    return out


def manager_version(fs) -> "str | None":
    """The NVIDIA vGPU manager's version on ``fs``'s host: ``sys/module/nvidia/version`` (the nvidia
    module's ``MODULE_VERSION``, e.g. ``580.65.05``), None when the module is not loaded or the file
    cannot be read.  ``fs``: a :class:`~vgpuhost.io.sysfs.Sysfs`."""
    text = fs.read_optional(_join(fs.host.s.sys_module, "nvidia", "version"))
    text = (text or "").strip()
    return text or None

