"""``vgpuhost agent``: JSON over HTTP/1.1 on three unix sockets, roles from SO_PEERCRED.

Owns: the listening sockets (bound here, or passed by systemd socket
activation: ``LISTEN_FDS`` with ``LISTEN_FDNAMES`` ``admin``, ``ro`` and ``tenant``),
HTTP parsing (stdlib :mod:`http.server`, the headers read by :func:`read_headers`; each connection
served on a worker thread, :class:`_Workers`), the
role of each caller, body limits, and turning results and errors into
responses.  Must not: decide anything about devices (``api.py`` calls the
ops).

Sockets and roles:

- the **admin** socket (default ``<root>/run/vgpuhost/agent.sock``, mode
  0660, group ``vgpuhost``) serves root and members of the admin group
  with every endpoint;
- the **read-only** socket (``agent-ro.sock``, mode 0660, group
  ``vgpuhost-ro``) serves root and members of either group with the read
  endpoints only (and a tenant member, if the mode lets it in, with its
  tenant's reads only);
- the **tenant** socket (``agent-tenant.sock``, mode 0666) lets anyone
  connect: the role is decided by the credentials alone.

Roles (:class:`Access`): ``admin`` (root, a member of the admin group),
``read`` (the read-only group), ``tenant`` (a group mapped to a tenant:
``--tenant-group GROUP=TENANT``, or a group named ``<prefix><tenant>``,
default prefix ``vgpuhost-t-``), tried in that order.  The file modes keep
others out of the admin and read-only sockets; the agent checks again with
the peer's credentials (``SO_PEERCRED`` and ``SO_PEERGROUPS``,
:func:`vgpuhost.io.unixsock.peer`), so a socket whose mode was loosened
still refuses them (403).  The role is decided as the connection is accepted
(:meth:`_Server.process_request`): a peer of no role is answered 403 there and
closed once its peer is done, its request never parsed, before it is given a slot or a thread.

Responses: ``200`` with the endpoint's document; errors as one
``vgpuhost.agent-error/v1`` document carrying the CLI's exit code:
400 input (a malformed request line or header too, HTTP/0.9 included, at
once; a query parameter given twice), 403 role, 404 path (or a bill not issued), 405 method, 408 a request that did not arrive in
time, 409 refused, 411/413 body, 429 too many connections or expensive
reads (``Retry-After``), 500 device failed (``exit_code`` 3) or internal
(4), 503 unavailable.

Connections: each socket serves at most ``max_connections`` (default
:data:`MAX_CONNECTIONS`) at once, each on a worker thread while served; a caller (uid; root
excepted) holds a quarter of them at most, a tenant's members together a quarter, callers other
than root three quarters (a quarter kept for root); one more is answered 429 from the accepting
thread and closed (:meth:`_Server.process_request`).  A connection's slot is given back just
before its answer's last byte is sent.  Only a peer with a role takes a slot (a peer of no role:
403 at accept, above, from a cache of answers).  The listen backlog is :data:`BACKLOG`.  A request must
arrive within ``request_timeout_s`` (:data:`REQUEST_TIMEOUT_S`) of its
connection, with no gap over ``read_timeout_s`` (:data:`READ_TIMEOUT_S`):
else 408, closed.

Work bounded before parsing (413): per-route body sizes (:func:`body_limit`),
JSON items (:func:`json_items`), a layout config's size and items
(:func:`config_refusal`).  Expensive reads (:data:`EXPENSIVE_READS`): per
caller, a concurrency limit and a CPU budget (:class:`ReadBudget`; 429).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
import os
import queue
import select
import selectors
import signal
import socket
import sys
import socketserver
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler
from typing import Any, Dict, List, NamedTuple, Optional, Tuple
from urllib.parse import parse_qsl, unquote, urlsplit

from .. import __version__
from ..hook.runtime import agent_error_line
from ..io import unixsock
from ..io.connlimits import DeadlineReader as _DeadlineReader, RefusalLog, answer_and_close
from ..io.hostroot import HostRoot
from ..io.state import store_error
from ..libvirt.domxml import parse_domain, parse_domain_identity, valid_key
from ..model.errors import (EXIT_DEVICE, EXIT_INPUT, HostEnvironmentError, InputError, RefusedError, TransientError,
                             VgpuhostError)
from ..ops import recover
from ..ops.vgpu import reconcile
from ..policy.config import MAX_ENTRIES
from . import api
from .metrics import AgentMetering
from .rebalance import start as start_rebalancer

log = logging.getLogger("vgpuhost.agent")

ADMIN_SOCKET = "agent.sock"
RO_SOCKET = "agent-ro.sock"
TENANT_SOCKET = "agent-tenant.sock"
DEFAULT_ADMIN_GROUP = "vgpuhost"
DEFAULT_RO_GROUP = "vgpuhost-ro"
#: a group named PREFIX + TENANT makes its members members of TENANT (``--tenant-group-prefix``)
DEFAULT_TENANT_PREFIX = "vgpuhost-t-"
SOCKET_MODE = 0o660
#: the tenant socket: anyone may connect, the credentials decide (tenant groups are many and change)
TENANT_SOCKET_MODE = 0o666
#: seconds a group's name read from the group database serves at most (sooner when /etc/group changes)
GROUP_NAME_TTL_S = 60.0
#: the largest request body: the hook's (a domain XML of 4 MiB, JSON-escaped)
MAX_BODY = 12 * 1024 * 1024
#: the largest body of ``POST /v1/plan``, ``/v1/assert`` and ``/v1/apply`` (a layout config, JSON-escaped)
MAX_LAYOUT_BODY = 128 * 1024
#: the largest body of every other POST (a few keys)
MAX_SMALL_BODY = 64 * 1024
#: the largest layout config text (``config``): the largest example is 2 KiB, 256 entries about 25 KiB
MAX_CONFIG_BYTES = 64 * 1024
#: the most items a JSON body (other than the hook's) or a layout config may hold, counted before either
#: is parsed: JSON ``,`` ``{`` ``[``; a config's lines plus those (an upper bound of its YAML nodes)
MAX_JSON_ITEMS = 4096
MAX_CONFIG_ITEMS = 4096
#: a refused body up to this size is read and dropped after the answer (so its client reads the 413)
MAX_DRAIN = 16 * 1024 * 1024
EXIT_INTERNAL = 4
#: connections one socket serves at once (each on a worker thread); more are answered 429 and closed
MAX_CONNECTIONS = 64
#: seconds a connection may send nothing while its request (line, headers, body) is read
READ_TIMEOUT_S = 10.0
#: seconds a connection may take to send its whole request (line, headers and body), however it paces it
REQUEST_TIMEOUT_S = 30.0
#: the listen backlog of a socket the agent binds: connections beyond the served ones wait in it and are
#: answered (429 when every slot is taken), never refused by the kernel (EAGAIN) while it has room
BACKLOG = socket.SOMAXCONN
#: the nice value of the threads that serve the read-only and the tenant sockets (0: as the agent's)
READ_NICE = 10
#: the interpreter's thread switch interval in the agent (``sys.setswitchinterval``; Python's default is 5 ms):
#: a hook's prepare, which waits on many small reads and writes, retakes the interpreter from a busy
#: reader's thread after at most this long, instead of 5 ms each time
SWITCH_INTERVAL_S = 0.0005
#: seconds a worker thread left idle waits for the next connection before it ends (:class:`_Workers`)
WORKER_IDLE_S = 30.0
#: seconds an expensive read over its caller's limit waits before its 429 (at most its Retry-After)
REFUSAL_DELAY_S = 1.0
#: seconds a stopping agent waits for a change in progress (a hook's prepare) to end, counted from SIGTERM:
#: with the main thread's poll (:data:`SIGNAL_POLL_S`; the accept loops wake at once, :meth:`_Server.shutdown`)
#: the agent is gone within 5 s of SIGTERM under any load
STOP_WAIT_S = 4.0
#: seconds between two log lines about connections refused for want of a slot (a storm is one line)
REFUSAL_LOG_S = 10.0
#: the expensive reads: each peer (uid) runs at most :data:`EXPENSIVE_PER_PEER` of them at once and
#: spends at most its CPU budget on them (:class:`ReadBudget`); more are answered 429 with Retry-After
EXPENSIVE_READS = frozenset({("GET", "/v1/inventory"), ("GET", "/v1/types"), ("GET", "/v1/capacity"),
                             ("GET", "/v1/audit"), ("GET", "/v1/metrics"), ("POST", "/v1/plan"),
                             ("POST", "/v1/assert"), ("GET", "/v1/usage/hourly"), ("GET", "/v1/bill")})
EXPENSIVE_PER_PEER = 2
#: a peer's CPU budget for expensive reads: a burst of this many CPU seconds ...
BUDGET_BURST_S = 1.0
#: ... refilled at this many CPU seconds per second (a fifth of one core)
BUDGET_RATE = 0.2


class ReadBudget:
    """The expensive reads' limits per peer (its uid, ``SO_PEERCRED``), shared by the agent's sockets.

    A peer runs at most ``per_peer`` expensive reads (:data:`EXPENSIVE_READS`) at once, and spends
    at most its CPU budget on them: a bucket of ``burst_s`` CPU seconds, refilled at ``rate`` CPU
    seconds per second, from which each read's thread CPU time is taken when it ends (a bucket may go
    below zero: the peer's next read is refused until it is refilled to zero).  ``refused`` counts the reads refused.
    """

    def __init__(self, per_peer: int = EXPENSIVE_PER_PEER, burst_s: float = BUDGET_BURST_S,
                 rate: float = BUDGET_RATE, clock=time.monotonic):
        self.per_peer, self.burst_s, self.rate, self.clock = per_peer, burst_s, rate, clock
        self._lock = threading.Lock()
        self._running: Dict[int, int] = {}
        self._bucket: Dict[int, Tuple[float, float]] = {}      # uid -> (CPU seconds left, when)
        self.refused = 0

    def _left(self, uid: int, now: float) -> float:
        left, at = self._bucket.get(uid, (self.burst_s, now))
        return min(self.burst_s, left + (now - at) * self.rate)

    def begin(self, uid: int) -> Optional[Tuple[str, int]]:
        """None when ``uid`` may run one more expensive read now (call :meth:`end` after it), else
        ``(why, retry_after_s)``: the one line of the 429 and its ``Retry-After`` (whole seconds >= 1)."""
        with self._lock:
            now = self.clock()
            left = self._left(uid, now)
            self._bucket[uid] = (left, now)
            running = self._running.get(uid, 0)
            if running >= self.per_peer:
                self.refused += 1
                return (f"uid {uid} already runs {running} expensive reads (inventory, types, capacity, "
                        f"audit, metrics, plan, assert) at once, the most one caller may", 1)
            if left < 0:
                self.refused += 1
                return (f"uid {uid} has spent its CPU budget for expensive reads ({self.burst_s:g} CPU s, "
                        f"renewed at {self.rate:g} CPU s per second)", max(1, math.ceil(-left / self.rate)))
            self._running[uid] = running + 1
            return None

    def end(self, uid: int, cpu_s: float) -> None:
        """One expensive read of ``uid`` ended after ``cpu_s`` CPU seconds of its thread."""
        with self._lock:
            now = self.clock()
            self._bucket[uid] = (self._left(uid, now) - max(0.0, cpu_s), now)
            n = self._running.get(uid, 1) - 1
            if n > 0:
                self._running[uid] = n
            else:
                self._running.pop(uid, None)


def _nice_this_thread(nice: int) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread's nice value is its own, ``setpriority(2)``
    on its thread id): the read-only socket's threads yield the CPU to the hook's and the admin's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass


def default_socket_dir(host: HostRoot):
    """``<root>/run/vgpuhost``: where the agent listens and the hook and CLI look for it."""
    return host.path("run", "vgpuhost")


class _Workers:
    """The threads that serve one socket's connections.  A connection goes to an idle worker when one
    waits (a queue hand-off, about 10 us of CPU), else to a new thread (about 140 us, measured 2026-12-07);
    at most as many serve requests as the socket has slots (:meth:`_Server.process_request` counts them; a
    worker that has given its slot back may still be sending its answer's last byte, closing, or refreshing
    the snapshot), and one left idle for :data:`WORKER_IDLE_S` ends.  ``nice``: each worker's nice value
    (:func:`_nice_this_thread`), set once as it starts; ``serve(request, client)`` serves one connection
    (``client``: what :meth:`submit` was given with it, a :class:`_Client` for the agent's sockets)."""

    def __init__(self, serve, name: str, nice: int = 0, idle_s: Optional[float] = None):
        self._serve, self.name, self.nice = serve, name, nice
        self.idle_s = WORKER_IDLE_S if idle_s is None else idle_s
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0              # workers waiting for a connection that none has been handed to yet
        self._closed = False
        self.started = 0            # worker threads started so far

    def submit(self, request, client) -> None:
        """Serve ``request`` (a connection of peer ``client``) on an idle worker, else on a new one.  Raises
        what :meth:`threading.Thread.start` raises (no thread could be had)."""
        with self._lock:
            if self._idle > 0:
                self._idle -= 1     # spoken for: the item is in the queue before any waiter can give up
                self._jobs.put((request, client))
                return
            self.started += 1
            n = self.started
        threading.Thread(target=self._run, args=((request, client),), name=f"{self.name}-{n}", daemon=True).start()

    def _run(self, job) -> None:
        if self.nice:
            _nice_this_thread(self.nice)
        while job is not None:
            self._serve(*job)
            job = None
            with self._lock:
                if self._closed:
                    return
                self._idle += 1
            while True:
                try:
                    job = self._jobs.get(timeout=self.idle_s)
                    break
                except queue.Empty:
                    with self._lock:
                        # a connection handed over (under this lock) after the wait ended: take it
                        if self._jobs.empty():
                            self._idle -= 1
                            return

    def close(self) -> None:
        """End the idle workers now (busy ones end when their connection is served)."""
        with self._lock:
            self._closed = True
            n, self._idle = self._idle, 0
            for _ in range(n):
                self._jobs.put(None)


class _Server(socketserver.UnixStreamServer):
    """One listening socket (bound elsewhere) and its role; each connection served on a worker thread
    (:class:`_Workers`)."""

    def __init__(self, sock, role: str, agent: api.Agent, admin_gid: int, ro_gid: int,
                 admin_group: str = DEFAULT_ADMIN_GROUP, ro_group: str = DEFAULT_RO_GROUP, *,
                 max_connections: int = MAX_CONNECTIONS, read_timeout_s: float = READ_TIMEOUT_S,
                 access: Optional["Access"] = None, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 budget: Optional[ReadBudget] = None):
        socketserver.BaseServer.__init__(self, "", _Handler)
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.request_timeout_s = request_timeout_s
        self.budget = budget if budget is not None else ReadBudget()
        self.refusal_delay_s = REFUSAL_DELAY_S
        self.refused = 0                        # connections answered 429 (no slot free)
        self.forbidden = 0                      # connections answered 403 at accept (a peer of no role)
        self.per_peer_connections = max(1, max_connections // 4)
        self.per_tenant_connections = self.per_peer_connections
        self.root_room = max_connections // 4
        self._peer_lock = threading.Lock()
        self._peer_held: Dict[int, int] = {}    # uid -> connections it holds on this socket
        self._tenant_held: Dict[str, int] = {}  # tenant (lower case) -> connections its members hold
        self._others_held = 0                   # connections held by callers other than root
        self._slots = threading.BoundedSemaphore(max_connections)
        self.socket = sock
        self.server_address = unixsock.socket_path(sock)
        self._refusals = RefusalLog(log, self.server_address, REFUSAL_LOG_S)   # a storm is one line
        self.role = role
        self.agent = agent
        self.admin_gid = admin_gid
        self.ro_gid = ro_gid
        self.admin_group = admin_group      # as the operator named them (--admin-group, --ro-group)
        self.ro_group = ro_group
        self.access = access if access is not None else Access(admin_gid, ro_gid)
        self.workers = _Workers(self.process_request_thread, f"agent-{role}",
                                READ_NICE if role in (api.READ, api.TENANT) else 0)
        self._wake_r, self._wake_w = socket.socketpair()        # shutdown() wakes the accept loop
        self._wake_w.setblocking(False)
        self._stop = False
        self._stopped = threading.Event()

    def serve_forever(self, poll_interval: Optional[float] = None) -> None:
        """Accept connections until :meth:`shutdown`, blocked in ``poll(2)`` on the listening socket and a
        wake-up socket pair: an idle agent's accept loops never wake (``socketserver``'s woke every
        ``poll_interval`` to look for a stop, 30 times a second for the three sockets).  ``poll_interval``
        is not used."""
        self._stopped.clear()
        try:
            with selectors.PollSelector() as sel:
                sel.register(self.socket, selectors.EVENT_READ)
                sel.register(self._wake_r, selectors.EVENT_READ)
                listening = self.socket.fileno()
                while not self._stop:
                    ready = sel.select()
                    if self._stop:
                        break
                    if any(key.fd == listening for key, _ in ready):
                        self._handle_request_noblock()
        finally:
            self._stop = False
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait until it has returned (it must have been started)."""
        self._stop = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass                    # full (woken already) or closed
        self._stopped.wait()

    def process_request(self, request, client_address) -> None:
        """Decide the peer's role from its credentials (``SO_PEERCRED``, ``SO_PEERGROUPS``: the kernel's,
        known at accept) and serve the connection on a worker thread while it is within every share of
        this socket's ``max_connections`` slots:

        - its peer (uid; root is not limited) holds fewer than ``per_peer_connections`` (a quarter);
        - a tenant member's tenant (the one its groups map to, :meth:`Access.caller`) holds fewer than
          ``per_tenant_connections`` with all its members' connections together: the same quarter, so a
          tenant whose members connect as one uid notices nothing, and one tenant with many uids (one per
          VM controller) still cannot shut the other tenants out (trial 8 R2: four uids of one tenant with 16
          slow connections each took all 64 slots of the tenant socket);
        - callers other than root hold fewer than ``max_connections - root_room`` together: root (the qemu
          hook on the admin socket, the operator) keeps a quarter of the slots that only it may take;
        - a slot is free.

        Answered from the accepting thread and closed, with no slot, no thread and no HTTP parsing: a peer
        of no role, 403 (:meth:`_forbid`, its request never parsed); a peer with a role over a share, 429 whose
        one line names the share."""
        try:
            peer = unixsock.peer(request)
        except OSError:
            self.shutdown_request(request)
            return
        who, why = self.access.caller(peer)
        if who is None:
            self._forbid(request, peer, why)
            return
        uid = peer.uid
        tenant = who.tenant.lower() if who.role == api.TENANT and who.tenant else None
        with self._peer_lock:
            held = self._peer_held.get(uid, 0)
            if uid != 0 and held >= self.per_peer_connections:
                why = (f"uid {uid} already holds {held} of this socket's connections, the most one caller may",
                       "close connections you hold open")
            elif tenant is not None and self._tenant_held.get(tenant, 0) >= self.per_tenant_connections:
                why = (f"the members of tenant {who.tenant!r} already hold {self._tenant_held[tenant]} of this "
                       "socket's connections, the most one tenant may (its share)",
                       "close connections your tenant's members hold open")
            elif uid != 0 and self._others_held >= self.max_connections - self.root_room:
                why = (f"callers other than root hold {self._others_held} of this socket's "
                       f"{self.max_connections} connections, all but the {self.root_room} kept for root",
                       "retry shortly; close connections you hold open")
            elif not self._slots.acquire(blocking=False):
                why = (f"the agent serves at most {self.max_connections} connections at once on this socket, "
                       "all open", "retry shortly; close connections you hold open")
            else:
                self._peer_held[uid] = held + 1
                if tenant is not None:
                    self._tenant_held[tenant] = self._tenant_held.get(tenant, 0) + 1
                if uid != 0:
                    self._others_held += 1
                why = None
        if why is not None:
            self._refuse(request, *why)
            return
        slot = _Slot(self, uid, tenant)
        try:
            self.workers.submit(request, _Client(uid, peer, who, slot))
        except BaseException:
            slot.release()
            raise

    def _release(self, uid: int, tenant: Optional[str]) -> None:
        """Give back a slot taken by :meth:`process_request` (call it through :class:`_Slot`, once)."""
        with self._peer_lock:
            n = self._peer_held.get(uid, 1) - 1
            if n > 0:
                self._peer_held[uid] = n
            else:
                self._peer_held.pop(uid, None)
            if tenant is not None:
                n = self._tenant_held.get(tenant, 1) - 1
                if n > 0:
                    self._tenant_held[tenant] = n
                else:
                    self._tenant_held.pop(tenant, None)
            if uid != 0:
                self._others_held -= 1
        self._slots.release()

    def process_request_thread(self, request, client: "_Client") -> None:
        """Serve one connection (on a worker thread; ``client``: its peer and role, decided at accept):
        answered (its slot given back just before the answer's last byte is sent, :meth:`_Handler._final`;
        else before the connection is closed), closed, then the snapshot refreshed when the answer's write
        left it due."""
        try:
            try:
                self.finish_request(request, client)
            except Exception:
                self.handle_error(request, client)
            finally:
                if client.slot is not None:
                    # given back already just before the answer's last byte, as a rule; else (an answer
                    # with a refused body dropped after it, none at all) before the close its client sees
                    client.slot.release()
        finally:
            self.shutdown_request(request)              # answered, and closed
        # the answer is out and the slot free: bring the snapshot up to date after a write now (the GPUs
        # the write touched; one thread reads while the others' refreshes coalesce into its read), not
        # at the next VM start
        self.agent.warm_up()

    def server_close(self) -> None:
        super().server_close()
        self.workers.close()
        self._wake_r.close()
        self._wake_w.close()

    def _refuse(self, request, message: str, hint: str) -> None:
        """Answer 429 (no slot for this peer) at accept, and close."""
        self.refused += 1
        self._refusals.note(message)                    # one line per interval, not one per connection
        self._answer_at_accept(request, _refusal(message, hint))

    def _forbid(self, request, peer: unixsock.Peer, why: str) -> None:
        """Answer 403 to a peer of no role at accept, and close once the peer is done: its request is not
        parsed (HTTP lets a server answer before the request is complete), only read and dropped by the
        one thread that closes answered connections (:class:`vgpuhost.io.connlimits.Lingerer`), so the
        peer may send it after the answer came (curl does) and still read the answer; it holds no slot, no
        worker thread and no header buffer, however it paces its bytes."""
        self.forbidden += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("refused uid %d pid %d on %s: %s", peer.uid, peer.pid, self.server_address, why)
        self._answer_at_accept(request, _forbidden(peer.uid, why, self.ro_group, self.admin_group))

    def _answer_at_accept(self, request, answer: bytes) -> None:
        """Send ``answer`` (a whole HTTP answer) on a connection not handed to a worker, shut its writing
        side, and close it once its peer closes, has sent 1 MiB, or after 1 s, what it sent dropped
        (:func:`vgpuhost.io.connlimits.answer_and_close`, shared with the metrics port)."""
        answer_and_close(request, answer)


@functools.lru_cache(maxsize=64)
def _refusal(message: str, hint: str) -> bytes:
    """The whole 429 answer to a connection refused at accept (a storm's answers are a handful of texts)."""
    return _early_answer(429, error_doc(429, message, hint=hint, exit_code=5, kind="TransientError"))


@functools.lru_cache(maxsize=256)
def _forbidden(uid: int, why: str, ro_group: str, admin_group: str) -> bytes:
    """The whole 403 answer to a peer of no role, refused at accept (:func:`no_role_doc`): built once per
    uid and reason (a connect flood from one uid is answered from this cache: trial 8 R7)."""
    return _early_answer(403, no_role_doc(uid, why, ro_group, admin_group))


def _early_answer(status: int, doc: Dict[str, Any]) -> bytes:
    """The whole answer (status line, ``Content-Type``, ``Content-Length``, ``Connection: close``, the
    error document) to a connection answered at accept, before its request is read."""
    body = (json.dumps(doc, indent=2) + "\n").encode()
    reason = BaseHTTPRequestHandler.responses[status][0]
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("ascii")
    return head + body


class _Slot:
    """A connection's slot on its socket (and its counts: its uid's, its tenant's, callers other than
    root), given back once: :meth:`release` may be called again, and then does nothing.  Used by the
    connection's worker thread only."""

    __slots__ = ("_server", "_uid", "_tenant", "held")

    def __init__(self, server: "_Server", uid: int, tenant: Optional[str]):
        self._server, self._uid, self._tenant, self.held = server, uid, tenant, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._server._release(self._uid, self._tenant)


class _Client(NamedTuple):
    """A connection's peer as decided at accept (the handler's ``client_address``): ``uid`` (the slot's
    owner), ``peer`` (its credentials), ``caller`` (its role) and ``slot`` (given back before the answer's
    last byte)."""

    uid: int
    peer: unixsock.Peer
    caller: "Caller"
    slot: Optional[_Slot] = None


def group_words(group: str) -> str:
    """A group as a hint names it: ``the NAME group``, or ``the group of gid N`` for a group given as a gid
    (``--admin-group 0``: "the 0 group" reads as no group at all)."""
    return f"the group of gid {group}" if group.isascii() and group.isdigit() else f"the {group} group"


def no_role_doc(uid: int, why: str, ro_group: str, admin_group: str) -> Dict[str, Any]:
    """The 403 document for a peer (``uid``) of no role (``why``: :meth:`Access.caller`'s reason)."""
    return error_doc(403, f"uid {uid} is not allowed to use the vgpuhost agent: {why}",
                     hint=f"ask for membership of {group_words(ro_group)} (read) or {group_words(admin_group)} "
                          "(admin), or of one tenant's group", kind="RefusedError")


class Caller(NamedTuple):
    """Who a peer is to the agent: ``role`` (:data:`api.ROLES`) and ``tenant`` (the tenant a tenant
    member belongs to; None for the other roles)."""

    role: str
    tenant: Optional[str] = None


class Access:
    """The agent's roles for a peer's credentials: ``admin_gid``, ``ro_gid``, ``tenant_gids`` (``{gid:
    tenant}``, from ``--tenant-group``) and ``prefix`` (a group named ``prefix + TENANT`` maps to TENANT;
    empty: no naming convention).  Group names are read from the group database
    (:func:`vgpuhost.io.unixsock.group_name`) and kept until ``/etc/group`` changes
    (:func:`vgpuhost.io.unixsock.group_db_stamp`, one ``stat`` per call that needs a name: a group added,
    renamed or removed counts from the next call on), and at most :data:`GROUP_NAME_TTL_S` seconds (for
    groups from another source of the name service, LDAP or sssd, which the file does not show)."""

    def __init__(self, admin_gid: int, ro_gid: int, tenant_gids: Optional[Dict[int, str]] = None,
                 prefix: str = DEFAULT_TENANT_PREFIX):
        self.admin_gid, self.ro_gid = admin_gid, ro_gid
        self.tenant_gids = dict(tenant_gids or {})
        self.prefix = prefix
        self._names: Dict[int, Tuple[float, Optional[str]]] = {}
        self._stamp: Optional[tuple] = None         # /etc/group as it was when _names was read
        self._lock = threading.Lock()

    def _name(self, gid: int, stamp: Optional[tuple]) -> Optional[str]:
        now = time.monotonic()
        with self._lock:
            if stamp != self._stamp:                # the group file changed (or is gone): read names again
                self._names.clear()
                self._stamp = stamp
            hit = self._names.get(gid)
            if hit is not None and now - hit[0] < GROUP_NAME_TTL_S:
                return hit[1]
        name = unixsock.group_name(gid)
        with self._lock:
            if stamp == self._stamp:
                self._names[gid] = (now, name)
        return name

    def tenants_of(self, groups) -> List[str]:
        """The tenants ``groups`` (gids) map to, sorted, each once (names compared in any case)."""
        found: Dict[str, str] = {}
        stamp: Any = ()         # () : not read yet (read once per call, only when a name is needed)
        for gid in sorted(groups):
            tenant = self.tenant_gids.get(gid)
            if tenant is None and self.prefix:
                if stamp == ():
                    stamp = unixsock.group_db_stamp()
                name = self._name(gid, stamp)
                if name and name.startswith(self.prefix) and valid_key(name[len(self.prefix):]):
                    tenant = name[len(self.prefix):]
            if tenant:
                found.setdefault(tenant.lower(), tenant)
        return sorted(found.values(), key=str.lower)

    def caller(self, peer: unixsock.Peer) -> Tuple[Optional[Caller], str]:
        """``(Caller, "")``, or ``(None, why)`` for a peer of no role, or of groups of two tenants (a member
        of two tenants is refused rather than given either: the operator maps it to one)."""
        if peer.uid == 0 or self.admin_gid in peer.groups:
            return Caller(api.ADMIN), ""
        if self.ro_gid in peer.groups:
            return Caller(api.READ), ""
        tenants = self.tenants_of(peer.groups - {self.admin_gid, self.ro_gid})
        if len(tenants) == 1:
            return Caller(api.TENANT, tenants[0]), ""
        if tenants:
            return None, "its groups map to more than one tenant (" + ", ".join(tenants) + ")"
        return None, "it is in no group of the agent's"


def socket_role(caller: Caller, socket_role_: str) -> Caller:
    """The caller's role on a socket of ``socket_role_``: the read-only socket serves no change (an admin
    reads there; a tenant member reads its tenant's data); the admin and tenant sockets serve the caller's
    own role."""
    if socket_role_ == api.READ and caller.role == api.ADMIN:
        return Caller(api.READ)
    return caller


def error_doc(status: int, message: str, *, hint: Optional[str] = None, exit_code: int = EXIT_INPUT,
              kind: str = "InputError") -> Dict[str, Any]:
    line = f"{message}; {hint}" if hint else message
    return {"schema": api.SCHEMA_ERROR, "status": status,
            "error": {"type": kind, "message": message, "hint": hint, "exit_code": exit_code, "line": line}}


def store_error_doc(path: str, e: BaseException) -> Dict[str, Any]:
    """The error document (status 503) for a raw SQLite error ``e`` on the store at ``path``, said as what it
    is (:func:`vgpuhost.io.state.store_error`): busy or locked (type ``TransientError``, exit 5: try
    again), read-only, disk full, I/O; only a damaged store (``SQLITE_CORRUPT``/``SQLITE_NOTADB``) asks for
    a backup (type ``StateError``)."""
    err = store_error(path, e)
    return error_doc(503, err.message, hint=err.hint, exit_code=err.exit_code,
                     kind="TransientError" if isinstance(err, TransientError) else "StateError")


def status_of(e: VgpuhostError) -> int:
    if isinstance(e, api.Forbidden):
        return 403
    if isinstance(e, api.NotFound):
        return 404
    if isinstance(e, api.Unavailable):
        return 503
    if isinstance(e, api.Misdirected):
        return 421
    if isinstance(e, RefusedError):
        return 409
    if isinstance(e, HostEnvironmentError):
        return 503
    if isinstance(e, InputError):
        return 400
    return 500 if e.exit_code == EXIT_DEVICE else 400


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = f"vgpuhost-agent/{__version__}"

    def log_message(self, fmt: str, *args) -> None:        # the base class writes to stderr
        if log.isEnabledFor(logging.DEBUG):                 # one per request: formatted only when kept
            log.debug("%s %s", getattr(self, "_peer", None), fmt % args)

    def setup(self) -> None:
        """StreamRequestHandler's, less the socket reader it makes and this one replaces: the request is
        read through a reader that enforces both the gap between bytes and the whole request's deadline (a
        peer sending one byte every few seconds must not hold its slot for ever); answers are written
        unbuffered (``wbufsize`` 0)."""
        self.connection = self.request
        self.connection.settimeout(self.server.read_timeout_s)
        self._reader = _DeadlineReader(self.connection, self.server.read_timeout_s, self.server.request_timeout_s)
        self.rfile = io.BufferedReader(self._reader)
        self.wfile = socketserver._SocketWriter(self.connection)
        self._retry_after: Optional[int] = None
        self._unread = 0        # bytes of a refused body to read and drop after the answer
        self._expect_continue = False   # ``Expect: 100-continue``, not answered yet (:meth:`_read` answers it)

    def handle_one_request(self) -> None:
        """http.server's, except that a request that stops arriving, or arrives too slowly, is answered
        408 (the stdlib closes silently), and every malformed request line is answered at once."""
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline, self.request_version, self.command = "", "", ""
                self.send_error(414, "the request line is over 65536 bytes")
                return
            if not self.raw_requestline:        # closed before it sent anything: nobody to answer
                self.close_connection = True
                return
            if not self.parse_request():
                return
            handler = getattr(self, "do_" + self.command, None)
            if handler is None:
                self.send_error(501, f"unsupported method {self.command!r}")
                return
            handler()
            self.wfile.flush()
        except TimeoutError:
            self.close_connection = True
            if not getattr(self, "request_version", None) or self.request_version == "HTTP/0.9":
                # the request line itself never ended: answer as HTTP/1.1 (the stdlib writes no status
                # line for the HTTP/0.9 it assumes before a request line is parsed)
                self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
            self.send_error(408, self._late())

    def _late(self) -> str:
        """Why the request is answered 408: it took longer than the request deadline, or stopped."""
        if self._reader.expired:
            return (f"the request did not arrive within {self.server.request_timeout_s:g} s (request line, "
                    "headers and body together)")
        return f"the request stopped arriving (nothing for {self.server.read_timeout_s:g} s)"

    def parse_request(self) -> bool:
        """The request line and headers, as :meth:`BaseHTTPRequestHandler.parse_request` reads them (its
        answers to a bad version, 400, or one of 2.0 and later, 505 sent as 400; at most 100 header lines of
        at most 65536 bytes each, else 431; ``Connection``), except that:

        - a request line without an HTTP version (HTTP/0.9) or an empty one is refused at once (the stdlib
          would read headers after the first and close silently on the second);
        - the headers are read by :func:`read_headers` (no :mod:`email` parser: about 0.15 ms of CPU a
          request less), and a header line that is not ``NAME: VALUE`` with NAME a token (the email parser
          took it for the start of the body and dropped the headers after it; a folded line too) is 400;
        - ``Expect: 100-continue`` is only noted here: ``100 Continue`` is sent once the request has passed
          every check made before its body is read (role, route, length, headers), just before the body is
          read (:meth:`_read`); a request refused before that gets its final answer alone."""
        self.command = None
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = requestline.split()
        if not words or (len(words) == 2 and not words[1].startswith("HTTP/")):
            self.command, self.path, self.request_version = "", "", "HTTP/0.9"
            self.requestline = " ".join(words)
            self.send_error(400, "a request line without an HTTP version (HTTP/0.9) is not served" if words
                            else "an empty request line")
            return False
        self.requestline = requestline
        self.request_version = self.default_request_version
        if len(words) != 3:
            self.send_error(400, "Bad request syntax (%r)" % requestline)
            return False
        version = words[-1]
        number = _http_version(version)
        if number is None:
            self.send_error(400, "Bad request version (%r)" % version)
            return False
        if number >= (2, 0):
            self.send_error(505, "Invalid HTTP version (%s)" % version[5:])
            return False
        self.close_connection = number < (1, 1)
        self.request_version = version
        self.command, self.path = words[0], words[1]
        if self.path.startswith("//"):          # as the stdlib (gh-87389): never a scheme-less URI
            self.path = "/" + self.path.lstrip("/")
        try:
            self.headers = read_headers(self.rfile)
        except HeaderError as e:
            self.send_error(e.status, e.text)
            return False
        conntype = self.headers.get("Connection", "").lower()
        if conntype == "close":
            self.close_connection = True
        elif conntype == "keep-alive":
            self.close_connection = False
        self._expect_continue = self.headers.get("Expect", "").lower() == "100-continue" and number >= (1, 1)
        return True

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """What http.server answers itself (a malformed request line or header, an unknown method):
        the agent's error document, with a status line even for an HTTP/0.9 request."""
        if self.request_version == "HTTP/0.9" or not self.request_version:
            self.request_version = "HTTP/1.0"
        self.close_connection = True
        text = message or self.responses.get(code, ("error",))[0]
        text = "".join(c if c.isprintable() else "?" for c in str(text))[:200]
        status = code if code in (400, 405, 408, 413, 414, 431) else 400
        if code == 501:
            status, text = 405, f"{text}: the agent serves GET and POST"
        log.info("refused a request: %d %s", code, text)
        if status == 408:
            doc = error_doc(408, text, hint="send the whole request at once")
        else:
            doc = error_doc(status, f"malformed request: {text}", hint="send an HTTP/1.1 request (GET /v1/openapi "
                                                                      "lists the endpoints)")
        self._send(status, "application/json", (json.dumps(doc, indent=2) + "\n").encode())

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # --- one request ------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        # a change begun in this call owes its answer: a stopping agent waits for it (AgentProcess.stop)
        with self.server.agent.answering():
            self._answer(method)

    def _answer(self, method: str) -> None:
        self.close_connection = True
        self._hook_xml = None
        try:
            status, doc = self._handle(method)
        except Exception as e:      # a bug: one error document, never a traceback on the socket
            log.exception("internal error")
            status, doc = 500, error_doc(500, f"internal error: {type(e).__name__}: {e}",
                                         hint="report it (the agent's journal has the traceback)",
                                         exit_code=EXIT_INTERNAL, kind="InternalError")
        if self._hook_xml is not None and status != 421 and not (status == 503 and self.server.agent.stopping):
            # (421, and 503 from a stopping agent: the JSON error, so the hook's client does the work itself)
            doc = hook_answer(status, doc, self._hook_xml, release=self.path.startswith("/v1/hook/release"))
        if isinstance(doc, api.Stream):
            self._stream(doc)
        elif isinstance(doc, api.Text):
            self._send(status, doc.content_type, doc.body)
        else:
            self._send(status, "application/json", (json.dumps(doc, indent=2) + "\n").encode())
        if self._unread:
            self._drain(self._unread)

    def _drain(self, n: int) -> None:
        """Read and drop the ``n`` bytes of a body refused unread (413), within the request's deadline:
        a unix socket closed with unread data resets the connection, and its client, still sending, would
        see a broken pipe instead of the answer."""
        try:
            while n > 0:
                chunk = self.rfile.read(min(n, 1 << 16))
                if not chunk:
                    return
                n -= len(chunk)
        except (TimeoutError, OSError):
            pass

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        """The whole answer in one write: the status line, ``Server``, ``Date``, ``Content-Type``,
        ``Content-Length``, ``Retry-After`` (a 429 that has one), ``Connection: close``, the body."""
        self.log_request(status)
        self.close_connection = True
        retry = f"Retry-After: {self._retry_after}\r\n" if status == 429 and self._retry_after is not None else ""
        reason = self.responses.get(status, ("",))[0]
        head = (f"{self.protocol_version} {status} {reason}\r\nServer: {self.server_version}\r\n"
                f"Date: {_http_date()}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                f"{retry}Connection: close\r\n\r\n").encode("latin-1")
        try:
            self.connection.settimeout(self.server.read_timeout_s)     # the answer: not the request's deadline
            if len(body) > 1 << 16:
                self.wfile.write(head)          # a large document is not copied to join its head
                self._final(memoryview(body))
            else:
                self._final(head + body)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass

    def _final(self, data) -> None:
        """Write ``data``, the end of the answer, and give the connection's slot back just before its very
        last byte is sent (:class:`_Slot`): a client that has read its whole answer (by its length, or up
        to the close) and connects again at once finds that slot free, never a 429 for a connection it has
        finished with.  The last byte is sent once the socket has room for it (``poll`` ``POLLOUT``: a unix
        socket has then a quarter of its buffer free, so the send cannot block), so a slot given back never
        leaves its thread blocked on a client that does not read; one that reads nothing for
        ``read_timeout_s`` gets no last byte.  A connection with a refused body still to drop after its
        answer (:meth:`_drain`) keeps its slot until that is done.  Raises what the socket's writes raise
        (BrokenPipeError, ConnectionResetError, TimeoutError)."""
        if len(data) > 1:
            self.wfile.write(data[:-1])
        slot = getattr(self.client_address, "slot", None)
        if slot is None or self._unread:
            self.wfile.write(data[-1:])
            return
        poller = select.poll()
        poller.register(self.connection, select.POLLOUT)
        if not poller.poll(self.server.read_timeout_s * 1000):
            raise TimeoutError("the client reads nothing of its answer")
        slot.release()
        self.wfile.write(data[-1:])

    def _stream(self, stream: "api.Stream") -> None:
        """Status 200 and ``application/x-ndjson`` now, then one line per progress document as the work
        runs, then its document, or the error it raised as an error document (with the ``status`` the answer
        would have had).  A caller that goes away does not stop the work: its lines are dropped."""
        gone = False

        def line(doc: Dict[str, Any]) -> None:
            nonlocal gone
            if gone:
                return
            try:
                self.wfile.write((json.dumps(doc) + "\n").encode())
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                gone = True
        try:
            self.connection.settimeout(self.server.read_timeout_s)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            gone = True
        try:
            final = stream.run(line)
        except VgpuhostError as e:
            final = error_doc(status_of(e), e.message, hint=e.hint, exit_code=e.exit_code, kind=type(e).__name__)
        except Exception as e:      # a bug: one error document, never a traceback on the socket
            log.exception("internal error")
            final = error_doc(500, f"internal error: {type(e).__name__}: {e}",
                              hint="report it (the agent's journal has the traceback)",
                              exit_code=EXIT_INTERNAL, kind="InternalError")
        if not gone:
            try:
                self._final((json.dumps(final) + "\n").encode())     # the slot back before its last byte
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass

    def _handle(self, method: str) -> Tuple[int, Any]:
        # the peer and its role, decided at accept (_Server.process_request: a peer of no role never gets here)
        peer, who = self.client_address.peer, self.client_address.caller
        self._peer = peer
        srv = self.server
        caller = socket_role(who, srv.role)
        role = caller.role
        url = urlsplit(self.path)
        route, params, allowed = api.match(method, url.path)
        params = {k: unquote(v) for k, v in params.items()}
        if route is None:
            if allowed:
                return 405, error_doc(405, f"{method} is not allowed on {url.path}",
                                      hint="allowed: " + ", ".join(sorted(set(allowed))))
            return 404, error_doc(404, f"no endpoint {url.path}", hint="GET /v1/openapi lists them")
        if role == api.TENANT and (route.tenant is None or (srv.role == api.READ and route.role == api.ADMIN)):
            where = " on the read-only socket" if route.tenant is not None else ""
            return 403, error_doc(403, f"{method} {route.template} is not open to members of tenant "
                                       f"{caller.tenant!r}{where}",
                                  hint="a tenant member reads its tenant's usage, domains, vGPUs, capacity and audit "
                                       "rows, and allocates and releases for its tenant's domains (on the tenant "
                                       "socket); ask the operator for the rest", kind="RefusedError")
        if role != api.TENANT and role not in route.roles:
            where = "the read-only socket" if srv.role == api.READ else "a member of the read-only group"
            return 403, error_doc(403, f"{method} {url.path} changes the host: not allowed for {where}",
                                  hint=f"use the admin socket as root or a member of {group_words(srv.admin_group)}",
                                  kind="RefusedError")
        body = None
        if method == "POST":
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if ctype == "application/xml" and route.handler in api.HOOK_HANDLERS:
                body, problem = self._xml_body()
            else:
                body, problem = self._body(route)
            if problem is not None:
                return problem
        pairs = parse_qsl(url.query, keep_blank_values=True)
        query = dict(pairs)
        if len(query) < len(pairs):     # which value counts would be the reader's guess (the last, silently)
            seen: set = set()
            key = next(k for k, _v in pairs if k in seen or seen.add(k))
            shown = "".join(c if c.isprintable() else "?" for c in key[:64])
            return 400, error_doc(400, f"the query gives {shown!r} more than once", hint="give each query "
                                  "parameter once")
        actor = f"agent uid={peer.uid} pid={peer.pid}"
        req = api.Request(params, query, body, actor, peer.pid, role, caller.tenant)
        srv.agent.count(route, thin=self._hook_xml is not None)
        expensive = (route.method, route.template) in EXPENSIVE_READS
        if expensive and not body and route.method == "GET":
            try:
                api.check_query(route, query)
                kept = api.cached_read(srv.agent, route, req)
            except VgpuhostError:
                kept = None             # answered below, as any request
            if kept is not None:
                return 200, kept        # built before for this snapshot: no host read, no CPU to budget
        if expensive:
            refused = srv.budget.begin(peer.uid)
            if refused is not None:
                why, self._retry_after = refused
                log.debug("refused an expensive read of uid %d: %s", peer.uid, why)
                # answered after a pause (no CPU: this connection's thread sleeps): a caller that retries at
                # once, in a loop, runs a request a second instead of hundreds, on its side and the agent's
                time.sleep(min(srv.refusal_delay_s, self._retry_after))
                return 429, error_doc(429, why, hint=f"retry after {self._retry_after} s; read one at a time",
                                      exit_code=5, kind="TransientError")
        cpu0 = time.thread_time()
        try:
            api.check_keys(route, body)
            api.check_query(route, query)
            return 200, route.handler_for(req)(srv.agent, req)
        except VgpuhostError as e:
            if role == api.TENANT and not isinstance(e, api.Forbidden):
                # a refusal's reason may name other tenants and domains; Forbidden echoes only what the caller
                # asked (redacting a known domain there and not an unknown one would tell which exist)
                e = api.redact_error(srv.agent, req, e)
            status = status_of(e)
            kind = "RefusedError" if isinstance(e, api.Forbidden) else type(e).__name__
            return status, error_doc(status, e.message, hint=e.hint, exit_code=e.exit_code, kind=kind)
        except OSError as e:
            name = f": {e.filename}" if e.filename else ""
            return 500, error_doc(500, f"{e.strerror or e}{name}", hint="check the path and its permissions",
                                  kind="OSError")
        except Exception as e:
            if type(e).__module__ == "sqlite3":
                return 503, store_error_doc(getattr(getattr(srv.agent, "store", None), "db", "state.db"), e)
            raise
        finally:
            if expensive:
                srv.budget.end(peer.uid, time.thread_time() - cpu0)

    def _length(self, *, garbled: int = 400, limit: int = MAX_BODY,
                what: str = "") -> Tuple[Optional[int], Optional[Tuple[int, Dict[str, Any]]]]:
        """The body's length from the one ``Content-Length`` header (ASCII digits), or the answer:
        411 without one (or with ``Transfer-Encoding``), 400 for two, ``garbled`` for a value that is
        not a length, 413 above ``limit`` (before a byte of the body is read)."""
        values = self.headers.get_all("Content-Length") or []
        if len(values) > 1:
            return None, (400, error_doc(400, "the request has more than one Content-Length header",
                                         hint="send one"))
        if not values or self.headers.get("Transfer-Encoding"):
            return None, (411, error_doc(411, "a POST needs Content-Length (0 for no body)",
                                         hint="send the body's length in bytes; chunked bodies are not read"))
        value = values[0].strip()
        if value.startswith("-") and value[1:].isascii() and value[1:].isdigit():
            return None, (garbled, error_doc(garbled, "Content-Length is negative",
                                             hint="send the body's length in bytes"))
        if not (value.isascii() and value.isdigit()) or len(value) > 20:
            return None, (garbled, error_doc(garbled, "Content-Length is not a number",
                                             hint="send the body's length in bytes (ASCII digits)"))
        n = int(value)
        if n > limit:
            self._drop_after(n)
            return None, (413, error_doc(413, f"the request body of {n} bytes is over the {_size(limit)} "
                                              f"{what or 'this endpoint'} takes", hint="send a smaller body"))
        return n, None

    def _drop_after(self, n: int) -> None:
        """A body of ``n`` bytes refused unread: read and drop it after the answer (:meth:`_drain`), up to
        :data:`MAX_DRAIN`; none when its client waits for ``100 Continue`` (it sends no body)."""
        self._unread = n if n <= MAX_DRAIN and not self._expect_continue else 0

    def _read(self, n: int) -> Tuple[bytes, Optional[Tuple[int, Dict[str, Any]]]]:
        """The ``n`` bytes of the body (``100 Continue`` first when the client asked for it), or the 408."""
        if self._expect_continue and n:
            self._expect_continue = False
            try:
                self.wfile.write(b"%s 100 Continue\r\n\r\n" % self.protocol_version.encode("ascii"))
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass                # gone: the read below sees it
        try:
            raw = self.rfile.read(n) if n else b""
        except TimeoutError:
            raw = None
        if raw is None or len(raw) < n:
            why = (f"within {self.server.request_timeout_s:g} s of the request's start" if self._reader.expired
                   else f"a connection may pause at most {self.server.read_timeout_s:g} s")
            return b"", (408, error_doc(408, f"the request body did not arrive ({n} bytes announced; {why})",
                                        hint="send the whole body with the request"))
        return raw, None

    def _xml_body(self) -> Tuple[Optional[Dict[str, Any]], Optional[Tuple[int, Dict[str, Any]]]]:
        """The hook's thin client (the sh dispatcher's curl): the domain XML as the body, the domain
        name, host root and state dir in ``X-Vgpuhost-*`` headers; answered as :func:`hook_answer`."""
        n, problem = self._length(garbled=411, limit=MAX_BODY, what="the hook's domain XML")
        if problem is not None:
            return None, problem
        for name in HOOK_HEADERS:
            if len(self.headers.get_all(name) or ()) > 1:     # which one counts would be the reader's guess
                self._drop_after(n)
                return None, (400, error_doc(400, f"the request has more than one {name} header",
                                             hint="send one"))
        raw, problem = self._read(n)
        if problem is not None:
            return None, problem
        try:
            xml = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None, (415, error_doc(415, "the domain XML is not UTF-8", hint="the hook does the work itself"))

        def header(name: str) -> Optional[str]:
            value = self.headers.get(name)
            if value is None:
                return None
            return value.encode("latin-1", "replace").decode("utf-8", "replace")
        body = {"xml": xml, "name": header(HOOK_HEADERS[0]) or "?"}
        for key, name in (("root", "X-Vgpuhost-Root"), ("state_dir", "X-Vgpuhost-State-Dir"),
                          ("timeout_s", "X-Vgpuhost-Timeout")):
            if header(name) is not None:
                body[key] = header(name)
        self._hook_xml = body
        return body, None

    def _body(self, route: api.Route) -> Tuple[Optional[Dict[str, Any]], Optional[Tuple[int, Dict[str, Any]]]]:
        """The JSON body, bounded before it is parsed: its size by the route (:func:`body_limit`), its
        items (:data:`MAX_JSON_ITEMS`) and a layout config's size and items (:func:`config_refusal`)."""
        limit = body_limit(route)
        n, problem = self._length(limit=limit, what=f"{route.method} {route.template}")
        if problem is not None:
            return None, problem
        raw, problem = self._read(n)
        if problem is not None:
            return None, problem
        if not raw.strip():
            return None, None
        if route.handler not in api.HOOK_HANDLERS:      # the hook's one XML string holds any punctuation
            items = json_items(raw)
            if items > MAX_JSON_ITEMS:
                return None, (413, error_doc(413, f"the request body has {items} JSON items (, {{ [); at most "
                                                  f"{MAX_JSON_ITEMS}", hint="send fewer entries"))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None, (415, error_doc(415, "the request body is not UTF-8", hint="send JSON in UTF-8"))
        try:
            doc = json.loads(text, object_pairs_hook=_unique_keys)
        except _DuplicateKey as e:
            return None, (400, error_doc(400, f"the request body has the key {e.key!r} more than once",
                                         hint="send each key once"))
        except (ValueError, RecursionError):
            return None, (400, error_doc(400, "the request body is not JSON", hint="send a JSON object"))
        if not isinstance(doc, dict):
            return None, (400, error_doc(400, "the request body must be a JSON object"))
        if "config" in route.keys and isinstance(doc.get("config"), str):
            refused = config_refusal(doc["config"])
            if refused is not None:
                return None, (413, error_doc(413, refused, hint="split the layouts over several configs"))
        return doc, None


#: the most header lines a request may have, and the longest line (as :mod:`http.client` reads them)
MAX_HEADERS = 100
MAX_HEADER_LINE = 65536
#: the characters of an HTTP token (RFC 9110 5.6.2): a header's name
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class HeaderError(Exception):
    """A request's headers refused: ``status`` (400, 431) and the ``text`` of its error."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status, self.text = status, text


class Headers:
    """A request's headers: ``get(name, default)`` the first value of ``name`` (any case), ``get_all(name)``
    every value in order (None when there is none): what the agent reads of :class:`email.message.Message`,
    and with its values (leading blanks dropped, trailing ones kept)."""

    __slots__ = ("items",)

    def __init__(self, items: List[Tuple[str, str]]):
        self.items = items          # (lower-case name, value), in the request's order

    def get(self, name: str, default: Optional[str] = None) -> Optional[str]:
        name = name.lower()
        for key, value in self.items:
            if key == name:
                return value
        return default

    def get_all(self, name: str, failobj: Optional[List[str]] = None) -> Optional[List[str]]:
        name = name.lower()
        found = [value for key, value in self.items if key == name]
        return found or failobj

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __getitem__(self, name: str) -> Optional[str]:
        return self.get(name)


def read_headers(rfile) -> Headers:
    """The header lines of a request from ``rfile`` up to the empty line (or the end of input), decoded as
    ISO-8859-1.  Raises HeaderError: 431 for a line over :data:`MAX_HEADER_LINE` bytes or more than
    :data:`MAX_HEADERS` lines (:mod:`http.client`'s limits and texts), 400 for a line that is not
    ``NAME: VALUE`` with NAME a token (a folded line included); TimeoutError as ``rfile`` raises it."""
    items: List[Tuple[str, str]] = []
    while True:
        line = rfile.readline(MAX_HEADER_LINE + 1)
        if len(line) > MAX_HEADER_LINE:
            raise HeaderError(431, "Line too long")
        if line in (b"\r\n", b"\n", b""):
            return Headers(items)
        if len(items) >= MAX_HEADERS:
            raise HeaderError(431, "Too many headers")
        text = line.decode("iso-8859-1")
        name, sep, value = text.partition(":")
        if not sep or not name or not _TOKEN.issuperset(name):
            raise HeaderError(400, "a header line that is not NAME: VALUE (NAME a token; no folded line)")
        items.append((name.lower(), value.lstrip(" \t").rstrip("\r\n")))


def _http_version(text: str) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of ``HTTP/M.N`` (digits, at most 10 each, leading zeros ignored), else None."""
    if not text.startswith("HTTP/"):
        return None
    parts = text[5:].split(".")
    if len(parts) != 2 or not all(p.isdigit() and p.isascii() and len(p) <= 10 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


_DATE: Tuple[int, str] = (0, "")


def _http_date() -> str:
    """The ``Date`` header's value now (RFC 9110 IMF-fixdate), formatted once a second."""
    global _DATE
    now = int(time.time())
    at, text = _DATE
    if at != now:
        text = formatdate(now, usegmt=True)
        _DATE = (now, text)
    return text


def body_limit(route: api.Route) -> int:
    """The largest body ``route`` takes, in bytes: :data:`MAX_BODY` for the hook's, :data:`MAX_LAYOUT_BODY`
    for a layout config's (plan, assert, apply), :data:`MAX_SMALL_BODY` for the others."""
    if route.handler in api.HOOK_HANDLERS:
        return MAX_BODY
    if "config" in route.keys:
        return MAX_LAYOUT_BODY
    return MAX_SMALL_BODY


def json_items(raw: bytes) -> int:
    """An upper bound of the values a JSON text holds, counted without parsing it: its ``,`` ``{`` ``[``."""
    return raw.count(b",") + raw.count(b"{") + raw.count(b"[")


def config_refusal(text: str) -> Optional[str]:
    """Why a layout config text is refused before YAML reads it (the one line of a 413), or None: over
    :data:`MAX_CONFIG_BYTES` in UTF-8, or over :data:`MAX_CONFIG_ITEMS` items (lines plus ``,`` ``{`` ``[``:
    an upper bound of the YAML nodes, so of the parse's cost)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        return f"the layout config is {size} bytes; at most {_size(MAX_CONFIG_BYTES)}"
    items = text.count("\n") + text.count(",") + text.count("{") + text.count("[")
    if items > MAX_CONFIG_ITEMS:
        return (f"the layout config has {items} items (lines, and , {{ [ in them); at most {MAX_CONFIG_ITEMS} "
                "(a layout takes at most {MAX_ENTRIES} GPU entries)")
    return None


def _size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n % (1 << 20) == 0 else f"{n // 1024} KiB" if n % 1024 == 0 else f"{n} bytes"


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = "".join(c if c.isprintable() else "?" for c in key[:64])


def _unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """``json.loads``'s object hook: an object that names a key twice is refused (last-wins would let
    ``{"dry_run": true, "dry_run": false}`` read as a dry run to one reader and not to another)."""
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


#: the headers of the hook's thin client (the XML form): each may be given once (two: 400)
HOOK_HEADERS = ("X-Vgpuhost-Domain", "X-Vgpuhost-Root", "X-Vgpuhost-State-Dir", "X-Vgpuhost-Timeout")
#: the first line of an answer to the hook's thin client, followed by the exit code
HOOK_ANSWER = "vgpuhost-hook/1"


def hook_answer(status: int, doc: Any, body: Dict[str, Any], *, release: bool = False) -> api.Text:
    """The thin client's answer: ``vgpuhost-hook/1 EXIT``, then the one line the hook prints on stderr
    (none on success), exactly as the hook would print it had it done the work itself (``release``: the
    call is ``release end``, whose domain name the hook takes from the document's identity alone)."""
    if status == 200:
        return api.Text("text/plain; charset=utf-8", f"{HOOK_ANSWER} 0".encode())
    problem = doc.get("error") if isinstance(doc, dict) else None
    code = problem.get("exit_code") if isinstance(problem, dict) else None
    if not isinstance(code, int):
        code, line = EXIT_INTERNAL, f"the agent answered {status}"
    else:
        line = problem.get("line")
    name = _domain_name(body.get("xml") or "", release=release) or body.get("name") or "?"
    return api.Text("text/plain; charset=utf-8",
                    f"{HOOK_ANSWER} {code}\n{agent_error_line(name, code, line)}".encode())


def _domain_name(xml: str, *, release: bool = False) -> Optional[str]:
    """The domain's ``<name>`` as the hook's own handler (:func:`vgpuhost.hook.runtime.run`) names it in
    its errors: at ``prepare begin`` the name of a document :func:`parse_domain` reads whole, None when it
    refuses it (two ``<name>`` elements among them: the hook's argument, libvirt's name, is shown, never
    either of the document's); at ``release end`` its identity's (:func:`parse_domain_identity`)."""
    try:
        data = xml.encode("utf-8")
        return (parse_domain_identity(data) if release else parse_domain(data)).name
    except (VgpuhostError, ValueError):
        return None


class AgentProcess:
    """The running agent: its servers (one per socket) and their threads."""

    def __init__(self, agent: api.Agent, servers: List[_Server], bound: List[str]):
        self.agent = agent
        self.servers = servers
        self.bound = bound              # socket files this process created (removed at stop)
        self.threads: List[threading.Thread] = []

    def start(self) -> None:
        for s in self.servers:
            t = threading.Thread(target=s.serve_forever,
                                 name=f"agent-{s.role}", daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self) -> None:
        """Stop accepting, close the listening sockets, and give a change in progress up to
        :data:`STOP_WAIT_S` to end and its answer to be sent (an apply stops between its steps; reads in
        flight are dropped with the process: SIGTERM ends the agent within seconds under any load)."""
        since = time.monotonic()
        self.agent.stop()                       # no change (nor an apply's next step) starts from here
        # every accept loop told at once (its wake-up socket), then each waited for;
        # only loops that were started: socketserver's shutdown() of a server whose serve_forever never ran
        # waits forever (a thread left blocked for the process's life, and a fork later copies it)
        stoppers = [threading.Thread(target=s.shutdown, daemon=True) for s in self.servers[:len(self.threads)]]
        for t in stoppers:
            t.start()
        if self.agent.metering is not None:
            self.agent.metering.close()
        if getattr(self.agent, "rebalancer", None) is not None:
            self.agent.rebalancer.stop.set()    # a run in progress ends with the write lock below
        for t in stoppers:
            t.join(1.0)
        for s in self.servers:
            s.server_close()
        for path in self.bound:
            unixsock.remove_socket(path)
        self.agent.wait_answers(STOP_WAIT_S - (time.monotonic() - since))
        if self.agent.write_lock.acquire(timeout=max(0.0, STOP_WAIT_S - (time.monotonic() - since))):
            self.agent.write_lock.release()
            if getattr(self.agent, "rebalancer", None) is not None:
                self.agent.rebalancer.close()       # its run (under the write lock) has ended: the thread ends


def tenant_group_map(pairs) -> Dict[int, str]:
    """``{gid: tenant}`` from ``GROUP=TENANT`` texts (``--tenant-group``; GROUP a name or a gid).  Raises
    InputError for a text without ``=``, a tenant name that is not one, an unknown group, or a group
    given for two tenants."""
    out: Dict[int, str] = {}
    for text in pairs or ():
        group, sep, tenant = str(text).partition("=")
        tenant = tenant.strip()
        if not sep or not group.strip() or not valid_key(tenant):
            raise InputError(f"--tenant-group {str(text)[:80]!r} is not GROUP=TENANT",
                             hint="e.g. --tenant-group ml-team=ml (a group name or gid; the tenant's name: "
                                  "letters, digits and _.:+-)")
        gid = unixsock.group_id(group.strip())
        if gid in out and out[gid].lower() != tenant.lower():
            raise InputError(f"--tenant-group maps group {group.strip()!r} to two tenants ({out[gid]}, {tenant})",
                             hint="a group's members belong to one tenant")
        out[gid] = tenant
    return out


def open_agent(host: HostRoot, *, socket_dir: Optional[str] = None, admin_group="vgpuhost",
               ro_group="vgpuhost-ro", env=None, metering_interval_s: float = 0.0,
               metrics_listen: Optional[Tuple] = None,
               libvirt_uri: str = api.DEFAULT_LIBVIRT_URI, max_connections: int = MAX_CONNECTIONS,
               read_timeout_s: float = READ_TIMEOUT_S, request_timeout_s: float = REQUEST_TIMEOUT_S,
               tenant_groups=(), tenant_prefix: str = DEFAULT_TENANT_PREFIX) -> AgentProcess:
    """Build the agent: adopt systemd's sockets (``LISTEN_FDS``) or bind all three under ``socket_dir``.

    ``libvirt_uri``: the libvirt URI attach/detach connect to (callers may
    name only it or a local qemu URI, :func:`api.allowed_uris`).
    ``tenant_groups``: ``GROUP=TENANT`` texts (:func:`tenant_group_map`);
    ``tenant_prefix``: the naming convention's prefix ('' turns it off).
    Raises InputError for an unknown group, a bad tenant mapping or an
    unusable URI and HostEnvironmentError when a socket cannot be had
    (another agent listens, the directory is not writable).
    """
    if not libvirt_uri or len(libvirt_uri) > 1024 or not libvirt_uri.isprintable():
        raise InputError("--libvirt-uri must be a libvirt URI of at most 1024 printable characters",
                         hint="e.g. qemu:///system (the default)")
    admin_gid = unixsock.group_id(admin_group)
    ro_gid = unixsock.group_id(ro_group)
    tenant_gids = tenant_group_map(tenant_groups)
    if admin_gid in tenant_gids or ro_gid in tenant_gids:
        raise InputError("--tenant-group names the admin or the read-only group",
                         hint="map groups of a tenant's members only; admin and read-only keep their meaning")
    access = Access(admin_gid, ro_gid, tenant_gids, tenant_prefix or "")
    host.require_host()
    if metering_interval_s <= 0 and metrics_listen is not None:
        raise InputError("--metrics-port needs metering on", hint="give --metering-interval S with S > 0")
    agent = api.Agent(host, libvirt_uri)
    # the sockets first: a second agent (its socket is in use) is refused before it recovers anything or
    # starts a metering thread; whatever fails after them closes them (and the sampler) again
    passed = unixsock.listen_fds(env)
    bound: List[str] = []
    socks: Dict[str, Any] = {}
    try:
        if passed:
            for name, sock in passed.items():
                role = api.READ if name in ("ro", "read", "vgpuhost-agent-ro.socket") else \
                    api.TENANT if name in ("tenant", "vgpuhost-agent-tenant.socket") else api.ADMIN
                socks.setdefault(role, []).append(sock)
        else:
            d = str(socket_dir) if socket_dir else str(default_socket_dir(host))
            for role, fname, gid, mode in ((api.ADMIN, ADMIN_SOCKET, admin_gid, SOCKET_MODE),
                                           (api.READ, RO_SOCKET, ro_gid, SOCKET_MODE),
                                           (api.TENANT, TENANT_SOCKET, 0, TENANT_SOCKET_MODE)):
                path = os.path.join(d, fname)
                socks.setdefault(role, []).append(unixsock.bind(path, mode=mode, gid=gid, backlog=BACKLOG))
                bound.append(path)
        agent.recovered = recover_at_start(agent)
        if metering_interval_s > 0:
            start_metering(agent, metering_interval_s, metrics_listen)
        agent.rebalancer = start_rebalancer(agent)   # the capacity reconciler, when its config turns it on
        budget = ReadBudget()           # one per agent: a peer's expensive reads count on every socket
        servers = [_Server(s, role, agent, admin_gid, ro_gid, str(admin_group), str(ro_group),
                           max_connections=max_connections, read_timeout_s=read_timeout_s, access=access,
                           request_timeout_s=request_timeout_s, budget=budget)
                   for role, ss in socks.items() for s in ss]
    except BaseException:
        if agent.metering is not None:
            agent.metering.close()
        if getattr(agent, "rebalancer", None) is not None:
            agent.rebalancer.close()
        if not passed:                  # systemd's sockets stay systemd's
            for ss in socks.values():
                for sock in ss:
                    sock.close()
        for p in bound:
            unixsock.remove_socket(p)
        raise
    return AgentProcess(agent, servers, bound)


def recover_at_start(agent: api.Agent) -> Dict[str, Any]:
    """What a killed agent (or CLI, or hook) left half-done, finished or rolled back before serving.

    The intent journal's open entries (issue 12) when this vgpuhost has it,
    then reconcile: recorded vGPUs that are missing are made again; nothing
    is removed; a killed start is forgotten unless libvirt at the agent's
    ``--libvirt-uri`` lists its domain running, or does not answer (then it
    is kept, with a warning).  Failures are logged and reported in ``GET /v1/agent``;
    the agent serves on.
    """
    out: Dict[str, Any] = {"journal": None, "reconcile": None}
    actor = "agent start"
    try:
        done = recover.recover_all(agent.host, agent.store, actor=actor)
        out["journal"] = [getattr(r, "line", lambda: str(r))() for r in done]
        rep = reconcile(agent.host, agent.store, check=False, actor=actor, libvirt_uri=agent.libvirt_uri,
                        forget_unasked=False)
        out["reconcile"] = rep.as_dict()
        if rep.libvirt_unasked and rep.stale_domains:
            log.warning("libvirt at %s did not answer: %d domain(s) recorded running were kept, not forgotten "
                        "(they hold no device; 'vgpuhost reconcile --check' lists them, 'vgpuhost reconcile' "
                        "forgets them)", rep.libvirt_unasked, len(rep.stale_domains))
    except VgpuhostError as e:
        log.warning("recovery at start failed: %s", e.one_line())
        out["error"] = e.one_line()
    return out


def start_metering(agent: api.Agent, interval_s: float, metrics_listen: Optional[Tuple]) -> None:
    """Run the metering sampler in the agent; without NVML the agent serves on and /v1/metrics says why (503).
    ``metrics_listen``: ``(address, port)`` or ``(address, port, scope)`` of the TCP listener
    (:meth:`AgentMetering.listen_tcp`).  A TCP listener that cannot be bound raises InputError."""
    try:
        m = AgentMetering(agent.host, interval_s)
    except VgpuhostError as e:
        agent.metering_off = f"metering could not start: {e.one_line()}"
        log.warning("%s", agent.metering_off)
        if metrics_listen is not None:
            raise
        return
    if metrics_listen is not None:
        try:
            m.metrics_port = m.listen_tcp(*metrics_listen)
        except OSError as e:
            raise InputError(f"cannot serve metrics on {metrics_listen[0]}:{metrics_listen[1]}: {e.strerror or e}",
                             hint="pick another --metrics-port, or stop what holds it") from None
    m.start()
    agent.metering = m


#: seconds between the main thread's checks for a stop signal (:func:`serve`)
SIGNAL_POLL_S = 0.25


def serve(host: HostRoot, *, socket_dir: Optional[str] = None, admin_group="vgpuhost",
          ro_group="vgpuhost-ro", ready=None, metering_interval_s: float = 0.0,
          metrics_listen: Optional[Tuple] = None, libvirt_uri: str = api.DEFAULT_LIBVIRT_URI,
          max_connections: int = MAX_CONNECTIONS, read_timeout_s: float = READ_TIMEOUT_S,
          request_timeout_s: float = REQUEST_TIMEOUT_S, tenant_groups=(),
          tenant_prefix: str = DEFAULT_TENANT_PREFIX) -> int:
    """Run the agent until SIGTERM or SIGINT; returns 0.  ``ready(process)`` is called once listening."""
    proc = open_agent(host, socket_dir=socket_dir, admin_group=admin_group, ro_group=ro_group,
                      metering_interval_s=metering_interval_s, metrics_listen=metrics_listen,
                      libvirt_uri=libvirt_uri, max_connections=max_connections, read_timeout_s=read_timeout_s,
                      request_timeout_s=request_timeout_s, tenant_groups=tenant_groups, tenant_prefix=tenant_prefix)
    stop = threading.Event()
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    def on_signal(signum, frame):
        stop.set()
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        proc.start()
        unixsock.sd_notify("READY=1")       # Type=notify (vgpuhost-agent.service): listening now
        if ready is not None:
            ready(proc)
        # short waits: the kernel may hand SIGTERM to any of the agent's threads, and then the main thread's
        # blocked wait is not interrupted; Python runs the handler only when the main thread next wakes (with
        # a wait of an hour, an agent under load ignored SIGTERM until systemd killed it)
        while not stop.wait(SIGNAL_POLL_S):
            pass
    finally:
        proc.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return 0
