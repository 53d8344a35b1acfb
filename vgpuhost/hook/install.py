"""Installing libvirt's qemu hook: ``vgpuhost hook install|uninstall|status``.

Owns: rendering the dispatcher (the ``hook/qemu.sh`` template with the
interpreter, ``sys.path``, host root, state dir and timeout baked in),
writing it atomically as ``<hooks dir>/vgpuhost`` (only over a file it
wrote: the marker line), removing it, and reporting whether it is installed
and current and what the allow-list allows.  Files are read and written
through :mod:`vgpuhost.io.files`; the allow-list through
:mod:`vgpuhost.ops.devices`.
Must not: signal or call libvirtd (the outcome says when it must be reloaded).
"""

from __future__ import annotations

import errno as _errno
import os
import shlex
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List, Optional

from .. import __version__
from ..io import files
from ..io.agentclient import default_socket
from ..io.hostroot import HostRoot
from ..io.modbundle import build, bundle_path, check, linked_folder
from ..io.process import actor as actor_name, run_program
from ..io.state import StateStore
from ..io.sysfs import Sysfs
from ..io.vgpudev import CREATABLE_ATTR, CURRENT_TYPE_ATTR, SUPPORTED_TYPES_DIR
from ..model.errors import HostEnvironmentError, InputError, RefusedError, VgpuhostError
from ..observe.inventory import discover
from ..ops.devices import allow_path, load_allow
from .runtime import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S

HOOK_NAME = "vgpuhost"                        # the file in qemu.d
#: the sh dispatcher's template, beside this module (``vgpuhost/hook/qemu.sh``)
DISPATCHER = "qemu.sh"
#: where the dispatcher looks for curl, its thin client to the agent (no fork: ``[ -x ]`` in sh)
CURL_DIRS = ("/usr/bin", "/bin", "/usr/local/bin")
MARKER = "# vgpuhost-hook: written by 'vgpuhost hook install'"
#: the compiled thin client (vgpuhost/hook/client.c; ``make dev`` and the Debian package build it)
CLIENT_NAME = "vgpuhost-hook-client"
#: where a system package installs it; :func:`find_client` looks next to the package first
CLIENT_SYSTEM_DIR = "/usr/lib/vgpuhost"


def _template() -> str:
    return files.package_text("hook", DISPATCHER)


def _sh_quote(text: str) -> str:
    if "\0" in text or "\n" in text:
        raise InputError(f"{text[:80]!r} cannot be written into the hook (newline or NUL)")
    return "'" + text.replace("'", "'\\''") + "'"


def client_candidates(client: "Optional[str]" = None) -> List[str]:
    """Where the dispatcher looks for the compiled thin client, in order, each time it runs.

    ``client`` None: ``vgpuhost-hook-client`` next to the package (``make
    dev`` builds it there), then ``/usr/lib/vgpuhost/vgpuhost-hook-client``
    (the Debian package ``vgpuhost-hook-client``), so the hook's text does
    not depend on whether it is built; "" or ``none``: nowhere (curl); any
    other value: that one path, which must be absolute and an executable file
    (InputError otherwise).
    """
    if client is None:
        return [os.path.join(files.package_parent(), "vgpuhost", "hook", CLIENT_NAME),
                os.path.join(CLIENT_SYSTEM_DIR, CLIENT_NAME)]
    if client in ("", "none"):
        return []
    if not os.path.isabs(client) or not client.isprintable():
        raise InputError(f"--client {client[:200]!r} is not an absolute path",
                         hint=f"give the path of {CLIENT_NAME} (make dev builds it), or 'none' for curl")
    if not files.is_executable_file(client):
        raise InputError(f"--client {client[:200]} is not an executable file",
                         hint=f"build it ('make client', or gcc -O2 -o {CLIENT_NAME} vgpuhost/hook/client.c), "
                              "or give 'none' for curl")
    if not _answers_as_client(client):
        raise InputError(f"--client {client[:200]} does not answer '--version' as {CLIENT_NAME} does",
                         hint=f"give the path of vgpuhost's {CLIENT_NAME} (make dev builds it), or 'none' for curl")
    return [client]


#: what ``vgpuhost-hook-client --version`` prints (vgpuhost/hook/client.c)
CLIENT_VERSION = b"vgpuhost-hook-client 1\n"


