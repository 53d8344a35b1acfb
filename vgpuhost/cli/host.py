"""`vgpuhost host check`, `vgpuhost gpus`, `vgpuhost types`: what the host has and whether it is ready.

Logic lives in :mod:`vgpuhost.observe.inventory` and :mod:`vgpuhost.policy.checks`;
tables and documents in :mod:`vgpuhost.cli.output`.  ``host check`` exits 1
when it finds problems.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import click

from ..model.errors import EXIT_OK, EXIT_PROBLEMS
from ..ops import migdemand, tenancy
from ..ops import health
from ..ops.metering import licence_report
from ..ops.readiness import check
from ..policy.checks import host_ready
from .common import Context, emit, pass_ctx, store
from .lean import gpus_output, types_output
from .output import check_doc, check_text


@click.group()
def host() -> None:
    """Host readiness."""


@host.command("check")
@pass_ctx
def host_check(ctx: Context) -> None:
    """Is this host ready for GPU virtualisation, and for which modes?

    Findings, then one verdict per GPU for passthrough, vGPU and MIG (what
    those commands would do now).  Exit 0 ready (no error, and every GPU can
    serve some mode), 1 otherwise.
    """
    inv = ctx.inventory()
    st = store(ctx, write=False)
    findings, verdicts = check(ctx.host, inv, frozenset() if st.absent else migdemand.opted_in(st))
    findings = (findings + tenancy.guarantee_findings(st, inv) + health.findings(ctx.host, st, inv, health.nvml_or_none(ctx.host))
                + licence_report(ctx.host, st, inv))
    emit(ctx, check_doc(findings, verdicts), check_text(findings, verdicts))
    sys.exit(EXIT_OK if host_ready(findings, verdicts) else EXIT_PROBLEMS)


@click.command("gpus")
@pass_ctx
def gpus(ctx: Context) -> None:
    """List NVIDIA GPUs, their IOMMU groups and the backends each can serve."""
    doc, text = gpus_output(ctx)
    emit(ctx, doc, text)


@click.command("types")
@click.option("--gpu", metavar="BDF", help="Only this GPU (dddd:bb:ss.f).")
@click.option("--available", is_flag=True, help="Only types with free instances now.")
@pass_ctx
def types(ctx: Context, gpu: Optional[str], available: bool) -> None:
    """List vGPU types per GPU with max and available instances."""
    doc, text = types_output(ctx, gpu, available)
    emit(ctx, doc, text)


COMMANDS: List[click.Command] = [host, gpus, types]
