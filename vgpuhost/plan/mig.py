"""The MIG planner: which NVML steps bring a GPU to a wanted layout or MIG mode (pure).

Owns: :func:`plan_layout` (GPU instances to destroy, keep and create, as
:class:`~vgpuhost.plan.steps.DestroyGi` / :class:`~vgpuhost.plan.steps.CreateGi`
steps) and :func:`plan_mode_change` (destroy every GPU instance, then
:class:`~vgpuhost.plan.steps.SetMigMode`) and :func:`plan_restore` (back to the
instances a GPU had before an interrupted operation).  Inputs are values the caller
observed (the device's profiles and instances); must not: call NVML, read
files or run steps (:mod:`vgpuhost.ops.mig` does, through the Executor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from ..model.nvml import GiProfile, GpuInstance
from ..model.errors import RefusedError
from ..model.values import PciAddress
from ..policy.mig import place, profile_name, why_not
from .steps import CreateGi, DestroyGi, SetMigMode, Step


@dataclass
class LayoutPlan:
    """What apply will do: GPU instances to destroy, to keep and to create."""

    keep: List[GpuInstance]
    destroy: List[DestroyGi]
    create: List[CreateGi]

    @property
    def steps(self) -> List[Step]:
        return [*self.destroy, *self.create]


def plan_layout(profiles: Sequence[GiProfile], current: Sequence[GpuInstance],
                wanted: Mapping[int, int], gpu: Optional[PciAddress] = None) -> LayoutPlan:
    """Destroy the GPU instances not wanted, create the missing ones on ``gpu`` (pure).

    Keeps wanted instances where the rest still fits beside them; otherwise
    rebuilds the whole layout.  Raises RefusedError when ``wanted`` cannot fit.
    """
    by_id = {p.profile_id: p for p in profiles}
    wanted = {k: v for k, v in wanted.items() if v}
    reason = why_not(profiles, wanted)
    if reason:
        raise RefusedError(f"MIG layout does not fit: {reason}", hint="nothing was changed")
    have: Dict[int, int] = {}
    for g in current:
        have[g.profile_id] = have.get(g.profile_id, 0) + 1
    if have == wanted:
        return LayoutPlan(list(current), [], [])
    keep: List[GpuInstance] = []
    kept: Dict[int, int] = {}
    for g in sorted(current, key=lambda g: (g.start, g.gi_id)):
        if kept.get(g.profile_id, 0) < wanted.get(g.profile_id, 0):
            keep.append(g)
            kept[g.profile_id] = kept.get(g.profile_id, 0) + 1
    missing = {pid: n - kept.get(pid, 0) for pid, n in wanted.items() if n - kept.get(pid, 0) > 0}
    found = place(profiles, missing, keep)
    if found is None:
        keep, found = [], place(profiles, wanted)
        assert found is not None      # why_not said it fits an empty GPU
    kept_ids = {g.gi_id for g in keep}
    destroy = [DestroyGi(gpu, g.gi_id, profile_name(by_id, g.profile_id), g.start, g.size, g.profile_id)
               for g in sorted(current, key=lambda g: g.gi_id) if g.gi_id not in kept_ids]
    create = [CreateGi(gpu, p.profile_id, p.name, start, dict(p.placements)[start]) for p, start in found]
    return LayoutPlan(keep, destroy, create)


def plan_mode_change(gpu: PciAddress, profiles: Sequence[GiProfile], current: Sequence[GpuInstance],
                     enabled: bool) -> List[Step]:
    """The steps that turn MIG mode on or off on ``gpu``: disabling destroys its GPU instances first."""
    by_id = {p.profile_id: p for p in profiles}
    steps: List[Step] = []
    if not enabled:
        steps += [DestroyGi(gpu, g.gi_id, profile_name(by_id, g.profile_id), g.start, g.size, g.profile_id)
                  for g in current]
    steps.append(SetMigMode(gpu, enabled))
    return steps


def plan_restore(profiles: Sequence[GiProfile], current: Sequence[GpuInstance],
                 before: Sequence[GpuInstance], gpu: Optional[PciAddress] = None) -> List[Step]:
    """The steps that bring ``gpu``'s GPU instances back to ``before`` (pure): destroy those
    ``before`` did not have, then create those it had at their memory-slice placement.

    Instances match by profile and placement start (a re-created instance gets a new id).
    What :mod:`vgpuhost.ops.nvmljournal` runs to roll back an interrupted ``mig apply``
    or ``mig disable``.
    """
    by_id = {p.profile_id: p for p in profiles}
    old = {(g.profile_id, g.start) for g in before}
    now = {(g.profile_id, g.start) for g in current}
    steps: List[Step] = [DestroyGi(gpu, g.gi_id, profile_name(by_id, g.profile_id), g.start, g.size, g.profile_id)
                         for g in sorted(current, key=lambda g: g.gi_id) if (g.profile_id, g.start) not in old]
    steps += [CreateGi(gpu, g.profile_id, profile_name(by_id, g.profile_id), g.start, g.size)
              for g in sorted(before, key=lambda g: g.start) if (g.profile_id, g.start) not in now]
    return steps


__all__ = ["LayoutPlan", "plan_layout", "plan_mode_change", "plan_restore"]
