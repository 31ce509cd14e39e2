"""Which remediation is due: pure decisions over the open findings.

An action is due when a critical finding whose alert may act has been open
for `remediation.hold_seconds`, the action is opted in for critical, and it
is not already engaged. Warnings and info never act: the config cannot even
name them (the per-action severity lists accept `critical` only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuwatchd.config import Config
from gpuwatchd.model import Finding, Severity

__all__ = ["ACTIONS", "Decision", "due", "enabled_actions", "reason_text"]

# Slurm drain, Kubernetes node condition, Kubernetes NoSchedule taint.
ACTIONS = ("slurm_drain", "kubernetes_condition", "kubernetes_taint")
REASON_PREFIX = "gpuwatchd: "
MAX_REASON = 200  # Slurm keeps the reason in its state file; keep it a line


@dataclass(frozen=True, slots=True)
class Decision:
    """Take `action` because of `finding`."""

    action: str
    finding: Finding


def enabled_actions(cfg: Config, severity: Severity = Severity.CRITICAL) -> list[str]:
    """The actions opted in for `severity` (only critical can be)."""
    rem = cfg.remediation
    name = str(severity)
    lists = {
        "slurm_drain": rem.slurm.drain_on,
        "kubernetes_condition": rem.kubernetes.condition_on,
        "kubernetes_taint": rem.kubernetes.taint_on,
    }
    return [a for a in ACTIONS if name in lists[a]]


def due(
    cfg: Config, findings: Iterable[Finding], now: float, engaged: Iterable[str]
) -> list[Decision]:
    """The actions to take now, each for the longest-held qualifying finding."""
    allowed = set(cfg.remediation.alerts)
    held = [
        f
        for f in findings
        if f.severity == Severity.CRITICAL
        and f.scope != "job"  # a hung job is restarted by its owner, never a reason to drain
        and (not allowed or f.alertname in allowed)
        and f.since > 0
        and now - f.since >= cfg.remediation.hold_seconds
    ]
    if not held:
        return []
    first = min(held, key=lambda f: (f.since, f.alertname))
    skip = set(engaged)
    return [Decision(a, first) for a in enabled_actions(cfg) if a not in skip]


def reason_text(finding: Finding, parts: Sequence[str] = ()) -> str:
    """`gpuwatchd: <alert>: <remediation>` on one line, bounded in length."""
    what = finding.alertname
    subject = dict(finding.subject)
    if subject.get("gpu"):
        what += f" gpu {subject['gpu']}"
    text = f"{REASON_PREFIX}{what}: {finding.remediation or finding.reason}"
    text = " ".join([text, *parts]).replace("\n", " ").strip()
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."
