"""Bursts of one Xid on one GPU, kept apart per process, and multi-line reports joined.

Pure bookkeeping for the tracker (no I/O, no clock). A burst is the repeats
of one fault by one process within the burst window: two pids hitting the
same Xid on the same GPU are two faults. A multi-line report (Xid 13 prints
GPC/TPC/SM lines, an ESR line, then a line with pid and channel, within a
few ms; only some lines name the process) becomes one event that has the
pid and every parsed field. A report is bounded: the SM lines of one
GPC/TPC/SM, one ESR line and one line naming the process, at most
MAX_REPORT_LINES lines and MAX_MESSAGE_CHARS of text; any other line starts
the next report, so a flood of reports is counted report by report and
never grows one event.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gpuwatchd.model import Event
from gpuwatchd.model.xid import PROCESS_JOB_KEYS

__all__ = [
    "Burst",
    "Bursts",
    "JOIN_WINDOW",
    "MAX_MESSAGE_CHARS",
    "MAX_REPORT_LINES",
    "MULTILINE_XIDS",
    "join_lines",
    "pid_of",
    "report_part",
]

JOIN_WINDOW = 0.25  # seconds from a report's first line to its last
MULTILINE_XIDS = frozenset({13})  # codes the driver reports over several lines
# Xid 13 prints a warp and a global exception line per SM, an ESR line and a pid line;
# a few spare for driver versions that add one.
MAX_REPORT_LINES = 6
_START = operator.attrgetter("start")
MAX_MESSAGE_CHARS = 8192  # the kernel's record cap (PRINTK_MESSAGE_MAX)


@dataclass
class Burst:
    """Repeats of one fault by one process (pid "" = none named yet)."""

    id: str
    start: float
    last: float
    pid: str
    count: int = 1
    event: Event | None = None  # the report being joined, while more lines may come
    lines: set[str] = field(default_factory=set)
    parts: set[str] = field(default_factory=set)  # report_part()s of the report's lines
    where: str = ""  # the report's GPC/TPC/SM

    def open_report(self, event: Event) -> None:
        """Start joining a report at `event` (its first line)."""
        self.start, self.event, self.lines = event.time, event, {event.message}
        self.parts, self.where = {report_part(event)}, _where(event)

    def continues(self, event: Event) -> bool:
        """Whether `event` is a further line of the open report (see the module docstring)."""
        if self.event is None or "pid" in self.parts or len(self.lines) >= MAX_REPORT_LINES:
            return False  # none open, or its last line (the process's) came, or full
        if not 0 <= event.time - self.start <= JOIN_WINDOW or event.message in self.lines:
            return False  # too late, or the same line again: a repeat
        part = report_part(event)
        if part == "pid":
            pid = pid_of(event)
            return not self.pid or self.pid == pid  # another pid: another process's report
        if part == "sm":  # an SM line after the ESR line, or of another SM: the next report
            return "esr" not in self.parts and self.where in ("", _where(event))
        return part not in self.parts or part == "other"


def pid_of(event: Event) -> str:
    """The report's pid as the bursts key it ("" when it names none)."""
    xid = event.xid
    pid = xid.attribution.pid if xid is not None else None
    return "" if pid is None else str(pid)


def report_part(event: Event) -> str:
    """Which line of a multi-line report `event` is: "pid", "sm", "esr" or "other"."""
    if pid_of(event):
        return "pid"
    if event.xid is not None and event.xid.sm is not None:
        return "sm"
    return "esr" if "ESR " in event.message else "other"


def _where(event: Event) -> str:
    xid = event.xid
    if xid is None or xid.sm is None:
        return ""
    return "/".join("" if n is None else str(n) for n in (xid.gpc, xid.tpc, xid.sm))


def _is_process_key(key: str) -> bool:
    return key in PROCESS_JOB_KEYS or key.startswith("workload")


def join_lines(first: Event, line: Event) -> Event:
    """One event from two lines of one report: the pid line's process, every field kept."""
    fields, other = first.xid, line.xid
    if fields is None or other is None:
        return first
    if other.attribution.pid is not None and fields.attribution.pid is None:
        theirs = other.attribution
        job = {k: v for k, v in fields.attribution.job if not _is_process_key(k)}
        job.update((k, v) for k, v in theirs.job if _is_process_key(k))
        who = replace(
            fields.attribution,
            pid=theirs.pid,
            process=theirs.process,
            verified=theirs.verified,
            job=tuple(sorted(job.items())),
        )
        fields = replace(fields, attribution=who)
    fields = replace(fields.filled_from(other), lines=fields.lines + other.lines)
    details = [d for d in first.message.split(" | ") if d]
    if line.message and line.message not in details:
        details.append(line.message)
    message = " | ".join(details)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "\u2026"
    return first.carrying(fields, message=message)


class Bursts:
    """The open bursts of one (kind, GPU, code), keyed by pid."""

    def __init__(self) -> None:
        self._by_pid: dict[str, Burst] = {}
        self._order: list[str] | None = None  # the pids numerically; None after a change

    def join(self, event: Event) -> tuple[Burst, Event] | None:
        """The open report this line continues, and the joined event; None if it is a report."""
        if event.kind != "xid" or event.code not in MULTILINE_XIDS:
            return None
        pid = pid_of(event)
        for burst in sorted(self._by_pid.values(), key=_START, reverse=True):
            first = burst.event
            if first is None or not burst.continues(event):
                continue
            if pid and not burst.pid:  # the line that names the process completes the report
                del self._by_pid[burst.pid]
                burst.pid = pid
                self._by_pid[pid] = burst
                self._order = None
            burst.last = max(burst.last, event.time)
            burst.lines.add(event.message)
            burst.parts.add(report_part(event))
            burst.where = burst.where or _where(event)
            burst.event = join_lines(first, event)
            return burst, burst.event
        return None

    def pids(self, now: float, window: float, most: int = 16) -> list[str]:
        """The pids with a burst within `window` of `now`, numerically, at most `most`."""
        if self._order is None:  # sorted once per change of the pids, not per report
            keys = [p for p in self._by_pid if p]
            # (length, text): numeric order for pids, compared in C
            self._order = [p for _, p in sorted(zip(map(len, keys), keys, strict=True))]
        by_pid = self._by_pid
        return [p for p in self._order if now - by_pid[p].last <= window][:most]

    def observe(self, event: Event, window: float, new_id: Callable[[], str]) -> tuple[str, Burst]:
        """ "repeat" of this process's burst within `window`, or a "new" burst."""
        pid = pid_of(event)
        burst = self._by_pid.get(pid)
        if burst is None and not pid:  # a report without pid repeats the latest burst
            burst = max(self._by_pid.values(), key=lambda b: b.last, default=None)
        if burst is not None and 0 <= event.time - burst.last <= window:
            burst.count += 1
            burst.last = max(burst.last, event.time)
            burst.open_report(event)  # a repeat's further lines join it, uncounted
            return "repeat", burst
        stored = event.xid.burst_id if event.xid is not None else ""  # a restored report's
        burst = Burst(stored or new_id(), event.time, event.time, pid)
        burst.open_report(event)
        for old in [k for k, b in self._by_pid.items() if event.time - b.last > window]:
            del self._by_pid[old]
        self._by_pid[pid] = burst
        self._order = None
        return "new", burst
