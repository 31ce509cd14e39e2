"""NVLink5 severity from the decoded line, and non-fatal NVSwitch SXids."""

from __future__ import annotations

import pytest

from gpuwatchd.health.xid import nvlink5
from gpuwatchd.health.xid.catalog import default_catalog
from gpuwatchd.model import Action, Severity

TLW_FATAL = "TLW_TX Fatal XC0 i0 Link 03 (0x02180000 0x00000010 0x00000000 0x00000000 0x0 0x0)"
RLW_NONFATAL = "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x0 0x0 0x0)"
NETIR_SUB4 = "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x004001c6 0x00000000 0x0 0x0 0x0 0x0)"
NETIR_SUB38 = "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000 0x0 0x0 0x0 0x0)"


def test_report_is_decoded() -> None:
    report = nvlink5.parse_report(RLW_NONFATAL)
    assert report is not None
    assert (report.unit, report.fatal, report.error_status) == ("RLW_RXPIPE", False, 8)
    assert report.subcode == (0x0409A0C2 >> 20) & 0x3F
    assert nvlink5.parse_report("no registers here") is None


def test_tlw_status_of_146_is_a_warning_even_when_printed_fatal() -> None:
    info = default_catalog().resolve(146, "xid", TLW_FATAL)
    assert (info.severity, info.action) == (Severity.WARNING, Action.NONE)
    # the same unit on another NVLink5 code is left to the Fatal word
    other = default_catalog().resolve(144, "xid", TLW_FATAL)
    assert other.severity == Severity.CRITICAL


def test_netir_link_down_subcodes_ask_for_inspection() -> None:
    info = default_catalog().resolve(149, "xid", NETIR_SUB4)
    assert (info.severity, info.action) == (Severity.CRITICAL, Action.DRAIN_AND_INSPECT)
    plain = default_catalog().resolve(149, "xid", NETIR_SUB38)
    assert (plain.severity, plain.action) == (Severity.CRITICAL, Action.RESET_GPU)


def test_without_a_rule_the_fatal_word_decides() -> None:
    info = default_catalog().resolve(145, "xid", RLW_NONFATAL)
    assert (info.severity, info.action) == (Severity.WARNING, Action.NONE)


def test_every_rule_names_a_source_and_an_nvlink5_code() -> None:
    rules = nvlink5.rules()
    assert rules
    assert all(r.source and r.why and 144 <= r.xid <= 150 for r in rules)


def test_nonfatal_sxid_never_reboots_the_node() -> None:
    cat = default_catalog()
    rebooting = [
        code
        for code in cat.codes("sxid")
        if cat.lookup(code, "sxid").action in (Action.REBOOT_NODE, Action.RESET_GPU)
    ]
    assert rebooting  # the catalog has such codes, so the check below means something
    for code in rebooting:
        info = cat.resolve(code, "sxid", "Non-fatal, Link 32", fatal=False)
        assert info.action not in (Action.REBOOT_NODE, Action.RESET_GPU), code
        assert info.severity <= Severity.WARNING
        fatal = cat.resolve(code, "sxid", "Fatal, Link 32", fatal=True)
        assert fatal.severity == Severity.CRITICAL


def test_explain_lists_the_decode_rules(capsys: pytest.CaptureFixture[str]) -> None:
    from gpuwatchd.cli import main

    assert main(["xid", "explain", "146"]) == 0
    assert "unit TLW*" in capsys.readouterr().out
