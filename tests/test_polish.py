"""Small defects an operator found trying vgpuhost (the polish list): each test failed before its fix.

Outcomes are read back from the simulated tree, the state store and the CLI's documents.
"""

from __future__ import annotations

import json

import pytest

from vgpuhost.cli.main import main as cli_main
from vgpuhost.io.state import StateStore
from vgpuhost.model.tenancy import NO_TENANT, usage_text
from vgpuhost.ops import tenancy

from test_hook import mixed, start
from test_tenancy import tdom, uid


def run(capsys, host, *argv):
    code = cli_main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------
# 1, 2: tenant usage: the no-tenant row, quota 0 and burst

def test_tenant_usage_labels_no_tenant_and_shows_quota_zero_and_burst(make_host, capsys):
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("team", quota=tenancy.Quota(tenancy.Limits(vgpus=1), tenancy.Limits(vgpus=2))))
    for i in range(2):
        assert start(host, f"vm{i}", tdom(f"vm{i}", uid("33333333", i), uid("cccccccc", i), tenant="team")) == (0, "")
    assert run(capsys, host, "vgpu", "create", "--profile", "A40-8Q")[0] == 0       # manual: no tenant, no domain
    code, out, _ = run(capsys, host, "tenant", "usage")
    assert code == 0 and "(none)" not in out
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["team", "2", "2/1:2"] and "(1 burst)" in lines[1]
    assert "8192 burst" not in lines[1]                 # framebuffer has no limit: nothing to burst above
    assert lines[2].startswith(NO_TENANT + "  ") and lines[2][len(NO_TENANT):].split()[:3] == ["0", "1", "8192"]
    code, out, _ = run(capsys, host, "--json", "tenant", "usage")
    docs = json.loads(out)["tenants"]
    assert [d["tenant"] for d in docs] == ["team", None] and [d["domains"] for d in docs] == [2, 0]
    # the quota lowered to 0 under two running domains: over quota, never "2/0 (1 burst)"; the burst part is
    # use above the guarantee now, up to the ceiling (breaker round 2): with 0:0 there is none, both are over
    assert run(capsys, host, "tenant", "set", "team", "--vgpus", "0")[0] == 0
    code, out, _ = run(capsys, host, "tenant", "usage")
    assert "2/0 (2 over quota)" in out.splitlines()[1]
    code, out, _ = run(capsys, host, "tenant", "show", "team")
    assert "2/0 (2 over quota)" in out and NO_TENANT not in out


def test_usage_text_cases():
    assert usage_text(0, 0, 0, 0) == "0/0"
    assert usage_text(2, 0, 0, 0) == "2/0 (2 over quota)"
    assert usage_text(2, 1, 1, 2) == "2/1:2 (1 burst)"
    assert usage_text(3, 0, 4, 4) == "3/4"
    assert usage_text(5, 2, None, None) == "5"


