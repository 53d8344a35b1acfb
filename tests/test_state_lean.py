"""The state store's lean open for the qemu hook (issue 17): what importing it costs a fresh process,
and the hook's one write transaction to forget a domain."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vgpuhost.io.state import StateStore

SRC = str(Path(__file__).resolve().parents[1])


def test_a_fresh_process_imports_the_store_without_functools_and_still_caches_statements(tmp_path):
    """From Python 3.11 ``_sqlite3`` imports functools (and collections) for ``lru_cache``: the store
    hands it a stand-in that holds only that, so the hook imports neither; the statement cache works
    (the same statement many times, more distinct ones than the cache holds), and a later ``import
    functools`` gets the real module."""
    code = ("import sys\n"
            f"sys.path.insert(0, {SRC!r})\n"
            "from vgpuhost.io.state import StateStore, sqlite3\n"
            "print(sorted(m for m in ('functools', 'collections', 'keyword', 'reprlib') if m in sys.modules))\n"
            "s = StateStore(sys.argv[1])\n"
            "conn = s._conn()\n"
            "for i in range(300):\n"
            "    assert conn.execute('SELECT %d' % (i % 150)).fetchone() == (i % 150,)\n"
            "with s.transaction() as c:\n"
            "    c.execute(\"INSERT OR REPLACE INTO domains VALUES ('u', 'n', 't')\")\n"
            "print(s.active_domains())\n"
            "import functools\n"
            "print(hasattr(functools, 'partial') and hasattr(functools, 'wraps'))\n")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "{'u': 'n'}", "True"]


def test_a_process_with_functools_already_imported_uses_it(tmp_path):
    code = ("import sys, functools\n"
            f"sys.path.insert(0, {SRC!r})\n"
            "from vgpuhost.io.state import StateStore\n"
            "print(sys.modules['functools'] is functools, StateStore(sys.argv[1]).active_domains())\n")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "True {}\n"), proc.stderr


def test_domain_stopped_with_allocations_forgets_both_and_the_marker(tmp_path):
    store = StateStore(tmp_path)
    me, other = "11111111-2222-4333-8444-000000000001", "11111111-2222-4333-8444-000000000002"
    for u in (me, other):
        store.domain_started(u, "vm")
        with store.transaction() as conn:
            StateStore.put_allocation(conn, (f"dev-{u}", u, None, "0000:81:00.0", "vgpu", "A40-8Q", 8192, 0,
                                             "best-effort", 0))
    assert (tmp_path / "domains" / me).exists()
    store.domain_stopped(me, allocations=True)
    assert store.active_domains() == {other: "vm"}
    assert [r[1] for r in store.allocation_rows()] == [other]
    assert not (tmp_path / "domains" / me).exists() and (tmp_path / "domains" / other).exists()
    store.domain_stopped(other)                 # without: its allocations stay (another caller's business)
    assert [r[1] for r in store.allocation_rows()] == [other]


def test_the_write_ahead_log_stays_bounded_under_one_shot_processes(tmp_path):
    """Processes that open the store alone, commit, and exit without closing (as every qemu hook
    does): the log is checkpointed and started over, not grown on every call (it was: past
    wal_autocheckpoint each later commit checkpointed all of it, and each open read all of it)."""
    from vgpuhost.io.state import WAL_RESET_BYTES
    StateStore(tmp_path).close()
    code = ("import os, sys\n"
            f"sys.path.insert(0, {SRC!r})\n"
            "from vgpuhost.io.state import StateStore\n"
            "store = StateStore(sys.argv[1])\n"
            "conn = store._conn()\n"
            "for i in range(400):\n"
            "    conn.execute(\"INSERT INTO audit (time, actor, operation, path, value, result, errno) \"\n"
            "                 \"VALUES ('t', 'test', 'op', 'p', ?, 'ok', 0)\", ('x' * 200,))\n"
            "sys.stdout.flush()\n"
            "os._exit(0)\n")
    sizes = []
    for _ in range(14):                         # about 5600 frames in all: 22 MB of log if never restarted
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        sizes.append(os.path.getsize(tmp_path / "state.db-wal"))
    assert max(sizes) < 3 * WAL_RESET_BYTES, sizes
    store = StateStore(tmp_path)
    assert store._conn().execute("SELECT count(*) FROM audit").fetchone() == (14 * 400,)


def test_the_checkpoint_at_open_is_skipped_where_the_store_can_only_be_read(tmp_path):
    """The checkpoint at open is an optimisation: on a connection that may only read it fails
    (SQLite: disk I/O error), and the open goes on reading."""
    import sqlite3
    import vgpuhost.io.state as state
    store = StateStore(tmp_path)
    store.domain_started("11111111-2222-4333-8444-000000000001", "vm")
    conn = store._conn()
    for _ in range(300):
        conn.execute("INSERT INTO audit (time, actor, operation, path, value, result, errno) "
                     "VALUES ('t', 'test', 'op', 'p', ?, 'ok', 0)", ("x" * 4000,))
    assert os.path.getsize(tmp_path / "state.db-wal") > state.WAL_RESET_BYTES
    reader = sqlite3.connect(f"file:{store.db}?mode=ro", uri=True, isolation_level=None)
    try:
        store._bound_wal(reader)
        assert reader.execute("SELECT uuid FROM domains").fetchall() == [("11111111-2222-4333-8444-000000000001",)]
    finally:
        reader.close()
        store.close()
