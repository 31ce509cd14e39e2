"""Rules over the PCIe AER counters (sources/aer): fatal, non-fatal, correctable rising.

The counters only ever tell how many errors a function has seen since it was
enumerated, so every rule works on increases between two polls of the aer
source, never on the value: a node that logged errors before the daemon
started does not page. A decrease is a reset (the function was removed and
re-enumerated) and the new value is the increase. Time is the aer polls'
own timestamps, so a verdict holds the same on a live node and over recorded
samples.

- A fatal error (the link is unreliable; the kernel resets it, the GPU or NIC
  behind it usually drops off the bus) is critical; a non-fatal one (one
  transaction lost: a completion timeout, an unsupported request) a warning.
  Each holds for `hold_seconds` after the last rise, as the Prometheus rule's
  increase over 10 minutes does.
- Correctable errors are normal in small numbers; a warning when a function's
  rise within the last `correctable_window_seconds` is more than
  `correctable_per_minute` times that window (Prometheus: increase over 5m
  above 8 x 5).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuwatchd.model import Action, Finding, Labels, Sample, Severity

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.state import NodeSnapshot

__all__ = ["AerRules", "AerThresholds"]

P = "gpuwatchd_pcie_aer_"
FATAL_FIX = (
    "A fatal PCIe error makes the link unreliable: the kernel resets it and the GPU or NIC "
    "behind it often falls off the bus. Drain the node, read the kernel log's 'AER:' lines "
    "for the error type and the reporting function, reseat or replace the GPU, riser, cable "
    "or NIC on that path, and reboot; a second fatal error on the same path means hardware."
)
NONFATAL_FIX = (
    "An uncorrectable non-fatal PCIe error lost one transaction (a completion timeout, a "
    "poisoned or unsupported request) while the link stayed up. Read the kernel log's 'AER:' "
    "lines; if it repeats on the same path, drain the node and inspect the slot, riser, "
    "cable and the firmware of the devices on it."
)
CORRECTABLE_FIX = (
    "Correctable PCIe errors (bad TLPs and DLLPs, receiver errors, replay timeouts) are "
    "corrected by replays that cost bandwidth; a steady rise points at a marginal link. "
    "Check the link's speed and width (lspci -vv, nvidia-smi -q), reseat the GPU, riser or "
    "cable and watch whether the rate falls; drain the node if it keeps rising."
)
_WHAT = {"fatal": "fatal", "nonfatal": "non-fatal"}
Key = tuple[str, str]  # (pci_bus_id, severity)


@dataclass(frozen=True)
class AerThresholds:
    """The rules' thresholds (sources.aer)."""

    correctable_per_minute: float = 8.0
    correctable_window_seconds: float = 300.0
    hold_seconds: float = 600.0

    @classmethod
    def from_config(cls, cfg: Config | None) -> AerThresholds:
        """From sources.aer; the defaults without a config."""
        if cfg is None:
            return cls()
        c = cfg.sources.aer
        return cls(c.correctable_per_minute, c.correctable_window_seconds, c.hold_seconds)


@dataclass
class _Rise:
    at: float  # poll time of the last rise
    increase: float  # summed over the rises still held
    types: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Place:
    role: str
    gpus: str
    nics: str


