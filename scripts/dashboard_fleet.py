"""The panels of the gpuwatchd / Fleet dashboard (all GPU nodes), as data."""

from __future__ import annotations

from dashboard_panels import EMPTY, HEALTH_TEXT, NODE_KEYS, P, S, row

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
    P("table", "Most PCIe AER errors (time range)", [
        (f"topk(10, sum by ({NODE_KEYS}, pci_bus_id, role, severity) (increase("
         f"gpuwatchd_pcie_aer_errors_total{{{S}}}[$__range])))", ""),
    ], instant=True),
    P("table", "Collectors, failing first", [
        (f"sort(min by ({NODE_KEYS}, collector) (gpuwatchd_collector_success{{{S}}}))", ""),
    ], instant=True),
]  # fmt: skip
