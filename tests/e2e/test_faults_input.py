"""Fault drill, hostile kernel log input: a 1 MiB line, a flood of lines, an absurd number."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.faults import Drill, Probe, assert_responsive, xid_line
from tests.servers import AlertmanagerServer


def test_one_mib_line_then_xids(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    drill = Drill(tmp_path, alertmanager.url, node="drill-mib")
    drill.start()
    try:
        probe = Probe(drill.daemon.url)
        # The prefix repeated: what made the old Xid regex quadratic.
        hostile = "NVRM: Xid (" * ((1 << 20) // 11) + "\n"
        with open(drill.kernel_log, "a") as f:
            f.write(hostile)
        drill.feed(79, 0)
        drill.feed(48, 1)
        drill.assert_nothing_lost(alertmanager)
        assert drill.metric("gpuwatchd_kmsg_truncated_lines_total") == 1
        assert_responsive("1 MiB line", probe.stop())
    finally:
        drill.stop()


def test_oversized_numbers_are_rejected_alone(
    tmp_path: Path, alertmanager: AlertmanagerServer
) -> None:
    drill = Drill(tmp_path, alertmanager.url, node="drill-number")
    drill.start()
    try:
        probe = Probe(drill.daemon.url)
        with open(drill.kernel_log, "a") as f:
            f.write(xid_line(79, 0, "a"))
            f.write("NVRM: Xid (PCI:0000:00:06): 9223372036854775808, pid=1, name=x, big\n")
            f.write("NVRM: Xid (PCI:0000:00:07): 48, pid=18446744073709551616, name=x, big\n")
            f.write(xid_line(95, 1, "b"))
        drill.fed = {(79, 0): 1, (95, 1): 1}
        drill.assert_nothing_lost(alertmanager)
        assert drill.metric("gpuwatchd_kmsg_unparsed_xid_lines_total") == 2
        assert drill.metric("gpuwatchd_event_store_errors_total") == 0
        assert_responsive("oversized number", probe.stop())
    finally:
        drill.stop()


@pytest.mark.slow
def test_a_million_line_flood(tmp_path: Path, alertmanager: AlertmanagerServer) -> None:
    """1,000,000 lines of kernel chatter with critical Xids among them, all at once."""
    drill = Drill(tmp_path, alertmanager.url, node="drill-flood")
    drill.start()
    try:
        probe = Probe(drill.daemon.url)
        noise = "usb 1-1: reset high-speed USB device number 2 using xhci_hcd\n" * 1000
        start = time.monotonic()
        with open(drill.kernel_log, "a") as f:
            for i in range(1000):
                f.write(noise)
                if i % 200 == 100:
                    f.write(xid_line((79, 48, 95, 119, 120)[i // 200], i % 2, str(i)))
        drill.fed = {(c, (100 + 200 * k) % 2): 1 for k, c in enumerate((79, 48, 95, 119, 120))}
        read = 1_000_000 + len(drill.fed)
        drill.wait_for(
            lambda: drill.metric("gpuwatchd_kmsg_records_read_total") >= read, 120, "read all"
        )
        took = time.monotonic() - start
        drill.assert_nothing_lost(alertmanager)
        figures = probe.stop()
        figures["seconds_to_read"] = took
        assert_responsive("million-line flood", figures)
    finally:
        drill.stop()
