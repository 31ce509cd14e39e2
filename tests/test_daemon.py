"""The real daemon as a subprocess: readiness, signals, exit codes, notify sequence."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.conftest import ROOT, http_get, nvml_works

QUIET = "sources:\n  kmsg:\n    enabled: false\n  udev:\n    enabled: false\n"


def test_starts_without_gpu_and_serves_other_collectors(start_daemon) -> None:
    d = start_daemon(QUIET)
    status, body = d.get("/metrics")
    assert status == 200
    text = body.decode()
    assert "gpuwatchd_build_info{" in text
    if not nvml_works():
        assert 'gpuwatchd_collector_success{collector="nvml"} 0.0' in text
        assert "NVML" in d.output()
    status, _ = d.get("/healthz")
    assert status == 200
    status, body = d.get("/status")
    assert status == 200 and b'"sources"' in body
    assert d.stop() == 0
    assert d.notify.messages[-1] == "STOPPING=1"


def test_sighup_reloads_and_bad_reload_keeps_old_config(start_daemon) -> None:
    d = start_daemon(QUIET)
    d.proc.send_signal(signal.SIGHUP)
    n = len(d.notify.messages)
    d.notify.wait_for("RELOADING=1", after=n)
    d.notify.wait_for("READY=1", after=n)

    d.config.write_text("sources:\n  nvml:\n    interval: -1\n")
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reload rejected" not in d.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    out = d.output()
    assert "reload rejected" in out
    assert "sources.nvml.interval: must be >= 0.1" in out
    assert d.get("/metrics")[0] == 200  # still serving on the old config
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    d.notify.drain()
    seq = [m.split("\n")[0] for m in d.notify.messages if not m.startswith("STATUS=")]
    assert seq[0] == "READY=1" and seq[-1] == "STOPPING=1"
    assert seq.count("RELOADING=1") == 2


def test_sigint_exits_130(start_daemon) -> None:
    d = start_daemon(QUIET)
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(15) == 130


def test_watchdog_pings_while_loops_progress(start_daemon) -> None:
    d = start_daemon(QUIET, env={"WATCHDOG_USEC": "1000000"})
    d.notify.wait_for("WATCHDOG=1", timeout=10)


def test_bad_config_exits_78_with_one_line(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sources:\n  nvml:\n    call_timeout: fast\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "run",
            "--config",
            str(cfg),
            "--state-dir",
            str(tmp_path / "s"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 78
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert f"{cfg}: sources.nvml.call_timeout: must be a number, got string" in lines[0]


def test_port_in_use_fails_cleanly(start_daemon) -> None:
    first = start_daemon(QUIET)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "run",
            "--listen",
            f"127.0.0.1:{first.port}",
            "--state-dir",
            str(first.config.parent / "s2"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert "cannot listen" in res.stderr
    assert http_get(first.url + "/healthz")[0] == 200


def test_sigterm_during_start_up_stops_at_once_not_after_the_first_polls(
    start_daemon, tmp_path
) -> None:
    """NVML's init hangs (as a wedged driver's does): start-up waits for its first poll,
    and a SIGTERM waited with it, up to the NVML source's deadlines (here 15 s for init)
    plus every source's first poll (60 s). It is acted on at once."""
    import json

    capture = json.loads((ROOT / "tests/fixtures/nvml/h200x2-record.json").read_text())
    capture["script"] = [{"call": "init", "hang": True}]
    hung = tmp_path / "hung-init.json"
    hung.write_text(json.dumps(capture))
    slow = QUIET + "  nvml:\n    call_timeout: 15\n"  # its init deadline: 15 s
    d = start_daemon(slow, "--nvml-replay", str(hung), ready=False)
    deadline = time.monotonic() + 30
    while not (tmp_path / "state" / "gpuwatchd.db").exists():  # made after the handlers
        assert time.monotonic() < deadline and d.proc.poll() is None, d.output()
        time.sleep(0.05)
    time.sleep(0.5)  # in the wait for NVML's first poll (its init held past its deadline)
    asked = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    took = time.monotonic() - asked
    assert "SIGTERM: stopping" in d.output()
    assert took < 8.0, f"{took:.1f} s from SIGTERM to exit; output:\n{d.output()}"
