"""The state store is never silently re-initialised (issue 12 #3): damaged,
empty or symlinked ``state.db`` files are refused with a restore hint while
the host has devices vgpuhost may own, and a read-only state dir says so."""

from __future__ import annotations

import os
import sqlite3

from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.model.errors import HostEnvironmentError
from vgpuhost.observe.ownable import devices_vgpuhost_may_own
from vgpuhost.ops.passthrough import prepare
from vgpuhost.ops.vgpu import create

from test_passthrough import GPU, turing


def cli(capsys, host, *argv):
    code = main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _records(host):
    conn = sqlite3.connect(host.state_dir / "state.db")
    try:
        return conn.execute("SELECT count(*) FROM vgpus").fetchone()[0]
    finally:
        conn.close()


def test_empty_state_db_is_refused_while_vgpus_exist(make_host, capsys):
    host = make_host("a40-mdev")
    out = create(host, StateStore(host.state_dir), profile="A40-8Q")
    db = host.state_dir / "state.db"
    for suffix in ("-wal", "-shm"):
        if os.path.exists(str(db) + suffix):
            os.unlink(str(db) + suffix)
    db.write_bytes(b"")                                # what a crashed copy or a full disk leaves
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 2 and err.count("\n") == 1
    assert "empty" in err and f"mdev {out.id}" in err and "restore state.db from a backup" in err
    assert "aside" not in err
    assert db.stat().st_size == 0                      # not re-initialised
    assert devices_vgpuhost_may_own(host) == [f"mdev {out.id}"]   # nothing else was created


def test_empty_state_db_on_a_host_with_nothing_to_own_is_initialised(make_host, capsys):
    host = make_host("a40-mdev")
    host.state_dir.mkdir(parents=True)
    (host.state_dir / "state.db").write_bytes(b"")
    code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 0, err
    assert _records(host) == 1


def test_symlinked_state_db_is_refused(make_host, capsys, tmp_path):
    host = make_host("a40-mdev")
    elsewhere = tmp_path / "elsewhere.db"
    StateStore(tmp_path / "other").close()
    os.replace(tmp_path / "other" / "state.db", elsewhere)
    host.state_dir.mkdir(parents=True)
    os.symlink(elsewhere, host.state_dir / "state.db")
    for argv in (("vgpu", "list"), ("vgpu", "create", "--profile", "A40-8Q")):
        code, _, err = cli(capsys, host, *argv)
        assert code == 2 and "symlink" in err and "aside" not in err, err
    assert os.path.islink(host.state_dir / "state.db")
    assert devices_vgpuhost_may_own(host) == []


def test_corrupt_state_db_is_refused_not_replaced(make_host, capsys):
    host = make_host("turing-consumer")
    host.state_dir.mkdir(parents=True)
    db = host.state_dir / "state.db"
    db.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4080)
    before = db.read_bytes()
    code, _, err = cli(capsys, host, "passthrough", "release", str(GPU))
    assert code == 2 and err.count("\n") == 1 and "aside" not in err, err
    assert db.read_bytes() == before


def test_read_only_state_dir_is_reported_as_read_only(make_host, capsys):
    """A state dir on a read-only file system (statvfs says ST_RDONLY; root ignores modes, so
    the file-system flag is what is simulated) is named as read-only, before anything is touched."""
    from unittest import mock
    host = make_host("a40-mdev")
    StateStore(host.state_dir).close()

    class ReadOnlyFs:
        f_flag = os.ST_RDONLY

    with mock.patch("vgpuhost.io.state.os.statvfs", return_value=ReadOnlyFs()):
        code, _, err = cli(capsys, host, "vgpu", "create", "--profile", "A40-8Q")
    assert code == 2 and "read-only file system" in err and "aside" not in err, err
    assert devices_vgpuhost_may_own(host) == []


def test_read_only_store_message_from_sqlite(make_host):
    from vgpuhost.io.state import store_error
    e = store_error("/x/state.db", sqlite3.OperationalError("attempt to write a readonly database"))
    assert "read-only" in e.message and "aside" not in e.one_line()
    e = store_error("/x/state.db", sqlite3.DatabaseError("file is not a database"))
    assert "damaged" in e.message and "restore state.db from a backup" in e.one_line()


