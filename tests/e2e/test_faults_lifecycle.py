"""Fault drill, the daemon's own end: kill -9, a fatal signal, a thread that dies, a
reload that moves the state dir, a full disk at start, state files other users read.

A monitoring daemon never dies silently: each unclean end leaves a stack or a marker
that the next start reports (a log line, gpuwatchd_unclean_restarts_total, an event).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, DaemonProcess, NotifySocket, free_port
from tests.e2e.faults import Drill, mount_tmpfs, umount
from tests.servers import AlertmanagerServer

UNCLEAN = "did not stop cleanly"
FAULT_LOG = "gpuwatchd-fault.log"

# A real daemon process whose kmsg source thread dies of an uncaught exception once
# the file `die` appears beside it: planted through sitecustomize, nothing in the package.
PLANT = """
import os, sys
import gpuwatchd.sources.runner as runner

_loop = runner.Runner._loop
_trigger = os.path.join(os.path.dirname(os.path.abspath(__file__)), "die")


def _dying(self, slot):
    if slot.source.name != "kmsg":
        return _loop(self, slot)
    while not self._stop.is_set():
        self._poll(slot)
        if os.path.exists(_trigger):
            raise RuntimeError("planted: the kmsg source thread dies")
        slot.wake.wait(0.1)
        slot.wake.clear()


runner.Runner._loop = _dying
"""

# ... and the stop that follows hangs: the fallback must end the process anyway.
HANG_STOP = """
import time
import gpuwatchd.daemon as daemon

daemon.DEATH_GRACE = 1.0
daemon.Daemon._shutdown = lambda self: time.sleep(3600)
"""


def restarts(drill: Drill) -> float:
    return drill.metric("gpuwatchd_unclean_restarts_total")


def restart_events(drill: Drill) -> list[dict[str, object]]:
    body = json.loads(drill.get("/events?kind=daemon_unclean_restart")[1])
    return list(body["events"])


def check_notes(drill: Drill) -> list[str]:
    """`gpuwatchd check --format json`'s notes, on the drill's config and state dir."""
    r = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "check", "--config", str(drill.tmp / "config.yaml")]
        + ["--nvml-replay", str(drill.capture), "--state-dir", str(drill.state_dir)]
        + ["--format", "json", "--timeout", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return list(json.loads(r.stdout)["notes"])


class PlainDaemon(DaemonProcess):
    """`gpuwatchd run` without the harness's --state-dir flag (the config's key counts)."""

    def __init__(self, tmp: Path, config_text: str, args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.config = tmp / "config.yaml"
        self.config.write_text(config_text)
        (tmp / "notify.sock").unlink(missing_ok=True)
        self.notify = NotifySocket(tmp / "notify.sock")
        self.log = open(tmp / "daemon.log", "w+")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "NOTIFY_SOCKET": self.notify.path, "PYTHONUNBUFFERED": "1"}
        full_env.update(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatchd", "run", "--config", str(self.config)]
            + ["--listen", f"127.0.0.1:{self.port}", *args],
            cwd=ROOT,
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )


def test_kill_9_is_reported_at_the_next_start_and_sigterm_is_not(
    tmp_path: Path, alertmanager: AlertmanagerServer
) -> None:
    drill = Drill(tmp_path, alertmanager.url, node="drill-unclean")
    d = drill.start()
    first_pid = d.proc.pid
    assert (drill.state_dir / "gpuwatchd.run").exists()
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    drill.stop()

    d = drill.start()
    try:
        warnings = [line for line in d.output().splitlines() if UNCLEAN in line]
        assert len(warnings) == 1, d.output()
        assert "WARNING" in warnings[0] and f"pid {first_pid}" in warnings[0]
        assert "no stack in the fault log" in warnings[0]
        assert restarts(drill) == 1
        events = restart_events(drill)
        assert len(events) == 1 and events[0]["severity"] == "warning", events
        assert f"pid {first_pid}" in str(events[0]["message"])
        notes = check_notes(drill)
        assert any(UNCLEAN in n and f"pid {first_pid}" in n for n in notes), notes
    finally:
        assert drill.stop() == 0
    assert not (drill.state_dir / "gpuwatchd.run").exists()  # a clean stop removes it

    d = drill.start()  # after SIGTERM: nothing to report, and the counter only grows
    try:
        assert UNCLEAN not in d.output()
        assert restarts(drill) == 1
        assert len(restart_events(drill)) == 1
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
    finally:
        drill.stop()
    drill.start()
    try:
        assert restarts(drill) == 2
        assert len(restart_events(drill)) == 2
    finally:
        drill.stop()


def test_a_fatal_signal_leaves_a_stack_the_next_start_reports(
    tmp_path: Path, alertmanager: AlertmanagerServer
) -> None:
    """SIGSEGV as a native library's crash gives it (SIGABRT, SIGBUS, SIGILL, SIGFPE alike)."""
    sig = signal.SIGSEGV
    drill = Drill(tmp_path, alertmanager.url, node="drill-sigsegv")
    d = drill.start()
    os.kill(d.proc.pid, sig)
    assert d.proc.wait(10) == -sig
    drill.stop()
    stack = (drill.state_dir / FAULT_LOG).read_text()
    assert "Fatal Python error" in stack and "Thread 0x" in stack, stack
    assert "pipeline/daemon.py" in stack, stack  # every thread's stack: the consumer's too

    d = drill.start()
    try:
        warning = next(line for line in d.output().splitlines() if UNCLEAN in line)
        assert "Fatal Python error" in warning, warning
        assert restarts(drill) == 1
        assert "Fatal Python error" in str(restart_events(drill)[0]["message"])
        assert (drill.state_dir / (FAULT_LOG + ".1")).read_text() == stack  # kept
        assert (drill.state_dir / FAULT_LOG).read_text() == ""  # this run's, empty
    finally:
        drill.stop()


