"""NCCL RAS polled for every distributed job on a slow cadence, off the consumer thread.

Hazards designed around (NCCL's issue tracker): a RAS query while communicators
start crashed jobs on NCCL 2.26.2, so a job is first asked once every rank's GPUs
did real work (it trained: its communicators are up), or else `startup_grace_seconds`
after its youngest rank started; stray traffic on the port crashed ranks, so
only the documented protocol is spoken, once per job and cadence, never two
queries in flight for one job; every query has a deadline. A job under
suspicion (a rank gone, counts flat) is asked every `ras_urgent_interval_seconds`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from gpuwatchd.health.hangs.ras_view import RasView
from gpuwatchd.jobview import JobView, RasAnswer, RasError

__all__ = ["RasPoller"]

log = logging.getLogger("gpuwatchd.hangs")

RasFn = Callable[[JobView], RasAnswer]


class RasPoller:
    """Latest RAS answer per job; queries run on a small pool (or inline: `workers=0`)."""

    def __init__(self, query: RasFn, workers: int = 2) -> None:
        self._query = query
        self._pool = ThreadPoolExecutor(workers, "hang-ras") if workers > 0 else None
        self._lock = threading.Lock()
        self._views: dict[str, RasView] = {}
        self._answers: dict[str, RasAnswer] = {}
        self._asked: dict[str, float] = {}
        self._first_seen: dict[str, float] = {}
        self._in_flight: set[str] = set()
        self.queries = 0
        self.failures = 0

    def set_query(self, query: RasFn) -> None:
        """A new query function (reload)."""
        self._query = query

    def poll(
        self,
        jobs: Iterable[JobView],
        now: float,
        *,
        interval: float,
        urgent_interval: float,
        grace: float,
        urgent: Iterable[str] = (),
        started: Iterable[str] = (),
    ) -> None:
        """Ask every due job's RAS service (non-blocking with a pool).

        `started`: jobs known to be past NCCL start-up (their GPUs worked): no grace.
        """
        hurry, proven = set(urgent), set(started)
        current = set()
        for job in jobs:
            current.add(job.job)
            first = self._first_seen.setdefault(job.job, now)
            alive = [r for r in job.ranks if r.alive]
            if not alive or ((job.world_size or 1) <= 1 and len(job.ranks) <= 1):
                continue
            ages = [r.age_seconds for r in alive]
            youngest = min((a for a in ages if a is not None), default=now - first)
            if youngest < grace and job.job not in proven:
                continue
            every = urgent_interval if job.job in hurry else interval
            with self._lock:
                if job.job in self._in_flight or now - self._asked.get(job.job, -1e18) < every:
                    continue
                self._in_flight.add(job.job)
                self._asked[job.job] = now
            if self._pool is None:
                self._ask(job, now)
            else:
                self._pool.submit(self._ask, job, now)
        with self._lock:
            for gone in set(self._first_seen) - current:
                self._first_seen.pop(gone, None)
                self._asked.pop(gone, None)
                self._views.pop(gone, None)
                self._answers.pop(gone, None)

    def _ask(self, job: JobView, now: float) -> None:
        try:
            answer = self._query(job)
            view = RasView(now, answer.report)
        except RasError as e:
            answer, view = None, RasView(now, None, str(e))
        except Exception as e:  # a bug must not leave the job marked in flight
            log.exception("RAS query of job %s", job.job)
            answer, view = None, RasView(now, None, str(e))
        with self._lock:
            self.queries += 1
            self.failures += answer is None
            self._in_flight.discard(job.job)
            if job.job in self._first_seen:
                self._views[job.job] = view
                if answer is not None:
                    self._answers[job.job] = answer

    def views(self) -> dict[str, RasView]:
        """The latest answer of each job."""
        with self._lock:
            return dict(self._views)

    def answer(self, job: str, newer_than: float) -> RasAnswer | None:
        """The job's latest successful answer if it was asked after `newer_than`."""
        with self._lock:
            view = self._views.get(job)
            if view is None or view.report is None or view.time < newer_than:
                return None
            return self._answers.get(job)

    def stop(self) -> None:
        """Let queries in flight end at their own deadline."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
