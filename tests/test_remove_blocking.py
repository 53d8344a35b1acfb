"""A remove of an open vGPU: the simulator blocks it as the kernel does, and no vgpuhost command hangs on it.

Since Linux 5.8 a write to an open mdev's ``remove`` does not fail with EBUSY: it blocks the
writer until the device is closed (``vfio_unregister_group_dev()``); NVIDIA's vendor-VFIO driver
answers a destroy of an open VF with EPERM (docs/reference/hardware.md#mdev, #vendor-vfio).
vgpuhost refuses while it sees a holder (``proc/<pid>/fd`` links to the device's VFIO nodes) and
bounds every remove write (``VGPUHOST_REMOVE_TIMEOUT_S``), leaving the removal pending for
reconcile.  Every outcome is read back from the simulated tree and the state store.
"""

from __future__ import annotations

import errno
import io
import os
import threading
import time

import pytest

from vgpuhost.cli.main import main
from vgpuhost.hook import runtime as hook
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.io.vfioholders import REMOVE_TIMEOUT_ENV, Holder, holders
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.model.errors import SysfsError
from vgpuhost.ops.vgpu import create
from vgpuhost.sim.kernel import SimKernel

A40 = "0000:81:00.0"                    # a40-mdev
VF0 = "0000:21:00.4"                    # l40s-vendor-vfio
A40_8Q = "nvidia-566"
DOM = "11111111-2222-4333-8444-0000000000b1"
MDEV = "aaaaaaaa-2222-4333-8444-0000000000b1"
#: how long a test waits for something that happens at once in the normal case (a deadline, not a tolerance)
DEADLINE_S = 20.0


def cli(capsys, host: HostRoot, *argv):
    code = main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def until(what, deadline_s: float = DEADLINE_S) -> None:
    """Wait for ``what()`` to hold (it does within milliseconds unless something is wrong)."""
    end = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def make_mdev(host: HostRoot) -> str:
    Sysfs(host).write(host.mdev_bus / A40 / "mdev_supported_types" / A40_8Q / "create", MDEV)
    return MDEV


def requests(kernel: SimKernel, pid: int) -> int:
    return kernel.meta()["opened"][str(pid)]["requests"]


# ---------------------------------------------------------------------------
# the simulator, as the kernel

def test_the_simulator_blocks_a_remove_of_an_open_mdev_until_it_is_closed(make_host):
    host = make_host("a40-mdev")
    uuid = make_mdev(host)
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(uuid)
    group = os.path.basename(os.readlink(host.mdev_devices / uuid / "iommu_group"))
    done = []
    writer = threading.Thread(target=lambda: (Sysfs(host).write(host.mdev_devices / uuid / "remove", "1"),
                                              done.append(True)), daemon=True)
    writer.start()
    until(lambda: requests(kernel, pid) >= 1)       # the unregister has asked qemu to let go
    assert writer.is_alive() and not done           # ... and the writer waits: no EBUSY, no return
    assert (host.mdev_devices / uuid).is_dir() and (host.dev_vfio / group).exists()
    # remove_store() removed its own file: a second writer meanwhile finds none
    with pytest.raises(SysfsError) as second:
        Sysfs(host).write(host.mdev_devices / uuid / "remove", "1")
    assert second.value.errno == errno.ENOENT
    kernel.close_vgpu(pid)                          # qemu closes the device
    writer.join(DEADLINE_S)
    assert not writer.is_alive() and done == [True]
    assert not os.path.lexists(host.mdev_devices / uuid) and not (host.dev_vfio / group).exists()
    assert not (host.proc / str(pid)).exists()


