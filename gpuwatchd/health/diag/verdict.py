"""Verdicts of `gpuwatchd diag`: each measurement against its floor, as data.

Floors ship in gpuwatchd/data/diag-floors.yaml (per GPU model, and per GPU
count for node-wide checks); a site file in the same format is matched
first (config/floors.py reads and checks both). Correctness (a wrong GEMM,
a bad memory word, a new uncorrectable error) fails whatever the floor; a
figure that is missing, NaN or infinite measured nothing and is an error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from gpuwatchd.config.floors import Floor, Floors, load_floors
from gpuwatchd.diag.worker.measure import Measurement
from gpuwatchd.model import DiagOutcome, DiagResult

__all__ = [
    "Floor",
    "Floors",
    "evaluate",
    "load_floors",
    "verdict",
]


def _model_of(gpu: str, models: Mapping[str, str]) -> str:
    """The model of a GPU label ("0"), a pair ("0>1": the source's) or the node ("all")."""
    first = gpu.split(">")[0]
    if first in models:
        return models[first]
    return next(iter(models.values()), "")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def evaluate(
    measurements: Iterable[Measurement], models: Mapping[str, str], floors: Floors
) -> list[DiagResult]:
    """Each measurement's outcome; `models` maps a GPU index ("0") to its NVML name."""
    out = []
    for m in measurements:
        if m.error:
            out.append(
                DiagResult(
                    m.check,
                    m.gpu,
                    "error",
                    _finite(m.value),
                    m.unit,
                    detail=m.error,
                    seconds=m.seconds,
                )
            )
            continue
        if m.unit == "skipped":
            out.append(DiagResult(m.check, m.gpu, "skipped", None, "", detail=m.detail))
            continue
        value = _finite(m.value)
        if value is None and m.correct:
            # null, NaN or Infinity: nothing was measured (a wrong result still fails below)
            got = "no value" if m.value is None else f"{m.value} is not a measurement"
            out.append(
                DiagResult(m.check, m.gpu, "error", None, m.unit, detail=got, seconds=m.seconds)
            )
            continue
        floor = floors.lookup(m.check, _model_of(m.gpu, models), len(models))
        outcome: DiagOutcome = "pass"
        if not m.correct:
            outcome = "fail"
        elif floor is not None and value is not None and value < floor.value:
            outcome = "fail"
        out.append(
            DiagResult(
                m.check,
                m.gpu,
                outcome,
                value,
                m.unit,
                None if floor is None else floor.value,
                "" if floor is None else floor.source,
                m.detail,
                m.seconds,
            )
        )
    return out


def verdict(results: Sequence[DiagResult]) -> str:
    """OK, CRITICAL (a check failed) or UNKNOWN (a check could not run, or nothing ran)."""
    if any(r.outcome == "fail" for r in results):
        return "CRITICAL"
    if not results or any(r.outcome in ("error", "cancelled") for r in results):
        return "UNKNOWN"
    if all(r.outcome == "skipped" for r in results):
        return "UNKNOWN"
    if any(r.outcome == "skipped" and r.check == "dcgm" for r in results):
        return "UNKNOWN"  # the dcgm tier without DCGM checked nothing it was asked to
    return "OK"
