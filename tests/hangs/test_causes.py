"""The hang's incident: node signals joined to the job by affinity and time, ranked.

Kernel lines are real ones (tests/fixtures/kmsg) read by the kernel log source's
parsers; InfiniBand and AER signals come from the real sources polling a copy of
tests/fixtures/sys (benchmarks/cause_faults.NodeFeed, the benchmark's injector).
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.cause_faults import KILL_CONTEXT, KILL_LINES, NEAR_BUS, NodeFeed, kernel_line
from gpuwatchd.cli.hang import render
from gpuwatchd.clock import SystemClock
from gpuwatchd.config import AlertmanagerConfig, Config
from gpuwatchd.health.hangs.alerts import finding_of
from gpuwatchd.health.hangs.causes import CauseMemory, Incident
from gpuwatchd.health.hangs.detector import JobVerdict
from gpuwatchd.health.hangs.record import HangRecord
from gpuwatchd.jobview import JobView, RankView
from gpuwatchd.model import (
    Event,
    Gpu,
    GpuInventory,
    GpuPlace,
    Sample,
    SourceSnapshot,
    Topology,
)
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.sources.kmsg.parse import parse_line
from gpuwatchd.sources.kmsg.process_kills import KillParser, to_event
from tests.servers import AlertmanagerServer, alertmanager_server

T0 = 1_800_000_000.0
JOB = JobView(
    "torch:127.0.0.1:29500",
    (RankView(4241, ("0",), 0, 2, 0), RankView(4242, ("1",), 1, 2, 1)),
    2,
    2,
    (("job", "train"),),
)


def dead(pid: int = 4242, since: float = T0, nodes: tuple[str, ...] = ()) -> JobVerdict:
    return JobVerdict(
        JOB.job,
        ("rank_dead",),
        since,
        "liveness",
        dead_pids=(pid,),
        reason="rank 1 died",
        nodes=nodes,
    )


def kernel_event(kind: str, pid: int, at: float) -> Event:
    """The kill report of a real kernel line (and its oom-kill context line), for `pid`."""
    parser = KillParser()
    if kind in KILL_CONTEXT:
        name, index, pattern = KILL_CONTEXT[kind]
        parser.feed(re.sub(pattern, str(pid), kernel_line(name, index)))
    name, index, pattern = KILL_LINES[kind]
    got = parser.feed(re.sub(pattern, str(pid), kernel_line(name, index)))
    assert got is not None
    return to_event(got, at, 0.0, boot_times=False)


def memory() -> CauseMemory:
    mem = CauseMemory()
    gpus = tuple(Gpu(index=i, pci_bus_id=f"0000:{0x19 + 2 * i:02x}:00.0") for i in range(4))
    places = tuple(
        GpuPlace(i, "", peers=tuple((o, "NV18") for o in range(4) if o != i)) for i in range(4)
    )
    inv = GpuInventory(gpus, Topology(places))
    mem.note(SourceSnapshot("nvml", (), True, timestamp=T0 - 100, payload=inv), (), T0 - 100)
    mem.note(SourceSnapshot("kmsg", (), True, timestamp=T0 - 100), (), T0 - 100)
    return mem


def test_the_oom_kill_of_the_dead_rank_is_the_cause_with_its_memory_cgroup() -> None:
    mem = memory()
    mem.note(None, (kernel_event("oom_kill", 4242, T0 - 2.1),), T0)
    inc = mem.incident(JOB, dead())
    assert inc.cause is not None and inc.cause.kind == "oom_kill"
    assert (inc.cause.rank, inc.cause.pid, inc.cause.affinity) == (1, 4242, "pid")
    assert inc.headline() == (
        "rank 1 (pid 4242) killed by the OOM killer (memory cgroup /lxc.payload....-lxc/"
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        "eded8c65_6e8e_4c6e_a889_3e427565c740.slice) 2.1 s before the job stopped"
    )


def test_a_kill_of_a_process_that_is_no_rank_is_not_joined() -> None:
    mem = memory()
    mem.note(None, (kernel_event("segfault", 999, T0 - 1),), T0)
    inc = mem.incident(JOB, dead())
    assert inc.cause is None
    assert inc.headline().startswith("no cause seen on this node (looked at: kernel log")
    assert "NVML (GPU lost" in inc.headline()


def test_a_cause_on_another_node_is_that_nodes_daemon_to_name() -> None:
    inc = memory().incident(JOB, dead(nodes=("node-17",)))
    assert inc.headline() == (
        "no cause seen on this node; the rank that stopped first runs on node-17: "
        "its daemon names the cause"
    )


def test_ranked_kind_first_then_the_dead_rank_then_time_and_the_window_holds() -> None:
    mem = memory()
    thermal = Sample.of("gpuwatchd_gpu_clock_event_active", 0, gpu=1, reason="hw_thermal_slowdown")
    mem.note(SourceSnapshot("nvml", (thermal,), True, timestamp=T0 - 50), (), T0)
    hot = Sample(thermal.name, 1.0, thermal.labels)
    mem.note(SourceSnapshot("nvml", (hot,), True, timestamp=T0 - 40), (), T0)
    # a trap of the live rank, a segfault of the dead one, an old one out of the window
    mem.note(None, (kernel_event("trap", 4241, T0 - 3),), T0)
    mem.note(None, (kernel_event("segfault", 4242, T0 - 1),), T0)
    mem.note(None, (kernel_event("oom_kill", 4242, T0 - 700),), T0)
    mem.note(None, (kernel_event("segfault", 4242, T0 + 120),), T0 + 120)
    inc = mem.incident(JOB, dead())
    assert [(c.kind, c.pid) for c in inc.causes] == [
        ("segfault", 4242),
        ("trap", 4241),
        ("thermal", 4242),
    ]
    assert inc.causes[2].text == (
        "rank 1 (pid 4242): hw thermal slowdown on GPU 1 (0000:1b:00.0) "
        "40.0 s before the job stopped"
    )
    assert inc.lines()[1].startswith("alternative: rank 0 (pid 4241) crashed (invalid opcode")


def test_an_sxid_reaches_every_rank_and_a_local_cause_keeps_the_nodes_ras_names() -> None:
    """An NVSwitch error (the real SXid line of tests/fixtures/kmsg) sits on no GPU of the
    job: it reaches every GPU of the fabric. RAS names another node too: both are said."""
    line = kernel_line("dmesg-h100-nvswitch-sxid22013.txt", 2)
    rec = parse_line(line)
    assert rec is not None and rec.kind == "sxid", line
    ev = Event("sxid", "kmsg", T0 - 4, code=rec.code, pci_bus_id=rec.pci_bus_id, message=rec.detail)
    mem = memory()
    mem.note(None, (ev,), T0)
    inc = mem.incident(JOB, dead(nodes=("node-17",)))
    assert inc.cause is not None and (inc.cause.kind, inc.cause.affinity) == ("xid", "node")
    assert inc.cause.incident == f"xid-{rec.pci_bus_id}-{rec.code}"
    assert inc.headline().startswith(f"SXid {rec.code} (")
    assert inc.headline().endswith(
        "4.0 s before the job stopped; ranks lost on node-17: their daemon names what broke there"
    )


def test_an_nvlink_peer_link_down_joins_through_the_topology() -> None:
    mem = memory()
    up = Sample.of("gpuwatchd_nvlink_up", 1, gpu=3, link="4")
    mem.note(SourceSnapshot("nvml", (up,), True, timestamp=T0 - 20), (), T0)
    down = Sample(up.name, 0.0, up.labels)
    mem.note(SourceSnapshot("nvml", (down,), True, timestamp=T0 - 10), (), T0)
    cause = mem.incident(JOB, dead()).cause
    assert cause is not None and (cause.kind, cause.affinity) == ("nvlink", "nvlink_peer")
    assert cause.text.startswith("rank 1 (pid 4242): NVLink link 4 down on GPU 3")


def _feed(tmp: Path, kind: str, target_gpu: int) -> NodeFeed:
    feed = NodeFeed(tmp, [0, 1], target_gpu, T0 - 120, random.Random(3))
    feed.inject(kind, T0 - 5, 4242)
    return feed


def _joined(feed: NodeFeed, job: JobView) -> Incident:
    mem = CauseMemory()
    for src, events in feed.due(T0 + 60):
        mem.note(src, events, T0)
    return mem.incident(job, dead())


def test_an_infiniband_port_down_near_the_ranks_gpu_is_the_cause(tmp_path: Path) -> None:
    """mlx5_0 shares a PCIe switch with the GPU at NEAR_BUS: the rank on it is hit."""
    feed = _feed(tmp_path, "infiniband", target_gpu=1)
    assert feed.bus[1] == NEAR_BUS
    cause = _joined(feed, JOB).cause
    assert cause is not None and (cause.kind, cause.rank, cause.affinity) == (
        "infiniband",
        1,
        "nic",
    )
    assert "port left ACTIVE (state 1) on mlx5_0 port 1 (near GPU 1)" in cause.text


def test_an_infiniband_port_down_far_from_the_job_is_not_its_cause(tmp_path: Path) -> None:
    """The job's GPUs sit under other root ports than mlx5_0 (fixture GPUs 2 and 3)."""
    feed = _feed(tmp_path, "infiniband", target_gpu=7)  # job GPUs 0, 1: on the far buses
    assert NEAR_BUS not in feed.bus.values()
    inc = _joined(feed, JOB)
    assert inc.cause is None, inc.headline()


