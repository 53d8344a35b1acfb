"""The state store: vgpuhost's memory of what it did, in SQLite.

Owns: every SQL statement.  One database file ``state.db`` in the state dir
(``--state-dir``, default ``<root>/var/lib/vgpuhost``), WAL mode, a busy
timeout so parallel processes queue instead of failing, a schema versioned
by ``PRAGMA user_version`` with forward-only migrations, one transaction per
operation (:meth:`StateStore.transaction`), and an append-only audit log
(triggers refuse UPDATE and DELETE).  Must not: touch sysfs or decide
anything.

Tables (version 1):
- ``audit``: one row per sysfs or config write: time (UTC ISO 8601),
  actor, operation, path (as the kernel names it), value, result (``ok`` or
  the errno name), errno.
- ``passthrough``: one row per PCI function vgpuhost bound to vfio-pci:
  bdf, iommu group, the GPU it moved with, its original driver and
  ``driver_override``, the order it was bound in, time, persisted flag.

Version 3 adds ``seen_types``: the vGPU types each GPU has listed (id,
name, framebuffer MiB), so names still resolve when a vendor-VFIO GPU is
full and lists none.

Version 4 adds ``passthrough.owner`` (a domain UUID, or ``manual`` for
``vgpuhost passthrough prepare``) and ``domains``: the domains the qemu hook
saw start (``prepare begin``) and not yet release (``release end``); devices
their owners hold are in use and never touched by plan/apply.

Version 5 adds tenancy (issue 13): ``tenants`` (name, default QoS class,
isolation, guaranteed ``g_*`` and burst ``b_*`` limits for vGPUs,
framebuffer MiB, MIG compute slices and passthrough GPUs (NULL: no limit),
allowed series, labels, avoid and prefer labels), ``allocations`` (one row
per device admission let a domain hold: device id, owner, tenant, GPU,
kind, profile, framebuffer MiB, MIG slices, QoS class, burst flag),
``pools`` (GPU -> pool name, scheduler policy, QoS classes served) and
``settings`` (key -> value, e.g. ``openstack_tenants``).

Version 6 adds metering (:mod:`vgpuhost.ops.metering`): ``usage_hourly``,
one row per UTC hour, device and domain with allocation, SM/encoder/decoder
busy seconds and framebuffer peak (the billing record); ``meter_cursor``,
the last allocation and sample time (microseconds) per device, so a
restarted sampler neither loses nor counts twice; ``meter_gaps``, spans
with no utilisation samples; ``meter_state`` (``last_tick_us``).

Version 7 adds the intent journal and audit outcomes:
- ``journal``: one row per device operation (passthrough prepare/release,
  vGPU create/remove), written before its first write: kind, operation
  text, owner, actor, GPU and IOMMU group, the devices as JSON (functions
  with their original driver and ``driver_override``; a vGPU with its id,
  parent and type, ``creating`` before its create write), the planned
  steps as JSON, how many steps completed, state (``open`` until the
  operation ends; then ``closed``, ``rolled-back`` or ``finished`` by
  reconcile), the pid, open and close times and an outcome line.
- ``audit_outcome``: a device write's audit row is inserted *before* the
  write (result ``pending``) and its outcome (``ok`` or the errno name)
  here after it, so a write cut off by kill -9 still has its row.
  :meth:`StateStore.audit_rows` joins them; a row with no outcome reads
  ``interrupted`` once no live process owns it.

Version 8 adds ``vgpus.pool``: for a vGPU a domain claimed from a pool of
pre-created ones (a layout's, at the hook's ``prepare begin``), the pool
owner it goes back to at ``release end`` (NULL: the domain's own vGPU).

Version 9 adds ``audit_outcome.detail``: what a failed write written as
intent adds to its row's value (an NVML call's error name, `` -> NVMLError_InUse``).

Version 10 puts the tenant in the key of ``usage_hourly`` (hour, device,
domain, tenant): a domain that passes to another tenant within an hour
leaves the first tenant's usage billed to it.  Rows a version-9 store holds
keep their tenant.

Version 11 adds ``bindings`` (issue 28): the operator's binding of a domain
(UUID) to a tenant and, optionally, a QoS class (NULL: the tenant's), who
bound it and when.  Domains holding allocations of a known tenant at the
upgrade are bound to it once, each with an audit row.

Version 12 adds billing (issue 32, :mod:`vgpuhost.ops.billing`): ``bills``, one
row per issued period (``2026-11``) with its time, actor, the SHA-256 of the
price sheet it was priced with and the bill document (JSON) as issued; and
``bill_adjustments``, the late corrections of an issued bill (tenant, amount
as decimal text, reason, actor, time, the audit row that records it).  Both
refuse UPDATE and DELETE (triggers): an issued bill never changes.

Version 13 adds ``gpu_health`` (issue 27, :mod:`vgpuhost.ops.health`): one row
per GPU taken out of service (BDF): the reason (one line), its source (``io``
for EIO/ENODEV from a device write or read, ``nvml`` for GPU_IS_LOST or a
critical Xid, ``pci`` for a device gone from the tree, ``operator`` for a
cordon by hand), the time, and whether it was cordoned by hand.  A GPU with
no row is in service; uncordon deletes the row (each change audited).

Version 16 (trial 9 of billing): ``bills`` and ``bill_adjustments`` also refuse an
INSERT of a period or id they hold (SQLite's REPLACE deletes without firing DELETE
triggers); ``usage_hourly``'s key adds kind, GPU and profile, so a device resized or
moved within an hour keeps each part's seconds under what it was; ``tenant_guarantees``,
the append-only history of each tenant's guaranteed vGPUs, MIG slices and passthrough
GPUs (a row per ``tenants`` insert, update or delete, written by triggers; the upgrade
seeds each tenant's guarantee as in force since its last change, ``tenants.time``: the
guarantee before it is not known, so nothing reserved is owed for those hours, never more
than was in force); ``meter_state`` ``first_tick_us``, the sampler's first reading (a trigger
on the first ``last_tick_us``; the upgrade seeds it from the oldest rollup hour).

Version 17 (trial 10 of the capacity reconciler): ``admission_refusals``, one row per start
admission weighed and refused (:meth:`StateStore.audit_refusal`, written in the transaction of its
``(admission)`` audit row, keyed by that row's id): the domain's UUID, the device, the refusal code,
the profile asked, the QoS class and tenant admission used ("" for none).  The capacity reconciler's
demand is read from these columns only, never from the audit row's value, which echoes tenant-written
text (the domain's name); the domain makes a retried start count once.

Version 2 adds ``vgpus``: one row per vGPU vgpuhost created: id (mdev UUID,
or the VF's BDF on vendor VFIO), backend, GPU, parent, type id and name,
owner (a domain UUID or ``manual``), anti-affinity key, vgpu_params,
persisted flag, time.
"""

from __future__ import annotations

import errno as _errno
import os
import time as _time



def _import_sqlite3():
    """The C module the ``sqlite3`` package wraps, itself (or the package where there is no split).

    The package adds only the DB-API date constructors and datetime adapters (this store writes
    times as text) and imports datetime and collections for them, 1.5 ms of every qemu hook
    process's start (measured 2026-12-01: ``python -I -S -c 'import sqlite3'`` 11.3 ms, ``import
    _sqlite3`` 9.8 ms, ``pass`` 6.5 ms).  Same classes, exceptions and functions; a process that
    imports ``sqlite3`` too shares them.

    From Python 3.11 the C module's initialisation imports :mod:`functools` for one function,
    ``lru_cache`` (each connection's statement cache), and with it collections, keyword,
    operator, reprlib and types: about 2 ms of every qemu hook process (``python -X importtime``,
    the minimum over 10 hook runs, 2026-12-01).  Where nothing has imported functools yet (the
    hook; any process that imported :mod:`threading` has, so no other Python thread can be
    importing meanwhile), a stand-in module that holds only ``lru_cache``, built on the same C
    cache (``_functools._lru_cache_wrapper``, what ``functools.lru_cache`` returns), is in
    ``sys.modules`` while the C module initialises, and is taken out at once: a later ``import
    functools`` gets the real one.  Any failure with the stand-in imports the module plainly.
    """
    import sys
    if "functools" in sys.modules or "_sqlite3" in sys.modules:
        try:
            import _sqlite3
        except ImportError:         # an interpreter without the split: the package
            import sqlite3 as _sqlite3
        return _sqlite3
    import _functools

    def lru_cache(maxsize=128, typed=False):
        def decorate(function):
            return _functools._lru_cache_wrapper(function, maxsize, typed, tuple)
        return decorate

    stand_in = type(sys)("functools", "vgpuhost's stand-in while _sqlite3 initialises (io/state.py)")
    stand_in.lru_cache = lru_cache
    sys.modules["functools"] = stand_in
    try:
        import _sqlite3
    except ImportError:             # no split (the package imports more than lru_cache): plainly
        _sqlite3 = None
    except Exception:               # a C module that wants more of functools: plainly
        sys.modules.pop("_sqlite3", None)
        _sqlite3 = None
    finally:
        if sys.modules.get("functools") is stand_in:
            del sys.modules["functools"]
    if _sqlite3 is None:
        try:
            import _sqlite3
        except ImportError:
            import sqlite3 as _sqlite3
    return _sqlite3


sqlite3 = _import_sqlite3()
from _thread import _local as _thread_local     # threading.local itself, without importing threading (the hook)
from _thread import allocate_lock as _allocate_lock

from ..model.errors import HostEnvironmentError, RefusedError, TransientError
from ..model.records import AuditRow, JournalEntry, PassthroughRecord, VgpuRecord
from .hostroot import plain_path

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from pathlib import Path
    from typing import Callable, Dict, List, Optional, Sequence, Tuple

    from ..model.usage import UsageRow

DB_NAME = "state.db"
BUSY_TIMEOUT_MS = 60_000
#: the write-ahead log's size (bytes) above which an open checkpoints it first (see :meth:`StateStore._open`)
WAL_RESET_BYTES = 1 << 20
#: what a damaged or unreachable store raises (callers above io/ catch this, never sqlite3 itself)
StoreError = sqlite3.Error

