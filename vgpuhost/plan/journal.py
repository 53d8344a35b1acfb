"""The intent journal: what a device operation is about to do, kept until it ends.

Owns: opening an entry in the state store before an operation's first
write (the operation, its owner, the devices with their original drivers,
the planned steps), recording each completed write on it, and closing it
when the operation ends, however it ends short of a kill.  An entry left
open means the process died (kill -9, OOM, power loss) between its first
write and its end; :mod:`vgpuhost.ops.recover` finishes or rolls it back.
Must not: write to the host (the Executor does), or decide recovery.

Kinds and their ``devices`` (JSON in the ``journal`` table):

- ``passthrough-prepare`` / ``passthrough-release``: one dict per PCI
  function of the IOMMU group, ``{"bdf", "driver", "override", "target"}``:
  the driver and ``driver_override`` it had before the operation (for a
  release: the original driver recorded at prepare) and the driver it is
  to end on (``vfio-pci``; or for a release the original driver, ``*`` for
  any host driver, None for none).
- ``vgpu-create`` / ``vgpu-remove``: one dict, ``{"id", "backend", "gpu",
  "parent", "type_id", "type_name", "persisted", "state"}``; ``state`` is
  ``creating`` before the create write of a new vGPU, ``removing`` before a
  remove write.
- ``mig-mode`` / ``mig-apply`` / ``scheduler-set`` / ``mixed-size`` (NVML
  writes): one dict, the GPU's NVML state before the first call and what
  the operation wants (:mod:`vgpuhost.ops.nvmljournal` writes and ends them).
"""

from __future__ import annotations

import os
from _thread import allocate_lock

from ..io.state import StateStore

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import List, Optional, Sequence


class Journal:
    """One open journal entry; use as a context manager around an operation's writes.

    Leaving the block normally closes the entry (``closed``, outcome ``ok``);
    leaving it by an error closes it with the error as outcome, since the
    operation's own rollback ran.  An interrupt (KeyboardInterrupt, SIGTERM)
    or a SIGKILL leaves it open, for reconcile.
    """

    def __init__(self, store: StateStore, entry_id: int, steps: int):
        self.store = store
        self.id = entry_id
        self.planned = steps
        self.done = 0
        self._keep = False
        with _live_lock:
            _live.add(entry_id)             # worked on by this process until the block ends (in_progress)

    @classmethod
    def start(cls, store: StateStore, *, kind: str, operation: str, owner: str, actor: str, gpu: str,
             group: Optional[int], devices: list, steps: Sequence[str]) -> "Journal":
        """Record the intent (committed before this returns, so before the first write)."""
        eid = store.journal_open(kind=kind, operation=operation, owner=owner, actor=actor, gpu=gpu,
                                 group=group, devices=devices, steps=steps)
        return cls(store, eid, len(steps))

    # --- the Executor's journal seam (plan/executor.py) -------------------------------
    def begin(self, executor, steps) -> None:
        """An Executor run starts: the entry is already open (before the first write)."""

    def step_done(self, executor, index: int, step) -> None:
        """One more step completed and verified: counted on the entry."""
        self.done += 1
        self.store.journal_update(self.id, done=self.done)

    def end(self, executor, error) -> None:
        """An Executor run ended; the operation closes the entry when it ends (``with``)."""

    def devices(self, devices: List[dict]) -> None:
        """The devices as they now stand (e.g. a vGPU's state ``creating`` -> ``created``)."""
        self.store.journal_update(self.id, devices=devices)

    def close(self, outcome: str = "ok") -> None:
        self.store.journal_close(self.id, state="closed", outcome=outcome)

    def keep_open(self) -> None:
        """Leave the entry open when the block ends (work left pending for reconcile, e.g. an
        removal of a vGPU still open, or a remove write that did not return in time)."""
        self._keep = True

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._keep:
                return
            if exc_type is None:
                self.close("ok")
            elif isinstance(exc, Exception):
                self.close(f"failed: {exc}")
            # KeyboardInterrupt/SystemExit: left open; reconcile (or the next command on this
            # group/GPU) checks the host and finishes or rolls back whatever the unwinding left
        finally:
            # an entry left open from here on (pending, interrupted) is no thread's any more: the next
            # operation on its GPU in this process too (the resident agent) may end it (ops/recover.py)
            with _live_lock:
                _live.discard(self.id)


#: ids of the entries this process has opened and one of its threads still works on (a :class:`Journal`
#: from :meth:`Journal.start` until its ``with`` block ends); guarded by ``_live_lock``
_live: set = set()
_live_lock = allocate_lock()


def in_progress(entry_id: int, pid: int) -> bool:
    """Whether the entry ``entry_id``, opened by process ``pid``, is being worked on by a thread of this
    process now (its :class:`Journal` block has not ended).  False for another process's entry: that one
    is guarded by the group/GPU locks its process holds while it works."""
    if pid != os.getpid():
        return False        # (a forked child's copy of its parent's ids never matches: their pid is not its own)
    with _live_lock:
        return entry_id in _live


def attach(executor, journal: Optional[Journal]) -> None:
    """Point ``executor``'s journal seam at ``journal`` (None detaches)."""
    executor.journal = journal


__all__ = ["Journal", "attach", "in_progress"]
