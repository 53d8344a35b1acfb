"""What every ``vgpuhost`` command family shares: the global options' Context and the output helpers.

Owns: :func:`current` (the Context of the running command), :func:`emit`
(``--json`` document or text), :func:`store` (the state store, never
created by a read-only command) and :data:`pass_ctx`; re-exports
:class:`~vgpuhost.cli.context.Context` (``--root``, ``--state-dir``,
``--connect``, ``--json``, ``-v``, ``--local``), :func:`printable` (one safe line), the
``--gpu`` option's parsing (all three click-free, in
:mod:`vgpuhost.cli.context`) and :func:`actor` (who the audit log names).
Command modules import these, never each other's private names.  Must not:
hold command logic or import a command module.
"""

from __future__ import annotations

import math

import click

from ..io import files
from ..io.process import actor
from ..io.state import StateStore
from ..observe.ownable import devices_vgpuhost_may_own
from .context import Context, parse_gpu_option, printable
from .output import dumps

EXIT_INTERNAL = 4

__all__ = ["EXIT_INTERNAL", "Finite", "Context", "pass_ctx", "current", "emit", "store", "parse_gpu_option", "printable",
           "actor"]


pass_ctx = click.make_pass_decorator(Context)


class Finite(click.FloatRange):
    """A number option in ``[min, max]`` (seconds, hours, ...), refused (exit 2, one line) when it is not a
    finite number: ``nan`` passes :class:`click.FloatRange` (every comparison with NaN is false) and
    ``inf`` passes an open bound.  Every float option of the CLI uses this type (trial 9 F3)."""

    name = "number"

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


def current() -> Context:
    """The running command's :class:`Context` (the root group puts it in the click context's ``obj``)."""
    return click.get_current_context().find_object(Context)


def emit(ctx: Context, doc, text: str, json_flag: bool = False) -> None:
    """Print ``doc`` as the documented JSON (``--json`` or ``json_flag``), else ``text``."""
    click.echo(dumps(doc) if (ctx.json or json_flag) else text)


def store(ctx: Context, *, write: bool = True):
    """The state store; ``write=False`` (list, audit, checks, dry runs) never creates one.

    A write command creates the state dir (``var/lib/vgpuhost``) only under a
    host root (HostEnvironmentError, exit 2, naming ``--root``, otherwise): a
    mistyped ``--root`` must not leave a store in any directory.
    """
    if write and not files.exists(ctx.host.state_dir):
        ctx.host.require_host()
    return StateStore(ctx.host.state_dir, create=write, owned=lambda: devices_vgpuhost_may_own(ctx.host))
