"""Shared fixtures: repo paths, free ports, a real daemon subprocess, GPU skip."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

# Every daemon the tests start, in process or as a subprocess, raises on a sample
# its exposition would drop (production counts it in
# gpuwatchd_exporter_dropped_samples_total instead).
os.environ["GPUWATCHD_STRICT_EXPORT"] = "1"
# A shell that followed the quick start has it set; the tests choose their own store.
os.environ.pop("GPUWATCHD_STATE_DIR", None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite tests/fixtures/e2e-output.txt"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not nvml_works():
        skip = pytest.mark.skip(reason="needs real NVML and an NVIDIA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


class NotifySocket:
    """A real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[str] = []

    def wait_for(self, text: str, timeout: float = 30.0, after: int = 0) -> list[str]:
        """Collect messages until one from index `after` on contains `text`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(text in m for m in self.messages[after:]):
                return self.messages
            self.sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                break
            self.messages.append(data.decode())
        raise AssertionError(f"no {text!r} from daemon; got {self.messages}")

    def drain(self) -> None:
        """Read whatever is queued without waiting."""
        self.sock.setblocking(False)
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                break

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self.drain()
            self.sock.close()


class DaemonProcess:
    """`python -m gpuwatchd run` as a real subprocess on a loopback port."""

    def __init__(self, tmp: Path, config_text: str, args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.config = tmp / "config.yaml"
        self.config.write_text(config_text)
        self.notify = NotifySocket(tmp / "notify.sock")
        self.log = open(tmp / "daemon.log", "w+")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "NOTIFY_SOCKET": self.notify.path, "PYTHONUNBUFFERED": "1"}
        full_env.pop("JOURNAL_STREAM", None)
        full_env.update(env)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuwatchd",
                "run",
                "--config",
                str(self.config),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--state-dir",
                str(tmp / "state"),
                *args,
            ],
            cwd=ROOT,
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, bytes]:
        return http_get(self.url + path)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.log.closed:
            return self.proc.returncode
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.notify.close()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[object]:
    started: list[DaemonProcess] = []

    def start(
        config_text: str = "", *args: str, env: dict[str, str] | None = None, ready: bool = True
    ) -> DaemonProcess:
        d = DaemonProcess(tmp_path, config_text, list(args), env or {})
        started.append(d)
        if ready:
            try:
                d.notify.wait_for("READY=1", timeout=60)
            except AssertionError:
                raise AssertionError(f"daemon not ready; output:\n{d.output()}") from None
        return d

    yield start
    for d in started:
        d.stop()
