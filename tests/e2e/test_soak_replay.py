"""A short soak on the replay: the daemon on a recorded 2-GPU capture while the kernel
log grows, scraped and polled the whole time. It must stay alive, answer every scrape,
keep its memory flat, lose no thread and stop cleanly.

GPUWATCHD_SOAK_SECONDS sets the length (CI: 20 s; a longer run is the same test).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.faults import BUS, Drill, Probe, record_figure
from tests.servers import AlertmanagerServer

SOAK_SECONDS = float(os.environ.get("GPUWATCHD_SOAK_SECONDS", "20"))
WARMUP_SECONDS = 4.0  # imports, first polls and caches settle before RSS is the baseline
RSS_GROWTH_LIMIT = 12 * 1024 * 1024  # bytes, from after the warm-up to the end
CODES = (13, 31, 43, 79, 94, 48)  # warnings and criticals of the shipped catalog
NOISE = "kernel: eth0: link up, 100Gbps, full duplex\n"


def rss(pid: int) -> int:
    """Resident set size of a process, in bytes (/proc/PID/status VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Writer:
    """Appends kernel log lines (Xids on both GPUs among noise) about 20 a second."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(0.05):
            with open(self.path, "a") as f:
                if n % 10 == 0:
                    code, gpu = CODES[(n // 10) % len(CODES)], (n // 10) % 2
                    f.write(f"NVRM: Xid (PCI:{BUS[gpu]}): {code}, pid={1000 + n}, soak\n")
                else:
                    f.write(NOISE)
            n += 1
            self.lines = n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.slow
@pytest.mark.timeout(SOAK_SECONDS + 90)
def test_replay_soak(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    drill = Drill(tmp_path, alertmanager.url, node="drill-soak")
    d = drill.start()
    probe = Probe(d.url, every=0.1)
    writer = Writer(drill.kernel_log)
    polls = {"status": 0, "events": 0}
    try:
        time.sleep(WARMUP_SECONDS)
        baseline = rss(d.proc.pid)
        end = time.monotonic() + SOAK_SECONDS
        while time.monotonic() < end:
            code, body = d.get("/status")
            assert code == 200, body[:200]
            json.loads(body)
            polls["status"] += 1
            code, body = d.get("/events?limit=100")
            assert code == 200, body[:200]
            polls["events"] += 1
            assert d.proc.poll() is None, d.output()[-4000:]
            time.sleep(0.5)
        grown = rss(d.proc.pid) - baseline
        writer.stop()
        figures = probe.stop()
        assert d.get("/healthz")[0] == 200
        stored = json.loads(d.get("/events?kind=xid&limit=1000")[1])["events"]
        assert stored, "no Xid stored during the soak"
        errors = drill.metric("gpuwatchd_consumer_errors_total")
    finally:
        writer.stop()
        probe.stop()
        rc = drill.stop()
    out = (tmp_path / "daemon.log").read_text()
    record_figure(
        "replay soak",
        {**figures, "seconds": SOAK_SECONDS, "rss_growth_mib": grown / 2**20},
        lost=len(probe.failures),
    )
    assert rc == 0, out[-4000:]
    assert probe.failures == [], probe.failures[:5]
    assert figures["n"] > SOAK_SECONDS  # scraped all along, about 10 a second
    assert grown < RSS_GROWTH_LIMIT, f"RSS grew {grown / 2**20:.1f} MiB in {SOAK_SECONDS:.0f}s"
    assert errors == 0
    assert "died of an uncaught exception" not in out
    assert "Traceback" not in out, out[-4000:]
    assert not (drill.state_dir / "gpuwatchd.run").exists()  # stopped cleanly
    assert (drill.state_dir / "gpuwatchd-fault.log").read_text() == ""
