"""CLI conventions (issue 29 item 6): ``--json`` after the command, ``audit --op``, ``audit --gpu`` naming a
GPU's VFs and vGPUs.  Read back from the audit log the commands wrote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vgpuhost.cli.lean import hoist_json
from vgpuhost.cli.main import main

OWNER = "11111111-2222-4333-8444-0000000000c1"


@pytest.mark.parametrize("argv, want", [
    (["types", "--json"], ["--json", "types"]),
    (["--root", "/r", "audit", "--op", "vgpu", "--json"], ["--json", "--root", "/r", "audit", "--op", "vgpu"]),
    (["--json", "types", "--json"], ["--json", "types"]),
    (["vgpu", "create", "--", "--json"], ["vgpu", "create", "--", "--json"]),
    (["--root", "/r"], ["--root", "/r"]),
    (["-c", "x", "gpus"], ["-c", "x", "gpus"]),
])
def test_json_after_the_command_moves_before_it(argv, want):
    assert hoist_json(argv) == want


def test_json_after_the_command_prints_the_document_on_both_paths(make_host, capsys):
    host = make_host("a40-mdev")
    assert main(["--root", str(host.root), "gpus", "--json"]) == 0              # the lean path
    assert json.loads(capsys.readouterr().out)["schema"] == "vgpuhost.gpus/v1"
    assert main(["--root", str(host.root), "audit", "--json"]) == 0             # click's path
    assert json.loads(capsys.readouterr().out)["schema"] == "vgpuhost.audit/v1"
    # the installed entry point (vgpuhost.cli.entry) too
    proc = subprocess.run([sys.executable, "-m", "vgpuhost", "--root", str(host.root), "types", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and json.loads(proc.stdout)["schema"] == "vgpuhost.types/v1", proc.stderr


def test_audit_gpu_names_the_vf_a_vendor_vfio_vgpu_is_written_through(make_host, capsys):
    host = make_host("l40s-vendor-vfio")
    root = str(host.root)
    assert main(["--root", root, "--json", "vgpu", "create", "--profile", "L40S-4Q", "--gpu", "0000:21:00.0",
                 "--owner", OWNER]) == 0
    vf = json.loads(capsys.readouterr().out)["id"]
    assert vf.startswith("0000:21:00.") and vf != "0000:21:00.0"
    assert main(["--root", root, "--json", "vgpu", "remove", vf]) == 0
    capsys.readouterr()
    assert main(["--root", root, "--json", "audit", "--gpu", "0000:21:00.0"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    writes = [r for r in rows if r["path"].startswith("/sys/")]
    # the type written to the VF and the removal (0), both named by the VF's path only
    assert [(r["path"], r["value"]) for r in writes] == [
        (f"/sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type", writes[0]["value"]),
        (f"/sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type", "0")], writes
    assert writes[0]["value"] != "0"
    # the other GPU's audit holds none of it
    assert main(["--root", root, "--json", "audit", "--gpu", "0000:a1:00.0"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == []


def test_audit_gpu_keeps_a_removed_mdevs_rows(make_host, capsys):
    """An mdev's removal is written through its UUID only (``/sys/bus/mdev/devices/<uuid>/remove``), and its
    record is gone after it: ``audit --gpu`` still finds it, by the UUID the create row wrote to that GPU."""
    host = make_host("a100-sriov-mdev")
    root = str(host.root)
    assert main(["--root", root, "--json", "vgpu", "create", "--profile", "A100-8C", "--owner", OWNER]) == 0
    mdev = json.loads(capsys.readouterr().out)["id"]
    assert main(["--root", root, "--json", "vgpu", "remove", mdev]) == 0
    capsys.readouterr()
    assert main(["--root", root, "--json", "audit", "--gpu", "0000:41:00.0"]) == 0
    writes = [r["path"] for r in json.loads(capsys.readouterr().out)["rows"] if r["path"].startswith("/sys/")]
    assert len(writes) == 2 and writes[0].endswith("/create"), writes
    assert writes[1] == f"/sys/bus/mdev/devices/{mdev}/remove", writes


def test_audit_op_matches_leading_words(make_host, capsys):
    host = make_host("a40-mdev")
    root = str(host.root)
    assert main(["--root", root, "vgpu", "create", "--profile", "A40-8Q", "--owner", OWNER]) == 0
    assert main(["--root", root, "tenant", "add", "t1", "--vgpus", "1"]) == 0
    capsys.readouterr()
    assert main(["--root", root, "--json", "audit", "--op", "vgpu create"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["filters"]["op"] == "vgpu create" and doc["rows"]
    assert all(r["operation"].startswith("vgpu create ") for r in doc["rows"])
    assert main(["--root", root, "--json", "audit", "--op", "TENANT"]) == 0
    ops = [r["operation"] for r in json.loads(capsys.readouterr().out)["rows"]]
    assert ops and all(o.lower().split()[0] == "tenant" for o in ops), ops
    assert main(["--root", root, "audit", "--op", "vgpu crea"]) == 0         # words, not a prefix of one
    assert capsys.readouterr().out.strip() == "no audit rows match"


TWO_LAYOUTS = """version: 1
layouts:
  eight:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu: {types: {A40-8Q: 2}}
  four:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu: {types: {A40-4Q: 3}}
