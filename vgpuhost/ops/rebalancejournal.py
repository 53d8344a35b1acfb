"""The journal entry of one capacity-reconciler move, and how reconcile ends one a kill left open.

Owns: :data:`KIND` (``rebalance``) and :func:`recover`, which :mod:`vgpuhost.ops.recover` calls
under the GPU's lock for such an entry.  The entry's one device (JSON in the ``journal`` table)::

    {"gpu": BDF, "from_pool": name, "to_pool": name, "scheduler_before": {policy, arr, ...} | null,
     "policy_after": policy | null, "reason": the demand that drove it}

Must not: import the reconciler itself (:mod:`vgpuhost.ops.rebalance`, which reads tenancy):
recovery runs on the qemu hook's path.
"""

from __future__ import annotations

from ..io.hostroot import HostRoot
from ..io.state import StateStore
from ..model.nvml import SchedulerState
from ..model.records import JournalEntry
from ..model.values import PciAddress
from ..plan.executor import Executor
from ..plan.steps import SetScheduler
from ..policy.admission import DEFAULT_POOL

#: the journal entry kind of one move
KIND = "rebalance"


def recover(host: HostRoot, store: StateStore, ex: Executor, entry: JournalEntry, rep) -> None:
    """End a ``rebalance`` entry a kill left open: recorded in the new pool -> ``finished`` (the new
    pool's policy set where it does not run); else -> ``rolled-back`` (the scheduler state before set
    again where it differs).  Each NVML write is an Executor step (audited); the GPU must be empty."""
    dev = entry.devices[0]
    gpu = PciAddress.parse(dev["gpu"])
    recorded = next((r[1] for r in store.pool_rows() if r[0] == dev["gpu"]), DEFAULT_POOL)
    backend = ex.backend
    now = backend.scheduler_state(gpu)
    if recorded == dev["to_pool"]:
        want = SchedulerState(policy=dev["policy_after"]) if dev.get("policy_after") else None
        if want is not None and now.policy != want.policy:
            ex.run([SetScheduler(gpu, want, None)])
        rep.result, rep.detail = "finished", f"GPU {gpu} is in pool {recorded}"
        return
    before = dev.get("scheduler_before")
    if before and now.policy != before["policy"]:
        ex.run([SetScheduler(gpu, SchedulerState(**before), None)])
    rep.result, rep.detail = "rolled-back", f"GPU {gpu} stays in pool {recorded}"
    rep.devices = [str(gpu)]


__all__ = ["KIND", "recover"]
