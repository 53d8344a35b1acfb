"""``vgpuhost agent``: JSON over HTTP/1.1 on three unix sockets, roles from SO_PEERCRED.

Owns: the listening sockets (bound here, or passed by systemd socket
activation: ``LISTEN_FDS`` with ``LISTEN_FDNAMES`` ``admin``, ``ro`` and ``tenant``),
HTTP parsing (stdlib :mod:`http.server`, one thread per connection), the
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
  connect: the role is decided by the credentials alone, and a caller of no
  role is answered 403 before its request body is read.

Roles (:class:`Access`): ``admin`` (root, a member of the admin group),
``read`` (the read-only group), ``tenant`` (a group mapped to a tenant:
``--tenant-group GROUP=TENANT``, or a group named ``<prefix><tenant>``,
default prefix ``vgpuhost-t-``), tried in that order.  The file modes keep
others out of the admin and read-only sockets; the agent checks again with
the peer's credentials (``SO_PEERCRED`` and ``SO_PEERGROUPS``,
:func:`vgpuhost.io.unixsock.peer`), so a socket whose mode was loosened
still refuses them (403).

Responses: ``200`` with the endpoint's document; errors as one
``vgpuhost.agent-error/v1`` document carrying the CLI's exit code:
400 input (a malformed request line or header too), 403 role, 404 path,
405 method, 408 a body that stopped arriving, 409 refused, 411/413 body,
429 too many connections, 500 device failed (``exit_code`` 3) or internal
(4), 503 unavailable.

Connections: each socket serves at most ``max_connections`` (default
:data:`MAX_CONNECTIONS`) at once, one thread each; one more is answered 429
at once and closed.  A connection that sends nothing for ``read_timeout_s``
(default :data:`READ_TIMEOUT_S`) while its request is read is closed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any, Dict, List, NamedTuple, Optional, Tuple
from urllib.parse import parse_qsl, unquote, urlsplit

from .. import __version__
from ..hook.runtime import agent_error_line
from ..io import unixsock
from ..io.hostroot import HostRoot
from ..libvirt.domxml import parse_domain_identity, valid_key
from ..model.errors import EXIT_DEVICE, EXIT_INPUT, HostEnvironmentError, InputError, RefusedError, VgpuhostError
from ..ops import recover
from ..ops.vgpu import reconcile
from . import api
from .metrics import AgentMetering

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
#: seconds a group's name read from the group database serves before it is read again
GROUP_NAME_TTL_S = 60.0
#: the largest request body (a domain XML of 4 MiB, JSON-escaped)
MAX_BODY = 12 * 1024 * 1024
EXIT_INTERNAL = 4
#: connections one socket serves at once (one thread each); more are answered 429 and closed
MAX_CONNECTIONS = 64
#: seconds a connection may send nothing while its request (line, headers, body) is read
READ_TIMEOUT_S = 10.0


def default_socket_dir(host: HostRoot):
    """``<root>/run/vgpuhost``: where the agent listens and the hook and CLI look for it."""
    return host.path("run", "vgpuhost")


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """One listening socket (bound elsewhere) and its role."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, sock, role: str, agent: api.Agent, admin_gid: int, ro_gid: int,
                 admin_group: str = DEFAULT_ADMIN_GROUP, ro_group: str = DEFAULT_RO_GROUP, *,
                 max_connections: int = MAX_CONNECTIONS, read_timeout_s: float = READ_TIMEOUT_S,
                 access: Optional["Access"] = None):
        socketserver.BaseServer.__init__(self, "", _Handler)
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.socket = sock
        self.server_address = unixsock.socket_path(sock)
        self.role = role
        self.agent = agent
        self.admin_gid = admin_gid
        self.ro_gid = ro_gid
        self.admin_group = admin_group      # as the operator named them (--admin-group, --ro-group)
        self.ro_group = ro_group
        self.access = access if access is not None else Access(admin_gid, ro_gid)

    def process_request(self, request, client_address) -> None:
        """A thread for the connection while fewer than ``max_connections`` are open; else 429, closed."""
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request) -> None:
        log.warning("refused a connection on %s: %d connections open (the most it serves)",
                    self.server_address, self.max_connections)
        doc = error_doc(429, f"the agent serves at most {self.max_connections} connections at once on this "
                             "socket, all open", hint="retry shortly; close connections you hold open",
                        exit_code=5, kind="TransientError")
        body = (json.dumps(doc, indent=2) + "\n").encode()
        head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("ascii")
        try:
            request.settimeout(1.0)
            request.sendall(head + body)
            request.setblocking(False)
            for _ in range(16):         # what the client already sent: a close with unread data
                if not request.recv(1 << 16):   # would reset the connection before it reads the answer
                    break
        except OSError:
            pass
        self.shutdown_request(request)


