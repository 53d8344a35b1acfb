"""VFIO passthrough of whole IOMMU groups on the simulator: state read back
from the simulated sysfs tree, the state store and the audit log."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import subprocess

import pytest

from vgpuhost.cli.main import main
from vgpuhost.model.errors import DeviceError, InputError, RefusedError
from vgpuhost.ops.passthrough import prepare, release
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress

A = PciAddress.parse
GPU = A("0000:01:00.0")
TURING_FUNCS = ["0000:01:00.0", "0000:01:00.1", "0000:01:00.2", "0000:01:00.3"]
ORIGINAL = {"0000:01:00.0": "nvidia", "0000:01:00.1": "snd_hda_intel",
            "0000:01:00.2": "xhci_hcd", "0000:01:00.3": "nvidia-gpu"}

TURING = """
version: 1
name: turing-lab
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, snd_hda_intel, xhci_pci, i2c_nvidia_gpu]
  processes: [{procs}]
devices:
  - {{bdf: "0000:00:01.0", model: intel-root-port}}
  - {{bdf: "0000:01:00.0", model: RTX2080-TU104, upstream: "0000:00:01.0", boot_vga: {boot_vga}}}
  - {{bdf: "0000:01:00.1", model: tu104-hda, upstream: "0000:00:01.0"}}
  - {{bdf: "0000:01:00.2", model: tu104-xhci, upstream: "0000:00:01.0"}}
  - {{bdf: "0000:01:00.3", model: tu104-ucsi, upstream: "0000:00:01.0"}}
faults: [{faults}]
"""


def turing(make_host, *, procs="", boot_vga="false", faults=""):
    return make_host(yaml_text=TURING.format(procs=procs, boot_vga=boot_vga, faults=faults))


def drivers(host, bdfs=TURING_FUNCS):
    fs = Sysfs(host)
    return {b: fs.link_name(host.pci_device(b) / "driver") for b in bdfs}


def overrides(host, bdfs=TURING_FUNCS):
    return {b: (host.pci_device(b) / "driver_override").read_text().strip() for b in bdfs}


def store_of(host):
    return StateStore(host.state_dir)


def test_turing_group_moves_together_and_returns_in_order(make_host):
    host = turing(make_host)
    store = store_of(host)
    out = prepare(host, store, GPU)
    assert out.changed and out.group is not None
    assert drivers(host) == {b: "vfio-pci" for b in TURING_FUNCS}
    assert set(overrides(host).values()) == {"vfio-pci"}
    group = (host.pci_device(GPU) / "iommu_group").resolve().name
    assert (host.dev_vfio / group).exists()
    recs = {r.bdf: r.original_driver for r in store.passthrough_records()}
    assert recs == ORIGINAL

    n_before = len(store.audit_rows())
    out = release(host, store, GPU)
    assert out.changed
    assert drivers(host) == ORIGINAL
    assert set(overrides(host).values()) == {"(null)"}
    assert store.passthrough_records() == []
    assert not (host.dev_vfio / group).exists()
    # release order: the companions go back before the GPU goes back to nvidia
    probes = [r.value for r in store.audit_rows()[n_before:] if r.path.endswith("drivers_probe")]
    assert probes == ["0000:01:00.3", "0000:01:00.2", "0000:01:00.1", "0000:01:00.0"]


def test_prepare_and_release_are_idempotent(make_host):
    host = turing(make_host)
    store = store_of(host)
    prepare(host, store, GPU)
    rows = len(store.audit_rows())
    again = prepare(host, store, GPU)
    assert not again.changed and "already bound to vfio-pci" in again.notes[0]
    assert len(store.audit_rows()) == rows            # nothing written
    release(host, store, GPU)
    rows = len(store.audit_rows())
    again = release(host, store, GPU)
    assert not again.changed and "nothing to do" in again.notes[0]
    assert len(store.audit_rows()) == rows


def test_dry_run_prints_exact_steps_and_writes_nothing(make_host, capsys):
    host = turing(make_host)
    code = main(["--root", str(host.root), "passthrough", "prepare", "--dry-run", str(GPU)])
    out = capsys.readouterr().out
    assert code == 0
    assert "write 'vfio-pci' to /sys/bus/pci/devices/0000:01:00.2/driver_override" in out
    assert "write '0000:01:00.2' to /sys/bus/pci/drivers/xhci_hcd/unbind" in out
    assert drivers(host) == ORIGINAL and not (host.state_dir / "state.db").exists() or \
        store_of(host).audit_rows() == []


def test_group_with_bridge_leaves_bridge_on_pcieport(make_host):
    host = make_host(yaml_text="""
