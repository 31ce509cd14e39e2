"""The `job_hang` event's typed payload: one `HangReport`, serialized once at the store,
read back typed by `check`, `gpuwatchd hang show`, /events/ID and evidence bundles; rows
an older daemon wrote (fewer fields) still read."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from gpuwatchd.cli import main
from gpuwatchd.config import Config
from gpuwatchd.config.schema import DaemonConfig
from gpuwatchd.health.hangs.stored import open_hangs
from gpuwatchd.http.endpoints import events_route
from gpuwatchd.model import Event, HangReport, Severity
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sinks.store_schema import hang_report_json
from tests.hangs.test_cli_hang import _record_peer_death_hang

SINCE = float(int(time.time())) - 59.5  # recent: the store's retention keeps it

# As the v0.2 daemon stored a hang: no causes, flight recorder nor confirmed stacks yet.
OLD_DOC = {
    "id": 3,
    "job": "torch:10.0.0.1:29500",
    "labels": {"job": "torch:10.0.0.1:29500", "job_id": "torch:10.0.0.1:29500"},
    "since": SINCE,
    "resolved_at": None,
    "conditions": ["rank_dead"],
    "signals": "liveness",
    "reason": "rank 1 died (pid 77)",
    "nodes": [],
    "signature": "dead_peer",
    "remediation": "Find why rank 1 died.",
    "signatures": ["dead_peer"],
    "facts": [],
    "where": "rank 0 (pid 76): all_reduce; rank 1 (pid 77): gone",
    "ranks": [
        {
            "pid": 76,
            "rank": 0,
            "gpus": ["0"],
            "state": "spin",
            "where": "all_reduce",
            "collective": "all_reduce",
            "collective_counts": {"AllReduce": 12},
            "stack_error": "",
        }
    ],
    "missing": ["rank 1"],
    "unresponsive": [],
    "diverging_frame": "",
    "stacks": {"76": {"ok": True, "error": "", "seconds": 0.8, "dump": "Thread 76 (idle)"}},
    "ras": {"error": "", "at": SINCE + 1.0, "answer": "RAS: rank 1 missing"},
}


def _old_store(tmp_path: Path) -> EventStore:
    """A state DB with one job hang row in the old form: attrs as strings, no payload."""
    cfg = dataclasses.replace(Config(), daemon=DaemonConfig(state_dir=str(tmp_path)))
    store = EventStore.from_config(cfg)
    old = Event(
        "job_hang",
        "hangs",
        SINCE,
        message="job torch:10.0.0.1:29500: rank 1 died (pid 77)",
        severity=Severity.CRITICAL,
        attrs=(
            ("job", "torch:10.0.0.1:29500"),
            ("hang_id", "3"),
            ("forensics", json.dumps(OLD_DOC)),
        ),
    )
    assert old.payload is None  # written as an older daemon wrote it
    store.write([(old, f"hang:torch:10.0.0.1:29500:{SINCE}", 1)])
    return store


def test_the_report_is_stored_once_and_read_back_equal(tmp_path: Path) -> None:
    store, monitor = _record_peer_death_hang(tmp_path)
    (report,) = monitor.reports()
    (stored,) = [e for e in store.events_since(0.0) if e.kind == "job_hang"]
    assert stored.hang == report  # typed, field for field
    assert {k for k, _ in stored.attrs} == {"forensics", "hang_id", "job"}  # as before
    assert json.loads(stored.attr("forensics")) == report.json()
    assert HangReport.from_json(report.json()) == report
    store.close()


def test_an_old_row_reads_in_check_hang_show_events_and_evidence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _old_store(tmp_path)
    (ev,) = store.events_since(0.0)
    report = ev.hang
    assert report is not None
    assert report.id == 3 and report.job == "torch:10.0.0.1:29500"
    assert report.ranks[0].collective_counts == (("AllReduce", 12),)
    assert report.causes is None and report.flight_recorder == () and not report.stacks_confirmed
    assert report.json() == {
        **OLD_DOC,
        "severity": "",
        "cause": "",
        "incident": "",
        "causes": None,
        "stacks_confirmed": False,
        "flight_recorder": [],
        "flight_recorder_errors": [],
    }
    # gpuwatchd check: still open, critical
    (f,) = open_hangs([ev])
    assert f.alertname == "JobHangSuspected" and f.severity == Severity.CRITICAL
    assert f.remediation == "Find why rank 1 died." and f.since == SINCE
    # /events/ID: the report as an object
    (row,) = store.recent(5, kind="job_hang")
    status, _, body = events_route(store)({"id": [str(row["id"])]})
    assert status == 200
    assert json.loads(body)["attrs"]["forensics"]["ras"]["answer"] == "RAS: rank 1 missing"
    # evidence bundles' events.json take the same view
    assert hang_report_json(dict(row))["attrs"]["forensics"]["where"].startswith("rank 0")
    store.close()
    # gpuwatchd hang show
    assert main(["hang", "show", "--state-dir", str(tmp_path)]) == 0
    assert "hang 3 " in capsys.readouterr().out
    assert main(["hang", "show", "3", "--state-dir", str(tmp_path)]) == 0
    detail = capsys.readouterr().out
    assert "rank 0 pid 76 gpus 0: all_reduce [AllReduce 12]" in detail
    assert "--- stack of pid 76 ---" in detail and "RAS: rank 1 missing" in detail
    assert main(["hang", "show", "3", "--json", "--state-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["stacks"] == OLD_DOC["stacks"]


def test_a_row_that_does_not_parse_is_kept_as_stored(tmp_path: Path) -> None:
    cfg = dataclasses.replace(Config(), daemon=DaemonConfig(state_dir=str(tmp_path)))
    store = EventStore.from_config(cfg)
    bad = Event("job_hang", "hangs", 1.0, attrs=(("forensics", "{not json"), ("job", "j")))
    store.write([(bad, "hang:j:1.0", 1)])
    (ev,) = store.events_since(0.0)
    assert ev.hang is None and ev.attr("forensics") == "{not json"
    assert open_hangs([ev]) == []
    store.close()
