"""A job as the hang path sees it, driven in time: /proc probes every 3 s, NVML every 10 s,
RAS answers on the monitor's cadence (15 s after a 60 s grace), fed to the detector.

Numbers follow what real NCCL jobs showed on 2x H100/H200 over NVLink (issue 21,
tests/fixtures/hangs/ras-2xh100-deadpeer.json): a rank waiting in a collective burns
a core and reads SM activity 18 % at 122 W; training reads SM activity 92 % at 625 W.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwatchd.health.hangs.detector import GpuActivity, HangDetector, HangThresholds, JobVerdict
from gpuwatchd.health.hangs.ras_view import RasView
from gpuwatchd.jobview import JobView, RankView, RasCommunicator, RasRank, RasReport
from gpuwatchd.sources.hangs.ras import parse_report
from tests.hangs.replay import fixture

TRAIN = dict(sm=0.92, watts=625.0)
SPIN = dict(sm=0.18, watts=123.0)  # waiting for a peer over NVLink
IDLE = dict(sm=0.0, watts=80.0)
BASE = 1_800_000_000.0


def recorded_answers() -> dict[str, RasReport]:
    """The real RAS answers of a 2-rank job before and after rank 1 was SIGKILLed."""
    doc = json.loads(fixture("ras-2xh100-deadpeer.json"))
    return {a["when"]: parse_report(a["json_body"]) for a in doc["answers"]}


def report(counts: dict[int, dict[str, int]], pids: dict[int, int], **flags: bool) -> RasReport:
    """A one-communicator answer with these per-rank collective counts."""
    ranks = tuple(
        RasRank(rank=r, host="192.0.2.2", pid=pids[r], nvml_dev=r, collective_counts=c, **flags)
        for r, c in sorted(counts.items())
    )
    return RasReport("2.28.9", (RasCommunicator("0xa46b337f78afebcd", len(pids), ranks),))


@dataclass
class Rank:
    """One rank's behaviour per second: CPU cores, I/O bytes/s, children's CPU, GPU state."""

    pid: int
    rank: int
    cpu: float = 1.0
    io: float = 0.0
    child_cpu: float = 0.0
    gpu: dict[str, float] = field(default_factory=lambda: dict(TRAIN))
    alive: bool = True
    started: float = -600.0  # seconds relative to t = 0
    # running totals
    cpu_s: float = 0.0
    io_b: float = 0.0
    child_s: float = 0.0

    def view(self, t: float) -> RankView:
        return RankView(
            pid=self.pid,
            gpus=(str(self.rank),),
            rank=self.rank,
            world_size=2,
            cpu_seconds=self.cpu_s,
            state="S" if self.alive else "gone",
            io_bytes=int(self.io_b),
            child_cpu_seconds=self.child_s,
            child_io_bytes=0,
            age_seconds=t - self.started,
        )


Script = Callable[[float, "Sim"], None]


class Sim:
    """Drive a two-rank job (or as many as given) through a detector."""

    def __init__(
        self,
        ranks: list[Rank],
        *,
        expected: int | None = 2,
        thresholds: HangThresholds | None = None,
        ras: bool = True,
        start: float = -120.0,
    ) -> None:
        self.ranks = ranks
        self.expected = expected
        self.det = HangDetector(thresholds or HangThresholds())
        self.ras = ras
        self.t = start
        self.counts = {r.rank: {"AllReduce": 1000} for r in ranks}
        self.answer: RasReport | None = None  # set by a script to replace the counts' report
        self.rising = True
        self.flags: dict[str, bool] = {}  # RAS status flags of every rank (destroy_flag...)
        self._ras_at = -1e9
        self.log: list[tuple[float, JobVerdict]] = []

    def job(self) -> JobView:
        ranks = tuple(r.view(self.t) for r in self.ranks)
        return JobView("torch:10.0.0.1:29500", ranks, self.expected, 2, (("job", "j"),))

    def _gpus(self) -> list[GpuActivity]:
        return [
            GpuActivity(str(r.rank), 0.0, 0.0, r.gpu["watts"], 700.0, r.gpu["sm"], r.gpu["sm"] / 4)
            for r in self.ranks
        ]

    def run(self, until: float, script: Script | None = None) -> list[tuple[float, JobVerdict]]:
        """Step in 1 s; probe every 3 s, NVML every 10 s, RAS every 15 s (5 s in doubt)."""
        out = []
        while self.t < until:
            self.t += 1.0
            if script is not None:
                script(self.t, self)
            for r in self.ranks:
                if r.alive:
                    r.cpu_s += r.cpu
                    r.io_b += r.io
                    r.child_s += r.child_cpu
            if self.rising:
                for c in self.counts.values():
                    c["AllReduce"] = c.get("AllReduce", 0) + 10
            nvml = int(self.t) % 10 == 0
            if int(self.t) % 3 and not nvml:
                continue
            gpus = self._gpus() if nvml else None
            views = {}
            ages = [self.t - r.started for r in self.ranks if r.alive]
            every = 5 if self.det.doubtful() or not all(r.alive for r in self.ranks) else 15
            if self.ras and ages and min(ages) >= 60 and self.t - self._ras_at >= every:
                self._ras_at = self.t
                rep = self.answer or report(
                    {k: dict(v) for k, v in self.counts.items()},
                    {r.rank: r.pid for r in self.ranks},
                    **self.flags,
                )
                views["torch:10.0.0.1:29500"] = RasView(BASE + self.t, rep)
            job = self.job()
            (v,) = self.det.observe([job], gpus, BASE + self.t, views) or [_quiet(job)]
            v = dataclasses.replace(v, since=v.since - BASE)
            out.append((self.t, v))
        self.log += out
        return out


def _quiet(job: JobView) -> JobVerdict:
    return JobVerdict(job.job, (), BASE, "")


def first(log: list[tuple[float, JobVerdict]], cond: str = "") -> tuple[float, JobVerdict] | None:
    """The first verdict that suspects (with `cond` among its conditions)."""
    for t, v in log:
        if v.suspected and (not cond or cond in v.conditions):
            return t, v
    return None
