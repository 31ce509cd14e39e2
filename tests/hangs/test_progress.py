"""The progress-based detector over the patterns real NCCL jobs show (issue 21).

Each test drives a job through `tests.hangs.sim` (probe 3 s, NVML 10 s, RAS 15 s);
times are seconds from the fault. The dead-peer tests replay the RAS answers
recorded on 2x H100 (NCCL 2.28.9) before and after rank 1 was SIGKILLed.
"""

from __future__ import annotations

from gpuwatchd.health.hangs.detector import HangDetector, HangThresholds, JobVerdict
from gpuwatchd.health.hangs.ras_view import RasView
from gpuwatchd.jobview import JobView, RankView, RasReport
from tests.hangs.sim import (
    BASE,
    IDLE,
    SPIN,
    TRAIN,
    Rank,
    Script,
    Sim,
    first,
    recorded_answers,
    report,
)


def _pair(**kw: object) -> list[Rank]:
    return [Rank(593, 0, **kw), Rank(594, 1, **kw)]  # type: ignore[arg-type]


def test_healthy_training_counts_rising_stays_quiet() -> None:
    sim = Sim(_pair())
    log = sim.run(300)
    assert first(log) is None
    assert {s for t, v in log for _, s in v.rank_states if t > -100} == {"progress"}


def test_dead_peer_with_the_recorded_ras_answers_is_critical_within_30s() -> None:
    answers = recorded_answers()
    sim = Sim(_pair())
    sim.answer = answers["healthy"]
    sim.run(0)

    def kill(t: float, s: Sim) -> None:
        if t == 1:
            s.ranks[1].alive = False
            s.ranks[0].gpu = dict(SPIN)  # the survivor spins in its all_reduce, a core busy
            s.answer = answers["+5s after kill"]

    log = sim.run(60, kill)
    found = first(log)
    assert found is not None
    t, v = found
    assert t < 30 and v.conditions == ("rank_dead",) and v.severity == "critical"
    assert v.missing_ranks == (1,) and v.dead_pids == (594,)
    assert "liveness" in v.signals.split("+") and "ras" in v.signals.split("+")
    assert "rank 1 died" in v.reason
    # before the kill: quiet
    assert all(not v.suspected for tt, v in sim.log if tt <= 0)


def test_dead_peer_without_ras_still_critical_within_30s() -> None:
    sim = Sim(_pair(), ras=False)
    sim.run(0)

    def kill(t: float, s: Sim) -> None:
        if t == 1:
            s.ranks[1].alive = False
            s.ranks[0].gpu = dict(SPIN)

    found = first(sim.run(60, kill))
    assert found is not None and found[0] < 30 and found[1].conditions == ("rank_dead",)
    assert "gpu" in found[1].signals


def test_remote_rank_named_by_ras_twice_is_dead_and_names_its_node() -> None:
    answers = recorded_answers()
    det = HangDetector(HangThresholds())
    rank0 = RankView(593, ("0",), 0, world_size=2, cpu_seconds=0.0, state="S", io_bytes=0)
    verdicts = []
    for i, (when, t) in enumerate((("healthy", 0.0), ("+5s after kill", 15.0))):
        job = JobView("j", (RankView(593, ("0",), 0, 2, cpu_seconds=t, state="S", io_bytes=0),))
        verdicts = det.observe([job], None, BASE + t, {"j": RasView(BASE + t, answers[when])})
        assert not verdicts[0].suspected, i
    job = JobView("j", (rank0,))
    verdicts = det.observe(
        [job], None, BASE + 20, {"j": RasView(BASE + 20, answers["+20s after kill"])}
    )
    (v,) = verdicts
    assert v.conditions == ("rank_dead",) and v.severity == "critical"
    assert v.missing_ranks == (1,) and v.nodes == ("192.0.2.2",) and v.signals == "ras"


