"""The CLI as an operator meets it: exit codes, one-line errors, --json contracts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vgpuhost.cli.main import main

from conftest import golden


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_host_check_exit_codes(make_host, capsys):
    assert run(capsys, "--root", str(make_host("a40-mdev").root), "host", "check")[0] == 0
    code, out, err = run(capsys, "--root", str(make_host("iommu-off").root), "host", "check")
    assert code == 1 and "IOMMU_OFF" in out and "intel_iommu=on" in out and "host is NOT ready" in out
    code, out, _ = run(capsys, "--root", str(make_host("sata-shared-group").root), "host", "check")
    assert code == 1 and "SATA controller" in out


def test_host_check_json_contract(make_host, capsys):
    code, out, _ = run(capsys, "--root", str(make_host("sata-shared-group").root), "--json", "host", "check")
    doc = json.loads(out)
    assert code == 1
    assert doc["schema"] == "vgpuhost.host-check/v1" and doc["ready"] is False
    assert set(doc["counts"]) == {"error", "warning", "info", "ok"}
    f = next(f for f in doc["findings"] if f["code"] == "GROUP_NOT_VIABLE")
    assert set(f) == {"severity", "code", "subject", "message", "fix"}
    assert f["subject"] == "0000:03:00.0" and f["fix"]


def test_gpus_and_types_human_goldens(make_host, capsys):
    root = str(make_host("a40-mdev").root)
    code, out, _ = run(capsys, "--root", root, "gpus")
    assert code == 0
    golden("cli", "gpus-a40-mdev.txt", out)
    code, out, _ = run(capsys, "--root", root, "types", "--gpu", "0000:81:00.0")
    assert code == 0
    golden("cli", "types-a40-mdev.txt", out)
    code, out, _ = run(capsys, "--root", str(make_host("turing-consumer").root), "host", "check")
    golden("cli", "host-check-turing-consumer.txt", out)


def test_types_json_contract_and_available_filter(make_host, capsys, fs_of):
    host = make_host("a100-sriov-mdev")
    code, out, _ = run(capsys, "--root", str(host.root), "--json", "types")
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "vgpuhost.types/v1"
    e = next(t for t in doc["types"] if t["name"] == "A100-8C")
    assert e["type_id"] == "nvidia-470" and e["backend"] == "mdev" and e["raw_name"] == "GRID A100-8C"
    assert e["max_instances"] == 5 and e["framebuffer_mib"] == 8192 and e["series"] == "C"
    assert len(e["parents"]) == 20 and all(p["available_instances"] == 1 for p in e["parents"])
    code, out, _ = run(capsys, "--root", str(host.root), "--json", "types", "--available")
    names = {t["name"] for t in json.loads(out)["types"]}
    assert "A100-8C" in names and "A100-1-5C" not in names   # MIG-backed: none free with MIG off


def test_gpus_json_contract(make_host, capsys):
    code, out, _ = run(capsys, "--root", str(make_host("l40s-vendor-vfio").root), "--json", "gpus")
    doc = json.loads(out)
    assert doc["schema"] == "vgpuhost.gpus/v1" and doc["iommu_enabled"] is True
    g = doc["gpus"][1]
    assert g["address"] == "0000:a1:00.0" and g["numa_node"] == 1 and g["vgpu_backend"] == "vendor-vfio"
    assert g["sriov"]["numvfs"] == 16 and g["sriov"]["totalvfs"] == 32 and len(g["sriov"]["vfs"]) == 16
    assert g["backends"] == ["passthrough", "vendor-vfio"] and g["mig"] is None


@pytest.mark.parametrize("bdf", ["41:00.0", "../../etc", "0000:41:00.8", "0000:zz:00.0", ""])
def test_bad_bdf_is_one_line_exit_2(make_host, capsys, bdf):
    code, out, err = run(capsys, "--root", str(make_host("a40-mdev").root), "types", "--gpu", bdf)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vgpuhost: error: invalid PCI address")
    assert "Traceback" not in err


def test_unknown_gpu_names_the_gpus(make_host, capsys):
    code, _, err = run(capsys, "--root", str(make_host("a40-mdev").root), "types", "--gpu", "0000:41:00.0")
    assert code == 2 and "no NVIDIA GPU at 0000:41:00.0" in err and "0000:81:00.0" in err


def test_short_bdf_suggests_full_form(capsys, make_host):
    _, _, err = run(capsys, "--root", str(make_host("a40-mdev").root), "types", "--gpu", "81:00.0")
    assert "did you mean 0000:81:00.0?" in err


def test_missing_root(capsys, tmp_path):
    code, _, err = run(capsys, "--root", str(tmp_path / "nope"), "gpus")
    assert code == 2 and "is not a directory" in err and err.count("\n") == 1


def test_unreadable_sysfs_file_is_one_line(make_host, capsys):
    host = make_host("a40-mdev")
    vendor = host.pci_device("0000:81:00.0") / "vendor"
    os.chmod(vendor, 0)
    try:
        if os.access(vendor, os.R_OK):   # root ignores modes: make it unreadable another way
            vendor.unlink()
            vendor.mkdir()               # reading a directory fails with EISDIR
        code, out, err = run(capsys, "--root", str(host.root), "gpus")
    finally:
        if vendor.is_dir():
            vendor.rmdir()
            vendor.write_text("0x10de\n")
        os.chmod(vendor, 0o644)
    assert code == 2 and out == ""
    assert err.startswith("vgpuhost: error: reading ") and "0000:81:00.0" in err and "vendor" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_garbage_in_sysfs_number_is_one_line(make_host, capsys):
    host = make_host("a40-mdev")
    (host.pci_device("0000:81:00.0") / "numa_node").write_text("banana\n")
    code, _, err = run(capsys, "--root", str(host.root), "gpus")
    assert code == 2 and "numa_node" in err and "expected a number" in err


def test_env_root(make_host, monkeypatch, capsys):
    host = make_host("a40-mdev")
    monkeypatch.setenv("VGPUHOST_ROOT", str(host.root))
    code, out, _ = run(capsys, "--json", "gpus")
    assert code == 0 and json.loads(out)["gpus"][0]["address"] == "0000:81:00.0"


def test_sim_create_and_specs(tmp_path, capsys):
    code, out, _ = run(capsys, "--json", "sim", "specs")
    names = {s["name"] for s in json.loads(out)["specs"]}
    assert code == 0 and "turing-consumer" in names
    dest = tmp_path / "h"
    code, out, _ = run(capsys, "sim", "create", "a40-mdev", str(dest))
    assert code == 0 and (dest / ".vgpuhost-sim" / "host.json").is_file()
    code, _, err = run(capsys, "sim", "create", "a40-mdev", str(dest))
    assert code == 2 and "not empty" in err and "--force" in err
    assert run(capsys, "sim", "create", "--force", "a40-mdev", str(dest))[0] == 0
    code, _, err = run(capsys, "sim", "create", "no-such-spec", str(tmp_path / "x"))
    assert code == 2 and "no host spec 'no-such-spec'" in err and "a40-mdev" in err


def test_sim_create_refuses_to_replace_a_non_simulated_dir(tmp_path, capsys):
    d = tmp_path / "precious"
    d.mkdir()
    (d / "keep").write_text("x")
    code, _, err = run(capsys, "sim", "create", "--force", "a40-mdev", str(d))
    assert code == 2 and "not a simulated host root" in err and (d / "keep").exists()


#: runs vgpuhost as the Debian package ``vgpuhost`` does without ``vgpuhost-sim``: the simulator's modules absent
_WITHOUT_SIM = """
import sys
class NoSim:
    def find_spec(self, name, path=None, target=None):
        if name == "vgpuhost.sim" or name.startswith("vgpuhost.sim.") or name == "vgpuhost.demo":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoSim())
