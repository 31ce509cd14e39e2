"""Drill: the multi-GPU session script (tests/gpu/multi_gpu_session.sh) without a GPU.

The daemon runs on the NVML replay and the scenarios on fake ranks (--dry-run).
Defects of the first real 2x H100 run: the scenarios phase waited for the
daemon it had started (a bare `wait`) until the call limit; a phase named
`scenarios-a+b` wrote `scenarios-a+b.log`, a name that cannot come back; and a
daemon that died of SIGSEGV was silently replaced by the next phase.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "tests" / "gpu" / "multi_gpu_session.sh"
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def session(phases: str, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), phases, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,  # a phase that waits on the daemon never ends
        cwd=ROOT,
    )


@pytest.mark.slow
def test_session_phases_end_name_files_safely_and_report_a_dead_daemon(tmp_path: Path) -> None:
    run = tmp_path / "gwd"
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        PYTHONPATH=str(ROOT),
        GW_PORT=str(free_port()),
        GW_STATE=str(tmp_path / "state"),
        GW_RUN=str(run),
        WORK_ROOT=str(tmp_path),
        GW_ARGS=f"--nvml-replay {FIXTURES / 'nvml' / 'h200x2-record.json'}",
        HARNESS_ARGS="--dry-run --settle 1 --warm 0.2 --ras-port-base 28700"
        " --master-port-base 29700",
        BUDGET="40",
        HANG_SECONDS="3",
    )
    out = tmp_path / "out"
    try:
        first = session("scenarios-rendezvous_missing+dead_peer", out, env)
        assert first.returncode == 0, first.stdout + first.stderr
        names = sorted(os.listdir(out))
        assert all(SAFE_NAME.match(n) for n in names), names
        assert len(names) <= 8 and "scenarios-rendezvous_missing_dead_peer.tar.gz" in names
        doc = json.loads((out / "session-summary.json").read_text())
        assert doc["phases"][0]["daemon_checks"][-1]["state"] == "alive"

        pid = int(Path(f"{run}.pid").read_text())
        os.kill(pid, signal.SIGSEGV)  # as libnvidia-ml did on the H100s
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and " Z " not in _stat(pid):
            time.sleep(0.1)

        second = session("finish", out, env)
        assert second.returncode == 0, second.stdout + second.stderr
        assert re.search(rf"pid {pid} \(start time \d+\) GONE", second.stdout), second.stdout
        check = json.loads((out / "session-summary.json").read_text())["phases"][1]
        assert check["daemon_checks"][0]["state"] == "GONE"
        with tarfile.open(out / "finish.tar.gz") as tar:
            fault = [m for m in tar.getnames() if m.endswith("begin-gpuwatchd-fault.log")]
            assert fault, tar.getnames()
            text = tar.extractfile(fault[0]).read().decode()  # type: ignore[union-attr]
        assert "Segmentation fault" in text
    finally:
        try:
            os.kill(int(Path(f"{run}.pid").read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _stat(pid: int) -> str:
    """/proc/PID/stat, or ' Z ' once it is gone (reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return " Z "
