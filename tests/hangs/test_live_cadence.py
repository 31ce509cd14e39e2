"""The replay runs at the daemon's cadences, and the early verdicts lose no time to them.

Live on 1x H200 the remote rendezvous paged 35.3 s after the hang began while the
replay of the same recording said 20-29 s: the daemon took its jobs from the workloads
source, which names an NVML poll's processes after that poll was judged (one NVML
interval late), and its early dumps took a second each with 3 s between them. The
replay now models both (scenario_replay.Replay, TimedProbes); these tests pin the
model and what the detector and monitor do about the time."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.config.schema import HangsConfig
from gpuwatchd.health.hangs.detector import GpuActivity, HangDetector, HangThresholds
from gpuwatchd.health.hangs.early import StackEvidence
from gpuwatchd.jobview import JobView, RankView
from tests.hangs.real_trace import Trace
from tests.hangs.replay import FIXTURES
from tests.hangs.scenario_replay import TimedProbes, replaying

REMOTE_1XH200 = os.path.join(FIXTURES, "remote-rank-missing-1xh200")
IDLE = GpuActivity("0", 0.0, 0.0, 90.0, 700.0, 0.0, 0.0)


def test_early_evidence_reaches_the_detector_as_late_as_the_daemon_has_it() -> None:
    clock = FakeClock(1000.0)
    probes = TimedProbes(clock, dump=0.97, confirm=3.0)
    probes.put(StackEvidence("j", "rendezvous", 1000.0, 1000.0))
    clock.advance(4.9)
    assert probes.evidence() == {}  # two dumps of 0.97 s and the 3 s between them
    clock.advance(0.1)
    ev = probes.evidence()["j"]
    assert (ev.first_at, round(ev.at, 2)) == (1000.0, 1003.97)


def test_the_replay_uses_the_recorded_dump_durations(tmp_path: Path) -> None:
    with replaying(str(tmp_path), Trace(REMOTE_1XH200), 5.0, Config()) as node:
        assert node.probes.dump == 0.971  # trace.json's pyspy[].seconds, the longest
        assert node.probes.confirm == Config().hangs.stacks_confirm_seconds


def test_a_job_the_workloads_poll_names_is_probed_before_the_next_nvml_poll(
    tmp_path: Path,
) -> None:
    """At NVML phase 5 the poll at +5.3 s lists the rank first; the daemon took it at the
    poll 10 s later (its first dumps at +19.3 s live, +18.3 s in the replay)."""
    cfg = dataclasses.replace(Config(), hangs=HangsConfig(stacks=True))
    with replaying(str(tmp_path), Trace(REMOTE_1XH200), 5.0, cfg) as node:
        node.run()
    assert node.stacks_taken[0] < 15.3, node.stacks_taken  # seconds after the hang began
    first = [t for t, found in node.ticks if found][0]
    assert first < 25.0, first


def _rank0(cpu: float) -> JobView:
    rank = RankView(20, ("0",), 0, world_size=2, cpu_seconds=cpu)
    return JobView("torch:m:29500", (rank,), expected_local=1, world_size=2)


def _held(det: HangDetector, times: tuple[float, ...]) -> dict[float, tuple[str, ...]]:
    det.observe([_rank0(1.0)], [IDLE], 100.0)
    det.observe([_rank0(1.0)], None, 103.0)
    assert det.wants_stacks() == ["torch:m:29500"]
    rdv = StackEvidence("torch:m:29500", "rendezvous", 103.5, 108.0, "init_process_group")
    out = {}
    for now in times:
        (v,) = det.observe([_rank0(1.0)], None, now, evidence={"torch:m:29500": rdv})
        out[now] = v.conditions
    return out


def test_the_rendezvous_dates_from_the_probe_that_began_its_quiet_span() -> None:
    """The CPU ratio read at 103 s covers 100-103 s: quiet since 100 s, decided at 115 s."""
    det = HangDetector(HangThresholds(remote_rank_missing_after_seconds=15.0))
    held = _held(det, (106.0, 109.0, 112.0, 114.9, 115.0))
    assert held[114.9] == () and held[115.0] == ("rank_missing",)


def test_the_monitor_is_told_when_an_early_verdict_falls_due() -> None:
    det = HangDetector(HangThresholds(remote_rank_missing_after_seconds=15.0))
    _held(det, (106.0, 109.0))
    assert det.due() == 115.0  # the monitor probes then, off its 3 s cadence
    rdv = StackEvidence("torch:m:29500", "rendezvous", 103.5, 108.0, "init_process_group")
    (v,) = det.observe([_rank0(1.0)], None, 115.0, evidence={"torch:m:29500": rdv})
    assert v.conditions == ("rank_missing",) and det.due() is None


def test_a_rank_named_after_the_nvml_poll_is_read_by_that_poll() -> None:
    """The GPU reading is a state: a job first probed at the tick after the workloads poll
    counts as started on it (RAS may be asked), not one NVML interval later."""
    det = HangDetector(HangThresholds())
    busy = GpuActivity("0", 1.0, 0.3, 600.0, 700.0, 0.9, 0.3)
    det.observe([], [busy], 100.0)
    det.observe([_rank0(1.0)], None, 101.0)
    assert det.started() == ["torch:m:29500"]


def test_a_rank_missing_here_dates_from_the_probe_that_began_its_quiet_span() -> None:
    det = HangDetector(HangThresholds())
    three = RankView(21, ("0",), 0, world_size=4, cpu_seconds=1.0)
    job = JobView("torch:m:29501", (three,), expected_local=2, world_size=4)
    det.observe([job], [IDLE], 100.0)
    conditions = {now: det.observe([job], None, now)[0].conditions for now in (103.0, 110.0)}
    assert conditions == {103.0: (), 110.0: ("rank_missing",)}  # 10 s from 100 s
