"""The latest immutable snapshot of everything the daemon knows.

Writers (source threads, the consumer thread) build a new `NodeSnapshot`
and swap one reference under a short lock; readers (a scrape, /status)
take the reference and never wait on a source. Nothing that can block
(NVML, disk) ever runs while the lock is held.

`PublishQueue` carries source publishes to the one consumer thread: the
latest snapshot of each source wins, events are never dropped.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from gpuwatchd.model import Event, Finding, Sample, SourceSnapshot

__all__ = ["NodeSnapshot", "Publish", "PublishQueue", "State"]

Listener = Callable[["NodeSnapshot", SourceSnapshot | None, tuple[Event, ...]], None]


@dataclass(frozen=True)
class NodeSnapshot:
    """What every sink reads. `extra` holds samples from non-source producers."""

    sources: Mapping[str, SourceSnapshot] = field(default_factory=dict)
    extra: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    findings: tuple[Finding, ...] = ()
    generation: int = 0

    def samples(self) -> Iterable[Sample]:
        for snap in self.sources.values():
            yield from snap.samples
        for group in self.extra.values():
            yield from group


class State:
    """Holder of the current NodeSnapshot plus a bounded list of recent events."""

    def __init__(self, max_events: int = 1000) -> None:
        self._lock = threading.Lock()
        self._snap = NodeSnapshot()
        self._events: deque[Event] = deque(maxlen=max_events)
        self._listeners: list[Listener] = []

    def snapshot(self) -> NodeSnapshot:
        return self._snap  # a single reference read: atomic, never blocks

    def subscribe(self, listener: Listener) -> None:
        """Call `listener` after every source publish, in the publishing thread.

        A listener must not block: the daemon's only one is `PublishQueue.offer`.
        """
        self._listeners.append(listener)

    def publish(self, snap: SourceSnapshot, events: Iterable[Event] = ()) -> NodeSnapshot:
        new_events = tuple(events)
        with self._lock:
            self._events.extend(new_events)
            sources = dict(self._snap.sources)
            sources[snap.source] = snap
            self._snap = replace(
                self._snap,
                sources=MappingProxyType(sources),
                events=tuple(self._events),
                generation=self._snap.generation + 1,
            )
            current = self._snap
        for listener in list(self._listeners):
            listener(current, snap, new_events)
        return current

    def publish_extra(self, owner: str, samples: Iterable[Sample]) -> bool:
        """Samples from a producer that is not a polled source (health, alerts).

        The same samples as before publish nothing (False): producers publish on
        every 1 s tick, and an unchanged publish would only bump the generation
        and void the scrape cache. This is the one place that check lives.
        """
        frozen = tuple(samples)
        with self._lock:
            if self._snap.extra.get(owner) == frozen:
                return False
            extra = dict(self._snap.extra)
            extra[owner] = frozen
            self._snap = replace(
                self._snap, extra=MappingProxyType(extra), generation=self._snap.generation + 1
            )
        return True

    def set_findings(self, findings: Iterable[Finding]) -> bool:
        """The open findings; the same ones as before change nothing (False)."""
        frozen = tuple(findings)
        with self._lock:
            if self._snap.findings == frozen:
                return False
            self._snap = replace(self._snap, findings=frozen, generation=self._snap.generation + 1)
        return True


@dataclass(frozen=True)
class Publish:
    """What the consumer thread takes: a source's latest snapshot and every event since."""

    source: SourceSnapshot
    events: tuple[Event, ...]
    seq: int  # of the newest publish folded in


class PublishQueue:
    """Source publishes waiting for the consumer thread, one entry per source.

    Bounded by the number of sources: a publish for a source that is still
    waiting replaces its snapshot (only the latest matters) and appends its
    events (none is dropped). Entries keep the order of their first arrival.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[str, Publish] = {}
        self._offered = 0
        self._done = 0
        self._closed = False
        self._woken = False
        self.coalesced = 0  # publishes folded into one still waiting

    def offer(
        self, _snap: NodeSnapshot, source: SourceSnapshot | None, events: tuple[Event, ...]
    ) -> None:
        """State listener: enqueue and return at once (runs in the source thread)."""
        if source is None:
            return
        with self._cond:
            self._offered += 1
            prev = self._pending.get(source.source)
            if prev is not None:
                self.coalesced += 1
                events = prev.events + events
            self._pending[source.source] = Publish(source, events, self._offered)
            self._cond.notify_all()

    def take(self, timeout: float) -> list[Publish]:
        """Everything waiting, oldest source first; [] after `timeout` or once closed."""
        with self._cond:
            if not self._pending and not self._closed and not self._woken:
                self._cond.wait(timeout)
            batch = list(self._pending.values())
            self._pending.clear()
            return batch

    def wake(self) -> None:
        """End the consumer's wait without a publish: a findings provider changed on a
        thread of its own (a hang decided on the probe thread), so its alert leaves now
        rather than at the next tick."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def woken(self) -> bool:
        """Whether `wake` was called since the last call (it clears the flag)."""
        with self._cond:
            woken, self._woken = self._woken, False
            return woken

    def done(self, seq: int) -> None:
        """The consumer finished every publish up to `seq`."""
        with self._cond:
            self._done = max(self._done, seq)
            self._cond.notify_all()

    def wait_drained(self, timeout: float) -> bool:
        """Wait until every publish offered so far is consumed; False on timeout."""
        with self._cond:
            target = self._offered
            return self._cond.wait_for(lambda: self._done >= target or self._closed, timeout)

    def depth(self) -> int:
        """Sources with a publish waiting."""
        with self._cond:
            return len(self._pending)

    def close(self) -> None:
        """Wake the consumer so it can stop; later offers still queue (drained on stop)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
