"""The ``vgpuhost`` command line (click).

Owns: option parsing, choosing human or ``--json`` output, and mapping
errors to exit codes (0 ok, 1 problems found / drift, 2 usage, input or
environment error, 3 device operation failed, 4 internal error).  Must not:
hold logic of its own; it calls inventory, checks, sim and output.
"""

from __future__ import annotations

import logging
import signal
import sqlite3
import sys
import threading
import traceback
from pathlib import Path
from typing import Optional

import click

from .. import __version__
from ..model.errors import EXIT_INPUT, EXIT_OK, EXIT_PROBLEMS, InputError, RefusedError, VgpuhostError
from ..io.hostroot import HostRoot

EXIT_INTERNAL = 4
log = logging.getLogger("vgpuhost")


class Context:
    """What the global options set: the host root and output mode."""

    def __init__(self, root: Optional[str], state_dir: Optional[str], connect: Optional[str],
                 json_out: bool, verbose: int):
        self._root = root
        self._state_dir = state_dir
        self.connect = connect
        self.json = json_out
        self.verbose = verbose
        self._host: Optional[HostRoot] = None

    @property
    def host(self) -> HostRoot:
        if self._host is None:
            self._host = HostRoot.from_env(self._root, self._state_dir)
        return self._host

    def sysfs(self):
        from ..io.sysfs import Sysfs
        return Sysfs(self.host)

    def inventory(self, *, with_types: bool = True):
        from ..observe.inventory import discover
        self.host.require_host()
        return discover(self.sysfs(), with_types=with_types)


pass_ctx = click.make_pass_decorator(Context)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--root", metavar="DIR", help="Host root (default $VGPUHOST_ROOT or /); a simulated host works too.")
@click.option("--state-dir", metavar="DIR", help="State directory (default <root>/var/lib/vgpuhost).")
@click.option("--connect", "-c", "connect", metavar="URI", help="libvirt URI (attach/detach).")
@click.option("--json", "json_out", is_flag=True, help="Machine-readable output (documented, stable).")
@click.option("-v", "--verbose", count=True, help="More logging; -vv shows tracebacks.")
@click.version_option(__version__, prog_name="vgpuhost")
@click.pass_context
def cli(ctx: click.Context, root, state_dir, connect, json_out, verbose) -> None:
    """Share NVIDIA GPUs between libvirt/KVM VMs: passthrough, vGPU, MIG."""
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), format="vgpuhost: %(message)s")
    ctx.obj = Context(root, state_dir, connect, json_out, verbose)


def _emit(ctx: Context, doc, text: str) -> None:
    from .output import dumps
    click.echo(dumps(doc) if ctx.json else text)


def _parse_gpu_option(ctx: Context, inv, gpu: Optional[str]):
    if gpu is None:
        return None
    from ..model.values import PciAddress
    addr = PciAddress.parse(gpu)
    if inv is not None and inv.gpu(addr) is None:
        known = ", ".join(str(g.address) for g in inv.gpus) or "none"
        raise InputError(f"no NVIDIA GPU at {addr}", hint=f"GPUs on this host: {known} ('vgpuhost gpus')")
    return addr


# --- host ----------------------------------------------------------------

@cli.group()
def host() -> None:
    """Host readiness."""


@host.command("check")
@pass_ctx
def host_check(ctx: Context) -> None:
    """Is this host ready for GPU virtualisation?  Exit 0 ready, 1 problems found."""
    from ..policy.checks import check_host, is_ready
    from .output import check_doc, check_text
    findings = check_host(ctx.inventory())
    _emit(ctx, check_doc(findings), check_text(findings))
    sys.exit(EXIT_OK if is_ready(findings) else EXIT_PROBLEMS)


@cli.command("gpus")
@pass_ctx
def gpus(ctx: Context) -> None:
    """List NVIDIA GPUs, their IOMMU groups and the backends each can serve."""
    from .output import gpus_doc, gpus_table
    inv = ctx.inventory()
    _emit(ctx, gpus_doc(inv), gpus_table(inv) if inv.gpus else "no NVIDIA GPU found")


