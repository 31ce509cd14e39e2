"""The diag gate passes only what was measured: every check of the tier on every GPU,
each a finite figure; floors are checked when loaded; a GPU that is not there is UNKNOWN."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd import config
from gpuwatchd.cli import main
from gpuwatchd.diag.run import DiagOptions, run_diag
from gpuwatchd.errors import ConfigError
from gpuwatchd.health.diag.verdict import load_floors
from gpuwatchd.sources.nvml.replay import ReplayClient
from tests.conftest import FIXTURES, ROOT
from tests.diag.fakes import H100_IDLE, HEALTHY_H100, canned, capture_with_script, result

H200X2 = FIXTURES / "nvml" / "h200x2-record.json"
HELLO_ONLY = [{"hello": {"backend": "fake", "devices": 2}}]


def _quick_on(gpu: str, gemm: float = 790.0) -> list[dict[str, Any]]:
    return [
        result("gemm", gpu, gemm, "TFLOP/s"),
        result("h2d_bandwidth", gpu, 52.0, "GB/s"),
        result("d2d_bandwidth", gpu, 4300.0, "GB/s"),
    ]


def _standard_h200x2() -> list[dict[str, Any]]:
    return [
        *HELLO_ONLY,
        *_quick_on("0"),
        *_quick_on("1"),
        result("p2p_bandwidth", "0>1", 380.0, "GB/s"),
        result("p2p_bandwidth", "1>0", 380.0, "GB/s"),
        result("all_reduce", "all", 330.0, "GB/s"),
        result("memory_pattern", "0", 0.0, "words"),
        result("memory_pattern", "1", 0.0, "words"),
    ]


def _h200x2() -> ReplayClient:
    client = ReplayClient.load(H200X2)
    client.init()
    return client


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "diag", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_a_worker_that_measured_nothing_is_unknown_not_ok(tmp_path: Path) -> None:
    """The issue's reproducer: hello, then the end of output, gave `OK ... 0 failed`, exit 0."""
    got = _cli("--nvml-replay", str(H200X2), "--fake-worker", canned(tmp_path, HELLO_ONLY))
    assert got.returncode == 3, got.stdout
    assert got.stdout.startswith("UNKNOWN: diag quick")
    missing = [line.split()[1:4] for line in got.stdout.splitlines() if "ERROR" in line]
    assert sorted(missing) == sorted(
        [c, "gpu", g] for g in "01" for c in ("gemm", "h2d_bandwidth", "d2d_bandwidth")
    )


def test_one_gpu_unreported_is_unknown(tmp_path: Path) -> None:
    lines = [*HELLO_ONLY, *_quick_on("0")]
    report = run_diag(DiagOptions(fake_worker=canned(tmp_path, lines)), _h200x2())
    assert report.verdict == "UNKNOWN"
    assert {(r.check, r.gpu) for r in report.results if r.outcome == "error"} == {
        ("gemm", "1"),
        ("h2d_bandwidth", "1"),
        ("d2d_bandwidth", "1"),
    }
    # ... while a measured failure still says CRITICAL
    slow = [*HELLO_ONLY, *_quick_on("0", gemm=100.0)]
    assert run_diag(DiagOptions(fake_worker=canned(tmp_path, slow)), _h200x2()).verdict == (
        "CRITICAL"
    )


def test_the_whole_standard_tier_passes_and_each_missing_piece_is_unknown(tmp_path: Path) -> None:
    full = _standard_h200x2()
    opts = DiagOptions(tier="standard", fake_worker=canned(tmp_path, full))
    assert run_diag(opts, _h200x2()).verdict == "OK"
    for i in range(1, len(full)):  # drop each measurement in turn
        lines = full[:i] + full[i + 1 :]
        opts = DiagOptions(tier="standard", fake_worker=canned(tmp_path, lines, f"w{i}.jsonl"))
        report = run_diag(opts, _h200x2())
        assert report.verdict == "UNKNOWN", full[i]


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "null"])
def test_nan_infinity_and_null_are_unknown_and_print(tmp_path: Path, raw: str) -> None:
    worker = tmp_path / "w.jsonl"
    lines = [json.dumps(x) for x in HEALTHY_H100]
    lines[1] = json.dumps(result("gemm", "0", 0.0, "TFLOP/s")).replace("0.0", raw, 1)
    worker.write_text("\n".join(lines) + "\n")
    # The daemon's path (scheduled and pre-resume runs) judges with the same code.
    client = ReplayClient.load(H100_IDLE)
    client.init()
    report = run_diag(DiagOptions(fake_worker=str(worker)), client)
    assert report.verdict == "UNKNOWN"
    [gemm] = [r for r in report.results if r.check == "gemm"]
    assert (gemm.outcome, gemm.measured) == ("error", None)
    text = _cli("--nvml-replay", str(H100_IDLE), "--fake-worker", str(worker))
    assert text.returncode == 3, text.stderr  # was exit 1 (a crash) on NaN
    assert "ERROR     gemm" in text.stdout and "Traceback" not in text.stderr
    as_json = _cli("--nvml-replay", str(H100_IDLE), "--fake-worker", str(worker), "--json")
    assert as_json.returncode == 3

    def strict(const: str) -> None:
        raise ValueError(f"not JSON: {const}")

    assert json.loads(as_json.stdout, parse_constant=strict)["verdict"] == "UNKNOWN"


