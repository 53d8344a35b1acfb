"""Regression tests for the field defects of issue 12 (#4 a-m), each on a simulated
tree, each failing before its fix.  Outcomes are read back from the simulated
sysfs tree, the state store and the CLI's exit code."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.errors import RefusedError
from vgpuhost.model.values import PciAddress
from vgpuhost.ops.passthrough import prepare, release

A = PciAddress.parse


def cli(capsys, host, *argv):
    code = main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def driver(host, bdf):
    return Sysfs(host).link_name(host.pci_device(bdf) / "driver")


def override(host, bdf):
    return (host.pci_device(bdf) / "driver_override").read_text().strip()


# ---------------------------------------------------------------------------
# a. a GPU whose original driver is vfio-pci (vfio-pci.ids bound it at boot)

EARLY_VFIO = """
version: 1
name: early-vfio
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, snd_hda_intel]
devices:
  - {bdf: "0000:80:03.0", model: intel-root-port}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:03.0", driver: vfio-pci}
  - {bdf: "0000:81:00.1", model: nvidia-hda, upstream: "0000:80:03.0", driver: vfio-pci}
"""
DOM_A = "11111111-2222-4333-8444-0000000000a1"
DOM_B = "11111111-2222-4333-8444-0000000000b2"


def test_a_gpu_early_bound_to_vfio_pci_is_released_and_the_next_domain_prepares(make_host):
    host = make_host(yaml_text=EARLY_VFIO)
    store = StateStore(host.state_dir)
    gpu = A("0000:81:00.0")
    prepare(host, store, gpu, owner=DOM_A)
    assert driver(host, gpu) == "vfio-pci" and store.passthrough_records()
    out = release(host, store, gpu, owner=DOM_A)          # raised DeviceError before: held forever
    assert driver(host, gpu) == "vfio-pci" and driver(host, "0000:81:00.1") == "vfio-pci"
    assert override(host, gpu) == "(null)"                # as it booted
    assert store.passthrough_records() == [] and out.changed
    prepare(host, store, gpu, owner=DOM_B)                # the next domain is not refused
    assert {r.owner for r in store.passthrough_records()} == {DOM_B}


# ---------------------------------------------------------------------------
# b. a driverless host bridge (class 0x0600) in the GPU's IOMMU group

HOST_BRIDGE = """
version: 1
name: epyc-dummy-host-bridge
host:
  cpu_vendor: AuthenticAMD
  cmdline: "iommu=pt"
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, snd_hda_intel]
devices:
  - {bdf: "0000:40:01.0", model: amd-dummy-host-bridge, iommu_group: 31}
  - {bdf: "0000:40:01.1", model: amd-root-port, iommu_group: 31}
  - {bdf: "0000:41:00.0", model: A40, upstream: "0000:40:01.1", iommu_group: 31}
  - {bdf: "0000:41:00.1", model: nvidia-hda, upstream: "0000:40:01.1", iommu_group: 31}
