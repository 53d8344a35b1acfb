"""What every ``vgpuhost`` command family shares: the global options' Context and the output helpers.

Owns: :class:`Context` (``--root``, ``--state-dir``, ``--connect``,
``--json``, ``-v``, ``--local``), :func:`current` (the Context of the running command),
:func:`emit` (``--json`` document or text), :func:`store` (the state
store, never created by a read-only command), :func:`printable` (one safe
line), :func:`actor` (who the audit log names) and the ``--gpu`` option's
parsing.  Command modules import these, never each other's private names.
Must not: hold command logic or import a command module.
"""

from __future__ import annotations

from typing import Optional

import click

from ..io.hostroot import HostRoot
from ..io.process import actor
from ..model.errors import InputError

EXIT_INTERNAL = 4

__all__ = ["EXIT_INTERNAL", "Context", "pass_ctx", "current", "emit", "store", "parse_gpu_option", "printable",
           "actor"]


class Context:
    """What the global options set: the host root and output mode."""

    def __init__(self, root: Optional[str], state_dir: Optional[str], connect: Optional[str],
                 json_out: bool, verbose: int, local: bool = False):
        self._root = root
        self.local = local              # --local: write commands never go through the agent
        self._state_dir = state_dir
        self.connect = connect
        self.json = json_out
        self.verbose = verbose
        self._host: Optional[HostRoot] = None

    @property
    def host(self) -> HostRoot:
        if self._host is None:
            self._host = HostRoot.from_env(self._root, self._state_dir)
        return self._host

    def sysfs(self):
        from ..io.sysfs import Sysfs
        return Sysfs(self.host)

    def inventory(self, *, with_types: bool = True):
        from ..observe.inventory import discover
        self.host.require_host()
        return discover(self.sysfs(), with_types=with_types)


pass_ctx = click.make_pass_decorator(Context)


def current() -> Context:
    """The running command's :class:`Context` (the root group puts it in the click context's ``obj``)."""
    return click.get_current_context().find_object(Context)


def emit(ctx: Context, doc, text: str, json_flag: bool = False) -> None:
    """Print ``doc`` as the documented JSON (``--json`` or ``json_flag``), else ``text``."""
    from .output import dumps
    click.echo(dumps(doc) if (ctx.json or json_flag) else text)


def store(ctx: Context, *, write: bool = True):
    """The state store; ``write=False`` (list, audit, checks, dry runs) never creates one."""
    from ..io.state import StateStore
    from ..observe.ownable import devices_vgpuhost_may_own
    return StateStore(ctx.host.state_dir, create=write, owned=lambda: devices_vgpuhost_may_own(ctx.host))


def parse_gpu_option(ctx: Context, inv, gpu: Optional[str]):
    """``--gpu BDF`` as a PciAddress (None when not given); with ``inv``, InputError unless it is an NVIDIA GPU."""
    if gpu is None:
        return None
    from ..model.values import PciAddress
    addr = PciAddress.parse(gpu)
    if inv is not None and inv.gpu(addr) is None:
        known = ", ".join(str(g.address) for g in inv.gpus) or "none"
        raise InputError(f"no NVIDIA GPU at {addr}", hint=f"GPUs on this host: {known} ('vgpuhost gpus')")
    return addr


def printable(text: str, limit: int = 2000) -> str:
    """One line: control characters escaped (no terminal escapes from files), length capped."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return out if len(out) <= limit else out[:limit] + "..."
