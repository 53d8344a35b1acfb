"""Files shipped in the ``vgpuhost.sim`` package: the board catalog and the example host specs."""

from __future__ import annotations

from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict

PACKAGE = __name__.rsplit(".", 1)[0]


def data_path(name: str) -> Path:
    """A file shipped in the ``vgpuhost.sim`` package (works from a wheel)."""
    from importlib import resources     # here: the qemu hook imports this package (sim.kernel) on simulated roots
    return Path(str(resources.files(PACKAGE).joinpath(name)))


def bundled_specs() -> Dict[str, Path]:
    """Example host specs shipped with vgpuhost: ``{name: path}`` (examples/hosts)."""
    hosts = data_path("hosts")
    return {p.stem: p for p in sorted(hosts.glob("*.yaml"))}
