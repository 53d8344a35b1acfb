"""The Debian package (`make deb`): built with dpkg-buildpackage and dh-python, checked with lintian,
then installed, upgraded, removed and purged by dpkg in a throwaway root made of Debian's own packages.

The root is a simulated host first (``vgpuhost sim create a40-mdev ROOT``); Debian's python3,
python3-click, python3-jinja2, python3-yaml, python3-lxml, dash, coreutils, dpkg, perl-base and
init-system-helpers, with the packages they depend on, are then unpacked into it (``apt-get download``
+ ``dpkg -x``). python3-libvirt and nvidia-ml-py are left out on purpose: the read commands and the
qemu hook must work without them. ``/run/systemd/system`` exists in the root and its ``systemctl`` is a
stand-in that records each call, so the maintainer scripts' systemd steps run (``deb-systemd-invoke``,
``deb-systemd-helper``) and can be read back; nothing touches this machine's systemd, libvirt or /etc.

``dpkg --root ROOT`` (maintainer scripts chrooted into ROOT) then:

- installs the previous build (this build repacked at a lower version, with the
  ``/etc/libvirt/hooks/qemu.d/vgpuhost`` link the packages before the opt-in hook shipped);
- upgrades to this build: the agent and the exporter are try-restarted, the sockets and boot units
  are not; the hook the old package linked stays linked, now the operator's;
- runs the read commands, the autopkgtest (debian/tests/sim-and-hook) and the linked hook as libvirt
  runs it, from inside the root;
- removes it: every unit is stopped and no hook is left linked; purges it: the state directory and
  deb-systemd-helper's records go.

A fresh install (no older package) links no hook and says how to enable it.

Needs root (chroot), dpkg-buildpackage with debhelper and dh-python, lintian, and apt with its lists
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

import vgpuhost

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "build" / "deb-cache"
BIN = Path(sys.executable).parent
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# What the root gets from Debian: the package's dependencies less python3-libvirt, plus a shell
# (adduser: the postinst's addgroup).
DEBIAN_PACKAGES = ["python3", "python3-click", "python3-jinja2", "python3-yaml", "python3-lxml",
                   "dash", "coreutils", "libc-bin", "adduser", "dpkg", "perl-base", "init-system-helpers",
                   "grep", "sed", "findutils", "diffutils", "tar"]
DOMAIN_UUID = "6f1b1d4e-0000-4000-8000-00000000d0e6"
MDEV = "2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a"


def _need():
    missing = [tool for tool in ("dpkg-buildpackage", "dh_python3", "apt-get", "apt-cache", "dpkg", "chroot",
                                 "lintian")
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
                "--exclude=./ansible/.ansible", "--exclude=./vgpuhost/hook/vgpuhost-hook-client",
                # written by the suite's other workers while this copy is made (tar: "file changed")
                "--exclude=./.hypothesis", "--exclude=./.pytest_cache"]
    pack = subprocess.Popen(["tar", *excludes, "-cf", "-", "."], cwd=REPO, stdout=subprocess.PIPE)
    unpack = subprocess.run(["tar", "-C", str(src), "-xf", "-"], stdin=pack.stdout, capture_output=True)
    pack.wait()
    assert pack.returncode == 0 and unpack.returncode == 0, unpack.stderr
    _run(["dpkg-buildpackage", "-us", "-uc"], cwd=src, env=_system_env(), timeout=900)
    debs = sorted((tmp_path / "src").glob("vgpuhost_*_all.deb"))
    assert len(debs) == 1, debs
    return debs[0]


def _repack(deb: Path, out: Path, version: str, *, link_hook: bool) -> Path:
    """``deb`` as another version (the previous build), with the hook link older packages shipped."""
    tree = out.parent / f"repack-{version}"
    _run(["dpkg-deb", "-R", str(deb), str(tree)])
    control = tree / "DEBIAN" / "control"
    control.write_text(re.sub(r"^Version: .*$", f"Version: {version}", control.read_text(), flags=re.M))
    if link_hook:
        link = tree / "etc" / "libvirt" / "hooks" / "qemu.d" / "vgpuhost"
        link.parent.mkdir(parents=True)
        link.symlink_to("/usr/lib/vgpuhost/qemu-hook")
    _run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(out)])
    return out


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




SYSTEMCTL = """#!/bin/sh
# stand-in for systemctl: records each call; nothing is enabled, everything is active
echo "$*" >> /var/log/systemctl.calls
case "$1" in
    is-enabled) echo disabled; exit 1 ;;
    --version) echo "systemd 252 (252)"; exit 0 ;;
