"""Kernel log lines that say a process was killed, crashed or hung: typed events.

Four reports, in the shapes the kernel prints them (mm/oom_kill.c,
arch/x86/mm/fault.c and kernel/signal.c's show_signal, arch/x86/kernel/traps.c,
kernel/hung_task.c), behind any prefix the kernel log readers see (raw
/dev/kmsg, dmesg, syslog, journal):

- OOM kill: `Out of memory: Killed process PID (comm) total-vm:...kB, anon-rss:...kB, ...`;
  the memory-cgroup form starts `Memory cgroup out of memory:`; kernels before 5.0
  print a bare `Killed process PID (comm) ...` after a `... Kill process ... or
  sacrifice child` line. The `oom-kill:constraint=...,oom_memcg=...,task_memcg=...,
  task=...,pid=...,uid=...` line just before names the cgroups; it is joined to the
  kill by pid.
- segfault: `comm[PID]: segfault at ADDR ip IP sp SP error N in OBJECT[BASE+SIZE]`
  (`likely on CPU N (core C, socket S)` since 6.1). Printed only when the process
  has no SIGSEGV handler: a rank with Python's faulthandler on prints none.
- trap: `traps: comm[PID] general protection fault ip:IP sp:SP error:N in OBJECT[...]`,
  `traps: comm[PID] trap invalid opcode ip:...`, `trap divide error`, ...
- hung task: `INFO: task comm:PID blocked for more than N seconds.`

Only text after a kernel record's head counts (heads.kernel_head, the Xid parser's
rule), so a shell command or a note that quotes such a line is no report; a line that the
prefix says user space wrote is marked so (origin "user").
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass

from gpuwatchd.model import KILL_KINDS, Event, MetricSpec, ProcessKill, Sample, Severity
from gpuwatchd.sources.kmsg.heads import kernel_head
from gpuwatchd.sources.kmsg.prefix import Prefix, parse_prefix

__all__ = ["KillParser", "METRICS", "ParsedKill", "parse_kill", "parse_oom_context", "to_event"]

log = logging.getLogger("gpuwatchd.sources.kmsg.process_kills")

METRICS = (
    MetricSpec(
        "gpuwatchd_kmsg_process_kills_total",
        "counter",
        "kernel reports of a process killed or crashed (oom_kill, segfault, trap) or stuck in"
        " uninterruptible sleep (hung_task), by kind",
        ("kind",),
    ),
)

MAX_LINE = 8192  # a kernel record's size; longer lines are cut before matching
MAX_PENDING = 64  # oom-kill context lines waiting for their kill line, at most
_COMM = r"(?P<comm>[^\[\]\n]{1,16}?)"
_OOM = re.compile(
    r"(?P<head>Memory cgroup out of memory: |Out of memory: )?Killed process (?P<pid>\d{1,10})"
    r" \((?P<comm>.{0,16}?)\)(?=[\s,]|$)"
    r"(?: total-vm:(?P<vm>[\d,]{1,24})kB, anon-rss:(?P<anon>[\d,]{1,24})kB"
    r"(?:.{0,80}?UID:(?P<uid>\d{1,10}))?)?"
)
_OOM_CONTEXT = re.compile(r"oom-kill:(constraint=[^\n]{0,2048})")
_OLD_MEMCG = re.compile(r"Memory cgroup out of memory: Kill process \d{1,10} ")
_SEGFAULT = re.compile(
    r"(?<![^\s;\]])(?P<comm>[^\s\[\]]{1,16})\[(?P<pid>\d{1,10})\]: segfault at"
    r" (?P<addr>[0-9a-fA-F]{1,16})"
    r" ip (?P<ip>[0-9a-fA-F]{1,16}) sp [0-9a-fA-F]{1,16} error (?P<err>[0-9a-fA-F]{1,8})"
    r"(?: in (?P<obj>[^\s\[]{1,256})\[)?(?:.{0,64}? likely on CPU (?P<cpu>\d{1,5}))?"
)
_TRAP = re.compile(
    r"traps: " + _COMM + r"\[(?P<pid>\d{1,10})\] (?P<what>[a-z][a-z0-9 ]{1,40}?)"
    r" ip:(?P<ip>[0-9a-fA-F]{1,16}) sp:[0-9a-fA-F]{1,16} error:(?P<err>[0-9a-fA-F]{1,8})"
    r"(?: in (?P<obj>[^\s\[]{1,256})\[)?(?:.{0,64}? likely on CPU (?P<cpu>\d{1,5}))?"
)
_HUNG = re.compile(
    # the name may hold ':' and brackets (kworker/2:1, nvc:[driver]): the pid is the last number
    r"INFO: task (?P<comm>[^\n]{1,16}?):(?P<pid>\d{1,10}) blocked for more than"
    r" (?P<secs>\d{1,10}) seconds"
)
# The signal an unhandled x86 fault delivers (arch/x86/kernel/traps.c)
_TRAP_SIGNALS = {
    "general protection": "SIGSEGV",
    "general protection fault": "SIGSEGV",
    "trap invalid opcode": "SIGILL",
    "trap divide error": "SIGFPE",
    "trap int3": "SIGTRAP",
    "trap bounds": "SIGSEGV",
    "trap stack segment": "SIGBUS",
    "trap alignment check": "SIGBUS",
    "trap segment not present": "SIGBUS",
    "trap invalid TSS": "SIGSEGV",
    "trap overflow": "SIGSEGV",
}


@dataclass(frozen=True, slots=True)
class ParsedKill:
    """A report as read from one line, with what its prefix says (who wrote it, when)."""

    kill: ProcessKill
    prefix: Prefix
    line: str


def _int(text: str | None) -> int | None:
    if not text:
        return None
    digits = text.replace(",", "")
    return int(digits) if digits.isdigit() else None


def _hex(text: str | None) -> int | None:
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


def _may_report(line: str) -> bool:
    # "Kill" covers "Killed process" and the pre-5.0 "Kill process"
    return (
        "Kill" in line
        or "segfault at" in line
        or "traps: " in line
        or "blocked for more than" in line
        or "oom-kill:" in line
    )


def parse_kill(line: str, year: int | None = None) -> ParsedKill | None:
    """One line -> the report it holds, or None. The oom-kill context line is KillParser's."""
    if not _may_report(line):
        return None
    text = line[:MAX_LINE].rstrip("\r\n")
    if "Killed process" in text:
        m = _OOM.search(text)
        if m is not None and (p := _prefix(text, m.start(), year)) is not None:
            kb = 1024
            vm, anon = _int(m.group("vm")), _int(m.group("anon"))
            kill = ProcessKill(
                kind="oom_kill",
                pid=int(m.group("pid")),
                process=m.group("comm"),
                signal="SIGKILL",
                memcg=True if (m.group("head") or "").startswith("Memory cgroup") else None,
                total_vm_bytes=None if vm is None else vm * kb,
                anon_rss_bytes=None if anon is None else anon * kb,
                uid=_int(m.group("uid")),
            )
            return ParsedKill(kill, p, text)
    if "segfault at" in text:
        m = _SEGFAULT.search(text)
        if m is not None and (p := _prefix(text, m.start(), year)) is not None:
            kill = ProcessKill(
                kind="segfault",
                pid=int(m.group("pid")),
                process=m.group("comm"),
                signal="SIGSEGV",
                fault="segfault",
                address=m.group("addr"),
                ip=m.group("ip"),
                error_code=_hex(m.group("err")),
                object=m.group("obj") or "",
                cpu=_int(m.group("cpu")),
            )
            return ParsedKill(kill, p, text)
    if "traps: " in text:
        m = _TRAP.search(text)
        if m is not None and (p := _prefix(text, m.start(), year)) is not None:
            what = m.group("what")
            kill = ProcessKill(
                kind="trap",
                pid=int(m.group("pid")),
                process=m.group("comm"),
                signal=_TRAP_SIGNALS.get(what, ""),
                fault=what.removeprefix("trap "),
                ip=m.group("ip"),
                error_code=_hex(m.group("err")),
                object=m.group("obj") or "",
                cpu=_int(m.group("cpu")),
            )
            return ParsedKill(kill, p, text)
    if "blocked for more than" in text:
        m = _HUNG.search(text)
        if m is not None and (p := _prefix(text, m.start(), year)) is not None:
            kill = ProcessKill(
                kind="hung_task",
                pid=int(m.group("pid")),
                process=m.group("comm"),
                blocked_seconds=int(m.group("secs")),
            )
            return ParsedKill(kill, p, text)
    return None


