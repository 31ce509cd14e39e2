from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry as Registry
from prometheus_client import generate_latest as render

from gpuwatchd.http.app import make_app
from gpuwatchd.model import MetricSpec, Sample, SourceSnapshot
from gpuwatchd.sinks.prometheus import (
    DROP_REASONS,
    STRICT_ENV,
    DroppedSampleError,
    SnapshotCollector,
    write_textfile,
)
from gpuwatchd.state import State

SPECS = (
    MetricSpec("gpuwatchd_gpu_power_watts", "gauge", "Power draw.", ("gpu", "uuid", "pci_bus_id")),
    MetricSpec("gpuwatchd_gpu_energy_joules_total", "counter", "Energy.", ("gpu",)),
)


def _registry(state: State, strict: bool | None = None) -> Registry:
    reg = Registry()
    reg.register(SnapshotCollector(state, SPECS, strict=strict))
    return reg


def _publish(state: State, samples: list[Sample], ok: bool = True) -> None:
    state.publish(
        SourceSnapshot(
            "nvml",
            tuple(samples),
            ok,
            "" if ok else "nvml_init_failed",
            1.0,
            0.002,
            1.0 if ok else 0.0,
            errors_by_reason={} if ok else {"nvml_init": 2},
        )
    )


def test_exposition_from_snapshot() -> None:
    state = State()
    _publish(
        state,
        [
            Sample.of(
                "gpuwatchd_gpu_power_watts", 121.753, gpu=0, uuid="GPU-a", pci_bus_id="0000:00:06.0"
            ),
            Sample.of("gpuwatchd_gpu_energy_joules_total", 2172.869, gpu=0),
        ],
    )
    text = render(_registry(state)).decode()
    assert (
        'gpuwatchd_gpu_power_watts{gpu="0",pci_bus_id="0000:00:06.0",uuid="GPU-a"} 121.753' in text
    )
    assert "# TYPE gpuwatchd_gpu_energy_joules_total counter" in text
    assert 'gpuwatchd_gpu_energy_joules_total{gpu="0"} 2172.869' in text
    assert 'gpuwatchd_collector_success{collector="nvml"} 1.0' in text
    assert "gpuwatchd_build_info{" in text


def test_malformed_and_unknown_samples_are_dropped_not_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = State()
    _publish(
        state,
        [
            Sample.of("gpuwatchd_gpu_power_watts", 1, gpu=0),  # missing labels
            Sample.of("gpuwatchd_not_declared", 1),
            Sample.of("gpuwatchd_gpu_energy_joules_total", 5, gpu=1),
            Sample.of("gpuwatchd_gpu_energy_joules_total", 6, gpu=1),  # duplicate series
        ],
        ok=False,
    )
    registry = _registry(state, strict=False)
    with caplog.at_level(logging.ERROR, "gpuwatchd.prometheus"):
        text = render(registry).decode()
        again = render(registry).decode()
    assert "gpuwatchd_not_declared" not in text
    assert "gpuwatchd_gpu_power_watts{" not in text
    assert text.count('gpuwatchd_gpu_energy_joules_total{gpu="1"}') == 1
    assert 'gpuwatchd_collector_success{collector="nvml"} 0.0' in text
    assert 'gpuwatchd_collector_errors_total{collector="nvml",reason="nvml_init"} 2.0' in text
    for reason in ("no_spec", "label_mismatch", "duplicate_series"):
        assert f'gpuwatchd_exporter_dropped_samples_total{{reason="{reason}"}} 1.0' in text
    # a second render of the same snapshot neither counts nor logs again
    assert again == text
    assert len(caplog.records) == 3
    _publish(state, [Sample.of("gpuwatchd_not_declared", 2)])
    text = render(registry).decode()
    assert 'gpuwatchd_exporter_dropped_samples_total{reason="no_spec"} 2.0' in text
    assert len(caplog.records) == 3


def test_dropped_samples_counter_exported_at_zero() -> None:
    state = State()
    _publish(state, [Sample.of("gpuwatchd_gpu_energy_joules_total", 5, gpu=1)])
    text = render(_registry(state, strict=True)).decode()
    for reason in DROP_REASONS:
        assert f'gpuwatchd_exporter_dropped_samples_total{{reason="{reason}"}} 0.0' in text


@pytest.mark.parametrize(
    "bad",
    [
        Sample.of("gpuwatchd_gpu_power_watts", 1, gpu=0),
        Sample.of("gpuwatchd_not_declared", 1),
    ],
)
def test_strict_mode_raises_on_a_sample_it_would_drop(bad: Sample) -> None:
    state = State()
    _publish(state, [bad])
    with pytest.raises(DroppedSampleError, match=bad.name):
        render(_registry(state, strict=True))


def test_strict_mode_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    state = State()
    _publish(state, [Sample.of("gpuwatchd_not_declared", 1)])
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(DroppedSampleError):
        render(_registry(state))
    monkeypatch.setenv(STRICT_ENV, "0")
    assert b"gpuwatchd_not_declared" not in render(_registry(state))


def test_wsgi_routes() -> None:
    state = State()
    app = make_app(_registry(state), {"/healthz": lambda q: (503, "text/plain", b"stale\n")})
    seen: list[str] = []

    def call(path: str, method: str = "GET") -> bytes:
        body = app({"PATH_INFO": path, "REQUEST_METHOD": method}, lambda s, h: seen.append(s))
        return b"".join(body)

    assert b"gpuwatchd_build_info" in call("/metrics")
    assert call("/healthz") == b"stale\n" and seen[-1].startswith("503")
    call("/nope")
    assert seen[-1].startswith("404")
    call("/metrics", "POST")
    assert seen[-1].startswith("405")


def test_textfile_written_atomically(tmp_path: Path) -> None:
    state = State()
    target = tmp_path / "gpuwatchd.prom"
    write_textfile(_registry(state), str(target))
    assert "gpuwatchd_build_info" in target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["gpuwatchd.prom"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_exposition() -> None:
    state = State()
    _publish(state, [Sample.of("gpuwatchd_gpu_energy_joules_total", 1, gpu=0)])
    text = render(_registry(state))
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), res


def test_exposition_rendered_once_per_snapshot() -> None:
    state = State()
    calls = []

    class Counting(SnapshotCollector):
        def collect(self):  # type: ignore[no-untyped-def]
            calls.append(1)
            return super().collect()

    reg = Registry()
    reg.register(Counting(state, SPECS))
    app = make_app(reg, {}, lambda: state.snapshot().generation)

    def scrape() -> bytes:
        return b"".join(app({"PATH_INFO": "/metrics", "REQUEST_METHOD": "GET"}, lambda s, h: None))

    first = scrape()
    assert scrape() == first and len(calls) == 1
    _publish(state, [Sample.of("gpuwatchd_gpu_energy_joules_total", 9, gpu=0)])
    assert b'gpuwatchd_gpu_energy_joules_total{gpu="0"} 9.0' in scrape()
    assert len(calls) == 2
