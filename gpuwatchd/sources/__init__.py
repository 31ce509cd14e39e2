"""Sources: the only code that touches hardware, the kernel or the filesystem.

A source knows nothing of Prometheus, Alertmanager or SQLite
(tests/test_layering.py enforces it). It returns samples and events from
`poll()`; the runner calls it on its own thread and publishes the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gpuwatchd.model import Event, MetricSpec, Sample, SourcePayload
from gpuwatchd.sources.context import SourceContext

if TYPE_CHECKING:
    from gpuwatchd.config import Config

__all__ = [
    "PayloadSource",
    "SOURCES",
    "Source",
    "SourceContext",
    "SourceSpec",
    "all_metrics",
    "build_sources",
]


@runtime_checkable
class Source(Protocol):
    """One kind of input.

    `interval` is the pause between polls in seconds; a source whose poll()
    waits for input itself (the kernel log) uses a small interval and
    returns when its own wait times out. `poll()` raises SourceError when
    it could read nothing at all; partial failures are reported as
    samples (errors counters) and the poll still succeeds.
    """

    name: str
    interval: float

    def poll(self, now: float) -> Sequence[Sample | Event]: ...

    def status(self) -> Mapping[str, object]: ...

    def close(self) -> None: ...


@runtime_checkable
class PayloadSource(Protocol):
    """A source whose typed state other parts read (NVML's GPUs, the kernel log's
    cursor, the workloads); the runner publishes it on the snapshot. `status()`
    is for /status only: nothing outside a source reads it by key."""

    def payload(self) -> SourcePayload: ...


Factory = Callable[["Config", SourceContext], Source]


@dataclass(frozen=True)
class SourceSpec:
    factory: Factory
    default_enabled: bool
    metrics: tuple[MetricSpec, ...]


def _registry() -> dict[str, SourceSpec]:
    # Imported here, not at module top, so importing one source never
    # imports the others (and none of them imports pynvml or pyudev eagerly).
    from gpuwatchd.sources import udev
    from gpuwatchd.sources.aer import source as aer
    from gpuwatchd.sources.infiniband import source as infiniband
    from gpuwatchd.sources.kmsg import source as kmsg
    from gpuwatchd.sources.memory import source as memory
    from gpuwatchd.sources.nvml import source as nvml
    from gpuwatchd.sources.shm import source as shm
    from gpuwatchd.sources.workloads import source as workloads

    return {
        "nvml": SourceSpec(nvml.NvmlSource.from_config, True, nvml.METRICS),
        "kmsg": SourceSpec(kmsg.KmsgSource.from_config, True, kmsg.METRICS),
        "shm": SourceSpec(shm.ShmSource.from_config, True, shm.METRICS),
        "memory": SourceSpec(memory.MemorySource.from_config, True, memory.METRICS),
        "infiniband": SourceSpec(infiniband.InfinibandSource.from_config, True, infiniband.METRICS),
        "aer": SourceSpec(aer.AerSource.from_config, True, aer.METRICS),
        "udev": SourceSpec(udev.UdevSource.from_config, True, udev.METRICS),
        "workloads": SourceSpec(workloads.WorkloadSource.from_config, True, workloads.METRICS),
    }


SOURCES: dict[str, SourceSpec] = {}


def registry() -> dict[str, SourceSpec]:
    if not SOURCES:
        SOURCES.update(_registry())
    return SOURCES


def enabled(cfg: Config, name: str) -> bool:
    section = getattr(cfg.sources, name, None)
    return bool(getattr(section, "enabled", registry()[name].default_enabled))


def build_sources(cfg: Config, ctx: SourceContext) -> list[Source]:
    """Instantiate every enabled source, in registry order."""
    return [spec.factory(cfg, ctx) for name, spec in registry().items() if enabled(cfg, name)]


def all_metrics() -> tuple[MetricSpec, ...]:
    return tuple(m for spec in registry().values() for m in spec.metrics)
