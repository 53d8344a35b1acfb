"""The agent's GPU health watch: NVML's critical Xid events and a periodic check, continuously.

Owns: :class:`HealthWatch`, a daemon thread the agent runs beside its server
(:func:`vgpuhost.__main__.serve_agent`): each round takes NVML's critical Xid
events (waiting up to :data:`vgpuhost.ops.health.WATCH_EVENT_WAIT_MS` for the
first) and, every :data:`vgpuhost.ops.health.WATCH_INTERVAL_S`, checks every
known GPU (the PCI tree, GPU_IS_LOST; known: the store's, and every GPU an earlier check found in the
tree, so one that never held a vGPU and leaves the tree is recorded too); each new failure is recorded and audited
by :func:`vgpuhost.ops.health.watch_once`.  Going back into service is the
operator's ``gpu uncordon`` (after a health check), never automatic: a GPU that
fell off the bus once is not trusted by itself.  Must not: speak HTTP, or stop
the agent when a round fails (it logs and tries again next round).
"""

from __future__ import annotations

import logging
import os.path
import threading
import time
from typing import List, Optional, Set

from ..io.hostroot import HostRoot
from ..io.files import exists
from ..io.state import DB_NAME, StateStore
from ..io.sysfs import Sysfs
from ..model.values import PciAddress
from ..observe.inventory import discover
from ..ops import health
from ..policy.offers import seen_rows

log = logging.getLogger(__name__)

#: the audit actor of the watch's transitions
ACTOR = "agent health-watch"


class HealthWatch:
    """``with HealthWatch(host):`` runs the watch on a daemon thread until the block ends."""

    def __init__(self, host: HostRoot, *, interval_s: float = health.WATCH_INTERVAL_S,
                 event_wait_ms: int = health.WATCH_EVENT_WAIT_MS):
        self.host = host
        self.interval_s = interval_s
        self.event_wait_ms = event_wait_ms
        self.stop = threading.Event()
        self.transitions: List[dict] = []       # every transition this watch recorded, oldest first
        self.rounds = 0
        self.seen: Set[PciAddress] = set()      # every GPU a periodic check found in the tree
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "HealthWatch":
        self._thread = threading.Thread(target=self.run, name="vgpuhost-health-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return False

    def run(self) -> None:
        store = None
        nvml = None
        last_check = 0.0
        while not self.stop.is_set():
            try:
                if store is None:
                    # the agent creates the store as it starts: the watch opens it once it exists (two
                    # creators in one process would race on the same temporary file)
                    if not exists(os.path.join(str(self.host.state_dir), DB_NAME)):
                        self.stop.wait(0.05)
                        continue
                    store = StateStore(self.host.state_dir, create=False)
                    nvml = health.nvml_or_none(self.host)
                now = time.monotonic()
                check = now - last_check >= self.interval_s
                # the periodic check reads the host too: a device read failing with EIO/ENODEV is a signal
                inv = discover(Sysfs(self.host)) if check else None
                if inv is not None:
                    # every GPU seen is watched from now on: one that leaves the tree later is recorded even if
                    # it never held a vGPU; its types remembered in the store (written only when new), so the
                    # CLI's check and the next agent know it too
                    self.seen |= {g.address for g in inv.gpus}
                    store.remember_types(seen_rows(inv))
                self.transitions += health.watch_once(self.host, store, nvml, actor=ACTOR, check=check, inv=inv,
                                                      event_wait_ms=self.event_wait_ms if nvml is not None else 0,
                                                      also=self.seen)
                if check:
                    last_check = now
                self.rounds += 1
            except Exception as e:      # a round that fails (store busy, host root gone) is tried again
                log.warning("health watch: %s", e)
            self.stop.wait(0.2 if nvml is not None and not self.host.is_simulated else min(1.0, self.interval_s))