def test_a_blocked_remove_whose_writer_is_killed_still_removes_the_mdev_at_the_close(make_host):
    """The kernel's wait for the release is uninterruptible: a writer killed while its remove waits
    does not leave the device half removed (no ``remove`` file, never going); it goes when the last
    holder closes it, whole, and its UUID can be made again."""
    import subprocess
    import sys
    host = make_host("a40-mdev")
    uuid = make_mdev(host)
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(uuid)
    group = os.path.basename(os.readlink(host.mdev_devices / uuid / "iommu_group"))
    writer = subprocess.Popen([sys.executable, "-c",
                               "import sys; from pathlib import Path; from vgpuhost.io.hostroot import HostRoot;"
                               " from vgpuhost.sim.kernel import SimKernel;"
                               " h = HostRoot(Path(sys.argv[1])); SimKernel(h).write(h.mdev_devices / sys.argv[2] / 'remove', '1')",
                               str(host.root), uuid])
    try:
        until(lambda: requests(kernel, pid) >= 1)       # it waits for the release
        assert writer.poll() is None
    finally:
        writer.kill()
        writer.wait(DEADLINE_S)
    assert (host.mdev_devices / uuid).is_dir() and not (host.mdev_devices / uuid / "remove").exists()
    kernel.close_vgpu(pid)                              # qemu closes the device
    assert not os.path.lexists(host.mdev_devices / uuid) and not (host.dev_vfio / group).exists()
    assert not os.path.lexists(os.path.realpath(host.pci_device(A40)) + "/" + uuid)
    assert Sysfs(host).listdir(host.mdev_bus / A40 / "mdev_supported_types" / A40_8Q / "devices") == []
    assert make_mdev(host) == uuid and (host.mdev_devices / uuid / "remove").exists()


def test_a_closed_mdev_is_removed_at_once(make_host):
    host = make_host("a40-mdev")
    uuid = make_mdev(host)
    kernel = SimKernel(host)
    kernel.close_vgpu(kernel.open_vgpu(uuid))
    Sysfs(host).write(host.mdev_devices / uuid / "remove", "1")
    assert not os.path.lexists(host.mdev_devices / uuid)


def test_destroying_an_open_vendor_vfio_vgpu_is_eperm_and_never_blocks(make_host):
    host = make_host("l40s-vendor-vfio")
    fs = Sysfs(host)
    cur = host.pci_device(VF0) / "nvidia" / "current_vgpu_type"
    fs.write(cur, "1155")
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(VF0)
    with pytest.raises(SysfsError) as e:
        fs.write(cur, "0")
    assert e.value.errno == errno.EPERM and fs.read(cur) == "1155"       # NVIDIA: usage count not zero
    kernel.close_vgpu(pid)
    fs.write(cur, "0")
    assert fs.read(cur) == "0"


def test_the_holders_are_read_from_proc_fd_links(make_host):
    host = make_host("a40-mdev")
    uuid = make_mdev(host)
    fs = Sysfs(host)
    kernel = SimKernel(host)
    mdir = str(host.mdev_devices / uuid)
    group = os.path.basename(os.readlink(host.mdev_devices / uuid / "iommu_group"))
    assert holders(fs, mdir) == []
    pid = kernel.open_vgpu(uuid)
    assert holders(fs, mdir) == [Holder(pid, "qemu-system-x86", f"/dev/vfio/{group}")]
    hidden = kernel.open_vgpu(uuid, comm="qemu-kvm", via="device")     # only anon_inode:[vfio-device]
    assert [h.pid for h in holders(fs, mdir)] == [pid]
    kernel.close_vgpu(pid)
    kernel.close_vgpu(hidden)
    assert holders(fs, mdir) == []
    # the iommufd form: the device's cdev, named by its vfio-dev/vfioN entry
    (host.mdev_devices / uuid / "vfio-dev" / "vfio3").mkdir(parents=True)
    (host.proc / "5100" / "fd").mkdir(parents=True)
    (host.proc / "5100" / "comm").write_text("qemu-system-x86\n")
    os.symlink("/dev/vfio/devices/vfio3", host.proc / "5100" / "fd" / "40")
    assert holders(fs, mdir) == [Holder(5100, "qemu-system-x86", "/dev/vfio/devices/vfio3")]


# ---------------------------------------------------------------------------
# vgpuhost: refuse what it sees, bound what it cannot

