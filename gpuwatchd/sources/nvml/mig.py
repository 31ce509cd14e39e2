"""MIG: the GPU's MIG mode and, with MIG on, its MIG devices.

Each MIG device (one compute instance of one GPU instance) is read through
the client's `mig_device(i)` call, i up to nvmlDeviceGetMaxMigDeviceCount;
an empty slot answers NOT_FOUND. Per-instance series carry the parent
GPU's labels plus `gpu_instance` and `compute_instance`; the MIG device
UUID and profile are on the info series only. GPM per GPU instance
(nvmlGpmMigSampleGet) gives SM and DRAM activity where the driver allows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from gpuwatchd.model import GpuProcess, MetricSpec, MetricType
from gpuwatchd.sources.nvml.gpm import samples_from_gpm

__all__ = ["MIG_METRICS", "MigDevice", "gpu_processes", "mig_uuids", "read_mig"]

Get = Callable[..., object | None]
Put = Callable[..., None]

# profile name: the text after "MIG " in the MIG device's name, e.g. "3g.40gb"
MigDevice = Mapping[str, object]


def _profile(name: object) -> str:
    text = str(name or "")
    return text.rsplit("MIG ", 1)[1].strip() if "MIG " in text else text


def read_mig(
    get: Get,
    put: Put,
    gpm_supported: bool,
    last: dict[str, object],
    mode_get: Get | None = None,
) -> list[dict[str, object]]:
    """MIG mode, MIG devices and their readings; returns their processes, tagged.

    The mode and the slot count are asked through `mode_get` (the reader's
    static cache) when given.
    """
    mode = (mode_get or get)("mig_mode")
    if not (isinstance(mode, list) and len(mode) == 2):
        return []
    put("gpuwatchd_gpu_mig_mode", mode[0], which="current")
    put("gpuwatchd_gpu_mig_mode", mode[1], which="pending")
    last["mig_mode"] = bool(mode[0])
    if mode[0] != 1:
        return []
    # asked while MIG is on (0 slots until it is), like the mode through `mode_get`
    slots = (mode_get or get)("max_mig_device_count")
    max_devices = slots if isinstance(slots, int) else 0
    processes: list[dict[str, object]] = []
    instances: set[int] = set()
    found = []
    for index in range(max_devices):
        dev = get("mig_device", index)
        if not isinstance(dev, dict):
            continue
        gi, ci = dev.get("gpu_instance"), dev.get("compute_instance")
        if not isinstance(gi, int) or not isinstance(ci, int):
            continue
        instances.add(gi)
        ids = {"gpu_instance": str(gi), "compute_instance": str(ci)}
        uuid = str(dev.get("uuid", ""))
        found.append({"gpu_instance": gi, "compute_instance": ci, "uuid": uuid})
        put(
            "gpuwatchd_mig_device_info",
            1,
            **ids,
            mig_uuid=uuid,
            profile=_profile(dev.get("name")),
        )
        mem = dev.get("memory")
        if isinstance(mem, dict):
            for key, family in (
                ("used", "gpuwatchd_mig_memory_used_bytes"),
                ("free", "gpuwatchd_mig_memory_free_bytes"),
                ("total", "gpuwatchd_mig_memory_capacity_bytes"),
            ):
                value = mem.get(key)
                if isinstance(value, int):
                    put(family, value, **ids)
        attrs = dev.get("attributes")
        if isinstance(attrs, dict) and isinstance(attrs.get("multiprocessors"), int):
            put("gpuwatchd_mig_multiprocessors", attrs["multiprocessors"], **ids)
        procs = dev.get("processes")
        if isinstance(procs, list):
            put("gpuwatchd_mig_compute_processes", len(procs), **ids)
            for p in procs:
                if isinstance(p, dict):
                    processes.append(
                        {**p, "gpu_instance": gi, "compute_instance": ci, "mig_uuid": uuid}
                    )
    put("gpuwatchd_gpu_mig_devices", len(found))
    last["mig_devices"] = found
    if gpm_supported:
        for gi in sorted(instances):
            values = get("gpm_mig_metrics", gi)
            if isinstance(values, dict):
                samples_from_gpm(values, _mig_put(put), gpu_instance=str(gi))
    return processes


def _mig_put(put: Put) -> Put:
    """Route GPM families to their per-GPU-instance twins (gpuwatchd_mig_*)."""

    def mig(name: str, value: float | None, **labels: object) -> None:
        put(name.replace("gpuwatchd_gpu_", "gpuwatchd_mig_", 1), value, **labels)

    return mig


_GPU = ("gpu", "uuid", "pci_bus_id")


def _m(name: str, kind: MetricType, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, kind, help, _GPU + labels)


_MIG = (*_GPU, "gpu_instance", "compute_instance")


def _mig(name: str, kind: MetricType, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, kind, help, _MIG + labels)


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


def gpu_processes(procs: Iterable[Mapping[str, object]]) -> tuple[GpuProcess, ...]:
    """A reading's processes (MIG ones tagged by `read_mig`), typed and ordered by pid."""
    out = []
    for p in procs:
        pid, used, mig = p.get("pid"), p.get("used_memory"), str(p.get("mig_uuid") or "")
        if not isinstance(pid, int) or pid <= 0:
            continue
        gi, ci = p.get("gpu_instance"), p.get("compute_instance")
        out.append(
            GpuProcess(
                pid=pid,
                used_memory_bytes=used if isinstance(used, int) else None,
                mig_uuid=mig,
                gpu_instance=gi if mig and isinstance(gi, int) else None,
                compute_instance=ci if mig and isinstance(ci, int) else None,
            )
        )
    return tuple(sorted(out, key=lambda p: p.pid))


def mig_uuids(last: Mapping[str, object]) -> tuple[str, ...]:
    """UUIDs of the GPU's MIG devices as of its last reading (none without MIG)."""
    found = last.get("mig_devices")
    if not isinstance(found, list):
        return ()
    return tuple(str(d["uuid"]) for d in found if isinstance(d, Mapping) and d.get("uuid"))
