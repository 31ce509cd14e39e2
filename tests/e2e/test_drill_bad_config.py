"""Drill: every file the config names is read at `config check` and at start, and a bad one
is one line naming file, key and problem, exit 78 (systemd's RestartPreventExitStatus),
never a traceback and exit 70 once the daemon is half built."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port

SIGNATURE = (
    "signatures:\n  - name: site_stall\n    title: t\n    severity: warning\n"
    "    when:\n      - facts: ['cond:cpu_stall']\n"
)


def _gpuwatchd(*args: str, code: str = "") -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "gpuwatchd"]
    return subprocess.run(
        [*argv, *([] if code else args)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def _run(cfg: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return _gpuwatchd(
        "run", "--config", str(cfg), "--listen", f"127.0.0.1:{free_port()}",
        "--state-dir", str(tmp / "state"), *extra,
    )  # fmt: skip


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# (config text, files to write beside it, the config key, the file named, the problem)
Case = Callable[[Path], tuple[str, str, str, str]]


def _replay_not_a_capture(tmp: Path) -> tuple[str, str, str, str]:
    return (
        f"sources: {{nvml: {{replay: {ROOT / 'README.md'}}}}}\n",
        "sources.nvml.replay",
        ("README.md"),
        "not a usable NVML capture",
    )


def _signatures_missing(tmp: Path) -> tuple[str, str, str, str]:
    return (
        "hangs: {signatures_file: /nonexistent.yaml}\n",
        "hangs.signatures_file",
        ("/nonexistent.yaml"),
        "No such file",
    )


def _signatures_invalid(tmp: Path) -> tuple[str, str, str, str]:
    (tmp / "sig.yaml").write_text("signatures:\n  - name: x\n")
    return f"hangs: {{signatures_file: {tmp / 'sig.yaml'}}}\n", "", "sig.yaml", "signature x"


def _signatures_repeated_key(tmp: Path) -> tuple[str, str, str, str]:
    (tmp / "sig.yaml").write_text(SIGNATURE.replace("    severity:", "    title: u\n    severity:"))
    return (
        f"hangs: {{signatures_file: {tmp / 'sig.yaml'}}}\n",
        "signatures[0].title",
        "sig.yaml",
        "key given twice (lines 3 and 4)",
    )


def _floors_nan(tmp: Path) -> tuple[str, str, str, str]:
    (tmp / "floors.yaml").write_text("models: [{match: H100, checks: {gemm: {floor: .nan}}}]\n")
    return (
        f"diag: {{floors_file: {tmp / 'floors.yaml'}}}\n",
        "models[0].checks.gemm.floor",
        "floors.yaml",
        "must be a finite number",
    )


def _web_config_repeated_key(tmp: Path) -> tuple[str, str, str, str]:
    (tmp / "web.yml").write_text(
        "http_server_config:\n  headers: {X-A: b}\nhttp_server_config:\n  headers: {X-C: d}\n"
    )
    return (
        f"http: {{web_config_file: {tmp / 'web.yml'}}}\n",
        "http_server_config",
        "web.yml",
        "key given twice (lines 1 and 3)",
    )


def _config_repeated_key(tmp: Path) -> tuple[str, str, str, str]:
    return "http:\n  listen: 127.0.0.1:1\nhttp:\n  textfile: ''\n", "http", "c.yaml", "twice"


def _am_ca_not_a_certificate(tmp: Path) -> tuple[str, str, str, str]:
    return (
        f"alertmanager: {{urls: ['https://am:9093'], tls_ca_file: {ROOT / 'README.md'}}}\n",
        "alertmanager.tls_ca_file",
        "README.md",
        "not a CA bundle",
    )


def _am_cert_not_a_certificate(tmp: Path) -> tuple[str, str, str, str]:
    (tmp / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    return (
        f"alertmanager: {{tls_cert_file: {tmp / 'cert.pem'}}}\n",
        "alertmanager.tls_cert_file",
        "c.yaml",
        "certificate and key",
    )


def _am_key_without_cert(tmp: Path) -> tuple[str, str, str, str]:
    (tmp / "key.pem").write_text("k")
    return (
        f"alertmanager: {{tls_key_file: {tmp / 'key.pem'}}}\n",
        ("alertmanager.tls_key_file"),
        "c.yaml",
        "needs alertmanager.tls_cert_file",
    )


def _empty_token(tmp: Path) -> tuple[str, str, str, str]:
    (tmp / "token").write_text("\n")
    return (
        f"alertmanager: {{bearer_token_file: {tmp / 'token'}}}\n",
        ("alertmanager.bearer_token_file"),
        "token",
        "is empty",
    )


def _kubernetes_ca(tmp: Path) -> tuple[str, str, str, str]:
    return (
        f"remediation: {{kubernetes: {{ca_file: {ROOT / 'README.md'}}}}}\n",
        ("remediation.kubernetes.ca_file"),
        "README.md",
        "not a CA bundle",
    )


def _diag_python(tmp: Path) -> tuple[str, str, str, str]:
    return (
        "diag: {python: /nonexistent/python3}\n",
        "diag.python",
        "/nonexistent/python3",
        ("not an executable"),
    )


CASES = [
    _replay_not_a_capture,
    _signatures_missing,
    _signatures_invalid,
    _signatures_repeated_key,
    _floors_nan,
    _web_config_repeated_key,
    _config_repeated_key,
    _am_ca_not_a_certificate,
    _am_cert_not_a_certificate,
    _am_key_without_cert,
    _empty_token,
    _kubernetes_ca,
    _diag_python,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.lstrip("_") for c in CASES])
def test_config_check_and_run_refuse_each_bad_named_file_in_one_line(
    tmp_path: Path, case: Case
) -> None:
    text, key, named, problem = case(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"daemon: {{state_dir: {tmp_path / 'state'}}}\n" + text)
    check = _gpuwatchd("config", "check", str(cfg))
    assert check.returncode == 78, check.stdout + check.stderr  # was 0: "ok"
    line = _one_line(check.stderr)
    assert key in line and named in line and problem in line, line
    run = _run(cfg, tmp_path)
    assert run.returncode == 78, run.stderr  # was 70 with a traceback, or a daemon that ran
    assert line.removeprefix("gpuwatchd: ") in _one_line(run.stderr)


def test_nvml_replay_flag_naming_a_non_capture_is_one_line(tmp_path: Path) -> None:
    """The issue's reproducer: `gpuwatchd run --nvml-replay README.md` died exit 70."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    run = _run(cfg, tmp_path, "--nvml-replay", "README.md")
    assert run.returncode == 78, run.stderr
    line = _one_line(run.stderr)
    assert "command line: --nvml-replay: README.md: not a usable NVML capture" in line


