"""Stacks taken before a verdict (health/hangs/early.py): the rendezvous for ranks of
other nodes and the kernel that never completes page in seconds, and nothing else does.

The two hang recordings (synthesized from real ones: their PROVENANCE.md) are replayed
by test_real_scenarios_replay.py against their expect.json; here: every control
recording with the stacks on (at its expect.json's NVML phases), a real healthy matmul
and copy loop whose host always reads as waiting in a synchronize, the healthy NVML
captures, and the cases the shapes must not take."""

from __future__ import annotations

import dataclasses
import filecmp
import glob
import json
import os
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.config.schema import HangsConfig
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.health.hangs.detector import GpuActivity, HangDetector, HangThresholds
from gpuwatchd.health.hangs.early import StackEvidence, evidence_of
from gpuwatchd.jobview import JobView, RankView, StackCapture
from gpuwatchd.sources.hangs.stacks import parse_dump
from tests.hangs import synth
from tests.hangs.real_trace import Trace
from tests.hangs.replay import FIXTURES, fixture, polls
from tests.hangs.scenario_replay import Expect, check, replaying

STACKS = {"stacks": True}  # the pause between the dumps: modelled by the replay
CONTROLS = [
    os.path.dirname(p)
    for p in sorted(glob.glob(os.path.join(FIXTURES, "*", "expect.json")))
    if json.loads(Path(p).read_text())["kind"] == "control"
]
SPIN = GpuActivity("0", 1.0, 0.0, 122.0, 700.0, 0.0076, 0.0001)  # one block spinning (H100)


def _stack(name: str, pid: int) -> StackCapture:
    text = fixture(name)
    version, threads = parse_dump(text)
    return StackCapture(pid, True, threads, python=version, raw=text)


def _cfg(**hangs: object) -> Config:
    return dataclasses.replace(Config(), hangs=HangsConfig(**hangs))  # type: ignore[arg-type]


@pytest.mark.parametrize("directory", CONTROLS, ids=[os.path.basename(d) for d in CONTROLS])
def test_no_control_recording_pages_with_the_early_stacks_on(
    tmp_path: Path, directory: str
) -> None:
    want = Expect.load(os.path.join(directory, "expect.json"))
    cfg = dataclasses.replace(
        want.config(), hangs=dataclasses.replace(want.config().hangs, **STACKS)
    )
    for phase in want.nvml_phases:  # the phases its own replay test uses
        with replaying(str(tmp_path / str(phase)), Trace(directory), float(phase), cfg) as node:
            node.run()
        assert not check(node, want), (phase, check(node, want))
        conditions = {c for d in node.monitor.records() for c in d["conditions"]}
        assert not conditions & {"kernel_stuck", "rank_missing"}


def test_a_long_kernel_at_work_with_its_host_in_synchronize_is_never_asked_nor_paged() -> None:
    """Real H100 polls: 6 minutes of bf16 8192x8192 matmuls then 1 GiB copies; every
    capture would show the host waiting in cudaDeviceSynchronize."""
    asked: list[int] = []

    def capture(pid: int) -> StackCapture:
        asked.append(pid)
        return _stack("pyspy-peerdeath.txt", pid)

    monitor = HangMonitor(_cfg(ras=False, **STACKS), FakeClock(), capture=capture)
    for t, jobs, gpus in polls("healthy-polls.jsonl"):
        monitor.observe(jobs, gpus, 1_800_000_000.0 + t)
        monitor.run_pending()
        assert monitor.findings() == []
    assert asked == [] and monitor.records() == []


def test_the_stacks_stay_off_by_default(tmp_path: Path) -> None:
    """Without hangs.stacks no dump is taken; the remote rendezvous waits for the CPU stall."""
    directory = os.path.join(FIXTURES, synth.REMOTE)
    with replaying(str(tmp_path), Trace(directory), 0.0) as node:
        node.run()
    assert node.stacks_taken == []
    assert {c for d in node.monitor.records() for c in d["conditions"]} <= {"cpu_stall"}


