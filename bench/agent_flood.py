#!/usr/bin/env python3
"""Benchmark: what a no-role connect flood costs the agent (trial 8 R7).

Not a test: nothing is asserted.  Run as root (the flooders and the member drop to throwaway uids).

One simulated ``a40-mdev`` host; for each ``--tree`` (a checkout of vgpuhost; default this one), in turn
and ``--rounds`` times interleaved: ``vgpuhost agent`` from that tree (``--tenant-group 54510=t1``, the
naming convention off), then ``--flooders`` processes of throwaway uids in no group of the agent's, each
connecting to the 0666 tenant socket, reading the 403 to the end and closing, in a loop for
``--seconds`` s (trial 8's flood.py), while a member of tenant t1 calls ``GET /v1/agent`` one call after
another.  Printed per tree: connections answered (403) and closed unanswered, the agent's CPU seconds
over the flood (``/proc/PID/stat`` utime + stime: a figure the machine's other load moves less than the
wall clock), its CPU milliseconds per 1,000 no-role connections, and the member's calls and their median
and largest latency.

    .venv/bin/python bench/agent_flood.py [--tree DIR ...] [--flooders 2] [--seconds 5] [--rounds 2]
                                          [--tmpdir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
NO_ROLE_UID0, NO_ROLE_GID = 54501, 54500
MEMBER_UID, T1_GID = 54511, 54510

FLOOD = r"""
import os, socket, sys, time
path, uid, gid, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
answered = unanswered = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    raw = b""
    try:
        s.connect(path)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    except OSError:
        pass
    s.close()
    if raw.startswith(b"HTTP/1.1 403 "):
        answered += 1
    else:
        unanswered += 1
print(answered, unanswered)
"""

MEMBER = r"""
import json, os, stat, sys, time
from vgpuhost.io import agentclient, unixsock  # imported as root: the ids drop below
path, uid, gid, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
os.setgroups([gid]); os.setgid(gid); os.setuid(uid)
lat, bad = [], 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter()
    status, _doc = agentclient.call(path, "GET", "/v1/agent", timeout_s=30)
    lat.append(time.perf_counter() - t0)
    bad += status != 200
    time.sleep(0.05)
print(json.dumps([lat, bad]))
"""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _agent(tree: Path, root: Path, sockdir: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("VGPUHOST_AGENT_SOCKET", None)
    proc = subprocess.Popen([sys.executable, "-m", "vgpuhost", "--root", str(root), "agent", "--socket-dir", sockdir,
                             "--admin-group", "0", "--ro-group", "54599", "--metering-interval", "0",
                             "--tenant-group", f"{T1_GID}=t1", "--tenant-group-prefix", ""],
                            cwd=str(tree), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sys.path.insert(0, str(REPO))
    from vgpuhost.io import agentclient
    deadline = time.monotonic() + 60
    while True:
        try:
            if agentclient.call(os.path.join(sockdir, "agent.sock"), "GET", "/v1/agent", timeout_s=5)[0] == 200:
                return proc
        except (agentclient.AgentDown, OSError):
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"the agent from {tree} did not start")
        time.sleep(0.05)


def one_run(tree: Path, root: Path, flooders: int, seconds: float) -> Dict[str, float]:
    sockdir = tempfile.mkdtemp(prefix="vgh-flood-", dir="/tmp")
    os.chmod(sockdir, 0o755)
    agent = _agent(tree, root, sockdir)
    tenant = os.path.join(sockdir, "agent-tenant.sock")
    try:
        time.sleep(0.5)                         # the agent's start-up work done before the count begins
        cpu0 = _cpu_s(agent.pid)
        floods = [subprocess.Popen([sys.executable, "-I", "-c", FLOOD, tenant, str(NO_ROLE_UID0 + i), str(NO_ROLE_GID),
                                    str(seconds)], stdout=subprocess.PIPE, text=True, cwd="/")
                  for i in range(flooders)]
        member = subprocess.Popen([sys.executable, "-c", MEMBER, tenant, str(MEMBER_UID), str(T1_GID), str(seconds)],
                                  stdout=subprocess.PIPE, text=True, cwd=str(REPO),
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
        answered = unanswered = 0
        for p in floods:
            a, u = p.communicate(timeout=seconds + 120)[0].split()
            answered, unanswered = answered + int(a), unanswered + int(u)
        lat, bad = json.loads(member.communicate(timeout=seconds + 120)[0])
        cpu = _cpu_s(agent.pid) - cpu0
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        shutil.rmtree(sockdir, ignore_errors=True)
    n = answered + unanswered
    return {"answered": answered, "unanswered": unanswered, "cpu_s": cpu,
            "cpu_ms_per_1000": 1e6 * cpu / n if n else float("nan"), "member_calls": len(lat),
            "member_bad": bad, "member_median_ms": 1e3 * statistics.median(lat) if lat else float("nan"),
            "member_max_ms": 1e3 * max(lat) if lat else float("nan")}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tree", action="append", default=[], help="a vgpuhost checkout to run the agent from "
                    "(repeat for side-by-side figures; default: this one)")
    ap.add_argument("--flooders", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tmpdir", default=None)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("run as root: the flooders and the member take throwaway uids")
    trees = [Path(t).resolve() for t in args.tree] or [REPO]
    sys.path.insert(0, str(REPO))
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.data import bundled_specs
    from vgpuhost.sim.spec import load_spec
    work = Path(tempfile.mkdtemp(prefix="agent-flood-", dir=args.tmpdir))
    try:
        root = materialise(load_spec(bundled_specs()["a40-mdev"]), work / "host").root
        runs: Dict[Path, List[Dict[str, float]]] = {t: [] for t in trees}
        for _ in range(args.rounds):
            for t in trees:
                runs[t].append(one_run(t, root, args.flooders, args.seconds))
        print(f"{args.flooders} no-role flooders x {args.seconds:g} s, {args.rounds} round(s) per tree, interleaved")
        print(f"{'tree':40} {'403s':>8} {'unanswered':>10} {'agent CPU s':>11} {'CPU ms/1000':>11} "
              f"{'member calls':>12} {'median ms':>9} {'max ms':>7}")
        for t, rs in runs.items():
            for r in rs:
                print(f"{str(t)[-40:]:40} {r['answered']:8d} {r['unanswered']:10d} {r['cpu_s']:11.2f} "
                      f"{r['cpu_ms_per_1000']:11.1f} {r['member_calls']:12d} {r['member_median_ms']:9.1f} "
                      f"{r['member_max_ms']:7.1f}" + (f"  ({r['member_bad']} member calls not 200)"
                                                      if r["member_bad"] else ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
