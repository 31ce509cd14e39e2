"""A small pool of threads that run complete requests through the WSGI app.

Threads start when work comes and no thread is free, up to `size`; they
wait on a condition while idle, so an idle pool never wakes. The queue is
bounded: when it is full `submit()` says no and the server answers 503.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

__all__ = ["WorkerPool"]

Job = Callable[[], None]


class WorkerPool:
    """Runs jobs on at most `size` threads, with at most `max_queued` waiting."""

    def __init__(self, size: int, max_queued: int, name: str = "http-worker") -> None:
        self.size = size
        self.max_queued = max_queued
        self.name = name
        self._cond = threading.Condition()
        self._jobs: deque[Job] = deque()
        self._threads = 0
        self._idle = 0
        self._stopped = False

    def submit(self, job: Job) -> bool:
        """Queue `job`; False (and nothing queued) when the queue is full or stopped."""
        with self._cond:
            if self._stopped or len(self._jobs) >= self.max_queued:
                return False
            self._jobs.append(job)
            if self._idle > len(self._jobs) - 1:
                self._cond.notify()
                return True
            if self._threads < self.size:
                try:
                    threading.Thread(target=self._work, name=self.name, daemon=True).start()
                    self._threads += 1
                except RuntimeError:  # no thread to be had: a running one takes it later
                    if self._threads == 0:
                        self._jobs.pop()
                        return False
            return True

    def stop(self) -> None:
        """Idle threads exit; queued jobs are dropped."""
        with self._cond:
            self._stopped = True
            self._jobs.clear()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopped:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if self._stopped:
                    self._threads -= 1
                    return
                job = self._jobs.popleft()
            job()  # jobs catch their own errors
