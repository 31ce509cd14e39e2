"""The ranks of each job between NVML polls: NVML's list, plus those it no longer lists.

Each NVML poll says which processes hold a context; a rank that died drops out of
that list, and would silently leave its job. `JobMembers` keeps every rank seen
with its job until the /proc probe has said it is gone, and for five minutes
after, so the detector sees the death, not a smaller job.

Jobs come from the workloads source when it runs, and it names the processes of an
NVML poll after that poll was published and judged: `JobMembers.named` takes them
from its poll, not one NVML interval (10 s) later, and `ProbeCadence` probes a job
named so at the next tick, and the jobs whose early verdict falls due between probes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from gpuwatchd.jobview import JobView, RankView
from gpuwatchd.state import NodeSnapshot

__all__ = ["GONE_FORGET", "JobMembers", "MIN_PROBE_SPAN", "ProbeCadence"]

GONE_FORGET = 300.0  # seconds: a rank gone this long is no longer shown with its job
MIN_PROBE_SPAN = 1.0  # seconds: a shorter span reads CPU ratios from a few jiffies


class ProbeCadence:
    """When the consumer's tick probes: every interval, and sooner when asked to."""

    def __init__(self) -> None:
        self.at = -1e18  # the last probe (an NVML poll's or a tick's)
        self.soon = False  # a job was named since: probe at the next tick

    def due(self, now: float, interval: float, verdict_due: float | None) -> bool:
        """A probe now: the interval passed, or a job was named or a verdict falls due."""
        since = now - self.at
        sooner = self.soon or (verdict_due is not None and now >= verdict_due)
        return since >= interval or (sooner and since >= MIN_PROBE_SPAN)

    def probed(self, now: float) -> None:
        self.at, self.soon = now, False


class JobMembers:
    """Jobs as last listed, each with every rank seen (one caller: the consumer thread)."""

    def __init__(self) -> None:
        self._templates: dict[str, JobView] = {}
        self._members: dict[str, dict[int, RankView]] = {}
        self._gone_at: dict[int, float] = {}
        self._named = 0.0  # the workloads poll last taken

    def __bool__(self) -> bool:
        return bool(self._templates)

    def named(self, snap: NodeSnapshot, jobs_of: Callable[[NodeSnapshot], list[JobView]]) -> bool:
        """The jobs of a workloads poll not taken yet; True when one is new."""
        wl = snap.sources.get("workloads")
        if wl is None or not wl.ok or wl.timestamp == self._named:
            return False
        self._named = wl.timestamp
        return self.merge(jobs_of(snap))

    def merge(self, jobs: Sequence[JobView]) -> bool:
        """Jobs as NVML lists them now; ranks seen before stay. True when a job is new."""
        new = any(job.job not in self._templates for job in jobs)
        for job in jobs:
            self._members.setdefault(job.job, {}).update({r.pid: r for r in job.ranks})
            self._templates[job.job] = job
        return new

    def current(self, now: float) -> list[JobView]:
        """Every job with all its ranks (those gone longer than GONE_FORGET dropped)."""
        out = []
        for key, job in list(self._templates.items()):
            members = self._members[key]
            for pid in [p for p in members if now - self._gone_at.get(p, now) >= GONE_FORGET]:
                del members[pid]  # gone long ago: a restarted job goes on without it
                self._gone_at.pop(pid, None)
            out.append(dataclasses.replace(job, ranks=tuple(r for _, r in sorted(members.items()))))
        return out

    def update(self, probed: Sequence[JobView], now: float) -> list[JobView]:
        """Keep what the probe read; drop jobs with no rank alive. The jobs still running."""
        out = []
        for job in probed:
            if not any(r.alive for r in job.ranks):  # the job ended
                self._templates.pop(job.job, None)
                for r in job.ranks:
                    self._gone_at.pop(r.pid, None)
                self._members.pop(job.job, None)
                continue
            for r in job.ranks:
                self._members[job.job][r.pid] = r
                if not r.alive:
                    self._gone_at.setdefault(r.pid, now)
            out.append(job)
        return out
