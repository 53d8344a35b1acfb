"""`vgpuhost gpu cordon|uncordon|drain BDF`: take a GPU out of service for maintenance, bring it back.

Logic lives in :mod:`vgpuhost.ops.health`; this module parses options and prints.
cordon and uncordon go through the agent when its admin socket answers (:mod:`.agentcall`);
a dry run and drain (which changes nothing) are always local.
"""

from __future__ import annotations

from typing import List

import click

from ..model.errors import InputError
from ..model.values import PciAddress
from ..ops import health
from .agentcall import forward
from .common import Context, actor, emit, pass_ctx, store

SCHEMA_HEALTH = "vgpuhost.gpu-health/v1"
SCHEMA_DRAIN = "vgpuhost.gpu-drain/v1"


def _gpu_arg(bdf: str) -> PciAddress:
    """The BDF argument, exactly ``dddd:bb:ss.f``: surrounding white space is refused (InputError, exit 2)
    as any other stray character is, not stripped."""
    if bdf != bdf.strip():
        raise InputError(f"invalid PCI address {bdf!r}: white space around it",
                         hint="expected the full form dddd:bb:ss.f, e.g. 0000:41:00.0")
    return PciAddress.parse(bdf)


@click.group()
def gpu() -> None:
    """A GPU's service state: cordon it for maintenance, drain what it holds, uncordon it after a check."""


def _health_text(action: str, doc: dict) -> str:
    gpu_ = doc["gpu"]
    if doc.get("dry_run"):
        verb = "would " + action if doc["changed"] else f"no change: {gpu_} is already {action}ed"
        return f"{gpu_}: {verb}" if doc["changed"] else verb
    if not doc["changed"]:
        return f"no change: {gpu_} is {'in service' if doc['in_service'] else 'out of service already'}"
    if action == "cordon":
        held = doc.get("holders") or []
        line = f"{gpu_}: cordoned ({doc['reason']}); no new vGPU is placed on it"
        if held:
            line += f"\nnote: {len(held)} holder(s) still use it: 'vgpuhost gpu drain {gpu_}' says what each needs"
        return line
    return f"{gpu_}: health check passed; back in service"


@gpu.command("cordon")
@click.argument("bdf")
@click.option("--reason", metavar="TEXT", default="",
              help="Why: one line, at most 512 characters (kept in the state store; for a GPU that failed "
                   "already, in the audit log beside its failure).")
@click.option("--dry-run", is_flag=True, help="Say what would change; change nothing.")
@pass_ctx
def gpu_cordon(ctx: Context, bdf: str, reason: str, dry_run: bool) -> None:
    """Take BDF out of placement by hand (maintenance); what it holds keeps running."""
    addr = _gpu_arg(bdf)
    doc = None
    if not dry_run:
        doc = forward(ctx, "POST", f"/v1/gpus/{addr}/cordon", {"reason": reason})
    if doc is None:
        doc = health.cordon(ctx.host, store(ctx, write=not dry_run), ctx.inventory(), addr, reason=reason,
                            actor=actor(), dry_run=dry_run)
        doc = {"schema": SCHEMA_HEALTH, "action": "cordon", **doc}
    else:
        doc = doc.as_dict()
    emit(ctx, doc, _health_text("cordon", doc))


@gpu.command("uncordon")
@click.argument("bdf")
@click.option("--dry-run", is_flag=True, help="Run the health check and say what would change; change nothing.")
@pass_ctx
def gpu_uncordon(ctx: Context, bdf: str, dry_run: bool) -> None:
    """Bring BDF back into placement after a health check (refused, exit 2, while the check fails)."""
    addr = _gpu_arg(bdf)
    doc = None
    if not dry_run:
        doc = forward(ctx, "POST", f"/v1/gpus/{addr}/uncordon", {})
    if doc is None:
        doc = health.uncordon(ctx.host, store(ctx, write=not dry_run), ctx.inventory(), addr, actor=actor(),
                              nvml=health.nvml_or_none(ctx.host), dry_run=dry_run)
        doc = {"schema": SCHEMA_HEALTH, "action": "uncordon", **doc}
    else:
        doc = doc.as_dict()
    emit(ctx, doc, _health_text("uncordon", doc))


def _drain_text(doc: dict) -> str:
    head = f"{doc['gpu']}: " + ("in service" if doc["in_service"] else
                                 f"out of service ({doc['reason']})" if doc.get("reason") else "out of service")
    if not doc["domains"]:
        return head + "; nothing holds it"
    lines = [head + f"; held by {len(doc['domains'])} device(s) (vgpuhost stops no VM):"]
    for d in doc["domains"]:
        who = d["name"] or d["domain"]
        state = "running" if d["running"] else "not running"
        fits = ", ".join(d["fits_on"]) if d["fits_on"] else "no other GPU here now"
        lines.append(f"  {who} ({state}) {d['kind']} {d['device']}: {d['needs']}"
                     + (f"; fits here on: {fits}" if d["kind"] == "vgpu" else ""))
    return "\n".join(lines)


@gpu.command("drain")
@click.argument("bdf")
@pass_ctx
def gpu_drain(ctx: Context, bdf: str) -> None:
    """List the domains that hold BDF and what each needs to move; changes nothing, stops no VM."""
    addr = _gpu_arg(bdf)
    doc = {"schema": SCHEMA_DRAIN, **health.drain(store(ctx, write=False), ctx.inventory(), addr, ctx.host)}
    emit(ctx, doc, _drain_text(doc))


COMMANDS: List[click.Command] = [gpu]
