"""The job-level hang detector over polls recorded on an H100, and its edge cases."""

from __future__ import annotations

from gpuwatchd.health.hangs.detector import (
    GpuActivity,
    HangDetector,
    HangThresholds,
    activity_from_samples,
    classify,
)
from gpuwatchd.model import Sample
from gpuwatchd.sources.hangs.jobs import JobView, RankView
from tests.hangs.replay import first_suspicion, polls, replay


def test_rank_missing_at_start_flagged_within_30s() -> None:
    found = first_suspicion("rendezvous-polls.jsonl")
    assert found is not None
    t, v = found
    # rank 0 waits from its first poll as a job (4.3 s); decided rank_missing_after later
    seen = next(t for t, jobs, _ in polls("rendezvous-polls.jsonl") if jobs)
    assert seen + HangThresholds().rank_missing_after_seconds <= t <= 30
    assert v.conditions == ("rank_missing",)
    assert v.missing_count == 1 and v.missing_ranks == ()
    assert "1 local rank(s) running of 2 expected" in v.reason


def test_peer_death_flagged_within_30s_naming_the_dead_rank() -> None:
    found = first_suspicion("peerdeath-polls.jsonl")
    assert found is not None
    t, v = found
    assert 0 < t < 30  # never while both peers ran (t < 0)
    assert v.conditions == ("rank_dead",) and v.severity == "critical"
    assert v.missing_ranks == (1,) and v.dead_pids == (1032,)
    assert dict(v.rank_states)[1032] == "gone"
    assert set(v.signals.split("+")) == {"liveness", "io", "gpu"}  # the survivor's GPU spins


def test_peer_death_stays_a_dead_rank_verdict() -> None:
    t, verdicts = replay("peerdeath-polls.jsonl")[-1]
    assert t > 60
    assert verdicts[0].conditions == ("rank_dead",)
    assert dict(verdicts[0].rank_states) == {1031: "waiting", 1032: "gone"}


def test_peer_death_without_gpm_still_flagged_within_30s() -> None:
    found = first_suspicion("peerdeath-polls.jsonl", gpm=False)
    assert found is not None
    assert 0 < found[0] < 30 and found[1].conditions == ("rank_dead",)
    assert "gpu" in found[1].signals  # power+memory: a spinning kernel


def test_healthy_matmul_and_copy_never_flagged_with_or_without_gpm() -> None:
    for gpm in (True, False):
        rows = replay("healthy-polls.jsonl", gpm=gpm)
        assert rows[-1][0] > 355  # six minutes of matmul then copy
        assert [v for _, vs in rows for v in vs if v.suspected] == []
        states = {s for t, vs in rows for v in vs for _, s in v.rank_states if t > 15}
        assert states == {"progress"} or not gpm  # power alone dips between the two loops


def _rank(pid: int, gpu: str, rank: int, cpu: float) -> RankView:
    return RankView(pid=pid, gpus=(gpu,), rank=rank, world_size=2, cpu_seconds=cpu)


def test_straggler_one_rank_busy_while_the_other_spins() -> None:
    det = HangDetector(HangThresholds())
    spin = GpuActivity("0", 1.0, 0.0, 120.0, 700.0, 0.007, 0.0001)
    busy = GpuActivity("1", 1.0, 0.3, 600.0, 700.0, 0.9, 0.3)
    verdicts = []
    for i in range(62):  # no RAS: the GPU readings alone
        job = JobView("j", (_rank(10, "0", 0, i * 1.0), _rank(11, "1", 1, i * 1.0)), 2, 2)
        verdicts = det.observe([job], [spin, busy], 100.0 + i)
    assert verdicts[0].conditions == ("straggler",) and verdicts[0].severity == "warning"
    assert verdicts[0].straggler_pids == (11,)


