"""Reading one GPU through NVML: identity once, then every reading each poll.

A `DeviceReader` belongs to one GPU and is only ever used on that GPU's
worker thread (see gpuwatchd/deadline.py), so its memo of unsupported
calls needs no lock. It returns an immutable `Reading`; the source
decides what the GPU's state is and discards readings that came too late.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpuwatchd.errors import NvmlError
from gpuwatchd.model import Sample
from gpuwatchd.sources.nvml.client import (
    UNSUPPORTED_CODES,
    FieldKey,
    NvmlDevice,
    call_key,
    normalize_bus_id,
)
from gpuwatchd.sources.nvml.fabric import read_fabric
from gpuwatchd.sources.nvml.gpm import read_gpm
from gpuwatchd.sources.nvml.memory import read_memory
from gpuwatchd.sources.nvml.mig import read_mig
from gpuwatchd.sources.nvml.perf import clock_event_fields, read_max_clocks, read_perf
from gpuwatchd.sources.nvml.static import StaticReads

__all__ = [
    "CLOCK_EVENT_REASONS",
    "DeviceReader",
    "Identity",
    "RECOVERY_ACTIONS",
    "Reading",
]

log = logging.getLogger("gpuwatchd.nvml")

# nvmlTemperatureThresholds_t
THRESHOLDS = {"shutdown": 0, "slowdown": 1, "memory_max": 2, "gpu_max": 3}
# nvmlClocksEventReason* bits
CLOCK_EVENT_REASONS = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# nvmlDeviceGpuRecoveryAction_t
RECOVERY_ACTIONS = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}
# The per-link counters `nvidia-smi nvlink -e` prints (Replay, Recovery, CRC) and
# DCGM's NVLink health watch fails on for pre-Blackwell GPUs: field values, scope = link.
NVLINK_ERROR_FIELDS = {
    "NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY": "replay",
    "NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY": "recovery",
    "NVML_FI_DEV_NVLINK_ERROR_DL_CRC": "crc",
}
# nvmlNvLinkErrorCounter_t for replay and recovery where those fields are missing
# (drivers before r525): the same data-link counters.
NVLINK_ERROR_FALLBACK = {"replay": 0, "recovery": 1}
# Data-link receive events that the link corrected (nvmlDeviceGetNvLinkErrorCounter).
# On Hopper they rise with traffic on healthy links; neither nvidia-smi nor DCGM
# counts them as errors there (docs/nvml-sources.md, "NVLink counters").
NVLINK_CORRECTED = {"crc_flit": 2, "crc_data": 3, "ecc_data": 4}
# Used when NVML_FI_DEV_NVLINK_LINK_COUNT is unavailable; links beyond the
# real count answer NOT_SUPPORTED/INVALID_ARGUMENT once and are then skipped.
MAX_NVLINKS = 18
PCIE_ERROR_FIELDS = {
    "NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS": "correctable",
    "NVML_FI_DEV_PCIE_COUNT_NAKS_RECEIVED": "nak_received",
    "NVML_FI_DEV_PCIE_COUNT_RECEIVER_ERROR": "receiver",
    "NVML_FI_DEV_PCIE_COUNT_BAD_TLP": "bad_tlp",
    "NVML_FI_DEV_PCIE_COUNT_NAKS_SENT": "nak_sent",
    "NVML_FI_DEV_PCIE_COUNT_BAD_DLLP": "bad_dllp",
    "NVML_FI_DEV_PCIE_COUNT_NON_FATAL_ERROR": "non_fatal",
    "NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR": "fatal",
    "NVML_FI_DEV_PCIE_COUNT_UNSUPPORTED_REQ": "unsupported_request",
    "NVML_FI_DEV_PCIE_COUNT_LCRC_ERROR": "lcrc",
    "NVML_FI_DEV_PCIE_L0_TO_RECOVERY_COUNTER": "l0_to_recovery",
    "NVML_FI_DEV_PCIE_REPLAY_ROLLOVER_COUNTER": "replay_rollover",
}
FI_MEMORY_TEMP = "NVML_FI_DEV_MEMORY_TEMP"
FI_RECOVERY_ACTION = "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
FI_RESET_STATUS = "NVML_FI_DEV_RESET_STATUS"
FI_DRAIN_AND_RESET = "NVML_FI_DEV_DRAIN_AND_RESET_STATUS"
FI_NVLINK_SPEED = "NVML_FI_DEV_NVLINK_GET_SPEED"  # MB/s, scope = link
FI_NVLINK_COUNT = "NVML_FI_DEV_NVLINK_LINK_COUNT"
NVLINK_ERRORS_METRIC = "gpuwatchd_nvlink_errors_total"
NVLINK_CORRECTED_METRIC = "gpuwatchd_nvlink_corrected_errors_total"


@dataclass(frozen=True)
class Identity:
    """What does not change while the driver is loaded, read once per GPU."""

    index: int
    uuid: str = ""
    pci_bus_id: str = ""
    name: str = ""
    serial: str = ""
    vbios: str = ""
    minor: int | None = None
    thresholds: Mapping[str, float] = field(default_factory=dict)
    pcie_max: Mapping[str, float] = field(default_factory=dict)
    nvlinks: int = 0
    max_clocks: Mapping[str, float] = field(default_factory=dict)
    gpm: bool = False

    def labels(self) -> dict[str, str]:
        return {"gpu": str(self.index), "uuid": self.uuid, "pci_bus_id": self.pci_bus_id}


@dataclass(frozen=True)
class Reading:
    """One poll of one GPU, made on its worker thread."""

    identity: Identity | None
    samples: tuple[Sample, ...] = ()
    last: Mapping[str, object] = field(default_factory=dict)
    processes: tuple[Mapping[str, object], ...] = ()
    errors: Mapping[str, int] = field(default_factory=dict)
    unsupported: tuple[tuple[str, str], ...] = ()  # (call key, NVML code)
    lost: bool = False
    failure: str = ""  # the NVML code when the GPU could not be read at all
    seconds: float = 0.0
    static_read: bool = False  # the static calls were asked of NVML, not the cache


def _num(value: object) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    return None


class DeviceReader:
    """Reads one GPU and remembers which of its readings NVML does not support."""

    def __init__(self, index: int, processes: bool = True, gpm: bool = True) -> None:
        self.index = index
        self.processes = processes
        self.gpm = gpm
        self.unsupported: dict[str, str] = {}  # call key -> code it failed with
        self._errors: Counter[str] = Counter()
        self._logged: dict[str, str] = {}
        self._dev: NvmlDevice | None = None
        # NVLink counters from the last slow read: (metric, link, error label, value)
        self._nvlink_counts: list[tuple[str, int, str, float]] = []
        # PCIe replays and error counters (by error label) from the last slow read
        self._pcie_replays: float | None = None
        self._pcie_errors: dict[str, float | None] = {}
        self.static = StaticReads()

    @property
    def device(self) -> NvmlDevice | None:
        """The handle, once opened (by the first poll)."""
        return self._dev

    # --- one guarded NVML access ---------------------------------------------

    def get(self, name: str, *args: int) -> object | None:
        """The value of one call, or None when NVML had none (reason counted)."""
        assert self._dev is not None
        key = call_key(name, args)
        if key in self.unsupported:
            return None
        try:
            return self._dev.call(name, *args)
        except NvmlError as exc:
            self._failed(key, exc)
            return None

    def release(self) -> None:
        """Drop the handle, freeing what it holds (GPM samples)."""
        release = getattr(self._dev, "release", None)
        if callable(release):
            release()
        self._dev = None
        self.static.invalidate()

    def fields(self, keys: Iterable[FieldKey]) -> dict[FieldKey, float]:
        """Batch field values; unsupported ones are remembered and left out."""
        assert self._dev is not None
        ask = [k for k in keys if f"{k[0]}@{k[1]}" not in self.unsupported]
        if not ask or "field_values" in self.unsupported:
            return {}
        try:
            answers = self._dev.field_values(ask)
        except NvmlError as exc:
            self._failed("field_values", exc)
            return {}
        out: dict[FieldKey, float] = {}
        for key in ask:
            value = answers.get(key)
            if isinstance(value, NvmlError):
                self._failed(f"{key[0]}@{key[1]}", value)
            elif value is None:
                self._failed(f"{key[0]}@{key[1]}", NvmlError("NOT_RECORDED", -1))
            else:
                out[key] = float(value)
        return out

    def _failed(self, key: str, exc: NvmlError) -> None:
        if exc.code == "GPU_IS_LOST":
            raise exc
        self._errors[exc.code.lower()] += 1
        self.static.failed(key, exc.code in UNSUPPORTED_CODES)
        if exc.code in UNSUPPORTED_CODES:
            self.unsupported[key] = exc.code
            log.debug("gpu %d: %s unavailable (%s), not asking again", self.index, key, exc.code)
        elif self._logged.get(key) != exc.code:
            self._logged[key] = exc.code
            log.warning("gpu %d: %s failed: %s", self.index, key, exc)

    # --- whole-GPU operations --------------------------------------------------

    def poll(
        self,
        open_device: Callable[[int], NvmlDevice],
        identity: Identity | None,
        slow: bool = True,
        static: bool = True,
    ) -> Reading:
        """Discover (first time) and read the GPU; never raises NvmlError.

        `slow` also reads the NVLink and PCIe error counters; otherwise their
        last values are reported again. `static` asks the static calls of NVML
        (static.py); otherwise their cached answers are reported unless the
        cache was dropped since.
        """
        t0 = time.monotonic()
        fresh = self.static.begin(static)
        try:
            if self._dev is None:
                self._dev = open_device(self.index)
            if identity is None:
                identity = self.discover()
            samples, last, procs = self.read(identity, slow)
        except NvmlError as exc:
            self._errors[exc.code.lower()] += 1
            if exc.code != "GPU_IS_LOST":
                self.release()  # a fresh handle next time
            return Reading(
                identity,
                errors=self._take_errors(),
                unsupported=tuple(sorted(self.unsupported.items())),
                lost=exc.code == "GPU_IS_LOST",
                failure=exc.code,
                seconds=time.monotonic() - t0,
            )  # the cache is dropped: the next poll re-reads
        return Reading(
            identity,
            tuple(samples),
            last,
            procs,
            self._take_errors(),
            tuple(sorted(self.unsupported.items())),
            seconds=time.monotonic() - t0,
            static_read=fresh,
        )

    def _take_errors(self) -> dict[str, int]:
        out = dict(self._errors)
        self._errors.clear()
        return out

    def discover(self) -> Identity:
        """Read identity and static limits; uuid and bus id must succeed."""
        assert self._dev is not None
        uuid = self._dev.call("uuid")
        pci = self._dev.call("pci_info")
        bus = pci.get("busId") if isinstance(pci, dict) else None
        minor = self.get("minor_number")
        thresholds = {}
        for label, kind in THRESHOLDS.items():
            value = _num(self.get("temperature_threshold", kind))
            if value is not None:
                thresholds[label] = value
        pcie_max = {}
        for label, name in (
            ("generation", "max_pcie_link_generation"),
            ("width", "max_pcie_link_width"),
        ):
            value = _num(self.get(name))
            if value is not None:
                pcie_max[label] = value
        links = self.fields([(FI_NVLINK_COUNT, 0)]).get((FI_NVLINK_COUNT, 0))
        return Identity(
            index=self.index,
            uuid=str(uuid),
            pci_bus_id=normalize_bus_id(str(bus or "")),
            name=str(self.get("name") or ""),
            serial=str(self.get("serial") or ""),
            vbios=str(self.get("vbios_version") or ""),
            minor=int(minor) if isinstance(minor, int) else None,
            thresholds=thresholds,
            pcie_max=pcie_max,
            nvlinks=MAX_NVLINKS if links is None else int(links),
            max_clocks=read_max_clocks(self.get),
            gpm=self.gpm and self.get("gpm_support") == 1,
        )

    def read(
        self, ident: Identity, slow: bool = True
    ) -> tuple[list[Sample], dict[str, object], tuple[Mapping[str, object], ...]]:
        """Every per-poll reading of the GPU as samples, plus status details."""
        base = ident.labels()
        out: list[Sample] = []
        last: dict[str, object] = {}

        def put(name: str, value: float | None, **labels: object) -> None:
            if value is not None:
                out.append(Sample.of(name, value, **base, **labels))

        links = range(ident.nvlinks)
        fv = self.fields(
            [
                (FI_MEMORY_TEMP, 0),
                (FI_RECOVERY_ACTION, 0),
                (FI_RESET_STATUS, 0),
                (FI_DRAIN_AND_RESET, 0),
            ]
            + ([(name, 0) for name in PCIE_ERROR_FIELDS] if slow else [])
            + [(FI_NVLINK_SPEED, link) for link in links]
            + ([(name, link) for link in links for name in NVLINK_ERROR_FIELDS] if slow else [])
            + clock_event_fields()
        )

        temp = _num(self.get("temperature", 0))
        mem_temp = fv.get((FI_MEMORY_TEMP, 0))
        put("gpuwatchd_gpu_temperature_celsius", temp, sensor="gpu")
        put("gpuwatchd_gpu_temperature_celsius", mem_temp, sensor="memory")
        last.update(temperature_celsius=temp, memory_temperature_celsius=mem_temp)
        for label, limit in ident.thresholds.items():
            put("gpuwatchd_gpu_temperature_threshold_celsius", limit, threshold=label)

        power = _scaled(self.get("power_usage"), 1e-3)
        put("gpuwatchd_gpu_power_watts", power)
        put("gpuwatchd_gpu_power_limit_watts", _scaled(self.get("enforced_power_limit"), 1e-3))
        energy = _scaled(self.get("total_energy_consumption"), 1e-3)
        put("gpuwatchd_gpu_energy_joules_total", energy)
        last["power_watts"] = power

        util = self.get("utilization_rates")
        if isinstance(util, dict):
            for engine in ("gpu", "memory"):
                put(
                    "gpuwatchd_gpu_utilization_ratio",
                    _scaled(util.get(engine), 0.01),
                    engine=engine,
                )
            last["utilization_ratio"] = _scaled(util.get("gpu"), 0.01)
        # v2 answers as nvidia-smi does (reserved apart from used); v1 where it is missing
        mem = self.get("memory_info_v2")
        if not isinstance(mem, dict):
            mem = self.get("memory_info")
        if isinstance(mem, dict):
            put("gpuwatchd_gpu_memory_used_bytes", _num(mem.get("used")))
            put("gpuwatchd_gpu_memory_reserved_bytes", _num(mem.get("reserved")))
            put("gpuwatchd_gpu_memory_free_bytes", _num(mem.get("free")))
            put("gpuwatchd_gpu_memory_capacity_bytes", _num(mem.get("total")))
            last["memory_used_bytes"] = _num(mem.get("used"))

        reasons = self.get("clocks_event_reasons")
        if isinstance(reasons, int):
            for bit, label in CLOCK_EVENT_REASONS.items():
                put("gpuwatchd_gpu_clock_event_active", 1 if reasons & bit else 0, reason=label)
            last["clock_events"] = [r for b, r in CLOCK_EVENT_REASONS.items() if reasons & b]

        read_memory(self.get, self._static_get, put, last)
        self._read_pcie(put, ident, fv, slow)
        read_perf(self.get, put, ident.max_clocks, fv, last, self._static_get)
        read_gpm(self.get, put, ident.gpm, last)
        if read_fabric(self.get, put, last) is False:  # no fabric here: do not ask again
            self.unsupported["gpu_fabric_info"] = "NO_FABRIC"
        mig_procs = read_mig(self._mig_get, put, ident.gpm, last, self._static_mig_get)

        action = fv.get((FI_RECOVERY_ACTION, 0))
        if action is not None:
            put("gpuwatchd_gpu_recovery_action", action)
            name = RECOVERY_ACTIONS.get(int(action), "unknown")
            put("gpuwatchd_gpu_recovery_action_info", 1, action=name)
            last["recovery_action"] = name
        put("gpuwatchd_gpu_reset_required", fv.get((FI_RESET_STATUS, 0)))
        put("gpuwatchd_gpu_drain_and_reset_recommended", fv.get((FI_DRAIN_AND_RESET, 0)))

        down = []
        for link in links:
            state = _num(self.get("nvlink_state", link))
            if state is not None:
                put("gpuwatchd_nvlink_up", 1 if state == 1 else 0, link=link)
                if state != 1:
                    down.append(link)
            speed = fv.get((FI_NVLINK_SPEED, link))
            put("gpuwatchd_nvlink_speed_bytes_per_second", _scaled(speed, 1e6), link=link)
        if slow:
            self._nvlink_counts = self._read_nvlink_counters(links, fv)
        for name, link, label, count in self._nvlink_counts:
            put(name, count, link=link, error=label)
        last["nvlinks_down"] = down

        procs: tuple[Mapping[str, object], ...] = ()
        if self.processes:
            found = self.get("compute_running_processes")
            if isinstance(found, list):
                procs = tuple(p for p in found if isinstance(p, dict))
                put("gpuwatchd_gpu_compute_processes", len(procs))
            # in MIG mode the parent lists the same processes; the MIG device's entry names more
            in_mig = {p.get("pid") for p in mig_procs}
            procs = tuple(p for p in procs if p.get("pid") not in in_mig) + tuple(mig_procs)
        self.static.end(fv, last)
        return out, {k: v for k, v in last.items() if v is not None}, procs

    def _static_get(self, name: str, *args: int) -> object | None:
        return self.static.get(self.get, name, *args)

    def _static_mig_get(self, name: str, *args: int) -> object | None:
        return self.static.get(self._mig_get, name, *args)

    def _mig_get(self, name: str, *args: int) -> object | None:
        """Like get(), but NOT_FOUND (an empty MIG slot) is an answer, not an error."""
        key = call_key(name, args)
        if key in self.unsupported or self._dev is None:
            return None
        try:
            return self._dev.call(name, *args)
        except NvmlError as exc:
            if exc.code != "NOT_FOUND":
                self._failed(key, exc)
            return None

    def _read_nvlink_counters(
        self, links: range, fv: Mapping[FieldKey, float]
    ) -> list[tuple[str, int, str, float]]:
        out: list[tuple[str, int, str, float]] = []
        for link in links:
            for name, label in NVLINK_ERROR_FIELDS.items():
                count = fv.get((name, link))
                fallback = NVLINK_ERROR_FALLBACK.get(label)
                if count is None and fallback is not None:
                    count = _num(self.get("nvlink_error_counter", link, fallback))
                if count is not None:
                    out.append((NVLINK_ERRORS_METRIC, link, label, count))
            for label, counter in NVLINK_CORRECTED.items():
                count = _num(self.get("nvlink_error_counter", link, counter))
                if count is not None:
                    out.append((NVLINK_CORRECTED_METRIC, link, label, count))
        return out

    def _read_pcie(
        self, put: _Put, ident: Identity, fv: Mapping[FieldKey, float], slow: bool
    ) -> None:
        for label, name in (
            ("generation", "curr_pcie_link_generation"),
            ("width", "curr_pcie_link_width"),
        ):
            family = f"gpuwatchd_gpu_pcie_link_{label}"
            put(family, _num(self.get(name)), which="current")
            put(family, ident.pcie_max.get(label), which="max")
        if slow:  # error counters, on the NVLink counters' cadence (about 2.5 ms per read)
            self._pcie_replays = _num(self.get("pcie_replay_counter"))
            self._pcie_errors = {
                label: fv.get((name, 0)) for name, label in PCIE_ERROR_FIELDS.items()
            }
        put("gpuwatchd_gpu_pcie_replays_total", self._pcie_replays)
        for label, count in self._pcie_errors.items():
            put("gpuwatchd_gpu_pcie_errors_total", count, error=label)


class _Put(Protocol):  # the shape of read()'s local `put`
    def __call__(self, name: str, value: float | None, **labels: object) -> None: ...


def _scaled(value: object, factor: float) -> float | None:
    num = _num(value)
    return None if num is None else num * factor


def sorted_processes(procs: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """Processes ordered by pid, as plain dicts for /status."""
    return sorted((dict(p) for p in procs), key=lambda p: _num(p.get("pid")) or 0.0)
