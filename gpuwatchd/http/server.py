"""The HTTP server: one event-loop thread for the sockets, bounded pools for the app.

Scope, frozen: HTTP/1.1 GET and HEAD, one request per connection (every
response says `Connection: close`), no request bodies, the target in origin
form; TLS and basic auth from the web config. Anything else is a 400, 405 or
431; growing this is a decision for docs/architecture.md, not a patch. Why
not `http.server` (prometheus_client loads it anyway): its thread per
connection lost every scrape to 64 slow clients; this design on asyncio
streams was measured beside this loop and not taken (docs/architecture.md).

One thread sleeps in epoll(2) and does all socket work without blocking:
accept, TLS handshake, request head, response, a short linger; an idle,
trickling or half-handshaken client costs a socket, never a thread. Each
connection has one deadline for its whole exchange (timers.py); a full
table drops the oldest connection without a complete head; 503
(Retry-After) is for a full queue. A TLS port never answers in clear text.
Memory has a budget under any flood: a closed connection keeps nothing, at
most MAX_HANDSHAKING TLS handshakes past the ClientHello, MAX_HELD_BYTES of
responses for slow readers. Scrapes, other routes and password checks run
on separate bounded pools (dispatch.py). Why: docs/architecture.md.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpuwatchd.http import dispatch
from gpuwatchd.http.app import REASONS, App, LogLimiter
from gpuwatchd.http.connection import (
    APP,
    FD_RESERVE,
    HANDSHAKE,
    HEAD,
    IN,
    LINGER,
    OUT,
    WRITE,
    Connection,
    connection_budget,
    drain,
    raise_fd_limit,
    san_allowed,
    tls_want,
)
from gpuwatchd.http.counters import BAD_REQUESTS
from gpuwatchd.http.request import MAX_HEAD_BYTES, BadRequest, head_length, parse_head, response
from gpuwatchd.http.timers import Deadlines
from gpuwatchd.http.webconfig import IO_TIMEOUT, WebConfig, WebConfigWatcher, with_headers

__all__ = ["FD_RESERVE", "MAX_CONNECTIONS", "MAX_HANDSHAKING", "MAX_HEAD_BYTES", "MAX_HELD_BYTES",
           "WebServer", "raise_fd_limit", "serve"]  # fmt: skip

log = logging.getLogger("gpuwatchd.http")
_limited = LogLimiter(log)

MAX_CONNECTIONS = 4096  # held at once, also bounded by the open-files limit
# A TLS connection past its ClientHello holds about 42 KiB of OpenSSL state
# until the handshake ends: past this many the oldest such one is closed.
MAX_HANDSHAKING = 128
# Response bytes waiting for slow readers; past this the connection that has
# been writing the longest is closed.
MAX_HELD_BYTES = 32 << 20
_MAX_REFUSALS = 64  # 503s being written beyond the table; more are just closed
_LINGER_SECONDS = 1.0
_LINGER_BYTES = 65536
_ACCEPT_BATCH = 64  # accepts per wake-up, so a flood cannot starve the others
_ACCEPT_PAUSE = 0.1  # after EMFILE and nothing to evict
_GREETING_SLICE = 0.01  # seconds of TLS first flights per turn of the loop


class WebServer:
    """Listens on one address; `serve_forever()` serves until `shutdown()`."""

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        watcher: WebConfigWatcher,
        max_connections: int = MAX_CONNECTIONS,
        **pools: int,  # the sizes of dispatch.Dispatcher's pools
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=1024)
        self.socket.setblocking(False)
        self.server_address: tuple[Any, ...] = self.socket.getsockname()
        self.app = app
        self.watcher = watcher
        self.max_connections = max(1, connection_budget(max_connections))
        self._dispatcher = dispatch.Dispatcher(app, self._hand_back, **pools)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep = select.epoll()
        self._ep.register(self.socket.fileno(), IN)
        self._ep.register(self._wake_r, IN)
        self._conns: dict[int, Connection] = {}
        self._incoming: dict[int, Connection] = {}  # no complete head yet, oldest first
        self._handshaking: dict[int, Connection] = {}  # TLS past the ClientHello, oldest first
        self._writing: dict[int, Connection] = {}  # sending a response, oldest first
        self._held = 0  # bytes of responses not yet sent, over all connections
        self._deadlines = Deadlines()
        self._seq = itertools.count()
        self._done: deque[tuple[Connection, bytes]] = deque()  # responses from the workers
        self._refusing = 0
        self._accept_resume = 0.0  # accepting paused until then (EMFILE)
        self._lock = threading.Lock()
        self._shut = False  # set by shutdown(); serve_forever() returns, or never starts
        self._serving = False
        self._stopped = threading.Event()

    # --- lifecycle -------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve connections until `shutdown()`."""
        with self._lock:
            if self._shut:
                return
            self._serving = True
        try:
            self._loop()
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._dispatcher.stop()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop `serve_forever()` and wait for it to return; open connections are closed."""
        with self._lock:
            self._shut = True
            serving = self._serving
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:
                    pass  # full of wake-ups already: the loop will read them and see _shut
        if serving:
            self._stopped.wait()

    def server_close(self) -> None:
        """Close the listening socket, the poller and the wake-up pipe."""
        with self._lock:
            self.socket.close()
            self._ep.close()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1

    # --- the loop --------------------------------------------------------------------

    def _loop(self) -> None:
        listen_fd = self.socket.fileno()
        while True:
            greetings: list[Connection] = []
            for fd, mask in self._ep.poll(self._timeout()):
                if fd == self._wake_r:
                    drain(self._wake_r)
                    if self._shut:
                        return
                conn = self._conns.get(fd)
                if conn is not None and conn.state == HANDSHAKE and not conn.greeted:
                    greetings.append(conn)  # the costly step: after the cheap ones
                    continue
                if fd == listen_fd:
                    self._step(None, self._accept)
                elif fd == self._wake_r:
                    self._step(None, self._finish_jobs)
                elif conn is not None and not conn.closed:
                    self._step(conn, self._on_event, conn, mask)
            # A burst of ClientHellos (each a signature) gets a slice of time per turn;
            # the rest stay readable and come back at the next poll, after which the
            # requests and handshakes further along go first.
            budget = time.monotonic() + _GREETING_SLICE
            for conn in greetings:
                if time.monotonic() > budget:
                    break
                if not conn.closed:
                    self._step(conn, self._handshake, conn)
            self._step(None, self._expire)

    def _step(self, conn: Connection | None, step: Callable[..., None], *args: Any) -> None:
        try:
            step(*args)
        except Exception:  # a surprise in one connection must not end the loop
            _limited.log(logging.ERROR, "loop", "HTTP event loop", exc_info=True)
            if conn is not None:
                self._close(conn)

    def _timeout(self) -> float:
        """Seconds to the next deadline; -1 (sleep until woken) with none."""
        next_due = self._deadlines.next_due()
        due = [] if next_due is None else [next_due]
        if self._accept_resume:
            due.append(self._accept_resume)
        if not due:
            return -1
        return max(0.0, min(due) - time.monotonic()) + 0.001  # epoll rounds down to ms

    def _expire(self) -> None:
        now = time.monotonic()
        if self._accept_resume and now >= self._accept_resume:
            self._accept_resume = 0.0
            self._ep.modify(self.socket.fileno(), IN)
        while (conn := self._deadlines.pop_due(now)) is not None:
            if conn.state == HEAD:
                self._answer(conn, BadRequest(408, "request head not received in time", "timeout"))
            else:  # a handshake, a response or a linger that ran out of time
                self._close(conn)

    def _on_event(self, conn: Connection, mask: int) -> None:
        state = conn.state
        if state == HANDSHAKE:
            self._handshake(conn)
        elif state == HEAD:
            self._read_head(conn)
        elif state == WRITE:
            self._write(conn)
        elif state == LINGER:
            self._linger(conn)
        elif mask & (select.EPOLLHUP | select.EPOLLERR):  # gone while the app runs
            self._close(conn)

    # --- accepting -------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, addr = self.socket.accept()
            except BlockingIOError:
                return
            except (InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:  # EMFILE and the like: make room or back off
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._evict_oldest():
                    continue
                _limited.log(logging.WARNING, "accept", "accept failed: %s (retrying)", exc)
                self._accept_resume = time.monotonic() + _ACCEPT_PAUSE
                self._ep.modify(self.socket.fileno(), 0)
                return
            self._admit(sock, str(addr[0]) if isinstance(addr, tuple) else str(addr))

    def _admit(self, sock: socket.socket, peer: str) -> None:
        sock.setblocking(False)
        web = self.watcher.current()
        tls = web.context is not None
        refusal = len(self._conns) >= self.max_connections and not self._evict_oldest()
        if refusal and (tls or self._refusing >= _MAX_REFUSALS):
            sock.close()  # never a clear-text 503 on a TLS port
            return
        if tls:
            assert web.context is not None
            try:
                sock = web.context.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
            except (OSError, ValueError) as exc:
                log.debug("TLS setup for %s failed: %s", peer, exc)
                sock.close()
                return
        conn = Connection(sock, peer, web if tls else None)
        self._conns[conn.fd] = conn
        self._ep.register(conn.fd, 0)
        if refusal:
            conn.refusal = True
            self._refusing += 1
            self._send(conn, dispatch.BUSY)
            return
        self._incoming[conn.fd] = conn
        # Spread over the second half of IO_TIMEOUT (golden-ratio steps): clients that
        # connected together do not all time out, and come back, together.
        spread = 0.5 + 0.5 * ((next(self._seq) * 0.6180339887) % 1.0)
        self._deadlines.set(conn, time.monotonic() + IO_TIMEOUT * spread)
        conn.state = HANDSHAKE if tls else HEAD
        self._want(conn, IN)

    def _evict_oldest(self) -> bool:
        """Close the oldest connection without a complete head; False if there is none."""
        if not self._incoming:
            return False
        self._close(next(iter(self._incoming.values())))
        return True

    # --- one connection --------------------------------------------------------------

    def _handshake(self, conn: Connection) -> None:
        assert isinstance(conn.sock, ssl.SSLSocket) and conn.web is not None
        if not conn.greeted:
            conn.greeted = True
            if len(self._handshaking) >= MAX_HANDSHAKING:
                self._close(next(iter(self._handshaking.values())))
            self._handshaking[conn.fd] = conn
        try:
            conn.sock.do_handshake()
        except OSError as exc:
            want = tls_want(exc)
            if want:
                self._want(conn, want)
            else:
                log.debug("TLS handshake with %s failed: %s", conn.peer, exc)
                self._close(conn)
            return
        self._handshaking.pop(conn.fd, None)
        tls = conn.web.tls
        if tls and tls.client_allowed_sans and not san_allowed(conn.sock, tls):
            _limited.log(
                logging.WARNING, "san", "client %s: certificate SAN not allowed", conn.peer
            )
            self._close(conn)
            return
        conn.state = HEAD
        self._read_head(conn)  # the request may have come with the last handshake flight

    def _recv(
        self, conn: Connection, failed: Callable[[Connection, OSError], None]
    ) -> bytes | None:
        """One read: the bytes (b"" at the peer's end), or None when it must wait or failed."""
        try:
            return conn.sock.recv(8192)
        except BlockingIOError:
            self._want(conn, IN)
        except OSError as exc:
            failed(conn, exc)
        return None

    def _read_head(self, conn: Connection) -> None:
        while True:
            chunk = self._recv(conn, self._io_failed)
            if chunk is None:
                return
            if not chunk:
                if conn.buf:
                    self._answer(conn, BadRequest(400, "connection closed before the head ended"))
                else:
                    self._close(conn)
                return
            conn.buf += chunk
            try:
                end = head_length(conn.buf)
                if end < 0:
                    continue
                environ = parse_head(conn.buf[:end], conn.peer)
            except BadRequest as exc:
                self._answer(conn, exc)
                return
            self._dispatch(conn, environ)
            return

    def _dispatch(self, conn: Connection, environ: dict[str, Any]) -> None:
        self._incoming.pop(conn.fd, None)
        conn.state, conn.buf = APP, b""
        self._deadlines.cancel(conn)
        self._want(conn, 0)  # hang-ups and errors are still reported
        environ["wsgi.url_scheme"] = "https" if conn.web is not None else "http"
        now = self._dispatcher.dispatch(conn, environ, self.watcher.current())
        if now is not None:
            self._send(conn, now)

    def _hand_back(self, conn: Connection, data: bytes) -> None:
        """From a worker or the credentials thread: a response for the loop to send."""
        self._done.append((conn, data))
        with self._lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"r")
                except BlockingIOError:
                    pass  # the pipe is full: the loop is awake anyway

    def _finish_jobs(self) -> None:
        while self._done:
            conn, data = self._done.popleft()
            if not conn.closed:
                self._send(conn, data)

    def _answer(self, conn: Connection, exc: BadRequest) -> None:
        """The server's own error response (400, 408, 431), over TLS if the port is TLS."""
        self._incoming.pop(conn.fd, None)
        BAD_REQUESTS.add(exc.reason)
        _limited.log(logging.DEBUG, str(exc.status), "bad request from %s: %s", conn.peer, exc)
        body = f"{exc}\n".encode()
        self._send(conn, response(f"{exc.status} {REASONS[exc.status]}", [], body))

    def _send(self, conn: Connection, data: bytes) -> None:
        conn.state, conn.out, conn.held = WRITE, memoryview(data), len(data)
        self._held += len(data)
        self._writing[conn.fd] = conn
        self._deadlines.set(conn, time.monotonic() + IO_TIMEOUT)
        self._write(conn)
        # Over budget: the slowest reader (writing the longest) goes, never this one.
        while self._held > MAX_HELD_BYTES and len(self._writing) > 1:
            oldest = next(iter(self._writing.values()))
            self._close(oldest if oldest is not conn else list(self._writing.values())[1])

    def _io_failed(self, conn: Connection, exc: OSError) -> None:
        """A read or write that TLS wants retried when the socket is ready, else the end."""
        want = tls_want(exc) if conn.web is not None else 0
        if want:
            self._want(conn, want)
        else:
            self._close(conn)

    def _write(self, conn: Connection) -> None:
        while conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except BlockingIOError:
                self._want(conn, OUT)
                return
            except OSError as exc:
                self._io_failed(conn, exc)
                return
            conn.out = conn.out[sent:]
            conn.held -= sent
            self._held -= sent
        self._written(conn)
        # Half-close, then read what the client still sends: closing with unread
        # data resets the connection, which can destroy the response in flight.
        try:
            conn.sock.shutdown(socket.SHUT_WR)  # on TLS: drops the TLS layer first
        except OSError:
            self._close(conn)
            return
        conn.state = LINGER
        self._deadlines.set(conn, time.monotonic() + _LINGER_SECONDS)
        self._linger(conn)

    def _linger(self, conn: Connection) -> None:
        while True:
            chunk = self._recv(conn, lambda c, _exc: self._close(c))
            if chunk is None:
                return
            conn.drained += len(chunk)
            if not chunk or conn.drained > _LINGER_BYTES:
                self._close(conn)
                return

    # --- bookkeeping -----------------------------------------------------------------

    def _want(self, conn: Connection, mask: int) -> None:
        if conn.mask != mask:
            self._ep.modify(conn.fd, mask)
            conn.mask = mask

    def _written(self, conn: Connection) -> None:
        """`conn` holds no response any more: out of the budget and the writers."""
        self._held -= conn.held
        conn.held, conn.out = 0, memoryview(b"")
        self._writing.pop(conn.fd, None)

    def _close(self, conn: Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.pop(conn.fd, None)
        self._incoming.pop(conn.fd, None)
        self._handshaking.pop(conn.fd, None)
        self._written(conn)
        self._deadlines.cancel(conn)  # nothing keeps a closed connection alive
        conn.buf = b""
        if conn.refusal:
            self._refusing -= 1
        try:
            self._ep.unregister(conn.fd)
        except OSError:
            pass
        conn.sock.close()


def serve(
    app: App,
    host: str,
    port: int,
    web: WebConfig | None = None,
    max_connections: int = MAX_CONNECTIONS,
    **pools: int,
) -> tuple[WebServer, threading.Thread]:
    """Serve `app` with TLS/basic auth from `web` on a daemon thread.

    `pools` sizes the worker pools (dispatch.Dispatcher's keyword arguments).
    Returns the server (call `shutdown()` then `server_close()`) and its thread.
    """
    raise_fd_limit()
    watcher = WebConfigWatcher(web or WebConfig())
    httpd = WebServer(with_headers(app, watcher), host, port, watcher, max_connections, **pools)
    thread = threading.Thread(target=httpd.serve_forever, name="http", daemon=True)
    thread.start()
    return httpd, thread