"""


def test_b_driverless_host_bridge_does_not_block_passthrough(make_host, capsys):
    host = make_host(yaml_text=HOST_BRIDGE)
    gpu = A("0000:41:00.0")
    assert driver(host, "0000:40:01.0") is None
    code, out, err = cli(capsys, host, "host", "check")
    assert "GROUP_NOT_VIABLE" not in out and "GROUP_VIABLE" in out, out
    store = StateStore(host.state_dir)
    prepare(host, store, gpu)                             # refused as "not viable" before
    assert driver(host, gpu) == "vfio-pci" and driver(host, "0000:41:00.1") == "vfio-pci"
    assert driver(host, "0000:40:01.0") is None and driver(host, "0000:40:01.1") == "pcieport"
    assert "0000:40:01.0" not in {r.bdf for r in store.passthrough_records()}
    release(host, store, gpu)
    assert driver(host, gpu) == "nvidia"


# ---------------------------------------------------------------------------
# k. exit codes: SIGINT and SIGTERM exit 130; transient conditions exit 5, permanent refusals 2

def test_k_sigint_exits_130(make_host, capsys, monkeypatch):
    host = make_host("a40-mdev")
    import vgpuhost.cli.vgpu as vgpu          # the command's own name for it (imported at its top)

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(vgpu, "list_vgpus", interrupted)
    code, _, err = cli(capsys, host, "vgpu", "list")
    assert code == 130 and "interrupted" in err           # was 2 ("aborted")


def test_k_sigterm_exits_130(make_host, capsys, monkeypatch):
    host = make_host("a40-mdev")
    import vgpuhost.cli.vgpu as vgpu          # the command's own name for it (imported at its top)

    def terminated(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt")
    monkeypatch.setattr(vgpu, "list_vgpus", terminated)
    code, _, err = cli(capsys, host, "vgpu", "list")
    assert code == 130 and "interrupted" in err


def test_k_a_held_lock_is_transient_and_a_blocked_plan_is_permanent(make_host, capsys, monkeypatch):
    from vgpuhost.io import locks
    host = make_host("a40-mdev")
    StateStore(host.state_dir).close()
    # the wrapped function holds the default (the @contextmanager wrapper passes keywords through)
    monkeypatch.setattr(locks.file_lock.__wrapped__, "__kwdefaults__", {"timeout_s": 0.05})
    with locks.file_lock(host.state_dir, "gpu-0000:81:00.0", timeout_s=1):
        code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 5 and "lock" in err, err                # a lock held: retry later
    assert not list((host.root / "sys/bus/mdev/devices").iterdir())
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-48Q")
    assert code == 0
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 2 and "cannot place" in err             # no capacity: permanent


def test_k_boot_units_retry_transient_exits_not_permanent_ones():
    from vgpuhost.ops import units
    for name, codes in units.RETRY_EXITS.items():
        assert "5" in codes.split() and "2" not in codes.split(), (name, codes)


# ---------------------------------------------------------------------------
# d. a remove of an open vGPU: no EBUSY exists to retry (a remove of an open mdev blocks until it is
# closed, Linux >= 5.8): refused while a holder is seen, the write bounded, else "remove pending" --
# tests/test_remove_blocking.py


# ---------------------------------------------------------------------------
# e. vgpu remove of a running domain's vGPU is refused, naming the domain

def test_e_vgpu_remove_refuses_a_running_domains_vgpu(make_host, capsys):
    from vgpuhost.ops.vgpu import create
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    dom = "11111111-2222-4333-8444-0000000000e5"
    out = create(host, store, profile="A40-8Q", owner=dom)
    store.domain_started(dom, "web-01")
    code, _, err = cli(capsys, host, "vgpu", "remove", out.id)
    assert code == 2 and "web-01" in err and dom in err and err.count("\n") == 1
    assert (host.mdev_devices / out.id).exists() and len(store.vgpu_records()) == 1
    store.domain_stopped(dom)                                # stopped: the operator may take it
    code, _, err = cli(capsys, host, "vgpu", "remove", out.id)
    assert code == 0, err


# ---------------------------------------------------------------------------
# f. a layout's vGPUs are lent to domains (the pool model)

POOL_LAYOUT = """
version: 1
layouts:
  vdi:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu:
          types: {A40-8Q: 6}
