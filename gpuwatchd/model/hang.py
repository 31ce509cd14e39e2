"""The typed report of a suspected job hang: what the detector saw, what forensics found.

The `job_hang` event carries one `HangReport` as its payload. `json()` is the
document the store keeps (in the `forensics` attribute, as since v0.2), /hangs
serves and `gpuwatchd hang show --json` prints; `from_json` reads a stored one
back, including rows written before a field existed (it takes its default).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["HANG_KIND", "HangCause", "HangCauses", "HangRank", "HangReport", "HangStack"]

HANG_KIND = "job_hang"  # Event.kind of a hang report


def _str(v: object) -> str:
    return "" if v is None else str(v)


def _float(v: object, default: float = 0.0) -> float:
    try:
        return float(v) if v is not None and v != "" else default  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


def _int(v: object) -> int | None:
    try:
        return int(v) if v is not None and v != "" else None  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def _strs(v: object) -> tuple[str, ...]:
    return tuple(str(x) for x in v) if isinstance(v, list | tuple) else ()


def _dict(v: object) -> Mapping[str, Any]:
    return v if isinstance(v, dict) else {}


@dataclass(frozen=True, slots=True, kw_only=True)
class HangStack:
    """One rank's stack dump (py-spy), or why there is none."""

    pid: int
    ok: bool
    error: str = ""
    seconds: float = 0.0
    dump: str = ""

    def json(self) -> dict[str, Any]:
        return {"ok": self.ok, "error": self.error, "seconds": self.seconds, "dump": self.dump}


