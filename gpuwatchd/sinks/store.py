"""The durable event store: Xid/SXid events, source cursors and operator clears in SQLite.

One file under the state directory (WAL mode; the alert outbox keeps its
own tables in the same file). Events and the kernel log cursor are
written in one transaction, so after a crash or restart the cursor never
points past an event that was not stored, nor before one that was:
nothing is reported twice and nothing is missed. Size is bounded by count
and age.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from gpuwatchd.errors import StoreError
from gpuwatchd.model import Clear, Event, Sample
from gpuwatchd.sinks.durability import HeldWrites, dir_identity, memory_copy, quarantine
from gpuwatchd.sinks.read_cache import ReadCache, data_version
from gpuwatchd.sinks.store_schema import (
    METRICS,
    MIGRATIONS,
    SCHEMA_VERSION,
    STORE_OPS,
    clear_of,
    event_of,
    row_json,
    upsert_event,
)

if TYPE_CHECKING:
    from gpuwatchd.config import Config

__all__ = [
    "DB_NAME",
    "EventStore",
    "METRICS",
    "Record",
    "SCHEMA_VERSION",
]

DB_NAME = "gpuwatchd.db"

PRUNE_EVERY = 60.0
RETRY_MAX = 30.0  # seconds between attempts to write held events, at most
MAX_HELD = 10000  # events held in memory while the store cannot write them
REWRITE_KEEP = 2000  # recent rows kept to re-persist into a re-created state dir
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)

log = logging.getLogger("gpuwatchd.store")


class Record(NamedTuple):
    """An event to store; rows with the same `burst_id` are one event with a count."""

    event: Event
    burst_id: str = ""
    reports: int = 1


class EventStore:
    """SQLite event store; thread-safe (one connection behind one lock)."""

    def __init__(
        self,
        path: str,
        max_events: int = 100_000,
        max_age_days: float = 90.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_events = max_events
        self.max_age = max_age_days * 86400.0
        self._now = clock
        self._lock = threading.Lock()
        self._next_prune = 0.0
        self.state_dir = os.path.dirname(os.path.abspath(path))
        self.errors = dict.fromkeys(STORE_OPS, 0)
        self.held = HeldWrites(MAX_HELD)
        self.quarantined: list[str] = []  # where corrupt files were moved
        self.problem = ""  # set while writes fail: what and where, for logs and the alert
        self._failures = 0
        self._retry_at = 0.0
        self._written: list[tuple[Event, str, int]] = []  # recent rows, to re-persist
        self._cursors: dict[str, str] = {}
        self._reads = ReadCache(lambda: data_version(self._db, self._lock))  # per-second clears
        self._on_file = True  # False while a disk that refused at start keeps us in memory
        try:
            self._db = self._open()
        except sqlite3.OperationalError as exc:  # full, read-only, I/O error: not the file
            self._db = self._in_memory(exc)
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError and "malformed" not in str(exc):
                raise StoreError(f"cannot open the event store {path}: {exc}") from None
            self._db = self._quarantine(exc)  # corrupt: keep monitoring on a fresh file
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:  # not a disk that may recover: a wrong path
                raise StoreError(f"cannot open the event store {path}: {exc}") from None
            self._db = self._in_memory(exc)
        self._dir_id = dir_identity(self.state_dir)
        self.prune()

    def _open(self) -> sqlite3.Connection:
        os.makedirs(self.state_dir, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False)
        try:
            db.execute("PRAGMA busy_timeout = 10000")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            # A garbage header fails above; torn or garbage pages fail here.
            verdict = db.execute("PRAGMA quick_check").fetchone()
            if verdict is None or verdict[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {verdict[0] if verdict else '?'}")
            self._db = db
            self._migrate()
        except BaseException:
            db.close()
            raise
        return db

    def _quarantine(self, exc: Exception) -> sqlite3.Connection:
        self.errors["open"] += 1
        try:
            moved = quarantine(self.path, self._now())
            db = self._open()
        except (sqlite3.Error, OSError) as again:
            raise StoreError(f"cannot open the event store {self.path}: {again}") from None
        self.quarantined.append(moved)
        log.error(
            "event store %s is corrupt (%s): moved to %s, started a fresh one",
            self.path,
            exc,
            moved,
        )
        return db

    def _in_memory(self, exc: Exception) -> sqlite3.Connection:
        """A disk that refuses at start: read a copy of the file, hold writes until it opens."""
        self.errors["open"] += 1
        self._on_file, self._db = False, memory_copy(self.path)
        self._migrate()
        self._failed(exc)
        return self._db

    def _reopen_file(self) -> None:
        with self._lock:  # raises while the disk still refuses
            old = self._db
            try:
                self._db = self._open()  # which sets self._db before it may fail
            except BaseException:
                self._db = old
                raise
            self._on_file, self._dir_id = True, dir_identity(self.state_dir)
        old.close()

    @classmethod
    def from_config(cls, cfg: Config, clock: Callable[[], float] = time.time) -> EventStore:
        """The store at <daemon.state_dir>/gpuwatchd.db with the configured retention."""
        return cls(
            os.path.join(cfg.daemon.state_dir, DB_NAME),
            cfg.store.max_events,
            cfg.store.max_age_days,
            clock,
        )

    def _migrate(self) -> None:
        with self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS store_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
            )
            row = self._db.execute(
                "SELECT value FROM store_meta WHERE key = 'events_schema_version'"
            ).fetchone()
            version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {version}, newer than this gpuwatchd"
                    f" ({SCHEMA_VERSION}); refusing to touch it"
                )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            # executescript commits on its own; the version row marks completion
            self._db.executescript(
                "BEGIN;"
                + MIGRATIONS[target - 1]
                + "INSERT OR REPLACE INTO store_meta VALUES ('events_schema_version', "
                + f"'{target}'); COMMIT;"
            )

    def schema_version(self) -> int:
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM store_meta WHERE key = 'events_schema_version'"
            ).fetchone()
        return int(row[0]) if row else 0

    # --- writing -------------------------------------------------------------------

    def write(
        self,
        records: Sequence[tuple[Event, str, int]],
        cursors: Mapping[str, str] | None = None,
    ) -> None:
        """Store (event, burst_id, reports) rows and move cursors in one transaction.

        Never raises. What cannot be written (disk full, read-only, I/O
        error) is held in memory, bounded, and retried with backoff on later
        calls (an empty call retries); the cursor moves only with its events.
        """
        try:
            self._write(records, cursors or {})
        except Exception as exc:  # a bug must not take the consumer thread down
            log.exception("event store write")
            self._failed(exc)

    def _write(self, records: Sequence[tuple[Event, str, int]], cursors: Mapping[str, str]) -> None:
        if records or cursors:
            self.held.add(records, cursors)
        if not self.held.rows and not self.held.cursors and self._on_file:
            return
        now = self._now()
        if now < self._retry_at:
            return
        rows, curs = self.held.take()
        try:
            if not self._on_file:
                self._reopen_file()
            elif self._dir_changed():
                # Re-persist what the lost file held (recent rows, the cursors) first.
                rows = [*self._written[-REWRITE_KEEP:], *rows]
                curs = {**self._cursors, **curs}
            with self._lock, self._db:
                self._commit(rows, curs, now)
        except (sqlite3.Error, OSError) as exc:
            self.held.restore(rows, curs)
            self._failed(exc)
            return
        self._remember(rows, curs)
        if self.problem:
            log.warning(
                "event store %s writable again; %d held event(s) written", self.path, len(rows)
            )
        self.problem, self._failures, self._retry_at = "", 0, 0.0
        if rows and now >= self._next_prune:
            try:
                self.prune()
            except StoreError as exc:
                log.warning("%s", exc)

    def _commit(
        self, rows: Sequence[tuple[Event, str, int]], cursors: Mapping[str, str], now: float
    ) -> None:
        bad = []
        for rec in rows:
            try:
                upsert_event(self._db, rec)
            except sqlite3.IntegrityError as exc:
                if "constraint failed" not in str(exc) and "mismatch" not in str(exc):
                    raise  # not about this row: the whole batch is held and retried
                bad.append(rec)  # SQLite rolled back this statement only
                log.error("event not storable, skipped: %s: %s", exc, str(rec[0].message)[:200])
            except (sqlite3.OperationalError, sqlite3.DatabaseError):
                raise  # the disk or the file, not this row: held and retried
            except Exception as exc:  # a number beyond 64 bits, a value of the wrong type
                bad.append(rec)  # this record alone; the others of the batch are stored
                log.error("event not storable, skipped: %s: %s", exc, str(rec[0].message)[:200])
        self.errors["reject"] += len(bad)
        for source, cursor in cursors.items():
            self._db.execute(
                "INSERT INTO cursors VALUES (?, ?, ?) ON CONFLICT(source) DO UPDATE"
                " SET cursor = excluded.cursor, updated = excluded.updated",
                (source, cursor, now),
            )

    def _failed(self, exc: Exception) -> None:
        self.errors["write"] += 1
        self._failures += 1
        delay = min(RETRY_MAX, 0.5 * 2.0 ** min(self._failures - 1, 8))
        self._retry_at = self._now() + delay
        problem = f"cannot write the event store in {self.state_dir}: {exc}"
        if problem != self.problem:
            log.error("%s; %d event(s) held in memory, retrying", problem, len(self.held))
        self.problem = problem

    def _remember(self, rows: Sequence[tuple[Event, str, int]], cursors: Mapping[str, str]) -> None:
        self._cursors.update(cursors)
        self._written.extend(rows)
        if len(self._written) > 2 * REWRITE_KEEP:
            del self._written[:-REWRITE_KEEP]

    def _dir_changed(self) -> bool:
        """Re-open a fresh store when the state dir was deleted or replaced (True then)."""
        if dir_identity(self.state_dir) == self._dir_id and os.path.exists(self.path):
            return False
        self.errors["state_dir"] += 1
        log.error(
            "state dir %s was deleted or replaced while running: re-creating the event store",
            self.state_dir,
        )
        with self._lock:
            old = self._db
            try:
                self._db = self._open()
            except BaseException:
                # Reads go on from the old file until a retry opens a new one;
                # the caller holds the rows.
                self._db = old
                raise
            self._dir_id = dir_identity(self.state_dir)
        try:
            old.close()
        except sqlite3.Error:
            pass
        return True

    def pending(self) -> bool:
        """Whether writes wait in memory (the caller's tick should call `write([])`)."""
        return bool(self.held.rows or self.held.cursors) or not self._on_file

    def samples(self) -> list[Sample]:
        """The store's own metrics (see METRICS)."""
        out = [
            Sample.of("gpuwatchd_event_store_errors_total", n, op=op)
            for op, n in self.errors.items()
        ]
        out += [
            Sample.of("gpuwatchd_event_store_up", 0.0 if self.problem else 1.0),
            Sample.of("gpuwatchd_event_store_held_events", len(self.held)),
            Sample.of("gpuwatchd_event_store_dropped_events_total", self.held.dropped),
            Sample.of("gpuwatchd_event_store_quarantined_total", len(self.quarantined)),
        ]
        return out

    def load_cursor(self, source: str) -> str | None:
        """The cursor last committed for `source` (SourceContext.load_cursor)."""
        with self._lock:
            row = self._db.execute(
                "SELECT cursor FROM cursors WHERE source = ?", (source,)
            ).fetchone()
        return str(row[0]) if row else None

    def add_clear(
        self,
        who: str,
        *,
        kind: str = "xid",
        pci_bus_id: str = "",
        code: int | None = None,
        reason: str = "",
        reset: bool = False,
        boot_id: str = "",
        when: float | None = None,
    ) -> Clear:
        """Record an operator clear (who, when, what) or a GPU reset."""
        t = self._now() if when is None else when
        try:
            with self._lock, self._db:
                cur = self._db.execute(
                    "INSERT INTO clears (time, who, kind, pci_bus_id, code, reason, reset, boot_id)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (t, who, kind, pci_bus_id, code, reason, int(reset), boot_id),
                )
        except sqlite3.Error as exc:
            raise StoreError(f"writing to {self.path}: {exc}") from None
        return Clear(
            id=int(cur.lastrowid or 0),
            time=t,
            who=who,
            kind=kind,
            pci_bus_id=pci_bus_id,
            code=code,
            reason=reason,
            reset=reset,
            boot_id=boot_id,
        )

    def prune(self) -> int:
        """Apply retention by age and count; returns rows removed."""
        now = self._now()
        self._next_prune = now + PRUNE_EVERY
        try:
            with self._lock, self._db:
                n = self._db.execute(
                    "DELETE FROM events WHERE last_time < ?", (now - self.max_age,)
                ).rowcount
                n += self._db.execute(
                    "DELETE FROM events WHERE id <= (SELECT id FROM events ORDER BY id DESC"
                    " LIMIT 1 OFFSET ?)",
                    (self.max_events,),
                ).rowcount
                self._db.execute("DELETE FROM clears WHERE time < ?", (now - self.max_age,))
        except sqlite3.Error as exc:
            raise StoreError(f"pruning {self.path}: {exc}") from None
        return n

    # --- reading -------------------------------------------------------------------

    def recent(
        self,
        limit: int = 100,
        *,
        kind: str | None = None,
        code: int | None = None,
        gpu: str | None = None,
        since: float | None = None,
    ) -> list[dict[str, Any]]:
        """Newest events first, as JSON-able dicts."""
        where: list[str] = ["1"]
        args: list[object] = []
        if kind:
            where.append("kind = ?")
            args.append(kind)
        if code is not None:
            where.append("code = ?")
            args.append(code)
        if gpu:
            where.append("(pci_bus_id = ? OR uuid = ? OR gpu = ?)")
            args += [gpu, gpu, gpu]
        if since is not None:
            where.append("last_time >= ?")
            args.append(since)
        sql = f"SELECT * FROM events WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?"
        with self._lock:
            cur = self._db.execute(sql, (*args, limit))
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        return [row_json(dict(zip(names, row, strict=True))) for row in rows]

    def event(self, event_id: int) -> dict[str, Any] | None:
        """One stored event by its id, as JSON-able dict; None if there is none."""
        with self._lock:
            cur = self._db.execute("SELECT * FROM events WHERE id = ?", (event_id,))
            names = [d[0] for d in cur.description]
            row = cur.fetchone()
        return None if row is None else row_json(dict(zip(names, row, strict=True)))

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM events").fetchone()[0])

    def events_since(self, since: float) -> list[Event]:
        """Stored events (one per burst, with its count) from `since` on, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT kind, source, time, code, pci_bus_id, message, severity, attrs, count"
                " FROM events WHERE last_time >= ? ORDER BY time, id",
                (since,),
            ).fetchall()
        return [event_of(row) for row in rows]

    def clears_since(self, since: float) -> list[Clear]:
        """Clears recorded at or after `since` (read again only once the files changed)."""
        return self._reads.get(
            ("since", since), lambda: self._clears("time >= ?", since, "time, id")
        )

    def clears_after(self, clear_id: int) -> list[Clear]:
        """Clears added after row `clear_id` (by another process, e.g. `gpuwatchd clear`)."""
        return self._reads.get(("after", clear_id), lambda: self._clears("id > ?", clear_id, "id"))

    def _clears(self, where: str, arg: float, order: str) -> list[Clear]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, time, who, kind, pci_bus_id, code, reason, reset, boot_id"
                f" FROM clears WHERE {where} ORDER BY {order}",
                (arg,),
            ).fetchall()
        return [clear_of(r) for r in rows]

    def load_gpu_baseline(self) -> int:
        """The most GPUs the health engine has seen on this node (0 = none yet)."""
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM health_memory WHERE key = 'baseline_gpus'"
            ).fetchone()
        text = str(row[0]) if row else ""
        return int(text) if text.isdigit() else 0

    def save_gpu_baseline(self, count: int) -> None:
        """Keep the GPU count baseline across restarts (HealthEngine's `on_baseline`)."""
        try:
            with self._lock, self._db:
                self._db.execute(
                    "INSERT INTO health_memory VALUES ('baseline_gpus', ?)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (str(count),),
                )
        except sqlite3.Error as exc:
            raise StoreError(f"writing to {self.path}: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()
