"""The consumer thread: sources only publish; one thread runs the Xid stage, health and store."""

from __future__ import annotations

import threading
from pathlib import Path

from gpuwatchd.clock import FakeClock, SystemClock
from gpuwatchd.config import Config, load
from gpuwatchd.model import Event, KmsgState, Sample, Severity, SourceSnapshot
from gpuwatchd.pipeline.daemon import Pipeline
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import PublishQueue, State

BUS = "00000000:06:00.0"


def snap(source: str, value: float, cursor: str = "") -> SourceSnapshot:
    reader = KmsgState(reader_up=True, cursor=cursor) if source == "kmsg" else None
    return SourceSnapshot(source, (Sample.of("gpuwatchd_x", value),), True, payload=reader)


def xid(code: int, t: float) -> Event:
    return Event("xid", "kmsg", t, code=code, pci_bus_id=BUS, severity=Severity.CRITICAL)


def test_queue_keeps_latest_snapshot_and_every_event_in_arrival_order() -> None:
    q, state = PublishQueue(), State()
    q.offer(state.snapshot(), snap("kmsg", 1), (xid(13, 1.0),))
    q.offer(state.snapshot(), snap("nvml", 1), ())
    q.offer(state.snapshot(), snap("kmsg", 2), (xid(31, 2.0),))
    batch = q.take(0.0)
    assert [p.source.source for p in batch] == ["kmsg", "nvml"]
    assert batch[0].source.samples[0].value == 2  # the latest snapshot wins
    assert [e.code for e in batch[0].events] == [13, 31]  # no event is dropped
    assert q.coalesced == 1 and q.depth() == 0
    assert q.take(0.0) == []
    assert not q.wait_drained(0.0)
    q.done(max(p.seq for p in batch))
    assert q.wait_drained(0.0)


def cfg_for(tmp_path: Path) -> Config:
    path = tmp_path / "config.yaml"
    path.write_text(f"daemon:\n  state_dir: {tmp_path}\n")
    return load(str(path))


def test_consumer_runs_steps_off_the_source_thread_and_stores_events(tmp_path: Path) -> None:
    cfg, state = cfg_for(tmp_path), State()
    pipeline = Pipeline(cfg, state, SystemClock(), "n", 0, ["kmsg"])
    seen: list[str] = []
    inner = pipeline.engine.on_publish

    def spy(*args: object) -> None:
        seen.append(threading.current_thread().name)
        inner(*args)  # type: ignore[arg-type]

    pipeline.engine.on_publish = spy  # type: ignore[method-assign]
    pipeline.start()
    try:
        now = SystemClock().time()
        state.publish(snap("kmsg", 1, cursor="c1"), (xid(79, now),))
        assert pipeline.wait_idle(10)
        assert seen == ["consumer"]
        assert [f.alertname for f in state.snapshot().findings] == ["GpuXidCritical"]
    finally:
        pipeline.stop()
    store = EventStore(str(tmp_path / "gpuwatchd.db"))
    try:
        assert [e.code for e in store.events_since(0)] == [79]
        assert store.load_cursor("kmsg") == "c1"  # written with the event, by the consumer
    finally:
        store.close()


