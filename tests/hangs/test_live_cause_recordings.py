"""Dead ranks recorded on a real H200: the kernel's own records name the same cause again.

tests/fixtures/hangs/cause-kills-1xh200 holds, per scenario of tests/gpu/cause_kills.py
(a rank OOM-killed in a memory cgroup, a rank that segfaults, a rank that hits Xid 31),
the raw /dev/kmsg records from the fault until the daemon's alert and what the daemon
named (live.json). Here the kmsg source reads those records from a file as it reads
/dev/kmsg, and the cause join gets them with the live job and its verdict: it must name
the class, rank, pid, place and evidence the daemon named on the device, at the same
offset from the moment the job stopped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.health.hangs.causes import CauseMemory
from gpuwatchd.health.hangs.verdict import JobVerdict
from gpuwatchd.jobview import JobView, RankView
from gpuwatchd.model import Event, Gpu, GpuInventory, GpuPlace, SourceSnapshot, Topology
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.source import KmsgSource
from tests.sources.kmsg_files import kmsg_config

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hangs" / "cause-kills-1xh200"
LIVE: dict[str, Any] = json.loads((FIXTURE / "live.json").read_text())
BOOT_WALL = 1_800_000_000.0  # the replay's boot: kernel timestamps count from it


def kernel_events(tmp_path: Path, records: str, until_usec: int) -> list[Event]:
    """The events the kmsg source makes of raw records, read as /dev/kmsg is."""
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(records)
    clock = FakeClock(BOOT_WALL + 1000.0)  # its monotonic clock starts at 1000 s after boot
    clock.advance(until_usec / 1e6 - 1000.0)  # now: the live verdict, on the kernel's clock
    src = KmsgSource(
        kmsg_config(tmp_path, kmsg),
        SourceContext(clock=clock),
        wait=0.05,
        sleep=lambda s: None,
    )
    out: list[Event] = []
    for _ in range(3):  # a poll returns what the reader had; the held tail comes next
        out += [e for e in src.poll(clock.time()) if isinstance(e, Event)]
    src.close()
    return out


def memory(bus: str) -> CauseMemory:
    mem = CauseMemory()
    gpu = Gpu(index=0, pci_bus_id=normalize_bus_id(bus))  # NVML's 8-digit domain, as the source
    inv = GpuInventory((gpu,), Topology((GpuPlace(0, ""),)))
    t = BOOT_WALL
    mem.note(SourceSnapshot("nvml", (), True, timestamp=t, payload=inv), (), t)
    mem.note(SourceSnapshot("kmsg", (), True, timestamp=t), (), t)
    return mem


@pytest.mark.parametrize("scenario", sorted(LIVE["scenarios"]))
def test_the_recorded_kernel_records_name_the_cause_the_daemon_named_live(
    scenario: str, tmp_path: Path
) -> None:
    live = LIVE["scenarios"][scenario]
    named = live["causes"]["cause"]
    assert live["named_right"], "the live run named the wrong cause: not a fixture"
    # when the job stopped, on the kernel's clock: the live cause's time less its offset
    stopped_usec = live["fault_usec"] + round(
        (named["at"] - named["offset_seconds"] - live["fault_at"]) * 1e6
    )
    verdict_usec = live["fault_usec"] + round(live["seconds_to_verdict"] * 1e6)
    records = (FIXTURE / f"{scenario}.kmsg").read_text()
    events = kernel_events(tmp_path, records, verdict_usec)
    assert events, "the kmsg source made nothing of the recorded records"

    mem = memory(LIVE["gpu_bus_id"])
    mem.note(None, events, BOOT_WALL + verdict_usec / 1e6)
    ranks = (
        RankView(live["peer_pid"], ("0",), 0, 2, 0),
        RankView(live["victim_pid"], ("0",), 1, 2, 1),
    )
    job = JobView(live["job"], ranks, 2, 2, ())
    verdict = JobVerdict(
        live["job"],
        tuple(live["conditions"]),
        BOOT_WALL + stopped_usec / 1e6,
        "liveness",
        dead_pids=(live["victim_pid"],),
        reason=live["reason"],
    )
    got = mem.incident(job, verdict).cause
    assert got is not None
    assert (got.kind, got.rank, got.pid, got.affinity) == (
        named["kind"],
        named["rank"],
        named["pid"],
        named["affinity"],
    )
    assert (got.what, got.where, got.evidence) == (named["what"], named["where"], named["evidence"])
    assert got.offset_seconds == pytest.approx(named["offset_seconds"], abs=0.05)
    assert got.text == named["text"]


def test_the_recording_holds_the_three_causes_of_a_dead_rank() -> None:
    kinds = {name: s["causes"]["cause"]["kind"] for name, s in LIVE["scenarios"].items()}
    assert kinds == {"oom": "oom_kill", "segfault": "segfault", "xid31": "xid"}
    oom = (FIXTURE / "oom.kmsg").read_text()
    assert "invoked oom-killer" in oom and "CONSTRAINT_MEMCG" in oom  # the kernel's whole report
