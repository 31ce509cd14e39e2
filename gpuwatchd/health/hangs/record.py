"""A suspected job hang as the daemon keeps, stores and reports it.

`HangRecord` holds what the detector saw and what forensics found; its
`json()` is the document stored with the `job_hang` event, served at
/hangs and shown by `gpuwatchd hang show`. `open_hangs()` turns stored
documents back into findings for `gpuwatchd check`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwatchd.health.hangs.causes import Incident
from gpuwatchd.health.hangs.detector import JobVerdict
from gpuwatchd.health.hangs.summary import HangSummary
from gpuwatchd.jobview import GroupProgress, JobView, StackCapture
from gpuwatchd.model import Action, Event, Finding, Severity

__all__ = [
    "ALERTNAME",
    "GENERIC_REMEDIATION",
    "HangRecord",
    "RULE",
    "open_hangs",
]

ALERTNAME = "JobHangSuspected"
RULE = "job_hang"
GENERIC_REMEDIATION = (
    "The job makes no progress. Take its ranks' stacks (py-spy dump --native --pid PID), "
    "rerun with NCCL_DEBUG=INFO and a collective timeout, then restart it."
)


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

    def json(self) -> dict[str, Any]:
        """Everything, JSON-able, for /hangs, the store and `gpuwatchd hang show`."""
        s = self.summary
        return {
            "id": self.id,
            "job": self.job.job,
            "labels": dict(self.job.labels),
            "since": self.verdict.since,
            "resolved_at": self.resolved_at,
            "conditions": list(self.verdict.conditions),
            "signals": self.verdict.signals,
            "reason": self.verdict.reason,
            "severity": self.verdict.severity,
            "cause": self.incident.headline() if self.incident else "",
            "incident": self.incident.label if self.incident else "",
            "causes": self.incident.json() if self.incident else None,
            "stacks_confirmed": self.stacks_confirmed,
            "flight_recorder": [g.line() for g in self.flight],
            "flight_recorder_errors": list(self.flight_errors),
            "nodes": list(self.verdict.nodes),
            "signature": s.signature.name if s and s.signature else "",
            "remediation": s.signature.remediation if s and s.signature else "",
            "signatures": list(s.signatures) if s else [],
            "facts": list(s.facts) if s else [],
            "where": s.where_line() if s else "",
            "ranks": [asdict(r) for r in s.ranks] if s else [],
            "missing": list(s.missing) if s else [],
            "unresponsive": list(s.unresponsive) if s else [],
            "diverging_frame": s.diverging_frame if s else "",
            "stacks": {
                str(pid): {"ok": c.ok, "error": c.error, "seconds": c.seconds, "dump": c.raw}
                for pid, c in self.stacks.items()
            },
            "ras": {"error": self.ras_error, "at": self.ras_at, "answer": self.ras_text},
        }


def open_hangs(events: Iterable[Event]) -> list[Finding]:
    """Critical JobHangSuspected findings for stored hangs not yet resolved (`gpuwatchd check`)."""
    latest: dict[str, Mapping[str, Any]] = {}
    for ev in events:
        if ev.kind != RULE:
            continue
        try:
            doc = json.loads(ev.attr("forensics") or "{}")
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("job"):
            latest[str(doc["job"])] = doc  # oldest first: the newest record of a job wins
    out = []
    for job, doc in sorted(latest.items()):
        if doc.get("resolved_at"):
            continue
        subject = tuple((k, str(v)) for k, v in (doc.get("labels") or {}).items() if v)
        out.append(
            Finding(
                rule=RULE,
                alertname=ALERTNAME,
                scope="job",
                subject=subject or (("job", job),),
                severity=Severity.CRITICAL,  # check exits 2 so a health check script acts
                reason=f"Job {job} hangs: {doc.get('reason', '')}. Where: {doc.get('where', '')}",
                action=Action.RESTART_APP,
                remediation=str(doc.get("remediation") or GENERIC_REMEDIATION),
                since=float(doc.get("since") or 0.0),
            )
        )
    return out
