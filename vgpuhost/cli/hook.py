"""`vgpuhost hook install|uninstall|status`: libvirt's qemu hook (commands over :mod:`vgpuhost.hook`).

Registered on the main group by cli/main.py: every click command in
``COMMANDS`` becomes a top-level command.  ``--json`` documents:
``vgpuhost.hook/v1`` (install, uninstall) and ``vgpuhost.hook-status/v1``.
``status`` exits 1 when the hook is missing, outdated, not executable or the
allow-list is unreadable, malformed or names a GPU the host does not have.  ``--hooks-dir`` must be absolute
(libvirt runs hooks from an absolute directory); a relative one is refused
with exit 2 before anything is read or written.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import List, Optional

import click

from ..hook import install as hookmod
from ..io import files
from ..model.errors import InputError
from .common import emit, store

HOOKS_DIR_HELP = "Where libvirt looks for qemu hooks, an absolute path (default <root>/etc/libvirt/hooks/qemu.d)."


def _absolute_dir(_cctx: click.Context, _param: click.Parameter, value: Optional[str]) -> Optional[str]:
    """``--hooks-dir``: None (the default) or an absolute path; InputError (exit 2) otherwise."""
    if value is None:
        return None
    if not value.isprintable():
        raise InputError(f"--hooks-dir {value[:200]!r} holds a control character (a newline, a tab...)",
                         hint="the dispatcher names its own path in sh: give a directory whose path is plain text")
    if not value.startswith("/"):
        raise InputError(f"--hooks-dir {value[:200]!r} is not an absolute path",
                         hint="libvirt runs hooks from an absolute directory: give one, "
                              "e.g. /etc/libvirt/hooks/qemu.d")
    return value


@click.group(name="hook")
def hook() -> None:
    """libvirt's qemu hook: makes a domain's GPU devices at start, releases them at stop."""


def _outcome(ctx, out) -> None:
    if ctx.json:
        emit(ctx, out.as_dict(), "")
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
@click.option("--hooks-dir", metavar="DIR", callback=_absolute_dir, help=HOOKS_DIR_HELP)
@click.option("--timeout", "timeout_s", type=click.IntRange(1, 3600), default=60, show_default=True,
              help="Seconds the hook may run before it undoes what it made and fails the start.")
@click.option("--client", metavar="PATH",
              help="The compiled thin client the hook hands calls to the agent with (an absolute path), or "
                   "'none' for curl.  Default: vgpuhost-hook-client, looked for each time the hook runs next to "
                   "the package (make dev builds it there), then in /usr/lib/vgpuhost; curl when neither is there.")
@click.option("--dry-run", is_flag=True, help="Say what would change; write nothing.")
@click.pass_context
def hook_install(cctx: click.Context, hooks_dir: Optional[str], timeout_s: int, client: Optional[str],
                 dry_run: bool) -> None:
    """Install the qemu hook (DIR/vgpuhost, mode 0755), baking in the root and state dir.

    Idempotent.  Then reload libvirtd (systemctl reload libvirtd): it reads its hooks when it
    starts or gets SIGHUP, and this command never signals it.  The Debian package installs the
    hook but leaves this step (enabling it) to the operator.
    """
    ctx = cctx.obj
    ctx.host.require_host()
    st = None if dry_run else store(ctx)
    _outcome(ctx, hookmod.install(ctx.host, hooks_dir=hooks_dir, dry_run=dry_run, timeout_s=timeout_s,
                                  store=st, client=client))


@hook.command("uninstall")
@click.option("--hooks-dir", metavar="DIR", callback=_absolute_dir, help=HOOKS_DIR_HELP)
@click.option("--dry-run", is_flag=True, help="Say what would change; write nothing.")
@click.pass_context
def hook_uninstall(cctx: click.Context, hooks_dir: Optional[str], dry_run: bool) -> None:
    """Remove the qemu hook, only if vgpuhost wrote it."""
    ctx = cctx.obj
    st = None if dry_run else store(ctx)
    _outcome(ctx, hookmod.uninstall(ctx.host, hooks_dir=hooks_dir, dry_run=dry_run, store=st))


@hook.command("status")
@click.option("--hooks-dir", metavar="DIR", callback=_absolute_dir, help=HOOKS_DIR_HELP)
@click.pass_context
def hook_status(cctx: click.Context, hooks_dir: Optional[str]) -> None:
    """Is the hook installed and current, does libvirt's directory exist, what does the allow-list allow?

    Also lists the other qemu hooks libvirt runs, in its order, and warns about one whose text names a GPU
    of this host or a tool or sysfs file of the GPU device layer.  Exit 0 when installed, current and
    executable, the allow-list reads and names only GPUs of this host, and no other hook is warned about;
    1 otherwise.
    """
    ctx = cctx.obj
    doc = _status(ctx.host, hooks_dir)
    yes = {True: "yes", False: "no"}
    install = "vgpuhost hook install" + (f" --hooks-dir {shlex.quote(hooks_dir)}" if hooks_dir else "")
    installed = yes[doc["installed"]]
    foreign = not doc["installed"] and files.lexists(doc["path"])
    if foreign:
        installed += " (a file not written by vgpuhost is there)"
    lines = [f"hook:        {doc['path']}",
             f"installed:   {installed}",
             f"current:     {yes[doc['current']]}" + ("" if doc["current"] or not doc["installed"] else
                                                      f" (run '{install}' to update it)"),
             f"executable:  {yes[doc['executable']]}",
             f"hooks dir:   {doc['hooks_dir']} ({'exists' if doc['hooks_dir_exists'] else 'missing'})",
             f"allow-list:  {doc['allow']['path']}: {doc['allow']['summary']}",
             f"bundle:      {doc['bundle']['path']}: {_bundle_line(doc['bundle'], install)}"]
    if doc["allow"]["error"]:
        lines.append(f"             {doc['allow']['error']}")
    if doc["allow"]["missing"]:
        lines.append("             allow-list names GPUs this host does not have: "
                     f"{', '.join(doc['allow']['missing'])} (fix or remove those lines)")
    for o in doc["other_hooks"]:
        when = "before" if o["before_vgpuhost"] else "after"
        line = f"other hook:  {o['path']} (runs {when} vgpuhost's, #{o['order']})"
        if o["gpus"] or o["acts_on"]:
            named = ", ".join(o["gpus"] + o["acts_on"])
            line += (f": WARNING: it names {named}, which vgpuhost manages on this host: a hook that changes a "
                     "GPU's drivers, VFs or vGPUs can undo or break what vgpuhost makes (make it skip the "
                     "GPUs vgpuhost manages)")
        lines.append(line)
    if foreign:
        lines.append(f"not installed: {doc['path']} is someone else's: move it aside, then run '{install}' "
                     "and reload libvirtd (systemctl reload libvirtd)")
    elif not doc["installed"]:
        lines.append(f"not installed: run '{install}', then reload libvirtd (systemctl reload libvirtd)")
    emit(ctx, doc, "\n".join(lines))
    sys.exit(0 if doc["ok"] else 1)


def _bundle_line(b: dict, install: str) -> str:
    """``hook status``'s line on the handler's module bundle (io/modbundle.py): only speed depends on it."""
    if b["state"] == "current":
        return f"current ({b['modules']} modules)"
    if b["state"] == "folder-symlink":
        folder = os.path.dirname(b["path"])
        return (f"not used, its folder {folder} is a symbolic link (the hook loads its modules from their "
                f"files, a little slower; remove the link (rm {shlex.quote(folder)}), then run '{install}')")
    why = {"stale": f"{len(b['stale'])} of its {b['modules']} modules changed since (the hook loads those",
           "damaged": f"damaged: the code of {len(b['damaged'])} of its {b['modules']} modules fails its checksum "
                      "(the hook loads those",
           "missing": "missing (the hook loads its modules",
           "untrusted": "not used, not a regular file of root's that only root may write (the hook loads its modules",
           "old-format": "not used, an older vgpuhost's bundle format (the hook loads its modules",
           "other-python": "not used, a bundle for another Python (the hook loads its modules",
           "unreadable": "not used, cut short, grown or not a bundle (the hook loads its modules"}.get(
               b["state"], f"{b['state']} (the hook loads its modules")
    return f"{why} from their files, a little slower; '{install}' writes it anew)"


def _status(host, hooks_dir: Optional[str]) -> dict:
    """:func:`vgpuhost.hook.install.status`, with three fields as the operator needs them.

    - ``installed``: vgpuhost's hook is there (a file vgpuhost did not write
      at that path is not an installed hook: ``written_by_vgpuhost`` is
      false and install refuses to overwrite it).
    - ``allow.path``: the file actually read (``<root>/etc/vgpuhost/hook.allow``),
      as ``path`` names the hook under the root.
    - ``allow.summary``: "unreadable" only when the file cannot be read;
      a file that reads but does not parse is "malformed".
    """
    doc = hookmod.status(host, hooks_dir=hooks_dir)
    doc["installed"] = bool(doc["installed"] and doc["written_by_vgpuhost"])
    doc["ok"] = bool(doc["ok"] and doc["installed"])
    allow = doc["allow"]
    path = hookmod.allow_path(host)
    allow["path"] = str(path)
    if allow.get("error"):
        if files.can_open(path):
            allow["summary"] = "malformed: the hook refuses every GPU domain"
        else:
            allow["summary"] = "unreadable: the hook refuses every GPU domain"
    return doc


COMMANDS: List[click.Command] = [hook]
