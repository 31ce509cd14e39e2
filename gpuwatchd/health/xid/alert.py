"""One copy of an Xid alert, whoever sends it.

The daemon's Alertmanager sink and the Prometheus rules
(deploy/prometheus/gpuwatchd-rules.yaml) both send GpuXidCritical and
GpuXidWarning. Alertmanager keeps one alert per label set and takes the
annotations of whichever copy came last, so both must carry the same labels
and the same annotations. Both are built here from the finding:
`gpuwatchd_xid_alert_info` exports them (one series per active Xid incident:
the alert's labels, its severity and its annotation texts), the rule reads that
series, and the sink sends `texts(f)` as its annotations. The workload labels live on this
`_info` series only, never on the Xid counters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuwatchd.health.alerts import ALERTS, summary
from gpuwatchd.logs import escape_control
from gpuwatchd.model import Finding, MetricSpec, Sample, Severity
from gpuwatchd.pci import UNKNOWN_BUS

__all__ = ["ALERTNAMES", "INFO", "METRICS", "TEXTS", "own_labels", "samples", "texts"]

ALERTNAMES = ("GpuXidCritical", "GpuXidWarning")
INFO = "gpuwatchd_xid_alert_info"
TEXTS = ("summary", "description", "remediation", "action")
_LABELS = (*ALERTS["GpuXidCritical"].labels, "severity", *TEXTS)
# The workload as the description names it: the bounded fields first.
_WORKLOAD = (
    "workload",
    "workload_id",
    "namespace",
    "pod",
    "container",
    "pod_uid",
    "slurm_job",
    "slurm_job_name",
    "slurm_user",
    "slurm_step",
    "rank",
    "local_rank",
    "world_size",
    "torchelastic_run_id",
    "pids",
    "mig_uuid",
    "gpu_instance",
    "compute_instance",
)
_TEXT_LIMIT = 1024  # a label value and an annotation alike; Slurm job names are free text

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        INFO,
        "gauge",
        "1 per active GPU Xid condition while it alerts: the labels of its"
        " GpuXidCritical/GpuXidWarning alert (incident, and the workload it hit), its"
        " severity and the alert's annotation texts, for the Prometheus rule to send the"
        " same alert as the daemon.",
        _LABELS,
    ),
)


def own_labels(f: Finding) -> dict[str, str]:
    """The alert's labels besides alertname, severity and node (non-empty only)."""
    keep = set(ALERTS[f.alertname].labels) if f.alertname in ALERTS else set()
    return {k: v for k, v in (*f.subject, *f.labels) if v and k in keep}


def texts(f: Finding) -> dict[str, str]:
    """summary, description, remediation and action of an Xid alert: texts that stay the
    same while the incident lasts (no report count, no kernel line text: those are in the
    event store and the evidence bundle), so the info series does not churn."""
    given = {k: v for k, v in (*f.subject, *f.labels) if v}
    bus, gpu = given.get("pci_bus_id", ""), given.get("gpu", "")
    if gpu:
        where = f"GPU {gpu} ({bus})"
    elif bus and bus != UNKNOWN_BUS:
        where = f"the GPU at {bus}"
    else:
        where = "a GPU the report did not name"
    text = f"Xid {given.get('xid', '?')} ({given.get('name', 'unknown')}) on {where}."
    if given.get("process"):
        text += f" Reported by {given['process']}."
    held = ", ".join(f"{k}={given[k]}" for k in _WORKLOAD if k in given)
    if held:
        text += f" Workload: {held}."
    out = {
        "summary": summary(f),
        "description": text,
        "remediation": f.remediation or "Run `gpuwatchd xid explain CODE` on the node.",
        "action": str(f.action),
    }
    # What the sink would change (undecodable bytes, control characters) is changed here,
    # so the label Prometheus reads and the annotation the daemon sends stay equal.
    return {k: escape_control(_utf8(v), _TEXT_LIMIT) for k, v in out.items()}


def _utf8(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")


def samples(findings: Iterable[Finding]) -> list[Sample]:
    """The info series of every Xid alert among `findings`."""
    out = []
    for f in findings:
        if f.alertname not in ALERTNAMES or f.severity < Severity.WARNING:
            continue
        labels: Mapping[str, str] = own_labels(f)
        values = {k: labels.get(k, "") for k in ALERTS[f.alertname].labels}
        values.update(texts(f), severity=str(f.severity))
        out.append(Sample.of(INFO, 1, **values))
    return out
