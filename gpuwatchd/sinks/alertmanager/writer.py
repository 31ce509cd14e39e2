"""The alert sink's writes, off the consumer thread.

The consumer hands each new alert set over in memory (`submit`) and goes
on. A writer thread applies the sets to the outbox in the order they came
(a commit that does not wait for the disk) and wakes the senders; a second
thread then syncs the outbox to disk, one fsync covering every commit
before it. So a slow disk delays neither the Xid pipeline nor a delivery:
an alert may reach Alertmanager before it is on disk, never after it was
forgotten, and nothing submitted is skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from gpuwatchd.sinks.alertmanager.outbox import Outbox

__all__ = ["AlertSet", "OutboxWriter"]

log = logging.getLogger("gpuwatchd.alertmanager")

AlertSet = list[tuple[dict[str, str], dict[str, str], float]]  # labels, annotations, startsAt


class OutboxWriter:
    """Applies submitted alert sets on its own thread and syncs them on another."""

    def __init__(
        self, outbox: Outbox, apply: Callable[[AlertSet, float], None], lock: threading.Lock
    ) -> None:
        self._outbox = outbox
        self._apply = apply
        self._lock = lock  # the sink's sync lock: one set applied at a time, in order
        self._inbox: deque[tuple[AlertSet, float]] = deque()
        self._submitted = threading.Event()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.syncs = 0
        self.slowest_sync = 0.0  # seconds

    def start(self, name: str) -> None:
        """Start the writer and the syncer threads."""
        for target, suffix in ((self._write_loop, "outbox"), (self._sync_loop, "fsync")):
            t = threading.Thread(target=target, name=f"{name}-{suffix}", daemon=True)
            self._threads.append(t)
            t.start()

    def submit(self, current: AlertSet, now: float) -> None:
        """Hand a new alert set over; applied at once when the threads do not run."""
        self._inbox.append((current, now))
        if self._threads and not self._stop.is_set():
            self._submitted.set()
            return
        self.drain()
        self.sync()

    def drain(self) -> None:
        """Apply every set submitted so far (from any thread), oldest first."""
        applied = False
        while True:
            with self._lock:  # pop and apply together: the order holds across threads
                try:
                    current, now = self._inbox.popleft()
                except IndexError:
                    break
                self._apply(current, now)
            applied = True
        if applied:
            self._dirty.set()

    def sync(self) -> None:
        """Put every commit so far on disk."""
        self._dirty.clear()
        start = time.monotonic()
        self._outbox.make_durable()
        self.syncs += 1
        self.slowest_sync = max(self.slowest_sync, time.monotonic() - start)

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            self._submitted.wait()
            self._submitted.clear()
            self._guarded(self.drain)

    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if not self._stop.is_set():
                self._guarded(self.sync)

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:
            log.exception("alert outbox %s", step.__name__)
            self._stop.wait(1.0)  # never a hot loop

    def stop(self, timeout: float, final_sync: bool = True) -> None:
        """Apply and sync what is left, then end the threads (within about `timeout`).

        `final_sync` False: the caller closes the database next, and that close's
        checkpoint syncs the log (one sync at stop, not two).
        """
        end = time.monotonic() + timeout
        self._stop.set()
        self._submitted.set()
        self._dirty.set()
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        self._threads = []
        self.drain()
        if final_sync:
            self.sync()
