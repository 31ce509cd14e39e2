"""Who a process belongs to: Kubernetes pod and container, Slurm job, or a unit.

Read from /proc/PID/cgroup (root injectable), for an Xid that names a pid.
This goes on events only, never on metric labels (pods come and go).
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

__all__ = [
    "Attribution",
    "CLOCK_TICKS",
    "REUSED",
    "UNVERIFIED",
    "attribute",
    "parse_cgroup",
    "start_ticks",
]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc/PID/stat's start time
REUSED = "pid reused"
# A report without a time of its own, and a process at its pid that started
# between the last read that found the log's end and this one: the reporter,
# or another process that took the pid after it exited. Named as neither.
UNVERIFIED = "pid unverified"

_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER = re.compile(
    r"(?:^|[/-])(?:cri-containerd-|crio-|docker-|containerd-|libpod-)?([0-9a-f]{64})(?:\.scope)?$"
)
_SLURM_JOB = re.compile(r"/job_(\d+)(?:/step_([^/]+))?")
_SLURM_UID = re.compile(r"/uid_(\d+)")
_UNIT = re.compile(r"^([^/]{1,255}\.(?:service|scope))$")  # anchored: linear on any input


class Attribution(NamedTuple):
    """What a pid was part of. `status` says how much we could tell."""

    status: str  # kubernetes | slurm | container | systemd | host | process gone | ...
    pod_uid: str = ""
    container_id: str = ""
    slurm_job: str = ""
    slurm_step: str = ""
    slurm_uid: str = ""
    unit: str = ""
    cgroup: str = ""
    pid_start: str = ""  # /proc/PID/stat start time (ticks after boot): pid + start = one process

    def attrs(self) -> tuple[tuple[str, str], ...]:
        """Non-empty fields as event attributes."""
        pairs = [("attribution", self.status)]
        pairs += [(k, v) for k, v in self._asdict().items() if k != "status" and v]
        if self.status in (REUSED, UNVERIFIED):  # the start is (maybe) a newcomer's
            pairs = [("reused_pid_start", v) if k == "pid_start" else (k, v) for k, v in pairs]
        return tuple(pairs)


def _cgroup_path(text: str) -> str:
    """The path that places the process: cgroup v2's line, else a v1 controller's."""
    v1 = ""
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            return path
        if not v1 and any(c in controllers.split(",") for c in ("pids", "memory", "cpu")):
            v1 = path
    return v1


def parse_cgroup(text: str) -> Attribution:
    """Classify the content of /proc/PID/cgroup (v1 or v2, cgroupfs or systemd driver)."""
    path = _cgroup_path(text)
    leaf = path.rstrip("/")
    container = ""
    m = _CONTAINER.search(leaf)
    if m is not None:
        container = m.group(1)
    pod = _POD.search(path)
    if pod is not None:
        return Attribution(
            "kubernetes",
            pod_uid=pod.group(1).replace("_", "-"),
            container_id=container,
            cgroup=path,
        )
    job = _SLURM_JOB.search(path)
    if job is not None:
        uid = _SLURM_UID.search(path)
        return Attribution(
            "slurm",
            slurm_job=job.group(1),
            slurm_step=job.group(2) or "",
            slurm_uid=uid.group(1) if uid else "",
            cgroup=path,
        )
    if container:
        return Attribution("container", container_id=container, cgroup=path)
    unit = _UNIT.search(leaf.rpartition("/")[2])
    if unit is not None:
        return Attribution("systemd", unit=unit.group(1), cgroup=path)
    return Attribution("host", cgroup=path)


def start_ticks(procfs: str, pid: int) -> int | None:
    """When the process now at `pid` started, in clock ticks after boot (stat field 22)."""
    try:
        with open(os.path.join(procfs, str(pid), "stat"), "rb") as f:
            text = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: count fields after its last ")"
    rest = text.rpartition(b")")[2].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def attribute(
    procfs: str,
    pid: int,
    expect_comm: str = "",
    started_by: float | None = None,
    logged_after: float | None = None,
) -> Attribution:
    """Attribute a live pid; says "process gone", "pid reused" or "pid unverified" when it
    cannot.

    `started_by`: seconds after boot at which the reporting process was
    alive (the kernel record's time, else its arrival); a process at `pid`
    that started later is another one that reuses the pid. `logged_after`:
    for a report without a time of its own, seconds after boot after which
    it was logged; a process that started after that may be a newcomer.
    """
    base = os.path.join(procfs, str(pid))
    try:
        with open(os.path.join(base, "cgroup"), encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return Attribution("process gone")
    except OSError as exc:
        return Attribution(f"unreadable: {exc.strerror or exc}")
    start = start_ticks(procfs, pid)
    # a tick of slack: the record's time and the start time are rounded differently
    newcomer = Attribution(REUSED, pid_start=str(start) if start is not None else "")
    if start is not None and started_by is not None and start > (started_by + 1) * CLOCK_TICKS:
        return newcomer
    if logged_after is not None and (start is None or start > (logged_after + 1) * CLOCK_TICKS):
        return newcomer._replace(status=UNVERIFIED)
    if expect_comm:
        try:
            with open(os.path.join(base, "comm"), encoding="utf-8", errors="replace") as f:
                comm = f.read().strip()
        except OSError:
            comm = ""
        # The driver prints the task's comm (at most 15 bytes); another name
        # means the pid now belongs to a different process.
        if comm and comm[:15] != expect_comm[:15]:
            return newcomer
    found = parse_cgroup(text)
    return found._replace(pid_start=str(start)) if start is not None else found
