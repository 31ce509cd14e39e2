"""The pipeline, wired in one place: sources -> state -> consumers -> sinks.

The daemon and `gpuwatchd check` build theirs here: `Pipeline` (consumer
thread, store, sinks) and `Consumers` (the same chain, one-shot, over the
store read-only). `Pipeline` holds the long-lived consumers (event store, Xid stage, health
engine, alert sink, hang monitor). Every alert leaves through the engine's
findings and its one `AlertSink`: the hang monitor is a findings provider the
engine pulls, not a second sink. They keep memory that must survive a SIGHUP (open
conditions, `startsAt` of firing alerts, the kernel log cursor), so they are
built once per process and only reconfigured on reload. `SourceSet` holds the
sources and their runner, which a reload rebuilds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.config.overrides import node_name
from gpuwatchd.diag import scheduler as diag_scheduler
from gpuwatchd.diag.scheduler import DiagScheduler
from gpuwatchd.errors import GpuwatchdError, StoreError
from gpuwatchd.forensics import NodeForensics
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.health import engine as engine_mod
from gpuwatchd.health.engine import HealthEngine
from gpuwatchd.health.hangs.ports import METRICS as HANG_METRICS
from gpuwatchd.health.slowdowns.monitor import METRICS as SLOWDOWN_METRICS
from gpuwatchd.health.slowdowns.monitor import SlowdownMonitor
from gpuwatchd.health.xid.stage import METRICS as XID_METRICS
from gpuwatchd.health.xid.stage import XidStage
from gpuwatchd.http.app import Route
from gpuwatchd.http.endpoints import events_route
from gpuwatchd.model import Clear, Event, Finding, GpuInventory, MetricSpec, Sample
from gpuwatchd.sinks import evidence, store
from gpuwatchd.sinks.alertmanager import sink as alertmanager
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sinks.durability import close_within
from gpuwatchd.sinks.evidence import EvidenceRecorder, evidence_route
from gpuwatchd.sinks.hang_ids import HangIds
from gpuwatchd.sinks.remediation import sink as remediation
from gpuwatchd.sinks.remediation.sink import RemediationSink
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources import SourceContext, all_metrics, build_sources, enabled, registry
from gpuwatchd.sources.runner import Runner
from gpuwatchd.state import Publish, PublishQueue, State

__all__ = [
    "CONSUMER_METRICS",
    "Consumers",
    "PIPELINE_METRICS",
    "Pipeline",
    "SourceSet",
    "StoreReader",
    "TICK_SECONDS",
    "node_name",
    "one_shot_config",
    "open_store_reader",
    "source_names",
]

log = logging.getLogger("gpuwatchd")

TICK_SECONDS = 1.0
STOP_CLOSE_SECONDS = 8.0  # for closing the databases at stop (their checkpoints), together

PIPELINE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_consumer_errors_total",
        "counter",
        "Steps of the consumer thread (xid, health, tick) that raised (a bug; the log has"
        " the traceback). The thread goes on with the next publish.",
        ("step",),
    ),
    MetricSpec(
        "gpuwatchd_consumer_coalesced_total",
        "counter",
        "Source publishes folded into one still waiting for the consumer thread (the latest"
        " snapshot wins, events are kept): a sign the consumer falls behind.",
    ),
)

CONSUMER_METRICS: tuple[MetricSpec, ...] = (
    *PIPELINE_METRICS,
    *XID_METRICS,
    *engine_mod.METRICS,
    *HANG_METRICS,
    *SLOWDOWN_METRICS,
    *alertmanager.METRICS,
    *remediation.METRICS,
    *diag_scheduler.METRICS,
    *store.METRICS,
    *evidence.METRICS,
)


def source_names(cfg: Config) -> list[str]:
    return [name for name in registry() if enabled(cfg, name)]


class Consumers:
    """The consumer chain without a thread or sinks: Xid stage, then health engine.

    Publishes wait on a `PublishQueue` (State's listener); `_consume` runs,
    for each source's publish in arrival order, the steps of `STEPS`: the
    Xid stage (merge, track, and write events with the kernel log cursor to
    the store in one transaction), then the health engine (rules; open
    findings go to its listeners). A step that raises is logged and counted.
    The daemon's `Pipeline` adds the consumer thread and the sinks; `check`
    uses this chain as is, one-shot, over the daemon's store read-only.
    """

    STEPS = ("xid", "health")

    def __init__(
        self,
        cfg: Config,
        state: State,
        clock: Clock,
        store: EventStore | StoreReader | None,
        source_names: Iterable[str],
        one_shot: bool = False,
    ) -> None:
        self.cfg = cfg
        self._state = state
        self._clock = clock
        self.store = store
        self.xids = XidStage.from_config(cfg, state.publish_extra, store, clock)
        self.engine = HealthEngine(
            cfg,
            clock,
            state,
            xids=self.xids.conditions,
            expected_sources=list(source_names),
            clears=engine_mod.store_clears(store) if store is not None else None,
            baseline_gpus=_baseline(cfg, store),
            on_baseline=None if one_shot or store is None else _saver(cfg, store),
            log_transitions=not one_shot,  # `check` reports what it found itself
        )
        self.xids.log_reports = not one_shot
        self._one_shot = one_shot
        self.queue = PublishQueue()
        self._lock = threading.Lock()  # one step at a time: the consumer or a reload
        self._errors = dict.fromkeys((*self.STEPS, "hangs", "slowdowns", "tick"), 0)
        self.hangs: HangMonitor | None = None  # the daemon's job hang monitor (Pipeline)
        self.slowdowns: SlowdownMonitor | None = None  # and its slowdown detector
        state.subscribe(self.queue.offer)

    def drain(self) -> None:
        """Consume every publish waiting, in the caller's thread (one-shot use)."""
        self._consume(self.queue.take(0.0))
        if self._one_shot:
            self._guarded("xid", self.xids.replay_clears)

    def _consume(self, batch: Sequence[Publish]) -> None:
        if not batch:
            return
        steps: list[tuple[str, Callable[..., object]]] = [
            ("xid", self.xids.on_publish),
            ("health", self.engine.on_publish),
        ]
        if self.hangs is not None:  # before the engine, which pulls its findings
            steps.insert(1, ("hangs", self.hangs.on_publish))
        if self.slowdowns is not None:
            steps.insert(-1, ("slowdowns", self.slowdowns.on_publish))
        for item in batch:
            for name, step in steps:
                self._guarded(name, step, self._state.snapshot(), item.source, item.events)
        self.queue.done(max(item.seq for item in batch))

    def _guarded(self, name: str, step: Callable[..., object], *args: object) -> None:
        with self._lock:
            try:
                step(*args)
            except Exception:  # a bug in one step must not stop the consumer
                self._errors[name] = self._errors.get(name, 0) + 1
                log.exception("consumer step %s raised", name)


class Pipeline(Consumers):
    """Event store -> Xid stage -> health engine -> alert sink, on one consumer thread.

    Source threads only publish to the State; its one listener puts the
    publish on the `PublishQueue`. The consumer thread takes what waits and
    runs the steps (see `Consumers`). About once a second it runs the tick
    (NVML merge releases, operator clears, hold times and expiries) and
    publishes the consumer's and the sink's own samples. Sinks only read:
    the alert sink's outbox and its sender threads are its own.
    """

    def __init__(
        self,
        cfg: Config,
        state: State,
        clock: Clock,
        node: str,
        listen_port: int,
        source_names: Iterable[str],
    ) -> None:
        self._node = node
        self._port = listen_port
        self.store: EventStore = EventStore.from_config(cfg, clock.time)
        super().__init__(cfg, state, clock, self.store, source_names)
        self.sink = self._new_sink(cfg)
        self.engine.add_listener(self.sink.update)
        self.remediation = RemediationSink(cfg, clock, node, self.store)
        self.engine.add_listener(self.remediation.update)
        self.diag = DiagScheduler(cfg, state, clock, self.store, node)
        self.engine.add_listener(self.diag.update)
        self.evidence = EvidenceRecorder(cfg, self.store, state, clock)
        self.engine.add_listener(self.evidence.update)
        self.remediation.before_act = self._evidence_before_act
        # Job hangs: their own probe and forensics threads; their findings are pulled by
        # the engine, so they leave through the one sink (reload, for_seconds, disabled_rules).
        ids = HangIds(self.store)  # unique for the store's life, not the run's
        self.hangs: HangMonitor = HangMonitor(cfg, clock, self.store, io=NodeForensics(), ids=ids)
        self.engine.add_provider("job_hang", self.hangs.provider)
        # the hang probe's jobs of its last poll (no /proc read here) and its RAS answers
        self.slowdowns = SlowdownMonitor(self.hangs.jobs_seen, ras_views=self.hangs.ras_views)
        self.engine.add_provider("job_slowdown", self.slowdowns)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._heartbeat = clock.monotonic()

    def _evidence_before_act(self, finding: Finding) -> str:
        return self.evidence.ensure(finding, "before remediation")

    def _new_sink(self, cfg: Config) -> AlertSink:
        db = os.path.join(cfg.daemon.state_dir, store.DB_NAME)
        return AlertSink(cfg, db, self._clock, self._node, listen_port=self._port)

    def load_cursor(self, source: str) -> str | None:
        return self.store.load_cursor(source)

    def routes(self) -> dict[str, Route]:
        return {
            "/events": events_route(self.store),
            "/alerts": self.sink.route_alerts,
            "/hangs": self.hangs.route,
            "/evidence": evidence_route(self.cfg),
        }

    def status(self) -> Mapping[str, Any]:
        return {
            "health": self.engine.status(),
            "alerts": self.sink.status(),
            "remediation": self.remediation.status(),
            "diag": self.diag.status(),
            "event_store": self._store_status(),
            "slowdowns": self.slowdowns.status() if self.slowdowns else {},
        }

    def _store_status(self) -> dict[str, Any]:
        held = len(self.store.held)
        out: dict[str, Any] = {"up": not self.store.problem, "problem": self.store.problem}
        out["held_events"] = held
        if held:  # /events reads the file: what waits in memory is not there yet
            out["note"] = f"{held} event(s) held in memory are missing from /events until written"
        return out

    # --- the consumer thread ----------------------------------------------------------

    def start(self) -> None:
        """Start the alert senders and the consumer thread."""
        self.sink.start()
        self.remediation.start()
        self.diag.start()
        self.hangs.start()
        self.evidence.start()
        self._heartbeat = self._clock.monotonic()
        self._thread = threading.Thread(target=self._run, name="consumer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_tick = self._clock.monotonic()
        while not self._stopping.is_set():
            batch = self.queue.take(max(0.0, next_tick - self._clock.monotonic()))
            self._consume(batch)
            if self._clock.monotonic() >= next_tick:
                self.tick()
                next_tick = self._clock.monotonic() + TICK_SECONDS
            self._heartbeat = self._clock.monotonic()
        self._consume(self.queue.take(0.0))  # what sources published before they stopped

    def tick(self) -> None:
        """About once a second on the consumer thread: expiries, hold times, operator clears."""
        self._guarded("tick", self.xids.tick)
        self._guarded("hangs", self.hangs.tick)  # before the engine pulls its findings
        self._guarded("tick", self.engine.tick)
        self._guarded("tick", self._publish_samples)

    def _publish_samples(self) -> None:
        # State.publish_extra skips an unchanged publish (the tick mostly finds nothing new).
        errors = {**self._errors, "hangs": self._errors["hangs"] + self.hangs.errors}
        out = [
            Sample.of("gpuwatchd_consumer_errors_total", n, step=name) for name, n in errors.items()
        ]
        out.append(Sample.of("gpuwatchd_consumer_coalesced_total", self.queue.coalesced))
        self._state.publish_extra("consumer", out)
        self._state.publish_extra("hangs", self.hangs.samples())
        self._state.publish_extra("slowdowns", self.slowdowns.samples() if self.slowdowns else [])
        # Sinks only count; their samples are cheap copies, published here.
        self._state.publish_extra("alertmanager", self.sink.samples())
        self._state.publish_extra("remediation", self.remediation.samples())
        self._state.publish_extra("diag", self.diag.samples())
        self._state.publish_extra("evidence", self.evidence.samples())

    def stale(self, max_age: float) -> list[str]:
        """["consumer"] if the consumer thread made no progress for `max_age` + a tick."""
        if self._thread is None:
            return []
        age = self._clock.monotonic() - self._heartbeat
        return ["consumer"] if age > max_age + TICK_SECONDS else []

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the consumer has handled every publish so far (start-up, reload)."""
        return self.queue.wait_drained(timeout)

    def reconfigure(self, cfg: Config) -> None:
        """SIGHUP: new thresholds and policies; open conditions and queued alerts stay."""
        with self._lock:
            self.xids.reconfigure(cfg)
            self.engine.reconfigure(cfg)
            self.hangs.reconfigure(cfg)
            old = self.sink
            old.stop(flush_timeout=2.0)
            self.engine.remove_listener(old.update)
            self.sink = self._new_sink(cfg)
            self.engine.add_listener(self.sink.update)
            self.sink.start()
            self._restart_remediation(cfg)
            self.cfg = cfg

    def _restart_remediation(self, cfg: Config) -> None:
        self.remediation.stop()
        self.engine.remove_listener(self.remediation.update)
        self.remediation = RemediationSink(cfg, self._clock, self._node, self.store)
        self.remediation.before_act = self._evidence_before_act
        self.engine.add_listener(self.remediation.update)
        self.remediation.start()
        self.diag.stop()
        self.engine.remove_listener(self.diag.update)
        self.diag = DiagScheduler(cfg, self._state, self._clock, self.store, self._node)
        self.engine.add_listener(self.diag.update)
        self.diag.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Drain and stop the consumer (sources are stopped first), flush alerts, close."""
        self._stopping.set()
        self.queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("consumer thread did not stop in %.0fs", timeout)
        self.remediation.stop()
        self.diag.stop(timeout)
        self.hangs.stop(timeout)
        self.evidence.stop(timeout)
        self.sink.stop(flush_timeout=timeout, close=False)
        # One checkpoint per database (the last connection's close), in parallel and bounded:
        # 5 s per sync made them 30 s in a row, past systemd's TimeoutStopSec.
        files = [("alert outbox", self.sink.close), ("event store", self.store.close)]
        late = close_within(files, STOP_CLOSE_SECONDS)
        if late:
            log.warning(
                "stop: %s not closed in %.0fs (a slow disk): the next start recovers the"
                " write-ahead log",
                ", ".join(late),
                STOP_CLOSE_SECONDS,
            )


class StoreReader:
    """The daemon's event store as `check` uses it: read, never written."""

    def __init__(self, store: EventStore) -> None:
        self._store = store

    def write(
        self, records: Sequence[tuple[Event, str, int]], cursors: Mapping[str, str] | None = None
    ) -> None:
        """Nothing: the daemon owns the events and the kernel log cursor."""

    def events_since(self, since: float) -> list[Event]:
        return self._store.events_since(since)

    def clears_since(self, since: float) -> list[Clear]:
        return self._store.clears_since(since)

    def clears_after(self, clear_id: int) -> list[Clear]:
        return self._store.clears_after(clear_id)

    def add_clear(self, who: str, **fields: Any) -> Clear:
        raise StoreError("a one-shot check does not record clears")

    def load_gpu_baseline(self) -> int:
        return self._store.load_gpu_baseline()

    def event_store(self) -> EventStore:
        """The store underneath, for read-only helpers (stored diag runs)."""
        return self._store

    def save_gpu_baseline(self, count: int) -> None:
        """Nothing: the baseline is the daemon's."""

    def close(self) -> None:
        self._store.close()


def open_store_reader(cfg: Config, notes: list[str]) -> StoreReader | None:
    """The daemon's store under daemon.state_dir, if there is one; why not in `notes`."""
    path = os.path.join(cfg.daemon.state_dir, store.DB_NAME)
    if not os.path.exists(path):
        return None
    if not os.access(path, os.W_OK):  # SQLite in WAL mode needs write access to read
        notes.append(f"cannot open {path} (operator clears not applied): not writable")
        return None
    try:
        return StoreReader(EventStore.from_config(cfg))
    except GpuwatchdError as exc:
        notes.append(f"event store: {exc} (operator clears not applied)")
        return None


def _saver(cfg: Config, store: EventStore | StoreReader) -> Callable[[int], None] | None:
    # A replay's GPUs are the capture's, not the node's: it never teaches the store a
    # count (a later real run on a GPU-less node would page NvmlUnresponsive).
    return None if cfg.sources.nvml.replay else store.save_gpu_baseline


def _baseline(cfg: Config, store: EventStore | StoreReader | None) -> int:
    if store is None or cfg.health.expected_gpus:
        return 0
    try:
        return store.load_gpu_baseline()
    except GpuwatchdError as exc:
        log.warning("GPU count baseline unavailable: %s", exc)
        return 0


def one_shot_config(cfg: Config) -> Config:
    """No `for:` delays, no failure grace, no NVML hold: a check reports what is true now."""
    zero = {name: 0.0 for name in {**cfg.health.for_seconds, **type(cfg.health)().for_seconds}}
    health = dataclasses.replace(cfg.health, for_seconds=zero, collector_failure_seconds=0.0)
    xid = dataclasses.replace(cfg.xid, nvml_hold=0.0)
    return dataclasses.replace(cfg, health=health, xid=xid)


class SourceSet:
    """The enabled sources and the runner that polls them, built from one config."""

    def __init__(
        self,
        cfg: Config,
        state: State,
        clock: Clock,
        pipeline: Pipeline | None = None,
        one_shot: bool = False,
    ) -> None:
        """`pipeline` None: sources start from scratch (no stored cursor), as `check` does;
        `one_shot`: a poll never waits for input that is not there yet (`check`)."""
        self.cfg = cfg
        self.state = state
        self.clock = clock
        ctx = SourceContext(
            clock=clock,
            log=logging.getLogger("gpuwatchd.sources"),
            nudge=self._nudge,
            gpus=self.gpus,
            load_cursor=pipeline.load_cursor if pipeline else (lambda name: None),
            one_shot=one_shot,
        )
        self.sources = build_sources(cfg, ctx)
        self.runner = Runner(self.sources, state, clock)

    def _nudge(self, name: str) -> None:
        self.runner.nudge(name)

    def gpus(self) -> GpuInventory:
        """The GPUs of the NVML source's last published poll (empty before it)."""
        nvml = self.state.snapshot().sources.get("nvml")
        inventory = nvml.inventory if nvml is not None else None
        return inventory if inventory is not None else GpuInventory()

    @staticmethod
    def metric_specs(with_consumers: bool) -> list[MetricSpec]:
        return [*all_metrics(), *(CONSUMER_METRICS if with_consumers else ())]

    def start(self, stopping: Callable[[], bool] = bool) -> None:
        wait = 2 * self.cfg.sources.nvml.call_timeout + 1  # NVML's init, then one call each
        self.runner.start(first=("nvml",), first_timeout=wait, stopping=stopping)

    def stop(self) -> None:
        self.runner.stop()
