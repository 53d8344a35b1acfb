"""`vgpuhost scheduler show|set|decode`: the vGPU scheduler.

Logic lives in :mod:`vgpuhost.ops.scheduler`; this module parses options and
prints.  :func:`runtime_outcome` also prints ``vgpuhost vgpu mode``
(:mod:`vgpuhost.cli.vgpu`).
"""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import click

from ..model.concepts import SchedulerPolicy
from ..model.errors import EXIT_OK, EXIT_PROBLEMS, InputError
from ..model.values import PciAddress
from ..ops.scheduler import (
    persist as do_persist, refuse_boards_without_vgpu, resolve_gpus, set_runtime, show, show_text
)
from ..policy.scheduler import explain, explain_doc, parse_value, validate
from ..present.scheduler import scheduler_state
from .agentcall import forward
from .common import current, emit, store


@click.group(name="scheduler")
def scheduler() -> None:
    """vGPU scheduler: best effort, equal share, fixed share (runtime via NVML or persistent via modprobe.d)."""


@scheduler.command("show")
@click.option("--gpu", metavar="BDF", help="Only this GPU (dddd:bb:ss.f).")
def scheduler_show(gpu: Optional[str]) -> None:
    """Each GPU's scheduler state, capabilities and the persistent RmPVMRL value."""
    ctx = current()
    addr = PciAddress.parse(gpu) if gpu else None
    doc = show(ctx.host, addr)
    emit(ctx, doc, show_text(doc))


@scheduler.command("set")
@click.option("--policy", required=True, type=click.Choice(SchedulerPolicy.values()))
@click.option("--timeslice-ms", type=int, metavar="N", help="Time slice without adaptive round robin (1..30).")
@click.option("--frequency-hz", type=int, metavar="N", help="ARR scheduling frequency (63..960); with --avg-factor.")
@click.option("--avg-factor", type=int, metavar="N", help="ARR averaging factor (1..60); with --frequency-hz.")
@click.option("--gpu", "gpus", multiple=True, metavar="BDF", help="This GPU (repeatable).")
@click.option("--all", "all_gpus", is_flag=True, help="Every NVIDIA GPU on the host.")
@click.option("--persist", is_flag=True, help="Write RmPVMRL to etc/modprobe.d (applies at the next module load).")
@click.option("--dry-run", is_flag=True, help="Check and show what would change; change nothing.")
def scheduler_set(policy: str, timeslice_ms: Optional[int], frequency_hz: Optional[int], avg_factor: Optional[int],
                  gpus: Tuple[str, ...], all_gpus: bool, persist: bool, dry_run: bool) -> None:
    """Set the vGPU scheduler: now through NVML (no vGPU may run), or with --persist for the next module load.

    Without --timeslice-ms or --frequency-hz/--avg-factor, equal and fixed share
    use adaptive round robin with the driver's defaults (<= 8 vGPUs: 2 ms /
    480 Hz; > 8: 1 ms / 960 Hz).
    """
    ctx = current()
    if bool(gpus) == all_gpus:
        raise click.UsageError("give --gpu BDF (repeatable) or --all")
    if (frequency_hz is None) != (avg_factor is None):
        raise click.UsageError("--frequency-hz and --avg-factor go together")
    if timeslice_ms is not None and frequency_hz is not None:
        raise click.UsageError("--timeslice-ms (no ARR) and --frequency-hz/--avg-factor (ARR) exclude each other")
    if policy == SchedulerPolicy.BEST_EFFORT and (timeslice_ms is not None or frequency_hz is not None):
        raise InputError("best effort takes no time slice, frequency or averaging factor")
    addrs = [PciAddress.parse(g) for g in gpus]
    state = scheduler_state(policy, timeslice_ms, frequency_hz, avg_factor)
    if persist:
        validate(state)                       # a bad value fails before the host is read
        if addrs:
            addrs = resolve_gpus(ctx.host, addrs, False)
            refuse_boards_without_vgpu(ctx.host, addrs)
        out = do_persist(ctx.host, store(ctx, write=not dry_run), state, addrs or None, dry_run=dry_run)
        if ctx.json:
            emit(ctx, out.as_dict(), "")
            return
        verb = "would write" if dry_run else "wrote"
        scope = ", ".join(out.gpus) if out.gpus else "all GPUs"
        head = (f"{verb} {out.path}: RmPVMRL=0x{out.value:08x} ({scope})" if out.changed
                else f"no change: {out.path} already sets RmPVMRL=0x{out.value:08x} ({scope})")
        lines = [head]
        if out.changed:
            lines += [f"  {line}" for line in out.text.rstrip("\n").splitlines()]
        lines += [f"note: {n}" for n in out.notes]
        click.echo("\n".join(lines))
        return
    if not dry_run:
        out = forward(ctx, "POST", "/v1/scheduler", {
            "policy": policy, "timeslice_ms": timeslice_ms, "frequency_hz": frequency_hz, "avg_factor": avg_factor,
            "gpus": [str(a) for a in addrs], "all": all_gpus})
        if out is not None:
            runtime_outcome(ctx, out)
            return
    out = set_runtime(ctx.host, store(ctx, write=not dry_run), "all" if all_gpus else addrs, state, dry_run=dry_run)
    runtime_outcome(ctx, out)


def runtime_outcome(ctx, out) -> None:
    if ctx.json:
        emit(ctx, out.as_dict(), "")
        return
    lines = []
    for g in out.gpus:
        if "requested" in g:
            before, want, after = g["before"]["text"], g["requested"]["text"], g["after"]["text"]
            if not g["changed"]:
                lines.append(f"{g['gpu']}: no change ({before})")
            elif out.dry_run:
                lines.append(f"{g['gpu']}: would set {want} (now {before})")
            else:
                lines.append(f"{g['gpu']}: {before} -> {after}")
        else:
            fmt = lambda v: "on" if v else "off"   # noqa: E731
            if not g["changed"]:
                lines.append(f"{g['gpu']}: no change (mixed-size mode {fmt(g['mixed_size'])})")
            elif out.dry_run:
                lines.append(f"{g['gpu']}: would turn mixed-size mode {fmt(g['mixed_size'])}")
            else:
                lines.append(f"{g['gpu']}: mixed-size mode {fmt(g['mixed_size_before'])} -> {fmt(g['mixed_size'])}")
    lines += [f"note: {n}" for n in out.notes]
    click.echo("\n".join(lines))


@scheduler.command("decode")
@click.argument("value")
@click.option("--json", "json_flag", is_flag=True, help="Machine-readable output.")
def scheduler_decode(value: str, json_flag: bool) -> None:
    """Explain an RmPVMRL value (0x3c3c0001 or decimal), field by field.

    Exit 0 for a valid scheduler value, 1 when it is not one (each problem is named).
    """
    ctx = current()
    v = parse_value(value)
    doc = explain_doc(v)
    emit(ctx, doc, explain(v), json_flag)
    sys.exit(EXIT_OK if doc["valid"] else EXIT_PROBLEMS)


COMMANDS: List[click.Command] = [scheduler]
