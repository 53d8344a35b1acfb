"""The Debian package (`make deb`): built with dpkg-buildpackage and dh-python, installed into a
throwaway root made of Debian's own packages, then run from inside it.

The root is a simulated host first (``vgpuhost sim create a40-mdev ROOT``); Debian's python3,
python3-click, python3-jinja2, python3-yaml, python3-lxml, dash and coreutils, with the packages
they depend on, are then unpacked into it (``apt-get download`` + ``dpkg -x``), and the built
``.deb`` on top. python3-libvirt and nvidia-ml-py are left out on purpose: the read commands and
the qemu hook must work without them. Inside ``chroot ROOT``:

- ``vgpuhost --root /srv/host host check`` on a second simulated host, ``gpus`` and ``types``;
- ``vgpuhost hook status``: the hook the package installs (``/etc/libvirt/hooks/qemu.d/vgpuhost``
  -> ``/usr/lib/vgpuhost/qemu-hook``) is vgpuhost's and current;
- that hook, run as libvirt runs it (argv, the domain XML on stdin, libvirt's minimal
  environment), for ``prepare begin`` then ``release end`` of a domain with an A40-8Q vGPU: the
  mdev appears in the root's simulated sysfs, then goes, and the audit log has both.

Needs root (chroot), dpkg-buildpackage with debhelper and dh-python, and apt with its lists
(``make dev`` installs the packages). The downloaded packages are cached in build/deb-cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nsutil import skip_or_fail

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "build" / "deb-cache"
BIN = Path(sys.executable).parent
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# What the root gets from Debian: the package's dependencies less python3-libvirt, plus a shell
# (adduser: the postinst's addgroup).
DEBIAN_PACKAGES = ["python3", "python3-click", "python3-jinja2", "python3-yaml", "python3-lxml",
                   "dash", "coreutils", "libc-bin", "adduser"]
DOMAIN_UUID = "6f1b1d4e-0000-4000-8000-00000000d0e6"
MDEV = "2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a"


def _need():
    missing = [tool for tool in ("dpkg-buildpackage", "dh_python3", "apt-get", "apt-cache", "dpkg", "chroot")
               if not shutil.which(tool, path=SYSTEM_PATH)]
    if missing:
        return f"{', '.join(missing)} not found (make dev installs the Debian build packages)"
    if os.geteuid() != 0:
        return "needs root (chroot)"
    if not Path("/usr/share/perl5/Debian/Debhelper/Buildsystem/pybuild.pm").exists() and \
            not Path("/usr/share/dh-python/dhpython/build/plugin_pyproject.py").exists():
        return "pybuild-plugin-pyproject is not installed (make dev installs it)"
    return None


def _run(args, *, cwd=None, env=None, input=None, check=True, timeout=600):
    proc = subprocess.run(args, cwd=cwd, env=env, input=input, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, (f"{args!r} failed ({proc.returncode})\n--- stdout\n{proc.stdout}"
                                      f"\n--- stderr\n{proc.stderr}")
    return proc


def _system_env():
    return {"PATH": SYSTEM_PATH, "LC_ALL": "C.UTF-8", "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive"}


def _build_deb(tmp_path) -> Path:
    """`make deb`'s steps, in a copy of the tree under tmp_path."""
    src = tmp_path / "src" / "vgpuhost"
    src.mkdir(parents=True)
    excludes = ["--exclude=./.git", "--exclude=./.venv", "--exclude=./build", "--exclude=./dist",
                "--exclude=./site", "--exclude=./demo-host", "--exclude=__pycache__", "--exclude=*.egg-info",
                "--exclude=./ansible/.ansible"]
    pack = subprocess.Popen(["tar", *excludes, "-cf", "-", "."], cwd=REPO, stdout=subprocess.PIPE)
    unpack = subprocess.run(["tar", "-C", str(src), "-xf", "-"], stdin=pack.stdout, capture_output=True)
    pack.wait()
    assert pack.returncode == 0 and unpack.returncode == 0, unpack.stderr
    _run(["dpkg-buildpackage", "-us", "-uc", "-b"], cwd=src, env=_system_env(), timeout=900)
    debs = sorted((tmp_path / "src").glob("vgpuhost_*_all.deb"))
    assert len(debs) == 1, debs
    return debs[0]


def _closure() -> list:
    """DEBIAN_PACKAGES and everything they depend on (no recommends), as apt would install them."""
    out = _run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                "--no-breaks", "--no-replaces", "--no-enhances", *DEBIAN_PACKAGES], env=_system_env()).stdout
    names = set()
    for line in out.splitlines():
        name = line.strip()
        if line.startswith(" "):
            m = re.match(r"\|?(?:Pre)?Depends: ([^<>\s]+)$", name)
            if not m:
                continue
            name = m.group(1)
        if re.fullmatch(r"[a-z0-9][a-z0-9+.-]+(:\w+)?", name):
            names.add(name.split(":")[0])
    names -= {"python3-libvirt", "debconf-2.0", "usrmerge", "usr-is-merged", "base-files"}
    return sorted(names)


