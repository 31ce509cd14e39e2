"""Diag runs as events in the store: one `diag` event per run, one `diag_fail` per failure.

Whoever runs the checks (the CLI, `clear --resume`, the daemon's scheduler)
records them here; the daemon's metrics and /status read them back, so a
run from a Slurm epilog shows up in the fleet's view like a scheduled one.
The `diag` event carries the typed run (`model.DiagRun`), written once as
its attrs view and read back typed, rows written before the typed payload
included; a `diag_fail` row is the store's index of failures per check and
GPU, which the repeat-offender count queries.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from gpuwatchd.model import DIAG_KIND, DiagResult, DiagRun, Event, Severity
from gpuwatchd.sinks.store import EventStore

__all__ = [
    "FAIL_KIND",
    "PendingRun",
    "REPEAT_WINDOW_SECONDS",
    "RUN_KIND",
    "failures_by_gpu",
    "last_runs",
    "record_run",
    "repeat_offenders",
]

RUN_KIND = DIAG_KIND
FAIL_KIND = "diag_fail"
REPEAT_WINDOW_SECONDS = 30 * 86400.0


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def record_run(store: EventStore, run: DiagRun) -> None:
    """Store the run (its trigger set) and each failed result (with the GPU's bus id)."""
    failed = run.failed
    summary = f"diag {run.tier}: {run.verdict}"
    if run.cancelled:
        summary += f", cancelled ({run.cancelled})"
    elif failed:
        summary += ", failed " + ", ".join(f"{r.check} on GPU {r.gpu}" for r in failed[:8])
    event = Event(
        kind=RUN_KIND,
        source="diag",
        time=run.started,
        message=summary,
        severity=Severity.WARNING if failed else Severity.INFO,
        payload=run,
    )
    store.write([(event, "", 1)] + [(_failure(run, r), "", 1) for r in failed])


def _failure(run: DiagRun, r: DiagResult) -> Event:
    if r.floor is not None:
        why = f" below the floor {_fmt(r.floor)}"
    else:
        why = f" ({r.detail})"
    return Event(
        kind=FAIL_KIND,
        source="diag",
        time=run.started,
        pci_bus_id=run.buses.get(r.gpu.split(">")[0], "") if r.gpu != "all" else "",
        message=f"diag {r.check} failed on GPU {r.gpu}: {_fmt(r.measured)} {r.unit}{why}",
        severity=Severity.WARNING,
        attrs=tuple(
            sorted(
                {
                    "check": r.check,
                    "gpu": r.gpu,
                    "tier": run.tier,
                    "measured": _fmt(r.measured),
                    "floor": _fmt(r.floor),
                    "unit": r.unit,
                    "floor_source": r.floor_source[:300],
                }.items()
            )
        ),
    )


@dataclass(frozen=True, slots=True)
class PendingRun:
    """A run the command context records when the command ends (`app.Outcome`)."""

    run: DiagRun

    def record_into(self, store: EventStore, trigger: str) -> None:
        """Store the run with `trigger` (the CLI's: `cli`)."""
        record_run(store, dataclasses.replace(self.run, trigger=trigger))


def last_runs(store: EventStore, limit: int = 50) -> list[DiagRun]:
    """The newest runs first, typed."""
    out = []
    for row in store.recent(limit, kind=RUN_KIND):
        attrs = {str(k): str(v) for k, v in (row.get("attrs") or {}).items()}
        out.append(DiagRun.from_attrs(attrs, float(row.get("time") or 0.0)))
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
