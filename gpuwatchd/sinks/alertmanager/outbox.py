"""Durable alert state for the Alertmanager sink, in the event store's SQLite file.

This is not a queue of messages but the set of alerts with a delivery
mark per Alertmanager: an alert's `version` goes up whenever something
Alertmanager must hear about changes (it fired, it resolved, its text
changed), and each receiver records the version it last acknowledged.
What is due for a receiver is then one query, a restart changes nothing
(startsAt and versions are on disk), and an Alertmanager that was away
gets everything it missed, however long the outage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.errors import StoreError

__all__ = ["Outbox", "StoredAlert", "fingerprint"]

# Alertmanager keeps a resolved alert for this long; so do we, re-sending it.
RESOLVED_RETENTION = 15 * 60.0
WRITE_BACK_EVERY = 2.0  # seconds between attempts to write an in-memory outbox back
_TABLES = ("alert_outbox", "alert_delivery")

log = logging.getLogger("gpuwatchd.alertmanager")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS alert_outbox (
    fingerprint TEXT PRIMARY KEY,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    starts_at REAL NOT NULL,
    resolved_at REAL,
    version INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS alert_delivery (
    fingerprint TEXT NOT NULL,
    receiver TEXT NOT NULL,
    version INTEGER NOT NULL,
    sent_at REAL NOT NULL,
    PRIMARY KEY (fingerprint, receiver)
);
"""


