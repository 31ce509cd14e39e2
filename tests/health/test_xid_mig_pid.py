"""An Xid raised inside a MIG instance, logged without GPU-I/GPU-CI, is placed on its MIG
device by its pid: the real H100 capture (NVML lists the process under GPU instance 2),
the real kernel line, the daemon's NVML, kernel log and workloads sources, the Xid stage,
the store and a real Alertmanager."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock, SystemClock
from gpuwatchd.config import (
    AlertmanagerConfig,
    Config,
    DaemonConfig,
    KmsgConfig,
    PathsConfig,
    SourcesConfig,
)
from gpuwatchd.health import rules
from gpuwatchd.health.history import History, View
from gpuwatchd.health.xid.stage import XidStage, xid_condition
from gpuwatchd.health.xid.workload import attach_mig
from gpuwatchd.model import Event, Gpu, GpuInventory, GpuProcess
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.source import KmsgSource
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource
from gpuwatchd.sources.runner import Runner
from gpuwatchd.sources.workloads.slurm import SlurmJobs
from gpuwatchd.sources.workloads.source import WorkloadSource
from gpuwatchd.state import State
from tests.servers import AlertmanagerServer, alertmanager_server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURE = FIXTURES / "nvml" / "h100-mig-instances-record.json"
KMSG = FIXTURES / "kmsg" / "kmsg-h100-mig-xid31.txt"
T0 = 1_700_000_000.0
PID = 457  # the process NVML lists on GPU instance 2, compute instance 0 in the capture
SHIFT_US = 923_000_000
BOOT = "9d1f6a0e-1111-4222-8333-444455556666"


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerServer]:
    yield from alertmanager_server(tmp_path_factory)


def kernel_log() -> str:
    # The two recordings come from different runs: the faulting process was pid 486 in the
    # kernel log and pid 457 in the NVML capture. Give the line the capture's pid.
    # The kernel stamped the lines 76 s after boot; FakeClock's monotonic time starts at
    # 1000 s: shift the stamps (only those) so the fault is 1 s old, not 15 minutes.
    text = KMSG.read_text()
    assert "pid=486," in text and "GPU-I" not in text
    lines = []
    for rec in text.replace("pid=486,", f"pid={PID},").splitlines():
        prefix, _, message = rec.partition(";")
        level, seq, usec, *flags = prefix.split(",")
        lines.append(f"{','.join([level, seq, str(int(usec) + SHIFT_US), *flags])};{message}\n")
    return "".join(lines)


class MigNode:
    """Replayed NVML + kernel log (+ workloads on a fake /proc) -> state -> Xid stage."""

    def __init__(self, tmp: Path, workloads: bool) -> None:
        self.workloads = workloads
        (tmp / "boot_id").write_text(BOOT + "\n")
        (tmp / "kmsg").write_text(kernel_log())
        self.clock = FakeClock(start=T0)
        self.cfg = Config(
            paths=PathsConfig(
                kmsg=str(tmp / "kmsg"), boot_id=str(tmp / "boot_id"), procfs=str(tmp / "proc")
            ),
            daemon=DaemonConfig(state_dir=str(tmp / "state")),
            sources=SourcesConfig(kmsg=KmsgConfig(backend="kmsg")),
        )
        self.state = State()
        self.store = EventStore.from_config(self.cfg, self.clock.time)
        self.stage = XidStage.from_config(
            self.cfg, self.state.publish_extra, self.store, self.clock
        )
        self.state.subscribe(self.stage.on_publish)
        ctx = SourceContext(clock=self.clock, load_cursor=self.store.load_cursor)
        self.nvml = NvmlSource(ReplayClient.load(CAPTURE), call_timeout=2.0)
        self.kmsg = KmsgSource(self.cfg, ctx, wait=0.01, sleep=lambda s: None)
        sources: list[NvmlSource | KmsgSource | WorkloadSource] = [self.nvml, self.kmsg]
        if workloads:
            proc = tmp / "proc" / str(PID)
            proc.mkdir(parents=True)
            (proc / "cgroup").write_text("0::/user.slice/user-1000.slice/session-3.scope\n")
            (proc / "environ").write_bytes(b"RANK=0\0WORLD_SIZE=1\0")
            (proc / "comm").write_text("python3\n")

            def gpus() -> GpuInventory:
                return self.nvml.payload()

            wl = WorkloadSource(
                gpus, procfs=str(tmp / "proc"), slurm=SlurmJobs(which=lambda n: None)
            )
            sources.append(wl)
        self.runner = Runner(sources, self.state, self.clock)

    def run(self) -> None:
        self.runner.poll_once("nvml")
        if self.workloads:
            self.runner.poll_once("workloads")
        self.runner.poll_once("kmsg")
        self.clock.advance(1.0)
        self.stage.tick()

    def stop(self) -> None:
        self.kmsg.close()
        self.nvml.close()
        self.store.close()


def test_mig_instance_from_the_nvml_process_list(tmp_path: Path, am: AlertmanagerServer) -> None:
    node = MigNode(tmp_path, workloads=False)
    try:
        node.run()
        gpus = node.nvml.status()["gpus"]
        assert isinstance(gpus, dict)
        (listed,) = [p for g in gpus.values() for p in g["processes"] if p["pid"] == PID]
        assert (listed["gpu_instance"], listed["compute_instance"]) == (2, 0)
        mig_uuid = listed["mig_uuid"]
        assert mig_uuid.startswith("MIG-")

        (row,) = node.store.recent(10)  # what /events shows
        attrs = row["attrs"]
        assert row["code"] == 31 and row["pid"] == PID
        assert (attrs["gpu_instance"], attrs["compute_instance"]) == ("2", "0")
        assert attrs["mig_uuid"] == mig_uuid

        conds = tuple(xid_condition(a) for a in node.stage.active())
        inp = rules.Inputs(View(node.state.snapshot()), History(60), node.cfg, T0, conds)
        findings = rules.xid(inp)
        cfg = dataclasses.replace(Config(), alertmanager=AlertmanagerConfig(urls=[am.url]))
        sink = AlertSink(cfg, str(tmp_path / "alerts.db"), SystemClock(), "mig-node")
        sink.update(findings)
        assert sink.flush()
        (alert,) = am.alerts(node="mig-node")
        ann = alert["annotations"]
        assert isinstance(ann, dict)
        assert f"mig_uuid={mig_uuid}, gpu_instance=2, compute_instance=0." in ann["description"]
        sink.stop()
    finally:
        node.stop()


def test_mig_instance_from_the_workload_process(tmp_path: Path) -> None:
    node = MigNode(tmp_path, workloads=True)
    try:
        node.run()
        shown = node.state.snapshot().sources["workloads"].status["workloads"]
        assert isinstance(shown, list) and len(shown) == 1  # /status
        (p,) = shown[0]["processes"]
        assert (p["pid"], p["gpu_instance"], p["compute_instance"]) == (PID, "2", "0")
        (row,) = node.store.recent(10)
        attrs = row["attrs"]
        assert (attrs["gpu_instance"], attrs["compute_instance"]) == ("2", "0")
        assert attrs["mig_uuid"] == p["uuid"] and attrs["workload_id"] == str(PID)
        assert attrs["rank"] == "0"
    finally:
        node.stop()


def test_what_the_line_says_wins_and_other_gpus_do_not_match() -> None:
    on_mig = GpuProcess(pid=7, gpu_instance=2, compute_instance=0, mig_uuid="MIG-a")
    gpus = GpuInventory((Gpu(index=0, pci_bus_id="0000:00:06.0", processes=(on_mig,)),))

    def xid31(bus: str, **attrs: str) -> Event:
        return Event("xid", "kmsg", T0, 31, bus, "fault", attrs=tuple(sorted(attrs.items())))

    placed = attach_mig(xid31("0000:00:06.0", pid="7"), gpus)
    assert (placed.attr("gpu_instance"), placed.attr("mig_uuid")) == ("2", "MIG-a")
    said = xid31("0000:00:06.0", pid="7", gpu_instance="1", compute_instance="0")
    assert attach_mig(said, gpus) is said
    assert attach_mig(xid31("0000:00:07.0", pid="7"), gpus).attr("gpu_instance") == ""
    assert attach_mig(xid31("0000:00:06.0", pid="8"), gpus).attr("gpu_instance") == ""
