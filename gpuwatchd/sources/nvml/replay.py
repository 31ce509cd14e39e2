"""Replay a recorded NVML capture through the NvmlClient interface.

This is gpuwatchd's only NVML fake. A capture (written by `gpuwatchd
record`, format below) holds what real NVML answered, call by call; the
replay serves those answers, and a *script* can change them over time:

    {"device": 1, "call": "nvlink_state(3)", "from_poll": 3, "value": 0}
    {"device": 0, "call": "total_ecc_errors(0,0)", "add_per_poll": 2}
    {"device": 1, "call": "*", "from_poll": 2, "until_poll": 4, "hang": true}
    {"device": 1, "call": "*", "from_poll": 5, "error": "GPU_IS_LOST"}
    {"call": "init", "until_call": 3, "error": "DRIVER_NOT_LOADED"}
    {"device": 0, "from_poll": 2, "xid": 79}

Values always come from the recording; a step may replace or shift a
recorded value, or turn any answer into an NVML error or a hang, but a call
the capture lacks stays missing: it raises NvmlError("NOT_RECORDED"),
which the source treats like an unsupported reading (absent, never zero).

Capture format (`gpuwatchd-nvml-capture/1`): `init` and `system` hold the
library-level calls (`init`, `driver_version`, `device_count`,
`device_handle(N)`, ...), `devices[i].calls` the per-device ones keyed
like `temperature(0)`, `devices[i].fields` the nvmlDeviceGetFieldValues
answers keyed `NVML_FI_...@scope`. Each key holds a list of observations,
`{"value": V, "us": T}` or `{"error": "NOT_SUPPORTED", "code": 3, "us": T}`;
the n-th call of a key gets the n-th observation (the last one repeats).

Windows: `from_poll`/`until_poll` count polls (poll N starts with the N-th
nvmlDeviceGetCount, which NvmlSource makes exactly once per poll),
`from_s`/`until_s` are seconds since the client was made (on its Clock),
`from_call`/`until_call` count earlier calls of the matched key; `until_*`
is exclusive. `device` is a GPU index or "*"; without it a step matches
library-level calls only.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import json
import threading
import time
import uuid as uuidlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from gpuwatchd.clock import Clock, SystemClock
from gpuwatchd.errors import NvmlError
from gpuwatchd.sources.nvml.client import (
    NVML_ERROR_CODES,
    FieldKey,
    FieldResult,
    NvmlDevice,
    XidEvent,
    normalize_bus_id,
    nvml_error,
)

__all__ = ["FORMAT", "ReplayClient", "ReplayDevice", "Step", "expand_devices", "load_capture"]

FORMAT = "gpuwatchd-nvml-capture/1"
_UNSET: Any = object()
Observation = Mapping[str, Any]


@dataclass(frozen=True)
class Step:
    """One scripted change; see the module docstring."""

    call: str = "*"
    device: int | str | None = None
    from_poll: int | None = None
    until_poll: int | None = None
    from_s: float | None = None
    until_s: float | None = None
    from_call: int | None = None
    until_call: int | None = None
    value: Any = _UNSET
    add: float = 0.0
    add_per_poll: float = 0.0
    error: str | None = None
    hang: bool | float = False
    xid: int | None = None

    @classmethod
    def parse(cls, data: Mapping[str, Any] | Step) -> Step:
        """A step from its JSON form; unknown keys and error names are refused."""
        if isinstance(data, Step):
            return data
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"script step has unknown keys {unknown}: {dict(data)}")
        step = cls(**data)
        if step.error is not None and step.error not in NVML_ERROR_CODES:
            raise ValueError(f"script step names unknown NVML error {step.error!r}")
        if step.xid is not None and not isinstance(step.device, int):
            raise ValueError(f"an xid step needs a device index: {dict(data)}")
        return step

    def window(self, call_n: int, poll: int, elapsed: float) -> bool:
        """Whether the step is active for this call."""
        return (
            _within(poll, self.from_poll, self.until_poll)
            and _within(elapsed, self.from_s, self.until_s)
            and _within(call_n, self.from_call, self.until_call)
        )

    def matches(self, device: int | None, key: str) -> bool:
        if self.xid is not None:
            return False
        if self.device is None:
            if device is not None:
                return False
        elif self.device != "*" and self.device != device:
            return False
        return fnmatch.fnmatchcase(key, self.call)


def _within(x: float, lo: float | None, hi: float | None) -> bool:
    return (lo is None or x >= lo) and (hi is None or x < hi)


def load_capture(path: str | Path) -> dict[str, Any]:
    """Read and check a capture file."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    _check(data)
    return dict(data)


