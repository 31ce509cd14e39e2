"""An Xid on a GPU held by a pod, and one on a GPU held by a Slurm job, fire alerts whose
labels name that pod or job: real kubelet pod-resources gRPC server, real slurmctld, real
Alertmanager, the daemon's kernel log source, Xid stage, health engine and exposition in
between. A real Prometheus scrapes that exposition and evaluates the shipped rules into the
same Alertmanager: it must hold one alert per incident, with one set of annotations."""

from __future__ import annotations

import dataclasses
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gpuwatchd.clock import FakeClock, SystemClock
from gpuwatchd.config import AlertmanagerConfig, Config
from gpuwatchd.health.engine import HealthEngine
from gpuwatchd.model import Gpu, GpuInventory, GpuProcess
from gpuwatchd.pipeline import SourceSet
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sinks.prometheus import SnapshotCollector
from gpuwatchd.sources.workloads.podresources import PodResourcesClient
from gpuwatchd.sources.workloads.slurm import SlurmJobs
from gpuwatchd.state import State
from tests.health.test_xid_workloads import Node
from tests.servers import AlertmanagerServer, PrometheusServer, alertmanager_server
from tests.slurm_cluster import SlurmCluster, slurm_cluster
from tests.workload_servers import PodResourcesServer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "workloads" / "pod-resources-list.json"
POD_GPU = "GPU-8a47641b-dff6-f09f-618c-c3eb58fb430d"  # llama-train-0 in the fixture
JOB_GPU = "GPU-1c0e2d4f-5a6b-7c8d-9e0f-a1b2c3d4e5f6"
POD_UID = "0f2d8c9e-1a2b-4c3d-8e9f-0a1b2c3d4e5f"
T0 = 1_700_000_000.0
NODE = "workload-node"
RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "gpuwatchd-rules.yaml"


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerServer]:
    yield from alertmanager_server(tmp_path_factory)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from slurm_cluster(tmp_path_factory)


def proc(root: Path, pid: int, cgroup: str, environ: bytes) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    (d / "environ").write_bytes(environ)
    (d / "comm").write_text("python3\n")