@cli.command("types")
@click.option("--gpu", metavar="BDF", help="Only this GPU (dddd:bb:ss.f).")
@click.option("--available", is_flag=True, help="Only types with free instances now.")
@pass_ctx
def types(ctx: Context, gpu: Optional[str], available: bool) -> None:
    """List vGPU types per GPU with max and available instances."""
    from .output import aggregate_types, types_doc, types_table
    _parse_gpu_option(ctx, None, gpu)          # a bad BDF fails before the host is read
    inv = ctx.inventory()
    addr = _parse_gpu_option(ctx, inv, gpu)
    entries = aggregate_types((t for t in inv.vgpu_types if addr is None or t.gpu == addr), inv)
    if available:
        entries = [e for e in entries if e["available_instances"] > 0]
    _emit(ctx, types_doc(entries), types_table(entries) if entries else "no vGPU types")


# --- passthrough -----------------------------------------------------------

@cli.group()
def passthrough() -> None:
    """Whole GPUs to one VM: bind an IOMMU group to vfio-pci, and give it back."""


def _store(ctx: Context, *, write: bool = True):
    """The state store; ``write=False`` (list, audit, checks, dry runs) never creates one."""
    from ..io.state import StateStore
    return StateStore(ctx.host.state_dir, create=write)


def _outcome(ctx: Context, out) -> None:
    if ctx.json:
        _emit(ctx, out.as_dict(), "")
        return
    verb = "would" if out.dry_run else ("did" if out.changed else "no change:")
    lines = []
    if out.steps:
        lines.append(f"{out.action} {out.gpu} (IOMMU group {out.group}): {verb}")
        lines += [f"  {s}" for s in out.steps]
    for f in out.functions:
        if f["from"] != f["to"]:
            lines.append(f"  {f['bdf']}: {f['from'] or 'no driver'} -> {f['to'] or 'no driver'}")
    lines += [f"note: {n}" for n in out.notes]
    click.echo("\n".join(lines))


@passthrough.command("prepare")
@click.argument("bdf")
@click.option("--allow-boot-vga", is_flag=True, help="Also when the GPU drives the host console.")
@click.option("--persist", is_flag=True, help="Record driverctl overrides (etc/driverctl.d) for boot.")
@click.option("--dry-run", is_flag=True, help="Print the exact steps; change nothing.")
@pass_ctx
def passthrough_prepare(ctx: Context, bdf: str, allow_boot_vga: bool, persist: bool, dry_run: bool) -> None:
    """Bind every function of BDF's IOMMU group to vfio-pci (idempotent)."""
    from ..ops.passthrough import prepare
    from ..model.values import PciAddress
    addr = PciAddress.parse(bdf)
    _outcome(ctx, prepare(ctx.host, _store(ctx, write=not dry_run), addr, allow_boot_vga=allow_boot_vga,
                          persist=persist, dry_run=dry_run))


@passthrough.command("release")
@click.argument("bdf")
@click.option("--persist", is_flag=True, help="Also remove the driverctl overrides.")
@click.option("--dry-run", is_flag=True, help="Print the exact steps; change nothing.")
@pass_ctx
def passthrough_release(ctx: Context, bdf: str, persist: bool, dry_run: bool) -> None:
    """Give BDF's group back to its original drivers, companions first (idempotent)."""
    from ..ops.passthrough import release
    from ..model.values import PciAddress
    addr = PciAddress.parse(bdf)
    _outcome(ctx, release(ctx.host, _store(ctx, write=not dry_run), addr, persist=persist, dry_run=dry_run))


@passthrough.command("modprobe-config")
@click.argument("bdf")
@pass_ctx
def passthrough_modprobe_config(ctx: Context, bdf: str) -> None:
    """Print vfio-pci ids= and softdep lines for binding BDF's group at boot."""
    from ..ops.passthrough import modprobe_config
    from ..model.values import PciAddress
    addr = PciAddress.parse(bdf)
    fs = ctx.sysfs()
    from ..observe.inventory import discover
    records = {r.bdf: r for r in _store(ctx, write=False).passthrough_records()}
    text = modprobe_config(discover(fs, with_types=False), addr, fs, records)
    _emit(ctx, {"schema": "vgpuhost.modprobe-config/v1", "gpu": str(addr), "text": text}, text.rstrip("\n"))


# --- vGPU ------------------------------------------------------------------

@cli.group()
def vgpu() -> None:
    """Time-sliced and MIG-backed vGPUs on mdev or vendor-specific VFIO."""


