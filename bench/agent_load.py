#!/usr/bin/env python3
"""Benchmark: the qemu hook through the agent while hostile readers load it, and a scrape storm.

Not a test: nothing is asserted on time; a failed hook run aborts with exit 1 (issue 28, finding 6).

``--mode load``: one simulated ``a40-mdev`` host with the hook installed (as ``bench/hook.py`` builds
it) and ``vgpuhost agent`` running (admin group 0, read-only group a throwaway gid); every hook run is
the installed dispatcher with the domain XML on stdin, handing prepare and release to the agent. The
figure is the wall time of one ``prepare begin`` + ``release end`` (median of ``--rounds`` x ``--runs``;
the phases interleaved, round by round), measured:

  idle      nothing else talks to the agent;
  readers   4 hostile readers (processes of one throwaway uid in the read-only group, on agent-ro.sock),
            each posting, in a loop, the finding's 640 KB config of 9,000 entries and the largest
            config the agent parses (just within its size and item limits) to ``POST /v1/plan``;
  all       the readers, plus 64 trickling connections (one byte every 5 s; a connection answered is
            opened again, after 1/64 s when the answer was a 429), plus bursts of 200 connects at
            once (each sends ``GET /v1/agent``), every 2 s; three uids, one per kind of client.

Printed: the medians, the ratio all/idle and readers/idle (target <= 2), the answers the hostile
clients got by status (429s vs other errors; a connect that fails is counted by its errno name), and
the seconds SIGTERM took to end the agent with the load still running.

``--mode scrape``: an agent with metering on and ``--metrics-port 0``; ``--scrapers`` (50) threads
scrape ``/metrics`` over TCP for ``--seconds`` (30), each with a 10 s timeout; printed: scrapes, errors,
timeouts (target 0).

``--mode scale`` (issue 31): one simulated host of ``--gpus`` (8) A40s on classic mdev with the hook
installed; ``--clients`` hook clients at once (default 1,8), each running the installed dispatcher for
its own domain (one A40-4Q vGPU, its own UUIDs) in a loop of ``prepare begin`` + ``release end`` for
``--seconds-per`` (15) seconds, first with the agent down (the one-shot path: the dispatcher's Python
handler), then up.  Printed side by side: pairs/s and median pair latency per client count, and the
ratio agent/one-shot (target >= 3 at 8 clients); and the CPU seconds each path spent per pair (the hook
runs' and the agent's; a figure the machine's other load does not move as it moves the wall clock).  Then, with the agent up: ``--storm`` (64) clients for
``--storm-seconds`` (60) s (failed hook runs, and the 429s the agent answered, which the dispatcher
handles by doing the work itself: hook calls minus the agent's served ones), SIGTERM with the storm still
running (seconds to exit; target 5), and ``GET /v1/capacity`` from ``--capacity-clients`` (8) client
threads in one process for ``--seconds-per`` s (requests/s, p50/p99; target >= 300/s, p99 <= 50 ms),
beside the one-shot ``vgpuhost --json capacity`` (ms a call).

    .venv/bin/python bench/agent_load.py --mode scale [--gpus 8] [--clients 1,8] [--seconds-per 15]
                                         [--storm 64] [--storm-seconds 60] [--capacity-clients 8]

    .venv/bin/python bench/agent_load.py [--mode load|scrape|both] [--runs 5] [--rounds 3] [--seconds 30]
                                         [--scrapers 50] [--tmpdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: the hostile clients' ids (nobody has them; as in tests/agentutil.py)
RO_GID = 54011
#: one throwaway uid per kind of hostile client (three parties; the agent's per-caller limits are per uid)
HOSTILE_UIDS = {"reader": 54001, "trickle": 54002, "burst": 54003}
#: set by SIGTERM in a hostile client: it stops and prints its counts
_STOP = threading.Event()


def _going(until: float) -> bool:
    return time.monotonic() < until and not _STOP.is_set()


# ---------------------------------------------------------------------------
# the hostile clients: plain stdlib processes, run as HOSTILE_UIDS[KIND] (``--worker KIND SOCKET SECONDS``)

def _read_answer(s: socket.socket) -> Tuple[bytes, str]:
    """Everything the agent sends on ``s`` until it closes, and the error name when reading failed with
    nothing read ("" otherwise: an answer cut short still counts as its status)."""
    raw = b""
    try:
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                return raw, ""
            raw += chunk
    except OSError as e:
        return raw, "" if raw else type(e).__name__


def _request(path: str, data: bytes, timeout: float = 60) -> str:
    """Send ``data`` on a fresh connection; the answer's status, or the errno name of what failed."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError as e:
        s.close()
        return f"connect {type(e).__name__}"
    try:
        try:
            s.sendall(data)
        except OSError:
            pass                                    # answered and closed before it was all sent
        raw, failed = _read_answer(s)
        if failed:
            return failed
    finally:
        s.close()
    try:
        return raw.split(b"\r\n", 1)[0].split()[1].decode()
    except IndexError:
        return "no answer"