def test_vgpu_remove_of_an_open_vf_is_refused_naming_the_holder(make_host, capsys):
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="L40S-8Q")
    pid = SimKernel(host).open_vgpu(out.id)
    rows = len(store.audit_rows())
    code, _, err = cli(capsys, host, "vgpu", "remove", out.id)
    assert code == 2 and f"vGPU {out.id} is open, held by qemu-system-x86 (pid {pid}" in err, err
    assert err.count("\n") == 1 and len(store.audit_rows()) == rows
    assert Sysfs(host).read(host.pci_device(out.id) / "nvidia" / "current_vgpu_type") == out.type_id
    SimKernel(host).close_vgpu(pid)
    assert cli(capsys, host, "vgpu", "remove", out.id)[0] == 0
    assert store.vgpu_records() == []


def test_a_remove_that_blocks_times_out_stays_pending_and_reconcile_finishes_it(make_host, capsys, monkeypatch):
    """A holder vgpuhost cannot see (a device fd without its group fd): the write blocks; the
    command ends after the bound with one line, the journal entry stays open, and reconcile
    finishes it once the device is closed (the detached write completes by itself)."""
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(out.id, via="device")
    monkeypatch.setenv(REMOVE_TIMEOUT_ENV, "0.3")     # every remove write after this one blocks or is not made
    t0 = time.monotonic()
    code, _, err = cli(capsys, host, "vgpu", "remove", out.id)
    assert time.monotonic() - t0 < DEADLINE_S                                  # it came back
    assert code == 3 and err.count("\n") == 1, err
    assert (f"remove of {out.id} did not finish within 0.3 s: the device is still open (held by a process "
            "vgpuhost cannot see") in err and "stays pending" in err
    assert (host.mdev_devices / out.id).is_dir() and len(store.vgpu_records()) == 1
    assert requests(kernel, pid) >= 1                  # the kernel asked qemu to unplug it meanwhile
    code, text, _ = cli(capsys, host, "reconcile", "--check")
    assert code == 1 and f"vgpu remove {out.id}" in text
    code, text, _ = cli(capsys, host, "reconcile")                             # still open: pending
    assert code == 1 and "pending" in text and "already in progress" in text, text
    kernel.close_vgpu(pid)
    until(lambda: not os.path.lexists(host.mdev_devices / out.id))             # the write completed
    code, text, _ = cli(capsys, host, "reconcile")
    assert code == 0 and "finished" in text, text
    assert store.vgpu_records() == [] and store.journal_entries(open_only=True) == []


def test_reconcile_does_not_remove_a_vgpu_that_is_open(make_host, capsys):
    from vgpuhost.ops.vgpu import _journal_device
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")
    pid = SimKernel(host).open_vgpu(out.id)
    store.journal_open(kind="vgpu-remove", operation=f"vgpu remove {out.id}", owner=out.owner, actor="test",
                       gpu=out.gpu, group=None, steps=["remove"],
                       devices=[_journal_device(out.id, out.backend, out.gpu, out.parent, out.type_id,
                                                out.type_name, False, "removing")])
    code, text, _ = cli(capsys, host, "reconcile")
    assert code == 1 and f"vGPU {out.id} is open, held by qemu-system-x86 (pid {pid}" in text, text
    assert "remove pending" in text and (host.mdev_devices / out.id).is_dir()
    assert os.path.exists(host.mdev_devices / out.id / "remove")              # never written
    SimKernel(host).close_vgpu(pid)
    code, text, _ = cli(capsys, host, "reconcile")
    assert code == 0 and "finished" in text and store.vgpu_records() == []


def _domain(name: str) -> str:
    meta = Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV)])
    return (f"<domain type='kvm' id='7'>\n  <name>{name}</name>\n  <uuid>{DOM}</uuid>\n  <metadata>\n"
            f"{meta.to_xml()}  </metadata>\n  <devices>\n    <hostdev mode='subsystem' type='mdev' "
            f"model='vfio-pci' display='off'><source><address uuid='{MDEV}'/></source></hostdev>\n"
            "  </devices>\n</domain>\n")


def _hook(host: HostRoot, op: str, sub: str, xml: str):
    err = io.StringIO()
    rc = hook.main(["web", op, sub, "-"], io.BytesIO(xml.encode()), err, host=host)
    return rc, err.getvalue()


