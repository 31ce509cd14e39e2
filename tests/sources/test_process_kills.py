"""Kernel reports of killed, crashed and hung processes (sources/kmsg/process_kills.py).

Over real lines kept in tests/fixtures/kmsg (SOURCES.md says where each
comes from), then through the kmsg source reading a raw /dev/kmsg file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.model import KILL_KINDS, Event, ProcessKill, Sample
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.process_kills import (
    MAX_PENDING,
    KillParser,
    parse_kill,
    parse_oom_context,
    to_event,
)
from gpuwatchd.sources.kmsg.source import KmsgSource
from tests.sources.kmsg_files import FIX, kmsg_config, raw, xid_line

MIB = 1024 * 1024


def read_all(name: str, year: int = 2025) -> list[ProcessKill]:
    parser = KillParser()
    parser.year = year
    got = [parser.feed(line) for line in (FIX / name).read_text().splitlines()]
    return [g.kill for g in got if g is not None]


def test_oom_kills_of_the_whole_node_joined_to_their_oom_kill_line() -> None:
    kills = read_all("oom-kill-global.txt")
    assert [(k.kind, k.pid, k.process) for k in kills] == [
        ("oom_kill", 1440763, "perl"),
        ("oom_kill", 7899, "python"),
        ("oom_kill", 15784, "python3"),
        ("oom_kill", 15925, "(resolved)"),  # a comm in parentheses
    ]
    perl = kills[0]
    assert perl.signal == "SIGKILL" and perl.memcg is False  # CONSTRAINT_NONE: the node's memory
    assert perl.cgroup == "/user.slice/user-21417.slice/user@21417.service"
    assert perl.anon_rss_bytes == 60356340 * 1024 and perl.total_vm_bytes == 87033376 * 1024
    assert perl.uid == 21417
    assert kills[1].cgroup == "/init.scope"
    assert kills[1].total_vm_bytes == 26184840 * 1024  # digits grouped with commas in the source
    assert kills[2].memcg is None and kills[2].cgroup == ""  # no oom-kill line before it


def test_memory_cgroup_oom_kills() -> None:
    kills = read_all("oom-kill-memcg.txt")
    assert [(k.pid, k.process, k.memcg) for k in kills] == [
        (140339, "python3", True),
        (15617, "python3", True),
        (63214, "uwsgi", True),
    ]


def test_oom_kill_line_gives_the_pods_cgroups() -> None:
    line = (FIX / "oom-kill-memcg.txt").read_text().splitlines()[3]
    ctx = parse_oom_context(line)
    assert ctx is not None
    assert ctx["constraint"] == "CONSTRAINT_MEMCG" and ctx["task"] == "pt_main_thread"
    assert ctx["pid"] == "461754" and ctx["mems_allowed"] == "0-1"
    assert ctx["task_memcg"].endswith(
        "/cri-containerd-ec9ee26695deb4cc72bc665efff1cf3a03fdfb12f1303e02fe9252985e084a95.scope"
    )
    assert ctx["oom_memcg"].endswith(
        "kubepods-burstable-podeded8c65_6e8e_4c6e_a889_3e427565c740.slice"
    )
    # and a kill line of that pid takes them
    parser = KillParser()
    parser.feed(line)
    got = parser.feed(
        "[ 7063.247407] Memory cgroup out of memory: Killed process 461754 (pt_main_thread)"
        " total-vm:3149468kB, anon-rss:164992kB, file-rss:52176kB, shmem-rss:92kB"
    )
    assert got is not None and got.kill.memcg is True
    assert got.kill.cgroup == ctx["task_memcg"] and got.kill.limit_cgroup == ctx["oom_memcg"]
    assert got.kill.uid == 0


def test_oom_kill_of_kernels_before_5_0() -> None:
    (kill,) = read_all("oom-kill-before-5.0.txt")
    assert (kill.pid, kill.process, kill.memcg) == (28438, "java", True)  # the child sacrificed


def test_oom_kill_lines_waiting_for_their_kill_are_bounded() -> None:
    parser = KillParser()
    for pid in range(1, 10 * MAX_PENDING):
        parser.feed(f"[ 1.0] oom-kill:constraint=CONSTRAINT_MEMCG,task_memcg=/x,pid={pid},uid=0")
    assert len(parser._context) == MAX_PENDING


def test_segfaults() -> None:
    kills = read_all("segfault.txt")
    assert [(k.kind, k.pid, k.process, k.signal) for k in kills] == [
        ("segfault", 7777, "python3", "SIGSEGV"),
        ("segfault", 5019, "python", "SIGSEGV"),
        ("segfault", 19691, "a", "SIGSEGV"),
    ]
    py = kills[0]
    assert (py.address, py.ip, py.error_code, py.object) == (
        "0",
        "0000000000000000",
        0x14,
        "python3.7",
    )
    assert kills[1].cpu == 1 and kills[1].object == ""  # 6.1+: "likely on CPU 1", no object


def test_traps() -> None:
    kills = read_all("traps.txt")
    assert [(k.pid, k.process, k.signal, k.fault, k.object) for k in kills] == [
        (1466, "dmesg", "SIGILL", "invalid opcode", "dmesg"),
        (1286, "dmesg", "SIGILL", "invalid opcode", "dmesg"),
        (9640, "openarc", "SIGSEGV", "general protection", "openarc"),
        (2150063, "libretranslate", "SIGILL", "invalid opcode", "libctranslate2-e7e12a4c.so"),
        (244404, "pressure-vessel", "SIGILL", "invalid opcode", "libc.so.6"),
    ]


def test_hung_tasks_with_colons_and_brackets_in_their_names() -> None:
    kills = read_all("hung-task.txt")
    assert [(k.pid, k.process, k.blocked_seconds) for k in kills] == [
        (5403, "nvc:[driver]", 120),
        (2837, "GpuWatchdog", 120),
        (5747, "kworker/2:1", 120),
        (5, "kworker/u8:0", 120),
    ]
    assert all(k.kind == "hung_task" and k.signal == "" for k in kills)


@pytest.mark.parametrize(
    "line",
    [
        "oom_reaper: reaped process 1440763 (perl), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB",
        "Jul 17 09:12:47 clear.fortnebula.com kernel: Code: Bad RIP value.",
        "$ sudo sh -c \"echo 'Out of memory: Killed process 1 (python) total-vm:1kB'\"",
        "grep 'python[7777]: segfault at 0 ip 0 sp 0 error 14' /var/log/syslog",
        "the log said INFO: task python:1 blocked for more than 120 seconds. yesterday",
        "Killed process",
        "",
    ],
)
def test_lines_that_are_no_report(line: str) -> None:
    assert KillParser().feed(line) is None
    assert parse_kill(line) is None


def test_a_parser_bug_costs_the_line_not_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = KillParser()

    def broken(line: str, year: int | None = None) -> None:
        raise ValueError("bug")

    monkeypatch.setattr("gpuwatchd.sources.kmsg.process_kills.parse_kill", broken)
    assert parser.feed("[ 1.0] INFO: task python:1 blocked for more than 120 seconds.") is None
    assert parser.errors == 1


def test_a_mib_line_is_cut_to_a_record_and_parsed_fast() -> None:
    line = "[ 1.0] " + "Killed process 1 (" * (MIB // 18)
    assert parse_kill(line) is None
    line = "[ 1.0] INFO: task " + "x" * MIB + ":1 blocked for more than 120 seconds."
    assert parse_kill(line) is None


def test_event_time_fields_and_typed_round_trip() -> None:
    parser = KillParser()
    parser.year = 2024
    lines = (FIX / "oom-kill-global.txt").read_text().splitlines()
    parser.feed(lines[0])
    got = parser.feed(lines[1])
    assert got is not None
    ev = to_event(got, now=2e9, boot_wall=1e9)
    assert ev.kind == "oom_kill" and ev.source == "kmsg"
    assert ev.time == pytest.approx(1714395341.6797)  # the line's own ISO stamp
    assert ev.message == "perl[1440763] killed by the OOM killer"
    # the payload is the parsed fields with the line's origin and stamp; its view the attrs
    want = dataclasses.replace(got.kill, origin=got.prefix.origin, stamp=got.prefix.stamp)
    assert ev.kill == want and ev.attr("origin") == got.prefix.origin
    assert ProcessKill.from_attrs(ev.kind, dict(ev.attrs)) == ev.kill
    assert ev.attr("pid") == "1440763" and ev.attr("cgroup").startswith("/user.slice")
    # only the kernel's boot stamp: boot time + stamp, unless the stamps are another boot's
    (hung,) = [
        g
        for g in map(
            parser.feed,
            ["[ 9426.062972] INFO: task GpuWatchdog:2837 blocked for more than 120 seconds."],
        )
        if g
    ]
    assert to_event(hung, now=2e9, boot_wall=1e9).time == pytest.approx(1e9 + 9426.062972)
    assert to_event(hung, now=2e9, boot_wall=1e9, boot_times=False).time == 2e9
    assert Event("hang", "hangs", 0.0).kill is None
    assert set(KILL_KINDS) == {"oom_kill", "segfault", "trap", "hung_task"}


# --- through the kmsg source -----------------------------------------------------------


def kill_events(items: object) -> list[Event]:
    return [i for i in items if isinstance(i, Event) and i.kind in KILL_KINDS]  # type: ignore[attr-defined]


def test_source_reports_kills_beside_xids_from_raw_kmsg_records(tmp_path: Path) -> None:
    # the messages are real (the fixtures above); the /dev/kmsg record heads are ours
    ctx_line = (FIX / "oom-kill-global.txt").read_text().splitlines()[0].split(" ", 1)[1]
    kill_line = (FIX / "oom-kill-global.txt").read_text().splitlines()[1].split(" ", 1)[1]
    segv = "python[5019]: segfault at 1 ip 0000000000000001 sp 00007fff75097a90 error 14"
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        raw(1, ctx_line, level=6, usec=5_000_000)
        + raw(2, kill_line, level=3, usec=5_000_100)
        + raw(3, xid_line("0000:00:06", 31), usec=6_000_000)
        + raw(4, segv, level=6, usec=7_000_000)
        + raw(5, segv, facility=1, usec=8_000_000)  # user space writing the same: not a report
    )
    clock = FakeClock()
    src = KmsgSource(
        kmsg_config(tmp_path, kmsg),
        SourceContext(clock=clock),
        wait=0.05,  # type: ignore[arg-type]
        sleep=lambda s: None,
    )
    out = src.poll(clock.time())
    kills = kill_events(out)
    assert [(e.kind, e.attr("pid"), e.attr("origin")) for e in kills] == [
        ("oom_kill", "1440763", "kernel"),
        ("segfault", "5019", "kernel"),
    ]
    assert kills[0].kill is not None and kills[0].kill.memcg is False
    assert kills[0].time == pytest.approx(src._boot_wall + 5.0001)
    assert [e.code for e in out if isinstance(e, Event) and e.kind == "xid"] == [31]
    counts = {
        s.label("kind"): s.value
        for s in out
        if isinstance(s, Sample) and s.name == "gpuwatchd_kmsg_process_kills_total"
    }
    assert counts == {"oom_kill": 1, "segfault": 2, "trap": 0, "hung_task": 0}
