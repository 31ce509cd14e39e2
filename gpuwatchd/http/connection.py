"""One client connection as the server's event loop sees it, and the descriptor budget.

A connection is a socket, where its exchange stands (TLS handshake, request
head, the app, the response, the linger) and one deadline (timers.py). Holding it costs
a descriptor and this small object, never a thread; the open-files limit is
what bounds how many the server can hold.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
from typing import Any

from gpuwatchd.http.webconfig import TlsSettings, WebConfig

__all__ = [
    "APP",
    "Connection",
    "FD_RESERVE",
    "HANDSHAKE",
    "HEAD",
    "IN",
    "LINGER",
    "OUT",
    "WRITE",
    "connection_budget",
    "drain",
    "raise_fd_limit",
    "san_allowed",
    "tls_want",
]

log = logging.getLogger("gpuwatchd.http")

IN = select.EPOLLIN
OUT = select.EPOLLOUT
# Where a connection's exchange stands, in order.
HANDSHAKE = 0  # TLS only
HEAD = 1  # reading the request head
APP = 2  # the app runs on a worker; the loop waits only for hang-ups
WRITE = 3  # sending the response
LINGER = 4  # half-closed: reading what the client still sends, briefly
FD_RESERVE = 128  # descriptors left to the rest of the daemon (store, sources, logs)


class Connection:
    """A client connection and where its exchange stands."""

    __slots__ = ("sock", "fd", "peer", "web", "state", "buf", "out", "timer", "held", "mask",
                 "drained", "closed", "refusal", "greeted")  # fmt: skip

    def __init__(self, sock: socket.socket, peer: str, web: WebConfig | None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.web = web  # the web config of a TLS connection; None for plain HTTP
        self.state = HEAD
        self.buf = b""  # the request head so far
        self.out = memoryview(b"")  # the response still to send
        self.timer: list[Any] | None = None  # its entry in the server's Deadlines
        self.held = 0  # bytes of `out` counted in the server's budget
        self.mask = 0  # the epoll events asked for
        self.drained = 0  # bytes read while lingering
        self.closed = False
        self.refusal = False  # a 503 beyond the table's size
        self.greeted = False  # the TLS handshake has had its first (costly) step


def drain(fd: int) -> None:
    """Read a non-blocking pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def tls_want(exc: OSError) -> int:
    """What a non-blocking TLS call waits for (IN or OUT); 0 for a real error.

    Call it for TLS connections only.
    """
    if isinstance(exc, ssl.SSLWantReadError):
        return IN
    if isinstance(exc, ssl.SSLWantWriteError):
        return OUT
    return 0


def san_allowed(conn: ssl.SSLSocket, tls: TlsSettings) -> bool:
    """Whether the client certificate names one of `client_allowed_sans`."""
    cert = conn.getpeercert()
    if not cert:
        return True  # no certificate: client_auth_type alone decides
    entries = cert.get("subjectAltName", ())
    sans = {str(e[1]) for e in entries if isinstance(e, tuple) and len(e) == 2}
    return bool(sans & set(tls.client_allowed_sans))


def connection_budget(wanted: int) -> int:
    """Connections the open-files limit leaves room for, at most `wanted`."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return min(wanted, max(16, soft - FD_RESERVE))


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one; log if it stays low. Returns it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            log.debug("cannot raise the open-files limit to %s: %s", hard, exc)
    if soft != resource.RLIM_INFINITY and soft < 1024 + FD_RESERVE:
        log.warning(
            "open-files limit is %d: the HTTP server holds at most %d connections "
            "(raise LimitNOFILE / ulimit -n)",
            soft,
            max(16, soft - FD_RESERVE),
        )
    return int(soft)