def _post(target: str, body: bytes) -> bytes:
    return (f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _config(entries: int) -> str:
    lines = ["version: 1", "layouts:", "  big:", "    gpus:"]
    for i in range(entries):
        lines += [f"      - select: {{address: '0000:{i % 256:02x}:{i // 256:02x}.0'}}", "        mode: vgpu",
                  "        vgpu: {types: {A40-8Q: 2}}"]
    return "\n".join(lines) + "\n"


def worker_reader(path: str, until: float, out: Counter, finding: bytes, maximal: bytes) -> None:
    while _going(until):
        out["finding " + _request(path, _post("/v1/plan", finding))] += 1
        out["maximal " + _request(path, _post("/v1/plan", maximal))] += 1


def worker_trickle(path: str, until: float, out: Counter, n: int = 64, every_s: float = 5.0) -> None:
    import select
    socks: Dict[socket.socket, float] = {}

    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError as e:
            out[f"connect {type(e).__name__}"] += 1
            s.close()
            return
        try:
            s.sendall(b"GET /v1/agent HTTP/1.1\r\nX-Slow: ")
        except OSError:
            pass                                    # answered (429) and closed at once: read below
        socks[s] = time.monotonic()
    for _ in range(n):
        connect()
    while _going(until):
        ready = select.select(list(socks), [], [], 0.5)[0]
        for s in ready:                             # answered (408, or 429 when no slot was free)
            status = "reset"
            try:
                data = s.recv(1 << 16)
                status = data.split(b"\r\n", 1)[0].split()[1].decode() if data else "closed unanswered"
            except (OSError, IndexError):
                pass
            out[status] += 1
            del socks[s]
            s.close()
            if status == "429":                     # a trickler, not a connect flood (that is the burst's):
                time.sleep(1.0 / n)                 # it comes back at about one connection a second
            connect()
        now = time.monotonic()
        for s, last in list(socks.items()):
            if now - last >= every_s:
                try:
                    s.sendall(b"x")
                    socks[s] = now
                except OSError:
                    pass
    for s in socks:
        s.close()


def worker_burst(path: str, until: float, out: Counter, n: int = 200, every_s: float = 2.0) -> None:
    while _going(until):
        socks = []
        for _ in range(n):                          # all connected at once, then each read
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
                socks.append(s)
            except OSError as e:
                out[f"connect {type(e).__name__}"] += 1
                s.close()
        for s in socks:
            s.setblocking(True)
            s.settimeout(60)
            try:
                s.sendall(b"GET /v1/agent HTTP/1.1\r\nHost: x\r\n\r\n")
            except OSError:
                pass
            raw, failed = _read_answer(s)
            if failed:
                out[failed] += 1
            s.close()
            if raw:
                out[raw.split(b"\r\n", 1)[0].split()[1].decode()] += 1
        time.sleep(every_s)


def worker_main(kind: str, path: str, seconds: float) -> int:
    os.setgroups([RO_GID])          # started as root (the interpreter may be under /root): the ids drop now
    os.setgid(RO_GID)
    os.setuid(HOSTILE_UIDS[kind])
    until = time.monotonic() + seconds
    out: Counter = Counter()
    signal.signal(signal.SIGTERM, lambda *_: _STOP.set())
    if kind == "reader":
        finding = json.dumps({"config": _config(9000), "layout": "big"}).encode()
        maximal = json.loads(sys.stdin.read())["maximal"].encode()
        worker_reader(path, until, out, finding, maximal)
    elif kind == "trickle":
        worker_trickle(path, until, out)
    else:
        worker_burst(path, until, out)
    print(json.dumps(dict(out)))
    return 0


# ---------------------------------------------------------------------------
# the bench

def _maximal_body() -> str:
    """The largest ``POST /v1/plan`` body the agent parses: a config just within its limits."""
    from vgpuhost.agent.server import MAX_LAYOUT_BODY, config_refusal, json_items, MAX_JSON_ITEMS
    n = 1
    while True:
        body = json.dumps({"config": _config(n + 1), "layout": "big"})
        if (config_refusal(_config(n + 1)) is not None or len(body) > MAX_LAYOUT_BODY
                or json_items(body.encode()) > MAX_JSON_ITEMS):
            return json.dumps({"config": _config(n), "layout": "big"})
        n += 1


def _start_agent(host, extra: List[str]) -> subprocess.Popen:
    """The agent, its log in ``<root>/agent.log`` (a file: a pipe nobody reads would stall its logging)."""
    from benchutil import wait_agent        # here: the hostile workers run this file with -I (no bench/ on the path)
    sockdir = host.path("run", "vgpuhost")
    log = Path(host.root) / "agent.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "vgpuhost", "--root", str(host.root), "agent",
                                 "--socket-dir", str(sockdir), "--admin-group", "0", "--ro-group", str(RO_GID),
                                 *extra], stdout=subprocess.DEVNULL, stderr=f, cwd=str(REPO))
    return wait_agent(proc, str(sockdir / "agent.sock"), log.read_text)