class Caller(NamedTuple):
    """Who a peer is to the agent: ``role`` (:data:`api.ROLES`) and ``tenant`` (the tenant a tenant
    member belongs to; None for the other roles)."""

    role: str
    tenant: Optional[str] = None


class Access:
    """The agent's roles for a peer's credentials: ``admin_gid``, ``ro_gid``, ``tenant_gids`` (``{gid:
    tenant}``, from ``--tenant-group``) and ``prefix`` (a group named ``prefix + TENANT`` maps to TENANT;
    empty: no naming convention).  Group names are read from the group database
    (:func:`vgpuhost.io.unixsock.group_name`), each kept :data:`GROUP_NAME_TTL_S` seconds."""

    def __init__(self, admin_gid: int, ro_gid: int, tenant_gids: Optional[Dict[int, str]] = None,
                 prefix: str = DEFAULT_TENANT_PREFIX):
        self.admin_gid, self.ro_gid = admin_gid, ro_gid
        self.tenant_gids = dict(tenant_gids or {})
        self.prefix = prefix
        self._names: Dict[int, Tuple[float, Optional[str]]] = {}
        self._lock = threading.Lock()

    def _name(self, gid: int) -> Optional[str]:
        now = time.monotonic()
        with self._lock:
            hit = self._names.get(gid)
            if hit is not None and now - hit[0] < GROUP_NAME_TTL_S:
                return hit[1]
        name = unixsock.group_name(gid)
        with self._lock:
            self._names[gid] = (now, name)
        return name

    def tenants_of(self, groups) -> List[str]:
        """The tenants ``groups`` (gids) map to, sorted, each once (names compared in any case)."""
        found: Dict[str, str] = {}
        for gid in sorted(groups):
            tenant = self.tenant_gids.get(gid)
            if tenant is None and self.prefix:
                name = self._name(gid)
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