esac
exit 0
"""


def _make_root(tmp_path) -> Path:
    """A simulated host with Debian's packages unpacked in it, a dpkg database and a recording systemctl."""
    root = tmp_path / "root"
    _vgpuhost("sim", "create", "a40-mdev", str(root))
    for pkg in _download(_closure()):
        _run(["dpkg", "-x", str(pkg), str(root)], env=_system_env())
    for name, text in (("passwd", "root:x:0:0:root:/root:/bin/sh\n"), ("group", "root:x:0:\n"),
                       ("shadow", "root:*:19000:0:99999:7:::\n"), ("gshadow", "root:*::\n")):
        if not (root / "etc" / name).exists():
            (root / "etc" / name).write_text(text)
    admin = root / "var" / "lib" / "dpkg"
    for d in ("info", "updates", "triggers"):
        (admin / d).mkdir(parents=True, exist_ok=True)
    for f in ("status", "available"):
        (admin / f).touch()
    for d in ("tmp", "run/systemd/system", "var/log", "etc/libvirt/hooks/qemu.d"):
        (root / d).mkdir(parents=True, exist_ok=True)
    stand_in = root / "usr" / "local" / "bin" / "systemctl"      # before /usr/bin and /bin in dpkg's PATH
    stand_in.parent.mkdir(parents=True, exist_ok=True)
    stand_in.write_text(SYSTEMCTL)
    stand_in.chmod(0o755)
    _run(["chroot", str(root), "/sbin/ldconfig"], env=_system_env())
    return root


def _dpkg(root: Path, *args, check=True):
    """dpkg on the throwaway root (maintainer scripts run chrooted into it); dependencies are unpacked,
    not registered, hence --force-depends."""
    env = dict(_system_env(), PATH="/usr/local/sbin:/usr/local/bin:" + SYSTEM_PATH)
    return _run(["dpkg", f"--root={root}", "--force-depends", "--force-unsafe-io", *args], env=env, check=check)


