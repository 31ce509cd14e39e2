"""Every recorded scenario with an expect.json (tests/fixtures/hangs/*/expect.json)
replayed through the hang monitor on its defaults, the whole recording long, at the
NVML poll offsets expect.json names; the monitor must do what expect.json says.

How to add a recording: tests/gpu/scenario_fixture.py (docs/gpu-testing.md)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from tests.hangs.real_trace import Trace
from tests.hangs.replay import FIXTURES
from tests.hangs.scenario_replay import Expect, check, replaying

EXPECT = sorted(glob.glob(os.path.join(FIXTURES, "*", "expect.json")))
CASES = [
    pytest.param(os.path.dirname(path), phase, id=f"{path.split(os.sep)[-2]}-{phase}")
    for path in EXPECT
    for phase in Expect.load(path).nvml_phases
]


def test_the_dead_peer_recording_is_among_the_cases() -> None:
    assert any("dead-peer-2xh100" in str(c.values[0]) for c in CASES)


@pytest.mark.parametrize(("directory", "phase"), CASES)
def test_recorded_scenario_does_what_expect_json_says(
    tmp_path: Path, directory: str, phase: int
) -> None:
    want = Expect.load(os.path.join(directory, "expect.json"))
    trace = Trace(directory)
    with replaying(str(tmp_path), trace, float(phase), want.config()) as node:
        node.run()
    bad = check(node, want)
    timeline = [(round(t, 1), [f.severity.name for f in found]) for t, found in node.found]
    assert not bad, f"{trace.name} at NVML phase {phase}: {bad}; findings over time {timeline}"


def test_a_control_expectation_fails_on_the_dead_peer(tmp_path: Path) -> None:
    """The check is not vacuous: the dead peer read as a control breaks `max_severity`.

    At +5 s (+9 s while the replay read GPM from the poll's last second alone, not over
    its interval as the daemon does): rank 1 is gone and the others made no progress."""
    directory = os.path.join(FIXTURES, "dead-peer-2xh100")
    with replaying(str(tmp_path), Trace(directory), 0.0) as node:
        node.run(forensics=False)
    (bad,) = check(node, Expect(kind="control", max_severity="warning"))
    assert bad.startswith("above warning: first at (5.0, 'CRITICAL'")
    assert "rank 1 died (pid 1274)" in bad and "Decided by: gpu+io+liveness+ras." in bad


def test_the_kernel_hang_replays_when_the_device_paged() -> None:
    # On the H200 the kernel that never completes paged 25.5-27.3 s after the hang in four
    # runs. The replay said 12-21 s: it read SM activity from the recording's last second,
    # where the daemon's GPM is the mean over the whole 10 s poll interval.
    from tests.hangs.delays import one

    directory = os.path.join(FIXTURES, "kernel-never-ends-1xh200")
    firsts = [one(directory, phase, stacks=True)["first"] for phase in (0, 2, 5, 9)]
    assert all(f is not None and 20.0 <= f <= 30.0 for f in firsts), firsts