MIGRATIONS: Sequence[str] = (
    # 1: audit log and passthrough records
    """
    CREATE TABLE audit (
        id        INTEGER PRIMARY KEY AUTOINCREMENT,
        time      TEXT NOT NULL,
        actor     TEXT NOT NULL,
        operation TEXT NOT NULL,
        path      TEXT NOT NULL,
        value     TEXT NOT NULL,
        result    TEXT NOT NULL,
        errno     INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX audit_time ON audit(time);
    CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit
        BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
    CREATE TRIGGER audit_no_delete BEFORE DELETE ON audit
        BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
    CREATE TABLE passthrough (
        bdf               TEXT PRIMARY KEY,
        iommu_group       INTEGER,
        gpu               TEXT NOT NULL,
        original_driver   TEXT,
        original_override TEXT,
        position          INTEGER NOT NULL,
        time              TEXT NOT NULL,
        persisted         INTEGER NOT NULL DEFAULT 0
    );
    """,
    # 2: vGPUs vgpuhost created, with their owners
    """
    CREATE TABLE vgpus (
        id            TEXT PRIMARY KEY,
        backend       TEXT NOT NULL,
        gpu           TEXT NOT NULL,
        parent        TEXT NOT NULL,
        type_id       TEXT NOT NULL,
        type_name     TEXT NOT NULL,
        owner         TEXT NOT NULL,
        anti_affinity TEXT,
        params        TEXT,
        persisted     INTEGER NOT NULL DEFAULT 0,
        time          TEXT NOT NULL
    );
    CREATE INDEX vgpus_owner ON vgpus(owner);
    CREATE INDEX vgpus_gpu ON vgpus(gpu);
    """,
    # 3: vGPU types seen per GPU (a full vendor-VFIO GPU lists none in sysfs)
    """
    CREATE TABLE seen_types (
        gpu             TEXT NOT NULL,
        type_id         TEXT NOT NULL,
        name            TEXT NOT NULL,
        framebuffer_mib INTEGER,
        PRIMARY KEY (gpu, type_id)
    );
    """,
    # 4: who holds a passed-through group, and which domains the hook started
    """
    ALTER TABLE passthrough ADD COLUMN owner TEXT NOT NULL DEFAULT 'manual';
    CREATE TABLE domains (
        uuid   TEXT PRIMARY KEY,
        name   TEXT NOT NULL,
        since  TEXT NOT NULL
    );
    """,
    # 5: tenants with quotas, the allocations admission made, GPU pools, settings
    """
    CREATE TABLE tenants (
        name       TEXT PRIMARY KEY COLLATE NOCASE,
        qos        TEXT NOT NULL,
        isolation  TEXT NOT NULL,
        g_vgpus    INTEGER, b_vgpus INTEGER,
        g_fb_mib   INTEGER, b_fb_mib INTEGER,
        g_mig      INTEGER, b_mig INTEGER,
        g_pt       INTEGER, b_pt INTEGER,
        series     TEXT NOT NULL DEFAULT '',
        labels     TEXT NOT NULL DEFAULT '',
        avoid      TEXT NOT NULL DEFAULT '',
        prefer     TEXT NOT NULL DEFAULT '',
        time       TEXT NOT NULL
    );
    CREATE TABLE allocations (
        device          TEXT PRIMARY KEY,
        owner           TEXT NOT NULL,
        tenant          TEXT,
        gpu             TEXT NOT NULL,
        kind            TEXT NOT NULL,
        profile         TEXT NOT NULL DEFAULT '',
        framebuffer_mib INTEGER NOT NULL DEFAULT 0,
        mig_slices      INTEGER NOT NULL DEFAULT 0,
        qos             TEXT NOT NULL,
        burst           INTEGER NOT NULL DEFAULT 0,
        time            TEXT NOT NULL
    );
    CREATE INDEX allocations_owner ON allocations(owner);
    CREATE INDEX allocations_tenant ON allocations(tenant);
    CREATE TABLE pools (
        gpu     TEXT PRIMARY KEY,
        pool    TEXT NOT NULL,
        policy  TEXT NOT NULL,
        classes TEXT NOT NULL
    );
    CREATE TABLE settings (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    """,
    # 6: metering (issue 14): hourly usage rollups, the sampler's cursors, gaps
    """
    CREATE TABLE usage_hourly (
        hour           TEXT NOT NULL,
        device         TEXT NOT NULL,
        domain_uuid    TEXT NOT NULL,
        kind           TEXT NOT NULL,
        gpu            TEXT NOT NULL,
        profile        TEXT NOT NULL,
        domain         TEXT NOT NULL,
        tenant         TEXT NOT NULL,
        qos            TEXT NOT NULL,
        alloc_s        REAL NOT NULL DEFAULT 0,
        sm_busy_s      REAL NOT NULL DEFAULT 0,
        enc_busy_s     REAL NOT NULL DEFAULT 0,
        dec_busy_s     REAL NOT NULL DEFAULT 0,
        fb_peak_bytes  INTEGER NOT NULL DEFAULT 0,
        fb_total_bytes INTEGER NOT NULL DEFAULT 0,
        samples        INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (hour, device, domain_uuid)
    );
    CREATE INDEX usage_hourly_tenant ON usage_hourly(tenant, hour);
    CREATE TABLE meter_cursor (
        device      TEXT PRIMARY KEY,
        domain_uuid TEXT NOT NULL,
        alloc_us    INTEGER NOT NULL,
        sample_us   INTEGER NOT NULL
    );
    CREATE TABLE meter_gaps (
        id       INTEGER PRIMARY KEY AUTOINCREMENT,
        start    TEXT NOT NULL,
        end      TEXT NOT NULL,
        device   TEXT NOT NULL,
        seconds  REAL NOT NULL,
        reason   TEXT NOT NULL
    );
    CREATE TABLE meter_state (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    """,
    # 7: the intent journal of device operations, and audit outcomes (audit rows are written as intent)
    """
    CREATE TABLE journal (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        kind        TEXT NOT NULL,
        operation   TEXT NOT NULL,
        owner       TEXT NOT NULL,
        actor       TEXT NOT NULL,
        gpu         TEXT NOT NULL,
        iommu_group INTEGER,
        devices     TEXT NOT NULL,
        steps       TEXT NOT NULL,
        done        INTEGER NOT NULL DEFAULT 0,
        state       TEXT NOT NULL DEFAULT 'open',
        pid         INTEGER NOT NULL,
        opened      TEXT NOT NULL,
        closed      TEXT,
        outcome     TEXT
    );
    CREATE INDEX journal_state ON journal(state);
    CREATE TABLE audit_outcome (
        audit_id INTEGER PRIMARY KEY REFERENCES audit(id),
        result   TEXT NOT NULL,
        errno    INTEGER NOT NULL DEFAULT 0
    );
    CREATE TRIGGER audit_outcome_no_update BEFORE UPDATE ON audit_outcome
        BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
    CREATE TRIGGER audit_outcome_no_delete BEFORE DELETE ON audit_outcome
        BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
    """,
    # 8: the pool a domain's vGPU was claimed from (given back, not removed, at release)
    """
    ALTER TABLE vgpus ADD COLUMN pool TEXT;
    """,
    # 9: what a failed write written as intent said (an NVML call's error name)
    """
    ALTER TABLE audit_outcome ADD COLUMN detail TEXT NOT NULL DEFAULT '';
    """,
    # 10: the hourly rollups keep each tenant's usage apart (the tenant joins the key)
    """
    CREATE TABLE usage_hourly_v10 (
        hour           TEXT NOT NULL,
        device         TEXT NOT NULL,
        domain_uuid    TEXT NOT NULL,
        kind           TEXT NOT NULL,
        gpu            TEXT NOT NULL,
        profile        TEXT NOT NULL,
        domain         TEXT NOT NULL,
        tenant         TEXT NOT NULL,
        qos            TEXT NOT NULL,
        alloc_s        REAL NOT NULL DEFAULT 0,
        sm_busy_s      REAL NOT NULL DEFAULT 0,
        enc_busy_s     REAL NOT NULL DEFAULT 0,
        dec_busy_s     REAL NOT NULL DEFAULT 0,
        fb_peak_bytes  INTEGER NOT NULL DEFAULT 0,
        fb_total_bytes INTEGER NOT NULL DEFAULT 0,
        samples        INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (hour, device, domain_uuid, tenant)
    );
    INSERT INTO usage_hourly_v10 SELECT hour, device, domain_uuid, kind, gpu, profile, domain, tenant, qos,
        alloc_s, sm_busy_s, enc_busy_s, dec_busy_s, fb_peak_bytes, fb_total_bytes, samples FROM usage_hourly;
    DROP TABLE usage_hourly;
    ALTER TABLE usage_hourly_v10 RENAME TO usage_hourly;
    CREATE INDEX usage_hourly_tenant ON usage_hourly(tenant, hour);
    """,
    # 11: the operator's tenant bindings (issue 28); domains already holding a known tenant's allocations
    # are bound to it once, audited (the upgrade path, docs/guide/tenancy.md "Trust model")
    """
    CREATE TABLE bindings (
        domain   TEXT PRIMARY KEY,
        tenant   TEXT NOT NULL COLLATE NOCASE,
        qos      TEXT,
        bound_by TEXT NOT NULL,
        time     TEXT NOT NULL
    );
    CREATE INDEX bindings_tenant ON bindings(tenant);
    INSERT OR IGNORE INTO bindings (domain, tenant, qos, bound_by, time)
        SELECT a.owner, t.name, NULL, 'upgrade (schema 11)', strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now')
        FROM allocations a JOIN tenants t ON t.name = a.tenant
        WHERE length(a.owner) = 36 AND a.owner LIKE '________-____-____-____-____________'
        GROUP BY a.owner;
    INSERT INTO audit (time, actor, operation, path, value, result, errno)
        SELECT time, bound_by, 'tenant bind ' || domain, '(tenants)',
               'tenant=' || tenant || ' (from the allocations the domain held at the upgrade)', 'ok', 0
        FROM bindings;
    """,
    # 12: issued bills (never changed) and their audited adjustments (issue 32)
    """
    CREATE TABLE bills (
        period        TEXT PRIMARY KEY,
        issued        TEXT NOT NULL,
        actor         TEXT NOT NULL,
        prices_sha256 TEXT NOT NULL,
        document      TEXT NOT NULL
    );
    CREATE TRIGGER bills_no_update BEFORE UPDATE ON bills
        BEGIN SELECT RAISE(ABORT, 'an issued bill never changes: adjust it'); END;
    CREATE TRIGGER bills_no_delete BEFORE DELETE ON bills
        BEGIN SELECT RAISE(ABORT, 'an issued bill never changes: adjust it'); END;
    CREATE TABLE bill_adjustments (
        id       INTEGER PRIMARY KEY AUTOINCREMENT,
        period   TEXT NOT NULL REFERENCES bills(period),
        tenant   TEXT NOT NULL,
        amount   TEXT NOT NULL,
        reason   TEXT NOT NULL,
        actor    TEXT NOT NULL,
        time     TEXT NOT NULL,
        audit_id INTEGER NOT NULL REFERENCES audit(id)
    );
    CREATE INDEX bill_adjustments_period ON bill_adjustments(period);
    CREATE TRIGGER bill_adjustments_no_update BEFORE UPDATE ON bill_adjustments
        BEGIN SELECT RAISE(ABORT, 'adjustments are append-only'); END;
    CREATE TRIGGER bill_adjustments_no_delete BEFORE DELETE ON bill_adjustments
        BEGIN SELECT RAISE(ABORT, 'adjustments are append-only'); END;
    """,
    # 13: GPUs out of service (issue 27): unhealthy, or cordoned by hand
    """
    CREATE TABLE gpu_health (
        gpu       TEXT PRIMARY KEY,
        reason    TEXT NOT NULL,
        source    TEXT NOT NULL,
        time      TEXT NOT NULL,
        by_hand   INTEGER NOT NULL DEFAULT 0
    );
    """,
    # 14: devices reserved for an incoming live migration (issue 27): the qemu hook's ``migrate begin``
    # reserves, ``prepare begin`` makes the device and drops the row, ``release end`` or an expiry frees it
    """
    CREATE TABLE reservations (
        device    TEXT PRIMARY KEY,
        owner     TEXT NOT NULL,
        name      TEXT NOT NULL,
        gpu       TEXT NOT NULL,
        kind      TEXT NOT NULL,
        profile   TEXT NOT NULL,
        expires   TEXT NOT NULL,
        time      TEXT NOT NULL
    );
    CREATE INDEX reservations_owner ON reservations(owner);
    """,
    # 15: the tenant and QoS class the destination's admission trusted for a reservation (trial 7 retest
    # N1): a domain's tenant may come from the OpenStack mapping (its XML's <nova:project>), which no
    # binding records, so admission counts the reservation for the tenant stored with it
    """
    ALTER TABLE reservations ADD COLUMN tenant TEXT;
    ALTER TABLE reservations ADD COLUMN qos TEXT;
    """,
    # 16: billing fixes of trial 9: issued bills and adjustments refuse REPLACE (F11); the rollups keep the
    # parts of an hour a device spent at another profile, kind or GPU apart (F10); the history of each
    # tenant's guarantee, written by triggers on ``tenants`` (F1); the time metering began (F1)
    """
    CREATE TRIGGER bills_no_replace BEFORE INSERT ON bills
        WHEN EXISTS (SELECT 1 FROM bills WHERE period = NEW.period)
        BEGIN SELECT RAISE(ABORT, 'an issued bill never changes: adjust it'); END;
    CREATE TRIGGER bill_adjustments_no_replace BEFORE INSERT ON bill_adjustments
        WHEN NEW.id IS NOT NULL AND EXISTS (SELECT 1 FROM bill_adjustments WHERE id = NEW.id)
        BEGIN SELECT RAISE(ABORT, 'adjustments are append-only'); END;
    CREATE TABLE usage_hourly_v16 (
        hour           TEXT NOT NULL,
        device         TEXT NOT NULL,
        domain_uuid    TEXT NOT NULL,
        kind           TEXT NOT NULL,
        gpu            TEXT NOT NULL,
        profile        TEXT NOT NULL,
        domain         TEXT NOT NULL,
        tenant         TEXT NOT NULL,
        qos            TEXT NOT NULL,
        alloc_s        REAL NOT NULL DEFAULT 0,
        sm_busy_s      REAL NOT NULL DEFAULT 0,
        enc_busy_s     REAL NOT NULL DEFAULT 0,
        dec_busy_s     REAL NOT NULL DEFAULT 0,
        fb_peak_bytes  INTEGER NOT NULL DEFAULT 0,
        fb_total_bytes INTEGER NOT NULL DEFAULT 0,
        samples        INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (hour, device, domain_uuid, tenant, kind, gpu, profile)
    );
    INSERT INTO usage_hourly_v16 SELECT hour, device, domain_uuid, kind, gpu, profile, domain, tenant, qos,
        alloc_s, sm_busy_s, enc_busy_s, dec_busy_s, fb_peak_bytes, fb_total_bytes, samples FROM usage_hourly;
    DROP TABLE usage_hourly;
    ALTER TABLE usage_hourly_v16 RENAME TO usage_hourly;
    CREATE INDEX usage_hourly_tenant ON usage_hourly(tenant, hour);
    CREATE TABLE tenant_guarantees (
        id               INTEGER PRIMARY KEY AUTOINCREMENT,
        tenant           TEXT NOT NULL COLLATE NOCASE,
        since            TEXT NOT NULL,
        vgpus            INTEGER NOT NULL DEFAULT 0,
        mig_slices       INTEGER NOT NULL DEFAULT 0,
        passthrough_gpus INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX tenant_guarantees_tenant ON tenant_guarantees(tenant, since);
    CREATE TRIGGER tenant_guarantees_no_update BEFORE UPDATE ON tenant_guarantees
        BEGIN SELECT RAISE(ABORT, 'the guarantee history is append-only'); END;
    CREATE TRIGGER tenant_guarantees_no_delete BEFORE DELETE ON tenant_guarantees
        BEGIN SELECT RAISE(ABORT, 'the guarantee history is append-only'); END;
    CREATE TRIGGER tenants_guarantee_insert AFTER INSERT ON tenants
        BEGIN INSERT INTO tenant_guarantees (tenant, since, vgpus, mig_slices, passthrough_gpus)
              VALUES (NEW.name, NEW.time, COALESCE(NEW.g_vgpus, 0), COALESCE(NEW.g_mig, 0), COALESCE(NEW.g_pt, 0));
        END;
    CREATE TRIGGER tenants_guarantee_update AFTER UPDATE ON tenants
        BEGIN INSERT INTO tenant_guarantees (tenant, since, vgpus, mig_slices, passthrough_gpus)
              VALUES (NEW.name, NEW.time, COALESCE(NEW.g_vgpus, 0), COALESCE(NEW.g_mig, 0), COALESCE(NEW.g_pt, 0));
        END;
    CREATE TRIGGER tenants_guarantee_delete AFTER DELETE ON tenants
        BEGIN INSERT INTO tenant_guarantees (tenant, since, vgpus, mig_slices, passthrough_gpus)
              VALUES (OLD.name, strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now'), 0, 0, 0);
        END;
    INSERT INTO tenant_guarantees (tenant, since, vgpus, mig_slices, passthrough_gpus)
        SELECT t.name, t.time, COALESCE(t.g_vgpus, 0), COALESCE(t.g_mig, 0), COALESCE(t.g_pt, 0) FROM tenants t;
    CREATE TRIGGER meter_state_first_tick AFTER INSERT ON meter_state
        WHEN NEW.key = 'last_tick_us' AND NOT EXISTS (SELECT 1 FROM meter_state WHERE key = 'first_tick_us')
        BEGIN INSERT INTO meter_state (key, value) VALUES ('first_tick_us', NEW.value); END;
    INSERT INTO meter_state (key, value)
        SELECT 'first_tick_us', CAST(m AS TEXT) FROM (SELECT MIN(v) AS m FROM (
            SELECT CAST(strftime('%s', substr(MIN(hour), 1, 19)) AS INTEGER) * 1000000 AS v FROM usage_hourly
            UNION ALL SELECT CAST(value AS INTEGER) FROM meter_state WHERE key = 'last_tick_us') WHERE v IS NOT NULL)
        WHERE m IS NOT NULL;
    """,
    # 17: what admission decided for each start it refused (trial 10 F4, F5): the capacity reconciler's
    # demand, in columns admission alone writes (never parsed from an audit row's value, which echoes
    # tenant-written text such as the domain's name), with the domain and device, so a retried start
    # counts once
    """
    CREATE TABLE admission_refusals (
        audit_id    INTEGER PRIMARY KEY,
        domain_uuid TEXT NOT NULL,
        device      TEXT NOT NULL,
        code        TEXT NOT NULL,
        profile     TEXT NOT NULL,
        qos         TEXT NOT NULL,
        tenant      TEXT NOT NULL
    );
    """,
)


