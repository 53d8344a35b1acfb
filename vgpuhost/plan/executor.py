"""The ONE Executor: runs typed steps, audits them, verifies them, undoes them on failure.

Owns: :class:`StepContext` (what a step runs against: the audited
:class:`~vgpuhost.io.sysfs.Sysfs`, the NVML backend opened lazily, the
state store, who acts and what for) and :class:`Executor` (run a sequence
of :class:`~vgpuhost.plan.steps.Step`: execute, write one audit row, verify
by reading back, and on failure undo the completed steps in reverse order
and re-raise).  Must not: decide which steps to take (planners do, as pure
functions) or spell kernel paths (steps do, through :class:`HostRoot`).

Audit rows: a step whose ``audit_by`` is ``"fs"`` is recorded by the
audited Sysfs, one row per kernel or configuration-file write (path
relative to the host root, value, errno) exactly as each write happens; a
step whose ``audit_by`` is ``"executor"`` (NVML calls) gets one row from
:meth:`Step.audit_row` written here, as intent before the call and outcome
after it (the errno and NVML error name of a failure); a read-only check
(``None``) writes none.

Journal seam (issue 12): ``Executor(journal=J)`` calls ``J.begin(executor,
steps)`` before the first step of each :meth:`Executor.run`,
``J.step_done(executor, index, step)`` after each step ran and verified,
and ``J.end(executor, error)`` when the run finishes (``error`` None on
success, else the exception after the undo).  :class:`vgpuhost.plan.journal.Journal`
is the one journal: an operation opens its entry before its first write and
points its executors at it.

Audit rows of Sysfs writes are written as intent, then outcome: the row is
inserted before the write (``pending``) and its outcome recorded after it
(:meth:`~vgpuhost.io.state.StateStore.audit_outcome`), so kill -9 during a
write cannot lose the row.
"""

from __future__ import annotations

from ..io.hostroot import HostRoot
from ..io.sysfs import Sysfs

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Callable, Iterable, List, Mapping, Optional, Tuple
    from ..io.nvml import NvmlBackend
    from ..io.state import StateStore
    from .steps import Step


class StepContext:
    """What a step runs against.

    ``fs``: a Sysfs whose every write (kernel file or configuration file)
    becomes one audit row; ``backend``: the NVML backend, opened on first
    use (:func:`vgpuhost.io.backends.open_backend`, HostEnvironmentError exit 2
    when NVML cannot be had); ``store``: the state store or None (no audit
    rows then); ``actor`` who acts (``cli uid=0 pid=42``, ``hook <domain>``);
    ``operation`` what for (``passthrough prepare 0000:01:00.0``);
    ``writes``: audited changes made so far (successful or not);
    ``bindings``: ``{step type: run it}`` for steps an operation above runs
    (a layout's composite steps, bound by :mod:`vgpuhost.ops.layout`), looked
    up by :meth:`bound`.
    """

    def __init__(self, host: HostRoot, store: Optional[StateStore], *, actor: str, operation: str,
                 backend: Optional[NvmlBackend] = None, bindings: Optional[Mapping[type, Callable]] = None):
        self.host = host
        self.bindings = dict(bindings or {})
        self.store = store
        self.actor = actor
        self.operation = operation
        self.writes = 0
        self._backend = backend
        self._pending: Optional[int] = None
        self.fs = Sysfs(host, observers=[self._audit_write], intents=[self._intent_write])

    @property
    def backend(self) -> NvmlBackend:
        if self._backend is None:
            from ..io.backends import open_backend
            self._backend = open_backend(self.host)
        return self._backend

    def bound(self, step: Step) -> Callable:
        """The callable bound to ``step``'s type (or the nearest base type).

        Raises VgpuhostError (a bug: exit 4 territory) when nothing is bound to it.
        """
        for cls in type(step).__mro__:
            fn = self.bindings.get(cls)
            if fn is not None:
                return fn
        from ..model.errors import VgpuhostError
        raise VgpuhostError(f"step {type(step).__name__} has no binding in this executor")

    def audit(self, path: str, value: str, err: int = 0) -> None:
        """One audit row (``path`` as the row names it: ``/sys/...``, ``nvml:<call>``)."""
        self.writes += 1
        if self.store is not None:
            self.store.audit(actor=self.actor, operation=self.operation, path=path, value=value, err=err)

    def intent(self, path: str, value: str) -> Optional[int]:
        """An executor-audited write's row, inserted before the write (result ``pending``); its id
        (None without a store).  :meth:`outcome` completes it."""
        if self.store is None:
            return None
        return self.store.audit_intent(actor=self.actor, operation=self.operation, path=path, value=value)

    def outcome(self, row: Optional[int], err: int = 0, detail: str = "") -> None:
        """How the write of :meth:`intent`'s row ``row`` ended (``detail`` is appended to its value)."""
        self.writes += 1
        if row is not None:
            self.store.audit_outcome(row, err, detail)

    def _intent_write(self, path, value: str) -> None:
        """A write's audit row, inserted before the write (result ``pending``): a process killed
        during the write still leaves its row (issue 12)."""
        if self.store is not None:
            self._pending = self.store.audit_intent(actor=self.actor, operation=self.operation,
                                                    path=self.host.relative(path),
                                                    value=value.rstrip("\n") or "\\n")

    def _audit_write(self, path, value: str, err: int) -> None:
        """The write's outcome, completing the row :meth:`_intent_write` inserted."""
        if self._pending is not None:
            self.writes += 1
            self.store.audit_outcome(self._pending, err)
            self._pending = None
            return
        self.audit(self.host.relative(path), value.rstrip("\n") or "\\n", err)


