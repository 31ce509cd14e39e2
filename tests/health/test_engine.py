"""The health engine: for-durations, transitions, roll-up, publishing, threads, clears."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.health import ruleset
from gpuwatchd.health.engine import HealthEngine
from gpuwatchd.health.rules import Inputs, XidCondition
from gpuwatchd.health.ruleset import RuleSpec
from gpuwatchd.model import Action, Clear, Finding, Health, Severity
from gpuwatchd.state import State
from tests.health.snapshots import GPU0, GPU1, T0, Node, source
from tests.health.test_rules import cfg_with

U0, U1 = GPU0["uuid"], GPU1["uuid"]


def publish(state: State, node: Node, clock: FakeClock) -> None:
    snap = node.snapshot(clock.time())
    for src in snap.sources.values():
        state.publish(src)


def make(cfg: Config | None = None, **kw: object) -> tuple[HealthEngine, State, FakeClock]:
    clock = FakeClock(T0)
    state = State()
    engine = HealthEngine(cfg or Config(), clock, state, **kw)  # type: ignore[arg-type]
    state.subscribe(engine.on_publish)
    return engine, state, clock


def health_samples(state: State) -> dict[tuple[str, str, str], float]:
    return {
        (s.label("scope"), s.label("component"), s.label("gpu")): s.value
        for s in state.snapshot().extra["health"]
        if s.name == "gpuwatchd_health"
    }


def test_healthy_node_publishes_health() -> None:
    engine, state, clock = make()
    publish(state, Node(), clock)
    assert state.snapshot().findings == ()
    h = health_samples(state)
    assert h[("node", "", "")] == 0 and h[("gpu", "", "0")] == 0 and h[("gpu", "", "1")] == 0
    assert h[("component", "nvml", "")] == 0 and h[("component", "daemon", "")] == 0
    assert engine.status()["health"] == "healthy"


def test_for_seconds_delays_opening_and_since_is_first_seen() -> None:
    engine, state, clock = make()
    hot = Node(gpus={U0: {"hw_slowdown": 1}, U1: {}})
    publish(state, hot, clock)
    assert state.snapshot().findings == ()  # GpuThermalSlowdown needs 60 s
    clock.advance(30)
    publish(state, hot, clock)
    assert state.snapshot().findings == ()
    clock.advance(30)
    publish(state, hot, clock)
    [f] = state.snapshot().findings
    assert f.alertname == "GpuThermalSlowdown" and f.since == T0
    h = health_samples(state)
    assert h[("gpu", "", "0")] == int(Health.DEGRADED) and h[("node", "", "")] == 1
    assert engine.rollup().components["nvml"] is Health.DEGRADED
    clock.advance(10)
    publish(state, Node(), clock)
    assert state.snapshot().findings == ()


def test_critical_rolls_up_and_sorts_first() -> None:
    engine, state, clock = make()
    publish(state, Node(), clock)
    clock.advance(10)
    publish(state, Node(gpus={U0: {"remap_pending": 1}, U1: {"ecc_unc_vol": 1}}), clock)
    names = [f.alertname for f in state.snapshot().findings]
    assert names == ["GpuEccUncorrectable", "GpuRowRemapPending"]
    roll = engine.rollup()
    assert roll.node is Health.UNHEALTHY
    assert roll.gpus == {U0: Health.DEGRADED, U1: Health.UNHEALTHY}
    status = engine.status()
    assert status["gpus"]["1"] == {"uuid": U1, "health": "unhealthy"}  # type: ignore[index]
    conds = status["conditions"]
    assert conds[0]["summary"] == "Uncorrectable ECC errors on GPU 1"  # type: ignore[index]


def test_listener_sees_changes_only_and_waits_for_sources() -> None:
    calls: list[tuple[str, ...]] = []
    engine, state, clock = make(expected_sources=["nvml", "kmsg"])
    engine.add_listener(lambda found, now: calls.append(tuple(f.alertname for f in found)))
    pending = Node(gpus={U0: {"remap_pending": 1}, U1: {}})
    publish(state, pending, clock)
    assert calls == []  # kmsg has not reported yet: do not resolve last run's alerts
    state.publish(source("kmsg", [], clock.time()))
    assert calls == [("GpuRowRemapPending",)]
    clock.advance(10)
    publish(state, pending, clock)
    assert len(calls) == 1  # nothing changed
    clock.advance(10)
    publish(state, Node(), clock)
    assert calls[-1] == ()


def test_startup_grace_releases_listener() -> None:
    calls: list[int] = []
    engine, state, clock = make(expected_sources=["nvml", "infiniband"])
    engine.add_listener(lambda found, now: calls.append(len(found)))
    publish(state, Node(gpus={U0: {"remap_pending": 1}, U1: {}}), clock)
    clock.advance(61)
    engine.evaluate()
    assert calls == [1]


def test_xids_from_tracker_and_clear_hooks() -> None:
    active = [
        XidCondition(
            79,
            "0000:00:07.0",
            Severity.CRITICAL,
            Action.REBOOT_NODE,
            "GPU has fallen off the bus",
            "reboot",
            since=T0 - 30,
        )
    ]
    cleared: list[Clear] = []
    engine, state, clock = make(xids=lambda now: list(active))
    engine.on_clear(cleared.append)
    publish(state, Node(), clock)
    [f] = state.snapshot().findings
    assert (f.alertname, dict(f.subject)["gpu"], f.since) == ("GpuXidCritical", "1", T0 - 30)
    assert engine.rollup().components["kmsg"] is Health.UNHEALTHY
    active.clear()  # what the tracker does on a clear
    engine.apply_clear(
        Clear(id=1, time=clock.time(), pci_bus_id="1", who="alice", reason="reseated")
    )
    assert [c.who for c in cleared] == ["alice"]
    assert state.snapshot().findings == ()


def test_clear_forgets_sticky_memory_of_one_gpu() -> None:
    engine, state, clock = make()
    publish(state, Node(), clock)
    clock.advance(10)
    both = Node(gpus={U0: {"ecc_unc_vol": 1}, U1: {"ecc_unc_vol": 1}})
    publish(state, both, clock)
    assert len(state.snapshot().findings) == 2
    engine.apply_clear(Clear(id=1, time=clock.time(), pci_bus_id=GPU0["pci_bus_id"], who="bob"))
    [left] = state.snapshot().findings
    assert dict(left.subject)["gpu"] == "1"


def test_clear_all_resets_gpu_count_baseline() -> None:
    engine, state, clock = make()
    publish(state, Node(), clock)
    clock.advance(10)
    publish(state, Node(gpus={U0: {}}), clock)
    assert {f.alertname for f in state.snapshot().findings} == {"GpuLost", "GpuCountLow"}
    engine.apply_clear(Clear(id=2, time=clock.time()))
    assert state.snapshot().findings == ()


def test_a_raising_rule_is_counted_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(inp: Inputs) -> list[Finding]:
        raise ZeroDivisionError

    monkeypatch.setattr(ruleset, "RULES", (RuleSpec("broken", broken), *ruleset.RULES))
    engine, state, clock = make()
    publish(state, Node(gpus={U0: {"remap_failure": 1}, U1: {}}), clock)
    assert [f.alertname for f in state.snapshot().findings] == ["GpuRowRemapFailure"]
    errors = [
        s
        for s in state.snapshot().extra["health"]
        if s.name == "gpuwatchd_health_rule_errors_total"
    ]
    counted = {s.label("rule"): s.value for s in errors}
    assert counted.pop("broken") == 1
    # every other rule is exported at 0, so the series exists before anything fails
    assert {"node_rules", "gpu_stuck", "xid_tracker"} <= set(counted)
    assert set(counted.values()) == {0}


def test_disabled_and_for_seconds_from_config() -> None:
    cfg = cfg_with(disabled_rules=["GpuRowRemapPending"], for_seconds={"GpuPcieDegraded": 0})
    engine, state, clock = make(cfg)
    publish(state, Node(gpus={U0: {"remap_pending": 1, "width": 8}, U1: {}}), clock)
    assert [f.alertname for f in state.snapshot().findings] == ["GpuPcieDegraded"]


def test_concurrent_publishers() -> None:
    engine, state, clock = make()
    errors: list[BaseException] = []
    sick = Node(gpus={U0: {"remap_failure": 1}, U1: {}})

    def worker(node: Node, n: int) -> None:
        try:
            for _ in range(n):
                publish(state, node, clock)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(sick, 50)) for _ in range(4)]
    threads.append(
        threading.Thread(
            target=worker,
            args=(Node(extra_sources={"shm": []}, gpus={U0: {"remap_failure": 1}, U1: {}}), 50),
        )
    )
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    found: Sequence[Finding] = state.snapshot().findings
    assert [f.alertname for f in found] == ["GpuRowRemapFailure"]


def test_node_rules_and_stuck_detector_run_in_the_engine() -> None:
    from gpuwatchd.model import Sample
    from tests.health.snapshots import ib_port

    engine, state, clock = make()
    full = [
        Sample.of("gpuwatchd_shm_size_bytes", 64 * 2**20),
        Sample.of("gpuwatchd_shm_available_bytes", 0),
        Sample.of("gpuwatchd_shm_segments", 3, state="stale"),
        Sample.of("gpuwatchd_shm_segment_bytes", 60 * 2**20, state="stale"),
    ]
    node = Node(extra_sources={"shm": full, "infiniband": ib_port(state=1, phys=3)})
    publish(state, node, clock)
    names = {f.alertname for f in state.snapshot().findings}
    assert {"ShmNearlyFull", "ShmStaleSegments", "InfinibandPortDown"} <= names
    roll = engine.rollup()
    assert roll.components["shm"] is Health.UNHEALTHY  # 0 bytes free: critical
    assert roll.components["infiniband"] is Health.UNHEALTHY
    assert roll.components["nvml"] is Health.HEALTHY


def test_gpu_count_baseline_survives_restart(tmp_path) -> None:
    from gpuwatchd.sinks.store import EventStore

    store = EventStore(str(tmp_path / "db"))
    clock, state = FakeClock(T0), State()
    first = HealthEngine(
        Config(),
        clock,
        state,
        baseline_gpus=store.load_gpu_baseline(),
        on_baseline=store.save_gpu_baseline,
    )
    state.subscribe(first.on_publish)
    publish(state, Node(), clock)
    assert store.load_gpu_baseline() == 2
    # The daemon restarts after a GPU fell off the bus.
    state = State()
    second = HealthEngine(
        Config(),
        clock,
        state,
        baseline_gpus=store.load_gpu_baseline(),
        on_baseline=store.save_gpu_baseline,
    )
    state.subscribe(second.on_publish)
    publish(state, Node(gpus={U0: {}}), clock)
    assert [f.alertname for f in state.snapshot().findings] == ["GpuCountLow"]
    expected = [
        s.value for s in state.snapshot().extra["health"] if s.name == "gpuwatchd_gpus_expected"
    ]
    assert expected == [2]
    store.close()


def test_tick_applies_clears_written_to_the_store(tmp_path) -> None:
    from gpuwatchd.health.engine import store_clears
    from gpuwatchd.sinks.store import EventStore

    store = EventStore(str(tmp_path / "gpuwatchd.db"), clock=lambda: T0 + 20)
    engine, state, clock = make(clears=store_clears(store))
    publish(state, Node(), clock)
    clock.advance(10)
    publish(state, Node(gpus={U0: {"ecc_unc_vol": 2}, U1: {}}), clock)
    assert [f.alertname for f in engine.tick()] == ["GpuEccUncorrectable"]
    store.add_clear("carol", pci_bus_id=GPU0["pci_bus_id"], reason="reset done")
    clock.advance(10)
    assert engine.tick() == []
    assert engine.tick() == []  # applied once, stays applied
    store.close()


def test_quiet_repeat_publish_is_not_re_evaluated_within_a_second() -> None:
    engine, state, clock = make()
    runs: list[float] = []
    original = engine.evaluate

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        runs.append(clock.time())
        return original(*a, **k)

    engine.evaluate = counting  # type: ignore[method-assign]
    node = Node()
    publish(state, node, clock)
    first = len(runs)
    clock.advance(0.5)
    publish(state, node, clock)  # same samples, half a second later: skipped
    assert len(runs) == first
    clock.advance(1.0)
    publish(state, node, clock)  # same samples, but a second has passed: evaluated
    assert len(runs) > first
    hot = Node(gpus={U0: {"remap_pending": 1}, U1: {}})
    n = len(runs)
    publish(state, hot, clock)  # changed samples: evaluated at once
    assert len(runs) > n


def test_a_tick_that_changes_nothing_leaves_the_snapshot_alone() -> None:
    """The scrape cache lives as long as a snapshot generation: a quiet tick keeps it."""
    engine, state, clock = make()
    publish(state, Node(gpus={U0: {"ecc_dbe_volatile": 1}, U1: {}}), clock)
    generation = state.snapshot().generation
    clock.advance(1.0)
    engine.tick()
    assert state.snapshot().generation == generation
    publish(state, Node(gpus={U0: {}, U1: {}}), clock)  # a change still publishes
    assert state.snapshot().generation > generation


def test_a_fresh_interpreter_importing_only_the_engine_sees_every_rule() -> None:
    """The rule set is an explicit list, not whatever modules happen to be imported."""
    code = (
        "from gpuwatchd.clock import FakeClock\n"
        "from gpuwatchd.config import Config\n"
        "from gpuwatchd.health.engine import HealthEngine\n"
        "from gpuwatchd.model import SourceSnapshot\n"
        "from gpuwatchd.state import State\n"
        "state = State()\n"
        "state.subscribe(HealthEngine(Config(), FakeClock(1e9), state).on_publish)\n"
        "state.publish(SourceSnapshot('shm', (), True))\n"
        "names = {s.label('rule') for s in state.snapshot().extra['health']\n"
        "         if s.name == 'gpuwatchd_health_rule_errors_total'}\n"
        "print(' '.join(sorted(names)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert {"fabric", "state_dir", "collectors", "xid"} <= set(out)
    assert len(out) == len(ruleset.RULES) + 3  # plus xid_tracker, node_rules, gpu_stuck