def test_cpu_stall_needs_flat_cpu_and_idle_gpus_for_decide_after() -> None:
    idle = GpuActivity("0", 0.0, 0.0, 70.0, 700.0, 0.0, 0.0)
    det = HangDetector(HangThresholds())
    for i in range(45):
        job = JobView("j", (_rank(10, "0", 0, 5.0),), None, 2)
        assert not det.observe([job], [idle], 100.0 + i)[0].suspected
    job = JobView("j", (_rank(10, "0", 0, 5.0),), None, 2)
    assert det.observe([job], [idle], 146.0)[0].conditions == ("cpu_stall",)
    # CPU time moves again: progress, the verdict clears at once
    job = JobView("j", (_rank(10, "0", 0, 9.0),), None, 2)
    assert not det.observe([job], [idle], 147.0)[0].suspected


def test_a_single_process_idle_is_not_a_hang_by_default() -> None:
    idle = GpuActivity("0", 0.0, 0.0, 70.0, 700.0, 0.0, 0.0)
    det = HangDetector(HangThresholds())
    for i in range(120):
        job = JobView("pid:10", (RankView(10, ("0",), cpu_seconds=1.0),))
        verdict = det.observe([job], [idle], 100.0 + i)[0]
    assert not verdict.suspected


def test_a_gap_in_polls_restarts_the_clocks() -> None:
    spin = GpuActivity("0", 1.0, 0.0, 120.0, 700.0, 0.007, 0.0001)
    det = HangDetector(HangThresholds())
    job = JobView("j", (RankView(10, ("0",), 0, world_size=1, cpu_seconds=None),))
    det.observe([job], [spin], 100.0)
    det.observe([job], [spin], 140.0)
    assert not det.observe([job], [spin], 200.0)[0].suspected  # 60 s gap > max_gap
    assert det.observe([job], [spin], 260.0)[0].suspected is False  # still 60 s apart
    for t in range(261, 321):
        v = det.observe([job], [spin], float(t))[0]
    assert v.conditions == ("gpu_stall",)


def test_classify_names_the_deciding_signals() -> None:
    t = HangThresholds()
    assert classify(GpuActivity("0", 1.0, 0.0, 121.0, 700.0, 0.0076, 0.0001), t) == ("spin", "gpm")
    assert classify(GpuActivity("0", 1.0, 0.0, 121.0, 700.0), t) == ("spin", "power+memory")
    assert classify(GpuActivity("0", 1.0, 0.0, 121.0, None), t) == ("spin", "power+memory")
    assert classify(GpuActivity("0", 1.0, 1.0, 300.0, 700.0), t) == ("busy", "power+memory")
    assert classify(GpuActivity("0", 0.0), t) == ("idle", "utilization")
    assert classify(None, t) == ("unknown", "")


def test_activity_from_the_nvml_and_gpm_series() -> None:
    labels = {"gpu": "0", "uuid": "GPU-x", "pci_bus_id": "0000:01:00.0"}
    samples = [
        Sample.of("gpuwatchd_gpu_utilization_ratio", 1.0, engine="gpu", **labels),
        Sample.of("gpuwatchd_gpu_utilization_ratio", 0.0, engine="memory", **labels),
        Sample.of("gpuwatchd_gpu_power_watts", 123.0, **labels),
        Sample.of("gpuwatchd_gpu_power_limit_watts", 700.0, **labels),
        Sample.of("gpuwatchd_gpu_sm_active_ratio", 0.0076, **labels),
        Sample.of("gpuwatchd_gpu_sm_occupancy_ratio", 0.0001, **labels),
    ]
    (g,) = activity_from_samples(samples)
    assert (g.utilization, g.memory_utilization, g.power_watts) == (1.0, 0.0, 123.0)
    assert (g.sm_active, g.sm_occupancy, g.dram_active) == (0.0076, 0.0001, None)


def test_a_rank_that_leaves_while_the_others_work_is_not_a_hang() -> None:
    busy = GpuActivity("0", 1.0, 0.3, 600.0, 700.0, 0.9, 0.3)
    det = HangDetector(HangThresholds())
    both = JobView("j", (_rank(10, "0", 0, 0.0), _rank(11, "0", 1, 0.0)), 2, 2)
    det.observe([both], [busy], 100.0)
    for i in range(1, 300):  # rank 0 writes a checkpoint for five minutes after rank 1 exits
        alone = JobView("j", (_rank(10, "0", 0, float(i)),), 2, 2)
        assert not det.observe([alone], [busy], 100.0 + i)[0].suspected