class AerRules:
    """Keeps the previous aer poll and what rose since, so `evaluate` can run at any time."""

    def __init__(self, thresholds: AerThresholds | None = None) -> None:
        self.t = thresholds or AerThresholds()
        self._stamp: float | None = None
        self._prev: dict[Key, float] = {}
        self._prev_types: dict[tuple[str, str, str], float] = {}
        self._rises: dict[Key, _Rise] = {}  # fatal / nonfatal
        # correctable increases per function: (poll time, increase), within the window
        self._cor: dict[str, deque[tuple[float, float]]] = {}
        self._places: dict[str, _Place] = {}
        self._findings: list[Finding] = []

    def evaluate(self, snapshot: NodeSnapshot) -> list[Finding]:
        """Findings for the aer source's latest poll (recomputed only when it polled again)."""
        src = snapshot.sources.get("aer")
        if src is None or not src.ok:
            return list(self._findings)
        if src.timestamp != self._stamp:
            self.update(src.samples, src.timestamp)
        return list(self._findings)

    def update(self, samples: Iterable[Sample], now: float) -> list[Finding]:
        """Take one aer poll's samples taken at `now`; return the findings that hold."""
        totals: dict[Key, float] = {}
        types: dict[tuple[str, str, str], float] = {}
        for s in samples:
            if s.name == P + "errors_total":
                totals[(s.label("pci_bus_id"), s.label("severity"))] = s.value
            elif s.name == P + "error_types_total":
                bus, sev = s.label("pci_bus_id"), s.label("severity")
                types[(bus, sev, s.label("error"))] = s.value
            elif s.name == P + "device_info":
                self._places[s.label("pci_bus_id")] = _Place(
                    s.label("role"), s.label("gpus"), s.label("nics")
                )
        first = self._stamp is None
        for key, value in totals.items():
            old = self._prev.get(key)
            if old is None:
                continue  # a function seen for the first time: its past is not news
            grew = value if value < old else value - old
            if key[1] == "correctable":
                self._cor.setdefault(key[0], deque()).append((now, grew))
            elif grew > 0:
                self._rise(key, now, grew, types)
        self._prev, self._prev_types, self._stamp = totals, types, now
        self._expire(now, set(totals))
        self._findings = [] if first else self._judge()
        return list(self._findings)

    def _rise(
        self, key: Key, now: float, grew: float, types: Mapping[tuple[str, str, str], float]
    ) -> None:
        rise = self._rises.get(key)
        if rise is None or now - rise.at > self.t.hold_seconds:
            rise = self._rises[key] = _Rise(now, 0.0)
        rise.at = now
        rise.increase += grew
        for (bus, sev, error), value in types.items():
            if (bus, sev) != key:
                continue
            old = self._prev_types.get((bus, sev, error), 0.0)
            d = value if value < old else value - old
            if d > 0:
                rise.types[error] = rise.types.get(error, 0.0) + d

    def _expire(self, now: float, present: set[Key]) -> None:
        for key in [k for k, r in self._rises.items() if now - r.at > self.t.hold_seconds]:
            del self._rises[key]
        buses = {bus for bus, _ in present}
        for bus in list(self._cor):
            window = self._cor[bus]
            while window and now - window[0][0] >= self.t.correctable_window_seconds:
                window.popleft()
            if not window or bus not in buses:
                del self._cor[bus]
        for bus in [b for b in self._places if b not in buses]:
            del self._places[bus]

    def _judge(self) -> list[Finding]:
        out = []
        for (bus, sev), rise in sorted(self._rises.items()):
            kinds = ", ".join(f"{e} +{n:.0f}" for e, n in sorted(rise.types.items()))
            out.append(
                self._finding(
                    bus,
                    "pcie_aer_fatal" if sev == "fatal" else "pcie_aer_nonfatal",
                    "PcieAerFatalErrors" if sev == "fatal" else "PcieAerNonFatalErrors",
                    Severity.CRITICAL if sev == "fatal" else Severity.WARNING,
                    f"{rise.increase:.0f} uncorrectable {_WHAT[sev]} PCIe error message(s)"
                    f"{f' ({kinds})' if kinds else ''}",
                    Action.DRAIN_AND_INSPECT if sev == "fatal" else Action.NONE,
                    FATAL_FIX if sev == "fatal" else NONFATAL_FIX,
                )
            )
        budget = self.t.correctable_per_minute * self.t.correctable_window_seconds / 60.0
        for bus, window in sorted(self._cor.items()):
            grew = sum(n for _, n in window)
            if grew > budget:
                out.append(
                    self._finding(
                        bus,
                        "pcie_aer_correctable",
                        "PcieAerCorrectableErrorsRising",
                        Severity.WARNING,
                        f"correctable PCIe errors rose by {grew:.0f} in the last "
                        f"{self.t.correctable_window_seconds:.0f} s "
                        f"(more than {self.t.correctable_per_minute:g}/min on average)",
                        Action.NONE,
                        CORRECTABLE_FIX,
                    )
                )
        return out

    def _finding(
        self,
        bus: str,
        rule: str,
        alert: str,
        severity: Severity,
        what: str,
        action: Action,
        fix: str,
    ) -> Finding:
        place = self._places.get(bus, _Place("", "", ""))
        labels: Labels = (("role", place.role),) if place.role else ()
        return Finding(
            rule=rule,
            alertname=alert,
            scope="pcie",
            subject=(("pci_bus_id", bus),),
            severity=severity,
            reason=f"{what} at {_describe(bus, place)}.",
            action=action,
            remediation=fix,
            labels=labels,
        )


def _describe(bus: str, place: _Place) -> str:
    role = {"gpu": "GPU", "nic": "NIC", "bridge": "PCIe switch port", "root_port": "root port"}
    text = f"{role.get(place.role, 'PCI function')} {bus}"
    below = [x for x in (place.gpus and f"GPUs {place.gpus}", place.nics) if x]
    if place.role in ("bridge", "root_port") and below:
        text += f", above {' and '.join(below)}"
    return text
