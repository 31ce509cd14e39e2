"""Judging the readings that move under load: utilisation rounds and NVLink throughput.

Used by compare_nvidia_smi.py; tested without a GPU on saved JSON
(tests/sources/test_smi_load.py).

Utilisation is a sampled value: a training step swings it by 0.3-0.4 within
a second, so gpuwatchd's collector and nvidia-smi, read a few hundred
milliseconds apart, can differ though both are right. The `--util-rounds`
readings (collector, nvmlDeviceGetUtilizationRates, `--query-gpu` and `dmon`,
all at once) tell a wrong collector from a moving load: the collector must
equal nvidia-smi in most rounds, and when it does not, NVML's own read, taken
by the script in the same instant, must fare no better.

NVLink: GPM's NVLink counters count header and payload (DCGM documents its
NVLINK_TX_BYTES field, which reads GPM, that way), the figure of
`nvidia-smi nvlink -gt r`; `-gt d` counts payload only. GPM's window is the
gap between two polls; the nvidia-smi rate's window is its own, and under a
varying load two different windows read different rates.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from smi_nvlink import _row, _value

from gpuwatchd.model import Sample

__all__ = [
    "EQUAL",
    "RoundsSummary",
    "VARIES",
    "WINDOW_DIFFERS",
    "rounds_rows",
    "soften_single_instant",
    "summarize_rounds",
    "throughput_rows",
]

EQUAL = 0.02  # two readings of the same instant, in whole percent, rounded
SWING = 0.1  # a spread above this means the load moves faster than the reads line up
VARIES = "varies under load"
WINDOW_DIFFERS = "window differs under varying load"
RAW_RELATIVE = 0.10
COMPARABLE = 0.8  # the shorter window at least this fraction of the longer
_READING = re.compile(
    r"(nvmlDeviceGetUtilizationRates|query utilization\.gpu|dmon sm) (n/a|[0-9.]+)"
)
_SMI = ("query utilization.gpu", "dmon sm")
DIRECT = "nvmlDeviceGetUtilizationRates"


@dataclass(frozen=True)
class RoundsSummary:
    """One GPU's utilisation rounds: how often the collector equals nvidia-smi."""

    gpu: str
    rounds: int
    equal: int  # rounds where the collector equals query or dmon within EQUAL
    exact: int  # rounds where it equals them to the percent
    direct_equal: int  # the same for NVML's own read in that round
    low: float
    high: float
    swing_in_round: bool  # NVML's read and nvidia-smi's over SWING apart in one round

    @property
    def swinging(self) -> bool:
        return self.high - self.low > SWING or self.swing_in_round

    @property
    def verdict(self) -> str:
        if not self.swinging:
            # a steady load (idle): every round must agree to the percent
            return "agree" if self.exact == self.rounds else "MISMATCH"
        if 2 * self.equal > self.rounds:
            return "agree"
        # the collector no worse than NVML's own read taken with nvidia-smi
        return VARIES if 0 < self.equal and self.equal >= self.direct_equal else "MISMATCH"

    @property
    def text(self) -> str:
        return (
            f"{self.equal} of {self.rounds} rounds equal nvidia-smi (within {EQUAL:g}; "
            f"{self.exact} to the percent); "
            f"NVML's own read in the same rounds: {self.direct_equal} of {self.rounds}; "
            f"readings {self.low:.2f}-{self.high:.2f}"
            + (" (load swings)" if self.swinging else " (steady)")
        )


def _readings(row: Mapping[str, Any]) -> dict[str, float]:
    """The side-by-side readings of one saved row (numbers, or parsed from its text)."""
    saved = row.get("readings")
    if isinstance(saved, Mapping):
        return {k: float(v) for k, v in saved.items() if v is not None}
    out = {}
    for name, value in _READING.findall(str(row.get("nvidia_smi_text") or "")):
        if value != "n/a":
            out[name] = float(value)
    return out


def _near(value: float, others: Iterable[float | None], within: float) -> bool:
    return any(o is not None and abs(value - o) <= within + 1e-9 for o in others)


