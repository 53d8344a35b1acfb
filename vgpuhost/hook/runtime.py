"""libvirt's qemu hook, the process: make a domain's GPU devices exist at start, give them back at stop.

Owns: the hook's process runtime (:func:`main`, :func:`run`): argv, stdin,
the timeout and signals, one line on stderr and the exit code.  It is run
by the dispatcher ``hook/qemu.sh`` that ``vgpuhost hook install``
(:mod:`vgpuhost.hook.install`) places in ``/etc/libvirt/hooks/qemu.d/``.
The work is elsewhere: which devices a domain document nobody vouches for
may make vgpuhost touch, and the operator allow-list
``etc/vgpuhost/hook.allow``, in :mod:`vgpuhost.policy.hookrequest`; making
and releasing the devices in :mod:`vgpuhost.ops.devices`.
Must not: call libvirt (a hook that calls back into libvirtd deadlocks it,
docs/reference/libvirt.md); import click, lxml, yaml, jinja2 or libvirt (the hook runs
on every GPU domain start: ``python -X importtime`` keeps it lean); start a
child process; print more than one line.

libvirt facts (docs/reference/libvirt.md): argv is ``<domain name> <operation>
<sub-operation> <extra>``, stdin the domain XML.  ``prepare begin`` runs
before libvirt prepares hostdevs: the mdev must exist and the group be on
vfio-pci by then.  A non-zero exit of ``prepare`` aborts the start and
libvirt shows the hook's stderr to the user.  ``release end`` runs after
every stop, and also after a start that failed (even in ``prepare``):
release must cope with a start that never happened.  There is no timeout
in libvirt: the hook arms its own (``signal.alarm``).

What ``prepare begin`` does, for a domain whose ``<metadata>`` holds
vgpuhost's element (:mod:`vgpuhost.domxml`):

1. reads and validates the XML (expat, no DTD or entities, 4 MiB cap);
2. checks every request against the host and the domain's own hostdevs
   (:func:`vgpuhost.policy.hookrequest.check_request`) and against the records (held by another
   domain?), refuses every GPU device a hostdev names that the metadata does not declare
   (:mod:`vgpuhost.policy.hostdevs`), and resolves every profile name, all before any write;
3. records the domain as started (``StateStore.domain_started``);
4. binds each ``passthrough`` group (owner = the domain UUID; a group the
   operator bound for guests, owner ``manual`` or ``layout``, is used as it
   is and never released by the domain), then creates each vGPU: a classic
   mdev with the UUID its hostdev names, placed now by the domain's
   strategy, or the vGPU type on the VF its hostdev names;
5. on any failure removes what *this* invocation made and exits non-zero
   with one line.

A domain without vgpuhost's element that names host devices (the dispatcher hands it over when its
XML holds ``hostdev``) gets step 2's hostdev check alone, on the named devices only: a GPU device it
names is refused (exit 2, one audit row); anything else passes with nothing written.

``release end`` removes the vGPUs and releases the groups the domain's UUID
owns (owner-guarded: a late release never frees the next owner's device)
and forgets the domain; nothing recorded is a no-op.  It reads only the
domain's name and UUID from the XML: the store, not the metadata, says what
the domain holds, so metadata removed or changed while it ran (``virsh
metadata --live``), even to something ``prepare`` would refuse, releases
the same devices.

``migrate begin`` (on the destination of a live migration: libvirt passes the incoming XML on stdin and
takes a rewritten one from stdout, an empty stdout meaning unchanged) is
:func:`vgpuhost.ops.migrate.incoming`: it chooses the domain's devices on this host, rewrites what is
host-specific (a VF's address, a ``gpu=`` pin to a GPU this host cannot use) and reserves the devices
for ``prepare begin`` (docs/guide/migration.md).  It is always done here, never by the agent (the
dispatcher execs the handler for it with ``$VGPUHOST_AGENT=off``), and it imports lxml (the XML
editor), on a live migration only.

With the agent up (``vgpuhost agent``: its admin socket, ``$VGPUHOST_AGENT_SOCKET``
or ``<root>/run/vgpuhost/agent.sock``, answers), steps 2-5 are handed to it
(``POST /v1/hook/prepare`` and ``/v1/hook/release``): the agent does them
with the same code over its warm snapshot of the host, serialised with
every other change it makes, and the hook prints the agent's error line
(:func:`agent_error_line`) and exits with its exit code.  The installed sh
dispatcher makes that call itself with curl, before any Python starts, and
runs this handler only when it got no usable answer, with
``$VGPUHOST_AGENT=off``; this handler calls the agent itself only where
the dispatcher has no curl.  When nobody answers on the socket (or
``$VGPUHOST_AGENT`` is ``off``) the hook does the work itself: a domain
start never depends on the agent.

Deadlines, all the handler's own (no ``timeout`` process in front of it:
that exec and fork cost every domain start and stop about as much as 20% of
an interpreter start): ``$VGPUHOST_HOOK_TIMEOUT`` seconds after it starts
(``signal.alarm``) the work is interrupted and what this invocation made is
undone; a rollback still running :data:`BACKSTOP_EXTRA_S` later is
interrupted again; and :data:`BACKSTOP_KILL_S` after that a watchdog thread
in C (:func:`vgpuhost.io.process.exit_after`) ends the
process with ``_exit(1)`` even when it is stuck in C code that never
returns to the interpreter (an SQLite busy wait), where a Python signal
handler cannot run.

Exit codes: 0 done or nothing to do; 1 the watchdog ended a handler stuck
past every deadline; 2 refused or bad input (nothing changed); 3 a device
operation failed or the hook timed out (what this invocation made was
undone); 4 internal error.
"""


