"""The hang monitor end to end: recorded H100 polls in, forensics from a RAS replay server
and real py-spy dumps, the JobHangSuspected alert out to a real Alertmanager."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock, SystemClock
from gpuwatchd.config import AlertmanagerConfig, Config
from gpuwatchd.config.schema import HangsConfig
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.model import Event, Severity
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sources.hangs import ras
from gpuwatchd.sources.hangs.jobs import JobView
from gpuwatchd.sources.hangs.stacks import StackCapture, parse_dump
from tests.hangs.ras_server import ras_server
from tests.hangs.replay import fixture, polls
from tests.servers import AlertmanagerServer, alertmanager_server


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerServer]:
    yield from alertmanager_server(tmp_path_factory)


class Store:
    def __init__(self) -> None:
        self.rows: list[tuple[Event, str, int]] = []

    def write(self, records: list[tuple[Event, str, int]]) -> None:
        self.rows.extend(records)


def _recorded_stack(name: str) -> StackCapture:
    pid = {"pyspy-rendezvous.txt": 962, "pyspy-peerdeath.txt": 1031}[name]
    text = fixture(name)
    version, threads = parse_dump(text)
    return StackCapture(pid, True, threads, python=version, raw=text)


def _cfg(**hangs: object) -> Config:
    return dataclasses.replace(Config(), hangs=HangsConfig(**hangs))  # type: ignore[arg-type]


def _run(monitor: HangMonitor, name: str, base: float = 1_800_000_000.0) -> list[float]:
    """Replay a recording; the times (relative to the fault) the open set changed."""
    changes: list[float] = []
    last: list[str] = []
    for t, jobs, gpus in polls(name):
        monitor.observe(jobs, gpus, base + t)
        monitor.run_pending()
        now = [f.alertname for f in monitor.findings()]
        if now != last:
            changes.append(t)
            last = now
    return changes


def test_dead_peer_alert_reaches_alertmanager_with_job_ranks_and_remediation(
    tmp_path: Path, am: AlertmanagerServer
) -> None:
    cfg = _cfg(stacks=True, stacks_confirm_seconds=0)
    cfg = dataclasses.replace(cfg, alertmanager=AlertmanagerConfig(urls=[am.url]))
    store = Store()
    with ras_server(fixture("ras-running.txt"), fixture("ras-running.json")) as srv:

        def query(job: JobView) -> ras.RasAnswer:
            return ras.query(srv.addr, timeout=5)

        monitor = HangMonitor(
            cfg,
            FakeClock(),
            store,
            capture=lambda pid: _recorded_stack("pyspy-peerdeath.txt"),
            ras_query=query,
        )
        sink = AlertSink(cfg, str(tmp_path / "hang-alerts.db"), SystemClock(), "hang-node")
        monitor.add_listener(sink.update)
        # replayed as if the peer died 150 s ago (Alertmanager wants startsAt in the past)
        changes = _run(monitor, "peerdeath-polls.jsonl", base=time.time() - 150)
        assert 0 < changes[0] < 30  # flagged within 30 s of the kill, never before
        assert sink.flush()
        (alert,) = am.alerts(node="hang-node", alertname="JobHangSuspected")
        sink.stop()
    assert alert["labels"]["job"] == "torch:127.0.0.1:29544"
    assert alert["labels"]["severity"] == "critical"
    desc = alert["annotations"]["description"]
    assert "rank 1 died" in desc and "Ranks (rank:pid): 0:1031" in desc
    assert "rank 0 (pid 1031): cuCtxSynchronize_v2; rank 1: missing" in desc
    assert "dead" in alert["annotations"]["remediation"]
    (event, burst, _), *_ = store.rows
    doc = json.loads(event.attr("forensics"))
    assert doc["signature"] == "dead_peer"
    assert doc["stacks"]["1031"]["ok"] and "cuCtxSynchronize_v2" in doc["stacks"]["1031"]["dump"]
    assert '"nccl_version": "2.28.9"' in doc["ras"]["answer"]
    assert event.kind == "job_hang" and event.severity == Severity.CRITICAL


def test_rank_missing_at_start_names_the_rendezvous_signature() -> None:
    monitor = HangMonitor(
        _cfg(stacks=True, stacks_confirm_seconds=0, ras=False),
        FakeClock(),
        capture=lambda pid: _recorded_stack("pyspy-rendezvous.txt"),
    )
    changes = _run(monitor, "rendezvous-polls.jsonl")
    assert changes and changes[0] <= 60
    (f,) = monitor.findings()
    assert "rendezvous" in f.reason.lower() or "Rendezvous" in f.reason
    assert "MASTER_ADDR:MASTER_PORT" in f.remediation
    (doc,) = monitor.records()
    assert doc["signature"] == "rendezvous_missing_rank"
    assert doc["missing"] == ["1 rank(s) never started"]
    assert doc["stacks_confirmed"] is True  # the same TCPStore wait in both dumps
    (info,) = [s for s in monitor.samples() if s.name == "gpuwatchd_job_hang_info"]
    assert info.label("signature") == "rendezvous_missing_rank"
    status, _, body = monitor.route({"id": [str(doc["id"])]})
    assert status == 200 and json.loads(body)["job"] == "torch:127.0.0.1:29533"
    assert monitor.route({"id": ["999"]})[0] == 404


def test_healthy_loads_never_alert_and_a_resolved_hang_leaves_the_set() -> None:
    monitor = HangMonitor(_cfg(ras=False), FakeClock())
    assert _run(monitor, "healthy-polls.jsonl") == []
    assert monitor.records() == []
    # a hang that ends (the job's processes exit) resolves at once
    monitor = HangMonitor(_cfg(ras=False), FakeClock())
    changes = _run(monitor, "peerdeath-polls.jsonl")
    assert len(changes) == 1
    monitor.observe([], [], 1_900_000_000.0)
    assert monitor.findings() == [] and monitor.records()[0]["resolved_at"] == 1_900_000_000.0


def test_forensics_queue_full_is_counted_not_blocking() -> None:
    monitor = HangMonitor(_cfg(ras=False), FakeClock(), max_queue=1)
    for t, jobs, gpus in polls("peerdeath-polls.jsonl"):
        monitor.observe(jobs, gpus, 1_800_000_000.0 + t)
    monitor.observe([], [], 1_800_001_000.0)  # resolve, then hang again with a full queue
    for t, jobs, gpus in polls("peerdeath-polls.jsonl"):
        monitor.observe(jobs, gpus, 1_800_002_000.0 + t)
    assert monitor.dropped == 1


def test_reload_keeps_the_detector_memory_and_a_bad_site_file_keeps_the_old_catalog(
    tmp_path: Path,
) -> None:
    from gpuwatchd.errors import ConfigError

    monitor = HangMonitor(_cfg(ras=False), FakeClock())
    rows = list(polls("peerdeath-polls.jsonl"))
    for t, jobs, gpus in rows[:32]:  # up to 8 s after the kill: nothing decided yet
        monitor.observe(jobs, gpus, 1_800_000_000.0 + t)
    assert monitor.findings() == []
    bad = tmp_path / "sig.yaml"
    bad.write_text("signatures: 3\n")
    monitor.reconfigure(_cfg(ras=False, signatures_file=str(bad)))
    assert monitor.catalog[0].name == "dead_peer"
    for t, jobs, gpus in rows[32:]:
        monitor.observe(jobs, gpus, 1_800_000_000.0 + t)
        if monitor.findings():
            break
    assert 8 < t <= 12  # the death seen before the reload still counts
    with pytest.raises(ConfigError, match="sig.yaml"):
        HangMonitor(_cfg(ras=False, signatures_file=str(bad)), FakeClock())


def test_stacks_confirm_only_when_every_rank_stays_in_the_same_call() -> None:
    from gpuwatchd.health.hangs.summary import stacks_confirm

    waiting = _recorded_stack("pyspy-peerdeath.txt")
    moved = StackCapture(1031, True, parse_dump(fixture("pyspy-rendezvous.txt"))[1])
    assert stacks_confirm({1031: waiting}, {1031: waiting})
    assert not stacks_confirm({1031: waiting}, {1031: moved})  # it moved on: progress
    assert not stacks_confirm({1031: waiting}, {})  # gone between the dumps
    assert not stacks_confirm({1031: StackCapture(1031, False, error="no py-spy")}, {})
