"""The torch.distributed identity of a process, from /proc/PID/environ.

Only the names in TORCH_ENV are kept; every other variable is dropped
unread into anything else (environments carry tokens and passwords), and
nothing here logs values. Reading another user's environ needs root or
CAP_SYS_PTRACE; without it the process simply has no rank.
"""

from __future__ import annotations

import os

__all__ = ["TORCH_ENV", "parse_environ", "read_torch_env", "torch_job_id"]

# Environment name -> attribute name.
TORCH_ENV: dict[str, str] = {
    "RANK": "rank",
    "LOCAL_RANK": "local_rank",
    "WORLD_SIZE": "world_size",
    "MASTER_ADDR": "master_addr",
    "MASTER_PORT": "master_port",
    "TORCHELASTIC_RUN_ID": "torchelastic_run_id",
    "SLURM_PROCID": "slurm_procid",
}
MAX_ENVIRON_BYTES = 1 << 20
MAX_VALUE_CHARS = 256


def parse_environ(data: bytes) -> dict[str, str]:
    """The TORCH_ENV entries of an environ block (NUL-separated NAME=value)."""
    out: dict[str, str] = {}
    for entry in data.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if not sep:
            continue
        key = TORCH_ENV.get(name.decode("ascii", "replace"))
        if key is not None:
            text = value.decode("utf-8", "replace")[:MAX_VALUE_CHARS]
            if text.isprintable():
                out[key] = text
    return out


def read_torch_env(procfs: str, pid: int) -> dict[str, str]:
    """TORCH_ENV of a live pid; empty when it is gone or not ours to read."""
    try:
        with open(os.path.join(procfs, str(pid), "environ"), "rb") as f:
            data = f.read(MAX_ENVIRON_BYTES)
    except OSError:
        return {}
    return parse_environ(data)


def torch_job_id(run_id: str = "", master_addr: str = "", master_port: str = "") -> str:
    """The job a torch.distributed process belongs to, from its launcher's variables.

    "torchelastic:RUN" when TORCHELASTIC_RUN_ID names a run (torchrun's default
    "none" does not), else "torch:ADDR:PORT" of the rendezvous store, else "".
    The workloads source and the hang detector both name jobs this way.
    """
    if run_id and run_id != "none":
        return f"torchelastic:{run_id}"
    if master_port:
        return f"torch:{master_addr or 'localhost'}:{master_port}"
    return ""
