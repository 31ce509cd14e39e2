"""Stored hang reports read back as findings, for `gpuwatchd check`.

Only the model: `check` reads the daemon's store and must not load the
detector, the causes and their catalogs to say a stored hang is still open.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.model import HANG_KIND, Action, Event, Finding, HangReport, Severity

__all__ = ["ALERTNAME", "GENERIC_REMEDIATION", "RULE", "open_hangs"]

ALERTNAME = "JobHangSuspected"
RULE = HANG_KIND
GENERIC_REMEDIATION = (
    "The job makes no progress. Take its ranks' stacks (py-spy dump --native --pid PID), "
    "rerun with NCCL_DEBUG=INFO and a collective timeout, then restart it."
)


def open_hangs(events: Iterable[Event]) -> list[Finding]:
    """Critical JobHangSuspected findings for stored hangs not yet resolved (`gpuwatchd check`)."""
    latest: dict[str, HangReport] = {}
    for ev in events:
        if ev.hang is not None:
            latest[ev.hang.job] = ev.hang  # oldest first: the newest record of a job wins
    out = []
    for job, doc in sorted(latest.items()):
        if doc.resolved:
            continue
        subject = tuple((k, v) for k, v in doc.labels if v)
        out.append(
            Finding(
                rule=RULE,
                alertname=ALERTNAME,
                scope="job",
                subject=subject or (("job", job),),
                severity=Severity.CRITICAL,  # check exits 2 so a health check script acts
                reason=f"Job {job} hangs: {doc.reason}. Where: {doc.where}",
                action=Action.RESTART_APP,
                remediation=doc.remediation or GENERIC_REMEDIATION,
                since=doc.since,
            )
        )
    return out
