"""`vgpuhost migrate request|check`: can a destination take a live-migrating domain with vGPUs, and why not.

Logic lives in :mod:`vgpuhost.ops.migrate` (decisions in :mod:`vgpuhost.policy.migration`); this
module parses options, reads the domain (libvirt, or ``--xml FILE``) and prints.  Both commands
change nothing on either host (docs/guide/migration.md).
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import click

from ..io.files import read_capped
from ..io.virt import open_connection
from ..libvirt.domxml import parse_domain
from ..model.errors import EXIT_INPUT, EXIT_OK, InputError
from ..ops import migrate as ops
from ..policy.migration import parse_request
from .common import Context, emit, pass_ctx, store
from .context import printable
from .output import dumps

#: the most bytes of a request document read from stdin (``--incoming``)
MAX_REQUEST_BYTES = 1 << 20


def _view(ctx: Context, domain: Optional[str], xml: Optional[str]):
    """The domain's view: from ``--xml FILE`` ('-': stdin), else libvirt (``--connect``) by name or UUID."""
    if xml is not None:
        if xml == "-":
            data = sys.stdin.buffer.read(4 * 1024 * 1024 + 1)
        else:
            try:
                data = read_capped(xml, 4 * 1024 * 1024 + 1)
            except OSError as e:
                raise InputError(f"cannot read {xml!r}: {e.strerror}", hint="give the domain XML file") from None
        view = parse_domain(data)
        if domain is not None and domain not in (view.name, view.uuid):
            raise InputError(f"--xml describes domain {view.name!r}, not {domain!r}",
                             hint="give the XML of the domain named, or leave DOMAIN out")
        return view
    if domain is None:
        raise click.UsageError("give DOMAIN (looked up in libvirt) or --xml FILE")
    with open_connection(ctx.connect) as conn:
        return parse_domain(conn.lookup(domain).live_xml())


@click.group()
def migrate() -> None:
    """Live migration of domains with vGPUs: check a destination before 'virsh migrate'."""


@migrate.command("request")
@click.argument("domain", required=False)
@click.option("--xml", "xml", metavar="FILE", help="Read the domain XML from FILE ('-': stdin), not from libvirt.")
@pass_ctx
def migrate_request(ctx: Context, domain: Optional[str], xml: Optional[str]) -> None:
    """Print what this host (the source) sends a destination for DOMAIN: its devices, binding and vGPU
    manager version (vgpuhost.migrate-request/v1; pipe it to 'vgpuhost migrate check --incoming' there)."""
    view = _view(ctx, domain, xml)
    click.echo(dumps(ops.request_for(ctx.host, store(ctx, write=False), view).as_dict()))


def _text(doc: dict) -> str:
    """The check document as text; every string escaped (:func:`printable`): no terminal control
    sequence or line break of another host's answer reaches the terminal."""
    def p(v) -> str:
        return printable(str(v), 1000)
    if doc["ok"]:
        where = ", ".join(f"{p(d['profile'])} {p(d['device'])} -> {p(d['parent'] if d['kind'] == 'vf' else d['gpu'])}"
                          for d in doc["devices"]) or "no vGPU"
        return f"{p(doc['destination'])} can take {p(doc['domain'])}: {where}"
    lines = [f"refused: {p(r['line'])}; fix: {p(r['fix'])}" for r in doc["refusals"]]
    lines.append(f"{p(doc['destination'])} cannot take {p(doc['domain'])} ({len(doc['refusals'])} refusal(s))")
    return "\n".join(lines)


@migrate.command("check")
@click.argument("domain", required=False)
@click.option("--to", "dest", metavar="DEST",
              help="The destination: ssh://[USER@]HOST[:PORT] or qemu+ssh://[USER@]HOST[:PORT]/system (runs "
                   "'vgpuhost --json migrate check --incoming' there over ssh, no prompt), or another host root "
                   "(a directory, as VGPUHOST_ROOT).")
@click.option("--incoming", is_flag=True,
              help="This host is the destination: read the source's request document (vgpuhost migrate "
                   "request) on stdin.")
@click.option("--xml", "xml", metavar="FILE", help="Read the domain XML from FILE ('-': stdin), not from libvirt.")
@pass_ctx
def migrate_check(ctx: Context, domain: Optional[str], dest: Optional[str], incoming: bool, xml: Optional[str]) -> None:
    """Can the destination take DOMAIN: same vGPU type creatable there, vGPU manager versions, MIG profile
    free, admission for its tenant; passthrough refused.  Exit 2 with one line per refusal; changes nothing."""
    if incoming == (dest is not None):
        raise click.UsageError("give exactly one of --to DIR or --incoming")
    if incoming:
        if domain is not None or xml is not None:
            raise click.UsageError("--incoming reads the request on stdin: no DOMAIN or --xml")
        raw = sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1)
        if len(raw) > MAX_REQUEST_BYTES:
            raise InputError(f"the request on stdin is larger than {MAX_REQUEST_BYTES} bytes",
                             hint="make it with 'vgpuhost migrate request DOMAIN'")
        try:
            doc_in = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise InputError("the request on stdin is not JSON",
                             hint="make it with 'vgpuhost migrate request DOMAIN' on the source host") from None
        ctx.host.require_host()
        doc = ops.check_incoming(ctx.host, parse_request(doc_in))
    else:
        ctx.host.require_host()
        doc = ops.check(ctx.host, store(ctx, write=False), _view(ctx, domain, xml), dest)
    emit(ctx, doc, _text(doc))
    sys.exit(EXIT_OK if doc["ok"] else EXIT_INPUT)


COMMANDS: List[click.Command] = [migrate]
