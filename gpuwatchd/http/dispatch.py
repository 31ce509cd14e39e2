"""Where a complete request runs: scrapes, JSON routes and credential checks apart.

Three bounded pools, so no kind of flood can take another's place:
- /metrics and /healthz on their own workers: scrapes never wait behind
  a JSON route or a password check;
- every other route (/events, /status, ...) on two workers with a short
  queue: a flood of large JSON pages gets 503, the scrapes go on;
- credentials that are not yet known on one thread (bcrypt is slow on
  purpose) with its own short queue: a wrong-password flood gets 503,
  and a scraper whose credentials were verified before goes straight to
  the scrape workers.
A full queue answers 503 (Retry-After) at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gpuwatchd.http.app import App, LogLimiter
from gpuwatchd.http.auth import Credentials
from gpuwatchd.http.connection import Connection
from gpuwatchd.http.request import response
from gpuwatchd.http.webconfig import PUBLIC_PATHS, WebConfig
from gpuwatchd.http.workers import WorkerPool

__all__ = [
    "AUTH_QUEUED",
    "BUSY",
    "Dispatcher",
    "MAX_QUEUED",
    "ROUTE_QUEUED",
    "ROUTE_WORKERS",
    "SCRAPE_PATHS",
    "WORKERS",
]

log = logging.getLogger("gpuwatchd.http")
_limited = LogLimiter(log)

SCRAPE_PATHS = frozenset({"/metrics", "/healthz"})
WORKERS = 4  # threads running scrapes (/metrics, /healthz)
MAX_QUEUED = 64  # scrapes waiting for one of them
ROUTE_WORKERS = 2  # threads running the other routes (JSON pages)
ROUTE_QUEUED = 8  # requests waiting for one of them
AUTH_QUEUED = 16  # requests waiting for the credentials thread (bcrypt)
BUSY = response("503 Service Unavailable", [("Retry-After", "1")], b"busy\n")

HandBack = Callable[[Connection, bytes], None]


def unauthorized(web: WebConfig, realm: str = "gpuwatchd") -> bytes:
    headers = [("WWW-Authenticate", f'Basic realm="{realm}", charset="UTF-8"'), *web.headers]
    return response("401 Unauthorized", headers, b"unauthorized\n")


class Dispatcher:
    """Runs complete requests on the right pool; answers come back through `hand_back`."""

    def __init__(
        self,
        app: App,
        hand_back: HandBack,
        workers: int = WORKERS,
        max_queued: int = MAX_QUEUED,
        route_workers: int = ROUTE_WORKERS,
        route_queued: int = ROUTE_QUEUED,
        auth_queued: int = AUTH_QUEUED,
    ) -> None:
        self.app = app
        self._hand_back = hand_back
        self._scrapes = WorkerPool(workers, max_queued, "http-scrape")
        self._routes = WorkerPool(route_workers, route_queued, "http-route")
        self._checks = WorkerPool(1, auth_queued, "http-auth")
        self.credentials = Credentials()

    def dispatch(self, conn: Connection, environ: dict[str, Any], web: WebConfig) -> bytes | None:
        """Queue the request; or the answer to send now (401 known, 503 full)."""
        path = environ["PATH_INFO"]
        pool = self._scrapes if path in SCRAPE_PATHS else self._routes

        def run() -> None:
            self._run_app(conn, environ)

        if web.users and path not in PUBLIC_PATHS:
            header = environ.get("HTTP_AUTHORIZATION", "")
            verdict = self.credentials.cached(web.users, header)
            if verdict is None:

                def check() -> None:
                    self._check(conn, web, header, pool, run)

                return None if self._checks.submit(check) else BUSY
            if not verdict:
                return unauthorized(web)
        return None if pool.submit(run) else BUSY

    def stop(self) -> None:
        for pool in (self._checks, self._routes, self._scrapes):
            pool.stop()

    def _check(
        self,
        conn: Connection,
        web: WebConfig,
        header: str,
        pool: WorkerPool,
        run: Callable[[], None],
    ) -> None:
        """On the credentials thread: bcrypt, then the app's pool (or 401, or 503)."""
        if conn.closed:
            return  # the client gave up while queued: no bcrypt for nobody
        try:
            ok = self.credentials.verify(web.users, header)
        except Exception:
            _limited.log(logging.ERROR, "auth", "checking credentials", exc_info=True)
            ok = False
        if not ok:
            self._hand_back(conn, unauthorized(web))
        elif not pool.submit(run):
            self._hand_back(conn, BUSY)

    def _run_app(self, conn: Connection, environ: dict[str, Any]) -> None:
        """On a worker: the app's response, handed back to the loop."""
        sent: list[tuple[str, list[tuple[str, str]]]] = []

        def start_response(status: str, headers: list[tuple[str, str]], *_exc: Any) -> Any:
            sent[:] = [(status, headers)]
            return None

        method, path = environ["REQUEST_METHOD"], environ["PATH_INFO"]
        try:
            body = b"".join(self.app(environ, start_response))
        except Exception:
            _limited.log(logging.ERROR, "app", "request %s %s", method, path, exc_info=True)
            sent[:] = [("500 Internal Server Error", [("Content-Type", "text/plain")])]
            body = b"internal error\n"
        status, headers = sent[0] if sent else ("500 Internal Server Error", [])
        self._hand_back(conn, response(status, headers, body, method == "HEAD"))
