"""NVML queries that take a versioned struct, keep state, or open other handles.

Each function here gets the pynvml module and the device handle from the
real client (gpuwatchd/sources/nvml/client.py, the one module that imports
pynvml) and returns plain data, like every other device call, so the
recorder and the replay treat them as ordinary calls:

- `memory_info_v2`: used, free, total and the driver's reserved memory, as
  `nvidia-smi -q` reports them (v1 counts reserved memory as used);
- `gpu_fabric_info`: NVSwitch fabric registration (nvmlDeviceGetGpuFabricInfoV;
  its struct argument carries a version, v3 first, then v2, then the v1 call);
- `gpm_support` and `gpm_metrics`: GPM. One sample is taken per call and
  kept; the metrics are computed between it and the previous call's sample,
  which is then freed, so the values cover the poll interval and at most
  one sample per GPU (and per GPU instance) is ever held. GPM calls of all
  GPUs take turns (`GPM_TURN`): the per-GPU workers otherwise run them at
  once, which no NVIDIA tool does (DCGM and nvidia-smi call NVML from one
  thread), and the one daemon death seen on a 2-GPU node was a SIGSEGV inside
  libnvidia-ml at the first GPM metrics read (docs/gpu-testing.md);
- `mig_device(i)`: the i-th MIG device of a GPU in MIG mode with its ids,
  profile name, memory and processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["GPM_METRIC_IDS", "GPM_TURN", "GPM_TURN_WAIT", "GpmSamples", "STRUCTURED_CALLS"]

# Our name -> NVML_GPM_METRIC_* id (nvml.h). Ratios are NVML percentages;
# the *_per_second ones are MiB/s.
GPM_METRIC_IDS: Mapping[str, int] = {
    "graphics_active": 1,
    "sm_active": 2,
    "sm_occupancy": 3,
    "tensor_active": 5,
    "dram_active": 10,
    "fp64_active": 11,
    "fp32_active": 12,
    "fp16_active": 13,
    "pcie_tx_per_second": 20,
    "pcie_rx_per_second": 21,
    "nvlink_rx_per_second": 60,
    "nvlink_tx_per_second": 61,
}


# One GPM call sequence at a time in the process; a GPU whose turn does not come
# within GPM_TURN_WAIT seconds skips GPM for that poll (its other reads go on).
GPM_TURN = threading.Lock()
GPM_TURN_WAIT = 2.0


class GpmSamples:
    """The last GPM sample per (device handle, GPU instance), freed when replaced."""

    def __init__(self) -> None:
        self._held: dict[int | None, Any] = {}
        self._lock = threading.Lock()

    def swap(self, key: int | None, sample: Any) -> Any:
        """Keep `sample` for `key`; return the one it replaces (or None)."""
        with self._lock:
            old = self._held.pop(key, None)
            self._held[key] = sample
            return old

    def free_all(self, nv: Any) -> None:
        """Free every held sample (on close)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for sample in held:
            try:
                nv.nvmlGpmSampleFree(sample)
            except Exception:  # best effort: the library may already be shut down
                pass


def memory_info_v2(nv: Any, handle: Any, state: GpmSamples) -> object:
    """nvmlDeviceGetMemoryInfo_v2: total, reserved, free, used (bytes)."""
    mem = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
    return {n: int(getattr(mem, n)) for n in ("total", "reserved", "free", "used")}


def _uuid_text(raw: Any) -> str:
    data = bytes(raw)
    if not any(data):
        return ""
    h = data.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def gpu_fabric_info(nv: Any, handle: Any, state: GpmSamples) -> object:
    """Fabric state, registration status, clique id, cluster UUID, health mask."""
    out: dict[str, object] = {}
    info: Any = None
    for struct_name in ("c_nvmlGpuFabricInfo_v3_t", "c_nvmlGpuFabricInfo_v2_t"):
        struct = getattr(nv, struct_name, None)
        if struct is None or not hasattr(nv, "nvmlDeviceGetGpuFabricInfoV"):
            continue
        candidate = struct()
        try:
            nv.nvmlDeviceGetGpuFabricInfoV(handle, nv.byref(candidate))
        except nv.NVMLError as exc:
            if int(getattr(exc, "value", -1)) == 25:  # ARGUMENT_VERSION_MISMATCH: older driver
                continue
            raise
        info = candidate
        out["version"] = struct_name
        break
    if info is None:
        info = nv.c_nvmlGpuFabricInfo_t()
        nv.nvmlDeviceGetGpuFabricInfo(handle, nv.byref(info))
        out["version"] = "c_nvmlGpuFabricInfo_t"
    out.update(
        state=int(info.state),
        status=int(info.status),
        clique_id=int(info.cliqueId),
        cluster_uuid=_uuid_text(info.clusterUuid),
    )
    if hasattr(info, "healthMask"):
        out["health_mask"] = int(info.healthMask)
    return out


