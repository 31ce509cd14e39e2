"""Fuzz the kernel log parser: any line, any sequence, never an exception, bounded fields.

Seeds are the real captures in tests/fixtures/kmsg and the hostile lines kept in
tests/fuzz/corpus/kmsg (add a file there for every line that ever broke the parser).
Hypothesis mutates them; the run is bounded by example count, not by wall time.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.sources.kmsg.parse import (
    MAX_CODE,
    MAX_PID,
    MAX_RECORD,
    KmsgParser,
    KmsgRecord,
    parse_line,
)
from tests.conftest import FIXTURES

CORPUS = Path(__file__).parent / "corpus" / "kmsg"
SEEDS = sorted(
    {
        line
        for path in [*CORPUS.iterdir(), *(FIXTURES / "kmsg").glob("*.txt")]
        for line in path.read_text(errors="replace").split("\n")
        if line
    }
)
PIECES = [
    "NVRM: Xid (",
    "PCI:0000:18:00",
    "): ",
    "79",
    "9223372036854775808",
    ", pid=",
    "<unknown>",
    ", name=",
    "\\x0a",
    "nvidia-nvswitch0: SXid (",
    "fallen off the bus",
    "NVRM: The NVIDIA GPU ",
    "[ 1843.308145] ",
    "6,1234,5678,-;",
    "Feb 23 16:24:18 host kernel: ",
    " Fatal Link 3 (0x1 0x2)",
    "recovery action changed from 0x0 (",
    # heads read right before the driver text (issue 29)
    '{"MESSAGE":"',
    '\\"',
    '"}',
    "2026-03-05T10:00:00.494739123Z stdout F ",
    " 3月 05 10:00:00 host kernel: ",
    "Reason:NvidiaXid Message:",
    "echo '",
    "MESSAGE=",
    "\x00",
    "\x1b[2J",
    "\r",
    "é",
]
FUZZ = settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

lines = st.one_of(
    st.sampled_from(SEEDS),
    st.lists(st.sampled_from(PIECES) | st.text(max_size=12), max_size=24).map("".join),
    st.tuples(st.sampled_from(SEEDS), st.integers(0, 400), st.text(max_size=40)).map(
        lambda t: t[0][: t[1]] + t[2] + t[0][t[1] :]
    ),
)


def check(rec: KmsgRecord) -> None:
    assert rec.kind in ("xid", "sxid", "gpu", "unparsed")
    assert len(rec.message) <= MAX_RECORD + 200
    if rec.kind in ("xid", "sxid"):
        assert 0 <= rec.code <= MAX_CODE
        assert rec.pci_bus_id
    if rec.pid is not None:
        assert 0 <= rec.pid <= MAX_PID
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in rec.process)


@FUZZ
@given(lines)
def test_parse_line_never_raises_and_bounds_its_fields(line: str) -> None:
    rec = parse_line(line)
    if rec is not None:
        check(rec)


@FUZZ
@given(st.lists(lines, max_size=12))
def test_the_multi_line_parser_never_raises(batch: list[str]) -> None:
    parser = KmsgParser()
    for line in batch:
        for rec in parser.feed(line):
            check(rec)
    for rec in parser.flush():
        check(rec)


def test_every_corpus_line_parses_without_raising() -> None:
    assert len(SEEDS) > 40
    parser = KmsgParser()
    for line in SEEDS:
        for rec in [*parser.feed(line), *parser.flush()]:
            check(rec)
