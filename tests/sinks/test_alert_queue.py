"""The alert queue bound: alerts counted once, the most severe kept, the rest sent later."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from gpuwatchd.clock import SystemClock
from gpuwatchd.model import Severity
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from tests.sinks.test_alertmanager import _metric, config, xid_finding


def warning(code: int):  # noqa: ANN201 - a Finding
    return dataclasses.replace(
        xid_finding(code=code), alertname="GpuXidWarning", severity=Severity.WARNING
    )


def firing(sink: AlertSink) -> set[str]:
    _code, _ctype, body = sink.route_alerts({"state": ["firing"]})
    return {a["labels"]["xid"] for a in json.loads(body)["alerts"]}


def test_refused_alerts_are_counted_once_not_per_attempt(tmp_path: Path) -> None:
    sink = AlertSink(config([], max_alerts=10), str(tmp_path / "db"), SystemClock(), "n")
    findings = [xid_finding(code=i) for i in range(12)]
    for _ in range(50):  # the engine re-offers the same open set again and again
        sink.update(findings)
    assert _metric(sink, "gpuwatchd_alertmanager_dropped_alerts_total", reason="queue_full") == 2
    sink.stop()


def test_a_critical_alert_displaces_a_warning_and_the_rest_follow_when_room_frees(
    tmp_path: Path,
) -> None:
    sink = AlertSink(config([], max_alerts=10), str(tmp_path / "db"), SystemClock(), "n")
    warnings = [warning(100 + i) for i in range(10)]
    sink.update(warnings)
    assert len(firing(sink)) == 10
    criticals = [xid_finding(code=i) for i in range(3)]
    sink.update([*warnings, *criticals])
    now = firing(sink)
    assert {"0", "1", "2"} <= now and len(now) == 10  # every critical is in
    # Three warnings wait outside; once three of the others resolve, they get in.
    sink.update([*warnings[3:], *criticals])
    sink.update([*warnings[3:], *criticals])
    assert firing(sink) == {str(100 + i) for i in range(3, 10)} | {"0", "1", "2"}
    sink.update(warnings[:3] + criticals)
    assert firing(sink) == {"100", "101", "102", "0", "1", "2"}
    sink.stop()
