"""The typed payload of an Xid or SXid report, and the attrs view the store and journal keep.

The kernel log source builds it from its parser's record, NVML's event
listener from the event; the Xid stage adds the workload and the MIG
device, merges NVML's copy, joins a report's lines and classifies it, each
step on these fields. `attrs()` is the one string form: the store writes
it (the `attrs` column, what /events serves) and `from_attrs` reads a
stored row back into the same fields.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.model.values import Labels

__all__ = ["JOB_KEYS", "MIG_KEYS", "PROCESS_JOB_KEYS", "XidAttribution", "XidFields"]

# Where the reporting process runs, as strings: its cgroup (read when the line
# arrived) and its torch.distributed environment; what the line naming the process
# brings to a joined report (health/xid/bursts.py).
PROCESS_JOB_KEYS = frozenset(
    {
        # the cgroup (sources/workloads/cgroup.py Attribution)
        "pod_uid",
        "container_id",
        "slurm_job",
        "slurm_step",
        "slurm_uid",
        "unit",
        "cgroup",
        # the environment (sources/workloads/environ.py TORCH_ENV)
        "rank",
        "local_rank",
        "world_size",
        "master_addr",
        "master_port",
        "torchelastic_run_id",
        "slurm_procid",
    }
)
# ... and the workload the stage matched (Workload.attrs).
JOB_KEYS = PROCESS_JOB_KEYS | {
    "workload",
    "workload_id",
    "namespace",
    "pod",
    "container",
    "slurm_user",
    "slurm_job_name",
}
MIG_KEYS = ("gpu_instance", "compute_instance", "mig_uuid")
# attrs name -> XidAttribution field
_WHO = {
    "pid": "pid",
    "process": "process",
    "attribution": "verified",
    "pid_start": "pid_start",
    "reused_pid_start": "reused_pid_start",
}
_INTS = ("gpc", "tpc", "sm", "link", "subcode", "sequence")
_STRINGS = (
    "gpu",
    "uuid",
    "recovery_action",
    "previous_recovery_action",
    "detail",
    "device",
    "host",
    *MIG_KEYS,
    "raw",
    "cursor",
    "boot_id",
    "origin",
    "stamp",
    "kernel_time",
    "inferred",
    "confirmed_by",
    "via",
    "name",
    "category",
    "action",
    "escalated",
    "policy",
    "burst_id",
    "epoch",
)

_get_strings = operator.attrgetter(*_STRINGS)
_get_ints = operator.attrgetter(*_INTS)


@dataclass(frozen=True, slots=True, kw_only=True)
class XidAttribution:
    """Who a report names: the process, how sure that is, and its job."""

    pid: int | None = None
    process: str = ""  # the driver's name= (the thread's comm)
    verified: str = ""  # how the pid was placed: kubernetes, slurm, process gone, pid reused...
    pid_start: str = ""  # /proc/PID/stat start ticks of the process read
    reused_pid_start: str = ""  # ... of a later process on the pid (the reporter's is unknown)
    job: Labels = ()  # JOB_KEYS: the cgroup's, the environment's, the workload's (sorted)

    def job_value(self, key: str) -> str:
        return dict(self.job).get(key, "")

    def with_job(self, values: Iterable[tuple[str, str]], keep: bool = True) -> XidAttribution:
        """With `values` added to the job; `keep`: what it names already stays."""
        job = dict(self.job)
        for k, v in values:
            if v and (not keep or not job.get(k)):
                job[k] = v
        new = tuple(sorted(job.items()))
        return self if new == self.job else dataclasses.replace(self, job=new)


NOBODY = XidAttribution()  # a report that names no process (immutable: one shared)


@dataclass(frozen=True, slots=True, kw_only=True)
class XidFields:
    """One Xid/SXid report, typed: what the line said, who it names, what it means.

    Empty strings and None are "not said"; `facts` keeps the parser's other
    findings (registers, MMU fault fields, an SXid's Data lines) as it read them.
    """

    code: int
    gpu: str = ""  # NVML index; "" when NVML did not list the bus id
    uuid: str = ""
    attribution: XidAttribution = NOBODY
    # what the report says
    gpc: int | None = None  # Xid 13 and friends: where in the GPU the fault hit
    tpc: int | None = None
    sm: int | None = None
    recovery_action: str = ""  # the driver's own text (Xid 154: "GPU Reset Required", ...)
    previous_recovery_action: str = ""  # Xid 154: the state it changed from
    fatal: bool | None = None  # SXid, NVLink5: the driver says fatal or non-fatal
    detail: str = ""  # the report's text after the code
    device: str = ""  # SXid: the switch's device name
    host: str = ""  # the host name a syslog line carried
    link: int | None = None
    subcode: int | None = None
    gpu_instance: str = ""  # MIG: the report's or NVML's GPU/compute instance, device
    compute_instance: str = ""
    mig_uuid: str = ""
    lines: int = 1  # kernel lines joined into this report
    facts: Labels = ()
    # where the line came from
    raw: str = ""
    cursor: str = ""
    boot_id: str = ""
    origin: str = ""  # kernel, user, unknown
    stamp: str = ""  # the line's own time stamp, as printed
    sequence: int | None = None  # /dev/kmsg sequence number
    kernel_time: str = ""  # seconds after boot, as printed
    inferred: str = ""  # why a report without an Xid number was taken for one
    confirmed_by: str = ""  # the other witness that reported it (NVML)
    via: str = ""  # NVML: the API it came through
    # the tracker's classification
    name: str = ""
    category: str = ""
    action: str = ""  # Action values
    escalated: str = ""  # why the tracker raised the action, if it did
    policy: str = ""  # the site policy that applied
    burst_id: str = ""
    epoch: str = ""  # boot and GPU reset count: what escalation counts
    pids: tuple[int, ...] = ()  # other processes with this Xid on this GPU within the window

    def attrs(self) -> Labels:
        """The fields as strings (sorted, empty ones left out): the store's and journal's form."""
        # a fact under a typed name is text that did not read as that type: the field is empty
        out = {k: v for k, v in self.facts if v}
        a = self.attribution
        if a.pid is not None:
            out["pid"] = str(a.pid)
        for key, value in (
            ("process", a.process),
            ("attribution", a.verified),
            ("pid_start", a.pid_start),
            ("reused_pid_start", a.reused_pid_start),
            *a.job,
            *zip(_STRINGS, _get_strings(self), strict=True),
        ):
            if value:
                out[key] = value
        for key, number in zip(_INTS, _get_ints(self), strict=True):
            if number is not None:
                out[key] = str(number)
        if self.fatal is not None:
            out["fatal"] = "true" if self.fatal else "false"
        if self.lines > 1:
            out["lines"] = str(self.lines)
        if self.pids:
            out["pids"] = ",".join(map(str, self.pids))
        return tuple(sorted(out.items()))

    @classmethod
    def from_attrs(cls, code: int, attrs: Mapping[str, str] | Labels) -> XidFields:
        """The fields that `attrs()` wrote (a stored row read back); text that does not
        read as its type stays in `facts`, as written."""
        pairs = attrs.items() if isinstance(attrs, Mapping) else attrs
        given = {k: v for k, v in pairs if v != ""}
        return cls(code=code).with_facts(given.items())

    def with_facts(self, pairs: Iterable[tuple[str, str]]) -> XidFields:
        """These fields with `pairs` (strings under the attrs' names) read into them."""
        given = dict(pairs)
        if not given:
            return self
        values: dict[str, object] = {}
        facts = dict(self.facts)
        a = self.attribution
        who: dict[str, object] = {}
        job = dict(a.job)
        for key, text in given.items():
            typed = _read(key, text)
            if key in _WHO:
                if typed is None:
                    facts[key] = text  # a pid that is not one: kept as the text said it
                else:
                    who[_WHO[key]] = typed
            elif key in JOB_KEYS and (key != "unit" or "pid" in given or a.pid is not None):
                # an NVLink5 report's unit is the link's; the process's cgroup names its own
                job.setdefault(key, text)
            elif key in _STRINGS:
                values[key] = text
            elif key in _INTS or key in ("fatal", "lines", "pids"):
                if typed is None:
                    facts[key] = text  # not a number: kept as the text said it
                else:
                    values[key] = typed
            else:
                facts[key] = text
        who["job"] = tuple(sorted(job.items()))
        return dataclasses.replace(
            self,
            attribution=dataclasses.replace(a, **who),  # type: ignore[arg-type]
            facts=tuple(sorted(facts.items())),
            **values,  # type: ignore[arg-type]
        )

    def filled_from(self, other: XidFields | None) -> XidFields:
        """These fields with the empty ones taken from `other` (attribution and facts too)."""
        if other is None:
            return self
        changes: dict[str, object] = {
            f.name: getattr(other, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("attribution", "facts", "lines", "pids")
            and getattr(self, f.name) in ("", None)
            and getattr(other, f.name) not in ("", None)
        }
        mine, theirs = self.attribution, other.attribution
        who = {
            f.name: getattr(theirs, f.name)
            for f in dataclasses.fields(mine)
            if f.name != "job" and getattr(mine, f.name) in ("", None)
        }
        changes["attribution"] = dataclasses.replace(mine, **who).with_job(theirs.job)
        facts = dict(other.facts)
        facts.update(self.facts)
        changes["facts"] = tuple(sorted(facts.items()))
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def changed(self, **changes: Any) -> XidFields:
        """`dataclasses.replace(self, **changes)` without its checks per field: the
        tracker classifies every report of a flood with it."""
        values = dict(zip(_FIELD_NAMES, _get_fields(self), strict=True))
        values.update(changes)
        return XidFields(**values)

    def placement(self) -> Labels:
        """Where the process ran as the alert describes it: job, MIG device, other pids."""
        out = dict(self.attribution.job)
        out.update((k, getattr(self, k)) for k in MIG_KEYS)
        out["pids"] = ",".join(map(str, self.pids))
        return tuple(sorted((k, v) for k, v in out.items() if v))


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(XidFields))
_get_fields = operator.attrgetter(*_FIELD_NAMES)


def _read(key: str, text: str) -> object:
    """`text` as the field `key` holds it; None where it does not read back exactly."""
    if key in ("pid", "lines") or key in _INTS:
        return _int(text)
    if key == "fatal":
        return {"true": True, "false": False}.get(text)
    if key == "pids":
        pids = tuple(_int(p) for p in text.split(","))
        return None if None in pids else pids
    return text


def _int(text: str) -> int | None:
    """`text` as a number only if the number prints as `text` again."""
    try:
        number = int(text)
    except ValueError:
        return None
    return number if str(number) == text else None