@pytest.mark.parametrize("via", ["group", "device"])
def test_the_hooks_release_end_refuses_or_times_out_and_never_hangs(make_host, monkeypatch, via):
    """``release end`` after a qemu that still holds its vGPU (seen: refused; unseen: the bounded
    write times out): one line, the vGPU and its record kept; once closed, the next release ends it."""
    host = make_host("a40-mdev")
    xml = _domain("web")
    assert _hook(host, "prepare", "begin", xml) == (0, "")
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(MDEV, via=via)
    monkeypatch.setenv(REMOVE_TIMEOUT_ENV, "0.3")     # only for the write that blocks: others keep 20 s
    rc, err = _hook(host, "release", "end", xml)
    monkeypatch.delenv(REMOVE_TIMEOUT_ENV)
    assert rc != 0 and err.count("\n") == 1, err
    if via == "group":
        assert f"vGPU {MDEV} is open, held by qemu-system-x86 (pid {pid}" in err, err
        assert os.path.exists(host.mdev_devices / MDEV / "remove")            # never written
    else:
        assert f"remove of {MDEV} did not finish within 0.3 s: the device is still open" in err, err
    store = StateStore(host.state_dir)
    assert (host.mdev_devices / MDEV).is_dir() and [r.id for r in store.vgpu_records()] == [MDEV]
    kernel.close_vgpu(pid)
    until(lambda: via == "group" or not os.path.lexists(host.mdev_devices / MDEV))
    assert _hook(host, "release", "end", xml)[0] == 0
    assert not os.path.lexists(host.mdev_devices / MDEV) and store.vgpu_records() == []


LAYOUT = """
version: 1
layouts:
  desk:
    gpus:
      - select: {board: A40}
        mode: vgpu
        vgpu:
          types: {A40-8Q: 2}
  none:
    gpus: []
"""


def test_layout_apply_refuses_to_remove_an_open_vgpu(make_host, tmp_path, capsys):
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    path = tmp_path / "layout.yaml"
    path.write_text(LAYOUT)
    assert cli(capsys, host, "apply", "-c", str(path), "desk")[0] == 0
    held = sorted(r.id for r in store.vgpu_records())[0]
    pid = SimKernel(host).open_vgpu(held)
    code, out, err = cli(capsys, host, "apply", "-c", str(path), "none")
    assert code != 0 and f"vGPU {held} is open, held by qemu-system-x86 (pid {pid}" in out + err, (out, err)
    assert (host.mdev_devices / held).is_dir() and held in {r.id for r in store.vgpu_records()}
    assert os.path.exists(host.mdev_devices / held / "remove")                # never written
    SimKernel(host).close_vgpu(pid)
    assert cli(capsys, host, "apply", "-c", str(path), "none")[0] == 0
    assert store.vgpu_records() == [] and not os.listdir(host.mdev_devices)


# ---------------------------------------------------------------------------
# the pieces: the bound, and the detached write on a real (unsimulated) root

@pytest.mark.parametrize("raw,want", [("", 20.0), ("0.5", 0.5), ("0", 0.05), ("9999", 600.0), ("soon", 20.0),
                                      ("nan", 20.0)])
def test_the_remove_bound_comes_from_the_environment(monkeypatch, raw, want):
    from vgpuhost.io.vfioholders import remove_timeout_s
    monkeypatch.setenv(REMOVE_TIMEOUT_ENV, raw)
    assert remove_timeout_s() == want


def test_a_bounded_write_on_a_real_root_writes_once_and_reports_the_errno(tmp_path):
    (tmp_path / "sys").mkdir()
    (tmp_path / "proc").mkdir()
    attr = tmp_path / "sys" / "attr"
    attr.write_text("")
    heard = []
    fs = Sysfs(HostRoot(tmp_path), observers=[lambda p, v, e: heard.append((p, v, e))])
    assert not fs.simulated
    assert fs.write_bounded(attr, "1", timeout_s=DEADLINE_S) is True
    assert attr.read_text() == "1"
    with pytest.raises(SysfsError) as e:
        fs.write_bounded(tmp_path / "sys", "1", timeout_s=DEADLINE_S)      # a directory: EISDIR
    assert e.value.errno == errno.EISDIR
    assert heard == [(str(attr), "1", 0), (str(tmp_path / "sys"), "1", errno.EISDIR)]


