"""The vGPU scheduler checked against primary sources (issue 25 items 3, 8, 9): what modprobe really
hands the nvidia module (docs/reference/hardware.md#vgpu-scheduling), the deprecated v1 NVML calls,
and no vGPU scheduler in MIG mode before Blackwell."""

from __future__ import annotations

import json

import pytest

from vgpuhost.cli.main import main
from vgpuhost.io.backends import backend_for
from vgpuhost.io.configfiles import modprobe_conf_files
from vgpuhost.io.nvml import NvmlError
from vgpuhost.io.state import StateStore
from vgpuhost.model.boards import ARCHITECTURES, BOARDS, MIG_NO_SCHEDULER, Board, board, mig_scheduler_on
from vgpuhost.model.errors import InputError, RefusedError
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.ops import scheduler as ops
from vgpuhost.policy import scheduler as pol
from vgpuhost.policy.config import parse as parse_config

S = SchedulerState
OWN = "/etc/modprobe.d/vgpuhost-scheduler.conf"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _write(host, rel, text):
    p = host.root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


@pytest.fixture
def l40s(make_host):
    host = make_host("l40s-vendor-vfio")
    return host, ops.host_gpus(host)


# ----------------------------------------------------------------- item 9: effective modprobe settings

def test_modprobe_reads_every_dir_sorted_by_name_first_dir_wins(l40s):
    """kmod's conf_files_list: *.conf of /etc, /run, /usr/local/lib, /usr/lib, /lib modprobe.d, sorted
    by file name whatever the directory; a name in a directory of higher precedence hides the others."""
    host, _ = l40s
    _write(host, "lib/modprobe.d/50-nvidia.conf", "x\n")
    _write(host, "etc/modprobe.d/50-nvidia.conf", "y\n")           # hides /lib's file of that name
    _write(host, "usr/lib/modprobe.d/10-dist.conf", "z\n")
    _write(host, "run/modprobe.d/zz-local.conf", "w\n")
    _write(host, "usr/local/lib/modprobe.d/60-site.conf", "v\n")
    _write(host, "etc/modprobe.d/notes.txt", "not a conf\n")
    (host.root / "etc/modprobe.d/sub.conf").mkdir()                 # a directory: skipped as kmod does
    files = modprobe_conf_files(host)
    assert [p for p, _ in files] == ["/usr/lib/modprobe.d/10-dist.conf", "/etc/modprobe.d/50-nvidia.conf",
                                     "/usr/local/lib/modprobe.d/60-site.conf", "/run/modprobe.d/zz-local.conf"]
    assert files[1][1] == "y\n"


def test_last_option_wins_across_files_and_the_kernel_command_line():
    files = [("/etc/modprobe.d/a.conf", 'options nvidia NVreg_RegistryDwords="RmPVMRL=0x11"\n'
                                        "# options nvidia NVreg_RegistryDwords=RmPVMRL=0x99\n"),
             ("/etc/modprobe.d/b.conf", "options nvidia-drm modeset=1\n"
                                        "options nvidia NVreg_EnableGpuFirmware=0 \\\n"
                                        '    NVreg_RegistryDwords="RmFoo=1;RmPVMRL=0x01" NVreg_X=1\n')]
    opts = pol.registry_options(files)
    assert [(o.value, o.source) for o in opts] == [("RmPVMRL=0x11", "/etc/modprobe.d/a.conf"),
                                                   ("RmFoo=1;RmPVMRL=0x01", "/etc/modprobe.d/b.conf")]
    eff = pol.effective_value(pol.effective_options(opts), "0000:41:00.0")
    assert (eff.value, eff.scope, eff.source) == (0x01, "all GPUs", "/etc/modprobe.d/b.conf")
    # kmod appends nvidia.<option>= words of the kernel command line after the files' options
    opts = pol.registry_options(files, 'BOOT_IMAGE=/vmlinuz nvidia.NVreg_RegistryDwords="RmPVMRL=0x3c3c0001" quiet',
                                "/proc/cmdline")
    eff = pol.effective_value(pol.effective_options(opts), "0000:41:00.0")
    assert (eff.value, eff.source) == (0x3C3C0001, "/proc/cmdline")


