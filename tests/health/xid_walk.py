"""A captured kernel log's walk to the store, the journal and the Xid rule, as data.

Every report of one file of tests/fixtures/kmsg/ goes through the kernel log
source (with a /proc that places every pid in a pod or a Slurm job and gives
it a rank), the Xid stage (MIG device, workload, an NVML copy of the first
report merged, lines joined, classified), and the event store. `walk` returns
what a user sees of them: the /events rows, the journal fields of the events
read back, and the active conditions as the Xid rule reads them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwatchd.clock import FakeClock
from gpuwatchd.health.xid.catalog import KINDS, default_catalog
from gpuwatchd.health.xid.merge import XidMerger
from gpuwatchd.health.xid.stage import XidStage, journal_fields
from gpuwatchd.health.xid.tracker import Observation, TrackerSettings, XidTracker
from gpuwatchd.model import (
    Event,
    Gpu,
    GpuInventory,
    GpuProcess,
    KmsgState,
    SourceSnapshot,
    Workload,
    WorkloadProcess,
    WorkloadSet,
)
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.filereader import FileReader
from gpuwatchd.sources.kmsg.source import KmsgSource
from gpuwatchd.state import NodeSnapshot
from tests.sources.kmsg_files import kmsg_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "kmsg"
GOLDEN = Path(__file__).parents[1] / "fixtures" / "xid-walk.json"
POD = "kubepods.slice/kubepods-pod0c4b1c3e_5d2a_4f6b_9e1d_2a3b4c5d6e7f.slice"
NvmlEvent = Callable[[int, str, float], Event]  # code, bus id, time -> NVML's Xid event


@dataclasses.dataclass
class Walk:
    rows: list[dict[str, Any]]  # /events, oldest first
    journal: list[dict[str, str]]  # of the events read back from the store
    conditions: list[dict[str, Any]]  # XidStage.conditions()
    observed: list[Observation]  # what the tracker made of each report
    read_back: list[Event]  # the store's events_since(0)

    def seen(self) -> dict[str, Any]:
        """The rows, journal fields and conditions as JSON values; file cursors name the
        fixture's inode, which no other checkout shares: left out."""
        seen = {"rows": self.rows, "journal": self.journal, "conditions": self.conditions}
        text = re.sub(r'"file:\d+:\d+:', '"file:-:-:', json.dumps(seen, sort_keys=True))
        return json.loads(text)  # type: ignore[no-any-return]


def _procfs(root: Path, text: str) -> None:
    """Every pid the log names: alive since boot, in a pod (even) or a Slurm job (odd)."""
    for pid in {int(p) for p in re.findall(r"pid=(\d+)", text)}:
        d = root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        cgroup = (
            f"/{POD}/cri-containerd-{'ab' * 32}.scope"
            if pid % 2 == 0
            else (f"/system.slice/slurmstepd.scope/job_{pid % 1000}/step_0/user/task_0")
        )
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        (d / "stat").write_text(f"{pid} (python3) S " + " ".join(["1"] * 20) + "\n")
        env = f"RANK={pid % 8}\0LOCAL_RANK={pid % 4}\0WORLD_SIZE=8\0MASTER_PORT=29500\0"
        (d / "environ").write_bytes(env.encode())


def walk(fixture: Path, tmp: Path, nvml_event: NvmlEvent) -> Walk:
    text = fixture.read_text(errors="replace")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = kmsg_config(tmp, tmp / "unused")
    _procfs(Path(cfg.paths.procfs), text)
    bus_m = re.search(r"\(PCI:([0-9a-fA-F:.]+)\)", text)
    bus = normalize_bus_id(bus_m.group(1)) if bus_m else ""
    pid_m = re.search(r"pid=(\d+)", text)
    pid = int(pid_m.group(1)) if pid_m else 1
    mig = GpuProcess(pid=pid, mig_uuid="MIG-7", gpu_instance=1, compute_instance=0)
    gpus = GpuInventory((Gpu(index=0, uuid="GPU-0", pci_bus_id=bus, processes=(mig,)),))
    job = Workload(
        "k8s",
        "ml/trainer-0",
        namespace="ml",
        pod="trainer-0",
        container="main",
        processes=(WorkloadProcess(pid=pid, gpu="0", pci_bus_id=bus, rank="5"),),
    )
    clock = FakeClock()
    src = KmsgSource(
        cfg,
        SourceContext(clock=clock, one_shot=True, gpus=lambda: gpus),
        opener=lambda cur: FileReader(str(fixture), cur, sleep=lambda s: None),
        sleep=lambda s: None,
    )
    store = EventStore(str(tmp / "events.db"), max_age_days=1e6, clock=clock.time)
    tracker = XidTracker(default_catalog(), TrackerSettings(), "boot-1")
    stage = XidStage(tracker, XidMerger(), store, lambda owner, samples: None, clock)
    stage.log_reports = False
    observed: list[Observation] = []
    observe = tracker.observe

    def spy(event: Event, restoring: bool = False, seen: float | None = None) -> Observation:
        obs = observe(event, restoring, seen)
        observed.append(obs)
        return obs

    tracker.observe = spy  # type: ignore[method-assign]
    try:
        events = tuple(e for e in src.poll(clock.time()) if isinstance(e, Event))
    finally:
        src.close()
    snap = NodeSnapshot(
        sources={
            "nvml": SourceSnapshot("nvml", (), True, payload=gpus),
            "workloads": SourceSnapshot("workloads", (), True, payload=WorkloadSet((job,))),
        }
    )
    first = next((e for e in events if e.kind == "xid"), None)
    if first is not None:  # NVML's copy of the first report: held, then merged into it
        nvml = nvml_event(first.code or 0, "0000" + first.pci_bus_id, first.time + 1.5)
        stage.on_publish(snap, None, (nvml,))
    kmsg = SourceSnapshot("kmsg", (), True, payload=KmsgState(reader_up=True, cursor="c"))
    stage.on_publish(snap, kmsg, events)
    clock.advance(60.0)
    stage.tick()
    rows = list(reversed(store.recent(limit=10_000)))
    read_back = [e for e in store.events_since(0.0) if e.kind in KINDS]
    conditions = [
        {**dataclasses.asdict(c), "severity": str(c.severity), "action": str(c.action)}
        for c in stage.conditions()
    ]
    for c in conditions:
        c["workload"] = [list(p) for p in c["workload"]]
    store.close()
    return Walk(rows, [journal_fields(e) for e in read_back], conditions, observed, read_back)
