"""Bare torch jobs: the ranks of one job on this node are one workload, named as the hang
detector names the job; real processes started with a torchrun-style environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from gpuwatchd.health.xid.workload import attach_workload
from gpuwatchd.model import Event, Gpu, GpuProcess, Sample
from gpuwatchd.sources.hangs.jobs import jobs_from_workloads
from gpuwatchd.sources.workloads.cgroup import attribute
from gpuwatchd.sources.workloads.environ import TORCH_ENV, torch_job_id
from gpuwatchd.sources.workloads.source import WorkloadSource, workloads_from_status
from tests.sources.test_workloads import inventory

GPU0 = "GPU-8a47641b-dff6-f09f-618c-c3eb58fb430d"
GPU1 = "GPU-4e391288-897c-ba5d-6944-dfbea55ebcfa"
# torchrun without --rdzv-id leaves TORCHELASTIC_RUN_ID at "none": the store address names the job
RENDEZVOUS = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29633", "WORLD_SIZE": "2"}


def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A real process with `env` on top of ours (minus any torch variables we carry)."""
    base = {k: v for k, v in os.environ.items() if k not in TORCH_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**base, **env},
    )
    # execve() closes the pipe Popen waits on before the new environ is in place
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(5)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Ranks 0 and 1 of one torchrun-style job, one of another run, and a bare process."""
    if attribute("/proc", os.getpid()).status in ("kubernetes", "slurm"):
        pytest.skip("the test runs inside a pod or Slurm job: its processes are placed by that")
    envs = [
        {**RENDEZVOUS, "TORCHELASTIC_RUN_ID": "none", "RANK": "0", "LOCAL_RANK": "0"},
        {**RENDEZVOUS, "TORCHELASTIC_RUN_ID": "none", "RANK": "1", "LOCAL_RANK": "1"},
        {**RENDEZVOUS, "MASTER_PORT": "29700", "TORCHELASTIC_RUN_ID": "5c1f", "RANK": "0"},
        {},
    ]
    with ExitStack() as stack:
        procs = []
        for env in envs:
            procs.append(start(env))
            stack.callback(stop, procs[-1])
        yield procs


def gpu(index: int, uuid: str, pids: list[int]) -> Gpu:
    return Gpu(
        index=index,
        uuid=uuid,
        processes=tuple(GpuProcess(pid=p, used_memory_bytes=1) for p in pids),
    )


def test_the_ranks_of_one_torch_job_are_one_workload(
    processes: list[subprocess.Popen[bytes]],
) -> None:
    rank0, rank1, elastic, bare = (p.pid for p in processes)
    index = {
        "0000:01:00.0": gpu(0, GPU0, [rank0, elastic]),
        "0000:02:00.0": gpu(1, GPU1, [rank1, bare]),
    }
    src = WorkloadSource(lambda: inventory(index), procfs="/proc")
    samples = src.poll(0.0)
    by_id = {w.id: w for w in src.workloads()}
    assert sorted(by_id) == sorted(["torch:127.0.0.1:29633", "torchelastic:5c1f", str(bare)])
    job = by_id["torch:127.0.0.1:29633"]
    assert job.kind == "torch" and job.world_size == "2" and job.run_id == ""
    assert [(p.pid, p.gpu, p.rank, p.local_rank) for p in job.processes] == [
        (rank0, "0", "0", "0"),
        (rank1, "1", "1", "1"),
    ]
    assert job.gpus == (GPU0, GPU1)
    assert (
        by_id["torchelastic:5c1f"].kind == "torch" and by_id["torchelastic:5c1f"].run_id == "5c1f"
    )
    assert by_id[str(bare)].kind == "process"
    # one info series per GPU and workload labels (the bare process adds no second one)
    info = sorted(
        (s.label("gpu"), s.label("uuid"))
        for s in samples
        if isinstance(s, Sample) and s.name == "gpuwatchd_gpu_workload_info"
    )
    assert info == [("0", GPU0), ("1", GPU1)]
    # /status shows the job with both ranks and round-trips
    status = src.status()
    assert workloads_from_status(status) == list(src.workloads())
    shown = {w["id"]: w for w in json.loads(json.dumps(status["workloads"]))}
    assert [p["rank"] for p in shown["torch:127.0.0.1:29633"]["processes"]] == ["0", "1"]
    # the hang detector names the same jobs the same way
    hang_jobs = {j.job: j for j in jobs_from_workloads(src.workloads(), "/proc")}
    assert "torch:127.0.0.1:29633" in hang_jobs and "torchelastic:5c1f" in hang_jobs
    assert [r.rank for r in hang_jobs["torch:127.0.0.1:29633"].ranks] == [0, 1]
    # an Xid naming rank 1 carries the job's id and the rank
    xid = Event("xid", "kmsg", 1.0, 31, "0000:02:00.0", "fault", attrs=(("pid", str(rank1)),))
    attrs = dict(attach_workload(xid, src.workloads()).attrs)
    assert (attrs["workload"], attrs["workload_id"]) == ("torch", "torch:127.0.0.1:29633")
    assert (attrs["rank"], attrs["world_size"]) == ("1", "2")


def test_job_id_from_the_launcher_variables() -> None:
    assert torch_job_id("run-42", "10.0.0.1", "29500") == "torchelastic:run-42"
    assert torch_job_id("none", "10.0.0.1", "29500") == "torch:10.0.0.1:29500"
    assert torch_job_id("", "", "29500") == "torch:localhost:29500"
    assert torch_job_id("", "10.0.0.1", "") == ""  # no store port: not a job we can name
