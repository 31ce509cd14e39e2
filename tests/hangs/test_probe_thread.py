"""The node reads of the hang path (/proc of every rank, through NodeIO) happen on the
probe loop's thread, never on the consumer thread that runs `on_publish` and `tick`:
a /proc read that hangs (a rank in D state, a stuck FUSE mount) must not hold up the
consumer and with it every other rule's alerts."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Sequence

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.jobview import JobView, RankView, RasAnswer, StackCapture
from gpuwatchd.model import Gpu, GpuInventory, GpuProcess, SourceSnapshot
from gpuwatchd.state import NodeSnapshot
from tests.hangs.test_monitor_live import RealProcs, ranks  # noqa: F401 (a fixture)

JOB = JobView("torch:127.0.0.1:29500", (RankView(4242, ("0",), 0, world_size=1),), 1, 1)


class BlockedProc:
    """NodeIO whose /proc reads wait until released, noting the thread each ran on."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.threads: set[str] = set()

    def _read(self) -> None:
        self.threads.add(threading.current_thread().name)
        self.entered.set()
        self.release.wait(30.0)

    def jobs(self, snap: NodeSnapshot, procfs: str) -> list[JobView]:
        self._read()
        return [JOB]

    def probe(self, jobs: Sequence[JobView], procfs: str) -> list[JobView]:
        self._read()
        return list(jobs)

    def capture(self, pid: int, timeout: float) -> StackCapture:
        return StackCapture(pid, False, error="not asked")

    def ras(self, job: JobView, netns: bool, timeout: float) -> RasAnswer:
        raise AssertionError("not asked")

    def flight(self, job: JobView, procfs: str, wait: object) -> tuple[list[object], list[str]]:
        return [], []


def _nvml(stamp: float) -> NodeSnapshot:
    gpus = GpuInventory(
        (Gpu(index=0, pci_bus_id="0000:01:00.0", processes=(GpuProcess(pid=4242),)),)
    )
    return NodeSnapshot(
        sources={"nvml": SourceSnapshot("nvml", (), True, timestamp=stamp, payload=gpus)}
    )


def test_a_proc_read_that_blocks_does_not_block_the_consumer_step() -> None:
    io = BlockedProc()
    clock = FakeClock(start=1_800_000_000.0)
    monitor = HangMonitor(Config(), clock, io=io, ras_workers=0)
    monitor.start()

    def consumer() -> None:  # what the consumer thread runs for a few seconds of polls
        for _ in range(3):
            monitor.on_publish(_nvml(clock.time()))
            clock.advance(1.0)
            monitor.tick()

    step = threading.Thread(target=consumer, name="consumer", daemon=True)
    try:
        step.start()
        assert io.entered.wait(10.0), "the jobs were never read"
        step.join(5.0)  # a bound far above a step's milliseconds, far below the read's 30 s
        assert not step.is_alive(), "the consumer's step waited on a /proc read"
        assert io.threads == {"hang-probe"}
        assert monitor.findings() == []  # the engine's pull does not wait either
    finally:
        io.release.set()
        step.join(30.0)
        monitor.stop()


def test_the_probe_thread_finds_a_killed_rank(ranks: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    views = tuple(
        RankView(p.pid, (str(i),), i, world_size=2, local_rank=i) for i, p in enumerate(ranks)
    )
    io = RealProcs(JobView("torch:127.0.0.1:29500", views, 2, 2, (("job", "t"),)))
    clock = FakeClock(start=1_800_000_000.0)
    monitor = HangMonitor(Config(), clock, io=io)
    monitor.start()
    try:
        monitor.on_publish(_nvml(clock.time()))  # the NVML poll: the job and its two ranks
        for _ in range(5):
            clock.advance(1.0)
            monitor.tick()
            assert monitor.wait_idle(10.0)
        ranks[1].send_signal(signal.SIGKILL)
        ranks[1].wait()
        killed = clock.time()
        while clock.time() - killed < 30 and not monitor.findings():
            clock.advance(1.0)
            monitor.tick()
            assert monitor.wait_idle(10.0)
        (f,) = monitor.findings()
        assert "rank 1 died" in f.reason and f.severity.name == "CRITICAL"
        deadline = time.monotonic() + 10.0  # forensics on its own thread names the signature
        while dict(monitor.findings()[0].labels)["signature"] == "pending":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert dict(monitor.findings()[0].labels)["signature"] == "dead_peer"
    finally:
        monitor.stop()


class BrokenProc(BlockedProc):
    """NodeIO whose probe raises (a bug): counted, and the next probe still runs."""

    def jobs(self, snap: NodeSnapshot, procfs: str) -> list[JobView]:
        return [JOB]

    def probe(self, jobs: Sequence[JobView], procfs: str) -> list[JobView]:
        self.threads.add(threading.current_thread().name)
        raise RuntimeError("a bug in a reader")


def test_a_probe_that_raises_is_counted_and_the_loop_goes_on() -> None:
    io = BrokenProc()
    clock = FakeClock(start=1_800_000_000.0)
    monitor = HangMonitor(Config(), clock, io=io, ras_workers=0)
    monitor.start()
    try:
        monitor.on_publish(_nvml(clock.time()))
        assert monitor.wait_idle(10.0)
        clock.advance(5.0)
        monitor.tick()  # due: the probe interval passed
        assert monitor.wait_idle(10.0)
        assert monitor.errors == 2 and io.threads == {"hang-probe"}
    finally:
        monitor.stop()


class CountedProc(BlockedProc):
    """NodeIO that answers at once and counts the reads of the probe thread."""

    def __init__(self, jobs: list[JobView]) -> None:
        super().__init__()
        self.reads = 0
        self._jobs = jobs

    def jobs(self, snap: NodeSnapshot, procfs: str) -> list[JobView]:
        self.reads += 1
        return list(self._jobs)

    def probe(self, jobs: Sequence[JobView], procfs: str) -> list[JobView]:
        self.reads += 1
        return list(jobs)


def test_an_idle_node_does_not_wake_the_probe_thread() -> None:
    # Every tick and every source's publish woke it (3.5 wake-ups a second on an idle
    # replayed node); with no job, and for sources that name no job, nothing is to read.
    io = CountedProc([])
    clock = FakeClock(start=1_800_000_000.0)
    monitor = HangMonitor(Config(), clock, io=io, ras_workers=0)
    woken: list[object] = []
    handle = monitor._loop._handle
    monitor._loop._handle = lambda item: (woken.append(item), handle(item))  # type: ignore[method-assign]
    monitor.start()
    try:
        monitor.on_publish(_nvml(clock.time()), _nvml(clock.time()).sources["nvml"])
        assert monitor.wait_idle(10.0) and len(woken) == 1  # the poll: no job on the node
        kmsg = SourceSnapshot("kmsg", (), True, timestamp=clock.time())
        for _ in range(10):
            clock.advance(1.0)
            monitor.on_publish(NodeSnapshot(sources={"kmsg": kmsg}), kmsg)
            monitor.tick()
        assert monitor.wait_idle(10.0)
        assert len(woken) == 1, woken
    finally:
        monitor.stop()
    # with a job, the tick's faster probe runs again
    io = CountedProc([JOB])
    monitor = HangMonitor(Config(), clock, io=io, ras_workers=0)
    monitor.start()
    try:
        monitor.on_publish(_nvml(clock.time()), _nvml(clock.time()).sources["nvml"])
        assert monitor.wait_idle(10.0)
        before = io.reads
        for _ in range(10):
            clock.advance(1.0)
            monitor.tick()
            assert monitor.wait_idle(10.0)
        assert io.reads > before
    finally:
        monitor.stop()
