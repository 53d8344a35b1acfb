#!/usr/bin/env python3
"""Benchmark: the cost of libvirt's qemu hook on a domain start and stop.

Byte-compiles the package first (without ``PYTHONDONTWRITEBYTECODE``, as
``bench/inventory.py`` does: the figures are an installed package's), builds
simulated hosts (``a40-mdev``: one A40 on classic mdev, the representative
one-vGPU domain; ``l40s-vendor-vfio`` and ``a100-sriov-mdev`` as extra lines),
installs the hook on each with ``vgpuhost --root R hook install --hooks-dir
D`` (which byte-compiles the package too, as on a real install), writes a domain document with one vGPU (vgpuhost metadata + its
hostdev, as ``vgpuhost attach`` writes it) and one without vgpuhost
metadata, then runs, RUNS times each, interleaved, as real processes with the
XML on stdin and libvirt's minimal environment (``PATH``, ``HOME``,
``LC_ALL=C``):

  prepare     DIR/vgpuhost NAME prepare begin -   (must exit 0 and make the vGPU)
  release     DIR/vgpuhost NAME release end -     (must exit 0 and remove it)
  no-meta     DIR/vgpuhost NAME prepare begin -   for the domain without metadata
  no-meta release  DIR/vgpuhost NAME release end -   for it too (once vgpuhost's state store
              exists, every release end reaches the handler or the agent: the store,
              not the XML, says what a domain holds)
  clean python -I -c pass   the yardstick: the interpreter the hook runs, started
              clean (with ``site``) from an empty venv made with ``python -m venv
              --without-pip``: the editable install's ``.pth`` files and
              whatever the base installation's site-packages holds are not
              counted; ``--yardstick PY`` picks another interpreter
  python -I -S -c pass      the hook's own flags (no site), for comparison

With ``--agent up`` (or ``both``, the default) each host gets a twin with
``vgpuhost agent`` running (listening on ``<root>/run/vgpuhost``, where the
installed hook looks): its rows are labelled ``agent-up``, and there the
hook's sh dispatcher hands prepare and release to the agent (the compiled
``vgpuhost-hook-client`` over its unix socket when ``make dev`` built it, else
curl; no Python start), which keeps a warm snapshot of the host.

The simulated kernel's own time is measured apart: every hook run (and the
agent) has ``VGPUHOST_SIM_TIME_FILE`` set, the simulator appends the
seconds it spends (importing itself, applying each write) to that file, and
the ``SIM ms`` column is its median per run.  ``OWN ms`` is vgpuhost's own
cost, the median over runs of (wall time - simulator time): a real kernel
has a cost of its own, which the simulator's does not stand for.

Printed: medians (ms) and the ratios the targets (issue 17) are stated in,
against the clean start: own (prepare + release) / clean, target <= 5
without the agent and <= 2.5 with it; no-meta / clean, target < 0.5 (the
no-meta domain names a NIC hostdev: since issue 28 the dispatcher hands a
domain that names a host device to the handler or the agent, so with the agent
down that row pays a handler start; docs/performance.md has the figures).
Nothing is asserted on time; a failed hook run (exit code, any stderr, or
the device not appearing / disappearing) aborts with exit 1.

    .venv/bin/python bench/hook.py [--runs 20] [--hosts a40-mdev,l40s-vendor-vfio,a100-sriov-mdev] [--tmpdir DIR]
                                   [--agent both|up|down] [--yardstick PY]
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
import time
from pathlib import Path
from typing import Dict, List, Tuple

from benchutil import precompile, run, timed, wait_agent

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
        """``base``: the scratch directory; the simulator's time goes to ``base/<host>.simtime``."""
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
        self.simtime = base / f"{root.name}.simtime"
        self.env = dict(HOOK_ENV, **{SIM_TIME_ENV: str(self.simtime)})
        self.agent = _start_agent(self.host, self.simtime) if agent else None
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

    def _dispatch(self, name: str, op: str, sub: str, xml: bytes) -> Tuple[float, float]:
        """Run the installed hook once: ``(wall seconds, simulator seconds)``."""
        with open(self.simtime, "w"):
            pass                                    # truncate: this run's charges only
        t0 = time.perf_counter()
        proc = subprocess.run([str(self.hook), name, op, sub, "-"], input=xml, capture_output=True,
                              env=self.env, timeout=120)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or proc.stderr:
            raise SystemExit(f"bench: {self.label}: hook {op} {sub} exited {proc.returncode}: "
                             f"{proc.stderr.decode(errors='replace').strip()[:500]}")
        with open(self.simtime) as f:
            sim = sum(float(line) for line in f if line.strip())
        return wall, sim

    def prepare(self) -> Tuple[float, float]:
        return self._dispatch("bench-vm", "prepare", "begin", self.xml)

    def release(self) -> Tuple[float, float]:
        return self._dispatch("bench-vm", "release", "end", self.xml)

    def no_meta(self) -> Tuple[float, float]:
        return self._dispatch("plain-vm", "prepare", "begin", self.plain)

    def no_meta_release(self) -> Tuple[float, float]:
        return self._dispatch("plain-vm", "release", "end", self.plain)

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
    ap.add_argument("--yardstick", metavar="PY",
                    help="the interpreter whose clean start is the yardstick (default: an empty venv of the "
                         "interpreter the hook runs)")
    args = ap.parse_args(argv)
    if args.runs < 5:
        ap.error("--runs must be at least 5")
    specs = [s.strip() for s in args.hosts.split(",") if s.strip()]
    unknown = [s for s in specs if s not in HOSTS]
    if unknown or not specs:
        ap.error(f"--hosts: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(HOSTS)}")

    py = sys.executable
    # bytecode as an installed package has it, whatever the shell's PYTHONDONTWRITEBYTECODE says (the hook
    # runs -I and ignores it; the agent, started from this environment, would otherwise compile what
    # 'hook install' left out): the figures are an installed package's
    precompile(REPO / "vgpuhost")
    tmp = tempfile.mkdtemp(prefix="vgpuhost-bench-hook-", dir=args.tmpdir)
    times: Dict[str, List[float]] = {}
    sims: Dict[str, List[float]] = {}
    try:
        clean = args.yardstick or _clean_interpreter(Path(tmp) / "clean-venv")
        baselines = {CLEAN: [clean, "-I", "-c", "pass"], "python -I -S -c pass": [py, "-I", "-S", "-c", "pass"]}
        modes = {"both": (False, True), "up": (True,), "down": (False,)}[args.agent]
        benches = [Bench(s, Path(tmp), agent) for s in specs for agent in modes]
        jobs: List[Tuple[str, object]] = []
        for label, cmd in baselines.items():
            jobs.append((label, lambda cmd=cmd: (timed(lambda: _run_quiet(cmd)), 0.0)))
        for b in benches:
            jobs.append((f"{b.label} no-meta", b.no_meta))
            jobs.append((f"{b.label} no-meta release", b.no_meta_release))
            jobs.append((f"{b.label} prepare+release", b))        # a pair: prepare, check, release, check
        # warm-up: page cache, and a first start/stop that proves each host works
        for label, job in jobs:
            if isinstance(job, Bench):
                _pair(job, {}, {})
            else:
                job()
        for i in range(args.runs):
            order = jobs[i % len(jobs):] + jobs[:i % len(jobs)]    # rotate: no fixed position bias
            for label, job in order:
                if isinstance(job, Bench):
                    _pair(job, times, sims)
                else:
                    wall, sim = job()
                    times.setdefault(label, []).append(wall)
                    sims.setdefault(label, []).append(sim)
    finally:
        for b in locals().get("benches", []):
            b.close()
        shutil.rmtree(tmp, ignore_errors=True)

    med = {n: statistics.median(t) for n, t in times.items()}
    sim = {n: statistics.median(t) for n, t in sims.items()}
    own = {n: statistics.median([w - s for w, s in zip(times[n], sims[n])]) for n in times}
    ms = lambda s: f"{s * 1000:8.1f}"   # noqa: E731
    base = med[CLEAN]
    print(f"command: {shlex.join([sys.executable] + sys.argv)}")
    print(f"hook interpreter: {py}; yardstick: {clean} -I -c pass (clean start, with site)")
    from vgpuhost.hook.install import find_client
    client = find_client()
    print("thin client (agent up): " + (f"{client} (compiled, vgpuhost/hook/client.c)" if client else
                                        f"curl {shutil.which('curl')} (no compiled client: make client)"
                                        if shutil.which("curl") else "none (the hook starts Python with the agent up too)"))
    print(f"hook environment: {' '.join(f'{k}={v}' for k, v in HOOK_ENV.items())} {SIM_TIME_ENV}=FILE; "
          f"{args.runs} interleaved runs each; medians; hosts under {os.path.dirname(tmp)}")
    print()
    print(f"{'WHAT':<36}{'MEDIAN ms':>10}{'MIN ms':>9}{'MAX ms':>9}{'SIM ms':>9}{'OWN ms':>9}{'OWN/clean':>10}")
    for n, t in times.items():
        print(f"{n:<36}{ms(med[n]):>10}{ms(min(t)):>9}{ms(max(t)):>9}{ms(sim[n]):>9}{ms(own[n]):>9}"
              f"{own[n] / base:>10.2f}")
    print()
    width = max(len(b.label) for b in benches)
    print(f"{'HOST':<{width}}  {'RATIO (own cost = wall - simulator)':<40}{'/ clean':>8}  TARGET")
    for b in benches:
        pair = own[f"{b.label} prepare"] + own[f"{b.label} release"]
        nometa = own[f"{b.label} no-meta"]
        target = "<= 2.5" if b.agent is not None else "<= 5"
        print(f"{b.label:<{width}}  {'own (prepare + release) / clean start':<40}{pair / base:>8.2f}  {target}")
        print(f"{b.label:<{width}}  {'no-meta / clean start':<40}{nometa / base:>8.2f}  < 0.5")
        print(f"{b.label:<{width}}  {'no-meta release / clean start':<40}"
              f"{own[f'{b.label} no-meta release'] / base:>8.2f}")
    return 0


