"""The workloads source: which pod, Slurm job or process holds each GPU, with ranks.

Polled right after each NVML poll (`follows`). Processes per GPU come from the NVML source's
last poll (ctx.gpus, no second NVML client); each pid is placed by
its cgroup (pod UID, Slurm job), named through the kubelet pod-resources
API (one List per poll, matched by GPU/MIG UUID) or Slurm (cached per
job), and given its torch.distributed rank from /proc/PID/environ. A
backend that is absent or fails leaves its fields empty; the poll never
fails for it (errors are counted).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from gpuwatchd.errors import SourceError
from gpuwatchd.model import (
    Event,
    GpuInventory,
    MetricSpec,
    Sample,
    Workload,
    WorkloadProcess,
    WorkloadSet,
)
from gpuwatchd.sources.workloads.cgroup import Attribution, attribute, start_ticks
from gpuwatchd.sources.workloads.environ import read_torch_env, torch_job_id
from gpuwatchd.sources.workloads.podresources import PodDevice, PodResourcesClient
from gpuwatchd.sources.workloads.slurm import SlurmJobs

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.sources.context import SourceContext

__all__ = [
    "METRICS",
    "WorkloadSource",
    "workload_json",
    "workloads_from_status",
    "workloads_on_gpus",
]

log = logging.getLogger("gpuwatchd.sources.workloads")

INFO_LABELS = ("gpu", "uuid", "pci_bus_id", "namespace", "pod", "container", "slurm_job")

METRICS = (
    MetricSpec(
        "gpuwatchd_gpu_workload_info",
        "info",
        "1 per GPU and the workload on it (pod or Slurm job; empty labels for a bare process):"
        " join any GPU metric to its workload on gpu/uuid",
        INFO_LABELS,
    ),
    MetricSpec(
        "gpuwatchd_workload_lookup_errors_total",
        "counter",
        "failed kubelet pod-resources or Slurm lookups (the workload keeps what the cgroup says)",
        ("backend",),
    ),
)

# A poll asks Slurm about at most this many new jobs (each bounded by call_timeout);
# the rest wait for the next poll, so a hung slurmctld cannot stretch one poll much.
SLURM_LOOKUPS_PER_POLL = 4
# Exited processes remembered for late Xids: the newest, at most this many.
MAX_EXITED = 256

GpuLookup = Callable[[], GpuInventory]


class _GpuProcesses(NamedTuple):
    """One GPU's processes as NVML listed them: pid, used bytes, MIG device UUID, GI, CI."""

    gpu: str
    uuid: str
    bus: str
    migs: tuple[str, ...]
    procs: list[tuple[int, int | None, str, str, str]]


class _Proc:
    """What one pid is, read once while it stays on a GPU."""

    __slots__ = ("attribution", "env", "seen", "start")

    def __init__(
        self, attribution: Attribution, env: Mapping[str, str], seen: float, start: int | None
    ) -> None:
        self.attribution = attribution
        self.env = env
        self.seen = seen
        self.start = start  # with the pid, names the process (pids are reused)


