"""GpuDiagFailed: an active check (`gpuwatchd diag`) failed in its last run.

Reads the gpuwatchd_diag_* series the daemon's diag scheduler exports from
the store; health/ruleset.py lists it. A check that failed repeatedly says drain_and_inspect in its
reason as well as in the alert's action.
"""

from __future__ import annotations

from gpuwatchd.health.rules import Inputs, finding
from gpuwatchd.model import Finding

__all__ = ["diag_failed"]


def diag_failed(inp: Inputs) -> list[Finding]:
    """One finding per check and GPU whose last run failed."""
    out = []
    for s in inp.view.series("gpuwatchd_diag_check_passed"):
        if s.value >= 1:
            continue
        check, gpu = s.label("check"), s.label("gpu")
        reason = f"diag {check} failed on GPU {gpu} in its last run"
        for m in inp.view.series("gpuwatchd_diag_measured", check=check, gpu=gpu):
            reason += f": measured {m.value:.4g}"
        for f in inp.view.series("gpuwatchd_diag_floor", check=check, gpu=gpu):
            reason += f", floor {f.value:.4g}"
        if any(
            x.value >= 1 for x in inp.view.series("gpuwatchd_diag_inspect", check=check, gpu=gpu)
        ):
            reason += "; it failed repeatedly in 30 days: drain and inspect"
        subject = (("check", check), ("gpu", gpu))
        out.append(finding("GpuDiagFailed", subject, reason, "diag_failed", scope="node"))
    return out
