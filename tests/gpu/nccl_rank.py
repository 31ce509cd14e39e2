"""One rank of a scenario job of nccl_jobs.py: the job modes, its identity and its marker files."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

# NVLink multicast stays off in every process (set before torch loads NCCL).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(MULTICAST_OFF)

CONTROLS = (
    "healthy_ddp",
    "healthy_fsdp",
    "checkpoint",
    "eval_pause",
    "slow_loader",
    "compile_start",
    "ends_normally",
)
HANGS = (
    "teardown_destroy",
    "teardown_graph_attr",
    "unbalanced",
    "dead_peer",
    "rendezvous_missing",
    "xid_kill",
    "remote_rank_missing",
    "kernel_never_ends",
)


class Job:
    """The rank's identity, its directory and its marker files."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = args.dir
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.fake = bool(args.fake)
        os.makedirs(os.path.join(self.dir, "markers"), exist_ok=True)
        self._last_progress = 0.0

    def mark(self, name: str, **extra: Any) -> None:
        path = os.path.join(self.dir, "markers", f"{name}.rank{self.rank}.json")
        doc = {"t": time.time(), "pid": os.getpid(), "rank": self.rank, **extra}
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)
        if name != "progress":  # every marker in order (the files keep only the last)
            with open(os.path.join(self.dir, "markers", f"log.rank{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"name": name, **doc}) + "\n")
            print(f"[rank {self.rank}] {name} {extra}", flush=True)

    def progress(self, steps: int) -> None:
        now = time.monotonic()
        if now - self._last_progress >= 5.0:
            self._last_progress = now
            self.mark("progress", steps=steps)

    def go(self) -> bool:
        return os.path.exists(os.path.join(self.dir, "go"))