"""


def _mdevs(host):
    return sorted(p.name for p in host.mdev_devices.iterdir()) if host.mdev_devices.exists() else []


def test_apply_on_a_terminal_asks_before_removing_the_layouts_vgpus(make_host, tmp_path, monkeypatch):
    from click.testing import CliRunner
    from vgpuhost.cli import layout as cli_layout
    from vgpuhost.cli.main import cli
    host = make_host("a40-mdev")
    cfg = tmp_path / "layouts.yaml"
    cfg.write_text(TWO_LAYOUTS)
    base = ["--root", str(host.root), "--local"]
    assert main(base + ["apply", "-c", str(cfg), "eight"]) == 0
    eight = _mdevs(host)
    assert len(eight) == 2
    monkeypatch.setattr(cli_layout, "interactive", lambda: True)
    runner = CliRunner()
    # declined: nothing changed
    res = runner.invoke(cli, base + ["apply", "-c", str(cfg), "four"], input="n\n")
    assert res.exit_code != 0 and isinstance(res.exception, Exception)
    assert "apply would remove 2 vGPUs of layout 'four'" in res.output and "Remove them?" in res.output
    assert _mdevs(host) == eight
    # accepted: the two are removed and the three made
    res = runner.invoke(cli, base + ["apply", "-c", str(cfg), "four"], input="y\n")
    assert res.exit_code == 0, res.output
    four = _mdevs(host)
    assert len(four) == 3 and not set(four) & set(eight)
    # --yes: not asked (no input to give)
    res = runner.invoke(cli, base + ["apply", "-c", str(cfg), "eight", "--yes"], input="")
    assert res.exit_code == 0 and "Remove them?" not in res.output, res.output
    assert len(_mdevs(host)) == 2 and not set(_mdevs(host)) & set(four)


def test_apply_declined_at_the_prompt_exits_2_saying_nothing_changed(make_host, tmp_path, monkeypatch, capsys):
    from vgpuhost.cli import layout as cli_layout
    host = make_host("a40-mdev")
    cfg = tmp_path / "layouts.yaml"
    cfg.write_text(TWO_LAYOUTS)
    base = ["--root", str(host.root), "--local"]
    assert main(base + ["apply", "-c", str(cfg), "eight"]) == 0
    before = _mdevs(host)
    monkeypatch.setattr(cli_layout, "interactive", lambda: True)
    monkeypatch.setattr("click.confirm", lambda *a, **k: False)
    capsys.readouterr()
    assert main(base + ["apply", "-c", str(cfg), "four"]) == 2
    err = capsys.readouterr().err
    assert "apply cancelled at the prompt: nothing was changed" in err and "--yes" in err
    assert _mdevs(host) == before


def _complete(root, words, shell="bash_complete"):
    """What the installed ``vgpuhost`` offers for the last word of ``words`` (click's completion protocol,
    as the generated bash script calls it)."""
    import os
    env = {**os.environ, "_VGPUHOST_COMPLETE": shell, "COMP_WORDS": " ".join(["vgpuhost", "--root", str(root)] + words),
           "COMP_CWORD": str(2 + len(words))}
    proc = subprocess.run([sys.executable, "-m", "vgpuhost"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [line.split(",", 1)[1] for line in proc.stdout.splitlines() if line.startswith("plain,")]


def test_completion_offers_the_hosts_profiles_gpus_tenants_and_specs(make_host):
    host = make_host("l40s-vendor-vfio")
    assert main(["--root", str(host.root), "tenant", "add", "alpha"]) == 0
    assert main(["--root", str(host.root), "tenant", "add", "beta"]) == 0
    assert _complete(host.root, ["vgpu", "create", "--profile", "L40S-4"]) == [
        "L40S-48A", "L40S-48C", "L40S-48Q", "L40S-4A", "L40S-4C", "L40S-4Q"]
    assert _complete(host.root, ["passthrough", "prepare", "0000:a"]) == ["0000:a1:00.0"]
    assert _complete(host.root, ["types", "--gpu", ""]) == ["0000:21:00.0", "0000:a1:00.0"]
    assert _complete(host.root, ["tenant", "show", ""]) == ["alpha", "beta"]
    assert _complete(host.root, ["capacity", "--tenant", "b"]) == ["beta"]
    assert _complete(host.root, ["sim", "create", "a4"]) == ["a40-mdev"]
    assert _complete(host.root, ["tenant", "add", ""]) == []          # a new tenant's name: nothing to offer
    # domains: the ones the state store knows as running (never libvirt: a hung libvirtd would hang the shell)
    from vgpuhost.io.state import StateStore
    StateStore(host.state_dir).domain_started("6f1b1d4e-0000-4000-8000-00000000c0de", "vm-alpha")
    assert _complete(host.root, ["detach", "vm"]) == ["vm-alpha"]
    assert _complete(host.root, ["tenant", "bind", ""]) == ["vm-alpha"]           # tenant bind DOMAIN [TENANT]
    assert _complete(host.root, ["tenant", "bind", "vm-alpha", "a"]) == ["alpha"]
    assert _complete(host.root, ["detach", "6f1b"]) == ["6f1b1d4e-0000-4000-8000-00000000c0de"]


def test_the_zsh_completion_file_completes_on_the_first_tab_when_autoloaded():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("clidoc", Path(__file__).resolve().parents[1] / "tools" / "clidoc.py")
    clidoc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(clidoc)
    text = clidoc.completion("zsh")
    assert text.startswith("#compdef vgpuhost")
    branch = text[text.index("loadautofunc"):]
    assert '_vgpuhost_completion "$@"' in branch and "compdef _vgpuhost_completion vgpuhost" in branch


def test_a_dry_run_of_an_existing_uuid_refuses_as_the_run_does(make_host, capsys):
    host = make_host("a40-mdev")
    base = ["--root", str(host.root), "--local", "vgpu", "create", "--profile", "A40-8Q",
            "--uuid", "aaaaaaaa-1111-4111-8111-0000000000d1"]
    assert main(base) == 0
    capsys.readouterr()
    assert main(base + ["--dry-run"]) == 2
    dry = capsys.readouterr().err
    assert main(base) == 2
    assert capsys.readouterr().err == dry and "already exists" in dry
