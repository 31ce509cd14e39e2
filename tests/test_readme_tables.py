"""README's alerts table names every alert the shipped rules can raise, and each has a runbook."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_every_alert_is_in_the_readme_table_and_has_a_runbook() -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/gpuwatchd-rules.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    table = _section((ROOT / "README.md").read_text(), "Alerts")
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", table))
    assert alerts - named == set(), "alerts missing from README's table"
    assert named - alerts == set(), "README names alerts no rule raises"
    runbooks = {p.stem for p in (ROOT / "docs/runbooks").glob("*.md")} - {"README"}
    assert alerts - runbooks == set(), "alerts without a runbook"
