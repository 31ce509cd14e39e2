"""The RAS poll end to end: the monitor's pool asks a RAS replay server on loopback (the
answers recorded from a 2-rank job on 2x H100 before and after rank 1 was SIGKILLed,
NCCL 2.28.9's malformed JSON included), never within the start-up grace unless every
rank's GPU did real work (the job trained: its communicators are up), one query per job
at a time, and the answer decides with the probe."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Sequence

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.health.hangs.gpu import SM_ACTIVE
from gpuwatchd.jobview import JobView, RankView, RasAnswer, StackCapture
from gpuwatchd.model import Sample, SourceSnapshot
from gpuwatchd.sources.hangs import ras
from gpuwatchd.state import NodeSnapshot
from tests.hangs.ras_server import ras_server
from tests.hangs.replay import fixture

ANSWERS = {a["when"]: a for a in json.loads(fixture("ras-2xh100-deadpeer.json"))["answers"]}


class Ranks:
    """NodeIO with two ranks (the recorded pids) whose probe the test sets."""

    def __init__(self, addr: str, age: float) -> None:
        self.job = JobView(
            "torch:127.0.0.1:29500",
            tuple(RankView(p, (str(i),), i, world_size=2) for i, p in enumerate((593, 594))),
            2,
            2,
            (("job", "t"),),
            ras_addr=addr,
        )
        self.age = age
        self.dead: set[int] = set()
        self.cpu = 0.0

    def jobs(self, snap: NodeSnapshot, procfs: str) -> list[JobView]:
        return [self.job]

    def capture(self, pid: int, timeout: float) -> StackCapture:
        return StackCapture(pid, False, error="off")

    def ras(self, job: JobView, netns: bool, timeout: float) -> RasAnswer:
        return ras.query(job.ras_addr, timeout=timeout)

    def flight(self, job: JobView, procfs: str, wait: object) -> tuple[list[object], list[str]]:
        return [], ["no flight recorder here"]

    def probe(self, jobs: Sequence[JobView], procfs: str) -> list[JobView]:
        self.cpu += 3.0  # every rank burns a core (the survivor in its synchronize)
        return [
            dataclasses.replace(
                j,
                ranks=tuple(
                    dataclasses.replace(
                        r,
                        state="gone" if r.pid in self.dead else "S",
                        cpu_seconds=self.cpu,
                        io_bytes=0,
                        age_seconds=self.age,
                    )
                    for r in j.ranks
                ),
            )
            for j in jobs
        ]


def _settle(monitor: HangMonitor, n: int = 0) -> None:
    """Wait (real time) until the pool has answered `n` queries and none is in flight."""
    end = time.monotonic() + 10
    poller = monitor._poller
    while (poller.queries < n or poller._in_flight) and time.monotonic() < end:
        time.sleep(0.01)
    assert poller.queries >= n and not poller._in_flight


def test_dead_peer_decided_with_the_polled_recorded_answers() -> None:
    healthy, killed = ANSWERS["healthy"], ANSWERS["+5s after kill"]
    assert not killed["json_parses"]  # NCCL 2.28.9's answer for a missing rank
    with ras_server(healthy["text_body"], healthy["json_body"]) as srv:
        io = Ranks(srv.addr, age=600.0)
        clock = FakeClock(start=1_800_000_000.0)
        monitor = HangMonitor(Config(), clock, io=io)  # the real pool of 2 threads
        try:
            monitor.on_publish(NodeSnapshot(sources={"nvml": _nvml(clock.time())}))
            _settle(monitor, 1)
            assert srv.requests[0] == [
                "CLIENT PROTOCOL 2",
                "TIMEOUT 5",
                "SET FORMAT json",
                "STATUS",
            ]
            for _ in range(5):  # within the cadence: no second query
                clock.advance(2.0)
                monitor.tick()
            assert len(srv.requests) == 1
            srv.json_answer = killed["json_body"]
            io.dead.add(594)  # SIGKILL
            killed_at = clock.time()
            while clock.time() - killed_at < 30 and not monitor.findings():
                clock.advance(1.0)
                monitor.tick()
                _settle(monitor)
                monitor.run_pending()
            (f,) = monitor.findings()
            assert clock.time() - killed_at <= 10
            assert "rank 1 died (pid 594)" in f.reason and "RAS cannot reach it" in f.reason
            assert "ras" in f.reason.split("Decided by: ")[1]
            doc = monitor.records()[0]
            assert doc["missing"] == [
                "rank 1",
                "rank 1 on 192.0.2.2 pid 594 (RAS, communicator 0xa46b337f78afebcd)",
            ]
            assert '"missing_ranks_count": 1' in doc["ras"]["answer"]  # the poll's answer, reused
        finally:
            monitor.stop()


def _first_query_age(sm_active: dict[str, float]) -> float | None:
    """The ranks' age at the first RAS query, ranks 10 s old at the start, for 60 s.

    NVML reads `sm_active` (GPU -> SM activity) every 10 s; the hang probe runs every
    3 s, on the consumer's ticks 2 s apart (so every 4 s here)."""
    healthy = ANSWERS["healthy"]
    with ras_server(healthy["text_body"], healthy["json_body"]) as srv:
        io = Ranks(srv.addr, age=10.0)
        clock = FakeClock(start=1_800_000_000.0)
        monitor = HangMonitor(Config(), clock, io=io, ras_workers=0)
        for i in range(31):
            if i % 5 == 0:
                monitor.on_publish(NodeSnapshot(sources={"nvml": _nvml(clock.time(), sm_active)}))
            else:
                monitor.tick()
            if srv.requests:
                return io.age
            clock.advance(2.0)
            io.age += 2.0
        return None


