"""``make demo``: vgpuhost's main job, end to end, on a simulated host.

Part 1 (libvirt): a simulated A40 host, a diskless VM, ``vgpuhost attach``
of a vGPU profile, the domain XML, a start through libvirt with vgpuhost's
qemu hook installed (the hook creates the mdev; the audit log shows it), the
stop (the hook releases it), and what was created and released.  As root,
with Debian's libvirtd and qemu present, this runs against a real libvirtd
started in a private mount and network namespace
(:mod:`vgpuhost.sim.libvirtd`); otherwise on libvirt's ``test:///default``
driver, feeding the installed hook the domain XML as libvirt would, and it
says which parts it skipped.

Part 2: a tour of the other modes on the bundled simulated hosts.

Everything is built under ``./demo-host/`` (or the directory given as the
first argument); nothing outside it is touched.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from .cli.main import main as vgpuhost
from .io import files
from .io.process import run_program
from .io.virt import _libvirt, open_connection
from .model.errors import VgpuhostError
from .sim.data import bundled_specs
from .sim.libvirtd import IsolatedLibvirtd, available, diskless_domain_xml

DOMAIN = "demo-vm"
PROFILE = "A40-8Q"

TOUR = [
    ("a40-mdev", [["host", "check"], ["types", "--available"],
                  ["vgpu", "create", "--profile", "A40-8Q", "--params", "frame_rate_limiter=0"],
                  ["vgpu", "create", "--profile", "A40-4C"],          # refused: equal-size mode
                  ["vgpu", "list"]]),
    ("l40s-vendor-vfio", [["gpus"],
                          ["vgpu", "create", "--profile", "l40s-8q", "--numa-node", "1", "--strategy", "best-fit"],
                          ["vgpu", "list"]]),
    ("turing-consumer", [["host", "check"], ["passthrough", "prepare", "0000:01:00.0"]]),
    ("sata-shared-group", [["passthrough", "prepare", "0000:03:00.0"]]),
    # refused: vfio-pci binds no PF with SR-IOV VFs enabled (the refusal names sriov-manage -d)
    ("a100-sriov-mdev", [["passthrough", "prepare", "--dry-run", "0000:41:00.0"]]),
    ("a100-vfs-off", [["passthrough", "prepare", "--dry-run", "0000:41:00.0"],
                      ["passthrough", "prepare", "0000:41:00.0"],
                      ["passthrough", "release", "0000:41:00.0"]]),
]
# the A100 host after '/usr/lib/nvidia/sriov-manage -d 0000:41:00.0' (vgpuhost never runs it): VFs off
VFS_OFF = "a100-vfs-off"


def _spec(base: Path, spec: str) -> str:
    """A bundled spec's name, or for :data:`VFS_OFF` a spec file written under ``base``."""
    if spec != VFS_OFF:
        return spec
    text = files.read_text_capped(bundled_specs()["a100-sriov-mdev"]) or ""
    text = text.replace("name: a100-sriov-mdev", f"name: {VFS_OFF}").replace("sriov_numvfs: 20", "sriov_numvfs: 0")
    path = base / f"{VFS_OFF}.yaml"
    files.write_atomic(path, text)
    return str(path)


def run(argv: List[str]) -> int:
    print(f"\n$ vgpuhost {' '.join(shlex.quote(a) for a in argv)}", flush=True)
    code = vgpuhost(argv)
    print(f"[exit {code}]", flush=True)
    return code


def virsh(daemon, *args: str):
    """Run ``virsh ARGS`` against the isolated daemon, printed like the vgpuhost commands."""
    print(f"\n$ virsh {' '.join(shlex.quote(a) for a in args)}", flush=True)
    r = daemon.virsh(*args)
    text = (r.stdout + r.stderr).strip()
    if text:
        print(text)
    print(f"[exit {r.returncode}]", flush=True)
    return r


def say(text: str) -> None:
    print(f"\n# {text}", flush=True)


def _hostdev_lines(xml: str) -> str:
    """The parts of a domain document the demo is about: metadata and hostdevs."""
    out, keep = [], False
    for line in xml.splitlines():
        s = line.strip()
        if s.startswith("<metadata") or s.startswith("<hostdev"):
            keep = True
        if keep:
            out.append(line)
        if s.startswith("</metadata") or s.startswith("</hostdev"):
            keep = False
    return "\n".join(out)


def _libvirt_part(base: Path) -> int:

    root = base / "libvirt-host"
    if run(["sim", "create", "--force", "a40-mdev", str(root)]) != 0:
        return 2
    ok, why = available()
    try:
        _libvirt()              # libvirt-python, installed by make dev
    except VgpuhostError as e:
        print(f"vgpuhost demo: {e.one_line()}")
        return 2
    g = ["--root", str(root)]
    if ok:
        return _real_daemon(base, root, g, IsolatedLibvirtd, diskless_domain_xml)
    say(f"No isolated libvirtd here ({why}): running the same flow on libvirt's test:///default driver.")
    say("Skipped: the real daemon running the hook. Instead the installed hook is fed the domain XML "
        "as libvirt would feed it.")
    return _test_driver(base, root, g, diskless_domain_xml)


