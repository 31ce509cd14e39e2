"""Where kernel log lines come from: /dev/kmsg, the systemd journal, or a file/pipe.

The journal reader lives in journal.py (`journal_line`, its record format, is
here), the file reader in filereader.py.

Each reader implements `LineReader`: `read(timeout)` waits at most
`timeout` seconds for input and returns what is there, each line with a
cursor that says where to resume after it. Readers raise `ReaderError`
(a SourceError) when they cannot go on; the source reopens them with
backoff.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from gpuwatchd.errors import SourceError
from gpuwatchd.sources.kmsg.parse import MAX_RECORD

__all__ = [
    "KmsgReader",
    "Line",
    "LineReader",
    "ReaderError",
    "journal_line",
    "permission_message",
]

READ_SIZE = 16384  # /dev/kmsg returns EINVAL when a record does not fit; they are < 8 KiB
MAX_LINES = 20000  # per read(): bounds one poll so the heartbeat stays fresh


class ReaderError(SourceError):
    """The reader cannot continue; `reason` is a short token (permission, missing, read...)."""


class Line(NamedTuple):
    text: str
    cursor: str = ""


class LineReader(Protocol):
    """A stream of kernel log lines with resumable cursors.

    `read(timeout)` returns the lines available now, waiting up to
    `timeout` seconds when there are none. `cursor()` is where a new
    reader should resume to neither repeat nor miss a line. `take_lost()`
    returns and resets the number of records that were lost (overwritten
    before they were read).
    """

    name: str

    def read(self, timeout: float) -> list[Line]: ...

    def cursor(self) -> str: ...

    def take_lost(self) -> int: ...

    def close(self) -> None: ...


def permission_message(path: str, procfs: str = "/proc") -> str:
    """Why reading the kernel log was refused, and what fixes it."""
    try:
        with open(os.path.join(procfs, "sys/kernel/dmesg_restrict")) as f:
            restrict = f.read().strip()
    except OSError:
        restrict = "unknown"
    return (
        f"cannot read {path}: permission denied. Reading the kernel log needs CAP_SYSLOG "
        f"when kernel.dmesg_restrict=1 (here: {restrict}); run gpuwatchd as root or grant "
        "it CAP_SYSLOG (systemd: AmbientCapabilities=CAP_SYSLOG), or use backend: journald"
    )


# --- /dev/kmsg ------------------------------------------------------------------


class KmsgReader:
    """Raw records from /dev/kmsg: one record per read(2), non-blocking, poll(2) to wait.

    Starts at the oldest record still in the ring buffer (never at the end:
    Xids logged while the driver came up must not be missed) and skips
    records at or before `after_seq`, the last one a previous run handled
    in this same boot. A sequence number jump means records were
    overwritten before we read them (the kernel answers EPIPE once when that
    happens); the gap is counted as lost.
    """

    name = "kmsg"

    def __init__(
        self,
        path: str,
        boot_id: str,
        after_seq: int | None = None,
        procfs: str = "/proc",
        read: Callable[[int, int], bytes] = os.read,
        max_lines: int = MAX_LINES,
        fd: int | None = None,
    ) -> None:
        self.path = path
        self.boot_id = boot_id
        self._read = read
        self._max = max_lines
        self._last = after_seq
        self._lost = 0
        self._pending = b""
        self.epipes = 0
        try:
            # `fd`: an already open descriptor (tests hand in a SOCK_SEQPACKET
            # socket, which like /dev/kmsg returns one record per read)
            self._fd = (
                fd if fd is not None else os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            )
        except PermissionError:
            raise ReaderError("permission", permission_message(path, procfs)) from None
        except FileNotFoundError:
            raise ReaderError("missing", f"{path} does not exist") from None
        except OSError as exc:
            raise ReaderError("open", f"cannot open {path}: {exc.strerror or exc}") from None
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN | select.POLLPRI)
        # interrupt() writes here so a long wait in poll() ends at once on stop
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll.register(self._wake_r, select.POLLIN)

    def read(self, timeout: float) -> list[Line]:
        lines = self._drain()
        if lines:
            return lines
        try:
            ready = self._poll.poll(max(0, int(timeout * 1000)))
        except InterruptedError:
            ready = []
        if any(fd == self._wake_r for fd, _ in ready):
            try:
                os.read(self._wake_r, 64)
            except OSError:
                pass
        return self._drain() if ready else []

    def interrupt(self) -> None:
        """End a read() waiting in poll() now (from another thread)."""
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # pipe full: a wake-up is already pending

    def _drain(self) -> list[Line]:
        lines: list[Line] = []
        while len(lines) < self._max:
            try:
                chunk = self._read(self._fd, READ_SIZE)
            except BlockingIOError:
                break
            except BrokenPipeError:
                # Records were overwritten; the next read returns the oldest
                # one left and the sequence gap tells how many we lost.
                self.epipes += 1
                continue
            except InterruptedError:
                continue
            except PermissionError:
                raise ReaderError("permission", permission_message(self.path)) from None
            except OSError as exc:
                raise ReaderError("read", f"reading {self.path}: {exc.strerror or exc}") from None
            if not chunk:
                break  # end of a file or pipe (tests); /dev/kmsg never ends
            self._records(chunk, lines)
        return lines

    def _records(self, chunk: bytes, out: list[Line]) -> None:
        # One read of /dev/kmsg is one record; files and pipes (tests) give many.
        data = self._pending + chunk
        *complete, pending = data.split(b"\n")
        # Keep one record's worth of an unterminated line: a hostile writer must
        # not grow memory; the parser counts the line as truncated.
        self._pending = pending[: MAX_RECORD + 1]
        for raw in complete:
            if not raw or raw[:1] == b" ":
                continue  # continuation lines: " SUBSYSTEM=...", " DEVICE=..."
            text = raw.decode("utf-8", "replace")
            head = text.partition(";")[0].split(",")
            try:
                seq = int(head[1])
            except (IndexError, ValueError):
                continue  # not a record; nothing to resume from
            if self._last is not None:
                if seq <= self._last:
                    continue  # handled by an earlier run in this boot
                if seq > self._last + 1:
                    self._lost += seq - self._last - 1
            self._last = seq
            out.append(Line(text, f"kmsg:{self.boot_id}:{seq}"))

    def cursor(self) -> str:
        return f"kmsg:{self.boot_id}:{self._last}" if self._last is not None else ""

    def take_lost(self) -> int:
        lost, self._lost = self._lost, 0
        return lost

    def close(self) -> None:
        for fd in (self._fd, self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


# --- journald -------------------------------------------------------------------


def journal_line(entry: Mapping[str, Any]) -> str:
    """A journal entry as a raw kmsg record, so one parser reads both.

    The kernel transport keeps the record's facility and priority and its
    kernel timestamp (_SOURCE_MONOTONIC_TIMESTAMP); a multi-line message is
    escaped the way /dev/kmsg escapes it.
    """
    message = entry.get("MESSAGE", "")
    if isinstance(message, bytes):
        message = message.decode("utf-8", "replace")
    facility = _as_int(entry.get("SYSLOG_FACILITY"), 0)
    priority = _as_int(entry.get("PRIORITY"), 6)
    mono = entry.get("_SOURCE_MONOTONIC_TIMESTAMP")
    seconds = getattr(mono, "total_seconds", None)  # systemd-python gives a timedelta
    usec = int(seconds() * 1e6) if callable(seconds) else _as_int(mono, 0)
    text = str(message).rstrip("\n").replace("\n", "\\x0a")
    return f"{facility * 8 + priority},0,{usec},-;{text}"


def _as_int(value: object, default: int) -> int:
    try:
        return int(value)  # type: ignore[call-overload, no-any-return]
    except (TypeError, ValueError):
        return default
