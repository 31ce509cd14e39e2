"""GpuDiagFailed from the gpuwatchd_diag_* series the diag scheduler exports."""

from __future__ import annotations

from types import MappingProxyType

from gpuwatchd.config import Config
from gpuwatchd.health.diag import rule as diag_rule
from gpuwatchd.health.history import History, View
from gpuwatchd.health.rules import Inputs
from gpuwatchd.model import Action, Sample, Severity
from gpuwatchd.state import NodeSnapshot

T0 = 1_700_000_000.0


def _findings(*samples: Sample) -> list[object]:
    snap = NodeSnapshot(extra=MappingProxyType({"diag": tuple(samples)}))
    view = View(snap)
    return diag_rule.diag_failed(Inputs(view, History(300), Config(), T0))


def test_failed_check_fires_with_figures_and_repeat_note() -> None:
    found = _findings(
        Sample.of("gpuwatchd_diag_check_passed", 0, check="gemm", gpu="1"),
        Sample.of("gpuwatchd_diag_measured", 5e14, check="gemm", gpu="1"),
        Sample.of("gpuwatchd_diag_floor", 6.6e14, check="gemm", gpu="1"),
        Sample.of("gpuwatchd_diag_inspect", 1, check="gemm", gpu="1"),
        Sample.of("gpuwatchd_diag_check_passed", 1, check="all_reduce", gpu="all"),
    )
    [f] = found
    assert f.alertname == "GpuDiagFailed"  # type: ignore[attr-defined]
    assert f.subject == (("check", "gemm"), ("gpu", "1"))  # type: ignore[attr-defined]
    assert f.severity == Severity.WARNING  # type: ignore[attr-defined]
    assert f.action == Action.DRAIN_AND_INSPECT  # type: ignore[attr-defined]
    reason = f.reason  # type: ignore[attr-defined]
    assert "measured 5e+14, floor 6.6e+14" in reason and "drain and inspect" in reason


def test_passing_or_absent_checks_do_not_fire() -> None:
    assert _findings() == []
    assert _findings(Sample.of("gpuwatchd_diag_check_passed", 1, check="gemm", gpu="0")) == []
