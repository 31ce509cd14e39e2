"""The `hangs:` section: job hang detection and forensics (gpuwatchd/health/hangs/)."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.config.fields import opt

__all__ = ["HangsConfig"]


@dataclass(frozen=True)
class HangsConfig:
    """Job-level hang detection and forensics, health/hangs/."""

    enabled: bool = opt(True, "decide per job whether it hangs (GPU spin, CPU stall, rank missing)")
    decide_after_seconds: float = opt(
        45.0, "a CPU or GPU stall (jobs without NCCL RAS) must last this long", min=5
    )
    rank_missing_after_seconds: float = opt(
        10.0, "fewer ranks than expected while the others make no progress, for this long", min=5
    )
    remote_rank_missing_after_seconds: float = opt(
        15.0,
        "every local rank in the start-up rendezvous (two stack dumps) for ranks of other"
        " nodes, for this long; a site whose nodes start minutes apart raises it",
        min=5,
    )
    kernel_stuck_after_seconds: float = opt(
        10.0,
        "one process's GPU busy with its SMs idle while its host waits in a CUDA"
        " synchronize (two stack dumps), for this long",
        min=5,
    )
    dead_peer_after_seconds: float = opt(
        10.0, "a rank gone while its peers make no progress is a dead peer after this", min=2
    )
    collective_stall_seconds: float = opt(
        30.0, "NCCL RAS collective counts flat this long, no rank progressing: a stall", min=10
    )
    collective_deadlock_seconds: float = opt(
        15.0,
        "collective counts flat this long, every rank waiting, when RAS shows why none can"
        " complete (ranks behind waiting in another collective; a communicator destroyed,"
        " aborted or failed): a stall",
        min=10,
    )
    straggler_after_seconds: float = opt(
        60.0, "some ranks progress while the others wait this long: a warning", min=5
    )
    collective_timeout_seconds: float = opt(
        600.0, "a straggler becomes critical at the job's collective timeout (PyTorch's)", min=10
    )
    startup_grace_seconds: float = opt(
        30.0,
        "a job is asked RAS and judged a collective stall only this long after its youngest"
        " rank started, unless every rank's GPUs already did real work",
        min=0,
    )
    probe_interval_seconds: float = opt(
        3.0, "read each rank's /proc liveness, CPU and I/O this often", min=0.5, max=60
    )
    io_progress_bytes_per_second: float = opt(
        65536.0, "a rank (or its children) reading or writing this fast makes progress", min=1
    )
    max_sm_active: float = opt(
        0.05, "GPM: SM activity at or below this counts as spinning (ratio)", min=0, max=1
    )
    max_sm_occupancy: float = opt(
        0.05, "GPM: SM occupancy at or below this counts as spinning (ratio)", min=0, max=1
    )
    max_cpu_ratio: float = opt(
        0.05, "a rank using less CPU than this (cores) makes no CPU progress", min=0
    )
    single_process_cpu_stall: bool = opt(
        False, "also flag a lone (non-distributed) process idle on its GPU"
    )
    signatures_file: str = opt("", "site hang signatures (YAML) replacing or adding to ours")
    ras: bool = opt(
        True, "query NCCL's RAS service of a suspected job (localhost or NCCL_RAS_ADDR)"
    )
    ras_netns: bool = opt(
        False, "join the job's network namespace for the RAS query (CAP_SYS_ADMIN, hostPID)"
    )
    ras_interval_seconds: float = opt(300.0, "re-query RAS this often while the hang lasts", min=10)
    ras_poll: bool = opt(
        True, "poll NCCL RAS of every distributed job for its collective counts (progress)"
    )
    ras_poll_interval_seconds: float = opt(15.0, "RAS poll cadence per job", min=2, max=3600)
    ras_urgent_interval_seconds: float = opt(
        5.0, "RAS poll cadence of a job under suspicion (a rank gone, counts flat)", min=1
    )
    ras_timeout_seconds: float = opt(10.0, "deadline of one RAS query", min=1, max=120)
    stacks: bool = opt(
        False, "capture each rank's stack once per stall with py-spy (CAP_SYS_PTRACE)"
    )
    stacks_timeout_seconds: float = opt(15.0, "deadline of one py-spy dump", min=1, max=120)
    flight_recorder: bool = opt(
        True,
        "on suspicion, trigger (TORCH_NCCL_DEBUG_INFO_PIPE_FILE) and read each rank's"
        " PyTorch flight recorder dump; reports where each process group's ranks are",
    )
    stacks_confirm_seconds: float = opt(
        3.0, "the second stack dump, this long after the first, confirms a stall", min=0, max=60
    )
