"""Kernel log source: Xid and SXid reports from /dev/kmsg, the journal, or a file.

`poll()` waits up to half a second for kernel records itself (the
source's interval is tiny), so a report reaches the state within a second
of the driver printing it. Events carry what the line says (code, bus id,
pid, process, detail, cursor, attribution); classifying them against the
Xid catalog is the health layer's job (health/xid/stage.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gpuwatchd.bootid import read_boot_id
from gpuwatchd.clock import Clock
from gpuwatchd.model import (
    Event,
    GpuInventory,
    KmsgState,
    MetricSpec,
    Sample,
    XidAttribution,
    XidFields,
)
from gpuwatchd.sources.kmsg import process_kills
from gpuwatchd.sources.kmsg.filereader import FileReader
from gpuwatchd.sources.kmsg.journal import JournalReader
from gpuwatchd.sources.kmsg.parse import (
    GPU,
    SXID,
    UNPARSED,
    XID,
    KmsgParser,
    KmsgRecord,
    parse_line,
)
from gpuwatchd.sources.kmsg.readers import (
    KmsgReader,
    LineReader,
    ReaderError,
)
from gpuwatchd.sources.workloads.cgroup import REUSED, UNVERIFIED, attribute
from gpuwatchd.sources.workloads.environ import read_torch_env

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.sources.context import SourceContext

__all__ = [
    "KmsgSource",
    "METRICS",
    "open_reader",
    "parse_line",
]

log = logging.getLogger("gpuwatchd.sources.kmsg.source")

METRICS = (
    MetricSpec(
        "gpuwatchd_kmsg_reader_up",
        "gauge",
        "1 while the kernel log is being read; 0 while the reader fails and retries"
        " (Xids are not seen meanwhile)",
        ("backend",),
    ),
    MetricSpec(
        "gpuwatchd_kmsg_records_read_total", "counter", "kernel log records read", ("backend",)
    ),
    MetricSpec(
        "gpuwatchd_kmsg_records_lost_total",
        "counter",
        "kernel log records lost before they were read: /dev/kmsg sequence gaps, or journal"
        " entries rotated away unread (all transports: an upper bound), or one per copytruncate"
        " of a log file (its copy-to-truncate window is unreadable) and one per rotated file"
        " not found at start (possible losses)",
        ("backend",),
    ),
    MetricSpec(
        "gpuwatchd_kmsg_reader_restarts_total",
        "counter",
        "times the kernel log reader was reopened after an error",
        ("backend",),
    ),
    MetricSpec(
        "gpuwatchd_kmsg_reports_total",
        "counter",
        "Xid/SXid reports read from the kernel log",
        ("kind",),
    ),
    MetricSpec(
        "gpuwatchd_kmsg_unparsed_xid_lines_total",
        "counter",
        "lines that look like an Xid/SXid report but could not be parsed (logged once per shape)",
    ),
    MetricSpec(
        "gpuwatchd_kmsg_truncated_lines_total",
        "counter",
        "kernel log lines longer than a kernel record (8 KiB), cut to that size before parsing",
    ),
    MetricSpec(
        "gpuwatchd_kmsg_spoofed_xid_lines_total",
        "counter",
        "Xid/SXid lines written by user space, not the kernel; ignored unless"
        " sources.kmsg.accept_userspace",
    ),
    *process_kills.METRICS,
)

WAIT = 0.5  # longest a poll waits for input: detection latency stays under a second
# A reader that blocks on its descriptor (/dev/kmsg) returns as soon as a record
# arrives, so its wait bounds only the idle wake-ups (and publishes); the runner's
# stop() interrupts it. Well under the watchdog's 30 s staleness limit.
BLOCKING_WAIT = 10.0
# An NVSwitch prints the lines of one SXid report a few ms apart, and a read may
# end between them: a started report waits this long after its last line for the rest.
SXID_HOLD = 0.5
ATTRIBUTE_MAX_AGE = 120.0  # older records: the pid may belong to someone else by now
MAX_SHAPES = 1000


def open_reader(backend: str, cfg: Config, boot_id: str, cursor: str | None) -> LineReader:
    """Open the configured reader; `auto` tries /dev/kmsg, then the journal."""
    kcfg = cfg.sources.kmsg
    after: int | None = None
    if cursor and cursor.startswith(f"kmsg:{boot_id}:") and boot_id != "unknown":
        try:
            after = int(cursor.rsplit(":", 1)[1])
        except ValueError:
            after = None
    journal_cursor = cursor[len("journal:") :] if cursor and cursor.startswith("journal:") else None
    if backend == "kmsg":
        return KmsgReader(cfg.paths.kmsg, boot_id, after, procfs=cfg.paths.procfs)
    if backend == "journald":
        return JournalReader(journal_cursor)
    if backend == "file":
        if not kcfg.file:
            raise ReaderError("config", "backend file needs sources.kmsg.file")
        return FileReader(kcfg.file, cursor)
    problems = []
    for name, opener in (
        (
            cfg.paths.kmsg,
            lambda: KmsgReader(cfg.paths.kmsg, boot_id, after, procfs=cfg.paths.procfs),
        ),
        ("journald", lambda: JournalReader(journal_cursor)),
    ):
        try:
            return opener()
        except ReaderError as exc:
            problems.append(f"{name}: {exc}")
    raise ReaderError(
        "no_backend", "no kernel log is readable, Xids cannot be detected: " + " | ".join(problems)
    )


class KmsgSource:
    """Follows the kernel log and emits one Event per Xid/SXid report."""

    name = "kmsg"
    interval = 0.01  # poll() does the waiting

    def __init__(
        self,
        cfg: Config,
        ctx: SourceContext,
        opener: Callable[[str | None], LineReader] | None = None,
        wait: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Clock | None = None,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.clock = clock or ctx.clock
        self.backend = cfg.sources.kmsg.backend
        self.boot_id = read_boot_id(cfg.paths.boot_id)
        self._opener = opener or (lambda cur: open_reader(self.backend, cfg, self.boot_id, cur))
        self._wait = WAIT if wait is None else wait
        # None: a reader that blocks on its descriptor waits BLOCKING_WAIT
        self._blocking_wait = BLOCKING_WAIT if wait is None else wait
        self._first_done = False  # the first read never waits: start-up waits for it
        if ctx.one_shot:  # `check`: read to the end of the log and stop, never wait
            self._wait = self._blocking_wait = 0.0
        self._sleep = sleep
        self._reader: LineReader | None = None
        self._cursor = ctx.load_cursor(self.name) or ""
        self._parser = KmsgParser()
        self._kills = process_kills.KillParser()  # OOM kills, segfaults, traps, hung tasks
        self._held_until = 0.0  # monotonic time when held SXid reports are handed out
        self._error = ""
        self._failures = 0
        self._retry_at = 0.0
        self._read = self._lost = self._restarts = self._unparsed = self._spoofed = 0
        self._reports = {XID: 0, SXID: 0}
        self._shapes: set[str] = set()
        self._uuids: dict[str, str] = {}
        # kernel timestamps are CLOCK_MONOTONIC; this turns them into wall time
        self._boot_wall = self.clock.time() - self.clock.monotonic()
        # seconds after boot when a read last found the log's end: what is read later was
        # logged after it (0: not yet, lines read at start may be of any age)
        self._caught_up = 0.0
        self._read_from = 0.0  # _caught_up as it was before this poll's read

    @classmethod
    def from_config(cls, cfg: Config, ctx: SourceContext) -> KmsgSource:
        return cls(cfg, ctx)

    # --- polling -----------------------------------------------------------------

    def poll(self, now: float) -> Sequence[Sample | Event]:
        reader = self._ensure_reader()
        if reader is None:
            self._sleep(min(self._wait, max(0.0, self._retry_at - self.clock.monotonic())))
            return self._samples()
        try:
            blocking = getattr(reader, "interrupt", None) is not None
            wait = self._blocking_wait if blocking else self._wait
            if not self._first_done:  # the log read to its end at start: say so now
                wait, self._first_done = 0.0, True
            if self._parser.holding():
                wait = min(wait, max(0.0, self._held_until - self.clock.monotonic()))
            self._read_from = self._caught_up
            lines = reader.read(wait)
            if not lines:
                self._caught_up = self.clock.time() - self._boot_wall
        except ReaderError as exc:
            self._fail(exc)
            return self._samples()
        except Exception as exc:  # a reader bug: back off like any failure, never spin
            log.exception("kernel log reader %s", reader.name)
            self._fail(ReaderError("bug", f"{type(exc).__name__}: {exc}"))
            return self._samples()
        self._parser.year = self._kills.year = time.localtime(now).tm_year
        index = self._gpus()
        events: list[Sample | Event] = []
        sxids = self._parser.sxid_lines
        for line in lines:
            if (kill := self._kills.feed(line.text)) is not None:
                self._handle_kill(kill, now, events)
            for rec in self._parser.feed(line.text, line.cursor):
                self._handle(rec, now, index, events)
        if self._parser.sxid_lines != sxids:
            self._held_until = self.clock.monotonic() + SXID_HOLD
        if not lines or self.clock.monotonic() >= self._held_until:  # the rest is not coming
            for rec in self._parser.flush():
                self._handle(rec, now, index, events)
        self._read += len(lines)
        self._lost += reader.take_lost()
        # Store no cursor past a held report's first line: a restart reads it again.
        held = self._parser.resume_cursor()
        self._cursor = (held if held is not None else reader.cursor()) or self._cursor
        return [*self._samples(), *events]

    def _ensure_reader(self) -> LineReader | None:
        if self._reader is not None:
            return self._reader
        if self.clock.monotonic() < self._retry_at:
            return None
        try:
            self._reader = self._opener(self._cursor or None)
        except ReaderError as exc:
            self._fail(exc)
            return None
        if self._failures:
            self._restarts += 1
            log.info("kernel log reader %s is back", self._reader.name)
        self._failures, self._error = 0, ""
        return self._reader

    def _fail(self, exc: ReaderError) -> None:
        if self._reader is not None:
            self._lost += self._reader.take_lost()
            self._cursor = self._reader.cursor() or self._cursor
            self._reader.close()
            self._reader = None
        self._failures += 1
        # Never a hot loop: at least a second, doubling up to half a minute.
        delay = min(30.0, 2.0 ** (self._failures - 1))
        self._retry_at = self.clock.monotonic() + delay
        if str(exc) != self._error:
            log.error("kernel log reader failed: %s (retrying every %.0fs at most)", exc, delay)
        self._error = str(exc)

    def _gpus(self) -> GpuInventory:
        try:
            return self.ctx.gpus()
        except Exception:
            return GpuInventory()

    # --- records -> events -------------------------------------------------------

    def _handle(
        self,
        rec: KmsgRecord,
        now: float,
        index: GpuInventory,
        out: list[Sample | Event],
    ) -> None:
        if rec.kind == GPU:
            self._uuids[rec.pci_bus_id] = rec.uuid
            return
        if rec.kind == UNPARSED:
            self._unparsed += 1
            if rec.shape not in self._shapes and len(self._shapes) < MAX_SHAPES:
                self._shapes.add(rec.shape)
                log.warning("kernel line looks like an Xid but does not parse: %s", rec.message)
            return
        if rec.kind not in (XID, SXID):
            return
        if rec.origin == "user" and not self.cfg.sources.kmsg.accept_userspace:
            self._spoofed += 1
            log.warning(
                "ignoring an Xid line written from user space, not the kernel: %s", rec.message
            )
            return
        self._reports[rec.kind] += 1
        out.append(self._event(rec, now, index))

    def _handle_kill(
        self, got: process_kills.ParsedKill, now: float, out: list[Sample | Event]
    ) -> None:
        if got.prefix.origin != "user" or self.cfg.sources.kmsg.accept_userspace:
            out.append(process_kills.to_event(got, now, self._boot_wall, self.backend != "file"))

    def _event(self, rec: KmsgRecord, now: float, index: GpuInventory) -> Event:
        when = self._time_of(rec, now)
        gpu = index.by_bus_id(rec.pci_bus_id)
        fields = XidFields(
            code=rec.code,
            gpu=str(gpu.index) if gpu is not None else "",
            uuid=(gpu.uuid if gpu is not None else "") or self._uuids.get(rec.pci_bus_id, ""),
            attribution=self._attribution(rec, when, now),
            recovery_action=rec.recovery_action,
            fatal=rec.fatal,
            detail=rec.detail,
            device=rec.device,
            host=rec.host,
            link=rec.link,
            subcode=rec.subcode,
            lines=rec.lines,
            raw=rec.message[:2048],
            cursor=rec.cursor,
            boot_id=self.boot_id,
            origin=rec.origin,
            stamp=rec.stamp,
            sequence=rec.sequence if self.backend != "file" else None,
            kernel_time="" if rec.boot_seconds is None else f"{rec.boot_seconds:.6f}",
            inferred="fallen off the bus text without an Xid number" if rec.synthetic else "",
        )
        return Event(
            kind=rec.kind,
            source=self.name,
            time=when,
            code=rec.code,
            pci_bus_id=rec.pci_bus_id,
            message=rec.detail,
            payload=fields.with_facts(rec.extras),  # gpc/tpc/sm, MIG ids... typed, the rest kept
        )

    def _time_of(self, rec: KmsgRecord, now: float) -> float:
        if rec.wall_time is not None:
            return rec.wall_time
        if rec.boot_seconds is not None and self.backend != "file":
            return self._boot_wall + rec.boot_seconds
        return now

    def _since_boot(self, rec: KmsgRecord) -> float | None:
        """Seconds after boot at which the record was logged (its process alive), if known."""
        if rec.wall_time is not None:
            return rec.wall_time - self._boot_wall
        # a file may hold another boot's records: their kernel times say nothing of this boot
        return rec.boot_seconds if self.backend != "file" else None

    def _attribution(self, rec: KmsgRecord, when: float, now: float) -> XidAttribution:
        if rec.pid is None:
            return XidAttribution(
                process=rec.process, verified="no pid in the report" if rec.kind == XID else ""
            )
        if now - when > ATTRIBUTE_MAX_AGE:
            return XidAttribution(
                pid=rec.pid,
                process=rec.process,
                verified="report too old to attribute (the pid may be reused)",
            )
        logged = self._since_boot(rec)
        if logged is None:
            # No time of its own (a bare line, or `dmesg -w > file`): it was logged after
            # the last read that found the log's end and before it arrived.
            window = (self._read_from, self.clock.time() - self._boot_wall)
            who = attribute(self.cfg.paths.procfs, rec.pid, rec.process, window[1], window[0])
        else:
            who = attribute(self.cfg.paths.procfs, rec.pid, rec.process, logged)
        found = dict(who.attrs())
        env: dict[str, str] = {}
        if self.cfg.sources.workloads.rank_env and who.status not in (
            "process gone",
            REUSED,
            UNVERIFIED,
        ):
            env = read_torch_env(self.cfg.paths.procfs, rec.pid)  # only the rank names
        start = found.pop("pid_start", ""), found.pop("reused_pid_start", "")
        return XidAttribution(
            pid=rec.pid,
            process=rec.process,
            verified=found.pop("attribution", ""),
            pid_start=start[0],
            reused_pid_start=start[1],
        ).with_job({**found, **env}.items(), keep=False)

    # --- outputs -------------------------------------------------------------------

    def _samples(self) -> list[Sample]:
        backend = self._reader.name if self._reader is not None else self.backend
        return [
            Sample.of(
                "gpuwatchd_kmsg_reader_up", 1 if self._reader is not None else 0, backend=backend
            ),
            Sample.of("gpuwatchd_kmsg_records_read_total", self._read, backend=backend),
            Sample.of("gpuwatchd_kmsg_records_lost_total", self._lost, backend=backend),
            Sample.of("gpuwatchd_kmsg_reader_restarts_total", self._restarts, backend=backend),
            Sample.of("gpuwatchd_kmsg_reports_total", self._reports[XID], kind=XID),
            Sample.of("gpuwatchd_kmsg_reports_total", self._reports[SXID], kind=SXID),
            Sample.of("gpuwatchd_kmsg_unparsed_xid_lines_total", self._unparsed),
            Sample.of("gpuwatchd_kmsg_spoofed_xid_lines_total", self._spoofed),
            Sample.of("gpuwatchd_kmsg_truncated_lines_total", self._parser.truncated),
            *self._kills.samples(),
        ]

    def status(self) -> Mapping[str, object]:
        return {
            "backend": self._reader.name if self._reader is not None else self.backend,
            "reader_up": self._reader is not None,
            "error": self._error,
            "cursor": self._cursor,
            "boot_id": self.boot_id,
            "records_read": self._read,
            "records_lost": self._lost,
            "unparsed_xid_lines": self._unparsed,
            "spoofed_xid_lines": self._spoofed,
            "retry_in_seconds": 0.0 if self._reader is not None else self._retry_in(),
        }

    def payload(self) -> KmsgState:
        """The reader's state, typed (the Xid stage stores the cursor, `check` the rest)."""
        return KmsgState(
            reader_up=self._reader is not None,
            error=self._error,
            cursor=self._cursor,
            records_read=self._read,
        )

    def _retry_in(self) -> float:
        return max(0.0, round(self._retry_at - self.clock.monotonic(), 1))

    def interrupt(self) -> None:
        """End a wait for kernel log records now (the runner stops)."""
        interrupt = getattr(self._reader, "interrupt", None)
        if interrupt is not None:
            interrupt()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
