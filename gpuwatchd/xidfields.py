"""The typed fields of an Xid or SXid report.

The kernel log source fills them from its parser's output and hands them on
with the event (`Event.fields`); `Event.attrs` carries the same values as
strings under the same names, which the store and the journal keep. Events
that come without them (NVML's, the store's) are read from the attrs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwatchd.model import Event

__all__ = ["XidFields"]


@dataclass(frozen=True, slots=True, kw_only=True)
class XidFields:
    """An Xid/SXid report's fields, typed; `Event.attrs` carries them as strings
    under the same names (the store's columns and the journal's fields)."""

    code: int
    gpu: str = ""  # NVML index; "" when NVML did not list the bus id
    uuid: str = ""
    pid: int | None = None
    process: str = ""
    gpc: int | None = None  # Xid 13 and friends: where in the GPU the fault hit
    tpc: int | None = None
    sm: int | None = None
    recovery_action: str = ""  # the driver's own text (Xid 154: "GPU Reset Required", ...)
    fatal: bool | None = None  # SXid: the driver says fatal or non-fatal
    detail: str = ""  # the report's text after the code
    name: str = ""  # the catalog's name, once the tracker classified it
    action: str = ""  # the catalog's action, once classified (Action values)
    escalated: str = ""  # why the tracker raised the action, if it did

    @classmethod
    def of(cls, ev: Event) -> XidFields:
        """Read the fields from an event's attrs (bad numbers read as None)."""
        a = dict(ev.attrs)
        return cls(
            code=ev.code or 0,
            gpu=a.get("gpu", ""),
            uuid=a.get("uuid", ""),
            pid=_int_or_none(a.get("pid", "")),
            process=a.get("process", ""),
            gpc=_int_or_none(a.get("gpc", "")),
            tpc=_int_or_none(a.get("tpc", "")),
            sm=_int_or_none(a.get("sm", "")),
            recovery_action=a.get("recovery_action", ""),
            fatal={"true": True, "false": False}.get(a.get("fatal", "")),
            detail=a.get("detail", ""),
            name=a.get("name", ""),
            action=a.get("action", ""),
            escalated=a.get("escalated", ""),
        )

    def filled_from(self, other: XidFields | None, keys: frozenset[str] | None = None) -> XidFields:
        """These fields with the empty ones (of `keys`, or all) taken from `other`."""
        if other is None:
            return self
        empty = ("", None)
        changes = {
            f.name: getattr(other, f.name)
            for f in dataclasses.fields(self)
            if (keys is None or f.name in keys)
            and getattr(self, f.name) in empty
            and getattr(other, f.name) not in empty
        }
        return dataclasses.replace(self, **changes) if changes else self


def _int_or_none(text: str) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None
