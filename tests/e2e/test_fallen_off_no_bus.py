"""Drill: a fall-off whose line lost its bus id is a critical node-level Xid 79.

Issue 20: "NVRM: GPU has fallen off the bus." without a bus id (cut by a log
shipper) was listed as an unreadable line. A GPU of the node is gone even if
the line no longer says which: the parser, the daemon's Xid rule (what it
alerts on, here through `check`, which runs the same chain) and `xid scan`
must report it, critical, with the bus unknown.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpuwatchd.cli import main
from gpuwatchd.sources.kmsg.parse import parse_line
from tests.check_config import write_check_config

LINE = "[ 1843.308145] NVRM: GPU has fallen off the bus.\n"


def test_parser_reads_a_fall_off_without_a_bus_id() -> None:
    rec = parse_line(LINE)
    assert rec is not None
    assert (rec.kind, rec.code, rec.pci_bus_id, rec.synthetic) == ("xid", 79, "", True)


def test_check_and_scan_report_it_critical_at_node_level(tmp_path: Path, capsys) -> None:
    log = tmp_path / "kern.log"
    log.write_text(LINE)
    cfg = write_check_config(tmp_path, log)
    assert main(["check", "--json", "--config", str(cfg)]) == 2
    [cond] = json.loads(capsys.readouterr().out)["conditions"]
    assert (cond["alertname"], cond["severity"], cond["scope"]) == (
        "GpuXidCritical",
        "critical",
        "node",
    )
    assert cond["labels"] == {"xid": "79", "name": "GPU has fallen off the bus"}
    assert cond["subject"] == {"pci_bus_id": "unknown"}
    assert cond["action"] == "reboot_node"

    assert main(["xid", "scan", str(log), "--fail-on", "critical"]) == 1
    out = capsys.readouterr().out
    assert "critical  Xid 79     unknown" in out
    assert "could not be read" not in out
