"""Follow a kernel log written to a plain file or a FIFO, across rotation.

Rotation by rename: the writer keeps appending to the renamed file until it
reopens (syslog daemons do so only after logrotate's HUP, which may come
late), so renamed files stay open and are read beside the new file until
they are deleted, at most `MAX_RENAMED` of them (the oldest is then read to
its end and let go). Rotation by copytruncate: the file shrinks, or its
bytes before our offset change; what the writer appended after our last
read is taken from the copy when one lies beside the file, and the
truncation is counted as a possible loss (lines written between logrotate's
copy and its truncate are in neither file). A file seen earlier (renamed
away and back) resumes at the offset reached in it, never from its start.

Cursor: `file:<dev>:<inode>:<offset>:<n>-<crc32>`, the last part a
fingerprint of the n bytes before the offset. At start it tells a file
that grew from one truncated and grown again past the offset; a file
renamed while the daemon was stopped is found again by its inode and read
on from the offset, a truncated one's copy by its fingerprint. What cannot
be found is counted as a possible loss (`take_lost`). Cursors without a
fingerprint (older versions) are still accepted.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable

from gpuwatchd.sources.kmsg.parse import MAX_RECORD
from gpuwatchd.sources.kmsg.readers import MAX_LINES, Line, ReaderError

__all__ = ["FileReader", "MAX_RENAMED", "fingerprint"]

MAX_RENAMED = 4  # renamed files kept open and read (the writer may not have reopened yet)
TAIL = 256  # bytes before the offset kept to tell a rewritten file from a grown one
REMEMBERED = 16  # files whose offsets are kept for a switch back


def fingerprint(tail: bytes) -> str:
    """The cursor's fingerprint of the bytes before its offset."""
    return f"{len(tail)}-{zlib.crc32(tail):08x}"


def _matches(fd: int, offset: int, mark: str) -> bool:
    """Whether the bytes before `offset` in `fd` have the fingerprint `mark`."""
    n_text, _, _ = mark.partition("-")
    if not n_text.isdigit() or int(n_text) > offset:
        return False
    n = int(n_text)
    try:
        return fingerprint(os.pread(fd, n, offset - n)) == mark
    except OSError:
        return False


def _pread_tail(fd: int, offset: int) -> bytes:
    """The TAIL bytes before `offset` (fewer at the start of the file)."""
    try:
        return os.pread(fd, min(TAIL, offset), max(0, offset - TAIL))
    except OSError:
        return b""


