"""Connection deadlines: one live timer per connection, and none left by a closed one.

A heap ordered by deadline. Moving a connection's deadline or closing it
invalidates its entry in place (the entry forgets the connection), so a
closed connection is never kept alive by the heap, whatever lies above it.
Invalidated entries are dropped when they reach the top, and the heap is
rebuilt once they outnumber the live ones: its size stays within twice the
open connections (plus a small floor), under any flood.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Protocol

__all__ = ["Deadlines", "Timed"]

_COMPACT_FLOOR = 64  # invalidated entries tolerated before a rebuild is worth it


class Timed(Protocol):
    """What has a deadline: a connection, holding its own heap entry."""

    timer: list[Any] | None


class Deadlines:
    """Deadlines of open connections, earliest first."""

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []  # [when, seq, connection or None]
        self._seq = itertools.count()
        self._stale = 0

    def __len__(self) -> int:
        """Heap entries, live and invalidated (for tests of the bound)."""
        return len(self._heap)

    def set(self, conn: Timed, when: float) -> None:
        """`conn` is due at `when` (monotonic seconds); replaces its previous deadline."""
        self.cancel(conn)
        entry: list[Any] = [when, next(self._seq), conn]
        conn.timer = entry
        heapq.heappush(self._heap, entry)

    def cancel(self, conn: Timed) -> None:
        """`conn` has no deadline any more (the app runs, or it closed)."""
        entry = conn.timer
        if entry is None:
            return
        entry[2] = None
        conn.timer = None
        self._stale += 1
        if self._stale > _COMPACT_FLOOR and self._stale * 2 > len(self._heap):
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)
            self._stale = 0

    def next_due(self) -> float | None:
        """The earliest live deadline, or None."""
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
            self._stale -= 1
        return float(heap[0][0]) if heap else None

    def pop_due(self, now: float) -> Any:
        """One connection whose deadline has passed (and no longer has one), or None."""
        due = self.next_due()
        if due is None or due > now:
            return None
        entry = heapq.heappop(self._heap)
        conn = entry[2]
        entry[2] = None
        conn.timer = None
        return conn
