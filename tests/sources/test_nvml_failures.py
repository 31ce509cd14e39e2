"""NvmlSource when NVML fails: hung calls and GPUs, a lost GPU, init errors (over replays)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.errors import SourceError
from tests.health.snapshots import GPU0, GPU1
from tests.sources.nvml_rigs import H200X8, Rig, find, rig, value


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
