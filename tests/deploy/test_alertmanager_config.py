"""deploy/alertmanager/: amtool's checks, the routing tree, and grouping and
inhibition as a real Alertmanager applies them (webhook receivers on loopback)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.servers import AlertmanagerServer

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "alertmanager" / "alertmanager.yml"


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("amtool")
    if binary is None:
        pytest.skip("amtool not installed (Debian package prometheus-alertmanager)")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=30, check=False)


def test_check_config() -> None:
    out = amtool("check-config", str(CONFIG))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.parametrize(
    ("labels", "receivers"),
    [
        (["alertname=GpuXidCritical", "severity=critical", "node=n1", "gpu=3"], "pager,team"),
        (["alertname=GpuLost", "severity=critical", "node=n1"], "pager,team"),
        (["alertname=GpuNvlinkErrors", "severity=warning", "node=n1"], "team"),
        (["alertname=GpuwatchdDown", "severity=warning", "node=n1"], "team"),
        (["alertname=Watchdog", "severity=none"], "team"),
        (["alertname=JobHangSuspected", "severity=critical", "job_id=slurm:7"], "pager,team"),
        (["alertname=JobHangSuspected", "severity=warning", "job_id=slurm:7"], "team"),
    ],
)
def test_routes(labels: list[str], receivers: str) -> None:
    out = amtool(
        "config",
        "routes",
        "test",
        f"--config.file={CONFIG}",
        f"--verify.receivers={receivers}",
        *labels,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == receivers


def test_groups_by_node_and_alertname() -> None:
    route = yaml.safe_load(CONFIG.read_text())["route"]
    assert route["group_by"] == ["node", "alertname"]


class Webhook:
    """A loopback webhook receiver that keeps every notification it gets."""

    def __init__(self) -> None:
        received: list[dict[str, object]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                received.append({"path": self.path, **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def to(self, receiver: str) -> list[dict[str, object]]:
        return [n for n in self.received if n["path"] == f"/{receiver}"]


@pytest.fixture
def shipped_alertmanager(tmp_path: Path) -> Iterator[tuple[AlertmanagerServer, Webhook]]:
    hook = Webhook()
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["route"]["group_wait"] = "1s"  # the tree and matchers stay as shipped
    for receiver in cfg["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = f"{hook.url}/{receiver['name']}"
    server = AlertmanagerServer(tmp_path)
    server.config.write_text(yaml.safe_dump(cfg))
    server.start()
    try:
        yield server, hook
    finally:
        server.stop()
        hook.server.shutdown()
        hook.server.server_close()


def _post(server: AlertmanagerServer, alerts: list[dict[str, str]]) -> None:
    now = datetime.now(UTC)
    body = [
        {
            "labels": labels,
            "startsAt": now.isoformat(),
            "endsAt": (now + timedelta(minutes=10)).isoformat(),
        }
        for labels in alerts
    ]
    req = urllib.request.Request(
        f"{server.url}/api/v2/alerts",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as resp:
        assert resp.status == 200


def _wait(cond: object, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_one_notification_per_node_incident_and_inhibition(
    shipped_alertmanager: tuple[AlertmanagerServer, Webhook],
) -> None:
    server, hook = shipped_alertmanager
    xid = [
        {
            "alertname": "GpuXidCritical",
            "severity": "critical",
            "node": "n1",
            "gpu": str(g),
            "uuid": f"GPU-{g}",
            "xid": "79",
        }
        for g in range(8)
    ]
    # n2's daemon is down: its (stale) GPU alert is muted; the GPU that fell off
    # the bus on n1 mutes its own NVML timeout.
    _post(
        server,
        [
            *xid,
            {"alertname": "GpuwatchdDown", "severity": "warning", "node": "n2"},
            {"alertname": "GpuXidCritical", "severity": "critical", "node": "n2", "gpu": "0"},
            {
                "alertname": "NvmlUnresponsive",
                "severity": "critical",
                "node": "n1",
                "gpu": "0",
                "uuid": "GPU-0",
            },
            # What follows an Xid 79: NVML loses the GPU, the count drops.
            {"alertname": "GpuLost", "severity": "critical", "node": "n1", "gpu": "0",
             "uuid": "GPU-0"},
            {"alertname": "GpuCountLow", "severity": "critical", "node": "n1"},
        ],
    )  # fmt: skip
    _wait(lambda: hook.to("pager") and hook.to("team"))
    time.sleep(1.5)  # a second group_wait: nothing else may arrive
    pager = hook.to("pager")
    assert len(pager) == 1, pager
    assert {a["labels"]["gpu"] for a in pager[0]["alerts"]} == {str(g) for g in range(8)}
    assert pager[0]["groupLabels"] == {"node": "n1", "alertname": "GpuXidCritical"}
    inhibited = server.alerts(node="n2", alertname="GpuXidCritical")
    assert inhibited[0]["status"]["state"] == "suppressed"
    assert inhibited[0]["status"]["inhibitedBy"]
    for name in ("NvmlUnresponsive", "GpuLost", "GpuCountLow"):
        assert server.alerts(node="n1", alertname=name)[0]["status"]["inhibitedBy"], name
    down = server.alerts(node="n2", alertname="GpuwatchdDown")
    assert down[0]["status"]["state"] == "active"


def test_one_notification_per_hung_job_across_nodes_naming_the_culprit(
    shipped_alertmanager: tuple[AlertmanagerServer, Webhook],
) -> None:
    server, hook = shipped_alertmanager
    job = {"alertname": "JobHangSuspected", "severity": "critical", "job_id": "slurm:4711"}
    _post(
        server,
        [
            {**job, "node": "n1", "role": "culprit", "job": "slurm:4711.0"},
            {**job, "node": "n2", "role": "waiting", "job": "slurm:4711.0"},
            {**job, "node": "n3", "role": "waiting", "job": "slurm:4711.0"},
            {**job, "job_id": "slurm:4712", "node": "n1", "role": "culprit"},
        ],
    )
    _wait(lambda: len(hook.to("pager")) >= 2)
    time.sleep(1.5)  # a second group_wait: nothing else may arrive
    pager = hook.to("pager")
    assert len(pager) == 2, pager  # one per job, not one per node
    by_job = {n["groupLabels"]["job_id"]: n for n in pager}  # type: ignore[index]
    alerts = by_job["slurm:4711"]["alerts"]
    assert {a["labels"]["node"] for a in alerts} == {"n1", "n2", "n3"}  # type: ignore[index]
    assert [a["labels"]["node"] for a in alerts if a["labels"]["role"] == "culprit"] == ["n1"]  # type: ignore[index]
