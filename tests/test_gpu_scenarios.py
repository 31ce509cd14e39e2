"""The multi-GPU scenario harness (tests/gpu/nccl_scenarios.py) without a GPU.

Its schedule must fit the device calls it is written for, and its bookkeeping
(markers, the kill, samples, the end of every child) must hold on fake ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "gpu" / "nccl_scenarios.py"


def harness(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(HARNESS), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_each_session_call_fits_its_budget_and_together_they_run_every_scenario() -> None:
    names: list[str] = []
    for suite in ("a", "b"):
        out = harness("--plan", suite)
        assert out.returncode == 0, out.stderr
        *rows, total = out.stdout.strip().splitlines()
        assert float(total.split("~")[1].split()[0]) <= 540, total
        names += [r.split()[-1] for r in rows]
    every = harness("--plan", "all").stdout.strip().splitlines()[:-1]
    assert sorted(names) == sorted(r.split()[-1] for r in every)


@pytest.mark.slow
def test_a_dead_peer_on_fake_ranks_is_killed_sampled_and_cleaned_up(tmp_path: Path) -> None:
    out = harness(
        "--dry-run",
        "--out",
        str(tmp_path),
        "--daemon-url",
        "",
        "--hang-seconds",
        "3",
        "--settle",
        "1",
        "--warm",
        "0.2",
        "dead_peer",
    )
    assert out.returncode == 0, out.stderr
    trace = json.loads((tmp_path / "dead_peer" / "trace.json").read_text())
    killed = trace["ranks"]["1"]
    assert trace["hang_what"] == [f"SIGKILL rank 1 (pid {killed})"]
    assert trace["hang_start"] > trace["t_ready"]
    last = trace["samples"][-1]["ranks"]
    assert not last["1"]["alive"] and last["0"]["alive"]
    assert trace["notes"] == []  # nothing left alive after the kill
    for pid in trace["ranks"].values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert rows[0]["scenario"] == "dead_peer" and rows[0]["hang_start_s"] is not None
