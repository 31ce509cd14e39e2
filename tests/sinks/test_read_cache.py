"""Clears are read from SQLite again only when the database files changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpuwatchd.sinks import read_cache
from gpuwatchd.sinks.read_cache import ReadCache
from gpuwatchd.sinks.store import EventStore

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_unchanged_files_reuse_the_result_and_any_write_reruns_it(tmp_path: Path) -> None:
    path = tmp_path / "db"
    path.write_bytes(b"x")
    clock, calls = Clock(), []
    cache = ReadCache(str(path), clock)

    def query() -> list[int]:
        calls.append(1)
        return [len(calls)]

    assert cache.get("k", query) == [1]
    assert cache.get("k", query) == [1] and len(calls) == 1
    (tmp_path / "db-wal").write_bytes(b"frame")  # a commit by anyone appends to the log
    assert cache.get("k", query) == [2]
    assert cache.get("other", query) == [3]  # keys are cached apart
    clock.now += read_cache.BACKSTOP_SECONDS
    assert cache.get("k", query) == [4]  # the backstop re-reads even when nothing changed
    cache.invalidate()
    assert cache.get("k", query) == [5]


def test_without_a_database_file_nothing_is_cached(tmp_path: Path) -> None:
    cache, calls = ReadCache(str(tmp_path / "absent")), []
    for _ in range(3):
        cache.get("k", lambda: calls.append(1) or [])
    assert len(calls) == 3


_CLEAR = """
import sys
from gpuwatchd.sinks.store import EventStore
EventStore(sys.argv[1]).add_clear("bob", pci_bus_id="0000:41:00.0", reason="replaced")
"""


def test_a_clear_written_by_another_process_is_seen_at_the_next_read(tmp_path: Path) -> None:
    store = EventStore(str(tmp_path / "events.db"))
    try:
        mine = store.add_clear("alice")
        assert [c.who for c in store.clears_after(0)] == ["alice"]
        assert store.clears_after(mine.id) == []
        assert store.clears_after(mine.id) == []  # from the cache
        subprocess.run(
            [sys.executable, "-c", _CLEAR, str(tmp_path / "events.db")], cwd=ROOT, check=True
        )
        assert [c.who for c in store.clears_after(mine.id)] == ["bob"]
        assert [c.who for c in store.clears_since(0)] == ["alice", "bob"]
    finally:
        store.close()


def test_reads_of_an_idle_store_do_not_query(tmp_path: Path) -> None:
    store = EventStore(str(tmp_path / "events.db"))
    try:
        store.add_clear("alice")
        store.clears_since(0)
        queries = []
        store._db.set_trace_callback(queries.append)  # every statement SQLite runs
        for _ in range(10):
            assert [c.who for c in store.clears_since(0)] == ["alice"]
        assert queries == []
    finally:
        store.close()