def _check(data: object) -> None:
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith(
        "gpuwatchd-nvml-capture/"
    ):
        raise ValueError(f"not a gpuwatchd NVML capture (format {FORMAT} expected)")
    if data["format"] != FORMAT:
        raise ValueError(f"capture format {data['format']} is not {FORMAT}")
    devices = data.get("devices")
    if not isinstance(devices, list) or not all(
        isinstance(d, dict) and isinstance(d.get("calls", {}), dict) for d in devices
    ):
        raise ValueError("capture: devices must be a list of {calls, fields} objects")
    if not isinstance(data.get("system", {}), dict):
        raise ValueError("capture: system must be an object")


class ReplayClient:
    """An NvmlClient answering from a capture, changed over time by a script."""

    def __init__(
        self,
        capture: Mapping[str, Any],
        *,
        script: Sequence[Mapping[str, Any] | Step] = (),
        clock: Clock | None = None,
        latency: bool = False,
    ) -> None:
        """`latency`: each call blocks for the time the real call took when recorded."""
        _check(capture)
        self.capture = capture
        self.steps = [Step.parse(s) for s in [*capture.get("script", []), *script]]
        self._clock = clock or SystemClock()
        self._start = self._clock.monotonic()
        self._lock = threading.Lock()
        self._release = threading.Event()
        self.calls: Counter[tuple[int | None, str]] = Counter()
        self.polls = 0
        self._delivered: set[int] = set()
        self._latency = latency

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        script: Sequence[Mapping[str, Any] | Step] = (),
        clock: Clock | None = None,
        devices: int | None = None,
        latency: bool = False,
    ) -> ReplayClient:
        """Replay a capture file, optionally widened to `devices` GPUs (expand_devices)."""
        capture = load_capture(path)
        if devices is not None:
            capture = expand_devices(capture, devices)
        return cls(capture, script=script, clock=clock, latency=latency)

    # --- test controls -----------------------------------------------------------

    def release(self) -> None:
        """Let every call that is hanging now return (later hangs still hang)."""
        with self._lock:
            self._release.set()
            self._release = threading.Event()

    def count(self, device: int | None, key: str) -> int:
        """How often `key` was called on `device` (None: library-level)."""
        with self._lock:
            return self.calls[(device, key)]

    def elapsed(self) -> float:
        return self._clock.monotonic() - self._start

    # --- the engine --------------------------------------------------------------

    def answer(self, device: int | None, key: str, recorded: Sequence[Observation] | None) -> Any:
        """The recorded answer to the next call of `key`, as the script changes it."""
        with self._lock:
            n = self.calls[(device, key)]
            self.calls[(device, key)] += 1
            if device is None and key == "device_count":
                self.polls += 1
            poll, elapsed = self.polls, self.elapsed()
            active = [
                s for s in self.steps if s.matches(device, key) and s.window(n, poll, elapsed)
            ]
            release = self._release
        where = "library" if device is None else f"device {device}"
        value: Any = None
        error: NvmlError | None = None
        if not recorded:
            error = NvmlError("NOT_RECORDED", -1, f"the capture has no {key} for the {where}")
        else:
            obs = recorded[min(n, len(recorded) - 1)]
            if self._latency:
                time.sleep(float(obs.get("us", 0.0)) / 1e6)
            if "error" in obs:
                code = str(obs["error"])
                error = NvmlError(code, int(obs.get("code", NVML_ERROR_CODES.get(code, -1))), code)
            else:
                value = copy.deepcopy(obs.get("value"))
        for step in active:
            if step.hang is not False:
                release.wait(None if step.hang is True else float(step.hang))
            if step.error is not None:
                error = nvml_error(step.error, f"scripted {step.error} for {key} ({where})")
            elif error is None:
                value = _modify(step, value, poll)
        if error is not None:
            raise error
        return value

    # --- NvmlClient --------------------------------------------------------------

    def init(self) -> None:
        self.answer(None, "init", self.capture.get("init") or [{"value": None}])

    def shutdown(self) -> None:
        self.answer(None, "shutdown", [{"value": None}])

    def call(self, name: str) -> object:
        return self.answer(None, name, self.capture.get("system", {}).get(name))

    def device(self, index: int) -> ReplayDevice:
        devices = self.capture["devices"]
        key = f"device_handle({index})"
        recorded = self.capture.get("system", {}).get(key)
        if recorded is None and 0 <= index < len(devices):
            recorded = [{"value": None}]
        self.answer(None, key, recorded)
        return ReplayDevice(self, index, devices[index])

    def xid_events(self, devices: Sequence[NvmlDevice]) -> ReplayXidEvents:
        return ReplayXidEvents(self, [d.index for d in devices])

    def pending_xids(self, indexes: Sequence[int]) -> list[tuple[int, int]]:
        """(device, code) of scripted Xids now due, each delivered once."""
        out = []
        with self._lock:
            poll, elapsed = self.polls, self.elapsed()
            for i, step in enumerate(self.steps):
                if step.xid is None or i in self._delivered:
                    continue
                if (
                    isinstance(step.device, int)
                    and step.device in indexes
                    and step.window(0, poll, elapsed)
                ):
                    self._delivered.add(i)
                    out.append((step.device, step.xid))
        return out

    def wall_time(self) -> float:
        return self._clock.time()


