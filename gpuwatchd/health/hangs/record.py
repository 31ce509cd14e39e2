"""A suspected job hang as the daemon keeps, stores and reports it.

`HangRecord` holds what the detector saw and what forensics found (it
changes while the hang is open); its `report()` is the typed `HangReport`
the `job_hang` event carries, /hangs serves and `gpuwatchd hang show`
reads back. What a stored report says to `gpuwatchd check` is `stored`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuwatchd.health.hangs.causes import Cause, Incident
from gpuwatchd.health.hangs.detector import JobVerdict
from gpuwatchd.health.hangs.stored import ALERTNAME, GENERIC_REMEDIATION, RULE
from gpuwatchd.health.hangs.summary import HangSummary, RankSummary
from gpuwatchd.jobview import GroupProgress, JobView, StackCapture
from gpuwatchd.model import (
    HangCause,
    HangCauses,
    HangRank,
    HangReport,
    HangStack,
)

__all__ = ["ALERTNAME", "GENERIC_REMEDIATION", "HangRecord", "RULE"]


@dataclass
class HangRecord:
    """One suspected hang of one job: what the detector saw and what forensics found."""

    id: int
    job: JobView
    verdict: JobVerdict
    summary: HangSummary | None = None
    stacks: dict[int, StackCapture] = field(default_factory=dict)
    ras_text: str = ""
    ras_error: str = ""
    ras_at: float = 0.0
    resolved_at: float | None = None
    incident: Incident | None = None  # what broke on this node, joined to the hang
    stacks_confirmed: bool = False  # two dumps seconds apart: every rank in the same call
    flight: list[GroupProgress] = field(default_factory=list)  # PyTorch's flight recorder
    flight_errors: list[str] = field(default_factory=list)

    def report(self) -> HangReport:
        """The typed report: the `job_hang` event's payload, /hangs and `hang show`."""
        s = self.summary
        inc = self.incident
        return HangReport(
            id=self.id,
            job=self.job.job,
            labels=tuple((k, v) for k, v in self.job.labels),
            since=self.verdict.since,
            resolved_at=self.resolved_at,
            conditions=tuple(self.verdict.conditions),
            signals=self.verdict.signals,
            reason=self.verdict.reason,
            severity=self.verdict.severity,
            cause=inc.headline() if inc else "",
            incident=inc.label if inc else "",
            causes=_causes(inc) if inc else None,
            stacks_confirmed=self.stacks_confirmed,
            flight_recorder=tuple(g.line() for g in self.flight),
            flight_recorder_errors=tuple(self.flight_errors),
            nodes=tuple(self.verdict.nodes),
            signature=s.signature.name if s and s.signature else "",
            remediation=s.signature.remediation if s and s.signature else "",
            signatures=tuple(s.signatures) if s else (),
            facts=tuple(s.facts) if s else (),
            where=s.where_line() if s else "",
            ranks=tuple(_rank(r) for r in s.ranks) if s else (),
            missing=tuple(s.missing) if s else (),
            unresponsive=tuple(s.unresponsive) if s else (),
            diverging_frame=s.diverging_frame if s else "",
            stacks=tuple(
                HangStack(pid=pid, ok=c.ok, error=c.error, seconds=c.seconds, dump=c.raw)
                for pid, c in self.stacks.items()
            ),
            ras_error=self.ras_error,
            ras_at=self.ras_at,
            ras_answer=self.ras_text,
        )


def _rank(r: RankSummary) -> HangRank:
    return HangRank(
        pid=r.pid,
        rank=r.rank,
        gpus=tuple(r.gpus),
        state=r.state,
        where=r.where,
        collective=r.collective,
        collective_counts=tuple(r.collective_counts.items()),
        stack_error=r.stack_error,
    )


def _cause(c: Cause) -> HangCause:
    return HangCause(
        kind=c.kind,
        text=c.text,
        what=c.what,
        where=c.where,
        at=c.at,
        offset_seconds=round(c.offset_seconds, 3),
        rank=c.rank,
        pid=c.pid,
        affinity=c.affinity,
        evidence=c.evidence,
        incident=c.incident,
    )


def _causes(inc: Incident) -> HangCauses:
    return HangCauses(
        cause=_cause(inc.cause) if inc.cause is not None else None,
        alternatives=tuple(_cause(c) for c in inc.causes[1:]),
        headline=inc.headline(),
        looked_at=tuple(inc.looked_at),
        elsewhere=tuple(inc.elsewhere),
    )
