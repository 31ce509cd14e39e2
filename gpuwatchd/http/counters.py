"""Requests the HTTP layer turned away as bad, counted by a bounded reason.

Anyone who can reach the port can send junk: each bad request costs a count
here, never a log line of its own (the server logs them rate-limited at debug).
"""

from __future__ import annotations

import threading

from prometheus_client.core import Metric

from gpuwatchd.model import MetricSpec
from gpuwatchd.sinks.prometheus import family

__all__ = ["BAD_REQUESTS", "BAD_REQUEST_REASONS", "BadRequestCounter", "HTTP_METRICS"]

BAD_REQUEST_REASONS = (
    "invalid_parameter",
    "malformed",
    "method",
    "not_origin_form",
    "timeout",
    "too_large",
)

HTTP_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_http_bad_requests_total",
        "counter",
        "Requests answered 400, 405, 408 or 431, by reason: malformed (request line or "
        "header), not_origin_form (the target is not a path), method (not GET or HEAD), "
        "timeout (no complete head within 10 s), too_large (head over 16 KiB or 100 "
        "headers), invalid_parameter (an id or number in the path or query a route "
        "rejected).",
        ("reason",),
    ),
)


class BadRequestCounter:
    """Thread-safe counts per reason; a prometheus_client collector of one family."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(BAD_REQUEST_REASONS, 0)
        self._lock = threading.Lock()

    def add(self, reason: str) -> None:
        """Count one; an unknown reason is a bug and raises KeyError."""
        with self._lock:
            self._counts[reason] += 1

    def count(self, reason: str) -> int:
        with self._lock:
            return self._counts[reason]

    def collect(self) -> list[Metric]:
        fam = family(HTTP_METRICS[0])
        with self._lock:
            for reason, n in self._counts.items():
                fam.add_metric((reason,), n)
        return [fam]


# One per process: the server and the app of the daemon count into the same one.
BAD_REQUESTS = BadRequestCounter()
