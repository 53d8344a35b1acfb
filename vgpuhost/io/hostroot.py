"""The host root: the one place every kernel and host path is derived.

Owns: turning a root directory (``--root DIR``, env ``VGPUHOST_ROOT``,
default ``/``, as mdevctl's environment does) into every path vgpuhost
touches: ``sys/...``, ``proc/...``, ``etc/...``, ``dev/vfio`` and the state
dir.  Must not: read or write files (that is :mod:`vgpuhost.sysfs`).

No other module spells a kernel path; tests reject a literal ``/sys``
anywhere else in the package.

Two spellings of every path: :class:`HostRoot`'s properties and methods
give :class:`pathlib.Path` values (the package at large), and
:attr:`HostRoot.s` (a :class:`HostPaths`) gives the same paths as plain
strings joined with :mod:`os.path`.  The qemu hook's path (hook/, ops/devices,
the io doors it uses) takes the strings: importing :mod:`pathlib` pulls in
``re``, ``enum``, ``fnmatch``, ``urllib.parse`` and ``ipaddress``, about
4 ms of every hook process's start (``python -X importtime``, measured
2026-12-01), and this module imports it only when a ``Path`` is asked for.
"""

from __future__ import annotations

import os

from ..model.errors import HostEnvironmentError

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from pathlib import Path
    from typing import Optional, Union

    PathLike = Union[str, "os.PathLike[str]"]

ENV_ROOT = "VGPUHOST_ROOT"
ENV_STATE_DIR = "VGPUHOST_STATE_DIR"
SIM_MARKER = ".vgpuhost-sim"
#: in the state directory, beside state.db, while a GPU may be out of service or a VF be reserved for an
#: incoming migration (:mod:`vgpuhost.ops.health` writes and removes it; named here so that a lean read
#: command looks for it without importing that module)
HEALTH_MARKER = "gpu-health.marker"

_join = os.path.join


def _Path(text: str) -> "Path":
    from pathlib import Path
    return Path(text)


def plain_path(value: "PathLike") -> str:
    """``value`` (a string or path-like) spelled as ``str(pathlib.Path(value))`` spells it, without
    importing pathlib: repeated slashes and ``.`` components dropped, no trailing slash, ``..``
    kept (a symlink's ``..`` is not its parent)."""
    value = os.fspath(value)
    if value == "":
        return "."
    parts = [p for p in value.split("/") if p and p != "."]
    head = "/" if value.startswith("/") else ""
    if value.startswith("//") and not value.startswith("///"):
        head = "//"             # POSIX keeps exactly two leading slashes, and so does pathlib
    return head + "/".join(parts) if (head or parts) else "."


def _absolute(value: str) -> str:
    """``str(pathlib.Path(value).absolute())``: relative to the working directory, not resolved."""
    value = plain_path(value)
    if value.startswith("/"):
        return value
    return plain_path(_join(os.getcwd(), value)) if value != "." else plain_path(os.getcwd())


def running_kernel_proc_status(pid: int) -> "Path":
    """``/proc/<pid>/status`` of the kernel this process runs on, never under a (simulated) root:
    the credentials of a socket peer (the agent's callers) are that kernel's."""
    return _Path(_join(os.sep, "proc", str(int(pid)), "status"))


