"""`vgpuhost agent`: run the resident agent (the local API on unix sockets).

Registered on the main group by cli/main.py (``COMMANDS``).  Logic lives in
:mod:`vgpuhost.agent.server`; this module parses options and starts the
server the program's entry point handed over (:func:`vgpuhost.__main__.serve_agent`,
in the Context): cli and agent sit side by side, so it never imports it.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import click

from ..model.errors import InputError
from .common import Finite, current


@click.command("agent")
@click.option("--socket-dir", metavar="DIR",
              help="Where to listen: DIR/agent.sock (admin), DIR/agent-ro.sock (read-only) and "
                   "DIR/agent-tenant.sock (tenant members); default <root>/run/vgpuhost.  Ignored when "
                   "systemd passes the sockets (socket activation).")
@click.option("--admin-group", default="vgpuhost", show_default=True, metavar="GROUP",
              help="Group (name or gid) of the admin socket; its members may change the host.")
@click.option("--ro-group", default="vgpuhost-ro", show_default=True, metavar="GROUP",
              help="Group (name or gid) of the read-only socket; its members may read.")
@click.option("--tenant-group", "tenant_groups", multiple=True, metavar="GROUP=TENANT",
              help="Members of GROUP (a name or gid) are members of TENANT: they read their tenant's data and "
                   "allocate and release for its domains, on the tenant socket (repeatable).")
@click.option("--tenant-group-prefix", default="vgpuhost-t-", show_default=True, metavar="PREFIX",
              help="A group named PREFIX<tenant> maps its members to that tenant too ('' turns this off).")
@click.option("--metering-interval", type=Finite(0, 3600), default=10.0, show_default=True,
              metavar="S", help="Run the metering sampler every S seconds and serve it on /v1/metrics "
                                "(0: off).  Run this or 'vgpuhost exporter' on a host, not both.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), metavar="PORT",
              help="Also serve /metrics over TCP for Prometheus (0: any free port, printed).  Any local user "
                   "can read it: see --metrics-scope.")
@click.option("--metrics-scope", type=click.Choice(["host", "all"]), default="host", show_default=True,
              help="What the --metrics-port page holds: host (GPUs, pools, health, the sampler; no series "
                   "naming a tenant, domain or device) or all (every tenant's too, as /v1/metrics serves "
                   "the admin and read-only groups: restrict who may connect, docs/guide/alerts.md); "
                   "all without --metrics-port is refused (exit 2).")
@click.option("--metrics-listen", default="127.0.0.1", show_default=True, metavar="ADDR",
              help="Address of the --metrics-port listener (loopback unless you mean otherwise).")
@click.option("--libvirt-uri", default="qemu:///system", show_default=True, metavar="URI",
              help="The libvirt URI attach/detach connect to.  A caller may name only this URI or "
                   "qemu:///system (no other URI, no parameters); the CLI does the others itself.")
@click.option("--max-connections", type=click.IntRange(1, 4096), default=64, show_default=True, metavar="N",
              help="Connections each socket serves at once (a thread each); one more is answered 429 and "
                   "closed (the qemu hook then does the work itself).")
@click.option("--read-timeout", type=Finite(0.1, 3600), default=10.0, show_default=True, metavar="S",
              help="Close a connection that sends nothing for S seconds while its request is read.")
@click.option("--request-timeout", type=Finite(0.1, 3600), default=30.0, show_default=True,
              metavar="S", help="Answer 408 and close a connection whose request (line, headers and body) "
                                "has not all arrived S seconds after it connected, however it paces it.")
def agent_cmd(socket_dir: Optional[str], admin_group: str, ro_group: str, tenant_groups: Tuple[str, ...],
              tenant_group_prefix: str, metering_interval: float, metrics_port: Optional[int], metrics_scope: str,
              metrics_listen: str,
              libvirt_uri: str, max_connections: int, read_timeout: float, request_timeout: float) -> None:
    """Serve the local API (JSON over HTTP, /v1/...) until SIGTERM.

    Reads (inventory, types, capacity, vGPUs, domains, tenants, usage, audit,
    plan, assert, metrics) on the admin and read-only sockets; changes
    (allocate, release, the hook's prepare/release, vgpu create/remove, apply,
    reconcile, passthrough, attach/detach, tenant writes) on the admin socket
    only, through the same operations, locks and audit log as the CLI, whose
    write commands come here when the agent answers.  Members of a tenant's
    group (--tenant-group, --tenant-group-prefix) read their tenant's data and
    allocate and release for its domains on the tenant socket.  The API
    document: GET /v1/openapi.
    """
    if metrics_scope == "all" and metrics_port is None:
        raise InputError("--metrics-scope all applies to the --metrics-port listener, and no --metrics-port is "
                         "given: nothing would serve those series over TCP",
                         hint="give --metrics-port PORT as well, or leave --metrics-scope out (/v1/metrics on "
                              "the admin and read-only sockets serves every series)")
    ctx = current()
    if ctx.serve_agent is None:     # cli.main.main called without the entry point's server: a bug
        raise RuntimeError("vgpuhost agent runs only from the program's entry point (vgpuhost.__main__)")

    def ready(proc) -> None:
        where = ", ".join(p for p in proc.bound) or "sockets passed by systemd"
        m = proc.agent.metering
        if m is not None and getattr(m, "metrics_port", None) is not None:
            host = f"[{metrics_listen}]" if ":" in metrics_listen else metrics_listen     # an IPv6 address
            where += f"; metrics on http://{host}:{m.metrics_port}/metrics"
        click.echo(f"vgpuhost agent: listening on {where}", err=True)
        sys.stderr.flush()
    ctx.serve_agent(ctx.host, socket_dir=socket_dir, admin_group=admin_group, ro_group=ro_group, ready=ready,
                    metering_interval_s=metering_interval, libvirt_uri=libvirt_uri,
                    max_connections=max_connections, read_timeout_s=read_timeout,
                    tenant_groups=tenant_groups, tenant_prefix=tenant_group_prefix,
                    request_timeout_s=request_timeout,
                    metrics_listen=(metrics_listen, metrics_port, metrics_scope) if metrics_port is not None else None)


COMMANDS: List[click.Command] = [agent_cmd]
