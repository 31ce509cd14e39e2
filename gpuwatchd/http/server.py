"""The HTTP server: a small HTTP/1.1 front for the WSGI app, with web-config TLS and auth.

Written on plain sockets rather than `http.server`/`wsgiref`: the daemon answers
GET and HEAD on a handful of paths, and the stdlib server (with the email and
http.client packages it imports) cost several MiB of the daemon's memory.
Every connection gets its own thread, which also runs the TLS handshake, so
one silent client never stalls the accept loop; the number of connections
served at once is capped, the whole request head must arrive within
IO_TIMEOUT, and one response is sent per connection (Connection: close).
The accept loop sleeps in poll(2) with no timeout; `shutdown()` wakes it
through a pipe.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

from gpuwatchd.http.app import REASONS, App, StartResponse
from gpuwatchd.http.webconfig import (
    IO_TIMEOUT,
    BasicAuth,
    TlsSettings,
    WebConfig,
    WebConfigWatcher,
)

__all__ = ["MAX_CONNECTIONS", "MAX_HEAD_BYTES", "WebServer", "serve"]

log = logging.getLogger("gpuwatchd.http")

MAX_CONNECTIONS = 64  # served at once; more are answered 503 and closed
MAX_HEAD_BYTES = 16384  # request line and headers together
_MAX_HEADERS = 100
_MAX_REFUSALS = 8  # 503s being sent at once; beyond both caps a connection is just closed
_REFUSAL_TIMEOUT = 1.0
_LINGER_SECONDS = 1.0


class _BadRequest(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class WebServer:
    """Listens on one address; `serve_forever()` accepts until `shutdown()`."""

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        watcher: WebConfigWatcher,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=128)
        self.socket.setblocking(False)
        self.server_address: tuple[Any, ...] = self.socket.getsockname()
        self.app = app
        self.watcher = watcher
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refusals = threading.BoundedSemaphore(_MAX_REFUSALS)
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._shut = False  # set by shutdown(); serve_forever() returns, or never starts
        self._serving = False
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        """Accept connections, each served on its own thread, until `shutdown()`."""
        with self._lock:
            if self._shut:
                return
            self._serving = True
        poller = select.poll()
        poller.register(self.socket, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        warned = 0.0
        try:
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if self._wake_r in ready or self._shut:
                    return
                try:
                    conn, addr = self.socket.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError as exc:  # EMFILE and the like: back off, keep serving
                    if time.monotonic() - warned > 60:  # at most a line a minute
                        warned = time.monotonic()
                        log.warning("accept failed: %s (retrying)", exc)
                    time.sleep(0.1)
                    continue
                self._start(conn, addr)
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop `serve_forever()` and wait for it to return; connections in flight finish."""
        with self._lock:
            self._shut = True
            serving = self._serving
        os.write(self._wake_w, b"x")
        if serving:
            self._stopped.wait()

    def server_close(self) -> None:
        """Close the listening socket and the wake-up pipe."""
        self.socket.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _start(self, conn: socket.socket, addr: Any) -> None:
        conn.setblocking(True)
        if self._slots.acquire(blocking=False):
            target, slots = self._connection, self._slots
        elif self._refusals.acquire(blocking=False):
            target, slots = self._refuse, self._refusals
        else:
            conn.close()  # flooded: not even a 503
            return
        try:
            threading.Thread(
                target=target, args=(conn, addr), name="http-conn", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: drop the connection rather than die
            slots.release()
            conn.close()

    def _refuse(self, conn: socket.socket, addr: Any) -> None:
        """503 to a client over the connection cap, after reading its request (else: RST)."""
        try:
            conn.settimeout(_REFUSAL_TIMEOUT)
            try:
                conn.recv(MAX_HEAD_BYTES)
            except TimeoutError:
                pass
            conn.sendall(_response("503 Service Unavailable", [("Retry-After", "1")], b"busy\n"))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            conn.close()
            self._refusals.release()

    def _connection(self, conn: socket.socket, addr: Any) -> None:
        peer = str(addr[0]) if isinstance(addr, tuple) else str(addr)
        try:
            conn.settimeout(IO_TIMEOUT)  # a client that stops talking frees its thread
            web = self.watcher.current()
            sock = self._tls(conn, web, peer) if web.context is not None else conn
            if sock is not None:
                try:
                    self._exchange(sock, peer)
                    if sock is conn:
                        _linger(conn)
                finally:
                    if sock is not conn:
                        sock.close()
        except OSError as exc:
            log.debug("connection from %s: %s", peer, exc)
        finally:
            conn.close()
            self._slots.release()

    @staticmethod
    def _tls(conn: socket.socket, web: WebConfig, peer: str) -> ssl.SSLSocket | None:
        assert web.context is not None
        try:
            tls_conn = web.context.wrap_socket(conn, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            log.debug("TLS handshake with %s failed: %s", peer, exc)
            return None
        if web.tls and web.tls.client_allowed_sans and not _san_allowed(tls_conn, web.tls):
            log.warning("client %s: certificate SAN not allowed", peer)
            tls_conn.close()
            return None
        return tls_conn

    def _exchange(self, sock: socket.socket, peer: str) -> None:
        try:
            environ = _parse_head(_read_head(sock), peer)
        except _BadRequest as exc:
            log.debug("bad request from %s: %s", peer, exc)
            body = f"{exc}\n".encode()
            sock.sendall(_response(f"{exc.status} {REASONS[exc.status]}", [], body))
            return
        sent: list[tuple[str, list[tuple[str, str]]]] = []

        def start_response(status: str, headers: list[tuple[str, str]], *_exc: Any) -> Any:
            sent[:] = [(status, headers)]
            return None

        try:
            chunks = b"".join(self.app(environ, start_response))
        except Exception:
            log.exception("request %s %s", environ["REQUEST_METHOD"], environ["PATH_INFO"])
            sent[:] = [("500 Internal Server Error", [("Content-Type", "text/plain")])]
            chunks = b"internal error\n"
        status, headers = sent[0] if sent else ("500 Internal Server Error", [])
        sock.sendall(_response(status, headers, chunks, environ["REQUEST_METHOD"] == "HEAD"))


def _linger(conn: socket.socket) -> None:
    """Half-close, then read what the client still sends, so closing does not reset
    the connection (a reset can destroy the response before the client reads it)."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(_LINGER_SECONDS)
    drained = 0
    while drained < MAX_HEAD_BYTES:
        chunk = conn.recv(4096)
        if not chunk:
            return
        drained += len(chunk)


def _read_head(sock: socket.socket) -> bytes:
    """Bytes up to the blank line ending the request head, within IO_TIMEOUT in all."""
    deadline = time.monotonic() + IO_TIMEOUT
    buf = b""
    while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
        if len(buf) > MAX_HEAD_BYTES:
            raise _BadRequest(431, "request head too large")
        left = deadline - time.monotonic()
        if left <= 0:
            raise _BadRequest(408, "request head not received in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            raise _BadRequest(408, "request head not received in time") from None
        if not chunk:
            raise _BadRequest(400, "connection closed before the request head ended")
        buf += chunk
    sock.settimeout(IO_TIMEOUT)
    head = buf.split(b"\n\n" if b"\r\n\r\n" not in buf else b"\r\n\r\n", 1)[0]
    if len(head) > MAX_HEAD_BYTES:
        raise _BadRequest(431, "request head too large")
    return head


def _parse_head(head: bytes, peer: str) -> dict[str, Any]:
    """A WSGI environ from the request line and headers (no body: GET and HEAD only)."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise _BadRequest(400, "undecodable request") from None
    lines = text.replace("\r\n", "\n").split("\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha():
        raise _BadRequest(400, "malformed request line")
    method, target, version = parts
    if len(lines) - 1 > _MAX_HEADERS:
        raise _BadRequest(431, "too many headers")
    if "://" in target:  # absolute form: keep the path
        target = "/" + target.split("://", 1)[1].partition("/")[2]
    path, _, query = target.partition("?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "PATH_INFO": unquote(path, "latin-1"),
        "QUERY_STRING": query,
        "SERVER_PROTOCOL": version,
        "REMOTE_ADDR": peer,
    }
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "malformed header line")
        key = "HTTP_" + name.upper().replace("-", "_")
        value = value.strip()
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def _response(
    status: str, headers: list[tuple[str, str]], body: bytes, head: bool = False
) -> bytes:
    names = {k.lower() for k, _ in headers}
    lines = [f"HTTP/1.1 {status}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if "content-type" not in names:
        lines.append("Content-Type: text/plain")
    if "content-length" not in names:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else body)


def _san_allowed(conn: ssl.SSLSocket, tls: TlsSettings) -> bool:
    cert = conn.getpeercert()
    if not cert:
        return True  # no certificate: client_auth_type alone decides
    entries = cert.get("subjectAltName", ())
    sans = {str(e[1]) for e in entries if isinstance(e, tuple) and len(e) == 2}
    return bool(sans & set(tls.client_allowed_sans))


def _with_headers(app: App, watcher: WebConfigWatcher) -> App:
    def wrapped(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        extra = list(watcher.current().headers)

        def start(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            return start_response(status, headers + extra, *exc)

        return app(environ, start if extra else start_response)

    return wrapped


def serve(
    app: App,
    host: str,
    port: int,
    web: WebConfig | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> tuple[WebServer, threading.Thread]:
    """Serve `app` with TLS/basic auth from `web` on a daemon thread.

    Returns the server (call `shutdown()` then `server_close()`) and its thread.
    """
    watcher = WebConfigWatcher(web or WebConfig())
    wrapped: App = BasicAuth(_with_headers(app, watcher), watcher)
    httpd = WebServer(wrapped, host, port, watcher, max_connections)
    thread = threading.Thread(target=httpd.serve_forever, name="http", daemon=True)
    thread.start()
    return httpd, thread
