"""JobSlowedByGpu leaves through the health engine's findings; its metrics stay bounded."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import AlertmanagerConfig, Config, DaemonConfig, HealthConfig
from gpuwatchd.config.schema import HangsConfig
from gpuwatchd.health.hangs.ras_view import RasView
from gpuwatchd.health.slowdowns.detector import MAX_JOBS
from gpuwatchd.health.slowdowns.monitor import METRICS, SlowdownMonitor, collectives
from gpuwatchd.health.slowdowns.readings import GpuPace
from gpuwatchd.model import Action, Health, Sample, Severity, SourceSnapshot
from gpuwatchd.pipeline.daemon import Pipeline
from gpuwatchd.state import NodeSnapshot, State
from tests.slowdowns import replay as R


def _pipeline(tmp_path: Path, clock: FakeClock, **health: object) -> Pipeline:
    cfg = Config(
        daemon=DaemonConfig(state_dir=str(tmp_path / "state")),
        alertmanager=AlertmanagerConfig(urls=[]),
        hangs=HangsConfig(ras=False, ras_poll=False, stacks=False, flight_recorder=False),
        health=HealthConfig(**health),  # type: ignore[arg-type]
    )
    return Pipeline(cfg, State(), clock, tmp_path.name, 0, [])


def _throttled(monitor: SlowdownMonitor, base: float) -> R.Recording:
    """healthy-ddp with GPU 3 throttled 20 % from 480 s on, fed at the daemon's cadence."""
    rec = R.looped(R.load("healthy-ddp"), 720.0)
    polls = R.at_interval(R.slowed(rec, "3", 0.2, 480.0, "throttle"), 10.0)
    for t, row in polls:
        monitor.observe([rec.job], row, base + t)
    return rec


def test_the_finding_goes_through_the_engine_and_its_one_sink(tmp_path: Path) -> None:
    clock = FakeClock(time.time())
    pipeline = _pipeline(tmp_path, clock)
    try:
        assert pipeline.slowdowns is not None
        rec = _throttled(pipeline.slowdowns, clock.time() - 720.0)
        pipeline.tick()
        [f] = pipeline.engine.open_findings()
        assert (f.alertname, f.severity, f.scope) == ("JobSlowedByGpu", Severity.WARNING, "job")
        labels = dict(f.labels)
        assert (labels["gpu"], labels["cause"], labels["job"]) == (
            "3",
            "thermal_throttle",
            rec.job.job,
        )
        assert f.action == Action.DRAIN_AND_INSPECT and "cooling" not in f.reason
        assert "slower, waiting for GPU 3" in f.reason and "sw_thermal_slowdown" in f.reason
        assert "Rank on it (rank:pid): 1:1009" in f.reason
        assert "temperature" in f.remediation
        _, _, body = pipeline.routes()["/alerts"]({})
        [alert] = json.loads(body)["alerts"]
        assert alert["labels"]["alertname"] == "JobSlowedByGpu"
        assert {"gpu", "cause", "job", "job_id"} <= set(alert["labels"]) - {"pod", "namespace"}
        assert pipeline.engine.rollup().node == Health.HEALTHY  # the job's, not the node's
        pipeline.tick()
        extra = {s.name for s in pipeline._state.snapshot().extra.get("slowdowns", ())}
        assert "gpuwatchd_job_slowed_ratio" in extra
    finally:
        pipeline.stop(timeout=2.0)


def test_disabled_rules_silence_it(tmp_path: Path) -> None:
    clock = FakeClock(time.time())
    pipeline = _pipeline(tmp_path, clock, disabled_rules=["JobSlowedByGpu"])
    try:
        assert pipeline.slowdowns is not None
        _throttled(pipeline.slowdowns, clock.time() - 720.0)
        pipeline.tick()
        assert pipeline.engine.open_findings() == ()
        assert pipeline.slowdowns.findings()  # still judged, on /status and the metrics
    finally:
        pipeline.stop(timeout=2.0)


