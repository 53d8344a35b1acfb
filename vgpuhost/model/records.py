"""The records the state store keeps: audit rows, intent-journal entries, passthrough and vGPU records.

Owns: the value types of :mod:`vgpuhost.io.state`'s tables, one field per
column in the table's order (the store builds them from its rows and writes
them back field by field), so policy, planning and output read them without
importing the store.  Must not: touch files or SQLite; import anything heavy
at module level (the qemu hook uses them: :func:`vgpuhost.model.values.record`,
not ``dataclasses``).

Tables and columns: :mod:`vgpuhost.io.state`'s schema (its module docstring).
"""

from __future__ import annotations

from .kinds import Owner
from .values import record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Optional


@record(frozen=True)
class AuditRow:
    id: int
    time: str
    actor: str
    operation: str
    path: str
    value: str
    result: str
    errno: int

    def _replace_result(self, result: str) -> "AuditRow":
        return AuditRow(self.id, self.time, self.actor, self.operation, self.path, self.value, result, self.errno)


@record(frozen=True)
class JournalEntry:
    """One intent-journal entry (see the module docstring, version 5)."""

    id: int
    kind: str
    operation: str
    owner: str
    actor: str
    gpu: str
    iommu_group: Optional[int]
    devices: list
    steps: list
    done: int
    state: str
    pid: int
    opened: str
    closed: Optional[str]
    outcome: Optional[str]


@record(frozen=True)
class PassthroughRecord:
    bdf: str
    iommu_group: Optional[int]
    gpu: str
    original_driver: Optional[str]
    original_override: Optional[str]
    position: int
    time: str
    persisted: bool
    owner: str = Owner.MANUAL


@record(frozen=True)
class VgpuRecord:
    id: str
    backend: str
    gpu: str
    parent: str
    type_id: str
    type_name: str
    owner: str
    anti_affinity: Optional[str]
    params: Optional[str]
    persisted: bool
    time: str
    pool: Optional[str] = None      # claimed from this pool owner (``layout``); None: the owner's own
