"""The ``vgpuhost`` launcher that starts the read commands lean: ``python -m vgpuhost.cli.launcher``.

Owns: :func:`launcher_text`, the text of an executable script that replaces the
``vgpuhost`` console script pip writes (``make dev`` installs it in the venv).
pip's script starts the interpreter with ``site``: every ``.pth`` file of
site-packages is processed first (an editable install's import finder, which
loads ``pathlib``, ``importlib.util`` and more: most of a start's imports).
This launcher starts with ``-S`` (no ``site``), puts the directory holding the
``vgpuhost`` package first on ``sys.path``, and then:

- for a plain read command line (:func:`vgpuhost.cli.lean.match`: ``types``,
  ``gpus``) appends the site-packages directories known when it was written,
  without processing their ``.pth`` files (what ``types`` may import from
  there: PyYAML and nvidia-ml-py, on a vendor-VFIO host);
- for every other command line runs ``site.main()``, the start pip's script
  would have had (site-packages and ``.pth`` files), before anything else loads.

Environment variables (``PYTHONPATH``...) are honoured as with pip's script
(``-S`` only, not ``-I``: the qemu hook's dispatcher isolates itself, a user's
command line does not need to).  Must not: be imported by any command (it runs at build time).
"""

from __future__ import annotations

import os
import site
import sys
from typing import List, Optional, Sequence

import vgpuhost

_TEMPLATE = '''#!{python} -S
# vgpuhost's launcher (python -m vgpuhost.cli.launcher; make dev writes it): the read commands
# start without site, every other command line gets site as pip's console script gives it.
import sys
sys.path.insert(0, {package_parent!r})
from vgpuhost.cli.lean import hoist_json, match
if match(hoist_json(sys.argv[1:])) is None:
    import site
    site.main()
else:
    sys.path.extend({site_dirs!r})
from vgpuhost.__main__ import run
sys.exit(run())
'''


def launcher_text(python: str, package_parent: str, site_dirs: Sequence[str]) -> str:
    """The launcher script for interpreter ``python`` (an absolute path), with the directory holding
    the ``vgpuhost`` package ``package_parent`` first on ``sys.path`` and ``site_dirs`` (site-packages)
    appended for the read commands.  Raises ValueError for a path that is not absolute or holds a
    character a shebang line or the script cannot carry (whitespace in ``python``, a newline)."""
    for p in [python, package_parent, *site_dirs]:
        if not os.path.isabs(p) or "\n" in p or "\r" in p:
            raise ValueError(f"not an absolute path on one line: {p!r}")
    if any(c.isspace() for c in python):
        raise ValueError(f"a shebang line cannot carry this interpreter path: {python!r}")
    return _TEMPLATE.format(python=python, package_parent=package_parent, site_dirs=list(site_dirs))


def main(argv: Optional[List[str]] = None) -> int:
    """Print the launcher for this interpreter and this package (``sys.executable``, the ``vgpuhost``
    package's parent directory, ``site.getsitepackages()``); 0."""
    parent = os.path.dirname(os.path.dirname(os.path.abspath(vgpuhost.__file__)))
    sys.stdout.write(launcher_text(sys.executable, parent, site.getsitepackages()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