def _answers_as_client(path: str) -> bool:
    """Whether ``path --version`` prints :data:`CLIENT_VERSION` and exits 0 within 10 s: a program
    that is not the client (``/bin/true``) would otherwise answer every start with 'done'."""
    try:
        proc = run_program([path, "--version"], timeout=10)
    except Exception:
        return False
    return proc.returncode == 0 and proc.stdout == CLIENT_VERSION


def find_client() -> Optional[str]:
    """The client the dispatcher would use now (the first executable :func:`client_candidates`), or None."""
    return next((c for c in client_candidates() if files.is_executable_file(c)), None)


def render(host: HostRoot, *, python: Optional[str] = None, timeout_s: int = DEFAULT_TIMEOUT_S,
           curl: bool = True, client: Optional[str] = None) -> str:
    """The dispatcher's text for ``host``: the template with the interpreter, sys.path, root and state dir.

    libvirt gives hooks a minimal environment (``PATH``, ``HOME``,
    ``LC_ALL=C``, docs/reference/libvirt.md), so all of it is baked in.  Python runs
    with ``-I -S`` (no site: no ``.pth`` processing, no user site) and an
    explicit ``sys.path``: the directory holding the ``vgpuhost`` package
    first, this interpreter's site-packages last.  ``curl``: the thin client
    that hands the call to the agent without starting Python, looked for in
    :data:`CURL_DIRS` each time the hook runs (so the text does not depend on
    whether curl is installed); False: none, and no compiled client unless
    ``client`` names one: the handler talks to the agent itself.
    ``client``: where the compiled thin client is looked for
    (:func:`client_candidates`), tried before curl: the dispatcher uses the
    first that is executable when it runs, and curl when none is.
    """
    if not 1 <= timeout_s <= MAX_TIMEOUT_S:
        raise InputError(f"--timeout {timeout_s} is out of range", hint=f"1..{MAX_TIMEOUT_S} seconds")
    clients = client_candidates(client if curl or client is not None else "none")
    exe = python or sys.executable
    if not exe or not os.path.isabs(exe):
        raise InputError("cannot tell which Python runs vgpuhost (sys.executable is empty)",
                         hint="run 'vgpuhost hook install' with the interpreter vgpuhost is installed in")
    pkg_parent = files.package_parent()
    paths = [pkg_parent]
    purelib = sysconfig.get_paths().get("purelib")
    extra = [purelib] if purelib and purelib != pkg_parent else []
    # gc.disable(): the handler is a process of tens of milliseconds that ends with os._exit, and its
    # imports alone ran 17 cyclic collections (measured 2026-12-01, a vGPU's prepare begin: 1.7 ms of
    # CPU of 23 ms for its imports); reference counting still frees everything not in a cycle
    # then the module bundle hook install writes (io/modbundle.py: one file instead of ~40 module lookups)
    boot = (f"import gc;gc.disable();import sys;sys.path[:0]={paths!r};sys.path.extend({extra!r});"
            f"from vgpuhost.io.modbundle import use;use({bundle_path(str(host.root))!r});"
            "from vgpuhost.hook.runtime import run;run()")
    values = {
        "@VERSION@": __version__,
        "@MARKER@": MARKER,
        "@ROOT@": _sh_quote(str(host.root)),
        "@STATE_DIR@": _sh_quote(str(host.state_dir)),
        "@TIMEOUT_S@": str(int(timeout_s)),
        "@PYTHON@": _sh_quote(exe),
        "@BOOT@": _sh_quote(boot),
        "@CURL_DIRS@": " ".join(CURL_DIRS) if curl else "",
        "@CLIENTS@": " ".join(_sh_quote(c) for c in clients),
        "@AGENT_SOCKET@": _sh_quote(default_socket(str(host.root))),
    }
    text = _template()
    for key, value in values.items():
        text = text.replace(key, value)
    return text


class HookOutcome:
    """What install/uninstall did (``as_dict``: the ``vgpuhost.hook/v1`` document)."""

    def __init__(self, action: str, path: str, *, changed: bool, dry_run: bool, new: bool = False):
        self.action, self.path, self.changed, self.dry_run, self.new = action, path, changed, dry_run, new
        self.reload_needed = False
        self.compiled = False
        self.notes: List[str] = []

    def as_dict(self) -> dict:
        return {"schema": "vgpuhost.hook/v1", "action": self.action, "path": self.path, "changed": self.changed,
                "dry_run": self.dry_run, "new": self.new, "reload_needed": self.reload_needed,
                "compiled": self.compiled, "notes": self.notes}