def test_a_fatal_aer_error_on_the_switch_above_the_gpu_is_the_cause(tmp_path: Path) -> None:
    feed = _feed(tmp_path, "pcie", target_gpu=1)
    cause = _joined(feed, JOB).cause
    assert cause is not None and (cause.kind, cause.rank, cause.affinity) == (
        "pcie",
        1,
        "pcie_path",
    )
    assert "PCIe AER fatal errors 0->1 on 0000:18:00.0 (bridge)" in cause.text


def test_the_ranks_memory_cgroup_thrashing_is_the_cause(tmp_path: Path) -> None:
    """The real memory source reads the rank's pod group (kernel formats) in the feed."""
    cause = _joined(_feed(tmp_path, "memory_pressure", target_gpu=1), JOB).cause
    assert cause is not None and (cause.kind, cause.rank, cause.affinity) == (
        "memory_pressure",
        1,
        "cgroup",
    )
    assert cause.text.startswith("rank 1 (pid 4242): memory pressure in memory cgroup /kubepods")
    assert "every task stalled on memory 53 % of the last 10 s" in cause.text


def _memory_event(scope_pids: str, at: float) -> Event:
    attrs = [("scope", "cgroup" if scope_pids else "node"), ("raw", "full avg10=52.77")]
    if scope_pids:
        attrs += [("cgroup", "/job_7/step_0"), ("pids", scope_pids)]
    return Event(
        "memory_pressure", "memory", at, message="memory pressure on the node", attrs=tuple(attrs)
    )


