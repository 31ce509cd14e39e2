"""The `diag:` section: active GPU checks (`gpuwatchd diag`, docs/diag.md)."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.config.fields import opt

__all__ = ["DiagConfig", "EvidenceConfig"]


@dataclass(frozen=True)
class DiagConfig:
    """When and how the diag worker runs; the GPU work needs gpuwatchd[diag] or PyTorch."""

    python: str = opt("", "interpreter with CuPy or PyTorch for the worker; empty = gpuwatchd's")
    backend: str = opt(
        "auto", "GPU library: auto tries CuPy, then PyTorch", choices=("auto", "cupy", "torch")
    )
    timeout_seconds: float = opt(300.0, "a run longer than this is stopped (UNKNOWN)", min=10)
    dcgm_level: int = opt(2, "dcgmi diag -r LEVEL for the dcgm tier", min=1, max=4)
    floors_file: str = opt("", "site floors (YAML, as gpuwatchd/data/diag-floors.yaml), first")
    verify_before_resume: bool = opt(
        True, "clear --resume runs the standard tier first and resumes only on a pass"
    )
    schedule_seconds: float = opt(
        0.0, "run schedule_tier this often while the node is idle; 0 = never", min=0
    )
    schedule_tier: str = opt("quick", "tier of scheduled runs", choices=("quick", "standard"))
    after_critical: bool = opt(
        False, "run the standard tier once the node is idle after a critical condition clears"
    )
    inspect_after_failures: int = opt(
        3,
        "the same check failing on the same GPU this often in 30 days: drain_and_inspect",
        min=1,
    )


@dataclass(frozen=True)
class EvidenceConfig:
    """Evidence bundles under <state_dir>/evidence, one per critical incident."""

    enabled: bool = opt(
        True, "write a bundle when a critical condition is raised and before remediation acts"
    )
    max_bundles: int = opt(
        20, "keep at most this many bundles (oldest removed, an incident chain's first last)", min=1
    )
    max_bundle_bytes: int = opt(
        8 << 20, "bytes per bundle at most (each part cut to fit)", min=4096
    )
    kmsg_records: int = opt(2000, "newest kernel log records kept in a bundle", min=0)
    events: int = opt(200, "newest stored events kept in a bundle", min=0)
    bug_report: bool = opt(
        False, "also run nvidia-bug-report.sh when installed (slow: minutes, tens of MiB)"
    )
    bug_report_timeout_seconds: float = opt(
        300.0, "nvidia-bug-report.sh is stopped after this long", min=10
    )
