"""Fault drill, the daemon itself: an NVML call that hangs, a GPU lost, a SIGHUP storm then
SIGTERM, and a planted secret that must appear in no endpoint and no log line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT
from tests.e2e.faults import Drill, Probe, assert_responsive, record_figure
from tests.servers import AlertmanagerServer


def daemon_alerts(drill: Drill) -> set[str]:
    body = json.loads(drill.get("/alerts?state=firing")[1])
    return {a["labels"]["alertname"] for a in body["alerts"]}


def test_nvml_call_hangs(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    hang = [{"device": 1, "call": "*", "from_poll": 3, "hang": True}]
    drill = Drill(tmp_path, alertmanager.url, node="drill-nvml-hang", script=hang)
    drill.start()
    try:
        probe = Probe(drill.daemon.url)
        drill.wait_for(lambda: "NvmlUnresponsive" in daemon_alerts(drill), why="NvmlUnresponsive")
        drill.feed(79, 0)
        drill.feed(48, 1)
        drill.assert_nothing_lost(alertmanager)
        assert_responsive("NVML call hangs", probe.stop())
    finally:
        drill.stop()


def test_gpu_lost(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    lost = [{"device": 0, "call": "*", "from_poll": 3, "error": "GPU_IS_LOST"}]
    drill = Drill(tmp_path, alertmanager.url, node="drill-gpu-lost", script=lost)
    drill.start()
    try:
        probe = Probe(drill.daemon.url)
        drill.wait_for(lambda: "GpuLost" in daemon_alerts(drill), why="GpuLost")
        drill.feed(79, 0)
        drill.feed(95, 1)
        drill.assert_nothing_lost(alertmanager)
        assert_responsive("GPU lost", probe.stop())
    finally:
        drill.stop()


def test_sighup_storm_then_sigterm(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    drill = Drill(tmp_path, alertmanager.url, node="drill-sighup")
    d = drill.start()
    probe = Probe(d.url)
    drill.feed(79, 0)
    drill.wait_for(lambda: drill.stored() == drill.expected_store(), why="stored")
    for _ in range(50):
        # Spaced out: the kernel merges a signal sent while one is still pending, so
        # a burst would reach the daemon as one; these each reach its handler.
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.02)
    drill.feed(48, 1)
    start = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    stop_seconds = time.monotonic() - start
    figures = probe.stop()
    reloads = d.output().count("SIGHUP: reloading")
    drill.stop()
    # Pending reloads collapse into one, and a stop wins over any still pending.
    assert reloads < 25, reloads
    figures["stop_seconds"] = stop_seconds
    figures["reloads"] = reloads
    assert stop_seconds < 5, stop_seconds
    drill.start()
    try:
        drill.assert_nothing_lost(alertmanager)
    finally:
        drill.stop()
    assert_responsive("SIGHUP storm then SIGTERM", figures)


SECRET = "s3cr3t-drill-password-7f1c"


def test_a_planted_secret_leaks_nowhere(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    password = tmp_path / "am-password"
    password.write_text(SECRET + "\n")
    # Credentials in the URL are refused at config time, naming the keys to use instead.
    bad = tmp_path / "bad.yaml"
    host = alertmanager.url.split("//")[1]
    bad.write_text(f"alertmanager:\n  urls: [http://gpuwatchd:{SECRET}@{host}]\n")
    check = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "config", "check", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 78
    assert "basic_auth_password_file" in check.stderr and SECRET not in check.stderr
    drill = Drill(
        tmp_path,
        alertmanager.url,
        node="drill-secret",
        extra_config=f"  basic_auth_user: gpuwatchd\n  basic_auth_password_file: {password}\n",
    )
    drill.start()
    try:
        drill.feed(79, 0)
        drill.assert_nothing_lost(alertmanager)
        os.kill(drill.daemon.proc.pid, signal.SIGHUP)
        drill.daemon.notify.wait_for("READY=1", after=len(drill.daemon.notify.messages))
        for path in ("/metrics", "/status", "/alerts", "/events", "/healthz"):
            assert SECRET not in drill.get(path)[1].decode(errors="replace"), path
    finally:
        drill.stop()
    assert SECRET not in (tmp_path / "daemon.log").read_text()
    record_figure("planted secret", {"n": 5}, 0)
