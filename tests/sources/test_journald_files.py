"""The journald reader on real journal files.

systemd-journal-remote (Debian's systemd-journal-remote package) writes
journal files from the export format, and systemd-python's reader opens
them the way it opens the host's journal. journald's rotation keeps one
sequence-number id and continues the numbers in the new file; journal-remote
starts every new file afresh, so `continue_sequence` writes those two
header fields (the file format's documented layout) into a new, still
empty file before journal-remote appends to it. Vacuum is deleting the
oldest file, as journald does.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("systemd.journal")

from gpuwatchd.clock import FakeClock  # noqa: E402
from gpuwatchd.config import Config, KmsgConfig, PathsConfig, SourcesConfig  # noqa: E402
from gpuwatchd.model import Event, Sample  # noqa: E402
from gpuwatchd.sources import SourceContext  # noqa: E402
from gpuwatchd.sources.kmsg.journal import JournalReader, cursor_seqnum  # noqa: E402
from gpuwatchd.sources.kmsg.readers import Line  # noqa: E402
from gpuwatchd.sources.kmsg.source import KmsgSource  # noqa: E402

REMOTE = shutil.which("systemd-journal-remote") or next(
    (p for p in ("/lib/systemd/systemd-journal-remote", "/usr/lib/systemd/systemd-journal-remote")
     if Path(p).exists()),
    None,
)  # fmt: skip
pytestmark = pytest.mark.skipif(REMOTE is None, reason="systemd-journal-remote not installed")

BOOT = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
OTHER_BOOT = uuid.uuid4().hex
SEQNUM_ID_AT, TAIL_SEQNUM_AT = 72, 160  # journal file header offsets
XID = "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


class Journal:
    """Export-format entries written into journal files, one sequence like journald's."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(exist_ok=True)
        self.n = 0
        self.active = self.dir / "system.journal"
        self.archived: list[Path] = []

    def write(self, *entries: tuple[str, str] | tuple[str, str, str]) -> None:
        """(transport, message[, boot id]) entries appended to the active file."""
        chunks = []
        for entry in entries:
            transport, message = entry[0], entry[1]
            boot = entry[2] if len(entry) == 3 else BOOT
            self.n += 1
            fields = {
                "__REALTIME_TIMESTAMP": str(1_790_000_000_000_000 + self.n * 1000),
                "__MONOTONIC_TIMESTAMP": str(self.n * 1000),
                "_BOOT_ID": boot,
                "_TRANSPORT": transport,
                "PRIORITY": "3" if transport == "kernel" else "6",
                "SYSLOG_FACILITY": "0" if transport == "kernel" else "3",
                "_SOURCE_MONOTONIC_TIMESTAMP": str(self.n * 1000),
                "MESSAGE": message,
            }
            chunks.append("".join(f"{k}={v}\n" for k, v in fields.items()) + "\n")
        run_remote(self.active, "".join(chunks).encode())

    def rotate(self) -> None:
        """Archive the active file and start a new one that continues its sequence."""
        header = self.active.read_bytes()[:256]
        seqnum_id = header[SEQNUM_ID_AT : SEQNUM_ID_AT + 16]
        (tail,) = struct.unpack_from("<Q", header, TAIL_SEQNUM_AT)
        archived = self.dir / f"system@{seqnum_id.hex()}-{len(self.archived):016x}.journal"
        self.active.rename(archived)
        self.archived.append(archived)
        run_remote(self.active, b"")  # an empty file: header only
        with open(self.active, "r+b") as f:
            f.seek(SEQNUM_ID_AT)
            f.write(seqnum_id)
            f.seek(TAIL_SEQNUM_AT)
            f.write(struct.pack("<Q", tail))

    def vacuum(self) -> None:
        """Delete the oldest archived file, as journald's vacuum does."""
        self.archived.pop(0).unlink()


