"""What the NVML source needs from NVML, and the real implementation on pynvml.

The boundary is deliberately generic: a device answers `call(name, *args)`
for the names in DEVICE_CALLS and returns plain JSON-able data (ints,
strings, lists, dicts), never ctypes structs. That keeps the recorder and
the replay (gpuwatchd/sources/nvml/replay.py) one small table-free loop each,
and a capture stays readable: `"temperature(0)": [{"value": 34}]`.

This is the only module that imports pynvml, and only inside functions,
so the package imports on machines without it. Every pynvml error is
translated into `NvmlError(code, value)` keeping NVML's symbolic name
(NOT_SUPPORTED, GPU_IS_LOST, ...) and numeric code.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

from gpuwatchd.errors import NvmlError
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.sources.nvml.structured import STRUCTURED_CALLS, GpmSamples

__all__ = [
    "DEVICE_CALLS",
    "FieldKey",
    "FieldResult",
    "NVML_ERROR_CODES",
    "NvmlClient",
    "NvmlDevice",
    "Pynvml",
    "SYSTEM_CALLS",
    "UNSUPPORTED_CODES",
    "XidEvent",
    "XidEventSet",
    "call_key",
    "code_name",
    "normalize_bus_id",
    "nvml_error",
    "nvml_errors",
]

# nvmlReturn_t values (nvml.h; part of the ABI, so stable across releases).
NVML_ERROR_CODES: dict[str, int] = {
    "UNINITIALIZED": 1,
    "INVALID_ARGUMENT": 2,
    "NOT_SUPPORTED": 3,
    "NO_PERMISSION": 4,
    "ALREADY_INITIALIZED": 5,
    "NOT_FOUND": 6,
    "INSUFFICIENT_SIZE": 7,
    "INSUFFICIENT_POWER": 8,
    "DRIVER_NOT_LOADED": 9,
    "TIMEOUT": 10,
    "IRQ_ISSUE": 11,
    "LIBRARY_NOT_FOUND": 12,
    "FUNCTION_NOT_FOUND": 13,
    "CORRUPTED_INFOROM": 14,
    "GPU_IS_LOST": 15,
    "RESET_REQUIRED": 16,
    "OPERATING_SYSTEM": 17,
    "LIB_RM_VERSION_MISMATCH": 18,
    "IN_USE": 19,
    "MEMORY": 20,
    "NO_DATA": 21,
    "ARGUMENT_VERSION_MISMATCH": 25,
    "DEPRECATED": 26,
    "NOT_READY": 27,
    "GPU_NOT_FOUND": 28,
    "INVALID_STATE": 29,
    "UNKNOWN": 999,
}
_NAMES = {v: k for k, v in NVML_ERROR_CODES.items()}

# Answers that mean "this reading does not exist here": asked once, then never
# again. NOT_RECORDED is the replay's answer for a call the capture lacks.
UNSUPPORTED_CODES = frozenset(
    {
        "NOT_SUPPORTED",
        "FUNCTION_NOT_FOUND",
        "INVALID_ARGUMENT",
        "NO_PERMISSION",
        "ARGUMENT_VERSION_MISMATCH",
        "DEPRECATED",
        "NOT_RECORDED",
    }
)

FieldKey = tuple[str, int]  # (NVML_FI_* name, scope id)
FieldResult = int | float | NvmlError


class XidEvent(NamedTuple):
    """An Xid reported through NVML's event API."""

    uuid: str
    pci_bus_id: str
    code: int
    time: float


class XidEventSet(Protocol):
    """Registered Xid events of some devices; `wait` blocks at most `timeout` seconds."""

    def wait(self, timeout: float) -> XidEvent | None: ...

    def close(self) -> None: ...


class NvmlDevice(Protocol):
    """One GPU handle.

    `call(name, *args)` runs the NVML query DEVICE_CALLS names and returns
    plain data; `field_values` batches nvmlDeviceGetFieldValues and answers
    each (field name, scope) with a number or the NvmlError NVML gave for it.
    Both raise NvmlError when NVML fails the whole call.
    """

    index: int

    def call(self, name: str, *args: int) -> object: ...

    def field_values(self, fields: Sequence[FieldKey]) -> Mapping[FieldKey, FieldResult]: ...


class NvmlClient(Protocol):
    """The library: init/shutdown, SYSTEM_CALLS, device handles and Xid events."""

    def init(self) -> None: ...

    def shutdown(self) -> None: ...

    def call(self, name: str) -> object: ...

    def device(self, index: int) -> NvmlDevice: ...

    def xid_events(self, devices: Sequence[NvmlDevice]) -> XidEventSet: ...


