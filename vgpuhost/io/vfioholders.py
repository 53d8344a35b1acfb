"""Who holds a vGPU open, read from the host: the door to ``proc/<pid>/fd``.

Owns: finding the processes that have a vGPU's VFIO nodes open -- its IOMMU
group's node ``/dev/vfio/<group>`` (the group interface, which QEMU keeps
open while it uses the device) or its device cdev ``/dev/vfio/devices/vfioN``
(the iommufd interface, Linux >= 6.6; the device directory's ``vfio-dev/vfioN``
names it) -- by reading the ``proc/<pid>/fd/*`` links under the host root;
the errors a remove of an open vGPU ends in (:class:`VgpuInUse`,
:class:`RemoveTimedOut`, :class:`RemoveUnanswered`); and the bound on a remove write
(:func:`remove_timeout_s`).  Must not: decide what to do about a holder, or
write anything.

Why (docs/reference/hardware.md#mdev): since Linux 5.8 a remove of an open
mdev does not fail with EBUSY, it blocks the writer until the device is
closed (``vfio_unregister_group_dev()``), and asks QEMU meanwhile to unplug
it from the guest; NVIDIA's vendor-VFIO driver answers a destroy of an open
VF with EPERM.  So vgpuhost looks for holders before it writes, and bounds
the write (:meth:`vgpuhost.io.sysfs.Sysfs.write_bounded`).

What this cannot see: a device fd got through the group interface shows as
``anon_inode:[vfio-device]``, naming no device, so a holder that closed its
group fd and kept the device fd is invisible here (the bounded write covers
it).  Reading another process's fd table needs root (``CAP_SYS_PTRACE``): a
table that cannot be read is skipped.
"""

from __future__ import annotations

import os
from os.path import join as _join

from ..model.errors import DeviceError, RefusedError
from .locks import time_left
from .sysfs import Sysfs

#: the environment variable that sets how long a remove write may take, in seconds (a float)
REMOVE_TIMEOUT_ENV = "VGPUHOST_REMOVE_TIMEOUT_S"
#: the default: a remove of a closed vGPU takes milliseconds; well below the qemu hook's 60 s
DEFAULT_REMOVE_TIMEOUT_S = 20.0
_MIN_TIMEOUT_S = 0.05
_MAX_TIMEOUT_S = 600.0
#: seconds kept, before the caller's deadline (:func:`vgpuhost.io.locks.deadline`: the qemu hook's own
#: timeout, the agent's hook client), to record a remove that did not finish as pending
DEADLINE_MARGIN_S = 2.0

#: the device directory's entry that names its VFIO cdev (``vfio-dev/vfioN``, Linux >= 6.1)
VFIO_DEV_DIR = "vfio-dev"
IOMMU_GROUP_LINK = "iommu_group"


