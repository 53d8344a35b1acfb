"""The lean read path (issue 17 #2): `vgpuhost types` starts without click and the write paths,
reads only what vGPU types need, and prints the same bytes as the click command.

Outcomes: the printed text and exit codes of both paths, the modules a real
`python -m vgpuhost ... types` process imported (-X importtime), the inventory
values both discovery scopes return, and json.dumps's own text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vgpuhost.cli import lean
from vgpuhost.cli.main import COMMAND_FAMILY, FAMILIES, cli, load_all, main
from vgpuhost.cli.output import dumps
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.observe.inventory import SCOPE_VGPU, discover
from vgpuhost.sim.data import bundled_specs

A40 = "0000:81:00.0"


def run_both(capsys, argv):
    """(exit code, stdout, stderr) of the lean path and of click's, for one command line."""
    out = []
    for use_lean in (True, False):
        code = main(argv, lean=use_lean)
        o, e = capsys.readouterr()
        out.append((code, o, e))
    return out


@pytest.mark.parametrize("extra", [
    ["types"], ["--json", "types"], ["types", "--available"], ["--json", "types", "--gpu", A40],
    ["types", f"--gpu={A40}", "--available"], ["--json", "types", "--gpu", "0000:99:00.0"],
    ["types", "--gpu", "81:00.0"], ["--json", "types", "--gpu", "nonsense"], ["gpus"], ["--json", "gpus"],
])
def test_lean_types_prints_what_click_prints(make_host, capsys, extra):
    host = make_host("a40-mdev")
    argv = ["--root", str(host.root), *extra]
    assert lean.match(argv) is not None
    fast, slow = run_both(capsys, argv)
    assert fast == slow
    assert fast[1] or fast[2]


def test_lean_types_on_a_missing_root_reports_as_click_does(tmp_path, capsys):
    argv = ["--root", str(tmp_path / "absent"), "--json", "types"]
    fast, slow = run_both(capsys, argv)
    assert fast == slow and fast[0] == 2 and "vgpuhost.error/v1" in fast[1]


@pytest.mark.parametrize("argv", [
    ["-v", "types"], ["types", "--help"], ["--help"], ["gpus", "--gpu", "x"], ["types", "--bogus"],
    ["types", "extra"], ["host", "check"], ["vgpu", "list"], ["gpus", "--json"],
    ["--root", "a", "--root", "b", "types"], ["types", "--gpu"], ["--root", "--json", "types"],
    ["types", "--gpu", "x", "--gpu", "y"], ["--json", "--json", "types"], ["types", "--json"],
    ["--connect", "qemu:///system", "types"], ["--root"], [],
])
def test_anything_else_goes_to_click(argv):
    assert lean.match(argv) is None


