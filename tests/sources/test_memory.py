"""MemorySource on procfs and cgroup v2 trees in the kernel's own file formats.

The files are written as the kernel writes them (Documentation/accounting/psi.rst;
cgroup v2's memory.events keys); the machine's own /proc/pressure/memory, when it
has one, is read too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatchd.config import load_text
from gpuwatchd.model import Event, Gpu, GpuInventory, GpuProcess, Sample
from gpuwatchd.sources import SourceContext, registry
from gpuwatchd.sources.memory.psi import parse_events, parse_pressure, v2_path
from gpuwatchd.sources.memory.source import EVENT, MemorySource

QUIET = (
    "some avg10=0.00 avg60=0.00 avg300=0.00 total=1204117\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=310552\n"
)
THRASH = (
    "some avg10=71.32 avg60=40.18 avg300=12.05 total=19842500\n"
    "full avg10=52.77 avg60=30.02 avg300=8.93 total=14208930\n"
)
EVENTS = "low 0\nhigh 0\nmax {max}\noom {oom}\noom_kill {kill}\noom_group_kill 0\n"
GROUP = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podx.slice/cri-x.scope"
# a cgroup v1 process (hybrid hierarchy without a v2 line), as /proc/PID/cgroup shows it
V1_ONLY = "12:memory:/user.slice\n11:pids:/user.slice/user-0.slice\n1:name=systemd:/init.scope\n"


class Node:
    """A procfs and a cgroupfs tree, and GPU processes for the source's inventory."""

    def __init__(self, root: Path) -> None:
        self.proc, self.cgroup = root / "proc", root / "cgroup"
        (self.proc / "pressure").mkdir(parents=True)
        self.pids: list[int] = []

    def psi(self, text: str) -> None:
        (self.proc / "pressure" / "memory").write_text(text)

    def process(self, pid: int, cgroup_file: str) -> None:
        (self.proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (self.proc / str(pid) / "cgroup").write_text(cgroup_file)
        self.pids.append(pid)

    def group(self, events: str, pressure: str = QUIET, path: str = GROUP) -> None:
        d = self.cgroup / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.events").write_text(events)
        (d / "memory.pressure").write_text(pressure)

    def inventory(self) -> GpuInventory:
        procs = tuple(GpuProcess(pid=p) for p in self.pids)
        return GpuInventory((Gpu(index=0, pci_bus_id="0000:19:00.0", processes=procs),))

    def source(self) -> MemorySource:
        return MemorySource(str(self.proc), str(self.cgroup), self.inventory)


def samples(got: list[Sample | Event] | tuple[Sample | Event, ...]) -> dict[str, float]:
    out = {}
    for s in got:
        if isinstance(s, Sample):
            out[s.name + "".join(f",{k}={v}" for k, v in s.labels)] = s.value
    return out


def events(got: object) -> list[Event]:
    return [e for e in got if isinstance(e, Event)]  # type: ignore[attr-defined]


def test_psi_and_memory_events_parse_in_base_units() -> None:
    psi = parse_pressure(THRASH)
    assert psi["full"].avg10 == pytest.approx(0.5277)
    assert psi["some"].avg300 == pytest.approx(0.1205)
    assert psi["full"].total_seconds == pytest.approx(14.20893)
    assert parse_events(EVENTS.format(max=3, oom=1, kill=1))["oom_kill"] == 1
    assert v2_path(f"0::{GROUP}\n") == GROUP
    assert v2_path(V1_ONLY) is None
    assert parse_pressure("some avg10=x\nbogus\n") == {}


def test_node_pressure_is_published_and_full_pressure_is_one_event(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.psi(QUIET)
    src = node.source()
    got = src.poll(100.0)
    s = samples(got)
    assert s["gpuwatchd_memory_pressure_available"] == 1
    assert s["gpuwatchd_memory_pressure_ratio,kind=full,window=10s"] == 0
    assert s["gpuwatchd_memory_pressure_stalled_seconds_total,kind=some"] == pytest.approx(1.204117)
    assert not events(got)
    node.psi(THRASH)
    (ev,) = events(src.poll(110.0))
    assert ev.kind == EVENT and ev.attr("scope") == "node" and not ev.attr("cgroup")
    assert "53 % of the last 10 s" in ev.message
    assert not events(src.poll(120.0))  # still high: said once
    node.psi(THRASH.replace("full avg10=52.77", "full avg10=6.00"))
    assert not events(src.poll(130.0))  # between half the threshold and it: still the same one
    node.psi(QUIET)
    src.poll(140.0)
    node.psi(THRASH)
    assert len(events(src.poll(150.0))) == 1  # fell, rose again: a new episode


def test_a_kernel_without_psi_says_so_and_polls_on(tmp_path: Path) -> None:
    node = Node(tmp_path)  # no pressure/memory: CONFIG_PSI off
    src = node.source()
    got = src.poll(100.0)
    assert samples(got)["gpuwatchd_memory_pressure_available"] == 0
    assert "CONFIG_PSI" in str(src.status()["pressure"])
    assert not any(k.startswith("gpuwatchd_memory_pressure_ratio") for k in samples(got))


def test_a_gpu_processes_cgroup_oom_kill_and_pressure_are_events_naming_its_pids(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path)
    node.psi(QUIET)
    node.process(4241, f"0::{GROUP}\n")
    node.process(4242, f"0::{GROUP}\n")
    node.group(EVENTS.format(max=0, oom=2, kill=2))  # old kills: before the daemon looked
    src = node.source()
    first = src.poll(100.0)
    assert not events(first)
    assert samples(first)["gpuwatchd_memory_job_cgroups"] == 1
    node.group(EVENTS.format(max=40, oom=3, kill=3), THRASH)
    got = events(src.poll(110.0))
    by_raw = {
        e.attr("raw").split()[1] if "memory.events" in e.attr("raw") else "psi": e for e in got
    }
    assert set(by_raw) == {"oom", "oom_kill", "psi"}
    assert (
        by_raw["oom"].message
        == f"memory cgroup {GROUP} hit its memory limit (memory.events oom 2->3)"
    )
    assert "OOM-killed (memory.events oom_kill 2->3)" in by_raw["oom_kill"].message
    assert by_raw["psi"].message.startswith(f"memory pressure in memory cgroup {GROUP}: every task")
    assert {e.attr("cgroup") for e in got} == {GROUP}
    assert {e.attr("pids") for e in got} == {"4241,4242"}
    s = samples(src.poll(120.0))
    assert s["gpuwatchd_memory_job_cgroup_events_total,event=oom_kill"] == 1
    # the group goes (the pod ended): forgotten
    for name in ("memory.events", "memory.pressure"):
        os.unlink(node.cgroup / GROUP.lstrip("/") / name)
    assert samples(src.poll(130.0))["gpuwatchd_memory_job_cgroups"] == 0


def test_a_cgroup_v1_node_reads_no_job_groups_and_says_why(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.psi(QUIET)
    node.process(4241, V1_ONLY)
    src = node.source()
    assert samples(src.poll(100.0))["gpuwatchd_memory_job_cgroups"] == 0
    assert "cgroup v2" in str(src.status()["job_cgroups"])


def test_built_from_config_and_reads_this_machine(tmp_path: Path) -> None:
    cfg = load_text("sources: {memory: {interval: 5, full_pressure_ratio: 0.2}}")
    src = registry()["memory"].factory(cfg, SourceContext())
    assert isinstance(src, MemorySource) and src.interval == 5
    got = src.poll(100.0)  # the real /proc/pressure/memory where the kernel has PSI
    have = os.path.exists("/proc/pressure/memory")
    assert samples(got)["gpuwatchd_memory_pressure_available"] == (1 if have else 0)


def test_a_real_oom_kill_in_a_memory_cgroup_is_an_event_though_its_pressure_stayed_zero(
    tmp_path: Path,
) -> None:
    """The files of a group whose rank the OOM killer killed on an H200 (fixtures/memory):
    the kill is an event from memory.events, while the group's PSI averages read 0.00, as
    a kill this fast leaves them; the node's real PSI is no event."""
    real = Path(__file__).resolve().parent.parent / "fixtures" / "memory" / "oom-kill-1xh200"
    node = Node(tmp_path)
    node.psi((real / "node-pressure-memory").read_text())
    node.process(483, f"0::{GROUP}\n")
    node.group(EVENTS.format(max=0, oom=0, kill=0))  # before the kill
    src = node.source()
    assert not events(src.poll(100.0))
    node.group((real / "memory.events").read_text(), (real / "memory.pressure").read_text())
    got = events(src.poll(110.0))
    kinds = sorted(e.attr("raw").split()[1] for e in got if "memory.events" in e.attr("raw"))
    assert kinds == ["oom", "oom_kill"] and len(got) == 2  # no pressure event
    assert all(e.attr("pids") == "483" for e in got)
    s = samples(src.poll(120.0))
    assert s["gpuwatchd_memory_job_cgroup_events_total,event=oom_kill"] == 1
    assert s["gpuwatchd_memory_pressure_ratio,kind=full,window=10s"] == 0.0
