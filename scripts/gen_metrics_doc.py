"""Generate docs/metrics.md: one table of every metric gpuwatchd exports.

The table is built from the METRICS tuples in the code, so it cannot
drift: tests/test_metrics_doc.py fails when the file is stale.

    python scripts/gen_metrics_doc.py           # rewrite docs/metrics.md
    python scripts/gen_metrics_doc.py --check   # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuwatchd.model import MetricSpec  # noqa: E402

DOC = ROOT / "docs" / "metrics.md"

# Everything that publishes samples, as (module, attribute, producer shown in the table).
# The attribute is a tuple of MetricSpec or a function returning one. "sources" expands
# to every registered source. Add a producer here when it starts publishing samples.
PRODUCERS: tuple[tuple[str, str, str], ...] = (
    ("gpuwatchd.sources", "registry", "sources"),
    ("gpuwatchd.health.engine", "METRICS", "health"),
    ("gpuwatchd.health.xid.stage", "METRICS", "xid"),
    ("gpuwatchd.health.hangs.ports", "METRICS", "hangs"),
    ("gpuwatchd.health.slowdowns.monitor", "METRICS", "slowdowns"),
    ("gpuwatchd.sinks.store", "METRICS", "store"),
    ("gpuwatchd.sinks.evidence", "METRICS", "evidence"),
    ("gpuwatchd.sinks.alertmanager.sink", "METRICS", "alerts"),
    ("gpuwatchd.sinks.remediation.sink", "METRICS", "remediation"),
    ("gpuwatchd.diag.scheduler", "METRICS", "diag"),
    ("gpuwatchd.sinks.prometheus", "DAEMON_METRICS", "daemon"),
    ("gpuwatchd.pipeline.daemon", "PIPELINE_METRICS", "consumer"),
    ("gpuwatchd.runmarker", "METRICS", "daemon"),
    ("gpuwatchd.http.counters", "HTTP_METRICS", "http"),
)

# The nearest dcgm-exporter field (DCGM_FI_*) for metrics that have one. Units and
# scales differ (DCGM reports %, MiB and mJ where gpuwatchd uses ratios, bytes, joules).
DCGM: dict[str, str] = {
    "gpuwatchd_gpus_visible": "DCGM_FI_DEV_COUNT",
    "gpuwatchd_gpu_info": "labels UUID, modelName, pci_bus_id, DCGM_FI_DRIVER_VERSION",
    "gpuwatchd_gpu_temperature_celsius": (
        "DCGM_FI_DEV_GPU_TEMP (sensor=gpu), DCGM_FI_DEV_MEMORY_TEMP (sensor=memory)"
    ),
    "gpuwatchd_gpu_temperature_threshold_celsius": (
        "DCGM_FI_DEV_SLOWDOWN_TEMP, DCGM_FI_DEV_SHUTDOWN_TEMP"
    ),
    "gpuwatchd_gpu_power_watts": "DCGM_FI_DEV_POWER_USAGE",
    "gpuwatchd_gpu_power_limit_watts": "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
    "gpuwatchd_gpu_energy_joules_total": "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)",
    "gpuwatchd_gpu_utilization_ratio": (
        "DCGM_FI_DEV_GPU_UTIL (engine=gpu), DCGM_FI_DEV_MEM_COPY_UTIL (engine=memory); in %"
    ),
    "gpuwatchd_gpu_memory_used_bytes": "DCGM_FI_DEV_FB_USED (MiB)",
    "gpuwatchd_gpu_memory_free_bytes": "DCGM_FI_DEV_FB_FREE (MiB)",
    "gpuwatchd_gpu_memory_capacity_bytes": "DCGM_FI_DEV_FB_TOTAL (MiB)",
    "gpuwatchd_gpu_clock_event_active": "DCGM_FI_DEV_CLOCKS_EVENT_REASONS (one bitmask)",
    "gpuwatchd_gpu_ecc_enabled": "DCGM_FI_DEV_ECC_CURRENT, DCGM_FI_DEV_ECC_PENDING",
    "gpuwatchd_gpu_ecc_errors_total": ("DCGM_FI_DEV_ECC_{SBE,DBE}_{VOL,AGG}_TOTAL"),
    "gpuwatchd_gpu_retired_pages_total": "DCGM_FI_DEV_RETIRED_SBE, DCGM_FI_DEV_RETIRED_DBE",
    "gpuwatchd_gpu_retired_pages_pending": "DCGM_FI_DEV_RETIRED_PENDING",
    "gpuwatchd_gpu_remapped_rows_total": (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS, DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
    ),
    "gpuwatchd_gpu_row_remap_pending": "DCGM_FI_DEV_ROW_REMAP_PENDING",
    "gpuwatchd_gpu_row_remap_failure": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "gpuwatchd_gpu_pcie_link_generation": (
        "DCGM_FI_DEV_PCIE_LINK_GEN, DCGM_FI_DEV_PCIE_MAX_LINK_GEN"
    ),
    "gpuwatchd_gpu_pcie_link_width": "DCGM_FI_DEV_PCIE_LINK_WIDTH, DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH",
    "gpuwatchd_gpu_pcie_replays_total": "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "gpuwatchd_nvlink_errors_total": ("DCGM_FI_DEV_NVLINK_ERROR_DL_{REPLAY,RECOVERY,CRC}"),
    "gpuwatchd_nvlink_corrected_errors_total": (
        "DCGM_FI_DEV_NVLINK_{CRC_FLIT,CRC_DATA,ECC_DATA}_ERROR_COUNT_TOTAL (all links;"
        " not supported on Hopper)"
    ),
    "gpuwatchd_xid_errors_total": "DCGM_FI_DEV_XID_ERRORS (there: the last Xid code, a gauge)",
    "gpuwatchd_gpu_memory_reserved_bytes": "DCGM_FI_DEV_FB_RESERVED (MiB)",
    "gpuwatchd_gpu_clock_hertz": (
        "DCGM_FI_DEV_SM_CLOCK (clock=sm), DCGM_FI_DEV_MEM_CLOCK (clock=memory); MHz"
    ),
    "gpuwatchd_gpu_clock_max_hertz": "DCGM_FI_DEV_MAX_SM_CLOCK, DCGM_FI_DEV_MAX_MEM_CLOCK; MHz",
    "gpuwatchd_gpu_clock_application_hertz": (
        "DCGM_FI_DEV_APP_SM_CLOCK, DCGM_FI_DEV_APP_MEM_CLOCK; MHz"
    ),
    "gpuwatchd_gpu_performance_state": "DCGM_FI_DEV_PSTATE",
    "gpuwatchd_gpu_clock_event_seconds_total": (
        "DCGM_FI_DEV_POWER_VIOLATION (sw_power_cap), DCGM_FI_DEV_SYNC_BOOST_VIOLATION "
        "(sync_boost), DCGM_FI_DEV_THERMAL_VIOLATION; in us"
    ),
    # GPM: the same quantities as DCGM's profiling fields, from NVML without DCGM
    "gpuwatchd_gpu_sm_active_ratio": "DCGM_FI_PROF_SM_ACTIVE",
    "gpuwatchd_gpu_sm_occupancy_ratio": "DCGM_FI_PROF_SM_OCCUPANCY",
    "gpuwatchd_gpu_pipe_active_ratio": (
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE (pipe=tensor), DCGM_FI_PROF_PIPE_FP64_ACTIVE (fp64), "
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE (fp32), DCGM_FI_PROF_PIPE_FP16_ACTIVE (fp16)"
    ),
    "gpuwatchd_gpu_dram_active_ratio": "DCGM_FI_PROF_DRAM_ACTIVE",
    "gpuwatchd_gpu_pcie_bytes_per_second": (
        "DCGM_FI_PROF_PCIE_RX_BYTES (direction=rx), DCGM_FI_PROF_PCIE_TX_BYTES (tx)"
    ),
    "gpuwatchd_gpu_nvlink_bytes_per_second": (
        "DCGM_FI_PROF_NVLINK_RX_BYTES (direction=rx), DCGM_FI_PROF_NVLINK_TX_BYTES (tx)"
    ),
    "gpuwatchd_mig_device_info": "labels GPU_I_ID, GPU_I_PROFILE of every dcgm-exporter series",
    "gpuwatchd_gpu_fabric_state": "DCGM_FI_DEV_FABRIC_MANAGER_STATUS",
    "gpuwatchd_gpu_fabric_info": (
        "DCGM_FI_DEV_FABRIC_CLIQUE_ID, DCGM_FI_DEV_FABRIC_CLUSTER_UUID, "
        "DCGM_FI_DEV_FABRIC_MANAGER_ERROR_CODE"
    ),
}

HEADER = """# Metrics