#: every hostile client started (killed at the end, whatever happened)
_STARTED: List[subprocess.Popen] = []


def _hostile(kind: str, path: str, seconds: float, stdin: str = "") -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-I", str(Path(__file__).resolve()), "--worker", kind, path,
                          str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    _STARTED.append(p)
    return p


def _cycles(b, runs: int) -> List[float]:
    out = []
    for _ in range(runs):
        prepared = b.prepare()                      # bench/hook.py's Sample: wall seconds and more
        b.check(True, "prepare begin")
        released = b.release()
        b.check(False, "release end")
        out.append(prepared.wall + released.wall)
    return out


def _load_phase(b, ro: str, runs: int, kinds: List[str], maximal: str) -> tuple:
    seconds = 600.0                                 # stopped (SIGTERM) once the runs are done
    procs = []
    for kind in kinds:
        p = _hostile(kind, ro, seconds)
        p.stdin.write(json.dumps({"maximal": maximal}) if kind == "reader" else "")
        p.stdin.close()
        procs.append(p)
    time.sleep(3.0)                                 # the load under way before the first hook run
    times = _cycles(b, runs)
    return times, procs


def _collect(procs) -> Counter:
    total: Counter = Counter()
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)       # it stops after its current request and prints its counts
    for p in procs:
        try:
            p.wait(90)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        out = p.stdout.read()
        if out.strip():
            total.update(json.loads(out.strip().splitlines()[-1]))
    return total


