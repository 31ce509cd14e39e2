"""Drill: a kernel log file rotated under a writer that never pauses.

A real writer process appends numbered lines as fast as it can (each a
single O_APPEND write, like a syslog daemon) while the file is rotated by
rename (the writer goes on writing to the renamed file for a while, as it
does until logrotate's HUP) or by copytruncate. The reader must hand out
every line once: nothing lost to a rename, no duplicate, and a loss that
cannot be read (copytruncate's copy-to-truncate window) counted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpuwatchd.sources.kmsg.filereader import FileReader

# Writes `line N` until told to stop; on SIGHUP reopens the path (a syslog daemon). The
# handler only asks: closing the descriptor in it could close the one a write is about to use.
WRITER = r"""
import os, signal, sys, time
path, stop = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
hup = []
signal.signal(signal.SIGHUP, lambda *_: hup.append(1))
n = 0
while not os.path.exists(stop):
    if hup:
        hup.clear()
        new = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        fd, old = new, fd
        os.close(old)
    os.write(fd, b"[ 1.0] line %d\n" % n)
    n += 1
    if n % 20 == 0:
        time.sleep(0.001)
os.write(fd, b"[ 1.0] line %d\n" % n)
print(n + 1)
"""


def follow(reader: FileReader, seen: list[int], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for line in reader.read(0.05):
            seen.append(int(line.text.rsplit(" ", 1)[1]))


def run_drill(tmp_path: Path, rotate: str) -> tuple[int, list[int], int]:
    log = tmp_path / "kern.log"
    stop = tmp_path / "stop"
    log.touch()
    reader = FileReader(str(log), step=0.01)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(log), str(stop)], stdout=subprocess.PIPE, text=True
    )
    seen: list[int] = []
    lost = 0
    try:
        follow(reader, seen, 0.3)
        while not seen and writer.poll() is None:  # its SIGHUP handler is set: it writes
            follow(reader, seen, 0.1)
        for n in range(2):
            if rotate == "rename":
                log.rename(tmp_path / f"kern.log.{n + 1}")
                log.touch()
                # the writer goes on appending to the renamed file until its HUP
                follow(reader, seen, 0.4)
                writer.send_signal(1)
            else:
                shutil.copyfile(log, tmp_path / f"kern.log.{n + 1}")
                os.truncate(log, 0)
            follow(reader, seen, 0.3)
        stop.touch()
        written = int(writer.communicate(timeout=10)[0])
        follow(reader, seen, 0.8)
        lost = reader.take_lost()
    finally:
        writer.kill()
        writer.wait()
        reader.close()
    return written, seen, lost


def test_rename_rotation_loses_nothing_and_repeats_nothing(tmp_path: Path) -> None:
    written, seen, lost = run_drill(tmp_path, "rename")
    assert len(seen) == len(set(seen)), "a line was handed out twice"
    missing = sorted(set(range(written)) - set(seen))
    assert not missing, f"{len(missing)} of {written} lines lost, from line {missing[0]}"
    assert lost == 0


def test_copytruncate_counts_what_it_cannot_read(tmp_path: Path) -> None:
    written, seen, lost = run_drill(tmp_path, "copytruncate")
    assert len(seen) == len(set(seen)), "a line was handed out twice"
    missing = set(range(written)) - set(seen)
    # Lines written between the copy and the truncate are in neither file; each
    # truncation is counted as a possible loss. Everything else is read.
    assert lost == 2
    assert len(missing) < written // 20, f"{len(missing)} of {written} lines lost"


def test_copytruncate_window_loss_is_counted(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a\nb\n")
    reader = FileReader(str(log), step=0.01)
    assert [line.text for line in reader.read(0)] == ["a", "b"]
    with log.open("a") as f:
        f.write("c\n")  # appended after our last read: only the copy holds it
    shutil.copyfile(log, tmp_path / "kern.log-20261126")
    with log.open("a") as f:
        f.write("lost\n")  # between copy and truncate: in neither file
    os.truncate(log, 0)
    with log.open("a") as f:
        f.write("d\n")
    assert [line.text for line in reader.read(0.2)] == ["c", "d"]
    assert reader.take_lost() == 1
    reader.close()


def test_a_file_renamed_away_and_back_is_not_read_again(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("one\ntwo\n")
    reader = FileReader(str(log), step=0.01)
    assert [line.text for line in reader.read(0)] == ["one", "two"]
    log.rename(tmp_path / "kern.log.tmp")
    log.write_text("other\n")
    assert [line.text for line in reader.read(0.2)] == ["other"]
    log.rename(tmp_path / "kern.log.other")
    (tmp_path / "kern.log.tmp").rename(log)
    with log.open("a") as f:
        f.write("three\n")
    assert [line.text for line in reader.read(0.2)] == ["three"]
    reader.close()


# --- around a restart: the daemon stopped while the file was rotated -------------------


def _numbered(path: Path, first: int, count: int) -> None:
    with path.open("a") as f:
        f.write("".join(f"[ 1.0] line {n}\n" for n in range(first, first + count)))


def _stopped(tmp_path: Path, lines: int = 100) -> tuple[Path, str]:
    """A reader that read `lines` lines and stopped: the log and the cursor it stored."""
    log = tmp_path / "kern.log"
    _numbered(log, 0, lines)
    reader = FileReader(str(log), sleep=lambda s: None)
    assert len(reader.read(0)) == lines
    cursor = reader.cursor()
    reader.close()
    return log, cursor


def _restart(log: Path, cursor: str) -> tuple[list[int], int]:
    reader = FileReader(str(log), cursor, sleep=lambda s: None)
    try:
        seen = [int(line.text.rsplit(" ", 1)[1]) for line in reader.read(0)]
        return seen, reader.take_lost()
    finally:
        reader.close()


def test_rename_rotation_while_stopped_is_read_on_at_start(tmp_path: Path) -> None:
    log, cursor = _stopped(tmp_path)
    _numbered(log, 100, 20)  # written after the stop, before the rotation
    log.rename(tmp_path / "kern.log.1")
    _numbered(log, 120, 30)
    seen, lost = _restart(log, cursor)
    assert sorted(seen) == list(range(100, 150)) and lost == 0


def test_copytruncate_while_stopped_reads_the_copy(tmp_path: Path) -> None:
    log, cursor = _stopped(tmp_path)
    _numbered(log, 100, 20)
    shutil.copyfile(log, tmp_path / "kern.log.1")
    os.truncate(log, 0)
    _numbered(log, 120, 30)
    seen, lost = _restart(log, cursor)
    assert sorted(seen) == list(range(100, 150))
    assert lost == 1  # the copy-to-truncate window, as while running


def test_truncated_and_grown_past_the_offset_while_stopped(tmp_path: Path) -> None:
    """The cursor's offset lies inside the new content: its fingerprint tells."""
    log, cursor = _stopped(tmp_path, 50)
    os.truncate(log, 0)
    _numbered(log, 1000, 169)  # longer than what was read before
    seen, lost = _restart(log, cursor)
    assert seen == list(range(1000, 1169)) and lost == 1


