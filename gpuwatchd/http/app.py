"""The daemon's WSGI app: /metrics plus plain-function JSON routes.

/metrics is prometheus_client's, negotiated and cached per snapshot
(http/exposition.py); routes are plain functions
`query -> (status, content type, body)`, so a handler never sees WSGI.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs

from prometheus_client.registry import Collector

from gpuwatchd.http.counters import BAD_REQUESTS
from gpuwatchd.http.exposition import Exposition

__all__ = ["App", "LogLimiter", "REASONS", "Route", "StartResponse", "json_route", "make_app"]

log = logging.getLogger("gpuwatchd.http")

StartResponse = Callable[..., Any]
App = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
Route = Callable[[Mapping[str, list[str]]], tuple[int, str, bytes]]

REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class LogLimiter:
    """At most one line per `key` every `interval` seconds; the next one says how many it hid.

    Anyone can send bad requests: what they cost in log must not grow with their number.
    """

    def __init__(self, logger: logging.Logger, interval: float = 60.0, max_keys: int = 64) -> None:
        self.logger = logger
        self.interval = interval
        self.max_keys = max_keys
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last line, lines hidden since)
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            last, hidden = self._last.get(key, (-self.interval, 0))
            if now - last < self.interval:
                self._last[key] = (last, hidden + 1)
                return
            if key not in self._last and len(self._last) >= self.max_keys:
                self._last.pop(next(iter(self._last)))
            self._last[key] = (now, 0)
        if hidden:
            msg += f" ({hidden} more like it in the last {self.interval:.0f}s not logged)"
        self.logger.log(level, msg, *args, exc_info=exc_info)


_handler_errors = LogLimiter(log)


def make_app(
    registry: Collector,
    routes: Mapping[str, Route],
    generation: Callable[[], int] | None = None,
) -> Callable[[dict[str, Any], StartResponse], Sequence[bytes]]:
    """A WSGI app: /metrics plus the given JSON routes; anything else is 404.

    With `generation` (the snapshot's counter), the exposition is rendered once
    per snapshot and format, and reused by every scrape until the next publish.
    The HTTP layer's own counters are written fresh after it.
    """
    exposition = Exposition(registry, BAD_REQUESTS, generation)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Sequence[bytes]:
        path = environ.get("PATH_INFO", "/") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            BAD_REQUESTS.add("method")
            return _reply(start_response, 405, "text/plain", b"method not allowed\n")
        query = parse_qs(environ.get("QUERY_STRING", ""))
        base, _, item = path.rpartition("/")
        if path not in routes and base in routes and item:
            path, query = base, {**query, "id": [item]}  # /events/42 is /events?id=42
        if path == "/metrics":
            body, headers = exposition.reply(
                environ.get("HTTP_ACCEPT", ""), environ.get("HTTP_ACCEPT_ENCODING", "")
            )
            return _reply(start_response, 200, "", body, headers)
        if path in routes:
            try:
                status, ctype, body = routes[path](query)
                if status == 400:
                    BAD_REQUESTS.add("invalid_parameter")
            except Exception:
                _handler_errors.log(logging.ERROR, path, "handler for %s", path, exc_info=True)
                status, ctype, body = 500, "text/plain", b"internal error\n"
        elif path == "/":
            links = "".join(f'<li><a href="{p}">{p}</a></li>' for p in ["/metrics", *routes])
            body = f"<html><body><h1>gpuwatchd</h1><ul>{links}</ul></body></html>".encode()
            status, ctype = 200, "text/html; charset=utf-8"
        else:
            status, ctype, body = 404, "text/plain", b"not found\n"
        return _reply(start_response, status, ctype, body)  # the server sends no body for HEAD

    return app


def _reply(
    start: StartResponse,
    status: int,
    ctype: str,
    body: bytes,
    headers: Sequence[tuple[str, str]] = (),
) -> list[bytes]:
    """Start the response; `headers`, when given, carry the Content-Type instead of `ctype`."""
    start(
        f"{status} {REASONS.get(status, 'Unknown')}",
        [*(headers or [("Content-Type", ctype)]), ("Content-Length", str(len(body)))],
    )
    return [body]


def json_route(producer: Callable[[Mapping[str, list[str]]], object]) -> Route:
    """Wrap a function returning JSON-able data as a 200 application/json route."""

    def route(query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        data = producer(query)
        return 200, "application/json", json.dumps(data, indent=1, default=str).encode() + b"\n"

    return route