def test_per_device_option_last_one_wins_and_falls_back_to_global():
    files = [(OWN, 'options nvidia NVreg_RegistryDwords="RmPVMRL=0x11"\n'
                   'options nvidia NVreg_RegistryDwordsPerDevice="pci=0000:41:00.0;RmPVMRL=0x01"\n'),
             ("/etc/modprobe.d/zz-local.conf",
              'options nvidia NVreg_RegistryDwordsPerDevice="pci=0000:42:00.0;RmPVMRL=0x00030003"\n')]
    eff = pol.effective_options(pol.registry_options(files))
    # zz-local's per-device string replaces vgpuhost's: 41 loses its own entry and gets the global value
    assert pol.effective_value(eff, "0000:41:00.0") == pol.EffectiveValue(0x11, "all GPUs", OWN)
    assert pol.effective_value(eff, "0000:42:00.0").value == 0x00030003
    assert pol.overriding_sources(pol.registry_options(files), OWN) == ["/etc/modprobe.d/zz-local.conf"]


def test_show_reports_an_overriding_file_as_drift(l40s, capsys):
    """main reported vgpuhost's own file although zz-local.conf, read after it, overrides it."""
    host, gpus = l40s
    ops.persist(host, StateStore(host.state_dir), S("fixed-share", arr=True))
    _write(host, "etc/modprobe.d/zz-local.conf",
           '# site settings\noptions nvidia NVreg_RegistryDwords="RmPVMRL=0x01;SecretKey=hunter2"\n')
    code, out, err = run(capsys, "--root", str(host.root), "--json", "scheduler", "show", "--gpu", str(gpus[0]))
    assert code == 0, err
    doc = json.loads(out)
    [g] = doc["gpus"]
    assert g["persistent"]["value"] == "0x00000011"
    assert g["effective"] == {"value": "0x00000001", "scope": "all GPUs", "source": "/etc/modprobe.d/zz-local.conf",
                              "text": pol.describe_value(0x01)}
    assert g["drift"] == doc["drift"][0]
    assert doc["drift"] == [f"{gpus[0]}: /etc/modprobe.d/zz-local.conf overrides {OWN}: the nvidia module gets "
                            "RmPVMRL=0x00000001 (all GPUs) at its next load, not vgpuhost's RmPVMRL=0x00000011"]
    code, out, _ = run(capsys, "--root", str(host.root), "scheduler", "show", "--gpu", str(gpus[0]))
    assert "drift:      " in out and "from /etc/modprobe.d/zz-local.conf" in out
    assert "hunter2" not in out and "site settings" not in out          # parsed values only, never the file


def test_show_drift_when_a_later_file_drops_the_key(l40s):
    host, gpus = l40s
    ops.persist(host, StateStore(host.state_dir), S("equal-share", arr=False, timeslice_ms=3), gpus[1])
    _write(host, "run/modprobe.d/zz-nvidia.conf", 'options nvidia NVreg_RegistryDwordsPerDevice="pci=0000:00:00.0;RmX=1"\n')
    doc = ops.show(host, backend=_NoNvml())
    by = {g["gpu"]: g for g in doc["gpus"]}
    assert by[str(gpus[1])]["effective"] is None
    assert by[str(gpus[1])]["drift"] == (f"{gpus[1]}: /run/modprobe.d/zz-nvidia.conf overrides {OWN}: the nvidia "
                                         "module gets no RmPVMRL (best effort) at its next load, not vgpuhost's "
                                         "RmPVMRL=0x00030003")
    assert by[str(gpus[0])]["drift"] is None and len(doc["drift"]) == 1


def test_no_drift_when_vgpuhost_file_is_the_last_word(l40s):
    host, gpus = l40s
    _write(host, "etc/modprobe.d/nvidia.conf", 'options nvidia NVreg_RegistryDwords="RmPVMRL=0x01"\n')
    ops.persist(host, StateStore(host.state_dir), S("fixed-share", arr=True))
    doc = ops.show(host, backend=_NoNvml())
    assert doc["drift"] == []
    assert all(g["effective"]["source"] == OWN and g["effective"]["value"] == "0x00000011" for g in doc["gpus"])


def test_persist_notes_a_file_that_will_override_it(l40s):
    host, _ = l40s
    _write(host, "etc/modprobe.d/zz-local.conf", 'options nvidia NVreg_RegistryDwords="RmPVMRL=0x01"\n')
    out = ops.persist(host, StateStore(host.state_dir), S("fixed-share", arr=True), dry_run=True)
    assert any(n.startswith("/etc/modprobe.d/zz-local.conf sets NVreg_RegistryDwords* after vgpuhost's file")
               for n in out.notes)


class _NoNvml:
    """A backend whose every NVML call is unavailable (show reports the files all the same)."""

    def __getattr__(self, name):
        def fail(*a, **k):
            raise NvmlError(name, "NVMLError_NotSupported")
        return fail


