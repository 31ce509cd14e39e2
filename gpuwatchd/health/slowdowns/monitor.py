"""The slowdown consumer: the detector on every NVML poll, JobSlowedByGpu findings, metrics.

`on_publish` (the consumer chain) reads each new NVML poll's samples and the
node's jobs (the hang monitor's view of them, from the workloads source or
NVML's process list) and feeds the detector. `findings()` holds one
JobSlowedByGpu per slowed job, which the health engine pulls (`version` moves
when they change) and sends through its one alert sink. Metrics keep their
cardinality bounded: each followed job gets a small slot number; the job's
labels are on the info series only, the gauges carry the slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from gpuwatchd.health.hangs.ras_view import RasView, job_communicators
from gpuwatchd.health.slowdowns.causes import UNEXPLAINED, catalog
from gpuwatchd.health.slowdowns.detector import (
    MAX_JOBS,
    JobPace,
    SlowdownDetector,
    SlowdownThresholds,
)
from gpuwatchd.health.slowdowns.readings import GpuPace, paces_from_samples
from gpuwatchd.jobview import JobView
from gpuwatchd.model import Finding, MetricSpec, Sample, Severity, SourceSnapshot
from gpuwatchd.state import NodeSnapshot

__all__ = ["ALERTNAME", "METRICS", "RULE", "SlowdownMonitor", "collectives", "finding_of"]

ALERTNAME = "JobSlowedByGpu"
RULE = "job_slowdown"
SUBJECT_KEYS = ("job", "namespace", "pod", "slurm_job")
JobsOf = Callable[[NodeSnapshot], Sequence[JobView]]
RasViews = Callable[[], Mapping[str, RasView]]  # the hang monitor's latest RAS answer per job

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_job_pace_info",
        "info",
        "1 for each multi-GPU job the slowdown detector follows on this node: slot is the"
        " small number its gauges carry (join on node and slot), workload the job (pod, Slurm"
        " job or launcher id), job_id its name on every node.",
        ("slot", "workload", "job_id", "namespace", "pod", "slurm_job"),
    ),
    MetricSpec(
        "gpuwatchd_job_step_rate_ratio",
        "gauge",
        "The job's step rate against its own baseline (1 = as fast as while balanced): the"
        " rate of its NCCL collectives where its RAS service answers, else estimated from its"
        " waiting GPUs' compute activity. Absent until the job is judged.",
        ("slot",),
    ),
    MetricSpec(
        "gpuwatchd_job_busy_ratio",
        "gauge",
        "Compute activity of the job's busiest GPU over its peers' median, against the job's"
        " own usual balance (1 = balanced; 1.1 = that GPU computes 10 % longer per step while"
        " the others wait). Absent until the job is judged.",
        ("slot",),
    ),
    MetricSpec(
        "gpuwatchd_job_slowed_ratio",
        "gauge",
        "While JobSlowedByGpu holds: how much slower the job steps because of this GPU"
        " (0.1 = 10 %), and the cause the node shows (slowdown cause catalog name).",
        ("slot", "gpu", "cause"),
    ),
)


def finding_of(p: JobPace) -> Finding:
    """One JobSlowedByGpu: the job, the GPU (or its link), how much slower, the cause."""
    entries = catalog()
    main = p.causes[0].name if p.causes else UNEXPLAINED
    entry = entries.get(main, entries[UNEXPLAINED])
    link = next((c.link for c in p.causes if c.link), "")
    what = f"GPU {p.slowest}" + (
        f" ({'PCIe' if link == 'pcie' else 'NVLink'} link)" if link else ""
    )
    how = (
        f"its compute activity stands {p.busy_ratio:.2f} times its peers' (the others wait in NCCL)"
        if p.by == "busy_ratio" and p.busy_ratio is not None
        else f"the job steps at {p.pace:.0%} of its baseline while the link is degraded"
        if p.pace is not None
        else ""
    )
    reason = f"Job {p.job.job} runs about {p.slowdown:.0%} slower, waiting for {what}: {how}."
    if p.causes:
        reason += " The node shows: " + "; ".join(f"{c.name}: {c.detail}" for c in p.causes) + "."
        reason += f" Cause: {entry.title}."
    else:
        reason += " The node shows no throttle, clock, link or ECC cause on it."
    ranks = ", ".join(
        f"{r.rank if r.rank is not None else '?'}:{r.pid}"
        for r in p.job.ranks
        if p.slowest in r.gpus
    )
    if ranks:
        reason += f" Rank on it (rank:pid): {ranks}."
    labels = [*p.job.labels]
    have = {k for k, _ in labels}
    labels[:0] = [(k, p.job.job) for k in ("job", "job_id") if k not in have]
    labels += [("gpu", p.slowest), ("cause", main)]
    return Finding(
        rule=RULE,
        alertname=ALERTNAME,
        scope="job",
        subject=tuple((k, v) for k, v in labels if k in SUBJECT_KEYS),
        severity=Severity.WARNING,
        reason=reason,
        action=entry.action,
        remediation=entry.remediation,
        labels=tuple(labels),
        since=p.since,
    )


def collectives(job: JobView, view: RasView | None) -> tuple[float, float] | None:
    """(answer time, collectives done) of the job from a RAS answer: over its communicators,
    the count of the rank that completed fewest (every rank does each collective once)."""
    if view is None or view.report is None:
        return None
    comms = job_communicators(view.report, job)
    counts = [min(sum(r.collective_counts.values()) for r in c.ranks) for c in comms if c.ranks]
    return (view.time, float(sum(counts))) if counts else None


def _alert_key(p: JobPace) -> tuple[object, ...]:
    """What, when it changes, re-sends the alert: the GPU and the causes, not the estimate."""
    return (p.slowest, tuple(c.name for c in p.causes))


class SlowdownMonitor:
    """Detector, slots and the JobSlowedByGpu findings (a provider the health engine pulls)."""

    def __init__(
        self,
        jobs_of: JobsOf | None = None,
        thresholds: SlowdownThresholds | None = None,
        ras_views: RasViews | None = None,
    ) -> None:
        self.detector = SlowdownDetector(thresholds)
        self._jobs_of = jobs_of
        self._ras_views = ras_views
        self._lock = threading.Lock()
        self._seen_stamp: float | None = None
        self._paces: dict[str, JobPace] = {}
        self._slots: dict[str, int] = {}
        self._open: dict[str, tuple[object, ...]] = {}
        self.version = 0  # moves when findings() changes

    def on_publish(
        self, snap: NodeSnapshot, source: SourceSnapshot | None = None, events: object = ()
    ) -> None:
        """Judge the node's jobs once per new NVML poll."""
        nvml = snap.sources.get("nvml")
        if nvml is None or not nvml.ok or nvml.timestamp == self._seen_stamp:
            return
        self._seen_stamp = nvml.timestamp
        jobs = self._jobs_of(snap) if self._jobs_of is not None else ()
        if nvml.timestamp is not None:
            self.observe(jobs, paces_from_samples(nvml.samples), nvml.timestamp)

    def observe(self, jobs: Sequence[JobView], gpus: Sequence[GpuPace], now: float) -> None:
        """Feed one poll (also from tests and benchmarks)."""
        multi = [j for j in jobs if len(j.gpus) >= 2]
        views = self._ras_views() if self._ras_views is not None else {}
        counted = {j.job: c for j in multi if (c := collectives(j, views.get(j.job))) is not None}
        paces = self.detector.observe(multi, gpus, now, counted)
        with self._lock:
            self._paces = {p.job.job: p for p in paces}
            for job in [j for j in self._slots if j not in self._paces]:
                del self._slots[job]
            for job in self._paces:
                if job not in self._slots and len(self._slots) < MAX_JOBS:
                    used = set(self._slots.values())
                    self._slots[job] = next(i for i in range(MAX_JOBS) if i not in used)
            open_now = {p.job.job: _alert_key(p) for p in paces if p.suspected}
            if open_now != self._open:
                self._open = open_now
                self.version += 1

    def findings(self) -> Sequence[Finding]:
        with self._lock:
            return [finding_of(p) for p in self._paces.values() if p.suspected]

    def samples(self) -> list[Sample]:
        """The info series and gauges of the followed jobs (see METRICS)."""
        out: list[Sample] = []
        with self._lock:
            for job, p in self._paces.items():
                slot = self._slots.get(job)
                if slot is None:
                    continue
                lab = dict(p.job.labels)
                out.append(
                    Sample.of(
                        "gpuwatchd_job_pace_info",
                        1,
                        slot=slot,
                        workload=job,
                        job_id=lab.get("job_id", job),
                        namespace=lab.get("namespace", ""),
                        pod=lab.get("pod", ""),
                        slurm_job=lab.get("slurm_job", ""),
                    )
                )
                if p.pace is not None:
                    out.append(Sample.of("gpuwatchd_job_step_rate_ratio", p.pace, slot=slot))
                if p.busy_ratio is not None:
                    out.append(Sample.of("gpuwatchd_job_busy_ratio", p.busy_ratio, slot=slot))
                if p.suspected:
                    cause = p.causes[0].name if p.causes else UNEXPLAINED
                    out.append(
                        Sample.of(
                            "gpuwatchd_job_slowed_ratio",
                            p.slowdown,
                            slot=slot,
                            gpu=p.slowest,
                            cause=cause,
                        )
                    )
        return out

    def status(self) -> dict[str, object]:
        """For /status: each followed job's pace, busy ratio and decision."""
        with self._lock:
            return {
                job: {
                    "slot": self._slots.get(job),
                    "pace": p.pace,
                    "pace_from": p.pace_from,
                    "busy_ratio": p.busy_ratio,
                    "slowest": p.slowest,
                    "slowed": p.suspected,
                    "slowdown": round(p.slowdown, 4),
                    "causes": [c.name for c in p.causes],
                }
                for job, p in self._paces.items()
            }
