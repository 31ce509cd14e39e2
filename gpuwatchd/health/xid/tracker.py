"""What the Xids mean right now: bursts, site policy, escalation, active conditions.

Pure logic over events and times (no I/O, no clock of its own), fed by
health/xid/stage.py and read by the health engine through `active(now)`.

- Repeats of one code on one GPU within `burst_window` collapse into one
  event with a count (one bad node can log 100,000 identical Xid 95s), per
  process: reports naming different pids are different faults.
- Lines of one multi-line report (Xid 13: GPC/TPC/SM, ESR, then the line
  with pid and channel, within a few ms) join into one event (kind "line"):
  it takes the pid and keeps every parsed field; only the first line counts.
- Per-code policy: ignore, N reports within a window before it counts,
  hold time, severity/action overrides (the latter live in the catalog).
- A critical Xid whose action is reset_gpu, reboot_node, drain_and_inspect
  or contact_support stays active until the GPU is reset (reset_gpu only),
  the node reboots (a new boot id: the tracker starts empty) or an operator
  clears it. Anything else stays active for its hold time.
- An Xid that comes back in `escalate_after` different boots or GPU resets
  escalates reset_gpu/reboot_node to drain_and_inspect: rebooting again
  will not fix it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from gpuwatchd.health.xid.bursts import Bursts
from gpuwatchd.health.xid.catalog import KINDS, Catalog, XidInfo
from gpuwatchd.health.xid.policy import Policy, TrackerSettings
from gpuwatchd.model import (
    Action,
    Clear,
    Event,
    MetricSpec,
    Sample,
    Severity,
    XidFields,
    labels_of,
)

__all__ = [
    "ActiveXid",
    "METRICS",
    "Observation",
    "Policy",
    "TrackerSettings",
    "XidTracker",
]

_XID_LABELS = ("gpu", "uuid", "pci_bus_id", "xid", "name", "severity", "action")
_SXID_LABELS = ("pci_bus_id", "sxid", "name", "severity", "action")

METRICS = (
    MetricSpec(
        "gpuwatchd_xid_active",
        "gauge",
        "1 while an Xid's condition is active on a GPU (critical ones until GPU reset, reboot"
        " or operator clear; others for their hold time), 0 once it cleared",
        _XID_LABELS,
    ),
    MetricSpec(
        "gpuwatchd_xid_errors_total",
        "counter",
        "Xid reports seen since the daemon started, by GPU and code",
        _XID_LABELS,
    ),
    MetricSpec(
        "gpuwatchd_xid_last_seen_timestamp_seconds",
        "gauge",
        "time of the latest report of an Xid on a GPU",
        ("gpu", "uuid", "xid"),
    ),
    MetricSpec(
        "gpuwatchd_sxid_active",
        "gauge",
        "1 while an NVSwitch SXid's condition is active, 0 once it cleared",
        _SXID_LABELS,
    ),
    MetricSpec(
        "gpuwatchd_sxid_errors_total",
        "counter",
        "NVSwitch SXid reports seen since the daemon started",
        _SXID_LABELS,
    ),
    MetricSpec(
        "gpuwatchd_sxid_last_seen_timestamp_seconds",
        "gauge",
        "time of the latest report of an SXid on an NVSwitch",
        ("pci_bus_id", "sxid"),
    ),
)

STICKY = frozenset(
    {Action.RESET_GPU, Action.REBOOT_NODE, Action.DRAIN_AND_INSPECT, Action.CONTACT_SUPPORT}
)
CLEARED_BY_RESET = frozenset({Action.RESET_GPU, Action.RESTART_APP, Action.NONE})
ESCALATES = frozenset({Action.RESET_GPU, Action.REBOOT_NODE})
RECOVERY_CODE = 154


@dataclass(frozen=True)
class Observation:
    """What one report did: started a burst ("new"), repeated one ("repeat"), or
    completed the report before it ("line": a continuation line, not another fault)."""

    kind: str
    event: Event  # classified: severity set, name/action/burst/epoch in its XidFields
    info: XidInfo
    burst_id: str
    count: int
    raised: bool  # counts toward an active condition (not ignored, threshold met)


@dataclass(frozen=True)
class ActiveXid:
    """An Xid condition that is active now, for the health engine."""

    kind: str
    code: int
    pci_bus_id: str
    gpu: str
    uuid: str
    info: XidInfo
    since: float
    last: float
    count: int
    until: str  # "gpu reset", "reboot or operator clear", "<n>s after the last report"
    escalated: bool
    event: Event  # the latest report (pid, process, detail, attribution...)


@dataclass
class _State:
    kind: str
    code: int
    bus: str
    gpu: str = ""
    uuid: str = ""
    info: XidInfo | None = None
    burst_id: str = ""
    burst_last: float = float("-inf")
    count: int = 0
    since: float = 0.0
    last: float = 0.0
    raised: bool = False
    cleared_at: float = float("-inf")
    held_from: float | None = None  # monotonic time the hold counts from (None: wall `last`)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=10000))
    event: Event | None = None
    escalated: bool = False
    bursts: Bursts = field(default_factory=Bursts)


class XidTracker:
    """Keeps per-(GPU, code) state; see the module docstring for the rules."""

    def __init__(
        self, catalog: Catalog, settings: TrackerSettings, boot_id: str = "unknown"
    ) -> None:
        self.catalog = catalog
        self.settings = settings
        self.boot_id = boot_id
        self._states: dict[tuple[str, str, int], _State] = {}
        self._totals: dict[tuple[str, ...], int] = {}
        self._resets: dict[str, int] = {}
        self._epochs: dict[tuple[str, str, int], dict[str, float]] = {}
        self._seq = 0

    # --- input -------------------------------------------------------------------

    def classify(self, event: Event) -> XidInfo:
        """The catalog entry as the report's own words adjust it."""
        xid = event.xid or XidFields(code=event.code or 0)
        return self.catalog.resolve(
            event.code or 0,
            event.kind,
            text=xid.detail or event.message,
            fatal=xid.fatal,
            recovery_action=xid.recovery_action,
        )

    def observe(
        self, event: Event, restoring: bool = False, seen: float | None = None
    ) -> Observation:
        """Account one Xid/SXid report (any other kind is a caller's bug: ValueError).

        `seen`: the monotonic time the report was made (arrival less its age):
        hold times count from it, so a step of the wall clock moves no expiry.
        """
        if event.kind not in KINDS:
            raise ValueError(f"not an Xid or SXid event: {event.kind}")
        code = event.code or 0
        key = (event.kind, event.pci_bus_id, code)
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = _State(event.kind, code, event.pci_bus_id)
        xid = event.xid
        if xid is not None:
            st.gpu = xid.gpu or st.gpu
            st.uuid = xid.uuid or st.uuid
        policy = self.settings.policy(event.kind, code)
        joined = st.bursts.join(event)
        if joined is not None:
            burst, event = joined
            xid = event.xid
        base = self.classify(event)
        if (event.kind, code) == ("xid", RECOVERY_CODE) and self._recovered(event):
            self.gpu_reset(event.pci_bus_id, event.time, who="xid 154: recovery action None")
        epoch = (xid.epoch if xid is not None else "") or self._epoch(event.pci_bus_id)
        window = policy.window or self.settings.burst_window
        if joined is None:
            st.recent.append(event.time)
        while st.recent and st.recent[0] < event.time - window:
            st.recent.popleft()
        raised = not policy.ignore and len(st.recent) >= policy.threshold
        info = self._escalate(key, base, epoch, event.time, raised)
        escalated = info.action is not base.action

        if joined is not None:
            kind = "line"
        else:
            kind, burst = st.bursts.observe(event, self.settings.burst_window, self._new_id(event))
        st.burst_id, st.count = burst.id, burst.count
        st.burst_last = max(st.burst_last, event.time)

        was_active = self._is_active(st, event.time, seen)
        if raised:
            if not was_active:
                st.since = event.time
                st.info = info
            elif st.info is None or info.severity >= st.info.severity:
                st.info = info
            st.raised = True
        elif st.info is None or not was_active:
            st.info = info
        st.last = max(st.last, event.time)
        if seen is not None:
            st.held_from = seen if st.held_from is None else max(st.held_from, seen)
        st.escalated = st.escalated or escalated
        classified = self._classified(event, info, st, epoch, escalated, policy)
        st.event = classified
        if not restoring and joined is None:
            labels = self._labels(st, info)
            self._totals[labels] = self._totals.get(labels, 0) + 1
        return Observation(kind, classified, info, st.burst_id, st.count, raised)

    def _new_id(self, event: Event) -> Callable[[], str]:
        def new_id() -> str:
            self._seq += 1
            return f"{self.boot_id}:{event.time:.6f}:{self._seq}"

        return new_id

    @staticmethod
    def _recovered(event: Event) -> bool:
        """Xid 154 "... to 0x0 (None)" after a reset-required state: the GPU was reset."""
        xid = event.xid
        return (
            xid is not None
            and xid.recovery_action == "None"
            and (xid.previous_recovery_action or "None") != "None"
        )

    def _classified(
        self, event: Event, info: XidInfo, st: _State, epoch: str, escalated: bool, policy: Policy
    ) -> Event:
        xid = event.xid or XidFields(code=event.code or 0)
        escalation = ""
        if escalated:
            escalation = (
                f"seen in {len(self._epochs.get((st.kind, st.bus, st.code), {}))} boots or"
                " GPU resets: another reset or reboot is unlikely to fix it"
            )
        rule = ""
        if policy.ignore:
            rule = "ignored by site policy"
        elif policy.threshold > 1:
            rule = f"counts after {policy.threshold} reports"
        pids = st.bursts.pids(event.time, self.settings.burst_window)
        fields = xid.changed(
            name=info.name,
            category=info.category,
            action=str(info.action),
            burst_id=st.burst_id,
            epoch=epoch,
            # other processes hit this Xid on this GPU within the window
            pids=tuple(map(int, pids)) if len(pids) > 1 else xid.pids,
            escalated=escalation or xid.escalated,
            policy=rule or xid.policy,
        )
        return event.carrying(fields, severity=info.severity)

    def _epoch(self, bus: str) -> str:
        return f"{self.boot_id}#{self._resets.get(bus, 0)}"

    def _escalate(
        self, key: tuple[str, str, int], info: XidInfo, epoch: str, when: float, raised: bool
    ) -> XidInfo:
        epochs = self._epochs.setdefault(key, {})
        if raised:
            epochs[epoch] = max(epochs.get(epoch, when), when)
        horizon = when - self.settings.escalate_window
        for old in [e for e, t in epochs.items() if t < horizon]:
            del epochs[old]
        n = self.settings.escalate_after
        if n and len(epochs) >= n and info.action in ESCALATES:
            return replace(info, severity=Severity.CRITICAL, action=Action.DRAIN_AND_INSPECT)
        return info

    def gpu_reset(self, pci_bus_id: str, now: float, who: str = "gpu reset") -> int:
        """The GPU was reset: clear what a reset fixes and start a new epoch."""
        self._resets[pci_bus_id] = self._resets.get(pci_bus_id, 0) + 1
        return self.clear(Clear(time=now, who=who, pci_bus_id=pci_bus_id, reset=True))

    def clear(self, c: Clear) -> int:
        """Apply an operator clear (or a reset); returns how many conditions it ended."""
        n = 0
        for st in self._states.values():
            if c.pci_bus_id and st.bus != c.pci_bus_id:
                continue
            if c.code is not None and (st.kind, st.code) != (c.kind, c.code):
                continue
            if c.reset and st.info is not None and st.info.action not in CLEARED_BY_RESET:
                continue
            if self._is_active(st, c.time):
                n += 1
            st.cleared_at = max(st.cleared_at, c.time)
            st.raised = False
            st.recent.clear()
        return n

    def restore(
        self,
        events: Iterable[Event],
        clears: Iterable[Clear] = (),
        now: float | None = None,
        mono: float | None = None,
    ) -> None:
        """Rebuild from stored events (oldest first) and clears after a daemon restart.

        With `now` and `mono` (wall and monotonic time of the restore), the
        hold of a restored report counts from its age at restore, in monotonic time.

        Events of earlier boots count for escalation only; events of this
        boot also restore what is active. The store holds every kind (job
        hangs, remediation steps, ...): only Xids and SXids are read here.
        """
        ordered: list[tuple[float, int, object]] = []
        for ev in events:
            if ev.kind in KINDS:
                ordered.append((ev.time, 0, ev))
        for c in clears:
            ordered.append((c.time, 1, c))
        for _, _, item in sorted(ordered, key=lambda t: (t[0], t[1])):
            if isinstance(item, Clear):
                if item.reset:
                    self._resets[item.pci_bus_id] = self._resets.get(item.pci_bus_id, 0) + 1
                self.clear(item)
            elif isinstance(item, Event) and item.xid is not None:
                if (item.xid.boot_id or self.boot_id) == self.boot_id:
                    seen = None if now is None or mono is None else mono - max(0.0, now - item.time)
                    self.observe(item, restoring=True, seen=seen)
                elif item.xid.epoch:
                    key = (item.kind, item.pci_bus_id, item.code or 0)
                    self._epochs.setdefault(key, {})[item.xid.epoch] = item.time

    # --- output ------------------------------------------------------------------

    def _hold(self, st: _State) -> float:
        assert st.info is not None
        policy = self.settings.policy(st.kind, st.code)
        if policy.hold >= 0:
            return policy.hold
        return self.settings.warning_hold if st.info.severity >= Severity.WARNING else 0.0

    def _sticky(self, st: _State) -> bool:
        return (
            st.info is not None
            and st.info.severity >= Severity.CRITICAL
            and st.info.action in STICKY
        )

    def _is_active(self, st: _State, now: float, mono: float | None = None) -> bool:
        if not st.raised or st.info is None or st.last <= st.cleared_at:
            return False
        if self._sticky(st):
            return True
        if mono is not None and st.held_from is not None:
            return mono - st.held_from <= self._hold(st)
        return now - st.last <= self._hold(st)

    def _until(self, st: _State) -> str:
        if not self._sticky(st):
            return f"{self._hold(st):.0f}s after the last report"
        assert st.info is not None
        if st.info.action in CLEARED_BY_RESET:
            return "GPU reset, reboot or operator clear"
        return "reboot or operator clear"

    def active(self, now: float, mono: float | None = None) -> list[ActiveXid]:
        """Conditions active at `now` (hold times by `mono`, the monotonic time), worst first."""
        out = [
            ActiveXid(
                st.kind,
                st.code,
                st.bus,
                st.gpu,
                st.uuid,
                st.info,
                st.since,
                st.last,
                st.count,
                self._until(st),
                st.escalated,
                st.event,
            )
            for st in self._states.values()
            if self._is_active(st, now, mono) and st.info is not None and st.event is not None
        ]
        return sorted(out, key=lambda a: (-a.info.severity, a.pci_bus_id, a.code))

    def _labels(self, st: _State, info: XidInfo) -> tuple[str, ...]:
        if st.kind == "sxid":
            return ("sxid", st.bus, str(st.code), info.name, str(info.severity), str(info.action))
        return (
            "xid",
            st.gpu,
            st.uuid,
            st.bus,
            str(st.code),
            info.name,
            str(info.severity),
            str(info.action),
        )

    def samples(self, now: float, mono: float | None = None) -> list[Sample]:
        """The xid/sxid metric families (see METRICS)."""
        out: list[Sample] = []
        for values, total in sorted(self._totals.items()):
            kind, rest = values[0], values[1:]
            names = _SXID_LABELS if kind == "sxid" else _XID_LABELS
            labels = dict(zip(names, rest, strict=True))
            out.append(Sample(f"gpuwatchd_{kind}_errors_total", float(total), labels_of(labels)))
        for st in self._states.values():
            if st.info is None or st.event is None:
                continue
            names = _SXID_LABELS if st.kind == "sxid" else _XID_LABELS
            labels = dict(zip(names, self._labels(st, st.info)[1:], strict=True))
            # a label is called "name", so not Sample.of(name, ...)
            value = 1.0 if self._is_active(st, now, mono) else 0.0
            out.append(Sample(f"gpuwatchd_{st.kind}_active", value, labels_of(labels)))
            if st.kind == "sxid":
                out.append(
                    Sample.of(
                        "gpuwatchd_sxid_last_seen_timestamp_seconds",
                        st.last,
                        pci_bus_id=st.bus,
                        sxid=st.code,
                    )
                )
            else:
                out.append(
                    Sample.of(
                        "gpuwatchd_xid_last_seen_timestamp_seconds",
                        st.last,
                        gpu=st.gpu,
                        uuid=st.uuid,
                        xid=st.code,
                    )
                )
        return out
