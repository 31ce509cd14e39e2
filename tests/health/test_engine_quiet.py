"""Quiet ticks: the health engine skips the 1 s tick when no rule's answer can change.

Each scenario runs twice on a FakeClock, ticking every second: once as the
daemon does, once with the skipping switched off (every tick evaluates, as
before it existed); the findings must be the same at every second, and the
time-based finding each scenario is about must appear.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config, load_text
from gpuwatchd.health.engine import HealthEngine, store_clears
from gpuwatchd.health.rules import XidCondition
from gpuwatchd.health.ruleset import MAX_QUIET_SECONDS
from gpuwatchd.model import Action, Finding, Labels, Sample, Severity
from gpuwatchd.state import State
from tests.health.snapshots import GPU0, GPU1, T0, Node, gpu_samples, source

U0, U1 = GPU0["uuid"], GPU1["uuid"]
# One step of a scenario at second t: publish what it wants through `state`.
Step = Callable[[int, State, FakeClock], None]
Seen = list[tuple[tuple[str, Labels, str], ...]]  # per second: (alertname, subject, reason)


def make(
    skipping: bool, cfg: Config | None = None, **kw: object
) -> tuple[HealthEngine, State, FakeClock]:
    clock = FakeClock(T0)
    state = State()
    engine = HealthEngine(cfg or Config(), clock, state, **kw)  # type: ignore[arg-type]
    state.subscribe(engine.on_publish)
    if not skipping:
        engine._quiet = lambda now: False  # type: ignore[method-assign]
    return engine, state, clock


def publish(state: State, node: Node, t: float, only: tuple[str, ...] = ()) -> None:
    for name, src in node.snapshot(t).sources.items():
        if not only or name in only:
            state.publish(src)


def run(
    step: Step, seconds: int, skipping: bool, cfg: Config | None = None, **kw: object
) -> tuple[Seen, HealthEngine]:
    """Findings (name, subject, reason) after each second's tick."""
    engine, state, clock = make(skipping, cfg, **kw)
    seen: Seen = []
    for t in range(seconds):
        step(t, state, clock)
        engine.tick()
        seen.append(tuple((f.alertname, f.subject, f.reason) for f in state.snapshot().findings))
        clock.advance(1.0)
    return seen, engine


def same_with_and_without_skipping(
    step: Step, seconds: int, cfg: Config | None = None, **kw: object
) -> Seen:
    skipped, quiet = run(step, seconds, True, cfg, **kw)
    every, busy = run(step, seconds, False, cfg, **kw)
    assert skipped == every
    assert quiet.evaluations < busy.evaluations  # the skipping did skip something
    return skipped


def names(seen: Seen, t: int) -> set[str]:
    return {f[0] for f in seen[t]}


def first(seen: Seen, name: str) -> int:
    return next(t for t, found in enumerate(seen) if name in {f[0] for f in found})


def test_an_unchanged_tick_does_not_evaluate() -> None:
    engine, state, clock = make(True)
    publish(state, Node(), clock.time())
    done = engine.evaluations
    for _ in range(20):
        clock.advance(1.0)
        assert engine.tick() == []
    assert engine.evaluations == done
    clock.advance(1.0)
    publish(state, Node(gpus={U0: {"remap_pending": 1}, U1: {}}), clock.time())
    assert engine.evaluations == done + 1  # a change is evaluated at once, as before
    clock.advance(1.0)
    engine.tick()  # something is open now: every tick evaluates
    assert engine.evaluations == done + 2


def test_a_quiet_engine_still_evaluates_at_least_every_max_quiet_seconds() -> None:
    engine, state, clock = make(True)
    publish(state, Node(), clock.time())
    done = engine.evaluations
    for _ in range(int(MAX_QUIET_SECONDS)):
        clock.advance(1.0)
        engine.tick()
    assert engine.evaluations == done + 1


def test_a_collector_that_stops_polling_fires_on_time() -> None:
    shm = [Sample.of("gpuwatchd_shm_size_bytes", 64 * 2**20)]
    node = Node(extra_sources={"shm": shm})

    def step(t: int, state: State, clock: FakeClock) -> None:
        if t % 10 == 0:  # NVML keeps polling; shm polls until t=40, then hangs
            publish(state, node, clock.time(), only=("nvml",) if t > 40 else ())

    seen = same_with_and_without_skipping(step, 220)
    # stale once its last poll (t=40) is older than collector_failure_seconds (120 s)
    assert first(seen, "GpuwatchdCollectorFailed") == 161