class WorkloadSource:
    """Builds the `Workload`s of this node once per NVML poll."""

    name = "workloads"
    follows = "nvml"  # the runner polls it right after each NVML poll (its processes)

    def __init__(
        self,
        gpus: GpuLookup,
        *,
        procfs: str = "/proc",
        interval: float = 10.0,
        kubelet: PodResourcesClient | None = None,
        slurm: SlurmJobs | None = None,
        rank_env: bool = True,
        keep_seconds: float = 600.0,
    ) -> None:
        self.interval = interval
        self._gpu_lookup = gpus
        self.procfs = procfs
        self.kubelet = kubelet
        self.slurm = slurm
        self.rank_env = rank_env
        self.keep_seconds = keep_seconds
        self._procs: dict[int, _Proc] = {}
        self._workloads: tuple[Workload, ...] = ()
        self._exited: dict[tuple[int, int | None], tuple[float, Workload]] = {}
        self._errors = {"kubelet": 0, "slurm": 0}
        self._kubelet_error = ""
        self._slurm_budget = SLURM_LOOKUPS_PER_POLL
        self._last_inventory: object = None
        self._samples_cache: list[Sample] | None = None

    @classmethod
    def from_config(cls, cfg: Config, ctx: SourceContext) -> WorkloadSource:
        """Build from sources.workloads; polled at the NVML interval (see poll())."""
        wc = cfg.sources.workloads
        return cls(
            ctx.gpus,
            procfs=cfg.paths.procfs,
            interval=cfg.sources.nvml.interval,
            kubelet=PodResourcesClient(wc.kubelet_socket, wc.call_timeout),
            slurm=SlurmJobs(timeout=wc.call_timeout) if wc.slurm else None,
            rank_env=wc.rank_env,
            keep_seconds=wc.keep_seconds,
        )

    # --- the poll ------------------------------------------------------------------

    def poll(self, now: float) -> Sequence[Sample | Event]:
        """Read processes, place and name them; samples: workload info and lookup errors.

        Polled after each NVML poll (and at its interval), it works only when NVML has published a
        new poll since (a new inventory object): at most one kubelet call per
        NVML poll. (Polling faster would name new processes sooner but adds
        a publish, and a pass of the consumer chain, every time.)
        """
        inventory = self._gpu_lookup()
        if inventory is self._last_inventory and self._samples_cache is not None:
            return self._samples_cache
        self._last_inventory = inventory
        gpus = self._gpus(inventory)
        devices = self._pod_devices(gpus)
        groups: dict[tuple[str, str], dict[str, Any]] = {}
        seen: set[tuple[int, int | None]] = set()
        self._slurm_budget = SLURM_LOOKUPS_PER_POLL
        for gpu, uuid, bus, migs, procs in gpus:
            for device in (uuid, *migs):  # a pod may hold the GPU or one of its MIG devices
                for pod_dev in devices.get(device, ()):
                    self._group(groups, _k8s_fields(pod_dev), gpu_uuid=device)
            for pid, used, mig, gi, ci in procs:
                info = self._proc(pid, now)
                seen.add((pid, info.start))
                device = mig or uuid
                fields = self._fields_of(info, devices.get(device, []), pid, now)
                wp = WorkloadProcess(
                    pid=pid,
                    gpu=gpu,
                    uuid=device,
                    pci_bus_id=bus,
                    name=info.env.get("_comm", ""),
                    used_memory_bytes=used,
                    rank=info.env.get("rank", ""),
                    local_rank=info.env.get("local_rank", ""),
                    gpu_instance=gi,
                    compute_instance=ci,
                    start_ticks=info.start,
                )
                group = self._group(groups, fields, gpu_uuid=device)
                group["processes"].append(wp)
                run_id = info.env.get("torchelastic_run_id", "")  # torchrun's default: no run
                group["run_id"] = group.get("run_id") or ("" if run_id == "none" else run_id)
                group["world_size"] = group.get("world_size") or info.env.get("world_size", "")
        workloads = tuple(_build(g) for g in groups.values())
        self._forget(seen, workloads, now)
        self._workloads = workloads
        self._samples_cache = self._samples(gpus, workloads)
        return self._samples_cache

    def _gpus(self, inventory: GpuInventory) -> list[_GpuProcesses]:
        out = []
        for g in sorted(inventory, key=lambda g: g.pci_bus_id):
            procs = [
                (
                    p.pid,
                    p.used_memory_bytes,
                    p.mig_uuid,
                    _instance(p.gpu_instance) if p.mig_uuid else "",
                    _instance(p.compute_instance) if p.mig_uuid else "",
                )
                for p in g.processes
            ]
            out.append(_GpuProcesses(str(g.index), g.uuid, g.pci_bus_id, g.mig, procs))
        return out

    def _pod_devices(self, gpus: list[_GpuProcesses]) -> Mapping[str, list[PodDevice]]:
        if self.kubelet is None or not gpus or not self.kubelet.available():
            return {}
        try:
            found = self.kubelet.list_pods()
        except SourceError as exc:
            self._errors["kubelet"] += 1
            if str(exc) != self._kubelet_error:
                log.warning("kubelet pod-resources: %s", exc)
            self._kubelet_error = str(exc)
            return {}
        self._kubelet_error = ""
        return found

    def _proc(self, pid: int, now: float) -> _Proc:
        start = start_ticks(self.procfs, pid)
        info = self._procs.get(pid)
        if info is None or info.start != start:  # new, or the pid now names another process
            env: dict[str, str] = read_torch_env(self.procfs, pid) if self.rank_env else {}
            env["_comm"] = _comm(self.procfs, pid)
            info = self._procs[pid] = _Proc(attribute(self.procfs, pid), env, now, start)
        info.seen = now
        return info

    def _fields_of(
        self, info: _Proc, assigned: list[PodDevice], pid: int, now: float
    ) -> dict[str, str]:
        a = info.attribution
        if a.status == "kubernetes":
            pods = {(d.namespace, d.pod) for d in assigned}
            if len(pods) == 1:
                return {**_k8s_fields(assigned[0]), "pod_uid": a.pod_uid}
            return {"kind": "k8s", "id": a.pod_uid, "pod_uid": a.pod_uid}
        if a.status == "slurm":
            fields = {"kind": "slurm", "id": a.slurm_job, "slurm_job": a.slurm_job}
            fields["slurm_step"] = a.slurm_step
            job = self.slurm.cached(a.slurm_job) if self.slurm is not None else None
            if self.slurm is not None and self.slurm.would_ask(a.slurm_job, now):
                if self._slurm_budget > 0:
                    self._slurm_budget -= 1
                    job = self.slurm.lookup(a.slurm_job, now)
            if job is not None:
                fields.update(slurm_user=job.user, slurm_job_name=job.name)
            return fields
        env = info.env  # neither pod nor Slurm job: the ranks of one torch job are one workload
        torch_job = torch_job_id(
            env.get("torchelastic_run_id", ""),
            env.get("master_addr", ""),
            env.get("master_port", ""),
        )
        return (
            {"kind": "torch", "id": torch_job} if torch_job else {"kind": "process", "id": str(pid)}
        )

    @staticmethod
    def _group(
        groups: dict[tuple[str, str], dict[str, Any]], fields: Mapping[str, str], gpu_uuid: str
    ) -> dict[str, Any]:
        key = (fields["kind"], fields["id"])
        group = groups.setdefault(key, {"processes": [], "gpus": []})
        for k, v in fields.items():
            if v and not group.get(k):
                group[k] = v
        if gpu_uuid and gpu_uuid not in group["gpus"]:
            group["gpus"].append(gpu_uuid)
        return group

    def _forget(
        self, seen: set[tuple[int, int | None]], workloads: tuple[Workload, ...], now: float
    ) -> None:
        """Keep exited processes' workloads for keep_seconds (an Xid may name them late).

        A process is its pid and start time: one that exited stays here even
        when its pid already names a new process.
        """
        for w in self._workloads:
            for p in w.processes:
                if (p.pid, p.start_ticks) not in seen:
                    key = (p.pid, p.start_ticks)
                    self._exited[key] = (now, dataclasses.replace(w, processes=(p,)))
        live = {pid for pid, _ in seen}
        for pid in [p for p in self._procs if p not in live]:
            del self._procs[pid]
        for key in seen:
            self._exited.pop(key, None)
        for key in [k for k, (t, _) in self._exited.items() if now - t > self.keep_seconds]:
            del self._exited[key]
        while len(self._exited) > MAX_EXITED:  # oldest first: insertion order
            del self._exited[next(iter(self._exited))]

    def _samples(self, gpus: list[_GpuProcesses], workloads: tuple[Workload, ...]) -> list[Sample]:
        by_uuid = {}
        for g in gpus:  # a MIG device's series carry its GPU's uuid (join on gpu/uuid)
            for device in (g.uuid, *g.migs):
                by_uuid[device] = (g.gpu, g.uuid, g.bus)
        series: set[tuple[tuple[str, str], ...]] = set()
        for w in workloads:
            for uuid in w.gpus:
                gpu, parent, bus = by_uuid.get(uuid, ("", uuid, ""))
                labels = dict.fromkeys(INFO_LABELS, "")
                labels.update(gpu=gpu, uuid=parent, pci_bus_id=bus)
                labels.update(namespace=w.namespace, pod=w.pod, container=w.container)
                labels["slurm_job"] = w.slurm_job
                series.add(tuple(sorted(labels.items())))
        out = [Sample("gpuwatchd_gpu_workload_info", 1.0, labels) for labels in sorted(series)]
        if self.slurm is not None:
            self._errors["slurm"] = sum(self.slurm.errors.values())
        for backend, n in sorted(self._errors.items()):
            out.append(Sample.of("gpuwatchd_workload_lookup_errors_total", n, backend=backend))
        return out

    # --- for other parts of the daemon ------------------------------------------------

    def workloads(self) -> tuple[Workload, ...]:
        """The workloads of the last poll."""
        return self._workloads

    def payload(self) -> WorkloadSet:
        """Current workloads, then recently exited ones, typed (what /status lists)."""
        return WorkloadSet(
            self._workloads, tuple(w for _, w in sorted(self._exited.values(), key=_first))
        )

    def status(self) -> Mapping[str, object]:
        """For /status: current workloads, recently exited processes, backends."""
        kubelet = "absent"
        if self.kubelet is not None and self.kubelet.available():
            kubelet = f"error: {self._kubelet_error}" if self._kubelet_error else "ok"
        slurm = "off"
        if self.slurm is not None:
            slurm = "available" if self.slurm.available() else "no client commands"
        return {
            "workloads": [workload_json(w) for w in self._workloads],
            "exited": [workload_json(w) for _, w in sorted(self._exited.values(), key=_first)],
            "kubelet": kubelet,
            "slurm": slurm,
            "rank_env": self.rank_env,
        }

    def close(self) -> None:
        """Drop the kubelet channel."""
        if self.kubelet is not None:
            self.kubelet.close()


