"""Xid events from the sources to the tracker, the store and the metrics.

A step of the consumer thread (pipeline/consumers.py): every publish of the kmsg or
NVML source hands its events here, and the 1 s tick releases NVML events
that waited long enough and applies clears other processes recorded.
NVML duplicates of log reports are merged away, each report is
classified and accounted by the tracker, and the resulting events go
to the store together with the kernel log cursor of the same poll, in one
transaction. The tracker's samples are published as extra samples
(owner "xid"); the health engine reads `active(now)`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from gpuwatchd.bootid import read_boot_id
from gpuwatchd.clock import Clock
from gpuwatchd.errors import StoreError
from gpuwatchd.health.alerts import WORKLOAD_ATTRS
from gpuwatchd.health.rules import XidCondition
from gpuwatchd.health.xid import catalog as xid
from gpuwatchd.health.xid.bursts import JOIN_WINDOW, MULTILINE_XIDS, pid_of
from gpuwatchd.health.xid.merge import XidMerger
from gpuwatchd.health.xid.tracker import (
    METRICS as TRACKER_METRICS,
)
from gpuwatchd.health.xid.tracker import (
    ActiveXid,
    Observation,
    TrackerSettings,
    XidTracker,
)
from gpuwatchd.health.xid.workload import attach_mig, attach_workload
from gpuwatchd.model import (
    Clear,
    Event,
    MetricSpec,
    Sample,
    SourceSnapshot,
    XidFields,
)
from gpuwatchd.pci import normalize_bus_id

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.state import NodeSnapshot

__all__ = [
    "EventSink",
    "METRICS",
    "XidStage",
    "xid_condition",
]

log = logging.getLogger("gpuwatchd.health.xid.catalog")

OWNER = "xid"
KINDS = frozenset({"xid", "sxid"})

METRICS: tuple[MetricSpec, ...] = (
    *TRACKER_METRICS,
    MetricSpec(
        "gpuwatchd_xid_nvml_merged_total",
        "counter",
        "NVML Xid events dropped because the kernel log reported the same Xid",
    ),
)


class EventSink(Protocol):
    """What the pipeline needs of the event store (sinks/store.py)."""

    def write(
        self, records: Sequence[tuple[Event, str, int]], cursors: Mapping[str, str] | None = None
    ) -> None: ...

    def events_since(self, since: float) -> list[Event]: ...

    def clears_since(self, since: float) -> Sequence[Clear]: ...

    def clears_after(self, clear_id: int) -> Sequence[Clear]: ...

    def add_clear(
        self,
        who: str,
        *,
        kind: str = "xid",
        pci_bus_id: str = "",
        code: int | None = None,
        reason: str = "",
        reset: bool = False,
        boot_id: str = "",
        when: float | None = None,
    ) -> Clear: ...


class XidStage:
    """Consumer step that turns source events into tracked, stored, exported Xids."""

    def __init__(
        self,
        tracker: XidTracker,
        merger: XidMerger,
        store: EventSink | None,
        publish: Callable[[str, Sequence[Sample]], object],
        clock: Clock,
    ) -> None:
        self.tracker = tracker
        self.merger = merger
        self.store = store
        self._publish_extra = publish
        self.clock = clock
        self._lock = threading.Lock()
        self._cursors: dict[str, str] = {}
        self._store_errors = 0
        self._last_clear_id = 0
        self.log_reports = True  # off for a one-shot `check`: it reports what it found itself
        # NVML reports carry no boot id: the stage stamps this boot's, or a replay's own, so a
        # real run never restores what a replayed capture reported (nor an earlier boot's).
        self.nvml_boot = tracker.boot_id
        self._unlogged: dict[str, tuple[float, Event]] = {}

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        publish: Callable[[str, Sequence[Sample]], object],
        store: EventSink | None,
        clock: Clock,
    ) -> XidStage:
        """Build from config and restore what the store remembers of this boot."""
        tracker = XidTracker(
            xid.from_config(cfg), TrackerSettings.from_config(cfg), read_boot_id(cfg.paths.boot_id)
        )
        merger = XidMerger(cfg.xid.nvml_merge_window, cfg.xid.nvml_hold)
        pipeline = cls(tracker, merger, store, publish, clock)
        if cfg.sources.nvml.replay:
            pipeline.nvml_boot = f"{tracker.boot_id}+replay"
        pipeline.restore()
        return pipeline

    def reconfigure(self, cfg: Config) -> None:
        """Apply a reloaded config (catalog overrides, policies, windows), keeping the state."""
        with self._lock:
            self.tracker.catalog = xid.from_config(cfg)
            self.tracker.settings = TrackerSettings.from_config(cfg)
            self.merger.window = cfg.xid.nvml_merge_window
            self.merger.hold = cfg.xid.nvml_hold
            self._publish(self.clock.time())

    def restore(self) -> None:
        """Replay stored events and this boot's clears into the tracker."""
        if self.store is None:
            return
        since = self.clock.time() - self.tracker.settings.escalate_window
        try:
            events = [e for e in self.store.events_since(since) if e.kind in KINDS]
            rows = self.store.clears_since(since)
        except StoreError as exc:
            log.error("cannot restore Xid state from the store: %s", exc)
            return
        boot = self.tracker.boot_id
        clears = [r for r in rows if r.boot_id in (boot, "")]
        self._last_clear_id = max((r.id for r in rows), default=0)
        with self._lock:
            self.tracker.restore(events, clears, self.clock.time(), self.clock.monotonic())
            self._publish(self.clock.time())
        active = self.tracker.active(self.clock.time(), self.clock.monotonic())
        if active:
            log.info("restored %d active Xid condition(s) from the store", len(active))

    # --- the consumer step ----------------------------------------------------------

    def on_publish(
        self, snap: NodeSnapshot, source: SourceSnapshot | None, events: tuple[Event, ...]
    ) -> None:
        """Consumer step: a source's publish (events, and the kernel log cursor to store)."""
        kmsg = source.kmsg if source is not None else None
        cursor = kmsg.cursor if kmsg is not None else ""
        xids = [e for e in events if e.kind in KINDS]
        nvml = snap.sources.get("nvml")
        gpus = nvml.inventory if nvml is not None else None
        if xids and gpus is not None:
            xids = [attach_mig(e, gpus) for e in xids]
        workloads = snap.sources.get("workloads")
        held = workloads.workloads if workloads is not None else None
        if xids and held is not None:
            known = [*held.current, *held.exited]
            xids = [attach_workload(e, known) for e in xids]
        self._process(xids, {"kmsg": cursor} if cursor else {})

    def tick(self) -> None:
        """Release NVML events that waited long enough, pick up clears, re-publish."""
        self._sync_clears()
        self._process([], {})

    def _process(self, events: list[Event], cursors: dict[str, str]) -> None:
        with self._lock:
            mono, now = self.clock.monotonic(), self.clock.time()
            passed: list[Event] = []
            for ev in events:
                bus = normalize_bus_id(ev.pci_bus_id) if ev.pci_bus_id else ""
                if bus and bus != ev.pci_bus_id:  # one form for every producer (NVML: 8 digits)
                    ev = replace(ev, pci_bus_id=bus)
                passed += self.merger.offer(ev, mono)
            passed += self.merger.due(mono)
            records = []
            for ev in passed:
                if ev.source == "nvml" and ev.xid is not None and not ev.xid.boot_id:
                    ev = ev.carrying(replace(ev.xid, boot_id=self.nvml_boot))
                # its hold counts in monotonic time from when it was logged (its age at arrival)
                obs = self.tracker.observe(ev, seen=mono - max(0.0, now - ev.time))
                records.append((obs.event, obs.burst_id, obs.count))
                self._log_once(obs, mono)
            for bid, (due, ev) in list(self._unlogged.items()):
                if mono >= due:  # the line naming the process did not come
                    del self._unlogged[bid]
                    self._log(ev)
            changed = {k: v for k, v in cursors.items() if v and self._cursors.get(k) != v}
            held = getattr(self.store, "pending", None)  # writes the store retries
            if self.store is not None and (records or changed or (held and held())):
                try:
                    self.store.write(records, changed)
                    self._cursors.update(changed)
                except StoreError as exc:
                    self._store_errors += 1
                    log.error("event store: %s", exc)
            self._publish(now)

    def _log_once(self, obs: Observation, mono: float) -> None:
        """Log a raised report once, with every line of it joined (waits JOIN_WINDOW at most)."""
        if not obs.raised or obs.kind == "repeat":
            return
        names_pid = bool(pid_of(obs.event))
        if obs.kind == "new" and (names_pid or obs.event.code not in MULTILINE_XIDS):
            self._log(obs.event)
        elif obs.kind == "new":
            self._unlogged[obs.burst_id] = (mono + JOIN_WINDOW, obs.event)
        elif obs.burst_id in self._unlogged:  # a line of a report not logged yet
            due = self._unlogged[obs.burst_id][0]
            if names_pid:
                del self._unlogged[obs.burst_id]
                self._log(obs.event)
            else:
                self._unlogged[obs.burst_id] = (due, obs.event)

    def _log(self, ev: Event) -> None:
        fields = ev.xid
        if not self.log_reports or fields is None:
            return
        log.warning(
            "%s %s on %s (GPU %s): %s [%s, %s] %s",
            "SXid" if ev.kind == "sxid" else "Xid",
            ev.code,
            ev.pci_bus_id,
            fields.gpu or "?",
            fields.name,
            ev.severity,
            fields.action,
            ev.message,
            # Upper-case extras become journal fields under systemd (logs.py).
            extra=journal_fields(ev),
        )

    def _publish(self, now: float) -> None:
        samples = self.tracker.samples(now, self.clock.monotonic())
        samples.append(Sample.of("gpuwatchd_xid_nvml_merged_total", self.merger.merged))
        store_samples = getattr(self.store, "samples", None)  # the store's own metrics
        if store_samples is not None:
            samples.extend(store_samples())
        self._publish_extra(OWNER, samples)  # the state skips an unchanged publish

    # --- operator actions -------------------------------------------------------------

    def clear(
        self,
        who: str,
        pci_bus_id: str = "",
        code: int | None = None,
        kind: str = "xid",
        reason: str = "",
    ) -> int:
        """Operator clear: recorded in the store (who, when, what), applied now."""
        now = self.clock.time()
        if self.store is not None:
            row = self.store.add_clear(
                who,
                kind=kind,
                pci_bus_id=pci_bus_id,
                code=code,
                reason=reason,
                boot_id=self.tracker.boot_id,
                when=now,
            )
            self._last_clear_id = max(self._last_clear_id, row.id)
        with self._lock:
            n = self.tracker.clear(
                Clear(time=now, who=who, pci_bus_id=pci_bus_id, code=code, kind=kind, reason=reason)
            )
            self._publish(now)
        return n

    def gpu_reset(self, pci_bus_id: str, who: str = "gpu reset") -> int:
        """A GPU was reset (NVML saw it come back, or an operator said so)."""
        now = self.clock.time()
        if self.store is not None:
            row = self.store.add_clear(
                who, pci_bus_id=pci_bus_id, reset=True, boot_id=self.tracker.boot_id, when=now
            )
            self._last_clear_id = max(self._last_clear_id, row.id)
        with self._lock:
            n = self.tracker.gpu_reset(pci_bus_id, now, who)
            self._publish(now)
        return n

    def replay_clears(self) -> None:
        """Apply every stored clear of this boot again (one-shot `check`: the kernel log
        it re-reads after `restore` holds Xids older than the clears)."""
        self._last_clear_id = 0
        self._sync_clears()

    def _sync_clears(self) -> None:
        """Apply clears another process (the `clear` command) wrote to the store."""
        if self.store is None:
            return
        try:
            rows = self.store.clears_after(self._last_clear_id)
        except StoreError:
            return
        for r in rows:
            self._last_clear_id = max(self._last_clear_id, r.id)
            if r.boot_id not in (self.tracker.boot_id, ""):
                continue
            with self._lock:
                if r.reset:
                    self.tracker.gpu_reset(r.pci_bus_id, r.time, r.who)
                else:
                    self.tracker.clear(r)
            log.info("applied clear by %s: %s %s %s", r.who, r.kind, r.code or "*", r.pci_bus_id)

    def active(self, now: float | None = None) -> list[ActiveXid]:
        """Active Xid/SXid conditions, as the tracker keeps them."""
        with self._lock:
            wall = self.clock.time() if now is None else now
            return self.tracker.active(wall, self.clock.monotonic())

    def conditions(self, now: float | None = None) -> list[XidCondition]:
        """Active Xid/SXid conditions as the Xid rule reads them (the health engine's input)."""
        return [xid_condition(a) for a in self.active(now)]


