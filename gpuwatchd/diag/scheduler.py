"""When the daemon runs diag itself: on a schedule, and after a critical condition clears.

Only on an idle node: no GPU process (checked by the run itself, before and
every half second), no workload the workloads source sees, no Slurm job on
the node (`sinfo`, where Slurm remediation is configured). Whatever starts
meanwhile cancels the run; a cancelled run is stored as such and fails
nothing. The metrics come from the store, so runs from the CLI (a Slurm
epilog, `clear --resume`) show up too.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.model import DiagRun, Finding, MetricSpec, Sample, Severity
from gpuwatchd.sinks.diag import failures_by_gpu, last_runs, repeat_offenders
from gpuwatchd.sinks.remediation.slurm import SlurmNodes
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import State

if TYPE_CHECKING:  # a run's machinery loads with the first run, not with the daemon
    from gpuwatchd.sources.diag.runner import WorkerRun

__all__ = [
    "DiagScheduler",
    "METRICS",
    "diag_samples",
]

log = logging.getLogger("gpuwatchd.diag")

CHECK_SECONDS = 2.0  # how often the thread looks whether a run is due
REFRESH_SECONDS = 60.0  # the store is re-read this often for runs made outside the daemon
SLURM_BUSY_STATES = ("alloc", "mix", "comp", "draining")
SCALE = {"TFLOP/s": 1e12, "GB/s": 1e9}  # to base units: FLOP/s, bytes/s

_PER_CHECK = ("check", "gpu")
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_diag_check_passed",
        "gauge",
        "1 if the check passed on the GPU (index, 'a>b' for a pair, 'all' for the node) in the"
        " last run that ran it, 0 if it failed (docs/diag.md)",
        _PER_CHECK,
    ),
    MetricSpec(
        "gpuwatchd_diag_measured",
        "gauge",
        "The check's last figure in base units: FLOP/s (gemm), bytes/s (bandwidths, all_reduce"
        " bus bandwidth), a count (memory_pattern words, ecc_errors, row_remap rows)",
        _PER_CHECK,
    ),
    MetricSpec(
        "gpuwatchd_diag_floor",
        "gauge",
        "The floor the check's last figure was held to, in the same units",
        _PER_CHECK,
    ),
    MetricSpec(
        "gpuwatchd_diag_duration_seconds", "gauge", "How long the tier's last run took", ("tier",)
    ),
    MetricSpec(
        "gpuwatchd_diag_last_pass_timestamp_seconds",
        "gauge",
        "When the tier last passed (Unix time)",
        ("tier",),
    ),
    MetricSpec(
        "gpuwatchd_diag_failures_30d",
        "gauge",
        "Failed diag checks per GPU over the last 30 days (repeat offenders fleet-wide)",
        ("gpu",),
    ),
    MetricSpec(
        "gpuwatchd_diag_inspect",
        "gauge",
        "1 when the check failed on the GPU diag.inspect_after_failures times in 30 days:"
        " drain_and_inspect",
        _PER_CHECK,
    ),
    MetricSpec(
        "gpuwatchd_diag_running",
        "gauge",
        "1 while the daemon runs a diag (exported where diag.schedule_seconds or"
        " diag.after_critical lets it start runs)",
    ),
)


def diag_samples(store: EventStore, now: float, inspect_after: int) -> list[Sample]:
    """The gpuwatchd_diag_* series, from the stored runs (newest wins per check and GPU)."""
    out: list[Sample] = []
    seen: set[tuple[str, str]] = set()
    tiers: set[str] = set()
    passed: set[str] = set()
    for run in last_runs(store, 100):
        if run.tier not in tiers and not run.cancelled:
            tiers.add(run.tier)
            out.append(Sample.of("gpuwatchd_diag_duration_seconds", run.seconds, tier=run.tier))
        if run.verdict == "OK" and run.tier not in passed:
            passed.add(run.tier)
            out.append(
                Sample.of("gpuwatchd_diag_last_pass_timestamp_seconds", run.started, tier=run.tier)
            )
        for r in run.results:
            key = (r.check, r.gpu)
            if key in seen or r.outcome not in ("pass", "fail"):
                continue
            seen.add(key)
            labels = {"check": r.check, "gpu": r.gpu}
            scale = SCALE.get(r.unit, 1.0)
            out.append(Sample.of("gpuwatchd_diag_check_passed", r.outcome == "pass", **labels))
            if r.measured is not None:
                out.append(Sample.of("gpuwatchd_diag_measured", r.measured * scale, **labels))
            if r.floor is not None:
                out.append(Sample.of("gpuwatchd_diag_floor", r.floor * scale, **labels))
    per_gpu: dict[str, int] = {}
    for (_check, gpu), n in failures_by_gpu(store, now).items():
        per_gpu[gpu] = per_gpu.get(gpu, 0) + n
    out += [Sample.of("gpuwatchd_diag_failures_30d", n, gpu=g) for g, n in sorted(per_gpu.items())]
    out += [
        Sample.of("gpuwatchd_diag_inspect", 1, check=c, gpu=g)
        for c, g in repeat_offenders(store, now, inspect_after)
    ]
    return out


class DiagScheduler:
    """Starts diag runs on an idle node; a health-engine listener for "critical cleared"."""

    def __init__(
        self,
        cfg: Config,
        state: State,
        clock: Clock,
        store: EventStore,
        node: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self._state = state
        self._clock = clock
        self._store = store
        self._node = node
        self._env = env
        self._lock = threading.Lock()
        self._had_critical = False
        self._pending = ""  # trigger of a run owed (after_critical), else ""
        self._last_scheduled = clock.time()
        self._worker: WorkerRun | None = None
        self._running = ""
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: list[Sample] = []
        self._refreshed = -REFRESH_SECONDS
        self.version = 0
        self.last_report: DiagRun | None = None
        self._slurm_checked = (-1.0, "")

    # --- inputs ---------------------------------------------------------------------

    def update(self, findings: Iterable[Finding], now: float | None = None) -> None:
        """HealthEngine listener: note when the last critical condition clears."""
        # a job's hang is the job's: its end does not call for a diag of the node
        critical = any(f.severity == Severity.CRITICAL and f.scope != "job" for f in findings)
        with self._lock:
            if self._had_critical and not critical and self.cfg.diag.after_critical:
                self._pending = "after_critical"
            self._had_critical = critical

    def busy(self) -> str:
        """Why the node is not idle (a workload, a Slurm job), or ""."""
        snap = self._state.snapshot().sources.get("workloads")
        if snap is not None and snap.workloads is not None:
            for w in snap.workloads.current:
                return f"{w.kind} workload {w.slurm_job or w.pod or w.id} on the node"
        return self._slurm_busy()

    def _slurm_busy(self) -> str:
        sl = self.cfg.remediation.slurm
        if not (sl.node_name or sl.drain_on) or shutil.which(sl.scontrol) is None:
            return ""
        t, why = self._slurm_checked
        now = time.monotonic()  # a rate limit on sinfo calls: real time, whatever the clock
        if now - t < 5.0:
            return why
        try:
            node = SlurmNodes(self.cfg, self._node, self._env).this_node()
            state = node.state.lower() if node is not None else ""
            why = f"Slurm node {state}" if any(s in state for s in SLURM_BUSY_STATES) else ""
        except Exception as exc:  # Slurm unreachable: do not load GPUs a job may hold
            why = f"Slurm state unknown ({exc})"
        self._slurm_checked = (now, why)
        return why

    # --- deciding and running ---------------------------------------------------------

    def due(self, now: float) -> tuple[str, str] | None:
        """(tier, trigger) of the run owed now, or None."""
        with self._lock:
            if self._pending:
                return "standard", self._pending
        every = self.cfg.diag.schedule_seconds
        if every > 0 and now - self._last_scheduled >= every:
            return self.cfg.diag.schedule_tier, "schedule"
        return None

    def tick(self) -> DiagRun | None:
        """Run what is due if the node is idle; the thread calls this, tests too."""
        now = self._clock.time()
        want = self.due(now)
        if want is None or self._stopping.is_set():
            return None
        if self.busy():
            return None  # not idle: try again at the next tick
        tier, trigger = want
        with self._lock:
            self._running = tier
        self.version += 1
        from gpuwatchd.diag.run import run_recorded

        try:
            report, offenders = run_recorded(
                self.cfg, self._store, tier, trigger, busy=self.busy, on_start=self._started
            )
        finally:
            with self._lock:
                self._running = ""
                self._worker = None
        with self._lock:
            if trigger == "schedule":
                self._last_scheduled = now
            elif not report.cancelled:
                self._pending = ""  # an owed run is owed until one completes
        for check, gpu in offenders:
            log.warning("diag: %s failed on GPU %s repeatedly: drain_and_inspect", check, gpu)
        log.info(
            "diag %s (%s): %s%s",
            tier,
            trigger,
            report.verdict,
            f", cancelled: {report.cancelled}" if report.cancelled else "",
        )
        self.last_report = report
        self._refreshed = -REFRESH_SECONDS
        self.version += 1
        return report

    def _started(self, worker: WorkerRun) -> None:
        with self._lock:
            self._worker = worker
        if self._stopping.is_set():
            worker.cancel("daemon stopping")

    # --- thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduling thread (only when something can be due)."""
        if not self.active:
            return
        self._thread = threading.Thread(target=self._loop, name="diag", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping.wait(CHECK_SECONDS):
            try:
                self.tick()
            except Exception:
                log.exception("diag scheduler")

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel a run in progress and stop the thread."""
        self._stopping.set()
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.cancel("daemon stopping")
        if self._thread is not None:
            self._thread.join(timeout)

    # --- what sinks read --------------------------------------------------------------

    def samples(self) -> list[Sample]:
        """The gpuwatchd_diag_* series (the store re-read at most once a minute)."""
        now = self._clock.monotonic()
        if now - self._refreshed >= REFRESH_SECONDS:
            self._refreshed = now
            try:
                fresh = diag_samples(
                    self._store, self._clock.time(), self.cfg.diag.inspect_after_failures
                )
            except Exception:
                log.exception("diag samples")
                fresh = self._samples
            if fresh != self._samples:
                self._samples = fresh
                self.version += 1
        if not self.active:  # unused: no series beyond what stored runs say
            return list(self._samples)
        running = Sample.of("gpuwatchd_diag_running", 1 if self._running else 0)
        return [*self._samples, running]

    @property
    def active(self) -> bool:
        """Whether the daemon may start runs itself (a schedule or after_critical)."""
        return self.cfg.diag.schedule_seconds > 0 or self.cfg.diag.after_critical

    def status(self) -> Mapping[str, Any]:
        """For /status: what runs now, the last runs, repeat offenders."""
        runs = last_runs(self._store, 3)
        return {
            "running": self._running,
            "schedule_seconds": self.cfg.diag.schedule_seconds,
            "after_critical": self.cfg.diag.after_critical,
            "pending": self._pending,
            "last_runs": [
                {
                    "time": r.started,
                    "tier": r.tier,
                    "verdict": r.verdict,
                    "trigger": r.trigger,
                    "seconds": r.seconds,
                    "cancelled": r.cancelled,
                    "failed": [f"{x.check}:{x.gpu}" for x in r.failed],
                }
                for r in runs
            ],
            "inspect": [
                f"{c}:{g}"
                for c, g in repeat_offenders(
                    self._store, time.time(), self.cfg.diag.inspect_after_failures
                )
            ],
            "worker_python": self.cfg.diag.python or sys.executable,
        }