def test_metering_tables_label_no_tenant(make_host, capsys):
    from vgpuhost.io.backends import metering_nvml
    from vgpuhost.ops.metering import Sampler
    host = make_host("a40-mdev")
    # a domain naming no tenant (a vGPU no domain holds is idle capacity, '(idle)': tests/test_billing.py)
    assert run(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--owner", uid("44444444", 1))[0] == 0
    store = StateStore(host.state_dir)
    nv = metering_nvml(host)
    nv.freeze()
    s = Sampler(nv, store, interval_s=60)
    s.tick()
    nv.advance(60)
    s.tick()
    code, out, _ = run(capsys, host, "usage", "--by", "tenant")
    assert code == 0 and out.splitlines()[1].startswith(NO_TENANT + "  ")
    code, out, _ = run(capsys, host, "--json", "usage", "--by", "tenant")
    assert [r["tenant"] for r in json.loads(out)["rows"]] == ["(none)"]        # as first published


# ---------------------------------------------------------------------------
# 3: scheduler set --persist prints only the notes that apply to the GPUs in scope

MIG_NOTE = "the driver ignores it on a GPU in MIG mode"
MIXED_NOTE = "fixed share is not available while a GPU is in mixed-size mode"


def test_persist_notes_apply_to_the_board(make_host, capsys):
    a40 = make_host("a40-mdev")                         # Ampere, no MIG
    code, out, _ = run(capsys, a40, "scheduler", "set", "--policy", "equal-share", "--all", "--persist")
    assert code == 0 and MIG_NOTE not in out and MIXED_NOTE not in out
    assert 'RmPVMRL=0x01"' in (a40.root / "etc/modprobe.d/vgpuhost-scheduler.conf").read_text()
    code, out, _ = run(capsys, a40, "--json", "scheduler", "set", "--policy", "fixed-share", "--gpu", "0000:81:00.0",
                       "--persist")
    notes = json.loads(out)["notes"]
    assert code == 0 and not any(MIG_NOTE in n for n in notes) and any(MIXED_NOTE in n for n in notes)
    a100 = make_host("a100-sriov-mdev")                 # MIG-capable: the note applies
    code, out, _ = run(capsys, a100, "scheduler", "set", "--policy", "equal-share", "--all", "--persist")
    assert code == 0 and MIG_NOTE in out
    code, out, _ = run(capsys, a100, "scheduler", "set", "--policy", "best-effort", "--all", "--persist")
    assert code == 0 and MIG_NOTE not in out            # best effort is what MIG mode leaves anyway


# ---------------------------------------------------------------------------
# 4: a simulated root reads as a real / does (0755), made fresh or replaced

def test_sim_create_root_is_world_readable(tmp_path, capsys):
    import os
    import stat
    old = os.umask(0o022)
    try:
        dest = tmp_path / "host"
        assert cli_main(["sim", "create", "a40-mdev", str(dest)]) == 0
        assert stat.S_IMODE(dest.stat().st_mode) == 0o755
        (dest / "sys").chmod(0o700)                          # replaced with --force: a fresh tree, 0755 again
        assert cli_main(["sim", "create", "--force", "a40-mdev", str(dest)]) == 0
        assert stat.S_IMODE(dest.stat().st_mode) == 0o755 and stat.S_IMODE((dest / "sys").stat().st_mode) == 0o755
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host"]     # no staging folder left
    capsys.readouterr()


# ---------------------------------------------------------------------------
# 5: a GPU off nvidia (on vfio-pci) offers no mdev type in the simulator, as the kernel shows it

def test_sim_gpu_on_vfio_pci_has_no_mdev_types(make_host, capsys):
    from vgpuhost.io.sysfs import Sysfs
    from vgpuhost.observe.inventory import discover
    host = make_host("a40-mdev")
    gpu = "0000:81:00.0"
    pdir = host.root / "sys/bus/pci/devices" / gpu
    assert (pdir / "mdev_supported_types/nvidia-566/create").exists()
    assert run(capsys, host, "passthrough", "prepare", gpu)[0] == 0
    assert (pdir / "driver").resolve().name == "vfio-pci"
    assert not (pdir / "mdev_supported_types").exists()
    assert not (host.root / "sys/class/mdev_bus" / gpu).exists()
    assert [t for t in discover(Sysfs(host)).vgpu_types if str(t.gpu) == gpu] == []
    code, out, _ = run(capsys, host, "--json", "types")
    assert code == 0 and json.loads(out)["types"] == []
    assert run(capsys, host, "passthrough", "release", gpu)[0] == 0
    assert (pdir / "driver").resolve().name == "nvidia"
    assert (pdir / "mdev_supported_types/nvidia-566/available_instances").read_text() == "6\n"
    assert (host.root / "sys/class/mdev_bus" / gpu).resolve() == pdir.resolve()
    assert run(capsys, host, "vgpu", "create", "--profile", "A40-8Q")[0] == 0
    assert (pdir / "mdev_supported_types/nvidia-566/available_instances").read_text() == "5\n"


A40_ON_VFIO = """
version: 1
name: a40-early-vfio
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:80:03.0", model: intel-root-port}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:03.0", driver: vfio-pci, vgpu: {backend: mdev}}
"""


def test_sim_gpu_booted_on_vfio_pci_has_no_mdev_types(make_host):
    host = make_host(yaml_text=A40_ON_VFIO)
    pdir = host.root / "sys/bus/pci/devices/0000:81:00.0"
    assert (pdir / "driver").resolve().name == "vfio-pci"
    assert not (pdir / "mdev_supported_types").exists()
    assert not (host.root / "sys/class/mdev_bus/0000:81:00.0").exists()


# ---------------------------------------------------------------------------
# 6: the agent refuses a query parameter an endpoint does not take (400 naming it), as it does body keys

def test_agent_query_parameters_match_the_api_document():
    import yaml
    from vgpuhost.agent import api
    from test_agent import SPEC
    spec = yaml.safe_load(SPEC.read_text())
    for route in api.ROUTES:
        params = spec["paths"][route.template][route.method.lower()].get("parameters", [])
        assert {p["name"] for p in params if p["in"] == "query"} == set(route.query), route.template


@pytest.fixture
def agent(make_host):
    from agentutil import AgentRun
    with AgentRun(make_host("a40-mdev").root) as run:
        yield run


def test_agent_refuses_unknown_query_parameters(agent):
    from vgpuhost.agent import api
    status, doc = agent.call("GET", "/v1/types?availble=1")
    assert (status, doc["error"]["exit_code"]) == (400, 2), doc
    assert doc["error"]["line"].startswith("unknown query parameter 'availble' in GET /v1/types"), doc
    assert "gpu, available" in doc["error"]["hint"]
    status, doc = agent.call("GET", "/v1/types?available=1")
    assert status == 200 and all(t["available_instances"] > 0 for t in doc["types"])
    for route in api.ROUTES:
        if route.method != "GET":
            continue
        status, doc = agent.call("GET", route.template + "?no_such%00=1&x=2")
        assert status == 400 and "unknown query parameter 'no_such?' (and 1 more)" in doc["error"]["line"], doc
    status, doc = agent.call("POST", "/v1/reconcile?check=1", {"check": True})
    assert status == 400 and "unknown query parameter 'check'" in doc["error"]["line"]
    status, _ = agent.call("GET", "/v1/audit?since=1h")
    assert status == 200


# ---------------------------------------------------------------------------
# 7: the install guide's table names every unit the package ships and install-units writes

def test_install_guide_lists_every_unit():
    import re
    from pathlib import Path
    from vgpuhost.ops import units
    text = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "install.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| `/lib/systemd/system/")]     # bookworm's unit dir
    listed = {n for ln in rows for n in re.findall(r"(vgpuhost-[a-z-]+\.(?:service|socket))", ln.split(" | ")[0])}
    assert listed == set(units.UNIT_NAMES) == set(units.unit_names())