def _modify(step: Step, value: Any, poll: int) -> Any:
    if step.value is not _UNSET:
        return copy.deepcopy(step.value)
    if step.add or step.add_per_poll:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"script adds to a non-number {value!r}")
        polls = max(0, poll - (step.from_poll or 1))
        shifted = value + step.add + step.add_per_poll * polls
        return int(shifted) if isinstance(value, int) and float(shifted).is_integer() else shifted
    return value


class ReplayDevice:
    """One GPU of a capture."""

    def __init__(self, client: ReplayClient, index: int, recorded: Mapping[str, Any]) -> None:
        self.index = index
        self._client = client
        self._calls: Mapping[str, Sequence[Observation]] = recorded.get("calls", {})
        self._fields: Mapping[str, Sequence[Observation]] = recorded.get("fields", {})

    def call(self, name: str, *args: int) -> object:
        key = f"{name}({','.join(str(a) for a in args)})" if args else name
        return self._client.answer(self.index, key, self._calls.get(key))

    def field_values(self, fields: Sequence[FieldKey]) -> Mapping[FieldKey, FieldResult]:
        self._client.answer(
            self.index, "field_values", self._calls.get("field_values") or [{"value": None}]
        )
        out: dict[FieldKey, FieldResult] = {}
        for name, scope in fields:
            try:
                value = self._client.answer(
                    self.index, f"{name}@{scope}", self._fields.get(f"{name}@{scope}")
                )
            except NvmlError as exc:
                out[(name, scope)] = exc
                continue
            out[(name, scope)] = (
                value
                if isinstance(value, (int, float))
                else nvml_error("UNKNOWN", f"recorded {name}@{scope} is not a number: {value!r}")
            )
        return out

    def identity(self) -> tuple[str, str]:
        """(uuid, normalised PCI bus id) as first recorded."""
        uuid = (self._calls.get("uuid") or [{}])[0].get("value", "")
        pci = (self._calls.get("pci_info") or [{}])[0].get("value") or {}
        return str(uuid), normalize_bus_id(str(pci.get("busId", "")))


