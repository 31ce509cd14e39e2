"""What the hang detector remembers of one job between probes, and which verdicts stick.

A decided `rank_dead` or `rank_missing` stays decided while the rank stays dead or
missing: after a peer died, the survivors write flight recorder dumps and logs, spin
or idle, and none of that is the job's work (on 2x H100 the survivor's 270 KB dump
read as I/O progress and resolved the page 10 s after it went out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuwatchd.health.hangs.early import StackEvidence
from gpuwatchd.health.hangs.ras_view import JobRas
from gpuwatchd.jobview import JobView, RankView

__all__ = ["JobMemory", "keep_decided", "replace_ranks"]


@dataclass
class JobMemory:
    """One job's ranks, onsets and RAS answers as the detector last saw them."""

    onset: dict[str, float] = field(default_factory=dict)
    last_seen: float = 0.0
    seen: dict[int, int | None] = field(default_factory=dict)  # pid -> rank
    gone: dict[int, float] = field(default_factory=dict)  # pid -> first seen gone
    prev: dict[int, tuple[float, RankView]] = field(default_factory=dict)
    progress_at: dict[int, float] = field(default_factory=dict)  # I/O, children
    gpu_working: dict[int, bool] = field(default_factory=dict)  # as of the last reading
    worked: set[int] = field(default_factory=set)  # pids whose GPUs did real work once
    cpu_ratio: dict[int, float] = field(default_factory=dict)
    cpu_from: dict[int, float] = field(default_factory=dict)  # start of cpu_ratio's span
    ras: JobRas = field(default_factory=JobRas)
    replaced: set[int] = field(default_factory=set)  # gone pids whose rank runs again
    # A decided rank_dead / rank_missing stays decided (keep_decided): its onset, the
    # signals that decided it, and the RAS counts of the first answer after the death.
    dead_since: float | None = None
    dead_signals: str = ""
    dead_counts: tuple[tuple[str, int, str, int], ...] | None = None
    missing_since: float | None = None
    evidence: StackEvidence | None = None  # the last stack dumps taken before a verdict


def replace_ranks(job: JobView, mem: JobMemory) -> None:
    """A new live process holding a gone rank's number replaced it (elastic restart)."""
    running = {r.rank: r.pid for r in job.ranks if r.alive and r.rank is not None}
    for pid in list(mem.gone):
        rank = mem.seen.get(pid)
        if rank is not None and running.get(rank, pid) != pid:
            del mem.gone[pid]
            mem.seen.pop(pid, None)
            mem.prev.pop(pid, None)
            mem.replaced.add(pid)
            mem.ras = JobRas()  # new processes, new communicators: old answers are stale


def keep_decided(
    mem: JobMemory,
    held: dict[str, float],
    signals: dict[str, str],
    dead: bool,
    ras_named: bool,
    short: bool,
) -> None:
    """Keep a decided dead or missing rank decided while it stays dead or missing.

    After a peer died, the survivors write flight recorder dumps and logs, spin or
    idle: none of that is the job's work, and none of it may resolve the page.
    What ends it: the job ending (no rank alive: its memory is dropped), the rank
    replaced (a new process with its rank: an elastic restart) or, for a missing
    rank, started; the job tearing NCCL down; or RAS counts rising after the death.
    """
    ras = mem.ras
    if mem.dead_since is not None:
        if mem.dead_counts is None and ras.counts is not None and ras.at >= mem.dead_since:
            mem.dead_counts = ras.counts  # the first answer after the verdict
        counting = mem.dead_counts is not None and ras.counts not in (None, mem.dead_counts)
        if dead and not counting and not ras.torn_down_after(mem.dead_since):
            held["rank_dead"] = mem.dead_since
            extra = {"ras"} if ras_named else set()
            signals["rank_dead"] = "+".join(sorted(set(mem.dead_signals.split("+")) | extra))
        else:
            if counting:  # the job goes on without the ranks that left
                for pid in mem.gone:
                    mem.seen.pop(pid, None)
                    mem.replaced.add(pid)
                mem.gone.clear()
            held.pop("rank_dead", None)
            mem.dead_since, mem.dead_counts = None, None
    if mem.missing_since is not None:
        if short and not ras.rising():
            held["rank_missing"] = mem.missing_since
            signals.setdefault("rank_missing", "liveness")
        else:
            held.pop("rank_missing", None)
            mem.missing_since = None
