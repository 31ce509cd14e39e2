"""Judging gpuwatchd's readings against nvidia-smi's, row by row (for compare_nvidia_smi.py).

Parses `nvidia-smi -q`, looks up each row's nvidia-smi text, gives a verdict
per (GPU, row) and prints the results as a Markdown table; tested without a
GPU on saved captures (tests/sources/test_nvml_smi_parity.py, test_smi_load.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from smi_nvlink import judge
from smi_rows import Row, _num, _rows

from gpuwatchd.model import Sample
from gpuwatchd.pci import normalize_bus_id

# a tlimit: threshold is current temperature + margin, two whole-degree readings
TLIMIT_TOLERANCE = 1.0


# -q section names for the clock-event time counters differ between drivers
_COUNTER_SECTIONS = (
    "Clocks Event Reasons Counters",
    "Clocks Event Reasons",
    "Clocks Throttle Reasons",
)
_COUNTER_KEYS = {
    "sw_power_cap": ("SW Power Capping", "SW Power Cap"),
    "sync_boost": ("Sync Boost",),
    "sw_thermal_slowdown": ("SW Thermal Slowdown",),
    "hw_thermal_slowdown": ("HW Thermal Slowdown",),
    "hw_power_brake_slowdown": ("HW Power Braking", "HW Power Brake Slowdown"),
}


def parse_q(text: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi -q` as {bus id: {"Section/Sub/Key": value}}."""
    gpus: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if line.startswith("GPU ") and ":" in line:
            current = gpus.setdefault(normalize_bus_id(line[4:].strip()).upper(), {})
            stack = []
            continue
        if current is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if ":" in line:
            key, _, value = line.strip().partition(":")
            path = "/".join([s for _, s in stack] + [key.strip()])
            current[path] = value.strip()
            if not value.strip():
                stack.append((indent, key.strip()))
        else:
            stack.append((indent, line.strip()))
    return gpus


def _q_value(q: Mapping[str, str], path: str) -> str | None:
    """A -q value by "Section/Key", wherever the section nests (older drivers differ)."""
    if path in q:
        return q[path]
    section, key = path.rsplit("/", 1)
    for full, value in q.items():
        if full.endswith(f"{section}/{key}") or full.endswith(f"/{key}") and section in full:
            return value
    return None


def _match(
    samples: Iterable[Sample], family: str, bus: str, labels: Mapping[str, str]
) -> float | None:
    for s in samples:
        lab = dict(s.labels)
        if (
            s.name == family
            and lab.get("pci_bus_id", "").upper() == bus
            and all(lab.get(k) == v for k, v in labels.items())
        ):
            return s.value
    return None


def compare(
    samples: list[Sample],
    query: Mapping[str, Mapping[str, str]],
    q: Mapping[str, Mapping[str, str]],
    accepted: set[str],
) -> list[dict[str, Any]]:
    """One result per (GPU, row), plus the rows of series with no counterpart."""
    results: list[dict[str, Any]] = []
    buses = sorted({dict(s.labels).get("pci_bus_id", "").upper() for s in samples} - {""})
    for bus in buses:
        qgpu = q.get(bus, {})
        rows = _rows()
        for reason, keys in _COUNTER_KEYS.items():
            for section in _COUNTER_SECTIONS:
                hit = next(
                    (k for k in keys if f"{section}/{k}" in qgpu and _unit(qgpu[f"{section}/{k}"])),
                    None,
                )
                if hit:
                    rows.append(
                        Row(
                            "gpuwatchd_gpu_clock_event_seconds_total",
                            {"reason": reason},
                            f"q:{section}/{hit}",
                            _seconds,
                            # the counter grows 1 s/s while the reason holds, and the
                            # two reads are up to ~0.2 s apart
                            tolerance=0.25,
                        )
                    )
                    break
        for row in rows:
            ours = _match(samples, row.family, bus, row.labels)
            text, used = None, row.source
            for source in row.source.split(" | "):
                text = _lookup(source, query.get(bus, {}), qgpu, accepted)
                if text is not None:
                    used = source
                    break
            theirs_raw = None if text is None else row.convert(text)
            theirs = None if theirs_raw is None else theirs_raw * row.scale
            allowed = max(row.tolerance, abs(theirs or 0.0) * row.relative)
            if used.startswith("tlimit:"):
                # two readings rounded to whole degrees, taken at different instants
                allowed = max(allowed, TLIMIT_TOLERANCE)
            verdict = judge(ours, theirs, allowed)
            results.append(
                {
                    "gpu": bus,
                    "metric": row.family + _fmt(row.labels),
                    "gpuwatchd": ours,
                    "nvidia_smi": used,
                    "nvidia_smi_text": text,
                    "nvidia_smi_value": theirs,
                    "verdict": verdict,
                }
            )
        covered = {r.family for r in rows}
        for family in sorted(
            {s.name for s in samples if dict(s.labels).get("pci_bus_id", "").upper() == bus}
            - covered
        ):
            value = _match(samples, family, bus, {})
            results.append(
                {
                    "gpu": bus,
                    "metric": family,
                    "gpuwatchd": value,
                    "nvidia_smi": "",
                    "nvidia_smi_text": None,
                    "nvidia_smi_value": None,
                    "verdict": "no counterpart",
                }
            )
    return results


def _lookup(
    source: str, query: Mapping[str, str], qgpu: Mapping[str, str], accepted: set[str]
) -> str | None:
    """The nvidia-smi text one source names, or None where it has none."""
    where, _, name = source.partition(":")
    if where == "query":
        text = query.get(name) if name in accepted else None
        return None if text is None or "N/A" in text else text
    if where == "tlimit":
        # drivers from 580 print thresholds relative to T.Limit; T.Limit itself is
        # the current temperature plus the "GPU T.Limit Temp" margin
        cur = _num(qgpu.get("Temperature/GPU Current Temp", ""))
        margin = _num(qgpu.get("Temperature/GPU T.Limit Temp", ""))
        rel = _num(qgpu.get(f"Temperature/{name}", ""))
        if cur is None or margin is None or rel is None:
            return None
        limit = cur + margin
        return (
            f"{limit - rel:g} (T.Limit {limit:g} C, {name} {rel:g} C; derived from the "
            f"current temperature and a margin, each rounded: +-{TLIMIT_TOLERANCE:g} C accepted)"
        )
    return _q_value(qgpu, name)


def _unit(text: str) -> bool:
    return bool(re.match(r"\s*[0-9]+\s*(us|ns|ms|s)\b", text))


def _seconds(text: str) -> float | None:
    m = re.match(r"\s*([0-9.]+)\s*(us|ns|ms|s)\b", text)
    if not m:
        return None
    return float(m.group(1)) * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def _fmt(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""


def markdown(results: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table."""
    lines = [
        "| GPU | gpuwatchd metric | gpuwatchd | nvidia-smi | nvidia-smi says | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ours = "" if r["gpuwatchd"] is None else f"{r['gpuwatchd']:.6g}"
        ours = r.get("gpuwatchd_text") or ours  # topology rows compare text
        said = r["nvidia_smi_text"] or ""
        lines.append(
            f"| {r['gpu']} | `{r['metric']}` | {ours} | {r['nvidia_smi']} | {said} "
            f"| {r['verdict']} |"
        )
    counts: dict[str, int] = {}
    for r in results:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    lines.append("")
    lines.append("Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(lines) + "\n"
