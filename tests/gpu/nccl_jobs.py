"""NCCL job bodies for the multi-GPU hang scenarios (run by tests/gpu/nccl_scenarios.py).

    torchrun --standalone --nproc-per-node K tests/gpu/nccl_jobs.py MODE --dir DIR [--seconds N]
    RANK=0 WORLD_SIZE=2 ... python3 tests/gpu/nccl_jobs.py MODE --dir DIR     (by hand)
    python3 tests/gpu/nccl_jobs.py fake-torchrun K MODE --dir DIR --fake      (dry run, no GPU)

One process per GPU, torch.distributed over NCCL, a small MLP so a job starts
in seconds. Controls: healthy_ddp, healthy_fsdp, checkpoint (rank 0 writes and
fsyncs for N s while the others wait in a barrier), eval_pause, slow_loader,
compile_start, ends_normally. Hangs: teardown_destroy, teardown_graph_attr,
unbalanced, dead_peer (the harness kills a rank), rendezvous_missing (rank 0
of WORLD_SIZE=2 alone), remote_rank_missing (the same with LOCAL_WORLD_SIZE=1:
the missing rank belongs to another node), xid_kill (rank 1 stores to an
unmapped address once DIR/go exists, which makes the driver log Xid 31; the
rank then exits), kernel_never_ends (one process, no NCCL: after warm-up
matmuls a CUDA graph replays a one-thread kernel spinning on a flag nobody
sets, then the host synchronizes; hang_jobs.py's kernel body).

Each rank writes DIR/markers/NAME.rankR.json ({"t": wall time, "pid", ...}):
start (after init), ready (after warm-up), phase (what it does now),
hang (the wall time a hang begins, written just before the blocking call),
progress (steps so far, every 5 s), done. --fake replaces every GPU call by
sleeps so the harness can be tried without a GPU (nccl_dry_run.py); the modes
and the marker files are nccl_rank.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from nccl_dry_run import run_fake
from nccl_rank import CONTROLS, HANGS, Job

UNMAPPED = 0x7F_0000_0000
SCRIBBLE = r"""
extern "C" __global__ void scribble(unsigned int* where) { *where = 31u; }
"""


# --- the real bodies (torch imported lazily so --fake and import checks need no torch) ----


def _setup(job: Job) -> Any:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(job.local_rank)
    dev = torch.device("cuda", job.local_rank)
    dist.init_process_group("nccl", device_id=dev)
    job.mark("start")
    return dev


def _model(dev: Any) -> Any:
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024)
    ).to(dev)


def _train(
    job: Job,
    model: Any,
    opt: Any,
    dev: Any,
    seconds: float,
    stop: Callable[[], bool] | None = None,
    batches: Any = None,
) -> int:
    """Training steps for `seconds` (or until stop() on any rank).

    The ranks agree when to stop (an all-reduce of a flag every 10 steps, every
    step with a slow loader), so each rank runs the same number of steps and the
    collectives stay matched.
    """
    import torch
    import torch.distributed as dist

    end = time.monotonic() + seconds
    steps = 0
    it = iter(batches) if batches is not None else None
    every = 1 if it is not None else 10
    flag = torch.zeros(1, device=dev)
    while True:
        if steps % every == 0:
            flag.fill_(float(time.monotonic() >= end or (stop is not None and stop())))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:  # also the host sync that keeps the queue short
                break
        x = next(it).to(dev) if it is not None else torch.randn(64, 1024, device=dev)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
        job.progress(steps)
    torch.cuda.synchronize()
    return steps


def _ddp(job: Job, dev: Any, compile_it: bool = False) -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model: Any = DDP(_model(dev), device_ids=[job.local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    if compile_it:
        job.mark("phase", phase="compile")
        try:  # compilation happens at the first step: try one
            compiled = torch.compile(model)
            compiled(torch.randn(64, 1024, device=dev)).square().mean().backward()
            opt.zero_grad(set_to_none=True)
            model = compiled
            job.mark("phase", phase="compiled")
        except Exception as e:  # no compiler on the machine: say so and train eagerly
            job.mark("phase", phase="compile-failed", error=f"{type(e).__name__}: {e}")
    return model, opt


def _warm(job: Job, model: Any, opt: Any, dev: Any) -> None:
    _train(job, model, opt, dev, job.args.warm)
    job.mark("ready")


def _end(job: Job) -> int:
    import torch.distributed as dist

    job.mark("done")
    dist.destroy_process_group()
    return 0


def _barrier(job: Job) -> None:
    import torch.distributed as dist

    dist.barrier(device_ids=[job.local_rank])


def _write_checkpoint(job: Job, model: Any, seconds: float) -> int:
    """Real file writes: 16 MiB chunks of the weights, each fsynced, wrapping at 1 GiB."""
    import torch

    os.makedirs(job.args.scratch, exist_ok=True)
    path = os.path.join(job.args.scratch, f"ckpt-{os.getpid()}.bin")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    blob = flat.to(torch.float32).cpu().numpy().tobytes()
    chunk = 16 << 20
    written = 0
    end = time.monotonic() + seconds
    with open(path, "wb") as f:
        while time.monotonic() < end:
            start = written % len(blob)
            f.write(blob[start : start + chunk] or blob[:chunk])
            f.flush()
            os.fsync(f.fileno())
            written += chunk
            if f.tell() >= 1 << 30:
                f.seek(0)
    os.unlink(path)
    return written


class _SlowBatches:
    """A map-style dataset whose every item takes `delay` seconds (a slow data source)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> Any:
        import torch

        time.sleep(self.delay)
        return torch.randn(64, 1024)