def fingerprint(labels: Mapping[str, str]) -> str:
    """A stable id for a label set (what Alertmanager dedups on)."""
    text = json.dumps(sorted(labels.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StoredAlert:
    """One alert as the outbox keeps it; `resolved_at` is None while firing."""

    fingerprint: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at: float
    resolved_at: float | None
    version: int
    updated_at: float

    @property
    def firing(self) -> bool:
        return self.resolved_at is None


_RANK = {"critical": 0, "warning": 1}


def _rank(labels: Mapping[str, str]) -> int:
    return _RANK.get(labels.get("severity", ""), 2)


@dataclass(frozen=True)
class SyncResult:
    """What one sync changed, for logging.

    `refused` are the fingerprints of wanted alerts that do not fit under
    `max_alerts` this time; a later sync takes them when room frees.
    """

    fired: tuple[StoredAlert, ...] = ()
    resolved: tuple[StoredAlert, ...] = ()
    refused: frozenset[str] = frozenset()

    @property
    def dropped(self) -> int:
        return len(self.refused)


def _fsync(fd: int) -> None:
    os.fsync(fd)  # looked up at call time, so a test can slow it


class Outbox:
    """Alert rows plus per-receiver delivery marks; every method is thread-safe.

    Commits do not wait for the disk (synchronous=NORMAL): `make_durable()`
    syncs what was committed so far, from the sink's own thread, so a slow
    fsync delays neither the consumer nor a delivery.
    """

    def __init__(
        self, path: str, max_alerts: int = 10000, sync: Callable[[int], None] = _fsync
    ) -> None:
        self.max_alerts = max_alerts
        self.path = path
        self._sync = sync
        self._lock = threading.Lock()
        self._file: sqlite3.Connection | None = None  # the file while we write to memory
        self._retry_at = 0.0
        self.in_memory = False
        try:
            # One connection shared under our own lock; the store module
            # opens its own connection to the same file.
            self._db = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout = 10000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.executescript(_SCHEMA)
            self._db.commit()
        except sqlite3.OperationalError as exc:  # a full disk at start: memory until it opens
            self._db = sqlite3.connect(":memory:", check_same_thread=False)
            self._db.executescript(_SCHEMA)
            self._file = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
            self._retry_at = time.monotonic() + WRITE_BACK_EVERY
            self.in_memory = True
            log.error("alert outbox: cannot open %s (%s); keeping alerts in memory", path, exc)
        except sqlite3.Error as exc:
            raise StoreError(f"alert outbox {path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            if self._file is not None and self._file is not self._db:
                self._file.close()
            self._db.close()

    def make_durable(self) -> None:
        """fsync what was committed so far (the write-ahead log holds every commit).

        Called without the lock: commits and reads go on meanwhile, and one
        sync covers every commit before it (a group commit).
        """
        if self.in_memory:
            return
        for name in (self.path + "-wal", self.path):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # no log right now: the commits are in the database file
            except OSError as exc:
                log.warning("alert outbox: cannot sync %s: %s", name, exc)
                return
            try:
                self._sync(fd)
            except OSError as exc:
                log.warning("alert outbox: cannot sync %s: %s", name, exc)
            finally:
                os.close(fd)
            return

    def _write(self, body: Callable[[], object]) -> None:
        """Run `body` in one transaction; a disk that refuses moves the outbox to memory.

        Alerts must keep firing when the state dir is full or read-only: the
        outbox then lives in an in-memory copy (what the file held, plus what
        changed since) and is written back once the file accepts writes.
        """
        with self._lock:
            if self._file is not None and time.monotonic() >= self._retry_at:
                self._write_back()
            try:
                with self._db:
                    body()
                return
            except sqlite3.OperationalError as exc:
                if self._file is not None:
                    raise
                self._to_memory(exc)
            with self._db:
                body()

    def _to_memory(self, exc: Exception) -> None:
        mem = sqlite3.connect(":memory:", check_same_thread=False)
        mem.executescript(_SCHEMA)
        for table in _TABLES:
            rows = self._db.execute(f"SELECT * FROM {table}").fetchall()
            if rows:
                marks = ",".join("?" * len(rows[0]))
                mem.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
        mem.commit()
        self._file, self._db = self._db, mem
        self._retry_at = time.monotonic() + WRITE_BACK_EVERY
        self.in_memory = True
        log.error("alert outbox: cannot write %s (%s); keeping alerts in memory", self.path, exc)

    def _write_back(self) -> None:
        assert self._file is not None
        self._retry_at = time.monotonic() + WRITE_BACK_EVERY
        try:
            self._file.execute("PRAGMA busy_timeout = 10000")
            self._file.execute("PRAGMA journal_mode = WAL")
            self._file.executescript(_SCHEMA)  # the file may be new: created full at start
            with self._file:
                for table in _TABLES:
                    self._file.execute(f"DELETE FROM {table}")
                    rows = self._db.execute(f"SELECT * FROM {table}").fetchall()
                    if rows:
                        marks = ",".join("?" * len(rows[0]))
                        self._file.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
        except sqlite3.Error:
            return
        self._db.close()
        self._db, self._file = self._file, None
        self.in_memory = False
        log.warning("alert outbox: %s writable again; alerts written back", self.path)

    def sync(
        self,
        current: Iterable[tuple[Mapping[str, str], Mapping[str, str], float]],
        now: float,
    ) -> SyncResult:
        """Make the firing set equal `current` (labels, annotations, starts_at).

        New label sets fire with their starts_at; firing ones keep the
        starts_at on disk (stable across restarts); firing ones missing
        from `current` resolve at `now`.
        """
        # The most severe first, so that when the bound bites it keeps those.
        ordered = sorted(current, key=lambda c: _rank(c[0]))
        wanted = {fingerprint(lab): (lab, ann, start) for lab, ann, start in ordered}
        fired: list[StoredAlert] = []
        resolved: list[StoredAlert] = []
        refused: set[str] = set()

        def write() -> None:
            fired.clear()  # a retry on the in-memory copy starts over
            resolved.clear()
            refused.clear()
            rows = {a.fingerprint: a for a in self._select("", ())}
            count = len(rows)
            # Resolve first: a resolved row can make room for a new alert.
            for fp, gone in rows.items():
                if gone.firing and fp not in wanted:
                    self._db.execute(
                        "UPDATE alert_outbox SET resolved_at=?, version=version+1, updated_at=?"
                        " WHERE fingerprint=?",
                        (now, now, fp),
                    )
                    resolved.append(
                        StoredAlert(
                            fp,
                            gone.labels,
                            gone.annotations,
                            gone.starts_at,
                            now,
                            gone.version + 1,
                            now,
                        )
                    )
            for fp, (labels, ann, start) in wanted.items():
                old = rows.get(fp)
                if old is None:
                    if count >= self.max_alerts:
                        count -= self._evict_one(_rank(labels), rows)
                    if count >= self.max_alerts:
                        refused.add(fp)
                        continue
                    self._db.execute(
                        "INSERT INTO alert_outbox VALUES (?, ?, ?, ?, NULL, 1, ?)",
                        (fp, _dump(labels), _dump(ann), start, now),
                    )
                    count += 1
                    fired.append(StoredAlert(fp, labels, ann, start, None, 1, now))
                elif old.resolved_at is not None:
                    # Fired again after it resolved: a new alert with a new startsAt.
                    self._db.execute(
                        "UPDATE alert_outbox SET annotations=?, starts_at=?, resolved_at=NULL,"
                        " version=version+1, updated_at=? WHERE fingerprint=?",
                        (_dump(ann), start, now, fp),
                    )
                    fired.append(StoredAlert(fp, labels, ann, start, None, old.version + 1, now))
                elif dict(old.annotations) != dict(ann):
                    self._db.execute(
                        "UPDATE alert_outbox SET annotations=?, version=version+1, updated_at=?"
                        " WHERE fingerprint=?",
                        (_dump(ann), now, fp),
                    )

        self._write(write)
        return SyncResult(tuple(fired), tuple(resolved), frozenset(refused))

    def _evict_one(self, rank: int, rows: dict[str, StoredAlert]) -> int:
        """Free one row for a new alert (caller holds the lock).

        The oldest resolved alert goes first; else, for a more severe new
        alert, the newest firing alert of the lowest severity, which then
        waits outside (refused) until room frees.
        """
        row = self._db.execute(
            "SELECT fingerprint FROM alert_outbox WHERE resolved_at IS NOT NULL"
            " ORDER BY resolved_at LIMIT 1"
        ).fetchone()
        if row is None:
            victims = [a for a in rows.values() if a.firing and _rank(a.labels) > rank]
            if not victims:
                return 0
            # Still wanted, it is offered again later in this sync and waits outside.
            victim = max(victims, key=lambda a: (_rank(a.labels), a.starts_at))
            row = (victim.fingerprint,)
        rows.pop(row[0], None)
        self._delete([row[0]])
        return 1

    def due(
        self, receiver: str, now: float, resend_interval: float, limit: int = 256
    ) -> list[StoredAlert]:
        """Alerts `receiver` has not acknowledged at their version, or whose resend is due.

        A mark from the future (the wall clock was stepped back) is due: else
        the resend would wait out the step and Alertmanager expire the alert.
        """
        return self._locked_select(
            "LEFT JOIN alert_delivery d ON d.fingerprint = a.fingerprint AND d.receiver = ?"
            " WHERE d.version IS NULL OR d.version < a.version"
            " OR ((d.sent_at <= ? OR d.sent_at > ?)"
            " AND (a.resolved_at IS NULL OR a.resolved_at >= ?))"
            " ORDER BY a.updated_at, a.fingerprint LIMIT ?",
            (receiver, now - resend_interval, now, now - RESOLVED_RETENTION, limit),
        )

    def next_due(self, receiver: str, now: float, resend_interval: float) -> float:
        """Seconds until something is due for `receiver` (0 if something is due now)."""
        with self._lock:
            row = self._db.execute(
                "SELECT MIN(CASE WHEN d.version IS NULL OR d.version < a.version"
                " OR d.sent_at > ? THEN 0"
                " ELSE d.sent_at + ? - ? END) FROM alert_outbox a LEFT JOIN alert_delivery d"
                " ON d.fingerprint = a.fingerprint AND d.receiver = ?"
                " WHERE a.resolved_at IS NULL OR a.resolved_at >= ?",
                (now, resend_interval, now, receiver, now - RESOLVED_RETENTION),
            ).fetchone()
        value = row[0] if row else None
        return max(0.0, float(value)) if value is not None else resend_interval

    def mark_sent(self, receiver: str, sent: Sequence[StoredAlert], now: float) -> None:
        """Record that `receiver` acknowledged these alerts at the versions given."""
        self._write(
            lambda: self._db.executemany(
                "INSERT INTO alert_delivery VALUES (?, ?, ?, ?) ON CONFLICT"
                " (fingerprint, receiver) DO UPDATE SET version=excluded.version,"
                " sent_at=excluded.sent_at",
                [(a.fingerprint, receiver, a.version, now) for a in sent],
            )
        )

    def undelivered(self, receivers: Sequence[str]) -> int:
        """Alerts some receiver has not acknowledged at their current version."""
        if not receivers:
            return 0
        marks = ",".join("?" * len(receivers))
        with self._lock:
            row = self._db.execute(
                "SELECT COUNT(*) FROM alert_outbox a WHERE (SELECT COUNT(*) FROM alert_delivery d"
                f" WHERE d.fingerprint = a.fingerprint AND d.receiver IN ({marks})"
                " AND d.version >= a.version) < ?",
                (*receivers, len(receivers)),
            ).fetchone()
        return int(row[0])

    def prune(self, receivers: Sequence[str], now: float) -> int:
        """Delete resolved alerts older than the retention that every receiver has seen."""
        done: list[str] = []

        def write() -> None:
            old = self._select(
                "WHERE a.resolved_at IS NOT NULL AND a.resolved_at < ?",
                (now - RESOLVED_RETENTION,),
            )
            done[:] = [a.fingerprint for a in old if self._acked(a, receivers)]
            self._delete(done)

        self._write(write)
        return len(done)

    def _acked(self, alert: StoredAlert, receivers: Sequence[str]) -> bool:
        for receiver in receivers:
            row = self._db.execute(
                "SELECT version FROM alert_delivery WHERE fingerprint=? AND receiver=?",
                (alert.fingerprint, receiver),
            ).fetchone()
            if row is None or row[0] < alert.version:
                return False
        return True

    def _delete(self, fps: Sequence[str]) -> None:
        for fp in fps:
            self._db.execute("DELETE FROM alert_outbox WHERE fingerprint=?", (fp,))
            self._db.execute("DELETE FROM alert_delivery WHERE fingerprint=?", (fp,))

    def alerts(self) -> list[StoredAlert]:
        """Every alert kept: firing ones and recently resolved ones."""
        return self._locked_select("ORDER BY a.resolved_at IS NOT NULL, a.starts_at", ())

    def deliveries(self) -> dict[str, dict[str, tuple[int, float]]]:
        """fingerprint -> receiver -> (acknowledged version, sent_at)."""
        out: dict[str, dict[str, tuple[int, float]]] = {}
        with self._lock:
            for fp, receiver, version, sent_at in self._db.execute(
                "SELECT fingerprint, receiver, version, sent_at FROM alert_delivery"
            ):
                out.setdefault(fp, {})[receiver] = (int(version), float(sent_at))
        return out

    def _locked_select(self, tail: str, params: tuple[object, ...]) -> list[StoredAlert]:
        with self._lock:
            return self._select(tail, params)

    def _select(self, tail: str, params: tuple[object, ...]) -> list[StoredAlert]:
        sql = (
            "SELECT a.fingerprint, a.labels, a.annotations, a.starts_at, a.resolved_at,"
            f" a.version, a.updated_at FROM alert_outbox a {tail}"
        )
        return [
            StoredAlert(fp, json.loads(lab), json.loads(ann), start, res, ver, upd)
            for fp, lab, ann, start, res, ver, upd in self._db.execute(sql, params)
        ]


def _dump(mapping: Mapping[str, str]) -> str:
    return json.dumps(dict(sorted(mapping.items())), separators=(",", ":"))