def call_key(name: str, args: Sequence[int] = ()) -> str:
    """The name a call is recorded under: `temperature(0)`, `uuid`."""
    return f"{name}({','.join(str(a) for a in args)})" if args else name


def code_name(value: int) -> str:
    """NVML's symbolic name for a numeric return code."""
    return _NAMES.get(value, f"ERROR_{value}")


def nvml_error(code: str, message: str = "") -> NvmlError:
    """An NvmlError for a symbolic code, with NVML's numeric value when it has one."""
    return NvmlError(code, NVML_ERROR_CODES.get(code, -1), message or code)


@contextmanager
def nvml_errors() -> Iterator[None]:
    """Translate pynvml exceptions into NvmlError, keeping NVML's code."""
    try:
        yield
    except NvmlError:
        raise
    except Exception as exc:
        nv = sys.modules.get("pynvml")
        if nv is not None and isinstance(exc, nv.NVMLError):
            value = int(getattr(exc, "value", -1))
            raise NvmlError(code_name(value), value, _describe(exc)) from None
        if nv is not None and isinstance(exc, getattr(nv, "NVMLLibraryMismatchError", ())):
            raise nvml_error("FUNCTION_NOT_FOUND", str(exc)) from None
        raise


def _describe(exc: Exception) -> str:
    try:
        return str(exc)
    except Exception:  # str() of an NVMLError may itself call into NVML
        return type(exc).__name__


# --- converters: ctypes results -> plain data ---------------------------------


def _str(v: Any) -> object:
    return v.decode() if isinstance(v, bytes) else str(v)


def _ints(v: Any) -> object:
    return [int(x) for x in v]


def _attrs(*names: str) -> Callable[[Any], object]:
    def convert(v: Any) -> object:
        return {n: int(getattr(v, n)) for n in names}

    return convert


def _pci(v: Any) -> object:
    out: dict[str, object] = {"busId": _str(v.busId)}
    for n in ("domain", "bus", "device", "pciDeviceId", "pciSubSystemId"):
        out[n] = int(getattr(v, n))
    return out


_NO_INSTANCE = 0xFFFFFFFF  # a process outside MIG has no GPU/compute instance


def _procs(v: Any) -> object:
    out = []
    for p in v:
        proc: dict[str, object] = {
            "pid": int(p.pid),
            "used_memory": None if p.usedGpuMemory is None else int(p.usedGpuMemory),
        }
        for attr, key in (
            ("gpuInstanceId", "gpu_instance"),
            ("computeInstanceId", "compute_instance"),
        ):
            value = getattr(p, attr, None)
            if isinstance(value, int) and value != _NO_INSTANCE:
                proc[key] = value
        out.append(proc)
    return out


Spec = tuple[tuple[str, ...], Callable[[Any], object]]

# name -> (pynvml functions to try in order, converter). A later candidate
# is tried when pynvml lacks the earlier one or the driver has no symbol.
SYSTEM_CALLS: dict[str, Spec] = {
    "driver_version": (("nvmlSystemGetDriverVersion",), _str),
    "nvml_version": (("nvmlSystemGetNVMLVersion",), _str),
    "cuda_driver_version": (
        ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"),
        int,
    ),
    "device_count": (("nvmlDeviceGetCount",), int),
}

