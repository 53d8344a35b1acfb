"""The lean read commands: ``vgpuhost [--root DIR] [--json] types|gpus ...`` without click.

Owns: :func:`match`, which recognises a plain read command line and gives
the job that runs it without loading click or the write paths (the console
entry point :func:`vgpuhost.cli.entry.run` and :func:`vgpuhost.cli.main.main`
both use it), and the body of ``types`` (:func:`types_output`), which the
click command calls too, so both paths print the same bytes
(tests/test_cli_lean.py compares them).

The fast path takes only what it parses exactly: the global options
``--root``, ``--state-dir``, ``--json`` and ``--local``, then ``types`` with ``--gpu`` and
``--available``, or ``gpus``; each option at most once, values not starting
with ``-``.  Anything
else (``-v``, ``--help``, another command, a repeated option) is click's.
Errors are reported by :func:`vgpuhost.cli.main.report`, as for any command.
Must not: import click at module level.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple
    from .context import Context

_GLOBAL_VALUES = ("--root", "--state-dir")
_GLOBAL_FLAGS = ("--json", "--local")


def _options(args: List[str], valued: Tuple[str, ...], flags: Tuple[str, ...],
             to_command: bool) -> Optional[Tuple[Dict[str, Any], List[str]]]:
    """``({option: value or True}, rest)`` from the front of ``args``, up to the first word that is
    no option (``to_command``: it must come) or to the end; None when anything is not plainly one
    of ``valued`` / ``flags``, given once, with a value not starting with ``-``."""
    got: Dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if to_command and not a.startswith("-"):
            return got, args[i:]
        name, eq, value = a.partition("=")
        if name in valued:
            if not eq:
                if i + 1 >= len(args):
                    return None
                value = args[i + 1]
                i += 1
            if not value or value.startswith("-") or name in got:
                return None
            got[name] = value
        elif a in flags and a not in got:
            got[a] = True
        else:
            return None
        i += 1
    return None if to_command else (got, [])


def hoist_json(argv):
    """``argv`` with a ``--json`` given after the command moved before it, where the global option lives
    (``vgpuhost types --json`` = ``vgpuhost --json types``; a command's own ``--json`` means the same).
    Tokens after ``--`` are left alone.  None stays None."""
    if argv is None:
        return None
    args = list(argv)
    i = 0
    while i < len(args) and args[i].startswith("-"):     # the global options
        i += 2 if args[i] in ("--root", "--state-dir", "--connect", "-c") else 1
    if i >= len(args):
        return args
    head, tail, moved = args[:i], [], False
    for j, a in enumerate(args[i:]):
        if a == "--":
            tail.extend(args[i + j:])
            break
        if a == "--json":
            moved = True
            continue
        tail.append(a)
    return (["--json"] if moved and "--json" not in head else []) + head + tail


def match(argv: List[str]) -> Optional[Callable[[], str]]:
    """The job for a plain read command line (it returns the text to print), else None.

    Read commands: ``types [--gpu BDF] [--available]`` and ``gpus``.
    """
    front = _options(argv, _GLOBAL_VALUES, _GLOBAL_FLAGS, True)
    if front is None:
        return None
    glob, rest = front
    command = _COMMANDS.get(rest[0])
    if command is None:
        return None
    valued, flags, body = command
    tail = _options(rest[1:], valued, flags, False)
    if tail is None:
        return None
    opts = tail[0]

    def job() -> str:
        from .context import Context
        ctx = Context(glob.get("--root"), glob.get("--state-dir"), None, bool(glob.get("--json")), 0,
                      bool(glob.get("--local")))
        doc, text = body(ctx, opts)
        if ctx.json:
            from .output import dumps
            return dumps(doc)
        return text
    return job


def types_output(ctx: Context, gpu: Optional[str], available: bool) -> Tuple[dict, str]:
    """``vgpuhost types``: the ``vgpuhost.types/v1`` document and the table (or "no vGPU types") with its
    notes, as :func:`vgpuhost.present.inventory.types_listing` builds them (the agent's ``GET /v1/types``
    calls it too, on its snapshot)."""
    from .context import parse_gpu_option
    from ..present.inventory import types_listing
    from .output import types_table
    parse_gpu_option(ctx, None, gpu)          # a bad BDF fails before the host is read
    # GPUs, their types and vGPUs: no /proc, no other devices; no NVML (a GPU lost and not recorded yet
    # still lists its types here: capacity, placement and the exporter ask NVML)
    inv = ctx.inventory(scope="vgpu", nvml_lost=False)
    addr = parse_gpu_option(ctx, inv, gpu)
    doc, notes = types_listing(ctx.host, inv, addr, available=available)
    text = types_table(doc["types"]) if doc["types"] else "no vGPU types"
    return doc, "\n".join([text] + notes)


def gpus_output(ctx: Context) -> Tuple[dict, str]:
    """``vgpuhost gpus``: the ``vgpuhost.gpus/v1`` document and the table (or "no NVIDIA GPU found")."""
    from .output import gpus_doc, gpus_table
    inv = ctx.inventory()
    return gpus_doc(inv), (gpus_table(inv) if inv.gpus else "no NVIDIA GPU found")


#: command -> (options with a value, flags, body(ctx, {option: value}) -> (document, text))
_COMMANDS = {
    "types": (("--gpu",), ("--available",),
              lambda ctx, o: types_output(ctx, o.get("--gpu"), bool(o.get("--available")))),
    "gpus": ((), (), lambda ctx, o: gpus_output(ctx)),
}
