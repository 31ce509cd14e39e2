"""What keeps the event store honest when its disk is not: held writes, quarantine, lock.

- `HeldWrites`: events (and the cursor that goes with them) that could not
  be written yet, bounded; when full the oldest info-level events go first,
  then warnings, and a critical event is never dropped.
- `quarantine()`: move a corrupt database aside under a timestamped name.
- `StateDirLock`: an advisory lock so two daemons never share a state dir.
- `memory_copy()`: the store read into memory, when a full disk refuses it at start.
- `dir_identity()`: (device, inode) of the state dir, to notice it was
  deleted or replaced while the daemon runs.
- `close_within()`: close databases at stop in parallel within a budget:
  the last connection's close checkpoints the write-ahead log, two syncs
  each, which a slow disk makes seconds; what is not done in time is
  recovered from the log at the next start.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from gpuwatchd.model import Event, Severity

__all__ = [
    "HeldWrites",
    "LOCK_NAME",
    "StateDirLock",
    "close_within",
    "dir_identity",
    "memory_copy",
    "quarantine",
]

log = logging.getLogger("gpuwatchd.store")

LOCK_NAME = "gpuwatchd.lock"
Row = tuple[Event, str, int]


class HeldWrites:
    """Rows and cursors waiting for the store to accept them, oldest first."""

    def __init__(self, limit: int = 10000) -> None:
        self.limit = limit
        self.rows: list[Row] = []
        self.cursors: dict[str, str] = {}
        self.dropped = 0  # info/warning rows given up to stay within the limit

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: Sequence[Row], cursors: Mapping[str, str]) -> None:
        """Hold these rows; a later cursor for a source replaces the earlier one."""
        self.rows.extend(rows)
        self.cursors.update((k, v) for k, v in cursors.items() if v)
        for severity in (Severity.INFO, Severity.WARNING):
            if len(self.rows) <= self.limit:
                break
            self._drop(severity, len(self.rows) - self.limit)

    def _drop(self, severity: Severity, excess: int) -> None:
        kept: list[Row] = []
        for row in self.rows:
            if excess and row[0].severity <= severity:
                excess -= 1
                self.dropped += 1
                continue
            kept.append(row)
        self.rows = kept

    def take(self) -> tuple[list[Row], dict[str, str]]:
        """Everything held, emptied; `restore()` puts it back if the write fails again."""
        rows, cursors = self.rows, self.cursors
        self.rows, self.cursors = [], {}
        return rows, cursors

    def restore(self, rows: Sequence[Row], cursors: Mapping[str, str]) -> None:
        """Put back rows taken by `take()` ahead of anything held since."""
        newer, newer_cursors = self.rows, self.cursors
        self.rows, self.cursors = [], dict(cursors)
        self.add([*rows, *newer], newer_cursors)


def quarantine(path: str, now: float | None = None) -> str:
    """Rename a corrupt database (and its WAL files) aside; returns the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    target = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.exists(target):
        n += 1
        target = f"{path}.corrupt-{stamp}-{n}"
    os.replace(path, target)
    for suffix in ("-wal", "-shm"):
        try:
            os.replace(path + suffix, target + suffix)
        except FileNotFoundError:
            pass
    return target


def memory_copy(path: str) -> sqlite3.Connection:
    """An in-memory database holding what the file at `path` holds, as far as it reads.

    Opened `immutable`, so a full or read-only disk is never written (no WAL
    index, no lock); an unreadable or absent file gives an empty database.
    """
    db = sqlite3.connect(":memory:", check_same_thread=False)
    if not path or not os.path.exists(path):
        return db
    try:
        src = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
        try:
            src.backup(db)
        finally:
            src.close()
    except sqlite3.Error:
        db.close()
        db = sqlite3.connect(":memory:", check_same_thread=False)
    return db


def dir_identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a directory, None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class StateDirLock:
    """flock(2) on <state dir>/gpuwatchd.lock holding the owner's pid.

    The kernel drops the lock when the process dies, so a kill -9 never
    leaves a stale lock behind.
    """

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> int | None:
        """Take the lock; None on success, else the pid of the holder (0 if unknown)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                os.close(fd)
                raise
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            return int(holder) if holder.isdigit() else 0
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the flock is the lock, the pid only a hint
        self._fd = fd
        return None

    def release(self) -> None:
        """Drop the lock (the file stays; its content is only a hint)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def close_within(closers: Sequence[tuple[str, Callable[[], None]]], budget: float) -> list[str]:
    """Run each close on a thread of its own, all within `budget` seconds; the names late.

    A close cut short by the process's exit is a crash to SQLite: the
    write-ahead log stays and the next open recovers it.
    """

    def run(name: str, close: Callable[[], None]) -> None:
        try:
            close()
        except Exception as exc:  # at stop: say so, the others go on
            log.error("closing the %s: %s", name, exc)

    threads = [
        (name, threading.Thread(target=run, args=(name, close), name=f"close-{name}", daemon=True))
        for name, close in closers
    ]
    end = time.monotonic() + budget
    for _, t in threads:
        t.start()
    for _, t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return [name for name, t in threads if t.is_alive()]
