"""Alertmanager API v2 sink with Prometheus' delivery semantics.

Findings become alerts (labels: alertname, severity, node, the subject's
gpu/uuid/pci_bus_id, xid, static labels; annotations: summary,
description, remediation, action, runbook_url; a job hang's cause). Their state lives in the
durable outbox, and one sender thread per Alertmanager POSTs what is due:
changes at once, and every firing or recently resolved alert again each
resend interval, with endsAt = now + 4 x max(poll, resend interval) so
the alerts of a dead daemon expire on their own.

The sink writes nothing into the shared state: its own counters are read
through `samples()` by the consumer thread on its tick.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.health.alerts import summary
from gpuwatchd.health.xid import alert as xid_alert
from gpuwatchd.logs import escape_control
from gpuwatchd.model import Finding, MetricSpec, Sample, Severity
from gpuwatchd.sinks.alertmanager.labels import alert_labels, printable, valid, validate_config
from gpuwatchd.sinks.alertmanager.outbox import RESOLVED_RETENTION, Outbox, StoredAlert
from gpuwatchd.sinks.alertmanager.writer import AlertSet, OutboxWriter

if TYPE_CHECKING:
    from gpuwatchd.sinks.alertmanager.client import AlertmanagerClient

__all__ = [
    "AlertSink",
    "METRICS",
    "alert_labels",
    "validate_config",
]

log = logging.getLogger("gpuwatchd.alertmanager")

MAX_BATCH = 256
_REJECTED = (400, 422)  # the alert itself is bad; anything else is worth a retry

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_alerts_firing", "gauge", "Alerts firing now, by severity.", ("severity",)
    ),
    MetricSpec(
        "gpuwatchd_alertmanager_notifications_total",
        "counter",
        "POSTs of alert batches to each Alertmanager, by result (success, failure).",
        ("alertmanager", "result"),
    ),
    MetricSpec(
        "gpuwatchd_alertmanager_queue_length",
        "gauge",
        "Alerts some configured Alertmanager has not yet acknowledged in their latest state"
        " (those waiting for room in a full outbox included).",
    ),
    MetricSpec(
        "gpuwatchd_alertmanager_dropped_alerts_total",
        "counter",
        "Alerts given up on: queue_full (ended while waiting for room in a full outbox of"
        " alertmanager.max_alerts), invalid labels,"
        " rejected by Alertmanager (HTTP 4xx).",
        ("reason",),
    ),
    MetricSpec(
        "gpuwatchd_alertmanager_deliveries_rejected_total",
        "counter",
        "POSTs an Alertmanager answered with a client error (HTTP 4xx: an alert, the"
        " credentials or the URL is wrong); the alerts of a 400 or 422 are dropped, of other"
        " answers kept and retried. Also counted as result=failure in notifications_total.",
        ("alertmanager",),
    ),
    MetricSpec(
        "gpuwatchd_alertmanager_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the last POST that Alertmanager accepted.",
        ("alertmanager",),
    ),
)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Receiver:
    """One Alertmanager: its sender thread, backoff and counters."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.wake = threading.Event()
        self.lock = threading.Lock()  # one delivery at a time (thread or flush)
        self.thread: threading.Thread | None = None
        self.failures = 0
        self.retry_at = 0.0
        self.results = {"success": 0, "failure": 0}
        self.last_success = 0.0
        self.last_error = ""
        self.rejected = 0  # POSTs answered 4xx
        self.last_rejection = ""
        self.last_rejection_at = 0.0