def remove_timeout_s() -> float:
    """Seconds a remove write may take (``$VGPUHOST_REMOVE_TIMEOUT_S``, default 20, clamped to 0.05..600),
    and never past this thread's deadline less :data:`DEADLINE_MARGIN_S` (the qemu hook's timeout: a
    remove still blocked then is reported pending, not cut short by the hook's alarm)."""
    raw = os.environ.get(REMOVE_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_REMOVE_TIMEOUT_S
    except ValueError:
        value = DEFAULT_REMOVE_TIMEOUT_S
    if value != value:          # NaN
        value = DEFAULT_REMOVE_TIMEOUT_S
    left = time_left()
    if left is not None:
        value = min(value, left - DEADLINE_MARGIN_S)
    return min(max(value, _MIN_TIMEOUT_S), _MAX_TIMEOUT_S)


class Holder:
    """One process holding a vGPU's VFIO node open: ``pid``, ``comm`` (its name, at most 15
    characters; ``?`` when unreadable) and ``node`` (the path its fd shows)."""

    __slots__ = ("pid", "comm", "node")

    def __init__(self, pid: int, comm: str, node: str):
        self.pid, self.comm, self.node = pid, comm, node

    def __repr__(self) -> str:
        return f"Holder({self.pid}, {self.comm!r}, {self.node!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Holder) and (self.pid, self.comm, self.node) == (other.pid, other.comm, other.node)

    def describe(self) -> str:
        return f"{self.comm} (pid {self.pid}, {self.node} open)"


def describe(holders: "list[Holder]") -> str:
    """``qemu-system-x86 (pid 4000, /dev/vfio/12 open)``, comma-joined; '' for none."""
    return ", ".join(h.describe() for h in holders)


def group_node(group: str) -> str:
    """``/dev/vfio/<group>``: IOMMU group ``group``'s node as a process's fd link shows it (a path
    inside the holder's own view, not below the host root)."""
    return _join(os.sep, "dev", "vfio", group)


def device_nodes(fs: Sysfs, device_dir: str) -> list[str]:
    """The VFIO nodes of the device at ``device_dir`` as a process's fd table shows them:
    ``/dev/vfio/<group>`` (from its ``iommu_group`` link) and ``/dev/vfio/devices/vfioN`` (one per
    ``vfio-dev/vfioN``); [] when it has neither (gone, or not bound to a VFIO driver)."""
    nodes = []
    group = fs.link_name(_join(device_dir, IOMMU_GROUP_LINK))
    if group is not None:
        nodes.append(group_node(group))
    for name in fs.listdir(_join(device_dir, VFIO_DEV_DIR)):
        nodes.append(_join(os.sep, "dev", "vfio", "devices", name))
    return nodes


def holders(fs: Sysfs, device_dir: str) -> list[Holder]:
    """The processes that hold the device at ``device_dir`` open, by pid: every ``proc/<pid>/fd/*``
    link under the host root that points at one of its :func:`device_nodes`.  Unreadable fd
    tables (another user's, a process that just exited) are skipped."""
    nodes = set(device_nodes(fs, device_dir))
    if not nodes:
        return []
    proc = fs.host.s.proc
    out = []
    for name in fs.listdir(proc):
        if not name.isdigit():
            continue
        fd_dir = _join(proc, name, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(_join(fd_dir, fd))
            except OSError:
                continue
            if target in nodes:
                out.append(Holder(int(name), _comm(proc, name), target))
                break
    return sorted(out, key=lambda h: h.pid)


def _comm(proc: str, pid: str) -> str:
    try:
        with open(_join(proc, pid, "comm"), encoding="utf-8", errors="replace") as f:
            return f.read(64).strip() or "?"
    except OSError:
        return "?"


class VgpuInUse(RefusedError):
    """A remove refused before any write: ``holders`` (a list of :class:`Holder`) have the vGPU
    ``vgpu_id`` open.  Exit 2: nothing changed."""

    def __init__(self, vgpu_id: str, holder_list: list[Holder], *, hint: str | None = None):
        self.vgpu_id = vgpu_id
        self.holders = list(holder_list)
        super().__init__(f"vGPU {vgpu_id} is open, held by {describe(self.holders)}: not removed (a remove "
                         "of an open vGPU blocks until it is closed and asks qemu to unplug it from the guest)",
                         hint=hint or "stop the domain that uses it (or detach the vGPU from it) first")


def _who(holder_list: list[Holder]) -> str:
    return describe(holder_list) or "a process vgpuhost cannot see (a device fd without its group)"


class RemoveTimedOut(DeviceError):
    """A remove write that did not return within ``timeout_s``: the device is still open (the
    write goes on in a detached process and completes when the holder closes it).  Exit 3."""

    def __init__(self, vgpu_id: str, timeout_s: float, holder_list: list[Holder], *, hint: str | None = None):
        self.vgpu_id = vgpu_id
        self.timeout_s = timeout_s
        self.holders = list(holder_list)
        super().__init__(self._text(), hint=hint)

    def _text(self) -> str:
        return (f"remove of {self.vgpu_id} did not finish within {self.timeout_s:g} s: the device is still "
                f"open (held by {_who(self.holders)})")


class RemoveUnanswered(RemoveTimedOut):
    """A remove write whose outcome is not known (:class:`vgpuhost.io.sysfs.WriteOutcomeUnknown`: the process
    making it ended without answering, or the resident writer handed it was still starting), and the vGPU,
    read back, is still there: handled as a remove that did not finish in time (the removal stays pending,
    its journal entry open, so that reconcile finishes it and never re-creates the vGPU).  ``why`` the
    clause that says why.  Exit 3."""

    def __init__(self, vgpu_id: str, timeout_s: float, why: str, *, hint: str | None = None):
        self.why = why
        super().__init__(vgpu_id, timeout_s, [], hint=hint)

    def _text(self) -> str:
        return f"remove of {self.vgpu_id} did not finish: {self.why}; the vGPU is still there"


class RemoveInProgress(RemoveTimedOut):
    """An earlier remove write of ``vgpu_id`` still waits for the device to be closed (an mdev whose
    ``remove`` file is gone: ``remove_store()`` removes itself as it starts).  Exit 3."""

    def __init__(self, vgpu_id: str, holder_list: list[Holder], *, hint: str | None = None):
        super().__init__(vgpu_id, 0.0, holder_list, hint=hint)

    def _text(self) -> str:
        return (f"remove of {self.vgpu_id} is already in progress (its remove file is gone) and waits: the "
                f"device is still open (held by {_who(self.holders)})")


__all__ = ["RemoveInProgress", "RemoveUnanswered", "Holder", "holders", "device_nodes", "describe", "remove_timeout_s", "VgpuInUse", "RemoveTimedOut",
           "REMOVE_TIMEOUT_ENV", "DEFAULT_REMOVE_TIMEOUT_S"]
