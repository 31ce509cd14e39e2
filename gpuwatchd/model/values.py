"""Value types passed between layers (all but the event and its payloads).

Everything here is immutable so a snapshot can be handed to any thread
without copying or locking.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from gpuwatchd.pci import normalize_bus_id

__all__ = [
    "Action",
    "Clear",
    "Finding",
    "Gpu",
    "GpuInventory",
    "GpuPlace",
    "GpuProcess",
    "Health",
    "KmsgState",
    "Labels",
    "MetricSpec",
    "MetricType",
    "Sample",
    "Severity",
    "SourcePayload",
    "SourceSnapshot",
    "Topology",
    "WORKLOAD_ALERT_LABELS",
    "Workload",
    "WorkloadProcess",
    "WorkloadSet",
    "labels_of",
]

MetricType = Literal["gauge", "counter", "info"]
Labels = tuple[tuple[str, str], ...]


def labels_of(mapping: Mapping[str, object] | Iterable[tuple[str, object]]) -> Labels:
    """Freeze a label mapping into the sorted tuple form samples carry."""
    items = mapping.items() if isinstance(mapping, Mapping) else mapping
    return tuple(sorted((str(k), str(v)) for k, v in items))


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """Name, type, help and label names of one exported metric family.

    Sources declare the families they produce; the Prometheus sink turns
    them into exposition. Counters carry the full name including `_total`.
    """

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading: a metric family name, a value and its labels."""

    name: str
    value: float
    labels: Labels = ()

    @classmethod
    def of(cls, name: str, value: float, **labels: object) -> Sample:
        return cls(name, float(value), labels_of(labels))

    def label(self, key: str, default: str = "") -> str:
        for k, v in self.labels:
            if k == key:
                return v
        return default


class Severity(enum.IntEnum):
    """Ordered so max() picks the worst."""

    OK = 0
    INFO = 1
    WARNING = 2
    CRITICAL = 3

    @classmethod
    def parse(cls, text: str) -> Severity:
        return cls[text.strip().upper()]

    def __str__(self) -> str:
        return self.name.lower()


class Action(enum.Enum):
    """What an operator should do; values match the Xid catalog's `action` field."""

    NONE = "none"
    RESTART_APP = "restart_app"
    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    DRAIN_AND_INSPECT = "drain_and_inspect"
    CONTACT_SUPPORT = "contact_support"

    def __str__(self) -> str:
        return self.value


class Health(enum.IntEnum):
    HEALTHY = 0
    DEGRADED = 1
    UNHEALTHY = 2

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Finding:
    """A rule's verdict about one subject (a GPU, a port, the daemon)."""

    rule: str
    alertname: str
    scope: str
    subject: Labels
    severity: Severity
    reason: str
    action: Action = Action.NONE
    remediation: str = ""
    labels: Labels = ()
    since: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuProcess:
    """One compute process NVML lists on a GPU, or on one of its MIG devices."""

    pid: int
    used_memory_bytes: int | None = None
    mig_uuid: str = ""  # the MIG device it runs on ("" on a whole GPU)
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """One GPU of the node as NVML lists it."""

    index: int
    uuid: str = ""
    pci_bus_id: str = ""  # one form everywhere: pci.normalize_bus_id ("0000:06:00.0")
    name: str = ""
    mig: tuple[str, ...] = ()  # UUIDs of its MIG devices (MIG on and instances created)
    processes: tuple[GpuProcess, ...] = ()  # by pid, as of the last poll

    @property
    def key(self) -> str:
        """Who the GPU is across polls: its UUID, or `gpuN` while NVML could not say."""
        return self.uuid or f"gpu{self.index}"

    @property
    def subject(self) -> Labels:
        """The labels its per-GPU series and findings carry."""
        return labels_of({"gpu": self.index, "uuid": self.uuid, "pci_bus_id": self.pci_bus_id})


