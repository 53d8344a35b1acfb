"""The intent journal of NVML operations: what an entry records, and how reconcile ends it.

Owns: the journal entries of the four NVML write operations — ``mig-mode``
(``mig enable|disable``), ``mig-apply`` (GPU instances), ``scheduler-set``
(the vGPU scheduler) and ``mixed-size`` (``vgpu mode --mixed-size``), each
also run by a layout's ``apply`` — opened before the first NVML call
(:func:`start`: the GPU's state before, read through the NVML backend, and
what the operation wants), and :func:`recover`, which finishes or rolls back
such an entry that an interruption left open.  The entries themselves are
:class:`vgpuhost.plan.journal.Journal`'s (the Executor counts the steps);
:mod:`vgpuhost.ops.recover` dispatches to :func:`recover` under the GPU's
lock.  Must not: call pynvml (the NVML door does), or touch a GPU the
entry does not name.

An entry's one device (JSON in the ``journal`` table)::

    {"gpu": "0000:41:00.0",
     "mig_mode": {"current": true, "pending": true} | null,      (null: not MIG-capable)
     "gpu_instances": [{"gi_id", "profile_id", "profile", "start", "size"}],   (slices)
     "scheduler": {"policy", "arr", "timeslice_ms", "frequency_hz", "avg_factor"} | null,
     "mixed_size": true | false | null,      (null: NVML did not answer, e.g. no vGPU manager)
     "want": {"mig_mode": bool} | {"layout": {"<profile id>": count}} | {"scheduler": {...}}
             | {"mixed_size": bool}}

Recovery (each decision reads the GPU anew through NVML; every call it makes
is an audited Executor step):

- ``mig-mode``: the mode reads as wanted (current or pending) -> finished;
  otherwise rolled back: the GPU instances a ``mig disable`` destroyed before
  its mode call are created again at their placements.
- ``mig-apply``: the GPU's instances count as wanted -> finished; otherwise
  rolled back to the instances it had (those the apply created destroyed,
  those it destroyed created again), so the GPU holds the old layout or the
  new one, never half of one.  The next ``mig apply`` (or layout ``apply``)
  then reaches the wanted layout.
- ``scheduler-set`` / ``mixed-size``: the GPU reads as wanted -> finished;
  as before -> rolled back (nothing landed); anything else -> set back to
  the state before.

Facts: an NVML call either lands or not (the driver applies each one
whole, docs/reference/hardware.md#nvml); GPU instances are addressed by
profile and memory-slice placement, and a re-created instance gets a new
id (docs/reference/hardware.md#mig-profiles).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

from ..io.nvml import NvmlBackend, NvmlError
from ..io.state import StateStore
from ..model.nvml import GpuInstance, SchedulerState
from ..model.records import JournalEntry
from ..model.errors import DeviceError
from ..model.values import PciAddress
from ..plan.journal import Journal
from ..plan.mig import plan_restore
from ..plan.steps import SetMixedSize, SetScheduler
from ..policy.mig import counts, layout_text, profile_name
from ..policy.scheduler import describe, matches

#: the kinds of an NVML journal entry (the write it records); not plan line kinds, though two share a spelling
MIG_MODE, MIG_APPLY, SCHEDULER_SET, MIXED_SIZE = KINDS = ("mig-mode", "mig-apply", "scheduler-set", "mixed-size")


def snapshot(backend: NvmlBackend, bdf: PciAddress) -> dict:
    """The GPU's NVML state as an entry records it (see the module docstring); what NVML cannot
    answer for this GPU (not MIG-capable, no vGPU manager, the scheduler in MIG mode) is null."""
    out: Dict[str, object] = {"gpu": str(bdf), "mig_mode": None, "gpu_instances": [], "scheduler": None,
                              "mixed_size": None}
    try:
        mode = backend.mig_mode(bdf)
    except NvmlError:
        mode = None
    if mode is not None:
        out["mig_mode"] = {"current": bool(mode[0]), "pending": bool(mode[1])}
        if mode[0]:
            by_id = {p.profile_id: p for p in backend.gi_profiles(bdf)}
            out["gpu_instances"] = [{"gi_id": g.gi_id, "profile_id": g.profile_id,
                                     "profile": profile_name(by_id, g.profile_id), "start": g.start,
                                     "size": g.size} for g in backend.gpu_instances(bdf)]
    try:
        out["scheduler"] = asdict(backend.scheduler_state(bdf))
    except NvmlError:
        pass
    try:
        out["mixed_size"] = bool(backend.heterogeneous_mode(bdf))
    except NvmlError:
        pass
    return out


def start(store: StateStore, backend: NvmlBackend, bdf: PciAddress, *, kind: str, operation: str, owner: str,
          actor: str, steps: Sequence[str], want: dict) -> Journal:
    """Open the entry of NVML operation ``kind`` on ``bdf`` (committed before this returns, so
    before the first NVML write): the GPU's state now, ``want``, the planned ``steps`` (lines)."""
    assert kind in KINDS, kind
    dev = snapshot(backend, bdf)
    dev["want"] = want
    return Journal.start(store, kind=kind, operation=operation, owner=owner, actor=actor, gpu=str(bdf),
                         group=None, devices=[dev], steps=list(steps))


def _instances(dev: dict) -> List[GpuInstance]:
    return [GpuInstance(int(g["gi_id"]), int(g["profile_id"]), int(g["start"]), int(g["size"]))
            for g in dev.get("gpu_instances") or []]