class ReplayXidEvents:
    """Scripted Xids (steps with `xid`) for the devices registered.

    Blocks as libnvidia-ml's event set does: a wait returns at an event or at
    its timeout, never earlier, and close() (nvmlEventSetFree) waits for a
    wait in flight to return."""

    def __init__(self, client: ReplayClient, indexes: Sequence[int]) -> None:
        self._client = client
        self._indexes = list(indexes)
        self._queue: list[tuple[int, int]] = []
        self._in_wait = threading.Lock()
        self._never = threading.Event()  # what a driver wait sleeps on: nothing sets it
        self._closed = False

    def wait(self, timeout: float) -> XidEvent | None:
        """The next due scripted Xid, or None after `timeout` seconds."""
        with self._in_wait:
            if self._closed:
                raise nvml_error("UNINITIALIZED", "the event set was freed")
            if not any(step.xid is not None for step in self._client.steps):
                self._never.wait(timeout)  # no script delivers an Xid: nothing to look for
                return None
            waited = 0.0
            while True:
                self._queue.extend(self._client.pending_xids(self._indexes))
                if self._queue:
                    index, code = self._queue.pop(0)
                    dev = self._client.device(index)
                    uuid, bus = dev.identity()
                    return XidEvent(uuid, bus, code, self._client.wall_time())
                if waited >= timeout:
                    return None
                self._never.wait(min(0.01, timeout - waited))
                waited += 0.01

    def close(self) -> None:
        """Free the set: waits for a wait in flight, as nvmlEventSetFree does."""
        with self._in_wait:
            self._closed = True


# --- widening a capture ----------------------------------------------------------


def expand_devices(capture: Mapping[str, Any], count: int) -> dict[str, Any]:
    """A capture with `count` GPUs made by repeating the recorded ones in order.

    Copy i of recorded GPU i % n keeps every recorded answer except its
    identity, which is derived deterministically so no two GPUs share one:
    uuid = uuid5(URL namespace, "gpuwatchd-replay:<recorded uuid>:<i>"),
    PCI device number = highest recorded device number + (i - n + 1),
    minor number = i, serial = recorded serial with its last two digits
    replaced by i. The first n GPUs are the recorded ones, unchanged.
    """
    out = copy.deepcopy(dict(capture))
    recorded = out["devices"]
    n = len(recorded)
    if n == 0 or count < n:
        raise ValueError(f"cannot widen a capture of {n} GPUs to {count}")
    top = max(_pci(d).get("device", 0) for d in recorded)
    devices = list(recorded)
    for i in range(n, count):
        dev = copy.deepcopy(recorded[i % n])
        calls = dev["calls"]
        _rewrite(calls, "uuid", partial(_derived_uuid, i))
        _rewrite(calls, "minor_number", lambda _old, i=i: i)
        _rewrite(calls, "serial", lambda old, i=i: f"{old[:-2]}{i:02d}")
        _rewrite(calls, "pci_info", partial(_moved, top + i - n + 1))
        devices.append(dev)
    out["devices"] = devices
    system = out.setdefault("system", {})
    for obs in system.get("device_count", []):
        if "value" in obs:
            obs["value"] = count
    handle = system.get("device_handle(0)", [{"value": None, "us": 0.0}])
    for i in range(count):
        system.setdefault(f"device_handle({i})", copy.deepcopy(handle))
    out["derived"] = {
        "from_devices": n,
        "devices": count,
        "rule": "gpuwatchd.sources.nvml.replay.expand_devices",
    }
    return out


def _pci(dev: Mapping[str, Any]) -> Mapping[str, Any]:
    obs = dev.get("calls", {}).get("pci_info") or [{}]
    value = obs[0].get("value")
    return value if isinstance(value, dict) else {}


def _rewrite(calls: dict[str, list[dict[str, Any]]], key: str, fn: Any) -> None:
    for obs in calls.get(key, []):
        if "value" in obs and obs["value"] is not None:
            obs["value"] = fn(obs["value"])


def _derived_uuid(i: int, recorded: str) -> str:
    return f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, f'gpuwatchd-replay:{recorded}:{i}')}"


def _moved(device: int, pci: dict[str, Any]) -> dict[str, Any]:
    moved = dict(pci, device=device)
    domain, bus = int(pci.get("domain", 0)), int(pci.get("bus", 0))
    moved["busId"] = f"{domain:08X}:{bus:02X}:{device:02X}.0"
    if "busIdLegacy" in pci:
        moved["busIdLegacy"] = f"{domain:04X}:{bus:02X}:{device:02X}.0"
    return moved
