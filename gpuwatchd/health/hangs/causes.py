"""Hardware causes of a hang: an Xid on a rank's GPU shortly before the rank died.

The monitor runs on the consumer thread, which sees every Xid event as the
sources publish it; `XidMemory` keeps those of the last `WINDOW_SECONDS`. When a
hung job has a rank whose GPU (or whose pid) reported an Xid before the hang,
the verdict names it and the hang alert carries the same `incident` label as
the Xid alert (`xid_incident`), so a router can group the two.
"""

from __future__ import annotations

import time as _time
from collections.abc import Iterable
from dataclasses import dataclass

from gpuwatchd.health.hangs.detector import JobVerdict
from gpuwatchd.health.incident import xid_incident
from gpuwatchd.jobview import JobView
from gpuwatchd.model import Event, GpuInventory
from gpuwatchd.pci import normalize_bus_id

__all__ = ["HardwareCause", "XidMemory"]

WINDOW_SECONDS = 600.0
KINDS = ("xid", "sxid")


@dataclass(frozen=True, slots=True)
class HardwareCause:
    """The Xid that a hang is put down to, as text and as the shared incident label."""

    text: str
    incident: str


@dataclass(frozen=True, slots=True)
class _Seen:
    time: float
    kind: str
    code: int
    bus: str
    pid: int | None


class XidMemory:
    """Recent Xid/SXid events, and the GPU index -> bus id map of the last NVML poll."""

    def __init__(self) -> None:
        self._seen: list[_Seen] = []
        self._bus_of: dict[str, str] = {}

    def note_gpus(self, gpus: GpuInventory) -> None:
        """The GPUs of NVML's last poll (index -> bus id)."""
        for g in gpus:
            self._bus_of[str(g.index)] = g.pci_bus_id

    def note(self, events: Iterable[Event], now: float) -> None:
        """Keep the Xid/SXid events of a publish."""
        for ev in events:
            if ev.kind not in KINDS or ev.code is None:
                continue
            pid = ev.attr("pid")
            self._seen.append(
                _Seen(
                    ev.time,
                    ev.kind,
                    ev.code,
                    normalize_bus_id(ev.pci_bus_id) if ev.pci_bus_id else "",
                    int(pid) if pid.isdigit() else None,
                )
            )
        self._seen = [s for s in self._seen if now - s.time <= WINDOW_SECONDS]

    def cause(self, job: JobView, verdict: JobVerdict) -> HardwareCause | None:
        """The first Xid on a GPU (or pid) of the job's dead, then other, ranks before the hang."""
        dead = set(verdict.dead_pids)
        ordered = sorted(job.ranks, key=lambda r: (r.pid not in dead, r.pid))
        for r in ordered:
            buses = {self._bus_of.get(g, "") for g in r.gpus} - {""}
            hits = [
                s
                for s in self._seen
                if (s.bus in buses or s.pid == r.pid) and s.time <= verdict.since + 5.0
            ]
            if not hits:
                continue
            s = hits[0]
            who = f"rank {r.rank}" if r.rank is not None else f"pid {r.pid}"
            what = "died" if r.pid in dead else "stalled"
            gpu = next((g for g in r.gpus if self._bus_of.get(g) == s.bus), s.bus or "?")
            at = _time.strftime("%H:%M:%S", _time.gmtime(s.time))
            return HardwareCause(
                f"{who} {what} after {s.kind.capitalize()} {s.code} on GPU {gpu} at {at} UTC",
                xid_incident(s.bus, s.code),
            )
        return None