_INSTANCE_KEYS = ("gpu_instance", "compute_instance")


def _instance(value: object) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else ""


def _first(item: tuple[float, Workload]) -> float:
    return item[0]


def _k8s_fields(d: PodDevice) -> dict[str, str]:
    return {
        "kind": "k8s",
        "id": f"{d.namespace}/{d.pod}",
        "namespace": d.namespace,
        "pod": d.pod,
        "container": d.container,
    }


def _build(group: Mapping[str, Any]) -> Workload:
    names = {f.name for f in dataclasses.fields(Workload)}
    kwargs = {k: v for k, v in group.items() if k in names and k not in ("processes", "gpus")}
    procs = tuple(sorted(group["processes"], key=lambda p: (p.gpu, p.pid)))
    return Workload(**kwargs, processes=procs, gpus=tuple(group["gpus"]))


def _comm(procfs: str, pid: int) -> str:
    try:
        with open(f"{procfs}/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def workload_json(w: Workload) -> dict[str, object]:
    """A workload as plain JSON (empty fields dropped)."""
    out: dict[str, object] = {
        k: v for k, v in dataclasses.asdict(w).items() if v not in ("", None, (), [])
    }
    out["processes"] = [
        {k: v for k, v in dataclasses.asdict(p).items() if v not in ("", None)} for p in w.processes
    ]
    return out


def workloads_on_gpus(
    workloads: Sequence[Workload], gpus: Sequence[str]
) -> list[dict[str, object]]:
    """The workloads (JSON form) holding any of `gpus` (UUIDs or PCI bus ids)."""
    wanted = {g for g in gpus if g}
    out = []
    for w in workloads:
        held = set(w.gpus) | {p.uuid for p in w.processes} | {p.pci_bus_id for p in w.processes}
        if held & wanted:
            out.append(workload_json(w))
    return out


def workloads_from_status(status: Mapping[str, object]) -> list[Workload]:
    """Workloads (current, then recently exited) back from `status()`'s JSON form (/status)."""
    out = []
    for key in ("workloads", "exited"):
        items = status.get(key)
        for item in items if isinstance(items, list) else ():
            if not isinstance(item, Mapping):
                continue
            try:
                procs = tuple(
                    WorkloadProcess(**p) for p in item.get("processes") or () if isinstance(p, dict)
                )
                fields = {k: v for k, v in item.items() if k not in ("processes", "gpus")}
                gpus = tuple(item.get("gpus") or ())
                out.append(Workload(**fields, processes=procs, gpus=gpus))
            except TypeError:  # not this version's shape: no attribution rather than a crash
                continue
    return out
