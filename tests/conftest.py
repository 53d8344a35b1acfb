"""Shared fixtures: simulated hosts built from the shipped specs or inline YAML; the parallel run's groups.

``make test`` runs the suite on pytest-xdist workers (``-n``, ``--dist loadgroup``): each worker is its own
process with its own temporary root (``tmp_path`` under ``popen-gwN``), its own session fixtures (one
isolated libvirtd per worker that needs one) and its own sockets (``agentutil.socket_dir``) and ports (bound
to port 0).  Tests go one at a time to whichever worker is free (:func:`pytest_xdist_make_scheduler`),
except the modules in :data:`XDIST_GROUPS`, which run whole on one worker: their tests share a module
fixture and build on one another's state, or they write the same files in the repository.
"""

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

#: module file name -> its group (under ``--dist loadgroup`` a group's tests run on one worker, in order)
XDIST_GROUPS = {
    # one module-scoped agent, host or store that the module's tests share (and read each other's effects on)
    "test_agent_limits.py": "agent-limits",
    "test_agent_tenants.py": "agent-tenants",
    "test_billing.py": "billing",
    # both run setuptools on the checkout itself: build/ and vgpuhost.egg-info in the repository
    "test_packaging.py": "repo-build",
}
#: modules whose tests take the longest (tens of seconds to minutes each: Ansible runs, the Debian package,
#: kill sweeps, property tests with many real operations): a parallel run starts them first, so that no long
#: test starts last and leaves the other workers idle while it runs
SLOW_FIRST = ("test_ansible.py", "test_deb.py", "test_crash.py", "test_admission_model_property.py",
              "test_passthrough.py", "test_placement_property.py", "test_vgpu_concurrency.py",
              "test_admission_once.py", "test_metering_prometheus.py", "test_tenancy_hook_property.py")
REGEN = os.environ.get("VGPUHOST_REGEN_GOLDENS") == "1"


def pytest_collection_modifyitems(config, items) -> None:
    """On an xdist worker: the modules of :data:`SLOW_FIRST` first, in that order, each module's tests
    kept together and in their order (every worker sorts alike, so the workers' collections agree)."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup``: each test is its own unit of work, handed to whichever worker is free,
    except that the tests of a module of :data:`XDIST_GROUPS` go to one worker together, in order.

    (xdist's own loadgroup reads ``xdist_group`` marks by rewriting ``item._nodeid``, which pytest 9 no
    longer reads: the marks were ignored and a grouped module's tests ran spread over the workers.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return XDIST_GROUPS.get(module) or nodeid

    return ModuleGroupScheduling(config, log)


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
