"""The capture replay, the recorder, and the fixtures they are built from."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.cli import dispatch
from gpuwatchd.cli.record import main as record_main
from gpuwatchd.cli.record import register
from gpuwatchd.clock import FakeClock
from gpuwatchd.errors import NvmlError
from gpuwatchd.model import Sample
from gpuwatchd.sources.nvml.record import record
from gpuwatchd.sources.nvml.replay import FORMAT, ReplayClient, Step, expand_devices, load_capture
from gpuwatchd.sources.nvml.source import NvmlSource

ROOT = Path(__file__).resolve().parent.parent.parent
NVML = ROOT / "tests" / "fixtures" / "nvml"
H200X2 = NVML / "h200x2-probe.json"


def samples_of(client: ReplayClient, polls: int = 2) -> list[list[tuple[str, Any, float]]]:
    """Each poll's samples, minus the timing series, in a comparable form."""
    source = NvmlSource(client, call_timeout=2.0)
    out = []
    try:
        for _ in range(polls):
            items = [s for s in source.poll(0.0) if isinstance(s, Sample)]
            out.append(
                sorted(
                    (s.name, s.labels, s.value)
                    for s in items
                    if s.name != "gpuwatchd_gpu_poll_duration_seconds"
                )
            )
    finally:
        source.close()
    return out


def test_record_then_replay_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "capture.json"
    original = ReplayClient.load(
        H200X2,
        script=[
            {"device": 0, "call": "total_energy_consumption", "add_per_poll": 1000},
        ],
    )
    capture = record(out, polls=3, interval=0.0, client=original)
    assert json.loads(out.read_text()) == capture
    assert capture["format"] == FORMAT
    assert capture["polls"] == 3
    assert capture["host"]["python"] and "kernel" in capture["host"]
    assert capture["summary"]["driver_version"] == "580.159.04"
    assert [g["pci_bus_id"] for g in capture["summary"]["gpus"]] == ["0000:00:06.0", "0000:00:07.0"]
    dev0 = capture["devices"][0]
    assert [o["value"] for o in dev0["calls"]["total_energy_consumption"]] == [
        2172869,
        2173869,
        2174869,
    ]
    assert len(dev0["calls"]["uuid"]) == 1  # identity once
    assert dev0["calls"]["retired_pages(0)"] == [
        {"error": "NOT_SUPPORTED", "code": 3, "us": dev0["calls"]["retired_pages(0)"][0]["us"]}
    ]
    assert dev0["calls"]["nvlink_state(5)"][0]["value"] == 1
    assert len(dev0["fields"]["NVML_FI_DEV_MEMORY_TEMP@0"]) == 3
    assert all(o["us"] >= 0 for obs in dev0["calls"].values() for o in obs)

    # Replaying the recording gives what the recorded source saw, poll by poll.
    expected = samples_of(
        ReplayClient.load(
            H200X2,
            script=[
                {"device": 0, "call": "total_energy_consumption", "add_per_poll": 1000},
            ],
        ),
        polls=3,
    )
    assert samples_of(ReplayClient(capture), polls=3) == expected