DEVICE_CALLS: dict[str, Spec] = {
    "name": (("nvmlDeviceGetName",), _str),
    "uuid": (("nvmlDeviceGetUUID",), _str),
    "serial": (("nvmlDeviceGetSerial",), _str),
    "pci_info": (("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo"), _pci),
    "vbios_version": (("nvmlDeviceGetVbiosVersion",), _str),
    "minor_number": (("nvmlDeviceGetMinorNumber",), int),
    "temperature": (("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), int),
    "temperature_threshold": (("nvmlDeviceGetTemperatureThreshold",), int),
    "power_usage": (("nvmlDeviceGetPowerUsage",), int),
    "enforced_power_limit": (("nvmlDeviceGetEnforcedPowerLimit",), int),
    "total_energy_consumption": (("nvmlDeviceGetTotalEnergyConsumption",), int),
    "utilization_rates": (("nvmlDeviceGetUtilizationRates",), _attrs("gpu", "memory")),
    "memory_info": (("nvmlDeviceGetMemoryInfo",), _attrs("total", "free", "used")),
    "clocks_event_reasons": (
        ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
        int,
    ),
    "ecc_mode": (("nvmlDeviceGetEccMode",), _ints),
    "total_ecc_errors": (("nvmlDeviceGetTotalEccErrors",), int),
    "memory_error_counter": (("nvmlDeviceGetMemoryErrorCounter",), int),
    "retired_pages": (("nvmlDeviceGetRetiredPages",), _ints),
    "retired_pages_pending_status": (("nvmlDeviceGetRetiredPagesPendingStatus",), int),
    "remapped_rows": (("nvmlDeviceGetRemappedRows",), _ints),
    "row_remapper_histogram": (
        ("nvmlDeviceGetRowRemapperHistogram",),
        _attrs("max", "high", "partial", "low", "none"),
    ),
    "pcie_replay_counter": (("nvmlDeviceGetPcieReplayCounter",), int),
    "curr_pcie_link_generation": (("nvmlDeviceGetCurrPcieLinkGeneration",), int),
    "curr_pcie_link_width": (("nvmlDeviceGetCurrPcieLinkWidth",), int),
    "max_pcie_link_generation": (("nvmlDeviceGetMaxPcieLinkGeneration",), int),
    "max_pcie_link_width": (("nvmlDeviceGetMaxPcieLinkWidth",), int),
    "compute_running_processes": (
        ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
        _procs,
    ),
    "nvlink_state": (("nvmlDeviceGetNvLinkState",), int),
    # topology (read once per GPU set): the PCI function at the far end of a link
    "nvlink_remote_pci_info": (
        ("nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemotePciInfo"),
        _pci,
    ),
    "nvlink_remote_device_type": (("nvmlDeviceGetNvLinkRemoteDeviceType",), int),  # 2: NVSwitch
    "nvlink_error_counter": (("nvmlDeviceGetNvLinkErrorCounter",), int),
    "supported_event_types": (("nvmlDeviceGetSupportedEventTypes",), int),
    # clocks in MHz by nvmlClockType_t; P-state 0-15 (32 = unknown); MIG mode [current, pending]
    "clock_info": (("nvmlDeviceGetClockInfo",), int),
    "max_clock_info": (("nvmlDeviceGetMaxClockInfo",), int),
    "applications_clock": (("nvmlDeviceGetApplicationsClock",), int),
    "performance_state": (("nvmlDeviceGetPerformanceState",), int),
    "mig_mode": (("nvmlDeviceGetMigMode",), _ints),
    "max_mig_device_count": (("nvmlDeviceGetMaxMigDeviceCount",), int),
}


def _common_ancestor(nv: Any, handle: Any, _gpm: object, peer: int) -> object:
    """nvmlGpuTopologyLevel_t between this GPU and the GPU of index `peer`."""
    other = nv.nvmlDeviceGetHandleByIndex(peer)
    return int(nv.nvmlDeviceGetTopologyCommonAncestor(handle, other))


def _cpu_affinity(nv: Any, handle: Any, _gpm: object) -> object:
    """The GPU's ideal CPUs as 64-bit masks, lowest CPUs first."""
    words = max(1, ((os.cpu_count() or 1) + 63) // 64)
    return [int(w) for w in nv.nvmlDeviceGetCpuAffinity(handle, words)]


def _p2p_nvlink(nv: Any, handle: Any, _gpm: object, peer: int) -> object:
    """nvmlGpuP2PStatus_t of NVLink P2P to the GPU of index `peer` (0: OK, it has NVLink)."""
    other = nv.nvmlDeviceGetHandleByIndex(peer)
    caps = getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    return int(nv.nvmlDeviceGetP2PStatus(handle, other, caps))


def _numa_affinity(nv: Any, handle: Any, _gpm: object) -> object:
    """The GPU's nearest NUMA nodes as 64-bit masks (nvidia-smi topo's NUMA Affinity)."""
    return [int(w) for w in nv.nvmlDeviceGetMemoryAffinity(handle, 1, 0)]  # 0: SCOPE_NODE


# device calls that need more than one handle or a size from the host
TOPOLOGY_CALLS: dict[str, Callable[..., object]] = {
    "topology_common_ancestor": _common_ancestor,
    "cpu_affinity": _cpu_affinity,
    "p2p_nvlink_status": _p2p_nvlink,
    "numa_affinity": _numa_affinity,
}

# nvmlValueType_t -> member of the c_nvmlValue_t union
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError


def _module() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise nvml_error("LIBRARY_NOT_FOUND", f"nvidia-ml-py is not installed: {exc}") from None
    return pynvml


def _invoke(spec: Spec, name: str, *args: Any) -> object:
    nv = _module()
    candidates, convert = spec
    with nvml_errors():
        for i, fname in enumerate(candidates):
            fn = getattr(nv, fname, None)
            if fn is None:
                continue
            try:
                return convert(fn(*args))
            except nv.NVMLError as exc:
                last = i == len(candidates) - 1
                if last or getattr(exc, "value", None) != NVML_ERROR_CODES["FUNCTION_NOT_FOUND"]:
                    raise
    raise nvml_error("FUNCTION_NOT_FOUND", f"pynvml has none of {', '.join(candidates)} ({name})")


class PynvmlDevice:
    """A device handle from pynvml."""

    def __init__(self, index: int, handle: Any) -> None:
        self.index = index
        self.handle = handle
        self.gpm = GpmSamples()

    def call(self, name: str, *args: int) -> object:
        structured = STRUCTURED_CALLS.get(name) or TOPOLOGY_CALLS.get(name)
        if structured is not None:
            nv = _module()
            with nvml_errors():
                try:
                    return structured(nv, self.handle, self.gpm, *args)
                except (AttributeError, TypeError, ValueError) as exc:
                    # this nvidia-ml-py lacks or changed a struct: unsupported here
                    raise nvml_error("FUNCTION_NOT_FOUND", f"{name}: {exc!r}") from None
        spec = DEVICE_CALLS.get(name)
        if spec is None:
            raise nvml_error("FUNCTION_NOT_FOUND", f"unknown device call {name!r}")
        return _invoke(spec, name, self.handle, *args)

    def field_values(self, fields: Sequence[FieldKey]) -> Mapping[FieldKey, FieldResult]:
        nv = _module()
        out: dict[FieldKey, FieldResult] = {}
        ask: list[FieldKey] = []
        for name, scope in fields:
            if isinstance(getattr(nv, name, None), int):
                ask.append((name, scope))
            else:  # this nvidia-ml-py predates the field
                out[(name, scope)] = nvml_error("FUNCTION_NOT_FOUND", f"pynvml lacks {name}")
        if not ask:
            return out
        with nvml_errors():
            values = nv.nvmlDeviceGetFieldValues(self.handle, [(getattr(nv, n), s) for n, s in ask])
        for key, fv in zip(ask, values, strict=True):
            ret = int(fv.nvmlReturn)
            if ret != 0:
                out[key] = NvmlError(code_name(ret), ret, code_name(ret))
            elif 0 <= fv.valueType < len(_VALUE_MEMBERS):
                out[key] = getattr(fv.value, _VALUE_MEMBERS[fv.valueType])
            else:
                out[key] = nvml_error("UNKNOWN", f"value type {fv.valueType}")
        return out

    def release(self) -> None:
        """Free what the handle holds (GPM samples); the handle itself needs no freeing."""
        self.gpm.free_all(_module())


class Pynvml:
    """The real NVML, through nvidia-ml-py."""

    def init(self) -> None:
        nv = _module()
        with nvml_errors():
            nv.nvmlInit()

    def shutdown(self) -> None:
        nv = _module()
        with nvml_errors():
            nv.nvmlShutdown()

    def call(self, name: str) -> object:
        spec = SYSTEM_CALLS.get(name)
        if spec is None:
            raise nvml_error("FUNCTION_NOT_FOUND", f"unknown system call {name!r}")
        return _invoke(spec, name)

    def device(self, index: int) -> PynvmlDevice:
        nv = _module()
        with nvml_errors():
            return PynvmlDevice(index, nv.nvmlDeviceGetHandleByIndex(index))

    def xid_events(self, devices: Sequence[NvmlDevice]) -> XidEventSet:
        return PynvmlXidEvents([d for d in devices if isinstance(d, PynvmlDevice)])


def _address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class PynvmlXidEvents:
    """nvmlEventSetCreate + nvmlDeviceRegisterEvents(XidCriticalError) + wait."""

    def __init__(self, devices: Sequence[PynvmlDevice]) -> None:
        nv = _module()
        self._who: dict[int, tuple[str, str]] = {}
        with nvml_errors():
            self._set = nv.nvmlEventSetCreate()
        for dev in devices:
            supported = dev.call("supported_event_types")
            if not isinstance(supported, int) or not supported & _XID_CRITICAL:
                continue
            with nvml_errors():
                nv.nvmlDeviceRegisterEvents(dev.handle, _XID_CRITICAL, self._set)
            pci = dev.call("pci_info")
            bus = normalize_bus_id(str(pci["busId"])) if isinstance(pci, dict) else ""
            self._who[_address(dev.handle)] = (str(dev.call("uuid")), bus)

    def wait(self, timeout: float) -> XidEvent | None:
        """The next Xid, or None when none came within `timeout` seconds."""
        nv = _module()
        try:
            with nvml_errors():
                data = nv.nvmlEventSetWait_v2(self._set, max(0, int(timeout * 1000)))
        except NvmlError as exc:
            if exc.code == "TIMEOUT":
                return None
            raise
        uuid, bus = self._who.get(_address(data.device), ("", ""))
        return XidEvent(uuid, bus, int(data.eventData), time.time())

    def close(self) -> None:
        nv = _module()
        with nvml_errors():
            nv.nvmlEventSetFree(self._set)
