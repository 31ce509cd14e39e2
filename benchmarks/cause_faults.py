"""The node events the hang-cause benchmark injects, from real kernel lines and sysfs trees.

One `NodeFeed` per replayed job: it owns a copy of tests/fixtures/sys (the real
InfiniBand and PCIe AER sources poll it on their default intervals), the kernel
lines of tests/fixtures/kmsg (parsed by the kernel log source's own parsers),
and the NVML series the NVML source publishes for link state, row remapping and
clock events. `inject(kind, at)` schedules one fault of a cause class; `noise`
adds what healthy nodes show (corrected ECC, InfiniBand symbol errors at normal
rates, thermal slowdowns under load); `due(t)` returns the publishes a consumer
would see by time t, as (source snapshot, events).
"""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatchd.config import Config
from gpuwatchd.model import (
    Event,
    Gpu,
    GpuInventory,
    GpuPlace,
    GpuProcess,
    Sample,
    SourceSnapshot,
    Topology,
)
from gpuwatchd.sources.aer.source import AerSource
from gpuwatchd.sources.infiniband.source import InfinibandSource
from gpuwatchd.sources.kmsg.parse import parse_line
from gpuwatchd.sources.kmsg.process_kills import KillParser, to_event
from gpuwatchd.sources.memory.source import MemorySource

ROOT = Path(__file__).resolve().parent.parent
KMSG = ROOT / "tests" / "fixtures" / "kmsg"
SYS = ROOT / "tests" / "fixtures" / "sys"
# tests/fixtures/sys: GPU 0 and GPU 1 share a PCIe switch with mlx5_0 (PROVENANCE.md);
# the target rank's GPU is put there, the job's other GPUs on the other switches.
NEAR_BUS = "0000:19:00.0"
FAR_BUSES = ("0000:3b:00.0", "0000:9d:00.0", "0000:1b:00.0")
SWITCH_PORT = SYS / "devices/pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:00.0"
IB_PORT = SYS / "devices/pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:01.0/0000:1a:00.0"
IB_PORT = IB_PORT / "infiniband/mlx5_0/ports/1"
_CFG = Config().sources
INTERVALS = {
    "kmsg": 0.5,  # the kernel log reader publishes about twice a second
    "nvml": _CFG.nvml.interval,
    "infiniband": _CFG.infiniband.interval,
    "aer": _CFG.aer.interval,
    "shm": _CFG.shm.interval,
    "memory": _CFG.memory.interval,
}
# The memory files in the kernel's formats (Documentation/accounting/psi.rst; cgroup v2's
# memory.events keys): a quiet node, and a pod's group thrashing at its memory.max.
PSI_QUIET = (
    "some avg10=0.00 avg60=0.00 avg300=0.00 total={}\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total={}\n"
)
PSI_THRASH = (
    "some avg10=71.32 avg60=40.18 avg300=12.05 total={}\n"
    "full avg10=52.77 avg60=30.02 avg300=8.93 total={}\n"
)
MEMORY_EVENTS = "low 0\nhigh {high}\nmax {max}\noom 0\noom_kill 0\noom_group_kill 0\n"
POD_GROUP = (
    "/kubepods.slice/kubepods-burstable.slice/"
    "kubepods-burstable-pod0d8f5a4e_2c1b_4f6e_9a7d_3b5c8e1f2a60.slice/"
    "cri-containerd-4f1d2c3b5a6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c1b2a3f4e5d6c7b8a9f0e1d2c.scope"
)


def kernel_line(name: str, index: int) -> str:
    """Line `index` of the kernel log fixture `name`."""
    return (KMSG / name).read_text().splitlines()[index]


# (fixture, line index, pattern of the pid or bus in it): real kernel lines, their pid
# or PCI address replaced by the replayed rank's
KILL_LINES = {
    "oom_kill": ("oom-kill-memcg.txt", 0, r"(?<=Killed process )\d+"),
    "segfault": ("segfault.txt", 2, r"(?<=python\[)\d+"),
    "trap": ("traps.txt", 1, r"(?<=dmesg\[)\d+"),
    "hung_task": ("hung-task.txt", 0, r"(?<=:)\d+(?= blocked)"),
}
# the OOM killer's `oom-kill:` line before its kill line: the memory cgroup (a pod's)
KILL_CONTEXT = {"oom_kill": ("oom-kill-memcg.txt", 3, r"(?<=,pid=)\d+")}
XID_LINES = {
    "gpu_lost": ("fallen-off-bus-single.txt", 0),  # Xid 79
    "ecc_uncorrectable": ("nvlink5-xid144-150.txt", None),  # Xid 94, contained ECC
    "xid": ("h200-xid31-kmsg.txt", None),  # Xid 31, MMU fault
}
CLASSES = (
    "oom_kill",
    "segfault",
    "trap",
    "hung_task",
    "gpu_lost",
    "ecc_uncorrectable",
    "row_remap_failure",
    "xid",
    "nvlink",
    "infiniband",
    "pcie",
    "shm_full",
    "memory_pressure",
    "thermal",
)
PID_CLASSES = frozenset({"oom_kill", "segfault", "trap", "hung_task"})