class Executor:
    """Runs steps in order with an audit row each; verifies; undoes on failure.

    ``Executor(host, store, actor=..., operation=..., backend=None, journal=None, bindings=None)``
    (``bindings``: see :class:`StepContext`).
    ``fs``, ``writes``, ``host``, ``store``, ``actor`` and ``operation`` are
    the context's.  After a failed :meth:`run`, ``failed`` is the step
    that failed, ``undo_ok`` says whether every completed step was undone
    (True also when there was nothing to undo) and ``undo_errors`` holds
    the errors the undo met.
    """

    def __init__(self, host: HostRoot, store: Optional[StateStore], *, actor: str, operation: str,
                 backend: Optional[NvmlBackend] = None, journal=None,
                 bindings: Optional[Mapping[type, Callable]] = None):
        self.ctx = StepContext(host, store, actor=actor, operation=operation, backend=backend, bindings=bindings)
        self.journal = journal
        self.failed: Optional[Step] = None
        self.undo_ok = True
        self.undo_errors: List[BaseException] = []

    host = property(lambda self: self.ctx.host)
    store = property(lambda self: self.ctx.store)
    actor = property(lambda self: self.ctx.actor)
    operation = property(lambda self: self.ctx.operation)
    fs = property(lambda self: self.ctx.fs)
    writes = property(lambda self: self.ctx.writes)

    @property
    def backend(self) -> NvmlBackend:
        return self.ctx.backend

    def run(self, steps: Iterable[Step], *, undo: bool = True) -> List[object]:
        """Run ``steps`` in order; returns each step's result (what :meth:`Step.run` returned).

        For each step: run it, write its audit row, verify it (read back).
        The first failure (an exception from run or verify) stops the run:
        with ``undo`` the completed steps' inverses run in reverse order
        (the failing step's too when it ran but did not verify), then the
        exception is re-raised unchanged.  Steps without an inverse (the
        sysfs binding steps, whose rollback their planner derives from a
        fresh read) are skipped by the undo.  KeyboardInterrupt and other
        BaseExceptions undo too.
        """
        steps = list(steps)
        self.failed, self.undo_ok, self.undo_errors = None, True, []
        if self.journal is not None:
            self.journal.begin(self, steps)
        done: List[Tuple[Step, object]] = []
        results: List[object] = []
        try:
            for i, step in enumerate(steps):
                self.failed = step
                result = self._execute(step)
                try:
                    step.verify(self.ctx, result)
                except BaseException:
                    done.append((step, result))
                    raise
                done.append((step, result))
                results.append(result)
                self.failed = None
                if self.journal is not None:
                    self.journal.step_done(self, i, step)
        except BaseException as e:
            if undo:
                self._undo(done)
            if self.journal is not None:
                self.journal.end(self, e)
            raise
        if self.journal is not None:
            self.journal.end(self, None)
        return results

    def _execute(self, step: Step) -> object:
        """Run one step and write its audit row (executor-audited steps)."""
        if step.audit_by != "executor":
            return step.run(self.ctx)
        path, value = step.audit_row(self.ctx)
        row = self.ctx.intent(path, value)          # before the call: kill -9 during it keeps the row
        try:
            result = step.run(self.ctx)
        except Exception as e:
            suffix, err = step.audit_failure(e)
            self.ctx.outcome(row, err, suffix)
            raise
        finally:
            if step.moves_offers:
                # after the call, made or failed: a snapshot read before it is stale from here on (the
                # agent's, whichever process made the change: trial 8 T1)
                from ..io.changes import note_driver_change
                note_driver_change(self.ctx.host, str(getattr(step, "gpu", None) or ""))
        self.ctx.outcome(row, 0)
        return result

    def _undo(self, done: List[Tuple[Step, object]]) -> None:
        for step, result in reversed(done):
            inverse = step.inverse(result)
            if inverse is None:
                continue
            try:
                self._execute(inverse)
            except Exception as e:      # keep undoing the rest; report what failed
                self.undo_ok = False
                self.undo_errors.append(e)


def describe(host: HostRoot, steps: Iterable[Step]) -> List[str]:
    """What a dry run prints: one line per step."""
    return [s.describe(host) for s in steps]


__all__ = ["StepContext", "Executor", "describe"]
