"""The GPU count baseline lives in the event store (older files: in the outbox's table)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from gpuwatchd.sinks.store import EventStore


def test_baseline_round_trips(tmp_path: Path) -> None:
    store = EventStore(str(tmp_path / "db"))
    assert store.load_gpu_baseline() == 0
    store.save_gpu_baseline(8)
    store.save_gpu_baseline(7)
    store.close()
    again = EventStore(str(tmp_path / "db"))
    assert again.load_gpu_baseline() == 7
    again.close()


def test_baseline_written_by_an_older_version_is_kept(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    EventStore(path).close()
    db = sqlite3.connect(path)
    with db:  # what the outbox of the previous release left behind, at schema version 1
        db.execute("DROP TABLE health_memory")
        db.execute("CREATE TABLE health_memory (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO health_memory VALUES ('baseline_gpus', '8')")
        db.execute("UPDATE store_meta SET value = '1' WHERE key = 'events_schema_version'")
    db.close()
    store = EventStore(path)
    assert store.load_gpu_baseline() == 8
    store.close()
