"""What the diag worker reports: one typed measurement per line of JSON."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["CHECKS", "Measurement", "TIERS", "checks_of", "worker_results"]

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


def worker_results(tier: str, gpus: Sequence[str]) -> list[tuple[str, str]]:
    """Every (check, gpu) the worker must report for `tier` on `gpus`, in its order.

    A run that lacks one of them measured less than it claims: it is UNKNOWN,
    never OK. nvml_sanity, ecc_errors, row_remap and dcgm come from this process.
    """
    if tier not in ("quick", "standard"):
        return []
    out = [(c, g) for g in gpus for c in ("gemm", "h2d_bandwidth", "d2d_bandwidth")]
    if tier == "standard":
        out += [("p2p_bandwidth", f"{a}>{b}") for a, b in itertools.permutations(gpus, 2)]
        out += [("all_reduce", "all")] if len(gpus) > 1 else []
        out += [("memory_pattern", g) for g in gpus]
    return out


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
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"value is not a number: {value!r}")
        for key in ("check", "gpu", "unit"):
            if not isinstance(kept.get(key), str):
                raise ValueError(f"{key} missing or not a string")
        correct = kept.get("correct", True)
        if not isinstance(correct, bool):
            raise ValueError(f"correct is not true or false: {correct!r}")
        seconds = kept.get("seconds", 0.0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ValueError(f"seconds is not a number: {seconds!r}")
        # NaN, Infinity and null stay as they came: the verdict treats them as nothing measured.
        return cls(
            check=kept["check"],
            gpu=kept["gpu"],
            value=None if value is None else float(value),
            unit=kept["unit"],
            correct=correct,
            detail=str(kept.get("detail", "")),
            error=str(kept.get("error", "")),
            seconds=float(seconds) if math.isfinite(seconds) else 0.0,
        )
