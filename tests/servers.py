"""Real servers for tests, on 127.0.0.1 only: Alertmanager and Prometheus.

`AlertmanagerServer` runs the Debian/upstream `alertmanager` binary with
gossip off, its storage in a temporary directory and a minimal config. It
can be stopped and started again on the same port, which the outage tests
need. `alertmanager_server(tmp_path_factory)` is a generator a conftest
can wrap into a session fixture:

    @pytest.fixture(scope="session")
    def alertmanager(tmp_path_factory):
        yield from alertmanager_server(tmp_path_factory)
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = [
    "AlertmanagerServer",
    "LoopbackServer",
    "PrometheusServer",
    "alertmanager_binary",
    "alertmanager_server",
    "free_port",
]

MINIMAL_CONFIG = """\
route:
  receiver: default
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: default
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alertmanager_binary() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


class LoopbackServer:
    """A server binary run on 127.0.0.1 with its files in `workdir`."""

    name = "server"

    def __init__(self, workdir: Path, binary: str, scheme: str = "http") -> None:
        self.binary = binary
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = workdir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _launch(self, args: list[str], ready: Callable[[], bool], timeout: float) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not become ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def _get(self, path: str) -> tuple[int, bytes]:
        try:
            with self._opener.open(self.url + path, timeout=10) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), bytes(exc.read())


class AlertmanagerServer(LoopbackServer):
    """One Alertmanager process; `url` stays the same across stop()/start()."""

    name = "alertmanager"

    def __init__(self, workdir: Path, web_config: str = "", scheme: str = "http") -> None:
        binary = alertmanager_binary()
        if binary is None:
            pytest.skip("alertmanager not installed (Debian package prometheus-alertmanager)")
        super().__init__(workdir, binary, scheme)
        self.config = workdir / "alertmanager.yml"
        self.config.write_text(MINIMAL_CONFIG)
        self.web_config = web_config

    def start(self, timeout: float = 20.0) -> None:
        args = [
            self.binary,
            f"--config.file={self.config}",
            f"--storage.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ]
        if self.web_config:
            args.append(f"--web.config.file={self.web_config}")

        def ready() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return bool(self.web_config) or self._get("/-/ready")[0] == 200

        self._launch(args, ready, timeout)

    def alerts(self, **match: str) -> list[dict[str, object]]:
        """Active alerts (API v2) whose labels equal every `match` pair."""
        query = urllib.parse.urlencode(
            [("filter", f'{k}="{v}"') for k, v in match.items()], doseq=True
        )
        status, body = self._get(f"/api/v2/alerts?{query}")
        assert status == 200, body
        return list(json.loads(body))

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` (from /metrics) whose labels include `labels`."""
        status, body = self._get("/metrics")
        assert status == 200
        total = 0.0
        for line in body.decode().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            if series.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
        return total


def alertmanager_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerServer]:
    """Start one Alertmanager for a whole session."""
    server = AlertmanagerServer(tmp_path_factory.mktemp("alertmanager"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class PrometheusServer(LoopbackServer):
    """One Prometheus process with a throwaway TSDB, scraping what `config` says.

    `config` is the prometheus.yml text; rule files it names are read as is.
    Use as a context manager or call start()/stop().
    """

    name = "prometheus"

    def __init__(self, workdir: Path, config: str) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip("prometheus not installed (Debian package prometheus)")
        super().__init__(workdir, binary)
        self.config = workdir / "prometheus.yml"
        self.config.write_text(config)

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        args = [
            self.binary,
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        self._launch(args, lambda: self._get("/-/ready")[0] == 200, timeout)
        return self

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> dict[str, object]:
        """GET /api/v1/<path>; returns the decoded body (status "success" or "error")."""
        status, body = self._get(f"/api/v1/{path}?{urllib.parse.urlencode(params)}")
        data = json.loads(body)
        assert isinstance(data, dict), body
        data.setdefault("http_status", status)
        return data

    def query(self, expr: str) -> dict[str, object]:
        """Instant query at the current time."""
        return self.api("query", query=expr)

    def wait_for(self, expr: str, timeout: float = 30.0) -> list[object]:
        """Poll `expr` until it returns at least one series; returns the result."""
        deadline = time.monotonic() + timeout
        while True:
            res = self.query(expr)
            data = res.get("data")
            result = data.get("result") if isinstance(data, dict) else None
            if res.get("status") == "success" and result:
                return list(result)
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr!r} returned nothing in {timeout}s: {res}")
            time.sleep(0.25)
