#!/usr/bin/env python3
"""Generate the files a system package of vgpuhost owns, for the paths a package uses.

    python3 tools/packagefiles.py DESTDIR [--site DIR] [--python EXE]

writes under DESTDIR (debian/rules passes the package's staging directory):

- ``lib/systemd/system/vgpuhost-layout.service``, ``vgpuhost-reconcile.service``:
  the boot units for ``/usr/bin/vgpuhost`` and ``/etc/vgpuhost/config.yaml``;
  ``vgpuhost-agent.socket``, ``vgpuhost-agent-ro.socket``, ``vgpuhost-agent.service``
  (the agent meters) and ``vgpuhost-exporter.service``
  (``vgpuhost.ops.units.render``, the text ``install-units`` writes);
- ``usr/lib/vgpuhost/qemu-hook``: libvirt's qemu hook for the host root ``/``,
  running ``--python`` (default ``/usr/bin/python3``) with the package at
  ``--site`` (default ``/usr/lib/python3/dist-packages``), the text ``hook
  install`` writes, so ``hook status`` calls it current. The package does not
  link it into ``/etc/libvirt/hooks/qemu.d``: ``vgpuhost hook install`` does,
  when the operator chooses to;
- ``usr/share/man/man8/vgpuhost.8`` and the bash, zsh and fish completions
  (``tools/clidoc.py``).

vgpuhost is imported from ``sys.path`` (debian/rules points PYTHONPATH at the
staged package); the staged location is rewritten to ``--site`` in the hook.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("destdir", type=Path)
    ap.add_argument("--site", default="/usr/lib/python3/dist-packages")
    ap.add_argument("--python", default="/usr/bin/python3")
    args = ap.parse_args(argv)
    dest = args.destdir

    import importlib
    import vgpuhost
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.ops import units

    def write(rel: str, text: str, mode: int = 0o644) -> None:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
        print(path)

    for name in units.UNIT_NAMES:
        write(f"lib/systemd/system/{name}", units.render(name, exe="/usr/bin/vgpuhost"))

    staged = str(Path(vgpuhost.__file__).resolve().parent.parent)
    hook_install = importlib.import_module("vgpuhost.hook.install")     # what `vgpuhost hook install` writes
    hook = hook_install.render(HostRoot.from_env("/", None), python=args.python)
    if staged != args.site:
        hook = hook.replace(repr(staged)[1:-1], args.site)
    assert "/debian/" not in hook and str(HERE.parent) not in hook, "the build tree leaked into the hook"
    write("usr/lib/vgpuhost/qemu-hook", hook, 0o755)

    spec = importlib.util.spec_from_file_location("clidoc", HERE / "clidoc.py")
    clidoc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(clidoc)
    write("usr/share/man/man8/vgpuhost.8", clidoc.man(vgpuhost.__version__))
    for shell, rel in (("bash", "usr/share/bash-completion/completions/vgpuhost"),
                       ("zsh", "usr/share/zsh/vendor-completions/_vgpuhost"),
                       ("fish", "usr/share/fish/vendor_completions.d/vgpuhost.fish")):
        write(rel, clidoc.completion(shell))
    return 0


if __name__ == "__main__":
    sys.exit(main())