def _vgpu_outcome(ctx: Context, out) -> None:
    if ctx.json:
        _emit(ctx, out.as_dict(), "")
        return
    verb = "would" if out.dry_run else "did"
    lines = []
    if out.action == "create":
        head = f"{'would create' if out.dry_run else 'created'} {out.type_name} {out.id} on {out.parent}"
        lines.append(f"{head} (GPU {out.gpu}, {out.backend}, owner {out.owner})")
        lines.append(f"placement: {out.reason}")
    else:
        lines.append(f"{'would remove' if out.dry_run else 'removed'} {out.type_name} {out.id} "
                     f"from {out.parent} (owner {out.owner})")
    if out.steps:
        lines.append(f"{verb}:")
        lines += [f"  {s}" for s in out.steps]
    lines += [f"note: {n}" for n in out.notes]
    click.echo("\n".join(lines))


@vgpu.command("create")
@click.option("--profile", required=True, metavar="NAME", help="vGPU type name as the device reports it (A40-8Q).")
@click.option("--gpu", metavar="BDF", help="Only on this GPU.")
@click.option("--uuid", metavar="UUID", help="mdev UUID (default: a new one).")
@click.option("--strategy", default="first-fit", show_default=True,
              type=click.Choice(["first-fit", "best-fit", "worst-fit", "spread"]))
@click.option("--owner", default="manual", show_default=True, metavar="DOMAIN_UUID", help="Who holds it.")
@click.option("--params", metavar="K=V,...", help="vgpu_params, e.g. frame_rate_limiter=0.")
@click.option("--numa-node", type=click.IntRange(0, 1023), help="Prefer GPUs on this NUMA node.")
@click.option("--anti-affinity", metavar="KEY", help="No two vGPUs with KEY on one GPU.")
@click.option("--persist", is_flag=True, help="Define it in mdevctl (classic mdev only) so it comes back at boot.")
@click.option("--create-gi", is_flag=True, help="MIG-backed profile: create the GPU instance it needs.")
@click.option("--dry-run", is_flag=True, help="Show the placement decision and steps; change nothing.")
@pass_ctx
def vgpu_create(ctx: Context, profile, gpu, uuid, strategy, owner, params, numa_node, anti_affinity,
                persist, create_gi, dry_run) -> None:
    """Create a vGPU of PROFILE, placed by STRATEGY."""
    from ..model.values import PciAddress
    from ..ops.vgpu import create
    _vgpu_outcome(ctx, create(ctx.host, _store(ctx, write=not dry_run), profile=profile,
                              gpu=PciAddress.parse(gpu) if gpu else None, uuid=uuid, strategy=strategy,
                              owner=owner, params=params, numa_node=numa_node, anti_affinity=anti_affinity,
                              persist=persist, create_gi=create_gi, dry_run=dry_run))


@vgpu.command("remove")
@click.argument("vgpu_id", metavar="ID")
@click.option("--owner", metavar="DOMAIN_UUID", help="Only while this owner holds it.")
@click.option("--dry-run", is_flag=True, help="Show the steps; change nothing.")
@pass_ctx
def vgpu_remove(ctx: Context, vgpu_id: str, owner: Optional[str], dry_run: bool) -> None:
    """Remove a vGPU vgpuhost created (ID: mdev UUID, or the VF's BDF)."""
    from ..ops.vgpu import remove
    _vgpu_outcome(ctx, remove(ctx.host, _store(ctx, write=not dry_run), vgpu_id, owner=owner, dry_run=dry_run))


@vgpu.command("list")
@pass_ctx
def vgpu_list(ctx: Context) -> None:
    """vGPUs on the host, with owners; 'foreign' = not created by vgpuhost."""
    from .output import table
    from ..ops.vgpu import list_vgpus
    entries = list_vgpus(ctx.inventory(), _store(ctx, write=False).vgpu_records())
    _emit(ctx, {"schema": "vgpuhost.vgpu-list/v1", "vgpus": [e.as_dict() for e in entries]},
          table(["ID", "GPU", "PARENT", "TYPE", "NAME", "OWNER", "STATE"],
                [[e.id, e.gpu, e.parent, e.type_id, e.type_name, e.owner, e.state] for e in entries])
          if entries else "no vGPUs")


@cli.command("reconcile")
@click.option("--check", is_flag=True, help="Change nothing; exit 1 when the host and the records disagree.")
@click.option("--forget-domains", is_flag=True,
              help="At boot, before libvirtd: release what domains recorded as running still hold "
                   "(a crash skipped their 'release end'), then forget them.")
