"""One diag run over replayed NVML and a fake worker: verdicts, floors, busy GPUs, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatchd.diag.run import DiagOptions, run_diag
from gpuwatchd.diag.worker.measure import Measurement
from gpuwatchd.errors import ConfigError
from gpuwatchd.health.diag.verdict import evaluate, load_floors, verdict
from gpuwatchd.sources.diag.dcgm import parse_dcgmi
from gpuwatchd.sources.diag.nvml_reads import foreign_pids, read_gpus
from gpuwatchd.sources.nvml.replay import ReplayClient
from tests.conftest import ROOT
from tests.diag.fakes import (
    H100_IDLE,
    HEALTHY_H100,
    alive,
    canned,
    capture_with_script,
    env_without_dcgmi,
    result,
)


def _client(script: list[dict[str, object]] | None = None) -> ReplayClient:
    client = ReplayClient.load(H100_IDLE, script=script or [])
    client.init()
    return client


def test_healthy_quick_run_passes_with_floors_and_sources(tmp_path: Path) -> None:
    report = run_diag(DiagOptions(fake_worker=canned(tmp_path, HEALTHY_H100)), _client())
    assert report.verdict == "OK", report
    by_check = {r.check: r for r in report.results}
    assert set(by_check) == {"nvml_sanity", "gemm", "h2d_bandwidth", "d2d_bandwidth"}
    gemm = by_check["gemm"]
    assert (gemm.outcome, gemm.measured, gemm.floor) == ("pass", 790.0, 660.0)
    assert "778" in gemm.floor_source  # the measurement the floor comes from
    assert report.models == {"0": "NVIDIA H100 80GB HBM3"}


def test_below_floor_and_wrong_result_fail(tmp_path: Path) -> None:
    lines = [
        result("gemm", "0", 500.0, "TFLOP/s"),
        result("d2d_bandwidth", "0", 3000.0, "GB/s"),
        result("memory_pattern", "0", 3.0, "words", correct=False),
    ]
    report = run_diag(DiagOptions(fake_worker=canned(tmp_path, lines)), _client())
    assert report.verdict == "CRITICAL"
    failed = sorted((r.check, r.gpu) for r in report.results if r.failed)
    assert failed == [("gemm", "0"), ("memory_pattern", "0")]


def test_dead_worker_gives_unknown_not_pass(tmp_path: Path) -> None:
    lines = [result("gemm", "0", 790.0, "TFLOP/s"), {"exit": 1}]
    report = run_diag(DiagOptions(fake_worker=canned(tmp_path, lines)), _client())
    assert report.verdict == "UNKNOWN"
    assert {r.check for r in report.results if r.outcome == "error"} == {
        "h2d_bandwidth",
        "d2d_bandwidth",
    }


def test_busy_gpu_refuses_to_start(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        script = [
            {
                "device": 0,
                "call": "compute_running_processes",
                "value": [{"pid": other.pid, "used_memory": 1 << 30}],
            }
        ]
        report = run_diag(DiagOptions(fake_worker=canned(tmp_path, HEALTHY_H100)), _client(script))
    finally:
        other.kill()
        other.wait()
    assert report.cancelled == f"GPU in use by process {other.pid}"
    assert report.verdict == "UNKNOWN" and report.results == ()


def test_process_appearing_mid_run_cancels_and_fails_nothing(tmp_path: Path) -> None:
    pidfile = tmp_path / "worker-child.pid"
    lines = [
        *HEALTHY_H100[:2],
        {"spawn": [sys.executable, "-c", "import time; time.sleep(60)"], "pidfile": str(pidfile)},
        {"sleep": 60},
    ]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        script = [
            {
                "device": 0,
                "call": "compute_running_processes",
                "from_s": 1.0,
                "value": [{"pid": other.pid, "used_memory": 1 << 20}],
            }
        ]
        t0 = time.monotonic()
        report = run_diag(DiagOptions(fake_worker=canned(tmp_path, lines)), _client(script))
        took = time.monotonic() - t0
    finally:
        other.kill()
        other.wait()
    assert report.cancelled.startswith("GPU in use by process")
    assert report.results == () and report.verdict == "UNKNOWN"
    assert took < 10 and report.freed_seconds < 3
    child = int(pidfile.read_text())
    gone_by = time.monotonic() + 5.0  # SIGKILL to the group is delivered asynchronously
    while alive(child) and time.monotonic() < gone_by:
        time.sleep(0.02)
    assert not alive(child)


def test_a_job_named_by_the_workloads_view_cancels(tmp_path: Path) -> None:
    calls = []

    def busy() -> str:
        calls.append(1)
        return "slurm job 7 on the node" if len(calls) > 2 else ""

    lines = [*HEALTHY_H100[:2], {"sleep": 60}]
    report = run_diag(DiagOptions(fake_worker=canned(tmp_path, lines)), _client(), busy=busy)
    assert report.cancelled == "slurm job 7 on the node"


def test_foreign_pids_spare_the_workers_group() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    try:
        gpus = read_gpus(_client())
        from dataclasses import replace

        listed = [replace(gpus[0], pids=(worker.pid, 999999))]
        assert foreign_pids(listed, worker.pid) == [999999]
        assert foreign_pids(listed, None) == [worker.pid, 999999]
    finally:
        worker.kill()
        worker.wait()


# --- floors ---------------------------------------------------------------------------


@pytest.mark.parametrize(("count", "floor"), [(2, 280.0), (3, 280.0), (4, 300.0), (8, 307.0)])
def test_all_reduce_floor_by_gpu_count(count: int, floor: float) -> None:
    got = load_floors().lookup("all_reduce", "NVIDIA H100 80GB HBM3", count)
    assert got is not None and got.value == floor


def test_unknown_model_has_no_bandwidth_floor_but_the_generic_all_reduce_one() -> None:
    floors = load_floors()
    assert floors.lookup("gemm", "Tesla T4", 1) is None
    generic = floors.lookup("all_reduce", "Tesla T4", 4)
    assert generic is not None and generic.value == 150.0 and "NVSentinel" in generic.source


def test_site_floors_come_first_and_say_so(tmp_path: Path) -> None:
    site = tmp_path / "floors.yaml"
    site.write_text(
        "models:\n  - match: h100\n    checks:\n"
        "      gemm: {floor: 700, source: our acceptance test}\n"
    )
    floors = load_floors(str(site))
    gemm = floors.lookup("gemm", "NVIDIA H100 80GB HBM3", 1)
    assert gemm is not None and gemm.value == 700.0
    assert gemm.source == f"our acceptance test (site floor, {site})"
    d2d = floors.lookup("d2d_bandwidth", "NVIDIA H100 80GB HBM3", 1)
    assert d2d is not None and d2d.value == 2550.0  # the rest stays shipped


def test_bad_site_floors_name_the_key(tmp_path: Path) -> None:
    site = tmp_path / "floors.yaml"
    site.write_text("models:\n  - match: H100\n    checks:\n      gemm: {floor: fast}\n")
    with pytest.raises(ConfigError, match=r"models\[0\]\.checks\.gemm\.floor: must be a number"):
        load_floors(str(site))


def test_verdicts() -> None:
    floors = load_floors()
    models = {"0": "NVIDIA H100 80GB HBM3"}
    ok = evaluate([Measurement("gemm", "0", 700.0, "TFLOP/s")], models, floors)
    assert verdict(ok) == "OK"
    skipped = evaluate([Measurement("dcgm", "all", None, "skipped")], models, floors)
    assert verdict([*ok, *skipped]) == "UNKNOWN"
    assert verdict([]) == "UNKNOWN"


# --- dcgmi ----------------------------------------------------------------------------


def test_dcgmi_verdict_folded_in() -> None:
    # The shape of `dcgmi diag -j` (test categories holding tests holding results);
    # a synthetic document, not a capture: no DCGM on the machines here.
    doc = {
        "DCGM GPU Diagnostic": {
            "test_categories": [
                {
                    "category": "Deployment",
                    "tests": [{"name": "Denylist", "results": [{"status": "Pass"}]}],
                },
                {
                    "category": "Hardware",
                    "tests": [
                        {"name": "GPU Memory", "results": [{"status": "Fail", "gpu_id": "1"}]},
                        {"name": "Diagnostic", "results": [{"status": "Skip"}]},
                    ],
                },
            ]
        }
    }
    m = parse_dcgmi(json.dumps(doc), 226, 2)
    assert (m.value, m.correct) == (1.0, False)
    assert "failed: GPU Memory" in m.detail
    assert parse_dcgmi("Error: unable to connect to host engine", 255, 1).error


# --- the command line -------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "diag", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    ok = _cli(
        "--nvml-replay", str(H100_IDLE), "--fake-worker", canned(tmp_path, HEALTHY_H100), "--json"
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["verdict"] == "OK"
    slow = canned(tmp_path, [result("gemm", "0", 100.0, "TFLOP/s")], "slow.jsonl")
    bad = _cli("--nvml-replay", str(H100_IDLE), "--fake-worker", slow)
    assert bad.returncode == 2
    assert bad.stdout.startswith("CRITICAL: diag quick")
    assert "FAIL      gemm" in bad.stdout and "floor 660 [1]" in bad.stdout
    dcgm = _cli("--nvml-replay", str(H100_IDLE), "--tier", "dcgm", env=env_without_dcgmi(tmp_path))
    assert dcgm.returncode == 3 and "dcgmi not installed" in dcgm.stdout


def test_cli_busy_node_is_unknown(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        capture = capture_with_script(
            tmp_path,
            [
                {
                    "device": 0,
                    "call": "compute_running_processes",
                    "value": [{"pid": other.pid, "used_memory": 1}],
                }
            ],
        )
        busy = _cli("--nvml-replay", capture, "--fake-worker", canned(tmp_path, HEALTHY_H100))
    finally:
        other.kill()
        other.wait()
    assert busy.returncode == 3
    assert busy.stdout.startswith(
        f"UNKNOWN: diag quick cancelled (GPU in use by process {other.pid})"
    )


def test_cli_bad_floors_file_exits_78(tmp_path: Path) -> None:
    site = tmp_path / "floors.yaml"
    site.write_text("models: [{match: H100, checks: {gemm: {}}}]\n")
    got = _cli(
        "--nvml-replay",
        str(H100_IDLE),
        "--fake-worker",
        canned(tmp_path, HEALTHY_H100),
        "--floors",
        str(site),
    )
    assert got.returncode == 78
    assert f"{site}: models[0].checks.gemm: needs a number" in got.stderr


def test_timed_out_run_reports_the_time_it_took_to_free_the_gpus(tmp_path: Path) -> None:
    # the worker never finishes: the deadline kills its group, and the report says how
    # long the GPUs took to come free after the kill (was 0 for every timed-out run)
    lines = [{"hello": {"backend": "fake", "devices": 1}}, {"sleep": 60}]
    report = run_diag(DiagOptions(timeout=0.5, fake_worker=canned(tmp_path, lines)), _client())
    assert report.verdict == "UNKNOWN" and "did not finish within 0.5s" in report.error
    assert report.freed_seconds > 0
