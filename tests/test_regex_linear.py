"""Every regex in gpuwatchd runs in linear time on hostile input.

The patterns are found by importing every module and collecting the
compiled ones; each is searched over 1 MiB lines built from its own
literal pieces repeated (the shape that makes a backtracking engine
quadratic: a prefix that matches again and again and then fails), plus
runs of digits, letters, spaces and brackets. A quadratic pattern takes
minutes on 1 MiB; a linear one a few milliseconds.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import time
from re import _constants as sre_constants  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]

import pytest

import gpuwatchd
from gpuwatchd.sources.kmsg.parse import MAX_RECORD, KmsgParser, parse_line

MIB = 1 << 20
# Generous for a slow shared 2-core CI machine under a parallel suite (the slowest linear
# pattern, a 30-way alternation, takes 0.2 s per MiB here); a quadratic one takes minutes.
SECONDS_PER_MIB = 3.0
FILLERS = ("0", "a", "A", " ", "[", "(", ":", "-", "0x1", "Link 1 ", "\\x0a")


def _patterns() -> list[tuple[str, re.Pattern[str]]]:
    found: dict[tuple[str, int], tuple[str, re.Pattern[str]]] = {}
    for info in pkgutil.walk_packages(gpuwatchd.__path__, "gpuwatchd."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # optional dependencies (systemd, pynvml)
            continue
        for name, value in vars(module).items():
            if isinstance(value, re.Pattern) and isinstance(value.pattern, str):
                found[(value.pattern, value.flags)] = (f"{info.name}.{name}", value)
    return sorted(found.values(), key=lambda nv: nv[0])


def _literals(pattern: str) -> list[str]:
    """Literal runs of a pattern, in order (branches and groups walked into)."""
    runs: list[str] = []
    current: list[str] = []

    def walk(items: object) -> None:
        for op, arg in items:  # type: ignore[attr-defined]
            if op is sre_constants.LITERAL:
                current.append(chr(arg))
                continue
            if current:
                runs.append("".join(current))
                current.clear()
            if op is sre_constants.SUBPATTERN:
                walk(arg[-1])
            elif op is sre_constants.BRANCH:
                for branch in arg[1]:
                    walk(branch)
            elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
                walk(arg[2])

    walk(sre_parse.parse(pattern))
    if current:
        runs.append("".join(current))
    return [r for r in runs if r]


def _hostile_lines(pattern: str) -> list[str]:
    pieces = _literals(pattern)
    units = [f for f in FILLERS]
    for k in range(1, min(len(pieces), 4) + 1):
        units.append("".join(pieces[:k]))
        units.append(" ".join(pieces[:k]) + " 1")
    return [(u * (MIB // len(u) + 1))[:MIB] for u in dict.fromkeys(units)]


PATTERNS = _patterns()


def test_the_audit_finds_the_parsers_patterns() -> None:
    names = {name for name, _ in PATTERNS}
    assert "gpuwatchd.sources.kmsg.parse._XID_RE" in names
    assert "gpuwatchd.sources.kmsg.prefix._SYSLOG" in names
    assert len(names) >= 25


@pytest.mark.parametrize(("name", "pattern"), PATTERNS, ids=[n for n, _ in PATTERNS])
def test_pattern_is_linear_on_hostile_lines(name: str, pattern: re.Pattern[str]) -> None:
    for line in _hostile_lines(pattern.pattern):
        start = time.perf_counter()
        pattern.search(line)
        pattern.match(line)
        took = time.perf_counter() - start
        assert took < SECONDS_PER_MIB, f"{name} took {took:.2f}s on {line[:40]!r}..."


XID_PREFIXES = (
    "NVRM: Xid (",
    "NVRM: Xid (PCI:0000:00:06): ",
    "nvidia-nvswitch0: SXid (",
    "NVRM: Xid (PCI:0000:00:06): 31, pid=1, name=x, ENGINE ",
    "NVRM: Xid (PCI:0000:00:06): 145, RLW_MSE ",
    "NVRM: Xid (PCI:0000:00:06): 154, recovery action changed from 0x0 (",
    "NVRM: GPU at PCI:0000:00:06: ",
    "NVRM: The NVIDIA GPU 0000:",
    "kern  :err   : [ 1.0] ",
    "Feb 23 16:24:18 host kernel: NVRM: Xid (",
    # heads read right before the driver text (issue 29): JSON fields, CRI, locales, NPD
    '{"MESSAGE":"NVRM: Xid (',
    '{"log":"{\\"msg\\":\\"',
    "2026-03-05T10:00:00.494739123Z stdout F ",
    " 3月 05 10:00:00 host kernel: ",
    "Reason:NvidiaXid Message:",
    "echo 'NVRM: Xid (PCI:0000:00:06): 31, ",
    "a: ",
)


@pytest.mark.parametrize("unit", XID_PREFIXES)
def test_parser_is_linear_on_a_mib_of_repeated_prefixes(unit: str) -> None:
    line = (unit * (MIB // len(unit) + 1))[:MIB]
    parser = KmsgParser()
    start = time.perf_counter()
    parse_line(line)
    records = [*parser.feed(line), *parser.flush()]
    took = time.perf_counter() - start
    assert took < 2 * SECONDS_PER_MIB, f"{took:.2f}s"
    assert parser.truncated == 1
    assert all(len(r.message) <= MAX_RECORD for r in records)
