"""The qemu hook's module bundle (issue 17 #3, io/modbundle.py): one file instead of ~40 module lookups.

What is asserted: ``hook install`` writes it and the dispatcher uses it; the
handler's prepare and release import every vgpuhost module they need from it
(so :data:`MODULES` is complete); a module whose source changed loads from its
file; a bundle others could have written, a truncated one, or one for another
Python is ignored, and the hook still works; a module whose code in the bundle
is damaged (a flipped bit, swapped index entries) loads from its file and
``hook status`` says so; ``hook install`` never writes through a symlinked
bundle folder.
"""

from __future__ import annotations

import marshal
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vgpuhost.io import modbundle
from vgpuhost.io.files import package_parent

from test_hook import (A100, A100_AUDIO, DOM1, MDEV1, a100_vfs_off, install, pt_domain, vf_domain,
                       vgpu_domain)

HOOK_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LC_ALL": "C"}
SERVED = "_Finder"


#: vgpuhost modules only the simulator imports on these starts: the simulated kernel places every vGPU
#: with the mixed-size grid's code (a real host's hook loads it only for a mixed-size vendor-VFIO GPU,
#: with the catalog, outside the bundle: ops/vgpu._placement_for)
SIM_ONLY = ("vgpuhost.model.mixedsize",)


def _run_handler(host, bundle: str, xml: str, tail: str = "") -> subprocess.CompletedProcess:
    """prepare begin then release end in one fresh ``python -I -S`` with the bundle in use, as the boot
    line starts it; prints the exit codes, how many modules the bundle holds, then each vgpuhost module
    (but the simulator's) with the loader that loaded it."""
    code = textwrap.dedent(f"""\
        import io, sys
        sys.path[:0] = [{package_parent()!r}]
        from vgpuhost.io.modbundle import use
        n = use({bundle!r})
        from vgpuhost.hook import runtime
        x = sys.stdin.buffer.read()
        codes = [runtime.main(['vm', op, sub, '-'], io.BytesIO(x), stderr=sys.stderr)
                 for op, sub in (('prepare', 'begin'), ('release', 'end'))]
        print(codes, n)
        for name, m in sorted(sys.modules.items()):
            if name.startswith('vgpuhost') and not name.startswith('vgpuhost.sim') and name not in {SIM_ONLY!r}:
                print(name, type(m.__spec__.loader).__name__)
        """) + tail
    env = dict(HOOK_ENV, VGPUHOST_ROOT=str(host.root), VGPUHOST_AGENT="off")
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], input=xml.encode(), capture_output=True,
                          env=env, timeout=120)


