"""The 4x H200 job recordings through the slowdown detector: controls quiet, slowdowns named.

Slowdowns are synthesized on real recordings (tests/slowdowns/replay.py); the daemon's
10 s NVML cadence is replayed (GPM's SM activity averaged over each poll). The full
figures (latency, right-GPU share, false alerts per node-week) are benchmarks/bench_slowdown.py's.
"""

from __future__ import annotations

import random

import pytest

from gpuwatchd.health.slowdowns.detector import SlowdownDetector, SlowdownThresholds
from tests.slowdowns import replay as R

INTERVAL = 10.0
ONSET = 480.0  # after the job's grace minute and the five minutes of learning its balance


def _named(
    name: str, gpu: str, level: float, kind: str, seed: int
) -> tuple[float, R.JobPace] | None:
    rec = R.load(name)
    rng = random.Random(seed)
    polls = R.slowed(R.looped(rec, ONSET + 300.0), gpu, level, ONSET, kind)
    polls = R.at_interval(R.noisy(polls, rng, 0.05, 0.02), INTERVAL, rng.uniform(0, INTERVAL))
    return R.first_named(R.run(rec.job, polls))


@pytest.mark.parametrize("name", R.CONTROLS)
def test_no_control_recording_is_called_slow(name: str) -> None:
    # healthy DDP and FSDP, a checkpoint, eval pauses (one rank computes alone for a minute),
    # a slow data loader, compilation at start, a job that ends: looped to half an hour
    rec = R.looped(R.load(name), 1800.0)
    for seed in range(3):
        rng = random.Random(seed)
        polls = R.at_interval(R.noisy(rec.polls, rng, 0.05, 0.02), INTERVAL, rng.uniform(0, 10))
        assert R.first_named(R.run(rec.job, polls)) is None, (name, seed)


def test_a_job_whose_ranks_take_turns_is_judged_against_its_own_swing() -> None:
    # The FSDP recording's ranks lead in turn by up to 1.5x for a minute at a time: a fixed
    # threshold calls that a slowdown; the swing learned in the job's first minutes does not.
    rec = R.looped(R.load("healthy-fsdp"), 3600.0)
    polls = R.at_interval(R.noisy(rec.polls, random.Random(1), 0.05, 0.02), INTERVAL, 3.0)
    fixed = SlowdownDetector(SlowdownThresholds(spread_factor=0.0))
    assert R.first_named(R.run(rec.job, polls, fixed)) is not None
    assert R.first_named(R.run(rec.job, polls)) is None


@pytest.mark.parametrize("name", ["healthy-ddp", "compile-start"])
def test_a_rank_ten_percent_slower_is_named_within_two_minutes_nine_times_in_ten(
    name: str,
) -> None:
    rec = R.load(name)
    rng = random.Random(name)
    right = 0
    for i in range(10):
        gpu = rec.gpus[i % 2]
        onset = rng.uniform(420.0, 660.0)
        polls = R.slowed(R.looped(rec, onset + 300.0), gpu, 0.10, onset, "compute")
        polls = R.at_interval(R.noisy(polls, rng, 0.05, 0.02), INTERVAL, rng.uniform(0, 10))
        found = R.first_named(R.run(rec.job, polls))
        if found is None:
            continue
        at, pace = found
        assert pace.slowest == gpu, (i, pace)  # never the wrong GPU
        assert pace.by == "busy_ratio" and 0.05 <= pace.slowdown <= 0.17, pace
        assert pace.causes == ()  # nothing on the node explains it
        right += at - onset <= 120.0
    assert right >= 9


def test_a_throttled_gpu_is_named_with_its_cause() -> None:
    found = _named("healthy-ddp", "3", 0.10, "throttle", seed=4)
    assert found is not None
    _, pace = found
    assert pace.slowest == "3"
    assert [c.name for c in pace.causes] == ["thermal_throttle", "clocks_low"]
    assert "sw_thermal_slowdown" in pace.causes[0].detail


def test_a_pcie_link_trained_down_is_named_by_the_jobs_pace() -> None:
    # the slow rank waits on copies, not in compute: its GPU is not the busiest one
    found = _named("compile-start", "2", 0.10, "pcie", seed=5)
    assert found is not None
    _, pace = found
    assert pace.slowest == "2" and pace.by == "pace"
    assert [(c.name, c.link) for c in pace.causes] == [("pcie_degraded", "pcie")]
    assert pace.pace is not None and pace.pace < 0.95


def test_the_finding_resolves_when_the_gpu_recovers() -> None:
    rec = R.looped(R.load("healthy-ddp"), 1500.0)
    slow = R.slowed(rec, "2", 0.2, ONSET, "compute")
    back = R.slowed(rec, "2", 0.0, ONSET, "compute")
    polls = [p if p[0] < 900.0 else q for p, q in zip(slow, back, strict=True)]
    paces = R.run(rec.job, R.at_interval(polls, INTERVAL))
    assert any(p.suspected for t, p in paces if t < 900.0)
    assert not any(p.suspected for t, p in paces if t > 1000.0)
