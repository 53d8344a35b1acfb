"""GPU time as a placement dimension: expected demand per GPU, compute ceilings, starved demand.  Pure.

Owns: the expected GPU-time demand of a time-sliced vGPU where it sits
(:func:`expected`: its :class:`vgpuhost.model.gputime.ExpectedUse`, else its
profile's fixed share; in a fixed-share pool never more than the fixed
share, which the scheduler gives it and no more), the expected demand per
GPU (:func:`gpu_load`), a pool's compute ceiling per GPU
(:func:`ceiling_of`), whether a new vGPU still fits under it
(:func:`room`, :func:`fits`), and the demand above the ceilings
(:func:`starved`, :func:`pool_starved`).  Must not: read the metering
store (``vgpuhost.ops.gputime`` estimates the use) or choose a GPU
(:mod:`vgpuhost.policy.admission` filters the offers, then
:mod:`vgpuhost.policy.placement` takes the best fit).

Units: shares of one physical GPU's time (1.0: one GPU busy all the time);
framebuffer in MiB.  MIG-backed vGPUs and passthrough GPUs hold hardware
partitions: they are not counted (their time is theirs alone).
"""

from __future__ import annotations

from ..model.gputime import DEFAULT_CEILING, METERED, PROFILE_SHARE, ExpectedUse
from ..model.kinds import SchedulerPolicy
from .demand import VGPU, Allocation, Demand

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, Mapping, Optional, Sequence

#: a share this close above a ceiling still fits it (float sums of many shares)
EPSILON = 1e-9


def fixed_share(framebuffer_mib: int, gpu_memory_mib: Optional[int]) -> float:
    """The profile's fixed share of a GPU: its framebuffer over the GPU's (equal-size mode holds
    ``gpu / vGPU`` of them and the fixed-share scheduler gives each that share); 0.0 when either is
    not known."""
    if not framebuffer_mib or not gpu_memory_mib:
        return 0.0
    return min(1.0, framebuffer_mib / gpu_memory_mib)


def sliced(d: Demand) -> bool:
    """Is ``d`` a time-sliced vGPU (the only kind that shares a GPU's time)?"""
    return d.kind == VGPU and not d.mig_slices


def expected(d: Demand, gpu_memory_mib: Optional[int], policy: str = "") -> ExpectedUse:
    """The expected GPU-time demand of time-sliced ``d`` on a GPU of ``gpu_memory_mib`` MiB whose pool runs
    ``policy`` (``""``: not known): ``d.use`` when given, else the profile's fixed share; never more than
    1.0 (one GPU's time: a vGPU cannot use more), in a fixed-share pool capped at the fixed share (the
    scheduler gives the vGPU that share, never more), a domain's own metered mean never below it.  A
    hardware partition expects 0.0."""
    if not sliced(d):
        return ExpectedUse(0.0, PROFILE_SHARE)
    fixed = fixed_share(d.framebuffer_mib, gpu_memory_mib)
    use = d.use if d.use is not None else ExpectedUse(fixed, PROFILE_SHARE)
    if use.share > 1.0:
        use = ExpectedUse(1.0, use.source, use.samples_s)
    if policy == SchedulerPolicy.FIXED_SHARE and fixed and use.share > fixed:
        return ExpectedUse(fixed, use.source, use.samples_s)
    if use.source == METERED and fixed and use.share < fixed:
        # a domain's own history below its fixed share (it idled) counts the fixed share: idling once
        # is free, so an idle history must not let a domain that runs busy now be packed as idle
        # beside another tenant's VMs (trial 10 final NEW-1)
        return ExpectedUse(fixed, use.source, use.samples_s)
    return use


def ceiling_of(pool) -> float:
    """A pool's compute ceiling per GPU (:class:`vgpuhost.policy.admission.Pool`; the implicit pool and
    a pool declaring none: :data:`vgpuhost.model.gputime.DEFAULT_CEILING`)."""
    c = getattr(pool, "ceiling", None)
    return DEFAULT_CEILING if c is None else float(c)


def gpu_load(allocations: Sequence[Allocation], gpu_memory: Optional[Mapping[str, int]],
             policy_of=None) -> Dict[str, float]:
    """``{GPU BDF: expected GPU-time demand of its time-sliced vGPUs}`` (GPUs holding none left out).
    ``gpu_memory``: framebuffer MiB by BDF (the fixed share's denominator); ``policy_of(gpu)``: the
    scheduler policy of the GPU's pool (None: not known)."""
    out: Dict[str, float] = {}
    mem = gpu_memory or {}
    for a in allocations:
        d = a.demand
        if not sliced(d):
            continue
        out[a.gpu] = out.get(a.gpu, 0.0) + expected(d, mem.get(a.gpu), policy_of(a.gpu) if policy_of else "").share
    return out


def room(load: float, ceiling: float) -> float:
    """GPU time left under ``ceiling`` with ``load`` expected (0.0 and up)."""
    return max(0.0, ceiling - load)


def fits(share: float, load: float, ceiling: float) -> bool:
    """Does a vGPU expecting ``share`` fit on a GPU expecting ``load`` under ``ceiling``?"""
    return load + share <= ceiling + EPSILON


def starved(load: Mapping[str, float], ceilings: Mapping[str, float]) -> Dict[str, float]:
    """``{GPU BDF: expected demand above its ceiling}`` for every GPU of ``load`` (0.0 where it fits);
    ``ceilings``: by BDF (a GPU not named: :data:`DEFAULT_CEILING`)."""
    return {g: max(0.0, v - ceilings.get(g, DEFAULT_CEILING)) for g, v in load.items()}


def pool_starved(starved_by_gpu: Mapping[str, float], pool_of_gpu: Mapping[str, str]) -> Dict[str, float]:
    """``{pool: sum of its GPUs' starved demand}`` (``pool_of_gpu``: pool name by BDF; a GPU not named
    is in ``default``)."""
    out: Dict[str, float] = {}
    for g, v in starved_by_gpu.items():
        p = pool_of_gpu.get(g, "default")
        out[p] = out.get(p, 0.0) + v
    return out
