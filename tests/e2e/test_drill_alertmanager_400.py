"""Drill: an "Alertmanager" that answers every POST with 400 must not look healthy.

A real HTTP server on loopback answers 400 to every alert POST, the way a
misconfigured proxy or an Alertmanager that refuses a label does. The daemon
must count the rejections apart from transport failures, show the last one on
/status, and export the counter the shipped GpuwatchdAlertsRejected rule reads.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.faults import Drill


class Rejecting(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b"bad request: invalid label set"
        self.send_response(400)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def rejecting_am() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Rejecting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_rejected_deliveries_are_counted_and_shown(tmp_path: Path, rejecting_am: str) -> None:
    drill = Drill(tmp_path, rejecting_am, node="drill-am-400")
    drill.start()
    try:
        drill.feed(79, 0)

        def alertmanagers() -> list[dict[str, Any]]:
            return list(json.loads(drill.get("/status")[1])["alerts"]["alertmanagers"])

        drill.wait_for(
            lambda: alertmanagers()[0].get("rejected_deliveries", 0) >= 1, 15, "a rejection"
        )
        [am] = alertmanagers()
        assert "HTTP 400" in str(am["last_rejection"]) and "invalid label" in str(
            am["last_rejection"]
        )
        assert am["last_rejection_at"]
        url = rejecting_am.rstrip("/")
        rejected = "gpuwatchd_alertmanager_deliveries_rejected_total"
        drill.wait_for(lambda: drill.metric(rejected, alertmanager=url) >= 1, 5, rejected)
        assert drill.metric("gpuwatchd_alertmanager_dropped_alerts_total", reason="rejected") >= 1
    finally:
        drill.stop()