@dataclass(frozen=True, slots=True)
class GpuPlace:
    """Where one GPU sits: its links to the other GPUs, its CPUs and nearest NICs.

    Read once per set of GPUs (sources/nvml/topology.py); "" or None is unknown.
    Relations use nvidia-smi topo -m's names: NV<links>, PIX, PXB, PHB, NODE, SYS.
    """

    index: int
    pci_bus_id: str
    uuid: str = ""
    numa_node: int | None = None
    cpu_affinity: str = ""  # as the kernel prints CPU lists: "0-31,64-95"
    peers: tuple[tuple[int, str], ...] = ()  # (other GPU's index, relation)
    nics: tuple[tuple[str, str], ...] = ()  # nearest RDMA devices: (name, relation)


@dataclass(frozen=True, slots=True)
class Topology:
    """The GPU link matrix of the node, as `nvidia-smi topo -m` prints it."""

    gpus: tuple[GpuPlace, ...] = ()

    def as_json(self) -> dict[str, object]:
        """{"matrix": {"GPU0": {"GPU1": "NV18", ...}}, "gpus": [...]} for /status and check."""
        matrix = {
            f"GPU{g.index}": {f"GPU{i}": rel or "unknown" for i, rel in ((g.index, "X"), *g.peers)}
            for g in self.gpus
        }
        return {
            "matrix": matrix,
            "gpus": [
                {
                    "gpu": g.index,
                    "pci_bus_id": g.pci_bus_id,
                    "uuid": g.uuid,
                    "numa_node": g.numa_node,
                    "cpu_affinity": g.cpu_affinity or None,
                    "nics": [{"device": n, "relation": r} for n, r in g.nics],
                }
                for g in self.gpus
            ],
        }


@dataclass(frozen=True, slots=True)
class GpuInventory:
    """The GPUs the NVML source saw at its last poll, found by bus id, UUID or index."""

    gpus: tuple[Gpu, ...] = ()
    topology: Topology | None = None  # None until read (once per set of GPUs)

    def __len__(self) -> int:
        return len(self.gpus)

    def __iter__(self) -> Iterator[Gpu]:
        return iter(self.gpus)

    def by_bus_id(self, bus_id: str) -> Gpu | None:
        """The GPU at that PCI address, in any spelling the driver or sysfs prints."""
        want = normalize_bus_id(bus_id)
        return next((g for g in self.gpus if want and g.pci_bus_id == want), None)

    def pids_by_gpu(self) -> dict[str, list[int]]:
        """GPU index (as a label) -> the pids NVML lists on it, MIG devices included."""
        return {str(g.index): [p.pid for p in g.processes] for g in self.gpus if g.processes}

    def find(self, ident: str) -> Gpu | None:
        """The GPU an operator names: its index, UUID, a MIG device UUID or PCI bus id."""
        ident = ident.strip()
        for g in self.gpus:
            if ident in (str(g.index), g.uuid) or (ident and ident in g.mig):
                return g
        return self.by_bus_id(ident)


@dataclass(frozen=True, slots=True, kw_only=True)
class Clear:
    """An operator's `gpuwatchd clear`, or a GPU reset, as the event store records it.

    `pci_bus_id` "" clears every GPU; `code` None every Xid code (with a code,
    only that code is cleared and other sticky memory is kept).
    """

    time: float
    who: str = ""
    pci_bus_id: str = ""
    code: int | None = None
    kind: str = "xid"
    reason: str = ""
    reset: bool = False  # a GPU reset (NVML saw it come back), not an operator clear
    boot_id: str = ""  # the boot it applies to; "" = any
    id: int = 0  # the store's row id (0: not stored)


@dataclass(frozen=True, slots=True, kw_only=True)
class KmsgState:
    """The kernel log reader after a poll: what `check` and the store's cursor need."""

    reader_up: bool
    error: str = ""
    cursor: str = ""  # where the next read starts; the Xid stage commits it with the events
    records_read: int = 0


@dataclass(frozen=True, slots=True)
class WorkloadSet:
    """The workloads source's jobs: current ones, then recently exited ones."""

    current: tuple[Workload, ...] = ()
    exited: tuple[Workload, ...] = ()


SourcePayload = GpuInventory | KmsgState | WorkloadSet


