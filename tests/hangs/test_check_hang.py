"""`gpuwatchd check` reports a job hang the daemon holds open in its store (exit 2),
over the NVML replay of a real H200 capture; a resolved hang leaves it OK."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli.check import check
from gpuwatchd.clock import FakeClock
from gpuwatchd.config.schema import HangsConfig
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.sinks.store import EventStore
from tests.check_config import write_check_config
from tests.hangs.replay import polls

ROOT = Path(__file__).resolve().parents[2]
NO_XID = ROOT / "tests" / "fixtures" / "kmsg" / "talos-kern-nvrm-no-xid.txt"


@pytest.fixture
def cfg(tmp_path: Path) -> config.Config:
    path = write_check_config(tmp_path, NO_XID, node="n", extra="hangs: {ras: false}\n")
    c = config.load(str(path))
    (tmp_path / "state").mkdir()
    return dataclasses.replace(c, hangs=HangsConfig(ras=False))


def _record_hang(cfg: config.Config, resolve: bool) -> None:
    store = EventStore.from_config(cfg)
    monitor = HangMonitor(cfg, FakeClock(), store)
    base = time.time() - 150
    for t, jobs, gpus in polls("peerdeath-polls.jsonl"):
        monitor.observe(jobs, gpus, base + t)
        monitor.run_pending()
    if resolve:
        monitor.observe([], [], time.time())
    store.close()


def test_open_hang_makes_check_critical(cfg: config.Config) -> None:
    _record_hang(cfg, resolve=False)
    v = check(cfg, timeout=20)
    (f,) = [f for f in v.findings if f.alertname == "JobHangSuspected"]
    assert v.status == "CRITICAL" and v.exit_code == 2
    assert "torch:127.0.0.1:29544" in f.reason and "dead" in f.remediation


def test_resolved_hang_is_not_reported(cfg: config.Config) -> None:
    _record_hang(cfg, resolve=True)
    v = check(cfg, timeout=20)
    assert [f for f in v.findings if f.alertname == "JobHangSuspected"] == []
