"""Which GPU a synchronous job waits for, and how much slower the job runs.

In a synchronous job every step ends in a collective: a rank that computes
longer keeps its GPU busy in compute while the others' GPUs sit in NCCL
kernels waiting for it (kernels resident, few SMs active). Over a window the
slow rank's compute activity stands above its peers' by about its extra time:
a rank 10 % slower per step shows about 1.1 times its peers' SM activity,
while every GPU's utilization stays alike (the waiting ones run NCCL kernels).

Per job with two GPUs or more, each evaluation takes the window's mean compute
and utilization per GPU, the GPU with the most compute against the median of
the others (the busy ratio), and decides when, held for `hold_seconds`:
- the ratio is at least 1 + `min_slowdown` (1 + `min_slowdown_with_cause`
  when the node shows a cause on that GPU: a throttle reason, low clocks...);
- the peers still step (their compute above `min_busy`) and wait rather than
  idle (their utilization no lower than the slow GPU's less `wait_tolerance`:
  a rank that idles on its host is a data-loader or host imbalance, not this);
- the ratio stays under `max_ratio`: beyond it one rank works alone (an eval
  or a checkpoint on rank 0), the hang detector's straggler, not a slowdown.
The job's pace (its step rate against its own baseline) is the rate of its NCCL
collectives where its RAS service answers (counts from the hang monitor's RAS
polls), else its peers' compute against what it was while balanced: in a
synchronous job with a fixed amount of work per step, a peer's compute per
second follows the step rate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gpuwatchd.health.slowdowns import averages
from gpuwatchd.health.slowdowns.causes import Cause, node_causes
from gpuwatchd.health.slowdowns.readings import GpuPace
from gpuwatchd.jobview import JobView

__all__ = ["JobPace", "SlowdownDetector", "SlowdownThresholds"]

MAX_JOBS = 64  # jobs followed at once (a node runs a handful); more are skipped
MAX_POLLS = 600  # per GPU, whatever the poll interval


@dataclass(frozen=True, slots=True)
class SlowdownThresholds:
    """How the detector decides; defaults measured by benchmarks/bench_slowdown.py."""

    window_seconds: float = 60.0
    hold_seconds: float = 30.0
    grace_seconds: float = 60.0  # a job's first activity this long before it is judged
    min_slowdown: float = 0.07
    min_slowdown_with_cause: float = 0.04
    max_ratio: float = 2.0
    min_busy: float = 0.05
    min_utilization: float = 0.2
    wait_tolerance: float = 0.25
    release_seconds: float = 30.0  # windows that miss for less than this keep the decision
    min_coverage: float = 0.75  # share of the window with polls of every GPU
    clock_deficit: float = 0.08
    ecc_storm_per_second: float = 1.0
    baseline_weight: float = 0.1  # of each balanced window in the job's baseline pace
    learn_seconds: float = 300.0  # each GPU's share of the job's compute is learned this long
    spread_factor: float = 1.2  # a job's own swing in its busy ratios, times this: its noise floor


@dataclass(frozen=True, slots=True)
class JobPace:
    """One job at one evaluation: its rhythm, its slowest member, the decision."""

    job: JobView
    gpus: int
    pace: float | None = None  # step rate against the job's baseline (1 = as fast)
    pace_from: str = ""  # "ras" (its collectives' rate) or "gpu" (its waiting GPUs' compute)
    busy_ratio: float | None = None  # slowest GPU's compute over its peers' median
    slowest: str = ""  # the GPU the job waits for ("" = none judged)
    causes: tuple[Cause, ...] = ()
    suspected: bool = False
    since: float = 0.0  # when the condition began (suspected or pending)
    slowdown: float = 0.0  # how much slower the job steps for its slowest member (0.1 = 10 %)
    by: str = ""  # "busy_ratio" (its compute over its peers') or "pace" (a link, the job's pace)


class _Job:
    __slots__ = (
        "active_since",
        "baselines",
        "collectives",
        "candidate",
        "last",
        "last_slow",
        "learn_since",
        "learned",
        "polls",
        "seen",
        "shares",
        "since",
        "spread",
        "suspected",
    )

    def __init__(self) -> None:
        self.polls: dict[str, deque[tuple[float, GpuPace]]] = {}
        self.shares: dict[str, deque[float]] = {}  # log(compute / the job's median), learning
        self.learn_since: float | None = None
        self.learned: dict[str, float] = {}  # each GPU's usual share (1 = the job's median)
        self.spread = 0.0  # the largest swing of a GPU's log busy ratio while learning
        self.last: JobPace | None = None  # the last evaluation that found the job slowed
        self.last_slow = 0.0
        self.active_since: float | None = None
        self.baselines: dict[
            str, float
        ] = {}  # the job's pace while balanced, per way of reading it
        self.collectives: deque[tuple[float, float]] = deque(maxlen=64)  # (answer time, count)
        self.candidate = ""
        self.since = 0.0
        self.suspected = False
        self.seen = 0.0


class SlowdownDetector:
    """Feed it each NVML poll with the node's jobs; it answers one JobPace per job."""

    def __init__(self, thresholds: SlowdownThresholds | None = None) -> None:
        self.thresholds = thresholds or SlowdownThresholds()
        self._jobs: dict[str, _Job] = {}

    def observe(
        self,
        jobs: Sequence[JobView],
        gpus: Sequence[GpuPace],
        now: float,
        collectives: Mapping[str, tuple[float, float]] | None = None,
    ) -> list[JobPace]:
        """Record this poll for each job's GPUs and judge every job. `collectives`: per job,
        (time of its latest RAS answer, collectives its slowest rank completed so far)."""
        by_gpu = {g.gpu: g for g in gpus}
        out: list[JobPace] = []
        live = {j.job for j in jobs}
        for name in [n for n in self._jobs if n not in live]:
            del self._jobs[name]  # the job ended or left the node
        for job in jobs:
            if job.job not in self._jobs and len(self._jobs) >= MAX_JOBS:
                continue
            state = self._jobs.setdefault(job.job, _Job())
            state.seen = now
            counted = (collectives or {}).get(job.job)
            if counted is not None and (
                not state.collectives or counted[0] > state.collectives[-1][0]
            ):
                if state.collectives and counted[1] < state.collectives[-1][1]:
                    state.collectives.clear()  # a new communicator: counts start again
                state.collectives.append(counted)
            for gpu in job.gpus:
                reading = by_gpu.get(gpu)
                if reading is not None:
                    state.polls.setdefault(gpu, deque(maxlen=MAX_POLLS)).append((now, reading))
            out.append(self._judge(job, state, now))
        return out

    def _judge(self, job: JobView, state: _Job, now: float) -> JobPace:
        t = self.thresholds
        start = now - t.window_seconds
        windows: dict[str, list[GpuPace]] = {}
        for gpu, dq in state.polls.items():
            while dq and dq[0][0] < start - t.window_seconds:
                dq.popleft()  # keep two windows: the causes' counters look back one
            windows[gpu] = [p for ts, p in dq if ts >= start]
        gpus = [g for g in job.gpus if windows.get(g)]
        compute = {g: _mean([p.compute() for p in windows[g]]) for g in gpus}
        util = {g: _mean([p.utilization for p in windows[g]]) for g in gpus}
        active = all((util[g] or 0.0) >= t.min_utilization for g in gpus) and bool(gpus)
        if not active:
            state.active_since = None
        elif state.active_since is None:
            state.active_since = now
        covered = all(
            _span(state.polls[g], start, t.window_seconds) >= t.min_coverage for g in gpus
        )
        judged = bool(
            active
            and covered
            and state.active_since is not None
            and now - state.active_since >= t.grace_seconds
            and all(compute[g] is not None for g in gpus)
        )
        base = JobPace(job, len(gpus))
        if not judged or len(gpus) < 2:
            state.candidate, state.suspected, state.last = "", False, None
            return base
        own = self._learn(state, gpus, compute, now)
        rel = {g: (compute[g] or 0.0) / own.get(g, 1.0) for g in gpus}
        slowest = max(gpus, key=lambda g: rel[g])
        peers = [g for g in gpus if g != slowest]
        peer_compute = averages.median(compute[g] or 0.0 for g in peers)
        peer_rel = averages.median(rel[g] for g in peers)
        peer_util = averages.median(util[g] or 0.0 for g in peers)
        raw = (compute[slowest] or 0.0) / peer_compute if peer_compute > 0 else None
        ratio = rel[slowest] / peer_rel if peer_rel > 0 else None
        pace, pace_from = self._pace(state, peer_compute, ratio, self._rate(state, now))
        causes = self._causes(windows, gpus, slowest)
        hold = 0.5 if state.suspected and slowest == state.candidate else 1.0  # hysteresis
        floor = max(t.min_slowdown, t.spread_factor * state.spread) * hold
        waits = peer_util >= (util[slowest] or 0.0) - t.wait_tolerance
        slow = bool(
            ratio is not None
            and raw is not None
            and peer_compute >= t.min_busy
            and waits
            and max(raw, ratio) <= t.max_ratio
            and (
                (own and ratio >= 1.0 + floor)
                or (causes and max(raw, ratio) >= 1.0 + t.min_slowdown_with_cause * hold)
            )
        )
        if ratio is not None and raw is not None and not own:
            ratio = raw
        slowdown, by = (ratio - 1.0, "busy_ratio") if slow and ratio is not None else (0.0, "")
        need = t.min_slowdown_with_cause * (0.5 if state.suspected else 1.0)
        if not slow and pace is not None and pace <= 1.0 / (1.0 + need):
            # A slow link does not keep its GPU busy in compute: the job's pace falls while
            # the node shows the link degraded on one GPU and not on its peers.
            for gpu in gpus:
                link = tuple(c for c in self._causes(windows, gpus, gpu) if c.link)
                if link:
                    slowest, causes, slow = gpu, link, True
                    slowdown, by = 1.0 / pace - 1.0, "pace"
                    break
        if not slow:
            if state.last is not None and now - state.last_slow < t.release_seconds:
                return replace(state.last, pace=pace, pace_from=pace_from, busy_ratio=ratio)
            state.candidate, state.suspected, state.last = "", False, None
            return JobPace(job, len(gpus), pace=pace, pace_from=pace_from, busy_ratio=ratio)
        if slowest != state.candidate:
            state.candidate, state.since, state.suspected = slowest, now, False
        elif now - state.since >= t.hold_seconds:
            state.suspected = True
        state.last_slow = now
        state.last = JobPace(
            job,
            len(gpus),
            pace=pace,
            pace_from=pace_from,
            busy_ratio=ratio,
            slowest=slowest,
            causes=causes,
            suspected=state.suspected,
            since=state.since,
            slowdown=slowdown,
            by=by,
        )
        return state.last

    def _causes(
        self, windows: dict[str, list[GpuPace]], gpus: Sequence[str], gpu: str
    ) -> tuple[Cause, ...]:
        t = self.thresholds
        return node_causes(
            windows[gpu],
            [windows[g] for g in gpus if g != gpu],
            t.window_seconds,
            clock_deficit=t.clock_deficit,
            ecc_storm_per_second=t.ecc_storm_per_second,
        )

    def _learn(
        self, state: _Job, gpus: Sequence[str], compute: dict[str, float | None], now: float
    ) -> dict[str, float]:
        """Each GPU's usual share of the job's compute, once learned (else {})."""
        if state.learned:
            return state.learned
        if state.learn_since is None:
            state.learn_since = now
        t = self.thresholds
        values = [compute[g] or 0.0 for g in gpus]
        median = averages.median(values)
        if min(values) < t.min_busy or max(values) > t.max_ratio * min(values):
            return {}  # one rank works alone (an eval, a checkpoint): not the job's rhythm
        for g in gpus:
            share = max(compute[g] or 0.0, 1e-6) / median
            state.shares.setdefault(g, deque(maxlen=MAX_POLLS)).append(math.log(share))
        samples = min(len(v) for v in state.shares.values())
        if now - state.learn_since < t.learn_seconds or samples < 3:
            return {}
        state.learned = {g: math.exp(averages.mean(v)) for g, v in state.shares.items()}
        # The swing of each GPU's busy ratio (its share over its peers' median) around its
        # usual value, over the learning polls: the job's own noise floor.
        logs = {g: list(v) for g, v in state.shares.items()}
        swing = 0.0
        for g in gpus:
            usual = math.log(state.learned[g])
            for i, x in enumerate(logs[g]):
                peers = averages.median(
                    logs[p][i] - math.log(state.learned[p]) for p in gpus if p != g
                )
                swing = max(swing, abs(x - usual - peers))
        state.spread = swing
        state.shares = {}
        return state.learned

    def _rate(self, state: _Job, now: float) -> float | None:
        """Collectives per second over the window's RAS answers (None: too few)."""
        got = [(t, n) for t, n in state.collectives if t >= now - self.thresholds.window_seconds]
        if len(got) < 2 or got[-1][0] - got[0][0] < self.thresholds.window_seconds / 2:
            return None
        return (got[-1][1] - got[0][1]) / (got[-1][0] - got[0][0])

    def _pace(
        self, state: _Job, peer_compute: float, ratio: float | None, rate: float | None
    ) -> tuple[float | None, str]:
        """The job's pace against its balanced baseline: by RAS where it answers, else GPUs."""
        t = self.thresholds
        balanced = ratio is not None and ratio < 1.0 + t.min_slowdown / 2
        out: tuple[float | None, str] = (None, "")
        for way, value in (("gpu", peer_compute), ("ras", rate)):
            if value is None:
                continue
            base = state.baselines.get(way)
            if base is None:
                if balanced and value > 0:
                    state.baselines[way] = value
                    out = (1.0, way)
                continue
            if balanced and not state.learned:  # learned with the GPUs' balance, then kept
                w = t.baseline_weight
                state.baselines[way] = base = (1 - w) * base + w * value
            out = (value / base, way) if base > 0 else out
        return out


def _mean(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return averages.mean(got) if got else None


def _span(dq: deque[tuple[float, GpuPace]], start: float, window: float) -> float:
    """The share of the window its polls span (1 = from its start to now)."""
    inside = [ts for ts, _ in dq if ts >= start]
    return (inside[-1] - inside[0]) / window if len(inside) >= 2 else 0.0
