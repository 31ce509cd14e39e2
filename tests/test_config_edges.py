"""Config edges: non-finite and huge numbers, NUL bytes, non-UTF-8 files, every problem at
once, and `config check` running exactly the checks `run` runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli import main
from gpuwatchd.errors import ConfigError
from tests.conftest import ROOT, free_port


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("sources:\n  nvml:\n    call_timeout: .nan\n", "sources.nvml.call_timeout", "finite"),
        ("sources:\n  nvml:\n    interval: .inf\n", "sources.nvml.interval", "finite"),
        ("xid:\n  warning_hold: -.inf\n", "xid.warning_hold", "finite"),
        ("store:\n  max_events: 1e400\n", "store.max_events", ""),
        ("store:\n  max_events: 99999999999999999999999999\n", "store.max_events", "too large"),
        ("xid:\n  warning_hold: 1.0e+300\n", "xid.warning_hold", "too large"),
        ("xid:\n  escalate_after: " + "9" * 5000 + "\n", "", ""),
        ('daemon:\n  state_dir: "/var/lib/gpu\\0watchd"\n', "daemon.state_dir", "NUL"),
        ('sources:\n  kmsg:\n    file: "/var/log/k\\0ern.log"\n', "sources.kmsg.file", "NUL"),
        ("xid:\n  overrides:\n    abc: {severity: critical}\n", "xid.overrides.abc", "numeric"),
        ("xid:\n  overrides:\n    '99999999': {severity: critical}\n", "xid.overrides", ""),
        ("alertmanager:\n  urls: ['am:9093']\n", "alertmanager.urls[0]", "http(s)"),
        (
            "alertmanager:\n  urls: ['http://u:hunter2@am:9093']\n",
            "alertmanager.urls[0]",
            "basic_auth_password_file",
        ),
        ("alertmanager:\n  static_labels: {'bad-name': x}\n", "alertmanager.static_labels", ""),
        (
            "alertmanager:\n  external_url: 'https://u:hunter2@me'\n",
            "alertmanager.external_url",
            "credentials",
        ),
    ],
)
def test_bad_values_are_one_line_each(text: str, key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.load_text(text, "site.yaml")
    line = str(info.value)
    assert line.startswith(f"site.yaml: {key}"), line
    assert problem in line
    assert "\n" not in line
    assert "hunter2" not in line


def test_every_problem_of_a_file_is_reported_at_once(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "sources:\n  nvml:\n    interval: -3\n    call_timeout: .nan\n"
        "  nope: 1\n"
        "alertmanager:\n  urls: ['am:9093']\n  static_labels: {node: x}\n"
        "xid:\n  overrides:\n    abc: {}\n"
    )
    assert main(["config", "check", str(bad)]) == 78
    err = capsys.readouterr().err.strip().splitlines()
    keys = [line.split(": ")[2] for line in err]
    assert keys == [
        "sources.nvml.interval",
        "sources.nvml.call_timeout",
        "sources.nope",
        "alertmanager.urls[0]",
        "alertmanager.static_labels.node",
        "xid.overrides.abc",
    ], err
    assert all(line.startswith(f"gpuwatchd: {bad}: ") for line in err)


def test_a_file_that_is_not_utf8_is_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("daemon:\n  node_name: n\xf6de\n".encode("latin-1"))
    assert main(["config", "check", str(bad)]) == 78
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gpuwatchd: {bad}: not UTF-8 (byte 22)"]


@pytest.mark.parametrize(
    "text",
    [
        "alertmanager:\n  urls: ['am:9093']\n",
        "alertmanager:\n  static_labels: {'0bad': x}\n",
        "xid:\n  overrides:\n    abc: {severity: critical}\n",
        "sources:\n  nvml:\n    call_timeout: .nan\n",
    ],
)
def test_config_check_refuses_what_run_refuses(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    check = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "config", "check", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "run",
            "--config",
            str(cfg),
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == run.returncode == 78, (check.stderr, run.stderr)
    assert "Traceback" not in check.stderr + run.stderr
    assert check.stderr.strip().splitlines()[0].split(": ", 1)[1] in run.stderr


def test_config_check_also_reads_the_web_config(tmp_path: Path, capsys) -> None:
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  bogus: 1\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"http:\n  web_config_file: {web}\n")
    assert main(["config", "check", str(cfg)]) == 78
    assert "bogus" in capsys.readouterr().err


def test_one_override_builder_for_every_subcommand(tmp_path: Path) -> None:
    """run, check, clear and hang show read the same flags into the config the same way."""
    import argparse

    from gpuwatchd.cli import build_parser
    from gpuwatchd.config.overrides import Overrides, load_with

    parser = build_parser(None)
    for argv in (
        ["check", "--state-dir", str(tmp_path)],
        ["clear", "--all", "--state-dir", str(tmp_path)],
        ["hang", "show", "--state-dir", str(tmp_path)],
    ):
        args = parser.parse_args(argv)
        assert isinstance(args, argparse.Namespace)
        cfg = load_with(None, Overrides.of(args))
        assert cfg.daemon.state_dir == str(tmp_path), argv
    unset = load_with(None, Overrides.of(parser.parse_args(["clear", "--all", "--state-dir", ""])))
    assert unset.daemon.state_dir == load_with(None, Overrides()).daemon.state_dir
