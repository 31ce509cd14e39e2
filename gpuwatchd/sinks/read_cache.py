"""Store reads reused until the database changes.

The consumer looks for operator clears every second (`gpuwatchd clear` writes
them from another process), two SQLite queries a tick that almost always
find nothing new. A query's result is kept with the database's version,
taken before the query ran, and reused while the version stays the same.
The store's version is SQLite's own change counter: `PRAGMA data_version`
moves when another connection (another process) commits, and the
connection's `total_changes` when this one writes. No file is stat'ed and
no timer re-reads: the counters are exact.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import TypeVar

__all__ = ["ReadCache", "data_version"]

T = TypeVar("T")
_MAX_KEYS = 8


class ReadCache:
    """Results of read queries on one database, keyed by the caller.

    `version()` says whether anything may have changed since a result was
    read: equal versions, equal data. None means "cannot tell": never cache.
    """

    def __init__(self, version: Callable[[], Hashable | None]) -> None:
        self._version = version
        self._lock = threading.Lock()
        self._cache: dict[Hashable, tuple[Hashable, list[object]]] = {}

    def get(self, key: Hashable, query: Callable[[], list[T]]) -> list[T]:
        """`query()`'s rows, from the cache while the database's version is unchanged."""
        version = self._version()
        with self._lock:
            hit = self._cache.get(key)
        if version is not None and hit is not None and hit[0] == version:
            return list(hit[1])  # type: ignore[arg-type]
        rows = query()
        if version is not None:
            with self._lock:
                if key not in self._cache and len(self._cache) >= _MAX_KEYS:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = (version, list(rows))
        return rows

    def invalidate(self) -> None:
        """Forget every result."""
        with self._lock:
            self._cache.clear()


def data_version(db: sqlite3.Connection, lock: AbstractContextManager[object]) -> Hashable | None:
    """A version of the database that moves with any commit: another connection's
    (`PRAGMA data_version`) or this one's (`total_changes`); None if SQLite cannot say."""
    try:
        with lock:
            row = db.execute("PRAGMA data_version").fetchone()
            return (id(db), int(row[0]), db.total_changes)
    except sqlite3.Error:
        return None
