"""Long-lived consumers of the state, built once per process.

The event store, the Xid pipeline, the health engine and the alert sink keep
memory that must survive a SIGHUP (open conditions, `startsAt` of firing
alerts, the kernel log cursor), so the daemon builds them once and only
reconfigures them on reload, while sources are rebuilt.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.health import engine as engine_mod
from gpuwatchd.health.engine import HealthEngine
from gpuwatchd.health.xid.pipeline import METRICS as XID_METRICS
from gpuwatchd.health.xid.pipeline import XidPipeline
from gpuwatchd.model import MetricSpec
from gpuwatchd.sinks import store
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sinks.alertmanager import sink as alertmanager
from gpuwatchd.sinks.prometheus import Route
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import State

__all__ = ["METRICS", "Services"]

log = logging.getLogger("gpuwatchd")

METRICS: tuple[MetricSpec, ...] = (*XID_METRICS, *engine_mod.METRICS, *alertmanager.METRICS)


class Services:
    """Event store -> Xid pipeline -> health engine -> alert sink, wired to the state."""

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
        self.xids = XidPipeline.from_config(cfg, state.publish_extra, self.store, clock)
        self.sink = self._new_sink(cfg)
        self.engine = HealthEngine(
            cfg,
            clock,
            state,
            xids=self.xids.active,
            expected_sources=list(source_names),
            clears=engine_mod.store_clears(self.store),
            baseline_gpus=self.sink.baseline_gpus(),
            on_baseline=self.sink.save_baseline,
        )
        self.engine.add_listener(self.sink.update)
        # Order matters: the Xid pipeline must see a publish before the engine evaluates it.
        state.subscribe(self.xids.on_publish)
        state.subscribe(self.engine.on_publish)

    def _new_sink(self, cfg: Config) -> AlertSink:
        db = os.path.join(cfg.daemon.state_dir, store.DB_NAME)
        return AlertSink(cfg, db, self._clock, self._node, self._state, listen_port=self._port)

    def load_cursor(self, source: str) -> str | None:
        return self.store.load_cursor(source)

    def routes(self) -> dict[str, Route]:
        return {
            "/events": store.events_route(self.store),
            "/alerts": self.sink.route_alerts,
        }

    def status(self) -> Mapping[str, Any]:
        return {"health": self.engine.status(), "alerts": self.sink.status()}

    def start(self) -> None:
        self.sink.start()

    def tick(self) -> None:
        """Called about once a second: expiries, hold times, operator clears."""
        self.xids.tick()
        self.engine.tick()

    def reconfigure(self, cfg: Config) -> None:
        """SIGHUP: new thresholds and policies; open conditions and queued alerts stay."""
        self.xids.reconfigure(cfg)
        self.engine.reconfigure(cfg)
        old = self.sink
        old.stop(flush_timeout=2.0)
        self.engine.remove_listener(old.update)
        self.sink = self._new_sink(cfg)
        self.engine.add_listener(self.sink.update)
        self.sink.start()
        self.cfg = cfg

    def stop(self) -> None:
        self.sink.stop(flush_timeout=5.0)
        self.store.close()
