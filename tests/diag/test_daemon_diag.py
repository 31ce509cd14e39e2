"""The daemon runs a scheduled diag (real daemon process, replayed NVML, fake worker):
the results reach /metrics, /status, the health rules and `gpuwatchd check --json`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatchd.diag.run import FAKE_WORKER_ENV
from tests.conftest import ROOT
from tests.diag.fakes import H100_IDLE, canned, result


@pytest.mark.timeout(120)
def test_scheduled_failure_is_exported_alerted_and_checked(tmp_path: Path, start_daemon) -> None:
    worker = canned(
        tmp_path,
        [result("gemm", "0", 100.0, "TFLOP/s"), result("d2d_bandwidth", "0", 3000.0, "GB/s")],
    )
    cfg = f"""
paths: {{dev_shm: {tmp_path}}}
sources: {{udev: {{enabled: false}}, kmsg: {{enabled: false}}}}
diag: {{schedule_seconds: 1}}
"""
    d = start_daemon(cfg, "--nvml-replay", str(H100_IDLE), env={FAKE_WORKER_ENV: worker})
    want = 'gpuwatchd_diag_check_passed{check="gemm",gpu="0"} 0'
    end = time.monotonic() + 30
    while want not in d.get("/metrics")[1].decode() and time.monotonic() < end:
        time.sleep(0.3)
    metrics = d.get("/metrics")[1].decode()
    assert want in metrics, d.output()[-3000:]
    assert 'gpuwatchd_diag_measured{check="gemm",gpu="0"} 1e+14' in metrics
    assert 'gpuwatchd_diag_check_passed{check="d2d_bandwidth",gpu="0"} 1' in metrics
    status = json.loads(d.get("/status")[1])
    [run, *_] = status["diag"]["last_runs"]
    assert (run["tier"], run["verdict"], run["trigger"]) == ("quick", "CRITICAL", "schedule")
    assert run["failed"] == ["gemm:0"]
    end = time.monotonic() + 15
    while b"GpuDiagFailed" not in d.get("/status")[1] and time.monotonic() < end:
        time.sleep(0.3)
    assert b"GpuDiagFailed" in d.get("/status")[1]

    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "check",
            "--json",
            "--nvml-replay",
            str(H100_IDLE),
            "--config",
            str(d.config),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    verdict = json.loads(check.stdout)
    assert verdict["status"] == "WARNING", check.stdout
    assert "GpuDiagFailed" in {c["alertname"] for c in verdict["conditions"]}
    assert verdict["diag"][0]["verdict"] == "CRITICAL"
