"""Cost of the workloads source per poll on a full 8-GPU node.

8 GPUs with 8 processes each (64 pids, one pod per GPU in the cgroup, a
torch.distributed environment each) under a temporary /proc tree, and a
real kubelet pod-resources v1 gRPC server on a unix socket (grpcio server,
generated servicer) answering List with one pod per GPU. Measures the
first poll (reads every pid's cgroup, environ and comm) and the steady
polls after each NVML poll (one List call, cached per-pid facts), and a
poll that finds no new NVML poll (the last answer), with the same source
the daemon runs. Slurm is off (its lookups are cached per job and bounded by a timeout).

    .venv/bin/python benchmarks/bench_workloads.py [--polls 300] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from benchmarks.report import publish  # noqa: E402
from gpuwatchd.sources.workloads.podresources import PodResourcesClient  # noqa: E402
from gpuwatchd.sources.workloads.proto import api_pb2, api_pb2_grpc  # noqa: E402
from gpuwatchd.sources.workloads.slurm import SlurmJobs  # noqa: E402
from gpuwatchd.sources.workloads.source import WorkloadSource  # noqa: E402

GPUS, PER_GPU = 8, 8


class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def List(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC method name)
        return self.answer


def node(root: Path) -> tuple[dict[str, Any], Any]:
    """The /proc tree, the NVML per-GPU status and the kubelet's List answer."""
    status: dict[str, Any] = {}
    pods = []
    pid = 10_000
    for g in range(GPUS):
        uid = f"0f2d8c9e-1a2b-4c3d-8e9f-0a1b2c3d4e{g:02x}"
        procs = []
        for r in range(PER_GPU):
            d = root / str(pid)
            d.mkdir(parents=True)
            (d / "cgroup").write_text(f"0::/kubepods/pod{uid}/{'a' * 64}\n")
            env = f"PATH=/usr/bin\0RANK={g * PER_GPU + r}\0WORLD_SIZE={GPUS * PER_GPU}\0"
            (d / "environ").write_bytes(env.encode())
            (d / "comm").write_text("python3\n")
            procs.append({"pid": pid, "used_memory": 1 << 30})
            pid += 1
        uuid = f"GPU-00000000-0000-4000-8000-0000000000{g:02x}"
        status[f"0000:{0x18 + g:02x}:00.0"] = {"gpu": g, "uuid": uuid, "processes": procs}
        device = api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[uuid])
        container = api_pb2.ContainerResources(name="trainer", devices=[device])
        pods.append(api_pb2.PodResources(name=f"train-{g}", namespace="ml", containers=[container]))
    return status, api_pb2.ListPodResourcesResponse(pod_resources=pods)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--polls", type=int, default=300)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-workloads-"))
    status, answer = node(tmp / "proc")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(Kubelet(answer), server)
    sock = tmp / "kubelet.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        src = WorkloadSource(
            lambda: dict(status),  # a new object: as after every NVML poll
            procfs=str(tmp / "proc"),
            kubelet=PodResourcesClient(str(sock)),
            slurm=SlurmJobs(which=lambda name: None),
        )
        t0 = time.perf_counter()
        src.poll(0.0)
        first = time.perf_counter() - t0
        assert len(src.workloads()) == GPUS and all(w.pod for w in src.workloads())
        times = []
        cpu0 = time.process_time()
        for i in range(args.polls):
            t = time.perf_counter()
            src.poll(float(i + 1))
            times.append(time.perf_counter() - t)
        cpu = (time.process_time() - cpu0) / args.polls
        src.close()
        # a poll that finds no new NVML poll since the last one
        same = dict(status)
        idle_src = WorkloadSource(lambda: same, procfs=str(tmp / "proc"))
        idle_src.poll(0.0)
        t = time.perf_counter()
        for i in range(args.polls):
            idle_src.poll(float(i + 1))
        idle = (time.perf_counter() - t) / args.polls
    finally:
        server.stop(None)
    times.sort()
    fig = {
        "gpus": GPUS,
        "processes": GPUS * PER_GPU,
        "first_poll_ms": round(first * 1000, 2),
        "poll_p50_ms": round(statistics.median(times) * 1000, 2),
        "poll_p99_ms": round(times[int(len(times) * 0.99) - 1] * 1000, 2),
        "cpu_per_poll_ms": round(cpu * 1000, 2),
        "idle_poll_us": round(idle * 1e6, 1),
        "share_of_one_core_at_10s": f"{cpu / 10 * 100:.3f} %",
    }
    rows = [
        f"| first poll (64 pids: cgroup, environ, comm) | {fig['first_poll_ms']} ms |",
        f"| steady poll, p50 / p99 (one kubelet List) | {fig['poll_p50_ms']} / "
        f"{fig['poll_p99_ms']} ms |",
        f"| CPU per steady poll (all threads of this process) | {fig['cpu_per_poll_ms']} ms |",
        f"| poll that finds no new NVML poll (the last answer) | {fig['idle_poll_us']} us |",
        f"| share of one core at the 10 s interval | {fig['share_of_one_core_at_10s']} |",
    ]
    publish(
        fig,
        "Workloads source: 8 GPUs x 8 processes, real kubelet gRPC on a unix socket",
        rows,
        "" if args.no_write else "workloads",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
