"""Lifecycle: build the pipeline, serve HTTP, handle signals, talk to systemd.

Signal handlers only enqueue the signal number; the main loop waits on
that queue with a timeout and does all the lifecycle work (reload, stop,
watchdog, status) in one place. Health work (Xid stage, rules, store
writes, the 1 s tick) runs on the pipeline's consumer thread, not here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector

from gpuwatchd import __version__, config, logs
from gpuwatchd.app import Mode, assemble
from gpuwatchd.bootid import read_boot_id
from gpuwatchd.clock import Clock, SystemClock
from gpuwatchd.config import Config
from gpuwatchd.config.overrides import (
    NO_OVERRIDES,
    OVERRIDE_FLAGS,
    Overrides,
    apply_overrides,
    flag_error,
    node_name,
)
from gpuwatchd.errors import ConfigError, StoreError
from gpuwatchd.heap import release_startup_memory
from gpuwatchd.http import webconfig
from gpuwatchd.http.app import Route, json_route, make_app
from gpuwatchd.http.endpoints import healthz_route, status_document, summary_line
from gpuwatchd.http.server import WebServer, serve
from gpuwatchd.pipeline import SourceSet, source_names
from gpuwatchd.pipeline.daemon import Pipeline
from gpuwatchd.preflight import check_parsed_files
from gpuwatchd.runmarker import METRICS as RUN_METRICS
from gpuwatchd.runmarker import RunRecord, tighten_state_dir
from gpuwatchd.sinks.durability import StateDirLock
from gpuwatchd.sinks.prometheus import SnapshotCollector, write_textfile
from gpuwatchd.sources.nvml.rollup import nvlink_rollup
from gpuwatchd.state import State
from gpuwatchd.systemd import Notifier

__all__ = [
    "Daemon",
    "EX_CONFIG",
    "OVERRIDE_FLAGS",
    "Overrides",
    "apply_overrides",
    "flag_error",
    "load_checked",
    "split_listen",
]

log = logging.getLogger("gpuwatchd")

EX_CONFIG = 78
EX_SOFTWARE = 70  # a thread died of an uncaught exception
FIRST_POLL_TIMEOUT = 60.0
THREAD_DIED = -1  # on the signal queue: a thread's uncaught exception
DEATH_GRACE = 10.0  # seconds a stop after a thread death may take before os._exit


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def load_checked(
    path: str | None, overrides: Overrides = NO_OVERRIDES
) -> tuple[Config, webconfig.WebConfig | None]:
    """Every check `run` makes before it starts, all problems at once (`config check` too)."""
    errors: list[ConfigError] = []
    cfg = apply_overrides(config.read(path, errors), overrides)
    for check in (config.validate, check_parsed_files):
        try:
            check(cfg, path or "<defaults>")
        except ConfigError as exc:
            errors.append(flag_error(exc, overrides))
    web = None
    if cfg.http.web_config_file and not errors:
        try:
            web = webconfig.load(cfg.http.web_config_file)
        except ConfigError as exc:
            errors.append(exc)
    config.raise_all(errors)
    return cfg, web


def lock_state_dir(cfg: Config, source: str) -> StateDirLock:
    """Create and lock the state dir; ConfigError naming the dir (and the holder's pid)."""
    path = cfg.daemon.state_dir
    lock = StateDirLock(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        tighten_state_dir(path)
        holder = lock.acquire()
    except OSError as exc:
        raise ConfigError(
            source, "daemon.state_dir", f"cannot lock {path}: {exc.strerror}"
        ) from None
    if holder is not None:
        raise ConfigError(
            source,
            "daemon.state_dir",
            f"{path} is in use by another gpuwatchd (pid {holder or 'unknown'})",
        )
    return lock


class Wiring:
    """What one config builds: the sources and the routes over them and the pipeline."""

    def __init__(self, cfg: Config, state: State, clock: Clock, pipeline: Pipeline | None) -> None:
        self.cfg = cfg
        self.state = state
        self.pipeline = pipeline
        self.started = clock.time()
        self.sources = SourceSet(cfg, state, clock, pipeline)
        self.runner = self.sources.runner
        self.lifecycle: Callable[[], Mapping[str, Any]] = dict  # the daemon's run record
        self.routes: dict[str, Route] = {
            "/status": json_route(self.status),
            "/healthz": healthz_route(lambda: self.stale(self.cfg.http.healthz_stale_seconds)),
            **(pipeline.routes() if pipeline else {}),
        }

    def start(self, stopping: Callable[[], bool] = bool) -> None:
        self.sources.start(stopping)

    def stale(self, max_age: float) -> list[str]:
        """Source loops and the consumer thread that made no progress lately."""
        consumer = self.pipeline.stale(max_age) if self.pipeline else []
        return [*self.runner.stale(max_age), *consumer]

    def stop(self) -> None:
        self.sources.stop()

    def status(self, _query: Mapping[str, list[str]]) -> dict[str, Any]:
        extra = {**(self.pipeline.status() if self.pipeline else {}), **self.lifecycle()}
        return status_document(
            self.state.snapshot(),
            node=node_name(self.cfg),
            version=__version__,
            started=self.started,
            extra=extra,
        )

    def summary(self) -> str:
        return summary_line(self.state.snapshot(), len(self.sources.gpus()))


class Daemon:
    """The long-running process: `run()` returns the exit status."""

    def __init__(
        self,
        cfg_path: str | None,
        overrides: Overrides = NO_OVERRIDES,
        clock: Clock | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.cfg_path = cfg_path
        self.overrides = overrides
        self.clock = clock or SystemClock()
        self.notifier = notifier or Notifier()
        self.signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._stop_asked = False  # set by the signal handler: a stop during start-up
        self.state = State()
        self.wiring: Wiring | None = None
        self.httpd: WebServer | None = None
        # Not the global registry; process_* (CPU, RSS, fds) so the daemon's cost is watched too.
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        self._collector: SnapshotCollector | None = None
        self.web: webconfig.WebConfig | None = None
        self.pipeline: Pipeline | None = None
        self.lock: StateDirLock | None = None
        self.record: RunRecord | None = None
        self.clean = False  # set by a stop the next start need not report

    def load_config(self) -> Config:
        cfg, self.web = load_checked(self.cfg_path, self.overrides)
        return cfg

    def run(self) -> int:
        """Run until a signal stops it; an exception that escapes is logged, never silent."""
        hook = threading.excepthook
        try:
            return self._run()
        except ConfigError as exc:  # a part refused a setting while starting: one line, 78
            for line in str(flag_error(exc, self.overrides)).splitlines():
                log.error("%s", line)
            if self.record is not None:
                self.record.end_clean()  # said why; nothing for the next start to report
            return EX_CONFIG
        except Exception:
            self._died("main", traceback.format_exc())
            return EX_SOFTWARE
        finally:
            threading.excepthook = hook

    def _run(self) -> int:
        try:
            cfg = self.load_config()
        except ConfigError as exc:
            for line in str(exc).splitlines():  # one line per problem
                log.error("%s", line)
            return EX_CONFIG
        logs.setup(cfg.daemon.log_level)
        # Shorter GIL slices: a scrape must answer within 100 ms even while a source
        # thread parses a flood of kernel log lines (the default 5 ms slice lets one
        # CPU-bound thread hold the interpreter for most of a scrape).
        sys.setswitchinterval(0.0005)
        # The event store holds command lines and stacks: files for this user only, as
        # the unit's UMask=0077 makes them (the textfile sets its own 0644).
        os.umask(0o077)
        try:
            self.lock = lock_state_dir(cfg, self.cfg_path or "<defaults>")
        except ConfigError as exc:
            log.error("%s", flag_error(exc, self.overrides))
            return EX_CONFIG
        self.record = RunRecord(cfg.daemon.state_dir, read_boot_id(cfg.paths.boot_id))
        previous = self.record.begin(self.clock.time())
        if previous is not None:
            log.warning("%s", previous.describe())
        threading.excepthook = self._thread_died
        self._install_signals()
        try:
            self.pipeline = assemble(
                Mode.DAEMON,
                cfg,
                self.state,
                self.clock,
                node=node_name(cfg),
                listen_port=split_listen(cfg.http.listen)[1],
                source_names=source_names(cfg),
            )
        except StoreError as exc:
            log.error("%s", exc)
            return 1
        if previous is not None:
            self.pipeline.store.write([(previous.event(self.clock.time()), "", 1)])
        self.state.publish_extra("lifecycle", self.record.samples())
        wiring = self._build(cfg)
        try:
            self.httpd = self._serve(cfg)
        except OSError as exc:
            log.error("cannot listen on %s: %s", cfg.http.listen, exc.strerror or exc)
            self.pipeline.stop()
            self.record.end_clean()  # said why in the log; nothing for the next start
            return 1
        self.pipeline.start()
        wiring.start(lambda: self._stop_asked)
        # A stop during start-up (a first poll that blocks) is acted on at once, not after it.
        first = wiring.runner.wait_first_polls
        got = self._wait_unless_stopped(lambda: first(0.25), FIRST_POLL_TIMEOUT)
        if got == "late":
            log.warning("some sources did not finish a first poll in %.0fs", FIRST_POLL_TIMEOUT)
        if got != "stopped":  # READY=1: the first polls are evaluated too, not only queued
            pipeline = self.pipeline
            got = self._wait_unless_stopped(lambda: pipeline.wait_idle(0.25), FIRST_POLL_TIMEOUT)
            if got == "late":
                log.warning("the consumer did not catch up in %.0fs", FIRST_POLL_TIMEOUT)
        if got != "stopped":
            host, port = self.httpd.server_address[:2]
            log.info(
                "gpuwatchd %s serving on %s:%s (%s)", __version__, host, port, wiring.summary()
            )
            release_startup_memory()
            self.notifier.ready(wiring.summary())
        try:
            return self._loop()
        finally:
            self._shutdown()

    # --- internals -----------------------------------------------------------

    def _build(self, cfg: Config) -> Wiring:
        self.wiring = Wiring(cfg, self.state, self.clock, self.pipeline)
        if self.record is not None:
            self.wiring.lifecycle = self.record.status
        if self._collector is not None:
            self.registry.unregister(self._collector)
        specs = [*SourceSet.metric_specs(with_consumers=self.pipeline is not None), *RUN_METRICS]
        rollup = nvlink_rollup() if cfg.sources.nvml.nvlink_detail == "gpu" else None
        self._collector = SnapshotCollector(self.state, specs, transform=rollup)
        self.registry.register(self._collector)
        return self.wiring

    def _serve(self, cfg: Config) -> WebServer:
        host, port = split_listen(cfg.http.listen)
        app = make_app(self.registry, _LiveRoutes(self), lambda: self.state.snapshot().generation)
        httpd, _thread = serve(app, host, port, self.web)
        return httpd

    def _install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self._on_signal(signum))

    def _on_signal(self, signum: int) -> None:
        self._stop_asked = self._stop_asked or signum != signal.SIGHUP  # one assignment
        self.signals.put(signum)

    def _loop(self) -> int:
        watchdog = self.notifier.watchdog_interval()
        assert self.wiring is not None
        # Signals end the wait at once; between them only the watchdog and the textfile
        # want a 1 s beat (http settings, the textfile among them, need a restart).
        if watchdog:
            tick = min(watchdog, 1.0)
        else:
            tick = 1.0 if self.wiring.cfg.http.textfile else 10.0
        next_status = 0.0
        while True:
            try:
                # a run marker the disk refused is retried every second until written
                wait = 1.0 if self.record is not None and self.record.marker_problem else tick
                signum = self._next_signal(self.signals.get(timeout=min(tick, wait)))
            except queue.Empty:
                signum = 0
            if signum == THREAD_DIED:
                log.error("stopping: a thread died (exit %d)", EX_SOFTWARE)
                return EX_SOFTWARE
            if signum == signal.SIGTERM:
                log.info("SIGTERM: stopping")
                self.clean = True
                return 0
            if signum == signal.SIGINT:
                log.info("SIGINT: stopping")
                self.clean = True
                return 130
            if signum == signal.SIGHUP:
                self._reload()
            self._housekeeping(watchdog)
            now = self.clock.monotonic()
            if now >= next_status:
                assert self.wiring is not None
                self.notifier.status(self.wiring.summary())
                next_status = now + 10.0

    def _next_signal(self, first: int) -> int:
        """The signal to act on now: a stop wins over reloads, pending reloads are one."""
        pending = {first}
        while True:
            try:
                pending.add(self.signals.get_nowait())
            except queue.Empty:
                break
        for signum in (THREAD_DIED, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if signum in pending:
                return signum
        return 0

    def _wait_unless_stopped(self, done: Callable[[], bool], timeout: float) -> str:
        """Wait for `done()` (which waits briefly) up to `timeout`, but not past a stop:
        "done", "late" (the timeout passed) or "stopped" (a stop is queued for the loop)."""
        end = self.clock.monotonic() + timeout
        while not done():
            pending = self._next_signal(0)
            if pending:
                self.signals.put(pending)  # the loop acts on it next
                if pending != signal.SIGHUP:
                    return "stopped"
            if self.clock.monotonic() >= end:
                return "late"
        return "done"

    def _housekeeping(self, watchdog: float | None) -> None:
        assert self.wiring is not None
        cfg = self.wiring.cfg
        if self.record is not None:
            self.record.retry_marker()  # a disk that was full at start
        if watchdog:
            # Both halves must move: a source loop that hangs, or a consumer stuck on disk.
            stale = self.wiring.stale(max(30.0, watchdog * 2))
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
        assert self.wiring is not None
        old = self.wiring
        try:
            cfg = self.load_config()
        except ConfigError as exc:
            log.error("reload rejected, keeping the running config: %s", exc)
            self.notifier.ready(old.summary())
            return
        if cfg.http != old.cfg.http:
            log.warning("http settings changed: they take effect at the next restart")
            cfg = dataclasses.replace(cfg, http=old.cfg.http)
        if cfg.daemon.state_dir != old.cfg.daemon.state_dir:
            # The lock, the store, the outboxes and the run marker live there.
            log.warning(
                "daemon.state_dir changed: it takes effect at the next restart (keeping %s)",
                old.cfg.daemon.state_dir,
            )
            daemon = dataclasses.replace(cfg.daemon, state_dir=old.cfg.daemon.state_dir)
            cfg = dataclasses.replace(cfg, daemon=daemon)
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
        if self.pipeline is not None:
            self.pipeline.reconfigure(cfg)
        new.start()
        self._wait_unless_stopped(lambda: new.runner.wait_first_polls(0.1), FIRST_POLL_TIMEOUT)
        if self.pipeline is not None:
            self.pipeline.wait_idle(FIRST_POLL_TIMEOUT)
        log.info("reloaded: %s", new.summary())
        self.notifier.ready(new.summary())

    def _shutdown(self) -> None:
        self.notifier.stopping()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        if self.wiring is not None:
            self.wiring.stop()
        if self.pipeline is not None:
            self.pipeline.stop()  # flushes alerts (bounded); the rest stays queued on disk
        if self.record is not None and self.clean:
            self.record.end_clean()
        if self.lock is not None:
            self.lock.release()
        log.info("stopped")

    def _thread_died(self, args: threading.ExceptHookArgs) -> None:
        """threading.excepthook: a thread that dies stops the daemon, non-zero, with its trace."""
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        text = "".join(
            traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
        )
        self._died(name, text)
        self.signals.put(THREAD_DIED)
        # The clean stop gets DEATH_GRACE; then the process ends regardless, non-zero.
        timer = threading.Timer(DEATH_GRACE, _exit_now, (EX_SOFTWARE,))
        timer.daemon = True
        timer.start()

    def _died(self, thread: str, text: str) -> None:
        """Log an uncaught exception and keep it in the fault log for the next start."""
        log.critical("thread %s died of an uncaught exception:\n%s", thread, text.rstrip())
        if self.record is not None:
            self.record.fault(f"thread {thread} died of an uncaught exception:\n{text}")


def _exit_now(code: int) -> None:
    log.critical("the stop after a thread death did not finish in %.0fs: exiting", DEATH_GRACE)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


class _LiveRoutes(Mapping[str, Route]):
    """Routes of the current pipeline, so a reload swaps them under the server."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    def _routes(self) -> Mapping[str, Route]:
        w = self._daemon.wiring
        return w.routes if w is not None else {}

    def __getitem__(self, key: str) -> Route:
        return self._routes()[key]

    def __iter__(self) -> Any:
        return iter(self._routes())

    def __len__(self) -> int:
        return len(self._routes())
