"""Drill: the wall clock steps an hour back or forward while a GPU is stuck.

The real NVML source (on the replay backend, its GPU 1 made to look stuck:
fully busy, no memory traffic, idle power) and a quiet kernel log source are
polled by the real runner into the real health engine, all on a FakeClock.
Ten minutes pass in 10 s polls; a minute in, the wall clock steps (as NTP or
an operator steps it). The stuck-GPU warning must come after five minutes of
monotonic time, not an hour late or at once, and no collector may be reported
as failed for the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.health.engine import HealthEngine
from gpuwatchd.health.stuck import ALERTNAME
from gpuwatchd.health.xid.stage import XidStage
from gpuwatchd.model import Event, Sample, Severity
from gpuwatchd.sinks.alertmanager.outbox import Outbox
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource
from gpuwatchd.sources.runner import Runner
from gpuwatchd.state import State

H200X2 = Path(__file__).resolve().parents[1] / "fixtures" / "nvml" / "h200x2-probe.json"
POLL = 10.0


class StuckGpu1:
    """The NVML source with GPU 1's readings made those of a spinning NCCL kernel."""

    name = "nvml"
    interval = POLL

    def __init__(self, clock: FakeClock) -> None:
        self.client = ReplayClient.load(H200X2, clock=clock)
        self.source = NvmlSource(self.client, clock=clock, call_timeout=2.0)

    def poll(self, now: float) -> Sequence[Sample | Event]:
        out: list[Sample | Event] = []
        for s in self.source.poll(now):
            if isinstance(s, Sample) and s.label("gpu") == "1":
                if s.name == "gpuwatchd_gpu_utilization_ratio":
                    s = replace(s, value=1.0 if s.label("engine") == "gpu" else 0.0)
                elif s.name == "gpuwatchd_gpu_power_watts":
                    s = replace(s, value=118.0)
            out.append(s)
        return out

    def status(self) -> dict[str, object]:
        return dict(self.source.status())

    def inventory(self):  # type: ignore[no-untyped-def]
        return self.source.inventory()

    def close(self) -> None:
        self.source.close()
        self.client.release()


class QuietKernelLog:
    """A kernel log source with nothing to report (what matters is when it polled)."""

    name = "kmsg"
    interval = POLL

    def poll(self, now: float) -> Sequence[Sample | Event]:
        return []

    def status(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("step", [-3600.0, 3600.0], ids=["back", "forward"])
def test_a_wall_clock_step_changes_no_timer(step: float) -> None:
    clock = FakeClock()
    state = State()
    engine = HealthEngine(Config(), clock, state, log_transitions=False)
    state.subscribe(engine.on_publish)
    nvml = StuckGpu1(clock)
    runner = Runner([nvml, QuietKernelLog()], state, clock)
    fired_at = None
    failed: set[str] = set()
    try:
        for tick in range(61):  # ten minutes
            if tick == 6:
                clock.step_wall(step)
            runner.poll_once("nvml")
            for f in engine.evaluate():
                if f.alertname == "GpuwatchdCollectorFailed":
                    failed.add(str(dict(f.subject + f.labels)))
                if f.alertname == ALERTNAME and fired_at is None:
                    fired_at = tick * POLL
            runner.poll_once("kmsg")
            clock.advance(POLL)
    finally:
        nvml.close()
    assert not failed, f"collectors reported failed after the step: {failed}"
    assert fired_at == 300.0, f"stuck GPU reported after {fired_at}s, 300s expected"


def test_a_wall_clock_stepped_back_does_not_hold_the_resend(tmp_path: Path) -> None:
    """An alert sent just before the wall clock went back an hour is resent on time.

    Alertmanager expires an alert not resent within its endsAt (4 resend
    intervals); a resend waiting out the step would let it expire.
    """
    outbox = Outbox(str(tmp_path / "outbox.db"))
    try:
        t = 1_700_000_000.0
        outbox.sync([({"alertname": "GpuXidCritical", "severity": "critical"}, {}, t)], t)
        url = "http://am.example:9093"
        outbox.mark_sent(url, outbox.due(url, t, 60.0), t)
        assert outbox.due(url, t + 30, 60.0) == []  # not yet
        stepped = t + 30 - 3600
        assert len(outbox.due(url, stepped, 60.0)) == 1
        assert outbox.next_due(url, stepped, 60.0) == 0.0
    finally:
        outbox.close()


@pytest.mark.parametrize("step", [3600.0, -3600.0], ids=["forward", "back"])
def test_a_wall_clock_step_moves_no_xid_warning_hold(step: float) -> None:
    """A warning Xid stays active for xid.warning_hold seconds of monotonic time.

    With wall times, an hour forward resolved the warning at once (and an
    hour back raised it again); an hour back kept it an hour too long.
    """
    clock = FakeClock()
    state = State()
    cfg = Config()
    stage = XidStage.from_config(cfg, state.publish_extra, None, clock)
    report = Event(
        "xid",
        "kmsg",
        clock.time(),
        13,
        "0000:18:00.0",
        attrs=(("gpu", "0"), ("raw", "NVRM: Xid (PCI:0000:18:00): 13, pid=650, name=python3")),
    )
    stage.on_publish(state.snapshot(), None, (report,))
    hold = cfg.xid.warning_hold
    assert [a.info.severity for a in stage.active()] == [Severity.WARNING]
    seen: list[tuple[float, bool]] = []
    for elapsed in range(10, int(hold) + 60, 10):
        clock.advance(10)
        if elapsed == 60:
            clock.step_wall(step)
        if elapsed == hold + 30:
            clock.step_wall(-step)  # and back, after the hold
        stage.tick()
        seen.append((elapsed, bool(stage.active())))
    ended = [t for t, active in seen if not active]
    assert ended and ended[0] == hold + 10, f"warning resolved at {ended[:1]}s, {hold + 10}s due"
    assert all(not active for t, active in seen if t > hold), "the warning came back"
