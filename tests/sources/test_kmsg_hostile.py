"""Hostile kernel log input: absurd numbers, endless lines, forged control characters."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatchd.sources.kmsg.filereader import FileReader
from gpuwatchd.sources.kmsg.parse import MAX_RECORD, KmsgParser, parse_line

GOOD = (
    "[ 1843.308145] NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3,"
    " GPU has fallen off the bus."
)


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: Xid (PCI:0000:18:00): 9223372036854775808, pid=1, name=x, boom",
        "NVRM: Xid (PCI:0000:18:00): 99999999999999999999999999, pid=1, name=x, boom",
        "NVRM: Xid (PCI:0000:18:00): 79, pid=9223372036854775808, name=x, boom",
        "NVRM: Xid (PCI:0000:18:00): 79, pid=4194305, name=x, boom",
        "NVRM: Xid (PCI:0000:18:00): 1000000, pid=1, name=x, boom",  # > MAX_CODE
        "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 18446744073709551616, Fatal",
        "NVRM: Xid (PCI:0000:18:00): " + "9" * 5000 + ", pid=1, name=x, boom",
    ],
)
def test_numbers_that_do_not_fit_make_the_line_unparsed(line: str) -> None:
    rec = parse_line(line)
    assert rec is not None and rec.kind == "unparsed"


def test_a_bad_record_does_not_poison_the_others() -> None:
    parser = KmsgParser()
    lines = [GOOD, "NVRM: Xid (PCI:0000:18:00): 9223372036854775808, pid=1, name=x, x", GOOD]
    out = [r for line in lines for r in parser.feed(line)] + parser.flush()
    assert [r.kind for r in out] == ["xid", "unparsed", "xid"]


def test_a_line_longer_than_a_record_is_cut_and_counted() -> None:
    parser = KmsgParser()
    out = list(parser.feed(GOOD + " " + "x" * 100_000))
    assert parser.truncated == 1
    assert out[0].kind == "xid" and out[0].code == 79
    assert len(out[0].message) < MAX_RECORD


def test_control_characters_in_a_process_name_are_escaped() -> None:
    rec = parse_line(
        "NVRM: Xid (PCI:0000:18:00): 13, pid=7, name=evil\x1b[2J\rx, Graphics Exception"
    )
    assert rec is not None and rec.kind == "xid"
    assert "\x1b" not in rec.process and "\r" not in rec.process
    assert rec.process.startswith("evil\\x1b")


def test_file_reader_keeps_one_record_of_an_endless_line(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    with open(log, "wb") as f:
        f.write(b"A" * (64 << 20))  # 64 MiB, no newline yet
    reader = FileReader(str(log), sleep=lambda s: None)
    for _ in range(2000):
        if not reader.read(0):
            break
    assert len(reader._cur.buf) <= MAX_RECORD + 1
    with open(log, "ab") as f:
        f.write(b"\n" + GOOD.encode() + b"\n")
    lines = reader.read(0)
    assert [len(line.text) for line in lines][0] == MAX_RECORD + 1
    assert lines[1].text == GOOD
    # The cursor still counts every byte, so a restart resumes after the good line.
    assert lines[1].cursor.split(":")[3] == str(os.path.getsize(log))
    reader.close()