def gpm_support(nv: Any, handle: Any, state: GpmSamples) -> object:
    """1 when the GPU supports GPM, else 0."""
    return int(nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)


def _gpm(nv: Any, handle: Any, state: GpmSamples, gpu_instance: int | None) -> object:
    if not GPM_TURN.acquire(timeout=GPM_TURN_WAIT):
        return {}  # as after a first sample: the next turn covers both intervals
    try:
        return _gpm_in_turn(nv, handle, state, gpu_instance)
    finally:
        GPM_TURN.release()


def _gpm_in_turn(nv: Any, handle: Any, state: GpmSamples, gpu_instance: int | None) -> object:
    sample = nv.nvmlGpmSampleAlloc()
    try:
        if gpu_instance is None:
            nv.nvmlGpmSampleGet(handle, sample)
        else:
            nv.nvmlGpmMigSampleGet(handle, gpu_instance, sample)
    except Exception:
        nv.nvmlGpmSampleFree(sample)
        raise
    previous = state.swap(gpu_instance, sample)
    if previous is None:
        return {}  # the first sample: values come with the next one
    try:
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRIC_IDS)
        request.sample1 = previous
        request.sample2 = sample
        for i, metric_id in enumerate(GPM_METRIC_IDS.values()):
            request.metrics[i].metricId = metric_id
        nv.nvmlGpmMetricsGet(request)
    finally:
        nv.nvmlGpmSampleFree(previous)
    out: dict[str, object] = {}
    failed: dict[str, int] = {}
    for i, name in enumerate(GPM_METRIC_IDS):
        metric = request.metrics[i]
        if int(metric.nvmlReturn) == 0:
            out[name] = float(metric.value)
        else:
            failed[name] = int(metric.nvmlReturn)
    if failed:
        out["failed"] = failed
    return out


def gpm_metrics(nv: Any, handle: Any, state: GpmSamples) -> object:
    """GPM metrics since the previous call ({} on the first call)."""
    return _gpm(nv, handle, state, None)


def gpm_mig_metrics(nv: Any, handle: Any, state: GpmSamples, gpu_instance: int) -> object:
    """GPM metrics of one GPU instance since the previous call ({} on the first)."""
    return _gpm(nv, handle, state, int(gpu_instance))


def _optional(nv: Any, errors: dict[str, int], what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except nv.NVMLError as exc:
        errors[what] = int(getattr(exc, "value", -1))
        return None


def mig_device(nv: Any, handle: Any, state: GpmSamples, index: int) -> object:
    """The index-th MIG device: ids, uuid, profile name, memory, processes.

    Raises NOT_FOUND (from NVML) for an empty slot. Parts NVML cannot
    answer for a MIG device are left out and listed under `failed`.
    """
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, int(index))
    failed: dict[str, int] = {}
    out: dict[str, object] = {
        "gpu_instance": int(nv.nvmlDeviceGetGpuInstanceId(mig)),
        "compute_instance": int(nv.nvmlDeviceGetComputeInstanceId(mig)),
        "uuid": _text(nv.nvmlDeviceGetUUID(mig)),
    }
    name = _optional(nv, failed, "name", nv.nvmlDeviceGetName, mig)
    if name is not None:
        out["name"] = _text(name)
    mem = _optional(nv, failed, "memory", nv.nvmlDeviceGetMemoryInfo, mig)
    if mem is not None:
        out["memory"] = {n: int(getattr(mem, n)) for n in ("total", "free", "used")}
    attrs = _optional(nv, failed, "attributes", nv.nvmlDeviceGetAttributes, mig)
    if attrs is not None:
        out["attributes"] = {
            "multiprocessors": int(attrs.multiprocessorCount),
            "gpu_instance_slices": int(attrs.gpuInstanceSliceCount),
            "compute_instance_slices": int(attrs.computeInstanceSliceCount),
            "memory_mib": int(attrs.memorySizeMB),
        }
    procs = _optional(nv, failed, "processes", nv.nvmlDeviceGetComputeRunningProcesses, mig)
    if procs is not None:
        out["processes"] = [
            {
                "pid": int(p.pid),
                "used_memory": None if p.usedGpuMemory is None else int(p.usedGpuMemory),
            }
            for p in procs
        ]
    if failed:
        out["failed"] = failed
    return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


STRUCTURED_CALLS: Mapping[str, Callable[..., object]] = {
    "memory_info_v2": memory_info_v2,
    "gpu_fabric_info": gpu_fabric_info,
    "gpm_support": gpm_support,
    "gpm_metrics": gpm_metrics,
    "gpm_mig_metrics": gpm_mig_metrics,
    "mig_device": mig_device,
}
