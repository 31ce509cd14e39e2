"""NVML Xid events on a thread of their own, handed to the NVML source's next poll.

NVML's event API needs no kernel log access, so it still reports Xids in a
container that cannot read /dev/kmsg or the journal. `nvmlEventSetWait`
blocks, so it runs on its own daemon thread; each event is queued and the
source is nudged to poll at once, so the event is published within about a
second. The Xid pipeline merges it with the kernel log's report of the same
Xid and keeps the richer log record.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from gpuwatchd.errors import NvmlError
from gpuwatchd.model import Event, Severity, XidFields
from gpuwatchd.sources.nvml.client import XidEventSet

__all__ = ["XidListener"]

log = logging.getLogger("gpuwatchd.nvml")

# An event ends the wait at once, but nothing else does: freeing the set waits
# for a wait in flight (measured on H200: `check` spent 5.1 s in nvmlEventSetFree
# behind a 5 s wait). So the thread waits in short slices and looks at its stop
# flag between them; a slice's timeout costs one wake-up and one exception.
WAIT_SECONDS = 1.0
# How long close() waits for the thread before giving up on freeing the set: a
# wait hung in a sick driver must not hang the daemon's stop.
CLOSE_SECONDS = 2 * WAIT_SECONDS + 0.5


class XidListener:
    """Waits on an XidEventSet; `drain()` returns the events as model Events."""

    def __init__(self, events: XidEventSet, nudge: Callable[[], None]) -> None:
        self._events = events
        self._nudge = nudge
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name="nvml-xid-events", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                ev = self._events.wait(WAIT_SECONDS)
            except NvmlError as exc:
                # GPU lost or NVML gone: the source's poll reports that; back off here.
                self.errors += 1
                log.debug("NVML event wait failed: %s", exc.code)
                self._stop.wait(5.0)
                continue
            except Exception:  # never let a driver surprise kill the thread silently
                self.errors += 1
                log.exception("NVML event wait")
                self._stop.wait(5.0)
                continue
            if ev is None:
                continue
            self._queue.put(
                Event(
                    kind="xid",
                    source="nvml",
                    time=ev.time,
                    code=ev.code,
                    pci_bus_id=ev.pci_bus_id,
                    message=f"Xid {ev.code} reported by NVML's event API",
                    severity=Severity.WARNING,
                    payload=XidFields(code=ev.code, uuid=ev.uuid, via="nvml_event"),
                )
            )
            self._nudge()

    def drain(self) -> list[Event]:
        out: list[Event] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Stop the thread within about one wait slice, then free the set."""
        self._stop.set()
        self._thread.join(CLOSE_SECONDS)
        if self._thread.is_alive():
            # Freeing now would block behind the hung wait; the process exit frees it.
            log.warning("NVML event wait did not return within %.1fs; set left open", CLOSE_SECONDS)
            return
        try:
            self._events.close()
        except NvmlError as exc:
            log.debug("NVML event set free failed: %s", exc.code)