from vgpuhost.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_the_simulator_package_sim_commands_and_simulated_roots_name_it(make_host, tmp_path):
    """The Debian package vgpuhost ships without the simulator (vgpuhost-sim): what needs it says so, exit 2."""
    root = str(make_host("a40-mdev").root)

    def vgpuhost(*argv):
        return subprocess.run([sys.executable, "-c", _WITHOUT_SIM, *argv], capture_output=True, text=True)

    for argv in (["sim", "specs"], ["sim", "create", "a40-mdev", str(tmp_path / "h")], ["sim", "--help"]):
        p = vgpuhost(*argv)
        assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, (argv, p.stdout, p.stderr)
        assert "'vgpuhost sim' is not installed" in p.stderr and "apt install vgpuhost-sim" in p.stderr, p.stderr
    assert not (tmp_path / "h").exists()
    p = vgpuhost("--help")                                     # every other command is still listed
    assert p.returncode == 0 and "comes with the vgpuhost-sim package" in p.stdout and "capacity" in p.stdout
    # a write on a simulated root needs the simulated kernel: refused, nothing made
    before = sorted(os.listdir(os.path.join(root, "sys", "bus", "mdev", "devices")))
    p = vgpuhost("--root", root, "--local", "vgpu", "create", "--gpu", "0000:81:00.0", "--profile", "A40-8Q")
    assert p.returncode == 2 and "is a simulated host, and the simulator is not installed" in p.stderr, p.stderr
    assert sorted(os.listdir(os.path.join(root, "sys", "bus", "mdev", "devices"))) == before


