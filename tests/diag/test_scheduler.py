"""The daemon's diag scheduler: only on an idle node (real Slurm), after a critical clears,
cancelled by a job starting mid-run, and the gpuwatchd_diag_* series from the store."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.clock import FakeClock
from gpuwatchd.diag.run import FAKE_WORKER_ENV
from gpuwatchd.diag.scheduler import DiagScheduler
from gpuwatchd.model import Action, Finding, Severity, labels_of
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import State
from tests.diag.fakes import H100_IDLE, HEALTHY_H100, canned, result
from tests.slurm_cluster import SlurmCluster, slurm_cluster


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from slurm_cluster(tmp_path_factory)


def _scheduler(
    tmp_path: Path, diag: str, slurm_node: str = "", env: dict[str, str] | None = None
) -> tuple[DiagScheduler, FakeClock, EventStore]:
    scontrol = shutil.which("scontrol") or "scontrol"
    slurm = f"remediation: {{slurm: {{node_name: '{slurm_node}', scontrol: {scontrol}}}}}"
    cfg = config.load_text(
        f"daemon: {{state_dir: {tmp_path / 'state'}}}\n"
        f"sources: {{nvml: {{replay: {H100_IDLE}}}}}\n"
        f"diag: {diag}\n" + (slurm + "\n" if slurm_node else "")
    )
    clock = FakeClock(time.time())
    store = EventStore.from_config(cfg, clock.time)
    return DiagScheduler(cfg, State(), clock, store, "node1", env=env), clock, store


def critical() -> Finding:
    return Finding(
        rule="xid",
        alertname="GpuXidCritical",
        scope="gpu",
        subject=labels_of({"gpu": "0", "uuid": "GPU-0", "pci_bus_id": "0000:3b:00.0"}),
        severity=Severity.CRITICAL,
        reason="Xid 79",
        action=Action.REBOOT_NODE,
        remediation="reboot",
        since=0.0,
    )


def test_nothing_runs_by_default(tmp_path: Path) -> None:
    sched, clock, store = _scheduler(tmp_path, "{}")
    clock.advance(86400 * 30)
    sched.update([critical()])
    sched.update([])
    assert sched.tick() is None
    assert store.recent(5, kind="diag") == []
    store.close()


def test_schedule_runs_when_due_and_exports_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, HEALTHY_H100))
    sched, clock, store = _scheduler(tmp_path, "{schedule_seconds: 3600}")
    assert sched.tick() is None  # not due yet
    clock.advance(3600)
    report = sched.tick()
    assert report is not None and report.verdict == "OK" and report.tier == "quick"
    assert sched.tick() is None  # the next one is an hour away
    [run] = store.recent(5, kind="diag")
    assert run["attrs"]["trigger"] == "schedule"
    got = {(s.name, s.labels): s.value for s in sched.samples()}
    assert got[("gpuwatchd_diag_check_passed", (("check", "gemm"), ("gpu", "0")))] == 1
    assert got[("gpuwatchd_diag_measured", (("check", "gemm"), ("gpu", "0")))] == 790e12
    assert got[("gpuwatchd_diag_floor", (("check", "d2d_bandwidth"), ("gpu", "0")))] == 2550e9
    assert got[("gpuwatchd_diag_last_pass_timestamp_seconds", (("tier", "quick"),))] > 0
    assert got[("gpuwatchd_diag_running", ())] == 0
    store.close()


def test_after_a_critical_clears_standard_runs_until_one_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [*HEALTHY_H100, result("gemm", "0", 100.0, "TFLOP/s")]
    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, lines))
    sched, _clock, store = _scheduler(tmp_path, "{after_critical: true, inspect_after_failures: 2}")
    sched.update([critical()])
    assert sched.tick() is None  # still critical
    sched.update([])
    report = sched.tick()
    assert report is not None and report.tier == "standard" and report.verdict == "CRITICAL"
    assert sched.tick() is None  # owed once, done
    [fail] = store.recent(5, kind="diag_fail")
    assert fail["attrs"]["check"] == "gemm"
    sched.update([critical()])
    sched.update([])
    sched.tick()
    got = {(s.name, s.labels): s.value for s in sched.samples()}
    assert got[("gpuwatchd_diag_failures_30d", (("gpu", "0"),))] == 2
    assert got[("gpuwatchd_diag_inspect", (("check", "gemm"), ("gpu", "0")))] == 1
    assert sched.status()["inspect"] == ["gemm:0"]
    store.close()


@pytest.mark.timeout(120)
def test_slurm_job_on_the_node_blocks_then_cancels_the_run(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [*HEALTHY_H100[:2], {"sleep": 60}]
    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, lines))
    sched, clock, store = _scheduler(tmp_path, "{schedule_seconds: 60}", slurm.node, env=slurm.env)
    clock.advance(60)
    job = slurm.submit("sleep 60", name="train")
    try:
        slurm.wait_state(job, "RUNNING")
        assert sched.busy().startswith("Slurm node")
        assert sched.tick() is None  # a job holds the node: no run
        slurm.run(["scancel", job])
        deadline = time.monotonic() + 20
        while sched._slurm_busy() and time.monotonic() < deadline:
            time.sleep(0.5)
            sched._slurm_checked = (-1.0, "")
        assert sched.busy() == ""
        # Idle now: the run starts; a job starting meanwhile cancels it.
        import threading

        def start_job() -> None:
            time.sleep(1.0)
            slurm.submit("sleep 60", name="next")

        threading.Thread(target=start_job, daemon=True).start()
        t0 = time.monotonic()
        report = sched.tick()
        assert report is not None and report.cancelled.startswith("Slurm node"), report
        assert time.monotonic() - t0 < 20
        assert report.results == () and report.freed_seconds < 3
        [run] = store.recent(5, kind="diag")
        assert run["attrs"]["cancelled"].startswith("Slurm node")
        assert store.recent(5, kind="diag_fail") == []
    finally:
        slurm.run(["scancel", "--user", "root"], check=False)
        store.close()