def status_of(e: VgpuhostError) -> int:
    if isinstance(e, api.Forbidden):
        return 403
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
        log.debug("%s %s", getattr(self, "_peer", None), fmt % args)

    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s       # StreamRequestHandler sets it on the socket
        super().setup()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and self.request_version == "HTTP/0.9":
            self.send_error(400, "a request line without an HTTP version (HTTP/0.9) is not served")
            return False
        return ok

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
        self.close_connection = True
        self._hook_xml = None
        try:
            status, doc = self._handle(method)
        except Exception as e:      # a bug: one error document, never a traceback on the socket
            log.exception("internal error")
            status, doc = 500, error_doc(500, f"internal error: {type(e).__name__}: {e}",
                                         hint="report it (the agent's journal has the traceback)",
                                         exit_code=EXIT_INTERNAL, kind="InternalError")
        if self._hook_xml is not None and status != 421:
            doc = hook_answer(status, doc, self._hook_xml)
        if isinstance(doc, api.Text):
            self._send(status, doc.content_type, doc.body)
        else:
            self._send(status, "application/json", (json.dumps(doc, indent=2) + "\n").encode())
        if method == "POST":
            self.server.agent.warm_up()     # answered: re-read the host now, not at the next VM start

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _handle(self, method: str) -> Tuple[int, Any]:
        peer = unixsock.peer(self.connection)
        self._peer = peer
        srv = self.server
        who, why = srv.access.caller(peer)
        if who is None:
            return 403, error_doc(403, f"uid {peer.uid} is not allowed to use the vgpuhost agent: {why}",
                                  hint=f"ask for membership of the {srv.ro_group} (read) or {srv.admin_group} "
                                       "(admin) group, or of one tenant's group",
                                  kind="RefusedError")
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
                                  hint=f"use the admin socket as root or a member of the {srv.admin_group} group",
                                  kind="RefusedError")
        body = None
        if method == "POST":
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if ctype == "application/xml" and route.handler in api.HOOK_HANDLERS:
                body, problem = self._xml_body()
            else:
                body, problem = self._body()
            if problem is not None:
                return problem
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        actor = f"agent uid={peer.uid} pid={peer.pid}"
        req = api.Request(params, query, body, actor, peer.pid, role, caller.tenant)
        srv.agent.count(route, thin=self._hook_xml is not None)
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
                return 503, error_doc(503, f"the state store is unusable ({e})",
                                      hint="restore state.db from a backup", kind="StateError")
            raise

    def _length(self, *, garbled: int = 400) -> Tuple[Optional[int], Optional[Tuple[int, Dict[str, Any]]]]:
        """The body's length from the one ``Content-Length`` header (ASCII digits), or the answer:
        411 without one (or with ``Transfer-Encoding``), 400 for two, ``garbled`` for a value that is
        not a length, 413 above :data:`MAX_BODY`."""
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
        if n > MAX_BODY:
            return None, (413, error_doc(413, f"the request body is over {MAX_BODY} bytes"))
        return n, None

    def _read(self, n: int) -> Tuple[bytes, Optional[Tuple[int, Dict[str, Any]]]]:
        try:
            raw = self.rfile.read(n) if n else b""
        except TimeoutError:
            raw = None
        if raw is None or len(raw) < n:
            return b"", (408, error_doc(408, f"the request body did not arrive ({n} bytes announced; a "
                                             f"connection may pause at most {self.server.read_timeout_s:g} s)",
                                        hint="send the whole body with the request"))
        return raw, None

    def _xml_body(self) -> Tuple[Optional[Dict[str, Any]], Optional[Tuple[int, Dict[str, Any]]]]:
        """The hook's thin client (the sh dispatcher's curl): the domain XML as the body, the domain
        name, host root and state dir in ``X-Vgpuhost-*`` headers; answered as :func:`hook_answer`."""
        n, problem = self._length(garbled=411)
        if problem is not None:
            return None, problem
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
        body = {"xml": xml, "name": header("X-Vgpuhost-Domain") or "?"}
        for key, name in (("root", "X-Vgpuhost-Root"), ("state_dir", "X-Vgpuhost-State-Dir"),
                          ("timeout_s", "X-Vgpuhost-Timeout")):
            if header(name) is not None:
                body[key] = header(name)
        self._hook_xml = body
        return body, None

    def _body(self) -> Tuple[Optional[Dict[str, Any]], Optional[Tuple[int, Dict[str, Any]]]]:
        n, problem = self._length()
        if problem is not None:
            return None, problem
        raw, problem = self._read(n)
        if problem is not None:
            return None, problem
        if not raw.strip():
            return None, None
        try:
            doc = json.loads(raw, object_pairs_hook=_unique_keys)
        except _DuplicateKey as e:
            return None, (400, error_doc(400, f"the request body has the key {e.key!r} more than once",
                                         hint="send each key once"))
        except (ValueError, RecursionError):
            return None, (400, error_doc(400, "the request body is not JSON", hint="send a JSON object"))
        if not isinstance(doc, dict):
            return None, (400, error_doc(400, "the request body must be a JSON object"))
        return doc, None


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


#: the first line of an answer to the hook's thin client, followed by the exit code
HOOK_ANSWER = "vgpuhost-hook/1"


def hook_answer(status: int, doc: Any, body: Dict[str, Any]) -> api.Text:
    """The thin client's answer: ``vgpuhost-hook/1 EXIT``, then the one line the hook prints on stderr
    (none on success), exactly as the hook would print it had it done the work itself."""
    if status == 200:
        return api.Text("text/plain; charset=utf-8", f"{HOOK_ANSWER} 0".encode())
    problem = doc.get("error") if isinstance(doc, dict) else None
    code = problem.get("exit_code") if isinstance(problem, dict) else None
    if not isinstance(code, int):
        code, line = EXIT_INTERNAL, f"the agent answered {status}"
    else:
        line = problem.get("line")
    name = _domain_name(body.get("xml") or "") or body.get("name") or "?"
    return api.Text("text/plain; charset=utf-8",
                    f"{HOOK_ANSWER} {code}\n{agent_error_line(name, code, line)}".encode())