def test_unbalanced_collectives_counts_differ_and_flat_is_critical_within_60s() -> None:
    sim = Sim(_pair())
    sim.run(0)

    def diverge(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            s.counts[0]["AllReduce"] += 1  # rank 0: one extra all_reduce
            s.counts[1]["AllGather"] = 1  # rank 1 moved on to an all_gather
            for r in s.ranks:
                r.gpu = dict(SPIN)

    found = first(sim.run(90, diverge))
    assert found is not None
    t, v = found
    assert t < 60 and v.conditions == ("collective_stall",) and v.severity == "critical"
    assert "differ between ranks" in v.reason and v.signals.startswith("gpu+io+ras")


def test_rank_missing_at_init_without_ras_within_30s() -> None:
    sim = Sim([Rank(962, 0, cpu=0.02, gpu=dict(IDLE), started=0.0)], ras=False, start=0.0)
    found = first(sim.run(60))
    assert found is not None
    t, v = found
    assert t < 30 and v.conditions == ("rank_missing",) and v.severity == "critical"
    assert v.missing_count == 1


def test_teardown_hang_counts_flat_cpu_flat_is_critical_within_60s() -> None:
    sim = Sim(_pair())
    sim.run(0)

    def destroy(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            s.flags = {"destroy_flag": True}  # RAS: the communicator is being destroyed
            for r in s.ranks:
                r.cpu, r.gpu = 0.0, dict(IDLE)

    found = first(sim.run(90, destroy))
    assert found is not None
    t, v = found
    assert t < 60 and "collective_stall" in v.conditions and v.severity == "critical"


def test_an_idle_distributed_server_is_never_a_critical_collective_stall() -> None:
    # inference ranks waiting for requests: counts flat, no kernel, no CPU, clean comms
    sim = Sim(_pair())
    sim.run(0)

    def idle(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            for r in s.ranks:
                r.cpu, r.gpu = 0.0, dict(IDLE)

    log = sim.run(900, idle)
    assert "collective_stall" not in {c for _, v in log for c in v.conditions}
    assert {v.severity for _, v in log if v.suspected} <= {""}  # cpu_stall: the signature's


def test_checkpoint_on_rank_0_for_180s_is_a_straggler_warning_only() -> None:
    sim = Sim(_pair())
    sim.run(0)

    def checkpoint(t: float, s: Sim) -> None:
        r0, r1 = s.ranks
        if t == 1:
            s.rising = False
            s.counts[1]["AllReduce"] += 1  # rank 1 waits in the barrier
            r0.io, r0.gpu = 200e6, dict(IDLE)
            r1.gpu = dict(SPIN)
        if t == 181:
            s.rising = True
            r0.io, r0.gpu, r1.gpu = 0.0, dict(TRAIN), dict(TRAIN)

    log = sim.run(300, checkpoint)
    warned = [(t, v) for t, v in log if v.suspected]
    assert warned, "a 3-minute wait is worth a warning"
    assert {v.conditions for _, v in warned} == {("straggler",)}
    assert {v.severity for _, v in warned} == {"warning"}
    assert all(v.straggler_pids == (593,) for _, v in warned)
    assert "io" in warned[0][1].signals
    assert max(t for t, _ in warned) < 200  # resolved once rank 0 caught up


def test_evaluation_pause_on_rank_0_warns_and_resolves() -> None:
    sim = Sim(_pair())
    sim.run(0)

    def evaluate(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            s.counts[1]["AllReduce"] += 1
            s.ranks[1].gpu = dict(SPIN)  # rank 0 keeps its GPU busy: forward passes
        if t == 121:
            s.rising = True
            s.ranks[1].gpu = dict(TRAIN)

    log = sim.run(240, evaluate)
    assert {v.severity for _, v in log if v.suspected} <= {"warning"}
    assert not log[-1][1].suspected


def test_a_straggler_lasting_to_the_collective_timeout_becomes_critical() -> None:
    sim = Sim(_pair(), thresholds=HangThresholds(collective_timeout_seconds=300.0))
    sim.run(0)

    def evaluate(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            s.counts[1]["AllReduce"] += 1
            s.ranks[1].gpu = dict(SPIN)

    log = sim.run(400, evaluate)
    sev = {t: v.severity for t, v in log if v.suspected}
    assert sev[min(sev)] == "warning" and sev[max(sev)] == "critical"
    assert min(t for t, s in sev.items() if s == "critical") >= 300


def test_slow_data_loader_with_workers_busy_stays_quiet() -> None:
    sim = Sim(_pair())
    sim.run(0)

    def starve(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            for r in s.ranks:  # main threads wait on the workers' queue
                r.cpu, r.child_cpu, r.gpu = 0.01, 3.5, dict(IDLE)

    assert first(sim.run(240, starve)) is None


def test_startup_compilation_within_the_grace_stays_quiet() -> None:
    ranks = [Rank(10, 0, started=0.0, gpu=dict(IDLE)), Rank(11, 1, started=0.0, gpu=dict(SPIN))]
    ranks[0].child_cpu = 0.0  # compiles in its own process: CPU, no I/O, no children
    sim = Sim(ranks, start=0.0)
    assert first(sim.run(59)) is None


def test_normal_end_rank_1_exits_after_destroy_rank_0_follows() -> None:
    sim = Sim(_pair())
    sim.run(0)

    def end(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            s.answer = RasReport("2.28.9", ())  # communicators destroyed
            s.ranks[1].alive = False
            s.ranks[0].gpu = dict(IDLE)
            s.ranks[0].cpu = 0.5
        if t == 40:
            s.ranks[0].alive = False

    log = sim.run(60, end)
    assert first(log) is None


def test_gpu_work_is_judged_against_the_jobs_own_peak_not_fixed_utilisation() -> None:
    from gpuwatchd.health.hangs.gpu import GpuActivity, GpuBaseline

    t, b = HangThresholds(), GpuBaseline()
    # real training on 2x H200 read NVML utilisation 17 % with SM activity 92 % at 625 W
    train = GpuActivity("0", 0.17, power_watts=625.0, power_limit_watts=700.0, sm_active=0.92)
    b.update(train, 0.0)
    assert b.working(train, t) is True
    # the same GPU spinning on a dead peer: utilisation 0 %, SM activity 18 %, 123 W
    spin = GpuActivity("0", 0.0, power_watts=123.0, power_limit_watts=700.0, sm_active=0.18)
    b.update(spin, 10.0)
    assert b.working(spin, t) is False and b.resident(spin, t)
    # NVLink traffic at the job's own pace is work even with little SM activity
    link = GpuActivity("1", 0.1, sm_active=0.2, nvlink_bytes_per_second=40e9)
    b.update(link, 0.0)
    assert b.working(link, t) is True
    idle_link = GpuActivity("1", 0.0, sm_active=0.18, nvlink_bytes_per_second=0.0)
    assert b.working(idle_link, t) is False


def test_all_ranks_computing_on_the_cpu_with_counts_flat_waits_for_the_timeout() -> None:
    sim = Sim(_pair(), thresholds=HangThresholds(collective_timeout_seconds=300.0))
    sim.run(0)

    def cpu_phase(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False  # metrics on the CPU, no collective, no I/O
            for r in s.ranks:
                r.gpu = dict(IDLE)

    log = sim.run(400, cpu_phase)
    found = first(log)
    assert found is not None and found[0] >= 300  # never a page before the job's own timeout
    assert found[1].conditions == ("collective_stall",)


def test_a_young_job_hung_before_the_ras_grace_is_flagged_within_60_s() -> None:
    # unbalanced collectives 20 s after launch: its GPUs trained, so RAS is asked before the
    # age grace ends; kernels resident, no I/O, counts flat -> collective_stall within 60 s
    sim = Sim(_pair(started=0.0), start=0.0)
    sim.run(20)

    def diverge(t: float, s: Sim) -> None:
        if t == 21:
            s.rising = False
            for r in s.ranks:
                r.gpu = dict(SPIN)

    found = first(sim.run(100, diverge))
    assert found is not None and found[0] - 20 < 60
    assert found[1].conditions == ("collective_stall",)
    # teardown 10 s after launch: CPU and GPUs quiet -> cpu_stall within 60 s
    sim = Sim(_pair(started=0.0), start=0.0)
    sim.run(10)

    def destroy(t: float, s: Sim) -> None:
        if t == 11:
            s.rising = False
            for r in s.ranks:
                r.cpu, r.gpu = 0.0, dict(IDLE)

    found = first(sim.run(100, destroy))
    assert found is not None and found[0] - 10 < 60 and "cpu_stall" in found[1].conditions


def _stall_at(script: Script, until: float = 90) -> tuple[float, JobVerdict]:
    sim = Sim(_pair())
    sim.run(0)
    found = first(sim.run(until, script), "collective_stall")
    assert found is not None
    return found


def test_ranks_in_different_collectives_page_on_the_shorter_window() -> None:
    # rank 0 launched one all_reduce more; rank 1, behind, waits in another collective
    # (a kernel sits on its GPU): RAS shows why none can complete. Every rank waits from
    # the NVML poll at +10 s; RAS, asked again at once, confirms at +15 s; 15 s later it
    # pages (the 30 s window read +39 s here)
    def unbalanced(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            s.counts[0]["AllReduce"] += 1
            for r in s.ranks:
                r.gpu = dict(SPIN)

    t, v = _stall_at(unbalanced)
    assert t <= 30 and v.severity == "critical" and "differ between ranks" in v.reason


def test_a_communicator_torn_down_with_flat_counts_pages_on_the_shorter_window() -> None:
    def destroy(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            s.flags = {"finalize_called": True}
            for r in s.ranks:
                r.cpu, r.gpu = 0.0, dict(IDLE)

    t, v = _stall_at(destroy)
    assert t <= 30 and v.severity == "critical"


def test_a_rank_behind_on_another_node_waits_for_the_full_window() -> None:
    # the rank behind is not here: it may write a checkpoint; only 30 s of flat counts
    def remote_behind(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            counts = {k: dict(v) for k, v in s.counts.items()}
            counts[2] = {"AllReduce": counts[0]["AllReduce"] - 1}
            s.answer = report(counts, {0: 593, 1: 594, 2: 9999})
            for r in s.ranks:
                r.gpu = dict(SPIN)

    t, v = _stall_at(remote_behind)
    assert t >= 30 and v.severity == "critical"


def test_flat_equal_counts_with_every_rank_waiting_wait_for_the_full_window() -> None:
    # the same collective on every rank, nothing flagged: RAS does not say why
    def same(t: float, s: Sim) -> None:
        if t == 1:
            s.rising = False
            for r in s.ranks:
                r.gpu = dict(SPIN)

    t, _ = _stall_at(same)
    assert t >= 30
