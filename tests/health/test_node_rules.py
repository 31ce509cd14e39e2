"""Node rules over what the shm and infiniband sources really export.

InfiniBand samples come from polling the sysfs fixture tree (copied when
a test changes a value); /dev/shm samples from ShmSource over a real
directory. Capacity thresholds are checked on hand-made samples, since
a nearly full tmpfs cannot be made without mounting one.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from gpuwatchd.health.node_rules import (
    NodeRules,
    evaluate,
    infiniband_findings,
    shm_findings,
)
from gpuwatchd.model import Action, Finding, Gpu, GpuInventory, Sample, Severity, SourceSnapshot
from gpuwatchd.sources.infiniband.source import InfinibandSource
from gpuwatchd.sources.shm.source import ShmSource
from gpuwatchd.state import NodeSnapshot

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "sys"
GPUS = GpuInventory(
    tuple(
        Gpu(index=i, pci_bus_id=bus)
        for i, bus in enumerate(("0000:19:00.0", "0000:1b:00.0", "0000:3b:00.0", "0000:9d:00.0"))
    )
)
MIB = 1 << 20


def samples(items: object) -> list[Sample]:
    return [s for s in items if isinstance(s, Sample)]  # type: ignore[attr-defined]


def copy_tree(tmp_path: Path) -> Path:
    dst = tmp_path / "sys"
    shutil.copytree(FIXTURE, dst, symlinks=True)
    return dst


def port_file(root: Path, device: str, port: str, *rest: str) -> Path:
    return root / "class" / "infiniband" / device / "ports" / port / Path(*rest)


def alerts(findings: list[Finding]) -> set[tuple[str, str, str]]:
    return {
        (f.alertname, dict(f.subject).get("device", ""), dict(f.subject).get("port", ""))
        for f in findings
    }


def test_healthy_fixture_has_no_findings() -> None:
    src = InfinibandSource(str(FIXTURE), gpus=lambda: GPUS)
    first = samples(src.poll(0))
    second = samples(src.poll(1))
    assert infiniband_findings(second, first) == []  # mlx4_0/2 is down but was never up


def test_port_that_goes_down_is_critical_and_names_its_gpus(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = InfinibandSource(str(root), gpus=lambda: GPUS)
    before = samples(src.poll(0))
    port_file(root, "mlx5_0", "1", "state").write_text("1: DOWN\n")
    port_file(root, "mlx5_0", "1", "phys_state").write_text("2: Polling\n")
    found = infiniband_findings(samples(src.poll(1)), before)
    assert alerts(found) == {
        ("InfinibandPortDown", "mlx5_0", "1"),
        ("InfinibandPhysicalStateNotLinkUp", "mlx5_0", "1"),
    }
    down = next(f for f in found if f.alertname == "InfinibandPortDown")
    assert down.severity is Severity.CRITICAL and down.action is Action.DRAIN_AND_INSPECT
    assert dict(down.labels) == {"gpus": "0,1"}
    assert "DOWN" in down.reason and "GPUs 0,1 (the same PCIe switch)" in down.reason


def test_port_configured_as_expected_up_alerts_even_if_never_active() -> None:
    src = InfinibandSource(str(FIXTURE), expected_up="^mlx4_0/2$", gpus=lambda: GPUS)
    found = infiniband_findings(samples(src.poll(0)))
    assert alerts(found) == {
        ("InfinibandPortDown", "mlx4_0", "2"),
        ("InfinibandPhysicalStateNotLinkUp", "mlx4_0", "2"),
    }
    assert "Disabled" in next(f.reason for f in found if "Physical" in f.alertname)
    assert dict(found[0].labels) == {"gpus": "3"}  # only the NUMA node is shared


def test_rate_below_expected(tmp_path: Path) -> None:
    src = InfinibandSource(str(FIXTURE), expected_rate_gbps={"mlx5_1/1": 400})
    found = infiniband_findings(samples(src.poll(0)))
    assert alerts(found) == {("InfinibandRateDegraded", "mlx5_1", "1")}
    assert "100 Gb/s, expected 400 Gb/s" in found[0].reason


def test_rate_drop_below_the_highest_seen(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = InfinibandSource(str(root))
    src.poll(0)
    port_file(root, "mlx4_0", "1", "rate").write_text("20 Gb/sec (4X DDR)\n")
    found = infiniband_findings(samples(src.poll(1)))
    assert alerts(found) == {("InfinibandRateDegraded", "mlx4_0", "1")}


def test_error_counters_rising(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = InfinibandSource(str(root))
    before = samples(src.poll(0))
    port_file(root, "mlx5_0", "1", "counters", "symbol_error").write_text("7\n")
    port_file(root, "mlx5_0", "1", "counters", "link_error_recovery").write_text("1\n")
    port_file(root, "mlx5_0", "1", "counters", "port_rcv_packets").write_text("999999999999\n")
    found = infiniband_findings(samples(src.poll(1)), before)
    assert alerts(found) == {("InfinibandErrorsRising", "mlx5_0", "1")}
    assert "symbol_error +7" in found[0].reason and "link_error_recovery +1" in found[0].reason
    assert "packets" not in found[0].reason  # traffic counters are no errors


def test_a_reset_counts_the_new_value_as_the_increase(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    counter = port_file(root, "mlx4_0", "1", "counters", "port_xmit_discards")  # 5 in the fixture
    src = InfinibandSource(str(root))
    before = samples(src.poll(0))
    counter.write_text("0\n")
    quiet = samples(src.poll(1))
    assert infiniband_findings(quiet, before) == []  # reset to zero: nothing new happened
    counter.write_text("2\n")
    rising = samples(src.poll(2))
    assert "port_discards_transmitted +2" in infiniband_findings(rising, quiet)[0].reason
    counter.write_text("1\n")  # below 2: reset again, then one discard since
    found = infiniband_findings(samples(src.poll(3)), rising)
    assert "port_discards_transmitted +1" in found[0].reason


def test_stale_shm_segments_from_a_real_directory(tmp_path: Path) -> None:
    path = tmp_path / "nccl-abc123"
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 3 * MIB)
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    view = tmp_path / "procview"  # the processes we may inspect (see tests/sources/test_shm.py)
    view.mkdir()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and os.access(f"/proc/{pid}/maps", os.R_OK):
            try:
                os.listdir(f"/proc/{pid}/fd")
                with open(f"/proc/{pid}/maps", "rb") as f:
                    f.read(1)
            except OSError:
                continue
            (view / pid).symlink_to(f"/proc/{pid}")
    items = samples(ShmSource(str(tmp_path), str(view), ["nccl-*"], 60).poll(time.time()))
    (f,) = shm_findings(items)
    assert f.alertname == "ShmStaleSegments" and f.severity is Severity.WARNING
    assert "1 stale NCCL segment(s)" in f.reason and "3.0 MiB" in f.reason
    assert "cleanup_stale" in f.remediation


def capacity(size: float, avail: float, files: float = 1000, free: float = 900) -> list[Sample]:
    return [
        Sample.of("gpuwatchd_shm_size_bytes", size),
        Sample.of("gpuwatchd_shm_available_bytes", avail),
        Sample.of("gpuwatchd_shm_files", files),
        Sample.of("gpuwatchd_shm_files_free", free),
    ]


@pytest.mark.parametrize(
    ("items", "severity", "text"),
    [
        (capacity(64 * MIB, 32 * MIB), None, ""),
        (capacity(64 * MIB, 6 * MIB), Severity.WARNING, "91% of its 64 MiB used"),
        (capacity(64 * MIB, 0), Severity.CRITICAL, "100% of its 64 MiB used"),
        (capacity(64 * MIB, 32 * MIB, 1000, 50), Severity.WARNING, "95% of its inodes used"),
        (capacity(64 * MIB, 32 * MIB, 1000, 0), Severity.CRITICAL, "inodes"),
        (capacity(0, 0, 0, 0), None, ""),  # statvfs of nothing: no verdict
    ],
)
def test_shm_nearly_full(items: list[Sample], severity: Severity | None, text: str) -> None:
    found = shm_findings(items, full_warn_ratio=0.9)
    if severity is None:
        assert found == []
        return
    (f,) = found
    assert f.alertname == "ShmNearlyFull" and f.severity is severity and text in f.reason


def snapshot(ib: list[Sample], stamp: float, shm: list[Sample] | None = None) -> NodeSnapshot:
    sources = {"infiniband": SourceSnapshot("infiniband", tuple(ib), True, timestamp=stamp)}
    if shm is not None:
        sources["shm"] = SourceSnapshot("shm", tuple(shm), True, timestamp=stamp)
    return NodeSnapshot(sources=sources)


def test_node_rules_hold_the_rising_verdict_until_the_next_poll(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = InfinibandSource(str(root))
    rules = NodeRules()
    assert rules.evaluate(snapshot(samples(src.poll(0)), 0)) == []
    port_file(root, "mlx5_0", "1", "counters", "symbol_error").write_text("3\n")
    rising = snapshot(samples(src.poll(1)), 1, capacity(64 * MIB, 1 * MIB))
    first = rules.evaluate(rising)
    again = rules.evaluate(rising)  # another source published: same IB poll, same verdict
    assert {f.alertname for f in first} == {"InfinibandErrorsRising", "ShmNearlyFull"}
    assert again == first
    quiet = rules.evaluate(snapshot(samples(src.poll(2)), 2))
    assert quiet == []  # no new errors in the next poll


def test_evaluate_over_two_snapshots(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = InfinibandSource(str(root))
    prev = snapshot(samples(src.poll(0)), 0)
    port_file(root, "mlx5_0", "1", "counters", "link_downed").write_text("1\n")
    cur = snapshot(samples(src.poll(1)), 1)
    assert alerts(evaluate(cur, prev)) == {("InfinibandErrorsRising", "mlx5_0", "1")}
    assert evaluate(cur, cur) == []  # the same poll twice is no trend
    assert evaluate(NodeSnapshot()) == []
