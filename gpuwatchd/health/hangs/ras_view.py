"""A job's NCCL RAS answers folded over time: are its collective counts still rising?

The monitor polls each NCCL job's RAS service on a slow cadence and hands the
latest answer (`RasView`) to the detector. `job_ras` keeps, per job, the
communicators that belong to it (matched by the ranks' pids, else by their GPUs
where the daemon sees other pids than the job, as in a pod), when the counts
last changed, and which ranks RAS could not reach in how many answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpuwatchd.jobview import JobView, RasCommunicator, RasReport

__all__ = ["JobRas", "RasView", "job_communicators", "job_ras"]


@dataclass(frozen=True, slots=True)
class RasView:
    """One RAS answer for one job (report None: the query failed, `error` says why)."""

    time: float
    report: RasReport | None
    error: str = ""


@dataclass(frozen=True, slots=True)
class MissingRank:
    """A rank RAS could not reach: where it ran, since when, in how many answers."""

    host: str
    pid: int | None
    first_seen: float
    answers: int
    considered_dead: bool


@dataclass(frozen=True)
class JobRas:
    """What the RAS answers said about one job so far."""

    nccl: bool = False  # some answer held a communicator of this job
    at: float = 0.0  # time of the last answer folded in
    comms: tuple[RasCommunicator, ...] = ()
    counts: tuple[tuple[str, int, str, int], ...] | None = None
    counts_since: float | None = None  # the first answer with these counts
    counts_at: float | None = None  # the latest answer with these counts
    missing: Mapping[int, MissingRank] = field(default_factory=dict)
    empty_at: float | None = None  # an answer without this job's communicators, after some had
    answers: int = 0
    rose_at: float | None = None  # the last answer whose counts differed from the one before

    def rising(self) -> bool:
        """The latest answer showed counts that moved since the previous one."""
        return self.rose_at is not None and self.rose_at == self.counts_at

    def flat_for(self) -> float:
        """How long the counts are known to have stayed the same (0 = unknown or rising)."""
        if not self.comms or self.counts_since is None or self.counts_at is None:
            return 0.0
        return self.counts_at - self.counts_since

    def flagged(self) -> bool:
        """A rank's communicator is being destroyed, finalized or aborted, or failed."""
        return any(
            r.destroy_flag or r.abort_flag or r.async_error or r.finalize_called
            for c in self.comms
            for r in c.ranks
        )

    def diverge(self) -> bool:
        """True when the ranks of a communicator launched different collectives."""
        for c in self.comms:
            kinds = {tuple(sorted(r.collective_counts.items())) for r in c.ranks}
            if len(kinds) > 1:
                return True
        return False

    def behind_pids(self) -> set[int]:
        """Pids of ranks that launched fewer collectives than a peer and more than none.

        Such a rank is not in the collective its peers wait in: it works (a
        checkpoint, an evaluation) or hangs elsewhere; it is never ahead of a peer.
        """
        behind: set[int] = set()
        ahead: set[int] = set()
        for c in self.comms:
            for a in c.ranks:
                for b in c.ranks:
                    ops = set(a.collective_counts) | set(b.collective_counts)
                    less = [
                        a.collective_counts.get(o, 0) <= b.collective_counts.get(o, 0) for o in ops
                    ]
                    if all(less) and a.collective_counts != b.collective_counts:
                        if a.pid is not None:
                            behind.add(a.pid)
                        if b.pid is not None:
                            ahead.add(b.pid)
        return behind - ahead

    def dead_ranks(self, gone_pids: set[int]) -> dict[int, tuple[str, float]]:
        """rank -> (host, since) for missing ranks RAS confirms (or whose process left here)."""
        out = {}
        for rank, m in self.missing.items():
            if m.considered_dead or m.answers >= 2 or (m.pid is not None and m.pid in gone_pids):
                out[rank] = (m.host, m.first_seen)
        return out

    def torn_down_after(self, t: float) -> bool:
        """An answer after `t` found none of the job's communicators: it tore NCCL down."""
        return self.empty_at is not None and self.empty_at > t


def job_communicators(report: RasReport, job: JobView) -> tuple[RasCommunicator, ...]:
    """The communicators with a rank of this job: by pid, else (no pid known) by GPU."""
    pids = {r.pid for r in job.ranks}

    def pid_of(m: Mapping[str, object]) -> object:
        return m.get("pid")

    by_pid = tuple(
        c
        for c in report.communicators
        if any(r.pid in pids for r in c.ranks) or any(pid_of(m) in pids for m in c.missing_ranks)
    )
    if by_pid or not report.communicators:
        return by_pid
    if any(r.pid in pids for c in report.communicators for r in c.ranks):
        return ()
    gpus = {int(g) for g in job.gpus if g.isdigit()}
    return tuple(c for c in report.communicators if any(r.nvml_dev in gpus for r in c.ranks))


def _counts(comms: tuple[RasCommunicator, ...]) -> tuple[tuple[str, int, str, int], ...]:
    return tuple(
        sorted(
            (c.hash, r.rank, op, n)
            for c in comms
            for r in c.ranks
            for op, n in r.collective_counts.items()
        )
    )


def _missing(
    comms: tuple[RasCommunicator, ...], old: Mapping[int, MissingRank], now: float
) -> dict[int, MissingRank]:
    out: dict[int, MissingRank] = {}
    for c in comms:
        for m in c.missing_ranks:
            rank = m.get("rank")
            if not isinstance(rank, int) or rank in out:
                continue
            status = m.get("status")
            dead = isinstance(status, dict) and status.get("considered_dead") is True
            pid = m.get("pid")
            prev = old.get(rank)
            out[rank] = MissingRank(
                host=str(m.get("host", "")),
                pid=pid if isinstance(pid, int) else None,
                first_seen=prev.first_seen if prev else now,
                answers=(prev.answers if prev else 0) + 1,
                considered_dead=dead,
            )
    return out


def job_ras(prev: JobRas, view: RasView, job: JobView) -> JobRas:
    """Fold one answer into the job's RAS memory (an answer already folded is ignored)."""
    if view.time <= prev.at:
        return prev
    if view.report is None:  # no answer: keep what we knew, the counts are not confirmed
        return replace(prev, at=view.time)
    comms = job_communicators(view.report, job)
    if not comms:
        return replace(
            prev,
            at=view.time,
            comms=(),
            counts=None,
            counts_since=None,
            counts_at=None,
            missing={},
            empty_at=view.time if prev.nccl else prev.empty_at,
            answers=prev.answers + 1,
        )
    counts = _counts(comms)
    same = prev.counts == counts
    rose = prev.rose_at if same or prev.counts is None else view.time
    return JobRas(
        nccl=True,
        at=view.time,
        comms=comms,
        counts=counts,
        counts_since=prev.counts_since if same else view.time,
        counts_at=view.time,
        missing=_missing(comms, prev.missing, view.time),
        empty_at=prev.empty_at,
        answers=prev.answers + 1,
        rose_at=rose,
    )
