"""NVLink5 Xids 144-150: decode unit, subcode and error status, then decide severity.

The decisions are data (gpuwatchd/data/nvlink5-status.yaml, with its
sources); this module parses the report text and finds the first matching
rule. No rule: the caller falls back to the line's Fatal/Nonfatal word.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from gpuwatchd.errors import CatalogError
from gpuwatchd.model import Action, Severity
from gpuwatchd.shipped import shipped_text

__all__ = ["Nvlink5Report", "Nvlink5Rule", "decide", "parse_report", "rules"]

FORMAT = "gpuwatchd-nvlink5-status/1"
CODES = range(144, 151)
_REPORT = re.compile(
    r"\b(?P<unit>[A-Z][A-Z0-9_]{0,63})\s+(?P<word>Fatal|Nonfatal|Non-fatal)\b"
    r"[^(]{0,64}\((?P<regs>[^)]{0,256})\)"
)


@dataclass(frozen=True, slots=True)
class Nvlink5Report:
    """What one NVLink5 report line says."""

    unit: str
    fatal: bool
    intrinfo: int | None
    error_status: int | None

    @property
    def subcode(self) -> int | None:
        """intrinfo bits 25:20."""
        return None if self.intrinfo is None else (self.intrinfo >> 20) & 0x3F


@dataclass(frozen=True, slots=True)
class Nvlink5Rule:
    """One row of the decode table."""

    xid: int
    unit: str
    severity: Severity
    action: Action
    why: str
    source: str
    subcode: int | None = None
    error_status: int | None = None

    def matches(self, code: int, report: Nvlink5Report) -> bool:
        if code != self.xid:
            return False
        if self.unit.endswith("*"):
            if not report.unit.startswith(self.unit[:-1]):
                return False
        elif report.unit != self.unit:
            return False
        if self.subcode is not None and report.subcode != self.subcode:
            return False
        return self.error_status is None or report.error_status == self.error_status


def _hex(text: str) -> int | None:
    try:
        return int(text, 16)
    except ValueError:
        return None


def parse_report(text: str) -> Nvlink5Report | None:
    """Unit, Fatal word and the first two registers of a report, or None."""
    m = _REPORT.search(text)
    if m is None:
        return None
    regs = m.group("regs").split()
    return Nvlink5Report(
        unit=m.group("unit"),
        fatal=m.group("word") == "Fatal",
        intrinfo=_hex(regs[0]) if regs else None,
        error_status=_hex(regs[1]) if len(regs) > 1 else None,
    )


def _rule(row: Any, n: int) -> Nvlink5Rule:
    if not isinstance(row, dict):
        raise CatalogError(f"nvlink5-status.yaml: rule {n} is not a mapping")
    try:
        status = row.get("error_status")
        return Nvlink5Rule(
            xid=int(row["xid"]),
            unit=str(row["unit"]),
            severity=Severity.parse(str(row["severity"])),
            action=Action(str(row["action"])),
            why=str(row.get("why", "")),
            source=str(row["source"]),
            subcode=None if row.get("subcode") is None else int(row["subcode"]),
            error_status=None if status is None else int(str(status), 0),
        )
    except (KeyError, ValueError) as exc:
        raise CatalogError(f"nvlink5-status.yaml: rule {n}: {exc}") from None


@functools.cache
def rules() -> tuple[Nvlink5Rule, ...]:
    """The decode table, loaded once (YAML only when an NVLink5 report needs it)."""
    import yaml

    text = shipped_text("nvlink5-status.yaml")
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CatalogError(f"nvlink5-status.yaml: format {FORMAT} expected")
    out = tuple(_rule(row, n) for n, row in enumerate(data.get("rules") or []))
    for r in out:
        if r.xid not in CODES:
            raise CatalogError(f"nvlink5-status.yaml: Xid {r.xid} is not an NVLink5 code")
    return out


def decide(code: int, text: str) -> Nvlink5Rule | None:
    """The rule that decides this report, or None (the Fatal/Nonfatal word decides)."""
    if code not in CODES:
        return None
    report = parse_report(text)
    if report is None:
        return None
    return next((r for r in rules() if r.matches(code, report)), None)
