"""`vgpuhost vgpu create|remove|list|mode`: time-sliced and MIG-backed vGPUs.

Logic lives in :mod:`vgpuhost.ops.vgpu` (``mode``: :mod:`vgpuhost.ops.scheduler`);
this module parses options and prints.
"""

from __future__ import annotations

from typing import List, Optional
from urllib.parse import quote

import click

from ..model.kinds import Owner, PlacementStrategy
from ..model.values import PciAddress
from ..ops.scheduler import mixed_size
from ..ops.vgpu import VgpuCreateRequest, create_vgpu, list_vgpus, removal_pending, remove
from .agentcall import forward
from .common import Context, current, emit, pass_ctx, store
from .output import table
from .scheduler import runtime_outcome


@click.group()
def vgpu() -> None:
    """Time-sliced and MIG-backed vGPUs on mdev or vendor-specific VFIO."""


def _vgpu_outcome(ctx: Context, out) -> None:
    if ctx.json:
        emit(ctx, out.as_dict(), "")
        return
    verb = "would" if out.dry_run else "did"
    lines = []
    if out.action == "create":
        head = f"{'would create' if out.dry_run else 'created'} {out.type_name} {out.id} on {out.parent}"
        lines.append(f"{head} (GPU {out.gpu}, {out.backend}, owner {out.owner})")
        lines.append(f"placement: {out.reason}")
    else:
        lines.append(f"{'would remove' if out.dry_run else 'removed'} {out.type_name} {out.id} "
                     f"from {out.parent} (owner {out.owner})")
    if out.steps:
        lines.append(f"{verb}:")
        lines += [f"  {s}" for s in out.steps]
    lines += [f"note: {n}" for n in out.notes]
    click.echo("\n".join(lines))


@vgpu.command("create")
@click.option("--profile", required=True, metavar="NAME", help="vGPU type name as the device reports it (A40-8Q).")
@click.option("--gpu", metavar="BDF", help="Only on this GPU.")
@click.option("--uuid", metavar="UUID", help="mdev UUID (default: a new one).")
@click.option("--strategy", default=PlacementStrategy.DEFAULT, show_default=True,
              type=click.Choice(PlacementStrategy.OFFERED),
              help="How the GPU is chosen; headroom is best-fit that may refuse a whole- or half-GPU "
                   "type that fits while the host is near full, and says so (docs/performance.md).")
@click.option("--owner", default=Owner.MANUAL, show_default=True, metavar="DOMAIN_UUID", help="Who holds it.")
@click.option("--params", metavar="K=V,...", help="vgpu_params, e.g. frame_rate_limiter=0.")
@click.option("--numa-node", type=click.IntRange(0, 1023), help="Prefer GPUs on this NUMA node.")
@click.option("--anti-affinity", metavar="KEY", help="No two vGPUs with KEY on one GPU.")
@click.option("--persist", is_flag=True, help="Define it in mdevctl (classic mdev only) so it comes back at boot.")
@click.option("--create-gi", is_flag=True, help="MIG-backed profile: create the GPU instance it needs.")
@click.option("--dry-run", is_flag=True, help="Show the placement decision and steps; change nothing.")
@pass_ctx
def vgpu_create(ctx: Context, profile, gpu, uuid, strategy, owner, params, numa_node, anti_affinity,
                persist, create_gi, dry_run) -> None:
    """Create a vGPU of PROFILE, placed by STRATEGY."""
    request = VgpuCreateRequest.parse(profile, gpu=gpu or None, uuid=uuid, strategy=strategy, owner=owner,
                                      params=params, numa_node=numa_node, anti_affinity=anti_affinity,
                                      persist=persist, create_gi=create_gi)
    if not dry_run:
        out = forward(ctx, "POST", "/v1/vgpus", request.body())
        if out is not None:
            _vgpu_outcome(ctx, out)
            return
    _vgpu_outcome(ctx, create_vgpu(ctx.host, store(ctx, write=not dry_run), request, dry_run=dry_run))


@vgpu.command("remove")
@click.argument("vgpu_id", metavar="ID")
@click.option("--owner", metavar="DOMAIN_UUID", help="Only while this owner holds it.")
@click.option("--dry-run", is_flag=True, help="Show the steps; change nothing.")
@pass_ctx
def vgpu_remove(ctx: Context, vgpu_id: str, owner: Optional[str], dry_run: bool) -> None:
    """Remove a vGPU vgpuhost created (ID: mdev UUID, or the VF's BDF)."""
    if not dry_run:
        out = forward(ctx, "POST", f"/v1/vgpus/{quote(vgpu_id, safe='')}/remove", {"owner": owner})
        if out is not None:
            _vgpu_outcome(ctx, out)
            return
    _vgpu_outcome(ctx, remove(ctx.host, store(ctx, write=not dry_run), vgpu_id, owner=owner, dry_run=dry_run))


@vgpu.command("list")
@pass_ctx
def vgpu_list(ctx: Context) -> None:
    """vGPUs on the host, with owners; 'foreign' = not created by vgpuhost, 'removing' = removal pending."""
    st = store(ctx, write=False)
    entries = list_vgpus(ctx.inventory(), st.vgpu_records(), removal_pending(st))
    emit(ctx, {"schema": "vgpuhost.vgpu-list/v1", "vgpus": [e.as_dict() for e in entries]},
          table(["ID", "GPU", "PARENT", "TYPE", "NAME", "OWNER", "STATE"],
                [[e.id, e.gpu, e.parent, e.type_id, e.type_name, e.owner, e.state] for e in entries])
          if entries else "no vGPUs")



@vgpu.command("mode")
@click.option("--gpu", required=True, metavar="BDF", help="The GPU (dddd:bb:ss.f).")
@click.option("--mixed-size", "mixed", required=True, type=click.Choice(["on", "off"]),
              help="Mixed-size (heterogeneous) vGPU mode; needs no vGPUs on the GPU.")
@click.option("--dry-run", is_flag=True, help="Check and show what would change; change nothing.")
def vgpu_mode(gpu: str, mixed: str, dry_run: bool) -> None:
    """Turn a GPU's mixed-size vGPU mode on or off (lost on reboot or module reload)."""
    ctx = current()
    addr = PciAddress.parse(gpu)
    if not dry_run:
        out = forward(ctx, "POST", f"/v1/gpus/{addr}/mixed-size", {"mixed_size": mixed == "on"})
        if out is not None:
            runtime_outcome(ctx, out)
            return
    runtime_outcome(ctx, mixed_size(ctx.host, store(ctx, write=not dry_run), addr, mixed == "on", dry_run=dry_run))

COMMANDS: List[click.Command] = [vgpu]
