"""Session fixtures for end-to-end tests against a real, isolated libvirtd.

Loaded from tests/conftest.py (``pytest_plugins = ["libvirtd_fixture"]``).

``libvirtd``: one :class:`vgpuhost.sim.libvirtd.IsolatedLibvirtd` for the
whole session, started under pytest's base temp dir and stopped at the end.
Where it cannot run (not root, no ``unshare``, libvirt or qemu missing) the
tests using it are skipped, except in CI (``CI=true``) where they fail.

``host_libvirt_before``: the machine's own libvirt directories as they were
before the daemon started (see :func:`host_libvirt_snapshot`), to prove
the isolated daemon left them alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nsutil, whatever pytest's import mode
import nsutil  # noqa: E402

from vgpuhost.sim.libvirtd import NS_DIRS, IsolatedLibvirtd, available  # noqa: E402

#: relative path -> (is_dir, size, mtime_ns) for every entry under one directory
Snapshot = Dict[str, Dict[str, Tuple[bool, int, int]]]


def host_libvirt_snapshot() -> Snapshot:
    """Every entry under the machine's five libvirt directories (a missing directory reads as empty)."""
    out: Snapshot = {}
    for target in NS_DIRS.values():
        entries: Dict[str, Tuple[bool, int, int]] = {}
        for dirpath, dirnames, filenames in os.walk(target):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                entries[os.path.relpath(p, target)] = (os.path.isdir(p), st.st_size, st.st_mtime_ns)
        out[str(target)] = entries
    return out


@pytest.fixture(scope="session")
def host_libvirt_before() -> Snapshot:
    return host_libvirt_snapshot()


@pytest.fixture(scope="session")
def libvirtd(tmp_path_factory, host_libvirt_before) -> Iterator[IsolatedLibvirtd]:
    """A started IsolatedLibvirtd shared by the session; stopped (no process left) at the end."""
    ok, reason = available()
    nsutil.skip_or_fail(None if ok else reason, "the isolated-libvirtd tests")
    daemon = IsolatedLibvirtd(tmp_path_factory.mktemp("libvirtd"))
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
