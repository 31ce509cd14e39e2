"""Hotplug: udev add/remove/change events trigger an immediate re-poll of the affected source.

A GPU falling off the bus, a driver unbinding or an InfiniBand port going
down produces a uevent; udevd re-broadcasts it on its netlink group after
processing it. This source listens there (pyudev) and calls
`ctx.nudge(<source>)` so the runner polls that source now instead of at
its next interval.

It is a Source like the others, so the runner's thread, heartbeat and
watchdog cover it: `poll()` waits up to WAIT_SECONDS for events, handles
them, and returns a heartbeat (events and nudges counted). Its `interval`
is 0 while listening, since the wait happens inside poll(). Without udev
(no /run/udev/control: containers, minimal hosts) or without a usable
libudev, it says so once, exports gpuwatchd_udev_monitor_up 0, and checks
again every `fallback_interval`; the other sources keep their own
intervals, which is the fallback.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwatchd.model import Event, MetricSpec, Sample

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.sources.context import SourceContext

__all__ = ["ACTIONS", "METRICS", "SUBSYSTEMS", "UdevEvent", "UdevSource", "targets_for"]

log = logging.getLogger("gpuwatchd.udev")

SUBSYSTEMS = ("pci", "infiniband", "infiniband_verbs", "infiniband_mad", "net", "module")
ACTIONS = frozenset({"add", "remove", "change", "bind", "unbind", "move", "online", "offline"})
WAIT_SECONDS = 2.0
PCI_NVIDIA = "10DE"
PCI_MELLANOX = "15B3"  # NVIDIA Networking (Mellanox) ConnectX/BlueField
PCI_CLASS_INFINIBAND = "207"  # class 0x0207xx: InfiniBand controller

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_udev_monitor_up",
        "gauge",
        "1 while udev events are being received; 0 when udev is unavailable and sources "
        "rely on their poll intervals alone.",
    ),
    MetricSpec(
        "gpuwatchd_udev_events_total",
        "counter",
        "udev events received, by subsystem and action.",
        ("subsystem", "action"),
    ),
    MetricSpec(
        "gpuwatchd_udev_nudges_total",
        "counter",
        "Immediate re-polls requested because of udev events, by source.",
        ("source",),
    ),
)


@dataclass(frozen=True)
class UdevEvent:
    """The parts of a udev event the mapping looks at."""

    action: str
    subsystem: str
    devpath: str = ""
    properties: Mapping[str, str] = field(default_factory=dict)


def targets_for(event: UdevEvent) -> tuple[str, ...]:
    """The sources to re-poll because of this event (pure)."""
    if event.action not in ACTIONS:
        return ()
    sub = event.subsystem
    if sub.startswith("infiniband"):
        return ("infiniband",)
    if sub == "net":
        # veth and bridges of containers come and go all the time; only real NICs matter
        return () if event.devpath.startswith("/devices/virtual/") else ("infiniband",)
    if sub == "module":
        name = event.devpath.rsplit("/", 1)[-1]
        if name.startswith("nvidia"):
            return ("nvml",)
        if name.startswith(("mlx", "ib_", "rdma")):
            return ("infiniband",)
        return ()
    if sub == "pci":
        props = event.properties
        vendor = props.get("PCI_ID", "").partition(":")[0].upper()
        driver = props.get("DRIVER", "")
        # aer: a function that left or joined the bus changes the PCI paths it reads
        if vendor == PCI_NVIDIA or driver.startswith("nvidia"):
            return ("nvml", "aer")
        if vendor == PCI_MELLANOX or props.get("PCI_CLASS", "").upper().startswith(
            PCI_CLASS_INFINIBAND
        ):
            return ("infiniband", "aer")
    return ()


class UdevSource:
    """Listens to udev and nudges the sources its events concern."""

    name = "udev"

    def __init__(
        self,
        nudge: Callable[[str], None],
        run_udev: str = "/run/udev",
        fallback_interval: float = 60.0,
        debounce_seconds: float = 1.0,
        wait_seconds: float = WAIT_SECONDS,
    ) -> None:
        self._nudge = nudge
        self._run_udev = run_udev
        self._fallback = fallback_interval
        self._debounce = debounce_seconds
        self._wait = wait_seconds
        self._monitor: Any = None
        self._why_not = ""
        self._said = False
        self._events: dict[tuple[str, str], int] = {}
        self._nudges: dict[str, int] = {}
        self._last_nudge: dict[str, float] = {}
        self._pending: set[str] = set()
        self.interval = fallback_interval

    @classmethod
    def from_config(cls, cfg: Config, ctx: SourceContext) -> UdevSource:
        """Build from sources.udev; nudges go to ctx.nudge."""
        c = cfg.sources.udev
        return cls(
            ctx.nudge, fallback_interval=c.fallback_interval, debounce_seconds=c.debounce_seconds
        )

    def poll(self, now: float) -> Sequence[Sample | Event]:
        if self._monitor is None:
            self._start()
        if self._monitor is not None:
            self._receive()
        self._flush()
        self.interval = 0.0 if self._monitor is not None else self._fallback
        out = [Sample.of("gpuwatchd_udev_monitor_up", 1 if self._monitor is not None else 0)]
        out += [
            Sample.of("gpuwatchd_udev_events_total", n, subsystem=s, action=a)
            for (s, a), n in sorted(self._events.items())
        ]
        out += [
            Sample.of("gpuwatchd_udev_nudges_total", n, source=src)
            for src, n in sorted(self._nudges.items())
        ]
        return out

    def status(self) -> Mapping[str, object]:
        return {
            "listening": self._monitor is not None,
            "reason": self._why_not,
            "subsystems": list(SUBSYSTEMS),
            "nudges": dict(self._nudges),
        }

    def close(self) -> None:
        self._monitor = None  # the netlink socket closes with the Monitor object

    def handle(self, event: UdevEvent) -> tuple[str, ...]:
        """Count one event and nudge (debounced) what it concerns; returns the targets."""
        key = (event.subsystem, event.action)
        self._events[key] = self._events.get(key, 0) + 1
        targets = targets_for(event)
        for target in targets:
            log.debug(
                "udev %s %s %s -> re-poll %s", event.action, event.subsystem, event.devpath, target
            )
            self._pending.add(target)
        self._flush()
        return targets

    # --- internals -------------------------------------------------------------------

    def _flush(self) -> None:
        now = time.monotonic()
        for target in sorted(self._pending):
            if now - self._last_nudge.get(target, -1e18) < self._debounce:
                continue  # nudged moments ago; the pending one goes out on a later pass
            self._pending.discard(target)
            self._last_nudge[target] = now
            self._nudges[target] = self._nudges.get(target, 0) + 1
            self._nudge(target)

    def _start(self) -> None:
        why = ""
        if not os.path.exists(os.path.join(self._run_udev, "control")):
            why = f"udev is not running here ({self._run_udev}/control absent)"
        else:
            try:
                import pyudev  # imported here: needs libudev at runtime

                context = pyudev.Context()
                monitor = pyudev.Monitor.from_netlink(context, source="udev")
                for sub in SUBSYSTEMS:
                    monitor.filter_by(sub)
                monitor.start()
                self._monitor = monitor
            except Exception as exc:  # ImportError, OSError from libudev or netlink
                why = f"cannot listen to udev: {type(exc).__name__}: {exc}"
        if self._monitor is not None:
            log.info("listening to udev events (%s)", ", ".join(SUBSYSTEMS))
            self._why_not, self._said = "", False
            return
        self._why_not = why
        if not self._said:
            log.info("%s; hotplug is seen at the next regular poll of each source", why)
            self._said = True

    def _receive(self) -> None:
        try:
            device = self._monitor.poll(timeout=self._wait)
            while device is not None:
                self.handle(_event_of(device))
                device = self._monitor.poll(timeout=0)  # drain what queued meanwhile
        except Exception as exc:  # the socket broke: fall back and retry later
            log.warning("udev monitor failed: %s", exc)
            self._monitor = None


def _event_of(device: Any) -> UdevEvent:
    props = {str(k): str(v) for k, v in dict(device.properties).items()}
    return UdevEvent(
        action=str(device.action or ""),
        subsystem=str(device.subsystem or ""),
        devpath=str(device.device_path or ""),
        properties=props,
    )
