"""The hang path's probe schedule, off the consumer thread: jobs and /proc of every rank.

The consumer's step (`on_publish`, `tick`) only hands work over: a publish's
signals go to the findings' cause memory at once (pure, cheap), the snapshot
and the tick to this loop's thread, which names the jobs (the workloads' or
NVML's processes, their environment read from /proc), probes every rank
(liveness, CPU time, I/O), asks NCCL RAS through the poller and feeds the
detector. A slow /proc (a rank in D state, a hung FUSE mount) then stalls
this thread, never the consumer and the alerts of other rules. Before
`start()`, work runs in the caller's thread, as tests and replays drive it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.hangs.poller import RasPoller
from gpuwatchd.health.hangs.detector import GpuActivity, activity_from_samples
from gpuwatchd.health.hangs.members import JobMembers, ProbeCadence
from gpuwatchd.health.hangs.ports import NodeIO
from gpuwatchd.health.hangs.provider import HangFindings
from gpuwatchd.jobview import JobView
from gpuwatchd.model import SourceSnapshot
from gpuwatchd.state import NodeSnapshot

__all__ = ["MAX_PENDING", "PROBED_SOURCES", "ProbeLoop"]

log = logging.getLogger("gpuwatchd.hangs")

MAX_PENDING = 8  # publishes waiting for a slow probe: the oldest goes (the next poll comes)
# The publishes that name jobs or read their GPUs; another source's publish changes
# nothing the probe reads, so it does not wake the thread.
PROBED_SOURCES = frozenset(("nvml", "workloads"))
Observe = Callable[[Sequence[JobView], Iterable[GpuActivity] | None, float], None]


class ProbeLoop:
    """NVML polls and ticks in, observations of the detector out; one thread."""

    def __init__(
        self,
        cfg: Config,
        clock: Clock,
        io: NodeIO | None,
        hangs: HangFindings,
        poller: RasPoller,
        observe: Observe,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self._io = io
        self._hangs = hangs
        self._poller = poller
        self._observe = observe
        self._members = JobMembers()
        self._cadence = ProbeCadence()
        self._seen_stamp: float | None = None
        self.seen: tuple[JobView, ...] = ()  # the jobs of the last evaluation, probed
        self._cond = threading.Condition()
        self._pending: deque[NodeSnapshot | None] = deque()  # None: a tick
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._busy = False  # the thread is handling an item
        self.coalesced = 0  # publishes dropped while the probe was slow
        self.errors = 0  # probes that raised on the thread (a bug; the log has the traceback)

    # --- the consumer thread ----------------------------------------------------------

    def on_publish(
        self, snap: NodeSnapshot, source: SourceSnapshot | None = None, events: object = ()
    ) -> None:
        """Note the publish's signals; the rest on the probe thread."""
        if not self.cfg.hangs.enabled:
            return
        self._hangs.note(source, events if isinstance(events, tuple) else (), self._clock.time())
        if source is None or source.source in PROBED_SOURCES:
            self._submit(snap)

    def tick(self) -> None:
        """About once a second: the hang path's own faster probe (when one is due); with
        no job on the node there is nothing to probe, and the thread sleeps on."""
        if self.cfg.hangs.enabled and self._members:
            self._submit(None)

    def _submit(self, item: NodeSnapshot | None) -> None:
        if self._thread is None:
            self._handle(item)
            return
        with self._cond:
            if item is None and None in self._pending:
                return  # a tick waits already
            if len(self._pending) >= MAX_PENDING:
                self._pending.popleft()
                self.coalesced += 1
            self._pending.append(item)
            self._cond.notify_all()

    # --- the probe thread -------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hang-probe", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread (a /proc read in flight is left to end by itself)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until everything handed over so far was handled (tests, start-up)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                item = self._pending.popleft()
                self._busy = True
            try:
                self._handle(item)
            except Exception:  # a bug in one probe must not end the hang path
                self.errors += 1
                log.exception("hang probe")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _handle(self, item: NodeSnapshot | None) -> None:
        if item is None:
            self._tick()
        else:
            self._publish(item)

    def _publish(self, snap: NodeSnapshot) -> None:
        """Rebuild the jobs and read the GPUs once per new NVML poll, then evaluate."""
        nvml = snap.sources.get("nvml")
        if nvml is None or not nvml.ok:
            return
        if nvml.timestamp == self._seen_stamp:  # the workloads' names of the poll judged last
            self._cadence.soon |= self._members.named(snap, self.jobs_of)
            return
        self._seen_stamp = nvml.timestamp
        if nvml.inventory is not None:
            self._hangs.note_gpus(nvml.inventory)
        self._members.merge(self.jobs_of(snap))
        # The poll's own time, never before the last probe (time only moves forward here).
        now = max(nvml.timestamp or self._clock.time(), self._cadence.at)
        self._evaluate(now, activity_from_samples(nvml.samples))

    def _tick(self) -> None:
        if not self._members:
            return
        now = self._clock.time()
        due = self._hangs.detector.due()
        if self._cadence.due(now, self.cfg.hangs.probe_interval_seconds, due):
            self._evaluate(now, None)

    def _evaluate(self, now: float, gpus: Sequence[GpuActivity] | None) -> None:
        self._cadence.probed(now)
        jobs = self._members.current(now)
        if self._io is not None:
            jobs = self._io.probe(jobs, self.cfg.paths.procfs)
        jobs = self._members.update(jobs, now)
        h = self.cfg.hangs
        if h.ras_poll and h.ras:
            detector = self._hangs.detector
            urgent = detector.doubtful()
            urgent += [j.job for j in jobs if any(not r.alive for r in j.ranks)]
            self._poller.poll(
                jobs,
                now,
                interval=h.ras_poll_interval_seconds,
                urgent_interval=h.ras_urgent_interval_seconds,
                grace=h.startup_grace_seconds,
                urgent=urgent,
                started=detector.started(),
            )
        self.seen = tuple(jobs)  # one assignment: other threads read a whole list
        self._observe(jobs, gpus, now)

    def jobs_of(self, snap: NodeSnapshot) -> list[JobView]:
        """Jobs from the workloads source when it runs, else from NVML's processes."""
        if self._io is None:
            return []
        return self._io.jobs(snap, self.cfg.paths.procfs)
