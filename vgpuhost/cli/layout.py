"""`vgpuhost` commands: plan, apply and assert (declarative host configuration), and config check.

Registered on the main group by cli/main.py: every click command in
``COMMANDS`` becomes a top-level command.  Logic lives in
:mod:`vgpuhost.config` and :mod:`vgpuhost.layout`; this module parses
options, prints and chooses the exit code:

- ``plan``: 0, or 2 when the plan is blocked (apply would refuse);
- ``apply``: 0 done (or nothing to do), 2 refused before any change
  (blocked, bad config), 3 a step failed or the host does not match after;
  through the agent when its admin socket answers (the config is read and
  checked here, then its text is sent, and the agent streams its per-step progress lines back);
- ``assert``: 0 in sync, 1 drift (the diff is printed);
- ``config check``: 0 valid, 2 not.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional

import click

from ..io.yamlutil import read_text_file
from ..model.errors import EXIT_OK, EXIT_PROBLEMS, InputError, VgpuhostError
from ..ops.layout import apply, apply_text, check, plan
from ..plan.layout import LayoutRemoveVgpu
from ..policy.config import load, parse
from .agentcall import forward
from .common import Finite, current, emit, printable, store

CONFIG_HELP = "The config file (YAML, version: 1)."


def _load(path: str):
    return load(path)


def _load_text(path: str):
    """(config, its text): the text goes to the agent, which parses it again."""
    text = read_text_file(path, "config file")
    return parse(text, source=str(path)), text


def _plan_out(ctx, p) -> None:
    emit(ctx, p.as_dict(), p.text())
    if p.blocked:
        click.echo(f"vgpuhost: error: {printable('layout ' + repr(p.layout) + ' is blocked: ' + '; '.join(p.blocked))}",
                   err=True)
        sys.exit(2)


@click.command("plan")
@click.option("-c", "--config", "config", required=True, metavar="FILE", help=CONFIG_HELP)
@click.argument("layout", required=False)
def plan_cmd(config: str, layout: Optional[str]) -> None:
    """Print the ordered steps that would bring this host to LAYOUT (default: the config's default).

    Changes nothing.  Exit 0, or 2 when the plan is blocked (apply would refuse).
    """
    ctx = current()
    cfg = _load(config)
    _plan_out(ctx, plan(ctx.host, store(ctx, write=False), cfg, layout))


@click.command("apply")
@click.option("-c", "--config", "config", required=True, metavar="FILE", help=CONFIG_HELP)
@click.argument("layout", required=False)
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing (= vgpuhost plan).")
@click.option("--retries", type=click.IntRange(0, 100), default=0, show_default=True,
              help="Try again this many times when apply fails or is refused (at boot the vGPU manager "
                   "can be late: its types are missing for a while).  The config is read once.")
@click.option("--retry-delay", type=Finite(0, 3600), default=5.0, show_default=True, metavar="SECONDS",
              help="Wait between tries.")
@click.option("-y", "--yes", is_flag=True,
              help="Remove the layout's vGPUs the plan names without asking (on a terminal apply asks first).")
def apply_cmd(config: str, layout: Optional[str], dry_run: bool, retries: int, retry_delay: float,
              yes: bool) -> None:
    """Run the plan's steps, then read the host back (exit 3 when it does not match).

    Blocked plans (devices of running VMs, vGPUs the layout did not create in
    the way) are refused before any change (exit 2).  Steps that need a
    reboot are reported, never done.  On a terminal, a plan that removes
    vGPUs is shown and confirmed first (--yes: not asked).
    """
    ctx = current()
    cfg, text = _load_text(config)
    cfg.layout(layout)                    # an unknown layout fails before the host is read
    if dry_run:
        _plan_out(ctx, plan(ctx.host, store(ctx, write=False), cfg, layout))
        return
    if not yes and interactive():
        _confirm_removals(plan(ctx.host, store(ctx, write=False), cfg, layout))
    tries = 0
    while True:
        try:
            shown = _progress(ctx)
            out = forward(ctx, "POST", "/v1/apply", dict({"config": text, "source": str(config), "layout": layout},
                                                          **({"progress": True} if shown else {})),
                          on_line=shown and (lambda d: shown(d["step"], d["steps"], d, d["state"])))
            if out is not None:             # the agent applied it: print its document as apply does
                emit(ctx, out.as_dict(), apply_text(out.as_dict()))
                return
            result = apply(ctx.host, store(ctx, write=True), cfg, layout, progress=shown)
            break
        except VgpuhostError as e:        # the config was read above; the host may not be ready yet
            if tries >= retries:
                raise
            tries += 1
            click.echo(f"vgpuhost: apply failed (try {tries} of {retries + 1}): {e.one_line()}; "
                       f"trying again in {retry_delay:g} s", err=True)
            time.sleep(retry_delay)
    emit(ctx, result.as_dict(), apply_text(result.as_dict()))


def interactive() -> bool:
    """Is someone at a terminal to answer (stdin and stderr both terminals)?"""
    return sys.stdin.isatty() and sys.stderr.isatty()


def _confirm_removals(p) -> None:
    """Ask before a plan's vGPU removals (the layout's own vGPUs only: a running domain's vGPU blocks the
    plan instead).  Declined: nothing is changed, exit 2."""
    gone = [s for s in p.steps if isinstance(s, LayoutRemoveVgpu)]
    if not gone or p.blocked:
        return
    click.echo(f"apply would remove {len(gone)} vGPU{'s' if len(gone) != 1 else ''} of layout {p.layout!r}:", err=True)
    for s in gone:
        click.echo(f"  {s.target}  {s.action}", err=True)
    if not click.confirm("Remove them?", default=False, err=True):
        raise InputError("apply cancelled at the prompt: nothing was changed",
                         hint="give --yes to apply without being asked, or --dry-run to see every step")


def _progress(ctx):
    """One line per step on stderr while apply runs, here or in the agent (its streamed progress lines):
    on a terminal, or with -v (None otherwise).  ``step``: a plan step, or a progress line's document."""
    if not (ctx.verbose or sys.stderr.isatty()):
        return None

    def line(i: int, n: int, step, state: str) -> None:
        kind, target, action = ((step["kind"], step["target"], step["action"]) if isinstance(step, dict)
                                else (step.kind, step.target, step.action))
        if state == "start":
            click.echo(f"vgpuhost: [{i}/{n}] {kind} {target}: {action} ...", err=True)
        else:
            click.echo(f"vgpuhost: [{i}/{n}] {kind} {target}: {state}", err=True)
    return line


