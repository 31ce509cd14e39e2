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

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-probe.json"
LINE = "[ 1843.308145] NVRM: GPU has fallen off the bus.\n"


def test_parser_reads_a_fall_off_without_a_bus_id() -> None:
    rec = parse_line(LINE)
    assert rec is not None
    assert (rec.kind, rec.code, rec.pci_bus_id, rec.synthetic) == ("xid", 79, "", True)


def test_check_and_scan_report_it_critical_at_node_level(tmp_path: Path, capsys) -> None:
    log = tmp_path / "kern.log"
    log.write_text(LINE)
    for d in ("shm", "sys"):
        (tmp_path / d).mkdir()
    (tmp_path / "boot_id").write_text("0f3c1f7e-8a2b-4c6d-9e10-1234567890ab\n")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        f"daemon: {{state_dir: {tmp_path / 'state'}, node_name: gpu-node-17}}\n"
        f"paths: {{dev_shm: {tmp_path / 'shm'}, sysfs: {tmp_path / 'sys'},"
        f" boot_id: {tmp_path / 'boot_id'}}}\n"
        "sources:\n"
        f"  nvml: {{replay: {H200}}}\n"
        f"  kmsg: {{backend: file, file: {log}}}\n"
    )
    assert main(["check", "--json", "--config", str(cfg)]) == 2
    [cond] = json.loads(capsys.readouterr().out)["conditions"]
    assert (cond["alertname"], cond["severity"], cond["scope"]) == (
        "GpuXidCritical",
        "critical",
        "node",
    )
    assert cond["labels"] == {"xid": "79"} and cond["subject"] == {"pci_bus_id": "unknown"}
    assert cond["action"] == "reboot_node"

    assert main(["xid", "scan", str(log), "--fail-on", "critical"]) == 1
    out = capsys.readouterr().out
    assert "critical  Xid 79     unknown" in out
    assert "could not be read" not in out