def test_hook_install_writes_the_bundle_and_the_dispatcher_uses_it(make_host, tmp_path):
    host = make_host("a40-mdev")
    hook = install(host, tmp_path)
    bundle = modbundle.bundle_path(str(host.root))
    st = os.stat(bundle)
    assert st.st_mode & 0o777 == 0o644 and st.st_uid == os.geteuid()
    fmt, tag, entries = modbundle.unpack(Path(bundle).read_bytes())
    assert fmt == modbundle.FORMAT and tag == sys.implementation.cache_tag
    assert set(entries) == set(modbundle.MODULES)
    assert f"use({bundle!r})" in hook.read_text().replace("'\\''", "'")
    # the installed dispatcher, as libvirt runs it: the vGPU appears and goes
    xml = vgpu_domain("vm1", DOM1, MDEV1).encode()
    for op, sub in (("prepare", "begin"), ("release", "end")):
        proc = subprocess.run([str(hook), "vm1", op, sub, "-"], input=xml, capture_output=True, env=HOOK_ENV,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert (host.mdev_devices / MDEV1).exists() == (op == "prepare")
    # uninstall takes the bundle away with the dispatcher
    from vgpuhost.hook.install import uninstall
    uninstall(host, hooks_dir=hook.parent)
    assert not hook.exists() and not os.path.exists(bundle)


@pytest.mark.parametrize("case", ["mdev", "vendor-vfio", "passthrough"])
def test_prepare_and_release_import_every_vgpuhost_module_from_the_bundle(make_host, tmp_path, case):
    """MODULES is complete: after use(), nothing of vgpuhost (simulator aside) loads from its own file."""
    if case == "mdev":
        host = make_host("a40-mdev")
        xml = vgpu_domain("vm", DOM1, MDEV1)
    elif case == "vendor-vfio":
        host = make_host("l40s-vendor-vfio")
        xml = vf_domain("vm", DOM1, "0000:21:00.4", "L40S-4Q")
    else:
        host = a100_vfs_off(make_host)
        xml = pt_domain("vm", DOM1, A100, [A100, A100_AUDIO])
    install(host, tmp_path)
    proc = _run_handler(host, modbundle.bundle_path(str(host.root)), xml)
    assert proc.returncode == 0, proc.stderr
    first, *rows = proc.stdout.decode().splitlines()
    assert first == f"[0, 0] {len(modbundle.MODULES)}"
    loaders = dict(row.split() for row in rows)
    before = {"vgpuhost", "vgpuhost.io", "vgpuhost.io.modbundle"}      # imported to call use()
    assert {n for n, loader in loaders.items() if loader != SERVED} == before
    assert set(loaders) - before <= set(modbundle.MODULES)
    # no tenant on this host: the admission rules and the tenant store code are not imported at all
    assert not {"vgpuhost.ops.tenancy", "vgpuhost.policy.admission"} & set(loaders), sorted(loaders)


def _package(tmp_path: Path, body: str) -> Path:
    pkg = tmp_path / "bundled_pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text('"""A package for the bundle tests."""\n')
    (pkg / "mod.py").write_text(body)
    return pkg


def _load(tmp_path: Path, bundle: Path,
          then: str = "import bundled_pkg.mod as m\n"
                      "print(n, m.VALUE, type(m.__spec__.loader).__name__, m.__file__ == m.__spec__.origin)\n") -> str:
    """``use()`` the bundle for the test package in a fresh ``python -I -S``, then run ``then``; its output."""
    code = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {package_parent()!r}]\n"
            "from vgpuhost.io.modbundle import use\n"
            f"n = use({str(bundle)!r}, {str(tmp_path / 'bundled_pkg')!r})\n" + then)
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode().strip()


def _build(tmp_path: Path, bundle: Path) -> int:
    code = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {package_parent()!r}]\n"
            "from vgpuhost.io.modbundle import build\n"
            f"print(build({str(bundle)!r}, ['bundled_pkg', 'bundled_pkg.mod', 'bundled_pkg.absent']))\n")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


def test_a_module_whose_source_changed_loads_from_its_file(tmp_path):
    _package(tmp_path, "VALUE = 1\n")
    bundle = tmp_path / "cache" / "b.bundle"
    assert _build(tmp_path, bundle) == 2                      # a module that does not exist is left out
    assert _load(tmp_path, bundle) == f"2 1 {SERVED} True"
    _package(tmp_path, "VALUE = 22  # changed\n")            # another size: the bundle's code is stale
    assert _load(tmp_path, bundle) == "2 22 SourceFileLoader True"


@pytest.mark.parametrize("spoil", ["group-writable", "world-writable", "truncated", "other-python", "garbage",
                                   "symlink", "absent", "grown", "format-1"])
def test_a_bundle_that_cannot_be_trusted_is_ignored(tmp_path, spoil):
    _package(tmp_path, "VALUE = 1\n")
    bundle = tmp_path / "cache" / "b.bundle"
    _build(tmp_path, bundle)
    data = bundle.read_bytes()
    if spoil == "group-writable":
        bundle.chmod(0o664)
    elif spoil == "world-writable":
        bundle.chmod(0o646)
    elif spoil == "truncated":
        bundle.write_bytes(data[: len(data) // 2])
    elif spoil == "other-python":
        fmt, _, entries = modbundle.unpack(data)
        bundle.write_bytes(modbundle.pack(fmt, "cpython-10", entries))
    elif spoil == "garbage":
        bundle.write_bytes(b"\x00not a bundle")
    elif spoil == "grown":
        bundle.write_bytes(data + b"\x00")
    elif spoil == "format-1":                 # the whole-file format of before 2026-12-07
        _, tag, entries = modbundle.unpack(data)
        bundle.write_bytes(marshal.dumps(("vgpuhost-hook-bundle/1", tag, entries)))
    elif spoil == "symlink":
        real = tmp_path / "cache" / "real.bundle"
        bundle.rename(real)
        bundle.symlink_to(real)
    else:
        bundle.unlink()
    assert _load(tmp_path, bundle) == "0 1 SourceFileLoader True"


def test_a_bundle_owned_by_another_user_is_ignored(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("runs as root (CI does): it gives the bundle to another user")
    _package(tmp_path, "VALUE = 1\n")
    bundle = tmp_path / "cache" / "b.bundle"
    _build(tmp_path, bundle)
    os.chown(bundle, 65534, 65534)
    assert _load(tmp_path, bundle) == "0 1 SourceFileLoader True"


@pytest.mark.parametrize("kind", ["fifo", "char-device", "open-folder", "folder-symlink"])
def test_a_bundle_path_that_could_hang_or_was_planted_is_ignored_at_once(tmp_path, kind):
    """A FIFO or a device at the bundle's path never blocks or floods the hook (it runs before its
    watchdog); a folder others may write to, or a symlinked one, is not trusted."""
    _package(tmp_path, "VALUE = 1\n")
    cache = tmp_path / "cache"
    bundle = cache / "b.bundle"
    _build(tmp_path, bundle)
    if kind == "fifo":
        bundle.unlink()
        os.mkfifo(bundle, 0o644)
    elif kind == "char-device":
        if os.geteuid() != 0:
            pytest.fail("runs as root (CI does): it makes a device node")
        bundle.unlink()
        os.mknod(bundle, 0o644 | stat.S_IFCHR, os.makedev(1, 5))          # /dev/zero's numbers
    elif kind == "open-folder":
        cache.chmod(0o777)
    else:
        real = tmp_path / "real-cache"
        cache.rename(real)
        cache.symlink_to(real)
    assert _load(tmp_path, bundle) == "0 1 SourceFileLoader True"       # _load's own timeout: 60 s


def test_another_installations_modules_and_a_bad_entry_load_from_their_files(tmp_path):
    """Entries whose source lies outside the package the process imported (another installation's
    bundle, or a path that climbs out with '..') and an entry that is not one are skipped, module by
    module: each loads from its own file."""
    _package(tmp_path, "VALUE = 1\n")
    (tmp_path / "bundled_pkg" / "other.py").write_text("VALUE = 2\n")
    bundle = tmp_path / "cache" / "b.bundle"
    code = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {package_parent()!r}]\n"
            "from vgpuhost.io.modbundle import build\n"
            f"build({str(bundle)!r}, ['bundled_pkg', 'bundled_pkg.mod', 'bundled_pkg.other'])\n")
    subprocess.run([sys.executable, "-I", "-S", "-c", code], check=True, timeout=60)
    fmt, tag, entries = modbundle.unpack(bundle.read_bytes())
    elsewhere = tmp_path / "elsewhere" / "mod.py"
    elsewhere.parent.mkdir()
    elsewhere.write_text("VALUE = 99\n")
    st = elsewhere.stat()
    entries["bundled_pkg.mod"] = (str(elsewhere), st.st_size, st.st_mtime_ns, False,
                                  marshal.dumps(compile("VALUE = 99\n", str(elsewhere), "exec")))
    entries["bundled_pkg.other"] = ("x",)
    climbing = str(tmp_path / "bundled_pkg" / ".." / "elsewhere" / "mod.py")      # the breaker's '..' origin
    entries["bundled_pkg"] = (climbing, st.st_size, st.st_mtime_ns, True, entries["bundled_pkg.mod"][4])
    bundle.write_bytes(modbundle.pack(fmt, tag, entries))
    out = _load(tmp_path, bundle, "import bundled_pkg, bundled_pkg.mod as m, bundled_pkg.other as o\n"
                                  "print(m.VALUE, o.VALUE, *(type(x.__spec__.loader).__name__ "
                                  "for x in (bundled_pkg, m, o)))\n")
    assert out.split() == ["1", "2", "SourceFileLoader", "SourceFileLoader", "SourceFileLoader"]


def test_a_failed_bundle_write_takes_the_old_bundle_away(make_host, tmp_path):
    host = make_host("a40-mdev")
    install(host, tmp_path)
    bundle = modbundle.bundle_path(str(host.root))
    assert os.path.isfile(bundle)
    os.mkdir(os.path.join(os.path.dirname(bundle), ".hook-modules.bundle.vgpuhost-tmp"))   # the write fails
    from vgpuhost.hook.install import install as hook_install
    out = hook_install(host, hooks_dir=tmp_path / "qemu.d")
    assert not os.path.exists(bundle)
    assert any("module bundle" in n for n in out.notes), out.notes


def test_hook_status_reports_the_bundle(make_host, tmp_path, capsys):
    """``hook status`` says whether the bundle is current, missing or not trusted; only speed depends on it,
    so it leaves the exit code alone."""
    import json as _json
    from vgpuhost.cli.main import main as cli_main
    host = make_host("a40-mdev")
    hooks = str(tmp_path / "qemu.d")

    def status():
        capsys.readouterr()
        code = cli_main(["--root", str(host.root), "--json", "hook", "status", "--hooks-dir", hooks])
        return code, _json.loads(capsys.readouterr().out)["bundle"]

    code, b = status()
    assert b["state"] == "missing" and b["modules"] == 0
    install(host, tmp_path)
    code, b = status()
    assert (code, b["state"], b["modules"], b["stale"]) == (0, "current", len(modbundle.MODULES), [])
    assert b["path"] == modbundle.bundle_path(str(host.root))
    os.chmod(b["path"], 0o666)
    code, b = status()
    assert (code, b["state"]) == (0, "untrusted")


def test_check_names_the_stale_modules(tmp_path):
    _package(tmp_path, "VALUE = 1\n")
    bundle = tmp_path / "cache" / "b.bundle"
    _build(tmp_path, bundle)
    code = (f"import sys; sys.path[:0] = [{package_parent()!r}]\n"
            "from vgpuhost.io.modbundle import check\n"
            f"print(check({str(bundle)!r}, {str(tmp_path / 'bundled_pkg')!r}))\n")
    run = lambda: subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, timeout=60,
                                 check=True).stdout.decode().strip()
    assert run() == "{'state': 'current', 'modules': 2, 'stale': [], 'damaged': []}"
    _package(tmp_path, "VALUE = 22  # changed\n")
    assert run() == "{'state': 'stale', 'modules': 2, 'stale': ['bundled_pkg', 'bundled_pkg.mod'], 'damaged': []}"


def _hook_status(host, hooks: str, capsys, *, as_json: bool = True):
    """``vgpuhost --root R [--json] hook status --hooks-dir H``: (exit code, the bundle's document or line)."""
    import json as _json
    from vgpuhost.cli.main import main as cli_main
    capsys.readouterr()
    code = cli_main(["--root", str(host.root), *(["--json"] if as_json else []), "hook", "status",
                     "--hooks-dir", hooks])
    out = capsys.readouterr().out
    if as_json:
        return code, _json.loads(out)["bundle"]
    return code, next(line for line in out.splitlines() if line.startswith("bundle:"))


def _rewrite_index(bundle: str, change) -> None:
    """Rewrite the bundle file's index in place with ``change(index)`` (the owner's tamper), its code kept."""
    data = Path(bundle).read_bytes()
    size = int.from_bytes(data[:4], "little")
    fmt, tag, index = marshal.loads(data[4:4 + size])
    change(index)
    head = marshal.dumps((fmt, tag, index))
    Path(bundle).write_bytes(len(head).to_bytes(4, "little") + head + data[4 + size:])


@pytest.mark.parametrize("damage", ["swapped-offsets", "flipped-bit"])
def test_a_damaged_bundle_never_breaks_the_hook_and_hook_status_says_damaged(make_host, tmp_path, capsys, damage):
    """Trial 6 #1: the index's entries of two modules swapped (each then points at the other's intact code),
    or one bit flipped in a module's code (the tester's ``observe.inventory`` -> ``observe&inventory``: an
    import of a module that does not exist): those modules fail their checksum and load from their files,
    the rest from the bundle; the installed hook makes and removes the vGPU; ``hook status`` says damaged
    and names them; ``hook install`` writes it anew."""
    host = make_host("a40-mdev")
    hook = install(host, tmp_path)
    bundle = modbundle.bundle_path(str(host.root))
    if damage == "swapped-offsets":
        hit = ["vgpuhost.model.gputime", "vgpuhost.policy.iommu"]

        def swap(index):
            a, b = index[hit[0]], index[hit[1]]
            index[hit[0]], index[hit[1]] = a[:4] + b[4:6] + a[6:], b[:4] + a[4:6] + b[6:]
        _rewrite_index(bundle, swap)
    else:
        data = bytearray(Path(bundle).read_bytes())
        size = int.from_bytes(data[:4], "little")
        _, _, index = marshal.loads(bytes(data[4:4 + size]))
        base = 4 + size
        hit = [n for n, e in sorted(index.items(), key=lambda kv: kv[1][4])
               if b"observe.inventory" in data[base + e[4]:base + e[4] + e[5]]][:1]
        assert hit, "no module of the bundle imports observe.inventory by name"
        e = index[hit[0]]
        at = data.index(b"observe.inventory", base + e[4]) + len("observe")
        data[at] ^= 0x08                                                # '.' -> '&'
        Path(bundle).write_bytes(bytes(data))
    # the installed dispatcher, as libvirt runs it: the vGPU appears and goes, nothing on stderr
    xml = vgpu_domain("vm1", DOM1, MDEV1)
    for op, sub in (("prepare", "begin"), ("release", "end")):
        proc = subprocess.run([str(hook), "vm1", op, sub, "-"], input=xml.encode(), capture_output=True,
                              env=HOOK_ENV, timeout=120)
        assert (proc.returncode, proc.stderr) == (0, b""), proc.stderr
        assert (host.mdev_devices / MDEV1).exists() == (op == "prepare")
    # the damaged modules came from their files, every other vgpuhost module from the bundle
    proc = _run_handler(host, bundle, xml)
    assert proc.returncode == 0, proc.stderr
    first, *rows = proc.stdout.decode().splitlines()
    assert first == f"[0, 0] {len(modbundle.MODULES)}"
    loaders = dict(row.split() for row in rows)
    before = {"vgpuhost", "vgpuhost.io", "vgpuhost.io.modbundle"}
    from_files = {n for n, loader in loaders.items() if loader != SERVED}
    assert from_files - before == set(hit) & set(loaders) and set(hit) & set(loaders), (hit, from_files)
    code, b = _hook_status(host, str(hook.parent), capsys)
    assert (code, b["state"], b["damaged"], b["stale"]) == (0, "damaged", sorted(hit), [])
    code, line = _hook_status(host, str(hook.parent), capsys, as_json=False)
    assert f"damaged: the code of {len(hit)} of its {len(modbundle.MODULES)} modules fails its checksum" in line
    assert "'vgpuhost hook install --hooks-dir" in line and "writes it anew" in line
    install(host, tmp_path)                                              # the fix the line gives
    code, b = _hook_status(host, str(hook.parent), capsys)
    assert (b["state"], b["damaged"]) == ("current", [])


def test_hook_install_refuses_a_symlinked_bundle_folder_and_changes_nothing(make_host, tmp_path, capsys):
    """Trial 6 #6: ``<root>/var/cache/vgpuhost`` a symlink to a shared folder (mode 1777): ``hook install``
    refuses in one line naming the link and its fix (exit 2, an audit row), writes neither the hook nor the
    bundle, and leaves the link's target and its mode alone; ``hook status`` names the link as the reason."""
    from vgpuhost.cli.main import main as cli_main
    from vgpuhost.io.state import StateStore
    host = make_host("a40-mdev")
    bundle = modbundle.bundle_path(str(host.root))
    folder = os.path.dirname(bundle)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    if os.path.isdir(folder):
        os.rmdir(folder)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    os.symlink(shared, folder)
    hooks = tmp_path / "qemu.d"
    capsys.readouterr()
    code = cli_main(["--root", str(host.root), "hook", "install", "--hooks-dir", str(hooks)])
    out = capsys.readouterr()
    assert code == 2
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{folder}, the folder of the hook's module bundle, is a symbolic link" in lines[0]
    assert f"remove the link (rm {folder})" in lines[0]
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and list(shared.iterdir()) == []
    assert not (hooks / "vgpuhost").exists() and os.path.islink(folder)
    rows = [r for r in StateStore(host.state_dir).audit_rows() if r.operation == "hook install"]
    assert [(r.path, r.result) for r in rows] == [(host.relative(folder), "refused")]
    # the module's own door refuses too (the Debian postinst calls it), changing nothing
    with pytest.raises(OSError) as e:
        modbundle.build(bundle)
    assert e.value.errno == 40 and "symbolic link" in str(e.value)                  # ELOOP
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and list(shared.iterdir()) == []
    # hook status: the real reason and the fix that works
    code, b = _hook_status(host, str(hooks), capsys)
    assert (b["state"], b["modules"]) == ("folder-symlink", 0)
    code, line = _hook_status(host, str(hooks), capsys, as_json=False)
    assert f"its folder {folder} is a symbolic link" in line and f"remove the link (rm {folder})" in line
    os.unlink(folder)                                                    # the fix: then install works
    assert cli_main(["--root", str(host.root), "hook", "install", "--hooks-dir", str(hooks)]) == 0
    assert _hook_status(host, str(hooks), capsys)[1]["state"] == "current"
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and list(shared.iterdir()) == []


@pytest.mark.parametrize("kind", ["format-1", "format-2", "other-python", "cut"])
def test_hook_status_names_why_a_bundle_cannot_be_read(make_host, tmp_path, capsys, kind):
    """Trial 6 #8: an older vgpuhost's bundle (format 1: one marshal of the whole file; format 2: no
    checksums) is named as such, not "not a bundle for this Python"; the fix line stays."""
    host = make_host("a40-mdev")
    hook = install(host, tmp_path)
    bundle = modbundle.bundle_path(str(host.root))
    data = Path(bundle).read_bytes()
    fmt, tag, entries = modbundle.unpack(data)
    if kind == "format-1":
        Path(bundle).write_bytes(marshal.dumps(("vgpuhost-hook-bundle/1", tag, entries)))
    elif kind == "format-2":
        _rewrite_index(bundle, lambda index: index.update({n: e[:6] for n, e in index.items()}))
        text = Path(bundle).read_bytes()
        size = int.from_bytes(text[:4], "little")
        head = marshal.dumps(("vgpuhost-hook-bundle/2",) + marshal.loads(text[4:4 + size])[1:])
        Path(bundle).write_bytes(len(head).to_bytes(4, "little") + head + text[4 + size:])
    elif kind == "other-python":
        Path(bundle).write_bytes(modbundle.pack(fmt, "cpython-10", entries))
    else:
        Path(bundle).write_bytes(data[:-1])
    state, why = {"format-1": ("old-format", "an older vgpuhost's bundle format"),
                  "format-2": ("old-format", "an older vgpuhost's bundle format"),
                  "other-python": ("other-python", "a bundle for another Python"),
                  "cut": ("unreadable", "cut short, grown or not a bundle")}[kind]
    code, b = _hook_status(host, str(hook.parent), capsys)
    assert (code, b["state"], b["modules"]) == (0, state, 0)
    code, line = _hook_status(host, str(hook.parent), capsys, as_json=False)
    assert f"not used, {why} (the hook loads its modules from their files" in line
    assert "for this Python" not in line or kind == "other-python"
    assert "'vgpuhost hook install --hooks-dir" in line and "writes it anew" in line
