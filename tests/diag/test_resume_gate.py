"""`clear --resume` against a real Slurm: never on a diag that measured nothing, never while
a critical condition is still open (the daemon would drain the node again after the hold)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.cli import main
from gpuwatchd.diag.run import FAKE_WORKER_ENV
from gpuwatchd.sinks.store import EventStore
from tests.check_config import write_check_config
from tests.conftest import FIXTURES
from tests.diag.fakes import canned, result
from tests.slurm_cluster import SlurmCluster, slurm_cluster

NO_XID = FIXTURES / "kmsg" / "talos-kern-nvrm-no-xid.txt"
XID109 = FIXTURES / "kmsg" / "dmesg-T-xid13-xid109.txt"  # a critical Xid 109, sticky
HELLO_ONLY = [{"hello": {"backend": "fake", "devices": 2}}]
REASON = "gpuwatchd: GpuXidCritical gpu 0: Reset the GPU"


def _healthy_standard_h200x2() -> list[dict[str, object]]:
    out: list[dict[str, object]] = [*HELLO_ONLY]
    for g in "01":
        out += [
            result("gemm", g, 790.0, "TFLOP/s"),
            result("h2d_bandwidth", g, 52.0, "GB/s"),
            result("d2d_bandwidth", g, 4300.0, "GB/s"),
        ]
    out += [
        result("p2p_bandwidth", "0>1", 380.0, "GB/s"),
        result("p2p_bandwidth", "1>0", 380.0, "GB/s"),
        result("all_reduce", "all", 330.0, "GB/s"),
        result("memory_pattern", "0", 0.0, "words"),
        result("memory_pattern", "1", 0.0, "words"),
    ]
    return out


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from slurm_cluster(tmp_path_factory)


@pytest.fixture
def drained(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmCluster]:
    """The node drained with gpuwatchd's reason, as remediation leaves it; resumed after."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    slurm.run(["scontrol", "update", f"nodename={slurm.node}", "state=drain", f"reason={REASON}"])
    assert _state(slurm).startswith("drain")
    yield slurm
    slurm.run(["scontrol", "update", f"nodename={slurm.node}", "state=resume"], check=False)


def _state(slurm: SlurmCluster) -> str:
    out = slurm.run(["sinfo", "-h", "-N", "-n", slurm.node, "-o", "%T"]).stdout
    return out.strip().splitlines()[0].rstrip("*~#$@^-!%")


def _wait_idle(slurm: SlurmCluster, timeout: float = 15.0) -> str:
    end = time.monotonic() + timeout
    state = _state(slurm)
    while state != "idle" and time.monotonic() < end:
        time.sleep(0.2)
        state = _state(slurm)
    return state


def _config(tmp_path: Path, slurm: SlurmCluster, kmsg: Path) -> Path:
    scontrol = shutil.which("scontrol") or "scontrol"
    extra = (
        f"remediation:\n  slurm: {{drain_on: [critical], node_name: {slurm.node},"
        f" scontrol: {scontrol}, timeout: 10}}\n"
    )
    return write_check_config(tmp_path, kmsg, node=slurm.node, extra=extra)


def _results(tmp_path: Path) -> list[str]:
    store = EventStore(str(tmp_path / "state" / "gpuwatchd.db"))
    try:
        return [r["attrs"]["result"] for r in store.recent(10, kind="remediation")]
    finally:
        store.close()


@pytest.mark.timeout(120)
def test_a_diag_that_measured_nothing_resumes_nothing(
    drained: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The issue's reproducer: the hello-only worker printed OK and ran `state=resume`."""
    cfg = _config(tmp_path, drained, NO_XID)
    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, HELLO_ONLY))
    assert main(["clear", "--resume", "--config", str(cfg)]) == 3
    out = capsys.readouterr()
    assert out.out.startswith("UNKNOWN: diag standard")
    assert "not resumed: diag standard UNKNOWN" in out.err
    time.sleep(0.5)
    assert _state(drained).startswith("drain")  # still out of service
    assert _results(tmp_path)[0] == "resume_refused"

    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, _healthy_standard_h200x2(), "ok.jsonl"))
    assert main(["clear", "--resume", "--config", str(cfg)]) == 0
    assert "OK: diag standard" in capsys.readouterr().out
    assert _wait_idle(drained) == "idle"


@pytest.mark.timeout(120)
def test_an_open_critical_condition_is_said_and_refused_without_force(
    drained: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = _config(tmp_path, drained, XID109)
    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, _healthy_standard_h200x2()))
    assert main(["clear", "--resume", "--config", str(cfg), "--new-store"]) == 2
    err = capsys.readouterr().err
    assert "not resumed: a critical condition is still open: GpuXidCritical" in err
    assert "Xid 109" in err and "--force" in err
    time.sleep(0.5)
    assert _state(drained).startswith("drain")
    assert _results(tmp_path)[0] == "resume_refused"

    # Cleared by the operator (the fix is done): the same command resumes.
    argv = ["clear", "--all", "--resume", "--reason", "GPU reseated", "--config", str(cfg)]
    assert main([*argv, "--new-store"]) == 0, capsys.readouterr()
    assert _wait_idle(drained) == "idle"
    assert _results(tmp_path)[0] == "resumed"


@pytest.mark.timeout(120)
def test_force_resumes_with_the_condition_open_and_says_so(
    drained: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = _config(tmp_path, drained, XID109)
    assert main(["clear", "--resume", "--force", "--config", str(cfg)]) == 0
    assert "still open, resuming anyway (--force): GpuXidCritical" in capsys.readouterr().out
    assert _wait_idle(drained) == "idle"
    assert _results(tmp_path)[:2] == ["resumed", "resume_forced"]