from __future__ import annotations

import _signal as signal    # the C module: ``signal`` wraps it in enums (import enum: ~1 ms a start)
import os
import sys
from time import monotonic

from ..io.hostroot import HostRoot
from ..io.locks import deadline
from ..io.process import actor as actor_name, exit_after
from ..model.errors import EXIT_DEVICE, EXIT_INPUT, EXIT_OK, VgpuhostError
from ..ops.devices import open_store, prepare, release

TYPE_CHECKING = False
if TYPE_CHECKING:   # only for annotations: never imported on the hook path
    from typing import BinaryIO, List, Optional, TextIO
    from ..io.state import StateStore

EXIT_INTERNAL = 4
ENV_TIMEOUT = "VGPUHOST_HOOK_TIMEOUT"
DEFAULT_TIMEOUT_S = 60
MAX_TIMEOUT_S = 3600
#: the backstops after the handler's own alarm: interrupted again this long after it, then ended
#: (``_exit(1)``, by a watchdog thread in C) this long after that
BACKSTOP_EXTRA_S = 30
BACKSTOP_KILL_S = 5
ACTS = {("prepare", "begin"): "prepare", ("release", "end"): "release", ("migrate", "begin"): "migrate"}


class HookTimeout(Exception):
    """The handler ran past its timeout (``signal.alarm``) or was sent SIGTERM.

    Not a VgpuhostError on purpose: it unwinds through the ``except
    BaseException`` rollback paths of passthrough and of :func:`prepare`.
    """


# ---------------------------------------------------------------------------
# entry points

