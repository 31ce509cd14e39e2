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
from collections.abc import Iterable, Mapping
from typing import Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.health import engine as engine_mod
from gpuwatchd.health.engine import HealthEngine
from gpuwatchd.health.xid.stage import METRICS as XID_METRICS
from gpuwatchd.health.xid.stage import XidStage
from gpuwatchd.http.endpoints import events_route
from gpuwatchd.http.server import Route
from gpuwatchd.model import MetricSpec
from gpuwatchd.sinks import store
from gpuwatchd.sinks.alertmanager import sink as alertmanager
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources import SourceContext, all_metrics, build_sources, enabled, registry
from gpuwatchd.sources.runner import Runner
from gpuwatchd.state import State

__all__ = ["CONSUMER_METRICS", "Pipeline", "SourceSet", "node_name", "source_names"]

log = logging.getLogger("gpuwatchd")

CONSUMER_METRICS: tuple[MetricSpec, ...] = (
    *XID_METRICS,
    *engine_mod.METRICS,
    *alertmanager.METRICS,
)


def node_name(cfg: Config) -> str:
    """The node label: config, else $GPUWATCHD_NODE_NAME (the chart sets it), else hostname."""
    return cfg.daemon.node_name or os.environ.get("GPUWATCHD_NODE_NAME") or socket.gethostname()


def source_names(cfg: Config) -> list[str]:
    return [name for name in registry() if enabled(cfg, name)]


class Pipeline:
    """Event store -> Xid stage -> health engine -> alert sink, wired to the state."""

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
            baseline_gpus=self.sink.baseline_gpus(),
            on_baseline=self.sink.save_baseline,
        )
        self.engine.add_listener(self.sink.update)
        # Order matters: the Xid stage must see a publish before the engine evaluates it.
        state.subscribe(self.xids.on_publish)
        state.subscribe(self.engine.on_publish)

    def _new_sink(self, cfg: Config) -> AlertSink:
        db = os.path.join(cfg.daemon.state_dir, store.DB_NAME)
        return AlertSink(cfg, db, self._clock, self._node, self._state, listen_port=self._port)

    def load_cursor(self, source: str) -> str | None:
        return self.store.load_cursor(source)

    def routes(self) -> dict[str, Route]:
        return {"/events": events_route(self.store), "/alerts": self.sink.route_alerts}

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