def test_no_query_within_the_start_up_grace_while_the_gpus_never_worked() -> None:
    # no GPU reading, or one rank's GPU idle: asked once the youngest rank is past the grace
    for sm_active in ({}, {"0": 0.9, "1": 0.0}):
        age = _first_query_age(sm_active)
        grace = Config().hangs.startup_grace_seconds
        assert age is not None and grace <= age <= grace + 4.0, (sm_active, age)


def test_a_job_whose_gpus_all_worked_is_asked_within_the_grace() -> None:
    # every rank's GPU read at work (NCCL is past its start-up): the next probe asks
    age = _first_query_age({"0": 0.9, "1": 0.8})
    assert age is not None and age <= 14.0


def _nvml(stamp: float, sm_active: dict[str, float] | None = None) -> SourceSnapshot:
    samples = tuple(Sample.of(SM_ACTIVE, v, gpu=g) for g, v in (sm_active or {}).items())
    return SourceSnapshot("nvml", samples, True, timestamp=stamp)


class QuietRanks(Ranks):
    """Two ranks idle on the CPU with no I/O: hung before NCCL (a data loader, a store)."""

    def probe(self, jobs: Sequence[JobView], procfs: str) -> list[JobView]:
        return [
            dataclasses.replace(
                j,
                ranks=tuple(
                    dataclasses.replace(
                        r, state="S", cpu_seconds=5.0, io_bytes=0, age_seconds=self.age
                    )
                    for r in j.ranks
                ),
            )
            for j in jobs
        ]


def _free_port_addr() -> str:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_job_without_nccl_still_gets_its_cpu_stall_once_ras_had_its_say() -> None:
    """Defaults (RAS polled): a distributed job idle on CPU and GPU that no RAS answers
    for (nothing listens: hung before NCCL started) is decided cpu_stall after the
    start-up grace's first failed query, not held back for ever; a job that RAS has not
    been asked about yet is not decided."""
    io = QuietRanks(_free_port_addr(), age=5.0)
    clock = FakeClock(start=1_800_000_000.0)
    monitor = HangMonitor(Config(), clock, io=io, ras_workers=0)
    grace = Config().hangs.startup_grace_seconds
    decide = Config().hangs.decide_after_seconds
    monitor.on_publish(NodeSnapshot(sources={"nvml": _nvml(clock.time())}))
    start = clock.time()
    found_at = None
    while clock.time() - start < 120 and found_at is None:
        clock.advance(1.0)
        io.age += 1.0
        monitor.tick()
        if monitor.findings():
            found_at = clock.time() - start
        elif io.age < grace:
            assert monitor._poller.queries == 0  # not asked during the grace
    assert found_at is not None, "no verdict in 120 s"
    (f,) = monitor.findings()
    assert "no rank used its GPU, did I/O or more than 5% of a core" in f.reason
    # the stall held from the first probes; decided once RAS failed to answer after the grace
    assert decide <= found_at <= max(decide, grace - 5.0) + 10.0
