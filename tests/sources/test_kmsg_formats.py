"""The same real driver records in every log format a user has (tests/fixtures/kmsg/formats).

Each positive file holds nine real Xid/SXid records (and one ordinary driver
line) in one format: dmesg and dmesg -T in six locales, journalctl's short,
precise, ISO, full, monotonic, unix, cat, json, export and verbose outputs
(the short ones in six locales), rsyslog's RFC 3164 and RFC 5424 files, CRI
and Docker container logs, fluent-bit, Vector, Loki and Elasticsearch JSON,
node-problem-detector's log and events, notifications quoting the record.
Every one must yield the nine records exactly, through the parser, `xid scan`,
the file source and (for the export format) the journal source; the command
lines of negatives.txt must yield nothing. Issue 29: the line-start rule
read none of the localised, CRI, JSON, NPD or notification files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.cli import dispatch
from gpuwatchd.cli import xid as xidcmd
from gpuwatchd.clock import FakeClock
from gpuwatchd.config import KmsgConfig, SourcesConfig
from gpuwatchd.model import Event
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg import prefix
from gpuwatchd.sources.kmsg.parse import SXID, XID, KmsgParser, parse_line
from gpuwatchd.sources.kmsg.source import KmsgSource
from tests.sources.kmsg_files import kmsg_config

FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "kmsg" / "formats"
EXPECTED: list[dict[str, Any]] = json.loads((FORMATS / "expected.json").read_text())
NEGATIVES = FORMATS / "negatives.txt"
POSITIVES = sorted(
    p for p in FORMATS.iterdir() if p.suffix in (".txt", ".log", ".jsonl") and p != NEGATIVES
)
KEYS = ("kind", "code", "pci_bus_id", "pid", "process")
# Formats that say who wrote the line; the others (dmesg, bare messages) cannot.
SAYS_KERNEL = ("journalctl-short", "journalctl-json", "rsyslog", "rfc", "dmesg-x", "vector")


def test_the_corpus_is_all_there() -> None:
    names = {p.name for p in POSITIVES}
    assert len(POSITIVES) >= 50 and len(EXPECTED) == 9
    for loc in ("C", "de_DE", "fr_FR", "ja_JP", "zh_CN", "ko_KR"):
        assert {f"journalctl-short-{loc}.txt", f"dmesg-T-{loc}.txt"} <= names
    assert "月" in (FORMATS / "journalctl-short-ja_JP.txt").read_text()
    assert "mars" in (FORMATS / "journalctl-short-fr_FR.txt").read_text()
    assert "Mär" in (FORMATS / "rsyslog-traditional-de_DE.txt").read_text()


def _parsed(path: Path) -> list[Any]:
    parser = KmsgParser(year=2026)
    out = []
    for line in path.read_text().splitlines():
        out += parser.feed(line)
    out += parser.flush()
    return [r for r in out if r.kind in (XID, SXID)]


@pytest.mark.parametrize("path", POSITIVES, ids=[p.name for p in POSITIVES])
def test_every_format_parses_every_record_exactly(path: Path) -> None:
    got = _parsed(path)
    assert [{k: getattr(r, k) for k in KEYS} for r in got] == EXPECTED
    assert all(r.origin != "user" for r in got)
    if path.name.startswith(SAYS_KERNEL):
        assert {r.origin for r in got} == {"kernel"}


@pytest.mark.parametrize(
    ("name", "wall", "boot"),
    [
        ("journalctl-short-ja_JP.txt", 1772704800.0, None),  # " 3月 05 10:00:00", read in UTC
        ("journalctl-json.txt", 1772704800.494739, 48.494739),
        ("cri-dmesg-w.log", 1772704800.494739, 48.494739),
        ("rfc5424.txt", 1772704800.494739, None),
    ],
)
def test_times_come_from_the_format(
    name: str, wall: float, boot: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    prefix._local_hour.cache_clear()  # hours converted in the machine's own zone
    try:
        first = _parsed(FORMATS / name)[0]
    finally:
        monkeypatch.undo()
        time.tzset()
        prefix._local_hour.cache_clear()
    assert first.wall_time == pytest.approx(wall, abs=1e-3)
    assert first.boot_seconds == (pytest.approx(boot) if boot is not None else None)


def test_driver_text_in_a_command_line_is_never_a_report() -> None:
    lines = NEGATIVES.read_text().splitlines()
    assert len(lines) == 9 * 17
    assert [line for line in lines if parse_line(line, year=2026) is not None] == []
    parser = KmsgParser(year=2026)
    out = [r for line in lines for r in parser.feed(line)] + parser.flush()
    assert out == []


def _scan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="gpuwatchd")
    xidcmd.register(parser.add_subparsers())
    args = parser.parse_args(["xid", "scan", *argv, "--json"])
    assert dispatch(args) == 0
    out, _ = capsys.readouterr()
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize("path", POSITIVES, ids=[p.name for p in POSITIVES])
def test_xid_scan_reads_every_format(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reports = _scan([str(path)], capsys)
    assert [{k: r[k] for k in KEYS} for r in reports] == EXPECTED


def test_xid_scan_finds_nothing_in_the_command_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _scan([str(NEGATIVES)], capsys) == []
    parser = argparse.ArgumentParser(prog="gpuwatchd")
    xidcmd.register(parser.add_subparsers())
    args = parser.parse_args(["xid", "scan", str(NEGATIVES)])
    dispatch(args)
    out, _ = capsys.readouterr()
    assert "unreadable" not in out.lower() and "unparsed" not in out.lower()


def _file_source_events(tmp_path: Path, log: Path) -> list[Event]:
    cfg = kmsg_config(tmp_path, tmp_path / "unused")
    cfg = replace(cfg, sources=SourcesConfig(kmsg=KmsgConfig(backend="file", file=str(log))))
    src = KmsgSource(cfg, SourceContext(clock=FakeClock()), wait=0.05, sleep=lambda s: None)
    out: list[Event] = []
    for _ in range(3):  # a held SXid report leaves on a later poll
        out += [e for e in src.poll(0.0) if isinstance(e, Event)]
    return out


def _event_fields(e: Event) -> dict[str, Any]:
    return {
        "kind": e.kind,
        "code": e.code,
        "pci_bus_id": e.pci_bus_id,
        "pid": e.xid.attribution.pid if e.xid is not None else None,
        "process": e.xid.attribution.process if e.xid is not None else "",
    }


def test_the_file_source_reads_every_format(tmp_path: Path) -> None:
    log = tmp_path / "all-formats.log"
    log.write_text("".join(p.read_text() for p in POSITIVES))
    got = [_event_fields(e) for e in _file_source_events(tmp_path, log)]
    assert got == EXPECTED * len(POSITIVES)


def test_the_file_source_reports_nothing_from_the_command_lines(tmp_path: Path) -> None:
    assert _file_source_events(tmp_path, NEGATIVES) == []


REMOTE = shutil.which("systemd-journal-remote") or next(
    (p for p in ("/lib/systemd/systemd-journal-remote", "/usr/lib/systemd/systemd-journal-remote")
     if Path(p).exists()),
    None,
)  # fmt: skip


@pytest.mark.skipif(REMOTE is None, reason="systemd-journal-remote not installed")
def test_the_journal_source_reads_the_exported_journal(tmp_path: Path) -> None:
    """journalctl -o export is the journal's own interchange format: written back into
    journal files (as this boot's), the journald backend reads the nine records."""
    pytest.importorskip("systemd.journal")
    from gpuwatchd.sources.kmsg.journal import JournalReader

    assert REMOTE is not None
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    export = "".join(
        f"_BOOT_ID={boot.replace('-', '')}\n" if line.startswith("_BOOT_ID=") else line
        for line in (FORMATS / "journalctl-export.txt").read_text().splitlines(keepends=True)
    )
    jdir = tmp_path / "journal"
    jdir.mkdir()
    res = subprocess.run(
        [REMOTE, f"--output={jdir / 'system.journal'}", "--compress=no", "-"],
        input=export.encode(), capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    boot_file = tmp_path / "boot_id"
    boot_file.write_text(boot + "\n")
    cfg = kmsg_config(tmp_path, tmp_path / "unused")
    cfg = replace(
        cfg,
        paths=replace(cfg.paths, boot_id=str(boot_file)),
        sources=SourcesConfig(kmsg=KmsgConfig(backend="journald")),
    )
    src = KmsgSource(
        cfg,
        SourceContext(clock=FakeClock()),
        opener=lambda cur: JournalReader(None, path=str(jdir)),
        sleep=lambda s: None,
    )
    got: list[Event] = []
    for _ in range(3):
        got += [e for e in src.poll(0.0) if isinstance(e, Event)]
    assert [_event_fields(e) for e in got] == EXPECTED
    assert {e.attr("origin") for e in got} == {"kernel"}