Every metric gpuwatchd exports on `/metrics`. Generated by
`scripts/gen_metrics_doc.py` from the `METRICS` tables in the code; do not
edit by hand (`tests/test_metrics_doc.py` fails when this file is stale).

Types: `counter` names end in `_total`; `info` metrics carry strings as
labels and always have the value 1 (exposed as gauges). The last column
names the nearest dcgm-exporter field, where there is one, for porting
dashboards; units differ where noted.
"""


def collect() -> list[tuple[str, MetricSpec]]:
    """(producer, spec) for every metric, in PRODUCERS order; names must be unique."""
    out: list[tuple[str, MetricSpec]] = []
    seen: dict[str, MetricSpec] = {}
    for module, attr, producer in PRODUCERS:
        obj = getattr(importlib.import_module(module), attr)
        groups: Iterable[tuple[str, Iterable[MetricSpec]]]
        if attr == "registry":
            groups = [(name, spec.metrics) for name, spec in obj().items()]
        else:
            groups = [(producer, obj() if callable(obj) else obj)]
        for who, specs in groups:
            for spec in specs:
                if spec.name in seen:
                    if seen[spec.name] != spec:
                        raise SystemExit(f"{spec.name} is declared twice, differently ({who})")
                    continue
                seen[spec.name] = spec
                out.append((who, spec))
    unknown = sorted(set(DCGM) - set(seen))
    if unknown:
        raise SystemExit(f"DCGM mapping names metrics nobody exports: {', '.join(unknown)}")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The full text of docs/metrics.md."""
    rows = [
        "| Metric | Type | Labels | Producer | Meaning | dcgm-exporter |",
        "|---|---|---|---|---|---|",
    ]
    for producer, spec in collect():
        labels = ", ".join(f"`{label}`" for label in spec.labels)
        dcgm = DCGM.get(spec.name, "")
        rows.append(
            f"| `{spec.name}` | {spec.type} | {labels} | {producer} | {_cell(spec.help)} "
            f"| {_cell(dcgm)} |"
        )
    return HEADER + "\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate docs/metrics.md from the code.")
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/metrics.md is stale")
    args = ap.parse_args(argv)
    text = render()
    current = DOC.read_text() if DOC.exists() else ""
    if args.check:
        if current != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python scripts/gen_metrics_doc.py")
            return 1
        return 0
    if current != text:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(text)
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