@click.command("assert")
@click.option("-c", "--config", "config", required=True, metavar="FILE", help=CONFIG_HELP)
@click.argument("layout", required=False)
def assert_cmd(config: str, layout: Optional[str]) -> None:
    """Compare this host with LAYOUT: exit 0 in sync, 1 on drift (the diff is printed)."""
    ctx = current()
    cfg = _load(config)
    drift = check(ctx.host, store(ctx, write=False), cfg, layout)
    emit(ctx, drift.as_dict(), drift.text())
    sys.exit(EXIT_OK if drift.in_sync else EXIT_PROBLEMS)


@click.group("config")
def config_group() -> None:
    """The declarative config file."""


@config_group.command("check")
@click.option("-c", "--config", "config", required=True, metavar="FILE", help=CONFIG_HELP)
def config_check(config: str) -> None:
    """Validate a config file without a host (exit 0 valid, 2 not: FILE:LINE: what is wrong)."""
    ctx = current()
    cfg = _load(config)
    layouts = [{"name": lay.name, "entries": len(lay.entries),
                "modes": sorted({e.mode for e in lay.entries})} for lay in cfg.layouts.values()]
    doc = {"schema": "vgpuhost.config-check/v1", "source": cfg.source, "valid": True, "default": cfg.default,
           "layouts": layouts}
    lines = [f"{cfg.source}: valid, {len(layouts)} layout{'s' if len(layouts) != 1 else ''}"
             + (f" (default {cfg.default})" if cfg.default else " (no default: name one)")]
    lines += [f"  {x['name']}: {x['entries']} entr{'ies' if x['entries'] != 1 else 'y'} ({', '.join(x['modes'])})"
              for x in layouts]
    emit(ctx, doc, "\n".join(lines))


COMMANDS: List[click.Command] = [plan_cmd, apply_cmd, assert_cmd, config_group]
