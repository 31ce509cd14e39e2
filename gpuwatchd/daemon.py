"""Lifecycle: build the pipeline, serve HTTP, handle signals, talk to systemd.

Signal handlers only enqueue the signal number; the main loop waits on
that queue with a timeout and does all the work (reload, stop, watchdog,
status) in one place.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import _SilentHandler

from gpuwatchd import __version__, config, logs
from gpuwatchd.clock import Clock, SystemClock
from gpuwatchd.config import Config
from gpuwatchd.errors import ConfigError, StoreError
from gpuwatchd.http import webconfig
from gpuwatchd.model import MetricSpec
from gpuwatchd.services import METRICS as SERVICE_METRICS
from gpuwatchd.services import Services
from gpuwatchd.sinks.alertmanager import sink as alertmanager
from gpuwatchd.sinks.prometheus import (
    Route,
    SnapshotCollector,
    json_route,
    make_app,
    write_textfile,
)
from gpuwatchd.sources import SourceContext, all_metrics, build_sources, enabled, registry
from gpuwatchd.sources.runner import Runner
from gpuwatchd.state import State
from gpuwatchd.systemd import Notifier

__all__ = [
    "Daemon",
    "EX_CONFIG",
    "Overrides",
    "apply_overrides",
    "split_listen",
]

log = logging.getLogger("gpuwatchd")

EX_CONFIG = 78
FIRST_POLL_TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class Overrides:
    """Command-line flags that take precedence over the config file."""

    listen: str | None = None
    nvml_replay: str | None = None
    state_dir: str | None = None
    log_level: str | None = None


def apply_overrides(cfg: Config, ov: Overrides) -> Config:
    r = dataclasses.replace
    if ov.listen is not None:
        cfg = r(cfg, http=r(cfg.http, listen=ov.listen))
    if ov.nvml_replay is not None:
        nvml = r(cfg.sources.nvml, replay=ov.nvml_replay)
        cfg = r(cfg, sources=r(cfg.sources, nvml=nvml))
    if ov.state_dir is not None:
        cfg = r(cfg, daemon=r(cfg.daemon, state_dir=ov.state_dir))
    if ov.log_level is not None:
        cfg = r(cfg, daemon=r(cfg.daemon, log_level=ov.log_level))
    return cfg


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def node_name(cfg: Config) -> str:
    """The node label: config, else $GPUWATCHD_NODE_NAME (the chart sets it), else hostname."""
    return cfg.daemon.node_name or os.environ.get("GPUWATCHD_NODE_NAME") or socket.gethostname()


def check_state_dir(cfg: Config, source: str) -> None:
    path = cfg.daemon.state_dir
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            source, "daemon.state_dir", f"cannot create {path}: {exc.strerror}"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(source, "daemon.state_dir", f"{path} is not writable")


def source_names(cfg: Config) -> list[str]:
    return [name for name in registry() if enabled(cfg, name)]


class Pipeline:
    """Sources, runner and the sinks that read the state, built from one config."""

    def __init__(
        self, cfg: Config, state: State, clock: Clock, services: Services | None = None
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.clock = clock
        self.services = services
        self.started = clock.time()
        ctx = SourceContext(
            clock=clock,
            log=logging.getLogger("gpuwatchd.sources"),
            nudge=self._nudge,
            gpu_index=self._gpu_index,
            load_cursor=services.load_cursor if services else (lambda name: None),
        )
        self.sources = build_sources(cfg, ctx)
        self.runner = Runner(self.sources, state, clock)
        self.routes: dict[str, Route] = {
            "/status": json_route(self.status),
            "/healthz": self.healthz,
            **(services.routes() if services else {}),
        }

    def _nudge(self, name: str) -> None:
        self.runner.nudge(name)

    def _gpu_index(self) -> Mapping[str, Mapping[str, str]]:
        nvml = self.state.snapshot().sources.get("nvml")
        gpus = nvml.status.get("gpus") if nvml is not None else None
        return gpus if isinstance(gpus, Mapping) else {}

    def metric_specs(self) -> list[MetricSpec]:
        return [*all_metrics(), *(SERVICE_METRICS if self.services else ())]

    def start(self) -> None:
        # NVML's first poll is bounded by its deadlines: init plus one device call each.
        self.runner.start(first=("nvml",), first_timeout=2 * self.cfg.sources.nvml.call_timeout + 1)

    def stop(self) -> None:
        self.runner.stop()

    def healthz(self, _query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        stale = self.runner.stale(self.cfg.http.healthz_stale_seconds)
        if stale:
            return 503, "text/plain", f"stale: {', '.join(stale)}\n".encode()
        return 200, "text/plain", b"ok\n"

    def status(self, _query: Mapping[str, list[str]]) -> dict[str, Any]:
        snap = self.state.snapshot()
        return {
            "node": node_name(self.cfg),
            "version": __version__,
            "started": self.started,
            "sources": {
                name: {
                    "ok": s.ok,
                    "error": s.error,
                    "timestamp": s.timestamp,
                    "duration_seconds": s.duration_seconds,
                    "last_success": s.last_success,
                    **dict(s.status),
                }
                for name, s in snap.sources.items()
            },
            "findings": [_finding_json(f) for f in snap.findings],
            **(self.services.status() if self.services else {}),
        }

    def summary(self) -> str:
        """One line for systemd's STATUS=."""
        snap = self.state.snapshot()
        nvml = snap.sources.get("nvml")
        gpus = len(self._gpu_index())
        failing = sorted(n for n, s in snap.sources.items() if not s.ok)
        worst = max((f.severity for f in snap.findings), default=None)
        parts = [f"{gpus} GPU(s)" if nvml is not None and nvml.ok else "NVML unavailable"]
        parts.append(f"{len(snap.findings)} finding(s)" + (f", worst {worst}" if worst else ""))
        if failing:
            parts.append("failing: " + ",".join(failing))
        return "; ".join(parts)


