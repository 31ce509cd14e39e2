"""The JSON and plain-text routes besides /metrics: /status, /healthz, /events, /alerts.

Each route only reads: the latest snapshot, the event store, the alert sink's
view. A route is `query -> (status, content type, body)`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuwatchd.health.rollup import finding_json
from gpuwatchd.http.app import Route
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sinks.store_schema import hang_report_json
from gpuwatchd.state import NodeSnapshot

__all__ = ["events_route", "healthz_route", "status_document", "summary_line"]


def status_document(
    snap: NodeSnapshot, *, node: str, version: str, started: float, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """/status: every source's last poll, the open findings, and `extra` (health, alerts)."""
    return {
        "node": node,
        "version": version,
        "started": started,
        "sources": {
            name: {
                "ok": s.ok,
                "error": s.error,
                "timestamp": s.timestamp,
                "duration_seconds": s.duration_seconds,
                "last_success": s.last_success,
                **dict(s.status),
                "errors_by_reason": dict(s.errors_by_reason),
            }
            for name, s in snap.sources.items()
        },
        "findings": [finding_json(f) for f in snap.findings],
        **extra,
    }


def summary_line(snap: NodeSnapshot, gpu_count: int) -> str:
    """One line for systemd's STATUS= and the start-up log."""
    nvml = snap.sources.get("nvml")
    failing = sorted(n for n, s in snap.sources.items() if not s.ok)
    worst = max((f.severity for f in snap.findings), default=None)
    parts = [f"{gpu_count} GPU(s)" if nvml is not None and nvml.ok else "NVML unavailable"]
    parts.append(f"{len(snap.findings)} finding(s)" + (f", worst {worst}" if worst else ""))
    if failing:
        parts.append("failing: " + ",".join(failing))
    return "; ".join(parts)


def healthz_route(stale: Callable[[], Sequence[str]]) -> Route:
    """/healthz: 200 "ok", or 503 naming the sources whose loops stopped making progress."""

    def route(_query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        names = stale()
        if names:
            return 503, "text/plain", f"stale: {', '.join(names)}\n".encode()
        return 200, "text/plain", b"ok\n"

    return route


def _first(query: Mapping[str, list[str]], key: str) -> str:
    values = query.get(key) or [""]
    return values[0]


# SQLite integers are signed 64-bit: a longer number cannot name a stored row.
_MAX_DIGITS = 18


def _int(text: str) -> int:
    """A non-negative decimal integer in ASCII digits that SQLite can hold, else ValueError."""
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS):
        raise ValueError(text)
    return int(text)


def _epoch(text: str) -> float:
    """A finite number of seconds, else ValueError."""
    value = float(text) if text.isascii() else math.nan
    if not math.isfinite(value):
        raise ValueError(text)
    return value


# A page of events is built whole and held until the client has read it.
MAX_PAGE_BYTES = 4 << 20


def events_route(
    store: EventStore, max_limit: int = 1000, max_bytes: int = MAX_PAGE_BYTES
) -> Route:
    """GET /events?limit=N&kind=xid&code=79&gpu=<bus|uuid|index>&since=<epoch>; /events/ID.

    At most `max_limit` events and `max_bytes` of JSON (fewer events then, and
    `"truncated": true`).
    """

    def route(query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        if _first(query, "id"):
            return _one_event(store, _first(query, "id"))
        try:
            limit = _int(_first(query, "limit") or "100")
            code = _int(_first(query, "code")) if _first(query, "code") else None
            since = _epoch(_first(query, "since")) if _first(query, "since") else None
        except ValueError:
            return 400, "text/plain", _BAD_QUERY
        events = store.recent(
            max(1, min(limit, max_limit)),
            kind=_first(query, "kind") or None,
            code=code,
            gpu=_first(query, "gpu") or None,
            since=since,
        )
        return 200, "application/json", _page(events, max_bytes)

    return route


def _page(events: list[dict[str, Any]], max_bytes: int) -> bytes:
    """The newest events that fit in `max_bytes` of JSON; `truncated` says if some did not."""
    truncated = False
    while True:
        body = {"count": len(events), "events": events, "truncated": truncated}
        data = json.dumps(body, indent=1).encode() + b"\n"
        if len(data) <= max_bytes or len(events) <= 1:
            return data
        events, truncated = events[: len(events) // 2], True  # newest first: keep those


_BAD_QUERY = b"limit and code must be integers (up to 18 digits), since a finite number\n"


def _one_event(store: EventStore, ident: str) -> tuple[int, str, bytes]:
    """One event; a job hang's forensics (stacks, NCCL RAS answer) as JSON, not a string."""
    try:
        event_id = _int(ident)
    except ValueError:
        return 400, "text/plain", b"the event id is a number (up to 18 digits)\n"
    event = store.event(event_id)
    if event is None:
        return 404, "text/plain", b"no such event\n"
    event = hang_report_json(event)  # a hang's report as an object, not a string
    return 200, "application/json", json.dumps(event, indent=1).encode() + b"\n"
