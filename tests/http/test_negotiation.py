"""/metrics content negotiation on a real loopback server: gzip, OpenMetrics, HEAD, caching."""

from __future__ import annotations

import gzip
import re
import socket
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from gpuwatchd.http.app import make_app
from gpuwatchd.http.server import WebServer, serve
from gpuwatchd.model import MetricSpec, Sample, SourceSnapshot
from gpuwatchd.sinks.prometheus import SnapshotCollector
from gpuwatchd.state import State

SPECS = (
    MetricSpec("gpuwatchd_gpu_power_watts", "gauge", "Power draw.", ("gpu",)),
    MetricSpec("gpuwatchd_gpu_energy_joules_total", "counter", "Energy.", ("gpu",)),
)
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
# What Prometheus 2.x sends on every scrape.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


class Counting(SnapshotCollector):
    """Counts renders of the registry."""

    renders = 0

    def collect(self):  # type: ignore[no-untyped-def]
        Counting.renders += 1
        return super().collect()


def publish(state: State, gpus: int, value: float = 1.0) -> None:
    samples = [Sample.of("gpuwatchd_gpu_power_watts", value + i, gpu=i) for i in range(gpus)]
    samples += [Sample.of("gpuwatchd_gpu_energy_joules_total", 1e6 * i, gpu=i) for i in range(gpus)]
    state.publish(SourceSnapshot("nvml", tuple(samples), True, "", 1.0, 0.002, 1.0, {}))


@pytest.fixture
def served() -> Iterator[tuple[WebServer, State]]:
    state = State()
    publish(state, 64)  # big enough that gzip matters
    registry = CollectorRegistry()
    registry.register(Counting(state, SPECS, strict=True))
    Counting.renders = 0
    httpd, _ = serve(make_app(registry, {}, lambda: state.snapshot().generation), "127.0.0.1", 0)
    yield httpd, state
    httpd.shutdown()
    httpd.server_close()


def scrape(
    httpd: WebServer, method: str = "GET", path: str = "/metrics", **headers: str
) -> tuple[str, dict[str, str], bytes]:
    lines = [f"{method} {path} HTTP/1.1", "Host: x"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    with socket.create_connection(httpd.server_address[:2], timeout=10) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        reply = b"".join(iter(lambda: s.recv(65536), b""))
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *rest = head.decode("latin-1").split("\r\n")
    fields = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in rest)}
    return status, fields, body


def gunzip_one_member(body: bytes) -> bytes:
    """The body of a single-member gzip stream (some clients read only the first)."""
    d = zlib.decompressobj(wbits=31)
    out = d.decompress(body)
    assert d.eof and d.unused_data == b"", "not exactly one gzip member"
    return out


def test_gzip_when_accepted_identical_after_gunzip(served: Any) -> None:
    httpd, _ = served
    _, plain_headers, plain = scrape(httpd)
    status, headers, body = scrape(httpd, Accept_Encoding="gzip, deflate")
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-encoding"] == "gzip"
    assert "Accept-Encoding" in [v.strip() for v in headers["vary"].split(",")]
    assert "content-encoding" not in plain_headers and "Accept-Encoding" in plain_headers["vary"]
    assert headers["content-type"] == plain_headers["content-type"]
    assert int(headers["content-length"]) == len(body) < len(plain) / 4
    assert gunzip_one_member(body) == plain == gzip.decompress(body)
    assert re.search(rb'gpuwatchd_http_bad_requests_total\{reason="too_large"\} \S+\n\Z', plain)


def test_openmetrics_when_asked_for(served: Any) -> None:
    httpd, _ = served
    status, headers, body = scrape(httpd, Accept=OPENMETRICS)
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"].startswith("application/openmetrics-text; version=1.0.0;")
    text = body.decode()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    assert "# TYPE gpuwatchd_gpu_energy_joules counter" in text
    # prometheus_client's own OpenMetrics parser is strict: it raises on a malformed exposition.
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert len(families["gpuwatchd_gpu_power_watts"].samples) == 64
    assert "gpuwatchd_http_bad_requests" in families  # the fresh tail is inside the EOF
    _, gz_headers, gz = scrape(httpd, Accept=PROMETHEUS_ACCEPT, Accept_Encoding="gzip")
    assert gz_headers["content-type"] == headers["content-type"]
    assert gunzip_one_member(gz) == body


def test_head_content_length_per_encoding(served: Any) -> None:
    httpd, _ = served
    for headers in ({}, {"Accept_Encoding": "gzip"}, {"Accept": OPENMETRICS}):
        _, got, body = scrape(httpd, **headers)
        _, head, nothing = scrape(httpd, "HEAD", **headers)
        assert nothing == b""
        assert int(head["content-length"]) == len(body), headers
        assert head.get("content-encoding") == got.get("content-encoding")
        assert head["content-type"] == got["content-type"]


def test_an_accept_version_prometheus_client_cannot_compare_gets_text(served: Any) -> None:
    # choose_encoder raises TypeError on "1.0.x"; the scrape still gets the text format.
    httpd, _ = served
    status, headers, body = scrape(
        httpd, Accept="application/openmetrics-text; version=1.0.x", Accept_Encoding="gzip"
    )
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b"gpuwatchd_gpu_power_watts" in gunzip_one_member(body)


def test_rendered_once_per_snapshot_and_format(served: Any) -> None:
    httpd, state = served
    scrape(httpd)
    scrape(httpd, Accept_Encoding="gzip")
    scrape(httpd, "HEAD")
    assert Counting.renders == 1
    scrape(httpd, Accept=OPENMETRICS)
    scrape(httpd, Accept=OPENMETRICS, Accept_Encoding="gzip")
    assert Counting.renders == 2
    # Junk between scrapes moves the HTTP counters in every format without a render.
    assert scrape(httpd, "POST")[0].startswith("HTTP/1.1 405")
    gz = gunzip_one_member(scrape(httpd, Accept_Encoding="gzip")[2])
    assert b'gpuwatchd_http_bad_requests_total{reason="method"}' in gz
    om = scrape(httpd, Accept=OPENMETRICS, Accept_Encoding="gzip")[2]
    assert gunzip_one_member(om).endswith(b"# EOF\n")
    assert Counting.renders == 2
    publish(state, 64, value=7.0)
    assert b'gpuwatchd_gpu_power_watts{gpu="0"} 7.0' in gunzip_one_member(
        scrape(httpd, Accept_Encoding="gzip")[2]
    )
    assert Counting.renders == 3