def test_a_busy_locked_or_full_store_is_said_as_such_and_only_damage_asks_for_a_backup(tmp_path):
    """Raw SQLite errors by their result code (the agent's last-resort answer uses the same words): busy or
    locked is transient (exit 5: try again), full and I/O say so, and only SQLITE_CORRUPT/NOTADB say
    'restore state.db from a backup'."""
    from vgpuhost.io.state import store_error
    from vgpuhost.model.errors import TransientError
    db = tmp_path / "state.db"
    holder = sqlite3.connect(str(db), isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    other = sqlite3.connect(str(db), timeout=0, isolation_level=None)
    try:
        other.execute("INSERT INTO t VALUES (1)")
        raise AssertionError("the write was not refused")
    except sqlite3.OperationalError as raw:
        assert raw.sqlite_errorname == "SQLITE_BUSY"
        e = store_error(db, raw)
    holder.execute("ROLLBACK")
    assert isinstance(e, TransientError) and e.exit_code == 5
    assert "is busy: another process holds its lock" in e.message and "try again" in e.hint
    assert "restore" not in e.one_line() and "is damaged" not in e.one_line()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all, " * 100)
    try:
        sqlite3.connect(str(junk)).execute("SELECT * FROM sqlite_master").fetchall()
        raise AssertionError("the junk file was read")
    except sqlite3.DatabaseError as raw:
        assert raw.sqlite_errorname == "SQLITE_NOTADB"
        e = store_error(junk, raw)
    assert "damaged" in e.message and "restore state.db from a backup" in e.one_line()
    e = store_error(db, sqlite3.OperationalError("database or disk is full"))
    assert "its disk is full" in e.message and "free space" in e.hint and "restore" not in e.one_line()
    e = store_error(db, sqlite3.OperationalError("disk I/O error"))
    assert "I/O error" in e.message and "restore" not in e.one_line()
    e = store_error(db, sqlite3.OperationalError("database table is locked"))
    assert isinstance(e, TransientError) and "restore" not in e.one_line()


# --- connections and fork() --------------------------------------------------

def _open_files(folder) -> list:
    """Files under ``folder`` this process holds open (other tests' stores may be open too)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder) + os.sep):
            out.append(target)
    return out


def test_a_dropped_store_closes_its_database_at_once(tmp_path):
    """sqlite3 connections sit in a reference cycle; a store that is dropped must not leave its
    connection open until a garbage collection (a fork() meanwhile carries it into the children,
    and the parent's late close then deletes the WAL they commit to: lost rows)."""
    import gc
    gc.disable()
    try:
        store = StateStore(tmp_path)
        store.audit(actor="t", operation="o", path="/p", value="v")
        assert _open_files(tmp_path)
        del store
        assert _open_files(tmp_path) == []
    finally:
        gc.enable()


def test_a_forked_child_opens_its_own_connection(tmp_path):
    """A store used in a child of fork() never uses (nor closes) the parent's connection."""
    store = StateStore(tmp_path)
    parent_conn = store._conn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: never returns
        ok = 0
        try:
            store.audit(actor="child", operation="o", path="/p", value="v")
            ok = int(store._conn() is not parent_conn)
            store.close()
            del store
        finally:
            os.write(w, str(ok).encode())
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 8) == b"1" and status == 0
    os.close(r)
    store.audit(actor="parent", operation="o", path="/p", value="v")
    assert [a.actor for a in StateStore(tmp_path).audit_rows()] == ["child", "parent"]


# ---------------------------------------------------------------------------
# connections kept between the agent's request threads (StateStore.pooled)

def test_pooled_connections_pass_between_threads_and_never_carry_a_transaction(tmp_path):
    """Each request thread of the agent gets a connection the store kept from the one before (not one
    opened and its schema read again); a transaction an error left open is rolled back before the next
    thread gets it, so nothing of it is committed; the thread's own connection is its own again after."""
    import threading
    store = StateStore(tmp_path / "state", create=True)
    own = store._conn()
    seen = []

    def request(fail: bool):
        with store.pooled():
            conn = store._conn()
            seen.append(conn)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO audit (time, actor, operation, path, value, result) "
                         "VALUES ('t', 'a', 'op', 'p', 'v', 'ok')")
            if fail:
                raise RuntimeError("cut short")
            conn.execute("COMMIT")

    def run(fail: bool):
        try:
            request(fail)
        except RuntimeError:
            pass
    for fail in (True, False, True):
        t = threading.Thread(target=run, args=(fail,))
        t.start()
        t.join(30)
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2] and seen[0] is not own
    assert [r.operation for r in store.audit_rows()] == ["op"]           # the two cut short: rolled back
    assert store._conn() is own
    with store.pooled():                                                  # this thread's turn: the same one
        assert store._conn() is seen[0]
    assert store._conn() is own
    store.close()
    assert store._pool == []
