"""Bursts of one Xid on one GPU, kept apart per process, and multi-line reports joined.

Pure bookkeeping for the tracker (no I/O, no clock). A burst is the repeats
of one fault by one process within the burst window: two pids hitting the
same Xid on the same GPU are two faults. A multi-line report (Xid 13 prints
GPC/TPC/SM lines, an ESR line, then a line with pid and channel, within a
few ms; only some lines name the process) becomes one event that has the
pid and every parsed field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gpuwatchd.model import Event

__all__ = ["Burst", "Bursts", "JOIN_WINDOW", "MULTILINE_XIDS", "join_lines"]

JOIN_WINDOW = 0.25  # seconds from a report's first line to its last
MULTILINE_XIDS = frozenset({13})  # codes the driver reports over several lines
# What the line that names the process brings to the joined event.
_PROCESS_KEYS = frozenset(
    {
        "pid",
        "process",
        "attribution",
        "pod_uid",
        "container_id",
        "slurm_job",
        "slurm_step",
        "slurm_uid",
        "unit",
        "cgroup",
        "rank",
        "local_rank",
        "world_size",
        "master_addr",
        "master_port",
        "torchelastic_run_id",
        "slurm_procid",
    }
)


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


def join_lines(first: Event, line: Event) -> Event:
    """One event from two lines of one report: the pid line's process, every field kept."""
    attrs = dict(first.attrs)
    extra = dict(line.attrs)
    if extra.get("pid") and not attrs.get("pid"):
        for k in [k for k in attrs if k in _PROCESS_KEYS or k.startswith("workload")]:
            del attrs[k]
        attrs.update(
            (k, v) for k, v in extra.items() if k in _PROCESS_KEYS or k.startswith("workload")
        )
    for k, v in extra.items():
        attrs.setdefault(k, v)
    details = [d for d in first.message.split(" | ") if d]
    if line.message and line.message not in details:
        details.append(line.message)
    attrs["lines"] = str(int(attrs.get("lines") or 1) + int(extra.get("lines") or 1))
    return replace(first, message=" | ".join(details), attrs=tuple(sorted(attrs.items())))


class Bursts:
    """The open bursts of one (kind, GPU, code), keyed by pid."""

    def __init__(self) -> None:
        self._by_pid: dict[str, Burst] = {}

    def join(self, event: Event) -> tuple[Burst, Event] | None:
        """The open report this line continues, and the joined event; None if it is a report."""
        if event.kind != "xid" or event.code not in MULTILINE_XIDS:
            return None
        pid = event.attr("pid")
        for burst in sorted(self._by_pid.values(), key=lambda b: -b.start):
            first = burst.event
            if first is None or not 0 <= event.time - burst.start <= JOIN_WINDOW:
                continue
            if pid and burst.pid:
                continue  # a pid line after a pid line: another report (or process)
            if not pid and event.message in burst.lines:
                continue  # the same line again: a repeat, not a continuation
            if pid:  # the line that names the process completes a pid-less report
                del self._by_pid[burst.pid]
                burst.pid = pid
                self._by_pid[pid] = burst
            burst.last = max(burst.last, event.time)
            burst.lines.add(event.message)
            burst.event = join_lines(first, event)
            return burst, burst.event
        return None

    def pids(self, now: float, window: float, most: int = 16) -> list[str]:
        """The pids with a burst within `window` of `now`, numerically, at most `most`."""
        live = [b.pid for b in self._by_pid.values() if b.pid and now - b.last <= window]
        return sorted(live, key=lambda p: (len(p), p))[:most]

    def observe(self, event: Event, window: float, new_id: Callable[[], str]) -> tuple[str, Burst]:
        """ "repeat" of this process's burst within `window`, or a "new" burst."""
        pid = event.attr("pid")
        burst = self._by_pid.get(pid)
        if burst is None and not pid:  # a report without pid repeats the latest burst
            burst = max(self._by_pid.values(), key=lambda b: b.last, default=None)
        if burst is not None and 0 <= event.time - burst.last <= window:
            burst.count += 1
            burst.last = max(burst.last, event.time)
            burst.event = None  # a repeat closes the report before it
            return "repeat", burst
        burst = Burst(event.attr("burst_id") or new_id(), event.time, event.time, pid)
        burst.event, burst.lines = event, {event.message}
        for old in [k for k, b in self._by_pid.items() if event.time - b.last > window]:
            del self._by_pid[old]
        self._by_pid[pid] = burst
        return "new", burst