def _prefix(text: str, start: int, year: int | None) -> Prefix | None:
    at = kernel_head(text[:start])
    return parse_prefix(text[at:start], year) if at is not None else None


def parse_oom_context(line: str) -> dict[str, str] | None:
    """`oom-kill:constraint=...,task_memcg=...,pid=...` -> its fields; None if not one."""
    m = _OOM_CONTEXT.search(line)
    if m is None or kernel_head(line[: m.start()]) is None:
        return None
    fields: dict[str, str] = {}
    last = ""
    for part in m.group(1).rstrip().split(","):
        key, eq, value = part.partition("=")
        if eq and key.isidentifier():
            fields[key], last = value, key
        elif part.isidentifier():  # a flag (global_oom)
            fields[part] = "true"
        elif last:  # a comma inside a value (mems_allowed=0,2)
            fields[last] += "," + part
    return fields


class KillParser:
    """Reads lines one at a time; joins an OOM kill to the oom-kill line before it."""

    def __init__(self) -> None:
        self.year: int | None = None
        self.counts: dict[str, int] = dict.fromkeys(KILL_KINDS, 0)
        self.errors = 0  # lines that raised (a parser bug), each logged
        self._context: OrderedDict[int, dict[str, str]] = OrderedDict()  # pid -> oom-kill fields
        self._old_memcg = False  # a pre-5.0 "Memory cgroup out of memory: Kill process" line

    def feed(self, line: str) -> ParsedKill | None:
        """The report this line completes, if any. Never raises: a bug costs the line."""
        if not _may_report(line):  # the common case: one pass per needle, no regex
            return None
        try:
            return self._feed(line)
        except Exception:
            self.errors += 1
            log.exception("reading a process report from a kernel log line")
            return None

    def _feed(self, line: str) -> ParsedKill | None:
        if "oom-kill:" in line:
            ctx = parse_oom_context(line[:MAX_LINE])
            pid = _int(ctx.get("pid")) if ctx else None
            if ctx is not None and pid is not None:
                self._context[pid] = ctx
                self._context.move_to_end(pid)
                while len(self._context) > MAX_PENDING:
                    self._context.popitem(last=False)
            return None
        if "Kill process" in line and _OLD_MEMCG.search(line):
            self._old_memcg = True
            return None
        got = parse_kill(line, self.year)
        if got is None:
            return None
        if got.kill.kind == "oom_kill":
            got = self._with_context(got)
        self.counts[got.kill.kind] += 1
        return got

    def _with_context(self, got: ParsedKill) -> ParsedKill:
        ctx = self._context.pop(got.kill.pid, {})
        memcg = got.kill.memcg
        constraint = ctx.get("constraint", "")
        if constraint:
            memcg = constraint == "CONSTRAINT_MEMCG"
        elif self._old_memcg:
            memcg = True
        self._old_memcg = False
        kill = dataclasses.replace(
            got.kill,
            memcg=memcg,
            cgroup=ctx.get("task_memcg", ""),
            limit_cgroup=ctx.get("oom_memcg", ""),
            uid=got.kill.uid if got.kill.uid is not None else _int(ctx.get("uid")),
        )
        return ParsedKill(kill, got.prefix, got.line)

    def samples(self) -> list[Sample]:
        """gpuwatchd_kmsg_process_kills_total by kind."""
        return [
            Sample.of("gpuwatchd_kmsg_process_kills_total", n, kind=k)
            for k, n in self.counts.items()
        ]


