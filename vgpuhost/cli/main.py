"""The ``vgpuhost`` command line (click).

Owns: the root group and its global options, the one registry of command
families (:data:`FAMILIES`: each module's ``COMMANDS`` is added the same
way), and mapping errors to exit codes (0 ok, 1 problems found / drift, 2
usage, input or environment error, 3 device operation failed, 4 internal
error, 130 interrupted).  Shared helpers (Context, emit, store, printable,
actor) are in :mod:`vgpuhost.cli.common`.  Must not: hold command logic.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import traceback

import click

from .. import __version__
from ..model.errors import EXIT_INPUT, EXIT_INTERRUPTED, EXIT_OK, HostEnvironmentError, VgpuhostError
from .common import EXIT_INTERNAL, Context, printable  # noqa: F401 (Context: the root group's obj, for callers)
from .lean import hoist_json, match
from .output import dumps

# --- the command families: each module's COMMANDS, registered the same way ----------

#: the command family modules (vgpuhost.cli.<name>), each with its ``COMMANDS``
FAMILIES = ("host", "passthrough", "vgpu", "mig", "scheduler", "virt", "hook", "layout", "units", "tenant", "metering",
            "billing", "reconcile", "audit", "sim", "agent", "fleet", "gpu",
            "migrate", "rebalance")

#: top-level command -> its family: a command imports only its own family's module
#: (tests/test_cli.py checks this map against every family's COMMANDS)
COMMAND_FAMILY = {
    "host": "host", "gpus": "host", "types": "host",
    "passthrough": "passthrough", "vgpu": "vgpu", "mig": "mig", "scheduler": "scheduler",
    "render": "virt", "attach": "virt", "detach": "virt", "hook": "hook",
    "plan": "layout", "apply": "layout", "assert": "layout", "config": "layout",
    "install-units": "units", "tenant": "tenant", "capacity": "tenant",
    "exporter": "metering", "usage": "metering", "advise": "metering", "top": "metering", "bill": "billing",
    "forecast": "billing",
    "reconcile": "reconcile", "audit": "audit", "sim": "sim", "agent": "agent", "fleet": "fleet",
    "gpu": "gpu", "migrate": "migrate", "rebalance": "rebalance",
}


class LazyGroup(click.Group):
    """The root group: a family's module is imported when one of its commands is looked up,
    so ``vgpuhost types`` does not load the write paths (state store, NVML, libvirt, plans)."""

    def list_commands(self, ctx: click.Context):
        return sorted(set(COMMAND_FAMILY) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str):
        if cmd_name not in self.commands and cmd_name in COMMAND_FAMILY:
            load_family(COMMAND_FAMILY[cmd_name])
        return self.commands.get(cmd_name)


#: the family whose commands come with another Debian package, and that package (debian/control)
OPTIONAL_FAMILIES = {"sim": "vgpuhost-sim"}


def _absent_family(name: str, package: str) -> click.Command:
    """A stand-in for family ``name`` whose code is not installed: every use says which package has it
    (exit 2, nothing read or changed)."""

    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                           "help_option_names": []},
                   help=f"Not installed here: comes with the {package} package.")
    def absent() -> None:
        raise HostEnvironmentError(f"'vgpuhost {name}' is not installed on this host",
                                   hint=f"install the {package} package (apt install {package})")
    return absent


class _Absent:
    """The module stand-in :func:`load_family` returns for an optional family that is not installed."""

    def __init__(self, command: click.Command):
        self.COMMANDS = (command,)


def load_family(name: str):
    """Import ``vgpuhost.cli.<name>`` and add its ``COMMANDS`` to the root group; the module.

    A family of :data:`OPTIONAL_FAMILIES` whose package is not installed (the Debian package
    ``vgpuhost`` ships without the simulator) gets one stand-in command that names the package."""
    try:
        module = importlib.import_module(f"{__package__}.{name}")
    except ModuleNotFoundError as e:
        if name not in OPTIONAL_FAMILIES or not (e.name or "").startswith(f"vgpuhost.{name}"):
            raise
        module = _Absent(_absent_family(name, OPTIONAL_FAMILIES[name]))
    for command in module.COMMANDS:
        if command.name not in cli.commands:
            cli.add_command(command)
    return module


def load_all() -> None:
    """Every family's commands on the root group (``--help``, the generated docs)."""
    for name in FAMILIES:
        load_family(name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--root", metavar="DIR", help="Host root (default $VGPUHOST_ROOT or /); a simulated host works too.")
@click.option("--state-dir", metavar="DIR", help="State directory (default <root>/var/lib/vgpuhost).")
@click.option("--connect", "-c", "connect", metavar="URI", help="libvirt URI (attach/detach).")
@click.option("--json", "json_out", is_flag=True, help="Machine-readable output (documented, stable).")
@click.option("-v", "--verbose", count=True, help="More logging; -vv shows tracebacks.")
@click.option("--local", is_flag=True,
              help="Make changes in this process even when the agent's admin socket answers (write commands "
                   "go through the agent by default when it is up; VGPUHOST_AGENT=off does the same).")
@click.version_option(__version__, prog_name="vgpuhost")
@click.pass_context
def cli(ctx: click.Context, root, state_dir, connect, json_out, verbose, local) -> None:
    """Share NVIDIA GPUs between libvirt/KVM VMs: passthrough, vGPU, MIG."""
    # the read commands of the host family (nothing on their path logs) without -v never load logging
    if verbose or "logging" in sys.modules or COMMAND_FAMILY.get(ctx.invoked_subcommand or "") != "host":
        logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), format="vgpuhost: %(message)s")
    ctx.obj = Context(root, state_dir, connect, json_out, verbose, local, serve_agent=ctx.obj)


