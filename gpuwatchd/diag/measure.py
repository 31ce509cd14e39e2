"""What the diag worker reports: one typed measurement per line of JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["CHECKS", "Measurement", "TIERS", "checks_of"]

TIERS = ("quick", "standard", "dcgm")

# check name -> tiers that run it. Names are stable: metric labels and floors use them.
CHECKS: dict[str, tuple[str, ...]] = {
    "nvml_sanity": ("quick", "standard"),
    "gemm": ("quick", "standard"),
    "h2d_bandwidth": ("quick", "standard"),
    "d2d_bandwidth": ("quick", "standard"),
    "p2p_bandwidth": ("standard",),
    "all_reduce": ("standard",),
    "memory_pattern": ("standard",),
    "ecc_errors": ("standard",),
    "row_remap": ("standard",),
    "dcgm": ("dcgm",),
}


def checks_of(tier: str) -> tuple[str, ...]:
    """The checks a tier runs, in the order they run."""
    return tuple(name for name, tiers in CHECKS.items() if tier in tiers)


@dataclass(frozen=True)
class Measurement:
    """One figure from one check on one GPU ("0"), a pair ("0>1") or the node ("all").

    `correct` is False when the computed data was wrong (a GEMM off its
    reference, an all-reduce with a wrong sum, a memory word that did not
    read back); `error` says why the check could not run at all.
    """

    check: str
    gpu: str
    value: float | None
    unit: str
    correct: bool = True
    detail: str = ""
    error: str = ""
    seconds: float = 0.0

    def to_json(self) -> str:
        """One line of JSON."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        """Parse what `to_json` wrote; unknown keys are ignored, types are checked."""
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in data.items() if k in names}
        value = kept.get("value")
        if value is not None and not isinstance(value, (int, float)):
            raise ValueError(f"value is not a number: {value!r}")
        for key in ("check", "gpu", "unit"):
            if not isinstance(kept.get(key), str):
                raise ValueError(f"{key} missing or not a string")
        return cls(
            check=kept["check"],
            gpu=kept["gpu"],
            value=None if value is None else float(value),
            unit=kept["unit"],
            correct=bool(kept.get("correct", True)),
            detail=str(kept.get("detail", "")),
            error=str(kept.get("error", "")),
            seconds=float(kept.get("seconds", 0.0)),
        )
