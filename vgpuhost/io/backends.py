"""The factories that choose between the real outside and the simulator: the only door to :mod:`vgpuhost.sim`.

Owns: on a simulated host root (made by ``vgpuhost sim create``, marked by
:data:`vgpuhost.io.hostroot.SIM_MARKER`), handing out the simulator's stand-ins
for the outside systems, else the real ones:

- :func:`sysfs_kernel`: the simulated kernel that applies writes under the
  root (None on a real root: the real kernel does), used by
  :class:`vgpuhost.io.sysfs.Sysfs`;
- :func:`backend_for`: the NVML backend (the simulator's, or pynvml's), and
  :func:`open_backend`, the one way commands get it (every failure: exit 2);
- :func:`metering_nvml`: the read-only metering NVML door (the simulator's
  load, or pynvml's per-vGPU reads);
- :func:`bundled_specs`, :func:`load_host_spec`, :func:`build_host`: the
  simulator's host specs and builder, for ``vgpuhost sim ...``;
- :func:`isolated_libvirtd`, :func:`libvirtd_available`,
  :func:`diskless_domain_xml`: a private libvirtd for the demo.

Must not: import the simulator at module level (every import is where it is
used, so a real host never loads it, and the qemu hook stays lean).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from pathlib import Path
    from typing import Dict, Optional, Tuple, Union

    from .hostroot import HostRoot
    from .nvml import NvmlBackend


def sysfs_kernel(host: HostRoot):
    """The simulator's kernel for a simulated ``host`` (``.write(path, value)``), None for a real one."""
    if not host.is_simulated:
        return None
    from ..sim.kernel import SimKernel  # the simulator stands in for the kernel
    return SimKernel(host)


def backend_for(host: HostRoot) -> NvmlBackend:
    """The simulator's NVML on a simulated root, else the real library.

    Raises HostEnvironmentError when NVML cannot be loaded (no driver,
    nvidia-ml-py missing): commands that need NVML exit 2 saying so.
    """
    if host.is_simulated:
        from ..sim.nvml import SimNvml
        return SimNvml(host)
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
        from ..sim.metering import SimMetering
        return SimMetering(host)
    import os
    from .nvml_metering import PynvmlMetering
    return PynvmlMetering(open_backend(host), os.path.join(host.s.proc, "sys", "kernel", "random", "boot_id"))


def bundled_specs() -> Dict[str, Path]:
    """Example host specs shipped with vgpuhost: ``{name: path}``."""
    from ..sim.data import bundled_specs as specs
    return specs()


def load_host_spec(path: Union[str, Path]):
    """A host spec file as a :class:`vgpuhost.sim.spec.HostSpec`; InputError / SimulatorError when invalid."""
    from ..sim.spec import load_spec
    return load_spec(path)


def build_host(spec, directory: Union[str, Path], *, force: bool = False) -> HostRoot:
    """Build the simulated host ``spec`` at ``directory``; its HostRoot (see :func:`vgpuhost.sim.build.materialise`)."""
    from ..sim.build import materialise
    return materialise(spec, directory, force=force)


def libvirtd_available() -> Tuple[bool, str]:
    """Can a private libvirtd run here: ``(yes, why not)`` (root, Debian's libvirtd and qemu)."""
    from ..sim.libvirtd import available
    return available()


def isolated_libvirtd(workdir: Union[str, Path]):
    """A private libvirtd in its own mount and network namespace, under ``workdir`` (a context manager)."""
    from ..sim.libvirtd import IsolatedLibvirtd
    return IsolatedLibvirtd(workdir)


def diskless_domain_xml(name: str, uuid: Optional[str] = None, memory_mib: int = 64) -> str:
    """A minimal domain document (no disk) that libvirt can define and start."""
    from ..sim.libvirtd import diskless_domain_xml as xml
    return xml(name, uuid, memory_mib)