def _calls(root: Path) -> list:
    """The stand-in systemctl's calls since the last look (and forget them)."""
    log = root / "var" / "log" / "systemctl.calls"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def test_deb_is_lintian_clean_and_installs_upgrades_removes_and_purges(tmp_path):
    skip_or_fail(_need(), "the Debian package test")
    deb = _build_deb(tmp_path)
    sim_deb = next((tmp_path / "src").glob("vgpuhost-sim_*_all.deb"))
    info = _run(["dpkg-deb", "-f", str(deb), "Depends"]).stdout
    for dep in ("python3-libvirt", "python3-click (>= 8.0)", "python3-jinja2 (>= 3.0)", "python3-lxml (>= 4.6)",
                "python3-yaml (>= 5.4)", "python3-prometheus-client (>= 0.16)"):
        assert dep in info, info
    assert "nvidia-ml-py" not in info and "python3-pynvml" not in info and "coreutils" not in info, info
    files = _run(["dpkg-deb", "-c", str(deb)]).stdout
    for shipped in ("./usr/bin/vgpuhost", "./usr/lib/vgpuhost/qemu-hook",
                    "./lib/systemd/system/vgpuhost-layout.service",
                    "./lib/systemd/system/vgpuhost-reconcile.service",
                    "./lib/systemd/system/vgpuhost-agent.socket",
                    "./lib/systemd/system/vgpuhost-agent-ro.socket",
                    "./lib/systemd/system/vgpuhost-agent.service",
                    "./lib/systemd/system/vgpuhost-exporter.service",
                    "./usr/lib/tmpfiles.d/vgpuhost.conf", "./usr/share/man/man8/vgpuhost.8.gz",
                    "./usr/share/bash-completion/completions/vgpuhost",
                    "./usr/share/zsh/vendor-completions/_vgpuhost",
                    "./usr/share/fish/vendor_completions.d/vgpuhost.fish",
                    "./usr/share/doc/vgpuhost/README.Debian", "./usr/share/doc/vgpuhost/examples/vgpu-a40.yaml",
                    "./usr/share/vgpuhost/prometheus/vgpuhost-rules.yml",
                    "./usr/share/vgpuhost/grafana/vgpuhost-dashboard.json", "./usr/share/vgpuhost/openapi.yaml"):
        assert shipped in files, f"{shipped} not in the package:\n{files}"
    assert "etc/libvirt/hooks" not in files and "usr/lib/systemd/system" not in files and "man1" not in files
    # the simulator and the demo are vgpuhost-sim's, which needs this very vgpuhost and takes their files over
    assert "/vgpuhost/sim/" not in files and "/vgpuhost/demo.py" not in files, files
    sim_files = _run(["dpkg-deb", "-c", str(sim_deb)]).stdout
    assert "/dist-packages/vgpuhost/sim/kernel.py" in sim_files and "/dist-packages/vgpuhost/demo.py" in sim_files
    assert "/vgpuhost/cli/" not in sim_files and "/usr/bin/" not in sim_files, sim_files
    sim_info = _run(["dpkg-deb", "-f", str(sim_deb), "Depends", "Breaks", "Replaces"]).stdout
    assert f"vgpuhost (= {vgpuhost.__version__})" in sim_info and sim_info.count("vgpuhost (<< 0.2.0)") == 2, sim_info

    # lintian at --pedantic, on the source package and the .debs: nothing but overridden tags, each with its
    # reason in debian/*.lintian-overrides
    changes = sorted((tmp_path / "src").glob("vgpuhost_*.changes"))
    assert len(changes) == 1, changes
    lint = _run(["lintian", "--pedantic", "--fail-on", "error,warning,info,pedantic", str(changes[0])],
                env=_system_env(), check=False)
    tags = [line for line in lint.stdout.splitlines() if re.match(r"[EWIPX]: ", line)]
    assert lint.returncode == 0 and tags == [], lint.stdout + lint.stderr
    source = next((tmp_path / "src").glob("vgpuhost_*.tar.xz"))      # the checkout's built client stays out
    assert "/vgpuhost/hook/vgpuhost-hook-client\n" not in _run(["tar", "-tJf", str(source)]).stdout

    root = _make_root(tmp_path)
    old = _repack(deb, tmp_path / "vgpuhost_0.0.9_all.deb", "0.0.9", link_hook=True)
    hook = root / "etc" / "libvirt" / "hooks" / "qemu.d" / "vgpuhost"

    def inside(*argv, input=None, env=None, check=True):
        return _run(["chroot", str(root), *argv], env=env or {"PATH": SYSTEM_PATH, "LC_ALL": "C", "HOME": "/"},
                    input=input, check=check)

    # the previous build: installed, configured (groups made once), nothing started or enabled
    _dpkg(root, "-i", str(old))
    assert hook.is_symlink() and os.readlink(hook) == "/usr/lib/vgpuhost/qemu-hook"
    groups = {line.split(":")[0]: int(line.split(":")[2])
              for line in (root / "etc" / "group").read_text().splitlines() if line}
    for g in ("vgpuhost", "vgpuhost-ro"):
        assert 0 < groups.get(g, 0) < 1000, (g, groups)          # system groups
    calls = _calls(root)
    assert not [c for c in calls if c.split()[:1] in (["start"], ["restart"], ["try-restart"], ["enable"])], calls
    states = root / "var" / "lib" / "systemd" / "deb-systemd-helper-enabled"
    assert (states / "vgpuhost-agent.service.dsh-also").is_file(), sorted(os.listdir(root / "var" / "lib" / "systemd"))

    # the upgrade, with the simulator unpacked first as apt may order it (apt passes --auto-deconfigure for
    # Breaks): it takes over the old vgpuhost's simulator files (Replaces); the agent and the exporter are
    # try-restarted (they run the new code), nothing else is
    up = _dpkg(root, "--auto-deconfigure", "-i", str(sim_deb), str(deb))
    owner = _dpkg(root, "-S", "/usr/lib/python3/dist-packages/vgpuhost/sim/kernel.py").stdout
    assert owner.startswith("vgpuhost-sim: "), owner
    calls = _calls(root)
    assert "try-restart vgpuhost-agent.service vgpuhost-exporter.service" in calls, calls
    assert not [c for c in calls if "socket" in c or "layout" in c or "reconcile" in c], calls
    assert not [c for c in calls if c.split()[:1] in (["stop"], ["start"], ["enable"])], calls
    # the hook the old package linked is still linked (the preinst's note, the postinst's link), now no package's
    assert hook.is_symlink() and os.readlink(hook) == "/usr/lib/vgpuhost/qemu-hook", up.stdout
    owner = _dpkg(root, "-S", "/etc/libvirt/hooks/qemu.d/vgpuhost", check=False)
    assert owner.returncode != 0, owner.stdout
    assert "not enabled" not in up.stdout
    assert not (root / "var" / "lib" / "vgpuhost" / ".hook-linked-by-package").exists()
    status = _dpkg(root, "-s", "vgpuhost").stdout
    assert "Status: install ok installed" in status and f"Version: {vgpuhost.__version__}" in status, status
    # the postinst's step: the qemu hook's module bundle, for the installed files (the packaged hook uses it)
    bundle = root / "var" / "cache" / "vgpuhost" / "hook-modules.bundle"
    assert bundle.is_file() and bundle.stat().st_mode & 0o777 == 0o644, up.stdout + up.stderr
    assert "hook-modules.bundle" in (root / "usr" / "lib" / "vgpuhost" / "qemu-hook").read_text()

    # the installed command, from Debian's Python: the heavy imports are really absent
    probe = inside("/usr/bin/python3", "-c", "import importlib.util as u; print([m for m in ('libvirt', 'pynvml') "
                                             "if u.find_spec(m)])").stdout
    assert probe.strip() == "[]", probe
    assert vgpuhost.__version__ in inside("/usr/bin/vgpuhost", "--version").stdout
    _vgpuhost("sim", "create", "turing-consumer", str(root / "srv" / "host"))
    check = inside("/usr/bin/vgpuhost", "--root", "/srv/host", "host", "check", check=False)
    # one GeForce whose passthrough is blocked, no vGPU, no MIG: not ready (issue 12 #4i), and says why
    assert check.returncode == 1 and "BOOT_VGA" in check.stdout, check.stdout + check.stderr
    doc = json.loads(inside("/usr/bin/vgpuhost", "--root", "/srv/host", "--json", "gpus").stdout)
    assert [g["address"] for g in doc["gpus"]] == ["0000:01:00.0"], doc
    # the packaged man page is section 8
    assert (root / "usr" / "share" / "man" / "man8" / "vgpuhost.8.gz").is_file()
    # the autopkgtest, as autopkgtest runs it on an installed system
    shutil.copy(REPO / "debian" / "tests" / "sim-and-hook", root / "tmp" / "sim-and-hook")
    (root / "tmp" / "apt").mkdir()
    done = inside("/bin/sh", "/tmp/sim-and-hook", env={"PATH": SYSTEM_PATH, "LC_ALL": "C", "HOME": "/",
                                                        "AUTOPKGTEST_TMP": "/tmp/apt"}, check=False)
    assert done.returncode == 0 and "ok: simulator, read commands and the qemu hook" in done.stdout, \
        done.stdout + done.stderr

    # the linked hook (current: the packaged one), run as libvirt runs it on the root, a simulated host
    status_doc = json.loads(inside("/usr/bin/vgpuhost", "--json", "hook", "status", check=False).stdout)
    assert status_doc["installed"] and status_doc["current"], status_doc
    libvirt_env = {"PATH": SYSTEM_PATH, "HOME": "/", "LC_ALL": "C"}
    mdev = root / "sys" / "bus" / "mdev" / "devices" / MDEV
    hook_path = "/etc/libvirt/hooks/qemu.d/vgpuhost"
    done = inside(hook_path, "deb-vm", "prepare", "begin", "-", input=_domain_xml(), env=libvirt_env, check=False)
    assert done.returncode == 0 and mdev.exists(), done.stderr
    done = inside(hook_path, "deb-vm", "release", "end", "-", input=_domain_xml(), env=libvirt_env, check=False)
    assert done.returncode == 0 and not mdev.exists(), done.stderr
    audit = json.loads(inside("/usr/bin/vgpuhost", "--json", "audit").stdout)
    ops = [r["operation"] for r in audit["rows"] if r["actor"].startswith("hook deb-vm")]
    assert any(o.startswith("vgpu create A40-8Q") for o in ops) and any(o.startswith("vgpu remove") for o in ops), ops
    _calls(root)

    # without the simulator, what needs it names its package, and every other command is still there
    _dpkg(root, "--remove", "vgpuhost-sim")
    assert not (root / "usr" / "lib" / "python3" / "dist-packages" / "vgpuhost" / "sim").exists()
    no_sim = inside("/usr/bin/vgpuhost", "sim", "specs", check=False)
    assert no_sim.returncode == 2 and "apt install vgpuhost-sim" in no_sim.stderr, no_sim.stdout + no_sim.stderr
    mdevs = sorted(os.listdir(root / "sys" / "bus" / "mdev" / "devices"))
    no_sim = inside("/usr/bin/vgpuhost", "--local", "vgpu", "create", "--gpu", "0000:81:00.0", "--profile", "A40-8Q",
                    check=False)            # this root is a simulated host: its kernel is the simulator's
    assert no_sim.returncode == 2 and "simulator is not installed" in no_sim.stderr, no_sim.stdout + no_sim.stderr
    assert sorted(os.listdir(root / "sys" / "bus" / "mdev" / "devices")) == mdevs
    assert inside("/usr/bin/vgpuhost", "--root", "/srv/host", "--json", "gpus").returncode == 0

    # remove: every unit stopped, the hook taken out (it would fail without the package)
    gone = _dpkg(root, "--remove", "vgpuhost")
    calls = _calls(root)
    stops = [c for c in calls if c.startswith("stop ")]
    assert len(stops) == 1 and set(stops[0].split()[1:]) == {
        "vgpuhost-agent.service", "vgpuhost-exporter.service", "vgpuhost-agent.socket", "vgpuhost-agent-ro.socket",
        "vgpuhost-layout.service", "vgpuhost-reconcile.service"}, calls
    assert not hook.exists() and not hook.is_symlink(), sorted(os.listdir(hook.parent))
    assert "removed libvirt's qemu hook" in gone.stdout and "reload libvirtd" in gone.stdout, gone.stdout
    assert not (root / "usr" / "bin" / "vgpuhost").exists()
    assert not (root / "lib" / "systemd" / "system" / "vgpuhost-agent.service").exists()
    assert (root / "var" / "lib" / "vgpuhost" / "state.db").exists()          # kept until purge
    assert not bundle.exists()                                                  # a cache of the package's files
    # purge: the state directory and deb-systemd-helper's records of the units go
    _dpkg(root, "--purge", "vgpuhost")
    assert not (root / "var" / "lib" / "vgpuhost").exists()
    assert sorted(p.name for p in states.glob("vgpuhost*")) == []
    status = _dpkg(root, "-s", "vgpuhost", check=False)
    assert status.returncode == 1 and "not installed" in status.stderr, status.stdout + status.stderr

    # a fresh install (no older package): no hook linked, and the postinst says how to enable it
    fresh = _dpkg(root, "-i", str(deb))
    assert not hook.exists() and not hook.is_symlink()
    assert "run 'vgpuhost hook install'" in fresh.stdout and "reload libvirtd" in fresh.stdout, fresh.stdout
    assert not [c for c in _calls(root) if c.split()[:1] in (["start"], ["restart"], ["try-restart"])]
    installed = inside("/usr/bin/vgpuhost", "hook", "install").stdout      # the operator enables it
    assert installed.startswith("installed /etc/libvirt/hooks/qemu.d/vgpuhost") and "reload libvirtd" in installed
    _dpkg(root, "--purge", "vgpuhost")
    assert not hook.exists(), "purge left the hook that 'vgpuhost hook install' wrote"
