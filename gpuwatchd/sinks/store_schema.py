"""The event store's schema migrations and its metrics, kept apart from the store's code."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from typing import Any

from gpuwatchd.model import (
    DIAG_KIND,
    HANG_KIND,
    Clear,
    DiagRun,
    Event,
    HangReport,
    MetricSpec,
    Severity,
    XidFields,
    payload_of,
)

__all__ = [
    "ATTRIBUTION_KEYS",
    "METRICS",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "STORE_OPS",
    "clear_of",
    "event_of",
    "hang_report_json",
    "row_json",
    "upsert_event",
]

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

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_event_store_errors_total",
        "counter",
        "event store failures by operation: write (retried; events held in memory), open,"
        " reject (a record that cannot be stored, e.g. a number out of range), state_dir"
        " (the state directory vanished or was replaced and was re-created)",
        ("op",),
    ),
    MetricSpec(
        "gpuwatchd_event_store_up",
        "gauge",
        "1 while the event store accepts writes; 0 while events are held in memory",
    ),
    MetricSpec(
        "gpuwatchd_event_store_held_events",
        "gauge",
        "events waiting in memory for the store to accept them",
    ),
    MetricSpec(
        "gpuwatchd_event_store_dropped_events_total",
        "counter",
        "info/warning events given up because too many were held in memory (never critical)",
    ),
    MetricSpec(
        "gpuwatchd_event_store_quarantined_total",
        "counter",
        "corrupt database files moved aside (renamed with a timestamp) and replaced by a fresh one",
    ),
)
STORE_OPS = ("write", "open", "reject", "state_dir")

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


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def upsert_event(db: sqlite3.Connection, rec: tuple[Event, str, int]) -> None:
    """Insert one (event, burst_id, reports) row, or bump the count of its burst.

    The payload is written once, as its attrs view (the `attrs` column; `event_of`
    reads it back typed); a few of its fields are columns too, for queries."""
    ev, burst_id, reports = rec
    attrs = dict(ev.attrs)
    xid = ev.xid or XidFields(code=ev.code or 0)
    attribution = {k: attrs[k] for k in ATTRIBUTION_KEYS if attrs.get(k)}
    last = ev.time
    db.execute(
        """INSERT INTO events (time, last_time, boot_id, sequence, kind, source, code,
               pci_bus_id, gpu, uuid, pid, process, severity, action, name, message,
               attribution, raw, attrs, count, burst_id)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
           ON CONFLICT(burst_id) DO UPDATE SET
               count = excluded.count,
               last_time = max(last_time, excluded.last_time),
               -- the same first time: more lines of one report (the pid line of an Xid 13)
               pid = CASE WHEN excluded.time = time THEN excluded.pid ELSE pid END,
               process = CASE WHEN excluded.time = time THEN excluded.process ELSE process END,
               message = CASE WHEN excluded.time = time THEN excluded.message ELSE message END,
               attribution = CASE WHEN excluded.time = time
                   THEN excluded.attribution ELSE attribution END,
               attrs = CASE WHEN excluded.time = time THEN excluded.attrs ELSE attrs END""",
        (
            ev.time,
            last,
            attrs.get("boot_id", ""),
            _int(attrs.get("sequence", "")),
            ev.kind,
            ev.source,
            ev.code,
            ev.pci_bus_id,
            xid.gpu,
            xid.uuid,
            xid.attribution.pid,
            xid.attribution.process,
            str(ev.severity),
            xid.action,
            xid.name,
            ev.message,
            json.dumps(attribution, sort_keys=True),
            attrs.get("raw", ""),
            json.dumps(attrs, sort_keys=True),
            max(reports, ev.count),
            burst_id or None,
        ),
    )


def clear_of(r: Sequence[Any]) -> Clear:
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


def row_json(row: dict[str, Any]) -> dict[str, Any]:
    """An events row as /events serves it (JSON columns decoded, ISO times)."""
    row["attribution"] = json.loads(row["attribution"] or "{}")
    row["attrs"] = json.loads(row["attrs"] or "{}")
    if row.get("kind") == DIAG_KIND:  # the run read back typed, rows of any age
        row["diag"] = DiagRun.from_attrs(row["attrs"], row["time"]).to_json()
    row["time_iso"] = _iso(row["time"])
    row["last_time_iso"] = _iso(row["last_time"])
    row.pop("burst_id", None)
    return row


def hang_report_json(row: dict[str, Any]) -> dict[str, Any]:
    """A `row_json` row with a job hang's report read back typed and served as an object
    (/events/ID, evidence bundles); a report that does not parse stays as stored."""
    attrs = row.get("attrs")
    if row.get("kind") == HANG_KIND and isinstance(attrs, dict):
        report = HangReport.from_attrs(attrs)
        if report is not None:
            row["attrs"] = {**attrs, "forensics": report.json()}
    return row


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def event_of(row: Sequence[Any]) -> Event:
    """An Event from (kind, source, time, code, pci_bus_id, message, severity, attrs, count),
    with its payload read back typed (attrs as stored for kinds without one)."""
    kind, source, t, code, bus, message, severity, attrs, count = row
    stored = json.loads(attrs)
    try:
        sev = Severity.parse(severity)
    except KeyError:
        sev = Severity.INFO
    return Event(
        kind=kind,
        source=source,
        time=t,
        code=code,
        pci_bus_id=bus,
        message=message,
        severity=sev,
        attrs=tuple(sorted(stored.items())),
        count=count,
        payload=payload_of(kind, code, stored, t),
    )