def test_memory_pressure_joins_the_node_or_only_its_own_cgroups_ranks() -> None:
    mem = memory()
    mem.note(None, (_memory_event("777,778", T0 - 3),), T0)  # another job's group
    inc = mem.incident(JOB, dead())
    assert inc.cause is None
    assert "memory pressure (PSI) of the node and of the ranks' memory cgroups" in inc.headline()
    mem.note(None, (_memory_event("", T0 - 4),), T0)  # the node's PSI
    cause = mem.incident(JOB, dead()).cause
    assert cause is not None and (cause.kind, cause.rank, cause.affinity) == (
        "memory_pressure",
        None,
        "node",
    )
    assert cause.text == "memory pressure on the node 4.0 s before the job stopped"
    # a kill of the rank itself still ranks first
    mem.note(None, (kernel_event("oom_kill", 4242, T0 - 2.1),), T0)
    first = mem.incident(JOB, dead()).cause
    assert first is not None and first.kind == "oom_kill"


def test_the_incident_is_in_the_alert_hang_show_and_the_record() -> None:
    mem = memory()
    mem.note(None, (kernel_event("oom_kill", 4242, T0 - 2.1),), T0)
    mem.note(None, (kernel_event("trap", 4241, T0 - 1),), T0)
    rec = HangRecord(7, JOB, dead())
    rec.incident = mem.incident(JOB, dead())
    f = finding_of(rec)
    assert "Cause: rank 1 (pid 4242) killed by the OOM killer" in f.reason
    assert "Alternatives: rank 0 (pid 4241) crashed" in f.reason
    assert dict(f.labels)["cause"].splitlines()[0].startswith("rank 1 (pid 4242) killed")
    report = rec.report()
    doc = report.json()
    assert doc["causes"]["cause"]["kind"] == "oom_kill"
    assert doc["causes"]["alternatives"][0]["kind"] == "trap"
    text = render(report, 1, full=True)
    assert "  cause: rank 1 (pid 4242) killed by the OOM killer" in text
    assert "  alternative: rank 0 (pid 4241) crashed" in text
    assert "  cause evidence: python3[4242] killed by the OOM killer" in text


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerServer]:
    yield from alertmanager_server(tmp_path_factory)


