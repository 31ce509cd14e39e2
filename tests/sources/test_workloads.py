"""Workloads: the kubelet pod-resources client against a real gRPC server on a unix socket,
Slurm lookups against a real slurmctld on loopback, ranks from a real process's environ,
and the source putting them together per GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.errors import SourceError
from gpuwatchd.model import Gpu, GpuInventory, GpuProcess
from gpuwatchd.sources.workloads.environ import parse_environ, read_torch_env
from gpuwatchd.sources.workloads.podresources import PodResourcesClient, device_key
from gpuwatchd.sources.workloads.slurm import SlurmJobs, parse_jobs
from gpuwatchd.sources.workloads.source import (
    WorkloadSource,
    workloads_from_status,
    workloads_on_gpus,
)
from tests.slurm_cluster import SlurmCluster, slurm_cluster
from tests.workload_servers import PodResourcesServer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "workloads" / "pod-resources-list.json"
GPU0 = "GPU-8a47641b-dff6-f09f-618c-c3eb58fb430d"
GPU1 = "GPU-4e391288-897c-ba5d-6944-dfbea55ebcfa"
SHARED = "GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6"
MIG = "MIG-0b9f2a54-3c1e-5d6f-8a7b-9c0d1e2f3a4b"
POD_UID = "0f2d8c9e-1a2b-4c3d-8e9f-0a1b2c3d4e5f"
TORCH_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "16",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "run-42",
    "HF_TOKEN": "hf_secret_do_not_export",
}


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[PodResourcesServer]:
    server = PodResourcesServer(tmp_path / "kubelet.sock", FIXTURE).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from slurm_cluster(tmp_path_factory)


@pytest.fixture
def torch_process() -> Iterator[subprocess.Popen[bytes]]:
    """A real process started with a torch.distributed-style environment (and a secret)."""
    env = dict(os.environ, **TORCH_ENV)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    # execve() closes the pipe Popen waits on before the new environ is in place
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    yield proc
    proc.kill()
    proc.wait(5)
    assert proc.stdin is not None
    proc.stdin.close()
    proc.stdout.close()


# --- ranks ----------------------------------------------------------------------------


def test_rank_environment_of_a_real_process_and_nothing_else(
    torch_process: subprocess.Popen[bytes],
) -> None:
    got = read_torch_env("/proc", torch_process.pid)
    assert got == {
        "rank": "3",
        "local_rank": "1",
        "world_size": "16",
        "master_addr": "10.0.0.1",
        "master_port": "29500",
        "torchelastic_run_id": "run-42",
    }
    assert "hf_secret_do_not_export" not in repr(got)


def test_environ_parse_drops_other_names_and_unprintable_values() -> None:
    assert parse_environ(b"RANK=0\0PASSWORD=x\0WORLD_SIZE=2\x1b[2J\0garbage\0") == {"rank": "0"}
    assert read_torch_env("/proc", 2**22 + 7) == {}  # no such pid: nothing, no error


# --- kubelet pod-resources ------------------------------------------------------------


def test_list_maps_gpu_uuids_to_pods(kubelet: PodResourcesServer) -> None:
    client = PodResourcesClient(str(kubelet.socket_path), timeout=2.0)
    assert client.available()
    devices = client.list_pods()
    (train,) = devices[GPU0]
    assert (train.namespace, train.pod, train.container) == ("ml-team", "llama-train-0", "trainer")
    assert devices[GPU1][0].pod == "llama-train-0"
    assert sorted(d.pod for d in devices[SHARED]) == ["notebook-a", "notebook-b"]  # time-sliced
    assert devices[MIG][0].resource == "nvidia.com/mig-1g.10gb"
    assert devices["mlx5_0"][0].resource == "rdma/ib"
    assert kubelet.calls == {"List": 1}
    client.close()


def test_get_one_pod(kubelet: PodResourcesServer) -> None:
    client = PodResourcesClient(str(kubelet.socket_path))
    assert set(client.get_pod("serving", "infer-7f9c")) == {MIG}
    with pytest.raises(SourceError, match="NOT_FOUND"):
        client.get_pod("serving", "gone")
    client.close()


def test_slow_kubelet_hits_the_deadline(kubelet: PodResourcesServer) -> None:
    kubelet.delay = 1.0
    client = PodResourcesClient(str(kubelet.socket_path), timeout=0.2)
    with pytest.raises(SourceError, match="DEADLINE_EXCEEDED"):
        client.list_pods()
    client.close()


def test_absent_or_dead_socket(tmp_path: Path) -> None:
    assert not PodResourcesClient(str(tmp_path / "none.sock")).available()
    (tmp_path / "dead.sock").write_text("")  # exists, nobody listening
    client = PodResourcesClient(str(tmp_path / "dead.sock"), timeout=0.5)
    with pytest.raises(SourceError, match="UNAVAILABLE|DEADLINE"):
        client.list_pods()


def test_device_key_strips_time_slicing_suffix() -> None:
    assert device_key(f"{SHARED}::3") == SHARED
    assert device_key(MIG) == MIG


# --- Slurm ----------------------------------------------------------------------------


def test_slurm_job_name_and_user_from_a_real_slurmctld(slurm: SlurmCluster) -> None:
    job = slurm.submit("sleep 60", name="llama-pretrain")
    slurm.wait_state(job, "RUNNING")
    jobs = SlurmJobs(timeout=10.0, env=slurm.env)
    found = jobs.lookup(job, now=0.0)
    assert found is not None
    assert (found.job_id, found.name, found.user, found.partition) == (
        job,
        "llama-pretrain",
        "root",
        "debug",
    )
    assert jobs.errors == {}  # scontrol without --json (before 23.02) is no error: squeue answers
    calls = jobs.calls
    assert jobs.lookup(job, now=1.0) == found and jobs.calls == calls  # cached per job
    assert jobs.lookup("999999", now=2.0) is None
    calls = jobs.calls
    assert jobs.lookup("999999", now=3.0) is None and jobs.calls == calls  # not asked again soon
    slurm.run(["scancel", job])


def test_slurm_absent_means_none_quickly() -> None:
    jobs = SlurmJobs(which=lambda name: None)
    assert not jobs.available()
    assert jobs.lookup("12", now=0.0) is None
    assert jobs.errors == {"absent": 1}


def test_parse_jobs_both_state_shapes() -> None:
    new = '{"jobs": [{"job_id": 7, "name": "a", "user_name": "u", "job_state": ["RUNNING"]}]}'
    old = '{"jobs": [{"job_id": 7, "name": "a", "user_name": "u", "job_state": "RUNNING"}]}'
    assert parse_jobs(new, "7") == parse_jobs(old, "7")
    assert parse_jobs(new, "8") is None and parse_jobs("not json", "7") is None


# --- the source -----------------------------------------------------------------------


def fake_proc(root: Path, pid: int, cgroup: str, env: dict[str, str], comm: str) -> None:
    """A /proc/PID as the source reads it: cgroup, environ, comm."""
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    (d / "comm").write_text(comm + "\n")


def gpu(index: int, uuid: str, procs: list[tuple[int, int]], **more: Any) -> Gpu:
    found = tuple(GpuProcess(pid=p, used_memory_bytes=m) for p, m in procs)
    return Gpu(index=index, uuid=uuid, processes=found, **more)


def inventory(by_bus: dict[str, Gpu]) -> GpuInventory:
    """What the NVML source publishes: its GPUs, by bus id (a new object per poll)."""
    return GpuInventory(tuple(replace(g, pci_bus_id=bus) for bus, g in by_bus.items()))


def test_source_names_pod_slurm_job_and_ranks(
    tmp_path: Path, kubelet: PodResourcesServer, slurm: SlurmCluster
) -> None:
    job = slurm.submit("sleep 60", name="bert-finetune")
    slurm.wait_state(job, "RUNNING")
    procfs = tmp_path / "proc"
    pod_slice = f"kubepods-pod{POD_UID.replace('-', '_')}.slice"
    pod_cg = f"0::/kubepods.slice/{pod_slice}/cri-containerd-{'a' * 64}.scope\n"
    fake_proc(procfs, 101, pod_cg, {"RANK": "0", "WORLD_SIZE": "2"}, "python3")
    fake_proc(procfs, 102, pod_cg, {"RANK": "1", "WORLD_SIZE": "2", "SECRET": "x"}, "python3")
    slurm_cg = f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n"
    fake_proc(procfs, 201, slurm_cg, {"SLURM_PROCID": "0", "RANK": "0"}, "train.py")
    fake_proc(procfs, 301, "0::/user.slice/user-1000.slice/session-1.scope\n", {}, "glxgears")
    index = {
        "0000:01:00.0": gpu(0, GPU0, [(101, 1 << 30)]),
        "0000:02:00.0": gpu(1, GPU1, [(102, 2 << 30)]),
        "0000:03:00.0": gpu(2, "GPU-3", [(201, 3 << 30), (301, 1 << 20)]),
    }
    nvml = [inventory(index)]  # what the NVML source published last; a new object per poll
    src = WorkloadSource(
        lambda: nvml[-1],
        procfs=str(procfs),
        kubelet=PodResourcesClient(str(kubelet.socket_path)),
        slurm=SlurmJobs(timeout=10.0, env=slurm.env),
    )
    samples = src.poll(0.0)
    by_kind = {w.kind: w for w in src.workloads()}
    pod = by_kind["k8s"]
    assert (pod.namespace, pod.pod, pod.container, pod.pod_uid) == (
        "ml-team",
        "llama-train-0",
        "trainer",
        POD_UID,
    )
    assert [(p.pid, p.gpu, p.rank) for p in pod.processes] == [(101, "0", "0"), (102, "1", "1")]
    assert pod.world_size == "2" and set(pod.gpus) == {GPU0, GPU1}
    job_w = by_kind["slurm"]
    assert (job_w.slurm_job, job_w.slurm_job_name, job_w.slurm_user) == (
        job,
        "bert-finetune",
        "root",
    )
    assert by_kind["process"].id == "301" and by_kind["process"].processes[0].name == "glxgears"
    info = sorted(
        (s.label("gpu"), s.label("pod"), s.label("slurm_job"))
        for s in samples
        if s.name == "gpuwatchd_gpu_workload_info"
    )
    assert info == [
        ("0", "llama-train-0", ""),
        ("1", "llama-train-0", ""),
        ("2", "", ""),
        ("2", "", job),
    ]
    # /status round-trips to the same workloads; no environment value but the rank names
    status = src.status()
    assert workloads_from_status(status) == list(src.workloads())
    assert "SECRET" not in repr(status) and status["kubelet"] == "ok"
    held = workloads_on_gpus(src.workloads(), [GPU1])
    assert [w["pod"] for w in held] == ["llama-train-0"]
    assert [
        w["slurm_job"]
        for w in workloads_on_gpus(src.workloads(), ["0000:03:00.0"])
        if "slurm_job" in w
    ] == [job]
    assert kubelet.calls == {"List": 1}
    assert src.poll(1.0) == samples and kubelet.calls == {"List": 1}  # no new NVML poll yet
    # an exited process stays attributable for a while
    nvml.append(inventory({**index, "0000:02:00.0": gpu(1, GPU1, [])}))
    src.poll(10.0)
    assert kubelet.calls == {"List": 2}  # one List per NVML poll
    exited = workloads_from_status(src.status())[-1]
    assert src.payload().exited[-1] == exited
    assert exited.pod == "llama-train-0" and exited.processes[0].pid == 102
    slurm.run(["scancel", job])


def test_source_without_kubelet_or_slurm_keeps_the_cgroup_ids(tmp_path: Path) -> None:
    procfs = tmp_path / "proc"
    pod_cg = f"0::/kubepods/besteffort/pod{POD_UID}/{'b' * 64}\n"
    fake_proc(procfs, 11, pod_cg, {}, "python3")
    fake_proc(procfs, 12, "0::/slurm/uid_1000/job_77/step_batch/task_0\n", {}, "a.out")
    index = {"0000:01:00.0": gpu(0, GPU0, [(11, 1), (12, 2)])}
    src = WorkloadSource(
        lambda: inventory(index),
        procfs=str(procfs),
        kubelet=PodResourcesClient(str(tmp_path / "absent.sock")),
        slurm=SlurmJobs(which=lambda name: None),
    )
    src.poll(0.0)
    ws = {w.kind: w for w in src.workloads()}
    assert ws["k8s"].id == POD_UID and ws["k8s"].pod == ""
    assert ws["slurm"].slurm_job == "77" and ws["slurm"].slurm_step == "batch"
    assert src.status()["kubelet"] == "absent"


def test_a_pod_on_a_mig_device_is_matched_by_the_mig_uuid(
    tmp_path: Path, kubelet: PodResourcesServer
) -> None:
    procfs = tmp_path / "proc"
    fake_proc(procfs, 701, f"0::/kubepods/pod{POD_UID}/{'d' * 64}\n", {}, "tritonserver")
    parent = "GPU-7e1a0c3b-0000-4000-8000-000000000001"
    on_mig = GpuProcess(pid=701, used_memory_bytes=5 << 30, mig_uuid=MIG)
    index = {"0000:05:00.0": Gpu(index=4, uuid=parent, mig=(MIG,), processes=(on_mig,))}
    src = WorkloadSource(
        lambda: inventory(index),
        procfs=str(procfs),
        kubelet=PodResourcesClient(str(kubelet.socket_path)),
    )
    samples = src.poll(0.0)
    (w,) = src.workloads()
    assert (w.namespace, w.pod, w.container) == ("serving", "infer-7f9c", "triton")
    assert w.gpus == (MIG,) and w.processes[0].uuid == MIG
    (info,) = [s for s in samples if s.name == "gpuwatchd_gpu_workload_info"]
    assert (info.label("gpu"), info.label("uuid"), info.label("pod")) == ("4", parent, "infer-7f9c")


def test_a_poll_asks_slurm_about_few_new_jobs(tmp_path: Path) -> None:
    """A hung or broken slurmctld cannot stretch one poll: 4 new jobs asked per poll at most."""
    procfs = tmp_path / "proc"
    for i in range(6):
        fake_proc(procfs, 400 + i, f"0::/slurm/uid_0/job_{900 + i}/step_0\n", {}, "a.out")
    index = {"0000:01:00.0": gpu(0, GPU0, [(400 + i, 1) for i in range(6)])}
    # the commands "exist" but cannot be started (empty PATH): each ask fails at once
    jobs = SlurmJobs(env={"PATH": ""}, which=lambda name: f"/nonexistent/{name}")
    src = WorkloadSource(lambda: inventory(index), procfs=str(procfs), slurm=jobs)  # a poll each
    src.poll(0.0)
    assert jobs.calls == 4
    src.poll(10.0)
    assert jobs.calls == 6  # the other 2; the failed 4 wait out their retry time
    src.poll(20.0)
    assert jobs.calls == 6
    assert jobs.errors == {"exec": 6}
    assert {w.slurm_job for w in src.workloads()} == {str(900 + i) for i in range(6)}
