"""NVML source: per-GPU health and telemetry, where no NVML call can hang the daemon.

Every GPU's whole poll runs as one call on that GPU's own worker thread
(gpuwatchd.deadline.DeadlineRunner) under `call_timeout`; the GPUs are
waited for in parallel, so a poll takes at most about one deadline. A GPU
whose call overruns is `unresponsive`: later polls skip it (no new call is
queued behind the hung one) until the call returns, and whatever it then
returns is discarded. NVML_ERROR_GPU_IS_LOST makes a GPU `lost`. nvmlInit
runs under the same deadline and is retried with exponential backoff.

The NVML boundary (protocols, pynvml, error mapping) is in nvml_client.py,
the per-GPU readings in nvml_read.py.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

from gpuwatchd.clock import Clock, SystemClock
from gpuwatchd.deadline import CallTimeout, DeadlineRunner, StuckError
from gpuwatchd.errors import ConfigError, NvmlError, SourceError
from gpuwatchd.model import Event, Gpu, GpuInventory, Sample, Topology, labels_of
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.sources.nvml.client import NvmlClient, NvmlDevice, Pynvml, XidEventSet
from gpuwatchd.sources.nvml.events import XidListener
from gpuwatchd.sources.nvml.fabric import FabricManagerProbe
from gpuwatchd.sources.nvml.metrics import METRICS
from gpuwatchd.sources.nvml.mig import gpu_processes, mig_uuids
from gpuwatchd.sources.nvml.read import DeviceReader, Identity, Reading, sorted_processes
from gpuwatchd.sources.nvml.topology import GpuLinks, assemble, device_getter, read_links

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.sources.context import SourceContext

__all__ = [
    "METRICS",
    "NvmlSource",
    "STATES",
]

log = logging.getLogger("gpuwatchd.nvml")

STATES = {"ok": 0, "unresponsive": 1, "lost": 2}
# Failures of a per-poll system call that mean NVML as a whole is gone.
_FATAL = frozenset(
    {"UNINITIALIZED", "DRIVER_NOT_LOADED", "LIB_RM_VERSION_MISMATCH", "LIBRARY_NOT_FOUND"}
)


@dataclass
class _Gpu:
    """The poll thread's view of one GPU; `reader` lives on the GPU's worker."""

    index: int
    reader: DeviceReader
    identity: Identity | None = None
    state: str = "ok"
    errors: Counter[str] = field(default_factory=Counter)
    reading: Reading | None = None
    fresh: bool = False  # `reading` came from this poll
    next_slow: float = float("-inf")  # monotonic time the slow readings are due
    next_static: float = float("-inf")  # monotonic time the static calls are due (static.py)

    @property
    def key(self) -> str:
        return f"nvml-gpu{self.index}"

    def labels(self) -> dict[str, str]:
        if self.identity is not None:
            return self.identity.labels()
        return {"gpu": str(self.index), "uuid": "", "pci_bus_id": ""}


class NvmlSource:
    """Polls every GPU NVML sees; see the module docstring for the deadline rules."""

    name = "nvml"

    def __init__(
        self,
        client: NvmlClient,
        *,
        interval: float = 10.0,
        call_timeout: float = 5.0,
        init_retry_max: float = 300.0,
        processes: bool = True,
        gpm: bool = True,
        nvlink_error_interval: float = 0.0,
        static_interval: float = 0.0,
        clock: Clock | None = None,
        xid_events: bool = False,
        nudge: Callable[[], None] = lambda: None,
        fabricmanager: FabricManagerProbe | None = None,
        sysfs: str = "/sys",
    ) -> None:
        self.interval = interval
        self.client = client
        self._timeout = call_timeout
        self._retry_max = init_retry_max
        self._processes = processes
        self._gpm = gpm
        self._slow_every = nvlink_error_interval
        self._static_every = static_interval
        self._clock = clock or SystemClock()
        self._deadline = DeadlineRunner()
        self._ready = False
        self._versions: dict[str, object] = {}
        self._gpus: list[_Gpu] = []
        self._visible: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._init_error: str | None = None
        self._init_failures = 0
        self._next_init = float("-inf")
        self._gpu_map: Mapping[str, Mapping[str, str]] = {}
        self._inventory = GpuInventory()
        self._want_xid_events = xid_events
        self._nudge = nudge
        self._xid_listener: XidListener | None = None
        self._fabricmanager = fabricmanager
        self._sysfs = sysfs
        self._topology: Topology | None = None
        self._topology_of: tuple[tuple[int, str], ...] = ()  # the GPUs it was read for

    @classmethod
    def from_config(cls, cfg: Config, ctx: SourceContext) -> NvmlSource:
        """The real NVML, or the recorded capture `sources.nvml.replay` names."""
        nc = cfg.sources.nvml
        client: NvmlClient = Pynvml()
        if nc.replay:
            from gpuwatchd.sources.nvml.replay import ReplayClient

            try:
                # as slow as the recorded GPU was: a replay that answers at once hides
                # what real NVML's blocking costs (`check` read 0.47 s here, 5.7 s there)
                client = ReplayClient.load(nc.replay, clock=ctx.clock, latency=True)
            except (OSError, ValueError) as exc:
                raise ConfigError("", "sources.nvml.replay", f"{nc.replay}: {exc}") from None
        return cls(
            client,
            interval=nc.interval,
            call_timeout=nc.call_timeout,
            init_retry_max=nc.init_retry_max,
            processes=nc.processes,
            gpm=nc.gpm,
            nvlink_error_interval=nc.nvlink_error_interval,
            static_interval=nc.static_interval,
            clock=ctx.clock,
            # `check` reads Xids from the kernel log; waiting on NVML events there only
            # delays its exit (the set cannot be freed while a wait is in flight)
            xid_events=nc.xid_events and not ctx.one_shot,
            nudge=lambda: ctx.nudge(cls.name),
            # a replay is not this host: its fabric manager is not ours to report
            fabricmanager=None if nc.replay else FabricManagerProbe(),
            sysfs=cfg.paths.sysfs,
        )

    # --- polling ---------------------------------------------------------------

    def poll(self, now: float) -> Sequence[Sample | Event]:
        """One sample set for every GPU; raises SourceError when NVML is unusable."""
        if not self._ready:
            self._init()
        count = self._device_count()
        if count != len(self._gpus):
            self._rebuild(count)
        if self._gpus:
            assert self._pool is not None
            list(self._pool.map(self._poll_gpu, self._gpus))
        out: list[Sample | Event] = [Sample.of("gpuwatchd_gpus_visible", count)]
        for gpu in self._gpus:
            out.extend(self._samples(gpu))
        self._gpu_map = {
            g.identity.pci_bus_id: {
                "gpu": str(g.index),
                "uuid": g.identity.uuid,
                "name": g.identity.name,
                "minor": "" if g.identity.minor is None else str(g.identity.minor),
                "state": g.state,
            }
            for g in self._gpus
            if g.identity is not None
        }
        self._read_topology()
        self._inventory = GpuInventory(
            tuple(
                Gpu(
                    index=g.index,
                    uuid=g.identity.uuid,
                    pci_bus_id=normalize_bus_id(g.identity.pci_bus_id),
                    name=g.identity.name,
                    mig=mig_uuids(g.reading.last) if g.reading else (),
                    processes=gpu_processes(g.reading.processes) if g.reading else (),
                )
                for g in self._gpus
                if g.identity is not None
            ),
            self._topology,
        )
        out.extend(self._xid_events())
        if self._fabricmanager is not None and self._gpus:
            self._fabricmanager.samples(lambda name, v, **kw: out.append(Sample.of(name, v, **kw)))
        return out

    def _read_topology(self) -> None:
        """Once per set of GPUs (a GPU added, gone or moved reads it again), all GPUs known."""
        known = [(g, g.identity) for g in self._gpus if g.identity is not None]
        of = tuple((g.index, ident.pci_bus_id) for g, ident in known)
        if of == self._topology_of or len(known) < len(self._gpus):
            return
        links: dict[int, GpuLinks] = {}
        for gpu, ident in known:
            device = gpu.reader.device
            if gpu.state != "ok" or device is None:
                continue
            peers = [i for i, _ in of if i != gpu.index]
            failed: dict[str, str] = {}
            up = _links_up(gpu.reading)
            get = device_getter(device, failed)
            work = partial(read_links, get, ident.nvlinks, peers, failed, up)
            try:
                links[gpu.index] = self._deadline.call(gpu.key, work, self._timeout)
            except (NvmlError, CallTimeout, StuckError) as exc:
                log.info("gpu %d: topology not read: %s", gpu.index, exc)
        gpus = [(g.index, ident.pci_bus_id, ident.uuid) for g, ident in known]
        self._topology = assemble(gpus, links, self._sysfs)
        self._topology_of = of

    def _xid_events(self) -> list[Event]:
        """Start the NVML Xid event listener once the GPUs are known; drain it."""
        if self._want_xid_events and self._xid_listener is None and self._gpus:
            try:
                events = self.open_xid_events()
            except (NvmlError, CallTimeout, StuckError) as exc:
                log.info("NVML Xid events unavailable (%s); the kernel log still reports Xids", exc)
                self._want_xid_events = False
            else:
                if events is not None:
                    self._xid_listener = XidListener(events, self._nudge)
        if self._xid_listener is None:
            return []
        out = []
        for ev in self._xid_listener.drain():
            gpu = self._gpu_map.get(ev.pci_bus_id, {})
            self._refresh_static(gpu.get("gpu"))  # an Xid may come with a reset: re-read
            xid = ev.xid
            if xid is not None:
                found = replace(xid, gpu=gpu.get("gpu", ""), uuid=gpu.get("uuid", ""))
                ev = ev.carrying(xid.filled_from(found))
            out.append(ev)
        return out

    def _system(self, name: str) -> object:
        return self._deadline.call("nvml", partial(self.client.call, name), self._timeout)

    def _init(self) -> None:
        mono = self._clock.monotonic()
        if mono < self._next_init:
            raise SourceError("nvml_init_failed", f"NVML unavailable: {self._init_error}")
        try:
            self._deadline.call("nvml", self.client.init, self._timeout)
            versions: dict[str, object] = {}
            for name in ("driver_version", "nvml_version", "cuda_driver_version"):
                try:
                    versions[name] = self._system(name)
                except NvmlError as exc:
                    log.debug("NVML %s unavailable: %s", name, exc.code)
        except NvmlError as exc:
            reason = exc.code if str(exc) == exc.code else f"{exc.code} ({exc})"
        except CallTimeout:
            reason = f"nvmlInit did not return within {self._timeout:g}s"
        except StuckError:
            reason = "an earlier nvmlInit call is still hung"
        else:
            if self._init_failures:
                log.info("NVML initialised after %d failed attempts", self._init_failures)
            self._ready, self._versions = True, versions
            self._init_error, self._init_failures = None, 0
            return
        self._init_failures += 1
        delay = min(self._retry_max, self.interval * 2 ** (self._init_failures - 1))
        self._next_init = mono + delay
        if reason != self._init_error:
            log.warning("NVML initialisation failed: %s; retrying with backoff", reason)
        else:
            log.debug("NVML initialisation failed again: %s; next try in %.0fs", reason, delay)
        self._init_error = reason
        raise SourceError("nvml_init_failed", f"NVML initialisation failed: {reason}")

    def _device_count(self) -> int:
        try:
            count = self._system("device_count")
        except NvmlError as exc:
            if exc.code in _FATAL:
                self._teardown(f"{exc.code} from nvmlDeviceGetCount")
                raise SourceError("nvml_init_failed", f"NVML stopped working: {exc.code}") from None
            raise SourceError("nvml_device_count", f"nvmlDeviceGetCount: {exc.code}") from None
        except (CallTimeout, StuckError):
            raise SourceError(
                "nvml_timeout", f"nvmlDeviceGetCount did not return within {self._timeout:g}s"
            ) from None
        if not isinstance(count, int) or count < 0:
            raise SourceError("nvml_device_count", f"nvmlDeviceGetCount answered {count!r}")
        self._visible = count
        return count

    def _teardown(self, reason: str) -> None:
        log.warning("NVML failed as a whole (%s); initialising again", reason)
        self._ready = False
        self._init_error = reason
        self._next_init = float("-inf")
        self._rebuild(0)

    def _rebuild(self, count: int) -> None:
        if self._gpus or count:
            log.info("NVML sees %d GPU(s)", count)
        self._gpus = [_Gpu(i, DeviceReader(i, self._processes, self._gpm)) for i in range(count)]
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        # Pool threads only wait (at most one deadline); the NVML calls run on
        # the DeadlineRunner's per-GPU workers.
        self._pool = ThreadPoolExecutor(max(1, count), thread_name_prefix="nvml-wait")

    def _poll_gpu(self, gpu: _Gpu) -> None:
        gpu.fresh = False
        if self._deadline.is_stuck(gpu.key):
            self._set_state(gpu, "unresponsive", "an earlier NVML call is still hung")
            return
        mono = self._clock.monotonic()
        slow = mono >= gpu.next_slow
        static = mono >= gpu.next_static
        work = partial(gpu.reader.poll, self.client.device, gpu.identity, slow, static)
        try:
            reading = self._deadline.call(gpu.key, work, self._timeout)
        except CallTimeout:
            gpu.errors["deadline_exceeded"] += 1
            self._set_state(
                gpu, "unresponsive", f"an NVML call did not return within {self._timeout:g}s"
            )
            return
        except StuckError:
            self._set_state(gpu, "unresponsive", "an earlier NVML call is still hung")
            return
        except Exception:  # a bug in reading one GPU must not stop the others
            gpu.errors["exception"] += 1
            log.exception("gpu %d: reading failed", gpu.index)
            return
        gpu.errors.update(reading.errors)
        gpu.identity = reading.identity or gpu.identity
        gpu.reading, gpu.fresh = reading, True
        if reading.lost:
            self._set_state(gpu, "lost", "NVML reports GPU_IS_LOST")
        elif reading.failure:
            log.warning("gpu %d: could not be read: %s", gpu.index, reading.failure)
        else:
            self._set_state(gpu, "ok", "")
            if slow:
                gpu.next_slow = mono + self._slow_every
            if reading.static_read:
                gpu.next_static = mono + self._static_every

    def _refresh_static(self, index: str | None) -> None:
        for gpu in self._gpus:
            if str(gpu.index) == index:
                gpu.next_static = float("-inf")

    def _set_state(self, gpu: _Gpu, state: str, why: str) -> None:
        if state == gpu.state:
            return
        gpu.next_static = float("-inf")  # back from unresponsive or lost: re-read everything
        where = gpu.identity.pci_bus_id if gpu.identity else "?"
        if state == "ok":
            log.info("gpu %d (%s): NVML %s again", gpu.index, where, state)
        else:
            log.error("gpu %d (%s): NVML %s: %s", gpu.index, where, state, why)
        gpu.state = state

    def _samples(self, gpu: _Gpu) -> list[Sample]:
        base = gpu.labels()
        out = [
            Sample.of("gpuwatchd_gpu_nvml_state", STATES[gpu.state], **base),
            Sample.of("gpuwatchd_gpu_nvml_state_info", 1, **base, state=gpu.state),
        ]
        ident = gpu.identity
        if ident is not None:
            info = {
                **base,
                "name": ident.name,
                "serial": ident.serial,
                "vbios_version": ident.vbios,
                "driver_version": str(self._versions.get("driver_version", "")),
                "nvml_version": str(self._versions.get("nvml_version", "")),
                "cuda_version": _cuda_version(self._versions.get("cuda_driver_version")),
            }
            out.append(Sample("gpuwatchd_gpu_info", 1.0, labels_of(info)))
        for reason, count in sorted(gpu.errors.items()):
            out.append(Sample.of("gpuwatchd_nvml_errors_total", count, **base, reason=reason))
        if gpu.fresh and gpu.reading is not None and gpu.state == "ok":
            out.append(
                Sample.of("gpuwatchd_gpu_poll_duration_seconds", gpu.reading.seconds, **base)
            )
            out.extend(gpu.reading.samples)
        return out

    # --- for other parts of the daemon ------------------------------------------

    def status(self) -> Mapping[str, object]:
        """Per-GPU state and last values for /status, keyed by PCI bus id."""
        gpus: dict[str, object] = {}
        for gpu in self._gpus:
            ident, reading = gpu.identity, gpu.reading
            gpus[ident.pci_bus_id if ident else f"gpu{gpu.index}"] = {
                "gpu": gpu.index,
                "uuid": ident.uuid if ident else "",
                "name": ident.name if ident else "",
                "serial": ident.serial if ident else "",
                "minor": ident.minor if ident else None,
                "state": gpu.state,
                "processes": sorted_processes(reading.processes) if reading else [],
                "last": dict(reading.last) if reading else {},
                "unsupported": dict(reading.unsupported) if reading else {},
                "errors": dict(sorted(gpu.errors.items())),
            }
        return {
            "gpus": gpus,
            "visible": self._visible,
            "driver": self._versions.get("driver_version"),
            "nvml_version": self._versions.get("nvml_version"),
            "cuda_version": _cuda_version(self._versions.get("cuda_driver_version")) or None,
            "init_error": self._init_error,
            "topology": self._topology.as_json() if self._topology else None,
        }

    def inventory(self) -> GpuInventory:
        """The GPUs of the last poll, typed (the runner publishes it on the snapshot)."""
        return self._inventory

    payload = inventory

    def gpu_map(self) -> Mapping[str, Mapping[str, str]]:
        """PCI bus id -> {gpu, uuid, name, minor, state} as of the last poll (thread-safe)."""
        return self._gpu_map

    def open_xid_events(self) -> XidEventSet | None:
        """Register for NVML Xid events on every GPU read so far; None before init.

        The returned set's `wait()` blocks, so call it from a thread of its own.
        """
        if not self._ready:
            return None
        devices: list[NvmlDevice] = [d for g in self._gpus if (d := g.reader.device) is not None]
        return self._deadline.call("nvml", partial(self.client.xid_events, devices), self._timeout)

    def close(self) -> None:
        """Shut NVML down (best effort, bounded) and stop the worker threads."""
        if self._xid_listener is not None:
            self._xid_listener.close()
            self._xid_listener = None
        for gpu in self._gpus:
            try:
                self._deadline.call(gpu.key, gpu.reader.release, min(self._timeout, 1.0))
            except Exception as exc:
                log.debug("gpu %d: releasing the handle: %s", gpu.index, exc)
        if self._ready:
            try:
                self._deadline.call("nvml", self.client.shutdown, min(self._timeout, 1.0))
            except Exception as exc:
                log.debug("nvmlShutdown: %s", exc)
            self._ready = False
        self._deadline.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _links_up(reading: Reading | None) -> int:
    """The GPU's NVLinks up at its last poll."""
    samples = reading.samples if reading is not None else ()
    return sum(1 for s in samples if s.name == "gpuwatchd_nvlink_up" and s.value == 1)


def _cuda_version(value: object) -> str:
    """13000 -> "13.0" (nvmlSystemGetCudaDriverVersion encodes major*1000 + minor*10)."""
    if not isinstance(value, int) or value <= 0:
        return ""
    return f"{value // 1000}.{value % 1000 // 10}"