def test_the_alertmanager_alert_carries_the_cause_as_an_annotation(
    tmp_path: Path, am: AlertmanagerServer
) -> None:
    now = time.time()  # Alertmanager takes no alert that starts after it ends
    mem = memory()
    mem.note(None, (kernel_event("oom_kill", 4242, now - 2.1),), now)
    rec = HangRecord(8, JOB, dead(since=now))
    rec.incident = mem.incident(JOB, dead(since=now))
    cfg = dataclasses.replace(Config(), alertmanager=AlertmanagerConfig(urls=[am.url]))
    sink = AlertSink(cfg, str(tmp_path / "alerts.db"), SystemClock(), "cause-node")
    sink.update([finding_of(rec)])
    assert sink.flush()
    (alert,) = am.alerts(node="cause-node")
    assert alert["labels"]["alertname"] == "JobHangSuspected" and "cause" not in alert["labels"]
    assert alert["annotations"]["cause"].startswith(
        "rank 1 (pid 4242) killed by the OOM killer (memory cgroup /lxc.payload"
    )
    assert "Cause: rank 1 (pid 4242) killed" in alert["annotations"]["description"]


@pytest.mark.parametrize("nvml_first", [True, False])
def test_an_xid_seen_by_nvml_and_the_kernel_log_is_one_cause_the_logs(nvml_first: bool) -> None:
    """Live on H200 a rank's Xid 31 was named twice: NVML's event copy first, the kernel
    log's (with its line and pid) as the alternative. One report, the log's words."""
    bus = "0000:1b:00.0"  # GPU 1, rank 1's
    nvml = Event("xid", "nvml", T0 - 0.2, 31, bus, message="Xid 31 reported by NVML's event API")
    log = Event("xid", "kmsg", T0 - 0.1, 31, bus, message="MMU Fault", attrs=(("pid", "4242"),))
    mem = memory()
    for ev in (nvml, log) if nvml_first else (log, nvml):
        mem.note(None, (ev,), T0)
    inc = mem.incident(JOB, dead())
    assert inc.cause is not None and inc.cause.kind == "xid"
    assert "MMU Fault" in inc.cause.what
    assert len(inc.causes) == 1, inc.causes


def test_another_processs_application_xid_on_the_shared_gpu_comes_after_every_cause() -> None:
    """Live on one H200 the smoke's own Xid 31 (another process, 24.9 s earlier, same GPU)
    was put on the dead rank as if its own. An application Xid is about its pid's work
    alone: another process's is listed last, named as no rank of the job."""
    bus = "0000:1b:00.0"  # GPU 1, rank 1's
    stranger = Event(
        "xid", "kmsg", T0 - 24.9, 31, bus, message="MMU Fault", attrs=(("pid", "999"),)
    )
    fallen = Event("xid", "kmsg", T0 - 20.0, 79, bus, message="GPU has fallen off the bus")
    mem = memory()
    mem.note(None, (stranger,), T0)
    inc = mem.incident(JOB, dead())
    assert inc.cause is not None and inc.cause.kind == "xid"
    assert (inc.cause.rank, inc.cause.pid) == (None, None)
    assert "of pid 999, no rank of the job" in inc.cause.text
    mem.note(None, (fallen,), T0)  # a GPU-wide Xid on the same GPU: the cause, first
    inc = mem.incident(JOB, dead())
    assert [c.kind for c in inc.causes] == ["gpu_lost", "xid"]
    assert inc.causes[0].rank == 1 and "no rank" in inc.causes[1].text
    own = Event("xid", "kmsg", T0 - 0.5, 31, bus, message="MMU Fault", attrs=(("pid", "4242"),))
    mem.note(None, (own,), T0)  # the rank's own Xid 31 ranks by its kind, before the stranger
    kinds = [(c.kind, c.pid) for c in mem.incident(JOB, dead()).causes]
    assert kinds.index(("xid", 4242)) < kinds.index(("xid", None))
