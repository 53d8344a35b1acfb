"""The reconciler's plan: the steps that move one empty GPU to another pool.

Owns: :class:`RecordPool` (the GPU's pool recorded in the state store, with one audit row naming
the demand that drove it, in one transaction; its inverse records the old pool again) and
:func:`plan_move`, the pure planner from a decided :class:`~vgpuhost.policy.rebalance.Move` and the
GPU's scheduler state now: :class:`~vgpuhost.plan.steps.SetScheduler` to the new pool's policy
(whose inverse sets the old state again), then :class:`RecordPool`.  Must not: decide the move
(:mod:`vgpuhost.policy.rebalance`) or read the host; :mod:`vgpuhost.ops.rebalance` runs the plan
through the one :class:`~vgpuhost.plan.executor.Executor` under a journal entry.

Order: the scheduler first, then the record.  Admission takes a GPU of a pool only while the GPU
runs its pool's policy, so between the two steps the GPU serves no class (its old pool's policy no
longer runs): no start lands on it half-moved.  A failure undoes the steps before it; a kill is
finished or rolled back by ``vgpuhost reconcile`` from the journal (the record decides: the GPU
recorded in the new pool -> finished, else the old policy set again -> rolled back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..model.errors import DeviceError
from ..model.nvml import SchedulerState
from ..model.values import PciAddress
from ..policy.admission import DEFAULT_POOL, REBALANCE_MOVED
from ..policy.rebalance import Move
from .executor import StepContext
from .steps import AUDIT_NONE, SetScheduler, Step

#: the audit row's path and operation of a pool record
AUDIT_PATH = "(pools)"
OPERATION = "rebalance move"


@dataclass(frozen=True)
class RecordPool(Step):
    """Record GPU ``gpu`` (BDF) in pool ``pool`` (``policy``, ``classes``; :data:`DEFAULT_POOL`: in no
    declared pool), moved from ``was`` (``was_policy``, ``was_classes``), with one audit row (path
    ``(pools)``, operation ``rebalance move``) whose value names ``reason``, and the setting
    :data:`REBALANCE_MOVED` + ``gpu`` (``was -> pool``; dropped by the undo), in the same transaction."""

    gpu: str
    pool: str
    policy: str
    classes: Tuple[str, ...]
    was: str
    was_policy: str
    was_classes: Tuple[str, ...]
    reason: str
    audit_by = AUDIT_NONE          # the row joins the store transaction (run)

    def describe(self, host: object = None) -> str:
        return f"record GPU {self.gpu} in pool {self.pool} (was {self.was}): {self.reason}"

    def run(self, ctx: StepContext) -> object:
        store = ctx.store
        rows = [r for r in store.pool_rows() if r[0] != self.gpu]
        if self.pool != DEFAULT_POOL:
            rows.append((self.gpu, self.pool, self.policy, ",".join(self.classes)))
        with store.transaction() as conn:
            store.replace_pools(conn, rows)
            # which GPUs sit where the reconciler put them (apply and assert say so; apply puts them back)
            store.put_setting(conn, REBALANCE_MOVED + self.gpu, None if self.reason.startswith("undo: ")
                              else f"{self.was} -> {self.pool}")
            store.audit(actor=ctx.actor, operation=f"{OPERATION} {self.gpu}", path=AUDIT_PATH,
                        value=f"GPU {self.gpu}: pool {self.was} -> {self.pool}: {self.reason}", conn=conn)
        ctx.writes += 1
        return None

    def verify(self, ctx: StepContext, result: object) -> None:
        got = next((r[1] for r in ctx.store.pool_rows() if r[0] == self.gpu), DEFAULT_POOL)
        if got != self.pool:
            raise DeviceError(f"GPU {self.gpu}: recorded in pool {got} after recording pool {self.pool}",
                              hint="'vgpuhost audit' shows what changed the pools meanwhile")

    def inverse(self, result: object) -> Optional[Step]:
        return RecordPool(self.gpu, self.was, self.was_policy, self.was_classes, self.pool, self.policy,
                          self.classes, f"undo: {self.reason}")


def plan_move(move: Move, now: Optional[SchedulerState], *, classes: Tuple[str, ...],
              was_policy: str, was_classes: Tuple[str, ...]) -> List[Step]:
    """The steps of ``move``: the scheduler set to the new pool's policy when the GPU runs another
    (``now``: its state; None: not known, set it; undone to ``now``), then the pool recorded
    (``classes``: the new pool's; ``was_policy``/``was_classes``: the old pool's, for the undo)."""
    steps: List[Step] = []
    if move.policy and (now is None or now.policy != move.policy):
        steps.append(SetScheduler(PciAddress.parse(move.gpu), SchedulerState(policy=move.policy), now))
    steps.append(RecordPool(move.gpu, move.to_pool, move.policy, tuple(classes), move.from_pool, was_policy,
                            tuple(was_classes), move.reason))
    return steps


__all__ = ["AUDIT_PATH", "OPERATION", "RecordPool", "plan_move"]
