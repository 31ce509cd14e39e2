"""The typed fields of a kernel report that a process was killed, crashed or got stuck.

The kernel log source (sources/kmsg/process_kills.py) reads them from the
OOM killer's, the fault handlers' and the hung-task detector's lines and
hands them on as the event's payload (`Event.kill`); `attrs()` is their
string view, as the store and the journal keep events, and `from_attrs`
reads a stored row back. What a join with a job's ranks needs: the pid, the
process name, when (the event's time) and why; for an OOM kill also the
memory cgroup, which names the pod or the Slurm step even after the
process is gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["KILL_KINDS", "ProcessKill"]

# Event kinds (Event.kind) of these reports:
#   oom_kill   the OOM killer killed the process (SIGKILL): the node or its memory cgroup ran out
#   segfault   the process died of an unhandled SIGSEGV ("comm[pid]: segfault at ...")
#   trap       the process died of another unhandled fault ("traps: comm[pid] ...")
#   hung_task  the process sat in uninterruptible sleep (D state) past the kernel's limit;
#              it is not killed, but a rank in D state stalls its job
KILL_KINDS = ("oom_kill", "segfault", "trap", "hung_task")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessKill:
    """One kernel report about a process, typed (the event's payload)."""

    kind: str  # one of KILL_KINDS
    pid: int
    process: str = ""  # the kernel's comm: at most 15 characters, the thread's name
    signal: str = ""  # SIGKILL, SIGSEGV, SIGILL, SIGFPE, SIGBUS, SIGTRAP; "" if unknown or none
    # oom_kill
    memcg: bool | None = None  # a memory cgroup's limit was hit (not the whole node's memory)
    cgroup: str = ""  # the killed task's memory cgroup (task_memcg), when the kernel said
    limit_cgroup: str = ""  # the cgroup whose limit was hit (oom_memcg)
    anon_rss_bytes: int | None = None
    total_vm_bytes: int | None = None
    uid: int | None = None
    # segfault and trap
    fault: str = ""  # "segfault", "general protection fault", "invalid opcode", ...
    address: str = ""  # segfault: the address that faulted (hex, as printed)
    ip: str = ""  # the instruction pointer (hex, as printed)
    error_code: int | None = None
    object: str = ""  # the file the instruction pointer was in (libcuda.so.1, python3.10)
    cpu: int | None = None  # "likely on CPU N" (kernels from 6.1)
    # hung_task
    blocked_seconds: int | None = None
    # the line
    origin: str = ""  # kernel, user, unknown
    stamp: str = ""  # the line's own time stamp, as printed

    def attrs(self) -> tuple[tuple[str, str], ...]:
        """The fields as the event's string attrs (sorted, empty ones left out)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or value == "":
                continue
            out[f.name] = str(value).lower() if isinstance(value, bool) else str(value)
        return tuple(sorted(out.items()))

    @classmethod
    def from_attrs(cls, kind: str, attrs: Mapping[str, str]) -> ProcessKill | None:
        """The fields `attrs()` wrote (a stored row read back); None without a pid."""
        if kind not in KILL_KINDS:
            return None
        a = attrs
        pid = _int(a.get("pid", ""))
        if pid is None:
            return None
        return cls(
            kind=kind,
            pid=pid,
            process=a.get("process", ""),
            signal=a.get("signal", ""),
            memcg={"true": True, "false": False}.get(a.get("memcg", "")),
            cgroup=a.get("cgroup", ""),
            limit_cgroup=a.get("limit_cgroup", ""),
            anon_rss_bytes=_int(a.get("anon_rss_bytes", "")),
            total_vm_bytes=_int(a.get("total_vm_bytes", "")),
            uid=_int(a.get("uid", "")),
            fault=a.get("fault", ""),
            address=a.get("address", ""),
            ip=a.get("ip", ""),
            error_code=_int(a.get("error_code", "")),
            object=a.get("object", ""),
            cpu=_int(a.get("cpu", "")),
            blocked_seconds=_int(a.get("blocked_seconds", "")),
            origin=a.get("origin", ""),
            stamp=a.get("stamp", ""),
        )


def _int(text: str) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None
