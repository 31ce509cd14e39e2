"""Diag runs as events in the store: one `diag` event per run, one `diag_fail` per failure.

Whoever runs the checks (the CLI, `clear --resume`, the daemon's scheduler)
records them here; the daemon's metrics and /status read them back, so a
run from a Slurm epilog shows up in the fleet's view like a scheduled one.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from gpuwatchd.health.diag.verdict import DiagResult
from gpuwatchd.model import Event, Severity
from gpuwatchd.sinks.store import EventStore

__all__ = [
    "FAIL_KIND",
    "REPEAT_WINDOW_SECONDS",
    "RUN_KIND",
    "RecordedRun",
    "failures_by_gpu",
    "last_runs",
    "record_run",
    "repeat_offenders",
]

RUN_KIND = "diag"
FAIL_KIND = "diag_fail"
REPEAT_WINDOW_SECONDS = 30 * 86400.0


@dataclass(frozen=True)
class RecordedRun:
    """One stored run, as the metrics and /status need it."""

    time: float
    tier: str
    verdict: str
    trigger: str
    seconds: float
    cancelled: str
    results: tuple[dict[str, Any], ...]


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def record_run(
    store: EventStore,
    *,
    tier: str,
    verdict: str,
    results: tuple[DiagResult, ...],
    buses: dict[str, str],
    seconds: float,
    cancelled: str = "",
    trigger: str = "cli",
    t: float | None = None,
) -> None:
    """Store the run and each failed result (with the GPU's bus id)."""
    now = time.time() if t is None else t
    failed = [r for r in results if r.failed]
    summary = f"diag {tier}: {verdict}"
    if cancelled:
        summary += f", cancelled ({cancelled})"
    elif failed:
        summary += ", failed " + ", ".join(f"{r.check} on GPU {r.gpu}" for r in failed[:8])
    outcomes = ";".join(
        f"{r.check}|{r.gpu}|{r.outcome}|{_fmt(r.measured)}|{_fmt(r.floor)}|{r.unit}"
        for r in results
    )
    run = Event(
        kind=RUN_KIND,
        source="diag",
        time=now,
        message=summary,
        severity=Severity.WARNING if failed else Severity.INFO,
        attrs=tuple(
            sorted(
                {
                    "tier": tier,
                    "verdict": verdict,
                    "trigger": trigger,
                    "seconds": f"{seconds:.1f}",
                    "cancelled": cancelled,
                    "results": outcomes,
                }.items()
            )
        ),
    )
    rows = [(run, "", 1)]
    for r in failed:
        rows.append(
            (
                Event(
                    kind=FAIL_KIND,
                    source="diag",
                    time=now,
                    pci_bus_id=buses.get(r.gpu.split(">")[0], "") if r.gpu != "all" else "",
                    message=f"diag {r.check} failed on GPU {r.gpu}: {_fmt(r.measured)} {r.unit}"
                    + (
                        f" below the floor {_fmt(r.floor)}"
                        if r.floor is not None
                        else f" ({r.detail})"
                    ),
                    severity=Severity.WARNING,
                    attrs=tuple(
                        sorted(
                            {
                                "check": r.check,
                                "gpu": r.gpu,
                                "tier": tier,
                                "measured": _fmt(r.measured),
                                "floor": _fmt(r.floor),
                                "unit": r.unit,
                                "floor_source": r.floor_source[:300],
                            }.items()
                        )
                    ),
                ),
                "",
                1,
            )
        )
    store.write(rows)


def _parse_results(text: str) -> tuple[dict[str, Any], ...]:
    out = []
    for item in text.split(";") if text else []:
        parts = item.split("|")
        if len(parts) != 6:
            continue
        check, gpu, outcome, measured, floor, unit = parts
        out.append(
            {
                "check": check,
                "gpu": gpu,
                "outcome": outcome,
                "unit": unit,
                "measured": float(measured) if measured else None,
                "floor": float(floor) if floor else None,
            }
        )
    return tuple(out)


def last_runs(store: EventStore, limit: int = 50) -> list[RecordedRun]:
    """The newest runs first."""
    out = []
    for row in store.recent(limit, kind=RUN_KIND):
        attrs = row.get("attrs") or {}
        out.append(
            RecordedRun(
                time=float(row.get("time") or 0.0),
                tier=str(attrs.get("tier", "")),
                verdict=str(attrs.get("verdict", "")),
                trigger=str(attrs.get("trigger", "")),
                seconds=float(attrs.get("seconds") or 0.0),
                cancelled=str(attrs.get("cancelled", "")),
                results=_parse_results(str(attrs.get("results", ""))),
            )
        )
    return out


def failures_by_gpu(store: EventStore, now: float) -> Counter[tuple[str, str]]:
    """Failures per (check, GPU) over the last 30 days."""
    counts: Counter[tuple[str, str]] = Counter()
    for row in store.recent(10000, kind=FAIL_KIND, since=now - REPEAT_WINDOW_SECONDS):
        attrs = row.get("attrs") or {}
        counts[(str(attrs.get("check", "")), str(attrs.get("gpu", "")))] += 1
    return counts


def repeat_offenders(store: EventStore, now: float, threshold: int) -> list[tuple[str, str]]:
    """(check, GPU) pairs that failed `threshold` times or more in 30 days: drain_and_inspect."""
    return sorted(k for k, n in failures_by_gpu(store, now).items() if n >= threshold)
