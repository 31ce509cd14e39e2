"""The HTTP server on a real loopback socket: parsing, limits, slow and excess clients."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry as Registry
from prometheus_client.core import GaugeMetricFamily

from gpuwatchd.http import server as http_server
from gpuwatchd.http.app import make_app
from gpuwatchd.http.counters import BAD_REQUESTS
from gpuwatchd.http.server import WebServer, serve
from gpuwatchd.http.webconfig import WebConfig, WebConfigWatcher


class _Gauge:
    def collect(self) -> list[GaugeMetricFamily]:
        fam = GaugeMetricFamily("gpuwatchd_test_value", "A test gauge.", labels=("gpu",))
        fam.add_metric(("0",), 42)
        return [fam]


def _boom(query: Any) -> tuple[int, str, bytes]:
    raise RuntimeError("handler bug")


@pytest.fixture
def running() -> Iterator[Any]:
    started: list[WebServer] = []

    def start(routes: dict[str, Any] | None = None, collector: Any = None, **kw: Any) -> WebServer:
        reg = Registry()
        reg.register(collector or _Gauge())
        routes = {
            "/echo": lambda q: (200, "application/json", repr(sorted(q.items())).encode()),
            "/boom": _boom,
            **(routes or {}),
        }
        httpd, _ = serve(make_app(reg, routes), "127.0.0.1", 0, **kw)
        started.append(httpd)
        return httpd

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def _exchange(httpd: WebServer, raw: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(httpd.server_address[:2], timeout=timeout) as s:
        s.sendall(raw)
        return b"".join(iter(lambda: s.recv(65536), b""))


def _split(reply: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return status, headers, body


def test_get_metrics(running: Any) -> None:
    status, headers, body = _split(
        _exchange(running(), b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    )
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert int(headers["content-length"]) == len(body) and headers["connection"] == "close"
    assert b'gpuwatchd_test_value{gpu="0"} 42.0\n' in body


def test_head_has_no_body_and_bare_lf_requests_work(running: Any) -> None:
    httpd = running()
    status, headers, body = _split(_exchange(httpd, b"HEAD /metrics HTTP/1.0\n\n"))
    assert status == "HTTP/1.1 200 OK" and body == b""
    _, _, full = _split(_exchange(httpd, b"GET /metrics HTTP/1.0\n\n"))
    assert int(headers["content-length"]) == len(full) > 0  # what GET would send


def test_query_and_percent_encoded_path(running: Any) -> None:
    reply = _exchange(running(), b"GET /ec%68o?gpu=3&gpu=4&x=%2F HTTP/1.1\r\n\r\n")
    status, _, body = _split(reply)
    assert status.endswith("200 OK")
    assert body == b"[('gpu', ['3', '4']), ('x', ['/'])]"


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /metrics\r\n\r\n",
        b"GET /metrics HTTP/2.0\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n folded: header\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS to a plain port
    ],
)
def test_malformed_requests_get_400(running: Any, raw: bytes) -> None:
    status, _, _ = _split(_exchange(running(), raw))
    assert status == "HTTP/1.1 400 Bad Request"


def test_oversized_head_gets_431(running: Any) -> None:
    before = BAD_REQUESTS.count("too_large")
    raw = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (http_server.MAX_HEAD_BYTES + 10)
    status, _, _ = _split(_exchange(running(), raw + b"\r\n\r\n"))
    assert status.startswith("HTTP/1.1 431")
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(150))
    status, _, _ = _split(_exchange(running(), b"GET / HTTP/1.1\r\n" + many + b"\r\n"))
    assert status.startswith("HTTP/1.1 431")
    assert BAD_REQUESTS.count("too_large") == before + 2


def test_handler_exception_is_a_500_and_the_server_goes_on(running: Any) -> None:
    httpd = running()
    assert _split(_exchange(httpd, b"GET /boom HTTP/1.1\r\n\r\n"))[0].endswith(
        "500 Internal Server Error"
    )
    assert _split(_exchange(httpd, b"GET /metrics HTTP/1.1\r\n\r\n"))[0].endswith("200 OK")


def test_slow_client_times_out_without_blocking_others(
    running: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "IO_TIMEOUT", 2.0)
    httpd = running()
    slow = socket.create_connection(httpd.server_address[:2], timeout=10)
    try:
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")  # and then nothing: a slowloris
        assert _split(_exchange(httpd, b"GET /metrics HTTP/1.1\r\n\r\n"))[0].endswith("200 OK")
        slow.setblocking(False)
        with pytest.raises(BlockingIOError):  # served while the slow one still waits
            slow.recv(1)
        slow.setblocking(True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:  # a byte at a time does not extend the deadline
            try:
                slow.sendall(b"X")
            except OSError:
                break
            time.sleep(0.2)
        reply = b"".join(iter(lambda: slow.recv(65536), b""))
        assert _split(reply)[0] == "HTTP/1.1 408 Request Timeout"
    finally:
        slow.close()


def test_a_full_table_drops_the_oldest_slow_client_not_a_complete_request(running: Any) -> None:
    httpd = running(max_connections=1)
    held = socket.create_connection(httpd.server_address[:2], timeout=10)
    try:
        held.sendall(b"GET /metrics HTTP/1.1\r\n")  # takes the one place, head unfinished
        time.sleep(0.1)
        assert _split(_exchange(httpd, b"GET /metrics HTTP/1.1\r\n\r\n"))[0].endswith("200 OK")
        assert held.recv(1) == b""  # closed to make room
    finally:
        held.close()


def test_requests_beyond_a_route_queue_get_503_and_scrapes_go_on(running: Any) -> None:
    release = threading.Event()
    routes = {"/block": lambda q: _block(release)}
    httpd = running(route_workers=1, route_queued=1, routes=routes)
    addr = httpd.server_address[:2]
    busy = [socket.create_connection(addr, timeout=10) for _ in range(2)]
    try:
        for s in busy:  # one runs in the only route worker, one waits in its queue
            s.sendall(b"GET /block HTTP/1.1\r\n\r\n")
            time.sleep(0.1)
        status, headers, _ = _split(_exchange(httpd, b"GET /block HTTP/1.1\r\n\r\n"))
        assert status == "HTTP/1.1 503 Service Unavailable" and headers["retry-after"] == "1"
        # /metrics has workers of its own: the routes' full queue does not reach it.
        assert _split(_exchange(httpd, b"GET /metrics HTTP/1.1\r\n\r\n"))[0].endswith("200 OK")
    finally:
        release.set()
    for s in busy:
        with s:
            assert _split(b"".join(iter(lambda s=s: s.recv(65536), b"")))[0].endswith("200 OK")


def test_scrapes_beyond_the_scrape_queue_get_503(running: Any) -> None:
    release = threading.Event()

    class Blocking:  # a collector that holds the scrape workers until released
        def collect(self) -> Any:
            release.wait(10)
            return iter(())

    httpd = running(workers=1, max_queued=1, collector=Blocking())
    addr = httpd.server_address[:2]
    busy = [socket.create_connection(addr, timeout=10) for _ in range(2)]
    try:
        for s in busy:
            s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            time.sleep(0.1)
        status, headers, _ = _split(_exchange(httpd, b"GET /metrics HTTP/1.1\r\n\r\n"))
        assert status == "HTTP/1.1 503 Service Unavailable" and headers["retry-after"] == "1"
    finally:
        release.set()
    for s in busy:
        with s:
            assert _split(b"".join(iter(lambda s=s: s.recv(65536), b"")))[0].endswith("200 OK")


def test_a_table_full_of_requests_in_the_app_answers_503(running: Any) -> None:
    release = threading.Event()
    httpd = running(max_connections=1, routes={"/block": lambda q: _block(release)})
    with socket.create_connection(httpd.server_address[:2], timeout=10) as first:
        first.sendall(b"GET /block HTTP/1.1\r\n\r\n")
        time.sleep(0.1)
        try:
            status, headers, _ = _split(_exchange(httpd, b"GET /metrics HTTP/1.1\r\n\r\n"))
            assert status == "HTTP/1.1 503 Service Unavailable" and headers["retry-after"] == "1"
        finally:
            release.set()
        assert _split(b"".join(iter(lambda: first.recv(65536), b"")))[0].endswith("200 OK")


def _block(release: threading.Event) -> tuple[int, str, bytes]:
    release.wait(10)
    return 200, "text/plain", b"done\n"


def test_a_client_trickling_after_the_response_is_closed_within_the_linger(
    running: Any,
) -> None:
    httpd = running()
    with socket.create_connection(httpd.server_address[:2], timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        t0 = time.monotonic()
        with pytest.raises(OSError):  # reset once the server has closed
            while time.monotonic() - t0 < 4.0:
                s.sendall(b"X")  # a byte every 0.2 s after the response: not a reason to stay
                time.sleep(0.2)
        assert time.monotonic() - t0 < http_server._LINGER_SECONDS + 1.0


def test_oversized_heads_over_tls_get_their_431(tmp_path: Any) -> None:
    import ssl

    import trustme

    from gpuwatchd.http import webconfig

    ca = trustme.CA()
    pem, ca_pem = tmp_path / "server.pem", tmp_path / "ca.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(pem)
    ca.cert_pem.write_to_path(ca_pem)
    (tmp_path / "web.yml").write_text(
        f"tls_server_config:\n  cert_file: {pem}\n  key_file: {pem}\n"
    )
    web = webconfig.load(str(tmp_path / "web.yml"))
    httpd, _ = serve(make_app(Registry(), {}), "127.0.0.1", 0, web)
    ctx = ssl.create_default_context(cafile=str(ca_pem))
    raw = b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * (4 * http_server.MAX_HEAD_BYTES) + b"\r\n\r\n"
    try:
        for _ in range(10):  # the answer must survive the unread rest of the head
            plain = socket.create_connection(httpd.server_address[:2], timeout=10)
            with ctx.wrap_socket(plain, server_hostname="127.0.0.1") as s:
                try:
                    s.sendall(raw)
                except OSError:
                    pass  # the server stopped reading; its answer is still there
                reply = b"".join(iter(lambda s=s: s.recv(65536), b""))
            assert reply.startswith(b"HTTP/1.1 431 "), reply[:80]
    finally:
        httpd.shutdown()
        httpd.server_close()


def _ctx_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return sum(int(ln.split()[1]) for ln in f if "ctxt_switches" in ln)


def test_idle_server_sleeps_and_shuts_down_promptly() -> None:
    reg = Registry()
    httpd, thread = serve(make_app(reg, {}), "127.0.0.1", 0)
    try:
        time.sleep(0.05)
        tid = thread.native_id
        assert tid is not None
        before = _ctx_switches(tid)
        time.sleep(1.0)
        assert _ctx_switches(tid) - before <= 1  # no polling loop: it sleeps in poll(2)
    finally:
        httpd.shutdown()
        httpd.server_close()
    thread.join(5.0)
    assert not thread.is_alive()


def test_shutdown_before_serving_returns() -> None:
    httpd = WebServer(make_app(Registry(), {}), "127.0.0.1", 0, WebConfigWatcher(WebConfig()))
    done = threading.Event()

    def stop() -> None:
        httpd.shutdown()
        done.set()

    threading.Thread(target=stop, daemon=True).start()
    assert done.wait(5)
    httpd.server_close()
    late = threading.Thread(target=httpd.serve_forever, daemon=True)
    late.start()  # a serving thread that starts after the close touches no closed fd
    late.join(5)
    assert not late.is_alive()


def test_request_body_is_drained_so_the_response_arrives(running: Any) -> None:
    httpd = running()
    body = b"x" * 5000  # a body nobody reads: closing over it would reset the connection
    raw = b"GET /metrics HTTP/1.1\r\nContent-Length: 5000\r\n\r\n"
    with socket.create_connection(httpd.server_address[:2], timeout=10) as s:
        s.sendall(raw + body)  # the server answers from the head alone
        time.sleep(0.2)  # let the answer and the close happen before reading
        reply = b"".join(iter(lambda: s.recv(65536), b""))
    assert _split(reply)[0] == "HTTP/1.1 200 OK"


_FD_LIMIT = """
import logging, resource
from gpuwatchd.http.app import make_app
from gpuwatchd.http.server import serve
from prometheus_client import CollectorRegistry as Registry
logging.basicConfig(level=logging.WARNING, format="%(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))
httpd, _ = serve(make_app(Registry(), {}), "127.0.0.1", 0)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], httpd.max_connections, flush=True)
"""


def test_the_open_files_limit_is_raised_and_bounds_the_table() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _FD_LIMIT], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["512", str(512 - http_server.FD_RESERVE)], out.stderr
    assert "open-files limit is 512" in out.stderr


_FD_EXHAUSTION = """
import os, resource, sys
from gpuwatchd.http.app import make_app
from gpuwatchd.http.counters import BAD_REQUESTS
from gpuwatchd.http.server import serve
from prometheus_client import CollectorRegistry as Registry
httpd, _ = serve(make_app(Registry(), {}), "127.0.0.1", 0)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
fillers = []
try:
    while True:
        fillers.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print(httpd.server_address[1], flush=True)
sys.stdin.readline()  # the test has connected: now give descriptors back
for fd in fillers:
    os.close(fd)
sys.stdin.readline()
"""


def test_descriptor_exhaustion_does_not_stop_the_server() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with subprocess.Popen(
        [sys.executable, "-c", _FD_EXHAUSTION],
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        try:
            port = int(proc.stdout.readline())
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # in the backlog: accept fails
                time.sleep(0.3)
                proc.stdin.write("\n")
                proc.stdin.flush()
                reply = b"".join(iter(lambda: s.recv(65536), b""))
        finally:
            proc.kill()
            _, err = proc.communicate(timeout=5)
    assert _split(reply)[0] == "HTTP/1.1 200 OK"
    assert "accept failed" in err
