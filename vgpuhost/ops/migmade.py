"""The records of GPU instances made on demand (:mod:`vgpuhost.ops.migdemand`), and which of them a
start still in progress holds: read by :mod:`vgpuhost.ops.mig` (``mig apply`` counts such an
instance busy, and adopts the others a declared layout keeps) and by MIG on demand itself.

Owns: the settings rows ``mig.made/<BDF>/<profile id>/<start>`` = ``<owner> pid=<maker> gi=<id>``
(:class:`Made`), the in-process set of starts in progress (:class:`starting`).  Must not: call
NVML, change a GPU instance (:mod:`vgpuhost.ops.mig` does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..io.state import pid_alive

MADE = "mig.made/"

#: ``{owner: starts in progress}`` in this process (:class:`starting`): the agent runs every hook in one
#: process, so a record whose maker is this process is alive only while its start is (trial 10a finding 8)
_STARTING: Dict[str, int] = {}


class starting:
    """``with starting(owner):`` around a start that may make GPU instances on demand
    (:func:`vgpuhost.ops.migdemand.make_for` to its vGPUs made, or its undo): while it runs, a record of ``owner`` this process made counts as a
    start in progress (:func:`maker_alive`), so another domain's ``release end`` or a ``reconcile`` in the
    same process (the agent) does not take it for an orphan.  A class, not ``contextlib``: the qemu hook
    does not import contextlib."""

    __slots__ = ("owner",)

    def __init__(self, owner: str):
        self.owner = owner

    def __enter__(self) -> None:
        _STARTING[self.owner] = _STARTING.get(self.owner, 0) + 1

    def __exit__(self, *exc) -> bool:
        n = _STARTING.get(self.owner, 0) - 1
        if n > 0:
            _STARTING[self.owner] = n
        else:
            _STARTING.pop(self.owner, None)
        return False


@dataclass(frozen=True)
class Made:
    """A GPU instance made on demand: its GPU, GI profile id and memory-slice ``start``; the domain
    ``owner`` (UUID) it was made for; ``pid`` the process that made it while its start runs (a start
    still running is left alone by :func:`sweep`, :func:`maker_alive`; 0 once the start made its
    devices, :func:`started`); ``gi_id`` once it read back (None: the create was interrupted)."""

    gpu: str
    profile_id: int
    start: int
    owner: str
    pid: int = 0
    gi_id: Optional[int] = None

    @property
    def key(self) -> str:
        return f"{MADE}{self.gpu}/{self.profile_id}/{self.start}"

    def value(self) -> str:
        return f"{self.owner} pid={self.pid}" + (f" gi={self.gi_id}" if self.gi_id is not None else "")

    @classmethod
    def parse(cls, key: str, value: str) -> "Made":
        """The record of settings row ``key`` = ``value``; ValueError when it is damaged."""
        bdf, pid, start = key[len(MADE):].rsplit("/", 2)
        words = value.split()
        if not words:
            raise ValueError(value)
        kw = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        gi = kw.get("gi")
        return cls(bdf, int(pid), int(start), words[0], int(kw.get("pid") or 0), int(gi) if gi else None)

    def line(self) -> str:
        return (f"GPU instance {self.gi_id if self.gi_id is not None else '(interrupted create)'} at memory slice "
                f"{self.start} on {self.gpu}, made on demand for {self.owner}")


def made(store, *, owner: Optional[str] = None, gpu: Optional[str] = None) -> List[Made]:
    """The GPU instances made on demand and not destroyed yet (of ``owner`` / on ``gpu``)."""
    out = []
    for key, value in store.settings_under(MADE).items():
        try:
            m = Made.parse(key, value)
        except ValueError:
            continue                      # a damaged row: not ours to act on
        if (owner is None or m.owner == owner) and (gpu is None or m.gpu == gpu):
            out.append(m)
    return out


def maker_alive(m: "Made") -> bool:
    """Whether the start that made ``m`` may still be running: its maker (``pid``, 0 once the start
    ended: :func:`started`) is another live process, or this one with a start of ``m.owner`` in
    progress (:class:`starting`)."""
    if not m.pid:
        return False
    if m.pid == os.getpid():
        return _STARTING.get(m.owner, 0) > 0
    return pid_alive(m.pid)


def started(store, items: List["Made"]) -> None:
    """The start that made ``items`` ended with its devices made: their records keep the owner and the
    instance, no longer a maker (``pid=0``), so the instance is no start's in progress any more
    (:func:`in_progress`; ``mig apply`` may re-slice it once it is empty)."""
    for m in items:
        store.set_setting(m.key, Made(m.gpu, m.profile_id, m.start, m.owner, 0, m.gi_id).value())


def in_progress(store, gpu: str) -> List["Made"]:
    """The instances made on demand on ``gpu`` (BDF text) for a start still in progress (its maker
    alive, :func:`maker_alive`): its vGPU may not sit on it yet, so ``mig apply`` counts it busy."""
    return [m for m in made(store, gpu=gpu) if maker_alive(m)]


def adopt(store, gpu: str, gi_ids, *, actor: str, operation: str) -> List["Made"]:
    """An explicit ``mig apply`` declared the GPU instances ``gi_ids`` on ``gpu``: those made on demand
    (no start in progress) become the layout's: their records are dropped (one audit row each), so
    their owner's stop leaves them (trial 10a finding 9).  What was adopted."""
    out = []
    for m in made(store, gpu=gpu):
        if m.gi_id is None or m.gi_id not in gi_ids or maker_alive(m):
            continue
        store.set_setting(m.key, None)
        store.audit(actor=actor, operation=operation, path="(settings)",
                    value=f"{m.key} dropped: GPU instance {m.gi_id}, made on demand for {m.owner}, is the "
                          "applied layout's now (its owner's stop leaves it)")
        out.append(m)
    return out


__all__ = ["MADE", "Made", "made", "starting", "maker_alive", "started", "in_progress", "adopt"]