def test_the_hooks_release_ends_a_blocked_remove_before_its_own_timeout_and_keeps_it_pending(make_host, capsys,
                                                                                           monkeypatch):
    """Tester finding F2: the hook's alarm used to cut a blocked remove short, close its journal entry
    as failed, and a later ``reconcile`` re-created the vGPU for the stopped domain.  Now the remove's
    bound ends before the hook's timeout: the entry stays open (pending), the domain is forgotten, and
    once qemu closes the device ``reconcile`` finishes the removal instead of re-creating the vGPU."""
    host = make_host("a40-mdev")
    xml = _domain("web")
    assert _hook(host, "prepare", "begin", xml) == (0, "")
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(MDEV, via="device")        # a holder vgpuhost cannot see: the write blocks
    monkeypatch.delenv(REMOVE_TIMEOUT_ENV, raising=False)        # the default 20 s bound, over the hook's 4 s
    monkeypatch.setenv(hook.ENV_TIMEOUT, "4")
    rc, err = _hook(host, "release", "end", xml)
    assert rc == 3 and err.count("\n") == 1, err
    assert f"remove of {MDEV} did not finish within" in err and "timed out" not in err, err
    store = StateStore(host.state_dir)
    assert store.active_domains() == {}                                        # the domain is forgotten
    assert [e.kind for e in store.journal_entries(open_only=True)] == ["vgpu-remove"]     # pending, not failed
    kernel.close_vgpu(pid)
    until(lambda: not os.path.lexists(host.mdev_devices / MDEV))               # the detached write completed
    code, text, _ = cli(capsys, host, "reconcile")
    assert code == 0 and "finished" in text and "re-created" not in text, text
    assert not os.path.lexists(host.mdev_devices / MDEV) and store.vgpu_records() == []


def test_a_remove_interrupted_mid_write_stays_pending_and_is_never_re_created(make_host, capsys, monkeypatch):
    """An interruption while the remove write may be in flight (the hook's alarm, SIGTERM) leaves the
    journal entry open, not closed as failed; ``reconcile`` then finishes the removal."""
    from vgpuhost.ops import vgpu as vgpu_ops
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")

    def alarm(*_args, **_kw):
        raise hook.HookTimeout("the vgpuhost hook timed out after 1 s")
    monkeypatch.setattr(vgpu_ops, "destroy", alarm)
    with pytest.raises(hook.HookTimeout):
        vgpu_ops.remove(host, store, out.id, while_running=True)
    assert [e.kind for e in store.journal_entries(open_only=True)] == ["vgpu-remove"]
    monkeypatch.undo()
    code, text, _ = cli(capsys, host, "reconcile")
    assert code == 0 and "finished" in text and "re-created" not in text, text
    assert not os.path.lexists(host.mdev_devices / out.id) and store.vgpu_records() == []


def test_reconcile_never_re_creates_a_vgpu_whose_removal_is_pending(make_host, capsys):
    """A missing vGPU named by an open remove entry is the journal's to finish, not re-created."""
    from vgpuhost.ops.vgpu import _journal_device, reconcile
    host = make_host("a40-mdev")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="A40-8Q")
    store.journal_open(kind="vgpu-remove", operation=f"vgpu remove {out.id}", owner=out.owner, actor="test",
                       gpu=out.gpu, group=None, steps=["remove"],
                       devices=[_journal_device(out.id, out.backend, out.gpu, out.parent, out.type_id,
                                                out.type_name, False, "removing")])
    Sysfs(host).write(host.mdev_devices / out.id / "remove", "1")           # the write completed meanwhile
    rep = reconcile(host, store)
    assert rep.recreated == [] and "removal is pending" in rep.missing[0]
    assert not os.path.lexists(host.mdev_devices / out.id)


