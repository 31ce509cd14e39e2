"""Evidence bundles: what the node looked like when a critical condition was raised.

One bundle per incident (alert name and subject) under
<state_dir>/evidence/<id>/: the newest kernel log records, the NVML
samples and source status, the newest stored events, the incident's own
detail (a hang's stacks, NCCL RAS answer and flight-recorder dumps travel in
its finding and stored events), and `nvidia-bug-report.sh` output when
configured. Bounded in size per bundle and in count; written before
remediation acts (on the remediation thread, which waits for it) and
whenever a critical finding first opens (on the writer thread, through a
bounded queue: the consumer thread never waits on the disk).

An incident chain is a run of incidents each raised within `CHAIN_GAP` of
the one before (a cascade: one GPU falls off the bus, its jobs hang, NCCL
times out elsewhere). Its first incident is most likely the cause, so its
bundle is never dropped from the queue and is pruned only after every
other bundle. A bundle whose metadata cannot be read is moved aside at
start (`<id>.corrupt-<time>`), as the event store's damaged files are.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import stat
import subprocess
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from gpuwatchd.clock import Clock, SystemClock
from gpuwatchd.config import Config
from gpuwatchd.health.rollup import finding_json
from gpuwatchd.model import Finding, MetricSpec, Sample, Severity
from gpuwatchd.sinks.bundles import (
    CORRUPT,
    EVIDENCE_DIR,
    META,
    evidence_root,
    evidence_route,
    list_bundles,
    meta_of,
    read_bundle,
)
from gpuwatchd.sinks.durability import quarantine
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sinks.store_schema import hang_report_json
from gpuwatchd.state import State

__all__ = [
    "CHAIN_GAP",
    "EVIDENCE_DIR",
    "EvidenceRecorder",
    "METRICS",
    "QUEUE_LIMIT",
    "evidence_route",
    "incident_key",
    "list_bundles",
    "read_bundle",
    "read_kmsg",
]

log = logging.getLogger("gpuwatchd.evidence")

QUEUE_LIMIT = 64  # bundles waiting for the writer thread (a finding each: small)
CHAIN_GAP = 600.0  # seconds without a new critical incident that end an incident chain
TAIL_BLOCK = 65536  # bytes read at a time from the end of a kernel log file
DROPS_REMEMBERED = 1024  # dropped incidents not offered again (while they stay open)

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_evidence_bundles_written_total",
        "counter",
        "evidence bundles written (one per critical incident, or before remediation acts)",
    ),
    MetricSpec(
        "gpuwatchd_evidence_bundles_dropped_total",
        "counter",
        "evidence bundles not written: queue_full (more incidents at once than the writer's"
        " queue holds; the first of an incident chain is never dropped), write_failed (the"
        " disk refused)",
        ("reason",),
    ),
    MetricSpec(
        "gpuwatchd_evidence_bundles_queued",
        "gauge",
        "evidence bundles waiting for the writer thread",
    ),
    MetricSpec(
        "gpuwatchd_evidence_quarantined_total",
        "counter",
        "evidence bundles with unreadable metadata moved aside at start (<id>.corrupt-<time>)",
    ),
)


def incident_key(f: Finding) -> str:
    """Alert name and subject: one incident, one bundle."""
    return f.alertname + "|" + ",".join(f"{k}={v}" for k, v in f.subject)


def _bundle_id(key: str, t: float) -> str:
    import hashlib  # here: it maps libcrypto, and only a bundle being written needs it

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))
    digest = hashlib.sha1(f"{key}|{t}".encode()).hexdigest()[:10]
    return f"{stamp}-{digest}"


def _tail(path: str, records: int, limit: int) -> list[str]:
    """The last `records` lines of a file, read backwards from its end (at most `limit` bytes)."""
    chunks: list[bytes] = []
    newlines = 0
    with open(path, "rb") as f:
        pos = end = f.seek(0, os.SEEK_END)
        while pos > 0 and newlines <= records and end - pos < limit:
            step = min(TAIL_BLOCK, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            newlines += chunk.count(b"\n")
            chunks.append(chunk)
    data = b"".join(reversed(chunks))
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if pos > 0 and lines:
        lines.pop(0)  # begins mid-line
    return [line.decode("utf-8", "replace").rstrip("\r") for line in lines[-records:]]


def read_kmsg(path: str, records: int, limit: int = 64 << 20) -> list[str]:
    """The newest `records` kernel log records (a /dev/kmsg device or a plain file).

    A file is read from its end, never whole: a 300 MB kern.log costs a few blocks.
    """
    if records <= 0:
        return []
    out: deque[str] = deque(maxlen=records)
    try:
        if stat.S_ISCHR(os.stat(path).st_mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                while True:
                    try:
                        rec = os.read(fd, 8192)
                    except OSError as exc:
                        if exc.errno == errno.EPIPE:  # overwritten while reading: go on
                            continue
                        break  # EAGAIN: the end of the ring
                    if not rec:
                        break
                    out.append(rec.decode("utf-8", "replace").rstrip("\n"))
            finally:
                os.close(fd)
        elif stat.S_ISREG(os.stat(path).st_mode):
            return _tail(path, records, limit)
        else:  # a pipe would block, and its lines belong to the kmsg source
            return [f"(kernel log {path} is neither a device nor a file)"]
    except OSError as exc:
        return [f"(kernel log not readable: {exc})"]
    return list(out)


def _nvml_text(state: State | None) -> str:
    if state is None:
        return "(no NVML snapshot in a one-shot command)\n"
    snap = state.snapshot().sources.get("nvml")
    if snap is None:
        return "(NVML source not running)\n"
    lines = [f"# nvml ok={snap.ok} error={snap.error!r} at {snap.timestamp:.3f}"]
    lines += [f"# status {k}: {v}" for k, v in sorted(snap.status.items()) if k != "workloads"]
    for s in snap.samples:
        labels = ",".join(f'{k}="{v}"' for k, v in s.labels)
        lines.append(f"{s.name}{{{labels}}} {s.value:g}")
    return "\n".join(lines) + "\n"


class _Pending(NamedTuple):
    """A bundle waiting for the writer thread."""

    key: str
    finding: Finding
    why: str
    first: bool  # the first incident of its chain


class EvidenceRecorder:
    """Writes one bundle per critical incident; a health-engine and hang-monitor listener.

    `start()` runs the writer thread; until then (one-shot use, tests) a
    listener call writes in the caller's thread.
    """

    def __init__(
        self,
        cfg: Config,
        store: EventStore | None,
        state: State | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.cfg = cfg
        self._store = store
        self._state = state
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()  # what is done, queued and counted
        self._wake = threading.Condition(self._lock)
        self._write_lock = threading.Lock()  # one bundle written at a time
        self._queue: deque[_Pending] = deque()
        self._dropped: OrderedDict[str, None] = OrderedDict()
        self._last_raised = -math.inf  # monotonic time of the latest incident
        self._full_logged = False  # the queue's overflow was logged
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.written = 0
        self.drops = {"queue_full": 0, "write_failed": 0}
        self.quarantined = _quarantine_damaged(cfg, self._clock.time())
        self._done: dict[str, str] = {
            str(m["incident"]): str(m["id"]) for m in reversed(list_bundles(cfg))
        }

    # --- the writer thread ------------------------------------------------------------

    def start(self) -> None:
        """Start the writer thread (the daemon)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="evidence", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Write what waits (first bundles of a chain first) within `timeout`, then stop."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("evidence writer still busy after %.0fs at stop", timeout)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._wake.wait()
                if not self._queue:
                    return
                # at stop, the first bundles of a chain go before the others
                pick = next((p for p in self._queue if p.first), None) if self._stopping else None
                item = pick or self._queue[0]
                self._queue.remove(item)
            try:
                self._write_pending(item)
            except Exception:  # a bug must not end the writer: later bundles still come
                log.exception("evidence bundle for %s", item.key)

    # --- listener and remediation -------------------------------------------------------

    def update(self, findings: Iterable[Finding], now: float | None = None) -> None:
        """Listener: queue a bundle for each critical finding not bundled yet (never blocks
        on the disk once started)."""
        if not self.cfg.evidence.enabled:
            return
        for f in findings:
            if f.severity < Severity.CRITICAL:
                continue
            key = incident_key(f)
            with self._lock:
                if key in self._done or key in self._dropped or self._queued(key):
                    continue
                item = _Pending(key, f, "raised", self._chain_first())
                if self._thread is not None:
                    self._offer(item)
                    continue
            self._write_pending(item)

    def _queued(self, key: str) -> bool:
        return any(p.key == key for p in self._queue)

    def _chain_first(self) -> bool:
        """Whether an incident raised now starts a chain (called with the lock held)."""
        mono = self._clock.monotonic()
        first = mono - self._last_raised > CHAIN_GAP
        self._last_raised = mono
        return first

    def _offer(self, item: _Pending) -> None:
        """Queue a bundle (lock held); when full, a chain's first bundle displaces another."""
        if len(self._queue) < QUEUE_LIMIT:
            self._full_logged = False
        else:
            victim = next((p for p in reversed(self._queue) if not p.first), None)
            if not item.first or victim is None:
                victim = None if item.first else item
            if victim is not None:
                if victim is not item:
                    self._queue.remove(victim)
                self._drop(victim.key, "queue_full")
                if victim is item:
                    return
        self._queue.append(item)
        self._wake.notify()

    def _drop(self, key: str, reason: str) -> None:
        self.drops[reason] += 1
        self._dropped[key] = None
        while len(self._dropped) > DROPS_REMEMBERED:
            self._dropped.popitem(last=False)
        if reason == "write_failed" or not self._full_logged:  # once per overflow
            log.warning("evidence bundle for %s not written: %s", key, reason.replace("_", " "))
            self._full_logged = reason == "queue_full"

    def ensure(self, f: Finding, why: str) -> str:
        """The id of `f`'s incident bundle, written now if there is none ("" if disabled
        or not writable). Never the id of a bundle that is gone."""
        if not self.cfg.evidence.enabled:
            return ""
        key = incident_key(f)
        with self._lock:
            waiting = next((p for p in self._queue if p.key == key), None)
            if waiting is not None:
                self._queue.remove(waiting)  # written here, now: the caller waits for it
                item = waiting._replace(why=why)
            else:
                first = key not in self._done and self._chain_first()
                item = _Pending(key, f, why, first)
        return self._write_pending(item)

    def _write_pending(self, item: _Pending) -> str:
        with self._write_lock:
            with self._lock:
                done = self._done.get(item.key, "")
            if done and os.path.isdir(os.path.join(evidence_root(self.cfg), done)):
                return done
            parts = {"finding.json": json.dumps(finding_json(item.finding), indent=1)}
            try:
                bid = self.write(item.key, item.why, parts, first=item.first)
            except OSError as exc:
                log.warning("evidence bundle for %s not written: %s", item.key, exc)
                with self._lock:
                    self.drops["write_failed"] += 1
                return ""
            with self._lock:
                self._done[item.key] = bid
                self._dropped.pop(item.key, None)
            return bid

    def write(
        self,
        key: str,
        why: str,
        parts: Mapping[str, str],
        t: float | None = None,
        first: bool = False,
    ) -> str:
        """Write a bundle (the given parts plus kernel log, NVML, events); its id."""
        ev = self.cfg.evidence
        t = self._clock.time() if t is None else t
        bid = _bundle_id(key, t)
        final = os.path.join(evidence_root(self.cfg), bid)
        tmp = final + ".tmp"
        os.makedirs(tmp, mode=0o700, exist_ok=True)
        km = self.cfg.sources.kmsg
        path = km.file if km.backend == "file" and km.file else self.cfg.paths.kmsg
        kmsg = "\n".join(read_kmsg(path, ev.kmsg_records, ev.max_bundle_bytes)) + "\n"
        rows = self._store.recent(ev.events) if self._store is not None and ev.events else []
        events = [hang_report_json(row) for row in rows]  # a hang's report as an object
        texts = {
            **parts,
            "kmsg.txt": kmsg,
            "nvml.txt": _nvml_text(self._state),
            "events.json": json.dumps(events, indent=1, default=str),
        }
        budget = ev.max_bundle_bytes - 4096  # room for meta.json
        share = max(1024, budget // max(1, len(texts) + (1 if ev.bug_report else 0)))
        sizes = {}
        for name, text in texts.items():
            data = text.encode()
            if len(data) > share:  # keep the newest part: the end is nearest the incident
                data = b"(cut to fit the bundle)\n" + data[-share:]
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
            sizes[name] = len(data)
        if ev.bug_report:
            sizes.update(self._bug_report(tmp, share))
        meta = {
            "id": bid,
            "incident": key,
            "why": why,
            "time": t,
            "chain_first": first,
            "files": sizes,
        }
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, final)
        with self._lock:
            self.written += 1
        self._prune(keep=bid)
        log.info("evidence bundle %s written (%s: %s)", bid, why, key)
        return bid

    def _bug_report(self, where: str, limit: int) -> dict[str, int]:
        exe = shutil.which("nvidia-bug-report.sh")
        if exe is None:
            return {}
        base = os.path.join(where, "nvidia-bug-report.log")
        try:
            subprocess.run(
                [exe, "--output-file", base],
                capture_output=True,
                check=False,
                timeout=self.cfg.evidence.bug_report_timeout_seconds,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("nvidia-bug-report.sh: %s", exc)
        path = base + ".gz"
        if os.path.exists(path) and os.path.getsize(path) > limit:
            os.remove(path)  # too large for the bundle: say so rather than keep a part
            with open(base + ".cut", "w", encoding="utf-8") as f:
                f.write(f"nvidia-bug-report output over the bundle's {limit} bytes: dropped\n")
        return {
            n: os.path.getsize(os.path.join(where, n))
            for n in os.listdir(where)
            if n.startswith("nvidia-bug-report")
        }

    def _prune(self, keep: str) -> None:
        """Over max_bundles: remove the oldest, a chain's first bundles last, `keep` never."""
        bundles = sorted(
            (m for m in list_bundles(self.cfg) if m["id"] != keep),
            key=lambda m: (m.get("chain_first") is True, m["time"], m["id"]),
        )
        gone = bundles[: max(0, len(bundles) + 1 - self.cfg.evidence.max_bundles)]
        for meta in gone:
            shutil.rmtree(
                os.path.join(evidence_root(self.cfg), str(meta["id"])), ignore_errors=True
            )
        with self._lock:
            ids = {str(m["id"]) for m in gone}
            for key in [k for k, bid in self._done.items() if bid in ids]:
                del self._done[key]  # ensure() writes the incident again, never names a gone one

    def samples(self) -> list[Sample]:
        """The writer's counters (see METRICS)."""
        with self._lock:
            out = [Sample.of("gpuwatchd_evidence_bundles_written_total", self.written)]
            out += [
                Sample.of("gpuwatchd_evidence_bundles_dropped_total", n, reason=reason)
                for reason, n in self.drops.items()
            ]
            out.append(Sample.of("gpuwatchd_evidence_bundles_queued", len(self._queue)))
        out.append(Sample.of("gpuwatchd_evidence_quarantined_total", len(self.quarantined)))
        return out


def _quarantine_damaged(cfg: Config, now: float) -> list[str]:
    """Move aside bundles whose metadata does not read (start-up); where they went."""
    root = evidence_root(cfg)
    moved: list[str] = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if CORRUPT in name or meta_of(root, name) is not None:
            continue
        path = os.path.join(root, name)
        if name.endswith(".tmp"):  # a write cut short by a crash: nothing to keep
            shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            moved.append(quarantine(path, now))
        except OSError as exc:
            log.error("damaged evidence bundle %s cannot be moved aside: %s", path, exc)
            continue
        log.error(
            "evidence bundle %s is damaged (metadata unreadable): moved to %s", path, moved[-1]
        )
    return moved