class HostPaths:
    """The paths of a :class:`HostRoot` as plain strings (``host.s``): the same names as the
    ``HostRoot`` members, each an absolute path under the root (``os.path.join``)."""

    __slots__ = ("root", "_state_dir")

    def __init__(self, root: str, state_dir: Optional[str]):
        self.root = root
        self._state_dir = state_dir

    def path(self, *parts: str) -> str:
        """``<root>/<parts...>``; parts never start with a slash."""
        return _join(self.root, *parts)

    # --- simulator ---------------------------------------------------
    @property
    def sim_dir(self) -> str:
        """Where a simulated host keeps its metadata (absent on real hosts)."""
        return _join(self.root, SIM_MARKER)

    # --- sysfs: PCI ----------------------------------------------------
    @property
    def sys(self) -> str:
        return _join(self.root, "sys")

    @property
    def pci_devices(self) -> str:
        """``sys/bus/pci/devices``: one symlink per BDF (docs/reference/hardware.md#pci-and-iommu)."""
        return _join(self.root, "sys", "bus", "pci", "devices")

    def pci_device(self, bdf: object) -> str:
        return _join(self.root, "sys", "bus", "pci", "devices", str(bdf))

    @property
    def pci_drivers(self) -> str:
        return _join(self.root, "sys", "bus", "pci", "drivers")

    def pci_driver(self, name: str) -> str:
        return _join(self.root, "sys", "bus", "pci", "drivers", name)

    @property
    def pci_drivers_probe(self) -> str:
        return _join(self.root, "sys", "bus", "pci", "drivers_probe")

    @property
    def iommu_groups(self) -> str:
        """``sys/kernel/iommu_groups``; empty or absent when the IOMMU is off."""
        return _join(self.root, "sys", "kernel", "iommu_groups")

    @property
    def iommu_class(self) -> str:
        """``sys/class/iommu``: one entry per IOMMU unit (dmar0, ivhd0)."""
        return _join(self.root, "sys", "class", "iommu")

    @property
    def sys_module(self) -> str:
        return _join(self.root, "sys", "module")

    # --- sysfs: mdev ---------------------------------------------------
    @property
    def mdev_bus(self) -> str:
        """``sys/class/mdev_bus``: one link per mdev parent (docs/reference/hardware.md#mdev)."""
        return _join(self.root, "sys", "class", "mdev_bus")

    @property
    def mdev_devices(self) -> str:
        """``sys/bus/mdev/devices``: one link per mdev instance (UUID)."""
        return _join(self.root, "sys", "bus", "mdev", "devices")

    # --- proc, etc, dev --------------------------------------------------
    @property
    def proc(self) -> str:
        return _join(self.root, "proc")

    @property
    def proc_cmdline(self) -> str:
        return _join(self.root, "proc", "cmdline")

    @property
    def proc_modules(self) -> str:
        return _join(self.root, "proc", "modules")

    @property
    def proc_cpuinfo(self) -> str:
        return _join(self.root, "proc", "cpuinfo")

    @property
    def dev_vfio(self) -> str:
        return _join(self.root, "dev", "vfio")

    def etc(self, *parts: str) -> str:
        return _join(self.root, "etc", *parts)

    @property
    def modprobe_d(self) -> str:
        return _join(self.root, "etc", "modprobe.d")

    @property
    def driverctl_d(self) -> str:
        return _join(self.root, "etc", "driverctl.d")

    @property
    def mdevctl_d(self) -> str:
        return _join(self.root, "etc", "mdevctl.d")

    @property
    def libvirt_hooks(self) -> str:
        return _join(self.root, "etc", "libvirt", "hooks")

    def lib_modules(self, release: str) -> str:
        return _join(self.root, "lib", "modules", release)

    @property
    def state_dir(self) -> str:
        """vgpuhost's state (SQLite store, locks); ``<root>/var/lib/vgpuhost``."""
        if self._state_dir is not None:
            return self._state_dir
        return _join(self.root, "var", "lib", "vgpuhost")