def test_a_failing_collector_fires_after_collector_failure_seconds() -> None:
    ok = Node(extra_sources={"infiniband": []})
    failing = Node(extra_sources={"infiniband": []}, failing={"infiniband": "sysfs gone"})

    def step(t: int, state: State, clock: FakeClock) -> None:
        if t % 15 == 0:
            publish(state, failing if 30 <= t < 300 else ok, clock.time())

    seen = same_with_and_without_skipping(step, 330)
    assert first(seen, "GpuwatchdCollectorFailed") == 150  # failing since t=30, for 120 s
    assert "GpuwatchdCollectorFailed" not in names(seen, 300)  # resolved by the good poll


def test_a_for_window_opens_without_a_new_publish() -> None:
    hot = Node(gpus={U0: {"hw_slowdown": 1}, U1: {}})

    def step(t: int, state: State, clock: FakeClock) -> None:
        if t == 0:
            publish(state, Node(), clock.time())
        if t == 5:
            publish(state, hot, clock.time())  # then no publish at all

    cfg = load_text("health:\n  for_seconds:\n    GpuThermalSlowdown: 25\n")
    seen = same_with_and_without_skipping(step, 120, cfg=cfg)
    assert first(seen, "GpuThermalSlowdown") == 30


def test_an_xid_expires_on_time() -> None:
    until = T0 + 50
    xid = XidCondition(
        79,
        GPU1["pci_bus_id"],
        Severity.CRITICAL,
        Action.REBOOT_NODE,
        "GPU has fallen off the bus",
        "reboot",
        since=T0,
    )

    def step(t: int, state: State, clock: FakeClock) -> None:
        if t == 0:
            publish(state, Node(), clock.time())

    seen = same_with_and_without_skipping(step, 80, xids=lambda now: [xid] if now < until else [])
    assert "GpuXidCritical" in names(seen, 49) and "GpuXidCritical" not in names(seen, 50)


def test_a_stuck_gpu_fires_on_time_from_identical_polls() -> None:
    stuck = [
        *gpu_samples(GPU0, util=1.0),
        Sample.of("gpuwatchd_gpu_utilization_ratio", 0.0, **GPU0, engine="memory"),
        Sample.of("gpuwatchd_gpu_power_watts", 90.0, **GPU0),
        Sample.of("gpuwatchd_gpu_power_limit_watts", 700.0, **GPU0),
        Sample.of("gpuwatchd_gpus_visible", 1),
    ]

    def step(t: int, state: State, clock: FakeClock) -> None:
        if t % 10 == 0:  # the same readings every poll: only the poll's stamp moves
            state.publish(source("nvml", stuck, clock.time()))

    seen = same_with_and_without_skipping(step, 330)
    assert first(seen, "GpuStuckSuspected") == 300  # stuck.min_duration_seconds


def test_an_operator_clear_in_the_store_is_read_on_the_next_quiet_tick(tmp_path: Path) -> None:
    from gpuwatchd.sinks.store import EventStore

    store = EventStore(str(tmp_path / "gpuwatchd.db"), clock=lambda: T0)
    try:
        engine, state, clock = make(True, clears=store_clears(store))
        publish(state, Node(), clock.time())
        clock.advance(1.0)
        engine.tick()
        done = engine.evaluations
        store.add_clear("carol", reason="GPU 1 removed on purpose")
        clock.advance(1.0)
        engine.tick()
        assert engine.evaluations == done + 1
        clock.advance(1.0)
        engine.tick()
        assert engine.evaluations == done + 1  # applied once
    finally:
        store.close()


@pytest.mark.parametrize("change", ["listener", "reconfigure"])
def test_a_new_listener_or_config_is_evaluated_on_the_next_tick(change: str) -> None:
    engine, state, clock = make(True)
    old: list[tuple[Finding, ...]] = []
    engine.add_listener(lambda found, now: old.append(tuple(found)))
    publish(state, Node(), clock.time())
    assert old == [()]
    got: list[tuple[Finding, ...]] = []
    if change == "listener":  # as a reload swaps the alert sink
        engine.remove_listener(engine._listeners[0])
        engine.add_listener(lambda found, now: got.append(tuple(found)))
    else:
        engine.reconfigure(Config())
    done = engine.evaluations
    clock.advance(1.0)
    engine.tick()
    assert engine.evaluations == done + 1
    assert got == ([()] if change == "listener" else [])  # the new sink hears at once
