"""Drill: PCIe AER errors on a node reach Alertmanager; a node without AER says so once.

A real daemon (NVML replayed from a capture) reads a copy of the fixture
sysfs tree (tests/fixtures/sys, AER files from public sources) every half
second; the test raises counters the way the kernel does and a real
Alertmanager must hold the alerts with the labels the Prometheus rules use.
Then the same tree without any aer_dev_* file (a VM's bus): the daemon
exports `gpuwatchd_pcie_aer_available 0`, /status says why, the log says it
once, and nothing fires.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from tests.conftest import FIXTURES, DaemonProcess
from tests.e2e.faults import CAPTURE, wait_until
from tests.servers import AlertmanagerServer

GPU0 = "pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:00.0/0000:19:00.0"
SWITCH_UP = "pci0000:16/0000:16:01.0/0000:17:00.0"


def config(sysfs: Path, am_url: str, node: str) -> str:
    return (
        f"daemon:\n  node_name: {node}\n"
        f"paths:\n  sysfs: {sysfs}\n"
        "sources:\n"
        "  nvml:\n    interval: 0.5\n"
        "  aer:\n    interval: 0.5\n"
        "  kmsg:\n    enabled: false\n  udev:\n    enabled: false\n  shm:\n    enabled: false\n"
        "health:\n  startup_grace_seconds: 0\n"
        f"alertmanager:\n  urls: [{am_url}]\n  resend_interval: 1\n  timeout: 1\n"
        "  retry_max_seconds: 1\n"
    )


def bump(root: Path, dev: str, fname: str, **by: int) -> None:
    """Raise counters of an aer_dev_* file as the kernel would (same format, same order)."""
    path = root / "devices" / dev / fname
    lines = []
    for line in path.read_text().splitlines():
        name, _, value = line.rpartition(" ")
        lines.append(f"{name} {int(value) + by.get(name, 0)}")
    path.write_text("\n".join(lines) + "\n")


def metric(d: DaemonProcess, name: str, **labels: str) -> float | None:
    for line in d.get("/metrics")[1].decode().splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    return None


def start(tmp: Path, text: str) -> DaemonProcess:
    d = DaemonProcess(tmp, text, ["--nvml-replay", str(CAPTURE)], {})
    try:
        d.notify.wait_for("READY=1", timeout=60)
    except AssertionError:
        out = d.output()
        d.stop()
        raise AssertionError(f"daemon not ready; output:\n{out}") from None
    return d


def test_aer_errors_page_through_alertmanager(
    tmp_path: Path, alertmanager: AlertmanagerServer
) -> None:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "sys", root, symlinks=True)
    node = "aer-drill"
    d = start(tmp_path, config(root, alertmanager.url, node))
    try:
        assert wait_until(lambda: metric(d, "gpuwatchd_pcie_aer_available") == 1.0)
        time.sleep(1.2)  # two quiet polls: the counters as found must not page
        assert alertmanager.alerts(node=node) == []
        bump(root, GPU0, "aer_dev_fatal", SDES=1, TOTAL_ERR_FATAL=1)
        bump(root, SWITCH_UP, "aer_dev_nonfatal", CmpltTO=2, TOTAL_ERR_NONFATAL=2)
        fatal = wait_until(
            lambda: alertmanager.alerts(node=node, alertname="PcieAerFatalErrors"), timeout=30
        )
        nonfatal = wait_until(
            lambda: alertmanager.alerts(node=node, alertname="PcieAerNonFatalErrors"), timeout=30
        )
        assert len(fatal) == 1 and len(nonfatal) == 1, d.output()[-3000:]
        labels = {k: v for k, v in fatal[0]["labels"].items() if k != "instance"}  # type: ignore[union-attr]
        assert labels == {
            "alertname": "PcieAerFatalErrors",
            "severity": "critical",
            "node": node,
            "pci_bus_id": "0000:19:00.0",
            "role": "gpu",
        }
        ann = fatal[0]["annotations"]
        assert "SDES +1" in ann["description"]  # type: ignore[index]
        assert nonfatal[0]["labels"]["role"] == "bridge"  # type: ignore[index]
        assert (
            metric(
                d,
                "gpuwatchd_pcie_aer_error_types_total",
                pci_bus_id="0000:19:00.0",
                severity="fatal",
                error="SDES",
            )
            == 1.0
        )
    finally:
        d.stop()


def test_a_node_without_aer_files_says_so_once(
    tmp_path: Path, alertmanager: AlertmanagerServer
) -> None:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "sys", root, symlinks=True)
    for dirpath, _, files in os.walk(root / "devices"):
        for f in files:
            if f.startswith("aer_"):
                os.remove(os.path.join(dirpath, f))
    node = "aer-vm"
    d = start(tmp_path, config(root, alertmanager.url, node))
    try:
        assert wait_until(lambda: metric(d, "gpuwatchd_pcie_aer_available") == 0.0)
        status = json.loads(d.get("/status")[1])
        aer = status["sources"]["aer"]
        assert aer["ok"] is True, aer
        assert "no aer_dev_* files" in json.dumps(aer)
        time.sleep(2.0)  # several polls
        assert metric(d, "gpuwatchd_collector_success", collector="aer") == 1.0
        assert d.output().count("PCIe AER counters unavailable") == 1
        assert alertmanager.alerts(node=node) == []
    finally:
        d.stop()