class _Followed:
    """One open file and how far it has been read."""

    def __init__(self, fd: int, ident: tuple[int, int]) -> None:
        self.fd = fd
        self.id = ident
        self.offset = 0  # bytes handed out as complete lines (plus skipped ones)
        self.buf = b""
        self.skipped = 0
        self.tail = b""  # the last bytes before `offset`

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
    ) -> None:
        self.path = path
        self._sleep = sleep
        self._step = step
        self._max = max_lines
        self._lost = 0
        self._old: list[_Followed] = []  # renamed away, still read (oldest first)
        self._carry: list[Line] = []  # lines of a file let go, not yet returned
        self._seen: OrderedDict[tuple[int, int], tuple[int, bytes]] = OrderedDict()
        self._cur = self._open()
        if cursor and cursor.startswith("file:") and not self._fifo:
            try:
                self._resume_cursor(cursor)
            except (ValueError, OSError):
                pass

    def _resume_cursor(self, cursor: str) -> None:
        """Go on where the stored cursor stopped, in whatever the rotation left there."""
        _, dev, ino, off_text, *rest = cursor.split(":")
        ident, offset, mark = (int(dev), int(ino)), int(off_text), (rest[0] if rest else "")
        cur = self._cur
        if ident == cur.id:
            size = os.fstat(cur.fd).st_size
            if size >= offset and (not mark or _matches(cur.fd, offset, mark)):
                cur.seek(offset, _pread_tail(cur.fd, offset))
                return
            # truncated (and maybe grown again) while we were stopped: the copy holds the
            # rest; the copy-to-truncate window (or all of it, with no copy) is a possible loss
            if mark:
                self._from_copy(offset, mark, cur)
            self._lost += 1
            return
        renamed = self._find(ident, offset, mark)
        if renamed is None:
            self._lost += 1  # rotated away and gone (deleted, compressed): what followed is lost
            return
        self._old.append(renamed)  # read on from the offset, beside the new file

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
            for old in list(self._old):
                # Lines of a renamed file resume, after a restart, where the
                # current file stands: the old one is looked up by inode only
                # when it is the cursor's own file.
                self._drain(old, lines, self.cursor())
                if self._deleted(old):
                    self._let_go(old)
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
            self._split(f, chunk, lines, cursor)

    def _split(self, f: _Followed, chunk: bytes, lines: list[Line], cursor: str | None) -> None:
        data = f.buf + chunk
        *complete, rest = data.split(b"\n")
        for raw in complete:
            f.offset += len(raw) + 1 + f.skipped
            if f.skipped:  # the line's end was skipped, not kept: its last bytes from the file
                f.tail = _pread_tail(f.fd, f.offset)
                f.skipped = 0
            else:
                f.tail = (f.tail + raw + b"\n")[-TAIL:]
            text = raw[: MAX_RECORD + 1].decode("utf-8", "replace")
            lines.append(Line(text, cursor if cursor is not None else self._cursor_at(f)))
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
        ident = (st.st_dev, st.st_ino)
        if ident == self._cur.id:
            return False
        back = next((f for f in self._old if f.id == ident), None)
        self._old = [f for f in self._old if f is not back]
        self._old.append(self._cur)
        while len(self._old) > MAX_RENAMED:
            self._let_go(self._old[0])  # read to its end first
        if back is not None:  # renamed away and back while still open
            self._cur = back
            return True
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
        if cur.tail:
            self._from_copy(cur.offset, fingerprint(cur.tail), cur)
        self._lost += 1  # the copy-to-truncate window cannot be read by anyone
        cur.seek(0, b"")

    @staticmethod
    def _deleted(f: _Followed) -> bool:
        try:
            return os.fstat(f.fd).st_nlink == 0
        except OSError:
            return True

    def _let_go(self, old: _Followed) -> None:
        """Read a renamed file to its end one last time and close it."""
        self._old = [f for f in self._old if f is not old]
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

    def _siblings(self) -> list[os.DirEntry[str]]:
        """Files beside ours whose name starts with its name (kern.log.1, kern.log-20261126)."""
        folder, base = os.path.split(self.path)
        try:
            entries = list(os.scandir(folder or "."))
        except OSError:
            return []
        return [e for e in entries if e.name.startswith(base) and e.name != base]

    def _open_at(self, path: str, offset: int, mark: str) -> _Followed | None:
        """`path` opened at `offset` if it is a file whose bytes before it match `mark`."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size >= offset:
                if not mark or _matches(fd, offset, mark):
                    f = _Followed(fd, (st.st_dev, st.st_ino))
                    f.seek(offset, _pread_tail(fd, offset))
                    return f
        except OSError:
            pass
        os.close(fd)
        return None

    def _find(self, ident: tuple[int, int], offset: int, mark: str) -> _Followed | None:
        """The cursor's file, renamed beside ours while we were stopped, at the offset."""
        for entry in self._siblings():
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == ident:
                return self._open_at(entry.path, offset, mark)
        return None

    def _from_copy(self, offset: int, mark: str, cur: _Followed) -> bool:
        """After copytruncate, read what the writer added past `offset` from the copy."""
        for entry in self._siblings():
            copy = self._open_at(entry.path, offset, mark)
            if copy is None:
                continue
            try:
                # after a restart these lines are behind us: resume at the truncated file's start
                self._drain(copy, self._carry, f"file:{cur.id[0]}:{cur.id[1]}:0:{fingerprint(b'')}")
            finally:
                os.close(copy.fd)
            return True
        return False

    def _cursor_at(self, f: _Followed) -> str:
        return f"file:{f.id[0]}:{f.id[1]}:{f.offset}:{fingerprint(f.tail)}"

    def cursor(self) -> str:
        return "" if self._fifo else self._cursor_at(self._cur)

    def take_lost(self) -> int:
        lost, self._lost = self._lost, 0
        return lost

    def close(self) -> None:
        for f in (self._cur, *self._old):
            try:
                os.close(f.fd)
            except OSError:
                pass
        self._old = []