def _single(cpu: float) -> JobView:
    return JobView("torch:h:1", (RankView(10, ("0",), 0, world_size=1, cpu_seconds=cpu),), 1, 1)


def test_a_spinning_kernel_whose_host_is_not_in_a_synchronize_waits_for_the_gpu_stall() -> None:
    det = HangDetector(HangThresholds())
    conditions: list[tuple[str, ...]] = []
    for i in range(60):
        now = 100.0 + i
        elsewhere = StackEvidence("torch:h:1", "", now, now)  # the stacks show neither shape
        v = det.observe([_single(float(i))], [SPIN], now, evidence={"torch:h:1": elsewhere})[0]
        conditions.append(v.conditions)
    assert set(conditions[:45]) == {()}  # the generic stall's 45 s, as before
    assert conditions[-1] == ("gpu_stall",)


def test_a_spinning_kernel_in_synchronize_pages_after_ten_seconds_of_the_shape() -> None:
    det = HangDetector(HangThresholds())
    det.observe([_single(0.0)], [SPIN], 100.0)
    assert det.wants_stacks() == ["torch:h:1"]
    sync = StackEvidence("torch:h:1", "synchronize", 101.0, 101.0, "cudaDeviceSynchronize")
    for i in range(1, 12):
        v = det.observe([_single(float(i))], [SPIN], 100.0 + i, evidence={"torch:h:1": sync})[0]
    assert v.conditions == ("kernel_stuck",) and v.severity == "critical"
    assert "GPU 0 at 100 % utilisation, SM activity 0.8 %" in v.reason
    assert "waiting in cudaDeviceSynchronize" in v.reason and v.signals == "gpm+stacks"
    # the kernel completes (the GPU at work again): the verdict ends at once
    busy = GpuActivity("0", 1.0, 0.3, 600.0, 700.0, 0.9, 0.3)
    assert not det.observe([_single(12.0)], [busy], 112.0, evidence={"torch:h:1": sync})[
        0
    ].suspected


def test_stacks_taken_before_the_shape_began_decide_nothing() -> None:
    det = HangDetector(HangThresholds())
    old = StackEvidence("torch:h:1", "synchronize", 50.0, 50.0, "cudaDeviceSynchronize")
    for i in range(30):
        v = det.observe([_single(float(i))], [SPIN], 100.0 + i, evidence={"torch:h:1": old})[0]
        assert not v.suspected
    assert det.wants_stacks() == ["torch:h:1"]


def _rank0(cpu: float, world: int = 4) -> JobView:
    rank = RankView(20, ("0",), 0, world_size=world, cpu_seconds=cpu)
    return JobView("torch:m:29500", (rank,), expected_local=1, world_size=world)


def test_a_job_that_trained_is_never_taken_for_a_remote_rendezvous() -> None:
    """Ranks waiting quietly mid-run (a store barrier while another node checkpoints)."""
    det = HangDetector(HangThresholds())
    busy = GpuActivity("0", 1.0, 0.3, 600.0, 700.0, 0.9, 0.3)
    idle = GpuActivity("0", 0.0, 0.0, 90.0, 700.0, 0.0, 0.0)
    det.observe([_rank0(0.0)], [busy], 100.0)
    rdv = StackEvidence("torch:m:29500", "rendezvous", 101.0, 101.0, "init_process_group")
    for i in range(1, 40):
        v = det.observe([_rank0(1.0)], [idle], 100.0 + i, evidence={"torch:m:29500": rdv})[0]
        assert "rank_missing" not in v.conditions
    assert det.wants_stacks() == []


