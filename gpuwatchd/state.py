"""The latest immutable snapshot of everything the daemon knows.

Writers (source threads, the health engine) build a new `NodeSnapshot`
and swap one reference under a short lock; readers (a scrape, /status)
take the reference and never wait on a source. Nothing that can block
(NVML, disk) ever runs while the lock is held.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from gpuwatchd.model import Event, Finding, Sample, SourceSnapshot

__all__ = ["NodeSnapshot", "State"]

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
        """Call `listener` after every source publish (in the publishing thread)."""
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

    def publish_extra(self, owner: str, samples: Iterable[Sample]) -> None:
        """Samples from a producer that is not a polled source (health, alerts)."""
        frozen = tuple(samples)
        with self._lock:
            extra = dict(self._snap.extra)
            extra[owner] = frozen
            self._snap = replace(
                self._snap, extra=MappingProxyType(extra), generation=self._snap.generation + 1
            )

    def set_findings(self, findings: Iterable[Finding]) -> None:
        frozen = tuple(findings)
        with self._lock:
            self._snap = replace(self._snap, findings=frozen, generation=self._snap.generation + 1)
