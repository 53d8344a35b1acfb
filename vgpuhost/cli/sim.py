"""`vgpuhost sim specs|create`: simulated hosts, to try vgpuhost without a GPU.

The commands of the simulator itself: they use :mod:`vgpuhost.sim` directly (its
specs and builder), as no other command does.
"""

from __future__ import annotations

import errno as errnos
from pathlib import Path
from typing import List

import click

from ..model.errors import InputError
from ..model.values import PciAddress
from ..sim.build import materialise
from ..sim.data import bundled_specs
from ..sim.kernel import SimKernel
from ..sim.nvml import SimNvml
from ..sim.spec import load_spec
from .common import Context, emit, pass_ctx
from .output import table


@click.group()
def sim() -> None:
    """Simulated hosts: try vgpuhost without a GPU."""


@sim.command("specs")
@pass_ctx
def sim_specs(ctx: Context) -> None:
    """List the host specs shipped with vgpuhost."""
    rows = []
    for name, path in bundled_specs().items():
        rows.append([name, load_spec(path).summary])
    emit(ctx, {"schema": "vgpuhost.sim-specs/v1", "specs": [{"name": r[0], "summary": r[1]} for r in rows]},
          table(["NAME", "SUMMARY"], rows))


def _complete_spec(ctx: click.Context, param: click.Parameter, incomplete: str) -> List[str]:
    """The shipped host specs' names (shell completion of ``sim create SPEC``)."""
    return [name for name in bundled_specs() if name.startswith(incomplete)]


@sim.command("create")
@click.argument("spec", shell_complete=_complete_spec)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace a simulated host already at DIRECTORY.")
@pass_ctx
def sim_create(ctx: Context, spec: str, directory: str, force: bool) -> None:
    """Build a simulated host from SPEC (a file or a shipped name) at DIRECTORY."""
    specs = bundled_specs()
    if "/" not in spec and not spec.endswith((".yaml", ".yml")):
        if spec not in specs:       # a bare name is a shipped spec; a file is named by a path
            raise InputError(f"no host spec {spec!r}",
                             hint="name a YAML file (./my-host.yaml) or one of: " + ", ".join(specs))
        path = specs[spec]
    else:
        path = Path(spec)
    hs = load_spec(path)
    host_root = materialise(hs, directory, force=force)
    doc = {"schema": "vgpuhost.sim-create/v1", "name": hs.name, "root": str(host_root.root)}
    emit(ctx, doc, f"simulated host {hs.name!r} at {host_root.root}\n"
                    f"use: vgpuhost --root {host_root.root} host check   (or export VGPUHOST_ROOT=...)")


@sim.command("fail")
@click.argument("bdf")
@click.option("--lost", "how", flag_value="lost", help="NVML answers GPU_IS_LOST for it from now on.")
@click.option("--found", "how", flag_value="found", help="NVML sees it again (undoes --lost).")
@click.option("--xid", type=click.IntRange(1, 65535), metavar="N", help="Queue an Xid event N (NVML's event API).")
@click.option("--unplug", "how", flag_value="unplug", help="It disappears from the PCI tree (its VFs too).")
@click.option("--create-errno", metavar="NAME", help="Every vGPU create on it fails with this errno (EIO, ENODEV).")
@pass_ctx
def sim_fail(ctx: Context, bdf: str, how: str, xid: int, create_errno: str) -> None:
    """Make the simulated GPU at BDF fail, as a real one does (docs/guide/failures.md); --root names the host."""
    addr = PciAddress.parse(bdf)
    host = ctx.host
    if not host.is_simulated:
        raise InputError(f"{host.root} is not a simulated host", hint="pass --root DIR of one 'vgpuhost sim create' made")
    given = [x for x in (how, xid, create_errno) if x]
    if len(given) != 1:
        raise InputError("give one of --lost, --found, --xid N, --unplug, --create-errno NAME")
    if how in ("lost", "found"):
        SimNvml(host).lose(addr, how == "lost")
        what = "NVML: GPU_IS_LOST" if how == "lost" else "NVML sees it again"
    elif xid:
        SimNvml(host).inject_xid(addr, xid)
        what = f"Xid {xid} queued"
    elif how == "unplug":
        SimKernel(host).unplug(str(addr))
        what = "gone from the PCI tree"
    else:
        number = getattr(errnos, create_errno, None)
        if not isinstance(number, int) or not create_errno.startswith("E"):
            raise InputError(f"unknown errno name {create_errno!r}", hint="e.g. EIO, ENODEV")
        k = SimKernel(host)
        with k.locked():
            meta = k.meta()
            for op in ("create", "set_type"):        # an mdev create, a VF's current_vgpu_type (vendor VFIO)
                meta.setdefault("faults", []).append({"op": op, "device": str(addr), "errno": number, "count": 0})
            k.save_meta(meta)
        what = f"every vGPU create fails with {create_errno}"
    emit(ctx, {"schema": "vgpuhost.sim-fail/v1", "gpu": str(addr), "fault": what}, f"{addr}: {what}")


COMMANDS: List[click.Command] = [sim]
