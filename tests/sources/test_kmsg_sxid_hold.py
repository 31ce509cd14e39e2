"""The lines of one SXid report that arrive in separate reads are still one report.

An NVSwitch prints a report's Data, Non-fatal and Severity lines a few ms
apart; /dev/kmsg wakes the reader at the first, so each read may hold one
line. Issue 20: the source handed out what the parser held at the end of
every read, one report per line. Now a started report waits SXID_HOLD after
its last line, and the stored cursor never passes a held line.
"""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.clock import FakeClock
from gpuwatchd.model import Event
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.readers import Line
from gpuwatchd.sources.kmsg.source import SXID_HOLD, KmsgSource
from tests.sources.kmsg_files import kmsg_config, raw

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kmsg"


class OneLineAtATime:
    """A reader of real kmsg records that returns one line per read, as /dev/kmsg does
    when the driver prints them a few ms apart; an empty read moves the clock on."""

    name = "kmsg"

    def __init__(self, records: list[str], clock: FakeClock) -> None:
        self.lines = [Line(r, f"kmsg:b:{i}") for i, r in enumerate(records, 1)]
        self.clock = clock
        self.at = 0
        self.waits: list[float] = []

    def read(self, timeout: float) -> list[Line]:
        if self.at < len(self.lines):
            self.at += 1
            self.clock.advance(0.003)
            return [self.lines[self.at - 1]]
        self.waits.append(timeout)
        self.clock.advance(timeout)
        return []

    def cursor(self) -> str:
        return self.lines[self.at - 1].cursor if self.at else ""

    def take_lost(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_sxid_lines_read_one_at_a_time_make_one_report(tmp_path: Path) -> None:
    text = (FIX / "dmesg-h100-nvswitch-sxid22013.txt").read_text().splitlines()
    records = [raw(i, line.split("] ", 1)[1]) for i, line in enumerate(text, 1)]
    clock = FakeClock()
    reader = OneLineAtATime(records, clock)
    src = KmsgSource(
        kmsg_config(tmp_path, tmp_path / "unused"),
        SourceContext(clock=clock),
        opener=lambda cur: reader,
    )
    events: list[Event] = []
    cursors = []
    for _ in range(len(records)):
        events += [e for e in src.poll(clock.time()) if isinstance(e, Event)]
        cursors.append(src.status()["cursor"])
    # two reports done (a third started each time); the last one waits for more lines
    assert [e.attr("link") for e in events] == ["44", "45"]
    assert cursors[-1] == "kmsg:b:7"  # never past a line of the held report (8, 9)
    assert cursors[1] == "kmsg:b:1"  # report 1 (lines 2-4) held: before its first line
    events += [e for e in src.poll(clock.time()) if isinstance(e, Event)]
    assert reader.waits == [SXID_HOLD]  # the read waited only for the rest of the report
    assert [(e.attr("link"), e.attr("lines")) for e in events] == [
        ("44", "3"),
        ("45", "3"),
        ("46", "2"),
    ]
    assert src.status()["cursor"] == "kmsg:b:9"
