"""deploy/prometheus: promtool check/test rules, and parity with the daemon's alerts."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwatchd.config import HealthConfig
from gpuwatchd.health.rules import ALERTS
from gpuwatchd.model import WORKLOAD_ALERT_LABELS

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "gpuwatchd-rules.yaml"
TESTS = ROOT / "deploy" / "prometheus" / "gpuwatchd-rules.test.yaml"
# The daemon cannot report its own death, nor reach an Alertmanager that rejects it.
PROMETHEUS_ONLY = {"GpuwatchdAlertsRejected", "GpuwatchdDown"}

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    assert promtool is not None
    return subprocess.run(
        [promtool, *args], cwd=RULES.parent, capture_output=True, text=True, timeout=60
    )


@needs_promtool
def test_promtool_check_rules() -> None:
    result = _run("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_test_rules() -> None:
    result = _run("test", "rules", TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


def _alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _expected_alerts() -> list[tuple[str, dict[str, str]]]:
    doc = yaml.safe_load(TESTS.read_text())
    return [
        (case["alertname"], exp["exp_labels"])
        for test in doc["tests"]
        for case in test.get("alert_rule_test", [])
        for exp in case["exp_alerts"]
    ]


def test_same_alert_names_as_the_daemon() -> None:
    names = {r["alert"] for r in _alert_rules()}
    assert names - PROMETHEUS_ONLY == set(ALERTS)


def test_every_alert_rule_is_tested_firing() -> None:
    fired = {name for name, _ in _expected_alerts()}
    assert fired == {r["alert"] for r in _alert_rules()}


def test_label_sets_match_what_the_daemon_sends() -> None:
    for name, labels in _expected_alerts():
        if name in PROMETHEUS_ONLY:
            continue
        info = ALERTS[name]
        allowed = {"severity", "node", *info.labels}
        assert set(labels) <= allowed, (name, labels)
        assert {"severity", "node"} <= set(labels), (name, labels)
        if name not in (
            "NvmlUnresponsive",
            "ShmNearlyFull",
            "JobHangSuspected",  # a pod or a Slurm job: some of its labels are empty
        ):
            # These may lack GPU labels (node-wide) or escalate; the rest always carry
            # all their labels and one severity, and the workload's only when it has one.
            assert allowed - set(WORKLOAD_ALERT_LABELS) <= set(labels) <= allowed, (name, labels)
            assert labels["severity"] == str(info.severity), name


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)([smh])", text)
    assert m, text
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def test_for_durations_match_daemon_defaults() -> None:
    health = HealthConfig()
    expected = {
        **health.for_seconds,
        "GpuwatchdCollectorFailed": health.collector_failure_seconds,
        "GpuStuckSuspected": health.stuck.min_duration_seconds,
    }
    for rule in _alert_rules():
        if rule["alert"] in expected and "for" in rule:
            assert _seconds(rule["for"]) == expected[rule["alert"]], rule["alert"]
        elif rule["alert"] in expected:
            assert expected[rule["alert"]] == 0, rule["alert"]


def test_every_alert_has_a_runbook() -> None:
    for rule in _alert_rules():
        assert (ROOT / "docs" / "runbooks" / f"{rule['alert']}.md").is_file(), rule["alert"]