def _download(names) -> list:
    CACHE.mkdir(parents=True, exist_ok=True)
    have = {p.name.split("_")[0] for p in CACHE.glob("*.deb")}
    want = [n for n in names if n not in have]
    if want:
        proc = _run(["apt-get", "download", *want], cwd=CACHE, env=_system_env(), check=False, timeout=900)
        if proc.returncode != 0:        # no package lists yet on a fresh machine
            _run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "update"], env=_system_env(), timeout=900)
            _run(["apt-get", "download", *want], cwd=CACHE, env=_system_env(), timeout=900)
    debs = {}
    for p in sorted(CACHE.glob("*.deb")):
        debs.setdefault(p.name.split("_")[0], p)
    missing = [n for n in names if n not in debs]
    assert not missing, f"apt-get download did not fetch {missing}"
    return [debs[n] for n in names]


def _vgpuhost(*args) -> str:
    return _run([str(BIN / "vgpuhost"), *args]).stdout


def _domain_xml() -> str:
    return (f"<domain type='kvm' id='7'>\n  <name>deb-vm</name>\n  <uuid>{DOMAIN_UUID}</uuid>\n"
            "  <metadata>\n"
            '<vgpuhost:domain xmlns:vgpuhost="https://vgpuhost.dev/xmlns/domain/1" version="1">'
            f'<vgpuhost:vgpu profile="A40-8Q" uuid="{MDEV}"/></vgpuhost:domain>\n'
            "  </metadata>\n  <memory unit='KiB'>65536</memory>\n"
            "  <os><type arch='x86_64' machine='pc'>hvm</type></os>\n  <devices>\n"
            f"    <hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'><source>"
            f"<address uuid='{MDEV}'/></source></hostdev>\n  </devices>\n</domain>\n")


