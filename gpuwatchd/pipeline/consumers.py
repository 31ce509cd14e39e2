"""The consumer chain, without a thread or sinks: what `check` runs one-shot.

`Consumers` is the Xid stage then the health engine (the daemon's `Pipeline`
adds the hang monitor, the slowdown detector, the consumer thread and the
sinks). `StoreReader` is the daemon's event store as `check` reads it, never
written. This module loads no sink and no HTTP: `check` imports it, and every
module it pulls in is start-up time of a one-shot command.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.errors import GpuwatchdError, StoreError
from gpuwatchd.health import engine as engine_mod
from gpuwatchd.health.engine import HealthEngine
from gpuwatchd.health.xid.stage import XidStage
from gpuwatchd.model import Clear, Event
from gpuwatchd.sinks.store import DB_NAME, EventStore
from gpuwatchd.sources import enabled, registry
from gpuwatchd.state import Publish, PublishQueue, State

if TYPE_CHECKING:
    from gpuwatchd.hangs.monitor import HangMonitor
    from gpuwatchd.health.slowdowns.monitor import SlowdownMonitor

__all__ = [
    "Consumers",
    "StoreReader",
    "one_shot_config",
    "open_store_reader",
    "source_names",
]

log = logging.getLogger("gpuwatchd")


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
    path = os.path.join(cfg.daemon.state_dir, DB_NAME)
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