@pass_ctx
def reconcile_cmd(ctx: Context, check: bool, forget_domains: bool) -> None:
    """Re-create recorded vGPUs that are missing (boot); report foreign ones; remove nothing."""
    from ..ops.vgpu import reconcile
    ctx.host.require_host()
    if forget_domains:
        if check:
            raise click.UsageError("--forget-domains changes the state; it does not go with --check")
        _forget_domains(ctx)
        return
    rep = reconcile(ctx.host, _store(ctx, write=not check), check=check)
    lines = []
    for label, items in (("re-created", rep.recreated), ("missing", rep.missing), ("FAILED", rep.failed),
                         ("type changed", rep.mismatched), ("foreign (left alone)", rep.orphans)):
        lines += [f"{label}: {i}" for i in items]
    lines.append("in sync" if rep.in_sync else "NOT in sync")
    _emit(ctx, rep.as_dict(), "\n".join(lines))
    sys.exit(EXIT_OK if rep.in_sync else EXIT_PROBLEMS)


def _forget_domains(ctx: Context) -> None:
    """``reconcile --forget-domains``: the ``release end`` a host crash skipped, for every domain
    the hook recorded as running.  Refused while any qemu process runs (then domains may run)."""
    from ..ops.devices import release_domain
    from ..observe.inventory import discover
    from ..io.sysfs import Sysfs
    store = _store(ctx, write=False)
    running = store.active_domains()
    if running:
        qemu = sorted(p for p in discover(Sysfs(ctx.host)).host.processes
                      if p.startswith(("qemu-system", "qemu-kvm")))
        if qemu:
            raise RefusedError(f"qemu is running ({', '.join(qemu)}): domains may be running, so the "
                               f"{len(running)} recorded as running are not forgotten",
                               hint="--forget-domains is for boot, before libvirtd starts any domain")
        store = _store(ctx, write=True)
    forgotten = []
    for uuid, name in running.items():
        released = release_domain(ctx.host, store, uuid, actor=f"reconcile --forget-domains {name}")
        forgotten.append({"uuid": uuid, "name": name, "released": released})
    doc = {"schema": "vgpuhost.forget-domains/v1", "forgotten": forgotten}
    lines = [f"forgot {d['name']} ({d['uuid']})" + (f": released {', '.join(d['released'])}" if d["released"]
                                                      else "") for d in forgotten]
    _emit(ctx, doc, "\n".join(lines) or "no domain recorded as running")


# --- audit -----------------------------------------------------------------

@cli.command("audit")
@click.option("--since", metavar="WHEN", help="ISO 8601 time (2026-11-29T10:00) or an age: 30m, 2h, 7d.")
@pass_ctx
def audit(ctx: Context, since: Optional[str]) -> None:
    """Print the audit log: every write vgpuhost made to the host."""
    from .output import table
    start = _parse_since(since) if since else None
    rows = _store(ctx, write=False).audit_rows(start)
    doc = {"schema": "vgpuhost.audit/v1", "since": start,
           "rows": [r.__dict__ for r in rows]}
    _emit(ctx, doc, table(["TIME", "ACTOR", "OPERATION", "PATH", "VALUE", "RESULT"],
                          [[r.time[:23], r.actor, r.operation, r.path, r.value, r.result] for r in rows])
          if rows else "audit log is empty")


def _parse_since(text: str) -> str:
    import re
    from datetime import datetime, timedelta, timezone
    m = re.fullmatch(r"\s*(\d{1,9})\s*([smhd])\s*", text)
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m[2]]
        try:
            return (datetime.now(timezone.utc) - timedelta(**{unit: int(m[1])})).isoformat(timespec="microseconds")
        except OverflowError:
            return datetime.min.replace(tzinfo=timezone.utc).isoformat(timespec="microseconds")
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InputError(f"invalid --since {text!r}",
                         hint="give an ISO 8601 time (2026-11-29T10:00, UTC unless an offset is given) "
                              "or an age like 30m, 2h, 7d") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).isoformat(timespec="microseconds")


# --- simulator -----------------------------------------------------------

@cli.group()
def sim() -> None:
    """Simulated hosts: try vgpuhost without a GPU."""


@sim.command("specs")
@pass_ctx
def sim_specs(ctx: Context) -> None:
    """List the host specs shipped with vgpuhost."""
    from .output import table
    from ..sim import bundled_specs
    from ..sim.spec import load_spec
    rows = []
    for name, path in bundled_specs().items():
        rows.append([name, load_spec(path).summary])
    _emit(ctx, {"schema": "vgpuhost.sim-specs/v1", "specs": [{"name": r[0], "summary": r[1]} for r in rows]},
          table(["NAME", "SUMMARY"], rows))