def default_hooks_dir(host: HostRoot):
    """``<root>/etc/libvirt/hooks/qemu.d``: libvirt (>= 6.5) runs every executable there."""
    return host.libvirt_hooks / "qemu.d"


def _read(path) -> Optional[str]:
    return files.read_text_capped(path, 1 << 20)


def _ours(text: Optional[str]) -> bool:
    return text is not None and any(line.startswith(MARKER) for line in text.splitlines()[:4])


RELOAD_HINT = ("reload libvirtd so it runs the new hook ('systemctl reload libvirtd', or kill -HUP "
               "$(pidof libvirtd)): libvirtd reads the hooks present when it starts or gets SIGHUP")


def install(host: HostRoot, *, hooks_dir=None, dry_run: bool = False, timeout_s: int = DEFAULT_TIMEOUT_S,
            python: Optional[str] = None, store: "Optional[StateStore]" = None, actor: Optional[str] = None,
            curl: bool = True, client: Optional[str] = None) -> HookOutcome:
    """Write the dispatcher as ``<hooks_dir>/vgpuhost`` (mode 0755, atomically), byte-compile the package.

    Idempotent: an identical file is left alone.  Refuses (RefusedError) to
    overwrite a ``vgpuhost`` file it did not write, and when the module bundle's
    folder (``<root>/var/cache/vgpuhost``) is a symbolic link (it would write
    the bundle into, and chmod, what the link points at): nothing is changed.  Never signals libvirtd:
    the outcome says when it must be reloaded (a new file).  The write is
    audited when ``store`` is given.  ``curl``, ``client``: the agent's thin clients (see :func:`render`).
    """
    d = Path(hooks_dir) if hooks_dir is not None else default_hooks_dir(host)
    path = d / HOOK_NAME
    text = render(host, python=python, timeout_s=timeout_s, curl=curl, client=client)
    old = _read(path)
    if old is not None and not _ours(old):
        raise RefusedError(f"{path} exists and was not written by vgpuhost: left alone",
                           hint="move it aside, then run 'vgpuhost hook install' again")
    linked = linked_folder(bundle_path(str(host.root)))
    if linked:
        if store is not None:
            store.audit(actor=actor or actor_name(), operation="hook install", path=host.relative(linked),
                        value="<refused: the module bundle's folder is a symbolic link>", result="refused")
        raise RefusedError(f"{linked}, the folder of the hook's module bundle, is a symbolic link: hook install "
                           "does not write the bundle into (nor change the mode of) what it points at; nothing "
                           "was changed", hint=f"remove the link (rm {shlex.quote(linked)}), then run 'vgpuhost hook install' "
                                "again")
    lost_mode = old == text and not files.is_executable_file(path)   # libvirt skips a hook it cannot execute
    out = HookOutcome("install", str(path), changed=old != text or lost_mode, dry_run=dry_run, new=old is None)
    out.reload_needed = old is None
    if lost_mode:
        out.notes.append("the installed hook was not executable (libvirt skips it): written again with mode 0755")
    if not out.changed:
        out.notes.append("the installed hook is up to date: nothing to do")
    if dry_run:
        return out
    if out.changed:
        _write_atomic(path, text, store=store, actor=actor, host=host)
    out.compiled = files.compile_package() and _bundle(host, out)
    if out.reload_needed:
        out.notes.append(RELOAD_HINT)
    return out


def _bundle(host: HostRoot, out: HookOutcome) -> bool:
    """Write the handler's module bundle (:mod:`vgpuhost.io.modbundle`); False, with a note, when it cannot."""
    path = bundle_path(str(host.root))
    try:
        build(path)
    except (OSError, SyntaxError) as e:
        try:
            files.remove(path)              # an older bundle never stands in for this installation's
        except OSError:
            pass
        out.notes.append(f"could not write the hook's module bundle {path} "
                         f"({getattr(e, 'strerror', None) or e}): the hook loads its modules one by one")
        return False
    return True


