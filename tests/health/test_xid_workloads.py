"""Per-process truth in Xid bursts, multi-line Xid 13 reports joined, and the workload on
the event, in the store (also after a restart), in the log and on the alert."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config, DaemonConfig, KmsgConfig, PathsConfig, SourcesConfig
from gpuwatchd.health.xid import catalog as xid
from gpuwatchd.health.xid.stage import XidStage, xid_condition
from gpuwatchd.health.xid.tracker import TrackerSettings, XidTracker
from gpuwatchd.health.xid.workload import match_workload
from gpuwatchd.model import Event, GpuInventory, Workload, WorkloadProcess
from gpuwatchd.sinks.alertmanager.sink import alert_labels
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.source import KmsgSource
from gpuwatchd.sources.runner import Runner
from gpuwatchd.sources.workloads.slurm import SlurmJobs
from gpuwatchd.sources.workloads.source import WorkloadSource
from gpuwatchd.state import State
from tests.sources.test_workloads import gpu, inventory

T0 = 1_700_000_000.0
BUS = "0000:41:00.0"
UUID = "GPU-8a47641b-dff6-f09f-618c-c3eb58fb430d"
BOOT = "9d1f6a0e-1111-4222-8333-444455556666"
# Xid 13 as the driver prints it: GPC/TPC/SM and ESR lines, then the line naming the process.
XID13 = (
    "NVRM: Xid (PCI:0000:41:00): 13, Graphics SM Warp Exception on (GPC 1, TPC 0, SM 0):"
    " Illegal Instruction Encoding",
    "NVRM: Xid (PCI:0000:41:00): 13, Graphics Exception: ESR 0x50c730=0x30009 0x50c734=0x24"
    " 0x50c728=0x4c1eb72 0x50c72c=0x174",
    "NVRM: Xid (PCI:0000:41:00): 13, pid=4242, name=python3, Graphics Exception: ChID 0010,"
    " Class 0000c7c0, Offset 00000000, Data 00000000",
)


def ev(code: int, t: float, message: str = "", **attrs: str) -> Event:
    base = {"gpu": "0", "uuid": UUID, "boot_id": "b", **attrs}
    return Event("xid", "kmsg", t, code, BUS, message, attrs=tuple(sorted(base.items())))


def errors_total(t: XidTracker) -> float:
    return sum(s.value for s in t.samples(T0 + 100) if s.name == "gpuwatchd_xid_errors_total")


def test_two_processes_hitting_one_xid_on_one_gpu_are_two_faults() -> None:
    t = XidTracker(xid.default_catalog(), TrackerSettings(burst_window=60), "b")
    kinds = [
        t.observe(ev(31, T0, "fault a", pid="100")).kind,
        t.observe(ev(31, T0 + 10, "fault b", pid="200")).kind,
        t.observe(ev(31, T0 + 11, "fault a again", pid="100")).kind,
    ]
    assert kinds == ["new", "new", "repeat"]
    ids = {t.observe(ev(31, T0 + 12, "x", pid=p)).burst_id for p in ("100", "200")}
    assert len(ids) == 2  # each process keeps its own burst
    assert errors_total(t) == 5
    (active,) = t.active(T0 + 13)
    assert active.event.attr("pids") == "100,200"  # the alert names both processes


def test_multiline_xid13_is_one_event_with_the_pid_and_every_field() -> None:
    t = XidTracker(xid.default_catalog(), TrackerSettings(), "b")
    obs = [
        t.observe(ev(13, T0, XID13[0].split(": 13, ")[1])),
        t.observe(ev(13, T0 + 0.002, XID13[1].split(": 13, ")[1], esr="0x50c730")),
        t.observe(ev(13, T0 + 0.004, "Graphics Exception: ChID 0010", pid="4242", process="py")),
    ]
    assert [o.kind for o in obs] == ["new", "line", "line"]
    assert len({o.burst_id for o in obs}) == 1
    last = obs[-1].event
    assert (last.attr("pid"), last.attr("process"), last.attr("esr")) == ("4242", "py", "0x50c730")
    assert "GPC 1, TPC 0, SM 0" in last.message and "ChID 0010" in last.message
    assert last.attr("lines") == "3"
    assert errors_total(t) == 1  # one fault, three lines
    (active,) = t.active(T0 + 1)
    assert active.event.attr("pid") == "4242"
    # a second pid inside the window is another process: its own fault
    other = t.observe(ev(13, T0 + 0.005, "Graphics Exception: ChID 0011", pid="4343"))
    assert other.kind == "new" and errors_total(t) == 2


def test_identical_lines_are_repeats_not_continuations() -> None:
    t = XidTracker(xid.default_catalog(), TrackerSettings(), "b")
    kinds = [
        t.observe(ev(13, T0 + i * 0.001, "Graphics Exception: ESR 0x1=0x0")).kind for i in range(3)
    ]
    assert kinds == ["new", "repeat", "repeat"]


def test_match_by_pid_then_by_gpu() -> None:
    proc = WorkloadProcess(pid=7, gpu="0", uuid=UUID, pci_bus_id=BUS, rank="5")
    job = Workload("slurm", "12", slurm_job="12", processes=(proc,), gpus=(UUID,))
    other = Workload("k8s", "ns/p", namespace="ns", pod="p", gpus=("GPU-other",))
    assert match_workload(ev(31, T0, pid="7"), [other, job]) is job
    assert match_workload(ev(31, T0), [other, job]) is job  # no pid: the GPU's only workload
    assert match_workload(ev(31, T0, pid="8", slurm_job="99"), [job]) is None
    assert dict(job.attrs(7))["rank"] == "5"
    # a pod's process NVML has not listed yet: the pod the kubelet gave that GPU
    pod = Workload("k8s", "ns/p", namespace="ns", pod="p", gpus=(UUID,))
    new = ev(
        31, T0, pid="9", pod_uid="0f2d8c9e-1a2b-4c3d-8e9f-0a1b2c3d4e5f", attribution="kubernetes"
    )
    assert match_workload(new, [pod, other]) is pod
    assert match_workload(ev(31, T0, pid="9", attribution="host"), [pod]) is None


# --- through the stage, the store, a restart, the log and the alert ---------------------


class Node:
    """Kernel log + workloads source -> state -> Xid stage -> store, on a fake /proc."""

    def __init__(self, tmp: Path, clock: FakeClock, index: GpuInventory, **workloads: Any) -> None:
        (tmp / "boot_id").write_text(BOOT + "\n")
        self.cfg = Config(
            paths=PathsConfig(
                kmsg=str(tmp / "kmsg"), boot_id=str(tmp / "boot_id"), procfs=str(tmp / "proc")
            ),
            daemon=DaemonConfig(state_dir=str(tmp / "state")),
            sources=SourcesConfig(kmsg=KmsgConfig(backend="kmsg")),
        )
        self.state = State()
        self.store = EventStore.from_config(self.cfg, clock.time)
        self.stage = XidStage.from_config(self.cfg, self.state.publish_extra, self.store, clock)
        self.state.subscribe(self.stage.on_publish)
        ctx = SourceContext(clock=clock, load_cursor=self.store.load_cursor)
        self.kmsg = KmsgSource(self.cfg, ctx, wait=0.01, sleep=lambda s: None)
        workloads.setdefault("slurm", SlurmJobs(which=lambda n: None))
        self.workloads = WorkloadSource(lambda: index, procfs=str(tmp / "proc"), **workloads)
        self.runner = Runner([self.workloads, self.kmsg], self.state, clock)

    def stop(self) -> None:
        self.kmsg.close()
        self.store.close()


def test_xid13_with_workload_in_store_log_alert_and_after_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/slurm/uid_1000/job_5150/step_0/task_0\n")
    (proc / "environ").write_bytes(b"RANK=3\0WORLD_SIZE=8\0AWS_SECRET_ACCESS_KEY=nope\0")
    (proc / "comm").write_text("python3\n")
    index = inventory({BUS: gpu(0, UUID, [(4242, 1)])})
    clock = FakeClock(start=T0)
    # kernel times 1 ms apart; the pid comes on the third line
    (tmp_path / "kmsg").write_text(
        "".join(f"3,{i + 1},{1_000_000_000 + i * 1000},-;{line}\n" for i, line in enumerate(XID13))
    )
    node = Node(tmp_path, clock, index)
    caplog.set_level(logging.WARNING, logger="gpuwatchd")
    node.runner.poll_once("workloads")
    node.runner.poll_once("kmsg")
    clock.advance(1.0)
    node.stage.tick()

    (row,) = node.store.recent(10)
    assert row["code"] == 13 and row["pid"] == 4242 and row["count"] == 1
    attrs = row["attrs"]
    assert (attrs["slurm_job"], attrs["rank"], attrs["world_size"]) == ("5150", "3", "8")
    assert attrs["workload"] == "slurm" and "GPC 1" in row["message"]
    assert "nope" not in repr(row)
    logged = [r for r in caplog.records if "Xid 13" in r.getMessage()]
    assert len(logged) == 1 and getattr(logged[0], "XID_PID", "") == "4242"
    assert getattr(logged[0], "SLURM_JOB_ID", "") == "5150"
    errors = [
        s.value
        for s in node.state.snapshot().extra["xid"]
        if s.name == "gpuwatchd_xid_errors_total"
    ]
    assert errors == [1.0]

    def alert_of(stage: XidStage) -> tuple[dict[str, str], dict[str, str]]:
        from gpuwatchd.health import rules
        from gpuwatchd.health.history import History, View

        (active,) = stage.active()
        cond = xid_condition(active)
        inp = rules.Inputs(View(node.state.snapshot()), History(60), node.cfg, T0, (cond,))
        (finding,) = rules.xid(inp)
        return alert_labels(finding, "node1", {}), dict(finding.labels)

    labels, finding_labels = alert_of(node.stage)
    assert labels["slurm_job"] == "5150" and "rank" not in labels
    assert finding_labels["rank"] == "3" and finding_labels["world_size"] == "8"
    node.stop()

    again = Node(tmp_path, clock, index)
    (row2,) = again.store.recent(10)
    assert row2["attrs"] == attrs and row2["pid"] == 4242
    labels2, _ = alert_of(again.stage)
    assert labels2 == labels
    again.stop()
