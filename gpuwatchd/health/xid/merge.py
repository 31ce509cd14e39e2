"""One Xid, two witnesses: merge NVML's Xid event with the kernel log's report.

NVML's nvmlEventTypeXidCriticalError carries the code and the GPU but no
text; the kernel line carries pid, process and detail. When both report
the same Xid on the same GPU within a short window, one event goes on,
the kernel log's. NVML events wait `hold` seconds for their log line;
log events go on at once (NVML reported about 1.6 s after the fault on a
real H200, the log line comes first).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from gpuwatchd.model import Event
from gpuwatchd.pci import normalize_bus_id

__all__ = ["XidMerger", "richer", "same_report"]


def _gpu(ev: Event) -> tuple[str, str]:
    # NVML says 00000000:06:00.0, the driver's line PCI:0000:06:00: compare one form
    bus = normalize_bus_id(ev.pci_bus_id) if ev.pci_bus_id else ""
    return bus or ev.pci_bus_id, ev.xid.uuid if ev.xid is not None else ""


def same_report(a: Event, b: Event, window: float) -> bool:
    """Both events describe one Xid: same kind and code, same GPU, close in time."""
    if a.kind != b.kind or a.code != b.code or abs(a.time - b.time) > window:
        return False
    (bus_a, uuid_a), (bus_b, uuid_b) = _gpu(a), _gpu(b)
    if bus_a and bus_b:
        return bus_a == bus_b
    return bool(uuid_a) and uuid_a == uuid_b


def richer(log_event: Event, nvml_event: Event) -> Event:
    """The kernel log's event, completed with what only NVML knew (e.g. the UUID)."""
    fields = log_event.xid
    if fields is None:
        return log_event
    fields = replace(fields.filled_from(nvml_event.xid), confirmed_by=nvml_event.source)
    return replace(
        log_event, pci_bus_id=log_event.pci_bus_id or nvml_event.pci_bus_id, payload=fields
    )


class XidMerger:
    """Streams Xid events from any source, dropping NVML duplicates of log reports.

    `offer(event, now)` returns the events to pass on now; `due(now)`
    releases NVML events whose log line did not come within `hold`.
    `now` is a monotonic time; event times are compared with `window`.
    """

    def __init__(self, window: float = 10.0, hold: float = 2.0, nvml_source: str = "nvml") -> None:
        self.window = window
        self.hold = hold
        self.nvml_source = nvml_source
        self._held: list[tuple[float, Event]] = []
        self._recent: deque[Event] = deque(maxlen=4096)  # log reports already passed on
        self.merged = 0

    def offer(self, event: Event, now: float) -> list[Event]:
        if event.kind != "xid" or self.window <= 0:
            return [event]
        if event.source == self.nvml_source:
            if any(same_report(seen, event, self.window) for seen in self._recent):
                self.merged += 1
                return []
            self._held.append((now + self.hold, event))
            return self.due(now)
        for i, (_, held) in enumerate(self._held):
            if same_report(event, held, self.window):
                del self._held[i]
                self.merged += 1
                event = richer(event, held)
                break
        self._recent.append(event)
        return [event]

    def due(self, now: float) -> list[Event]:
        """NVML events that waited long enough for a log line that did not come."""
        ready = [ev for until, ev in self._held if until <= now]
        if ready:
            self._held = [(until, ev) for until, ev in self._held if until > now]
        return ready
