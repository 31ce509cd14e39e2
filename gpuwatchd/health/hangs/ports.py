"""What the hang monitor exchanges with the rest of the daemon: its metrics, the node's
I/O it is handed (gpuwatchd.forensics.NodeForensics), the store it writes to, its callbacks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from gpuwatchd.jobview import GroupProgress, JobView, RasAnswer, StackCapture
from gpuwatchd.model import Event, Finding, MetricSpec
from gpuwatchd.state import NodeSnapshot

__all__ = ["EventWriter", "Listener", "METRICS", "NodeIO", "RasFn", "StackFn"]

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_job_hang_info",
        "info",
        "1 for each job on this node suspected to hang (JobHangSuspected): workload is the job"
        " (pod, Slurm job or launcher id), job_id its name on every node, role culprit"
        " (a rank here died or lags), waiting or stalled, signature the matched hang signature"
        " (pending until forensics ran). Absent when no job hangs.",
        ("workload", "job_id", "namespace", "pod", "slurm_job", "role", "signature"),
    ),
    MetricSpec(
        "gpuwatchd_hang_forensics_dropped_total",
        "counter",
        "Suspected hangs analysed without stacks or RAS because the forensics queue was full.",
    ),
)
Listener = Callable[[Sequence[Finding], float], None]
StackFn = Callable[[int], StackCapture]
RasFn = Callable[[JobView], RasAnswer]


class NodeIO(Protocol):
    """What the monitor reads from the node; the daemon passes gpuwatchd.forensics.NodeForensics.

    The health layer decides; this object does the I/O (/proc, py-spy, NCCL RAS), so
    health never imports a source.
    """

    def jobs(self, snap: NodeSnapshot, procfs: str) -> list[JobView]: ...

    def capture(self, pid: int, timeout: float) -> StackCapture: ...

    def ras(self, job: JobView, netns: bool, timeout: float) -> RasAnswer: ...

    def probe(self, jobs: Sequence[JobView], procfs: str) -> list[JobView]: ...

    def flight(
        self, job: JobView, procfs: str, wait: Callable[[float], object]
    ) -> tuple[list[GroupProgress], list[str]]: ...


class EventWriter(Protocol):
    def write(self, records: Sequence[tuple[Event, str, int]]) -> None: ...
