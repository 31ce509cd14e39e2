"""A diag run is one typed payload (`model.DiagRun`), written once at the store and read
back typed by /events?kind=diag, the metrics, the GpuDiagFailed rule and /status; rows an
earlier version stored (results as `check|gpu|outcome|measured|floor|unit`) read too."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from types import MappingProxyType

from gpuwatchd.config import Config
from gpuwatchd.diag.scheduler import diag_samples
from gpuwatchd.health.diag import rule as diag_rule
from gpuwatchd.health.history import History, View
from gpuwatchd.health.rules import Inputs
from gpuwatchd.http.endpoints import events_route
from gpuwatchd.model import DiagResult, DiagRun, Event
from gpuwatchd.sinks.diag import FAIL_KIND, last_runs, record_run
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import NodeSnapshot

T0 = 1_700_000_000.0

# The attrs of a `diag` row as versions before the typed payload wrote them.
OLD_ATTRS = {
    "cancelled": "",
    "results": "gemm|0|fail|512.5|660|TFLOP/s;h2d_bandwidth|0|pass|52|40|GB/s;"
    "p2p_bandwidth|0>1|error|||;all_reduce|all|skipped|||",
    "seconds": "41.2",
    "tier": "quick",
    "trigger": "cli",
    "verdict": "CRITICAL",
}
OLD_RESULTS = (
    DiagResult("gemm", "0", "fail", 512.5, "TFLOP/s", 660.0),
    DiagResult("h2d_bandwidth", "0", "pass", 52.0, "GB/s", 40.0),
    DiagResult("p2p_bandwidth", "0>1", "error", None, ""),
    DiagResult("all_reduce", "all", "skipped", None, ""),
)


def _store_old_row(path: Path, t: float) -> None:
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO events (time, last_time, kind, source, severity, message, attrs)"
            " VALUES (?, ?, 'diag', 'diag', 'warning', 'diag quick: CRITICAL', ?)",
            (t, t, json.dumps(OLD_ATTRS, sort_keys=True)),
        )


def _events(store: EventStore) -> list[dict[str, object]]:
    status, _, body = events_route(store)({"kind": ["diag"]})
    assert status == 200
    events: list[dict[str, object]] = json.loads(body)["events"]
    return events


def _series(store: EventStore) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, s.labels): s.value for s in diag_samples(store, T0 + 60, 3)}


def test_a_run_stored_in_the_old_format_reads_back_typed(tmp_path: Path) -> None:
    db = tmp_path / "events.db"
    store = EventStore(str(db))
    try:
        _store_old_row(db, T0)
        expected = DiagRun("quick", T0, 41.2, "CRITICAL", OLD_RESULTS, cancelled="", trigger="cli")
        assert last_runs(store) == [expected]
        [event] = store.events_since(T0 - 1)
        assert event.diag == expected

        [row] = _events(store)
        assert row["diag"] == expected.to_json()
        assert row["attrs"] == OLD_ATTRS  # the stored view is served as it was written

        series = _series(store)
        gemm = (("check", "gemm"), ("gpu", "0"))
        assert series[("gpuwatchd_diag_check_passed", gemm)] == 0
        assert series[("gpuwatchd_diag_measured", gemm)] == 512.5e12
        assert series[("gpuwatchd_diag_floor", gemm)] == 660e12
        h2d = (("check", "h2d_bandwidth"), ("gpu", "0"))
        assert series[("gpuwatchd_diag_check_passed", h2d)] == 1
        assert not any(
            labels == (("check", "p2p_bandwidth"), ("gpu", "0>1")) for _, labels in series
        )

        snap = NodeSnapshot(
            extra=MappingProxyType({"diag": tuple(diag_samples(store, T0 + 60, 3))})
        )
        [found] = diag_rule.diag_failed(Inputs(View(snap), History(300), Config(), T0 + 60))
        assert found.subject == gemm
        assert "measured 5.125e+14, floor 6.6e+14" in found.reason
    finally:
        store.close()


def test_a_run_reads_back_exactly_as_it_was_written(tmp_path: Path) -> None:
    run = DiagRun(
        "standard",
        T0,
        63.25,
        "CRITICAL",
        (
            DiagResult(
                "gemm",
                "1",
                "fail",
                598.125,
                "TFLOP/s",
                660.0,
                "site floors.yaml: H100 80GB HBM3 gemm",
                "bf16 8192^3",
                4.5,
            ),
            DiagResult("memory_pattern", "1", "pass", 0.0, "words", None, "", "", 9.0),
            DiagResult("row_remap", "1", "error", None, "rows", detail="NVML: not supported"),
        ),
        backend="cupy",
        error="",
        gpus=("0", "1"),
        models={"0": "NVIDIA H100 80GB HBM3", "1": "NVIDIA H100 80GB HBM3"},
        buses={"0": "0000:18:00.0", "1": "0000:2a:00.0"},
        trigger="schedule",
    )
    store = EventStore(str(tmp_path / "events.db"))
    try:
        record_run(store, run)
        assert last_runs(store) == [run]
        assert [e.diag for e in store.events_since(T0) if e.kind == "diag"] == [run]
        [row] = _events(store)
        assert row["diag"] == run.to_json()
        assert json.loads(json.dumps(row["diag"])) == row["diag"]
        [fail] = store.recent(kind=FAIL_KIND)
        assert fail["pci_bus_id"] == "0000:2a:00.0"
        assert fail["attrs"]["check"] == "gemm" and fail["attrs"]["floor"] == "660"
    finally:
        store.close()


def test_a_cancelled_run_fails_nothing_and_keeps_why(tmp_path: Path) -> None:
    run = DiagRun(
        "quick", T0, 3.0, "UNKNOWN", cancelled="GPU in use by process 4242", freed_seconds=1.5
    )
    store = EventStore(str(tmp_path / "events.db"))
    try:
        record_run(store, run)
        [back] = last_runs(store)
        assert back == run and back.freed_seconds == 1.5
        assert store.recent(kind=FAIL_KIND) == []
        assert not any(name == "gpuwatchd_diag_check_passed" for name, _ in _series(store))
    finally:
        store.close()


def test_an_event_given_the_old_attrs_only_reads_them_into_the_payload() -> None:
    ev = Event(kind="diag", source="diag", time=T0, attrs=tuple(sorted(OLD_ATTRS.items())))
    assert ev.diag is not None and ev.diag.results == OLD_RESULTS
    assert ev.diag.started == T0
    assert dict(ev.attrs)["results"].startswith("[")  # attrs is the payload's view now
