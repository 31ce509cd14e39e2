"""Memory pressure of the node (PSI) and of the memory cgroups GPU processes run in.

A job that runs out of memory does not always die of the OOM killer: reclaim and
swap can stall its ranks for seconds at a time (PSI `full`: every task waiting on
memory), and a memory cgroup at its limit fails allocations (memory.events `oom`).
Each poll reads /proc/pressure/memory and, for the cgroup v2 group of every
process NVML lists on a GPU, that group's memory.events and memory.pressure. It
publishes the node's figures as metrics (bounded labels); what happens in a job's
group goes out as an event (its path and pids on it, never on a metric label).

A kernel without PSI (CONFIG_PSI off, or booted with psi=0) has no
/proc/pressure or cannot read it: `gpuwatchd_memory_pressure_available` reads 0
and /status says why. A node without cgroup v2 (v1 only) reads no job groups.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gpuwatchd.model import Event, GpuInventory, MetricSpec, Sample, Severity
from gpuwatchd.sources.memory.psi import Pressure, parse_events, parse_pressure, v2_path

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.sources.context import SourceContext

__all__ = ["EVENT", "METRICS", "MemorySource"]

log = logging.getLogger("gpuwatchd.memory")

EVENT = "memory_pressure"
WINDOWS = (("10s", "avg10"), ("60s", "avg60"), ("300s", "avg300"))
OOM_KEYS = ("oom", "oom_kill")
MAX_CGROUPS = 64  # bounded: groups of GPU processes watched at once
MAX_PIDS = 256  # and the GPU processes remembered per group (a rank killed stays named)

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_memory_pressure_available",
        "gauge",
        "1 if the kernel's memory pressure (PSI, /proc/pressure/memory) is readable; 0 where"
        " the kernel has none (CONFIG_PSI off, or booted with psi=0).",
    ),
    MetricSpec(
        "gpuwatchd_memory_pressure_ratio",
        "gauge",
        "Share of time tasks stalled on memory over the window (PSI avgN / 100): kind some"
        " (at least one task), full (every non-idle task at once).",
        ("kind", "window"),
    ),
    MetricSpec(
        "gpuwatchd_memory_pressure_stalled_seconds_total",
        "counter",
        "Time tasks stalled on memory since boot (PSI total), by kind (some, full).",
        ("kind",),
    ),
    MetricSpec(
        "gpuwatchd_memory_job_cgroups",
        "gauge",
        "cgroup v2 memory groups of GPU processes read at the last poll.",
    ),
    MetricSpec(
        "gpuwatchd_memory_job_cgroup_events_total",
        "counter",
        "Rises of memory.events in the groups of GPU processes seen since the daemon started:"
        " event oom (a group at its limit, an allocation about to fail), oom_kill.",
        ("event",),
    ),
)


class MemorySource:
    """PSI of the node; memory.events and memory.pressure of the GPU processes' groups."""

    name = "memory"

    def __init__(
        self,
        procfs: str,
        cgroupfs: str,
        gpus: Callable[[], GpuInventory] = GpuInventory,
        *,
        interval: float = 10.0,
        full_ratio: float = 0.10,
        job_cgroups: bool = True,
    ) -> None:
        self.interval = interval
        self._procfs = procfs
        self._cgroupfs = cgroupfs
        self._gpus = gpus
        self._full_ratio = full_ratio
        self._job_cgroups = job_cgroups
        self._high: dict[str, bool] = {}  # "" (the node) or a group -> full pressure held
        self._events: dict[str, dict[str, int]] = {}  # group -> its last memory.events
        self._pids: dict[str, dict[int, None]] = {}  # group -> GPU processes seen in it
        self._risen = dict.fromkeys(OOM_KEYS, 0)
        self._status: dict[str, object] = {}

    @classmethod
    def from_config(cls, cfg: Config, ctx: SourceContext) -> MemorySource:
        """Build from sources.memory and paths.*."""
        c = cfg.sources.memory
        return cls(
            cfg.paths.procfs,
            cfg.paths.cgroupfs,
            ctx.gpus,
            interval=c.interval,
            full_ratio=c.full_pressure_ratio,
            job_cgroups=c.job_cgroups,
        )

    def poll(self, now: float) -> Sequence[Sample | Event]:
        out: list[Sample | Event] = []
        node, why = self._node_pressure()
        out.append(Sample.of("gpuwatchd_memory_pressure_available", 1 if node else 0))
        for kind, p in node.items():
            for window, field in WINDOWS:
                out.append(
                    Sample.of(
                        "gpuwatchd_memory_pressure_ratio",
                        getattr(p, field),
                        kind=kind,
                        window=window,
                    )
                )
            out.append(
                Sample.of(
                    "gpuwatchd_memory_pressure_stalled_seconds_total", p.total_seconds, kind=kind
                )
            )
        out += self._pressure_event("", node, now, "/proc/pressure/memory")
        groups, cg_why = self._groups() if self._job_cgroups else ({}, "job_cgroups off")
        for group, pids in groups.items():
            out += self._group(group, pids, now)
        out.append(Sample.of("gpuwatchd_memory_job_cgroups", len(groups)))
        out += [
            Sample.of("gpuwatchd_memory_job_cgroup_events_total", n, event=k)
            for k, n in self._risen.items()
        ]
        self._status = {
            "pressure": {k: p.avg10 for k, p in node.items()} or why,
            "job_cgroups": sorted(groups) if groups else cg_why,
        }
        return out

    def status(self) -> Mapping[str, object]:
        return self._status

    def close(self) -> None:
        pass

    # --- the node -----------------------------------------------------------------

    def _node_pressure(self) -> tuple[dict[str, Pressure], str]:
        path = os.path.join(self._procfs, "pressure", "memory")
        try:
            with open(path) as f:
                return parse_pressure(f.read()), ""
        except OSError as e:
            # absent: CONFIG_PSI off; EOPNOTSUPP: built in but booted with psi=0
            off = e.errno in (errno.ENOENT, errno.EOPNOTSUPP)
            why = "no PSI in this kernel (CONFIG_PSI off or psi=0)" if off else e.strerror
            if self._status.get("pressure") != why:
                log.info("memory pressure not read: %s: %s", path, why)
            return {}, why or "unreadable"

    def _pressure_event(
        self, group: str, psi: Mapping[str, Pressure], now: float, path: str
    ) -> list[Event]:
        """An event when `full` pressure rises to the threshold (again after it fell)."""
        full = psi.get("full")
        if full is None:
            return []
        was = self._high.get(group, False)
        high = full.avg10 >= self._full_ratio or (was and full.avg10 >= self._full_ratio / 2)
        self._high[group] = high
        if not high or was:
            return []
        some = psi.get("some")
        where = f"in memory cgroup {group}" if group else "on the node"
        msg = (
            f"memory pressure {where}: every task stalled on memory"
            f" {100 * full.avg10:.0f} % of the last 10 s"
            + (f" (some: {100 * some.avg10:.0f} %)" if some is not None else "")
        )
        return [self._event(group, msg, now, f"{path} full avg10={100 * full.avg10:.2f}")]

    # --- the GPU processes' groups ----------------------------------------------------

    def _groups(self) -> tuple[dict[str, tuple[int, ...]], str]:
        """group -> the GPU processes seen in it (kept while the group exists)."""
        for g in self._gpus():
            for p in g.processes:
                try:
                    with open(os.path.join(self._procfs, str(p.pid), "cgroup")) as f:
                        group = v2_path(f.read())
                except OSError:
                    continue  # gone: its group stays known by its other pids, or is forgotten
                if group is not None and (group in self._pids or len(self._pids) < MAX_CGROUPS):
                    seen = self._pids.setdefault(group, {})
                    seen.pop(p.pid, None)
                    seen[p.pid] = None  # the newest last; a group keeps its latest pids
                    while len(seen) > MAX_PIDS:
                        del seen[next(iter(seen))]
        for group in list(self._pids):
            if not os.path.exists(self._file(group, "memory.events")):
                del self._pids[group]
                self._events.pop(group, None)
                self._high.pop(group, None)
        if not self._pids:
            return {}, "no cgroup v2 memory group of a GPU process"
        return {g: tuple(sorted(p)) for g, p in self._pids.items()}, ""

    def _file(self, group: str, name: str) -> str:
        return os.path.join(self._cgroupfs, group.lstrip("/"), name)

    def _group(self, group: str, pids: tuple[int, ...], now: float) -> list[Event]:
        out: list[Event] = []
        try:
            with open(self._file(group, "memory.events")) as f:
                counts = parse_events(f.read())
        except OSError:
            return out
        before = self._events.get(group)
        self._events[group] = counts
        for key in OOM_KEYS:
            old, new = (before or {}).get(key), counts.get(key)
            if before is None or old is None or new is None or new <= old:
                continue  # the first reading is the past: nothing to say about it
            self._risen[key] += new - old
            what = "hit its memory limit" if key == "oom" else "had a process OOM-killed"
            msg = f"memory cgroup {group} {what} (memory.events {key} {old}->{new})"
            out.append(self._event(group, msg, now, f"memory.events {key} {new}", pids))
        try:
            with open(self._file(group, "memory.pressure")) as f:
                psi = parse_pressure(f.read())
        except OSError:
            return out
        return out + self._pressure_event(group, psi, now, f"{group}/memory.pressure")

    def _event(
        self, group: str, msg: str, now: float, raw: str, pids: tuple[int, ...] = ()
    ) -> Event:
        attrs = [("scope", "cgroup" if group else "node"), ("raw", raw)]
        if group:
            attrs += [
                ("cgroup", group),
                ("pids", ",".join(map(str, sorted(pids or self._pids.get(group, {}))))),
            ]
        return Event(
            kind=EVENT,
            source=self.name,
            time=now,
            message=msg,
            severity=Severity.WARNING,
            attrs=tuple(attrs),
        )