class HostRoot:
    """A host root directory and the paths derived from it.

    ``HostRoot(root, state_dir_override=None)``: ``root`` and
    ``state_dir_override`` are a ``str`` or a path-like; ``root`` is read
    back as a :class:`pathlib.Path` (absolute when made by :meth:`from_env`);
    ``state_dir`` defaults to ``<root>/var/lib/vgpuhost``.  Frozen; equal
    (and hashed) by the two paths.  ``host.s`` gives every path as a string
    (:class:`HostPaths`).
    """

    __slots__ = ("s", "_root_path", "_state_path")

    def __init__(self, root: PathLike, state_dir_override: Optional[PathLike] = None):
        sd = plain_path(os.fspath(state_dir_override)) if state_dir_override is not None else None
        object.__setattr__(self, "s", HostPaths(plain_path(os.fspath(root)), sd))
        object.__setattr__(self, "_root_path", None)
        object.__setattr__(self, "_state_path", None)

    def __setattr__(self, name, value):
        from dataclasses import FrozenInstanceError
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    __delattr__ = __setattr__

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.s.root, self.s._state_dir) == (other.s.root, other.s._state_dir)

    def __hash__(self):
        return hash((self.s.root, self.s._state_dir))

    def __repr__(self) -> str:
        sd = self.state_dir_override
        return f"HostRoot(root={self.root!r}, state_dir_override={sd!r})"

    def __reduce__(self):
        return (HostRoot, (self.s.root, self.s._state_dir))

    @property
    def root(self) -> "Path":
        """The root directory (a ``Path``; ``host.s.root`` is the string)."""
        if self._root_path is None:
            object.__setattr__(self, "_root_path", _Path(self.s.root))
        return self._root_path

    @property
    def state_dir_override(self) -> "Optional[Path]":
        return _Path(self.s._state_dir) if self.s._state_dir is not None else None

    @classmethod
    def from_env(cls, root: Optional[PathLike] = None,
                 state_dir: Optional[PathLike] = None) -> "HostRoot":
        """Resolve the root from an explicit value, ``$VGPUHOST_ROOT`` or ``/``.

        Raises HostEnvironmentError when the root is not a directory.
        """
        value = os.fspath(root) if root is not None else os.environ.get(ENV_ROOT) or "/"
        if value == "" or "\0" in value:
            raise HostEnvironmentError("empty or invalid host root", hint="pass --root DIR or unset VGPUHOST_ROOT")
        path = _absolute(value)
        try:
            os.stat(path)
            is_dir = os.path.isdir(path)
        except FileNotFoundError:
            is_dir = False
        except OSError as e:
            if e.errno in (20, 40, 36):         # ENOTDIR, ELOOP, ENAMETOOLONG: not a directory (as is_dir)
                is_dir = False
            else:
                raise HostEnvironmentError(f"host root {path[:200]!r}: {e.strerror}",
                                           hint="pass --root DIR to an existing host root") from None
        if not is_dir:
            raise HostEnvironmentError(
                f"host root {path!r} is not a directory",
                hint="pass --root DIR (or set VGPUHOST_ROOT) to an existing host root, "
                     "e.g. one made by 'vgpuhost sim create'")
        sd = os.fspath(state_dir) if state_dir is not None else os.environ.get(ENV_STATE_DIR)
        return cls(path, _absolute(sd) if sd else None)

    def path(self, *parts: str) -> "Path":
        """``<root>/<parts...>``; parts never start with a slash."""
        return _Path(self.s.path(*parts))

    # --- simulator ---------------------------------------------------
    @property
    def sim_dir(self) -> "Path":
        """Where a simulated host keeps its metadata (absent on real hosts)."""
        return _Path(self.s.sim_dir)

    @property
    def is_simulated(self) -> bool:
        try:
            return os.path.isfile(_join(self.s.sim_dir, "host.json"))
        except (OSError, ValueError):
            return False

    def require_host(self) -> None:
        """Raise HostEnvironmentError unless the root looks like a host (``sys/bus/pci/devices``, ``proc/``)."""
        for need in (self.s.pci_devices, self.s.proc):
            try:
                ok = os.path.isdir(need)
            except (OSError, ValueError):
                ok = False
            if not ok:
                raise HostEnvironmentError(
                    f"{self.s.root} is not a host root: {self.relative(need)} is missing or unreadable",
                    hint="pass --root DIR to a host root (a directory holding sys/ and proc/), e.g. one "
                         "made by 'vgpuhost sim create'")

    # --- sysfs: PCI ----------------------------------------------------
    @property
    def sys(self) -> "Path":
        return _Path(self.s.sys)

    @property
    def pci_devices(self) -> "Path":
        """``sys/bus/pci/devices``: one symlink per BDF (docs/reference/hardware.md#pci-and-iommu)."""
        return _Path(self.s.pci_devices)

    def pci_device(self, bdf: object) -> "Path":
        return _Path(self.s.pci_device(bdf))

    @property
    def pci_drivers(self) -> "Path":
        return _Path(self.s.pci_drivers)

    def pci_driver(self, name: str) -> "Path":
        return _Path(self.s.pci_driver(name))

    @property
    def pci_drivers_probe(self) -> "Path":
        return _Path(self.s.pci_drivers_probe)

    @property
    def iommu_groups(self) -> "Path":
        """``sys/kernel/iommu_groups``; empty or absent when the IOMMU is off."""
        return _Path(self.s.iommu_groups)

    @property
    def iommu_class(self) -> "Path":
        """``sys/class/iommu``: one entry per IOMMU unit (dmar0, ivhd0)."""
        return _Path(self.s.iommu_class)

    @property
    def sys_module(self) -> "Path":
        return _Path(self.s.sys_module)

    # --- sysfs: mdev ---------------------------------------------------
    @property
    def mdev_bus(self) -> "Path":
        """``sys/class/mdev_bus``: one link per mdev parent (docs/reference/hardware.md#mdev)."""
        return _Path(self.s.mdev_bus)

    @property
    def mdev_devices(self) -> "Path":
        """``sys/bus/mdev/devices``: one link per mdev instance (UUID)."""
        return _Path(self.s.mdev_devices)

    # --- proc, etc, dev --------------------------------------------------
    @property
    def proc(self) -> "Path":
        return _Path(self.s.proc)

    @property
    def proc_cmdline(self) -> "Path":
        return _Path(self.s.proc_cmdline)

    @property
    def proc_modules(self) -> "Path":
        return _Path(self.s.proc_modules)

    @property
    def proc_cpuinfo(self) -> "Path":
        return _Path(self.s.proc_cpuinfo)

    @property
    def dev_vfio(self) -> "Path":
        return _Path(self.s.dev_vfio)

    def etc(self, *parts: str) -> "Path":
        return _Path(self.s.etc(*parts))

    @property
    def modprobe_d(self) -> "Path":
        return _Path(self.s.modprobe_d)

    @property
    def driverctl_d(self) -> "Path":
        return _Path(self.s.driverctl_d)

    @property
    def mdevctl_d(self) -> "Path":
        return _Path(self.s.mdevctl_d)

    @property
    def libvirt_hooks(self) -> "Path":
        return _Path(self.s.libvirt_hooks)

    def lib_modules(self, release: str) -> "Path":
        return _Path(self.s.lib_modules(release))

    @property
    def state_dir(self) -> "Path":
        """vgpuhost's state (SQLite store, locks); ``<root>/var/lib/vgpuhost`` (``host.s.state_dir``: the string)."""
        if self._state_path is None:
            object.__setattr__(self, "_state_path", _Path(self.s.state_dir))
        return self._state_path

    def relative(self, path: PathLike) -> str:
        """A path under the root as the kernel would name it (``/sys/...``); a path outside the
        root as it is.  Takes a string or a path-like."""
        p = plain_path(os.fspath(path))
        root = self.s.root
        if p == root:
            return "/"
        prefix = root if root.endswith("/") else root + "/"
        if p.startswith(prefix):
            return "/" + p[len(prefix):]
        return p
