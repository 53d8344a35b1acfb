"""A state dir or ``state.db`` the caller may not read (breaker finding): read commands must say so
(exit 2, one line naming the path and what to do), never read it as an empty store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from vgpuhost.cli.main import main
from vgpuhost.sim.build import materialise
from vgpuhost.sim.data import bundled_specs
from vgpuhost.sim.spec import load_spec

UID = GID = 54021          # a throwaway id: nobody has it

RUN_AS = r"""
import contextlib, io, json, os, sys
from vgpuhost.cli.main import main
uid, args = json.loads(sys.argv[1])
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    main(args)                          # once as root, so every module it needs is imported (the
                                        # interpreter's library may be root's alone); the ids drop below
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
sys.exit(main(args))
"""

READS = [
    ["usage", "--by", "tenant", "--csv"],
    ["tenant", "list"],
    ["--json", "tenant", "usage"],
    ["audit"],
    ["vgpu", "list"],
    ["reconcile", "--check"],
]


@pytest.fixture
def host():
    """A simulated host others may traverse (pytest's tmp_path is root's alone), with a state store."""
    top = tempfile.mkdtemp(prefix="vgh-state-", dir="/tmp")
    os.chmod(top, 0o755)
    h = materialise(load_spec(bundled_specs()["a40-mdev"]), os.path.join(top, "h"))
    assert main(["--root", str(h.root), "tenant", "add", "t", "--vgpus", "2"]) == 0
    assert main(["--root", str(h.root), "vgpu", "create", "--profile", "A40-8Q", "--owner", "manual"]) == 0
    yield h
    shutil.rmtree(top, ignore_errors=True)


def _as_user(h, args):
    return subprocess.run([sys.executable, "-c", RUN_AS, json.dumps([UID, ["--root", str(h.root)] + args])],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", READS, ids=lambda a: " ".join(a))
def test_a_state_dir_the_caller_cannot_read_is_refused_not_empty(host, args):
    state = str(host.state_dir)
    assert os.stat(state).st_mode & 0o777 == 0o700
    r = _as_user(host, args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    if "--json" in args:
        assert json.loads(r.stdout)["exit_code"] == 2
    else:
        assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"vgpuhost: error: cannot read the state dir {state!r}: Permission denied; ")
    assert "run it as root" in lines[0]


def test_a_state_db_the_caller_cannot_read_is_refused(host):
    os.chmod(host.state_dir, 0o755)
    db = os.path.join(str(host.state_dir), "state.db")
    os.chmod(db, 0o600)
    r = _as_user(host, ["usage", "--csv"])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"vgpuhost: error: cannot read the state store {db!r}: Permission denied; ")
    assert len(r.stderr.splitlines()) == 1


def test_a_missing_store_still_reads_as_empty(host):
    shutil.rmtree(host.state_dir)
    r = _as_user(host, ["usage", "--csv"])
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(host.state_dir)
