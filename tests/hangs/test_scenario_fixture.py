"""tests/gpu/scenario_fixture.py on a scenario directory built from the dead-peer
recording as nccl_scenarios.py writes one today (environ, the NVML window inside
trace.json on GPUs 2 and 3, fr/dump_0, the machine's absolute paths), then the
fixture it writes replayed against the expect.json it drafted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hangs.real_trace import DIR, PIPE_PREFIX, Trace

ROOT = Path(__file__).resolve().parent.parent.parent
CONVERTER = ROOT / "tests" / "gpu" / "scenario_fixture.py"
HOME = "/home/ci/gpuwatchd"


def scenario_dir(tmp: Path, control: bool) -> Path:
    out = tmp / "run" / "scen"
    src = out / "dead_peer"
    (src / "fr").mkdir(parents=True)
    trace = Trace()
    doc = dict(trace.doc)
    cmd = (
        f"/home/ci/venv/bin/python3 {HOME}/tests/gpu/nccl_jobs.py dead_peer --dir {src}"
        " --seconds 45.0 --warm 8.0 --scratch /tmp/gpuscen-ckpt"
    )
    doc["commands"] = [cmd, cmd]
    doc["environ"] = {
        str(r): {
            "NCCL_RAS_ADDR": "127.0.0.1:28100",
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{src}/fr/pipe_",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{src}/fr/dump_",
            "TORCH_FR_DUMP_TEMP_FILE": f"{src}/fr/dump_",
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29600",
        }
        for r in (0, 1)
    }
    doc["gpus"], doc["devices"] = [2, 3], ["2", "3"]
    doc["nvml"] = [
        {
            "t": row["t"],
            "gpus": [{**g, "gpu": str(int(g["gpu"]) + 2)} for g in row["gpus"]],
            "pids": {str(int(k) + 2): v for k, v in row["pids"].items()},
        }
        for row in trace.nvml
    ]
    if control:  # the healthy half: the recording up to the kill, no hang
        kill = trace.kill
        doc["scenario"] = {**doc["scenario"], "name": "healthy_cut", "kind": "control"}
        doc["samples"] = [s for s in doc["samples"] if s["t"] < kill - 1]
        doc["ras"] = [a for a in doc["ras"] if a["t"] < kill]
        doc["hang_start"], doc["hang_what"] = None, []
    (src / "trace.json").write_text(json.dumps(doc, indent=1))
    shutil.copy(os.path.join(DIR, "fr-dump-rank0.pkl"), src / "fr" / "dump_0")
    for name in ("pyspy-1-1272.txt", "pyspy-2-1272.txt", "rank1.log"):
        shutil.copy(os.path.join(DIR, name), src / name)
    (src / "rank0.log").write_text("".join(f"step {i} {HOME}/x.py\n" for i in range(5000)))
    rows = [{"scenario": "dead_peer", "flagged": False}, {"meta": {}}]
    (out / "summary.json").write_text(json.dumps({"rows": rows}))
    return src


@pytest.mark.parametrize("control", [False, True], ids=["hang", "control"])
def test_converted_scenario_is_a_drop_in_fixture(tmp_path: Path, control: bool) -> None:
    src = scenario_dir(tmp_path, control)
    dest = tmp_path / "fixture"
    got = subprocess.run(
        [sys.executable, str(CONVERTER), str(src), str(dest), "--expect-from-summary", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert got.returncode == 0, got.stdout + got.stderr
    assert "expect.json holds" in got.stdout and "warning" not in got.stderr, got.stderr
    names = sorted(os.listdir(dest))
    assert names == [
        "PROVENANCE.md",
        "expect.json",
        "fr-dump-rank0.pkl.gz",
        "nvml.jsonl",
        "pyspy-1-1272.txt",
        "pyspy-2-1272.txt",
        "rank0.log",
        "rank1.log",
        "trace.json",
    ]
    assert sum(os.path.getsize(dest / n) for n in names) < 300_000
    for name in names:
        text = (dest / name).read_bytes()
        assert b"/home/ci" not in text and str(tmp_path).encode() not in text, name
    expect = json.loads((dest / "expect.json").read_text())
    doc = json.loads((dest / "trace.json").read_text())
    assert "nvml" not in doc and "launchers" not in doc["samples"][0]
    assert doc["commands"][0].startswith("python3 tests/gpu/nccl_jobs.py dead_peer --dir RUNDIR/")
    assert len((dest / "rank0.log").read_text().splitlines()) < 250
    trace = Trace(str(dest))
    env = trace.environ("127.0.0.1:1")
    assert env[1]["TORCH_FR_DUMP_TEMP_FILE"] != f"{src}/fr/dump_"
    assert env[0]["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == PIPE_PREFIX
    assert {g["gpu"] for g in trace.nvml[0]["gpus"]} == {"2", "3"}
    assert set(trace.flight_dumps()) == {0}
    if control:
        assert expect == {"kind": "control", "flagged": False, "note": expect["note"]}
    else:
        assert expect["kind"] == "hang" and expect["within_s"] == 30
        assert expect["severity"] == "critical" and expect["conditions_any"] == ["rank_dead"]
