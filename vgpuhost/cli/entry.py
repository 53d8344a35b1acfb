"""The command line's start (for :mod:`vgpuhost.__main__`, the program's entry point): a lean start for read commands.

Owns: :func:`run`.  A plain read command line (:func:`vgpuhost.cli.lean.match`)
runs without loading click or the write paths, and the process ends with
``os._exit`` once its output is flushed: nothing is left to tear down for a
command that only read (the inventory's objects are not freed one by one).
Every other command line goes to :func:`vgpuhost.cli.main.main` and exits
normally.  Errors of either path are reported by
:func:`vgpuhost.cli.main.report`.  Must not: import click at module level.
"""

from __future__ import annotations

import os
import sys

from .lean import hoist_json, match


def _sigterm(signum, frame):
    raise KeyboardInterrupt   # unwinds like Ctrl-C (vgpuhost.cli.main does the same)


def run(*, serve_agent=None) -> None:
    """Run the command line in ``sys.argv``; exits with its code (0 ok, ... as documented).

    ``serve_agent``: what ``vgpuhost agent`` starts (see :func:`vgpuhost.cli.main.main`).
    """
    import _signal as signal    # the C module: ``signal`` wraps it in enums (enum, functools, collections)
    signal.signal(signal.SIGTERM, _sigterm)     # from here on a SIGTERM exits 130, as documented, not 143
    argv = hoist_json(sys.argv[1:])
    try:
        job = match(argv)
        if job is None:
            from .main import main
    except KeyboardInterrupt:       # while the command loads: nothing has run yet
        sys.stderr.write("vgpuhost: interrupted\n")
        sys.exit(130)
    if job is None:
        sys.exit(main(argv, serve_agent=serve_agent))
    # a read command's process ends below with os._exit: the cyclic collector would only walk, again and
    # again, the tens of thousands of rows and document dicts a `types` of a large host makes (none
    # cyclic) without freeing them; off, 2 to 4 ms less CPU on the 8 x 32 VF trees of bench/inventory.py
    import gc
    gc.disable()
    try:
        text = job()
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        code = 0
    except BaseException as e:     # reported exactly as the click path reports it
        from .main import report
        code = report(argv, e)
        try:
            sys.stdout.flush()
        except OSError:
            pass
    try:
        sys.stderr.flush()
    finally:
        os._exit(code)
