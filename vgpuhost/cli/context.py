"""The Context of a ``vgpuhost`` command, without click: the global options and the host they name.

Owns: :class:`Context` (``--root``, ``--state-dir``, ``--connect``, ``--json``,
``-v``, ``--local``), the ``--gpu`` option's parsing (:func:`parse_gpu_option`) and
:func:`printable` (one safe line).  :mod:`vgpuhost.cli.common` re-exports them
for the click commands; :mod:`vgpuhost.cli.lean` uses them without loading
click.  Must not: import click or a command module.
"""

from __future__ import annotations

from ..io.hostroot import HostRoot
from ..model.errors import InputError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

__all__ = ["Context", "parse_gpu_option", "printable"]


class Context:
    """What the global options set: the host root and output mode."""

    def __init__(self, root: Optional[str], state_dir: Optional[str], connect: Optional[str],
                 json_out: bool, verbose: int, local: bool = False, serve_agent=None):
        self._root = root
        self.serve_agent = serve_agent  # what `vgpuhost agent` starts (vgpuhost.__main__.serve_agent), or None
        self.local = local              # --local: write commands never go through the agent
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

    def inventory(self, *, with_types: bool = True, scope: str = "host", nvml_lost: bool = True):
        """The host's inventory (:func:`vgpuhost.observe.inventory.discover`; ``scope`` "vgpu": only
        what vGPU types and capacity need).  ``nvml_lost`` False: no NVML query for a GPU lost and not
        recorded yet (the lean ``types``, which loads no NVML library)."""
        from ..observe.inventory import discover
        self.host.require_host()
        inv = discover(self.sysfs(), with_types=with_types, scope=scope)
        if not nvml_lost:
            # no GPU can be out of service while the health marker is absent (what in_service_at looks
            # at first): then ops.health, a module of 600 lines, is not imported by a lean `types`
            import os.path
            from ..io.files import exists
            from ..io.hostroot import HEALTH_MARKER
            if not exists(os.path.join(self.host.s.state_dir, HEALTH_MARKER)):
                return inv
        from ..ops.health import in_service_at
        # GPUs out of service (unhealthy or cordoned) offer nothing: types, capacity, placement agree
        # the state directory as text: HostRoot.state_dir is a Path, and pathlib (with urllib.parse,
        # ipaddress, fnmatch) is a tenth of a lean 'types' start's imports
        # and a GPU NVML reports lost now, not recorded yet (ops.health.lost_now), as the exporter leaves it out
        return in_service_at(inv, self.host.s.state_dir, self.host if nvml_lost else None)


def parse_gpu_option(ctx: Context, inv, gpu: Optional[str]):
    """``--gpu BDF`` as a PciAddress (None when not given); with ``inv``, InputError unless it is an NVIDIA GPU."""
    if gpu is None:
        return None
    from ..model.values import PciAddress
    addr = PciAddress.parse(gpu)
    if inv is not None and inv.gpu(addr) is None:
        known = ", ".join(str(g.address) for g in inv.gpus) or "none"
        raise InputError(f"no NVIDIA GPU at {addr}", hint=f"GPUs on this host: {known} ('vgpuhost gpus')")
    return addr


def printable(text: str, limit: int = 2000) -> str:
    """One line: control characters escaped (no terminal escapes from files), length capped."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return out if len(out) <= limit else out[:limit] + "..."
