"""Workloads for the hang scenarios on a real GPU (run by tests/gpu/hang_run.sh).

    python3 tests/gpu/hang_jobs.py ras1 DIR        one-rank NCCL job; phases driven by files in DIR
    python3 tests/gpu/hang_jobs.py rendezvous      rank 0 of WORLD_SIZE=2; rank 1 never starts
    python3 tests/gpu/hang_jobs.py remote-rank-missing   the same; the launcher sets
                                                   LOCAL_WORLD_SIZE=1 (rank 1 is another node's)
    python3 tests/gpu/hang_jobs.py kernel-never-ends [WARM]  matmuls for WARM s (10), then a
                                                   CUDA graph whose kernel never ends
    python3 tests/gpu/hang_jobs.py peer RANK DIR   two ranks spin on each other's flag (CUDA IPC)
    python3 tests/gpu/hang_jobs.py matmul SECONDS  bf16 matmul loop (healthy)
    python3 tests/gpu/hang_jobs.py copy SECONDS    memory-bound copy loop (healthy)

ras1 phases: it writes DIR/ready after a few all-reduces, then waits for
DIR/go-teardown (captures an all-reduce in a CUDA graph, keeps the graph and
calls destroy_process_group, which then polls forever) or DIR/go-abort
(aborts the process group and lingers).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable


def _wait_for(path: str) -> str:
    while True:
        for name in ("go-teardown", "go-abort"):
            if os.path.exists(os.path.join(path, name)):
                return name
        time.sleep(0.1)


def ras1(path: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29520 + os.getpid() % 400))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    open(os.path.join(path, "ready"), "w").close()
    what = _wait_for(path)
    print(f"ras1: {what}", flush=True)
    if what == "go-teardown":
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            dist.all_reduce(x)  # warm-up outside capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                dist.all_reduce(x)
        g.replay()
        torch.cuda.synchronize()
        open(os.path.join(path, "destroying"), "w").close()
        dist.destroy_process_group()  # polls while the graph holds the communicator
        print("ras1: destroy returned", flush=True)
        del g
    else:
        from torch.distributed import distributed_c10d as c10d

        c10d._abort_process_group()
        open(os.path.join(path, "aborted"), "w").close()
        print("ras1: aborted", flush=True)
    time.sleep(600)


def rendezvous() -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a context NVML sees
    print("rendezvous: rank 0 waiting for rank 1", flush=True)
    dist.init_process_group("nccl", init_method="env://", rank=0, world_size=2)
    print("rendezvous: joined (unexpected)", keep.numel(), flush=True)


_SPIN = r"""
extern "C" __global__ void meet(volatile int* flags, int me, int peer, int round) {
    flags[me] = round;
    __threadfence_system();
    while (flags[peer] < round) { }
}
"""


def peer(rank: int, path: str) -> None:
    import cupy as cp

    cp.cuda.Device(0).use()
    kernel = cp.RawKernel(_SPIN, "meet")
    handle_file = os.path.join(path, "flags.handle")
    if rank == 0:
        flags = cp.zeros(2, dtype=cp.int32)
        handle = cp.cuda.runtime.ipcGetMemHandle(flags.data.ptr)
        with open(handle_file + ".tmp", "wb") as f:
            f.write(bytes(handle))
        os.replace(handle_file + ".tmp", handle_file)
        ptr = flags.data.ptr
    else:
        while not os.path.exists(handle_file):
            time.sleep(0.05)
        with open(handle_file, "rb") as f:
            ptr = cp.cuda.runtime.ipcOpenMemHandle(f.read())
    a = cp.random.random((2048, 2048), dtype=cp.float32)
    mem = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, 8, None), 0)
    flags_view = cp.ndarray((2,), dtype=cp.int32, memptr=mem)
    round_no = 0
    print(f"peer {rank}: running", flush=True)
    while True:
        round_no += 1
        for _ in range(20):
            a = a @ a
            a /= cp.linalg.norm(a)
        kernel((1,), (1,), (flags_view, cp.int32(rank), cp.int32(1 - rank), cp.int32(round_no)))
        cp.cuda.runtime.deviceSynchronize()  # the host thread spins here when the peer is gone
        if round_no % 100 == 0:
            print(f"peer {rank}: round {round_no}", flush=True)


_FOREVER = r"""
extern "C" __global__ void wait_for(volatile int* flag) {
    while (*flag == 0) { }  // nobody ever sets it
}
"""


def kernel_never_ends(
    device: int = 0,
    warm: float = 10.0,
    ready: Callable[[], object] = lambda: None,
    hang: Callable[[str], object] = lambda what: None,
) -> None:
    """Matmuls for `warm` s (a job at work), then a CUDA graph replay of a one-thread
    kernel spinning on a flag nobody sets, and the host waits for it in a synchronize.

    CuPy: the graph is captured on a stream; where capture is not available the kernel
    is launched directly (the same hang, without the graph)."""
    import cupy as cp

    cp.cuda.Device(device).use()
    a = cp.random.random((4096, 4096), dtype=cp.float32)
    end = time.monotonic() + warm
    while time.monotonic() < end:
        for _ in range(10):
            a = a @ a
            a /= cp.linalg.norm(a)
        cp.cuda.runtime.deviceSynchronize()
    ready()
    flag = cp.zeros(1, dtype=cp.int32)
    kernel = cp.RawKernel(_FOREVER, "wait_for")
    kernel.compile()
    stream = cp.cuda.Stream(non_blocking=True)
    how = "a CUDA graph replay of"
    try:
        stream.begin_capture()
        kernel((1,), (1,), (flag,), stream=stream)
        graph = stream.end_capture()
    except Exception as e:  # no graph capture in this CuPy: launch it directly
        print(f"kernel-never-ends: no graph ({type(e).__name__}: {e})", flush=True)
        graph, how = None, "a direct launch of"
    what = f"{how} a one-thread kernel spinning on a flag nobody sets; the host synchronizes"
    hang(what)
    print(f"kernel-never-ends: {what}", flush=True)
    if graph is not None:
        graph.launch(stream)
    else:
        kernel((1,), (1,), (flag,), stream=stream)
    stream.synchronize()  # never returns
    print("kernel-never-ends: returned (unexpected)", flush=True)


def matmul(seconds: float) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        for _ in range(20):
            c = a @ b
        torch.cuda.synchronize()
        n += 20
    print(f"matmul: {n} products, last {float(c[0, 0]):.3f}", flush=True)


def copy(seconds: float) -> None:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()
        n += 20
    print(f"copy: {n} GiB copied", flush=True)


def main(argv: list[str]) -> int:
    what = argv[0]
    if what == "ras1":
        ras1(argv[1])
    elif what in ("rendezvous", "remote-rank-missing"):
        rendezvous()  # the launcher's LOCAL_WORLD_SIZE says where rank 1 belongs
    elif what == "kernel-never-ends":
        kernel_never_ends(warm=float(argv[1]) if len(argv) > 1 else 10.0)
    elif what == "peer":
        peer(int(argv[1]), argv[2])
    elif what == "matmul":
        matmul(float(argv[1]))
    elif what == "copy":
        copy(float(argv[1]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