@pytest.mark.parametrize(
    ("floors", "key", "problem"),
    [
        ("gemm: {floor: .nan}", "models[0].checks.gemm.floor", "must be a finite number"),
        ("gemm: {floor: -5}", "models[0].checks.gemm.floor", "must be >= 0"),
        ("all_reduce: {by_gpus: {two: 5}}", "models[0].checks.all_reduce.by_gpus.two", "whole"),
        ("all_reduce: {by_gpus: {2: .inf}}", "models[0].checks.all_reduce.by_gpus.2", "finite"),
        ("all_reduce: {by_gpus: {0: 5}}", "models[0].checks.all_reduce.by_gpus.0", "whole"),
        ("gemm: {floor: 5, flor: 6}", "models[0].checks.gemm.flor", "unknown key"),
        ("gem: {floor: 5}", "models[0].checks.gem", "unknown check"),
        ("gemm: {floor: 5}\n      gemm: {floor: 6}", "models[0].checks.gemm", "given twice"),
    ],
)
def test_site_floors_are_checked_when_the_config_is_loaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], floors: str, key: str, problem: str
) -> None:
    site = tmp_path / "floors.yaml"
    site.write_text(f"models:\n  - match: H100\n    checks:\n      {floors}\n")
    with pytest.raises(ConfigError) as exc:
        load_floors(str(site))
    assert (exc.value.path, exc.value.key) == (str(site), key)
    assert problem in exc.value.problem
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"daemon: {{state_dir: {tmp_path / 'state'}}}\ndiag: {{floors_file: {site}}}\n")
    assert main(["config", "check", str(cfg)]) == 78  # was: ok, then exit 1 while judging
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gpuwatchd: {site}: {key}: {exc.value.problem}"]
    with pytest.raises(ConfigError):
        config.load(str(cfg))
    got = _cli(
        "--nvml-replay", str(H100_IDLE), "--fake-worker", canned(tmp_path, HEALTHY_H100),
        "--floors", str(site),
    )  # fmt: skip
    assert got.returncode == 78 and got.stdout == "", got.stdout
    assert got.stderr.strip() == f"gpuwatchd: {site}: {key}: {exc.value.problem}"


def test_shipped_floors_load() -> None:
    floors = load_floors()
    assert floors.lookup("all_reduce", "NVIDIA H200", 2) is not None


def test_a_gpu_that_is_not_there_is_unknown_naming_those_that_are(tmp_path: Path) -> None:
    worker = canned(tmp_path, [*HELLO_ONLY, *_quick_on("0"), *_quick_on("1")])
    got = _cli("--nvml-replay", str(H200X2), "--fake-worker", worker, "--gpu", "7")
    assert got.returncode == 3, got.stdout  # was 2: "FAIL nvml_sanity gpu 7", CRITICAL
    assert "no GPU 7 on this node (NVML sees GPUs 0, 1)" in got.stdout
    assert "FAIL" not in got.stdout
    both = _cli("--nvml-replay", str(H200X2), "--fake-worker", worker, "--gpu", "1", "--gpu", "1")
    assert both.returncode == 0, both.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--timeout", "-1"],
        ["--timeout", "0"],
        ["--timeout", "nan"],
        ["--gpu", "-1"],
        ["--gpu", "x"],
        ["--tier", "bogus"],
        ["--no-such-flag"],
    ],
)
def test_diag_usage_errors_are_unknown_never_critical(args: list[str]) -> None:
    got = _cli("--nvml-replay", str(H100_IDLE), *args)
    assert got.returncode == 3, (args, got.stderr)
    assert got.stdout == ""


def test_nvml_failing_mid_run_is_unknown_not_warning(tmp_path: Path) -> None:
    """An error nobody expected is UNKNOWN from a plugin command: exit 1 reads as WARNING."""
    capture = capture_with_script(tmp_path, [{"call": "device_count", "error": "UNKNOWN"}])
    got = _cli("--nvml-replay", capture, "--fake-worker", canned(tmp_path, HEALTHY_H100))
    assert got.returncode == 3, (got.stdout, got.stderr)
    assert "Traceback" not in got.stderr
