"""Fault drill, storage: a corrupt database, the state dir deleted, read-only or full,
two daemons on one state dir, kill -9. Nothing fed may be lost or doubled."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port
from tests.e2e.faults import (
    Drill,
    Probe,
    assert_responsive,
    mount_tmpfs,
    umount,
)
from tests.servers import AlertmanagerServer


def test_corrupt_database_at_start(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "gpuwatchd.db").write_bytes(b"not a database at all " * 512)
    drill = Drill(tmp_path, alertmanager.url, node="drill-corrupt")
    drill.start()
    try:
        probe = Probe(drill.daemon.url)
        drill.feed(79, 0)
        drill.feed(48, 1)
        drill.assert_nothing_lost(alertmanager)
        assert [p.name for p in state.iterdir() if ".corrupt-" in p.name]
        assert drill.metric("gpuwatchd_event_store_quarantined_total") == 1
        drill.wait_for(lambda: "corrupt" in drill.store_alert(), why="the store alert")
        assert str(state) in drill.store_alert()
        assert_responsive("corrupt database at start", probe.stop())
    finally:
        drill.stop()


def test_state_dir_deleted_while_running(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    drill = Drill(tmp_path, alertmanager.url, node="drill-deleted")
    drill.start()
    try:
        probe = Probe(drill.daemon.url)
        drill.feed(79, 0)
        drill.wait_for(lambda: drill.stored() == drill.expected_store(), why="first Xid stored")
        shutil.rmtree(drill.state_dir)
        drill.feed(95, 1)
        drill.assert_nothing_lost(alertmanager)
        assert (drill.state_dir / "gpuwatchd.db").exists()
        assert drill.metric("gpuwatchd_event_store_errors_total", op="state_dir") == 1
        drill.wait_for(lambda: "re-created" in drill.store_alert(), why="the store alert")
        assert_responsive("state dir deleted while running", probe.stop())
    finally:
        drill.stop()


@pytest.mark.parametrize("fault", ["full", "read_only", "full_then_kill_9"])
def test_state_dir_full_or_read_only_then_fixed(
    tmp_path: Path, alertmanager: AlertmanagerServer, fault: str
) -> None:
    """A real tmpfs as the state dir: filled up, or a read-only one mounted over it.

    `full_then_kill_9`: the daemon dies (kill -9) while events wait in memory; the disk is
    freed and it starts again: the cursor never moved past them, so it reads them again.
    """
    mnt = tmp_path / "mnt"
    if not mount_tmpfs(mnt, "4m"):
        pytest.skip(
            "mounting a tmpfs is not permitted here (tests/sinks/test_store_faults.py"
            " covers the same logic with an injected failure)"
        )
    drill = Drill(tmp_path, alertmanager.url, node=f"drill-{fault}", state_dir=mnt)
    try:
        drill.start()
        probe = Probe(drill.daemon.url)
        drill.feed(79, 0)
        drill.wait_for(lambda: drill.stored() == drill.expected_store(), why="first Xid stored")
        filler = mnt / "filler"
        if fault.startswith("full"):
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                except OSError:
                    pass
        else:
            # As after errors=remount-ro: the daemon's dir now is a read-only filesystem.
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], check=True
            )
        # Enough reports to overflow SQLite's free pages and the WAL's slack.
        for code in (48, 95, 119, 120, 74, 64):
            drill.feed(code, 1)
        drill.wait_for(lambda: drill.metric("gpuwatchd_event_store_up") == 0, why="store down")
        drill.wait_for(lambda: str(drill.state_dir) in drill.store_alert(), why="store alert")
        # Alerts come from what the daemon knows, not from what reached the disk.
        drill.wait_for(
            lambda: len(drill.in_alertmanager(alertmanager)) == len(drill.fed), why="alerts"
        )
        if fault == "full_then_kill_9":
            drill.daemon.proc.kill()
            drill.daemon.proc.wait(10)
            drill.stop()
            filler.unlink()
            drill.start()
        elif fault == "full":
            filler.unlink()
        else:
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        drill.assert_nothing_lost(alertmanager, timeout=60)
        drill.wait_for(lambda: drill.metric("gpuwatchd_event_store_up") == 1, why="store up")
        if fault == "full_then_kill_9":
            probe.stop()
            return
        assert drill.metric("gpuwatchd_event_store_errors_total", op="write") >= 1
        assert_responsive(f"state dir {fault.replace('_', '-')} then fixed", probe.stop())
    finally:
        drill.stop()
        umount(mnt)
        umount(mnt)


def test_kill_9_and_restart(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    drill = Drill(tmp_path, alertmanager.url, node="drill-kill9")
    for round_ in range(3):
        drill.start()
        drill.feed(CRIT[round_], 0)
        drill.wait_for(lambda: drill.stored() == drill.expected_store(), why="stored")
        drill.feed(CRIT[round_ + 3], 1)  # written to the log; the kill may come first
        drill.daemon.proc.send_signal(signal.SIGKILL)
        drill.daemon.proc.wait(10)
        drill.stop()
    drill.start()
    try:
        drill.assert_nothing_lost(alertmanager)
    finally:
        drill.stop()


CRIT = (79, 48, 95, 119, 120, 74)


def test_second_daemon_on_one_state_dir_exits_78(
    tmp_path: Path, alertmanager: AlertmanagerServer
) -> None:
    drill = Drill(tmp_path, alertmanager.url, node="drill-lock")
    drill.start()
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuwatchd",
                "run",
                "--listen",
                f"127.0.0.1:{free_port()}",
                "--state-dir",
                str(drill.state_dir),
                "--nvml-replay",
                str(drill.capture),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "NOTIFY_SOCKET": ""},
        )
        assert second.returncode == 78, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert str(drill.state_dir) in lines[0] and f"pid {drill.daemon.proc.pid}" in lines[0]
    finally:
        drill.stop()
