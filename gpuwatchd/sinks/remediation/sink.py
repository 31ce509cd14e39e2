"""Opt-in remediation as a sink: the health engine's findings in, Slurm drains
and Kubernetes conditions/taints out, on a thread of its own so a slow
scontrol or API server never holds up the engine.

Every action is logged, stored as an event (kind `remediation`) and counted.
An engaged action stays engaged until an operator runs `gpuwatchd clear
--resume`, which stores a `resumed` event the sink picks up; after that a
still-open critical condition must hold for the hold time again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.errors import GpuwatchdError
from gpuwatchd.model import Event, Finding, MetricSpec, Sample, Severity
from gpuwatchd.sinks.remediation.kubernetes import KubernetesNode
from gpuwatchd.sinks.remediation.policy import (
    ACTIONS,
    REASON_PREFIX,
    Decision,
    due,
    enabled_actions,
    reason_text,
)
from gpuwatchd.sinks.remediation.slurm import SlurmNodes
from gpuwatchd.sinks.store import EventStore

__all__ = ["METRICS", "RESULTS", "RemediationSink", "engaged_actions", "record", "spread_offset"]

log = logging.getLogger("gpuwatchd.remediation")

RESULTS = ("done", "failed", "guarded")
RETRY_SECONDS = 60.0  # after a failed or guarded attempt
EVENT_KIND = "remediation"

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_remediation_actions_total",
        "counter",
        "Remediation attempts by action (slurm_drain, kubernetes_condition, kubernetes_taint)"
        " and result (done; failed; guarded: the fleet-wide drain cap held it back).",
        ("action", "result"),
    ),
    MetricSpec(
        "gpuwatchd_remediation_engaged",
        "gauge",
        "1 while an action taken by gpuwatchd is in effect (until `gpuwatchd clear --resume`).",
        ("action",),
    ),
)


def record(
    store: EventStore, action: str, result: str, message: str, t: float, **attrs: str
) -> None:
    """Store one remediation step as an event."""
    sev = Severity.CRITICAL if result == "done" else Severity.INFO
    ev = Event(
        kind=EVENT_KIND,
        source="remediation",
        time=t,
        message=message,
        severity=sev,
        attrs=tuple(sorted({"action": action, "result": result, **attrs}.items())),
    )
    store.write([(ev, "", 1)])


def engaged_actions(store: EventStore) -> tuple[set[str], float]:
    """Actions in effect (done, not resumed since) and the time of the last resume."""
    engaged: set[str] = set()
    settled: set[str] = set()
    resumed_at = 0.0
    for row in store.recent(1000, kind=EVENT_KIND):  # newest first
        attrs = row.get("attrs") or {}
        action, result = attrs.get("action", ""), attrs.get("result", "")
        if result == "resumed":
            resumed_at = max(resumed_at, float(row.get("time") or 0.0))
            settled.update(ACTIONS if action == "all" else (action,))
        elif result == "done" and action not in settled:
            engaged.add(action)
            settled.add(action)
    return engaged, resumed_at


class RemediationSink:
    """Takes the opted-in actions for critical conditions held long enough."""

    def __init__(
        self,
        cfg: Config,
        clock: Clock,
        node: str,
        store: EventStore,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self._store = store
        self._node = node
        self.slurm = SlurmNodes(cfg, node, env)
        self.kube = KubernetesNode(cfg, node)
        self._findings: list[Finding] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counts = {(a, r): 0 for a in ACTIONS for r in RESULTS}
        self._retry_at: dict[str, float] = {}
        self._engaged, self._resumed_at = engaged_actions(store)
        self._spread = spread_offset(self.slurm.node, cfg.remediation.slurm.spread_seconds)
        # Called before any action with the finding; returns the evidence bundle's id.
        self.before_act: Callable[[Finding], str] | None = None

    @property
    def active(self) -> bool:
        return bool(enabled_actions(self.cfg))

    def update(self, findings: Iterable[Finding], now: float | None = None) -> None:
        """HealthEngine listener: remember the open findings and wake the worker."""
        with self._lock:
            self._findings = list(findings)
        self._wake.set()

    def start(self) -> None:
        if not self.active:
            return
        actions = enabled_actions(self.cfg)
        log.info("remediation on: %s", ", ".join(actions))
        kube = [a for a in actions if a.startswith("kubernetes")]
        if kube and importlib.util.find_spec("kubernetes") is None:
            log.error(
                "remediation %s configured, but the kubernetes Python client is not installed"
                " (pip install gpuwatchd[kubernetes]); each attempt will fail",
                ", ".join(kube),
            )
        self._thread = threading.Thread(target=self._loop, name="remediation", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(self._clock.time())
            except Exception:
                log.exception("remediation step")
            self._wake.wait(1.0)
            self._wake.clear()

    def step(self, now: float) -> list[Decision]:
        """One pass: pick up operator resumes, then take what is due; returns what was tried."""
        self._engaged, self._resumed_at = engaged_actions(self._store)
        with self._lock:
            findings = [f for f in self._findings if f.since]
        # After a resume, an old condition must hold for the hold time again.
        findings = [_since_at_least(f, self._resumed_at) for f in findings]
        tried = []
        for d in due(self.cfg, findings, now, self._engaged):
            if now < self._retry_at.get(d.action, 0.0):
                continue
            held = now - d.finding.since - self.cfg.remediation.hold_seconds
            if d.action == "slurm_drain" and held < self._spread:
                continue
            tried.append(d)
            self._take(d, now)
        return tried

    def _take(self, d: Decision, now: float) -> None:
        reason = reason_text(d.finding)
        try:
            if d.action == "slurm_drain" and not self._guard_allows(d, now, reason):
                return
            evidence = self.before_act(d.finding) if self.before_act is not None else ""
            self._act(d, reason)
        except Exception as exc:  # a bug or a surprise must not retry every second either
            if not isinstance(exc, (GpuwatchdError, OSError)):
                log.exception("remediation %s", d.action)
            self._retry_at[d.action] = now + RETRY_SECONDS
            self._result(d.action, "failed", f"{d.action} failed: {exc}", now, reason)
            log.error("remediation %s failed: %s (retry in %.0fs)", d.action, exc, RETRY_SECONDS)
            return
        self._engaged.add(d.action)
        bundle = f" (evidence {evidence})" if evidence else ""
        self._result(d.action, "done", f"{d.action}: {reason}{bundle}", now, reason)
        log.warning("remediation %s on %s: %s", d.action, self._node, reason)

    def _act(self, d: Decision, reason: str) -> None:
        if d.action == "slurm_drain":
            self.slurm.drain(reason)
        elif d.action == "kubernetes_condition":
            self.kube.set_condition(False, d.finding.alertname, reason)
        elif d.action == "kubernetes_taint":
            self.kube.taint(d.finding.alertname)

    def _guard_allows(self, d: Decision, now: float, reason: str) -> bool:
        sl = self.cfg.remediation.slurm
        drained = self.slurm.drained_by_us(now - sl.guard_window_seconds, REASON_PREFIX)
        others = [n for n in drained if n != self.slurm.node]
        if len(others) < sl.max_drains:
            return True
        msg = (
            f"slurm_drain held back: {len(others)} node(s) already drained by gpuwatchd within"
            f" {sl.guard_window_seconds:g}s (remediation.slurm.max_drains {sl.max_drains}):"
            f" {', '.join(others[:5])}"
        )
        self._result(d.action, "guarded", msg, now, reason)
        log.error("%s", msg)
        self._retry_at[d.action] = now + RETRY_SECONDS
        return False

    def _result(self, action: str, result: str, message: str, now: float, reason: str) -> None:
        with self._lock:
            self._counts[(action, result)] += 1
        record(self._store, action, result, message, now, reason=reason, node=self._node)

    def samples(self) -> list[Sample]:
        """The sink's metrics (see METRICS); only the opted-in actions."""
        actions = enabled_actions(self.cfg)
        with self._lock:
            out = [
                Sample.of("gpuwatchd_remediation_actions_total", n, action=a, result=r)
                for (a, r), n in self._counts.items()
                if a in actions
            ]
        out += [
            Sample.of("gpuwatchd_remediation_engaged", int(a in self._engaged), action=a)
            for a in actions
        ]
        return out

    def status(self) -> dict[str, Any]:
        """JSON-able view for /status."""
        return {
            "actions": enabled_actions(self.cfg),
            "engaged": sorted(self._engaged),
            "hold_seconds": self.cfg.remediation.hold_seconds,
        }


def spread_offset(node: str, spread: float) -> float:
    """This node's fixed share of `spread` seconds (the same across restarts)."""
    digest = hashlib.sha256(node.encode()).digest()
    return spread * int.from_bytes(digest[:4], "big") / 2**32


def _since_at_least(f: Finding, t: float) -> Finding:
    if f.since >= t:
        return f
    return Finding(
        f.rule, f.alertname, f.scope, f.subject, f.severity, f.reason, f.action,
        f.remediation, f.labels, t,
    )  # fmt: skip
