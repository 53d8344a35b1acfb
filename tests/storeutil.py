"""A state store at an older schema version, for the migration tests: the first ``version`` of
:data:`vgpuhost.io.state.MIGRATIONS` applied by hand, as that version of vgpuhost left it."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def store_at_version(db: Path, version: int) -> sqlite3.Connection:
    """``db`` (a new ``state.db``) built by migrations 1..``version`` and marked so; the open connection
    (the caller inserts its old rows, commits and closes)."""
    from vgpuhost.io.state import MIGRATIONS, _statements
    conn = sqlite3.connect(str(db))
    for script in MIGRATIONS[:version]:
        for stmt in _statements(script):
            conn.execute(stmt)
    conn.execute(f"PRAGMA user_version = {int(version)}")
    return conn