def run() -> None:
    """``python -m vgpuhost.hook NAME OP SUBOP EXTRA`` and the dispatcher's entry: exits with main's code.

    Exits with ``os._exit`` once stdout and stderr are flushed: everything
    the hook wrote is committed by then (SQLite transactions, kernel
    writes, renames), and skipping the interpreter's teardown (module and
    object finalisation) saves milliseconds on every domain start and stop.
    Arms the watchdog first (module docstring: deadlines).
    """
    exit_after(_timeout_s() + BACKSTOP_EXTRA_S + BACKSTOP_KILL_S)      # the watchdog (io/process.py)
    if sys.stdin is None:               # started with no stdin at all: an empty document
        import io
        stdin = io.BytesIO()
    else:
        stdin = sys.stdin.buffer
    code = main(sys.argv[1:], stdin)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: List[str], stdin: BinaryIO, stderr: Optional[TextIO] = None,
         host: Optional[HostRoot] = None, stdout: Optional[TextIO] = None) -> int:
    """Handle one hook call: ``argv`` = ``[domain name, operation, sub-operation, extra]``.

    Only ``prepare begin``, ``release end`` and ``migrate begin`` act (and read ``stdin``, at
    most :data:`READ_LIMIT` bytes); every other call returns 0 at
    once.  ``migrate begin`` (the destination of a live migration, :func:`vgpuhost.ops.migrate.incoming`)
    prints the rewritten domain XML on ``stdout`` (default ``sys.stdout``), or nothing when it is
    unchanged, as libvirt's hook contract allows; it is always done here, never by the agent.
    Failures print one line on ``stderr`` (default ``sys.stderr``)
    and return the exit code (module docstring); nothing raises.
    """
    err = stderr if stderr is not None else sys.stderr
    if len(argv) < 3:
        _say(err, "usage: vgpuhost-hook DOMAIN OPERATION SUB-OPERATION [EXTRA] (the domain XML on stdin)")
        return EXIT_INPUT
    name, act = argv[0], ACTS.get((argv[1], argv[2]))
    if act is None:
        return EXIT_OK
    timeout_s = _timeout_s()
    started = monotonic()
    armed = {"live": True}
    old = _arm(timeout_s, armed)
    try:
        host = host or HostRoot.from_env()
        data = stdin.read(READ_LIMIT)
        store = None
        if act == "migrate":
            from ..ops.migrate import incoming
            with deadline(started + timeout_s - 1):
                xml = incoming(host, data, actor=actor_name(f"hook {_printable(name, 80)}", with_uid=False))
            armed["live"] = False
            if xml:
                out = stdout if stdout is not None else sys.stdout
                out.write(xml if xml.endswith("\n") else xml + "\n")
                out.flush()
            return EXIT_OK
        if act == "prepare":
            from ..libvirt.domxml import parse_domain
            view = parse_domain(data)
            name = view.name or name
            ask = view.metadata is not None and not view.metadata.empty
        else:
            view, ask = None, True          # the store, not the XML, says what a domain holds: always ask
        if ask:
            answered = _via_agent(host, act, name, data, err, timeout_s)
            if answered is not None:
                armed["live"] = False
                return answered
        if view is None:
            # release frees what the store says this UUID holds: the XML's metadata may be gone or changed by now
            store = open_store(host)
            view = released_domain(data, name, store) if store is not None else None
            if view is None:
                from ..libvirt.domxml import parse_domain_identity
                view = parse_domain_identity(data)
            name = view.name or name
        actor = actor_name(f"hook {_printable(name, 80)}", with_uid=False)
        if act == "prepare":
            # a lock another operation holds (the host lock admission decides under, a GPU's) is waited
            # for only until just before the alarm: the start then ends as transient (exit 5), not timed out
            with deadline(started + timeout_s - 1):
                prepare(host, view, actor=actor)
        else:
            # a remove write a holder blocks ends before the alarm (io/vfioholders.remove_timeout_s), so
            # its journal entry is kept pending and the domain forgotten, never cut short mid-record
            with deadline(started + timeout_s - 1):
                release(host, view, actor=actor, store=store)
        armed["live"] = False               # done: a signal arriving now changes nothing
        return EXIT_OK
    except HookTimeout as e:
        done = ("what this start had made was undone" if act == "prepare" else
                "the incoming migration is cancelled (a reservation it made is freed by libvirt's release end "
                "or 'vgpuhost reconcile')" if act == "migrate" else
                "a vGPU removal it began stays pending ('vgpuhost reconcile' finishes it once the device "
                "is closed)")
        _say(err, f"vgpuhost: error: domain {name!r}: {e}; {done}; "
                  "check 'vgpuhost audit' and whether another vgpuhost operation holds a lock")
        return EXIT_DEVICE
    except VgpuhostError as e:
        _say(err, f"vgpuhost: error: domain {name!r}: {e.one_line()}")
        return e.exit_code
    except Exception as e:      # sqlite3.Error, OSError, a bug: still one line
        if type(e).__module__ == "sqlite3":
            from ..io.state import store_error
            _say(err, f"vgpuhost: error: domain {name!r}: {store_error('state.db', e).one_line()}")
            return EXIT_INPUT
        if isinstance(e, OSError):
            _say(err, f"vgpuhost: error: domain {name!r}: {e.strerror or e}"
                      f"{': ' + str(e.filename) if e.filename else ''}; check the path and its permissions")
            return EXIT_INPUT
        _say(err, f"vgpuhost: internal error in the qemu hook: {type(e).__name__}: {e} (report it; "
                  f"'python -m vgpuhost.hook NAME {argv[1]} {argv[2]} -' with the domain XML on stdin reproduces it)")
        return EXIT_INTERNAL
    finally:
        armed["live"] = False
        _disarm(old)


#: bytes of the domain XML read: one more than libvirt/domxml.py's MAX_XML_BYTES (4 MiB), which refuses a
#: larger document (a copy: the hook's stop imports no domxml; tests/test_hook_release_uuid.py checks it)
READ_LIMIT = 4 * 1024 * 1024 + 1


class _Released:
    """The domain ``release end`` names, found by :func:`released_domain`: all
    :func:`~vgpuhost.ops.devices.release` reads of a DomainView (the store, not the XML, says what it holds)."""

    name = None             # libvirt's argument names it
    metadata = None

    def __init__(self, uuid: str):
        self.uuid = uuid


