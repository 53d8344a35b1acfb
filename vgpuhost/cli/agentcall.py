"""CLI write commands through the agent: when its admin socket answers, the change is made there.

Owns: :func:`forward` (is an agent for this host root and state dir up,
and may this caller change the host through it? then send the request
and return its document) and turning the agent's error document back into
the CLI's one line and exit code (:class:`AgentError`).  With the agent
up, concurrent users serialise in one place (the agent's write lock, on
top of the file locks every path takes; lent by a change while it waits
long for one of those locks or a blocked remove).  With it down, with the global
``--local`` option, or with ``VGPUHOST_AGENT=off``, the command does the
work itself.  Commands that forward: vgpu create/remove, reconcile, apply,
passthrough prepare/release, attach/detach, tenant add/set/remove (each
has a ``/v1`` endpoint in ``vgpuhost/agent/openapi.yaml``), and mig
enable/disable/apply, scheduler set (not ``--persist``) and vgpu mode; a dry run is
always local (it changes nothing, so it needs no serialising).
Must not: decide anything; the agent runs the same ops.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ..io import agentclient
from ..model.errors import DeviceError, VgpuhostError


class AgentError(VgpuhostError):
    """The agent refused or failed the request: its message, hint and exit code, as the CLI prints them."""

    def __init__(self, error: Dict[str, Any]):
        super().__init__(str(error.get("message") or "the agent failed the request"), hint=error.get("hint"))
        code = error.get("exit_code")
        self.exit_code = code if isinstance(code, int) else 4


class Doc(dict):
    """An agent's answer as the CLI's printers read outcomes: attributes (``out.id``, nested:
    ``out.devices[0].kind``), and a dict too (``g["gpu"]``, ``.get``, ``in``, ``.items()``);
    ``as_dict()`` is the document as the agent sent it.  ``aliases`` maps an attribute the printer
    reads to the document's key (``group`` -> ``iommu_group``)."""

    def __init__(self, doc: Dict[str, Any], aliases: Optional[Dict[str, str]] = None):
        super().__init__({k: _wrap(v) for k, v in doc.items()})
        self._aliases = dict(aliases or {})
        self._doc = doc

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[self._aliases.get(name, name)]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> Dict[str, Any]:
        return self._doc


def _wrap(value: Any) -> Any:
    if isinstance(value, dict):
        return Doc(value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def forward(ctx, method: str, target: str, body: Optional[Dict[str, Any]] = None, *,
            aliases: Optional[Dict[str, str]] = None,
            accept: Optional[Callable[[Dict[str, Any]], bool]] = None,
            on_line: Optional[Callable[[Dict[str, Any]], None]] = None) -> Optional[Doc]:
    """The agent's answer to ``method target``, or None when no agent for ``ctx``'s host root and
    state dir answers as admin for this caller, when ``accept(GET /v1/agent document)`` is false,
    or ``ctx.local`` (do the work here).  ``on_line``: hears each progress line of a streamed answer
    (:func:`vgpuhost.io.agentclient.call`).  Raises
    AgentError for the agent's refusals and failures, DeviceError when it went away before
    answering."""
    if getattr(ctx, "local", False):
        return None
    path = agentclient.socket_path(ctx.host)
    if path is None:
        return None
    try:
        status, info = agentclient.call(path, "GET", "/v1/agent", timeout_s=5)
    except (agentclient.AgentDown, OSError, ValueError):
        return None
    if status != 200 or not isinstance(info, dict) or info.get("role") != "admin" \
            or info.get("root") != str(ctx.host.root) or info.get("state_dir") != str(ctx.host.state_dir):
        return None
    if accept is not None and not accept(info):
        return None
    try:
        status, doc = agentclient.call(path, method, target, body, on_line=on_line)
    except agentclient.AgentDown as e:
        raise DeviceError(f"the vgpuhost agent went away during the request ({e})",
                          hint="it finishes or rolls back what it started when it starts again; check "
                               "'vgpuhost vgpu list' and 'vgpuhost audit'") from None
    if status == 200 and isinstance(doc, dict):
        return Doc(doc, aliases)
    error = doc.get("error") if isinstance(doc, dict) else None
    if status == 404 and isinstance(error, dict) and str(error.get("message", "")).startswith("no endpoint "):
        return None             # an older agent (mid-upgrade) without this endpoint: do it here
    raise AgentError(error if isinstance(error, dict) else {"message": f"the agent answered {status}"})
