"""Drill: an Xid or SXid code the catalog does not know is reported, never dropped.

Issue 20: code 99999 (a future driver's, as in peers' test data) was read as
an unparsable line and lost. It must reach every output as unknown, with
the catalog's fallback remediation: the parser, the Xid stage and rule
(what the daemon alerts on), `check`, `xid scan` and `xid explain`.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpuwatchd.cli import main
from gpuwatchd.health.xid.catalog import default_catalog
from gpuwatchd.sources.kmsg.parse import parse_line
from tests.check_config import write_check_config

LINES = (
    "[ 1843.308145] NVRM: Xid (PCI:0000:00:06): 99999, pid=1773, name=python3, a future report\n"
    "[ 1843.410007] nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 99999, Non-fatal, Link 32 future\n"
)


def _fallback() -> str:
    return default_catalog().lookup(99999, "xid").remediation


def test_parser_reads_codes_beyond_the_catalog() -> None:
    xid, sxid = (parse_line(line) for line in LINES.splitlines())
    assert xid is not None and (xid.kind, xid.code, xid.pci_bus_id) == (
        "xid",
        99999,
        "0000:00:06.0",
    )
    assert sxid is not None and (sxid.kind, sxid.code) == ("sxid", 99999)


def test_check_reports_unknown_codes_with_the_fallback_remediation(tmp_path: Path, capsys) -> None:
    log = tmp_path / "kern.log"
    log.write_text(LINES)
    cfg = write_check_config(tmp_path, log)
    assert main(["check", "--json", "--config", str(cfg)]) == 1
    report = json.loads(capsys.readouterr().out)
    got = {
        (c["alertname"], c["labels"].get("xid") or c["labels"].get("sxid")): c
        for c in report["conditions"]
    }
    assert set(got) == {("GpuXidWarning", "99999"), ("NvswitchSxidWarning", "99999")}
    for cond in got.values():
        assert cond["remediation"] == _fallback()
        assert cond["action"] == "contact_support"

    assert main(["xid", "scan", str(log), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["kind"], r["code"], r["known"]) for r in rows] == [
        ("xid", 99999, False),
        ("sxid", 99999, False),
    ]
    assert all(r["remediation"] == _fallback() for r in rows)


def test_explain_gives_the_fallback_for_an_unknown_code(capsys) -> None:
    assert main(["xid", "explain", "xid:99999", "sxid:99999"]) == 0
    out = capsys.readouterr().out
    assert "Xid 99999 · Unknown Xid (not in the catalog)" in out
    assert "SXid 99999 · Unknown SXid (not in the catalog)" in out
    assert out.count("action     contact_support") == 2
    assert out.count("what to do This Xid is not in the catalog") == 2