def released_domain(data: bytes, name: str, store: "StateStore") -> "Optional[_Released]":
    """The domain a ``release end`` names, without parsing the XML ``data`` (no expat, no domxml: about
    0.9 ms of each stop, measured 2026-12-01), or None (then parse it).

    Taken only when a text scan can place the domain's UUID: the document is whole (within the size
    limit, ending with ``</domain>``: a cut one is left to the parser, which refuses it), holds no markup
    a scan cannot place (``<!``: comments, CDATA, declarations; ``<?``: processing instructions; libvirt
    writes none) and ``<uuid`` once, as ``<uuid>``; and the store recorded that UUID as started under
    ``name``, the name libvirt gives the hook (a document crafted to show another domain's UUID never
    names that domain).  The hook's handler and the agent both decide this way, so a document decides
    the same with the agent up or down.
    """
    if not name or len(data) >= READ_LIMIT or b"<!" in data or b"<?" in data:
        return None
    if not data.rstrip().endswith(b"</domain>"):
        return None
    at = data.find(b"<uuid")
    if at < 0 or data.find(b"<uuid", at + 5) >= 0 or data[at + 5:at + 6] != b">":
        return None
    end = data.find(b"</uuid>", at + 6)
    if end < 0:
        return None
    from ..model.values import parse_uuid
    try:
        uuid = parse_uuid(data[at + 6:end].decode("ascii"))
    except (UnicodeDecodeError, VgpuhostError):
        return None
    if store.active_domains().get(uuid) != name:
        return None
    return _Released(uuid)


def _via_agent(host: HostRoot, act: str, name: str, data: bytes, err: TextIO, timeout_s: int) -> "Optional[int]":
    """Hand the call to the agent: its exit code, or None when no agent answers (do it here)."""
    if os.environ.get("VGPUHOST_AGENT", "").lower() in ("off", "0", "no"):
        return None                 # io.agentclient.disabled(), before importing it: the dispatcher's fallback
    from ..io import agentclient
    path = agentclient.socket_path(host)
    if path is None:
        return None
    try:
        xml = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    try:
        status, doc = agentclient.call(path, "POST", f"/v1/hook/{act}",
                                       {"xml": xml, "name": name, "root": host.s.root,
                                        "state_dir": host.s.state_dir, "timeout_s": str(timeout_s + 5)},
                                       timeout_s=timeout_s + 5)
    except (agentclient.AgentDown, OSError, ValueError):
        return None                 # down, not ours to use, or a garbled answer: the hook does it itself
    if status == 200:
        return EXIT_OK
    if status in FALLBACK_STATUSES:
        return None                 # an agent that may not or cannot take it: the hook does it itself
    problem = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(problem, dict) or not isinstance(problem.get("exit_code"), int):
        return None
    _say(err, agent_error_line(name, problem["exit_code"], problem.get("line")))
    return int(problem["exit_code"])


#: agent answers that mean "not this agent's to do" (role, path, method, body, another root): do it here
FALLBACK_STATUSES = (403, 404, 405, 411, 413, 415, 421, 429)


def agent_error_line(name: str, exit_code: int, line: object) -> str:
    """The one stderr line for an error the agent answered (exit code ``exit_code``, its ``line``):
    what the hook prints when it did the work itself, the agent's internal errors named as such.
    Control characters escaped, at most 2000 characters."""
    if exit_code == EXIT_INTERNAL:
        text = f"vgpuhost: internal error in the vgpuhost agent (qemu hook): {line}"
        if "report it" not in str(line):
            text += " (report it)"
    else:
        text = f"vgpuhost: error: domain {name!r}: {line}"
    return _printable(text, 2000)


def _say(err: TextIO, line: str) -> None:
    try:
        err.write(_printable(line, 2000) + "\n")
        err.flush()
    except (OSError, ValueError):
        pass


def _printable(text: str, limit: int) -> str:
    """One line: control characters escaped, length capped (libvirt shows it to the user)."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return out if len(out) <= limit else out[:limit] + "..."


def _timeout_s() -> int:
    raw = os.environ.get(ENV_TIMEOUT, "")
    try:
        value = int(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        value = DEFAULT_TIMEOUT_S
    return min(max(value, 1), MAX_TIMEOUT_S)


def _arm(timeout_s: int, armed: dict):
    """SIGALRM after ``timeout_s`` and SIGTERM both raise :class:`HookTimeout` while ``armed['live']``;
    the alarm re-arms itself for :data:`BACKSTOP_EXTRA_S` more (a rollback that hangs is interrupted
    too); returns what to restore."""
    def on_alarm(signum, frame):
        if armed["live"]:
            signal.alarm(BACKSTOP_EXTRA_S)
            raise HookTimeout(f"the vgpuhost hook timed out after {timeout_s} s")

    def on_term(signum, frame):
        if armed["live"]:
            raise HookTimeout("the vgpuhost hook was terminated (SIGTERM)")

    try:
        old = (signal.signal(signal.SIGALRM, on_alarm), signal.signal(signal.SIGTERM, on_term))
    except ValueError:          # not the main thread (tests calling main from a thread): no timeout
        return None
    signal.alarm(timeout_s)
    return old


def _disarm(old) -> None:
    if old is None:
        return
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old[0])
    signal.signal(signal.SIGTERM, old[1])


if __name__ == "__main__":
    run()