version: 1
name: bridged
host: {modules: [vfio_pci, vfio, vfio_iommu_type1, nvidia, snd_hda_intel]}
devices:
  - {bdf: "0000:00:1c.0", model: intel-root-port}
  - {bdf: "0000:02:00.0", model: plx-switch-port, upstream: "0000:00:1c.0"}
  - {bdf: "0000:03:00.0", model: A40, upstream: "0000:02:00.0"}
  - {bdf: "0000:03:00.1", model: nvidia-hda, upstream: "0000:02:00.0"}
""")
    store = store_of(host)
    out = prepare(host, store, A("0000:03:00.0"))
    assert any("bridges stay on pcieport: 0000:02:00.0" in n for n in out.notes)
    d = drivers(host, ["0000:02:00.0", "0000:03:00.0", "0000:03:00.1"])
    assert d == {"0000:02:00.0": "pcieport", "0000:03:00.0": "vfio-pci", "0000:03:00.1": "vfio-pci"}
    release(host, store, A("0000:03:00.0"))
    assert drivers(host, ["0000:03:00.0", "0000:03:00.1"]) == {"0000:03:00.0": "nvidia",
                                                              "0000:03:00.1": "snd_hda_intel"}


def test_sata_group_refused_nothing_written(make_host, capsys):
    host = make_host("sata-shared-group")
    before = drivers(host, ["0000:03:00.0", "0000:03:00.1", "0000:04:00.0"])
    code = main(["--root", str(host.root), "passthrough", "prepare", "0000:03:00.0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "0000:04:00.0 (SATA controller, ahci)" in err and "not viable" in err
    assert drivers(host, ["0000:03:00.0", "0000:03:00.1", "0000:04:00.0"]) == before
    assert store_of(host).audit_rows() == []            # the audit log is empty: nothing written


def test_boot_vga_refused_unless_allowed(make_host):
    host = turing(make_host, boot_vga="true")
    store = store_of(host)
    with pytest.raises(RefusedError) as ei:
        prepare(host, store, GPU)
    assert "boot_vga" in ei.value.message and "--allow-boot-vga" in ei.value.message
    assert drivers(host) == ORIGINAL and store.audit_rows() == []
    prepare(host, store, GPU, allow_boot_vga=True)
    assert drivers(host)[str(GPU)] == "vfio-pci"


def test_persistenced_running_refused(make_host):
    host = turing(make_host, procs="nvidia-persistenced")
    store = store_of(host)
    with pytest.raises(RefusedError) as ei:
        prepare(host, store, GPU)
    assert "nvidia-persistenced" in ei.value.message and "systemctl stop" in ei.value.message
    assert drivers(host) == ORIGINAL and store.audit_rows() == []


def test_iommu_off_refused(make_host):
    host = make_host("iommu-off")
    with pytest.raises(RefusedError) as ei:
        prepare(host, store_of(host), A("0000:81:00.0"))
    assert "IOMMU is off" in ei.value.message and "intel_iommu=on" in ei.value.hint


def test_not_a_gpu_and_unknown_device(make_host):
    host = turing(make_host)
    with pytest.raises(InputError, match="not a GPU"):
        prepare(host, store_of(host), A("0000:01:00.1"))
    with pytest.raises(InputError, match="no PCI device"):
        prepare(host, store_of(host), A("0000:09:00.0"))


def test_bind_failing_mid_group_rolls_back(make_host, capsys):
    # function 3 of 4 (the USB controller) fails in drivers_probe with EIO
    host = turing(make_host, faults='{op: probe, device: "0000:01:00.2", errno: EIO}')
    code = main(["--root", str(host.root), "passthrough", "prepare", str(GPU)])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1
    assert "0000:01:00.2 failed to bind to vfio-pci: EIO" in err
    assert "rolled back 0000:01:00.0, 0000:01:00.1" in err
    # read back: every function is on its original driver, no override left
    assert drivers(host) == ORIGINAL
    assert set(overrides(host).values()) == {"(null)"}
    assert store_of(host).passthrough_records() == []
    results = [r.result for r in store_of(host).audit_rows()]
    assert "EIO" in results


def test_drivers_probe_binding_nothing_is_detected(make_host):
    host = turing(make_host, faults='{op: probe, device: "0000:01:00.1", effect: ignore}')
    store = store_of(host)
    with pytest.raises(DeviceError) as ei:
        prepare(host, store, GPU)
    msg = ei.value.message
    assert "0000:01:00.1" in msg and "bound to no driver after drivers_probe, expected vfio-pci" in msg
    assert drivers(host) == ORIGINAL and store.passthrough_records() == []


def test_stale_driver_override_from_another_tool_is_cleared_on_release(make_host):
    host = turing(make_host)
    store = store_of(host)
    fs = Sysfs(host)
    # another tool bound the audio function to vfio-pci by hand and left the override behind
    fs.write(host.pci_device("0000:01:00.1") / "driver_override", "vfio-pci")
    # and left a stale override on the USB function although it is back on xhci_hcd
    fs.write(host.pci_device("0000:01:00.2") / "driver_override", "vfio-pci")
    fs.write(host.pci_driver("snd_hda_intel") / "unbind", "0000:01:00.1")
    fs.write(host.pci_drivers_probe, "0000:01:00.1")
    assert drivers(host)["0000:01:00.1"] == "vfio-pci"
    out = release(host, store, GPU)
    assert any("not bound by vgpuhost" in n and "0000:01:00.1" in n for n in out.notes)
    assert drivers(host) == ORIGINAL
    assert set(overrides(host).values()) == {"(null)"}


def test_audit_cli(make_host, capsys):
    host = turing(make_host)
    prepare(host, store_of(host), GPU)
    code = main(["--root", str(host.root), "--json", "audit", "--since", "1h"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["schema"] == "vgpuhost.audit/v1" and len(doc["rows"]) == 12
    row = doc["rows"][1]
    assert row["path"] == "/sys/bus/pci/drivers/nvidia/unbind" and row["value"] == "0000:01:00.0"
    assert row["result"] == "ok" and row["operation"] == "passthrough prepare 0000:01:00.0"
    code = main(["--root", str(host.root), "--json", "audit", "--since", "2999-01-01T00:00"])
    assert json.loads(capsys.readouterr().out)["rows"] == []
    code = main(["--root", str(host.root), "audit", "--since", "yesterday"])
    assert code == 2 and "invalid --since" in capsys.readouterr().err


def test_audit_log_is_append_only(make_host):
    host = turing(make_host)
    store = store_of(host)
    prepare(host, store, GPU)
    import sqlite3
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        with store.transaction() as conn:
            conn.execute("UPDATE audit SET value = 'x'")
    from vgpuhost.io.state import MIGRATIONS
    assert store.schema_version == len(MIGRATIONS)


def test_modprobe_config(make_host, capsys):
    host = turing(make_host)
    code = main(["--root", str(host.root), "passthrough", "modprobe-config", str(GPU)])
    out = capsys.readouterr().out
    assert code == 0
    assert "options vfio-pci ids=10de:1e87,10de:10f8,10de:1ad8,10de:1ad9" in out
    for mod in ("nvidia", "snd_hda_intel", "xhci_pci", "i2c_nvidia_gpu"):
        assert f"softdep {mod} pre: vfio-pci" in out


def test_persist_writes_driverctl_files_and_release_removes_them(make_host):
    host = turing(make_host)
    store = store_of(host)
    prepare(host, store, GPU, persist=True)
    for b in TURING_FUNCS:
        assert (host.driverctl_d / f"pci-{b}").read_text() == "vfio-pci\n"
    out = release(host, store, GPU)            # without --persist: kept, and said so
    assert any("driverctl overrides remain" in n for n in out.notes)
    assert all((host.driverctl_d / f"pci-{b}").exists() for b in TURING_FUNCS)
    release(host, store, GPU, persist=True)
    assert list(host.driverctl_d.iterdir()) == []


# --- driverctl, the ecosystem's own tool, reads what --persist wrote --------------

def _driverctl():
    for p in (shutil.which("driverctl"), "/usr/sbin/driverctl"):
        if p and os.path.exists(p):
            return p
    return None


def _ns_unavailable():
    if os.geteuid() != 0:
        return "needs root for a private mount namespace"
    if not os.path.isdir("/etc/driverctl.d"):
        return "no /etc/driverctl.d to mount over (is driverctl installed?)"
    if _driverctl() is None:
        return "Debian's driverctl is not installed (make dev installs it)"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"unshare -m not permitted: {probe.stderr.decode().strip()}"
    return None


@pytest.mark.root
def test_driverctl_reapplies_what_persist_recorded(make_host):
    """Debian's driverctl 0.111 has no ``list-persisted``; its boot path is
    ``load-override <dev>`` (udev), which reads ``/etc/driverctl.d/pci-<BDF>``.
    Run it over the simulated tree and read the overrides back with
    ``list-overrides``."""
    import nsutil
    nsutil.skip_or_fail(_ns_unavailable(), "the driverctl test")
    host = turing(make_host)
    store = store_of(host)
    prepare(host, store, GPU, persist=True)
    release(host, store, GPU)                 # back on the host drivers; the driverctl files stay
    assert set(overrides(host).values()) == {"(null)"}
    # driverctl checks /sys/module/<driver> before it would run modprobe (absent here)
    (host.sys_module / "vfio-pci").mkdir()
    # /sys and /etc/driverctl.d are namespace-private mount targets; the host's own stay untouched
    script = ('mount --bind "$1/sys" /sys && mount --bind "$2" /etc/driverctl.d || exit 125; '
              'for d in ' + " ".join(TURING_FUNCS) + '; do "$3" --noprobe load-override "$d" || exit 1; done; '
              'exec "$3" list-overrides')
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                        str(host.root), str(host.driverctl_d), _driverctl()], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr + p.stdout
    listed = sorted(line.split()[0] for line in p.stdout.splitlines() if line.strip())
    assert listed == TURING_FUNCS
    assert set(overrides(host).values()) == {"vfio-pci"}   # driverctl wrote what our files say


# --- concurrency -------------------------------------------------------------------

def _worker(root: str, seed: int, iterations: int, q) -> None:
    from vgpuhost.io.hostroot import HostRoot
    host = HostRoot.from_env(root)
    store = StateStore(host.state_dir)
    rng = random.Random(seed)
    writes = 0
    try:
        for _ in range(iterations):
            op = prepare if rng.random() < 0.5 else release
            writes += op(host, store, GPU, actor=f"worker {seed}").writes
        q.put(("ok", writes))
    except Exception as e:  # report, do not hang the parent
        q.put(("error", f"{type(e).__name__}: {e}"))


@pytest.mark.slow
def test_eight_processes_prepare_and_release_concurrently(make_host):
    host = turing(make_host)
    StateStore(host.state_dir)        # create the schema once
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(host.root), seed, 200, q)) for seed in range(8)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(r[0] == "ok" for r in results), results
    final = set(drivers(host).values())
    assert final in ({"vfio-pci"}, set(ORIGINAL.values()))
    if final == {"vfio-pci"}:
        assert len(store_of(host).passthrough_records()) == 4
    else:
        assert drivers(host) == ORIGINAL and store_of(host).passthrough_records() == []
    assert set(overrides(host).values()) in ({"vfio-pci"}, {"(null)"})
    # no lost audit rows: one row per write every worker made
    assert len(store_of(host).audit_rows()) == sum(r[1] for r in results)


def test_state_store_migrates_a_version_1_database(tmp_path):
    import sqlite3
    from vgpuhost.io.state import MIGRATIONS, _statements
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db, isolation_level=None)
    for stmt in _statements(MIGRATIONS[0]):
        conn.execute(stmt)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO audit (time, actor, operation, path, value, result) "
                 "VALUES ('t', 'a', 'o', '/p', 'v', 'ok')")
    conn.close()
    store = StateStore(tmp_path)
    assert store.schema_version == len(MIGRATIONS) and len(store.audit_rows()) == 1
    assert store.vgpu_records() == []


def test_state_store_refuses_a_newer_schema(tmp_path):
    import sqlite3
    from vgpuhost.model.errors import HostEnvironmentError
    conn = sqlite3.connect(tmp_path / "state.db")
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(HostEnvironmentError, match="newer than this vgpuhost"):
        StateStore(tmp_path)
