"""The diag worker as a real subprocess: results read, cancel and timeout kill its group."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gpuwatchd.sources.diag.runner import WorkerRun, worker_command
from tests.diag.fakes import HEALTHY_H100, alive, canned, result


def _run(tmp_path: Path, lines: list[dict[str, object]], **kw: object) -> WorkerRun:
    return WorkerRun(worker_command("quick", [0], fake=canned(tmp_path, lines)), **kw)  # type: ignore[arg-type]


def test_measurements_come_back_typed(tmp_path: Path) -> None:
    out = _run(tmp_path, HEALTHY_H100, timeout=30).run()
    assert out.error == "" and out.cancelled == ""
    assert out.backend == "fake"
    assert [(m.check, m.gpu, m.value) for m in out.measurements] == [
        ("gemm", "0", 790.0),
        ("h2d_bandwidth", "0", 52.0),
        ("d2d_bandwidth", "0", 3000.0),
    ]


def test_cancel_kills_the_whole_group_within_seconds(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    lines = [
        result("gemm", "0", 790.0, "TFLOP/s"),
        {"spawn": [sys.executable, "-c", "import time; time.sleep(60)"], "pidfile": str(pidfile)},
        {"sleep": 60},
    ]
    started = time.monotonic()
    polls = []

    def job_started(pid: int) -> str:
        polls.append(pid)
        return "slurm job 42 started" if pidfile.exists() and len(polls) > 2 else ""

    run = _run(tmp_path, lines, timeout=60, should_cancel=job_started, check_every=0.05)
    out = run.run()
    assert out.cancelled == "slurm job 42 started"
    assert time.monotonic() - started < 10
    assert out.freed_seconds < 3
    child = int(pidfile.read_text())
    assert run.pid is not None and not alive(run.pid)
    deadline = time.monotonic() + 3
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the worker's child outlived the cancel"


def test_cancel_from_another_thread(tmp_path: Path) -> None:
    import threading

    run = _run(tmp_path, [{"sleep": 60}], timeout=60)
    threading.Timer(0.3, run.cancel, args=("pod scheduled",)).start()
    t0 = time.monotonic()
    out = run.run()
    assert out.cancelled == "pod scheduled"
    assert time.monotonic() - t0 < 5


def test_timeout_is_an_error_and_kills(tmp_path: Path) -> None:
    run = _run(tmp_path, [{"sleep": 60}], timeout=0.5)
    out = run.run()
    assert "did not finish within 0.5s" in out.error
    assert run.pid is not None and not alive(run.pid)


def test_worker_dying_midway_is_an_error(tmp_path: Path) -> None:
    out = _run(tmp_path, [result("gemm", "0", 790.0, "TFLOP/s"), {"exit": 7}], timeout=30).run()
    assert "exited 7 without finishing" in out.error
    assert len(out.measurements) == 1


def test_another_interpreter_sees_only_the_package(tmp_path: Path) -> None:
    # A configured interpreter (a PyTorch venv) must import this gpuwatchd's worker
    # without our environment: only a link to the package goes on its path.
    link = tmp_path / "python"
    link.symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = worker_command("quick", [0], python=str(link), fake=canned(tmp_path, HEALTHY_H100))
    out = WorkerRun(argv, timeout=30, env=env).run()
    assert out.error == "" and len(out.measurements) == 3


def test_worker_module_needs_no_gpu_library_to_start(tmp_path: Path) -> None:
    # Without CuPy or PyTorch the worker says so as a fatal line, it does not crash.
    proc = subprocess.run(
        [sys.executable, "-m", "gpuwatchd.diag.worker", "--backend", "cupy"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 3
    assert '"fatal"' in proc.stdout and "gpuwatchd[diag]" in proc.stdout
