"""Shell completion of values: vGPU profiles, GPU addresses, tenants and domains of the host at hand.

Owns: :func:`attach`, which gives the options and arguments that name those things a completion
function (click's ``shell_complete`` of a parameter), by parameter name, once every command is
loaded.  Runs only when the shell asks (``_VGPUHOST_COMPLETE`` is set: click's completion
protocol); it reads the host the command line names (``--root``, ``--state-dir``, else
``$VGPUHOST_ROOT`` and ``/``) and never writes.  A completion that cannot read the host offers
nothing rather than failing the shell.  Must not: change the host, or talk to libvirt (a hung
libvirtd would hang the shell): domains are the ones the state store knows.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import click

from ..io.hostroot import HostRoot
from ..io.state import StateStore
from ..io.sysfs import Sysfs
from ..model.errors import VgpuhostError
from ..observe.inventory import discover

#: the environment variable click's completion scripts set (tools/clidoc.py writes them)
COMPLETE_VAR = "_VGPUHOST_COMPLETE"

Completer = Callable[[click.Context, click.Parameter, str], List[str]]


def _host(ctx: click.Context) -> Optional[HostRoot]:
    top = ctx.find_root().params
    try:
        return HostRoot.from_env(top.get("root"), top.get("state_dir"))
    except VgpuhostError:
        return None


def _store(ctx: click.Context) -> Optional[StateStore]:
    host = _host(ctx)
    if host is None:
        return None
    try:
        return StateStore(host.state_dir, create=False)
    except (VgpuhostError, OSError):
        return None


def _matching(words, incomplete: str) -> List[str]:
    return sorted({w for w in words if w and w.startswith(incomplete)})


def profiles(ctx: click.Context, param: click.Parameter, incomplete: str) -> List[str]:
    """vGPU type names the host's GPUs offer (``A40-8Q``), upper or lower case as typed."""
    host = _host(ctx)
    if host is None:
        return []
    try:
        inv = discover(Sysfs(host))
    except (VgpuhostError, OSError):
        return []
    names = {t.name for t in inv.vgpu_types}
    return _matching(names, incomplete) or _matching((n.lower() for n in names), incomplete)


def gpus(ctx: click.Context, param: click.Parameter, incomplete: str) -> List[str]:
    """The NVIDIA GPUs' PCI addresses (``0000:41:00.0``)."""
    host = _host(ctx)
    if host is None:
        return []
    try:
        inv = discover(Sysfs(host), with_types=False)
    except (VgpuhostError, OSError):
        return []
    return _matching((str(g.address) for g in inv.gpus), incomplete)


def tenants(ctx: click.Context, param: click.Parameter, incomplete: str) -> List[str]:
    """The tenants the state store holds."""
    st = _store(ctx)
    if st is None:
        return []
    try:
        return _matching((row[0] for row in st.tenant_rows()), incomplete)
    except (VgpuhostError, OSError):
        return []


def domains(ctx: click.Context, param: click.Parameter, incomplete: str) -> List[str]:
    """Domains the state store knows as running (names; their UUIDs when nothing named matches)."""
    st = _store(ctx)
    if st is None:
        return []
    try:
        active = st.active_domains()
    except (VgpuhostError, OSError):
        return []
    return _matching(active.values(), incomplete) or _matching(active, incomplete)


#: parameter name -> completer, for every command (the tenant commands' NAME below)
BY_NAME: Dict[str, Completer] = {
    "profile": profiles, "gpu": gpus, "bdf": gpus, "passthrough": gpus, "tenant": tenants, "domain": domains,
}
#: command path (without the program) -> {parameter name: completer}: where a name means something else
BY_COMMAND: Dict[str, Dict[str, Completer]] = {
    "tenant show": {"name": tenants}, "tenant set": {"name": tenants}, "tenant remove": {"name": tenants},
    "tenant usage": {"name": tenants}, "tenant bind": {"tenant_name": tenants},
}


def attach(group: click.Group, path: str = "") -> int:
    """Give every parameter of ``group``'s commands (recursively) that names a profile, a GPU, a tenant
    or a domain its completer; returns how many.  A parameter that has a completer of its own keeps it.
    (click keeps a parameter's ``shell_complete=`` argument as ``_custom_shell_complete``; setting it
    after the decorators ran is the same as passing it to them: tests/test_cli_conventions.py runs a
    completion end to end, so a click that changes this fails there.)"""
    n = 0
    for name, command in sorted(group.commands.items()):
        where = f"{path} {name}".strip()
        if isinstance(command, click.Group):
            n += attach(command, where)
            continue
        table = {**BY_NAME, **BY_COMMAND.get(where, {})}
        for param in command.params:
            fn = table.get(param.name or "")
            if fn is not None and getattr(param, "_custom_shell_complete", None) is None:
                param._custom_shell_complete = fn
                n += 1
    return n


__all__ = ["COMPLETE_VAR", "attach", "profiles", "gpus", "tenants", "domains"]