def xid_condition(a: ActiveXid) -> XidCondition:
    """The Xid rule's view of a tracker's ActiveXid."""
    xid = a.event.xid or XidFields(code=a.code)
    pid = f"pid {xid.attribution.pid}" if xid.attribution.pid is not None else ""
    who = " ".join(x for x in (pid, xid.attribution.process) if x)
    parts = [p for p in (who, xid.detail, xid.escalated, f"active until {a.until}") if p]
    return XidCondition(
        code=a.code,
        pci_bus_id=a.pci_bus_id,
        severity=a.info.severity,
        action=a.info.action,
        name=a.info.name,
        remediation=a.info.remediation,
        since=a.since,
        kind=a.kind,
        count=a.count,
        detail="; ".join(parts),
        workload=tuple((k, v) for k, v in xid.placement() if k in WORKLOAD_ATTRS),
        process=who,
    )


def journal_fields(ev: Event) -> dict[str, str]:
    """Structured fields for the journal entry of an Xid/SXid report (its payload's
    fields; the job's read from the attrs view, as the store keeps them)."""
    xid = ev.xid or XidFields(code=ev.code or 0)
    fields = {
        "XID" if ev.kind == "xid" else "SXID": str(ev.code),
        "PCI_BUS_ID": ev.pci_bus_id,
        "GPU_UUID": xid.uuid,
        "GPU_INDEX": xid.gpu,
        "XID_SEVERITY": str(ev.severity),
        "XID_ACTION": xid.action,
        "XID_PID": "" if xid.attribution.pid is None else str(xid.attribution.pid),
        "XID_PROCESS": xid.attribution.process,
        "XID_RANK": ev.attr("rank"),
        "K8S_NAMESPACE": ev.attr("namespace"),
        "K8S_POD": ev.attr("pod"),
        "SLURM_JOB_ID": ev.attr("slurm_job"),
    }
    return {k: v for k, v in fields.items() if v}
