"""The pre-commit hooks run exactly what scripts/check runs, from .venv, offline."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def check_commands() -> list[str]:
    lines = (ROOT / "scripts" / "check").read_text().splitlines()
    return [line.strip() for line in lines if line.startswith(".venv/bin/")]


def test_scripts_check_lints_formats_and_types() -> None:
    tools = [cmd.split()[:2] for cmd in check_commands()]
    assert [".venv/bin/ruff", "check"] in tools
    assert [".venv/bin/ruff", "format"] in tools
    assert any("--check" in cmd for cmd in check_commands() if "format" in cmd)
    assert [".venv/bin/mypy"] in [t[:1] for t in tools]


def test_pre_commit_hooks_match_scripts_check() -> None:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert all(repo["repo"] == "local" for repo in config["repos"])  # nothing to download
    assert all(hook["language"] == "system" for hook in hooks)
    assert sorted(hook["entry"] for hook in hooks) == sorted(check_commands())
