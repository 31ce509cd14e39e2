"""Clocks, performance state and time spent in each clock-event reason.

Read as `nvidia-smi -q` shows them: current, maximum and application
clocks by domain (NVML reports MHz; exported in Hz), the P-state, and the
nanosecond counters behind "Clocks Event Reasons Counters" (field values)
as seconds since the driver loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpuwatchd.model import MetricSpec, MetricType
from gpuwatchd.sources.nvml.client import FieldKey

__all__ = [
    "CLOCK_DOMAINS",
    "CLOCK_EVENT_TIME_FIELDS",
    "PERF_METRICS",
    "clock_event_fields",
    "read_max_clocks",
    "read_perf",
]

Get = Callable[..., object | None]
Put = Callable[..., None]

CLOCK_DOMAINS = {"graphics": 0, "sm": 1, "memory": 2, "video": 3}  # nvmlClockType_t
_MHZ = 1e6
_UNKNOWN_PSTATE = 32
# NVML_FI_DEV_CLOCKS_EVENT_REASON_* (nanoseconds; the first two share ids with
# the power and sync-boost perf-policy counters)
CLOCK_EVENT_TIME_FIELDS = {
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP": "sw_power_cap",
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST": "sync_boost",
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": "sw_thermal_slowdown",
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": "hw_thermal_slowdown",
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": "hw_power_brake_slowdown",
}


def clock_event_fields() -> list[FieldKey]:
    """The field values read() must batch for the clock-event counters."""
    return [(name, 0) for name in CLOCK_EVENT_TIME_FIELDS]


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def read_max_clocks(get: Get) -> dict[str, float]:
    """Maximum clock per domain in Hz (read once: it does not change)."""
    out = {}
    for domain, kind in CLOCK_DOMAINS.items():
        mhz = _num(get("max_clock_info", kind))
        if mhz is not None:
            out[domain] = mhz * _MHZ
    return out


def read_perf(
    get: Get,
    put: Put,
    max_clocks: Mapping[str, float],
    fv: Mapping[FieldKey, float],
    last: dict[str, object],
    static: Get | None = None,
) -> None:
    """Current and application clocks, P-state and clock-event seconds.

    Application clocks are asked through `static` (the reader's cache of
    calls that do not change in steady state) when given.
    """
    for domain, kind in CLOCK_DOMAINS.items():
        mhz = _num(get("clock_info", kind))
        if mhz is not None:
            put("gpuwatchd_gpu_clock_hertz", mhz * _MHZ, clock=domain)
        if domain in max_clocks:
            put("gpuwatchd_gpu_clock_max_hertz", max_clocks[domain], clock=domain)
        if domain in ("graphics", "memory"):  # NVML has application clocks for these only
            app = _num((static or get)("applications_clock", kind))
            if app is not None:
                put("gpuwatchd_gpu_clock_application_hertz", app * _MHZ, clock=domain)
    pstate = get("performance_state")
    if isinstance(pstate, int) and 0 <= pstate < _UNKNOWN_PSTATE:
        put("gpuwatchd_gpu_performance_state", pstate)
        last["performance_state"] = f"P{pstate}"
    for name, reason in CLOCK_EVENT_TIME_FIELDS.items():
        ns = fv.get((name, 0))
        if ns is not None:
            put("gpuwatchd_gpu_clock_event_seconds_total", ns * 1e-9, reason=reason)


_GPU = ("gpu", "uuid", "pci_bus_id")


def _m(name: str, kind: MetricType, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, kind, help, _GPU + labels)


PERF_METRICS: tuple[MetricSpec, ...] = (
    _m(
        "gpuwatchd_gpu_memory_reserved_bytes",
        "gauge",
        "Framebuffer memory the driver reserves (not counted as used, as in nvidia-smi).",
    ),
    _m(
        "gpuwatchd_gpu_clock_hertz",
        "gauge",
        "Current clock in hertz (graphics, sm, memory, video).",
        "clock",
    ),
    _m("gpuwatchd_gpu_clock_max_hertz", "gauge", "Maximum clock in hertz, by domain.", "clock"),
    _m(
        "gpuwatchd_gpu_clock_application_hertz",
        "gauge",
        "Application (target) clock in hertz (graphics, memory).",
        "clock",
    ),
    _m("gpuwatchd_gpu_performance_state", "gauge", "Performance state: 0 (P0, fastest) to 15."),
    _m(
        "gpuwatchd_gpu_clock_event_seconds_total",
        "counter",
        "Time clocks were held down by this reason since the driver loaded.",
        "reason",
    ),
)