def _write_atomic(path, text: str, *, store, actor: Optional[str], host: HostRoot) -> None:
    err = 0
    try:
        files.write_atomic(path, text, 0o755)
    except OSError as e:
        err = e.errno or _errno.EIO
        raise HostEnvironmentError(f"cannot write {path}: {e.strerror}",
                                   hint="run as root, or pass --hooks-dir DIR") from None
    finally:
        if store is not None:
            store.audit(actor=actor or actor_name(), operation="hook install", path=host.relative(path),
                        value="<vgpuhost qemu hook>", err=err)


def uninstall(host: HostRoot, *, hooks_dir=None, dry_run: bool = False, store: "Optional[StateStore]" = None,
              actor: Optional[str] = None) -> HookOutcome:
    """Remove ``<hooks_dir>/vgpuhost`` when vgpuhost wrote it (marker line); absent is a no-op.

    Raises RefusedError for a file vgpuhost did not write.
    """
    d = Path(hooks_dir) if hooks_dir is not None else default_hooks_dir(host)
    path = d / HOOK_NAME
    old = _read(path)
    if old is None:
        out = HookOutcome("uninstall", str(path), changed=False, dry_run=dry_run)
        out.notes.append("no vgpuhost hook is installed there: nothing to do")
        return out
    if not _ours(old):
        raise RefusedError(f"{path} was not written by vgpuhost: left alone",
                           hint="remove it by hand if it is yours to remove")
    out = HookOutcome("uninstall", str(path), changed=True, dry_run=dry_run)
    if dry_run:
        return out
    err = 0
    try:
        out.changed = files.remove(path)
    except OSError as e:
        err = e.errno or 5
        raise HostEnvironmentError(f"cannot remove {path}: {e.strerror}", hint="run as root") from None
    finally:
        if store is not None:
            store.audit(actor=actor or actor_name(), operation="hook uninstall", path=host.relative(path),
                        value="<remove>", err=err)
    try:
        if not linked_folder(bundle_path(str(host.root))):   # never through a symlinked folder (the hook
            files.remove(bundle_path(str(host.root)))       # ignores a bundle there): the handler's module
    except OSError:                                         # bundle, a cache of the hook's (left behind,
        pass                                                # it is never run without the hook)
    out.notes.append("domains starting from now on get no vgpuhost devices made for them")
    return out


def status(host: HostRoot, *, hooks_dir=None, timeout_s: int = DEFAULT_TIMEOUT_S,
           python: Optional[str] = None) -> dict:
    """``vgpuhost.hook-status/v1``: is the hook installed, current, where libvirt looks; the allow-list.

    ``allow.missing``: the allow-listed GPUs this host does not have (or that
    are no NVIDIA GPU here); any makes ``ok`` false.  ``bundle``: the handler's
    module bundle (:func:`vgpuhost.io.modbundle.check`: ``path``, ``state``,
    ``modules``, ``stale``, ``damaged``); a bundle that is not current only costs speed, so
    it leaves ``ok`` alone.
    """
    d = Path(hooks_dir) if hooks_dir is not None else default_hooks_dir(host)
    path = d / HOOK_NAME
    text = _read(path)
    installed = text is not None
    ours = _ours(text)
    current = bool(installed and ours and text == render(host, python=python, timeout_s=timeout_s))
    if installed and ours and not current:
        current = _same_but_timeout(text, host, python)
    executable = installed and files.is_executable(path)
    allow: Dict[str, object] = {"path": host.relative(allow_path(host))}
    try:
        entries = load_allow(host)
        allow["present"] = files.exists(allow_path(host))
        allow["gpus"] = None if entries is None else sorted(str(g) for g in entries)
        allow["error"] = None
        allow["summary"] = ("every NVIDIA GPU (no allow-list file)" if not allow["present"] else
                            "every NVIDIA GPU ('*')" if entries is None else
                            "no GPU (the file lists none)" if not entries else
                            ", ".join(allow["gpus"]))
        allow["missing"] = _missing_gpus(host, entries)
    except VgpuhostError as e:
        allow.update(present=True, gpus=[], error=e.one_line(), summary="unreadable: the hook refuses every GPU domain",
                     missing=[])
    bundle = dict(path=bundle_path(str(host.root)), **check(bundle_path(str(host.root))))
    others = other_hooks(host, d)
    return {"schema": "vgpuhost.hook-status/v1", "path": str(path), "hooks_dir": str(d),
            "hooks_dir_exists": files.is_dir(d), "installed": installed, "written_by_vgpuhost": ours,
            "current": current, "executable": executable,
            "libvirt_hooks_dir": str(d.parent), "libvirt_hooks_dir_exists": files.is_dir(d.parent),
            "allow": allow, "bundle": bundle, "other_hooks": others,
            "ok": bool(installed and ours and current and executable and not allow["error"] and not allow["missing"]
                       and not any(o["gpus"] or o["acts_on"] for o in others))}


