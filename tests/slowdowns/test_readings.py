"""The detector's per-GPU readings from the NVML source's real samples, causes and the catalog."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.errors import ConfigError
from gpuwatchd.health.slowdowns.causes import catalog, node_causes, parse_catalog
from gpuwatchd.health.slowdowns.readings import GpuPace, paces_from_samples
from gpuwatchd.model import Action, Sample
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource

# Four H200 under a training load (tests/fixtures/nvml/PROVENANCE.md).
H200X4_LOAD = (
    Path(__file__).resolve().parent.parent / "fixtures" / "nvml" / "h200x4-load-record.json"
)


def test_the_nvml_sources_own_samples_fill_every_field_the_h200_has() -> None:
    clock = FakeClock(1000.0)
    client = ReplayClient.load(H200X4_LOAD, clock=clock)
    source = NvmlSource(client, clock=clock, call_timeout=2.0)
    try:
        for _ in range(3):  # GPM answers from the second poll on (a delta of two samples)
            samples = [i for i in source.poll(clock.time()) if isinstance(i, Sample)]
            clock.advance(10.0)
    finally:
        client.release()
        source.close()
    paces = paces_from_samples(samples)
    assert [p.gpu for p in paces] == ["0", "1", "2", "3"]
    for p in paces:
        assert p.utilization and p.sm_active and 0 < p.sm_active < 1 and p.tensor_active is not None
        assert p.sm_clock_hz and p.sm_clock_max_hz == 1.98e9  # what the replay's peers use
        assert (p.pcie_width, p.pcie_width_max, p.pcie_generation_max) == (16, 16, 5)
        assert p.ecc_corrected == 0 and p.nvlink_errors == 0 and p.clock_events == frozenset()
        assert p.compute() == p.sm_active


def test_clock_reasons_links_and_counters_are_read_by_label() -> None:
    samples = [
        Sample.of("gpuwatchd_gpu_clock_event_active", 1, gpu="3", reason="sw_thermal_slowdown"),
        Sample.of("gpuwatchd_gpu_clock_event_active", 1, gpu="3", reason="gpu_idle"),
        Sample.of("gpuwatchd_gpu_clock_event_active", 0, gpu="3", reason="sw_power_cap"),
        Sample.of("gpuwatchd_gpu_clock_hertz", 1.5e9, gpu="3", clock="sm"),
        Sample.of("gpuwatchd_gpu_clock_hertz", 2.6e9, gpu="3", clock="memory"),
        Sample.of("gpuwatchd_gpu_pcie_link_width", 8, gpu="3", which="current"),
        Sample.of("gpuwatchd_gpu_pcie_link_width", 16, gpu="3", which="max"),
        Sample.of("gpuwatchd_nvlink_errors_total", 4, gpu="3", link="0", error="replay"),
        Sample.of("gpuwatchd_nvlink_errors_total", 3, gpu="3", link="5", error="crc"),
        Sample.of(
            "gpuwatchd_gpu_ecc_errors_total", 9, gpu="3", error="corrected", scope="volatile"
        ),
        Sample.of(
            "gpuwatchd_gpu_ecc_errors_total", 99, gpu="3", error="corrected", scope="aggregate"
        ),
        Sample.of("gpuwatchd_gpu_utilization_ratio", 0.9, gpu="3", engine="gpu"),
        Sample.of("gpuwatchd_gpu_utilization_ratio", 0.2, gpu="3", engine="memory"),
        Sample.of("gpuwatchd_gpu_pipe_active_ratio", 0.4, gpu="3", pipe="tensor"),
        Sample.of("gpuwatchd_gpu_sm_active_ratio", 0.5, gpu="3", mig_uuid="MIG-1"),
    ]
    (p,) = paces_from_samples(samples)
    assert p.clock_events == {"sw_thermal_slowdown"}
    assert (p.sm_clock_hz, p.pcie_width, p.pcie_width_max) == (1.5e9, 8, 16)
    assert (p.nvlink_errors, p.ecc_corrected, p.utilization, p.tensor_active) == (7, 9, 0.9, 0.4)
    assert p.sm_active is None  # a MIG device's activity is not its GPU's


def _window(**fields: object) -> list[GpuPace]:
    return [replace(GpuPace("0", utilization=0.9, sm_active=0.4), **fields) for _ in range(6)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "cause"),
    [
        ({"clock_events": frozenset({"hw_thermal_slowdown"})}, "thermal_throttle"),
        ({"clock_events": frozenset({"sw_power_cap"})}, "power_cap"),
        ({"clock_events": frozenset({"hw_slowdown"})}, "hw_slowdown"),
        ({"sm_clock_hz": 1.6e9}, "clocks_low"),
        ({"pcie_width": 8, "pcie_width_max": 16}, "pcie_degraded"),
        ({"pcie_generation": 3, "pcie_generation_max": 5}, "pcie_degraded"),
    ],
)
def test_a_cause_on_the_gpu_and_not_its_peers_is_named(
    fields: dict[str, object], cause: str
) -> None:
    peer = _window(sm_clock_hz=1.98e9, pcie_width=16, pcie_width_max=16)
    gpu = _window(sm_clock_hz=1.98e9, pcie_width=16, pcie_width_max=16)
    gpu = [replace(p, **fields) for p in gpu]  # type: ignore[arg-type]
    assert [c.name for c in node_causes(gpu, [peer], 60.0)] == [cause]
    assert node_causes(peer, [peer], 60.0) == ()
    # the same reason on every GPU (a hot room, a node power cap) does not single one out
    if "clock_events" in fields:
        assert node_causes(gpu, [gpu], 60.0) == ()


def test_rising_counters_name_nvlink_errors_and_an_ecc_storm() -> None:
    gpu = [GpuPace("0", nvlink_errors=10.0 + i, ecc_corrected=100.0 * i) for i in range(6)]
    names = {c.name: c for c in node_causes(gpu, [[GpuPace("1")]], 60.0)}
    assert set(names) == {"nvlink_errors", "ecc_storm"} and names["nvlink_errors"].link == "nvlink"
    quiet = [GpuPace("0", nvlink_errors=10.0, ecc_corrected=float(i)) for i in range(6)]
    assert node_causes(quiet, [[GpuPace("1")]], 60.0) == ()


def test_the_shipped_catalog_covers_every_cause_the_detector_names() -> None:
    entries = catalog()
    named = {"thermal_throttle", "power_cap", "hw_slowdown", "clocks_low", "pcie_degraded"}
    named |= {"nvlink_errors", "ecc_storm", "unexplained"}
    assert set(entries) == named
    assert all(e.title and len(e.remediation) > 80 for e in entries.values())
    assert entries["unexplained"].action == Action.NONE


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("causes: {}", "causes: must be a list"),
        ("causes: [{name: x, title: t, remediation: r, action: fly}]", "causes[0].action"),
        ("causes: [{name: x, title: '', remediation: r, action: none}]", "causes[0].title"),
        ("causes: [{name: x, title: t, remediation: r, action: none}]", "needs an entry named"),
    ],
)
def test_a_bad_catalog_names_the_file_and_the_key(text: str, where: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_catalog(text, "causes.yaml")
    assert str(err.value).startswith("causes.yaml: ") and where in str(err.value)
