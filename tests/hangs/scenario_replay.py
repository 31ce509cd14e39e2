"""Any recorded scenario (tests/fixtures/hangs/NAME/) replayed through the hang monitor,
and what its expect.json says the monitor must make of it.

expect.json (every key but `kind` optional; an unknown key is an error):

    kind            "hang" | "control"
    flagged         a finding at some point of the replay (hang: within `within_s`)
    within_s        first finding at most this many seconds after trace.json's hang_start
    severity        the first finding's severity ("critical", "warning")
    alertname       the first finding's alertname
    reason_contains strings every one of which the first finding's reason holds
    labels          label -> value the first finding carries
    decided_by_all  signals ("liveness", "gpu", "ras", ...) that all decided the first finding
    decided_by_any  signals of which at least one decided it
    conditions_any  detector conditions ("rank_dead", "collective_stall", ...) of which at
                    least one appears in a hang record
    signature       the signature label once forensics ran (the last finding of the replay)
    stays_open      once flagged, flagged on every later tick while the recording lasts
    flight_contains strings the hang records' flight recorder lines hold (forensics ran)
    max_severity    no finding over the whole recording above this ("ok": none at all)
    nvml_phases     NVML poll offsets (seconds) to replay at; default [0, 5]
    hangs_config    keys of the `hangs:` section to replay with (e.g. {"stacks": true})
    note            free text: why these expectations
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.forensics import NodeForensics
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.health.hangs.early import StackEvidence, StackProbes
from gpuwatchd.jobview import JobView, StackCapture
from gpuwatchd.model import Finding, GpuInventory, Sample, Severity, SourceSnapshot
from gpuwatchd.sources.hangs import flight, stacks
from gpuwatchd.sources.workloads.source import WorkloadSource
from gpuwatchd.state import NodeSnapshot
from tests.hangs.ras_server import RasReplayServer, ras_server
from tests.hangs.real_trace import FlightRank, ProcTree, Trace, nvml_snapshot

NVML_INTERVAL = Config().sources.nvml.interval
# A live `py-spy dump --native` of a PyTorch rank: 0.62-1.34 s in the recordings that kept
# the figure (tests/fixtures/hangs/*/trace.json `pyspy[].seconds`); for those that did not.
DUMP_SECONDS = 1.0


@dataclass(frozen=True)
class Expect:
    """A fixture's expect.json."""

    kind: str
    flagged: bool | None = None
    within_s: float | None = None
    severity: str | None = None
    alertname: str | None = None
    reason_contains: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    decided_by_all: tuple[str, ...] = ()
    decided_by_any: tuple[str, ...] = ()
    conditions_any: tuple[str, ...] = ()
    signature: str | None = None
    stays_open: bool = False
    flight_contains: tuple[str, ...] = ()
    max_severity: str | None = None
    nvml_phases: tuple[int, ...] = (0, 5)
    hangs_config: tuple[tuple[str, Any], ...] = ()
    note: str = ""

    def config(self) -> Config:
        """The defaults with `hangs_config` applied (an unknown key is an error)."""
        cfg = Config()
        return dataclasses.replace(
            cfg, hangs=dataclasses.replace(cfg.hangs, **dict(self.hangs_config))
        )

    @classmethod
    def load(cls, path: str) -> Expect:
        with open(path) as f:
            doc = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(known)}")
        if doc.get("kind") not in ("hang", "control"):
            raise ValueError(f"{path}: kind must be 'hang' or 'control'")
        for key in ("severity", "max_severity"):
            if doc.get(key) is not None:
                Severity.parse(doc[key])  # a typo fails here, not as a silent pass
        lists = ("reason_contains", "decided_by_all", "decided_by_any", "conditions_any")
        for key in (*lists, "flight_contains"):
            doc[key] = tuple(doc.get(key, ()))
        doc["labels"] = tuple(sorted(doc.get("labels", {}).items()))
        doc["nvml_phases"] = tuple(doc.get("nvml_phases", (0, 5)))
        doc["hangs_config"] = tuple(sorted((doc.get("hangs_config") or {}).items()))
        return cls(**doc)


def decided_by(f: Finding) -> set[str]:
    """The signals a finding's reason names after `Decided by:`."""
    if "Decided by: " not in f.reason:
        return set()
    return set(f.reason.split("Decided by: ")[1].split(".")[0].split("+"))


class QuickFlight(NodeForensics):
    """The node's flight recorder path, waiting for the replayed dumps, not 2 s of wall time."""

    def __init__(self, ranks: list[FlightRank]) -> None:
        self.ranks = ranks

    def flight(
        self, job: JobView, procfs: str, wait: Callable[[float], object]
    ) -> tuple[list[flight.GroupProgress], list[str]]:
        # The ranks the node's path triggers: every live rank with a pipe reader. Waiting
        # for those (not for "the ranks seen triggered so far") keeps a reader thread slow
        # to notice its byte on a loaded machine from being read as no dump at all.
        alive = {r.pid for r in job.ranks if r.alive and r.rank is not None}
        expected = [(fr, fr.triggered) for fr in self.ranks if fr.pid in alive]

        def written(seconds: float) -> None:
            deadline = time.monotonic() + max(seconds, 10.0)
            while time.monotonic() < deadline:
                if all(fr.triggered > n and fr.written.is_set() for fr, n in expected):
                    return
                time.sleep(0.01)

        for fr in self.ranks:
            fr.written.clear()
        return super().flight(job, procfs, written)