def run_load(base: Path, runs: int, rounds: int) -> None:
    import hook as hookbench
    b = hookbench.Bench(hookbench.PRIMARY, base, agent=False)
    agent = _start_agent(b.host, ["--metering-interval", "0"])
    b.agent = agent
    ro = str(b.host.path("run", "vgpuhost", "agent-ro.sock"))
    maximal = _maximal_body()
    phases = {"idle": [], "readers": [], "all": []}
    kinds = {"idle": [], "readers": ["reader"] * 4, "all": ["reader"] * 4 + ["trickle", "burst"]}
    counts = {"readers": Counter(), "all": Counter()}
    try:
        _cycles(b, 2)                               # warm: the agent's snapshot, the page cache
        for r in range(rounds):                     # interleaved: a shared machine's drift hits each phase alike
            for phase in ("idle", "readers", "all"):
                print(f"bench: round {r + 1}/{rounds}: {phase} ...", file=sys.stderr)
                if phase == "idle":
                    phases[phase] += _cycles(b, runs)
                    continue
                times, procs = _load_phase(b, ro, runs, kinds[phase], maximal)
                phases[phase] += times
                counts[phase].update(_collect(procs))
        # SIGTERM with the whole load running (its answers are not counted: the socket goes away)
        _t, procs = _load_phase(b, ro, 1, kinds["all"], maximal)
        rc, stop_s = _sigterm(agent)
        _collect(procs)
    finally:
        b.close()
    med = {k: statistics.median(v) * 1000 for k, v in phases.items()}
    print(f"hook prepare begin + release end through the agent, {b.label}, median of {rounds} x {runs} (ms):")
    for k in ("idle", "readers", "all"):
        print(f"  {k:8s} {med[k]:8.1f}   ratio to idle {med[k] / med['idle']:.2f}  (target <= 2)")
    print(f"  maximal accepted /v1/plan body: {len(maximal)} bytes")
    for name, c in counts.items():
        n429 = sum(v for k, v in c.items() if k.endswith("429"))
        other = sum(v for k, v in c.items() if not k.endswith(("429", "413", "400", "408", "200")))
        print(f"  hostile answers ({name}): " + ", ".join(f"{k}: {v}" for k, v in sorted(c.items())))
        print(f"    429: {n429}; errors other than an HTTP answer: {other}")
    print(f"  SIGTERM under load: agent exited {rc} after {stop_s:.2f} s")


def run_scrape(base: Path, seconds: float, scrapers: int) -> None:
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.data import bundled_specs
    from vgpuhost.sim.spec import load_spec
    root = base / "scrape"
    materialise(load_spec(bundled_specs()["a40-mdev"]), root)
    host = HostRoot(root)
    agent = _start_agent(host, ["--metering-interval", "1", "--metrics-port", "0"])
    port = None
    try:
        for _ in range(200):                        # the "listening" line comes as the agent answers
            for text in (Path(host.root) / "agent.log").read_text().splitlines():
                if "metrics on http://" in text:
                    port = int(text.rsplit(":", 1)[1].split("/")[0])
            if port is not None:
                break
            time.sleep(0.05)
        if port is None:
            raise SystemExit("bench: the agent printed no metrics port")
        counts: Counter = Counter()
        lock = threading.Lock()
        until = time.monotonic() + seconds

        def scrape():
            while _going(until):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                        r.read()
                        what = "ok" if r.status == 200 else f"status {r.status}"
                except (socket.timeout, TimeoutError):
                    what = "timeout"
                except OSError as e:
                    what = "timeout" if "timed out" in str(e) else f"error {type(e).__name__}"
                with lock:
                    counts[what] += 1
        threads = [threading.Thread(target=scrape) for _ in range(scrapers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)
    print(f"scrape storm: {scrapers} scrapers for {seconds:g} s on --metrics-port: "
          f"{sum(counts.values())} scrapes, ok {counts['ok']}, timeouts {counts['timeout']} (target 0), "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("ok", "timeout")))


# ---------------------------------------------------------------------------
# --mode scale: many hook clients at once, agent up and down; GET /v1/capacity from 8 clients

SCALE_PROFILE = "A40-4Q"        # 12 per A40: 96 on 8 GPUs, more than the storm's 64 domains hold at once


