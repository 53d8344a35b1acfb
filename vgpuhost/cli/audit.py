"""`vgpuhost audit [--since WHEN] [--domain D] [--gpu BDF] [--actor TEXT] [--limit N]`: every write
vgpuhost made to the host, from the state store, filtered.
"""

from __future__ import annotations

import re
from typing import List, Optional

import click

from ..model.values import PciAddress
from ..policy.when import parse_since
from .common import Context, emit, pass_ctx, store
from .output import table


@click.command("audit")
@click.option("--since", metavar="WHEN", help="ISO 8601 time (2026-11-29T10:00) or an age: 30m, 2h, 7d.")
@click.option("--domain", metavar="DOMAIN",
              help="Rows whose actor or operation names DOMAIN (name or UUID): its hook runs, owner=UUID.")
@click.option("--gpu", metavar="BDF", help="Rows whose path, operation or value names this PCI address.")
@click.option("--actor", metavar="TEXT", help="Rows whose actor contains TEXT (hook, systemd:, ansible, uid=0).")
@click.option("--limit", type=click.IntRange(min=1), metavar="N", help="Only the last N rows that match.")
@pass_ctx
def audit(ctx: Context, since: Optional[str], domain: Optional[str], gpu: Optional[str], actor: Optional[str],
          limit: Optional[int]) -> None:
    """Print the audit log: every write vgpuhost made to the host."""
    start = _parse_since(since) if since else None
    if gpu is not None:
        gpu = str(PciAddress.parse(gpu))
    rows = filter_rows(store(ctx, write=False).audit_rows(start), domain=domain, gpu=gpu, actor=actor, limit=limit)
    doc = {"schema": "vgpuhost.audit/v1", "since": start,
           "filters": {"domain": domain, "gpu": gpu, "actor": actor, "limit": limit},
           "rows": [r.__dict__ for r in rows]}
    emit(ctx, doc, table(["TIME", "ACTOR", "OPERATION", "PATH", "VALUE", "RESULT"],
                          [[r.time[:23], r.actor, r.operation, r.path, r.value, r.result] for r in rows])
          if rows else "no audit rows match" if (domain or gpu or actor) else "audit log is empty")


def _words(text: Optional[str]) -> List[str]:
    return re.split(r"[\s=,;()]+", text or "")


def filter_rows(rows, *, domain: Optional[str] = None, gpu: Optional[str] = None, actor: Optional[str] = None,
                limit: Optional[int] = None) -> list:
    """The audit rows that match every filter given, in order; the last ``limit`` of them.

    ``domain``: a whole word of the actor or the operation (``hook NAME pid=..``, ``owner=UUID``),
    compared without case for UUIDs; ``gpu``: a canonical BDF contained in the path, operation or
    value; ``actor``: a substring of the actor.
    """
    out = []
    want_domain = domain.lower() if domain else None
    for r in rows:
        if want_domain is not None and want_domain not in {w.lower() for w in _words(r.actor) + _words(r.operation)}:
            continue
        if gpu is not None and not any(gpu in (t or "") for t in (r.path, r.operation, r.value)):
            continue
        if actor is not None and actor not in (r.actor or ""):
            continue
        out.append(r)
    return out[-limit:] if limit else out


def _parse_since(text: str) -> str:
    return parse_since(text)


COMMANDS: List[click.Command] = [audit]
