"""`vgpuhost` commands: install-units (the boot units, the agent's units and the exporter's).

Registered on the main group by cli/main.py: every click command in
``COMMANDS`` becomes a top-level command.  Logic lives in
:mod:`vgpuhost.units`; this module parses options and prints.
"""

from __future__ import annotations

from typing import List, Optional

import click

from ..ops import units
from .common import current
from .output import dumps


@click.command("install-units", short_help="Install vgpuhost's systemd units (boot, agent, exporter).")
@click.option("--unit-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Where to write the units, an absolute path (default <root>/etc/systemd/system).")
@click.option("--config", "config", metavar="FILE", default=None,
              help="Layout config file as the booted host names it (default /etc/vgpuhost/config.yaml).")
@click.option("--layout", metavar="NAME", help="Layout to apply at boot (default: the config's default).")
@click.option("--exe", metavar="PATH", help="vgpuhost executable named in the units (default: this one).")
@click.option("--retries", type=int, default=None, metavar="N", help="Tries per unit at boot (default 6).")
@click.option("--retry-delay", type=int, default=None, metavar="S", help="Seconds between tries (default 10).")
@click.option("--agent/--no-agent", default=True, show_default=True,
              help="Also the agent's units: vgpuhost-agent.socket, vgpuhost-agent-ro.socket (socket "
                   "activation) and vgpuhost-agent.service.")
@click.option("--metering", type=click.Choice(["agent", "exporter"]), default=None,
              help="Who meters the host, one sampler only: the agent (default with --agent; /metrics on "
                   "127.0.0.1:9842) or vgpuhost-exporter.service (default with --no-agent).  The exporter "
                   "unit is always written, and to be enabled only when it meters.")
@click.option("--dry-run", is_flag=True, help="Say what would change; write nothing.")
def install_units(unit_dir: Optional[str], config: Optional[str], layout: Optional[str], exe: Optional[str],
                  retries: Optional[int], retry_delay: Optional[int], agent: bool, metering: Optional[str],
                  dry_run: bool) -> None:
    """Write vgpuhost's systemd units (idempotent), naming the vgpuhost that runs (or --exe).

    vgpuhost-layout.service and vgpuhost-reconcile.service apply the layout
    and re-create recorded vGPUs at boot, after the NVIDIA driver and before
    libvirtd, with retries.  The agent's sockets start it on demand; enabling
    vgpuhost-agent.service also starts it at boot so its sampler meters.
    vgpuhost-exporter.service meters instead with --metering exporter.  Never
    runs systemctl or groupadd: prints the commands still needed.
    """
    ctx = current()
    out = units.install(ctx.host, unit_dir=unit_dir, exe=exe,
                        config=config or units.DEFAULT_CONFIG, layout=layout,
                        retries=units.DEFAULT_RETRIES if retries is None else retries,
                        retry_delay=units.DEFAULT_RETRY_DELAY if retry_delay is None else retry_delay,
                        dry_run=dry_run, agent=agent, metering=metering)
    click.echo(dumps(out.as_dict()) if ctx.json else out.text())


COMMANDS: List[click.Command] = [install_units]
