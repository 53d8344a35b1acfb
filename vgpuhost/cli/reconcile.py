"""`vgpuhost reconcile [--check] [--forget-domains]`: the host and the records agree again.

Logic lives in :mod:`vgpuhost.ops.recover` (the intent journal: operations
an interruption cut short are finished or rolled back first), :mod:`vgpuhost.ops.vgpu`
(reconcile) and :mod:`vgpuhost.ops.devices` (``--forget-domains``: what the
qemu hook's ``release end`` would have released); exits 1 when ``--check``
finds the two disagree or an open journal entry.
"""

from __future__ import annotations

import sys
from typing import List

import click

from ..io.process import actor as actor_name
from ..io.sysfs import Sysfs
from ..model.errors import EXIT_OK, EXIT_PROBLEMS, RefusedError
from ..observe.inventory import discover
from ..observe.ownable import devices_vgpuhost_may_own
from ..ops import migdemand
from ..ops.devices import release_domain
from ..ops.recover import describe_open, open_entries, recover_all, unmade_allocations
from ..ops.migrate import sweep
from ..ops.vgpu import reconcile
from .agentcall import forward
from .common import Context, emit, pass_ctx, store


@click.command("reconcile")
@click.option("--check", is_flag=True, help="Change nothing; exit 1 when the host and the records disagree.")
@click.option("--forget-domains", is_flag=True,
              help="At boot, before libvirtd: release what domains recorded as running still hold "
                   "(a crash skipped their 'release end'), then forget them.")
