"""Per-job hang decisions from GPU activity and the ranks' CPU time.

Four conditions, each held for a while before it counts:

- gpu_stall: every GPU of the job reads busy (a kernel is resident) while
  doing nothing. With GPM (Hopper and later) "nothing" is SM activity and
  occupancy near zero; without it, low power and no memory traffic.
- cpu_stall: the job's GPUs idle and its processes' CPU time flat.
- rank_missing: fewer local ranks than the job expects, or a rank that was
  seen has gone, while the others make no progress (spin, or flat CPU time).
- straggler: one rank at a different activity than all its peers.

`step()` is pure over typed inputs; `HangDetector` keeps the state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuwatchd.jobview import JobView
from gpuwatchd.model import Sample

__all__ = [
    "CONDITIONS",
    "GpuActivity",
    "HangDetector",
    "HangState",
    "HangThresholds",
    "JobVerdict",
    "activity_from_samples",
    "classify",
    "step",
]

CONDITIONS = ("gpu_stall", "cpu_stall", "rank_missing", "straggler")
UTIL = "gpuwatchd_gpu_utilization_ratio"
POWER = "gpuwatchd_gpu_power_watts"
POWER_LIMIT = "gpuwatchd_gpu_power_limit_watts"
SM_ACTIVE = "gpuwatchd_gpu_sm_active_ratio"
SM_OCCUPANCY = "gpuwatchd_gpu_sm_occupancy_ratio"
DRAM_ACTIVE = "gpuwatchd_gpu_dram_active_ratio"


@dataclass(frozen=True, slots=True)
class HangThresholds:
    """When a job counts as hung; defaults match config.HangsConfig."""

    decide_after_seconds: float = 60.0
    rank_missing_after_seconds: float = 20.0
    busy_utilization: float = 0.95
    idle_utilization: float = 0.05
    max_sm_active: float = 0.05
    max_sm_occupancy: float = 0.05
    max_memory_utilization: float = 0.02
    max_power_ratio: float = 0.3
    fallback_max_power_watts: float = 150.0
    max_cpu_ratio: float = 0.05
    max_gap_seconds: float = 30.0
    single_process_cpu_stall: bool = False


@dataclass(frozen=True, slots=True)
class GpuActivity:
    """One poll of one GPU; None = not read (GPM fields are None where unsupported)."""

    gpu: str
    utilization: float | None
    memory_utilization: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    dram_active: float | None = None


def classify(g: GpuActivity | None, t: HangThresholds) -> tuple[str, str]:
    """('spin' | 'idle' | 'busy' | 'unknown', which signals decided)."""
    if g is None or g.utilization is None:
        return "unknown", ""
    if g.sm_active is not None and g.sm_occupancy is not None:
        if g.utilization >= t.busy_utilization and (
            g.sm_active <= t.max_sm_active and g.sm_occupancy <= t.max_sm_occupancy
        ):
            return "spin", "gpm"
        if g.utilization <= t.idle_utilization:
            return "idle", "utilization"
        return "busy", "gpm"
    if g.utilization <= t.idle_utilization:
        return "idle", "utilization"
    if g.utilization < t.busy_utilization or g.memory_utilization is None:
        return "busy", "utilization"
    if g.power_watts is None:
        return "unknown", ""
    limit = (
        t.max_power_ratio * g.power_limit_watts
        if g.power_limit_watts
        else t.fallback_max_power_watts
    )
    if g.memory_utilization <= t.max_memory_utilization and g.power_watts <= limit:
        return "spin", "power+memory"
    return "busy", "power+memory"


@dataclass(frozen=True, slots=True)
class JobVerdict:
    """What the detector concludes about one job at one poll."""

    job: str
    conditions: tuple[str, ...]  # those held long enough, in CONDITIONS order
    since: float
    signals: str  # "gpm", "power+memory", "utilization", "cpu"
    missing_ranks: tuple[int, ...] = ()
    missing_count: int = 0
    straggler_pids: tuple[int, ...] = ()
    rank_states: tuple[tuple[int, str], ...] = ()  # (pid, spin|idle|busy|unknown)
    reason: str = ""

    @property
    def suspected(self) -> bool:
        """True when any condition has held long enough."""
        return bool(self.conditions)


@dataclass(frozen=True)
class _JobMemory:
    onset: Mapping[str, float] = field(default_factory=dict)
    last_seen: float = 0.0
    seen_ranks: Mapping[int, int] = field(default_factory=dict)  # rank -> pid
    cpu: Mapping[int, tuple[float, float]] = field(default_factory=dict)  # pid -> (t, s)


@dataclass(frozen=True)
class HangState:
    """Per job: condition onsets, ranks seen, the last CPU reading of each pid."""

    jobs: Mapping[str, _JobMemory] = field(default_factory=dict)


def _cpu_ratio(prev: tuple[float, float] | None, now: float, secs: float | None) -> float | None:
    if prev is None or secs is None or now <= prev[0]:
        return None
    return max(0.0, secs - prev[1]) / (now - prev[0])


def _current(
    job: JobView,
    mem: _JobMemory,
    gpus: Mapping[str, GpuActivity],
    now: float,
    t: HangThresholds,
) -> tuple[dict[str, bool], dict[str, object]]:
    """Which conditions hold at this poll, and the details behind them."""
    states = []
    signals = set()
    for r in job.ranks:
        per_gpu = [classify(gpus.get(g), t) for g in r.gpus] or [("unknown", "")]
        kinds = {k for k, _ in per_gpu}
        signals |= {s for _, s in per_gpu if s}
        state = kinds.pop() if len(kinds) == 1 else "busy" if "busy" in kinds else "unknown"
        states.append((r.pid, state))
    cpu_ratios = [_cpu_ratio(mem.cpu.get(r.pid), now, r.cpu_seconds) for r in job.ranks]
    known = [c for c in cpu_ratios if c is not None]
    cpu_flat = bool(known) and len(known) == len(cpu_ratios) and max(known) <= t.max_cpu_ratio
    kinds_all = [s for _, s in states]
    gpu_stall = bool(kinds_all) and all(k == "spin" for k in kinds_all)
    distributed = (job.world_size or 1) > 1 or len(job.ranks) > 1
    cpu_stall = (
        bool(kinds_all)
        and all(k == "idle" for k in kinds_all)
        and cpu_flat
        and (distributed or t.single_process_cpu_stall)
    )
    ranks_now = {r.rank: r.pid for r in job.ranks if r.rank is not None}
    gone = sorted(set(mem.seen_ranks) - set(ranks_now))
    short = max(0, job.expected_local - len(job.ranks)) if job.expected_local is not None else 0
    missing_count = max(short, len(gone))
    straggler: list[int] = []
    if len(states) >= 2:
        # All but one wait in a collective (spin) and one does something else, or all
        # but one work and one sits idle (a stalled rank).
        for pid, state in states:
            others = {s for p, s in states if p != pid}
            if (others == {"spin"} and state in ("busy", "idle")) or (
                others == {"busy"} and state == "idle"
            ):
                straggler.append(pid)
    if len(straggler) != 1:
        straggler = []
    held = {
        "gpu_stall": gpu_stall,
        "cpu_stall": cpu_stall,
        # a rank gone while the others work is a job winding down, not a hang
        "rank_missing": missing_count > 0 and (gpu_stall or cpu_stall or cpu_flat),
        "straggler": bool(straggler),
    }
    if cpu_stall:
        signals.add("cpu")
    details: dict[str, object] = {
        "states": tuple(states),
        "signals": "+".join(sorted(signals)),
        "gone": tuple(gone),
        "missing_count": missing_count,
        "straggler": tuple(straggler),
        "ranks_now": ranks_now,
    }
    return held, details


def _needed(cond: str, t: HangThresholds) -> float:
    return t.rank_missing_after_seconds if cond == "rank_missing" else t.decide_after_seconds


def step(
    state: HangState,
    jobs: Iterable[JobView],
    gpus: Iterable[GpuActivity],
    now: float,
    t: HangThresholds,
) -> tuple[HangState, list[JobVerdict]]:
    """Fold one poll into the state; return a verdict for every job present."""
    by_gpu = {g.gpu: g for g in gpus}
    memories: dict[str, _JobMemory] = {}
    verdicts = []
    for job in jobs:
        mem = state.jobs.get(job.job, _JobMemory())
        if mem.last_seen and now - mem.last_seen > t.max_gap_seconds:
            mem = replace(mem, onset={}, cpu={})  # a gap: start the clocks again
        held, details = _current(job, mem, by_gpu, now, t)
        onset = {c: mem.onset.get(c, now) for c, on in held.items() if on}
        decided = tuple(c for c in CONDITIONS if c in onset and now - onset[c] >= _needed(c, t))
        ranks_now = details["ranks_now"]
        assert isinstance(ranks_now, dict)
        seen = {**mem.seen_ranks, **ranks_now}
        cpu = {r.pid: (now, r.cpu_seconds) for r in job.ranks if r.cpu_seconds is not None}
        memories[job.job] = _JobMemory(onset, now, seen, cpu)
        since = min((onset[c] for c in decided), default=now)
        verdicts.append(_verdict(job, decided, since, details))
    return HangState(memories), verdicts


def _verdict(
    job: JobView, decided: tuple[str, ...], since: float, d: Mapping[str, object]
) -> JobVerdict:
    gone = d["gone"]
    straggler = d["straggler"]
    states = d["states"]
    missing_count = d["missing_count"]
    assert isinstance(gone, tuple) and isinstance(straggler, tuple) and isinstance(states, tuple)
    assert isinstance(missing_count, int)
    parts = []
    signals = str(d["signals"])
    if "gpu_stall" in decided:
        parts.append(f"every GPU of the job busy doing nothing ({signals})")
    if "cpu_stall" in decided:
        parts.append("GPUs idle and no CPU progress in any rank")
    if "rank_missing" in decided:
        names = ", ".join(str(r) for r in gone)
        expected = f" of {job.expected_local} expected" if job.expected_local else ""
        parts.append(
            f"{len(job.ranks)} local rank(s) running{expected}"
            + (f"; rank {names} left" if names else "")
        )
    if "straggler" in decided:
        parts.append(f"pid {', '.join(map(str, straggler))} at a different activity than its peers")
    return JobVerdict(
        job=job.job,
        conditions=decided,
        since=since,
        signals=signals,
        missing_ranks=gone if "rank_missing" in decided else (),
        missing_count=missing_count if "rank_missing" in decided else 0,
        straggler_pids=straggler if "straggler" in decided else (),
        rank_states=states,
        reason="; ".join(parts),
    )


def activity_from_samples(samples: Iterable[Sample]) -> list[GpuActivity]:
    """GPU activity from the NVML source's samples (GPM series when present)."""
    per: dict[str, dict[str, float]] = {}
    keys = {
        POWER: "power",
        POWER_LIMIT: "limit",
        SM_ACTIVE: "sm",
        SM_OCCUPANCY: "occ",
        DRAM_ACTIVE: "dram",
    }
    for s in samples:
        gpu = s.label("gpu")
        if not gpu:
            continue
        if s.name == UTIL:
            key = "mem" if s.label("engine") == "memory" else "util"
        elif s.name in keys:
            key = keys[s.name]
        else:
            continue
        per.setdefault(gpu, {})[key] = s.value
    return [
        GpuActivity(
            gpu,
            v.get("util"),
            v.get("mem"),
            v.get("power"),
            v.get("limit"),
            v.get("sm"),
            v.get("occ"),
            v.get("dram"),
        )
        for gpu, v in sorted(per.items())
    ]


class HangDetector:
    """Keeps the HangState between polls (not thread-safe: one caller)."""

    def __init__(self, thresholds: HangThresholds) -> None:
        self.thresholds = thresholds
        self._state = HangState()
        self._verdicts: list[JobVerdict] = []

    def observe(
        self, jobs: Sequence[JobView], gpus: Sequence[GpuActivity], now: float
    ) -> list[JobVerdict]:
        """Feed one poll; return every job's verdict (suspected or not)."""
        self._state, self._verdicts = step(self._state, jobs, gpus, now, self.thresholds)
        return list(self._verdicts)

    def suspected(self) -> list[JobVerdict]:
        """The verdicts of the last poll that suspect a hang."""
        return [v for v in self._verdicts if v.suspected]