def summarize_rounds(rounds: Iterable[Mapping[str, Any]]) -> dict[str, RoundsSummary]:
    """{bus id: RoundsSummary} over the JSON's nvlink.utilization_rounds."""
    per: dict[str, list[tuple[float, dict[str, float]]]] = {}
    for one in rounds:
        for row in one.get("rows", []):
            if row.get("gpuwatchd") is not None:
                per.setdefault(row["gpu"], []).append((float(row["gpuwatchd"]), _readings(row)))
    out = {}
    for gpu, got in sorted(per.items()):
        equal = exact = direct_equal = 0
        swing = False
        values = []
        for ours, read in got:
            smi = [read.get(k) for k in _SMI]
            equal += _near(ours, smi, EQUAL)
            exact += _near(ours, smi, 0.005)
            direct = read.get(DIRECT)
            if direct is not None:
                direct_equal += _near(direct, smi, EQUAL)
                swing |= any(s is not None and abs(direct - s) > SWING for s in smi)
            values += read.values()  # the collector's own spread is what is judged
        out[gpu] = RoundsSummary(
            gpu,
            len(got),
            equal,
            exact,
            direct_equal,
            min(values, default=0.0),
            max(values, default=0.0),
            swing,
        )
    return out


def rounds_rows(summaries: Mapping[str, RoundsSummary]) -> list[dict[str, Any]]:
    """One row per GPU: the utilisation judged by the rounds."""
    out = []
    for gpu, s in summaries.items():
        row = _row(
            gpu,
            'gpuwatchd_gpu_utilization_ratio{engine="gpu"} (rounds)',
            None,
            "NVML / query / dmon, at once",
            s.text,
            None,
            0,
        )
        row["gpuwatchd_text"] = f"{s.equal}/{s.rounds}"
        row["verdict"] = s.verdict
        out.append(row)
    return out


def soften_single_instant(
    results: list[dict[str, Any]], summaries: Mapping[str, RoundsSummary]
) -> None:
    """A single-instant utilisation MISMATCH is the load moving when the rounds say so."""
    for r in results:
        s = summaries.get(r["gpu"])
        if (
            s is None
            or r["verdict"] != "MISMATCH"
            or not r["metric"].startswith('gpuwatchd_gpu_utilization_ratio{engine="gpu"}')
            or r["metric"].endswith("(rounds)")
            or not s.swinging
            or s.verdict == "MISMATCH"
        ):
            continue
        r["verdict"] = VARIES
        r["nvidia_smi_text"] = f"{r['nvidia_smi_text']}; one instant, rounds: {s.text}"


def _comparable(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and min(a, b) >= COMPARABLE * max(a, b)


def throughput_rows(
    samples: list[Sample],
    rates: Mapping[str, Mapping[str, float]],
    gpm_seconds: float | None,
    smi_seconds: float | None,
) -> list[dict[str, Any]]:
    """gpuwatchd_gpu_nvlink_bytes_per_second against the `-gt r` (raw) rate, within 10 %.

    Past 10 % the row says WINDOW_DIFFERS instead of MISMATCH when the two
    windows are not comparable; where `-gt r` is missing, data stands in.
    """
    buses = {
        dict(s.labels).get("uuid", ""): dict(s.labels).get("pci_bus_id", "").upper()
        for s in samples
        if s.name == "gpuwatchd_gpu_nvlink_bytes_per_second"
    }
    windows = (f"GPM window {gpm_seconds:.2f} s" if gpm_seconds else "GPM window unknown") + (
        f", nvidia-smi window {smi_seconds:.2f} s" if smi_seconds else ""
    )
    comparable = _comparable(gpm_seconds, smi_seconds)
    out = []
    for uuid, bus in sorted(buses.items(), key=lambda kv: kv[1]):
        if not uuid:
            continue
        rate = rates.get(uuid, {})
        for direction in ("tx", "rx"):
            ours = _value(
                samples, "gpuwatchd_gpu_nvlink_bytes_per_second", uuid, direction=direction
            )
            data, raw = rate.get(f"data_{direction}"), rate.get(f"raw_{direction}")
            theirs = raw if raw is not None else data
            parts = [
                f"raw {raw / 1e9:.3f} GB/s" if raw is not None else "raw n/a (judged on data)",
                f"data {data / 1e9:.3f} GB/s" if data is not None else "data n/a",
                windows,
            ]
            row = _row(
                bus,
                f'gpuwatchd_gpu_nvlink_bytes_per_second{{direction="{direction}"}}',
                ours,
                "nvlink -gt r (rate)",
                None if theirs is None else "; ".join(parts),
                theirs,
                max(50e6, RAW_RELATIVE * (theirs or 0.0)),
            )
            if row["verdict"] == "MISMATCH" and not comparable:
                row["verdict"] = WINDOW_DIFFERS
            out.append(row)
    return out