class TimedProbes(StackProbes):
    """Early stack evidence as late as the daemon has it: after two dumps and the pause.

    The replay's dumps answer at once and its monitor does not wait between them (no
    wall time); the daemon's forensics thread takes `dump` seconds per `py-spy dump`
    (as recorded) and waits `confirm` (hangs.stacks_confirm_seconds) between the two.
    Evidence asked at T is dated as the daemon dates it (first dumps at T, second ones
    at T + dump + confirm) and seen by the detector from T + 2 dump + confirm on.
    """

    def __init__(self, clock: FakeClock, dump: float, confirm: float) -> None:
        super().__init__()
        self._clock, self.dump, self.confirm = clock, dump, confirm
        self._pending: list[tuple[float, StackEvidence]] = []

    def put(self, evidence: StackEvidence) -> None:
        at = evidence.first_at + self.dump + self.confirm
        self._pending.append((at + self.dump, dataclasses.replace(evidence, at=at)))

    def evidence(self) -> dict[str, StackEvidence]:
        now = self._clock.time()
        for ready, ev in [p for p in self._pending if p[0] <= now]:
            self._pending.remove((ready, ev))
            super().put(ev)
        return super().evidence()


class Replay:
    """The monitor beside one recorded job: a fake clock, /proc tree, NVML, RAS, dumps.

    Cadences as the daemon has them: an NVML poll every `sources.nvml.interval` at the
    given phase, the workloads source's poll just after each (it names the processes of
    the NVML poll before it is published: jobs are the workloads' when it runs), the
    consumer's tick every second, and early stack dumps as slow as recorded (TimedProbes).
    """

    def __init__(
        self, tmp: str, trace: Trace, srv: RasReplayServer, cfg: Config, phase: float
    ) -> None:
        self.trace, self.srv = trace, srv
        self.origin = trace.origin
        self.proc = ProcTree(os.path.join(tmp, "proc"), trace.environ(srv.addr), trace.cmdlines())
        confirm = cfg.hangs.stacks_confirm_seconds  # modelled by TimedProbes, not waited
        cfg = dataclasses.replace(
            cfg,
            paths=dataclasses.replace(cfg.paths, procfs=self.proc.root),
            hangs=dataclasses.replace(cfg.hangs, stacks_confirm_seconds=0.0),
        )
        samples = trace.samples()
        self.clock = FakeClock(start=samples[0][0])
        self.launch = float(trace.doc["t_launch"])
        self.boot = trace.boot_uptime()
        dumps = {pid: itertools.cycle(trace.pyspy(pid)) for pid in trace.pids.values()}
        self.stacks_taken: list[float] = []

        def capture(pid: int) -> StackCapture:  # py-spy as recorded, in turn
            self.stacks_taken.append(self.clock.time() - self.origin)
            text = next(dumps.get(pid, iter(())), None)
            if text is None:
                return StackCapture(pid, False, error="no py-spy dump recorded")
            python, threads = stacks.parse_dump(text)
            return StackCapture(pid, True, threads, python=python, raw=text)

        fr = trace.flight_dumps()
        self.flights = [
            FlightRank(self.proc, pid, rank, fr[rank])
            for rank, pid in trace.pids.items()
            if rank in fr
        ]
        recorded = [float(p["seconds"]) for p in trace.doc.get("pyspy") or () if p.get("seconds")]
        self.probes = TimedProbes(self.clock, max(recorded) if recorded else DUMP_SECONDS, confirm)
        self.monitor = HangMonitor(
            cfg,
            self.clock,
            io=QuickFlight(self.flights),
            ras_workers=0,
            capture=capture,
            probes=self.probes,
        )
        self.inventory = GpuInventory()
        self.workloads = WorkloadSource(
            lambda: self.inventory, procfs=self.proc.root, kubelet=None, slurm=None
        )
        self.workloads_snap: SourceSnapshot | None = None
        self._poll_workloads(samples[0][0])  # the daemon ran before the recording began
        self.found: list[tuple[float, list[Finding]]] = []
        self.monitor.add_listener(lambda f, now: self.found.append((now - self.origin, list(f))))
        self.next_nvml = samples[0][0] + phase
        self.last_nvml = self.next_nvml - NVML_INTERVAL  # the daemon polled before
        self.ticks: list[tuple[float, list[Finding]]] = []  # the monitor's findings each second

    def step(self, t: float, ranks: dict[int, dict[str, Any]]) -> None:
        """One second of the node: /proc now, an NVML poll when due, the consumer's tick."""
        trace = self.trace
        self.clock.advance(t - self.clock.time())
        self.proc.write(self.boot + t - self.launch, ranks)
        self.srv.json_answer = trace.ras_answer(t, "json") or trace.first_ras_answer("json")
        self.srv.text_answer = trace.ras_answer(t, "text") or trace.first_ras_answer("text")
        if t >= self.next_nvml:
            self.next_nvml += NVML_INTERVAL
            since, self.last_nvml = self.last_nvml, t
            nvml = nvml_snapshot(trace.nvml_poll(since, t), t).sources["nvml"]
            self.monitor.on_publish(self._node(nvml))  # the workloads' poll still to come
            assert nvml.inventory is not None
            self.inventory = nvml.inventory
            self._poll_workloads(t)
            self.monitor.on_publish(self._node(nvml))
        self.monitor.tick()

    def _poll_workloads(self, t: float) -> None:
        found = self.workloads.poll(t)
        self.workloads_snap = SourceSnapshot(
            "workloads",
            tuple(s for s in found if isinstance(s, Sample)),
            True,
            timestamp=t,
            payload=self.workloads.payload(),
        )

    def _node(self, nvml: SourceSnapshot) -> NodeSnapshot:
        sources = {"nvml": nvml}
        if self.workloads_snap is not None:
            sources["workloads"] = self.workloads_snap
        return NodeSnapshot(sources=sources)

    def run(self, forensics: bool = True) -> None:
        """The whole recording, second by second (forensics in this thread)."""
        for t, ranks in self.trace.samples():
            self.step(t, ranks)
            if forensics:
                self.monitor.run_pending()
            self.ticks.append((t - self.origin, self.monitor.findings()))

    def close(self) -> None:
        for fr in self.flights:
            fr.close()


