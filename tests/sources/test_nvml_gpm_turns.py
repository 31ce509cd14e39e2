"""GPM calls of different GPUs never overlap (the per-GPU workers used to run them at once)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from gpuwatchd.sources.nvml import structured
from gpuwatchd.sources.nvml.structured import GpmSamples


class _OverlapNvml:
    """Just enough of pynvml's GPM API to see whether two calls run at the same time."""

    NVML_GPM_METRICS_GET_VERSION = 1

    def __init__(self) -> None:
        self.inside = 0
        self.most = 0
        self._lock = threading.Lock()

    def _enter(self) -> None:
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(0.02)
        with self._lock:
            self.inside -= 1

    def nvmlGpmSampleAlloc(self) -> object:
        return object()

    def nvmlGpmSampleFree(self, sample: object) -> None:
        pass

    def nvmlGpmSampleGet(self, handle: object, sample: object) -> None:
        self._enter()

    def c_nvmlGpmMetricsGet_t(self) -> Any:
        metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=1.0) for _ in range(16)]
        return SimpleNamespace(version=0, numMetrics=0, sample1=None, sample2=None, metrics=metrics)

    def nvmlGpmMetricsGet(self, request: object) -> None:
        self._enter()


def test_gpm_calls_of_two_gpus_take_turns() -> None:
    nv = _OverlapNvml()
    states = [GpmSamples(), GpmSamples()]

    def poll(gpu: int) -> None:
        for _ in range(5):
            structured.gpm_metrics(nv, f"handle{gpu}", states[gpu])

    threads = [threading.Thread(target=poll, args=(g,)) for g in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert nv.most == 1


def test_a_gpu_whose_turn_does_not_come_skips_gpm_for_the_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(structured, "GPM_TURN_WAIT", 0.05)
    nv = _OverlapNvml()
    state = GpmSamples()
    structured.gpm_metrics(nv, "h", state)  # first sample held
    with structured.GPM_TURN:  # another GPU's call hangs in NVML
        assert structured.gpm_metrics(nv, "h", state) == {}
    values = structured.gpm_metrics(nv, "h", state)
    assert isinstance(values, dict) and values["sm_active"] == 1.0
