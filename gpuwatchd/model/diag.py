"""The typed payload of a diag run: the run (`DiagRun`) and each check's result (`DiagResult`).

`gpuwatchd diag`, `clear --resume` and the daemon's scheduler make a
`DiagRun`; the `diag` event carries it (`Event.diag`) and the store writes
its string view (`attrs()`) once. `from_attrs` reads a stored row back,
typed: the results as written since this format (a JSON list) and as
written before it (`check|gpu|outcome|measured|floor|unit`, `;`-separated).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast

__all__ = ["DIAG_KIND", "DiagOutcome", "DiagResult", "DiagRun"]

DIAG_KIND = "diag"  # Event.kind of a run

DiagOutcome = Literal["pass", "fail", "error", "skipped", "cancelled"]
_OUTCOMES: tuple[str, ...] = ("pass", "fail", "error", "skipped", "cancelled")


@dataclass(frozen=True, slots=True)
class DiagResult:
    """One check on one GPU: measured, floor, outcome and the floor's source."""

    check: str
    gpu: str  # an index ("0"), a pair ("0>1": source and destination) or the node ("all")
    outcome: DiagOutcome
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

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DiagResult | None:
        """What `to_json` wrote; None for an entry that is not one."""
        outcome = data.get("outcome")
        if outcome not in _OUTCOMES or not isinstance(data.get("check"), str):
            return None
        return cls(
            check=str(data["check"]),
            gpu=str(data.get("gpu", "")),
            outcome=cast(DiagOutcome, outcome),
            measured=_number(data.get("measured")),
            unit=str(data.get("unit", "")),
            floor=_number(data.get("floor")),
            floor_source=str(data.get("floor_source", "")),
            detail=str(data.get("detail", "")),
            seconds=_number(data.get("seconds")) or 0.0,
        )


@dataclass(frozen=True, slots=True)
class DiagRun:
    """One run of a tier: its verdict and results; a cancelled run carries no results."""

    tier: str
    started: float  # Unix time
    seconds: float
    verdict: str  # OK, CRITICAL or UNKNOWN
    results: tuple[DiagResult, ...] = ()
    backend: str = ""  # cupy, torch, dcgmi
    cancelled: str = ""  # why, when cancelled
    error: str = ""
    gpus: tuple[str, ...] = ()
    freed_seconds: float = 0.0  # how long the GPUs took to be free after a cancel
    models: Mapping[str, str] = field(default_factory=dict, hash=False)  # index -> NVML name
    buses: Mapping[str, str] = field(default_factory=dict, hash=False)  # index -> PCI bus id
    trigger: str = ""  # cli, schedule, after_critical, resume: set when recorded

    @property
    def failed(self) -> tuple[DiagResult, ...]:
        """The results that failed."""
        return tuple(r for r in self.results if r.failed)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (`gpuwatchd diag --json`, `/events?kind=diag`)."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["results"] = [r.to_json() for r in self.results]
        out["gpus"] = list(self.gpus)
        out["models"] = dict(self.models)
        out["buses"] = dict(self.buses)
        return out

    def attrs(self) -> tuple[tuple[str, str], ...]:
        """The run as the event's string attrs (the store keeps these; sorted)."""
        out = {
            "tier": self.tier,
            "verdict": self.verdict,
            "trigger": self.trigger,
            "seconds": repr(self.seconds),
            "cancelled": self.cancelled,
            "started": repr(self.started),
            "results": _dumps([r.to_json() for r in self.results]),
        }
        optional = {
            "backend": self.backend,
            "error": self.error,
            "gpus": ",".join(self.gpus),
            "freed_seconds": repr(self.freed_seconds) if self.freed_seconds else "",
            "models": _dumps(dict(self.models)) if self.models else "",
            "buses": _dumps(dict(self.buses)) if self.buses else "",
        }
        out.update((k, v) for k, v in optional.items() if v)
        return tuple(sorted(out.items()))

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, str], started: float = 0.0) -> DiagRun:
        """The run `attrs()` wrote (a stored row read back); `started` for rows written
        before the run kept its own start (the event's time)."""
        a = attrs
        return cls(
            tier=a.get("tier", ""),
            started=_float(a.get("started", ""), started),
            seconds=_float(a.get("seconds", ""), 0.0),
            verdict=a.get("verdict", ""),
            results=_results(a.get("results", "")),
            backend=a.get("backend", ""),
            cancelled=a.get("cancelled", ""),
            error=a.get("error", ""),
            gpus=tuple(g for g in a.get("gpus", "").split(",") if g),
            freed_seconds=_float(a.get("freed_seconds", ""), 0.0),
            models=_str_map(a.get("models", "")),
            buses=_str_map(a.get("buses", "")),
            trigger=a.get("trigger", ""),
        )


def _dumps(value: object) -> str:
    # NaN or infinity never reach a result (verdicts keep finite figures); refuse them anyway
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _results(text: str) -> tuple[DiagResult, ...]:
    if not text:
        return ()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            return ()
        parsed = (DiagResult.from_json(i) for i in items if isinstance(i, dict))
        return tuple(r for r in parsed if r is not None)
    return _pipe_results(text)


def _pipe_results(text: str) -> tuple[DiagResult, ...]:
    """Results as stored before the typed payload: `check|gpu|outcome|measured|floor|unit`."""
    out = []
    for item in text.split(";"):
        parts = item.split("|")
        if len(parts) != 6 or parts[2] not in _OUTCOMES:
            continue
        check, gpu, outcome, measured, floor, unit = parts
        out.append(
            DiagResult(
                check,
                gpu,
                cast(DiagOutcome, outcome),
                _opt_float(measured),
                unit,
                _opt_float(floor),
            )
        )
    return tuple(out)


def _opt_float(text: str) -> float | None:
    try:
        value = float(text) if text else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def _float(text: str, default: float) -> float:
    value = _opt_float(text)
    return default if value is None else value


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _str_map(text: str) -> dict[str, str]:
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