#: what another hook's text may name that acts on GPUs: the sysfs files and tools of the device layer that
#: vgpuhost owns on the GPUs it manages (a hook that uses one can undo what vgpuhost's hook made)
GPU_ACTIONS = ("bus/mdev", SUPPORTED_TYPES_DIR, "sriov_numvfs", "sriov-manage", "driver_override",
               "driverctl", "mdevctl", "nodedev-detach", "nodedev-reattach", "nodedev-dettach", "vfio-pci",
               "drivers/nvidia", "nvidia-smi", CURRENT_TYPE_ATTR, CREATABLE_ATTR)


def other_hooks(host: HostRoot, hooks_dir) -> List[Dict[str, object]]:
    """The other qemu hooks libvirt runs, in its order: ``<hooks>/qemu`` first, then every executable in
    ``qemu.d`` by name in byte order (docs/reference/libvirt.md#hooks); vgpuhost's own is left out.

    Each: ``{"path", "order" (1-based, vgpuhost's own counted), "before_vgpuhost", "gpus" (this host's NVIDIA
    GPUs its text names: BDF, short BDF or libvirt's pci_dddd_bb_ss_f), "acts_on" (the GPU_ACTIONS terms
    its text names)}``.  Only the first MiB of each is read; nothing of its text is returned but those terms.
    """
    d = Path(hooks_dir)
    paths = [d.parent / "qemu"] + [d / n for n in files.names_in(d)]
    run = [x for x in paths if files.is_executable_file(x)]
    gpus = [g.address for g in discover(Sysfs(host), with_types=False).gpus]
    spellings = {str(g): (str(g), f"{g.bus:02x}:{g.slot:02x}.{g.function}",
                          f"pci_{g.domain:04x}_{g.bus:02x}_{g.slot:02x}_{g.function}") for g in gpus}
    mine = d / HOOK_NAME
    position = next((i for i, x in enumerate(run) if x == mine), len(run))
    out: List[Dict[str, object]] = []
    for i, x in enumerate(run):
        if x == mine:
            continue
        try:
            text = (_read(x) or "").lower()
        except OSError:
            text = ""
        out.append({"path": str(x), "order": i + 1, "before_vgpuhost": i < position,
                    "gpus": sorted(bdf for bdf, names in spellings.items() if any(n in text for n in names)),
                    "acts_on": [t for t in GPU_ACTIONS if t in text]})
    return out


def _missing_gpus(host: HostRoot, entries) -> List[str]:
    """The allow-list's GPUs that are not NVIDIA GPUs (physical functions) of this host, sorted.

    The hook refuses every domain that wants one of them, so ``hook status``
    reports them (and exits 1).  ``entries``: :func:`load_allow`'s answer.
    """
    if not entries:
        return []
    present = {g.address for g in discover(Sysfs(host)).gpus}
    return sorted(str(g) for g in entries if g not in present)


def _same_but_timeout(text: str, host: HostRoot, python: Optional[str]) -> bool:
    """An installed hook that differs only in its ``--timeout`` or ``--client`` is current too."""
    t: Optional[int] = None
    client: Optional[str] = None
    for line in text.splitlines():
        if line.startswith("VGPUHOST_HOOK_TIMEOUT=") and t is None:
            try:
                t = int(line.split("=", 1)[1].strip("'"))
            except ValueError:
                return False
        elif line.lstrip().startswith("for c in ") and line.endswith("; do") and client is None:
            value = line.lstrip()[len("for c in "):-len("; do")]
            if not value:
                client = "none"
            elif value[0] == value[-1] == "'" and "' '" not in value:
                client = value[1:-1].replace("'\\''", "'")       # one path: --client PATH
    if t is None or not 1 <= t <= MAX_TIMEOUT_S:
        return False
    try:
        return text == render(host, python=python, timeout_s=t, client=client)
    except InputError:              # the client it names is gone: installing again writes another text
        return False
