"""The 4x H200 job recordings replayed through the slowdown detector, with slowdowns synthesized.

Each recording (tests/fixtures/hangs/<name>-4xh200) holds one NVML/GPM poll a
second of a real two-rank job's GPUs. A synthesized slowdown makes one rank
`s` slower per step from `onset` on, in one of three ways:
- "compute": the rank computes `s` longer per step; its peers wait that long
  in NCCL kernels (resident, few SMs active) and every GPU's step stretches;
- "throttle": the same, with the rank's SM clock lowered by the slowdown and a
  thermal clock event reason set (clocks are synthesized for every GPU: the
  recordings have none);
- "pcie": the rank's PCIe link trains down to x8 of x16 and its host transfers
  make its step `s` longer: its GPU waits on copies (no more compute, no
  kernel), its peers wait in NCCL.
For "compute" and "throttle", `s` is how much longer the rank computes (a GPU
`s` slower): the job's step stretches by `s` times the rank's compute share.
The model takes a GPU's compute share of the step from its SM activity over
`PURE_COMPUTE` (a matmul loop's SM activity on H200) and a waiting GPU's SM
activity as `NCCL_WAIT` (what the eval-pause recording's waiting rank shows).
Controls are replayed with multiplicative noise and random offsets.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from gpuwatchd.health.hangs.ras_view import RasView
from gpuwatchd.health.slowdowns.detector import JobPace, SlowdownDetector
from gpuwatchd.health.slowdowns.readings import GpuPace
from gpuwatchd.jobview import JobView, RankView
from gpuwatchd.sources.hangs.ras import parse_report

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hangs"
CONTROLS = (
    "healthy-ddp",
    "healthy-fsdp",
    "checkpoint",
    "eval-pause",
    "eval-pause-2",
    "slow-loader",
    "slow-loader-2",
    "compile-start",
    "ends-normally",
)
# Recordings with steady training long enough to carry a slowdown.
TRAINING = ("healthy-ddp", "healthy-fsdp", "compile-start")
PURE_COMPUTE = 0.96  # SM activity of a bf16 matmul loop on H200 (eval-pause, rank 0)
NCCL_WAIT = 0.008  # SM activity of a rank waiting in an NCCL kernel (eval-pause, rank 1)
PEAK_CLOCK_HZ = 1.98e9  # H200 maximum SM clock
KINDS = ("compute", "throttle", "pcie")

Poll = tuple[float, tuple[GpuPace, ...]]


@dataclass(frozen=True)
class Recording:
    """One recorded job: its view and its GPUs' polls (times from 0)."""

    name: str
    job: JobView
    polls: tuple[Poll, ...]

    @property
    def gpus(self) -> tuple[str, ...]:
        return self.job.gpus

    @property
    def seconds(self) -> float:
        return self.polls[-1][0] - self.polls[0][0]


def _open(path: Path) -> Iterator[str]:
    gz = path.with_name(path.name + ".gz")
    if gz.exists():
        with gzip.open(gz, "rt") as f:
            yield from f
    else:
        with path.open() as f:
            yield from f


def load(name: str) -> Recording:
    """The recording `name` (without the -4xh200 suffix)."""
    d = FIXTURES / f"{name}-4xh200"
    trace = json.loads("".join(_open(d / "trace.json")))
    rows = [json.loads(line) for line in _open(d / "nvml.jsonl") if line.strip()]
    gpu_of: dict[int, str] = {}
    for row in rows:
        for g in row["gpus"]:
            for pid in g.get("processes") or {}:
                gpu_of.setdefault(int(pid), str(g["gpu"]))
    ranks = tuple(
        RankView(pid=int(pid), gpus=(gpu_of.get(int(pid), ""),), rank=int(r), world_size=2)
        for r, pid in sorted(trace["ranks"].items())
    )
    job = JobView(
        job=trace["job_key"],
        ranks=ranks,
        expected_local=2,
        world_size=2,
        labels=(("job", trace["job_key"]),),
    )
    t0 = rows[0]["t"]
    polls = tuple(
        (
            row["t"] - t0,
            tuple(
                GpuPace(
                    str(g["gpu"]),
                    utilization=g.get("utilization"),
                    sm_active=g.get("sm_active"),
                    power_watts=g.get("power_watts"),
                    power_limit_watts=g.get("power_limit_watts"),
                )
                for g in row["gpus"]
            ),
        )
        for row in rows
    )
    return Recording(name, job, polls)


def ras_answers(name: str) -> list[RasView]:
    """The recording's NCCL RAS answers as the hang monitor keeps them (times from the first
    NVML poll)."""
    d = FIXTURES / f"{name}-4xh200"
    trace = json.loads("".join(_open(d / "trace.json")))
    first = json.loads(next(iter(_open(d / "nvml.jsonl"))))["t"]
    return [
        RasView(a["t"] - first, parse_report(a["text"]))
        for a in trace.get("ras", [])
        if a.get("format") == "json" and a.get("text")
    ]


def _stretch(p: GpuPace, compute: float, wait: float) -> GpuPace:
    """`p`'s step with `compute` more of the step in compute and `wait` more in an NCCL wait."""
    extra = compute + wait
    sm = ((p.sm_active or 0.0) + compute * PURE_COMPUTE + wait * NCCL_WAIT) / (1 + extra)
    util = min(1.0, ((p.utilization or 0.0) + extra) / (1 + extra))
    return replace(p, sm_active=sm, utilization=util)


