"""`gpuwatchd hang show` over a real event store that the hang monitor wrote."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gpuwatchd.cli import main
from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.config.schema import DaemonConfig, HangsConfig
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources.hangs.stacks import StackCapture, parse_dump
from tests.hangs.replay import fixture, polls


def _record_peer_death_hang(tmp_path: Path) -> tuple[EventStore, HangMonitor]:
    """A hang monitor on the recorded peer-death polls, its hang stored with stacks."""
    cfg = dataclasses.replace(
        Config(),
        daemon=DaemonConfig(state_dir=str(tmp_path)),
        hangs=HangsConfig(stacks=True, stacks_confirm_seconds=0, ras=False),
    )
    store = EventStore.from_config(cfg)
    text = fixture("pyspy-peerdeath.txt")
    cap = StackCapture(1031, True, parse_dump(text)[1], raw=text)
    monitor = HangMonitor(cfg, FakeClock(), store, capture=lambda pid: cap)
    for t, jobs, gpus in polls("peerdeath-polls.jsonl"):
        monitor.observe(jobs, gpus, 1_800_000_000.0 + t)
        monitor.run_pending()
    return store, monitor


def test_hang_show_lists_and_details_a_recorded_hang(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, monitor = _record_peer_death_hang(tmp_path)
    monitor.observe([], [], 1_800_000_200.0)  # the job ends: resolved
    store.close()

    assert main(["hang", "show", "--state-dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "hang 1 " in listing and "job torch:127.0.0.1:29544" in listing
    assert "resolved" in listing and "dead_peer" in listing
    assert "severity: critical" in listing and "signals: gpu+io+liveness" in listing

    assert main(["hang", "show", "1", "--state-dir", str(tmp_path)]) == 0
    detail = capsys.readouterr().out
    assert "rank 0 pid 1031 gpus 0: cuCtxSynchronize_v2" in detail
    assert "missing: rank 1" in detail
    assert "stacks: every rank in the same call in two dumps" in detail
    assert "--- stack of pid 1031 ---" in detail and "cudaDeviceSynchronize" in detail

    assert main(["hang", "show", "1", "--json", "--state-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["signature"] == "dead_peer" and doc["resolved_at"] == 1_800_000_200.0

    assert main(["hang", "show", "7", "--state-dir", str(tmp_path)]) == 1


def test_events_id_and_hangs_id_over_http(tmp_path: Path) -> None:
    """/events/ID serves a job hang's forensics as JSON; /hangs/ID the monitor's record."""
    from prometheus_client import CollectorRegistry as Registry

    from gpuwatchd.http.app import make_app
    from gpuwatchd.http.endpoints import events_route
    from gpuwatchd.http.server import serve
    from tests.conftest import free_port, http_get

    store, monitor = _record_peer_death_hang(tmp_path)
    (row,) = store.recent(10, kind="job_hang")
    app = make_app(Registry(), {"/events": events_route(store), "/hangs": monitor.route})
    port = free_port()
    httpd, _ = serve(app, "127.0.0.1", port)
    try:
        status, body = http_get(f"http://127.0.0.1:{port}/events/{row['id']}")
        assert status == 200
        forensics = json.loads(body)["attrs"]["forensics"]
        assert forensics["signature"] == "dead_peer"
        assert "cuCtxSynchronize_v2" in forensics["stacks"]["1031"]["dump"]
        status, body = http_get(f"http://127.0.0.1:{port}/hangs/1")
        assert status == 200 and json.loads(body)["missing"] == ["rank 1"]
        assert http_get(f"http://127.0.0.1:{port}/events/999999")[0] == 404
        assert http_get(f"http://127.0.0.1:{port}/events/x")[0] == 400
    finally:
        httpd.shutdown()
        httpd.server_close()
        store.close()


def test_hang_ids_stay_unique_across_daemon_restarts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two daemon runs over one state dir, a hang in each: `hang 1` and `hang 2`; after
    the restart /hangs/1 never names the second run's hang."""
    from gpuwatchd.pipeline.daemon import Pipeline
    from gpuwatchd.state import State

    cfg = dataclasses.replace(
        Config(),
        daemon=DaemonConfig(state_dir=str(tmp_path)),
        hangs=HangsConfig(stacks=False, ras=False),
    )
    for run in range(2):
        pipeline = Pipeline(cfg, State(), FakeClock(), "n", 0, [])
        try:
            start = 1_800_000_000.0 + run * 10_000
            for t, jobs, gpus in polls("peerdeath-polls.jsonl"):
                pipeline.hangs.observe(jobs, gpus, start + t)
                pipeline.hangs.run_pending()
            pipeline.hangs.observe([], [], start + 200)  # the job ends
            if run == 1:
                assert pipeline.hangs.route({"id": ["1"]})[0] == 404  # not in memory
                status, _, body = pipeline.hangs.route({"id": ["2"]})
                assert status == 200 and json.loads(body)["since"] >= start
        finally:
            pipeline.stop()
    assert main(["hang", "show", "--state-dir", str(tmp_path)]) == 0
    heads = [line.split(" (event")[0] for line in capsys.readouterr().out.splitlines()]
    assert [h for h in heads if h.startswith("hang ")] == ["hang 2", "hang 1"]
