"""Memory health of one GPU: ECC mode and counters, retired pages, row remapping.

Read as `nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER` shows them. The
ECC mode changes only with a reset, so it is asked through the reader's
static cache (gpuwatchd/sources/nvml/static.py); the counters every poll.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ECC_ERRORS", "ECC_LOCATIONS", "ECC_SCOPES", "RETIREMENT_CAUSES", "read_memory"]

Get = Callable[..., object | None]
Put = Callable[..., None]

ECC_ERRORS = {"corrected": 0, "uncorrected": 1}  # nvmlMemoryErrorType_t
ECC_SCOPES = {"volatile": 0, "aggregate": 1}  # nvmlEccCounterType_t
# nvmlMemoryLocation_t; most are pre-Hopper and simply unsupported on newer GPUs
ECC_LOCATIONS = {
    "l1_cache": 0,
    "l2_cache": 1,
    "dram": 2,
    "register_file": 3,
    "texture_memory": 4,
    "texture_shm": 5,
    "cbu": 6,
    "sram": 7,
}
RETIREMENT_CAUSES = {"multiple_single_bit_ecc": 0, "double_bit_ecc": 1}


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def read_memory(get: Get, static: Get, put: Put, last: dict[str, object]) -> None:
    """ECC mode (through `static`), ECC counters, page retirement and row remapping."""
    mode = static("ecc_mode")
    if isinstance(mode, list) and len(mode) == 2:
        put("gpuwatchd_gpu_ecc_enabled", _num(mode[0]), which="current")
        put("gpuwatchd_gpu_ecc_enabled", _num(mode[1]), which="pending")
    for err, e in ECC_ERRORS.items():
        for scope, c in ECC_SCOPES.items():
            value = _num(get("total_ecc_errors", e, c))
            put("gpuwatchd_gpu_ecc_errors_total", value, error=err, scope=scope)
            if (err, scope) == ("uncorrected", "volatile"):
                last["ecc_uncorrected_volatile"] = value
            for loc, where in ECC_LOCATIONS.items():
                value = _num(get("memory_error_counter", e, c, where))
                put(
                    "gpuwatchd_gpu_ecc_location_errors_total",
                    value,
                    error=err,
                    scope=scope,
                    location=loc,
                )
    for cause, kind in RETIREMENT_CAUSES.items():
        pages = get("retired_pages", kind)
        if isinstance(pages, list):
            put("gpuwatchd_gpu_retired_pages_total", len(pages), cause=cause)
    put("gpuwatchd_gpu_retired_pages_pending", _num(get("retired_pages_pending_status")))
    rows = get("remapped_rows")
    if isinstance(rows, list) and len(rows) == 4:
        put("gpuwatchd_gpu_remapped_rows_total", _num(rows[0]), cause="correctable")
        put("gpuwatchd_gpu_remapped_rows_total", _num(rows[1]), cause="uncorrectable")
        put("gpuwatchd_gpu_row_remap_pending", _num(rows[2]))
        put("gpuwatchd_gpu_row_remap_failure", _num(rows[3]))
        last["row_remap_pending"] = _num(rows[2])
    hist = get("row_remapper_histogram")
    if isinstance(hist, dict):
        for availability in ("max", "high", "partial", "low", "none"):
            put(
                "gpuwatchd_gpu_row_remap_availability_banks",
                _num(hist.get(availability)),
                availability=availability,
            )