class _Keep:
    graph: Any = None  # keeps the captured graph (and its communicator) alive until exit


def _captured_all_reduce(dev: Any) -> Any:
    import torch
    import torch.distributed as dist

    x = torch.ones(1 << 20, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dist.all_reduce(x)  # warm-up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            dist.all_reduce(x)
    g.replay()
    torch.cuda.synchronize()
    return g


def _fault(job: Job) -> str:
    """Store to an unmapped address on this rank's GPU; what came back (Xid 31 in the log)."""
    try:
        import cupy as cp

        cp.cuda.Device(job.local_rank).use()
        kernel = cp.RawKernel(SCRIBBLE, "scribble")
        kernel.compile()
    except Exception as e:  # no CuPy or no NVRTC: the PTX fallback below
        problem = f"cupy: {type(e).__name__}: {e}"
    else:
        try:
            kernel((1,), (1,), (cp.uint64(UNMAPPED),))
            cp.cuda.Device(job.local_rank).synchronize()
            return "no error"
        except Exception as e:  # cudaErrorIllegalAddress is the expected outcome
            return f"{type(e).__name__}: {e}"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from faults import illegal_write_ptx

    return problem + "; ptx: " + json.dumps(illegal_write_ptx(ordinal=job.local_rank))


def run_real(job: Job) -> int:
    import torch
    import torch.distributed as dist

    mode, secs = job.args.mode, job.args.seconds
    if mode == "kernel_never_ends":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from hang_jobs import kernel_never_ends

        kernel_never_ends(
            job.local_rank,
            job.args.warm,
            ready=lambda: job.mark("ready"),
            hang=lambda what: job.mark("hang", what=what),
        )
        return 1
    if mode in ("rendezvous_missing", "remote_rank_missing"):
        torch.cuda.set_device(job.local_rank)
        keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a context NVML sees
        where = " (another node)" if mode == "remote_rank_missing" else ""
        local = os.environ.get("LOCAL_WORLD_SIZE", "?")
        job.mark(
            "hang",
            what=f"init_process_group, WORLD_SIZE=2, LOCAL_WORLD_SIZE={local},"
            f" rank 1{where} never starts",
        )
        dist.init_process_group("nccl", init_method="env://")
        job.mark("returned", held=keep.numel())
        time.sleep(3600)
        return 1
    dev = _setup(job)
    if mode == "healthy_fsdp":
        model = _model(dev)
        try:
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        except ImportError:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    else:
        model, opt = _ddp(job, dev, compile_it=mode == "compile_start")
    if mode == "slow_loader":
        loader = torch.utils.data.DataLoader(
            _SlowBatches(job.args.loader_delay), batch_size=None, num_workers=2
        )
        job.mark("ready")
        job.mark("phase", phase="slow-loader", delay=job.args.loader_delay)
        steps = _train(job, model, opt, dev, secs, batches=loader)
        job.mark("phase", phase="trained", steps=steps)
        return _end(job)
    _warm(job, model, opt, dev)
    if mode in ("healthy_ddp", "healthy_fsdp", "compile_start", "ends_normally"):
        job.mark("phase", phase="train")
        steps = _train(job, model, opt, dev, secs)
        job.mark("phase", phase="trained", steps=steps)
        return _end(job)
    if mode in ("checkpoint", "eval_pause"):
        _train(job, model, opt, dev, 10.0)
        job.mark("phase", phase=mode)
        if job.rank == 0:
            if mode == "checkpoint":
                job.mark("phase", phase="checkpoint", bytes=_write_checkpoint(job, model, secs))
            else:
                end, n = time.monotonic() + secs, 0
                with torch.no_grad():
                    x = torch.randn(4096, 1024, device=dev)
                    while time.monotonic() < end:
                        model(x)
                        n += 1
                        if n % 10 == 0:
                            torch.cuda.synchronize()
                job.mark("phase", phase="evaluated", batches=n)
        _barrier(job)
        job.mark("phase", phase="train")
        _train(job, model, opt, dev, 10.0)
        return _end(job)
    if mode == "dead_peer":
        _train(job, model, opt, dev, 3600.0)  # until the harness kills a rank
        return 1
    if mode == "xid_kill":
        _train(job, model, opt, dev, 3600.0, stop=job.go)
        if job.rank == 1:
            job.mark("hang", what="rank 1 stores to an unmapped address")
            err = _fault(job)
            job.mark("faulted", error=err)
            os._exit(1)  # the context is lost; exit without running CUDA destructors
        _train(job, model, opt, dev, 3600.0)  # waits in the next all-reduce
        return 1
    if mode in ("teardown_destroy", "teardown_graph_attr"):
        g = _captured_all_reduce(dev)
        if mode == "teardown_destroy":
            job.mark("hang", what="destroy_process_group with a captured all_reduce alive")
            dist.destroy_process_group()
            job.mark("returned")
            del g
            time.sleep(3600)
            return 1
        _Keep.graph = g
        job.mark("hang", what="interpreter exit with the graph kept by a class attribute")
        return 0
    if mode == "unbalanced":
        x = torch.ones(1 << 22, device=dev)
        small = torch.ones(1, device=dev)
        out = torch.empty(job.world, device=dev)
        if job.rank == 0:
            job.mark("hang", what="rank 0: one extra all_reduce")
            dist.all_reduce(x)
        else:
            job.mark("hang", what="all_gather while rank 0 is in an all_reduce")
        dist.all_gather_into_tensor(out, small)
        torch.cuda.synchronize()
        job.mark("returned")
        time.sleep(3600)
        return 1
    raise SystemExit(f"unknown mode {mode}")


def fake_torchrun(nproc: int, argv: list[str]) -> int:
    """Stands in for torchrun in a dry run: K ranks; one failing takes the others down."""
    procs = []
    for r in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(29400 + os.getpid() % 500),
            TORCHELASTIC_RUN_ID=f"fake-{os.getpid()}",
        )
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))

    def stop() -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    def on_term(*_: Any) -> None:
        stop()
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            stop()
            for p in procs:
                p.wait(30)
            return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "fake-torchrun":
        return fake_torchrun(int(argv[1]), argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=CONTROLS + HANGS)
    ap.add_argument("--dir", required=True, help="markers and flight-recorder dumps go here")
    ap.add_argument("--seconds", type=float, default=180.0, help="length of the job's main phase")
    ap.add_argument("--warm", type=float, default=8.0, help="training seconds before `ready`")
    ap.add_argument("--loader-delay", type=float, default=8.0, help="seconds per slow batch")
    ap.add_argument("--scratch", default="/tmp/gpuscen-ckpt", help="checkpoint files go here")
    ap.add_argument("--fake", action="store_true", help="no GPU: sleeps instead of work")
    job = Job(ap.parse_args(argv))
    return run_fake(job) if job.fake else run_real(job)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