def test_deb_installs_into_a_debian_root_and_runs(tmp_path):
    skip_or_fail(_need(), "the Debian package test")
    deb = _build_deb(tmp_path)
    info = _run(["dpkg-deb", "-f", str(deb), "Depends"]).stdout
    for dep in ("python3-libvirt", "python3-click", "python3-jinja2", "python3-lxml", "python3-yaml"):
        assert dep in info, info
    assert "nvidia-ml-py" not in info and "python3-pynvml" not in info
    files = _run(["dpkg-deb", "-c", str(deb)]).stdout
    for shipped in ("./usr/bin/vgpuhost", "./usr/lib/vgpuhost/qemu-hook",
                    "./usr/lib/systemd/system/vgpuhost-layout.service",
                    "./usr/lib/systemd/system/vgpuhost-reconcile.service",
                    "./usr/lib/systemd/system/vgpuhost-agent.socket",
                    "./usr/lib/systemd/system/vgpuhost-agent-ro.socket",
                    "./usr/lib/systemd/system/vgpuhost-agent.service",
                    "./usr/lib/systemd/system/vgpuhost-exporter.service",
                    "./usr/lib/tmpfiles.d/vgpuhost.conf", "./usr/share/man/man1/vgpuhost.1.gz",
                    "./usr/share/bash-completion/completions/vgpuhost",
                    "./usr/share/zsh/vendor-completions/_vgpuhost",
                    "./usr/share/fish/vendor_completions.d/vgpuhost.fish",
                    "./etc/libvirt/hooks/qemu.d/vgpuhost -> /usr/lib/vgpuhost/qemu-hook"):
        assert shipped in files, f"{shipped} not in the package:\n{files}"

    # the root: a simulated host, then Debian's packages, then vgpuhost's
    root = tmp_path / "root"
    _vgpuhost("sim", "create", "a40-mdev", str(root))
    for pkg in _download(_closure()) + [deb]:
        _run(["dpkg", "-x", str(pkg), str(root)], env=_system_env())
    _vgpuhost("sim", "create", "turing-consumer", str(root / "srv" / "host"))
    (root / "tmp").mkdir(exist_ok=True)

    def inside(*argv, input=None, env=None, check=True):
        return _run(["chroot", str(root), *argv], env=env or {"PATH": SYSTEM_PATH, "LC_ALL": "C", "HOME": "/"},
                    input=input, check=check)

    inside("/sbin/ldconfig")
    # the postinst (as dpkg runs it at configure, twice: an upgrade) makes the sockets' groups once
    control = tmp_path / "control"
    _run(["dpkg-deb", "-e", str(deb), str(control)])
    assert (control / "postinst").stat().st_mode & 0o111, "the postinst is not executable"
    for name, text in (("passwd", "root:x:0:0:root:/root:/bin/sh\n"), ("group", "root:x:0:\n"),
                       ("shadow", "root:*:19000:0:99999:7:::\n"), ("gshadow", "root:*::\n")):
        if not (root / "etc" / name).exists():
            (root / "etc" / name).write_text(text)
    (root / "run").mkdir(exist_ok=True)             # adduser's lock file
    # debhelper's own sections (py3compile needs the package registered with dpkg, which dpkg -x skips)
    ours = re.sub(r"# Automatically added by .*?# End automatically added section\n", "",
                  (control / "postinst").read_text(), flags=re.S)
    assert "addgroup --system" in ours and "getent group" in ours, ours
    (root / "tmp" / "postinst").write_text(ours)
    sockets = [(root / "usr" / "lib" / "systemd" / "system" / u).read_text()
               for u in ("vgpuhost-agent.socket", "vgpuhost-agent-ro.socket")]
    wanted = sorted(re.search(r"^SocketGroup=(\S+)$", t, re.M).group(1) for t in sockets)
    assert wanted == ["vgpuhost", "vgpuhost-ro"], wanted
    for _ in range(2):
        done = inside("/bin/sh", "/tmp/postinst", "configure", "", check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        groups = {line.split(":")[0]: int(line.split(":")[2])
                  for line in (root / "etc" / "group").read_text().splitlines() if line}
        for g in wanted:
            assert 0 < groups.get(g, 0) < 1000, (g, groups)          # a system group
        assert len((root / "etc" / "group").read_text().splitlines()) == len(groups)
    # ... and the qemu hook's module bundle, for the installed files (the packaged hook uses it)
    bundle = root / "var" / "cache" / "vgpuhost" / "hook-modules.bundle"
    assert bundle.is_file() and bundle.stat().st_mode & 0o777 == 0o644, sorted(os.listdir(root / "var" / "cache"))
    assert "hook-modules.bundle" in (root / "usr" / "lib" / "vgpuhost" / "qemu-hook").read_text()
    # the heavy imports are really absent
    probe = inside("/usr/bin/python3", "-c", "import importlib.util as u; print([m for m in ('libvirt', 'pynvml') "
                                             "if u.find_spec(m)])").stdout
    assert probe.strip() == "[]", probe
    # the installed command, from Debian's Python: a simulated host's readiness, its GPUs and types
    check = inside("/usr/bin/vgpuhost", "--root", "/srv/host", "host", "check", check=False)
    assert check.returncode in (0, 1), check.stderr
    # one GeForce whose passthrough is blocked, no vGPU, no MIG: not ready (issue 12 #4i), and says why
    assert check.returncode == 1 and "BOOT_VGA" in check.stdout, check.stdout
    assert "host is NOT ready: 0000:01:00.0 can serve no mode now" in check.stdout, check.stdout
    doc = json.loads(inside("/usr/bin/vgpuhost", "--root", "/srv/host", "--json", "gpus").stdout)
    assert [g["address"] for g in doc["gpus"]] == ["0000:01:00.0"], doc
    types = json.loads(inside("/usr/bin/vgpuhost", "--json", "types").stdout)
    assert "A40-8Q" in {t["name"] for t in types["types"]}
    assert "vgpuhost" in inside("/usr/bin/vgpuhost", "--version").stdout
    import vgpuhost
    assert vgpuhost.__version__ in inside("/usr/bin/vgpuhost", "--version").stdout

    # the packaged hook: vgpuhost's, current, pointing at the installed package (not a checkout)
    status = json.loads(inside("/usr/bin/vgpuhost", "--json", "hook", "status", check=False).stdout)
    assert status["installed"] and status["written_by_vgpuhost"] and status["current"], status
    installed = json.loads(inside("/usr/bin/vgpuhost", "--json", "hook", "install").stdout)
    assert installed["changed"] is False, installed             # the package's hook is left as it is
    assert (root / "etc" / "libvirt" / "hooks" / "qemu.d" / "vgpuhost").is_symlink()
    hook_text = (root / "usr" / "lib" / "vgpuhost" / "qemu-hook").read_text()
    assert "/usr/lib/python3/dist-packages" in hook_text and str(REPO) not in hook_text
    assert str(tmp_path) not in hook_text

    # ... run as libvirt runs it: prepare begin makes the mdev, release end removes it
    libvirt_env = {"PATH": SYSTEM_PATH, "HOME": "/", "LC_ALL": "C"}
    hook = "/etc/libvirt/hooks/qemu.d/vgpuhost"
    mdev = root / "sys" / "bus" / "mdev" / "devices" / MDEV
    done = inside(hook, "deb-vm", "prepare", "begin", "-", input=_domain_xml(), env=libvirt_env, check=False)
    assert done.returncode == 0, done.stderr
    assert mdev.exists(), "prepare begin made no mdev"
    done = inside(hook, "deb-vm", "release", "end", "-", input=_domain_xml(), env=libvirt_env, check=False)
    assert done.returncode == 0, done.stderr
    assert not mdev.exists(), "release end left the mdev"
    audit = json.loads(inside("/usr/bin/vgpuhost", "--json", "audit").stdout)
    ops = [r["operation"] for r in audit["rows"] if r["actor"].startswith("hook deb-vm")]
    assert any(o.startswith("vgpu create A40-8Q") for o in ops) and any(o.startswith("vgpu remove") for o in ops), ops
    # a domain without vgpuhost's metadata: the sh dispatcher exits 0 before Python starts
    plain = _domain_xml().replace("https://vgpuhost.dev/xmlns/domain/1", "urn:other")
    assert inside(hook, "other-vm", "prepare", "begin", "-", input=plain, env=libvirt_env).returncode == 0