def _domain_name(xml: str) -> Optional[str]:
    """The domain's ``<name>`` when the XML parses (the name the hook's own errors show)."""
    try:
        return parse_domain_identity(xml.encode("utf-8")).name
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
            t = threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.2},
                                 name=f"agent-{s.role}", daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self) -> None:
        if self.agent.metering is not None:
            self.agent.metering.close()
        for s in self.servers:
            s.shutdown()
            s.server_close()
        for path in self.bound:
            unixsock.remove_socket(path)


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
               metrics_listen: Optional[Tuple[str, int]] = None,
               libvirt_uri: str = api.DEFAULT_LIBVIRT_URI, max_connections: int = MAX_CONNECTIONS,
               read_timeout_s: float = READ_TIMEOUT_S, tenant_groups=(),
               tenant_prefix: str = DEFAULT_TENANT_PREFIX) -> AgentProcess:
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
                socks.setdefault(role, []).append(unixsock.bind(path, mode=mode, gid=gid))
                bound.append(path)
        agent.recovered = recover_at_start(agent)
        if metering_interval_s > 0:
            start_metering(agent, metering_interval_s, metrics_listen)
        servers = [_Server(s, role, agent, admin_gid, ro_gid, str(admin_group), str(ro_group),
                           max_connections=max_connections, read_timeout_s=read_timeout_s, access=access)
                   for role, ss in socks.items() for s in ss]
    except BaseException:
        if agent.metering is not None:
            agent.metering.close()
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
    is removed.  Failures are logged and reported in ``GET /v1/agent``;
    the agent serves on.
    """
    out: Dict[str, Any] = {"journal": None, "reconcile": None}
    actor = "agent start"
    try:
        done = recover.recover_all(agent.host, agent.store, actor=actor)
        out["journal"] = [getattr(r, "line", lambda: str(r))() for r in done]
        rep = reconcile(agent.host, agent.store, check=False, actor=actor)
        out["reconcile"] = rep.as_dict()
    except VgpuhostError as e:
        log.warning("recovery at start failed: %s", e.one_line())
        out["error"] = e.one_line()
    return out


def start_metering(agent: api.Agent, interval_s: float, metrics_listen: Optional[Tuple[str, int]]) -> None:
    """Run the metering sampler in the agent; without NVML the agent serves on and /v1/metrics says why (503).
    A TCP listener that cannot be bound raises InputError."""
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


def serve(host: HostRoot, *, socket_dir: Optional[str] = None, admin_group="vgpuhost",
          ro_group="vgpuhost-ro", ready=None, metering_interval_s: float = 0.0,
          metrics_listen: Optional[Tuple[str, int]] = None, libvirt_uri: str = api.DEFAULT_LIBVIRT_URI,
          max_connections: int = MAX_CONNECTIONS, read_timeout_s: float = READ_TIMEOUT_S, tenant_groups=(),
          tenant_prefix: str = DEFAULT_TENANT_PREFIX) -> int:
    """Run the agent until SIGTERM or SIGINT; returns 0.  ``ready(process)`` is called once listening."""
    proc = open_agent(host, socket_dir=socket_dir, admin_group=admin_group, ro_group=ro_group,
                      metering_interval_s=metering_interval_s, metrics_listen=metrics_listen,
                      libvirt_uri=libvirt_uri, max_connections=max_connections, read_timeout_s=read_timeout_s,
                      tenant_groups=tenant_groups, tenant_prefix=tenant_prefix)
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        proc.start()
        unixsock.sd_notify("READY=1")       # Type=notify (vgpuhost-agent.service): listening now
        if ready is not None:
            ready(proc)
        while not stop.wait(3600):
            pass
    finally:
        proc.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return 0
