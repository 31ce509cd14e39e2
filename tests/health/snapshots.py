"""Build NodeSnapshots for rule and engine tests.

Identities and baseline values come from the real 2 x H200 capture
(shared fixtures: h200x2-nvml-probe.json, driver 580.159.04): UUIDs, bus
ids, slowdown threshold 89 C, PCIe Gen5 x16, NVLink CRC counts. Tests
change one reading at a time from that healthy baseline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuwatchd.model import Sample, SourceSnapshot, labels_of
from gpuwatchd.state import NodeSnapshot

GPU0 = {
    "gpu": "0",
    "uuid": "GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6",
    "pci_bus_id": "0000:00:06.0",
}
GPU1 = {
    "gpu": "1",
    "uuid": "GPU-cb99ac69-31a4-2508-9794-b7f3ed611416",
    "pci_bus_id": "0000:00:07.0",
}
T0 = 1_700_000_000.0


def gpu_samples(gpu: Mapping[str, str], **over: float) -> list[Sample]:
    """A healthy H200 as the capture shows it; `over` replaces readings by short key."""
    v = {
        "temp": 34,
        "mem_temp": 35,
        "slowdown": 89,
        "memory_max": 95,
        "util": 0.0,
        "ecc_unc_vol": 0,
        "ecc_unc_agg": 0,
        "remap_pending": 0,
        "remap_failure": 0,
        "gen": 5,
        "max_gen": 5,
        "width": 16,
        "max_width": 16,
        "replays": 0,
        "recovery": 0,
        "nvml_state": 0,
        "link3_crc": 0,
        "link3_ecc": 4,
        "link3_up": 1,
        "hw_slowdown": 0,
        **over,
    }
    g = dict(gpu)

    def s(name: str, value: float, **labels: str) -> Sample:
        return Sample.of(name, value, **g, **labels)

    out = [
        Sample("gpuwatchd_gpu_info", 1.0, labels_of({**g, "name": "NVIDIA H200"})),
        s("gpuwatchd_gpu_nvml_state", v["nvml_state"]),
        s("gpuwatchd_gpu_temperature_celsius", v["temp"], sensor="gpu"),
        s("gpuwatchd_gpu_temperature_celsius", v["mem_temp"], sensor="memory"),
        s("gpuwatchd_gpu_temperature_threshold_celsius", v["slowdown"], threshold="slowdown"),
        s("gpuwatchd_gpu_temperature_threshold_celsius", v["memory_max"], threshold="memory_max"),
        s("gpuwatchd_gpu_utilization_ratio", v["util"], engine="gpu"),
        s(
            "gpuwatchd_gpu_ecc_errors_total",
            v["ecc_unc_vol"],
            error="uncorrected",
            scope="volatile",
        ),
        s(
            "gpuwatchd_gpu_ecc_errors_total",
            v["ecc_unc_agg"],
            error="uncorrected",
            scope="aggregate",
        ),
        s("gpuwatchd_gpu_ecc_errors_total", 0, error="corrected", scope="volatile"),
        s("gpuwatchd_gpu_row_remap_pending", v["remap_pending"]),
        s("gpuwatchd_gpu_row_remap_failure", v["remap_failure"]),
        s("gpuwatchd_gpu_pcie_link_generation", v["gen"], which="current"),
        s("gpuwatchd_gpu_pcie_link_generation", v["max_gen"], which="max"),
        s("gpuwatchd_gpu_pcie_link_width", v["width"], which="current"),
        s("gpuwatchd_gpu_pcie_link_width", v["max_width"], which="max"),
        s("gpuwatchd_gpu_pcie_replays_total", v["replays"]),
        s("gpuwatchd_gpu_recovery_action", v["recovery"]),
        s("gpuwatchd_gpu_clock_event_active", 1, reason="gpu_idle"),
        s("gpuwatchd_gpu_clock_event_active", v["hw_slowdown"], reason="hw_slowdown"),
        s("gpuwatchd_nvlink_up", v["link3_up"], link="3"),
        s("gpuwatchd_nvlink_up", 1, link="4"),
        s("gpuwatchd_nvlink_errors_total", v["link3_crc"], link="3", error="crc"),
        s("gpuwatchd_nvlink_errors_total", 0, link="4", error="replay"),
        s("gpuwatchd_nvlink_corrected_errors_total", v["link3_ecc"], link="3", error="ecc_data"),
    ]
    if "retired_pending" in over:
        out.append(s("gpuwatchd_gpu_retired_pages_pending", over["retired_pending"]))
    return out


@dataclass
class Node:
    """Mutable description of a node from which snapshots are cut."""

    gpus: dict[str, dict[str, float]] = field(
        default_factory=lambda: {GPU0["uuid"]: {}, GPU1["uuid"]: {}}
    )
    nvml_ok: bool = True
    nvml_error: str = ""
    extra_sources: dict[str, list[Sample]] = field(default_factory=dict)
    failing: dict[str, str] = field(default_factory=dict)

    def snapshot(self, t: float) -> NodeSnapshot:
        samples: list[Sample] = []
        if self.nvml_ok:
            for ident in (GPU0, GPU1):
                if ident["uuid"] in self.gpus:
                    samples.extend(gpu_samples(ident, **self.gpus[ident["uuid"]]))
            samples.append(Sample.of("gpuwatchd_gpus_visible", len(self.gpus)))
        sources = {"nvml": source("nvml", samples, t, self.nvml_ok, self.nvml_error)}
        for name, extra in self.extra_sources.items():
            err = self.failing.get(name, "")
            sources[name] = source(name, extra, t, not err, err)
        return NodeSnapshot(sources=MappingProxyType(sources))


def source(
    name: str, samples: Iterable[Sample], t: float, ok: bool = True, error: str = ""
) -> SourceSnapshot:
    return SourceSnapshot(
        name, tuple(samples), ok, error, timestamp=t, last_success=t if ok else 0.0
    )


def ib_port(
    device: str = "mlx5_0",
    port: str = "1",
    *,
    state: int = 4,
    phys: int = 5,
    rate: float = 50e9,
    expected: float = 50e9,
    expected_up: int = 1,
    symbol_errors: float = 0,
) -> list[Sample]:
    """One InfiniBand port as the infiniband source exports it (NDR 400 Gb/s = 50e9 B/s)."""
    lab = {"device": device, "port": port}
    return [
        Sample.of("gpuwatchd_infiniband_state_id", state, **lab),
        Sample.of("gpuwatchd_infiniband_physical_state_id", phys, **lab),
        Sample.of("gpuwatchd_infiniband_rate_bytes_per_second", rate, **lab),
        Sample.of("gpuwatchd_infiniband_expected_rate_bytes_per_second", expected, **lab),
        Sample.of("gpuwatchd_infiniband_port_expected_up", expected_up, **lab),
        Sample.of("gpuwatchd_infiniband_symbol_error_total", symbol_errors, **lab),
    ]