@dataclass(frozen=True, slots=True)
class SourceSnapshot:
    """The outcome of one poll of one source, as the state keeps it.

    `status` is the source's JSON-able view for /status only; code reads the
    typed `payload` (through `inventory`, `kmsg`, `workloads`).
    """

    source: str
    samples: tuple[Sample, ...]
    ok: bool
    error: str = ""
    timestamp: float = 0.0  # wall time of the poll: for display and storage
    duration_seconds: float = 0.0
    last_success: float = 0.0
    status: Mapping[str, object] = field(default_factory=dict)
    payload: SourcePayload | None = None
    monotonic: float = 0.0  # monotonic time of the poll: ages and durations (0: unknown)
    errors_by_reason: Mapping[str, int] = field(default_factory=dict)  # failed polls so far

    @property
    def inventory(self) -> GpuInventory | None:
        """The NVML source's GPUs; None from other sources."""
        return self.payload if isinstance(self.payload, GpuInventory) else None

    @property
    def kmsg(self) -> KmsgState | None:
        """The kernel log reader's state; None from other sources."""
        return self.payload if isinstance(self.payload, KmsgState) else None

    @property
    def workloads(self) -> WorkloadSet | None:
        """The workloads source's jobs; None from other sources."""
        return self.payload if isinstance(self.payload, WorkloadSet) else None


# Bounded enough for alert labels (one value per job); the other workload
# fields go into annotations and event attributes only.
WORKLOAD_ALERT_LABELS = ("namespace", "pod", "slurm_job")


@dataclass(frozen=True, slots=True)
class WorkloadProcess:
    """One process of a workload on one GPU, with its torch.distributed rank when known."""

    pid: int
    gpu: str
    uuid: str = ""
    pci_bus_id: str = ""
    name: str = ""
    used_memory_bytes: int | None = None
    rank: str = ""
    local_rank: str = ""
    gpu_instance: str = ""  # MIG: the process runs on this GPU/compute instance (uuid is its)
    compute_instance: str = ""
    start_ticks: int | None = None  # /proc/PID/stat start time: pid + start is one process


@dataclass(frozen=True, slots=True)
class Workload:
    """One job on this node: a Kubernetes pod, a Slurm job, a torch job, or a bare process.

    `kind` is "k8s", "slurm", "torch" or "process"; `id` is namespace/pod (or
    the pod UID when the kubelet cannot be asked), the Slurm job id, the torch
    job id (`torch_job_id`: "torchelastic:RUN" or "torch:ADDR:PORT"), or the pid.
    """

    kind: Literal["k8s", "slurm", "torch", "process"]
    id: str
    namespace: str = ""
    pod: str = ""
    container: str = ""
    pod_uid: str = ""
    slurm_job: str = ""
    slurm_step: str = ""
    slurm_user: str = ""
    slurm_job_name: str = ""
    world_size: str = ""
    run_id: str = ""  # TORCHELASTIC_RUN_ID
    processes: tuple[WorkloadProcess, ...] = ()
    gpus: tuple[str, ...] = ()  # UUIDs assigned or in use

    def process(self, pid: int) -> WorkloadProcess | None:
        """This workload's process with that pid, if any."""
        return next((p for p in self.processes if p.pid == pid), None)

    def attrs(self, pid: int | None = None) -> Labels:
        """Event attributes naming this workload (and the rank of `pid`), non-empty only."""
        out = {
            "workload": self.kind,
            "workload_id": self.id,
            "namespace": self.namespace,
            "pod": self.pod,
            "container": self.container,
            "pod_uid": self.pod_uid,
            "slurm_job": self.slurm_job,
            "slurm_step": self.slurm_step,
            "slurm_user": self.slurm_user,
            "slurm_job_name": self.slurm_job_name,
            "world_size": self.world_size,
            "torchelastic_run_id": self.run_id,
        }
        proc = self.process(pid) if pid is not None else None
        if proc is not None:
            out.update(rank=proc.rank, local_rank=proc.local_rank)
            if proc.gpu_instance:
                out.update(gpu_instance=proc.gpu_instance, compute_instance=proc.compute_instance)
                out["mig_uuid"] = proc.uuid
        return tuple(sorted((k, v) for k, v in out.items() if v))
