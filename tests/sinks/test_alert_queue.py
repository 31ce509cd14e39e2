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


def test_alerts_that_end_while_waiting_are_counted_once_not_per_attempt(tmp_path: Path) -> None:
    sink = AlertSink(config([], max_alerts=10), str(tmp_path / "db"), SystemClock(), "n")
    findings = [xid_finding(code=i) for i in range(12)]
    for _ in range(50):  # the engine re-offers the same open set again and again
        sink.update(findings)
    dropped = ("gpuwatchd_alertmanager_dropped_alerts_total",)
    assert _metric(sink, *dropped, reason="queue_full") == 0  # waiting, not dropped
    for _ in range(50):  # two of the waiting ones end before room frees: dropped, once
        sink.update(findings[:10])
    assert _metric(sink, *dropped, reason="queue_full") == 2
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


def test_the_outbox_moves_to_memory_when_its_disk_refuses_and_writes_back(
    tmp_path: Path,
) -> None:
    from gpuwatchd.sinks.alertmanager.outbox import Outbox

    path = str(tmp_path / "db")
    box = Outbox(path, max_alerts=10)
    box.sync([({"alertname": "A", "severity": "critical"}, {}, 1.0)], 1.0)
    real = box._db
    box._db = _Refusing(real)  # type: ignore[assignment]  # an injected full disk
    result = box.sync(
        [
            ({"alertname": "A", "severity": "critical"}, {}, 1.0),
            ({"alertname": "B", "severity": "critical"}, {}, 2.0),
        ],
        2.0,
    )
    assert box.in_memory and [a.labels["alertname"] for a in result.fired] == ["B"]
    assert {a.labels["alertname"] for a in box.alerts()} == {"A", "B"}
    box._file = real  # the file works again
    box._retry_at = 0.0
    box.mark_sent("am", box.alerts(), 3.0)
    assert not box.in_memory
    again = Outbox(path)
    assert {a.labels["alertname"] for a in again.alerts()} == {"A", "B"}
    again.close()
    box.close()


class _Refusing:
    """A connection whose every write fails as on a full disk; reads pass through."""

    def __init__(self, db: object) -> None:
        self._db = db

    def execute(self, sql: str, *args: object) -> object:
        if sql.lstrip().upper().startswith("SELECT"):
            return self._db.execute(sql, *args)  # type: ignore[attr-defined]
        import sqlite3

        raise sqlite3.OperationalError("database or disk is full")

    def executemany(self, sql: str, *args: object) -> object:
        import sqlite3

        raise sqlite3.OperationalError("database or disk is full")

    def __enter__(self) -> _Refusing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        pass


def test_control_characters_never_reach_alert_text(tmp_path: Path) -> None:
    sink = AlertSink(config([], max_alerts=10), str(tmp_path / "db"), SystemClock(), "n")
    evil = "pid 7 evil\nlevel=error msg=forged\x1b[2J"
    xid13 = xid_finding(code=13)  # the process name reaches the Xid alert's description
    forged = dataclasses.replace(
        xid13, reason=f"Xid 13: {evil}", labels=(*xid13.labels, ("process", evil))
    )
    sink.update([forged])
    _code, _ctype, body = sink.route_alerts({})
    (alert,) = json.loads(body)["alerts"]
    text = json.dumps(alert["annotations"])
    assert "\\n" in alert["annotations"]["description"]
    assert "\n" not in alert["annotations"]["description"] and "\x1b" not in text
    sink.stop()


def test_xid_alert_texts_are_what_prometheus_reads(tmp_path: Path) -> None:
    """The Xid alert's annotations equal the texts of gpuwatchd_xid_alert_info, even for a
    process name with control characters and undecodable bytes."""
    from gpuwatchd.health.xid import alert as xid_alert

    sink = AlertSink(config([], max_alerts=10), str(tmp_path / "db"), SystemClock(), "n")
    f = xid_finding(code=13)
    f = dataclasses.replace(f, labels=(*f.labels, ("process", "pid 7 b\udcffad\x1b[2J\nx")))
    sink.update([f])
    _code, _ctype, body = sink.route_alerts({})
    (alert,) = json.loads(body)["alerts"]
    (info,) = xid_alert.samples([f])
    assert {k: info.label(k) for k in xid_alert.TEXTS} == alert["annotations"]
    assert "pid 7 b?ad\\x1b[2J\\nx" in alert["annotations"]["description"]
    sink.stop()