def _real_daemon(base: Path, root: Path, g: List[str], daemon_cls, domain_xml) -> int:
    workdir = base / "libvirtd"
    files.remove_tree(workdir)
    files.make_dirs(workdir)
    say(f"Starting an isolated libvirtd (private mount + network namespace) in {workdir}")
    with daemon_cls(workdir) as d:
        uri = d.uri
        run(g + ["hook", "install", "--hooks-dir", str(d.hooks_dir)])
        d.reload_hooks()
        conn = open_connection(uri)
        conn.define(domain_xml(DOMAIN))
        conn.define(domain_xml("plain-vm"))
        run(g + ["--connect", uri, "attach", DOMAIN, "--profile", PROFILE, "--tenant", "demo"])
        say(f"virsh dumpxml {DOMAIN}: vgpuhost's metadata and the mdev hostdev")
        print(f"$ virsh dumpxml {DOMAIN}   (metadata and hostdev shown)")
        print(_hostdev_lines(d.virsh("dumpxml", DOMAIN).stdout))
        say(f"virsh start {DOMAIN}: the hook creates the mdev at 'prepare begin'. This host's GPU is "
            "simulated, so libvirt then cannot use the device (this machine has no such mdev or "
            "VFIO) and fails the start; it runs 'release end', where the hook removes the mdev again.")
        virsh(d, "start", DOMAIN)
        run(g + ["audit"])
        run(g + ["vgpu", "list"])
        say("A domain without vgpuhost metadata starts and stops as before (the hook exits at once):")
        for args in (("start", "plain-vm"), ("destroy", "plain-vm")):
            virsh(d, *args)
        run(g + ["--connect", uri, "detach", DOMAIN, "--all"])
        run(g + ["hook", "status", "--hooks-dir", str(d.hooks_dir)])
        conn.close()
    return 0


def _test_driver(base: Path, root: Path, g: List[str], domain_xml) -> int:
    hooks = base / "hooks"
    files.remove_tree(hooks)
    run(g + ["hook", "install", "--hooks-dir", str(hooks)])
    uri = "test:///default"
    conn = open_connection(uri)
    dom = conn.define(domain_xml(DOMAIN))
    code = run(g + ["--connect", uri, "attach", DOMAIN, "--profile", PROFILE, "--tenant", "demo"])
    if code != 0:
        return code
    xml = dom.inactive_xml()
    say(f"{DOMAIN}'s definition: vgpuhost's metadata and the mdev hostdev")
    print(_hostdev_lines(xml))
    hook = hooks / "vgpuhost"
    for op, sub in (("prepare", "begin"), ("release", "end")):
        say(f"libvirt would run: {hook} {DOMAIN} {op} {sub} - < domain.xml")
        r = run_program([str(hook), DOMAIN, op, sub, "-"], input=xml.encode(), timeout=120)
        print(f"[hook exit {r.returncode}] {r.stderr.decode(errors='replace').strip()}")
        run(g + ["vgpu", "list"])
    run(g + ["audit"])
    conn.close()
    return 0


def tour(base: Path) -> Optional[List[Tuple[str, List[str], int]]]:
    """Part 2: each :data:`TOUR` command on its host under ``base``; ``(spec, argv, exit code)`` each,
    or None when a simulated host could not be built."""
    done = []
    for spec, commands in TOUR:
        root = base / spec
        if spec == VFS_OFF:
            say("The same A100 host after its VFs are disabled the documented way "
                "(/usr/lib/nvidia/sriov-manage -d 0000:41:00.0, which vgpuhost never runs): passthrough works")
        if run(["sim", "create", "--force", _spec(base, spec), str(root)]) != 0:
            return None
        for cmd in commands:
            done.append((spec, cmd, run(["--root", str(root)] + cmd)))
    return done


def main(args: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if args is None else args
    base = Path(args[0] if args else "demo-host").absolute()
    print(f"vgpuhost demo: simulated hosts under {base}")
    say("Part 1: a vGPU for a libvirt domain, created and released by vgpuhost's qemu hook")
    code = _libvirt_part(base)
    if code != 0:
        return code
    say("Part 2: the other modes on the bundled simulated hosts")
    if tour(base) is None:
        return 2
    print("\nDone. Try your own: vgpuhost --root", base / "a40-mdev", "--json types")
    return 0


if __name__ == "__main__":
    sys.exit(main())