def test_console_script_entry_point_runs(make_host):
    root = str(make_host("a40-mdev").root)
    p = subprocess.run([sys.executable, "-m", "vgpuhost", "--root", root, "types", "--gpu", "41:00.0"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1


@pytest.mark.parametrize("what", ["empty", "no-sys"])
def test_a_directory_that_is_not_a_host_root(tmp_path, make_host, capsys, what):
    if what == "empty":
        root = tmp_path / "empty"
        root.mkdir()
    else:
        host = make_host("a40-mdev")
        import shutil as _sh
        _sh.rmtree(host.root / "sys")
        root = host.root
    code, out, err = run(capsys, "--root", str(root), "host", "check")
    assert code == 2 and out == "" and "is not a host root" in err and err.count("\n") == 1


def test_fifo_in_the_tree_does_not_hang(make_host, capsys):
    host = make_host("a40-mdev")
    f = host.mdev_bus / "0000:81:00.0" / "mdev_supported_types" / "nvidia-566" / "available_instances"
    f.unlink()
    os.mkfifo(f)
    code, out, _ = run(capsys, "--root", str(host.root), "--json", "types")
    assert code == 0
    e = next(t for t in json.loads(out)["types"] if t["type_id"] == "nvidia-566")
    assert e["available_instances"] == 0


def test_control_characters_from_files_are_escaped(make_host, capsys):
    host = make_host("a40-mdev")
    (host.mdev_bus / "0000:81:00.0" / "mdev_supported_types" / "nvidia-566" / "name").write_text(
        "NVIDIA A40-8Q\x1b[31m\nX\n")
    code, out, _ = run(capsys, "--root", str(host.root), "types")
    assert code == 0 and "\x1b" not in out
    assert len(out.splitlines()) == 30            # header + 29 types: the newline did not split a row
    (host.pci_device("0000:81:00.0") / "numa_node").write_text("\x07\x1b[2J")
    code, _, err = run(capsys, "--root", str(host.root), "gpus")
    assert code == 2 and "\x1b" not in err and "\x07" not in err


@pytest.mark.parametrize("argv", [["no-such-command"], ["types", "--bogus"], ["types", "--gpu"],
                                  ["passthrough", "prepare"], ["scheduler", "set"]])
def test_usage_errors_are_one_line(capsys, argv, make_host):
    code, out, err = run(capsys, "--root", str(make_host("a40-mdev").root), *argv)
    assert code == 2 and err.startswith("vgpuhost: error: ") and err.count("\n") == 1 and "--help" in err
    assert "\\n" not in err and "\\t" not in err      # click's multi-line choices, not escaped layout


def test_overlong_root_and_bdf(capsys, make_host):
    code, _, err = run(capsys, "--root", "/" + "x" * 300, "gpus")
    assert code == 2 and err.count("\n") == 1
    code, _, err = run(capsys, "--root", str(make_host("a40-mdev").root), "types", "--gpu", "9" * 5000)
    assert code == 2 and len(err) < 400


# (--json after the command is accepted: tests/test_cli_conventions.py)
@pytest.mark.parametrize("option", ["-v", "--root"])
def test_a_global_option_after_the_command_says_where_it_goes(make_host, capsys, option):
    host = make_host("a40-mdev")
    code = main(["--root", str(host.root), "types", option] + (["/x"] if option == "--root" else []))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{option} is a global option: put it before the command (vgpuhost {option} ...)" in err
