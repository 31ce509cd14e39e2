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
        60.0, "a stall, or a straggler, must last this long before the alert", min=5
    )
    rank_missing_after_seconds: float = opt(
        20.0, "a missing rank while the others make no progress is flagged after this", min=5
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
    ras_timeout_seconds: float = opt(10.0, "deadline of one RAS query", min=1, max=120)
    stacks: bool = opt(
        False, "capture each rank's stack once per stall with py-spy (CAP_SYS_PTRACE)"
    )
    stacks_timeout_seconds: float = opt(15.0, "deadline of one py-spy dump", min=1, max=120)
