"""A decided dead or missing rank stays one verdict while the rank stays dead or missing.

What clears it: the job ending, the rank replaced (elastic restart) or started, RAS
counts rising after the death. What does not: the survivors' I/O (a flight recorder
dump, a log), CPU or GPU readings. Driven through `tests.hangs.sim` (probe 3 s, NVML
10 s, RAS 15 s) with the RAS answers recorded on 2x H100 before and after a SIGKILL.
"""

from __future__ import annotations

from gpuwatchd.health.hangs.detector import HangDetector, HangThresholds
from gpuwatchd.jobview import JobView, RankView
from tests.hangs.sim import IDLE, SPIN, TRAIN, Rank, Sim, first, recorded_answers


def _pair(**kw: object) -> list[Rank]:
    return [Rank(593, 0, **kw), Rank(594, 1, **kw)]  # type: ignore[arg-type]


def _killed(ras: bool = True) -> Sim:
    """Rank 1 SIGKILLed at t = 1, rank 0 spins in its all_reduce."""
    answers = recorded_answers()
    sim = Sim(_pair(), ras=ras)
    sim.answer = answers["healthy"] if ras else None
    sim.run(0)

    def kill(t: float, s: Sim) -> None:
        if t == 1:
            s.ranks[1].alive = False
            s.ranks[0].gpu = dict(SPIN)
            s.answer = answers["+5s after kill"] if ras else None

    sim.run(20, kill)
    return sim


def test_survivor_io_after_the_verdict_keeps_one_dead_rank_verdict() -> None:
    sim = _killed(ras=False)
    (t0, v0) = first(sim.log) or (None, None)
    assert t0 is not None and v0 is not None and v0.conditions == ("rank_dead",)

    def dump(t: float, s: Sim) -> None:  # rank 0 writes 270 KB of flight recorder dump
        s.ranks[0].io = 270_000.0 if t in (25, 26) else 0.0
        s.ranks[0].cpu = 0.0 if t > 40 else 1.0  # then goes quiet on the CPU
        if t == 310:  # the monitor's job view drops a rank gone for 5 minutes
            s.ranks = s.ranks[:1]

    log = sim.run(400, dump)  # past the 5 minutes after which a gone rank was forgotten
    assert all(v.conditions == ("rank_dead",) for _, v in log)
    assert {v.since for _, v in log} == {v0.since}  # one hang, one onset
    assert {v.severity for _, v in log} == {"critical"}


def test_ras_naming_the_dead_rank_adds_ras_to_the_open_verdict() -> None:
    sim = Sim(_pair(started=-30.0))  # RAS is first asked 30 s after the kill
    sim.run(0)
    answers = recorded_answers()

    def kill(t: float, s: Sim) -> None:
        if t == 1:
            s.ranks[1].alive = False
            s.ranks[0].gpu = dict(SPIN)
            s.answer = answers["+5s after kill"]
        s.ranks[0].io = 270_000.0 if t == 20 else 0.0  # the harness's dump trigger

    log = sim.run(60, kill)
    found = first(log)
    assert found is not None and found[0] < 30
    after = [v for t, v in log if t >= found[0]]
    assert all(v.conditions == ("rank_dead",) for v in after)
    assert "ras" not in found[1].signals.split("+")
    assert "ras" in after[-1].signals.split("+") and after[-1].since == found[1].since


def test_the_dead_rank_replaced_by_an_elastic_restart_clears_the_verdict() -> None:
    sim = _killed()
    assert sim.log[-1][1].conditions == ("rank_dead",)

    def restart(t: float, s: Sim) -> None:
        if t == 30:  # the agent restarts the job: new processes with the same ranks
            s.ranks[0].alive = False
            s.ranks += [Rank(700, 0, started=t), Rank(701, 1, started=t)]
            s.answer = None
            s.rising = True
            for r in s.ranks[2:]:
                r.gpu = dict(TRAIN)

    log = sim.run(200, restart)
    assert not any(v.suspected for t, v in log if t >= 33)


def test_counts_rising_after_the_death_clear_the_verdict() -> None:
    sim = _killed()
    assert sim.log[-1][1].conditions == ("rank_dead",)

    def resume(t: float, s: Sim) -> None:
        if t == 40:  # the survivors' communicator moves on without rank 1
            s.answer = None
            s.ranks = s.ranks[:1]
            s.counts = {0: {"AllReduce": 5000}}
            s.ranks[0].gpu = dict(TRAIN)

    log = sim.run(120, resume)
    assert log[-1][1].conditions == ()
    assert not any(v.suspected for t, v in log if t >= 70)


def test_the_job_ending_clears_the_verdict() -> None:
    sim = _killed(ras=False)

    def end(t: float, s: Sim) -> None:
        if t == 30:
            s.ranks[0].alive = False

    log = sim.run(60, end)
    assert log[-1][1].conditions == () and all(t < 30 for t, v in log if v.suspected)


def test_rank_missing_stays_while_the_present_rank_writes_until_the_rank_starts() -> None:
    sim = Sim([Rank(962, 0, cpu=0.02, gpu=dict(IDLE), started=0.0)], ras=False, start=0.0)
    found = first(sim.run(30))
    assert found is not None and found[1].conditions == ("rank_missing",)

    def later(t: float, s: Sim) -> None:
        s.ranks[0].io = 300_000.0 if 35 <= t < 45 else 0.0  # it writes a log
        if t == 80:
            s.ranks.append(Rank(963, 1, cpu=0.02, gpu=dict(IDLE), started=t))

    log = sim.run(100, later)
    assert all(v.conditions == ("rank_missing",) for t, v in log if t < 80)
    assert all(not v.suspected for t, v in log if t >= 81)


def test_own_io_of_the_monitor_is_not_progress() -> None:
    """I/O in a span the monitor marks as its own (its flight recorder trigger)."""

    def rank(pid: int, r: int, io: int) -> RankView:
        return RankView(pid, (str(r),), r, 2, cpu_seconds=0.0, state="S", io_bytes=io)

    for own, suspected in (({}, False), ({1: (1003.5, 1013.0)}, True)):
        det = HangDetector(HangThresholds(decide_after_seconds=6.0))
        for t, io in ((1000, 0), (1003, 0), (1006, 270_000), (1009, 270_000)):
            job = JobView("j", (rank(1, 0, io), rank(2, 1, 0)), 2, 2)
            (v,) = det.observe([job], [], float(t), own_io=own)
        assert v.suspected is suspected, own
