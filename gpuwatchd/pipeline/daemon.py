"""The daemon's pipeline: the consumer chain with its thread, the store and the sinks.

`Pipeline` holds the long-lived consumers (event store, Xid stage, health
engine, alert sink, hang monitor). Every alert leaves through the engine's
findings and its one `AlertSink`: the hang monitor is a findings provider the
engine pulls, not a second sink. They keep memory that must survive a SIGHUP (open
conditions, `startsAt` of firing alerts, the kernel log cursor), so they are
built once per process and only reconfigured on reload.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.diag import scheduler as diag_scheduler
from gpuwatchd.diag.scheduler import DiagScheduler
from gpuwatchd.forensics import NodeForensics
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.health import engine as engine_mod
from gpuwatchd.health.hangs.ports import METRICS as HANG_METRICS
from gpuwatchd.health.slowdowns.monitor import METRICS as SLOWDOWN_METRICS
from gpuwatchd.health.slowdowns.monitor import SlowdownMonitor
from gpuwatchd.health.xid.stage import METRICS as XID_METRICS
from gpuwatchd.http.app import Route
from gpuwatchd.http.endpoints import events_route
from gpuwatchd.model import Finding, MetricSpec, Sample
from gpuwatchd.pipeline.consumers import Consumers
from gpuwatchd.sinks import evidence, store
from gpuwatchd.sinks.alertmanager import sink as alertmanager
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sinks.durability import close_within
from gpuwatchd.sinks.evidence import EvidenceRecorder, evidence_route
from gpuwatchd.sinks.hang_ids import HangIds
from gpuwatchd.sinks.remediation import sink as remediation
from gpuwatchd.sinks.remediation.sink import RemediationSink
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import State

__all__ = [
    "CONSUMER_METRICS",
    "PIPELINE_METRICS",
    "Pipeline",
    "STOP_CLOSE_SECONDS",
    "TICK_SECONDS",
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
        self.hangs.add_listener(lambda _found, _now: self.queue.wake())
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
            if self.queue.woken():  # the hang monitor's findings moved: judge them now
                self._guarded("tick", self.engine.tick)
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
