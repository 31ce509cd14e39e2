"""A one-shot read (`check`) reads the kernel log to its end and stops (issue 20)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpuwatchd.clock import FakeClock
from gpuwatchd.model import Event
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.filereader import FileReader
from gpuwatchd.sources.kmsg.source import KmsgSource
from tests.sources.kmsg_files import kmsg_config, raw, xid_line


def test_one_shot_file_reader_never_sleeps(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(xid_line("0000:3b:00", 31) + "\n")
    slept: list[float] = []
    src = KmsgSource(
        kmsg_config(tmp_path, tmp_path / "unused"),
        SourceContext(clock=FakeClock(), one_shot=True),
        opener=lambda cur: FileReader(str(log), cur, sleep=slept.append),
        sleep=slept.append,
    )
    first = [e for e in src.poll(0.0) if isinstance(e, Event)]
    assert [e.code for e in first] == [31]
    assert not [e for e in src.poll(0.0) if isinstance(e, Event)]  # at the end: nothing
    assert slept == []


def test_one_shot_kmsg_reader_returns_at_the_end_of_the_ring(tmp_path: Path) -> None:
    """A FIFO with a writer never ends, as /dev/kmsg: the empty read must not wait."""
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(writer, raw(1, xid_line("0000:3b:00", 79)).encode())
        src = KmsgSource(kmsg_config(tmp_path, fifo), SourceContext(one_shot=True))
        assert [e.code for e in src.poll(time.time()) if isinstance(e, Event)] == [79]
        start = time.monotonic()
        assert not [e for e in src.poll(time.time()) if isinstance(e, Event)]
        assert time.monotonic() - start < 1.0  # the daemon's read waits up to 10 s here
        src.close()
    finally:
        os.close(writer)
