"""Drill: only Xid and SXid events reach the Xid rule, the Xid alerts and `check`.

Issue 20: every stored `job_hang` event came back as `GpuXidWarning{xid="0"}`
("Job_hang 0 (Unknown Xid)") once the stored events were replayed into the
Xid tracker (daemon restart, every `gpuwatchd check --state-dir`). Here the
store holds one event of each kind the daemon writes, plus a kind it does
not know yet, and the real `check` CLI, the Xid stage and the health engine
read it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli import main
from gpuwatchd.clock import SystemClock
from gpuwatchd.health.hangs.record import RULE as JOB_HANG
from gpuwatchd.model import Event, Severity
from gpuwatchd.pipeline import Consumers, StoreReader, one_shot_config
from gpuwatchd.sinks.remediation import sink as remediation
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import State

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-probe.json"
NO_XID = ROOT / "tests" / "fixtures" / "kmsg" / "talos-kern-nvrm-no-xid.txt"
BOOT = "0f3c1f7e-8a2b-4c6d-9e10-1234567890ab"
XID_ALERTS = {"GpuXidWarning", "GpuXidCritical", "NvswitchSxidWarning", "NvswitchSxidCritical"}


def _store_every_kind(path: Path) -> None:
    """One event of every kind the daemon stores, as its writers build them."""
    now = time.time() - 30
    boot = (("boot_id", BOOT),)
    store = EventStore(str(path))
    store.write(
        [
            # kmsg source / NVML event source: Xids
            (Event("xid", "kmsg", now, 31, "0000:00:06.0", "NVRM: Xid 31", attrs=boot), "b1", 1),
            (Event("xid", "nvml", now, 79, "0000:00:07.0", "Xid 79", attrs=boot), "b2", 1),
            # kmsg source: an NVSwitch SXid
            (Event("sxid", "kmsg", now, 12028, "0000:84:00.0", "SXid", attrs=boot), "b3", 1),
            # the hang monitor (hangs/monitor.py) stores each job hang
            (
                Event(
                    JOB_HANG,
                    "hangs",
                    now,
                    message="job 111: no progress for 600 s",
                    severity=Severity.WARNING,
                    attrs=(("job", "111"), ("hang_id", "1"), ("forensics", "{}")),
                ),
                "h1",
                1,
            ),
            # the shm source's removals, and a kind a later version may add
            (
                Event("shm_segment_removed", "shm", now, severity=Severity.INFO, attrs=boot),
                "s1",
                1,
            ),
            # the memory source: pressure in a GPU process's memory cgroup
            (
                Event(
                    "memory_pressure",
                    "memory",
                    now,
                    message="memory cgroup /job_7 hit its memory limit (memory.events oom 0->1)",
                    severity=Severity.WARNING,
                    attrs=(*boot, ("scope", "cgroup"), ("cgroup", "/job_7"), ("pids", "4242")),
                ),
                "m1",
                1,
            ),
            (Event("unclean_restart", "daemon", now, 1, severity=Severity.WARNING), "u1", 1),
        ]
    )
    # the remediation sink stores what it did through its own helper
    remediation.record(store, "drain", "failed", "drain of node failed", now)
    store.close()


@pytest.fixture
def cfg_path(tmp_path: Path) -> Path:
    shm, sysfs = tmp_path / "shm", tmp_path / "sys"
    shm.mkdir()
    sysfs.mkdir()
    boot = tmp_path / "boot_id"
    boot.write_text(BOOT + "\n")
    _store_every_kind(tmp_path / "state" / "gpuwatchd.db")
    path = tmp_path / "config.yaml"
    path.write_text(
        f"daemon: {{state_dir: {tmp_path / 'state'}, node_name: gpu-node-17}}\n"
        f"paths: {{dev_shm: {shm}, sysfs: {sysfs}, boot_id: {boot}}}\n"
        "sources:\n"
        f"  nvml: {{replay: {H200}}}\n"
        f"  kmsg: {{backend: file, file: {NO_XID}}}\n"
    )
    return path


def test_only_xid_and_sxid_events_reach_the_xid_rule(cfg_path: Path) -> None:
    cfg = config.load(str(cfg_path))
    store = EventStore(str(Path(cfg.daemon.state_dir) / "gpuwatchd.db"))
    try:
        chain = Consumers(
            one_shot_config(cfg), State(), SystemClock(), StoreReader(store), (), one_shot=True
        )
        active = chain.xids.active()
        assert sorted((x.kind, x.code) for x in active) == [
            ("sxid", 12028),
            ("xid", 31),
            ("xid", 79),
        ]
        findings = chain.engine.evaluate(State().snapshot(), now=time.time())
    finally:
        store.close()
    raised = [f for f in findings if f.rule == "xid"]
    codes = sorted(dict(f.labels).get("xid") or dict(f.labels).get("sxid") for f in raised)
    assert codes == ["12028", "31", "79"]
    assert {f.alertname for f in raised} <= XID_ALERTS


def test_check_lists_only_xid_conditions_for_xid_events(cfg_path: Path, capsys) -> None:
    rc = main(["check", "--json", "--config", str(cfg_path)])
    report = json.loads(capsys.readouterr().out)
    xids = [c for c in report["conditions"] if c["alertname"] in XID_ALERTS]
    codes = sorted(c["labels"].get("xid") or c["labels"].get("sxid") for c in xids)
    assert codes == ["12028", "31", "79"], xids
    assert not any(c["labels"].get("xid") == "0" for c in report["conditions"])
    text = json.dumps(report)
    assert "Unknown Xid" not in text and "Job_hang" not in text
    assert rc == 2  # the Xid 79 of the store is critical
