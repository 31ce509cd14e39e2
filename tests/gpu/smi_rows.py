"""The rows of compare_nvidia_smi.py: each gpuwatchd metric beside its nvidia-smi value.

A row names the nvidia-smi source ("query:FIELD", "q:Section/Key" or
"tlimit:Key", alternatives joined by " | "), how to turn its text into a
number and how far the two may differ; smi_judge.py applies the rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MIB = 1024 * 1024


def _num(text: str) -> float | None:
    m = re.match(r"\s*(-?[0-9.]+)", text)
    return float(m.group(1)) if m else None


def _flag(text: str) -> float | None:
    t = text.strip().lower()
    if t in ("enabled", "active", "yes", "1"):
        return 1.0
    if t in ("disabled", "not active", "no", "0"):
        return 0.0
    return None


def _pstate(text: str) -> float | None:
    m = re.match(r"\s*P(\d+)", text)
    return float(m.group(1)) if m else None


@dataclass(frozen=True)
class Row:
    """One metric of gpuwatchd against one nvidia-smi value."""

    family: str
    labels: Mapping[str, str]
    source: str  # "query:FIELD" or "q:Section/Key"
    convert: Callable[[str], float | None]
    scale: float = 1.0
    tolerance: float = 0.0  # absolute, in the metric's unit
    relative: float = 0.0  # fraction of the nvidia-smi value


def _rows() -> list[Row]:
    rows = [
        Row(
            "gpuwatchd_gpu_temperature_celsius",
            {"sensor": "gpu"},
            "query:temperature.gpu",
            _num,
            tolerance=2,
        ),
        Row(
            "gpuwatchd_gpu_temperature_celsius",
            {"sensor": "memory"},
            "query:temperature.memory",
            _num,
            tolerance=2,
        ),
        Row(
            "gpuwatchd_gpu_temperature_threshold_celsius",
            {"threshold": "shutdown"},
            "q:Temperature/GPU Shutdown Temp | tlimit:GPU Shutdown T.Limit Temp",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_temperature_threshold_celsius",
            {"threshold": "slowdown"},
            "q:Temperature/GPU Slowdown Temp | tlimit:GPU Slowdown T.Limit Temp",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_temperature_threshold_celsius",
            {"threshold": "gpu_max"},
            "q:Temperature/GPU Max Operating Temp | tlimit:GPU Max Operating T.Limit Temp",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_temperature_threshold_celsius",
            {"threshold": "memory_max"},
            "q:Temperature/Memory Max Operating Temp",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_power_watts",
            {},
            "query:power.draw.instant",
            _num,
            tolerance=15,
            relative=0.1,
        ),
        Row(
            "gpuwatchd_gpu_power_limit_watts", {}, "query:enforced.power.limit", _num, tolerance=0.5
        ),
        Row(
            "gpuwatchd_gpu_utilization_ratio",
            {"engine": "gpu"},
            "query:utilization.gpu",
            _num,
            scale=0.01,
            tolerance=0.1,
        ),
        Row(
            "gpuwatchd_gpu_utilization_ratio",
            {"engine": "memory"},
            "query:utilization.memory",
            _num,
            scale=0.01,
            tolerance=0.1,
        ),
        Row(
            "gpuwatchd_gpu_memory_capacity_bytes",
            {},
            "query:memory.total",
            _num,
            scale=MIB,
            tolerance=MIB,
        ),
        Row(
            "gpuwatchd_gpu_memory_reserved_bytes",
            {},
            "query:memory.reserved",
            _num,
            scale=MIB,
            tolerance=MIB,
        ),
        Row(
            "gpuwatchd_gpu_memory_used_bytes",
            {},
            "query:memory.used",
            _num,
            scale=MIB,
            tolerance=4 * MIB,
        ),
        Row(
            "gpuwatchd_gpu_memory_free_bytes",
            {},
            "query:memory.free",
            _num,
            scale=MIB,
            tolerance=4 * MIB,
        ),
        Row("gpuwatchd_gpu_performance_state", {}, "query:pstate", _pstate),
        Row(
            "gpuwatchd_gpu_pcie_link_generation",
            {"which": "current"},
            "query:pcie.link.gen.current",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_pcie_link_generation", {"which": "max"}, "query:pcie.link.gen.max", _num
        ),
        Row(
            "gpuwatchd_gpu_pcie_link_width",
            {"which": "current"},
            "query:pcie.link.width.current",
            _num,
        ),
        Row("gpuwatchd_gpu_pcie_link_width", {"which": "max"}, "query:pcie.link.width.max", _num),
        Row("gpuwatchd_gpu_ecc_enabled", {"which": "current"}, "query:ecc.mode.current", _flag),
        Row("gpuwatchd_gpu_ecc_enabled", {"which": "pending"}, "query:ecc.mode.pending", _flag),
        Row(
            "gpuwatchd_gpu_remapped_rows_total",
            {"cause": "correctable"},
            "query:remapped_rows.correctable",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_remapped_rows_total",
            {"cause": "uncorrectable"},
            "query:remapped_rows.uncorrectable",
            _num,
        ),
        Row("gpuwatchd_gpu_row_remap_pending", {}, "query:remapped_rows.pending", _flag),
        Row("gpuwatchd_gpu_row_remap_failure", {}, "query:remapped_rows.failure", _flag),
        Row("gpuwatchd_gpu_mig_mode", {"which": "current"}, "query:mig.mode.current", _flag),
        Row("gpuwatchd_gpu_mig_mode", {"which": "pending"}, "query:mig.mode.pending", _flag),
    ]
    for err in ("corrected", "uncorrected"):
        for scope in ("volatile", "aggregate"):
            rows.append(
                Row(
                    "gpuwatchd_gpu_ecc_errors_total",
                    {"error": err, "scope": scope},
                    f"query:ecc.errors.{err}.{scope}.total",
                    _num,
                )
            )
    for clock, field, q_name in (
        ("graphics", "gr", "Graphics"),
        ("sm", "sm", "SM"),
        ("memory", "mem", "Memory"),
        ("video", "video", "Video"),
    ):
        rows.append(
            Row(
                "gpuwatchd_gpu_clock_hertz",
                {"clock": clock},
                f"query:clocks.{field} | q:Clocks/{q_name}",
                _num,
                scale=1e6,
                relative=0.05,
            )
        )
        rows.append(
            Row(
                "gpuwatchd_gpu_clock_max_hertz",
                {"clock": clock},
                f"q:Max Clocks/{q_name}",
                _num,
                scale=1e6,
            )
        )
    for clock, q_name in (("graphics", "Graphics"), ("memory", "Memory")):
        rows.append(
            Row(
                "gpuwatchd_gpu_clock_application_hertz",
                {"clock": clock},
                f"q:Applications Clocks/{q_name}",
                _num,
                scale=1e6,
            )
        )
    for reason in (
        "gpu_idle",
        "applications_clocks_setting",
        "sw_power_cap",
        "hw_slowdown",
        "sync_boost",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    ):
        rows.append(
            Row(
                "gpuwatchd_gpu_clock_event_active",
                {"reason": reason},
                f"query:clocks_event_reasons.{reason}",
                _flag,
            )
        )
    return rows
