"""The hang path's cheap per-rank probe: liveness, CPU time, I/O bytes, children.

Read every `hangs.probe_interval_seconds` (3 s) for every rank of every job,
independent of the NVML poll: `/proc/PID/stat` (state, CPU time, start time),
`/proc/PID/io` (rchar + wchar: bytes read and written through any file or
socket, so a checkpoint to a network filesystem counts), and the same for the
process's children (data-loader workers, compiler subprocesses), listed in
`/proc/PID/task/PID/children`. A few small reads per process; no ptrace.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from gpuwatchd.jobview import JobView, RankView
from gpuwatchd.sources.hangs.jobs import read_cpu_seconds

__all__ = ["probe_jobs", "probe_rank", "read_uptime"]

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MAX_CHILDREN = 64


def read_uptime(procfs: str = "/proc") -> float | None:
    """Seconds since boot, or None."""
    try:
        with open(f"{procfs}/uptime", "rb") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stat(pid: int, procfs: str) -> tuple[str, float, float] | None:
    """(state letter, utime+stime seconds, start time in seconds since boot), None if gone."""
    try:
        with open(f"{procfs}/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 20:
        return None
    try:
        cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
        return fields[0], cpu, int(fields[19]) / _CLK_TCK
    except ValueError:
        return None


def _io(pid: int, procfs: str) -> int | None:
    """rchar + wchar of a process; None when unreadable (another user without ptrace)."""
    try:
        with open(f"{procfs}/{pid}/io", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("rchar", "wchar"):
            try:
                total += int(value)
            except ValueError:
                return None
    return total


def _children(pid: int, procfs: str) -> list[int]:
    try:
        with open(f"{procfs}/{pid}/task/{pid}/children", "rb") as f:
            return [int(c) for c in f.read().split()[:MAX_CHILDREN]]
    except (OSError, ValueError):
        return []


def probe_rank(rank: RankView, procfs: str = "/proc", uptime: float | None = None) -> RankView:
    """The rank with its liveness, CPU time, I/O bytes and its children's, read now."""
    pid = rank.pid
    st = _stat(pid, procfs)
    if st is None:
        if os.path.isdir(f"{procfs}/{pid}"):  # a procfs without stat (a fixture tree)
            return dataclasses.replace(rank, cpu_seconds=read_cpu_seconds(pid, procfs))
        return dataclasses.replace(rank, state="gone")
    state, cpu, started = st
    child_cpu = 0.0
    child_io: int | None = 0
    for child in _children(pid, procfs):
        cst = _stat(child, procfs)
        if cst is not None:
            child_cpu += cst[1]
        cio = _io(child, procfs)
        child_io = None if cio is None or child_io is None else child_io + cio
    return dataclasses.replace(
        rank,
        state=state,
        cpu_seconds=cpu,
        io_bytes=_io(pid, procfs),
        child_cpu_seconds=child_cpu,
        child_io_bytes=child_io,
        age_seconds=max(0.0, uptime - started) if uptime is not None else None,
    )


def probe_jobs(jobs: Iterable[JobView], procfs: str = "/proc") -> list[JobView]:
    """Every job with each rank probed."""
    uptime = read_uptime(procfs)
    return [
        dataclasses.replace(j, ranks=tuple(probe_rank(r, procfs, uptime) for r in j.ranks))
        for j in jobs
    ]
