"""A 2-rank job for the hang detector on real GPUs: matmuls and an all_reduce per step.

    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P \
        python tests/gpu/hang_progress_job.py MODE FLAG

When FLAG appears: `unbalanced` makes rank 0 run one extra all_reduce while rank 1
runs an all_gather; `checkpoint` makes rank 0 write to /tmp/ckpt.bin for
CKPT_SECONDS (rank 1 waits in its all_reduce), then go on; `train` does nothing
(kill a rank by hand for the dead-peer case). Driven by hang_progress_run.sh.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
g = torch.randn(32 << 20, device="cuda")
mode = sys.argv[1] if len(sys.argv) > 1 else "train"
flag = sys.argv[2] if len(sys.argv) > 2 else "/tmp/none"
print(f"rank {rank} pid {os.getpid()} ready", flush=True)
step = 0
while True:
    for _ in range(8):
        y = x @ x
    dist.all_reduce(g)
    step += 1
    if os.path.exists(flag):
        if mode == "unbalanced" and rank == 0:
            dist.all_reduce(g)  # one extra all_reduce
        if mode == "unbalanced" and rank == 1:
            t = torch.zeros(2 * g.numel(), device="cuda")
            dist.all_gather_into_tensor(t, g)
        if mode == "checkpoint" and rank == 0:
            end = time.time() + float(os.environ.get("CKPT_SECONDS", "100"))
            with open("/tmp/ckpt.bin", "wb") as f:
                buf = os.urandom(1 << 20)
                while time.time() < end:
                    f.write(buf)
                    f.flush()
                    os.fsync(f.fileno())
            os.unlink(flag)
        torch.cuda.synchronize()
