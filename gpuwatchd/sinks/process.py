"""process_* metrics of the daemon itself: CPU, memory, open file descriptors.

The same families and help texts as the Prometheus client libraries' process
collector, so dashboards and alerts written for any exporter work unchanged.
Read from /proc at render time; a file that cannot be read leaves its
families out of that scrape.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from gpuwatchd.sinks.exposition import Family

__all__ = ["ProcessCollector"]


class ProcessCollector:
    """Reads /proc/self (or `proc`/`pid`) on every collect."""

    def __init__(self, proc: str = "/proc", pid: str = "self") -> None:
        self._dir = os.path.join(proc, pid)
        self._ticks = float(os.sysconf("SC_CLK_TCK"))
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._btime = _boot_time(proc)

    def collect(self) -> Iterator[Family]:
        """vmem, RSS, start time and CPU from stat; max and open fds from limits and fd/."""
        if self._btime is None:
            return
        try:
            with open(os.path.join(self._dir, "stat"), "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()
        except OSError:
            fields = []
        if len(fields) > 21:
            yield _one(
                "process_virtual_memory_bytes", "Virtual memory size in bytes.", float(fields[20])
            )
            yield _one(
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                float(fields[21]) * self._page,
            )
            yield _one(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                float(fields[19]) / self._ticks + self._btime,
            )
            cpu = (float(fields[11]) + float(fields[12])) / self._ticks
            yield _one(
                "process_cpu_seconds_total",
                "Total user and system CPU time spent in seconds.",
                cpu,
                "counter",
            )
        try:
            max_fds = _max_open_files(os.path.join(self._dir, "limits"))
            open_fds = len(os.listdir(os.path.join(self._dir, "fd")))
        except OSError:
            return
        yield _one("process_open_fds", "Number of open file descriptors.", float(open_fds))
        if max_fds is not None:
            yield _one("process_max_fds", "Maximum number of open file descriptors.", max_fds)


def _one(name: str, help_text: str, value: float, kind: str = "gauge") -> Family:
    fam = Family(name, kind, help_text)
    fam.add((), value)
    return fam


def _boot_time(proc: str) -> float | None:
    try:
        with open(os.path.join(proc, "stat"), "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _max_open_files(path: str) -> float | None:
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"Max open files"):
                soft = line.split()[3]
                return float("inf") if soft == b"unlimited" else float(soft)
    return None
