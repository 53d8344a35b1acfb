"""Boot units: `vgpuhost install-units` writes them, idempotently, and they are valid systemd units.

The units are checked three ways: key lines (ordering, oneshot, install
target), ``systemd-analyze verify`` where it exists, and by running the
ExecStart command line itself (split the way systemd splits it) with a
stand-in vgpuhost, to see the retry loop try, wait and give up.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vgpuhost import units
from vgpuhost.cli import main
from vgpuhost.state import StateStore

EXE = "/opt/vgpuhost/bin/vgpuhost"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def unit_lines(text: str):
    """``{key: [values]}`` of a unit file (comments and sections dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def install(capsys, root, *extra):
    code, out, err = run(capsys, "--root", str(root), "--json", "install-units", "--exe", EXE, *extra)
    assert code == 0, err
    return json.loads(out)


def test_install_writes_both_units_with_paths_filled_in(tmp_path, capsys):
    doc = install(capsys, tmp_path, "--config", "/etc/vgpuhost/site.yaml", "--layout", "training")
    assert doc["schema"] == "vgpuhost.install-units/v1"
    assert doc["changed"] is True and doc["dry_run"] is False
    assert doc["unit_dir"] == "/etc/systemd/system"
    assert [(u["name"], u["action"], u["enabled"]) for u in doc["units"]] == [
        ("vgpuhost-layout.service", "create", False), ("vgpuhost-reconcile.service", "create", False)]
    assert doc["next"] == ["systemctl daemon-reload",
                           "systemctl enable vgpuhost-layout.service vgpuhost-reconcile.service"]

    unit_dir = tmp_path / "etc" / "systemd" / "system"
    layout = unit_lines((unit_dir / "vgpuhost-layout.service").read_text())
    reconcile = unit_lines((unit_dir / "vgpuhost-reconcile.service").read_text())
    for u in (layout, reconcile):
        assert u["Type"] == ["oneshot"] and u["RemainAfterExit"] == ["yes"]
        assert u["Before"] == ["libvirtd.service virtqemud.service"]
        assert {"nvidia-vgpu-mgr.service", "nvidia-persistenced.service",
                "systemd-modules-load.service"} <= set(u["After"][0].split())
        assert u["Wants"] == ["nvidia-vgpu-mgr.service"]
        assert u["WantedBy"] == ["multi-user.target"]
        assert "Restart" not in u            # retries are the in-unit loop (module docstring)
    assert "vgpuhost-layout.service" in reconcile["After"][0].split()
    assert layout["ConditionPathExists"] == ["/etc/vgpuhost/site.yaml"]
    assert layout["ExecStart"][0].endswith(f" vgpuhost-layout {EXE} apply -c /etc/vgpuhost/site.yaml training")
    assert reconcile["ExecStart"][0].endswith(f" vgpuhost-reconcile {EXE} reconcile")
    assert "VGPUHOST_RETRIES=6 VGPUHOST_RETRY_DELAY=10" in layout["Environment"]
    assert "VGPUHOST_ACTOR=systemd:vgpuhost-layout.service" in layout["Environment"]

    # every write is in the audit log
    rows = StateStore(tmp_path / "var" / "lib" / "vgpuhost", create=False).audit_rows(None)
    assert sorted((r.operation, r.path, r.result) for r in rows) == [
        ("install-units", "/etc/systemd/system/vgpuhost-layout.service", "ok"),
        ("install-units", "/etc/systemd/system/vgpuhost-reconcile.service", "ok")]


def test_install_is_idempotent_and_says_what_changed(tmp_path, capsys):
    install(capsys, tmp_path)
    unit_dir = tmp_path / "etc" / "systemd" / "system"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in unit_dir.iterdir()}

    doc = install(capsys, tmp_path)
    assert doc["changed"] is False
    assert [u["action"] for u in doc["units"]] == ["unchanged", "unchanged"]
    assert doc["next"] == ["systemctl enable vgpuhost-layout.service vgpuhost-reconcile.service"]
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in unit_dir.iterdir()} == before

    # enabled as `systemctl enable` leaves it: nothing left to do
    wants = unit_dir / "multi-user.target.wants"
    wants.mkdir()
    for name in units.UNIT_NAMES:
        (wants / name).symlink_to(unit_dir / name)
    code, out, _ = run(capsys, "--root", str(tmp_path), "install-units", "--exe", EXE)
    assert code == 0
    assert out.splitlines() == ["/etc/systemd/system/vgpuhost-layout.service: unchanged",
                                "/etc/systemd/system/vgpuhost-reconcile.service: unchanged",
                                "units are installed, up to date and enabled"]

    # another config path changes the layout unit only
    doc = install(capsys, tmp_path, "--config", "/srv/vgpuhost.yaml")
    assert [u["action"] for u in doc["units"]] == ["update", "unchanged"]
    assert doc["next"] == ["systemctl daemon-reload"]
    assert "apply -c /srv/vgpuhost.yaml" in (unit_dir / "vgpuhost-layout.service").read_text()
    rows = StateStore(tmp_path / "var" / "lib" / "vgpuhost", create=False).audit_rows(None)
    assert len(rows) == 3