"""
DOM_F1 = "11111111-2222-4333-8444-0000000000f1"
DOM_F2 = "11111111-2222-4333-8444-0000000000f2"
UUID_F1 = "aaaaaaaa-2222-4333-8444-0000000000f1"


def _hook(host, op, sub, xml):
    import io
    from vgpuhost.hook import runtime as handler
    err = io.StringIO()
    rc = handler.main(["vm", op, sub, "-"], io.BytesIO(xml.encode()), err, host=host)
    return rc, err.getvalue()


def _mdev_xml(dom, uuid, profile="A40-8Q"):
    from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
    from test_hook import domain_xml, mdev_hostdev
    return domain_xml("vm", dom, Metadata(vgpus=[VgpuRequest(profile, uuid=uuid)]), [mdev_hostdev(uuid)])


def test_f_a_layouts_vgpus_are_lent_to_domains_and_given_back(make_host, tmp_path, capsys):
    host = make_host("a40-mdev")
    cfg = tmp_path / "layout.yaml"
    cfg.write_text(POOL_LAYOUT)
    assert cli(capsys, host, "apply", "-c", str(cfg))[0] == 0
    store = StateStore(host.state_dir)
    pool = sorted(r.id for r in store.vgpu_records(owner="layout"))
    assert len(pool) == 6
    # a domain attached with --profile (its own UUID): the GPU is full of the layout's vGPUs
    xml = _mdev_xml(DOM_F1, UUID_F1)
    rc, err = _hook(host, "prepare", "begin", xml)
    assert rc == 0, err                                     # "no A40-8Q instance free" before
    (mine,) = store.vgpu_records(owner=DOM_F1)
    assert (mine.id, mine.pool) == (UUID_F1, "layout") and (host.mdev_devices / UUID_F1).exists()
    assert len(list(host.mdev_devices.iterdir())) == 6      # a slot handed over, not a 7th vGPU
    assert cli(capsys, host, "assert", "-c", str(cfg))[0] == 0     # the layout still counts 6
    assert cli(capsys, host, "apply", "-c", str(cfg))[0] == 0
    assert len(list(host.mdev_devices.iterdir())) == 6 and store.vgpu_records(owner=DOM_F1)
    rc, err = _hook(host, "release", "end", xml)
    assert rc == 0, err
    assert store.vgpu_records(owner=DOM_F1) == [] and len(store.vgpu_records(owner="layout")) == 6
    assert (host.mdev_devices / UUID_F1).exists()            # given back to the pool, not removed
    assert cli(capsys, host, "assert", "-c", str(cfg))[0] == 0
    # a domain naming one of the pool's vGPUs (attach --uuid) claims it with no write
    named = sorted(r.id for r in store.vgpu_records(owner="layout") if r.id != UUID_F1)[0]
    writes = len(store.audit_rows())
    xml2 = _mdev_xml(DOM_F2, named)
    rc, err = _hook(host, "prepare", "begin", xml2)
    assert rc == 0, err
    assert [r.id for r in store.vgpu_records(owner=DOM_F2)] == [named]
    assert not [r for r in store.audit_rows()[writes:] if r.path.startswith("/sys")]
    assert _hook(host, "release", "end", xml2)[0] == 0
    assert len(store.vgpu_records(owner="layout")) == 6 and len(list(host.mdev_devices.iterdir())) == 6


def test_f_attach_uuid_names_one_of_the_layouts_vgpus(make_host, tmp_path, capsys):
    import libvirt
    from vgpuhost.ops.attach import attach
    host = make_host("a40-mdev")
    cfg = tmp_path / "layout.yaml"
    cfg.write_text(POOL_LAYOUT)
    assert cli(capsys, host, "apply", "-c", str(cfg))[0] == 0
    store = StateStore(host.state_dir)
    named = sorted(r.id for r in store.vgpu_records(owner="layout"))[0]
    conn = libvirt.open("test:///default")
    try:
        conn.defineXML("<domain type='test'><name>pool-vm</name><memory>65536</memory><os><type>hvm</type>"
                       "</os><devices/></domain>")
        out = attach(host, store, "test:///default", "pool-vm", uuid=named)
        assert [d.id for d in out.devices] == [named] and out.devices[0].profile == "A40-8Q"
        xml = conn.lookupByName("pool-vm").XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        assert f"uuid='{named}'" in xml or f'uuid="{named}"' in xml
        with pytest.raises(RefusedError):                   # one domain per pooled vGPU
            conn.defineXML("<domain type='test'><name>pool-vm2</name><memory>65536</memory><os><type>hvm"
                           "</type></os><devices/></domain>")
            attach(host, store, "test:///default", "pool-vm2", uuid=named)
        from vgpuhost.model.errors import InputError
        with pytest.raises(InputError):                      # not a vGPU vgpuhost knows
            attach(host, store, "test:///default", "pool-vm2", uuid="aaaaaaaa-2222-4333-8444-00000000dead")
    finally:
        for n in ("pool-vm", "pool-vm2"):
            try:
                conn.lookupByName(n).undefine()
            except libvirt.libvirtError:
                pass
        conn.close()


# ---------------------------------------------------------------------------
# h. modprobe-config with vfio-pci built into the kernel: the kernel command line, not modprobe.d

BUILTIN_VFIO = """
version: 1
name: builtin-vfio
host:
  modules: [vfio, vfio_iommu_type1, nvidia, snd_hda_intel]
  builtin_modules: [vfio_pci, vfio_pci_core]
