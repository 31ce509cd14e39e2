"""A rank killed by the OOM killer of its memory cgroup, end to end: a real daemon (NVML
replay listing two real rank processes, the kernel log source on a file), a real
Alertmanager. Rank 1 is SIGKILLed and the kernel's two lines of a memory-cgroup OOM kill
(real ones, tests/fixtures/kmsg/oom-kill-memcg.txt, with the rank's pid) are appended to
the kernel log. The JobHangSuspected alert names the cause in its `cause` annotation and
description, and /hangs?id=N holds it typed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.cause_faults import KILL_CONTEXT, KILL_LINES, kernel_line
from tests.e2e.faults import Drill
from tests.servers import AlertmanagerServer

RANK = """
import os, sys, time
flag, fd, buf = sys.argv[1], os.open(os.devnull, os.O_WRONLY), b"x" * 131072
while not os.path.exists(flag):
    os.write(fd, buf)  # I/O the probe sees: the rank makes progress
    time.sleep(0.05)
time.sleep(600)  # the job hangs: the rank waits, no CPU, no I/O
"""
JOB = {"MASTER_ADDR": "10.9.9.8", "MASTER_PORT": "29998", "WORLD_SIZE": "2"}
HANGS = (
    "hangs:\n  probe_interval_seconds: 0.5\n  dead_peer_after_seconds: 2\n"
    "  decide_after_seconds: 5\n  ras: false\n"
)


def oom_lines(pid: int) -> str:
    out = []
    for kind in ("oom_kill",):
        name, index, pattern = KILL_CONTEXT[kind]
        out.append(re.sub(pattern, str(pid), kernel_line(name, index)))
        name, index, pattern = KILL_LINES[kind]
        out.append(re.sub(pattern, str(pid), kernel_line(name, index)))
    return "\n".join(out) + "\n"


def test_a_rank_killed_by_the_oom_killer_is_named_in_the_hang_alert(
    tmp_path: Path, alertmanager: AlertmanagerServer
) -> None:
    am = alertmanager
    flag = tmp_path / "hang"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(flag)],
            env={
                **os.environ,
                **JOB,
                "RANK": str(i),
                "LOCAL_RANK": str(i),
                "LOCAL_WORLD_SIZE": "2",
            },
        )
        for i in (0, 1)
    ]
    script = [
        {"device": i, "call": "compute_running_processes", "value": [{"pid": p.pid}]}
        for i, p in enumerate(ranks)
    ]
    drill = Drill(tmp_path, am.url, node="oom-node", script=script, extra_config=HANGS)
    try:
        drill.start()
        time.sleep(2.0)  # the daemon sees the job at work
        flag.touch()
        victim = ranks[1]
        victim.send_signal(signal.SIGKILL)  # what the OOM killer does ...
        victim.wait()
        with open(drill.kernel_log, "a") as f:  # ... and what it logs
            f.write(oom_lines(victim.pid))
        alert: dict[str, object] = {}
        end = time.monotonic() + 40
        while time.monotonic() < end:
            got = am.alerts(alertname="JobHangSuspected", node="oom-node")
            cause = str(got[0]["annotations"].get("cause", "")) if got else ""  # type: ignore[union-attr]
            if "OOM killer" in cause:
                alert = got[0]
                break
            time.sleep(0.5)
        assert alert, drill.daemon.output() if drill.daemon else ""
        ann = alert["annotations"]
        assert isinstance(ann, dict)
        want = f"rank 1 (pid {victim.pid}) killed by the OOM killer (memory cgroup /lxc.payload"
        assert ann["cause"].startswith(want), ann["cause"]
        assert "kubepods-burstable-pod" in ann["cause"] and "before the job stopped" in ann["cause"]
        assert f"Cause: {want}" in ann["description"]
        status, body = drill.get("/hangs")
        assert status == 200
        (doc,) = json.loads(body)["hangs"]
        cause = doc["causes"]["cause"]
        assert (cause["kind"], cause["rank"], cause["pid"]) == ("oom_kill", 1, victim.pid)
        assert cause["affinity"] == "pid" and cause["offset_seconds"] < 5
    finally:
        if drill.daemon is not None:
            drill.daemon.stop()
        for p in ranks:
            p.kill()
            p.wait()