def _snapshot(row: tuple[GpuPace, ...], stamp: float) -> NodeSnapshot:
    samples = []
    for p in row:
        samples.append(
            Sample.of(
                "gpuwatchd_gpu_utilization_ratio", p.utilization or 0, gpu=p.gpu, engine="gpu"
            )
        )
        samples.append(Sample.of("gpuwatchd_gpu_sm_active_ratio", p.sm_active or 0, gpu=p.gpu))
    nvml = SourceSnapshot("nvml", tuple(samples), True, timestamp=stamp)
    return NodeSnapshot(sources={"nvml": nvml})


def test_each_nvml_poll_is_judged_once_with_the_jobs_of_the_snapshot() -> None:
    rec = R.looped(R.load("healthy-ddp"), 720.0)
    polls = R.at_interval(R.slowed(rec, "2", 0.2, 480.0, "compute"), 10.0)
    asked: list[float] = []

    def jobs_of(snap: NodeSnapshot) -> list[R.JobView]:
        asked.append(snap.sources["nvml"].timestamp or 0.0)
        return [rec.job]

    monitor = SlowdownMonitor(jobs_of)
    for t, row in polls:
        snap = _snapshot(row, 1000.0 + t)
        monitor.on_publish(snap)
        monitor.on_publish(snap)  # another source's publish: the same NVML poll
    assert len(asked) == len(polls)
    [f] = monitor.findings()
    assert dict(f.labels)["gpu"] == "2" and dict(f.labels)["cause"] == "unexplained"
    assert monitor.status()[rec.job.job]["slowed"] is True


def test_metrics_carry_a_bounded_slot_and_the_job_labels_only_on_the_info_series() -> None:
    monitor = SlowdownMonitor()
    rec = R.load("healthy-ddp")
    row = tuple(GpuPace(g, utilization=0.7, sm_active=0.35) for g in ("0", "1"))
    jobs = [
        dataclasses.replace(
            rec.job,
            job=f"slurm:{i}",
            labels=(("job", f"slurm:{i}"), ("job_id", f"slurm:{i}"), ("slurm_job", str(i))),
            ranks=tuple(
                dataclasses.replace(r, gpus=(str(k),)) for k, r in enumerate(rec.job.ranks)
            ),
        )
        for i in range(MAX_JOBS + 5)
    ]
    monitor.observe(jobs, row, 1000.0)
    samples = monitor.samples()
    info = [s for s in samples if s.name == "gpuwatchd_job_pace_info"]
    assert len(info) == MAX_JOBS  # more jobs than slots are not followed
    assert {s.label("slot") for s in info} == {str(i) for i in range(MAX_JOBS)}
    declared = {m.name: set(m.labels) for m in METRICS}
    for s in samples:
        assert {k for k, _ in s.labels} == declared[s.name]
    # a job that ends frees its slot for the next one
    monitor.observe(jobs[1:], row, 1010.0)
    slots = {s.label("workload"): s.label("slot") for s in monitor.samples() if s.label("workload")}
    assert "slurm:0" not in slots and slots[f"slurm:{MAX_JOBS}"] == "0"
    # a job on one GPU has no peers to compare: not followed
    single = dataclasses.replace(jobs[0], job="one", ranks=jobs[0].ranks[:1])
    monitor.observe([single], row, 1020.0)
    assert monitor.samples() == []


def _slower(view: RasView, at: RasView, factor: float) -> RasView:
    """`view` with each count's rise since the answer `at` made `factor` times slower."""
    assert view.report is not None and at.report is not None
    then = {
        (c.hash, r.rank, op): n
        for c in at.report.communicators
        for r in c.ranks
        for op, n in r.collective_counts.items()
    }
    comms = []
    for c in view.report.communicators:
        ranks = []
        for r in c.ranks:
            counts = dict(r.collective_counts)
            if view.time > at.time:
                for op, n in counts.items():
                    n0 = then.get((c.hash, r.rank, op), n)
                    counts[op] = int(n0 + (n - n0) / factor)
            ranks.append(dataclasses.replace(r, collective_counts=counts))
        comms.append(dataclasses.replace(c, ranks=tuple(ranks)))
    return RasView(view.time, dataclasses.replace(view.report, communicators=tuple(comms)))


