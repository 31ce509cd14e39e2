"""Metric families for clocks, P-state, memory reserve, GPM, MIG and the GPU fabric."""

from __future__ import annotations

from gpuwatchd.model import MetricSpec, MetricType

__all__ = ["FABRIC_METRICS", "GPM_METRICS", "MIG_METRICS", "PERF_METRICS"]

_GPU = ("gpu", "uuid", "pci_bus_id")
_MIG = (*_GPU, "gpu_instance", "compute_instance")


def _m(name: str, kind: MetricType, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, kind, help, _GPU + labels)


def _mig(name: str, kind: MetricType, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, kind, help, _MIG + labels)


PERF_METRICS: tuple[MetricSpec, ...] = (
    _m(
        "gpuwatchd_gpu_memory_reserved_bytes",
        "gauge",
        "Framebuffer memory the driver reserves (not counted as used, as in nvidia-smi).",
    ),
    _m("gpuwatchd_gpu_clock_hz", "gauge", "Current clock (graphics, sm, memory, video).", "clock"),
    _m("gpuwatchd_gpu_clock_max_hz", "gauge", "Maximum clock by domain.", "clock"),
    _m(
        "gpuwatchd_gpu_clock_application_hz",
        "gauge",
        "Application (target) clock (graphics, memory).",
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

GPM_METRICS: tuple[MetricSpec, ...] = (
    _m(
        "gpuwatchd_gpu_gpm_supported",
        "gauge",
        "1 when the GPU has GPM profiling metrics (Hopper and later), else 0.",
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

MIG_METRICS: tuple[MetricSpec, ...] = (
    _m("gpuwatchd_gpu_mig_mode", "gauge", "MIG mode, current and pending (1 on).", "which"),
    _m("gpuwatchd_gpu_mig_devices", "gauge", "MIG devices (compute instances) on the GPU."),
    _mig(
        "gpuwatchd_mig_device_info",
        "info",
        "A MIG device: its UUID and profile (value 1).",
        "mig_uuid",
        "profile",
    ),
    _mig("gpuwatchd_mig_memory_used_bytes", "gauge", "Memory in use in the MIG device."),
    _mig("gpuwatchd_mig_memory_free_bytes", "gauge", "Memory free in the MIG device."),
    _mig("gpuwatchd_mig_memory_capacity_bytes", "gauge", "Memory size of the MIG device."),
    _mig("gpuwatchd_mig_multiprocessors", "gauge", "SMs of the MIG device."),
    _mig("gpuwatchd_mig_compute_processes", "gauge", "Compute processes on the MIG device."),
    MetricSpec(
        "gpuwatchd_mig_sm_active_ratio",
        "gauge",
        "SM activity of a GPU instance (GPM; last poll interval).",
        (*_GPU, "gpu_instance"),
    ),
    MetricSpec(
        "gpuwatchd_mig_sm_occupancy_ratio",
        "gauge",
        "SM occupancy of a GPU instance (GPM; last poll interval).",
        (*_GPU, "gpu_instance"),
    ),
    MetricSpec(
        "gpuwatchd_mig_pipe_active_ratio",
        "gauge",
        "Pipe activity of a GPU instance (GPM; last poll interval).",
        (*_GPU, "pipe", "gpu_instance"),
    ),
    MetricSpec(
        "gpuwatchd_mig_dram_active_ratio",
        "gauge",
        "DRAM bandwidth use of a GPU instance (GPM; last poll interval).",
        (*_GPU, "gpu_instance"),
    ),
    MetricSpec(
        "gpuwatchd_mig_pcie_bytes_per_second",
        "gauge",
        "PCIe throughput of a GPU instance (GPM; last poll interval).",
        (*_GPU, "direction", "gpu_instance"),
    ),
    MetricSpec(
        "gpuwatchd_mig_nvlink_bytes_per_second",
        "gauge",
        "NVLink throughput of a GPU instance (GPM; last poll interval).",
        (*_GPU, "direction", "gpu_instance"),
    ),
)

FABRIC_METRICS: tuple[MetricSpec, ...] = (
    _m(
        "gpuwatchd_gpu_fabric_state",
        "gauge",
        "NVLink fabric registration: 1 not started, 2 in progress, 3 completed "
        "(absent without a fabric).",
    ),
    _m(
        "gpuwatchd_gpu_fabric_info",
        "info",
        "Fabric registration by name, its NVML status, clique id and cluster UUID.",
        "state",
        "status",
        "clique_id",
        "cluster_uuid",
    ),
    _m(
        "gpuwatchd_gpu_fabric_health_issue",
        "gauge",
        "1 while the fabric reports this condition, 0 when it reports it absent.",
        "issue",
    ),
    MetricSpec(
        "gpuwatchd_fabricmanager_up",
        "gauge",
        "1 while the nvidia-fabricmanager unit is active (absent where it is not installed).",
    ),
    MetricSpec(
        "gpuwatchd_fabricmanager_state_info",
        "info",
        "The nvidia-fabricmanager unit's systemd state (value 1).",
        ("active_state", "sub_state", "result"),
    ),
)