def test_alerts_name_the_pod_and_the_slurm_job_once_per_incident(
    tmp_path: Path, am: AlertmanagerServer, slurm: SlurmCluster
) -> None:
    job = slurm.submit("sleep 60", name="resnet-ddp")
    slurm.wait_state(job, "RUNNING")
    kubelet = PodResourcesServer(tmp_path / "kubelet.sock", FIXTURE).start()
    procfs = tmp_path / "proc"
    pod_slice = f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice"
    proc(
        procfs,
        501,
        f"0::/kubepods.slice/{pod_slice}/cri-containerd-{'c' * 64}.scope\n",
        b"RANK=7\0",
    )
    proc(
        procfs,
        601,
        f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n",
        b"RANK=1\0",
    )
    index = GpuInventory(
        (
            Gpu(index=0, uuid=POD_GPU, pci_bus_id="0000:41:00.0", processes=(GpuProcess(pid=501),)),
            Gpu(index=1, uuid=JOB_GPU, pci_bus_id="0000:42:00.0", processes=(GpuProcess(pid=601),)),
        )
    )
    (tmp_path / "kmsg").write_text(
        "3,1,1000000000,-;NVRM: Xid (PCI:0000:41:00): 79, pid=501, name=python3,"
        " GPU has fallen off the bus.\n"
        "3,2,1000001000,-;NVRM: Xid (PCI:0000:42:00): 31, pid=601, name=python3,"
        " MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f00_00000000.\n"
    )
    clock = FakeClock(start=T0)
    node = Node(
        tmp_path,
        clock,
        index,
        kubelet=PodResourcesClient(str(kubelet.socket_path)),
        slurm=SlurmJobs(timeout=10.0, env=slurm.env),
    )
    cfg = dataclasses.replace(Config(), alertmanager=AlertmanagerConfig(urls=[am.url]))
    sink = AlertSink(cfg, str(tmp_path / "alerts.db"), SystemClock(), NODE)
    exposition = Exposition(node.state)
    prometheus: PrometheusServer | None = None
    try:
        node.runner.poll_once("workloads")
        node.runner.poll_once("kmsg")
        # the daemon's chain: the engine publishes its series and hands the findings on
        engine = HealthEngine(node.cfg, clock, node.state, xids=node.stage.conditions)
        findings = [
            f for f in engine.evaluate(node.state.snapshot()) if f.alertname.startswith("GpuXid")
        ]
        assert sorted(f.alertname for f in findings) == ["GpuXidCritical", "GpuXidWarning"]
        sink.update(findings)
        assert sink.flush()
        daemon = {a["labels"]["pci_bus_id"]: a for a in xid_alerts(am)}
        pod_alert, job_alert = daemon["0000:41:00.0"], daemon["0000:42:00.0"]
        assert pod_alert["labels"]["namespace"] == "ml-team"
        assert pod_alert["labels"]["pod"] == "llama-train-0"
        assert pod_alert["labels"]["incident"] == "xid-0000:41:00.0-79"
        assert "slurm_job" not in pod_alert["labels"] and "rank" not in pod_alert["labels"]
        assert "container=trainer" in pod_alert["annotations"]["description"]
        assert "rank=7" in pod_alert["annotations"]["description"]
        assert pod_alert["annotations"]["action"] == "reboot_node"
        assert job_alert["labels"]["slurm_job"] == job
        assert "slurm_job_name=resnet-ddp" in job_alert["annotations"]["description"]
        assert "slurm_user=root" in job_alert["annotations"]["description"]
        assert "rank=1" in job_alert["annotations"]["description"]

        prometheus = PrometheusServer(tmp_path / "prometheus", prometheus_config(exposition, am))
        prometheus.start()
        firing = 'ALERTS{alertname=~"GpuXid.*",alertstate="firing"}'
        # both rules fire; one evaluation may see the first before the second
        rule = prometheus.wait_for(f"count({firing}) == 2", timeout=30)
        rule = prometheus.wait_for(firing, timeout=5)
        assert len(rule) == 2, rule
        wait_sent(prometheus, 2)
        # both senders' copies of each incident: one alert, one set of annotations
        held = {a["labels"]["pci_bus_id"]: a for a in xid_alerts(am)}
        assert len(xid_alerts(am)) == 2, xid_alerts(am)
        by_rule = {a["labels"]["pci_bus_id"]: a for a in rule_alerts(prometheus)}
        for bus, alert in held.items():
            assert alert["labels"] == daemon[bus]["labels"], bus
            assert alert["annotations"] == daemon[bus]["annotations"], bus
            assert by_rule[bus]["labels"] == {
                k: v for k, v in daemon[bus]["labels"].items() if k != "node"
            } | {"node": NODE}, bus
            assert by_rule[bus]["annotations"] == daemon[bus]["annotations"], bus
        sink.stop()
    finally:
        if prometheus is not None:
            prometheus.stop()
        exposition.stop()
        node.stop()
        kubelet.stop()
        slurm.run(["scancel", job], check=False)


class Exposition:
    """The daemon's /metrics over a state, as prometheus_client renders it, on loopback."""

    def __init__(self, state: State) -> None:
        registry = CollectorRegistry()
        registry.register(SnapshotCollector(state, SourceSet.metric_specs(True)))

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def prometheus_config(exposition: Exposition, am: AlertmanagerServer) -> str:
    return f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: [{RULES}]
alerting:
  alertmanagers:
    - static_configs:
        - targets: ["{am.url.split("://", 1)[1]}"]
scrape_configs:
  - job_name: gpuwatchd
    static_configs:
      - targets: ["127.0.0.1:{exposition.port}"]
        labels: {{node: {NODE}}}
"""


def xid_alerts(am: AlertmanagerServer) -> list[dict[str, Any]]:
    return [
        a
        for a in am.alerts(node=NODE)
        if str(a["labels"].get("alertname", "")).startswith("GpuXid")  # type: ignore[union-attr]
    ]


def rule_alerts(prometheus: PrometheusServer) -> list[dict[str, Any]]:
    data = prometheus.api("alerts")["data"]
    assert isinstance(data, dict)
    return [a for a in data["alerts"] if a["labels"]["alertname"].startswith("GpuXid")]


def wait_sent(prometheus: PrometheusServer, n: int, timeout: float = 30.0) -> None:
    """Until Prometheus has handed `n` alerts to Alertmanager."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = prometheus._get("/metrics")
        sent = sum(
            float(line.rpartition(" ")[2])
            for line in body.decode().splitlines()
            if line.startswith("prometheus_notifications_sent_total")
        )
        if sent >= n:
            return
        assert time.monotonic() < deadline, f"Prometheus sent {sent} alerts, not {n}"
        time.sleep(0.25)