def _scale_host(base: Path, gpus: int):
    """``(host, installed hook)``: ``gpus`` A40s on classic mdev, the hook installed for it."""
    from benchutil import a40_spec_yaml, run
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.sim.build import materialise
    from vgpuhost.sim.spec import parse_spec
    root = base / f"scale-{gpus}"
    materialise(parse_spec(a40_spec_yaml(gpus, "scale")), root)
    hooks = base / f"scale-{gpus}-qemu.d"
    run([sys.executable, "-m", "vgpuhost", "--root", str(root), "hook", "install", "--hooks-dir", str(hooks)])
    return HostRoot(root), hooks / "vgpuhost"


def _scale_domain(i: int) -> bytes:
    import hook as hookbench
    from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
    uuid, mdev = f"11111111-2222-4333-8444-{i:012x}", f"aaaaaaaa-2222-4333-8444-{i:012x}"
    meta = Metadata(vgpus=[VgpuRequest(SCALE_PROFILE, uuid=mdev)])
    dev = (f"<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'><source>"
           f"<address uuid='{mdev}'/></source></hostdev>")
    return hookbench._domain_xml(f"scale-{i}", uuid, meta.to_xml(), [dev])


def _hook_clients(hook: Path, n: int, seconds: float, first: int = 0) -> tuple:
    """``n`` threads, each a domain's prepare begin + release end in a loop for ``seconds`` (or until the
    returned event is set): the pairs' seconds, and the failures by kind (a hook run that exited non-zero
    or printed anything)."""
    import hook as hookbench
    pairs: List[float] = []
    failed: Counter = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    until = time.monotonic() + seconds

    def client(i: int) -> None:
        xml = _scale_domain(first + i)
        name = f"scale-{first + i}"
        while time.monotonic() < until and not stop.is_set():
            t0 = time.perf_counter()
            ok = True
            for op, sub in (("prepare", "begin"), ("release", "end")):
                p = subprocess.run([str(hook), name, op, sub, "-"], input=xml, capture_output=True,
                                   env=hookbench.HOOK_ENV, timeout=120)
                if p.returncode != 0 or p.stderr:
                    ok = False
                    with lock:
                        failed[f"{op} exit {p.returncode}: {p.stderr.decode(errors='replace').strip()[:120]}"] += 1
            with lock:
                if ok:
                    pairs.append(time.perf_counter() - t0)
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return pairs, failed, stop, threads