@dataclass(frozen=True, slots=True, kw_only=True)
class HangRank:
    """Where one rank is."""

    pid: int
    rank: int | None
    gpus: tuple[str, ...] = ()
    state: str = ""  # the detector's spin | idle | busy | unknown
    where: str = ""
    collective: str = ""
    collective_counts: tuple[tuple[str, int], ...] = ()
    stack_error: str = ""

    def json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "rank": self.rank,
            "gpus": list(self.gpus),
            "state": self.state,
            "where": self.where,
            "collective": self.collective,
            "collective_counts": dict(self.collective_counts),
            "stack_error": self.stack_error,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HangRank:
        counts = _dict(d.get("collective_counts"))
        return cls(
            pid=_int(d.get("pid")) or 0,
            rank=_int(d.get("rank")),
            gpus=_strs(d.get("gpus")),
            state=_str(d.get("state")),
            where=_str(d.get("where")),
            collective=_str(d.get("collective")),
            collective_counts=tuple((str(k), _int(v) or 0) for k, v in counts.items()),
            stack_error=_str(d.get("stack_error")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HangCause:
    """One thing on this node that can explain the hang (health/hangs/causes.py's Cause)."""

    kind: str
    text: str = ""
    what: str = ""
    where: str = ""
    at: float = 0.0
    offset_seconds: float = 0.0
    rank: int | None = None
    pid: int | None = None
    affinity: str = ""
    evidence: str = ""
    incident: str = ""

    def json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "text": self.text,
            "what": self.what,
            "where": self.where,
            "at": self.at,
            "offset_seconds": self.offset_seconds,
            "rank": self.rank,
            "pid": self.pid,
            "affinity": self.affinity,
            "evidence": self.evidence,
            "incident": self.incident,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HangCause:
        return cls(
            kind=_str(d.get("kind")),
            text=_str(d.get("text")),
            what=_str(d.get("what")),
            where=_str(d.get("where")),
            at=_float(d.get("at")),
            offset_seconds=_float(d.get("offset_seconds")),
            rank=_int(d.get("rank")),
            pid=_int(d.get("pid")),
            affinity=_str(d.get("affinity")),
            evidence=_str(d.get("evidence")),
            incident=_str(d.get("incident")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HangCauses:
    """A hang's causes on this node: the first is the cause, then the alternatives."""

    cause: HangCause | None = None
    alternatives: tuple[HangCause, ...] = ()
    headline: str = ""
    looked_at: tuple[str, ...] = ()
    elsewhere: tuple[str, ...] = ()

    def json(self) -> dict[str, Any]:
        return {
            "cause": self.cause.json() if self.cause is not None else None,
            "alternatives": [c.json() for c in self.alternatives],
            "headline": self.headline,
            "looked_at": list(self.looked_at),
            "elsewhere": list(self.elsewhere),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HangCauses:
        cause = d.get("cause")
        alts = d.get("alternatives")
        return cls(
            cause=HangCause.from_json(cause) if isinstance(cause, dict) else None,
            alternatives=tuple(HangCause.from_json(a) for a in (alts or ()) if isinstance(a, dict)),
            headline=_str(d.get("headline")),
            looked_at=_strs(d.get("looked_at")),
            elsewhere=_strs(d.get("elsewhere")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HangReport:
    """One suspected hang of one job (the `job_hang` event's payload)."""

    id: int
    job: str
    labels: tuple[tuple[str, str], ...] = ()  # the job's workload labels, in their order
    since: float = 0.0  # when the first rank stopped
    resolved_at: float | None = None
    conditions: tuple[str, ...] = ()
    signals: str = ""  # what decided, "liveness+gpu+ras"
    reason: str = ""
    severity: str = ""  # the detector's ("critical", "warning"), "" when it set none
    cause: str = ""  # the causes' headline
    incident: str = ""  # the cause's own alert's incident label
    causes: HangCauses | None = None
    stacks_confirmed: bool = False
    flight_recorder: tuple[str, ...] = ()
    flight_recorder_errors: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    signature: str = ""
    remediation: str = ""
    signatures: tuple[str, ...] = ()
    facts: tuple[str, ...] = ()
    where: str = ""
    ranks: tuple[HangRank, ...] = ()
    missing: tuple[str, ...] = ()
    unresponsive: tuple[str, ...] = ()
    diverging_frame: str = ""
    stacks: tuple[HangStack, ...] = ()
    ras_error: str = ""
    ras_at: float = 0.0
    ras_answer: str = ""

    @property
    def resolved(self) -> bool:
        return bool(self.resolved_at)

    def json(self) -> dict[str, Any]:
        """The stored document (keys and shapes as every release wrote them)."""
        return {
            "id": self.id,
            "job": self.job,
            "labels": dict(self.labels),
            "since": self.since,
            "resolved_at": self.resolved_at,
            "conditions": list(self.conditions),
            "signals": self.signals,
            "reason": self.reason,
            "severity": self.severity,
            "cause": self.cause,
            "incident": self.incident,
            "causes": self.causes.json() if self.causes is not None else None,
            "stacks_confirmed": self.stacks_confirmed,
            "flight_recorder": list(self.flight_recorder),
            "flight_recorder_errors": list(self.flight_recorder_errors),
            "nodes": list(self.nodes),
            "signature": self.signature,
            "remediation": self.remediation,
            "signatures": list(self.signatures),
            "facts": list(self.facts),
            "where": self.where,
            "ranks": [r.json() for r in self.ranks],
            "missing": list(self.missing),
            "unresponsive": list(self.unresponsive),
            "diverging_frame": self.diverging_frame,
            "stacks": {str(s.pid): s.json() for s in self.stacks},
            "ras": {"error": self.ras_error, "at": self.ras_at, "answer": self.ras_answer},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HangReport | None:
        """A stored document read back; None without a job (not a hang report)."""
        if not d.get("job"):
            return None
        causes = d.get("causes")
        ras = _dict(d.get("ras"))
        stacks = _dict(d.get("stacks"))
        return cls(
            id=_int(d.get("id")) or 0,
            job=str(d["job"]),
            labels=tuple((str(k), _str(v)) for k, v in _dict(d.get("labels")).items()),
            since=_float(d.get("since")),
            resolved_at=_float(d["resolved_at"]) if d.get("resolved_at") else None,
            conditions=_strs(d.get("conditions")),
            signals=_str(d.get("signals")),
            reason=_str(d.get("reason")),
            severity=_str(d.get("severity")),
            cause=_str(d.get("cause")),
            incident=_str(d.get("incident")),
            causes=HangCauses.from_json(causes) if isinstance(causes, dict) else None,
            stacks_confirmed=bool(d.get("stacks_confirmed")),
            flight_recorder=_strs(d.get("flight_recorder")),
            flight_recorder_errors=_strs(d.get("flight_recorder_errors")),
            nodes=_strs(d.get("nodes")),
            signature=_str(d.get("signature")),
            remediation=_str(d.get("remediation")),
            signatures=_strs(d.get("signatures")),
            facts=_strs(d.get("facts")),
            where=_str(d.get("where")),
            ranks=tuple(HangRank.from_json(r) for r in d.get("ranks") or () if isinstance(r, dict)),
            missing=_strs(d.get("missing")),
            unresponsive=_strs(d.get("unresponsive")),
            diverging_frame=_str(d.get("diverging_frame")),
            stacks=tuple(
                HangStack(
                    pid=_int(pid) or 0,
                    ok=bool(_dict(s).get("ok")),
                    error=_str(_dict(s).get("error")),
                    seconds=_float(_dict(s).get("seconds")),
                    dump=_str(_dict(s).get("dump")),
                )
                for pid, s in stacks.items()
            ),
            ras_error=_str(ras.get("error")),
            ras_at=_float(ras.get("at")),
            ras_answer=_str(ras.get("answer")),
        )

    def attrs(self) -> tuple[tuple[str, str], ...]:
        """The event's string view, as the store keeps it: the document under `forensics`."""
        doc = json.dumps(self.json())
        return (("forensics", doc), ("hang_id", str(self.id)), ("job", self.job))

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, str]) -> HangReport | None:
        """The report `attrs()` wrote (a stored row read back); None if it does not parse."""
        try:
            doc = json.loads(attrs.get("forensics") or "{}")
        except ValueError:
            return None
        return cls.from_json(doc) if isinstance(doc, dict) else None
