"""Evidence bundles: what the node looked like when a critical condition was raised.

One bundle per incident (alert name and subject) under
<state_dir>/evidence/<id>/: the newest kernel log records, the NVML
samples and source status, the newest stored events, the incident's own
detail (a hang's stacks, NCCL RAS answer and flight-recorder dumps travel in
its finding and stored events), and `nvidia-bug-report.sh` output when
configured. Bounded in size per bundle and in count; written before
remediation acts and whenever a critical finding first opens.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpuwatchd.config import Config
from gpuwatchd.health.rollup import finding_json
from gpuwatchd.model import Finding, Severity
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import State

__all__ = [
    "EVIDENCE_DIR",
    "EvidenceRecorder",
    "evidence_route",
    "incident_key",
    "list_bundles",
    "read_bundle",
]

log = logging.getLogger("gpuwatchd.evidence")

EVIDENCE_DIR = "evidence"
META = "meta.json"
PARTS = ("finding.json", "kmsg.txt", "nvml.txt", "events.json", "nvidia-bug-report.log.gz")


def incident_key(f: Finding) -> str:
    """Alert name and subject: one incident, one bundle."""
    return f.alertname + "|" + ",".join(f"{k}={v}" for k, v in f.subject)


def _bundle_id(key: str, t: float) -> str:
    import hashlib  # here: it maps libcrypto, and only a bundle being written needs it

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))
    digest = hashlib.sha1(f"{key}|{t}".encode()).hexdigest()[:10]
    return f"{stamp}-{digest}"


def _root(cfg: Config) -> str:
    return os.path.join(cfg.daemon.state_dir, EVIDENCE_DIR)


def read_kmsg(path: str, records: int) -> list[str]:
    """The newest `records` kernel log records (a /dev/kmsg device or a plain file)."""
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
            with open(path, encoding="utf-8", errors="replace") as f:
                out.extend(line.rstrip("\n") for line in f)
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


class EvidenceRecorder:
    """Writes one bundle per critical incident; a health-engine and hang-monitor listener."""

    def __init__(self, cfg: Config, store: EventStore | None, state: State | None = None) -> None:
        self.cfg = cfg
        self._store = store
        self._state = state
        self._lock = threading.Lock()
        self._done: dict[str, str] = {
            str(m.get("incident", "")): str(m["id"]) for m in reversed(list_bundles(cfg))
        }

    def update(self, findings: Iterable[Finding], now: float | None = None) -> None:
        """Listener: a bundle for each critical finding not bundled yet (bug reports on a
        thread of their own: they take minutes)."""
        new = [f for f in findings if f.severity >= Severity.CRITICAL and self._missing(f)]
        for f in new:
            if self.cfg.evidence.bug_report:
                threading.Thread(target=self.ensure, args=(f, "raised"), daemon=True).start()
            else:
                self.ensure(f, "raised")

    def _missing(self, f: Finding) -> bool:
        with self._lock:
            return self.cfg.evidence.enabled and incident_key(f) not in self._done

    def ensure(self, f: Finding, why: str) -> str:
        """The id of `f`'s incident bundle, written now if there is none ("" if disabled)."""
        key = incident_key(f)
        with self._lock:
            if not self.cfg.evidence.enabled:
                return ""
            if key in self._done:
                return self._done[key]
            try:
                bid = self.write(key, why, {"finding.json": json.dumps(finding_json(f), indent=1)})
            except OSError as exc:
                log.warning("evidence bundle for %s not written: %s", key, exc)
                return ""
            self._done[key] = bid
            return bid

    def write(self, key: str, why: str, parts: Mapping[str, str], t: float | None = None) -> str:
        """Write a bundle (the given parts plus kernel log, NVML, events); its id."""
        ev = self.cfg.evidence
        t = time.time() if t is None else t
        bid = _bundle_id(key, t)
        final = os.path.join(_root(self.cfg), bid)
        tmp = final + ".tmp"
        os.makedirs(tmp, mode=0o700, exist_ok=True)
        km = self.cfg.sources.kmsg
        path = km.file if km.backend == "file" and km.file else self.cfg.paths.kmsg
        kmsg = "\n".join(read_kmsg(path, ev.kmsg_records)) + "\n"
        events = self._store.recent(ev.events) if self._store is not None and ev.events else []
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
        meta = {"id": bid, "incident": key, "why": why, "time": t, "files": sizes}
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, final)
        self._prune()
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

    def _prune(self) -> None:
        bundles = sorted(list_bundles(self.cfg), key=lambda m: (m.get("time", 0), m["id"]))
        for meta in bundles[: max(0, len(bundles) - self.cfg.evidence.max_bundles)]:
            shutil.rmtree(os.path.join(_root(self.cfg), str(meta["id"])), ignore_errors=True)


def list_bundles(cfg: Config) -> list[dict[str, Any]]:
    """Every complete bundle's metadata, newest first."""
    root = _root(cfg)
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, name, META), encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue  # being written (.tmp) or damaged
        if isinstance(meta, dict) and meta.get("id") == name:
            out.append(meta)
    return sorted(out, key=lambda m: (m.get("time", 0), m["id"]), reverse=True)


def read_bundle(cfg: Config, bundle_id: str, parts: Sequence[str] = PARTS) -> dict[str, Any] | None:
    """A bundle's metadata and text parts (for /evidence/{id}); None if there is none."""
    if not bundle_id or "/" in bundle_id or bundle_id.startswith("."):
        return None
    for meta in list_bundles(cfg):
        if meta["id"] == bundle_id:
            out: dict[str, Any] = {"meta": meta}
            for name in parts:
                path = os.path.join(_root(cfg), bundle_id, name)
                if os.path.exists(path) and not name.endswith(".gz"):
                    with open(path, encoding="utf-8", errors="replace") as f:
                        out[name] = f.read()
            return out
    return None


def evidence_route(cfg: Config) -> Callable[[Mapping[str, list[str]]], tuple[int, str, bytes]]:
    """GET /evidence (the bundles, newest first) and /evidence/{id} (one, its text parts)."""

    def route(query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        wanted = (query.get("id") or [""])[0]
        if wanted:
            doc = read_bundle(cfg, wanted)
            if doc is None:
                return 404, "text/plain", b"no such evidence bundle\n"
            return 200, "application/json", json.dumps(doc, indent=1).encode() + b"\n"
        bundles = list_bundles(cfg)
        body = {"count": len(bundles), "bundles": bundles}
        return 200, "application/json", json.dumps(body, indent=1).encode() + b"\n"

    return route
