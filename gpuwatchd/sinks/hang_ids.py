"""Hang ids unique for the life of the event store.

`/hangs/ID` and `gpuwatchd hang show ID` must name one hang before and after a
restart, so the last id handed out is kept in the store (as the cursor of the
"hangs" reader) and committed before the id is used.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from gpuwatchd.errors import GpuwatchdError
from gpuwatchd.sinks.store import EventStore

__all__ = ["CURSOR", "HangIds"]

log = logging.getLogger("gpuwatchd.hangs")

CURSOR = "hangs.last_id"


class HangIds(Iterator[int]):
    """The next hang id: one past every id this store has handed out or holds."""

    def __init__(self, store: EventStore) -> None:
        self._store = store
        self._last = max(_number(store.load_cursor(CURSOR)), _newest_stored(store))

    def __next__(self) -> int:
        self._last += 1
        try:
            self._store.write([], cursors={CURSOR: str(self._last)})
        except GpuwatchdError as exc:  # ids stay unique in this run; the hang is not delayed
            log.warning("hang id %d not kept in the store: %s", self._last, exc)
        return self._last


def _number(text: object) -> int:
    return int(text) if isinstance(text, str) and text.isdigit() else 0


def _newest_stored(store: EventStore) -> int:
    """The highest hang id among stored hangs (a store written before the cursor was kept)."""
    try:
        rows = store.recent(200, kind="job_hang")
    except GpuwatchdError:
        return 0
    return max((_number((r.get("attrs") or {}).get("hang_id")) for r in rows), default=0)
