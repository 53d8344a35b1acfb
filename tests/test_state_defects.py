"""Issue 12, state and journal defects a new-user trial found on simulated roots.

- a wrong ``--state-dir`` (a regular file, or missing while the host has
  devices vgpuhost may own) never reads as a healthy, empty store;
- lock files and the lock dir are never followed through symlinks;
- the placement reason of ``vgpu create`` is computed from the host as
  journal recovery left it.
"""

from __future__ import annotations

import os
import subprocess
import sys

from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs

A40 = "0000:81:00.0"


def cli(capsys, host, *argv):
    code = main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def mdevs(host):
    return sorted(Sysfs(host).listdir(host.mdev_devices))


def _host_with_vgpu(make_host, capsys):
    host = make_host("a40-mdev")
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 0, err
    return host


def test_a_state_dir_that_is_a_regular_file_is_refused_by_read_and_write_commands(make_host, capsys, tmp_path):
    host = _host_with_vgpu(make_host, capsys)
    bogus = tmp_path / "not-a-dir"
    bogus.write_text("")
    before = mdevs(host)
    for state_dir in (bogus, bogus / "sub"):
        for argv in (["reconcile", "--check"], ["vgpu", "list"], ["audit"],
                     ["vgpu", "create", "--profile", "A40-8Q"]):
            code, out, err = cli(capsys, host, "--state-dir", str(state_dir), *argv)
            assert code == 2 and out == "", (argv, out, err)
            assert err.startswith("vgpuhost: error: ") and err.count("\n") == 1, err
            assert "is not a directory" in err and "--state-dir" in err and "run as root" not in err, err
    assert mdevs(host) == before and bogus.read_text() == ""


def test_reconcile_check_never_says_in_sync_without_the_store_while_vgpuhost_may_own_devices(
        make_host, capsys, tmp_path):
    host = _host_with_vgpu(make_host, capsys)
    missing = tmp_path / "no-such-state-dir"
    code, out, err = cli(capsys, host, "--state-dir", str(missing), "reconcile", "--check")
    assert code == 2 and "in sync" not in out, (out, err)
    assert err.count("\n") == 1 and "no state store" in err and "mdev " in err and "--state-dir" in err, err
    assert not missing.exists()
    # the real store: in sync
    code, out, _ = cli(capsys, host, "reconcile", "--check")
    assert code == 0 and "in sync" in out
    # a host with nothing vgpuhost may own and no store: in sync, nothing created
    fresh = make_host("a40-mdev")
    code, out, _ = cli(capsys, fresh, "reconcile", "--check")
    assert code == 0 and "in sync" in out and not fresh.state_dir.exists()


def test_a_symlinked_lock_file_is_never_followed(make_host, capsys, tmp_path):
    host = make_host("a40-mdev")
    locks = host.state_dir / "locks"
    locks.mkdir(parents=True)
    target = tmp_path / "x"
    lock = locks / f"gpu-{A40}.lock"
    os.symlink(target, lock)
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 2 and err.count("\n") == 1, err
    assert "is a symlink" in err and f"rm {lock}" in err, err
    assert not os.path.lexists(target) and mdevs(host) == []
    os.unlink(lock)
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 0, err
    assert not os.path.islink(lock) and os.path.isfile(lock)


def test_a_symlinked_lock_dir_is_refused(make_host, capsys, tmp_path):
    host = make_host("a40-mdev")
    host.state_dir.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, host.state_dir / "locks")
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 2 and err.count("\n") == 1 and "lock dir" in err and "symlink" in err, err
    assert os.listdir(elsewhere) == [] and mdevs(host) == []


def test_the_placement_reason_after_recovery_counts_what_the_rollback_freed(make_host, capsys):
    host = make_host("a40-mdev")
    env = dict(os.environ, VGPUHOST_SIM_KILL_AT="1", VGPUHOST_SIM_KILL_WHEN="after")
    killed = subprocess.run([sys.executable, "-m", "vgpuhost", "--root", str(host.root), "vgpu", "create",
                             "--profile", "A40-8Q"], env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert len(mdevs(host)) == 1          # the create landed; the process died before recording it
    code, out, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 0, err
    assert "(6 A40-8Q free;" in out, out           # the rollback freed the one the killed create made
    store = StateStore(host.state_dir)
    assert [r.value for r in store.audit_rows() if r.path == "(placement)"][-1].count("6 A40-8Q free") == 1
    assert len(mdevs(host)) == 1 and len(store.vgpu_records()) == 1
    assert store.journal_entries(open_only=True) == []
