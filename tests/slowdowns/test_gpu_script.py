"""tests/gpu/slowdown_run.sh without a GPU: the harness, the job and the daemon work together."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_slowdown_run_keeps_steps_metrics_and_status_per_phase(tmp_path: Path) -> None:
    """slowdown_run.sh --dry-run: the daemon (replayed NVML) beside the job's fake steps;
    each phase has step times and scrapes of the GPU's series, summary.json says so."""
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu" / "slowdown_run.sh"), str(out), "--dry-run"]
        + ["--phases", "base:0:2,plus30:0.3:2", "--scrape", "0.5", "--interval", "0.5"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == 0 and result["ok"], done.stdout + done.stderr
    assert result == json.loads((out / "summary.json").read_text())
    assert result["daemon_exit"] == 0 and result["job_exit"] == 0
    base, slow = result["phases"]["base"], result["phases"]["plus30"]
    assert base["steps"] and base["scrapes"] and slow["steps"] and slow["scrapes"]
    assert 1.15 < slow["step_ratio"] < 1.45  # the job's own step times show the extra work
    assert base["sm_active_mean"] is not None and base["sm_clock_hz_mean"] == 1.98e9
    status = [json.loads(x) for x in (out / "status.jsonl").read_text().splitlines()]
    assert status and all("slowdowns" in s for s in status)
