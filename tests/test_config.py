from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli import main
from gpuwatchd.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_need_no_file() -> None:
    cfg = config.load(None)
    assert cfg.sources.nvml.call_timeout == 5.0
    assert cfg.http.listen.endswith(f":{config.DEFAULT_PORT}")


def test_example_file_is_the_rendered_default() -> None:
    # config.example.yaml is what `gpuwatchd config default` prints; regenerate on drift.
    assert (ROOT / "config.example.yaml").read_text() == config.render_default()


def test_rendered_default_loads_back_to_defaults() -> None:
    assert config.load_text(config.render_default()) == config.Config()


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("sources:\n  nvml:\n    interval: 0\n", "sources.nvml.interval", "must be >= 0.1"),
        ("sources:\n  nvml:\n    intervall: 1\n", "sources.nvml.intervall", "unknown key"),
        ("sources:\n  nvml:\n    enabled: yes please\n", "sources.nvml.enabled", "true or false"),
        ("http:\n  listen: 10370\n", "http.listen", "must be a string"),
        ("http:\n  listen: nohost\n", "http.listen", "host:port"),
        ("daemon:\n  log_level: loud\n", "daemon.log_level", "must be one of"),
        ("sources: [1]\n", "sources", "must be a mapping"),
        ("alertmanager:\n  urls: x\n", "alertmanager.urls", "must be a list"),
        ("health:\n  expected_gpus: 2.5\n", "health.expected_gpus", "whole number"),
        (
            "sources:\n  nvml:\n    replay: /nonexistent/capture.json\n",
            "sources.nvml.replay",
            "cannot read",
        ),
        ("a: [\n", "line 2", "invalid YAML"),
        (
            "sources:\n  infiniband:\n    device_include: 'mlx5_('\n",
            "sources.infiniband.device_include",
            "bad regex",
        ),
        (
            "sources:\n  shm:\n    patterns: [nccl-*, ../etc/*]\n",
            "sources.shm.patterns[1]",
            "without '/'",
        ),
    ],
)
def test_bad_config_names_file_key_and_problem(text: str, key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.load_text(text, "site.yaml")
    line = str(info.value)
    assert line.startswith(f"site.yaml: {key}: "), line
    assert problem in line
    assert "\n" not in line


def test_config_check_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("sources:\n  nvml:\n    interval: 2\n")
    assert main(["config", "check", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  nvml:\n    interval: -3\n")
    assert main(["config", "check", str(bad)]) == 78
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gpuwatchd: {bad}: sources.nvml.interval: must be >= 0.1, got -3.0"]
    assert main(["config", "check", str(tmp_path / "missing.yaml")]) == 78


def test_config_default_prints_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "default"]) == 0
    out = capsys.readouterr().out
    for section in ("http:", "paths:", "sources:", "nvml:", "alertmanager:"):
        assert f"\n{section}" in out or f"  {section}" in out
