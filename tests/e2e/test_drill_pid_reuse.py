"""Drill: a pid reused by another job must not carry the first job's Xid, or the reverse.

The daemon runs on the NVML replay with its proc root pointed at a /proc tree
built here: pid 4242 is rank 3 of Slurm job 111, then exits and the pid is
taken by rank 7 of job 222 (same command name, `python3`; only the start time
in /proc/PID/stat tells them apart). An Xid of the new process must name job
222; an Xid of the old one that arrives after the pid was taken must name job
111 (from the recently exited processes), never 222.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config, KmsgConfig, PathsConfig, SourcesConfig
from gpuwatchd.health.xid.workload import match_workload
from gpuwatchd.model import Event, Workload, WorkloadProcess
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.source import KmsgSource
from tests.conftest import FIXTURES, DaemonProcess
from tests.e2e.faults import wait_until

CAPTURE = FIXTURES / "nvml" / "h200x2-probe.json"  # GPU 0 at 0000:00:06.0
PID = 4242
HZ = os.sysconf("SC_CLK_TCK")


def fake_process(procfs: Path, job: str, rank: str, started: float) -> None:
    """/proc/PID of a Slurm task: cgroup, environ, comm, and stat with its start time."""
    d = procfs / str(PID)
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup").write_text(f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n")
    (d / "environ").write_bytes(f"RANK={rank}\0LOCAL_RANK={rank}\0WORLD_SIZE=8\0".encode())
    (d / "comm").write_text("python3\n")
    fields = ["S", "1", str(PID), str(PID), "0", "-1", "4194560"] + ["0"] * 12
    fields += [str(int(started * HZ)), "1000000", "100"]  # field 22: start time in ticks
    (d / "stat").write_text(f"{PID} (python3) " + " ".join(fields) + "\n")


def xid_line(logged: float) -> str:
    stamp = time.strftime("%b %d %H:%M:%S", time.localtime(logged))
    return (
        f"{stamp} node1 kernel: NVRM: Xid (PCI:0000:00:06): 31, pid={PID}, name=python3,"
        " channel 0x0000000a, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC0 GPCCLIENT_T1_6"
        " faulted @ 0x7f_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE\n"
    )


def test_a_reused_pid_is_blamed_on_the_right_job(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    capture = json.loads(CAPTURE.read_text())
    capture["devices"][0]["calls"]["compute_running_processes"] = [
        {"value": [{"pid": PID, "used_memory": 2 << 30}], "us": 20.0}
    ]
    replay = tmp_path / "with-process.json"
    replay.write_text(json.dumps(capture))
    procfs = tmp_path / "proc"
    boot = time.time() - time.monotonic()  # CLOCK_MONOTONIC, what the kernel stamps with
    fake_process(procfs, "111", "3", time.monotonic() - 600)
    kern = tmp_path / "kern.log"
    kern.write_text("")
    cfg = (
        f"paths:\n  procfs: {procfs}\n"
        "sources:\n  nvml:\n    interval: 0.3\n"
        f"  kmsg: {{backend: file, file: {kern}}}\n"
        "  workloads: {slurm: false}\n"
        "  udev:\n    enabled: false\n  shm:\n    enabled: false\n"
        "  infiniband:\n    enabled: false\n"
    )
    d = start_daemon(cfg, "--nvml-replay", str(replay))

    def jobs() -> list[str]:
        found = json.loads(d.get("/status")[1])["sources"].get("workloads", {})
        return [str(w.get("slurm_job")) for w in found.get("workloads", [])]

    assert wait_until(lambda: jobs() == ["111"]), d.output()[-3000:]
    # job 111 ends; job 222 starts on the same pid five seconds ago
    taken = time.monotonic() - 5
    fake_process(procfs, "222", "7", taken)
    assert wait_until(lambda: jobs() == ["222"], 5.0), f"the workload still says {jobs()}"

    with open(kern, "a") as f:
        f.write(xid_line(time.time()))  # from the new process

    def events() -> list[dict[str, dict[str, str]]]:
        return list(json.loads(d.get("/events?code=31")[1])["events"])

    [new] = wait_until(events)
    assert (new["attrs"]["slurm_job"], new["attrs"]["workload_id"]) == ("222", "222")
    assert new["attrs"]["rank"] == "7"

    with open(kern, "a") as f:
        f.write(xid_line(boot + taken - 20))  # the old process's, read after the pid was taken
    got = wait_until(lambda: len(events()) == 2 and events())
    assert got, d.output()[-3000:]
    old = next(e for e in got if e["attrs"] is not new["attrs"] and e != new)
    assert old["attrs"]["attribution"] == "pid reused"
    assert old["attrs"].get("workload_id") == "111", old["attrs"]
    assert old["attrs"].get("rank") == "3" and old["attrs"].get("slurm_job") == "111"


# --- a report without a time of its own (bare line, `dmesg -w > file`) ------------------


def _file_source(tmp_path: Path, kern: Path) -> tuple[KmsgSource, FakeClock]:
    procfs = tmp_path / "proc"
    procfs.mkdir(exist_ok=True)
    (tmp_path / "boot_id").write_text("6b1c1a36-8d7a-4b1e-9a55-0c2f7a1d0001\n")
    cfg = Config(
        paths=PathsConfig(kmsg=str(kern), boot_id=str(tmp_path / "boot_id"), procfs=str(procfs)),
        sources=SourcesConfig(kmsg=KmsgConfig(backend="file", file=str(kern))),
    )
    clock = FakeClock()
    src = KmsgSource(cfg, SourceContext(clock=clock), wait=0.0, sleep=lambda s: None)
    return src, clock


BARE = f"NVRM: Xid (PCI:0000:00:06): 31, pid={PID}, name=python3, channel 0x0000000a\n"


def test_a_timeless_xid_is_not_blamed_on_a_process_that_took_the_pid(tmp_path: Path) -> None:
    """Job 111's process logs an Xid and exits; job 222's takes the pid before the line is
    read. With no time on the line, the pid's start cannot tell them apart: the report
    names no job (it named 222)."""
    kern = tmp_path / "kern.log"
    kern.write_text("")
    src, clock = _file_source(tmp_path, kern)
    fake_process(tmp_path / "proc", "111", "3", clock.monotonic() - 600)
    src.poll(clock.time())  # reads to the end of the log
    clock.advance(10)
    for line in (BARE, f"[ {clock.monotonic() - 1:.6f}] {BARE}"):  # bare, and dmesg -w
        with kern.open("a") as f:
            f.write(line)
        clock.advance(2)
        fake_process(tmp_path / "proc", "222", "7", clock.monotonic() - 1)  # the newcomer
        clock.advance(2)
        [ev] = [e for e in src.poll(clock.time()) if isinstance(e, Event)]
        assert ev.attr("slurm_job") == "", f"blamed on job {ev.attr('slurm_job')}: {line!r}"
        assert ev.attr("attribution") in ("pid unverified", "pid reused")
        assert ev.attr("reused_pid_start") and ev.attr("rank") == ""
        src.poll(clock.time())  # the log's end again
        clock.advance(10)


def test_a_timeless_xid_of_a_process_older_than_the_last_read_is_attributed(
    tmp_path: Path,
) -> None:
    kern = tmp_path / "kern.log"
    kern.write_text("")
    src, clock = _file_source(tmp_path, kern)
    fake_process(tmp_path / "proc", "111", "3", clock.monotonic() - 600)
    src.poll(clock.time())
    clock.advance(5)
    with kern.open("a") as f:
        f.write(BARE)
    [ev] = [e for e in src.poll(clock.time()) if isinstance(e, Event)]
    assert ev.attr("slurm_job") == "111" and ev.attr("pid_start")


def test_an_unverified_pid_names_neither_the_old_nor_the_new_job() -> None:
    """The Xid stage's match: the exited job 111 and the running job 222 both had the pid."""
    old = Workload(
        "slurm", "111", slurm_job="111", processes=(WorkloadProcess(PID, "0", start_ticks=100),)
    )
    new = Workload(
        "slurm", "222", slurm_job="222", processes=(WorkloadProcess(PID, "0", start_ticks=900),)
    )
    ev = Event(
        "xid",
        "kmsg",
        1.0,
        31,
        "0000:00:06.0",
        attrs=(("attribution", "pid unverified"), ("pid", str(PID)), ("reused_pid_start", "900")),
    )
    assert match_workload(ev, [new, old]) is None
