"""Plans are data: the steps vgpuhost takes on a host, and their executor.

Owns: the step types (one kernel write or one read-back check each), how
each is described for ``--dry-run``, and executing them through
:class:`~vgpuhost.sysfs.Sysfs` with an audit row per write.  Must not:
decide which steps to take (planners in :mod:`vgpuhost.passthrough` and
later modules do, as pure functions).

Sources: the safe binding sequence is REFERENCE.md §1 (driverctl's:
driver_override, unbind, drivers_probe, then verify).
"""

from __future__ import annotations

from ..model.errors import DeviceError, SysfsError
from ..io.hostroot import HostRoot
from ..io.state import StateStore
from ..io.sysfs import Sysfs
from ..model.values import PciAddress, record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Callable, Iterable, List, Optional
    Observer = Callable[[object, str, int], None]

ANY_HOST_DRIVER = "<any host driver>"


class Step:
    """One action on the host."""

    bdf: PciAddress

    def describe(self, host: HostRoot) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, fs: Sysfs) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


@record(frozen=True)
class SetDriverOverride(Step):
    """Write ``driver`` to ``driver_override`` (None clears it: a newline)."""

    bdf: PciAddress
    driver: Optional[str]

    def _path(self, host: HostRoot):
        return host.pci_device(self.bdf) / "driver_override"

    def describe(self, host: HostRoot) -> str:
        value = repr(self.driver) if self.driver else "'\\n' (clear)"
        return f"write {value} to {host.relative(self._path(host))}"

    def run(self, fs: Sysfs) -> None:
        fs.write(self._path(fs.host), self.driver if self.driver else "\n")


@record(frozen=True)
class Unbind(Step):
    """Write the BDF to ``drivers/<driver>/unbind``."""

    bdf: PciAddress
    driver: str

    def describe(self, host: HostRoot) -> str:
        return f"write '{self.bdf}' to {host.relative(host.pci_driver(self.driver) / 'unbind')}"

    def run(self, fs: Sysfs) -> None:
        fs.write(fs.host.pci_driver(self.driver) / "unbind", str(self.bdf))


@record(frozen=True)
class Probe(Step):
    """Write the BDF to ``drivers_probe`` (succeeds even when nothing binds)."""

    bdf: PciAddress

    def describe(self, host: HostRoot) -> str:
        return f"write '{self.bdf}' to {host.relative(host.pci_drivers_probe)}"

    def run(self, fs: Sysfs) -> None:
        fs.write(fs.host.pci_drivers_probe, str(self.bdf))


@record(frozen=True)
class VerifyDriver(Step):
    """Read ``driver`` back; ``expected`` None = unbound, ANY_HOST_DRIVER = bound, not vfio-pci."""

    bdf: PciAddress
    expected: Optional[str]

    def describe(self, host: HostRoot) -> str:
        want = "no driver" if self.expected is None else self.expected
        return f"check {host.relative(host.pci_device(self.bdf) / 'driver')} is {want}"

    def run(self, fs: Sysfs) -> None:
        got = fs.link_name(fs.host.pci_device(self.bdf) / "driver")
        ok = (got is not None and got != "vfio-pci") if self.expected == ANY_HOST_DRIVER else got == self.expected
        if not ok:
            want = "no driver" if self.expected is None else self.expected
            raise DeviceError(
                f"{self.bdf} is bound to {got or 'no driver'} after drivers_probe, expected {want}",
                hint="drivers_probe reported success but bound nothing: is the driver's module loaded "
                     "(modprobe it) and does driver_override name it?")




class Executor:
    """Runs steps through a Sysfs whose every write lands in the audit log.

    ``actor`` names who acts (``cli uid=0 pid=42``, ``hook <domain>``);
    ``operation`` what for (``passthrough prepare 0000:01:00.0``).
    """

    def __init__(self, host: HostRoot, store: Optional[StateStore], *, actor: str, operation: str):
        self.host = host
        self.store = store
        self.actor = actor
        self.operation = operation
        self.writes = 0
        self.fs = Sysfs(host, observers=[self._audit])

    def _audit(self, path, value: str, err: int) -> None:
        self.writes += 1
        if self.store is not None:
            self.store.audit(actor=self.actor, operation=self.operation,
                             path=self.host.relative(path), value=value.rstrip("\n") or "\\n", err=err)

    def run(self, steps: Iterable[Step]) -> None:
        """Run steps in order; the first failure raises (SysfsError or DeviceError)."""
        for step in steps:
            step.run(self.fs)


def describe(host: HostRoot, steps: Iterable[Step]) -> List[str]:
    return [s.describe(host) for s in steps]


__all__ = ["Step", "SetDriverOverride", "Unbind", "Probe", "VerifyDriver", "Executor", "describe",
           "ANY_HOST_DRIVER", "SysfsError"]
