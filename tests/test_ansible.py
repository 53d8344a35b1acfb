"""The Ansible collection (ansible/): lint, the role against a simulated host, and the module's code paths.

- ``ansible-lint --profile production`` on the collection, offline.
- Three real ``ansible-playbook`` runs of the role against localhost
  (connection local) with ``vgpuhost_root`` at a simulated host: the first
  converges (files, hook, units, fact and the layout read back from the
  tree and the state store), the second reports ``changed=0``, and
  ``--check --diff`` after a hand-made drift shows the plan and changes
  nothing.
- The ``vgpuhost_layout`` module driven in-process, as Ansible's own unit
  tests drive modules, for the paths the playbook runs do not take
  (asserted, blocked, a bad config, no host).

The collection is found through a collections path in a temp dir
(``ansible_collections/vgpuhost/vgpuhost`` -> ``ansible/``); Ansible's
home and temp dirs are temp dirs too, so nothing outside them is written.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from nsutil import skip_or_fail
from vgpuhost.policy.config import load as load_config
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.observe.inventory import discover
from vgpuhost.ops.layout import check
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.ops.vgpu import list_vgpus

REPO = Path(__file__).resolve().parents[1]
COLLECTION = REPO / "ansible"
DATA = Path(__file__).parent / "data" / "ansible"
BIN = Path(sys.executable).parent
GPU = "0000:41:00.0"
DOMAIN = "6f1b1d4e-0000-4000-8000-000000000001"

CONFIG = {"version": 1, "layouts": {"compute": {
    "scheduler": {"policy": "equal-share"},
    "gpus": [{"select": {"address": GPU}, "mode": "vgpu", "vgpu": {"types": {"A100-8C": 2}}}]}}}


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        skip_or_fail(f"{name} is not installed in {BIN} (make dev installs the test extra)", "the Ansible tests")
    return str(path)


@pytest.fixture
def ansible_env(tmp_path):
    """Environment for ansible-playbook / ansible-lint: the collection on a temp collections path."""
    coll = tmp_path / "collections"
    (coll / "ansible_collections" / "vgpuhost").mkdir(parents=True)
    (coll / "ansible_collections" / "vgpuhost" / "vgpuhost").symlink_to(COLLECTION)
    home = tmp_path / "ansible-home"
    home.mkdir()
    env = dict(os.environ)
    env.update({
        "ANSIBLE_COLLECTIONS_PATH": str(coll),
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_REMOTE_TEMP": str(home / "remote-tmp"),
        "ANSIBLE_CONFIG": str(home / "none.cfg"),      # no ansible.cfg from the cwd or the machine
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        "ANSIBLE_PIPELINING": "1",
        "ANSIBLE_STDOUT_CALLBACK": "default",
        "ANSIBLE_LOAD_CALLBACK_PLUGINS": "0",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    })
    for var in ("VGPUHOST_ROOT", "VGPUHOST_STATE_DIR", "VGPUHOST_ACTOR", "ANSIBLE_INVENTORY"):
        env.pop(var, None)
    return env


# --- lint -------------------------------------------------------------------

def test_ansible_lint_production_profile(ansible_env):
    """``ansible-lint --profile production ansible/`` from the repository root passes, offline
    (configuration: the repository's .ansible-lint), with no warning: the production profile itself
    is met, not only the safety one (galaxy.yml names a repository: the source page published with
    the docs, docs/source.md, at the mkdocs site_url)."""
    lint = tool("ansible-lint")
    proc = subprocess.run([lint, "--profile", "production", "--offline", "--nocolor", "ansible/"],
                          cwd=COLLECTION.parent,
                          env=ansible_env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"Passed: 0 failure\(s\), 0 warning\(s\)", out), out
    assert "Profile 'production' was required, and it passed." in out, out
    galaxy = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())
    site = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert galaxy["repository"] == site["site_url"] + "source/"         # docs/source.md, built as source/
    assert (REPO / "docs" / "source.md").is_file() and "Source: source.md" in (REPO / "mkdocs.yml").read_text()
    docs_recipe = (REPO / "Makefile").read_text().split("\ndocs: ", 1)[1].split("\n\n", 1)[0]
    assert "--sdist" in docs_recipe and "site/source/" in docs_recipe, docs_recipe    # the archive beside it
    assert not (COLLECTION / ".ansible").exists() or ".ansible/" in (COLLECTION / ".gitignore").read_text()


# --- the role on a simulated host ---------------------------------------------

def recap(out: str):
    m = re.search(r"^localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", out, re.M)
    assert m, f"no PLAY RECAP in:\n{out}"
    return dict(zip(("ok", "changed", "unreachable", "failed"), map(int, m.groups())))


def playbook(env, vars_file: Path, *extra: str):
    argv = [tool("ansible-playbook"), "-i", "localhost,", "-c", "local",
            "-e", f"ansible_python_interpreter={sys.executable}", "-e", f"@{vars_file}", *extra,
            str(DATA / "site.yml")]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out, recap(out)


def vgpus(host: HostRoot):
    store = StateStore(host.state_dir, create=False)
    return sorted((v.id, v.type_name, v.owner, v.state)
                  for v in list_vgpus(discover(Sysfs(host)), store.vgpu_records()))


def tree_state(host: HostRoot):
    """Every file under the root with its mtime (the state store included)."""
    return {str(p.relative_to(host.root)): p.stat().st_mtime_ns
            for p in host.root.rglob("*") if p.is_file() and not p.is_symlink()}


def test_role_converges_then_idempotent_then_check_shows_drift(make_host, ansible_env, tmp_path, capsys):
    host = make_host("a100-sriov-mdev")
    root = host.root
    exe = BIN / "vgpuhost"
    variables = {
        "vgpuhost_root": str(root),
        "vgpuhost_executable": str(exe),
        "vgpuhost_python": sys.executable,
        "vgpuhost_install_package": False,
        "vgpuhost_manage_bootloader": False,
        "vgpuhost_manage_initramfs": False,
        "vgpuhost_systemd": False,
        "vgpuhost_reboot": False,
        "vgpuhost_config": CONFIG,
        "vgpuhost_test_gpus": [GPU],
    }
    vars_file = tmp_path / "vars.json"
    vars_file.write_text(json.dumps(variables))

    # 1. converge
    out, rc = playbook(ansible_env, vars_file)
    assert rc["failed"] == 0 and rc["changed"] > 0, out
    etc = root / "etc"
    assert 'GRUB_CMDLINE_LINUX="${GRUB_CMDLINE_LINUX:+$GRUB_CMDLINE_LINUX }intel_iommu=on iommu=pt"' in \
        (etc / "default" / "grub.d" / "vgpuhost.cfg").read_text().splitlines()
    assert [l for l in (etc / "modules-load.d" / "vgpuhost.conf").read_text().splitlines()
            if not l.startswith("#")] == ["vfio", "vfio_pci", "vfio_iommu_type1"]
    modprobe = (etc / "modprobe.d" / "vgpuhost.conf").read_text().splitlines()
    assert {"softdep nvidia pre: vfio-pci", "blacklist nouveau", "options nouveau modeset=0"} <= set(modprobe)
    cfg = load_config(etc / "vgpuhost" / "config.yaml")
    assert set(cfg.layouts) == {"compute"}
    assert yaml.safe_load((etc / "vgpuhost" / "config.yaml").read_text()) == CONFIG
    layout_unit = (etc / "systemd" / "system" / "vgpuhost-layout.service").read_text()
    assert f"vgpuhost-layout {exe} apply -c /etc/vgpuhost/config.yaml\n" in layout_unit
    assert (etc / "systemd" / "system" / "vgpuhost-reconcile.service").is_file()
    hook = etc / "libvirt" / "hooks" / "qemu.d" / "vgpuhost"
    assert hook.is_file() and os.access(hook, os.X_OK)
    fact = etc / "ansible" / "facts.d" / "vgpuhost.fact"
    assert os.access(fact, os.X_OK)
    doc = json.loads(subprocess.run([str(fact)], capture_output=True, text=True, timeout=60).stdout)
    assert doc["schema"] == "vgpuhost.gpus/v1" and [g["address"] for g in doc["gpus"]] == [GPU]
    # the layout, read back from the tree and the store
    after_first = vgpus(host)
    assert [(t, o, s) for _, t, o, s in after_first] == [("A100-8C", "layout", "active")] * 2
    store = StateStore(host.state_dir, create=False)
    assert check(host, store, cfg).in_sync
    assert any(r.actor.startswith("ansible vgpuhost_layout") for r in store.audit_rows(None))
    # never silent: the switched-off host-wide steps are reported
    assert "bootloader not updated (vgpuhost_root is not /): run update-grub" in out
    assert "systemctl daemon-reload; systemctl enable vgpuhost-layout.service vgpuhost-reconcile.service" in out
    assert "REBOOT PENDING" not in out      # the simulated kernel already runs with what the files ask for

    # 2. idempotent
    out, rc = playbook(ansible_env, vars_file)
    assert rc["changed"] == 0 and rc["failed"] == 0, out
    assert vgpus(host) == after_first

    # 3. a hand-made drift: --check --diff shows it and the plan, and changes nothing
    from vgpuhost.cli.main import main
    assert main(["--root", str(root), "vgpu", "remove", after_first[0][0]]) == 0
    capsys.readouterr()
    drifted = vgpus(host)
    before = tree_state(host)
    out, rc = playbook(ansible_env, vars_file, "--check", "--diff")
    assert rc["failed"] == 0 and rc["changed"] == 1, out
    assert f"- {GPU} vgpu A100-8C x2 (host has 1)" in out
    assert re.search(r"1\. vgpu\s+" + re.escape(GPU) + r"\s+create 1 x A100-8C", out), out
    changed_tasks = re.findall(r"^TASK \[([^\]]+)\].*\n(?:(?!TASK).*\n)*?changed:", out, re.M)
    assert changed_tasks == ["vgpuhost.vgpuhost.vgpuhost : Apply the GPU layout with vgpuhost"], out
    assert vgpus(host) == drifted
    assert tree_state(host) == before


# --- the module in-process -----------------------------------------------------

def load_module():
    spec = importlib.util.spec_from_file_location(
        "vgpuhost_layout_module", COLLECTION / "plugins" / "modules" / "vgpuhost_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_module(monkeypatch, check_mode=False, diff=False, **args):
    """Run the module as Ansible would: its arguments on stdin-equivalent, its JSON result on stdout."""
    try:
        from ansible.module_utils import basic
    except ImportError as e:
        skip_or_fail(f"ansible-core is not importable ({e}); make dev installs the test extra", "the Ansible tests")
    from ansible.module_utils.common.text.converters import to_bytes
    payload = dict(args, _ansible_check_mode=check_mode, _ansible_diff=diff, _ansible_remote_tmp="/tmp",
                   _ansible_keep_remote_files=False)
    monkeypatch.setattr(basic, "_ANSIBLE_ARGS", to_bytes(json.dumps({"ANSIBLE_MODULE_ARGS": payload})))
    monkeypatch.setattr(basic, "_ANSIBLE_PROFILE", "legacy", raising=False)
    buf = io.StringIO()
    with redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        load_module().main()
    return exc.value.code, json.loads(buf.getvalue())


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIG, sort_keys=False))
    return path


def test_module_check_mode_plans_and_changes_nothing(make_host, monkeypatch, config_file):
    host = make_host("a100-sriov-mdev")
    code, res = run_module(monkeypatch, check_mode=True, diff=True, config=str(config_file), root=str(host.root))
    assert code == 0 and res["changed"] is True
    assert res["layout"] == "compute" and len(res["steps"]) == 2 and res["plan"]["schema"] == "vgpuhost.plan/v1"
    assert "create 2 x A100-8C" in res["diff"]["prepared"]
    assert not host.state_dir.exists() and vgpus(host) == []


def test_module_applies_then_asserts(make_host, monkeypatch, config_file):
    host = make_host("a100-sriov-mdev")
    code, res = run_module(monkeypatch, config=str(config_file), root=str(host.root))
    assert code == 0 and res["changed"] is True and len(res["done"]) == 2
    assert res["result"]["schema"] == "vgpuhost.apply/v1" and res["result"]["drift_after"] == []
    code, res = run_module(monkeypatch, config=str(config_file), root=str(host.root))
    assert code == 0 and res["changed"] is False and res["steps"] == []
    code, res = run_module(monkeypatch, config=str(config_file), root=str(host.root), state="asserted")
    assert code == 0 and res["changed"] is False and res["in_sync"] is True

    victim = vgpus(host)[0][0]
    from vgpuhost.cli.main import main
    assert main(["--root", str(host.root), "vgpu", "remove", victim]) == 0
    rows = len(StateStore(host.state_dir).audit_rows(None))
    code, res = run_module(monkeypatch, config=str(config_file), root=str(host.root), state="asserted")
    assert code == 1 and res["failed"] is True
    assert res["msg"] == f"the host differs from layout compute: - {GPU} vgpu A100-8C x2 (host has 1)"
    assert len(StateStore(host.state_dir).audit_rows(None)) == rows      # asserted changes nothing


def test_module_refuses_a_blocked_layout_before_any_change(make_host, monkeypatch, config_file, capsys):
    host = make_host("a100-sriov-mdev")
    from vgpuhost.cli.main import main
    assert main(["--root", str(host.root), "vgpu", "create", "--profile", "A100-4C", "--owner", DOMAIN]) == 0
    capsys.readouterr()
    StateStore(host.state_dir).domain_started(DOMAIN, "vm1")
    before = vgpus(host)
    rows = len(StateStore(host.state_dir).audit_rows(None))
    for check_mode in (True, False):
        code, res = run_module(monkeypatch, check_mode=check_mode, config=str(config_file), root=str(host.root))
        assert code == 1 and res["failed"] is True
        assert "held by running domain vm1" in res["msg"] and "\n" not in res["msg"]
    assert vgpus(host) == before
    assert len(StateStore(host.state_dir).audit_rows(None)) == rows


def test_module_reports_bad_input_in_one_line(make_host, monkeypatch, tmp_path, config_file):
    host = make_host("a100-sriov-mdev")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nlayouts:\n  compute:\n    gpus: []\n    colour: blue\n")
    code, res = run_module(monkeypatch, config=str(bad), root=str(host.root))
    assert code == 1 and res["msg"].startswith(f"{bad}:5: ") and "\n" not in res["msg"]
    assert res["exit_code"] == 2
    code, res = run_module(monkeypatch, config=str(config_file), root=str(tmp_path / "nowhere"))
    assert code == 1 and "is not a directory" in res["msg"]
    code, res = run_module(monkeypatch, config=str(config_file), root=str(host.root), layout="nosuch")
    assert code == 1 and "nosuch" in res["msg"]
    assert not host.state_dir.exists()


# --- issue 16: defaults, string booleans, validate, check mode plans the new config -------

def run_playbook(env, inventory: Path, *extra: str):
    """ansible-playbook with an INI inventory; returns (returncode, output, recap or None)."""
    argv = [tool("ansible-playbook"), "-i", str(inventory), *extra, str(DATA / "site.yml")]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    m = re.search(r"^localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", out, re.M)
    return proc.returncode, out, (dict(zip(("ok", "changed", "unreachable", "failed"), map(int, m.groups())))
                                  if m else None)


def test_role_defaults_ini_booleans_validate_and_check_mode_new_layout(make_host, ansible_env, tmp_path):
    """The role on its own defaults (vgpuhost_install_package: true on a simulated root, which takes the
    report whose join once bound to the second list only), with every switch given as the STRING an INI
    inventory or ``-e key=value`` gives ("false", "true"); then ``--check`` with a changed config plans
    the new layout (not the one on disk) and writes nothing; then a config vgpuhost refuses fails the copy
    (``validate:``) and leaves the file on the host as it was."""
    host = make_host("a100-sriov-mdev")
    root = host.root
    exe = BIN / "vgpuhost"
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[hypervisors]\n"
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable} "
        f"vgpuhost_root={root} vgpuhost_executable={exe} vgpuhost_python={sys.executable} "
        "vgpuhost_manage_bootloader=false vgpuhost_manage_initramfs=no vgpuhost_systemd=false "
        "vgpuhost_reboot=false\n")
    for value in ("false", "no"):       # an INI host line gives strings, not booleans
        assert f"={value} " in inventory.read_text() or f"={value}\n" in inventory.read_text()

    def write_vars(config):
        path = tmp_path / "vars.json"
        path.write_text(json.dumps({"vgpuhost_config": config, "vgpuhost_test_gpus": [GPU]}))
        return path

    # 1. converge on the defaults, -e switches as strings
    rc, out, recap_ = run_playbook(ansible_env, inventory, "-e", f"@{write_vars(CONFIG)}",
                                   "-e", "vgpuhost_facts=true", "-e", "vgpuhost_install_hook=yes")
    assert rc == 0 and recap_ and recap_["failed"] == 0, out
    assert ("not installed (vgpuhost_root is not /): vgpuhost (pip vgpuhost[libvirt,nvml] into /opt/vgpuhost)" in out), out
    assert "bootloader not updated (vgpuhost_root is not /)" in out
    assert [(t, o, s) for _, t, o, s in vgpus(host)] == [("A100-8C", "layout", "active")] * 2
    config_path = root / "etc" / "vgpuhost" / "config.yaml"
    written = config_path.read_text()

    # the facts carry version, hook state, drift and capacity, read back from the host
    import vgpuhost
    from vgpuhost.cli.main import main as cli_main
    fact = root / "etc" / "ansible" / "facts.d" / "vgpuhost.fact"
    doc = json.loads(subprocess.run([str(fact)], capture_output=True, text=True, timeout=300).stdout)
    assert doc["schema"] == "vgpuhost.gpus/v1" and [g["address"] for g in doc["gpus"]] == [GPU]
    assert doc["version"] == vgpuhost.__version__ and doc["errors"] == []
    assert doc["hook"]["installed"] is True and doc["hook"]["current"] is True
    assert doc["drift"] == {"layout": "compute", "in_sync": True, "diff": [], "reboot": []}
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main(["--root", str(root), "--json", "types"]) == 0
    free = {}
    for t in json.loads(buf.getvalue())["types"]:
        free[t["name"]] = free.get(t["name"], 0) + (t["available_instances"] or 0)
    assert doc["capacity"] == free and doc["capacity"]["A100-8C"] > 0

    # the example fleet report, run from the collection, reads those facts
    proc = subprocess.run([tool("ansible-playbook"), "-i", str(inventory), "vgpuhost.vgpuhost.fleet_report",
                           "-e", f"vgpuhost_fact_path={root}/etc/ansible/facts.d"],
                          env=ansible_env, capture_output=True, text=True, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert f"localhost: vgpuhost {vgpuhost.__version__}, 1 GPU(s), hook " in report, report
    assert ", layout in sync" in report, report
    assert "fleet: 1 host(s), 1 GPU(s)," in report and "0 host(s) drifted" in report, report
    assert f"A100-8C={free['A100-8C']}" in report, report
    # a host without the role's facts is reported as such, not a crash of the whole report
    proc = subprocess.run([tool("ansible-playbook"), "-i", str(inventory), "vgpuhost.vgpuhost.fleet_report",
                           "-e", f"vgpuhost_fact_path={root}/no-such-facts.d"],
                          env=ansible_env, capture_output=True, text=True, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert "localhost: vgpuhost ?, 0 GPU(s), hook NOT OK, layout none, errors: no vgpuhost facts" in report, report
    assert "fleet: 1 host(s), 0 GPU(s), 1 hook(s) not ok, 0 host(s) drifted; free vGPUs: none" in report, report

    # 2. --check with a new config: the plan is the NEW layout's (one A100-8C goes), nothing is written
    new = json.loads(json.dumps(CONFIG))
    new["layouts"]["compute"]["gpus"][0]["vgpu"]["types"] = {"A100-8C": 1}
    held = vgpus(host)

    def files():            # SQLite's -wal/-shm come and go with readers; state.db itself is compared
        return {k: v for k, v in tree_state(host).items() if not k.endswith(("-wal", "-shm"))}
    before = files()
    rc, out, recap_ = run_playbook(ansible_env, inventory, "-e", f"@{write_vars(new)}", "--check", "--diff",
                                   "-e", "vgpuhost_deb_package=/srv/vgpuhost_0.1.0_all.deb")
    assert rc == 0 and recap_ and recap_["failed"] == 0, out
    # auto takes the Debian package where one is given on the Debian family (this machine is Debian)
    assert "not installed (vgpuhost_root is not /): vgpuhost (deb /srv/vgpuhost_0.1.0_all.deb)" in out, out
    assert f"- {GPU} vgpu A100-8C x1 (host has 2)" in out, out
    assert re.search(r"1\. vgpu\s+" + re.escape(GPU) + r"\s+remove", out), out
    assert config_path.read_text() == written
    assert files() == before and vgpus(host) == held

    # 3. a config vgpuhost refuses: the copy's validate fails it; the file on the host stays as it was
    bad = json.loads(json.dumps(CONFIG))
    bad["layouts"]["compute"]["colour"] = "blue"
    rc, out, recap_ = run_playbook(ansible_env, inventory, "-e", f"@{write_vars(bad)}")
    assert rc != 0 and recap_ and recap_["failed"] == 1, out
    assert re.search(r"TASK \[vgpuhost\.vgpuhost\.vgpuhost : Write the layout config from vgpuhost_config\]"
                     r"[^\n]*\n(?:(?!TASK).*\n)*?fatal:", out), out
    assert "colour" in out                                  # vgpuhost's own message names the key
    assert config_path.read_text() == written
    assert [(t, o, s) for _, t, o, s in vgpus(host)] == [("A100-8C", "layout", "active")] * 2


def test_module_plans_from_content(make_host, monkeypatch, config_file):
    """``content`` is planned from instead of the file at ``config`` (the role's check mode)."""
    host = make_host("a100-sriov-mdev")
    new = json.loads(json.dumps(CONFIG))
    new["layouts"]["compute"]["gpus"][0]["vgpu"]["types"] = {"A100-8C": 3}
    code, res = run_module(monkeypatch, check_mode=True, config=str(config_file), root=str(host.root),
                           content=yaml.safe_dump(new, sort_keys=False))
    assert code == 0 and res["changed"] is True
    assert any("create 3 x A100-8C" in s for s in res["steps"]), res["steps"]
    assert yaml.safe_load(config_file.read_text()) == CONFIG and not host.state_dir.exists()


# --- ansible-test sanity ------------------------------------------------------------

GET_PIP_SHIM = """\
# Offline stand-in for pip's get-pip.py bootstrap, written by tests/test_ansible.py:
# ensurepip brings the interpreter's bundled pip, which then installs the version asked for.
import subprocess, sys
subprocess.check_call([sys.executable, "-m", "ensurepip", "--default-pip"])
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
subprocess.check_call([sys.executable, "-m", "pip", "install", *args])
"""


def collection_copy(tmp_path: Path) -> Path:
    """The collection laid out as ansible-test wants it: ``ansible_collections/vgpuhost/vgpuhost``."""
    coll = tmp_path / "ansible_collections" / "vgpuhost" / "vgpuhost"
    shutil.copytree(COLLECTION, coll, ignore=shutil.ignore_patterns(".ansible", "__pycache__", "*.pyc", "output"))
    return coll


def test_ansible_test_sanity_clean(ansible_env, tmp_path):
    """``ansible-test sanity`` on the collection, laid out as ansible_collections/vgpuhost/vgpuhost,
    passes every test. The one ignore entry (ansible/tests/sanity/ignore-*.txt) is the GPLv3 header
    check: the collection is Apache-2.0, as vgpuhost is.

    ansible-test builds a venv per sanity test and bootstraps pip in it with a script it downloads
    from its own CI host; a stand-in that runs ensurepip takes its place, so only the package
    index is needed. The venvs are cached in build/ansible-test-home (make clean removes it)."""
    ansible_test = tool("ansible-test")
    from ansible_test._internal.python_requirements import get_venv_packages

    class Python:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"

    pip_version = get_venv_packages(Python())["pip"]
    home = REPO / "build" / "ansible-test-home"
    cache = home / ".ansible" / "test" / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"get_pip_{pip_version.replace('.', '_')}.py").write_text(GET_PIP_SHIM)

    coll = collection_copy(tmp_path)
    env = dict(ansible_env, HOME=str(home))
    proc = subprocess.run([ansible_test, "sanity", "--python", Python.version, "--local", "--color", "no"],
                          cwd=coll, env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    ran = re.findall(r'^Running sanity test "([\w-]+)"', out, re.M)
    assert {"validate-modules", "pep8", "pylint", "yamllint", "import", "ansible-doc", "changelog"} <= set(ran), out
    assert not re.search(r"^(ERROR|FATAL):", out, re.M), out


def test_ansible_test_integration_targets_pass_on_a_simulated_host(ansible_env, tmp_path):
    """``ansible-test integration --local`` runs every target of ansible/tests/integration/targets (one
    per module: vgpuhost_layout) with connection local; each target builds its own simulated host
    (``python -m vgpuhost sim create``) and reads every outcome back with vgpuhost's read commands.
    ansible-test runs the modules with this interpreter, which imports vgpuhost."""
    ansible_test = tool("ansible-test")
    targets = sorted(p.name for p in (COLLECTION / "tests" / "integration" / "targets").iterdir())
    modules = sorted(p.stem for p in (COLLECTION / "plugins" / "modules").glob("*.py"))
    assert targets == modules, (targets, modules)          # one target per module
    coll = collection_copy(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    env = dict(ansible_env, HOME=str(home))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run([ansible_test, "integration", "--local", "--python", version, "--color", "no"],
                          cwd=coll, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    ran = re.findall(r"^Running (\S+) integration test role", out, re.M)
    assert ran == targets, out
    assert re.search(r"^testhost\s*:\s*ok=\d+\s+changed=\d+\s+unreachable=0\s+failed=0", out, re.M), out
