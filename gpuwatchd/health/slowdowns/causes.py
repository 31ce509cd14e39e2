"""What the node shows on a slow GPU, and the cause catalog (gpuwatchd/data/slowdown-causes.yaml).

Each cause is read from the GPU's own window against its peers': a slowing clock
event reason set, SM clocks below the peers', a PCIe link trained below its
maximum, NVLink error counters rising, a storm of corrected ECC errors. The
catalog (data, like the hang signatures) gives each its title and remediation.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.config.yamlfile import load_yaml
from gpuwatchd.errors import ConfigError
from gpuwatchd.health.slowdowns import averages
from gpuwatchd.health.slowdowns.readings import GpuPace
from gpuwatchd.model import Action
from gpuwatchd.shipped import shipped_text

__all__ = [
    "CATALOG_FILE",
    "Cause",
    "CauseEntry",
    "UNEXPLAINED",
    "catalog",
    "node_causes",
    "parse_catalog",
]

CATALOG_FILE = "slowdown-causes.yaml"
UNEXPLAINED = "unexplained"
_THERMAL = {"sw_thermal_slowdown", "hw_thermal_slowdown"}
_POWER = {"sw_power_cap", "hw_power_brake_slowdown"}


@dataclass(frozen=True, slots=True)
class Cause:
    """One cause the node shows on the slow GPU: its catalog name and what was read."""

    name: str
    detail: str
    link: str = ""  # "pcie" or "nvlink" when the cause is the GPU's link


@dataclass(frozen=True, slots=True)
class CauseEntry:
    """A catalog entry: title, remediation and the action it asks for."""

    name: str
    title: str
    remediation: str
    action: Action


def parse_catalog(text: str, source: str) -> dict[str, CauseEntry]:
    """The catalog from YAML text; ConfigError naming `source` and the key on a bad entry."""
    data = load_yaml(text, source)
    entries = data.get("causes") if isinstance(data, Mapping) else None
    if not isinstance(entries, list):
        raise ConfigError(source, "causes", "must be a list")
    out: dict[str, CauseEntry] = {}
    for i, e in enumerate(entries):
        where = f"causes[{i}]"
        if not isinstance(e, Mapping):
            raise ConfigError(source, where, "must be a mapping")
        fields = {k: e.get(k) for k in ("name", "title", "remediation", "action")}
        for k, v in fields.items():
            if not isinstance(v, str) or not v.strip():
                raise ConfigError(source, f"{where}.{k}", "must be a non-empty string")
        try:
            action = Action(str(fields["action"]))
        except ValueError:
            raise ConfigError(
                source, f"{where}.action", f"unknown action {fields['action']!r}"
            ) from None
        name = str(fields["name"])
        out[name] = CauseEntry(name, str(fields["title"]), str(fields["remediation"]), action)
    if UNEXPLAINED not in out:
        raise ConfigError(source, "causes", f"needs an entry named {UNEXPLAINED}")
    return out


@functools.cache
def catalog() -> dict[str, CauseEntry]:
    """The shipped catalog, parsed once."""
    return parse_catalog(shipped_text(CATALOG_FILE), CATALOG_FILE)


def _share(polls: Sequence[GpuPace], reasons: set[str]) -> float:
    return sum(1 for p in polls if p.clock_events & reasons) / len(polls)


def _mean(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return averages.mean(got) if got else None


def _rise(polls: Sequence[GpuPace], attr: str) -> float:
    got = [getattr(p, attr) for p in polls if getattr(p, attr) is not None]
    return max(0.0, got[-1] - got[0]) if len(got) >= 2 else 0.0


def node_causes(
    polls: Sequence[GpuPace],
    peers: Sequence[Sequence[GpuPace]],
    seconds: float,
    *,
    clock_deficit: float = 0.08,
    ecc_storm_per_second: float = 1.0,
) -> tuple[Cause, ...]:
    """The causes `polls` (one GPU's window) shows that its peers' windows do not."""
    if not polls:
        return ()
    out: list[Cause] = []
    for name, reasons in (
        ("thermal_throttle", _THERMAL),
        ("power_cap", _POWER),
        ("hw_slowdown", {"hw_slowdown"}),
    ):
        share = _share(polls, reasons)
        if share >= 0.5 and all(_share(p, reasons) < share / 2 for p in peers if p):
            held = sorted({r for p in polls for r in p.clock_events & reasons})
            out.append(Cause(name, f"{', '.join(held)} set in {share:.0%} of polls"))
    clock = _mean([p.sm_clock_hz for p in polls])
    peer_clocks = [c for c in (_mean([p.sm_clock_hz for p in w]) for w in peers) if c]
    if clock is not None and peer_clocks:
        ref = averages.median(peer_clocks)
        if clock < ref * (1 - clock_deficit):
            out.append(
                Cause(
                    "clocks_low",
                    f"SM clock {clock / 1e6:.0f} MHz against its peers' {ref / 1e6:.0f} MHz",
                )
            )
    last = polls[-1]
    width, width_max = last.pcie_width, last.pcie_width_max
    gen, gen_max = last.pcie_generation, last.pcie_generation_max
    if width is not None and width_max and width < width_max:
        out.append(Cause("pcie_degraded", f"PCIe link x{width} of x{width_max}", "pcie"))
    elif (
        gen is not None
        and gen_max
        and gen < gen_max
        and (_mean([p.utilization for p in polls]) or 0) > 0.5
    ):
        # an idle link drops its generation to save power; a busy one should not
        out.append(Cause("pcie_degraded", f"PCIe link Gen{gen} of Gen{gen_max} while busy", "pcie"))
    if _rise(polls, "nvlink_errors") > 0:
        n = _rise(polls, "nvlink_errors")
        out.append(Cause("nvlink_errors", f"{n:.0f} NVLink replay/recovery/CRC errors", "nvlink"))
    ecc = _rise(polls, "ecc_corrected")
    if seconds > 0 and ecc / seconds >= ecc_storm_per_second:
        out.append(Cause("ecc_storm", f"{ecc:.0f} corrected ECC errors in {seconds:.0f} s"))
    return tuple(out)
