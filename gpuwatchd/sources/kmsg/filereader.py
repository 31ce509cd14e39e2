"""Follow a kernel log written to a plain file or a FIFO, across rotation.

Rotation by rename: the writer keeps appending to the renamed file until it
reopens (syslog daemons do so only after logrotate's HUP), so the old file
stays open and is read until it has been quiet for `grace` seconds, beside
the new file. Rotation by copytruncate: the file shrinks, or its bytes
before our offset change; what the writer appended after our last read is
taken from the copy when one lies beside the file, and the truncation is
counted as a possible loss (lines written between logrotate's copy and its
truncate are in neither file). A file seen earlier (renamed away and back)
resumes at the offset reached in it, never from its start.
Cursor: `file:<dev>:<inode>:<offset>`.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import time
from collections import OrderedDict
from collections.abc import Callable

from gpuwatchd.sources.kmsg.parse import MAX_RECORD
from gpuwatchd.sources.kmsg.readers import MAX_LINES, Line, ReaderError

__all__ = ["FileReader", "ROTATED_GRACE"]

ROTATED_GRACE = 5.0  # seconds a renamed file must stay unchanged before it is let go
TAIL = 64  # bytes before the offset kept to tell a rewritten file from a grown one
REMEMBERED = 16  # files whose offsets are kept for a switch back


class _Followed:
    """One open file and how far it has been read."""

    def __init__(self, fd: int, ident: tuple[int, int]) -> None:
        self.fd = fd
        self.id = ident
        self.offset = 0  # bytes handed out as complete lines (plus skipped ones)
        self.buf = b""
        self.skipped = 0
        self.tail = b""  # the last bytes before `offset`
        self.changed_at = time.monotonic()

    def end(self) -> int:
        return self.offset + len(self.buf) + self.skipped

    def seek(self, offset: int, tail: bytes) -> None:
        self.offset = os.lseek(self.fd, offset, os.SEEK_SET)
        self.buf, self.skipped, self.tail = b"", 0, tail

    def rewritten(self) -> bool:
        """Whether the bytes before our offset are no longer the ones we read."""
        if not self.tail:
            return False
        try:
            return os.pread(self.fd, len(self.tail), self.offset - len(self.tail)) != self.tail
        except OSError:
            return True


class FileReader:
    """Follow a text file (`dmesg -w > file`, syslog) or a FIFO, across rotation."""

    name = "file"

    def __init__(
        self,
        path: str,
        cursor: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        step: float = 0.1,
        max_lines: int = MAX_LINES,
        grace: float = ROTATED_GRACE,
    ) -> None:
        self.path = path
        self._sleep = sleep
        self._step = step
        self._max = max_lines
        self._grace = grace
        self._lost = 0
        self._old: _Followed | None = None  # renamed away, still drained
        self._carry: list[Line] = []  # lines of a file let go, not yet returned
        self._seen: OrderedDict[tuple[int, int], tuple[int, bytes]] = OrderedDict()
        self._cur = self._open()
        if cursor and cursor.startswith("file:") and not self._fifo:
            try:
                _, dev, ino, off = cursor.split(":")
                if (int(dev), int(ino)) == self._cur.id and os.fstat(self._cur.fd).st_size >= int(
                    off
                ):
                    self._cur.seek(int(off), b"")
            except (ValueError, OSError):
                pass

    def _open(self) -> _Followed:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            st = os.fstat(fd)
            self._fifo = stat.S_ISFIFO(st.st_mode)
            if self._fifo:
                # Also holding the write end keeps poll() from reporting POLLHUP
                # in a tight loop whenever no writer is attached.
                try:
                    rw = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                    os.close(fd)
                    fd = rw
                except OSError:
                    pass
        except PermissionError:
            raise ReaderError("permission", f"cannot read {self.path}: permission denied") from None
        except FileNotFoundError:
            raise ReaderError("missing", f"{self.path} does not exist") from None
        except OSError as exc:
            raise ReaderError("open", f"cannot open {self.path}: {exc.strerror or exc}") from None
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        return _Followed(fd, (st.st_dev, st.st_ino))

    # --- reading -----------------------------------------------------------------

    def read(self, timeout: float) -> list[Line]:
        deadline = time.monotonic() + timeout
        while True:
            self._truncated()
            lines, self._carry = self._carry, []
            if self._old is not None:
                # Lines of the renamed file resume, after a restart, where the
                # current file stands: the old one is not reopened by path.
                self._drain(self._old, lines, self.cursor())
                if time.monotonic() - self._old.changed_at >= self._grace:
                    self._let_go_old()
                    lines += self._carry
                    self._carry = []
            self._drain(self._cur, lines)
            if lines:
                return lines
            if self._rotated():
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            if self._fifo:
                self._poll.poll(int(left * 1000))
            else:
                self._sleep(min(self._step, left))

    def _drain(self, f: _Followed, lines: list[Line], cursor: str | None = None) -> None:
        start = len(lines)
        while len(lines) - start < self._max:
            try:
                chunk = os.read(f.fd, 65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise ReaderError("read", f"reading {self.path}: {exc.strerror or exc}") from None
            if not chunk:
                break
            f.changed_at = time.monotonic()
            self._split(f, chunk, lines, cursor)

    def _split(self, f: _Followed, chunk: bytes, lines: list[Line], cursor: str | None) -> None:
        data = f.buf + chunk
        *complete, rest = data.split(b"\n")
        for raw in complete:
            f.offset += len(raw) + 1 + f.skipped
            f.skipped = 0
            text = raw[: MAX_RECORD + 1].decode("utf-8", "replace")
            lines.append(Line(text, cursor if cursor is not None else self._cursor_at(f)))
        if complete:
            f.tail = (f.tail + data[: len(data) - len(rest)])[-TAIL:]
        # An endless line keeps only a record's worth (the parser cuts and
        # counts it); the rest is skipped but still counted in the offset.
        if len(rest) > MAX_RECORD + 1:
            f.skipped += len(rest) - (MAX_RECORD + 1)
            rest = rest[: MAX_RECORD + 1]
        f.buf = rest

    # --- rotation ----------------------------------------------------------------

    def _rotated(self) -> bool:
        """Switch to the file the path names now, keeping the renamed one open."""
        if self._fifo:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False  # between rename and re-create: keep the old one
        if (st.st_dev, st.st_ino) == self._cur.id:
            return False
        if self._old is not None:
            self._let_go_old()
        self._old = self._cur
        self._old.changed_at = time.monotonic()
        self._cur = self._open()
        self._resume(self._cur)
        return True

    def _truncated(self) -> None:
        """Start over when the file shrank or was rewritten (copytruncate).

        Checked before every read: a writer fast enough to refill the file
        past our offset must not hand us the middle of its new lines.
        """
        cur = self._cur
        if self._fifo or (os.fstat(cur.fd).st_size >= cur.end() and not cur.rewritten()):
            return
        self._from_copy(cur)
        self._lost += 1  # the copy-to-truncate window cannot be read by anyone
        cur.seek(0, b"")

    def _let_go_old(self) -> None:
        """Read the renamed file to its end one last time and close it."""
        old, self._old = self._old, None
        if old is None:
            return
        self._drain(old, self._carry, self.cursor())
        self._remember(old)
        os.close(old.fd)

    def _remember(self, f: _Followed) -> None:
        self._seen[f.id] = (f.offset, f.tail)
        self._seen.move_to_end(f.id)
        while len(self._seen) > REMEMBERED:
            self._seen.popitem(last=False)

    def _resume(self, f: _Followed) -> None:
        """A file read before (renamed away and back) goes on where it stopped."""
        offset, tail = self._seen.pop(f.id, (0, b""))
        if offset == 0:
            return
        f.seek(offset, tail)
        if os.fstat(f.fd).st_size < offset or f.rewritten():
            f.seek(0, b"")  # the inode was reused for another file

    def _from_copy(self, cur: _Followed) -> None:
        """After copytruncate, read what the writer added past our offset from the copy."""
        if not cur.tail:
            return  # nothing read yet to recognise the copy by
        folder, base = os.path.split(self.path)
        try:
            entries = list(os.scandir(folder or "."))
        except OSError:
            return
        for entry in entries:
            if not entry.name.startswith(base) or entry.name == base:
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size < cur.offset:
                    continue
                copy = _Followed(fd, (st.st_dev, st.st_ino))
                copy.seek(cur.offset, cur.tail)
                if copy.rewritten():
                    continue
                # after a restart these lines are behind us: resume at the truncated file's start
                self._drain(copy, self._carry, f"file:{cur.id[0]}:{cur.id[1]}:0")
                return
            finally:
                os.close(fd)

    def _cursor_at(self, f: _Followed) -> str:
        return f"file:{f.id[0]}:{f.id[1]}:{f.offset}"

    def cursor(self) -> str:
        return "" if self._fifo else self._cursor_at(self._cur)

    def take_lost(self) -> int:
        lost, self._lost = self._lost, 0
        return lost

    def close(self) -> None:
        for f in (self._cur, self._old):
            if f is not None:
                try:
                    os.close(f.fd)
                except OSError:
                    pass
