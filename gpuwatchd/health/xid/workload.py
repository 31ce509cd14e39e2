"""Which workload an Xid hit: the pid's, else the only one on that GPU; and its MIG device.

Pure matching over the workloads source's last poll (and the processes
that exited shortly before). The report's own cgroup attribution, read
when the line arrived, breaks ties when the pid is gone; its start time
tells the reporting process from a later one on the same pid. A report
without a time of its own whose pid may have changed hands ("pid
unverified") names no process. With MIG on, the
driver may log an Xid without `GPU-I:`/`GPU-CI:` (seen on an H100 for an
MMU fault, Xid 31); the pid then places it on the MIG device NVML lists
that process under.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from gpuwatchd.model import Event, GpuInventory, Workload, WorkloadProcess, XidFields
from gpuwatchd.model.xid import MIG_KEYS
from gpuwatchd.pci import normalize_bus_id

__all__ = ["attach_mig", "attach_workload", "match_workload"]


def _pid(ev: Event) -> int | None:
    return ev.xid.attribution.pid if ev.xid is not None else None


def _same_process(xid: XidFields, proc: WorkloadProcess) -> bool:
    """Whether `proc` is the process the report named, not another one on its pid later."""
    who = xid.attribution
    if who.verified == "pid unverified":
        return False  # the process at the pid, or one before it: naming either may be wrong
    start, newcomer = who.pid_start, who.reused_pid_start
    if proc.start_ticks is None:
        return not newcomer  # cannot tell the two apart: no attribution rather than a wrong one
    if start.isdigit():
        return proc.start_ticks == int(start)
    if newcomer.isdigit():
        return proc.start_ticks < int(newcomer)
    return True


def _on_gpu(ev: Event, workloads: Sequence[Workload]) -> list[Workload]:
    uuid, bus = ev.xid.uuid if ev.xid is not None else "", ev.pci_bus_id
    return [
        w
        for w in workloads
        if (uuid and uuid in w.gpus)
        or any(p.pci_bus_id == bus or (uuid and p.uuid == uuid) for p in w.processes)
    ]


def match_workload(ev: Event, workloads: Sequence[Workload]) -> Workload | None:
    """The workload of the event's pid, its cgroup's job or pod, or the GPU's only one."""
    pid, xid = _pid(ev), ev.xid
    if pid is not None and xid is not None:
        who = xid.attribution
        for w in workloads:
            proc = w.process(pid)
            if proc is not None and _same_process(xid, proc):
                return w
        job, pod_uid = who.job_value("slurm_job"), who.job_value("pod_uid")
        for w in workloads:
            if (job and w.slurm_job == job) or (pod_uid and w.pod_uid == pod_uid):
                return w
        if pod_uid:
            # A pod's process not listed yet: the one pod the kubelet gave this GPU to,
            # unless that pod is known under another UID.
            pods = [w for w in _on_gpu(ev, workloads) if w.kind == "k8s" and w.pod]
            return pods[0] if len(pods) == 1 and not pods[0].pod_uid else None
        if job or who.verified not in ("", "process gone"):
            return None  # the cgroup placed it and no known workload matches
    on_gpu = _on_gpu(ev, workloads)
    return on_gpu[0] if len(on_gpu) == 1 else None


def attach_workload(ev: Event, workloads: Sequence[Workload]) -> Event:
    """The event with its workload's attributes added (what the report said stays)."""
    w = match_workload(ev, workloads)
    if w is None or ev.xid is None:
        return ev
    return ev.carrying(_placed(ev.xid, w.attrs(_pid(ev))))


def _placed(xid: XidFields, found: Iterable[tuple[str, str]]) -> XidFields:
    """`xid` with the MIG device and job `found` added where the report named none."""
    job = dict(found)
    mig = {k: v for k in MIG_KEYS if (v := job.pop(k, "")) and not getattr(xid, k)}
    return replace(xid, attribution=xid.attribution.with_job(job.items()), **mig)  # type: ignore[arg-type]


_INSTANCE_KEYS = ("gpu_instance", "compute_instance")


def _mig_of(pid: int, bus: str, gpus: GpuInventory) -> dict[str, str]:
    """gpu_instance, compute_instance, mig_uuid of `pid` on GPU `bus` as NVML lists it."""
    gpu = gpus.by_bus_id(bus)
    for p in gpu.processes if gpu is not None else ():
        if p.pid != pid or not p.mig_uuid:
            continue
        if p.gpu_instance is not None and p.compute_instance is not None:
            return {
                "gpu_instance": str(p.gpu_instance),
                "compute_instance": str(p.compute_instance),
                "mig_uuid": p.mig_uuid,
            }
    return {}


def attach_mig(ev: Event, gpus: GpuInventory) -> Event:
    """The event with the MIG device NVML lists its pid on (`gpus`: NVML's last poll)."""
    pid = _pid(ev)
    bus = normalize_bus_id(ev.pci_bus_id) if ev.pci_bus_id else ""
    if pid is None or not bus:
        return ev
    found = _mig_of(pid, bus, gpus)
    xid = ev.xid
    if xid is None or not found:
        return ev
    if any(getattr(xid, k) not in ("", found[k]) for k in _INSTANCE_KEYS):
        return ev  # the report names another instance: what it says wins
    return ev.carrying(_placed(xid, found.items()))
