"""Floors of `gpuwatchd diag`: the shipped file and a site's, read and fully checked at load.

A floor is a finite number >= 0 (`floor`), or a table of them by GPU count
(`by_gpus`, whole counts >= 1). A site file that fails any check is refused
when the config is loaded (exit 78), before any GPU work, never while a run
is being judged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatchd.config.yamlfile import load_yaml
from gpuwatchd.diag.worker.measure import CHECKS
from gpuwatchd.errors import ConfigError
from gpuwatchd.logs import escape_control
from gpuwatchd.shipped import shipped_text

__all__ = ["Floor", "Floors", "load_floors"]

SHIPPED = "shipped"
_TOP_KEYS = ("version", "models", "default")
_SPEC_KEYS = ("floor", "by_gpus", "source")


@dataclass(frozen=True)
class Floor:
    """The least value a check must reach, and where that figure comes from."""

    value: float
    source: str


@dataclass(frozen=True)
class _Spec:
    """One check's floor in one entry: a single figure, or figures by GPU count."""

    source: str
    floor: float | None = None
    by_gpus: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _ModelFloors:
    match: str
    checks: Mapping[str, _Spec]
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
            source = spec.source + (
                "" if entry.origin == SHIPPED else f" (site floor, {entry.origin})"
            )
            if spec.floor is not None:
                return Floor(spec.floor, source)
            counts = sorted(n for n in spec.by_gpus if n <= gpu_count)
            if counts:
                return Floor(spec.by_gpus[counts[-1]], source)
        return None


def load_floors(site_file: str = "") -> Floors:
    """The shipped floors, with the site's file (if named) matched first."""
    models, defaults = _parse(load_yaml(shipped_text("diag-floors.yaml"), SHIPPED), SHIPPED)
    if site_file:
        try:
            with open(site_file, "rb") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(site_file, "", f"cannot read: {exc.strerror or exc}") from None
        site_models, site_defaults = _parse(load_yaml(text, site_file), site_file)
        models = site_models + models
        defaults = site_defaults + defaults
    return Floors(models, defaults)


def _parse(data: object, origin: str) -> tuple[list[_ModelFloors], list[_ModelFloors]]:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(origin, "(top level)", "must be a mapping")
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(origin, _shown(key), f"unknown key (known: {', '.join(_TOP_KEYS)})")
    entries = data.get("models") or []
    if not isinstance(entries, list):
        raise ConfigError(origin, "models", "must be a list")
    models = []
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("match"), str):
            raise ConfigError(origin, where, "needs a string 'match'")
        if not entry["match"].strip():
            raise ConfigError(origin, f"{where}.match", "empty: it would match every GPU")
        models.append(_ModelFloors(entry["match"], _checks(entry, origin, where), origin))
    defaults = []
    if data.get("default") is not None:
        defaults.append(_ModelFloors("", _checks(data["default"], origin, "default"), origin))
    return models, defaults


def _checks(entry: object, origin: str, where: str) -> dict[str, _Spec]:
    checks = entry.get("checks") if isinstance(entry, dict) else None
    if not isinstance(checks, dict):
        raise ConfigError(origin, f"{where}.checks", "not a mapping")
    out = {}
    for name, spec in checks.items():
        key = f"{where}.checks.{_shown(name)}"
        if name not in CHECKS:
            raise ConfigError(origin, key, f"unknown check (known: {', '.join(CHECKS)})")
        out[str(name)] = _spec(spec, origin, key)
    return out


def _spec(spec: object, origin: str, key: str) -> _Spec:
    if not isinstance(spec, dict) or ("floor" in spec) == ("by_gpus" in spec):
        raise ConfigError(origin, key, "needs a number 'floor' or 'by_gpus' (one of them)")
    for k in spec:
        if k not in _SPEC_KEYS:
            raise ConfigError(
                origin, f"{key}.{_shown(k)}", f"unknown key (known: {', '.join(_SPEC_KEYS)})"
            )
    source = spec.get("source", "")
    if not isinstance(source, str):
        raise ConfigError(origin, f"{key}.source", "must be a string")
    if "floor" in spec:
        return _Spec(source, floor=_figure(spec["floor"], origin, f"{key}.floor"))
    table = spec["by_gpus"]
    if not isinstance(table, dict) or not table:
        raise ConfigError(origin, f"{key}.by_gpus", "must be a mapping {GPU count: floor}")
    by_gpus = {}
    for count, value in table.items():
        where = f"{key}.by_gpus.{_shown(count)}"
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(origin, where, "the GPU count must be a whole number >= 1")
        by_gpus[count] = _figure(value, origin, where)
    return _Spec(source, by_gpus=by_gpus)


def _figure(value: object, origin: str, key: str) -> float:
    """A floor: a finite number >= 0 (NaN would pass everything, a negative one too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(origin, key, f"must be a number, got {escape_control(repr(value), 40)}")
    try:
        number = float(value)
    except OverflowError:
        raise ConfigError(origin, key, "must be a finite number") from None
    if not math.isfinite(number):
        raise ConfigError(origin, key, f"must be a finite number, got {number}")
    if number < 0:
        raise ConfigError(origin, key, f"must be >= 0, got {number:g}")
    return number


def _shown(key: object) -> str:
    return escape_control(str(key), 64)
