"""The durable event store: Xid/SXid events, source cursors and operator clears in SQLite.

One file under the state directory (WAL mode; the alert outbox keeps its
own tables in the same file). Events and the kernel log cursor are
written in one transaction, so after a crash or restart the cursor never
points past an event that was not stored, nor before one that was:
nothing is reported twice and nothing is missed. Size is bounded by count
and age.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from gpuwatchd.errors import StoreError
from gpuwatchd.model import Clear, Event, Severity

if TYPE_CHECKING:
    from gpuwatchd.config import Config

__all__ = [
    "ClearRow",
    "DB_NAME",
    "EventStore",
    "Record",
    "SCHEMA_VERSION",
]

DB_NAME = "gpuwatchd.db"
ATTRIBUTION_KEYS = (
    "attribution",
    "pod_uid",
    "container_id",
    "slurm_job",
    "slurm_step",
    "slurm_uid",
    "unit",
    "cgroup",
)

# Each entry moves the schema one version up; never edit a released one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE events (
        id INTEGER PRIMARY KEY,
        time REAL NOT NULL,
        last_time REAL NOT NULL,
        boot_id TEXT NOT NULL DEFAULT '',
        sequence INTEGER,
        kind TEXT NOT NULL,
        source TEXT NOT NULL,
        code INTEGER,
        pci_bus_id TEXT NOT NULL DEFAULT '',
        gpu TEXT NOT NULL DEFAULT '',
        uuid TEXT NOT NULL DEFAULT '',
        pid INTEGER,
        process TEXT NOT NULL DEFAULT '',
        severity TEXT NOT NULL,
        action TEXT NOT NULL DEFAULT '',
        name TEXT NOT NULL DEFAULT '',
        message TEXT NOT NULL DEFAULT '',
        attribution TEXT NOT NULL DEFAULT '{}',
        raw TEXT NOT NULL DEFAULT '',
        attrs TEXT NOT NULL DEFAULT '{}',
        count INTEGER NOT NULL DEFAULT 1,
        burst_id TEXT UNIQUE
    );
    CREATE INDEX events_time ON events (time);
    CREATE INDEX events_boot ON events (boot_id);
    CREATE TABLE cursors (
        source TEXT PRIMARY KEY,
        cursor TEXT NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE clears (
        id INTEGER PRIMARY KEY,
        time REAL NOT NULL,
        who TEXT NOT NULL,
        kind TEXT NOT NULL DEFAULT 'xid',
        pci_bus_id TEXT NOT NULL DEFAULT '',
        code INTEGER,
        reason TEXT NOT NULL DEFAULT '',
        reset INTEGER NOT NULL DEFAULT 0,
        boot_id TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX clears_time ON clears (time);
    """,
    # The health engine's memory (the GPU count baseline). Older files kept it in the
    # alert outbox's table of the same name and shape, so IF NOT EXISTS keeps their rows.
    """
    CREATE TABLE IF NOT EXISTS health_memory (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
PRUNE_EVERY = 60.0


class Record(NamedTuple):
    """An event to store; rows with the same `burst_id` are one event with a count."""

    event: Event
    burst_id: str = ""
    reports: int = 1


ClearRow = Clear  # an operator clear or a GPU reset, as stored (one type: model.Clear)


def _clear_of(r: Sequence[Any]) -> Clear:
    """A row of `SELECT id, time, who, kind, pci_bus_id, code, reason, reset, boot_id`."""
    return Clear(
        id=r[0],
        time=r[1],
        who=r[2],
        kind=r[3],
        pci_bus_id=r[4],
        code=r[5],
        reason=r[6],
        reset=bool(r[7]),
        boot_id=r[8],
    )


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


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
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._db = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout = 10000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the event store {path}: {exc}") from None
        self.prune()

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
        """Store (event, burst_id, reports) rows and move cursors in one transaction."""
        if not records and not cursors:
            return
        now = self._now()
        try:
            with self._lock, self._db:
                for rec in records:
                    self._upsert(rec)
                for source, cursor in (cursors or {}).items():
                    if cursor:
                        self._db.execute(
                            "INSERT INTO cursors VALUES (?, ?, ?) ON CONFLICT(source) DO UPDATE"
                            " SET cursor = excluded.cursor, updated = excluded.updated",
                            (source, cursor, now),
                        )
        except sqlite3.Error as exc:
            raise StoreError(f"writing to {self.path}: {exc}") from None
        if records and now >= self._next_prune:
            self.prune()

    def _upsert(self, rec: tuple[Event, str, int]) -> None:
        ev, burst_id, reports = rec
        attrs = dict(ev.attrs)
        attribution = {k: attrs[k] for k in ATTRIBUTION_KEYS if attrs.get(k)}
        last = ev.time
        self._db.execute(
            """INSERT INTO events (time, last_time, boot_id, sequence, kind, source, code,
                   pci_bus_id, gpu, uuid, pid, process, severity, action, name, message,
                   attribution, raw, attrs, count, burst_id)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT(burst_id) DO UPDATE SET
                   count = excluded.count,
                   last_time = max(last_time, excluded.last_time)""",
            (
                ev.time,
                last,
                attrs.get("boot_id", ""),
                _int(attrs.get("sequence", "")),
                ev.kind,
                ev.source,
                ev.code,
                ev.pci_bus_id,
                attrs.get("gpu", ""),
                attrs.get("uuid", ""),
                _int(attrs.get("pid", "")),
                attrs.get("process", ""),
                str(ev.severity),
                attrs.get("action", ""),
                attrs.get("name", ""),
                ev.message,
                json.dumps(attribution, sort_keys=True),
                attrs.get("raw", ""),
                json.dumps(attrs, sort_keys=True),
                max(reports, ev.count),
                burst_id or None,
            ),
        )

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
        return [_row_json(dict(zip(names, row, strict=True))) for row in rows]

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
        out = []
        for kind, source, t, code, bus, message, severity, attrs, count in rows:
            try:
                sev = Severity.parse(severity)
            except KeyError:
                sev = Severity.INFO
            out.append(
                Event(
                    kind=kind,
                    source=source,
                    time=t,
                    code=code,
                    pci_bus_id=bus,
                    message=message,
                    severity=sev,
                    attrs=tuple(sorted(json.loads(attrs).items())),
                    count=count,
                )
            )
        return out

    def clears_since(self, since: float) -> list[Clear]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, time, who, kind, pci_bus_id, code, reason, reset, boot_id"
                " FROM clears WHERE time >= ? ORDER BY time, id",
                (since,),
            ).fetchall()
        return [_clear_of(r) for r in rows]

    def clears_after(self, clear_id: int) -> list[Clear]:
        """Clears added after row `clear_id` (by another process, e.g. `gpuwatchd clear`)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, time, who, kind, pci_bus_id, code, reason, reset, boot_id"
                " FROM clears WHERE id > ? ORDER BY id",
                (clear_id,),
            ).fetchall()
        return [_clear_of(r) for r in rows]

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


def _row_json(row: dict[str, Any]) -> dict[str, Any]:
    row["attribution"] = json.loads(row["attribution"] or "{}")
    row["attrs"] = json.loads(row["attrs"] or "{}")
    row["time_iso"] = _iso(row["time"])
    row["last_time_iso"] = _iso(row["last_time"])
    row.pop("burst_id", None)
    return row


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
