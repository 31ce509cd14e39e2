"""Kernel records from the systemd journal, resumable across restarts and rotation.

Only `_TRANSPORT=kernel` entries of this boot are read. The cursor names
the last entry handled; while the kernel is quiet it moves to the
journal's tail now and then, so a restart after days of other logging
resumes there instead of at an old kernel entry whose file may be gone.

journald rotates files and deletes the oldest (vacuum). When the entry at
our cursor is gone, the journal entries between it and the oldest one left
are counted as lost (an upper bound for kernel records: the count includes
other transports, which the files no longer tell apart). Journal sequence
numbers continue across rotated files of one journal, which makes the gap
measurable; a cursor from another journal (new sequence id) counts as one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from gpuwatchd.sources.kmsg.readers import MAX_LINES, Line, ReaderError, journal_line

__all__ = ["JournalReader", "cursor_seqnum"]

log = logging.getLogger("gpuwatchd.sources.kmsg.journal")

TAIL_EVERY = 5.0  # seconds between moves of an idle cursor to the journal's tail


def cursor_seqnum(cursor: str) -> tuple[str, int] | None:
    """(sequence-number id, sequence number) of a journal cursor, or None."""
    fields = dict(part.split("=", 1) for part in cursor.split(";") if "=" in part)
    try:
        return fields["s"], int(fields["i"], 16)
    except (KeyError, ValueError):
        return None


class JournalReader:
    """Kernel records from the systemd journal (`_TRANSPORT=kernel`), this boot.

    `path` (a directory) or `files` open those journal files instead of the
    local machine's journal. `cursor` is a journal cursor to resume after.
    """

    name = "journald"

    def __init__(
        self,
        cursor: str | None = None,
        max_lines: int = MAX_LINES,
        path: str | None = None,
        files: list[str] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            from systemd import journal
        except ImportError:
            raise ReaderError(
                "unavailable",
                "the journald backend needs systemd-python (pip install 'gpuwatchd[systemd]'"
                " or the distribution's python3-systemd package)",
            ) from None
        self._journal = journal
        self._max = max_lines
        self._where: dict[str, Any] = {"path": path} if path else {"files": files} if files else {}
        self._position = cursor or ""  # last entry handled, kernel or (when idle) any
        self._lost = 0
        self._early: list[Line] = []
        self._monotonic = monotonic
        self._tail_at = monotonic() + TAIL_EVERY
        try:
            self._j = journal.Reader(**self._where)
            self._probe = journal.Reader(**self._where)  # unfiltered: gaps and the tail
            self._j.add_match(_TRANSPORT="kernel")
            self._j.this_boot()
            if cursor:
                self._lost += self._vacuumed_after(cursor)
                self._j.seek_cursor(cursor)
                entry = self._j.get_next()
                # The entry at the cursor was handled already; when it is gone, or
                # was a tail position of another transport, the next one is new.
                if entry and not self._j.test_cursor(cursor):
                    self._early = [self._line(entry)]
            else:
                self._j.seek_head()
        except OSError as exc:
            raise ReaderError("open", f"cannot open the journal: {exc}") from None

    def _line(self, entry: Any) -> Line:
        self._position = str(entry.get("__CURSOR", "")) or self._position
        return Line(journal_line(entry), self.cursor())

    def _vacuumed_after(self, cursor: str) -> int:
        """Entries between `cursor` and the oldest entry left, when the cursor's is gone."""
        probe = self._probe
        probe.seek_cursor(cursor)
        entry = probe.get_next()
        if not entry or probe.test_cursor(cursor):
            return 0
        here, there = cursor_seqnum(cursor), cursor_seqnum(str(entry.get("__CURSOR", "")))
        if here and there and here[0] == there[0]:
            lost = max(0, there[1] - here[1] - 1)
        else:
            lost = 1  # another journal: how much is gone cannot be measured
        if lost:
            log.warning(
                "journal entries after the kernel log cursor were deleted (rotation/vacuum)"
                " before they were read: %d lost, resuming at %s",
                lost,
                entry.get("__REALTIME_TIMESTAMP", "the oldest entry left"),
            )
        return lost

    def read(self, timeout: float) -> list[Line]:
        lines, self._early = self._early + self._drain(), []
        if lines:
            return lines
        if self._j.wait(timeout) == self._journal.INVALIDATE:
            self._check_vacuum()
        lines = self._drain()
        if not lines and self._monotonic() >= self._tail_at:
            lines = self._to_tail()
        return lines

    def _check_vacuum(self) -> None:
        """Files were added or removed: count what was deleted before we read it."""
        if self._position:
            try:
                self._probe.process()
                self._lost += self._vacuumed_after(self._position)
            except OSError as exc:
                raise ReaderError("read", f"reading the journal: {exc}") from None

    def _to_tail(self) -> list[Line]:
        """Move the cursor to the journal's last entry once nothing older is unread."""
        self._tail_at = self._monotonic() + TAIL_EVERY
        try:
            self._probe.process()
            self._probe.seek_tail()
            last = self._probe.get_previous()
            # The tail is looked up first and our reader drained after it, so no
            # kernel entry before the tail can be left unread when we move there.
            if self._j.process() == self._journal.INVALIDATE:
                self._check_vacuum()
        except OSError as exc:
            raise ReaderError("read", f"reading the journal: {exc}") from None
        lines = self._drain()
        if not lines and last and last.get("__CURSOR"):
            self._position = str(last["__CURSOR"])
        return lines

    def _drain(self) -> list[Line]:
        lines: list[Line] = []
        try:
            while len(lines) < self._max:
                entry = self._j.get_next()
                if not entry:
                    break
                lines.append(self._line(entry))
        except OSError as exc:
            raise ReaderError("read", f"reading the journal: {exc}") from None
        return lines

    def cursor(self) -> str:
        return f"journal:{self._position}" if self._position else ""

    def take_lost(self) -> int:
        lost, self._lost = self._lost, 0
        return lost

    def close(self) -> None:
        self._j.close()
        self._probe.close()