def test_remove_of_a_vf_held_by_an_unseen_process_says_so_in_plain_words(make_host, capsys):
    """The driver's EPERM for a VF whose holder vgpuhost cannot see reads as plain language, exit 2,
    the vGPU and its record kept (tester finding F6)."""
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="L40S-8Q")
    kernel = SimKernel(host)
    pid = kernel.open_vgpu(out.id, via="device")          # no group fd: invisible to the holder check
    code, _, err = cli(capsys, host, "vgpu", "remove", out.id)
    assert code == 2 and err.count("\n") == 1, err
    assert (f"vGPU {out.id} is still open, held by a process vgpuhost cannot see" in err
            and "stop the domain or process that uses it" in err), err
    assert Sysfs(host).read(host.pci_device(out.id) / "nvidia" / "current_vgpu_type") == out.type_id
    assert len(store.vgpu_records()) == 1
    assert cli(capsys, host, "reconcile", "--check")[0] == 0          # nothing left half-done
    kernel.close_vgpu(pid)
    assert cli(capsys, host, "vgpu", "remove", out.id)[0] == 0 and store.vgpu_records() == []


def _killed_writer(monkeypatch, *, after_write: bool) -> None:
    """Make every forked bounded-write child die by SIGKILL without answering: after its write (``after_write``)
    or before it, as a child killed (OOM) would."""
    import signal
    from vgpuhost.io import sysfs as sysfs_mod
    real = sysfs_mod._write_once

    def dying(kernel, path, value):
        if after_write:
            real(kernel, path, value)
        os.kill(os.getpid(), signal.SIGKILL)
    monkeypatch.setattr(sysfs_mod, "_write_once", dying)


def _remove_with_killed_writer(make_host, capsys, monkeypatch, after_write: bool):
    """``vgpu remove`` of a new L40S-8Q on a vendor-VFIO host, its forked writer killed after (or before) its
    write: ``(host, store, outcome, type file, exit code, stderr)``."""
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    out = create(host, store, profile="L40S-8Q")
    type_file = host.pci_device(out.id) / "nvidia" / "current_vgpu_type"
    _killed_writer(monkeypatch, after_write=after_write)
    code, _, err = cli(capsys, host, "vgpu", "remove", out.id)
    monkeypatch.undo()
    return host, store, out, type_file, code, err


def test_a_forked_writer_killed_after_its_write_landed_reports_the_remove_done(make_host, capsys, monkeypatch):
    """Trial 7 F1, the forked child's path (the CLI, the one-shot hook): a child killed after its vendor-VFIO
    clear landed answers nothing; the vGPU is read back gone, so the remove is done (exit 0, record dropped,
    ``reconcile --check`` in sync), never a definite EIO that keeps the record for ``reconcile`` to re-create."""
    host, store, out, type_file, code, err = _remove_with_killed_writer(make_host, capsys, monkeypatch, True)
    assert code == 0, err
    assert Sysfs(host).read(type_file) == "0" and store.vgpu_records() == []
    assert store.journal_entries(open_only=True) == []
    assert [r.result for r in store.audit_rows() if r.path.endswith("/current_vgpu_type")][-1] == "EINTR"
    code, text, _ = cli(capsys, host, "reconcile", "--check")
    assert code == 0, text


def test_a_forked_writer_killed_before_its_write_leaves_the_removal_pending(make_host, capsys, monkeypatch):
    """Trial 7 F1: a child killed before its write (nothing made) also answers nothing: whether the write was
    made is unknown, the vGPU reads back present, so the removal stays pending (exit 3, one line, journal
    open, record kept), as a remove that did not finish in time; ``reconcile`` then finishes it (removes the
    vGPU and drops the record), never re-creating it."""
    host, store, out, type_file, code, err = _remove_with_killed_writer(make_host, capsys, monkeypatch, False)
    assert code == 3 and err.count("\n") == 1, err
    assert (f"remove of {out.id} did not finish: the process making the write ended without answering (killed?)"
            in err and "stays pending" in err and "held by" not in err), err
    assert Sysfs(host).read(type_file) == out.type_id and [r.id for r in store.vgpu_records()] == [out.id]
    assert [e.kind for e in store.journal_entries(open_only=True)] == ["vgpu-remove"]
    code, text, _ = cli(capsys, host, "reconcile", "--check")
    assert code == 1 and f"vgpu remove {out.id}" in text, text
    code, text, _ = cli(capsys, host, "reconcile")
    assert code == 0 and "finished" in text and "re-created" not in text, text
    assert Sysfs(host).read(type_file) == "0" and store.vgpu_records() == []
    assert store.journal_entries(open_only=True) == []
    assert cli(capsys, host, "reconcile", "--check")[0] == 0
