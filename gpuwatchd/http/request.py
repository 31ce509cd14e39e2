"""HTTP/1.1 request heads in, responses out: pure functions over bytes, no sockets.

The target must be in origin form (a path, then an optional query): the
daemon is not a proxy, and a path taken from anywhere else in the target
would let a query string such as `?x=http://a/status` choose the route.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

__all__ = ["BadRequest", "MAX_HEADERS", "MAX_HEAD_BYTES", "head_length", "parse_head", "response"]

MAX_HEAD_BYTES = 16384  # request line and headers together
MAX_HEADERS = 100


class BadRequest(Exception):
    """A request the server answers itself with `status` (400, 408, 431).

    `reason` is one of gpuwatchd.http.counters.BAD_REQUEST_REASONS.
    """

    def __init__(self, status: int, why: str, reason: str = "malformed") -> None:
        super().__init__(why)
        self.status = status
        self.reason = reason


def head_length(buf: bytes) -> int:
    """Length of the request head in `buf` (without the blank line), or -1 if incomplete.

    Raises BadRequest(431) once the head outgrows MAX_HEAD_BYTES.
    """
    crlf, lf = buf.find(b"\r\n\r\n"), buf.find(b"\n\n")
    ends = [i for i in (crlf, lf) if i >= 0]
    if not ends:
        if len(buf) > MAX_HEAD_BYTES:
            raise BadRequest(431, "request head too large", "too_large")
        return -1
    end = min(ends)
    if end > MAX_HEAD_BYTES:
        raise BadRequest(431, "request head too large", "too_large")
    return end


def parse_head(head: bytes, peer: str) -> dict[str, Any]:
    """A WSGI environ from the request line and headers (no body: GET and HEAD only)."""
    text = head.decode("latin-1")  # decodes every byte
    lines = text.replace("\r\n", "\n").split("\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha():
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(431, "too many headers", "too_large")
    # Origin form only; the query never changes the path.
    if not target.startswith("/"):
        raise BadRequest(
            400, "the request target must be a path starting with /", "not_origin_form"
        )
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
            raise BadRequest(400, "malformed header line")
        key = "HTTP_" + name.upper().replace("-", "_")
        value = value.strip()
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def response(status: str, headers: list[tuple[str, str]], body: bytes, head: bool = False) -> bytes:
    """The whole response; for HEAD the Content-Length a GET would carry, and no body."""
    names = {k.lower() for k, _ in headers}
    lines = [f"HTTP/1.1 {status}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if "content-type" not in names:
        lines.append("Content-Type: text/plain")
    if "content-length" not in names:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else body)