_TEXT = {
    "oom_kill": "killed by the OOM killer",
    "segfault": "crashed (segfault)",
    "trap": "crashed",
    "hung_task": "blocked in the kernel",
}


def to_event(
    got: ParsedKill,
    now: float,
    boot_wall: float,
    boot_times: bool = True,
) -> Event:
    """The event of a report: its time from the line (wall clock, else boot time + the
    kernel's stamp when `boot_times`, else `now`), its fields the payload."""
    p = got.prefix
    if p.wall_time is not None:
        when = p.wall_time
    elif p.boot_seconds is not None and boot_times:
        when = boot_wall + p.boot_seconds
    else:
        when = now
    k = got.kill
    what = _TEXT[k.kind]
    if k.kind == "trap" and k.fault:
        what += f" ({k.fault})"
    if k.kind == "oom_kill" and k.memcg:
        what += " of its memory cgroup"
    if k.kind == "hung_task" and k.blocked_seconds is not None:
        what += f" for more than {k.blocked_seconds} s"
    return Event(
        kind=k.kind,
        source="kmsg",
        time=when,
        message=f"{k.process or '?'}[{k.pid}] {what}",
        severity=Severity.WARNING,
        payload=dataclasses.replace(k, origin=p.origin, stamp=p.stamp),
    )
