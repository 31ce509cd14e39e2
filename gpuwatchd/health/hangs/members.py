"""The ranks of each job between NVML polls: NVML's list, plus those it no longer lists.

Each NVML poll says which processes hold a context; a rank that died drops out of
that list, and would silently leave its job. `JobMembers` keeps every rank seen
with its job until the /proc probe has said it is gone, and for five minutes
after, so the detector sees the death, not a smaller job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gpuwatchd.jobview import JobView, RankView

__all__ = ["GONE_FORGET", "JobMembers"]

GONE_FORGET = 300.0  # seconds: a rank gone this long is no longer shown with its job


class JobMembers:
    """Jobs as last listed, each with every rank seen (one caller: the consumer thread)."""

    def __init__(self) -> None:
        self._templates: dict[str, JobView] = {}
        self._members: dict[str, dict[int, RankView]] = {}
        self._gone_at: dict[int, float] = {}

    def __bool__(self) -> bool:
        return bool(self._templates)

    def merge(self, jobs: Sequence[JobView]) -> None:
        """Jobs as NVML lists them now; ranks seen before stay."""
        for job in jobs:
            self._members.setdefault(job.job, {}).update({r.pid: r for r in job.ranks})
            self._templates[job.job] = job

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
