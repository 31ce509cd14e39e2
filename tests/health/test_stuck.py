"""Stuck-GPU detection: the pure step over readings, and the adapter over NVML samples.

Samples for the adapter come from the NVML source replaying the real
2 x H200 capture (tests/fixtures/nvml), so the metric names and labels
are the ones the daemon really exports.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import load_text
from gpuwatchd.health.stuck import (
    ALERTNAME,
    GpuReading,
    StuckDetector,
    StuckState,
    StuckThresholds,
    matches,
    proc_describer,
    readings_from_samples,
    readings_from_snapshot,
    step,
)
from gpuwatchd.model import Action, GpuInventory, GpuProcess, Sample, Severity, SourceSnapshot
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource
from gpuwatchd.state import NodeSnapshot

H200X2 = Path(__file__).resolve().parent.parent / "fixtures" / "nvml" / "h200x2-probe.json"
T = StuckThresholds(min_duration_seconds=300, max_gap_seconds=120)
# An H200 (700 W limit, ~120 W idle in the capture) running a spin-wait kernel
STUCK = GpuReading("3", 1.0, 0.0, 126.0, 700.0, (("gpu", "3"),), ("4242 python train.py",))


@pytest.mark.parametrize(
    ("reading", "stuck"),
    [
        (STUCK, True),
        (replace(STUCK, utilization=0.0), False),  # idle
        (replace(STUCK, utilization=0.94), False),
        (replace(STUCK, power_watts=560.0), False),  # a real matmul: busy and hot
        (replace(STUCK, memory_utilization=0.35), False),  # memory-bound work
        (replace(STUCK, memory_utilization=0.02), True),
        (replace(STUCK, power_watts=210.0), True),  # exactly 30 % of 700 W
        (replace(STUCK, power_watts=211.0), False),
        (replace(STUCK, power_limit_watts=None), True),  # falls back to 150 W absolute
        (replace(STUCK, power_limit_watts=None, power_watts=151.0), False),
        (replace(STUCK, utilization=None), False),  # unread is never stuck
        (replace(STUCK, power_watts=None), False),
        (replace(STUCK, memory_utilization=None), False),
    ],
)
def test_matches(reading: GpuReading, stuck: bool) -> None:
    assert matches(reading, T) is stuck


def run(readings_at: list[tuple[float, list[GpuReading]]]) -> list[list[str]]:
    state = StuckState()
    fired = []
    for now, readings in readings_at:
        state, findings = step(state, readings, now, T)
        fired.append([f.subject[0][1] for f in findings])
    return fired


def test_fires_only_after_the_pattern_lasted_min_duration() -> None:
    times = [0, 30, 60, 120, 180, 240, 299, 300, 330]
    assert run([(t, [STUCK]) for t in times]) == [[]] * 7 + [["3"], ["3"]]


def test_a_single_normal_reading_restarts_the_clock() -> None:
    busy = replace(STUCK, power_watts=600.0)
    seq = [(t, [busy if t == 150 else STUCK]) for t in range(0, 481, 30)]
    fired = run(seq)
    assert fired[:-1] == [[]] * (len(seq) - 1)  # 300 s after 0 is not enough: reset at 150
    assert fired[-1] == ["3"]  # 480 = 180 + 300


def test_a_gap_in_readings_restarts_the_clock() -> None:
    times = [0, 30, 60, 90, 120, *range(300, 601, 30)]  # 120 -> 300 exceeds max_gap
    assert run([(t, [STUCK]) for t in times]) == [[]] * (len(times) - 1) + [["3"]]


def test_missing_gpu_in_a_poll_restarts_its_clock() -> None:
    other = replace(STUCK, gpu="4", subject=(("gpu", "4"),))
    seq = [(t, [STUCK, other]) for t in range(0, 301, 30)]
    seq[5] = (150, [other])  # GPU 3 not read at 150 s
    assert run(seq)[-1] == ["4"]


def test_finding_names_processes_and_says_what_to_do() -> None:
    state = StuckState()
    for t in range(1000, 1301, 60):
        state, findings = step(state, [STUCK], float(t), T)
    (f,) = findings
    assert f.alertname == ALERTNAME == "GpuStuckSuspected"
    assert f.severity is Severity.WARNING and f.action is Action.RESTART_APP
    assert f.subject == (("gpu", "3"),)
    assert f.since == 1000.0
    assert "4242 python train.py" in f.reason
    assert "100% busy at 126 W (18% of its limit)" in f.reason
    assert "5m00s" in f.reason
    assert "NCCL" in f.reason and "py-spy" in f.remediation


def test_disabled_detector_finds_nothing() -> None:
    off = replace(T, enabled=False, min_duration_seconds=0)
    assert step(StuckState(), [STUCK], 0, off)[1] == []


def test_thresholds_from_config_with_and_without_a_stuck_section() -> None:
    cfg = load_text("")
    got = StuckThresholds.from_config(cfg)
    section = getattr(cfg.health, "stuck", None)
    if section is None:
        assert got == StuckThresholds()
    else:
        assert got.min_duration_seconds == section.min_duration_seconds


# --- the adapter over the NVML source's real samples ---------------------------------


def nvml_snapshot(clock: FakeClock) -> SourceSnapshot:
    client = ReplayClient.load(H200X2, clock=clock)
    source = NvmlSource(client, clock=clock, call_timeout=2.0)
    try:
        items = source.poll(clock.time())
        gpus = source.payload()
    finally:
        client.release()
        source.close()
    samples = tuple(i for i in items if isinstance(i, Sample))
    return SourceSnapshot("nvml", samples, True, timestamp=clock.time(), payload=gpus)


def with_values(snap: SourceSnapshot, gpu: str, util: float, mem: float, power: float) -> tuple:
    out = []
    for s in snap.samples:
        if s.label("gpu") == gpu and s.name == "gpuwatchd_gpu_utilization_ratio":
            s = replace(s, value=util if s.label("engine") == "gpu" else mem)
        elif s.label("gpu") == gpu and s.name == "gpuwatchd_gpu_power_watts":
            s = replace(s, value=power)
        out.append(s)
    return tuple(out)


def test_readings_from_the_real_nvml_source() -> None:
    snap = nvml_snapshot(FakeClock())
    readings = readings_from_samples(snap.samples)
    assert [r.gpu for r in readings] == ["0", "1"]
    r0 = readings[0]
    # the capture: idle H200, 0 % utilisation, ~122 W of a 700 W limit
    assert r0.utilization == 0.0 and r0.memory_utilization == 0.0
    assert r0.power_watts == pytest.approx(121.753)
    assert r0.power_limit_watts == 700.0
    assert dict(r0.subject) == {
        "gpu": "0",
        "uuid": "GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6",
        "pci_bus_id": "0000:00:06.0",
    }
    assert not matches(r0, T)  # idle is not stuck


def test_detector_over_snapshots_names_the_processes_from_nvml_status() -> None:
    clock = FakeClock()
    base = nvml_snapshot(clock)
    assert base.inventory is not None
    mine = (GpuProcess(pid=os.getpid(), used_memory_bytes=1 << 30),)
    gpus = GpuInventory(
        tuple(replace(g, processes=mine) if g.index == 1 else g for g in base.inventory)
    )
    detector = StuckDetector(T, clock, describe=proc_describer("/proc"))
    found = []
    for t in range(0, 361, 30):
        snap = replace(
            base,
            samples=with_values(base, "1", 1.0, 0.0, 118.0),
            timestamp=clock.time() + t,
            payload=gpus,
        )
        found = detector.evaluate(NodeSnapshot(sources={"nvml": snap}))
        assert detector.evaluate(NodeSnapshot(sources={"nvml": snap})) == found  # idempotent
    (f,) = found
    assert dict(f.subject)["uuid"] == "GPU-cb99ac69-31a4-2508-9794-b7f3ed611416"
    assert f"{os.getpid()} " in f.reason and "python" in f.reason
    assert detector.stuck_since() == {"1": clock.time()}


def test_only_a_gpu_that_looks_stuck_has_its_processes_named_from_proc() -> None:
    # The detector runs on the consumer thread at every publish; it read every GPU
    # process's /proc/PID/cmdline each time (which waits on the process's memory map),
    # even for a poll it had judged. Now: a GPU showing the pattern, once per poll.
    clock = FakeClock()
    base = nvml_snapshot(clock)
    assert base.inventory is not None
    mine = (GpuProcess(pid=os.getpid(), used_memory_bytes=1 << 30),)
    gpus = GpuInventory(tuple(replace(g, processes=mine) for g in base.inventory))
    named: list[int] = []

    def describe(pid: int) -> str:
        named.append(pid)
        return f"{pid} python"

    detector = StuckDetector(T, clock, describe=describe)

    def poll(t: int, stuck: bool) -> NodeSnapshot:
        samples = with_values(base, "1", 1.0, 0.0, 118.0) if stuck else base.samples
        snap = replace(base, samples=samples, timestamp=clock.time() + t, payload=gpus)
        return NodeSnapshot(sources={"nvml": snap})

    healthy = poll(0, stuck=False)
    for _ in range(5):
        assert detector.evaluate(healthy) == []
    assert named == []  # no GPU shows the pattern: nobody to name
    stuck = poll(30, stuck=True)
    for _ in range(5):
        detector.evaluate(stuck)
    assert named == [os.getpid()]  # GPU 1 shows the pattern: named once for the poll


def test_no_nvml_source_no_readings() -> None:
    assert readings_from_snapshot(NodeSnapshot()) == (None, [])
    detector = StuckDetector(T, FakeClock())
    assert detector.evaluate(NodeSnapshot()) == []


def test_observe_uses_the_clock() -> None:
    clock = FakeClock()
    detector = StuckDetector(replace(T, min_duration_seconds=10), clock)
    assert detector.observe([STUCK]) == []
    clock.advance(10)
    assert [f.alertname for f in detector.observe([STUCK])] == [ALERTNAME]


def test_proc_describer_handles_gone_processes() -> None:
    describe = proc_describer("/proc")
    assert describe(os.getpid()).startswith(f"{os.getpid()} ")
    assert describe(2**22 + 12345) == str(2**22 + 12345)


def test_proc_describer_names_the_process_and_keeps_arguments_out_by_default(
    tmp_path: Path,
) -> None:
    proc = tmp_path / "proc" / "77"
    proc.mkdir(parents=True)
    (proc / "cmdline").write_bytes(b"/usr/bin/python3\0train.py\0--token=s3cret\nforged\0")
    assert proc_describer(str(tmp_path / "proc"))(77) == "77 python3"
    full = proc_describer(str(tmp_path / "proc"), full_cmdline=True)(77)
    assert full == "77 python3 train.py --token=s3cret\\nforged"
