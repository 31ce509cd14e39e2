"""Value types passed between layers: sources -> state -> health -> sinks.

Everything here is immutable so a snapshot can be handed to any thread
without copying or locking. `values` holds the snapshot's types, `event`
the event and its payload union, `xid`, `kill`, `hang` and `diag` the payload types.
"""

from __future__ import annotations

from gpuwatchd.model.diag import DIAG_KIND, DiagOutcome, DiagResult, DiagRun
from gpuwatchd.model.event import XID_KINDS, Event, Payload, payload_of
from gpuwatchd.model.hang import (
    HANG_KIND,
    HangCause,
    HangCauses,
    HangRank,
    HangReport,
    HangStack,
)
from gpuwatchd.model.kill import KILL_KINDS, ProcessKill
from gpuwatchd.model.values import (
    WORKLOAD_ALERT_LABELS,
    Action,
    Clear,
    Finding,
    Gpu,
    GpuInventory,
    GpuPlace,
    GpuProcess,
    Health,
    KmsgState,
    Labels,
    MetricSpec,
    MetricType,
    Sample,
    Severity,
    SourcePayload,
    SourceSnapshot,
    Topology,
    Workload,
    WorkloadProcess,
    WorkloadSet,
    labels_of,
)
from gpuwatchd.model.xid import XidAttribution, XidFields

__all__ = [
    "Action",
    "Clear",
    "DIAG_KIND",
    "DiagOutcome",
    "DiagResult",
    "DiagRun",
    "Event",
    "Finding",
    "Gpu",
    "GpuInventory",
    "GpuPlace",
    "GpuProcess",
    "HANG_KIND",
    "HangCause",
    "HangCauses",
    "HangRank",
    "HangReport",
    "HangStack",
    "Health",
    "KILL_KINDS",
    "KmsgState",
    "Labels",
    "MetricSpec",
    "MetricType",
    "Payload",
    "ProcessKill",
    "Sample",
    "Severity",
    "SourcePayload",
    "SourceSnapshot",
    "Topology",
    "WORKLOAD_ALERT_LABELS",
    "Workload",
    "WorkloadProcess",
    "WorkloadSet",
    "XID_KINDS",
    "XidAttribution",
    "XidFields",
    "labels_of",
    "payload_of",
]