def _state(doc: Optional[dict]) -> Optional[SchedulerState]:
    if not doc:
        return None
    return SchedulerState(doc["policy"], bool(doc.get("arr")), doc.get("timeslice_ms"), doc.get("frequency_hz"),
                          doc.get("avg_factor"))


def recover(ex, entry: JournalEntry, rep) -> None:
    """Finish or roll back the open NVML entry ``entry`` (the caller holds the GPU's lock);
    ``rep`` (a :class:`vgpuhost.ops.recover.Recovered`) gets the result and a detail line.

    Raises NvmlError / DeviceError (the entry then stays open for the next reconcile).
    """
    dev = entry.devices[0]
    bdf = PciAddress.parse(entry.gpu)
    want = dev.get("want") or {}
    rep.devices = [entry.gpu]
    if entry.kind == MIG_MODE:
        _mig_mode(ex, bdf, dev, bool(want.get("mig_mode")), rep)
    elif entry.kind == MIG_APPLY:
        _mig_apply(ex, bdf, dev, {int(k): int(v) for k, v in (want.get("layout") or {}).items() if v}, rep)
    elif entry.kind == SCHEDULER_SET:
        _scheduler(ex, bdf, dev, _state(want.get("scheduler")), rep)
    elif entry.kind == MIXED_SIZE:
        _mixed_size(ex, bdf, dev, bool(want.get("mixed_size")), rep)


def _restore(ex, bdf: PciAddress, dev: dict) -> int:
    """Bring ``bdf``'s GPU instances back to those ``dev`` recorded; the NVML calls made.

    Raises DeviceError when they do not read back as recorded."""
    backend = ex.backend
    profiles = backend.gi_profiles(bdf)
    before = _instances(dev)
    steps = plan_restore(profiles, backend.gpu_instances(bdf), before, bdf)
    if steps:
        ex.run(steps)
    now = counts(profiles, backend.gpu_instances(bdf))
    if now != counts(profiles, before):
        raise DeviceError(f"GPU {bdf}: the GPU instances read back {layout_text(now)} after restoring "
                          f"{layout_text(counts(profiles, before))}", hint="see 'vgpuhost mig show' and 'vgpuhost audit'")
    return len(steps)


def _mig_mode(ex, bdf: PciAddress, dev: dict, target: bool, rep) -> None:
    mode = ex.backend.mig_mode(bdf)
    word = "on" if target else "off"
    if mode is not None and bool(mode[1]) == target:
        rep.result = "finished"
        rep.detail = f"MIG mode {word} was set before the interruption" + (
            " (pending until a GPU reset)" if bool(mode[0]) != target else "")
        return
    n = _restore(ex, bdf, dev) if mode is not None and mode[0] and dev.get("gpu_instances") else 0
    rep.result = "rolled-back"
    rep.detail = f"MIG mode was never turned {word}" + (
        f"; {n} GPU instance change(s) made to restore the instances it had destroyed" if n else "")


def _mig_apply(ex, bdf: PciAddress, dev: dict, wanted: Dict[int, int], rep) -> None:
    backend = ex.backend
    have: Dict[int, int] = {}
    for g in backend.gpu_instances(bdf):
        have[g.profile_id] = have.get(g.profile_id, 0) + 1
    profiles = backend.gi_profiles(bdf)
    if have == wanted:
        rep.result = "finished"
        rep.detail = f"the layout {layout_text(counts(profiles, backend.gpu_instances(bdf)))} was complete " \
                     "before the interruption"
        return
    n = _restore(ex, bdf, dev)
    rep.result = "rolled-back"
    rep.detail = (f"GPU instances back to the layout before ({layout_text(counts(profiles, _instances(dev)))}"
                  f"{f', {n} NVML change(s)' if n else ''}); run the apply again")


def _scheduler(ex, bdf: PciAddress, dev: dict, wanted: Optional[SchedulerState], rep) -> None:
    before = _state(dev.get("scheduler"))
    now = ex.backend.scheduler_state(bdf)
    if wanted is not None and matches(wanted, now):
        rep.result, rep.detail = "finished", f"the scheduler was set to {describe(now)} before the interruption"
    elif before is None or matches(before, now):
        rep.result, rep.detail = "rolled-back", f"the scheduler was never changed ({describe(now)})"
    else:
        ex.run([SetScheduler(bdf, before, now)])
        rep.result, rep.detail = "rolled-back", f"the scheduler set back to {describe(before)}"


def _mixed_size(ex, bdf: PciAddress, dev: dict, wanted: bool, rep) -> None:
    now = bool(ex.backend.heterogeneous_mode(bdf))
    word = "on" if wanted else "off"
    if now == wanted:
        rep.result, rep.detail = "finished", f"mixed-size mode was turned {word} before the interruption"
    elif dev.get("mixed_size") is None or bool(dev["mixed_size"]) == now:
        rep.result, rep.detail = "rolled-back", f"mixed-size mode was never turned {word}"
    else:
        ex.run([SetMixedSize(bdf, bool(dev["mixed_size"]))])
        rep.result, rep.detail = "rolled-back", f"mixed-size mode set back to {'on' if dev['mixed_size'] else 'off'}"


__all__ = ["KINDS", "snapshot", "start", "recover"]
