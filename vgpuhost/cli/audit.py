"""`vgpuhost audit [--since WHEN] [--domain D] [--gpu BDF] [--op TEXT] [--actor TEXT] [--limit N]`: every
write vgpuhost made to the host, from the state store, filtered.
"""

from __future__ import annotations

import re
from typing import FrozenSet, List, Optional

import click

from ..model.values import PciAddress
from ..policy.when import parse_since
from .common import Context, emit, pass_ctx, store
from .output import table


@click.command("audit")
@click.option("--since", metavar="WHEN", help="ISO 8601 time (2026-11-29T10:00) or an age: 30m, 2h, 7d.")
@click.option("--domain", metavar="DOMAIN",
              help="Rows whose actor or operation names DOMAIN (name or UUID): its hook runs, owner=UUID.")
@click.option("--gpu", metavar="BDF",
              help="Rows whose path, operation or value names this GPU, one of its VFs or a vGPU made on it.")
@click.option("--op", "operation", metavar="TEXT",
              help="Rows whose operation starts with TEXT, by words (vgpu create, tenant bind, admission, prepare).")
@click.option("--actor", metavar="TEXT", help="Rows whose actor contains TEXT (hook, systemd:, ansible, uid=0).")
@click.option("--limit", type=click.IntRange(min=1), metavar="N", help="Only the last N rows that match.")
@pass_ctx
def audit(ctx: Context, since: Optional[str], domain: Optional[str], gpu: Optional[str], operation: Optional[str],
          actor: Optional[str], limit: Optional[int]) -> None:
    """Print the audit log: every write vgpuhost made to the host."""
    start = _parse_since(since) if since else None
    st = store(ctx, write=False)
    names = None
    if gpu is not None:
        gpu = str(PciAddress.parse(gpu))
        names = gpu_names(ctx, st, gpu)
    rows = filter_rows(st.audit_rows(start), domain=domain, gpu=gpu, actor=actor, limit=limit, operation=operation,
                       gpu_names=names)
    doc = {"schema": "vgpuhost.audit/v1", "since": start,
           "filters": {"domain": domain, "gpu": gpu, "op": operation, "actor": actor, "limit": limit},
           "rows": [r.__dict__ for r in rows]}
    emit(ctx, doc, table(["TIME", "ACTOR", "OPERATION", "PATH", "VALUE", "RESULT"],
                          [[r.time[:23], _capped(r.actor), r.operation, r.path, r.value, r.result] for r in rows])
          if rows else "no audit rows match" if (domain or gpu or actor or operation) else "audit log is empty")


#: characters of the ACTOR column in the text table (a domain's name may be long: the hook's actor keeps 80 of
#: it); the full actor is in ``--json``
ACTOR_WIDTH = 40


def _capped(actor: str) -> str:
    return actor if len(actor) <= ACTOR_WIDTH else actor[:ACTOR_WIDTH - 3] + "..."


def gpu_names(ctx: Context, st, gpu: str) -> FrozenSet[str]:
    """What names GPU ``gpu`` in an audit row: its BDF, the BDFs of its SR-IOV VFs (the kernel's
    ``virtfn<i>`` links; a vendor-VFIO vGPU is written through its VF) and the ids of the vGPUs vgpuhost
    recorded on it (mdev UUIDs, VF BDFs: a removal names only the vGPU)."""
    out = {gpu}
    sysfs = ctx.sysfs()
    base = f"{ctx.host.pci_devices}/{gpu}"
    for name in sysfs.listdir(base) if sysfs.exists(base) else ():
        if name.startswith("virtfn"):
            vf = sysfs.link_name(f"{base}/{name}")
            if vf:
                out.add(vf)
    out.update(r.id for r in st.vgpu_records() if r.gpu == gpu)
    return frozenset(out)


def _words(text: Optional[str]) -> List[str]:
    return re.split(r"[\s=,;()]+", text or "")


def filter_rows(rows, *, domain: Optional[str] = None, gpu: Optional[str] = None, actor: Optional[str] = None,
                limit: Optional[int] = None, operation: Optional[str] = None,
                gpu_names: Optional[FrozenSet[str]] = None) -> list:
    """The audit rows that match every filter given, in order; the last ``limit`` of them.

    ``domain``: a whole word of the actor or the operation (``hook NAME pid=..``, ``owner=UUID``),
    compared without case for UUIDs; ``gpu``: a canonical BDF contained in the path, operation or
    value, or (``gpu_names``, :func:`gpu_names`) any of the names of that GPU's VFs and vGPUs, and the
    UUIDs the rows show written to a ``create`` file of it (a removed mdev has no record left);
    ``operation``: the operation's leading words (``vgpu create`` matches ``vgpu create A40-8Q ...``,
    not ``vgpu created``), without case; ``actor``: a substring of the actor.
    """
    out = []
    want_domain = domain.lower() if domain else None
    want_op = operation.lower().split() if operation else None
    names = tuple(sorted(gpu_names or ({gpu} if gpu else ())))
    rows = list(rows)
    if names:       # an mdev's UUID, written to a create file of this GPU: its removal names only the UUID,
        # and the record is gone once it is removed
        made = {r.value for r in rows if (r.path or "").endswith("/create") and r.value
                and any(n.lower() in r.path.lower() for n in names)}
        names = tuple(sorted(set(names) | made))
    for r in rows:
        if want_domain is not None and want_domain not in {w.lower() for w in _words(r.actor) + _words(r.operation)}:
            continue
        if want_op is not None and (r.operation or "").lower().split()[:len(want_op)] != want_op:
            continue
        if names and not any(n.lower() in (t or "").lower() for n in names for t in (r.path, r.operation, r.value)):
            continue
        if actor is not None and actor not in (r.actor or ""):
            continue
        out.append(r)
    return out[-limit:] if limit else out


def _parse_since(text: str) -> str:
    return parse_since(text)


COMMANDS: List[click.Command] = [audit]
