"""The kernel's memory pressure files, parsed (no I/O here).

PSI (Documentation/accounting/psi.rst), /proc/pressure/memory and a cgroup v2
group's memory.pressure, one line per kind:

    some avg10=0.00 avg60=0.00 avg300=0.00 total=0
    full avg10=0.00 avg60=0.00 avg300=0.00 total=0

`some`: the share of time at least one task stalled on memory; `full`: every
non-idle task at once (the work made no progress). avgN are percent over the last
N seconds, total the stalled time in microseconds.

cgroup v2 memory.events (Documentation/admin-guide/cgroup-v2.rst), one
`key count` line each: low, high, max, oom (the group hit its limit and an
allocation was about to fail), oom_kill (processes of the group the OOM killer
killed), oom_group_kill (kernels from 5.19). The counts include the group's
descendants.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KINDS", "Pressure", "parse_events", "parse_pressure", "v2_path"]

KINDS = ("some", "full")


@dataclass(frozen=True, slots=True)
class Pressure:
    """One PSI line, in base units."""

    avg10: float  # ratio of time stalled over the last 10 s (the kernel writes percent)
    avg60: float
    avg300: float
    total_seconds: float  # stalled time since boot (the kernel writes microseconds)


def parse_pressure(text: str) -> dict[str, Pressure]:
    """kind ("some", "full") -> Pressure; lines that do not parse are left out."""
    out: dict[str, Pressure] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind not in KINDS:
            continue
        fields = dict(f.split("=", 1) for f in rest.split() if "=" in f)
        try:
            out[kind] = Pressure(
                float(fields["avg10"]) / 100.0,
                float(fields["avg60"]) / 100.0,
                float(fields["avg300"]) / 100.0,
                int(fields["total"]) / 1e6,
            )
        except (KeyError, ValueError):
            continue
    return out


def parse_events(text: str) -> dict[str, int]:
    """memory.events: key -> count (unknown keys kept, bad lines left out)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key and value.strip().isdigit():
            out[key] = int(value)
    return out


def v2_path(proc_cgroup: str) -> str | None:
    """The cgroup v2 path of /proc/PID/cgroup (its `0::` line); None without one."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None
