"""What keeps the idle daemon small and quiet: a kernel log reader that blocks until a
record comes or the runner stops it, the exposition on the daemon's own server, the
hang catalog and the diag floors parsed at first use, the shipped data read without
`zipfile`."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.readers import KmsgReader, Line
from gpuwatchd.sources.kmsg.source import BLOCKING_WAIT, KmsgSource
from tests.sources.kmsg_files import kmsg_config, raw

ROOT = Path(__file__).resolve().parent.parent
BOOT = "6b1c1a36-8d7a-4b1e-9a55-0c2f7a1d0001"


@pytest.fixture
def seqpacket() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A socket pair that, like /dev/kmsg, hands out one record per read."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    yield a, b
    b.close()


def _in_thread(fn: object) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)  # type: ignore[operator]
    t.start()
    return t, out


def test_interrupt_ends_a_long_read_and_records_still_wake_it(
    seqpacket: tuple[socket.socket, socket.socket],
) -> None:
    ours, kernel = seqpacket
    reader = KmsgReader("/dev/kmsg", BOOT, fd=ours.detach())
    t0 = time.monotonic()
    t, out = _in_thread(lambda: reader.read(30.0))
    time.sleep(0.05)
    reader.interrupt()
    t.join(5.0)
    assert not t.is_alive() and out == [[]]
    assert time.monotonic() - t0 < 5.0
    kernel.send(raw(1, "usb 1-1: new device").encode())
    t, out = _in_thread(lambda: reader.read(30.0))
    t.join(5.0)
    assert not t.is_alive() and len(out[0]) == 1  # type: ignore[arg-type]
    reader.close()


def test_source_waits_long_on_a_blocking_reader_until_interrupted(
    tmp_path: Path, seqpacket: tuple[socket.socket, socket.socket]
) -> None:
    ours, kernel = seqpacket
    reader = KmsgReader("/dev/kmsg", BOOT, fd=ours.detach())
    waits: list[float] = []
    real_read = reader.read

    def read(timeout: float) -> list[Line]:
        waits.append(timeout)
        return real_read(timeout)

    reader.read = read  # type: ignore[method-assign]
    cfg = kmsg_config(tmp_path, tmp_path / "kmsg")
    src = KmsgSource(cfg, SourceContext(clock=FakeClock()), opener=lambda cur: reader)
    src.poll(0.0)  # the first read never waits: start-up waits for it
    t, _ = _in_thread(lambda: src.poll(0.0))
    time.sleep(0.05)
    src.interrupt()
    t.join(5.0)
    assert not t.is_alive()
    assert waits == [0.0, BLOCKING_WAIT]
    src.close()


def _python(code: str, *args: str) -> str:
    """What a fresh interpreter running `code` prints; it must exit 0."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=90
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


# The daemon, serving a scrape with the default sources on a replayed GPU, renders it
# through prometheus_client on its own server: no stdlib or prometheus_client server
# (their thread per connection is what the event loop replaced) is ever built.
_OWN_SERVER = """
import gc, os, signal, socket, sys, threading, time
from gpuwatchd.daemon import Daemon, Overrides
overrides = Overrides(listen="127.0.0.1:0", nvml_replay=sys.argv[1], state_dir=sys.argv[2])
daemon = Daemon(None, overrides)
verdict = []

def probe():
    deadline = time.monotonic() + 30
    # the HTTP socket is up before the sources start: wait for NVML's first poll too
    while (daemon.httpd is None or not daemon.pipeline or not daemon.pipeline.wait_idle(0.1)
           or "nvml" not in daemon.state.snapshot().sources):
        if time.monotonic() > deadline:
            verdict.append("daemon did not start")
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.05)
    with socket.create_connection(daemon.httpd.server_address[:2], timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
        reply = b"".join(iter(lambda: s.recv(65536), b""))
    import socketserver
    servers = [o for o in gc.get_objects() if isinstance(o, socketserver.BaseServer)]
    verdict.append(str("prometheus_client.exposition" in sys.modules))
    verdict.append(str(len(servers)))
    verdict.append(str(b"gpuwatchd_gpu_temperature_celsius" in reply))
    # no config file, no diag judged: no YAML parser; shipped data without zipfile; the
    # slowdown detector's medians without statistics (its fractions and decimal: 0.57 MiB)
    unwanted = ("yaml", "zipfile", "statistics", "decimal")
    verdict.append(",".join(m for m in unwanted if m in sys.modules) or "-")
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=probe, daemon=True).start()
rc = daemon.run()
print(rc, *verdict)
"""


def test_daemon_renders_through_prometheus_client_on_its_own_server(tmp_path: Path) -> None:
    capture = ROOT / "tests" / "fixtures" / "nvml" / "h100-idle-record.json"
    verdict = _python(_OWN_SERVER, str(capture), str(tmp_path)).split()
    assert verdict == ["0", "True", "0", "True", "-"]


_NO_YAML = """
import sys
from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.hangs.monitor import HangMonitor
monitor = HangMonitor(Config(), FakeClock())
assert "yaml" not in sys.modules, "the hang monitor parsed its catalog at start"
assert monitor.catalog and "yaml" in sys.modules
print("ok")
"""


def test_hang_signatures_are_parsed_at_first_use_without_a_site_file() -> None:
    assert _python(_NO_YAML) == "ok"


# `check` is one-shot: its start-up is its latency (0.37 s on an H200 before the hang
# split and the slowdown detector, 0.52 s after, most of it imports). It runs the
# consumer chain, not the daemon's sinks, HTTP, hang machinery or detector catalogs.
_CHECK_IMPORTS = """
import sys
from gpuwatchd.cli import main
try:
    code = main(["check", "--nvml-replay", sys.argv[1], "--state-dir", sys.argv[2]])
except SystemExit as exc:
    code = exc.code
daemon_only = (
    "prometheus_client", "gpuwatchd.http.app", "gpuwatchd.pipeline.daemon",
    "gpuwatchd.sinks.alertmanager.sink", "gpuwatchd.sinks.remediation.sink",
    "gpuwatchd.sinks.evidence", "gpuwatchd.hangs.monitor", "gpuwatchd.forensics",
    "gpuwatchd.health.hangs.detector", "gpuwatchd.health.slowdowns.monitor",
)
print(code, ",".join(m for m in daemon_only if m in sys.modules) or "-")
"""


def test_check_loads_the_consumer_chain_and_none_of_the_daemons_parts(tmp_path: Path) -> None:
    capture = ROOT / "tests" / "fixtures" / "nvml" / "h100-idle-record.json"
    assert _python(_CHECK_IMPORTS, str(capture), str(tmp_path)).split()[-2:] == ["0", "-"]