def _imported(argv, env=None):
    """Module names a real `python -m vgpuhost ARGV` imported, and its stdout."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "vgpuhost", *argv], capture_output=True,
                          text=True, env=env)
    names = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc.returncode, names, proc.stdout


def test_types_process_loads_no_click_no_store_no_simulator(make_host):
    host = make_host("a100-sriov-mdev")
    code, names, out = _imported(["--root", str(host.root), "--json", "types"])
    assert code == 0 and json.loads(out)["types"]
    assert "vgpuhost.observe.inventory" in names          # the probe sees imports at all
    for heavy in ("click", "sqlite3", "vgpuhost.io.state", "vgpuhost.sim.kernel", "vgpuhost.policy.checks",
                  "logging", "typing", "vgpuhost.ops.vgpu", "vgpuhost.plan.executor"):
        assert heavy not in names, heavy


def test_other_commands_still_go_through_click(make_host):
    host = make_host("a40-mdev")
    script = ("import sys\nfrom vgpuhost.cli.main import main\n"
              f"code = main(['--root', {str(host.root)!r}, '--json', 'gpus'], lean=False)\n"
              "print(code, ' '.join(sorted(m for m in sys.modules if m.startswith(('click', 'vgpuhost.cli.')))))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    last = proc.stdout.splitlines()[-1].split()
    assert last[0] == "0" and json.loads(proc.stdout[:proc.stdout.rindex("\n0 ")])["gpus"][0]["address"] == A40
    names = set(last[1:])
    assert "click" in names and "vgpuhost.cli.host" in names
    assert "vgpuhost.cli.vgpu" not in names and "vgpuhost.cli.metering" not in names     # one family only


def test_a_failing_lean_command_exits_as_documented(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vgpuhost", "--root", str(tmp_path / "no"), "types"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("vgpuhost: error: ") and proc.stdout == ""


def test_the_family_map_names_every_command_of_every_family():
    load_all()
    import importlib
    have = {}
    for name in FAMILIES:
        for command in importlib.import_module(f"vgpuhost.cli.{name}").COMMANDS:
            have[command.name] = name
    assert have == COMMAND_FAMILY
    assert sorted(cli.list_commands(None)) == sorted(have)


# ---------------------------------------------------------------------------
# discovery scoped to vGPU types reads the same GPUs, types and vGPUs

@pytest.mark.parametrize("name", sorted(bundled_specs()))
def test_vgpu_scope_sees_what_the_host_scope_sees(make_host, name):
    host = make_host(name)
    full = discover(Sysfs(host))
    lean_inv = discover(Sysfs(host), scope=SCOPE_VGPU)
    assert lean_inv.gpus == full.gpus
    assert lean_inv.vgpu_types == full.vgpu_types
    assert lean_inv.mdevs == full.mdevs and lean_inv.vf_vgpus == full.vf_vgpus
    assert set(lean_inv.devices) == {g.address for g in full.gpus}
    assert lean_inv.host.processes == frozenset() and lean_inv.host.cmdline == ""


def test_vgpu_scope_after_changes(make_host, capsys):
    from vgpuhost.io.state import StateStore
    from vgpuhost.ops.vgpu import create
    for name, profile in (("a100-sriov-mdev", "A100-4C"), ("l40s-vendor-vfio", "L40S-8Q"), ("a40-mdev", "A40-8Q")):
        host = make_host(name)
        create(host, StateStore(host.state_dir), profile=profile, owner="manual")
        full = discover(Sysfs(host))
        part = discover(Sysfs(host), scope=SCOPE_VGPU)
        assert (part.gpus, part.vgpu_types, part.mdevs, part.vf_vgpus) == (
            full.gpus, full.vgpu_types, full.mdevs, full.vf_vgpus)
        assert part.mdevs or any(v.type_id for v in part.vf_vgpus)


def test_an_unknown_scope_is_a_bug(make_host):
    with pytest.raises(ValueError):
        discover(Sysfs(make_host("a40-mdev")), scope="gpu")


# ---------------------------------------------------------------------------
# dumps: the documented --json text

def test_dumps_refuses_what_json_refuses():
    with pytest.raises(TypeError):
        dumps({"a": {1, 2}})
    with pytest.raises(TypeError):
        dumps({(1, 2): 3})


def test_dumps_of_a_types_document(make_host, capsys):
    host = make_host("a100-sriov-mdev")
    assert main(["--root", str(host.root), "--json", "types"]) == 0
    text = capsys.readouterr().out
    assert text == json.dumps(json.loads(text), indent=2) + "\n"
    assert os.linesep == "\n"


# ---------------------------------------------------------------------------
# what `types` reads, and that the capacity index is built once

def test_types_reads_only_the_gpus_their_types_and_vgpus(make_host, monkeypatch):
    host = make_host("a100-sriov-mdev")          # 20 VFs x 12 types, an HD-audio companion, a NIC
    reads = []
    real_open = os.open
    dirs = {}           # a directory's fd -> its path: a file opened relative to it (openat) is named in full

    def counting_open(path, flags, *args, dir_fd=None, **kwargs):
        full = str(path) if dir_fd is None else f"{dirs[dir_fd]}/{path}"
        if dir_fd is None:
            fd = real_open(path, flags, *args, **kwargs)
        else:
            fd = real_open(path, flags, *args, dir_fd=dir_fd, **kwargs)
        if flags & os.O_DIRECTORY:
            dirs[fd] = full.rstrip("/")         # a directory opened: no file read
        else:
            reads.append(full)
        return fd

    monkeypatch.setattr(os, "open", counting_open)
    inv = discover(Sysfs(host), scope=SCOPE_VGPU)
    monkeypatch.setattr(os, "open", real_open)
    rel = [p[len(str(host.root)):] for p in reads]
    assert not [p for p in rel if p.startswith("/proc") or "/lib/modules" in p]
    # the NIC: its vendor only; the NVIDIA audio function: vendor and class (not a display function)
    assert [p for p in rel if "0000:00:1f.6" in p] == ["/sys/bus/pci/devices/0000:00:1f.6/vendor"]
    assert [p.rsplit("/", 1)[1] for p in rel if "0000:41:00.1/" in p] == ["vendor", "class"]
    per_type = [p for p in rel if "/mdev_supported_types/" in p]
    pairs = len(inv.vgpu_types)
    assert pairs == 20 * 12
    kinds = {p.rsplit("/", 1)[1] for p in per_type}
    assert sum(p.endswith("/available_instances") for p in per_type) == pairs      # one per (VF, type)
    assert len(per_type) == pairs + 3 * 12 and kinds == {"available_instances", "name", "description",
                                                         "device_api"}            # the rest once per type


def test_types_builds_the_gpu_index_once(make_host, monkeypatch, capsys):
    from vgpuhost.observe import inventory
    calls = []
    real = inventory._build_index
    monkeypatch.setattr(inventory, "_build_index", lambda inv: calls.append(1) or real(inv))
    host = make_host("l40s-vendor-vfio")
    assert main(["--root", str(host.root), "--json", "types"]) == 0
    assert len(json.loads(capsys.readouterr().out)["types"]) > 20 and calls == [1]


# ---------------------------------------------------------------------------
# the --json encoder: exactly json.dumps(doc, indent=2), faster (issue 31)

from hypothesis import given, settings, strategies as st  # noqa: E402

_leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_docs = st.recursive(_leaf, lambda kids: st.lists(kids, max_size=4) | st.tuples(kids, kids)
                     | st.dictionaries(st.text(max_size=6) | st.integers(), kids, max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_docs)
def test_the_json_encoder_writes_what_json_dumps_indent_2_writes(doc):
    import json
    from vgpuhost.cli.output import indented        # what dumps() writes (the schema plugin wraps dumps)
    assert indented(doc) == json.dumps(doc, indent=2)


def test_the_lean_launcher_prints_what_the_module_prints_and_starts_other_commands_with_site(make_host, tmp_path):
    """vgpuhost/cli/launcher.py: types without site, byte for byte the output of python -m vgpuhost; any
    other command line with site.main() run first (click comes from site-packages)."""
    from vgpuhost.cli.launcher import launcher_text, main as launcher_main
    import contextlib
    import io
    host = make_host("a40-mdev")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert launcher_main([]) == 0
    script = tmp_path / "vgpuhost"
    script.write_text(buf.getvalue())
    script.chmod(0o755)
    assert buf.getvalue().startswith(f"#!{sys.executable} -S\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    lean = subprocess.run([str(script), "--root", str(host.root), "--json", "types"], capture_output=True,
                          text=True, env=env, check=True)
    plain = subprocess.run([sys.executable, "-m", "vgpuhost", "--root", str(host.root), "--json", "types"],
                           capture_output=True, text=True, env=env, check=True)
    assert lean.stdout == plain.stdout and json.loads(lean.stdout)["types"]
    # the lean start imports no site (nor click); another command line imports site first (PYTHON* honoured: -S only)
    timed = dict(env, PYTHONPROFILEIMPORTTIME="1")
    lean = subprocess.run([str(script), "--root", str(host.root), "--json", "types"], capture_output=True,
                          text=True, env=timed, check=True)
    imported = {line.split("|")[-1].strip() for line in lean.stderr.splitlines() if line.startswith("import time:")}
    assert "vgpuhost.cli.lean" in imported and "site" not in imported and "click" not in imported
    # nor a pure-Python module of the standard library beyond os (pathlib alone brings re, enum, urllib)
    assert not imported & {"pathlib", "re", "enum", "json", "urllib.parse", "functools"}, imported
    other = subprocess.run([str(script), "--root", str(host.root), "tenant", "list"], capture_output=True, text=True,
                           env=timed)
    imported = {line.split("|")[-1].strip() for line in other.stderr.splitlines() if line.startswith("import time:")}
    assert other.returncode == 0 and "no tenants" in other.stdout and {"site", "click"} <= imported
    with pytest.raises(ValueError):
        launcher_text("python3", "/x", [])
