"""A short run of the hang-cause benchmark (benchmarks/bench_hang_causes.py): a dead rank
and a stall, each with a fault of several cause classes before and after the first
stalled rank, and two controls with a node's noise. Thresholds catch a regression of
what docs/benchmarks.md publishes: every cause named right, detection within the
issue's goals, no page without a fault. Speed is the benchmark's, not asserted here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.bench_hang_causes import replay
from tests.hangs.replay import FIXTURES
from tests.hangs.scenario_replay import Expect

FAULTS = [
    ("dead-peer-4xh200", "oom_kill", -5.0),
    ("dead-peer-4xh200", "segfault", 2.0),
    ("dead-peer-4xh200", "gpu_lost", -30.0),
    ("dead-peer-4xh200", "infiniband", 2.0),
    ("unbalanced-4xh200", "hung_task", -5.0),
    ("unbalanced-4xh200", "nvlink", -5.0),
    ("unbalanced-4xh200", "pcie", 2.0),
    ("teardown-destroy-4xh200", "memory_pressure", -5.0),
    ("rendezvous-missing-4xh200", "shm_full", -5.0),
]


@pytest.mark.parametrize(("recording", "kind", "offset"), FAULTS)
def test_the_injected_cause_is_named(
    tmp_path: Path, recording: str, kind: str, offset: float
) -> None:
    got = replay(str(tmp_path), os.path.join(FIXTURES, recording), 0.0, 7, kind, offset)
    assert got.right, f"{recording} + {kind} at {offset:+g} s: named {got.cause!r}: {got.headline}"
    assert got.detected is not None
    # the goals: a dead rank within 15 s, a stall within 30 s (p90; here each case)
    assert got.detected <= (15.0 if recording.startswith("dead") else 30.0)
    assert got.named is not None and got.named <= got.detected + 30.0  # AER polls every 30 s


@pytest.mark.parametrize("recording", ["checkpoint-4xh200", "eval-pause-4xh200"])
def test_no_page_without_a_fault(tmp_path: Path, recording: str) -> None:
    directory = os.path.join(FIXTURES, recording)
    got = replay(str(tmp_path), directory, 5.0, 11)
    assert got.pages == 0, got.headline
    if Expect.load(os.path.join(directory, "expect.json")).max_severity == "ok":
        assert got.detected is None, got.headline