def test_a_remote_rendezvous_names_the_ranks_that_did_not_arrive() -> None:
    det = HangDetector(HangThresholds())
    idle = GpuActivity("0", 0.0, 0.0, 90.0, 700.0, 0.0, 0.0)
    det.observe([_rank0(1.0, 1024)], [idle], 100.0)
    det.observe([_rank0(1.0, 1024)], [idle], 103.0)
    assert det.wants_stacks() == ["torch:m:29500"]
    rdv = StackEvidence("torch:m:29500", "rendezvous", 104.0, 104.0, "init_process_group")
    for i in range(4, 14):
        v = det.observe([_rank0(1.0, 1024)], [idle], 100.0 + i, evidence={"torch:m:29500": rdv})[0]
    assert v.conditions == ("rank_missing",) and v.severity == "critical"
    assert v.elsewhere == tuple(range(1, 1024)) and v.missing_count == 1023
    assert "rank 0 of 1024 waits in the rendezvous (init_process_group)" in v.reason
    assert "ranks 1-1023 never arrived (expected on other nodes)" in v.reason


def test_evidence_needs_every_rank_in_the_same_shape_in_both_dumps() -> None:
    rdv, sync = _stack("pyspy-rendezvous.txt", 1), _stack("pyspy-peerdeath.txt", 2)
    both = evidence_of("j", {1: rdv, 2: rdv}, {1: rdv, 2: rdv}, 1.0, 4.0)
    assert (both.kind, both.where) == ("rendezvous", "init_process_group")
    assert evidence_of("j", {2: sync}, {2: sync}, 1.0, 4.0).where == "cudaDeviceSynchronize"
    assert evidence_of("j", {1: rdv, 2: sync}, {1: rdv, 2: sync}, 1.0, 4.0).kind == ""
    assert evidence_of("j", {1: rdv}, {1: sync}, 1.0, 4.0).kind == ""  # it moved on
    failed = StackCapture(1, False, error="py-spy may not read pid 1")
    assert evidence_of("j", {1: failed}, {1: failed}, 1.0, 4.0).kind == ""
    assert evidence_of("j", {}, {}, 1.0, 4.0).kind == ""


def test_the_synthesized_recordings_are_what_synth_py_builds(tmp_path: Path) -> None:
    synth.main([str(tmp_path)])
    for name in (synth.REMOTE, synth.KERNEL):
        built = sorted(os.listdir(tmp_path / name))
        match, mismatch, errors = filecmp.cmpfiles(
            tmp_path / name, os.path.join(FIXTURES, name), built, shallow=False
        )
        assert (mismatch, errors) == ([], []), name


@pytest.mark.slow
def test_no_healthy_nvml_capture_ever_reads_as_a_spinning_kernel(tmp_path: Path) -> None:
    """The kernel shape begins with a busy GPU whose SMs idle: no reading of any healthy
    capture (tests/fixtures/nvml, idle and under load, 5 polls each through the NVML
    source on its replay) has it, while the 4x H200 NCCL hang capture does."""
    from gpuwatchd.config import load_text
    from gpuwatchd.health.hangs.gpu import activity_from_samples, classify
    from gpuwatchd.pipeline import SourceSet
    from gpuwatchd.state import State
    from tests.e2e.test_healthy_captures_quiet import NVML, config, healthy_captures

    def classes(capture: Path) -> set[str]:
        cfg = load_text(config(tmp_path, capture), "config.yaml")
        clock, state = FakeClock(1_700_000_000.0), State()
        sources = SourceSet(cfg, state, clock)
        seen: set[str] = set()
        try:
            for _ in range(5):
                sources.runner.poll_once("nvml")
                nvml = state.snapshot().sources["nvml"]
                seen |= {
                    classify(g, HangThresholds())[0] for g in activity_from_samples(nvml.samples)
                }
                clock.advance(cfg.sources.nvml.interval)
        finally:
            for source in sources.runner.sources:
                close = getattr(source, "close", None)
                if callable(close):
                    close()
        return seen

    for capture in healthy_captures():
        assert "spin" not in classes(capture), capture.name
    assert "spin" in classes(NVML / "h200x4-hang-record.json")
