"""`gpuwatchd xid explain|scan`, driven through argparse like the CLI does."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
from pathlib import Path

import pytest

from gpuwatchd.cli import dispatch
from gpuwatchd.cli import xid as xidcmd

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kmsg"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="gpuwatchd")
    xidcmd.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    rc = dispatch(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_explain_text(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["xid", "explain", "79"], capsys)
    assert rc == 0
    assert out.splitlines()[0] == "Xid 79 · GPU has fallen off the bus"
    assert "severity   critical" in out
    assert "reboot_node: Drain the node and reboot it" in out
    assert "PCIe" in out  # the remediation text
    assert "\033[" not in out  # no colour when not a terminal


def test_explain_several_kinds_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["xid", "explain", "13", "sxid:22013", "12028", "4242", "--json"], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert rc == 0
    assert [(r["kind"], r["code"]) for r in rows] == [
        ("xid", 13),
        ("sxid", 22013),
        ("sxid", 12028),
        ("xid", 4242),
    ]
    assert rows[0]["severity"] == "warning" and rows[0]["action"] == "restart_app"
    assert rows[3]["known"] is False and rows[3]["name"] == "Unknown Xid"
    assert {"name", "severity", "action", "remediation", "action_text"} <= set(rows[0])


def test_explain_shows_what_the_line_decides(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(["xid", "explain", "154"], capsys)
    assert '"Node Reboot Required"   -> critical, reboot_node' in out


def test_explain_rejects_garbage(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["xid", "explain", "79", "seventy"], capsys)
    assert rc == 2
    assert "not a code: 'seventy'" in err
    assert "Xid 79" in out


def test_explain_with_site_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("xid:\n  overrides:\n    13: {severity: critical, action: reset_gpu}\n")
    _, out, _ = run(["xid", "explain", "13", "--json", "--config", str(cfg)], capsys)
    row = json.loads(out)
    assert (row["severity"], row["action"]) == ("critical", "reset_gpu")


def test_scan_text_report_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["xid", "scan", str(FIX / "dmesg-T-h100-xid119.txt")], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["SEVERITY", "CODE", "GPU", "/", "SWITCH", "WHEN"]
    events = [ln for ln in lines if ln.startswith("critical  Xid 119") and "·" not in ln]
    assert len(events) == 5
    assert "0000:9b:00.0" in events[0] and "nvidia-smi[2024380]" in events[0]
    assert "2025-02-23 16:24:18" in events[0]
    summary = out[out.index("Summary:") :]
    assert "5 report(s) in 21 line(s): 1 distinct (1 critical) on 1 device(s)" in summary
    assert "GPU 0000:9b:00.0 (GPU-509665ad-b600-ac93-3616-d754b23d636d)" in summary
    assert "5x, 2025-02-23 16:24:18 .. 2025-02-23 16:30:13" in summary
    assert "who:  nvidia-smi[2024380], cache_mgr_main[1263500], gpud[1240590]" in summary
    assert "do:   reset_gpu:" in summary


def test_scan_columns_line_up(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(["xid", "scan", str(FIX / "dmesg-xid31-mmu-fault.txt")], capsys)
    rows = [line for line in out.splitlines() if " Xid " in line and "·" not in line]
    assert len(rows) >= 8
    assert len({line.index("0000:") for line in rows}) == 1


def test_scan_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["xid", "scan", str(FIX / "dmesg-gb200-xid149-xid154.txt"), "--json"], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and len(rows) == 9
    for r in rows:
        assert {
            "kind",
            "code",
            "pci_bus_id",
            "pid",
            "process",
            "name",
            "severity",
            "action",
        } <= set(r)
    first, second = rows[0], rows[1]
    assert (first["code"], first["fatal"], first["link"], first["subcode"]) == (149, True, 1, 33)
    assert (second["code"], second["recovery_action"], second["severity"]) == (
        154,
        "Drain and Reset",
        "critical",
    )


def test_scan_stdin_and_fail_on(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    text = (FIX / "syslog-xid13-gpc.txt").read_text()
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    rc, out, _ = run(["xid", "scan", "--fail-on", "critical"], capsys)
    assert rc == 0  # Xid 13 is a warning: an application fault, not a node fault
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    rc, _, _ = run(["xid", "scan", "-", "--fail-on", "warning"], capsys)
    assert rc == 1


def test_scan_gzip_sxid_multiline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gz = tmp_path / "kern.log.1.gz"
    with gzip.open(gz, "wt") as f:
        f.write((FIX / "dmesg-h100-nvswitch-sxid22013.txt").read_text())
        f.write((FIX / "dmesg-fallen-off-bus-multiline.txt").read_text())
    rc, out, _ = run(["xid", "scan", str(gz), "--fail-on", "critical"], capsys)
    assert rc == 1
    assert out.count("SXid 22013") == 4  # three reports + one summary line
    assert "NVSwitch 0000:04:00.0" in out
    assert "critical  Xid 79" in out and "GPU 0000:b3:00.0" in out


def test_scan_user_space_and_unparsed_lines(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(["xid", "scan", str(FIX / "h200-xid31-kmsg.txt")], capsys)
    assert "1 Xid line(s) were written by user space" in out
    assert "Xid 79" not in out
    _, out, _ = run(
        ["xid", "scan", str(FIX / "h200-xid31-kmsg.txt"), "--include-userspace"], capsys
    )
    assert "Xid 79" in out
    _, out, _ = run(["xid", "scan", str(FIX / "redacted-and-malformed.txt")], capsys)
    assert "No Xid or SXid reports in 3 line(s)." in out
    assert "2 line(s) look like an Xid but could not be read" in out


def test_scan_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["xid", "scan", "/nonexistent/kern.log"], capsys)
    assert rc == 66 and "No such file" in err  # EX_NOINPUT


def test_scan_colour_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(
        ["xid", "scan", str(FIX / "fallen-off-bus-single.txt"), "--color", "always"], capsys
    )
    assert "\033[1;31mcritical" in out


def test_scan_ignores_driver_text_quoted_in_a_shell_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 20: notes that keep the command used to inject a test Xid are not an Xid;
    the kernel's own lines around them, in every text shape, still are."""
    notes = tmp_path / "notes.txt"
    notes.write_text(
        "# injected a test Xid on gpu-node-17:\n"
        "sudo sh -c \"echo 'NVRM: Xid (PCI:0000:3b:00): 79, pid=0, name=x, GPU has fallen off"
        " the bus.' >> /var/log/messages\"\n"
        "$ echo 'nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32' | logger\n"
        'root@gpu-node-17:~# echo "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."\n'
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=1773, name=python3, Graphics Exception\n"
        "[ 1843.308145] NVRM: Xid (PCI:0000:3b:00): 31, pid=1773, name=python3, MMU Fault\n"
        "Nov 26 10:00:00 gpu-node-17 kernel: NVRM: Xid (PCI:0000:3b:00): 43, pid=1773,"
        " name=python3, Ch 00000008\n"
        "2026-11-26T10:00:01+0000 gpu-node-17 kernel: NVRM: Xid (PCI:0000:3b:00): 45,"
        " pid=1773, name=python3, Ch 00000008\n"
        "6,1012,4875130,-;NVRM: Xid (PCI:0000:3b:00): 63, pid=1773, name=python3, Row remap\n"
    )
    rc, out, _ = run(["xid", "scan", str(notes), "--json"], capsys)
    assert [(r["kind"], r["code"]) for r in map(json.loads, out.splitlines())] == [
        ("xid", 13),
        ("xid", 31),
        ("xid", 43),
        ("xid", 45),
        ("xid", 63),
    ]
