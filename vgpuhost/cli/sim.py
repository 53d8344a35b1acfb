"""`vgpuhost sim specs|create`: simulated hosts, to try vgpuhost without a GPU.

The commands of the simulator itself: they use :mod:`vgpuhost.sim` directly (its
specs and builder), as no other command does.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import click

from ..model.errors import InputError
from ..sim.build import materialise
from ..sim.data import bundled_specs
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


COMMANDS: List[click.Command] = [sim]
