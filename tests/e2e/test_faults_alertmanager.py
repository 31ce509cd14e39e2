"""Fault drill, Alertmanager: down, answering 500, hanging. Then it recovers and gets
every alert exactly once; meanwhile the daemon keeps answering and storing."""

from __future__ import annotations

import http.server
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.faults import Drill, Probe, assert_responsive
from tests.servers import AlertmanagerServer

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class FaultyProxy(http.server.ThreadingHTTPServer):
    """Loopback front of the real Alertmanager that can refuse, fail (500) or hang."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = upstream
        self.mode = "pass"
        self.release = threading.Event()
        self.posts = 0
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def heal(self) -> None:
        self.mode = "pass"
        self.release.set()

    def close(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FaultyProxy

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        srv = self.server
        srv.posts += 1
        if srv.mode == "down":
            self.close_connection = True
            self.connection.close()  # no answer at all, as from a dead peer
            return
        if srv.mode == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"internal error (drill)")
            return
        if srv.mode == "hang":
            srv.release.wait(60)
        req = urllib.request.Request(
            srv.upstream + self.path,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with _OPENER.open(req, timeout=10) as resp:
                status, data = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, data = exc.code, exc.read()
        self.send_response(status)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("fault", ["down", "500", "hang"])
def test_alertmanager_fault_then_recovery(
    tmp_path: Path, alertmanager: AlertmanagerServer, fault: str
) -> None:
    proxy = FaultyProxy(alertmanager.url)
    proxy.mode = fault
    drill = Drill(tmp_path, proxy.url, node=f"drill-am-{fault}")
    drill.start()
    try:
        probe = Probe(drill.daemon.url)
        for code, gpu in ((79, 0), (48, 1), (95, 0)):
            drill.feed(code, gpu)
        drill.wait_for(lambda: drill.stored() == drill.expected_store(), why="stored")
        drill.wait_for(lambda: proxy.posts >= 1, why="a POST attempt")
        assert drill.in_alertmanager(alertmanager) == {}
        drill.wait_for(
            lambda: drill.metric("gpuwatchd_alertmanager_queue_length") >= 3, why="queued"
        )
        proxy.heal()
        drill.assert_nothing_lost(alertmanager, timeout=30)
        assert drill.metric("gpuwatchd_alertmanager_dropped_alerts_total") == 0
        assert_responsive(f"Alertmanager {fault}", probe.stop())
    finally:
        drill.stop()
        proxy.close()