def test_a_rotated_file_gone_at_start_is_counted(tmp_path: Path) -> None:
    log, cursor = _stopped(tmp_path)
    _numbered(log, 100, 20)
    log.rename(tmp_path / "kern.log.1")
    (tmp_path / "kern.log.1").unlink()  # compressed or deleted before the start
    _numbered(log, 120, 30)
    seen, lost = _restart(log, cursor)
    assert sorted(seen) == list(range(120, 150)) and lost == 1


def test_a_renamed_file_written_after_a_quiet_spell_is_still_read(tmp_path: Path) -> None:
    """The writer reopens late (logrotate's HUP delayed): it was let go after 5 s quiet."""
    log = tmp_path / "kern.log"
    _numbered(log, 0, 10)
    reader = FileReader(str(log), step=0.01)
    seen = [int(line.text.rsplit(" ", 1)[1]) for line in reader.read(0)]
    log.rename(tmp_path / "kern.log.1")
    _numbered(log, 100, 5)
    follow(reader, seen, 5.3)  # quiet longer than the old grace
    _numbered(tmp_path / "kern.log.1", 10, 40)  # the writer, still on the renamed file
    follow(reader, seen, 0.2)
    reader.close()
    assert sorted(seen) == [*range(50), *range(100, 105)]


def test_two_rotations_a_second_apart_lose_nothing(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    _numbered(log, 0, 10)
    reader = FileReader(str(log), step=0.01)
    seen: list[int] = []
    follow(reader, seen, 0.1)
    log.rename(tmp_path / "kern.log.1")
    log.touch()
    follow(reader, seen, 0.1)
    (tmp_path / "kern.log.1").rename(tmp_path / "kern.log.2")
    log.rename(tmp_path / "kern.log.1")
    log.touch()
    follow(reader, seen, 0.1)
    _numbered(tmp_path / "kern.log.2", 10, 38)  # the writer has not reopened yet
    _numbered(log, 100, 2)
    follow(reader, seen, 0.2)
    reader.close()
    assert sorted(seen) == [*range(48), 100, 101]
