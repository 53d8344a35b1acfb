"""systemd units of vgpuhost (the boot units, the agent, the exporter), and installing them.

Owns: the unit templates shipped in this package directory
(``vgpuhost-layout.service``, ``vgpuhost-reconcile.service``; the agent's
``vgpuhost-agent.socket``, ``vgpuhost-agent-ro.socket`` and
``vgpuhost-agent.service``; ``vgpuhost-exporter.service``), rendering them
with the vgpuhost executable (and for the boot units the config path) filled
in, and writing them under ``<root>/etc/systemd/system`` (or another unit
directory): idempotent, audited, and saying what changed and which units to
enable.  Must not: run ``systemctl``
(daemon-reload and enable are the operator's or the Ansible role's step;
:func:`install` says which are needed), or decide what the layout is
(:mod:`vgpuhost.layout` does, through ``vgpuhost apply``).

Boot order (docs/reference/hardware.md#field-lessons, "boot order as units with retries"): both
units are ``Type=oneshot`` + ``RemainAfterExit=yes``, ordered
``After=nvidia-vgpu-mgr.service nvidia-persistenced.service
systemd-modules-load.service`` and ``Before=libvirtd.service
virtqemud.service``; reconcile runs after the layout (the layout brings
SR-IOV, MIG mode and GPU instances that recorded vGPUs need).  The vGPU
manager can come up late, so each unit retries its command
``VGPUHOST_RETRIES`` times, ``VGPUHOST_RETRY_DELAY`` seconds apart, inside
one start job.  Only the exits that can go away are retried, as each
unit lists them in ``VGPUHOST_RETRY_EXITS``: 5 (a transient condition:
the NVIDIA driver not loaded yet, a lock another operation holds) and 3 (a
device operation failed), plus 1 for reconcile (a re-creation failed).
Exit 2 is a permanent refusal (a blocked plan, no capacity, bad input) and
is not retried: it cannot clear by waiting.  A bad config file
cannot pass on a later try, so the layout unit checks it first
(``ExecStartPre=vgpuhost config check``), without retries; any other exit
(4 a bug, 126/127 no executable) stops the loop at once: every try delays
libvirtd.  ``Restart=on-failure`` is not used: for ``Type=oneshot`` it
needs systemd >= 244, and before ``RestartMode=direct`` (systemd 254; Debian
12 has 252) the first failure completes the start job, so libvirtd would
start between two tries.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..io.configfiles import exists, find_program, is_executable_file, is_file, read_config_text
from ..io.files import data_text
from ..io.hostroot import HostRoot
from ..io.process import actor as actor_name
from ..io.state import StateStore
from ..model.errors import HostEnvironmentError, InputError
from ..plan.executor import Executor
from ..plan.steps import WriteConfig

LAYOUT_UNIT = "vgpuhost-layout.service"
RECONCILE_UNIT = "vgpuhost-reconcile.service"
BOOT_UNITS = (LAYOUT_UNIT, RECONCILE_UNIT)
AGENT_SOCKET = "vgpuhost-agent.socket"
AGENT_RO_SOCKET = "vgpuhost-agent-ro.socket"
AGENT_UNIT = "vgpuhost-agent.service"
AGENT_UNITS = (AGENT_SOCKET, AGENT_RO_SOCKET, AGENT_UNIT)
EXPORTER_UNIT = "vgpuhost-exporter.service"
UNIT_NAMES = BOOT_UNITS + AGENT_UNITS + (EXPORTER_UNIT,)
WANTED_BY = "multi-user.target"
SOCKETS_WANTED_BY = "sockets.target"

#: who meters the host (one sampler per state dir, ``ops.metering.sampler_lock``): ``agent``
#: (default: the agent's sampler, /metrics on the exporter's port; the exporter unit is written
#: but not enabled) or ``exporter`` (vgpuhost-exporter.service; the agent runs with its sampler off)
METERING = ("agent", "exporter")
DEFAULT_METERING = "agent"
#: the shipped agent and exporter units name this executable; ``render`` puts ``exe`` there
SHIPPED_EXE = "/usr/bin/vgpuhost"
AGENT_METERING_ARGS = " agent --metrics-port 9842"      # as shipped: the agent meters, on the exporter's port
AGENT_NO_METERING_ARGS = " agent --metering-interval 0"

DEFAULT_CONFIG = "/etc/vgpuhost/config.yaml"
"""The config file as the booted host names it (written into the layout unit)."""

DEFAULT_RETRIES = 6
DEFAULT_RETRY_DELAY = 10      # seconds
START_TIMEOUT_SLACK = 600     # seconds on top of the retry delays: the commands themselves

SCHEMA = "vgpuhost.install-units/v1"

RETRY_EXITS = {"vgpuhost-layout.service": "3 5",      # a device operation failed; not ready yet (transient)
               "vgpuhost-reconcile.service": "1 3 5"}  # ... and a re-creation failed

# $0 names the unit in messages; "$@" is the command.  Non-numeric settings
# fall back to one try / 10 s rather than looping forever.  Only the exits in
# $VGPUHOST_RETRY_EXITS are retried (module docstring); any other failure
# ends the loop at once.
_RETRY_LOOP = (
    'n="$VGPUHOST_RETRIES"; d="$VGPUHOST_RETRY_DELAY"; e="${VGPUHOST_RETRY_EXITS:-3}"; '
    'case "$n" in ""|*[!0-9]*) n=1 ;; esac; case "$d" in ""|*[!0-9]*) d=10 ;; esac; '
    'i=1; while :; do "$@" && exit 0; rc=$?; '
    'case " $e " in *" $rc "*) ;; *) echo "$0: try $i failed (exit $rc); not retried: '
    'only exits $e are" >&2; exit "$rc" ;; esac; '
    'if [ "$i" -ge "$n" ]; then echo "$0: giving up after $i tries (last exit $rc)" >&2; exit "$rc"; fi; '
    'echo "$0: try $i of $n failed (exit $rc); next try in ${d}s" >&2; '
    'i=$((i + 1)); sleep "$d"; done'
)

_PLACEHOLDER = re.compile(r"@[A-Z_]+@")
_BARE_WORD = re.compile(r"[A-Za-z0-9_./+:,=-]+")


def _systemd_word(value: str) -> str:
    """``value`` as one word of an ``Exec*=`` line (systemd.service(5) "Command lines").

    Bare when it holds only safe characters; otherwise double-quoted with
    ``\\`` and ``"`` escaped.  ``$`` is doubled (no variable expansion) and
    ``%`` doubled (no specifier expansion) in both forms.
    """
    escaped = value.replace("$", "$$").replace("%", "%%")
    if _BARE_WORD.fullmatch(value):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _check_path(what: str, value: str, option: str) -> str:
    if not value or any(not c.isprintable() for c in value):
        raise InputError(f"{what} {value!r} is empty or holds control characters",
                         hint=f"give {option} an absolute path")
    if not value.startswith("/"):
        raise InputError(f"{what} {value!r} is not an absolute path",
                         hint=f"give {option} an absolute path, as the booted host names it")
    return value


def default_executable() -> str:
    """The absolute path of the ``vgpuhost`` command that is running now.

    The console script next to this interpreter (a venv's ``bin/vgpuhost``),
    else ``vgpuhost`` on ``PATH``.  Raises HostEnvironmentError when neither
    exists (pass ``--exe``).
    """
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.name == "vgpuhost" and is_file(argv0):
        return str(argv0.absolute())
    beside = Path(sys.executable).parent / "vgpuhost"
    if is_executable_file(beside):
        return str(beside)
    found = find_program("vgpuhost")
    if found:
        return str(Path(found).absolute())
    raise HostEnvironmentError("cannot find the vgpuhost executable to name in the units",
                               hint="pass --exe /path/to/vgpuhost")


def template_text(name: str) -> str:
    """The shipped template of unit ``name`` (with ``@PLACEHOLDERS@``)."""
    if name not in UNIT_NAMES:
        raise InputError(f"no unit {name!r}", hint="units: " + ", ".join(UNIT_NAMES))
    return data_text("units", name)


def _render_shipped(name: str, exe: str, metering: str) -> str:
    """An agent or exporter unit as shipped, with ``exe`` in its ``ExecStart=`` (and, for the
    agent with ``metering`` ``exporter``, its sampler turned off)."""
    if metering not in METERING:
        raise InputError(f"unknown metering {metering!r}", hint="give " + " or ".join(METERING))
    text = template_text(name)
    if name.endswith(".socket"):            # no command: as shipped
        return text
    start = re.compile(r"^ExecStart=" + re.escape(SHIPPED_EXE) + r"(?= )", re.M)
    assert len(start.findall(text)) == 1, f"{name}: no ExecStart={SHIPPED_EXE} to fill in"
    text = start.sub(lambda m: "ExecStart=" + _systemd_word(exe), text)
    if name == AGENT_UNIT and metering == "exporter":
        line = re.compile(re.escape(AGENT_METERING_ARGS) + "$", re.M)
        assert line.search(text), f"{name}: no '{AGENT_METERING_ARGS.strip()}' to change"
        text = line.sub(AGENT_NO_METERING_ARGS, text)
    return text


def render(name: str, *, exe: str, config: str = DEFAULT_CONFIG, layout: Optional[str] = None,
           retries: int = DEFAULT_RETRIES, retry_delay: int = DEFAULT_RETRY_DELAY,
           metering: str = DEFAULT_METERING) -> str:
    """The text of unit ``name`` for this host.

    ``exe``: absolute path of the vgpuhost command; ``config``: absolute path
    of the layout config file; ``layout``: a layout name (None: the config's
    default); ``retries`` >= 1 tries; ``retry_delay`` seconds between tries
    (those three: the boot units only); ``metering``: who meters the host
    (:data:`METERING`; the agent unit only).  Raises InputError on a relative
    path, a control character, or a bad layout name, count or metering.
    """
    _check_path("vgpuhost executable", exe, "--exe")
    if name not in BOOT_UNITS:
        template_text(name)                 # an unknown name: InputError
        return _render_shipped(name, exe, metering)
    _check_path("config file", config, "--config")
    if layout is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", layout):
        raise InputError(f"layout name {layout!r} is not a plain name",
                         hint="use letters, digits, '_', '.', '-' (at most 64)")
    if not 1 <= retries <= 1000:
        raise InputError(f"--retries {retries} is out of range", hint="give 1..1000 tries")
    if not 0 <= retry_delay <= 3600:
        raise InputError(f"--retry-delay {retry_delay} is out of range", hint="give 0..3600 seconds")
    values = {
        "@VGPUHOST@": _systemd_word(exe),
        "@CONFIG@": _systemd_word(config),
        "@CONFIG_PATH@": config.replace("%", "%%"),
        "@LAYOUT@": f" {_systemd_word(layout)}" if layout else "",
        "@RETRIES@": str(retries),
        "@RETRY_DELAY@": str(retry_delay),
        "@RETRY_EXITS@": RETRY_EXITS[name],
        "@TIMEOUT@": str(retries * retry_delay + START_TIMEOUT_SLACK),
        "@RETRY_LOOP@": "'" + _RETRY_LOOP.replace("$", "$$") + "'",
    }
    text = _PLACEHOLDER.sub(lambda m: values[m.group(0)], template_text(name))
    assert not _PLACEHOLDER.search(text), f"unfilled placeholder in {name}"
    return text


@dataclass
class UnitChange:
    """One unit file: ``action`` is ``create``, ``update`` or ``unchanged``."""

    name: str
    path: str
    action: str
    enabled: bool
    enable: bool = True         # should be enabled (the exporter only when it meters)

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "path": self.path, "action": self.action,
                "changed": self.action != "unchanged", "enabled": self.enabled, "enable": self.enable}


@dataclass
class InstallOutcome:
    """What :func:`install` did (or, with ``dry_run``, would do)."""

    unit_dir: str
    units: List[UnitChange]
    dry_run: bool
    next_steps: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(u.action != "unchanged" for u in self.units)

    def as_dict(self) -> Dict[str, Any]:
        return {"schema": SCHEMA, "unit_dir": self.unit_dir, "changed": self.changed, "dry_run": self.dry_run,
                "units": [u.as_dict() for u in self.units], "next": self.next_steps,
                "warnings": self.warnings}

    def text(self) -> str:
        verb = {"create": "would create" if self.dry_run else "created",
                "update": "would update" if self.dry_run else "updated",
                "unchanged": "unchanged"}
        lines = [f"{u.path}: {verb[u.action]}" for u in self.units]
        lines += [f"warning: {w}" for w in self.warnings]
        if self.next_steps:
            lines.append("next (vgpuhost does not run systemctl):")
            lines += [f"  {s}" for s in self.next_steps]
        else:
            lines.append("units are installed, up to date and enabled")
        return "\n".join(lines)


def unit_dir_of(host: HostRoot) -> Path:
    """``<root>/etc/systemd/system``: where local units go."""
    return host.etc("systemd", "system")


def _executable_here(host: HostRoot, exe: str) -> bool:
    """Is ``exe`` an executable file on this machine, as given or under the host root?"""
    return any(is_executable_file(p) for p in (Path(exe), host.root / exe.lstrip("/")))


def _enabled(unit_dir: Path, name: str) -> bool:
    """Is ``name`` enabled, as ``systemctl enable`` leaves it (a link in ``multi-user.target.wants``,
    or ``sockets.target.wants`` for a socket)?"""
    target = SOCKETS_WANTED_BY if name.endswith(".socket") else WANTED_BY
    return exists(unit_dir / f"{target}.wants" / name)


def _group_known(host: HostRoot, group: str) -> bool:
    """Does ``<root>/etc/group`` name ``group``?"""
    text = read_config_text(host.etc("group")) or ""
    return any(line.split(":", 1)[0] == group for line in text.splitlines())


def unit_names(*, agent: bool = True) -> Tuple[str, ...]:
    """The units :func:`install` writes: the boot units, the agent's three with ``agent``, the exporter."""
    return BOOT_UNITS + (AGENT_UNITS if agent else ()) + (EXPORTER_UNIT,)


def wanted(*, agent: bool = True, metering: str = DEFAULT_METERING) -> Tuple[str, ...]:
    """The units to enable: the boot units; the agent's with ``agent``; the exporter when it meters."""
    return BOOT_UNITS + (AGENT_UNITS if agent else ()) + ((EXPORTER_UNIT,) if metering == "exporter" else ())


def install(host: HostRoot, *, unit_dir: "Optional[Path | str]" = None, exe: Optional[str] = None,
            config: str = DEFAULT_CONFIG, layout: Optional[str] = None, retries: int = DEFAULT_RETRIES,
            retry_delay: int = DEFAULT_RETRY_DELAY, dry_run: bool = False,
            actor: Optional[str] = None, agent: bool = True,
            metering: Optional[str] = None) -> InstallOutcome:
    """Write the units (:func:`unit_names`) to ``unit_dir`` (default ``<root>/etc/systemd/system``).

    ``agent``: also the agent's socket-activated units.  ``metering``: who
    meters the host (:data:`METERING`; default ``agent`` with the agent,
    ``exporter`` without it); the exporter unit is always written, and
    enabled only when it meters.  An enabled exporter while the agent meters
    gets a ``systemctl disable --now`` step; a missing agent group (in
    ``<root>/etc/group``) a ``groupadd --system`` step.

    A unit whose file already holds the same text is not rewritten.  Each
    write is audited in the state store (created only when something is
    written).  ``dry_run`` writes nothing and creates no store.  Returns the
    outcome with the systemctl commands still needed: ``daemon-reload`` when
    a file changed, ``enable`` for units without their ``.wants`` link.
    ``unit_dir`` must be absolute.  An ``exe`` that is not an executable
    file here (as given, or under the host root) is still written, with a
    warning in the outcome.  Raises InputError (bad path or value: nothing
    is written), HostEnvironmentError (unreadable file), SysfsError (a
    write failed; exit 3).
    """
    if metering is None:
        metering = DEFAULT_METERING if agent else "exporter"
    if metering not in METERING:
        raise InputError(f"unknown metering {metering!r}", hint="give " + " or ".join(METERING))
    if metering == "agent" and not agent:
        raise InputError("--metering agent needs the agent's units", hint="drop --no-agent, or give --metering exporter")
    exe = exe or default_executable()
    texts = {name: render(name, exe=exe, config=config, layout=layout, retries=retries,
                          retry_delay=retry_delay, metering=metering) for name in unit_names(agent=agent)}
    if unit_dir is not None:
        # systemd reads units from absolute directories; a relative one would land under the cwd
        target = Path(_check_path("unit directory", str(unit_dir), "--unit-dir"))
    else:
        target = unit_dir_of(host)
    target = target.absolute()
    warnings = []
    if not _executable_here(host, exe):
        warnings.append(f"{exe} is not an executable file on this host: the units would fail at boot "
                        "(exit 127) until it is there; pass --exe with the vgpuhost the booted host runs")
    changes: List[UnitChange] = []
    writes = []
    for name, text in texts.items():
        path = target / name
        old = read_config_text(path)
        action = "create" if old is None else ("unchanged" if old == text else "update")
        if action != "unchanged":
            writes.append(WriteConfig(path, text))
        changes.append(UnitChange(name, host.relative(path), action, _enabled(target, name),
                                  name in wanted(agent=agent, metering=metering)))
    if writes and not dry_run:
        # the store is created only when something is written; a failed write undoes the units written before it
        Executor(host, StateStore(host.state_dir), operation="install-units",
                 actor=actor or actor_name()).run(writes)
    steps = []
    for name in (AGENT_SOCKET, AGENT_RO_SOCKET) if agent else ():
        group = re.search(r"^SocketGroup=(\S+)$", texts[name], re.M)
        if group and not _group_known(host, group.group(1)):
            steps.append(f"groupadd --system {group.group(1)}")
    if any(c.action != "unchanged" for c in changes):
        steps.append("systemctl daemon-reload")
    not_enabled = [c.name for c in changes if c.enable and not c.enabled]
    if not_enabled:
        steps.append("systemctl enable " + " ".join(not_enabled))
    if metering == "agent" and _enabled(target, EXPORTER_UNIT):
        steps.append(f"systemctl disable --now {EXPORTER_UNIT}")
    return InstallOutcome(unit_dir=host.relative(target), units=changes, dry_run=dry_run, next_steps=steps,
                          warnings=warnings)


__all__ = ["UNIT_NAMES", "BOOT_UNITS", "AGENT_UNITS", "LAYOUT_UNIT", "RECONCILE_UNIT", "AGENT_UNIT", "AGENT_SOCKET",
           "AGENT_RO_SOCKET", "EXPORTER_UNIT", "METERING", "DEFAULT_CONFIG", "render", "install", "unit_names",
           "wanted", "InstallOutcome", "UnitChange", "default_executable", "template_text", "unit_dir_of"]
