"""The host root: the one place every kernel and host path is derived.

Owns: turning a root directory (``--root DIR``, env ``VGPUHOST_ROOT``,
default ``/``, as mdevctl's environment does) into every path vgpuhost
touches: ``sys/...``, ``proc/...``, ``etc/...``, ``dev/vfio`` and the state
dir.  Must not: read or write files (that is :mod:`vgpuhost.sysfs`).

No other module spells a kernel path; tests reject a literal ``/sys``
anywhere else in the package.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..model.errors import HostEnvironmentError
from ..model.values import record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Optional, Union

    PathLike = Union[str, "os.PathLike[str]"]

ENV_ROOT = "VGPUHOST_ROOT"
ENV_STATE_DIR = "VGPUHOST_STATE_DIR"
SIM_MARKER = ".vgpuhost-sim"


def running_kernel_proc_status(pid: int) -> Path:
    """``/proc/<pid>/status`` of the kernel this process runs on, never under a (simulated) root:
    the credentials of a socket peer (the agent's callers) are that kernel's."""
    return Path(os.sep, "proc", str(int(pid)), "status")


@record(frozen=True)
class HostRoot:
    """A host root directory and the paths derived from it.

    ``root`` is absolute; ``state_dir`` defaults to ``<root>/var/lib/vgpuhost``.
    """

    root: Path
    state_dir_override: Optional[Path] = None

    @classmethod
    def from_env(cls, root: Optional[PathLike] = None,
                 state_dir: Optional[PathLike] = None) -> "HostRoot":
        """Resolve the root from an explicit value, ``$VGPUHOST_ROOT`` or ``/``.

        Raises HostEnvironmentError when the root is not a directory.
        """
        value = os.fspath(root) if root is not None else os.environ.get(ENV_ROOT) or "/"
        if value == "" or "\0" in value:
            raise HostEnvironmentError("empty or invalid host root", hint="pass --root DIR or unset VGPUHOST_ROOT")
        path = Path(value).absolute()
        try:
            is_dir = path.is_dir()
        except OSError as e:
            raise HostEnvironmentError(f"host root {str(path)[:200]!r}: {e.strerror}",
                                       hint="pass --root DIR to an existing host root") from None
        if not is_dir:
            raise HostEnvironmentError(
                f"host root {str(path)!r} is not a directory",
                hint="pass --root DIR (or set VGPUHOST_ROOT) to an existing host root, "
                     "e.g. one made by 'vgpuhost sim create'")
        sd = state_dir if state_dir is not None else os.environ.get(ENV_STATE_DIR)
        return cls(path, Path(sd).absolute() if sd else None)

    def path(self, *parts: str) -> Path:
        """``<root>/<parts...>``; parts never start with a slash."""
        return self.root.joinpath(*parts)

    # --- simulator ---------------------------------------------------
    @property
    def sim_dir(self) -> Path:
        """Where a simulated host keeps its metadata (absent on real hosts)."""
        return self.path(SIM_MARKER)

    @property
    def is_simulated(self) -> bool:
        try:
            return (self.sim_dir / "host.json").is_file()
        except OSError:
            return False

    def require_host(self) -> None:
        """Raise HostEnvironmentError unless the root looks like a host (``sys/bus/pci/devices``, ``proc/``)."""
        for need in (self.pci_devices, self.path("proc")):
            try:
                ok = need.is_dir()
            except OSError:
                ok = False
            if not ok:
                raise HostEnvironmentError(
                    f"{self.root} is not a host root: {self.relative(need)} is missing or unreadable",
                    hint="pass --root DIR to a host root (a directory holding sys/ and proc/), e.g. one "
                         "made by 'vgpuhost sim create'")

    # --- sysfs: PCI ----------------------------------------------------
    @property
    def sys(self) -> Path:
        return self.path("sys")

    @property
    def pci_devices(self) -> Path:
        """``sys/bus/pci/devices``: one symlink per BDF (docs/reference/hardware.md#pci-and-iommu)."""
        return self.path("sys", "bus", "pci", "devices")

    def pci_device(self, bdf: object) -> Path:
        return self.pci_devices / str(bdf)

    @property
    def pci_drivers(self) -> Path:
        return self.path("sys", "bus", "pci", "drivers")

    def pci_driver(self, name: str) -> Path:
        return self.pci_drivers / name

    @property
    def pci_drivers_probe(self) -> Path:
        return self.path("sys", "bus", "pci", "drivers_probe")

    @property
    def iommu_groups(self) -> Path:
        """``sys/kernel/iommu_groups``; empty or absent when the IOMMU is off."""
        return self.path("sys", "kernel", "iommu_groups")

    @property
    def iommu_class(self) -> Path:
        """``sys/class/iommu``: one entry per IOMMU unit (dmar0, ivhd0)."""
        return self.path("sys", "class", "iommu")

    @property
    def sys_module(self) -> Path:
        return self.path("sys", "module")

    # --- sysfs: mdev ---------------------------------------------------
    @property
    def mdev_bus(self) -> Path:
        """``sys/class/mdev_bus``: one link per mdev parent (docs/reference/hardware.md#mdev)."""
        return self.path("sys", "class", "mdev_bus")

    @property
    def mdev_devices(self) -> Path:
        """``sys/bus/mdev/devices``: one link per mdev instance (UUID)."""
        return self.path("sys", "bus", "mdev", "devices")

    # --- proc, etc, dev --------------------------------------------------
    @property
    def proc_cmdline(self) -> Path:
        return self.path("proc", "cmdline")

    @property
    def proc_modules(self) -> Path:
        return self.path("proc", "modules")

    @property
    def proc_cpuinfo(self) -> Path:
        return self.path("proc", "cpuinfo")

    @property
    def dev_vfio(self) -> Path:
        return self.path("dev", "vfio")

    def etc(self, *parts: str) -> Path:
        return self.path("etc", *parts)

    @property
    def modprobe_d(self) -> Path:
        return self.etc("modprobe.d")

    @property
    def driverctl_d(self) -> Path:
        return self.etc("driverctl.d")

    @property
    def mdevctl_d(self) -> Path:
        return self.etc("mdevctl.d")

    @property
    def libvirt_hooks(self) -> Path:
        return self.etc("libvirt", "hooks")

    def lib_modules(self, release: str) -> Path:
        return self.path("lib", "modules", release)

    @property
    def state_dir(self) -> Path:
        """vgpuhost's state (SQLite store, locks); ``<root>/var/lib/vgpuhost``."""
        if self.state_dir_override is not None:
            return self.state_dir_override
        return self.path("var", "lib", "vgpuhost")

    def relative(self, path: PathLike) -> str:
        """A path under the root as the kernel would name it (``/sys/...``)."""
        p = Path(path)
        try:
            return "/" + str(p.relative_to(self.root))
        except ValueError:
            return str(p)
