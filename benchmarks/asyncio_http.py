"""The HTTP server's design on stdlib asyncio streams: the candidate it was measured against.

Same scope, limits, pools and routes as gpuwatchd/http/server.py (GET/HEAD,
one request per connection, the same dispatcher, web config, 4,096
connections, 128 TLS handshakes past the ClientHello, 32 MiB of held
responses, deadlines spread over the second half of IO_TIMEOUT); what
differs is underneath: one asyncio loop and a task per connection, and
asyncio's SSL protocol running the TLS state machine (the handshake,
close_notify) instead of the hand-written one. Where it falls short of the
epoll loop, besides what the figures show: TLS first flights get no time
slice of their own (asyncio runs each handshake step as its bytes arrive),
and a client that hangs up while the app runs is noticed only when its
answer is written. Measured and not taken (docs/architecture.md); not part
of the package, kept so that docs/benchmarks.md ("http-servers") can be
measured again:

    .venv/bin/python benchmarks/asyncio_http.py run ...   # `gpuwatchd run`, served by this
    GPUWATCHD_BENCH_HTTP=asyncio .venv/bin/python benchmarks/bench_http_floods.py ...
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import socket
import ssl
import sys
import threading
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuwatchd.http import dispatch  # noqa: E402
from gpuwatchd.http.app import REASONS, App, LogLimiter  # noqa: E402
from gpuwatchd.http.connection import connection_budget, raise_fd_limit, san_allowed  # noqa: E402
from gpuwatchd.http.counters import BAD_REQUESTS  # noqa: E402
from gpuwatchd.http.request import MAX_HEAD_BYTES, BadRequest, head_length, parse_head, response  # noqa: E402
from gpuwatchd.http.server import MAX_CONNECTIONS, MAX_HANDSHAKING, MAX_HELD_BYTES  # noqa: E402
from gpuwatchd.http.webconfig import IO_TIMEOUT, WebConfig, WebConfigWatcher, with_headers  # noqa: E402

log = logging.getLogger("gpuwatchd.http")
_limited = LogLimiter(log)

_MAX_REFUSALS = 64
_LINGER_SECONDS = 1.0
_LINGER_BYTES = 65536
_ACCEPT_PAUSE = 0.1


class _Gone(Exception):
    """The client closed before sending anything."""


class Exchange:
    """One connection's exchange, as the dispatcher sees it (`closed`)."""

    __slots__ = ("sock", "fd", "peer", "task", "transport", "reader", "writer", "reply",
                 "hello", "held", "closed", "refusal", "watching", "connecting",
                 "graceful")  # fmt: skip

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.task: asyncio.Task[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.reply: asyncio.Future[bytes] | None = None
        self.hello: asyncio.Future[bool] | None = None  # resolved False when closed
        self.held = 0
        self.closed = False
        self.refusal = False
        self.watching = False  # a reader registered on fd (waiting for the ClientHello)
        self.connecting = False  # the transport is being made: it owns the socket
        self.graceful = False  # closed on purpose after the linger: no abort


class AsyncWebServer:
    """Listens on one address; `serve_forever()` runs an asyncio loop until `shutdown()`."""

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        watcher: WebConfigWatcher,
        max_connections: int = MAX_CONNECTIONS,
        **pools: int,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=1024)
        self.socket.setblocking(False)
        self.server_address: tuple[Any, ...] = self.socket.getsockname()
        self.app = app
        self.watcher = watcher
        self.max_connections = max(1, connection_budget(max_connections))
        self._dispatcher = dispatch.Dispatcher(app, self._hand_back, **pools)  # type: ignore[arg-type]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._conns: dict[Exchange, None] = {}  # ordered: oldest first
        self._incoming: dict[Exchange, None] = {}  # no complete head yet
        self._handshaking: dict[Exchange, None] = {}  # TLS past the ClientHello
        self._writing: dict[Exchange, None] = {}
        self._held = 0
        self._refusing = 0
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._shut = False
        self._serving = False
        self._stopped = threading.Event()

    # --- lifecycle -------------------------------------------------------------------

    def serve_forever(self) -> None:
        with self._lock:
            if self._shut:
                return
            self._serving = True
        try:
            asyncio.run(self._main())
        finally:
            self._dispatcher.stop()
            self._stopped.set()

    def shutdown(self) -> None:
        with self._lock:
            self._shut = True
            serving, loop, stop = self._serving, self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop is closed already
        if serving:
            self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(
            lambda _loop, ctx: _limited.log(logging.DEBUG, "asyncio", "%s", ctx.get("message"))
        )
        stop = asyncio.Event()
        with self._lock:
            self._loop, self._stop = loop, stop
            if self._shut:
                return
        accepting = asyncio.create_task(self._accept_loop())
        await stop.wait()
        accepting.cancel()
        tasks = [ex.task for ex in self._conns if ex.task is not None]
        for ex in list(self._conns):
            self._close(ex)
        for task in tasks:
            task.cancel()  # a reply the stopped workers will not send
        await asyncio.gather(accepting, *tasks, return_exceptions=True)

    # --- accepting -------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self.socket)
            except (InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._evict_oldest():
                    continue
                _limited.log(logging.WARNING, "accept", "accept failed: %s (retrying)", exc)
                await asyncio.sleep(_ACCEPT_PAUSE)
                continue
            self._admit(sock, str(addr[0]) if isinstance(addr, tuple) else str(addr))

    def _admit(self, sock: socket.socket, peer: str) -> None:
        # asyncio sets TCP_NODELAY only on sockets made with proto=IPPROTO_TCP, which an
        # accepted one is not; without it, its TLS records meet delayed ACKs (40 ms).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        web = self.watcher.current()
        tls = web.context is not None
        refusal = len(self._conns) >= self.max_connections and not self._evict_oldest()
        if refusal and (tls or self._refusing >= _MAX_REFUSALS):
            sock.close()  # never a clear-text 503 on a TLS port
            return
        ex = Exchange(sock, peer)
        self._conns[ex] = None
        if refusal:
            ex.refusal = True
            self._refusing += 1
        else:
            self._incoming[ex] = None
        ex.task = asyncio.get_running_loop().create_task(self._exchange(ex, web))

    def _evict_oldest(self) -> bool:
        if not self._incoming:
            return False
        self._close(next(iter(self._incoming)))
        return True

    # --- one exchange ----------------------------------------------------------------

    async def _exchange(self, ex: Exchange, web: WebConfig) -> None:
        loop = asyncio.get_running_loop()
        if ex.closed:
            return  # closed before it started
        try:
            if ex.refusal:
                await self._open(ex, None, 0.0)
                await self._send(ex, dispatch.BUSY)
                return
            spread = 0.5 + 0.5 * ((next(self._seq) * 0.6180339887) % 1.0)
            deadline = loop.time() + IO_TIMEOUT * spread
            bad: BadRequest | None = None
            environ: dict[str, Any] = {}
            try:
                async with asyncio.timeout_at(deadline):
                    if web.context is not None:
                        await self._client_hello(ex)
                        if len(self._handshaking) >= MAX_HANDSHAKING:
                            self._close(next(iter(self._handshaking)))
                        self._handshaking[ex] = None
                        reader = await self._open(ex, web.context, deadline - loop.time())
                        self._handshaking.pop(ex, None)
                        tls = web.tls
                        ssl_object = cast(Any, ex.writer).get_extra_info("ssl_object")
                        if tls and tls.client_allowed_sans and not san_allowed(ssl_object, tls):
                            _limited.log(
                                logging.WARNING, "san", "client %s: certificate SAN not allowed",
                                ex.peer,
                            )  # fmt: skip
                            return
                    else:
                        reader = await self._open(ex, None, 0.0)
                    environ = await self._read_head(ex, reader)
            except TimeoutError:
                if ex.writer is None:
                    return  # the handshake ran out of time
                bad = BadRequest(408, "request head not received in time", "timeout")
            except BadRequest as exc:
                bad = exc
            self._incoming.pop(ex, None)
            if bad is not None:
                BAD_REQUESTS.add(bad.reason)
                _limited.log(
                    logging.DEBUG, str(bad.status), "bad request from %s: %s", ex.peer, bad
                )
                status = f"{bad.status} {REASONS[bad.status]}"
                await self._send(ex, response(status, [], f"{bad}\n".encode()))
                return
            environ["wsgi.url_scheme"] = "https" if web.context is not None else "http"
            ex.reply = loop.create_future()
            now = self._dispatcher.dispatch(ex, environ, self.watcher.current())  # type: ignore[arg-type]
            await self._send(ex, now if now is not None else await ex.reply)
        except (_Gone, OSError, asyncio.IncompleteReadError):
            pass
        except Exception:
            _limited.log(logging.ERROR, "loop", "HTTP exchange", exc_info=True)
        finally:
            self._close(ex)

    async def _client_hello(self, ex: Exchange) -> None:
        """Wait until the client has sent something (its ClientHello), reading nothing."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bool] = loop.create_future()

        def readable() -> None:
            if not ready.done():
                ready.set_result(True)

        loop.add_reader(ex.fd, readable)
        ex.watching, ex.hello = True, ready
        try:
            arrived = await ready
        finally:
            ex.hello = None
            if ex.watching:
                loop.remove_reader(ex.fd)
                ex.watching = False
        if not arrived:
            raise _Gone

    async def _open(
        self, ex: Exchange, context: ssl.SSLContext | None, timeout: float
    ) -> asyncio.StreamReader:
        """Streams over the accepted socket; with `context`, after asyncio's TLS handshake."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        tls: dict[str, Any] = {}
        if context is not None:
            tls = {"ssl": context, "ssl_handshake_timeout": max(0.001, timeout),
                   "ssl_shutdown_timeout": _LINGER_SECONDS}  # fmt: skip
        ex.connecting = True
        transport, _ = await loop.connect_accepted_socket(lambda: protocol, ex.sock, **tls)
        ex.connecting = False
        ex.transport = transport
        ex.reader, ex.writer = reader, asyncio.StreamWriter(transport, protocol, reader, loop)
        if ex.closed:  # evicted while the handshake ended
            raise _Gone
        return reader

    async def _read_head(self, ex: Exchange, reader: asyncio.StreamReader) -> dict[str, Any]:
        buf = b""
        while True:
            chunk = await reader.read(8192)
            if not chunk:
                if buf:
                    raise BadRequest(400, "connection closed before the head ended")
                raise _Gone
            buf += chunk
            end = head_length(buf)
            if end >= 0:
                return parse_head(buf[:end], ex.peer)

    def _hand_back(self, ex: Exchange, data: bytes) -> None:
        """From a worker or the credentials thread: the response, to the loop."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._deliver, ex, data)
        except RuntimeError:
            pass  # the loop has ended

    @staticmethod
    def _deliver(ex: Exchange, data: bytes) -> None:
        if ex.reply is not None and not ex.reply.done():
            ex.reply.set_result(data)

    async def _send(self, ex: Exchange, data: bytes) -> None:
        """Write the response within IO_TIMEOUT, then linger briefly and close."""
        writer, transport, reader = ex.writer, ex.transport, ex.reader
        assert writer is not None and transport is not None and reader is not None
        transport.set_write_buffer_limits(high=0)  # drain() returns when all is sent
        writer.write(data)
        ex.held = transport.get_write_buffer_size()
        self._held += ex.held
        self._writing[ex] = None
        self._budget(ex)
        async with asyncio.timeout(IO_TIMEOUT):
            await writer.drain()
        self._written(ex)
        async with asyncio.timeout(_LINGER_SECONDS):
            if writer.can_write_eof():  # plain TCP: half-close, read what still comes
                writer.write_eof()
                drained = 0
                while chunk := await reader.read(65536):
                    drained += len(chunk)
                    if drained > _LINGER_BYTES:
                        return
            ex.graceful = True
            writer.close()  # TLS: close_notify, bounded by ssl_shutdown_timeout
            await writer.wait_closed()

    def _budget(self, ex: Exchange) -> None:
        """Over MAX_HELD_BYTES, the connection writing the longest goes, never `ex`."""
        if self._held <= MAX_HELD_BYTES:
            return
        self._held = 0
        for other in self._writing:
            assert other.transport is not None
            other.held = other.transport.get_write_buffer_size()
            self._held += other.held
        while self._held > MAX_HELD_BYTES and len(self._writing) > 1:
            oldest = next(iter(self._writing))
            self._close(oldest if oldest is not ex else list(self._writing)[1])

    def _written(self, ex: Exchange) -> None:
        self._held -= ex.held
        ex.held = 0
        self._writing.pop(ex, None)

    def _close(self, ex: Exchange) -> None:
        """Forget `ex` at once; its socket or transport goes, its task is cancelled."""
        if ex.closed:
            return
        ex.closed = True
        self._conns.pop(ex, None)
        self._incoming.pop(ex, None)
        self._handshaking.pop(ex, None)
        self._written(ex)
        if ex.refusal:
            self._refusing -= 1
        # No task is cancelled here: a cancelled task keeps its frames (and a TLS
        # protocol's 256 KiB buffer) in a reference cycle until the collector runs.
        if ex.watching:
            asyncio.get_running_loop().remove_reader(ex.fd)
            ex.watching = False
        if ex.hello is not None and not ex.hello.done():
            ex.hello.set_result(False)
        if ex.transport is not None:
            if not ex.graceful:
                ex.transport.abort()  # wakes a pending read or drain
        elif ex.connecting:
            try:  # the handshake fails at once; the transport closes the socket
                ex.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        else:
            ex.sock.close()


def serve(
    app: App,
    host: str,
    port: int,
    web: WebConfig | None = None,
    max_connections: int = MAX_CONNECTIONS,
    **pools: int,
) -> tuple[AsyncWebServer, threading.Thread]:
    """Like gpuwatchd.http.server.serve, with the asyncio server."""
    raise_fd_limit()
    watcher = WebConfigWatcher(web or WebConfig())
    httpd = AsyncWebServer(
        with_headers(app, watcher), host, port, watcher, max_connections, **pools
    )
    thread = threading.Thread(target=httpd.serve_forever, name="http", daemon=True)
    thread.start()
    return httpd, thread


def daemon_command() -> list[str]:
    """The command that starts the daemon with the server GPUWATCHD_BENCH_HTTP names."""
    if os.environ.get("GPUWATCHD_BENCH_HTTP", "epoll") == "asyncio":
        return [sys.executable, str(Path(__file__).resolve())]
    return [sys.executable, "-m", "gpuwatchd"]


if __name__ == "__main__":
    import runpy

    from gpuwatchd import daemon

    setattr(daemon, "serve", serve)  # noqa: B010 (the daemon calls it by this name)
    sys.argv[0] = "gpuwatchd"
    runpy.run_module("gpuwatchd", run_name="__main__")
