"""The metric families the NVML source emits (re-exported as nvml.METRICS).

Every per-GPU family carries `gpu`, `uuid` and `pci_bus_id` first, then its
own labels; all label values are bounded (enums, link numbers, reasons).
"""

from __future__ import annotations

from gpuwatchd.model import MetricSpec, MetricType
from gpuwatchd.sources.nvml.fabric import FABRIC_METRICS
from gpuwatchd.sources.nvml.gpm import GPM_METRICS
from gpuwatchd.sources.nvml.mig import MIG_METRICS
from gpuwatchd.sources.nvml.perf import PERF_METRICS
from gpuwatchd.sources.nvml.rollup import ROLLUP_METRICS

__all__ = ["METRICS"]

_GPU = ("gpu", "uuid", "pci_bus_id")


def _m(name: str, kind: MetricType, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, kind, help, _GPU + labels)


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("gpuwatchd_gpus_visible", "gauge", "GPUs NVML reports on this node."),
    _m(
        "gpuwatchd_gpu_info",
        "info",
        "GPU identity (value 1).",
        "name",
        "serial",
        "vbios_version",
        "driver_version",
        "nvml_version",
        "cuda_version",
    ),
    _m(
        "gpuwatchd_gpu_nvml_state",
        "gauge",
        "NVML state of the GPU: 0 ok, 1 unresponsive (a call overran its deadline), 2 lost.",
    ),
    _m("gpuwatchd_gpu_nvml_state_info", "info", "NVML state of the GPU by name.", "state"),
    _m(
        "gpuwatchd_nvml_errors_total",
        "counter",
        "Failed NVML readings by NVML error (unsupported ones are counted once, then skipped).",
        "reason",
    ),
    _m("gpuwatchd_gpu_poll_duration_seconds", "gauge", "Time one poll of this GPU took."),
    _m(
        "gpuwatchd_gpu_temperature_celsius",
        "gauge",
        "Temperature by sensor (gpu, memory).",
        "sensor",
    ),
    _m(
        "gpuwatchd_gpu_temperature_threshold_celsius",
        "gauge",
        "Temperature thresholds (slowdown, shutdown, gpu_max, memory_max).",
        "threshold",
    ),
    _m("gpuwatchd_gpu_power_watts", "gauge", "Power draw."),
    _m("gpuwatchd_gpu_power_limit_watts", "gauge", "Enforced power limit."),
    _m("gpuwatchd_gpu_energy_joules_total", "counter", "Energy used since the driver loaded."),
    _m(
        "gpuwatchd_gpu_utilization_ratio",
        "gauge",
        "Fraction of the last sample period the engine was busy (gpu, memory).",
        "engine",
    ),
    _m("gpuwatchd_gpu_memory_used_bytes", "gauge", "Framebuffer memory in use."),
    _m("gpuwatchd_gpu_memory_free_bytes", "gauge", "Framebuffer memory free."),
    _m("gpuwatchd_gpu_memory_capacity_bytes", "gauge", "Framebuffer memory size."),
    _m(
        "gpuwatchd_gpu_clock_event_active",
        "gauge",
        "1 while this clock event (throttle) reason holds clocks down.",
        "reason",
    ),
    _m(
        "gpuwatchd_gpu_ecc_enabled",
        "gauge",
        "ECC mode, current and pending (after reboot).",
        "which",
    ),
    _m(
        "gpuwatchd_gpu_ecc_errors_total",
        "counter",
        "ECC errors (corrected, uncorrected) since boot (volatile) or ever (aggregate).",
        "error",
        "scope",
    ),
    _m(
        "gpuwatchd_gpu_ecc_location_errors_total",
        "counter",
        "ECC errors by memory location, where the GPU reports them.",
        "error",
        "scope",
        "location",
    ),
    _m(
        "gpuwatchd_gpu_retired_pages_total",
        "counter",
        "Retired framebuffer pages by cause (pre-Ampere GPUs).",
        "cause",
    ),
    _m(
        "gpuwatchd_gpu_retired_pages_pending",
        "gauge",
        "1 when a page retirement waits for the next driver reload.",
    ),
    _m(
        "gpuwatchd_gpu_remapped_rows_total",
        "counter",
        "Rows remapped by cause (correctable, uncorrectable).",
        "cause",
    ),
    _m("gpuwatchd_gpu_row_remap_pending", "gauge", "1 when a row remap waits for a GPU reset."),
    _m("gpuwatchd_gpu_row_remap_failure", "gauge", "1 when a row remap failed (replace the GPU)."),
    _m(
        "gpuwatchd_gpu_row_remap_availability_banks",
        "gauge",
        "Memory banks by remaining remap capacity (max, high, partial, low, none).",
        "availability",
    ),
    _m("gpuwatchd_gpu_pcie_link_generation", "gauge", "PCIe generation (current, max).", "which"),
    _m("gpuwatchd_gpu_pcie_link_width", "gauge", "PCIe lanes (current, max).", "which"),
    _m("gpuwatchd_gpu_pcie_replays_total", "counter", "PCIe replays."),
    _m(
        "gpuwatchd_gpu_pcie_errors_total",
        "counter",
        "PCIe errors by kind (NVML field values).",
        "error",
    ),
    _m(
        "gpuwatchd_gpu_recovery_action",
        "gauge",
        "Driver's recovery verdict: 0 none, 1 gpu_reset, 2 node_reboot, 3 drain_p2p, "
        "4 drain_and_reset, 5 recover_imex_domain, 6 bus_reset, 7 system_reboot.",
    ),
    _m(
        "gpuwatchd_gpu_recovery_action_info", "info", "Driver's recovery verdict by name.", "action"
    ),
    _m("gpuwatchd_gpu_reset_required", "gauge", "1 when the driver says the GPU needs a reset."),
    _m(
        "gpuwatchd_gpu_drain_and_reset_recommended",
        "gauge",
        "1 when the driver recommends draining work and resetting the GPU.",
    ),
    _m("gpuwatchd_nvlink_up", "gauge", "1 when the NVLink link is active.", "link"),
    _m("gpuwatchd_nvlink_speed_bytes_per_second", "gauge", "NVLink link speed.", "link"),
    _m(
        "gpuwatchd_nvlink_errors_total",
        "counter",
        "NVLink data-link errors as nvidia-smi nvlink -e counts them (replay, recovery, crc).",
        "link",
        "error",
    ),
    _m(
        "gpuwatchd_nvlink_corrected_errors_total",
        "counter",
        "NVLink receive errors the link corrected (crc_flit, crc_data, ecc_data); they rise"
        " with traffic on healthy NVLink 4 links and are not faults.",
        "link",
        "error",
    ),
    _m("gpuwatchd_gpu_compute_processes", "gauge", "Compute processes on the GPU."),
)
# clocks, P-state, reserved memory, GPM, MIG and fabric: declared beside their readers
METRICS += PERF_METRICS + GPM_METRICS + MIG_METRICS + FABRIC_METRICS
# NVLink errors per GPU, exported in place of per-link counters by default (rollup.py)
METRICS += ROLLUP_METRICS
