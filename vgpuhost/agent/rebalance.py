"""The capacity reconciler in the agent: :func:`vgpuhost.ops.rebalance.rebalance` every ``interval_s``.

Owns: :class:`AgentRebalancer` (one daemon thread; each run one of the agent's changes, under its
write lock, so it never interleaves with a change the agent serves but one that lent that lock while
it waits long (:meth:`vgpuhost.agent.api.Agent.write`: it holds its file locks), none starts once the
agent is stopping, and the agent's snapshot is read again for the GPUs moved) and
:func:`start`, which reads the reconciler's config (``<root>/etc/vgpuhost/rebalance.yaml``) and starts
it only when the config turns it on (``agent: {enabled: true, interval_s: S}``).  Must not: decide
or change anything itself (ops does), or stop the agent for a failed run (it is logged, the next
run tries again).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Optional

from ..io.state import StateStore
from ..model.errors import VgpuhostError
from ..ops import rebalance as ops
from .api import Stopping

log = logging.getLogger("vgpuhost.agent")

#: who the audit log names for the agent's runs
ACTOR = "agent rebalance"


class AgentRebalancer:
    """Runs the reconciler every ``interval_s`` seconds (default: the config's) until :meth:`close`.
    ``last``: the last run's document (``vgpuhost.rebalance/v1``) or ``{"error": line}``; ``runs``: how
    many ran."""

    def __init__(self, agent, bounds, *, interval_s: Optional[float] = None):
        self.agent, self.bounds = agent, bounds
        self.interval_s = bounds.interval_s if interval_s is None else interval_s
        self.stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.last: Optional[Dict[str, Any]] = None
        self.runs = 0

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="agent-rebalance", daemon=True)
        self.thread.start()

    def run_once(self) -> Optional[Dict[str, Any]]:
        """One run as one of the agent's changes (:meth:`vgpuhost.agent.api.Agent.write`: under its write
        lock, its snapshot then refreshed for the moved GPUs); None when the agent is stopping (nothing
        ran)."""
        if self.stop.is_set():
            return None

        def once():
            store = StateStore(self.agent.host.state_dir, create=True)
            try:
                return ops.rebalance(self.agent.host, store, self.bounds, actor=ACTOR)
            finally:
                store.close()
        try:
            result = self.agent.write(once, lambda r: [m.gpu for m in r.done])
        except Stopping:
            return None
        except VgpuhostError as e:
            self.last = {"error": e.one_line()}
            log.warning("rebalance failed: %s", e.one_line())
        else:
            self.last = result.as_dict()
            for m in result.done:
                log.info("rebalance: moved GPU %s from pool %s to pool %s: %s", m.gpu, m.from_pool, m.to_pool,
                         m.reason)
            for f in result.failed:
                log.warning("rebalance: %s", f)
        finally:
            self.runs += 1
        return self.last

    def _loop(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.run_once()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=10)


def start(agent) -> Optional[AgentRebalancer]:
    """The agent's reconciler, started, when its config turns it on; else None.  Raises InputError (one
    line naming the file and the field) for a config that is not valid: the agent does not start."""
    bounds = ops.load_bounds(agent.host)
    if not bounds.enabled:
        return None
    r = AgentRebalancer(agent, bounds)
    r.start()
    log.info("rebalance: every %g s (%s)", r.interval_s, ops.config_path(agent.host))
    return r


__all__ = ["AgentRebalancer", "start", "ACTOR"]
