"""One thread per source: poll, publish, wait; heartbeats for the watchdog."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuwatchd.clock import Clock
from gpuwatchd.errors import SourceError
from gpuwatchd.model import Event, Sample, SourceSnapshot
from gpuwatchd.sources import PayloadSource, Source
from gpuwatchd.state import State

__all__ = ["Runner"]

log = logging.getLogger("gpuwatchd.sources.runner")


@dataclass
class _Slot:
    source: Source
    wake: threading.Event
    thread: threading.Thread | None = None
    heartbeat: float = 0.0  # monotonic time the loop last made progress
    polls: int = 0
    last_success: float = 0.0
    errors: dict[str, int] | None = None
    last_error: str = ""


class Runner:
    """Drives every source on its own daemon thread.

    A source that raises is recorded as failed for that poll and polled
    again next interval; nothing a source does can stop another source.
    """

    def __init__(self, sources: Sequence[Source], state: State, clock: Clock) -> None:
        self._state = state
        self._clock = clock
        self._stop = threading.Event()
        self._slots = {s.name: _Slot(s, threading.Event(), errors={}) for s in sources}
        # A source that reads another's payload (`follows`: the workloads read NVML's
        # processes) polls right after each of its polls, not on a timer of its own that
        # may run just before (a new process named one interval late, or two).
        self._followers: dict[str, list[str]] = {}
        for s in sources:
            leader = getattr(s, "follows", "")
            if leader:
                self._followers.setdefault(leader, []).append(s.name)
        self._first = threading.Condition()

    @property
    def sources(self) -> list[Source]:
        return [slot.source for slot in self._slots.values()]

    def start(
        self,
        first: Sequence[str] = (),
        first_timeout: float = 0.0,
        stopping: Callable[[], bool] = bool,
    ) -> None:
        """Start every source loop; those in `first` start alone and get up to
        `first_timeout` seconds to finish a poll before the others start (less when
        `stopping()` turns true: a stop asked for during start-up).

        The NVML source goes first so that events the kernel log replays at
        start-up already find the bus id -> GPU index map.
        """
        early = [n for n in first if n in self._slots]
        for name in early:
            self._spawn(name)
        if early and not self._wait(early, first_timeout, stopping) and not stopping():
            log.warning(
                "%s did not finish a first poll in %.0fs; starting the others",
                ", ".join(early),
                first_timeout,
            )
        for name in self._slots:
            if name not in early:
                self._spawn(name)

    def _spawn(self, name: str) -> None:
        slot = self._slots[name]
        slot.heartbeat = self._clock.monotonic()
        slot.thread = threading.Thread(
            target=self._loop, args=(slot,), name=f"source-{name}", daemon=True
        )
        slot.thread.start()

    def poll_once(self, name: str) -> SourceSnapshot:
        """Poll one source in the caller's thread (used by --once and `check`)."""
        return self._poll(self._slots[name])

    def nudge(self, name: str) -> None:
        """Poll `name` now instead of at its next interval (udev events)."""
        slot = self._slots.get(name)
        if slot is not None:
            slot.wake.set()

    def wait_first_polls(self, timeout: float) -> bool:
        """Wait until each source has polled once; False if some did not in time."""
        return self._wait(list(self._slots), timeout)

    def _wait(
        self, names: Sequence[str], timeout: float, stopping: Callable[[], bool] = bool
    ) -> bool:
        deadline = self._clock.monotonic() + timeout
        with self._first:
            while any(self._slots[n].polls == 0 for n in names):
                left = deadline - self._clock.monotonic()
                if left <= 0 or stopping():
                    return False
                self._first.wait(min(left, 0.5))
        return True

    def stale(self, max_age: float) -> list[str]:
        """Sources whose loop made no progress for longer than their interval + max_age."""
        now = self._clock.monotonic()
        return [
            name
            for name, slot in self._slots.items()
            if now - slot.heartbeat > slot.source.interval + max_age
        ]

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        for slot in self._slots.values():
            slot.wake.set()
            interrupt = getattr(slot.source, "interrupt", None)  # a source blocked in poll()
            if interrupt is not None:
                try:
                    interrupt()
                except Exception:
                    log.exception("interrupting source %s", slot.source.name)
        for slot in self._slots.values():
            if slot.thread is not None:
                slot.thread.join(timeout)
        for slot in self._slots.values():
            try:
                slot.source.close()
            except Exception:
                log.exception("closing source %s", slot.source.name)

    def _loop(self, slot: _Slot) -> None:
        while not self._stop.is_set():
            started = self._clock.monotonic()
            self._poll(slot)
            elapsed = self._clock.monotonic() - started
            slot.wake.wait(max(0.0, slot.source.interval - elapsed))
            slot.wake.clear()

    def _poll(self, slot: _Slot) -> SourceSnapshot:
        source = slot.source
        t0 = self._clock.monotonic()
        now = self._clock.time()
        ok, error = True, ""
        items: Sequence[Sample | Event] = ()
        try:
            items = source.poll(now)
        except SourceError as exc:
            ok, error = False, exc.reason
            if error != slot.last_error:  # once per change, not every interval
                log.warning("source %s failed: %s", source.name, exc)
        except Exception as exc:  # a bug in a source must not kill its thread
            ok, error = False, "exception"
            log.exception("source %s raised %s", source.name, type(exc).__name__)
        if ok and slot.last_error:
            log.info("source %s recovered", source.name)
        slot.last_error = error
        duration = self._clock.monotonic() - t0
        if ok:
            slot.last_success = now
        else:
            assert slot.errors is not None
            slot.errors[error] = slot.errors.get(error, 0) + 1
        try:
            status = dict(source.status())
        except Exception:
            log.exception("source %s status()", source.name)
            status = {}
        payload = None
        if isinstance(source, PayloadSource):
            try:
                payload = source.payload()
            except Exception:
                log.exception("source %s payload()", source.name)
        snap = SourceSnapshot(
            source=source.name,
            samples=tuple(i for i in items if isinstance(i, Sample)),
            ok=ok,
            error=error,
            timestamp=now,
            duration_seconds=duration,
            last_success=slot.last_success,
            status=status,
            payload=payload,
            monotonic=t0,
            errors_by_reason=dict(slot.errors or {}),
        )
        events = tuple(i for i in items if isinstance(i, Event))
        try:
            self._state.publish(snap, events)
        except Exception:
            log.exception("publishing %s", source.name)
        for name in self._followers.get(source.name, ()):
            self.nudge(name)
        slot.heartbeat = self._clock.monotonic()
        with self._first:
            slot.polls += 1
            self._first.notify_all()
        return snap
