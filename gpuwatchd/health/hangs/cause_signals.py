"""What broke on the node, as the sources already publish it: the hang join's inputs.

`SignalReader` runs on the consumer thread beside the hang monitor. It reads
the events of each publish (the kernel's process kills, Xid and SXid reports)
and the samples of the NVML, InfiniBand, AER and /dev/shm sources, keeps the
previous value of the few series it watches, and turns a change that can stop
a job (a counter that rose, a link that went down, a state that left ACTIVE)
into a `NodeSignal`: what, where, when, and which GPUs (by index) it is near.
It reads no hardware: a signal is what a source already published.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwatchd.health.incident import xid_incident
from gpuwatchd.health.xid.catalog import lookup as xid_lookup
from gpuwatchd.model import KILL_KINDS, Event, GpuInventory, Sample, SourceSnapshot
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.ports import STATE_ACTIVE

__all__ = ["CAUSE_KINDS", "LOOKED_AT", "NodeSignal", "SignalReader", "xid_kind"]

# Cause classes, strongest first: a join ranks by this order, then by time.
CAUSE_KINDS = (
    "oom_kill",  # the kernel's OOM killer killed a rank
    "segfault",  # a rank died of SIGSEGV
    "trap",  # a rank died of another fault (invalid opcode, general protection...)
    "gpu_lost",  # the GPU fell off the bus (Xid 79, NVML: GPU lost)
    "ecc_uncorrectable",  # uncorrectable ECC (Xid 48, 94, 95; the volatile counter rose)
    "row_remap_failure",  # a row remap failed (Xid 64; NVML's flag)
    "xid",  # another Xid or SXid on the GPU or from the rank's pid
    "nvlink",  # an NVLink link down, or its error counters rising in a burst
    "infiniband",  # a nearby port left ACTIVE, flapped, lost rate, or counted link errors
    "pcie",  # AER fatal/non-fatal on the GPU's PCIe path, or its link width dropped
    "hung_task",  # a rank blocked in the kernel (D state) past the hung-task limit
    "shm_full",  # /dev/shm full: NCCL's shared-memory transport cannot allocate
    "memory_pressure",  # the node or the rank's memory cgroup stalls on memory, or hit its limit
    "thermal",  # a thermal or power-brake slowdown of the rank's GPU
)
# What the join looked at, by the source that feeds it (for "no cause seen on this node").
LOOKED_AT: Mapping[str, str] = {
    "kmsg": "kernel log (OOM kills, segfaults, traps, hung tasks, Xid/SXid)",
    "nvml": "NVML (GPU lost, uncorrectable ECC, row-remap failure, NVLink, PCIe width, "
    "thermal/power slowdown)",
    "infiniband": "InfiniBand/RoCE ports near the GPUs (state, rate, link_downed, symbol_error)",
    "aer": "PCIe AER of the GPUs, their NICs and bridges up to the root port",
    "shm": "/dev/shm",
    "memory": "memory pressure (PSI) of the node and of the ranks' memory cgroups",
}
XID_KINDS = {79: "gpu_lost", 48: "ecc_uncorrectable", 94: "ecc_uncorrectable"}
XID_KINDS |= {95: "ecc_uncorrectable", 64: "row_remap_failure", 74: "nvlink"}
SLOWDOWNS = frozenset({"hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"})
NVLINK_BURST = 100  # data-link errors of one link between two polls that make a burst
IB_SYMBOL_BURST = 10  # symbol errors between two polls (a healthy link counts a few a day)
SHM_FULL_RATIO = 0.02  # /dev/shm available under this share of its size: full
NEAR = ("pcie_switch", "host_bridge")  # a NIC NCCL would use for the GPU; not NUMA-only
MAX_SIGNALS = 2048  # bounded: the oldest go first
SAME_REPORT_SECONDS = 10.0  # two witnesses of one Xid (NVML and the kernel log) this close


@dataclass(frozen=True, slots=True)
class NodeSignal:
    """One thing that broke, as a source published it."""

    kind: str  # one of CAUSE_KINDS
    what: str  # "killed by the OOM killer of its memory cgroup /kubepods/pod-x"
    where: str  # "GPU 1 (0000:06:00.0)", "mlx5_0 port 1", "pid 4242"
    time: float
    gpus: frozenset[str] = frozenset()  # GPU indexes it is near; empty with pid or node_wide
    gpu: str = ""  # the GPU it happened on, when on one (an NVLink peer's link: the peer)
    pid: int | None = None  # the process it is about (kills; an Xid's pid)
    pids: frozenset[int] = frozenset()  # the processes of the memory cgroup it is about
    node_wide: bool = False  # touches every rank (/dev/shm)
    evidence: str = ""  # the kernel line, or the counter's values
    incident: str = ""  # the `incident` label of the alert it shares (Xids)
    nvml_event: bool = False  # an Xid from NVML's event API (the kernel log reports it too)
    own_process: bool = False  # an application Xid: about its pid's own work, no one else's


def xid_kind(code: int) -> str:
    """The cause class of an Xid code."""
    return XID_KINDS.get(code, "xid")


class SignalReader:
    """Signals from the publishes the consumer sees; the maps that place them near GPUs."""

    def __init__(self) -> None:
        self.signals: list[NodeSignal] = []
        self.sources: set[str] = set()  # sources seen so far (what was looked at)
        self._gpu_of_bus: dict[str, str] = {}
        self._peers: dict[str, frozenset[str]] = {}  # GPU index -> its NVLink peers
        self._nic_gpus: dict[str, frozenset[str]] = {}  # RDMA device -> GPU indexes near
        self._pci_gpus: dict[str, frozenset[str]] = {}  # AER function -> GPUs at or below
        self._pci_role: dict[str, str] = {}
        self._prev: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._stamps: dict[str, float] = {}

    # --- inputs -------------------------------------------------------------------

    def note_inventory(self, inv: GpuInventory) -> None:
        """GPU index <-> bus id, and NVLink peers from the topology when read."""
        for g in inv:
            if g.pci_bus_id:
                self._gpu_of_bus[g.pci_bus_id] = str(g.index)
        if inv.topology is not None:
            for place in inv.topology.gpus:
                near = {str(i) for i, rel in place.peers if rel.startswith("NV")}
                self._peers[str(place.index)] = frozenset(near)
                for nic, _rel in place.nics:
                    self._nic_gpus[nic] = self._nic_gpus.get(nic, frozenset()) | {str(place.index)}

    def note_events(self, events: Iterable[Event]) -> None:
        """Kills, Xids and SXids of a publish."""
        for ev in events:
            sig = self._of_event(ev)
            if sig is not None and self._first_report(sig):
                self._add(sig)
            if ev.source in ("kmsg", "memory"):
                self.sources.add(ev.source)

    def note_source(self, src: SourceSnapshot) -> None:
        """One source's new poll: its watched series against their previous values."""
        name = src.source
        if name not in ("nvml", "infiniband", "aer", "shm", "kmsg", "memory") or not src.ok:
            return
        self.sources.add(name)
        if self._stamps.get(name) == src.timestamp or name in ("kmsg", "memory"):
            return
        self._stamps[name] = src.timestamp
        if name == "nvml" and src.inventory is not None:
            self.note_inventory(src.inventory)
        if name == "infiniband":
            self._note_affinity(src.samples)
        if name == "aer":
            self._note_pci(src.samples)
        read = {"nvml": self._nvml, "infiniband": self._ib, "aer": self._aer, "shm": self._shm}
        read[name](src.samples, src.timestamp)

    def forget(self, before: float) -> None:
        """Drop signals older than `before` (and past the bound)."""
        self.signals = [s for s in self.signals if s.time >= before][-MAX_SIGNALS:]

    def near(self, gpu: str) -> frozenset[str]:
        """The GPU and its NVLink peers."""
        return self._peers.get(gpu, frozenset()) | {gpu}

    def gpu_label(self, gpu: str) -> str:
        bus = next((b for b, g in self._gpu_of_bus.items() if g == gpu), "")
        return f"GPU {gpu} ({bus})" if bus else f"GPU {gpu}"

    # --- events -------------------------------------------------------------------

    def _of_event(self, ev: Event) -> NodeSignal | None:
        if ev.kind in KILL_KINDS:
            k = ev.kill
            if k is None:
                return None
            return NodeSignal(
                kind=ev.kind,
                what=_kill_text(ev),
                where=f"pid {k.pid}",
                time=ev.time,
                pid=k.pid,
                evidence=ev.attr("raw") or ev.message,
            )
        if ev.kind == "memory_pressure":  # the memory source decided it (events only)
            group = ev.attr("cgroup")
            pids = frozenset(int(p) for p in ev.attr("pids").split(",") if p.isdigit())
            return NodeSignal(
                kind="memory_pressure",
                what=ev.message,
                where="",  # the message names the group or the node
                time=ev.time,
                pids=pids,
                node_wide=not group,
                evidence=ev.attr("raw") or ev.message,
            )
        if ev.kind not in ("xid", "sxid") or ev.code is None:
            return None
        bus = normalize_bus_id(ev.pci_bus_id) if ev.pci_bus_id else ""
        gpu = self._gpu_of_bus.get(bus, "")
        pid = ev.attr("pid")
        kind = xid_kind(ev.code) if ev.kind == "xid" else "xid"
        return NodeSignal(
            kind=kind,
            what=f"{'SXid' if ev.kind == 'sxid' else 'Xid'} {ev.code}"
            + (f" ({ev.message})" if ev.message else ""),
            where=self.gpu_label(gpu) if gpu else (bus or "an NVSwitch"),
            time=ev.time,
            gpus=frozenset({gpu}) if gpu else frozenset(),
            gpu=gpu,
            pid=int(pid) if pid.isdigit() else None,
            node_wide=ev.kind == "sxid",  # an NVSwitch error reaches every GPU of the fabric
            evidence=ev.attr("raw") or ev.message,
            incident=xid_incident(bus, ev.code),
            nvml_event=ev.source == "nvml",
            own_process=ev.kind == "xid" and xid_lookup(ev.code).category == "application",
        )

    # --- samples ------------------------------------------------------------------

    def _change(self, s: Sample) -> tuple[float | None, float]:
        """(previous value or None, value) of a watched series; remembers the value."""
        key = (s.name, s.labels)
        before = self._prev.get(key)
        self._prev[key] = s.value
        return before, s.value

    def _nvml(self, samples: Iterable[Sample], t: float) -> None:
        for s in samples:
            n = s.name
            if not n.startswith(("gpuwatchd_gpu_", "gpuwatchd_nvlink_")):
                continue
            gpu = s.label("gpu")
            kind, what = "", ""
            if n == "gpuwatchd_gpu_nvml_state":
                before, now = self._change(s)
                if now == 2 and before is not None and before != 2:
                    kind, what = "gpu_lost", "GPU lost (NVML: fallen off the bus)"
            elif n == "gpuwatchd_gpu_ecc_errors_total":
                if (s.label("error"), s.label("scope")) != ("uncorrected", "volatile"):
                    continue
                before, now = self._change(s)
                if before is not None and now > before:
                    kind, what = (
                        "ecc_uncorrectable",
                        f"uncorrectable ECC errors {before:g}->{now:g}",
                    )
            elif n == "gpuwatchd_gpu_row_remap_failure":
                before, now = self._change(s)
                if before == 0 and now >= 1:
                    kind, what = "row_remap_failure", "row remap failed"
            elif n == "gpuwatchd_nvlink_up":
                before, now = self._change(s)
                if before == 1 and now == 0:
                    kind, what = "nvlink", f"NVLink link {s.label('link')} down"
            elif n == "gpuwatchd_nvlink_errors_total":
                before, now = self._change(s)
                if before is not None and now - before >= NVLINK_BURST:
                    err = s.label("error")
                    what = f"NVLink link {s.label('link')} {err} errors {before:g}->{now:g}"
                    kind = "nvlink"
            elif n == "gpuwatchd_gpu_pcie_link_width" and s.label("which") == "current":
                before, now = self._change(s)
                if before is not None and 0 < now < before:
                    kind, what = "pcie", f"PCIe link width x{before:g}->x{now:g}"
            elif n == "gpuwatchd_gpu_clock_event_active" and s.label("reason") in SLOWDOWNS:
                before, now = self._change(s)
                if before == 0 and now == 1:
                    kind, what = "thermal", s.label("reason").replace("_", " ")
            if kind:
                where = self.gpu_label(gpu)
                near = self.near(gpu) if kind == "nvlink" else frozenset({gpu})
                self._add(NodeSignal(kind, what, where, t, near, gpu=gpu, evidence=_ev(s)))

    def _note_affinity(self, samples: Iterable[Sample]) -> None:
        near: dict[str, set[str]] = {}
        for s in samples:
            if s.name == "gpuwatchd_infiniband_gpu_affinity_info" and s.label("affinity") in NEAR:
                near.setdefault(s.label("device"), set()).add(s.label("gpu"))
        for dev, gpus in near.items():
            self._nic_gpus[dev] = frozenset(gpus)

    def _ib(self, samples: Iterable[Sample], t: float) -> None:
        for s in samples:
            n = s.name
            what = ""
            if n == "gpuwatchd_infiniband_state_id":
                before, now = self._change(s)
                if before == STATE_ACTIVE and now != STATE_ACTIVE:
                    what = f"port left ACTIVE (state {now:g})"
                elif before is not None and before != STATE_ACTIVE and now == STATE_ACTIVE:
                    what = "port flapped (back to ACTIVE)"
            elif n == "gpuwatchd_infiniband_rate_bytes_per_second":
                before, now = self._change(s)
                if before is not None and now < before:
                    what = f"rate dropped {before * 8e-9:g}->{now * 8e-9:g} Gb/s"
            elif n == "gpuwatchd_infiniband_link_downed_total":
                before, now = self._change(s)
                if before is not None and now > before:
                    what = f"link_downed {before:g}->{now:g}"
            elif n == "gpuwatchd_infiniband_symbol_error_total":
                before, now = self._change(s)
                if before is not None and now - before >= IB_SYMBOL_BURST:
                    what = f"symbol_error {before:g}->{now:g}"
            if what:
                dev = s.label("device")
                gpus = self._nic_gpus.get(dev, frozenset())
                where = f"{dev} port {s.label('port')}"
                if gpus:
                    where += f" (near GPU {','.join(sorted(gpus))})"
                self._add(NodeSignal("infiniband", what, where, t, gpus, evidence=_ev(s)))

    def _note_pci(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            if s.name == "gpuwatchd_pcie_aer_device_info":
                bus = s.label("pci_bus_id")
                self._pci_gpus[bus] = frozenset(g for g in s.label("gpus").split(",") if g)
                self._pci_role[bus] = s.label("role")

    def _aer(self, samples: Iterable[Sample], t: float) -> None:
        for s in samples:
            if s.name != "gpuwatchd_pcie_aer_errors_total":
                continue
            if s.label("severity") not in ("fatal", "nonfatal"):
                continue
            before, now = self._change(s)
            if before is None or now <= before:
                continue
            bus = s.label("pci_bus_id")
            role = self._pci_role.get(bus, s.label("role"))
            what = f"PCIe AER {s.label('severity')} errors {before:g}->{now:g}"
            gpus = self._pci_gpus.get(bus, frozenset())
            self._add(NodeSignal("pcie", what, f"{bus} ({role})", t, gpus, evidence=_ev(s)))

    def _shm(self, samples: Iterable[Sample], t: float) -> None:
        vals = {s.name: s for s in samples if not s.labels}
        size, avail = (
            vals.get("gpuwatchd_shm_size_bytes"),
            vals.get("gpuwatchd_shm_available_bytes"),
        )
        if size is None or avail is None or size.value <= 0:
            return
        full = avail.value < size.value * SHM_FULL_RATIO
        key = ("shm_full", ())
        was = self._prev.get(key)
        self._prev[key] = float(full)
        if full and was != 1.0:
            left, total = avail.value / 2**20, size.value / 2**30
            what = f"/dev/shm full ({left:.0f} MiB of {total:.1f} GiB left)"
            self._add(NodeSignal("shm_full", what, "", t, node_wide=True))

    def _first_report(self, sig: NodeSignal) -> bool:
        """Whether `sig` is new, not a second witness of an Xid already held.

        NVML's event API and the kernel log each report the same Xid (measured on H200:
        the incident listed it twice). The log's copy carries the line and the pid, so
        it replaces NVML's; any later copy of the same incident adds nothing."""
        if not sig.incident:
            return True
        for i, old in enumerate(self.signals):
            if old.incident == sig.incident and abs(old.time - sig.time) <= SAME_REPORT_SECONDS:
                if old.nvml_event and not sig.nvml_event:
                    self.signals[i] = sig
                return False
        return True

    def _add(self, sig: NodeSignal) -> None:
        self.signals.append(sig)
        if len(self.signals) > MAX_SIGNALS:
            del self.signals[: len(self.signals) - MAX_SIGNALS]


def _ev(s: Sample) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in s.labels)
    return f"{s.name}{{{labels}}} {s.value:g}"


def _kill_text(ev: Event) -> str:
    k = ev.kill
    assert k is not None
    if k.kind == "oom_kill":
        what = "killed by the OOM killer"
        cg = k.limit_cgroup or k.cgroup
        if k.memcg:
            what += f" (memory cgroup {cg})" if cg else " (its memory cgroup's limit)"
        elif k.memcg is False:
            what += " (the node ran out of memory)"
        return what
    if k.kind == "hung_task":
        secs = f" for more than {k.blocked_seconds} s" if k.blocked_seconds is not None else ""
        return f"blocked in the kernel (hung task){secs}"
    fault = k.fault or ("segfault" if k.kind == "segfault" else "trap")
    where = f" in {k.object}" if k.object else ""
    at = f" at {k.address}" if k.address else ""
    return f"crashed ({fault}{at}{where}, {k.signal or 'fatal signal'})"
