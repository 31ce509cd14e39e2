"""GPM profiling metrics (Hopper and later): what DCGM's profiling fields report.

The client answers `gpm_metrics` with the values between this poll's
sample and the previous poll's (an empty answer the first time), so each
value covers one poll interval. NVML gives activities in percent and
throughput in MiB/s; they are exported as ratios and bytes per second.
Where the GPU has no GPM, only `gpuwatchd_gpu_gpm_supported 0` is exported.
The DCGM field of each family is in docs/metrics.md (scripts/gen_metrics_doc.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpuwatchd.model import MetricSpec, MetricType

__all__ = ["GPM_METRICS", "read_gpm", "samples_from_gpm"]

Get = Callable[..., object | None]
Put = Callable[..., None]

_MIB = 1024.0 * 1024.0
# our metric -> (family, extra labels, scale)
_FAMILIES: Mapping[str, tuple[str, Mapping[str, str], float]] = {
    "sm_active": ("gpuwatchd_gpu_sm_active_ratio", {}, 0.01),
    "sm_occupancy": ("gpuwatchd_gpu_sm_occupancy_ratio", {}, 0.01),
    "tensor_active": ("gpuwatchd_gpu_pipe_active_ratio", {"pipe": "tensor"}, 0.01),
    "fp64_active": ("gpuwatchd_gpu_pipe_active_ratio", {"pipe": "fp64"}, 0.01),
    "fp32_active": ("gpuwatchd_gpu_pipe_active_ratio", {"pipe": "fp32"}, 0.01),
    "fp16_active": ("gpuwatchd_gpu_pipe_active_ratio", {"pipe": "fp16"}, 0.01),
    "dram_active": ("gpuwatchd_gpu_dram_active_ratio", {}, 0.01),
    "pcie_rx_per_second": ("gpuwatchd_gpu_pcie_bytes_per_second", {"direction": "rx"}, _MIB),
    "pcie_tx_per_second": ("gpuwatchd_gpu_pcie_bytes_per_second", {"direction": "tx"}, _MIB),
    "nvlink_rx_per_second": ("gpuwatchd_gpu_nvlink_bytes_per_second", {"direction": "rx"}, _MIB),
    "nvlink_tx_per_second": ("gpuwatchd_gpu_nvlink_bytes_per_second", {"direction": "tx"}, _MIB),
}


def samples_from_gpm(values: Mapping[str, object], put: Put, **labels: object) -> dict[str, float]:
    """Put one sample per GPM value NVML answered; returns the ratios by our name."""
    out = {}
    for name, (family, extra, scale) in _FAMILIES.items():
        value = values.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            put(family, float(value) * scale, **extra, **labels)
            out[name] = float(value) * scale
    return out


def read_gpm(get: Get, put: Put, supported: bool, last: dict[str, object]) -> None:
    """GPM support flag and, where supported, the metrics over the last interval."""
    put("gpuwatchd_gpu_gpm_supported", 1 if supported else 0)
    if not supported:
        return
    values = get("gpm_metrics")
    if isinstance(values, dict):
        got = samples_from_gpm(values, put)
        if "sm_active" in got:
            last["sm_active_ratio"] = got["sm_active"]


_GPU = ("gpu", "uuid", "pci_bus_id")


def _m(name: str, kind: MetricType, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, kind, help, _GPU + labels)


GPM_METRICS: tuple[MetricSpec, ...] = (
    _m(
        "gpuwatchd_gpu_gpm_supported",
        "gauge",
        "1 when GPM profiling metrics are read for the GPU (Hopper and later), 0 when it has"
        " none or sources.nvml.gpm is off.",
    ),
    _m(
        "gpuwatchd_gpu_sm_active_ratio",
        "gauge",
        "Fraction of time SMs had a warp resident, averaged over SMs (last poll interval).",
    ),
    _m(
        "gpuwatchd_gpu_sm_occupancy_ratio",
        "gauge",
        "Resident warps as a fraction of the maximum, averaged over SMs (last poll interval).",
    ),
    _m(
        "gpuwatchd_gpu_pipe_active_ratio",
        "gauge",
        "Fraction of time a pipe was busy (tensor, fp64, fp32, fp16; last poll interval).",
        "pipe",
    ),
    _m(
        "gpuwatchd_gpu_dram_active_ratio",
        "gauge",
        "Fraction of peak device memory bandwidth used (last poll interval).",
    ),
    _m(
        "gpuwatchd_gpu_pcie_bytes_per_second",
        "gauge",
        "PCIe throughput (rx to the GPU, tx from it; last poll interval).",
        "direction",
    ),
    _m(
        "gpuwatchd_gpu_nvlink_bytes_per_second",
        "gauge",
        "NVLink throughput, all links summed (rx, tx; last poll interval).",
        "direction",
    ),
)
