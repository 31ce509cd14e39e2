"""Stuck GPU, a suspected NCCL hang: busy at idle power with no memory traffic, for minutes.

NCCL's collective kernels wait for their peers by spinning on flags in
memory. When a peer never arrives (its rank died, hangs, or skipped the
collective) the kernel keeps running: NVML's utilisation, "a kernel was
executing during the sample period", reads ~100 %, but the kernel does
no arithmetic and moves no data, so the power draw stays near idle and
the memory-controller utilisation near 0. Real work at 100 %
utilisation draws much more power or moves memory. The pattern has to
hold for `min_duration_seconds` (default 5 min) before it is reported,
which rules out the short waits of a healthy job.

`step()` is the pure core over successive readings; `StuckDetector`
keeps its state between calls for the health engine;
`readings_from_snapshot()` adapts the NVML source's samples and GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from gpuwatchd.clock import Clock
from gpuwatchd.health.hangs.gpu import POWER, POWER_LIMIT, UTIL, activity_from_samples
from gpuwatchd.logs import escape_control
from gpuwatchd.model import Action, Finding, GpuInventory, Labels, Sample, Severity

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.state import NodeSnapshot

__all__ = [
    "ALERTNAME",
    "GpuReading",
    "StuckDetector",
    "StuckState",
    "StuckThresholds",
    "matches",
    "proc_describer",
    "readings_from_samples",
    "readings_from_snapshot",
    "step",
]

ALERTNAME = "GpuStuckSuspected"
RULE = "gpu_stuck"
REMEDIATION = (
    "The GPU itself is usually fine: a kernel is waiting for a peer. Check the job's other "
    "ranks (a dead or stuck rank, a node that left), take Python stacks of the processes "
    "listed (py-spy dump --pid PID) and rerun with NCCL_DEBUG=INFO; set a collective timeout "
    "(TORCH_NCCL_ASYNC_ERROR_HANDLING=1, init_process_group(timeout=...)) so hangs end on "
    "their own. If confirmed, kill and restart the job."
)
SUBJECT_LABELS = ("gpu", "uuid", "pci_bus_id")


@dataclass(frozen=True)
class StuckThresholds:
    """When a GPU counts as stuck; defaults match config.StuckConfig."""

    min_utilization: float = 0.95
    max_memory_utilization: float = 0.02
    max_power_ratio: float = 0.3
    min_duration_seconds: float = 300.0
    max_gap_seconds: float = 120.0
    # used only when NVML reports no power limit
    fallback_max_power_watts: float = 150.0
    enabled: bool = True

    @classmethod
    def from_config(cls, cfg: Config) -> StuckThresholds:
        """Read health.stuck if the config has that section, else the defaults."""
        section = getattr(cfg.health, "stuck", None)
        if section is None:
            return cls()
        return cls(
            min_utilization=section.min_utilization,
            max_memory_utilization=section.max_memory_utilization,
            max_power_ratio=section.max_power_ratio,
            min_duration_seconds=section.min_duration_seconds,
            max_gap_seconds=section.max_gap_seconds,
            enabled=section.enabled,
        )


@dataclass(frozen=True)
class GpuReading:
    """What the detector needs from one NVML poll of one GPU; None = not read."""

    gpu: str
    utilization: float | None
    memory_utilization: float | None
    power_watts: float | None
    power_limit_watts: float | None = None
    subject: Labels = ()
    processes: tuple[str, ...] = ()  # "1234 python train.py"
    pids: tuple[int, ...] = ()  # the processes NVML lists, named only when the GPU looks stuck


def matches(r: GpuReading, t: StuckThresholds) -> bool:
    """True if this one reading shows the stuck pattern."""
    if r.utilization is None or r.memory_utilization is None or r.power_watts is None:
        return False
    if r.power_limit_watts:
        low_power = r.power_watts <= t.max_power_ratio * r.power_limit_watts
    else:
        low_power = r.power_watts <= t.fallback_max_power_watts
    return (
        r.utilization >= t.min_utilization
        and r.memory_utilization <= t.max_memory_utilization
        and low_power
    )


@dataclass(frozen=True)
class StuckState:
    """Per GPU: when the pattern started (wall, shown) and, on the step clock, since when
    it holds and when it was last seen."""

    since: Mapping[str, float] = field(default_factory=dict)
    last: Mapping[str, float] = field(default_factory=dict)
    held_from: Mapping[str, float] = field(default_factory=dict)


def step(
    state: StuckState,
    readings: Iterable[GpuReading],
    now: float,
    t: StuckThresholds,
    mono: float | None = None,
) -> tuple[StuckState, list[Finding]]:
    """Fold one set of readings taken at `now` into the state; return the findings.

    Durations are measured on `mono` (the poll's monotonic time) when given,
    so a step of the wall clock neither silences nor hastens the detector;
    `now` (wall) only dates the finding.
    """
    at = now if mono is None else mono
    since: dict[str, float] = {}
    last: dict[str, float] = {}
    held_from: dict[str, float] = {}
    findings: list[Finding] = []
    if not t.enabled:
        return StuckState(), findings
    for r in readings:
        if not matches(r, t):
            continue  # the pattern broke (or was not readable): its clock restarts
        start = state.since.get(r.gpu)
        held = state.held_from.get(r.gpu)
        seen = state.last.get(r.gpu)
        if start is None or held is None or seen is None or not 0 <= at - seen <= t.max_gap_seconds:
            start, held = now, at
        since[r.gpu], last[r.gpu], held_from[r.gpu] = start, at, held
        if at - held >= t.min_duration_seconds:
            findings.append(_finding(r, start, at - held, t))
    state = StuckState(MappingProxyType(since), MappingProxyType(last), MappingProxyType(held_from))
    return state, findings


def _finding(r: GpuReading, start: float, held: float, t: StuckThresholds) -> Finding:
    power = f"{r.power_watts:.0f} W"
    if r.power_limit_watts:
        power += f" ({100 * (r.power_watts or 0) / r.power_limit_watts:.0f}% of its limit)"
    procs = ", ".join(r.processes) if r.processes else "none reported by NVML"
    reason = (
        f"GPU {r.gpu} has been {100 * (r.utilization or 0):.0f}% busy at {power} with "
        f"{100 * (r.memory_utilization or 0):.0f}% memory utilisation for "
        f"{_duration(held)}: a kernel is spinning without doing work, as a NCCL "
        f"collective waiting for a missing peer does. Processes: {procs}."
    )
    return Finding(
        rule=RULE,
        alertname=ALERTNAME,
        scope="gpu",
        subject=r.subject or (("gpu", r.gpu),),
        severity=Severity.WARNING,
        reason=reason,
        action=Action.RESTART_APP,
        remediation=REMEDIATION,
        since=start,
    )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


# --- adapters -------------------------------------------------------------------------


def readings_from_samples(
    samples: Iterable[Sample],
    gpus: GpuInventory | None = None,
    describe: Callable[[int], str] | None = None,
) -> list[GpuReading]:
    """Build readings from the NVML source's samples (and its GPUs' processes for pids)."""
    samples = list(samples)
    subjects: dict[str, Labels] = {}  # GPUs with a utilisation or power reading
    for s in samples:
        gpu = s.label("gpu")
        if gpu and s.name in (UTIL, POWER, POWER_LIMIT):
            subjects.setdefault(gpu, tuple((k, s.label(k)) for k in SUBJECT_LABELS if s.label(k)))
    pids = gpus.pids_by_gpu() if gpus is not None else {}
    return [
        GpuReading(
            a.gpu,
            a.utilization,
            a.memory_utilization,
            a.power_watts,
            a.power_limit_watts,
            subjects[a.gpu],
            tuple(describe(p) if describe else str(p) for p in pids.get(a.gpu, ())),
            tuple(pids.get(a.gpu, ())),
        )
        for a in activity_from_samples(samples)
        if a.gpu in subjects
    ]


def readings_from_snapshot(
    snapshot: NodeSnapshot, describe: Callable[[int], str] | None = None
) -> tuple[float | None, list[GpuReading]]:
    """(the NVML poll's timestamp, its readings); (None, []) without NVML data."""
    nvml = snapshot.sources.get("nvml")
    if nvml is None or not nvml.ok:
        return None, []
    return nvml.timestamp, readings_from_samples(nvml.samples, nvml.inventory, describe)


class StuckDetector:
    """Keeps the StuckState between health-engine evaluations.

    Call `evaluate(snapshot)` after every state change; a snapshot whose
    NVML poll was already seen changes nothing, so calling it often is
    harmless. Findings keep being returned while the GPU stays stuck.
    """

    def __init__(
        self,
        thresholds: StuckThresholds,
        clock: Clock,
        describe: Callable[[int], str] | None = None,
    ) -> None:
        self.thresholds = thresholds
        self._clock = clock
        self._describe = describe
        self._state = StuckState()
        self._seen: float | None = None
        self._findings: list[Finding] = []

    def evaluate(self, snapshot: NodeSnapshot) -> list[Finding]:
        """Findings for the GPUs stuck as of the latest NVML poll.

        Runs on the consumer thread at every publish: a poll already judged costs a
        lookup, and a process is named from /proc (its cmdline, which waits on the
        process's memory map) only on a GPU that shows the stuck pattern now."""
        nvml = snapshot.sources.get("nvml")
        if nvml is None or not nvml.ok:
            return []
        if nvml.timestamp == self._seen:
            return list(self._findings)
        stamp, readings = readings_from_snapshot(snapshot)
        if stamp is None:
            return []
        if self._describe is not None:
            readings = [self._named(r) if matches(r, self.thresholds) else r for r in readings]
        now = stamp or self._clock.time()
        nvml = snapshot.sources.get("nvml")
        mono = nvml.monotonic if nvml is not None and nvml.monotonic else None
        self._state, self._findings = step(self._state, readings, now, self.thresholds, mono)
        self._seen = stamp
        return list(self._findings)

    def _named(self, r: GpuReading) -> GpuReading:
        describe = self._describe
        assert describe is not None
        return replace(r, processes=tuple(describe(p) for p in r.pids))

    def observe(self, readings: Sequence[GpuReading], now: float | None = None) -> list[Finding]:
        """Feed readings directly (scripts, tests); `now` defaults to the clock."""
        at = self._clock.time() if now is None else now
        self._state, self._findings = step(self._state, readings, at, self.thresholds)
        return list(self._findings)

    def stuck_since(self) -> Mapping[str, float]:
        """GPU -> wall time the pattern started, for GPUs currently showing it."""
        return dict(self._state.since)


def proc_describer(procfs: str = "/proc", full_cmdline: bool = False) -> Callable[[int], str]:
    """A `describe(pid)` naming a process from procfs: `1234 python`, with its arguments
    (`1234 python train.py --lr 3e-4`) only when `full_cmdline` (xid.alert_cmdline): they
    may hold tokens and go to Alertmanager. Control characters are escaped."""

    def describe(pid: int) -> str:
        try:
            with open(f"{procfs}/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            return str(pid)  # another PID namespace, or gone
        if not argv:
            return str(pid)
        name = os.path.basename(argv[0])
        text = " ".join([name, *argv[1:]]) if full_cmdline else name
        return f"{pid} {escape_control(text, 120)}"

    return describe
