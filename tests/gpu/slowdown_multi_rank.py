"""One rank of the multi-GPU slowdown job (issue 32): bf16 matmuls, then an all_reduce.

Started by tests/gpu/slowdown_multi.py, one process per GPU, with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and NCCL_RAS_ADDR set (what the
daemon's workloads adapter reads). Each step: `--matmuls` bf16 8192x8192 matmuls (the
matmul code of slowdown_job.py), `--extra` of the phase more on rank `--slow-rank` only,
then an all_reduce of a 64 MiB float32 buffer and a synchronize: a synchronous job that
steps at its slowest rank's pace. Rank 0 keeps the phase clock: it writes its phase
index into the buffer's first element (the others write 0), so every rank learns the
next step's phase from the same all_reduce and all stop after the same step (no extra
collective, no rank left waiting). Every step's time goes to OUT/steps-rank<R>.jsonl,
each phase's start (rank 0's clock) to OUT/phases.jsonl.
--dry-run: no CUDA, no NCCL; each rank sleeps its matmuls (10 ms each) on its own clock.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/gpu: its sibling scripts
from slowdown_job import Step, parse_phases  # noqa: E402

PAYLOAD = 16 << 20  # float32 elements all-reduced per step: 64 MiB


class RankStep:
    """The matmuls of one step (slowdown_job.Step's tensors and carry) and the all_reduce."""

    def __init__(self, matmuls: int, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.matmuls = Step(matmuls, 0.0, dry_run)  # no NCCL-like wait: the all_reduce is real
        if dry_run:
            return
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.buf = torch.zeros(PAYLOAD, device="cuda", dtype=torch.float32)

    def compute(self, extra: float) -> None:
        step = self.matmuls
        # whole matmuls: the fraction carries over, so the mean extra work is exact
        step.carry += step.matmuls * (1.0 + extra)
        n = int(step.carry)
        step.carry -= n
        if self.dry_run:
            time.sleep(0.01 * n)
            return
        for _ in range(n):
            step.a @ step.b

    def all_reduce(self, phase: int) -> int:
        """The step's collective; answers rank 0's phase index (the others send 0)."""
        self.buf.zero_()
        if phase:
            self.buf[0] = float(phase)
        self.dist.all_reduce(self.buf)
        return int(self.buf[0].item())  # .item() waits for the collective: a synchronous step


def phase_at(ends: list[float], now: float) -> int:
    """The index of the phase running at `now` (len(ends) once all have ended)."""
    return next((i for i, end in enumerate(ends) if now < end), len(ends))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--phases", required=True, help="name:extra:seconds,...")
    ap.add_argument("--slow-rank", type=int, required=True)
    ap.add_argument("--matmuls", type=int, default=40, help="per step at no extra work")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    phases = parse_phases(args.phases)
    if not args.dry_run:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    step = RankStep(args.matmuls, args.dry_run)
    if not args.dry_run:
        step.all_reduce(0)  # NCCL's set-up is not a step; the clocks start together after it
    start = time.time()
    ends, total = [], 0.0
    for _, _, seconds in phases:
        total += seconds
        ends.append(start + total)
    steps = (args.out / f"steps-rank{rank}.jsonl").open("w")
    marks = (args.out / "phases.jsonl").open("a") if rank == 0 else None
    idx, n, flushed = 0, 0, time.time()
    if marks is not None:
        name, extra, seconds = phases[0]
        row: dict[str, Any] = {"phase": name, "extra": extra, "t": start, "seconds": seconds}
        marks.write(json.dumps(row) + "\n")
        marks.flush()
    while idx < len(phases):
        name, extra, _ = phases[idx]
        t0 = time.perf_counter()
        step.compute(extra if rank == args.slow_rank else 0.0)
        now = time.time()
        if args.dry_run:
            nxt = phase_at(ends, now)
        else:
            nxt = step.all_reduce(phase_at(ends, now) if rank == 0 else 0)
        dt = time.perf_counter() - t0
        n += 1
        steps.write(json.dumps({"t": time.time(), "step": n, "phase": name, "s": dt}) + "\n")
        if marks is not None and nxt != idx and nxt < len(phases):
            pname, pextra, pseconds = phases[nxt]
            row = {"phase": pname, "extra": pextra, "t": time.time(), "seconds": pseconds}
            marks.write(json.dumps(row) + "\n")
            marks.flush()
        if time.time() - flushed > 2.0:
            steps.flush()
            flushed = time.time()
        idx = nxt
    steps.close()
    if not args.dry_run:
        step.dist.destroy_process_group()
    (args.out / f"rank{rank}.done").write_text(str(n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
