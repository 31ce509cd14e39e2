"""Generate the Grafana dashboards in deploy/grafana/ with grafana-foundation-sdk.

The panels are data (the NODE and FLEET tables below); the SDK's typed
builders turn them into dashboard JSON that follows Grafana's schema. A test
fails when the files are stale.

    python scripts/gen_dashboards.py            # rewrite deploy/grafana/*.json and the chart copies
    python scripts/gen_dashboards.py --check    # exit 1 if any is stale

Every query is scoped with `cluster=~"$cluster", node=~"$node",
instance=~"$instance"`. Without the ServiceMonitor's `node` relabelling (or
without a `cluster` external label) the variables offer nothing but All
(`.*`), which also matches a missing label, and `$instance` picks the target;
tables group by `instance` as well as `node` so nodes stay apart either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import bargauge, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "deploy" / "grafana"
CHART_COPY = ROOT / "deploy" / "helm" / "gpuwatchd" / "files" / "dashboards"

S = 'cluster=~"$cluster", node=~"$node", instance=~"$instance"'
G = f'{S}, gpu=~"$gpu"'
NODE_KEYS = "cluster, node, instance"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
EMPTY = "Empty while nothing is wrong. "  # tests only check that such queries evaluate

HEALTH_TEXT = {"0": ("healthy", "green"), "1": ("degraded", "orange"), "2": ("unhealthy", "red")}
UP_TEXT = {"0": ("down", "red"), "1": ("up", "green")}
FLAG_TEXT = {"0": ("no", "green"), "1": ("yes", "red")}


@dataclass
class P:
    """One panel: kind, title, [(expr, legend)], width, height and options."""

    kind: str
    title: str
    targets: list[tuple[str, str]] = field(default_factory=list)
    w: int = 12
    h: int = 8
    unit: str = ""
    description: str = ""
    mapping: dict[str, tuple[str, str]] | None = None
    instant: bool = False


def row(title: str) -> P:
    return P("row", title, w=24, h=1)


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

_NODE_HEALTH = f'max by ({NODE_KEYS}) (gpuwatchd_health{{{S}, scope="node"}})'
FLEET: list[P] = [
    row("Fleet"),
    P("stat", "Nodes reporting",
      [(f"count(max by ({NODE_KEYS}) (gpuwatchd_build_info{{{S}}}))", "")], 4, 5),
    P("stat", "Unhealthy nodes", [(f"count({_NODE_HEALTH} == 2) or vector(0)", "")], 4, 5),
    P("stat", "Degraded nodes", [(f"count({_NODE_HEALTH} == 1) or vector(0)", "")], 4, 5),
    P("stat", "Unhealthy GPUs",
      [(f'count(gpuwatchd_health{{{S}, scope="gpu"}} == 2) or vector(0)', "")], 4, 5),
    P("stat", "GPUs missing", [
        (f"sum(max by ({NODE_KEYS}) (gpuwatchd_gpus_expected{{{S}}})"
         f" - max by ({NODE_KEYS}) (gpuwatchd_gpus_visible{{{S}}}))", ""),
    ], 4, 5, description="GPUs the nodes should have but NVML does not see (fallen off the"
      " bus, lost)."),
    P("stat", "Alerts firing",
      [(f"sum by (severity) (gpuwatchd_alerts_firing{{{S}}})", "{{severity}}")], 4, 5),
    P("bargauge", "Nodes by health", [
        (f"count({_NODE_HEALTH} == {v}) or vector(0)", text)
        for v, (text, _color) in sorted(HEALTH_TEXT.items())
    ], 8, 8, description="How many nodes are healthy, degraded (a warning) or unhealthy (a"
      " critical condition)."),
    P("table", "Nodes, worst first", [(f"sort_desc({_NODE_HEALTH})", "")], 8, 8,
      mapping=HEALTH_TEXT, instant=True),
    P("table", "GPUs, worst first", [
        (f"sort_desc(max by ({NODE_KEYS}, gpu, uuid) (gpuwatchd_health{{{S}, scope=\"gpu\"}}))",
         ""),
    ], 8, 8, mapping=HEALTH_TEXT, instant=True),
    row("Xid across the fleet"),
    P("bargauge", "Top Xids across the fleet (time range)", [
        ("topk(10, sum by (xid, name) (increase(gpuwatchd_xid_errors_total{"
         f"{S}}}[$__range])))", "Xid {{xid}} {{name}}"),
    ], 12, 9),
    P("timeseries", "Xid reports over time by code", [
        (f"sum by (xid, name) (increase(gpuwatchd_xid_errors_total{{{S}}}[$__rate_interval]))",
         "Xid {{xid}} {{name}}"),
    ], 12, 9),
    row("Jobs and hangs"),
    P("table", "Jobs hit: workloads on unhealthy GPUs", [
        (f"max by ({NODE_KEYS}, gpu, namespace, pod, slurm_job) ("
         f"gpuwatchd_gpu_workload_info{{{S}}} * on ({NODE_KEYS}, uuid) group_left ()"
         f' (max by ({NODE_KEYS}, uuid) (gpuwatchd_health{{{S}, scope="gpu"}}) > 0))', ""),
    ], 12, 8, description=EMPTY + "Pods and Slurm jobs with a process on a GPU that is degraded"
      " or unhealthy now.", instant=True),
    P("table", "Job hangs suspected", [
        (f"max by ({NODE_KEYS}, workload, namespace, pod, slurm_job, signature)"
         f" (gpuwatchd_job_hang_info{{{S}}})", ""),
    ], 12, 8, description=EMPTY + "Jobs gpuwatchd suspects to hang (JobHangSuspected), with"
      " the matched hang signature once forensics ran.", instant=True),
    P("table", "GPUs stuck (suspected NCCL hang)", [
        ('max by (cluster, node, gpu, uuid) (ALERTS{alertname="GpuStuckSuspected",'
         f' alertstate="firing", {S}}})', ""),
    ], 24, 6, description=EMPTY + "GPUs busy at idle power with no memory traffic (the"
      " GpuStuckSuspected rule).", instant=True),
    row("Top offenders"),
    P("table", "Most Xid reports (time range)", [
        (f"topk(10, sum by ({NODE_KEYS}, gpu, uuid) (increase(gpuwatchd_xid_errors_total"
         f"{{{S}}}[$__range])))", ""),
    ], instant=True),
    P("table", "Most remapped rows", [
        (f"topk(10, sum by ({NODE_KEYS}, gpu, uuid) (gpuwatchd_gpu_remapped_rows_total{{{S}}}))",
         ""),
    ], instant=True),
    P("table", "Most uncorrected ECC errors (GPU life)", [
        (f"topk(10, max by ({NODE_KEYS}, gpu, uuid) (gpuwatchd_gpu_ecc_errors_total{{{S},"
         ' error="uncorrected", scope="aggregate"}))', ""),
    ], instant=True),
    P("table", "Most NVLink errors (time range)", [
        (f"topk(10, sum by ({NODE_KEYS}, gpu) (increase(gpuwatchd_nvlink_gpu_errors_total"
         f"{{{S}}}[$__range])))", ""),
    ], instant=True),
    row("Fabric and daemons"),
    P("table", "InfiniBand ports, worst state first", [
        (f"sort(min by ({NODE_KEYS}, device, port) (gpuwatchd_infiniband_state_id{{{S}}}))", ""),
    ], instant=True),
    P("table", "Collectors, failing first", [
        (f"sort(min by ({NODE_KEYS}, collector) (gpuwatchd_collector_success{{{S}}}))", ""),
    ], instant=True),
]  # fmt: skip


def _mappings(text: dict[str, tuple[str, str]]) -> list[dm.ValueMapping]:
    return [
        dm.ValueMap(
            options={
                v: dm.ValueMappingResult(text=t, color=c, index=i)
                for i, (v, (t, c)) in enumerate(sorted(text.items()))
            }
        )
    ]


BUILDERS: dict[str, Any] = {
    "stat": stat.Panel,
    "table": table.Panel,
    "timeseries": timeseries.Panel,
    "bargauge": bargauge.Panel,
    "state-timeline": statetimeline.Panel,
}


def _panel(p: P, pid: int, pos: dm.GridPos) -> Any:
    if p.kind == "row":
        return gd.Row(p.title).id(pid).grid_pos(pos)
    b = BUILDERS[p.kind]().id(pid).title(p.title).datasource(DS).grid_pos(pos)
    if p.description:
        b = b.description(p.description)
    if p.unit:
        b = b.unit(p.unit)
    if p.mapping:
        b = b.mappings(_mappings(p.mapping))
    for i, (expr, legend) in enumerate(p.targets):
        q = gp.Dataquery().expr(expr).ref_id(chr(ord("A") + i)).datasource(DS)
        if legend:
            q = q.legend_format(legend)
        if p.instant:
            q = q.instant().format(pm.PromQueryFormat.TABLE)
        b = b.with_target(q)
    if p.kind == "table" and len(p.targets) > 1:
        b = b.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    return b


def _layout(panels: list[P]) -> list[tuple[P, dm.GridPos]]:
    out, x, y, row_h = [], 0, 0, 0
    for p in panels:
        if p.kind == "row" or x + p.w > 24:
            x, y, row_h = 0, y + row_h, 0
        out.append((p, dm.GridPos(h=p.h, w=p.w, x=x, y=y)))
        x, row_h = x + p.w, max(row_h, p.h)
        if p.kind == "row":
            x, y, row_h = 0, y + 1, 0
    return out


def _variable(name: str, label: str, query: str) -> Any:
    return (
        gd.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query({"query": query, "refId": name})
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(".*")
        .multi(True)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )


def build(uid: str, title: str, description: str, panels: list[P], gpu: bool) -> dict[str, Any]:
    """One dashboard as JSON-able data."""
    d = (
        gd.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["gpuwatchd", "gpu", "nvidia"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .refresh("1m")
        .time("now-6h", "now")
        .timezone("browser")
        .link(
            gd.DashboardLink("gpuwatchd dashboards")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["gpuwatchd"])
            .as_dropdown(False)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            _variable("cluster", "Cluster", "label_values(gpuwatchd_build_info, cluster)")
        )
        .with_variable(
            _variable(
                "node", "Node", 'label_values(gpuwatchd_build_info{cluster=~"$cluster"}, node)'
            )
        )
        .with_variable(
            _variable(
                "instance",
                "Target",
                'label_values(gpuwatchd_build_info{cluster=~"$cluster", node=~"$node"}, instance)',
            )
        )
    )
    if gpu:
        d = d.with_variable(
            _variable("gpu", "GPU", f"label_values(gpuwatchd_gpu_info{{{S}}}, gpu)")
        )
    for pid, (p, pos) in enumerate(_layout(panels), start=1):
        item = _panel(p, pid, pos)
        d = d.with_row(item) if p.kind == "row" else d.with_panel(item)
    data: dict[str, Any] = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    for panel in data["panels"]:
        if panel.get("options") is None:
            panel.pop("options", None)  # unset: Grafana applies the panel type's defaults
    return data


DASHBOARDS = {
    "gpuwatchd-node": (
        "gpuwatchd / Node",
        "One GPU node: health verdicts, thermals, memory errors, NVLink, PCIe, Xids, /dev/shm,"
        " InfiniBand, who runs on each GPU, and the daemon itself.",
        NODE,
        True,
    ),
    "gpuwatchd-fleet": (
        "gpuwatchd / Fleet",
        "All GPU nodes: nodes by health, GPUs worst first, top Xids across the fleet, jobs hit,"
        " hangs suspected, top offenders.",
        FLEET,
        False,
    ),
}


def render() -> dict[str, str]:
    """File name -> JSON text for every dashboard."""
    return {
        f"{uid}.json": json.dumps(build(uid, *spec), indent=2, sort_keys=True) + "\n"
        for uid, spec in DASHBOARDS.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = ap.parse_args()
    stale = []
    for name, text in render().items():
        for folder in (OUT, CHART_COPY):
            path = folder / name
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
                if not args.check:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(text)
    if args.check and stale:
        print("stale: " + ", ".join(stale) + " (run python scripts/gen_dashboards.py)")
        return 1
    for s in [] if args.check else stale:
        print(f"wrote {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