# ----------------------------------------------------------------- item 3: no vGPU scheduler in MIG mode before Blackwell

def test_board_table_knows_which_architectures_schedule_in_mig_mode():
    assert {b.architecture for b in BOARDS.values()} <= set(ARCHITECTURES)
    for dev in (0x20F1, 0x20B5, 0x2330, 0x2331, 0x2335, 0x233B):          # A100, H100, H200
        assert board(dev).architecture in ("Ampere", "Hopper") and not board(dev).mig_scheduler
    # no GB20x board is in the catalogue yet: the "allowed" branch, by a board entry of that architecture
    gb = Board(0xFFFF, "RTX-PRO-6000-BLACKWELL-TEST", 98304, "Blackwell")
    assert gb.mig_scheduler and mig_scheduler_on("Blackwell") and not mig_scheduler_on("Volta")
    ok = pol.mig_scheduler_refusal("0000:41:00.0", gb.product, gb.architecture)
    assert "per GPU instance" in ok.message and MIG_NO_SCHEDULER not in ok.message
    no = pol.mig_scheduler_refusal("0000:41:00.0", "H200-SXM-141GB", "Hopper")
    assert no.message == ("GPU 0000:41:00.0 (H200-SXM-141GB, Hopper) is in MIG mode: no vGPU scheduler there "
                          "(Software Scheduler is not supported in MIG mode before Blackwell)")


def test_sim_answers_not_supported_with_the_driver_reason_in_mig_mode(make_host):
    host = make_host("h200-mig")
    gpu = ops.host_gpus(host)[0]
    nv = backend_for(host)
    nv.set_mig_mode(gpu, True)
    for call, args in (("scheduler_state", ()), ("set_scheduler_state", (S("equal-share", arr=True),))):
        with pytest.raises(NvmlError) as ei:
            getattr(nv, call)(gpu, *args)
        assert ei.value.not_supported and MIG_NO_SCHEDULER in ei.value.hint
    # and scheduler set refuses it with that reason, changing nothing
    with pytest.raises(RefusedError) as ei:
        ops.set_runtime(host, StateStore(host.state_dir), gpu, S("equal-share", arr=True), backend=nv)
    assert MIG_NO_SCHEDULER in ei.value.message and "H200-SXM-141GB, Hopper" in ei.value.message
    assert StateStore(host.state_dir).audit_rows() == []


def test_layout_refuses_a_scheduler_on_a_mig_entry_with_the_reason():
    text = ("version: 1\nlayouts:\n  m:\n    gpus:\n      - select: {board: H200-SXM-141GB}\n        mode: mig\n"
            "        mig: {instances: {1g.18gb: 1}}\n        scheduler: {policy: equal-share}\n")
    with pytest.raises(InputError) as ei:
        parse_config(text, source="layout.yaml")
    assert ei.value.message.startswith("layout.yaml:8:")
    assert MIG_NO_SCHEDULER in ei.value.message and "before Blackwell" in ei.value.message


def test_assert_and_plan_see_a_file_that_overrides_the_persisted_scheduler(make_host, capsys):
    """Item 9 for layouts: 'assert' compares what the nvidia module will get, not vgpuhost's own file, and
    a plan names the overriding file as an operator step (vgpuhost changes only its own file)."""
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "examples" / "config" / "vgpu-a40.yaml"
    host = make_host("a40-mdev")
    gpu = "0000:81:00.0"
    assert run(capsys, "--root", str(host.root), "apply", "-c", str(path))[0] == 0
    assert run(capsys, "--root", str(host.root), "scheduler", "set", "--gpu", gpu, "--policy", "fixed-share",
               "--persist")[0] == 0
    assert run(capsys, "--root", str(host.root), "assert", "-c", str(path))[0] == 0
    # a local file read after vgpuhost's (by name) takes the last word for this GPU
    _write(host, "etc/modprobe.d/zz-local.conf",
           f'options nvidia NVreg_RegistryDwordsPerDevice="pci={gpu};RmPVMRL=0x00"\n')
    code, out, _ = run(capsys, "--root", str(host.root), "assert", "-c", str(path))
    assert code == 1
    [line] = out.splitlines()[1:]
    assert line.startswith(f"- {gpu} scheduler-persist overridden ({gpu}: /etc/modprobe.d/zz-local.conf overrides "
                           f"{OWN}: the nvidia module gets RmPVMRL=0x00000000 (this GPU) at its next load")
    assert line.endswith("(needs an operator step)")
    code, out, _ = run(capsys, "--root", str(host.root), "--json", "plan", "-c", str(path))
    manual = json.loads(out)["manual"]
    assert [(m["kind"], m["target"]) for m in manual] == [("scheduler", gpu)]
    assert "zz-local.conf overrides" in manual[0]["why"] and f"pci={gpu};RmPVMRL=0x00" not in out   # values, not file text
    # the local file gone: in agreement again
    (host.root / "etc/modprobe.d/zz-local.conf").unlink()
    assert run(capsys, "--root", str(host.root), "assert", "-c", str(path))[0] == 0


