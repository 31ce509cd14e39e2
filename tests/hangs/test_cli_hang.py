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
from gpuwatchd.health.hangs.monitor import HangMonitor
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources.hangs.stacks import StackCapture, parse_dump
from tests.hangs.replay import fixture, polls


def test_hang_show_lists_and_details_a_recorded_hang(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = dataclasses.replace(
        Config(),
        daemon=DaemonConfig(state_dir=str(tmp_path)),
        hangs=HangsConfig(stacks=True, ras=False),
    )
    store = EventStore.from_config(cfg)
    text = fixture("pyspy-peerdeath.txt")
    cap = StackCapture(1031, True, parse_dump(text)[1], raw=text)
    monitor = HangMonitor(cfg, FakeClock(), store, capture=lambda pid: cap)
    for t, jobs, gpus in polls("peerdeath-polls.jsonl"):
        monitor.observe(jobs, gpus, 1_800_000_000.0 + t)
        monitor.run_pending()
    monitor.observe([], [], 1_800_000_200.0)  # the job ends: resolved
    store.close()

    assert main(["hang", "show", "--state-dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "hang 1 " in listing and "job torch:127.0.0.1:29544" in listing
    assert "resolved" in listing and "straggler_or_dead_peer" in listing

    assert main(["hang", "show", "1", "--state-dir", str(tmp_path)]) == 0
    detail = capsys.readouterr().out
    assert "rank 0 pid 1031 gpus 0: cuCtxSynchronize_v2" in detail
    assert "missing: rank 1" in detail
    assert "--- stack of pid 1031 ---" in detail and "cudaDeviceSynchronize" in detail

    assert main(["hang", "show", "1", "--json", "--state-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["signature"] == "straggler_or_dead_peer" and doc["resolved_at"] == 1_800_000_200.0

    assert main(["hang", "show", "7", "--state-dir", str(tmp_path)]) == 1
