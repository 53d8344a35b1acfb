"""`vgpuhost passthrough prepare|release|modprobe-config BDF`: whole GPUs to one VM.

Logic lives in :mod:`vgpuhost.ops.passthrough`; this module parses options and prints.
prepare and release go through the agent when its admin socket answers (:mod:`.agentcall`).
"""

from __future__ import annotations

from typing import List

import click

from ..model.values import PciAddress
from ..observe.inventory import discover
from ..ops.passthrough import modprobe_config, prepare, release
from .agentcall import forward
from .common import Context, emit, pass_ctx, store

#: the agent's answer is the ``--json`` document; the printer reads ``group`` as the outcome names it
ALIASES = {"group": "iommu_group"}


@click.group()
def passthrough() -> None:
    """Whole GPUs to one VM: bind an IOMMU group to vfio-pci, and give it back."""


def _outcome(ctx: Context, out) -> None:
    if ctx.json:
        emit(ctx, out.as_dict(), "")
        return
    verb = "would" if out.dry_run else ("did" if out.changed else "no change:")
    lines = []
    if out.steps:
        lines.append(f"{out.action} {out.gpu} (IOMMU group {out.group}): {verb}")
        lines += [f"  {s}" for s in out.steps]
    for f in out.functions:
        if f["from"] != f["to"]:
            lines.append(f"  {f['bdf']}: {f['from'] or 'no driver'} -> {f['to'] or 'no driver'}")
    lines += [f"note: {n}" for n in out.notes]
    click.echo("\n".join(lines))


@passthrough.command("prepare")
@click.argument("bdf")
@click.option("--allow-boot-vga", is_flag=True, help="Also when the GPU drives the host console.")
@click.option("--persist", is_flag=True, help="Record driverctl overrides (etc/driverctl.d) for boot.")
@click.option("--dry-run", is_flag=True, help="Print the exact steps; change nothing.")
@pass_ctx
def passthrough_prepare(ctx: Context, bdf: str, allow_boot_vga: bool, persist: bool, dry_run: bool) -> None:
    """Bind every function of BDF's IOMMU group to vfio-pci (idempotent)."""
    addr = PciAddress.parse(bdf)
    if not dry_run:
        out = forward(ctx, "POST", f"/v1/passthrough/{addr}/prepare",
                      {"allow_boot_vga": allow_boot_vga, "persist": persist}, aliases=ALIASES)
        if out is not None:
            _outcome(ctx, out)
            return
    _outcome(ctx, prepare(ctx.host, store(ctx, write=not dry_run), addr, allow_boot_vga=allow_boot_vga,
                          persist=persist, dry_run=dry_run))


@passthrough.command("release")
@click.argument("bdf")
@click.option("--persist", is_flag=True, help="Also remove the driverctl overrides.")
@click.option("--dry-run", is_flag=True, help="Print the exact steps; change nothing.")
@pass_ctx
def passthrough_release(ctx: Context, bdf: str, persist: bool, dry_run: bool) -> None:
    """Give BDF's group back to its original drivers, companions first (idempotent)."""
    addr = PciAddress.parse(bdf)
    if not dry_run:
        out = forward(ctx, "POST", f"/v1/passthrough/{addr}/release", {"persist": persist}, aliases=ALIASES)
        if out is not None:
            _outcome(ctx, out)
            return
    _outcome(ctx, release(ctx.host, store(ctx, write=not dry_run), addr, persist=persist, dry_run=dry_run))


@passthrough.command("modprobe-config")
@click.argument("bdf")
@pass_ctx
def passthrough_modprobe_config(ctx: Context, bdf: str) -> None:
    """Print vfio-pci ids= and softdep lines for binding BDF's group at boot."""
    addr = PciAddress.parse(bdf)
    fs = ctx.sysfs()
    records = {r.bdf: r for r in store(ctx, write=False).passthrough_records()}
    text = modprobe_config(discover(fs, with_types=False), addr, fs, records)
    emit(ctx, {"schema": "vgpuhost.modprobe-config/v1", "gpu": str(addr), "text": text}, text.rstrip("\n"))


COMMANDS: List[click.Command] = [passthrough]