def run_remote(path: Path, export: bytes) -> None:
    assert REMOTE is not None
    res = subprocess.run(
        [REMOTE, f"--output={path}", "--compress=no", "-"],
        input=export, capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    yield Journal(tmp_path / "journal")


def messages(lines: list[Line]) -> list[str]:
    return [ln.text.split(";", 1)[1] for ln in lines]


def read_all(reader: JournalReader) -> list[Line]:
    out: list[Line] = []
    while batch := reader.read(0.01):
        out += batch
    return out


def test_only_kernel_records_of_this_boot(journal: Journal) -> None:
    journal.write(
        ("kernel", "k1"),
        ("syslog", XID),  # an Xid line logged from user space is not the kernel's
        ("stdout", "s1"),
        ("kernel", "k2", OTHER_BOOT),
        ("journal", "j1"),
        ("kernel", XID),
    )
    reader = JournalReader(path=str(journal.dir))
    lines = read_all(reader)
    assert messages(lines) == ["k1", XID]
    # kernel facility 0, priority 3 (err), the kernel timestamp in microseconds
    assert lines[1].text.startswith("3,0,6000,-;")
    assert lines[1].cursor == reader.cursor()
    assert reader.take_lost() == 0
    reader.close()


def test_cursor_across_a_restart_neither_repeats_nor_misses(journal: Journal) -> None:
    journal.write(("kernel", "k1"), ("kernel", "k2"), ("syslog", "u1"))
    first = JournalReader(path=str(journal.dir))
    assert messages(read_all(first)) == ["k1", "k2"]
    cursor = first.cursor()
    first.close()
    journal.write(("kernel", "k3"), ("syslog", "u2"), ("kernel", "k4"))
    # the daemon stores "journal:<cursor>"; open_reader hands the reader the bare cursor
    second = JournalReader(cursor.removeprefix("journal:"), path=str(journal.dir))
    assert messages(read_all(second)) == ["k3", "k4"]
    assert second.take_lost() == 0
    second.close()


def test_idle_cursor_moves_to_the_tail_without_skipping_a_kernel_record(
    journal: Journal,
) -> None:
    clock = FakeClock()
    journal.write(("kernel", "k1"), *[("syslog", f"u{i}") for i in range(20)])
    reader = JournalReader(path=str(journal.dir), monotonic=clock.monotonic)
    assert messages(read_all(reader)) == ["k1"]
    kernel_cursor = reader.cursor()
    clock.advance(10)
    assert reader.read(0.01) == []
    tail = reader.cursor()
    assert tail != kernel_cursor
    assert cursor_seqnum(tail.removeprefix("journal:")) == (
        cursor_seqnum(kernel_cursor.removeprefix("journal:"))[0],  # type: ignore[index]
        21,
    )
    reader.close()
    journal.write(("kernel", "k2"))
    again = JournalReader(tail.removeprefix("journal:"), path=str(journal.dir))
    assert messages(read_all(again)) == ["k2"]
    again.close()


def test_rotation_alone_loses_nothing(journal: Journal) -> None:
    journal.write(("kernel", "k1"), ("kernel", "k2"), ("syslog", "u1"))
    reader = JournalReader(path=str(journal.dir), max_lines=1)
    assert messages(reader.read(0.01)) == ["k1"]
    cursor = reader.cursor().removeprefix("journal:")
    reader.close()
    journal.rotate()
    journal.write(("kernel", "k3"))
    resumed = JournalReader(cursor, path=str(journal.dir))
    assert messages(read_all(resumed)) == ["k2", "k3"]
    assert resumed.take_lost() == 0
    resumed.close()


def test_records_vacuumed_before_they_were_read_are_counted_lost(journal: Journal) -> None:
    # seqnums 1..5 in the first file; the daemon read k1 (1) and then stopped
    journal.write(
        ("kernel", "k1"), ("kernel", "k2"), ("syslog", "u1"), ("kernel", "k3"), ("stdout", "s1")
    )
    reader = JournalReader(path=str(journal.dir), max_lines=1)
    assert messages(reader.read(0.01)) == ["k1"]
    cursor = reader.cursor().removeprefix("journal:")
    reader.close()
    journal.rotate()
    journal.write(("kernel", "k4"), ("syslog", "u2"))  # seqnums 6, 7
    journal.vacuum()  # 2..5 (k2, u1, k3, s1) deleted unread
    resumed = JournalReader(cursor, path=str(journal.dir))
    assert messages(read_all(resumed)) == ["k4"]
    assert resumed.take_lost() == 4  # journal entries 2..5: an upper bound for kernel ones
    assert resumed.take_lost() == 0
    resumed.close()


def test_a_vacuumed_gap_of_other_records_is_still_reported(journal: Journal) -> None:
    journal.write(("kernel", "k1"), ("syslog", "u1"))
    reader = JournalReader(path=str(journal.dir))
    assert messages(read_all(reader)) == ["k1"]
    cursor = reader.cursor().removeprefix("journal:")
    reader.close()  # stopped before its idle cursor moved past u1
    journal.rotate()
    journal.write(("kernel", "k2"))
    journal.vacuum()
    resumed = JournalReader(cursor, path=str(journal.dir))
    assert messages(read_all(resumed)) == ["k2"]
    # u1 (seqnum 2) lay between the cursor and the oldest entry left; the files no
    # longer say whether it was a kernel record, so it is reported, not skipped.
    assert resumed.take_lost() == 1
    resumed.close()


def test_vacuum_of_records_already_passed_is_not_a_loss(journal: Journal) -> None:
    clock = FakeClock()
    journal.write(("kernel", "k1"), ("syslog", "u1"), ("syslog", "u2"))
    reader = JournalReader(path=str(journal.dir), monotonic=clock.monotonic)
    assert messages(read_all(reader)) == ["k1"]
    clock.advance(10)
    reader.read(0.01)  # idle: the cursor moves to the tail (u2)
    cursor = reader.cursor().removeprefix("journal:")
    reader.close()
    journal.rotate()
    journal.write(("kernel", "k2"))
    journal.vacuum()
    resumed = JournalReader(cursor, path=str(journal.dir))
    assert messages(read_all(resumed)) == ["k2"]
    assert resumed.take_lost() == 0
    resumed.close()


def test_the_source_exports_lost_journal_records(journal: Journal, tmp_path: Path) -> None:
    journal.write(("kernel", "k1"), ("kernel", "k2"), ("kernel", "k3"))
    first = JournalReader(path=str(journal.dir), max_lines=1)
    first.read(0.01)
    cursor = first.cursor()
    first.close()
    journal.rotate()
    journal.write(("kernel", XID))
    journal.vacuum()
    boot = tmp_path / "boot_id"
    boot.write_text(str(uuid.UUID(BOOT)) + "\n")
    cfg = Config(
        paths=PathsConfig(boot_id=str(boot), procfs=str(tmp_path)),
        sources=SourcesConfig(kmsg=KmsgConfig(backend="journald")),
    )
    ctx = SourceContext(clock=FakeClock(), load_cursor=lambda name: cursor)
    src = KmsgSource(
        cfg,
        ctx,
        opener=lambda cur: JournalReader(
            cur.removeprefix("journal:") if cur else None, path=str(journal.dir)
        ),
        sleep=lambda s: None,
    )
    out = src.poll(0.0)
    lost = [s for s in out if isinstance(s, Sample) and s.name.endswith("records_lost_total")]
    assert [(s.label("backend"), s.value) for s in lost] == [("journald", 2)]
    (event,) = [e for e in out if isinstance(e, Event)]
    assert "79" in str(event)


def test_a_cursor_from_another_journal_counts_as_one_lost(journal: Journal) -> None:
    journal.write(("kernel", "k1"), ("kernel", "k2"))
    reader = JournalReader(path=str(journal.dir), max_lines=1)
    assert messages(reader.read(0.01)) == ["k1"]
    cursor = reader.cursor().removeprefix("journal:")
    reader.close()
    seqnum_id, seqnum = cursor_seqnum(cursor) or ("", 0)
    # the same position in a journal whose sequence id is not this one (wiped, replaced)
    foreign = cursor.replace(f"s={seqnum_id}", f"s={uuid.uuid4().hex}")
    assert cursor_seqnum(foreign) not in (None, (seqnum_id, seqnum))
    resumed = JournalReader(foreign, path=str(journal.dir))
    resumed.read(0.01)
    assert resumed.take_lost() == 1
    resumed.close()


@pytest.mark.parametrize("bad", ["", "garbage", "s=abc;i=zz", "i=1f"])
def test_cursor_seqnum_of_a_malformed_cursor_is_none(bad: str) -> None:
    assert cursor_seqnum(bad) is None
