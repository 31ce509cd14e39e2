"""Store reads reused until the database files change.

The consumer looks for operator clears every second (`gpuwatchd clear` writes
them from another process), two SQLite queries a tick that almost always
find nothing new. A query's result is kept with the size, mtime and inode of
the database and its write-ahead log, taken before the query ran; while those
stay the same the result is reused. Every write, from any process, appends to
the log or rewrites a file, so it changes the stamp; a backstop re-runs the
query after BACKSTOP_SECONDS regardless (a log rewritten in place within one
coarse mtime tick keeps its size and mtime). Without the files (an
in-memory database) nothing is cached.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

__all__ = ["BACKSTOP_SECONDS", "ReadCache"]

T = TypeVar("T")
BACKSTOP_SECONDS = 60.0
_MAX_KEYS = 8

Stamp = tuple[tuple[int, int, int], ...]


class ReadCache:
    """Results of read queries on one SQLite database, keyed by the caller."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._files = (path, path + "-wal")
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[Hashable, tuple[Stamp, float, list[object]]] = {}

    def get(self, key: Hashable, query: Callable[[], list[T]]) -> list[T]:
        """`query()`'s rows, from the cache while the database files have not changed."""
        stamp = self._stamp()
        now = self._clock()
        with self._lock:
            hit = self._cache.get(key)
        if (
            stamp is not None
            and hit is not None
            and hit[0] == stamp
            and now - hit[1] < BACKSTOP_SECONDS
        ):
            return list(hit[2])  # type: ignore[arg-type]
        rows = query()
        if stamp is not None:
            with self._lock:
                if key not in self._cache and len(self._cache) >= _MAX_KEYS:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = (stamp, now, list(rows))
        return rows

    def invalidate(self) -> None:
        """Forget every result (after a write through this process)."""
        with self._lock:
            self._cache.clear()

    def _stamp(self) -> Stamp | None:
        out = []
        for i, path in enumerate(self._files):
            try:
                st = os.stat(path)
            except OSError:
                if i == 0:
                    return None  # no database file: never cache
                out.append((0, 0, 0))  # no log (yet): its appearance changes the stamp
                continue
            out.append((st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(out)