def test_a_config_error_that_escapes_start_is_still_78_and_one_line(tmp_path: Path) -> None:
    """A part that refuses its settings while the daemon is built (here: the capture, with
    the check at load switched off) stops it as a bad config, not as a crash."""
    code = (
        "import sys, gpuwatchd.daemon as d; d.check_parsed_files = lambda cfg, file: None;"
        "from gpuwatchd.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    run = _gpuwatchd(
        "run", "--nvml-replay", "README.md", "--listen", f"127.0.0.1:{free_port()}",
        "--state-dir", str(tmp_path / "state"), code=code,
    )  # fmt: skip
    assert run.returncode == 78, run.stderr
    assert "--nvml-replay: README.md" in _one_line(run.stderr)


def test_valid_named_files_pass(tmp_path: Path) -> None:
    (tmp_path / "sig.yaml").write_text(SIGNATURE)
    (tmp_path / "floors.yaml").write_text("models: [{match: H100, checks: {gemm: {floor: 600}}}]\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"daemon: {{state_dir: {tmp_path / 'state'}}}\n"
        f"sources: {{nvml: {{replay: {ROOT / 'tests/fixtures/nvml/h100-idle-record.json'}}}}}\n"
        f"hangs: {{signatures_file: {tmp_path / 'sig.yaml'}}}\n"
        f"diag: {{floors_file: {tmp_path / 'floors.yaml'}, python: {sys.executable}}}\n"
    )
    check = _gpuwatchd("config", "check", str(cfg))
    assert (check.returncode, check.stdout) == (0, f"{cfg}: ok\n"), check.stderr
