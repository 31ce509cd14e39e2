"""Clears are read from SQLite again only when the database changed (PRAGMA data_version)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpuwatchd.sinks.read_cache import ReadCache
from gpuwatchd.sinks.store import EventStore

ROOT = Path(__file__).resolve().parents[2]


def test_an_unchanged_version_reuses_the_result_and_a_new_one_reruns_it() -> None:
    version, calls = [1], []
    cache = ReadCache(lambda: version[0])

    def query() -> list[int]:
        calls.append(1)
        return [len(calls)]

    assert cache.get("k", query) == [1]
    assert cache.get("k", query) == [1] and len(calls) == 1
    version[0] += 1  # a commit by anyone
    assert cache.get("k", query) == [2]
    assert cache.get("other", query) == [3]  # keys are cached apart
    cache.invalidate()
    assert cache.get("k", query) == [4]


def test_without_a_version_nothing_is_cached() -> None:
    cache, calls = ReadCache(lambda: None), []
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
        assert set(queries) == {"PRAGMA data_version"}  # SQLite's change counter, no query
    finally:
        store.close()


def test_a_write_through_this_connection_is_seen_without_an_invalidate(tmp_path: Path) -> None:
    store = EventStore(str(tmp_path / "events.db"))
    try:
        assert store.clears_since(0) == []
        with store._lock, store._db:  # any write of ours, not only add_clear
            store._db.execute(
                "INSERT INTO clears (time, who, kind, pci_bus_id, reason, reset, boot_id)"
                " VALUES (1.0, 'carol', 'xid', '', '', 0, '')"
            )
        assert [c.who for c in store.clears_since(0)] == ["carol"]
    finally:
        store.close()
