"""Health engine: runs the rules after each poll and event, keeps open conditions.

In the daemon the engine runs on the pipeline's consumer thread (after the
Xid stage, for each source publish, and on the 1 s tick); one lock
serialises evaluations against /status readers. Each evaluation: observe
the snapshot into History, run the rules, apply `for_seconds` (a condition
must last that long before it opens), track open/resolved transitions
with their `since`, then publish: `state.set_findings`, the roll-up
samples (health/rollup.py) via `state.publish_extra`, and the open
findings to listeners (the Alertmanager sink) when they changed.

Findings that other parts hold (the hang monitor's JobHangSuspected) are
pulled from `FindingsProvider`s at each evaluation, beside the rules' own,
so every alert goes through the same `for_seconds`, `disabled_rules`,
transitions and listeners: one alert path. A provider's `version` moves when
its findings change, so a quiet tick still picks the change up.

A tick on a quiet node is skipped: with nothing open or pending, no new
snapshot generation, no operator clear and before the earliest time a
time-based finding can appear (the rules' `due` in health/ruleset.py), every rule would give
the same answer as at the last evaluation.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config, HealthConfig
from gpuwatchd.health import ruleset
from gpuwatchd.health.history import History, View, gpu_key
from gpuwatchd.health.node_rules import NodeRules
from gpuwatchd.health.rollup import (
    METRICS,
    Rollup,
    health_samples,
    roll_up,
    status_json,
)
from gpuwatchd.health.rules import Inputs, XidCondition
from gpuwatchd.health.stuck import StuckDetector, StuckThresholds, proc_describer
from gpuwatchd.model import (
    Clear,
    Event,
    Finding,
    Labels,
    Sample,
    Severity,
    SourceSnapshot,
)
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.state import NodeSnapshot, State

__all__ = [
    "FindingsProvider",
    "HealthEngine",
    "METRICS",
    "store_clears",
]

log = logging.getLogger("gpuwatchd.health")

Listener = Callable[[Sequence[Finding], float], None]
Key = tuple[str, Labels, Labels]
XidProvider = Callable[[float], Sequence[XidCondition]]  # XidStage.conditions
ClearFetcher = Callable[[float], Sequence[Clear]]


class FindingsProvider(Protocol):
    """Findings held outside the rules (the hang monitor's), pulled at each evaluation."""

    @property
    def version(self) -> int:
        """Moves whenever `findings()` would answer differently."""
        ...

    def findings(self) -> Sequence[Finding]: ...


def store_clears(store: Any) -> ClearFetcher:
    """A ClearFetcher over the event store (sinks/store.py `clears_since`)."""

    def fetch(since: float) -> list[Clear]:
        return list(store.clears_since(since))

    return fetch


def _key(f: Finding) -> Key:
    return (f.alertname, f.subject, f.labels)


class HealthEngine:
    """Thread-safe evaluator; the consumer thread calls `on_publish` and `tick`."""

    def __init__(
        self,
        cfg: Config,
        clock: Clock,
        state: State | None = None,
        xids: XidProvider | None = None,
        expected_sources: Iterable[str] = (),
        clears: ClearFetcher | None = None,
        baseline_gpus: int = 0,
        on_baseline: Callable[[int], None] | None = None,
        log_transitions: bool = True,
    ) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._state = state
        self._xids = xids
        self._listeners: list[Listener] = []
        self._clear_hooks: list[Callable[[Clear], None]] = []
        self.history = History(cfg.health.rate_window_seconds)
        self._pending: dict[Key, tuple[float, float]] = {}  # first seen: wall, monotonic
        self._open: dict[Key, Finding] = {}
        # every rule from the start, so the counter exists at 0 before anything fails
        self._rule_errors: dict[str, int] = dict.fromkeys(
            ["xid_tracker", "node_rules", "gpu_stuck"] + [s.name for s in ruleset.RULES],
            0,
        )
        self._started = clock.time()
        self._started_mono = clock.monotonic()
        self._expected = set(expected_sources)
        self._ready = not self._expected
        self._last_sent: tuple[Finding, ...] | None = None
        self._last_view: View | None = None
        self._fetch_clears = clears
        self._last_inputs: dict[str, tuple[bool, tuple[Sample, ...]]] = {}
        self._last_eval = float("-inf")
        self.evaluations = 0  # rule runs so far (a skipped quiet tick runs none)
        self._quiet_generation: int | None = None  # the state's, after the last evaluation
        self._clears_seen: set[int] = set()
        self._providers: list[tuple[str, FindingsProvider]] = []
        self._provider_versions: tuple[int, ...] = ()  # as of the last evaluation
        # The GPU count seen at first start survives restarts through `on_baseline`.
        self.history.restore(baseline_gpus)
        self._saved_baseline = baseline_gpus
        self._on_baseline = on_baseline
        self._log_transitions = log_transitions  # off for one-shot `check` (it reports itself)
        self.reconfigure(cfg)

    def reconfigure(self, cfg: Config) -> None:
        """Take a new config (SIGHUP); memory and open conditions are kept."""
        with self._lock:
            self.cfg = cfg
            self._quiet_generation = None  # new thresholds: evaluate on the next tick
            self.history.window = cfg.health.rate_window_seconds
            self._for = {**HealthConfig().for_seconds, **cfg.health.for_seconds}
            # Rules of other modules that keep their own state between polls.
            self._node_rules = NodeRules(cfg)
            self._stuck = StuckDetector(
                StuckThresholds.from_config(cfg),
                self._clock,
                proc_describer(cfg.paths.procfs, cfg.xid.alert_cmdline),
            )

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(open_findings, now)` whenever the open set or its text changes."""
        self._listeners.append(listener)
        self._quiet_generation = None

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling `listener` (e.g. the old alert sink after a reload)."""
        if listener in self._listeners:
            self._listeners.remove(listener)
        self._last_sent = None  # the next listener gets the current set at once
        self._quiet_generation = None

    def add_provider(self, name: str, provider: FindingsProvider) -> None:
        """Pull `provider`'s findings at every evaluation (counted as rule `name` if it
        raises)."""
        with self._lock:
            self._providers.append((name, provider))
            self._quiet_generation = None

    def _versions(self) -> tuple[int, ...]:
        return tuple(p.version for _, p in self._providers)

    def on_clear(self, hook: Callable[[Clear], None]) -> None:
        """Also tell `hook` about operator clears (e.g. the Xid tracker)."""
        self._clear_hooks.append(hook)

    # --- input -----------------------------------------------------------------

    def on_publish(
        self, snap: NodeSnapshot, source: SourceSnapshot | None, events: tuple[Event, ...]
    ) -> None:
        """Consumer step: evaluate with the snapshot after a source's publish.

        A publish that changes nothing within a second of the last evaluation
        (the kernel log source publishes every half second while the log is
        quiet) is skipped: nothing a rule reads has moved, and time-based
        rules are covered by the next publish or the consumer's 1 s tick.
        """
        if source is not None and not events:
            key = (source.ok, source.samples)
            now = self._clock.time()
            with self._lock:
                same = self._last_inputs.get(source.source) == key
                self._last_inputs[source.source] = key
                moved = self._versions() != self._provider_versions
                if same and not moved and 0 <= now - self._last_eval < 1.0:
                    return
        self.evaluate(snap)

    def evaluate(self, snap: NodeSnapshot | None = None, now: float | None = None) -> list[Finding]:
        """Run every rule now; returns the open findings (also on a periodic tick)."""
        with self._lock:
            now = self._clock.time() if now is None else now
            if snap is None:
                snap = self._state.snapshot() if self._state is not None else NodeSnapshot()
            self._last_eval = now
            self.evaluations += 1
            self._provider_versions = self._versions()
            view = View(snap)
            self._last_view = view
            mono = self._clock.monotonic()  # durations; `now` (wall) is for display
            self.history.observe(view, now, mono)
            self._save_baseline()
            xids = self._active_xids(now)
            raw = self._run_rules(Inputs(view, self.history, self.cfg, now, xids, mono))
            current = self._transition(raw, now, mono)
            if not self._ready:
                seen = set(snap.sources)
                waited = mono - self._started_mono >= self.cfg.health.startup_grace_seconds
                self._ready = self._expected <= seen or waited
            self._publish(current, view, now)
            if self._state is not None:
                self._quiet_generation = self._state.snapshot().generation
            return list(current)

    def tick(self, now: float | None = None) -> list[Finding]:
        """The consumer's 1 s tick: pick up operator clears, then evaluate.

        Hold times and for-durations expire even when no source publishes;
        a quiet tick (see the module docstring) returns the open set unevaluated.
        """
        applied = False
        if self._fetch_clears is not None:
            try:
                rows = self._fetch_clears(self._started)
            except Exception:
                log.exception("reading operator clears")
                rows = ()
            for row in rows:
                if row.id not in self._clears_seen:
                    self._clears_seen.add(row.id)
                    self.apply_clear(row, evaluate=False)
                    applied = True
        now = self._clock.time() if now is None else now
        with self._lock:
            if not applied and self._quiet(now):
                return []
            return self.evaluate(now=now)

    def _quiet(self, now: float) -> bool:
        """Whether every rule would answer as at the last evaluation (module docstring)."""
        if self._state is None or not self._ready or self._open or self._pending:
            return False
        snap = self._state.snapshot()
        if snap.generation != self._quiet_generation:
            return False
        if self._versions() != self._provider_versions:
            return False
        if now - self._last_eval >= ruleset.MAX_QUIET_SECONDS or now < self._last_eval:
            return False
        return now < ruleset.next_change(snap, self.history, self.cfg)

    def _save_baseline(self) -> None:
        count = self.history.max_gpus
        if count != self._saved_baseline and self._on_baseline is not None:
            try:
                self._on_baseline(count)
                self._saved_baseline = count
            except Exception:
                log.exception("saving the GPU count baseline")

    def _active_xids(self, now: float) -> Sequence[XidCondition]:
        if self._xids is None:
            return ()
        try:
            return list(self._xids(now))
        except Exception:
            log.exception("reading the active Xids")
            self._rule_errors["xid_tracker"] = self._rule_errors.get("xid_tracker", 0) + 1
            return ()

    def _run_rules(self, inp: Inputs) -> list[Finding]:
        out: list[Finding] = []
        disabled = set(self.cfg.health.disabled_rules)
        snap = inp.view.snapshot
        stateful: list[tuple[str, Callable[[], list[Finding]]]] = [
            ("node_rules", lambda: self._node_rules.evaluate(snap)),
            ("gpu_stuck", lambda: self._stuck.evaluate(snap)),
        ]
        for spec in ruleset.RULES:
            stateful.append((spec.name, functools.partial(spec.rule, inp)))
        for name, provider in self._providers:
            stateful.append((name, functools.partial(_pulled, provider)))
        for name, run in stateful:
            try:
                found = run()
            except Exception:
                self._rule_errors[name] = self._rule_errors.get(name, 0) + 1
                log.exception("health rule %s raised", name)
                continue
            out.extend(f for f in found if f.alertname not in disabled)
        return out

    def _transition(self, raw: Sequence[Finding], now: float, mono: float) -> tuple[Finding, ...]:
        worst: dict[Key, Finding] = {}
        for f in raw:
            k = _key(f)
            if k not in worst or f.severity > worst[k].severity:
                worst[k] = f
        for k in list(self._pending):
            if k not in worst:
                del self._pending[k]
        for k, old in list(self._open.items()):
            if k not in worst:
                del self._open[k]
                if self._log_transitions:
                    log.info("resolved: %s %s", old.alertname, _fmt(old.subject + old.labels))
        for k, f in worst.items():
            first, first_mono = self._pending.setdefault(k, (now, mono))
            if mono - first_mono < self._for.get(f.alertname, 0.0):
                continue
            prev = self._open.get(k)
            if prev is not None:
                since = prev.since
            else:
                since = min(f.since, first) if f.since else first
                if self._log_transitions:
                    level = logging.ERROR if f.severity >= Severity.CRITICAL else logging.WARNING
                    log.log(
                        level,
                        "%s: %s %s: %s",
                        f.severity,
                        f.alertname,
                        _fmt(f.subject + f.labels),
                        f.reason,
                    )
            self._open[k] = _with_since(f, since)
        return tuple(sorted(self._open.values(), key=lambda f: (-f.severity, _key(f))))

    # --- operator clears -------------------------------------------------------

    def apply_clear(self, clear: Clear, evaluate: bool = True) -> None:
        """Forget the memory behind sticky conditions of the target (or all GPUs)."""
        self._clears_seen.add(clear.id)
        self._quiet_generation = None  # the memory changed: evaluate on the next tick
        if clear.code is not None:  # one Xid code only: the tracker's business
            for hook in self._clear_hooks:
                hook(clear)
            if evaluate:
                self.evaluate()
            return
        with self._lock:
            h = self.history
            view = self._last_view
            keys = set(h.gpus_seen) | (set(view.gpus) if view else set())
            if clear.pci_bus_id:  # a bus id; an index or UUID is matched too
                want = {clear.pci_bus_id, normalize_bus_id(clear.pci_bus_id)} - {""}
                keys = {k for k in keys if want & _ids(h, view, k)}
            for rk in [rk for rk in h.last_rise if gpu_key(dict(rk[1])) in keys]:
                del h.last_rise[rk]
            h.links_up = {(k, link) for k, link in h.links_up if k not in keys}
            for k in keys:
                h.gpus_seen.pop(k, None)
            if not clear.pci_bus_id and view is not None:
                h.max_gpus = len(view.gpus)  # a GPU removed on purpose: new baseline
                self._save_baseline()
            every = not clear.pci_bus_id
            for ok in [ok for ok in self._open if gpu_key(dict(ok[1])) in keys or every]:
                self._open.pop(ok, None)
                self._pending.pop(ok, None)
            log.warning(
                "clear %s by %s: %s",
                clear.pci_bus_id or "all",
                clear.who or "?",
                clear.reason or "(no reason)",
            )
        for hook in self._clear_hooks:
            hook(clear)
        if evaluate:
            self.evaluate()

    # --- output ----------------------------------------------------------------

    def _publish(self, current: tuple[Finding, ...], view: View, now: float) -> None:
        if self._state is not None:
            self._state.set_findings(current)  # the state skips an unchanged publish
            self._state.publish_extra("health", self.samples(current, view))
        if self._ready and current != self._last_sent:
            self._last_sent = current
            for listener in self._listeners:
                try:
                    listener(current, now)
                except Exception:
                    log.exception("health listener %r", listener)

    def gpu_count(self) -> int:
        """GPUs NVML listed in the last evaluated snapshot."""
        view = self._last_view
        return len(view.gpus) if view is not None else 0

    def open_findings(self) -> tuple[Finding, ...]:
        with self._lock:
            return tuple(sorted(self._open.values(), key=lambda f: (-f.severity, _key(f))))

    def rollup(self) -> Rollup:
        """Health per node, component and GPU."""
        with self._lock:
            view = self._last_view
            open_ = list(self._open.values())
        return roll_up(open_, view, self._expected)

    def samples(
        self, current: Sequence[Finding] | None = None, view: View | None = None
    ) -> list[Sample]:
        """gpuwatchd_health and friends (see METRICS)."""
        view = view or self._last_view
        findings = current if current is not None else self.open_findings()
        with self._lock:
            errors = dict(self._rule_errors)
            expected = self.cfg.health.expected_gpus or self.history.max_gpus
            seen = dict(self.history.gpus_seen)
        return health_samples(self.rollup(), findings, view, seen, errors, expected)

    def status(self) -> dict[str, object]:
        """JSON-able health for /status."""
        return status_json(self.rollup(), self._last_view, self.open_findings())


def _pulled(provider: FindingsProvider) -> list[Finding]:
    return list(provider.findings())


def _with_since(f: Finding, since: float) -> Finding:
    if f.since == since:
        return f
    return Finding(
        f.rule,
        f.alertname,
        f.scope,
        f.subject,
        f.severity,
        f.reason,
        f.action,
        f.remediation,
        f.labels,
        since,
    )


def _ids(h: History, view: View | None, key: str) -> set[str]:
    gpu = (view.gpus.get(key) if view else None) or h.gpus_seen.get(key)
    if gpu is None:
        return {key}
    return {str(gpu.index), gpu.uuid, gpu.pci_bus_id} - {""}


def _fmt(labels: Labels) -> str:
    return "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"