@sim.command("create")
@click.argument("spec")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace a simulated host already at DIRECTORY.")
@pass_ctx
def sim_create(ctx: Context, spec: str, directory: str, force: bool) -> None:
    """Build a simulated host from SPEC (a file or a shipped name) at DIRECTORY."""
    from ..sim import bundled_specs
    from ..sim.build import materialise
    from ..sim.spec import load_spec
    specs = bundled_specs()
    if "/" not in spec and not spec.endswith((".yaml", ".yml")):
        if spec not in specs:       # a bare name is a shipped spec; a file is named by a path
            raise InputError(f"no host spec {spec!r}",
                             hint="name a YAML file (./my-host.yaml) or one of: " + ", ".join(specs))
        path = specs[spec]
    else:
        path = Path(spec)
    hs = load_spec(path)
    host_root = materialise(hs, directory, force=force)
    doc = {"schema": "vgpuhost.sim-create/v1", "name": hs.name, "root": str(host_root.root)}
    _emit(ctx, doc, f"simulated host {hs.name!r} at {host_root.root}\n"
                    f"use: vgpuhost --root {host_root.root} host check   (or export VGPUHOST_ROOT=...)")


# --- command groups in their own modules -------------------------------------

def _register() -> None:
    from .mig import mig
    from .scheduler import scheduler, vgpu_mode
    from . import hook as cli_hook, layout as cli_layout, tenant as cli_tenant, units as cli_units, virt as cli_virt
    cli.add_command(mig)
    cli.add_command(scheduler)
    vgpu.add_command(vgpu_mode)
    for module in (cli_virt, cli_hook, cli_layout, cli_units, cli_tenant):
        for command in module.COMMANDS:
            cli.add_command(command)


_register()


# --- entry point -----------------------------------------------------------

GLOBAL_OPTIONS = ("--root", "--state-dir", "--connect", "-c", "--json", "-v", "--verbose")


def _sigterm(signum, frame):
    raise KeyboardInterrupt   # unwinds through the rollback paths like Ctrl-C


def main(argv=None) -> int:
    """Console entry point: run the CLI and map errors to one line + exit code."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)
    try:
        cli.main(args=argv, prog_name="vgpuhost", standalone_mode=False)
        return EXIT_OK
    except VgpuhostError as e:
        click.echo(f"vgpuhost: error: {printable(e.one_line())}", err=True)
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.Abort:
        click.echo("vgpuhost: aborted", err=True)
        return EXIT_INPUT
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "vgpuhost"
        hint = f"see '{where} --help'"
        if isinstance(e, click.NoSuchOption) and e.option_name in GLOBAL_OPTIONS:
            hint = f"{e.option_name} is a global option: put it before the command (vgpuhost {e.option_name} ...)"
        click.echo(f"vgpuhost: error: {printable(e.format_message().rstrip('.'))}; {hint}", err=True)
        return EXIT_INPUT
    except click.ClickException as e:
        click.echo(f"vgpuhost: error: {printable(e.format_message())}", err=True)
        return EXIT_INPUT
    except OSError as e:   # the environment, not a bug: a file vgpuhost cannot reach
        name = f": {printable(str(e.filename))}" if e.filename else ""
        click.echo(f"vgpuhost: error: {e.strerror or e}{name}; check the path and its permissions", err=True)
        return EXIT_INPUT
    except RecursionError:
        click.echo("vgpuhost: error: input nested too deeply", err=True)
        return EXIT_INPUT
    except KeyboardInterrupt:
        click.echo("vgpuhost: interrupted (any half-done group was rolled back)", err=True)
        return 130
    except sqlite3.Error as e:    # the state store is damaged or unreachable
        click.echo(f"vgpuhost: error: the state store is unusable ({printable(str(e))}); move state.db "
                   "aside (vgpuhost starts a new one) or restore it from a backup", err=True)
        return EXIT_INPUT
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_INPUT
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # a bug: one line, traceback with -vv
        if "-vv" in (argv or sys.argv):
            traceback.print_exc()
        click.echo(f"vgpuhost: internal error: {type(e).__name__}: {e} (rerun with -vv and report it)", err=True)
        return EXIT_INTERNAL


def printable(text: str, limit: int = 2000) -> str:
    """One line: control characters escaped (no terminal escapes from files), length capped."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return out if len(out) <= limit else out[:limit] + "..."


if __name__ == "__main__":
    sys.exit(main())
