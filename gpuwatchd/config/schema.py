"""The configuration schema: frozen dataclasses with defaults, help and bounds.

Every key has a default, so the daemon runs with no file at all. Each
field's `metadata["help"]` is the one-line why that `config default`
prints; `metadata["min"]`/`["max"]` bound numbers; `metadata["choices"]`
bounds strings. Validation errors name the file, the key path and the
problem (see errors.ConfigError).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.config.diag import DiagConfig, EvidenceConfig
from gpuwatchd.config.fields import opt, section
from gpuwatchd.config.hangs import HangsConfig
from gpuwatchd.config.remediation import (
    KubernetesRemediationConfig,
    RemediationConfig,
    SlurmRemediationConfig,
)

__all__ = [
    "AerConfig",
    "AlertmanagerConfig",
    "Config",
    "DEFAULT_PORT",
    "DaemonConfig",
    "HangsConfig",
    "HealthConfig",
    "HttpConfig",
    "InfinibandConfig",
    "KmsgConfig",
    "KubernetesRemediationConfig",
    "MemoryConfig",
    "NvmlConfig",
    "PathsConfig",
    "RemediationConfig",
    "ShmConfig",
    "SlurmRemediationConfig",
    "SourcesConfig",
    "StoreConfig",
    "StuckConfig",
    "UdevConfig",
    "WorkloadsConfig",
    "XidConfig",
    "XidRule",
    "opt",
    "section",
]

DEFAULT_PORT = 10370


@dataclass(frozen=True)
class HttpConfig:
    listen: str = opt(
        f"0.0.0.0:{DEFAULT_PORT}",
        "address:port for /metrics, /status, /healthz, /events, /alerts",
    )
    web_config_file: str = opt(
        "", "exporter-toolkit web-config.yml (TLS, basic auth); empty = plain HTTP"
    )
    textfile: str = opt(
        "", "also write the exposition atomically to this file (node_exporter textfile)"
    )
    healthz_stale_seconds: float = opt(
        120.0, "/healthz answers 503 when no source loop made progress for this long", min=1
    )


@dataclass(frozen=True)
class PathsConfig:
    sysfs: str = opt("/sys", "root of sysfs (tests and containers point it elsewhere)")
    procfs: str = opt("/proc", "root of procfs")
    dev_shm: str = opt("/dev/shm", "the host's /dev/shm")
    cgroupfs: str = opt(
        "/sys/fs/cgroup", "the cgroup v2 hierarchy (memory.events, memory.pressure)"
    )
    kmsg: str = opt("/dev/kmsg", "kernel log device")
    boot_id: str = opt(
        "/proc/sys/kernel/random/boot_id", "file holding this boot's id (kmsg cursor)"
    )


@dataclass(frozen=True)
class DaemonConfig:
    state_dir: str = opt("/var/lib/gpuwatchd", "event store and cursors live here")
    log_level: str = opt("info", "stderr log level", choices=("debug", "info", "warning", "error"))
    node_name: str = opt("", "node label on alerts; empty = the host name")


@dataclass(frozen=True)
class NvmlConfig:
    enabled: bool = opt(True, "poll GPUs through NVML")
    interval: float = opt(10.0, "seconds between polls", min=0.1, max=3600)
    call_timeout: float = opt(
        5.0, "an NVML call slower than this marks the GPU unresponsive", min=0.05, max=600
    )
    replay: str = opt("", "serve NVML from this recorded capture instead of the driver")
    xid_events: bool = opt(
        True, "also take Xids from NVML's event API (needs no kernel log access)"
    )
    processes: bool = opt(True, "list compute processes per GPU (pid, memory)")
    gpm: bool = opt(
        True,
        "read GPM profiling metrics (SM, tensor, DRAM activity; Hopper and later, about 2 ms"
        " per GPU poll); off where another profiler (DCGM profiling, Nsight) owns the counters",
    )
    init_retry_max: float = opt(
        300.0, "longest wait between NVML initialisation retries (exponential backoff)", min=1
    )
    nvlink_error_interval: float = opt(
        60.0,
        "seconds between reads of the NVLink and PCIe error counters (about 1 ms per link"
        " and counter on an H200, 2.5 ms for the PCIe counters of an H100); 0 = every poll",
        min=0,
        max=3600,
    )
    static_interval: float = opt(
        300.0,
        "seconds between reads of what is static in steady state (application clocks, ECC"
        " and MIG mode); read again at once after a reset, an Xid or a failed read; 0 = every"
        " poll",
        min=0,
        max=3600,
    )
    nvlink_detail: str = opt(
        "gpu",
        "NVLink series in /metrics: gpu = links up per link, errors summed per GPU plus the"
        " links with errors; link = every counter of every link (5 x 18 per H100/H200)",
        choices=("gpu", "link"),
    )


@dataclass(frozen=True)
class KmsgConfig:
    enabled: bool = opt(True, "follow the kernel log for Xid/SXid reports")
    backend: str = opt(
        "auto",
        "where kernel log lines come from",
        choices=("auto", "kmsg", "journald", "file"),
    )
    file: str = opt("", "log file or pipe to follow when backend is file")
    accept_userspace: bool = opt(
        False, "treat Xid lines written from user space as real (drills and tests only)"
    )


@dataclass(frozen=True)
class ShmConfig:
    enabled: bool = opt(True, "watch /dev/shm capacity and stale NCCL segments")
    interval: float = opt(30.0, "seconds between polls", min=0.1, max=3600)
    patterns: list[str] = opt(
        ["nccl-*"],
        "file name globs of NCCL segments in /dev/shm (NCCL names them nccl-XXXXXX)",
        filename=True,
    )
    grace_seconds: float = opt(
        300.0, "a segment nobody holds is stale only once older than this", min=0
    )
    cleanup_stale: bool = opt(
        False, "delete stale segments (never one a live process holds); off by default"
    )
    scan_fds: bool = opt(
        True, "also look at open file descriptors, not only memory maps, to find holders"
    )
    full_warn_ratio: float = opt(
        0.9, "warn when this fraction of /dev/shm bytes or inodes is used", min=0, max=1
    )
    status_segments: int = opt(50, "at most this many segments listed in /status", min=0)


@dataclass(frozen=True)
class MemoryConfig:
    enabled: bool = opt(
        True, "read memory pressure (PSI) of the node and of the GPU processes' memory cgroups"
    )
    interval: float = opt(10.0, "seconds between polls", min=0.1, max=3600)
    full_pressure_ratio: float = opt(
        0.1,
        "PSI full avg10 (every task stalled on memory) at or above this share of time is"
        " memory pressure that can stall a job (an event, and a cause of a hang)",
        min=0.01,
        max=1,
    )
    job_cgroups: bool = opt(
        True, "also read memory.events and memory.pressure of each GPU process's cgroup v2 group"
    )


@dataclass(frozen=True)
class InfinibandConfig:
    enabled: bool = opt(True, "watch InfiniBand/RoCE ports in sysfs")
    interval: float = opt(15.0, "seconds between polls", min=0.1, max=3600)
    device_include: str = opt(
        "", "regex: watch only devices whose name matches; empty = all", regex=True
    )
    device_exclude: str = opt(
        "", "regex: skip devices whose name matches; empty = none", regex=True
    )
    hw_counters: bool = opt(True, "export the driver's hw_counters/ (RDMA retransmits, CNPs...)")
    expected_rate_gbps: dict[str, float] = opt(
        {},
        "expected port rate in Gb/s by device or device/port (mlx5_0: 400); "
        "unlisted ports expect the highest rate seen since start",
    )
    expected_up: str = opt(
        "",
        "regex on device/port: ports that must be up even if never seen ACTIVE since start",
        regex=True,
    )


@dataclass(frozen=True)
class AerConfig:
    enabled: bool = opt(True, "read PCIe AER counters of the GPUs, nearby NICs and their bridges")
    interval: float = opt(30.0, "seconds between polls", min=0.1, max=3600)
    correctable_per_minute: float = opt(
        8.0,
        "PcieAerCorrectableErrorsRising fires when a function's correctable errors rise "
        "faster than this, averaged over correctable_window_seconds",
        min=0,
    )
    correctable_window_seconds: float = opt(300.0, "the window of that average", min=30, max=86400)
    hold_seconds: float = opt(
        600.0,
        "a fatal or non-fatal error keeps its alert firing this long after the last rise",
        min=0,
        max=86400,
    )


@dataclass(frozen=True)
class UdevConfig:
    enabled: bool = opt(True, "re-poll a source at once on udev add/remove/change events")
    fallback_interval: float = opt(
        60.0, "without udev, how often the udev source checks whether it has appeared", min=1
    )
    debounce_seconds: float = opt(
        1.0, "nudge one source at most this often, however many events arrive", min=0
    )


@dataclass(frozen=True)
class StuckConfig:
    """Thresholds of the stuck-GPU (suspected NCCL hang) detector, health/stuck.py."""

    enabled: bool = opt(True, "flag a GPU busy at idle power with no memory traffic")
    min_utilization: float = opt(0.95, "GPU utilisation at or above this (ratio)", min=0, max=1)
    max_memory_utilization: float = opt(
        0.02, "memory-controller utilisation at or below this (ratio)", min=0, max=1
    )
    max_power_ratio: float = opt(
        0.3, "power draw at or below this fraction of the power limit", min=0, max=1
    )
    min_duration_seconds: float = opt(
        300.0, "the pattern must hold this long before the warning", min=0
    )
    max_gap_seconds: float = opt(
        120.0, "a gap between readings longer than this restarts the clock", min=1
    )


@dataclass(frozen=True)
class WorkloadsConfig:
    enabled: bool = opt(True, "name the pod, Slurm job and rank of each GPU process")
    kubelet_socket: str = opt(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        "kubelet pod-resources socket (asked at most once per NVML poll); absent = no pod names",
    )
    call_timeout: float = opt(2.0, "seconds one kubelet or Slurm call may take", min=0.05, max=60)
    slurm: bool = opt(True, "ask Slurm (scontrol/squeue) for job name and user, cached per job")
    rank_env: bool = opt(
        True, "read RANK, LOCAL_RANK, WORLD_SIZE... from /proc/PID/environ (only those names)"
    )
    keep_seconds: float = opt(
        600.0, "remember an exited GPU process this long, for Xids reported after it died", min=0
    )


@dataclass(frozen=True)
class SourcesConfig:
    nvml: NvmlConfig = section(NvmlConfig, "NVIDIA Management Library")
    kmsg: KmsgConfig = section(KmsgConfig, "kernel log (Xid, SXid)")
    shm: ShmConfig = section(ShmConfig, "/dev/shm")
    memory: MemoryConfig = section(MemoryConfig, "memory pressure (PSI, memory cgroups)")
    infiniband: InfinibandConfig = section(InfinibandConfig, "InfiniBand ports")
    aer: AerConfig = section(AerConfig, "PCIe Advanced Error Reporting counters")
    udev: UdevConfig = section(UdevConfig, "hotplug events")
    workloads: WorkloadsConfig = section(WorkloadsConfig, "pods, Slurm jobs and ranks on each GPU")


@dataclass(frozen=True)
class HealthConfig:
    expected_gpus: int = opt(
        0, "GPUs this node should have; 0 = the count seen at first start", min=0, max=1024
    )
    disabled_rules: list[str] = opt([], "alert names to switch off, e.g. [GpuPcieDegraded]")
    for_seconds: dict[str, float] = opt(
        {
            "GpuTemperatureHigh": 120.0,
            "GpuThermalSlowdown": 60.0,
            "GpuPcieDegraded": 300.0,
            "GpuFabricNotRegistered": 300.0,
            "FabricManagerDown": 60.0,
            "InfinibandPhysicalStateNotLinkUp": 60.0,
            "InfinibandRateDegraded": 60.0,
        },
        "how long a condition must last before it counts, per alert name (Prometheus `for:`)",
    )
    temperature_margin_celsius: float = opt(
        5.0, "warn when a GPU is this close to its slowdown temperature", min=0, max=50
    )
    slowdown_reasons: list[str] = opt(
        ["hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown"],
        "clock-event reasons that raise GpuThermalSlowdown while active",
    )
    ecc_hold_seconds: float = opt(
        3600.0, "an uncorrectable ECC error keeps GpuEccUncorrectable active this long", min=0
    )
    rate_window_seconds: float = opt(
        300.0,
        "window over which error-counter rates (NVLink, PCIe, InfiniBand) are taken",
        min=10,
        max=86400,
    )
    nvlink_error_rate: float = opt(
        0.0,
        "NVLink replay, recovery or CRC errors per second on one link above which"
        " GpuNvlinkErrors is raised (0: any rise within the rate window, as DCGM's health"
        " watch; corrected errors never count)",
        min=0,
    )
    pcie_replay_rate: float = opt(0.1, "PCIe replays per second that raise GpuPcieDegraded", min=0)
    pcie_gen_min_utilization: float = opt(
        0.5,
        "PCIe generation below max counts only while the GPU is at least this busy"
        " (idle GPUs downshift); above 1 disables the generation check",
        min=0,
        max=2,
    )
    collector_failure_seconds: float = opt(
        120.0, "a collector failing for this long raises GpuwatchdCollectorFailed", min=0
    )
    startup_grace_seconds: float = opt(
        60.0,
        "after a start, wait this long for every source before resolving old alerts",
        min=0,
        max=3600,
    )
    stuck: StuckConfig = section(StuckConfig, "stuck GPU (suspected NCCL hang) detector")


@dataclass(frozen=True)
class AlertmanagerConfig:
    urls: list[str] = opt([], "Alertmanager base URLs (each one, not a load balancer)")
    resend_interval: float = opt(
        60.0, "re-send firing alerts this often (endsAt = now + 4 x this)", min=1, max=3600
    )
    timeout: float = opt(10.0, "HTTP timeout of one POST", min=0.1, max=300)
    external_url: str = opt(
        "", "base URL of this daemon for generatorURL; empty = http://<node>:<port>"
    )
    runbook_base_url: str = opt(
        "", "runbook_url = this + /<alertname>.md (e.g. your copy of docs/runbooks); empty = none"
    )
    static_labels: dict[str, str] = opt({}, "labels added to every alert, e.g. cluster, rack")
    tls_ca_file: str = opt("", "CA bundle to verify Alertmanager's certificate")
    tls_cert_file: str = opt("", "client certificate (mutual TLS)")
    tls_key_file: str = opt("", "client key (mutual TLS)")
    tls_insecure_skip_verify: bool = opt(False, "do not verify Alertmanager's certificate")
    basic_auth_user: str = opt("", "HTTP basic auth user")
    basic_auth_password_file: str = opt("", "file holding the basic auth password")
    bearer_token_file: str = opt("", "file holding a bearer token (re-read on every send)")
    max_alerts: int = opt(
        10000,
        "bound of the durable alert queue; beyond it new alerts are dropped and counted",
        min=10,
        max=10_000_000,
    )
    retry_max_seconds: float = opt(
        60.0, "longest wait between retries to an unreachable Alertmanager", min=1, max=3600
    )


_ACTIONS = (
    "",
    "none",
    "restart_app",
    "reset_gpu",
    "reboot_node",
    "drain_and_inspect",
    "contact_support",
)


@dataclass(frozen=True)
class XidRule:
    """Site policy for one Xid or SXid code (`xid.overrides.<code>`)."""

    severity: str = opt(
        "",
        "override the catalog severity; empty = keep",
        choices=("", "info", "warning", "critical"),
    )
    action: str = opt("", "override the catalog action; empty = keep", choices=_ACTIONS)
    name: str = opt("", "name for a code the catalog lacks (or a site-specific name)")
    remediation: str = opt("", "what your operators should do; empty = the catalog's text")
    ignore: bool = opt(False, "record and count it, but never make it active or alert")
    threshold: int = opt(
        1, "reports on one GPU within `window` before it counts as active", min=1, max=1_000_000
    )
    window: float = opt(0.0, "seconds for `threshold`; 0 = xid.burst_window", min=0, max=604800)
    hold: float = opt(
        -1.0, "seconds a non-critical report stays active; -1 = xid.warning_hold", min=-1
    )


@dataclass(frozen=True)
class XidConfig:
    overrides: dict[str, XidRule] = opt(
        {}, "per-code site policy, e.g. {13: {severity: critical}, 45: {ignore: true}}"
    )
    sxid_overrides: dict[str, XidRule] = opt({}, "the same for NVSwitch SXid codes")
    alert_cmdline: bool = opt(
        False,
        "put a process's full command line (arguments may hold tokens) in alert text;"
        " off = its name only",
    )
    burst_window: float = opt(
        60.0,
        "repeats of one code on one GPU within this many seconds are one event",
        min=0,
        max=86400,
    )
    warning_hold: float = opt(
        600.0, "a warning (not critical) Xid stays active this long after its last report", min=0
    )
    escalate_after: int = opt(
        3,
        "an Xid seen in this many boots or GPU resets turns reset_gpu/reboot_node into"
        " drain_and_inspect; 0 = never",
        min=0,
        max=1000,
    )
    escalate_window_days: float = opt(
        30.0, "how far back boots and resets count for escalation", min=1, max=3650
    )
    nvml_merge_window: float = opt(
        10.0,
        "an NVML Xid event and a kernel log report of the same GPU and code this close"
        " in time are one event",
        min=0,
        max=600,
    )
    nvml_hold: float = opt(
        2.0,
        "wait this long for the kernel log report before publishing an NVML-only Xid",
        min=0,
        max=60,
    )


@dataclass(frozen=True)
class StoreConfig:
    max_events: int = opt(100000, "events kept in the SQLite store", min=100)
    max_age_days: float = opt(90.0, "events older than this are pruned", min=1)


@dataclass(frozen=True)
class Config:
    http: HttpConfig = section(HttpConfig, "HTTP endpoints")
    paths: PathsConfig = section(PathsConfig, "filesystem roots")
    daemon: DaemonConfig = section(DaemonConfig, "process-wide settings")
    sources: SourcesConfig = section(SourcesConfig, "data sources")
    health: HealthConfig = section(HealthConfig, "health rules")
    alertmanager: AlertmanagerConfig = section(AlertmanagerConfig, "alert delivery")
    store: StoreConfig = section(StoreConfig, "event store")
    xid: XidConfig = section(XidConfig, "Xid/SXid classification, bursts and escalation")
    hangs: HangsConfig = section(HangsConfig, "job hang detection and forensics (RAS, stacks)")
    remediation: RemediationConfig = section(
        RemediationConfig, "opt-in actions: Slurm drain, Kubernetes condition and taint"
    )
    diag: DiagConfig = section(DiagConfig, "active GPU checks on an idle node (docs/diag.md)")
    evidence: EvidenceConfig = section(EvidenceConfig, "evidence bundles before remediation")