# --- entry point -----------------------------------------------------------

GLOBAL_OPTIONS = ("--root", "--state-dir", "--connect", "-c", "--json", "-v", "--verbose", "--local")


def _sigterm(signum, frame):
    raise KeyboardInterrupt   # unwinds through the rollback paths like Ctrl-C


def _json_mode(argv) -> bool:
    """Whether ``--json`` is among the global options (before the command) of ``argv``."""
    args = list(sys.argv[1:] if argv is None else argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--json":
            return True
        if a in ("--root", "--state-dir", "--connect", "-c"):
            i += 2
            continue
        if not a.startswith("-"):
            return False
        i += 1
    return False


def _error(argv, code: int, what: str, hint, kind: str, *, prefix: str = "vgpuhost: error: ",
           hint_in_parens: bool = False) -> int:
    """Report an error: one line on stderr, and under ``--json`` also the document
    ``vgpuhost.error/v1`` on stdout (``error``, ``hint``, ``exit_code``, ``type``). Returns ``code``."""
    if hint and hint_in_parens:
        line = f"{what} ({hint})"
    else:
        line = f"{what}; {hint}" if hint else what
    click.echo(f"{prefix}{printable(line)}", err=True)
    if _json_mode(argv):
        try:
            click.echo(dumps({"schema": "vgpuhost.error/v1", "error": printable(what),
                              "hint": printable(hint) if hint else None, "exit_code": code, "type": kind}))
        except OSError:
            pass
    return code


def main(argv=None, *, lean: bool = True, serve_agent=None) -> int:
    """Run the CLI and map errors to one line + exit code (:func:`report`).

    A plain read command line (:func:`vgpuhost.cli.lean.match`) runs without
    click's parsing unless ``lean`` is False; the console entry point is
    :func:`vgpuhost.__main__.run`, which also starts without loading click.
    ``serve_agent``: what ``vgpuhost agent`` starts, ``(host, **options)``
    (:func:`vgpuhost.__main__.serve_agent`; cli never imports the agent);
    None: that command refuses to run.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)
    argv = hoist_json(list(sys.argv[1:]) if argv is None else argv)
    try:
        job = None
        if lean:
            job = match(list(argv))
        if job is not None:
            click.echo(job())
        else:
            if "_VGPUHOST_COMPLETE" in os.environ:      # the shell asks for completions (cli/complete.py)
                load_all()
                importlib.import_module(f"{__package__}.complete").attach(cli)
            cli.main(args=argv, prog_name="vgpuhost", standalone_mode=False, obj=serve_agent)
        return EXIT_OK
    except BaseException as e:
        return report(argv, e)


def report(argv, exc: BaseException) -> int:
    """Report ``exc``, raised by the command line ``argv``: one line on stderr (and the error
    document under ``--json``); the exit code.  Re-raises what is not vgpuhost's to report."""
    try:
        raise exc
    except VgpuhostError as e:
        return _error(argv, e.exit_code, e.message, e.hint, type(e).__name__)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.Abort as e:
        # click turns KeyboardInterrupt (Ctrl-C, and SIGTERM through _sigterm) into Abort
        if isinstance(e.__context__, KeyboardInterrupt) or isinstance(e.__cause__, KeyboardInterrupt):
            return _error(argv, EXIT_INTERRUPTED, "interrupted (any half-done group was rolled back)", None,
                          "KeyboardInterrupt", prefix="vgpuhost: ")
        return _error(argv, EXIT_INPUT, "aborted", None, "Abort", prefix="vgpuhost: ")
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "vgpuhost"
        hint = f"see '{where} --help'"
        if isinstance(e, click.NoSuchOption) and e.option_name in GLOBAL_OPTIONS:
            hint = f"{e.option_name} is a global option: put it before the command (vgpuhost {e.option_name} ...)"
        # click lays some messages out over lines ("Choose from:\n\tbest-effort,\n\t..."): one line here
        return _error(argv, EXIT_INPUT, " ".join(e.format_message().split()).rstrip('.'), hint, "UsageError")
    except click.ClickException as e:
        return _error(argv, EXIT_INPUT, e.format_message(), None, "UsageError")
    except OSError as e:   # the environment, not a bug: a file vgpuhost cannot reach
        name = f": {str(e.filename)}" if e.filename else ""
        return _error(argv, EXIT_INPUT, f"{e.strerror or e}{name}", "check the path and its permissions", "OSError")
    except RecursionError:
        return _error(argv, EXIT_INPUT, "input nested too deeply", None, "RecursionError")
    except KeyboardInterrupt:
        return _error(argv, EXIT_INTERRUPTED, "interrupted (any half-done group was rolled back)", None,
                      "KeyboardInterrupt", prefix="vgpuhost: ")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_INPUT
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # a bug: one line, traceback with -vv
        state = sys.modules.get("vgpuhost.io.state")     # only a command that loaded the store can fail in it
        if state is not None and isinstance(e, state.StoreError):   # the state store is damaged or unreachable
            err = state.store_error('state.db', e)
            return _error(argv, EXIT_INPUT, err.message, err.hint, "StoreError")
        if "-vv" in (argv or sys.argv):
            traceback.print_exc()
        return _error(argv, EXIT_INTERNAL, f"{type(e).__name__}: {e}", "rerun with -vv and report it", "InternalError",
                      prefix="vgpuhost: internal error: ", hint_in_parens=True)


if __name__ == "__main__":
    sys.exit(main())
