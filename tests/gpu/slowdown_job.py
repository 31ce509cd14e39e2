"""A one-rank training-like job with a steady step, then extra work per step (the slow rank).

Each step: `--matmuls` bf16 8192x8192 matmuls (compute), then a one-SM spin kernel
for `--wait` seconds (torch.cuda._sleep: a kernel resident with its SMs idle, as a
rank waiting in an NCCL collective looks to NVML and GPM). Phases, from --phases
`name:extra:seconds,...`: the extra share of matmuls per step (0.1 = 10 % more
compute). Every step's time goes to OUT/steps.jsonl, each phase's start to
OUT/phases.jsonl. --dry-run: no CUDA, the step is time.sleep (for the harness's test).

    python3 tests/gpu/slowdown_job.py OUT [--phases base:0:90,plus10:0.1:90,...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

PHASES = "warm:0:20,base:0:90,plus10:0.1:90,plus30:0.3:90,back:0:60"


def parse_phases(text: str) -> list[tuple[str, float, float]]:
    out = []
    for part in text.split(","):
        name, extra, seconds = part.split(":")
        out.append((name, float(extra), float(seconds)))
    return out


class Step:
    """One step's work on the GPU (or a sleep in a dry run)."""

    def __init__(self, matmuls: int, wait: float, dry_run: bool) -> None:
        self.matmuls, self.wait, self.dry_run = matmuls, wait, dry_run
        self.carry = 0.0
        if dry_run:
            return
        import torch

        self.torch = torch
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.cycles = self._cycles_per_second() * wait

    def _cycles_per_second(self) -> float:
        torch = self.torch
        torch.cuda._sleep(1_000_000)  # warm the kernel
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(100_000_000)
        torch.cuda.synchronize()
        return 100_000_000 / (time.perf_counter() - t0)

    def run(self, extra: float) -> None:
        # whole matmuls: the fraction carries over, so the mean extra work is exact
        self.carry += self.matmuls * (1.0 + extra)
        n = int(self.carry)
        self.carry -= n
        if self.dry_run:
            time.sleep(0.01 * n + self.wait)
            return
        for _ in range(n):
            self.a @ self.b
        self.torch.cuda._sleep(int(self.cycles))
        self.torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--phases", default=PHASES)
    ap.add_argument("--matmuls", type=int, default=40, help="per step at no extra work")
    ap.add_argument("--wait", type=float, default=0.05, help="seconds of the NCCL-like wait")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    step = Step(args.matmuls, args.wait, args.dry_run)
    steps = (args.out / "steps.jsonl").open("w")
    phases = (args.out / "phases.jsonl").open("w")
    n = 0
    for name, extra, seconds in parse_phases(args.phases):
        start = time.time()
        row: dict[str, Any] = {"phase": name, "extra": extra, "t": start, "seconds": seconds}
        phases.write(json.dumps(row) + "\n")
        phases.flush()
        while time.time() - start < seconds:
            t0 = time.perf_counter()
            step.run(extra)
            dt = time.perf_counter() - t0
            n += 1
            steps.write(json.dumps({"t": time.time(), "step": n, "phase": name, "s": dt}) + "\n")
        steps.flush()
    (args.out / "job.done").write_text(str(n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
