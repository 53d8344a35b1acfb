"""The factories that choose between the real outside and the simulator's stand-ins for it.

Owns: on a simulated host root (made by ``vgpuhost sim create``, marked by
:data:`vgpuhost.io.hostroot.SIM_MARKER`), handing out the simulator's stand-ins
for the outside systems, else the real ones:

- :func:`sysfs_kernel`: the simulated kernel that applies writes under the
  root (None on a real root: the real kernel does), used by
  :class:`vgpuhost.io.sysfs.Sysfs`;
- :func:`backend_for`: the NVML backend (the simulator's, or pynvml's), and
  :func:`open_backend`, the one way commands get it (every failure: exit 2);
- :func:`metering_nvml`: the read-only metering NVML door (the simulator's
  load, or pynvml's per-vGPU reads).

How the simulator is found: :mod:`vgpuhost.sim` builds on ``io`` (host roots,
the NVML door's write rows, file reads), so ``io`` never imports it -- that
arrow would run back up and make the two packages a cycle.  Instead
:data:`SIMULATED` names each stand-in as ``"module:attribute"`` (the form of
a packaging entry point), and :func:`_simulated` loads the one asked for, on
a simulated root only.  The contract: each named attribute is a class that
takes the :class:`~vgpuhost.io.hostroot.HostRoot` and serves the interface
the factory returns (``.write(path, value)`` for the kernel,
:class:`~vgpuhost.io.nvml.NvmlBackend`, :class:`~vgpuhost.io.nvml_metering.MeteringNvml`);
tests/test_architecture.py checks that each name exists.  The simulator's
own conveniences (specs, the builder, the demo's libvirtd) are in
:mod:`vgpuhost.sim`, imported by ``vgpuhost sim`` and the demo directly.

Must not: import the simulator (a real host never loads it, and the qemu
hook stays lean: one stand-in's module is loaded where it is used).
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from .hostroot import HostRoot
    from .nvml import NvmlBackend

#: the simulator's stand-in for each outside system, ``"module:attribute"`` (see the module docstring)
SIMULATED = {
    "kernel": "vgpuhost.sim.kernel:SimKernel",
    "nvml": "vgpuhost.sim.nvml:SimNvml",
    "metering": "vgpuhost.sim.metering:SimMetering",
}


def _simulated(what: str, host: HostRoot):
    """The simulator's stand-in ``what`` (a key of :data:`SIMULATED`) for the simulated ``host``."""
    module, _, attribute = SIMULATED[what].partition(":")
    try:
        __import__(module)
    except ModuleNotFoundError as e:        # Debian ships the simulator apart (debian/control)
        if not (e.name or "").startswith("vgpuhost.sim"):
            raise
        from ..model.errors import HostEnvironmentError
        raise HostEnvironmentError(f"{host.root} is a simulated host, and the simulator is not installed here",
                                   hint="install the vgpuhost-sim package (apt install vgpuhost-sim)") from None
    return getattr(sys.modules[module], attribute)(host)


def sysfs_kernel(host: HostRoot):
    """The simulator's kernel for a simulated ``host`` (``.write(path, value)``), None for a real one."""
    if not host.is_simulated:
        return None
    return _simulated("kernel", host)     # the simulator stands in for the kernel


def backend_for(host: HostRoot) -> NvmlBackend:
    """The simulator's NVML on a simulated root, else the real library.

    Raises HostEnvironmentError when NVML cannot be loaded (no driver,
    nvidia-ml-py missing): commands that need NVML exit 2 saying so.
    """
    if host.is_simulated:
        return _simulated("nvml", host)
    from .nvml_pynvml import PynvmlBackend
    return PynvmlBackend.open()


def open_backend(host: HostRoot) -> NvmlBackend:
    """The NVML backend for ``host`` (:func:`backend_for`), for the commands and steps that need NVML.

    Every way NVML cannot be had -- nvidia-ml-py or the library missing, the
    driver not loaded, ``nvmlInit`` refused -- raises HostEnvironmentError
    (exit 2, one line) saying that sysfs commands still work.
    """
    from ..model.errors import HostEnvironmentError
    from .nvml import NvmlError
    try:
        return backend_for(host)
    except HostEnvironmentError:
        raise
    except ImportError as e:
        what = getattr(e, "name", None) or str(e)
        raise HostEnvironmentError(
            f"NVML is not available on this host ({what} cannot be loaded)",
            hint="install the NVIDIA vGPU manager driver and nvidia-ml-py; 'vgpuhost gpus' still "
                 "works from sysfs") from None
    except NvmlError as e:
        raise HostEnvironmentError(
            f"NVML is not available on this host ({e.call}: {e.nvml_name})",
            hint="is the NVIDIA vGPU manager driver loaded? 'vgpuhost gpus' still works from sysfs") from None


def metering_nvml(host: HostRoot):
    """The metering NVML door (:class:`vgpuhost.io.nvml_metering.MeteringNvml`): the
    simulator's load on a simulated root, else nvidia-ml-py's per-vGPU reads.

    Raises HostEnvironmentError when NVML cannot be loaded (exit 2).
    """
    if host.is_simulated:
        return _simulated("metering", host)
    import os
    from .nvml_metering import PynvmlMetering
    return PynvmlMetering(open_backend(host), os.path.join(host.s.proc, "sys", "kernel", "random", "boot_id"))