def test_a_step_that_raises_is_counted_and_the_thread_goes_on(tmp_path: Path) -> None:
    cfg, state = cfg_for(tmp_path), State()
    pipeline = Pipeline(cfg, state, SystemClock(), "n", 0, ["kmsg"])
    calls = 0
    inner = pipeline.xids.on_publish

    def flaky(*args: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        inner(*args)  # type: ignore[arg-type]

    pipeline.xids.on_publish = flaky  # type: ignore[method-assign]
    pipeline.start()
    try:
        state.publish(snap("kmsg", 1))
        assert pipeline.wait_idle(10)
        state.publish(snap("kmsg", 2))
        assert pipeline.wait_idle(10)
        assert calls == 2
        pipeline.tick()
        errors = {
            s.label("step"): s.value
            for s in state.snapshot().extra["consumer"]
            if s.name == "gpuwatchd_consumer_errors_total"
        }
        assert errors["xid"] == 1 and errors["health"] == errors["tick"] == 0
        assert sum(errors.values()) == 1
        assert pipeline.stale(30.0) == []
    finally:
        pipeline.stop()


def test_consumer_is_stale_when_it_makes_no_progress(tmp_path: Path) -> None:
    clock, state = FakeClock(), State()
    pipeline = Pipeline(cfg_for(tmp_path), state, clock, "n", 0, [])
    assert pipeline.stale(5.0) == []  # not started: nothing to watch
    block = threading.Event()
    pipeline.engine.on_publish = lambda *a: block.wait(10)  # type: ignore[method-assign]
    pipeline.start()
    try:
        state.publish(snap("kmsg", 1))  # the consumer now hangs in the health step
        assert not pipeline.wait_idle(0.2)
        clock.advance(10.0)
        assert pipeline.stale(5.0) == ["consumer"]
    finally:
        block.set()
        pipeline.stop()


def test_sink_samples_are_published_by_the_consumer(tmp_path: Path) -> None:
    state = State()
    pipeline = Pipeline(cfg_for(tmp_path), state, SystemClock(), "n", 0, [])
    try:
        pipeline.tick()
        names = {s.name for s in state.snapshot().extra["alertmanager"]}
        assert "gpuwatchd_alertmanager_queue_length" in names
    finally:
        pipeline.stop()


def test_nvml_publishes_a_typed_inventory_that_sources_read_through_the_context(
    tmp_path: Path,
) -> None:
    from gpuwatchd.pipeline import SourceSet

    capture = Path(__file__).parent / "fixtures" / "nvml" / "h200x2-record.json"
    path = tmp_path / "config.yaml"
    path.write_text(
        f"daemon:\n  state_dir: {tmp_path}\nsources:\n  nvml:\n    replay: {capture}\n"
        "  kmsg:\n    enabled: false\n  udev:\n    enabled: false\n"
    )
    state = State()
    sources = SourceSet(load(str(path)), state, FakeClock())
    assert len(sources.gpus()) == 0  # nothing published yet
    sources.runner.poll_once("nvml")
    gpus = sources.gpus()
    assert [(g.index, g.pci_bus_id) for g in gpus] == [(0, "0000:00:06.0"), (1, "0000:00:07.0")]
    assert gpus.by_bus_id("00000000:00:07.0") is gpus.gpus[1]  # NVML's 8-digit domain
    assert gpus.by_bus_id("PCI:0000:00:07") is gpus.gpus[1]  # as an Xid line prints it
    assert gpus.find("1") is gpus.find(gpus.gpus[1].uuid) is gpus.gpus[1]
    assert gpus.find("7") is None and gpus.gpus[0].mig == ()
    sources.stop()


def test_healthz_and_the_watchdog_name_a_stuck_consumer(tmp_path: Path) -> None:
    from gpuwatchd.daemon import Wiring

    path = tmp_path / "config.yaml"
    path.write_text(
        f"daemon:\n  state_dir: {tmp_path}\nsources:\n  nvml:\n    enabled: false\n"
        "  kmsg:\n    enabled: false\n  udev:\n    enabled: false\n"
        "  shm:\n    enabled: false\n  infiniband:\n    enabled: false\n"
        "  aer:\n    enabled: false\n  workloads:\n    enabled: false\n"
        "  memory:\n    enabled: false\n"
    )
    cfg, clock, state = load(str(path)), FakeClock(), State()
    pipeline = Pipeline(cfg, state, clock, "n", 0, [])
    wiring = Wiring(cfg, state, clock, pipeline)
    healthz = wiring.routes["/healthz"]
    block = threading.Event()
    pipeline.engine.on_publish = lambda *a: block.wait(10)  # type: ignore[method-assign]
    pipeline.start()
    try:
        assert healthz({})[0] == 200
        state.publish(snap("kmsg", 1))  # the consumer hangs in the health step
        assert not pipeline.wait_idle(0.2)
        clock.advance(cfg.http.healthz_stale_seconds + 5)
        assert healthz({}) == (503, "text/plain", b"stale: consumer\n")
        assert wiring.stale(30.0) == ["consumer"]  # what _housekeeping withholds WATCHDOG=1 on
    finally:
        block.set()
        pipeline.stop()


def test_quiet_ticks_keep_the_snapshot_generation(tmp_path: Path) -> None:
    """Nothing moved: no publish, so the exposition cached for this generation stays valid."""
    state = State()
    pipeline = Pipeline(cfg_for(tmp_path), state, FakeClock(), "n", 0, [])
    try:
        pipeline.tick()
        generation = state.snapshot().generation
        pipeline.tick()
        pipeline.tick()
        assert state.snapshot().generation == generation
    finally:
        pipeline.stop()


def test_the_state_skips_an_unchanged_publish_in_one_place() -> None:
    """Producers publish every tick; the same samples or findings bump no generation."""
    state = State()
    assert state.publish_extra("health", [Sample.of("gpuwatchd_x", 1)])
    generation = state.snapshot().generation
    assert not state.publish_extra("health", (Sample.of("gpuwatchd_x", 1),))
    assert not state.set_findings(())
    assert state.snapshot().generation == generation
    assert state.publish_extra("health", [Sample.of("gpuwatchd_x", 2)])
    assert state.snapshot().generation == generation + 1


def test_a_replay_does_not_teach_the_node_store_its_gpu_count(tmp_path: Path) -> None:
    """The README's replay demo and then a plain run on a GPU-less node share ./.state:
    the capture's 2 GPUs must not become the node's expected count (the plain run would
    page NvmlUnresponsive, reboot_node)."""
    from gpuwatchd.pipeline import SourceSet

    capture = Path(__file__).parent / "fixtures" / "nvml" / "h200x2-record.json"
    path = tmp_path / "config.yaml"
    path.write_text(
        f"daemon:\n  state_dir: {tmp_path}\nsources:\n  nvml:\n    replay: {capture}\n"
        "  kmsg:\n    enabled: false\n  udev:\n    enabled: false\n"
    )
    state = State()
    sources = SourceSet(load(str(path)), state, FakeClock())
    pipeline = Pipeline(load(str(path)), state, FakeClock(), "n", 0, ["nvml"])
    try:
        sources.runner.poll_once("nvml")
        pipeline.engine.evaluate(state.snapshot())
        assert pipeline.engine.gpu_count() == 2
    finally:
        sources.stop()
        pipeline.stop()
    store = EventStore(str(tmp_path / "gpuwatchd.db"))
    try:
        assert store.load_gpu_baseline() == 0
    finally:
        store.close()
