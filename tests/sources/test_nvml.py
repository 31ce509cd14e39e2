"""NvmlSource over replays of a real 2x H200 capture (tests/fixtures/nvml/PROVENANCE.md).

Failures (hung calls, a lost GPU, init errors) are in test_nvml_failures.py, the
other real captures in test_nvml_captures.py; the replay rig is nvml_rigs.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import load_text
from gpuwatchd.errors import ConfigError, NvmlError
from gpuwatchd.model import Sample
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.nvml.client import Pynvml, normalize_bus_id, nvml_errors
from gpuwatchd.sources.nvml.replay import ReplayClient, load_capture
from gpuwatchd.sources.nvml.source import METRICS, NvmlSource
from tests.health.snapshots import GPU0, GPU1
from tests.sources.nvml_rigs import (
    FIXTURES,
    H200X2,
    Rig,
    find,
    rig,
    value,
)

# Values read off the probe file by hand (tests/fixtures/nvml/source/), not
# through the converter, so a conversion or decoding slip shows up here.
CAPTURED = [
    ("gpuwatchd_gpus_visible", {}, 2),
    ("gpuwatchd_gpu_temperature_celsius", {**GPU0, "sensor": "gpu"}, 34),
    ("gpuwatchd_gpu_temperature_celsius", {**GPU1, "sensor": "gpu"}, 35),
    ("gpuwatchd_gpu_temperature_celsius", {**GPU0, "sensor": "memory"}, 35),
    ("gpuwatchd_gpu_temperature_celsius", {**GPU1, "sensor": "memory"}, 36),
    ("gpuwatchd_gpu_temperature_threshold_celsius", {**GPU0, "threshold": "slowdown"}, 89),
    ("gpuwatchd_gpu_temperature_threshold_celsius", {**GPU0, "threshold": "shutdown"}, 95),
    ("gpuwatchd_gpu_temperature_threshold_celsius", {**GPU0, "threshold": "gpu_max"}, 87),
    ("gpuwatchd_gpu_temperature_threshold_celsius", {**GPU0, "threshold": "memory_max"}, 95),
    ("gpuwatchd_gpu_power_watts", GPU0, 121.753),
    ("gpuwatchd_gpu_power_watts", GPU1, 124.277),
    ("gpuwatchd_gpu_power_limit_watts", GPU1, 700.0),
    ("gpuwatchd_gpu_energy_joules_total", GPU0, 2172.869),
    ("gpuwatchd_gpu_energy_joules_total", GPU1, 2220.445),
    ("gpuwatchd_gpu_utilization_ratio", {**GPU0, "engine": "gpu"}, 0.0),
    ("gpuwatchd_gpu_memory_used_bytes", GPU0, 644939776),
    ("gpuwatchd_gpu_memory_capacity_bytes", GPU0, 150754820096),
    ("gpuwatchd_gpu_clock_event_active", {**GPU0, "reason": "gpu_idle"}, 1),
    ("gpuwatchd_gpu_clock_event_active", {**GPU0, "reason": "hw_thermal_slowdown"}, 0),
    ("gpuwatchd_gpu_ecc_enabled", {**GPU0, "which": "current"}, 1),
    ("gpuwatchd_gpu_ecc_errors_total", {**GPU0, "error": "uncorrected", "scope": "volatile"}, 0),
    (
        "gpuwatchd_gpu_ecc_location_errors_total",
        {**GPU0, "error": "uncorrected", "scope": "volatile", "location": "dram"},
        0,
    ),
    ("gpuwatchd_gpu_remapped_rows_total", {**GPU0, "cause": "uncorrectable"}, 0),
    ("gpuwatchd_gpu_row_remap_pending", GPU0, 0),
    ("gpuwatchd_gpu_row_remap_failure", GPU0, 0),
    ("gpuwatchd_gpu_row_remap_availability_banks", {**GPU0, "availability": "max"}, 3072),
    ("gpuwatchd_gpu_pcie_link_generation", {**GPU0, "which": "current"}, 5),
    ("gpuwatchd_gpu_pcie_link_generation", {**GPU0, "which": "max"}, 5),
    ("gpuwatchd_gpu_pcie_link_width", {**GPU1, "which": "max"}, 16),
    ("gpuwatchd_gpu_pcie_replays_total", GPU0, 0),
    ("gpuwatchd_gpu_pcie_errors_total", {**GPU0, "error": "receiver"}, 11),
    ("gpuwatchd_gpu_pcie_errors_total", {**GPU1, "error": "bad_tlp"}, 4),
    ("gpuwatchd_gpu_pcie_errors_total", {**GPU0, "error": "l0_to_recovery"}, 81),
    ("gpuwatchd_gpu_reset_required", GPU0, 0),
    ("gpuwatchd_gpu_drain_and_reset_recommended", GPU1, 0),
    ("gpuwatchd_nvlink_up", {**GPU0, "link": "17"}, 1),
    ("gpuwatchd_nvlink_speed_bytes_per_second", {**GPU0, "link": "0"}, 26_562e6),
    # what nvidia-smi nvlink -e read on the same machine: Replay, Recovery, CRC 0 ...
    ("gpuwatchd_nvlink_errors_total", {**GPU0, "link": "0", "error": "replay"}, 0),
    ("gpuwatchd_nvlink_errors_total", {**GPU0, "link": "0", "error": "recovery"}, 0),
    ("gpuwatchd_nvlink_errors_total", {**GPU0, "link": "0", "error": "crc"}, 0),
    # ... while the data-link counters had corrected CRC and ECC errors
    ("gpuwatchd_nvlink_corrected_errors_total", {**GPU0, "link": "0", "error": "crc_data"}, 2),
    ("gpuwatchd_nvlink_corrected_errors_total", {**GPU1, "link": "0", "error": "crc_data"}, 6),
    ("gpuwatchd_nvlink_corrected_errors_total", {**GPU0, "link": "0", "error": "ecc_data"}, 4),
    ("gpuwatchd_nvlink_corrected_errors_total", {**GPU0, "link": "0", "error": "crc_flit"}, 0),
    ("gpuwatchd_gpu_nvml_state", GPU0, 0),
    ("gpuwatchd_gpu_compute_processes", GPU1, 0),
]


@pytest.mark.parametrize(
    ("name", "labels", "expected"),
    CAPTURED,
    ids=[f"{n}-{'-'.join(labels.values())}" for n, labels, _ in CAPTURED],
)
def test_values_match_the_capture(
    rigs: list[Rig], name: str, labels: dict[str, str], expected: float
) -> None:
    samples = rig(rigs).poll()
    assert value(samples, name, **labels) == pytest.approx(expected)


ABSENT = [
    # NOT_SUPPORTED on an H200 in the capture
    ("gpuwatchd_gpu_retired_pages_total", {}),
    ("gpuwatchd_gpu_retired_pages_pending", {}),
    ("gpuwatchd_gpu_ecc_location_errors_total", {"location": "l1_cache"}),
    # never asked by the probe: NOT_RECORDED, so absent rather than zero
    ("gpuwatchd_gpu_recovery_action", {}),
    ("gpuwatchd_gpu_recovery_action_info", {}),
    ("gpuwatchd_nvlink_errors_total", {"link": "1"}),
    ("gpuwatchd_nvlink_speed_bytes_per_second", {"link": "1"}),
    ("gpuwatchd_gpu_ecc_location_errors_total", {"error": "corrected"}),
]


@pytest.mark.parametrize(("name", "labels"), ABSENT)
def test_unavailable_readings_are_absent(
    rigs: list[Rig], name: str, labels: dict[str, str]
) -> None:
    r = rig(rigs)
    for _ in range(2):
        assert find(r.poll(), name, **labels) == []


def test_samples_follow_their_metric_specs(rigs: list[Rig]) -> None:
    specs = {m.name: m for m in METRICS}
    samples = rig(rigs).poll()
    assert {s.name for s in samples} <= set(specs)
    for s in samples:
        assert sorted(k for k, _ in s.labels) == sorted(specs[s.name].labels), s
        if "gpu" in specs[s.name].labels:
            assert s.label("pci_bus_id") == s.label("pci_bus_id").lower() != ""
    for spec in METRICS:
        assert spec.name.startswith("gpuwatchd_")
        assert spec.name.endswith("_total") == (spec.type == "counter")
        assert (spec.type == "info") == spec.name.endswith("_info")


def test_gpu_info_carries_identity(rigs: list[Rig]) -> None:
    (info,) = find(rig(rigs).poll(), "gpuwatchd_gpu_info", gpu="1")
    assert dict(info.labels) == {
        **GPU1,
        "name": "NVIDIA H200",
        "serial": "1653724064214",
        "vbios_version": "96.00.A5.00.1A",
        "driver_version": "580.159.04",
        "nvml_version": "13.580.159.04",
        "cuda_version": "13.0",
    }


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:00:06.0", "0000:00:06.0"),
        ("00000000:1B:00.0", "0000:1b:00.0"),
        ("0000:AF:00.0", "0000:af:00.0"),
        ("00000001:00:1E.0", "0001:00:1e.0"),
        ("garbage", ""),  # not a bus id: no label value rather than a made-up one
    ],
)
def test_bus_ids_are_normalised(raw: str, expected: str) -> None:
    assert normalize_bus_id(raw) == expected


def test_unsupported_calls_are_asked_once(rigs: list[Rig]) -> None:
    r = rig(rigs)
    first = r.poll()
    for _ in range(3):
        last = r.poll()
    c = r.client.count
    assert c(0, "temperature(0)") == 4
    assert c(0, "retired_pages(0)") == 1  # NOT_SUPPORTED
    assert c(1, "memory_error_counter(0,0,0)") == 1  # NOT_RECORDED
    assert c(0, "NVML_FI_DEV_NVLINK_GET_SPEED@3") == 1
    assert c(0, "NVML_FI_DEV_NVLINK_GET_SPEED@0") == 4
    assert c(0, "uuid") == 1  # identity is read once
    assert c(0, "cpu_affinity") == 1  # topology: read once (its misses are not counted)
    # the probe predates clocks, P-state, memory v2, GPM, fabric and MIG: 15 more;
    # it asked the NVLink error fields at scope 0 only: 3 for each of links 1-17
    for reason, count in (("not_supported", 3), ("not_recorded", 148 + 51)):
        before = value(first, "gpuwatchd_nvml_errors_total", **GPU0, reason=reason)
        after = value(last, "gpuwatchd_nvml_errors_total", **GPU0, reason=reason)
        assert before == after == count
    status = r.source.status()["gpus"]["0000:00:06.0"]  # type: ignore[index]
    assert status["unsupported"]["retired_pages(1)"] == "NOT_SUPPORTED"
    assert status["unsupported"]["NVML_FI_DEV_GET_GPU_RECOVERY_ACTION@0"] == "NOT_RECORDED"


def test_scripted_changes_show_in_the_samples(rigs: list[Rig]) -> None:
    r = rig(
        rigs,
        script=[
            {"device": 1, "call": "nvlink_state(3)", "from_poll": 2, "value": 0},
            {"device": 0, "call": "total_ecc_errors(0,0)", "add_per_poll": 5},
            {"device": 0, "call": "NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR@0", "from_poll": 3, "add": 1},
        ],
    )
    polls = [r.poll() for _ in range(3)]
    ecc = {"error": "corrected", "scope": "volatile"}
    assert [value(p, "gpuwatchd_gpu_ecc_errors_total", **GPU0, **ecc) for p in polls] == [0, 5, 10]
    assert [value(p, "gpuwatchd_nvlink_up", **GPU1, link="3") for p in polls] == [1, 0, 0]
    assert value(polls[2], "gpuwatchd_nvlink_up", **GPU1, link="2") == 1
    fatal = [value(p, "gpuwatchd_gpu_pcie_errors_total", **GPU0, error="fatal") for p in polls]
    assert fatal == [0, 0, 1]
    gpus: Any = r.source.status()["gpus"]
    assert gpus["0000:00:07.0"]["last"]["nvlinks_down"] == [3]


def _paced(rigs: list[Rig], script: list[dict[str, Any]], read: Any) -> list[Any]:
    """Polls at 0, 10, 60 and 70 s with a 60 s error-counter interval: `read(r, samples)`."""
    clock = FakeClock()
    r = rig(rigs, clock=clock, nvlink_error_interval=60.0, script=script)
    seen = []
    for step in (0, 10, 50, 10):
        clock.advance(step)
        seen.append(read(r, r.poll()))
    assert r.client.count(0, "temperature(0)") == 4  # everything else: every poll
    return seen


def test_nvlink_error_counters_are_read_at_their_own_pace(rigs: list[Rig]) -> None:
    script = [{"device": 0, "call": "nvlink_error_counter(0,3)", "add_per_poll": 1}]
    seen = _paced(
        rigs,
        script,
        lambda r, samples: (
            r.client.count(0, "nvlink_error_counter(0,3)"),
            value(
                samples,
                "gpuwatchd_nvlink_corrected_errors_total",
                **GPU0,
                link="0",
                error="crc_data",
            ),
        ),
    )
    # read at 0 s and 60 s; the polls between report the last value read
    assert seen == [(1, 2), (1, 2), (2, 4), (2, 4)]


def test_pcie_error_counters_share_the_nvlink_counters_pace(rigs: list[Rig]) -> None:
    script = [
        {"device": 0, "call": "pcie_replay_counter", "add_per_poll": 1},
        {"device": 0, "call": "NVML_FI_DEV_PCIE_COUNT_BAD_TLP@0", "add_per_poll": 1},
    ]
    seen = _paced(
        rigs,
        script,
        lambda r, samples: (
            r.client.count(0, "pcie_replay_counter"),
            value(samples, "gpuwatchd_gpu_pcie_replays_total", **GPU0),
            value(samples, "gpuwatchd_gpu_pcie_errors_total", **GPU0, error="bad_tlp"),
        ),
    )
    # read at 0 s and 60 s; the polls between report the last values read, never none
    first, second = seen[0][1:], seen[2][1:]
    assert [s[0] for s in seen] == [1, 1, 2, 2]
    assert [s[1:] for s in seen] == [first, first, second, second]
    assert second[0] > first[0] and second[1] > first[1]


def test_status_and_gpu_map(rigs: list[Rig]) -> None:
    r = rig(rigs)
    r.poll()
    status = r.source.status()
    json.dumps(status)
    assert status["driver"] == "580.159.04"
    assert status["visible"] == 2
    gpu: Any = status["gpus"]["0000:00:07.0"]  # type: ignore[index]
    assert gpu["gpu"] == 1 and gpu["uuid"] == GPU1["uuid"] and gpu["state"] == "ok"
    assert gpu["processes"] == []
    assert gpu["last"]["temperature_celsius"] == 35
    assert gpu["last"]["clock_events"] == ["gpu_idle"]
    assert r.source.gpu_map()["0000:00:06.0"] == {
        "gpu": "0",
        "uuid": GPU0["uuid"],
        "name": "NVIDIA H200",
        "minor": "0",
        "state": "ok",
    }


def test_from_config_uses_the_replay(tmp_path: Path) -> None:
    cfg = load_text(f"sources:\n  nvml:\n    replay: {H200X2}\n    call_timeout: 1\n")
    source = NvmlSource.from_config(cfg, SourceContext(clock=FakeClock()))
    try:
        assert isinstance(source.client, ReplayClient)
        samples = [s for s in source.poll(0.0) if isinstance(s, Sample)]
        assert value(samples, "gpuwatchd_gpus_visible") == 2
    finally:
        source.close()
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    cfg = load_text(f"sources:\n  nvml:\n    replay: {bad}\n")
    with pytest.raises(ConfigError, match="sources.nvml.replay"):
        NvmlSource.from_config(cfg, SourceContext())


def test_pynvml_errors_keep_nvml_codes() -> None:
    pynvml = pytest.importorskip("pynvml")
    with pytest.raises(NvmlError) as info, nvml_errors():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert (info.value.code, info.value.value) == ("GPU_IS_LOST", 15)
    with pytest.raises(NvmlError) as info, nvml_errors():
        raise pynvml.NVMLError_NotSupported()
    assert (info.value.code, info.value.value, info.value.reason) == (
        "NOT_SUPPORTED",
        3,
        "not_supported",
    )


def test_package_imports_without_pynvml() -> None:
    import subprocess

    code = (
        "import sys; sys.modules['pynvml'] = None\n"
        "from gpuwatchd.sources.nvml.source import NvmlSource\n"
        "from gpuwatchd.sources.nvml.client import Pynvml\n"
        "from gpuwatchd.errors import NvmlError\n"
        "try:\n    Pynvml().init()\nexcept NvmlError as e:\n    print(e.code, e.value)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=FIXTURES.parent.parent.parent,
        check=True,
    )
    assert out.stdout.split() == ["LIBRARY_NOT_FOUND", "12"]


# --- real NVML ---------------------------------------------------------------------


@pytest.mark.gpu
def test_real_gpus_are_read() -> None:
    source = NvmlSource(Pynvml(), call_timeout=5.0)
    try:
        samples = [s for s in source.poll(time.time()) if isinstance(s, Sample)]
        samples = [s for s in source.poll(time.time()) if isinstance(s, Sample)]
    finally:
        source.close()
    count = int(value(samples, "gpuwatchd_gpus_visible"))
    assert count >= 1
    for i in range(count):
        assert value(samples, "gpuwatchd_gpu_nvml_state", gpu=str(i)) == 0
        assert (
            0 < value(samples, "gpuwatchd_gpu_temperature_celsius", gpu=str(i), sensor="gpu") < 120
        )
        assert value(samples, "gpuwatchd_gpu_power_watts", gpu=str(i)) > 0
        (info,) = find(samples, "gpuwatchd_gpu_info", gpu=str(i))
        assert info.label("uuid").startswith("GPU-")
        assert info.label("pci_bus_id") == normalize_bus_id(info.label("pci_bus_id"))
    specs = {m.name: m for m in METRICS}
    for s in samples:
        assert sorted(k for k, _ in s.labels) == sorted(specs[s.name].labels), s


@pytest.mark.gpu
def test_real_capture_replays_to_the_same_series(tmp_path: Path) -> None:
    from gpuwatchd.sources.nvml.record import record

    out = tmp_path / "capture.json"
    record(out, polls=2, interval=0.2)
    capture = load_capture(out)
    assert capture["summary"]["init_error"] is None
    real = capture["summary"]["gpus"]
    replay = NvmlSource(ReplayClient(capture), call_timeout=5.0)
    try:
        replay.poll(0.0)
        samples = [s for s in replay.poll(0.0) if isinstance(s, Sample)]
    finally:
        replay.close()
    assert value(samples, "gpuwatchd_gpus_visible") == len(real)
    assert {s.label("uuid") for s in find(samples, "gpuwatchd_gpu_info")} == {
        g["uuid"] for g in real
    }


@pytest.mark.gpu
def test_real_xid_event_set_waits_and_times_out() -> None:
    source = NvmlSource(Pynvml(), call_timeout=5.0)
    try:
        source.poll(time.time())
        events = source.open_xid_events()
        assert events is not None
        t0 = time.monotonic()
        assert events.wait(0.2) is None  # no Xid on a healthy GPU
        assert 0.1 < time.monotonic() - t0 < 2.0
        events.close()
    finally:
        source.close()