def test_missing_calls_are_not_recorded_never_zero() -> None:
    client = ReplayClient.load(
        H200X2,
        script=[
            {"device": 0, "call": "nvlink_error_counter(1,0)", "value": 7},
        ],
    )
    dev = client.device(0)
    with pytest.raises(NvmlError) as info:
        dev.call("nvlink_error_counter", 1, 0)  # the probe read link 0 only
    assert info.value.code == "NOT_RECORDED"
    assert dev.call("nvlink_error_counter", 0, 3) == 2
    fields = dev.field_values(
        [
            ("NVML_FI_DEV_MEMORY_TEMP", 0),
            ("NVML_FI_DEV_RETIRED_SBE", 0),
            ("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 0),
        ]
    )
    assert fields[("NVML_FI_DEV_MEMORY_TEMP", 0)] == 35
    err = fields[("NVML_FI_DEV_RETIRED_SBE", 0)]
    assert isinstance(err, NvmlError) and (err.code, err.value) == ("NOT_SUPPORTED", 3)
    missing = fields[("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 0)]
    assert isinstance(missing, NvmlError) and missing.code == "NOT_RECORDED"


def test_recorded_errors_keep_their_codes() -> None:
    dev = ReplayClient.load(H200X2).device(1)
    with pytest.raises(NvmlError) as info:
        dev.call("retired_pages_pending_status")
    assert (info.value.code, info.value.value) == ("NOT_SUPPORTED", 3)


def test_windows_by_call_poll_and_time() -> None:
    clock = FakeClock()
    client = ReplayClient.load(
        H200X2,
        clock=clock,
        script=[
            {"call": "driver_version", "from_call": 1, "until_call": 2, "error": "TIMEOUT"},
            {"device": 0, "call": "temperature(*)", "from_poll": 2, "add": 10},
            {"device": 1, "call": "temperature(0)", "from_s": 30, "until_s": 60, "value": 90},
        ],
    )
    assert client.call("driver_version") == "580.159.04"
    with pytest.raises(NvmlError, match="TIMEOUT"):
        client.call("driver_version")
    assert client.call("driver_version") == "580.159.04"
    d0, d1 = client.device(0), client.device(1)
    client.call("device_count")
    assert d0.call("temperature", 0) == 34
    client.call("device_count")
    assert d0.call("temperature", 0) == 44
    assert d1.call("temperature", 0) == 35
    clock.advance(30)
    assert d1.call("temperature", 0) == 90
    clock.advance(30)
    assert d1.call("temperature", 0) == 35


def test_hang_for_seconds_and_until_released() -> None:
    client = ReplayClient.load(
        H200X2,
        script=[
            {"call": "nvml_version", "hang": 0.1},
            {"device": 0, "call": "uuid", "hang": True},
        ],
    )
    t0 = time.monotonic()
    assert client.call("nvml_version") == "13.580.159.04"
    assert time.monotonic() - t0 >= 0.1
    answers: list[object] = []
    worker = threading.Thread(target=lambda: answers.append(client.device(0).call("uuid")))
    worker.start()
    worker.join(0.2)
    assert worker.is_alive() and answers == []
    client.release()
    worker.join(2)
    assert answers == ["GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6"]


@pytest.mark.parametrize(
    ("step", "problem"),
    [
        ({"call": "init", "eror": "GPU_IS_LOST"}, "unknown keys"),
        ({"call": "init", "error": "GPU_LOST"}, "unknown NVML error"),
        ({"xid": 79}, "needs a device"),
    ],
)
def test_bad_script_steps_are_refused(step: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Step.parse(step)


def test_script_in_the_capture_file(tmp_path: Path) -> None:
    capture = load_capture(H200X2)
    capture["script"] = [{"device": 1, "call": "power_usage", "error": "GPU_IS_LOST"}]
    path = tmp_path / "scripted.json"
    path.write_text(json.dumps(capture))
    with pytest.raises(NvmlError, match="GPU_IS_LOST"):
        ReplayClient.load(path).device(1).call("power_usage")


@pytest.mark.parametrize(
    "content",
    [
        '{"devices": []}',
        '{"format": "gpuwatchd-nvml-capture/9"}',
        '{"format": "gpuwatchd-nvml-capture/1", "devices": 3}',
    ],
)
def test_bad_capture_files_are_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(ValueError):
        ReplayClient.load(path)


def test_expand_devices() -> None:
    capture = load_capture(H200X2)
    wide = expand_devices(capture, 8)
    assert wide["system"]["device_count"][0]["value"] == 8
    uuids = [d["calls"]["uuid"][0]["value"] for d in wide["devices"]]
    assert len(set(uuids)) == 8 and uuids[:2] == [
        d["calls"]["uuid"][0]["value"] for d in capture["devices"]
    ]
    assert (
        wide["devices"][5]["calls"]["temperature(0)"]
        == capture["devices"][1]["calls"]["temperature(0)"]
    )
    assert expand_devices(capture, 8) == wide  # deterministic
    with pytest.raises(ValueError):
        expand_devices(capture, 1)


def _convert_probe_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "convert_probe", ROOT / "scripts" / "convert_probe.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fixtures_are_what_the_converter_makes() -> None:
    convert = _convert_probe_module()
    probe = json.loads((NVML / "source" / "h200x2-nvml-probe.json").read_text())
    capture = convert.convert_probe(probe)
    assert json.loads(H200X2.read_text()) == capture
    assert json.loads((NVML / "h200x8-from-h200x2.json").read_text()) == expand_devices(capture, 8)


def test_record_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out = tmp_path / "x.json"
    args = parser.parse_args(
        [
            "record",
            "--out",
            str(out),
            "--polls",
            "2",
            "--interval",
            "0",
            "--from-replay",
            str(H200X2),
        ]
    )
    assert dispatch(args) == 0
    assert "2 GPU(s), driver 580.159.04, 2 poll(s)" in capsys.readouterr().out
    assert load_capture(out)["polls"] == 2


def test_record_without_nvml_writes_the_failure(tmp_path: Path) -> None:
    out = tmp_path / "nothing.json"
    client = ReplayClient.load(H200X2, script=[{"call": "init", "error": "DRIVER_NOT_LOADED"}])
    capture = record(out, polls=3, interval=0.0, client=client)
    assert capture["init"][0]["error"] == "DRIVER_NOT_LOADED"
    assert capture["devices"] == []
    assert "DRIVER_NOT_LOADED" in capture["summary"]["init_error"]
    assert record_main(["--out", str(out), "--from-replay", str(H200X2), "--polls", "1"]) == 0


def test_record_runs_with_only_the_standard_library_and_pynvml(tmp_path: Path) -> None:
    out = tmp_path / "standalone.json"
    blocked = ["yaml", "prometheus_client", "pyudev", "systemd"]
    code = (
        f"import sys, runpy\nfor m in {blocked!r}: sys.modules[m] = None\n"
        f"sys.argv = ['record', '--out', {str(out)!r}, '--polls', '1', "
        f"'--from-replay', {str(H200X2)!r}]\n"
        "runpy.run_module('gpuwatchd.cli.record', run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert load_capture(out)["summary"]["gpus"]