def xid_line(kind: str) -> str:
    name, index = XID_LINES[kind]
    lines = (KMSG / name).read_text().splitlines()
    if index is not None:
        return lines[index]
    code = {"ecc_uncorrectable": "94", "xid": "31"}[kind]
    return next(s for s in lines if re.search(rf"Xid \(PCI:[^)]*\): {code},", s))


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    source: SourceSnapshot | None = field(compare=False, default=None)
    events: tuple[Event, ...] = field(compare=False, default=())
    action: Callable[[], object] | None = field(compare=False, default=None)


class NodeFeed:
    """The node around one replayed job: sources on their intervals, faults, noise."""

    def __init__(
        self,
        tmp: Path,
        gpus: list[int],
        target_gpu: int,
        start: float,
        rng: random.Random,
    ) -> None:
        self.sys = tmp / "sys"
        if not self.sys.exists():
            shutil.copytree(SYS, self.sys, symlinks=True)
        self.rng = rng
        far = iter(FAR_BUSES)
        self.bus = {g: NEAR_BUS if g == target_gpu else next(far) for g in gpus}
        self.gpus = gpus
        self.target_gpu = target_gpu
        inv = GpuInventory(tuple(Gpu(index=g, pci_bus_id=b) for g, b in self.bus.items()))
        self.ib = InfinibandSource(str(self.sys), gpus=lambda: inv)
        self.aer = AerSource(str(self.sys), gpus=lambda: inv)
        self.kills = KillParser()
        self._queue: list[_Due] = []
        self._seq = 0
        self._nvml: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._shm_avail = 48 * 2**30
        self.phase = {s: rng.uniform(0, i) for s, i in INTERVALS.items()}
        self.start = start
        polled = ("nvml", "infiniband", "aer", "shm", "memory")
        self._next_poll = {s: start + self.phase[s] for s in polled}
        # memory: the node's PSI and the target rank's memory cgroup (once a fault names it)
        self.proc, self.cgroup = tmp / "mem" / "proc", tmp / "mem" / "cgroup"
        (self.proc / "pressure").mkdir(parents=True, exist_ok=True)
        (self.proc / "pressure" / "memory").write_text(PSI_QUIET.format(1_204_117, 310_552))
        self._mem_pids: list[int] = []
        self.memory = MemorySource(str(self.proc), str(self.cgroup), self._mem_inventory)
        # NVLink: every GPU of the board a peer of every other (NVSwitch), as on HGX
        places = tuple(
            GpuPlace(g, "", peers=tuple((o, "NV18") for o in range(8) if o != g)) for g in range(8)
        )
        self.topology = Topology(places)
        for g in range(8):
            for link in range(2):
                self._set("gpuwatchd_nvlink_up", 1, g, link=str(link))
            self._set("gpuwatchd_gpu_row_remap_failure", 0, g)
            self._set("gpuwatchd_gpu_ecc_errors_total", 0, g, error="corrected", scope="volatile")
            for reason in ("sw_thermal_slowdown", "hw_thermal_slowdown"):
                self._set("gpuwatchd_gpu_clock_event_active", 0, g, reason=reason)

    # --- faults ---------------------------------------------------------------------

    def inject(self, kind: str, at: float, pid: int) -> float:
        """Schedule one fault of `kind` at wall time `at`; returns when a source publishes it."""
        if kind in PID_CLASSES:
            if kind in KILL_CONTEXT:
                name, index, pattern = KILL_CONTEXT[kind]
                self.kills.feed(re.sub(pattern, str(pid), kernel_line(name, index)))
            name, index, pattern = KILL_LINES[kind]
            return self._kernel(re.sub(pattern, str(pid), kernel_line(name, index)), at)
        if kind in XID_LINES:
            bus = self.bus[self.target_gpu]
            line = re.sub(r"PCI:[0-9a-fA-F:]+\)", f"PCI:{bus[:-2]})", xid_line(kind))
            line = re.sub(r"pid=\d+", f"pid={pid}", line)
            return self._kernel(line, at)
        if kind == "row_remap_failure":
            self._later(
                at, lambda: self._set("gpuwatchd_gpu_row_remap_failure", 1, self.target_gpu)
            )
            return self._poll_after("nvml", at)
        if kind == "nvlink":  # a link of an NVLink peer of the rank's GPU goes down
            peer = next(g for g in range(8) if g not in self.gpus)
            self._later(at, lambda: self._set("gpuwatchd_nvlink_up", 0, peer, link="1"))
            return self._poll_after("nvml", at)
        if kind == "thermal":
            gpu = self.target_gpu
            reason = "hw_thermal_slowdown"
            self._later(
                at, lambda: self._set("gpuwatchd_gpu_clock_event_active", 1, gpu, reason=reason)
            )
            return self._poll_after("nvml", at)
        if kind == "infiniband":
            self._later(at, self._ib_down)
            return self._poll_after("infiniband", at)
        if kind == "pcie":
            self._later(at, self._aer_fatal)
            return self._poll_after("aer", at)
        if kind == "shm_full":
            self._later(at, lambda: setattr(self, "_shm_avail", 0))
            return self._poll_after("shm", at)
        if kind == "memory_pressure":  # the rank's pod group thrashes at its limit
            group = self.cgroup / POD_GROUP.lstrip("/")
            group.mkdir(parents=True, exist_ok=True)
            (group / "memory.pressure").write_text(PSI_QUIET.format(88_410, 20_118))
            (group / "memory.events").write_text(MEMORY_EVENTS.format(high=0, max=0))
            (self.proc / str(pid)).mkdir(parents=True, exist_ok=True)
            (self.proc / str(pid) / "cgroup").write_text(f"0::{POD_GROUP}\n")
            self._mem_pids.append(pid)
            self._later(at, lambda: self._thrash(group))
            return self._poll_after("memory", at)
        raise ValueError(kind)

    def _mem_inventory(self) -> GpuInventory:
        procs = tuple(GpuProcess(pid=p) for p in self._mem_pids)
        bus = self.bus.get(self.target_gpu, "")
        return GpuInventory((Gpu(index=self.target_gpu, pci_bus_id=bus, processes=procs),))

    def _thrash(self, group: Path) -> None:
        (group / "memory.pressure").write_text(PSI_THRASH.format(19_842_500, 14_208_930))
        (group / "memory.events").write_text(MEMORY_EVENTS.format(high=0, max=2813))

    def _ib_down(self) -> None:
        port = self.sys / IB_PORT.relative_to(SYS)
        (port / "state").write_text("1: DOWN\n")
        (port / "phys_state").write_text("3: Disabled\n")
        downed = port / "counters" / "link_downed"
        downed.write_text(f"{int(downed.read_text()) + 1}\n")

    def _aer_fatal(self) -> None:
        path = self.sys / SWITCH_PORT.relative_to(SYS) / "aer_dev_fatal"
        text = path.read_text()
        text = re.sub(
            r"^(SDES|TOTAL_ERR_FATAL) (\d+)$", lambda m: f"{m[1]} {int(m[2]) + 1}", text, flags=re.M
        )
        path.write_text(text)

    # --- noise ----------------------------------------------------------------------

    def noise(self, until: float, load: bool = True) -> None:
        """Corrected ECC, InfiniBand symbol errors and (under load) thermal slowdowns."""
        t = self.start
        while True:
            t += self.rng.expovariate(1 / 600.0)  # a corrected ECC error every ~10 min a node
            if t >= until:
                break
            g = self.rng.choice(range(8))
            self._later(t, lambda g=g: self._bump("gpuwatchd_gpu_ecc_errors_total", g))
        t = self.start
        while True:
            t += self.rng.expovariate(1 / 1800.0)  # a symbol error every ~30 min a port
            if t >= until:
                break
            self._later(t, self._symbol_error)
        t = self.start
        while load:
            t += self.rng.expovariate(1 / 3600.0)  # a thermal slowdown an hour under load
            if t >= until:
                break
            g = self.rng.choice(range(8))
            self._later(t, lambda g=g: self._thermal(g, 1))
            self._later(t + 20.0, lambda g=g: self._thermal(g, 0))

    def _thermal(self, gpu: int, on: int) -> None:
        self._set("gpuwatchd_gpu_clock_event_active", on, gpu, reason="sw_thermal_slowdown")

    def _bump(self, name: str, gpu: int) -> None:
        key = self._key(name, gpu, error="corrected", scope="volatile")
        self._nvml[key] = self._nvml.get(key, 0) + 1

    def _symbol_error(self) -> None:
        path = self.sys / IB_PORT.relative_to(SYS) / "counters" / "symbol_error"
        path.write_text(f"{int(path.read_text()) + 1}\n")

    # --- delivery -------------------------------------------------------------------

    def due(self, t: float) -> list[tuple[SourceSnapshot | None, tuple[Event, ...]]]:
        """Every publish the consumer sees by `t`: source polls and kernel log events."""
        out: list[tuple[SourceSnapshot | None, tuple[Event, ...]]] = []
        while True:
            polls = [(at, s) for s, at in self._next_poll.items() if at <= t]
            actions = [d for d in self._queue if d.at <= t]
            if not polls and not actions:
                return out
            first_poll = min(polls)[0] if polls else float("inf")
            first_act = min(actions).at if actions else float("inf")
            if first_act <= first_poll:
                d = min(actions)
                self._queue.remove(d)
                if d.source is not None or d.events:
                    out.append((d.source, d.events))
                elif d.action is not None:
                    d.action()
                continue
            at, name = min(polls)
            self._next_poll[name] = at + INTERVALS[name]
            if name == "memory":
                got = self.memory.poll(at)
                samples = tuple(s for s in got if isinstance(s, Sample))
                events = tuple(e for e in got if isinstance(e, Event))
                out.append((SourceSnapshot("memory", samples, True, timestamp=at), events))
                continue
            out.append((self._poll(name, at), ()))

    def _poll(self, name: str, at: float) -> SourceSnapshot:
        if name == "nvml":
            samples = tuple(Sample(n, v, labels) for (n, labels), v in self._nvml.items())
            inv = GpuInventory(
                tuple(Gpu(index=g, pci_bus_id=b) for g, b in self.bus.items()), self.topology
            )
            return SourceSnapshot("nvml", samples, True, timestamp=at, payload=inv)
        if name == "shm":
            samples = (
                Sample.of("gpuwatchd_shm_size_bytes", 64 * 2**30),
                Sample.of("gpuwatchd_shm_available_bytes", self._shm_avail),
            )
            return SourceSnapshot("shm", samples, True, timestamp=at)
        src = self.ib if name == "infiniband" else self.aer
        got = tuple(s for s in src.poll(at) if isinstance(s, Sample))
        return SourceSnapshot(name, got, True, timestamp=at)

    def kernel(self, line: str, at: float) -> float:
        """A kernel log line logged at `at`; returns when the reader publishes it."""
        return self._kernel(line, at)

    def _kernel(self, line: str, at: float) -> float:
        seen = at + self.rng.uniform(0, INTERVALS["kmsg"])
        got = self.kills.feed(line)
        if got is not None:
            ev = to_event(got, at, 0.0, boot_times=False)
            self._push(_Due(seen, self._next(), None, (ev,)))
            return seen
        rec = parse_line(line)
        assert rec is not None and rec.code is not None, line
        pid = rec.pid
        attrs = (("pid", str(pid)),) if pid is not None else ()
        ev = Event(
            kind=rec.kind,
            source="kmsg",
            time=at,
            code=rec.code,
            pci_bus_id=rec.pci_bus_id,
            message=rec.detail,
            attrs=(*attrs, ("raw", rec.message[:2048])),
        )
        self._push(_Due(seen, self._next(), None, (ev,)))
        return seen

    def _poll_after(self, source: str, at: float) -> float:
        nxt = self._next_poll[source]
        step = INTERVALS[source]
        while nxt < at:
            nxt += step
        return nxt

    def _later(self, at: float, action: Callable[[], object]) -> None:
        self._push(_Due(at, self._next(), action=action))

    def _push(self, d: _Due) -> None:
        self._queue.append(d)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _key(self, name: str, gpu: int, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        s = Sample.of(name, 0, gpu=gpu, pci_bus_id=self.bus.get(gpu, ""), **labels)
        return (s.name, s.labels)

    def _set(self, name: str, value: float, gpu: int, **labels: str) -> None:
        self._nvml[self._key(name, gpu, **labels)] = value


def hgx_polls(tmp: Path) -> tuple[SourceSnapshot, SourceSnapshot]:
    """One NVML poll of the 8-GPU HGX capture (18 links a GPU) and one InfiniBand poll of
    8 ConnectX ports, by the real sources: what the cause memory reads on a big node."""
    import dataclasses

    from benchmarks.hgx import write_hgx
    from gpuwatchd.clock import FakeClock
    from gpuwatchd.pipeline import SourceSet
    from gpuwatchd.state import State

    capture, sysfs = write_hgx(tmp / "hgx")
    cfg = Config()
    cfg = dataclasses.replace(
        cfg,
        paths=dataclasses.replace(cfg.paths, sysfs=str(sysfs)),
        sources=dataclasses.replace(
            cfg.sources, nvml=dataclasses.replace(cfg.sources.nvml, replay=str(capture))
        ),
    )
    sources = SourceSet(cfg, State(), FakeClock())
    try:
        nvml = sources.runner.poll_once("nvml")
        ib = sources.runner.poll_once("infiniband")
    finally:
        sources.stop()
    return nvml, ib
