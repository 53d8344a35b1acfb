"""Shared fixtures: simulated hosts built from the shipped specs or inline YAML."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

from vgpuhost.io.hostroot import HostRoot
from vgpuhost.sim.data import bundled_specs
from vgpuhost.sim.build import materialise
from vgpuhost.sim.spec import load_spec, parse_spec
from vgpuhost.io.sysfs import Sysfs

# the isolated libvirtd (tests/libvirtd_fixture.py); every --json document checked against docs/schemas/
# (tests/jsonschema_plugin.py)
pytest_plugins = ["libvirtd_fixture", "jsonschema_plugin"]

DATA = Path(__file__).parent / "data"
REGEN = os.environ.get("VGPUHOST_REGEN_GOLDENS") == "1"


@pytest.fixture
def make_host(tmp_path) -> Callable[..., HostRoot]:
    """``make_host('a40-mdev')`` or ``make_host(yaml_text=...)`` -> HostRoot of a fresh tree."""
    counter = {"n": 0}

    def build(name: str = None, *, yaml_text: str = None) -> HostRoot:
        counter["n"] += 1
        dest = tmp_path / f"host{counter['n']}"
        spec = load_spec(bundled_specs()[name]) if name else parse_spec(yaml_text)
        return materialise(spec, dest)

    return build


@pytest.fixture
def fs_of() -> Callable[[HostRoot], Sysfs]:
    return lambda host: Sysfs(host)


def golden(area: str, case: str, text: str) -> None:
    """Compare ``text`` with tests/data/<area>/<case>; VGPUHOST_REGEN_GOLDENS=1 rewrites it."""
    path = DATA / area / case
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"missing golden {path}; run with VGPUHOST_REGEN_GOLDENS=1 and review it"
    assert text == path.read_text(), f"output differs from golden {path}"
