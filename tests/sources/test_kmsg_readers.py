"""Kernel log readers against real files, pipes, FIFOs, sockets and /dev/kmsg itself."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest

from gpuwatchd.config import Config, KmsgConfig, PathsConfig, SourcesConfig
from gpuwatchd.sources.kmsg.filereader import FileReader
from gpuwatchd.sources.kmsg.journal import JournalReader
from gpuwatchd.sources.kmsg.readers import (
    KmsgReader,
    ReaderError,
    journal_line,
    permission_message,
)
from gpuwatchd.sources.kmsg.source import open_reader

BOOT = "0b5e6f1a-0000-4000-8000-00000000b007"


def rec(seq: int, msg: str = "usb 1-1: new high-speed USB device", dict_lines: str = "") -> bytes:
    return f"6,{seq},{seq * 1000},-;{msg}\n{dict_lines}".encode()


def seqs(lines: list) -> list[int]:
    return [int(line.text.split(",")[1]) for line in lines]


@pytest.fixture
def seqpacket():
    """A socket pair that, like /dev/kmsg, hands out one record per read."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_one_record_per_read_without_dictionary_lines(seqpacket) -> None:
    ours, kernel = seqpacket
    reader = KmsgReader("/dev/kmsg", BOOT, fd=ours.fileno())
    kernel.send(
        rec(
            1,
            "NVRM: Xid (PCI:0000:00:06): 31, pid=650, name=python3, x",
            " SUBSYSTEM=pci\n DEVICE=+pci:0000:00:06.0\n",
        )
    )
    kernel.send(rec(2))
    lines = reader.read(1.0)
    assert [line.text.split(";", 1)[1] for line in lines] == [
        "NVRM: Xid (PCI:0000:00:06): 31, pid=650, name=python3, x",
        "usb 1-1: new high-speed USB device",
    ]
    assert [line.cursor for line in lines] == [f"kmsg:{BOOT}:1", f"kmsg:{BOOT}:2"]
    assert reader.cursor() == f"kmsg:{BOOT}:2"


def test_read_waits_with_poll_and_wakes_on_input(seqpacket) -> None:
    ours, kernel = seqpacket
    reader = KmsgReader("/dev/kmsg", BOOT, fd=ours.fileno())
    t0 = time.monotonic()
    assert reader.read(0.2) == []
    assert 0.15 <= time.monotonic() - t0 < 1.0
    threading.Timer(0.1, lambda: kernel.send(rec(7))).start()
    t0 = time.monotonic()
    lines = reader.read(5.0)
    assert seqs(lines) == [7]
    assert time.monotonic() - t0 < 1.0, "a record must wake the reader at once"


def test_epipe_resumes_and_counts_lost_records() -> None:
    # what the kernel does when records were overwritten: one EPIPE, then the
    # oldest record still in the buffer
    script: list[object] = [rec(1), BrokenPipeError(errno.EPIPE, "Broken pipe"), rec(7), rec(8)]

    def read(fd: int, size: int) -> bytes:
        assert size >= 8192
        if not script:
            raise BlockingIOError(errno.EAGAIN, "again")
        item = script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item  # type: ignore[return-value]

    r, w = os.pipe()
    try:
        reader = KmsgReader("/dev/kmsg", BOOT, read=read, fd=r)
        assert seqs(reader.read(0.0)) == [1, 7, 8]
        assert reader.epipes == 1
        assert reader.take_lost() == 5
        assert reader.take_lost() == 0
    finally:
        os.close(r)
        os.close(w)


