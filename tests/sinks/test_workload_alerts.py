"""An Xid on a GPU held by a pod, and one on a GPU held by a Slurm job, fire alerts whose
labels name that pod or job: real kubelet pod-resources gRPC server, real slurmctld, real
Alertmanager, the daemon's kernel log source, Xid stage and rules in between."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock, SystemClock
from gpuwatchd.config import AlertmanagerConfig, Config
from gpuwatchd.health import rules
from gpuwatchd.health.history import History, View
from gpuwatchd.health.xid.stage import xid_condition
from gpuwatchd.model import Gpu, GpuInventory, GpuProcess
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sources.workloads.podresources import PodResourcesClient
from gpuwatchd.sources.workloads.slurm import SlurmJobs
from tests.health.test_xid_workloads import Node
from tests.servers import AlertmanagerServer, alertmanager_server
from tests.slurm_cluster import SlurmCluster, slurm_cluster
from tests.workload_servers import PodResourcesServer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "workloads" / "pod-resources-list.json"
POD_GPU = "GPU-8a47641b-dff6-f09f-618c-c3eb58fb430d"  # llama-train-0 in the fixture
JOB_GPU = "GPU-1c0e2d4f-5a6b-7c8d-9e0f-a1b2c3d4e5f6"
POD_UID = "0f2d8c9e-1a2b-4c3d-8e9f-0a1b2c3d4e5f"
T0 = 1_700_000_000.0


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


def test_alerts_name_the_pod_and_the_slurm_job(
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
        "3,2,1000001000,-;NVRM: Xid (PCI:0000:42:00): 79, pid=601, name=python3,"
        " GPU has fallen off the bus.\n"
    )
    clock = FakeClock(start=T0)
    node = Node(
        tmp_path,
        clock,
        index,
        kubelet=PodResourcesClient(str(kubelet.socket_path)),
        slurm=SlurmJobs(timeout=10.0, env=slurm.env),
    )
    try:
        node.runner.poll_once("workloads")
        node.runner.poll_once("kmsg")
        conds = tuple(xid_condition(a) for a in node.stage.active())
        inp = rules.Inputs(View(node.state.snapshot()), History(60), node.cfg, T0, conds)
        findings = rules.xid(inp)
        cfg = dataclasses.replace(Config(), alertmanager=AlertmanagerConfig(urls=[am.url]))
        sink = AlertSink(cfg, str(tmp_path / "alerts.db"), SystemClock(), "workload-node")
        sink.update(findings)
        assert sink.flush()
        alerts = {a["labels"].get("pci_bus_id"): a for a in am.alerts(node="workload-node")}
        pod_alert, job_alert = alerts["0000:41:00.0"], alerts["0000:42:00.0"]
        assert pod_alert["labels"]["namespace"] == "ml-team"
        assert pod_alert["labels"]["pod"] == "llama-train-0"
        assert "slurm_job" not in pod_alert["labels"] and "rank" not in pod_alert["labels"]
        assert pod_alert["annotations"]["container"] == "trainer"
        assert pod_alert["annotations"]["rank"] == "7"
        assert job_alert["labels"]["slurm_job"] == job
        assert job_alert["annotations"]["slurm_job_name"] == "resnet-ddp"
        assert job_alert["annotations"]["slurm_user"] == "root"
        assert job_alert["annotations"]["rank"] == "1"
        sink.stop()
    finally:
        node.stop()
        kubelet.stop()
        slurm.run(["scancel", job], check=False)