def slowed(
    rec: Recording, gpu: str, slowdown: float, onset: float, kind: str = "compute"
) -> tuple[Poll, ...]:
    """`rec`'s polls with `gpu` slowed by `slowdown` per step from `onset` on (see module doc)."""
    out: list[Poll] = []
    for t, polls in rec.polls:
        on = t >= onset
        row: list[GpuPace] = []
        slow = next(p for p in polls if p.gpu == gpu)
        share = min(1.0, (slow.sm_active or 0.0) / PURE_COMPUTE)  # its compute share of a step
        extra = slowdown if kind == "pcie" else slowdown * share
        for p in polls:
            clock = PEAK_CLOCK_HZ
            if on and extra > 0 and (p.utilization or 0.0) > 0.05:
                if p.gpu != gpu:
                    p = _stretch(p, 0.0, extra)
                elif kind == "pcie":  # longer copies: no more compute, no kernel meanwhile
                    p = replace(
                        p,
                        sm_active=(p.sm_active or 0.0) / (1 + extra),
                        utilization=(p.utilization or 0.0) / (1 + extra),
                    )
                else:
                    p = _stretch(p, extra, 0.0)
            if kind == "throttle":
                events: frozenset[str] = frozenset()
                if on and p.gpu == gpu:
                    clock, events = (
                        PEAK_CLOCK_HZ / (1 + slowdown),
                        frozenset({"sw_thermal_slowdown"}),
                    )
                p = replace(
                    p, sm_clock_hz=clock, sm_clock_max_hz=PEAK_CLOCK_HZ, clock_events=events
                )
            if kind == "pcie":
                width = 8 if on and p.gpu == gpu else 16
                p = replace(
                    p, pcie_width=width, pcie_width_max=16, pcie_generation=5, pcie_generation_max=5
                )
            row.append(p)
        out.append((t, tuple(row)))
    return tuple(out)


def noisy(
    polls: Sequence[Poll], rng: random.Random, sigma: float, bias: float = 0.0
) -> tuple[Poll, ...]:
    """Each activity reading times 1 + N(0, sigma), and each GPU's SM activity times its own
    1 + N(0, bias) for the whole replay (ranks that do a little more work: rank 0's logging);
    clamped to [0, 1]; clocks jitter 0.5 %; poll times +-50 ms."""
    gain: dict[str, float] = {}

    def jitter(v: float | None, k: float = 1.0) -> float | None:
        return None if v is None else min(1.0, max(0.0, v * k * (1 + rng.gauss(0.0, sigma))))

    out: list[Poll] = []
    for t, row in polls:
        new = []
        for p in row:
            k = gain.setdefault(p.gpu, 1 + rng.gauss(0.0, bias) if bias else 1.0)
            clock = p.sm_clock_hz * (1 + rng.gauss(0.0, 0.005)) if p.sm_clock_hz else None
            new.append(
                replace(
                    p,
                    sm_active=jitter(p.sm_active, k),
                    utilization=jitter(p.utilization),
                    sm_clock_hz=clock,
                )
            )
        out.append((t + rng.uniform(-0.05, 0.05), tuple(new)))
    return tuple(out)


def at_interval(polls: Sequence[Poll], interval: float, phase: float = 0.0) -> tuple[Poll, ...]:
    """The daemon's view at its NVML poll `interval`: GPM's SM activity is the mean over
    the interval (GPM samples span the poll), everything else the reading at the poll."""
    out: list[Poll] = []
    since: list[Poll] = []
    due = polls[0][0] + phase
    for t, row in polls:
        since.append((t, row))
        if t < due:
            continue
        due += interval
        mean: list[GpuPace] = []
        for i, p in enumerate(row):
            got = [r[i].sm_active for _, r in since if r[i].sm_active is not None]
            mean.append(replace(p, sm_active=sum(got) / len(got) if got else None))
        out.append((t, tuple(mean)))
        since = []
    return tuple(out)


def looped(rec: Recording, seconds: float, skip: float = 40.0) -> Recording:
    """`rec` with its polls after `skip` s (the job's start) repeated until `seconds` long."""
    head = [p for p in rec.polls if p[0] < skip]
    body = [p for p in rec.polls if p[0] >= skip]
    span = body[-1][0] - body[0][0] + 1.0
    out = list(head)
    k = 0
    while out[-1][0] < seconds:
        out += [(t + k * span, row) for t, row in body]
        k += 1
    return Recording(rec.name, rec.job, tuple(p for p in out if p[0] <= seconds))


def run(
    job: JobView,
    polls: Sequence[Poll],
    detector: SlowdownDetector | None = None,
    start: float = 0.0,
) -> list[tuple[float, JobPace]]:
    """Each poll through a detector (a fresh one unless given); (time, the job's JobPace)."""
    det = detector or SlowdownDetector()
    out = []
    for t, row in polls:
        (pace,) = det.observe([job], row, start + t)
        out.append((start + t, pace))
    return out


def first_named(paces: Sequence[tuple[float, JobPace]]) -> tuple[float, JobPace] | None:
    """The first suspected JobPace and its time."""
    return next(((t, p) for t, p in paces if p.suspected), None)
