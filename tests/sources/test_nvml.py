"""NvmlSource over replays of a real 2x H200 capture (tests/fixtures/nvml/PROVENANCE.md)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import load_text
from gpuwatchd.errors import ConfigError, NvmlError, SourceError
from gpuwatchd.model import Sample
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.nvml.client import Pynvml, normalize_bus_id, nvml_errors
from gpuwatchd.sources.nvml.replay import ReplayClient, load_capture
from gpuwatchd.sources.nvml.source import METRICS, NvmlSource

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nvml"
H200X2 = FIXTURES / "h200x2-probe.json"
H200X8 = FIXTURES / "h200x8-from-h200x2.json"
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


class Rig:
    """A source polling a replay, closed (and any hung replay call released) at the end."""

    def __init__(
        self, path: Path = H200X2, script: Sequence[dict[str, Any]] = (), **kwargs: Any
    ) -> None:
        self.clock = kwargs.pop("clock", FakeClock())
        self.client = ReplayClient.load(path, script=script, clock=self.clock)
        kwargs.setdefault("call_timeout", 2.0)
        self.source = NvmlSource(self.client, clock=self.clock, **kwargs)

    def poll(self) -> list[Sample]:
        items = self.source.poll(self.clock.time())
        assert all(isinstance(i, Sample) for i in items)
        return [i for i in items if isinstance(i, Sample)]

    def close(self) -> None:
        self.client.release()
        self.source.close()


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.close()


def rig(rigs: list[Rig], *args: Any, **kwargs: Any) -> Rig:
    r = Rig(*args, **kwargs)
    rigs.append(r)
    return r


def find(samples: Sequence[Sample], name: str, **labels: str) -> list[Sample]:
    return [
        s for s in samples if s.name == name and all(s.label(k) == v for k, v in labels.items())
    ]


def value(samples: Sequence[Sample], name: str, **labels: str) -> float:
    found = find(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0].value


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


def test_a_hung_gpu_costs_one_deadline_and_recovers(rigs: list[Rig]) -> None:
    timeout = 0.3
    r = rig(
        rigs,
        script=[{"device": 1, "call": "*", "from_poll": 2, "until_poll": 3, "hang": True}],
        call_timeout=timeout,
    )
    assert value(r.poll(), "gpuwatchd_gpu_nvml_state", **GPU1) == 0

    t0 = time.monotonic()
    hung = r.poll()
    assert time.monotonic() - t0 < timeout + 0.5
    assert value(hung, "gpuwatchd_gpu_nvml_state", **GPU1) == 1
    assert value(hung, "gpuwatchd_gpu_nvml_state_info", **GPU1, state="unresponsive") == 1
    assert value(hung, "gpuwatchd_nvml_errors_total", **GPU1, reason="deadline_exceeded") == 1
    assert find(hung, "gpuwatchd_gpu_temperature_celsius", gpu="1") == []
    assert value(hung, "gpuwatchd_gpu_temperature_celsius", **GPU0, sensor="gpu") == 34
    assert value(hung, "gpuwatchd_gpu_info", gpu="1") == 1  # identity is still known

    calls = r.client.count(1, "power_usage")
    t0 = time.monotonic()
    still = r.poll()  # the call is still hung: skipped at once, nothing queued behind it
    assert time.monotonic() - t0 < timeout / 2
    assert value(still, "gpuwatchd_gpu_nvml_state", **GPU1) == 1
    assert value(still, "gpuwatchd_nvml_errors_total", **GPU1, reason="deadline_exceeded") == 1
    assert r.client.count(1, "power_usage") == calls
    gpus: Any = r.source.status()["gpus"]
    assert gpus["0000:00:07.0"]["state"] == "unresponsive"

    r.client.release()
    deadline = time.monotonic() + 5
    while True:
        again = r.poll()
        if value(again, "gpuwatchd_gpu_nvml_state", **GPU1) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert value(again, "gpuwatchd_gpu_nvml_state_info", **GPU1, state="ok") == 1
    assert value(again, "gpuwatchd_gpu_temperature_celsius", **GPU1, sensor="gpu") == 35


def test_late_results_are_discarded(rigs: list[Rig]) -> None:
    # Poll 2 of GPU 1 records an NVML error, then hangs; when the hung call
    # returns, that poll's result (error count included) must go nowhere.
    r = rig(
        rigs,
        call_timeout=0.3,
        script=[
            {
                "device": 1,
                "call": "memory_info",
                "from_poll": 2,
                "until_poll": 3,
                "error": "UNKNOWN",
            },
            {"device": 1, "call": "ecc_mode", "from_poll": 2, "until_poll": 3, "hang": True},
        ],
    )
    r.poll()
    assert value(r.poll(), "gpuwatchd_gpu_nvml_state", **GPU1) == 1
    r.client.release()
    for _ in range(200):
        samples = r.poll()
        if value(samples, "gpuwatchd_gpu_nvml_state", **GPU1) == 0:
            break
        time.sleep(0.01)
    assert find(samples, "gpuwatchd_nvml_errors_total", gpu="1", reason="unknown") == []
    assert value(samples, "gpuwatchd_gpu_memory_used_bytes", **GPU1) == 644939776
    assert r.client.count(1, "memory_info") >= 2


def test_two_hung_gpus_cost_one_deadline_together(rigs: list[Rig]) -> None:
    timeout = 0.4
    r = rig(
        rigs,
        H200X8,
        script=[{"device": "*", "call": "power_usage", "hang": True}],
        call_timeout=timeout,
    )
    t0 = time.monotonic()
    samples = r.poll()
    assert time.monotonic() - t0 < timeout + 0.5
    assert [value(samples, "gpuwatchd_gpu_nvml_state", gpu=str(i)) for i in range(8)] == [1] * 8


def test_gpu_lost(rigs: list[Rig], caplog: pytest.LogCaptureFixture) -> None:
    r = rig(
        rigs, script=[{"device": 1, "call": "power_usage", "from_poll": 2, "error": "GPU_IS_LOST"}]
    )
    r.poll()
    with caplog.at_level(logging.ERROR, "gpuwatchd.nvml"):
        samples = r.poll()
    assert value(samples, "gpuwatchd_gpu_nvml_state", **GPU1) == 2
    assert value(samples, "gpuwatchd_gpu_nvml_state_info", **GPU1, state="lost") == 1
    assert value(samples, "gpuwatchd_nvml_errors_total", **GPU1, reason="gpu_is_lost") == 1
    assert find(samples, "gpuwatchd_gpu_temperature_celsius", gpu="1") == []
    assert value(samples, "gpuwatchd_gpu_nvml_state", **GPU0) == 0
    assert value(samples, "gpuwatchd_gpu_power_watts", **GPU0) == pytest.approx(121.753)
    assert "lost" in caplog.text and "0000:00:07.0" in caplog.text
    gpus: Any = r.source.status()["gpus"]
    assert gpus["0000:00:07.0"]["state"] == "lost"
    assert r.source.gpu_map()["0000:00:07.0"]["state"] == "lost"


def test_init_failure_backs_off_and_logs_once(
    rigs: list[Rig], caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    r = rig(
        rigs,
        clock=clock,
        interval=10.0,
        init_retry_max=35.0,
        script=[{"call": "init", "until_call": 4, "error": "DRIVER_NOT_LOADED"}],
    )
    tries = []  # init calls seen after each poll, the clock advanced before it
    with caplog.at_level(logging.DEBUG, "gpuwatchd.nvml"):
        for step in (0, 0, 10, 10, 10, 34, 1, 34, 1):
            clock.advance(step)
            try:
                r.poll()
                ok = True
            except SourceError as exc:
                assert exc.reason == "nvml_init_failed"
                assert "DRIVER_NOT_LOADED" in str(exc)
                ok = False
            tries.append((r.client.count(None, "init"), ok))
    # waits between tries: 10, 20, then capped at 35
    assert tries == [
        (1, False),
        (1, False),
        (2, False),
        (2, False),
        (3, False),
        (3, False),
        (4, False),
        (4, False),
        (5, True),
    ]
    warnings = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "initialisation failed" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert r.source.status()["init_error"] is None


def test_init_error_before_success_is_in_status(rigs: list[Rig]) -> None:
    r = rig(rigs, script=[{"call": "init", "error": "LIBRARY_NOT_FOUND"}])
    with pytest.raises(SourceError):
        r.poll()
    status = r.source.status()
    assert status["gpus"] == {}
    assert "LIBRARY_NOT_FOUND" in str(status["init_error"])
    json.dumps(status)


def test_hung_init_returns_within_the_deadline(rigs: list[Rig]) -> None:
    clock = FakeClock()
    r = rig(
        rigs,
        clock=clock,
        call_timeout=0.2,
        script=[{"call": "init", "until_call": 1, "hang": True}],
    )
    t0 = time.monotonic()
    with pytest.raises(SourceError, match="did not return within"):
        r.poll()
    assert time.monotonic() - t0 < 0.7
    clock.advance(3600)
    with pytest.raises(SourceError, match="still hung"):
        r.poll()
    assert r.client.count(None, "init") == 1
    r.client.release()
    clock.advance(3600)
    for _ in range(100):  # the released call returns on the worker thread
        try:
            samples = r.poll()
            break
        except SourceError:
            clock.advance(3600)
            time.sleep(0.01)
    assert value(samples, "gpuwatchd_gpus_visible") == 2


def test_nvml_failing_as_a_whole_initialises_again(rigs: list[Rig]) -> None:
    r = rig(
        rigs,
        script=[
            {"call": "device_count", "from_call": 1, "until_call": 2, "error": "UNINITIALIZED"}
        ],
    )
    r.poll()
    with pytest.raises(SourceError, match="UNINITIALIZED"):
        r.poll()
    samples = r.poll()
    assert r.client.count(None, "init") == 2
    assert value(samples, "gpuwatchd_gpu_temperature_celsius", **GPU1, sensor="gpu") == 35


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


def test_eight_gpu_replay(rigs: list[Rig]) -> None:
    samples = rig(rigs, H200X8).poll()
    assert value(samples, "gpuwatchd_gpus_visible") == 8
    infos = find(samples, "gpuwatchd_gpu_info")
    assert len({s.label("uuid") for s in infos}) == 8
    assert sorted(s.label("pci_bus_id") for s in infos) == [
        f"0000:00:{d:02x}.0" for d in range(6, 14)
    ]
    temps = [
        value(samples, "gpuwatchd_gpu_temperature_celsius", gpu=str(i), sensor="gpu")
        for i in range(8)
    ]
    assert temps == [34, 35] * 4


def test_xid_events_from_a_replay(rigs: list[Rig]) -> None:
    r = rig(rigs, script=[{"device": 1, "from_poll": 2, "xid": 79}])
    assert r.source.open_xid_events() is None  # before init
    r.poll()
    events = r.source.open_xid_events()
    assert events is not None
    assert events.wait(0.05) is None  # not due before poll 2
    r.poll()
    event = events.wait(1.0)
    assert event is not None
    assert (event.uuid, event.pci_bus_id, event.code) == (GPU1["uuid"], GPU1["pci_bus_id"], 79)
    assert event.time == r.clock.time()
    assert events.wait(0.02) is None  # delivered once
    events.close()


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


# --- captures recorded with `gpuwatchd record` on real GPU machines --------------------

H200X2_RECORD = FIXTURES / "h200x2-record.json"
H100_RECORD = FIXTURES / "h100-record.json"
H200X4 = {k: FIXTURES / f"h200x4-{k}-record.json" for k in ("idle", "load", "hang")}


@pytest.mark.parametrize(
    "path", [H200X2, H200X8, H200X2_RECORD, H100_RECORD, *H200X4.values()], ids=lambda p: p.stem
)
def test_every_capture_replays_cleanly(rigs: list[Rig], path: Path) -> None:
    capture = load_capture(path)
    samples = rig(rigs, path).poll()
    count = len(capture["devices"])
    assert value(samples, "gpuwatchd_gpus_visible") == count
    for i in range(count):
        assert value(samples, "gpuwatchd_gpu_nvml_state", gpu=str(i)) == 0
        assert find(samples, "gpuwatchd_gpu_temperature_celsius", gpu=str(i), sensor="gpu")


def test_recorded_polls_replay_in_order(rigs: list[Rig]) -> None:
    r = rig(rigs, H200X2_RECORD)
    polls = [r.poll() for _ in range(4)]
    energy = [value(p, "gpuwatchd_gpu_energy_joules_total", gpu="0") for p in polls]
    assert energy == [2216.273, 2325.181, 2426.861, 2426.861]  # the last answer repeats
    power = [value(p, "gpuwatchd_gpu_power_watts", gpu="1") for p in polls]
    assert power == [120.03, 76.589, 76.388, 76.388]
    last = polls[-1]
    assert value(last, "gpuwatchd_gpu_recovery_action", gpu="1") == 0
    assert value(last, "gpuwatchd_gpu_recovery_action_info", gpu="1", action="none") == 1
    corrected = "gpuwatchd_nvlink_corrected_errors_total"
    assert value(last, corrected, gpu="0", link="0", error="crc_data") == 9
    # recorded before the daemon read NVML_FI_DEV_NVLINK_ERROR_DL_*: replay and
    # recovery come from the data-link counters, CRC is absent
    assert value(last, "gpuwatchd_nvlink_errors_total", gpu="0", link="0", error="replay") == 0
    assert not find(last, "gpuwatchd_nvlink_errors_total", gpu="0", link="0", error="crc")
    assert len(find(last, "gpuwatchd_nvlink_up", gpu="0")) == 18


def test_recovery_action_scripted_on_a_recorded_value(rigs: list[Rig]) -> None:
    r = rig(
        rigs,
        H200X2_RECORD,
        script=[
            {
                "device": 0,
                "call": "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION@0",
                "from_poll": 2,
                "value": 4,
            },
        ],
    )
    r.poll()
    samples = r.poll()
    assert value(samples, "gpuwatchd_gpu_recovery_action", gpu="0") == 4
    assert (
        value(samples, "gpuwatchd_gpu_recovery_action_info", gpu="0", action="drain_and_reset") == 1
    )
    assert find(samples, "gpuwatchd_gpu_recovery_action_info", gpu="0", action="none") == []
    gpus: Any = r.source.status()["gpus"]
    assert gpus["0000:00:06.0"]["last"]["recovery_action"] == "drain_and_reset"


def test_a_gpu_without_nvlink_has_no_link_series(rigs: list[Rig]) -> None:
    r = rig(rigs, H100_RECORD)
    r.poll()
    samples = r.poll()
    assert not [s for s in samples if s.name.startswith("gpuwatchd_nvlink_")]
    assert r.client.count(0, "nvlink_state(7)") == 1  # NOT_SUPPORTED once, then never
    assert value(samples, "gpuwatchd_gpu_temperature_celsius", gpu="0", sensor="memory") == 40


def test_4xh200_under_nccl_load_reads_no_nvlink_error_as_nvidia_smi_does(rigs: list[Rig]) -> None:
    """DDP on all four GPUs (the load capture): `nvidia-smi nvlink -e` read 0 on all 72
    links at that moment; the corrected-error counters are exported apart."""
    r = rig(rigs, H200X4["load"])
    r.poll()
    samples = r.poll()
    errors = find(samples, "gpuwatchd_nvlink_errors_total")
    assert len(errors) == 4 * 18 * 3 and all(s.value == 0 for s in errors)
    assert len(find(samples, "gpuwatchd_nvlink_up")) == 4 * 18
    assert find(samples, "gpuwatchd_nvlink_corrected_errors_total")


def test_4xh200_hang_capture_reads_the_dead_peers_survivor_busy(rigs: list[Rig]) -> None:
    """13:54-13:55 UTC: rank 1 on GPU 1 was SIGKILLed, rank 0 on GPU 0 waits in an
    all_reduce, GPUs 2-3 train another job. NVML reads the survivor's GPU busy (1.0) at
    training's level of utilisation, GPM shows its SM activity (0.18) and power (118 W)
    far below the training pair's (0.31-0.34, 277-293 W): utilisation is no progress."""
    r = rig(rigs, H200X4["hang"])
    r.poll()
    for _ in range(3):
        samples = r.poll()
        util = {
            dict(x.labels)["gpu"]: x.value
            for x in find(samples, "gpuwatchd_gpu_utilization_ratio")
            if dict(x.labels).get("engine") == "gpu"
        }
        sm = {
            dict(x.labels)["gpu"]: x.value for x in find(samples, "gpuwatchd_gpu_sm_active_ratio")
        }
        watts = {dict(x.labels)["gpu"]: x.value for x in find(samples, "gpuwatchd_gpu_power_watts")}
        assert util["0"] == 1.0 and util["1"] == 0.0 and 0.5 <= min(util["2"], util["3"])
        assert 0.15 <= sm["0"] <= 0.2 and min(sm["2"], sm["3"]) >= 0.3
        assert watts["0"] < 130 < 270 < min(watts["2"], watts["3"])
