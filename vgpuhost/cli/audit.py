"""`vgpuhost audit [--since WHEN]`: every write vgpuhost made to the host, from the state store.
"""

from __future__ import annotations

from typing import List, Optional

import click

from .common import Context, emit, pass_ctx
from .common import store


@click.command("audit")
@click.option("--since", metavar="WHEN", help="ISO 8601 time (2026-11-29T10:00) or an age: 30m, 2h, 7d.")
@pass_ctx
def audit(ctx: Context, since: Optional[str]) -> None:
    """Print the audit log: every write vgpuhost made to the host."""
    from .output import table
    start = _parse_since(since) if since else None
    rows = store(ctx, write=False).audit_rows(start)
    doc = {"schema": "vgpuhost.audit/v1", "since": start,
           "rows": [r.__dict__ for r in rows]}
    emit(ctx, doc, table(["TIME", "ACTOR", "OPERATION", "PATH", "VALUE", "RESULT"],
                          [[r.time[:23], r.actor, r.operation, r.path, r.value, r.result] for r in rows])
          if rows else "audit log is empty")


def _parse_since(text: str) -> str:
    from ..policy.when import parse_since
    return parse_since(text)


COMMANDS: List[click.Command] = [audit]