@contextmanager
def replaying(tmp: str, trace: Trace, phase: float, cfg: Config | None = None) -> Iterator[Replay]:
    """A Replay with its RAS server, closed afterwards."""
    text, answer = trace.first_ras_answer("text"), trace.first_ras_answer("json")
    with ras_server(text, answer) as srv:
        node = Replay(tmp, trace, srv, cfg or Config(), phase)
        try:
            yield node
        finally:
            node.close()


def check(node: Replay, want: Expect) -> list[str]:
    """What in the replay differs from expect.json (empty: all held)."""
    bad: list[str] = []
    flagged = [(t, f) for t, found in node.ticks for f in found]
    first = flagged[0] if flagged else None
    if want.flagged is not None and bool(first) != want.flagged:
        bad.append(f"flagged: want {want.flagged}, got {first}")
    if want.max_severity is not None:
        cap = Severity.parse(want.max_severity)
        over = [(round(t, 1), f.severity.name, f.reason) for t, f in flagged if f.severity > cap]
        if over:
            bad.append(f"above {want.max_severity}: first at {over[0]}")
    records = node.monitor.records()
    seen = {c for doc in records for c in doc.get("conditions") or ()}
    flights = "\n".join(line for doc in records for line in doc.get("flight_recorder") or ())
    bad += [
        f"flight recorder lacks {s!r}: {flights!r}"
        for s in want.flight_contains
        if s not in flights
    ]
    if want.conditions_any and not seen & set(want.conditions_any):
        bad.append(f"conditions: want one of {want.conditions_any}, got {sorted(seen)}")
    if first is None:
        return bad
    at, f = first
    if want.within_s is not None:
        if node.trace.hang_start is None:
            bad.append("within_s: the recording has no hang_start")
        elif not 0 <= at <= want.within_s:
            bad.append(f"first finding at {at:+.1f} s, want within {want.within_s} s")
    if want.severity is not None and f.severity != Severity.parse(want.severity):
        bad.append(f"severity: want {want.severity}, got {f.severity.name}")
    if want.alertname is not None and f.alertname != want.alertname:
        bad.append(f"alertname: want {want.alertname}, got {f.alertname}")
    bad += [f"reason lacks {s!r}: {f.reason}" for s in want.reason_contains if s not in f.reason]
    labels = dict(f.labels)
    bad += [
        f"label {k}={labels.get(k)!r}, want {v!r}" for k, v in want.labels if labels.get(k) != v
    ]
    signals = decided_by(f)
    if not set(want.decided_by_all) <= signals:
        bad.append(f"decided by {sorted(signals)}, want all of {want.decided_by_all}")
    if want.decided_by_any and not signals & set(want.decided_by_any):
        bad.append(f"decided by {sorted(signals)}, want one of {want.decided_by_any}")
    if want.signature is not None:
        last = flagged[-1][1]
        if dict(last.labels).get("signature") != want.signature:
            bad.append(f"signature {dict(last.labels).get('signature')}, want {want.signature}")
    if want.stays_open:
        gaps = [t for t, found in node.ticks if t >= at and not found]
        if gaps:
            bad.append(f"not flagged at {gaps[0]:+.1f} s after being flagged at {at:+.1f} s")
    return bad
