"""Memory as nvidia-smi reports it, clocks, P-state, clock-event time, GPM and fabric.

All values come from captures recorded with `gpuwatchd record` on an H100
test machine (tests/fixtures/nvml/PROVENANCE.md): idle, and under a matmul
load with GPM values.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.model import Sample
from gpuwatchd.sources.nvml.fabric import FabricManagerProbe, read_fabric
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import METRICS, NvmlSource

NVML = Path(__file__).resolve().parents[1] / "fixtures" / "nvml"
IDLE = NVML / "h100-idle-record.json"
LOAD = NVML / "h100-gpm-record.json"
OLD = NVML / "h100-record.json"
BUS = "0000:00:06.0"
MIB = 1024 * 1024


def polls(capture: Path, n: int, **kwargs: object) -> list[list[Sample]]:
    source = NvmlSource(ReplayClient.load(capture), call_timeout=2.0, **kwargs)  # type: ignore[arg-type]
    try:
        return [[s for s in source.poll(0.0) if isinstance(s, Sample)] for _ in range(n)]
    finally:
        source.close()


def values(samples: list[Sample], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{extra labels: value} of one family on the captured GPU."""
    out = {}
    for s in samples:
        if s.name == name and s.label("pci_bus_id") == BUS:
            extra = tuple(kv for kv in s.labels if kv[0] not in ("gpu", "uuid", "pci_bus_id"))
            out[extra] = s.value
    return out


def one(samples: list[Sample], name: str, **labels: str) -> float:
    got = values(samples, name).get(tuple(sorted(labels.items())))
    assert got is not None, f"{name}{labels} missing"
    return got


@pytest.fixture(scope="module")
def idle() -> Iterator[list[Sample]]:
    yield polls(IDLE, 2)[-1]


@pytest.fixture(scope="module")
def load() -> Iterator[list[list[Sample]]]:
    yield polls(LOAD, 5)


def test_idle_memory_matches_nvidia_smi_used_apart_from_reserved(idle: list[Sample]) -> None:
    # nvidia-smi on the idle H100: 0 MiB used, 480 MiB reserved, 81559 MiB total
    assert one(idle, "gpuwatchd_gpu_memory_used_bytes") == 0
    assert one(idle, "gpuwatchd_gpu_memory_reserved_bytes") == 480 * MIB
    assert one(idle, "gpuwatchd_gpu_memory_capacity_bytes") == 85520809984
    total = one(idle, "gpuwatchd_gpu_memory_capacity_bytes")
    assert one(idle, "gpuwatchd_gpu_memory_free_bytes") == total - 480 * MIB


def test_clocks_in_hz_and_pstate(idle: list[Sample], load: list[list[Sample]]) -> None:
    assert values(idle, "gpuwatchd_gpu_clock_max_hertz") == {
        (("clock", "graphics"),): 1980e6,
        (("clock", "sm"),): 1980e6,
        (("clock", "memory"),): 2619e6,
        (("clock", "video"),): 1545e6,
    }
    assert one(idle, "gpuwatchd_gpu_clock_hertz", clock="sm") == 345e6
    assert one(load[-1], "gpuwatchd_gpu_clock_hertz", clock="sm") > 1500e6
    assert one(idle, "gpuwatchd_gpu_clock_application_hertz", clock="graphics") == 1980e6
    assert set(values(idle, "gpuwatchd_gpu_clock_application_hertz")) == {
        (("clock", "graphics"),),
        (("clock", "memory"),),
    }
    assert one(load[-1], "gpuwatchd_gpu_performance_state") == 0


def test_clock_event_time_is_a_counter_in_seconds(load: list[list[Sample]]) -> None:
    # the load ran at the 700 W cap: SW power capping time grows from poll to poll
    capped = [
        one(p, "gpuwatchd_gpu_clock_event_seconds_total", reason="sw_power_cap") for p in load
    ]
    assert capped == sorted(capped) and capped[-1] > capped[0] > 0
    assert (
        one(load[-1], "gpuwatchd_gpu_clock_event_seconds_total", reason="hw_thermal_slowdown") == 0
    )
    assert one(load[-1], "gpuwatchd_gpu_clock_event_active", reason="sw_power_cap") == 1


def test_gpm_values_over_the_poll_interval(load: list[list[Sample]]) -> None:
    first, last = load[0], load[-1]
    assert one(first, "gpuwatchd_gpu_gpm_supported") == 1
    # the first poll has only one GPM sample: no values yet, not zeros
    assert values(first, "gpuwatchd_gpu_sm_active_ratio") == {}
    assert 0.9 < one(last, "gpuwatchd_gpu_sm_active_ratio") <= 1.0
    assert 0.1 < one(last, "gpuwatchd_gpu_sm_occupancy_ratio") < 0.2
    pipes = values(last, "gpuwatchd_gpu_pipe_active_ratio")
    assert set(pipes) == {(("pipe", p),) for p in ("tensor", "fp64", "fp32", "fp16")}
    assert pipes[(("pipe", "fp32"),)] > 0.5 and pipes[(("pipe", "fp64"),)] == 0
    assert 0.1 < one(last, "gpuwatchd_gpu_dram_active_ratio") < 0.2
    pcie = values(last, "gpuwatchd_gpu_pcie_bytes_per_second")
    assert 1e6 < pcie[(("direction", "rx"),)] < 2e7  # about 8.8 MiB/s
    assert one(last, "gpuwatchd_gpu_nvlink_bytes_per_second", direction="tx") == 0