@pytest.mark.parametrize("stop", ["clean", "hangs"])
def test_a_thread_that_dies_stops_the_daemon_non_zero_with_its_traceback(
    tmp_path: Path, alertmanager: AlertmanagerServer, stop: str
) -> None:
    drill = Drill(tmp_path, alertmanager.url, node=f"drill-thread-dies-{stop}")
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(PLANT + (HANG_STOP if stop == "hangs" else ""))
    path = os.pathsep.join([str(plant), str(ROOT), os.environ.get("PYTHONPATH", "")])
    d = PlainDaemon(
        tmp_path,
        drill.config_text,
        ["--nvml-replay", str(drill.capture), "--state-dir", str(drill.state_dir)],
        {"PYTHONPATH": path},
    )
    drill.daemon = d
    try:
        d.notify.wait_for("READY=1", timeout=60)
        (plant / "die").touch()
        assert d.proc.wait(30) == 70, d.output()
        out = d.output()
        assert "thread source-kmsg died of an uncaught exception" in out, out
        assert "RuntimeError: planted: the kmsg source thread dies" in out, out
        assert "Traceback (most recent call last)" in out
        fault = (drill.state_dir / FAULT_LOG).read_text()
        assert "RuntimeError: planted" in fault
        if stop == "hangs":
            assert "did not finish in 1s: exiting" in out, out
    finally:
        drill.stop()
    if stop == "hangs":
        return
    (plant / "die").unlink()
    d = drill.start()
    try:
        warning = next(line for line in d.output().splitlines() if UNCLEAN in line)
        assert "thread source-kmsg died" in warning, warning
        assert restarts(drill) == 1
    finally:
        drill.stop()


def test_reload_that_changes_the_state_dir_keeps_the_old_one(
    tmp_path: Path, alertmanager: AlertmanagerServer
) -> None:
    old_dir, new_dir = tmp_path / "state-a", tmp_path / "no" / "such" / "dir"
    drill = Drill(tmp_path, alertmanager.url, node="drill-reload-state-dir", state_dir=old_dir)
    base = drill.config_text.replace("daemon:\n", f"daemon:\n  state_dir: {old_dir}\n", 1)
    d = PlainDaemon(tmp_path, base, ["--nvml-replay", str(drill.capture)], {})
    drill.daemon = d
    try:
        d.notify.wait_for("READY=1", timeout=60)
        d.config.write_text(base.replace(str(old_dir), str(new_dir)))
        seen = len(d.notify.messages)
        d.proc.send_signal(signal.SIGHUP)
        d.notify.wait_for("READY=1", timeout=30, after=seen + 1)
        assert d.proc.poll() is None, d.output()
        lines = [line for line in d.output().splitlines() if "daemon.state_dir" in line]
        assert len(lines) == 1 and "WARNING" in lines[0] and str(old_dir) in lines[0], lines
        assert not new_dir.exists()
        drill.feed(79, 0)  # the store and the alert outbox stay in the locked dir
        drill.assert_nothing_lost(alertmanager)
        assert (old_dir / "gpuwatchd.db").exists()
    finally:
        assert drill.stop() == 0


