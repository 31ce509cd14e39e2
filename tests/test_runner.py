"""The runner and the per-key deadlines, driven by a FakeClock: no sleeps, no wall-clock asserts."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.deadline import CallTimeout, DeadlineRunner, StuckError
from gpuwatchd.errors import SourceError
from gpuwatchd.model import Event, Sample
from gpuwatchd.sources.runner import Runner
from gpuwatchd.state import State


class Counting:
    """A source that counts its polls and can be told to fail or to block."""

    def __init__(self, name: str, interval: float = 60.0) -> None:
        self.name = name
        self.interval = interval
        self.polls = 0
        self.fail: Exception | None = None
        self.block = threading.Event()
        self.block.set()
        self.polled = threading.Event()  # set after each poll, for tests to wait on

    def poll(self, now: float) -> Sequence[Sample | Event]:
        self.block.wait()
        self.polls += 1
        self.polled.set()
        if self.fail is not None:
            raise self.fail
        return [Sample.of("x", self.polls), Event("e", self.name, now)]

    def status(self) -> Mapping[str, object]:
        return {"polls": self.polls}

    def close(self) -> None:
        pass


def test_failures_are_recorded_and_do_not_stop_the_loop() -> None:
    state = State()
    src = Counting("a")
    clock = FakeClock()
    runner = Runner([src], state, clock)
    snap = runner.poll_once("a")
    assert snap.timestamp == clock.time() and snap.last_success == clock.time()
    clock.advance(5.0)
    assert snap.ok and snap.samples[0].value == 1
    src.fail = SourceError("nvml_init_failed")
    snap = runner.poll_once("a")
    assert not snap.ok and snap.error == "nvml_init_failed"
    src.fail = RuntimeError("bug")
    snap = runner.poll_once("a")
    assert not snap.ok and snap.error == "exception"
    assert snap.last_success == clock.time() - 5.0  # the last good poll, not this one
    assert snap.errors_by_reason == {"nvml_init_failed": 1, "exception": 1}
    assert len(state.snapshot().events) == 1  # failed polls publish no events


def test_nudge_polls_before_the_interval() -> None:
    src = Counting("a", interval=60)
    runner = Runner([src], State(), FakeClock())
    runner.start()
    try:
        assert runner.wait_first_polls(5)
        src.polled.clear()
        runner.nudge("a")  # the fake clock never reaches the 60 s interval: only this wakes it
        assert src.polled.wait(5)
        assert src.polls == 2
    finally:
        runner.stop()


def test_blocked_source_goes_stale_and_others_do_not() -> None:
    slow, fast = Counting("slow", interval=0.05), Counting("fast", interval=0.05)
    slow.block.clear()
    clock = FakeClock()
    runner = Runner([slow, fast], State(), clock)
    runner.start()
    try:
        assert fast.polled.wait(5)
        assert runner.stale(0.1) == []  # both loops started just now
        clock.advance(10.0)
        for _ in range(2):  # the second poll starts after the first one's heartbeat
            fast.polled.clear()
            assert fast.polled.wait(5)
        assert runner.stale(0.1) == ["slow"]
        assert not runner.wait_first_polls(0.0)
    finally:
        slow.block.set()
        runner.stop()


def test_deadline_marks_key_stuck_until_the_call_returns() -> None:
    dr = DeadlineRunner()
    release = threading.Event()
    assert dr.call("gpu0", lambda: 7, 1.0) == 7
    with pytest.raises(CallTimeout):
        dr.call("gpu0", release.wait, 0.05)
    assert dr.is_stuck("gpu0") and dr.stuck_keys() == ["gpu0"]
    queued: list[int] = []
    with pytest.raises(StuckError):  # refused, not queued behind the hang
        dr.call("gpu0", lambda: queued.append(1) or 1, 5.0)
    assert dr.call("gpu1", lambda: 2, 1.0) == 2  # other keys unaffected
    release.set()
    # DeadlineRunner runs on real futures (no clock to fake): wait, bounded, for the hung
    # call to return; asserting nothing about how long that took.
    for _ in range(500):
        if not dr.is_stuck("gpu0"):
            break
        threading.Event().wait(0.01)
    assert dr.call("gpu0", lambda: 3, 5.0) == 3
    assert queued == []
    with pytest.raises(ZeroDivisionError):
        dr.call("gpu1", lambda: 1 // 0, 1.0)
    dr.close()


class Follower(Counting):
    """A source that reads another's payload (as the workloads read NVML's processes)."""

    follows = "lead"


def test_a_follower_polls_right_after_each_poll_of_the_source_it_reads() -> None:
    """Not on its own timer: that one may fire just before the leader's poll, and name the
    leader's new processes one interval late (the hang monitor then took them later still)."""
    state = State()
    lead, follower = Counting("lead", interval=3600.0), Follower("follower", interval=3600.0)
    runner = Runner([lead, follower], state, FakeClock())
    runner.start()
    try:
        assert follower.polled.wait(5.0)  # its own first poll at start
        follower.polled.clear()
        assert lead.polled.wait(5.0)
        runner.poll_once("lead")  # a poll of the leader: the follower is woken at once
        assert follower.polled.wait(5.0)
        assert follower.polls >= 2
    finally:
        runner.stop()
