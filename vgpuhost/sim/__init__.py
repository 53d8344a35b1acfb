"""The host simulator: a product feature, not a test helper.

Builds a faithful host root (sysfs tree with real symlinks, proc files,
kernel module lists) from a YAML host spec and a shipped board catalog, and
stands in for the kernel when vgpuhost writes to that tree (see
:mod:`vgpuhost.sim.kernel`).  State lives in the tree on disk, so separate
processes (CLI, hook, mdevctl) see one host.

Public entry points: :func:`vgpuhost.sim.spec.load_spec`,
:func:`vgpuhost.sim.build.materialise`, :func:`bundled_specs`.
"""

from __future__ import annotations

from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict


def data_path(name: str) -> Path:
    """A file shipped in the ``vgpuhost.sim`` package (works from a wheel)."""
    from importlib import resources     # here: the qemu hook imports this package (sim.kernel) on simulated roots
    return Path(str(resources.files(__name__).joinpath(name)))


def bundled_specs() -> Dict[str, Path]:
    """Example host specs shipped with vgpuhost: ``{name: path}`` (examples/hosts)."""
    hosts = data_path("hosts")
    return {p.stem: p for p in sorted(hosts.glob("*.yaml"))}
