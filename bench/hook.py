#!/usr/bin/env python3
"""Benchmark: the cost of libvirt's qemu hook on a domain start and stop.

Builds simulated hosts (``a40-mdev``: one A40 on classic mdev, the
representative one-vGPU domain; ``l40s-vendor-vfio`` and ``a100-sriov-mdev``
as extra lines), installs the hook on each with ``vgpuhost --root R hook
install --hooks-dir D`` (which byte-compiles the package, as on a real
install), writes a domain document with one vGPU (vgpuhost metadata + its
hostdev, as ``vgpuhost attach`` writes it) and one without vgpuhost
metadata, then runs, RUNS times each, interleaved, as real processes with the
XML on stdin and libvirt's minimal environment (``PATH``, ``HOME``,
``LC_ALL=C``):

  prepare     DIR/vgpuhost NAME prepare begin -   (must exit 0 and make the vGPU)
  release     DIR/vgpuhost NAME release end -     (must exit 0 and remove it)
  no-meta     DIR/vgpuhost NAME prepare begin -   for the domain without metadata
  python      PY -c pass        PY = the interpreter the hook runs (sys.executable), WITH site
  python -I -S  PY -I -S -c pass  (the hook's own flags: no site)

With ``--agent up`` (or ``both``, the default) each host gets a twin with
``vgpuhost agent`` running (listening on ``<root>/run/vgpuhost``, where the
installed hook looks): its rows are labelled ``agent-up``, and there the
hook hands prepare and release to the agent, which keeps a warm snapshot of
the host.

and prints medians (ms) and the ratios the qemu-hook targets are stated in:
``no-meta / python`` (target < 0.5) and ``(prepare + release) / python``
(target < 3).  Nothing is asserted on time; a failed hook run (exit code, or
the device not appearing / disappearing) aborts with exit 1.

    .venv/bin/python bench/hook.py [--runs 20] [--hosts a40-mdev,l40s-vendor-vfio,a100-sriov-mdev] [--tmpdir DIR]
                                   [--agent both|up|down]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from benchutil import run, timed

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: libvirt runs hooks with this environment (docs/reference/libvirt.md)
HOOK_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C"}
DOMAIN_UUID = "11111111-2222-4333-8444-00000000b001"
OTHER_UUID = "11111111-2222-4333-8444-00000000b002"
MDEV_UUID = "aaaaaaaa-2222-4333-8444-00000000b001"
#: host spec -> (profile, VF BDF or None for a classic mdev named by MDEV_UUID)
HOSTS: Dict[str, Tuple[str, object]] = {
    "a40-mdev": ("A40-8Q", None),
    "l40s-vendor-vfio": ("L40S-4Q", "0000:21:00.4"),
    "a100-sriov-mdev": ("A100-4C", None),
}
PRIMARY = "a40-mdev"


def _domain_xml(name: str, uuid: str, meta_xml: str, hostdevs: List[str]) -> bytes:
    """A live domain document as libvirt passes it to the hook (tests/test_hook.py builds the same)."""
    return (f"<domain type='kvm' id='7'>\n  <name>{name}</name>\n  <uuid>{uuid}</uuid>\n"
            f"  <metadata>\n{meta_xml}  </metadata>\n  <memory unit='KiB'>65536</memory>\n"
            f"  <os><type arch='x86_64' machine='pc'>hvm</type></os>\n  <devices>\n    "
            + "\n    ".join(hostdevs) + "\n  </devices>\n</domain>\n").encode()


def _documents(spec: str) -> Tuple[bytes, bytes]:
    """(one-vGPU domain, domain without vgpuhost metadata) for host ``spec``."""
    from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
    from vgpuhost.model.values import PciAddress
    profile, vf = HOSTS[spec]
    if vf is None:
        meta = Metadata(vgpus=[VgpuRequest(profile, uuid=MDEV_UUID)])
        dev = (f"<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'><source>"
               f"<address uuid='{MDEV_UUID}'/></source></hostdev>")
    else:
        a = PciAddress.parse(str(vf))
        meta = Metadata(vgpus=[VgpuRequest(profile, vf=a)])
        dev = (f"<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x{a.domain:04x}' "
               f"bus='0x{a.bus:02x}' slot='0x{a.slot:02x}' function='0x{a.function:x}'/></source></hostdev>")
    plain_dev = ("<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x0000' "
                 "bus='0x00' slot='0x1f' function='0x6'/></source></hostdev>")
    return (_domain_xml("bench-vm", DOMAIN_UUID, meta.to_xml(), [dev]),
            _domain_xml("plain-vm", OTHER_UUID, "", [plain_dev]))


class Bench:
    """One simulated host with the hook installed."""

    def __init__(self, spec: str, base: Path, agent: bool = False):
        from vgpuhost.io.hostroot import HostRoot
        from vgpuhost.sim.data import bundled_specs
        from vgpuhost.sim.build import materialise
        from vgpuhost.sim.spec import load_spec
        self.spec = spec
        self.label = f"{spec} agent-up" if agent else spec
        root = base / (f"{spec}-agent" if agent else spec)
        materialise(load_spec(bundled_specs()[spec]), root)
        self.host = HostRoot(root)
        hooks = base / f"{root.name}-qemu.d"
        run([sys.executable, "-m", "vgpuhost", "--root", str(root), "hook", "install", "--hooks-dir", str(hooks)])
        self.agent = _start_agent(self.host) if agent else None
        self.hook = hooks / "vgpuhost"
        self.xml, self.plain = _documents(spec)
        self.vf = HOSTS[spec][1]

    def close(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            self.agent.wait(30)

    def _device_present(self) -> bool:
        from vgpuhost.io.sysfs import Sysfs
        fs = Sysfs(self.host)
        if self.vf is None:
            return fs.exists(self.host.mdev_devices / MDEV_UUID)
        cur = fs.read_optional(self.host.pci_device(str(self.vf)) / "nvidia" / "current_vgpu_type")
        return bool(cur) and cur != "0"

    def _dispatch(self, name: str, op: str, sub: str, xml: bytes) -> None:
        proc = subprocess.run([str(self.hook), name, op, sub, "-"], input=xml, capture_output=True,
                              env=HOOK_ENV, timeout=120)
        if proc.returncode != 0 or proc.stderr:
            raise SystemExit(f"bench: {self.label}: hook {op} {sub} exited {proc.returncode}: "
                             f"{proc.stderr.decode(errors='replace').strip()[:500]}")

    def prepare(self) -> None:
        self._dispatch("bench-vm", "prepare", "begin", self.xml)

    def release(self) -> None:
        self._dispatch("bench-vm", "release", "end", self.xml)

    def no_meta(self) -> None:
        self._dispatch("plain-vm", "prepare", "begin", self.plain)

    def check(self, present: bool, after: str) -> None:
        if self._device_present() != present:
            raise SystemExit(f"bench: {self.label}: after {after} the vGPU is "
                             f"{'missing' if present else 'still there'}")


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="timed runs of each command (default 20, at least 5)")
    ap.add_argument("--hosts", default=",".join(HOSTS),
                    help=f"simulated host specs, comma-separated (default {','.join(HOSTS)})")
    ap.add_argument("--tmpdir", metavar="DIR",
                    help="where the simulated hosts and state stores go (default: the system temp dir; "
                         "a tmpfs such as /dev/shm takes the disk's journal out of the simulator's writes)")
    ap.add_argument("--agent", choices=["both", "up", "down"], default="both",
                    help="run each host with the agent down, up, or both (default both)")
    args = ap.parse_args(argv)
    if args.runs < 5:
        ap.error("--runs must be at least 5")
    specs = [s.strip() for s in args.hosts.split(",") if s.strip()]
    unknown = [s for s in specs if s not in HOSTS]
    if unknown or not specs:
        ap.error(f"--hosts: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(HOSTS)}")

    py = sys.executable
    baselines = {"python -c pass": [py, "-c", "pass"], "python -I -S -c pass": [py, "-I", "-S", "-c", "pass"]}
    tmp = tempfile.mkdtemp(prefix="vgpuhost-bench-hook-", dir=args.tmpdir)
    times: Dict[str, List[float]] = {}
    try:
        modes = {"both": (False, True), "up": (True,), "down": (False,)}[args.agent]
        benches = [Bench(s, Path(tmp), agent) for s in specs for agent in modes]
        jobs: List[Tuple[str, Callable[[], None]]] = []
        for label, cmd in baselines.items():
            jobs.append((label, lambda cmd=cmd: _run_quiet(cmd)))
        for b in benches:
            jobs.append((f"{b.label} no-meta", b.no_meta))
            jobs.append((f"{b.spec} prepare+release", b))        # a pair: prepare, check, release, check
        # warm-up: page cache, and a first start/stop that proves each host works
        for label, job in jobs:
            if isinstance(job, Bench):
                _pair(job, {})
            else:
                job()
        for i in range(args.runs):
            order = jobs[i % len(jobs):] + jobs[:i % len(jobs)]    # rotate: no fixed position bias
            for label, job in order:
                if isinstance(job, Bench):
                    _pair(job, times)
                else:
                    times.setdefault(label, []).append(timed(job))
    finally:
        for b in locals().get("benches", []):
            b.close()
        shutil.rmtree(tmp, ignore_errors=True)

    med = {n: statistics.median(t) for n, t in times.items()}
    ms = lambda s: f"{s * 1000:8.1f}"   # noqa: E731
    base = med["python -c pass"]
    print(f"command: {shlex.join([sys.executable] + sys.argv)}")
    print(f"interpreter: {py} (the one the installed hook runs; python -c pass runs WITH site)")
    print(f"hook environment: {' '.join(f'{k}={v}' for k, v in HOOK_ENV.items())}; "
          f"{args.runs} interleaved runs each; medians; hosts under {os.path.dirname(tmp)}")
    print()
    print(f"{'WHAT':<40}{'MEDIAN ms':>10}{'MIN ms':>10}{'MAX ms':>10}{'/ python':>10}")
    for n, t in times.items():
        print(f"{n:<40}{ms(med[n]):>10}{ms(min(t)):>10}{ms(max(t)):>10}{med[n] / base:>10.2f}")
    print()
    iso = med["python -I -S -c pass"]
    width = max(len(b.label) for b in benches)
    print(f"{'HOST':<{width}}  {'RATIO':<38}{'/ python':>9}{'/ -I -S':>9}")
    for b in benches:
        pair = med[f"{b.label} prepare"] + med[f"{b.label} release"]
        nometa = med[f"{b.label} no-meta"]
        primary = b.spec == PRIMARY
        print(f"{b.label:<{width}}  {'(prepare + release) / baseline':<38}{pair / base:>9.2f}{pair / iso:>9.2f}"
              + ("   target < 3 (/ python)" if primary else ""))
        print(f"{b.label:<{width}}  {'no-meta / baseline':<38}{nometa / base:>9.2f}{nometa / iso:>9.2f}"
              + ("   target < 0.5 (/ python)" if primary else ""))
    return 0


def _run_quiet(cmd: List[str]) -> None:
    subprocess.run(cmd, check=True, env=HOOK_ENV, stdin=subprocess.DEVNULL)


def _pair(b: Bench, times: Dict[str, List[float]]) -> None:
    t = timed(b.prepare)
    b.check(True, "prepare begin")
    times.setdefault(f"{b.label} prepare", []).append(t)
    t = timed(b.release)
    b.check(False, "release end")
    times.setdefault(f"{b.label} release", []).append(t)


def _start_agent(host) -> subprocess.Popen:
    """``vgpuhost agent`` for ``host``, listening where the installed hook looks; waits until it answers."""
    import time
    from vgpuhost.io import agentclient
    sockdir = host.path("run", "vgpuhost")
    proc = subprocess.Popen([sys.executable, "-m", "vgpuhost", "--root", str(host.root), "agent", "--socket-dir",
                             str(sockdir), "--admin-group", "0", "--ro-group", "0", "--metering-interval", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=str(REPO))
    path = str(sockdir / "agent.sock")
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"bench: the agent exited {proc.returncode}: {proc.stderr.read().decode()[:500]}")
        try:
            if agentclient.call(path, "GET", "/v1/agent", timeout_s=5)[0] == 200:
                return proc
        except (agentclient.AgentDown, OSError):
            pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("bench: the agent did not answer")


if __name__ == "__main__":
    sys.exit(main())
