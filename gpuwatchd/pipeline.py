"""The pipeline, wired in one place: sources -> state -> consumers -> sinks.

`Pipeline` holds the long-lived consumers (event store, Xid stage, health
engine, alert sink). They keep memory that must survive a SIGHUP (open
conditions, `startsAt` of firing alerts, the kernel log cursor), so they are
built once per process and only reconfigured on reload. `SourceSet` holds the
sources and their runner, which a reload rebuilds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.health import engine as engine_mod
from gpuwatchd.health import storage as _storage  # noqa: F401 (registers its rule)
from gpuwatchd.health.engine import HealthEngine
from gpuwatchd.health.xid.stage import METRICS as XID_METRICS
from gpuwatchd.health.xid.stage import XidStage
from gpuwatchd.http.endpoints import events_route
from gpuwatchd.http.server import Route
from gpuwatchd.model import MetricSpec, Sample
from gpuwatchd.sinks import store
from gpuwatchd.sinks.alertmanager import sink as alertmanager
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sinks.remediation import sink as remediation
from gpuwatchd.sinks.remediation.sink import RemediationSink
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources import SourceContext, all_metrics, build_sources, enabled, registry
from gpuwatchd.sources.runner import Runner
from gpuwatchd.state import Publish, PublishQueue, State

__all__ = [
    "CONSUMER_METRICS",
    "PIPELINE_METRICS",
    "Pipeline",
    "SourceSet",
    "TICK_SECONDS",
    "node_name",
    "source_names",
]

log = logging.getLogger("gpuwatchd")

TICK_SECONDS = 1.0

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
    *alertmanager.METRICS,
    *remediation.METRICS,
    *store.METRICS,
)


def node_name(cfg: Config) -> str:
    """The node label: config, else $GPUWATCHD_NODE_NAME (the chart sets it), else hostname."""
    return cfg.daemon.node_name or os.environ.get("GPUWATCHD_NODE_NAME") or socket.gethostname()


def source_names(cfg: Config) -> list[str]:
    return [name for name in registry() if enabled(cfg, name)]


class Pipeline:
    """Event store -> Xid stage -> health engine -> alert sink, on one consumer thread.

    Source threads only publish to the State; its one listener puts the
    publish on a `PublishQueue`. The consumer thread takes what waits and
    runs, for each source's publish in arrival order, the steps of
    `STEPS`: the Xid stage (merge, track, and write events with the kernel
    log cursor to the store in one transaction), then the health engine
    (rules; open findings go to the alert sink's outbox). About once a
    second it runs the tick (NVML merge releases, operator clears, hold
    times and expiries) and publishes the consumer's and the sink's own
    samples. A step that raises is logged and counted; the thread goes on.
    """

    STEPS = ("xid", "health")

    def __init__(
        self,
        cfg: Config,
        state: State,
        clock: Clock,
        node: str,
        listen_port: int,
        source_names: Iterable[str],
    ) -> None:
        self.cfg = cfg
        self._state = state
        self._clock = clock
        self._node = node
        self._port = listen_port
        self.store = EventStore.from_config(cfg, clock.time)
        self.xids = XidStage.from_config(cfg, state.publish_extra, self.store, clock)
        self.sink = self._new_sink(cfg)
        self.engine = HealthEngine(
            cfg,
            clock,
            state,
            xids=self.xids.active,
            expected_sources=list(source_names),
            clears=engine_mod.store_clears(self.store),
            baseline_gpus=self.store.load_gpu_baseline(),
            on_baseline=self.store.save_gpu_baseline,
        )
        self.engine.add_listener(self.sink.update)
        self.remediation = RemediationSink(cfg, clock, node, self.store, state)
        self.engine.add_listener(self.remediation.update)
        self.queue = PublishQueue()
        self._lock = threading.Lock()  # one step at a time: the consumer or a reload
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._heartbeat = clock.monotonic()
        self._errors = dict.fromkeys((*self.STEPS, "tick"), 0)
        self._sink_published: tuple[int, int] = (-1, -1)
        state.subscribe(self.queue.offer)

    def _new_sink(self, cfg: Config) -> AlertSink:
        db = os.path.join(cfg.daemon.state_dir, store.DB_NAME)
        return AlertSink(cfg, db, self._clock, self._node, listen_port=self._port)

    def load_cursor(self, source: str) -> str | None:
        return self.store.load_cursor(source)

    def routes(self) -> dict[str, Route]:
        return {"/events": events_route(self.store), "/alerts": self.sink.route_alerts}

    def status(self) -> Mapping[str, Any]:
        return {
            "health": self.engine.status(),
            "alerts": self.sink.status(),
            "remediation": self.remediation.status(),
        }

    # --- the consumer thread ----------------------------------------------------------

    def start(self) -> None:
        """Start the alert senders and the consumer thread."""
        self.sink.start()
        self.remediation.start()
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

    def _consume(self, batch: Sequence[Publish]) -> None:
        if not batch:
            return
        steps = (("xid", self.xids.on_publish), ("health", self.engine.on_publish))
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

    def tick(self) -> None:
        """About once a second on the consumer thread: expiries, hold times, operator clears."""
        self._guarded("tick", self.xids.tick)
        self._guarded("tick", self.engine.tick)
        self._guarded("tick", self._publish_samples)

    def _publish_samples(self) -> None:
        out = [
            Sample.of("gpuwatchd_consumer_errors_total", n, step=name)
            for name, n in self._errors.items()
        ]
        out.append(Sample.of("gpuwatchd_consumer_coalesced_total", self.queue.coalesced))
        self._state.publish_extra("consumer", out)
        # The sink only counts; its samples are published from here when they moved.
        mark = (id(self.sink), self.sink.version)
        if mark != self._sink_published:
            self._sink_published = mark
            self._state.publish_extra("alertmanager", self.sink.samples())

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
        self.remediation = RemediationSink(cfg, self._clock, self._node, self.store, self._state)
        self.engine.add_listener(self.remediation.update)
        self.remediation.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Drain and stop the consumer (sources are stopped first), flush alerts, close."""
        self._stopping.set()
        self.queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("consumer thread did not stop in %.0fs", timeout)
        self.remediation.stop()
        self.sink.stop(flush_timeout=timeout)
        self.store.close()


class SourceSet:
    """The enabled sources and the runner that polls them, built from one config."""

    def __init__(
        self, cfg: Config, state: State, clock: Clock, pipeline: Pipeline | None = None
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.clock = clock
        ctx = SourceContext(
            clock=clock,
            log=logging.getLogger("gpuwatchd.sources"),
            nudge=self._nudge,
            gpu_index=self.gpu_index,
            load_cursor=pipeline.load_cursor if pipeline else (lambda name: None),
        )
        self.sources = build_sources(cfg, ctx)
        self.runner = Runner(self.sources, state, clock)

    def _nudge(self, name: str) -> None:
        self.runner.nudge(name)

    def gpu_index(self) -> Mapping[str, Mapping[str, str]]:
        nvml = self.state.snapshot().sources.get("nvml")
        gpus = nvml.status.get("gpus") if nvml is not None else None
        return gpus if isinstance(gpus, Mapping) else {}

    @staticmethod
    def metric_specs(with_consumers: bool) -> list[MetricSpec]:
        return [*all_metrics(), *(CONSUMER_METRICS if with_consumers else ())]

    def start(self) -> None:
        # NVML's first poll is bounded by its deadlines: init plus one device call each.
        self.runner.start(first=("nvml",), first_timeout=2 * self.cfg.sources.nvml.call_timeout + 1)

    def stop(self) -> None:
        self.runner.stop()