def test_gpm_absent_where_unsupported_or_not_recorded() -> None:
    samples = polls(OLD, 2)[-1]
    assert one(samples, "gpuwatchd_gpu_gpm_supported") == 0
    assert values(samples, "gpuwatchd_gpu_sm_active_ratio") == {}
    # the old capture predates memory v2: used comes from v1, no reserved series
    assert values(samples, "gpuwatchd_gpu_memory_reserved_bytes") == {}
    assert one(samples, "gpuwatchd_gpu_memory_used_bytes") > 0


def test_single_h100_has_no_fabric_series(idle: list[Sample]) -> None:
    # recorded: nvmlDeviceGetGpuFabricInfoV answers state 0 (not supported) here
    assert [s for s in idle if "fabric" in s.name] == []
    client = ReplayClient.load(IDLE)
    source = NvmlSource(client, call_timeout=2.0)
    try:
        for _ in range(3):
            source.poll(0.0)
        status = source.status()["gpus"]
    finally:
        source.close()
    assert client.count(0, "gpu_fabric_info") == 1  # no fabric: not asked again
    assert status[BUS]["unsupported"]["gpu_fabric_info"] == "NO_FABRIC"  # type: ignore[index]


def test_fabric_state_and_health_from_the_info() -> None:
    out: list[tuple[str, float, dict[str, object]]] = []
    last: dict[str, object] = {}
    info = {
        "state": 2,
        "status": 0,
        "clique_id": 7,
        "cluster_uuid": "0a0b0c0d-0000-0000-0000-000000000001",
        "health_mask": 0b01_10,  # route recovery: true (bits 2-3 = 1), degraded bw: false (2)
    }
    read_fabric(lambda name: info, lambda n, v, **kw: out.append((n, v, kw)), last)
    assert ("gpuwatchd_gpu_fabric_state", 2, {}) in out
    assert (
        "gpuwatchd_gpu_fabric_info",
        1,
        {
            "state": "in_progress",
            "status": "success",
            "clique_id": "7",
            "cluster_uuid": "0a0b0c0d-0000-0000-0000-000000000001",
        },
    ) in out
    health = {kw["issue"]: v for n, v, kw in out if n == "gpuwatchd_gpu_fabric_health_issue"}
    assert health == {"degraded_bandwidth": 0, "route_recovery": 1}
    assert last["fabric"] == {"state": "in_progress", "status": "SUCCESS"}


def test_fabric_manager_unit_state_is_cached_and_absent_when_missing() -> None:
    calls: list[list[str]] = []
    now = [0.0]
    answers = {
        "active": "LoadState=loaded\nActiveState=active\nSubState=running\nResult=success\n",
        "failed": "LoadState=loaded\nActiveState=failed\nSubState=failed\nResult=exit-code\n",
        "none": "LoadState=not-found\nActiveState=inactive\nSubState=dead\n",
    }
    state = ["active"]

    def run(args: list[str], timeout: float) -> str:
        calls.append(args)
        return answers[state[0]]

    probe = FabricManagerProbe(run=run, every=60.0, monotonic=lambda: now[0])
    out: list[tuple[str, float, dict[str, object]]] = []
    probe.samples(lambda n, v, **kw: out.append((n, v, kw)))
    assert ("gpuwatchd_fabricmanager_up", 1, {}) in out
    state[0] = "failed"
    now[0] = 30.0
    assert probe.state() == {
        "LoadState": "loaded",
        "ActiveState": "active",
        "SubState": "running",
        "Result": "success",
    }
    assert len(calls) == 1  # cached for a minute
    now[0] = 61.0
    out.clear()
    probe.samples(lambda n, v, **kw: out.append((n, v, kw)))
    assert ("gpuwatchd_fabricmanager_up", 0, {}) in out
    assert calls[0][:2] == ["show", "nvidia-fabricmanager.service"]
    state[0] = "none"
    now[0] = 200.0
    out.clear()
    probe.samples(lambda n, v, **kw: out.append((n, v, kw)))
    assert out == []


def test_every_new_series_is_declared() -> None:
    declared = {m.name: m for m in METRICS}
    for samples in (polls(IDLE, 2)[-1], polls(LOAD, 3)[-1]):
        for s in samples:
            spec = declared.get(s.name)
            assert spec is not None, s.name
            assert {k for k, _ in s.labels} == set(spec.labels), s.name


def test_gpm_can_be_switched_off() -> None:
    client = ReplayClient.load(LOAD)
    source = NvmlSource(client, call_timeout=2.0, gpm=False)
    try:
        for _ in range(3):
            samples = [s for s in source.poll(0.0) if isinstance(s, Sample)]
    finally:
        source.close()
    assert one(samples, "gpuwatchd_gpu_gpm_supported") == 0
    assert values(samples, "gpuwatchd_gpu_sm_active_ratio") == {}
    assert client.count(0, "gpm_support") == 0 and client.count(0, "gpm_metrics") == 0
