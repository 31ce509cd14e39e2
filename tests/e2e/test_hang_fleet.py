"""One hung job spread over three simulated nodes: three real daemons (NVML replay listing
real rank processes), the shipped Alertmanager routing, one notification per job.

Each node runs two ranks of a 6-rank torch job (real processes with the launcher's
variables; they write to /dev/null, which /proc/PID/io counts, until the job "hangs").
At the hang every rank stops and node-b's rank 3 is SIGKILLed. node-b's daemon sees
its rank die (role=culprit); node-a and node-c see their ranks stall (role=stalled).
Alertmanager, with deploy/alertmanager/alertmanager.yml as shipped, puts the three
alerts in one group by job_id and notifies the pager once, naming node-b.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_alertmanager_config import CONFIG, Webhook
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
JOB = {"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29999", "WORLD_SIZE": "6"}
HANGS = (
    "hangs:\n  probe_interval_seconds: 0.5\n  dead_peer_after_seconds: 2\n"
    "  decide_after_seconds: 5\n  ras: false\n"
)


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[tuple[AlertmanagerServer, Webhook]]:
    hook = Webhook()
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["route"]["group_wait"] = "8s"  # long enough for all three nodes; the tree as shipped
    for receiver in cfg["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = f"{hook.url}/{receiver['name']}"
    server = AlertmanagerServer(tmp_path / "am")
    server.config.write_text(yaml.safe_dump(cfg))
    server.start()
    try:
        yield server, hook
    finally:
        server.stop()
        hook.server.shutdown()
        hook.server.server_close()


def test_a_job_hung_across_three_nodes_is_one_notification_naming_the_culprit(
    tmp_path: Path, routed: tuple[AlertmanagerServer, Webhook]
) -> None:
    server, hook = routed
    flag = tmp_path / "hang"
    ranks: dict[str, list[subprocess.Popen[bytes]]] = {}
    drills: list[Drill] = []
    try:
        for n, node in enumerate(("node-a", "node-b", "node-c")):
            ranks[node] = [
                subprocess.Popen(
                    [sys.executable, "-c", RANK, str(flag)],
                    env={
                        **os.environ,
                        **JOB,
                        "RANK": str(2 * n + i),
                        "LOCAL_RANK": str(i),
                        "LOCAL_WORLD_SIZE": "2",
                    },
                )
                for i in (0, 1)
            ]
            script = [
                {
                    "device": i,
                    "call": "compute_running_processes",
                    "value": [{"pid": p.pid, "used_memory": 1 << 30}],
                }
                for i, p in enumerate(ranks[node])
            ]
            d = tmp_path / node
            d.mkdir()
            drills.append(Drill(d, server.url, node=node, script=script, extra_config=HANGS))
        for drill in drills:  # all three start at once
            drill.start(ready=False)
        for drill in drills:
            assert drill.daemon is not None
            drill.daemon.notify.wait_for("READY=1", timeout=60)
        time.sleep(2.0)  # the daemons see the job at work
        flag.touch()  # every rank stops ...
        ranks["node-b"][1].send_signal(signal.SIGKILL)  # ... for rank 3 on node-b died
        ranks["node-b"][1].wait()
        end = time.monotonic() + 40
        while time.monotonic() < end and len(server.alerts(alertname="JobHangSuspected")) < 3:
            time.sleep(0.5)
        alerts = server.alerts(alertname="JobHangSuspected")
        assert len(alerts) == 3, [d.daemon.output() if d.daemon else "" for d in drills]
        labels = {a["labels"]["node"]: a["labels"] for a in alerts}  # type: ignore[index]
        assert {lab["job_id"] for lab in labels.values()} == {"torch:10.9.9.9:29999"}
        assert labels["node-b"]["role"] == "culprit"
        assert labels["node-b"]["severity"] == "critical"
        assert {labels["node-a"]["role"], labels["node-c"]["role"]} == {"stalled"}
        end = time.monotonic() + 30
        while time.monotonic() < end and not hook.to("pager"):
            time.sleep(0.5)
        time.sleep(1.0)  # nothing else may arrive
        (note,) = hook.to("pager")  # one notification for the job, not one per node
        assert note["groupLabels"] == {"alertname": "JobHangSuspected", "job_id": JOB_ID}
        culprits = [
            a["labels"]["node"]  # type: ignore[index]
            for a in note["alerts"]  # type: ignore[union-attr]
            if a["labels"]["role"] == "culprit"  # type: ignore[index]
        ]
        assert culprits == ["node-b"]
        print(json.dumps({"notification_alerts": len(note["alerts"])}))  # type: ignore[arg-type]
    finally:
        for drill in drills:
            if drill.daemon is not None:
                drill.daemon.stop()
        for procs in ranks.values():
            for p in procs:
                p.kill()
                p.wait()


JOB_ID = "torch:10.9.9.9:29999"