devices:
  - {bdf: "0000:80:03.0", model: intel-root-port}
  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:80:03.0"}
  - {bdf: "0000:81:00.1", model: nvidia-hda, upstream: "0000:80:03.0"}
"""


def test_h_modprobe_config_with_builtin_vfio_pci_gives_the_kernel_command_line(make_host, capsys):
    host = make_host(yaml_text=BUILTIN_VFIO)
    code, out, err = cli(capsys, host, "passthrough", "modprobe-config", "0000:81:00.0")
    assert code == 0, err
    assert "vfio-pci.ids=10de:2235,10de:1aef" in out and "kernel command line" in out
    assert "options vfio-pci" not in out and "modprobe.d options are ignored" in out
    host2 = make_host("a40-mdev")                          # a loadable module: modprobe.d as before
    code, out, _ = cli(capsys, host2, "passthrough", "modprobe-config", "0000:81:00.0")
    assert code == 0 and "options vfio-pci ids=" in out


# ---------------------------------------------------------------------------
# m. plan escapes domain names (a newline in one must not forge output lines)

def test_m_plan_escapes_domain_names(make_host, tmp_path, capsys):
    from vgpuhost.ops.vgpu import create
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    dom = "11111111-2222-4333-8444-0000000000d1"
    create(host, store, profile="A40-8Q", owner=dom)
    store.domain_started(dom, "evil\n  1. passthrough  0000:81:00.0  forged step")
    cfg = tmp_path / "pt.yaml"
    cfg.write_text("version: 1\nlayouts:\n  pt:\n    gpus:\n      - select: {board: A40}\n        mode: passthrough\n")
    code, out, err = cli(capsys, host, "plan", "-c", str(cfg))
    text = out + err
    assert "evil\\n" in text, text
    assert not any(line.lstrip().startswith("1. passthrough  0000:81:00.0  forged") for line in text.splitlines())


def test_m_scheduler_persist_is_refused_for_a_board_without_vgpu(make_host, capsys):
    host = make_host("turing-consumer")                     # a GeForce RTX 2080: no vGPU
    code, _, err = cli(capsys, host, "scheduler", "set", "--policy", "equal-share", "--gpu", "0000:01:00.0",
                       "--persist")
    assert code == 2 and "no vGPU support" in err, err
    assert not (host.root / "etc/modprobe.d/vgpuhost-scheduler.conf").exists()
    host2 = make_host("a40-mdev")                           # a vGPU board: written as before
    code, _, err = cli(capsys, host2, "scheduler", "set", "--policy", "equal-share", "--gpu", "0000:81:00.0",
                       "--persist")
    assert code == 0, err


# ---------------------------------------------------------------------------
# c. a PF with SR-IOV VFs enabled cannot be passed through (vfio-pci refuses such a PF)

def test_c_a_pf_with_vfs_enabled_is_refused_with_the_fix(make_host, capsys):
    host = make_host("a100-sriov-mdev")
    gpu = "0000:41:00.0"
    assert int((host.pci_device(gpu) / "sriov_numvfs").read_text()) > 0
    code, _, err = cli(capsys, host, "passthrough", "prepare", gpu)
    assert code == 2 and "SR-IOV VFs enabled" in err and "sriov-manage -d" in err, err
    assert driver(host, gpu) == "nvidia" and override(host, gpu) == "(null)"
    # the simulator models the kernel: vfio-pci's probe refuses the PF, drivers_probe binds nothing
    from vgpuhost.io.sysfs import Sysfs as Fs
    from vgpuhost.model.errors import SysfsError
    fs = Fs(host)
    fs.write(host.pci_device(gpu) / "driver_override", "vfio-pci")
    fs.write(host.pci_drivers / "nvidia" / "unbind", gpu)
    fs.write(host.pci_drivers_probe, gpu)
    assert driver(host, gpu) is None
    with pytest.raises(SysfsError) as ei:
        fs.write(host.pci_drivers / "vfio-pci" / "bind", gpu)
    assert ei.value.errno == 16


# ---------------------------------------------------------------------------
# i. host check: one verdict per mode, matching what the commands then do

def _verdicts(capsys, host):
    import json
    code, out, err = cli(capsys, host, "--json", "host", "check")
    doc = json.loads(out)
    return code, doc, {(g["gpu"], m["mode"]): g for m in doc["modes"] for g in m["gpus"]}


def _profile_for(host, gpu):
    """A profile the GPU offers now (its first type with a free instance), else one its board has."""
    from vgpuhost.io.catalog import load_catalog
    from vgpuhost.observe.inventory import discover
    inv = discover(Sysfs(host))
    free = [t.name for t in inv.vgpu_types if t.gpu == A(gpu) and t.available_instances > 0]
    if free:
        return free[0]
    dev = inv.gpu(A(gpu)).pci.device
    model = next(m for m in load_catalog().gpus.values() if m.ids.device == dev)
    timesliced = [t for t in model.vgpu_types if t.gi_profile is None]
    return (timesliced or model.vgpu_types)[0].name if model.vgpu_types else "A40-8Q"


@pytest.mark.parametrize("spec", ["a100-sriov-mdev", "a40-mdev", "h200-mig", "h200-mig-on", "iommu-off",
                                  "l40s-vendor-vfio", "sata-shared-group", "turing-consumer"])
def test_i_each_mode_verdict_is_what_the_command_then_does(make_host, capsys, spec):
    """For every GPU: passthrough 'ready' iff 'passthrough prepare --dry-run' goes ahead; vGPU 'ready' iff
    'vgpu create --gpu --dry-run' of a profile it offers goes ahead; MIG 'ready' iff MIG is on or
    'mig enable --dry-run' goes ahead."""
    host = make_host(spec)
    code, doc, v = _verdicts(capsys, host)
    gpus = sorted({g for g, _ in v})
    assert gpus and {m["mode"] for m in doc["modes"]} == {"passthrough", "vgpu", "mig"}
    for gpu in gpus:
        rc, _, err = cli(capsys, host, "passthrough", "prepare", gpu, "--dry-run")
        assert (rc == 0) == (v[gpu, "passthrough"]["verdict"] == "ready"), (gpu, rc, err, v[gpu, "passthrough"])
        rc, _, err = cli(capsys, host, "vgpu", "create", "--gpu", gpu, "--profile", _profile_for(host, gpu),
                         "--dry-run")
        assert (rc == 0) == (v[gpu, "vgpu"]["verdict"] == "ready"), (gpu, rc, err, v[gpu, "vgpu"])
        rc, out, err = cli(capsys, host, "mig", "show", "--gpu", gpu)
        mig_on = rc == 0 and ": MIG on" in out
        rc, _, err = cli(capsys, host, "mig", "enable", "--gpu", gpu, "--dry-run")
        assert (rc == 0 or mig_on) == (v[gpu, "mig"]["verdict"] == "ready"), (gpu, rc, err, v[gpu, "mig"])
        if v[gpu, "mig"]["verdict"] == "unsupported":
            assert "not MIG-capable" in err
    # the host is ready only when no finding is an error and every GPU serves some mode now
    idle = [g for g in gpus if all(v[g, m]["verdict"] != "ready" for m in ("passthrough", "vgpu", "mig"))]
    assert doc["ready"] == (doc["counts"]["error"] == 0 and not idle) and code == (0 if doc["ready"] else 1)
    assert all(m["verdict"] == ("ready" if any(g["verdict"] == "ready" for g in m["gpus"]) else m["verdict"])
               for m in doc["modes"])


def test_i_no_vgpu_ready_with_zero_types_and_no_ready_host_with_its_only_gpu_blocked(make_host, capsys):
    # the H200 in MIG mode with no GPU instance: its VFs offer no type, so no "ok VGPU_READY ... 0 types"
    host = make_host("h200-mig-on")
    code, out, _ = cli(capsys, host, "host", "check")
    assert "VGPU_READY" not in out and "0 types" not in out, out
    assert "VGPU_NO_TYPES" in out and "mig apply --gpu 0000:18:00.0" in out
    _, _, v = _verdicts(capsys, host)
    assert v["0000:18:00.0", "vgpu"]["verdict"] == "blocked" and v["0000:18:00.0", "mig"]["verdict"] == "ready"
    # one GeForce, passthrough blocked (console, persistenced, nvidia_drm), no vGPU, no MIG: not ready
    host = make_host("turing-consumer")
    code, out, _ = cli(capsys, host, "host", "check")
    assert code == 1 and "host is ready" not in out, out
    assert "host is NOT ready: 0000:01:00.0 can serve no mode now (passthrough blocked" in out
    code, doc, v = _verdicts(capsys, host)
    assert code == 1 and doc["ready"] is False and doc["counts"]["error"] == 0
    assert v["0000:01:00.0", "passthrough"]["verdict"] == "blocked"
    assert "nvidia-persistenced" in v["0000:01:00.0", "passthrough"]["reason"]
    # the A100 with its VFs on: passthrough is blocked (issue 12 #4c), vGPU is ready, so the host is
    # ready and says for which modes
    host = make_host("a100-sriov-mdev")
    code, out, _ = cli(capsys, host, "host", "check")
    assert code == 0 and "host is ready for vGPU, MIG (passthrough blocked)" in out, out


# ---------------------------------------------------------------------------
# m. parse errors never echo the content of the file that failed to parse

SECRET_LINES = "root:$6$SECRETHASH$0123abcd:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"


@pytest.mark.parametrize("argv", [["config", "check", "-c", "{cfg}"], ["plan", "-c", "{cfg}"],
                                  ["apply", "-c", "{cfg}", "--dry-run"], ["assert", "-c", "{cfg}"],
                                  ["sim", "create", "{cfg}", "{tmp}/host2"]])
def test_m_a_config_symlinked_to_a_secret_file_is_refused_by_position_only(make_host, tmp_path, capsys, argv):
    host = make_host("a40-mdev")
    secret = tmp_path / "shadow"
    secret.write_text(SECRET_LINES)
    cfg = tmp_path / "config.yaml"
    cfg.symlink_to(secret)
    code, out, err = cli(capsys, host, *[a.format(cfg=cfg, tmp=tmp_path) for a in argv])
    assert code == 2 and err.count("\n") == 1, err
    assert f"{cfg}:1: not a vgpuhost" in err and "content is not shown" in err, err
    assert "SECRET" not in out + err and "daemon" not in out + err and "$6$" not in out + err


@pytest.mark.parametrize("text, where", [
    ("version: 1\nlayouts:\n  a: {gpus: []}\n'root:$6$SECRET$x': 1\n", ":4: unknown key (not shown: "),
    ("version: 1\nlayouts: 'SECRET$abc/def'\n", ":2: layouts must be a mapping, found a string (not shown: "),
    ("version: 1\n'x$SECRET': 1\n'x$SECRET': 2\n", ":3: duplicate key (not shown: "),
    ("version: 1\nlayouts: !SECRETTAG foo\n", ":2: "),
])
def test_m_values_that_are_not_plain_names_are_not_quoted(make_host, tmp_path, capsys, text, where):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    code, _, err = cli(capsys, make_host("a40-mdev"), "config", "check", "-c", str(cfg))
    assert code == 2 and where in err and "SECRET" not in err, err


@pytest.mark.parametrize("key", ["web", "team-a.web:1+x", "a" * 64, "bad key", "a" * 65, "-lead", "web\n",
                                 "x/y", "käse"])
def test_m_anti_affinity_follows_the_metadata_parsers_rule(make_host, capsys, key):
    """'vgpu create --anti-affinity' took values the domain metadata parser refuses, so a key given on the
    command line could never match one from a domain."""
    from vgpuhost.libvirt.domxml import Metadata, VgpuRequest, parse_domain
    from vgpuhost.model.errors import InputError
    meta = Metadata(anti_affinity=key, vgpus=[VgpuRequest("A40-8Q", uuid="aaaaaaaa-2222-4333-8444-000000000001")])
    try:
        xml = (f"<domain><name>x</name><uuid>{DOM_A}</uuid><metadata>{meta.to_xml()}</metadata></domain>")
        parse_domain(xml)
        parser_accepts = True
    except InputError:
        parser_accepts = False
    host = make_host("a40-mdev")
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--anti-affinity", key)
    assert (code == 0) == parser_accepts, (key, code, err)
    if not parser_accepts:
        assert code == 2 and "--anti-affinity" in err and not list(host.mdev_devices.iterdir())
    assert parser_accepts == (key in ("web", "team-a.web:1+x", "a" * 64))


@pytest.mark.parametrize("argv", [["vgpu", "create", "--profile", "A40-8Q"],
                                  ["vgpu", "remove", "aaaaaaaa-2222-4333-8444-000000000001"],
                                  ["passthrough", "prepare", "0000:81:00.0"],
                                  ["scheduler", "set", "--gpu", "0000:81:00.0", "--policy", "equal-share"],
                                  ["mig", "enable", "--gpu", "0000:81:00.0"]])
def test_m_write_commands_do_not_create_a_store_in_a_directory_that_is_not_a_host_root(tmp_path, capsys, argv):
    """A mistyped --root left var/lib/vgpuhost (an empty store) in whatever directory it named."""
    root = tmp_path / "not-a-host"
    root.mkdir()
    (root / "notes.txt").write_text("x\n")
    code = main(["--root", str(root), *argv])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert f"{root} is not a host root" in err and "--root" in err
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("column, value", [("id", "../../../../../../tmp/evil"), ("parent", "0000:81:00.0/../.."),
                                           ("type_id", "../nvidia-566"), ("gpu", "evil-gpu\n")])
def test_m_ids_read_from_the_store_are_validated_before_they_become_sysfs_paths(make_host, capsys, column, value):
    """A state.db changed outside vgpuhost: an id with '../' in it used to become part of the path of a
    sysfs write (remove, create).  Now every id is checked as it is read, and nothing is written."""
    import sqlite3
    from vgpuhost.ops.vgpu import create
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")
    rows = len(store.audit_rows())
    with sqlite3.connect(host.state_dir / "state.db") as conn:
        conn.execute(f"UPDATE vgpus SET {column} = ?", (value,))
    for argv in (["vgpu", "list"], ["vgpu", "remove", out.id], ["reconcile"]):
        code, _, err = cli(capsys, host, *argv)
        assert code == 2 and "evil" not in err and "../" not in err, (argv, err)
        if argv[:2] != ["vgpu", "remove"] or column != "id":      # (removing by the old id finds no row: "left alone")
            assert "state.db: a row of table vgpus holds a" in err, (argv, err)
            assert "restore state.db from a backup" in err
    assert len(StateStore(host.state_dir).audit_rows()) == rows
    assert out.id in {p.name for p in host.mdev_devices.iterdir()}


def test_k_a_sigterm_while_the_command_loads_exits_130(monkeypatch, capsys):
    """The entry point takes SIGTERM from its first line: one that lands while the command's modules load
    (here: while the command line is matched) is exit 130 and one line, not Python's 143."""
    from vgpuhost.cli import entry

    def terminated(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt")
    monkeypatch.setattr(entry, "match", terminated)
    monkeypatch.setattr(sys, "argv", ["vgpuhost", "vgpu", "list"])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as e:
            entry.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert e.value.code == 130 and capsys.readouterr().err == "vgpuhost: interrupted\n"