class AlertSink:
    """Turns findings into durable alerts and delivers them to every Alertmanager."""

    def __init__(
        self,
        cfg: Config,
        db_path: str,
        clock: Clock,
        node: str,
        listen_port: int = 0,
        fsync: Callable[[int], None] | None = None,
    ) -> None:
        validate_config(cfg)
        self.cfg = cfg
        self._am = cfg.alertmanager
        self._clock = clock
        self._node = node
        if fsync is None:
            self._outbox = Outbox(db_path, self._am.max_alerts)
        else:
            self._outbox = Outbox(db_path, self._am.max_alerts, fsync)
        self._receivers = [_Receiver(u) for u in dict.fromkeys(self._am.urls)]
        self._stop = threading.Event()
        self._dropped = {"queue_full": 0, "invalid": 0, "rejected": 0}
        self._current: AlertSet = []
        self._refused: set[str] = set()  # wanted alerts the outbox had no room for
        self._sync_lock = threading.Lock()
        self._refused_seen: set[str] = set()  # each counted once in queue_full
        self._lock = threading.Lock()
        base = self._am.external_url.rstrip("/") or f"http://{node}:{listen_port}"
        self.generator_url = f"{base}/alerts"
        poll = cfg.sources.nvml.interval
        self._ttl = 4 * max(poll, self._am.resend_interval)
        self._client: AlertmanagerClient | None = None
        if self._am.urls:
            from gpuwatchd.sinks.alertmanager.client import AlertmanagerClient

            self._client = AlertmanagerClient(self._am)
        self._deadline: float | None = None  # monotonic; bounds HTTP during flush/stop
        self._writer = OutboxWriter(self._outbox, self._apply, self._sync_lock)
        self._samples_lock = threading.Lock()
        self._samples: list[Sample] = self._compute_samples()

    # --- input ---------------------------------------------------------------

    def update(self, findings: Iterable[Finding], now: float | None = None) -> None:
        """Make the firing alerts those of `findings` (INFO findings never alert)."""
        now = self._clock.time() if now is None else now
        current = []
        for f in findings:
            if f.severity < Severity.WARNING:
                continue
            labels = alert_labels(f, self._node, self._am.static_labels)
            ann = self._annotations(f)
            if not (valid(labels) and valid({"alertname": "x", **ann})):
                with self._lock:
                    self._dropped["invalid"] += 1
                log.error("alert with invalid labels not sent: %s %s", labels, sorted(ann))
                continue
            current.append((labels, ann, f.since or now))
        self._writer.submit(current, now)  # in memory: the disk is the sink's threads' wait

    def _apply(self, current: AlertSet, now: float) -> None:
        """Make the outbox hold `current` (the writer holds the sync lock)."""
        self._current = current
        self._sync(current, now)
        if self._refused:
            for r in self._receivers:
                r.wake.set()  # a sender re-offers them when the outbox has room again

    def _sync(self, current: AlertSet, now: float) -> None:
        result = self._outbox.sync(current, now)
        for a in result.fired:
            log.warning("alert firing: %s: %s", _name(a), a.annotations.get("description", ""))
        for a in result.resolved:
            log.info("alert resolved: %s", _name(a))
        with self._lock:
            # An alert waiting outside the full outbox is sent once room frees; it is
            # dropped (and counted once) only if it ends before it ever got in.
            admitted = {a.fingerprint for a in result.fired}
            gone = self._refused - result.refused - admitted
            self._dropped["queue_full"] += len(gone)
            new = result.refused - self._refused_seen
            self._refused_seen = (self._refused_seen | new) - admitted - gone
            self._refused = set(result.refused)
        if gone:
            log.error("alert queue full: %d alert(s) ended before they could be sent", len(gone))
        if new:
            log.error(
                "alert queue full (%d): %d alert(s) wait outside it (the most severe are kept)",
                self._am.max_alerts,
                len(new),
            )
        self._outbox.prune([r.url for r in self._receivers], now)
        if result.fired or result.resolved:
            for r in self._receivers:
                r.wake.set()
        self._changed()

    def _annotations(self, f: Finding) -> dict[str, str]:
        if f.alertname in xid_alert.ALERTNAMES:  # the Prometheus rule sends the same texts
            ann = xid_alert.texts(f)
        else:
            ann = {
                "summary": summary(f),
                "description": f.reason,
                "remediation": f.remediation,
                "action": str(f.action),
            }
        if f.alertname == "JobHangSuspected":  # the incident's cause, or what was looked at
            ann.update((k, v) for k, v in f.labels if k == "cause" and v)
        if self._am.runbook_base_url:
            ann["runbook_url"] = f"{self._am.runbook_base_url.rstrip('/')}/{f.alertname}.md"
        # Text from kernel log lines and process names can carry undecodable bytes and
        # control characters: never lose an alert for that, never pass them on. Bounded.
        return {k: escape_control(printable(v), 4096) for k, v in ann.items() if v}

    # --- delivery ------------------------------------------------------------

    def start(self) -> None:
        """Start the outbox writer and one sender thread per configured Alertmanager."""
        self._writer.start("alert-sink")
        for i, r in enumerate(self._receivers):
            r.thread = threading.Thread(
                target=self._loop, args=(r,), name=f"alertmanager-{i}", daemon=True
            )
            r.thread.start()

    def stop(self, flush_timeout: float = 5.0, close: bool = True) -> None:
        """Stop the senders after one last delivery attempt, all within `flush_timeout`.

        For SIGTERM: what is not delivered stays in the outbox for the next start.
        `close` False: the outbox stays open for the caller's `close()`, whose
        checkpoint is its one sync (the daemon bounds it at stop).
        """
        end = time.monotonic() + flush_timeout
        self._deadline = end
        self._stop.set()
        self._writer.drain()
        for r in self._receivers:
            r.wake.set()
        for r in self._receivers:
            if r.thread is not None:
                r.thread.join(max(0.0, end - time.monotonic()))
        self.flush(max(0.1, end - time.monotonic()))
        self._writer.stop(max(0.1, end - time.monotonic()), final_sync=close)
        if close:
            self._outbox.close()

    def close(self) -> None:
        """Close the outbox (after `stop(close=False)`); its last connection checkpoints."""
        self._outbox.close()

    def flush(self, timeout: float = 5.0) -> bool:
        """Deliver everything due now, ignoring backoff, within about `timeout` seconds.

        True if every Alertmanager has acknowledged every alert.
        """
        end = time.monotonic() + timeout
        self._deadline = end if self._deadline is None else min(self._deadline, end)
        self._writer.drain()
        ok = True
        try:
            for r in self._receivers:
                if r.lock.acquire(timeout=max(0.0, end - time.monotonic())):
                    try:
                        r.retry_at = 0.0
                        self._deliver(r, self._clock.time())
                    finally:
                        r.lock.release()
                ok = ok and r.failures == 0
        finally:
            if not self._stop.is_set():
                self._deadline = None
        self._changed()
        return ok and self._outbox.undelivered([r.url for r in self._receivers]) == 0

    def _loop(self, r: _Receiver) -> None:
        while not self._stop.is_set():
            try:
                if self._refused:
                    with self._sync_lock:
                        self._sync(self._current, self._clock.time())
                with r.lock:
                    wait = self._deliver(r, self._clock.time())
                if self._stop.is_set():
                    return
                self._changed()
            except Exception:
                if self._stop.is_set():
                    return  # a POST outlived stop() and the outbox is closed: nothing to do
                log.exception("alert sender for %s", r.url)
                wait = 5.0
            r.wake.wait(wait)
            r.wake.clear()

    def _deliver(self, r: _Receiver, now: float) -> float:
        """Send every due batch to `r`; return seconds until the next attempt."""
        mono = self._clock.monotonic()  # the backoff is a duration: a wall step must not stretch it
        if mono < r.retry_at:
            return r.retry_at - mono
        resend = self._am.resend_interval
        for _ in range(1000):  # a bound, not a limit reached in practice
            if self._deadline is not None and time.monotonic() >= self._deadline:
                break
            batch = self._outbox.due(r.url, now, resend, MAX_BATCH)
            if not batch:
                break
            accepted = self._post_batch(r, batch, now)
            if accepted is None:
                r.failures += 1
                delay = min(self._am.retry_max_seconds, 2.0 ** min(r.failures - 1, 16))
                delay = delay / 2 + random.uniform(0, delay / 2)  # equal jitter
                r.retry_at = mono + delay
                return delay
            self._outbox.mark_sent(r.url, accepted, now)
            r.failures = 0
        return max(0.05, self._outbox.next_due(r.url, now, resend))

    def _post_batch(
        self, r: _Receiver, batch: Sequence[StoredAlert], now: float
    ) -> Sequence[StoredAlert] | None:
        """POST a batch; the alerts to mark sent, or None to retry later."""
        status = self._post(r, [self._payload(a, now) for a in batch])
        if status is None or status not in _REJECTED and status >= 300:
            return None  # unreachable, overloaded, or our auth/URL is wrong: keep, retry
        if status < 300:
            return batch
        # 400 means some alert is invalid (Alertmanager still stores the valid ones);
        # send one by one so that only the bad alert is dropped.
        good: list[StoredAlert] = []
        for a in batch:
            one = self._post(r, [self._payload(a, now)]) if len(batch) > 1 else status
            if one is None or one not in _REJECTED and one >= 300:
                return good or None
            if one >= 300:
                with self._lock:
                    self._dropped["rejected"] += 1
                log.error("Alertmanager %s rejected alert %s; dropped", r.url, _name(a))
            good.append(a)
        return good

    def _payload(self, a: StoredAlert, now: float) -> dict[str, object]:
        ends = a.resolved_at if a.resolved_at is not None else now + self._ttl
        return {
            "labels": dict(a.labels),
            "annotations": dict(a.annotations),
            "startsAt": _iso(a.starts_at),
            "endsAt": _iso(ends),
            "generatorURL": self.generator_url,
        }

    def _post(self, r: _Receiver, payload: list[dict[str, object]]) -> int | None:
        """POST to /api/v2/alerts; the HTTP status, or None if no answer came."""
        timeout = self._am.timeout
        if self._deadline is not None:
            timeout = max(0.1, min(timeout, self._deadline - time.monotonic()))
        assert self._client is not None  # a receiver exists only for a configured URL
        result = self._client.post(r.url, payload, timeout)
        if result.status is None and r.failures == 0:
            log.warning("Alertmanager %s unreachable: %s (will retry)", r.url, result.error)
        r.results["success" if result.ok else "failure"] += 1
        r.last_error = result.error
        if result.status is not None and 400 <= result.status < 500:
            r.rejected += 1  # an answer, not an outage: the failure counters alone hide it
            r.last_rejection, r.last_rejection_at = result.error, self._clock.time()
        if result.ok:
            if r.failures:
                log.info("Alertmanager %s reachable again", r.url)
            r.last_success = self._clock.time()
        return result.status

    # --- output --------------------------------------------------------------

    def samples(self) -> list[Sample]:
        """The sink's metrics (see METRICS), as of the last change: never waits for the disk."""
        with self._samples_lock:
            return list(self._samples)

    def _compute_samples(self) -> list[Sample]:
        alerts = self._outbox.alerts()
        firing: dict[str, int] = {"warning": 0, "critical": 0}
        for a in alerts:
            if a.firing:
                sev = a.labels.get("severity", "")
                firing[sev] = firing.get(sev, 0) + 1
        out = [Sample.of("gpuwatchd_alerts_firing", n, severity=s) for s, n in firing.items()]
        for r in self._receivers:
            for result, n in r.results.items():
                out.append(
                    Sample.of(
                        "gpuwatchd_alertmanager_notifications_total",
                        n,
                        alertmanager=r.url,
                        result=result,
                    )
                )
            out.append(
                Sample.of(
                    "gpuwatchd_alertmanager_deliveries_rejected_total",
                    r.rejected,
                    alertmanager=r.url,
                )
            )
            if r.last_success:
                out.append(
                    Sample.of(
                        "gpuwatchd_alertmanager_last_success_timestamp_seconds",
                        r.last_success,
                        alertmanager=r.url,
                    )
                )
        out.append(
            Sample.of(
                "gpuwatchd_alertmanager_queue_length",
                self._outbox.undelivered([r.url for r in self._receivers])
                + (len(self._refused) if self._receivers else 0),
            )
        )
        with self._lock:
            out.extend(
                Sample.of("gpuwatchd_alertmanager_dropped_alerts_total", n, reason=k)
                for k, n in self._dropped.items()
            )
        return out

    def _changed(self) -> None:
        with self._samples_lock:  # computed on the sink's threads, read by the consumer
            self._samples = self._compute_samples()

    def status(self) -> dict[str, object]:
        """JSON-able view for /status and /alerts."""
        now = self._clock.time()
        deliveries = self._outbox.deliveries()
        alerts = []
        for a in self._outbox.alerts():
            marks = deliveries.get(a.fingerprint, {})
            alerts.append(
                {
                    "fingerprint": a.fingerprint,
                    "status": "firing" if a.firing else "resolved",
                    "labels": dict(a.labels),
                    "annotations": dict(a.annotations),
                    "startsAt": _iso(a.starts_at),
                    "endsAt": _iso(a.resolved_at) if a.resolved_at is not None else None,
                    "delivered": {
                        r.url: marks.get(r.url, (0, 0.0))[0] >= a.version for r in self._receivers
                    },
                }
            )
        return {
            "node": self._node,
            "generated_at": _iso(now),
            "resolved_kept_seconds": RESOLVED_RETENTION,
            "outbox_syncs": self._writer.syncs,
            "outbox_slowest_sync_seconds": round(self._writer.slowest_sync, 3),
            "alertmanagers": [
                {
                    "url": r.url,
                    "consecutive_failures": r.failures,
                    "last_error": r.last_error,
                    "last_success": _iso(r.last_success) if r.last_success else None,
                    "rejected_deliveries": r.rejected,
                    "last_rejection": r.last_rejection or None,
                    "last_rejection_at": _iso(r.last_rejection_at) if r.last_rejection else None,
                }
                for r in self._receivers
            ],
            "alerts": alerts,
        }

    def route_alerts(self, query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        """HTTP route for /alerts (?state=firing|resolved filters)."""
        data = self.status()
        want = (query.get("state") or [""])[0]
        if want in ("firing", "resolved"):
            data["alerts"] = [
                a
                for a in data["alerts"]  # type: ignore[attr-defined]
                if a["status"] == want
            ]
        return 200, "application/json", json.dumps(data, indent=1).encode() + b"\n"


def _name(a: StoredAlert) -> str:
    inner = ",".join(f"{k}={v}" for k, v in sorted(a.labels.items()) if k != "alertname")
    return f"{a.labels.get('alertname', '?')}{{{inner}}}"
