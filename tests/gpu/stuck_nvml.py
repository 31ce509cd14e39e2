"""NVML readers for stuck_gpu.py: gpuwatchd's own NvmlSource, or a small ctypes binding.

Each gives one GpuReading of the watched GPU per call, as the stuck detector takes it.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

from gpuwatchd.health.stuck import GpuReading, proc_describer, readings_from_samples
from gpuwatchd.model import Sample, SourceSnapshot
from gpuwatchd.state import NodeSnapshot


class GpuwatchdReader:
    """gpuwatchd's NvmlSource over the real driver: the daemon's own code path."""

    name = "gpuwatchd.NvmlSource"

    def __init__(self, bus: str) -> None:
        from gpuwatchd.sources.nvml.client import Pynvml
        from gpuwatchd.sources.nvml.source import NvmlSource

        self.source = NvmlSource(Pynvml(), interval=1.0, call_timeout=5.0)
        self.source.poll(time.time())
        gpus = self.source.status().get("gpus") or {}
        if bus not in gpus:
            bus = next(iter(gpus), "")  # CUDA device 0 could not be matched: take GPU 0
        self.bus = bus
        info = gpus.get(bus, {})
        self.gpu = str(info.get("gpu", "0"))
        self.info = {
            "name": info.get("name"),
            "uuid": info.get("uuid"),
            "pci_bus_id": bus,
            "driver": self.source.status().get("driver"),
        }

    def snapshot(self) -> NodeSnapshot:
        now = time.time()
        items = self.source.poll(now)
        samples = tuple(i for i in items if isinstance(i, Sample))
        snap = SourceSnapshot("nvml", samples, True, timestamp=now, payload=self.source.payload())
        return NodeSnapshot(sources={"nvml": snap})

    def reading(self, snap: NodeSnapshot) -> GpuReading | None:
        nvml = snap.sources["nvml"]
        for r in readings_from_samples(nvml.samples, nvml.inventory, proc_describer()):
            if r.gpu == self.gpu:
                return r
        return None

    def close(self) -> None:
        self.source.close()


class _Util(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Proc(ctypes.Structure):  # nvmlProcessInfo_t (v2 and v3 share this layout)
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class CtypesReader:
    """A minimal libnvidia-ml binding, for machines without pynvml."""

    name = "ctypes-libnvidia-ml"

    def __init__(self, bus: str) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._ok(self.lib.nvmlInit_v2(), "nvmlInit")
        self.handle = ctypes.c_void_p()
        rc = self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(self.handle))
        if rc != 0:
            self._ok(
                self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)),
                "nvmlDeviceGetHandleByIndex",
            )
        index = ctypes.c_uint()
        self._ok(self.lib.nvmlDeviceGetIndex(self.handle, ctypes.byref(index)), "GetIndex")
        self.gpu = str(index.value)
        buf = ctypes.create_string_buffer(96)
        self.lib.nvmlDeviceGetName(self.handle, buf, 96)
        name = buf.value.decode()
        self.lib.nvmlDeviceGetUUID(self.handle, buf, 96)
        self.info = {"name": name, "uuid": buf.value.decode(), "pci_bus_id": bus}
        self.describe = proc_describer()

    def _ok(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: NVML error {rc}")

    def snapshot(self) -> None:
        return None

    def reading(self, _snap: None) -> GpuReading:
        util, power, limit = _Util(), ctypes.c_uint(), ctypes.c_uint()
        ok_util = self.lib.nvmlDeviceGetUtilizationRates(self.handle, ctypes.byref(util)) == 0
        ok_power = self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(power)) == 0
        ok_limit = self.lib.nvmlDeviceGetEnforcedPowerLimit(self.handle, ctypes.byref(limit)) == 0
        count = ctypes.c_uint(64)
        procs = (_Proc * 64)()
        fn = getattr(self.lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)
        pids: list[int] = []
        if fn is not None and fn(self.handle, ctypes.byref(count), procs) == 0:
            pids = [procs[i].pid for i in range(count.value)]
        return GpuReading(
            self.gpu,
            util.gpu / 100 if ok_util else None,
            util.memory / 100 if ok_util else None,
            power.value / 1000 if ok_power else None,
            limit.value / 1000 if ok_limit else None,
            (("gpu", self.gpu), ("pci_bus_id", self.info["pci_bus_id"])),
            tuple(self.describe(p) for p in pids),
        )

    def close(self) -> None:
        self.lib.nvmlShutdown()


def make_reader(bus: str, force_ctypes: bool) -> Any:
    if not force_ctypes:
        try:
            import pynvml  # noqa: F401

            return GpuwatchdReader(bus)
        except ImportError:
            pass
    return CtypesReader(bus)