# ---------------------------------------------------------------------------
# 8: ops.passthrough.release(owner=...) refuses a running owner's group itself (every caller gets it)

def test_release_with_owner_refuses_while_the_domain_runs(make_host):
    from vgpuhost.model.errors import RefusedError
    from vgpuhost.ops.passthrough import release as pt_release
    from test_hook import A100, A100_AUDIO, DOM1, a100_vfs_off, driver, pt_domain, stop
    host = a100_vfs_off(make_host)
    s = StateStore(host.state_dir)
    xml = pt_domain("gpu-vm", DOM1, A100, [A100, A100_AUDIO])
    assert start(host, "gpu-vm", xml) == (0, "")
    with pytest.raises(RefusedError, match="in use by running domain gpu-vm"):
        pt_release(host, s, A100, owner=DOM1)
    assert driver(host, A100) == "vfio-pci" and {r.owner for r in s.passthrough_records()} == {DOM1}
    assert stop(host, "gpu-vm", xml) == (0, "")          # the hook's own release still gives it back
    assert driver(host, A100) == "nvidia" and s.passthrough_records() == []


# ---------------------------------------------------------------------------
# 9: bench/hook.py byte-compiles the package (without PYTHONDONTWRITEBYTECODE) before it builds or times anything

def _bench_module(name: str, monkeypatch):
    """``bench/NAME.py`` imported as the scripts run (bench/ on sys.path, for this test only)."""
    import importlib
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    for mod in (name, "benchutil"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    return importlib.import_module(name)


def test_bench_precompile_writes_bytecode_despite_the_environment(tmp_path, monkeypatch):
    benchutil = _bench_module("benchutil", monkeypatch)
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("X = 1\n")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    benchutil.precompile(pkg)
    assert list((pkg / "sub" / "__pycache__").glob("mod.*.pyc")) and list((pkg / "__pycache__").glob("*.pyc"))


def test_bench_hook_compiles_before_it_builds_hosts(monkeypatch):
    hook = _bench_module("hook", monkeypatch)
    calls = []

    class Stop(Exception):
        pass

    def precompile(path):
        calls.append(("precompile", str(path)))
        raise Stop()

    def no_host(*a, **kw):
        calls.append(("host",))
        raise Stop()
    monkeypatch.setattr(hook, "precompile", precompile, raising=False)
    monkeypatch.setattr(hook, "Bench", no_host)
    monkeypatch.setattr(hook, "_clean_interpreter", lambda where: no_host())
    with pytest.raises(Stop):
        hook.main(["--runs", "5", "--hosts", "a40-mdev", "--agent", "down"])
    assert calls and calls[0][0] == "precompile" and calls[0][1].endswith("/vgpuhost")
