"""Recording what NVML answers, for the replay backend (`gpuwatchd record`).

A RecordingClient wraps the real client and writes down every answer;
the real NvmlSource is then polled a few times through it, so the capture
holds exactly the calls the source makes (and, because the source stops
asking for unsupported readings, each of those once). The format is
described in gpuwatchd/sources/nvml/replay.py.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gpuwatchd.errors import NvmlError, SourceError
from gpuwatchd.model import Sample
from gpuwatchd.sources.nvml.client import (
    FieldKey,
    FieldResult,
    NvmlClient,
    NvmlDevice,
    Pynvml,
    XidEventSet,
    call_key,
)
from gpuwatchd.sources.nvml.replay import FORMAT
from gpuwatchd.sources.nvml.source import NvmlSource

__all__ = ["RecordingClient", "RecordingDevice", "record"]

log = logging.getLogger("gpuwatchd.sources.nvml.record")
T = TypeVar("T")
Book = dict[str, list[dict[str, Any]]]


def _timed(
    book: Book,
    key: str,
    lock: threading.Lock,
    fn: Callable[[], T],
    keep: Callable[[T], object] = lambda v: v,
) -> T:
    t0 = time.perf_counter()
    obs: dict[str, Any] | None = None
    try:
        value = fn()
        obs = {"value": keep(value)}
        return value
    except NvmlError as exc:
        obs = {"error": exc.code, "code": exc.value}
        raise
    finally:
        if obs is not None:  # anything but an NVML answer is a bug, not data
            obs["us"] = round((time.perf_counter() - t0) * 1e6, 1)
            with lock:
                book.setdefault(key, []).append(obs)


class RecordingDevice:
    """Passes every call to the real device and records the answer."""

    def __init__(self, inner: NvmlDevice, book: dict[str, Book], lock: threading.Lock) -> None:
        self.inner = inner
        self.index = inner.index
        self._calls = book.setdefault("calls", {})
        self._fields = book.setdefault("fields", {})
        self._lock = lock

    def call(self, name: str, *args: int) -> object:
        return _timed(
            self._calls, call_key(name, args), self._lock, lambda: self.inner.call(name, *args)
        )

    def field_values(self, fields: Sequence[FieldKey]) -> Mapping[FieldKey, FieldResult]:
        answers = _timed(
            self._calls,
            "field_values",
            self._lock,
            lambda: self.inner.field_values(fields),
            keep=lambda _v: None,
        )
        with self._lock:
            for (name, scope), value in answers.items():
                obs: dict[str, Any] = (
                    {"error": value.code, "code": value.value}
                    if isinstance(value, NvmlError)
                    else {"value": value}
                )
                self._fields.setdefault(f"{name}@{scope}", []).append(obs)
        return answers


class RecordingClient:
    """An NvmlClient that records everything `inner` answers."""

    def __init__(self, inner: NvmlClient) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self.init_calls: list[dict[str, Any]] = []
        self.system: Book = {}
        self.devices: dict[int, dict[str, Book]] = {}

    def init(self) -> None:
        _timed({"init": self.init_calls}, "init", self._lock, self.inner.init, keep=lambda _v: None)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def call(self, name: str) -> object:
        return _timed(self.system, name, self._lock, lambda: self.inner.call(name))

    def device(self, index: int) -> RecordingDevice:
        dev = _timed(
            self.system,
            f"device_handle({index})",
            self._lock,
            lambda: self.inner.device(index),
            keep=lambda _v: None,
        )
        with self._lock:
            book = self.devices.setdefault(index, {})
        return RecordingDevice(dev, book, self._lock)

    def xid_events(self, devices: Sequence[NvmlDevice]) -> XidEventSet:
        inner = [d.inner if isinstance(d, RecordingDevice) else d for d in devices]
        return self.inner.xid_events(inner)

    def capture(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Everything recorded so far, in the capture format."""
        with self._lock:
            count = max(self.devices, default=-1) + 1
            devices = [
                {
                    "calls": dict(sorted(self.devices.get(i, {}).get("calls", {}).items())),
                    "fields": dict(sorted(self.devices.get(i, {}).get("fields", {}).items())),
                }
                for i in range(count)
            ]
            return {
                "format": FORMAT,
                **meta,
                "init": list(self.init_calls),
                "system": dict(sorted(self.system.items())),
                "devices": devices,
            }


def _host() -> dict[str, Any]:
    try:
        from importlib.metadata import version

        nvml_py: str | None = version("nvidia-ml-py")
    except Exception:
        nvml_py = None
    os_name = ""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return {
        "kernel": platform.release(),
        "machine": platform.machine(),
        "os": os_name,
        "python": platform.python_version(),
        "nvidia_ml_py": nvml_py,
    }


def record(
    out: str | os.PathLike[str],
    *,
    polls: int = 3,
    interval: float = 1.0,
    call_timeout: float = 5.0,
    client: NvmlClient | None = None,
) -> dict[str, Any]:
    """Poll NVML `polls` times through a recorder and write the capture to `out`."""
    rec = RecordingClient(client if client is not None else Pynvml())
    source = NvmlSource(rec, interval=interval, call_timeout=call_timeout)
    started = dt.datetime.now(dt.UTC)
    history: list[dict[str, Any]] = []
    try:
        for n in range(polls):
            if n:
                time.sleep(interval)
            t0 = time.monotonic()
            entry: dict[str, Any] = {}
            try:
                items = source.poll(time.time())
            except SourceError as exc:
                entry["error"] = str(exc)
                items = []
            entry["seconds"] = round(time.monotonic() - t0, 6)
            entry["samples"] = sum(1 for i in items if isinstance(i, Sample))
            history.append(entry)
            if "error" in entry and not rec.devices:
                break  # NVML never came up; one failed attempt is the capture
        status = source.status()
    finally:
        source.close()
    gpus = status.get("gpus", {})
    meta = {
        "captured_at": started.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "tool": "gpuwatchd record",
        "polls": len(history),
        "interval": interval,
        "host": _host(),
        "summary": {
            "driver_version": status.get("driver"),
            "nvml_version": status.get("nvml_version"),
            "cuda_version": status.get("cuda_version"),
            "init_error": status.get("init_error"),
            "gpus": [
                {
                    "pci_bus_id": bus,
                    "name": g.get("name"),
                    "uuid": g.get("uuid"),
                    "state": g.get("state"),
                }
                for bus, g in (gpus.items() if isinstance(gpus, dict) else [])
            ],
            "polls": history,
        },
    }
    capture = rec.capture(meta)
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(capture, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return capture
