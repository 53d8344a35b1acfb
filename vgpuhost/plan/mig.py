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


def busy_refusal(profiles: Sequence[GiProfile], current: Sequence[GpuInstance], wanted: Mapping[int, int],
                 busy: Mapping[int, int]) -> Optional[str]:
    """Why ``wanted`` (profile id -> count) cannot keep every busy GPU instance where it is (None: it
    can), naming the busy instance that would have to go: ``GPU instance 1 (3g.71gb at memory slice
    4) holds 1 vGPU and the layout has no 3g.71gb for it`` / ``... and the layout's other GPU
    instances do not fit beside it``.  ``busy``: ``{gi_id: vGPUs on it}`` (pure)."""
    by_id = {p.profile_id: p for p in profiles}
    held = [g for g in sorted(current, key=lambda g: g.gi_id) if busy.get(g.gi_id)]
    left: Dict[int, int] = {k: v for k, v in wanted.items() if v}
    for g in held:
        if left.get(g.profile_id, 0) <= 0:
            return (f"{_busy_name(by_id, g, busy)} and the layout has no "
                    f"{'more ' if wanted.get(g.profile_id) else ''}{profile_name(by_id, g.profile_id)} for it")
        left[g.profile_id] -= 1
    missing = {k: v for k, v in left.items() if v > 0}
    if held and missing and place(profiles, missing, held) is None:
        return ", ".join(_busy_name(by_id, g, busy) for g in held) + \
            " and the layout's other GPU instances do not fit beside " + ("it" if len(held) == 1 else "them")
    return None


def _busy_name(by_id: Mapping[int, GiProfile], g: GpuInstance, busy: Mapping[int, int]) -> str:
    n = busy.get(g.gi_id, 0)
    return (f"GPU instance {g.gi_id} ({profile_name(by_id, g.profile_id)} at memory slice {g.start}) holds "
            f"{n} vGPU{'s' if n != 1 else ''}")


def plan_layout(profiles: Sequence[GiProfile], current: Sequence[GpuInstance],
                wanted: Mapping[int, int], gpu: Optional[PciAddress] = None,
                busy: Optional[Mapping[int, int]] = None) -> LayoutPlan:
    """Destroy the GPU instances not wanted, create the missing ones on ``gpu`` (pure).

    ``busy``: ``{gi_id: vGPUs on it}``: a busy GPU instance is always kept where it is, and
    only free ones are destroyed or re-sliced.  Keeps the other wanted instances where the rest
    still fits beside them; otherwise re-slices every free one.  New instances take the
    device's placements (start slices), :func:`vgpuhost.policy.mig.place`.  Raises RefusedError
    when ``wanted`` cannot fit, or cannot fit beside the busy instances (naming the busy one:
    :func:`busy_refusal`).
    """
    by_id = {p.profile_id: p for p in profiles}
    wanted = {k: v for k, v in wanted.items() if v}
    busy = {k: v for k, v in (busy or {}).items() if v}
    reason = why_not(profiles, wanted)
    if reason:
        raise RefusedError(f"MIG layout does not fit: {reason}", hint="nothing was changed")
    have: Dict[int, int] = {}
    for g in current:
        have[g.profile_id] = have.get(g.profile_id, 0) + 1
    if have == wanted:
        return LayoutPlan(list(current), [], [])
    why = busy_refusal(profiles, current, wanted, busy)
    if why:
        raise RefusedError(f"MIG layout would destroy a busy GPU instance: {why}",
                           hint="keep that instance in the layout, or stop the VM on it first; nothing was changed")
    held = [g for g in current if busy.get(g.gi_id)]

    def keeping(first: Sequence[GpuInstance]) -> List[GpuInstance]:
        keep = list(first)
        kept: Dict[int, int] = {}
        for g in keep:
            kept[g.profile_id] = kept.get(g.profile_id, 0) + 1
        for g in sorted(current, key=lambda g: (g.start, g.gi_id)):
            if g in keep:
                continue
            if kept.get(g.profile_id, 0) < wanted.get(g.profile_id, 0):
                keep.append(g)
                kept[g.profile_id] = kept.get(g.profile_id, 0) + 1
        return keep

    def missing_of(keep: Sequence[GpuInstance]) -> Dict[int, int]:
        kept: Dict[int, int] = {}
        for g in keep:
            kept[g.profile_id] = kept.get(g.profile_id, 0) + 1
        return {pid: n - kept.get(pid, 0) for pid, n in wanted.items() if n - kept.get(pid, 0) > 0}

    keep = keeping(held)
    found = place(profiles, missing_of(keep), keep)
    if found is None:
        keep = list(held)            # re-slice every free instance around the busy ones
        found = place(profiles, missing_of(keep), keep)
        assert found is not None     # busy_refusal said the rest fits beside the busy ones
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


__all__ = ["LayoutPlan", "busy_refusal", "plan_layout", "plan_mode_change", "plan_restore"]
