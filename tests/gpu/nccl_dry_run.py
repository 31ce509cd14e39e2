"""The dry run of nccl_jobs.py (--fake): the same markers, sleeps instead of GPU work."""

from __future__ import annotations

import json
import os
import threading
import time

from nccl_rank import CONTROLS, Job


def _fake_flight_recorder(job: Job) -> None:
    """Answer a write to the pipe file with a dump file, as PyTorch's monitor thread does."""
    pipe = os.environ.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "")
    dump = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "")
    if not pipe or not dump:
        return
    path = f"{pipe}{job.rank}.pipe"
    os.mkfifo(path)

    def serve() -> None:
        while True:
            with open(path) as f:
                if f.read():
                    with open(f"{dump}{job.rank}", "w") as out:
                        out.write(json.dumps({"fake": True, "rank": job.rank}))

    threading.Thread(target=serve, daemon=True).start()


def run_fake(job: Job) -> int:
    mode, secs = job.args.mode, job.args.seconds
    if mode in ("rendezvous_missing", "remote_rank_missing"):
        job.mark("hang", what="fake init_process_group")
        time.sleep(3600)
        return 1
    _fake_flight_recorder(job)
    time.sleep(0.5)
    job.mark("start")
    time.sleep(min(job.args.warm, 1.0))
    job.mark("ready")
    if mode in CONTROLS:
        if mode in ("checkpoint", "eval_pause") and job.rank == 0:
            job.mark("phase", phase=mode)
            os.makedirs(job.args.scratch, exist_ok=True)
            path = os.path.join(job.args.scratch, f"fake-{os.getpid()}.bin")
            end = time.monotonic() + secs
            with open(path, "wb") as f:
                while time.monotonic() < end:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
                    os.fsync(f.fileno())
                    time.sleep(0.05)
            os.unlink(path)
        else:
            time.sleep(secs)
        job.mark("done")
        return 0
    if mode == "xid_kill":
        while not job.go():
            time.sleep(0.1)
        if job.rank == 1:
            job.mark("hang", what="fake fault")
            job.mark("faulted", error="fake")
            os._exit(1)
    elif mode not in ("dead_peer",):
        job.mark("hang", what=f"fake {mode}")
    time.sleep(3600)
    return 1
