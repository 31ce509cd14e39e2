"""Roll-up: open findings -> health of the node, each component and each GPU.

What the engine publishes besides the findings: `gpuwatchd_health` per
scope, open conditions by severity, rule errors, the expected GPU count,
and the JSON shape of a finding and of the health on /status (the one
shape `check --json` prints too). Pure functions over the engine's state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.health import alerts
from gpuwatchd.health.history import View, gpu_key
from gpuwatchd.health.xid import alert as xid_alert
from gpuwatchd.model import Finding, Gpu, Health, Labels, MetricSpec, Sample, Severity

__all__ = [
    "COMPONENTS",
    "METRICS",
    "Rollup",
    "component_of",
    "finding_json",
    "health_of",
    "health_samples",
    "roll_up",
    "status_json",
]

COMPONENTS = ("nvml", "kmsg", "shm", "infiniband", "aer", "daemon")
_HEALTH_LABELS = ("scope", "component", "gpu", "uuid", "pci_bus_id")

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_health",
        "gauge",
        "Health verdict: 0 healthy, 1 degraded (a warning condition), 2 unhealthy (a critical"
        " one). scope is node, gpu or component; the other labels are empty where they do"
        " not apply.",
        _HEALTH_LABELS,
    ),
    MetricSpec(
        "gpuwatchd_health_conditions",
        "gauge",
        "Open health conditions (findings) by severity.",
        ("severity",),
    ),
    MetricSpec(
        "gpuwatchd_gpus_expected",
        "gauge",
        "GPUs this node should have: health.expected_gpus, else the most seen since the"
        " first start (GpuCountLow fires while gpuwatchd_gpus_visible is lower).",
    ),
    MetricSpec(
        "gpuwatchd_health_rule_errors_total",
        "counter",
        "Rule evaluations that raised (a bug; the log has the traceback).",
        ("rule",),
    ),
    *xid_alert.METRICS,
)


@dataclass(frozen=True)
class Rollup:
    """Health of the node, of each component and of each GPU (by history.gpu_key)."""

    node: Health
    components: Mapping[str, Health]
    gpus: Mapping[str, Health]


def health_of(severity: Severity) -> Health:
    """critical -> unhealthy, warning -> degraded, else healthy."""
    if severity >= Severity.CRITICAL:
        return Health.UNHEALTHY
    if severity >= Severity.WARNING:
        return Health.DEGRADED
    return Health.HEALTHY


def component_of(f: Finding) -> str:
    """Which component a finding counts against (a failing collector: its own)."""
    collector = dict(f.subject).get("collector")
    if collector in COMPONENTS:
        return collector
    info = alerts.ALERTS.get(f.alertname)
    return info.component if info is not None else "daemon"


def roll_up(
    findings: Iterable[Finding], view: View | None, expected_sources: Iterable[str]
) -> Rollup:
    """Health per node, component and GPU from the open findings."""
    present = set(view.snapshot.sources) if view else set()
    expected = set(expected_sources)
    gpus = {u: Health.HEALTHY for u in (view.gpus if view else {})}
    comps = {c: Health.HEALTHY for c in COMPONENTS if c in present | expected or c == "daemon"}
    for f in _node_findings(findings):
        h = health_of(f.severity)
        key = gpu_key(dict(f.subject))
        if key:
            gpus[key] = max(gpus.get(key, Health.HEALTHY), h)
        c = component_of(f)
        comps[c] = max(comps.get(c, Health.HEALTHY), h)
    node = max([*gpus.values(), *comps.values()], default=Health.HEALTHY)
    return Rollup(node, comps, gpus)


def _node_findings(findings: Iterable[Finding]) -> list[Finding]:
    """What counts against the node: a job's hang (scope job) is the job's; it has its
    own series (gpuwatchd_job_hang_info) and alert."""
    return [f for f in findings if f.scope != "job"]


def health_samples(
    roll: Rollup,
    findings: Iterable[Finding],
    view: View | None,
    seen: Mapping[str, Gpu],
    rule_errors: Mapping[str, int],
    expected_gpus: int,
) -> list[Sample]:
    """gpuwatchd_health and friends (see METRICS)."""
    findings = list(findings)
    out = [_health("node", "", None, roll.node)]
    for comp, h in roll.components.items():
        out.append(_health("component", comp, None, h))
    gpus = view.gpus if view else {}
    for key, h in roll.gpus.items():
        gpu = gpus.get(key) or seen.get(key)
        if gpu is not None:
            out.append(_health("gpu", "", gpu.subject, h))
    counts = {"warning": 0, "critical": 0}
    for f in _node_findings(findings):
        if f.severity >= Severity.WARNING:
            counts[str(f.severity)] += 1
    out.extend(Sample.of("gpuwatchd_health_conditions", n, severity=s) for s, n in counts.items())
    out.extend(xid_alert.samples(findings))  # what the Prometheus Xid rules send
    out.extend(
        Sample.of("gpuwatchd_health_rule_errors_total", n, rule=r) for r, n in rule_errors.items()
    )
    if expected_gpus:
        out.append(Sample.of("gpuwatchd_gpus_expected", expected_gpus))
    return out


def status_json(roll: Rollup, view: View | None, findings: Sequence[Finding]) -> dict[str, object]:
    """JSON-able health for /status."""
    gpus = view.gpus if view else {}
    return {
        "health": str(roll.node),
        "components": {c: str(h) for c, h in roll.components.items()},
        "gpus": {
            (str(gpus[k].index) if k in gpus else k): {
                "uuid": gpus[k].uuid if k in gpus else k,
                "health": str(h),
            }
            for k, h in roll.gpus.items()
        },
        "conditions": [finding_json(f) for f in findings],
    }


def finding_json(f: Finding) -> dict[str, object]:
    """A finding as JSON-able data (status, check --json)."""
    return {
        "rule": f.rule,
        "alertname": f.alertname,
        "severity": str(f.severity),
        "scope": f.scope,
        "component": component_of(f),
        "subject": dict(f.subject),
        "labels": dict(f.labels),
        "summary": alerts.summary(f),
        "reason": f.reason,
        "action": str(f.action),
        "remediation": f.remediation,
        "since": f.since,
    }


def _health(scope: str, component: str, subject: Labels | None, h: Health) -> Sample:
    labels: Mapping[str, str] = dict(subject or ())
    return Sample.of(
        "gpuwatchd_health",
        int(h),
        scope=scope,
        component=component,
        gpu=labels.get("gpu", ""),
        uuid=labels.get("uuid", ""),
        pci_bus_id=labels.get("pci_bus_id", ""),
    )