def test_other_read_errors_raise_reader_error() -> None:
    def read(fd: int, size: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    r, w = os.pipe()
    try:
        reader = KmsgReader("/dev/kmsg", BOOT, read=read, fd=r)
        with pytest.raises(ReaderError) as exc:
            reader.read(0.0)
        assert exc.value.reason == "read"
        assert "Input/output error" in str(exc.value)
    finally:
        os.close(r)
        os.close(w)


def test_file_of_records_skips_what_the_cursor_covers(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(b"".join(rec(i) for i in range(1, 6)))
    reader = KmsgReader(str(path), BOOT, after_seq=3)
    assert seqs(reader.read(0.0)) == [4, 5]
    assert reader.take_lost() == 0


def test_pipe_with_a_split_record(tmp_path: Path) -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        reader = KmsgReader("/dev/kmsg", BOOT, fd=r)
        data = rec(1) + rec(2)
        os.write(w, data[:30])
        assert reader.read(0.0) == []
        os.write(w, data[30:])
        assert seqs(reader.read(0.1)) == [1, 2]
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable here")
def test_the_real_dev_kmsg() -> None:
    reader = KmsgReader("/dev/kmsg", BOOT)
    try:
        lines = reader.read(0.2)
        assert lines, "a running kernel has records in its ring buffer"
        assert lines[0].cursor.startswith(f"kmsg:{BOOT}:")
        first = seqs(lines)
        assert first == sorted(first)
        # a second reader that starts after the last one sees nothing old again
        again = KmsgReader("/dev/kmsg", BOOT, after_seq=first[-1])
        try:
            assert all(s > first[-1] for s in seqs(again.read(0.05)))
        finally:
            again.close()
    finally:
        reader.close()


def _unprivileged(fn, *args: object) -> str:
    """Run fn(*args) in a forked child that dropped root; returns what it reported."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a threaded process; the child only
        # drops privileges, tries one open() and exits.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            msg = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            msg = f"{type(exc).__name__}: {exc}"
        os.write(w, msg.encode()[:4000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def _try_open(path: str) -> str:
    try:
        KmsgReader(path, BOOT).close()
    except ReaderError as exc:
        return f"{exc.reason}|{exc}"
    return "opened"


def test_permission_denied_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text("")
    path.chmod(0o600)
    out = _unprivileged(_try_open, str(path))
    reason, _, message = out.partition("|")
    assert reason == "permission", out
    assert "CAP_SYSLOG" in message and "kernel.dmesg_restrict=1" in message


def _restricted() -> bool:
    try:
        return Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(
    not (_restricted() and os.path.exists("/dev/kmsg")),
    reason="needs /dev/kmsg with kernel.dmesg_restrict=1",
)
def test_real_dev_kmsg_refuses_without_cap_syslog() -> None:
    out = _unprivileged(_try_open, "/dev/kmsg")
    assert out.startswith("permission|"), out
    assert "(here: 1)" in out


def test_permission_message_names_capability_and_sysctl(tmp_path: Path) -> None:
    (tmp_path / "sys/kernel").mkdir(parents=True)
    (tmp_path / "sys/kernel/dmesg_restrict").write_text("1\n")
    msg = permission_message("/dev/kmsg", str(tmp_path))
    assert "CAP_SYSLOG" in msg
    assert "kernel.dmesg_restrict=1 (here: 1)" in msg


# --- plain files and FIFOs ---------------------------------------------------------------


def test_file_follow_rotation_truncation_and_cursor(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("one\ntwo\n")
    reader = FileReader(str(log), sleep=lambda s: None)
    assert [line.text for line in reader.read(0.0)] == ["one", "two"]
    with log.open("a") as f:
        f.write("three\npart")
    assert [line.text for line in reader.read(0.0)] == ["three"]
    cursor = reader.cursor()
    # a new reader from the cursor continues after "three" (not before, not after "part")
    with log.open("a") as f:
        f.write("ial\n")
    resumed = FileReader(str(log), cursor, sleep=lambda s: None)
    assert [line.text for line in resumed.read(0.0)] == ["partial"]
    # rotation: the old file is renamed and a new one created
    log.rename(tmp_path / "kern.log.1")
    log.write_text("after rotation\n")
    assert [line.text for line in resumed.read(0.2)] == ["after rotation"]
    # copytruncate: same inode, shorter file
    log.write_text("")
    with log.open("a") as f:
        f.write("short\n")
    assert [line.text for line in resumed.read(0.2)] == ["short"]


def test_file_cursor_of_another_file_starts_over(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a\nb\n")
    reader = FileReader(str(log), "file:1:2:3", sleep=lambda s: None)
    assert [line.text for line in reader.read(0.0)] == ["a", "b"]


def test_fifo_reads_lines_and_waits_without_spinning(tmp_path: Path) -> None:
    fifo = tmp_path / "dmesg.fifo"
    os.mkfifo(fifo)
    reader = FileReader(str(fifo))
    try:
        t0 = time.process_time()
        w0 = time.monotonic()
        assert reader.read(0.3) == []
        assert time.monotonic() - w0 >= 0.25
        assert time.process_time() - t0 < 0.1, "waiting must not burn CPU"
        with open(fifo, "w") as w:
            w.write("[ 1.0] NVRM: Xid (PCI:0000:00:06): 79, GPU has fallen off the bus.\n")
        lines = reader.read(1.0)
        assert [line.text[:8] for line in lines] == ["[ 1.0] N"]
        # the writer went away: still no busy loop
        t0 = time.process_time()
        assert reader.read(0.2) == []
        assert time.process_time() - t0 < 0.1
    finally:
        reader.close()


# --- journald -------------------------------------------------------------------------


def test_journal_entry_becomes_a_raw_record() -> None:
    entry = {
        "MESSAGE": "NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: fallen off the bus and is not"
        " responding to commands.\n",
        "SYSLOG_FACILITY": 0,
        "PRIORITY": 3,
        "_SOURCE_MONOTONIC_TIMESTAMP": timedelta(seconds=1843.308145),
        "__CURSOR": "s=abc;i=1",
    }
    text = journal_line(entry)
    assert text.startswith("3,0,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM:")
    from gpuwatchd.sources.kmsg.parse import parse_line

    parsed = parse_line(text)
    assert parsed is not None
    assert (parsed.kind, parsed.code, parsed.pci_bus_id, parsed.origin) == (
        "xid",
        79,
        "0000:b3:00.0",
        "kernel",
    )
    user = journal_line({"MESSAGE": "NVRM: Xid (PCI:0000:00:06): 79, x", "SYSLOG_FACILITY": "1"})
    parsed_user = parse_line(user)
    assert parsed_user is not None and parsed_user.origin == "user"


def _has_systemd() -> bool:
    try:
        import systemd.journal  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_has_systemd(), reason="systemd-python is installed here")
def test_journald_without_systemd_python_says_so() -> None:
    with pytest.raises(ReaderError) as exc:
        JournalReader()
    assert exc.value.reason == "unavailable"
    assert "systemd-python" in str(exc.value)


@pytest.mark.skipif(_has_systemd(), reason="systemd-python is installed here")
def test_auto_explains_why_nothing_works(tmp_path: Path) -> None:
    cfg = Config(
        paths=PathsConfig(kmsg=str(tmp_path / "missing")),
        sources=SourcesConfig(kmsg=KmsgConfig(backend="auto")),
    )
    with pytest.raises(ReaderError) as exc:
        open_reader("auto", cfg, BOOT, None)
    msg = str(exc.value)
    assert exc.value.reason == "no_backend"
    assert "missing does not exist" in msg and "systemd-python" in msg


@pytest.mark.skipif(not _has_systemd(), reason="needs systemd-python")
def test_auto_falls_back_to_the_journal(tmp_path: Path) -> None:
    cfg = Config(paths=PathsConfig(kmsg=str(tmp_path / "missing")))
    reader = open_reader("auto", cfg, BOOT, None)
    try:
        assert reader.name == "journald"
        t0 = time.monotonic()
        lines = reader.read(0.2)
        assert time.monotonic() - t0 < 2.0
        assert all(line.cursor.startswith("journal:") for line in lines)
    finally:
        reader.close()


def test_auto_prefers_kmsg(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(rec(1))
    cfg = Config(paths=PathsConfig(kmsg=str(path)))
    reader = open_reader("auto", cfg, BOOT, f"kmsg:{BOOT}:0")
    try:
        assert reader.name == "kmsg"
        assert seqs(reader.read(0.0)) == [1]
    finally:
        reader.close()
