"""Fuzz the HTTP request-head parser: any bytes give a head or a BadRequest, nothing else.

Seeds are the hostile heads kept in tests/fuzz/corpus/http (add a file there for
every head that ever broke the parser or the server). Hypothesis mutates them;
the run is bounded by example count, not by wall time. The server's scope is
GET and HEAD, one request per connection, no bodies (http/server.py).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gpuwatchd.http.app import make_app
from gpuwatchd.http.counters import BAD_REQUEST_REASONS
from gpuwatchd.http.request import (
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    BadRequest,
    head_length,
    parse_head,
)
from gpuwatchd.http.server import WebServer, serve

CORPUS = Path(__file__).parent / "corpus" / "http"
SEEDS = sorted(path.read_bytes() for path in CORPUS.iterdir())
PIECES = [
    b"GET ",
    b"HEAD ",
    b"POST ",
    b"/metrics",
    b"/events/",
    b"?limit=1000",
    b"%2F",
    b"%",
    b" HTTP/1.1",
    b" HTTP/1.0",
    b"\r\n",
    b"\n",
    b"\r",
    b"\r\n\r\n",
    b"Host: x",
    b"Authorization: Basic ",
    b"Transfer-Encoding: chunked",
    b"Content-Length: 99999999999999999999",
    b":",
    b" ",
    b"\t",
    b"\x00",
    b"\xff",
    "é".encode(),
]
FUZZ = settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

heads = st.one_of(
    st.sampled_from(SEEDS),
    st.lists(st.sampled_from(PIECES) | st.binary(max_size=12), max_size=32).map(b"".join),
    st.tuples(st.sampled_from(SEEDS), st.integers(0, 200), st.binary(max_size=40)).map(
        lambda t: t[0][: t[1]] + t[2] + t[0][t[1] :]
    ),
)


def check_environ(env: dict[str, Any]) -> None:
    assert env["REQUEST_METHOD"].isalpha()
    assert env["PATH_INFO"].startswith("/")  # origin form: a query never chooses the path
    assert env["SERVER_PROTOCOL"].startswith("HTTP/1.")
    for key, value in env.items():
        assert isinstance(value, str)
        if key.startswith("HTTP_"):
            assert "-" not in key and key == key.upper() and value == value.strip()
    assert sum(1 for k in env if k.startswith("HTTP_")) <= MAX_HEADERS


def check_head(raw: bytes) -> None:
    """The parser's contract for one buffer."""
    try:
        end = head_length(raw)
    except BadRequest as exc:
        assert exc.status == 431 and exc.reason == "too_large"
        return
    if end < 0:
        assert b"\n\n" not in raw and b"\r\n\r\n" not in raw and len(raw) <= MAX_HEAD_BYTES
        return
    assert 0 <= end <= MAX_HEAD_BYTES
    try:
        env = parse_head(raw[:end], "127.0.0.1")
    except BadRequest as exc:
        assert exc.status in (400, 431) and exc.reason in BAD_REQUEST_REASONS
        return
    check_environ(env)


@FUZZ
@given(heads)
def test_any_bytes_give_a_head_or_a_bad_request(raw: bytes) -> None:
    check_head(raw)


tokens = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":"))


@FUZZ
@given(
    st.sampled_from(["GET", "HEAD"]),
    st.lists(st.text("abcdefz0123456789-_.~", min_size=1, max_size=8), max_size=4),
    st.text("abc=&%20", max_size=16),
    st.dictionaries(tokens.filter(bool), st.text("abc xyz,;=/", max_size=20), max_size=6),
)
def test_a_well_formed_head_parses_back_to_what_was_sent(
    method: str, segments: list[str], query: str, headers: dict[str, str]
) -> None:
    path = "/" + "/".join(segments)
    lines = [f"{method} {path}{'?' + query if query else ''} HTTP/1.1"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    end = head_length(raw)
    env = parse_head(raw[:end], "127.0.0.1")
    check_environ(env)
    assert (env["REQUEST_METHOD"], env["PATH_INFO"], env["QUERY_STRING"]) == (method, path, query)
    merged: dict[str, list[str]] = {}
    for name, value in headers.items():
        merged.setdefault("HTTP_" + name.upper().replace("-", "_"), []).append(value.strip())
    for key, values in merged.items():
        assert env[key] == ",".join(values)


def test_every_corpus_head_is_a_head_or_a_bad_request() -> None:
    assert len(SEEDS) >= 15
    for raw in SEEDS:
        check_head(raw)


@pytest.fixture(scope="module")
def server() -> Iterator[WebServer]:
    httpd, _ = serve(make_app(CollectorRegistry(), {}), "127.0.0.1", 0)
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@settings(FUZZ, max_examples=60)
@given(heads)
def test_the_server_answers_any_head_with_a_status_line_or_a_close(
    server: WebServer, raw: bytes
) -> None:
    with socket.create_connection(server.server_address[:2], timeout=10) as s:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)  # the head ends here, whatever it holds
            reply = b"".join(iter(lambda: s.recv(65536), b""))
        except ConnectionResetError:
            reply = b""
    status = reply[:13]
    assert reply == b"" or (status[:9] == b"HTTP/1.1 " and status[9:12].isdigit()), reply[:80]
    assert not reply or int(status[9:12]) in (200, 400, 404, 405, 408, 431), reply[:80]
