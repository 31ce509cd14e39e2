"""Diag runs on the daemon's side: one run (`run`), and when the daemon starts one (`scheduler`).

Daemon layer: it ties the NVML reads and the worker (sources), the floors
(health) and the store (sinks) together, for the CLI and the daemon.
"""

from gpuwatchd.diagnose.run import (
    FAKE_WORKER_ENV,
    DiagOptions,
    DiagReport,
    open_nvml,
    options_for,
    run_diag,
    run_recorded,
)

__all__ = [
    "DiagOptions",
    "DiagReport",
    "FAKE_WORKER_ENV",
    "open_nvml",
    "options_for",
    "run_diag",
    "run_recorded",
]
