"""A CLI diag run (a Slurm epilog's, say) lands in the daemon's store with trigger cli:
/events?kind=diag lists it, the gpuwatchd_diag_* series show it, GpuDiagFailed opens and
a repeated failure says drain_and_inspect, as docs/diag.md promises."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli import main as cli_main
from gpuwatchd.clock import FakeClock
from gpuwatchd.http.endpoints import events_route
from gpuwatchd.pipeline.daemon import Pipeline
from gpuwatchd.state import State
from tests.diag.fakes import H100_IDLE, canned, result


def test_a_failing_cli_run_is_exported_and_raises_gpu_diag_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "state"
    path = tmp_path / "gpuwatchd.yaml"
    path.write_text(
        f"daemon: {{state_dir: {state_dir}}}\n"
        f"paths: {{dev_shm: {tmp_path}, sysfs: {tmp_path}}}\n"
        "diag: {inspect_after_failures: 2}\n"
    )
    cfg = config.load(str(path))
    Pipeline(cfg, State(), FakeClock(), "n", 0, []).stop()  # the daemon made its store
    slow = canned(tmp_path, [result("gemm", "0", 100.0, "TFLOP/s")], "slow.jsonl")
    argv = ["diag", "--config", str(path), "--nvml-replay", str(H100_IDLE), "--fake-worker", slow]
    for _ in range(2):  # two epilogs, two failures of the same check on the same GPU
        assert cli_main(argv) == 2
    assert "not recorded" not in capsys.readouterr().err

    state = State()
    pipeline = Pipeline(cfg, state, FakeClock(time.time()), "n", 0, [])
    try:
        pipeline.tick()  # publishes the diag series read from the store
        pipeline.tick()  # the engine's rules see them
        status, _, body = events_route(pipeline.store)({"kind": ["diag"]})
        assert status == 200
        runs = json.loads(body)["events"]
        assert [e["attrs"]["trigger"] for e in runs] == ["cli", "cli"]
        extra = {(s.name, s.labels): s.value for s in state.snapshot().extra.get("diag", ())}
        assert extra[("gpuwatchd_diag_check_passed", (("check", "gemm"), ("gpu", "0")))] == 0
        assert extra[("gpuwatchd_diag_inspect", (("check", "gemm"), ("gpu", "0")))] == 1
        [failed] = [f for f in pipeline.engine.open_findings() if f.alertname == "GpuDiagFailed"]
        assert dict(failed.subject) == {"check": "gemm", "gpu": "0"}
        assert "drain and inspect" in failed.reason
    finally:
        pipeline.stop()


def test_the_cli_report_and_the_stored_run_are_one_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuwatchd diag --json` prints the run the store then serves under /events' `diag`."""
    state_dir = tmp_path / "state"
    path = tmp_path / "gpuwatchd.yaml"
    path.write_text(
        f"daemon: {{state_dir: {state_dir}}}\npaths: {{dev_shm: {tmp_path}, sysfs: {tmp_path}}}\n"
    )
    cfg = config.load(str(path))
    Pipeline(cfg, State(), FakeClock(), "n", 0, []).stop()
    slow = canned(tmp_path, [result("gemm", "0", 100.0, "TFLOP/s", detail="bf16")], "slow.jsonl")
    argv = ["diag", "--config", str(path), "--nvml-replay", str(H100_IDLE), "--fake-worker", slow]
    assert cli_main([*argv, "--json"]) == 2
    printed = json.loads(capsys.readouterr().out)
    pipeline = Pipeline(cfg, State(), FakeClock(time.time()), "n", 0, [])
    try:
        _, _, body = events_route(pipeline.store)({"kind": ["diag"]})
        [row] = json.loads(body)["events"]
    finally:
        pipeline.stop()
    assert row["diag"] == {**printed, "trigger": "cli"}
    [gemm] = [r for r in row["diag"]["results"] if r["check"] == "gemm"]
    assert gemm["outcome"] == "fail" and gemm["measured"] == 100.0 and gemm["detail"] == "bf16"
    assert gemm["floor_source"]  # the shipped floor for the H100, named