def _process_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` and of its children it reaped (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run_clients(hook: Path, n: int, seconds: float, agent_pid: int = 0) -> Tuple[float, float, Counter, float]:
    """``(pairs/s, median pair seconds, failures, CPU seconds per pair)`` of ``n`` clients for ``seconds``.
    The CPU: the hook runs' (this process's reaped children) and the agent's (``agent_pid``; its own and
    its reaped children's); a vGPU remove's detached writer is a child of the process that removes (the
    agent, or the one-shot hook run) and reaped by it, so its CPU counts on either path (before 2026-12-07
    04:00 it was a grandchild that init reaped, counted on neither)."""
    cpu0 = _children_cpu() + (_process_cpu(agent_pid) if agent_pid else 0.0)
    t0 = time.perf_counter()
    pairs, failed, _stop, threads = _hook_clients(hook, n, seconds)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu = _children_cpu() + (_process_cpu(agent_pid) if agent_pid else 0.0) - cpu0
    return (len(pairs) / wall, statistics.median(pairs) if pairs else float("nan"), failed,
            cpu / len(pairs) if pairs else float("nan"))


def _sigterm(agent: subprocess.Popen) -> Tuple[Optional[int], float]:
    """SIGTERM to the agent: ``(its exit status or None when it outlived 60 s, seconds until it exited)``."""
    t0 = time.perf_counter()
    agent.send_signal(signal.SIGTERM)
    try:
        rc = agent.wait(60)
    except subprocess.TimeoutExpired:
        rc = None
    return rc, time.perf_counter() - t0


def _agent_doc(sock: str) -> Dict:
    raw = _request_raw(sock, b"GET /v1/agent HTTP/1.1\r\nHost: x\r\n\r\n")
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def _request_raw(path: str, data: bytes, timeout: float = 60) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(data)
        return _read_answer(s)[0]
    finally:
        s.close()


def worker_capacity(path: str, seconds: float, n: int) -> int:
    """``n`` threads asking ``GET /v1/capacity`` for ``seconds``; prints ``{"ok": [seconds...], "other": {status: n}}``."""
    until = time.monotonic() + seconds
    lat: List[float] = []
    other: Counter = Counter()
    lock = threading.Lock()
    req = b"GET /v1/capacity HTTP/1.1\r\nHost: x\r\n\r\n"

    def loop():
        while time.monotonic() < until:
            t0 = time.perf_counter()
            try:
                raw = _request_raw(path, req, timeout=30)
                status = raw.split(b"\r\n", 1)[0].split()[1].decode()
            except (OSError, IndexError) as e:
                status = type(e).__name__
            dt = time.perf_counter() - t0
            with lock:
                if status == "200":
                    lat.append(dt)
                else:
                    other[status] += 1
    threads = [threading.Thread(target=loop) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"ok": lat, "other": dict(other), "seconds": seconds}))
    return 0


def run_scale(base: Path, gpus: int, clients: List[int], seconds: float, storm: int, storm_seconds: float,
              capacity_clients: int) -> None:
    host, hook = _scale_host(base, gpus)
    sock = str(host.path("run", "vgpuhost", "agent.sock"))
    rows = {}
    for n in clients:
        print(f"bench: one-shot path (agent down), {n} client(s) ...", file=sys.stderr)
        rows[("down", n)] = _run_clients(hook, n, seconds)
    agent = _start_agent(host, ["--metering-interval", "0"])
    try:
        _run_clients(hook, 1, 2.0)                      # warm: the snapshot, the page cache
        for n in clients:
            print(f"bench: agent up, {n} client(s) ...", file=sys.stderr)
            rows[("up", n)] = _run_clients(hook, n, seconds, agent.pid)
        # capacity from 8 clients, and the one-shot CLI's
        print(f"bench: GET /v1/capacity from {capacity_clients} clients ...", file=sys.stderr)
        p = subprocess.run([sys.executable, "-I", str(Path(__file__).resolve()), "--worker", "capacity", sock,
                            str(seconds), str(capacity_clients)], capture_output=True, text=True, cwd="/")
        cap = json.loads(p.stdout.strip().splitlines()[-1])
        cli = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "vgpuhost", "--root", str(host.root), "--local", "--json",
                            "capacity"], capture_output=True, check=True, cwd=str(REPO))
            cli.append(time.perf_counter() - t0)
        # the storm, then SIGTERM while it runs
        print(f"bench: {storm} clients for {storm_seconds:g} s ...", file=sys.stderr)
        served0 = _agent_doc(sock)["served"]
        pairs, failed, stop, threads = _hook_clients(hook, storm, storm_seconds, first=1000)
        for t in threads:
            t.join()
        served1 = _agent_doc(sock)
        calls = 2 * len(pairs) + sum(failed.values())
        by_agent = sum(served1["served"].get(k, 0) - served0.get(k, 0)
                       for k in ("POST /v1/hook/prepare", "POST /v1/hook/release"))
        pairs2, _f2, stop, threads = _hook_clients(hook, storm, 600.0, first=2000)
        time.sleep(5.0)
        rc, stop_s = _sigterm(agent)
        stop.set()
        for t in threads:
            t.join(180)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    print(f"hook prepare begin + release end, {gpus} x A40 ({SCALE_PROFILE}), {seconds:g} s per figure:")
    print(f"  {'clients':>7}  {'one-shot pairs/s':>16}  {'agent pairs/s':>13}  {'ratio':>5}  "
          f"{'one-shot median':>15}  {'agent median':>12}  {'CPU/pair one-shot':>17}  {'agent':>6}  {'ratio':>5}  "
          f"failures (one-shot/agent)")
    for n in clients:
        d, u = rows[("down", n)], rows[("up", n)]
        print(f"  {n:7d}  {d[0]:16.1f}  {u[0]:13.1f}  {u[0] / d[0]:5.2f}  {d[1] * 1000:13.0f}ms  "
              f"{u[1] * 1000:10.0f}ms  {d[3] * 1000:15.0f}ms  {u[3] * 1000:4.0f}ms  {d[3] / u[3]:5.2f}  "
              f"{sum(d[2].values())}/{sum(u[2].values())}")
        for k, v in list(d[2].items())[:3] + list(u[2].items())[:3]:
            print(f"           {v} x {k}")
    ok = sorted(cap["ok"])
    rate = len(ok) / cap["seconds"]
    p50 = ok[len(ok) // 2] * 1000 if ok else float("nan")
    p99 = ok[min(len(ok) - 1, int(len(ok) * 0.99))] * 1000 if ok else float("nan")
    print(f"GET /v1/capacity, {capacity_clients} clients: {rate:.0f} requests/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms "
          f"(targets >= 300/s, p99 <= 50 ms); other answers: {cap['other'] or 'none'}; "
          f"one-shot 'vgpuhost --local --json capacity': {statistics.median(cli) * 1000:.0f} ms a call")
    print(f"storm: {storm} clients for {storm_seconds:g} s: {len(pairs)} pairs ({len(pairs) / storm_seconds:.1f}/s), "
          f"failed hook runs {sum(failed.values())} (target 0); hook calls {calls}, answered by the agent "
          f"{by_agent}, by the hook's own handler after a 429 or no slot {calls - by_agent}")
    for k, v in list(failed.items())[:5]:
        print(f"           {v} x {k}")
    print(f"  snapshot: {served1['snapshot_scans']} whole-host scans, {served1.get('snapshot_refreshes', '-')} GPU "
          f"refreshes, {served1.get('cached_answers', '-')} cached answers")
    print(f"  SIGTERM with {storm} clients running: agent exited {rc} after {stop_s:.2f} s (target <= 5 s)")


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["--worker", "capacity"]:
        return worker_capacity(argv[2], float(argv[3]), int(argv[4]))
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1], argv[2], float(argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["load", "scrape", "both", "scale"], default="both")
    ap.add_argument("--gpus", type=int, default=8, help="scale: A40s on the simulated host (default 8)")
    ap.add_argument("--clients", default="1,8", help="scale: hook client counts, comma-separated (default 1,8)")
    ap.add_argument("--seconds-per", type=float, default=15.0, help="scale: seconds per figure (default 15)")
    ap.add_argument("--storm", type=int, default=64, help="scale: clients of the storm (default 64)")
    ap.add_argument("--storm-seconds", type=float, default=60.0, help="scale: the storm's seconds (default 60)")
    ap.add_argument("--capacity-clients", type=int, default=8, help="scale: GET /v1/capacity clients (default 8)")
    ap.add_argument("--runs", type=int, default=5, help="hook prepare+release cycles per phase and round (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of idle, readers, all (default 3)")
    ap.add_argument("--seconds", type=float, default=30.0, help="scrape storm length (default 30)")
    ap.add_argument("--scrapers", type=int, default=50, help="parallel scrapers (default 50)")
    ap.add_argument("--tmpdir", metavar="DIR", help="where the simulated hosts go (default: the system temp dir)")
    args = ap.parse_args(argv)
    from benchutil import precompile
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root (the hostile clients drop to a throwaway uid)")
    precompile(REPO / "vgpuhost")
    with tempfile.TemporaryDirectory(prefix="vgh-load-", dir=args.tmpdir) as tmp:
        os.chmod(tmp, 0o755)                        # the hostile uid reaches the sockets under it
        base = Path(tmp)
        try:
            if args.mode == "scale":
                run_scale(base, args.gpus, [int(c) for c in args.clients.split(",")], args.seconds_per,
                          args.storm, args.storm_seconds, args.capacity_clients)
            if args.mode in ("load", "both"):
                run_load(base, max(3, args.runs), max(1, args.rounds))
            if args.mode in ("scrape", "both"):
                run_scrape(base, args.seconds, args.scrapers)
        finally:
            for p in _STARTED:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