def test_the_pace_follows_the_jobs_real_nccl_collectives_where_ras_answers() -> None:
    # healthy-ddp's own RAS answers, every 5 s while it trained: AllReduce counts rising
    rec = R.load("healthy-ddp")
    answers = R.ras_answers("healthy-ddp")
    first = collectives(rec.job, answers[0])
    assert first is not None and first[1] > 10_000  # both ranks' counts, the lower one
    polls = R.at_interval(rec.polls, 10.0)

    def run(views: list[RasView]) -> list[dict[str, object]]:
        latest: dict[str, RasView] = {}
        monitor = SlowdownMonitor(ras_views=lambda: latest)
        seen = []
        for t, row in polls:
            done = [v for v in views if v.time <= t]
            if done:
                latest[rec.job.job] = done[-1]
            monitor.observe([rec.job], row, t)
            seen.append(monitor.status()[rec.job.job])
        return seen

    steady = [s for s in run(answers) if s["pace"] is not None]
    assert steady and {s["pace_from"] for s in steady} == {"ras"}
    assert all(0.95 < float(s["pace"]) < 1.05 for s in steady)  # type: ignore[arg-type]
    # the same answers with the job's collectives 15 % slower from 130 s on
    at = [v for v in answers if v.time < 130.0][-1]
    slowed = run([_slower(v, at, 1.15) for v in answers])
    # still inside the job's first minutes, where its baseline is being learned (and follows)
    assert 0.85 < float(slowed[-1]["pace"]) < 0.93  # type: ignore[arg-type]


def test_once_learned_the_baseline_pace_is_kept() -> None:
    # a balanced two-GPU job whose collectives go from 10/s to 10/1.1 per second at 900 s
    rec = R.load("healthy-ddp")
    monitor = SlowdownMonitor()
    row = tuple(GpuPace(g, utilization=0.7, sm_active=0.35) for g in rec.gpus)
    count = 0.0
    for i in range(120):
        t = 10.0 * i
        count += 100.0 if t < 900.0 else 100.0 / 1.1
        monitor.detector.observe([rec.job], row, t, {rec.job.job: (t, count)})
    [pace] = monitor.detector.observe([rec.job], row, 1200.0, {rec.job.job: (1200.0, count + 91)})
    assert pace.pace_from == "ras" and pace.pace is not None
    assert abs(pace.pace - 1 / 1.1) < 0.01


def test_the_daemon_judges_the_jobs_the_hang_probe_read_with_no_proc_read_of_its_own(
    tmp_path: Path,
) -> None:
    """The slowdown step runs on the consumer thread: it takes the jobs the hang-probe
    thread named and probed last, never reads /proc itself (a rank in D state must not
    hold the consumer), and judges their pace from the hang monitor's RAS answers."""
    clock = FakeClock(time.time())
    pipeline = _pipeline(tmp_path, clock)
    try:
        assert pipeline.slowdowns is not None and pipeline.hangs is not None

        class NoProc:
            def jobs(self, snap: object, procfs: str) -> list[object]:
                raise AssertionError("the slowdown step read /proc")

        pipeline.hangs._loop._io = NoProc()  # type: ignore[assignment]
        rec = R.load("healthy-ddp")
        pipeline.hangs._loop.seen = (rec.job,)  # what the probe thread judged last
        snap = NodeSnapshot()
        assert pipeline.slowdowns._jobs_of is not None
        assert list(pipeline.slowdowns._jobs_of(snap)) == [rec.job]
        assert pipeline.slowdowns._ras_views is not None
        assert pipeline.slowdowns._ras_views() == {}  # RAS off: no answers, yet no error
    finally:
        pipeline.stop(1.0)
