"""The hang consumer: detector on every NVML poll, forensics on its own thread.

`on_publish` (the consumer chain) turns the NVML source's samples and the
workloads (or NVML's process list) into the detector's inputs. A job newly
suspected goes on a bounded queue; the forensics worker captures each
rank's stack once per stall (opt-in), queries NCCL RAS once and then every
`ras_interval_seconds`, matches the signature catalog and stores the result
as a `job_hang` event. `findings()` holds one `JobHangSuspected` per job, which
the health engine pulls (`version` moves when they change) and sends through
its one alert sink. A job that makes progress or ends resolves its alert.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.errors import ConfigError
from gpuwatchd.health.hangs.alerts import alert_key, finding_of, info_samples, severity_of
from gpuwatchd.health.hangs.causes import CauseMemory
from gpuwatchd.health.hangs.detector import (
    GpuActivity,
    HangDetector,
    JobVerdict,
    activity_from_samples,
)
from gpuwatchd.health.hangs.early import StackProbes, evidence_of
from gpuwatchd.health.hangs.gpu import thresholds_from_config
from gpuwatchd.health.hangs.members import JobMembers, ProbeCadence
from gpuwatchd.health.hangs.poller import RasPoller
from gpuwatchd.health.hangs.ports import METRICS, EventWriter, Listener, NodeIO, RasFn, StackFn
from gpuwatchd.health.hangs.record import (
    ALERTNAME,
    RULE,
    HangRecord,
    open_hangs,
)
from gpuwatchd.health.hangs.signatures import Signature, builtin_catalog, load_catalog
from gpuwatchd.health.hangs.summary import stacks_confirm, summarize
from gpuwatchd.jobview import JobView, RasAnswer, RasError, StackCapture
from gpuwatchd.model import Event, Finding, Sample, SourceSnapshot
from gpuwatchd.state import NodeSnapshot

__all__ = [
    "ALERTNAME",
    "HangMonitor",
    "HangRecord",
    "METRICS",
    "open_hangs",
    "thresholds_from_config",
]

log = logging.getLogger("gpuwatchd.hangs")

# A rank's I/O from the monitor's flight recorder trigger until this long after the dumps
# were read is the dump it asked for (about 270 KB on 2x H100), not progress.
OWN_IO_SECONDS = 10.0


class HangMonitor:
    """Detector, forensics worker and the JobHangSuspected findings."""

    def __init__(
        self,
        cfg: Config,
        clock: Clock,
        store: EventWriter | None = None,
        *,
        capture: StackFn | None = None,
        ras_query: RasFn | None = None,
        io: NodeIO | None = None,
        max_queue: int = 16,
        ras_workers: int = 2,
        ids: Iterator[int] | None = None,  # the daemon's outlive it (sinks/hang_ids.py)
        probes: StackProbes | None = None,  # early stack evidence (the replay times it)
    ) -> None:
        self._clock = clock
        self._io = io
        self._store = store
        self._capture = capture
        self._ras_query = ras_query
        # a hang record's id to analyse, or a job whose stacks the detector wants (early.py)
        self._queue: queue.Queue[int | JobView | None] = queue.Queue(maxsize=max_queue)
        self._probes = probes if probes is not None else StackProbes()
        self._lock = threading.Lock()
        self._records: dict[int, HangRecord] = {}
        self._open: dict[str, int] = {}  # job -> record id
        self._ids = ids if ids is not None else itertools.count(1)
        self._listeners: list[Listener] = []
        self.version = 0  # moves when findings() changes
        self._seen_stamp: float | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.dropped = 0
        self._site_catalog: tuple[Signature, ...] | None = None
        self._poller = RasPoller(self._query_ras, ras_workers)
        self._causes = CauseMemory()
        self._members = JobMembers()
        self._cadence = ProbeCadence()
        self._own_io: dict[int, tuple[float, float]] = {}  # pid -> (from, until)
        self.reconfigure(cfg)

    def _query_ras(self, job: JobView) -> RasAnswer:
        if self._ras_query is None:
            raise RasError("no RAS client")
        return self._ras_query(job)

    @property
    def catalog(self) -> tuple[Signature, ...]:
        """The signatures in use: the site file's with ours, or ours alone."""
        return self._site_catalog if self._site_catalog is not None else builtin_catalog()

    def reconfigure(self, cfg: Config) -> None:
        """New thresholds and opt-ins; open hangs are kept."""
        first = not hasattr(self, "detector")
        # Without a site file the shipped catalog is parsed at the first hang: PyYAML
        # and the parsed catalog cost about 2 MiB that a healthy node never needs.
        catalog: tuple[Signature, ...] | None = None
        try:
            if cfg.hangs.signatures_file:
                catalog = load_catalog(cfg.hangs.signatures_file)
        except ConfigError:
            if first:
                raise  # at start: exit 78 naming the file
            log.exception("hang signatures not reloaded; the previous ones stay")
            catalog = self._site_catalog
        self.cfg = cfg
        self._site_catalog = catalog
        if first:
            self.detector = HangDetector(thresholds_from_config(cfg))
        else:  # the detector's memory (onsets, ranks seen) survives a reload
            self.detector.thresholds = thresholds_from_config(cfg)
        io = self._io
        if io is not None and (self._capture is None or getattr(self._capture, "_default", False)):
            t = cfg.hangs.stacks_timeout_seconds

            def capture(pid: int) -> StackCapture:
                return io.capture(pid, t)

            capture._default = True  # type: ignore[attr-defined]
            self._capture = capture
        if io is not None and (
            self._ras_query is None or getattr(self._ras_query, "_default", False)
        ):
            h = cfg.hangs

            def query(job: JobView) -> RasAnswer:
                return io.ras(job, h.ras_netns, h.ras_timeout_seconds)

            query._default = True  # type: ignore[attr-defined]
            self._ras_query = query

    def add_listener(self, listener: Listener) -> None:
        """Also call `listener(findings, now)` when the open hangs change (replays watch)."""
        self._listeners.append(listener)

    # --- the consumer step ------------------------------------------------------------

    def on_publish(
        self, snap: NodeSnapshot, source: SourceSnapshot | None = None, events: object = ()
    ) -> None:
        """Rebuild the jobs and read the GPUs once per new NVML poll, then evaluate."""
        if not self.cfg.hangs.enabled:
            return
        self._causes.note(source, events if isinstance(events, tuple) else (), self._clock.time())
        nvml = snap.sources.get("nvml")
        if nvml is None or not nvml.ok:
            return
        if nvml.timestamp == self._seen_stamp:  # the workloads' names of the poll judged last
            self._cadence.soon |= self._members.named(snap, self.jobs_of)
            return
        self._seen_stamp = nvml.timestamp
        if nvml.inventory is not None:
            self._causes.note_gpus(nvml.inventory)
        self._members.merge(self.jobs_of(snap))
        # The poll's own time, never before the last probe (time only moves forward here).
        now = max(nvml.timestamp or self._clock.time(), self._cadence.at)
        self._evaluate(now, activity_from_samples(nvml.samples))

    def tick(self) -> None:
        """About once a second (consumer thread): the hang path's own faster probe."""
        if not self.cfg.hangs.enabled or not self._members:
            return
        now = self._clock.time()
        if self._cadence.due(now, self.cfg.hangs.probe_interval_seconds, self.detector.due()):
            self._evaluate(now, None)

    def _evaluate(self, now: float, gpus: Sequence[GpuActivity] | None) -> None:
        self._cadence.probed(now)
        jobs = self._members.current(now)
        if self._io is not None:
            jobs = self._io.probe(jobs, self.cfg.paths.procfs)
        jobs = self._members.update(jobs, now)
        h = self.cfg.hangs
        if h.ras_poll and h.ras:
            urgent = self.detector.doubtful()
            urgent += [j.job for j in jobs if any(not r.alive for r in j.ranks)]
            self._poller.poll(
                jobs,
                now,
                interval=h.ras_poll_interval_seconds,
                urgent_interval=h.ras_urgent_interval_seconds,
                grace=h.startup_grace_seconds,
                urgent=urgent,
                started=self.detector.started(),
            )
        self.observe(jobs, gpus, now)

    def jobs_of(self, snap: NodeSnapshot) -> list[JobView]:
        """Jobs from the workloads source when it runs, else from NVML's processes."""
        if self._io is None:
            return []
        return self._io.jobs(snap, self.cfg.paths.procfs)

    def observe(self, jobs: Sequence[JobView], gpus: Iterable[Any] | None, now: float) -> None:
        """Feed one poll or probe (also from tests and benchmarks); gpus None: no new reading."""
        views = self._poller.views()
        with self._lock:
            for pid in [p for p, (_, until) in self._own_io.items() if until < now - 60.0]:
                del self._own_io[pid]
            own_io = dict(self._own_io)
        verdicts = self.detector.observe(
            jobs,
            list(gpus) if gpus is not None else None,
            now,
            views,
            own_io,
            self._probes.evidence(),
        )
        by_job = {j.job: j for j in jobs}
        self._ask_stacks(by_job, now)
        changed = False
        resolved: list[HangRecord] = []
        with self._lock:
            suspected = {v.job: v for v in verdicts if v.suspected}
            for job, rid in list(self._open.items()):
                if job not in suspected:  # progress, or the job ended
                    rec = self._records[rid]
                    rec.resolved_at = now
                    del self._open[job]
                    changed = True
                    resolved.append(rec)
                    log.info("hang of job %s resolved", job)
            for job, v in suspected.items():
                known = self._open.get(job)
                if known is None:
                    rid = self._new_record(by_job[job], v, now)
                    self._records[rid].incident = self._causes.incident(by_job[job], v)
                    self._seed_stacks(self._records[rid])
                    # The alert goes at once when the detector set its severity (a dead rank
                    # pages in seconds, stacks or not); else it waits for the signature.
                    queued = self._enqueue(rid)
                    changed |= not queued or bool(v.severity)
                else:
                    rec = self._records[known]
                    was = alert_key(rec.verdict)
                    rec.job, rec.verdict = by_job[job], v
                    if alert_key(v) != was:  # escalated, another cause, RAS confirmed
                        changed = True
                        log.warning("hang of job %s now: %s", job, v.reason)
                    incident = self._causes.incident(by_job[job], v)
                    changed |= incident != rec.incident  # a cause reported after the stall
                    rec.incident = incident
                    interval = self.cfg.hangs.ras_interval_seconds
                    if self.cfg.hangs.ras and rec.ras_at and now - rec.ras_at >= interval:
                        rec.ras_at = now  # one re-query per interval
                        self._enqueue(known)
        if self._store is not None and resolved:
            self._store.write([(self._event(r, r.json()), self._burst(r), 1) for r in resolved])
        if changed:
            self._notify(now)

    @staticmethod
    def _burst(rec: HangRecord) -> str:
        return f"hang:{rec.job.job}:{rec.verdict.since}"

    def _new_record(self, job: JobView, v: JobVerdict, now: float) -> int:
        rid = next(self._ids)
        self._records[rid] = HangRecord(rid, job, v, ras_at=now)
        self._open[job.job] = rid
        for old in sorted(self._records)[:-200]:  # keep the newest 200
            if old not in self._open.values():
                del self._records[old]
        log.warning("hang suspected in job %s: %s", job.job, v.reason)
        return rid

    def _enqueue(self, rid: int) -> bool:
        try:
            self._queue.put_nowait(rid)
        except queue.Full:
            self.dropped += 1
            log.error("hang forensics queue full: job hang %d alerted without stacks or RAS", rid)
            return False
        return True

    # --- the forensics worker ---------------------------------------------------------

    def start(self) -> None:
        """Start the forensics thread."""
        self._thread = threading.Thread(target=self._work, name="hang-forensics", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the forensics thread (a capture in flight ends at its own deadline)."""
        self._poller.stop()
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
        live = [r.pid for r in item.ranks if r.alive]  # two dumps of every rank (early.py)
        first_at, first = self._clock.time(), self._capture_all(live)
        self._stopping.wait(self.cfg.hangs.stacks_confirm_seconds)
        at, second = self._clock.time(), self._capture_all(live)
        self._probes.put(evidence_of(item.job, first, second, first_at, at))

    def _ask_stacks(self, by_job: Mapping[str, JobView], now: float) -> None:
        """Queue the stack dumps the detector wants before a verdict (stacks opt-in)."""
        self._probes.keep(by_job)
        if not self.cfg.hangs.stacks or self._capture is None:
            return
        for key in self._probes.due(self.detector.wants_stacks(), now):
            if key in by_job and key not in self._open:
                try:
                    self._queue.put_nowait(by_job[key])
                except queue.Full:  # forensics of open hangs come first; asked again later
                    log.warning("hang forensics queue full: no early stacks of job %s", key)

    def _seed_stacks(self, rec: HangRecord) -> None:
        """A hang decided on early stacks keeps them: forensics takes no more."""
        ev = self._probes.evidence().get(rec.job.job)
        if ev is not None and ev.kind and ev.first_at >= rec.verdict.since:
            rec.stacks, rec.stacks_confirmed = dict(ev.captures), True

    def analyse(self, rid: int) -> None:
        """Stacks (once per stall), RAS, summary, signature, store; then notify."""
        with self._lock:
            rec = self._records.get(rid)
            if rec is None:
                return
            job, verdict, have_stacks = rec.job, rec.verdict, bool(rec.stacks)
        h = self.cfg.hangs
        caps = dict(rec.stacks)
        confirmed = rec.stacks_confirmed
        if h.stacks and not have_stacks and self._capture is not None:
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
        if h.ras and fresh is not None and not rec.summary:
            answer = fresh  # the poll's answer is recent: no second query on the port
        elif (
            h.ras
            and _young(job, h.startup_grace_seconds)
            and job.job not in self.detector.started()
        ):
            ras_error = "not asked: the job started less than the start-up grace ago"
        elif h.ras and self._ras_query is not None:
            try:
                answer = self._ras_query(job)
            except RasError as e:
                ras_error = str(e)
        report = answer.report if answer is not None else None
        groups, flight_errors = rec.flight, rec.flight_errors
        if h.flight_recorder and self._io is not None and not rec.summary:
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
        summary = summarize(job, verdict, caps, report, self.catalog, facts)
        with self._lock:
            rec.stacks = caps
            rec.stacks_confirmed = confirmed
            rec.flight, rec.flight_errors = groups, flight_errors
            rec.summary = summary
            rec.ras_text = answer.text if answer is not None else rec.ras_text
            rec.ras_error = ras_error
            doc = rec.json()
            resolved = rec.resolved_at is not None
        log.warning(
            "hang %d in job %s: %s; %s",
            rid,
            job.job,
            summary.signature.title if summary.signature else "unclassified",
            summary.where_line(),
        )
        if self._store is not None:
            self._store.write([(self._event(rec, doc), self._burst(rec), 1)])
        if not resolved:
            self._notify(self._clock.time())

    def _capture_all(self, pids: Sequence[int]) -> dict[int, StackCapture]:
        """Every rank's stack at once (py-spy takes about a second for a PyTorch rank)."""
        capture = self._capture
        assert capture is not None
        with ThreadPoolExecutor(min(8, max(1, len(pids))), "hang-stacks") as pool:
            return dict(zip(pids, pool.map(capture, pids), strict=True))

    def _event(self, rec: HangRecord, doc: Mapping[str, Any]) -> Event:
        return Event(
            kind=RULE,
            source="hangs",
            time=rec.verdict.since,
            message=f"job {rec.job.job}: {rec.verdict.reason}",
            severity=severity_of(rec),
            attrs=(("job", rec.job.job), ("hang_id", str(rec.id)), ("forensics", json.dumps(doc))),
        )

    # --- findings ---------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        """One JobHangSuspected per job suspected now."""
        with self._lock:
            return [finding_of(self._records[rid]) for rid in self._open.values()]

    def samples(self) -> list[Sample]:
        """The per-job info series (only while suspected) and the dropped counter."""
        with self._lock:
            recs = [self._records[rid] for rid in self._open.values()]
        return info_samples(recs, self.dropped)

    def _notify(self, now: float) -> None:
        with self._lock:
            self.version += 1
        found = self.findings()
        for listener in list(self._listeners):
            try:
                listener(found, now)
            except Exception:
                log.exception("hang listener")

    # --- reading ----------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """Every kept hang, newest first."""
        with self._lock:
            return [self._records[r].json() for r in sorted(self._records, reverse=True)]

    def route(self, query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        """GET /hangs (all kept, newest first) or /hangs?id=N (one, with stacks and RAS)."""
        wanted = (query.get("id") or [""])[0]
        docs = self.records()
        if wanted:
            docs = [d for d in docs if str(d["id"]) == wanted]
            if not docs:
                return 404, "text/plain", b"no such hang\n"
            return 200, "application/json", json.dumps(docs[0], indent=1).encode() + b"\n"
        body = {"count": len(docs), "hangs": docs}
        return 200, "application/json", json.dumps(body, indent=1).encode() + b"\n"


def _young(job: JobView, grace: float) -> bool:
    """A rank started less than `grace` ago: RAS may still be setting communicators up."""
    return any(r.age_seconds is not None and r.age_seconds < grace for r in job.ranks if r.alive)