def _finding_json(f: Any) -> dict[str, Any]:
    return {
        "rule": f.rule,
        "alertname": f.alertname,
        "scope": f.scope,
        "subject": dict(f.subject),
        "severity": str(f.severity),
        "reason": f.reason,
        "action": str(f.action),
        "remediation": f.remediation,
        "since": f.since,
    }


class Daemon:
    """The long-running process: `run()` returns the exit status."""

    def __init__(
        self,
        cfg_path: str | None,
        overrides: Overrides = Overrides(),
        clock: Clock | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.cfg_path = cfg_path
        self.overrides = overrides
        self.clock = clock or SystemClock()
        self.notifier = notifier or Notifier()
        self.signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.state = State()
        self.pipeline: Pipeline | None = None
        self.httpd: WSGIServer | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        # process_* (CPU, RSS, open fds) so the daemon's own cost is watched too.
        ProcessCollector(registry=self.registry)
        self._collector: SnapshotCollector | None = None
        self.web: webconfig.WebConfig | None = None
        self.services: Services | None = None

    def load_config(self) -> Config:
        cfg = apply_overrides(config.load(self.cfg_path), self.overrides)
        source = self.cfg_path or "<defaults>"
        config.check_paths(cfg, source)
        alertmanager.validate_config(cfg, source)
        check_state_dir(cfg, source)
        if cfg.http.web_config_file:
            self.web = webconfig.load(cfg.http.web_config_file)
        return cfg

    def run(self) -> int:
        try:
            cfg = self.load_config()
        except ConfigError as exc:
            log.error("%s", exc)
            return EX_CONFIG
        logs.setup(cfg.daemon.log_level)
        self._install_signals()
        try:
            self.services = Services(
                cfg,
                self.state,
                self.clock,
                node_name(cfg),
                split_listen(cfg.http.listen)[1],
                source_names(cfg),
            )
        except StoreError as exc:
            log.error("%s", exc)
            return 1
        pipeline = self._build(cfg)
        try:
            self.httpd = self._serve(cfg)
        except OSError as exc:
            log.error("cannot listen on %s: %s", cfg.http.listen, exc.strerror or exc)
            self.services.stop()
            return 1
        self.services.start()
        pipeline.start()
        if not pipeline.runner.wait_first_polls(FIRST_POLL_TIMEOUT):
            log.warning("some sources did not finish a first poll in %.0fs", FIRST_POLL_TIMEOUT)
        host, port = self.httpd.server_address[:2]
        log.info("gpuwatchd %s serving on %s:%s (%s)", __version__, host, port, pipeline.summary())
        self.notifier.ready(pipeline.summary())
        try:
            return self._loop()
        finally:
            self._shutdown()

    # --- internals -----------------------------------------------------------

    def _build(self, cfg: Config) -> Pipeline:
        self.pipeline = Pipeline(cfg, self.state, self.clock, self.services)
        if self._collector is not None:
            self.registry.unregister(self._collector)
        self._collector = SnapshotCollector(self.state, self.pipeline.metric_specs())
        self.registry.register(self._collector)
        return self.pipeline

    def _serve(self, cfg: Config) -> WSGIServer:
        host, port = split_listen(cfg.http.listen)
        app = make_app(self.registry, _LiveRoutes(self), lambda: self.state.snapshot().generation)
        httpd, _thread = webconfig.serve(app, host, port, self.web, handler_class=_SilentHandler)
        return httpd

    def _install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self.signals.put(signum))

    def _loop(self) -> int:
        watchdog = self.notifier.watchdog_interval()
        tick = min(watchdog, 1.0) if watchdog else 1.0
        next_status = 0.0
        while True:
            try:
                signum = self.signals.get(timeout=tick)
            except queue.Empty:
                signum = 0
            if signum == signal.SIGTERM:
                log.info("SIGTERM: stopping")
                return 0
            if signum == signal.SIGINT:
                log.info("SIGINT: stopping")
                return 130
            if signum == signal.SIGHUP:
                self._reload()
            self._housekeeping(watchdog)
            now = self.clock.monotonic()
            if now >= next_status:
                assert self.pipeline is not None
                self.notifier.status(self.pipeline.summary())
                next_status = now + 10.0

    def _housekeeping(self, watchdog: float | None) -> None:
        assert self.pipeline is not None
        cfg = self.pipeline.cfg
        if self.services is not None:
            try:
                self.services.tick()
            except Exception:  # a bug here must not stop the watchdog or the loop
                log.exception("health tick")
        if watchdog:
            stale = self.pipeline.runner.stale(max(30.0, watchdog * 2))
            if stale:
                log.error("watchdog withheld: no progress from %s", ", ".join(stale))
            else:
                self.notifier.watchdog()
        if cfg.http.textfile:
            try:
                write_textfile(self.registry, cfg.http.textfile)
            except OSError as exc:
                log.warning("textfile %s: %s", cfg.http.textfile, exc)

    def _reload(self) -> None:
        log.info("SIGHUP: reloading %s", self.cfg_path or "(defaults)")
        self.notifier.reloading()
        assert self.pipeline is not None
        old = self.pipeline
        try:
            cfg = self.load_config()
        except ConfigError as exc:
            log.error("reload rejected, keeping the running config: %s", exc)
            self.notifier.ready(old.summary())
            return
        if cfg.http != old.cfg.http:
            log.warning("http settings changed: they take effect at the next restart")
            cfg = dataclasses.replace(cfg, http=old.cfg.http)
        logs.setup(cfg.daemon.log_level)
        old.stop()
        try:
            new = self._build(cfg)
        except ConfigError as exc:  # a source refused the new settings
            log.error("reload rejected, keeping the running config: %s", exc)
            new = self._build(old.cfg)
            new.start()
            self.notifier.ready(new.summary())
            return
        if self.services is not None:
            self.services.reconfigure(cfg)
        new.start()
        new.runner.wait_first_polls(FIRST_POLL_TIMEOUT)
        log.info("reloaded: %s", new.summary())
        self.notifier.ready(new.summary())

    def _shutdown(self) -> None:
        self.notifier.stopping()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        if self.pipeline is not None:
            self.pipeline.stop()
        if self.services is not None:
            self.services.stop()  # flushes alerts (bounded); the rest stays queued on disk
        log.info("stopped")


class _LiveRoutes(Mapping[str, Route]):
    """Routes of the current pipeline, so a reload swaps them under the server."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    def _routes(self) -> Mapping[str, Route]:
        p = self._daemon.pipeline
        return p.routes if p is not None else {}

    def __getitem__(self, key: str) -> Route:
        return self._routes()[key]

    def __iter__(self) -> Any:
        return iter(self._routes())

    def __len__(self) -> int:
        return len(self._routes())


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    """Poll `pred` until true or timeout (used by tools and tests)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()
