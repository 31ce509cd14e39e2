"""The open job hangs as findings: the detector's verdicts joined to hang records.

`HangFindings` is what the health engine pulls (`findings()`, `version`): it
holds the detector, the hang records and the node's recent signals (the
causes), and turns each observation (`observe`) into records opened, kept or
resolved. It starts no thread and reads nothing from the node: the jobs, the
GPU readings, the RAS views and the stack evidence are handed to it, and what
forensics found comes back through `complete`. Its lock is for readers on
other threads (the engine, /hangs); one caller at a time observes.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.config import Config
from gpuwatchd.health.hangs.alerts import alert_key, event_of, finding_of, info_samples
from gpuwatchd.health.hangs.causes import CauseMemory
from gpuwatchd.health.hangs.detector import HangDetector, JobVerdict
from gpuwatchd.health.hangs.early import StackEvidence
from gpuwatchd.health.hangs.gpu import thresholds_from_config
from gpuwatchd.health.hangs.ras_view import RasView
from gpuwatchd.health.hangs.record import HangRecord
from gpuwatchd.health.hangs.summary import HangSummary
from gpuwatchd.jobview import GroupProgress, JobView, StackCapture
from gpuwatchd.model import Event, Finding, GpuInventory, HangReport, Sample, SourceSnapshot

__all__ = ["Forensics", "HangFindings", "Observed"]

log = logging.getLogger("gpuwatchd.hangs")

KEEP_RECORDS = 200  # the newest hang records kept in memory (open ones always)


@dataclass
class Observed:
    """What one observation changed, for the machinery to act on."""

    changed: bool = False  # findings() differs: notify
    analyse: list[int] = field(default_factory=list)  # record ids for forensics, in order
    waiting: set[int] = field(default_factory=set)  # new ids whose alert waits for forensics
    resolved: list[Event] = field(default_factory=list)  # their job_hang events, to store


@dataclass(frozen=True)
class Forensics:
    """What the forensics worker found for one hang record."""

    stacks: Mapping[int, StackCapture]
    stacks_confirmed: bool
    flight: Sequence[GroupProgress]
    flight_errors: Sequence[str]
    summary: HangSummary
    ras_text: str | None  # None: no new answer, the record keeps its last
    ras_error: str


class HangFindings:
    """Detector, hang records and the JobHangSuspected findings; no threads, no I/O."""

    def __init__(self, cfg: Config, ids: Iterator[int] | None = None) -> None:
        self._lock = threading.Lock()
        self._records: dict[int, HangRecord] = {}
        self._open: dict[str, int] = {}  # job -> record id
        self._ids = ids if ids is not None else itertools.count(1)
        self._causes = CauseMemory()
        self.detector = HangDetector(thresholds_from_config(cfg))
        self.cfg = cfg
        self.version = 0  # moves when findings() changes
        self.dropped = 0  # hangs alerted without forensics (the queue was full)

    def reconfigure(self, cfg: Config) -> None:
        """New thresholds; the detector's memory (onsets, ranks seen) and open hangs stay."""
        self.detector.thresholds = thresholds_from_config(cfg)
        self.cfg = cfg

    # --- what the node said ----------------------------------------------------------

    def note(self, source: SourceSnapshot | None, events: Iterable[Event], now: float) -> None:
        """One publish's signals, joined to a hang later as its causes."""
        with self._lock:
            self._causes.note(source, events, now)

    def note_gpus(self, gpus: GpuInventory) -> None:
        with self._lock:
            self._causes.note_gpus(gpus)

    def observe(
        self,
        jobs: Sequence[JobView],
        gpus: Iterable[Any] | None,
        now: float,
        views: Mapping[str, RasView],
        own_io: Mapping[int, tuple[float, float]],
        evidence: Mapping[str, StackEvidence],
    ) -> Observed:
        """One poll or probe through the detector: hangs opened, kept, resolved."""
        verdicts = self.detector.observe(
            jobs, list(gpus) if gpus is not None else None, now, views, own_io, evidence
        )
        by_job = {j.job: j for j in jobs}
        out = Observed()
        with self._lock:
            suspected = {v.job: v for v in verdicts if v.suspected}
            for job, rid in list(self._open.items()):
                if job not in suspected:  # progress, or the job ended
                    rec = self._records[rid]
                    rec.resolved_at = now
                    del self._open[job]
                    out.changed = True
                    out.resolved.append(event_of(rec))
                    log.info("hang of job %s resolved", job)
            for job, v in suspected.items():
                known = self._open.get(job)
                if known is None:
                    rec = self._new_record(by_job[job], v, now)
                    rec.incident = self._causes.incident(by_job[job], v)
                    self._seed_stacks(rec, evidence)
                    # The alert goes at once when the detector set its severity (a dead rank
                    # pages in seconds, stacks or not); else it waits for the signature.
                    out.analyse.append(rec.id)
                    if v.severity:
                        out.changed = True
                    else:
                        out.waiting.add(rec.id)
                else:
                    rec = self._records[known]
                    was = alert_key(rec.verdict)
                    rec.job, rec.verdict = by_job[job], v
                    if alert_key(v) != was:  # escalated, another cause, RAS confirmed
                        out.changed = True
                        log.warning("hang of job %s now: %s", job, v.reason)
                    incident = self._causes.incident(by_job[job], v)
                    out.changed |= incident != rec.incident  # a cause reported after the stall
                    rec.incident = incident
                    interval = self.cfg.hangs.ras_interval_seconds
                    if self.cfg.hangs.ras and rec.ras_at and now - rec.ras_at >= interval:
                        rec.ras_at = now  # one re-query per interval
                        out.analyse.append(known)
        return out

    def _new_record(self, job: JobView, v: JobVerdict, now: float) -> HangRecord:
        rid = next(self._ids)
        rec = self._records[rid] = HangRecord(rid, job, v, ras_at=now)
        self._open[job.job] = rid
        for old in sorted(self._records)[:-KEEP_RECORDS]:
            if old not in self._open.values():
                del self._records[old]
        log.warning("hang suspected in job %s: %s", job.job, v.reason)
        return rec

    @staticmethod
    def _seed_stacks(rec: HangRecord, evidence: Mapping[str, StackEvidence]) -> None:
        """A hang decided on early stacks keeps them: forensics takes no more."""
        ev = evidence.get(rec.job.job)
        if ev is not None and ev.kind and ev.first_at >= rec.verdict.since:
            rec.stacks, rec.stacks_confirmed = dict(ev.captures), True

    # --- what forensics found --------------------------------------------------------

    def record(self, rid: int) -> HangRecord | None:
        """The record to analyse (its job, verdict and stacks are read, not changed)."""
        with self._lock:
            return self._records.get(rid)

    def is_open(self, job: str) -> bool:
        with self._lock:
            return job in self._open

    def complete(self, rid: int, found: Forensics) -> tuple[Event, bool] | None:
        """Forensics' result into the record: its event to store, and whether it is open."""
        with self._lock:
            rec = self._records.get(rid)
            if rec is None:
                return None
            rec.stacks = dict(found.stacks)
            rec.stacks_confirmed = found.stacks_confirmed
            rec.flight, rec.flight_errors = list(found.flight), list(found.flight_errors)
            rec.summary = found.summary
            if found.ras_text is not None:
                rec.ras_text = found.ras_text
            rec.ras_error = found.ras_error
            return event_of(rec), rec.resolved_at is None

    def changed(self) -> list[Finding]:
        """Note a change of findings (the engine pulls again); the findings now."""
        with self._lock:
            self.version += 1
        return self.findings()

    def count_dropped(self) -> None:
        with self._lock:
            self.dropped += 1

    # --- reading ---------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        """One JobHangSuspected per job suspected now."""
        with self._lock:
            return [finding_of(self._records[rid]) for rid in self._open.values()]

    def samples(self) -> list[Sample]:
        """The per-job info series (only while suspected) and the dropped counter."""
        with self._lock:
            recs = [self._records[rid] for rid in self._open.values()]
            dropped = self.dropped
        return info_samples(recs, dropped)

    def reports(self) -> list[HangReport]:
        """Every kept hang, newest first."""
        with self._lock:
            return [self._records[r].report() for r in sorted(self._records, reverse=True)]
