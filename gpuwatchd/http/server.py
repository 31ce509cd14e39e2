"""The HTTP server: one WSGI app for /metrics and the JSON routes, served with web-config.

The exposition is rendered at most once per snapshot generation; routes are
plain functions `query -> (status, content type, body)`, so a handler never
sees WSGI. TLS handshakes run in each connection's own thread.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer

from gpuwatchd.http.webconfig import (
    IO_TIMEOUT,
    BasicAuth,
    TlsSettings,
    WebConfig,
    WebConfigWatcher,
)

__all__ = ["Route", "WebServer", "json_route", "make_app", "serve"]

log = logging.getLogger("gpuwatchd.http")

App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

Route = Callable[[Mapping[str, list[str]]], tuple[int, str, bytes]]
StartResponse = Callable[..., Any]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def make_app(
    registry: CollectorRegistry,
    routes: Mapping[str, Route],
    generation: Callable[[], int] | None = None,
) -> Callable[[dict[str, Any], StartResponse], Sequence[bytes]]:
    """A WSGI app: /metrics plus the given JSON routes; anything else is 404.

    With `generation` (the snapshot's counter), the exposition is rendered once
    per snapshot and reused by every scrape until the next publish.
    """
    cache: list[tuple[int, bytes]] = []
    cache_lock = threading.Lock()

    def exposition() -> bytes:
        if generation is None:
            return generate_latest(registry)
        gen = generation()
        with cache_lock:
            if cache and cache[0][0] == gen:
                return cache[0][1]
        body = generate_latest(registry)
        with cache_lock:
            cache[:] = [(gen, body)]
        return body

    def app(environ: dict[str, Any], start_response: StartResponse) -> Sequence[bytes]:
        path = environ.get("PATH_INFO", "/") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            return _reply(start_response, 405, "text/plain", b"method not allowed\n")
        query = parse_qs(environ.get("QUERY_STRING", ""))
        base, _, item = path.rpartition("/")
        if path not in routes and base in routes and item:
            path, query = base, {**query, "id": [item]}  # /events/42 is /events?id=42
        if path == "/metrics":
            body = exposition()
            status, ctype = 200, "text/plain; version=0.0.4; charset=utf-8"
        elif path in routes:
            try:
                status, ctype, body = routes[path](query)
            except Exception:
                log.exception("handler for %s", path)
                status, ctype, body = 500, "text/plain", b"internal error\n"
        elif path == "/":
            links = "".join(f'<li><a href="{p}">{p}</a></li>' for p in ["/metrics", *routes])
            body = f"<html><body><h1>gpuwatchd</h1><ul>{links}</ul></body></html>".encode()
            status, ctype = 200, "text/html; charset=utf-8"
        else:
            status, ctype, body = 404, "text/plain", b"not found\n"
        return _reply(start_response, status, ctype, b"" if method == "HEAD" else body)

    return app


def _reply(start: StartResponse, status: int, ctype: str, body: bytes) -> list[bytes]:
    start(
        f"{status} {_REASONS.get(status, 'Unknown')}",
        [("Content-Type", ctype), ("Content-Length", str(len(body)))],
    )
    return [body]


def json_route(producer: Callable[[Mapping[str, list[str]]], object]) -> Route:
    """Wrap a function returning JSON-able data as a 200 application/json route."""

    def route(query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        data = producer(query)
        return 200, "application/json", json.dumps(data, indent=1, default=str).encode() + b"\n"

    return route


def _with_headers(app: App, watcher: WebConfigWatcher) -> App:
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        extra = list(watcher.current().headers)

        def start(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            return start_response(status, headers + extra, *exc)

        return app(environ, start if extra else start_response)

    return wrapped


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        """Scrapes are not worth a log line each."""


class WebServer(ThreadingWSGIServer):
    """ThreadingWSGIServer that does TLS per connection, in the connection's thread.

    Wrapping the listening socket instead would run every handshake in the
    accept loop, where one silent client stalls all others.
    """

    watcher: WebConfigWatcher

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(IO_TIMEOUT)  # a client that stops talking frees its thread
        web = self.watcher.current()
        if web.context is None:
            super().finish_request(request, client_address)
            return
        tls = web.tls
        try:
            conn = web.context.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            log.debug("TLS handshake with %s failed: %s", client_address[0], exc)
            return
        try:
            if tls and tls.client_allowed_sans and not _san_allowed(conn, tls):
                log.warning("client %s: certificate SAN not allowed", client_address[0])
                return
            super().finish_request(conn, client_address)
        finally:
            conn.close()


def _san_allowed(conn: ssl.SSLSocket, tls: TlsSettings) -> bool:
    cert = conn.getpeercert()
    if not cert:
        return True  # no certificate: client_auth_type alone decides
    entries = cert.get("subjectAltName", ())
    sans = {str(e[1]) for e in entries if isinstance(e, tuple) and len(e) == 2}
    return bool(sans & set(tls.client_allowed_sans))


def serve(
    app: App,
    host: str,
    port: int,
    web: WebConfig | None = None,
    handler_class: type[WSGIRequestHandler] = _QuietHandler,
    poll_interval: float = 0.5,
) -> tuple[WSGIServer, threading.Thread]:
    """Serve `app` with TLS/basic auth from `web` on a daemon thread.

    Returns the server (call `shutdown()` then `server_close()`) and its thread.
    """
    watcher = WebConfigWatcher(web or WebConfig())
    wrapped: App = BasicAuth(_with_headers(app, watcher), watcher)

    class Server(WebServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    Server.watcher = watcher
    httpd = make_server(host, port, wrapped, Server, handler_class=handler_class)
    thread = threading.Thread(
        target=httpd.serve_forever, args=(poll_interval,), name="http", daemon=True
    )
    thread.start()
    return httpd, thread
