"""`vgpuhost rebalance [--dry-run] [-c FILE]`: move empty GPUs toward the demand admission refused.

Logic lives in :mod:`vgpuhost.ops.rebalance` (facts, moves run as plans by the Executor) and
:mod:`vgpuhost.policy.rebalance` (the decision); this module parses options and prints.  Always
local: the agent runs the same reconciler on its own interval when its config says so.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import click

from ..model.errors import EXIT_DEVICE
from ..ops import rebalance as ops
from .common import Context, actor, emit, pass_ctx, store


@click.command("rebalance")
@click.option("--dry-run", is_flag=True, help="Print the moves and their steps; change nothing.")
@click.option("-c", "--config", "config", metavar="FILE",
              help="The reconciler's bounds (pools' min/max GPUs, quiet hours, changes per hour); default "
                   "<root>/etc/vgpuhost/rebalance.yaml, its defaults when that is missing.")
@pass_ctx
def rebalance_cmd(ctx: Context, dry_run: bool, config: Optional[str]) -> None:
    """Move empty GPUs between pools toward refused starts and rising use; never a busy GPU.

    Reads the refused admissions of the window (audit log), each pool's GPUs and metered use, and
    the operator's bounds; each move sets the GPU's scheduler to its new pool's policy and records
    the pool, as a plan run by the Executor (audited, journalled, undone on failure), only where
    every tenant's guarantee stays servable.  Exit 0; 3 when a move failed (it was undone).
    """
    ctx.host.require_host()
    bounds = ops.load_bounds(ctx.host, config)
    result = ops.rebalance(ctx.host, store(ctx, write=not dry_run), bounds, dry_run=dry_run, actor=f"{actor()} rebalance")
    emit(ctx, result.as_dict(), result.text())
    if result.failed:
        sys.exit(EXIT_DEVICE)


COMMANDS: List[click.Command] = [rebalance_cmd]
