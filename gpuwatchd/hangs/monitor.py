"""The hang monitor: the health layer's `HangFindings` with its threads, store and route.

`on_publish` and `tick` (the consumer's step) hand the NVML polls to the probe
loop (probing.py, thread `hang-probe`), which feeds `observe`: the findings
open, keep or resolve hang records; a job newly suspected goes to the
forensics worker (worker.py, thread `hang-forensics`); every report (on
suspicion, after forensics, on resolution) is written to the store as a
`job_hang` event with its `HangReport` payload. The health engine pulls
`findings` (the `HangFindings`) and sends them through its one alert sink.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.errors import ConfigError
from gpuwatchd.hangs.poller import RasPoller
from gpuwatchd.hangs.probing import ProbeLoop
from gpuwatchd.hangs.worker import ForensicsWorker
from gpuwatchd.health.hangs.detector import GpuActivity, HangDetector
from gpuwatchd.health.hangs.early import StackProbes
from gpuwatchd.health.hangs.ports import EventWriter, Listener, NodeIO, RasFn, StackFn
from gpuwatchd.health.hangs.provider import HangFindings
from gpuwatchd.health.hangs.ras_view import RasView
from gpuwatchd.health.hangs.signatures import Signature, builtin_catalog, load_catalog
from gpuwatchd.jobview import JobView, RasAnswer, RasError, StackCapture
from gpuwatchd.model import Event, Finding, HangReport, Sample, SourceSnapshot
from gpuwatchd.state import NodeSnapshot

__all__ = ["HangMonitor"]

log = logging.getLogger("gpuwatchd.hangs")


class HangMonitor:
    """Probe loop, forensics worker, store writes and /hangs around one `HangFindings`."""

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
        self._probes = probes if probes is not None else StackProbes()
        self._listeners: list[Listener] = []
        self._site_catalog: tuple[Signature, ...] | None = None
        self.provider = HangFindings(cfg, ids if ids is not None else itertools.count(1))
        self._poller = RasPoller(self._query_ras, ras_workers)
        self._worker = ForensicsWorker(
            self.provider,
            clock,
            io,
            self._poller,
            self._probes,
            lambda: self.catalog,
            self._analysed,
            max_queue,
        )
        self._loop = ProbeLoop(cfg, clock, io, self.provider, self._poller, self.observe)
        self.cfg = cfg
        self._configure(cfg, first=True)

    def _query_ras(self, job: JobView) -> RasAnswer:
        if self._ras_query is None:
            raise RasError("no RAS client")
        return self._ras_query(job)

    @property
    def detector(self) -> HangDetector:
        return self.provider.detector

    @property
    def version(self) -> int:
        return self.provider.version

    @property
    def dropped(self) -> int:
        return self.provider.dropped

    @property
    def errors(self) -> int:
        """Probes that raised on the probe thread (the consumer counts them as step hangs)."""
        return self._loop.errors

    @property
    def catalog(self) -> tuple[Signature, ...]:
        """The signatures in use: the site file's with ours, or ours alone."""
        return self._site_catalog if self._site_catalog is not None else builtin_catalog()

    def reconfigure(self, cfg: Config) -> None:
        """New thresholds and opt-ins; open hangs are kept."""
        self._configure(cfg, first=False)

    def _configure(self, cfg: Config, first: bool) -> None:
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
        if not first:  # the detector's memory (onsets, ranks seen) survives a reload
            self.provider.reconfigure(cfg)
        self._loop.cfg = self._worker.cfg = cfg
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
        self._worker.capture, self._worker.ras_query = self._capture, self._ras_query

    def add_listener(self, listener: Listener) -> None:
        """Also call `listener(findings, now)` when the open hangs change (replays watch)."""
        self._listeners.append(listener)

    # --- the consumer step (handed to the probe loop) ---------------------------------

    def on_publish(
        self, snap: NodeSnapshot, source: SourceSnapshot | None = None, events: object = ()
    ) -> None:
        """One publish: its signals noted, its NVML poll handed to the probe loop."""
        self._loop.on_publish(snap, source, events)

    def tick(self) -> None:
        """About once a second (consumer thread): the probe loop's own faster probe."""
        self._loop.tick()

    def jobs_of(self, snap: NodeSnapshot) -> list[JobView]:
        """Jobs from the workloads source when it runs, else from NVML's processes."""
        return self._loop.jobs_of(snap)

    def jobs_seen(self, snap: NodeSnapshot | None = None) -> list[JobView]:
        """The jobs the probe loop judged last, read from no /proc (any thread)."""
        return list(self._loop.seen)

    def ras_views(self) -> dict[str, RasView]:
        """The latest NCCL RAS answer of each job (any thread)."""
        return self._poller.views()

    def observe(
        self, jobs: Sequence[JobView], gpus: Iterable[GpuActivity] | None, now: float
    ) -> None:
        """Feed one poll or probe (also from tests and benchmarks); gpus None: no new reading."""
        seen = self.provider.observe(
            jobs,
            gpus,
            now,
            self._poller.views(),
            self._worker.own_io(now),
            self._probes.evidence(),
        )
        self._worker.ask_stacks(
            {j.job: j for j in jobs}, self.provider.detector.wants_stacks(), now
        )
        changed = seen.changed
        for rid in seen.analyse:
            queued = self._worker.enqueue(rid)
            changed |= not queued and rid in seen.waiting  # alerted without its signature
        self._write(seen.resolved)
        if changed:
            self._notify(now)

    def _analysed(self, event: Event, still_open: bool) -> None:
        self._write([event])
        if still_open:
            self._notify(self._clock.time())

    def _write(self, events: Sequence[Event]) -> None:
        """One row per hang and stall (the burst id): each write updates it."""
        if self._store is not None and events:
            self._store.write([(ev, _burst(ev), 1) for ev in events])

    def _notify(self, now: float) -> None:
        found = self.provider.changed()
        for listener in list(self._listeners):
            try:
                listener(found, now)
            except Exception:
                log.exception("hang listener")

    # --- the threads ------------------------------------------------------------------

    def start(self) -> None:
        """Start the probe loop's and the forensics worker's threads."""
        self._worker.start()
        self._loop.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop both threads (a capture or a /proc read in flight ends by itself)."""
        self._poller.stop()
        self._loop.stop(timeout)
        self._worker.stop(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the probe loop handled every publish and tick handed to it."""
        return self._loop.wait_idle(timeout)

    def run_pending(self) -> None:
        """Analyse every queued hang in the caller's thread (tests, one-shot use)."""
        self._worker.run_pending()

    def analyse(self, rid: int) -> None:
        self._worker.analyse(rid)

    # --- reading ----------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        return self.provider.findings()

    def samples(self) -> list[Sample]:
        return self.provider.samples()

    def reports(self) -> list[HangReport]:
        """Every kept hang, newest first."""
        return self.provider.reports()

    def records(self) -> list[dict[str, Any]]:
        """Every kept hang as /hangs serves it (its report's JSON), newest first."""
        return [r.json() for r in self.reports()]

    def route(self, query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        """GET /hangs (all kept, newest first) or /hangs?id=N (one, with stacks and RAS)."""
        wanted = (query.get("id") or [""])[0]
        reports = self.reports()
        if wanted:
            one = [r for r in reports if str(r.id) == wanted]
            if not one:
                return 404, "text/plain", b"no such hang\n"
            return 200, "application/json", json.dumps(one[0].json(), indent=1).encode() + b"\n"
        body = {"count": len(reports), "hangs": [r.json() for r in reports]}
        return 200, "application/json", json.dumps(body, indent=1).encode() + b"\n"


def _burst(ev: Event) -> str:
    report = ev.hang
    assert report is not None
    return f"hang:{report.job}:{report.since}"
