"""A hang record as the JobHangSuspected finding, its severity and its info series.

Severity: the detector's when it decides one (a dead rank, a missing rank or
flat NCCL counts are critical; a straggler warns until the job's collective
timeout), else the matched signature's.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.health.hangs.detector import JobVerdict
from gpuwatchd.health.hangs.record import ALERTNAME, GENERIC_REMEDIATION, RULE, HangRecord
from gpuwatchd.model import Action, Event, Finding, Sample, Severity

__all__ = ["alert_key", "event_of", "finding_of", "info_samples", "role_of", "severity_of"]

SUBJECT_KEYS = ("job", "namespace", "pod", "slurm_job")


def severity_of(rec: HangRecord) -> Severity:
    """The detector's severity when it set one, else the signature's."""
    if rec.verdict.severity:
        return Severity.CRITICAL if rec.verdict.severity == "critical" else Severity.WARNING
    if rec.stacks_confirmed:  # a stall the stacks confirm is critical, whatever its name
        return Severity.CRITICAL
    sig = rec.summary.signature if rec.summary else None
    return Severity.CRITICAL if sig is not None and sig.severity == "critical" else Severity.WARNING


def event_of(rec: HangRecord) -> Event:
    """The `job_hang` event stored for a record: its report is the payload."""
    report = rec.report()
    return Event(
        kind=RULE,
        source="hangs",
        time=report.since,
        message=f"job {report.job}: {report.reason}",
        severity=severity_of(rec),
        payload=report,
    )


def alert_key(v: JobVerdict) -> tuple[object, ...]:
    """What, when it changes, re-sends an open hang's alert: not every signal's flicker."""
    return (v.conditions, v.severity, "ras" in v.signals.split("+"), v.nodes)


def role_of(v: JobVerdict) -> str:
    """culprit: a rank of this node died, lags or never started; waiting: ours wait for it."""
    if v.elsewhere:  # the ranks that did not arrive belong to other nodes
        return "waiting"
    if v.dead_pids or v.straggler_pids or "rank_missing" in v.conditions:
        return "culprit"
    return "waiting" if v.nodes or "rank_dead" in v.conditions else "stalled"


def finding_of(rec: HangRecord) -> Finding:
    """One JobHangSuspected for a record: job, ranks, where they are, what decided."""
    s = rec.summary
    sig = s.signature if s else None
    where = s.where_line() if s else ""
    v = rec.verdict
    ranks = ", ".join(f"{r.rank if r.rank is not None else '?'}:{r.pid}" for r in rec.job.ranks)
    reason = f"Job {rec.job.job} hangs: {v.reason}."
    if rec.incident is not None:
        reason += f" Cause: {rec.incident.headline()}."
        alternatives = [c.text for c in rec.incident.causes[1:]]
        if alternatives:
            reason += f" Alternatives: {'; '.join(alternatives)}."
    reason += f" Ranks (rank:pid): {ranks}."
    if v.signals:
        reason += f" Decided by: {v.signals}."
    if v.nodes:
        reason += f" Ranks lost on: {', '.join(v.nodes)}."
    if rec.stacks_confirmed:
        reason += " Two stack dumps seconds apart show every rank in the same call."
    if sig is not None:
        reason += f" Signature: {sig.title}."
    if where:
        reason += f" Where: {where}."
    labels = [*rec.job.labels, ("ranks", ranks), ("where", where)]
    labels.append(("signature", sig.name if sig else "pending"))
    if rec.incident is not None and rec.incident.label:
        labels.append(("incident", rec.incident.label))
    if rec.incident is not None:
        labels.append(("cause", "\n".join(rec.incident.lines())))
    labels.append(("role", role_of(v)))
    return Finding(
        rule=RULE,
        alertname=ALERTNAME,
        scope="job",
        subject=tuple((k, val) for k, val in rec.job.labels if k in SUBJECT_KEYS),
        severity=severity_of(rec),
        reason=reason,
        action=Action.RESTART_APP,
        remediation=sig.remediation if sig else GENERIC_REMEDIATION,
        labels=tuple(labels),
        since=v.since,
    )


def info_samples(records: Iterable[HangRecord], dropped: int) -> list[Sample]:
    """The per-job info series (only while suspected) and the dropped counter."""
    out = [Sample.of("gpuwatchd_hang_forensics_dropped_total", dropped)]
    for rec in records:
        lab = dict(rec.job.labels)
        sig = rec.summary.signature if rec.summary else None
        out.append(
            Sample.of(
                "gpuwatchd_job_hang_info",
                1,
                workload=rec.job.job,
                job_id=lab.get("job_id", rec.job.job),
                namespace=lab.get("namespace", ""),
                pod=lab.get("pod", ""),
                slurm_job=lab.get("slurm_job", ""),
                role=role_of(rec.verdict),
                signature=sig.name if sig else "pending",
            )
        )
    return out
