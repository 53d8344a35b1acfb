"""`vgpuhost mig show|enable|disable|apply|assert`: MIG mode and GPU-instance layouts.

``show`` / ``enable`` / ``disable`` / ``apply`` / ``assert`` over
:mod:`vgpuhost.mig`.  NVML comes from :func:`vgpuhost.io.backends.open_backend`: on a
host without NVML every command prints one line and exits 2.  ``--json``
documents: ``vgpuhost.mig-show/v1``, ``vgpuhost.mig/v1`` (enable, disable,
apply), ``vgpuhost.mig-assert/v1``.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import click

from ..model.errors import EXIT_OK, EXIT_PROBLEMS
from ..model.values import PciAddress
from ..io.process import actor
from ..ops.mig import MigOutcome, apply, assert_layout, disable, enable, show, show_text
from ..ops.migdemand import set_opt_in
from ..policy.mig import layout_text, parse_layout
from .agentcall import forward
from .common import emit, store

LAYOUT_HELP = "PROFILE=COUNT,... as the device names its profiles, e.g. 3g.71gb=1,2g.35gb=1,1g.18gb=1"


def _outcome(ctx, out) -> None:
    if ctx.json:
        emit(ctx, out.as_dict(), "")
        return
    lines = []
    mode = out.mig_mode or {}
    state = ("on" if mode.get("current") else "off") if mode else "?"
    if mode and mode.get("current") != mode.get("pending"):
        state += f", {'on' if mode.get('pending') else 'off'} pending a GPU reset"
    if out.action == "apply":
        verb = "would apply" if out.dry_run else ("applied" if out.changed else "no change:")
        lines.append(f"{verb} {layout_text(out.layout_after)} on {out.gpu} ({out.name}; was "
                     f"{layout_text(out.layout_before)})")
    else:
        verb = f"would {out.action}" if out.dry_run else (f"{out.action}d" if out.changed else "no change:")
        lines.append(f"{verb} MIG mode on {out.gpu} ({out.name}): MIG {state}")
    if out.steps:
        lines.append("would:" if out.dry_run else "did:")
        lines += [f"  {s}" for s in out.steps]
    lines += [f"note: {n}" for n in out.notes]
    click.echo("\n".join(lines))


def _through_agent(ctx, target: str, body: dict, dry_run: bool) -> bool:
    """A MIG change through the agent when it answers (never a dry run); printed as here."""
    if dry_run:
        return False
    out = forward(ctx, "POST", target, body)
    if out is None:
        return False
    _outcome(ctx, out)
    return True


def _addr(text: str):
    return PciAddress.parse(text)


@click.group(name="mig")
def mig() -> None:
    """MIG mode and GPU-instance layouts (through NVML)."""


@mig.command("show")
@click.option("--gpu", metavar="BDF", help="Only this GPU (dddd:bb:ss.f).")
@click.pass_context
def mig_show(cctx: click.Context, gpu: Optional[str]) -> None:
    """MIG mode (current, pending), GPU instances and profiles per GPU."""
    ctx = cctx.obj
    addr = _addr(gpu) if gpu else None
    doc = show(ctx.host, addr)
    emit(ctx, doc, show_text(doc))


@mig.command("enable")
@click.option("--gpu", "gpu", required=True, metavar="BDF", help="The GPU (dddd:bb:ss.f).")
@click.option("--dry-run", is_flag=True, help="Show the steps; change nothing.")
@click.pass_context
def mig_enable(cctx: click.Context, gpu: str, dry_run: bool) -> None:
    """Enable MIG mode (refused while vGPUs, processes or VFs block it)."""
    ctx = cctx.obj
    addr = _addr(gpu)
    if not _through_agent(ctx, f"/v1/mig/{addr}/enable", {}, dry_run):
        _outcome(ctx, enable(ctx.host, store(ctx, write=not dry_run), addr, dry_run=dry_run))


@mig.command("disable")
@click.option("--gpu", "gpu", required=True, metavar="BDF", help="The GPU (dddd:bb:ss.f).")
@click.option("--dry-run", is_flag=True, help="Show the steps; change nothing.")
@click.pass_context
def mig_disable(cctx: click.Context, gpu: str, dry_run: bool) -> None:
    """Disable MIG mode, destroying the GPU instances first."""
    ctx = cctx.obj
    addr = _addr(gpu)
    if not _through_agent(ctx, f"/v1/mig/{addr}/disable", {}, dry_run):
        _outcome(ctx, disable(ctx.host, store(ctx, write=not dry_run), addr, dry_run=dry_run))


@mig.command("apply")
@click.option("--gpu", "gpu", required=True, metavar="BDF", help="The GPU (dddd:bb:ss.f).")
@click.argument("layout", metavar="LAYOUT")
@click.option("--dry-run", is_flag=True, help="Show the placements and steps; change nothing.")
@click.pass_context
def mig_apply(cctx: click.Context, gpu: str, layout: str, dry_run: bool) -> None:
    """Make the GPU instances match LAYOUT (no-op when they do).

    LAYOUT: PROFILE=COUNT,... as the device names its profiles, e.g.
    3g.71gb=1,2g.35gb=1,1g.18gb=1; 'none' destroys every GPU instance.
    """
    ctx = cctx.obj
    addr = _addr(gpu)
    parse_layout(layout)                       # a malformed layout fails before the host is read
    if not _through_agent(ctx, f"/v1/mig/{addr}/apply", {"layout": layout}, dry_run):
        _outcome(ctx, apply(ctx.host, store(ctx, write=not dry_run), addr, layout, dry_run=dry_run, adopt=True))


@mig.command("assert")
@click.option("--gpu", "gpu", required=True, metavar="BDF", help="The GPU (dddd:bb:ss.f).")
@click.argument("layout", metavar="LAYOUT")
@click.pass_context
def mig_assert(cctx: click.Context, gpu: str, layout: str) -> None:
    """Exit 0 when the GPU instances match LAYOUT, 1 on drift (with the difference)."""
    ctx = cctx.obj
    addr = _addr(gpu)
    parse_layout(layout)
    rep = assert_layout(ctx.host, addr, layout)
    if rep.in_sync:
        text = f"{addr}: in sync ({layout_text(rep.actual)})"
    else:
        lines = [f"{addr}: DRIFT (wanted {layout_text(rep.wanted)}, found {layout_text(rep.actual)})"]
        lines += [f"  {d['profile']}: wanted {d['wanted']}, found {d['actual']}" for d in rep.diff]
        text = "\n".join(lines)
    emit(ctx, rep.as_dict(), text)
    sys.exit(EXIT_OK if rep.in_sync else EXIT_PROBLEMS)


COMMANDS: List[click.Command] = [mig]


@mig.command("on-demand")
@click.option("--gpu", "gpu", required=True, metavar="BDF", help="The GPU (dddd:bb:ss.f).")
@click.argument("state", type=click.Choice(["on", "off"]))
@click.pass_context
def mig_on_demand(cctx: click.Context, gpu: str, state: str) -> None:
    """Turn MIG on demand on or off for a GPU.

    On: at a domain's start (the qemu hook's prepare begin) a MIG-backed vGPU
    that no free GPU instance takes gets one made where a free slice range
    allows it, and it is destroyed at the domain's stop (release end).
    """
    ctx = cctx.obj
    addr = _addr(gpu)
    changed = set_opt_in(ctx.host, store(ctx, write=True), addr, state == "on", actor=actor())
    out = MigOutcome(f"on-demand {state}", str(addr), changed=changed, dry_run=False)
    out.notes.append(f"MIG on demand is {state} on {addr}" + ("" if changed else " already"))
    if ctx.json:
        emit(ctx, out.as_dict(), "")
        return
    click.echo(out.notes[0])
