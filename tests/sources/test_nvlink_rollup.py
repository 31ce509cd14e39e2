"""The NVLink roll-up at the exposition: per-GPU sums, per-link series only for
links whose counters moved, and a real HGX-sized daemon under 2,000 series."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpuwatchd.model import Sample
from gpuwatchd.sources.nvml.rollup import nvlink_rollup

ROOT = Path(__file__).resolve().parents[2]


def _errors(
    link: int,
    value: float,
    gpu: str = "0",
    error: str = "crc",
    name: str = "gpuwatchd_nvlink_errors_total",
) -> Sample:
    return Sample.of(
        name,
        value,
        gpu=gpu,
        uuid=f"GPU-{gpu}",
        pci_bus_id=f"0000:0{gpu}:00.0",
        link=link,
        error=error,
    )


def _poll(values: dict[int, float]) -> list[Sample]:
    return [
        Sample.of("gpuwatchd_gpu_power_watts", 300.0, gpu="0", uuid="GPU-0", pci_bus_id="x"),
        Sample.of("gpuwatchd_nvlink_speed_bytes_per_second", 5e10, gpu="0", link=0),
        *(_errors(link, v) for link, v in values.items()),
    ]


def test_sums_per_gpu_and_names_only_links_that_move() -> None:
    rollup = nvlink_rollup()
    first = list(rollup(_poll({0: 2.0, 1: 0.0, 2: 0.0})))
    names = [s.name for s in first]
    assert "gpuwatchd_nvlink_errors_total" not in names  # old counts: GPU sum only
    assert "gpuwatchd_nvlink_speed_bytes_per_second" not in names
    assert "gpuwatchd_gpu_power_watts" in names
    [total] = [s for s in first if s.name == "gpuwatchd_nvlink_gpu_errors_total"]
    assert total.value == 2.0
    assert dict(total.labels) == {
        "gpu": "0",
        "uuid": "GPU-0",
        "pci_bus_id": "0000:00:00.0",
        "error": "crc",
    }

    second = list(rollup(_poll({0: 2.0, 1: 7.0, 2: 0.0})))
    links = [s.label("link") for s in second if s.name == "gpuwatchd_nvlink_errors_total"]
    assert links == ["1"]
    # Once named, a link stays in the exposition (rates stay continuous).
    third = list(rollup(_poll({0: 2.0, 1: 7.0, 2: 0.0})))
    assert [s.label("link") for s in third if s.name == "gpuwatchd_nvlink_errors_total"] == ["1"]
    [total] = [s for s in third if s.name == "gpuwatchd_nvlink_gpu_errors_total"]
    assert total.value == 9.0


def test_corrected_errors_are_summed_per_gpu_only() -> None:
    corrected = "gpuwatchd_nvlink_corrected_errors_total"
    rollup = nvlink_rollup()
    for values in ({0: 4.0, 1: 9.0}, {0: 400.0, 1: 900.0}):
        out = list(
            rollup(_errors(link, v, error="ecc_data", name=corrected) for link, v in values.items())
        )
        assert [s.name for s in out] == ["gpuwatchd_nvlink_gpu_corrected_errors_total"]
        assert out[0].value == sum(values.values())
        assert out[0].label("error") == "ecc_data"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hgx_node_under_2000_series_with_defaults() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.cardinality import measure

    counts = measure()
    total = sum(counts.values())
    assert counts["gpuwatchd_nvlink_up"] == 8 * 18
    assert counts["gpuwatchd_nvlink_gpu_errors_total"] == 8 * 3  # replay, recovery, crc
    assert counts["gpuwatchd_nvlink_gpu_corrected_errors_total"] == 8 * 3
    assert "gpuwatchd_nvlink_errors_total" not in counts
    assert "gpuwatchd_nvlink_corrected_errors_total" not in counts
    assert counts["gpuwatchd_infiniband_port_info"] == 8
    assert total < 2000, counts.most_common(10)
