"""The program's entry point: the ``vgpuhost`` console script and ``python -m vgpuhost``.

Owns: putting the two top layers together.  ``cli/`` and ``agent/`` sit
side by side and never import each other (tests/test_architecture.py), so
the ``vgpuhost agent`` command, which the CLI parses
(:mod:`vgpuhost.cli.agent`), starts the server this module hands it:
:func:`serve_agent`, which loads :mod:`vgpuhost.agent.server` only when the
agent starts.  Everything else about a command line is
:func:`vgpuhost.cli.entry.run`'s (the lean start of read commands
included).  Must not: hold command logic.
"""

from __future__ import annotations

from .cli.entry import run as run_cli

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (a read command's lean start imports no typing)
    from typing import List, Optional

    from .io.hostroot import HostRoot


def serve_agent(host: HostRoot, **options) -> int:
    """Run the agent (:func:`vgpuhost.agent.server.serve`, the same keyword options) until SIGTERM; 0.
    Beside it, the GPU health watch (:class:`vgpuhost.agent.watch.HealthWatch`).  The agent lives long: once
    it listens, its bounded writes (each release's mdev remove) go to a resident writer
    (:mod:`vgpuhost.io.residentwriter`), not a fork of the agent per write; an agent refused before it
    listens (its sockets taken) starts none, and one that stops ends its idle writers."""
    from .agent.server import serve
    from .agent.watch import HealthWatch
    from .io.residentwriter import keep_writer, let_writers_go
    told = options.get("ready")

    def ready(proc) -> None:
        keep_writer()
        if told is not None:
            told(proc)
    options["ready"] = ready
    try:
        with HealthWatch(host):
            return serve(host, **options)
    finally:
        let_writers_go()


def serve_agent_and_exit(host: HostRoot, **options) -> int:
    """:func:`serve_agent`, then, once it has returned (SIGTERM: no change running, or what ran journalled),
    the process ends at once (``os._exit(0)``, the standard streams and the log flushed first): the
    interpreter's finalization would close, one by one, the state-store connection each worker thread of
    the agent keeps (seconds under load: 64 busy workers, 66 closes, 2-4 s on a loaded 2-core machine, which
    broke the 5 s SIGTERM target), while daemon threads may still be inside SQLite's C code on them.
    Errors before serving (a bad option, a socket in use) are raised as before."""
    code = serve_agent(host, **options)
    import logging
    import os
    import sys
    logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code or 0)


def run() -> None:
    """Run the command line in ``sys.argv``; exits with its code (:func:`vgpuhost.cli.entry.run`)."""
    run_cli(serve_agent=serve_agent_and_exit)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line ``argv`` in this process (:func:`vgpuhost.cli.main.main`); its exit code."""
    from .cli.main import main as cli_main
    return cli_main(argv, serve_agent=serve_agent)


if __name__ == "__main__":
    run()