def utcnow() -> str:
    """Now as ``2026-11-29T23:40:01.123456+00:00`` (UTC, microseconds; what
    ``datetime.now(timezone.utc).isoformat(timespec="microseconds")`` gives, without importing
    :mod:`datetime` on the qemu hook's path)."""
    ns = _time.time_ns()
    secs, rest = divmod(ns, 1_000_000_000)
    return _time.strftime("%Y-%m-%dT%H:%M:%S", _time.gmtime(secs)) + f".{rest // 1000:06d}+00:00"


#: the result of an audit row written before its write, until the outcome is recorded
PENDING = "pending"
#: the result shown for a write whose process died before recording the outcome
INTERRUPTED = "interrupted"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


MARKER_DIR = "domains"
_UUID_CHARS = frozenset("0123456789abcdef-")


def _is_uuid(u: str) -> bool:
    """A lower-case 8-4-4-4-12 UUID (safe as a file name), without importing ``re``."""
    return (len(u) == 36 and set(u) <= _UUID_CHARS
            and [len(p) for p in u.split("-")] == [8, 4, 4, 4, 12])


def _touch(folder: str, uuid: str) -> None:
    """Create the marker ``folder/uuid``.

    Not synced, as durable as the row it goes with: the store commits with ``synchronous = NORMAL``
    (write-ahead log, no sync per commit), so both survive the process being killed; after a power
    loss no domain runs, and the boot unit's ``reconcile --forget-domains`` releases what the
    domains recorded as running held and forgets them, markers too (a marker without its row only
    makes that domain's next ``release end`` start Python for nothing).  A sync of the folder cost
    each domain start 0.4-1 ms of waiting on the disk (measured 2026-12-01).
    """
    if not _is_uuid(uuid):
        return
    fd = os.open(os.path.join(folder, uuid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:    # who is starting it: a start killed half-way leaves a marker whose process is gone (reconcile)
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)


class StateStore:
    """The SQLite state store in one state directory.

    Raises HostEnvironmentError when the directory cannot be created or the
    database opened, and when the database is newer than this vgpuhost.
    """

    def __init__(self, state_dir: "str | os.PathLike[str]", *, create: bool = True,
                 owned: "Optional[Callable[[], List[str]]]" = None):
        """Open (``create``: and create) the store.  ``create=False`` with no
        database yet gives an empty in-memory store, so read-only commands
        never write to the host.

        The store is never re-initialised behind the operator's back: a
        ``state.db`` that is a symlink, not a regular file, or not an SQLite
        database raises HostEnvironmentError naming a restore, and so does a
        zero-length one while ``owned()`` (the devices on the host vgpuhost
        may own: functions on vfio-pci, vGPUs) names any; with none, a
        zero-length file (a creation a crash cut short) is initialised.  A
        new store is built under a temporary name and linked into place, so
        no process ever sees a half-created one.  A state dir that cannot
        be written is reported as read-only.
        """
        #: the state dir and the database as strings (``state_dir`` and ``path`` are their ``Path``\ s)
        self.dir = plain_path(state_dir)
        self.db = os.path.join(self.dir, DB_NAME)
        self._local = _thread_local()
        self._pool: list = []                   # idle connections kept for pooled() (another thread's next)
        self._pool_lock = _allocate_lock()
        self._memory = False
        self._owned = owned
        self._check_dir()
        if not create and not self._exists():
            self._memory = True
        else:
            self._check_file(create)
            if create and not os.path.lexists(self.db):
                self._create()
        self._migrate()

    @property
    def state_dir(self) -> "Path":
        """The state dir (``dir``: the same as a string)."""
        from pathlib import Path
        return Path(self.dir)

    @property
    def path(self) -> "Path":
        """``<state dir>/state.db`` (``db``: the same as a string)."""
        from pathlib import Path
        return Path(self.db)

    @property
    def absent(self) -> bool:
        """True when no ``state.db`` exists (a read-only open gave an empty in-memory store)."""
        return self._memory

    def _exists(self) -> bool:
        """Whether ``state.db`` exists; HostEnvironmentError (naming the state dir) when this process
        may not look: a store it cannot read must never read as an empty one."""
        try:
            os.lstat(self.db)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            raise unreadable(self.dir, e, "state dir") from None

    def _check_dir(self) -> None:
        """Refuse a state dir that is not a directory (a regular file, or under one)."""
        import stat as _stat
        try:
            st = os.stat(self.dir)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            st = None
        except OSError:
            return                  # permissions and the like: the store's own checks say what
        if st is None or not _stat.S_ISDIR(st.st_mode):
            raise HostEnvironmentError(f"the state dir {self.dir!r} is not a directory",
                                       hint="pass --state-dir DIR naming the directory that holds state.db "
                                            "(default <root>/var/lib/vgpuhost)")

    def _check_file(self, create: bool) -> None:
        """Refuse a state.db that is not plainly ours (see :meth:`__init__`)."""
        import stat as _stat
        where = self.db
        try:
            st = os.lstat(self.db)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise unreadable(self.dir, e, "state dir") from None
        if st is not None and _stat.S_ISREG(st.st_mode):
            # asked, never opened: closing any descriptor of the file would drop the POSIX locks that
            # SQLite connections of this process hold on it
            eff = os.access in os.supports_effective_ids
            if not os.access(self.db, os.R_OK, effective_ids=eff):
                raise unreadable(self.db, PermissionError(_errno.EACCES, os.strerror(_errno.EACCES)),
                                 "state store") from None
        if st is not None:
            if _stat.S_ISLNK(st.st_mode):
                raise HostEnvironmentError(
                    f"the state store {where!r} is a symlink; vgpuhost refuses to follow it",
                    hint=f"replace it with the database itself (restore it from a backup), or pass "
                         f"--state-dir DIR naming the directory that holds it; {_KEEP}")
            if not _stat.S_ISREG(st.st_mode):
                raise HostEnvironmentError(f"the state store {where!r} is not a regular file",
                                           hint=f"restore state.db from a backup; {_KEEP}")
            if st.st_size == 0:
                held = self._owned() if self._owned is not None else ["(unknown: not checked)"]
                if held:
                    raise HostEnvironmentError(
                        f"the state store {where!r} is empty (zero length) while the host has devices "
                        f"vgpuhost may own: {', '.join(held[:6])}{' ...' if len(held) > 6 else ''}",
                        hint=f"restore state.db from a backup; {_KEEP}")
                if create:
                    self._check_writable()
                    self._create(replace=True)
        if create:
            self._check_writable()

    def _check_writable(self) -> None:
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        except OSError as e:
            if e.errno == _errno.EROFS:
                raise HostEnvironmentError(f"the state dir {self.dir!r} is on a read-only file "
                                           "system", hint="remount it read-write, or pass --state-dir DIR "
                                                          "to a writable directory") from None
            raise HostEnvironmentError(f"cannot create the state dir {self.dir!r}: {e.strerror}",
                                       hint="pass --state-dir DIR to a writable directory") from None
        why = _read_only_reason(self.dir)
        if why:
            raise HostEnvironmentError(f"the state dir {self.dir!r} is read-only ({why})",
                                       hint="vgpuhost records every device it changes there: make it writable "
                                            "(remount read-write, fix its owner or mode) or run as root")

    def _create(self, replace: bool = False) -> None:
        """Build a new store under a temporary name, then link it into place (atomic)."""
        tmp = os.path.join(self.dir, f".{DB_NAME}.{os.getpid()}.new")
        try:
            _unlink_quiet(tmp)
            conn = sqlite3.connect(tmp, isolation_level=None)
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("BEGIN IMMEDIATE")
                for script in MIGRATIONS:
                    for stmt in _statements(script):
                        conn.execute(stmt)
                conn.execute(f"PRAGMA user_version = {len(MIGRATIONS)}")
                conn.execute("COMMIT")
            finally:
                conn.close()
            if replace:
                os.replace(tmp, self.db)
            else:
                try:
                    os.link(tmp, self.db)     # fails when another process linked its store first
                except FileExistsError:
                    pass
        except (OSError, sqlite3.Error) as e:
            raise HostEnvironmentError(f"cannot create the state store {self.db!r}: {e}",
                                       hint="check the state dir's permissions and free space") from None
        finally:
            _unlink_quiet(tmp)
            for suffix in ("-wal", "-shm"):
                _unlink_quiet(tmp + suffix)

    # --- connection ------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) != os.getpid():
            _abandon(conn)          # opened before a fork(): the parent's, never used (nor closed) here
            conn = None
        if conn is None:
            try:
                conn = _retry_locked(self._open)
            except sqlite3.Error as e:
                raise store_error(self.db, e) from None
            self._local.conn = conn
            self._local.pid = os.getpid()
        return conn

    def pooled(self) -> "_Pooled":
        """``with store.pooled():`` this thread's calls on the store use a connection the store keeps
        between threads (at most :data:`POOL_MAX` idle), not one opened for the thread: for a server
        that answers each request on a new thread (the agent), which otherwise opened a connection and
        read the schema again on every request (0.45 ms of CPU a request, measured 2026-12-07).  At
        the block's end the thread's own connection (if any) is its again, and the pooled one goes
        back idle, an open transaction rolled back first (an error inside a ``transaction()`` rolls
        back already).  A store without a database file (in memory) uses the thread's own."""
        return _Pooled(self)

    def _open(self, shared: bool = False) -> sqlite3.Connection:
        target = ":memory:" if self._memory else self.db
        conn = sqlite3.connect(target, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=not shared)
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            if not self._memory:
                self._bound_wal(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _bound_wal(self, conn: sqlite3.Connection) -> None:
        """Keep the write-ahead log from growing without end under one-shot processes (the qemu hook).

        SQLite starts writing its log from the beginning again only when the writer knows the last
        checkpoint copied all of it; that knowledge lives in the ``-shm`` index, which the first
        connection to open the database rebuilds (reading every frame in the log) and rebuilds
        without it.  A hook process opens the database alone, writes, and exits without closing
        (no checkpoint at close): the commit that passes ``wal_autocheckpoint`` (1000 pages)
        checkpoints, but the next process starts over not knowing it, so the log grew on every
        hook call, every later open read all of it, and every commit checkpointed all of it again
        (measured 2026-12-01 on a bench store: a 3.9 MB log cost each open 2.2 ms and each
        commit 1-4 ms, and the log kept growing).  So an open that finds the log above
        :data:`WAL_RESET_BYTES` checkpoints it (PASSIVE: it never waits for another connection;
        when one is reading, the next open tries again); this connection's next write then starts
        the log from the beginning, and ``journal_size_limit`` truncates the file there.
        """
        try:
            size = os.stat(self.db + "-wal").st_size
        except OSError:
            return
        conn.execute(f"PRAGMA journal_size_limit = {WAL_RESET_BYTES}")
        if size > WAL_RESET_BYTES:
            try:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error:
                pass            # a store this process may only read (it raises there): its readers pay, as before

    def close(self) -> None:
        """Close this thread's connection and the idle pooled ones (one a fork() carried over is left
        alone, see :func:`_abandon`)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            if getattr(self._local, "pid", None) == os.getpid():
                conn.close()
            else:
                _abandon(conn)
        pool = getattr(self, "_pool", None)
        while pool:
            pid, idle = pool.pop()
            if pid == os.getpid():
                idle.close()
            else:
                _abandon(idle)

    def __del__(self) -> None:
        # Close the connection as soon as the store is dropped.  Python's sqlite3 connection sits in
        # a reference cycle (its statement cache), so without this it stays open until a garbage
        # collection pass: a process that forks meanwhile (multiprocessing, the crash tests) carries
        # it into its children, and when the parent's collector finally closes it, SQLite there sees
        # no other process holding the database (the children's locks sit on the carried-over
        # connection's bookkeeping, not in the kernel), checkpoints and deletes the WAL the children
        # are still committing to: their later writes (audit rows, passthrough records) are lost.
        try:
            self.close()
        except Exception:       # interpreter shutdown, a half-built store: nothing to close
            pass

    def transaction(self) -> "_Transaction":
        """One write transaction: ``with store.transaction() as conn:`` (BEGIN IMMEDIATE ... COMMIT,
        ROLLBACK on error)."""
        return _Transaction(self._conn())

    def _migrate(self) -> None:
        try:
            current = _retry_locked(lambda: self._conn().execute("PRAGMA user_version").fetchone()[0])
        except sqlite3.Error as e:
            raise store_error(self.db, e) from None
        if current == len(MIGRATIONS):
            return          # current (the common case: every hook call): no write lock taken
        with self.transaction() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version < 0:
                raise HostEnvironmentError(f"the state store {self.db!r} has an invalid schema "
                                           f"version {version}", hint=f"restore state.db from a backup; {_KEEP}")
            if version > len(MIGRATIONS):
                raise HostEnvironmentError(
                    f"the state store {self.db!r} has schema version {version}, newer than this "
                    f"vgpuhost knows ({len(MIGRATIONS)})", hint="upgrade vgpuhost")
            for n in range(version, len(MIGRATIONS)):
                for stmt in _statements(MIGRATIONS[n]):
                    conn.execute(stmt)
                conn.execute(f"PRAGMA user_version = {n + 1}")

    @property
    def schema_version(self) -> int:
        return self._conn().execute("PRAGMA user_version").fetchone()[0]

    # --- audit -------------------------------------------------------------
    def audit(self, *, actor: str, operation: str, path: str, value: str, err: int = 0,
              result: Optional[str] = None, conn: Optional[sqlite3.Connection] = None) -> int:
        """Append one audit row; its id.

        Device writes happen outside store transactions (under a per-group or
        per-GPU file lock instead), so each row commits at once and a write
        that happened is never lost with a failed operation.  Inside a
        transaction (``conn``: the one :meth:`transaction` gave; the row joins it
        without it too, on this thread's connection) the row commits or is lost
        with the change it records.
        """
        if result is None:      # a decision (admission) names its own result: admitted / refused
            result = "ok" if err == 0 else _errno.errorcode.get(err, str(err))
        return (conn or self._conn()).execute(_AUDIT_INSERT, (utcnow(), actor, operation, path, value, result,
                                                              err)).lastrowid

    def audit_intent(self, *, actor: str, operation: str, path: str, value: str) -> int:
        """Append the audit row of a write about to happen (result ``pending``); its id.

        Committed at once, before the write: a process killed during the
        write still leaves its row.  :meth:`audit_outcome` completes it.
        """
        return self._conn().execute(_AUDIT_INSERT, (utcnow(), actor, operation, path, value,
                                                    PENDING, 0)).lastrowid

    def audit_outcome(self, audit_id: int, err: int = 0, detail: str = "", *, result: Optional[str] = None,
                      conn: Optional[sqlite3.Connection] = None) -> None:
        """Record how the write of audit row ``audit_id`` ended (0 = ok, else its errno); ``detail``
        (`` -> NVMLError_InUse``) is appended to the row's value as :meth:`audit_rows` shows it.
        ``result``: the outcome's result instead of the errno's (an admission made void by the
        start it admitted failing: ``refused`` / ``failed`` / ``interrupted``)."""
        if result is None:
            result = "ok" if err == 0 else _errno.errorcode.get(err, str(err))
        (conn or self._conn()).execute("INSERT OR IGNORE INTO audit_outcome (audit_id, result, errno, detail) "
                                       "VALUES (?, ?, ?, ?)", (audit_id, result, err, detail))

    def admission_row(self, device: str, conn: Optional[sqlite3.Connection] = None) -> Optional[int]:
        """The id of the newest audit row that admitted ``device`` (path ``(admission)``, result
        ``admitted``, operation ``admission NAME DEVICE``) and has no outcome yet; None without one."""
        tail = " " + device
        row = (conn or self._conn()).execute(
            "SELECT a.id FROM audit a LEFT JOIN audit_outcome o ON o.audit_id = a.id WHERE a.path = '(admission)' "
            "AND a.result = 'admitted' AND o.audit_id IS NULL AND substr(a.operation, -?) = ? "
            "ORDER BY a.id DESC LIMIT 1", (len(tail), tail)).fetchone()
        return row[0] if row else None

    def audit_refusal(self, *, actor: str, operation: str, value: str, domain_uuid: str, device: str, code: str,
                      profile: str, qos: str, tenant: Optional[str]) -> int:
        """Append the ``(admission)`` audit row of a start admission refused (result ``refused``) and, in
        the same transaction, what admission decided (table ``admission_refusals``, version 17): the
        domain's UUID, the ``device`` refused, the refusal ``code``, the ``profile`` asked, the ``qos``
        class and ``tenant`` (None: none) admission weighed.  The capacity reconciler reads those columns
        (:meth:`refusal_records`), never the row's value.  The audit row's id."""
        def write(conn: sqlite3.Connection) -> int:
            audit_id = self.audit(actor=actor, operation=operation, path="(admission)", value=value,
                                  result="refused", conn=conn)
            conn.execute("INSERT INTO admission_refusals (audit_id, domain_uuid, device, code, profile, qos, tenant) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)", (audit_id, domain_uuid, device, code, profile, qos,
                                                           tenant or ""))
            return audit_id

        conn = self._conn()
        if conn.in_transaction:         # the caller's transaction: both rows join it
            return write(conn)
        with self.transaction() as conn:
            return write(conn)

    def refusal_records(self, since: Optional[str] = None) -> List[tuple]:
        """``(audit_id, time, domain_uuid, device, code, profile, qos, tenant)`` of each start admission
        refused (:meth:`audit_refusal`), at or after ``since`` (ISO 8601 UTC) when given, oldest first;
        ``time``: its audit row's; ``tenant`` "" for none."""
        # the audit rows of the window by their time index, each refusal by its key: never the whole
        # table (300,000 old refusals: 0.65 s a reconciler pass, under the host lock, trial 10 retest N3)
        sql = ("SELECT r.audit_id, a.time, r.domain_uuid, r.device, r.code, r.profile, r.qos, r.tenant "
               "FROM audit a CROSS JOIN admission_refusals r ON r.audit_id = a.id")
        args: tuple = ()
        if since:
            sql += " WHERE a.time >= ?"
            args = (since,)
        return [tuple(r) for r in self._conn().execute(sql + " ORDER BY r.audit_id", args)]

    def audit_rows(self, since: Optional[str] = None) -> List[AuditRow]:
        """Audit rows in order, those at or after ``since`` (ISO 8601 UTC) when given.

        A row written as intent shows its outcome; one whose process died
        before the outcome was written (no open journal entry of a live
        process explains it) reads ``interrupted``.
        """
        sql = ("SELECT a.id, a.time, a.actor, a.operation, a.path, a.value || COALESCE(o.detail, ''), "
               "COALESCE(o.result, a.result), "
               "COALESCE(o.errno, a.errno) FROM audit a LEFT JOIN audit_outcome o ON o.audit_id = a.id")
        args: tuple = ()
        if since:
            sql += " WHERE a.time >= ?"
            args = (since,)
        rows = [AuditRow(*r) for r in self._conn().execute(sql + " ORDER BY a.id", args)]
        if any(r.result == PENDING for r in rows):
            live = {e.actor for e in self.journal_entries(open_only=True) if pid_alive(e.pid)}
            rows = [r._replace_result(INTERRUPTED) if r.result == PENDING and r.actor not in live else r
                    for r in rows]
        return rows

    # --- the intent journal ------------------------------------------------------
    def journal_open(self, *, kind: str, operation: str, owner: str, actor: str, gpu: str,
                     group: Optional[int], devices: list, steps: Sequence[str]) -> int:
        """Open a journal entry before an operation's first write; its id (committed at once)."""
        with self.transaction() as conn:
            return conn.execute(
                "INSERT INTO journal (kind, operation, owner, actor, gpu, iommu_group, devices, steps, pid, opened) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (kind, operation, owner, actor, gpu, group, json_text(devices, sort_keys=True),
                 json_text(list(steps)), os.getpid(), utcnow())).lastrowid

    def journal_update(self, entry_id: int, *, devices: Optional[list] = None, done: Optional[int] = None) -> None:
        """Record progress: the devices as they now stand, and/or the number of completed steps."""
        if devices is not None:
            self._conn().execute("UPDATE journal SET devices = ? WHERE id = ?",
                                 (json_text(devices, sort_keys=True), entry_id))
        if done is not None:
            self._conn().execute("UPDATE journal SET done = ? WHERE id = ?", (done, entry_id))

    def journal_close(self, entry_id: int, *, state: str = "closed", outcome: str = "ok",
                      conn: Optional[sqlite3.Connection] = None) -> None:
        """Close an entry (``closed``: the operation ended; ``finished`` / ``rolled-back``: by reconcile)."""
        (conn or self._conn()).execute("UPDATE journal SET state = ?, closed = ?, outcome = ? WHERE id = ?",
                                       (state, utcnow(), outcome[:500], entry_id))

    def journal_entries(self, *, open_only: bool = False, gpu: Optional[str] = None) -> List[JournalEntry]:
        """Journal entries, oldest first (``open_only``: those still open; ``gpu``: touching that GPU)."""
        sql = ("SELECT id, kind, operation, owner, actor, gpu, iommu_group, devices, steps, done, state, pid, "
               "opened, closed, outcome FROM journal")
        where, args = [], []
        if open_only:
            where.append("state = 'open'")
        if gpu is not None:
            where.append("gpu = ?")
            args.append(gpu)
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._conn().execute(sql + " ORDER BY id", args).fetchall()
        if not rows:
            return []           # the usual case on a device operation's path: json is not imported
        import json
        out = [JournalEntry(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]), json.loads(r[8]),
                            r[9], r[10], r[11], r[12], r[13], r[14])
               for r in rows]
        for e in out:
            for d in e.devices if isinstance(e.devices, list) else [None]:
                if not isinstance(d, dict):
                    _check_id("journal", "device", None)
                for key, what in (("bdf", "PCI address"), ("gpu", "GPU"), ("parent", "parent")):
                    if d.get(key) is not None:
                        _check_id("journal", what, d[key])
                if d.get("id") is not None:
                    _check_id("journal", "vGPU id", d["id"], uuid=True)
                if d.get("type_id") is not None:
                    _check_id("journal", "type id", d["type_id"], token=True)
        return out

    # --- passthrough records ------------------------------------------------
    def passthrough_records(self, conn: Optional[sqlite3.Connection] = None,
                            gpu: Optional[str] = None) -> List[PassthroughRecord]:
        c = conn or self._conn()
        sql = ("SELECT bdf, iommu_group, gpu, original_driver, original_override, position, time, persisted, "
               "owner FROM passthrough")
        args: tuple = ()
        if gpu:
            sql += " WHERE gpu = ?"
            args = (gpu,)
        out = [PassthroughRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], bool(r[7]), r[8])
               for r in c.execute(sql + " ORDER BY gpu, position", args)]
        for rec in out:
            _check_id("passthrough", "PCI address", rec.bdf)
            _check_id("passthrough", "GPU", rec.gpu)
        return out

    @staticmethod
    def put_passthrough(conn: sqlite3.Connection, rec: PassthroughRecord) -> None:
        conn.execute("INSERT OR REPLACE INTO passthrough (bdf, iommu_group, gpu, original_driver, "
                     "original_override, position, time, persisted, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (rec.bdf, rec.iommu_group, rec.gpu, rec.original_driver, rec.original_override,
                      rec.position, rec.time, int(rec.persisted), rec.owner))

    # --- domains the hook started ---------------------------------------------
    # Each row of ``domains`` has a marker file ``<state dir>/domains/<uuid>``.
    # The hook's sh dispatcher reads it at ``release end`` for a domain whose
    # XML no longer names vgpuhost's metadata: no marker, nothing held, and no
    # Python starts (docs/performance.md).  The marker is made before the row
    # is committed and removed after the row is deleted, so a crash can leave
    # a marker without a row (one Python start too many) but never the
    # reverse.  A state dir without the marker folder (a store from before the
    # markers) makes the dispatcher run the handler for every release; the
    # folder is made, with a marker per recorded domain, at the next change.
    def _markers(self) -> "Optional[str]":
        if self._memory:
            return None
        d = os.path.join(self.dir, MARKER_DIR)
        if not os.path.isdir(d):
            tmp = d + f".{os.getpid()}.new"
            try:
                os.mkdir(tmp, 0o700)
                for u in self.active_domains():
                    _touch(tmp, u)
                os.rename(tmp, d)              # the folder appears whole, or not at all
            except FileExistsError:
                pass                           # another process made it
            except OSError:
                return None                    # no markers: the dispatcher keeps running the handler
        return d

    def domain_started(self, uuid: str, name: str) -> None:
        """Record that domain ``uuid`` is starting (the hook's ``prepare begin``); upsert."""
        d = self._markers()
        if d is not None:
            try:
                _touch(d, uuid)
            except OSError as e:
                raise HostEnvironmentError(f"cannot write the domain marker in {d!r}: {e.strerror}",
                                           hint="free space or fix the state dir's owner and mode, then retry") from None
        with self.transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO domains VALUES (?, ?, ?)", (uuid, name, utcnow()))

    def domain_record(self, uuid: str) -> "Optional[Tuple[str, str, Optional[int]]]":
        """``(name, since, starter pid)`` of domain ``uuid`` as recorded running (:meth:`domain_started`;
        the pid :meth:`domain_starter` reads, None where its marker names none), None when it is not."""
        row = self._conn().execute("SELECT name, since FROM domains WHERE uuid = ?", (uuid,)).fetchone()
        return None if row is None else (row[0], row[1], self.domain_starter(uuid))

    def domain_restore(self, uuid: str, record: "Tuple[str, str, Optional[int]]") -> None:
        """Put domain ``uuid``'s record back as :meth:`domain_record` read it (its row's name and time, its
        marker's pid), after a start of a domain recorded running was refused or failed: such a start
        changes nothing (the qemu hook's refusal, trial 10 B1: the refused start had renamed the row)."""
        name, since, starter = record
        d = self._markers()
        if d is not None and _is_uuid(uuid):
            fd = os.open(os.path.join(d, uuid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                if starter is not None:
                    os.write(fd, f"{starter}\n".encode())
            finally:
                os.close(fd)
        with self.transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO domains VALUES (?, ?, ?)", (uuid, name, since))

    def domain_stopped(self, uuid: str, *, allocations: bool = False) -> None:
        """Forget domain ``uuid`` (the hook's ``release end``); no-op when unknown.  ``allocations``:
        its allocation rows go too, in the same transaction (one write transaction per release, not two);
        the marker last."""
        with self.transaction() as conn:
            conn.execute("DELETE FROM domains WHERE uuid = ?", (uuid,))
            if allocations:
                self.delete_allocations(conn, owner=uuid)
        d = self._markers()
        if d is not None and _is_uuid(uuid):
            try:
                os.unlink(os.path.join(d, uuid))
            except FileNotFoundError:
                pass

    def domain_starter(self, uuid: str) -> Optional[int]:
        """The process ID that recorded domain ``uuid`` started (its marker's content: the qemu hook's
        handler, or the agent that ran its start), None when there is no marker or it names none (a
        marker written before markers held one)."""
        if self._memory or not _is_uuid(uuid):
            return None
        try:
            with open(os.path.join(self.dir, MARKER_DIR, uuid), "rb") as f:
                text = f.read(32).decode("ascii", "replace").strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def active_domains(self) -> Dict[str, str]:
        """``{domain UUID: name}`` of domains started through the hook and not yet released."""
        return dict(self._conn().execute("SELECT uuid, name FROM domains ORDER BY uuid"))

    def domain_starts(self) -> Dict[str, str]:
        """``{domain UUID: since}`` (UTC ISO) of the domains :meth:`active_domains` lists: a new
        ``since`` is a new start."""
        return dict(self._conn().execute("SELECT uuid, since FROM domains ORDER BY uuid"))

    def remember_types(self, rows: Sequence[tuple]) -> None:
        """Record ``(gpu, type_id, name, framebuffer_mib)`` rows seen in sysfs (upsert).

        Only rows the store does not hold as they are are written: every vGPU
        create (each qemu hook ``prepare begin``) passes the whole host's types,
        which are almost always known already, and a read costs less than a
        write transaction.
        """
        if not rows:
            return
        known = set(self.seen_types())
        new = [tuple(r) for r in rows if tuple(r) not in known]
        if not new:
            return
        with self.transaction() as conn:
            conn.executemany("INSERT OR REPLACE INTO seen_types VALUES (?, ?, ?, ?)", new)

    def seen_types(self, *, gpu: Optional[str] = None) -> List[tuple]:
        """All ``(gpu, type_id, name, framebuffer_mib)`` rows, or those of one GPU (BDF)."""
        sql = "SELECT gpu, type_id, name, framebuffer_mib FROM seen_types"
        if gpu is not None:
            return list(self._conn().execute(sql + " WHERE gpu = ?", (gpu,)))
        return list(self._conn().execute(sql))

    def vgpu_records(self, *, owner: Optional[str] = None, gpu: Optional[str] = None,
                     vgpu_id: Optional[str] = None) -> List[VgpuRecord]:
        """Recorded vGPUs, filtered by owner, GPU (BDF) and/or id, oldest first."""
        return vgpu_records(self._conn(), owner=owner, gpu=gpu, vgpu_id=vgpu_id)

    # --- GPU health (version 13) -----------------------------------------------------
    def gpu_health_rows(self, gpu: Optional[str] = None) -> List[tuple]:
        """``(gpu BDF, reason, source, time ISO 8601 UTC, by_hand bool)`` of each GPU out of service (or of
        ``gpu`` only), sorted by BDF.  One query; a store older than version 13 is migrated on open."""
        sql = "SELECT gpu, reason, source, time, by_hand FROM gpu_health"
        rows = (self._conn().execute(sql + " WHERE gpu = ?", (gpu,)) if gpu is not None
                else self._conn().execute(sql + " ORDER BY gpu"))
        return [(r[0], r[1], r[2], r[3], bool(r[4])) for r in rows]

    @staticmethod
    def put_gpu_health(conn: sqlite3.Connection, gpu: str, reason: str, source: str, by_hand: bool) -> None:
        """Record ``gpu`` out of service (replacing its row) inside the caller's transaction; the time is now."""
        conn.execute("INSERT OR REPLACE INTO gpu_health (gpu, reason, source, time, by_hand) VALUES (?, ?, ?, ?, ?)",
                     (gpu, reason, source, utcnow(), int(by_hand)))

    @staticmethod
    def cordon_gpu_health(conn: sqlite3.Connection, gpu: str) -> int:
        """Mark ``gpu``'s row cordoned by hand (its reason, source and time kept) inside the caller's
        transaction; how many rows changed (0 or 1)."""
        return conn.execute("UPDATE gpu_health SET by_hand = 1 WHERE gpu = ?", (gpu,)).rowcount

    @staticmethod
    def delete_gpu_health(conn: sqlite3.Connection, gpu: str) -> int:
        """Put ``gpu`` back in service inside the caller's transaction; how many rows went (0 or 1)."""
        return conn.execute("DELETE FROM gpu_health WHERE gpu = ?", (gpu,)).rowcount

    # --- reservations for incoming migrations (version 14) ----------------------------------
    def reservation_rows(self, owner: Optional[str] = None) -> List[tuple]:
        """``(device, owner, name, gpu, kind, profile, expires, time, tenant, qos)`` of each device reserved
        for an incoming migration (of ``owner``'s only when given), by device.  ``device``: the mdev UUID or
        the VF's BDF; ``kind``: ``mdev`` or ``vf``; ``expires``/``time``: ISO 8601 UTC; ``tenant``/``qos``:
        the tenant and QoS class the destination's admission trusted for the domain (its binding, or the
        OpenStack mapping of its XML's project; None: no tenant, or tenancy not in use then, or a row made
        before schema 15)."""
        sql = "SELECT device, owner, name, gpu, kind, profile, expires, time, tenant, qos FROM reservations"
        rows = (self._conn().execute(sql + " WHERE owner = ? ORDER BY device", (owner,)) if owner is not None
                else self._conn().execute(sql + " ORDER BY device"))
        return [tuple(r) for r in rows]

    def reserve(self, rows: Sequence[tuple], *, owner: str, actor: str, operation: str,
                tenant: Optional[str] = None, qos: Optional[str] = None) -> None:
        """Record ``(device, name, gpu, kind, profile, expires)`` rows reserved for ``owner``, replacing what
        ``owner`` reserved before, with one audit row each (path ``(reservation)``), in one transaction.
        ``tenant``/``qos``: the tenant and class admission trusted for ``owner`` (stored with each row;
        None: none).  Another owner's expired reservation of a device is taken over (audited ``expired``);
        raises RefusedError when a device is reserved for another owner until later."""
        with self.transaction() as conn:
            conn.execute("DELETE FROM reservations WHERE owner = ?", (owner,))
            now = utcnow()
            for device, name, gpu, kind, profile, expires in rows:
                other = conn.execute("SELECT owner, name, expires FROM reservations WHERE device = ?",
                                     (device,)).fetchone()
                if other is not None and other[2] < now:        # expired: it holds nothing, this one takes over
                    conn.execute("DELETE FROM reservations WHERE device = ?", (device,))
                    self.audit(actor=actor, operation=operation, path="(reservation)",
                               value=f"{kind} {device} reserved for {other[1]} until {other[2]}", result="expired",
                               conn=conn)
                elif other is not None:
                    raise RefusedError(f"{device} is reserved for the incoming migration of domain {other[1]!r}",
                                       hint="let that migration end, or run 'vgpuhost reconcile' once its "
                                            "reservation expired")
                conn.execute("INSERT INTO reservations (device, owner, name, gpu, kind, profile, expires, time, "
                             "tenant, qos) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             (device, owner, name, gpu, kind, profile, expires, utcnow(), tenant, qos))
                whose = f" (tenant {tenant})" if tenant else ""
                self.audit(actor=actor, operation=operation, path="(reservation)",
                           value=f"{kind} {device} on {gpu} ({profile}) reserved for {name}{whose} until {expires}",
                           result="reserved", conn=conn)

    def drop_reservations(self, *, owner: Optional[str] = None, expired_before: Optional[str] = None,
                          actor: str, operation: str, result: str = "released") -> List[tuple]:
        """Delete ``owner``'s reservations, or those expiring before ``expired_before`` (ISO 8601 UTC), with
        one audit row each (result ``result``); the rows deleted, as :meth:`reservation_rows` gives them."""
        sql = "SELECT device, owner, name, gpu, kind, profile, expires, time, tenant, qos FROM reservations"
        probe = ("SELECT 1 FROM reservations WHERE owner = ? LIMIT 1", (owner,)) if owner is not None else \
            ("SELECT 1 FROM reservations WHERE expires < ? LIMIT 1", (expired_before,))
        if self._memory or self._conn().execute(*probe).fetchone() is None:
            return []           # the usual case (every release end): no write transaction
        with self.transaction() as conn:
            if owner is not None:
                rows = conn.execute(sql + " WHERE owner = ? ORDER BY device", (owner,)).fetchall()
            else:
                rows = conn.execute(sql + " WHERE expires < ? ORDER BY device", (expired_before,)).fetchall()
            for r in rows:
                conn.execute("DELETE FROM reservations WHERE device = ?", (r[0],))
                self.audit(actor=actor, operation=operation, path="(reservation)",
                           value=f"{r[4]} {r[0]} on {r[3]} reserved for {r[2]} until {r[6]}", result=result,
                           conn=conn)
        return [tuple(r) for r in rows]

    # --- tenancy (version 5) -------------------------------------------------------
    def tenant_rows(self, name: Optional[str] = None) -> List[tuple]:
        """``tenants`` rows (every column but ``time``, in table order), by name; one name when given."""
        sql = ("SELECT name, qos, isolation, g_vgpus, b_vgpus, g_fb_mib, b_fb_mib, g_mig, b_mig, g_pt, b_pt, "
               "series, labels, avoid, prefer FROM tenants")
        if name is not None:
            return list(self._conn().execute(sql + " WHERE name = ?", (name,)))
        return list(self._conn().execute(sql + " ORDER BY name"))

    @staticmethod
    def put_tenant(conn: sqlite3.Connection, row: Sequence) -> None:
        """Upsert one tenant (``row`` as :meth:`tenant_rows` gives it)."""
        conn.execute("INSERT OR REPLACE INTO tenants (name, qos, isolation, g_vgpus, b_vgpus, g_fb_mib, b_fb_mib, "
                     "g_mig, b_mig, g_pt, b_pt, series, labels, avoid, prefer, time) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (*row, utcnow()))

    @staticmethod
    def delete_tenant(conn: sqlite3.Connection, name: str) -> int:
        return conn.execute("DELETE FROM tenants WHERE name = ?", (name,)).rowcount

    def allocation_rows(self, conn: Optional[sqlite3.Connection] = None, *,
                        owner: Optional[str] = None) -> List[tuple]:
        """``allocations`` rows ``(device, owner, tenant, gpu, kind, profile, framebuffer_mib, mig_slices,
        qos, burst)``, oldest first; one owner's when given."""
        c = conn or self._conn()
        sql = ("SELECT device, owner, tenant, gpu, kind, profile, framebuffer_mib, mig_slices, qos, burst "
               "FROM allocations")
        if owner is not None:
            return list(c.execute(sql + " WHERE owner = ? ORDER BY time, device", (owner,)))
        return list(c.execute(sql + " ORDER BY time, device"))

    @staticmethod
    def put_allocation(conn: sqlite3.Connection, row: Sequence) -> None:
        """Upsert one allocation (``row`` as :meth:`allocation_rows` gives it)."""
        conn.execute("INSERT OR REPLACE INTO allocations (device, owner, tenant, gpu, kind, profile, "
                     "framebuffer_mib, mig_slices, qos, burst, time) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (*row, utcnow()))

    @staticmethod
    def delete_allocations(conn: sqlite3.Connection, *, owner: Optional[str] = None,
                           devices: Sequence[str] = (), of_owner: Optional[str] = None) -> int:
        """Delete one owner's allocations, or the named devices' (``of_owner``: only those rows of the
        named devices that owner ``of_owner`` holds, never another owner's); rows deleted."""
        n = 0
        if owner is not None:
            n += conn.execute("DELETE FROM allocations WHERE owner = ?", (owner,)).rowcount
        for d in devices:
            if of_owner is not None:
                n += conn.execute("DELETE FROM allocations WHERE device = ? AND owner = ?", (d, of_owner)).rowcount
            else:
                n += conn.execute("DELETE FROM allocations WHERE device = ?", (d,)).rowcount
        return n

    def forget_allocations(self, *, owner: Optional[str] = None, devices: Sequence[str] = ()) -> int:
        """:meth:`delete_allocations` in a transaction of its own; rows deleted."""
        with self.transaction() as conn:
            return self.delete_allocations(conn, owner=owner, devices=devices)

    def pool_rows(self) -> List[tuple]:
        """``(gpu, pool, policy, classes)`` rows; ``classes`` comma-separated."""
        return list(self._conn().execute("SELECT gpu, pool, policy, classes FROM pools ORDER BY pool, gpu"))

    @staticmethod
    def replace_pools(conn: sqlite3.Connection, rows: Sequence[tuple]) -> None:
        conn.execute("DELETE FROM pools")
        conn.executemany("INSERT INTO pools (gpu, pool, policy, classes) VALUES (?, ?, ?, ?)", rows)

    # --- bindings (version 11) ----------------------------------------------------
    def binding(self, domain: str) -> Optional[tuple]:
        """The binding of domain ``domain`` (UUID, lower case): ``(domain, tenant, qos or None, bound_by,
        time)``, None when unbound (one primary-key lookup: the qemu hook's path)."""
        return self._conn().execute("SELECT domain, tenant, qos, bound_by, time FROM bindings WHERE domain = ?",
                                    (domain,)).fetchone()

    def binding_rows(self, tenant: Optional[str] = None) -> List[tuple]:
        """Every binding as :meth:`binding` gives it (one tenant's, names in any case, when given), by domain."""
        sql = "SELECT domain, tenant, qos, bound_by, time FROM bindings"
        if tenant is not None:
            return list(self._conn().execute(sql + " WHERE tenant = ? ORDER BY domain", (tenant,)))
        return list(self._conn().execute(sql + " ORDER BY domain"))

    @staticmethod
    def put_binding(conn: sqlite3.Connection, domain: str, tenant: str, qos: Optional[str], bound_by: str) -> None:
        """Upsert the binding of ``domain`` inside the caller's transaction."""
        conn.execute("INSERT OR REPLACE INTO bindings (domain, tenant, qos, bound_by, time) VALUES (?, ?, ?, ?, ?)",
                     (domain, tenant, qos, bound_by, utcnow()))

    @staticmethod
    def delete_binding(conn: sqlite3.Connection, *, domain: Optional[str] = None,
                       tenant: Optional[str] = None) -> int:
        """Drop the binding of ``domain``, or every binding to ``tenant``; rows dropped."""
        if domain is not None:
            return conn.execute("DELETE FROM bindings WHERE domain = ?", (domain,)).rowcount
        return conn.execute("DELETE FROM bindings WHERE tenant = ?", (tenant,)).rowcount

    def tenancy_in_use(self, keys: Sequence[str]) -> bool:
        """One query: does the store hold a tenant, a pool, or one of the settings ``keys``?"""
        marks = ", ".join("?" for _ in keys) or "NULL"
        return bool(self._conn().execute(
            "SELECT EXISTS (SELECT 1 FROM tenants) OR EXISTS (SELECT 1 FROM pools) OR "
            f"EXISTS (SELECT 1 FROM settings WHERE key IN ({marks}))", tuple(keys)).fetchone()[0])

    def setting(self, key: str) -> Optional[str]:
        row = self._conn().execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def settings_under(self, prefix: str) -> Dict[str, str]:
        """``{key: value}`` of the settings whose key starts with ``prefix`` (a literal prefix)."""
        rows = self._conn().execute("SELECT key, value FROM settings WHERE substr(key, 1, ?) = ? ORDER BY key",
                                    (len(prefix), prefix)).fetchall()
        return {k: v for k, v in rows}

    def set_setting(self, key: str, value: Optional[str]) -> None:
        with self.transaction() as conn:
            self.put_setting(conn, key, value)

    @staticmethod
    def put_setting(conn: sqlite3.Connection, key: str, value: Optional[str]) -> None:
        """Set (None: drop) one setting inside the caller's transaction."""
        if value is None:
            conn.execute("DELETE FROM settings WHERE key = ?", (key,))
        else:
            conn.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)", (key, value))

    @staticmethod
    def delete_passthrough(conn: sqlite3.Connection, bdfs: Sequence[str]) -> None:
        conn.executemany("DELETE FROM passthrough WHERE bdf = ?", [(b,) for b in bdfs])


def _vgpu_record(row) -> VgpuRecord:
    rec = VgpuRecord(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8],
                     bool(row[9]), row[10], row[11] if len(row) > 11 else None)
    _check_id("vgpus", "vGPU id", rec.id, uuid=True)
    _check_id("vgpus", "GPU", rec.gpu)
    _check_id("vgpus", "parent", rec.parent)
    _check_id("vgpus", "type id", rec.type_id, token=True)
    return rec


_TOKEN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _check_id(table: str, what: str, value: object, *, uuid: bool = False, token: bool = False) -> None:
    """An id read from the store must be what vgpuhost writes before it becomes part of a sysfs path:
    a PCI address, an mdev UUID (``uuid``) or a type id (``token``: letters, digits, ``_.-``).
    HostEnvironmentError (exit 2) otherwise, never showing the value: the store was changed outside
    vgpuhost, and ``../`` in an id would send a write anywhere."""
    from ..model.values import PciAddress, parse_uuid
    ok = False
    if isinstance(value, str):
        if token:
            ok = 0 < len(value) <= 64 and set(value) <= _TOKEN_CHARS and value not in (".", "..")
        else:
            ok = PciAddress.is_valid(value)
            if not ok and uuid:
                try:
                    ok = parse_uuid(value) == value
                except Exception:
                    ok = False
    if not ok:
        raise HostEnvironmentError(
            f"state.db: a row of table {table} holds a {what} that vgpuhost never writes (not shown): it is not used "
            "as a sysfs path", hint="the store was changed outside vgpuhost: restore state.db from a backup, or fix "
                                    "that row with sqlite3; 'vgpuhost audit' shows what vgpuhost did")


def vgpu_records(conn: sqlite3.Connection, *, owner: Optional[str] = None,
                 gpu: Optional[str] = None, vgpu_id: Optional[str] = None) -> List[VgpuRecord]:
    """Recorded vGPUs, filtered by owner, GPU and/or id, oldest first."""
    sql = "SELECT * FROM vgpus"
    where, args = [], []
    if vgpu_id is not None:
        where.append("id = ?")
        args.append(vgpu_id)
    if owner is not None:
        where.append("owner = ?")
        args.append(owner)
    if gpu is not None:
        where.append("gpu = ?")
        args.append(gpu)
    if where:
        sql += " WHERE " + " AND ".join(where)
    return [_vgpu_record(r) for r in conn.execute(sql + " ORDER BY time, id", args)]


class VgpuRecordTaken(RefusedError):
    """:func:`put_vgpu` found a record with the same id (sqlite's UNIQUE constraint on ``vgpus.id``):
    the record's ``vgpu_id`` (text).  Not a damaged store: the caller undoes what it made for the new
    record and says who holds the id (:func:`vgpuhost.ops.vgpu.create_vgpu`)."""

    def __init__(self, vgpu_id: str):
        super().__init__(f"vGPU {vgpu_id} is recorded already", hint="'vgpuhost vgpu list' names its owner")
        self.vgpu_id = vgpu_id


def put_vgpu(conn: sqlite3.Connection, rec: VgpuRecord) -> None:
    """Insert the record ``rec`` (in the caller's transaction).  Raises :class:`VgpuRecordTaken` when a
    record with its id exists (the transaction is then rolled back by the caller's ``with``)."""
    try:
        conn.execute("INSERT INTO vgpus (id, backend, gpu, parent, type_id, type_name, owner, anti_affinity, params, "
                     "persisted, time, pool) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (rec.id, rec.backend, rec.gpu, rec.parent, rec.type_id, rec.type_name, rec.owner,
                      rec.anti_affinity, rec.params, int(rec.persisted), rec.time, rec.pool))
    except sqlite3.IntegrityError as e:
        if "vgpus.id" not in str(e):
            raise
        raise VgpuRecordTaken(rec.id) from None


def claim_vgpu(conn: sqlite3.Connection, vgpu_id: str, *, pool: str, owner: str) -> bool:
    """Give pool ``pool``'s vGPU ``vgpu_id`` to ``owner`` (a domain); False when the pool no longer holds it."""
    return conn.execute("UPDATE vgpus SET owner = ?, pool = ? WHERE id = ? AND owner = ?",
                        (owner, pool, vgpu_id, pool)).rowcount == 1


def give_back_vgpu(conn: sqlite3.Connection, vgpu_id: str, *, owner: str) -> Optional[str]:
    """Return ``owner``'s claimed vGPU ``vgpu_id`` to its pool; the pool owner, None when not claimed."""
    row = conn.execute("SELECT pool FROM vgpus WHERE id = ? AND owner = ? AND pool IS NOT NULL",
                       (vgpu_id, owner)).fetchone()
    if row is None:
        return None
    conn.execute("UPDATE vgpus SET owner = pool, pool = NULL WHERE id = ? AND owner = ?", (vgpu_id, owner))
    return row[0]


def delete_vgpu(conn: sqlite3.Connection, vgpu_id: str, owner: Optional[str] = None) -> int:
    """Delete a record (only if still owned by ``owner`` when given); rows deleted."""
    if owner is None:
        return conn.execute("DELETE FROM vgpus WHERE id = ?", (vgpu_id,)).rowcount
    return conn.execute("DELETE FROM vgpus WHERE id = ? AND owner = ?", (vgpu_id, owner)).rowcount


#: the advice every damaged-store message carries (never "move it aside": that drops every record)
_KEEP = ("keep this file: it records which devices vgpuhost changed and their original drivers, "
         "and a new store would forget them")


def unreadable(path: str, e: OSError, what: str) -> HostEnvironmentError:
    """The one-line error (exit 2) for a state dir or ``state.db`` this process may not read
    (EACCES, EPERM): never an empty store, which would make a bill or a check look clean."""
    return HostEnvironmentError(
        f"cannot read the {what} {path!r}: {e.strerror or e}",
        hint="run it as root (the state dir is root's, mode 0700); members of the vgpuhost-ro group can "
             "read usage, tenants, vGPUs and the audit log through the agent's read-only socket (docs/agent.md)")


def store_error(path: "str | os.PathLike[str]", e: BaseException) -> HostEnvironmentError:
    """The one-line error for an SQLite failure on the store at ``path`` (exit 2), said as what it is, by
    SQLite's result code (``sqlite_errorname``, else the message): read-only; a write a constraint refused
    (the store is fine); damaged (``SQLITE_CORRUPT``, ``SQLITE_NOTADB``: the only case whose fix is a
    backup); busy or locked by another writer (a :class:`TransientError`, exit 5: try again); the disk
    full; an I/O error; not openable; anything else as unusable, with the permissions and free space to
    check.  Never echoes the file's content."""
    text = str(e)
    low = text.lower()
    code = "_".join((getattr(e, "sqlite_errorname", None) or "").split("_")[:2])    # SQLITE_BUSY_SNAPSHOT: BUSY
    if code == "SQLITE_READONLY" or "readonly" in low or "read-only" in low:
        return HostEnvironmentError(f"the state store {str(path)!r} is read-only ({text})",
                                    hint="make the state dir and state.db writable (remount read-write, fix "
                                         "owner or mode) or run as root")
    if isinstance(e, sqlite3.IntegrityError):
        # a constraint refused one write (a record that exists already): the store itself is fine
        return HostEnvironmentError(f"the state store {str(path)!r} refused a write ({text}): a record with that "
                                    "key exists; the store is not damaged",
                                    hint="'vgpuhost vgpu list' and 'vgpuhost audit' show what holds it; "
                                         "run 'vgpuhost reconcile' and try again")
    if code in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or "not a database" in low or "malformed" in low \
            or "corrupt" in low:
        return HostEnvironmentError(f"the state store {str(path)!r} is damaged ({text})",
                                    hint=f"restore state.db from a backup; {_KEEP}")
    if code in ("SQLITE_BUSY", "SQLITE_LOCKED") or "is locked" in low or "is busy" in low:
        return TransientError(f"the state store {str(path)!r} is busy: another process holds its lock ({text})",
                              hint="try again in a moment (another vgpuhost command, the agent or a tool with "
                                   "state.db open is writing); the store is not damaged")
    if code == "SQLITE_FULL" or "disk is full" in low:
        return HostEnvironmentError(f"the state store {str(path)!r} cannot grow: its disk is full ({text})",
                                    hint="free space on the state dir's filesystem and try again; the store is "
                                         "not damaged")
    if code == "SQLITE_IOERR" or "i/o error" in low:
        return HostEnvironmentError(f"the state store {str(path)!r} hit an I/O error ({text})",
                                    hint="check the disk holding the state dir (the kernel log says more) and try "
                                         "again")
    if code == "SQLITE_CANTOPEN" or "unable to open" in low:
        return HostEnvironmentError(f"the state store {str(path)!r} cannot be opened ({text})",
                                    hint="check that the state dir exists and its owner and mode (root's, 0700)")
    return HostEnvironmentError(f"the state store {str(path)!r} is unusable ({text})",
                                hint="check the state dir's permissions and free space")


class _Transaction:
    """:meth:`StateStore.transaction`'s context manager (a class: no :mod:`contextlib` on the hook's path)."""

    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.conn.execute("ROLLBACK")
            return False
        self.conn.execute("COMMIT")
        return False


def _read_only_reason(directory: str) -> "Optional[str]":
    """Why ``directory`` cannot be written (read-only file system, no permission); None when it can."""
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"no write permission for uid {os.geteuid()}"
    return None


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_AUDIT_INSERT = ("INSERT INTO audit (time, actor, operation, path, value, result, errno) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?)")


def _statements(script: str) -> List[str]:
    """Split a migration script into statements (triggers keep their BEGIN...END)."""
    out, buf = [], []
    for line in script.strip().splitlines():
        buf.append(line)
        joined = "\n".join(buf).strip()
        if joined.endswith(";") and sqlite3.complete_statement(joined):
            out.append(joined)
            buf = []
    if "".join(buf).strip():
        out.append("\n".join(buf))
    return out


_JSON_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def json_text(value, *, sort_keys: bool = False) -> str:
    """``json.dumps(value, sort_keys=sort_keys)``, byte for byte, for the JSON-shaped values the
    journal stores (dicts with string keys, lists, tuples, strings, ints, bools, None), without
    importing :mod:`json` (and with it :mod:`re`) on every device operation's path; any other value
    (floats included) goes to :func:`json.dumps` itself."""
    parts: List[str] = []
    if not _json_into(value, parts, sort_keys):
        import json
        return json.dumps(value, sort_keys=sort_keys)
    return "".join(parts)


def _json_into(value, out: List[str], sort_keys: bool) -> bool:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif type(value) is int:
        out.append(int.__repr__(value))
    elif type(value) is str:
        out.append(_json_str(value))
    elif type(value) in (list, tuple):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(", ")
            if not _json_into(item, out, sort_keys):
                return False
        out.append("]")
    elif type(value) is dict:
        if not all(type(k) is str for k in value):
            return False
        out.append("{")
        for i, k in enumerate(sorted(value) if sort_keys else value):
            if i:
                out.append(", ")
            out.append(_json_str(k))
            out.append(": ")
            if not _json_into(value[k], out, sort_keys):
                return False
        out.append("}")
    else:
        return False
    return True


def _json_str(text: str) -> str:
    """A JSON string as json.dumps writes it (ensure_ascii: everything outside space..~ escaped)."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return '"' + text + '"'
    out = ['"']
    for c in text:
        n = ord(c)
        if c in _JSON_ESCAPES:
            out.append(_JSON_ESCAPES[c])
        elif 0x20 <= n <= 0x7e:
            out.append(c)
        elif n > 0xFFFF:
            n -= 0x10000
            out.append("\\u%04x\\u%04x" % (0xD800 | (n >> 10), 0xDC00 | (n & 0x3FF)))
        else:
            out.append("\\u%04x" % n)
    out.append('"')
    return "".join(out)


#: connections a fork() carried into this process: kept referenced so they are never closed here
#: (closing one in the child can checkpoint and delete the WAL under the processes using it; see
#: https://www.sqlite.org/howtocorrupt.html, "carrying an open database connection across a fork")
_CARRIED: List[sqlite3.Connection] = []


#: :meth:`StateStore.pooled` keeps at most this many idle connections
POOL_MAX = 8


class _Pooled:
    """:meth:`StateStore.pooled`'s context."""

    __slots__ = ("store", "saved", "conn", "pid")

    def __init__(self, store: "StateStore"):
        self.store = store
        self.conn = None

    def __enter__(self) -> "StateStore":
        st = self.store
        if st._memory:
            return st
        self.pid = os.getpid()
        conn = None
        with st._pool_lock:
            while st._pool and conn is None:
                pid, idle = st._pool.pop()
                if pid == self.pid:
                    conn = idle
                else:
                    _abandon(idle)          # opened before a fork(): the parent's
        if conn is None:
            try:
                conn = _retry_locked(lambda: st._open(shared=True))
            except sqlite3.Error as e:
                raise store_error(st.db, e) from None
        self.saved = (getattr(st._local, "conn", None), getattr(st._local, "pid", None))
        st._local.conn, st._local.pid = conn, self.pid
        self.conn = conn
        return st

    def __exit__(self, *exc) -> bool:
        conn, st = self.conn, self.store
        if conn is None:
            return False
        self.conn = None
        st._local.conn, st._local.pid = self.saved
        if os.getpid() != self.pid:
            _abandon(conn)
            return False
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        except sqlite3.Error:
            conn.close()
            return False
        with st._pool_lock:
            if len(st._pool) < POOL_MAX:
                st._pool.append((self.pid, conn))
                return False
        conn.close()
        return False


def _abandon(conn: sqlite3.Connection) -> None:
    """Keep ``conn`` (opened by the process this one forked from) alive and unused for good."""
    _CARRIED.append(conn)


def _retry_locked(fn, budget_s: float = BUSY_TIMEOUT_MS / 1000):
    """``fn()``, retried while SQLite says the database is locked or busy.

    SQLite's busy handler does not cover every case: switching a database
    that several processes create at once to WAL, or a read that meets a
    lock upgrade, can fail at once with SQLITE_BUSY.  Sixteen qemu hooks
    starting together on a fresh host do exactly that, so the opening steps
    retry (10-50 ms apart, within the busy timeout) before giving up.
    """
    import time
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as e:
            text = str(e).lower()
            if ("locked" not in text and "busy" not in text) or time.monotonic() >= deadline:
                raise
            import random           # only when it has to wait (the hook's path stays lean)
            time.sleep(random.uniform(0.01, 0.05))


# --- metering (version 6) ---------------------------------------------------------

def _reader(source) -> sqlite3.Connection:
    """A connection from a StateStore or a connection (metering's readers take either)."""
    return source._conn() if isinstance(source, StateStore) else source


def add_usage(conn: sqlite3.Connection, rows: Sequence[UsageRow]) -> None:
    """Add ``rows`` (:class:`~vgpuhost.model.usage.UsageRow`, or tuples in its field order) to the
    hourly rollups, one per (hour, device, domain, tenant, kind, GPU, profile): seconds and samples
    add up, the framebuffer peak keeps the maximum, the domain name and QoS class take the newest.
    A device resized or moved within an hour keeps one row per profile, kind and GPU, each
    priced as what it was (trial 9, F10)."""
    conn.executemany(
        "INSERT INTO usage_hourly VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (hour, device, domain_uuid, tenant, kind, gpu, profile) DO UPDATE SET "
        "domain = excluded.domain, qos = excluded.qos, "
        "alloc_s = alloc_s + excluded.alloc_s, sm_busy_s = sm_busy_s + excluded.sm_busy_s, "
        "enc_busy_s = enc_busy_s + excluded.enc_busy_s, dec_busy_s = dec_busy_s + excluded.dec_busy_s, "
        "fb_peak_bytes = MAX(fb_peak_bytes, excluded.fb_peak_bytes), "
        "fb_total_bytes = excluded.fb_total_bytes, samples = samples + excluded.samples", rows)


def usage_rows(conn: "StateStore | sqlite3.Connection", since: Optional[str] = None,
               until: Optional[str] = None, *, tenant: Optional[str] = None, device: Optional[str] = None,
               limit: Optional[int] = None) -> List[UsageRow]:
    """Hourly rollup rows with ``since <= hour < until`` (ISO hours), by hour; only ``tenant``'s (its
    name without case) and only ``device``'s where given, and at most ``limit`` rows."""
    from ..model.usage import USAGE_COLUMNS, UsageRow  # typing: not at module level (the qemu hook imports this)
    conn = _reader(conn)
    sql = "SELECT " + ", ".join(USAGE_COLUMNS) + " FROM usage_hourly"
    where, args = [], []
    for clause, value in (("hour >= ?", since), ("hour < ?", until), ("tenant = ? COLLATE NOCASE", tenant),
                          ("device = ?", device)):
        if value is not None and (value or clause.startswith(("tenant", "device"))):
            where.append(clause)
            args.append(value)
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY hour, device, domain_uuid, tenant"
    if limit is not None:
        sql += " LIMIT ?"
        args.append(limit)
    return [UsageRow._make(r) for r in conn.execute(sql, args)]


def device_hour_tenants(conn: "StateStore | sqlite3.Connection", devices: "Sequence[str]", since: str,
                        until: str) -> "Dict[str, Dict[str, set]]":
    """``{device: {hour: {tenant, ...}}}``: for each of ``devices``, the hours (ISO hour keys) with ``since
    <= hour < until`` in which metering attributed its use, and to which tenants (names in lower case; ``""``:
    none)."""
    held: Dict[str, Dict[str, set]] = {}
    for i in range(0, len(devices), 500):
        chunk = list(devices[i:i + 500])
        for device, hour, tenant in _reader(conn).execute(
                "SELECT DISTINCT device, hour, tenant FROM usage_hourly WHERE hour >= ? AND hour < ? AND device IN ("
                + ", ".join("?" * len(chunk)) + ")", [since, until, *chunk]):
            held.setdefault(device, {}).setdefault(hour, set()).add(tenant.lower())
    return held


def usage_by_tenant(conn: "StateStore | sqlite3.Connection", since: str, until: str) -> List[UsageRow]:
    """Rollups summed per (hour, tenant, kind, profile) with ``since <= hour < until``, as UsageRows
    whose device, domain and GPU are "" (seconds and samples summed, peaks the maximum): what a
    tenant's pattern needs, without one row per device."""
    from ..model.usage import UsageRow  # typing: not at module level (the qemu hook imports this)
    return [UsageRow._make(r) for r in _reader(conn).execute(
        "SELECT hour, '', '', kind, '', profile, '', tenant, '', SUM(alloc_s), SUM(sm_busy_s), SUM(enc_busy_s), "
        "SUM(dec_busy_s), MAX(fb_peak_bytes), MAX(fb_total_bytes), SUM(samples) FROM usage_hourly "
        "WHERE hour >= ? AND hour < ? GROUP BY hour, tenant, kind, profile ORDER BY hour, tenant, kind, profile",
        (since, until))]


def gpu_time_history(conn: "StateStore | sqlite3.Connection", since: str) -> List[tuple]:
    """Metered time-sliced vGPU use since hour ``since`` (ISO), summed per domain, tenant and profile:
    ``[(domain_uuid, tenant, profile, alloc_s, sm_busy_s)]`` (seconds; ``tenant`` "" for none): what
    ``vgpuhost.ops.gputime`` estimates a vGPU's expected GPU time from."""
    return list(_reader(conn).execute(
        "SELECT domain_uuid, tenant, profile, SUM(alloc_s), SUM(sm_busy_s) FROM usage_hourly "
        "WHERE hour >= ? AND kind = 'vgpu' GROUP BY domain_uuid, tenant, profile", (since,)))


def gpu_alloc_by_hour(conn: "StateStore | sqlite3.Connection", since: str) -> List[tuple]:
    """Metered vGPU allocated seconds since hour ``since`` (ISO), per hour and GPU: ``[(hour, gpu,
    alloc_s)]``: the trend of use the capacity reconciler weighs (``vgpuhost.ops.rebalance``).  Devices
    no domain held (a layout's idle vGPUs: no domain UUID) are room, not use, and are left out."""
    return list(_reader(conn).execute(
        "SELECT hour, gpu, SUM(alloc_s) FROM usage_hourly WHERE hour >= ? AND kind = 'vgpu' AND domain_uuid != '' "
        "GROUP BY hour, gpu", (since,)))


def usage_totals(conn: "StateStore | sqlite3.Connection") -> Dict[tuple, tuple]:
    """Lifetime ``{(device, domain_uuid): (alloc_s, sm_busy_s, enc_busy_s, dec_busy_s, fb_peak_bytes)}``."""
    return {(r[0], r[1]): tuple(r[2:]) for r in _reader(conn).execute(
        "SELECT device, domain_uuid, SUM(alloc_s), SUM(sm_busy_s), SUM(enc_busy_s), SUM(dec_busy_s), "
        "MAX(fb_peak_bytes) FROM usage_hourly GROUP BY device, domain_uuid")}


def device_alloc_by_hour(conn: "StateStore | sqlite3.Connection", device: str,
                        hours: Sequence[str]) -> Dict[str, float]:
    """``{hour: allocated seconds}`` the rollups hold for ``device`` in each of ``hours`` (rollup
    keys, ``2026-12-01T14:00:00Z``), summed over its domains and tenants; hours with no row are left out."""
    if not hours:
        return {}
    marks = ", ".join("?" for _ in hours)
    return {r[0]: float(r[1] or 0.0) for r in _reader(conn).execute(
        f"SELECT hour, SUM(alloc_s) FROM usage_hourly WHERE device = ? AND hour IN ({marks}) GROUP BY hour",
        (device, *hours))}


def meter_cursors(conn: "StateStore | sqlite3.Connection") -> Dict[str, tuple]:
    """``{device: (domain_uuid, alloc_us, sample_us)}``."""
    return {r[0]: (r[1], r[2], r[3]) for r in _reader(conn).execute(
        "SELECT device, domain_uuid, alloc_us, sample_us FROM meter_cursor")}


def put_meter_cursors(conn: sqlite3.Connection, rows: Sequence[tuple], gone: Sequence[str] = ()) -> None:
    """Upsert ``(device, domain_uuid, alloc_us, sample_us)`` rows; forget devices in ``gone``."""
    conn.executemany("INSERT OR REPLACE INTO meter_cursor VALUES (?, ?, ?, ?)", rows)
    conn.executemany("DELETE FROM meter_cursor WHERE device = ?", [(d,) for d in gone])


def add_meter_gap(conn: sqlite3.Connection, start: str, end: str, device: str, seconds: float,
                  reason: str) -> None:
    conn.execute("INSERT INTO meter_gaps (start, end, device, seconds, reason) VALUES (?, ?, ?, ?, ?)",
                 (start, end, device, float(seconds), reason))


def meter_gaps(conn: "StateStore | sqlite3.Connection", since: Optional[str] = None, until: Optional[str] = None) -> List[tuple]:
    """``(start, end, device, seconds, reason)`` of gaps overlapping ``[since, until)``."""
    conn = _reader(conn)
    sql, args = "SELECT start, end, device, seconds, reason FROM meter_gaps", []
    where = []
    if since:
        where.append("end > ?")
        args.append(since)
    if until:
        where.append("start < ?")
        args.append(until)
    if where:
        sql += " WHERE " + " AND ".join(where)
    return list(conn.execute(sql + " ORDER BY start, id", args))


def meter_state(conn: "StateStore | sqlite3.Connection", key: str) -> Optional[str]:
    row = _reader(conn).execute("SELECT value FROM meter_state WHERE key = ?", (key,)).fetchone()
    return row[0] if row else None


def put_meter_state(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute("INSERT OR REPLACE INTO meter_state VALUES (?, ?)", (key, value))


# --- billing (version 12) -----------------------------------------------------------

def tenant_guarantees(conn: "StateStore | sqlite3.Connection") -> List[tuple]:
    """The guarantee history (version 16): ``(tenant, since ISO, vgpus, mig_slices,
    passthrough_gpus)`` rows, oldest first (a removed tenant's last row has zeros)."""
    return list(_reader(conn).execute("SELECT tenant, since, vgpus, mig_slices, passthrough_gpus FROM "
                                      "tenant_guarantees ORDER BY since, id"))


def device_gpus(conn: "StateStore | sqlite3.Connection", devices: Sequence[str]) -> Dict[str, str]:
    """``{device: GPU}`` of the newest rollup row of each of ``devices`` (those with none left out)."""
    out: Dict[str, str] = {}
    c = _reader(conn)
    for d in devices:
        row = c.execute("SELECT gpu FROM usage_hourly WHERE device = ? ORDER BY hour DESC LIMIT 1", (d,)).fetchone()
        if row:
            out[d] = row[0]
    return out


def issued_bill(conn: "StateStore | sqlite3.Connection", period: str) -> Optional[tuple]:
    """``(period, issued, actor, prices_sha256, document JSON)`` of an issued period, else None."""
    return _reader(conn).execute("SELECT period, issued, actor, prices_sha256, document FROM bills "
                                 "WHERE period = ?", (period,)).fetchone()


def put_bill(conn: sqlite3.Connection, period: str, issued: str, actor: str, prices_sha256: str,
             document: str) -> None:
    """Store an issued bill (inside the caller's transaction); sqlite3.IntegrityError when the
    period is issued already."""
    conn.execute("INSERT INTO bills (period, issued, actor, prices_sha256, document) VALUES (?, ?, ?, ?, ?)",
                 (period, issued, actor, prices_sha256, document))


def add_bill_adjustment(conn: sqlite3.Connection, period: str, tenant: str, amount: str, reason: str,
                        actor: str, time: str, audit_id: int) -> int:
    """Append one adjustment of an issued bill (inside the caller's transaction); its id."""
    cur = conn.execute("INSERT INTO bill_adjustments (period, tenant, amount, reason, actor, time, audit_id) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)", (period, tenant, amount, reason, actor, time, audit_id))
    return int(cur.lastrowid)


def bill_adjustments(conn: "StateStore | sqlite3.Connection", period: str) -> List[tuple]:
    """``(id, tenant, amount text, reason, actor, time, audit_id)`` of a period, oldest first."""
    return list(_reader(conn).execute("SELECT id, tenant, amount, reason, actor, time, audit_id FROM "
                                      "bill_adjustments WHERE period = ? ORDER BY id", (period,)))


class StoreWatch:
    """Whether a store changed since last asked, for caches of answers read from it (the agent's).

    :meth:`token` is a value that differs after any commit to ``store``'s database by any connection
    but the watch's own, which never writes: another thread's of this process, another process's (the
    CLI's, the hook's).  It is SQLite's ``PRAGMA data_version`` on a connection kept for it, with the
    database file's inode and device (a store restored under the same name is another file).  An
    in-memory store, or a database that cannot be opened: ``None`` every time (no caching).
    """

    def __init__(self, store: "StateStore"):
        from _thread import allocate_lock
        self.db = store.db
        self._memory = store._memory
        self._lock = allocate_lock()
        self._conn: "Optional[sqlite3.Connection]" = None
        self._pid = os.getpid()

    def token(self) -> "Optional[tuple]":
        """``(data_version, st_dev, st_ino)`` now, or None when it cannot be read."""
        if self._memory:
            return None
        with self._lock:
            try:
                st = os.stat(self.db)
                if self._conn is None or self._pid != os.getpid():
                    self._conn = sqlite3.connect(self.db, isolation_level=None,
                                                 check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
                    self._pid = os.getpid()
                    self._ino = (st.st_dev, st.st_ino)
                if (st.st_dev, st.st_ino) != self._ino:
                    self._conn.close()
                    self._conn = None
                    return self.token_unlocked()
                return (self._conn.execute("PRAGMA data_version").fetchone()[0],) + self._ino
            except (OSError, sqlite3.Error):
                return None

    def token_unlocked(self) -> "Optional[tuple]":
        # the database was replaced: a new connection on the new file (one retry)
        try:
            st = os.stat(self.db)
            self._conn = sqlite3.connect(self.db, isolation_level=None,
                                         check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
            self._ino = (st.st_dev, st.st_ino)
            return (self._conn.execute("PRAGMA data_version").fetchone()[0],) + self._ino
        except (OSError, sqlite3.Error):
            return None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
