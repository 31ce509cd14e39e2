"""Building the detector's job view from procfs files, NVML's processes and the workloads
source; and the monitor fed by a NodeSnapshot as the consumer chain hands it over."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.config.hangs import HangsConfig
from gpuwatchd.config.schema import PathsConfig
from gpuwatchd.forensics import NodeForensics
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.model import (
    Gpu,
    GpuInventory,
    GpuProcess,
    Sample,
    SourceSnapshot,
    Workload,
    WorkloadProcess,
)
from gpuwatchd.sources.hangs.jobs import (
    jobs_from_gpu_processes,
    jobs_from_workloads,
    read_cpu_seconds,
)
from gpuwatchd.state import NodeSnapshot


def proc(root: Path, pid: int, env: dict[str, str], ticks: tuple[int, int] = (100, 50)) -> None:
    d = root / str(pid)
    (d / "task" / str(pid)).mkdir(parents=True)
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (d / "cmdline").write_bytes(b"/usr/bin/python3\0train.py\0--lr\0" + b"0.1\0")
    utime, stime = ticks
    fields = ["S", *["0"] * 10, str(utime), str(stime), *["0"] * 20]
    (d / "task" / str(pid) / "stat").write_text(f"{pid} (pt_main thread) " + " ".join(fields))


def torch_env(rank: int, port: str = "29500", **extra: str) -> dict[str, str]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank)}
    env.update(LOCAL_RANK=str(rank), WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", PATH="/usr/bin")
    env.update(extra)
    return env


def test_processes_group_into_jobs_by_launcher_variables(tmp_path: Path) -> None:
    for r in range(3):
        proc(tmp_path, 100 + r, torch_env(r, NCCL_RAS_ADDR="10.0.0.1:29999" if r == 0 else ""))
    proc(tmp_path, 200, {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"})
    proc(tmp_path, 300, {"HOME": "/root"})
    gpu_pids = {"0": [100, 200], "1": [101, 300], "2": [102], "3": [102]}
    jobs = {j.job: j for j in jobs_from_gpu_processes(gpu_pids, str(tmp_path))}
    assert set(jobs) == {"torch:127.0.0.1:29500", "slurm:4711.0", "pid:300"}
    torch = jobs["torch:127.0.0.1:29500"]
    assert [r.rank for r in torch.ranks] == [0, 1, 2]
    assert torch.expected_local == 4 and torch.world_size == 4  # one rank never started
    assert torch.ranks[2].gpus == ("2", "3") and torch.gpus == ("0", "1", "2", "3")
    assert torch.ras_addr == "10.0.0.1:29999"
    assert torch.ranks[0].command == "python3 train.py --lr 0.1"
    assert torch.ranks[0].cpu_seconds == read_cpu_seconds(100, str(tmp_path)) > 0
    assert dict(jobs["slurm:4711.0"].labels) == {
        "job": "slurm:4711.0",
        "job_id": "slurm:4711",  # the same on every node of the job
        "slurm_job": "4711",
    }
    assert dict(torch.labels)["job_id"] == "torch:127.0.0.1:29500"
    assert jobs["pid:300"].expected_local is None


def test_unreadable_processes_still_count(tmp_path: Path) -> None:
    (job,) = jobs_from_gpu_processes({"0": [4242]}, str(tmp_path))  # gone or another user
    assert job.job == "pid:4242" and job.ranks[0].cpu_seconds is None


def test_jobs_from_the_workloads_source(tmp_path: Path) -> None:
    proc(tmp_path, 10, torch_env(0, LOCAL_WORLD_SIZE="2"))
    proc(tmp_path, 11, torch_env(1, LOCAL_WORLD_SIZE="2"))
    proc(tmp_path, 20, torch_env(0, port="29600"))
    proc(tmp_path, 21, torch_env(1, port="29600"))
    pod = Workload(
        "k8s",
        "ml/train-0",
        namespace="ml",
        pod="train-0",
        world_size="2",
        processes=(WorkloadProcess(10, "0", rank="0"), WorkloadProcess(11, "1", rank="1")),
    )
    bare = [
        Workload("process", str(p), processes=(WorkloadProcess(p, str(p - 18)),)) for p in (20, 21)
    ]
    jobs = {j.job: j for j in jobs_from_workloads([pod, *bare], str(tmp_path))}
    assert set(jobs) == {"k8s:ml/train-0", "torch:127.0.0.1:29600"}
    k8s = jobs["k8s:ml/train-0"]
    assert dict(k8s.labels) == {
        "job": "k8s:ml/train-0",
        "job_id": "torch:127.0.0.1:29500",  # what its pods share across nodes
        "namespace": "ml",
        "pod": "train-0",
    }
    assert [r.rank for r in k8s.ranks] == [0, 1] and k8s.expected_local == 2
    assert [r.pid for r in jobs["torch:127.0.0.1:29600"].ranks] == [20, 21]


def test_monitor_reads_nvml_samples_and_processes_from_the_snapshot(tmp_path: Path) -> None:
    proc(tmp_path, 100, torch_env(0, LOCAL_WORLD_SIZE="1", WORLD_SIZE="2"))
    cfg = dataclasses.replace(
        Config(), paths=PathsConfig(procfs=str(tmp_path)), hangs=HangsConfig(ras=False)
    )
    monitor = HangMonitor(cfg, FakeClock(), None, io=NodeForensics())
    labels = {"gpu": "0", "uuid": "GPU-a", "pci_bus_id": "0000:01:00.0"}
    for i in range(80):
        samples = (
            Sample.of("gpuwatchd_gpu_utilization_ratio", 1.0, engine="gpu", **labels),
            Sample.of("gpuwatchd_gpu_utilization_ratio", 0.0, engine="memory", **labels),
            Sample.of("gpuwatchd_gpu_power_watts", 121.0, **labels),
            Sample.of("gpuwatchd_gpu_power_limit_watts", 700.0, **labels),
            Sample.of("gpuwatchd_gpu_sm_active_ratio", 0.0076, **labels),
            Sample.of("gpuwatchd_gpu_sm_occupancy_ratio", 0.0001, **labels),
        )
        gpus = GpuInventory(
            (Gpu(index=0, pci_bus_id="0000:01:00.0", processes=(GpuProcess(pid=100),)),)
        )
        nvml = SourceSnapshot("nvml", samples, True, timestamp=1000.0 + i, payload=gpus)
        monitor.on_publish(NodeSnapshot(sources={"nvml": nvml}), nvml, ())
        monitor.on_publish(NodeSnapshot(sources={"nvml": nvml}), nvml, ())  # same poll: no-op
    monitor.run_pending()
    (f,) = monitor.findings()
    assert f.alertname == "JobHangSuspected" and "gpm" in f.reason
    assert dict(f.subject) == {"job": "torch:127.0.0.1:29500"}


def test_a_rank_still_starting_is_found_beside_its_siblings_not_called_missing() -> None:
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29571"}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(30)"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in (0, 1)
    ]
    try:
        for p in procs:  # until each has exec'd (before, /proc shows the parent's environ)
            while b"time.sleep" not in Path(f"/proc/{p.pid}/cmdline").read_bytes():
                time.sleep(0.01)
        # NVML lists rank 0 only: rank 1 has no CUDA context yet (still importing)
        (job,) = jobs_from_gpu_processes({"0": [procs[0].pid]})
        assert [(r.pid, r.rank, r.gpus) for r in job.ranks] == [
            (procs[0].pid, 0, ("0",)),
            (procs[1].pid, 1, ()),
        ]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_ranks_cpu_time_is_one_read_of_its_process_stat(tmp_path: Path) -> None:
    # The process's stat holds every thread's time, exited ones too; summing the tasks'
    # files (80 of them for a PyTorch rank) cost 7 ms per 8-rank job at every NVML poll.
    proc(tmp_path, 100, torch_env(0), ticks=(100, 50))
    for tid in range(101, 180):  # threads whose own files read far more than the total
        (tmp_path / "100" / "task" / str(tid)).mkdir()
        stat = f"{tid} (worker) S " + " ".join(["0"] * 10 + ["999", "999"] + ["0"] * 20)
        (tmp_path / "100" / "task" / str(tid) / "stat").write_text(stat)
    fields = ["S", *["0"] * 10, "300", "200", *["0"] * 20]
    (tmp_path / "100" / "stat").write_text("100 (pt_main thread) " + " ".join(fields))
    assert read_cpu_seconds(100, str(tmp_path)) == 500 / _clk_tck()
    (tmp_path / "100" / "stat").unlink()  # a recorded tree without it: the tasks' sum
    assert read_cpu_seconds(100, str(tmp_path)) == (150 + 79 * 1998) / _clk_tck()
    assert read_cpu_seconds(999, str(tmp_path)) is None


def _clk_tck() -> int:
    return os.sysconf("SC_CLK_TCK")