CLEAN = "clean python -I -c pass"
SIM_TIME_ENV = "VGPUHOST_SIM_TIME_FILE"


def _clean_interpreter(where: Path) -> str:
    """An empty venv of the interpreter the hook runs (no .pth, no packages): its python's path."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    run([base, "-I", "-m", "venv", "--without-pip", str(where)])
    return str(where / "bin" / "python")


def _run_quiet(cmd: List[str]) -> None:
    subprocess.run(cmd, check=True, env=HOOK_ENV, stdin=subprocess.DEVNULL)


def _pair(b: Bench, times: Dict[str, List[float]], sims: Dict[str, List[float]]) -> None:
    t, s = b.prepare()
    b.check(True, "prepare begin")
    times.setdefault(f"{b.label} prepare", []).append(t)
    sims.setdefault(f"{b.label} prepare", []).append(s)
    t, s = b.release()
    b.check(False, "release end")
    times.setdefault(f"{b.label} release", []).append(t)
    sims.setdefault(f"{b.label} release", []).append(s)


def _start_agent(host, simtime: Path) -> subprocess.Popen:
    """``vgpuhost agent`` for ``host``, listening where the installed hook looks; waits until it answers.
    Its simulator time goes to ``simtime`` too."""
    sockdir = host.path("run", "vgpuhost")
    proc = subprocess.Popen([sys.executable, "-m", "vgpuhost", "--root", str(host.root), "agent", "--socket-dir",
                             str(sockdir), "--admin-group", "0", "--ro-group", "0", "--metering-interval", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=str(REPO),
                            env=dict(os.environ, **{SIM_TIME_ENV: str(simtime)}))
    return wait_agent(proc, str(sockdir / "agent.sock"), lambda: proc.stderr.read().decode())


if __name__ == "__main__":
    sys.exit(main())
