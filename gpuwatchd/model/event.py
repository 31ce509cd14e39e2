"""The event: something that happened once, with one typed payload.

An Xid or SXid report carries `XidFields`, a kernel report of a killed,
crashed or hung process `ProcessKill`, a suspected job hang `HangReport`, a
diag run `DiagRun`. Kinds without a payload type yet (remediation steps, the
run marker, shared memory segments) carry their detail as strings in `attrs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.model.diag import DIAG_KIND, DiagRun
from gpuwatchd.model.hang import HANG_KIND, HangReport
from gpuwatchd.model.kill import KILL_KINDS, ProcessKill
from gpuwatchd.model.values import Labels, Severity
from gpuwatchd.model.xid import XidFields

__all__ = ["Event", "Payload", "XID_KINDS", "payload_of"]

Payload = XidFields | ProcessKill | HangReport | DiagRun
XID_KINDS = ("xid", "sxid")


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened once (an Xid, a GPU lost), as opposed to a state.

    With a `payload`, `attrs` is its string view (`payload.attrs()`),
    derived at its first read: the store writes it and the journal reads
    it; code reads the payload (`xid`, `kill`, `diag`). Without one,
    `attrs` is the event's detail; an Xid or SXid always has one (given
    attrs only, they are read into it).
    De-duplication is the Xid tracker's, by kind, bus id and code.
    """

    kind: str
    source: str
    time: float
    code: int | None = None
    pci_bus_id: str = ""
    message: str = ""
    severity: Severity = Severity.INFO
    attrs: Labels = ()
    count: int = 1
    payload: Payload | None = None

    def __post_init__(self) -> None:
        payload = self.payload
        if payload is None:
            if self.kind in XID_KINDS:
                # written as strings (a stored row, a test's shorthand): read once, exactly
                payload = XidFields.from_attrs(self.code or 0, self.attrs)
            elif self.kind == DIAG_KIND:  # a run stored as strings
                payload = DiagRun.from_attrs(dict(self.attrs), self.time)
            else:
                return
            object.__setattr__(self, "payload", payload)
        if self.kind in XID_KINDS and not isinstance(payload, XidFields):
            raise TypeError(f"an {self.kind} event carries XidFields, not {payload!r}")
        _ATTRS_SLOT.__set__(self, None)  # the payload's view, derived when read

    def carrying(
        self, payload: Payload, *, message: str | None = None, severity: Severity | None = None
    ) -> Event:
        """This event with a new payload (and message or severity), its view not derived:
        the Xid stage's steps make one per report, and most are never written."""
        return Event(
            self.kind,
            self.source,
            self.time,
            self.code,
            self.pci_bus_id,
            self.message if message is None else message,
            self.severity if severity is None else severity,
            (),
            self.count,
            payload,
        )

    def attr(self, key: str, default: str = "") -> str:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def xid(self) -> XidFields | None:
        """The typed fields of an Xid or SXid report; None for other kinds."""
        return self.payload if isinstance(self.payload, XidFields) else None

    @property
    def kill(self) -> ProcessKill | None:
        """The typed fields of a kernel report of a killed, crashed or hung process
        (KILL_KINDS); None for other kinds."""
        return self.payload if isinstance(self.payload, ProcessKill) else None

    @property
    def hang(self) -> HangReport | None:
        """The report of a suspected job hang (kind `job_hang`); None for other kinds."""
        return self.payload if isinstance(self.payload, HangReport) else None

    @property
    def diag(self) -> DiagRun | None:
        """The typed run of a `diag` event; None for other kinds."""
        return self.payload if isinstance(self.payload, DiagRun) else None


class _DerivedAttrs:
    """`Event.attrs`: the slot as given, or, for an event with a payload, the payload's
    view computed at the first read and kept (a flood's events mostly go unwritten)."""

    def __init__(self, slot: Any) -> None:
        self._slot = slot

    def __get__(self, event: Event | None, owner: type | None = None) -> Any:
        if event is None:
            return self
        view = self._slot.__get__(event, owner)
        if view is None:
            view = event.payload.attrs() if event.payload is not None else ()
            self._slot.__set__(event, view)
        return view

    def __set__(self, event: Event, value: Labels | None) -> None:
        self._slot.__set__(event, value)


_ATTRS_SLOT = Event.__dict__["attrs"]
setattr(Event, "attrs", _DerivedAttrs(_ATTRS_SLOT))  # noqa: B010


def payload_of(
    kind: str, code: int | None, attrs: Mapping[str, str], time: float = 0.0
) -> Payload | None:
    """The typed payload of a stored event, read from the attrs its payload wrote
    (`time`, the event's: a diag run stored before it kept its own start)."""
    if kind in XID_KINDS:
        return XidFields.from_attrs(code or 0, attrs)
    if kind in KILL_KINDS:
        return ProcessKill.from_attrs(kind, attrs)
    if kind == HANG_KIND:
        return HangReport.from_attrs(attrs)
    if kind == DIAG_KIND:
        return DiagRun.from_attrs(attrs, time)
    return None
