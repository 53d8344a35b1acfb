"""The passthrough planner: the sysfs steps that bind an IOMMU group to vfio-pci and give it back (pure).

Owns: :class:`FunctionPlan` (one PCI function's steps, with its driver
before and after), :func:`plan_prepare`, :func:`plan_release` and
:func:`rollback_steps` (back to the driver before, from the state a failure
left).  Inputs are observed values (endpoints, passthrough records); must
not: read sysfs or run steps (:mod:`vgpuhost.ops.passthrough` does, through
the Executor).

Facts (the project's docs reference, section 1): the safe binding sequence
is driver_override, unbind, drivers_probe, then verify (drivers_probe
succeeds even when nothing bound); release gives companions (HD audio...)
back before the GPU.
"""

from __future__ import annotations

from ..model.values import PciAddress, record
from ..policy.iommu import VFIO_PCI
from .steps import ANY_HOST_DRIVER, Probe, SetDriverOverride, Step, Unbind, VerifyDriver

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, List, Optional, Sequence, Tuple
    from ..model.records import PassthroughRecord
    from ..observe.inventory import PciDevice


@record(frozen=True)
class FunctionPlan:
    """The steps for one PCI function, with what it was bound to before."""

    bdf: PciAddress
    before_driver: Optional[str]
    target_driver: Optional[str]   # vfio-pci on prepare; the original (or ANY_HOST_DRIVER) on release
    steps: Tuple[Step, ...]


def plan_prepare(endpoints: Sequence[PciDevice]) -> List[FunctionPlan]:
    """Steps that bind each endpoint to vfio-pci; functions already there are skipped."""
    plans = []
    for d in endpoints:
        if d.driver == VFIO_PCI and d.driver_override == VFIO_PCI:
            continue
        steps: List[Step] = []
        if d.driver_override != VFIO_PCI:
            steps.append(SetDriverOverride(d.address, VFIO_PCI))
        if d.driver and d.driver != VFIO_PCI:
            steps.append(Unbind(d.address, d.driver))
        if d.driver != VFIO_PCI:
            steps.append(Probe(d.address))
        steps.append(VerifyDriver(d.address, VFIO_PCI))
        plans.append(FunctionPlan(d.address, d.driver, VFIO_PCI, tuple(steps)))
    return plans


def plan_release(endpoints: Sequence[PciDevice], records: Dict[str, PassthroughRecord]) -> List[FunctionPlan]:
    """Steps that give each endpoint back, companions first and the GPU last.

    A recorded function goes back to its original driver; an unrecorded one
    bound to vfio-pci (another tool's doing) to whatever host driver probes.
    A stale ``driver_override`` is cleared either way.
    """
    plans = []
    for d in reversed(list(endpoints)):
        rec = records.get(str(d.address))
        if rec is not None and rec.original_driver == VFIO_PCI:
            # bound to vfio-pci before vgpuhost came (vfio-pci.ids, early binding): it stays there;
            # only an override vgpuhost set is cleared, and the record is dropped
            steps = []
            if d.driver_override != rec.original_override:
                steps.append(SetDriverOverride(d.address, rec.original_override))
            if d.driver != VFIO_PCI:
                if d.driver is not None:
                    steps.append(Unbind(d.address, d.driver))
                steps += [Probe(d.address), VerifyDriver(d.address, VFIO_PCI)]
            if steps:
                plans.append(FunctionPlan(d.address, d.driver, VFIO_PCI, tuple(steps)))
            continue
        target = (rec.original_driver if rec and rec.original_driver != VFIO_PCI else
                  (None if rec and rec.original_driver is None else ANY_HOST_DRIVER))
        steps: List[Step] = []
        if d.driver_override is not None:
            steps.append(SetDriverOverride(d.address, None))
        if d.driver == VFIO_PCI:
            steps.append(Unbind(d.address, VFIO_PCI))
            if target is not None:
                steps.append(Probe(d.address))
            steps.append(VerifyDriver(d.address, target))
        elif d.driver is None and target is not None:
            steps.append(Probe(d.address))
            steps.append(VerifyDriver(d.address, target))
        if steps:
            plans.append(FunctionPlan(d.address, d.driver, target, tuple(steps)))
    return plans


def rollback_steps(fp: FunctionPlan, now: PciDevice) -> List[Step]:
    """Steps that return a function to ``fp.before_driver`` from its state ``now``."""
    steps: List[Step] = []
    if now.driver_override is not None:
        steps.append(SetDriverOverride(fp.bdf, None))
    if now.driver is not None and now.driver != fp.before_driver:
        steps.append(Unbind(fp.bdf, now.driver))
    if fp.before_driver is not None and now.driver != fp.before_driver:
        steps.append(Probe(fp.bdf))
        steps.append(VerifyDriver(fp.bdf, fp.before_driver))
    return steps


__all__ = ["FunctionPlan", "plan_prepare", "plan_release", "rollback_steps"]
