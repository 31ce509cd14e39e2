"""The forensics worker: stacks, NCCL RAS and the flight recorder of a suspected hang.

A bounded queue feeds one thread (or the caller, `run_pending`, in tests and
replays). Two kinds of work: a hang record's id (take every rank's stack once
per stall, ask RAS once and then every `ras_interval_seconds`, read the flight
recorder, match the signature catalog: `HangFindings.complete`), or a job whose
stacks the detector wants before a verdict (early.py's evidence).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.hangs.poller import RasPoller
from gpuwatchd.health.hangs.early import StackProbes, evidence_of
from gpuwatchd.health.hangs.ports import NodeIO, RasFn, StackFn
from gpuwatchd.health.hangs.provider import Forensics, HangFindings
from gpuwatchd.health.hangs.signatures import Signature
from gpuwatchd.health.hangs.summary import stacks_confirm, summarize
from gpuwatchd.jobview import JobView, RasAnswer, RasError, StackCapture
from gpuwatchd.model import Event

__all__ = ["ForensicsWorker", "OWN_IO_SECONDS"]

log = logging.getLogger("gpuwatchd.hangs")

# A rank's I/O from the monitor's flight recorder trigger until this long after the dumps
# were read is the dump it asked for (about 270 KB on 2x H100), not progress.
OWN_IO_SECONDS = 10.0


class ForensicsWorker:
    """The queue and thread that analyse suspected hangs."""

    def __init__(
        self,
        hangs: HangFindings,
        clock: Clock,
        io: NodeIO | None,
        poller: RasPoller,
        probes: StackProbes,
        catalog: Callable[[], tuple[Signature, ...]],
        done: Callable[[Event, bool], None],
        max_queue: int,
    ) -> None:
        self._hangs = hangs
        self._clock = clock
        self._io = io
        self._poller = poller
        self._probes = probes
        self._catalog = catalog
        self._done = done  # (its job_hang event, still open): store it, notify
        # a hang record's id to analyse, or a job whose stacks the detector wants (early.py)
        self._queue: queue.Queue[int | JobView | None] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._own_io: dict[int, tuple[float, float]] = {}  # pid -> (from, until)
        self.cfg: Config | None = None
        self.capture: StackFn | None = None
        self.ras_query: RasFn | None = None

    def own_io(self, now: float) -> dict[int, tuple[float, float]]:
        """The ranks' I/O the flight recorder dumps caused (not progress), by pid."""
        with self._lock:
            for pid in [p for p, (_, until) in self._own_io.items() if until < now - 60.0]:
                del self._own_io[pid]
            return dict(self._own_io)

    def enqueue(self, rid: int) -> bool:
        """Queue a record's forensics; False (counted, logged) when the queue is full."""
        try:
            self._queue.put_nowait(rid)
        except queue.Full:
            self._hangs.count_dropped()
            log.error("hang forensics queue full: job hang %d alerted without stacks or RAS", rid)
            return False
        return True

    def ask_stacks(self, by_job: Mapping[str, JobView], wants: Sequence[str], now: float) -> None:
        """Queue the stack dumps the detector wants before a verdict (stacks opt-in)."""
        self._probes.keep(by_job)
        cfg = self.cfg
        if cfg is None or not cfg.hangs.stacks or self.capture is None:
            return
        for key in self._probes.due(wants, now):
            if key in by_job and not self._hangs.is_open(key):
                try:
                    self._queue.put_nowait(by_job[key])
                except queue.Full:  # forensics of open hangs come first; asked again later
                    log.warning("hang forensics queue full: no early stacks of job %s", key)

    # --- the thread -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="hang-forensics", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread (a capture in flight ends at its own deadline)."""
        self._stopping.set()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)

    def run_pending(self) -> None:
        """Analyse every queued hang in the caller's thread (tests, one-shot use)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._do(item)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._do(item)
            except Exception:  # one bad capture must not end forensics
                log.exception("hang forensics of %s", item if isinstance(item, int) else item.job)

    def _do(self, item: int | JobView) -> None:
        if isinstance(item, int):
            self.analyse(item)
            return
        assert self.cfg is not None
        live = [r.pid for r in item.ranks if r.alive]  # two dumps of every rank (early.py)
        first_at, first = self._clock.time(), self._capture_all(live)
        self._stopping.wait(self.cfg.hangs.stacks_confirm_seconds)
        at, second = self._clock.time(), self._capture_all(live)
        self._probes.put(evidence_of(item.job, first, second, first_at, at))

    # --- one hang ---------------------------------------------------------------------

    def analyse(self, rid: int) -> None:
        """Stacks (once per stall), RAS, flight recorder, summary, signature; then done."""
        rec = self._hangs.record(rid)
        if rec is None or self.cfg is None:
            return
        job, verdict, caps = rec.job, rec.verdict, dict(rec.stacks)
        confirmed, analysed = rec.stacks_confirmed, rec.summary is not None
        h = self.cfg.hangs
        if h.stacks and not caps and self.capture is not None:
            live = [r.pid for r in job.ranks if r.alive]
            first = self._capture_all(live)
            self._stopping.wait(h.stacks_confirm_seconds)  # a second dump: still there?
            caps = self._capture_all(live)
            confirmed = stacks_confirm(first, caps)
            for pid, cap in caps.items():
                if not cap.ok:
                    log.warning("hang %d: no stack of pid %d: %s", rid, pid, cap.error)
        answer: RasAnswer | None = None
        ras_error = ""
        fresh = self._poller.answer(job.job, self._clock.time() - h.ras_poll_interval_seconds)
        if h.ras and fresh is not None and not analysed:
            answer = fresh  # the poll's answer is recent: no second query on the port
        elif (
            h.ras
            and _young(job, h.startup_grace_seconds)
            and job.job not in self._hangs.detector.started()
        ):
            ras_error = "not asked: the job started less than the start-up grace ago"
        elif h.ras and self.ras_query is not None:
            try:
                answer = self.ras_query(job)
            except RasError as e:
                ras_error = str(e)
        groups, flight_errors = list(rec.flight), list(rec.flight_errors)
        if h.flight_recorder and self._io is not None and not analysed:
            live = [r.pid for r in job.ranks if r.alive]
            asked = self._clock.time()
            with self._lock:  # the probes in between already discount the dump
                self._own_io.update((pid, (asked, float("inf"))) for pid in live)
            groups, flight_errors = self._io.flight(job, self.cfg.paths.procfs, self._stopping.wait)
            until = self._clock.time() + OWN_IO_SECONDS
            with self._lock:
                self._own_io.update((pid, (asked, until)) for pid in live)
        facts = {"flight:not_joined" for g in groups if g.not_joined}
        facts |= {"flight:ops_differ" for g in groups if g.ops_differ}
        report = answer.report if answer is not None else None
        summary = summarize(job, verdict, caps, report, self._catalog(), facts)
        found = Forensics(
            stacks=caps,
            stacks_confirmed=confirmed,
            flight=groups,
            flight_errors=flight_errors,
            summary=summary,
            ras_text=answer.text if answer is not None else None,
            ras_error=ras_error,
        )
        done = self._hangs.complete(rid, found)
        if done is None:
            return
        log.warning(
            "hang %d in job %s: %s; %s",
            rid,
            job.job,
            summary.signature.title if summary.signature else "unclassified",
            summary.where_line(),
        )
        self._done(*done)

    def _capture_all(self, pids: Sequence[int]) -> dict[int, StackCapture]:
        """Every rank's stack at once (py-spy takes about a second for a PyTorch rank)."""
        capture = self.capture
        assert capture is not None
        with ThreadPoolExecutor(min(8, max(1, len(pids))), "hang-stacks") as pool:
            return dict(zip(pids, pool.map(capture, pids), strict=True))


def _young(job: JobView, grace: float) -> bool:
    """A rank started less than `grace` ago: RAS may still be setting communicators up."""
    return any(r.age_seconds is not None and r.age_seconds < grace for r in job.ranks if r.alive)
