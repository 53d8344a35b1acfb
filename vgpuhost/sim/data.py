"""Files shipped in the ``vgpuhost.sim`` package: the board catalog and the example host specs."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Dict

PACKAGE = __name__.rsplit(".", 1)[0]


def data_path(name: str) -> Path:
    """A file shipped in the ``vgpuhost.sim`` package (works from a wheel)."""
    return Path(str(resources.files(PACKAGE).joinpath(name)))


def bundled_specs() -> Dict[str, Path]:
    """Example host specs shipped with vgpuhost: ``{name: path}`` (examples/hosts)."""
    hosts = data_path("hosts")
    return {p.stem: p for p in sorted(hosts.glob("*.yaml"))}