@pass_ctx
def reconcile_cmd(ctx: Context, check: bool, forget_domains: bool) -> None:
    """Re-create recorded vGPUs that are missing (boot); report foreign ones; remove nothing."""
    ctx.host.require_host()
    if forget_domains:
        if check:
            raise click.UsageError("--forget-domains changes the state; it does not go with --check")
        _forget_domains(ctx)
        return
    st = store(ctx, write=not check)
    if check and st.absent:
        held = devices_vgpuhost_may_own(ctx.host)
        if held:        # the records are not there to compare with: never "in sync" (as for a damaged store)
            raise RefusedError(f"no state store in {str(ctx.host.state_dir)!r} while the host has devices "
                               f"vgpuhost may own: {', '.join(held[:6])}{' ...' if len(held) > 6 else ''}",
                               hint="pass --state-dir DIR naming vgpuhost's state dir (default "
                                    "<root>/var/lib/vgpuhost), or restore state.db from a backup")
    journal_lines, journal_doc, journal_ok = [], [], True
    unmade: List[str] = []          # allocation rows of devices a killed start never made
    interrupted: set = set()        # devices an open entry names: the journal's to finish or roll back
    if check:                       # the intent journal: open entries are interrupted operations
        for e in open_entries(st):
            interrupted |= {str(d.get("id") or d.get("bdf")) for d in e.devices}
            journal_lines.append("open: " + describe_open(e, st.dir))
            journal_doc.append({"entry": e.id, "operation": e.operation, "owner": e.owner, "opened": e.opened,
                                "done": e.done, "steps": e.steps, "devices": e.devices, "result": "open"})
            journal_ok = False
        unmade = [] if st.absent else unmade_allocations(st)
        journal_lines += ["open: " + line for line in unmade]
        journal_ok = journal_ok and not unmade
        # GPU instances made on demand (MIG on demand) that nothing ends by itself: an interrupted start's
        # or stop's, or one left empty after its owner's stop
        on_demand = [] if st.absent else [f"{m.line()} ({why})" for m, why in migdemand.left(ctx.host, st)]
        journal_lines += ["left: " + line for line in on_demand]
        journal_ok = journal_ok and not on_demand
    else:                           # finish or roll back each, then re-create missing vGPUs
        for r in recover_all(ctx.host, st, actor=actor_name("reconcile")):
            journal_lines.append(r.line())
            journal_doc.append(r.as_dict())
            journal_ok = journal_ok and r.result in ("finished", "rolled-back")
    rep = None
    if not check:
        rep = forward(ctx, "POST", "/v1/reconcile", {"check": False})
    if rep is None:
        rep = reconcile(ctx.host, st, check=check, libvirt_uri=ctx.connect)
    if not check:
        # after the stale domains were forgotten: a GPU instance made on demand for one is an orphan now
        ended, failed = migdemand.sweep(ctx.host, st, actor=actor_name("reconcile"))
        on_demand = [f"ended: {m.line()}" for m in ended] + [f"FAILED {f}" for f in failed]
        journal_lines += on_demand
        journal_ok = journal_ok and not failed
    # devices reserved for an incoming live migration that neither prepare begin nor release end took
    # (docs/guide/migration.md): freed once expired, or listed with --check
    expired = sweep(st, actor=actor_name("reconcile"), check=check)
    lines = list(journal_lines)
    lines += [("expired reservation: " if check else "freed expired reservation: ") + e for e in expired]
    half_made = [o for o in rep.orphans if o.split(" ", 1)[0] in interrupted]
    foreign = [o for o in rep.orphans if o not in half_made]
    for label, items in (("turned mixed-size mode on", [] if check else rep.mixed_size_on),
                         ("mixed-size mode", rep.mixed_size_on if check else []), ("re-created", rep.recreated), ("missing", rep.missing), ("FAILED", rep.failed),
                         ("type changed", rep.mismatched),
                         ("stale domain", rep.stale_domains), ("forgotten domain", rep.forgotten_domains),
                         ("interrupted (its open journal entry finishes or removes it)", half_made),
                         ("foreign (left alone)", foreign)):
        lines += [f"{label}: {i}" for i in items]
    in_sync = rep.in_sync and journal_ok and not (check and expired)
    lines.append("in sync" if in_sync else "NOT in sync")
    if check and not journal_ok:
        lines.append("fix: run 'vgpuhost reconcile' to finish or roll back the interrupted operations")
    if check and rep.stale_domains:
        lines.append("fix: run 'vgpuhost reconcile' to forget the stale domains (they hold nothing)")
    doc = rep.as_dict()
    doc["journal"] = journal_doc
    doc["expired_reservations"] = expired
    doc["mig_on_demand"] = on_demand
    if check:
        doc["unmade_allocations"] = unmade
    doc["in_sync"] = in_sync
    emit(ctx, doc, "\n".join(lines))
    sys.exit(EXIT_OK if in_sync else EXIT_PROBLEMS)


def _forget_domains(ctx: Context) -> None:
    """``reconcile --forget-domains``: the ``release end`` a host crash skipped, for every domain
    the hook recorded as running.  Refused while any qemu process runs (then domains may run)."""
    st = store(ctx, write=False)
    running = st.active_domains()
    if running:
        qemu = sorted(p for p in discover(Sysfs(ctx.host)).host.processes
                      if p.startswith(("qemu-system", "qemu-kvm")))
        if qemu:
            raise RefusedError(f"qemu is running ({', '.join(qemu)}): domains may be running, so the "
                               f"{len(running)} recorded as running are not forgotten",
                               hint="--forget-domains is for boot, before libvirtd starts any domain")
        st = store(ctx, write=True)
    forgotten = []
    for uuid, name in running.items():
        released = release_domain(ctx.host, st, uuid, actor=f"reconcile --forget-domains {name}")
        forgotten.append({"uuid": uuid, "name": name, "released": released})
    doc = {"schema": "vgpuhost.forget-domains/v1", "forgotten": forgotten}
    lines = [f"forgot {d['name']} ({d['uuid']})" + (f": released {', '.join(d['released'])}" if d["released"]
                                                      else "") for d in forgotten]
    emit(ctx, doc, "\n".join(lines) or "no domain recorded as running")


COMMANDS: List[click.Command] = [reconcile_cmd]
