"""The daemon end to end: a process on a (replayed) GPU with a torch-style environment is a
workload in /status and /metrics, and an Xid naming its pid carries its rank in /events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from tests.e2e.faults import wait_until

CAPTURE = FIXTURES / "nvml" / "h200x2-probe.json"  # GPU 0 at 0000:00:06.0


@pytest.fixture
def rank5() -> Iterator[subprocess.Popen[bytes]]:
    env = dict(os.environ, RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", API_KEY="never-shown")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    yield proc
    proc.kill()
    proc.wait(5)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    proc.stdout.close()


def test_workload_in_status_metrics_and_xid_event(start_daemon, tmp_path, rank5) -> None:
    capture = json.loads(CAPTURE.read_text())
    capture["devices"][0]["calls"]["compute_running_processes"] = [
        {"value": [{"pid": rank5.pid, "used_memory": 2 << 30}], "us": 20.0}
    ]
    replay = tmp_path / "with-process.json"
    replay.write_text(json.dumps(capture))
    kern = tmp_path / "kern.log"
    kern.write_text("")
    cfg = (
        "sources:\n  nvml:\n    interval: 0.5\n"
        f"  kmsg: {{backend: file, file: {kern}}}\n"
        "  udev:\n    enabled: false\n  shm:\n    enabled: false\n"
        "  infiniband:\n    enabled: false\n"
    )
    d = start_daemon(cfg, "--nvml-replay", str(replay))

    def workloads() -> list[dict[str, object]]:
        status = json.loads(d.get("/status")[1])
        found = status["sources"].get("workloads", {}).get("workloads", [])
        return [w for w in found if w.get("id") == str(rank5.pid)]

    found = wait_until(workloads, 20.0)
    assert len(found) == 1, d.output()[-3000:]
    w = found[0]
    [p] = w["processes"]  # type: ignore[index]
    assert (p["pid"], p["gpu"], p["rank"], p["local_rank"]) == (rank5.pid, "0", "5", "1")
    assert w["world_size"] == "8"
    metrics = d.get("/metrics")[1].decode()
    assert 'gpuwatchd_gpu_workload_info{container="",gpu="0"' in metrics

    # the driver names the task by its comm; another name would mean the pid was reused
    comm = Path(f"/proc/{rank5.pid}/comm").read_text().strip()
    with open(kern, "a") as f:
        f.write(
            f"NVRM: Xid (PCI:0000:00:06): 31, pid={rank5.pid}, name={comm}, channel 0x0000000a,"
            " intr 00000000. MMU Fault: ENGINE GRAPHICS GPC0 GPCCLIENT_T1_6 faulted @"
            " 0x7f_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE\n"
        )

    def event() -> list[dict[str, object]]:
        return json.loads(d.get("/events?code=31")[1])["events"]

    events = wait_until(event, 20.0)
    assert len(events) == 1, d.output()[-3000:]
    ev = events[0]
    attrs = ev["attrs"]
    assert attrs["pid"] == str(rank5.pid) and attrs["rank"] == "5"  # type: ignore[index]
    assert attrs["workload"] == "process" and attrs["world_size"] == "8"  # type: ignore[index]
    log = d.output()
    assert "never-shown" not in log and "never-shown" not in json.dumps(ev)
    assert "never-shown" not in d.get("/status")[1].decode()
