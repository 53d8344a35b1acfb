"""`vgpuhost agent`: run the resident agent (the local API on unix sockets).

Registered on the main group by cli/main.py (``COMMANDS``).  Logic lives in
:mod:`vgpuhost.agent.server`; this module parses options.
"""

from __future__ import annotations

from typing import List, Optional

import click


@click.command("agent")
@click.option("--socket-dir", metavar="DIR",
              help="Where to listen: DIR/agent.sock (admin) and DIR/agent-ro.sock (read-only); default "
                   "<root>/run/vgpuhost.  Ignored when systemd passes the sockets (socket activation).")
@click.option("--admin-group", default="vgpuhost", show_default=True, metavar="GROUP",
              help="Group (name or gid) of the admin socket; its members may change the host.")
@click.option("--ro-group", default="vgpuhost-ro", show_default=True, metavar="GROUP",
              help="Group (name or gid) of the read-only socket; its members may read.")
def agent_cmd(socket_dir: Optional[str], admin_group: str, ro_group: str) -> None:
    """Serve the local API (JSON over HTTP, /v1/...) until SIGTERM.

    Reads (inventory, types, capacity, vGPUs, domains, tenants, usage, audit,
    plan, assert, metrics) on both sockets; changes (allocate, release, the
    hook's prepare/release, apply, reconcile) on the admin socket only, through
    the same operations, locks and audit log as the CLI.  The API document:
    GET /v1/openapi.
    """
    import sys
    from ..agent.server import serve
    from .common import current
    ctx = current()

    def ready(proc) -> None:
        where = ", ".join(p for p in proc.bound) or "sockets passed by systemd"
        click.echo(f"vgpuhost agent: listening on {where}", err=True)
        sys.stderr.flush()
    serve(ctx.host, socket_dir=socket_dir, admin_group=admin_group, ro_group=ro_group, ready=ready)


COMMANDS: List[click.Command] = [agent_cmd]
