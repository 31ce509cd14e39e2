"""Drills: whatever stops `gpuwatchd diag` or `clear --resume`, the worker does not outlive it.

The worker runs in its own session, so a signal to the command reaches it
only through the command: SIGINT, SIGTERM and SIGHUP kill its group;
SIGKILL of the command kills it through PR_SET_PDEATHSIG. A child that
calls setsid and keeps the pipes open holds neither --timeout nor a
scheduled run past its deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.clock import FakeClock
from gpuwatchd.diag.run import FAKE_WORKER_ENV
from gpuwatchd.diag.scheduler import DiagScheduler
from gpuwatchd.sinks.diag import last_runs
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import State
from tests.conftest import ROOT
from tests.diag.fakes import H100_IDLE, HEALTHY_H100, alive, canned

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
SETSID_SLEEP = [sys.executable, "-c", "import os, time; os.setsid(); time.sleep(60)"]


def _wait_file(path: Path, proc: subprocess.Popen[str], timeout: float = 20.0) -> int:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)
    return int(path.read_text())


def _gone(pid: int, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


@pytest.fixture
def reaped() -> Iterator[list[int]]:
    """Pids a test may leave behind when it fails: killed at the end if still ours (their
    command line is the drill's sleeper, the worker or the command), never a reused pid."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"time.sleep(60)" in cmdline or b"gpuwatchd" in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _diag(tmp_path: Path, lines: list[dict[str, object]], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "diag", "--nvml-replay", str(H100_IDLE),
         "--fake-worker", canned(tmp_path, lines), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _clear_resume(tmp_path: Path, lines: list[dict[str, object]]) -> subprocess.Popen[str]:
    """`clear --resume` with Slurm draining configured: it runs diag standard first."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"daemon: {{state_dir: {tmp_path / 'state'}}}\n"
        f"sources: {{nvml: {{replay: {H100_IDLE}}}, kmsg: {{enabled: false}}}}\n"
        "remediation: {slurm: {drain_on: [critical], node_name: n1}}\n"
    )
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "clear", "--resume", "--config", str(cfg)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, FAKE_WORKER_ENV: canned(tmp_path, lines)},
    )  # fmt: skip


def _worker_of(child: int) -> int:
    """The worker's pid: the group of the child it started (the worker leads its group)."""
    return os.getpgid(child)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_kills_the_worker_and_its_children(
    tmp_path: Path, reaped: list[int], sig: signal.Signals
) -> None:
    pidfile = tmp_path / "child.pid"
    lines = [*HEALTHY_H100[:2], {"spawn": SLEEP, "pidfile": str(pidfile)}, {"sleep": 60}]
    cli = _diag(tmp_path, lines)
    reaped.append(cli.pid)
    child = _wait_file(pidfile, cli)
    worker = _worker_of(child)
    reaped += [child, worker]
    cli.send_signal(sig)
    out, err = cli.communicate(timeout=15)
    assert cli.returncode == 3, (out, err)  # UNKNOWN: nothing failed, nothing passed
    assert f"cancelled (interrupted by {sig.name})" in out
    assert _gone(worker), "the worker outlived the command"
    assert _gone(child), "the worker's child outlived the command"


def test_sigterm_to_clear_resume_kills_the_worker_and_resumes_nothing(
    tmp_path: Path, reaped: list[int]
) -> None:
    pidfile = tmp_path / "child.pid"
    lines = [*HEALTHY_H100[:2], {"spawn": SLEEP, "pidfile": str(pidfile)}, {"sleep": 60}]
    cli = _clear_resume(tmp_path, lines)
    reaped.append(cli.pid)
    child = _wait_file(pidfile, cli)
    worker = _worker_of(child)
    reaped += [child, worker]
    cli.send_signal(signal.SIGTERM)
    out, err = cli.communicate(timeout=15)
    assert cli.returncode == 3, (out, err)
    assert "not resumed" in err and "interrupted by SIGTERM" in out + err
    assert _gone(worker) and _gone(child), "the worker outlived clear --resume"


def test_sigkill_of_the_command_takes_the_worker_with_it(tmp_path: Path, reaped: list[int]) -> None:
    pidfile = tmp_path / "child.pid"
    # The worker's own pid is what PR_SET_PDEATHSIG guards: its child writes the group.
    lines = [{"spawn": SLEEP, "pidfile": str(pidfile)}, {"sleep": 60}]
    cli = _diag(tmp_path, lines)
    child = _wait_file(pidfile, cli)
    worker = _worker_of(child)
    reaped += [child, worker]
    cli.kill()
    cli.communicate(timeout=10)
    assert _gone(worker), "the worker survived SIGKILL of diag"


def test_a_setsid_child_holding_the_pipes_does_not_stretch_the_timeout(
    tmp_path: Path, reaped: list[int]
) -> None:
    pidfile = tmp_path / "child.pid"
    lines = [{"spawn": SETSID_SLEEP, "pidfile": str(pidfile)}, {"sleep": 60}]
    t0 = time.monotonic()
    cli = _diag(tmp_path, lines, "--timeout", "3")
    reaped += [cli.pid, _wait_file(pidfile, cli)]
    out, err = cli.communicate(timeout=40)
    took = time.monotonic() - t0
    assert cli.returncode == 3, (out, err)
    assert "did not finish within 3s" in out
    assert took < 12, f"--timeout 3 returned after {took:.1f}s"  # was the child's life


def test_a_worker_that_finished_is_not_waited_past_its_end(
    tmp_path: Path, reaped: list[int]
) -> None:
    """It printed every result and its final line; a setsid child still holds stdout."""
    pidfile = tmp_path / "child.pid"
    lines = [{"spawn": SETSID_SLEEP, "pidfile": str(pidfile)}, *HEALTHY_H100]
    t0 = time.monotonic()
    cli = _diag(tmp_path, lines, "--timeout", "30")
    reaped += [cli.pid, _wait_file(pidfile, cli)]
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, (out, err)
    assert time.monotonic() - t0 < 12, "waited for the child instead of the worker"


@pytest.mark.timeout(60)
def test_a_scheduled_run_reaches_a_final_state_at_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reaped: list[int]
) -> None:
    pidfile = tmp_path / "child.pid"
    lines = [{"spawn": SETSID_SLEEP, "pidfile": str(pidfile)}, {"sleep": 60}]
    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, lines))
    cfg = config.load_text(
        f"daemon: {{state_dir: {tmp_path / 'state'}}}\n"
        f"sources: {{nvml: {{replay: {H100_IDLE}}}}}\n"
        "diag: {schedule_seconds: 60, timeout_seconds: 10}\n"
    )
    clock = FakeClock(time.time())
    store = EventStore.from_config(cfg, clock.time)
    sched = DiagScheduler(cfg, State(), clock, store, "node1")
    try:
        clock.advance(61)
        t0 = time.monotonic()
        report = sched.tick()
        took = time.monotonic() - t0
        reaped.append(int(pidfile.read_text()))
        assert report is not None and report.verdict == "UNKNOWN"
        assert "did not finish within 10s" in report.error
        assert took < 20, f"the run stayed running {took:.1f}s past a 10 s timeout"
        assert sched.status()["running"] == ""
        [run] = last_runs(store, 5)
        assert run.verdict == "UNKNOWN"
    finally:
        sched.stop()
        store.close()
