"""The panels of the gpuwatchd / Node dashboard (one GPU node), as data."""

from __future__ import annotations

from dashboard_panels import EMPTY, FLAG_TEXT, HEALTH_TEXT, UP_TEXT, G, P, S, row

NODE: list[P] = [
    row("Health"),
    P(
        "stat",
        "Node health",
        [(f'max(gpuwatchd_health{{{S}, scope="node"}})', "")],
        6,
        5,
        description="gpuwatchd's verdict for the node: the worst open condition.",
        mapping=HEALTH_TEXT,
    ),
    P(
        "stat",
        "GPUs visible / expected",
        [
            (f"max(gpuwatchd_gpus_visible{{{S}}})", "visible"),
            (f"max(gpuwatchd_gpus_expected{{{S}}})", "expected"),
        ],
        6,
        5,
        description="A GPU that fell off the bus disappears from NVML: visible drops below"
        " expected.",
    ),
    P(
        "stat",
        "Open conditions",
        [(f"sum by (severity) (gpuwatchd_health_conditions{{{S}}})", "{{severity}}")],
        6,
        5,
    ),
    P(
        "stat",
        "Kernel log reader",
        [(f"max by (backend) (gpuwatchd_kmsg_reader_up{{{S}}})", "{{backend}}")],
        6,
        5,
        description="Xid/SXid detection depends on it: 0 means the kernel log is not read.",
        mapping=UP_TEXT,
    ),
    P(
        "table",
        "GPU status",
        [
            (f'max by (gpu, uuid, pci_bus_id) (gpuwatchd_health{{{G}, scope="gpu"}})', ""),
            (f"max by (gpu, uuid, pci_bus_id) (gpuwatchd_gpu_nvml_state{{{G}}})", ""),
            (f"max by (gpu, uuid, pci_bus_id) (gpuwatchd_gpu_reset_required{{{G}}})", ""),
            (
                f"max by (gpu, uuid, pci_bus_id) (gpuwatchd_gpu_drain_and_reset_recommended{{{G}}})",  # noqa: E501
                "",
            ),
            (
                "max by (gpu, uuid, pci_bus_id, name, serial, vbios_version, driver_version)"
                f" (gpuwatchd_gpu_info{{{G}}})",
                "",
            ),
        ],
        24,
        8,
        description="Per-GPU health, NVML state (ok / unresponsive / lost) and the"
        " driver's reset verdicts.",
        instant=True,
    ),
    P(
        "table",
        "Who is on which GPU",
        [
            (
                "max by (gpu, uuid, pci_bus_id, namespace, pod, container, slurm_job)"
                f" (gpuwatchd_gpu_workload_info{{{G}}})",
                "",
            ),
        ],
        24,
        7,
        description=EMPTY.replace("nothing is wrong", "no process runs on the GPUs")
        + "The pod or Slurm job of each GPU process (gpuwatchd_gpu_workload_info).",
        instant=True,
    ),
    row("Temperature and power"),
    P(
        "timeseries",
        "GPU temperature vs slowdown",
        [
            (f'gpuwatchd_gpu_temperature_celsius{{{G}, sensor="gpu"}}', "GPU {{gpu}}"),
            (
                f'min(gpuwatchd_gpu_temperature_threshold_celsius{{{G}, threshold="slowdown"}})',
                "slowdown",
            ),
            (
                f'min(gpuwatchd_gpu_temperature_threshold_celsius{{{G}, threshold="shutdown"}})',
                "shutdown",
            ),
        ],
        unit="celsius",
    ),
    P(
        "timeseries",
        "Memory (HBM) temperature vs limit",
        [
            (f'gpuwatchd_gpu_temperature_celsius{{{G}, sensor="memory"}}', "GPU {{gpu}}"),
            (
                f'min(gpuwatchd_gpu_temperature_threshold_celsius{{{G}, threshold="memory_max"}})',
                "memory max",
            ),
        ],
        unit="celsius",
    ),
    P(
        "timeseries",
        "Power vs enforced limit",
        [
            (f"gpuwatchd_gpu_power_watts{{{G}}}", "GPU {{gpu}}"),
            (f"gpuwatchd_gpu_power_limit_watts{{{G}}}", "limit GPU {{gpu}}"),
        ],
        unit="watt",
    ),
    P(
        "state-timeline",
        "Clock event reasons (throttling)",
        [
            (
                f"max by (gpu, reason) (gpuwatchd_gpu_clock_event_active{{{G}}})",
                "GPU {{gpu}} {{reason}}",
            ),
        ],
        description="gpu_idle is normal; hw_slowdown, hw_thermal_slowdown and hw_power_brake"
        " mean the GPU is being held back.",
        mapping=FLAG_TEXT,
    ),
    row("Memory errors"),
    P(
        "timeseries",
        "ECC errors (volatile) per second",
        [
            (
                f'sum by (gpu, error) (rate(gpuwatchd_gpu_ecc_errors_total{{{G}, scope="volatile"}}'
                "[$__rate_interval]))",
                "GPU {{gpu}} {{error}}",
            ),
        ],
        unit="short",
    ),
    P(
        "table",
        "ECC errors over the GPU's life (aggregate)",
        [
            (f'max by (gpu, error) (gpuwatchd_gpu_ecc_errors_total{{{G}, scope="aggregate"}})', ""),
        ],
        instant=True,
    ),
    P(
        "timeseries",
        "Remapped rows",
        [
            (
                f"max by (gpu, cause) (gpuwatchd_gpu_remapped_rows_total{{{G}}})",
                "GPU {{gpu}} {{cause}}",
            ),
        ],
        8,
        description="Uncorrectable remaps cost a bank; a pending remap needs a GPU reset.",
    ),
    P(
        "stat",
        "Row remap pending / failed",
        [
            (f"max by (gpu) (gpuwatchd_gpu_row_remap_pending{{{G}}})", "pending GPU {{gpu}}"),
            (f"max by (gpu) (gpuwatchd_gpu_row_remap_failure{{{G}}})", "failed GPU {{gpu}}"),
        ],
        8,
        mapping=FLAG_TEXT,
    ),
    P(
        "bargauge",
        "Row remapper bank availability",
        [
            (
                f"max by (gpu, availability) (gpuwatchd_gpu_row_remap_availability_banks{{{G}}})",
                "GPU {{gpu}} {{availability}}",
            ),
        ],
        8,
    ),
    row("NVLink"),
    P(
        "state-timeline",
        "NVLink state per link",
        [
            (f"max by (gpu, link) (gpuwatchd_nvlink_up{{{G}}})", "GPU {{gpu}} link {{link}}"),
        ],
        h=10,
        mapping=UP_TEXT,
    ),
    P(
        "timeseries",
        "NVLink errors per second by GPU",
        [
            (
                f"sum by (gpu, error) (rate(gpuwatchd_nvlink_gpu_errors_total{{{G}}}[$__rate_interval]))",  # noqa: E501
                "GPU {{gpu}} {{error}}",
            ),
        ],
        h=10,
        description="Replay, recovery and CRC errors as nvidia-smi nvlink -e counts them, summed"
        " over the GPU's links; any rise raises GpuNvlinkErrors. The link: the table below, or"
        " sources.nvml.nvlink_detail=link.",
    ),
    P(
        "timeseries",
        "NVLink corrected errors per second by GPU",
        [
            (
                f"sum by (gpu, error) (rate(gpuwatchd_nvlink_gpu_corrected_errors_total{{{G}}}[$__rate_interval]))",  # noqa: E501
                "GPU {{gpu}} {{error}}",
            ),
        ],
        h=10,
        description="CRC and ECC errors the links corrected (no replay, no recovery). They rise"
        " with traffic on healthy NVLink 4 links (hundreds per second per GPU under NCCL load);"
        " not faults, no alert. nvidia-smi nvlink -e does not show them.",
    ),
    P(
        "table",
        "NVLink links with errors",
        [
            (f"max by (gpu, link, error) (gpuwatchd_nvlink_errors_total{{{G}}})", ""),
        ],
        24,
        6,
        description=EMPTY + "Links whose error counters moved while gpuwatchd watched"
        " (all links with sources.nvml.nvlink_detail=link).",
        instant=True,
    ),
    row("PCIe"),
    P(
        "table",
        "PCIe link: current vs max",
        [
            (f"max by (gpu, which) (gpuwatchd_gpu_pcie_link_generation{{{G}}})", ""),
            (f"max by (gpu, which) (gpuwatchd_gpu_pcie_link_width{{{G}}})", ""),
        ],
        description="A link running below its maximum generation or width is degraded (at"
        " idle, generation may drop to save power).",
        instant=True,
    ),
    P(
        "timeseries",
        "PCIe replays and errors per second",
        [
            (
                f"sum by (gpu) (rate(gpuwatchd_gpu_pcie_replays_total{{{G}}}[$__rate_interval]))",
                "GPU {{gpu}} replays",
            ),
            (
                f"sum by (gpu, error) (rate(gpuwatchd_gpu_pcie_errors_total{{{G}}}[$__rate_interval]))",  # noqa: E501
                "GPU {{gpu}} {{error}}",
            ),
        ],
    ),
    row("Xid and SXid"),
    P(
        "timeseries",
        "Xid reports",
        [
            (
                f"sum by (gpu, xid, name) (increase(gpuwatchd_xid_errors_total{{{G}}}[$__rate_interval]))",  # noqa: E501
                "GPU {{gpu}} Xid {{xid}} {{name}}",
            ),
        ],
        24,
        description="Each bar is a kernel report of an Xid on a GPU, named from gpuwatchd's"
        " catalog.",
    ),
    P(
        "table",
        "Active Xid conditions",
        [
            (f"max by (gpu, xid, name, severity, action) (gpuwatchd_xid_active{{{G}}})", ""),
        ],
        description="Critical Xids stay active until the GPU is reset, the node reboots or an"
        " operator runs gpuwatchd clear.",
        instant=True,
    ),
    P(
        "table",
        "NVSwitch SXid conditions",
        [
            (
                f"max by (pci_bus_id, sxid, name, severity, action) (gpuwatchd_sxid_active{{{S}}})",
                "",
            ),
        ],
        instant=True,
    ),
    row("/dev/shm"),
    P(
        "timeseries",
        "/dev/shm used vs size",
        [
            (
                f"max(gpuwatchd_shm_size_bytes{{{S}}}) - max(gpuwatchd_shm_available_bytes{{{S}}})",
                "used",
            ),
            (f"max(gpuwatchd_shm_size_bytes{{{S}}})", "size"),
        ],
        8,
        unit="bytes",
    ),
    P(
        "timeseries",
        "NCCL segments by state",
        [(f"max by (state) (gpuwatchd_shm_segments{{{S}}})", "{{state}}")],
        8,
    ),
    P(
        "stat",
        "Stale NCCL segment bytes",
        [(f'max(gpuwatchd_shm_segment_bytes{{{S}, state="stale"}})', "stale")],
        8,
        unit="bytes",
        description="Left by ranks that died during NCCL setup; they fill /dev/shm until removed.",
    ),
    row("InfiniBand"),
    P(
        "table",
        "Ports",
        [
            (
                "max by (device, port, link_layer, state, physical_state)"
                f" (gpuwatchd_infiniband_port_info{{{S}}})",
                "",
            ),
            (f"max by (device, port) (gpuwatchd_infiniband_rate_bytes_per_second{{{S}}})", ""),
            (
                f"max by (device, port) (gpuwatchd_infiniband_expected_rate_bytes_per_second{{{S}}})",  # noqa: E501
                "",
            ),
        ],
        24,
        instant=True,
    ),
    P(
        "timeseries",
        "Port errors per second",
        [
            (
                f"sum by (device, port) (rate(gpuwatchd_infiniband_{name}{{{S}}}[$__rate_interval]))",  # noqa: E501
                f"{{{{device}}}}/{{{{port}}}} {legend}",
            )
            for name, legend in (
                ("symbol_error_total", "symbol"),
                ("link_error_recovery_total", "link recovery"),
                ("link_downed_total", "link downed"),
                ("port_errors_received_total", "rcv errors"),
            )
        ],
    ),
    P(
        "timeseries",
        "Port traffic",
        [
            (
                f"sum by (device, port) (rate(gpuwatchd_infiniband_port_data_{d}_bytes_total{{{S}}}"
                "[$__rate_interval]))",
                f"{{{{device}}}}/{{{{port}}}} {short}",
            )
            for d, short in (("received", "rx"), ("transmitted", "tx"))
        ],
        unit="Bps",
    ),
    row("PCIe AER"),
    P(
        "timeseries",
        "PCIe AER errors per second",
        [
            (
                "sum by (pci_bus_id, role, severity)"
                f" (rate(gpuwatchd_pcie_aer_errors_total{{{S}}}[$__rate_interval]))",
                "{{role}} {{pci_bus_id}} {{severity}}",
            )
        ],
        description="AER error messages of the GPUs, the NICs near them and the bridges up to"
        " the root port. Fatal: the link was reset; non-fatal: one transaction lost; correctable:"
        " replays. gpuwatchd_pcie_aer_available 0 means this node exposes no AER counters.",
    ),
    P(
        "table",
        "PCIe functions watched",
        [
            (
                "max by (pci_bus_id, role, root_port, gpus, nics)"
                f" (gpuwatchd_pcie_aer_device_info{{{S}}})",
                "",
            ),
        ],
        description="Each function whose AER counters are read and the GPUs (index) and NICs at"
        " or below it: the path an error on a bridge or root port affects.",
        instant=True,
    ),
    row("Daemon"),
    P(
        "table",
        "Collectors",
        [
            (f"min by (collector) (gpuwatchd_collector_success{{{S}}})", ""),
            (f"max by (collector) (gpuwatchd_collector_duration_seconds{{{S}}})", ""),
            (
                "time() - max by (collector)"
                f" (gpuwatchd_collector_last_success_timestamp_seconds{{{S}}})",
                "",
            ),
        ],
        instant=True,
    ),
    P(
        "timeseries",
        "Alerts firing and delivery queue",
        [
            (f"sum by (severity) (gpuwatchd_alerts_firing{{{S}}})", "firing {{severity}}"),
            (f"max(gpuwatchd_alertmanager_queue_length{{{S}}})", "queued for Alertmanager"),
        ],
    ),
    P(
        "table",
        "Remediation",
        [
            (f"max by (action) (gpuwatchd_remediation_engaged{{{S}}})", ""),
        ],
        description=EMPTY.replace("nothing is wrong", "remediation is off")
        + "Actions gpuwatchd took (Slurm drain, Kubernetes condition or taint) that are in effect"
        " until gpuwatchd clear --resume.",
        instant=True,
    ),
    P(
        "table",
        "Build",
        [(f"max by (version, python_version) (gpuwatchd_build_info{{{S}}})", "")],
        instant=True,
    ),
]
