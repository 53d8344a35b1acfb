"""`vgpuhost hook install|uninstall|status`: libvirt's qemu hook (commands over :mod:`vgpuhost.hook`).

Registered on the main group by cli.py: every click command in
``COMMANDS`` becomes a top-level command.  ``--json`` documents:
``vgpuhost.hook/v1`` (install, uninstall) and ``vgpuhost.hook-status/v1``.
``status`` exits 1 when the hook is missing, outdated, not executable or the
allow-list is unreadable.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import click

HOOKS_DIR_HELP = "Where libvirt looks for qemu hooks (default <root>/etc/libvirt/hooks/qemu.d)."


@click.group(name="hook")
def hook() -> None:
    """libvirt's qemu hook: makes a domain's GPU devices at start, releases them at stop."""


def _outcome(ctx, out) -> None:
    from .cli import _emit
    if ctx.json:
        _emit(ctx, out.as_dict(), "")
        return
    if out.action == "install":
        verb = ("would install" if out.new else "would update") if out.dry_run else (
            ("installed" if out.new else "updated") if out.changed else "no change:")
    else:
        verb = "would remove" if out.dry_run and out.changed else ("removed" if out.changed else "no change:")
    lines = [f"{verb} {out.path}"]
    lines += [f"note: {n}" for n in out.notes]
    click.echo("\n".join(lines))


@hook.command("install")
@click.option("--hooks-dir", metavar="DIR", help=HOOKS_DIR_HELP)
@click.option("--timeout", "timeout_s", type=click.IntRange(1, 3600), default=60, show_default=True,
              help="Seconds the hook may run before it undoes what it made and fails the start.")
@click.option("--dry-run", is_flag=True, help="Say what would change; write nothing.")
@click.pass_context
def hook_install(cctx: click.Context, hooks_dir: Optional[str], timeout_s: int, dry_run: bool) -> None:
    """Install the qemu hook (DIR/vgpuhost, mode 0755), baking in the root and state dir.

    Idempotent.  libvirtd must be restarted or sent SIGHUP to see a new hook;
    this command never does that itself.
    """
    from . import hook as hookmod
    from .cli import _store
    ctx = cctx.obj
    ctx.host.require_host()
    store = None if dry_run else _store(ctx)
    _outcome(ctx, hookmod.install(ctx.host, hooks_dir=hooks_dir, dry_run=dry_run, timeout_s=timeout_s,
                                  store=store))


@hook.command("uninstall")
@click.option("--hooks-dir", metavar="DIR", help=HOOKS_DIR_HELP)
@click.option("--dry-run", is_flag=True, help="Say what would change; write nothing.")
@click.pass_context
def hook_uninstall(cctx: click.Context, hooks_dir: Optional[str], dry_run: bool) -> None:
    """Remove the qemu hook, only if vgpuhost wrote it."""
    from . import hook as hookmod
    from .cli import _store
    ctx = cctx.obj
    store = None if dry_run else _store(ctx)
    _outcome(ctx, hookmod.uninstall(ctx.host, hooks_dir=hooks_dir, dry_run=dry_run, store=store))


@hook.command("status")
@click.option("--hooks-dir", metavar="DIR", help=HOOKS_DIR_HELP)
@click.pass_context
def hook_status(cctx: click.Context, hooks_dir: Optional[str]) -> None:
    """Is the hook installed and current, does libvirt's directory exist, what does the allow-list allow?

    Exit 0 when installed, current and executable; 1 otherwise.
    """
    from . import hook as hookmod
    from .cli import _emit
    ctx = cctx.obj
    doc = hookmod.status(ctx.host, hooks_dir=hooks_dir)
    yes = {True: "yes", False: "no"}
    installed = yes[doc["installed"]]
    if doc["installed"] and not doc["written_by_vgpuhost"]:
        installed += " (not written by vgpuhost)"
    lines = [f"hook:        {doc['path']}",
             f"installed:   {installed}",
             f"current:     {yes[doc['current']]}" + ("" if doc["current"] or not doc["installed"] else
                                                      " (run 'vgpuhost hook install' to update it)"),
             f"executable:  {yes[doc['executable']]}",
             f"hooks dir:   {doc['hooks_dir']} ({'exists' if doc['hooks_dir_exists'] else 'missing'})",
             f"allow-list:  {doc['allow']['path']}: {doc['allow']['summary']}"]
    if doc["allow"]["error"]:
        lines.append(f"             {doc['allow']['error']}")
    if not doc["installed"]:
        lines.append("not installed: run 'vgpuhost hook install', then reload libvirtd (systemctl reload libvirtd)")
    _emit(ctx, doc, "\n".join(lines))
    sys.exit(0 if doc["ok"] else 1)


COMMANDS: List[click.Command] = [hook]
