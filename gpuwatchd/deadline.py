"""Run blocking calls with a deadline, one worker thread per key.

NVML calls can block forever on a sick GPU and a thread in C code cannot
be interrupted. So each GPU gets its own worker thread: a call that
overruns its deadline is abandoned (its late result discarded) and the
key is marked stuck; later calls for that key fail at once until the hung
call returns, which frees the worker again (node_exporter's stuckMounts).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from gpuwatchd.errors import CallTimeout, StuckError

__all__ = ["CallTimeout", "DeadlineRunner", "StuckError"]

T = TypeVar("T")


class _Worker:
    def __init__(self, key: str) -> None:
        self.key = key
        self.busy_since: float | None = None
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name=f"call-{key}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._q.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._q.put(None)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller, never lost
                fut.set_exception(exc)


class DeadlineRunner:
    """Calls `fn` on the worker for `key` and waits at most `timeout` seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._stuck: dict[str, Future[Any]] = {}

    def call(self, key: str, fn: Callable[[], T], timeout: float) -> T:
        with self._lock:
            hung = self._stuck.get(key)
            if hung is not None and not hung.done():
                raise StuckError(key)
            self._stuck.pop(key, None)
            worker = self._workers.get(key)
            if worker is None:
                worker = self._workers[key] = _Worker(key)
        fut = worker.submit(fn)
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            with self._lock:
                self._stuck[key] = fut
            raise CallTimeout(key) from None

    def is_stuck(self, key: str) -> bool:
        with self._lock:
            fut = self._stuck.get(key)
            return fut is not None and not fut.done()

    def stuck_keys(self) -> list[str]:
        with self._lock:
            return sorted(k for k, f in self._stuck.items() if not f.done())

    def close(self) -> None:
        with self._lock:
            for w in self._workers.values():
                w.stop()
            self._workers.clear()
