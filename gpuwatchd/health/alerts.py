"""The alert names the health rules raise: severity, component, default action, text.

One entry per alert name. `labels` is the alert's label set besides
alertname, severity and node; the Alertmanager sink sends exactly those,
and deploy/prometheus/gpuwatchd-rules.yaml keeps the same (a test checks).
Every name has a runbook in docs/runbooks/<AlertName>.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.model import WORKLOAD_ALERT_LABELS, Action, Finding, Severity

__all__ = [
    "ALERTS",
    "AlertInfo",
    "GPU_LABELS",
    "PCIE_LABELS",
    "PORT_LABELS",
    "WORKLOAD_ANNOTATIONS",
    "WORKLOAD_ATTRS",
    "summary",
]

GPU_LABELS = ("gpu", "uuid", "pci_bus_id")
PORT_LABELS = ("device", "port")
PCIE_LABELS = ("pci_bus_id", "role")
# Workload fields an Xid alert carries: the bounded ones as labels
# (model.WORKLOAD_ALERT_LABELS), these as annotations (pid and process are
# in the description already).
WORKLOAD_ANNOTATIONS = (
    "workload",
    "workload_id",
    "container",
    "pod_uid",
    "slurm_user",
    "slurm_job_name",
    "slurm_step",
    "pids",
    "rank",
    "local_rank",
    "world_size",
    "torchelastic_run_id",
    "gpu_instance",
    "compute_instance",
    "mig_uuid",
)
WORKLOAD_ATTRS = frozenset((*WORKLOAD_ALERT_LABELS, *WORKLOAD_ANNOTATIONS))
# incident: shared with a job hang put down to this Xid (health/incident.py)
_XID_LABELS = (*GPU_LABELS, "xid", "incident", *WORKLOAD_ALERT_LABELS)


@dataclass(frozen=True)
class AlertInfo:
    """Fixed facts of one alert name.

    `labels` are the alert's labels besides alertname, severity, node and
    the static ones: the same the Prometheus rule of that name keeps.
    """

    severity: Severity
    component: str
    action: Action
    summary: str  # str.format over the subject's labels
    remediation: str
    labels: tuple[str, ...] = GPU_LABELS


_W, _C = Severity.WARNING, Severity.CRITICAL
ALERTS: dict[str, AlertInfo] = {
    "GpuXidCritical": AlertInfo(
        _C, "kmsg", Action.RESET_GPU, "Critical Xid {xid} on GPU {gpu}", "", _XID_LABELS
    ),
    "GpuXidWarning": AlertInfo(
        _W, "kmsg", Action.RESTART_APP, "Xid {xid} on GPU {gpu}", "", _XID_LABELS
    ),
    "NvswitchSxidCritical": AlertInfo(
        _C,
        "kmsg",
        Action.REBOOT_NODE,
        "Critical SXid {sxid} on NVSwitch {pci_bus_id}",
        "",
        ("pci_bus_id", "sxid"),
    ),
    "NvswitchSxidWarning": AlertInfo(
        _W, "kmsg", Action.NONE, "SXid {sxid} on NVSwitch {pci_bus_id}", "", ("pci_bus_id", "sxid")
    ),
    "GpuEccUncorrectable": AlertInfo(
        _C,
        "nvml",
        Action.RESET_GPU,
        "Uncorrectable ECC errors on GPU {gpu}",
        "Drain the GPU; after the jobs on it ended, reset it so the bad rows are remapped. "
        "Check row-remap status afterwards; if errors keep coming, run DCGM diagnostics.",
    ),
    "GpuRowRemapFailure": AlertInfo(
        _C,
        "nvml",
        Action.CONTACT_SUPPORT,
        "Row remapping failed on GPU {gpu}",
        "The GPU has no spare rows left for a bad memory row. Drain it, keep it out of "
        "service and open an RMA case with nvidia-bug-report output.",
    ),
    "GpuRowRemapPending": AlertInfo(
        _W,
        "nvml",
        Action.RESET_GPU,
        "Memory repair pending on GPU {gpu}",
        "A row remap or page retirement waits for a GPU reset. Drain the GPU and reset it "
        "(nvidia-smi -r) or reboot the node at the next opportunity.",
    ),
    "GpuNvlinkDown": AlertInfo(
        _C,
        "nvml",
        Action.DRAIN_AND_INSPECT,
        "NVLink down on GPU {gpu}",
        "A link that was up is down; NCCL falls back to slower paths or fails. Drain the "
        "node, check nvidia-smi nvlink -s and Fabric Manager, reset the GPUs or reboot.",
    ),
    "GpuNvlinkErrors": AlertInfo(
        _W,
        "nvml",
        Action.DRAIN_AND_INSPECT,
        "NVLink errors rising on GPU {gpu}",
        "Replays, recoveries and CRC errors (what nvidia-smi nvlink -e shows) point at a "
        "marginal link; corrected errors do not count. If they keep rising, drain the node and "
        "run DCGM NVLink diagnostics.",
    ),
    "GpuTemperatureHigh": AlertInfo(
        _W,
        "nvml",
        Action.NONE,
        "GPU {gpu} close to its slowdown temperature",
        "Check airflow, fans and inlet temperature of the node before the GPU slows down.",
    ),
    "GpuThermalSlowdown": AlertInfo(
        _W,
        "nvml",
        Action.DRAIN_AND_INSPECT,
        "GPU {gpu} clocks slowed down by hardware",
        "The GPU is throttled for temperature or power. Check cooling, power supplies and "
        "power-brake signals; a single slow GPU slows the whole job.",
    ),
    "GpuPcieDegraded": AlertInfo(
        _W,
        "nvml",
        Action.DRAIN_AND_INSPECT,
        "PCIe link of GPU {gpu} degraded",
        "The link trained below its width/generation or replays packets. Drain the node, "
        "reseat the GPU or riser, and check the slot's link status with lspci -vv.",
    ),
    "GpuRecoveryActionRequired": AlertInfo(
        _C,
        "nvml",
        Action.RESET_GPU,
        "Driver asks for recovery of GPU {gpu}",
        "The driver set a recovery action for this GPU. Drain it and do what it asks "
        "(GPU reset, node reboot, or drain peer-to-peer traffic).",
    ),
    "GpuLost": AlertInfo(
        _C,
        "nvml",
        Action.REBOOT_NODE,
        "GPU {gpu} is lost",
        "The GPU no longer answers (fallen off the bus). Drain the node and reboot it; if "
        "it happens again, inspect seating, power and the PCIe slot.",
    ),
    "NvmlUnresponsive": AlertInfo(
        _C,
        "nvml",
        Action.REBOOT_NODE,
        "NVML not answering{for_gpu}",
        "NVML calls hang or fail, so the GPUs cannot be monitored or managed. Check "
        "nvidia-smi and the kernel log; drain and reboot the node if it does not recover.",
    ),
    "GpuCountLow": AlertInfo(
        _C,
        "nvml",
        Action.REBOOT_NODE,
        "Fewer GPUs visible than expected",
        "A GPU is missing from NVML. Check lspci and the kernel log for Xid 79; drain the "
        "node and reboot. If a GPU was removed on purpose, set health.expected_gpus.",
        (),
    ),
    # Raised by health/fabric.py.
    "GpuFabricNotRegistered": AlertInfo(
        _C,
        "nvml",
        Action.DRAIN_AND_INSPECT,
        "GPU {gpu} not registered with the NVLink fabric",
        "The GPU has not joined its NVSwitch fabric, so NCCL jobs on it hang at init or "
        "fail. Check nvidia-fabricmanager (systemctl status, its log), then reset the GPUs "
        "or reboot the node; if the GPU still does not register, have the baseboard inspected.",
    ),
    "GpuDiagFailed": AlertInfo(
        _W,
        "diag",
        Action.DRAIN_AND_INSPECT,
        "Diag check {check} failed on GPU {gpu}",
        "An active check (gpuwatchd diag) failed: a figure below its floor or a wrong result. "
        "Keep the node out of service, read `gpuwatchd diag --tier standard` and its floor "
        "sources, and run the dcgm tier; a GPU that fails the same check again is inspected.",
        ("check", "gpu"),
    ),
    "FabricManagerDown": AlertInfo(
        _C,
        "nvml",
        Action.DRAIN_AND_INSPECT,
        "nvidia-fabricmanager is not running",
        "This node's GPUs sit on an NVSwitch fabric that needs nvidia-fabricmanager. Read "
        "journalctl -u nvidia-fabricmanager, restart the service (its version must match "
        "the driver's), and drain the node until the GPUs are registered again.",
        (),
    ),
    "GpuwatchdCollectorFailed": AlertInfo(
        _W,
        "daemon",
        Action.NONE,
        "gpuwatchd collector {collector} failing",
        "Part of the node is not monitored. Read the daemon log (journalctl -u gpuwatchd) "
        "for the collector's error.",
        ("collector",),
    ),
    # Raised by health/stuck.py and health/node_rules.py (their own text and actions).
    "GpuStuckSuspected": AlertInfo(
        _W, "nvml", Action.RESTART_APP, "GPU {gpu} looks stuck (suspected NCCL hang)", ""
    ),
    # Raised by health/hangs/provider.py, one per job (its own text, severity and remediation).
    "JobHangSuspected": AlertInfo(
        _W,
        "nvml",
        Action.RESTART_APP,
        "Job {job} looks hung",
        "",
        # job_id: the same on every node of the job (routing groups by it); role: culprit,
        # waiting or stalled; incident: the Xid this hang is put down to
        ("job", "job_id", "namespace", "pod", "slurm_job", "role", "incident"),
    ),
    # Raised by health/slowdowns/monitor.py, one per slowed job (its own text and remediation).
    "JobSlowedByGpu": AlertInfo(
        _W,
        "nvml",
        Action.DRAIN_AND_INSPECT,
        "Job {job} slowed by GPU {gpu}",
        "",
        # gpu: the GPU the job waits for; cause: the slowdown cause catalog's name
        ("job", "job_id", "namespace", "pod", "slurm_job", "gpu", "cause"),
    ),
    "ShmNearlyFull": AlertInfo(_W, "shm", Action.NONE, "/dev/shm nearly full", "", ()),
    "ShmStaleSegments": AlertInfo(
        _W, "shm", Action.NONE, "Stale NCCL segments in /dev/shm", "", ()
    ),
    "InfinibandPortDown": AlertInfo(
        _C,
        "infiniband",
        Action.DRAIN_AND_INSPECT,
        "InfiniBand port {device}/{port} down",
        "",
        PORT_LABELS,
    ),
    "InfinibandPhysicalStateNotLinkUp": AlertInfo(
        _W,
        "infiniband",
        Action.DRAIN_AND_INSPECT,
        "InfiniBand port {device}/{port} physical link not up",
        "",
        PORT_LABELS,
    ),
    "InfinibandRateDegraded": AlertInfo(
        _W,
        "infiniband",
        Action.DRAIN_AND_INSPECT,
        "InfiniBand port {device}/{port} below its expected rate",
        "",
        PORT_LABELS,
    ),
    "InfinibandErrorsRising": AlertInfo(
        _W,
        "infiniband",
        Action.NONE,
        "InfiniBand port {device}/{port} errors rising",
        "",
        PORT_LABELS,
    ),
    # Raised by health/aer_rules.py (their own text).
    "PcieAerFatalErrors": AlertInfo(
        _C,
        "aer",
        Action.DRAIN_AND_INSPECT,
        "Fatal PCIe errors at {role} {pci_bus_id}",
        "",
        PCIE_LABELS,
    ),
    "PcieAerNonFatalErrors": AlertInfo(
        _W,
        "aer",
        Action.NONE,
        "Non-fatal PCIe errors at {role} {pci_bus_id}",
        "",
        PCIE_LABELS,
    ),
    "PcieAerCorrectableErrorsRising": AlertInfo(
        _W,
        "aer",
        Action.NONE,
        "Correctable PCIe errors rising at {role} {pci_bus_id}",
        "",
        PCIE_LABELS,
    ),
}


def summary(f: Finding) -> str:
    """One line for the alert's `summary` annotation."""
    info = ALERTS.get(f.alertname)
    if info is None:
        return f.reason
    given = {k: v for k, v in (*f.subject, *f.labels) if v}
    values = {
        "xid": "?",
        "sxid": "?",
        "pci_bus_id": "?",
        "collector": "?",
        "device": "?",
        "port": "?",
        "role": "PCI function",
        **given,
    }
    values.setdefault("gpu", given.get("pci_bus_id", "?"))  # an Xid of a GPU NVML lacks
    values["for_gpu"] = f" for GPU {values['gpu']}" if "gpu" in dict(f.subject) else ""
    return info.summary.format(**values)
