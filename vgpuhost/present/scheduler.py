"""The scheduler request parsing the CLI (``scheduler set``) and the agent (``POST /v1/scheduler``) share.

:func:`scheduler_state` turns the options as given into the SchedulerState asked for
(policies and their parameters: NVIDIA vGPU software user guide, "vGPU scheduling
policies"); it raises InputError for options that do not go together.
"""

from __future__ import annotations

from typing import Optional

from ..model.concepts import SchedulerPolicy
from ..model.errors import InputError
from ..model.nvml import SchedulerState


def scheduler_state(policy: str, timeslice_ms: Optional[int], frequency_hz: Optional[int],
                    avg_factor: Optional[int]):
    """The SchedulerState ``scheduler set`` asks for.  Raises InputError for options that do not go
    together (the command says so as usage errors first)."""
    if policy not in SchedulerPolicy.values():
        *first, last = SchedulerPolicy.values()
        raise InputError(f"unknown scheduler policy {policy!r}", hint=f"{', '.join(first)} or {last}")
    if (frequency_hz is None) != (avg_factor is None):
        raise InputError("--frequency-hz and --avg-factor go together")
    if timeslice_ms is not None and frequency_hz is not None:
        raise InputError("--timeslice-ms (no ARR) and --frequency-hz/--avg-factor (ARR) exclude each other")
    if policy == SchedulerPolicy.BEST_EFFORT and (timeslice_ms is not None or frequency_hz is not None):
        raise InputError("best effort takes no time slice, frequency or averaging factor")
    if policy == SchedulerPolicy.BEST_EFFORT:
        return SchedulerState(SchedulerPolicy.BEST_EFFORT)
    if timeslice_ms is not None:
        return SchedulerState(policy, arr=False, timeslice_ms=timeslice_ms)
    return SchedulerState(policy, arr=True, frequency_hz=frequency_hz, avg_factor=avg_factor)