def test_a_fifo_named_conf_in_modprobe_d_hangs_nothing(l40s, capsys):
    """Tester finding F1: a FIFO planted as zz-fifo.conf blocked 'scheduler show' forever; it is not a config file."""
    import os
    host, _ = l40s
    d = host.root / "etc/modprobe.d"
    d.mkdir(parents=True, exist_ok=True)
    os.mkfifo(d / "zz-fifo.conf")
    assert [p for p, _ in modprobe_conf_files(host)] == []
    code, _, err = run(capsys, "--root", str(host.root), "scheduler", "show")
    assert code == 0, err


def test_persist_and_show_in_mig_mode_offer_no_scheduler(make_host, capsys):
    """`scheduler set --persist` for a GPU in MIG mode is refused with the driver's reason, nothing written;
    `scheduler show` lists no policy there: device-level calls answer NOT_SUPPORTED (tester finding F7)."""
    host = make_host("h200-mig")
    gpu = ops.host_gpus(host)[0]
    backend_for(host).set_mig_mode(gpu, True)
    root = ("--root", str(host.root))
    code, out, err = run(capsys, *root, "scheduler", "set", "--policy", "equal-share", "--gpu", str(gpu),
                         "--persist")
    assert code == 2 and MIG_NO_SCHEDULER in err and err.count("\n") == 1, err
    assert not ops.conf_path(host).exists() and StateStore(host.state_dir).audit_rows() == []
    code, out, err = run(capsys, *root, "scheduler", "set", "--policy", "equal-share", "--all", "--persist")
    assert code == 0 and f"the driver ignores it on {gpu}: in MIG mode" in out, out
    code, out, err = run(capsys, *root, "scheduler", "set", "--policy", "best-effort", "--gpu", str(gpu),
                         "--persist")
    assert code == 0, err
    code, out, err = run(capsys, *root, "--json", "scheduler", "show", "--gpu", str(gpu))
    [e] = json.loads(out)["gpus"]
    assert e["mig"]["current"] and e["caps"] is None and e["errors"]["caps"] == "NVMLError_NotSupported", e
    code, out, err = run(capsys, *root, "scheduler", "show", "--gpu", str(gpu))
    assert "supports:" not in out and "Software Scheduler is not supported in MIG mode" in out, out


def test_modprobe_links_resolve_inside_the_host_root(l40s, tmp_path, capsys):
    """A modprobe.d link read under --root follows its target inside the root, as modprobe on that host
    would: an absolute target names the host's file, never the machine running vgpuhost, and '..' never
    climbs out (tester finding F8)."""
    import os
    host, _ = l40s
    d = host.root / "etc/modprobe.d"
    d.mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "outside.conf"                 # a file of "this machine", outside the host root
    outside.write_text('options nvidia NVreg_RegistryDwords="RmPVMRL=0x11"\n')
    os.symlink(str(outside), d / "zz-abs.conf")          # absolute: resolves to <root>/<that path>: absent
    os.symlink("../../../../../../../../../../.." + str(outside), d / "zz-up.conf")    # '..' stops at the root
    (host.root / "usr/lib/modprobe.d").mkdir(parents=True, exist_ok=True)
    (host.root / "usr/lib/modprobe.d/vendor.conf").write_text('options nvidia NVreg_RegistryDwords="RmPVMRL=0x01"\n')
    os.symlink("/usr/lib/modprobe.d/vendor.conf", d / "aa-vendor.conf")     # absolute, inside the host
    os.symlink("loop.conf", d / "loop.conf")
    files = modprobe_conf_files(host)
    assert [p for p, _ in files] == ["/etc/modprobe.d/aa-vendor.conf", "/usr/lib/modprobe.d/vendor.conf"]
    assert all("0x11" not in text for _, text in files)
    code, out, err = run(capsys, "--root", str(host.root), "--json", "scheduler", "show")
    assert code == 0 and "0x00000011" not in out, err