def test_dry_run_writes_nothing(tmp_path, capsys):
    code, out, _ = run(capsys, "--root", str(tmp_path), "install-units", "--exe", EXE, "--dry-run")
    assert code == 0
    assert "/etc/systemd/system/vgpuhost-layout.service: would create" in out
    assert "systemctl daemon-reload" in out
    assert list(tmp_path.iterdir()) == []          # no unit, no state store


def test_unit_dir_option(tmp_path, capsys):
    root, target = tmp_path / "root", tmp_path / "units"
    root.mkdir()
    doc = install(capsys, root, "--unit-dir", str(target))
    assert sorted(p.name for p in target.iterdir()) == sorted(units.UNIT_NAMES)
    assert doc["units"][0]["path"] == str(target / "vgpuhost-layout.service")   # outside the root: as given
    assert not (root / "etc").exists()


@pytest.mark.parametrize("args, what", [
    (["--config", "etc/vgpuhost/config.yaml"], "is not an absolute path"),
    (["--exe", "bin/vgpuhost"], "is not an absolute path"),
    (["--retries", "0"], "--retries 0 is out of range"),
    (["--retry-delay", "-1"], "--retry-delay -1 is out of range"),
    (["--layout", "a b"], "is not a plain name"),
    (["--config", "/etc/vgpu\nhost.yaml"], "control characters"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, what):
    code, out, err = run(capsys, "--root", str(tmp_path), "install-units", "--exe", EXE, *args)
    assert code == 2 and out == ""
    assert err.startswith("vgpuhost: error: ") and what in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_default_executable_is_the_running_one():
    exe = units.default_executable()
    assert os.path.isabs(exe) and Path(exe).name == "vgpuhost" and os.access(exe, os.X_OK)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed; "
                    "test_install_writes_both_units_with_paths_filled_in checks the key lines")
def test_systemd_analyze_verify_accepts_the_units(tmp_path, capsys):
    # awkward paths: a space, a percent sign and a dollar must survive systemd's quoting
    install(capsys, tmp_path, "--config", "/etc/vgpu host/50%$HOME.yaml", "--layout", "prod")
    unit_dir = tmp_path / "etc" / "systemd" / "system"
    proc = subprocess.run(["systemd-analyze", "verify", *(str(unit_dir / n) for n in units.UNIT_NAMES)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "vgpuhost-" not in proc.stderr, proc.stderr      # no warning about our units


def exec_start_argv(text: str):
    """A unit's ExecStart= as systemd hands it to execve: ``$$`` -> ``$``, ``%%`` -> ``%``, then
    word splitting with "..." and '...' quoting (systemd.service(5), "Command lines")."""
    line = unit_lines(text)["ExecStart"][0]
    return shlex.split(line.replace("$$", "\0").replace("%%", "%").replace("\0", "$"))


STAND_IN = """#!/bin/sh
# stand-in for vgpuhost: logs its arguments, fails until the Nth call
n=$(cat "{count}" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "{count}"
printf '%s\\n' "$*" >> "{log}"
[ "$n" -ge {succeed_at} ] && exit 0
exit 3
"""


def stand_in(tmp_path: Path, succeed_at: int) -> Path:
    exe = tmp_path / "bin dir" / "vgpuhost"
    exe.parent.mkdir()
    exe.write_text(STAND_IN.format(count=tmp_path / "count", log=tmp_path / "log", succeed_at=succeed_at))
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("succeed_at, rc, tries", [(1, 0, 1), (3, 0, 3), (99, 3, 4)])
def test_exec_start_retries_then_gives_up(tmp_path, succeed_at, rc, tries):
    exe = stand_in(tmp_path, succeed_at)
    config = "/etc/vgpu host/50%$HOME.yaml"
    text = units.render(units.LAYOUT_UNIT, exe=str(exe), config=config, layout="prod", retries=4, retry_delay=0)
    argv = exec_start_argv(text)
    assert argv[:2] == ["/bin/sh", "-c"]
    assert argv[3:] == ["vgpuhost-layout", str(exe), "apply", "-c", config, "prod"]
    env = dict(os.environ, VGPUHOST_RETRIES="4", VGPUHOST_RETRY_DELAY="0")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc, proc.stderr
    assert (tmp_path / "log").read_text().splitlines() == [f"apply -c {config} prod"] * tries
    if rc:
        assert "vgpuhost-layout: giving up after 4 tries (last exit 3)" in proc.stderr
    if tries > 1:
        assert "vgpuhost-layout: try 1 of 4 failed (exit 3); next try in 0s" in proc.stderr


def test_exec_start_survives_a_bad_retry_setting(tmp_path):
    exe = stand_in(tmp_path, 99)
    argv = exec_start_argv(units.render(units.RECONCILE_UNIT, exe=str(exe)))
    assert argv[3:] == ["vgpuhost-reconcile", str(exe), "reconcile"]
    env = dict(os.environ, VGPUHOST_RETRIES="many", VGPUHOST_RETRY_DELAY="0")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3            # one try, not an endless loop
    assert (tmp_path / "log").read_text().splitlines() == ["reconcile"]


def test_units_are_package_data():
    for name in units.UNIT_NAMES:
        assert "[Install]" in units.template_text(name)
    with pytest.raises(Exception, match="no unit"):
        units.template_text("other.service")


def unit_environment(text: str):
    """The ``Environment=`` assignments of a unit."""
    env = {}
    for value in unit_lines(text).get("Environment", []):
        for item in shlex.split(value):
            key, _, val = item.partition("=")
            env[key] = val
    return env


@pytest.mark.parametrize("flaky", [False, True], ids=["clean", "first-create-fails"])
def test_boot_sequence_restores_the_layout_and_recorded_vgpus(tmp_path, capsys, flaky):
    """A simulated reboot: the tree is rebuilt (vGPUs gone, state kept); the units' own command
    lines, in their After= order, bring the layout and the manual vGPU back.  ``flaky``: the
    first vGPU create fails once (an injected EIO, as from a late vGPU manager) and the retry
    loop carries on."""
    from vgpuhost.config import load as load_config
    from vgpuhost.hostroot import HostRoot
    from vgpuhost.inventory import discover
    from vgpuhost.layout import check
    from vgpuhost.sim import bundled_specs
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.spec import parse_spec
    from vgpuhost.sysfs import Sysfs
    from vgpuhost.vgpu import list_vgpus

    spec_text = bundled_specs()["a100-sriov-mdev"].read_text()
    root, state = tmp_path / "host", tmp_path / "state"
    materialise(parse_spec(spec_text), root)
    config = tmp_path / "config.yaml"
    config.write_text("version: 1\nlayouts:\n  compute:\n    gpus:\n"
                      "      - select: {address: \"0000:41:00.0\"}\n        mode: vgpu\n"
                      "        vgpu: {types: {A100-8C: 2}}\n")
    base = ["--root", str(root), "--state-dir", str(state)]
    assert run(capsys, *base, "apply", "-c", str(config))[0] == 0
    assert run(capsys, *base, "vgpu", "create", "--profile", "A100-8C")[0] == 0
    host = HostRoot.from_env(root, state)

    def vgpus():
        store = StateStore(state, create=False)
        return sorted((v.id, v.owner, v.state) for v in list_vgpus(discover(Sysfs(host)), store.vgpu_records()))

    before = vgpus()
    assert sorted(o for _, o, _ in before) == ["layout", "layout", "manual"]

    # reboot: a fresh tree (flaky: one vGPU create fails once)
    fault = '\nfaults:\n  - {op: create, device: "0000:41:00.0", errno: EIO, count: 1}\n' if flaky else ""
    materialise(parse_spec(spec_text + fault), root, force=True)
    assert {s for _, _, s in vgpus()} == {"missing"}

    exe = str(Path(sys.executable).parent / "vgpuhost")
    texts = {name: units.render(name, exe=exe, config=str(config), retries=3, retry_delay=0)
             for name in units.UNIT_NAMES}
    assert units.LAYOUT_UNIT in unit_lines(texts[units.RECONCILE_UNIT])["After"][0].split()
    for name in (units.LAYOUT_UNIT, units.RECONCILE_UNIT):        # the After= order
        env = dict(os.environ, VGPUHOST_ROOT=str(root), VGPUHOST_STATE_DIR=str(state))
        env.update(unit_environment(texts[name]))
        proc = subprocess.run(exec_start_argv(texts[name]), env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        if name == units.LAYOUT_UNIT and flaky:
            assert "vgpuhost-layout: try 1 of 3 failed (exit 3)" in proc.stderr
            assert "EIO" in proc.stderr
        else:
            assert "failed" not in proc.stderr, proc.stderr

    after = vgpus()
    assert sorted((o, s) for _, o, s in after) == [("layout", "active")] * 2 + [("manual", "active")]
    manual = [i for i, o, _ in before if o == "manual"]
    assert [i for i, o, _ in after if o == "manual"] == manual          # reconcile: the same id
    store = StateStore(state, create=False)
    assert check(host, store, load_config(config)).in_sync
    actors = {r.actor.split(" ")[0] for r in store.audit_rows(None)}      # the layout adds "apply compute"
    assert {"systemd:vgpuhost-layout.service", "systemd:vgpuhost-reconcile.service"} <= actors
    assert after == [(i, o, "active") for i, o, _ in before]          # the same ids, all back