@pytest.mark.parametrize("existing", [False, True], ids=["empty-state-dir", "existing-store"])
def test_full_disk_at_start_monitors_and_persists_once_space_frees(
    tmp_path: Path, alertmanager: AlertmanagerServer, existing: bool
) -> None:
    mnt = tmp_path / "mnt"
    if not mount_tmpfs(mnt, "2m"):
        pytest.skip("mounting a tmpfs is not permitted here")
    drill = Drill(
        tmp_path, alertmanager.url, node=f"drill-full-{existing}", state_dir=mnt / "state"
    )
    try:
        if existing:
            drill.start()
            drill.feed(79, 0)
            drill.assert_nothing_lost(alertmanager)
            drill.stop()
        filler = mnt / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        d = drill.start()  # before the fix: exit 78 (empty) or 1 (existing store)
        assert d.proc.poll() is None
        drill.wait_for(lambda: drill.metric("gpuwatchd_event_store_up") == 0, why="store down")
        drill.feed(48, 1)
        # Alerts come from memory while nothing reaches the disk.
        drill.wait_for(
            lambda: len(drill.in_alertmanager(alertmanager)) == len(drill.fed), why="alerts"
        )
        # /status says what a full disk costs: no run marker, held events not in /events
        status = json.loads(drill.get("/status")[1])
        assert status["run_marker"].startswith("not written"), status.get("run_marker")
        store = status["event_store"]
        assert store["up"] is False and store["held_events"] >= 1, store
        assert "missing from /events" in store["note"]
        filler.unlink()
        drill.assert_nothing_lost(alertmanager, timeout=60)
        drill.wait_for(lambda: drill.metric("gpuwatchd_event_store_up") == 1, why="store up")
        drill.wait_for(
            lambda: json.loads(drill.get("/status")[1])["run_marker"] == "written",
            why="the run marker written once space freed",
        )
        assert "note" not in json.loads(drill.get("/status")[1])["event_store"]
        assert drill.stop() == 0
        drill.start()  # what was held reached the file
        assert drill.stored() == drill.expected_store()
    finally:
        drill.stop()
        umount(mnt)


def test_state_files_are_private_without_the_units_umask(
    tmp_path: Path, alertmanager: AlertmanagerServer
) -> None:
    state = tmp_path / "state"
    drill = Drill(tmp_path, alertmanager.url, node="drill-private")
    old = os.umask(0o022)  # what a shell gives a hand start
    try:
        drill.start()
        drill.feed(79, 0)
        drill.assert_nothing_lost(alertmanager)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in state.iterdir() if p.is_file()}
        dirs = {p.name: stat.S_IMODE(p.stat().st_mode) for p in state.iterdir() if p.is_dir()}
        assert {n: m for n, m in dirs.items() if m != 0o700} == {}  # e.g. evidence/
        for name in ("gpuwatchd.db", "gpuwatchd.db-wal", "gpuwatchd.lock", "gpuwatchd.run"):
            assert name in files, files
        assert FAULT_LOG in files
        assert {n: m for n, m in files.items() if m != 0o600} == {}
    finally:
        drill.stop()
    # A store an earlier version (or a hand start) left world-readable is tightened.
    os.chmod(state / "gpuwatchd.db", 0o644)
    os.chmod(state, 0o755)
    os.chmod(state / FAULT_LOG, 0o644)
    bundles = [p for p in (state / "evidence").iterdir()]
    assert bundles, "the critical Xid wrote no evidence bundle"
    for p in [state / "evidence", *bundles]:
        os.chmod(p, 0o755)
    os.chmod(bundles[0] / "meta.json", 0o644)
    d = drill.start()
    try:
        assert stat.S_IMODE((state / "gpuwatchd.db").stat().st_mode) == 0o600
        assert stat.S_IMODE((state / FAULT_LOG).stat().st_mode) == 0o600
        modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [state / "evidence", *bundles]}
        assert set(modes.values()) == {0o700}, modes
        assert stat.S_IMODE((bundles[0] / "meta.json").stat().st_mode) == 0o600
        assert stat.S_IMODE(state.stat().st_mode) == 0o750  # the group's bits are the site's
        assert "was open to all users: mode 750 now" in d.output()
    finally:
        drill.stop()


def test_files_left_open_by_an_older_version_are_tightened_at_start(tmp_path: Path) -> None:
    """The fault logs and the evidence tree, made before the modes changed (0644/0755)."""
    from gpuwatchd.runmarker import tighten_state_dir

    state = tmp_path / "state"
    bundle = state / "evidence" / "20261128T000000Z-0123456789"
    bundle.mkdir(parents=True)
    for p in (state / FAULT_LOG, state / (FAULT_LOG + ".1"), bundle / "kmsg.txt"):
        p.write_text("x\n")
        p.chmod(0o644)
    for p in (state / "evidence", bundle):
        p.chmod(0o755)
    outside = tmp_path / "elsewhere"
    outside.write_text("not ours\n")
    outside.chmod(0o644)
    (bundle / "link").symlink_to(outside)
    tighten_state_dir(str(state))
    modes = {
        p.name: stat.S_IMODE(p.stat().st_mode) for p in (state / FAULT_LOG, bundle / "kmsg.txt")
    }
    assert modes == {FAULT_LOG: 0o600, "kmsg.txt": 0o600}
    assert stat.S_IMODE((state / (FAULT_LOG + ".1")).stat().st_mode) == 0o600
    assert {stat.S_IMODE(p.stat().st_mode) for p in (state / "evidence", bundle)} == {0o700}
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644  # a link is not followed
