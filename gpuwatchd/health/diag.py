"""Verdicts of `gpuwatchd diag`: each measurement against its floor, as data.

Floors ship in gpuwatchd/data/diag-floors.yaml (per GPU model, and per GPU
count for node-wide checks); a site file in the same format is matched
first. Correctness (a wrong GEMM, a bad memory word, a new uncorrectable
error) fails whatever the floor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gpuwatchd.diag.measure import Measurement
from gpuwatchd.errors import ConfigError
from gpuwatchd.shipped import shipped_text

__all__ = [
    "DiagResult",
    "Floor",
    "Floors",
    "Outcome",
    "evaluate",
    "load_floors",
    "verdict",
]

Outcome = Literal["pass", "fail", "error", "skipped", "cancelled"]


@dataclass(frozen=True)
class Floor:
    """The least value a check must reach, and where that figure comes from."""

    value: float
    source: str


@dataclass(frozen=True)
class DiagResult:
    """One check on one GPU: measured, floor, outcome and the floor's source."""

    check: str
    gpu: str
    outcome: Outcome
    measured: float | None
    unit: str
    floor: float | None = None
    floor_source: str = ""
    detail: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        """True when the check ran and the GPU did not meet it."""
        return self.outcome == "fail"


@dataclass(frozen=True)
class _ModelFloors:
    match: str
    checks: Mapping[str, Mapping[str, Any]]
    origin: str


class Floors:
    """Floors looked up by GPU model name, check and GPU count."""

    def __init__(self, models: Sequence[_ModelFloors], defaults: Sequence[_ModelFloors]) -> None:
        self._models = list(models)
        self._defaults = list(defaults)

    def lookup(self, check: str, model: str, gpu_count: int) -> Floor | None:
        """The floor of `check` for a GPU named `model` on a node of `gpu_count` GPUs."""
        lowered = model.lower()
        candidates = [m for m in self._models if m.match.lower() in lowered]
        for entry in [*candidates, *self._defaults]:
            spec = entry.checks.get(check)
            if spec is None:
                continue
            source = str(spec.get("source", "")) + (
                "" if entry.origin == "shipped" else f" (site floor, {entry.origin})"
            )
            if "floor" in spec:
                return Floor(float(spec["floor"]), source)
            counts = sorted(int(n) for n in spec.get("by_gpus", {}) if int(n) <= gpu_count)
            if counts:
                return Floor(float(spec["by_gpus"][counts[-1]]), source)
        return None


def _parse(data: object, origin: str) -> tuple[list[_ModelFloors], list[_ModelFloors]]:
    if not isinstance(data, dict):
        raise ConfigError(origin, "", "not a mapping")
    models = []
    for i, entry in enumerate(data.get("models") or []):
        if not isinstance(entry, dict) or not isinstance(entry.get("match"), str):
            raise ConfigError(origin, f"models[{i}]", "needs a string 'match'")
        models.append(_ModelFloors(entry["match"], _checks(entry, origin, f"models[{i}]"), origin))
    defaults = []
    if data.get("default") is not None:
        defaults.append(_ModelFloors("", _checks(data["default"], origin, "default"), origin))
    return models, defaults


def _checks(entry: object, origin: str, where: str) -> dict[str, Mapping[str, Any]]:
    checks = entry.get("checks") if isinstance(entry, dict) else None
    if not isinstance(checks, dict):
        raise ConfigError(origin, f"{where}.checks", "not a mapping")
    for name, spec in checks.items():
        ok = isinstance(spec, dict) and (
            isinstance(spec.get("floor"), (int, float))
            or (
                isinstance(spec.get("by_gpus"), dict)
                and all(isinstance(v, (int, float)) for v in spec["by_gpus"].values())
            )
        )
        if not ok:
            raise ConfigError(
                origin, f"{where}.checks.{name}", "needs a number 'floor' or 'by_gpus'"
            )
    return checks


def load_floors(site_file: str = "") -> Floors:
    """The shipped floors, with the site's file (if named) matched first."""
    import yaml  # here: the daemon stores diag results without ever judging one

    text = shipped_text("diag-floors.yaml")
    models, defaults = _parse(yaml.safe_load(text), "shipped")
    if site_file:
        try:
            site = yaml.safe_load(Path(site_file).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(site_file, "diag.floors_file", str(exc)) from exc
        site_models, site_defaults = _parse(site, site_file)
        models = site_models + models
        defaults = site_defaults + defaults
    return Floors(models, defaults)


def _model_of(gpu: str, models: Mapping[str, str]) -> str:
    """The model of a GPU label ("0"), a pair ("0>1": the source's) or the node ("all")."""
    first = gpu.split(">")[0]
    if first in models:
        return models[first]
    return next(iter(models.values()), "")


def evaluate(
    measurements: Iterable[Measurement], models: Mapping[str, str], floors: Floors
) -> list[DiagResult]:
    """Each measurement's outcome; `models` maps a GPU index ("0") to its NVML name."""
    out = []
    for m in measurements:
        if m.error:
            out.append(
                DiagResult(
                    m.check, m.gpu, "error", m.value, m.unit, detail=m.error, seconds=m.seconds
                )
            )
            continue
        if m.unit == "skipped":
            out.append(DiagResult(m.check, m.gpu, "skipped", None, "", detail=m.detail))
            continue
        floor = floors.lookup(m.check, _model_of(m.gpu, models), len(models))
        outcome: Outcome = "pass"
        if not m.correct:
            outcome = "fail"
        elif floor is not None and m.value is not None and m.value < floor.value:
            outcome = "fail"
        out.append(
            DiagResult(
                m.check,
                m.gpu,
                outcome,
                m.value,
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
